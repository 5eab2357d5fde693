//! Publishing this cluster's usage record ([`super::clusters`]) on the
//! leader: when an image new to the record is in use (looked for every
//! `sharing.checkEvery`), every `sharing.interval` while the images in use
//! differ from the record's, every third of `sharing.staleAfter` when
//! nothing changed, and before each retention pass. Runs whether or not
//! this cluster's retention is on: another cluster's retention reads it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use tokio::sync::{Mutex, watch};
use tracing::{info, warn};

use super::clusters::{
    ClusterRecord, ClustersError, MAX_BYTES, MAX_ENTRIES, Present, Records, age, entry_key,
};
use super::{InUse, InUseSource};
use crate::admission::policy::Policy;
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::reference::{Digest, MirrorTarget, Reference};
use crate::registry::delete::Deleted;

/// What [`Publisher::publish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// The watches have not listed everything: nothing published.
    NotSynced,
    /// Nothing to write: nothing new is in use, and the record at the
    /// target stands (younger than `sharing.interval`, or, when the images
    /// in use are those it names as in use, than a third of
    /// `sharing.staleAfter`).
    Unchanged,
    /// Written, with this many entries and bytes of shards uploaded.
    Written {
        /// Entries.
        entries: usize,
        /// Bytes of the shards that changed, uploaded.
        bytes: usize,
    },
}

/// This cluster's record and how to publish it.
pub struct Publisher {
    mirror: Arc<Mirror>,
    /// What may be mirrored: only such images go into the record.
    policy: Policy,
    cluster: String,
    interval: Duration,
    check_every: Duration,
    stale_after: Duration,
    /// How long a record stands while nothing changes.
    refresh: Duration,
    keep_for: Duration,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// The shards of the records read before: a pass fetches only those
    /// that changed.
    cache: Arc<super::shards::Cache>,
}

#[derive(Default)]
struct State {
    /// What was last published (or read back at the first round).
    record: Option<ClusterRecord>,
    /// When it was last written.
    written: Option<Instant>,
    /// The record was read back from the target.
    loaded: bool,
    /// The blobs the target holds: the empty config, and the layers of
    /// the version read back or last written.
    present: Present,
    /// The manifest this install's tag named when last read or written.
    digest: Option<Digest>,
    /// `digest` is this install's: written here, or read back when this
    /// replica began to lead (one writer per name). Not one read back after
    /// a failure that this process did not write: another install's.
    own: bool,
    /// The next read-back follows a failed or refused publication.
    after_failure: bool,
    /// The manifest this process last tried to write: a write whose answer
    /// was lost is recognised by it.
    attempted: Option<Digest>,
    /// When the tag was last found naming `digest` (or written).
    checked: Option<Instant>,
    /// Between writes, when each entry was last seen in use: an image that
    /// stops being used gets its true last use at the next write.
    seen: HashMap<String, Timestamp>,
    /// Replaced versions stay at the target (refused or failed deletes):
    /// told once per stretch.
    keeping: bool,
}

impl State {
    /// A replica that begins to lead reads the record back and writes at
    /// its first round: another replica may have led meanwhile.
    fn lead(&mut self) {
        self.loaded = false;
        self.after_failure = false;
        self.written = None;
        self.checked = None;
    }
}

impl Publisher {
    /// The publisher of `cluster`'s record at `mirror`'s target, under the
    /// `sharing` settings.
    pub fn new(
        mirror: Arc<Mirror>,
        policy: Policy,
        cluster: &str,
        sharing: &crate::config::Sharing,
    ) -> Self {
        let metrics = mirror.metrics().clone();
        metrics.sharing.cluster(cluster);
        Self {
            mirror,
            policy,
            cluster: cluster.to_owned(),
            interval: sharing.interval,
            check_every: sharing.check_every,
            stale_after: sharing.stale_after,
            refresh: refresh(sharing),
            keep_for: sharing.keep_for,
            metrics,
            state: Mutex::new(State::default()),
            cache: Arc::default(),
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
        self.read(Some(&self.cluster)).await
    }

    /// Every cluster's record, this one's too.
    ///
    /// # Errors
    /// As [`Publisher::others`].
    pub async fn all(&self) -> Result<Vec<ClusterRecord>, ClustersError> {
        self.read(None).await
    }

    async fn read(&self, except: Option<&str>) -> Result<Vec<ClusterRecord>, ClustersError> {
        let records = Records::of(&self.mirror)
            .await?
            .with_cache(self.cache.clone());
        // This cluster's own record, once written or read back here, must
        // be in the listing: one without it is short.
        let written = self.state.lock().await.digest.is_some();
        let all = records
            .read_all(except, written.then_some(self.cluster.as_str()))
            .await?;
        let now = Timestamp::now();
        for r in &all {
            self.metrics.sharing.record(
                &r.cluster,
                r.images.len(),
                r.updated.as_second(),
                r.is_stale(now, self.stale_after),
            );
        }
        // The others' pulls under the quotas this cluster shares with them.
        self.mirror.quotas().set_fleet(
            all.iter()
                .filter(|r| r.cluster != self.cluster && !r.is_stale(now, self.stale_after))
                .flat_map(|r| r.quotas.iter().take(crate::registry::quota::MAX_RECORDED)),
        );
        if let Some(r) = all.iter().find(|r| !r.complete) {
            return Err(ClustersError::Incomplete {
                cluster: r.cluster.clone(),
                entries: r.in_use,
            });
        }
        Ok(all)
    }

    /// Publishes this cluster's record when `in_use` names an image new to
    /// it, when it is older than `sharing.interval` and the images in use
    /// are not those it names as in use, when it is older than a third of
    /// `sharing.staleAfter`, when its tag no longer names it (looked at
    /// every `sharing.interval`), or with `force`. Images in use are last
    /// used now; others keep their time (the last round that saw them in
    /// use) and are dropped past `sharing.keepFor`.
    ///
    /// # Errors
    /// [`ClustersError`] when the record could not be read back or
    /// written, or [`ClustersError::Incomplete`] when this cluster uses
    /// more images than a record holds (an incomplete record is published
    /// then, so that every cluster's retention stops).
    pub async fn publish(&self, in_use: &InUse, force: bool) -> Result<Published, ClustersError> {
        if !in_use.synced {
            // Not a success: other clusters see this one's use as of its
            // last record, and may remove what it started to use since.
            Metrics::outcome(&self.metrics.sharing.publishes, "not_synced");
            return Ok(Published::NotSynced);
        }
        let mut state = self.state.lock().await;
        let result = self.publish_locked(&mut state, in_use, force).await;
        if let Err(e) = &result {
            // Read the record back before the next try: a write may have
            // landed although its answer was lost, or another replica led
            // meanwhile. A real second install under this name is found
            // out again at each try. The next round writes.
            state.loaded = false;
            if !matches!(e, ClustersError::Incomplete { .. }) {
                state.after_failure = true;
                state.written = None;
                // What the target holds is read again with the record.
                state.present.layers.clear();
            }
            match e {
                ClustersError::Conflict { .. } | ClustersError::Incomplete { .. } => {}
                _ => Metrics::outcome(&self.metrics.sharing.publishes, "failed"),
            }
        }
        result
    }

    async fn publish_locked(
        &self,
        state: &mut State,
        in_use: &InUse,
        force: bool,
    ) -> Result<Published, ClustersError> {
        // Its own cache: the shards it writes do not pile up in the one
        // the reads of the others keep trimmed.
        let records = Records::of(&self.mirror).await?;
        if !state.loaded {
            // This cluster's last use survives the loss of the cluster
            // (or of its ConfigMap): what the target holds is carried on.
            let read = records.read_full(&self.cluster).await?;
            let before = (state.own, state.digest.take());
            state.digest = read.as_ref().map(|r| r.digest.clone());
            // After a failure, only what this process wrote or tried to
            // write is known to be its own; anything else came from
            // elsewhere.
            state.own = !state.after_failure
                || state.digest == state.attempted
                || (before.0 && state.digest == before.1);
            state.after_failure = false;
            state.present.layers = read
                .as_ref()
                .map(|r| r.layers.iter().cloned().collect())
                .unwrap_or_default();
            state.record = read.map(|r| r.record);
            state.loaded = true;
        }
        let keys = record_keys(self.mirror.target(), &self.policy, &in_use.images);
        // Known: in use when the record was last written. An image used
        // again after a while is news too (a rollback), as its old time
        // would let another cluster remove it.
        let in_use_then = state.record.as_ref().map_or(0, |r| {
            r.images.values().filter(|t| **t >= r.updated).count()
        });
        let known = |k: &String| {
            state
                .record
                .as_ref()
                .is_some_and(|r| r.images.get(k).is_some_and(|t| *t >= r.updated))
        };
        let new = keys.iter().any(|k| !known(k));
        // Nothing new: the same images, or fewer.
        let same = !new && keys.len() == in_use_then;
        let since = |at: Option<Instant>| at.map_or(Duration::MAX, |w| w.elapsed());
        // A record that names exactly what is in use would change only in
        // its times, all of which readers take from `updated`: it stands
        // until a third of staleAfter, so it never looks stale elsewhere.
        let due = since(state.written) >= if same { self.refresh } else { self.interval };
        let mut current = None;
        if !(new || due || force) {
            let now = Timestamp::now();
            for k in &keys {
                state.seen.insert(k.clone(), now);
            }
            if since(state.checked) < self.interval {
                return Ok(Published::Unchanged);
            }
            // The record must still be there (`clusters forget` removes
            // it) and still this install's: one HEAD per interval.
            let found = records.current(&self.cluster).await?;
            if found.is_some() && found == state.digest {
                state.checked = Some(Instant::now());
                return Ok(Published::Unchanged);
            }
            current = Some(found);
        }
        let now = Timestamp::now();
        let mut images: BTreeMap<String, Timestamp> = state
            .record
            .as_ref()
            .map(|r| r.images.clone())
            .unwrap_or_default();
        for (k, t) in state.seen.drain() {
            if let Some(last) = images.get_mut(&k) {
                *last = (*last).max(t);
            }
        }
        images.retain(|_, t| age(now, *t) <= self.keep_for);
        // Carried on from a record written by a clock ahead of this one:
        // never later than now, or it would never age out.
        for t in images.values_mut() {
            *t = (*t).min(now);
        }
        let in_use_count = keys.len();
        for k in keys {
            images.insert(k, now);
        }
        let mut record = bounded(&self.cluster, now, images, in_use_count, MAX_ENTRIES);
        record.quotas = self.mirror.quotas().uses();
        let complete = record.complete;
        // One writer per name: a tag that moved since this install last
        // read or wrote it, or that names a record where there was none,
        // is another install's under the same name.
        let current = match current {
            Some(c) => c,
            None => records.current(&self.cluster).await?,
        };
        if let Some(found) = &current
            && state.digest.as_ref() != Some(found)
        {
            Metrics::outcome(&self.metrics.sharing.publishes, "conflict");
            return Err(ClustersError::Conflict {
                cluster: self.cluster.clone(),
                found: found.to_string(),
                wrote: state
                    .digest
                    .as_ref()
                    .map_or_else(|| "nothing".to_owned(), ToString::to_string),
            });
        }
        state.attempted = Some(Records::digest_of(&record)?);
        let (bytes, digest) = records.publish(&record, &mut state.present).await?;
        if let Some(old) = current.filter(|d| *d != digest) {
            self.replaced(&records, &old, state).await;
        }
        state.digest = Some(digest);
        state.own = true;
        let entries = record.images.len();
        Metrics::outcome(
            &self.metrics.sharing.publishes,
            if complete { "published" } else { "incomplete" },
        );
        self.metrics
            .sharing
            .record(&self.cluster, entries, record.updated.as_second(), false);
        if new {
            info!(cluster = %self.cluster, entries, bytes, "usage record published: an image new to it is in use");
        }
        state.record = Some(record);
        state.written = Some(Instant::now());
        state.checked = state.written;
        if !complete {
            return Err(ClustersError::Incomplete {
                cluster: self.cluster.clone(),
                entries: in_use_count,
            });
        }
        Ok(Published::Written { entries, bytes })
    }

    /// Removes `old`, the version a publication just replaced, when it is
    /// known to be this install's; counts and tells what became of it.
    async fn replaced(&self, records: &Records, old: &Digest, state: &mut State) {
        let versions = &self.metrics.sharing.versions;
        if !state.own {
            // Read back after a failure, and not what this process wrote:
            // another install's, which only its writer removes.
            Metrics::outcome(versions, "not_own");
            info!(cluster = %self.cluster, version = %old, "the usage record's version before is not known to be this install's: it stays at the target");
            return;
        }
        let kept = match records.remove_version(old).await {
            Ok(Deleted::Accepted | Deleted::Absent) => {
                Metrics::outcome(versions, "removed");
                None
            }
            Ok(Deleted::Unsupported) => {
                Metrics::outcome(versions, "kept");
                Some("the target registry refuses deletes (Distribution: storage.delete.enabled is false), so it keeps every version of this cluster's usage record, one per publication".to_owned())
            }
            Err(e) => {
                Metrics::outcome(versions, "failed");
                Some(format!(
                    "the usage record's earlier versions could not be removed ({e}), so they stay at the target"
                ))
            }
        };
        match kept {
            // Once per stretch: it is the same at each publication.
            Some(why) if !state.keeping => {
                warn!(cluster = %self.cluster, "{why}: remove the old versions and run the registry's garbage collection (docs/operations.md#several-clusters-one-mirror); pinswap_usage_record_versions_total counts them");
                state.keeping = true;
            }
            Some(_) => {}
            None if state.keeping => {
                info!(cluster = %self.cluster, "the usage record's earlier versions are removed again");
                state.keeping = false;
            }
            None => {}
        }
    }
}

/// How long a record that names exactly what is in use stands: a third of
/// `sharing.staleAfter` (at least `sharing.interval`), so that two missed
/// writes in a row still leave it fresh for other clusters.
fn refresh(sharing: &crate::config::Sharing) -> Duration {
    (sharing.stale_after / 3).max(sharing.interval)
}

/// The record's keys for `images`: only what maps to an allowed source
/// (what pinswap never mirrors is nobody's to keep), and a source tag
/// only when no image names the same tag pinned by digest (a Pod's
/// original reference next to its rewritten one is one image). Sorted,
/// without repeats.
fn record_keys(target: &MirrorTarget, policy: &Policy, images: &[Reference]) -> Vec<String> {
    let mut pinned_tags = std::collections::HashSet::new();
    let mut keys = Vec::new();
    let mut tags = Vec::new();
    for i in images {
        let mapped = match target.contains(i) {
            true => {
                if super::mirrored_source(target, policy, i.repository()).is_none() {
                    continue;
                }
                i.clone()
            }
            false => {
                if policy.source_allowed(i).is_err() {
                    continue;
                }
                let Ok(m) = target.map(i) else { continue };
                m
            }
        };
        let Some(key) = entry_key(target, &mapped) else {
            continue;
        };
        match (mapped.digest(), mapped.tag()) {
            (Some(_), Some(t)) => {
                pinned_tags.insert(format!("{}:{t}", mapped.repository()));
                keys.push(key);
            }
            (Some(_), None) => keys.push(key),
            (None, _) => tags.push(key),
        }
    }
    keys.extend(tags.into_iter().filter(|k| !pinned_tags.contains(k)));
    keys.sort();
    keys.dedup();
    keys
}

/// A record within `max` entries and [`MAX_BYTES`]: past either, the
/// oldest entries not in use now go first; when what is in use now does
/// not fit, an incomplete record holding none (nothing is removed
/// anywhere while one stands, and an empty one costs no bytes to read).
fn bounded(
    cluster: &str,
    now: Timestamp,
    mut images: BTreeMap<String, Timestamp>,
    in_use: usize,
    max: usize,
) -> ClusterRecord {
    let size = |k: &String| k.len() + 40;
    // 256 bytes for the rest, and the quotas' reserve.
    let reserve = 256 + crate::registry::quota::MAX_RECORDED * 256;
    let fits = |n: usize, bytes: usize| n <= max && bytes + reserve <= MAX_BYTES;
    let mut bytes: usize = images.keys().map(size).sum();
    if !fits(images.len(), bytes) {
        let mut history: Vec<(Timestamp, String)> = images
            .iter()
            .filter(|(_, t)| **t < now)
            .map(|(k, t)| (*t, k.clone()))
            .collect();
        history.sort();
        for (_, k) in history {
            if fits(images.len(), bytes) {
                break;
            }
            bytes -= size(&k);
            images.remove(&k);
        }
    }
    let complete = fits(images.len(), bytes);
    ClusterRecord {
        cluster: cluster.to_owned(),
        updated: now,
        complete,
        in_use,
        images: if complete { images } else { BTreeMap::new() },
        quotas: Vec::new(),
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
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        info!(cluster = %publisher.cluster, "leading: this cluster's usage record is published");
        // Another replica may have led meanwhile: read the record back.
        publisher.state.lock().await.lead();
        let mut failing = false;
        // Since this replica last published, or began to lead.
        let mut last_written = Instant::now();
        loop {
            let lost = async {
                let _ = leader.wait_for(|l| !*l).await;
            };
            tokio::select! {
                _ = tokio::time::sleep(publisher.check_every) => {}
                _ = lost => break,
            }
            if !*leader.borrow() {
                break;
            }
            // A replica that stops leading stops writing at once: a late
            // write would land over the new leader's.
            let lost = async {
                let _ = leader.wait_for(|l| !*l).await;
            };
            let now_in_use = in_use();
            let published = tokio::select! {
                r = publisher.publish(&now_in_use, false) => r,
                _ = lost => break,
            };
            let overdue = match &published {
                Ok(Published::Written { .. } | Published::Unchanged) => {
                    last_written = Instant::now();
                    false
                }
                _ => last_written.elapsed() >= publisher.interval * 3,
            };
            publisher.metrics.sharing.overdue.set(i64::from(overdue));
            match published {
                Ok(Published::NotSynced) => {
                    if overdue && !failing {
                        warn!(cluster = %publisher.cluster, "the usage record has not been published for three sharing.interval: the Kubernetes watches have not listed everything (pinswap_usage_synced is 0), and other clusters' retention sees this cluster's use as of its last record");
                    }
                    failing = overdue;
                }
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
        // Only a leader owes a record.
        publisher.metrics.sharing.overdue.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only what maps to an allowed source is counted, and a Pod's
    /// original reference next to its rewritten one counts once.
    #[test]
    fn a_record_counts_only_what_is_mirrored() {
        let config = crate::config::Config::from_yaml(
            "target: {registry: m.example.com/mirror}\nsource: {registries: [{registry: docker.io}]}\n",
            "t.yaml",
        )
        .unwrap();
        let target = MirrorTarget::parse(&config.target.registry).unwrap();
        let policy = Policy::new(&config, target.clone()).unwrap();
        let d = format!("sha256:{}", "a".repeat(64));
        let images: Vec<Reference> = [
            // A rewritten Pod: its original and the rewritten reference.
            "docker.io/library/nginx:1.25".to_owned(),
            format!("m.example.com/mirror/docker.io/library/nginx:1.25@{d}"),
            // A template between runs names the source's tag.
            "docker.io/library/redis:7".to_owned(),
            // Outside the allowlist, as written and under the target.
            "quay.io/team/app:1".to_owned(),
            format!("m.example.com/mirror/quay.io/team/app:1@{d}"),
            // Under the target, but no mirror path.
            "m.example.com/mirror/tools:1".to_owned(),
        ]
        .iter()
        .map(|r| Reference::parse(r).unwrap())
        .collect();
        assert_eq!(
            record_keys(&target, &policy, &images),
            vec![
                format!("mirror/docker.io/library/nginx@{d}"),
                "mirror/docker.io/library/redis:7".to_owned(),
            ]
        );
    }

    #[test]
    fn a_record_past_its_bounds_drops_history_first_then_is_incomplete() {
        let now = Timestamp::from_second(1000).unwrap();
        let old = Timestamp::from_second(1).unwrap();
        let key = |i: usize| format!("m/a@sha256:{i:064x}");
        let max = 1000;
        // Ten old entries past the bound: they go, what is in use stays.
        let mut images: BTreeMap<String, Timestamp> = (0..max).map(|i| (key(i), now)).collect();
        images.extend((max..max + 10).map(|i| (key(i), old)));
        let r = bounded("a", now, images, max, max);
        assert!(r.complete);
        assert_eq!(r.images.len(), max);
        assert!(r.images.values().all(|t| *t == now));
        // More in use than fits: incomplete, empty, the real count.
        let images: BTreeMap<String, Timestamp> = (0..max + 1).map(|i| (key(i), now)).collect();
        let r = bounded("a", now, images, max + 1, max);
        assert!(!r.complete);
        assert!(r.images.is_empty());
        assert_eq!(r.in_use, max + 1);
        // The bound itself is about a million entries.
        const { assert!(MAX_ENTRIES >= 1 << 20) };
    }
}
