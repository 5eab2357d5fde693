//! The accept loop and the life of each connection, for both listeners.
//!
//! Our own loop over hyper-util's auto (HTTP/1.1 + HTTP/2) builder, not
//! axum-server's: that one has a TLS handshake timeout but no idle timeout,
//! no header timeout separate from the keep-alive wait, no connection limit,
//! and no way to close one connection at a time.
//!
//! Every connection is tracked with its requests in flight and the instant
//! it last became idle, and a per-connection timer enforces:
//! - the TLS handshake timeout;
//! - the header timeout: a new connection must send its first request's
//!   headers within it of the handshake, and a kept-alive HTTP/1.1
//!   connection within it of the request's first byte (hyper's own
//!   `header_read_timeout` is off: it runs from the end of the previous
//!   response, so it would double as a far shorter idle timeout);
//! - the idle timeout between requests (HTTP/1.1 and HTTP/2 alike, so
//!   HTTP/2 PINGs do not keep an unused connection open).
//!
//! Body deadlines are the handler's ([`super::budget`]), since only it knows
//! when a body is complete. At `maxConnections` a new connection makes the
//! idlest one close; if none is idle the new one is refused. Closing is
//! graceful (HTTP/2 GOAWAY, HTTP/1.1 close when idle) with a short hard
//! deadline behind it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, Version, header};
use axum_server::tls_rustls::RustlsConfig;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tracing::{debug, warn};

use crate::logsafe::RateLimited;
use crate::metrics::Metrics;

/// Where a listener is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Accepting and serving.
    Serving,
    /// Shutting down but still serving: HTTP/1.1 responses carry
    /// `Connection: close` and HTTP/2 connections get a GOAWAY, so clients
    /// move to other replicas without losing a request.
    Draining,
    /// Not accepting; open connections finish their requests and close.
    Closing,
}

/// The per-connection limits of one listener.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// First request's headers from the handshake; later ones from their
    /// first byte.
    pub header_read_timeout: Duration,
    /// Wait for the next request on a kept-alive connection.
    pub idle_timeout: Duration,
    /// Open connections.
    pub max_connections: usize,
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// After [`Phase::Closing`], how long requests in flight may take.
    pub drain_timeout: Duration,
}

/// HTTP/1.1 read buffer: headers larger than this are refused (hyper's
/// default is about 400 KiB, which 1000 connections would multiply).
const MAX_H1_BUF: usize = 64 * 1024;
/// HTTP/2 flow-control windows: what a client may send before the handler
/// reads it, per stream and per connection.
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONN_WINDOW: u32 = 1024 * 1024;
const H2_MAX_HEADER_LIST: u32 = 32 * 1024;
/// How long a connection closed by a limit may take to go.
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Connections being closed that may be open on top of the limit.
const CLOSING_SLACK: usize = 32;
/// Between checks of a connection with requests in flight.
const BUSY_CHECK: Duration = Duration::from_secs(1);

fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// One connection's state, shared by its task, its service and its I/O.
#[derive(Debug)]
struct ConnState {
    in_flight: AtomicUsize,
    served: AtomicU64,
    /// When it last had no request in flight (ms since start).
    idle_since: AtomicU64,
    /// First byte read while idle, plus one; 0 when none.
    first_byte: AtomicU64,
    evicted: AtomicBool,
    evict: Notify,
}

impl ConnState {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            idle_since: AtomicU64::new(now_ms()),
            first_byte: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
        }
    }

    /// Which limit the connection is past, if any, and when to look again.
    fn check(&self, limits: &ConnLimits, h2: bool) -> (Option<&'static str>, Duration) {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return (None, BUSY_CHECK);
        }
        let now = now_ms();
        let header = limits.header_read_timeout.as_millis() as u64;
        let mut due = u64::MAX;
        let first = self.first_byte.load(Ordering::Acquire);
        if first > 0 && !h2 {
            let at = first - 1 + header;
            if now >= at {
                return (Some("header_timeout"), Duration::ZERO);
            }
            due = at;
        }
        let (limit, reason) = if self.served.load(Ordering::Acquire) == 0 {
            (header, "header_timeout")
        } else {
            (limits.idle_timeout.as_millis() as u64, "idle_timeout")
        };
        let at = self.idle_since.load(Ordering::Acquire) + limit;
        if now >= at {
            return (Some(reason), Duration::ZERO);
        }
        (None, Duration::from_millis(due.min(at) - now))
    }
}

/// Counts one request in flight on its connection until dropped.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn begin(state: Arc<ConnState>) -> Self {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        state.first_byte.store(0, Ordering::Release);
        Self(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.served.fetch_add(1, Ordering::AcqRel);
        self.0.idle_since.store(now_ms(), Ordering::Release);
        self.0.first_byte.store(0, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection's stream, noting the first byte that arrives while no
/// request is in flight (the start of the next request's headers).
struct Tracked<S> {
    inner: S,
    state: Arc<ConnState>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before
            && self.state.in_flight.load(Ordering::Acquire) == 0
            && self.state.first_byte.load(Ordering::Acquire) == 0
        {
            self.state.first_byte.store(now_ms() + 1, Ordering::Release);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The router as a hyper service that counts requests in flight and, while
/// draining, closes HTTP/1.1 connections after their response.
#[derive(Clone)]
struct Counted {
    router: Router,
    state: Arc<ConnState>,
    phase: watch::Receiver<Phase>,
}

impl hyper::service::Service<Request<Incoming>> for Counted {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let guard = InFlight::begin(self.state.clone());
        let h1 = req.version() < Version::HTTP_2;
        let mut router = self.router.clone();
        let phase = self.phase.clone();
        Box::pin(async move {
            // A Router is always ready (axum documents poll_ready as such).
            let mut response = tower_service::Service::call(&mut router, req).await?;
            if h1 && *phase.borrow() != Phase::Serving {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            drop(guard);
            Ok(response)
        })
    }
}

/// What every connection of one listener shares.
struct Shared {
    what: &'static str,
    tls: Option<RustlsConfig>,
    router: Router,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    conns: Mutex<HashMap<u64, Arc<ConnState>>>,
    next_id: AtomicU64,
    closed: Notify,
    warnings: Mutex<HashMap<&'static str, Arc<RateLimited>>>,
}

impl Shared {
    /// Counts a connection closed for `reason` and warns, rate-limited, when
    /// the reason is a limit a client ran into.
    fn closed_for(&self, reason: &'static str, peer: SocketAddr) {
        self.metrics.server.connection_closed(self.what, reason);
        if matches!(reason, "idle_timeout" | "drained" | "client") {
            debug!(listener = self.what, %peer, reason, "connection closed");
        } else {
            self.warn(reason, peer);
        }
    }

    fn warn(&self, reason: &'static str, peer: SocketAddr) {
        let limiter = {
            let mut w = self.warnings.lock().unwrap_or_else(|e| e.into_inner());
            w.entry(reason)
                .or_insert_with(|| Arc::new(RateLimited::new(Duration::from_secs(10))))
                .clone()
        };
        if let Some(held_back) = limiter.check() {
            warn!(
                listener = self.what,
                %peer,
                reason,
                held_back,
                "connection limit hit; closing the connection (like ones held back from the log since the last)"
            );
        }
    }

    fn len(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether a new connection may be served: under the limit, or an idle
    /// connection was told to close to make room.
    fn make_room(&self) -> bool {
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() < self.limits.max_connections {
            return true;
        }
        if conns.len() >= self.limits.max_connections + CLOSING_SLACK {
            return false;
        }
        evict_idlest_of(&conns)
    }

    fn register(self: &Arc<Self>) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::new());
        let n = {
            let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            conns.insert(id, state.clone());
            conns.len()
        };
        self.metrics.server.connections(self.what, n);
        Registered {
            shared: self.clone(),
            id,
            state,
        }
    }
}

/// A tracked connection; unregisters itself when dropped.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
    state: Arc<ConnState>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let n = {
            let mut conns = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
            conns.remove(&self.id);
            conns.len()
        };
        self.shared.metrics.server.connections(self.shared.what, n);
        self.shared.closed.notify_waiters();
    }
}

/// One listening socket and how its connections are served.
pub struct Listener {
    /// `webhook` or `health`, in logs and metrics.
    pub what: &'static str,
    /// The bound socket.
    pub tcp: TcpListener,
    /// TLS, or plain HTTP when `None`.
    pub tls: Option<RustlsConfig>,
    /// The routes.
    pub router: Router,
    /// Its limits.
    pub limits: ConnLimits,
    /// Where connections are counted.
    pub metrics: Arc<Metrics>,
}

impl Listener {
    /// Accepts until `phase` is [`Phase::Closing`] (or its sender is
    /// dropped), then closes the socket and returns when every connection
    /// has closed: gracefully, or at the drain timeout.
    pub async fn run(self, mut phase: watch::Receiver<Phase>) {
        let shared = Arc::new(Shared {
            what: self.what,
            tls: self.tls,
            router: self.router,
            limits: self.limits,
            metrics: self.metrics,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            closed: Notify::new(),
            warnings: Mutex::new(HashMap::new()),
        });
        let accept_errors = RateLimited::new(Duration::from_secs(10));
        loop {
            if *phase.borrow_and_update() == Phase::Closing {
                break;
            }
            tokio::select! {
                changed = phase.changed() => if changed.is_err() { break },
                accepted = self.tcp.accept() => match accepted {
                    Ok((tcp, peer)) => {
                        if !shared.make_room() {
                            shared.closed_for("refused", peer);
                            continue;
                        }
                        // A small AdmissionReview response otherwise waits
                        // on the client's delayed ACK (Nagle), ~40 ms.
                        let _ = tcp.set_nodelay(true);
                        let conn = shared.register();
                        tokio::spawn(connection(conn, tcp, peer, phase.clone()));
                    }
                    Err(err) => {
                        // Out of file descriptors, typically: make room and
                        // back off instead of spinning on the error.
                        if let Some(held_back) = accept_errors.check() {
                            warn!(listener = shared.what, %err, held_back, open = shared.len(), "cannot accept a connection");
                        }
                        shared.metrics.server.connection_closed(shared.what, "accept_error");
                        evict_idlest(&shared);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
        drop(self.tcp);
        loop {
            let closed = shared.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if shared.len() == 0 {
                break;
            }
            closed.await;
        }
    }
}

/// Tells the idlest connection to close, whatever the count.
fn evict_idlest(shared: &Shared) {
    evict_idlest_of(&shared.conns.lock().unwrap_or_else(|e| e.into_inner()));
}

/// Tells the connection idle the longest to close; false when none is idle.
fn evict_idlest_of(conns: &HashMap<u64, Arc<ConnState>>) -> bool {
    let idlest = conns
        .values()
        .filter(|c| c.in_flight.load(Ordering::Acquire) == 0 && !c.evicted.load(Ordering::Acquire))
        .min_by_key(|c| c.idle_since.load(Ordering::Acquire));
    match idlest {
        Some(c) => {
            c.evicted.store(true, Ordering::Release);
            c.evict.notify_one();
            true
        }
        None => false,
    }
}

async fn connection(
    conn: Registered,
    tcp: TcpStream,
    peer: SocketAddr,
    phase: watch::Receiver<Phase>,
) {
    let shared = conn.shared.clone();
    let Some(tls) = &shared.tls else {
        return serve_io(&conn, tcp, false, peer, phase).await;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.get_inner());
    let handshake = tokio::time::timeout(shared.limits.tls_handshake_timeout, acceptor.accept(tcp));
    let stream = tokio::select! {
        r = handshake => match r {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => {
                debug!(listener = shared.what, %peer, %err, "TLS handshake failed");
                shared.metrics.server.connection_closed(shared.what, "tls_error");
                return;
            }
            Err(_) => return shared.closed_for("handshake_timeout", peer),
        },
        () = conn.state.evict.notified() => return shared.closed_for("evicted", peer),
    };
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    serve_io(&conn, stream, h2, peer, phase).await;
}

async fn serve_io<I>(
    conn: &Registered,
    io: I,
    h2: bool,
    peer: SocketAddr,
    mut phase: watch::Receiver<Phase>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let shared = &conn.shared;
    let limits = &shared.limits;
    let state = &conn.state;
    // The header timeout of the first request runs from here.
    state.idle_since.store(now_ms(), Ordering::Release);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(MAX_H1_BUF);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        .max_header_list_size(H2_MAX_HEADER_LIST);
    let service = Counted {
        router: shared.router.clone(),
        state: state.clone(),
        phase: phase.clone(),
    };
    let io = TokioIo::new(Tracked {
        inner: io,
        state: state.clone(),
    });
    let served = builder.serve_connection(io, service);
    tokio::pin!(served);
    // Whether the connection was told to close (GOAWAY, or close when idle),
    // and when to drop it regardless.
    let mut sent = false;
    let mut hard: Option<tokio::time::Instant> = None;
    let mut phase_open = true;
    let now = tokio::time::Instant::now;
    if *phase.borrow_and_update() == Phase::Closing {
        served.as_mut().graceful_shutdown();
        (sent, hard) = (true, Some(now() + limits.drain_timeout));
    }
    loop {
        let wake = match hard {
            Some(at) => Some(at),
            None if !sent => Some(now() + state.check(limits, h2).1),
            None => None,
        };
        tokio::select! {
            r = served.as_mut() => {
                if let Err(err) = r {
                    debug!(listener = shared.what, %peer, %err, "connection ended with an error");
                }
                return;
            }
            changed = phase.changed(), if phase_open => {
                if changed.is_err() {
                    phase_open = false;
                    continue;
                }
                match *phase.borrow_and_update() {
                    Phase::Serving => {}
                    // GOAWAY is race-free: the client retries elsewhere the
                    // streams the server never saw. HTTP/1.1 connections
                    // close after their next response instead.
                    Phase::Draining => {
                        if h2 && !sent {
                            served.as_mut().graceful_shutdown();
                            sent = true;
                        }
                    }
                    Phase::Closing => {
                        if !sent {
                            served.as_mut().graceful_shutdown();
                            sent = true;
                        }
                        let at = now() + limits.drain_timeout;
                        hard = Some(hard.map_or(at, |h| h.min(at)));
                    }
                }
            }
            () = tokio::time::sleep_until(wake.unwrap_or_else(now)), if wake.is_some() => {
                if let Some(at) = hard {
                    if now() >= at {
                        shared.closed_for("drained", peer);
                        return;
                    }
                    continue;
                }
                if let (Some(reason), _) = state.check(limits, h2) {
                    shared.closed_for(reason, peer);
                    served.as_mut().graceful_shutdown();
                    (sent, hard) = (true, Some(now() + CLOSE_GRACE));
                }
            }
            () = state.evict.notified(), if !sent => {
                shared.closed_for("evicted", peer);
                served.as_mut().graceful_shutdown();
                (sent, hard) = (true, Some(now() + CLOSE_GRACE));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            tls_handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(600),
            max_connections: 10,
            max_concurrent_streams: 4,
            drain_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn header_then_idle_timeouts() {
        let s = Arc::new(ConnState::new());
        let l = limits();
        assert_eq!(s.check(&l, false).0, None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            s.check(&l, false).0,
            Some("header_timeout"),
            "first request's headers"
        );
        let guard = InFlight::begin(s.clone());
        assert_eq!(s.check(&l, false), (None, BUSY_CHECK), "busy");
        drop(guard);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            s.check(&l, false).0,
            None,
            "kept alive: idle timeout applies"
        );
        s.first_byte.store(now_ms() + 1, Ordering::Release);
        assert_eq!(s.check(&l, true).0, None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            s.check(&l, false).0,
            Some("header_timeout"),
            "next request's headers"
        );
        assert_eq!(s.check(&l, true).0, None, "HTTP/2: bytes are not a request");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(s.check(&l, true).0, Some("idle_timeout"));
    }
}
