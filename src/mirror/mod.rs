//! The mirror service (docs/architecture.md §3): the caches of [`crate::cache`], a copy
//! queue deduplicated by source digest, and the swap and copy policies. The
//! webhook and `pinswap mutate` both decide through [`Mirror::decide`].
//!
//! - `access`: who may be given a private image (docs/security.md);
//! - `identity_check`: identity facts, findings and the repaired copy;
//! - `recover`: re-verification and restoring a lost image.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use moka::future::Cache;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

mod access;
pub(crate) mod backfill;
pub(crate) mod health;
mod identity_check;
mod recover;
mod referrers;
mod resume;
pub(crate) mod retention;

pub use backfill::Backfilled;
pub use recover::Recovered;

use crate::cache::{Caches, Purge};
use crate::config::{Auth, CollisionPolicy, Config, CopyPolicy, Platforms, SwapPolicy};
use crate::identity::{Facts, Record, Repair};
use crate::metrics::{ErrorCause, Metrics};
use crate::platform::PlatformSpec;
use crate::reference::{Digest, MirrorTarget, Reference, ReferenceError, normalize_registry};
use crate::registry::auth::{CredentialSources, Credentials};
use crate::registry::copy::{Copier, CopyError, CopyOptions, Endpoint};
use crate::registry::ecr::Ecr;
use crate::registry::pullsecrets::PodCredentials;
use crate::registry::{ClientPool, PoolOptions, RegistryError, Role};

/// Why the target cannot be used now (`/readyz`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// It does not answer `GET /v2/`.
    #[error("target {host} unreachable: {reason}")]
    Unreachable {
        /// The target registry.
        host: String,
        /// The transport error chain.
        reason: String,
    },
    /// Its client cannot be built, or it answered with an error.
    #[error("target {host}: {reason}")]
    Refused {
        /// The target registry.
        host: String,
        /// What failed.
        reason: String,
    },
}

/// Errors deciding about one image. Each names the image.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    /// The config's credentials could not be read (at startup).
    #[error("{path}: {reason}")]
    Credentials {
        /// Config key path.
        path: String,
        /// Why (never the secret).
        reason: String,
    },
    /// The target reference could not be built.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    /// A registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Resolving or planning failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// The ECR target could not sign in (at startup).
    #[error("target.aws: {0}")]
    Ecr(#[from] crate::registry::ecr::EcrError),
    /// The environment's proxy settings cannot be used (at startup).
    #[error(transparent)]
    Proxy(#[from] crate::registry::proxy::ProxyError),
    /// Resolution failed for a caller that waited on another's lookup.
    #[error("resolving {image}: {reason}")]
    Resolve {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
        /// The kind of failure, as [`MirrorError::cause`] gives it.
        kind: ErrorCause,
    },
    /// The copy the policy waits for failed or ran out of time.
    #[error("copy of {image} failed: {reason}")]
    CopyFailed {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
        /// The kind of failure, as [`MirrorError::cause`] gives it.
        kind: ErrorCause,
    },
    /// The source could not answer (down, timeout, 5xx, 429, refused
    /// credentials, or its circuit breaker is open) and the target holds no
    /// copy that can stand in.
    #[error("source registry {registry} cannot answer ({cause}); {consequence}")]
    SourceDown {
        /// The source image.
        image: String,
        /// The source registry, normalised.
        registry: String,
        /// The failure, in words.
        cause: String,
        /// What follows for this image.
        consequence: String,
        /// [`ErrorCause::Credentials`] when the source refused our
        /// credentials, else [`ErrorCause::Source`].
        kind: ErrorCause,
    },
    /// A private image (it needs a Pod's own pull secret at the source), and
    /// no Pod it was asked for proves access.
    #[error("{image}: {reason}")]
    Private {
        /// The pinned source.
        image: String,
        /// Why, in words (never a credential).
        reason: String,
    },
    /// `identity.collisions: deny` and the image's image ID is not unique.
    /// Admission denies the Pod whatever `failurePolicy` says.
    #[error("{image}: {message}")]
    IdentityDenied {
        /// The source image.
        image: String,
        /// The findings and the fix.
        message: String,
    },
}

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

/// A source image mapped to where it lives at the target.
#[derive(Debug, Clone)]
struct Plan {
    /// The source, pinned to the digest it resolved to.
    source: Reference,
    /// The target reference with the tag to push and the digest to pin.
    target: Reference,
    /// Whether the source named a tag (else the target tag is an anchor).
    tagged: bool,
    /// Push by digest only, leaving the tag where it is (a recovery of
    /// content the tag no longer names).
    untagged: bool,
    /// Check every blob and child manifest at the target and restore what
    /// is missing (recovery after a pull failure).
    verify: bool,
    /// What the source's manifests say about identity (`None` when the
    /// inspection failed under `collisions: warn`).
    assessed: Option<Arc<Assessed>>,
    /// The repaired copy to push instead (`collisions: repair`).
    repair: Option<Arc<Repair>>,
    /// Whether the target has the image under `target`'s tag: known while
    /// planning (`Some`), or to be checked (`None`).
    present: Option<bool>,
    /// The source could not answer and the target's copy of the tag stands
    /// in: the failure, in words.
    fallback: Option<String>,
    /// `source` is known (a stand-in copy of a filtered or repaired image
    /// does not say which source digest it was made from).
    source_known: bool,
}

impl Plan {
    /// The decision note for an image the target holds.
    fn held_note(&self) -> String {
        match &self.fallback {
            None => "present at the target".into(),
            Some(cause) => format!(
                "source unreachable ({cause}); pinned to the mirror's copy of {}",
                self.source.tag().unwrap_or("the image")
            ),
        }
    }

    /// `present`'s label, or `source_down` when the target's copy stood in.
    fn rewrite_cause(&self, present: &'static str) -> &'static str {
        match self.fallback {
            Some(_) => "source_down",
            None => present,
        }
    }

    /// The pinned source for `pinswap.dev/sources`, empty when not known.
    fn source_note(&self) -> String {
        match self.source_known {
            true => self.source.to_string(),
            false => String::new(),
        }
    }
}

/// The identity facts of one pinned source (content under a digest never
/// changes, so they are cached by digest).
#[derive(Debug)]
struct Assessed {
    /// (platform, facts) per image manifest.
    images: Vec<(Option<String>, Facts)>,
    /// The planned repair, when any image needs one.
    repair: Option<Arc<Repair>>,
    /// Flagged images a repair leaves as they are, with why.
    unrepaired: crate::identity::Unrepaired,
}

/// Why a copy failed: the error in words and its kind.
#[derive(Debug, Clone)]
struct CopyFailure {
    reason: String,
    cause: ErrorCause,
}

/// A copy's outcome: blobs copied or mounted (what a verifying copy
/// restored), or the failure.
type CopyHandle = Shared<BoxFuture<'static, Result<u64, CopyFailure>>>;

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
    copier: Arc<Copier>,
    /// As `copier`, with `verify_target`: restores lost blobs and children.
    verifier: Arc<Copier>,
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
    /// [`copy_variant`] of this config: `Some` when a copy's digest may
    /// differ from the source's.
    variant: Option<String>,
    record: Arc<Record>,
    /// Pinned source → identity facts and repair plan.
    assessed: Cache<String, Arc<Assessed>>,
    /// Findings already logged and counted, so each is reported once.
    reported: Mutex<std::collections::HashSet<String>>,
    inflight: Arc<Mutex<HashMap<String, CopyHandle>>>,
    copy_slots: Arc<Semaphore>,
    /// Target `repository:tag` → the digest it was last seen to hold, so
    /// the target's copy can stand in for a failing source without a HEAD
    /// while the existence cache vouches for it.
    held_tags: Cache<String, Digest>,
    /// The source registries' circuit breakers.
    breakers: Arc<health::Breakers>,
    /// How long an admission waits for a source to resolve (`source.timeout`).
    source_timeout: Duration,
    /// Copies that failed because their source could not answer, to retry.
    resumes: Arc<resume::Resumes>,
    /// The ECR target (`target.aws`): its registry token and repositories.
    ecr: Option<Arc<Ecr>>,
    /// Who may be given a private image: settings and proofs.
    access: access::Access,
    /// Copies referrers after their image (`referrers`); `None` when off.
    referrers: Option<Arc<referrers::Follower>>,
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

/// The outage `e` shows at source `registry` (normalised), with the
/// `Retry-After` it asked for and the failure in words; `None` for errors
/// of other registries (the target) and for answers that are not outages.
fn source_outage(
    e: &MirrorError,
    registry: &str,
) -> Option<(crate::registry::Outage, Option<Duration>, String)> {
    let r = match e {
        MirrorError::Registry(r) | MirrorError::Copy(CopyError::Registry(r)) => r,
        _ => return None,
    };
    if r.registry().map(normalize_registry).as_deref() != Some(registry) {
        return None;
    }
    let (outage, retry_after) = r.outage()?;
    Some((outage, retry_after, r.outage_cause()))
}

/// The kind of a source outage: refused credentials, or the source.
fn outage_kind(outage: crate::registry::Outage) -> ErrorCause {
    match outage {
        crate::registry::Outage::Unauthorized => ErrorCause::Credentials,
        _ => ErrorCause::Source,
    }
}

/// The kind of a registry error, `target` being the target registry
/// (normalised): a 401 (or credentials that cannot be read) is about
/// credentials whichever side answered it; anything else names the side.
fn registry_kind(r: &RegistryError, target: &str) -> ErrorCause {
    match r {
        RegistryError::Unauthorized { .. }
        | RegistryError::AuthRequired { .. }
        | RegistryError::Auth(_) => ErrorCause::Credentials,
        _ if r.registry().map(normalize_registry).as_deref() == Some(target) => ErrorCause::Target,
        _ => ErrorCause::Source,
    }
}

/// The kind of a copy error (see [`registry_kind`]); a blob that failed
/// while streaming, or a manifest that is not the pinned one, is the
/// source's.
fn copy_kind(e: &CopyError, target: &str) -> ErrorCause {
    match e {
        CopyError::Registry(r) => registry_kind(r, target),
        _ => ErrorCause::Source,
    }
}

impl MirrorError {
    /// What kind of failure this is, as the `cause` label of
    /// `pinswap_admission_errors_total`; `target` is the target registry
    /// (`host[:port]`, normalised).
    pub fn cause(&self, target: &str) -> ErrorCause {
        match self {
            Self::Credentials { .. } | Self::Private { .. } => ErrorCause::Credentials,
            Self::Reference(_) => ErrorCause::Reference,
            Self::Registry(r) => registry_kind(r, target),
            Self::Copy(e) => copy_kind(e, target),
            Self::Ecr(_) => ErrorCause::Target,
            Self::Proxy(_) => ErrorCause::Source,
            Self::Resolve { kind, .. }
            | Self::CopyFailed { kind, .. }
            | Self::SourceDown { kind, .. } => *kind,
            // A policy decision rather than a failure: admission counts it
            // as a denial, never through this.
            Self::IdentityDenied { .. } => ErrorCause::Source,
        }
    }

    /// This error for a caller that waited on another's lookup (moka hands
    /// the waiters one shared error): a source outage stays one, so the
    /// waiter can fall back to the target too. `target` as in
    /// [`MirrorError::cause`].
    fn for_waiter(&self, src: &Reference, target: &str) -> MirrorError {
        match self {
            MirrorError::SourceDown {
                registry,
                cause,
                consequence,
                kind,
                ..
            } => MirrorError::SourceDown {
                image: src.to_string(),
                registry: registry.clone(),
                cause: cause.clone(),
                consequence: consequence.clone(),
                kind: *kind,
            },
            other => MirrorError::Resolve {
                image: src.to_string(),
                reason: other.to_string(),
                kind: other.cause(target),
            },
        }
    }
}

/// How often `pinswap serve` reads the config's `auth` blocks again.
pub const CREDENTIALS_REFRESH: Duration = Duration::from_secs(300);

/// How long one refresh waits for an `auth` block (a credential helper).
const CREDENTIAL_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a config `auth` block into credentials (at startup, and again
/// every [`CREDENTIALS_REFRESH`] under `serve`).
fn read_auth(auth: &Auth, registry: &str, path: &str) -> Result<Credentials, MirrorError> {
    let bad = |reason: String| MirrorError::Credentials {
        path: path.to_owned(),
        reason,
    };
    if let Some(file) = &auth.docker_config_file {
        let sources = CredentialSources {
            authfile: Some(file.clone()),
            docker_config: false,
        };
        return match sources.lookup_blocking(registry) {
            Ok(Some(oci_client::secrets::RegistryAuth::Basic(u, p))) => Ok(Credentials::new(u, p)),
            Ok(_) => Err(bad(format!(
                "dockerConfigFile {} has no credentials for {registry}",
                file.display()
            ))),
            Err(e) => Err(bad(e.to_string())),
        };
    }
    let user = auth.username.clone().unwrap_or_default();
    let password = if let Some(file) = &auth.password_file {
        std::fs::read_to_string(file)
            .map_err(|e| bad(format!("passwordFile {}: {e}", file.display())))?
            .trim_end_matches(['\r', '\n'])
            .to_owned()
    } else if let Some(var) = &auth.password_env {
        std::env::var(var).map_err(|_| bad(format!("passwordEnv {var} is not set")))?
    } else {
        return Err(bad("no credentials".into()));
    };
    Ok(Credentials::new(user, password))
}

/// The longest a held tag is kept, whatever `cache.ttl` says.
const HELD_TAGS_TTL_MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Mirror {
    /// Builds the service from a validated config: reads referenced
    /// credentials now, so a missing secret fails at startup.
    ///
    /// # Errors
    /// [`MirrorError::Credentials`] naming the config key (also for a
    /// `target.aws` config, which needs [`Mirror::connect`]);
    /// [`MirrorError::Reference`] for a bad target.
    pub fn from_config(config: &Config, metrics: Arc<Metrics>) -> Result<Self, MirrorError> {
        if config.target.aws.is_some() {
            return Err(MirrorError::Credentials {
                path: "target.aws".into(),
                reason: "an ECR target signs in through the AWS API: build the mirror with Mirror::connect".into(),
            });
        }
        Self::build(config, metrics, None)
    }

    /// As [`Mirror::from_config`], and for a `target.aws` (ECR) target signs
    /// in: AWS credentials from the SDK's default chain, then a registry
    /// token from `ecr:GetAuthorizationToken`.
    ///
    /// # Errors
    /// As [`Mirror::from_config`]; [`MirrorError::Ecr`] naming the AWS
    /// error code and the IAM action.
    pub async fn connect(config: &Config, metrics: Arc<Metrics>) -> Result<Self, MirrorError> {
        match &config.target.aws {
            Some(aws) => {
                let sdk = crate::registry::ecr::default_sdk_config(&aws.region).await;
                Self::connect_with(config, metrics, sdk).await
            }
            None => Self::build(config, metrics, None),
        }
    }

    /// As [`Mirror::connect`], with the AWS SDK config given (credentials,
    /// region, endpoints) instead of the default chain; `target.aws.role`
    /// is still assumed on top of it.
    ///
    /// # Errors
    /// As [`Mirror::connect`].
    pub async fn connect_with(
        config: &Config,
        metrics: Arc<Metrics>,
        sdk: aws_config::SdkConfig,
    ) -> Result<Self, MirrorError> {
        let Some(aws) = &config.target.aws else {
            return Self::build(config, metrics, None);
        };
        let target = MirrorTarget::parse(&config.target.registry)?;
        let ecr = Ecr::connect_with(aws, target.registry(), sdk)
            .await
            .with_metrics(metrics.clone());
        let token = ecr.authorization().await?;
        let mirror = Self::build(config, metrics, Some(Arc::new(ecr)))?;
        let ecr = mirror.ecr.as_ref().expect("just set");
        mirror
            .pool
            .set_credentials(ecr.host(), Role::Target, token)
            .await;
        Ok(mirror)
    }

    fn build(
        config: &Config,
        metrics: Arc<Metrics>,
        ecr: Option<Arc<Ecr>>,
    ) -> Result<Self, MirrorError> {
        let target = MirrorTarget::parse(&config.target.registry)?;
        let mut insecure = Vec::new();
        let mut auths = Vec::new();
        if config.target.insecure {
            insecure.push(target.registry().to_owned());
        }
        if let Some(a) = &config.target.auth {
            // The pool looks credentials up by the normalised host.
            let registry = normalize_registry(target.registry());
            auths.push((registry, Role::Target, a.clone(), "target.auth".to_owned()));
        }
        for (i, r) in config.source.registries.iter().enumerate() {
            if r.insecure {
                insecure.push(normalize_registry(&r.registry));
            }
            if let Some(a) = &r.auth {
                let path = format!("source.registries[{i}].auth");
                auths.push((
                    normalize_registry(&r.registry),
                    Role::Source,
                    a.clone(),
                    path,
                ));
            }
        }
        let mut per_registry = HashMap::new();
        for (registry, role, auth, path) in &auths {
            per_registry.insert((registry.clone(), *role), read_auth(auth, registry, path)?);
        }
        // Loopback and private addresses only for the registries the config
        // names; anything `"*"` lets in must be public (docs/architecture.md §5).
        // They are also the only registries metric labels name, and the
        // ones whose breakers are never evicted.
        let named: Vec<String> = config
            .source
            .registries
            .iter()
            .filter(|r| r.registry != "*")
            .map(|r| normalize_registry(&r.registry))
            .chain([normalize_registry(target.registry())])
            .collect();
        metrics.label_registries(named.iter().cloned());
        let guard = crate::registry::guard::Guard::private_only_for(&named);
        // A proxy at a refused address stops the start, not each request.
        let proxies = crate::registry::proxy::Proxies::from_env()?;
        proxies.guard(&guard)?;
        let pool = Arc::new(ClientPool::new(PoolOptions {
            insecure,
            per_registry,
            guard,
            proxies,
            ..PoolOptions::default()
        }));
        let platforms = match &config.platforms {
            Platforms::All => Vec::new(),
            Platforms::Only(p) => p.clone(),
        };
        let options = |verify_target| CopyOptions {
            jobs: 4,
            platforms: platforms.clone(),
            progress: false,
            verify_target,
        };
        let copier = |verify| {
            let c = Copier::new(pool.clone(), options(verify));
            match &ecr {
                Some(e) => Arc::new(c.with_before_push(e.clone())),
                None => Arc::new(c),
            }
        };
        let (copier, verifier) = (copier(false), copier(true));
        let breakers = Arc::new(health::Breakers::new(
            config.source.breaker.clone(),
            metrics.clone(),
            named,
        ));
        let referrers = config.referrers.enabled.then(|| {
            let opts = crate::registry::referrers::ReferrerOptions {
                artifact_types: config.referrers.artifact_types.clone(),
                ..Default::default()
            };
            let copier = crate::registry::referrers::ReferrerCopier::new(copier.clone(), opts);
            Arc::new(referrers::Follower::new(
                copier,
                metrics.clone(),
                breakers.clone(),
            ))
        });
        Ok(Self {
            target,
            swap: config.swap_policy,
            copy_policy: config.copy_policy,
            copy_deadline: config.copy_deadline,
            pin: config.pin,
            pool,
            auths,
            copier,
            verifier,
            caches: Arc::new(Caches::new(&config.cache, metrics.clone())),
            metrics: metrics.clone(),
            planned: Cache::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .max_capacity(10_000)
                .build(),
            // Idle, not live: the admissions that read an entry keep it.
            sources: Cache::builder()
                .time_to_idle(Duration::from_secs(24 * 3600))
                .max_capacity(100_000)
                .build(),
            variant: copy_variant(&platforms, config.identity.collisions),
            platforms,
            collisions: config.identity.collisions,
            record: Arc::default(),
            assessed: Cache::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .max_capacity(10_000)
                .build(),
            reported: Mutex::default(),
            inflight: Arc::default(),
            copy_slots: Arc::new(Semaphore::new(4)),
            held_tags: Cache::builder()
                // moka panics on a TTL over 1000 years; cache.ttl has no
                // upper bound, and a century is as good as forever here.
                .time_to_live(
                    config
                        .cache
                        .ttl
                        .clamp(Duration::from_secs(1), HELD_TAGS_TTL_MAX),
                )
                .max_capacity(100_000)
                .build(),
            breakers,
            source_timeout: config.source.timeout,
            resumes: Arc::new(resume::Resumes::new(config.source.breaker.clone())),
            ecr,
            access: access::Access::new(config),
            referrers,
        })
    }

    /// Reads every config `auth` block again (password files, Docker
    /// configs and their credential helpers, each within 30 s) and hands
    /// changed credentials to the client pool, so a rotated secret or an
    /// expiring token (ECR's last 12 h) is picked up without a restart.
    /// An ECR target's token is fetched again once half its life is gone.
    /// Returns how many changed. A block that cannot be read now is logged
    /// and keeps its previous credentials.
    pub async fn refresh_credentials(&self) -> usize {
        let mut changed = 0;
        if let Some(ecr) = &self.ecr
            && ecr.token_due(std::time::SystemTime::now())
        {
            match ecr.authorization().await {
                Ok(creds) => {
                    if self
                        .pool
                        .set_credentials(ecr.host(), Role::Target, creds)
                        .await
                    {
                        info!(
                            registry = ecr.host(),
                            "ECR registry token renewed; signing in again"
                        );
                        changed += 1;
                    }
                }
                Err(e) => {
                    warn!(error = %e, "cannot renew the ECR registry token; keeping the previous one")
                }
            }
        }
        for (registry, role, auth, path) in &self.auths {
            let (a, r, p) = (auth.clone(), registry.clone(), path.clone());
            // Credential helpers are programs: run them off the runtime, and
            // don't let a hung one stop the refreshes of the others.
            let read = tokio::time::timeout(
                CREDENTIAL_READ_TIMEOUT,
                tokio::task::spawn_blocking(move || read_auth(&a, &r, &p)),
            )
            .await;
            let Ok(read) = read else {
                warn!(key = %path, timeout = ?CREDENTIAL_READ_TIMEOUT, "reading registry credentials timed out; keeping the previous ones");
                continue;
            };
            match read {
                Ok(Ok(creds)) => {
                    if self.pool.set_credentials(registry, *role, creds).await {
                        info!(registry, key = %path, "registry credentials changed; signing in again");
                        changed += 1;
                    }
                }
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot read registry credentials again; keeping the previous ones")
                }
                Err(e) => warn!(error = %e, key = %path, "credential refresh task failed"),
            }
        }
        changed
    }

    /// Calls [`Mirror::refresh_credentials`] every `every` until `token` is
    /// cancelled; does nothing when the config has no `auth` block.
    pub async fn refresh_credentials_every(
        self: Arc<Self>,
        every: Duration,
        token: tokio_util::sync::CancellationToken,
    ) {
        if self.auths.is_empty() && self.ecr.is_none() {
            return;
        }
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            self.refresh_credentials().await;
        }
    }

    /// The ECR target, when `target.aws` is set.
    pub fn ecr(&self) -> Option<&Arc<Ecr>> {
        self.ecr.as_ref()
    }

    /// The mirror target.
    pub fn target(&self) -> &MirrorTarget {
        &self.target
    }

    /// The existence and resolution caches.
    pub fn caches(&self) -> &Caches {
        &self.caches
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

    /// The breaker key and metric label of `src`'s registry.
    fn source_key(src: &Reference) -> String {
        normalize_registry(src.registry())
    }

    /// The anchor tag at the target for source digest `d`: the plain one
    /// while copies keep the source's digest, else the one naming this
    /// config's platform filter and repair setting.
    pub(crate) fn anchor(&self, d: &Digest) -> String {
        match &self.variant {
            None => anchor_tag(d),
            Some(v) => variant_anchor_tag(d, v),
        }
    }

    /// How long until `src`'s registry may be asked again (zero while its
    /// breaker is closed): recovery waits at least this before retrying.
    pub fn source_retry_in(&self, src: &Reference) -> Duration {
        self.breakers.retry_in(&Self::source_key(src))
    }

    /// Runs `work`, a request to `src`'s registry, through its circuit
    /// breaker: refused at once while the breaker is open, bounded by
    /// `source.timeout` and half the time left before `deadline`, and
    /// counted as an answer or an outage. An outage becomes
    /// [`MirrorError::SourceDown`]; other errors pass through.
    async fn ask_source<T>(
        &self,
        src: &Reference,
        deadline: Option<Instant>,
        work: impl Future<Output = Result<T, MirrorError>>,
    ) -> Result<T, MirrorError> {
        let registry = Self::source_key(src);
        let down = |cause: String, kind: ErrorCause| MirrorError::SourceDown {
            image: src.to_string(),
            registry: registry.clone(),
            cause,
            consequence: "not read from it".into(),
            kind,
        };
        let attempt = self.breakers.attempt(&registry).map_err(|open| {
            down(
                format!("circuit breaker open after {open}"),
                ErrorCause::Source,
            )
        })?;
        let limit = match deadline {
            Some(d) => {
                let now = Instant::now();
                self.source_timeout
                    .min(d.saturating_duration_since(now) / 2)
            }
            None => self.source_timeout.max(Duration::from_secs(30)),
        };
        match tokio::time::timeout(limit, work).await {
            Err(_) => {
                let ms = Duration::from_millis(limit.as_millis() as u64);
                let cause = format!("no answer within {}", humantime::format_duration(ms));
                // A wait cut to less than half of `source.timeout` by the
                // admission's budget says little: a busy machine can miss
                // a 20 ms window with a healthy source. Only longer waits
                // count against it (docs/architecture.md §3).
                if limit < self.source_timeout / 2 {
                    attempt.abandoned();
                } else {
                    attempt.failed(crate::registry::Outage::Timeout, cause.clone(), None);
                }
                Err(down(cause, ErrorCause::Source))
            }
            Ok(Ok(v)) => {
                attempt.answered();
                Ok(v)
            }
            Ok(Err(e)) => match source_outage(&e, &registry) {
                Some((outage, retry_after, cause)) => {
                    attempt.failed(outage, cause.clone(), retry_after);
                    Err(down(cause, outage_kind(outage)))
                }
                None => {
                    attempt.answered();
                    Err(e)
                }
            },
        }
    }

    /// Tag → manifest digest on the source, cached for `cache.resolutionTtl`,
    /// through the source's circuit breaker.
    async fn resolve(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Digest, MirrorError> {
        if let Some(d) = src.digest() {
            return Ok(d.clone());
        }
        if let Some(d) = self.cached_resolution(src).await {
            return Ok(d);
        }
        let key = src.to_string();
        // Boxed: the request's future is about ten times the size of the
        // rest of an admission's, and every cached admission moved it
        // around (memmove was the largest cost in the profile).
        Box::pin(self.resolve_at_source(src, key, creds, deadline)).await
    }

    /// `src`'s digest from the resolution cache, counted as a hit; `None`
    /// (not counted: the lookup that follows counts) on a miss.
    async fn cached_resolution(&self, src: &Reference) -> Option<Digest> {
        let d = self.caches.resolution()?.get(&src.to_string()).await?;
        self.metrics.cache(crate::cache::RESOLUTION, true);
        Some(d)
    }

    /// [`Mirror::resolve`] past the cache: one request per key at a time.
    async fn resolve_at_source(
        &self,
        src: &Reference,
        key: String,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Digest, MirrorError> {
        let fetch = self.ask_source(src, deadline, async {
            self.metrics.cache(crate::cache::RESOLUTION, false);
            let client = self
                .pool
                .get_with(src.registry(), Role::Source, creds)
                .await?;
            Ok::<_, MirrorError>(match client.head_manifest(src).await? {
                Some(d) => d,
                // HEAD has no body; GET brings the registry's own error code.
                None => client.get_manifest(src).await?.digest,
            })
        });
        match self.caches.resolution() {
            // While the breaker is open or half-open, a caller must not wait
            // on another's lookup: that one may be the probe, which waits
            // out `source.timeout`. Each asks the breaker itself, and all
            // but the probe are refused at once and use the target's copy.
            Some(c) if !self.breakers.is_closed(&Self::source_key(src)) => {
                let d = fetch.await?;
                c.insert(key, d.clone()).await;
                Ok(d)
            }
            // One lookup per key at a time: callers arriving while it runs
            // wait for it instead of resolving again (moka's coalescing).
            Some(c) => {
                let mut missed = false;
                let d = c
                    .try_get_with(key, async {
                        missed = true;
                        fetch.await
                    })
                    .await
                    .map_err(|e| match Arc::try_unwrap(e) {
                        Ok(e) => e,
                        Err(shared) => shared.for_waiter(src, &self.target_key()),
                    })?;
                if !missed {
                    self.metrics.cache(crate::cache::RESOLUTION, true);
                }
                Ok(d)
            }
            None => fetch.await,
        }
    }

    /// Resolves, maps and assesses `src` (docs/architecture.md §3 steps 3 to 5). The
    /// target is the authority for what it holds: a digest it has is planned
    /// without the source, and a tag whose source cannot answer is planned
    /// from the target's copy of that tag. Under `collisions: warn` the
    /// identity check is advisory: with a `deadline` it waits at most half
    /// the time left, and the check goes on in the background for the next
    /// admission.
    ///
    /// # Errors
    /// [`MirrorError::SourceDown`] when the source cannot answer and the
    /// target holds no copy; resolution, registry and identity errors.
    async fn plan(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Plan, MirrorError> {
        if src.digest().is_some()
            && let Some(plan) = self.plan_held(src, deadline, None).await?
        {
            return Ok(plan);
        }
        match self.plan_from_source(src, creds, deadline).await {
            Err(MirrorError::SourceDown {
                image,
                registry,
                cause,
                kind,
                ..
            }) => match self.plan_stand_in(src, &cause, deadline).await? {
                Some(plan) => Ok(plan),
                None => Err(MirrorError::SourceDown {
                    image,
                    registry,
                    cause,
                    consequence: "the target has no copy of this image yet".into(),
                    kind,
                }),
            },
            other => other,
        }
    }

    /// The plan for `pinned` (a source pinned by digest, with or without a
    /// tag) when the target already holds it under its tag (the source tag,
    /// or the anchor tag of a digest-only source), else `None`. Asks the
    /// target only. The target digest is the source's when nothing changes
    /// it; under a platform filter or `collisions: repair` it is the one
    /// planned earlier, else the one the anchor tag for this source digest
    /// and this setting names ([`variant_anchor_tag`]), so a fresh replica
    /// finds the copy without the source, and never one made under another
    /// setting.
    ///
    /// `ahead` is the target's answer for the tag when it was already
    /// asked (at the same time as the source): it replaces the HEAD.
    async fn plan_held(
        &self,
        pinned: &Reference,
        deadline: Option<Instant>,
        ahead: Option<Result<Option<Digest>, MirrorError>>,
    ) -> Result<Option<Plan>, MirrorError> {
        let Some(source_digest) = pinned.digest() else {
            return Ok(None);
        };
        let tag = match pinned.tag() {
            Some(t) => t.to_owned(),
            None => self.anchor(source_digest),
        };
        let tagged = self.target.map(&pinned.without_digest().with_tag(&tag)?)?;
        let (d, read) = match self.variant {
            None => (source_digest.clone(), false),
            Some(_) => match self.planned.get(&pinned.to_string()).await {
                Some(d) => (d, false),
                None => {
                    let anchor = tagged.with_tag(&self.anchor(source_digest))?;
                    let Some(d) = Box::pin(self.target_tag_digest(&anchor)).await? else {
                        return Ok(None);
                    };
                    self.planned.insert(pinned.to_string(), d.clone()).await;
                    (d, true)
                }
            },
        };
        let target = tagged.with_digest(d.clone());
        let present = match ahead {
            Some(answer) => {
                let present = answer?.as_ref() == Some(&d);
                if present {
                    self.caches.verified(&target).await;
                }
                present
            }
            // The anchor tag just read is a digest-only source's own tag.
            None if read && pinned.tag().is_none() => {
                self.caches.verified(&target).await;
                true
            }
            None => self.target_has_ref(&target).await?,
        };
        if !present {
            return Ok(None);
        }
        if pinned.tag().is_some() {
            self.held_tag(&tagged, &d).await;
        }
        let plan = self
            .held(pinned.clone(), true, target, deadline, None)
            .await?;
        Ok(Some(plan))
    }

    /// When the source cannot answer: the target's own copy of `src`'s tag
    /// stands in, pinned to the digest the target has under it (the last
    /// copy pinswap made). A digest reference was already looked up at the
    /// target by [`Mirror::plan_held`]. `None` when the target has no copy.
    async fn plan_stand_in(
        &self,
        src: &Reference,
        cause: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<Plan>, MirrorError> {
        if src.digest().is_some() {
            return Ok(None);
        }
        let Some(tag) = src.tag() else {
            return Ok(None);
        };
        let tagged = self.target.map(src)?;
        let d = match self.held_tags.get(&tagged.to_string()).await {
            Some(d) if self.caches.has(&tagged.with_digest(d.clone())).await => d,
            _ => {
                let Some(d) = Box::pin(self.target_tag_digest(&tagged)).await? else {
                    return Ok(None);
                };
                self.caches.verified(&tagged.with_digest(d.clone())).await;
                self.held_tag(&tagged, &d).await;
                d
            }
        };
        let target = tagged.with_digest(d.clone());
        // The source digest is the target's unless a filter or a repair
        // made the copy; then only this process's own record knows it.
        let unchanged = self.variant.is_none();
        let (source, known) = match unchanged {
            true => (src.with_digest(d), true),
            false => match self.sources.get(&target.without_tag().to_string()).await {
                Some(s) => (s, true),
                None => (src.clone(), false),
            },
        };
        debug!(image = %src, %cause, target = %target, tag, "source cannot answer; the target's copy stands in");
        let plan = self
            .held(source, known, target, deadline, Some(cause))
            .await?;
        Ok(Some(plan))
    }

    /// A plan for an image the target holds at `target`
    /// (`repository:tag@digest`), made from `source`. Its identity facts
    /// come from the source's earlier assessment when this process has it
    /// (no request), else from the target's copy.
    async fn held(
        &self,
        source: Reference,
        source_known: bool,
        target: Reference,
        deadline: Option<Instant>,
        fallback: Option<&str>,
    ) -> Result<Plan, MirrorError> {
        let assessed = match self.assessed.get(&source.to_string()).await {
            Some(hit) if source_known => Some(hit),
            _ => {
                let at = target.without_tag();
                Box::pin(self.bounded_assessment(
                    &at,
                    self.assess(&at, Role::Target, None),
                    deadline,
                ))
                .await?
            }
        };
        if source_known {
            self.record_source(&target, &source).await;
        }
        Ok(Plan {
            tagged: source.tag().is_some(),
            source,
            target,
            untagged: false,
            verify: false,
            assessed,
            repair: None,
            present: Some(true),
            fallback: fallback.map(str::to_owned),
            source_known,
        })
    }

    /// Waits for an identity assessment as the policy says: under `warn`
    /// with a `deadline`, at most half the time left, and a failure only
    /// logs; otherwise to the end, and a failure is the plan's error.
    async fn bounded_assessment(
        &self,
        image: &Reference,
        assessing: impl Future<Output = Result<Arc<Assessed>, MirrorError>>,
        deadline: Option<Instant>,
    ) -> Result<Option<Arc<Assessed>>, MirrorError> {
        let assessed = match (self.collisions, deadline) {
            (CollisionPolicy::Warn, Some(d)) => {
                let now = Instant::now();
                let until = now + d.saturating_duration_since(now) / 2;
                match tokio::time::timeout_at(until.into(), assessing).await {
                    Ok(r) => Some(r),
                    Err(_) => {
                        debug!(%image, "identity check still running; this admission goes without it");
                        None
                    }
                }
            }
            _ => Some(assessing.await),
        };
        match assessed {
            Some(Ok(a)) => Ok(Some(a)),
            None => Ok(None),
            Some(Err(e)) if self.collisions == CollisionPolicy::Warn => {
                warn!(%image, error = %e, "identity check failed; rewriting without it");
                Ok(None)
            }
            Some(Err(e)) => Err(e),
        }
    }

    /// Records that target `tagged` (`repository:tag`) holds `digest`; a
    /// moka insert is a write, so only when that changes.
    async fn held_tag(&self, tagged: &Reference, digest: &Digest) {
        let key = tagged.to_string();
        if self.held_tags.get(&key).await.as_ref() != Some(digest) {
            self.held_tags.insert(key, digest.clone()).await;
        }
    }

    /// Records that target `repository@digest` was planned from `source`.
    /// A moka insert is a write (queued, then applied by housekeeping):
    /// skipped when the entry already says this.
    async fn record_source(&self, target: &Reference, source: &Reference) {
        let key = target.without_tag().to_string();
        if self.sources.get(&key).await.as_ref() != Some(source) {
            self.sources.insert(key, source.clone()).await;
        }
    }

    /// The plan when the source answers: resolve, then the target first
    /// (it may hold the digest already), else the target digest and the
    /// identity facts from the source.
    async fn plan_from_source(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Plan, MirrorError> {
        let unchanged = self.variant.is_none();
        let (source_digest, ahead) = match src.tag() {
            Some(tag) if src.digest().is_none() && unchanged => {
                self.resolve_and_look_ahead(src, tag, creds, deadline)
                    .await?
            }
            _ => (self.resolve(src, creds, deadline).await?, None),
        };
        let pinned_source = src.with_digest(source_digest.clone());
        if src.digest().is_none()
            && let Some(plan) = self.plan_held(&pinned_source, deadline, ahead).await?
        {
            return Ok(plan);
        }
        // With a platform filter the target holds a filtered index with its
        // own digest; planned_digest computes it without pushing anything.
        // Content under a digest never changes, so it is cached by digest.
        let target_digest = match self.copier.filters_platforms() {
            false => source_digest.clone(),
            // Boxed, as in `resolve`: a request's future is large.
            true => Box::pin(self.planned.try_get_with(
                pinned_source.to_string(),
                self.ask_source(src, deadline, async {
                    Ok(self
                        .copier
                        .planned_digest(&Endpoint::Registry(pinned_source.clone()), creds)
                        .await?)
                }),
            ))
            .await
            .map_err(|e| match Arc::try_unwrap(e) {
                Ok(e) => e,
                Err(shared) => shared.for_waiter(src, &self.target_key()),
            })?,
        };
        let assessed = Box::pin(self.bounded_assessment(
            &pinned_source,
            self.assess(&pinned_source, Role::Source, creds),
            deadline,
        ))
        .await?;
        let repair = match self.collisions {
            CollisionPolicy::Repair => assessed.as_ref().and_then(|a| a.repair.clone()),
            _ => None,
        };
        let target_digest = match &repair {
            Some(r) => r.top.digest.clone(),
            None => target_digest,
        };
        if self.collisions == CollisionPolicy::Repair
            && self.planned.get(&pinned_source.to_string()).await.as_ref() != Some(&target_digest)
        {
            self.planned
                .insert(pinned_source.to_string(), target_digest.clone())
                .await;
        }
        let tag = match src.tag() {
            Some(t) => t.to_owned(),
            None => self.anchor(&source_digest),
        };
        let target = self
            .target
            .map(&src.without_digest().with_tag(&tag)?)?
            .with_digest(target_digest);
        self.record_source(&target, &pinned_source).await;
        // Without a filter or repair, plan_held has just looked.
        let present = unchanged.then_some(false);
        Ok(Plan {
            source: pinned_source,
            target,
            tagged: src.tag().is_some(),
            untagged: false,
            verify: false,
            assessed,
            repair,
            present,
            fallback: None,
            source_known: true,
        })
    }

    /// Resolves `src` (a tag, no digest; no filter or repair, so the
    /// target's digest is the source's) and, when the resolution is not
    /// cached and the existence cache does not vouch for the tag's last
    /// digest, asks the target for the tag at the same time: an uncached
    /// admission then waits for one round trip instead of two, with no
    /// extra request. Returns the source digest and, when asked, the
    /// target's answer.
    ///
    /// # Errors
    /// The resolution's; the target's answer is the caller's to read.
    async fn resolve_and_look_ahead(
        &self,
        src: &Reference,
        tag: &str,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<(Digest, Option<Result<Option<Digest>, MirrorError>>), MirrorError> {
        if let Some(d) = self.cached_resolution(src).await {
            return Ok((d, None));
        }
        let tagged = self.target.map(&src.without_digest().with_tag(tag)?)?;
        let vouched = match self.held_tags.get(&tagged.to_string()).await {
            Some(d) => self.caches.vouches(&tagged.with_digest(d)).await,
            None => false,
        };
        if vouched {
            return Ok((self.resolve(src, creds, deadline).await?, None));
        }
        let (digest, ahead) = tokio::join!(
            self.resolve(src, creds, deadline),
            Box::pin(self.target_tag_digest(&tagged))
        );
        Ok((digest?, Some(ahead)))
    }

    /// Whether the target has the plan's manifest under the plan's tag, as
    /// planning found, else as [`Mirror::target_has_ref`] finds.
    async fn target_has(&self, plan: &Plan) -> Result<bool, MirrorError> {
        match plan.present {
            Some(p) => Ok(p),
            None => self.target_has_ref(&plan.target).await,
        }
    }

    /// Whether the target has `target` (`repository:tag@digest`) under its tag (the
    /// source tag, or the anchor tag of a digest-only source): the existence
    /// cache, else a HEAD by tag compared with the digest, recorded in the
    /// cache when present. By tag, not by digest: the tag must exist too,
    /// both for an unpinned rewrite and so "delete untagged" lifecycle rules
    /// leave the copy alone.
    async fn target_has_ref(&self, target: &Reference) -> Result<bool, MirrorError> {
        if self.caches.has(target).await {
            return Ok(true);
        }
        // Boxed, as in `resolve`: a request's future is large.
        Box::pin(self.head_target(target)).await
    }

    /// The digest the target registry has under `tagged`
    /// (`repository:tag`), by HEAD; `None` when it has none. Called boxed:
    /// a request's future is large, and cached admissions should not carry
    /// its space.
    async fn target_tag_digest(&self, tagged: &Reference) -> Result<Option<Digest>, MirrorError> {
        let client = self.pool.get(tagged.registry(), Role::Target).await?;
        Ok(client.manifest_digest(tagged).await?)
    }

    /// HEAD `target` (`repository:tag@digest`) at the target registry: true
    /// when the tag resolves to the digest. Records a hit in the existence
    /// cache.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when the target does not answer.
    pub async fn head_target(&self, target: &Reference) -> Result<bool, MirrorError> {
        let client = self.pool.get(target.registry(), Role::Target).await?;
        let present = match target.tag() {
            Some(_) => {
                client
                    .manifest_digest(&target.without_digest())
                    .await?
                    .as_ref()
                    == target.digest()
            }
            None => client.manifest_digest(target).await?.is_some(),
        };
        if present {
            self.caches.verified(target).await;
        }
        Ok(present)
    }

    /// The existence-cache and copy-queue key: `repository:tag@digest`.
    fn key(&self, plan: &Plan) -> String {
        plan.target.to_string()
    }

    /// Starts (or joins) the copy for `plan`; it runs to the end in the
    /// background whoever stops waiting for it.
    ///
    /// Background (`delayed`) copies queue for one of the copy slots;
    /// copies an admission waits for (`immediate`, `force`) start at once,
    /// so a backlog of background work cannot make them miss their deadline.
    /// Blob transfers stay bounded by the copier's `--jobs` slots either way.
    /// `resumed`: a retry of the resume queue, whose failures count there.
    fn copy(
        &self,
        plan: &Plan,
        creds: Option<&Credentials>,
        waited_for: bool,
        resumed: bool,
    ) -> CopyHandle {
        let key = self.key(plan);
        let mut inflight = self.inflight.lock().expect("inflight lock");
        if let Some(h) = inflight.get(&key) {
            return h.clone();
        }
        let (src, dst, creds) = (plan.source.clone(), plan.target.clone(), creds.cloned());
        let (repair, pool) = (plan.repair.clone(), self.pool.clone());
        // Without the tag, pushes go by digest and the tag stays put.
        let dst = if plan.untagged {
            dst.without_tag()
        } else {
            dst
        };
        let copier = match plan.verify {
            true => self.verifier.clone(),
            false => self.copier.clone(),
        };
        let (metrics, slots) = (self.metrics.clone(), self.copy_slots.clone());
        let (breakers, resumes, retry) =
            (self.breakers.clone(), self.resumes.clone(), plan.clone());
        let source_key = Self::source_key(&plan.source);
        let target_key = self.target_key();
        let (caches, inflight_map, k) = (self.caches.clone(), self.inflight.clone(), key.clone());
        let follower = self.referrers.clone();
        let source_timeout = self.source_timeout.max(Duration::from_secs(30));
        // A tagged copy whose digest may differ from the source's gets the
        // anchor tag of its source digest too: how another replica finds it
        // while the source cannot answer (a digest-only one has it as its tag).
        let anchor = match (&self.variant, plan.source.digest(), plan.target.digest()) {
            (Some(_), Some(s), Some(d)) if plan.tagged && !plan.untagged => {
                let tagged = plan.target.without_digest().with_tag(&self.anchor(s)).ok();
                tagged.map(|t| (t, d.clone()))
            }
            _ => None,
        };
        // An untagged push verifies the digest, not the tag.
        let target_ref = match plan.untagged {
            true => plan.target.without_tag(),
            false => plan.target.clone(),
        };
        let task = tokio::spawn(async move {
            // Removes the queue entry however the task ends: returned,
            // panicked or aborted. Otherwise a failed handle would be
            // shared with every later caller for the life of the process.
            let _entry = Inflight(inflight_map, k.clone());
            #[cfg(test)]
            tests::maybe_panic(&k);
            let _permit = match waited_for {
                true => None,
                false => Some(slots.acquire_owned().await.expect("never closed")),
            };
            metrics.copies_started.inc();
            let start = Instant::now();
            // A source whose breaker is open is not asked: the copy fails at
            // once and waits in `resumes` for the source to answer again.
            let refused = |open: health::Open| {
                metrics.copies_failed.inc();
                // Never sent: no retry of the resume queue is spent.
                resumes.failed(&k, &retry, creds.as_ref(), false);
                debug!(source = %src, target = %k, %open, "copy waits for its source");
                Err(CopyFailure {
                    reason: format!(
                        "source registry {source_key} cannot answer (circuit breaker open after {open})"
                    ),
                    cause: ErrorCause::Source,
                })
            };
            let attempt = match breakers.attempt(&source_key) {
                Ok(a) => a,
                Err(open) => return refused(open),
            };
            // The breaker's probe is one HEAD, not the whole copy: a copy
            // may run for minutes, and while the probe runs every admission
            // is refused the source.
            let attempt = match attempt.is_probe() {
                false => attempt,
                true => {
                    let probe = async {
                        let client = pool
                            .get_with(src.registry(), Role::Source, creds.as_ref())
                            .await?;
                        client.head_manifest(&src).await.map(drop)
                    };
                    let outage = match tokio::time::timeout(source_timeout, probe).await {
                        Err(_) => Some((
                            crate::registry::Outage::Timeout,
                            None,
                            format!(
                                "no answer within {}",
                                humantime::format_duration(source_timeout)
                            ),
                        )),
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => match (e.registry().map(normalize_registry), e.outage()) {
                            (Some(r), Some((o, retry_after))) if r == source_key => {
                                Some((o, retry_after, e.outage_cause()))
                            }
                            _ => None,
                        },
                    };
                    if let Some((o, retry_after, cause)) = outage {
                        attempt.failed(o, cause.clone(), retry_after);
                        metrics.copies_failed.inc();
                        resumes.failed(&k, &retry, creds.as_ref(), resumed);
                        return Err(CopyFailure {
                            reason: format!("source registry {source_key} cannot answer: {cause}"),
                            cause: ErrorCause::Source,
                        });
                    }
                    attempt.answered();
                    match breakers.attempt(&source_key) {
                        Ok(a) => a,
                        Err(open) => return refused(open),
                    }
                }
            };
            let res = match &repair {
                None => {
                    copier
                        .copy_with(
                            &Endpoint::Registry(src.clone()),
                            &Endpoint::Registry(dst),
                            creds.as_ref(),
                        )
                        .await
                }
                // The original by digest (its blobs and child manifests),
                // then the repaired configs and manifests, the top by tag.
                Some(r) => {
                    let original = dst.without_tag().with_digest(r.original.clone());
                    match copier
                        .copy_with(
                            &Endpoint::Registry(src.clone()),
                            &Endpoint::Registry(original),
                            creds.as_ref(),
                        )
                        .await
                    {
                        Ok(report) => identity_check::push_repair(&pool, &copier, &dst, r)
                            .await
                            .map(|()| report),
                        Err(e) => Err(e),
                    }
                }
            };
            let res = match (res, &anchor) {
                (Ok(report), Some((a, d))) => {
                    let tagged = async {
                        let client = pool.get(a.registry(), Role::Target).await?;
                        copier.tag_manifest(&client, a, d).await
                    };
                    tagged.await.map(|()| report).map_err(CopyError::from)
                }
                (res, _) => res,
            };
            metrics.copy_seconds.observe(start.elapsed().as_secs_f64());
            let outage = res.as_ref().err().and_then(|e| match e {
                CopyError::Registry(r)
                    if r.registry().map(normalize_registry).as_deref() == Some(&source_key) =>
                {
                    r.outage().map(|(o, retry)| (o, retry, r.outage_cause()))
                }
                _ => None,
            });
            match outage {
                Some((o, retry_after, cause)) => {
                    attempt.failed(o, cause, retry_after);
                    resumes.failed(&k, &retry, creds.as_ref(), resumed);
                }
                None => {
                    attempt.answered();
                    resumes.settled(&k);
                }
            }
            match res {
                Ok(r) => {
                    metrics.copies_succeeded.inc();
                    metrics.copy_bytes.inc_by(r.bytes_copied);
                    caches.verified(&target_ref).await;
                    // Referrers follow in the background: the admission
                    // waits for the image alone.
                    if let Some(follower) = &follower
                        && let (Ok(sd), Ok(td)) =
                            (Digest::parse(&r.source_digest), Digest::parse(&r.digest))
                    {
                        follower.spawn(referrers::Follow {
                            source: src.clone(),
                            source_digest: sd,
                            target: target_ref.without_tag().without_digest(),
                            target_digest: td,
                            creds: creds.clone(),
                        });
                    }
                    info!(source = %src, target = %k, bytes = r.bytes_copied, "mirrored");
                    Ok(r.blobs_copied + r.blobs_mounted)
                }
                Err(e) => {
                    metrics.copies_failed.inc();
                    warn!(source = %src, target = %k, error = %e, "mirror copy failed");
                    Err(CopyFailure {
                        reason: e.to_string(),
                        cause: copy_kind(&e, &target_key),
                    })
                }
            }
        });
        // A copy task that panicked failed writing the copy: the target's.
        let handle = async move {
            task.await.unwrap_or_else(|e| {
                Err(CopyFailure {
                    reason: e.to_string(),
                    cause: ErrorCause::Target,
                })
            })
        }
        .boxed()
        .shared();
        inflight.insert(key, handle.clone());
        handle
    }
}

/// A copy-queue entry, removed from the map when the copy's task ends.
struct Inflight(Arc<Mutex<HashMap<String, CopyHandle>>>, String);

impl Drop for Inflight {
    fn drop(&mut self) {
        // A poisoned lock still holds a consistent map: entries are only
        // inserted and removed whole.
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.1);
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
        if self.referrers.is_none() || !self.copier.filters_platforms() {
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

    /// Waits for every copy started so far (a CLI run must not exit while
    /// `copyPolicy: delayed` copies are still in flight). Returns how many
    /// failed.
    pub async fn wait_for_copies(&self) -> usize {
        let handles: Vec<CopyHandle> = self
            .inflight
            .lock()
            .expect("inflight lock")
            .values()
            .cloned()
            .collect();
        let failed = futures::future::join_all(handles)
            .await
            .iter()
            .filter(|r| r.is_err())
            .count();
        // The referrers those copies handed on, too.
        if let Some(f) = &self.referrers {
            f.idle().await;
        }
        failed
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
        let plan = self.plan(src, pod.first(src.registry()), None).await?;
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
    /// imagePullSecrets; the first for the source's registry reads it),
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
        let creds = pod.first(src.registry());
        let plan = self.plan(src, creds, Some(deadline)).await?;
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
                drop(self.copy(&plan, creds, false, false));
                let wait = self.source_retry_in(&plan.source);
                if !wait.is_zero() && !always {
                    return Ok(keep(&format!(
                        "not at the target yet; its source {} cannot answer, so the copy waits for it",
                        Self::source_key(&plan.source)
                    )));
                }
                Ok(if always {
                    rewrite("copy started in the background (swapPolicy always)")
                } else {
                    keep("not at the target yet; copy started in the background")
                })
            }
            CopyPolicy::Immediate | CopyPolicy::Force => {
                let handle = self.copy(&plan, creds, true, false);
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
        let key = m.key(&plan);
        *PANIC_FOR.lock().unwrap() = Some(key.clone());
        let first = m.copy(&plan, None, true, false).await.unwrap_err();
        assert!(first.reason.contains("panic"), "{}", first.reason);
        assert!(m.inflight.lock().unwrap().is_empty(), "entry removed");
        let second = m.copy(&plan, None, true, false).await.unwrap_err();
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
        let resolve = std::mem::size_of_val(&m.resolve(&r, None, None));
        assert!(decide <= 6 * 1024, "decide's future is {decide} bytes");
        assert!(resolve <= 2 * 1024, "resolve's future is {resolve} bytes");
    }
}
