//! Admission through a real kube-apiserver: pinswap installed from
//! `pinswap manifests`, `serve` on the host registered with the rendered
//! MutatingWebhookConfiguration (only `clientConfig` becomes a URL), Pods
//! created through the API and read back from it. Needs the harness built
//! by `scripts/build-cluster.sh`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{self, Cluster, IMAGE, Rig, annotation, images, no_forbidden, pod};
use common::fixtures::Image;
use common::push_image;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_created_through_the_api_is_stored_rewritten_and_pinned() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "admit", "").await;
    let app = rig.push("app", "v1", 1).await;
    let tool = rig.push("tool", "1.0", 2).await;
    let by_digest = format!("{}@{}", rig.source("tool"), tool.digest);
    rig.create(pod(
        "shop",
        &[("app", &rig.source(IMAGE)), ("pinned", &by_digest)],
        &[("setup", &rig.source("tool:1.0"))],
    ))
    .await
    .unwrap();

    // Read back from the API server: what is stored is what runs.
    let stored = rig.pods().get("shop").await.unwrap();
    assert_eq!(
        images(&stored, "containers"),
        [
            format!("{}:v1@{}", rig.mirrored("app"), app.digest),
            format!("{}@{}", rig.mirrored("tool"), tool.digest),
        ]
    );
    assert_eq!(
        images(&stored, "initContainers"),
        [format!("{}:1.0@{}", rig.mirrored("tool"), tool.digest)]
    );
    let originals: Value =
        serde_json::from_str(&annotation(&stored, "pinswap.dev/original-images").unwrap()).unwrap();
    assert_eq!(originals["containers/app"], rig.source(IMAGE));
    assert_eq!(originals["initContainers/setup"], rig.source("tool:1.0"));
    assert!(annotation(&stored, "pinswap.dev/decisions").is_some());
    // The target holds the exact manifest the source serves.
    let (bytes, _, _) = rig
        .dst
        .get_manifest(
            &format!("mirror/127.0.0.1_{}/app", rig.src.port()),
            &app.digest,
        )
        .await
        .unwrap();
    assert_eq!(bytes, app.manifest);
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_pods_made_by_the_controller_manager_are_rewritten() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "deploy", "").await;
    let app = rig.push("app", "v1", 3).await;
    let deploy: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": rig.source(IMAGE)}]},
            },
        },
    }))
    .unwrap();
    Api::<Deployment>::namespaced(rig.client.clone(), &rig.ns)
        .create(&PostParams::default(), &deploy)
        .await
        .unwrap();
    // The ReplicaSet controller creates the Pods; each passes admission.
    let t = Instant::now();
    let pods = loop {
        let pods = rig
            .pods()
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap();
        if pods.items.len() == 2 {
            break pods.items;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the controller-manager made {} Pods",
            pods.items.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for p in &pods {
        assert!(
            p.metadata
                .owner_references
                .as_ref()
                .is_some_and(|o| o[0].kind == "ReplicaSet"),
            "{:?} is not the ReplicaSet's",
            p.metadata.name
        );
        assert_eq!(
            images(p, "containers"),
            [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
        );
    }
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ephemeral_container_added_through_its_subresource_is_rewritten() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "debug", "").await;
    rig.push("app", "v1", 4).await;
    let shell = rig.push("shell", "1", 5).await;
    rig.create(pod("target", &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap();
    // What `kubectl debug` sends: a patch of pods/ephemeralcontainers.
    let patch = json!({"spec": {"ephemeralContainers": [
        {"name": "debugger", "image": rig.source("shell:1"), "targetContainerName": "app"}
    ]}});
    rig.pods()
        .patch_ephemeral_containers("target", &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .unwrap();
    let stored = rig.pods().get("target").await.unwrap();
    assert_eq!(
        images(&stored, "ephemeralContainers"),
        [format!("{}:1@{}", rig.mirrored("shell"), shell.digest)]
    );
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_side_dry_run_is_answered_and_copies_nothing() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "dryrun", "").await;
    // The install declares sideEffects NoneOnDryRun.
    assert_eq!(
        rig.install.object("MutatingWebhookConfiguration")["webhooks"][0]["sideEffects"],
        "NoneOnDryRun"
    );
    let app = rig.push("app", "v1", 6).await;
    // `kubectl create --dry-run=server`
    let p: Pod = serde_json::from_value(pod("dry", &[("app", &rig.source(IMAGE))], &[])).unwrap();
    let answered = rig
        .pods()
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &p,
        )
        .await
        .unwrap();
    assert_eq!(
        images(&answered, "containers"),
        [rig.source(IMAGE)],
        "nothing was mirrored, so nothing to rewrite to"
    );
    assert!(
        rig.pods().get_opt("dry").await.unwrap().is_none(),
        "a dry run stores nothing"
    );
    let repo = format!("mirror/127.0.0.1_{}/app", rig.src.port());
    assert_eq!(
        rig.dst.head_manifest(&repo, &app.digest).await,
        None,
        "a dry run copied the image"
    );
    // The review did reach pinswap: its decision is on the answer.
    let decisions = annotation(&answered, "pinswap.dev/decisions").unwrap_or_default();
    assert!(decisions.contains("dry run"), "decisions: {decisions}");
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_added_by_a_later_webhook_is_rewritten_on_reinvocation() {
    use base64::Engine;
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "sidecar", "").await;
    let app = rig.push("app", "v1", 7).await;
    let proxy = rig.push("proxy", "2", 8).await;
    // Webhooks run in the order of their configurations' names; this one
    // comes after pinswap's and changes the Pod after pinswap saw it.
    let ca = base64::engine::general_purpose::STANDARD.encode(&cluster.ca_pem);
    let injector = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "zz-sidecar-injector"},
        "webhooks": [{
            "name": "sidecar.pinswap.dev",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"url": cluster.sidecar_url, "caBundle": ca},
            "sideEffects": "None",
            "reinvocationPolicy": "Never",
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": rig.ns}},
        }],
    });
    assert!(
        rig.install.object("MutatingWebhookConfiguration")["metadata"]["name"]
            .as_str()
            .unwrap()
            < "zz-sidecar-injector"
    );
    cluster::apply(&rig.client, &injector).await.unwrap();
    let mut p = pod("meshed", &[("app", &rig.source(IMAGE))], &[]);
    p["metadata"]["annotations"] = json!({"sidecar.pinswap.dev/image": rig.source("proxy:2")});
    rig.create(p).await.unwrap();
    let stored = rig.pods().get("meshed").await.unwrap();
    assert_eq!(
        images(&stored, "containers"),
        [
            format!("{}:v1@{}", rig.mirrored("app"), app.digest),
            format!("{}:2@{}", rig.mirrored("proxy"), proxy.digest),
        ],
        "reinvocationPolicy IfNeeded sends the sidecar's image to pinswap"
    );
    cluster::delete(&rig.client, &injector).await;
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rendered_selectors_keep_pinswaps_namespace_kube_system_and_opted_out_pods_out() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let rig = Rig::start(cluster, "selectors", "").await;
    let app = rig.push("app", "v1", 9).await;
    let image = rig.source(IMAGE);
    for ns in [rig.install.namespace.as_str(), "kube-system"] {
        let api: Api<Pod> = Api::namespaced(rig.client.clone(), ns);
        let p: Pod = serde_json::from_value(pod("left-alone", &[("app", &image)], &[])).unwrap();
        let stored = api.create(&PostParams::default(), &p).await.unwrap();
        assert_eq!(
            images(&stored, "containers"),
            std::slice::from_ref(&image),
            "in {ns}"
        );
        api.delete("left-alone", &Default::default()).await.unwrap();
    }
    // The object selector: a Pod labelled pinswap.dev/ignore=true.
    let mut opted_out = pod("opted-out", &[("app", &image)], &[]);
    opted_out["metadata"]["labels"] = json!({"pinswap.dev/ignore": "true"});
    let stored = rig.create(opted_out).await.unwrap();
    assert_eq!(images(&stored, "containers"), std::slice::from_ref(&image));
    // And a namespace labelled so.
    cluster::namespace(
        &rig.client,
        "selectors-out",
        json!({"pinswap.dev/ignore": "true"}),
    )
    .await;
    let api: Api<Pod> = Api::namespaced(rig.client.clone(), "selectors-out");
    let p: Pod = serde_json::from_value(pod("p", &[("app", &image)], &[])).unwrap();
    assert_eq!(
        images(
            &api.create(&PostParams::default(), &p).await.unwrap(),
            "containers"
        ),
        std::slice::from_ref(&image)
    );
    // The webhook still mutates everywhere else.
    let stored = rig
        .create(pod("mutated", &[("app", &image)], &[]))
        .await
        .unwrap();
    assert_eq!(
        images(&stored, "containers"),
        [format!("{}:v1@{}", rig.mirrored("app"), app.digest)]
    );
    no_forbidden(cluster, &rig);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pinswap_stopped_ignore_admits_unchanged_and_fail_refuses() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    // failurePolicy: open renders Ignore.
    let mut rig = Rig::start(cluster, "down-open", "").await;
    let webhook = rig.install.object("MutatingWebhookConfiguration")["webhooks"][0].clone();
    assert_eq!(webhook["failurePolicy"], "Ignore");
    let timeout = webhook["timeoutSeconds"].as_u64().unwrap();
    rig.push("app", "v1", 10).await;
    drop(rig.served.take());
    let t = Instant::now();
    let stored = rig
        .create(pod("while-down", &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(timeout),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(images(&stored, "containers"), [rig.source(IMAGE)]);

    // failurePolicy: closed renders Fail: the API server refuses the Pod,
    // naming pinswap's webhook.
    let mut rig = Rig::start(cluster, "down-closed", "failurePolicy: closed").await;
    let webhook = rig.install.object("MutatingWebhookConfiguration")["webhooks"][0].clone();
    assert_eq!(webhook["failurePolicy"], "Fail");
    rig.push("app", "v1", 11).await;
    drop(rig.served.take());
    let t = Instant::now();
    let err = rig
        .create(pod("while-down", &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(timeout),
        "took {:?}",
        t.elapsed()
    );
    let text = err.to_string();
    assert!(text.contains(webhook["name"].as_str().unwrap()), "{text}");
    assert!(rig.pods().get_opt("while-down").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_denials_reach_the_user_with_pinswaps_message() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let mut rig = Rig::start(cluster, "deny", "failurePolicy: closed").await;
    // The source is gone: pinswap cannot mirror, and says so.
    rig.src.kill();
    let err = rig
        .create(pod("no-source", &[("app", &rig.source(IMAGE))], &[]))
        .await
        .unwrap_err();
    let kube::Error::Api(status) = &err else {
        panic!("{err}")
    };
    assert!(status.message.contains("pinswap"), "{}", status.message);
    assert!(rig.pods().get_opt("no-source").await.unwrap().is_none());
    assert!(rig.served().log_text().contains("no-source"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_secrets_of_the_pod_and_its_service_account_are_read_from_real_secrets() {
    use common::kube::dockerconfigjson_secret;
    use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let src = common::TestRegistry::plain_auth("team", "s3cret").await;
    let rig = Rig::start_with(cluster, "secrets", "", "  imagePullSecrets: true", src).await;
    // The config's source entry has no auth, so only the Pod's secrets
    // open the source.
    let img = Image::oci(1, 30);
    push_image(&rig.src, "private", Some("v1"), &img).await;
    let secrets: Api<Secret> = Api::namespaced(rig.client.clone(), &rig.ns);
    for name in ["pod-secret", "sa-secret"] {
        let s = dockerconfigjson_secret(name, &rig.src.host(), "team", "s3cret");
        secrets.create(&PostParams::default(), &s).await.unwrap();
    }
    // A Pod naming its secret.
    let mut p = pod("own-secret", &[("app", &rig.source("private:v1"))], &[]);
    p["spec"]["imagePullSecrets"] = json!([{"name": "pod-secret"}]);
    let stored = rig.create(p).await.unwrap();
    let want = format!("{}:v1@{}", rig.mirrored("private"), img.digest);
    assert_eq!(images(&stored, "containers"), std::slice::from_ref(&want));
    // A Pod whose ServiceAccount names one (the ServiceAccount admission
    // plugin, which runs before webhooks, copies it onto the Pod).
    let sas: Api<ServiceAccount> = Api::namespaced(rig.client.clone(), &rig.ns);
    let sa: ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "builder"},
        "imagePullSecrets": [{"name": "sa-secret"}],
    }))
    .unwrap();
    sas.create(&PostParams::default(), &sa).await.unwrap();
    let mut p = pod("sa-secret", &[("app", &rig.source("private:v1"))], &[]);
    p["spec"]["serviceAccountName"] = json!("builder");
    let stored = rig.create(p).await.unwrap();
    assert_eq!(images(&stored, "containers"), std::slice::from_ref(&want));
    // Another team's namespace: the mirror holds the image now, but the
    // mirror never widens who can run it.
    cluster::namespace(&rig.client, "secrets-b", json!({})).await;
    let team_b: Api<Pod> = Api::namespaced(rig.client.clone(), "secrets-b");
    let b_secrets: Api<Secret> = Api::namespaced(rig.client.clone(), "secrets-b");
    let wrong = dockerconfigjson_secret("wrong", &rig.src.host(), "team", "guess");
    b_secrets
        .create(&PostParams::default(), &wrong)
        .await
        .unwrap();
    let own = dockerconfigjson_secret("own", &rig.src.host(), "team", "s3cret");
    b_secrets
        .create(&PostParams::default(), &own)
        .await
        .unwrap();
    let cases = [
        ("no-secret", None, false, "has no pull secret for"),
        (
            "wrong-secret",
            Some("wrong"),
            false,
            "refused by the source",
        ),
        ("own-secret", Some("own"), true, "rewritten"),
    ];
    for (name, secret, rewritten, note) in cases {
        let mut p = pod(name, &[("app", &rig.source("private:v1"))], &[]);
        if let Some(s) = secret {
            p["spec"]["imagePullSecrets"] = json!([{"name": s}]);
        }
        let p: Pod = serde_json::from_value(p).unwrap();
        let stored = team_b.create(&PostParams::default(), &p).await.unwrap();
        let decisions = annotation(&stored, "pinswap.dev/decisions").unwrap_or_default();
        let expected = if rewritten {
            want.clone()
        } else {
            rig.source("private:v1")
        };
        assert_eq!(
            images(&stored, "containers"),
            [expected],
            "{name}: {decisions}"
        );
        assert!(decisions.contains(note), "{name}: {decisions}");
        assert!(!decisions.contains("s3cret") && !decisions.contains("guess"));
    }
    no_forbidden(cluster, &rig);
}
