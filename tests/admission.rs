//! Admission against real registries: AdmissionReview fixtures from
//! `tests/data/admission/` go through `Admission::review`, the returned
//! JSONPatch is applied to the Pod with json-patch, and the Pod and the
//! target registry are checked field by field.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::admission::*;
use common::fixtures::Image;
use common::{TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::metrics::Metrics;
use serde_json::Value;

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
    let debug_pinned = a.image("ephemeralContainers", 0);
    assert!(debug_pinned.starts_with(&format!("{debug}:v1@sha256:")));
    // An image volume's reference, like a container's image; other volumes
    // and a volume outside the allowlist untouched.
    let volumes = &a.pod["spec"]["volumes"];
    assert_eq!(volumes[1]["image"]["reference"], debug_pinned);
    assert_eq!(volumes[1]["image"]["pullPolicy"], "IfNotPresent");
    assert_eq!(volumes[0], a.original["spec"]["volumes"][0]);
    assert_eq!(volumes[2], a.original["spec"]["volumes"][2]);

    let original = a.annotation("pinswap.dev/original-images");
    assert_eq!(
        original["containers/web"],
        format!("{}/shop/app:v1", r.src.host())
    );
    assert_eq!(original.len(), 6, "{original:?}");
    assert_eq!(
        original["volumes/model"],
        format!("{}/shop/debug:v1", r.src.host())
    );
    let decisions = a.annotation("pinswap.dev/decisions");
    assert_eq!(decisions.len(), 10, "every slot explained: {decisions:?}");
    assert!(decisions["volumes/data"].contains("not in source.registries"));
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
    // One image in five slots (and debug in two) is streamed once: app (tagged), app's anchor
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
        Some(6.0),
        "{text}"
    );
    assert_eq!(
        common::metrics::total(&text, "pinswap_rewrites_total"),
        6.0,
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
