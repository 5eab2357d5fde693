//! Prometheus metrics (prometheus-client), all prefixed `pinswap_`.
//!
//! Counter names are registered without `_total`: prometheus-client adds the
//! suffix itself (and panics in debug builds if it is already there).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

/// Label for counts by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// The outcome, e.g. `rewritten`.
    pub outcome: String,
}

/// Label for cache metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabel {
    /// `existence` or `resolution`.
    pub cache: String,
}

/// Labels of `pinswap_cache_invalidations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvalidationLabels {
    /// `existence` or `resolution`.
    pub cache: String,
    /// `pull_failure`, `reverification`, `purge`, `ttl` or `capacity`.
    pub cause: String,
}

/// Why an image slot could not be decided as the config says: the `cause`
/// label of `pinswap_admission_errors_total` (docs/operations.md lists
/// what each covers).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ErrorCause {
    /// A registry refused or required credentials (HTTP 401), or they could
    /// not be read.
    Credentials,
    /// The source registry could not answer (down, timeout, 429, 5xx, its
    /// breaker open) and the target had no copy to stand in, or it answered
    /// with an error (unknown manifest, bad content).
    Source,
    /// The target registry could not answer or refused a request.
    Target,
    /// Time ran out: the admission budget (`server.admissionBudget`), or
    /// `copyDeadline` under `copyPolicy: force`.
    Budget,
    /// A JMESPath filter could not be evaluated for the slot.
    Filter,
    /// The image is not a valid reference, or its mirror path is not.
    Reference,
}

impl ErrorCause {
    /// Every cause, in the order the metric lists them.
    pub const ALL: [ErrorCause; 6] = [
        Self::Credentials,
        Self::Source,
        Self::Target,
        Self::Budget,
        Self::Filter,
        Self::Reference,
    ];

    /// The metric label: `credentials`, `source`, `target`, `budget`,
    /// `filter` or `reference`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Credentials => "credentials",
            Self::Source => "source",
            Self::Target => "target",
            Self::Budget => "budget",
            Self::Filter => "filter",
            Self::Reference => "reference",
        }
    }
}

impl std::fmt::Display for ErrorCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Label `cause` of `pinswap_admission_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// [`ErrorCause::as_str`].
    pub cause: String,
}

/// Labels of `pinswap_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The crate version, e.g. `0.1.0`.
    pub version: String,
    /// The git commit it was built from (12 hex digits), or `unknown`.
    pub commit: String,
}

/// The git commit `build.rs` found, or `unknown`.
pub fn build_commit() -> &'static str {
    match env!("PINSWAP_GIT_COMMIT") {
        "" => "unknown",
        c => c,
    }
}

/// The `reason` labels of `pinswap_copies_cut_total`.
pub const COPY_CUT_REASONS: [&str; 2] = ["deadline", "transfer_rate"];

/// The `registry` label of registries the config does not name.
pub const OTHER_REGISTRY: &str = "other";

/// Every metric pinswap exports.
pub struct Metrics {
    registry: Registry,
    /// The registries a `registry` label may name: the config's own (see
    /// [`Metrics::label_registries`]). Any other is [`OTHER_REGISTRY`], so
    /// the names Pods bring under `"*"` add no series.
    registry_labels: std::sync::RwLock<std::collections::HashSet<String>>,
    /// `pinswap_admissions_total{outcome}`.
    pub admissions: Family<OutcomeLabel, Counter>,
    /// `pinswap_admission_duration_seconds`.
    pub admission_seconds: Histogram,
    /// `pinswap_admission_errors_total{cause}`: image slots met with an
    /// error, by [`ErrorCause`], whether `failurePolicy` then left them
    /// unchanged (open) or denied the Pod (closed).
    pub admission_errors: Family<CauseLabel, Counter>,
    /// `pinswap_build_info{version,commit}`: always 1.
    pub build_info: Family<BuildLabels, Gauge>,
    /// `pinswap_rewrites_total`.
    pub rewrites: Family<ReasonLabel, Counter>,
    /// `pinswap_copies_started_total`.
    pub copies_started: Counter,
    /// `pinswap_copies_succeeded_total`.
    pub copies_succeeded: Counter,
    /// `pinswap_copies_failed_total`.
    pub copies_failed: Counter,
    /// `pinswap_copy_bytes_total`.
    pub copy_bytes: Counter,
    /// `pinswap_copy_duration_seconds`.
    pub copy_seconds: Histogram,
    /// `pinswap_copies_cut_total{reason}`: copies pinswap stopped itself
    /// (`deadline`: past `copy.timeout`; `transfer_rate`: a blob below
    /// `copy.minTransferRate`).
    pub copies_cut: Family<ReasonLabel, Counter>,
    /// `pinswap_cache_hits_total{cache}`.
    pub cache_hits: Family<CacheLabel, Counter>,
    /// `pinswap_cache_misses_total{cache}`.
    pub cache_misses: Family<CacheLabel, Counter>,
    /// `pinswap_cache_invalidations_total{cache,cause}`.
    pub cache_invalidations: Family<InvalidationLabels, Counter>,
    /// `pinswap_cache_entries{cache}`, set when `/metrics` is scraped.
    pub cache_entries: Family<CacheLabel, Gauge>,
    /// `pinswap_pull_failures_total`: container statuses seen in
    /// `ErrImagePull` or `ImagePullBackOff` on a target image.
    pub pull_failures: Counter,
    /// `pinswap_remirrors_total{outcome}`: recoveries of one target image
    /// (`remirrored`, `present`, `failed`).
    pub remirrors: Family<OutcomeLabel, Counter>,
    /// `pinswap_evictions_total{outcome}`: eviction attempts and decisions
    /// for Pods stuck in pull back-off after a re-mirror (`evicted`,
    /// `budget`, `gone`, `recovered`, `not_served`, `failed`, `dropped`).
    pub evictions: Family<OutcomeLabel, Counter>,
    /// `pinswap_reverifications_total{outcome}`: re-verification HEADs
    /// (`present`, `missing`, `error`).
    pub reverifications: Family<OutcomeLabel, Counter>,
    /// `pinswap_leader`: 1 while this replica holds the recovery Lease.
    pub leader: Gauge,
    /// `pinswap_watched_pods`: Pods with target images in the leader's
    /// index.
    pub watched_pods: Gauge,
    /// `pinswap_nodes_without_platform`: nodes whose `kubernetes.io/os` and
    /// `kubernetes.io/arch` the `platforms` filter does not mirror.
    pub nodes_without_platform: Gauge,
    /// `pinswap_identity_findings_total{kind}`: distinct identity findings
    /// (`non_unique`, `collision`).
    pub identity_findings: Family<KindLabel, Counter>,
    /// Connection and request limits of the listeners.
    pub server: ServerMetrics,
    /// `pinswap_source_failures_total{registry,cause}`.
    pub source_failures: Family<SourceLabels, Counter>,
    /// `pinswap_source_breaker_open{registry}`.
    pub source_breaker_open: Family<RegistryLabel, Gauge>,
    /// `pinswap_private_image_denials_total{reason}`: image slots left
    /// unchanged because the image is private and the Pod did not prove
    /// access (`no_credentials`, `refused`, `unverified`).
    pub private_denials: Family<ReasonLabel, Counter>,
    /// `pinswap_pull_secret_errors_total{reason}`: pull secrets (and
    /// ServiceAccounts) that could not be used (`forbidden`, `missing`,
    /// `malformed`, `unreadable`).
    pub pull_secret_errors: Family<ReasonLabel, Counter>,
    /// `pinswap_ecr_policy_failures_total{action}`.
    pub ecr_policy_failures: Family<ActionLabel, Counter>,
    /// `pinswap_referrers_copied_total{outcome}`: referrers of mirrored
    /// images, per attempt (`copied`, `present`, `skipped`, `failed`).
    pub referrers_copied: Family<OutcomeLabel, Counter>,
    /// `pinswap_usage_images`: distinct image references the leader's
    /// Pods and workload templates name.
    pub usage_images: Gauge,
    /// `pinswap_usage_synced`: 1 once every watch of the leader has listed
    /// and its usage record left nothing out; 0 before, while one lists
    /// again or after one failed.
    pub usage_synced: Gauge,
    /// `pinswap_usage_images_dropped_total`: references left out of the
    /// usage record past its bound.
    pub usage_images_dropped: Counter,
    /// `pinswap_backfill_images{state}`: images the backfill handles, by
    /// state (`present`, `copied`, `pending`, `failed`, `denied`).
    pub backfill_images: Family<StateLabel, Gauge>,
    /// Retention of mirrored images (src/retention/).
    pub retention: RetentionMetrics,
    /// This cluster's name and the usage records of the clusters sharing
    /// the target (src/retention/clusters.rs).
    pub sharing: SharingMetrics,
}

/// Label `state`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// The state, e.g. `copied`.
    pub state: String,
}

/// Label `action`: an AWS API action (`ecr:SetRepositoryPolicy`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// The IAM action.
    pub action: String,
}

/// Label `reason`: why a slot was rewritten (`present`, `copied`,
/// `always`, `source_down`), or why a request was refused (`body_memory`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason.
    pub reason: String,
}

/// Labels `registry` and `cause` of a source failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// The source registry, `host[:port]`, when the config names it; else
    /// `other`.
    pub registry: String,
    /// `unreachable`, `timeout`, `rate_limited`, `server_error` or `unauthorized`.
    pub cause: String,
}

/// Label `registry`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegistryLabel {
    /// `host[:port]` of a registry the config names, or `other`.
    pub registry: String,
}

/// Label for counts by kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind, e.g. `collision`.
    pub kind: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    /// A fresh registry with every metric registered at zero.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("pinswap");
        let metrics = Self {
            admissions: register(
                &mut r,
                "admissions",
                "AdmissionReviews answered, by outcome",
                Family::default(),
            ),
            // 0.5 ms .. ~16 s
            admission_seconds: register(
                &mut r,
                "admission_duration_seconds",
                "Time to answer one AdmissionReview",
                Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            ),
            admission_errors: register(
                &mut r,
                "admission_errors",
                "Image slots met with an error while admitting, by cause (credentials, source, target, budget, filter, reference); failurePolicy open leaves them unchanged, closed denies the Pod",
                Family::default(),
            ),
            build_info: register(
                &mut r,
                "build_info",
                "Always 1; the labels say which build is running",
                Family::default(),
            ),
            rewrites: register(
                &mut r,
                "rewrites",
                "Image slots rewritten to the target, by reason (present, copied, always, source_down: the source could not answer and the target's copy was used)",
                Family::default(),
            ),
            copies_started: register(
                &mut r,
                "copies_started",
                "Image copies started",
                Counter::default(),
            ),
            copies_succeeded: register(
                &mut r,
                "copies_succeeded",
                "Image copies that completed",
                Counter::default(),
            ),
            copies_failed: register(
                &mut r,
                "copies_failed",
                "Image copies that failed",
                Counter::default(),
            ),
            copy_bytes: register(
                &mut r,
                "copy_bytes",
                "Bytes streamed by image copies",
                Counter::default(),
            ),
            copy_seconds: register(
                &mut r,
                "copy_duration_seconds",
                "Wall time of one image copy",
                Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            ),
            copies_cut: register(
                &mut r,
                "copies_cut",
                "Copies pinswap cut short, by reason (deadline: an image copy or referrers follow past copy.timeout; transfer_rate: an image or referrer copy whose blob came slower than copy.minTransferRate); each also counts as failed",
                Family::default(),
            ),
            cache_hits: register(
                &mut r,
                "cache_hits",
                "Cache hits, by cache",
                Family::default(),
            ),
            cache_misses: register(
                &mut r,
                "cache_misses",
                "Cache misses, by cache",
                Family::default(),
            ),
            cache_invalidations: register(
                &mut r,
                "cache_invalidations",
                "Cache entries removed, by cache and cause (pull_failure, reverification, purge, ttl, capacity)",
                Family::default(),
            ),
            cache_entries: register(
                &mut r,
                "cache_entries",
                "Entries in each cache",
                Family::default(),
            ),
            pull_failures: register(
                &mut r,
                "pull_failures",
                "Container statuses seen in ErrImagePull or ImagePullBackOff on a target image",
                Counter::default(),
            ),
            remirrors: register(
                &mut r,
                "remirrors",
                "Recoveries of a target image after a pull failure or re-verification, by outcome (remirrored, present, failed)",
                Family::default(),
            ),
            evictions: register(
                &mut r,
                "evictions",
                "Evictions of Pods still in pull back-off after their image was mirrored again, by outcome (evicted, budget, gone, recovered, not_served, failed, dropped)",
                Family::default(),
            ),
            reverifications: register(
                &mut r,
                "reverifications",
                "Re-verification HEADs of cached target manifests, by outcome (present, missing, error)",
                Family::default(),
            ),
            leader: register(
                &mut r,
                "leader",
                "1 while this replica holds the recovery Lease",
                Gauge::default(),
            ),
            watched_pods: register(
                &mut r,
                "watched_pods",
                "Pods with images under the target in the leader's Pod index",
                Gauge::default(),
            ),
            nodes_without_platform: register(
                &mut r,
                "nodes_without_platform",
                "Nodes whose os/arch the platforms filter does not mirror (their Pods cannot pull filtered indexes)",
                Gauge::default(),
            ),
            identity_findings: register(
                &mut r,
                "identity_findings",
                "Distinct image-ID (config digest) findings, by kind (non_unique, collision)",
                Family::default(),
            ),
            server: ServerMetrics::register(&mut r),
            retention: RetentionMetrics::register(&mut r),
            sharing: SharingMetrics::register(&mut r),
            source_failures: register(
                &mut r,
                "source_failures",
                "Failed requests to a source registry, by registry and cause (unreachable, timeout, rate_limited, quota_exhausted, server_error, unauthorized)",
                Family::default(),
            ),
            source_breaker_open: register(
                &mut r,
                "source_breaker_open",
                "Open circuit breakers of a source registry (admissions use the target's copies): 1 or 0 for a registry the config names, how many are open for registry=\"other\"",
                Family::default(),
            ),
            private_denials: register(
                &mut r,
                "private_image_denials",
                "Image slots left unchanged because the image is private (it needs a Pod's own pull secret) and the Pod did not prove access at the source, by reason (no_credentials, refused, unverified: the source could not answer and no recent proof)",
                Family::default(),
            ),
            pull_secret_errors: register(
                &mut r,
                "pull_secret_errors",
                "Pull secrets or ServiceAccounts that could not be used, by reason (forbidden, missing, malformed, unreadable)",
                Family::default(),
            ),
            ecr_policy_failures: register(
                &mut r,
                "ecr_policy_failures",
                "Failed attempts to apply ecrOptions to a repository pinswap made, by action: its access or lifecycle policy after the create (retried before the next push into it), a reconcile, or reading its tags (ecr:ListTagsForResource: then left as it is)",
                Family::default(),
            ),
            referrers_copied: register(
                &mut r,
                "referrers_copied",
                "Referrers (signatures, attestations, SBOMs) of mirrored images handled in the background, per attempt, by outcome (copied, present: already at the target, skipped: left out by referrers.artifactTypes or of a type not copied, failed: retried, then left to re-verification)",
                Family::default(),
            ),
            usage_images: register(
                &mut r,
                "usage_images",
                "Distinct image references named by the Pods and workload templates the leader watches",
                Gauge::default(),
            ),
            usage_synced: register(
                &mut r,
                "usage_synced",
                "1 once every watch of the leader has listed and the usage record left nothing out, else 0",
                Gauge::default(),
            ),
            usage_images_dropped: register(
                &mut r,
                "usage_images_dropped",
                "Image references left out of the leader's usage record past its bound (usage then counts as unsynced)",
                Counter::default(),
            ),
            backfill_images: register(
                &mut r,
                "backfill_images",
                "Images named by running Pods and workload templates that admission would mirror, by backfill state (present, copied, pending, failed, denied)",
                Family::default(),
            ),
            registry: r,
            registry_labels: std::sync::RwLock::default(),
        };
        // Every state at zero from the start (a replica that never leads
        // reports zeros, as for pinswap_watched_pods).
        for state in ["present", "copied", "pending", "failed", "denied"] {
            metrics
                .backfill_images
                .get_or_create(&StateLabel {
                    state: state.to_owned(),
                })
                .set(0);
        }
        for outcome in ["copied", "present", "skipped", "failed"] {
            metrics
                .referrers_copied
                .get_or_create(&OutcomeLabel {
                    outcome: outcome.to_owned(),
                })
                .inc_by(0);
        }
        for reason in COPY_CUT_REASONS {
            metrics
                .copies_cut
                .get_or_create(&ReasonLabel {
                    reason: reason.to_owned(),
                })
                .inc_by(0);
        }
        // Every cause at zero from the start, so a rate over it is defined
        // before the first error.
        for cause in ErrorCause::ALL {
            metrics
                .admission_errors
                .get_or_create(&CauseLabel {
                    cause: cause.as_str().to_owned(),
                })
                .inc_by(0);
        }
        metrics
            .build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                commit: build_commit().to_owned(),
            })
            .set(1);
        metrics
    }

    /// Counts one image slot met with an error of `cause`.
    pub fn admission_error(&self, cause: ErrorCause) {
        self.admission_errors
            .get_or_create(&CauseLabel {
                cause: cause.as_str().to_owned(),
            })
            .inc();
    }

    /// Counts one copy cut short for `reason` (one of
    /// [`COPY_CUT_REASONS`]).
    pub fn copy_cut(&self, reason: &str) {
        self.copies_cut
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts one rewritten slot for `reason`.
    pub fn rewrite(&self, reason: &str) {
        self.rewrites
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts a private image left unchanged for a Pod, by reason.
    pub fn private_denial(&self, reason: &str) {
        self.private_denials
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts a pull secret that could not be used, by reason.
    pub fn pull_secret_error(&self, reason: &str) {
        self.pull_secret_errors
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts a failed `action` applying an ECR repository policy.
    pub fn ecr_policy_failure(&self, action: &str) {
        self.ecr_policy_failures
            .get_or_create(&ActionLabel {
                action: action.to_owned(),
            })
            .inc();
    }

    /// Names the registries `registry` labels may carry (host[:port],
    /// normalised): `source.registries` entries but `"*"`, and the target.
    pub fn label_registries(&self, names: impl IntoIterator<Item = String>) {
        let mut labels = self
            .registry_labels
            .write()
            .unwrap_or_else(|e| e.into_inner());
        labels.extend(names);
    }

    /// The `registry` label for `registry`: itself when the config names
    /// it, else [`OTHER_REGISTRY`].
    pub fn registry_label(&self, registry: &str) -> String {
        let labels = self
            .registry_labels
            .read()
            .unwrap_or_else(|e| e.into_inner());
        match labels.contains(registry) {
            true => registry.to_owned(),
            false => OTHER_REGISTRY.to_owned(),
        }
    }

    /// Counts one failed request to source `registry` for `cause`.
    pub fn source_failure(&self, registry: &str, cause: &str) {
        self.source_failures
            .get_or_create(&SourceLabels {
                registry: self.registry_label(registry),
                cause: cause.to_owned(),
            })
            .inc();
    }

    /// Counts `registry`'s breaker opening (`true`) or closing.
    pub fn breaker_open(&self, registry: &str, open: bool) {
        let gauge = self.source_breaker_open.get_or_create(&RegistryLabel {
            registry: self.registry_label(registry),
        });
        match open {
            true => gauge.inc(),
            false => gauge.dec(),
        };
    }

    /// Counts one new identity finding of `kind`.
    pub fn identity_finding(&self, kind: &str) {
        self.identity_findings
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Counts one answered AdmissionReview.
    pub fn admission(&self, outcome: &str) {
        self.admissions
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Counts one hit or miss of `cache`.
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

    /// Counts `n` entries of `cache` removed for `cause`.
    pub fn invalidated(&self, cache: &str, cause: &str, n: u64) {
        self.cache_invalidations
            .get_or_create(&InvalidationLabels {
                cache: cache.to_owned(),
                cause: cause.to_owned(),
            })
            .inc_by(n);
    }

    /// Counts one event of `family` with `outcome`.
    pub fn outcome(family: &Family<OutcomeLabel, Counter>, outcome: &str) {
        family
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Labels of `pinswap_connections_closed_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// `webhook` or `health`.
    pub listener: String,
    /// `handshake_timeout`, `header_timeout`, `idle_timeout`, `evicted`,
    /// `refused`, `drained`, `tls_error` or `accept_error`.
    pub reason: String,
}

/// Label for per-listener gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    /// `webhook` or `health`.
    pub listener: String,
}

/// The listeners' limits at work.
pub struct ServerMetrics {
    /// `pinswap_connections{listener}`: open connections.
    pub open: Family<ListenerLabel, Gauge>,
    /// `pinswap_connections_closed_total{listener,reason}`: connections
    /// closed or refused by the server, by the limit that closed them.
    pub closed: Family<ConnectionLabels, Counter>,
    /// `pinswap_requests_refused_total{reason}`: `/mutate` requests refused
    /// before their review (`body_too_large`, `body_memory`, `body_timeout`,
    /// `body_read`).
    pub refused: Family<ReasonLabel, Counter>,
    /// `pinswap_body_bytes_in_flight`: bytes of the body budget reserved,
    /// set when `/metrics` is scraped.
    pub body_bytes: Gauge,
    /// `pinswap_body_budget_bytes`: the body budget (`server.bodyMemory`).
    pub body_budget: Gauge,
}

impl ServerMetrics {
    fn register(r: &mut Registry) -> Self {
        Self {
            open: register(
                r,
                "connections",
                "Open connections, by listener",
                Family::default(),
            ),
            closed: register(
                r,
                "connections_closed",
                "Connections closed or refused by the server, by listener and reason",
                Family::default(),
            ),
            refused: register(
                r,
                "requests_refused",
                "Webhook requests refused before review, by reason",
                Family::default(),
            ),
            body_bytes: register(
                r,
                "body_bytes_in_flight",
                "Bytes of the request body budget reserved",
                Gauge::default(),
            ),
            body_budget: register(
                r,
                "body_budget_bytes",
                "The request body budget (server.bodyMemory)",
                Gauge::default(),
            ),
        }
    }

    /// Sets the open connections of `listener`.
    pub fn connections(&self, listener: &str, n: usize) {
        self.open
            .get_or_create(&ListenerLabel {
                listener: listener.to_owned(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts one connection of `listener` closed for `reason`.
    pub fn connection_closed(&self, listener: &str, reason: &str) {
        self.closed
            .get_or_create(&ConnectionLabels {
                listener: listener.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts one request refused for `reason`.
    pub fn request_refused(&self, reason: &str) {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// Retention passes and what they did.
pub struct RetentionMetrics {
    /// `pinswap_retention_passes_total{outcome}`: `done`, `not_synced`,
    /// `source_down`, `error`, `leadership_lost` (stopped leading mid-pass:
    /// a lost Lease or a shutdown).
    pub passes: Family<OutcomeLabel, Counter>,
    /// `pinswap_retention_removed_total{outcome}`: images (target
    /// `repository@digest`) `removed`, that a dry run would remove
    /// (`dry_run`), or whose removal `failed`.
    pub removed: Family<OutcomeLabel, Counter>,
    /// `pinswap_retention_images{state}`: the images of the last pass, by
    /// state.
    pub images: Family<StateLabel, Gauge>,
    /// `pinswap_retention_unrecoverable`: images kept because their source
    /// no longer serves them (they could not be mirrored again).
    pub unrecoverable: Gauge,
}

impl RetentionMetrics {
    fn register(r: &mut Registry) -> Self {
        Self {
            passes: register(
                r,
                "retention_passes",
                "Retention passes, by outcome",
                Family::default(),
            ),
            removed: register(
                r,
                "retention_removed",
                "Images removed by retention (or that a dry run would remove), by outcome",
                Family::default(),
            ),
            images: register(
                r,
                "retention_images",
                "Mirrored images in the last retention pass, by state",
                Family::default(),
            ),
            unrecoverable: register(
                r,
                "retention_unrecoverable",
                "Unused images kept because their source no longer serves them",
                Gauge::default(),
            ),
        }
    }
}

/// Label `cluster`: a cluster's name (`cluster` in the config).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabel {
    /// The name.
    pub cluster: String,
}

/// This cluster and the usage records at the target.
pub struct SharingMetrics {
    /// `pinswap_cluster_info{cluster}`: 1 for this cluster's name.
    pub info: Family<ClusterLabel, Gauge>,
    /// `pinswap_usage_record_publishes_total{outcome}`: `published`,
    /// `incomplete` (more images in use than a record holds), `failed`,
    /// `conflict`, `not_synced` (the watches have not listed everything).
    pub publishes: Family<OutcomeLabel, Counter>,
    /// `pinswap_usage_record_versions_total{outcome}`: what became of the
    /// version each publication replaced: `removed`, `kept` (the registry
    /// refuses deletes, and keeps every version), `failed` (the delete
    /// failed; it stays), `not_own` (not known to be this install's; it
    /// stays).
    pub versions: Family<OutcomeLabel, Counter>,
    /// `pinswap_usage_record_images{cluster}`: entries of each cluster's
    /// record as last read or written.
    pub images: Family<ClusterLabel, Gauge>,
    /// `pinswap_usage_record_updated_seconds{cluster}`: when each record
    /// was published (Unix time).
    pub updated: Family<ClusterLabel, Gauge>,
    /// `pinswap_usage_record_stale{cluster}`: 1 for a record older than
    /// `sharing.staleAfter`.
    pub stale: Family<ClusterLabel, Gauge>,
    /// `pinswap_usage_record_overdue`: 1 while this replica leads and has
    /// published nothing for three `sharing.interval`.
    pub overdue: Gauge,
}

impl SharingMetrics {
    fn register(r: &mut Registry) -> Self {
        Self {
            info: register(
                r,
                "cluster_info",
                "This cluster's name (the config's cluster), always 1",
                Family::default(),
            ),
            publishes: register(
                r,
                "usage_record_publishes",
                "Publications of this cluster's usage record at the target, by outcome (published, incomplete, failed, conflict, not_synced)",
                Family::default(),
            ),
            versions: register(
                r,
                "usage_record_versions",
                "Versions of this cluster's usage record replaced by a publication, by what became of them (removed; kept: the registry refuses deletes and keeps every version; failed; not_own)",
                Family::default(),
            ),
            images: register(
                r,
                "usage_record_images",
                "Entries of each cluster's usage record at the target, as last read or written",
                Family::default(),
            ),
            updated: register(
                r,
                "usage_record_updated_seconds",
                "When each cluster's usage record was last published (Unix time)",
                Family::default(),
            ),
            stale: register(
                r,
                "usage_record_stale",
                "1 for a cluster's usage record not updated within sharing.staleAfter (it keeps everything it lists)",
                Family::default(),
            ),
            overdue: register(
                r,
                "usage_record_overdue",
                "1 while this replica leads and has published its cluster's usage record for none of the last three sharing.interval",
                Gauge::default(),
            ),
        }
    }

    fn label(cluster: &str) -> ClusterLabel {
        ClusterLabel {
            cluster: cluster.to_owned(),
        }
    }

    /// Names this cluster.
    pub fn cluster(&self, name: &str) {
        self.info.get_or_create(&Self::label(name)).set(1);
    }

    /// `cluster`'s record as read or written: `images` entries,
    /// published at `updated` (Unix seconds), stale or not.
    pub fn record(&self, cluster: &str, images: usize, updated: i64, stale: bool) {
        let l = Self::label(cluster);
        self.images.get_or_create(&l).set(images as i64);
        self.updated.get_or_create(&l).set(updated);
        self.stale.get_or_create(&l).set(i64::from(stale));
    }

    /// `cluster`'s record is gone.
    pub fn forget(&self, cluster: &str) {
        let l = Self::label(cluster);
        self.images.remove(&l);
        self.updated.remove(&l);
        self.stale.remove(&l);
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
        m.invalidated("existence", "pull_failure", 2);
        Metrics::outcome(&m.remirrors, "remirrored");
        m.leader.set(1);
        m.server.connection_closed("webhook", "header_timeout");
        m.server.request_refused("body_memory");
        let text = m.encode();
        for want in [
            "pinswap_admissions_total{outcome=\"rewritten\"} 1",
            "pinswap_cache_hits_total{cache=\"existence\"} 1",
            "pinswap_copy_bytes_total 42",
            "# TYPE pinswap_admission_duration_seconds histogram",
            "pinswap_cache_invalidations_total{cache=\"existence\",cause=\"pull_failure\"} 2",
            "pinswap_remirrors_total{outcome=\"remirrored\"} 1",
            "pinswap_leader 1",
            "pinswap_watched_pods 0",
            "pinswap_nodes_without_platform 0",
            "pinswap_pull_failures_total 0",
            "pinswap_copies_cut_total{reason=\"deadline\"} 0",
            "pinswap_copies_cut_total{reason=\"transfer_rate\"} 0",
            "pinswap_connections_closed_total{listener=\"webhook\",reason=\"header_timeout\"} 1",
            "pinswap_requests_refused_total{reason=\"body_memory\"} 1",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }
}
