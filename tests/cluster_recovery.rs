//! Keeping rewrites true against a real kube-apiserver: a kubelet's pull
//! failure reported through `pods/status`, the re-mirror and its Event, the
//! Lease between two replicas, and the Pod watch across an etcd compaction
//! and an API server restart. pinswap runs with the install's
//! ServiceAccount token, so the install's RBAC is what it has.

mod common;

use std::time::{Duration, Instant};

use common::TcpCutProxy;
use common::cluster::{Cluster, IMAGE, Rig, images, no_forbidden, pod};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// Short Lease and retry timings so leadership plays out in seconds.
const FAST: &str = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
";

async fn until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < limit, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reports through `pods/status` what a kubelet reports when it cannot
/// pull `container`'s image; the API server validates it.
async fn report_pull_failure(rig: &Rig, name: &str, container: &str, reason: &str) {
    let stored = serde_json::to_value(rig.pods().get(name).await.unwrap()).unwrap();
    let failing = common::review::pull_failing(&stored, container, reason);
    let status = json!({"status": failing["status"]});
    rig.pods()
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
}

/// Waits until the target serves `app` again, then compares its bytes
/// with the source's.
async fn remirrored(rig: &Rig, app: &common::fixtures::Image, what: &str) {
    let dst = &rig.dst;
    until(what, Duration::from_secs(30), || async {
        dst.head_manifest(&repo(rig, "app"), &app.digest)
            .await
            .as_deref()
            == Some(&*app.digest)
    })
    .await;
    let (bytes, _, _) = dst
        .get_manifest(&repo(rig, "app"), &app.digest)
        .await
        .unwrap();
    assert_eq!(bytes, app.manifest, "the same bytes as the source's");
}

fn repo(rig: &Rig, name: &str) -> String {
    format!("mirror/127.0.0.1_{}/{name}", rig.src.port())
}

async fn lease_holder(rig: &Rig) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(rig.client.clone(), &rig.install.namespace);
    leases
        .get_opt("pinswap-leader")
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
}

/// Admits a Pod using `app:v1`, deletes its manifest at the target and
/// reports the pull failure; returns the image.
async fn lose_and_fail(rig: &Rig, name: &str, seed: u64) -> common::fixtures::Image {
    let app = rig.push("app", "v1", seed).await;
    let stored = rig
        .create(pod(name, &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap();
    assert_eq!(
        images(&stored, "containers"),
        [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
    );
    rig.dst
        .delete_manifest(&repo(rig, "app"), &app.digest)
        .await;
    assert_eq!(
        rig.dst.head_manifest(&repo(rig, "app"), &app.digest).await,
        None
    );
    report_pull_failure(rig, name, "app", "ErrImagePull").await;
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_failure_reported_through_pods_status_is_remirrored_with_an_event() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "seed003", FAST).await;
    let served = rig.served();
    until("the replica leads", Duration::from_secs(30), || async {
        served.log_text().contains("leading: watching Pods")
    })
    .await;
    let app = lose_and_fail(&rig, "stuck", 20).await;
    remirrored(&rig, &app, "the image is served again").await;

    // The Event, through events.k8s.io/v1 and as `kubectl get events`
    // reads it (core/v1).
    let events: Api<Event> = Api::namespaced(rig.client.clone(), &rig.ns);
    let t = Instant::now();
    let ev = loop {
        let listed = events.list(&ListParams::default()).await.unwrap().items;
        if let Some(e) = listed
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("ImageRemirrored"))
        {
            break e;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no ImageRemirrored Event after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let regarding = ev.regarding.unwrap();
    assert_eq!(
        (regarding.kind.as_deref(), regarding.name.as_deref()),
        (Some("Pod"), Some("stuck"))
    );
    assert!(ev.note.unwrap_or_default().contains(&app.digest));
    let core: Api<CoreEvent> = Api::namespaced(rig.client.clone(), &rig.ns);
    let listed = core.list(&ListParams::default()).await.unwrap();
    assert!(
        listed
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("ImageRemirrored")
                && e.involved_object.name.as_deref() == Some("stuck")),
        "kubectl get events shows it"
    );
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_hands_the_lease_and_the_recovery_to_the_other_replica() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let mut rig = Rig::start(cluster, "leader", FAST).await;
    until("replica 0 leads", Duration::from_secs(30), || async {
        lease_holder(&rig)
            .await
            .is_some_and(|h| h.starts_with("leader-0"))
    })
    .await;
    let second = rig.install.serve(cluster, "leader-1").await;
    // Kill the leader without a chance to release the Lease.
    let mut first = rig.served.take().unwrap();
    first.child.start_kill().unwrap();
    first.child.wait().await.unwrap();
    until(
        "replica 1 takes the Lease",
        Duration::from_secs(30),
        || async {
            lease_holder(&rig)
                .await
                .is_some_and(|h| h.starts_with("leader-1"))
        },
    )
    .await;
    until("replica 1 watches", Duration::from_secs(10), || async {
        second.log_text().contains("leading: watching Pods")
    })
    .await;
    // Admission went through replica 0's URL; point the webhook at 1.
    rig.install.register(&rig.client, &second).await;
    rig.served = Some(second);
    let app = lose_and_fail(&rig, "after-handover", 21).await;
    remirrored(&rig, &app, "the new leader mirrors it again").await;
    assert!(
        rig.served()
            .log_text()
            .contains("pull failure on a target image")
    );
    no_forbidden(cluster, &rig);
}

/// A Pod request of the install's ServiceAccount.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Asked {
    /// A list (a page of one).
    List,
    /// A streamed list: a watch that sends the current Pods first
    /// (`sendInitialEvents`), then goes on as the watch.
    Streamed,
    /// A watch from a resourceVersion.
    Watch,
}

/// The Pod lists and watches the install's ServiceAccount made, in order,
/// each with the resourceVersion it asked from.
fn pod_requests(cluster: &Cluster, rig: &Rig) -> Vec<(Asked, String)> {
    cluster
        .audit_of(&rig.install.user())
        .iter()
        // A watch is audited when its response starts (it completes only
        // when it ends); a list when it completes.
        .filter(|e| e["objectRef"]["resource"] == "pods" && e["objectRef"]["subresource"].is_null())
        .filter(|e| {
            (e["verb"] == "watch" && e["stage"] == "ResponseStarted")
                || (e["verb"] == "list" && e["stage"] == "ResponseComplete")
        })
        .map(|e| {
            let uri = e["requestURI"].as_str().unwrap().to_owned();
            let rv = uri
                .split(['?', '&'])
                .find_map(|kv| kv.strip_prefix("resourceVersion="))
                .unwrap_or("")
                .to_owned();
            let asked = match (e["verb"] == "watch", uri.contains("sendInitialEvents=true")) {
                (false, _) => Asked::List,
                (true, true) => Asked::Streamed,
                (true, false) => Asked::Watch,
            };
            (asked, rv)
        })
        .collect()
}

/// Lists of either kind.
fn lists(requests: &[(Asked, String)]) -> usize {
    requests.iter().filter(|(a, _)| *a != Asked::Watch).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_relists_after_a_compaction_and_reconnects_after_a_restart() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "watch", FAST).await;
    let served = rig.served();
    until("the replica watches", Duration::from_secs(30), || async {
        pod_requests(cluster, &rig)
            .iter()
            .any(|(a, _)| *a != Asked::List)
    })
    .await;
    // kube-apiserver v1.37 streams lists (WatchList): the replica's list is
    // one watch request, no page of a list.
    let start = pod_requests(cluster, &rig);
    assert_eq!(start[0].0, Asked::Streamed, "{start:?}");
    assert!(!start.iter().any(|(a, _)| *a == Asked::List), "{start:?}");
    let before = start.len();
    // Compacted history and a restarted API server: the watcher's next
    // watch is from a version the server no longer has.
    cluster.compact().await;
    cluster.restart_apiserver().await;
    // Streamed, the list after the restart goes on as the watch.
    until(
        "a streamed list after the restart",
        Duration::from_secs(60),
        || async {
            pod_requests(cluster, &rig)[before..]
                .iter()
                .any(|(a, _)| *a == Asked::Streamed)
        },
    )
    .await;
    // The watch it runs now is live: a pull failure reported after the
    // restart is recovered.
    let app = lose_and_fail(&rig, "after-restart", 22).await;
    remirrored(&rig, &app, "mirrored again").await;
    assert!(served.log_text().contains("pull failure on a target image"));
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_watch_resumes_from_the_servers_own_bookmark_without_listing_again() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    // Watching one namespace: Pod changes elsewhere move the Pods'
    // resourceVersion on without an event for this watch, so only the
    // server's bookmarks can tell the watcher the newer version.
    let recovery = format!("{FAST}  namespaces: [bookmarks]\n");
    let mut rig = Rig::start(cluster, "bookmarks", &recovery).await;
    // This replica reaches the API server through a proxy that can close
    // its connections, as a load balancer's idle timeout does.
    drop(rig.served.take());
    let upstream = cluster.server.trim_start_matches("https://");
    let proxy = TcpCutProxy::start(upstream).await;
    let before = pod_requests(cluster, &rig).len();
    let served = rig
        .install
        .serve_via(cluster, "bookmarks-1", &format!("https://{}", proxy.host()))
        .await;
    rig.install.register(&rig.client, &served).await;
    rig.served = Some(served);
    until("the replica watches", Duration::from_secs(30), || async {
        pod_requests(cluster, &rig)[before..]
            .iter()
            .any(|(a, _)| *a != Asked::List)
    })
    .await;
    // The newest resourceVersion now: the replica's list ended at or
    // before it, so a watch from a newer one resumes from a bookmark.
    let mine: Api<Pod> = Api::namespaced(rig.client.clone(), "bookmarks");
    let watched_from: u64 = mine
        .list(&kube::api::ListParams::default().limit(1))
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap()
        .parse()
        .unwrap();
    // kube-apiserver sends a bookmark about once a minute on each watch.
    let elsewhere: Api<Pod> = Api::namespaced(rig.client.clone(), "kube-system");
    let t = Instant::now();
    let mut i = 0;
    while t.elapsed() < Duration::from_secs(70) {
        let p: Pod = serde_json::from_value(pod(
            &format!("noise-{i}"),
            &[("c", "registry.invalid/x")],
            &[],
        ))
        .unwrap();
        elsewhere.create(&PostParams::default(), &p).await.unwrap();
        elsewhere
            .delete(&format!("noise-{i}"), &Default::default())
            .await
            .unwrap();
        i += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Lists before the cut are the start's (a lease lost to a slow
    // machine lists again there); only what follows the cut is judged.
    let cut = pod_requests(cluster, &rig).len();
    proxy.reset_connections();
    let t = Instant::now();
    loop {
        let ours = pod_requests(cluster, &rig)[before..].to_vec();
        let since = pod_requests(cluster, &rig)[cut..].to_vec();
        let resumed = since
            .iter()
            .filter(|(a, _)| *a == Asked::Watch)
            .any(|(_, rv)| rv.parse::<u64>().is_ok_and(|v| v > watched_from));
        if resumed {
            assert_eq!(
                lists(&since),
                0,
                "resumed from the bookmark without listing again: since the cut {since:?}, all {ours:?}"
            );
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no watch from a version newer than {watched_from}: {ours:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And the resumed watch delivers: a pull failure is recovered.
    let app = lose_and_fail(&rig, "after-cut", 23).await;
    remirrored(&rig, &app, "mirrored again").await;
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platforms_filter_that_leaves_out_a_nodes_arch_is_reported_and_counted() {
    use k8s_openapi::api::core::v1::Node;
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(
        cluster,
        "platforms",
        &format!("platforms: [linux/amd64, linux/arm/v7]\n{FAST}"),
    )
    .await;
    let served = rig.served();
    let nodes: Api<Node> = Api::all(rig.client.clone());
    let node = |name: &str, arch: &str| -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {
            "kubernetes.io/os": "linux", "kubernetes.io/arch": arch}}}))
        .unwrap()
    };
    let gauge = || async {
        let (_, text) = served.health_get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix("pinswap_nodes_without_platform "))
            .map(str::to_owned)
    };
    for (name, arch) in [("amd-1", "amd64"), ("arm-1", "arm64"), ("arm-2", "arm64")] {
        nodes
            .create(&PostParams::default(), &node(name, arch))
            .await
            .unwrap();
    }
    until(
        "both arm64 nodes are counted",
        Duration::from_secs(30),
        || async { gauge().await.as_deref() == Some("2") },
    )
    .await;
    let warned = served.log_text();
    let line = warned
        .lines()
        .find(|l| l.contains("leaves out platforms"))
        .expect("a warning names what the filter leaves out");
    assert!(line.contains("linux/arm64"), "{line}");
    assert!(!line.contains("missing=linux/amd64"), "{line}");

    // A node of an arch the filter holds (any variant) is covered; deleting
    // the arm64 nodes clears the count and says so.
    let covered = "the platforms filter covers every node's os/arch";
    let before = served.log_text().matches(covered).count();
    nodes
        .create(&PostParams::default(), &node("arm32-1", "arm"))
        .await
        .unwrap();
    for name in ["arm-1", "arm-2"] {
        nodes.delete(name, &Default::default()).await.unwrap();
    }
    until("no node is left out", Duration::from_secs(30), || async {
        gauge().await.as_deref() == Some("0")
    })
    .await;
    until("the change is logged", Duration::from_secs(10), || async {
        served.log_text().matches(covered).count() > before
    })
    .await;
    for name in ["amd-1", "arm32-1"] {
        nodes.delete(name, &Default::default()).await.unwrap();
    }
    no_forbidden(cluster, &rig);
}

// ---- eviction after a late re-mirror (recovery.evict) --------------------

/// A source breaker that lets a returning source be asked again within a
/// second (under `source`).
const QUICK_BREAKER: &str = "  breaker: {backoff: 500ms, maxBackoff: 1s}";

fn deployment(name: &str, image: &str) -> k8s_openapi::api::apps::v1::Deployment {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": image}]}
            }
        }
    }))
    .unwrap()
}

/// The Deployment `app`'s Pods, as the API server has them.
async fn pods_of(rig: &Rig, app: &str) -> Vec<Pod> {
    let lp = ListParams::default().labels(&format!("app={app}"));
    rig.pods().list(&lp).await.unwrap().items
}

/// Creates the Deployment `name` running `app:v1` and returns its one Pod,
/// created by the ReplicaSet controller and rewritten by admission.
async fn deploy(rig: &Rig, name: &str, app: &common::fixtures::Image) -> Pod {
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(rig.client.clone(), &rig.ns);
    deployments
        .create(
            &PostParams::default(),
            &deployment(name, &rig.source(IMAGE)),
        )
        .await
        .unwrap();
    until(
        "the ReplicaSet creates a Pod",
        Duration::from_secs(30),
        || async { pods_of(rig, name).await.len() == 1 },
    )
    .await;
    let p = pods_of(rig, name).await.remove(0);
    assert_eq!(
        images(&p, "containers"),
        [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
    );
    assert!(
        p.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "ReplicaSet" && o.controller == Some(true))
    );
    p
}

/// Waits until `old` is gone and the Deployment `name` has a new Pod, and
/// returns it.
async fn replaced(rig: &Rig, name: &str, old: &Pod) -> Pod {
    let old_name = old.metadata.name.clone().unwrap();
    let t = Instant::now();
    while rig.pods().get_opt(&old_name).await.unwrap().is_some() {
        let log = rig.served().log_text();
        let said: Vec<&str> = log.lines().rev().take(25).collect();
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "the stuck Pod is not evicted after 40 s; pinswap said: {said:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    until("a replacement", Duration::from_secs(30), || async {
        pods_of(rig, name)
            .await
            .iter()
            .any(|p| p.metadata.uid != old.metadata.uid)
    })
    .await;
    pods_of(rig, name)
        .await
        .into_iter()
        .find(|p| p.metadata.uid != old.metadata.uid)
        .unwrap()
}

async fn events_with(rig: &Rig, reason: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(rig.client.clone(), &rig.ns);
    let listed = events.list(&ListParams::default()).await.unwrap().items;
    listed
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

async fn metric(rig: &Rig, series: &str) -> f64 {
    let (_, text) = rig.served().health_get("/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// The source is down at the first pull failure; once it is back and the
/// image is mirrored again, the Deployment's Pod (failing for longer than
/// `after`) is evicted, kube-controller-manager's ReplicaSet controller
/// creates a replacement, and admission rewrites it to the target. A bare
/// Pod failing on the same image is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_pod_stuck_after_a_late_remirror_is_evicted_and_replaced() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let recovery = format!("{FAST}  evict: {{enabled: true, after: 3s}}\n");
    let src = common::TestRegistry::plain().await;
    let mut rig = Rig::start_with(cluster, "evict", &recovery, QUICK_BREAKER, src).await;
    until("the replica leads", Duration::from_secs(30), || async {
        rig.served().log_text().contains("leading: watching Pods")
    })
    .await;
    let app = rig.push("app", "v1", 24).await;
    let stuck = deploy(&rig, "web", &app).await;
    let stuck_name = stuck.metadata.name.clone().unwrap();
    rig.create(pod("solo", &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap();

    rig.dst
        .delete_manifest(&repo(&rig, "app"), &app.digest)
        .await;
    rig.src.kill();
    report_pull_failure(&rig, &stuck_name, "app", "ErrImagePull").await;
    report_pull_failure(&rig, "solo", "app", "ErrImagePull").await;
    until("RemirrorFailed", Duration::from_secs(30), || async {
        !events_with(&rig, "RemirrorFailed").await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    rig.src.restart().await;
    remirrored(&rig, &app, "the image is served again").await;

    let new = replaced(&rig, "web", &stuck).await;
    assert_eq!(
        images(&new, "containers"),
        [format!("{}:v1@{}", rig.mirrored("app"), app.digest)],
        "the replacement is rewritten and pinned"
    );
    let evicted = events_with(&rig, "EvictedAfterRemirror").await;
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    let regarding = evicted[0].regarding.clone().unwrap();
    assert_eq!(regarding.name.as_deref(), Some(stuck_name.as_str()));
    assert!(evicted[0].note.clone().unwrap().contains(&app.digest));
    // The bare Pod is still there, still waiting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let solo = rig.pods().get("solo").await.unwrap();
    assert!(solo.metadata.deletion_timestamp.is_none());
    assert_eq!(
        metric(&rig, "pinswap_evictions_total{outcome=\"evicted\"}").await,
        1.0
    );
    no_forbidden(cluster, &rig);
}

/// A real PodDisruptionBudget (its status computed by the disruption
/// controller) refuses the eviction of a Pod that had run (phase Running:
/// the API server ignores budgets for Pending Pods): 429, counted, retried;
/// once the budget allows it, the Pod is evicted and replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disruption_budget_holds_the_eviction_until_it_allows_it() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let recovery = format!("{FAST}  evict: {{enabled: true, after: 0s}}\n");
    let src = common::TestRegistry::plain().await;
    let rig = Rig::start_with(cluster, "evict-pdb", &recovery, QUICK_BREAKER, src).await;
    until("the replica leads", Duration::from_secs(30), || async {
        rig.served().log_text().contains("leading: watching Pods")
    })
    .await;
    let app = rig.push("app", "v1", 25).await;
    let stuck = deploy(&rig, "web", &app).await;
    let stuck_name = stuck.metadata.name.clone().unwrap();
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(rig.client.clone(), &rig.ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    until(
        "the disruption controller computes the budget",
        Duration::from_secs(30),
        || async {
            let p = pdbs.get("web").await.unwrap();
            let st = p.status.unwrap_or_default();
            st.observed_generation == p.metadata.generation && st.expected_pods == 1
        },
    )
    .await;

    rig.dst
        .delete_manifest(&repo(&rig, "app"), &app.digest)
        .await;
    // A Pod that ran, whose container restarted and cannot pull.
    let stored = serde_json::to_value(rig.pods().get(&stuck_name).await.unwrap()).unwrap();
    let mut failing = common::review::pull_failing(&stored, "app", "ErrImagePull");
    failing["status"]["phase"] = "Running".into();
    rig.pods()
        .patch_status(
            &stuck_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": failing["status"]})),
        )
        .await
        .unwrap();
    remirrored(&rig, &app, "the image is served again").await;
    until("the budget refuses", Duration::from_secs(30), || async {
        metric(&rig, "pinswap_evictions_total{outcome=\"budget\"}").await >= 1.0
    })
    .await;
    let still = rig.pods().get(&stuck_name).await.unwrap();
    assert!(
        still.metadata.deletion_timestamp.is_none(),
        "the budget held"
    );

    // The budget now lets unhealthy Pods go.
    pdbs.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"unhealthyPodEvictionPolicy": "AlwaysAllow"}})),
    )
    .await
    .unwrap();
    let new = replaced(&rig, "web", &stuck).await;
    assert_eq!(
        images(&new, "containers"),
        [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
    );
    assert_eq!(
        metric(&rig, "pinswap_evictions_total{outcome=\"evicted\"}").await,
        1.0
    );
    assert_eq!(events_with(&rig, "EvictedAfterRemirror").await.len(), 1);
    no_forbidden(cluster, &rig);
}

/// Creates the Job `name` (one Pod running `app:v1`, `backoffLimit: 0`,
/// with `rules` as its `podFailurePolicy` when given) and returns its Pod,
/// created by the Job controller and rewritten by admission.
async fn job(rig: &Rig, name: &str, rules: Option<serde_json::Value>) -> Pod {
    let mut spec = json!({
        "backoffLimit": 0,
        "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "app", "image": rig.source(IMAGE)}]
        }}
    });
    if let Some(rules) = rules {
        spec["podFailurePolicy"] = json!({"rules": rules});
    }
    let jobs: Api<Job> = Api::namespaced(rig.client.clone(), &rig.ns);
    let j: Job = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
    jobs.create(&PostParams::default(), &j).await.unwrap();
    let lp = ListParams::default().labels(&format!("batch.kubernetes.io/job-name={name}"));
    until("the Job creates a Pod", Duration::from_secs(30), || async {
        rig.pods().list(&lp).await.unwrap().items.len() == 1
    })
    .await;
    rig.pods().list(&lp).await.unwrap().items.remove(0)
}

/// A Job's Pods stuck on a lost image: the Pod of the Job whose
/// `podFailurePolicy` ignores `DisruptionTarget` is evicted, and the real
/// Job controller replaces it without counting a failure; the Pod of the
/// Job without one (`backoffLimit: 0`: an eviction would fail it) is left
/// to the kubelet's retry, and that Job does not fail. The install's RBAC
/// lets the leader read the Jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_pod_is_evicted_only_when_its_pod_failure_policy_ignores_the_disruption() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let recovery = format!("{FAST}  evict: {{enabled: true, after: 0s}}\n");
    let src = common::TestRegistry::plain().await;
    let rig = Rig::start_with(cluster, "evict-job", &recovery, QUICK_BREAKER, src).await;
    until("the replica leads", Duration::from_secs(30), || async {
        rig.served().log_text().contains("leading: watching Pods")
    })
    .await;
    let app = rig.push("app", "v1", 26).await;
    let ignore = json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]);
    let tolerant = job(&rig, "tolerant", Some(ignore)).await;
    let plain = job(&rig, "plain", None).await;
    for p in [&tolerant, &plain] {
        assert_eq!(
            images(p, "containers"),
            [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
        );
    }
    rig.dst
        .delete_manifest(&repo(&rig, "app"), &app.digest)
        .await;
    let (tolerant_name, plain_name) = (
        tolerant.metadata.name.clone().unwrap(),
        plain.metadata.name.clone().unwrap(),
    );
    report_pull_failure(&rig, &tolerant_name, "app", "ErrImagePull").await;
    report_pull_failure(&rig, &plain_name, "app", "ErrImagePull").await;
    remirrored(&rig, &app, "the image is served again").await;

    until(
        "tolerant's Pod evicted",
        Duration::from_secs(30),
        || async { rig.pods().get_opt(&tolerant_name).await.unwrap().is_none() },
    )
    .await;
    let lp = ListParams::default().labels("batch.kubernetes.io/job-name=tolerant");
    until("a replacement", Duration::from_secs(30), || async {
        rig.pods().list(&lp).await.unwrap().items.len() == 1
    })
    .await;
    until("plain's Pod looked at", Duration::from_secs(30), || async {
        metric(&rig, "pinswap_evictions_total{outcome=\"skipped\"}").await >= 1.0
    })
    .await;
    assert!(rig.pods().get_opt(&plain_name).await.unwrap().is_some());
    let jobs: Api<Job> = Api::namespaced(rig.client.clone(), &rig.ns);
    for name in ["tolerant", "plain"] {
        let status = jobs.get(name).await.unwrap().status.unwrap_or_default();
        assert_eq!(status.failed.unwrap_or(0), 0, "{name}: {status:?}");
        assert!(
            !status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Failed" && c.status == "True"),
            "{name}: {status:?}"
        );
    }
    assert_eq!(
        metric(&rig, "pinswap_evictions_total{outcome=\"evicted\"}").await,
        1.0
    );
    no_forbidden(cluster, &rig);
}
