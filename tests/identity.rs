//! Image identity, against real registries: `pinswap check`, and the
//! `warn` and `deny` policies through the admission handler, the watcher's
//! events and the record's bounds. Spin apps pushed before Spin 2.4 share
//! one 78-byte config, so containerd gives them one image ID; ORAS
//! artifacts share `{}`.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::fixtures::{EMPTY_CONFIG_DIGEST, Image, OCI_INDEX, SPIN_CONFIG, SPIN_CONFIG_DIGEST};
use common::identity::*;
use common::review::{admit, create_review, pod};
use common::{TestRegistry, push_image, push_manifest, sha256_digest};
use pinswap::config::Config;
use serde_json::{Value, json};

#[test]
fn the_spin_fixtures_share_one_config_and_oras_ones_the_empty_config() {
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
