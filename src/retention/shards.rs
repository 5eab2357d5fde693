//! A usage record split into shards, one blob each, so that a record of
//! any size is rewritten only where it changed and read again only where
//! it changed (docs/operations.md#sizing-a-fleet).
//!
//! An entry goes to shard `h mod k`, where `h` is the first 8 bytes of
//! the SHA-256 of its key and `k`, the shard count, is the least power of
//! two that keeps the mean shard at [`SHARD_ENTRIES`] or fewer. Keys,
//! not repositories, are hashed: one repository with many digests would
//! otherwise make one shard as large as the record. When the count
//! doubles, each shard splits in two, once.
//!
//! An entry in use when the record is written carries no time: its last
//! use is the record's `updated`, which the manifest holds. A shard then
//! changes only when what it names changes, not at every publication.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use crate::reference::Digest;

/// The most entries a shard holds on average.
pub const SHARD_ENTRIES: usize = 256;
/// The most shards a record has: with [`SHARD_ENTRIES`], about a million
/// entries.
pub const MAX_SHARDS: usize = 4096;
/// The most bytes of one shard read.
pub const MAX_SHARD_BYTES: u64 = 1024 * 1024;
/// The shards' layer media type.
pub const MEDIA_TYPE: &str = "application/vnd.pinswap.usage.shard.v1+json";

/// One shard as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Shard {
    /// Its index.
    pub shard: usize,
    /// How many shards the record has.
    pub of: usize,
    /// Keys in use when the record was written, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_use: Vec<String>,
    /// Keys no longer in use → their last use.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub last: BTreeMap<String, Timestamp>,
}

/// The shard count for `entries` entries (a power of two, at least 1).
pub fn count(entries: usize) -> usize {
    entries
        .div_ceil(SHARD_ENTRIES)
        .max(1)
        .next_power_of_two()
        .min(MAX_SHARDS)
}

/// The shard `key` goes to among `of` (a power of two).
pub fn of(key: &str, of: usize) -> usize {
    let h = sha2::Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&h[..8]);
    (u64::from_be_bytes(first) % of as u64) as usize
}

/// `images` (key → last use) as shards, for a record written at
/// `updated`: entries used at `updated` or later are in use. Each shard
/// as its JSON bytes.
pub fn split(images: &BTreeMap<String, Timestamp>, updated: Timestamp) -> Vec<Bytes> {
    let k = count(images.len());
    let mut shards: Vec<Shard> = (0..k)
        .map(|i| Shard {
            shard: i,
            of: k,
            in_use: Vec::new(),
            last: BTreeMap::new(),
        })
        .collect();
    for (key, t) in images {
        let s = &mut shards[of(key, k)];
        match *t >= updated {
            true => s.in_use.push(key.clone()),
            false => {
                s.last.insert(key.clone(), *t);
            }
        }
    }
    shards
        .iter()
        .map(|s| Bytes::from(serde_json::to_vec(s).expect("a shard serialises")))
        .collect()
}

/// The entries of `shards`, in order, for a record written at `updated`:
/// in-use entries last used at `updated`.
///
/// # Errors
/// Why the shards are not one record's: out of order, of different
/// counts, or holding a key that belongs to another shard.
pub fn join(
    shards: &[Arc<Shard>],
    updated: Timestamp,
) -> Result<BTreeMap<String, Timestamp>, String> {
    let k = shards.len();
    let mut out = BTreeMap::new();
    for (i, s) in shards.iter().enumerate() {
        if s.shard != i || s.of != k {
            return Err(format!(
                "layer {i} is shard {} of {}, expected {i} of {k}",
                s.shard, s.of
            ));
        }
        let keys = s.in_use.iter().chain(s.last.keys());
        if let Some(stray) = keys.into_iter().find(|key| of(key, k) != i) {
            return Err(format!(
                "shard {i} holds {:?}, which belongs to shard {}",
                crate::logsafe::clip(stray, 120),
                of(stray, k)
            ));
        }
        for key in &s.in_use {
            out.insert(key.clone(), updated);
        }
        for (key, t) in &s.last {
            // A time past `updated` counts as in use then: later, never
            // earlier.
            out.entry(key.clone()).or_insert((*t).min(updated));
        }
    }
    Ok(out)
}

/// Parses one shard's bytes.
///
/// # Errors
/// Why it is not a shard.
pub fn parse(bytes: &[u8]) -> Result<Shard, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("a layer is not a usage shard: {e}"))
}

/// Shards read before, by digest: a reader fetches only the shards whose
/// digest it has not seen. Its owner trims it to what the last read (or
/// write) named.
#[derive(Default)]
pub struct Cache {
    shards: Mutex<HashMap<Digest, Arc<Shard>>>,
}

impl Cache {
    /// The shard of `digest`, if read before.
    pub fn get(&self, digest: &Digest) -> Option<Arc<Shard>> {
        self.shards
            .lock()
            .expect("not poisoned")
            .get(digest)
            .cloned()
    }

    /// Keeps `shard`, read under `digest`.
    pub fn put(&self, digest: Digest, shard: Arc<Shard>) {
        self.shards
            .lock()
            .expect("not poisoned")
            .insert(digest, shard);
    }

    /// Drops every shard but `live`'s.
    pub fn retain(&self, live: &HashSet<Digest>) {
        self.shards
            .lock()
            .expect("not poisoned")
            .retain(|d, _| live.contains(d));
    }

    /// How many shards it holds.
    pub fn len(&self) -> usize {
        self.shards.lock().expect("not poisoned").len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn key(i: usize) -> String {
        format!("m/docker.io/app{}@sha256:{i:064x}", i % 7)
    }

    fn parsed(bytes: &[Bytes]) -> Vec<Arc<Shard>> {
        bytes.iter().map(|b| Arc::new(parse(b).unwrap())).collect()
    }

    #[test]
    fn a_record_round_trips_through_its_shards() {
        let updated = at(1000);
        let images: BTreeMap<String, Timestamp> = (0..1000)
            .map(|i| {
                (
                    key(i),
                    if i % 3 == 0 {
                        at(500 + (i % 400) as i64)
                    } else {
                        updated
                    },
                )
            })
            .collect();
        let shards = split(&images, updated);
        assert_eq!(shards.len(), 4);
        assert_eq!(join(&parsed(&shards), updated).unwrap(), images);
        // Balanced enough that no shard is twice the mean.
        for s in parsed(&shards) {
            let n = s.in_use.len() + s.last.len();
            assert!((125..=375).contains(&n), "{n}");
        }
    }

    #[test]
    fn one_new_entry_changes_one_shard_and_a_new_time_none() {
        let images: BTreeMap<String, Timestamp> = (0..2000).map(|i| (key(i), at(10))).collect();
        let before = split(&images, at(10));
        // Published again later with the same images in use.
        let later: BTreeMap<String, Timestamp> =
            images.keys().map(|k| (k.clone(), at(20))).collect();
        assert_eq!(split(&later, at(20)), before);
        let mut more = later.clone();
        more.insert(key(5000), at(20));
        let after = split(&more, at(20));
        assert_eq!(after.len(), before.len());
        let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert_eq!(changed, 1);
        let bytes = after.iter().map(Bytes::len).max().unwrap();
        assert!(bytes < 64 * 1024, "{bytes}");
    }

    #[test]
    fn shards_that_are_not_one_records_are_refused() {
        let images: BTreeMap<String, Timestamp> = (0..600).map(|i| (key(i), at(10))).collect();
        let mut shards = parsed(&split(&images, at(10)));
        shards.swap(0, 1);
        assert!(
            join(&shards, at(10))
                .unwrap_err()
                .contains("expected 0 of 4")
        );
        let mut shards = parsed(&split(&images, at(10)));
        let mut s = (*shards[0]).clone();
        s.in_use
            .push((0..).map(key).find(|k| of(k, 4) == 1).unwrap());
        shards[0] = Arc::new(s);
        assert!(
            join(&shards, at(10))
                .unwrap_err()
                .contains("belongs to shard 1")
        );
        assert!(parse(b"{\"shard\":0,\"of\":1,\"extra\":1}").is_err());
    }

    #[test]
    fn the_count_doubles_with_the_entries_up_to_its_bound() {
        assert_eq!(count(0), 1);
        assert_eq!(count(SHARD_ENTRIES), 1);
        assert_eq!(count(SHARD_ENTRIES + 1), 2);
        assert_eq!(count(100_000), 512);
        assert_eq!(count(usize::MAX / 2), MAX_SHARDS);
    }
}
