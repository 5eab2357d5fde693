//! Which source a re-mirror copies from: a forged annotation is refused,
//! a moved source tag does not flip the target's tag, and a platform-filtered
//! image is recovered by another replica. Each case failed before its fix.

mod common;

use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::recovery::*;
use common::review::{admit, pod, pull_failing};
use common::{TestRegistry, push_image};
use pinswap::config::Config;

/// The `pinswap.dev/original-images` annotation is the Pod author's to
/// write. Recovery refuses it twice over, and each guard alone must hold:
/// a source outside source.registries (even one that maps to the Pod's
/// target repository), and a source in an allowed registry that maps to
/// another repository. Either way the forged digest never reaches the
/// target and the Pod gets a `RemirrorFailed` Event.
#[derive(Clone, Copy, PartialEq)]
enum Forgery {
    /// The annotation names a registry outside source.registries; the
    /// Pod's image is that source's own mirror path, so only the allowlist
    /// stands in the way.
    OutsideTheAllowlist,
    /// The annotation names an allowed registry but another repository
    /// than the one the Pod's image is under.
    AnotherRepository,
}

async fn a_forged_annotation_is_refused(forgery: Forgery, seed: u64) {
    common::init();
    let (src, evil, dst, api) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        KubeApi::start().await,
    );
    let app = push(&src, "app", seed).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    // A legitimate Pod mirrors shop/app:v1.
    admit_and_store(&r, &api, "victim", &app, &dst).await;
    let bad = Image::oci(1, seed + 1);
    let (forged_source, repo) = match forgery {
        Forgery::OutsideTheAllowlist => {
            push_image(&evil, "x/evil", Some("v1"), &bad).await;
            (
                format!("{}/x/evil:v1", evil.host()),
                format!("mirror/127.0.0.1_{}/x/evil", evil.port()),
            )
        }
        Forgery::AnotherRepository => {
            push_image(&src, "x/evil", Some("v1"), &bad).await;
            (format!("{}/x/evil:v1", src.host()), app.repo.clone())
        }
    };
    // Attacker Pod: an image already under the target (so admission leaves
    // it alone), pinned to the attacker's digest, with a forged annotation.
    let mut p = pod(
        "attackers",
        "evil",
        &[("app", &format!("{}/{repo}:v1@{}", dst.host(), bad.digest))],
    );
    p["metadata"]["annotations"] = serde_json::json!({
        "pinswap.dev/original-images":
            serde_json::json!({"containers/app": forged_source}).to_string()
    });
    let (p, _) = admit(&r.adm, &p).await;
    store(&api, &p);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually("the recovery's Event", Duration::from_secs(20), || async {
        !events_for(&api, "evil", "RemirrorFailed").is_empty()
            || !events_for(&api, "evil", "ImageRemirrored").is_empty()
    })
    .await;
    // Absent by digest from every repository of the target: the Pod's, and
    // the forged source's own mirror path among them.
    let mut repos = dst.catalog().await;
    if !repos.contains(&repo) {
        repos.push(repo.clone());
    }
    let mut holders = Vec::new();
    for repo in repos {
        if dst.head_manifest(&repo, &bad.digest).await.is_some()
            || dst.blob_exists(&repo, &bad.layers[0].digest).await
        {
            holders.push(repo);
        }
    }
    let tag_now = dst.head_manifest(&app.repo, "v1").await;
    r.stop().await;
    assert!(
        holders.is_empty(),
        "the forged image {} from {forged_source} was copied into the target at {holders:?} (the Pod names {repo})",
        bad.digest
    );
    assert_eq!(
        tag_now.as_deref(),
        Some(app.image.digest.as_str()),
        "target tag shop/app:v1 moved"
    );
    let failed = events_for(&api, "evil", "RemirrorFailed");
    assert_eq!(failed.len(), 1, "{:?}", api.events());
    assert_eq!(failed[0]["type"], "Warning");
    let note = failed[0]["note"].as_str().unwrap();
    assert!(note.contains(&bad.digest), "{note}");
    match forgery {
        Forgery::AnotherRepository => assert!(
            note.contains(&forged_source) && note.contains("does not mirror to"),
            "{note}"
        ),
        // The note says the entry was ignored, not that there was none.
        Forgery::OutsideTheAllowlist => assert!(
            note.contains(&format!(
                "the Pod's pinswap.dev/original-images entry {forged_source} was ignored"
            )),
            "{note}"
        ),
    }
    assert!(events_for(&api, "evil", "ImageRemirrored").is_empty());
}

#[tokio::test]
async fn a_forged_original_images_annotation_cannot_redirect_a_remirror() {
    a_forged_annotation_is_refused(Forgery::OutsideTheAllowlist, 901).await;
}

#[tokio::test]
async fn a_forged_original_images_annotation_cannot_name_another_repository() {
    a_forged_annotation_is_refused(Forgery::AnotherRepository, 903).await;
}

/// A source tag that moved leaves two digests in use under one target tag;
/// re-verification must not take the older one for lost and flip the tag.
#[tokio::test]
async fn a_moved_source_tag_does_not_make_reverification_flip_the_target_tag() {
    let (src, dst, api) = rig().await;
    let old = push(&src, "app", 911).await;
    let cfg = config(&src, &dst, "{reverify: 2s, resolutionTtl: 0s}");
    let mut r = Replica::new(&cfg);
    // Running (and watching) before the first re-verification round, as in
    // any long-lived deployment.
    r.start(&cfg, &api);
    wait_leader(&r).await;
    admit_and_store(&r, &api, "old", &old, &dst).await;
    // The source tag moves (a new build of app:v1), and a new Pod is admitted.
    let new = push_this(&src, "app", Image::oci(2, 912)).await;
    admit_and_store(&r, &api, "new", &new, &dst).await;
    let copies_before = r.metric("pinswap_copies_started_total");
    let reverified = |r: &Replica| {
        let text = r.metrics.encode();
        let n = |outcome| {
            common::metrics::sample(
                &text,
                "pinswap_reverifications_total",
                &[("outcome", outcome)],
            )
            .unwrap_or(0.0)
        };
        (n("present"), n("missing"), n("error"))
    };
    let (present_before, _, _) = reverified(&r);
    let mut seen = std::collections::BTreeSet::new();
    let mut flips = 0;
    let mut last = None;
    // Watch the tag for two whole rounds: each HEADs both digests (and the
    // tag, for each), so four more "present" answers.
    let start = Instant::now();
    while reverified(&r).0 < present_before + 4.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "two re-verification rounds did not run: {:?} (present, missing, error)",
            reverified(&r)
        );
        if let Some(d) = dst.head_manifest(&new.repo, "v1").await {
            if last.as_ref().is_some_and(|l| *l != d) {
                flips += 1;
            }
            last = Some(d.clone());
            seen.insert(d);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, missing, errors) = reverified(&r);
    let entries = r.adm.mirror().caches().existence_entries();
    let copies = r.metric("pinswap_copies_started_total") - copies_before;
    let remirrored = r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}");
    r.stop().await;
    assert!(
        copies == 0.0 && seen.len() == 1 && seen.contains(&new.image.digest),
        "nothing was lost, yet over two re-verification rounds: {copies} re-mirror copies, {remirrored} remirrored, {flips} tag flips between {seen:?}"
    );
    assert_eq!((missing, errors), (0.0, 0.0), "both digests are present");
    // The rounds looked at the tag too: the older digest no longer claims it.
    let tags_of = |digest: &str| {
        entries
            .iter()
            .find(|e| e.target.digest().map(|d| d.as_str()) == Some(digest))
            .map(|e| e.tags.clone())
    };
    assert_eq!(tags_of(&old.image.digest), Some(vec![]), "{entries:?}");
    assert_eq!(
        tags_of(&new.image.digest),
        Some(vec!["v1".to_owned()]),
        "{entries:?}"
    );
}

fn platform_config(src: &TestRegistry, dst: &TestRegistry) -> Config {
    yaml_config(&format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nplatforms: [linux/amd64]\nserver: {{admissionBudget: 8s}}\ncache: {{reverify: 0s}}\n{FAST}",
        dst.host(),
        src.host()
    ))
}

/// Platform filter (the mirror's digest differs from the source's), and a
/// replica that did not admit the Pod (a new leader, a restart): the source
/// is planned from the annotation's digest, even when the tag moved since.
async fn platform_filtered_recovery_by_another_replica(tag: Option<&str>, seed: u64) {
    let (src, dst, api) = rig().await;
    let idx = common::Index::oci(seed, false);
    common::push_index(&src, "shop/multi", tag, &idx).await;
    let cfg = platform_config(&src, &dst);
    let admitting = Replica::new(&cfg);
    let source = match tag {
        Some(t) => format!("{}/shop/multi:{t}@{}", src.host(), idx.digest),
        None => format!("{}/shop/multi@{}", src.host(), idx.digest),
    };
    let (p, _) = admit(&admitting.adm, &pod("shop", "web", &[("app", &source)])).await;
    let image = p["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let (name, digest) = image
        .strip_prefix(&format!("{}/", dst.host()))
        .unwrap()
        .split_once('@')
        .unwrap();
    let repo = match tag {
        Some(_) => name.rsplit_once(':').unwrap().0,
        None => name,
    };
    assert_ne!(
        digest, idx.digest,
        "the filter gives the mirror its own digest"
    );
    store(&api, &p);
    if let Some(t) = tag {
        // The tag moves upstream; the Pod still pins the first index.
        let moved = common::Index::oci(seed + 1, false);
        common::push_index(&src, "shop/multi", Some(t), &moved).await;
    }
    let mut leader = Replica::new(&cfg); // another process: empty `sources`
    leader.start(&cfg, &api);
    wait_leader(&leader).await;
    dst.delete_manifest(repo, digest).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    let back = || async { dst.head_manifest(repo, digest).await.as_deref() == Some(digest) };
    let start = Instant::now();
    while !back().await {
        let failed = events_for(&api, "web", "RemirrorFailed");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not restored; events: {:?}",
            failed.iter().map(|e| e["note"].clone()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    leader.stop().await;
}

/// Platform filter, the source down, and a digest-only Pod image whose
/// original-images entry names a tag: a replica that did not mirror it
/// cannot tell which source digest the copy was made from. That is an
/// error for the recovery to retry, not a panic of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_only_image_with_a_tag_hint_and_the_source_down_is_an_error() {
    common::init();
    let (mut src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = common::Index::oci(951, false);
    common::push_index(&src, "shop/multi", Some("v1"), &idx).await;
    let cfg = platform_config(&src, &dst);
    let admitting = Replica::new(&cfg);
    let original = format!("{}/shop/multi:v1", src.host());
    let (p, _) = admit(&admitting.adm, &pod("shop", "web", &[("app", &original)])).await;
    let image = p["spec"]["containers"][0]["image"].as_str().unwrap();
    let pinned = pinswap::reference::Reference::parse(image).unwrap();
    assert!(pinned.digest().is_some(), "{image}");
    let digest_only = pinned.without_tag();
    src.kill();
    let fresh = Replica::new(&cfg); // another process: it did not mirror it
    let hint = pinswap::reference::Reference::parse(&original).unwrap();
    let e = fresh
        .adm
        .mirror()
        .recover(
            &digest_only,
            Some(&hint),
            pinswap::cache::Cause::PullFailure,
            &[],
        )
        .await
        .expect_err("the source digest is unknown");
    assert!(
        matches!(e, pinswap::mirror::MirrorError::Resolve { .. }),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("cannot say which digest this copy was made from"),
        "{e}"
    );
}

#[tokio::test]
async fn a_platform_filtered_digest_only_image_is_recovered_by_another_replica() {
    platform_filtered_recovery_by_another_replica(None, 931).await;
}

#[tokio::test]
async fn a_platform_filtered_tag_and_digest_image_survives_a_moved_tag() {
    platform_filtered_recovery_by_another_replica(Some("v1"), 941).await;
}
