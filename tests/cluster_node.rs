//! pinswap on a real node: kube-scheduler, a kubelet, containerd 2.x and
//! runc (the cluster harness with `-node`), pinswap installed from its own
//! image as Pods by `pinswap manifests` or by the Helm chart, and what a
//! kubelet does with the Pods it rewrote: pulls from the mirror, the
//! kubelet's own `ErrImagePull` and back-off after the mirror loses an
//! image (seed 003), a source outage, an imported running set with the
//! source stopped, and pinswap's own probes and logs.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`
//! (scripts/test-cluster.sh runs both).

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::node::{
    NodeRig, Via, container_state, crictl, deployment, forget_images, is_running, push_runnable,
    wait_running,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};

fn cluster() -> &'static Cluster {
    Cluster::with_node()
}

/// The images of the Pods of `app=NAME` in `ns`, as stored.
async fn pod_images(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.list(&ListParams::default().labels(&format!("app={name}")))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            p.spec.as_ref().unwrap().containers[0]
                .image
                .clone()
                .unwrap()
        })
        .collect()
}

/// A Deployment's Pods are rewritten, scheduled by kube-scheduler, pulled by
/// containerd from the target and Running; containerd never asked the
/// source. pinswap runs as two replicas from its image, installed by
/// `pinswap manifests`; its probes pass and `kubectl logs` shows its lines.
#[tokio::test]
async fn pods_run_from_the_mirror_with_pinswap_installed_from_its_manifests() {
    let c = cluster();
    let _held = c.lock().await;
    let rig = NodeRig::start(c, "web", Via::Manifests, 2, "", "").await;
    let digest = push_runnable(&rig.src, "shop/web", "v1", "web").await;
    common::cluster::apply(
        &rig.client,
        &deployment("web", "web", &rig.source("shop/web:v1"), 2),
    )
    .await
    .unwrap();
    let pods = wait_running(&rig.client, "web", "app=web", 2, Duration::from_secs(120)).await;

    let mirrored = format!("{}/{}", rig.dst_at, rig.mirrored_repo("shop/web"));
    for p in &pods {
        let spec = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(
            spec.image.as_deref(),
            Some(format!("{mirrored}:v1@{digest}").as_str()),
            "rewritten and pinned"
        );
        assert_eq!(
            p.spec.as_ref().unwrap().node_name.as_deref(),
            Some("pinswap-node")
        );
        let st = common::node::first_status(p);
        assert!(
            st.image_id.ends_with(&digest),
            "imageID {} is the mirror's manifest",
            st.image_id
        );
    }
    // containerd pulled from the target only; pinswap's copy read the source.
    rig.assert_pulled_from_target("shop/web");
    // The mirror holds the same bytes as the source.
    assert_eq!(
        rig.dst
            .head_manifest(&rig.mirrored_repo("shop/web"), &digest)
            .await
            .as_deref(),
        Some(digest.as_str())
    );

    // pinswap under the kubelet: Ready, never restarted, its lines in
    // kubectl logs (API server → kubelet → containerd's log files).
    let ours = rig.install.pods(c).await;
    assert_eq!(ours.len(), 2);
    for p in &ours {
        let st = common::node::first_status(p);
        assert!(st.ready, "{:?} not ready", p.metadata.name);
        assert_eq!(
            st.restart_count, 0,
            "{:?} restarted (liveness)",
            p.metadata.name
        );
    }
    let logs = rig.install.logs(c).await;
    assert!(
        logs.contains("admitted"),
        "no admission in kubectl logs:\n{logs}"
    );

    // The suite's fail-open count sees a Pod the API server let through
    // unanswered: the webhook pointed at a path pinswap does not serve.
    assert_eq!(rig.failed_open(), Vec::<String>::new());
    unanswered_webhook(&rig).await;
    common::node::wait_probe(&rig.client, "web", false).await;
    let p = common::node::create_pod(
        &rig.client,
        "web",
        serde_json::json!({
            "metadata": {"name": "unanswered"},
            "spec": {"containers": [{"name": "web", "image": rig.source("shop/web:v1")}]},
        }),
    )
    .await
    .unwrap();
    assert_eq!(
        p.spec.unwrap().containers[0].image.as_deref(),
        Some(rig.source("shop/web:v1").as_str()),
        "admitted as written"
    );
    let failed = rig.failed_open();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].starts_with("create web pods/unanswered "),
        "{failed:?}"
    );
    rig.expect_fail_open("the webhook pointed at a path pinswap does not serve");
}

/// A target that DNS does not name, reached through the chart's
/// `hostAliases`: pinswap's image resolves it from the Pod's `/etc/hosts`
/// (where the kubelet writes the aliases) and copies there, and containerd
/// pulls the rewritten image through its own `hosts.toml` for that name.
#[tokio::test]
async fn a_target_named_only_by_host_aliases_is_mirrored_to_and_pulled_from() {
    let c = cluster();
    let _held = c.lock().await;
    let rig = NodeRig::start_aliased(c, "aliased", "mirror.pinswap.test").await;
    assert!(
        rig.dst_at.starts_with("mirror.pinswap.test:"),
        "{}",
        rig.dst_at
    );
    let digest = push_runnable(&rig.src, "shop/alias", "v1", "alias").await;
    let stored = common::node::create_pod(
        &rig.client,
        "aliased",
        serde_json::json!({
            "metadata": {"name": "app", "labels": {"app": "alias"}},
            "spec": {"containers": [{"name": "app", "image": rig.source("shop/alias:v1")}]},
        }),
    )
    .await
    .unwrap();
    assert_eq!(
        stored.spec.unwrap().containers[0].image.as_deref(),
        Some(
            format!(
                "{}/{}:v1@{digest}",
                rig.dst_at,
                rig.mirrored_repo("shop/alias")
            )
            .as_str()
        ),
        "rewritten to the aliased target"
    );
    wait_running(
        &rig.client,
        "aliased",
        "app=alias",
        1,
        Duration::from_secs(120),
    )
    .await;
    rig.assert_pulled_from_target("shop/alias");
    assert_eq!(
        rig.dst
            .head_manifest(&rig.mirrored_repo("shop/alias"), &digest)
            .await
            .as_deref(),
        Some(digest.as_str())
    );
}

/// Points every webhook of `rig`'s install at a path pinswap does not
/// serve: the API server's calls get 404 and, failing open, admit Pods
/// as written.
async fn unanswered_webhook(rig: &NodeRig) {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use kube::api::{Patch, PatchParams};
    let hooks: Api<MutatingWebhookConfiguration> = Api::all(rig.client.clone());
    for w in hooks.list(&ListParams::default()).await.unwrap().items {
        let ours = w.webhooks.iter().flatten().any(|h| {
            h.client_config
                .service
                .as_ref()
                .is_some_and(|s| s.namespace == rig.install.namespace)
        });
        if !ours {
            continue;
        }
        // Strategic merge: webhooks merge by name.
        let webhooks: Vec<_> = w
            .webhooks
            .iter()
            .flatten()
            .map(|h| {
                serde_json::json!({
                    "name": h.name,
                    "clientConfig": {"service": {"path": "/no-such-path"}},
                })
            })
            .collect();
        hooks
            .patch(
                w.metadata.name.as_deref().unwrap(),
                &PatchParams::default(),
                &Patch::Strategic(serde_json::json!({"webhooks": webhooks})),
            )
            .await
            .unwrap();
    }
}

/// Seed 003 on a node: the mirror loses an image; a new Pod of the
/// Deployment gets the kubelet's own `ErrImagePull`; pinswap mirrors the
/// image again from that report and the Pod runs with nobody touching it.
/// The kubelet's `ImagePullBackOff`, written at its retry, starts no second
/// recovery. Then with `recovery.evict`, the stuck Pod is evicted and its
/// controller's replacement is the Pod that runs. Both times are printed.
#[tokio::test]
async fn a_lost_image_recovers_from_the_kubelets_own_pull_failure() {
    let c = cluster();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let mut times = Vec::new();
    for evict in [false, true] {
        let name = if evict { "lost-evict" } else { "lost" };
        let recovery = if evict {
            "  evict: {enabled: true, after: 1s, perMinute: 60}\n"
        } else {
            ""
        };
        let rig = NodeRig::start(c, name, Via::Manifests, 1, recovery, "").await;
        let digest = push_runnable(&rig.src, "shop/cart", "v1", name).await;
        common::cluster::apply(
            &rig.client,
            &deployment(name, "cart", &rig.source("shop/cart:v1"), 1),
        )
        .await
        .unwrap();
        let pods = wait_running(&rig.client, name, "app=cart", 1, Duration::from_secs(120)).await;
        let image = pods[0].spec.as_ref().unwrap().containers[0]
            .image
            .clone()
            .unwrap();

        // A node that has not pulled it, and a mirror that lost it.
        forget_images(node, &[&image]);
        let lost = Instant::now();
        rig.dst
            .delete_manifest(&rig.mirrored_repo("shop/cart"), &digest)
            .await;
        let old = pods[0].metadata.name.clone().unwrap();
        rig.pods()
            .delete(&old, &DeleteParams::default())
            .await
            .unwrap();

        // The kubelet's own report, read back from the API server, per Pod.
        let pods_api = rig.pods();
        let mut seen: Vec<(String, Vec<String>)> = Vec::new();
        let t = Instant::now();
        let running = loop {
            let list = pods_api
                .list(&ListParams::default().labels("app=cart"))
                .await
                .unwrap()
                .items;
            for p in list
                .iter()
                .filter(|p| p.metadata.name.as_deref() != Some(&old))
            {
                let pod = p.metadata.name.clone().unwrap();
                let i = match seen.iter().position(|(n, _)| *n == pod) {
                    Some(i) => i,
                    None => {
                        seen.push((pod, Vec::new()));
                        seen.len() - 1
                    }
                };
                if let Some(s) = container_state(p)
                    && seen[i].1.last() != Some(&s)
                {
                    seen[i].1.push(s);
                }
            }
            if let Some(p) = list
                .iter()
                .find(|p| p.metadata.name.as_deref() != Some(&old) && is_running(p))
            {
                break p.clone();
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "no replacement running after 120 s; states {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let took = lost.elapsed();
        // The first replacement is the Pod the kubelet failed to pull for.
        let (failed, states) = &seen[0];
        assert!(
            states.iter().any(|s| s == "ErrImagePull"),
            "the kubelet never reported ErrImagePull for {failed}: {seen:?}"
        );
        let runs = running.metadata.name.as_deref().unwrap();
        if evict {
            // Its controller's replacement runs, not the Pod evicted.
            assert_ne!(runs, failed, "the failed Pod ran; states {seen:?}");
        } else {
            // Nobody touched it: the kubelet's own retry pulled the image.
            assert_eq!(runs, failed, "another Pod ran; states {seen:?}");
        }
        assert_eq!(
            running.spec.as_ref().unwrap().containers[0]
                .image
                .as_deref(),
            Some(image.as_str()),
            "the replacement runs the same pinned image"
        );
        assert_eq!(
            rig.dst
                .head_manifest(&rig.mirrored_repo("shop/cart"), &digest)
                .await
                .as_deref(),
            Some(digest.as_str()),
            "mirrored again"
        );
        let logs = rig.install.logs(c).await;
        times.push((name, took, seen.clone(), logs.clone()));
        assert!(
            logs.contains("mirrored a lost image again"),
            "no re-mirror in pinswap's logs:\n{logs}"
        );
        assert!(
            !logs.contains("the pull failure has another cause"),
            "a second recovery started from the kubelet's back-off status:\n{logs}"
        );
        let evicted = logs.lines().any(|l| {
            l.contains("evicted a Pod still in pull back-off") && l.contains(failed.as_str())
        });
        assert_eq!(
            evicted, evict,
            "eviction of {failed} in pinswap's log:\n{logs}"
        );
    }
    // How much sooner eviction is, is a benchmark's to say: printed here,
    // with pinswap's log when it was no sooner than the kubelet's retry.
    for (name, took, seen, logs) in &times {
        eprintln!("{name}: image deleted to Running in {took:.1?} (states {seen:?})");
        if *name == "lost-evict" && *took >= times[0].1 {
            eprintln!("eviction was no sooner; pinswap's log:\n{logs}");
        }
    }
}

/// The source goes down: new Pods still start, pinned to the mirror's copy.
#[tokio::test]
async fn pods_start_from_the_mirror_while_the_source_is_down() {
    let c = cluster();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let mut rig = NodeRig::start(c, "outage", Via::Manifests, 1, "", "").await;
    let digest = push_runnable(&rig.src, "shop/api", "v1", "outage").await;
    common::cluster::apply(
        &rig.client,
        &deployment("outage", "api", &rig.source("shop/api:v1"), 1),
    )
    .await
    .unwrap();
    let pods = wait_running(
        &rig.client,
        "outage",
        "app=api",
        1,
        Duration::from_secs(120),
    )
    .await;
    let image = pods[0].spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap();
    forget_images(node, &[&image]);
    rig.src.kill();

    common::cluster::apply(
        &rig.client,
        &deployment("outage", "api2", &rig.source("shop/api:v1"), 2),
    )
    .await
    .unwrap();
    let pods = wait_running(
        &rig.client,
        "outage",
        "app=api2",
        2,
        Duration::from_secs(120),
    )
    .await;
    for p in &pods {
        let got = p.spec.as_ref().unwrap().containers[0]
            .image
            .clone()
            .unwrap();
        assert!(
            got.starts_with(&rig.dst_at) && got.ends_with(&digest),
            "{got} is not the mirror's copy"
        );
    }
    assert!(crictl(node, &["images"]).contains(&rig.mirrored_repo("shop/api")));
    let _ = pod_images;
}

/// An air gap: the running set exported from another target (where the
/// clusters outside mirrored the image and their usage record lists it) is
/// imported into this cluster's target; with the source stopped, a Pod
/// naming the source's tag is pinned to the imported copy, and the kubelet
/// pulls it from the target.
#[tokio::test]
async fn pods_start_from_an_imported_running_set_with_every_source_stopped() {
    let c = cluster();
    let _held = c.lock().await;
    let mut rig = NodeRig::start(c, "airgap", Via::Manifests, 1, "", "").await;
    let digest = push_runnable(&rig.src, "shop/air", "v1", "airgap").await;
    // Outside: a target that mirrored it under the same mirror path.
    let outside = common::TestRegistry::plain().await;
    let repo = rig.mirrored_repo("shop/air");
    let (code, _, err) = common::run_pinswap(&[
        "copy",
        &format!("docker://{}/shop/air:v1", rig.src.host()),
        &format!("docker://{}/{repo}:v1", outside.host()),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    common::records::publish(&outside.host(), "outside", &[format!("{repo}@{digest}")]).await;
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("pinswap.yaml");
    std::fs::write(&config, common::records::sharing_yaml(&outside.host())).unwrap();
    let set = work.path().join("set.tar");
    let (code, out, err) = common::run_pinswap(&[
        "export",
        "-c",
        config.to_str().unwrap(),
        "--output",
        set.to_str().unwrap(),
    ])
    .await;
    assert_eq!(code, 0, "export: {out}{err}");
    drop(outside);
    let (code, out, err) = common::run_pinswap(&[
        "import",
        set.to_str().unwrap(),
        "--to",
        &format!("{}/mirror", rig.dst.host()),
    ])
    .await;
    assert_eq!(code, 0, "import: {out}{err}");

    rig.src.kill();
    common::cluster::apply(
        &rig.client,
        &deployment("airgap", "air", &rig.source("shop/air:v1"), 1),
    )
    .await
    .unwrap();
    wait_running(
        &rig.client,
        "airgap",
        "app=air",
        1,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        pod_images(&rig.client, "airgap", "air").await,
        vec![format!("{}/{repo}:v1@{digest}", rig.dst_at)]
    );
    rig.assert_pulled_from_target("shop/air");
}

/// The Helm chart, installed by Helm's engine, puts pinswap on the node
/// the same way: Pods run from the mirror.
#[tokio::test]
async fn pods_run_from_the_mirror_with_pinswap_installed_by_helm() {
    let c = cluster();
    let _held = c.lock().await;
    let rig = NodeRig::start(c, "helm", Via::Helm, 2, "", "").await;
    let digest = push_runnable(&rig.src, "shop/helm", "v1", "helm").await;
    common::cluster::apply(
        &rig.client,
        &deployment("helm", "web", &rig.source("shop/helm:v1"), 1),
    )
    .await
    .unwrap();
    wait_running(&rig.client, "helm", "app=web", 1, Duration::from_secs(120)).await;
    let images = pod_images(&rig.client, "helm", "web").await;
    assert_eq!(
        images,
        vec![format!(
            "{}/{}:v1@{digest}",
            rig.dst_at,
            rig.mirrored_repo("shop/helm")
        )]
    );
    assert_eq!(NodeRig::node_pulls(&rig.src, "shop/helm"), 0);
    let ours = rig.install.pods(c).await;
    assert_eq!(ours.len(), 2, "two replicas");
    let image = ours[0].spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap();
    assert!(
        image.contains("/pinswap:") && image.contains("@sha256:"),
        "pinswap runs from its own image by digest: {image}"
    );
}

/// pinswap's image: two builds from the same binary give the same digest;
/// it runs `/usr/local/bin/pinswap` as 65532:65532 and carries the OCI
/// labels; and under the kubelet its process runs as that user.
#[tokio::test]
async fn pinswap_image_is_reproducible_and_runs_as_nonroot() {
    // Built under the lock: two builds beside a node test would slow its
    // registries and kubelet enough to change what it sees.
    let c = cluster();
    let _held = c.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    common::node::build_image(&a);
    common::node::build_image(&b);
    let index = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p.join("index.json")).unwrap()).unwrap()
    };
    let (ia, ib) = (index(&a), index(&b));
    assert_eq!(ia, ib, "two builds, two digests");
    let blob = |d: &serde_json::Value| -> serde_json::Value {
        let d = d.as_str().unwrap().trim_start_matches("sha256:");
        serde_json::from_slice(&std::fs::read(a.join("blobs/sha256").join(d)).unwrap()).unwrap()
    };
    let manifest = blob(&ia["manifests"][0]["digest"]);
    let config = blob(&manifest["config"]["digest"]);
    // The binary under test is the machine's, and so is the image.
    let arch = std::process::Command::new("dpkg")
        .arg("--print-architecture")
        .output()
        .unwrap();
    let arch = String::from_utf8(arch.stdout).unwrap();
    assert_eq!(config["architecture"], arch.trim());
    assert_eq!(ia["manifests"][0]["platform"]["architecture"], arch.trim());
    assert_eq!(config["config"]["User"], "65532:65532");
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/usr/local/bin/pinswap"])
    );
    let labels = &config["config"]["Labels"];
    for key in [
        "title", "version", "revision", "source", "licenses", "created",
    ] {
        assert!(
            labels[format!("org.opencontainers.image.{key}")].is_string(),
            "label {key} missing: {labels}"
        );
    }

    // Running under the kubelet: the user the kubelet reports.
    let rig = NodeRig::start(c, "image", Via::Manifests, 1, "", "").await;
    let ours = rig.install.pods(c).await;
    let st = common::node::first_status(&ours[0]);
    let user = st.user.as_ref().unwrap().linux.as_ref().unwrap();
    assert_eq!((user.uid, user.gid), (65532, 65532));
    let image = ours[0].spec.as_ref().unwrap().containers[0]
        .image
        .clone()
        .unwrap();
    assert!(
        image.ends_with(ia["manifests"][0]["digest"].as_str().unwrap()),
        "{image} is not the image built here"
    );
}
