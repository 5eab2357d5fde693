//! Pods that must not be rewritten, on a real node: pinswap admits them
//! exactly as written (`mirrorOnly`) and copies their images, and containerd,
//! configured by `pinswap node-config`'s `hosts.toml`, pulls them from the
//! target, also while the source is down.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::cluster::Cluster;
use common::node::{NodeRig, Via, create_pod, forget_images, wait_running};
use kube::api::DeleteParams;
use serde_json::{Value, json};

/// Puts the harness's own `hosts.toml` for a host back when dropped.
struct Restore {
    file: PathBuf,
    saved: String,
}

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.file, &self.saved);
    }
}

/// The node's mirror for the rig's source, as `pinswap node-config ARGS`
/// writes it into containerd's certs.d (the harness's file for that host
/// put back when the guard drops).
async fn node_config(rig: &NodeRig, node: &common::node::NodeInfo, args: &[&str]) -> Restore {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{}/mirror\", insecure: true}}\nsource: {{registries: [{{registry: \"{}\", insecure: true}}]}}\n",
            rig.dst_at, rig.src_at
        ),
    )
    .unwrap();
    let hosts = node.certs_d.join(&rig.src_at).join("hosts.toml");
    let restore = Restore {
        saved: std::fs::read_to_string(&hosts).unwrap(),
        file: hosts.clone(),
    };
    std::fs::remove_file(&hosts).unwrap();
    let mut cmd = vec![
        "node-config",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        node.certs_d.to_str().unwrap(),
    ];
    cmd.extend_from_slice(args);
    let (code, _, err) = common::run_pinswap(&cmd).await;
    assert_eq!(code, 0, "{err}");
    let written = std::fs::read_to_string(&hosts).unwrap();
    assert!(
        written.contains(&format!("/v2/mirror/{}", rig.src_at.replace(':', "_"))),
        "{written}"
    );
    restore
}

fn pod(ns: &str, name: &str, app: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent"}]
        }
    })
}

/// A Pod `mirrorOnly` matches is stored as it was sent (no image changed,
/// no annotation), its image is copied, and containerd, with the
/// `hosts.toml` that `pinswap node-config` wrote for the source, pulls it
/// from the target: the registries' access logs show no pull at the
/// source. With the source stopped, a new Pod naming the same tag starts.
#[tokio::test]
async fn a_pod_admitted_as_written_is_pulled_from_the_mirror_by_node_config() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let mut rig = NodeRig::start(
        c,
        "asis",
        Via::Manifests,
        1,
        "",
        "mirrorOnly: {pods: [{podSelector: {matchLabels: {app: ledger}}}]}\n",
    )
    .await;
    let digest = common::node::push_runnable(&rig.src, "shop/ledger", "v1", "ledger").await;

    let _restore = node_config(&rig, node, &[]).await;

    let source = rig.source("shop/ledger:v1");
    let stored = create_pod(
        &rig.client,
        "asis",
        pod("asis", "ledger-1", "ledger", &source),
    )
    .await
    .unwrap();
    assert_eq!(
        stored.spec.as_ref().unwrap().containers[0].image.as_deref(),
        Some(source.as_str()),
        "the image as written"
    );
    let notes: Vec<String> = stored
        .metadata
        .annotations
        .unwrap_or_default()
        .into_keys()
        .filter(|k| k.starts_with("pinswap.dev/"))
        .collect();
    assert!(notes.is_empty(), "annotated: {notes:?}");
    let running = wait_running(
        &rig.client,
        "asis",
        "app=ledger",
        1,
        Duration::from_secs(120),
    )
    .await;
    let st = &running[0]
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0];
    assert!(st.image_id.ends_with(&digest), "{}", st.image_id);
    assert!(NodeRig::node_pulls(&rig.dst, &rig.mirrored_repo("shop/ledger")) > 0);
    assert_eq!(
        NodeRig::node_pulls(&rig.src, "shop/ledger"),
        0,
        "containerd asked the source:\n{}",
        rig.src.log()
    );

    // The source goes down; a new Pod naming the tag still starts.
    rig.src.kill();
    forget_images(node, &[&source]);
    rig.pods()
        .delete("ledger-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    create_pod(
        &rig.client,
        "asis",
        pod("asis", "ledger-2", "ledger", &source),
    )
    .await
    .unwrap();
    let running = wait_running(
        &rig.client,
        "asis",
        "app=ledger",
        1,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(running[0].metadata.name.as_deref(), Some("ledger-2"));
}
