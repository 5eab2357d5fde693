//! Every rendering of `pinswap manifests` applied to a real kube-apiserver
//! with server-side apply and strict field validation, and read back. The
//! cert-manager and Prometheus Operator CRDs are installed first from their
//! published definitions (tests/data/crds/), so the Issuer and Certificate
//! are validated against their schemas too. (The Helm chart's renderings
//! are applied the same way by tests/chart/test_cluster.py.)

mod common;

use common::cluster::{self, Cluster, apply, yaml_documents};
use serde_json::{Value, json};

/// Installs the CRDs in tests/data/crds and waits until each is served.
async fn install_crds(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/crds");
    let api: kube::Api<CustomResourceDefinition> = kube::Api::all(client.clone());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        for crd in yaml_documents(&std::fs::read_to_string(&path).unwrap()) {
            apply(client, &crd).await.unwrap();
            let name = crd["metadata"]["name"].as_str().unwrap().to_owned();
            let cond = kube::runtime::conditions::is_crd_established();
            tokio::time::timeout(
                std::time::Duration::from_secs(60),
                kube::runtime::wait::await_condition(api.clone(), &name, cond),
            )
            .await
            .unwrap_or_else(|_| panic!("CRD {name} not established"))
            .unwrap();
        }
    }
}

async fn render(dir: &std::path::Path, ns: &str, config: &str, args: &[&str]) -> Vec<Value> {
    let file = dir.join(format!("{ns}.yaml"));
    std::fs::write(&file, config).unwrap();
    let mut all = vec![
        "manifests",
        "--namespace",
        ns,
        "--config",
        file.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let (code, out, err) = common::run_pinswap(&all).await;
    assert_eq!(code, 0, "pinswap manifests {args:?}: {err}");
    yaml_documents(&out)
}

const CONFIG: &str = "target: {registry: registry.example.com/mirror}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rendering_of_pinswap_manifests_is_accepted_and_stored() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let client = cluster.admin().await;
    cluster::remove_webhooks(&client).await;
    install_crds(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let pull_secrets =
        "target: {registry: registry.example.com/mirror}\nsource: {imagePullSecrets: true}\n";
    let watched =
        "target: {registry: registry.example.com/mirror}\nrecovery: {namespaces: [apps, web]}\n";
    for ns in ["apps", "web"] {
        cluster::namespace(&client, ns, json!({})).await;
    }
    let scoped = "target: {registry: registry.example.com/mirror}\nscope:\n  namespaceSelector: {matchLabels: {mirror: enabled}, matchExpressions: [{key: tier, operator: NotIn, values: [db]}]}\n  objectSelector: {matchExpressions: [{key: app, operator: Exists}]}\n";
    let cases: [(&str, &str, &[&str]); 9] = [
        ("inst-default", CONFIG, &[]),
        ("inst-self-signed", CONFIG, &["--tls", "self-signed"]),
        ("inst-cert-manager", CONFIG, &["--tls", "cert-manager"]),
        (
            "inst-replicas",
            CONFIG,
            &[
                "--replicas",
                "3",
                "--image",
                "registry.example.com/pinswap:0.1.0",
            ],
        ),
        (
            "inst-pull-secret",
            CONFIG,
            &["--image-pull-secret", "regcred"],
        ),
        ("inst-secrets", pull_secrets, &[]),
        ("inst-watched", watched, &[]),
        ("inst-scoped", scoped, &[]),
        (
            "inst-closed",
            "target: {registry: registry.example.com/mirror}\nfailurePolicy: closed\n",
            &[],
        ),
    ];
    for (ns, config, args) in cases {
        let objects = render(dir.path(), ns, config, args).await;
        for obj in &objects {
            let what = format!("{ns}: {} {}", obj["kind"], obj["metadata"]["name"]);
            let stored = apply(&client, obj)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // Read back: the stored object exists where the rendering put it.
            let api = cluster::api_for(&client, obj).await;
            let got = api
                .get(&stored.metadata.name.clone().unwrap())
                .await
                .unwrap();
            assert_eq!(
                got.metadata.namespace.as_deref(),
                obj["metadata"]["namespace"].as_str(),
                "{what}"
            );
        }
        // The webhook as stored is the webhook as rendered.
        let webhook = objects
            .iter()
            .find(|o| o["kind"] == "MutatingWebhookConfiguration")
            .unwrap();
        let api = cluster::api_for(&client, webhook).await;
        let stored = serde_json::to_value(
            api.get(webhook["metadata"]["name"].as_str().unwrap())
                .await
                .unwrap(),
        )
        .unwrap();
        for key in [
            "failurePolicy",
            "sideEffects",
            "reinvocationPolicy",
            "timeoutSeconds",
            "namespaceSelector",
            "objectSelector",
            "rules",
        ] {
            assert_eq!(
                stored["webhooks"][0][key], webhook["webhooks"][0][key],
                "{ns}: webhook {key}"
            );
        }
        // Delete the cluster-wide webhook, so later tests' Pods never reach it.
        cluster::delete(&client, webhook).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_validation_refuses_a_field_the_schema_lacks() {
    // So that the acceptances above mean something.
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let client = cluster.admin().await;
    install_crds(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let objects = render(
        dir.path(),
        "inst-strict",
        CONFIG,
        &["--tls", "cert-manager"],
    )
    .await;
    let ns = objects.iter().find(|o| o["kind"] == "Namespace").unwrap();
    apply(&client, ns).await.unwrap();
    let mut dep = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .unwrap()
        .clone();
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = json!("Always");
    let err = apply(&client, &dep).await.unwrap_err().to_string();
    assert!(err.contains("imagePullPolicyy"), "{err}");
    let mut cert = objects
        .iter()
        .find(|o| o["kind"] == "Certificate")
        .unwrap()
        .clone();
    cert["spec"]["duration"] = json!(12);
    let err = apply(&client, &cert).await.unwrap_err().to_string();
    assert!(err.contains("duration"), "{err}");
}
