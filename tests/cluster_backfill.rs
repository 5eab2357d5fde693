//! The backfill against a real kube-apiserver: a Pod and a CronJob created
//! before pinswap is installed have their images mirrored by the leader,
//! byte for byte, with the install's ServiceAccount token (so the
//! install's RBAC is what it has: the audit log shows no 403); an image
//! outside the allowlist is left alone and the Pod is not touched.

mod common;

use std::time::Duration;

use common::cluster::{Cluster, Install, forbidden, namespace, remove_webhooks};
use common::{FAST_RECOVERY as FAST, TestRegistry, eventually as until};
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_and_cron_jobs_from_before_the_install_are_backfilled() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let client = cluster.admin().await;
    remove_webhooks(&client).await;
    let (src, other, dst) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        TestRegistry::plain().await,
    );
    let app = common::fixtures::Image::oci(2, 8101);
    common::push_image(&src, "shop/app", Some("v1"), &app).await;
    let job = common::fixtures::Image::oci(1, 8102);
    common::push_image(&src, "shop/job", Some("v1"), &job).await;
    let stray = common::fixtures::Image::oci(1, 8103);
    common::push_image(&other, "shop/stray", Some("v1"), &stray).await;

    let ns = "backfill";
    namespace(&client, ns, json!({})).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"containers": [
            {"name": "app", "image": format!("{}/shop/app:v1", src.host())},
            {"name": "stray", "image": format!("{}/shop/stray:v1", other.host())}
        ]}
    }))
    .unwrap();
    let before = pods.create(&PostParams::default(), &pod).await.unwrap();
    let cron: CronJob = serde_json::from_value(json!({
        "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {"spec": {
            "restartPolicy": "OnFailure",
            "containers": [{"name": "job", "image": format!("{}/shop/job:v1", src.host())}]
        }}}}}
    }))
    .unwrap();
    Api::<CronJob>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cron)
        .await
        .unwrap();

    let config = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n{FAST}",
        dst.host(),
        src.host()
    );
    let install = Install::new(&client, "pinswap-backfill", &config, &[]).await;
    let served = install.serve(cluster, "backfill-0").await;
    for (name, img) in [("app", &app), ("job", &job)] {
        let repo = format!("mirror/127.0.0.1_{}/shop/{name}", src.port());
        until(
            &format!("{name} mirrored"),
            Duration::from_secs(60),
            || async {
                dst.head_manifest(&repo, "v1").await.as_deref() == Some(img.digest.as_str())
            },
        )
        .await;
        let (bytes, _, _) = dst.get_manifest(&repo, "v1").await.unwrap();
        assert_eq!(bytes, img.manifest, "{name}: the source's bytes");
        for b in img.blobs() {
            assert_eq!(
                dst.blob(&repo, &b.digest).await.as_deref(),
                Some(b.bytes.as_slice()),
                "{name}: blob {}",
                b.digest
            );
        }
    }
    let catalog = dst.catalog().await;
    assert_eq!(
        catalog.len(),
        2,
        "nothing outside the allowlist: {catalog:?}"
    );
    until(
        "the first pass's summary",
        Duration::from_secs(10),
        || async { served.log_text().contains("backfill: first pass done") },
    )
    .await;
    // The running Pod is not patched or restarted.
    let now = pods.get("web").await.unwrap();
    assert_eq!(now.metadata.uid, before.metadata.uid);
    assert_eq!(
        serde_json::to_value(&now.spec).unwrap()["containers"],
        serde_json::to_value(&before.spec).unwrap()["containers"]
    );
    let refused = forbidden(cluster, &install.user());
    assert!(
        refused.is_empty(),
        "403s for the install's ServiceAccount: {refused:?}"
    );
    drop(served);
    Api::<CronJob>::namespaced(client.clone(), ns)
        .delete("nightly", &Default::default())
        .await
        .unwrap();
    pods.delete("web", &Default::default()).await.unwrap();
}
