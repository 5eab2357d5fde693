//! Source credentials from a Pod's imagePullSecrets and those of its
//! ServiceAccount, read through the Kubernetes API (kube).
//!
//! The kubelet merges the same two lists (Pod first, then ServiceAccount)
//! and skips secrets it cannot use; so do we, but a Secret that cannot be
//! used (403, missing, malformed) is logged at warn with its name and the
//! cause, and counted in `pinswap_pull_secret_errors_total{reason}`.
//! Secrets of type `kubernetes.io/dockerconfigjson` (`.dockerconfigjson`)
//! and `kubernetes.io/dockercfg` (`.dockercfg`) are read. Nothing read here
//! is ever logged: [`Credentials`] redacts its `Debug`, and errors describe
//! a Secret's shape, never its content.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::Api;
use serde_json::Value;
use tracing::{debug, warn};

use super::auth::Credentials;
use crate::logsafe::Untrusted;
use crate::metrics::Metrics;

/// How long a Secret or ServiceAccount read is kept.
const READ_TTL: Duration = Duration::from_secs(30);
/// How long a failed read is kept: short, so a fixed RBAC rule or a
/// created Secret counts soon, yet a burst of Pods costs one read.
const FAILED_READ_TTL: Duration = Duration::from_secs(5);
/// Secrets and ServiceAccounts kept at most, each.
const MAX_CACHED: u64 = 10_000;
/// Secret names read per Pod at most (its own and its ServiceAccount's):
/// the lists are the Pod author's to write.
pub const MAX_SECRETS_PER_POD: usize = 32;
/// Credentials kept per registry and Pod at most.
pub const MAX_CREDENTIALS_PER_REGISTRY: usize = 4;

/// Why a pull secret gave no credentials. Never holds a credential.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullSecretError {
    /// The API server refused the read (RBAC).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// No such Secret (or ServiceAccount) in the namespace.
    #[error("not found")]
    Missing,
    /// The Secret is not a Docker config pinswap can read.
    #[error("malformed: {0}")]
    Malformed(String),
    /// The API server could not be read (timeout, 5xx, transport).
    #[error("unreadable: {0}")]
    Unreadable(String),
}

impl PullSecretError {
    /// The `reason` label: `forbidden`, `missing`, `malformed`, `unreadable`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Forbidden(_) => "forbidden",
            Self::Missing => "missing",
            Self::Malformed(_) => "malformed",
            Self::Unreadable(_) => "unreadable",
        }
    }

    fn of_api(e: &kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 403 => Self::Forbidden(s.message.clone()),
            kube::Error::Api(s) if s.code == 404 => Self::Missing,
            other => Self::Unreadable(other.to_string()),
        }
    }
}

/// Source credentials a Pod may use: its namespace, and per source
/// registry (normalised) the credentials of its pull secrets in the
/// kubelet's order.
#[derive(Debug, Clone, Default)]
pub struct PodCredentials {
    namespace: String,
    registries: HashMap<String, Vec<Credentials>>,
}

impl PodCredentials {
    /// No Pod, or a Pod without pull secrets (`pinswap mutate`, a Pod
    /// whose secrets are not read).
    pub fn none() -> Self {
        Self::default()
    }

    /// Credentials of a Pod in `namespace`, as (registry, credentials)
    /// pairs in order; later duplicates and those beyond
    /// [`MAX_CREDENTIALS_PER_REGISTRY`] per registry are dropped.
    pub fn new(namespace: &str, pairs: impl IntoIterator<Item = (String, Credentials)>) -> Self {
        let mut out = Self {
            namespace: namespace.to_owned(),
            registries: HashMap::new(),
        };
        for (registry, creds) in pairs {
            let list = out
                .registries
                .entry(crate::reference::normalize_registry(&registry))
                .or_default();
            if list.len() < MAX_CREDENTIALS_PER_REGISTRY && !list.contains(&creds) {
                list.push(creds);
            }
        }
        out
    }

    /// The Pod's namespace (empty for [`PodCredentials::none`]).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Credentials for `registry`, in the order the kubelet tries them.
    pub fn for_registry(&self, registry: &str) -> &[Credentials] {
        self.registries
            .get(&crate::reference::normalize_registry(registry))
            .map_or(&[], Vec::as_slice)
    }

    /// The first credentials for `registry`: what reads the source.
    pub fn first(&self, registry: &str) -> Option<&Credentials> {
        self.for_registry(registry).first()
    }
}

/// Reads pull secrets. Cheap to share; reads are cached (30 s, failures
/// 5 s) per namespace and name, so a burst of Pods costs one API read per
/// Secret and ServiceAccount.
pub struct PullSecrets {
    client: kube::Client,
    metrics: Arc<Metrics>,
    secrets: moka::future::Cache<(String, String), Read<SecretCredentials>>,
    accounts: moka::future::Cache<(String, String), Read<Vec<String>>>,
}

/// (registry, credentials) pairs of one Secret, in its order.
type SecretCredentials = Vec<(String, Credentials)>;

/// A cached read: the value, or why there is none.
type Read<T> = Result<Arc<T>, PullSecretError>;

/// Keeps a failed read for [`FAILED_READ_TTL`], a good one for [`READ_TTL`].
struct ReadExpiry;

impl<K, T> moka::Expiry<K, Read<T>> for ReadExpiry {
    fn expire_after_create(&self, _: &K, value: &Read<T>, _: Instant) -> Option<Duration> {
        Some(match value {
            Ok(_) => READ_TTL,
            Err(_) => FAILED_READ_TTL,
        })
    }
}

/// The registry a Docker config `auths` key names: scheme and path dropped,
/// Docker Hub's v1 index URL and `index.docker.io` as `docker.io`.
fn registry_of(key: &str) -> String {
    let host = key
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or("");
    crate::reference::normalize_registry(host)
}

/// One `auths` entry's credentials; the error names the registry only.
fn credentials_of(registry: &str, entry: &Value) -> Result<Credentials, PullSecretError> {
    if let (Some(u), Some(p)) = (
        entry.get("username").and_then(Value::as_str),
        entry.get("password").and_then(Value::as_str),
    ) {
        return Ok(Credentials::new(u, p));
    }
    let bad = |why: &str| PullSecretError::Malformed(format!("the entry for {registry} {why}"));
    use base64::Engine as _;
    let auth = entry
        .get("auth")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("has neither username and password nor auth"))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .map_err(|_| bad("has an auth that is not base64"))?;
    let text = String::from_utf8(decoded).map_err(|_| bad("has an auth that is not UTF-8"))?;
    let (u, p) = text
        .split_once(':')
        .ok_or_else(|| bad("has an auth that is not user:password"))?;
    Ok(Credentials::new(u, p))
}

/// (registry, credentials) from one pull secret, in its `auths` order.
///
/// # Errors
/// [`PullSecretError::Malformed`] saying what is wrong with its shape
/// (never quoting its content).
pub fn parse_secret(secret: &Secret) -> Result<SecretCredentials, PullSecretError> {
    let bad = |why: String| PullSecretError::Malformed(why);
    let data = secret.data.as_ref();
    let (key, wrapped) = match secret.type_.as_deref() {
        Some("kubernetes.io/dockercfg") => (".dockercfg", false),
        Some("kubernetes.io/dockerconfigjson") | None => (".dockerconfigjson", true),
        // The kubelet reads only these two types; an Opaque Secret holding
        // a Docker config is still read, as before.
        Some(other) => match data.is_some_and(|d| d.contains_key(".dockerconfigjson")) {
            true => (".dockerconfigjson", true),
            false => {
                return Err(bad(format!(
                    "type {} is not kubernetes.io/dockerconfigjson or kubernetes.io/dockercfg",
                    Untrusted(other)
                )));
            }
        },
    };
    let (key, wrapped) = match data {
        Some(d) if !d.contains_key(key) && d.contains_key(".dockercfg") => (".dockercfg", false),
        _ => (key, wrapped),
    };
    let raw = data
        .and_then(|d| d.get(key))
        .ok_or_else(|| bad(format!("no {key} key")))?;
    let json: Value = serde_json::from_slice(&raw.0).map_err(|e| {
        bad(format!(
            "{key} is not JSON (line {} column {})",
            e.line(),
            e.column()
        ))
    })?;
    let auths = match wrapped {
        true => json.get("auths").cloned().unwrap_or(Value::Null),
        false => json,
    };
    let Value::Object(map) = auths else {
        return Err(bad(format!(
            "{key} has no {} object",
            if wrapped { "auths" } else { "registry" }
        )));
    };
    map.iter()
        .map(|(k, v)| {
            let registry = registry_of(k);
            credentials_of(&registry, v).map(|c| (registry, c))
        })
        .collect()
}

impl PullSecrets {
    /// Uses `client` for API reads (RBAC: get on secrets and
    /// serviceaccounts); read failures are counted in `metrics`.
    pub fn new(client: kube::Client, metrics: Arc<Metrics>) -> Self {
        Self {
            client,
            metrics,
            secrets: moka::future::Cache::builder()
                .expire_after(ReadExpiry)
                .max_capacity(MAX_CACHED)
                .build(),
            accounts: moka::future::Cache::builder()
                .expire_after(ReadExpiry)
                .max_capacity(MAX_CACHED)
                .build(),
        }
    }

    /// Logs and counts a failed read of `kind` `name` in `namespace`.
    fn failed(&self, kind: &str, namespace: &str, name: &str, e: &PullSecretError) {
        self.metrics.pull_secret_error(e.reason());
        warn!(
            namespace = %Untrusted(namespace),
            kind,
            name = %Untrusted(name),
            reason = e.reason(),
            error = %e,
            "pull secret not used"
        );
    }

    async fn secret(&self, namespace: &str, name: &str) -> Read<SecretCredentials> {
        let key = (namespace.to_owned(), name.to_owned());
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        self.secrets
            .get_with(key, async move {
                let read = match api.get(name).await {
                    Ok(s) => parse_secret(&s).map(Arc::new),
                    Err(e) => Err(PullSecretError::of_api(&e)),
                };
                if let Err(e) = &read {
                    self.failed("Secret", namespace, name, e);
                }
                read
            })
            .await
    }

    /// The pull secret names of ServiceAccount `name`.
    async fn account(&self, namespace: &str, name: &str) -> Read<Vec<String>> {
        let key = (namespace.to_owned(), name.to_owned());
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        self.accounts
            .get_with(key, async move {
                let read = match api.get(name).await {
                    Ok(a) => Ok(Arc::new(
                        a.image_pull_secrets
                            .unwrap_or_default()
                            .into_iter()
                            .map(|r| r.name)
                            .collect(),
                    )),
                    Err(e) => Err(PullSecretError::of_api(&e)),
                };
                match &read {
                    // The API server admits no Pod whose ServiceAccount is
                    // missing; one just created may not be readable yet.
                    Err(PullSecretError::Missing) => {
                        debug!(namespace = %Untrusted(namespace), service_account = %Untrusted(name), "ServiceAccount not found")
                    }
                    Err(e) => self.failed("ServiceAccount", namespace, name, e),
                    Ok(_) => {}
                }
                read
            })
            .await
    }

    /// The credentials a Pod in `namespace` may use: its own
    /// `imagePullSecrets` first, then its ServiceAccount's (default
    /// `default`), at most [`MAX_SECRETS_PER_POD`] Secrets. Secrets that
    /// cannot be used are skipped (logged and counted).
    pub async fn for_pod(&self, namespace: &str, pod: &Value) -> PodCredentials {
        let mut names: Vec<String> = pod
            .pointer("/spec/imagePullSecrets")
            .and_then(Value::as_array)
            .map(|l| {
                l.iter()
                    .filter_map(|r| r.get("name").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let sa = pod
            .pointer("/spec/serviceAccountName")
            .and_then(Value::as_str)
            .unwrap_or("default");
        if let Ok(account) = self.account(namespace, sa).await {
            names.extend(account.iter().cloned());
        }
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| !n.is_empty() && seen.insert(n.clone()));
        if names.len() > MAX_SECRETS_PER_POD {
            warn!(namespace = %Untrusted(namespace), secrets = names.len(), max = MAX_SECRETS_PER_POD, "a Pod names too many pull secrets; reading the first ones only");
            names.truncate(MAX_SECRETS_PER_POD);
        }
        let mut pairs = Vec::new();
        for name in names {
            if let Ok(list) = self.secret(namespace, &name).await {
                pairs.extend(list.iter().cloned());
            }
        }
        PodCredentials::new(namespace, pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn secret(type_: &str, key: &str, body: &[u8]) -> Secret {
        Secret {
            type_: Some(type_.into()),
            data: Some([(key.to_owned(), ByteString(body.to_vec()))].into()),
            ..Secret::default()
        }
    }

    #[test]
    fn both_secret_formats() {
        let s = secret(
            "kubernetes.io/dockerconfigjson",
            ".dockerconfigjson",
            br#"{"auths":{"https://index.docker.io/v1/":{"auth":"dTpw"},"127.0.0.1:5000":{"username":"a","password":"b:c"}}}"#,
        );
        let m: HashMap<_, _> = parse_secret(&s).unwrap().into_iter().collect();
        assert_eq!(m["docker.io"], Credentials::new("u", "p"));
        assert_eq!(m["127.0.0.1:5000"], Credentials::new("a", "b:c"));
        let s = secret(
            "kubernetes.io/dockercfg",
            ".dockercfg",
            br#"{"quay.io":{"auth":"eDp5"}}"#,
        );
        assert_eq!(
            parse_secret(&s).unwrap(),
            vec![("quay.io".to_owned(), Credentials::new("x", "y"))]
        );
    }

    /// Each malformed shape is an error saying what is wrong, and none
    /// quotes the Secret's content.
    #[test]
    fn malformed_secrets_say_why_without_their_content() {
        let cases: &[(&str, &str, &[u8], &str)] = &[
            (
                "kubernetes.io/dockercfg",
                ".dockercfg",
                b"garbage-s3cret",
                ".dockercfg is not JSON",
            ),
            (
                "kubernetes.io/dockerconfigjson",
                ".dockerconfigjson",
                br#"{"auths":{"r.example":{"auth":"!!s3cret"}}}"#,
                "the entry for r.example has an auth that is not base64",
            ),
            (
                "kubernetes.io/dockerconfigjson",
                ".dockerconfigjson",
                br#"{"auths":{"r.example":{"auth":"czNjcmV0"}}}"#,
                "not user:password",
            ),
            (
                "kubernetes.io/dockerconfigjson",
                ".dockerconfigjson",
                br#"{"s3cret":1}"#,
                "no auths object",
            ),
            (
                "kubernetes.io/dockerconfigjson",
                "other",
                b"{}",
                "no .dockerconfigjson key",
            ),
            (
                "Opaque",
                "password",
                b"s3cret",
                "type Opaque is not kubernetes.io/dockerconfigjson",
            ),
        ];
        for (type_, key, body, want) in cases {
            let e = parse_secret(&secret(type_, key, body)).unwrap_err();
            assert_eq!(e.reason(), "malformed");
            let text = e.to_string();
            assert!(text.contains(want), "{text:?} should say {want:?}");
            assert!(!text.contains("s3cret"), "{text:?} quotes the secret");
        }
    }

    #[test]
    fn pod_credentials_keep_the_kubelet_order_bounded() {
        let c = |n: u32| Credentials::new(format!("u{n}"), "p");
        let pairs = (0..10).map(|n| ("index.docker.io".to_owned(), c(n)));
        let pod = PodCredentials::new("ns", pairs.chain([("docker.io".to_owned(), c(0))]));
        assert_eq!(
            pod.for_registry("docker.io").len(),
            MAX_CREDENTIALS_PER_REGISTRY
        );
        assert_eq!(pod.first("docker.io"), Some(&c(0)));
        assert!(pod.for_registry("quay.io").is_empty());
        assert!(PodCredentials::none().first("docker.io").is_none());
    }
}
