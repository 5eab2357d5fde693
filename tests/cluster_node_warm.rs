//! Pre-warmed nodes on the real node: the leader publishes the warm set
//! from its usage record, a second kubelet joins as a new, cold node with a
//! startup taint, `pinswap node-agent` pulls the set through containerd's
//! CRI image service, labels the node and removes the taint, and the Pod
//! scheduled there starts with the kubelet's "already present on machine"
//! and no pull from the mirror.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::TestRegistry;
use common::cluster::{Cluster, Install, namespace, remove_webhooks};
use common::node::{blob_gets, deployment, push_runnable_sized, until, wait_running};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;

const NS: &str = "warm";
const INSTALL_NS: &str = "pinswap-warm";
const TAINT: &str = "pinswap.dev/warming";

async fn node(client: &kube::Client, name: &str) -> Node {
    Api::<Node>::all(client.clone()).get(name).await.unwrap()
}

fn label(n: &Node, key: &str) -> Option<String> {
    n.metadata.labels.as_ref()?.get(key).cloned()
}

fn tainted(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TAINT))
}

/// The images the published warm set lists.
async fn warm_set(client: &kube::Client) -> Vec<String> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), INSTALL_NS);
    let Some(text) = cms
        .get_opt("pinswap-warm-set")
        .await
        .unwrap()
        .and_then(|c| c.data)
        .and_then(|d| d.get("warm-set.json").cloned())
    else {
        return Vec::new();
    };
    let set: serde_json::Value = serde_json::from_str(&text).unwrap();
    set["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["image"].as_str().unwrap().to_owned())
        .collect()
}

/// The kubelet's events for `pod`, as `REASON: message`.
async fn events(client: &kube::Client, pod: &str) -> Vec<String> {
    let api: Api<Event> = Api::namespaced(client.clone(), NS);
    api.list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .collect()
}

/// The agent's metrics text.
async fn metrics(addr: &str) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A new node takes its Pods warm: the leader lists the Deployment's image
/// (by digest, at the target) in the warm set; the node registers with the
/// startup taint, so the Pod waits; the agent pulls the set through CRI,
/// labels the node `pinswap.dev/warm=true` and removes the taint; the Pod
/// then starts with "already present on machine" and the mirror serves no
/// blob for it.
#[tokio::test]
async fn a_new_node_pulls_the_warm_set_before_it_takes_pods() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let info = c.node.as_ref().unwrap();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (src_at, dst_at) = (info.expose(&src).await, info.expose(&dst).await);
    let client = c.admin().await;
    remove_webhooks(&client).await;
    namespace(&client, NS, json!({})).await;
    namespace(&client, "elsewhere", json!({})).await;
    let config = format!(
        "target: {{registry: \"{dst_at}/mirror\", insecure: true}}\nsource:\n  registries: [{{registry: \"{src_at}\", insecure: true}}]\ncopyPolicy: immediate\ncopyDeadline: 2s\nprewarm: {{enabled: true, namespaces: [{NS}], startupTaint: {TAINT}, deadline: 3m}}\n"
    );
    // The agent runs on the host below: its DaemonSet's image is served by
    // no registry here.
    let install = Install::new_skipping(
        &client,
        INSTALL_NS,
        &config,
        &["--node-agent"],
        &["DaemonSet"],
    )
    .await;
    let served = install.serve(c, "warm-0").await;
    install.register(&client, &served).await;

    let digest = push_runnable_sized(&src, "shop/app", "v1", "app", 4 << 20).await;
    push_runnable_sized(&src, "shop/other", "v1", "other", 0).await;
    common::cluster::apply(
        &client,
        &deployment(NS, "app", &format!("{src_at}/shop/app:v1"), 1),
    )
    .await
    .unwrap();
    // Another namespace's image: `prewarm.namespaces` leaves it out.
    common::cluster::apply(
        &client,
        &deployment("elsewhere", "other", &format!("{src_at}/shop/other:v1"), 1),
    )
    .await
    .unwrap();
    wait_running(&client, NS, "app=app", 1, Duration::from_secs(120)).await;
    let repo = format!("mirror/{}/shop/app", src_at.replace(':', "_"));
    let mirrored = format!("{dst_at}/{repo}@{digest}");
    until(
        "the warm set lists the image",
        Duration::from_secs(90),
        || async { warm_set(&client).await.contains(&mirrored) },
    )
    .await;
    let set = warm_set(&client).await;
    assert_eq!(
        set,
        std::slice::from_ref(&mirrored),
        "only the warm namespace's image"
    );

    // A new node joins, cold and tainted; the Pod moves to it and waits.
    let new = info
        .replace("pinswap-node-2", Some(&format!("{TAINT}=true:NoSchedule")))
        .await;
    assert!(tainted(&node(&client, &new).await));
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for p in pods
        .list(&ListParams::default().labels("app=app"))
        .await
        .unwrap()
    {
        pods.delete(
            &p.metadata.name.unwrap(),
            &DeleteParams::default().grace_period(0),
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waiting = pods
        .list(&ListParams::default().labels("app=app"))
        .await
        .unwrap();
    assert!(
        waiting
            .items
            .iter()
            .all(|p| p.spec.as_ref().is_none_or(|s| s.node_name.is_none())),
        "a Pod was scheduled onto the tainted node"
    );

    let before_agent = blob_gets(&dst, &repo);
    // The agent, with its install's ServiceAccount and RBAC.
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = c
        .service_account_kubeconfig(dir.path(), INSTALL_NS, "pinswap-node-agent")
        .await;
    let config_file = dir.path().join("pinswap.yaml");
    std::fs::write(&config_file, &config).unwrap();
    let metrics_at = format!("127.0.0.1:{}", common::registry::free_port());
    let hosts = dir.path().join("certs.d");
    let mut agent = tokio::process::Command::new(common::pinswap_bin())
        .args(["node-agent", "--config"])
        .arg(&config_file)
        .arg("--dir")
        .arg(&hosts)
        .args(["--cri-endpoint", &info.containerd])
        .args(["--node-name", &new, "--namespace", INSTALL_NS])
        .args(["--metrics-address", &metrics_at])
        .env("KUBECONFIG", &kubeconfig)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    until(
        "the node is labelled warm",
        Duration::from_secs(120),
        || async {
            label(&node(&client, &new).await, "pinswap.dev/warm").as_deref() == Some("true")
        },
    )
    .await;
    let warmed = node(&client, &new).await;
    assert!(!tainted(&warmed), "the startup taint was not removed");
    let report = warmed.metadata.annotations.unwrap()["pinswap.dev/warm-report"].clone();
    assert!(
        report.starts_with("1 of 1 images on the node (1 pulled"),
        "{report}"
    );
    let m = metrics(&metrics_at).await;
    for line in [
        "pinswap_prewarm_images{state=\"pulled\"} 1",
        "pinswap_prewarm_images{state=\"listed\"} 1",
        "pinswap_prewarm_done 1",
    ] {
        assert!(m.contains(line), "{line} not in:\n{m}");
    }
    let gets = blob_gets(&dst, &repo);
    assert!(
        gets > before_agent,
        "the agent pulled nothing from the mirror"
    );

    // The Pod lands on the warm node and pulls nothing.
    let running = wait_running(&client, NS, "app=app", 1, Duration::from_secs(120)).await;
    let pod = &running[0];
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(new.as_str())
    );
    let name = pod.metadata.name.clone().unwrap();
    let seen = events(&client, &name).await;
    assert!(
        seen.iter()
            .any(|e| e.starts_with("Pulled: ") && e.contains("already present on machine")),
        "{seen:#?}"
    );
    assert!(
        !seen.iter().any(|e| e.starts_with("Pulling: ")),
        "{seen:#?}"
    );
    assert_eq!(
        blob_gets(&dst, &repo),
        gets,
        "the mirror served blobs after the pre-warm"
    );
    agent.start_kill().unwrap();
    let out = agent.wait_with_output().await.unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("the node is warm"), "{log}");
    assert!(log.contains("removed the startup taint"), "{log}");
    common::cluster::delete(&client, &deployment(NS, "app", "", 1)).await;
    common::cluster::delete(&client, &deployment("elsewhere", "other", "", 1)).await;
}
