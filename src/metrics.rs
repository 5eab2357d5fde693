//! Prometheus metrics (prometheus-client), all prefixed `pinswap_`.
//!
//! Counter names are registered without `_total`: prometheus-client adds the
//! suffix itself (and panics in debug builds if it is already there).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label for admissions by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `rewritten`, `unchanged`, `denied`, `skipped` (not a Pod), `invalid`.
    pub outcome: String,
}

/// Label for cache metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabel {
    /// `existence` or `resolution`.
    pub cache: String,
}

/// Every metric pinswap exports.
pub struct Metrics {
    registry: Registry,
    /// `pinswap_admissions_total{outcome}`.
    pub admissions: Family<OutcomeLabel, Counter>,
    /// `pinswap_admission_duration_seconds`.
    pub admission_seconds: Histogram,
    /// `pinswap_rewrites_total`: image slots rewritten.
    pub rewrites: Counter,
    /// `pinswap_copies_started_total`.
    pub copies_started: Counter,
    /// `pinswap_copies_succeeded_total`.
    pub copies_succeeded: Counter,
    /// `pinswap_copies_failed_total`.
    pub copies_failed: Counter,
    /// `pinswap_copy_bytes_total`: bytes streamed by copies.
    pub copy_bytes: Counter,
    /// `pinswap_copy_duration_seconds`.
    pub copy_seconds: Histogram,
    /// `pinswap_cache_hits_total{cache}`.
    pub cache_hits: Family<CacheLabel, Counter>,
    /// `pinswap_cache_misses_total{cache}`.
    pub cache_misses: Family<CacheLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pinswap");
        let admissions = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "admissions",
            "AdmissionReviews answered, by outcome",
            admissions.clone(),
        );
        // 0.5 ms .. ~16 s
        let admission_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register(
            "admission_duration_seconds",
            "Time to answer one AdmissionReview",
            admission_seconds.clone(),
        );
        let rewrites = Counter::default();
        registry.register(
            "rewrites",
            "Image slots rewritten to the target",
            rewrites.clone(),
        );
        let copies_started = Counter::default();
        registry.register(
            "copies_started",
            "Image copies started",
            copies_started.clone(),
        );
        let copies_succeeded = Counter::default();
        registry.register(
            "copies_succeeded",
            "Image copies that completed",
            copies_succeeded.clone(),
        );
        let copies_failed = Counter::default();
        registry.register(
            "copies_failed",
            "Image copies that failed",
            copies_failed.clone(),
        );
        let copy_bytes = Counter::default();
        registry.register(
            "copy_bytes",
            "Bytes streamed by image copies",
            copy_bytes.clone(),
        );
        let copy_seconds = Histogram::new(exponential_buckets(0.01, 2.0, 16));
        registry.register(
            "copy_duration_seconds",
            "Wall time of one image copy",
            copy_seconds.clone(),
        );
        let cache_hits = Family::<CacheLabel, Counter>::default();
        registry.register("cache_hits", "Cache hits, by cache", cache_hits.clone());
        let cache_misses = Family::<CacheLabel, Counter>::default();
        registry.register(
            "cache_misses",
            "Cache misses, by cache",
            cache_misses.clone(),
        );
        Self {
            registry,
            admissions,
            admission_seconds,
            rewrites,
            copies_started,
            copies_succeeded,
            copies_failed,
            copy_bytes,
            copy_seconds,
            cache_hits,
            cache_misses,
        }
    }

    /// Counts one admission with `outcome`.
    pub fn admission(&self, outcome: &str) {
        self.admissions
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Counts a cache lookup.
    pub fn cache(&self, cache: &str, hit: bool) {
        let label = CacheLabel {
            cache: cache.to_owned(),
        };
        if hit {
            self.cache_hits.get_or_create(&label).inc();
        } else {
            self.cache_misses.get_or_create(&label).inc();
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels() {
        let m = Metrics::new();
        m.admission("rewritten");
        m.cache("existence", true);
        m.copy_bytes.inc_by(42);
        let text = m.encode();
        for want in [
            "pinswap_admissions_total{outcome=\"rewritten\"} 1",
            "pinswap_cache_hits_total{cache=\"existence\"} 1",
            "pinswap_copy_bytes_total 42",
            "# TYPE pinswap_admission_duration_seconds histogram",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }
}
