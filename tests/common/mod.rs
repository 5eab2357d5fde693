//! Shared integration-test harness (docs/architecture.md §7).
//!
//! Every test binary that says `mod common;` gets:
//! - [`init`]: the rustls ring provider and a tracing subscriber;
//! - [`registry::TestRegistry`]: a real `docker-registry` (Distribution 2.8)
//!   process, plain HTTP, htpasswd auth behind TLS, or bearer tokens from
//!   [`token::TokenServer`], with HTTP helpers to read
//!   back what the code under test wrote, and fault helpers;
//! - [`proxy::TcpCutProxy`]: a TCP forwarder that can cut connections;
//! - [`forward::ForwardProxy`]: a forward HTTP proxy (`CONNECT` and
//!   absolute URIs) that records every request line;
//! - [`front::Front`]: an HTTP front that passes requests to a registry or
//!   answers them all with 429/503 or an auth challenge, or rewrites upload
//!   `Location`s, or behaves as a vendor's registry does, counting what
//!   reached it;
//! - [`matrix`]: the registry matrix, real registries and vendors' fronts
//!   started alike;
//! - [`metrics`]: sample values out of the metrics text;
//! - [`moto::MotoServer`]: moto as the ECR, STS and IAM API on loopback;
//! - [`fixtures`]: images, indexes and artifacts built in-process, with their
//!   exact bytes and digests, and [`push`] to put them in a registry;
//! - [`recovery`]: the recovery rig (registries, the API double,
//!   replicas with their background work, images to prune);
//! - [`identity`]: Spin apps sharing one config, and the identity configs;
//! - [`skopeo`]: skopeo as an independent peer;
//! - [`kube::KubeApi`]: an in-process Kubernetes API server (Pods and workloads list/watch,
//!   Events, Leases, Secrets, ServiceAccounts) and a `kube::Client` for it;
//! - [`serve::Served`]: `pinswap serve` as a process, measured from outside,
//!   with raw TLS clients that misbehave;
//! - [`tenants`]: namespaces with pull secrets and ServiceAccounts, written
//!   through the API double or a real API server's admin client;
//! - [`tools`]: cosign, oras and a referrers-API registry from
//!   `scripts/build-tools.sh`;
//! - [`admission`]: AdmissionReview fixtures and an admission rig;
//! - [`api_objects`], [`judge`]: Pods, metadata and watch helpers of the
//!   API double's self-test, and both API servers set up alike;
//! - [`manifests`]: `pinswap manifests` decoded into objects;
//! - [`mutating`]: running `pinswap mutate`, its manifests and configs;
//! - [`node`]: the cluster suite's node (containerd, runc, kube-scheduler
//!   and a kubelet), pinswap's own image, and installs that run it as Pods;
//! - [`cli`]: the binary run with no ambient credentials, and `copy --json`;
//! - [`copying`]: byte-exact checks of a copy at the target;
//! - [`pinswap_bin`]: the path of the binary under test.
//!
//! Helpers panic with context instead of returning errors: they are test code.
//! Each test binary uses a subset, hence the `allow` below.
#![allow(dead_code, unused_imports)]

pub mod admission;
pub mod api_objects;
pub mod cli;
pub mod cluster;
pub mod copying;
pub mod fixtures;
pub mod forward;
pub mod front;
pub mod identity;
pub mod judge;
pub mod kube;
pub mod manifests;
pub mod matrix;
pub mod metrics;
pub mod moto;
pub mod mutating;
pub mod node;
pub mod proxy;
pub mod push;
pub mod records;
pub mod recovery;
pub mod registry;
pub mod review;
pub mod serve;
pub mod skopeo;
pub mod tenants;
pub mod tls;
pub mod token;
pub mod tools;

pub use fixtures::{Blob, Image, Index, StreamedImage};
pub use proxy::TcpCutProxy;
pub use push::{
    push_blob, push_image, push_index, push_manifest, push_random_blob, push_streamed_image,
};
pub use registry::TestRegistry;
pub use token::TokenServer;

use std::path::PathBuf;
use std::sync::Once;

/// Installs the rustls ring provider (reqwest panics without one) and a
/// tracing subscriber honouring `RUST_LOG`. Safe to call any number of times.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means another provider is already installed: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
    });
}

/// Path of the `pinswap` binary built by cargo for this test run, or
/// `PINSWAP_BIN` (a benchmark's release build).
pub fn pinswap_bin() -> PathBuf {
    std::env::var_os("PINSWAP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_pinswap")))
}

/// A fresh, empty cache directory for one `pinswap` run, given as
/// `XDG_CACHE_HOME`: remembered blob locations from other tests (whose
/// registries may have had the same port) never change what a test sees.
pub fn cache_home() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pinswap-cache-")
        .tempdir()
        .unwrap()
}

/// Runs the `pinswap` binary with `args` to completion (async, so servers
/// in the test process keep answering): (exit code, stdout, stderr).
pub async fn run_pinswap(args: &[&str]) -> (i32, String, String) {
    let cache = cache_home();
    let out = tokio::process::Command::new(pinswap_bin())
        .args(args)
        .env("XDG_CACHE_HOME", cache.path())
        .output()
        .await
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (
        out.status.code().unwrap(),
        text(out.stdout),
        text(out.stderr),
    )
}

/// Runs the `pinswap` binary with `args` and `input` on its standard
/// input, with no Docker config to read: (exit code, stdout, stderr).
pub async fn run_pinswap_with_input(args: &[&str], input: &str) -> (i32, String, String) {
    use tokio::io::AsyncWriteExt;
    let cache = cache_home();
    let mut child = tokio::process::Command::new(pinswap_bin())
        .args(args)
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .env("XDG_CACHE_HOME", cache.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `Authorization` value of HTTP Basic credentials.
pub fn basic_auth(user: &str, password: &str) -> String {
    use base64::Engine as _;
    let pair = format!("{user}:{password}");
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// `assert_eq!` for byte strings that prints something readable: the text
/// when both sides are UTF-8 (manifests), else sizes and digests (blobs).
#[track_caller]
pub fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    let show = |b: &[u8]| match std::str::from_utf8(b) {
        Ok(s) if s.len() <= 4000 => format!("{s:?}"),
        _ => format!("{} bytes, {}", b.len(), sha256_digest(b)),
    };
    panic!(
        "{what}: bytes differ\n  got: {}\n want: {}",
        show(got),
        show(want)
    );
}

/// Polls `cond` every 10 ms until it holds; panics naming `what` after
/// `timeout`.
#[allow(dead_code)]
pub async fn wait_until(what: &str, timeout: std::time::Duration, mut cond: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            std::time::Instant::now() < end,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// As [`wait_until`] for an async `check`, polled every 50 ms.
pub async fn eventually<F, Fut>(what: &str, timeout: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = std::time::Instant::now() + timeout;
    while !check().await {
        assert!(
            std::time::Instant::now() < end,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Recovery timings that play leadership and backoff out in seconds.
pub const FAST_RECOVERY: &str = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
";
