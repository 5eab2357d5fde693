//! Building the mirror service from the config, and reading its
//! credentials again while it runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moka::future::Cache;
use tracing::{info, warn};

use super::{Mirror, MirrorError, access, copy_variant, health, queue, referrers, resolve, resume};
use crate::cache::Caches;
use crate::config::{Auth, Config, Platforms};
use crate::metrics::Metrics;
use crate::reference::{MirrorTarget, normalize_registry};
use crate::registry::auth::{CredentialSources, Credentials};
use crate::registry::copy::{Copier, CopyOptions};
use crate::registry::ecr::Ecr;
use crate::registry::rate::TransferFloor;
use crate::registry::{ClientPool, PoolOptions, Role};

/// How often `pinswap serve` reads the config's `auth` blocks again.
pub const CREDENTIALS_REFRESH: Duration = Duration::from_secs(300);

/// How long one refresh waits for an `auth` block (a credential helper).
pub(super) const CREDENTIAL_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a config `auth` block into credentials (at startup, and again
/// every [`CREDENTIALS_REFRESH`] under `serve`).
pub(super) fn read_auth(
    auth: &Auth,
    registry: &str,
    path: &str,
) -> Result<Credentials, MirrorError> {
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
pub(super) const HELD_TAGS_TTL_MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

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
            .with_target(&target)
            .with_sources(config.source.registries.iter().map(|r| r.registry.as_str()))
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

    pub(super) fn build(
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
        // minTransferRate 0 turns the floor off.
        let transfer_floor = (config.copy.min_transfer_rate.0 > 0).then_some(TransferFloor {
            bytes_per_second: config.copy.min_transfer_rate.0,
            window: config.copy.transfer_rate_window,
        });
        let options = |verify_target| CopyOptions {
            jobs: config.copy.concurrency,
            platforms: platforms.clone(),
            progress: false,
            verify_target,
            jobs_per_source: Some(config.copy.concurrency_per_registry),
            min_transfer_rate: transfer_floor,
        };
        // The verifier (recovery's copies) has slots of its own, shared by
        // source registry the same way.
        let copier = |verify| {
            let c = Copier::new(pool.clone(), options(verify)).with_metrics(metrics.clone());
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
                config.copy.timeout,
            ))
        });
        let caches = Arc::new(Caches::new(&config.cache, metrics.clone()));
        let target_key = normalize_registry(target.registry());
        let resolver = resolve::Resolver::new(
            pool.clone(),
            breakers.clone(),
            caches.clone(),
            metrics.clone(),
            config.source.timeout,
            target_key.clone(),
        );
        let queue = queue::Queue::new(queue::QueueParts {
            copier,
            verifier,
            pool: pool.clone(),
            metrics: metrics.clone(),
            caches: caches.clone(),
            breakers,
            resumes: Arc::new(resume::Resumes::new(config.source.breaker.clone())),
            referrers,
            source_timeout: config.source.timeout,
            copy_timeout: config.copy.timeout,
            slots: (
                config.copy.concurrency,
                config.copy.concurrency_per_registry,
            ),
            target_key,
            variant: copy_variant(&platforms, config.identity.collisions),
        });
        Ok(Self {
            target,
            swap: config.swap_policy,
            copy_policy: config.copy_policy,
            copy_deadline: config.copy_deadline,
            pin: config.pin,
            pool,
            auths,
            caches,
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
            platforms,
            collisions: config.identity.collisions,
            record: Arc::default(),
            assessed: Cache::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .max_capacity(10_000)
                .build(),
            reported: Mutex::default(),
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
            resolver,
            queue,
            ecr,
            access: access::Access::new(config),
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
}
