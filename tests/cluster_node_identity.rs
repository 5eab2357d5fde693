//! What containerd makes of images on a real node: seed 000 (Spin apps
//! before Spin 2.4 share one config blob, so containerd, which keys images by
//! config digest, gives them one image ID) replayed with and without
//! pinswap's repair, read through CRI; and private images, which the kubelet
//! pulls from the mirror only for a Pod whose pull secret proves access.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::cluster::{Cluster, namespace};
use common::node::{NodeRig, Via, container_state, pulled, push_runnable, until};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

fn pod(ns: &str, name: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": image}],
        },
    })
}

async fn create(client: &kube::Client, ns: &str, p: Value) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap())
        .await
        .unwrap()
}

/// Seed 000: three Spin apps sharing one config, pulled by the kubelet
/// from the source, get one image ID in containerd; pulled from the mirror
/// with `identity.collisions: repair`, three. The apps need not run (no
/// Wasm shim here): the pulls and the IDs are what count.
#[tokio::test]
async fn shared_configs_get_one_image_id_from_the_source_and_three_repaired() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let rig = NodeRig::start(
        c,
        "spin",
        Via::Manifests,
        1,
        "",
        "identity: {collisions: repair}\n",
    )
    .await;
    let apps = common::node::push_spin_apps(&rig.src).await;
    let configs: BTreeSet<_> = apps.iter().map(|(_, i)| i.config.digest.clone()).collect();
    assert_eq!(configs.len(), 1, "the fixtures share one config");

    // Without pinswap (a namespace it ignores): the source's references.
    namespace(
        &rig.client,
        "spin-direct",
        json!({"pinswap.dev/ignore": "true"}),
    )
    .await;
    let mut direct = BTreeSet::new();
    for (i, (name, _)) in apps.iter().enumerate() {
        let image = rig.source(name);
        let p = create(
            &rig.client,
            "spin-direct",
            pod("spin-direct", &format!("app-{i}"), &image),
        )
        .await;
        assert_eq!(
            p.spec.unwrap().containers[0].image.as_deref(),
            Some(image.as_str())
        );
        direct.insert(pulled(node, &image).await);
    }
    assert_eq!(
        direct.len(),
        1,
        "three apps from the source, one image ID in containerd: {direct:?}"
    );
    assert!(direct.contains(&configs.first().unwrap().to_string()));

    // Through pinswap with repair: each Pod pinned to a repaired copy.
    let mut repaired = BTreeSet::new();
    for (i, (name, img)) in apps.iter().enumerate() {
        let asked = std::time::Instant::now();
        let p = create(
            &rig.client,
            "spin",
            pod("spin", &format!("app-{i}"), &rig.source(name)),
        )
        .await;
        let decisions = common::cluster::annotation(&p, "pinswap.dev/decisions");
        let image = p.spec.unwrap().containers[0].image.clone().unwrap();
        if !image.starts_with(&rig.dst_at) {
            // No decisions: the API server gave up on the webhook and let
            // the Pod through; pinswap's log says which step waited.
            let logs = rig.install.logs(c).await;
            panic!(
                "{name} not rewritten after {:?}: {image}: {decisions:?}\npinswap's log:\n{logs}",
                asked.elapsed()
            );
        }
        assert!(
            !image.ends_with(&img.digest),
            "{name} pinned to the unrepaired manifest"
        );
        repaired.insert(pulled(node, &image).await);
    }
    assert_eq!(
        repaired.len(),
        3,
        "three repaired apps from the mirror, three image IDs: {repaired:?}"
    );
    assert!(repaired.is_disjoint(&direct));
    // The kubelet pulled them from the target, not from the source, for
    // the namespace pinswap rewrites.
    assert!(NodeRig::node_pulls(&rig.dst, &rig.mirrored_repo("spin/hello")) > 0);
}

/// A Pod whose pull secret proves access to a private image pulls it from
/// the mirror; a Pod without one keeps the source reference, and the
/// kubelet is refused by the source, as it would be without pinswap.
#[tokio::test]
async fn private_images_come_from_the_mirror_only_for_pods_that_may_pull_them() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let src = common::TestRegistry::plain_auth("team", "s3cret").await;
    let rig = NodeRig::start_with(
        c,
        "private",
        Via::Manifests,
        1,
        "",
        "",
        "  imagePullSecrets: true\n",
        src,
        None,
    )
    .await;
    // Pushed through the registry's own credentials.
    let digest = {
        let open = common::TestRegistry::plain().await;
        let d = push_runnable(&open, "team/app", "v1", "private").await;
        let (code, _, err) = common::run_pinswap(&[
            "copy",
            "--dest-creds",
            "team:s3cret",
            &format!("docker://{}/team/app:v1", open.host()),
            &format!("docker://{}/team/app:v1", rig.src.host()),
        ])
        .await;
        assert_eq!(code, 0, "{err}");
        d
    };
    let secrets: Api<Secret> = Api::namespaced(rig.client.clone(), "private");
    let s = common::kube::dockerconfigjson_secret("team", &rig.src_at, "team", "s3cret");
    secrets.create(&PostParams::default(), &s).await.unwrap();

    let image = rig.source("team/app:v1");
    let mut with = pod("private", "with-secret", &image);
    with["spec"]["imagePullSecrets"] = json!([{"name": "team"}]);
    let with = create(&rig.client, "private", with).await;
    let rewritten = with.spec.unwrap().containers[0].image.clone().unwrap();
    assert!(
        rewritten.starts_with(&rig.dst_at) && rewritten.ends_with(&digest),
        "{rewritten}"
    );
    let without = create(&rig.client, "private", pod("private", "without", &image)).await;
    assert_eq!(
        without.spec.unwrap().containers[0].image.as_deref(),
        Some(image.as_str()),
        "the mirror never widens who can run an image"
    );

    let pods: Api<Pod> = Api::namespaced(rig.client.clone(), "private");
    until("with-secret running", Duration::from_secs(120), || {
        let pods = pods.clone();
        async move { common::node::is_running(&pods.get("with-secret").await.unwrap()) }
    })
    .await;
    until(
        "without refused by the source",
        Duration::from_secs(120),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get("without").await.unwrap();
                matches!(
                    container_state(&p).as_deref(),
                    Some("ErrImagePull" | "ImagePullBackOff")
                )
            }
        },
    )
    .await;
    let p = pods.get("without").await.unwrap();
    let msg = p.status.unwrap().container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap()
        .waiting
        .unwrap()
        .message
        .unwrap_or_default();
    assert!(
        msg.contains("authorization failed") || msg.contains("401"),
        "not refused by the source: {msg}"
    );
}
