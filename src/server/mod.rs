//! `pinswap serve`: the HTTPS admission webhook and the plain-HTTP health
//! server (docs/architecture.md §4).
//!
//! Two listeners, because they have different clients:
//! - the webhook (`:8443`, HTTPS, `POST /mutate`) is called by the API server,
//!   which only speaks TLS to webhooks;
//! - health and metrics (`:8080`, plain HTTP, `/healthz`, `/readyz`,
//!   `/metrics`) are scraped by the kubelet and Prometheus, which need no TLS
//!   and must keep working when the certificate is broken.
//!
//! Choices worth knowing:
//! - **Bounded clients.** What a client can make the server hold is bounded
//!   in time and memory: TLS handshake, header, body and idle timeouts and a
//!   connection limit ([`conn`]), and a byte budget over every request body
//!   in flight ([`budget`]). A body over [`MAX_BODY_BYTES`] is refused with
//!   413 from its `Content-Length`, before it is read; a body the budget
//!   cannot hold gets 503 at once.
//! - **4 MiB body limit.** The API server caps a webhook request around 3 MiB
//!   (its etcd object limit plus the review envelope); 4 MiB admits every
//!   genuine review.
//! - **400, not a denial, for malformed input.** A body that is not an
//!   AdmissionReview did not come from the API server; answering with an HTTP
//!   error (and counting it as `outcome="invalid"`) is clearer than inventing
//!   an AdmissionReview response with no uid to echo.
//! - **Shutdown loses no admission.** On SIGTERM `/readyz` fails at once and
//!   the webhook keeps serving for `server.shutdownDelay`, while the
//!   endpoint is removed everywhere; HTTP/1.1 responses then carry
//!   `Connection: close` and HTTP/2 connections get a GOAWAY, so clients
//!   reconnect to other replicas. After the delay the webhook stops
//!   accepting, requests in flight finish (up to `server.drainTimeout`), and
//!   the health server stops last.

pub(crate) mod budget;
pub(crate) mod conn;
mod reload;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::tls_rustls::RustlsConfig;
use tokio::sync::watch;

use crate::admission::{Admission, ReviewError};
use crate::logsafe::{RateLimited, Untrusted, clip};
use crate::metrics::Metrics;
use budget::{BodyBudget, BodyError};
use conn::{ConnLimits, Listener, Phase};

/// Largest `/mutate` request body accepted; larger ones get 413.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// What a review holds of the body budget while it is parsed and answered,
/// as a multiple of its body. `tests/body_memory.rs` counts the heap bytes
/// allocated around `Admission::review` of 4 MiB reviews of the costliest
/// shapes per byte: small containers peak at 23.1 times the body, small
/// env vars at 18.1, small annotations at 14.2. Those are
/// requested bytes; the allocator rounds each of the many small ones up to
/// its 32-byte chunk, so 32 (docs/benchmarks.md, "Body memory").
pub const PARSED_FACTOR: u64 = 32;

/// Open connections the health listener keeps (kubelet probes and
/// Prometheus need a handful).
pub const HEALTH_MAX_CONNECTIONS: usize = 64;

/// File descriptors kept free of webhook connections: the health listener,
/// registry connections, config and certificate files.
const RESERVED_FDS: u64 = 192;

/// The content type of `/metrics` (OpenMetrics text, as prometheus-client
/// encodes it).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Time and memory limits of the listeners (config `server`; see
/// docs/configuration.md for what each bounds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// TLS handshake of a new webhook connection.
    pub tls_handshake_timeout: Duration,
    /// A request's headers: from the handshake on a new connection, from
    /// their first byte on a kept-alive one.
    pub header_read_timeout: Duration,
    /// A request's body, from its headers.
    pub body_timeout: Duration,
    /// A kept-alive connection's wait for its next request.
    pub idle_timeout: Duration,
    /// Open webhook connections (lowered to fit the file-descriptor limit).
    pub max_connections: usize,
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// Bytes of request bodies buffered at once, over all connections.
    pub body_memory: u64,
    /// How long the webhook keeps serving after the shutdown signal.
    pub shutdown_delay: Duration,
    /// How long requests in flight may take to finish after the delay.
    pub drain_timeout: Duration,
}

impl Limits {
    /// The limits a config's `server` section sets; a `bodyMemory`
    /// percentage is taken of the container's cgroup memory limit, or of
    /// [`crate::config::ASSUMED_MEMORY_LIMIT`] when there is none.
    pub fn from_config(server: &crate::config::Server) -> Self {
        let limit = container_memory_limit().unwrap_or(crate::config::ASSUMED_MEMORY_LIMIT);
        Self {
            tls_handshake_timeout: server.tls_handshake_timeout,
            header_read_timeout: server.header_read_timeout,
            body_timeout: server.body_timeout,
            idle_timeout: server.idle_timeout,
            max_connections: server.max_connections,
            max_concurrent_streams: server.max_concurrent_streams,
            // A small container's share still holds the largest review.
            body_memory: server
                .body_memory
                .bytes(limit)
                .max(crate::config::MIN_BODY_MEMORY),
            shutdown_delay: server.shutdown_delay,
            drain_timeout: server.drain_timeout,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::from_config(&crate::config::Server::default())
    }
}

/// The memory limit of this process's cgroup (v2 `memory.max`, else v1
/// `memory.limit_in_bytes`), if it has one.
pub fn container_memory_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let v2 = read("/sys/fs/cgroup/memory.max");
    let v1 = || read("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    let text = v2.or_else(v1)?;
    // "max", or v1's "no limit" (a page-rounded i64::MAX).
    text.trim().parse::<u64>().ok().filter(|&n| n < 1 << 60)
}

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
    /// Timeouts, connection and memory limits, shutdown timing.
    pub limits: Limits,
}

impl ServerOptions {
    /// The defaults of `pinswap serve`: `:8443` and `:8080` on all
    /// addresses, a 10 s reload interval, the default [`Limits`], and the
    /// given certificate files.
    pub fn new(tls_cert: PathBuf, tls_key: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8443)),
            health_listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            tls_cert,
            tls_key,
            reload_interval: Duration::from_secs(10),
            limits: Limits::default(),
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

/// What the webhook routes share.
struct Webhook {
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    budget: BodyBudget,
    body_timeout: Duration,
    refusals: RateLimited,
}

/// The webhook routes with the default [`Limits`]; see
/// [`webhook_router_with`].
pub fn webhook_router(admission: Arc<Admission>, metrics: Arc<Metrics>) -> Router {
    let limits = Limits::default();
    webhook_router_with(
        admission,
        metrics,
        BodyBudget::new(limits.body_memory),
        limits.body_timeout,
    )
}

/// The webhook routes: `POST /mutate` takes an AdmissionReview and answers
/// 200 with the response AdmissionReview (`application/json`); 400 with the
/// parse error when the body is not an AdmissionReview (`admission.k8s.io/v1`
/// or `v1beta1`); 413 when its `Content-Length` (or the bytes received) pass
/// [`MAX_BODY_BYTES`]; 503 with `Retry-After: 1` when `budget` cannot hold
/// it now; 408 when it does not arrive within `body_timeout` of its
/// headers. Every request is timed into `admission_seconds` once; refusals
/// count as `admissions{outcome="invalid"}` and, all but 400,
/// `requests_refused{reason}`.
pub fn webhook_router_with(
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    budget: BodyBudget,
    body_timeout: Duration,
) -> Router {
    metrics
        .server
        .body_budget
        .set(i64::try_from(budget.bytes()).unwrap_or(i64::MAX));
    Router::new()
        .route("/mutate", post(mutate))
        .with_state(Arc::new(Webhook {
            admission,
            metrics,
            budget,
            body_timeout,
            refusals: RateLimited::new(Duration::from_secs(10)),
        }))
}

/// `POST /mutate`. [`Admission::review`] counts and times the reviews it
/// answers; this counts and times the requests it refuses, so every request
/// is observed exactly once.
async fn mutate(State(app): State<Arc<Webhook>>, request: Request) -> Response {
    let start = Instant::now();
    let declared = match request.headers().get(header::CONTENT_LENGTH) {
        None => axum::body::HttpBody::size_hint(request.body()).exact(),
        Some(v) => match v.to_str().ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(n) => Some(n),
            None => {
                return app.refuse(
                    start,
                    StatusCode::BAD_REQUEST,
                    "Content-Length: not a byte count".into(),
                    None,
                );
            }
        },
    };
    let h1 = request.version() < axum::http::Version::HTTP_2;
    let deadline = start + app.body_timeout;
    let limit = MAX_BODY_BYTES as u64;
    let read = match budget::admit(declared, limit, &app.budget) {
        Ok(reservation) => {
            budget::read_body(request.into_body(), declared, limit, reservation, deadline).await
        }
        Err(e) => {
            // Refused before reading: answer at once. Over HTTP/1.1, read and
            // drop what the client still sends (up to a bound, holding none
            // of it) before the connection closes: closing on unread data
            // resets the connection, and the client may never see the
            // answer. HTTP/2 ends just the stream (RST_STREAM NO_ERROR).
            let mut response = app.refused(start, e);
            if h1 {
                let n = declared.unwrap_or(0).min(2 * limit);
                tokio::spawn(budget::discard(request.into_body(), n, deadline));
                response.headers_mut().insert(
                    header::CONNECTION,
                    header::HeaderValue::from_static("close"),
                );
            }
            return response;
        }
    };
    let (body, mut reservation) = match read {
        Ok(read) => read,
        Err(e) => return app.refused(start, e),
    };
    // The parsed review takes several times the body's bytes; a review of
    // many small objects (thousands of containers) many times.
    if let Err(e) = reservation.grow_to(body.len() as u64 * PARSED_FACTOR) {
        return app.refused(start, e);
    }
    let answer = app.admission.review(body).await;
    // The review's parsed form is gone by now.
    drop(reservation);
    match answer {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(err @ ReviewError::Malformed(_)) => {
            let message = err.to_string();
            tracing::debug!(error = %Untrusted(&message), "refused /mutate body");
            app.refuse(start, StatusCode::BAD_REQUEST, message, None)
        }
    }
}

impl Webhook {
    /// The answer to a body that was not read: counted, logged (rate-limited).
    fn refused(&self, start: Instant, e: BodyError) -> Response {
        let (status, reason) = match &e {
            BodyError::TooLarge { .. } | BodyError::OverBudget { .. } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
            }
            BodyError::Busy => (StatusCode::SERVICE_UNAVAILABLE, "body_memory"),
            BodyError::Timeout => (StatusCode::REQUEST_TIMEOUT, "body_timeout"),
            BodyError::Read(_) => (StatusCode::BAD_REQUEST, "body_read"),
        };
        self.metrics.server.request_refused(reason);
        if let Some(held_back) = self.refusals.check() {
            tracing::warn!(
                reason,
                error = %e,
                in_use = self.budget.in_use(),
                budget = self.budget.bytes(),
                held_back,
                "refused a /mutate request (like ones held back from the log since the last)"
            );
        }
        self.refuse(start, status, e.to_string(), Some(reason))
    }

    fn refuse(
        &self,
        start: Instant,
        status: StatusCode,
        message: String,
        reason: Option<&str>,
    ) -> Response {
        self.metrics.admission("invalid");
        self.metrics
            .admission_seconds
            .observe(start.elapsed().as_secs_f64());
        let mut response = (status, message).into_response();
        if reason == Some("body_memory") {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
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

/// Characters kept of a not-ready reason in `/readyz`'s answer.
const READY_REASON_CHARS: usize = 500;

/// `/readyz`'s last answer, so each change between ready and not ready is
/// logged once rather than once per probe.
#[derive(Debug, Default)]
struct Readiness {
    /// `None` before the first probe.
    last: std::sync::Mutex<Option<bool>>,
}

impl Readiness {
    /// Records one probe's answer; logs it when it is not the last one's.
    fn observe(&self, now: &Result<(), String>) {
        let ready = now.is_ok();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if *last == Some(ready) {
            return;
        }
        *last = Some(ready);
        match now {
            Ok(()) => tracing::info!("ready"),
            Err(reason) => tracing::warn!(reason = %clip(reason, READY_REASON_CHARS), "not ready"),
        }
    }
}

/// The health routes: `GET /healthz` (always 200 `ok` while the process
/// serves), `GET /readyz` (200 `ok` when [`Admission::ready`], else 503
/// with the reason on one plain-text line, e.g. `target HOST unreachable:
/// ...` or `shutting down`; each change is logged once),
/// `GET /metrics` (OpenMetrics text) and `POST /cache/purge` (see
/// [`PurgeRequest`]; 404 unless `cache.purgeEndpoint` is on).
pub fn health_router(admission: Arc<Admission>, metrics: Arc<Metrics>) -> Router {
    health_routes(admission, metrics, Arc::new(AtomicBool::new(false)), None)
}

/// [`health_router`], with `/readyz` answering 503 `shutting down` once
/// `stopping` is set, and `/metrics` reporting `budget`'s use.
fn health_routes(
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    stopping: Arc<AtomicBool>,
    budget: Option<BodyBudget>,
) -> Router {
    let for_metrics = admission.clone();
    let for_purge = admission.clone();
    let readiness = Arc::new(Readiness::default());
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
                let now = match stopping.load(Ordering::Acquire) {
                    true => Err("shutting down".to_owned()),
                    false => admission.ready().await.map_err(|e| e.to_string()),
                };
                readiness.observe(&now);
                match now {
                    Ok(()) => (StatusCode::OK, "ok".to_owned()),
                    Err(reason) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        clip(&reason, READY_REASON_CHARS),
                    ),
                }
            }),
        )
        .route(
            "/metrics",
            get(async move || {
                for_metrics.mirror().caches().refresh_gauges().await;
                if let Some(b) = &budget {
                    metrics
                        .server
                        .body_bytes
                        .set(i64::try_from(b.in_use()).unwrap_or(i64::MAX));
                }
                let content_type = [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)];
                (content_type, metrics.encode())
            }),
        )
}

/// Raises the soft file-descriptor limit to the hard one, as the Go runtime
/// does, and returns the soft limit now in force (`None` if unknown).
fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if setrlimit(Resource::Nofile, limit).is_err() {
            limit = getrlimit(Resource::Nofile);
        }
    }
    limit.current
}

/// Runs the HTTPS webhook and the health server until `shutdown` resolves,
/// then shuts down as the module documentation describes (delay, then
/// drain) and returns `Ok(())`.
///
/// Needs a rustls crypto provider installed as the process default (`main`
/// installs ring).
///
/// # Errors
/// [`ServerError::Tls`] when the certificate or key cannot be loaded,
/// [`ServerError::Bind`] when an address cannot be bound (both before
/// anything is served), [`ServerError::Serve`] when a socket cannot be
/// handed to the runtime.
pub async fn serve(
    opts: ServerOptions,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_with(opts, admission, metrics, Router::new(), shutdown).await
}

/// [`serve`], with `extra` routes on the health listener (the leader's
/// `GET /retention/plan`, which needs what only the background knows).
///
/// # Errors
/// As [`serve`].
pub async fn serve_with(
    opts: ServerOptions,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    extra: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let tls = RustlsConfig::from_pem_file(&opts.tls_cert, &opts.tls_key)
        .await
        .map_err(|source| ServerError::Tls {
            cert: opts.tls_cert.clone(),
            key: opts.tls_key.clone(),
            source,
        })?;
    let webhook_tcp = bind("webhook", opts.listen)?;
    let health_tcp = bind("health", opts.health_listen)?;
    // The bound addresses, so a listen port of 0 is logged as the one taken.
    let bound =
        |tcp: &tokio::net::TcpListener, asked: SocketAddr| tcp.local_addr().unwrap_or(asked);
    let (webhook_addr, health_addr) = (
        bound(&webhook_tcp, opts.listen),
        bound(&health_tcp, opts.health_listen),
    );
    let limits = &opts.limits;
    let mut max_connections = limits.max_connections;
    if let Some(fds) = raise_fd_limit() {
        let fit = usize::try_from(fds.saturating_sub(RESERVED_FDS).max(16)).unwrap_or(usize::MAX);
        if fit < max_connections {
            tracing::warn!(
                max_connections,
                file_descriptors = fds,
                lowered_to = fit,
                "server.maxConnections does not fit the file-descriptor limit; lowered"
            );
            max_connections = fit;
        }
    }
    let conn_limits = ConnLimits {
        tls_handshake_timeout: limits.tls_handshake_timeout,
        header_read_timeout: limits.header_read_timeout,
        idle_timeout: limits.idle_timeout,
        max_connections,
        max_concurrent_streams: limits.max_concurrent_streams,
        drain_timeout: limits.drain_timeout,
    };
    let budget = BodyBudget::new(limits.body_memory);
    let stopping = Arc::new(AtomicBool::new(false));
    let webhook = Listener {
        what: "webhook",
        tcp: webhook_tcp,
        tls: Some(tls.clone()),
        router: webhook_router_with(
            admission.clone(),
            metrics.clone(),
            budget.clone(),
            limits.body_timeout,
        ),
        limits: conn_limits.clone(),
        metrics: metrics.clone(),
    };
    let health = Listener {
        what: "health",
        tcp: health_tcp,
        tls: None,
        router: health_routes(admission, metrics.clone(), stopping.clone(), Some(budget))
            .merge(extra),
        limits: ConnLimits {
            max_connections: HEALTH_MAX_CONNECTIONS,
            ..conn_limits
        },
        metrics,
    };
    tracing::info!(webhook = %webhook_addr, health = %health_addr, max_connections, body_memory = limits.body_memory, "serving");

    let watcher = reload::CertWatcher::new(tls, opts.tls_cert, opts.tls_key);
    let reload = tokio::spawn(watcher.run(opts.reload_interval));
    let (webhook_phase, webhook_rx) = watch::channel(Phase::Serving);
    let (health_phase, health_rx) = watch::channel(Phase::Serving);
    let webhook = tokio::spawn(webhook.run(webhook_rx));
    let health = tokio::spawn(health.run(health_rx));

    shutdown.await;
    stopping.store(true, Ordering::Release);
    tracing::info!(
        delay = %humantime::format_duration(limits.shutdown_delay),
        "shutting down: /readyz fails; the webhook serves until the delay ends"
    );
    let _ = webhook_phase.send(Phase::Draining);
    tokio::time::sleep(limits.shutdown_delay).await;
    tracing::info!(
        drain = %humantime::format_duration(limits.drain_timeout),
        "no longer accepting webhook connections; finishing requests in flight"
    );
    let _ = webhook_phase.send(Phase::Closing);
    let _ = webhook.await;
    let _ = health_phase.send(Phase::Closing);
    let _ = health.await;
    reload.abort();
    tracing::info!("stopped");
    Ok(())
}

/// Connections the kernel completes before they are accepted. A burst
/// beyond the backlog is not refused: the kernel drops the handshake's last
/// ACK, and the client holds a connection the server never sees.
const LISTEN_BACKLOG: u32 = 1024;

fn bind(what: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, ServerError> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    };
    let bound = socket.and_then(|s| {
        // As std's bind does: a restarted server can rebind at once.
        s.set_reuseaddr(true)?;
        s.bind(addr)?;
        s.listen(LISTEN_BACKLOG)
    });
    bound.map_err(|source| ServerError::Bind { what, addr, source })
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
