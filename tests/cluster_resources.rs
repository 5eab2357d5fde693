//! Images named in custom resources, against a real kube-apiserver with
//! the projects' CRDs installed: the leader, with the install's
//! ServiceAccount (so the install's RBAC is what it has, and the audit log
//! shows no 403), copies what Argo Workflows, Tekton, Knative Serving,
//! KubeVirt and Flux objects name, byte for byte, before any Pod exists;
//! it changes none of the objects; retention keeps those images while
//! their objects exist and removes one once its object is gone; and a CRD
//! installed after the leader started is found by discovery and watched;
//! and while discovery cannot answer for a kind (an aggregated API whose
//! backend is down), retention removes nothing.
//!
//! The CRDs are minimal and schema-true: each project's group, version,
//! kind, plural and namespaced scope, with `spec` kept as written
//! (`x-kubernetes-preserve-unknown-fields`), which is what the API server
//! needs to serve and store their objects. The objects themselves follow
//! each project's documented API.

mod common;

use std::time::Duration;

use common::cluster::{Cluster, Rig, apply, no_forbidden};
use common::eventually as until;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};

const CONFIG: &str = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
retention: {enabled: true, unusedFor: 2s, interval: 1s}
customResources:
  profiles: [argo-workflows, tekton, knative-serving, kubevirt, flux]
  discoveryInterval: 1s
";

/// A minimal CRD for `group/version` `kind` (plural `plural`).
fn crd(group: &str, version: &str, kind: &str, plural: &str) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "versions": [{"name": version, "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }}}]
        }
    })
}

async fn install(client: &kube::Client, crd: &Value) {
    apply(client, crd).await.unwrap();
    let api: kube::Api<CustomResourceDefinition> = kube::Api::all(client.clone());
    let name = crd["metadata"]["name"].as_str().unwrap().to_owned();
    tokio::time::timeout(
        Duration::from_secs(60),
        kube::runtime::wait::await_condition(
            api,
            &name,
            kube::runtime::conditions::is_crd_established(),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("CRD {name} not established"))
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_named_in_custom_resources_are_mirrored_kept_and_released() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let client = cluster.admin().await;
    // Flux's CRD comes later; a kind left without a CRD (Tekton's
    // Pipeline, KubeVirt's VirtualMachineInstance) is no error.
    for c in [
        crd("argoproj.io", "v1alpha1", "Workflow", "workflows"),
        crd("argoproj.io", "v1alpha1", "CronWorkflow", "cronworkflows"),
        crd("tekton.dev", "v1", "Task", "tasks"),
        crd("tekton.dev", "v1", "PipelineRun", "pipelineruns"),
        // Served only at a version the group does not prefer (tekton.dev
        // prefers v1), as Tekton's own StepAction is.
        crd("tekton.dev", "v1beta1", "StepAction", "stepactions"),
        crd("serving.knative.dev", "v1", "Service", "services"),
        crd("kubevirt.io", "v1", "VirtualMachine", "virtualmachines"),
    ] {
        install(&client, &c).await;
    }
    let rig = Rig::start(cluster, "crds01", CONFIG).await;
    let ns = rig.ns.clone();
    let mut pushed = Vec::new();
    for (i, repo) in [
        "wf", "cron", "task", "run", "ksvc", "disk", "step", "dv", "flux",
    ]
    .into_iter()
    .enumerate()
    {
        pushed.push((repo, rig.push(repo, "v1", 9300 + i as u64).await));
    }
    let src = |repo: &str| rig.source(&format!("{repo}:v1"));
    let objects = [
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "hello", "namespace": ns},
            "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {"image": src("wf"), "command": ["echo"]}}]}}),
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "CronWorkflow", "metadata": {"name": "nightly", "namespace": ns},
            "spec": {"schedules": ["0 3 * * *"], "workflowSpec": {"entrypoint": "main", "templates": [{"name": "main", "script": {"image": src("cron"), "source": "true"}}]}}}),
        json!({"apiVersion": "tekton.dev/v1", "kind": "Task", "metadata": {"name": "build", "namespace": ns},
            "spec": {"params": [{"name": "builder"}], "steps": [{"name": "compile", "image": src("task"), "script": "make"}, {"name": "p", "image": "$(params.builder)"}]}}),
        json!({"apiVersion": "tekton.dev/v1", "kind": "PipelineRun", "metadata": {"name": "ci-1", "namespace": ns},
            "spec": {"pipelineSpec": {"tasks": [{"name": "t", "taskSpec": {"steps": [{"name": "s", "image": src("run")}]}}]}}}),
        json!({"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "hello", "namespace": ns},
            "spec": {"template": {"spec": {"containers": [{"image": src("ksvc")}]}}}}),
        json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm", "namespace": ns},
            "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}, "volumes": [{"name": "root", "containerDisk": {"image": src("disk")}}]}},
                "dataVolumeTemplates": [{"metadata": {"name": "data"}, "spec": {"source": {"registry": {"url": format!("docker://{}", src("dv"))}}}}]}}),
        json!({"apiVersion": "tekton.dev/v1beta1", "kind": "StepAction", "metadata": {"name": "step", "namespace": ns},
            "spec": {"image": src("step"), "script": "true"}}),
    ];
    let mut versions = Vec::new();
    for o in &objects {
        let stored = apply(&rig.client, o).await.unwrap();
        versions.push(stored.metadata.resource_version.clone());
    }
    let repo = |name: &str| format!("mirror/127.0.0.1_{}/{name}", rig.src.port());
    let mirrored = |name: &'static str, img: common::fixtures::Image| {
        let rig = &rig;
        async move {
            until(
                &format!("{name} mirrored"),
                Duration::from_secs(60),
                || async {
                    rig.dst.head_manifest(&repo(name), "v1").await.as_deref()
                        == Some(img.digest.as_str())
                },
            )
            .await;
            let (bytes, _, _) = rig.dst.get_manifest(&repo(name), "v1").await.unwrap();
            assert_eq!(bytes, img.manifest, "{name}: the source's bytes");
            for b in img.blobs() {
                assert!(
                    rig.dst.blob(&repo(name), &b.digest).await.is_some(),
                    "{name}: blob {}",
                    b.digest
                );
            }
        }
    };
    for (name, img) in pushed.iter().take(8) {
        mirrored(name, img.clone()).await;
    }
    // Copied without rewriting: no object was written to.
    for (o, v) in objects.iter().zip(&versions) {
        let now = common::cluster::api_for(&rig.client, o)
            .await
            .get(o["metadata"]["name"].as_str().unwrap())
            .await
            .unwrap();
        assert_eq!(&now.metadata.resource_version, v, "{} changed", o["kind"]);
        assert_eq!(now.data["spec"], o["spec"], "{} changed", o["kind"]);
    }
    assert_eq!(
        rig.pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        0,
        "no Pod was needed"
    );

    // A CRD installed while the leader runs is discovered, then watched.
    install(
        &client,
        &crd(
            "source.toolkit.fluxcd.io",
            "v1",
            "OCIRepository",
            "ocirepositories",
        ),
    )
    .await;
    let flux = json!({"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "OCIRepository", "metadata": {"name": "manifests", "namespace": ns},
        "spec": {"interval": "5m", "url": format!("oci://{}/flux", rig.src.host()), "ref": {"tag": "v1"}}});
    apply(&rig.client, &flux).await.unwrap();
    mirrored("flux", pushed[8].1.clone()).await;

    // Retention: the Knative Service goes, and so does its image; every
    // image an object still names stays.
    common::cluster::delete(&rig.client, &objects[4]).await;
    until(
        "the Service's image removed",
        Duration::from_secs(60),
        || async { rig.dst.head_manifest(&repo("ksvc"), "v1").await.is_none() },
    )
    .await;
    for (name, img) in pushed.iter().filter(|(n, _)| *n != "ksvc") {
        assert_eq!(
            rig.dst.head_manifest(&repo(name), "v1").await.as_deref(),
            Some(img.digest.as_str()),
            "{name} is named by an object and stays"
        );
    }
    let log = rig.served().log_text();
    assert!(
        log.contains("custom resource served: watching its images"),
        "{log}"
    );
    no_forbidden(cluster, &rig);
}

/// An aggregated API whose backend is gone, as a metrics server that is
/// down: `/apis` lists its group, and its version answers 503.
fn broken_api_service() -> Value {
    json!({
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": "v1.gadgets.example.com"},
        "spec": {
            "group": "gadgets.example.com", "version": "v1",
            "service": {"namespace": "default", "name": "no-such-service", "port": 443},
            "insecureSkipTLSVerify": true, "groupPriorityMinimum": 1000, "versionPriority": 15
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_nothing_while_discovery_cannot_answer_for_a_kind() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let client = cluster.admin().await;
    let service = broken_api_service();
    common::cluster::delete(&client, &service).await;
    apply(&client, &service).await.unwrap();
    let config = "recovery:
  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}
retention: {enabled: true, unusedFor: 2s, interval: 1s}
customResources:
  kinds: [{group: gadgets.example.com, kind: Gadget, resource: gadgets, paths: [spec.image]}]
  discoveryInterval: 1s
";
    let rig = Rig::start(cluster, "crds02", config).await;
    let img = rig.push("unused", "v1", 9401).await;
    rig.create(common::cluster::pod(
        "once",
        &[("app", &rig.source("unused:v1"))],
        &[],
    ))
    .await
    .unwrap();
    rig.pods()
        .delete("once", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let repo = format!("mirror/127.0.0.1_{}/unused", rig.src.port());
    assert_eq!(
        rig.dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(img.digest.as_str()),
        "mirrored at admission"
    );
    // Many passes, each long after the image was last named: a Gadget the
    // leader cannot list may name it.
    until("discovery fails", Duration::from_secs(30), || async {
        rig.served()
            .log_text()
            .contains("API discovery of a group version failed")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        rig.dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(img.digest.as_str()),
        "kept while discovery cannot answer; log:\n{}",
        rig.served().log_text()
    );
    // The API server now says the group is not served: the kind names
    // nothing, and the image goes.
    common::cluster::delete(&client, &service).await;
    until(
        "the unused image removed",
        Duration::from_secs(60),
        || async { rig.dst.head_manifest(&repo, "v1").await.is_none() },
    )
    .await;
    no_forbidden(cluster, &rig);
}
