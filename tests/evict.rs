//! Eviction after a late re-mirror (`recovery.evict`): Pods a controller
//! owns that are still in the kubelet's back-off are evicted once `after`
//! has passed, within a disruption budget and `perMinute`, and not at all
//! when it is off.

mod common;

use std::time::{Duration, Instant};

use common::TestRegistry;
use common::kube::KubeApi;
use common::recovery::*;
use common::review::{admit, pod, pull_failing, running};
use k8s_openapi::api::batch::v1::Job;
use pinswap::config::Config;
use serde_json::Value;

/// `pod` as its ReplicaSet creates it: a controller owner reference.
fn owned(mut pod: Value) -> Value {
    pod["metadata"]["ownerReferences"] = serde_json::json!([{
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f7c",
        "uid": "00000000-0000-4000-8000-0000000000aa", "controller": true,
        "blockOwnerDeletion": true
    }]);
    pod
}

/// `pod` as Job `job` (stored) creates it.
fn owned_by_job(mut pod: Value, job: &Job) -> Value {
    pod["metadata"]["ownerReferences"] = serde_json::json!([{
        "apiVersion": "batch/v1", "kind": "Job",
        "name": job.metadata.name, "uid": job.metadata.uid,
        "controller": true, "blockOwnerDeletion": true
    }]);
    pod
}

/// A Job with `backoffLimit: 0`, and the given `podFailurePolicy` rules.
fn job(name: &str, rules: Option<Value>) -> Job {
    let mut spec = serde_json::json!({
        "backoffLimit": 0,
        "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "app", "image": "busybox"}]
        }}
    });
    if let Some(rules) = rules {
        spec["podFailurePolicy"] = serde_json::json!({"rules": rules});
    }
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": spec
    }))
    .unwrap()
}

/// [`config`] with `recovery.evict: EVICT`, and a source breaker that
/// lets a returning source be asked again within a second.
fn evict_config(src: &TestRegistry, dst: &TestRegistry, evict: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n  breaker: {{backoff: 500ms, maxBackoff: 1s}}\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {{reverify: 0s}}\n{FAST}  evict: {evict}\n",
        dst.host(),
        src.host()
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

/// Admits `name` (owned by a ReplicaSet when `controlled`) and stores it.
async fn admit_owned(
    r: &Replica,
    api: &KubeApi,
    name: &str,
    img: &Pushed,
    controlled: bool,
) -> Value {
    let bare = pod("shop", name, &[("app", &img.source)]);
    let p = if controlled { owned(bare) } else { bare };
    let (patched, _) = admit(&r.adm, &p).await;
    assert!(
        patched["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap()
            .contains(&img.image.digest),
        "rewritten and pinned"
    );
    store(api, &patched);
    patched
}

/// The source down when Pods first fail to pull a pruned image, so they go
/// into back-off; the source back `down_for` later; returns when the
/// image is served again and its `ImageRemirrored` Event is recorded on
/// `first`.
async fn late_remirror(
    api: &KubeApi,
    src: &mut TestRegistry,
    dst: &TestRegistry,
    img: &Pushed,
    failing: &[&Value],
    first: &str,
) {
    prune(dst, img).await;
    src.kill();
    for p in failing {
        store(api, &pull_failing(p, "app", "ErrImagePull"));
    }
    eventually(
        "a RemirrorFailed Event",
        Duration::from_secs(20),
        || async { !events_for(api, first, "RemirrorFailed").is_empty() },
    )
    .await;
}

async fn source_back(
    api: &KubeApi,
    src: &mut TestRegistry,
    dst: &TestRegistry,
    img: &Pushed,
    first: &str,
) {
    src.restart().await;
    eventually("the image served again", Duration::from_secs(30), || {
        served_again(dst, img)
    })
    .await;
    eventually(
        "an ImageRemirrored Event",
        Duration::from_secs(10),
        || async { !events_for(api, first, "ImageRemirrored").is_empty() },
    )
    .await;
}

/// The late re-mirror: a Pod with a controller that failed more than
/// `after` before it is evicted at once; one whose failure was seen later
/// is evicted when its `after` has passed (a timer); a bare Pod, a Pod
/// that pulled by itself meanwhile and a Pod failing on another image are
/// left alone.
#[tokio::test]
async fn pods_still_in_back_off_after_a_late_remirror_are_evicted_once_after_has_passed() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 441).await;
    let other = push(&src, "other", 442).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 8s}");
    let mut r = Replica::new(&cfg);
    let web = admit_owned(&r, &api, "web-0", &app, true).await;
    let solo = admit_owned(&r, &api, "solo", &app, false).await;
    let healed = admit_owned(&r, &api, "healed", &app, true).await;
    let late = admit_owned(&r, &api, "late", &app, true).await;
    let elsewhere = admit_owned(&r, &api, "elsewhere", &other, true).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;

    // web-0 and solo fail while the source is down, more than `after`
    // before it returns.
    late_remirror(&api, &mut src, &dst, &app, &[&web, &solo], "web-0").await;
    // A Pod failing on an image the target still has: no re-mirror of it.
    store(&api, &pull_failing(&elsewhere, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_secs(8)).await;
    // healed and late fail just before it returns: within `after`.
    for p in [&healed, &late] {
        store(&api, &pull_failing(p, "app", "ImagePullBackOff"));
    }
    eventually("both failures seen", Duration::from_secs(10), || async {
        r.metric("pinswap_pull_failures_total") >= 5.0
    })
    .await;
    source_back(&api, &mut src, &dst, &app, "web-0").await;
    // healed's kubelet retry pulls the image on its own.
    store(&api, &running(&healed));

    eventually("web-0 evicted", Duration::from_secs(10), || async {
        api.pod("shop", "web-0").is_none()
    })
    .await;
    // At the re-mirror, late's failure is younger than `after`: it stays.
    assert_eq!(api.evicted(), ["shop/web-0"], "{:?}", api.evictions());
    assert!(api.pod("shop", "late").is_some());
    let ev = events_for(&api, "web-0", "EvictedAfterRemirror");
    assert_eq!(ev.len(), 1, "{:?}", api.events());
    assert_eq!(ev[0]["type"], "Normal");
    assert_eq!(ev[0]["reportingController"], "pinswap");
    let note = ev[0]["note"].as_str().unwrap();
    assert!(note.contains(&app.image.digest), "{note}");

    // late, when its `after` has passed: a timer.
    eventually("late evicted", Duration::from_secs(15), || async {
        api.pod("shop", "late").is_none()
    })
    .await;
    assert_eq!(api.evicted(), ["shop/web-0", "shop/late"]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for name in ["solo", "healed", "elsewhere"] {
        assert!(api.pod("shop", name).is_some(), "{name} was not evicted");
        assert!(events_for(&api, name, "EvictedAfterRemirror").is_empty());
    }
    assert_eq!(api.evictions().len(), 2, "{:?}", api.evictions());
    assert_eq!(
        r.metric("pinswap_evictions_total{outcome=\"evicted\"}"),
        2.0
    );
    assert_eq!(
        r.metric("pinswap_evictions_total{outcome=\"recovered\"}"),
        1.0,
        "healed was checked once more and found running"
    );
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.stop().await;
}

/// A PodDisruptionBudget's 429 is retried later and counted; the Pod is
/// evicted once the budget allows it.
#[tokio::test]
async fn an_eviction_a_budget_refuses_is_retried_until_it_allows_it() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 443).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 0s}");
    let mut r = Replica::new(&cfg);
    let web = admit_owned(&r, &api, "web-0", &app, true).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    api.refuse_evictions(2);
    prune(&dst, &app).await;
    store(&api, &pull_failing(&web, "app", "ErrImagePull"));
    eventually("a refused eviction", Duration::from_secs(20), || async {
        !api.evictions().is_empty()
    })
    .await;
    let refused = Instant::now();
    assert_eq!(api.evictions()[0].1, 429, "{:?}", api.evictions());
    eventually("the eviction", Duration::from_secs(30), || async {
        api.pod("shop", "web-0").is_none()
    })
    .await;
    // 5 s, then 10 s more: backoff, not a tight loop.
    assert!(
        refused.elapsed() >= Duration::from_secs(14),
        "{:?} {:?}",
        refused.elapsed(),
        api.evictions()
    );
    let codes: Vec<u16> = api.evictions().iter().map(|(_, c)| *c).collect();
    assert_eq!(codes, [429, 429, 201]);
    assert_eq!(r.metric("pinswap_evictions_total{outcome=\"budget\"}"), 2.0);
    assert_eq!(
        r.metric("pinswap_evictions_total{outcome=\"evicted\"}"),
        1.0
    );
    // The Event is published after the eviction, in a task of its own.
    eventually("its Event", Duration::from_secs(5), || async {
        events_for(&api, "web-0", "EvictedAfterRemirror").len() == 1
    })
    .await;
    r.stop().await;
}

/// 100 Pods stuck on one image: no more than `perMinute` evictions in the
/// first minute; the rest wait their turn.
#[tokio::test]
async fn evictions_after_a_large_outage_are_held_to_per_minute() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 444).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 1s, perMinute: 7}");
    let mut r = Replica::new(&cfg);
    let mut pods = Vec::new();
    for i in 0..100 {
        pods.push(admit_owned(&r, &api, &format!("web-{i}"), &app, true).await);
    }
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    let failing: Vec<&Value> = pods.iter().collect();
    late_remirror(&api, &mut src, &dst, &app, &failing, "web-0").await;
    eventually("every failure seen", Duration::from_secs(10), || async {
        r.metric("pinswap_pull_failures_total") == 100.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    source_back(&api, &mut src, &dst, &app, "web-0").await;
    eventually("the first evictions", Duration::from_secs(10), || async {
        api.evicted().len() == 7
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let evicted = api.evicted();
    assert_eq!(evicted.len(), 7, "{evicted:?}");
    assert_eq!(api.evictions().len(), 7, "no request beyond the bound");
    let distinct: std::collections::HashSet<_> = evicted.iter().collect();
    assert_eq!(distinct.len(), 7);
    let left = (0..100)
        .filter(|i| api.pod("shop", &format!("web-{i}")).is_some())
        .count();
    assert_eq!(left, 93);
    let queued =
        r.bg.as_ref()
            .and_then(|b| b.recovery())
            .and_then(|rec| rec.evictor())
            .map(|e| e.queued());
    assert_eq!(queued, Some(93), "the rest wait their turn");
    r.stop().await;
}

/// Off by default: the same late re-mirror evicts nothing, and the
/// install grants no `pods/eviction`.
#[tokio::test]
async fn with_eviction_off_nothing_is_evicted_and_none_is_granted() {
    let (mut src, dst, api) = rig().await;
    let app = push(&src, "app", 445).await;
    // Off by default; and off means off, even with `after: 0s`.
    assert!(!config(&src, &dst, "{}").recovery.evict.enabled);
    let cfg = evict_config(&src, &dst, "{enabled: false, after: 0s}");
    let mut r = Replica::new(&cfg);
    let web = admit_owned(&r, &api, "web-0", &app, true).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    late_remirror(&api, &mut src, &dst, &app, &[&web], "web-0").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    source_back(&api, &mut src, &dst, &app, "web-0").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(api.evictions().is_empty(), "{:?}", api.evictions());
    assert!(
        api.forbidden().is_empty(),
        "not even tried: {:?}",
        api.forbidden()
    );
    assert!(api.pod("shop", "web-0").is_some());
    let opts = pinswap::install::manifests::Options {
        namespace: "pinswap".into(),
        replicas: 1,
        tls: pinswap::install::manifests::Tls::CertManager,
        image: "registry.example/pinswap:0".into(),
        image_pull_secrets: Vec::new(),
        config_text: String::new(),
        config: cfg.clone(),
        node_agent: None,
    };
    let rbac = serde_json::to_string(&pinswap::install::manifests::rbac(&opts).unwrap()).unwrap();
    assert!(!rbac.contains("pods/eviction"), "{rbac}");
    r.stop().await;
}

/// The target's tag moved on to newer content after the Pod was pinned (a
/// later copy of a moved source tag): the kubelet pulls the pinned digest,
/// which recovery restores without moving the tag back, so the Pod is
/// evicted; the tag keeps naming the newer content.
#[tokio::test]
async fn a_pod_pinned_to_a_digest_is_evicted_when_the_targets_tag_moved_on() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 446).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 0s}");
    let mut r = Replica::new(&cfg);
    let web = admit_owned(&r, &api, "web-0", &app, true).await;
    // Newer content under the same tag at the target.
    let newer = common::fixtures::Image::oci(2, 447);
    common::push_image(&dst, &app.repo, Some("v1"), &newer).await;
    dst.delete_manifest(&app.repo, &app.image.digest).await;
    dst.delete_blob(&app.repo, &app.image.layers[0].digest)
        .await;
    assert_eq!(
        dst.head_manifest(&app.repo, &app.image.digest).await,
        None,
        "pruned"
    );
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    store(&api, &pull_failing(&web, "app", "ErrImagePull"));
    eventually(
        "the pinned digest restored",
        Duration::from_secs(20),
        || async {
            dst.head_manifest(&app.repo, &app.image.digest)
                .await
                .as_deref()
                == Some(app.image.digest.as_str())
        },
    )
    .await;
    eventually("web-0 evicted", Duration::from_secs(20), || async {
        api.pod("shop", "web-0").is_none()
    })
    .await;
    assert_eq!(api.evicted(), ["shop/web-0"]);
    assert_eq!(
        r.metric("pinswap_evictions_total{outcome=\"not_served\"}"),
        0.0
    );
    assert_eq!(
        dst.head_manifest(&app.repo, "v1").await.as_deref(),
        Some(newer.digest.as_str()),
        "the tag still names the newer content"
    );
    r.stop().await;
}

/// The Job controller counts an evicted Pod as a failure unless its
/// `podFailurePolicy` ignores `DisruptionTarget` first: with
/// `backoffLimit: 0` an eviction would fail the Job, where the kubelet's
/// next retry pulls the image. Only the Pod of the Job whose policy
/// ignores the disruption is evicted, the Job read with the install's RBAC.
#[tokio::test]
async fn a_jobs_pod_is_evicted_only_when_the_jobs_policy_ignores_the_disruption() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 448).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 0s}");
    let mut r = Replica::new(&cfg);
    let ignore = serde_json::json!({"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]});
    let count_first =
        serde_json::json!({"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0]}});
    let jobs = [
        ("tolerant", Some(serde_json::json!([ignore]))),
        ("plain", None),
        (
            "counted-first",
            Some(serde_json::json!([count_first, ignore])),
        ),
        (
            "counted",
            Some(
                serde_json::json!([{"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]),
            ),
        ),
    ];
    let mut pods = Vec::new();
    for (name, rules) in jobs {
        let stored = api.apply_object(job(name, rules));
        let bare = pod("shop", &format!("{name}-x"), &[("app", &app.source)]);
        let (patched, _) = admit(&r.adm, &owned_by_job(bare, &stored)).await;
        store(&api, &patched);
        pods.push(patched);
    }
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    prune(&dst, &app).await;
    for p in &pods {
        store(&api, &pull_failing(p, "app", "ErrImagePull"));
    }
    eventually("tolerant-x evicted", Duration::from_secs(20), || async {
        api.pod("shop", "tolerant-x").is_none()
    })
    .await;
    eventually("each Pod looked at", Duration::from_secs(10), || async {
        r.metric("pinswap_evictions_total{outcome=\"skipped\"}")
            + r.metric("pinswap_evictions_total{outcome=\"evicted\"}")
            >= 4.0
    })
    .await;
    assert_eq!(api.evicted(), ["shop/tolerant-x"], "{:?}", api.evictions());
    for name in ["plain-x", "counted-first-x", "counted-x"] {
        assert!(api.pod("shop", name).is_some(), "{name} was not evicted");
    }
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.stop().await;
}

/// A Pod outside the webhook's scope (its namespace labelled
/// `pinswap.dev/ignore=true`) is never evicted, even when a Pod in the
/// scope brings its image back.
#[tokio::test]
async fn a_pod_outside_the_webhooks_scope_is_not_evicted() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 449).await;
    let cfg = evict_config(&src, &dst, "{enabled: true, after: 0s}");
    let mut r = Replica::new(&cfg);
    let web = admit_owned(&r, &api, "web-0", &app, true).await;
    let (quiet, _) = admit(
        &r.adm,
        &owned(pod("quiet", "web-q", &[("app", &app.source)])),
    )
    .await;
    store(&api, &quiet);
    api.apply_namespace("quiet", &[("pinswap.dev/ignore", "true")]);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    prune(&dst, &app).await;
    store(&api, &pull_failing(&quiet, "app", "ErrImagePull"));
    store(&api, &pull_failing(&web, "app", "ErrImagePull"));
    eventually("web-0 evicted", Duration::from_secs(20), || async {
        api.pod("shop", "web-0").is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(api.evicted(), ["shop/web-0"], "{:?}", api.evictions());
    assert!(api.pod("quiet", "web-q").is_some());
    assert!(events_for(&api, "web-q", "EvictedAfterRemirror").is_empty());
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.stop().await;
}
