//! Retention against a real kube-apiserver: `pinswap serve` with the
//! install's ServiceAccount looks for the ConfigMap an earlier install kept
//! its record in, as the install's RBAC grants (no 403 in the audit log),
//! keeps its record at the target, removes the image no Pod uses and keeps
//! the one a Pod does.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Rig, images, no_forbidden, pod};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams};

const CONFIG: &str = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
retention: {enabled: true, unusedFor: 2s, interval: 1s}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_keeps_its_record_at_the_target_and_removes_only_the_unused() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "retain01", CONFIG).await;
    let used = rig.push("used", "v1", 901).await;
    let unused = rig.push("unused", "v1", 902).await;
    let stored = rig
        .create(pod("runs", &[("app", &rig.source("used:v1"))], &[]))
        .await
        .unwrap();
    assert_eq!(
        images(&stored, "containers"),
        [format!("{}:v1@{}", rig.mirrored("used"), used.digest)]
    );
    let gone = rig
        .create(pod("gone", &[("app", &rig.source("unused:v1"))], &[]))
        .await
        .unwrap();
    assert_eq!(
        images(&gone, "containers"),
        [format!("{}:v1@{}", rig.mirrored("unused"), unused.digest)]
    );
    rig.pods()
        .delete("gone", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let repo = |name: &str| format!("mirror/127.0.0.1_{}/{name}", rig.src.port());

    let t = Instant::now();
    while rig
        .dst
        .head_manifest(&repo("unused"), &unused.digest)
        .await
        .is_some()
    {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the unused image was not removed; log:\n{}",
            rig.served().log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        rig.dst.head_manifest(&repo("used"), "v1").await.as_deref(),
        Some(used.digest.as_str()),
        "the Pod's image stays"
    );
    // The record is at the target, the ConfigMap never written.
    let cms: Api<ConfigMap> = Api::namespaced(rig.client.clone(), &rig.install.namespace);
    assert!(cms.get_opt("pinswap-retention").await.unwrap().is_none());
    let records = "mirror/pinswap-usage";
    let (bytes, _, _) = rig
        .dst
        .get_manifest(records, &pinswap::retention::record_tag(None))
        .await
        .expect("the retention record at the target");
    let manifest: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let mut keys = Vec::new();
    for l in manifest["layers"].as_array().unwrap() {
        let blob = rig
            .dst
            .blob(records, l["digest"].as_str().unwrap())
            .await
            .unwrap();
        let shard = pinswap::retention::shards::parse(&blob).unwrap();
        keys.extend(shard.in_use.into_iter().chain(shard.last.into_keys()));
    }
    let key = format!("{}@{}", rig.mirrored("used"), used.digest);
    assert!(keys.contains(&key), "{keys:?}");
    assert!(
        rig.served()
            .log_text()
            .contains("retention removed an unused image"),
        "logged"
    );
    no_forbidden(cluster, &rig);
}
