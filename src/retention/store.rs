//! The retention record: when each mirrored image was last in use, kept
//! at the target so that a restart or a new leader never makes an image
//! look unused earlier than it is, and so that it grows with the target
//! without a cap.
//!
//! It is an artifact in the usage records' repository, in their sharded
//! format ([`super::shards`]), under the tag [`tag`]: `_retention`, or
//! `_retention.<cluster>` with sharing, one per cluster that runs
//! retention. A cluster name never starts with `_`, so the tag is never
//! read as a cluster's usage record. Keys are target
//! `registry/repository@digest`; an image in use at the last pass, or
//! first seen in it, carries no time of its own, so a pass rewrites only
//! the shards whose images changed.
//!
//! Earlier installs kept the record in the ConfigMap [`CONFIG_MAP`]. When
//! the target holds no record yet, that ConfigMap is read once and carried
//! on, so an upgrade never makes an image look unused earlier; it is never
//! written again.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tracing::{info, warn};

use super::RetentionError;
use super::clusters::{ClusterRecord, MAX_BYTES, MAX_ENTRIES, Present, Records};
use crate::mirror::Mirror;
use crate::reference::Digest;
use crate::registry::delete::Deleted;

/// The ConfigMap that held the record before it moved to the target.
pub const CONFIG_MAP: &str = "pinswap-retention";
/// Its data key.
pub const KEY: &str = "record.json";
/// The most images the record tracks, about a million.
pub const MAX_IMAGES: usize = MAX_ENTRIES;

/// The record's tag in the usage records' repository.
pub fn tag(cluster: Option<&str>) -> String {
    match cluster {
        Some(c) => format!("_retention.{c}"),
        None => "_retention".to_owned(),
    }
}

/// When tracking began and when each image was last in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When the record was created (or, read from the target, last
    /// written).
    pub since: Timestamp,
    /// Target `registry/repository@digest` → last seen in use (or first
    /// seen at all).
    pub images: BTreeMap<String, Timestamp>,
}

impl Record {
    /// An empty record started at `now`.
    pub fn new(now: Timestamp) -> Self {
        Self {
            since: now,
            images: BTreeMap::new(),
        }
    }

    /// The JSON size this record takes, about.
    pub fn bytes(&self) -> usize {
        self.images.keys().map(|k| entry_bytes(k)).sum::<usize>() + 64
    }

    /// Sets `image` last seen at `now`, unless a later time is recorded.
    /// A new entry is added only within the caps; returns whether `image`
    /// is tracked.
    pub fn seen(&mut self, image: &str, now: Timestamp, bytes: &mut usize) -> bool {
        if let Some(t) = self.images.get_mut(image) {
            if *t < now {
                *t = now;
            }
            return true;
        }
        let add = entry_bytes(image);
        if self.images.len() >= MAX_IMAGES || *bytes + add > MAX_BYTES {
            return false;
        }
        *bytes += add;
        self.images.insert(image.to_owned(), now);
        true
    }
}

/// The JSON bytes of one entry: its key, a time, quotes and separators.
fn entry_bytes(key: &str) -> usize {
    key.len() + 40
}

/// The record at the target, and the ConfigMap it moved from.
pub struct Store {
    api: Api<ConfigMap>,
    namespace: String,
    at: Option<At>,
    kept: Mutex<Kept>,
}

/// Where at the target.
struct At {
    mirror: Arc<Mirror>,
    tag: String,
    /// How recent the ConfigMap's newest entry must be for it to be
    /// carried on: two passes.
    fresh_for: std::time::Duration,
}

/// What this process knows of the record at the target.
#[derive(Default)]
struct Kept {
    /// The version last read or written here.
    digest: Option<Digest>,
    /// The blobs the target holds.
    present: Present,
    /// Shards read before.
    cache: Arc<super::shards::Cache>,
    /// The target refused to delete a version before: it keeps them all,
    /// and is not asked again in this process.
    keeps_versions: bool,
}

impl Store {
    /// A record whose earlier ConfigMap, [`CONFIG_MAP`], is in `namespace`.
    /// [`Store::at`] says where at the target it is kept.
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            at: None,
            kept: Mutex::default(),
        }
    }

    /// Kept at `mirror`'s target under `tag`, by passes every `interval`.
    pub(crate) fn place(
        &mut self,
        mirror: Arc<Mirror>,
        tag: String,
        interval: std::time::Duration,
    ) {
        self.at = Some(At {
            mirror,
            tag,
            fresh_for: interval.saturating_mul(2),
        });
        *self.kept.get_mut() = Kept::default();
    }

    /// A replica that begins to lead takes the record as it finds it:
    /// another replica of this install may have written it meanwhile.
    pub(crate) async fn lead(&self) {
        let mut kept = self.kept.lock().await;
        kept.digest = None;
        kept.present = Present::default();
    }

    fn at_target(&self) -> &At {
        self.at
            .as_ref()
            .expect("a retention store is placed at its target")
    }

    async fn records(&self, kept: &Kept) -> Result<Records, RetentionError> {
        Ok(Records::of(&self.at_target().mirror)
            .await
            .map_err(RetentionError::Store)?
            .with_cache(kept.cache.clone()))
    }

    /// The record as stored, `None` when there is none yet (at the target
    /// nor in the ConfigMap it moved from).
    ///
    /// # Errors
    /// [`RetentionError::Store`] when the target cannot be read;
    /// [`RetentionError::Record`] when the ConfigMap cannot.
    pub async fn read(&self) -> Result<Option<Record>, RetentionError> {
        let kept = self.kept.lock().await;
        let records = self.records(&kept).await?;
        match records
            .read_at(&self.at_target().tag)
            .await
            .map_err(RetentionError::Store)?
        {
            Some(r) => Ok(Some(of_stored(r.record))),
            None => self.legacy(Timestamp::now()).await,
        }
    }

    /// The record the ConfigMap holds, if any, and only while an earlier
    /// install still wrote it: its newest entry (the last pass's time for
    /// every image in use then) within two passes of `now`. A ConfigMap
    /// left behind after the record moved holds times that stopped at the
    /// move: carried on later (the tag removed, sharing turned on or off),
    /// they would make an image used since look unused since then.
    async fn legacy(&self, now: Timestamp) -> Result<Option<Record>, RetentionError> {
        let cm = self
            .api
            .get_opt(CONFIG_MAP)
            .await
            .map_err(|e| RetentionError::Record {
                namespace: self.namespace.clone(),
                name: CONFIG_MAP.into(),
                source: e,
            })?;
        let Some(record) = cm.map(|cm| self.parse(&cm, now)) else {
            return Ok(None);
        };
        let newest = record
            .images
            .values()
            .max()
            .copied()
            .unwrap_or(record.since);
        let fresh_for = self
            .at
            .as_ref()
            .map_or(std::time::Duration::ZERO, |a| a.fresh_for);
        if super::clusters::age(now, newest) > fresh_for {
            warn!(configmap = %format!("{}/{CONFIG_MAP}", self.namespace), newest = %newest, "the retention record's ConfigMap was last written too long ago to carry on: tracking starts again from now (delete the ConfigMap; it is no longer written)");
            return Ok(None);
        }
        Ok(Some(record))
    }

    /// The record in `cm`; one that cannot be read starts again at `now`,
    /// which makes every image look used now: later, never earlier.
    fn parse(&self, cm: &ConfigMap, now: Timestamp) -> Record {
        let text = cm.data.as_ref().and_then(|d| d.get(KEY));
        match text.map(|t| serde_json::from_str::<Record>(t)) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                warn!(configmap = %format!("{}/{CONFIG_MAP}", self.namespace), error = %e, "the retention record cannot be read; starting it again (every image counts as used now)");
                Record::new(now)
            }
            None => Record::new(now),
        }
    }

    /// Reads the record (from the ConfigMap when the target holds none; a
    /// new one starts at `now`), lets `apply` change it, and writes it to
    /// the target: the shards that changed, then its manifest, then the
    /// removal of the version before. The tag must still name the version
    /// read: one that moved is another writer's, and nothing is written.
    /// Returns the record written.
    ///
    /// # Errors
    /// [`RetentionError::Store`] when the target cannot be read or
    /// written; [`RetentionError::Record`] when the ConfigMap cannot be
    /// read; [`RetentionError::Moved`] when another writer wrote the tag.
    pub async fn update(
        &self,
        now: Timestamp,
        apply: impl FnOnce(&mut Record),
    ) -> Result<Record, RetentionError> {
        let mut kept = self.kept.lock().await;
        let result = self.update_locked(&mut kept, now, apply).await;
        if let Err(e) = &result {
            // Read everything again at the next pass; a moved tag stays
            // another's until this process restarts or the tag is removed.
            if !matches!(e, RetentionError::Moved { .. }) {
                kept.digest = None;
            }
            kept.present = Present::default();
        }
        result
    }

    async fn update_locked(
        &self,
        kept: &mut Kept,
        now: Timestamp,
        apply: impl FnOnce(&mut Record),
    ) -> Result<Record, RetentionError> {
        let tag = &self.at_target().tag;
        let records = self.records(kept).await?;
        let read = records.read_at(tag).await.map_err(RetentionError::Store)?;
        // One writer per tag: a version other than the one this process
        // last wrote or read is another's.
        if let (Some(last), Some(r)) = (&kept.digest, &read)
            && *last != r.digest
        {
            return Err(RetentionError::Moved {
                tag: tag.clone(),
                found: r.digest.to_string(),
                read: last.to_string(),
            });
        }
        let (mut record, before) = match read {
            Some(r) => {
                kept.present.layers = r.layers.iter().cloned().collect();
                (of_stored(r.record), Some(r.digest))
            }
            None => {
                // Nothing there (a removed tag, a collected registry):
                // every blob is pushed again.
                kept.present = Present::default();
                let legacy = self.legacy(now).await?;
                if let Some(l) = &legacy {
                    info!(configmap = %format!("{}/{CONFIG_MAP}", self.namespace), images = l.images.len(), tag = %tag, "the retention record moves from its ConfigMap to the target; the ConfigMap is no longer written");
                }
                (legacy.unwrap_or_else(|| Record::new(now)), None)
            }
        };
        kept.digest = before.clone();
        apply(&mut record);
        let stored = ClusterRecord {
            cluster: tag.clone(),
            updated: now,
            complete: true,
            in_use: record.images.values().filter(|t| **t >= now).count(),
            images: record.images.clone(),
            quotas: Vec::new(),
        };
        // One writer per tag: the leader. A tag moved since it was read is
        // another's (a second install under this cluster name), and left
        // as it is.
        let current = records.current(tag).await.map_err(RetentionError::Store)?;
        if current != before {
            return Err(RetentionError::Moved {
                tag: tag.clone(),
                found: current.map_or_else(|| "nothing".into(), |d| d.to_string()),
                read: before.map_or_else(|| "nothing".into(), |d| d.to_string()),
            });
        }
        let (_, digest) = records
            .publish(&stored, &mut kept.present)
            .await
            .map_err(RetentionError::Store)?;
        kept.digest = Some(digest.clone());
        // Only the version now at the target stays cached.
        kept.cache.retain(&kept.present.layers);
        if let Some(old) = before.filter(|d| *d != digest && !kept.keeps_versions) {
            // The version read, which this tag named until now: this
            // install's record. A registry that keeps it only costs space.
            match records.remove_version(&old).await {
                Ok(Deleted::Accepted | Deleted::Absent) => {}
                Ok(Deleted::Unsupported) => {
                    kept.keeps_versions = true;
                    warn!(tag = %tag, "the target registry refuses deletes, so it keeps a version of the retention record per pass (a manifest of a few KB; the shards are shared); remove the untagged manifests of pinswap-usage by hand (docs/operations.md#several-clusters-one-mirror)");
                }
                Err(e) => {
                    warn!(tag = %tag, version = %old, error = %e, "the retention record's version before could not be removed; it stays at the target")
                }
            }
        }
        Ok(record)
    }
}

/// A record as the target holds it.
fn of_stored(r: ClusterRecord) -> Record {
    Record {
        since: r.updated,
        images: r.images,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn last_use_only_moves_forward() {
        let mut r = Record::new(at(100));
        let mut bytes = r.bytes();
        assert!(r.seen("m/a@sha256:1", at(200), &mut bytes));
        assert!(r.seen("m/a@sha256:1", at(150), &mut bytes));
        assert_eq!(r.images["m/a@sha256:1"], at(200));
        assert!(r.seen("m/a@sha256:1", at(300), &mut bytes));
        assert_eq!(r.images["m/a@sha256:1"], at(300));
    }

    #[test]
    fn tags_are_never_cluster_names() {
        for c in [None, Some("a"), Some("prod.eu-1")] {
            let t = tag(c);
            assert!(crate::config::cluster_name_problem(&t).is_some(), "{t}");
            assert!(crate::reference::Reference::parse(&format!("r.io/x:{t}")).is_ok());
        }
    }

    #[test]
    fn the_record_holds_a_million_images() {
        const { assert!(MAX_IMAGES >= 1 << 20) };
        let mut r = Record::new(at(0));
        let mut bytes = r.bytes();
        for i in 0..20_000 {
            assert!(r.seen(&format!("m/a@sha256:{i:064x}"), at(1), &mut bytes));
        }
    }
}
