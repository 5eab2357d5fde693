//! A forward HTTP proxy on 127.0.0.1, as an egress proxy is: `CONNECT
//! host:port` tunnels and absolute-URI requests (`GET http://host/…`). It
//! records the request line of each, in order, and reaches every host at
//! 127.0.0.1 on the port asked for: it stands for a proxy that resolves
//! names itself, so whatever reaches it would have gone out.
//!
//! Each absolute-URI request is sent upstream with `Connection: close`, and
//! its client connection ends with it, so every request is seen.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// The running proxy; stops when dropped.
pub struct ForwardProxy {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ForwardProxy {
    /// Listens on 127.0.0.1:0.
    pub async fn start() -> ForwardProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, log.clone()));
            }
        });
        ForwardProxy { addr, seen, task }
    }

    /// `http://127.0.0.1:PORT`, for `HTTPS_PROXY` and `HTTP_PROXY`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The request line of every request so far (`CONNECT a.test:443
    /// HTTP/1.1`, `GET http://a.test:5000/v2/ HTTP/1.1`), in order.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    /// Whether any request so far named `part` in its request line.
    pub fn saw(&self, part: &str) -> bool {
        self.seen().iter().any(|l| l.contains(part))
    }

    /// Forgets what it saw.
    pub fn reset(&self) {
        self.seen.lock().unwrap().clear();
    }
}

impl Drop for ForwardProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The port of `host:port` (IPv6 in brackets), 80 when none is given.
fn port_of(authority: &str) -> u16 {
    match authority.rsplit_once(':') {
        Some((h, p)) if !p.contains(']') && !h.is_empty() => p.parse().unwrap_or(80),
        _ => 80,
    }
}

async fn serve(conn: TcpStream, seen: Arc<Mutex<Vec<String>>>) {
    let mut client = BufReader::new(conn);
    let mut line = String::new();
    if client.read_line(&mut line).await.unwrap_or(0) == 0 {
        return;
    }
    let line = line.trim_end().to_owned();
    seen.lock().unwrap().push(line.clone());
    let mut parts = line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    // The rest of the head: kept for an absolute-URI request, dropped for
    // CONNECT.
    let mut head = Vec::new();
    loop {
        let mut h = String::new();
        if client.read_line(&mut h).await.unwrap_or(0) == 0 {
            return;
        }
        if h == "\r\n" || h == "\n" {
            break;
        }
        let name = h.split(':').next().unwrap_or("").to_ascii_lowercase();
        if !matches!(
            name.as_str(),
            "connection" | "proxy-connection" | "proxy-authorization"
        ) {
            head.push(h);
        }
    }
    if method == "CONNECT" {
        let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", port_of(target))).await else {
            let _ = client
                .get_mut()
                .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                .await;
            return;
        };
        let established = b"HTTP/1.1 200 Connection established\r\n\r\n";
        if client.get_mut().write_all(established).await.is_err() {
            return;
        }
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        return;
    }
    let Ok(url) = url::Url::parse(target) else {
        let _ = client
            .get_mut()
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    let port = url.port_or_known_default().unwrap_or(80);
    let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", port)).await else {
        let _ = client
            .get_mut()
            .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    };
    let mut out = format!("{method} {path} HTTP/1.1\r\n");
    for h in head {
        out.push_str(&h);
    }
    out.push_str("connection: close\r\n\r\n");
    if upstream.write_all(out.as_bytes()).await.is_err() {
        return;
    }
    // Whatever of the body the reader holds already, then the rest.
    let buffered = client.buffer().to_vec();
    if upstream.write_all(&buffered).await.is_err() {
        return;
    }
    let mut client = client.into_inner();
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}
