//! A real registry process per test: Debian's Distribution 2.8
//! (`docker-registry serve`) unless another [`Engine`] is asked for.
//!
//! Each [`TestRegistry`] owns a temp dir holding its config, storage, log and
//! (for TLS) certificates, and one registry child process on 127.0.0.1 and a
//! free port. Drop kills the process and removes the dir.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::{Method, RequestBuilder, StatusCode};
use tempfile::TempDir;

use super::token::{self, TokenServer};

/// Every manifest media type the registry can store, for `Accept`.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
     application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json";

const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Which registry implementation a [`TestRegistry`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// Debian's `docker-registry` (Distribution 2.8): no referrers API.
    Distribution2,
    /// Distribution v3.1.2 (`scripts/build-tools.sh`), with the same config
    /// and storage layout as 2.8; it answers the referrers API with 404 as
    /// 2.8 does (tests/airgap.rs sees an import write a fallback tag there).
    Distribution3,
    /// go-containerregistry's registry package (`referrers-registry`,
    /// `scripts/build-tools.sh`): in memory, plain HTTP, no auth, and the
    /// referrers API. A restart starts it empty.
    Ggcr,
}

/// A registry process with its own storage.
pub struct TestRegistry {
    engine: Engine,
    dir: TempDir,
    port: u16,
    tls: bool,
    creds: Option<(String, String)>,
    token: Option<TokenServer>,
    /// `storage.delete.enabled`.
    deletes: bool,
    child: Option<Child>,
    http: reqwest::Client,
}

impl TestRegistry {
    /// Plain HTTP, no auth.
    pub async fn plain() -> TestRegistry {
        Self::start(false, None, None, true).await
    }

    /// Plain HTTP, no auth, DELETE on, running `engine`.
    pub async fn of(engine: Engine) -> TestRegistry {
        Self::start_engine(engine, false, None, None, true).await
    }

    /// Plain HTTP, no auth, with `storage.delete.enabled: false`: every
    /// DELETE answers 405 `UNSUPPORTED`.
    pub async fn plain_without_deletes() -> TestRegistry {
        Self::start(false, None, None, false).await
    }

    /// TLS with a fresh test CA ([`TestRegistry::ca_pem_path`]), no auth.
    pub async fn tls() -> TestRegistry {
        Self::start(true, None, None, true).await
    }

    /// TLS with a fresh test CA, and htpasswd (bcrypt) basic auth.
    pub async fn tls_auth(user: &str, password: &str) -> TestRegistry {
        Self::start(
            true,
            Some((user.to_owned(), password.to_owned())),
            None,
            true,
        )
        .await
    }

    /// Plain HTTP with htpasswd (bcrypt) basic auth: the credentials cross
    /// the wire readable, so a [`super::front::Front`] can see whose they are.
    pub async fn plain_auth(user: &str, password: &str) -> TestRegistry {
        Self::start(
            false,
            Some((user.to_owned(), password.to_owned())),
            None,
            true,
        )
        .await
    }

    /// Plain HTTP with `auth: token:`: bearer tokens from an in-process
    /// [`TokenServer`] that issues them to `user` with `password`.
    pub async fn token_auth(user: &str, password: &str) -> TestRegistry {
        super::init();
        let server = TokenServer::start(user, password).await;
        let creds = Some((user.to_owned(), password.to_owned()));
        Self::start(false, creds, Some(server), true).await
    }

    async fn start(
        tls: bool,
        creds: Option<(String, String)>,
        token: Option<TokenServer>,
        deletes: bool,
    ) -> TestRegistry {
        Self::start_engine(Engine::Distribution2, tls, creds, token, deletes).await
    }

    async fn start_engine(
        engine: Engine,
        tls: bool,
        creds: Option<(String, String)>,
        token: Option<TokenServer>,
        deletes: bool,
    ) -> TestRegistry {
        super::init();
        assert!(
            engine != Engine::Ggcr || (!tls && creds.is_none() && deletes),
            "go-containerregistry's registry runs plain, without auth, with DELETE"
        );
        let dir = tempfile::Builder::new()
            .prefix("pinswap-registry-")
            .tempdir()
            .expect("create registry temp dir");
        fs::create_dir_all(dir.path().join("storage")).unwrap();
        if tls {
            write_tls_material(dir.path());
        }
        if let Some(server) = &token {
            fs::write(dir.path().join("token-root.pem"), server.cert_pem()).unwrap();
        } else if let Some((user, password)) = &creds {
            let hash = bcrypt::hash(password, 4).expect("bcrypt");
            fs::write(dir.path().join("htpasswd"), format!("{user}:{hash}\n")).unwrap();
        }
        let http = http_client(tls.then(|| dir.path().join("ca/ca.crt")).as_deref());
        let mut reg = TestRegistry {
            engine,
            dir,
            port: 0,
            tls,
            creds,
            token,
            deletes,
            child: None,
            http,
        };
        // A port picked from :0 can be taken again before the registry binds it.
        for attempt in 1..=5 {
            reg.port = free_port();
            reg.write_config();
            match reg.spawn_and_wait().await {
                Ok(()) => return reg,
                Err(e) if attempt < 5 && e.contains("address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!()
    }

    /// The registry implementation running.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// `127.0.0.1:PORT`
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT` or `https://127.0.0.1:PORT`
    pub fn base_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.host())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The registry's `rootdirectory`.
    pub fn storage_dir(&self) -> PathBuf {
        assert!(
            self.engine != Engine::Ggcr,
            "go-containerregistry's registry keeps its storage in memory"
        );
        self.dir.path().join("storage")
    }

    /// PEM of the test CA that signed the server certificate (TLS only).
    pub fn ca_pem_path(&self) -> PathBuf {
        assert!(self.tls, "ca_pem_path() on a plain registry");
        self.cert_dir().join("ca.crt")
    }

    /// A directory holding only `ca.crt`, as skopeo's `--cert-dir` wants it.
    pub fn cert_dir(&self) -> PathBuf {
        self.dir.path().join("ca")
    }

    pub fn username(&self) -> Option<&str> {
        self.creds.as_ref().map(|c| c.0.as_str())
    }

    pub fn password(&self) -> Option<&str> {
        self.creds.as_ref().map(|c| c.1.as_str())
    }

    /// The token server of a [`Self::token_auth`] registry.
    pub fn token_server(&self) -> &TokenServer {
        self.token
            .as_ref()
            .expect("token_server() on a registry without token auth")
    }

    /// The registry's stdout and stderr so far (print it when a test fails).
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// SIGKILL the process; storage stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP the process: connections are still accepted (by the
    /// kernel) and never answered, as with a hung registry.
    pub fn freeze(&self) {
        self.signal("-STOP");
        // Delivered when each thread is next scheduled: wait until every
        // thread is stopped (state T), so no request is answered after this.
        let pid = self.child.as_ref().expect("running").id();
        let stopped = || {
            fs::read_dir(format!("/proc/{pid}/task"))
                .map(|tasks| {
                    tasks.flatten().all(|t| {
                        fs::read_to_string(t.path().join("stat"))
                            .ok()
                            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
                            .unwrap_or(true)
                    })
                })
                .unwrap_or(true)
        };
        for _ in 0..500 {
            if stopped() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("registry {pid} did not stop");
    }

    /// SIGCONT after [`TestRegistry::freeze`].
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    /// Turns `storage.delete.enabled` on or off: starts again on the same
    /// port with the same storage.
    pub async fn set_deletes(&mut self, on: bool) {
        assert!(
            self.engine != Engine::Ggcr,
            "go-containerregistry's registry always takes DELETE"
        );
        self.deletes = on;
        self.write_config();
        self.restart().await;
    }

    /// Start again on the same port with the same storage. As at the first
    /// start, "address already in use" is retried: another test's
    /// [`free_port`] probe may hold the port for a moment.
    pub async fn restart(&mut self) {
        self.kill();
        for attempt in 1..=10 {
            match self.spawn_and_wait().await {
                Ok(()) => return,
                Err(e) if attempt < 10 && e.contains("address already in use") => {
                    tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                }
                Err(e) => panic!("restart: {e}"),
            }
        }
    }

    fn write_config(&self) {
        let d = self.dir.path();
        let mut cfg = format!(
            "version: 0.1\n\
             log:\n  level: error\n  accesslog:\n    disabled: false\n\
             storage:\n  filesystem:\n    rootdirectory: {storage}\n  \
             delete:\n    enabled: {deletes}\n  \
             maintenance:\n    uploadpurging:\n      enabled: false\n\
             http:\n  addr: 127.0.0.1:{port}\n  secret: pinswap-test-secret\n",
            storage = d.join("storage").display(),
            port = self.port,
            deletes = self.deletes,
        );
        if self.tls {
            cfg += &format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                d.join("server/cert.pem").display(),
                d.join("server/key.pem").display()
            );
        }
        if let Some(server) = &self.token {
            cfg += &format!(
                "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    \
                 rootcertbundle: {}\n",
                server.realm(),
                token::SERVICE,
                token::ISSUER,
                d.join("token-root.pem").display()
            );
        } else if self.creds.is_some() {
            cfg += &format!(
                "auth:\n  htpasswd:\n    realm: pinswap-test\n    path: {}\n",
                d.join("htpasswd").display()
            );
        }
        fs::write(d.join("config.yml"), cfg).unwrap();
    }

    /// Spawn the process and wait until `GET /v2/` gets any HTTP answer.
    async fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log_path = self.dir.path().join("registry.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let mut command = match self.engine {
            Engine::Distribution2 => {
                let bin = std::env::var("PINSWAP_TEST_REGISTRY_BIN")
                    .unwrap_or_else(|_| "docker-registry".to_owned());
                let mut c = Command::new(bin);
                c.arg("serve").arg(self.dir.path().join("config.yml"));
                c
            }
            Engine::Distribution3 => {
                let mut c = Command::new(super::tools::tool("distribution3"));
                c.arg("serve").arg(self.dir.path().join("config.yml"));
                // v3 reads OTEL_* and would export traces to localhost:4318.
                c.env("OTEL_TRACES_EXPORTER", "none");
                c
            }
            Engine::Ggcr => {
                let mut c = Command::new(super::tools::tool("referrers-registry"));
                c.args(["-addr", &self.host()]);
                c
            }
        };
        let bin = command.get_program().to_string_lossy().into_owned();
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("spawn {bin} (apt-get install docker-registry, scripts/build-tools.sh): {e}")
            });
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!(
                    "{bin} on port {} exited with {status}; log:\n{}",
                    self.port,
                    self.log()
                ));
            }
            let probe = self
                .http
                .get(format!("{}/v2/", self.base_url()))
                .timeout(Duration::from_millis(500))
                .send()
                .await;
            if probe.is_ok() {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                self.kill();
                return Err(format!(
                    "{bin} on port {} not answering GET /v2/ after {READY_TIMEOUT:?} \
                     (last error: {}); log:\n{}",
                    self.port,
                    probe.unwrap_err(),
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // ---- HTTP ----------------------------------------------------------

    /// The client used by the helpers: trusts the test CA, no proxy.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// A request to `base_url() + path`, with basic auth when configured, or
    /// a bearer token for exactly what the request needs (minted, not
    /// requested: [`TokenServer::requests`] counts only the code under test).
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.request_url(method, &format!("{}{path}", self.base_url()))
    }

    /// A request to an absolute `url`, authenticated as [`Self::request`] says.
    pub fn request_url(&self, method: Method, url: &str) -> RequestBuilder {
        if let Some(server) = &self.token {
            let bearer = server.mint_for_request(&method, url);
            return self.http.request(method, url).bearer_auth(bearer);
        }
        let rb = self.http.request(method, url);
        match &self.creds {
            Some((u, p)) => rb.basic_auth(u, Some(p)),
            None => rb,
        }
    }

    async fn send(&self, rb: RequestBuilder, what: &str) -> reqwest::Response {
        // Distribution's filesystem driver writes a manifest's link files in
        // place, so a read racing a writer of the same manifest (a copy or a
        // re-mirror still running) can get 500: asked again, it answers.
        for _ in 0..4 {
            let retry = rb.try_clone().expect("no streamed bodies here");
            let resp = self.send_once(retry, what).await;
            if resp.status() != StatusCode::INTERNAL_SERVER_ERROR {
                return resp;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        self.send_once(rb, what).await
    }

    async fn send_once(&self, rb: RequestBuilder, what: &str) -> reqwest::Response {
        rb.send()
            .await
            .unwrap_or_else(|e| panic!("{what} on {}: {e}", self.host()))
    }

    /// GET a manifest: `(bytes, Content-Type, Docker-Content-Digest)`, or None on 404.
    pub async fn get_manifest(
        &self,
        repo: &str,
        reference: &str,
    ) -> Option<(Vec<u8>, String, String)> {
        let what = format!("GET manifest {repo}:{reference}");
        let rb = self
            .request(Method::GET, &format!("/v2/{repo}/manifests/{reference}"))
            .header("Accept", MANIFEST_ACCEPT);
        let resp = self.send(rb, &what).await;
        if resp.status() == StatusCode::NOT_FOUND {
            return None;
        }
        let resp = expect_status(resp, StatusCode::OK, &what).await;
        let content_type = header(&resp, "content-type");
        let digest = header(&resp, "docker-content-digest");
        Some((resp.bytes().await.unwrap().to_vec(), content_type, digest))
    }

    /// HEAD a manifest: its `Docker-Content-Digest`, or None on 404.
    pub async fn head_manifest(&self, repo: &str, reference: &str) -> Option<String> {
        let what = format!("HEAD manifest {repo}:{reference}");
        let rb = self
            .request(Method::HEAD, &format!("/v2/{repo}/manifests/{reference}"))
            .header("Accept", MANIFEST_ACCEPT);
        let resp = self.send(rb, &what).await;
        if resp.status() == StatusCode::NOT_FOUND {
            return None;
        }
        let resp = expect_status(resp, StatusCode::OK, &what).await;
        Some(header(&resp, "docker-content-digest"))
    }

    /// GET a blob's bytes as served (not verified), or None on 404.
    pub async fn blob(&self, repo: &str, digest: &str) -> Option<Vec<u8>> {
        let what = format!("GET blob {repo}@{digest}");
        let resp = self
            .send(
                self.request(Method::GET, &format!("/v2/{repo}/blobs/{digest}")),
                &what,
            )
            .await;
        if resp.status() == StatusCode::NOT_FOUND {
            return None;
        }
        let resp = expect_status(resp, StatusCode::OK, &what).await;
        Some(resp.bytes().await.unwrap().to_vec())
    }

    pub async fn blob_exists(&self, repo: &str, digest: &str) -> bool {
        let what = format!("HEAD blob {repo}@{digest}");
        let resp = self
            .send(
                self.request(Method::HEAD, &format!("/v2/{repo}/blobs/{digest}")),
                &what,
            )
            .await;
        match resp.status() {
            StatusCode::OK => true,
            StatusCode::NOT_FOUND => false,
            s => panic!("{what}: unexpected {s}"),
        }
    }

    /// DELETE a manifest by digest through the API (asserts 202). Tags that
    /// pointed at it disappear with it.
    pub async fn delete_manifest(&self, repo: &str, digest: &str) {
        let what = format!("DELETE manifest {repo}@{digest}");
        let resp = self
            .send(
                self.request(Method::DELETE, &format!("/v2/{repo}/manifests/{digest}")),
                &what,
            )
            .await;
        expect_status(resp, StatusCode::ACCEPTED, &what).await;
    }

    /// DELETE a blob's link from `repo` (the registry then answers 404 for
    /// it there), as a lifecycle rule or a broken GC would.
    pub async fn delete_blob(&self, repo: &str, digest: &str) {
        let what = format!("DELETE blob {repo}@{digest}");
        let resp = self
            .send(
                self.request(Method::DELETE, &format!("/v2/{repo}/blobs/{digest}")),
                &what,
            )
            .await;
        expect_status(resp, StatusCode::ACCEPTED, &what).await;
    }

    /// Tags of `repo`, sorted; empty when the repository is unknown.
    pub async fn tags(&self, repo: &str) -> Vec<String> {
        let what = format!("GET tags of {repo}");
        let resp = self
            .send(
                self.request(Method::GET, &format!("/v2/{repo}/tags/list")),
                &what,
            )
            .await;
        if resp.status() == StatusCode::NOT_FOUND {
            return Vec::new();
        }
        let body = expect_status(resp, StatusCode::OK, &what).await;
        let v: serde_json::Value = body.json().await.unwrap();
        let mut tags = string_list(&v["tags"]);
        tags.sort();
        tags
    }

    /// Repositories in the registry, sorted.
    pub async fn catalog(&self) -> Vec<String> {
        let what = "GET /v2/_catalog";
        let resp = self
            .send(self.request(Method::GET, "/v2/_catalog?n=1000"), what)
            .await;
        let body = expect_status(resp, StatusCode::OK, what).await;
        let v: serde_json::Value = body.json().await.unwrap();
        let mut repos = string_list(&v["repositories"]);
        repos.sort();
        repos
    }

    // ---- faults --------------------------------------------------------

    /// Where the filesystem driver keeps the bytes of `digest`.
    pub fn blob_data_path(&self, digest: &str) -> PathBuf {
        let hex = digest
            .strip_prefix("sha256:")
            .unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
        self.storage_dir()
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Overwrite the stored bytes of `digest`, so the registry serves
    /// `new_bytes` under that digest (in every repository linking it).
    pub fn corrupt_blob(&self, digest: &str, new_bytes: &[u8]) {
        let path = self.blob_data_path(digest);
        assert!(path.exists(), "corrupt_blob: {} not in storage", digest);
        fs::write(&path, new_bytes).unwrap();
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A reqwest client that ignores proxy env vars and, given a CA, trusts only it.
pub fn http_client(ca_pem: Option<&Path>) -> reqwest::Client {
    super::init();
    let mut b = reqwest::Client::builder().no_proxy();
    if let Some(path) = ca_pem {
        let pem = fs::read(path).unwrap();
        b = b.tls_certs_only([reqwest::Certificate::from_pem(&pem).unwrap()]);
    }
    b.build().expect("build reqwest client")
}

pub(crate) async fn expect_status(
    resp: reqwest::Response,
    want: StatusCode,
    what: &str,
) -> reqwest::Response {
    if resp.status() == want {
        return resp;
    }
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    panic!("{what}: expected {want}, got {status}: {body}");
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| panic!("response to {} has no {name} header", resp.url()))
        .to_str()
        .unwrap()
        .to_owned()
}

fn string_list(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A CA, and a server certificate for 127.0.0.1 and localhost signed by it:
/// `ca/ca.crt` (alone in its dir, for skopeo), `server/{cert,key}.pem`.
fn write_tls_material(dir: &Path) {
    let pki = super::tls::pki("pinswap test registry", &["127.0.0.1", "localhost"]);
    fs::create_dir_all(dir.join("ca")).unwrap();
    fs::create_dir_all(dir.join("server")).unwrap();
    fs::write(dir.join("ca/ca.crt"), pki.ca_pem).unwrap();
    fs::write(dir.join("server/cert.pem"), pki.cert_pem).unwrap();
    fs::write(dir.join("server/key.pem"), pki.key_pem).unwrap();
}
