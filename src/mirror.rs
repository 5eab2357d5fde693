//! The mirror service (DESIGN.md §3): resolution and existence caches, a copy
//! queue deduplicated by source digest, and the swap and copy policies. The
//! webhook and `pinswap mutate` both decide through [`Mirror::decide`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use moka::future::Cache;
use tokio::sync::Semaphore;
use tracing::{info, warn};

use crate::config::{Auth, Config, CopyPolicy, Platforms, SwapPolicy};
use crate::metrics::Metrics;
use crate::reference::{Digest, MirrorTarget, Reference, ReferenceError, normalize_registry};
use crate::registry::auth::{CredentialSources, Credentials};
use crate::registry::copy::{Copier, CopyError, CopyOptions, Endpoint};
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
}

/// The outcome for one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The image to write into the Pod, or `None` to leave it unchanged.
    pub image: Option<String>,
    /// Why, in words (it goes into the `pinswap.dev/decisions` annotation).
    pub reason: String,
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
}

type CopyHandle = Shared<BoxFuture<'static, Result<(), String>>>;

/// The mirror service. Cheap to share behind an `Arc`.
pub struct Mirror {
    target: MirrorTarget,
    swap: SwapPolicy,
    copy_policy: CopyPolicy,
    copy_deadline: Duration,
    pin: bool,
    pool: Arc<ClientPool>,
    copier: Arc<Copier>,
    metrics: Arc<Metrics>,
    resolution: Option<Cache<String, Digest>>,
    /// Source digest → target digest (differs with a platform filter).
    /// Content under a digest never changes, so this outlives `resolutionTtl`.
    planned: Cache<String, Digest>,
    existence: Option<Cache<String, Instant>>,
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

/// Reads a config `auth` block into credentials, at startup.
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
        let mut per_registry = HashMap::new();
        if config.target.insecure {
            insecure.push(target.registry().to_owned());
        }
        if let Some(a) = &config.target.auth {
            per_registry.insert(
                (target.registry().to_owned(), Role::Target),
                read_auth(a, target.registry(), "target.auth")?,
            );
        }
        for (i, r) in config.source.registries.iter().enumerate() {
            if r.insecure {
                insecure.push(normalize_registry(&r.registry));
            }
            if let Some(a) = &r.auth {
                per_registry.insert(
                    (normalize_registry(&r.registry), Role::Source),
                    read_auth(a, &r.registry, &format!("source.registries[{i}].auth"))?,
                );
            }
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
        let copier = Arc::new(Copier::new(
            pool.clone(),
            CopyOptions {
                jobs: 4,
                platforms,
                progress: false,
                verify_target: false,
            },
        ));
        fn cache<V: Clone + Send + Sync + 'static>(
            ttl: Duration,
            size: u64,
        ) -> Option<Cache<String, V>> {
            (!ttl.is_zero()).then(|| {
                Cache::builder()
                    .time_to_live(ttl)
                    .max_capacity(size)
                    .build()
            })
        }
        Ok(Self {
            target,
            swap: config.swap_policy,
            copy_policy: config.copy_policy,
            copy_deadline: config.copy_deadline,
            pin: config.pin,
            pool,
            copier,
            metrics,
            resolution: cache(config.cache.resolution_ttl, 10_000),
            planned: Cache::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .max_capacity(10_000)
                .build(),
            existence: cache(config.cache.ttl, 100_000),
            inflight: Arc::default(),
            copy_slots: Arc::new(Semaphore::new(4)),
        })
    }

    /// The mirror target.
    pub fn target(&self) -> &MirrorTarget {
        &self.target
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
            self.metrics.cache("resolution", false);
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
        match &self.resolution {
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
                    self.metrics.cache("resolution", true);
                }
                Ok(d)
            }
            None => fetch.await,
        }
    }

    async fn plan(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
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
        let tag = match src.tag() {
            Some(t) => t.to_owned(),
            None => anchor_tag(&source_digest),
        };
        let target = self
            .target
            .map(&src.without_digest().with_tag(&tag)?)?
            .with_digest(target_digest);
        Ok(Plan {
            source: pinned_source,
            target,
            tagged: src.tag().is_some(),
        })
    }

    /// Whether the target has the plan's manifest under the plan's tag (the
    /// source tag, or the anchor tag of a digest-only source): the existence
    /// cache, else a HEAD by tag compared with the digest, cached for
    /// `cache.ttl` when present. By tag, not by digest: the tag must exist
    /// too, both for an unpinned rewrite and so "delete untagged" lifecycle
    /// rules leave the copy alone.
    async fn target_has(&self, plan: &Plan) -> Result<bool, MirrorError> {
        let key = self.key(plan);
        if let Some(c) = &self.existence
            && c.get(&key).await.is_some()
        {
            self.metrics.cache("existence", true);
            return Ok(true);
        }
        self.metrics.cache("existence", false);
        let target = &plan.target;
        let client = self.pool.get(target.registry(), Role::Target).await?;
        let present = client
            .manifest_digest(&target.without_digest())
            .await?
            .as_ref()
            == target.digest();
        if present && let Some(c) = &self.existence {
            c.insert(key, Instant::now()).await;
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
        let (copier, metrics, slots) = (
            self.copier.clone(),
            self.metrics.clone(),
            self.copy_slots.clone(),
        );
        let (existence, inflight_map, k) =
            (self.existence.clone(), self.inflight.clone(), key.clone());
        let task = tokio::spawn(async move {
            let _permit = match waited_for {
                true => None,
                false => Some(slots.acquire_owned().await.expect("never closed")),
            };
            metrics.copies_started.inc();
            let start = Instant::now();
            let res = copier
                .copy_with(
                    &Endpoint::Registry(src.clone()),
                    &Endpoint::Registry(dst),
                    creds.as_ref(),
                )
                .await;
            metrics.copy_seconds.observe(start.elapsed().as_secs_f64());
            let out = match res {
                Ok(r) => {
                    metrics.copies_succeeded.inc();
                    metrics.copy_bytes.inc_by(r.bytes_copied);
                    if let Some(c) = &existence {
                        c.insert(k.clone(), Instant::now()).await;
                    }
                    info!(source = %src, target = %k, bytes = r.bytes_copied, "mirrored");
                    Ok(())
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
        let plan = self.plan(src, creds).await?;
        let image = self.rewritten(&plan);
        Ok(if self.target_has(&plan).await? {
            Decision {
                image: Some(image),
                reason: "present at the target".into(),
            }
        } else if self.swap == SwapPolicy::Always {
            Decision {
                image: Some(image),
                reason: "dry run: not at the target, not copied (swapPolicy always)".into(),
            }
        } else {
            Decision {
                image: None,
                reason: "dry run: not at the target, not copied".into(),
            }
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
        let plan = self.plan(src, creds).await?;
        let image = self.rewritten(&plan);
        let rewrite = |reason: &str| Decision {
            image: Some(image.clone()),
            reason: reason.to_owned(),
        };
        let keep = |reason: &str| Decision {
            image: None,
            reason: reason.to_owned(),
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
                let wait = self
                    .copy_deadline
                    .min(deadline.saturating_duration_since(Instant::now()));
                match tokio::time::timeout(wait, handle).await {
                    Ok(Ok(())) => Ok(rewrite("copied to the target")),
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
