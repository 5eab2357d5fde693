//! Image identity, against real registries: `pinswap check`, and
//! the `warn`, `deny` and `repair` policies through the admission handler.
//! Spin apps pushed before Spin 2.4 share one 78-byte config, so containerd
//! gives them one image ID; ORAS artifacts share `{}`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::{EMPTY_CONFIG_DIGEST, Image, OCI_INDEX, SPIN_CONFIG, SPIN_CONFIG_DIGEST};
use common::review::{admit, create_review, pod};
use common::{TestRegistry, push_image, push_manifest, sha256_digest, skopeo};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::{Value, json};

/// Three Spin apps sharing the pre-2.4 config, pushed as `spin/hello:v1`,
/// `spin/hello:v2` and `spin/other:w`.
struct Spin {
    src: TestRegistry,
    dst: TestRegistry,
    apps: Vec<(String, Image)>,
}

async fn spin() -> Spin {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let apps = vec![
        ("spin/hello:v1", Image::spin("hello", 1, None)),
        ("spin/hello:v2", Image::spin("hello-v2", 1, None)),
        ("spin/other:w", Image::spin("other", 2, None)),
    ];
    let mut out = Vec::new();
    for (name, img) in apps {
        let (repo, tag) = name.split_once(':').unwrap();
        push_image(&src, repo, Some(tag), &img).await;
        out.push((name.to_owned(), img));
    }
    Spin {
        src,
        dst,
        apps: out,
    }
}

fn config(src: &TestRegistry, dst: &TestRegistry, collisions: &str) -> Config {
    config_extra(src, dst, collisions, "")
}

/// As [`config`], with more top-level keys.
fn config_extra(src: &TestRegistry, dst: &TestRegistry, collisions: &str, extra: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nidentity: {{collisions: {collisions}}}\nrecovery: {{enabled: false}}\n{extra}",
        dst.host(),
        src.host()
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

fn admission(cfg: &Config) -> (Arc<Admission>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (
        Arc::new(Admission::from_config(cfg, metrics.clone()).unwrap()),
        metrics,
    )
}

/// A Pod with one container per Spin app.
fn spin_pod(s: &Spin, name: &str) -> Value {
    let containers: Vec<(String, String)> = s
        .apps
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (format!("c{i}"), format!("{}/{n}", s.src.host())))
        .collect();
    let refs: Vec<(&str, &str)> = containers
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    pod("wasm", name, &refs)
}

fn annotation(pod: &Value, key: &str) -> serde_json::Map<String, Value> {
    pod["metadata"]["annotations"][key]
        .as_str()
        .map(|s| serde_json::from_str(s).unwrap())
        .unwrap_or_default()
}

fn metric(m: &Metrics, series: &str) -> f64 {
    m.encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// An OCI index (bytes) over `children`, each with its platform.
fn index_of(children: &[(&Image, Value)]) -> Vec<u8> {
    let manifests: Vec<Value> = children
        .iter()
        .map(|(img, platform)| {
            json!({"mediaType": img.media_type, "digest": img.digest,
                   "size": img.manifest.len(), "platform": platform})
        })
        .collect();
    serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}))
        .unwrap()
}

/// Two Spin apps sharing the config, pushed by digest into `repo`.
async fn spin_pair(src: &TestRegistry, repo: &str, a: &str, b: &str) -> (Image, Image) {
    let (a, b) = (Image::spin(a, 1, None), Image::spin(b, 1, None));
    push_image(src, repo, None, &a).await;
    push_image(src, repo, None, &b).await;
    (a, b)
}

fn wasm(variant: &str) -> Value {
    json!({"architecture": "wasm", "os": "wasip1", "variant": variant})
}

#[test]
fn the_fixtures_share_the_configs_the_issue_names() {
    assert_eq!(SPIN_CONFIG.len(), 78);
    assert_eq!(sha256_digest(SPIN_CONFIG), SPIN_CONFIG_DIGEST);
    assert_eq!(
        SPIN_CONFIG_DIGEST,
        "sha256:aabedf0b094944b344cecbffcfa0a9172e905a5d156bdf67c4c6cbb6d27d1d92"
    );
    let (a, b) = (Image::spin("a", 1, None), Image::spin("b", 1, None));
    assert_eq!(a.config.digest, b.config.digest, "one image ID");
    assert_ne!(a.layers[0].digest, b.layers[0].digest, "different apps");
    let o = Image::oras("application/vnd.example+type", "f.txt", b"x");
    assert_eq!(o.config.digest, EMPTY_CONFIG_DIGEST);
}

#[tokio::test]
async fn check_flags_spin_apps_and_oras_artifacts_and_names_the_collisions() {
    common::init();
    let s = spin().await;
    let refs: Vec<String> = s
        .apps
        .iter()
        .map(|(n, _)| format!("{}/{n}", s.src.host()))
        .collect();
    let mut args = vec!["check", "--json"];
    args.extend(refs.iter().map(String::as_str));
    let (code, stdout, stderr) = common::run_pinswap(&args).await;
    assert_eq!(code, 3, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["flagged"], 3);
    for (i, img) in report["images"].as_array().unwrap().iter().enumerate() {
        assert_eq!(img["reference"], refs[i].as_str());
        assert_eq!(img["manifest"], s.apps[i].1.digest.as_str());
        assert_eq!(img["config"], SPIN_CONFIG_DIGEST);
        assert!(img["nonUnique"].as_str().unwrap().contains("Spin 2.4"));
        let others: BTreeSet<&str> = img["collidesWith"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let want: BTreeSet<&str> = refs
            .iter()
            .filter(|r| **r != refs[i])
            .map(String::as_str)
            .collect();
        assert_eq!(others, want, "every other app, on every side");
    }
    // Text form, and a whole repository (every tag).
    let repo = format!("{}/spin/hello", s.src.host());
    let (code, stdout, _) = common::run_pinswap(&["check", "--repository", &repo]).await;
    assert_eq!(code, 3);
    assert!(
        stdout.contains("COLLISION: same config, different layers as"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{repo}:v1")) && stdout.contains(&format!("{repo}:v2")),
        "{stdout}"
    );

    let oras = Image::oras("application/vnd.example.sbom", "sbom.json", b"{\"a\":1}");
    push_image(&s.src, "art/sbom", Some("1"), &oras).await;
    let (code, stdout, _) =
        common::run_pinswap(&["check", "--json", &format!("{}/art/sbom:1", s.src.host())]).await;
    assert_eq!(code, 3);
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        report["images"][0]["nonUnique"]
            .as_str()
            .unwrap()
            .contains("{}")
    );
}

#[tokio::test]
async fn check_has_no_false_positives() {
    common::init();
    let src = TestRegistry::plain().await;
    let app = Image::oci(2, 601);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&src, "shop/app", Some("latest"), &app).await;
    // Same rootfs, recompressed: other layer digests, one config.
    let again = app.recompressed();
    assert_eq!(again.config.digest, app.config.digest);
    assert_ne!(again.layers[0].digest, app.layers[0].digest);
    push_image(&src, "shop/app-fast", Some("v1"), &again).await;
    let h = src.host();
    let (code, stdout, stderr) = common::run_pinswap(&[
        "check",
        "--json",
        &format!("{h}/shop/app:v1"),
        &format!("{h}/shop/app:latest"),
        &format!("{h}/shop/app-fast:v1"),
    ])
    .await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["flagged"], 0);
    assert!(
        report["images"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["contentBearing"] == true)
    );
    let (code, _, stderr) = common::run_pinswap(&["check", &format!("{h}/shop/missing:v1")]).await;
    assert_eq!(code, 1, "an unreadable reference");
    assert!(stderr.contains("shop/missing"), "{stderr}");
    let (code, _, _) = common::run_pinswap(&["check"]).await;
    assert_eq!(code, 2);
}

#[tokio::test]
async fn warn_rewrites_as_usual_and_records_the_finding() {
    common::init();
    let s = spin().await;
    let (adm, metrics) = admission(&config(&s.src, &s.dst, "warn"));
    let (patched, _) = admit(&adm, &spin_pod(&s, "apps")).await;
    let identity = annotation(&patched, "pinswap.dev/identity");
    assert_eq!(identity.len(), 3, "{identity:?}");
    // The images of one review are decided concurrently, so the first one
    // recorded has no collision yet; together the notes name every app.
    let mut named = BTreeSet::new();
    for (i, (_, img)) in s.apps.iter().enumerate() {
        let image = patched["spec"]["containers"][i]["image"].as_str().unwrap();
        assert!(
            image.ends_with(&format!("@{}", img.digest)),
            "pinned to the source digest: {image}"
        );
        let note = identity[&format!("containers/c{i}")].as_str().unwrap();
        assert!(
            note.contains(SPIN_CONFIG_DIGEST) && note.contains("Spin 2.4"),
            "{note}"
        );
        for (name, _) in &s.apps {
            if note.contains("collides with") && note.contains(&format!("/{name}")) {
                named.insert(name.clone());
            }
        }
    }
    let collisions = identity
        .values()
        .filter(|v| v.as_str().unwrap().contains("collides with"))
        .count();
    assert_eq!(collisions, 2, "all but the first recorded: {identity:?}");
    assert!(named.len() >= 2, "{identity:?}");
    // A later Pod with one app names the other two.
    let (again, _) = admit(
        &adm,
        &pod(
            "wasm",
            "one",
            &[("app", &format!("{}/spin/hello:v1", s.src.host()))],
        ),
    )
    .await;
    let note = annotation(&again, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    for other in ["spin/hello:v2", "spin/other:w"] {
        assert!(note.contains(&format!("/{other}")), "{other}: {note}");
    }
    assert!(
        metric(
            &metrics,
            "pinswap_identity_findings_total{kind=\"collision\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &metrics,
            "pinswap_identity_findings_total{kind=\"non_unique\"}"
        ) >= 1.0
    );
}

#[tokio::test]
async fn deny_rejects_the_pod_naming_the_references_and_the_fix() {
    common::init();
    let s = spin().await;
    let (adm, _) = admission(&config(&s.src, &s.dst, "deny"));
    let review = create_review(&spin_pod(&s, "apps"));
    let out = adm
        .review(serde_json::to_vec(&review).unwrap().into())
        .await
        .unwrap();
    let response: Value = serde_json::from_slice::<Value>(&out).unwrap()["response"].clone();
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.contains("identity.collisions deny"), "{message}");
    assert!(message.contains(SPIN_CONFIG_DIGEST), "{message}");
    assert!(
        message.contains("/spin/hello:v1"),
        "names a colliding reference: {message}"
    );
    assert!(
        message.contains("Spin 2.4") && message.contains("identity.collisions: repair"),
        "the fix: {message}"
    );
    // An ordinary image passes.
    let app = Image::oci(1, 611);
    push_image(&s.src, "shop/app", Some("v1"), &app).await;
    let (patched, _) = admit(
        &adm,
        &pod(
            "shop",
            "ok",
            &[("app", &format!("{}/shop/app:v1", s.src.host()))],
        ),
    )
    .await;
    assert!(annotation(&patched, "pinswap.dev/identity").is_empty());
}

/// The config at the target for `repo:tag`, and its manifest.
async fn target_config(dst: &TestRegistry, repo: &str, tag: &str) -> (Value, Vec<u8>, Value) {
    let (bytes, _, _) = dst.get_manifest(repo, tag).await.unwrap();
    let m: Value = serde_json::from_slice(&bytes).unwrap();
    let d = m["config"]["digest"].as_str().unwrap();
    let config = dst.blob(repo, d).await.unwrap();
    (
        m.clone(),
        config.clone(),
        serde_json::from_slice(&config).unwrap(),
    )
}

#[tokio::test]
async fn repair_gives_each_app_its_own_image_id_and_a_second_run_changes_nothing() {
    common::init();
    let s = spin().await;
    let cfg = config(&s.src, &s.dst, "repair");
    let (adm, metrics) = admission(&cfg);
    let (patched, _) = admit(&adm, &spin_pod(&s, "apps")).await;
    let identity = annotation(&patched, "pinswap.dev/identity");
    let mut configs = BTreeSet::new();
    let mut pinned = Vec::new();
    for (i, (name, img)) in s.apps.iter().enumerate() {
        let image = patched["spec"]["containers"][i]["image"]
            .as_str()
            .unwrap()
            .to_owned();
        let (repo_tag, digest) = image.split_once('@').unwrap();
        assert_ne!(digest, img.digest, "pinned to the repaired digest");
        let repo_tag = repo_tag
            .strip_prefix(&format!("{}/", s.dst.host()))
            .unwrap();
        let (repo, tag) = repo_tag.rsplit_once(':').unwrap();
        assert_eq!(
            s.dst.head_manifest(repo, tag).await.as_deref(),
            Some(digest),
            "the tag names the repaired copy"
        );
        let (m, config_bytes, config) = target_config(&s.dst, repo, tag).await;
        let want_label = {
            let mut t = String::new();
            for l in &img.layers {
                t.push_str(&l.digest);
                t.push('\n');
            }
            sha256_digest(t.as_bytes())
        };
        assert_eq!(
            config["config"]["Labels"]["dev.pinswap.content-digest"],
            want_label.as_str()
        );
        assert_eq!(
            config["architecture"], "wasm",
            "the rest of the config is kept"
        );
        assert_eq!(
            m["annotations"]["dev.pinswap.repaired-from"],
            img.digest.as_str()
        );
        assert_eq!(m["config"]["digest"], sha256_digest(&config_bytes).as_str());
        configs.insert(m["config"]["digest"].as_str().unwrap().to_owned());
        // Layers byte-identical to the source.
        for l in &img.layers {
            assert_eq!(
                s.dst.blob(repo, &l.digest).await.as_deref(),
                Some(&l.bytes[..]),
                "{name}"
            );
        }
        let layers: Vec<&str> = m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["digest"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = img.layers.iter().map(|l| l.digest.as_str()).collect();
        assert_eq!(layers, want);
        // skopeo reads the repaired copy, config included.
        assert_eq!(skopeo::inspect_digest(&s.dst, repo, tag).await, digest);
        let inspected = skopeo::inspect(&s.dst, repo, tag).await;
        assert_eq!(inspected["Digest"], digest);
        assert_eq!(
            inspected["Labels"]["dev.pinswap.content-digest"],
            want_label.as_str()
        );
        let note = identity[&format!("containers/c{i}")].as_str().unwrap();
        assert!(
            note.starts_with("repaired:") && note.contains(&img.digest),
            "{note}"
        );
        pinned.push(image);
    }
    assert_eq!(configs.len(), 3, "three distinct image IDs");
    assert!(!configs.contains(SPIN_CONFIG_DIGEST));
    assert_eq!(metric(&metrics, "pinswap_copies_succeeded_total"), 3.0);

    // A second run (a new process): same digests, nothing copied or pushed.
    let (adm2, metrics2) = admission(&cfg);
    let (again, _) = admit(&adm2, &spin_pod(&s, "apps-again")).await;
    for (i, p) in pinned.iter().enumerate() {
        assert_eq!(
            again["spec"]["containers"][i]["image"],
            p.as_str(),
            "repair is deterministic"
        );
    }
    assert_eq!(
        metric(&metrics2, "pinswap_copies_started_total"),
        0.0,
        "present already"
    );
    let decisions = annotation(&again, "pinswap.dev/decisions");
    assert!(
        decisions
            .values()
            .all(|d| d == "rewritten: present at the target"),
        "{decisions:?}"
    );
}

#[tokio::test]
async fn repair_rewrites_an_index_child_by_child() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/multi", "multi-a", "multi-b").await;
    let index = index_of(&[(&a, wasm("a")), (&b, wasm("b"))]);
    push_manifest(&src, "spin/multi", "v1", OCI_INDEX, &index).await;
    let cfg = config(&src, &dst, "repair");
    let (adm, _) = admission(&cfg);
    let (patched, _) = admit(
        &adm,
        &pod(
            "wasm",
            "multi",
            &[("app", &format!("{}/spin/multi:v1", src.host()))],
        ),
    )
    .await;
    let image = patched["spec"]["containers"][0]["image"].as_str().unwrap();
    let digest = image.split_once('@').unwrap().1;
    assert_ne!(digest, sha256_digest(&index));
    let repo = format!("mirror/127.0.0.1_{}/spin/multi", src.port());
    let (bytes, _, _) = dst.get_manifest(&repo, "v1").await.unwrap();
    assert_eq!(sha256_digest(&bytes), digest);
    let idx: Value = serde_json::from_slice(&bytes).unwrap();
    let mut configs = BTreeSet::new();
    for (i, child) in idx["manifests"].as_array().unwrap().iter().enumerate() {
        let d = child["digest"].as_str().unwrap();
        assert_ne!(d, [&a, &b][i].digest, "child {i} repaired");
        assert_eq!(child["platform"]["variant"], ["a", "b"][i], "platform kept");
        let (mb, _, _) = dst.get_manifest(&repo, d).await.unwrap();
        let m: Value = serde_json::from_slice(&mb).unwrap();
        configs.insert(m["config"]["digest"].as_str().unwrap().to_owned());
    }
    assert_eq!(configs.len(), 2);
    assert_eq!(skopeo::inspect_digest(&dst, &repo, "v1").await, digest);
}

#[tokio::test]
async fn a_restart_does_not_forget_a_collision() {
    common::init();
    let s = spin().await;
    let cfg = config(&s.src, &s.dst, "warn");
    let (first, _) = admission(&cfg);
    let h = s.src.host();
    admit(
        &first,
        &pod("wasm", "one", &[("app", &format!("{h}/spin/hello:v1"))]),
    )
    .await;
    drop(first);
    // A new process: its record is rebuilt from the target before it sees
    // the other app.
    let (second, _) = admission(&cfg);
    let tags = second.mirror().rebuild_identity(100).await.unwrap();
    assert_eq!(tags, 1);
    let (patched, _) = admit(
        &second,
        &pod("wasm", "two", &[("app", &format!("{h}/spin/other:w"))]),
    )
    .await;
    let note = annotation(&patched, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        note.contains(&format!(
            "collides with {}/mirror/127.0.0.1_{}/spin/hello:v1",
            s.dst.host(),
            s.src.port()
        )),
        "{note}"
    );
}

/// The watcher and recovery, talking to `api` as an install does: with the
/// install's RBAC and its namespace.
fn watch_as_installed(
    api: &common::kube::KubeApi,
    adm: &Admission,
    cfg: &Config,
) -> pinswap::watch::Background {
    api.authorize_install(cfg, pinswap::install::manifests::Tls::CertManager);
    pinswap::watch::Background::start(
        adm.mirror().clone(),
        cfg,
        Some(api.install_client()),
        tokio_util::sync::CancellationToken::new(),
    )
}

#[tokio::test]
async fn the_watcher_records_one_event_for_a_pod_with_an_identity_finding() {
    use k8s_openapi::api::core::v1::Pod;
    common::init();
    let s = spin().await;
    let api = common::kube::KubeApi::start().await;
    let cfg = Config {
        recovery: pinswap::config::Recovery::default(),
        ..config(&s.src, &s.dst, "warn")
    };
    let (adm, _) = admission(&cfg);
    let (patched, _) = admit(&adm, &spin_pod(&s, "apps")).await;
    api.apply_pod(serde_json::from_value::<Pod>(patched.clone()).unwrap());
    let bg = watch_as_installed(&api, &adm, &cfg);
    let found = || {
        api.events()
            .into_iter()
            .filter(|e| e["reason"] == "ImageIdentityNotUnique")
            .collect::<Vec<_>>()
    };
    let start = std::time::Instant::now();
    while found().is_empty() {
        assert!(
            start.elapsed().as_secs() < 10,
            "no Event: {:?}",
            api.events()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A later status update of the same Pod adds no second Event. The
    // watch delivers in order, so once a Pod stored after that update has
    // its Event, the update has been seen.
    api.apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    let (later, _) = admit(&adm, &spin_pod(&s, "apps-later")).await;
    api.apply_pod(serde_json::from_value::<Pod>(later).unwrap());
    let start = std::time::Instant::now();
    while !found()
        .iter()
        .any(|e| e["regarding"]["name"] == "apps-later")
    {
        assert!(start.elapsed().as_secs() < 10, "no Event for the later Pod");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let events: Vec<Value> = found()
        .into_iter()
        .filter(|e| e["regarding"]["name"] == "apps")
        .collect();
    assert_eq!(events.len(), 1, "one Event per Pod: {events:?}");
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["regarding"]["name"], "apps");
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains(SPIN_CONFIG_DIGEST), "{note}");
    bg.stop().await;
}

#[tokio::test]
async fn the_longest_identity_note_is_cut_to_the_api_servers_limit() {
    use k8s_openapi::api::core::v1::Pod;
    common::init();
    // Three colliding Spin apps under long repository names: the findings
    // of three slots, each naming the long references, pass 1 KiB, which
    // the API server (and the test API server) refuses in an Event note.
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let long = "a".repeat(90);
    let mut containers = Vec::new();
    for (i, (app, seed)) in [("hello", 1), ("hello-v2", 1), ("other", 2)]
        .into_iter()
        .enumerate()
    {
        let repo = format!("spin/{long}/{app}");
        push_image(&src, &repo, Some("v1"), &Image::spin(app, seed, None)).await;
        containers.push((format!("c{i}"), format!("{}/{repo}:v1", src.host())));
    }
    let refs: Vec<(&str, &str)> = containers
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let api = common::kube::KubeApi::start().await;
    let cfg = Config {
        recovery: pinswap::config::Recovery::default(),
        ..config(&src, &dst, "warn")
    };
    let (adm, _) = admission(&cfg);
    let (patched, _) = admit(&adm, &pod("wasm", "apps", &refs)).await;
    let findings = annotation(&patched, "pinswap.dev/identity");
    assert_eq!(findings.len(), 3, "{findings:?}");
    let whole = findings
        .iter()
        .map(|(slot, v)| format!("{slot}: {}", v.as_str().unwrap()))
        .collect::<Vec<_>>()
        .join("; ");
    assert!(
        whole.len() > 1024,
        "the findings fit a note whole ({} bytes)",
        whole.len()
    );
    api.apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    let bg = watch_as_installed(&api, &adm, &cfg);
    let start = std::time::Instant::now();
    let event = loop {
        let found = api
            .events()
            .into_iter()
            .find(|e| e["reason"] == "ImageIdentityNotUnique");
        if let Some(e) = found {
            break e;
        }
        assert!(
            start.elapsed().as_secs() < 10,
            "no Event: {:?}",
            api.requests()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let note = event["note"].as_str().unwrap();
    assert!(note.len() <= 1024, "{} bytes", note.len());
    assert!(note.ends_with('…'), "{note}");
    let kept = note.trim_end_matches('…');
    assert!(
        whole.starts_with(kept),
        "the note is the findings' beginning"
    );
    bg.stop().await;
}

// Edge cases found by a review that tried to break identity handling;
// each failed before its fix.

/// Follows `digest` at the target down to its image manifests and returns
/// their config digests.
async fn image_configs(dst: &TestRegistry, repo: &str, digest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut queue = vec![digest.to_owned()];
    while let Some(d) = queue.pop() {
        let (bytes, _, _) = dst.get_manifest(repo, &d).await.unwrap();
        let m: Value = serde_json::from_slice(&bytes).unwrap();
        if let Some(list) = m["manifests"].as_array() {
            for c in list {
                queue.push(c["digest"].as_str().unwrap().to_owned());
            }
        } else {
            out.push(m["config"]["digest"].as_str().unwrap().to_owned());
        }
    }
    out
}

fn split_pinned<'a>(dst: &TestRegistry, image: &'a str) -> (&'a str, &'a str) {
    let host = format!("{}/", dst.host());
    let (repo_tag, digest) = image
        .strip_prefix(host.as_str())
        .unwrap()
        .split_once('@')
        .unwrap();
    let repo = match repo_tag.rsplit_once(':') {
        Some((r, _)) => r,
        None => repo_tag,
    };
    (repo, digest)
}

/// An index whose child is itself an index (nested), holding Spin apps that
/// share the config: not repaired, and said so.
#[tokio::test]
async fn a_nested_index_is_not_repaired_and_the_note_says_so() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/nested", "nest-a", "nest-b").await;
    let inner = index_of(&[(&a, wasm("a")), (&b, wasm("b"))]);
    let inner_digest = sha256_digest(&inner);
    push_manifest(&src, "spin/nested", &inner_digest, OCI_INDEX, &inner).await;
    let outer = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": OCI_INDEX, "digest": inner_digest, "size": inner.len()}]}))
    .unwrap();
    push_manifest(&src, "spin/nested", "v1", OCI_INDEX, &outer).await;
    let (adm, _) = admission(&config(&src, &dst, "repair"));
    let (patched, _) = admit(
        &adm,
        &pod(
            "wasm",
            "nested",
            &[("app", &format!("{}/spin/nested:v1", src.host()))],
        ),
    )
    .await;
    let image = patched["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let note = annotation(&patched, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    // Only the top index's own children are rewritten: the images inside
    // the nested index are mirrored as they are, and the note says so
    // rather than claiming a repair.
    let (_, digest) = split_pinned(&dst, &image);
    assert_eq!(digest, sha256_digest(&outer), "pinned to the original");
    assert!(
        note.contains("not repaired (inside a nested index)"),
        "{note}"
    );
    assert!(!note.contains("repaired: config"), "{note}");
}

/// The descriptor of `bytes` as `media_type`.
fn descriptor(media_type: &str, bytes: &[u8]) -> pinswap::registry::manifest::Descriptor {
    pinswap::registry::manifest::Descriptor {
        media_type: media_type.into(),
        digest: sha256_digest(bytes),
        size: bytes.len() as u64,
        platform: None,
        urls: None,
    }
}

/// A config that names only one shared layer, or carries a copied or forged
/// content label, does not tell artifacts apart: sharing it is reported.
#[test]
fn a_config_naming_one_layer_or_a_forged_label_does_not_hide_a_collision() {
    use pinswap::identity::{Record, assess};
    let d = descriptor;
    let (l1, l2, l3) = (
        d("application/x-layer", b"common"),
        d("application/x-layer", b"app-one"),
        d("application/x-layer", b"app-two"),
    );
    // A config naming the shared base layer only.
    let cfg = format!(r#"{{"base":"{}"}}"#, l1.digest);
    let c = d("application/x-cfg+json", cfg.as_bytes());
    let r = Record::default();
    r.observe(
        "m/one:1",
        &assess("sha256:m1", &c, &[l1.clone(), l2.clone()], cfg.as_bytes()),
    );
    let f = r.observe(
        "m/two:1",
        &assess("sha256:m2", &c, &[l1.clone(), l3.clone()], cfg.as_bytes()),
    );
    // A config with the pinswap label set to anything (e.g. copied from a
    // repaired image, or hand-written), shared by two different apps.
    let forged = br#"{"architecture":"wasm","os":"wasip1","rootfs":{"type":"layers","diff_ids":[]},"config":{"Labels":{"dev.pinswap.content-digest":"x"}}}"#;
    let fc = d("application/vnd.oci.image.config.v1+json", forged);
    let r2 = Record::default();
    r2.observe(
        "m/a:1",
        &assess("sha256:a", &fc, std::slice::from_ref(&l2), forged),
    );
    let g = r2.observe(
        "m/b:1",
        &assess("sha256:b", &fc, std::slice::from_ref(&l3), forged),
    );
    assert!(
        f.is_some() && g.is_some(),
        "same config, different layers, nothing reported: mentions-one-layer={f:?} forged-label={g:?}"
    );
}

/// The record and a finding's text stay bounded however many artifacts
/// share one config (every ORAS artifact shares `{}`).
#[test]
fn the_record_and_a_finding_stay_bounded_for_one_shared_config() {
    use pinswap::identity::{Record, assess};
    let d = descriptor;
    let c = d("application/vnd.oci.empty.v1+json", b"{}");
    let r = Record::default();
    let mut last = None;
    for i in 0..5000 {
        let l = d("application/x-layer", format!("artifact-{i}").as_bytes());
        last = r.observe(
            &format!("mirror.example/art/a{i}:1"),
            &assess(&format!("sha256:{i}"), &c, &[l], b"{}"),
        );
    }
    let f = last.unwrap();
    let text = f.to_string();
    assert!(
        f.colliding.len() <= 100 && text.len() < 64 * 1024,
        "one finding names {} references, {} bytes of text (deny messages and logs carry it whole)",
        f.colliding.len(),
        text.len()
    );
}

async fn admit_one(adm: &Admission, image: &str, name: &str) -> Value {
    admit(adm, &pod("wasm", name, &[("app", image)])).await.0
}

fn image_of(p: &Value) -> String {
    p["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A repaired image lost at the target is recovered by a replica that did
/// not plan it (another replica, a restart, or after the 24 h `sources`
/// TTL), even once the source tag has moved, from the `pinswap.dev/sources`
/// entry; `warn` is the control.
#[tokio::test]
async fn a_repaired_image_is_recovered_by_another_replica_after_the_tag_moved() {
    use pinswap::cache::Cause;
    use pinswap::reference::Reference;
    common::init();
    for policy in ["warn", "repair"] {
        let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
        push_image(
            &src,
            "spin/hello",
            Some("v1"),
            &Image::spin("rec-a", 1, None),
        )
        .await;
        let cfg = config(&src, &dst, policy);
        let (first, _) = admission(&cfg);
        let original = format!("{}/spin/hello:v1", src.host());
        let p = admit_one(&first, &original, "web").await;
        let image = image_of(&p);
        // What the watcher reads: the pinned source the admission recorded.
        let pinned_source = annotation(&p, "pinswap.dev/sources")["containers/app"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            pinned_source.starts_with(&format!("{original}@sha256:")),
            "{pinned_source}"
        );
        // The tag moves upstream (a new release).
        push_image(
            &src,
            "spin/hello",
            Some("v1"),
            &Image::spin("rec-b", 1, None),
        )
        .await;
        let (repo, digest) = split_pinned(&dst, &image);
        dst.delete_manifest(repo, digest).await;
        let (other, _) = admission(&cfg);
        let target = Reference::parse(&image).unwrap();
        let hint = Reference::parse(&pinned_source).unwrap();
        let r = other
            .mirror()
            .recover(&target, Some(&hint), Cause::PullFailure, &[])
            .await;
        assert!(
            r.is_ok() && dst.head_manifest(repo, digest).await.is_some(),
            "{policy}: {image} not recovered: {r:?}"
        );
    }
}

/// A dry-run admission has no side effects: nothing enters the identity
/// record, and no finding is counted.
#[tokio::test]
async fn a_dry_run_admission_leaves_the_identity_record_alone() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    push_image(
        &src,
        "spin/ghost",
        Some("v1"),
        &Image::spin("ghost", 1, None),
    )
    .await;
    push_image(&src, "spin/real", Some("v1"), &Image::spin("real", 1, None)).await;
    let (adm, metrics) = admission(&config(&src, &dst, "warn"));
    let mut review = create_review(&pod(
        "wasm",
        "dry",
        &[("app", &format!("{}/spin/ghost:v1", src.host()))],
    ));
    review["request"]["dryRun"] = json!(true);
    adm.review(serde_json::to_vec(&review).unwrap().into())
        .await
        .unwrap();
    let findings_after_dry_run = metric(
        &metrics,
        "pinswap_identity_findings_total{kind=\"non_unique\"}",
    );
    let p = admit_one(&adm, &format!("{}/spin/real:v1", src.host()), "real").await;
    let note = annotation(&p, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        findings_after_dry_run == 0.0 && !note.contains("spin/ghost"),
        "dry run counted {findings_after_dry_run} finding(s); the real Pod's note names the dry-run image: {note}"
    );
}

/// A platform filter with repair, on an index of two Spin apps.
#[tokio::test]
async fn repair_with_a_platform_filter() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/pf", "pf-a", "pf-b").await;
    let linux = |arch: &str| json!({"architecture": arch, "os": "linux"});
    let index = index_of(&[(&a, linux("amd64")), (&b, linux("arm64"))]);
    push_manifest(&src, "spin/pf", "v1", OCI_INDEX, &index).await;
    let cfg = config_extra(&src, &dst, "repair", "platforms: [linux/amd64]\n");
    let (adm, _) = admission(&cfg);
    let p = admit_one(&adm, &format!("{}/spin/pf:v1", src.host()), "pf").await;
    let image = image_of(&p);
    assert!(
        image.starts_with(&dst.host()),
        "{image} {:?}",
        annotation(&p, "pinswap.dev/decisions")
    );
    let (repo, digest) = split_pinned(&dst, &image);
    let configs = image_configs(&dst, repo, digest).await;
    assert_eq!(configs.len(), 1, "{configs:?}");
    assert_ne!(configs[0], SPIN_CONFIG_DIGEST);
    // A second process plans the same digest (deterministic).
    let (adm2, m2) = admission(&cfg);
    let p2 = admit_one(&adm2, &format!("{}/spin/pf:v1", src.host()), "pf2").await;
    assert_eq!(image_of(&p2), image);
    assert_eq!(metric(&m2, "pinswap_copies_started_total"), 0.0);
}

/// Docker schema2 images (pretty-printed manifests, no annotations)
/// sharing one config, with a digest-only source and pin: false.
#[tokio::test]
async fn repair_of_docker_schema2_images_sharing_a_config() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let cfg_bytes = br#"{"architecture":"amd64","os":"linux","config":{"Labels":{"a":"b"}},"rootfs":{"type":"layers","diff_ids":[]}}"#;
    let config = common::fixtures::Blob::new(
        "application/vnd.docker.container.image.v1+json",
        cfg_bytes.to_vec(),
    );
    let mk = |seed: &str| {
        let layer = common::fixtures::Blob::new(
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            common::fixtures::gzip(seed.as_bytes()),
        );
        let m = serde_json::to_vec_pretty(&json!({"schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": config.descriptor(), "layers": [layer.descriptor()]}))
        .unwrap();
        Image {
            digest: sha256_digest(&m),
            manifest: m,
            media_type: "application/vnd.docker.distribution.manifest.v2+json".into(),
            config: config.clone(),
            layers: vec![layer],
        }
    };
    let (a, b) = (mk("docker-a"), mk("docker-b"));
    push_image(&src, "dock/a", Some("v1"), &a).await;
    push_image(&src, "dock/b", None, &b).await;
    let cfg = config_extra(&src, &dst, "repair", "pin: false\n");
    let (adm, _) = admission(&cfg);
    let pa = admit_one(&adm, &format!("{}/dock/a:v1", src.host()), "a").await;
    let pb = admit_one(&adm, &format!("{}/dock/b@{}", src.host(), b.digest), "b").await;
    let (ia, ib) = (image_of(&pa), image_of(&pb));
    assert!(!ia.contains('@'), "pin: false keeps the tag only: {ia}");
    let repo_a = ia
        .strip_prefix(&format!("{}/", dst.host()))
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .0
        .to_owned();
    let (da, _, _) = dst.get_manifest(&repo_a, "v1").await.unwrap();
    let da = sha256_digest(&da);
    let (repo_b, db) = split_pinned(&dst, &ib);
    assert_ne!(
        db, b.digest,
        "digest-only source pinned to the repaired digest"
    );
    let ca = image_configs(&dst, &repo_a, &da).await;
    let cb = image_configs(&dst, repo_b, db).await;
    assert_ne!(ca, cb, "unique image IDs");
    // The anchor tag names the repaired copy.
    let tags = dst.tags(repo_b).await;
    assert_eq!(tags.len(), 1, "{tags:?}");
    assert_eq!(
        dst.head_manifest(repo_b, &tags[0]).await.as_deref(),
        Some(db)
    );
    let (cfgb, _, _) = {
        let (bytes, _, _) = dst.get_manifest(repo_b, db).await.unwrap();
        let m: Value = serde_json::from_slice(&bytes).unwrap();
        let c = dst
            .blob(repo_b, m["config"]["digest"].as_str().unwrap())
            .await
            .unwrap();
        (serde_json::from_slice::<Value>(&c).unwrap(), (), ())
    };
    assert_eq!(cfgb["config"]["Labels"]["a"], "b", "existing labels kept");
    assert!(cfgb["config"]["Labels"]["dev.pinswap.content-digest"].is_string());
    assert_eq!(
        common::skopeo::inspect_digest(&dst, repo_b, &tags[0]).await,
        db
    );
}

/// The target has the original under the tag (mirrored under warn), then
/// the operator switches to repair: the tag moves to the repaired copy and
/// the original stays by digest.
#[tokio::test]
async fn switching_from_warn_to_repair_repairs_what_warn_mirrored() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let a = Image::spin("sw-a", 1, None);
    push_image(&src, "spin/sw", Some("v1"), &a).await;
    let (warn, _) = admission(&config(&src, &dst, "warn"));
    let image = format!("{}/spin/sw:v1", src.host());
    let p = admit_one(&warn, &image, "w").await;
    assert!(image_of(&p).ends_with(&a.digest));
    let (repair, _) = admission(&config(&src, &dst, "repair"));
    let p = admit_one(&repair, &image, "r").await;
    let pinned = image_of(&p);
    let (repo, digest) = split_pinned(&dst, &pinned);
    assert_ne!(digest, a.digest);
    assert_eq!(dst.head_manifest(repo, "v1").await.as_deref(), Some(digest));
    assert!(
        dst.head_manifest(repo, &a.digest).await.is_some(),
        "original still there for old Pods"
    );
}

/// `pinswap check` given a flagged reference (written as `copy` takes it,
/// with `docker://`) and an unreadable one.
#[tokio::test]
async fn check_reports_errors_even_when_something_is_flagged() {
    common::init();
    let src = TestRegistry::plain().await;
    push_image(&src, "spin/x", Some("v1"), &Image::spin("x", 1, None)).await;
    let out = tokio::process::Command::new(common::pinswap_bin())
        .args([
            "check",
            "--json",
            &format!("docker://{}/spin/x:v1", src.host()),
            &format!("{}/spin/missing:v1", src.host()),
        ])
        .output()
        .await
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["errors"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(out.status.code(), Some(3));
}

/// Two admissions of one Spin index at once, by tag and by digest (two
/// copy-queue keys), under repair: both repaired pushes succeed (they share
/// the copier's per-manifest lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_repairs_of_one_index_under_two_tags_both_succeed() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let mut failures = Vec::new();
    for round in 0..10 {
        let repo = format!("spin/c{round}");
        let kids: Vec<Image> = (0..4)
            .map(|i| Image::spin(&format!("c{round}-{i}"), 1, None))
            .collect();
        let mut entries = Vec::new();
        for (i, k) in kids.iter().enumerate() {
            push_image(&src, &repo, None, k).await;
            entries.push(
                json!({"mediaType": k.media_type, "digest": k.digest, "size": k.manifest.len(),
                "platform": {"architecture": "wasm", "os": "wasip1", "variant": format!("v{i}")}}),
            );
        }
        let index = serde_json::to_vec(
            &json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}),
        )
        .unwrap();
        push_manifest(&src, &repo, "v1", OCI_INDEX, &index).await;
        let (adm, _) = admission(&config(&src, &dst, "repair"));
        let by_tag = format!("{}/{repo}:v1", src.host());
        let by_digest = format!("{}/{repo}@{}", src.host(), sha256_digest(&index));
        let (a, b) = tokio::join!(
            admit_one(&adm, &by_tag, "t"),
            admit_one(&adm, &by_digest, "d")
        );
        for p in [a, b] {
            let d = annotation(&p, "pinswap.dev/decisions")["containers/app"].clone();
            if !d.as_str().unwrap().starts_with("rewritten") {
                failures.push(format!("round {round}: {d}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A slow identity inspection under a tight admission budget: under warn
/// (advisory) it does not hold up the rewrite of an image already at the
/// target, and it finishes in the background for later admissions.
#[tokio::test]
async fn a_slow_inspection_makes_progress_across_admissions() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let mut entries = Vec::new();
    for i in 0..80u64 {
        let img = Image::oci_for("amd64", Some(&format!("v{i}")), 1, 1000 + i);
        push_image(&src, "shop/wide", None, &img).await;
        entries.push(
            json!({"mediaType": img.media_type, "digest": img.digest, "size": img.manifest.len(),
            "platform": {"architecture": "amd64", "os": "linux", "variant": format!("v{i}")}}),
        );
    }
    let index = serde_json::to_vec(
        &json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}),
    )
    .unwrap();
    push_manifest(&src, "shop/wide", "v1", OCI_INDEX, &index).await;
    let image = format!("{}/shop/wide:v1", src.host());
    // Mirrored already (by an earlier process with a generous budget).
    let (first, _) = admission(&config(&src, &dst, "warn"));
    // The copy goes on in the background past one admission's budget on a
    // loaded machine: admit until it is done.
    let t = Instant::now();
    let mut mirrored = false;
    for i in 0..20 {
        let p = admit_one(&first, &image, &format!("a{i}")).await;
        if image_of(&p).starts_with(&dst.host()) {
            mirrored = true;
            break;
        }
    }
    eprintln!("first admissions (copy + inspection): {:?}", t.elapsed());
    assert!(mirrored, "never mirrored");
    // A new replica with a tight budget.
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\nserver: {{admissionBudget: 100ms}}\nidentity: {{collisions: warn}}\nrecovery: {{enabled: false}}\n",
        dst.host(),
        src.host()
    );
    let (second, _) = admission(&Config::from_yaml(&yaml, "t.yaml").unwrap());
    let count = || src.log().lines().filter(|l| l.contains("\"GET ")).count();
    // Admissions until three in a row are rewritten: the inspection goes on
    // between them, so that comes after a few. How many depends on the
    // machine's load (each admission has 100 ms), so the bound is loose.
    let mut outcomes = Vec::new();
    let mut in_a_row = 0;
    for i in 0..40 {
        let before = count();
        let p = admit_one(&second, &image, &format!("b{i}")).await;
        let decision = annotation(&p, "pinswap.dev/decisions")["containers/app"]
            .as_str()
            .unwrap()
            .to_owned();
        in_a_row = if decision.starts_with("rewritten") {
            in_a_row + 1
        } else {
            0
        };
        outcomes.push((decision, count() - before));
        if in_a_row == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("{outcomes:#?}");
    assert_eq!(
        in_a_row, 3,
        "never rewritten three times in a row: {outcomes:#?}"
    );
}

/// OCI 1.1 artifacts embed the empty config in the descriptor (`"data":
/// "e30="`). The repaired descriptor must not contradict itself: `data`
/// matches the digest or is gone, and the empty mediaType (which must hold
/// `{}`) is replaced.
#[test]
fn a_repaired_oras_manifest_keeps_a_consistent_config_descriptor() {
    use pinswap::identity::{repair_config, repair_manifest};
    use pinswap::registry::manifest::RawManifest;
    let layer =
        common::fixtures::Blob::new("application/vnd.oci.image.layer.v1.tar", b"x".to_vec());
    let body = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.example",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": common::fixtures::EMPTY_CONFIG_DIGEST, "size": 2, "data": "e30="},
        "layers": [layer.descriptor()]});
    let bytes = bytes::Bytes::from(serde_json::to_vec(&body).unwrap());
    let m = RawManifest::parse(
        bytes.clone(),
        pinswap::reference::Digest::parse(&sha256_digest(&bytes)).unwrap(),
        None,
    )
    .unwrap();
    let desc = descriptor("application/vnd.oci.empty.v1+json", b"{}");
    let cfg = repair_config(b"{}", &desc, std::slice::from_ref(&layer.digest)).unwrap();
    let d = pinswap::reference::Digest::parse(&sha256_digest(&cfg)).unwrap();
    let r = repair_manifest(&m, (&d, cfg.len() as u64)).unwrap();
    let v: Value = serde_json::from_slice(&r.bytes).unwrap();
    let c = &v["config"];
    use base64::Engine as _;
    let data_ok = c.get("data").is_none_or(|x| {
        base64::engine::general_purpose::STANDARD
            .decode(x.as_str().unwrap())
            .unwrap()
            == cfg
    });
    let mt_ok = c["mediaType"] != "application/vnd.oci.empty.v1+json";
    assert!(data_ok && mt_ok, "repaired config descriptor: {c}");
}

/// A layerless manifest that shares its config with a layered image has no
/// layers to label its config with; under `repair` its identity note says
/// it is not repaired and names the collision, instead of being empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layerless_manifest_in_a_collision_is_reported_not_repaired() {
    use common::fixtures::{Blob, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, gzip};
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let shared = Blob::new(
        OCI_CONFIG,
        br#"{"architecture":"amd64","os":"linux"}"#.to_vec(),
    );
    let layered = Image::with_parts(
        OCI_MANIFEST,
        shared.clone(),
        vec![Blob::new(OCI_LAYER_GZIP, gzip(b"app"))],
    );
    let bare = Image::with_parts(OCI_MANIFEST, shared, vec![]);
    push_image(&src, "art/layered", Some("v1"), &layered).await;
    push_image(&src, "art/bare", Some("v1"), &bare).await;
    let (adm, _) = admission(&config(&src, &dst, "repair"));
    let first = admit_one(&adm, &format!("{}/art/layered:v1", src.host()), "a").await;
    let note = annotation(&first, "pinswap.dev/identity")["containers/app"].clone();
    assert!(
        note.as_str().unwrap().starts_with("repaired: config"),
        "{note}"
    );
    let second = admit_one(&adm, &format!("{}/art/bare:v1", src.host()), "b").await;
    let note = annotation(&second, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        note.starts_with("not repaired (no layers to label the config with): "),
        "{note}"
    );
    assert!(
        note.contains("art/layered:v1"),
        "names the collision: {note}"
    );
}
