//! `pinswap serve`: the HTTPS admission webhook and the plain-HTTP health
//! server (DESIGN.md §4).
//!
//! Two listeners, because they have different clients:
//! - the webhook (`:8443`, HTTPS, `POST /mutate`) is called by the API server,
//!   which only speaks TLS to webhooks;
//! - health and metrics (`:8080`, plain HTTP, `/healthz`, `/readyz`,
//!   `/metrics`) are scraped by the kubelet and Prometheus, which need no TLS
//!   and must keep working when the certificate is broken.
//!
//! Choices worth knowing:
//! - **Certificate reload.** cert-manager rotates the Secret, and the kubelet
//!   swaps the mounted files in place; nothing restarts the Pod. A task polls
//!   the certificate and key files' modification time and size every
//!   [`ServerOptions::reload_interval`] and reloads them into the live rustls
//!   config. New connections get the new certificate; open ones keep theirs. A
//!   file that fails to load (half-written, mismatched pair) is logged and the
//!   old certificate stays in use; the reload is retried at the next poll.
//! - **4 MiB body limit.** The API server caps a webhook request around 3 MiB
//!   (its etcd object limit plus the review envelope); 4 MiB admits every
//!   genuine review and refuses anything else early with 413.
//! - **400, not a denial, for malformed input.** A body that is not an
//!   AdmissionReview did not come from the API server; answering with an HTTP
//!   error (and counting it as `outcome="invalid"`) is clearer than inventing
//!   an AdmissionReview response with no uid to echo.
//! - **Graceful shutdown.** On SIGTERM both listeners stop accepting, requests
//!   in flight finish, and connections still open after [`SHUTDOWN_GRACE`] are
//!   closed. That stays inside Kubernetes' default 30 s termination grace.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::tls_rustls::RustlsConfig;
use axum_server::{Control, Handle};

use crate::admission::{Admission, ReviewError};
use crate::metrics::Metrics;

/// Largest `/mutate` request body accepted; larger ones get 413.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// How long shutdown waits for requests in flight before closing connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The content type of `/metrics` (OpenMetrics text, as prometheus-client
/// encodes it).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Where and how [`serve`] listens.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// HTTPS webhook address, e.g. `0.0.0.0:8443`.
    pub listen: SocketAddr,
    /// Plain-HTTP health and metrics address, e.g. `0.0.0.0:8080`.
    pub health_listen: SocketAddr,
    /// PEM certificate chain for the webhook (leaf first).
    pub tls_cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) matching `tls_cert`.
    pub tls_key: PathBuf,
    /// How often the certificate and key files are checked for changes.
    pub reload_interval: Duration,
}

impl ServerOptions {
    /// The defaults of `pinswap serve`: `:8443` and `:8080` on all
    /// addresses, a 10 s reload interval, and the given certificate files.
    pub fn new(tls_cert: PathBuf, tls_key: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8443)),
            health_listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            tls_cert,
            tls_key,
            reload_interval: Duration::from_secs(10),
        }
    }
}

/// Why [`serve`] could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A listen address could not be bound (in use, not local, privileged).
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// `webhook` or `health`.
        what: &'static str,
        /// The address from the options.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// The certificate or key could not be read or parsed at startup.
    #[error("cannot load TLS certificate {cert} and key {key}: {source}")]
    Tls {
        /// Certificate path.
        cert: PathBuf,
        /// Key path.
        key: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// A server failed while running.
    #[error("{what} server failed: {source}")]
    Serve {
        /// `webhook` or `health`.
        what: &'static str,
        /// The I/O error.
        source: io::Error,
    },
}

/// The webhook routes: `POST /mutate` takes an AdmissionReview and answers
/// 200 with the response AdmissionReview (`application/json`), 400 with the
/// parse error when the body is not an AdmissionReview, and 413 above
/// [`MAX_BODY_BYTES`]. Every request is timed into `admission_seconds` once;
/// 400 and 413 count as `admissions{outcome="invalid"}`.
pub fn webhook_router(admission: Arc<Admission>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state((admission, metrics))
}

/// `POST /mutate`. [`Admission::review`] counts and times the reviews it
/// answers; this counts and times the requests it refuses, so every request
/// is observed exactly once.
async fn mutate(
    State((admission, metrics)): State<(Arc<Admission>, Arc<Metrics>)>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    let refused = match body {
        Err(rejection) => rejection.into_response(),
        Ok(body) => match admission.review(body).await {
            Ok(json) => {
                return ([(header::CONTENT_TYPE, "application/json")], json).into_response();
            }
            Err(err @ ReviewError::Malformed(_)) => {
                tracing::debug!(error = %err, "refused /mutate body");
                (StatusCode::BAD_REQUEST, err.to_string()).into_response()
            }
        },
    };
    metrics.admission("invalid");
    metrics
        .admission_seconds
        .observe(start.elapsed().as_secs_f64());
    refused
}

/// The body of `POST /cache/purge`: `{"all": true}` or
/// `{"reference": "REF"}` (see [`crate::mirror::Mirror::purge`]).
#[derive(Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeRequest {
    /// Purge every entry of both caches.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
    /// Purge the entries of this source or target reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// `POST /cache/purge`: 200 `{"purged": N}`; 400 naming the problem for a
/// body that is not a [`PurgeRequest`] with exactly one of `all` and
/// `reference`, or a malformed reference; 404 while `cache.purgeEndpoint`
/// is off.
async fn purge(State(admission): State<Arc<Admission>>, body: Bytes) -> Response {
    if !admission.cache_purge() {
        return (
            StatusCode::NOT_FOUND,
            "cache purge is off; set cache.purgeEndpoint: true to serve it\n",
        )
            .into_response();
    }
    let req: PurgeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("expected {{\"all\": true}} or {{\"reference\": \"REF\"}}: {e}\n"),
            )
                .into_response();
        }
    };
    let selector = match (req.all, req.reference.as_deref()) {
        (true, None) => None,
        (false, Some(r)) => Some(r),
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                "give exactly one of \"all\": true and \"reference\"\n",
            )
                .into_response();
        }
    };
    match admission.mirror().purge(selector).await {
        Ok(n) => {
            tracing::info!(
                selector = selector.unwrap_or("all"),
                purged = n,
                "cache purged"
            );
            axum::Json(serde_json::json!({ "purged": n })).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("reference: {e}\n")).into_response(),
    }
}

/// The health routes: `GET /healthz` (always 200 `ok` while the process
/// serves), `GET /readyz` (200 when [`Admission::ready`], else 503),
/// `GET /metrics` (OpenMetrics text) and `POST /cache/purge` (see
/// [`PurgeRequest`]; 404 unless `cache.purgeEndpoint` is on).
pub fn health_router(admission: Arc<Admission>, metrics: Arc<Metrics>) -> Router {
    let for_metrics = admission.clone();
    let for_purge = admission.clone();
    Router::new()
        .route(
            "/cache/purge",
            post(purge)
                .with_state(for_purge)
                .layer(DefaultBodyLimit::max(64 * 1024)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(async move || {
                if admission.ready().await {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .route(
            "/metrics",
            get(async move || {
                for_metrics.mirror().caches().refresh_gauges().await;
                let content_type = [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)];
                (content_type, metrics.encode())
            }),
        )
}

/// Runs the HTTPS webhook and the health server until `shutdown` resolves,
/// then drains both (up to [`SHUTDOWN_GRACE`]) and returns `Ok(())`.
///
/// Needs a rustls crypto provider installed as the process default (`main`
/// installs ring).
///
/// # Errors
/// [`ServerError::Tls`] when the certificate or key cannot be loaded,
/// [`ServerError::Bind`] when an address cannot be bound (both before
/// anything is served), [`ServerError::Serve`] when a server fails later.
pub async fn serve(
    opts: ServerOptions,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let tls = RustlsConfig::from_pem_file(&opts.tls_cert, &opts.tls_key)
        .await
        .map_err(|source| ServerError::Tls {
            cert: opts.tls_cert.clone(),
            key: opts.tls_key.clone(),
            source,
        })?;
    let webhook_listener = bind("webhook", opts.listen)?;
    let health_listener = bind("health", opts.health_listen)?;
    let serve_err = |what| move |source| ServerError::Serve { what, source };

    let control = Control::new();
    // TCP_NODELAY: a small AdmissionReview response otherwise waits on the
    // client's delayed ACK (Nagle), adding ~40 ms to some admissions.
    let webhook = axum_server::from_tcp_rustls(webhook_listener, tls.clone())
        .map_err(serve_err("webhook"))?
        .map(|tls| tls.acceptor(axum_server::accept::NoDelayAcceptor::new()))
        .handle(Handle::with_control(control.clone()))
        .accept_error_handler(|peer, err| tracing::debug!(?peer, %err, "webhook connection"))
        .serve(webhook_router(admission.clone(), metrics.clone()).into_make_service());
    let health = axum_server::from_tcp(health_listener)
        .map_err(serve_err("health"))?
        .handle(Handle::with_control(control.clone()))
        .serve(health_router(admission, metrics).into_make_service());
    tracing::info!(webhook = %opts.listen, health = %opts.health_listen, "serving");

    let watcher = CertWatcher::new(tls, opts.tls_cert, opts.tls_key);
    let reload = tokio::spawn(watcher.run(opts.reload_interval));
    let stop = tokio::spawn(async move {
        shutdown.await;
        tracing::info!(grace = ?SHUTDOWN_GRACE, "shutting down");
        control.graceful_shutdown(Some(SHUTDOWN_GRACE));
    });
    let result = tokio::try_join!(
        async { webhook.await.map_err(serve_err("webhook")) },
        async { health.await.map_err(serve_err("health")) },
    );
    reload.abort();
    stop.abort();
    result.map(|_| ())
}

fn bind(what: &'static str, addr: SocketAddr) -> Result<std::net::TcpListener, ServerError> {
    std::net::TcpListener::bind(addr).map_err(|source| ServerError::Bind { what, addr, source })
}

/// Resolves on SIGTERM (what the kubelet sends) or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::warn!(%err, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("received Ctrl-C"),
        () = term => tracing::info!("received SIGTERM"),
    }
}

/// The modification time and size of a file, or `None` while it is missing.
type Stamp = Option<(SystemTime, u64)>;

/// Reloads the certificate into the live rustls config when its files change.
struct CertWatcher {
    tls: RustlsConfig,
    cert: PathBuf,
    key: PathBuf,
    /// The stamps of the files last loaded successfully.
    loaded: (Stamp, Stamp),
}

impl CertWatcher {
    fn new(tls: RustlsConfig, cert: PathBuf, key: PathBuf) -> Self {
        let loaded = (stamp(&cert), stamp(&key));
        Self {
            tls,
            cert,
            key,
            loaded,
        }
    }

    async fn run(mut self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is immediate
        loop {
            ticks.tick().await;
            self.poll().await;
        }
    }

    /// Reloads if either file changed since the last successful load. Returns
    /// whether a new certificate is now in use.
    async fn poll(&mut self) -> bool {
        let now = (stamp(&self.cert), stamp(&self.key));
        if now == self.loaded || now.0.is_none() || now.1.is_none() {
            return false;
        }
        match self.tls.reload_from_pem_file(&self.cert, &self.key).await {
            Ok(()) => {
                tracing::info!(cert = %self.cert.display(), "reloaded TLS certificate");
                self.loaded = now;
                true
            }
            Err(err) => {
                tracing::error!(
                    cert = %self.cert.display(), key = %self.key.display(), %err,
                    "cannot reload TLS certificate; keeping the previous one",
                );
                false
            }
        }
    }
}

fn stamp(path: &Path) -> Stamp {
    // `metadata` follows symlinks: the kubelet's `..data` swap shows up here.
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for 127.0.0.1: (cert PEM, key PEM).
    fn self_signed() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[tokio::test]
    async fn cert_watcher_reloads_changes_and_keeps_the_old_cert_on_errors() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let (pem, key_pem) = self_signed();
        std::fs::write(&cert, &pem).unwrap();
        std::fs::write(&key, &key_pem).unwrap();
        let tls = RustlsConfig::from_pem_file(&cert, &key).await.unwrap();
        let mut watcher = CertWatcher::new(tls.clone(), cert.clone(), key.clone());
        let first = tls.get_inner();

        assert!(!watcher.poll().await, "unchanged files must not reload");
        assert!(Arc::ptr_eq(&first, &tls.get_inner()));

        std::fs::write(&cert, "not a certificate").unwrap();
        assert!(!watcher.poll().await, "a broken file must not load");
        assert!(Arc::ptr_eq(&first, &tls.get_inner()), "old cert kept");

        std::fs::remove_file(&cert).unwrap();
        assert!(!watcher.poll().await, "a missing file must not load");

        let (pem, key_pem) = self_signed();
        std::fs::write(&cert, &pem).unwrap();
        std::fs::write(&key, &key_pem).unwrap();
        assert!(watcher.poll().await, "a new pair must load");
        assert!(!Arc::ptr_eq(&first, &tls.get_inner()));
        assert!(!watcher.poll().await, "and only once");
    }
}
