//! pinswap's own Pods under a kubelet: leadership moves when the leader's
//! Pod is deleted, recovery follows it, and a rolling update of pinswap's
//! Deployment under a steady stream of Pod creations loses no admission.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::node::{NodeRig, Via, deployment, forget_images, push_runnable, until, wait_running};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

async fn holder(client: &kube::Client, ns: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases
        .get_opt("pinswap-leader")
        .await
        .unwrap()?
        .spec?
        .holder_identity
        // POD_NAME, then a suffix of its own.
        .map(|h| h.split('_').next().unwrap_or_default().to_owned())
}

/// Deleting the leader's Pod moves the Lease to the other replica, which
/// then does the recovery work: a Pod that fails to pull a lost image runs
/// again without anyone touching it.
#[tokio::test]
async fn the_lease_and_recovery_move_when_the_leaders_pod_is_deleted() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let rig = NodeRig::start(c, "lead", Via::Manifests, 2, "", "").await;
    let ns = rig.install.namespace.clone();
    until("a leader", Duration::from_secs(60), || async {
        holder(&rig.client, &ns).await.is_some()
    })
    .await;
    let first = holder(&rig.client, &ns).await.unwrap();
    let names: Vec<String> = rig
        .install
        .pods(c)
        .await
        .into_iter()
        .map(|p| p.metadata.name.unwrap())
        .collect();
    assert!(names.contains(&first), "{first} is not one of {names:?}");
    let ours: Api<Pod> = Api::namespaced(rig.client.clone(), &ns);
    let moved = Instant::now();
    ours.delete(&first, &DeleteParams::default()).await.unwrap();
    // The other replica or the Pod replacing the deleted one: whichever
    // took the Lease first once the leader released it on SIGTERM.
    let leader = loop {
        if let Some(h) = holder(&rig.client, &ns).await {
            let live = rig
                .install
                .pods(c)
                .await
                .iter()
                .any(|p| p.metadata.name.as_deref() == Some(h.as_str()));
            if h != first && live {
                break h;
            }
        }
        assert!(
            moved.elapsed() < Duration::from_secs(60),
            "the Lease not held by another replica after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "Lease moved from {first} to {leader} in {:.1?} (the other replica was {})",
        moved.elapsed(),
        names.iter().find(|n| **n != first).unwrap()
    );

    // Recovery on the new leader: the mirror loses the image of a Pod that
    // has to pull it again.
    let digest = push_runnable(&rig.src, "shop/lead", "v1", "lead").await;
    common::cluster::apply(
        &rig.client,
        &deployment("lead", "app", &rig.source("shop/lead:v1"), 1),
    )
    .await
    .unwrap();
    let pods = wait_running(&rig.client, "lead", "app=app", 1, Duration::from_secs(120)).await;
    let image = pods[0].spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap();
    forget_images(node, &[&image]);
    rig.dst
        .delete_manifest(&rig.mirrored_repo("shop/lead"), &digest)
        .await;
    rig.pods()
        .delete(
            pods[0].metadata.name.as_deref().unwrap(),
            &DeleteParams::default(),
        )
        .await
        .unwrap();
    let old = pods[0].metadata.name.clone().unwrap();
    until(
        "the replacement running",
        Duration::from_secs(120),
        || async {
            rig.pods()
                .list(&ListParams::default().labels("app=app"))
                .await
                .unwrap()
                .items
                .iter()
                .any(|p| p.metadata.name.as_deref() != Some(&old) && common::node::is_running(p))
        },
    )
    .await;
    // The replacement's admission reaches either replica. One whose cache
    // still says the image is there rewrites it, the kubelet's pull fails
    // and the leader recovers it; a Pod that replaced the deleted one has
    // an empty cache, so it copies the image back while admitting.
    let leader_logs = ours.logs(&leader, &Default::default()).await.unwrap();
    let mut copied_back = false;
    for p in rig.install.pods(c).await {
        let logs = ours
            .logs(p.metadata.name.as_deref().unwrap(), &Default::default())
            .await
            .unwrap_or_default();
        copied_back |= logs
            .lines()
            .any(|l| l.contains("mirrored source=") && l.contains("shop/lead"));
    }
    assert!(
        leader_logs.contains("mirrored a lost image again") || copied_back,
        "neither did the new leader recover it nor an admission copy it back:\n{leader_logs}"
    );
}

/// A rolling update of pinswap's Deployment while Pods are created at a
/// steady rate loses no admission: every Pod created is rewritten, and
/// none is created without pinswap (the webhook fails open, so a lost
/// answer would show as a Pod left on the source).
#[tokio::test]
async fn a_rolling_update_under_steady_admissions_loses_none() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let rig = NodeRig::start(c, "roll", Via::Manifests, 2, "", "").await;
    let digest = push_runnable(&rig.src, "shop/roll", "v1", "roll").await;
    let image = rig.source("shop/roll:v1");
    let want = format!(
        "{}/{}:v1@{digest}",
        rig.dst_at,
        rig.mirrored_repo("shop/roll")
    );
    let pods: Api<Pod> = Api::namespaced(rig.client.clone(), "roll");
    // Mirrored once before, so every admission has the same answer.
    let warm: Pod = serde_json::from_value(json!({
        "metadata": {"name": "warm"},
        "spec": {"containers": [{"name": "app", "image": image}]},
    }))
    .unwrap();
    let warm = pods.create(&PostParams::default(), &warm).await.unwrap();
    assert_eq!(
        warm.spec.unwrap().containers[0].image.as_deref(),
        Some(want.as_str())
    );

    let deps: Api<Deployment> = Api::namespaced(rig.client.clone(), &rig.install.namespace);
    let restart = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": "2026-12-03T00:00:00Z"}}}}});
    let started = Instant::now();
    deps.patch(
        "pinswap",
        &PatchParams::default(),
        &Patch::Strategic(restart),
    )
    .await
    .unwrap();
    // Pods at 5 a second until the rollout is done and the old Pods are
    // gone (their drain included), and 2 s more.
    let ours: Api<Pod> = Api::namespaced(rig.client.clone(), &rig.install.namespace);
    let (mut created, mut rewritten, mut left, mut failed) = (0, 0, Vec::new(), Vec::new());
    let mut done_at: Option<Instant> = None;
    let mut i = 0;
    while done_at.is_none_or(|t| t.elapsed() < Duration::from_secs(2)) {
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "the rollout did not finish"
        );
        // Admitted, never scheduled: only admission is measured.
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("p-{i}")},
            "spec": {
                "nodeSelector": {"pinswap.dev/unschedulable": "true"},
                "containers": [{"name": "app", "image": image}],
            },
        }))
        .unwrap();
        i += 1;
        match pods.create(&PostParams::default(), &p).await {
            Ok(p) => {
                created += 1;
                let got = p.spec.unwrap().containers[0].image.clone().unwrap();
                if got == want {
                    rewritten += 1;
                } else {
                    left.push(got);
                }
            }
            Err(e) => failed.push(e.to_string()),
        }
        if done_at.is_none() {
            let d = deps.get("pinswap").await.unwrap();
            let st = d.status.unwrap_or_default();
            let draining = ours
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .iter()
                .any(|p| p.metadata.deletion_timestamp.is_some());
            if d.metadata.generation == st.observed_generation
                && st.updated_replicas == Some(2)
                && st.available_replicas == Some(2)
                && st.replicas == Some(2)
                && !draining
            {
                done_at = Some(Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "rollout in {:.1?}: {created} Pods created, {rewritten} rewritten, {} left unchanged, {} refused",
        done_at.unwrap() - started,
        left.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "creations failed: {failed:?}");
    assert!(left.is_empty(), "created without pinswap: {left:?}");
    assert_eq!(rewritten, created);
    assert!(created >= 10, "too few Pods to judge: {created}");
}
