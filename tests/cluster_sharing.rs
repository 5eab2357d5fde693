//! Several clusters, one mirror, against real kube-apiservers: two control
//! planes from the harness (two processes), each with pinswap installed by
//! `pinswap manifests` and serving with its install's RBAC, mirror into one
//! target. Each cluster's retention keeps what the other's Pods run; a
//! cluster whose control plane stopped keeps everything it listed until
//! `pinswap clusters forget`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Install, forbidden, images, namespace, pod, remove_webhooks};
use common::serve::Served;
use common::{TestRegistry, push_image};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const NS: &str = "shop";

/// pinswap installed into `cluster` as cluster `name`, serving.
struct Member {
    client: kube::Client,
    install: Install,
    served: Served,
}

async fn join(cluster: &Cluster, name: &str, src: &TestRegistry, dst: &TestRegistry) -> Member {
    let config = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\ncluster: {name}\nrecovery:\n  retryInitial: 300ms\n  retryMax: 2s\n  lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\nretention: {{enabled: true, unusedFor: 2s, interval: 1s}}\nsharing: {{enabled: true, interval: 1s, checkEvery: 300ms, staleAfter: 4s, keepFor: 1h}}\n",
        dst.host(),
        src.host()
    );
    let client = cluster.admin().await;
    remove_webhooks(&client).await;
    namespace(&client, NS, json!({})).await;
    let install = Install::new(&client, "pinswap-sharing", &config, &[]).await;
    let served = install.serve(cluster, &format!("{name}-0")).await;
    install.register(&client, &served).await;
    Member {
        client,
        install,
        served,
    }
}

impl Member {
    /// Creates a Pod running `image`; returns the image it was stored with.
    async fn run(&self, name: &str, image: &str) -> String {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        let p: Pod = serde_json::from_value(pod(name, &[("app", image)], &[])).unwrap();
        let stored = pods.create(&PostParams::default(), &p).await.unwrap();
        images(&stored, "containers").remove(0)
    }

    async fn delete(&self, name: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
}

async fn until(
    what: &str,
    limit: Duration,
    log: impl Fn() -> String,
    mut f: impl AsyncFnMut() -> bool,
) {
    let t = Instant::now();
    while !f().await {
        assert!(
            t.elapsed() < limit,
            "{what} within {limit:?}; log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clusters_keep_each_others_images_until_one_is_forgotten() {
    let one = Cluster::get();
    let _g = one.lock().await;
    let two = tokio::task::spawn_blocking(Cluster::another).await.unwrap();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    let repo = |n: &str| format!("mirror/127.0.0.1_{}/shop/{n}", src.port());
    let mut pushed = Vec::new();
    for (n, seed) in [("x", 71), ("y", 72), ("z", 73)] {
        let img = common::fixtures::Image::oci(1, seed);
        push_image(&src, &format!("shop/{n}"), Some("v1"), &img).await;
        pushed.push(img);
    }
    let (x, y, z) = (&pushed[0], &pushed[1], &pushed[2]);
    let present = async |n: &str, img: &common::fixtures::Image| {
        dst.get_manifest(&repo(n), &img.digest)
            .await
            .is_some_and(|(b, _, _)| b == img.manifest)
    };

    let a = join(one, "a", &src, &dst).await;
    let b = join(&two, "b", &src, &dst).await;
    let source = |n: &str| format!("{}/shop/{n}:v1", src.host());
    let pinned = |n: &str, img: &common::fixtures::Image| {
        format!("{}/{}:v1@{}", dst.host(), repo(n), img.digest)
    };
    assert_eq!(a.run("x", &source("x")).await, pinned("x", x));
    assert_eq!(b.run("y", &source("y")).await, pinned("y", y));
    // Z: mirrored by A, then used by nobody.
    assert_eq!(a.run("z", &source("z")).await, pinned("z", z));
    a.delete("z").await;
    let logs = || format!("A:\n{}", a.served.log_text());

    // Both records published, then Z removed by retention; X and Y stay
    // over passes of both clusters.
    until("both records", Duration::from_secs(60), logs, async || {
        dst.head_manifest("mirror/pinswap-usage", "a")
            .await
            .is_some()
            && dst
                .head_manifest("mirror/pinswap-usage", "b")
                .await
                .is_some()
    })
    .await;
    until("Z removed", Duration::from_secs(60), logs, async || {
        !present("z", z).await
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(present("x", x).await, "A's image stays; log:\n{}", logs());
    assert!(
        present("y", y).await,
        "B's image stays; log:\n{}\nB:\n{}",
        logs(),
        b.served.log_text()
    );

    // B goes offline: its pinswap and its control plane stop. Its record
    // goes stale and keeps Y in A's passes.
    for (m, c) in [(&a, one), (&b, &two)] {
        let refused = forbidden(c, &m.install.user());
        assert!(refused.is_empty(), "403s: {refused:?}");
    }
    let Member { served, .. } = b;
    drop(served);
    drop(two);
    let stale = async || {
        let (_, text) = a.served.health_get("/metrics").await;
        common::metrics::sample(&text, "pinswap_usage_record_stale", &[("cluster", "b")])
            == Some(1.0)
    };
    until(
        "B's record counted stale",
        Duration::from_secs(60),
        logs,
        stale,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        present("y", y).await,
        "a stale cluster's image stays; log:\n{}",
        logs()
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pinswap.yaml");
    std::fs::write(&file, &a.install.config).unwrap();
    let (code, out, err) =
        common::run_pinswap(&["clusters", "list", "-c", file.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("b ") && l.ends_with("stale")),
        "{out}"
    );
    let (code, _, err) =
        common::run_pinswap(&["clusters", "forget", "-c", file.to_str().unwrap(), "b"]).await;
    assert_eq!(code, 0, "{err}");
    until(
        "Y removed once B is forgotten",
        Duration::from_secs(60),
        logs,
        async || !present("y", y).await,
    )
    .await;
    assert!(present("x", x).await);
    assert!(
        a.served
            .log_text()
            .contains("retention removed an unused image")
    );
}
