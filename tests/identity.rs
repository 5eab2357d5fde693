//! Image identity (issue 5), against real registries: `pinswap check`, and
//! the `warn`, `deny` and `repair` policies through the admission handler.
//! Spin apps pushed before Spin 2.4 share one 78-byte config, so containerd
//! gives them one image ID; ORAS artifacts share `{}`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

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
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\nserver: {{admissionBudget: 8s}}\nidentity: {{collisions: {collisions}}}\nrecovery: {{enabled: false}}\n",
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
    let (a, b) = (
        Image::spin("multi-a", 1, None),
        Image::spin("multi-b", 1, None),
    );
    push_image(&src, "spin/multi", None, &a).await;
    push_image(&src, "spin/multi", None, &b).await;
    let entry = |img: &Image, variant: &str| {
        json!({"mediaType": img.media_type, "digest": img.digest, "size": img.manifest.len(),
               "platform": {"architecture": "wasm", "os": "wasip1", "variant": variant}})
    };
    let index = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [entry(&a, "a"), entry(&b, "b")]}))
    .unwrap();
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
    let bg = pinswap::watch::Background::start(
        adm.mirror().clone(),
        &cfg,
        Some(api.client()),
        tokio_util::sync::CancellationToken::new(),
    );
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
    // A later status update of the same Pod adds no second Event.
    api.apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let events = found();
    assert_eq!(events.len(), 1, "one Event per Pod: {events:?}");
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["regarding"]["name"], "apps");
    assert!(
        events[0]["note"]
            .as_str()
            .unwrap()
            .contains(SPIN_CONFIG_DIGEST)
    );
    bg.stop().await;
}
