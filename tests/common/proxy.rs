//! A TCP forwarder in front of a registry that can be cut, to simulate the
//! registry dying mid-transfer deterministically.
//!
//! After [`TcpCutProxy::cut`] every live connection is reset (RST, so bytes
//! still in the proxy's socket buffers are lost, as when a host dies) and the
//! listener is dropped, so new connections are refused. Bytes the client's
//! kernel already received can still be read: a cut is only certain to break
//! a transfer larger than the loopback socket buffers (a few MiB). The proxy speaks TCP only: a TLS client
//! still sees the upstream's certificate (valid for 127.0.0.1).
//!
//! [`TcpCutProxy::stall_after`] instead holds every response that has
//! carried more than a given number of bytes server→client (a blob, not a
//! manifest) until [`TcpCutProxy::release`]: a copy that is still running.
//! The count restarts with each request a connection sends, so small
//! responses on a reused (keep-alive) connection are never held.
//!
//! [`TcpCutProxy::trickle_after`] lets each response's first bytes through
//! at full speed (headers, manifests, small blobs), then sends the rest one
//! byte at a time, a fixed interval apart: a source that is slow on purpose,
//! which no per-read timeout ever cuts.
//!
//! [`TcpCutProxy::black_hole`] is a partition that neither resets nor
//! refuses: connections are accepted and kept open, but no byte is
//! forwarded either way until it is lifted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct TcpCutProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

struct Shared {
    upstream: String,
    cut: watch::Sender<bool>,
    /// Bytes forwarded server→client, over all connections.
    down: AtomicU64,
    /// Cut once `down` reaches this (u64::MAX: never).
    limit: AtomicU64,
    /// Hold a connection once it has sent this many bytes downstream.
    stall: AtomicU64,
    /// Whether held connections may go on.
    released: watch::Sender<bool>,
    /// While true, nothing is forwarded either way.
    hole: watch::Sender<bool>,
    /// Bumped to close every live connection while still accepting new ones.
    resets: watch::Sender<u64>,
    /// Past this many bytes of one response, send one byte per `trickle_every`
    /// (u64::MAX: never).
    trickle: AtomicU64,
    /// Milliseconds between trickled bytes.
    trickle_every: AtomicU64,
    /// Responses being trickled now.
    trickling: AtomicUsize,
    /// Bytes a second all responses share, as on one link (u64::MAX: no
    /// limit); `link_free` is when the link is free again.
    pace: AtomicU64,
    link_free: std::sync::Mutex<tokio::time::Instant>,
}

impl TcpCutProxy {
    /// Listen on 127.0.0.1:free port and forward to `upstream` ("host:port").
    /// Needs a tokio runtime (any flavour).
    pub async fn start(upstream: &str) -> TcpCutProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream: upstream.to_owned(),
            cut: watch::channel(false).0,
            down: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
            stall: AtomicU64::new(u64::MAX),
            released: watch::channel(false).0,
            hole: watch::channel(false).0,
            resets: watch::channel(0).0,
            trickle: AtomicU64::new(u64::MAX),
            trickle_every: AtomicU64::new(0),
            trickling: AtomicUsize::new(0),
            pace: AtomicU64::new(u64::MAX),
            link_free: std::sync::Mutex::new(tokio::time::Instant::now()),
        });
        let s = shared.clone();
        let mut cut = shared.cut.subscribe();
        let accept = tokio::spawn(async move {
            // Returning drops the listener: connects are then refused.
            loop {
                tokio::select! {
                    r = listener.accept() => match r {
                        Ok((client, _)) => drop(tokio::spawn(forward(client, s.clone()))),
                        Err(_) => return,
                    },
                    _ = cut.wait_for(|c| *c) => return,
                }
            }
        });
        TcpCutProxy {
            addr,
            shared,
            accept,
        }
    }

    /// `127.0.0.1:PORT` of the proxy: give this to the client.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Reset every live connection now and refuse new ones.
    pub fn cut(&self) {
        self.shared.cut.send_replace(true);
        self.accept.abort();
    }

    /// Cut once `n` bytes in total have flowed server→client (counting what
    /// already flowed). Exactly `n` bytes get through: the connection that
    /// reaches the limit is closed gracefully after them, the others reset.
    pub fn cut_after_bytes(&self, n: u64) {
        self.shared.limit.store(n, Ordering::SeqCst);
        if self.shared.down.load(Ordering::SeqCst) >= n {
            self.cut();
        }
    }

    /// Hold each connection once it has forwarded `n` bytes server→client,
    /// until [`TcpCutProxy::release`].
    pub fn stall_after(&self, n: u64) {
        self.shared.released.send_replace(false);
        self.shared.stall.store(n, Ordering::SeqCst);
    }

    /// Lets held connections go on, and stops holding new ones.
    pub fn release(&self) {
        self.shared.stall.store(u64::MAX, Ordering::SeqCst);
        self.shared.released.send_replace(true);
    }

    /// Sends each response's first `n` bytes at full speed and the rest one
    /// byte per `every`, until [`TcpCutProxy::trickle_off`].
    pub fn trickle_after(&self, n: u64, every: Duration) {
        let ms = u64::try_from(every.as_millis()).unwrap().max(1);
        self.shared.trickle_every.store(ms, Ordering::SeqCst);
        self.shared.trickle.store(n, Ordering::SeqCst);
    }

    /// Forwards at full speed again, trickling responses included.
    pub fn trickle_off(&self) {
        self.shared.trickle.store(u64::MAX, Ordering::SeqCst);
    }

    /// Sends responses at `bytes_per_second` in all, as one link of that
    /// speed would: a registry across a network rather than on loopback.
    pub fn pace(&self, bytes_per_second: u64) {
        self.shared
            .pace
            .store(bytes_per_second.max(1), Ordering::SeqCst);
    }

    /// Responses at full speed again.
    pub fn pace_off(&self) {
        self.shared.pace.store(u64::MAX, Ordering::SeqCst);
    }

    /// Responses being trickled now (each holds its client's request open).
    pub fn trickling(&self) -> usize {
        self.shared.trickling.load(Ordering::SeqCst)
    }

    /// With `on`, forwards nothing either way (connections stay open and
    /// new ones are accepted) until `black_hole(false)`.
    pub fn black_hole(&self, on: bool) {
        self.shared.hole.send_replace(on);
    }

    /// Bytes forwarded server→client so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.down.load(Ordering::SeqCst)
    }

    /// Closes every live connection, as a load balancer or a node's
    /// conntrack does; new connections are still accepted.
    pub fn reset_connections(&self) {
        self.shared.resets.send_modify(|g| *g += 1);
    }

    pub fn is_cut(&self) -> bool {
        *self.shared.cut.borrow()
    }
}

impl Drop for TcpCutProxy {
    fn drop(&mut self) {
        self.cut();
    }
}

async fn forward(client: TcpStream, s: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(&s.upstream).await else {
        return;
    };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Bytes of the current response; the client side resets it when it
    // sends the next request (HTTP/1.1 answers in order).
    let response = Arc::new(AtomicU64::new(0));
    let mut resets = s.resets.subscribe();
    let up = tokio::spawn(pump(cr, sw, s.clone(), false, response.clone()));
    tokio::select! {
        _ = pump(sr, cw, s, true, response) => drop(up.await),
        // Dropping both halves of both sockets closes the connection.
        _ = resets.changed() => up.abort(),
    }
}

/// Copy `from` → `to` until EOF, error or cut. `downstream` counts bytes
/// against the limit and trips the cut when it is reached.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    s: Arc<Shared>,
    downstream: bool,
    response: Arc<AtomicU64>,
) {
    let mut cut = s.cut.subscribe();
    let mut released = s.released.subscribe();
    let mut hole = s.hole.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if downstream && response.load(Ordering::SeqCst) >= s.stall.load(Ordering::SeqCst) {
            tokio::select! {
                _ = released.wait_for(|r| *r) => {}
                _ = cut.wait_for(|c| *c) => return reset(&to),
            }
        }
        let mut n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = cut.wait_for(|c| *c) => return reset(&to),
        };
        let mut trip = false;
        if downstream {
            let limit = s.limit.load(Ordering::SeqCst);
            let before = s.down.fetch_add(n as u64, Ordering::SeqCst);
            if before + n as u64 >= limit {
                n = limit.saturating_sub(before) as usize;
                s.down.store(limit, Ordering::SeqCst);
                trip = true;
            }
        }
        // Read before the partition, or during it: held until it lifts.
        tokio::select! {
            _ = hole.wait_for(|h| !*h) => {}
            _ = cut.wait_for(|c| *c) => return reset(&to),
        }
        // Bytes of this read that go at full speed; the rest trickle.
        let fast = match downstream {
            true => {
                let left = s
                    .trickle
                    .load(Ordering::SeqCst)
                    .saturating_sub(response.load(Ordering::SeqCst));
                n.min(usize::try_from(left).unwrap_or(usize::MAX))
            }
            false => n,
        };
        let bps = s.pace.load(Ordering::SeqCst);
        if downstream && bps != u64::MAX {
            // Each read takes its turn on the link. Up to 20 ms of idle
            // link counts as credit, so timer overshoot does not lower the
            // rate below `pace`.
            let done = {
                let mut free = s.link_free.lock().unwrap();
                let now = tokio::time::Instant::now();
                let start = (*free).max(now - Duration::from_millis(20));
                *free = start + Duration::from_secs_f64(fast as f64 / bps as f64);
                *free
            };
            tokio::time::sleep_until(done).await;
        }
        // A stalled reader must not keep the connection alive past a cut.
        let written = tokio::select! {
            r = to.write_all(&buf[..fast]) => r,
            _ = cut.wait_for(|c| *c), if !trip => return reset(&to),
        };
        if written.is_err() {
            break;
        }
        if downstream {
            response.fetch_add(fast as u64, Ordering::SeqCst);
            if fast < n {
                let _trickling = Trickling::new(&s.trickling);
                for i in fast..n {
                    // Trickling stopped: the rest of this read at once.
                    if s.trickle.load(Ordering::SeqCst) == u64::MAX {
                        if to.write_all(&buf[i..n]).await.is_err() {
                            return;
                        }
                        break;
                    }
                    let every = Duration::from_millis(s.trickle_every.load(Ordering::SeqCst));
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        _ = cut.wait_for(|c| *c) => return reset(&to),
                    }
                    if to.write_all(&buf[i..=i]).await.is_err() {
                        return;
                    }
                }
                response.fetch_add((n - fast) as u64, Ordering::SeqCst);
            }
        } else {
            response.store(0, Ordering::SeqCst);
        }
        if trip {
            let _ = to.shutdown().await; // FIN after exactly the allowed bytes
            s.cut.send_replace(true);
            return;
        }
    }
    let _ = to.shutdown().await;
}

/// Counts a response as trickling while it lives.
struct Trickling<'a>(&'a AtomicUsize);

impl<'a> Trickling<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Trickling<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Make dropping the socket send RST and discard unsent data.
fn reset(to: &tokio::net::tcp::OwnedWriteHalf) {
    let _ = to.as_ref().set_zero_linger();
}
