//! `pinswap manifests`, `deploy/` and `pinswap serve --self-signed`: the
//! objects decode into their k8s-openapi types without losing a field, the
//! webhook and RBAC are exactly what they should be, kustomize renders the
//! same objects, and the self-signed bootstrap converges to one Secret and a
//! matching caBundle against the in-process Kubernetes API server.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use common::kube::KubeApi;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use pinswap::install::self_signed::{self, CaBundle, SelfSigned};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// `pinswap manifests ARGS`, decoded document by document.
async fn manifests(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["manifests"];
    all.extend_from_slice(args);
    let (code, out, err) = common::run_pinswap(&all).await;
    assert_eq!(code, 0, "pinswap manifests {args:?}: {err}");
    documents(&out)
}

fn documents(yaml: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("a YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

fn key(v: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    (
        s(&v["kind"]),
        s(&v["metadata"]["namespace"]),
        s(&v["metadata"]["name"]),
    )
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn typed<K: DeserializeOwned>(v: &Value) -> K {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{}: {e}", key(v).0))
}

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

#[tokio::test]
async fn rbac_grants_only_what_the_config_uses() {
    // Default config: recovery on everywhere, no pull secrets, cert-manager.
    let g = grants(&manifests(&[]).await);
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
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        ["/secrets,serviceaccounts get "]
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
    let g = grants(&manifests(&["--config", config.to_str().unwrap()]).await);
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        [
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
    let g = grants(&manifests(&["--config", config.to_str().unwrap()]).await);
    assert!(g.is_empty(), "{g:?}");

    // A platforms filter: the leader reads the nodes' os/arch, cluster-wide
    // even when recovery watches some namespaces only; not without recovery.
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nplatforms: [linux/amd64]\nrecovery: {namespaces: [apps]}\n",
    )
    .unwrap();
    let g = grants(&manifests(&["--config", config.to_str().unwrap()]).await);
    assert_eq!(
        rules(&g[&k("ClusterRole", "", "pinswap")]),
        ["/nodes list,watch "]
    );
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nplatforms: [linux/amd64]\nrecovery: {enabled: false}\n",
    )
    .unwrap();
    let g = grants(&manifests(&["--config", config.to_str().unwrap()]).await);
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

/// `kubectl kustomize deploy/overlays/<mode>` renders exactly what
/// `pinswap manifests --tls <mode>` prints.
#[tokio::test]
async fn the_kustomize_overlays_render_what_pinswap_manifests_prints() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for mode in ["cert-manager", "self-signed"] {
        let out = tokio::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(repo.join("deploy/overlays").join(mode))
            .output()
            .await
            .expect("kubectl (1.32+, with kustomize v5) must be installed for this test");
        assert!(
            out.status.success(),
            "kubectl kustomize {mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rendered: BTreeMap<_, _> = documents(&String::from_utf8(out.stdout).unwrap())
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

// ---- the self-signed bootstrap -------------------------------------------

const NS: &str = "pinswap";

/// The webhook configuration exactly as `pinswap manifests --tls
/// self-signed` prints it, stored in the test API server.
async fn install_webhook(api: &KubeApi) -> MutatingWebhookConfiguration {
    authorize(api);
    let objects = manifests(&["--tls", "self-signed"]).await;
    api.put_webhook_configuration(typed(find(
        &objects,
        "MutatingWebhookConfiguration",
        "pinswap",
    )))
}

/// The test API server answers as a cluster would for the RBAC `pinswap
/// manifests --tls self-signed` grants (recovery off, as in these tests).
fn authorize(api: &KubeApi) {
    let config = pinswap::config::Config::from_yaml(
        "target: {registry: 127.0.0.1:9/mirror}\nrecovery: {enabled: false}\n",
        "test",
    )
    .unwrap();
    api.authorize_install(&config, pinswap::install::manifests::Tls::SelfSigned);
}

fn bootstrap(api: &KubeApi, dir: &Path) -> SelfSigned {
    authorize(api);
    SelfSigned::new(
        api.client_in(NS),
        NS,
        "pinswap",
        "pinswap-tls",
        "pinswap",
        dir.join("tls.crt"),
        dir.join("tls.key"),
    )
}

fn data(secret: &Secret, key: &str) -> String {
    String::from_utf8(secret.data.as_ref().unwrap()[key].0.clone()).unwrap()
}

fn ca_bundle(api: &KubeApi) -> String {
    let config = api.webhook_configuration("pinswap").unwrap();
    let hooks = config.webhooks.unwrap();
    String::from_utf8(hooks[0].client_config.ca_bundle.clone().unwrap().0).unwrap()
}

fn posts(api: &KubeApi, path: &str) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path == path)
        .count()
}

#[tokio::test]
async fn replicas_bootstrapping_at_once_share_one_secret_and_a_matching_ca_bundle() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dirs: Vec<_> = (0..6).map(|_| tempfile::tempdir().unwrap()).collect();
    let replicas: Vec<_> = dirs.iter().map(|d| bootstrap(&api, d.path())).collect();
    let results = futures::future::join_all(replicas.iter().map(|r| r.bootstrap())).await;
    let materials: Vec<_> = results.into_iter().map(Result::unwrap).collect();

    let secret = api.secret(NS, "pinswap-tls").expect("the Secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let creates = posts(&api, "/api/v1/namespaces/pinswap/secrets");
    assert!(creates >= 2, "the replicas raced ({creates} creates)");
    for (m, dir) in materials.iter().zip(&dirs) {
        assert_eq!(
            m.cert_pem,
            data(&secret, "tls.crt"),
            "every replica uses the stored one"
        );
        assert_eq!(m.key_pem, data(&secret, "tls.key"));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("tls.crt")).unwrap(),
            m.cert_pem
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("tls.key")).unwrap(),
            m.key_pem
        );
    }
    assert_eq!(ca_bundle(&api), data(&secret, "ca.crt"));
    verify_chain(
        &data(&secret, "tls.crt"),
        &ca_bundle(&api),
        "pinswap.pinswap.svc",
    );

    // A second pass changes nothing.
    assert_eq!(replicas[0].secret().await.unwrap(), materials[0]);
    assert_eq!(
        replicas[0].patch_ca_bundle(&materials[0]).await.unwrap(),
        CaBundle::Unchanged
    );
}

/// The serving certificate chains to the CA bundle for `name`, checked by
/// rustls' own verifier, as the API server's client would.
fn verify_chain(cert_pem: &str, bundle_pem: &str, name: &str) {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(bundle_pem.as_bytes()) {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        roots.into(),
        rustls::crypto::ring::default_provider().into(),
    )
    .build()
    .unwrap();
    let leaf = CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap();
    verifier
        .verify_server_cert(
            &leaf,
            &[],
            &ServerName::try_from(name.to_owned()).unwrap(),
            &[],
            UnixTime::now(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
}

#[tokio::test]
async fn a_certificate_due_for_renewal_is_replaced_and_the_old_ca_stays_trusted() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let first = replica.bootstrap().await.unwrap();

    // Ten days left: inside the 30-day renewal window.
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    let soon = SystemTime::now() + Duration::from_secs(10 * 24 * 3600);
    secret.metadata.annotations.as_mut().unwrap().insert(
        self_signed::NOT_AFTER.into(),
        humantime::format_rfc3339_seconds(soon).to_string(),
    );
    secret
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("team".into(), "platform".into());
    api.put_secret(NS, secret);

    let renewed = replica.secret().await.unwrap();
    assert_ne!(renewed.cert_pem, first.cert_pem);
    assert!(renewed.not_after > soon + Duration::from_secs(300 * 24 * 3600));
    assert!(
        renewed.ca_pem.ends_with(&first.ca_pem),
        "the previous CA stays in the bundle"
    );
    let stored = api.secret(NS, "pinswap-tls").unwrap();
    assert_eq!(data(&stored, "tls.crt"), renewed.cert_pem);
    assert_eq!(
        stored.metadata.labels.unwrap()["team"],
        "platform",
        "others' labels kept"
    );
    verify_chain(
        &renewed.cert_pem,
        &renewed.ca_pem,
        "pinswap.pinswap.svc.cluster.local",
    );
    verify_chain(&first.cert_pem, &renewed.ca_pem, "pinswap.pinswap.svc");

    assert!(replica.write_files(&renewed).await.unwrap());
    assert!(
        !replica.write_files(&renewed).await.unwrap(),
        "unchanged files are left alone"
    );
    assert_eq!(
        replica.patch_ca_bundle(&renewed).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(ca_bundle(&api), renewed.ca_pem);
}

#[tokio::test]
async fn a_reset_ca_bundle_is_restored_and_other_webhooks_are_left_alone() {
    common::init();
    let api = KubeApi::start().await;
    let mut config = install_webhook(&api).await;
    // A second webhook in the same configuration, calling someone else.
    let mut other = config.webhooks.as_ref().unwrap()[0].clone();
    other.name = "other.example.com".into();
    other.client_config.service.as_mut().unwrap().name = "other".into();
    config.webhooks.as_mut().unwrap().insert(0, other);
    config.metadata.resource_version = None;
    api.put_webhook_configuration(config);

    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let m = replica.bootstrap().await.unwrap();
    let hooks = api
        .webhook_configuration("pinswap")
        .unwrap()
        .webhooks
        .unwrap();
    assert!(hooks[0].client_config.ca_bundle.is_none(), "not ours");
    assert_eq!(
        hooks[1].client_config.ca_bundle.as_ref().unwrap().0,
        m.ca_pem.as_bytes()
    );

    // `kubectl apply` of a manifest with an empty caBundle, say.
    let mut reset = api.webhook_configuration("pinswap").unwrap();
    reset.webhooks.as_mut().unwrap()[1].client_config.ca_bundle = None;
    api.put_webhook_configuration(reset);
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Patched
    );
    let hooks = api
        .webhook_configuration("pinswap")
        .unwrap()
        .webhooks
        .unwrap();
    assert_eq!(
        hooks[1].client_config.ca_bundle.as_ref().unwrap().0,
        m.ca_pem.as_bytes()
    );
    assert!(hooks[0].client_config.ca_bundle.is_none());
}

#[tokio::test]
async fn a_missing_webhook_configuration_does_not_stop_the_bootstrap() {
    common::init();
    let api = KubeApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let m = replica
        .bootstrap()
        .await
        .expect("serves without the webhook object");
    assert!(dir.path().join("tls.crt").exists());
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Missing
    );
    install_webhook(&api).await;
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(ca_bundle(&api), m.ca_pem);
}

/// Two `pinswap serve --self-signed` processes started at once, as two
/// replicas: one Secret, a matching caBundle, and both serve the stored
/// certificate over HTTPS to a client that trusts only the caBundle.
#[tokio::test]
async fn two_serve_processes_come_up_with_one_shared_certificate() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{}\"}}\n\
             users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test, namespace: {NS}}}\n\
             current-context: test\n",
            api.url()
        ),
    )
    .unwrap();
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for i in 0..2 {
        let (port, health) = (common::registry::free_port(), common::registry::free_port());
        let config = dir.path().join(format!("c{i}.yaml"));
        std::fs::write(
            &config,
            format!(
                "target: {{registry: 127.0.0.1:9/mirror, insecure: true}}\nrecovery: {{enabled: false}}\n\
                 identity: {{scanRate: 0}}\nserver: {{listen: 127.0.0.1:{port}, healthListen: 127.0.0.1:{health}}}\n"
            ),
        )
        .unwrap();
        let tls = dir.path().join(format!("tls{i}"));
        let child = tokio::process::Command::new(common::pinswap_bin())
            .args(["serve", "--self-signed", "--config"])
            .arg(&config)
            .arg("--tls-cert")
            .arg(tls.join("tls.crt"))
            .arg("--tls-key")
            .arg(tls.join("tls.key"))
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", NS)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .kill_on_drop(true)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        children.push(child);
        ports.push((port, health));
    }
    let http = common::registry::http_client(None);
    for (_, health) in &ports {
        let url = format!("http://127.0.0.1:{health}/healthz");
        let mut up = false;
        for _ in 0..100 {
            if http
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !up {
            let child = children.pop().unwrap();
            let out = child.wait_with_output().await.unwrap();
            panic!(
                "serve did not come up: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let secret = api.secret(NS, "pinswap-tls").expect("one Secret");
    let bundle = ca_bundle(&api);
    assert_eq!(bundle, data(&secret, "ca.crt"));

    let served = data(&secret, "tls.crt");
    let ca = reqwest::Certificate::from_pem(bundle.as_bytes()).unwrap();
    for (port, _) in &ports {
        // The API server calls https://pinswap.pinswap.svc:443/mutate.
        let client = reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only([ca.clone()])
            .resolve(
                "pinswap.pinswap.svc",
                std::net::SocketAddr::from(([127, 0, 0, 1], *port)),
            )
            .tls_info(true)
            .build()
            .unwrap();
        let resp = client
            .post(format!("https://pinswap.pinswap.svc:{port}/mutate"))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("TLS handshake trusting only the caBundle");
        assert_eq!(resp.status(), 400, "an empty review is refused");
        let info = resp.extensions().get::<reqwest::tls::TlsInfo>().unwrap();
        use rustls::pki_types::pem::PemObject;
        let want = rustls::pki_types::CertificateDer::from_pem_slice(served.as_bytes()).unwrap();
        assert_eq!(
            info.peer_certificate(),
            Some(want.as_ref()),
            "the stored certificate"
        );
    }
    let patches = api
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH")
        .count();
    assert!(
        (1..=2).contains(&patches),
        "one caBundle patch per replica at most: {patches}"
    );
}

#[tokio::test]
async fn a_secret_that_does_not_serve_is_replaced_and_a_foreign_one_is_named() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let good = replica.bootstrap().await.unwrap();

    // Garbage certificate, annotations still claiming a long life (a bad
    // restore, a hand edit): replaced, not served.
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    secret.data.as_mut().unwrap().insert(
        "tls.crt".into(),
        k8s_openapi::ByteString(
            b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n".to_vec(),
        ),
    );
    api.put_secret(NS, secret);
    let fresh = replica.bootstrap().await.unwrap();
    assert_ne!(fresh.cert_pem, good.cert_pem);
    verify_chain(&fresh.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
    assert_eq!(
        data(&api.secret(NS, "pinswap-tls").unwrap(), "tls.crt"),
        fresh.cert_pem
    );

    // A key that belongs to another certificate: replaced too.
    let other = self_signed::generate(&fresh.dns_names, None).unwrap();
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    secret.data.as_mut().unwrap().insert(
        "tls.key".into(),
        k8s_openapi::ByteString(other.key_pem.into_bytes()),
    );
    api.put_secret(NS, secret);
    let again = replica.bootstrap().await.unwrap();
    assert_ne!(again.cert_pem, fresh.cert_pem);

    // An Opaque Secret of that name, made by someone else: its type cannot
    // change, so the error says what to do, and the Secret is untouched.
    let api = KubeApi::start().await;
    let opaque = Secret {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("pinswap-tls".into()),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    api.put_secret(NS, opaque);
    let e = bootstrap(&api, dir.path())
        .bootstrap()
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "Secret pinswap/pinswap-tls has type \"Opaque\"; delete it and pinswap creates its own"
    );
    assert_eq!(
        api.secret(NS, "pinswap-tls").unwrap().type_.as_deref(),
        Some("Opaque")
    );
}

#[tokio::test]
async fn a_replica_with_older_material_never_drops_a_newer_ca() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (bootstrap(&api, da.path()), bootstrap(&api, db.path()));
    let old = a.bootstrap().await.unwrap();
    // A renews (the bundle becomes new CA + old CA); B still holds `old`.
    let renewed = self_signed::generate(&old.dns_names, Some(&old)).unwrap();
    assert_eq!(
        a.patch_ca_bundle(&renewed).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(b.patch_ca_bundle(&old).await.unwrap(), CaBundle::Unchanged);
    assert_eq!(ca_bundle(&api), renewed.ca_pem, "B left A's bundle alone");
    verify_chain(&renewed.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
    verify_chain(&old.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
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
