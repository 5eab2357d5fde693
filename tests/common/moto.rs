//! moto (PyPI `moto[server]`) as the ECR, STS and IAM API on 127.0.0.1: a
//! `moto_server` process per test, in its own temp dir.
//!
//! Outside CI a machine without `moto_server` skips these tests with a
//! message ([`MotoServer::start`] returns `None`); with `CI=true` a missing
//! moto fails them.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::registry::free_port;

/// The account moto answers for with its default credentials.
pub const ACCOUNT: &str = "123456789012";
/// The region the tests use.
pub const REGION: &str = "eu-west-1";

/// A running `moto_server`; killed when dropped.
pub struct MotoServer {
    _dir: TempDir,
    port: u16,
    child: Child,
}

impl MotoServer {
    /// A moto server that allows everything.
    pub async fn start() -> Option<MotoServer> {
        Self::start_with(None).await
    }

    /// A moto server that enforces IAM after the first `free` requests
    /// (`INITIAL_NO_AUTH_ACTION_COUNT`), which set up users and policies.
    pub async fn enforcing(free: u32) -> Option<MotoServer> {
        Self::start_with(Some(free)).await
    }

    async fn start_with(free: Option<u32>) -> Option<MotoServer> {
        super::init();
        let bin = std::env::var("PINSWAP_TEST_MOTO_BIN").unwrap_or_else(|_| "moto_server".into());
        let found = Command::new(&bin)
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{bin} not found; install it with pip install 'moto[server]==5.2.1' (.ci/run does)"
            );
            eprintln!("SKIPPED: {bin} not found (pip install 'moto[server]==5.2.1')");
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("pinswap-moto-")
            .tempdir()
            .unwrap();
        for _ in 0..5 {
            let port = free_port();
            let log = std::fs::File::create(dir.path().join("moto.log")).unwrap();
            let mut cmd = Command::new(&bin);
            cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .current_dir(dir.path())
                .env("AWS_EC2_METADATA_DISABLED", "true")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            if let Some(n) = free {
                cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", n.to_string());
            }
            let mut child = cmd.spawn().unwrap();
            let start = Instant::now();
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                // A TCP accept is enough: any HTTP request would count as
                // one of the free actions.
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                {
                    return Some(MotoServer {
                        _dir: dir,
                        port,
                        child,
                    });
                }
                if start.elapsed() > Duration::from_secs(20) {
                    let _ = child.kill();
                    panic!(
                        "moto_server not listening after 20 s: {}",
                        std::fs::read_to_string(dir.path().join("moto.log")).unwrap_or_default()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        panic!(
            "moto_server did not start: {}",
            std::fs::read_to_string(dir.path().join("moto.log")).unwrap_or_default()
        );
    }

    /// `http://127.0.0.1:PORT`
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An SDK config for moto: these static credentials, [`REGION`], every
    /// endpoint at moto. Nothing else is looked up (no instance metadata).
    pub async fn sdk(&self, key: &str, secret: &str) -> aws_config::SdkConfig {
        pinswap::registry::ecr::sdk_loader(REGION)
            .credentials_provider(aws_credential_types::Credentials::new(
                key, secret, None, None, "test",
            ))
            .endpoint_url(self.endpoint())
            .load()
            .await
    }

    /// The environment for a `pinswap` process that should reach only moto
    /// through the SDK's default chain (environment credentials).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
            ("AWS_ACCESS_KEY_ID", "testing".into()),
            ("AWS_SECRET_ACCESS_KEY", "testing".into()),
            ("AWS_REGION", REGION.into()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_CONFIG_FILE", "/nonexistent/pinswap-test".into()),
            (
                "AWS_SHARED_CREDENTIALS_FILE",
                "/nonexistent/pinswap-test".into(),
            ),
        ]
    }

    /// One IAM query-API call, unsigned (moto's free actions): the
    /// response body.
    pub async fn iam(&self, params: &[(&str, &str)]) -> String {
        let mut form: Vec<(&str, &str)> = vec![("Version", "2010-05-08")];
        form.extend_from_slice(params);
        let res = reqwest::Client::new()
            .post(self.endpoint())
            // moto routes by the credential scope's service.
            .header(
                "Authorization",
                "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20260101/us-east-1/iam/aws4_request, SignedHeaders=host, Signature=00",
            )
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(
                url::form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(form)
                    .finish(),
            )
            .send()
            .await
            .unwrap();
        let status = res.status();
        let body = res.text().await.unwrap();
        assert!(status.is_success(), "IAM {params:?}: {status} {body}");
        body
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The text between `<tag>` and `</tag>` in an XML answer.
pub fn xml_field(body: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    let start = body
        .find(&open)
        .unwrap_or_else(|| panic!("no {tag} in {body}"))
        + open.len();
    let end = body[start..].find(&format!("</{tag}>")).unwrap() + start;
    body[start..end].to_owned()
}
