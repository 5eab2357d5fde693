//! Admission against real registries: AdmissionReview fixtures from
//! `tests/data/admission/` go through `Admission::review`, the returned
//! JSONPatch is applied to the Pod with json-patch, and the Pod and the
//! target registry are checked field by field.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::{TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::Value;

fn fixture(name: &str, vars: &[(&str, &str)]) -> bytes::Bytes {
    let path = format!("{}/tests/data/admission/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut text = std::fs::read_to_string(&path).unwrap();
    for (k, v) in vars {
        text = text.replace(&format!("{{{{{k}}}}}"), v);
    }
    bytes::Bytes::from(text)
}

fn config(src: &str, target: &str, extra: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{target}/mirror\"}}\nsource:\n  registries: [{{registry: \"{src}\"}}]\n  filters: [{{jmespath: \"container.env[?name=='PINSWAP_SKIP'] | [0].value == 'true'\"}}]\n{extra}"
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

struct Answer {
    response: Value,
    pod: Value,
    original: Value,
}

impl Answer {
    fn allowed(&self) -> bool {
        self.response["allowed"] == true
    }
    fn image(&self, kind: &str, i: usize) -> &str {
        self.pod["spec"][kind][i]["image"].as_str().unwrap()
    }
    fn annotation(&self, key: &str) -> BTreeMap<String, String> {
        self.pod["metadata"]["annotations"][key]
            .as_str()
            .map(|s| serde_json::from_str(s).unwrap())
            .unwrap_or_default()
    }
}

/// Reviews `body` and applies the patch to the request's Pod.
async fn review(adm: &Admission, body: bytes::Bytes) -> Answer {
    let request: Value = serde_json::from_slice(&body).unwrap();
    let out = adm.review(body).await.expect("a review");
    let review: Value = serde_json::from_slice(&out).unwrap();
    let response = review["response"].clone();
    assert_eq!(response["uid"], request["request"]["uid"]);
    assert_eq!(
        review["apiVersion"], request["apiVersion"],
        "answers in the request's version"
    );
    let original = request["request"]["object"].clone();
    let mut pod = original.clone();
    if let Some(patch) = common::review::apply_patch(&response, &mut pod) {
        for op in &patch.0 {
            if let json_patch::PatchOperation::Replace(r) = op {
                assert!(
                    r.path.to_string().ends_with("/image"),
                    "only image replaces: {op:?}"
                );
            }
        }
    }
    Answer {
        response,
        pod,
        original,
    }
}

struct Rig {
    src: TestRegistry,
    dst: TestRegistry,
    app: Image,
    debug: Image,
}

async fn rig() -> Rig {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(2, 301);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let debug = Image::oci(1, 302);
    push_image(&src, "shop/debug", Some("v1"), &debug).await;
    push_image(&src, "shop/sidecar", Some("v1"), &Image::oci(1, 303)).await;
    Rig {
        src,
        dst,
        app,
        debug,
    }
}

impl Rig {
    fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("SRC", self.src.host()),
            ("TARGET", self.dst.host()),
            ("SRC_COMPONENT", format!("127.0.0.1_{}", self.src.port())),
            ("APP_DIGEST", self.app.digest.clone()),
        ]
    }
    fn body(&self, name: &str) -> bytes::Bytes {
        let v = self.vars();
        let vars: Vec<(&str, &str)> = v.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fixture(name, &vars)
    }
    fn admission(&self, extra: &str) -> (Admission, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let c = config(&self.src.host(), &self.dst.host(), extra);
        (
            Admission::from_config(&c, metrics.clone()).unwrap(),
            metrics,
        )
    }
    fn mirrored(&self, repo: &str) -> String {
        format!(
            "{}/mirror/127.0.0.1_{}/{repo}",
            self.dst.host(),
            self.src.port()
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_slot_kind_and_reference_form() {
    common::init();
    let r = rig().await;
    let (adm, metrics) = r.admission("copyPolicy: immediate\n");
    let a = review(&adm, r.body("pod-all-slots.json")).await;
    assert!(a.allowed(), "{}", a.response);
    let app = r.mirrored("shop/app");
    let pinned = format!("{app}:v1@{}", r.app.digest);
    // Tag: pinned to the digest, tag kept.
    assert_eq!(a.image("initContainers", 0), pinned);
    assert_eq!(a.image("containers", 0), pinned);
    // Digest-only stays digest-only.
    assert_eq!(a.image("containers", 1), format!("{app}@{}", r.app.digest));
    // Tag + digest.
    assert_eq!(a.image("containers", 2), pinned);
    // Already under the target, outside the allowlist, filtered: untouched.
    for i in 3..6 {
        assert_eq!(
            a.image("containers", i),
            a.original["spec"]["containers"][i]["image"]
        );
    }
    let debug = r.mirrored("shop/debug");
    assert!(
        a.image("ephemeralContainers", 0)
            .starts_with(&format!("{debug}:v1@sha256:"))
    );

    let original = a.annotation("pinswap.dev/original-images");
    assert_eq!(
        original["containers/web"],
        format!("{}/shop/app:v1", r.src.host())
    );
    assert_eq!(original.len(), 5, "{original:?}");
    let decisions = a.annotation("pinswap.dev/decisions");
    assert_eq!(decisions.len(), 8, "every slot explained: {decisions:?}");
    assert!(decisions["containers/mirrored"].contains("already under the target"));
    assert!(decisions["containers/elsewhere"].contains("not in source.registries"));
    assert!(decisions["containers/skipped"].contains("filter"));
    assert!(decisions["containers/web"].starts_with("rewritten"));

    // The target serves the copies by digest, byte for byte.
    let repo = format!("mirror/127.0.0.1_{}/shop/app", r.src.port());
    let (bytes, _, digest) = r.dst.get_manifest(&repo, &r.app.digest).await.unwrap();
    assert_eq!(digest, r.app.digest);
    assert!(bytes == r.app.manifest);
    assert_eq!(
        r.dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(r.app.digest.as_str())
    );
    // The digest-only slot got an anchor tag, not sha256-<hex>.
    let tags = r.dst.tags(&repo).await;
    assert!(
        tags.contains(&format!(
            "pinswap-{}",
            r.app.digest.trim_start_matches("sha256:")
        )),
        "{tags:?}"
    );
    assert!(!tags.iter().any(|t| t.starts_with("sha256-")));
    // One image in five slots is streamed once: app (tagged), app's anchor
    // tag (a manifest push, blobs already there) and debug; bytes counted
    // once each.
    let text = metrics.encode();
    assert!(
        common::metrics::sample(&text, "pinswap_copies_started_total", &[]) == Some(3.0),
        "{text}"
    );
    let bytes: u64 = r.app.blobs().chain(r.debug.blobs()).map(|b| b.size()).sum();
    assert!(
        common::metrics::sample(&text, "pinswap_copy_bytes_total", &[]) == Some(bytes as f64),
        "{text}"
    );
    use common::metrics::sample;
    assert_eq!(
        sample(&text, "pinswap_rewrites_total", &[("reason", "copied")]),
        Some(5.0),
        "{text}"
    );
    assert_eq!(
        common::metrics::total(&text, "pinswap_rewrites_total"),
        5.0,
        "{text}"
    );
    assert!(
        common::metrics::sample(
            &text,
            "pinswap_admissions_total",
            &[("outcome", "rewritten")]
        ) == Some(1.0)
    );

    // Reinvocation: nothing left to do, and the originals stay.
    let again_body = {
        let mut v: Value = serde_json::from_slice(&r.body("pod-all-slots.json")).unwrap();
        v["request"]["object"] = a.pod.clone();
        bytes::Bytes::from(serde_json::to_vec(&v).unwrap())
    };
    let b = review(&adm, again_body).await;
    assert_eq!(b.pod["spec"], a.pod["spec"], "idempotent");
    assert_eq!(b.annotation("pinswap.dev/original-images"), original);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_and_copy_policy_matrix() {
    common::init();
    let r = rig().await;
    let app = r.mirrored("shop/app");
    let pinned = format!("{app}:v1@{}", r.app.digest);
    let repo = format!("mirror/127.0.0.1_{}/shop/app", r.src.port());
    for (swap, copy, rewritten, copied_now) in [
        ("exists", "none", false, false),
        ("always", "none", true, false),
        ("exists", "delayed", false, false),
        ("always", "delayed", true, false),
        ("exists", "immediate", true, true),
        ("always", "immediate", true, true),
        ("exists", "force", true, true),
        ("always", "force", true, true),
    ] {
        // A fresh target per combination.
        let dst = TestRegistry::plain().await;
        let metrics = Arc::new(Metrics::new());
        let c = config(
            &r.src.host(),
            &dst.host(),
            &format!("swapPolicy: {swap}\ncopyPolicy: {copy}\n"),
        );
        let adm = Admission::from_config(&c, metrics.clone()).unwrap();
        let a = review(&adm, r.body("pod-v1beta1.json")).await;
        let got = a.image("containers", 0);
        let want_image = pinned.replace(&r.dst.host(), &dst.host());
        assert_eq!(got == want_image, rewritten, "{swap}/{copy}: got {got}");
        if !rewritten {
            // Not rewritten means the Pod's own image, byte for byte.
            let sent: Value = serde_json::from_slice(&r.body("pod-v1beta1.json")).unwrap();
            let original = sent["request"]["object"]["spec"]["containers"][0]["image"]
                .as_str()
                .unwrap();
            assert_eq!(got, original, "{swap}/{copy}: left as sent");
        }
        let present = dst.head_manifest(&repo, &r.app.digest).await.is_some();
        if copied_now {
            assert!(present, "{swap}/{copy}: copied before the answer");
        }
        if copy == "delayed" {
            // The background copy lands shortly after: done when the tag
            // names it (a registry shows the manifest by digest a moment
            // before the tag pushed with it).
            let t = Instant::now();
            while dst.head_manifest(&repo, "v1").await.as_deref() != Some(r.app.digest.as_str()) {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "{swap}/{copy}: no background copy"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Now it exists, so even swapPolicy exists rewrites.
            let b = review(&adm, r.body("pod-v1beta1.json")).await;
            assert_eq!(
                b.image("containers", 0),
                want_image,
                "{swap}/{copy}: after the copy"
            );
        }
        if copy == "none" {
            assert!(!present, "{swap}/{copy}: nothing copied");
        }
        // The v1beta1 Pod kept its own annotation next to ours.
        assert_eq!(a.pod["metadata"]["annotations"]["team"], "core");
    }
}

/// The response's `patch` is a base64 string (the API's form for `[]byte`)
/// that decodes to the JSONPatch: a replace of the image with the pinned
/// mirror, and the annotations; `patchType` says JSONPatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_patch_is_base64_of_the_json_patch() {
    use base64::Engine as _;
    common::init();
    let r = rig().await;
    let (adm, _) = r.admission("swapPolicy: always\ncopyPolicy: none\n");
    let out = adm.review(r.body("pod-v1beta1.json")).await.unwrap();
    let review: Value = serde_json::from_slice(&out).unwrap();
    let response = &review["response"];
    assert_eq!(response["patchType"], "JSONPatch");
    let text = response["patch"].as_str().expect("patch is a string");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .expect("standard base64");
    let ops: Vec<Value> = serde_json::from_slice(&bytes).expect("a JSON array");
    let want = format!("{}:v1@{}", r.mirrored("shop/app"), r.app.digest);
    assert!(
        ops.iter().any(|op| op["op"] == "replace"
            && op["path"] == "/spec/containers/0/image"
            && op["value"] == want.as_str()),
        "{ops:?}"
    );
    assert!(
        ops.iter().any(|op| op["path"]
            .as_str()
            .unwrap()
            .starts_with("/metadata/annotations")),
        "{ops:?}"
    );
    // The same patch through the shared decoder, applied to the Pod.
    let request: Value = serde_json::from_slice(&r.body("pod-v1beta1.json")).unwrap();
    let mut pod = request["request"]["object"].clone();
    common::review::apply_patch(response, &mut pod).unwrap();
    assert_eq!(pod["spec"]["containers"][0]["image"], want.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_down_admits_unchanged_within_the_budget() {
    common::init();
    let mut r = rig().await;
    r.src.kill();
    for copy in ["none", "delayed", "immediate", "force"] {
        let (adm, _) = r.admission(&format!(
            "copyPolicy: {copy}\nserver: {{admissionBudget: 1s}}\n"
        ));
        let start = Instant::now();
        let a = review(&adm, r.body("pod-v1beta1.json")).await;
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{copy}: took {:?}",
            start.elapsed()
        );
        assert!(a.allowed(), "fail open");
        assert_eq!(
            a.image("containers", 0),
            a.original["spec"]["containers"][0]["image"]
        );
        let d = a.annotation("pinswap.dev/decisions");
        assert!(
            d["containers/app"].starts_with("unchanged (error)"),
            "{d:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policy_closed_denies_naming_the_image() {
    common::init();
    let r = rig().await;
    let (adm, metrics) = r.admission("failurePolicy: closed\n");
    let body = String::from_utf8(r.body("pod-v1beta1.json").to_vec())
        .unwrap()
        .replace("shop/app:v1", "shop/missing:v9");
    let a = review(&adm, body.into()).await;
    assert_eq!(a.response["allowed"], false);
    let msg = a.response["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{}/shop/missing:v9", r.src.host())),
        "{msg}"
    );
    assert!(
        msg.contains("MANIFEST_UNKNOWN") || msg.contains("NAME_UNKNOWN"),
        "{msg}"
    );
    assert!(metrics.encode().contains("outcome=\"denied\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_kinds_and_malformed_bodies() {
    common::init();
    let r = rig().await;
    let (adm, _) = r.admission("");
    let a = review(&adm, r.body("configmap-create.json")).await;
    assert!(a.allowed());
    assert!(
        a.response.get("patch").is_none(),
        "a ConfigMap is not patched"
    );
    for bad in [
        &b"not json"[..],
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
    ] {
        let e = adm
            .review(bytes::Bytes::from_static(bad))
            .await
            .unwrap_err();
        assert!(
            e.to_string().starts_with("malformed AdmissionReview: "),
            "{e}"
        );
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_requests_rewrite_without_copying() {
    common::init();
    let r = rig().await;
    let dry = |v: &mut Value| v["request"]["dryRun"] = Value::Bool(true);
    let pinned = format!("{}:v1@{}", r.mirrored("shop/app"), r.app.digest);
    // swapPolicy exists: not at the target, and a dry run copies nothing.
    let (adm, metrics) = r.admission("copyPolicy: force\n");
    let mut v: Value = serde_json::from_slice(&r.body("pod-v1beta1.json")).unwrap();
    dry(&mut v);
    let a = review(&adm, bytes::Bytes::from(serde_json::to_vec(&v).unwrap())).await;
    assert_eq!(
        a.image("containers", 0),
        a.original["spec"]["containers"][0]["image"]
    );
    let d = a.annotation("pinswap.dev/decisions");
    assert!(
        d["containers/app"].contains("dry run: not at the target, not copied"),
        "{d:?}"
    );
    // swapPolicy always: rewritten, still nothing copied.
    let (adm, _) = r.admission("copyPolicy: force\nswapPolicy: always\n");
    let a = review(&adm, bytes::Bytes::from(serde_json::to_vec(&v).unwrap())).await;
    assert_eq!(a.image("containers", 0), pinned);
    assert!(
        r.dst.catalog().await.is_empty(),
        "no side effect on dry run"
    );
    assert!(
        common::metrics::sample(&metrics.encode(), "pinswap_copies_started_total", &[])
            == Some(0.0)
    );
}

/// `source.imagePullSecrets`: a private (bearer-token) source is read with
/// the Pod's pull secret, or its ServiceAccount's, fetched through the
/// Kubernetes API; a Pod with neither is left unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_secrets_from_the_pod_and_its_service_account() {
    use k8s_openapi::api::core::v1::{LocalObjectReference, ServiceAccount};
    common::init();
    let src = TestRegistry::token_auth("puller", "Pull-Secret-77").await;
    let dst = TestRegistry::plain().await;
    let app = Image::oci(1, 501);
    push_image(&src, "private/app", Some("v1"), &app).await;
    let kube = common::kube::KubeApi::start().await;
    kube.put_secret(
        "shop",
        common::kube::dockerconfigjson_secret("regcred", &src.host(), "puller", "Pull-Secret-77"),
    );
    kube.put_secret(
        "shop",
        common::kube::dockerconfigjson_secret("sa-cred", &src.host(), "puller", "Pull-Secret-77"),
    );
    kube.put_service_account(
        "shop",
        ServiceAccount {
            metadata: kube::api::ObjectMeta {
                name: Some("builder".into()),
                ..Default::default()
            },
            image_pull_secrets: Some(vec![LocalObjectReference {
                name: "sa-cred".into(),
            }]),
            ..Default::default()
        },
    );
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}], imagePullSecrets: true}}\ncopyPolicy: immediate\n",
            dst.host(),
            src.host()
        ),
        "test.yaml",
    )
    .unwrap();
    // Only what the install's RBAC grants for imagePullSecrets: get.
    kube.authorize_install(&c, pinswap::install::manifests::Tls::CertManager);
    let adm = Admission::from_config(&c, Arc::new(Metrics::new()))
        .unwrap()
        .with_pull_secrets(kube.client());
    let pod_review = |spec: Value| {
        let v = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "shop",
                "operation": "CREATE",
                "userInfo": {"username": "alice"},
                "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "shop"}, "spec": spec},
                "dryRun": false
            }
        });
        bytes::Bytes::from(serde_json::to_vec(&v).unwrap())
    };
    let image = format!("{}/private/app:v1", src.host());
    let mirrored = format!(
        "{}/mirror/127.0.0.1_{}/private/app:v1@{}",
        dst.host(),
        src.port(),
        app.digest
    );

    // No secret anywhere: the source refuses, the Pod is left unchanged.
    let a = review(
        &adm,
        pod_review(serde_json::json!({"containers": [{"name": "c", "image": image}]})),
    )
    .await;
    assert_eq!(a.image("containers", 0), image);
    let d = a.annotation("pinswap.dev/decisions");
    assert!(
        d["containers/c"].contains("requires authentication"),
        "{d:?}"
    );

    // The Pod's own pull secret.
    let a = review(
        &adm,
        pod_review(serde_json::json!({
            "imagePullSecrets": [{"name": "regcred"}, {"name": "missing"}],
            "containers": [{"name": "c", "image": image}]
        })),
    )
    .await;
    assert_eq!(a.image("containers", 0), mirrored);
    let repo = format!("mirror/127.0.0.1_{}/private/app", src.port());
    let (bytes, _, _) = dst.get_manifest(&repo, &app.digest).await.expect("copied");
    assert!(bytes == app.manifest);
    let text = a.pod.to_string();
    assert!(
        !text.contains("Pull-Secret-77"),
        "secret leaked into the Pod"
    );

    // The ServiceAccount's pull secret, for an image no cache has seen.
    let other_img = Image::oci(1, 502);
    push_image(&src, "private/other", Some("v1"), &other_img).await;
    let other = format!("{}/private/other:v1", src.host());
    let a = review(
        &adm,
        pod_review(serde_json::json!({
            "serviceAccountName": "builder",
            "containers": [{"name": "c", "image": other}]
        })),
    )
    .await;
    let want = format!(
        "{}/mirror/127.0.0.1_{}/private/other:v1@{}",
        dst.host(),
        src.port(),
        other_img.digest
    );
    assert_eq!(a.image("containers", 0), want);
    assert!(
        src.token_server().log().iter().any(|t| t.granted
            && t.user.as_deref() == Some("puller")
            && t.scopes
                .iter()
                .any(|s| s == "repository:private/other:pull")),
        "read with the ServiceAccount's secret: {:?}",
        src.token_server().log()
    );

    // An empty request.namespace (k8s-image-swapper's sample review): the
    // Pod's own metadata.namespace is where its secrets are read.
    let third = Image::oci(1, 503);
    push_image(&src, "private/third", Some("v1"), &third).await;
    let image3 = format!("{}/private/third:v1", src.host());
    let mut v: Value = serde_json::from_slice(&pod_review(serde_json::json!({
        "imagePullSecrets": [{"name": "regcred"}],
        "containers": [{"name": "c", "image": image3}]
    })))
    .unwrap();
    v["request"]["namespace"] = Value::String(String::new());
    let a = review(&adm, bytes::Bytes::from(serde_json::to_vec(&v).unwrap())).await;
    assert_eq!(
        a.image("containers", 0),
        format!(
            "{}/mirror/127.0.0.1_{}/private/third:v1@{}",
            dst.host(),
            src.port(),
            third.digest
        ),
        "{:?}",
        a.annotation("pinswap.dev/decisions")
    );
    assert!(
        kube.requests()
            .iter()
            .any(|r| r.path.contains("/namespaces/shop/secrets/regcred")),
        "{:?}",
        kube.requests()
    );
    // The API calls were reads of secrets and service accounts only.
    for r in kube.requests() {
        assert_eq!(r.method, "GET", "{r:?}");
        assert!(
            r.path.contains("/secrets/") || r.path.contains("/serviceaccounts/"),
            "{r:?}"
        );
    }
}

/// UPDATE touches only images the update changes (a changed image restarts
/// a running container); the `ephemeralcontainers` subresource touches only
/// ephemeral containers and no metadata; other subresources nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_subresources_touch_only_what_changed() {
    common::init();
    let r = rig().await;
    let (adm, _) = r.admission("copyPolicy: immediate\n");
    let app = format!("{}/shop/app:v1", r.src.host());
    let debug = format!("{}/shop/debug:v1", r.src.host());
    let pod = |labels: &str, image: &str, ephemeral: Option<&str>| {
        let mut spec = serde_json::json!({"containers": [{"name": "c", "image": image}]});
        if let Some(e) = ephemeral {
            spec["ephemeralContainers"] = serde_json::json!([{"name": "dbg", "image": e}]);
        }
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "shop", "labels": {"v": labels}}, "spec": spec})
    };
    let update = |old: Value, new: Value, sub: Option<&str>| {
        let mut v = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "shop", "operation": "UPDATE", "userInfo": {"username": "a"},
                "object": new, "oldObject": old, "dryRun": false}
        });
        if let Some(s) = sub {
            v["request"]["subResource"] = Value::String(s.to_owned());
        }
        bytes::Bytes::from(serde_json::to_vec(&v).unwrap())
    };
    // A label change on a Pod whose image was left alone at CREATE.
    let a = review(
        &adm,
        update(pod("1", &app, None), pod("2", &app, None), None),
    )
    .await;
    assert!(
        a.response.get("patch").is_none(),
        "no patch: {}",
        a.response
    );
    // The update changes the image: that one is rewritten.
    let a = review(
        &adm,
        update(pod("1", &debug, None), pod("1", &app, None), None),
    )
    .await;
    assert!(a.image("containers", 0).contains("/mirror/"), "{}", a.pod);
    // kubectl debug: only the new ephemeral container, and no annotations.
    let a = review(
        &adm,
        update(
            pod("1", &app, None),
            pod("1", &app, Some(&debug)),
            Some("ephemeralcontainers"),
        ),
    )
    .await;
    assert_eq!(a.image("containers", 0), app);
    assert!(a.image("ephemeralContainers", 0).contains("/mirror/"));
    assert!(a.pod["metadata"].get("annotations").is_none(), "{}", a.pod);
    // Any other subresource: nothing.
    let a = review(
        &adm,
        update(pod("1", &debug, None), pod("1", &app, None), Some("status")),
    )
    .await;
    assert!(a.response.get("patch").is_none());
}

/// Two tags of one digest: the second tag is pushed to the target too, so an
/// unpinned rewrite never points at a tag the target lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tag_a_pod_uses_exists_at_the_target() {
    common::init();
    let mut r = rig().await;
    push_image(&r.src, "shop/app", Some("stable"), &r.app).await;
    let (adm, _) = r.admission("copyPolicy: immediate\npin: false\n");
    assert_eq!(adm.ready().await, Ok(()));
    let body = |tag: &str| {
        let text = String::from_utf8(r.body("pod-v1beta1.json").to_vec()).unwrap();
        bytes::Bytes::from(text.replace("shop/app:v1", &format!("shop/app:{tag}")))
    };
    let repo = format!("mirror/127.0.0.1_{}/shop/app", r.src.port());
    for tag in ["v1", "stable"] {
        let a = review(&adm, body(tag)).await;
        assert_eq!(
            a.image("containers", 0),
            format!("{}:{tag}", r.mirrored("shop/app"))
        );
        assert_eq!(
            r.dst.head_manifest(&repo, tag).await.as_deref(),
            Some(r.app.digest.as_str()),
            "tag {tag} at the target"
        );
    }
    // Readiness follows the target.
    r.dst.kill();
    assert!(
        adm.ready().await.is_err(),
        "not ready while the target is down"
    );
}

/// `copyPolicy: immediate` with a copy that outlasts the admission budget:
/// every image is left unchanged with "copy still running", never an error,
/// so even `failurePolicy: closed` admits the Pod. The copy wait and the
/// budget end at the same instant; the copy wait must be the one that
/// answers. Once the copy finishes, the next admission rewrites.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_outlasting_the_budget_leaves_images_unchanged_even_when_closed() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let proxy = common::TcpCutProxy::start(&src.host()).await;
    let mut containers = Vec::new();
    for i in 0..4u64 {
        let image = Image::random_layers(1, 1 << 20, 900 + i);
        push_image(&src, &format!("slow/app{i}"), Some("v1"), &image).await;
        containers.push((format!("c{i}"), format!("{}/slow/app{i}:v1", proxy.host())));
    }
    let named: Vec<(&str, &str)> = containers
        .iter()
        .map(|(n, i)| (n.as_str(), i.as_str()))
        .collect();
    let pod = common::review::pod("apps", "slow", &named);
    let metrics = Arc::new(Metrics::new());
    let c = config(
        &proxy.host(),
        &dst.host(),
        "copyPolicy: immediate\nfailurePolicy: closed\nserver: {admissionBudget: 700ms}\n",
    );
    let adm = Admission::from_config(&c, metrics).unwrap();

    // Manifests and configs pass; every layer transfer stalls.
    proxy.stall_after(256 * 1024);
    for round in 0..5 {
        let (patched, _) = common::review::admit(&adm, &pod).await;
        let decisions: BTreeMap<String, String> = serde_json::from_str(
            patched["metadata"]["annotations"]["pinswap.dev/decisions"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        for (name, image) in &containers {
            let d = &decisions[&format!("containers/{name}")];
            assert_eq!(
                d, "unchanged: copy still running; not at the target yet",
                "round {round}, {name}"
            );
            let i: usize = name[1..].parse().unwrap();
            assert_eq!(patched["spec"]["containers"][i]["image"], *image.as_str());
        }
    }

    proxy.release();
    let mut rewritten = 0;
    for _ in 0..50 {
        let (patched, _) = common::review::admit(&adm, &pod).await;
        rewritten = (0..4)
            .filter(|i| {
                patched["spec"]["containers"][*i]["image"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{}/mirror/", dst.host()))
            })
            .count();
        if rewritten == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rewritten, 4, "rewritten once the copies finished");
}

/// A rotated target password (a Secret updated in place, a credential
/// helper's new token) is picked up by `refresh_credentials` without a
/// restart: the connected client is dropped and signs in again with it.
/// The file is a Secret volume's: `password` -> `..data/password`, and an
/// update swaps the `..data` symlink, as the kubelet does. The second
/// rotation is picked up by the periodic loop `serve` runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_target_credentials_are_read_again() {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("mirror", "Token-1").await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 950)).await;
    push_image(&src, "shop/web", Some("v1"), &Image::oci(1, 951)).await;
    push_image(&src, "shop/api", Some("v1"), &Image::oci(1, 952)).await;
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("password");
    // The kubelet's atomic writer: a new timestamped directory, then a
    // rename of a fresh `..data` symlink over the old one.
    let publish = |version: &str, secret: &str| {
        let data = dir.path().join(format!("..{version}"));
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("password"), format!("{secret}\n")).unwrap();
        let tmp = dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
        std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
    };
    publish("v1", "Token-1");
    std::os::unix::fs::symlink("..data/password", &password).unwrap();
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\", auth: {{username: mirror, passwordFile: {}}}}}\n\
             source: {{registries: [{{registry: \"{}\"}}]}}\ncopyPolicy: immediate\n\
             copyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery: {{enabled: false}}\n",
            dst.host(),
            password.display(),
            src.host()
        ),
        "test.yaml",
    )
    .unwrap();
    let adm = Admission::from_config(&c, Arc::new(Metrics::new())).unwrap();
    let admit = |repo: &str| {
        let pod = common::review::pod(
            "shop",
            repo,
            &[("app", &format!("{}/shop/{repo}:v1", src.host()))],
        );
        let adm = &adm;
        async move {
            let (p, _) = common::review::admit(adm, &pod).await;
            let d: BTreeMap<String, String> = serde_json::from_str(
                p["metadata"]["annotations"]["pinswap.dev/decisions"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            d["containers/app"].clone()
        }
    };

    // Signed in and working; then the registry's password rotates.
    assert_eq!(admit("app").await, "rewritten: copied to the target");
    dst.token_server().set_password("Token-2");
    let stale = admit("web").await;
    assert!(
        stale.starts_with("unchanged (error)") && stale.contains("401"),
        "{stale}"
    );
    assert_eq!(
        adm.mirror().refresh_credentials().await,
        0,
        "the file has not changed"
    );

    publish("v2", "Token-2");
    assert_eq!(adm.mirror().refresh_credentials().await, 1);
    assert_eq!(
        adm.mirror().refresh_credentials().await,
        0,
        "one change, counted once"
    );
    assert_eq!(admit("web").await, "rewritten: copied to the target");

    // The periodic refresh (serve runs it every 5 minutes; here 100 ms).
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(
        adm.mirror()
            .clone()
            .refresh_credentials_every(Duration::from_millis(100), stop.clone()),
    );
    dst.token_server().set_password("Token-3");
    publish("v3", "Token-3");
    let mut last = String::new();
    for _ in 0..50 {
        last = admit("api").await;
        if last == "rewritten: copied to the target" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    assert_eq!(last, "rewritten: copied to the target");
}

/// The size the API server counts for `pod`'s annotations (keys plus
/// values), and the part that is pinswap's.
fn annotation_sizes(pod: &Value) -> (usize, usize) {
    let Some(a) = pod["metadata"]["annotations"].as_object() else {
        return (0, 0);
    };
    let size = |(k, v): (&String, &Value)| k.len() + v.as_str().unwrap().len();
    let ours = a.iter().filter(|(k, _)| k.starts_with("pinswap.dev/"));
    (a.iter().map(size).sum(), ours.map(size).sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_containers_are_admitted_within_the_budget_with_annotations_that_fit() {
    common::init();
    let r = rig().await;
    let (adm, _) = r.admission("swapPolicy: always\ncopyPolicy: none\n");
    let limit = pinswap::admission::notes::ANNOTATIONS_LIMIT;
    let own = pinswap::admission::notes::OWN_SHARE;

    // 5,000 containers, each its own image: 256 are decided, the rest are
    // left unchanged with one reason.
    let images: Vec<(String, String)> = (0..5000)
        .map(|i| (format!("c{i}"), format!("{}/shop/app{i}:v1", r.src.host())))
        .collect();
    let containers: Vec<(&str, &str)> = images
        .iter()
        .map(|(n, i)| (n.as_str(), i.as_str()))
        .collect();
    let pod = common::review::pod("default", "wide", &containers);
    let body = serde_json::to_vec(&common::review::create_review(&pod)).unwrap();
    let start = Instant::now();
    let a = review(&adm, body.into()).await;
    let took = start.elapsed();
    eprintln!("5,000 distinct images answered in {took:?}");
    assert!(a.allowed());
    assert!(took < Duration::from_secs(3), "2 s budget, took {took:?}");
    let (total, ours) = annotation_sizes(&a.pod);
    assert!(total <= limit && ours <= own, "{total} / {ours}");
    let d = a.annotation("pinswap.dev/decisions");
    let summary = &d["*"];
    assert!(summary.starts_with("5000 slots, summarised"), "{summary}");
    assert!(
        summary.contains("4744 × unchanged: not decided: more than server.maxImages (256) distinct images in one review"),
        "{summary}"
    );

    // 500 containers of one image with long names, beside 200 KiB of the
    // Pod's own annotations: every slot is rewritten, and the notes shrink
    // to what the API server still accepts.
    let image = format!("{}/shop/app:v1", r.src.host());
    let names: Vec<String> = (0..500)
        .map(|i| format!("{}-{i:03}", "n".repeat(58)))
        .collect();
    let containers: Vec<(&str, &str)> =
        names.iter().map(|n| (n.as_str(), image.as_str())).collect();
    let mut pod = common::review::pod("default", "long", &containers);
    pod["metadata"]["annotations"] = serde_json::json!({"example.com/big": "x".repeat(200 * 1024)});
    let body = serde_json::to_vec(&common::review::create_review(&pod)).unwrap();
    let a = review(&adm, body.into()).await;
    assert!(a.allowed());
    let app = format!("{}:v1@{}", r.mirrored("shop/app"), r.app.digest);
    for i in 0..500 {
        assert_eq!(a.image("containers", i), app);
    }
    let (total, ours) = annotation_sizes(&a.pod);
    eprintln!("annotations: {total} bytes, {ours} of them pinswap's");
    assert!(total <= limit, "{total}");
    assert!(
        a.pod["metadata"]["annotations"]["example.com/big"]
            .as_str()
            .unwrap()
            .len()
            == 200 * 1024
    );
    let sources = a.annotation("pinswap.dev/sources");
    assert!(
        !sources.is_empty() && sources.len() < 500,
        "{}",
        sources.len()
    );
    let d = a.annotation("pinswap.dev/decisions");
    assert!(
        d["*"].contains(&format!(
            "pinswap.dev/sources kept for {} of 500 slots",
            sources.len()
        )),
        "{d:?}"
    );
}

/// Credentials are kept to their side: the configured source credentials
/// and those of a Pod's pull secret (which also names the target, with
/// someone else's credentials) reach their sources only. Every registry is
/// htpasswd over plain HTTP behind a recording front, so each request's
/// `Authorization` says whose credentials it carries: at the target, only
/// the target's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_and_pull_secret_credentials_never_reach_the_target() {
    use common::front::Front;
    common::init();
    let (src, private, dst) = (
        TestRegistry::plain_auth("puller", "Source-Secret-1").await,
        TestRegistry::plain_auth("secret-user", "Pull-Secret-2").await,
        TestRegistry::plain_auth("mirror", "Target-Secret-3").await,
    );
    let (sf, pf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&private.host()).await,
        Front::start(&dst.host()).await,
    );
    let (app, own) = (Image::oci(2, 961), Image::oci(2, 962));
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&private, "private/app", Some("v1"), &own).await;
    let kube = common::kube::KubeApi::start().await;
    // The Pod's pull secret: the private source, and the target too.
    let auths = serde_json::json!({"auths": {
        pf.host(): {"username": "secret-user", "password": "Pull-Secret-2"},
        tf.host(): {"username": "intruder", "password": "Pull-Secret-4"},
    }});
    let mut secret =
        common::kube::dockerconfigjson_secret("regcred", &pf.host(), "secret-user", "x");
    secret.data = Some(
        [(
            ".dockerconfigjson".to_owned(),
            k8s_openapi::ByteString(auths.to_string().into_bytes()),
        )]
        .into(),
    );
    kube.put_secret("shop", secret);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\", auth: {{username: mirror, passwordFile: {}}}}}\n\
             source:\n  registries:\n  - {{registry: \"{}\", auth: {{username: puller, passwordFile: {}}}}}\n  \
             - {{registry: \"{}\"}}\n  imagePullSecrets: true\n\
             copyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery: {{enabled: false}}\n",
            tf.host(),
            file("target-password", "Target-Secret-3\n"),
            sf.host(),
            file("source-password", "Source-Secret-1\n"),
            pf.host(),
        ),
        "test.yaml",
    )
    .unwrap();
    kube.authorize_install(&c, pinswap::install::manifests::Tls::CertManager);
    let adm = Admission::from_config(&c, Arc::new(Metrics::new()))
        .unwrap()
        .with_pull_secrets(kube.client());
    let mut pod = common::review::pod(
        "shop",
        "web",
        &[
            ("app", &format!("{}/shop/app:v1", sf.host())),
            ("own", &format!("{}/private/app:v1", pf.host())),
        ],
    );
    pod["spec"]["imagePullSecrets"] = serde_json::json!([{"name": "regcred"}]);
    let (patched, _) = common::review::admit(&adm, &pod).await;
    for (i, (front, repo, img)) in [(&sf, "shop/app", &app), (&pf, "private/app", &own)]
        .into_iter()
        .enumerate()
    {
        let mirrored = format!("mirror/{}/{repo}", front.host().replace(':', "_"));
        assert_eq!(
            patched["spec"]["containers"][i]["image"],
            format!("{}/{mirrored}:v1@{}", tf.host(), img.digest),
            "{patched}"
        );
        let (bytes, _, _) = dst.get_manifest(&mirrored, "v1").await.expect("copied");
        assert!(bytes == img.manifest, "{repo}");
    }

    // Each source was read with its own credentials (else this test would
    // prove nothing about them)...
    assert_eq!(
        sf.credentials_sent(),
        [common::basic_auth("puller", "Source-Secret-1")]
    );
    assert_eq!(
        pf.credentials_sent(),
        [common::basic_auth("secret-user", "Pull-Secret-2")]
    );
    // ...and the target saw only its own, on every request that carried any,
    // the pushes among them.
    assert_eq!(
        tf.credentials_sent(),
        [common::basic_auth("mirror", "Target-Secret-3")]
    );
    let pushes = tf
        .authorizations()
        .into_iter()
        .filter(|(m, p, a)| m == "PUT" && p.contains("/manifests/") && a.is_some())
        .count();
    assert_eq!(pushes, 2, "{:?}", tf.authorizations());
}

/// A `copyDeadline` shorter than the budget bounds the wait for a copy
/// (here a layer stalled at the source): `immediate` leaves the image
/// unchanged while the copy runs on; `force` is an error naming that
/// deadline, not the budget, counted as `budget`, and `failurePolicy:
/// closed` denies the Pod with it. The copies finish in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_deadline_shorter_than_the_budget_bounds_the_wait() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let proxy = common::TcpCutProxy::start(&src.host()).await;
    let image = Image::random_layers(1, 1 << 20, 1011);
    push_image(&src, "slow/app", Some("v1"), &image).await;
    let source = format!("{}/slow/app:v1", proxy.host());
    let pod = common::review::pod("apps", "slow", &[("app", &source)]);
    let body =
        || bytes::Bytes::from(serde_json::to_vec(&common::review::create_review(&pod)).unwrap());
    let admission = |extra: &str| {
        let metrics = Arc::new(Metrics::new());
        let c = config(
            &proxy.host(),
            &dst.host(),
            &format!("copyDeadline: 1s\nserver: {{admissionBudget: 8s}}\n{extra}"),
        );
        (
            Admission::from_config(&c, metrics.clone()).unwrap(),
            metrics,
        )
    };
    // Manifests and configs pass; the layer stalls.
    proxy.stall_after(256 * 1024);

    let (adm, _) = admission("copyPolicy: immediate\n");
    let a = review(&adm, body()).await;
    assert!(a.allowed());
    assert_eq!(a.image("containers", 0), source);
    assert_eq!(
        a.annotation("pinswap.dev/decisions")["containers/app"],
        "unchanged: copy still running; not at the target yet"
    );

    let failed = format!("copy of {source} failed: not done within 1s (copyPolicy force)");
    let (adm, metrics) = admission("copyPolicy: force\n");
    let a = review(&adm, body()).await;
    assert!(a.allowed(), "fails open");
    assert_eq!(a.image("containers", 0), source);
    assert_eq!(
        a.annotation("pinswap.dev/decisions")["containers/app"],
        format!("unchanged (error): {failed}")
    );
    assert_eq!(
        common::metrics::sample(
            &metrics.encode(),
            "pinswap_admission_errors_total",
            &[("cause", "budget")]
        ),
        Some(1.0)
    );

    let (adm, _) = admission("copyPolicy: force\nfailurePolicy: closed\n");
    let a = review(&adm, body()).await;
    assert_eq!(a.response["allowed"], false, "{}", a.response);
    let msg = a.response["status"]["message"].as_str().unwrap();
    assert!(msg.contains(&failed), "{msg}");

    // Nothing is at the target while the layer is held; then every copy ends.
    let repo = format!("mirror/{}/slow/app", proxy.host().replace(':', "_"));
    assert_eq!(dst.head_manifest(&repo, "v1").await, None);
    proxy.release();
    let start = Instant::now();
    while dst.head_manifest(&repo, "v1").await.as_deref() != Some(image.digest.as_str()) {
        assert!(start.elapsed() < Duration::from_secs(20), "never copied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (bytes, _, _) = dst.get_manifest(&repo, "v1").await.unwrap();
    assert!(bytes == image.manifest);
}

/// A review of a Pod with one container per `imagePullPolicy`, all of the
/// same image.
fn pull_policy_review(image: &str) -> bytes::Bytes {
    let containers: Vec<Value> = ["Never", "IfNotPresent", "Always"]
        .iter()
        .map(
            |p| serde_json::json!({"name": p.to_lowercase(), "image": image, "imagePullPolicy": p}),
        )
        .collect();
    let body = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "8d1f0c2a-0000-4000-8000-000000000013",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "u"},
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "shop"},
                "spec": {"containers": containers}
            },
            "dryRun": false
        }
    });
    bytes::Bytes::from(body.to_string())
}

/// The kubelet never pulls an `imagePullPolicy: Never` image: it must be on
/// the node under the name written, so a rewrite would fail the Pod with
/// ErrImageNeverPull. Such containers stay unchanged unless the config opts
/// in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_pulled_containers_stay_unchanged_unless_opted_in() {
    common::init();
    let r = rig().await;
    let image = format!("{}/shop/app:v1", r.src.host());
    let pinned = format!("{}:v1@{}", r.mirrored("shop/app"), r.app.digest);
    let (adm, _) = r.admission("copyPolicy: immediate\n");
    let a = review(&adm, pull_policy_review(&image)).await;
    assert!(a.allowed());
    assert_eq!(a.image("containers", 0), image, "Never: unchanged");
    assert_eq!(a.image("containers", 1), pinned, "IfNotPresent: rewritten");
    assert_eq!(a.image("containers", 2), pinned, "Always: rewritten");
    let decisions = a.annotation("pinswap.dev/decisions");
    assert!(
        decisions["containers/never"].contains("imagePullPolicy is Never")
            && decisions["containers/never"].contains("rewriteImagePullPolicyNever"),
        "{decisions:?}"
    );
    assert!(
        !a.annotation("pinswap.dev/original-images")
            .contains_key("containers/never")
    );

    let (adm, _) = r.admission("copyPolicy: immediate\nrewriteImagePullPolicyNever: true\n");
    let a = review(&adm, pull_policy_review(&image)).await;
    for i in 0..3 {
        assert_eq!(a.image("containers", i), pinned, "opted in: container {i}");
    }
}
