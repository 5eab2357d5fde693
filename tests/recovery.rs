//! Keeping rewrites true when the mirror loses an image: pull-
//! failure recovery, re-verification, `ttl: 0`, leadership and a source
//! that is down, against real registries and the in-process Kubernetes API
//! server. Pods are admitted through `Admission::review` and stored in the
//! API server; a kubelet's pull failure is published as the Pod's status.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::review::{admit, pod, pull_failing};
use common::{TestRegistry, push_image};
use k8s_openapi::api::core::v1::Pod;
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::watch::Background;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// Short Lease and retry timings so leadership and backoff play out in
/// seconds.
const FAST: &str = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
";

fn config(src: &TestRegistry, dst: &TestRegistry, cache: &str) -> Config {
    config_with(src, dst, cache, "")
}

/// As [`config`], with more `recovery` keys (indented two spaces).
fn config_with(src: &TestRegistry, dst: &TestRegistry, cache: &str, recovery: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {cache}\n{FAST}{recovery}",
        dst.host(),
        src.host()
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

/// A source and a target registry and the Kubernetes API test server.
async fn rig() -> (TestRegistry, TestRegistry, KubeApi) {
    common::init();
    (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        KubeApi::start().await,
    )
}

/// One pinswap replica: its admission handler, metrics and background work.
struct Replica {
    adm: Arc<Admission>,
    metrics: Arc<Metrics>,
    bg: Option<Background>,
}

impl Replica {
    fn new(config: &Config) -> Replica {
        let metrics = Arc::new(Metrics::new());
        let adm = Arc::new(Admission::from_config(config, metrics.clone()).unwrap());
        Replica {
            adm,
            metrics,
            bg: None,
        }
    }

    /// Starts the watcher, recovery and leader election against `api`,
    /// which from then on allows only what the install's RBAC grants.
    fn start(&mut self, config: &Config, api: &KubeApi) {
        api.authorize_install(config, pinswap::install::manifests::Tls::CertManager);
        self.bg = Some(Background::start(
            self.adm.mirror().clone(),
            config,
            Some(api.install_client()),
            CancellationToken::new(),
        ));
    }

    async fn stop(&mut self) {
        if let Some(bg) = self.bg.take() {
            bg.stop().await;
        }
    }

    fn leading(&self) -> bool {
        self.bg.as_ref().is_some_and(Background::is_leader)
    }

    /// The value of the sample whose line starts with `series` (0 if absent).
    fn metric(&self, series: &str) -> f64 {
        sample(&self.metrics.encode(), series)
    }
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// Polls `check` every 50 ms until it holds, or panics after `timeout`.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An image in `src` as `shop/<name>:v1`, and where it mirrors to.
struct Pushed {
    image: Image,
    source: String,
    repo: String,
}

async fn push(src: &TestRegistry, name: &str, seed: u64) -> Pushed {
    push_this(src, name, Image::oci(2, seed)).await
}

async fn push_this(src: &TestRegistry, name: &str, image: Image) -> Pushed {
    push_image(src, &format!("shop/{name}"), Some("v1"), &image).await;
    Pushed {
        source: format!("{}/shop/{name}:v1", src.host()),
        repo: format!("mirror/127.0.0.1_{}/shop/{name}", src.port()),
        image,
    }
}

/// Admits a one-container Pod running `image` in namespace `shop`, checks
/// it was rewritten and pinned, stores it in the API server, and returns it.
async fn admit_and_store(
    r: &Replica,
    api: &KubeApi,
    name: &str,
    img: &Pushed,
    dst: &TestRegistry,
) -> Value {
    let (patched, _) = admit(&r.adm, &pod("shop", name, &[("app", &img.source)])).await;
    let want = format!("{}/{}:v1@{}", dst.host(), img.repo, img.image.digest);
    assert_eq!(patched["spec"]["containers"][0]["image"], want.as_str());
    store(api, &patched);
    patched
}

fn store(api: &KubeApi, pod: &Value) {
    api.apply_pod(serde_json::from_value::<Pod>(pod.clone()).unwrap());
}

/// Deletes the image's manifest (and so its tag) at the target, and one of
/// its layers, as a lifecycle rule followed by garbage collection would.
async fn prune(dst: &TestRegistry, img: &Pushed) {
    dst.delete_manifest(&img.repo, &img.image.digest).await;
    dst.delete_blob(&img.repo, &img.image.layers[0].digest)
        .await;
    assert_eq!(dst.head_manifest(&img.repo, "v1").await, None, "pruned");
}

/// The target serves the image again: tag → same digest, same bytes, and
/// every layer byte-identical.
async fn served_again(dst: &TestRegistry, img: &Pushed) -> bool {
    if dst.head_manifest(&img.repo, "v1").await.as_deref() != Some(img.image.digest.as_str()) {
        return false;
    }
    for l in &img.image.layers {
        if dst.blob(&img.repo, &l.digest).await.as_deref() != Some(l.bytes.as_slice()) {
            return false;
        }
    }
    let (bytes, _, _) = dst.get_manifest(&img.repo, "v1").await.unwrap();
    bytes == img.image.manifest
}

fn events_for(api: &KubeApi, pod: &str, reason: &str) -> Vec<Value> {
    api.events()
        .into_iter()
        .filter(|e| e["reason"] == reason && e["regarding"]["name"] == pod)
        .collect()
}

/// Waits until the Pod watch is open: the watcher has listed the Pods.
async fn wait_watching(api: &KubeApi) {
    eventually("the Pod watch is open", Duration::from_secs(10), || async {
        api.open_watches() > 0
    })
    .await;
}

async fn wait_leader(r: &Replica) {
    eventually("leadership", Duration::from_secs(10), || async {
        r.leading()
    })
    .await;
}

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
    for p in &pods {
        store(&api, &pull_failing(p, "app", "ImagePullBackOff"));
    }
    eventually(
        "backoff statuses counted",
        Duration::from_secs(10),
        || async { r.metric("pinswap_pull_failures_total") == 100.0 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
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
async fn with_two_replicas_only_the_lease_holder_remirrors_and_the_other_takes_over() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 431).await;
    let other = push(&src, "other", 432).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let (mut a, mut b) = (Replica::new(&cfg), Replica::new(&cfg));
    let p = admit_and_store(&a, &api, "web", &app, &dst).await;
    let q = admit_and_store(&b, &api, "api", &other, &dst).await;
    a.start(&cfg, &api);
    b.start(&cfg, &api);
    eventually("one leader", Duration::from_secs(10), || async {
        a.leading() || b.leading()
    })
    .await;
    // Both have read the Lease since one took it: three more Lease
    // requests (retryPeriod 200ms) include a try by each.
    let lease_requests = || {
        api.requests()
            .iter()
            .filter(|q| q.path.ends_with("/leases/pinswap-leader"))
            .count()
    };
    let seen = lease_requests();
    eventually("two more tries", Duration::from_secs(10), || async {
        lease_requests() >= seen + 3
    })
    .await;
    assert!(a.leading() != b.leading(), "exactly one leader");
    let (leader, follower) = if a.leading() {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(leader.metric("pinswap_leader"), 1.0);
    assert_eq!(follower.metric("pinswap_leader"), 0.0);
    let lease = api.lease("pinswap", "pinswap-leader").expect("the Lease");
    assert!(lease.spec.unwrap().holder_identity.is_some());

    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        leader.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    assert_eq!(
        follower.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        0.0
    );
    assert_eq!(
        follower.metric("pinswap_pull_failures_total"),
        0.0,
        "the follower does not watch"
    );

    // The leader stops (releasing the Lease); the other takes over and
    // handles the next failure.
    leader.stop().await;
    eventually("the follower leads", Duration::from_secs(10), || async {
        follower.leading()
    })
    .await;
    prune(&dst, &other).await;
    store(&api, &pull_failing(&q, "app", "ErrImagePull"));
    eventually(
        "re-mirrored by the new leader",
        Duration::from_secs(20),
        || served_again(&dst, &other),
    )
    .await;
    assert_eq!(
        follower.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    follower.stop().await;
}

/// Fails every Lease read from now on (an API server partition; kube
/// retries a 503 itself, so plenty are queued) and waits for `r` to step
/// down.
async fn step_down(api: &KubeApi, r: &Replica) {
    for _ in 0..10_000 {
        api.fail_next(
            "GET",
            "/apis/coordination.k8s.io/v1/namespaces/pinswap/leases/pinswap-leader",
            503,
        );
    }
    eventually("stepped down", Duration::from_secs(5), || async {
        !r.leading()
    })
    .await;
}

/// `pinswap_nodes_without_platform` is the leader's: a replica that stops
/// leading no longer reports the nodes it saw (the alert takes the max over
/// replicas, so a stale count would keep it firing).
#[tokio::test]
async fn a_replica_that_stops_leading_reports_no_nodes() {
    let (src, dst, api) = rig().await;
    api.put_node(
        "arm",
        &[
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "arm64"),
        ],
    );
    let cfg = config_with(&src, &dst, "{reverify: 0s}", "platforms: [linux/amd64]\n");
    let mut r = Replica::new(&cfg);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually(
        "the arm64 node counted",
        Duration::from_secs(10),
        || async { r.metric("pinswap_nodes_without_platform") == 1.0 },
    )
    .await;
    step_down(&api, &r).await;
    eventually("no nodes reported", Duration::from_secs(5), || async {
        r.metric("pinswap_nodes_without_platform") == 0.0
    })
    .await;
    r.stop().await;
}

#[tokio::test]
async fn a_leader_that_cannot_renew_stops_within_the_renew_deadline() {
    let (src, dst, api) = rig().await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    step_down(&api, &r).await;
    // Seen stepped down (no earlier than it did) before the Lease record
    // let anyone else take it: its last renewTime plus its duration.
    let seen = k8s_openapi::jiff::Timestamp::now();
    let spec = api
        .lease("pinswap", "pinswap-leader")
        .and_then(|l| l.spec)
        .expect("the Lease");
    let renewed = spec.renew_time.expect("renewTime").0;
    let expires = renewed
        + k8s_openapi::jiff::SignedDuration::from_secs(
            spec.lease_duration_seconds
                .expect("leaseDurationSeconds")
                .into(),
        );
    assert!(
        seen < expires,
        "still leading at {seen}, after the Lease renewed at {renewed} expired at {expires}"
    );
    r.stop().await;
}

/// A black-hole partition: the API server accepts connections but never
/// answers (no reset, no 503). The leader must still step down on its own
/// clock, admission must go on as before, and once the API server answers
/// again the replica leads again and catches up on what it missed.
#[tokio::test]
async fn a_leader_facing_a_hanging_api_server_steps_down_and_admission_goes_on() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 445).await;
    let later = push(&src, "later", 446).await;
    let mut cfg = config(&src, &dst, "{reverify: 0s}");
    // The Pod watch alone: no workload watches beside it.
    cfg.backfill.enabled = false;
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually("the watcher watches", Duration::from_secs(10), || async {
        api.open_watches() == 1
    })
    .await;
    let lease_path = "/apis/coordination.k8s.io/v1/namespaces/pinswap/leases/pinswap-leader";
    let lease_reads = |api: &KubeApi| {
        api.requests()
            .iter()
            .filter(|q| q.method == "GET" && q.path == lease_path)
            .count()
    };

    api.black_hole(true);
    let before = lease_reads(&api);
    // Stepped down while its renewal attempts hang unanswered.
    eventually("stepped down", Duration::from_secs(10), || async {
        !r.leading()
    })
    .await;
    assert!(
        lease_reads(&api) > before,
        "the leader did not try to renew during the partition"
    );
    assert_eq!(r.metric("pinswap_leader"), 0.0);
    // Admission needs no API server: a new image is mirrored and pinned.
    admit_and_store(&r, &api, "new", &later, &dst).await;
    assert!(served_again(&dst, &later).await);
    // A pull failure while partitioned: the watch delivers nothing now.
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));

    api.black_hole(false);
    wait_leader(&r).await;
    eventually(
        "re-mirrored once the API server answers",
        Duration::from_secs(20),
        || served_again(&dst, &app),
    )
    .await;
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    r.stop().await;
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

/// Cluster-wide Pod watch requests (`watch=true`) so far.
fn pod_watches(api: &KubeApi) -> Vec<common::kube::ApiRequest> {
    api.requests()
        .into_iter()
        .filter(|q| q.path == "/api/v1/pods" && q.query.contains("watch=true"))
        .collect()
}

/// The value of `key` in a recorded request's query.
fn query_param(q: &common::kube::ApiRequest, key: &str) -> Option<String> {
    q.query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

#[tokio::test]
async fn the_watcher_survives_expired_history_and_closed_watches() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 451).await;
    let mut cfg = config(&src, &dst, "{reverify: 0s}");
    // The Pod watch alone: no workload watches beside it.
    cfg.backfill.enabled = false;
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually("the watcher watches", Duration::from_secs(10), || async {
        api.open_watches() == 1
    })
    .await;
    // The history moves past what the watch has seen (Lease renewals; no
    // Pod changes), so resuming from its resourceVersion needs that history.
    let watched: u64 = query_param(&pod_watches(&api)[0], "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    eventually(
        "a newer resourceVersion",
        Duration::from_secs(10),
        || async { api.resource_version().parse::<u64>().unwrap() > watched },
    )
    .await;
    // etcd compaction and an API server restart: the watch gets 410 Gone on
    // its resume, and must list again.
    api.expire_history();
    api.close_watches();
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "re-mirrored after the re-list",
        Duration::from_secs(20),
        || served_again(&dst, &app),
    )
    .await;
    r.stop().await;
    // The resumed watch was answered 410, and a list followed it.
    let expired = api.expired();
    assert!(
        expired
            .iter()
            .any(|q| q.path == "/api/v1/pods" && q.query.contains("watch=true")),
        "no watch was answered 410 Expired: {:?}",
        pod_watches(&api)
    );
    let requests = api.requests();
    let gone = requests
        .iter()
        .position(|q| *q == expired[0])
        .expect("the expired request was recorded");
    let relisted = requests[gone + 1..]
        .iter()
        .any(|q| q.path == "/api/v1/pods" && !q.query.contains("watch=true"));
    assert!(relisted, "no list after the 410: {:?}", &requests[gone..]);
}

/// With periodic bookmarks (as from a real API server), a closed watch is
/// resumed from the latest bookmark's resourceVersion, not the older one of
/// the list, and with no re-list; pull failures are still seen after it.
#[tokio::test]
async fn the_watcher_resumes_from_a_bookmark() {
    let (src, dst, api) = rig().await;
    api.bookmark_every(Duration::from_millis(100));
    let app = push(&src, "app", 455).await;
    let mut cfg = config(&src, &dst, "{reverify: 0s}");
    // The Pod watch alone: no workload watches beside it.
    cfg.backfill.enabled = false;
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually("the watcher watches", Duration::from_secs(10), || async {
        api.open_watches() == 1
    })
    .await;
    let first = pod_watches(&api)[0].clone();
    assert_eq!(
        query_param(&first, "allowWatchBookmarks").as_deref(),
        Some("true")
    );
    let listed: u64 = query_param(&first, "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    // Lease renewals move the global resourceVersion on (no Pod changes),
    // and a periodic bookmark carries it. Sent before the close, it is
    // delivered before the close too.
    let bookmarked = || {
        api.last_bookmark()
            .map_or(0, |rv| rv.parse::<u64>().unwrap())
    };
    eventually(
        "a bookmark past the list",
        Duration::from_secs(10),
        || async { bookmarked() > listed },
    )
    .await;
    let marked = bookmarked();
    api.close_watches();
    eventually("the watch resumed", Duration::from_secs(10), || async {
        pod_watches(&api).len() >= 2
    })
    .await;
    let resumed = pod_watches(&api)[1].clone();
    let from: u64 = query_param(&resumed, "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        from >= marked && from > listed,
        "resumed from {from}, not the bookmark's {marked} (the list's was {listed})"
    );
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    r.stop().await;
    let lists = api
        .requests()
        .iter()
        .filter(|q| q.path == "/api/v1/pods" && !q.query.contains("watch=true"))
        .count();
    assert_eq!(lists, 1, "no re-list: {:?}", api.requests());
    assert!(api.expired().is_empty(), "{:?}", api.expired());
}

#[tokio::test]
async fn a_pod_failing_before_the_replica_leads_is_seen_in_the_first_list() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 461).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
    // Started after the failure (a restart, or a new leader).
    r.start(&cfg, &api);
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    r.stop().await;
}

#[tokio::test]
async fn only_the_configured_namespaces_are_watched() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 471).await;
    let cfg = config_with(&src, &dst, "{reverify: 0s}", "  namespaces: [prod]\n");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    prune(&dst, &app).await;
    // In namespace shop, which is not watched.
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(r.metric("pinswap_pull_failures_total"), 0.0);
    assert_eq!(dst.head_manifest(&app.repo, "v1").await, None);
    // The same Pod in prod is.
    let mut q = p.clone();
    q["metadata"]["namespace"] = "prod".into();
    store(&api, &pull_failing(&q, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    assert!(
        api.requests().iter().all(|q| q.path != "/api/v1/pods"),
        "no cluster-wide list or watch"
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

// Found by a review that tried to break recovery; each failed before its fix.

fn yaml_config(yaml: &str) -> Config {
    Config::from_yaml(yaml, "review.yaml").unwrap()
}

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

/// How leader A loses the API server.
#[derive(Clone, Copy, Debug)]
enum Partition {
    /// Connections reset, new ones refused.
    Reset,
    /// Connections stay open and new ones are accepted, but nothing is
    /// answered (a black hole).
    Hang,
}

/// A valid Lease config (retryPeriod < renewDeadline < duration) with
/// renewDeadline + retryPeriod > duration: a partitioned leader must still
/// stop before its Lease expires and another replica leads.
#[tokio::test]
async fn a_partitioned_leader_stops_before_the_next_one_leads() {
    partitioned_leader_stops_before_the_next_one_leads(Partition::Reset).await;
}

/// As above, with a partition that answers nothing rather than resetting:
/// A's renewals hang, and A must step down on its own clock.
#[tokio::test]
async fn a_leader_behind_a_black_hole_stops_before_the_next_one_leads() {
    partitioned_leader_stops_before_the_next_one_leads(Partition::Hang).await;
}

async fn partitioned_leader_stops_before_the_next_one_leads(partition: Partition) {
    let (src, dst, api) = rig().await;
    let lease = "recovery:\n  lease: {duration: 2s, renewDeadline: 1900ms, retryPeriod: 1800ms}\n";
    let yaml = |lease: &str| {
        format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncache: {{reverify: 0s}}\n{lease}",
            dst.host(),
            src.host()
        )
    };
    let cfg_a = yaml_config(&yaml(lease));
    // B: the same Lease, polling often (equivalently: B's poll happened to
    // land right after A's last renewal).
    let cfg_b = yaml_config(&yaml(
        "recovery:\n  lease: {duration: 2s, renewDeadline: 1900ms, retryPeriod: 100ms}\n",
    ));
    let proxy = common::TcpCutProxy::start(api.url().trim_start_matches("http://")).await;
    let mut kc = ::kube::Config::new(format!("http://{}", proxy.host()).parse().unwrap());
    kc.default_namespace = "default".into();
    let client_a = ::kube::Client::try_from(kc).unwrap();
    let (ra, rb) = (Replica::new(&cfg_a), Replica::new(&cfg_b));
    let a = Background::start(
        ra.adm.mirror().clone(),
        &cfg_a,
        Some(client_a),
        CancellationToken::new(),
    );
    eventually("A leads", Duration::from_secs(10), || async {
        a.is_leader()
    })
    .await;
    let b = Background::start(
        rb.adm.mirror().clone(),
        &cfg_b,
        Some(api.client()),
        CancellationToken::new(),
    );
    // Cut A right after one of its renewals.
    let renew = |api: &KubeApi| {
        api.lease("default", "pinswap-leader")
            .and_then(|l| l.spec?.renew_time)
            .map(|t| t.0)
    };
    let first = renew(&api);
    eventually("A renews", Duration::from_secs(5), || async {
        renew(&api) != first
    })
    .await;
    let holder = |api: &KubeApi| {
        api.lease("default", "pinswap-leader")
            .and_then(|l| l.spec?.holder_identity)
    };
    let a_holder = holder(&api).expect("A holds the Lease");
    match partition {
        Partition::Reset => proxy.cut(),
        Partition::Hang => proxy.black_hole(true),
    }
    let start = Instant::now();
    let mut both = None;
    let mut b_led = false;
    while start.elapsed() < Duration::from_secs(6) {
        if a.is_leader() && b.is_leader() {
            both = Some(start.elapsed());
            break;
        }
        b_led |= b.is_leader();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (a_leads, b_leads) = (a.is_leader(), b.is_leader());
    let b_holder = holder(&api);
    b.stop().await;
    drop(a);
    assert!(
        both.is_none(),
        "two leaders at once, {:?} after A was cut off ({partition:?}; A {a_leads}, B {b_leads})",
        both
    );
    assert!(
        !a_leads,
        "A still leads 6 s into the partition ({partition:?})"
    );
    // And the other one does lead: B took the Lease over from A.
    assert!(b_led, "B never led after A was cut off");
    assert!(
        b_holder.as_ref().is_some_and(|h| *h != a_holder),
        "the Lease still names {a_holder} ({b_holder:?})"
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

/// A pull failure that arrives in the cooldown after a recovery starts no
/// second re-mirror, but still invalidates the existence entry, so admission
/// asks the target again instead of answering "present" from the cache for
/// a manifest the kubelet just failed to pull.
#[tokio::test]
async fn a_pull_failure_in_the_cooldown_still_invalidates_the_existence_entry() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 441).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web-0", &app, &dst).await;
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
    // The kubelet's next status, inside the cooldown.
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
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
