//! The existence and resolution caches (docs/architecture.md §2), with invalidation by
//! cause and the metrics that count it.
//!
//! - **Existence**: "the target has `repository@digest`", keyed by the
//!   target's `registry/repository@digest`. Each entry holds the time it was
//!   last verified and the tags verified to point at that digest, because a
//!   rewrite relies on the tag too (`target:tag@digest`, and "delete
//!   untagged" lifecycle rules spare tagged manifests).
//! - **Resolution**: source reference (`registry/repository:tag`) → manifest
//!   digest.
//!
//! Both are moka caches with a TTL, shortened per entry by a random part of
//! `cache.jitter` so entries cached together do not all expire at once. A TTL
//! of `0s` turns a cache off: every lookup misses and nothing is stored.
//! Entries leave by TTL (counted as `ttl`), capacity (`capacity`), or one of
//! the explicit [`Cause`]s.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::future::Cache;
use moka::notification::RemovalCause;

use crate::config;
use crate::metrics::{CacheLabel, Metrics};
use crate::reference::{Digest, Reference};

/// `cache` label of the existence cache.
pub const EXISTENCE: &str = "existence";
/// `cache` label of the resolution cache.
pub const RESOLUTION: &str = "resolution";

/// Why entries were removed on purpose (the `cause` label of
/// `pinswap_cache_invalidations_total`; `ttl` and `capacity` are moka's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A Pod reported `ErrImagePull` or `ImagePullBackOff` on the image.
    PullFailure,
    /// A re-verification HEAD found the manifest missing.
    Reverification,
    /// `POST /cache/purge` or `pinswap cache purge`.
    Purge,
}

impl Cause {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::PullFailure => "pull_failure",
            Cause::Reverification => "reverification",
            Cause::Purge => "purge",
        }
    }
}

/// One existence-cache entry.
#[derive(Debug, Clone)]
pub struct Verified {
    /// When the target last answered that it has the manifest.
    pub at: Instant,
    /// Tags verified to point at the digest.
    pub tags: Arc<BTreeSet<String>>,
}

/// An existence entry as listed for re-verification.
#[derive(Debug, Clone)]
pub struct ExistenceEntry {
    /// `registry/repository@digest` at the target.
    pub target: Reference,
    /// Tags verified to point at the digest.
    pub tags: Vec<String>,
    /// When it was last verified.
    pub verified: Instant,
}

/// What [`Caches::purge`] removes.
#[derive(Debug, Clone)]
pub enum Purge {
    /// Every entry of both caches.
    All,
    /// Existence entries of this target repository; only this digest when
    /// it has one, only entries verified under this tag when it has one.
    Existence(Reference),
    /// Resolution entries of this source repository; only this tag when it
    /// has one.
    Resolution(Reference),
}

/// Per-entry TTL less a random part of `jitter × ttl`.
struct Jittered {
    ttl: Duration,
    jitter: f64,
    seed: std::collections::hash_map::RandomState,
}

impl Jittered {
    fn lifetime<K: Hash>(&self, key: &K, now: Instant) -> Duration {
        // A hash of the key and the time is random enough to spread expiry;
        // no RNG crate needed.
        let h = self.seed.hash_one((key, now));
        let fraction = (h % 10_000) as f64 / 10_000.0;
        self.ttl.mul_f64(1.0 - self.jitter * fraction)
    }
}

impl<K: Hash, V> Expiry<K, V> for Jittered {
    fn expire_after_create(&self, key: &K, _: &V, now: Instant) -> Option<Duration> {
        Some(self.lifetime(key, now))
    }
    fn expire_after_update(
        &self,
        key: &K,
        _: &V,
        now: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(self.lifetime(key, now))
    }
}

fn build<V: Clone + Send + Sync + 'static>(
    name: &'static str,
    ttl: Duration,
    jitter: f64,
    capacity: u64,
    metrics: &Arc<Metrics>,
) -> Option<Cache<String, V>> {
    if ttl.is_zero() {
        return None;
    }
    let m = metrics.clone();
    Some(
        Cache::builder()
            .max_capacity(capacity)
            .expire_after(Jittered {
                ttl,
                jitter,
                seed: Default::default(),
            })
            .eviction_listener(move |_, _, cause| match cause {
                RemovalCause::Expired => m.invalidated(name, "ttl", 1),
                RemovalCause::Size => m.invalidated(name, "capacity", 1),
                // Explicit removals are counted with their cause by the
                // caller; replacements are not removals.
                RemovalCause::Explicit | RemovalCause::Replaced => {}
            })
            .build(),
    )
}

/// The existence-cache key of a target reference: `registry/repository@digest`.
fn existence_key(name: &str, digest: &Digest) -> String {
    format!("{name}@{digest}")
}

/// Both caches. Cheap to share behind an `Arc`.
pub struct Caches {
    existence: Option<Cache<String, Verified>>,
    resolution: Option<Cache<String, Digest>>,
    metrics: Arc<Metrics>,
}

impl Caches {
    /// Builds the caches from `cache.ttl`, `cache.resolutionTtl` and
    /// `cache.jitter` (a TTL of zero turns that cache off). Capacity: 100 000
    /// existence and 10 000 resolution entries.
    pub fn new(config: &config::Cache, metrics: Arc<Metrics>) -> Self {
        Self {
            existence: build(EXISTENCE, config.ttl, config.jitter, 100_000, &metrics),
            resolution: build(
                RESOLUTION,
                config.resolution_ttl,
                config.jitter,
                10_000,
                &metrics,
            ),
            metrics,
        }
    }

    /// Whether the existence cache holds `target` (`repository:tag@digest`,
    /// or `repository@digest`): the digest, and the tag among those verified.
    /// Counts a hit or a miss. A reference without a digest always misses.
    pub async fn has(&self, target: &Reference) -> bool {
        let hit = self.vouches(target).await;
        self.metrics.cache(EXISTENCE, hit);
        hit
    }

    /// [`Caches::has`] without counting: for deciding whether a request
    /// will be needed, not for answering.
    pub async fn vouches(&self, target: &Reference) -> bool {
        match (&self.existence, target.digest()) {
            (Some(c), Some(d)) => c
                .get(&existence_key(&target.name(), d))
                .await
                .is_some_and(|v| target.tag().is_none_or(|t| v.tags.contains(t))),
            _ => false,
        }
    }

    /// Records that the target has `target` now, merging its tag into the
    /// entry's verified tags. No-op without a digest or with the cache off.
    pub async fn verified(&self, target: &Reference) {
        let (Some(c), Some(d)) = (&self.existence, target.digest()) else {
            return;
        };
        let tag = target.tag().map(str::to_owned);
        c.entry(existence_key(&target.name(), d))
            .and_upsert_with(|old| async move {
                let mut tags = old
                    .map(|e| e.into_value().tags.as_ref().clone())
                    .unwrap_or_default();
                tags.extend(tag);
                Verified {
                    at: Instant::now(),
                    tags: Arc::new(tags),
                }
            })
            .await;
    }

    /// Drops `target`'s tag from its entry's verified tags (the tag names
    /// other content now). The entry itself stays.
    pub async fn forget_tag(&self, target: &Reference) {
        let (Some(c), Some(d), Some(tag)) = (&self.existence, target.digest(), target.tag()) else {
            return;
        };
        let key = existence_key(&target.name(), d);
        if let Some(v) = c.get(&key).await
            && v.tags.contains(tag)
        {
            let mut tags = v.tags.as_ref().clone();
            tags.remove(tag);
            c.insert(
                key,
                Verified {
                    at: v.at,
                    tags: Arc::new(tags),
                },
            )
            .await;
        }
    }

    /// Removes the entry for `target`'s `repository@digest` (every tag), and
    /// counts it under `cause`. Returns whether there was one.
    pub async fn invalidate(&self, target: &Reference, cause: Cause) -> bool {
        let (Some(c), Some(d)) = (&self.existence, target.digest()) else {
            return false;
        };
        let gone = c.remove(&existence_key(&target.name(), d)).await.is_some();
        if gone {
            self.metrics.invalidated(EXISTENCE, cause.as_str(), 1);
        }
        gone
    }

    /// Every existence entry, for re-verification.
    pub fn existence_entries(&self) -> Vec<ExistenceEntry> {
        let Some(c) = &self.existence else {
            return Vec::new();
        };
        c.iter()
            .filter_map(|(k, v)| {
                Some(ExistenceEntry {
                    target: Reference::parse(&k).ok()?,
                    tags: v.tags.iter().cloned().collect(),
                    verified: v.at,
                })
            })
            .collect()
    }

    /// The resolution cache, for lookups coalesced with `try_get_with`;
    /// `None` when it is off.
    pub fn resolution(&self) -> Option<&Cache<String, Digest>> {
        self.resolution.as_ref()
    }

    /// Removes what `what` selects, counts it under `purge`, and returns how
    /// many entries went.
    pub async fn purge(&self, what: &Purge) -> u64 {
        let mut n = 0;
        if let Some(c) = &self.existence {
            let hit = |k: &str, v: &Verified| -> bool {
                match what {
                    Purge::All => true,
                    Purge::Resolution(_) => false,
                    Purge::Existence(r) => {
                        let Ok(key) = Reference::parse(k) else {
                            return false;
                        };
                        key.name() == r.name()
                            && r.digest().is_none_or(|d| key.digest() == Some(d))
                            && r.tag().is_none_or(|t| v.tags.contains(t))
                    }
                }
            };
            n += self.remove_where(c, EXISTENCE, hit).await;
        }
        if let Some(c) = &self.resolution {
            let hit = |k: &str, _: &Digest| -> bool {
                match what {
                    Purge::All => true,
                    Purge::Existence(_) => false,
                    Purge::Resolution(r) => Reference::parse(k).is_ok_and(|key| {
                        key.name() == r.name() && r.tag().is_none_or(|t| key.tag() == Some(t))
                    }),
                }
            };
            n += self.remove_where(c, RESOLUTION, hit).await;
        }
        n
    }

    async fn remove_where<V: Clone + Send + Sync + 'static>(
        &self,
        cache: &Cache<String, V>,
        name: &str,
        hit: impl Fn(&str, &V) -> bool,
    ) -> u64 {
        let keys: Vec<Arc<String>> = cache
            .iter()
            .filter(|(k, v)| hit(k, v))
            .map(|(k, _)| k)
            .collect();
        let mut n = 0;
        for k in keys {
            if cache.remove(k.as_str()).await.is_some() {
                n += 1;
            }
        }
        if n > 0 {
            self.metrics.invalidated(name, Cause::Purge.as_str(), n);
        }
        n
    }

    /// Runs moka's pending maintenance (so expired entries are counted) and
    /// sets `pinswap_cache_entries`. Called before `/metrics` is encoded.
    pub async fn refresh_gauges(&self) {
        for (name, count) in [
            (EXISTENCE, self.existence_count().await),
            (RESOLUTION, self.resolution_count().await),
        ] {
            self.metrics
                .cache_entries
                .get_or_create(&CacheLabel {
                    cache: name.to_owned(),
                })
                .set(count as i64);
        }
    }

    async fn existence_count(&self) -> u64 {
        match &self.existence {
            Some(c) => {
                c.run_pending_tasks().await;
                c.entry_count()
            }
            None => 0,
        }
    }

    async fn resolution_count(&self) -> u64 {
        match &self.resolution {
            Some(c) => {
                c.run_pending_tasks().await;
                c.entry_count()
            }
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caches(ttl: Duration) -> (Caches, Arc<Metrics>) {
        let m = Arc::new(Metrics::new());
        let cfg = config::Cache {
            ttl,
            resolution_ttl: ttl,
            ..Default::default()
        };
        (Caches::new(&cfg, m.clone()), m)
    }

    fn r(s: &str) -> Reference {
        Reference::parse(s).unwrap()
    }

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

    #[tokio::test]
    async fn entries_are_per_digest_and_remember_their_tags() {
        let (c, m) = caches(Duration::from_secs(60));
        let v1 = r(&format!("m.example/app:v1@{D1}"));
        assert!(!c.has(&v1).await);
        c.verified(&v1).await;
        assert!(c.has(&v1).await);
        assert!(c.has(&r(&format!("m.example/app@{D1}"))).await);
        assert!(!c.has(&r(&format!("m.example/app:latest@{D1}"))).await);
        assert!(!c.has(&r(&format!("m.example/app:v1@{D2}"))).await);
        c.verified(&r(&format!("m.example/app:latest@{D1}"))).await;
        assert!(c.has(&v1).await, "a second tag does not drop the first");
        let entries = c.existence_entries();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].target.to_string(), format!("m.example/app@{D1}"));
        assert_eq!(entries[0].tags, ["latest", "v1"]);

        assert!(c.invalidate(&v1, Cause::PullFailure).await);
        assert!(!c.has(&v1).await);
        assert!(!c.invalidate(&v1, Cause::PullFailure).await);
        c.refresh_gauges().await;
        let text = m.encode();
        assert!(text.contains(
            "pinswap_cache_invalidations_total{cache=\"existence\",cause=\"pull_failure\"} 1"
        ));
        assert!(text.contains("pinswap_cache_entries{cache=\"existence\"} 0"));
        assert!(text.contains("pinswap_cache_hits_total{cache=\"existence\"} 3"));
    }

    #[tokio::test]
    async fn ttl_zero_stores_nothing() {
        let (c, _) = caches(Duration::ZERO);
        let v1 = r(&format!("m.example/app:v1@{D1}"));
        c.verified(&v1).await;
        assert!(!c.has(&v1).await);
        assert!(c.existence_entries().is_empty());
        assert!(c.resolution().is_none());
    }

    #[tokio::test]
    async fn expiry_is_counted_as_ttl_and_jittered_within_bounds() {
        let (c, m) = caches(Duration::from_millis(200));
        let v1 = r(&format!("m.example/app:v1@{D1}"));
        c.verified(&v1).await;
        assert!(c.has(&v1).await);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(!c.has(&v1).await, "expired entries are not served");
        // moka's timer wheel removes expired entries at ~1 s granularity.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        c.refresh_gauges().await;
        assert!(
            m.encode()
                .contains("pinswap_cache_invalidations_total{cache=\"existence\",cause=\"ttl\"} 1")
        );
        let j = Jittered {
            ttl: Duration::from_secs(100),
            jitter: 0.1,
            seed: Default::default(),
        };
        let lifetimes: BTreeSet<Duration> = (0..50)
            .map(|i| j.lifetime(&format!("k{i}"), Instant::now()))
            .collect();
        assert!(lifetimes.iter().all(|d| *d > Duration::from_secs(89)));
        assert!(lifetimes.iter().all(|d| *d <= Duration::from_secs(100)));
        assert!(lifetimes.len() > 10, "lifetimes are spread: {lifetimes:?}");
    }

    #[tokio::test]
    async fn purge_selects_by_repository_digest_and_tag() {
        let (c, m) = caches(Duration::from_secs(60));
        for t in [
            format!("m.example/a:v1@{D1}"),
            format!("m.example/a:v2@{D2}"),
            format!("m.example/b:v1@{D1}"),
        ] {
            c.verified(&r(&t)).await;
        }
        let res = c.resolution().unwrap();
        res.insert("docker.io/library/a:v1".into(), Digest::parse(D1).unwrap())
            .await;
        res.insert("docker.io/library/a:v2".into(), Digest::parse(D2).unwrap())
            .await;

        let n = c
            .purge(&Purge::Existence(r(&format!("m.example/a@{D2}"))))
            .await;
        assert_eq!(n, 1);
        assert_eq!(c.purge(&Purge::Existence(r("m.example/a:v1"))).await, 1);
        assert_eq!(c.purge(&Purge::Resolution(r("docker.io/a:v2"))).await, 1);
        assert_eq!(c.existence_entries().len(), 1, "b is untouched");
        assert_eq!(c.purge(&Purge::All).await, 2);
        assert!(
            m.encode().contains(
                "pinswap_cache_invalidations_total{cache=\"existence\",cause=\"purge\"} 3"
            )
        );
    }
}
