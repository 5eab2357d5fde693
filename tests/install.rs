//! `pinswap manifests` and `deploy/`: the objects decode into their
//! k8s-openapi types without losing a field, the webhook and RBAC are
//! exactly what they should be, and kustomize renders the same objects.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::manifests::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Decodes `v` as `K` and encodes it again: a field `K` does not know (a
/// typo, a wrong nesting) is dropped by the decode and shows up here.
fn round_trips<K: DeserializeOwned + serde::Serialize>(v: &Value) {
    let back = serde_json::to_value(typed::<K>(v)).unwrap();
    assert_eq!(
        &back,
        v,
        "{:?} lost or changed fields in a round trip",
        key(v)
    );
}

/// cert-manager v1 has no k8s-openapi type; these follow its CRD schema for
/// the fields we write and refuse any other.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct CertManagerObject {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: CertManagerSpec,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct CertManagerSpec {
    self_signed: Option<BTreeMap<String, Value>>,
    ca: Option<CaIssuer>,
    #[serde(rename = "isCA")]
    is_ca: Option<bool>,
    common_name: Option<String>,
    secret_name: Option<String>,
    dns_names: Option<Vec<String>>,
    issuer_ref: Option<IssuerRef>,
    duration: Option<String>,
    renew_before: Option<String>,
    private_key: Option<PrivateKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct CaIssuer {
    secret_name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct IssuerRef {
    kind: String,
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct PrivateKey {
    algorithm: String,
    size: u32,
    rotation_policy: Option<String>,
}

fn check_round_trip(objects: &[Value]) {
    for o in objects {
        match o["kind"].as_str().unwrap() {
            "Namespace" => round_trips::<Namespace>(o),
            "ServiceAccount" => round_trips::<ServiceAccount>(o),
            "ClusterRole" => round_trips::<ClusterRole>(o),
            "ClusterRoleBinding" => round_trips::<ClusterRoleBinding>(o),
            "Role" => round_trips::<Role>(o),
            "RoleBinding" => round_trips::<RoleBinding>(o),
            "ConfigMap" => round_trips::<ConfigMap>(o),
            "Service" => round_trips::<Service>(o),
            "Deployment" => round_trips::<Deployment>(o),
            "PodDisruptionBudget" => round_trips::<PodDisruptionBudget>(o),
            "MutatingWebhookConfiguration" => round_trips::<MutatingWebhookConfiguration>(o),
            "Issuer" | "Certificate" => {
                let _: CertManagerObject = typed(o);
                assert_eq!(o["apiVersion"], "cert-manager.io/v1");
            }
            other => panic!("unexpected kind {other}"),
        }
    }
}

const PULL_SECRETS_CONFIG: &str = "target: {registry: mirror.example.com/cache}
source: {imagePullSecrets: true}
recovery: {namespaces: [apps, web]}
";

#[tokio::test]
async fn every_object_round_trips_through_its_k8s_openapi_type() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(&config, PULL_SECRETS_CONFIG).unwrap();
    let config = config.to_str().unwrap();
    for args in [
        vec!["--tls", "cert-manager"],
        vec!["--tls", "self-signed"],
        vec!["--tls", "self-signed", "--config", config, "-n", "mirror"],
    ] {
        let objects = manifests(&args).await;
        check_round_trip(&objects);
        let kinds: Vec<&str> = objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap())
            .collect();
        assert_eq!(kinds.first(), Some(&"Namespace"), "{args:?}");
        assert_eq!(
            kinds.last(),
            Some(&"MutatingWebhookConfiguration"),
            "{args:?}"
        );
        for kind in [
            "ServiceAccount",
            "ConfigMap",
            "Deployment",
            "PodDisruptionBudget",
        ] {
            assert_eq!(kinds.iter().filter(|k| **k == kind).count(), 1, "{kind}");
        }
        // The webhook's and the metrics Service.
        assert_eq!(kinds.iter().filter(|k| **k == "Service").count(), 2);
    }
}

#[tokio::test]
async fn the_webhook_is_fail_open_and_skips_its_own_and_opted_out_namespaces() {
    let objects = manifests(&["--namespace", "mirror", "--tls", "cert-manager"]).await;
    let config: MutatingWebhookConfiguration = typed(find(
        &objects,
        "MutatingWebhookConfiguration",
        "pinswap-mirror",
    ));
    let annotations = config.metadata.annotations.clone().unwrap();
    assert_eq!(
        annotations["cert-manager.io/inject-ca-from"],
        "mirror/pinswap-webhook"
    );
    let hooks = config.webhooks.unwrap();
    assert_eq!(hooks.len(), 1);
    let w = &hooks[0];
    assert_eq!(w.name, "mutate.pinswap.dev");
    assert_eq!(w.failure_policy.as_deref(), Some("Ignore"));
    assert_eq!(w.side_effects, "NoneOnDryRun");
    assert_eq!(w.admission_review_versions, ["v1"]);
    assert_eq!(w.timeout_seconds, Some(10));
    assert_eq!(w.reinvocation_policy.as_deref(), Some("IfNeeded"));
    assert_eq!(w.match_policy.as_deref(), Some("Equivalent"));
    let service = w.client_config.service.as_ref().unwrap();
    assert_eq!(
        (
            service.namespace.as_str(),
            service.name.as_str(),
            service.path.as_deref(),
            service.port
        ),
        ("mirror", "pinswap", Some("/mutate"), Some(443))
    );
    assert!(w.client_config.url.is_none());
    assert!(
        w.client_config.ca_bundle.is_none(),
        "cainjector fills caBundle"
    );
    let rules = w.rules.as_ref().unwrap();
    assert_eq!(rules.len(), 1);
    let r = &rules[0];
    assert_eq!(r.api_groups.as_deref(), Some(&["".to_owned()][..]));
    assert_eq!(r.api_versions.as_deref(), Some(&["v1".to_owned()][..]));
    assert_eq!(
        r.operations.as_deref(),
        Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..])
    );
    assert_eq!(
        r.resources.as_deref(),
        Some(&["pods".to_owned(), "pods/ephemeralcontainers".to_owned()][..])
    );
    assert_eq!(r.scope.as_deref(), Some("Namespaced"));

    let ns = serde_json::to_value(w.namespace_selector.as_ref().unwrap()).unwrap();
    assert_eq!(
        ns,
        json!({"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["mirror", "kube-system"]},
            {"key": "pinswap.dev/ignore", "operator": "NotIn", "values": ["true"]},
        ]})
    );
    let obj = serde_json::to_value(w.object_selector.as_ref().unwrap()).unwrap();
    assert_eq!(
        obj,
        json!({"matchExpressions": [
            {"key": "pinswap.dev/ignore", "operator": "NotIn", "values": ["true"]},
        ]})
    );
    // Its own namespace also carries the opt-out label.
    let own: Namespace = typed(find(&objects, "Namespace", "mirror"));
    assert_eq!(own.metadata.labels.unwrap()["pinswap.dev/ignore"], "true");

    // The serving certificate comes from a CA Issuer whose CA a self-signed
    // Issuer made, so renewing it leaves the injected CA alone.
    let serving = find(&objects, "Certificate", "pinswap-webhook");
    assert_eq!(
        serving["spec"]["issuerRef"],
        json!({"kind": "Issuer", "name": "pinswap-ca"})
    );
    assert_eq!(serving["spec"]["secretName"], "pinswap-tls");
    assert_eq!(
        serving["spec"]["dnsNames"],
        json!(["pinswap.mirror.svc", "pinswap.mirror.svc.cluster.local"])
    );
    assert_eq!(
        find(&objects, "Issuer", "pinswap-ca")["spec"],
        json!({"ca": {"secretName": "pinswap-ca"}})
    );
    let ca = find(&objects, "Certificate", "pinswap-ca");
    assert_eq!(ca["spec"]["isCA"], true);
    assert_eq!(
        ca["spec"]["issuerRef"],
        json!({"kind": "Issuer", "name": "pinswap-selfsigned"})
    );
    assert_eq!(
        find(&objects, "Issuer", "pinswap-selfsigned")["spec"],
        json!({"selfSigned": {}})
    );

    let self_signed = manifests(&["--tls", "self-signed"]).await;
    let config: MutatingWebhookConfiguration = typed(find(
        &self_signed,
        "MutatingWebhookConfiguration",
        "pinswap",
    ));
    assert!(
        config.metadata.annotations.is_none(),
        "no cert-manager annotation"
    );
}

/// (kind, namespace, name) → rules, for every Role and ClusterRole, and
/// the subject every binding grants it to.
fn grants(objects: &[Value]) -> BTreeMap<(String, String, String), Vec<PolicyRule>> {
    let mut out = BTreeMap::new();
    for o in objects {
        let k = key(o);
        match k.0.as_str() {
            "Role" => {
                out.insert(k, typed::<Role>(o).rules.unwrap());
            }
            "ClusterRole" => {
                out.insert(k, typed::<ClusterRole>(o).rules.unwrap());
            }
            "RoleBinding" | "ClusterRoleBinding" => {
                let b: RoleBinding = typed(&json!({
                    "metadata": o["metadata"], "roleRef": o["roleRef"], "subjects": o["subjects"],
                }));
                let s = &b.subjects.unwrap()[0];
                assert_eq!(
                    (s.kind.as_str(), s.name.as_str()),
                    ("ServiceAccount", "pinswap")
                );
                assert_eq!(
                    b.role_ref.name, k.2,
                    "each binding grants its namesake role"
                );
                assert_eq!(b.role_ref.kind, k.0.trim_end_matches("Binding"));
            }
            _ => {}
        }
    }
    out
}

fn rules(rules: &[PolicyRule]) -> Vec<String> {
    rules
        .iter()
        .map(|r| {
            format!(
                "{}/{} {} {}",
                r.api_groups.as_ref().unwrap().join(","),
                r.resources.as_ref().unwrap().join(","),
                r.verbs.join(","),
                r.resource_names.clone().unwrap_or_default().join(",")
            )
        })
        .collect()
}

fn k(kind: &str, ns: &str, name: &str) -> (String, String, String) {
    (kind.into(), ns.into(), name.into())
}

/// Cluster-scoped objects carry the namespace outside the default one, so
/// two installs never share them (`-n self-signed` once met the default
/// install's `pinswap-self-signed`), and the self-signed bootstrap is told
/// the webhook configuration's name.
#[tokio::test]
async fn cluster_scoped_names_follow_the_namespace() {
    let objects = manifests(&["--tls", "self-signed", "-n", "mirror"]).await;
    let cluster: Vec<String> = objects
        .iter()
        .map(key)
        .filter(|(_, ns, _)| ns.is_empty())
        .map(|(kind, _, name)| format!("{kind}/{name}"))
        .collect();
    assert_eq!(
        cluster,
        [
            "Namespace/mirror",
            "ClusterRole/pinswap:mirror",
            "ClusterRoleBinding/pinswap:mirror",
            "ClusterRole/pinswap-self-signed:mirror",
            "ClusterRoleBinding/pinswap-self-signed:mirror",
            "MutatingWebhookConfiguration/pinswap-mirror",
        ]
    );
    let role: ClusterRole = typed(find(&objects, "ClusterRole", "pinswap-self-signed:mirror"));
    assert_eq!(
        role.rules.unwrap()[0].resource_names.as_deref(),
        Some(&["pinswap-mirror".to_owned()][..])
    );
    let d: Deployment = typed(find(&objects, "Deployment", "pinswap"));
    let args = d.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    let at = args
        .iter()
        .position(|a| a == "--webhook-configuration")
        .expect("the flag");
    assert_eq!(args[at + 1], "pinswap-mirror");
    let hook: MutatingWebhookConfiguration = typed(find(
        &objects,
        "MutatingWebhookConfiguration",
        "pinswap-mirror",
    ));
    let service = hook.webhooks.unwrap()[0]
        .client_config
        .service
        .clone()
        .unwrap();
    assert_eq!(
        (service.namespace.as_str(), service.name.as_str()),
        ("mirror", "pinswap")
    );

    // No two installs share a cluster-scoped name, whatever the namespaces.
    let mut seen = BTreeMap::new();
    for ns in [
        "pinswap",
        "self-signed",
        "mirror",
        "self-signed-mirror",
        "mirror-self-signed",
    ] {
        for o in manifests(&["--tls", "self-signed", "-n", ns]).await {
            let (kind, namespace, name) = key(&o);
            if namespace.is_empty() && kind != "Namespace" {
                let before = seen.insert(format!("{kind}/{name}"), ns);
                assert!(
                    before.is_none(),
                    "{kind}/{name} from -n {ns} and -n {before:?}"
                );
            }
        }
    }
}

/// The grants `pinswap manifests --tls cert-manager --config FILE` prints.
async fn cert_manager_grants(config: &Path) -> BTreeMap<(String, String, String), Vec<PolicyRule>> {
    let config = config.to_str().unwrap();
    grants(&manifests(&["--config", config, "--tls", "cert-manager"]).await)
}

#[tokio::test]
async fn rbac_grants_only_what_the_config_uses() {
    // Default config: recovery on everywhere, no pull secrets; cert-manager
    // (the self-signed bootstrap's own grants are checked on their own).
    let g = grants(&manifests(&["--tls", "cert-manager"]).await);
    assert_eq!(
        g.keys().cloned().collect::<Vec<_>>(),
        [
            k("ClusterRole", "", "pinswap"),
            k("Role", "pinswap", "pinswap-leader")
        ]
    );
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        [
            "/namespaces list,watch ",
            "/pods get,list,watch ",
            "events.k8s.io/events create,patch ",
            "apps/daemonsets,deployments,replicasets,statefulsets list,watch ",
            "batch/cronjobs,jobs list,watch "
        ]
    );
    assert_eq!(
        rules(&g[&k("Role", "pinswap", "pinswap-leader")]),
        [
            "coordination.k8s.io/leases create ",
            "coordination.k8s.io/leases get,update pinswap-leader"
        ]
    );

    // Pull secrets, recovery limited to two namespaces, self-signed TLS.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(&config, PULL_SECRETS_CONFIG).unwrap();
    let objects = manifests(&["--config", config.to_str().unwrap(), "--tls", "self-signed"]).await;
    let g = grants(&objects);
    assert_eq!(
        g.keys().cloned().collect::<Vec<_>>(),
        [
            k("ClusterRole", "", "pinswap"),
            k("ClusterRole", "", "pinswap-self-signed"),
            k("Role", "apps", "pinswap-recovery"),
            k("Role", "pinswap", "pinswap-leader"),
            k("Role", "pinswap", "pinswap-self-signed"),
            k("Role", "web", "pinswap-recovery"),
        ]
    );
    // The watched namespaces' labels, by name: the webhook's scope.
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        [
            "/namespaces list,watch apps,web",
            "/secrets,serviceaccounts get "
        ]
    );
    for ns in ["apps", "web"] {
        assert_eq!(
            rules(&g[&k("Role", ns, "pinswap-recovery")]),
            [
                "/pods get,list,watch ",
                "events.k8s.io/events create,patch ",
                "apps/daemonsets,deployments,replicasets,statefulsets list,watch ",
                "batch/cronjobs,jobs list,watch "
            ]
        );
    }
    assert_eq!(
        rules(&g[&k("Role", "pinswap", "pinswap-self-signed")]),
        ["/secrets create ", "/secrets get,update pinswap-tls"]
    );
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap-self-signed")]),
        ["admissionregistration.k8s.io/mutatingwebhookconfigurations get,patch pinswap"]
    );

    // Backfill off: the Pod watch's rules alone, no workload kind.
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nbackfill: {enabled: false}\n",
    )
    .unwrap();
    let g = cert_manager_grants(&config).await;
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        [
            "/namespaces list,watch ",
            "/pods get,list,watch ",
            "events.k8s.io/events create,patch "
        ]
    );

    // Recovery off and no pull secrets: no ClusterRole at all.
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nrecovery: {enabled: false}\n",
    )
    .unwrap();
    let g = cert_manager_grants(&config).await;
    assert!(g.is_empty(), "{g:?}");

    // A platforms filter: the leader reads the nodes' os/arch, cluster-wide
    // even when recovery watches some namespaces only; not without recovery.
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nplatforms: [linux/amd64]\nrecovery: {namespaces: [apps]}\n",
    )
    .unwrap();
    let g = cert_manager_grants(&config).await;
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        ["/namespaces list,watch apps", "/nodes list,watch "]
    );
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nplatforms: [linux/amd64]\nrecovery: {enabled: false}\n",
    )
    .unwrap();
    let g = cert_manager_grants(&config).await;
    assert!(g.is_empty(), "{g:?}");
}

#[tokio::test]
async fn the_deployment_is_hardened_and_rolls_on_config_changes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    let text = "target: {registry: mirror.example.com/cache}\nserver: {listen: 0.0.0.0:9443, healthListen: 0.0.0.0:9090}\n";
    std::fs::write(&config, text).unwrap();
    let objects = manifests(&[
        "--config",
        config.to_str().unwrap(),
        "--replicas",
        "3",
        "--image",
        "registry.example.com/pinswap:1",
    ])
    .await;
    let cm: ConfigMap = typed(find(&objects, "ConfigMap", "pinswap"));
    assert_eq!(cm.data.unwrap()["config.yaml"], text, "stored verbatim");
    let d: Deployment = typed(find(&objects, "Deployment", "pinswap"));
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(3));
    let template = spec.template;
    let notes = template.metadata.unwrap().annotations.unwrap();
    assert_eq!(
        notes["checksum/config"],
        hex::encode(Sha256::digest(text.as_bytes()))
    );
    let pod = template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("pinswap"));
    let anti = pod.affinity.unwrap().pod_anti_affinity.unwrap();
    let term = &anti
        .preferred_during_scheduling_ignored_during_execution
        .unwrap()[0];
    assert_eq!(
        term.pod_affinity_term.topology_key,
        "kubernetes.io/hostname"
    );
    let psc = pod.security_context.unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some("registry.example.com/pinswap:1"));
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    let ports: Vec<(String, i32)> = c
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(
        ports,
        [("webhook".to_owned(), 9443), ("http".to_owned(), 9090)]
    );
    for (probe, path) in [
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            serde_json::to_value(&get.port).unwrap(),
            "http",
            "the health port"
        );
    }
    let resources = c.resources.as_ref().unwrap();
    assert!(resources.requests.as_ref().unwrap().contains_key("memory"));
    assert!(resources.limits.as_ref().unwrap().contains_key("memory"));
    let args = c.args.clone().unwrap();
    assert_eq!(
        args[..3],
        ["serve", "--config", "/etc/pinswap/config/config.yaml"]
    );
    let mounts: Vec<&str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    assert!(mounts.contains(&"/etc/pinswap/config"), "{mounts:?}");

    let svc: Service = typed(find(&objects, "Service", "pinswap"));
    let ports: Vec<(i32, String)> = svc
        .spec
        .unwrap()
        .ports
        .unwrap()
        .into_iter()
        .map(|p| {
            (
                p.port,
                serde_json::to_value(p.target_port)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [(443, "webhook".into())],
        "the plain-HTTP health port stays off the webhook's Service"
    );
    let metrics: Service = typed(find(&objects, "Service", "pinswap-metrics"));
    assert_eq!(
        metrics.metadata.labels.unwrap()["app.kubernetes.io/component"],
        "metrics"
    );
    let spec = metrics.spec.unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "headless");
    assert_eq!(spec.selector.unwrap()["app.kubernetes.io/name"], "pinswap");
    let port = &spec.ports.unwrap()[0];
    assert_eq!(
        (
            port.name.as_deref(),
            port.port,
            serde_json::to_value(&port.target_port).unwrap()
        ),
        (Some("http"), 9090, json!("http"))
    );
    assert!(pod.image_pull_secrets.is_none(), "none unless asked for");
    let pdb: PodDisruptionBudget = typed(find(&objects, "PodDisruptionBudget", "pinswap"));
    assert_eq!(
        serde_json::to_value(pdb.spec.unwrap().max_unavailable).unwrap(),
        1
    );

    // Another config, another checksum: the Deployment rolls.
    std::fs::write(&config, format!("{text}pin: false\n")).unwrap();
    let again = manifests(&["--config", config.to_str().unwrap()]).await;
    let d: Deployment = typed(find(&again, "Deployment", "pinswap"));
    let other = d
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap();
    assert_ne!(other["checksum/config"], notes["checksum/config"]);
    assert_eq!(other["checksum/tls"], notes["checksum/tls"]);
}

/// `failurePolicy: closed` holds while pinswap is down too: the API server
/// is told to deny what it cannot get an answer for.
#[tokio::test]
async fn a_fail_closed_config_renders_a_fail_closed_webhook() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    let policy = |objects: &[Value]| {
        let hook: MutatingWebhookConfiguration =
            typed(find(objects, "MutatingWebhookConfiguration", "pinswap"));
        hook.webhooks.unwrap()[0].failure_policy.clone().unwrap()
    };
    for (text, want) in [
        (
            "target: {registry: m.example.com}\nfailurePolicy: closed\n",
            "Fail",
        ),
        (
            "target: {registry: m.example.com}\nfailurePolicy: open\n",
            "Ignore",
        ),
        ("target: {registry: m.example.com}\n", "Ignore"),
    ] {
        std::fs::write(&config, text).unwrap();
        for tls in ["cert-manager", "self-signed"] {
            let objects = manifests(&["--config", config.to_str().unwrap(), "--tls", tls]).await;
            assert_eq!(policy(&objects), want, "{tls}: {text}");
        }
    }
}

#[tokio::test]
async fn image_pull_secrets_reach_the_pod_spec() {
    let objects = manifests(&[
        "--image-pull-secret",
        "regcred",
        "--image-pull-secret",
        "ghcr.io-token",
    ])
    .await;
    check_round_trip(&objects);
    let d: Deployment = typed(find(&objects, "Deployment", "pinswap"));
    let names: Vec<String> = d
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .image_pull_secrets
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, ["regcred", "ghcr.io-token"]);
}

/// A loopback target is only the Pod itself from inside a Pod: warned
/// about, naming the key, and the objects are printed all the same.
#[tokio::test]
async fn a_loopback_target_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    for (target, loopback) in [
        ("127.0.0.1:5000/mirror", true),
        ("127.1.2.3:5000", true),
        ("localhost:5000/mirror", true),
        ("\"[::1]:5000\"", true),
        ("10.0.0.5:5000/mirror", false),
        ("registry.example.com/mirror", false),
    ] {
        std::fs::write(
            &config,
            format!("target: {{registry: {target}}}\nsource: {{registries: [{{registry: docker.io}}]}}\n"),
        )
        .unwrap();
        let (code, out, err) = common::run_pinswap(&[
            "manifests",
            "--config",
            config.to_str().unwrap(),
            "--image",
            "registry.example.com/pinswap:0.1.0",
        ])
        .await;
        assert_eq!(code, 0, "{target}: {err}");
        assert!(
            out.contains("kind: MutatingWebhookConfiguration"),
            "{target}"
        );
        let warned = err.lines().any(|l| {
            l.starts_with(&format!(
                "warning: target.registry {}: a loopback address, which Pods cannot reach",
                target.trim_matches('"')
            ))
        });
        assert_eq!(warned, loopback, "{target}: {err}");
    }
}

/// The help's example writes the install somewhere other than the
/// config's own file name.
#[tokio::test]
async fn the_help_example_never_overwrites_the_config() {
    let (code, out, err) = common::run_pinswap(&["manifests", "--help"]).await;
    assert_eq!(code, 0, "{err}");
    let examples = out.split_once("Examples:").expect("examples").1;
    assert!(!examples.contains("> pinswap.yaml"), "{examples}");
    assert!(examples.contains("> pinswap-install.yaml"), "{examples}");
}

#[tokio::test]
async fn bad_options_and_configs_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\ncopyPolicy: later\n",
    )
    .unwrap();
    let cases = [
        (vec!["--namespace", "Bad_NS"], "--namespace \"Bad_NS\""),
        (vec!["--replicas", "0"], "--replicas 0"),
        (
            vec!["--image-pull-secret", "Reg_Cred"],
            "--image-pull-secret \"Reg_Cred\": not a valid Secret name",
        ),
        (
            vec!["--namespace", "default"],
            "--namespace default: a namespace Kubernetes itself uses",
        ),
        (
            vec!["--namespace", "kube-system"],
            "--namespace kube-system: a namespace Kubernetes itself uses",
        ),
        (
            vec!["--image", "Registry.Example.com/PinSwap"],
            "--image \"Registry.Example.com/PinSwap\"",
        ),
        (
            vec!["--config", "/nonexistent/c.yaml"],
            "--config /nonexistent/c.yaml",
        ),
        (vec!["--config", config.to_str().unwrap()], "copyPolicy"),
        (vec!["--tls", "vault"], "--tls"),
    ];
    for (args, expected) in cases {
        let mut all = vec!["manifests"];
        all.extend_from_slice(&args);
        let (code, out, err) = common::run_pinswap(&all).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: nothing printed on error");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

/// The objects `kubectl kustomize DIR` renders.
async fn kustomize(dir: &Path) -> Vec<Value> {
    let out = tokio::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .await
        .expect("kubectl (1.32+, with kustomize v5) must be installed for this test");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    documents(&String::from_utf8(out.stdout).unwrap())
}

/// `kubectl kustomize deploy/overlays/<mode>` renders exactly what
/// `pinswap manifests --tls <mode>` prints.
#[tokio::test]
async fn the_kustomize_overlays_render_what_pinswap_manifests_prints() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for mode in ["cert-manager", "self-signed"] {
        let rendered: BTreeMap<_, _> = kustomize(&repo.join("deploy/overlays").join(mode))
            .await
            .into_iter()
            .map(|o| (key(&o), o))
            .collect();
        let printed: BTreeMap<_, _> = manifests(&["--tls", mode])
            .await
            .into_iter()
            .map(|o| (key(&o), o))
            .collect();
        assert_eq!(
            rendered.keys().collect::<Vec<_>>(),
            printed.keys().collect::<Vec<_>>(),
            "{mode}: the same objects"
        );
        for (k, want) in &printed {
            assert_eq!(
                &rendered[k], want,
                "{mode}: {k:?} differs between deploy/ and pinswap manifests"
            );
        }
    }
}

/// Copies the directory tree `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Eviction is granted only when the config turns it on: `pinswap
/// manifests` adds `pods/eviction` create and `jobs` get (a Job's Pod is
/// evicted only when the Job allows it) beside the Pod rules, the
/// kustomize base has none, and `deploy/components/evict` adds exactly what
/// `pinswap manifests` grants.
#[tokio::test]
async fn pods_eviction_is_granted_only_with_recovery_evict_enabled() {
    let cluster_role = |objects: &[Value]| -> Vec<String> {
        let g = grants(objects);
        rules(&g[&k("ClusterRole", "", "pinswap")])
    };
    let base = cluster_role(&manifests(&["--tls", "cert-manager"]).await);
    assert!(!base.iter().any(|r| r.contains("eviction")), "{base:?}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "target: {registry: mirror.example.com/cache}\nrecovery: {evict: {enabled: true}}\n",
    )
    .unwrap();
    let printed = manifests(&[
        "--tls",
        "cert-manager",
        "--config",
        config.to_str().unwrap(),
    ])
    .await;
    assert_eq!(
        cluster_role(&printed),
        [
            "/namespaces list,watch ",
            "/pods get,list,watch ",
            "events.k8s.io/events create,patch ",
            "apps/daemonsets,deployments,replicasets,statefulsets list,watch ",
            "batch/cronjobs,jobs list,watch ",
            "/pods/eviction create ",
            "batch/jobs get "
        ]
    );
    // Per namespace with recovery.namespaces.
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nrecovery: {namespaces: [apps], evict: {enabled: true}}\n",
    )
    .unwrap();
    let g = grants(&manifests(&["--config", config.to_str().unwrap()]).await);
    assert_eq!(
        rules(&g[&k("Role", "apps", "pinswap-recovery")]),
        [
            "/pods get,list,watch ",
            "events.k8s.io/events create,patch ",
            "apps/daemonsets,deployments,replicasets,statefulsets list,watch ",
            "batch/cronjobs,jobs list,watch ",
            "/pods/eviction create ",
            "batch/jobs get "
        ]
    );

    // kustomize: the cert-manager overlay with the component.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    copy_tree(&repo.join("deploy"), &dir.path().join("deploy"));
    let overlay = dir.path().join("evict");
    std::fs::create_dir(&overlay).unwrap();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../deploy/overlays/cert-manager]\ncomponents: [../deploy/components/evict]\n",
    )
    .unwrap();
    let rendered = kustomize(&overlay).await;
    assert_eq!(
        find(&rendered, "ClusterRole", "pinswap"),
        find(&printed, "ClusterRole", "pinswap")
    );
}

/// No image is published yet: without `--image` the output names the
/// default but says so on stderr; with it, nothing is said.
#[tokio::test]
async fn the_unpublished_default_image_is_pointed_out() {
    let (code, out, err) = common::run_pinswap(&["manifests"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning: no --image: ghcr.io/pinswap/pinswap:"),
        "{err}"
    );
    let d: Deployment = typed(find(&documents(&out), "Deployment", "pinswap"));
    let image = d.spec.unwrap().template.spec.unwrap().containers[0]
        .image
        .clone()
        .unwrap();
    assert!(image.starts_with("ghcr.io/pinswap/pinswap:"), "{image}");
    let (code, _, err) =
        common::run_pinswap(&["manifests", "--image", "registry.example.com/pinswap:1"]).await;
    assert_eq!(code, 0);
    assert!(!err.contains("--image"), "{err}");
}
