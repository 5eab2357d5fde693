//! Publishing this cluster's usage record ([`super::clusters`]) on the
//! leader: when an image new to the record is in use (looked for every
//! `sharing.checkEvery`), else every `sharing.interval`, and before each
//! retention pass. Runs whether or not this cluster's retention is on:
//! another cluster's retention reads it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use tokio::sync::{Mutex, watch};
use tracing::{info, warn};

use super::clusters::{
    ClusterRecord, ClustersError, MAX_BYTES, MAX_ENTRIES, Records, age, entry_key,
};
use super::{InUse, InUseSource};
use crate::metrics::Metrics;
use crate::mirror::Mirror;

/// What [`Publisher::publish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// The watches have not listed everything: nothing published.
    NotSynced,
    /// Nothing new, and the record is younger than `sharing.interval`.
    Unchanged,
    /// Written, with this many entries and layer bytes.
    Written {
        /// Entries.
        entries: usize,
        /// Layer bytes.
        bytes: usize,
    },
}

/// This cluster's record and how to publish it.
pub struct Publisher {
    mirror: Arc<Mirror>,
    cluster: String,
    interval: Duration,
    check_every: Duration,
    stale_after: Duration,
    keep_for: Duration,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// What was last published (or read back at the first round).
    record: Option<ClusterRecord>,
    /// When it was last written.
    written: Option<Instant>,
    /// The record was read back from the target.
    loaded: bool,
    /// The target holds the empty config blob.
    config_present: bool,
}

impl Publisher {
    /// The publisher of `cluster`'s record at `mirror`'s target, under the
    /// `sharing` settings.
    pub fn new(mirror: Arc<Mirror>, cluster: &str, sharing: &crate::config::Sharing) -> Self {
        let metrics = mirror.metrics().clone();
        metrics.sharing.cluster(cluster);
        Self {
            mirror,
            cluster: cluster.to_owned(),
            interval: sharing.interval,
            check_every: sharing.check_every,
            stale_after: sharing.stale_after,
            keep_for: sharing.keep_for,
            metrics,
            state: Mutex::new(State::default()),
        }
    }

    /// This cluster's name.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// How long retention waits between choosing what to remove and
    /// reading the records again: two `sharing.checkEvery`, so that a
    /// cluster that started to use a candidate meanwhile has published it.
    pub fn settle(&self) -> Duration {
        self.check_every * 2
    }

    /// `sharing.staleAfter`.
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The records of every other cluster, each counted in the metrics.
    ///
    /// # Errors
    /// As [`Records::read_all`]; [`ClustersError::Incomplete`] for a
    /// record that holds only part of what its cluster uses.
    pub async fn others(&self) -> Result<Vec<ClusterRecord>, ClustersError> {
        let records = Records::of(&self.mirror).await?;
        let all = records.read_all(Some(&self.cluster)).await?;
        let now = Timestamp::now();
        for r in &all {
            self.metrics.sharing.record(
                &r.cluster,
                r.images.len(),
                r.updated.as_second(),
                r.is_stale(now, self.stale_after),
            );
        }
        if let Some(r) = all.iter().find(|r| !r.complete) {
            return Err(ClustersError::Incomplete {
                cluster: r.cluster.clone(),
                entries: r.in_use,
            });
        }
        Ok(all)
    }

    /// Publishes this cluster's record when `in_use` names an image new to
    /// it, when it is older than `sharing.interval`, or with `force`.
    /// Images in use are last used now; others keep their time and are
    /// dropped past `sharing.keepFor`.
    ///
    /// # Errors
    /// [`ClustersError`] when the record could not be read back or
    /// written, or [`ClustersError::Incomplete`] when this cluster uses
    /// more images than a record holds (an incomplete record is published
    /// then, so that every cluster's retention stops).
    pub async fn publish(&self, in_use: &InUse, force: bool) -> Result<Published, ClustersError> {
        if !in_use.synced {
            return Ok(Published::NotSynced);
        }
        let mut state = self.state.lock().await;
        let records = Records::of(&self.mirror).await?;
        if !state.loaded {
            // This cluster's last use survives the loss of the cluster
            // (or of its ConfigMap): what the target holds is carried on.
            state.record = records.read(&self.cluster).await?;
            state.loaded = true;
        }
        let target = self.mirror.target();
        let mut keys: Vec<String> = in_use
            .images
            .iter()
            .filter_map(|i| {
                let mapped = match target.contains(i) {
                    true => i.clone(),
                    false => target.map(i).ok()?,
                };
                entry_key(target, &mapped)
            })
            .collect();
        keys.sort();
        keys.dedup();
        let known = |k: &String| {
            state
                .record
                .as_ref()
                .is_some_and(|r| r.images.contains_key(k))
        };
        let new = keys.iter().any(|k| !known(k));
        let due = state.written.is_none_or(|w| w.elapsed() >= self.interval);
        if !(new || due || force) {
            return Ok(Published::Unchanged);
        }
        let now = Timestamp::now();
        let mut images: BTreeMap<String, Timestamp> = state
            .record
            .as_ref()
            .map(|r| r.images.clone())
            .unwrap_or_default();
        images.retain(|_, t| age(now, *t) <= self.keep_for);
        let in_use_count = keys.len();
        for k in keys {
            images.insert(k, now);
        }
        let record = bounded(&self.cluster, now, images, in_use_count);
        let complete = record.complete;
        match records.publish(&record, &mut state.config_present).await {
            Ok(bytes) => {
                let entries = record.images.len();
                Metrics::outcome(
                    &self.metrics.sharing.publishes,
                    if complete { "published" } else { "incomplete" },
                );
                self.metrics.sharing.record(
                    &self.cluster,
                    entries,
                    record.updated.as_second(),
                    false,
                );
                if new {
                    info!(cluster = %self.cluster, entries, bytes, "usage record published: an image new to it is in use");
                }
                state.record = Some(record);
                state.written = Some(Instant::now());
                if !complete {
                    return Err(ClustersError::Incomplete {
                        cluster: self.cluster.clone(),
                        entries: in_use_count,
                    });
                }
                Ok(Published::Written { entries, bytes })
            }
            Err(e) => {
                Metrics::outcome(&self.metrics.sharing.publishes, "failed");
                Err(e)
            }
        }
    }
}

/// A record within [`MAX_ENTRIES`] and [`MAX_BYTES`]: past either, an
/// incomplete one holding none of the entries (a part would mislead
/// nobody, as nothing is removed while one is incomplete, but it would
/// cost bytes on every read).
fn bounded(
    cluster: &str,
    now: Timestamp,
    images: BTreeMap<String, Timestamp>,
    in_use: usize,
) -> ClusterRecord {
    let bytes: usize = images.keys().map(|k| k.len() + 40).sum();
    let complete = images.len() <= MAX_ENTRIES && bytes + 256 <= MAX_BYTES;
    ClusterRecord {
        cluster: cluster.to_owned(),
        updated: now,
        complete,
        in_use: in_use.max(if complete { 0 } else { images.len() }),
        images: if complete { images } else { BTreeMap::new() },
    }
}

/// Publishes while this replica leads (`leader`): every
/// `sharing.checkEvery` it looks for new images, and writes as [`Publisher::publish`] says.
pub async fn run(
    publisher: Arc<Publisher>,
    in_use: InUseSource,
    mut leader: watch::Receiver<bool>,
) {
    loop {
        while !*leader.borrow_and_update() {
            if leader.changed().await.is_err() {
                return;
            }
        }
        info!(cluster = %publisher.cluster, "leading: this cluster's usage record is published");
        let mut failing = false;
        loop {
            let lost = async {
                while *leader.borrow_and_update() {
                    if leader.changed().await.is_err() {
                        return;
                    }
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(publisher.check_every) => {}
                _ = lost => break,
            }
            if !*leader.borrow() {
                break;
            }
            match publisher.publish(&in_use(), false).await {
                Ok(_) => failing = false,
                Err(e) => {
                    // Once per failing stretch: it is retried every round.
                    if !failing {
                        warn!(cluster = %publisher.cluster, error = %e, "the usage record could not be published; other clusters' retention sees this cluster's use as of its last record");
                    }
                    failing = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_past_its_bounds_is_incomplete_and_empty() {
        let now = Timestamp::from_second(1).unwrap();
        let images: BTreeMap<String, Timestamp> = (0..MAX_ENTRIES + 1)
            .map(|i| (format!("m/a@sha256:{i:064x}"), now))
            .collect();
        let r = bounded("a", now, images.clone(), MAX_ENTRIES + 1);
        assert!(!r.complete);
        assert!(r.images.is_empty());
        assert_eq!(r.in_use, MAX_ENTRIES + 1);
        let fits: BTreeMap<_, _> = images.into_iter().take(MAX_ENTRIES).collect();
        let r = bounded("a", now, fits, 10);
        assert!(r.complete);
        assert_eq!(r.images.len(), MAX_ENTRIES);
        assert!(serde_json::to_vec(&r).unwrap().len() <= MAX_BYTES);
    }
}
