//! The mirror service (DESIGN.md §3): the caches of [`crate::cache`], a copy
//! queue deduplicated by source digest, and the swap and copy policies. The
//! webhook and `pinswap mutate` both decide through [`Mirror::decide`].
//!
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

mod identity_check;
mod recover;

pub use recover::Recovered;

use crate::cache::{Caches, Purge};
use crate::config::{Auth, CollisionPolicy, Config, CopyPolicy, Platforms, SwapPolicy};
use crate::identity::{Facts, Record, Repair};
use crate::metrics::Metrics;
use crate::reference::{Digest, MirrorTarget, Reference, ReferenceError, normalize_registry};
use crate::registry::auth::{CredentialSources, Credentials};
use crate::registry::copy::{Copier, CopyError, CopyOptions, Endpoint};
use crate::registry::manifest::PlatformSpec;
use crate::registry::{ClientPool, PoolOptions, RegistryError, Role};

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
    /// Resolution failed for a caller that waited on another's lookup.
    #[error("resolving {image}: {reason}")]
    Resolve {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
    },
    /// The copy the policy waits for failed or ran out of time.
    #[error("copy of {image} failed: {reason}")]
    CopyFailed {
        /// The source image.
        image: String,
        /// Why.
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
    /// annotation, which recovery reads).
    pub source: String,
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

/// A copy's outcome: blobs copied or mounted (what a verifying copy
/// restored), or the error.
type CopyHandle = Shared<BoxFuture<'static, Result<u64, String>>>;

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
    record: Arc<Record>,
    /// Pinned source → identity facts and repair plan.
    assessed: Cache<String, Arc<Assessed>>,
    /// Findings already logged and counted, so each is reported once.
    reported: Mutex<std::collections::HashSet<String>>,
    inflight: Arc<Mutex<HashMap<String, CopyHandle>>>,
    copy_slots: Arc<Semaphore>,
}

/// The tag a digest-only source gets at the target, so "delete untagged"
/// lifecycle rules leave the copy alone. Not `sha256-<hex>`: the referrers
/// tag schema and cosign use that form.
pub fn anchor_tag(digest: &Digest) -> String {
    let hex = digest.hex();
    format!("pinswap-{}", &hex[..hex.len().min(64)])
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

impl Mirror {
    /// Builds the service from a validated config: reads referenced
    /// credentials now, so a missing secret fails at startup.
    ///
    /// # Errors
    /// [`MirrorError::Credentials`] naming the config key;
    /// [`MirrorError::Reference`] for a bad target.
    pub fn from_config(config: &Config, metrics: Arc<Metrics>) -> Result<Self, MirrorError> {
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
        let pool = Arc::new(ClientPool::new(PoolOptions {
            insecure,
            per_registry,
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
        let copier = Arc::new(Copier::new(pool.clone(), options(false)));
        let verifier = Arc::new(Copier::new(pool.clone(), options(true)));
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
            metrics,
            planned: Cache::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .max_capacity(10_000)
                .build(),
            // Idle, not live: the admissions that read an entry keep it.
            sources: Cache::builder()
                .time_to_idle(Duration::from_secs(24 * 3600))
                .max_capacity(100_000)
                .build(),
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
        })
    }

    /// Reads every config `auth` block again (password files, Docker
    /// configs and their credential helpers, each within 30 s) and hands
    /// changed credentials to the client pool, so a rotated secret or an
    /// expiring token (ECR's last 12 h) is picked up without a restart.
    /// Returns how many changed. A block that cannot be read now is logged
    /// and keeps its previous credentials.
    pub async fn refresh_credentials(&self) -> usize {
        let mut changed = 0;
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
        if self.auths.is_empty() {
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
    pub async fn target_ready(&self) -> bool {
        match self.pool.get(self.target.registry(), Role::Target).await {
            Ok(client) => client.ping().await,
            Err(_) => false,
        }
    }

    /// Tag → manifest digest on the source, cached for `cache.resolutionTtl`.
    async fn resolve(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
    ) -> Result<Digest, MirrorError> {
        if let Some(d) = src.digest() {
            return Ok(d.clone());
        }
        let fetch = async {
            self.metrics.cache(crate::cache::RESOLUTION, false);
            let client = self
                .pool
                .get_with(src.registry(), Role::Source, creds)
                .await?;
            Ok::<_, MirrorError>(match client.manifest_digest(src).await? {
                Some(d) => d,
                // HEAD has no body; GET brings the registry's own error code.
                None => client.get_manifest(src).await?.digest,
            })
        };
        match self.caches.resolution() {
            // One lookup per key at a time: callers arriving while it runs
            // wait for it instead of resolving again (moka's coalescing).
            Some(c) => {
                let mut missed = false;
                let d = c
                    .try_get_with(src.to_string(), async {
                        missed = true;
                        fetch.await
                    })
                    .await
                    .map_err(|e| match Arc::try_unwrap(e) {
                        Ok(e) => e,
                        Err(shared) => MirrorError::Resolve {
                            image: src.to_string(),
                            reason: shared.to_string(),
                        },
                    })?;
                if !missed {
                    self.metrics.cache(crate::cache::RESOLUTION, true);
                }
                Ok(d)
            }
            None => fetch.await,
        }
    }

    /// Resolves, maps and assesses `src`. Under `collisions: warn` the
    /// identity check is advisory: with a `deadline` it waits at most half
    /// the time left, and the check goes on in the background for the next
    /// admission.
    async fn plan(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Plan, MirrorError> {
        let source_digest = self.resolve(src, creds).await?;
        let pinned_source = src.with_digest(source_digest.clone());
        // With a platform filter the target holds a filtered index with its
        // own digest; planned_digest computes it without pushing anything.
        // Content under a digest never changes, so it is cached by digest.
        let target_digest = self
            .planned
            .try_get_with(pinned_source.to_string(), async {
                self.copier
                    .planned_digest(&Endpoint::Registry(pinned_source.clone()), creds)
                    .await
            })
            .await
            .map_err(|e| MirrorError::Resolve {
                image: src.to_string(),
                reason: e.to_string(),
            })?;
        let assessing = self.assess(&pinned_source, creds);
        let assessed = match (self.collisions, deadline) {
            (CollisionPolicy::Warn, Some(d)) => {
                let now = Instant::now();
                let until = now + d.saturating_duration_since(now) / 2;
                match tokio::time::timeout_at(until.into(), assessing).await {
                    Ok(r) => Some(r),
                    Err(_) => {
                        debug!(image = %pinned_source, "identity check still running; this admission goes without it");
                        None
                    }
                }
            }
            _ => Some(assessing.await),
        };
        let assessed = match assessed {
            Some(Ok(a)) => Some(a),
            None => None,
            Some(Err(e)) if self.collisions == CollisionPolicy::Warn => {
                warn!(image = %pinned_source, error = %e, "identity check failed; rewriting without it");
                None
            }
            Some(Err(e)) => return Err(e),
        };
        let repair = match self.collisions {
            CollisionPolicy::Repair => assessed.as_ref().and_then(|a| a.repair.clone()),
            _ => None,
        };
        let target_digest = match &repair {
            Some(r) => r.top.digest.clone(),
            None => target_digest,
        };
        let tag = match src.tag() {
            Some(t) => t.to_owned(),
            None => anchor_tag(&source_digest),
        };
        let target = self
            .target
            .map(&src.without_digest().with_tag(&tag)?)?
            .with_digest(target_digest);
        // A moka insert is a write (queued, then applied by housekeeping):
        // skip it when the entry already says this.
        let key = target.without_tag().to_string();
        if self.sources.get(&key).await.as_ref() != Some(&pinned_source) {
            self.sources.insert(key, pinned_source.clone()).await;
        }
        Ok(Plan {
            source: pinned_source,
            target,
            tagged: src.tag().is_some(),
            untagged: false,
            verify: false,
            assessed,
            repair,
        })
    }

    /// Whether the target has the plan's manifest under the plan's tag (the
    /// source tag, or the anchor tag of a digest-only source): the existence
    /// cache, else a HEAD by tag compared with the digest, recorded in the
    /// cache when present. By tag, not by digest: the tag must exist too,
    /// both for an unpinned rewrite and so "delete untagged" lifecycle rules
    /// leave the copy alone.
    async fn target_has(&self, plan: &Plan) -> Result<bool, MirrorError> {
        if self.caches.has(&plan.target).await {
            return Ok(true);
        }
        self.head_target(&plan.target).await
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
    fn copy(&self, plan: &Plan, creds: Option<&Credentials>, waited_for: bool) -> CopyHandle {
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
        let (caches, inflight_map, k) = (self.caches.clone(), self.inflight.clone(), key.clone());
        // An untagged push verifies the digest, not the tag.
        let target_ref = match plan.untagged {
            true => plan.target.without_tag(),
            false => plan.target.clone(),
        };
        let task = tokio::spawn(async move {
            let _permit = match waited_for {
                true => None,
                false => Some(slots.acquire_owned().await.expect("never closed")),
            };
            metrics.copies_started.inc();
            let start = Instant::now();
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
            metrics.copy_seconds.observe(start.elapsed().as_secs_f64());
            let out = match res {
                Ok(r) => {
                    metrics.copies_succeeded.inc();
                    metrics.copy_bytes.inc_by(r.bytes_copied);
                    caches.verified(&target_ref).await;
                    info!(source = %src, target = %k, bytes = r.bytes_copied, "mirrored");
                    Ok(r.blobs_copied + r.blobs_mounted)
                }
                Err(e) => {
                    metrics.copies_failed.inc();
                    warn!(source = %src, target = %k, error = %e, "mirror copy failed");
                    Err(e.to_string())
                }
            };
            inflight_map.lock().expect("inflight lock").remove(&k);
            out
        });
        let handle = async move { task.await.unwrap_or_else(|e| Err(e.to_string())) }
            .boxed()
            .shared();
        inflight.insert(key, handle.clone());
        handle
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
        futures::future::join_all(handles)
            .await
            .iter()
            .filter(|r| r.is_err())
            .count()
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
        creds: Option<&Credentials>,
    ) -> Result<Decision, MirrorError> {
        let plan = self.plan(src, creds, None).await?;
        let image = self.rewritten(&plan);
        let identity = self.identity_note(&plan, src, true)?;
        let (image, reason) = if self.target_has(&plan).await? {
            (Some(image), "present at the target")
        } else if self.swap == SwapPolicy::Always {
            (
                Some(image),
                "dry run: not at the target, not copied (swapPolicy always)",
            )
        } else {
            (None, "dry run: not at the target, not copied")
        };
        Ok(Decision {
            image,
            reason: reason.into(),
            identity,
            source: plan.source.to_string(),
        })
    }

    /// Decides what `src` becomes, reading the source with `creds` (a Pod's
    /// imagePullSecrets) when given, under the swap and copy policies
    /// (DESIGN.md §2), without passing `deadline`:
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
        creds: Option<&Credentials>,
    ) -> Result<Decision, MirrorError> {
        let plan = self.plan(src, creds, Some(deadline)).await?;
        let image = self.rewritten(&plan);
        let identity = self.identity_note(&plan, src, false)?;
        let source = plan.source.to_string();
        let rewrite = |reason: &str| Decision {
            image: Some(image.clone()),
            reason: reason.to_owned(),
            identity: identity.clone(),
            source: source.clone(),
        };
        let keep = |reason: &str| Decision {
            image: None,
            reason: reason.to_owned(),
            identity: identity.clone(),
            source: source.clone(),
        };
        let always = self.swap == SwapPolicy::Always;
        if self.target_has(&plan).await? {
            return Ok(rewrite("present at the target"));
        }
        match self.copy_policy {
            CopyPolicy::None if always => Ok(rewrite("swapPolicy always (copyPolicy none)")),
            CopyPolicy::None => Ok(keep("not at the target and copyPolicy is none")),
            CopyPolicy::Delayed => {
                drop(self.copy(&plan, creds, false));
                Ok(if always {
                    rewrite("copy started in the background (swapPolicy always)")
                } else {
                    keep("not at the target yet; copy started in the background")
                })
            }
            CopyPolicy::Immediate | CopyPolicy::Force => {
                let handle = self.copy(&plan, creds, true);
                // The admission's own timeout ends at `deadline` too: waiting
                // until that same instant, not a duration computed a moment
                // later, lets this wait answer ("copy still running") rather
                // than the admission's ("budget exhausted", an error).
                let until = (Instant::now() + self.copy_deadline).min(deadline);
                let wait = until.saturating_duration_since(Instant::now());
                match tokio::time::timeout_at(until.into(), handle).await {
                    Ok(Ok(_)) => Ok(rewrite("copied to the target")),
                    Ok(Err(reason)) if self.copy_policy == CopyPolicy::Immediate && always => {
                        warn!(image = %src, %reason, "copy failed; rewriting anyway (swapPolicy always)");
                        Ok(rewrite("copy failed (swapPolicy always)"))
                    }
                    Ok(Err(reason)) => Err(MirrorError::CopyFailed {
                        image: src.to_string(),
                        reason,
                    }),
                    Err(_) if self.copy_policy == CopyPolicy::Force => {
                        Err(MirrorError::CopyFailed {
                            image: src.to_string(),
                            reason: format!(
                                "not done within {} (copyPolicy force)",
                                humantime::format_duration(wait)
                            ),
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
