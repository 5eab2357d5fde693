//! Image volumes (`spec.volumes[].image`) on a real node: pinswap rewrites
//! and pins a volume's reference like a container's, containerd mounts the
//! mirror's copy, and a volume the mirror lost recovers from the kubelet's
//! own report, which it writes on the containers that mount the volume.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::node::{NodeRig, Via, container_state, forget_images, is_running, push_runnable};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams};
use serde_json::{Value, json};

/// A Deployment whose Pods run `app` with the image volume `model` of
/// `volume` mounted at `/model`.
fn with_volume(ns: &str, app: &str, volume: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "infer", "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "infer"}},
            "template": {
                "metadata": {"labels": {"app": "infer"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app", "image": app, "imagePullPolicy": "IfNotPresent",
                        "volumeMounts": [{"name": "model", "mountPath": "/model", "readOnly": true}]
                    }],
                    "volumes": [{"name": "model", "image": {"reference": volume, "pullPolicy": "IfNotPresent"}}],
                },
            },
        },
    })
}

fn volume_reference(p: &Pod) -> String {
    p.spec.as_ref().unwrap().volumes.as_ref().unwrap()[0]
        .image
        .as_ref()
        .unwrap()
        .reference
        .clone()
        .unwrap()
}

/// The first Pod of `app=infer` other than `old` that runs, and the states
/// its container went through; panics after 120 s.
async fn running_replacement(rig: &NodeRig, old: &str) -> (Pod, Vec<String>) {
    let mut seen: Vec<String> = Vec::new();
    let t = Instant::now();
    loop {
        let list = rig
            .pods()
            .list(&ListParams::default().labels("app=infer"))
            .await
            .unwrap()
            .items;
        for p in list
            .iter()
            .filter(|p| p.metadata.name.as_deref() != Some(old))
        {
            if let Some(s) = container_state(p)
                && seen.last() != Some(&s)
            {
                seen.push(s);
            }
            if is_running(p) {
                return (p.clone(), seen);
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no Pod running after 120 s; states {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Pod's image volume is rewritten and pinned, containerd pulls it from
/// the target and the Pod runs with it mounted. When the mirror loses the
/// volume's image, the kubelet reports `ErrImagePull` on the container
/// that mounts it, naming the volume's reference; pinswap mirrors the
/// volume's image again (not the container's) and the replacement runs.
#[tokio::test]
async fn an_image_volume_is_pulled_from_the_mirror_and_recovers_when_lost() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let rig = NodeRig::start(c, "volumes", Via::Manifests, 1, "", "").await;
    let app = push_runnable(&rig.src, "shop/infer", "v1", "infer").await;
    let model = push_runnable(&rig.src, "data/model", "v1", "model-v1").await;
    common::cluster::apply(
        &rig.client,
        &with_volume(
            "volumes",
            &rig.source("shop/infer:v1"),
            &rig.source("data/model:v1"),
        ),
    )
    .await
    .unwrap();
    let (pod, _) = running_replacement(&rig, "").await;

    let mirrored = format!("{}/{}", rig.dst_at, rig.mirrored_repo("data/model"));
    let reference = volume_reference(&pod);
    assert_eq!(
        reference,
        format!("{mirrored}:v1@{model}"),
        "rewritten and pinned"
    );
    let decisions = common::cluster::annotation(&pod, "pinswap.dev/decisions").unwrap();
    assert!(decisions.contains("volumes/model"), "{decisions}");
    assert!(
        pod.spec.as_ref().unwrap().containers[0]
            .image
            .as_deref()
            .unwrap()
            .ends_with(&app)
    );
    // containerd mounted the target's copy and never asked the source.
    rig.assert_pulled_from_target("data/model");

    // The mirror loses the volume's image; a node that has not pulled it.
    forget_images(node, &[&reference]);
    rig.dst
        .delete_manifest(&rig.mirrored_repo("data/model"), &model)
        .await;
    let old = pod.metadata.name.clone().unwrap();
    rig.pods()
        .delete(&old, &DeleteParams::default())
        .await
        .unwrap();
    let (running, seen) = running_replacement(&rig, &old).await;
    assert!(
        seen.iter().any(|s| s == "ErrImagePull"),
        "the kubelet never reported ErrImagePull: {seen:?}"
    );
    assert_eq!(volume_reference(&running), reference);
    assert_eq!(
        rig.dst
            .head_manifest(&rig.mirrored_repo("data/model"), &model)
            .await
            .as_deref(),
        Some(model.as_str()),
        "the volume's image mirrored again"
    );
    let logs = rig.install.logs(c).await;
    assert!(
        logs.contains("mirrored a lost image again") && logs.contains("data/model"),
        "no re-mirror of the volume's image in pinswap's logs:\n{logs}"
    );
}
