//! Keeping rewrites true when the mirror loses an image: pull-failure
//! recovery, re-verification, `ttl: 0`, and a source that is down, against
//! real registries and the in-process Kubernetes API server. Pods are
//! admitted through `Admission::review` and stored in the API server; a
//! kubelet's pull failure is published as the Pod's status. The rig is
//! `common::recovery`.

mod common;

use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::recovery::*;
use common::review::{admit, pod, pull_failing, running};
use common::{TestRegistry, push_image};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

#[tokio::test]
async fn a_pruned_image_is_mirrored_again_once_when_pods_fail_to_pull_it() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 401).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);

    // 1. Mirror app:v1 and admit Pods; they are rewritten and pinned.
    let mut pods = Vec::new();
    for i in 0..50 {
        pods.push(admit_and_store(&r, &api, &format!("web-{i}"), &app, &dst).await);
    }
    assert!(served_again(&dst, &app).await, "mirrored at admission");
    assert_eq!(r.metric("pinswap_copies_succeeded_total"), 1.0);
    r.start(&cfg, &api);
    wait_leader(&r).await;

    // 2. The registry loses it.
    prune(&dst, &app).await;

    // 3. Every kubelet reports ErrImagePull on the rewritten image.
    for p in &pods {
        store(&api, &pull_failing(p, "app", "ErrImagePull"));
    }

    // 4. It is served again, with the same digest and bytes.
    eventually("the image served again", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    // Let the other 49 statuses, and each Pod's next kubelet retry
    // (ImagePullBackOff), arrive and be ignored.
    eventually(
        "every pull failure counted",
        Duration::from_secs(10),
        || async { r.metric("pinswap_pull_failures_total") == 50.0 },
    )
    .await;
    // The kubelet's back-off after ErrImagePull describes the same
    // failure: not counted again, and no second recovery.
    for p in &pods {
        store(&api, &pull_failing(p, "app", "ImagePullBackOff"));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(r.metric("pinswap_pull_failures_total"), 50.0);
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0,
        "exactly one re-mirror"
    );
    assert_eq!(
        r.metric("pinswap_copies_started_total"),
        2.0,
        "admission's copy and one re-mirror"
    );
    assert_eq!(r.metric("pinswap_remirrors_total{outcome=\"failed\"}"), 0.0);
    // The first failure invalidates the stale entry; the re-mirror records
    // it again, and a failure arriving in the cooldown after it invalidates
    // it once more (admission then asks the target again) unless every
    // other status arrived while the recovery ran.
    let invalidated =
        r.metric("pinswap_cache_invalidations_total{cache=\"existence\",cause=\"pull_failure\"}");
    assert!(
        (1.0..=2.0).contains(&invalidated),
        "the stale entry was invalidated: {invalidated}"
    );
    let events = events_for(&api, "web-0", "ImageRemirrored");
    assert_eq!(events.len(), 1, "{:?}", api.events());
    let e = &events[0];
    assert_eq!(e["type"], "Normal");
    assert_eq!(e["regarding"]["kind"], "Pod");
    assert_eq!(e["regarding"]["namespace"], "shop");
    assert_eq!(e["reportingController"], "pinswap");
    let note = e["note"].as_str().unwrap();
    assert!(
        note.contains(&app.image.digest) && note.contains(&app.source.replace(":v1", "")),
        "{note}"
    );
    r.stop().await;
}

#[tokio::test]
async fn reverification_restores_images_in_use_and_evicts_the_rest() {
    let (src, dst, api) = rig().await;
    let used = push(&src, "used", 411).await;
    let unused = push(&src, "unused", 412).await;
    let cfg = config(&src, &dst, "{reverify: 1s}");
    let mut r = Replica::new(&cfg);
    admit_and_store(&r, &api, "web", &used, &dst).await;
    // Admitted, but its Pod never reached the API server.
    admit(&r.adm, &pod("shop", "gone", &[("app", &unused.source)])).await;
    assert!(served_again(&dst, &unused).await);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    // The watcher has listed the Pod before the prune.
    wait_watching(&api).await;
    prune(&dst, &used).await;
    prune(&dst, &unused).await;

    eventually("the image in use is back", Duration::from_secs(10), || {
        served_again(&dst, &used)
    })
    .await;
    eventually(
        "both were found missing",
        Duration::from_secs(10),
        || async {
            r.metric(
                "pinswap_cache_invalidations_total{cache=\"existence\",cause=\"reverification\"}",
            ) == 2.0
        },
    )
    .await;
    // Another round passes; the unused image stays gone and uncached.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        dst.head_manifest(&unused.repo, "v1").await,
        None,
        "not copied"
    );
    let cached: Vec<String> = r
        .adm
        .mirror()
        .caches()
        .existence_entries()
        .iter()
        .map(|e| e.target.to_string())
        .collect();
    assert!(
        !cached.iter().any(|t| t.contains("/shop/unused@")),
        "evicted: {cached:?}"
    );
    assert!(
        cached.iter().any(|t| t.contains("/shop/used@")),
        "re-cached: {cached:?}"
    );
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    assert_eq!(
        r.metric("pinswap_copies_started_total"),
        3.0,
        "two admissions and one re-mirror"
    );
    assert!(r.metric("pinswap_reverifications_total{outcome=\"missing\"}") >= 2.0);
    assert!(r.metric("pinswap_reverifications_total{outcome=\"present\"}") >= 1.0);
    r.stop().await;
}

#[tokio::test]
async fn with_ttl_zero_the_next_admission_mirrors_a_pruned_image_before_rewriting() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = push(&src, "app", 421).await;
    let cfg = config(&src, &dst, "{ttl: 0s, reverify: 0s}");
    let r = Replica::new(&cfg);
    let (first, _) = admit(&r.adm, &pod("shop", "a", &[("app", &app.source)])).await;
    prune(&dst, &app).await;
    let (second, response) = admit(&r.adm, &pod("shop", "b", &[("app", &app.source)])).await;
    assert_eq!(
        second["spec"]["containers"][0]["image"],
        first["spec"]["containers"][0]["image"]
    );
    // Checked right after the answer: the copy happened before it.
    assert!(served_again(&dst, &app).await, "{response}");
    let decisions: Value = serde_json::from_str(
        second["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        decisions["containers/app"],
        "rewritten: copied to the target"
    );
    assert_eq!(r.metric("pinswap_copies_succeeded_total"), 2.0);
    assert_eq!(
        r.metric("pinswap_cache_hits_total{cache=\"existence\"}"),
        0.0
    );
}

#[tokio::test]
async fn a_source_down_during_recovery_gives_remirror_failed_then_retries_until_it_works() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 441).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    src.kill();
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));

    eventually(
        "RemirrorFailed recorded",
        Duration::from_secs(10),
        || async { !events_for(&api, "web", "RemirrorFailed").is_empty() },
    )
    .await;
    let failed = events_for(&api, "web", "RemirrorFailed");
    assert_eq!(failed[0]["type"], "Warning");
    let note = failed[0]["note"].as_str().unwrap();
    assert!(
        note.contains(&src.host()) && note.contains("retrying in"),
        "{note}"
    );
    // Retries back off: 300 ms, 600 ms, 1.2 s, ...; a few happen while the
    // source is down, each recorded (as one Event series).
    eventually("retried", Duration::from_secs(10), || async {
        r.metric("pinswap_remirrors_total{outcome=\"failed\"}") >= 3.0
    })
    .await;
    src.restart().await;
    eventually(
        "recovered once the source is back",
        Duration::from_secs(20),
        || served_again(&dst, &app),
    )
    .await;
    eventually(
        "ImageRemirrored recorded",
        Duration::from_secs(5),
        || async { !events_for(&api, "web", "ImageRemirrored").is_empty() },
    )
    .await;
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    r.stop().await;
}

/// The figures in docs/recovery-and-identity.md: time from a pull-failure status to the image
/// being served again, over 20 distinct 10 MiB images (one per run, so no
/// cooldown applies). Run with `scripts/bench-recovery.sh`.
#[tokio::test]
#[ignore = "a measurement, not a test; scripts/bench-recovery.sh runs it"]
async fn recovery_latency_figures() {
    let (src, dst, api) = rig().await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let mut runs = Vec::new();
    for i in 0..20u64 {
        let img = push_this(
            &src,
            &format!("big{i}"),
            Image::random_layers(1, 10 << 20, 500 + i),
        )
        .await;
        runs.push((
            admit_and_store(&r, &api, &format!("big-{i}"), &img, &dst).await,
            img,
        ));
    }
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    let mut times = Vec::new();
    for (p, img) in &runs {
        prune(&dst, img).await;
        let start = Instant::now();
        store(&api, &pull_failing(p, "app", "ErrImagePull"));
        while dst.head_manifest(&img.repo, "v1").await.as_deref() != Some(img.image.digest.as_str())
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        times.push(start.elapsed());
        assert!(served_again(&dst, img).await);
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "recovery of a 10 MiB image, {} runs: median {:.0} ms, max {:.0} ms, min {:.0} ms",
        times.len(),
        ms(times[times.len() / 2]),
        ms(times[times.len() - 1]),
        ms(times[0])
    );
    r.stop().await;
}

/// Only a layer lost (GC): the manifest HEAD still answers, so recovery
/// must verify the blobs and restore the one the kubelet needs.
#[tokio::test]
async fn a_lost_layer_alone_is_restored_after_a_pull_failure() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 921).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    dst.delete_blob(&app.repo, &app.image.layers[0].digest)
        .await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
    tokio::time::sleep(Duration::from_secs(6)).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let present = r.metric("pinswap_remirrors_total{outcome=\"present\"}");
    let ok = served_again(&dst, &app).await;
    r.stop().await;
    assert!(
        ok,
        "layer still missing after {present} recoveries that each answered \"present\""
    );
}

/// Re-verification finds an in-use image missing while the source is down:
/// the re-mirror must be retried though no Pod fails (its Pods run fine).
#[tokio::test]
async fn a_failed_reverification_remirror_is_retried_while_the_image_is_in_use() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 951).await;
    let cfg = config(&src, &dst, "{reverify: 1s}");
    let mut r = Replica::new(&cfg);
    admit_and_store(&r, &api, "web", &app, &dst).await; // running fine
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    src.kill();
    prune(&dst, &app).await;
    eventually("re-mirror failed", Duration::from_secs(10), || async {
        r.metric("pinswap_remirrors_total{outcome=\"failed\"}") >= 1.0
    })
    .await;
    src.restart().await;
    // retryMax is 2s here: a retry comes within a few seconds.
    let t = Instant::now();
    while !served_again(&dst, &app).await && t.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ok = served_again(&dst, &app).await;
    let failed = r.metric("pinswap_remirrors_total{outcome=\"failed\"}");
    let entries = r.adm.mirror().caches().existence_entries().len();
    r.stop().await;
    assert!(
        ok,
        "still missing 8 s after the source came back; {failed} failed attempts, {entries} cache entries left to re-verify"
    );
}

/// A pull failure while the source is down: the re-mirror fails with a
/// `RemirrorFailed` Event naming the cause, admission stops answering
/// "present at the target" for the lost image, and the recovery retries
/// until the source is back, then mirrors the image again.
#[tokio::test]
async fn a_pull_failure_during_a_source_outage_recovers_when_the_source_returns() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 431).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web-0", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;

    prune(&dst, &app).await;
    src.kill();
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "a RemirrorFailed Event",
        Duration::from_secs(20),
        || async { !events_for(&api, "web-0", "RemirrorFailed").is_empty() },
    )
    .await;
    let events = events_for(&api, "web-0", "RemirrorFailed");
    let note = events[0]["note"].as_str().unwrap();
    // The cause: the source registry, refusing connections (or, once its
    // breaker has opened, "cannot answer").
    assert!(
        note.contains(&src.host())
            && (note.contains("Connection refused") || note.contains("cannot answer"))
            && note.contains("retrying in"),
        "{note}"
    );
    assert_eq!(events[0]["type"], "Warning");
    // The lost image is not answered from the existence cache: admission
    // leaves the Pod unchanged (the target has no copy, the source is down).
    let (again, _) = admit(&r.adm, &pod("shop", "web-1", &[("app", &app.source)])).await;
    assert_eq!(again["spec"]["containers"][0]["image"], app.source.as_str());

    src.restart().await;
    eventually("the image served again", Duration::from_secs(30), || {
        served_again(&dst, &app)
    })
    .await;
    eventually(
        "an ImageRemirrored Event",
        Duration::from_secs(10),
        || async { !events_for(&api, "web-0", "ImageRemirrored").is_empty() },
    )
    .await;
    r.stop().await;
}

/// A new pull failure that arrives in the cooldown after a recovery (another
/// Pod's `ErrImagePull`) starts no second re-mirror, but still invalidates
/// the existence entry, so admission asks the target again instead of
/// answering "present" from the cache for a manifest a kubelet just failed
/// to pull. The failing Pod's own `ImagePullBackOff`, which the kubelet
/// writes at its retry about the failure already handled, does neither.
#[tokio::test]
async fn a_pull_failure_in_the_cooldown_still_invalidates_the_existence_entry() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 441).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web-0", &app, &dst).await;
    let other = admit_and_store(&r, &api, "web-1", &app, &dst).await;
    let image =
        pinswap::reference::Reference::parse(p["spec"]["containers"][0]["image"].as_str().unwrap())
            .unwrap();
    r.start(&cfg, &api);
    wait_leader(&r).await;

    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "an ImageRemirrored Event",
        Duration::from_secs(20),
        || async { !events_for(&api, "web-0", "ImageRemirrored").is_empty() },
    )
    .await;
    assert!(
        r.adm.mirror().caches().has(&image).await,
        "the re-mirror recorded the image"
    );
    // The kubelet's status at web-0's retry: the failure already handled.
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        r.adm.mirror().caches().has(&image).await,
        "ImagePullBackOff after its ErrImagePull invalidated the entry"
    );
    assert_eq!(r.metric("pinswap_pull_failures_total"), 1.0);
    // Another Pod's failed pull, inside the cooldown.
    store(&api, &pull_failing(&other, "app", "ErrImagePull"));
    eventually(
        "the existence entry invalidated",
        Duration::from_secs(4),
        || async { !r.adm.mirror().caches().has(&image).await },
    )
    .await;
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0,
        "no second re-mirror in the cooldown"
    );
    r.stop().await;
}

/// The kubelet writes `ImagePullBackOff` at its retry, 10 s or more after
/// `ErrImagePull` (past the cooldown), just before the retried pull works.
/// With the source down by then, that status must start no second recovery:
/// no verifying copy, no second count, no `RemirrorFailed`.
#[tokio::test]
async fn back_off_at_the_kubelets_retry_starts_no_second_recovery() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 443).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web-0", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;

    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "an ImageRemirrored Event",
        Duration::from_secs(20),
        || async { !events_for(&api, "web-0", "ImageRemirrored").is_empty() },
    )
    .await;
    src.kill();
    // Past the cooldown, as the kubelet's 10 s back-off is.
    tokio::time::sleep(pinswap::watch::recovery::COOLDOWN + Duration::from_secs(1)).await;
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    store(&api, &running(&p));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(r.metric("pinswap_pull_failures_total"), 1.0);
    assert_eq!(r.metric("pinswap_remirrors_total{outcome=\"failed\"}"), 0.0);
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"present\"}"),
        0.0
    );
    assert!(
        events_for(&api, "web-0", "RemirrorFailed").is_empty(),
        "a RemirrorFailed Event on a Pod about to run"
    );
    r.stop().await;
}

/// The source tag moved after mirroring and a newer Pod moved the target's
/// tag with it; then the older content is lost and its Pod fails to pull.
/// Recovery mirrors the digest that Pod pins again, by digest: the target's
/// tag keeps naming the newer content.
#[tokio::test]
async fn a_pull_failure_recovery_does_not_rewind_a_tag_that_names_newer_content() {
    let (src, dst, api) = rig().await;
    let old = push(&src, "app", 981).await;
    let cfg = config(&src, &dst, "{reverify: 0s, resolutionTtl: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "old", &old, &dst).await;
    let new = push_this(&src, "app", Image::oci(2, 982)).await;
    admit_and_store(&r, &api, "new", &new, &dst).await;
    assert_eq!(
        dst.head_manifest(&new.repo, "v1").await.as_deref(),
        Some(new.image.digest.as_str()),
        "the second admission moved the target's tag"
    );
    r.start(&cfg, &api);
    wait_leader(&r).await;
    // The older content is lost; the tag names the newer and stays.
    dst.delete_manifest(&old.repo, &old.image.digest).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "an ImageRemirrored Event",
        Duration::from_secs(20),
        || async { !events_for(&api, "old", "ImageRemirrored").is_empty() },
    )
    .await;
    let (bytes, _, digest) = dst
        .get_manifest(&old.repo, &old.image.digest)
        .await
        .expect("the pinned digest is back");
    assert_eq!(digest, old.image.digest);
    assert!(bytes == old.image.manifest, "byte for byte");
    assert_eq!(
        dst.head_manifest(&new.repo, "v1").await.as_deref(),
        Some(new.image.digest.as_str()),
        "recovery rewound the target's tag to the older content"
    );
    r.stop().await;
}

/// Pods of one image fail while its recovery runs (the copy held by a
/// stalled source): each joins it and gets its Event, except a Pod deleted
/// while the watch was down, which the re-list forgets: it gets none, and
/// the watcher no longer counts it a user of its image.
#[tokio::test]
async fn pods_joining_a_recovery_get_its_event_and_a_deleted_one_is_forgotten_after_a_relist() {
    joined_recovery_with_a_deleted_pod(true).await;
}

/// As above, the deletion seen as it happens (a DELETED watch event).
#[tokio::test]
async fn a_pod_deleted_while_its_recovery_runs_gets_no_event() {
    joined_recovery_with_a_deleted_pod(false).await;
}

/// Three Pods join one recovery; "deleted" goes before it ends, `unseen`
/// (found out by a re-list) or through a DELETED event.
async fn joined_recovery_with_a_deleted_pod(unseen: bool) {
    let (src, dst, api) = rig().await;
    let proxy = common::TcpCutProxy::start(&src.host()).await;
    let image = Image::random_layers(1, 1 << 20, 991);
    push_image(&src, "shop/app", Some("v1"), &image).await;
    let alone = Image::oci(1, 992);
    push_image(&src, "shop/alone", Some("v1"), &alone).await;
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {{reverify: 0s}}\n{FAST}",
        dst.host(),
        proxy.host()
    );
    let cfg = yaml_config(&yaml);
    let mut r = Replica::new(&cfg);
    let repo = format!("mirror/{}/shop/app", proxy.host().replace(':', "_"));
    let source = format!("{}/shop/app:v1", proxy.host());
    let mut pods = Vec::new();
    for name in ["first", "deleted", "last"] {
        let mut containers = vec![("app", source.as_str())];
        let other = format!("{}/shop/alone:v1", proxy.host());
        if name == "deleted" {
            containers.push(("alone", other.as_str()));
        }
        let (p, _) = admit(&r.adm, &pod("shop", name, &containers)).await;
        assert!(
            p["spec"]["containers"][0]["image"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{}/{repo}:v1@", dst.host())),
            "{p}"
        );
        store(&api, &p);
        pods.push(p);
    }
    let target = |p: &Value, i: usize| {
        pinswap::reference::Reference::parse(p["spec"]["containers"][i]["image"].as_str().unwrap())
            .unwrap()
    };
    let alone_target = target(&pods[1], 1);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    let recovery = r.bg.as_ref().unwrap().recovery().unwrap().clone();
    eventually("the Pods listed", Duration::from_secs(10), || async {
        recovery.user_of(&alone_target).is_some()
    })
    .await;

    // The layer is lost; its copy from the source will stall.
    dst.delete_manifest(&repo, &image.digest).await;
    dst.delete_blob(&repo, &image.layers[0].digest).await;
    proxy.stall_after(64 * 1024);
    // One at a time, so the joins come in this order.
    for (i, p) in pods.iter().enumerate() {
        store(&api, &pull_failing(p, "app", "ErrImagePull"));
        eventually("the failure seen", Duration::from_secs(10), || async {
            r.metric("pinswap_pull_failures_total") == (i + 1) as f64
        })
        .await;
    }
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        0.0
    );

    // "deleted" goes while the watch is down; the watcher lists again.
    let lists = |api: &KubeApi| {
        api.requests()
            .iter()
            .enumerate()
            .rfind(|(_, q)| q.path == "/api/v1/pods" && !q.query.contains("watch=true"))
            .map(|(i, _)| i)
    };
    let before = lists(&api);
    if unseen {
        api.delete_pod_unseen("shop", "deleted");
        // A watch opened after a new list: the list's end was handled.
        eventually("a re-list", Duration::from_secs(20), || async {
            let requests = api.requests();
            lists(&api).is_some_and(|l| {
                Some(l) != before
                    && requests[l..]
                        .iter()
                        .any(|q| q.path == "/api/v1/pods" && q.query.contains("watch=true"))
            })
        })
        .await;
    } else {
        api.delete_pod("shop", "deleted");
        eventually("the deletion seen", Duration::from_secs(10), || async {
            recovery.user_of(&alone_target).is_none()
        })
        .await;
    }
    assert!(
        recovery.user_of(&alone_target).is_none(),
        "the deleted Pod is still counted a user of its image"
    );

    proxy.release();
    eventually("the last Pod's Event", Duration::from_secs(20), || async {
        !events_for(&api, "last", "ImageRemirrored").is_empty()
    })
    .await;
    assert_eq!(events_for(&api, "first", "ImageRemirrored").len(), 1);
    assert_eq!(events_for(&api, "last", "ImageRemirrored").len(), 1);
    // Published in join order: its Event, had it one, would be there already.
    assert!(
        events_for(&api, "deleted", "ImageRemirrored").is_empty(),
        "an Event for a Pod deleted and forgotten: {:?}",
        api.events()
    );
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    let (bytes, _, _) = dst.get_manifest(&repo, "v1").await.unwrap();
    assert!(bytes == image.manifest);
    assert!(
        dst.blob(&repo, &image.layers[0].digest).await.as_deref()
            == Some(&image.layers[0].bytes[..])
    );
    r.stop().await;
}

/// `pod` with the kubelet's pull-failure status on the `kind` container
/// `name` (`initContainers`, `ephemeralContainers`).
fn failing_in(pod: &Value, kind: &str, name: &str, reason: &str) -> Value {
    let mut pod = pod.clone();
    let image = pod["spec"][kind]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()["image"]
        .clone();
    let field = match kind {
        "initContainers" => "initContainerStatuses",
        "ephemeralContainers" => "ephemeralContainerStatuses",
        _ => "containerStatuses",
    };
    pod["status"] = serde_json::json!({
        "phase": "Pending",
        field: [{
            "name": name, "image": image, "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": "failed to pull"}}
        }]
    });
    pod
}

/// Pull failures of an init container and of an ephemeral container (added
/// by `kubectl debug` through the `ephemeralcontainers` subresource) are
/// recovered like those of a container.
#[tokio::test]
async fn pull_failures_of_init_and_ephemeral_containers_recover() {
    let (src, dst, api) = rig().await;
    let (init, app, debug) = (
        push(&src, "init", 1001).await,
        push(&src, "app", 1002).await,
        push(&src, "debug", 1003).await,
    );
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let mut p = pod("shop", "web", &[("app", &app.source)]);
    p["spec"]["initContainers"] = serde_json::json!([{"name": "init", "image": init.source}]);
    let (created, _) = admit(&r.adm, &p).await;
    let pinned = |img: &Pushed| format!("{}/{}:v1@{}", dst.host(), img.repo, img.image.digest);
    assert_eq!(created["spec"]["initContainers"][0]["image"], pinned(&init));
    store(&api, &created);
    // kubectl debug: an UPDATE of the ephemeralcontainers subresource.
    let mut debugged = created.clone();
    debugged["spec"]["ephemeralContainers"] =
        serde_json::json!([{"name": "dbg", "image": debug.source}]);
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u-2", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers",
            "name": "web", "namespace": "shop", "operation": "UPDATE",
            "userInfo": {"username": "a"}, "object": debugged, "oldObject": created,
            "dryRun": false}
    });
    let out = r
        .adm
        .review(serde_json::to_vec(&review).unwrap().into())
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&out).unwrap();
    common::review::apply_patch(&answer["response"], &mut debugged).expect("a patch");
    assert_eq!(
        debugged["spec"]["ephemeralContainers"][0]["image"],
        pinned(&debug)
    );
    store(&api, &debugged);
    r.start(&cfg, &api);
    wait_leader(&r).await;

    for (img, kind, name) in [
        (&init, "initContainers", "init"),
        (&debug, "ephemeralContainers", "dbg"),
    ] {
        prune(&dst, img).await;
        store(&api, &failing_in(&debugged, kind, name, "ErrImagePull"));
        eventually(
            &format!("{kind} image served again"),
            Duration::from_secs(20),
            || served_again(&dst, img),
        )
        .await;
    }
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        2.0
    );
    assert_eq!(r.metric("pinswap_remirrors_total{outcome=\"failed\"}"), 0.0);
    // One Event, its series counting both (the Recorder's).
    eventually("the Pod's Event", Duration::from_secs(10), || async {
        !events_for(&api, "web", "ImageRemirrored").is_empty()
    })
    .await;
    r.stop().await;
}

/// The figures in docs/benchmarks.md ("The Pod index"): `pinswap serve`'s
/// RSS once the leader's initial list of N Pods is indexed, against the same
/// process with none. Pods are spread over 20 namespaces, share 500 images,
/// and each has two containers under the target, pull secrets and a
/// ServiceAccount, as a Deployment's Pods do. Run with
/// `scripts/bench-index.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test; scripts/bench-index.sh runs it"]
async fn pod_index_memory_figures() {
    let sizes: Vec<usize> = std::env::var("BENCH_PODS")
        .unwrap_or_else(|_| "0,20000,50000,100000,200000".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("BENCH_PODS: comma-separated counts")
        })
        .collect();
    let target = "mirror.example/m";
    let mut base = None;
    for n in sizes {
        let api = KubeApi::start().await;
        for i in 0..n {
            let img = |c: &str| {
                format!(
                    "{target}/docker.io/team/app{}-{c}:v1@sha256:{:064x}",
                    i % 500,
                    i % 500
                )
            };
            let p: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("web-7d9f8c6b5-{i:06}"), "namespace": format!("team-{}", i % 20),
                    "uid": format!("00000000-0000-0000-0000-{i:012}"),
                    "labels": {"app": "web", "pod-template-hash": "7d9f8c6b5"},
                    "annotations": {"pinswap.dev/original-images": serde_json::json!({
                        "containers/app": format!("docker.io/team/app{}-app:v1", i % 500),
                        "containers/sidecar": format!("docker.io/team/app{}-sidecar:v1", i % 500),
                    }).to_string()}},
                "spec": {"containers": [{"name": "app", "image": img("app")}, {"name": "sidecar", "image": img("sidecar")}],
                    "serviceAccountName": "web", "imagePullSecrets": [{"name": "regcred"}]},
                "status": {"phase": "Running"},
            }))
            .unwrap();
            api.apply_pod(p);
        }
        let dir = tempfile::tempdir().unwrap();
        let kc = api.kubeconfig(dir.path());
        let body = format!(
            "target: {{registry: \"{target}\"}}\nsource: {{registries: [{{registry: docker.io}}]}}\n\
             cache: {{reverify: 0s}}\nidentity: {{scanRate: 0}}\n"
        );
        let env = [
            ("KUBECONFIG", kc.to_str().unwrap()),
            ("POD_NAMESPACE", "pinswap"),
        ];
        let served = common::serve::Served::start_with(&body, "", &env, None).await;
        let t = Instant::now();
        let scrape = reqwest::Client::builder().no_proxy().build().unwrap();
        let metrics = format!("http://{}/metrics", served.health);
        loop {
            let text = match scrape.get(&metrics).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(e) => panic!("no /metrics ({e}): {}", served.log_text()),
            };
            let listed = text
                .lines()
                .find_map(|l| l.strip_prefix("pinswap_watched_pods "));
            let leading = text.lines().any(|l| l == "pinswap_leader 1");
            if leading && listed == Some(n.to_string().as_str()) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(300),
                "not indexed: {listed:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let listed_in = t.elapsed();
        let lists = api
            .requests()
            .iter()
            .filter(|q| {
                q.path == "/api/v1/pods"
                    && !q.query.contains("watch=")
                    && !q.query.contains("continue=")
            })
            .count();
        assert_eq!(lists, 1, "one list, no restart in between");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss = served.status_kib("VmRSS");
        let hwm = served.status_kib("VmHWM");
        let base_rss = *base.get_or_insert(rss);
        let per_pod = match n {
            0 => String::from("-"),
            n => format!("{:.0}", (rss as f64 - base_rss as f64) * 1024.0 / n as f64),
        };
        println!(
            "pod index: {n} Pods, listed and indexed in {:.1} s, RSS {:.1} MiB (peak {:.1} MiB), {per_pod} bytes per Pod over 0 Pods",
            listed_in.as_secs_f64(),
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0,
        );
    }
}
