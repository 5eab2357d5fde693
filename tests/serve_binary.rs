//! `pinswap serve` as a process: an admission end to end over TLS, and a
//! bad config refused at startup with each cause said once.

mod common;

use std::time::{Duration, Instant};

use common::admission::*;
use serde_json::Value;

/// `pinswap serve` as a process: HTTPS on a free port, a Pod review over
/// TLS, the copy verified by digest at the target, metrics, SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_binary_end_to_end() {
    common::init();
    let r = rig().await;
    let dir = tempfile::tempdir().unwrap();
    let pki = common::tls::pki("e2e", &["127.0.0.1"]);
    std::fs::write(dir.path().join("tls.crt"), &pki.cert_pem).unwrap();
    std::fs::write(dir.path().join("tls.key"), &pki.key_pem).unwrap();
    let (port, health) = (common::registry::free_port(), common::registry::free_port());
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\ncopyPolicy: immediate\nserver:\n  listen: \"127.0.0.1:{port}\"\n  healthListen: \"127.0.0.1:{health}\"\n  tlsCert: {}\n  tlsKey: {}\n",
            r.dst.host(),
            r.src.host(),
            dir.path().join("tls.crt").display(),
            dir.path().join("tls.key").display()
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(common::pinswap_bin())
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let plain = reqwest::Client::new();
    let ready = format!("http://127.0.0.1:{health}/readyz");
    let t = Instant::now();
    while !plain
        .get(&ready)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(t.elapsed() < Duration::from_secs(10), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let tls = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap()])
        .build()
        .unwrap();
    let resp = tls
        .post(format!("https://127.0.0.1:{port}/mutate"))
        .header("content-type", "application/json")
        .body(r.body("pod-all-slots.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let review: Value = resp.json().await.unwrap();
    assert_eq!(review["response"]["allowed"], true);
    assert!(review["response"]["patch"].is_string(), "{review}");
    let repo = format!("mirror/127.0.0.1_{}/shop/app", r.src.port());
    let (bytes, _, digest) = r
        .dst
        .get_manifest(&repo, &r.app.digest)
        .await
        .expect("copied");
    assert_eq!(digest, r.app.digest);
    assert!(bytes == r.app.manifest);
    let metrics = plain
        .get(format!("http://127.0.0.1:{health}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        common::metrics::sample(
            &metrics,
            "pinswap_admissions_total",
            &[("outcome", "rewritten")]
        ) == Some(1.0),
        "{metrics}"
    );
    // Oversized and malformed bodies.
    let big = tls
        .post(format!("https://127.0.0.1:{port}/mutate"))
        .body(vec![b' '; 5 * 1024 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 413);
    // SIGTERM: a clean exit.
    let pid = child.id().unwrap().to_string();
    // The shell's builtin kill: no procps needed on a fresh machine.
    std::process::Command::new("sh")
        .args(["-c", &format!("kill -TERM {pid}")])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    let mut log = String::new();
    use tokio::io::AsyncReadExt;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .await
        .unwrap();
    assert!(
        log.contains("admitted"),
        "decisions are logged at info: {log}"
    );
}

#[test]
fn serve_refuses_a_bad_config_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.yaml");
    std::fs::write(
        &cfg,
        "target: {registry: m.example.com}\ncopyPolicy: sometimes\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::pinswap_bin())
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("copyPolicy: unknown variant `sometimes`"),
        "{err}"
    );
}

/// Each `: `-separated part of `text` that occurs more than once.
fn repeated_parts(text: &str) -> Vec<&str> {
    let parts: Vec<&str> = text.split(": ").map(str::trim).collect();
    let mut seen = Vec::new();
    let mut twice = Vec::new();
    for p in parts {
        if seen.contains(&p) && !twice.contains(&p) {
            twice.push(p);
        }
        seen.push(p);
    }
    twice
}

#[test]
fn serve_startup_errors_say_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        common::tls::pki("one", &["127.0.0.1"]),
        common::tls::pki("two", &["127.0.0.1"]),
    );
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let (cert, key, other_key) = (
        write("tls.crt", &a.cert_pem),
        write("tls.key", &a.key_pem),
        write("other.key", &b.key_pem),
    );
    let cfg = write("pinswap.yaml", "target: {registry: m.example.com}\n");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let health = format!("127.0.0.1:{}", common::registry::free_port());
    let free = format!("127.0.0.1:{}", common::registry::free_port());
    for (listen, key, cause) in [
        (&free, &other_key, "KeyMismatch"),
        (&taken, &key, "Address already in use"),
    ] {
        let out = std::process::Command::new(common::pinswap_bin())
            .args(["serve", "--config", &cfg, "--tls-cert", &cert, "--tls-key"])
            .args([key, "--listen", listen, "--health-listen", &health])
            .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or("");
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(line.matches(cause).count(), 1, "{err}");
        assert!(repeated_parts(line).is_empty(), "{line}");
    }
}
