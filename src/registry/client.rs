//! A pool of registry clients, one per registry and side of a copy.
//!
//! Each registry gets its own client (its scheme, credentials and token
//! cache), built after one `GET /v2/` probe (distribution-spec §Determining
//! support) that picks the scheme and tells whether the registry wants auth
//! at all. Insecure registries (`--insecure-registry`, and loopback
//! addresses as Docker does) try HTTPS first and fall back to plain HTTP.
//! Every request goes through our own HTTP client and the outbound guard
//! (`requests.rs`, `session.rs`, `guard.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use oci_client::secrets::RegistryAuth;
use tokio::sync::OnceCell;
use tracing::debug;

use super::auth::{CredentialSources, Credentials};
use super::session::Session;
use super::token::{Scheme, parse_challenge};
use super::{RegistryError, Result, chain};
use crate::reference::{is_loopback_registry, normalize_registry};

/// Blobs larger than this (bytes) are uploaded in chunks of this size
/// (POST, PATCH..., PUT); smaller ones in one streamed PUT
/// (distribution-spec §Pushing blobs).
pub const DEFAULT_CHUNKED_THRESHOLD: u64 = 64 * 1024 * 1024;

/// Which side of a copy a client serves. Explicit credentials are per side,
/// so source credentials are never sent to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Where images are read from.
    Source,
    /// Where images are written to.
    Target,
}

/// How the pool builds clients.
#[derive(Debug, Clone, Default)]
pub struct PoolOptions {
    /// `host[:port]` registries that may be reached over plain HTTP.
    pub insecure: Vec<String>,
    /// Extra trusted CA certificates (PEM), added to the system roots.
    pub ca_certs: Vec<Vec<u8>>,
    /// Credentials used only for the source side.
    pub source_creds: Option<Credentials>,
    /// Credentials used only for the target side.
    pub target_creds: Option<Credentials>,
    /// Credentials for one registry on one side (from the webhook config),
    /// used when no side-wide credentials are given.
    pub per_registry: HashMap<(String, Role), Credentials>,
    /// Authfile and Docker config lookup.
    pub sources: CredentialSources,
    /// Blobs above this many bytes use chunked upload; `None` for the default.
    pub chunked_threshold: Option<u64>,
    /// Which addresses our own requests may connect to
    /// (docs/architecture.md §8).
    pub guard: super::guard::Guard,
    /// The HTTP proxies requests go through (none unless set:
    /// [`super::proxy::Proxies::from_env`] reads the environment's).
    pub proxies: super::proxy::Proxies,
    /// The sources' pull quotas, shared by every client of the pool.
    pub quotas: Arc<super::quota::Quotas>,
}

/// The pool key of the client signed in as no one (credential
/// fingerprints are `sha256:…`, the configured client's is empty).
const ANONYMOUS: &str = "anonymous";

/// A client built at most once, however many copies ask for it at once.
type Slot = Arc<OnceCell<Arc<Registry>>>;

/// A registry's scheme and `/v2/` challenge, probed at most once.
type Probe = Arc<OnceCell<(&'static str, Scheme)>>;

/// Clients kept at most, by registry, side and credentials. Registries
/// and credentials come from Pods (`"*"`, pull secrets, their rotations),
/// so the pool is bounded; moka admits a new key only over one used less
/// often, so a flood of one-off names does not push out the registries in
/// use. An evicted client is built again on its next use.
pub const MAX_CLIENTS: u64 = 1024;

/// Registries whose `/v2/` answer is kept at most (bounded as
/// [`MAX_CLIENTS`]).
pub const MAX_PROBES: u64 = 1024;

/// Lazily built, shared clients keyed by registry and [`Role`].
#[derive(Debug)]
pub struct ClientPool {
    opts: PoolOptions,
    /// `opts.per_registry`, replaceable at run time
    /// ([`ClientPool::set_credentials`]).
    configured: std::sync::RwLock<HashMap<(String, Role), Credentials>>,
    http: OnceCell<reqwest::Client>,
    roots: OnceCell<Vec<Vec<u8>>>,
    entries: moka::future::Cache<(String, Role, String), Slot>,
    /// What each registry's `/v2/` answered, by normalised name.
    probes: moka::future::Cache<String, Probe>,
}

/// A connection to one registry. Cheap to share (`Arc`).
pub struct Registry {
    session: Session,
    chunked_threshold: u64,
    /// The registry refused a chunk (`PATCH`): it takes blobs only whole
    /// (Google Artifact Registry documents so), and gets them so from then on.
    whole_only: std::sync::atomic::AtomicBool,
    /// A source's pull quota under its credential
    /// ([`super::quota::Quotas`]).
    pub(super) quota: Option<(Arc<super::quota::Quotas>, super::quota::QuotaKey)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Registry({}://{})",
            self.session.scheme, self.session.host
        )
    }
}

/// Whether plain HTTP may be tried for `registry`: listed with
/// `--insecure-registry`, or a loopback address (as Docker does).
fn allows_plain_http(insecure: &[String], registry: &str) -> bool {
    let registry = normalize_registry(registry);
    insecure.iter().any(|h| normalize_registry(h) == registry) || is_loopback_registry(&registry)
}

impl ClientPool {
    /// The sources' pull quotas, as every client of the pool draws on them.
    pub fn quotas(&self) -> &Arc<super::quota::Quotas> {
        &self.opts.quotas
    }

    /// A pool with these options; no connection is made yet.
    pub fn new(opts: PoolOptions) -> Self {
        Self {
            configured: std::sync::RwLock::new(opts.per_registry.clone()),
            opts,
            http: OnceCell::new(),
            roots: OnceCell::new(),
            entries: moka::future::Cache::new(MAX_CLIENTS),
            probes: moka::future::Cache::new(MAX_PROBES),
        }
    }

    /// How many clients and `/v2/` answers the pool holds (for tests of
    /// its bounds).
    #[doc(hidden)]
    pub async fn held(&self) -> (u64, u64) {
        self.entries.run_pending_tasks().await;
        self.probes.run_pending_tasks().await;
        (self.entries.entry_count(), self.probes.entry_count())
    }

    /// The client in `key`'s slot, connecting with `connect` on first use;
    /// a slot whose connect failed is dropped, so failing names hold no
    /// place in the pool.
    async fn slot<F, Fut>(&self, key: (String, Role, String), connect: F) -> Result<Arc<Registry>>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Registry>>,
    {
        let cell = self
            .entries
            .get_with(key.clone(), async { Slot::default() })
            .await;
        match cell
            .get_or_try_init(|| async { connect().await.map(Arc::new) })
            .await
        {
            Ok(r) => Ok(r.clone()),
            Err(e) => {
                if !cell.initialized() {
                    self.entries.invalidate(&key).await;
                }
                Err(e)
            }
        }
    }

    /// Trusted roots: the system's (read once; each client build would
    /// otherwise scan /etc/ssl/certs again) plus `--ca-cert`, as DER.
    async fn roots(&self, registry: &str) -> Result<Vec<Vec<u8>>> {
        self.roots
            .get_or_try_init(|| async {
                let mut ders: Vec<Vec<u8>> = tokio::task::spawn_blocking(|| {
                    let found = rustls_native_certs::load_native_certs();
                    for e in &found.errors {
                        debug!(error = %e, "skipping a system root certificate");
                    }
                    found.certs.into_iter().map(|c| c.to_vec()).collect()
                })
                .await
                .unwrap_or_default();
                for pem in &self.opts.ca_certs {
                    use rustls::pki_types::{CertificateDer, pem::PemObject};
                    let before = ders.len();
                    ders.extend(
                        CertificateDer::pem_slice_iter(pem)
                            .filter_map(|c| c.ok())
                            .map(|c| c.to_vec()),
                    );
                    if ders.len() == before {
                        return Err(RegistryError::Other {
                            registry: registry.into(),
                            reference: "CA certificate".into(),
                            operation: "load",
                            message: "no PEM certificate in --ca-cert".into(),
                        });
                    }
                }
                Ok(ders)
            })
            .await
            .cloned()
    }

    /// The HTTP client for probes and our own requests, built once.
    async fn http_client(&self, registry: &str) -> Result<reqwest::Client> {
        let roots = self.roots(registry).await?;
        let failed = |message: String| RegistryError::Other {
            registry: registry.into(),
            reference: "/v2/".into(),
            operation: "build client for",
            message,
        };
        self.http
            .get_or_try_init(|| async {
                let certs = roots
                    .iter()
                    .filter_map(|d| reqwest::Certificate::from_der(d).ok());
                let proxies = &self.opts.proxies;
                let guard = proxies
                    .guard(&self.opts.guard)
                    .map_err(|e| failed(e.to_string()))?;
                let builder = reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .read_timeout(Duration::from_secs(60))
                    .user_agent(concat!("pinswap/", env!("CARGO_PKG_VERSION")))
                    .tls_certs_only(certs)
                    .dns_resolver(guard.resolver())
                    .redirect(guard.redirect_policy());
                proxies
                    .apply(builder, &guard)
                    .map_err(|e| failed(e.to_string()))?
                    .build()
                    .map_err(|e| failed(chain(&e)))
            })
            .await
            .cloned()
    }

    /// The client for `registry` (`host[:port]`, Docker Hub as `docker.io`)
    /// on `role`'s side, probing and authenticating on first use.
    ///
    /// # Errors
    /// [`RegistryError::Unreachable`] when `GET /v2/` fails on every allowed
    /// scheme; [`RegistryError::Unauthorized`] when the registry wants auth and
    /// no credentials are known; [`RegistryError::Auth`] when credentials
    /// cannot be read.
    pub async fn get(&self, registry: &str, role: Role) -> Result<Arc<Registry>> {
        self.get_with(registry, role, None).await
    }

    /// The configured credentials for `registry` on `role`'s side, if any.
    pub fn configured(&self, registry: &str, role: Role) -> Option<Credentials> {
        let key = (normalize_registry(registry), role);
        let map = self.configured.read().unwrap_or_else(|e| e.into_inner());
        map.get(&key).cloned()
    }

    /// Replaces the configured credentials for `registry` on `role`'s side
    /// (a rotated password file, a credential helper's new token). When
    /// they differ from the current ones, the cached client is dropped, so
    /// the next use signs in again with them; copies in flight keep the
    /// client they hold. Returns whether anything changed.
    pub async fn set_credentials(&self, registry: &str, role: Role, creds: Credentials) -> bool {
        let key = (normalize_registry(registry), role);
        {
            let mut map = self.configured.write().unwrap_or_else(|e| e.into_inner());
            if map.get(&key) == Some(&creds) {
                return false;
            }
            map.insert(key.clone(), creds);
        }
        let stale: Vec<_> = self
            .entries
            .iter()
            .filter(|(k, _)| {
                let (r, ro, who) = &**k;
                who.is_empty() && *ro == role && normalize_registry(r) == key.0
            })
            .map(|(k, _)| k)
            .collect();
        for k in stale {
            self.entries.invalidate(&*k).await;
        }
        // Signing in again probes again: new credentials may come with a
        // moved token service.
        self.probes.invalidate(&key.0).await;
        true
    }

    /// As [`ClientPool::get`], but with these credentials (a Pod's
    /// imagePullSecrets) instead of the configured ones. Clients are kept
    /// per registry, side and credentials.
    ///
    /// # Errors
    /// As [`ClientPool::get`].
    pub async fn get_with(
        &self,
        registry: &str,
        role: Role,
        creds: Option<&Credentials>,
    ) -> Result<Arc<Registry>> {
        let who = creds.map(Credentials::fingerprint).unwrap_or_default();
        self.slot((registry.to_owned(), role, who), || {
            self.connect(registry, role, creds, false)
        })
        .await
    }

    /// As [`ClientPool::get`], signed in as no one: what the registry
    /// serves anonymously (is an image public?).
    ///
    /// # Errors
    /// As [`ClientPool::get`].
    pub async fn get_anonymous(&self, registry: &str, role: Role) -> Result<Arc<Registry>> {
        self.slot((registry.to_owned(), role, ANONYMOUS.to_owned()), || {
            self.connect(registry, role, None, true)
        })
        .await
    }

    /// The scheme and auth challenge of `registry` (reached at `api_host`),
    /// from one `GET /v2/` per scheme tried, once per registry and process:
    /// the source and target sides and every credential set share it. A
    /// failed probe is not kept, so the next use probes again.
    async fn probe(&self, registry: &str, api_host: &str) -> Result<(&'static str, Scheme)> {
        let key = normalize_registry(registry);
        let cell = self
            .probes
            .get_with(key.clone(), async { Probe::default() })
            .await;
        let found = cell
            .get_or_try_init(|| self.probe_now(registry, api_host))
            .await
            .cloned();
        if found.is_err() && !cell.initialized() {
            self.probes.invalidate(&key).await;
        }
        found
    }

    async fn probe_now(&self, registry: &str, api_host: &str) -> Result<(&'static str, Scheme)> {
        // A literal host is not resolved, so the guard checks it here; a
        // name is checked when the probe resolves it.
        if let Err(e) = self.opts.guard.check_str(&format!("http://{api_host}/")) {
            return Err(RegistryError::Unreachable {
                registry: registry.into(),
                reason: e.to_string(),
            });
        }
        let probe = self.http_client(registry).await?;
        // Plain HTTP first on loopback, where TLS protects nothing and most
        // registries are plain; HTTPS first elsewhere, as Docker does.
        let order: &[&'static str] = if is_loopback_registry(api_host) {
            &["http", "https"]
        } else if allows_plain_http(&self.opts.insecure, api_host) {
            &["https", "http"]
        } else {
            &["https"]
        };
        let mut found = None;
        // Each scheme's failure, so the error says what was tried.
        let mut failures: Vec<(&'static str, String)> = Vec::new();
        for scheme in order {
            match ping(&probe, scheme, api_host).await {
                Ok(c) => {
                    found = Some((*scheme, c));
                    break;
                }
                // A registry that answers 429 or 5xx is there but refuses
                // now: say so, with its Retry-After, rather than try another
                // scheme and report that one's failure.
                Err(Ping::Unavailable(status, retry_after)) => {
                    return Err(RegistryError::Unavailable {
                        registry: registry.into(),
                        reference: "/v2/".into(),
                        operation: "GET",
                        status,
                        retry_after,
                    });
                }
                Err(Ping::Failed(e)) => failures.push((scheme, e)),
            }
        }
        found.ok_or_else(|| RegistryError::Unreachable {
            registry: registry.into(),
            reason: unreachable_reason(&failures),
        })
    }

    async fn connect(
        &self,
        registry: &str,
        role: Role,
        creds: Option<&Credentials>,
        anonymous: bool,
    ) -> Result<Registry> {
        // Docker Hub's API lives on another host than its name.
        let api_host = if registry == "docker.io" {
            "index.docker.io"
        } else {
            registry
        };
        let probe = self.http_client(registry).await?;
        let (scheme, challenge) = self.probe(registry, api_host).await?;
        let explicit = match role {
            Role::Source => self.opts.source_creds.as_ref(),
            Role::Target => self.opts.target_creds.as_ref(),
        };
        let configured = self
            .configured
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(normalize_registry(registry), role))
            .cloned();
        let explicit = creds.or(explicit).or(configured.as_ref());
        let auth = match explicit {
            _ if anonymous => RegistryAuth::Anonymous,
            Some(c) => c.to_auth(),
            None => {
                let sources = self.opts.sources.clone();
                let reg = registry.to_owned();
                tokio::task::spawn_blocking(move || sources.lookup_blocking(&reg))
                    .await
                    .map_err(|e| RegistryError::Other {
                        registry: registry.into(),
                        reference: "credentials".into(),
                        operation: "look up",
                        message: e.to_string(),
                    })??
                    .unwrap_or(RegistryAuth::Anonymous)
            }
        };
        debug!(registry, scheme, role = ?role, "registry probed");
        if let Scheme::Bearer(c) = &challenge {
            self.opts.guard.trust_realm(registry, &c.realm);
        }
        let threshold = self
            .opts
            .chunked_threshold
            .unwrap_or(DEFAULT_CHUNKED_THRESHOLD);
        let quota = (role == Role::Source).then(|| {
            let key = super::quota::QuotaKey {
                registry: normalize_registry(registry),
                credential: quota_credential(&auth),
            };
            (self.opts.quotas.clone(), key)
        });
        Ok(Registry {
            session: Session::new(
                registry,
                scheme,
                api_host,
                probe,
                auth,
                challenge,
                self.opts.guard.clone(),
            ),
            chunked_threshold: threshold,
            whole_only: Default::default(),
            quota,
        })
    }
}

/// Whose pull quota a client draws on: the account (a hash of its user
/// name: never a secret, though a common name can be guessed back), a
/// bearer token's (whose account is not known, so never shared), or
/// `anonymous`. A quota is the account's, whatever its password.
fn quota_credential(auth: &RegistryAuth) -> String {
    use sha2::Digest as _;
    match auth {
        RegistryAuth::Basic(user, _) => {
            let hash = sha2::Sha256::digest(user.as_bytes());
            format!("user:{}", &hex::encode(hash)[..16])
        }
        RegistryAuth::Bearer(_) => "token".to_owned(),
        _ => ANONYMOUS.to_owned(),
    }
}

/// Why no scheme worked: the one failure as it is, or every scheme tried
/// with its failure (`tried http and https: …` when they agree).
fn unreachable_reason(failures: &[(&str, String)]) -> String {
    match failures {
        [] => String::new(),
        [(_, e)] => e.clone(),
        [(first, e), rest @ ..] if rest.iter().all(|(_, r)| r == e) => {
            let mut schemes = vec![*first];
            schemes.extend(rest.iter().map(|(s, _)| *s));
            format!("tried {}: {e}", schemes.join(" and "))
        }
        all => {
            let each: Vec<String> = all.iter().map(|(s, e)| format!("{s}: {e}")).collect();
            format!("tried {}", each.join("; "))
        }
    }
}

/// Why a `GET /v2/` probe found no registry to use.
enum Ping {
    /// The transport failed, or plain HTTP got a non-registry answer.
    Failed(String),
    /// The registry answered 429 or 5xx (with `Retry-After`).
    Unavailable(u16, Option<Duration>),
}

/// `GET /v2/`, returning the auth challenge. Over HTTPS any answer means
/// the scheme works. Over plain HTTP only a registry's answer counts (200 or
/// 401, distribution-spec §Determining support): a TLS server answers 400 to
/// plain HTTP, and taking that would hide the real TLS error (e.g. an unknown
/// CA).
async fn ping(
    client: &reqwest::Client,
    scheme: &str,
    host: &str,
) -> std::result::Result<Scheme, Ping> {
    let resp = client
        .get(format!("{scheme}://{host}/v2/"))
        .send()
        .await
        .map_err(|e| Ping::Failed(chain(&e)))?;
    let status = resp.status().as_u16();
    if status == 429 || (500..=599).contains(&status) {
        return Err(Ping::Unavailable(
            status,
            super::retry_after(resp.headers()),
        ));
    }
    if scheme == "http" && status != 200 && status != 401 {
        return Err(Ping::Failed(format!(
            "GET /v2/ over plain HTTP answered {status}"
        )));
    }
    if status != 401 {
        return Ok(Scheme::None);
    }
    Ok(resp
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|h| h.to_str().ok())
        .map(parse_challenge)
        .unwrap_or(Scheme::Basic))
}

/// A registry that does not answer `GET /v2/` ([`Registry::ping`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct PingError {
    /// The transport error chain.
    pub reason: String,
}

impl Registry {
    /// `host[:port]` as given to the pool.
    pub fn host(&self) -> &str {
        &self.session.host
    }

    /// Whether the registry answers `GET /v2/` (any HTTP status) within 2 s.
    ///
    /// # Errors
    /// The transport error chain when it does not.
    pub async fn ping(&self) -> std::result::Result<(), PingError> {
        self.session
            .http
            .get(format!("{}/v2/", self.session.base))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map(drop)
            .map_err(|e| PingError { reason: chain(&e) })
    }

    /// `scheme://host[:port]` of the registry's API.
    pub(crate) fn base(&self) -> &str {
        self.session.base()
    }

    /// The HTTP client for requests oci-client does not make for us.
    pub(crate) fn http(&self) -> &reqwest::Client {
        self.session.http()
    }

    /// What our own requests to this registry share (`session.rs`).
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    /// Blobs larger than this go up in chunks (`upload.rs`).
    pub(crate) fn chunked_threshold(&self) -> u64 {
        self.chunked_threshold
    }

    /// Whether a blob of `size` bytes goes up in chunks.
    pub(crate) fn chunks(&self, size: u64) -> bool {
        size > self.chunked_threshold && !self.whole_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records that the registry refused a chunk: blobs go up whole.
    pub(crate) fn refuses_chunks(&self) {
        if !self
            .whole_only
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!(registry = %self.host(), "the registry refused a chunked upload: blobs go up whole from now on");
        }
    }

    /// `https` or `http`, as chosen by the probe.
    pub fn scheme(&self) -> &'static str {
        self.session.scheme
    }

    /// The Authorization header for our own requests with these token
    /// `scopes` ([`Session::auth_header`]).
    ///
    /// # Errors
    /// As [`Session::auth_header`].
    pub(crate) async fn auth_header(
        &self,
        scopes: &[String],
        reference: &str,
    ) -> Result<Option<http::HeaderValue>> {
        self.session.auth_header(scopes, reference).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_for_loopback_and_listed_registries_only() {
        let listed = vec!["registry.internal:5000".to_owned()];
        for h in [
            "localhost:5000",
            "127.0.0.1:5000",
            "127.1.2.3",
            "[::1]:5000",
            "localhost",
            "registry.internal:5000",
        ] {
            assert!(allows_plain_http(&listed, h), "{h}");
        }
        for h in [
            "docker.io",
            "10.0.0.1:5000",
            "example.com:443",
            "[::2]:5000",
            "registry.internal",
            "registry.internal:5001",
        ] {
            assert!(!allows_plain_http(&listed, h), "{h}");
        }
    }
}
