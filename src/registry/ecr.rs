//! Amazon ECR as a target (`target.aws`): registry credentials from
//! `GetAuthorizationToken`, and each repository created (with the config's
//! `ecrOptions` and policies) before the first push into it, since ECR
//! refuses pushes to repositories that do not exist.
//!
//! pinswap marks each repository it creates with [`MANAGED_BY`], and
//! changes the settings of an existing repository only when it is its own:
//! marked, or (with a prefix) named as a mirror path under the prefix. When
//! that cannot be told (the tags cannot be read), the repository is left
//! as it is.
//!
//! AWS credentials come from the official SDK's default chain (environment,
//! web identity token for IRSA, EKS Pod Identity and other container
//! credentials, shared profile, instance metadata), or from `role` assumed
//! through STS on top of that chain. No signing is done here.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::provider::SharedCredentialsProvider;
use aws_sdk_ecr::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ecr::types::{
    EncryptionConfiguration, EncryptionType, ImageScanningConfiguration, ImageTagMutability, Tag,
};
use aws_smithy_types::error::display::DisplayErrorContext;
use base64::Engine;
use futures::FutureExt;
use futures::future::BoxFuture;
use tracing::{debug, info, warn};

use super::RegistryError;
use super::auth::Credentials;
use super::copy::BeforePush;
use crate::config::Aws;
use crate::metrics::Metrics;
use crate::reference::{MirrorTarget, USAGE_REPOSITORY, is_usage_repository, normalize_registry};

/// The resource tag (key, value) pinswap puts on every repository it
/// creates, besides `ecrOptions.tags` (a tag there with this key is
/// replaced). It tells pinswap's repositories from the others in the
/// registry: only a repository carrying it, or with a prefix one named as a
/// mirror path under it, is ever brought in line with `ecrOptions`.
pub const MANAGED_BY: (&str, &str) = ("pinswap.dev/managed-by", "pinswap");

/// ECR errors. Each names the IAM action and, where there is one, the
/// repository; none carries a credential.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EcrError {
    /// The caller's IAM policy does not allow `action`.
    #[error(
        "missing IAM permission {action} on {}: {code}: {message}; allow {action} for pinswap's AWS identity (see the IAM policy in docs/configuration.md)",
        on(.repository)
    )]
    Denied {
        /// The IAM action, e.g. `ecr:CreateRepository`.
        action: &'static str,
        /// The repository, if the call had one.
        repository: Option<String>,
        /// AWS's error code, e.g. `AccessDeniedException`.
        code: String,
        /// AWS's message.
        message: String,
    },
    /// AWS answered with another error.
    #[error("{action} on {} failed: {code}: {message}", on(.repository))]
    Api {
        /// The IAM action.
        action: &'static str,
        /// The repository, if the call had one.
        repository: Option<String>,
        /// AWS's error code.
        code: String,
        /// AWS's message.
        message: String,
    },
    /// No answer from AWS: no credentials, a failed role assumption, a
    /// timeout, a connection error.
    #[error("{action} on {} failed: {reason}", on(.repository))]
    Call {
        /// The IAM action.
        action: &'static str,
        /// The repository, if the call had one.
        repository: Option<String>,
        /// The SDK's error chain.
        reason: String,
    },
    /// `GetAuthorizationToken` answered without a usable token.
    #[error("ecr:GetAuthorizationToken returned no usable token: {0}")]
    Token(String),
}

fn on(repository: &Option<String>) -> String {
    match repository {
        Some(r) => format!("repository {r}"),
        None => "the registry".into(),
    }
}

/// Result alias.
pub type Result<T, E = EcrError> = std::result::Result<T, E>;

impl EcrError {
    fn from_sdk<E>(
        action: &'static str,
        repository: Option<&str>,
        e: &SdkError<E, aws_sdk_ecr::config::http::HttpResponse>,
    ) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let repository = repository.map(str::to_owned);
        // Denied or another API error, by code (or HTTP 403).
        let answered = |code: String, message: String, forbidden: bool| {
            if forbidden || code.starts_with("AccessDenied") || code == "UnauthorizedOperation" {
                EcrError::Denied {
                    action,
                    repository: repository.clone(),
                    code,
                    message,
                }
            } else {
                EcrError::Api {
                    action,
                    repository: repository.clone(),
                    code,
                    message,
                }
            }
        };
        match (e.code(), e.as_service_error(), e.raw_response()) {
            (Some(code), Some(_), _) => answered(
                code.to_owned(),
                e.message().unwrap_or_default().to_owned(),
                false,
            ),
            // An answer the SDK could not parse (a proxy, a stand-in
            // answering in another protocol): its status and body text.
            (_, _, Some(raw)) => {
                let status = raw.status().as_u16();
                let body = raw
                    .body()
                    .bytes()
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                let (code, message) = error_fields(&body);
                answered(
                    code.unwrap_or_else(|| format!("HTTP {status}")),
                    message.unwrap_or_else(|| body.chars().take(300).collect()),
                    status == 403,
                )
            }
            _ => EcrError::Call {
                action,
                repository,
                reason: DisplayErrorContext(e).to_string(),
            },
        }
    }
}

/// The error code and message of an AWS error body, JSON
/// (`__type`, `message`) or XML (`<Code>`, `<Message>`).
fn error_fields(body: &str) -> (Option<String>, Option<String>) {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
        let code = field("__type").map(|t| t.rsplit('#').next().unwrap_or(&t).to_owned());
        return (code, field("message").or_else(|| field("Message")));
    }
    let tag = |t: &str| {
        let open = format!("<{t}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find(&format!("</{t}>"))? + start;
        Some(body[start..end].to_owned())
    };
    (tag("Code"), tag("Message"))
}

/// How many AWS calls of each kind were made; for logs and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EcrStats {
    /// `DescribeRepositories` calls.
    pub describes: u64,
    /// `CreateRepository` calls (including ones answered
    /// `RepositoryAlreadyExistsException`).
    pub creates: u64,
    /// `GetAuthorizationToken` calls.
    pub tokens: u64,
    /// Failed `SetRepositoryPolicy` and `PutLifecyclePolicy` calls, failed
    /// reconciles, and existing repositories left as they are because
    /// `ListTagsForResource` failed (whether pinswap made them is unknown).
    pub policy_failures: u64,
    /// Existing repositories found not to be pinswap's (no [`MANAGED_BY`]
    /// tag, no mirror path under the prefix): pushed into, never changed.
    pub foreign: u64,
}

#[derive(Default)]
struct Counters {
    describes: AtomicU64,
    creates: AtomicU64,
    tokens: AtomicU64,
    policy_failures: AtomicU64,
    foreign: AtomicU64,
}

/// The SDK config loader pinswap uses: `region`, hyper 1 with rustls on
/// ring (the SDK's default client brings aws-lc), 3 s to connect and 10 s
/// per attempt. Credentials and endpoints come from the default chain
/// unless set on the loader.
pub fn sdk_loader(region: &str) -> aws_config::ConfigLoader {
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_owned()))
        .http_client(http)
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(3))
                .operation_attempt_timeout(Duration::from_secs(10))
                .build(),
        )
}

/// The SDK config from the default chain (environment, web identity token,
/// EKS Pod Identity and container credentials, shared profile, instance
/// metadata), in `region`. Endpoints can be overridden the SDK's way
/// (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_ECR`, `AWS_ENDPOINT_URL_STS`).
pub async fn default_sdk_config(region: &str) -> SdkConfig {
    sdk_loader(region).load().await
}

/// An ECR target: one registry (account and region), its repository
/// settings, and the repositories known to exist.
pub struct Ecr {
    client: aws_sdk_ecr::Client,
    account: String,
    /// The target registry host, normalised: pushes elsewhere are not ours.
    host: String,
    options: crate::config::EcrOptions,
    /// The target when it has a prefix: a repository named as one of its
    /// mirror paths (or its usage repository) is pinswap's, marked or not
    /// (made before repositories were marked). Without a prefix, only the
    /// mark tells.
    prefixed: Option<MirrorTarget>,
    /// The source registries the allowlist names, normalised; `None`
    /// (or `"*"` among them) allows any. A mirror path of another source
    /// is not pinswap's by its name.
    sources: Option<Vec<String>>,
    /// Repositories known to exist. `try_get_with` coalesces concurrent
    /// first pushes into one describe-or-create per repository.
    known: moka::future::Cache<String, ()>,
    /// Repositories this process created whose access or lifecycle policy
    /// is not applied yet: applied before the next push into them.
    unconfigured: Mutex<HashSet<String>>,
    /// When the current registry token was fetched and when it expires.
    token: Mutex<Option<(SystemTime, SystemTime)>>,
    counters: Counters,
    metrics: Option<Arc<Metrics>>,
}

/// Repositories remembered as created but not configured, at most (as many
/// as are remembered as existing).
const MAX_UNCONFIGURED: usize = 100_000;

/// How long a repository is remembered as existing. A repository deleted
/// behind pinswap's back is created again after this long at most.
const KNOWN_TTL: Duration = Duration::from_secs(3600);

impl Ecr {
    /// An ECR target for `aws`, whose data plane is `host` (the target
    /// registry, under `aws.prefix`), with AWS credentials from the default
    /// chain and `role` assumed on top when set.
    pub async fn connect(aws: &Aws, host: &str) -> Self {
        Self::connect_with(aws, host, default_sdk_config(&aws.region).await).await
    }

    /// As [`Ecr::connect`], on a given SDK config (credentials, region,
    /// endpoint, HTTP client). `role` is still assumed on top of it.
    pub async fn connect_with(aws: &Aws, host: &str, base: SdkConfig) -> Self {
        let sdk = match &aws.role {
            Some(role) => {
                let provider = aws_config::sts::AssumeRoleProvider::builder(role.clone())
                    .session_name("pinswap")
                    .configure(&base)
                    .build()
                    .await;
                base.to_builder()
                    .credentials_provider(SharedCredentialsProvider::new(provider))
                    .build()
            }
            None => base,
        };
        Self {
            client: aws_sdk_ecr::Client::new(&sdk),
            account: aws.account_id.clone(),
            host: normalize_registry(host),
            options: aws.ecr_options.clone(),
            prefixed: aws
                .prefix()
                .and_then(|p| MirrorTarget::parse(&format!("{host}/{p}")).ok()),
            sources: None,
            known: moka::future::Cache::builder()
                .time_to_live(KNOWN_TTL)
                .max_capacity(100_000)
                .build(),
            unconfigured: Mutex::default(),
            token: Mutex::new(None),
            counters: Counters::default(),
            metrics: None,
        }
    }

    /// Takes the prefix from `target` (a `target.registry` may carry one
    /// of its own): the prefix of the mirror paths counted as pinswap's,
    /// and of the leader's pass.
    pub fn with_target(mut self, target: &MirrorTarget) -> Self {
        self.prefixed = target.prefix().is_some().then(|| target.clone());
        self
    }

    /// Only mirror paths of these source registries (the config's
    /// `source.registries`) count as pinswap's by their name.
    pub fn with_sources<'a>(mut self, registries: impl IntoIterator<Item = &'a str>) -> Self {
        let all: Vec<String> = registries.into_iter().map(normalize_registry).collect();
        self.sources = (!all.iter().any(|r| r == "*")).then_some(all);
        self
    }

    /// Counts policy failures in `pinswap_ecr_policy_failures_total`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Calls so far.
    pub fn stats(&self) -> EcrStats {
        EcrStats {
            describes: self.counters.describes.load(Ordering::Relaxed),
            creates: self.counters.creates.load(Ordering::Relaxed),
            tokens: self.counters.tokens.load(Ordering::Relaxed),
            policy_failures: self.counters.policy_failures.load(Ordering::Relaxed),
            foreign: self.counters.foreign.load(Ordering::Relaxed),
        }
    }

    /// The registry host this target pushes to, normalised.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Registry credentials (`AWS` and a token valid for 12 hours) from
    /// `ecr:GetAuthorizationToken`.
    ///
    /// # Errors
    /// [`EcrError::Denied`] naming `ecr:GetAuthorizationToken`, other API
    /// and call errors, [`EcrError::Token`] for an unreadable answer.
    pub async fn authorization(&self) -> Result<Credentials> {
        const ACTION: &str = "ecr:GetAuthorizationToken";
        self.counters.tokens.fetch_add(1, Ordering::Relaxed);
        #[allow(deprecated)] // registryIds: still the way to name the account.
        let out = self
            .client
            .get_authorization_token()
            .registry_ids(&self.account)
            .send()
            .await
            .map_err(|e| EcrError::from_sdk(ACTION, None, &e))?;
        let data = out
            .authorization_data()
            .first()
            .ok_or_else(|| EcrError::Token("no authorizationData".into()))?;
        let encoded = data
            .authorization_token()
            .ok_or_else(|| EcrError::Token("no authorizationToken".into()))?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .ok_or_else(|| EcrError::Token("authorizationToken is not base64 text".into()))?;
        let (user, password) = decoded
            .split_once(':')
            .ok_or_else(|| EcrError::Token("authorizationToken is not USER:PASSWORD".into()))?;
        let now = SystemTime::now();
        let expires = data
            .expires_at()
            .and_then(|t| SystemTime::try_from(*t).ok())
            .unwrap_or(now + Duration::from_secs(12 * 3600));
        *self.token.lock().unwrap_or_else(|e| e.into_inner()) = Some((now, expires));
        debug!(registry = %self.host, expires = %humantime::format_rfc3339_seconds(expires), "ECR registry token fetched");
        Ok(Credentials::new(user, password))
    }

    /// Whether the registry token should be fetched again at `now`: none
    /// yet, or half of its lifetime gone (ECR's last 12 hours, so renewal
    /// starts 6 hours before expiry and has many refresh rounds to succeed).
    pub fn token_due(&self, now: SystemTime) -> bool {
        match *self.token.lock().unwrap_or_else(|e| e.into_inner()) {
            None => true,
            Some((fetched, expires)) => {
                let life = expires.duration_since(fetched).unwrap_or_default();
                now >= fetched + life / 2
            }
        }
    }

    /// Makes sure `repository` exists: remembered, else
    /// `DescribeRepositories`, else `CreateRepository` with `ecrOptions`
    /// and [`MANAGED_BY`], then the access and lifecycle policies. An
    /// existing repository is reconciled with `ecrOptions` only when it is
    /// pinswap's; any other is pushed into as it is. Concurrent callers
    /// for one repository share one check;
    /// `RepositoryAlreadyExistsException` (another replica was first)
    /// counts as success.
    ///
    /// # Errors
    /// [`EcrError::Denied`] naming the missing IAM action, other API and
    /// call errors; each names the repository.
    pub async fn ensure_repository(&self, repository: &str) -> Result<()> {
        self.known
            .try_get_with(repository.to_owned(), self.describe_or_create(repository))
            .await
            .map_err(|e| (*e).clone())
    }

    async fn describe_or_create(&self, repository: &str) -> Result<()> {
        self.counters.describes.fetch_add(1, Ordering::Relaxed);
        let described = self
            .client
            .describe_repositories()
            .registry_id(&self.account)
            .repository_names(repository)
            .send()
            .await;
        match described {
            Ok(out) => {
                debug!(repository, "ECR repository exists");
                // Created by this process, but its policies failed: retry
                // them, or they would never be applied.
                let unconfigured = self
                    .unconfigured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(repository);
                if unconfigured {
                    return self.configure(repository).await;
                }
                // Made before this start, perhaps under other ecrOptions,
                // perhaps by someone else: only pinswap's own is changed.
                if let Some(r) = out.repositories().first() {
                    match self.made_by_pinswap(repository, r).await {
                        Ok(true) => self.reconcile(repository, r).await,
                        Ok(false) => {
                            self.counters.foreign.fetch_add(1, Ordering::Relaxed);
                            debug!(
                                repository,
                                "ECR repository not made by pinswap: pushed into, its settings left as they are"
                            );
                        }
                        Err(e) => {
                            self.count_failure(&e);
                            warn!(repository, error = %e, "ECR repository left as it is: whether pinswap made it is unknown");
                        }
                    }
                }
                return Ok(());
            }
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_repository_not_found_exception()) => {}
            Err(e) => {
                return Err(EcrError::from_sdk(
                    "ecr:DescribeRepositories",
                    Some(repository),
                    &e,
                ));
            }
        }
        self.create(repository).await
    }

    async fn create(&self, repository: &str) -> Result<()> {
        const ACTION: &str = "ecr:CreateRepository";
        let o = &self.options;
        let bad_option = |reason: String| EcrError::Call {
            action: ACTION,
            repository: Some(repository.to_owned()),
            reason,
        };
        let mut encryption = EncryptionConfiguration::builder().encryption_type(
            EncryptionType::from(o.encryption_configuration.encryption_type.as_str()),
        );
        if !o.encryption_configuration.kms_key.is_empty() {
            encryption = encryption.kms_key(&o.encryption_configuration.kms_key);
        }
        let encryption = encryption.build().map_err(|e| bad_option(e.to_string()))?;
        let (key, value) = MANAGED_BY;
        let tags = o
            .tags
            .iter()
            .filter(|t| t.key != key)
            .map(|t| (t.key.as_str(), t.value.as_str()))
            .chain([(key, value)])
            .map(|(k, v)| Tag::builder().key(k).value(v).build())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad_option(e.to_string()))?;
        self.counters.creates.fetch_add(1, Ordering::Relaxed);
        let created = self
            .client
            .create_repository()
            .registry_id(&self.account)
            .repository_name(repository)
            .image_tag_mutability(tag_mutability(repository, &o.image_tag_mutability))
            .image_scanning_configuration(
                ImageScanningConfiguration::builder()
                    .scan_on_push(o.image_scanning_configuration.image_scan_on_push)
                    .build(),
            )
            .encryption_configuration(encryption)
            .set_tags(Some(tags))
            .send()
            .await;
        match created {
            Ok(_) => info!(repository, "ECR repository created"),
            // Created by someone else since we looked: theirs to configure.
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_repository_already_exists_exception()) =>
            {
                debug!(repository, "ECR repository created concurrently elsewhere");
                return Ok(());
            }
            Err(e) => return Err(EcrError::from_sdk(ACTION, Some(repository), &e)),
        }
        self.configure(repository).await
    }

    /// Applies `ecrOptions`' access and lifecycle policies to `repository`.
    /// Until both are applied the repository stays unconfigured: the error
    /// fails this push, and the next push into it tries again.
    async fn configure(&self, repository: &str) -> Result<()> {
        let applied = self.apply_policies(repository).await;
        let mut unconfigured = self.unconfigured.lock().unwrap_or_else(|e| e.into_inner());
        match &applied {
            Ok(()) => {
                unconfigured.remove(repository);
            }
            Err(e) => {
                self.count_failure(e);
                warn!(repository, error = %e, "ECR repository policy not applied; retried before the next push into it");
                if unconfigured.len() < MAX_UNCONFIGURED {
                    unconfigured.insert(repository.to_owned());
                }
            }
        }
        applied
    }

    /// Counts a failed call in the stats and in
    /// `pinswap_ecr_policy_failures_total{action}`.
    fn count_failure(&self, e: &EcrError) {
        self.counters
            .policy_failures
            .fetch_add(1, Ordering::Relaxed);
        if let (
            Some(m),
            EcrError::Denied { action, .. }
            | EcrError::Api { action, .. }
            | EcrError::Call { action, .. },
        ) = (&self.metrics, e)
        {
            m.ecr_policy_failure(action);
        }
    }

    /// Whether the existing `repository` (as `described`) is pinswap's:
    /// with a prefix, named as a mirror path or the usage repository under
    /// it; else carrying [`MANAGED_BY`], read with `ListTagsForResource`.
    ///
    /// # Errors
    /// When the tags cannot be read: then nobody knows, and the caller
    /// changes nothing.
    async fn made_by_pinswap(
        &self,
        repository: &str,
        described: &aws_sdk_ecr::types::Repository,
    ) -> Result<bool> {
        const ACTION: &str = "ecr:ListTagsForResource";
        if let Some(t) = &self.prefixed {
            let usage = t
                .prefix()
                .and_then(|p| repository.strip_prefix(p)?.strip_prefix('/'))
                == Some(USAGE_REPOSITORY);
            let allowed = |s: &crate::reference::Reference| {
                self.sources
                    .as_ref()
                    .is_none_or(|all| all.iter().any(|r| *r == normalize_registry(s.registry())))
            };
            if usage || t.source_of(repository).is_some_and(|s| allowed(&s)) {
                return Ok(true);
            }
        }
        let arn = described.repository_arn().ok_or_else(|| EcrError::Call {
            action: ACTION,
            repository: Some(repository.to_owned()),
            reason: "DescribeRepositories answered without the repository's ARN".into(),
        })?;
        let out = self
            .client
            .list_tags_for_resource()
            .resource_arn(arn)
            .send()
            .await
            .map_err(|e| EcrError::from_sdk(ACTION, Some(repository), &e))?;
        let (key, value) = MANAGED_BY;
        Ok(out
            .tags()
            .iter()
            .any(|t| t.key() == key && t.value() == value))
    }

    /// Brings an existing `repository` (as `described`) to `ecrOptions`:
    /// tag mutability, scan on push, and the access and lifecycle
    /// policies where the config sets them (compared as JSON; an empty
    /// option leaves the repository's own alone). A config change rolls
    /// the Pods, so each repository is reconciled at its first use after
    /// it. Encryption cannot change after creation. A failure is logged
    /// and counted, and the push goes on.
    async fn reconcile(&self, repository: &str, described: &aws_sdk_ecr::types::Repository) {
        let mut changed = Vec::new();
        let result = self
            .reconcile_settings(repository, described, &mut changed)
            .await;
        match result {
            Ok(()) if changed.is_empty() => {}
            Ok(()) => {
                info!(repository, changed = ?changed, "ECR repository reconciled with ecrOptions")
            }
            Err(e) => {
                self.count_failure(&e);
                warn!(repository, error = %e, "ECR repository not reconciled with ecrOptions; it keeps its settings until the next start");
            }
        }
    }

    async fn reconcile_settings(
        &self,
        repository: &str,
        described: &aws_sdk_ecr::types::Repository,
        changed: &mut Vec<&'static str>,
    ) -> Result<()> {
        let o = &self.options;
        let mutability = tag_mutability(repository, &o.image_tag_mutability);
        if described.image_tag_mutability() != Some(&mutability) {
            self.client
                .put_image_tag_mutability()
                .registry_id(&self.account)
                .repository_name(repository)
                .image_tag_mutability(mutability)
                .send()
                .await
                .map_err(|e| {
                    EcrError::from_sdk("ecr:PutImageTagMutability", Some(repository), &e)
                })?;
            changed.push("imageTagMutability");
        }
        let scan = o.image_scanning_configuration.image_scan_on_push;
        if described
            .image_scanning_configuration()
            .map(|c| c.scan_on_push())
            != Some(scan)
        {
            self.client
                .put_image_scanning_configuration()
                .registry_id(&self.account)
                .repository_name(repository)
                .image_scanning_configuration(
                    ImageScanningConfiguration::builder()
                        .scan_on_push(scan)
                        .build(),
                )
                .send()
                .await
                .map_err(|e| {
                    EcrError::from_sdk("ecr:PutImageScanningConfiguration", Some(repository), &e)
                })?;
            changed.push("imageScanningConfiguration");
        }
        if !o.access_policy.is_empty() {
            let current = match self
                .client
                .get_repository_policy()
                .registry_id(&self.account)
                .repository_name(repository)
                .send()
                .await
            {
                Ok(p) => p.policy_text().map(str::to_owned),
                Err(e)
                    if e.as_service_error()
                        .is_some_and(|s| s.is_repository_policy_not_found_exception()) =>
                {
                    None
                }
                Err(e) => {
                    return Err(EcrError::from_sdk(
                        "ecr:GetRepositoryPolicy",
                        Some(repository),
                        &e,
                    ));
                }
            };
            if !same_json(current.as_deref(), &o.access_policy) {
                self.client
                    .set_repository_policy()
                    .registry_id(&self.account)
                    .repository_name(repository)
                    .policy_text(&o.access_policy)
                    .send()
                    .await
                    .map_err(|e| {
                        EcrError::from_sdk("ecr:SetRepositoryPolicy", Some(repository), &e)
                    })?;
                changed.push("accessPolicy");
            }
        }
        if !o.lifecycle_policy.is_empty() && !is_usage_repository(repository) {
            let current = match self
                .client
                .get_lifecycle_policy()
                .registry_id(&self.account)
                .repository_name(repository)
                .send()
                .await
            {
                Ok(p) => p.lifecycle_policy_text().map(str::to_owned),
                Err(e)
                    if e.as_service_error()
                        .is_some_and(|s| s.is_lifecycle_policy_not_found_exception()) =>
                {
                    None
                }
                Err(e) => {
                    return Err(EcrError::from_sdk(
                        "ecr:GetLifecyclePolicy",
                        Some(repository),
                        &e,
                    ));
                }
            };
            if !same_json(current.as_deref(), &o.lifecycle_policy) {
                self.client
                    .put_lifecycle_policy()
                    .registry_id(&self.account)
                    .repository_name(repository)
                    .lifecycle_policy_text(&o.lifecycle_policy)
                    .send()
                    .await
                    .map_err(|e| {
                        EcrError::from_sdk("ecr:PutLifecyclePolicy", Some(repository), &e)
                    })?;
                changed.push("lifecyclePolicy");
            }
        }
        Ok(())
    }

    /// Reconciles with `ecrOptions` every repository of pinswap's under
    /// the prefix (the whole registry without one), at most `per_second`
    /// a second (ECR's API limits are per account): the count looked at.
    /// Other repositories are left as they are, as at a first push.
    ///
    /// # Errors
    /// When the repositories cannot be listed; a repository that cannot
    /// be reconciled is logged and counted, and the pass goes on.
    pub async fn reconcile_all(&self, per_second: u32) -> Result<usize> {
        let gap = Duration::from_secs(1) / per_second.max(1);
        let prefix = self.prefixed.as_ref().and_then(MirrorTarget::prefix);
        let mut done = 0;
        for name in self.repositories().await? {
            let under = match prefix {
                Some(p) => name.strip_prefix(p).is_some_and(|r| r.starts_with('/')),
                None => true,
            };
            if !under {
                continue;
            }
            if self.ensure_repository(&name).await.is_ok() {
                done += 1;
            }
            tokio::time::sleep(gap).await;
        }
        Ok(done)
    }

    async fn apply_policies(&self, repository: &str) -> Result<()> {
        let o = &self.options;
        if !o.access_policy.is_empty() {
            self.client
                .set_repository_policy()
                .registry_id(&self.account)
                .repository_name(repository)
                .policy_text(&o.access_policy)
                .send()
                .await
                .map_err(|e| EcrError::from_sdk("ecr:SetRepositoryPolicy", Some(repository), &e))?;
        }
        if !o.lifecycle_policy.is_empty() && !is_usage_repository(repository) {
            self.client
                .put_lifecycle_policy()
                .registry_id(&self.account)
                .repository_name(repository)
                .lifecycle_policy_text(&o.lifecycle_policy)
                .send()
                .await
                .map_err(|e| EcrError::from_sdk("ecr:PutLifecyclePolicy", Some(repository), &e))?;
        }
        Ok(())
    }
}

impl BeforePush for Ecr {
    fn before_push<'a>(
        &'a self,
        registry: &'a str,
        repository: &'a str,
    ) -> BoxFuture<'a, std::result::Result<(), RegistryError>> {
        async move {
            if normalize_registry(registry) != self.host {
                return Ok(());
            }
            self.ensure_repository(repository)
                .await
                .map_err(|e| RegistryError::Prepare {
                    registry: registry.to_owned(),
                    repository: repository.to_owned(),
                    reason: e.to_string(),
                })
        }
        .boxed()
    }
}

/// The tag mutability of `repository`: `configured`, but always MUTABLE
/// for the usage records, whose tags each cluster rewrites. (Nor does a
/// lifecycle policy apply there: it could expire a stale cluster's record,
/// and with it the protection of what that cluster listed.)
fn tag_mutability(repository: &str, configured: &str) -> ImageTagMutability {
    if is_usage_repository(repository) {
        ImageTagMutability::Mutable
    } else {
        ImageTagMutability::from(configured)
    }
}

/// Whether `current` is the JSON document `want` (ECR may store a policy
/// reformatted).
fn same_json(current: Option<&str>, want: &str) -> bool {
    let parse = |t: &str| serde_json::from_str::<serde_json::Value>(t).ok();
    match (current.and_then(parse), parse(want)) {
        (Some(a), Some(b)) => a == b,
        _ => current == Some(want),
    }
}

/// Retention's calls (src/retention/).
impl Ecr {
    /// Every repository of the registry, by `ecr:DescribeRepositories`
    /// (ECR serves no `/v2/_catalog`).
    ///
    /// # Errors
    /// [`EcrError::Denied`] naming the IAM action, other API and call errors.
    pub async fn repositories(&self) -> Result<Vec<String>> {
        const ACTION: &str = "ecr:DescribeRepositories";
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let page = self
                .client
                .describe_repositories()
                .registry_id(&self.account)
                .set_next_token(next.take())
                .send()
                .await
                .map_err(|e| EcrError::from_sdk(ACTION, None, &e))?;
            out.extend(
                page.repositories()
                    .iter()
                    .filter_map(|r| r.repository_name().map(str::to_owned)),
            );
            match page.next_token() {
                Some(t) if !t.is_empty() => next = Some(t.to_owned()),
                _ => return Ok(out),
            }
        }
    }

    /// Removes an image with `ecr:BatchDeleteImage`: its `tags` first, then
    /// the manifest by `digest`. An image already gone is no failure.
    ///
    /// # Errors
    /// [`EcrError::Denied`] naming the IAM action, other API and call
    /// errors, and a failure ECR reports for one of the ids.
    pub async fn delete_image(
        &self,
        repository: &str,
        tags: &[String],
        digest: &crate::reference::Digest,
    ) -> Result<()> {
        use aws_sdk_ecr::types::ImageIdentifier;
        let by_tag = tags
            .iter()
            .map(|t| ImageIdentifier::builder().image_tag(t).build())
            .collect::<Vec<_>>();
        let by_digest = vec![
            ImageIdentifier::builder()
                .image_digest(digest.as_str())
                .build(),
        ];
        for ids in [by_tag, by_digest] {
            if ids.is_empty() {
                continue;
            }
            self.batch_delete(repository, ids).await?;
        }
        Ok(())
    }

    async fn batch_delete(
        &self,
        repository: &str,
        ids: Vec<aws_sdk_ecr::types::ImageIdentifier>,
    ) -> Result<()> {
        const ACTION: &str = "ecr:BatchDeleteImage";
        let out = self
            .client
            .batch_delete_image()
            .registry_id(&self.account)
            .repository_name(repository)
            .set_image_ids(Some(ids))
            .send()
            .await
            .map_err(|e| EcrError::from_sdk(ACTION, Some(repository), &e))?;
        let failed = out.failures().iter().find(|f| {
            f.failure_code() != Some(&aws_sdk_ecr::types::ImageFailureCode::ImageNotFound)
        });
        match failed {
            None => Ok(()),
            Some(f) => Err(EcrError::Api {
                action: ACTION,
                repository: Some(repository.to_owned()),
                code: f
                    .failure_code()
                    .map(|c| c.as_str().to_owned())
                    .unwrap_or_default(),
                message: f.failure_reason().unwrap_or_default().to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aws() -> Aws {
        crate::config::Config::from_yaml(
            "target: {aws: {accountId: \"111122223333\", region: eu-west-1}}\n",
            "t",
        )
        .unwrap()
        .target
        .aws
        .unwrap()
    }

    #[tokio::test]
    async fn token_is_due_at_half_its_life() {
        let base = SdkConfig::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("eu-west-1"))
            .build();
        let ecr =
            Ecr::connect_with(&aws(), "111122223333.dkr.ecr.eu-west-1.amazonaws.com", base).await;
        let t0 = SystemTime::now();
        assert!(ecr.token_due(t0), "no token yet");
        *ecr.token.lock().unwrap() = Some((t0, t0 + Duration::from_secs(12 * 3600)));
        assert!(!ecr.token_due(t0 + Duration::from_secs(5 * 3600 + 3599)));
        assert!(ecr.token_due(t0 + Duration::from_secs(6 * 3600)));
        // An expiry in the past (clock skew, a stand-in's fixed date).
        *ecr.token.lock().unwrap() = Some((t0, t0 - Duration::from_secs(1)));
        assert!(ecr.token_due(t0));
    }

    #[test]
    fn error_bodies_in_json_and_xml() {
        assert_eq!(
            error_fields(r#"{"__type":"com.amazonaws#AccessDeniedException","message":"no"}"#),
            (Some("AccessDeniedException".into()), Some("no".into()))
        );
        assert_eq!(
            error_fields(
                "<ErrorResponse><Error><Code>AccessDenied</Code><Message>not allowed</Message></Error></ErrorResponse>"
            ),
            (Some("AccessDenied".into()), Some("not allowed".into()))
        );
        assert_eq!(error_fields("gateway timeout"), (None, None));
    }

    #[test]
    fn denied_names_the_action_and_repository() {
        let e = EcrError::Denied {
            action: "ecr:CreateRepository",
            repository: Some("cache/docker.io/library/nginx".into()),
            code: "AccessDeniedException".into(),
            message: "not authorized".into(),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("missing IAM permission ecr:CreateRepository on repository cache/docker.io/library/nginx: AccessDeniedException"),
            "{text}"
        );
    }
}
