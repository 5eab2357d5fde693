//! Keeping rewrites true against a real kube-apiserver: a kubelet's pull
//! failure reported through `pods/status`, the re-mirror and its Event, the
//! Lease between two replicas, and the Pod watch across an etcd compaction
//! and an API server restart. pinswap runs with the install's
//! ServiceAccount token, so the install's RBAC is what it has.

mod common;

use std::time::{Duration, Instant};

use common::TcpCutProxy;
use common::cluster::{Cluster, IMAGE, Rig, images, no_forbidden, pod};
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

/// The watch requests (`watch=true`) the install's ServiceAccount made, and
/// its Pod lists, in order: (is_watch, resourceVersion).
fn pod_requests(cluster: &Cluster, rig: &Rig) -> Vec<(bool, String)> {
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
            (e["verb"] == "watch", rv)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_relists_after_a_compaction_and_reconnects_after_a_restart() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "watch", FAST).await;
    let served = rig.served();
    until("the replica watches", Duration::from_secs(30), || async {
        pod_requests(cluster, &rig).iter().any(|(w, _)| *w)
    })
    .await;
    let before = pod_requests(cluster, &rig).len();
    // Compacted history and a restarted API server: the watcher's next
    // watch is from a version the server no longer has.
    cluster.compact().await;
    cluster.restart_apiserver().await;
    until(
        "a list after the restart",
        Duration::from_secs(60),
        || async {
            pod_requests(cluster, &rig)[before..]
                .iter()
                .any(|(w, _)| !*w)
        },
    )
    .await;
    until(
        "a watch after that list",
        Duration::from_secs(60),
        || async {
            let after = &pod_requests(cluster, &rig)[before..];
            let list = after.iter().position(|(w, _)| !*w);
            list.is_some_and(|i| after[i + 1..].iter().any(|(w, rv)| *w && !rv.is_empty()))
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
            .any(|(w, _)| *w)
    })
    .await;
    let ours = pod_requests(cluster, &rig)[before..].to_vec();
    let watched_from: u64 = ours.iter().find(|(w, _)| *w).unwrap().1.parse().unwrap();
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
    proxy.reset_connections();
    let t = Instant::now();
    loop {
        let ours = pod_requests(cluster, &rig)[before..].to_vec();
        let resumed = ours
            .iter()
            .filter(|(w, _)| *w)
            .any(|(_, rv)| rv.parse::<u64>().is_ok_and(|v| v > watched_from));
        if resumed {
            let lists = ours.iter().filter(|(w, _)| !*w).count();
            assert_eq!(
                lists, 1,
                "resumed from the bookmark without listing again: {ours:?}"
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
