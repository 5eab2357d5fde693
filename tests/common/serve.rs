//! `pinswap serve` as a separate process, for tests that measure it from the
//! outside (memory from `/proc/PID/status`, file descriptors, signals) or
//! lower its limits (`prlimit`), and raw TLS clients that misbehave.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::registry::free_port;

/// A running `pinswap serve` whose target is down and whose only allowed
/// source is `registry.invalid`, so reviews never wait on a registry.
pub struct Served {
    pub child: tokio::process::Child,
    pub webhook: SocketAddr,
    pub health: SocketAddr,
    pub ca_pem: String,
    pub log: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Served {
    /// Starts it with `server` keys added to the `server` mapping (flow
    /// YAML, e.g. `bodyMemory: 64Mi, bodyTimeout: 3s`) and `top` keys at the
    /// top level, under `prlimit --nofile=N:N` when `nofile` is given.
    pub async fn start(server: &str, top: &str, nofile: Option<u64>) -> Self {
        let body = format!(
            "target: {{registry: \"127.0.0.1:{}\", insecure: true}}\n\
             source: {{registries: [{{registry: registry.invalid}}]}}\n\
             recovery: {{enabled: false}}\n\
             {top}\n",
            free_port(),
        );
        Self::start_with(&body, server, &[], nofile).await
    }

    /// Starts it with the config `body` (every top-level key but `server`),
    /// `server` keys added to the `server` mapping, and `env` set.
    pub async fn start_with(
        body: &str,
        server: &str,
        env: &[(&str, &str)],
        nofile: Option<u64>,
    ) -> Self {
        super::init();
        let dir = tempfile::tempdir().unwrap();
        let pki = super::tls::pki("serve", &["127.0.0.1"]);
        std::fs::write(dir.path().join("tls.crt"), &pki.cert_pem).unwrap();
        std::fs::write(dir.path().join("tls.key"), &pki.key_pem).unwrap();
        // Port 0: the ports taken are read back from the "serving" line.
        let sep = if server.is_empty() { "" } else { ", " };
        let config = format!(
            "{body}\nserver: {{listen: \"127.0.0.1:0\", healthListen: \"127.0.0.1:0\", tlsCert: {}, tlsKey: {}{sep}{server}}}\n",
            dir.path().join("tls.crt").display(),
            dir.path().join("tls.key").display(),
        );
        let cfg = dir.path().join("config.yaml");
        std::fs::write(&cfg, config).unwrap();
        let log = dir.path().join("serve.log");
        let stderr = std::fs::File::create(&log).unwrap();
        let bin = super::pinswap_bin();
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = tokio::process::Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg(bin);
                c
            }
            None => tokio::process::Command::new(bin),
        };
        let mut child = cmd
            .args(["serve", "--config", cfg.to_str().unwrap()])
            .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let t = Instant::now();
        let (webhook, health) = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(addrs) = text.lines().find_map(serving_addresses) {
                break addrs;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "serve never bound its ports: {text}"
            );
            if let Ok(Some(status)) = child.try_wait() {
                panic!("serve exited with {status}: {text}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let served = Self {
            child,
            webhook,
            health,
            ca_pem: pki.ca_pem,
            log,
            dir,
        };
        while !served.healthz().await {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "serve never came up: {}",
                served.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        served
    }

    /// The process id (`prlimit` execs the binary, so it is the same).
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    /// A `/proc/PID/status` field in KiB (`VmRSS`, `VmHWM`).
    pub fn status_kib(&self, field: &str) -> u64 {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in /proc status"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// Open file descriptors of the process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether `GET /healthz` answers 200 within 2 s.
    pub async fn healthz(&self) -> bool {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        client
            .get(format!("http://{}/healthz", self.health))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// `GET path` on the health port: (status, body).
    pub async fn health_get(&self, path: &str) -> (u16, String) {
        let r = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("http://{}{path}", self.health))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// Waits (up to 20 s) until `/metrics` counts a request refused for the
    /// body budget, i.e. the budget is full.
    pub async fn wait_for_body_refusals(&self) {
        let t = Instant::now();
        loop {
            let (_, text) = self.health_get("/metrics").await;
            let refused = super::metrics::sample(
                &text,
                "pinswap_requests_refused_total",
                &[("reason", "body_memory")],
            );
            if refused.is_some_and(|n| n > 0.0) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the body budget never filled"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A reqwest client trusting the server's CA (HTTP/1.1).
    pub fn client(&self) -> reqwest::Client {
        self.client_with_timeout(Duration::from_secs(10))
    }

    /// As [`Served::client`], each request bounded by `timeout`.
    pub fn client_with_timeout(&self, timeout: Duration) -> reqwest::Client {
        reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only([reqwest::Certificate::from_pem(self.ca_pem.as_bytes()).unwrap()])
            .timeout(timeout)
            .build()
            .unwrap()
    }

    /// POSTs `review` to `/mutate` with `client`: the status.
    pub async fn post(&self, client: &reqwest::Client, review: &str) -> reqwest::Result<u16> {
        self.send(client, review).await.map(|r| r.status().as_u16())
    }

    /// POSTs `review` to `/mutate` with `client`: the response.
    pub async fn send(
        &self,
        client: &reqwest::Client,
        review: &str,
    ) -> reqwest::Result<reqwest::Response> {
        client
            .post(format!("https://{}/mutate", self.webhook))
            .header("content-type", "application/json")
            .body(review.to_owned())
            .send()
            .await
    }

    /// A TLS connection to the webhook offering `alpn` (`h2`, `http/1.1`).
    pub async fn tls(&self, alpn: &[u8]) -> TlsStream<TcpStream> {
        let tcp = TcpStream::connect(self.webhook).await.unwrap();
        self.connector(alpn)
            .connect("127.0.0.1".try_into().unwrap(), tcp)
            .await
            .unwrap()
    }

    /// A TLS connector trusting the server's CA, offering `alpn`.
    pub fn connector(&self, alpn: &[u8]) -> TlsConnector {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.ca_pem.as_bytes()).unwrap())
            .unwrap();
        let mut config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        TlsConnector::from(Arc::new(config))
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        // The shell's builtin kill: no procps needed on a fresh machine.
        let status = std::process::Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.pid())])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// The webhook and health addresses of `serve`'s "serving" log line
/// (`… serving webhook=127.0.0.1:P health=127.0.0.1:Q …`).
fn serving_addresses(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    if !line.contains("serving") {
        return None;
    }
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
    };
    Some((field("webhook=")?, field("health=")?))
}

/// Reads from `stream` until EOF, an error or `within`; returns what was
/// read and whether the server closed it.
pub async fn read_until_closed<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    within: Duration,
) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return (got, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The request head of a `POST /mutate` declaring `content_length`.
pub fn post_head(content_length: u64) -> String {
    format!(
        "POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
    )
}

/// Writes `n` bytes of spaces to `w` in 64 KiB writes, stopping at the
/// first error; returns how many were written.
pub async fn write_spaces<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, n: u64) -> u64 {
    let chunk = vec![b' '; 64 * 1024];
    let mut sent = 0u64;
    while sent < n {
        let len = (n - sent).min(chunk.len() as u64) as usize;
        if w.write_all(&chunk[..len]).await.is_err() {
            break;
        }
        sent += len as u64;
    }
    let _ = w.flush().await;
    sent
}

/// The HTTP status of the first response in `bytes`, if any.
pub fn status_of(bytes: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(bytes.get(..12)?).ok()?;
    text.strip_prefix("HTTP/1.1 ")?.parse().ok()
}
