//! Pre-warmed nodes on the real node: the leader publishes the warm set
//! from its usage record, a second kubelet joins as a new, cold node with a
//! startup taint, `pinswap node-agent` pulls the set through containerd's
//! CRI image service, labels the node and removes the taint, and the Pod
//! scheduled there starts with the kubelet's "already present on machine"
//! and no pull from the mirror.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use common::TestRegistry;
use common::cluster::{Cluster, Install, namespace, remove_webhooks};
use common::node::{blob_gets, deployment, push_runnable_sized, until, wait_running};
use common::proxy::TcpCutProxy;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;
use tokio::process::Child;

const NS: &str = "warm";
const INSTALL_NS: &str = "pinswap-warm";
const TAINT: &str = "pinswap.dev/warming";

async fn node_of(client: &kube::Client, name: &str) -> Node {
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
async fn warm_set(client: &kube::Client, install_ns: &str) -> Vec<String> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), install_ns);
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

/// Registries exposed to the node, pinswap installed (with the node
/// agent's RBAC) in `install_ns` and serving on the host, with `prewarm`
/// on for the workload namespace `ns`.
struct Warm {
    ns: &'static str,
    install_ns: &'static str,
    src: TestRegistry,
    dst: TestRegistry,
    /// In front of the target: the node's link to it, at full speed unless
    /// paced.
    link: TcpCutProxy,
    src_at: String,
    dst_at: String,
    client: kube::Client,
    config: String,
    _install: Install,
    _served: common::serve::Served,
}

impl Warm {
    /// `prewarm` keys go inside the `prewarm` mapping.
    async fn start(
        c: &'static Cluster,
        ns: &'static str,
        install_ns: &'static str,
        prewarm: &str,
    ) -> Warm {
        let info = c.node.as_ref().unwrap();
        let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
        let link = TcpCutProxy::start(&dst.host()).await;
        let (src_at, dst_at) = (
            info.expose(&src).await,
            info.expose_addr(&link.host()).await,
        );
        let client = c.admin().await;
        remove_webhooks(&client).await;
        namespace(&client, ns, json!({})).await;
        let config = format!(
            "target: {{registry: \"{dst_at}/mirror\", insecure: true}}\nsource:\n  registries: [{{registry: \"{src_at}\", insecure: true}}]\ncopyPolicy: immediate\ncopyDeadline: 2s\nprewarm: {{enabled: true, namespaces: [{ns}], {prewarm}}}\n"
        );
        // The agent runs on the host: its DaemonSet's image is served by no
        // registry here.
        let install = Install::new_skipping(
            &client,
            install_ns,
            &config,
            &["--node-agent"],
            &["DaemonSet"],
        )
        .await;
        let served = install.serve(c, "warm-0").await;
        install.register(&client, &served).await;
        Warm {
            ns,
            install_ns,
            src,
            dst,
            link,
            src_at,
            dst_at,
            client,
            config,
            _install: install,
            _served: served,
        }
    }

    /// The target repository the source's `repo` is mirrored to.
    fn mirrored_repo(&self, repo: &str) -> String {
        format!("mirror/{}/{repo}", self.src_at.replace(':', "_"))
    }

    /// `pinswap node-agent` on the host for `node`, with the install's
    /// ServiceAccount for the agent; its metrics at the returned address.
    async fn agent(&self, c: &Cluster, node: &str, dir: &Path) -> (Child, String) {
        let info = c.node.as_ref().unwrap();
        let kubeconfig = c
            .service_account_kubeconfig(dir, self.install_ns, "pinswap-node-agent")
            .await;
        let config_file = dir.join("pinswap.yaml");
        std::fs::write(&config_file, &self.config).unwrap();
        let metrics_at = format!("127.0.0.1:{}", common::registry::free_port());
        let child = tokio::process::Command::new(common::pinswap_bin())
            .args(["node-agent", "--config"])
            .arg(&config_file)
            .arg("--dir")
            .arg(dir.join("certs.d"))
            .args(["--cri-endpoint", &info.containerd])
            .args(["--node-name", node, "--namespace", self.install_ns])
            .args(["--metrics-address", &metrics_at])
            .env("KUBECONFIG", &kubeconfig)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        (child, metrics_at)
    }

    /// Waits until `node` is labelled `pinswap.dev/warm=true`.
    async fn wait_warm(&self, node: &str, limit: Duration) {
        until("the node is labelled warm", limit, || async {
            label(&node_of(&self.client, node).await, "pinswap.dev/warm").as_deref() == Some("true")
        })
        .await;
    }

    /// Waits until the warm set lists `image`.
    async fn wait_listed(&self, image: &str) {
        until(
            "the warm set lists the image",
            Duration::from_secs(90),
            || async {
                warm_set(&self.client, self.install_ns)
                    .await
                    .iter()
                    .any(|i| i == image)
            },
        )
        .await;
    }
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
    let w = Warm::start(
        c,
        NS,
        INSTALL_NS,
        &format!("startupTaint: {TAINT}, deadline: 3m"),
    )
    .await;
    let client = &w.client;
    namespace(client, "elsewhere", json!({})).await;
    let digest = push_runnable_sized(&w.src, "shop/app", "v1", "app", 4 << 20).await;
    push_runnable_sized(&w.src, "shop/other", "v1", "other", 0).await;
    let image = format!("{}/shop/app:v1", w.src_at);
    common::cluster::apply(client, &deployment(NS, "app", &image, 1))
        .await
        .unwrap();
    // Another namespace's image: `prewarm.namespaces` leaves it out.
    let other = format!("{}/shop/other:v1", w.src_at);
    common::cluster::apply(client, &deployment("elsewhere", "other", &other, 1))
        .await
        .unwrap();
    wait_running(client, NS, "app=app", 1, Duration::from_secs(120)).await;
    let repo = w.mirrored_repo("shop/app");
    let mirrored = format!("{}/{repo}@{digest}", w.dst_at);
    w.wait_listed(&mirrored).await;
    assert_eq!(
        warm_set(client, INSTALL_NS).await,
        std::slice::from_ref(&mirrored),
        "only the warm namespace's image"
    );

    // A new node joins, cold and tainted; the Pod moves to it and waits.
    let new = info
        .replace("pinswap-node-2", Some(&format!("{TAINT}=true:NoSchedule")))
        .await;
    assert!(tainted(&node_of(client, &new).await));
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let app = ListParams::default().labels("app=app");
    for p in pods.list(&app).await.unwrap() {
        let now = DeleteParams::default().grace_period(0);
        pods.delete(&p.metadata.name.unwrap(), &now).await.unwrap();
    }
    until("the Pod is made again", Duration::from_secs(30), || async {
        !pods.list(&app).await.unwrap().items.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waiting = pods.list(&app).await.unwrap();
    assert!(!waiting.items.is_empty());
    assert!(
        waiting
            .items
            .iter()
            .all(|p| p.spec.as_ref().is_none_or(|s| s.node_name.is_none())),
        "a Pod was scheduled onto the tainted node"
    );

    let before_agent = blob_gets(&w.dst, &repo);
    let dir = tempfile::tempdir().unwrap();
    let (agent, metrics_at) = w.agent(c, &new, dir.path()).await;
    w.wait_warm(&new, Duration::from_secs(120)).await;
    let warmed = node_of(client, &new).await;
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
    let gets = blob_gets(&w.dst, &repo);
    assert!(
        gets > before_agent,
        "the agent pulled nothing from the mirror"
    );

    // The Pod lands on the warm node and pulls nothing.
    let running = wait_running(client, NS, "app=app", 1, Duration::from_secs(120)).await;
    let pod = &running[0];
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(new.as_str())
    );
    let seen = events(client, pod.metadata.name.as_deref().unwrap()).await;
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
        blob_gets(&w.dst, &repo),
        gets,
        "the mirror served blobs after the pre-warm"
    );
    let log = stop(agent).await;
    assert!(log.contains("the node is warm"), "{log}");
    assert!(log.contains("removed the startup taint"), "{log}");
    common::cluster::delete(client, &deployment(NS, "app", "", 1)).await;
    common::cluster::delete(client, &deployment("elsewhere", "other", "", 1)).await;
}

/// Stops the agent; returns its log.
async fn stop(mut agent: Child) -> String {
    agent.start_kill().unwrap();
    let out = agent.wait_with_output().await.unwrap();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Apply-to-Running of a one-replica Deployment of an image of the pause
/// program and [`BENCH_DATA`] bytes, on a new node: cold, and pre-warmed by
/// the node agent, in one run. The warm set lists the image because a
/// Deployment scaled to zero names it. A benchmark, not a test:
/// `scripts/bench-warm.sh` runs it (ignored otherwise) and
/// docs/benchmarks.md holds its figures.
#[tokio::test]
#[ignore = "a benchmark: scripts/bench-warm.sh"]
async fn bench_warm_against_cold_node() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let info = c.node.as_ref().unwrap();
    let w = Warm::start(c, "warm-bench", "pinswap-warm-bench", "deadline: 5m").await;
    let client = &w.client;
    let digest = push_runnable_sized(&w.src, "bench/big", "v1", "big", BENCH_DATA).await;
    let image = format!("{}/bench/big:v1", w.src_at);
    common::cluster::apply(client, &deployment(w.ns, "seed", &image, 0))
        .await
        .unwrap();
    w.wait_listed(&format!(
        "{}/{}@{digest}",
        w.dst_at,
        w.mirrored_repo("bench/big")
    ))
    .await;
    let rounds: usize = std::env::var("PINSWAP_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    println!("image {} MiB + pause; {rounds} rounds", BENCH_DATA >> 20);
    // Loopback, where a pull costs little more than unpacking, then a
    // node-to-registry link of 1 Gbit/s.
    for (link, pace) in [("loopback", None), ("1 Gbit/s", Some(125_000_000))] {
        match pace {
            Some(bps) => w.link.pace(bps),
            None => w.link.pace_off(),
        }
        let (mut cold, mut warm, mut warming) = (vec![], vec![], vec![]);
        for round in 0..rounds {
            let case = format!("{}-{round}", pace.map_or(0, |p| p / 1_000_000));
            let node = info.replace(&format!("pinswap-cold-{case}"), None).await;
            cold.push(apply_to_running(client, w.ns, &format!("cold-{case}"), &image, &node).await);

            let node = info.replace(&format!("pinswap-warm-{case}"), None).await;
            let dir = tempfile::tempdir().unwrap();
            let (t, before) = (Instant::now(), w.link.bytes_down());
            let (agent, _) = w.agent(c, &node, dir.path()).await;
            w.wait_warm(&node, Duration::from_secs(300)).await;
            warming.push(t.elapsed());
            let down = w.link.bytes_down() - before;
            stop(agent).await;
            println!(
                "{link} round {round}: the agent pulled {:.0} MB through the link in {:.0} ms ({:.0} MB/s)",
                down as f64 / 1e6,
                ms(*warming.last().unwrap()),
                down as f64 / 1e6 / warming.last().unwrap().as_secs_f64()
            );
            warm.push(apply_to_running(client, w.ns, &format!("warm-{case}"), &image, &node).await);
        }
        let (c50, w50, p50) = (median(&mut cold), median(&mut warm), median(&mut warming));
        println!(
            "{link}: cold node apply-to-Running median {:.0} ms (all {:?}); warm node median {:.0} ms (all {:?}); warm/cold {:.3}; agent start to node warm median {:.0} ms",
            ms(c50),
            cold.iter().map(|d| ms(*d).round()).collect::<Vec<_>>(),
            ms(w50),
            warm.iter().map(|d| ms(*d).round()).collect::<Vec<_>>(),
            w50.as_secs_f64() / c50.as_secs_f64(),
            ms(p50),
        );
    }
    w.link.pace_off();
}

/// Image data for the benchmark: the size the goal names.
const BENCH_DATA: usize = 100 << 20;

/// Applies a one-replica Deployment `name` of `image` and waits until its
/// Pod runs on `node`; deletes it after.
async fn apply_to_running(
    client: &kube::Client,
    ns: &str,
    name: &str,
    image: &str,
    node: &str,
) -> Duration {
    let t = Instant::now();
    common::cluster::apply(client, &deployment(ns, name, image, 1))
        .await
        .unwrap();
    let pods = wait_running(
        client,
        ns,
        &format!("app={name}"),
        1,
        Duration::from_secs(300),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(
        pods[0].spec.as_ref().unwrap().node_name.as_deref(),
        Some(node)
    );
    common::cluster::delete(client, &deployment(ns, name, "", 1)).await;
    took
}
