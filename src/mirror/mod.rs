//! The mirror service (docs/architecture.md §3): the caches of [`crate::cache`], a copy
//! queue deduplicated by source digest, and the swap and copy policies. The
//! webhook and `pinswap mutate` both decide through [`Mirror::decide`].
//!
//! - `access`: who may be given a private image (docs/security.md);
//! - `identity_check`: identity facts, findings and the repaired copy;
//! - `recover`: re-verification and restoring a lost image.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::future::Cache;
use tracing::{debug, warn};

mod access;
pub(crate) mod backfill;
pub(crate) mod health;
mod identity_check;
mod recover;
mod referrers;
mod resume;
pub(crate) mod retention;

mod build;
mod error;
mod plan;
mod queue;
mod resolve;

pub use backfill::Backfilled;
pub use build::CREDENTIALS_REFRESH;
pub use error::{MirrorError, NotReady};
pub use recover::Recovered;

use build::HELD_TAGS_TTL_MAX;
use error::outage_kind;
use plan::{Assessed, Plan};
use queue::CopyFailure;

use crate::cache::{Caches, Purge};
use crate::config::{Auth, CollisionPolicy, CopyPolicy, SwapPolicy};
use crate::identity::Record;
use crate::metrics::{ErrorCause, Metrics};
use crate::platform::PlatformSpec;
use crate::reference::{Digest, MirrorTarget, Reference, normalize_registry};
use crate::registry::ecr::Ecr;
use crate::registry::pullsecrets::PodCredentials;
use crate::registry::{ClientPool, RegistryError, Role};

/// The outcome for one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The image to write into the Pod, or `None` to leave it unchanged.
    pub image: Option<String>,
    /// Why, in words (it goes into the `pinswap.dev/decisions` annotation).
    pub reason: String,
    /// Identity findings or the repair made, in words (the
    /// `pinswap.dev/identity` annotation); `None` when the image ID is
    /// unique.
    pub identity: Option<String>,
    /// The source pinned to the digest that was mirrored,
    /// `registry/repository[:tag]@digest` (the `pinswap.dev/sources`
    /// annotation, which recovery reads); empty when it is not known (the
    /// target's copy of a filtered or repaired image stood in for a source
    /// that cannot answer).
    pub source: String,
    /// Why a rewritten image was rewritten, as the `reason` label of
    /// `pinswap_rewrites_total`: `present`, `copied`, `always` or
    /// `source_down`; empty when the image is left unchanged.
    pub cause: &'static str,
}

/// The mirror service. Cheap to share behind an `Arc`.
pub struct Mirror {
    target: MirrorTarget,
    swap: SwapPolicy,
    copy_policy: CopyPolicy,
    copy_deadline: Duration,
    pin: bool,
    pool: Arc<ClientPool>,
    /// The config's `auth` blocks: (registry, side, block, key path), read
    /// again by [`Mirror::refresh_credentials`].
    auths: Vec<(String, Role, Auth, String)>,
    metrics: Arc<Metrics>,
    caches: Arc<Caches>,
    /// Source digest → target digest (differs with a platform filter).
    /// Content under a digest never changes, so this outlives `resolutionTtl`.
    planned: Cache<String, Digest>,
    /// Target `repository@digest` → the pinned source it was planned from,
    /// so a lost image can be mirrored again even when a platform filter
    /// gave it a digest of its own.
    sources: Cache<String, Reference>,
    platforms: Vec<PlatformSpec>,
    collisions: CollisionPolicy,
    record: Arc<Record>,
    /// Pinned source → identity facts and repair plan.
    assessed: Cache<String, Arc<Assessed>>,
    /// Findings already logged and counted, so each is reported once.
    reported: Mutex<std::collections::HashSet<String>>,
    /// Target `repository:tag` → the digest it was last seen to hold, so
    /// the target's copy can stand in for a failing source without a HEAD
    /// while the existence cache vouches for it.
    held_tags: Cache<String, Digest>,
    /// Source resolution through the breakers and the resolution cache.
    resolver: resolve::Resolver,
    /// The copies in flight, their slots and resumes.
    queue: queue::Queue,
    /// The ECR target (`target.aws`): its registry token and repositories.
    ecr: Option<Arc<Ecr>>,
    /// Who may be given a private image: settings and proofs.
    access: access::Access,
}

/// The tag a digest-only source gets at the target, so "delete untagged"
/// lifecycle rules leave the copy alone. Not `sha256-<hex>`: the referrers
/// tag schema and cosign use that form.
pub fn anchor_tag(digest: &Digest) -> String {
    let hex = digest.hex();
    format!("pinswap-{}", &hex[..hex.len().min(64)])
}

/// The anchor tag of a copy whose digest may differ from the source's (a
/// platform filter or an identity repair): the source digest's anchor tag
/// and `-<variant>`, naming the setting the copy was made under
/// ([`copy_variant`]). It points at the target's copy, so any replica reads
/// back which copy it made of a source digest without the source, and one
/// made under another setting is never taken for it. A plain anchor tag
/// always names the source digest's own bytes.
pub fn variant_anchor_tag(digest: &Digest, variant: &str) -> String {
    format!("{}-{variant}", anchor_tag(digest))
}

/// A short name (12 hex digits of a SHA-256) for the setting that shapes a
/// copy: the platform filter and identity repair. `None` when neither is
/// set, so every copy keeps the source's digest.
pub fn copy_variant(platforms: &[PlatformSpec], collisions: CollisionPolicy) -> Option<String> {
    let repair = collisions == CollisionPolicy::Repair;
    if platforms.is_empty() && !repair {
        return None;
    }
    // Sorted: the filter keeps the index's own order whatever the list's.
    let mut names: Vec<String> = platforms
        .iter()
        .map(|p| match &p.variant {
            Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
            None => format!("{}/{}", p.os, p.architecture),
        })
        .collect();
    names.sort();
    names.dedup();
    let setting = format!("platforms={};repair={repair}", names.join(","));
    let hash = <sha2::Sha256 as sha2::Digest>::digest(setting.as_bytes());
    Some(hex::encode(hash)[..12].to_owned())
}

impl Mirror {
    /// The ECR target, when `target.aws` is set.
    pub fn ecr(&self) -> Option<&Arc<Ecr>> {
        self.ecr.as_ref()
    }

    /// The clients every copy of this mirror shares.
    pub fn pool(&self) -> &Arc<ClientPool> {
        &self.pool
    }

    /// The mirror target.
    pub fn target(&self) -> &MirrorTarget {
        &self.target
    }

    /// The source registries the target holds images of: the first path
    /// component under the prefix of every repository (`GET /v2/_catalog`,
    /// or ECR's repository list), mapped back to the registry it names.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] or [`MirrorError::Ecr`] when the
    /// repositories cannot be listed.
    pub async fn mirrored_registries(
        &self,
    ) -> Result<std::collections::BTreeSet<String>, MirrorError> {
        let names = match &self.ecr {
            Some(ecr) => ecr.repositories().await?,
            None => {
                let client = self.pool.get(self.target.registry(), Role::Target).await?;
                client.catalog().await?
            }
        };
        Ok(names
            .iter()
            .filter_map(|n| match self.target.prefix() {
                Some(p) => n.strip_prefix(p)?.strip_prefix('/'),
                None => Some(n.as_str()),
            })
            .filter_map(|rest| rest.split_once('/'))
            .filter_map(|(component, _)| crate::reference::registry_of_path_component(component))
            .collect())
    }

    /// The existence and resolution caches.
    pub fn caches(&self) -> &Caches {
        &self.caches
    }

    /// The sources' pull quotas, as every copy draws on them.
    pub fn quotas(&self) -> &Arc<crate::registry::quota::Quotas> {
        self.pool.quotas()
    }

    /// The metrics this service counts into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether the target registry answers `GET /v2/` now (2 s at most),
    /// for `/readyz`.
    ///
    /// # Errors
    /// Why not, in one line: `target HOST unreachable: ...` when it does
    /// not answer, `target HOST: ...` when it answers with an error.
    pub async fn target_ready(&self) -> Result<(), NotReady> {
        let host = self.target.registry();
        let client = self
            .pool
            .get(host, Role::Target)
            .await
            .map_err(|e| match e {
                RegistryError::Unreachable { reason, .. } => NotReady::Unreachable {
                    host: host.to_owned(),
                    reason,
                },
                other => NotReady::Refused {
                    host: host.to_owned(),
                    reason: other.to_string(),
                },
            })?;
        client.ping().await.map_err(|e| NotReady::Unreachable {
            host: host.to_owned(),
            reason: e.reason,
        })
    }

    /// The `cause` label of `pinswap_admission_errors_total` for `e`.
    pub fn error_cause(&self, e: &MirrorError) -> ErrorCause {
        e.cause(&self.target_key())
    }

    /// The target registry, normalised, as errors name it.
    fn target_key(&self) -> String {
        normalize_registry(self.target.registry())
    }

    /// The anchor tag at the target for source digest `d`: the plain one
    /// while copies keep the source's digest, else the one naming this
    /// config's platform filter and repair setting.
    pub(crate) fn anchor(&self, d: &Digest) -> String {
        self.queue.anchor(d)
    }

    /// How long until `src`'s registry may be asked again (zero while its
    /// breaker is closed): recovery waits at least this before retrying.
    pub fn source_retry_in(&self, src: &Reference) -> Duration {
        self.resolver.retry_in(src)
    }

    /// Waits for every copy started so far (a CLI run must not exit while
    /// `copyPolicy: delayed` copies are still in flight), and the referrers
    /// they handed on. Returns how many failed.
    pub async fn wait_for_copies(&self) -> usize {
        self.queue.wait().await
    }

    /// Purges cache entries: all of them with `None`; else those `selector`
    /// names. A reference under the target selects existence entries of
    /// that repository (narrowed by its tag and digest when written); any
    /// other reference is a source, and selects its resolution entries and
    /// the existence entries of where it mirrors to. A selector without a
    /// tag or digest covers the whole repository. Returns how many entries
    /// went.
    ///
    /// # Errors
    /// [`MirrorError::Reference`] for a malformed selector.
    pub async fn purge(&self, selector: Option<&str>) -> Result<u64, MirrorError> {
        let Some(s) = selector else {
            return Ok(self.caches.purge(&Purge::All).await);
        };
        let parsed = Reference::parse(s)?;
        let last = s.rsplit('/').next().unwrap_or(s);
        let r = match last.split('@').next().is_some_and(|n| n.contains(':')) {
            true => parsed,
            false => parsed.without_tag(),
        };
        if self.target.contains(&r) {
            return Ok(self.caches.purge(&Purge::Existence(r)).await);
        }
        let mapped = self.target.map(&r)?;
        Ok(self.caches.purge(&Purge::Resolution(r)).await
            + self.caches.purge(&Purge::Existence(mapped)).await)
    }
}

impl Mirror {
    /// The decision for a Pod denied a private image: unchanged, counted,
    /// and no identity facts about an image it may not have.
    fn denied(&self, src: &Reference, pod: &PodCredentials, d: access::Denial) -> Decision {
        self.metrics.private_denial(d.reason);
        debug!(image = %src, namespace = pod.namespace(), reason = d.reason, note = %d.note, "private image not given");
        Decision {
            image: None,
            reason: d.note,
            identity: None,
            source: String::new(),
            cause: "",
        }
    }

    /// What a decision adds when the mirror's index is platform-filtered
    /// while referrers travel: signatures over the source's index do not
    /// apply to the filtered one, which has a digest of its own.
    fn filtered_referrers_note(&self, plan: &Plan) -> String {
        if self.queue.referrers().is_none() || !self.queue.copier().filters_platforms() {
            return String::new();
        }
        match (plan.source.digest(), plan.target.digest()) {
            (Some(s), Some(t)) if s != t => format!(
                "; referrers: the platform-filtered index {t} is not the source's index {s}, so signatures over the source index do not apply to it; those of each platform's manifest are copied"
            ),
            _ => String::new(),
        }
    }

    /// The image a Pod gets for `plan`: `target:tag@digest` when pinned, the
    /// tag alone when not; a digest-only source stays digest-only.
    fn rewritten(&self, plan: &Plan) -> String {
        if plan.tagged && self.pin {
            plan.target.to_string()
        } else if plan.tagged {
            plan.target.without_digest().to_string()
        } else {
            plan.target.without_tag().to_string()
        }
    }

    /// As [`Mirror::decide`] with no side effect: nothing is copied, so an
    /// image missing at the target is rewritten only with `swapPolicy:
    /// always` (dry-run admissions, `pinswap mutate --dry-run`).
    ///
    /// # Errors
    /// Resolution and registry errors.
    pub async fn decide_dry(
        &self,
        src: &Reference,
        pod: &PodCredentials,
    ) -> Result<Decision, MirrorError> {
        let candidates = plan::candidates([pod], src.registry());
        let (plan, _) = self
            .plan_with_any(src, &candidates, None, plan::Assess::All)
            .await?;
        if let access::Verdict::Denied(d) =
            Box::pin(self.access(&plan.source, plan.source_known, pod, None)).await
        {
            return Ok(self.denied(src, pod, d));
        }
        let image = self.rewritten(&plan);
        let identity = self.identity_note(&plan, src, true)?;
        let (image, reason, cause) = if self.target_has(&plan).await? {
            (Some(image), plan.held_note(), plan.rewrite_cause("present"))
        } else if self.swap == SwapPolicy::Always {
            (
                Some(image),
                "dry run: not at the target, not copied (swapPolicy always)".into(),
                "always",
            )
        } else {
            (None, "dry run: not at the target, not copied".into(), "")
        };
        Ok(Decision {
            image,
            reason,
            identity,
            source: plan.source_note(),
            cause,
        })
    }

    /// Decides what `src` becomes for a Pod with `pod`'s credentials (its
    /// imagePullSecrets; the first the source does not refuse reads it),
    /// under the access rule (a private image only for a Pod whose own
    /// credentials read it at the source, docs/security.md) and the swap
    /// and copy policies
    /// (docs/architecture.md §2), without passing `deadline`:
    ///
    /// | at target | copyPolicy | result |
    /// |---|---|---|
    /// | yes | any | rewrite |
    /// | no | none | rewrite only with swapPolicy `always` |
    /// | no | delayed | copy in the background; rewrite only with `always` |
    /// | no | immediate | copy, wait up to copyDeadline; rewrite when done, or with `always` |
    /// | no | force | copy, wait up to copyDeadline; an error if it fails or times out |
    ///
    /// # Errors
    /// Resolution or registry errors, and [`MirrorError::CopyFailed`] for a
    /// failed copy that the policy waited for.
    pub async fn decide(
        &self,
        src: &Reference,
        deadline: Instant,
        pod: &PodCredentials,
    ) -> Result<Decision, MirrorError> {
        // Read with each of the Pod's credentials in turn, then the
        // config's: which one reads the digest says nothing of access,
        // which the check below decides.
        let candidates = plan::candidates([pod], src.registry());
        let (plan, creds) = self
            .plan_with_any(src, &candidates, Some(deadline), plan::Assess::All)
            .await?;
        // Boxed, as in `resolve`: the check's requests are large futures.
        let proven =
            match Box::pin(self.access(&plan.source, plan.source_known, pod, Some(deadline))).await
            {
                access::Verdict::Shared => None,
                access::Verdict::Proven(c) => Some(c),
                access::Verdict::Denied(d) => return Ok(self.denied(src, pod, d)),
            };
        // Copies use the credentials that proved access.
        let creds = proven.as_ref().or(creds);
        let image = self.rewritten(&plan);
        let identity = self.identity_note(&plan, src, false)?;
        let source = plan.source_note();
        let filtered = self.filtered_referrers_note(&plan);
        let decision = |image: Option<String>, reason: &str, cause: &'static str| Decision {
            image,
            reason: format!("{reason}{filtered}"),
            identity: identity.clone(),
            source: source.clone(),
            cause,
        };
        let rewrite = |reason: &str| {
            let cause = match reason.starts_with("copied") {
                true => "copied",
                false => "always",
            };
            decision(Some(image.clone()), reason, cause)
        };
        let keep = |reason: &str| decision(None, reason, "");
        let always = self.swap == SwapPolicy::Always;
        if self.target_has(&plan).await? {
            return Ok(decision(
                Some(image.clone()),
                &plan.held_note(),
                plan.rewrite_cause("present"),
            ));
        }
        match self.copy_policy {
            CopyPolicy::None if always => Ok(rewrite("swapPolicy always (copyPolicy none)")),
            CopyPolicy::None => Ok(keep("not at the target and copyPolicy is none")),
            CopyPolicy::Delayed => {
                drop(self.queue.copy(&plan, creds, false, false));
                let wait = self.source_retry_in(&plan.source);
                if !wait.is_zero() && !always {
                    return Ok(keep(&format!(
                        "not at the target yet; its source {} cannot answer, so the copy waits for it",
                        resolve::source_key(&plan.source)
                    )));
                }
                Ok(if always {
                    rewrite("copy started in the background (swapPolicy always)")
                } else {
                    keep("not at the target yet; copy started in the background")
                })
            }
            CopyPolicy::Immediate | CopyPolicy::Force => {
                let handle = self.queue.copy(&plan, creds, true, false);
                // The admission's own timeout ends at `deadline` too: waiting
                // until that same instant, not a duration computed a moment
                // later, lets this wait answer ("copy still running") rather
                // than the admission's ("budget exhausted", an error).
                // One `now` for both, so a binding copyDeadline is named
                // as configured ("1s", not "999ms 999us 871ns").
                let now = Instant::now();
                let until = (now + self.copy_deadline).min(deadline);
                let wait = until.saturating_duration_since(now);
                match tokio::time::timeout_at(until.into(), handle).await {
                    Ok(Ok(_)) => Ok(rewrite("copied to the target")),
                    Ok(Err(CopyFailure { reason, .. }))
                        if self.copy_policy == CopyPolicy::Immediate && always =>
                    {
                        warn!(image = %src, %reason, "copy failed; rewriting anyway (swapPolicy always)");
                        Ok(rewrite("copy failed (swapPolicy always)"))
                    }
                    Ok(Err(CopyFailure { reason, cause })) => Err(MirrorError::CopyFailed {
                        image: src.to_string(),
                        reason,
                        kind: cause,
                    }),
                    Err(_) if self.copy_policy == CopyPolicy::Force => {
                        Err(MirrorError::CopyFailed {
                            image: src.to_string(),
                            reason: format!(
                                "not done within {} (copyPolicy force)",
                                humantime::format_duration(Duration::from_millis(
                                    wait.as_millis() as u64
                                ))
                            ),
                            kind: ErrorCause::Budget,
                        })
                    }
                    Err(_) if always => Ok(rewrite("copy still running (swapPolicy always)")),
                    Err(_) => Ok(keep("copy still running; not at the target yet")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The copy-queue key whose next copy task panics (a stand-in for a
    /// bug anywhere under the copy).
    static PANIC_FOR: Mutex<Option<String>> = Mutex::new(None);

    pub(super) fn maybe_panic(key: &str) {
        let mut k = PANIC_FOR.lock().unwrap_or_else(|e| e.into_inner());
        if k.as_deref() == Some(key) {
            *k = None;
            drop(k);
            panic!("a bug in a copy task");
        }
    }

    /// A plan for `source` (a tag), pinned to a made-up digest, into
    /// `127.0.0.1:9/mirror`.
    pub(super) fn plan(source: &str) -> Plan {
        let digest = Digest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap();
        let source = Reference::parse(source).unwrap().with_digest(digest);
        Plan {
            target: MirrorTarget::parse("127.0.0.1:9/mirror")
                .unwrap()
                .map(&source)
                .unwrap(),
            source,
            tagged: true,
            untagged: false,
            verify: false,
            assessed: None,
            repair: None,
            present: None,
            fallback: None,
            source_known: true,
        }
    }

    /// A copy task that panics fails that copy, and only that copy: the
    /// next request for the image starts a new one.
    #[tokio::test]
    async fn a_panicking_copy_does_not_poison_its_image() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config =
            Config::from_yaml("target: {registry: \"127.0.0.1:9/mirror\"}\nsource: {registries: [{registry: \"127.0.0.1:9\"}]}\n", "t.yaml").unwrap();
        let m = Mirror::from_config(&config, Arc::new(Metrics::new())).unwrap();
        let plan = plan("127.0.0.1:9/shop/app:v1");
        let key = queue::key(&plan);
        *PANIC_FOR.lock().unwrap() = Some(key.clone());
        let first = m.queue.copy(&plan, None, true, false).await.unwrap_err();
        assert!(first.reason.contains("panic"), "{}", first.reason);
        assert!(m.queue.is_idle(), "entry removed");
        let second = m.queue.copy(&plan, None, true, false).await.unwrap_err();
        assert!(
            !second.reason.contains("panic"),
            "a new copy, which fails on its own (nothing listens): {}",
            second.reason
        );
    }

    /// `cache.ttl` accepts any duration; moka's builder panics beyond 1000
    /// years, which made `Mirror::from_config` panic on a valid config.
    #[tokio::test]
    async fn a_cache_ttl_of_two_thousand_years_builds() {
        let config = Config::from_yaml(
            "target: {registry: \"127.0.0.1:9/mirror\"}\ncache: {ttl: 2000years}\n",
            "test.yaml",
        )
        .unwrap();
        assert_eq!(config.cache.ttl, Duration::from_secs(2000 * 31_557_600));
        Mirror::from_config(&config, Arc::new(Metrics::new())).unwrap();
    }

    #[test]
    fn anchor_tags_are_valid_and_not_the_referrers_form() {
        let d = Digest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap();
        let t = anchor_tag(&d);
        assert_eq!(t, format!("pinswap-{}", "ab".repeat(32)));
        assert!(!t.starts_with("sha256-"));
        let r = Reference::parse("docker.io/library/nginx").unwrap();
        assert!(r.with_tag(&t).is_ok(), "a valid tag");
        let d512 = Digest::parse(&format!("sha512:{}", "c".repeat(128))).unwrap();
        assert!(
            r.with_tag(&anchor_tag(&d512)).is_ok(),
            "fits in 128 characters"
        );
    }
}

#[cfg(test)]
mod future_size {
    use super::*;
    use crate::config::Config;

    /// Every admission moves its decision's future around; the paths that
    /// send a request are boxed so that a cached decision does not carry
    /// their space. Unboxed, `decide` was 20,544 bytes in this profile.
    #[test]
    fn a_decision_future_stays_small() {
        let config =
            Config::from_yaml("target: {registry: \"127.0.0.1:9/mirror\"}\n", "t.yaml").unwrap();
        let m = Mirror::from_config(&config, Arc::new(Metrics::new())).unwrap();
        let r = Reference::parse("127.0.0.1:9/a:b").unwrap();
        let pod = PodCredentials::none();
        let decide = std::mem::size_of_val(&m.decide(&r, Instant::now(), &pod));
        let resolve = std::mem::size_of_val(&m.resolver.resolve(&r, None, None));
        assert!(decide <= 6 * 1024, "decide's future is {decide} bytes");
        assert!(resolve <= 2 * 1024, "resolve's future is {resolve} bytes");
    }
}
