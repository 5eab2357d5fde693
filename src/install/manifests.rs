//! The Kubernetes objects of an install, as `pinswap manifests` prints them
//! (in the manner of `linkerd install | kubectl apply -f -`).
//!
//! Every object is built from its k8s-openapi type, so a misspelt field
//! cannot compile; the cert-manager Issuer and Certificate have no such
//! type and are written as JSON against cert-manager's `v1` schema.
//! RBAC follows what the running process calls (README, "RBAC"): nothing
//! is granted that the config does not use.

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, LocalObjectReference, Namespace, ObjectFieldSelector,
    PodAffinityTerm, PodAntiAffinity, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SeccompProfile, SecretVolumeSource, Service, ServiceAccount, ServicePort,
    ServiceSpec, Volume, VolumeMount, WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

use super::{IGNORE_LABEL, NAME, TIMEOUT_SECONDS, TLS_SECRET, WEBHOOK, dns_names};
use crate::config::{Config, FailurePolicy};
use crate::registry::check::sha256_digest;

/// Where the ConfigMap's `config.yaml` is mounted in the container.
pub const CONFIG_PATH: &str = "/etc/pinswap/config/config.yaml";
/// Optional Secret mounted at [`REGISTRY_AUTH_DIR`] for the files that
/// `target.auth` and `source.registries[].auth` reference.
pub const REGISTRY_AUTH_SECRET: &str = "pinswap-registry-auth";
/// Mount point of [`REGISTRY_AUTH_SECRET`] (the paths `pinswap config
/// default` suggests).
pub const REGISTRY_AUTH_DIR: &str = "/var/run/secrets/pinswap";
/// The cert-manager Certificate that fills [`TLS_SECRET`].
pub const CERTIFICATE: &str = "pinswap-webhook";
/// The cert-manager self-signed Issuer, which only signs the CA.
pub const ISSUER: &str = "pinswap-selfsigned";
/// The cert-manager CA Certificate (and its Secret).
pub const CA_CERTIFICATE: &str = "pinswap-ca";
/// The cert-manager CA Issuer, which signs the serving certificate.
pub const CA_ISSUER: &str = "pinswap-ca";
/// Name of the RBAC objects that only the self-signed bootstrap needs.
pub const SELF_SIGNED_RBAC: &str = "pinswap-self-signed";
/// Name of the Role that lets the replicas elect a leader.
pub const LEADER_RBAC: &str = "pinswap-leader";
/// Name of the per-namespace Role used when `recovery.namespaces` is set.
pub const RECOVERY_RBAC: &str = "pinswap-recovery";
/// Name of the Role that lets the leader read the ConfigMap earlier
/// installs kept the retention record in (of the same name,
/// `crate::retention::CONFIG_MAP`), to carry it on to the target.
pub const RETENTION_RBAC: &str = "pinswap-retention";
/// Name of the Role that lets the leader write the registries it lists
/// for the node agents (the ConfigMap
/// `crate::nodeconfig::registries::CONFIG_MAP`, of the same name).
pub const REGISTRIES_RBAC: &str = "pinswap-registries";
/// Name of the Role that lets the leader write the warm set for the node
/// agents (the ConfigMap `crate::nodeconfig::warm::CONFIG_MAP`, of the
/// same name).
pub const WARM_SET_RBAC: &str = "pinswap-warm-set";
/// The headless Service that selects the replicas' health port
/// (`/metrics`, probes) for scraping, apart from the webhook's Service.
pub const METRICS_SERVICE: &str = "pinswap-metrics";
/// Pod template annotation: SHA-256 of `config.yaml`, so a config change
/// rolls the Deployment.
pub const CONFIG_CHECKSUM: &str = "checksum/config";
/// Pod template annotation: SHA-256 of the TLS setup (mode, Secret, DNS
/// names), so a change of certificate definition rolls the Deployment.
pub const TLS_CHECKSUM: &str = "checksum/tls";

/// How the webhook gets its serving certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    /// cert-manager issues it from a self-signed Issuer and injects the CA
    /// into the webhook (`cert-manager.io/inject-ca-from`).
    CertManager,
    /// `pinswap serve --self-signed` creates it, stores it in
    /// [`TLS_SECRET`] and patches the webhook's `caBundle` itself.
    SelfSigned,
}

impl Tls {
    /// The `--tls` value: `cert-manager` or `self-signed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tls::CertManager => "cert-manager",
            Tls::SelfSigned => "self-signed",
        }
    }
}

/// What an install is made of.
#[derive(Debug, Clone)]
pub struct Options {
    /// Namespace for every namespaced object (an RFC 1123 label).
    pub namespace: String,
    /// Deployment replicas (1 or more; 2 keeps admission up during drains).
    pub replicas: i32,
    /// Certificate source.
    pub tls: Tls,
    /// Container image reference of pinswap itself.
    pub image: String,
    /// Secrets (`kubernetes.io/dockerconfigjson`, in the install's
    /// namespace) the kubelet uses to pull [`Options::image`].
    pub image_pull_secrets: Vec<String>,
    /// The config file's text, stored verbatim in the ConfigMap.
    pub config_text: String,
    /// The same config, parsed and validated.
    pub config: Config,
    /// The node agent DaemonSet, when wanted.
    pub node_agent: Option<super::node_agent::NodeAgent>,
}

/// Why the objects cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// `--node-agent` with a config it cannot serve.
    #[error("--node-agent: {0}")]
    NodeAgent(String),
    /// `--node-agent-registry-auth-secret` the agent must not get.
    #[error("--node-agent-registry-auth-secret: {0}")]
    NodeAgentSecret(String),
    /// `--namespace` is not an RFC 1123 label.
    #[error(
        "--namespace {0:?}: not a valid namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"
    )]
    Namespace(String),
    /// `--namespace` names one Kubernetes itself uses.
    #[error(
        "--namespace {0}: a namespace Kubernetes itself uses; the output owns its namespace (labels it pinswap.dev/ignore=true, and kubectl delete -f removes it), so give pinswap its own"
    )]
    SystemNamespace(String),
    /// `--image` is not a container image reference.
    #[error(
        "--image {image:?}: {reason}; expected a reference such as registry.example.com/pinswap:0.1.0"
    )]
    Image {
        /// The value given.
        image: String,
        /// Why it does not parse.
        reason: String,
    },
    /// `--replicas` below 1.
    #[error("--replicas {0}: must be 1 or more")]
    Replicas(i32),
    /// `--image-pull-secret` is not a Secret name.
    #[error(
        "--image-pull-secret {0:?}: not a valid Secret name (lowercase letters, digits, '-' and '.', at most 253, starting and ending with a letter or digit)"
    )]
    ImagePullSecret(String),
    /// `server.admissionBudget` would outlast the API server's call.
    #[error(
        "server.admissionBudget: {budget} must be below the webhook's timeoutSeconds ({TIMEOUT_SECONDS}s), or the API server gives up first"
    )]
    Budget {
        /// The configured budget.
        budget: String,
    },
    /// The config cannot work inside the generated Deployment: one
    /// `KEY: why, and what to write instead` per problem.
    #[error("{}", .0.join("\n"))]
    InCluster(Vec<String>),
    /// A built object did not serialise (a bug).
    #[error("cannot serialise {kind}: {source}")]
    Serialize {
        /// The object kind.
        kind: &'static str,
        /// The serde error.
        source: serde_json::Error,
    },
}

/// Builds every object of an install, in apply order: Namespace,
/// ServiceAccount, RBAC, ConfigMap, the webhook's and the metrics Service,
/// Deployment,
/// PodDisruptionBudget, the cert-manager Issuers and Certificates (with
/// [`Tls::CertManager`]), and last the MutatingWebhookConfiguration, so the
/// webhook is registered only once its Service exists.
///
/// Each object is a JSON value with `apiVersion` and `kind`.
///
/// # Errors
/// [`InstallError::Namespace`], [`InstallError::Replicas`],
/// [`InstallError::ImagePullSecret`] and [`InstallError::Budget`] for
/// options that cannot work;
/// [`InstallError::InCluster`] listing every config setting the Pod could
/// not honour.
pub fn objects(opts: &Options) -> Result<Vec<Value>, InstallError> {
    if !is_dns_label(&opts.namespace) {
        return Err(InstallError::Namespace(opts.namespace.clone()));
    }
    if ["default", "kube-system", "kube-public", "kube-node-lease"]
        .contains(&opts.namespace.as_str())
    {
        return Err(InstallError::SystemNamespace(opts.namespace.clone()));
    }
    if let Err(e) = crate::reference::Reference::parse(&opts.image) {
        return Err(InstallError::Image {
            image: opts.image.clone(),
            reason: e.to_string(),
        });
    }
    if opts.replicas < 1 {
        return Err(InstallError::Replicas(opts.replicas));
    }
    if let Some(bad) = opts
        .image_pull_secrets
        .iter()
        .find(|s| !is_dns_subdomain(s))
    {
        return Err(InstallError::ImagePullSecret(bad.clone()));
    }
    if opts.config.server.admission_budget.as_secs_f64() >= f64::from(TIMEOUT_SECONDS) {
        return Err(InstallError::Budget {
            budget: humantime::format_duration(opts.config.server.admission_budget).to_string(),
        });
    }
    if opts.node_agent.is_some() && opts.config.source.image_pull_secrets {
        return Err(InstallError::NodeAgent(
            crate::nodeconfig::NodeConfigError::PrivateImages.to_string(),
        ));
    }
    if opts.node_agent.is_some()
        && matches!(opts.config.platforms, crate::config::Platforms::Only(_))
    {
        return Err(InstallError::NodeAgent(
            crate::nodeconfig::NodeConfigError::Platforms.to_string(),
        ));
    }
    if opts.node_agent.as_ref().map(|a| a.mode) == Some(crate::nodeconfig::Mode::DigestOnly)
        && opts.config.identity.collisions == crate::config::CollisionPolicy::Repair
    {
        return Err(InstallError::NodeAgent(
            crate::nodeconfig::NodeConfigError::RepairDigestOnly.to_string(),
        ));
    }
    if let Some(secret) = opts
        .node_agent
        .as_ref()
        .and_then(|a| a.registry_auth_secret.as_deref())
    {
        node_agent_secret_problem(&opts.config, secret).map_err(InstallError::NodeAgentSecret)?;
    }
    let problems = in_cluster_problems(&opts.config);
    if !problems.is_empty() {
        return Err(InstallError::InCluster(problems));
    }
    let ns = opts.namespace.as_str();
    let account = ServiceAccount {
        metadata: meta(NAME, Some(ns)),
        ..Default::default()
    };
    let mut out = vec![
        value("Namespace", &namespace(ns))?,
        value("ServiceAccount", &account)?,
    ];
    out.extend(rbac(opts)?);
    out.push(value("ConfigMap", &config_map(opts))?);
    out.push(value("Service", &service(opts))?);
    out.push(value("Service", &metrics_service(opts))?);
    out.push(value("Deployment", &deployment(opts))?);
    out.push(value("PodDisruptionBudget", &disruption_budget(ns))?);
    if let Some(agent) = &opts.node_agent {
        let (account, role, binding, daemonset) = super::node_agent::objects(
            agent,
            ns,
            &opts.image,
            &opts.image_pull_secrets,
            CONFIG_PATH,
            (CONFIG_CHECKSUM, &sha256_hex(opts.config_text.as_bytes())),
            super::node_agent::Published {
                registries: publishes_registries(opts),
                warm_set: prewarms(opts),
            },
        );
        out.push(value("ServiceAccount", &account)?);
        out.push(value("Role", &role)?);
        out.push(value("RoleBinding", &binding)?);
        if prewarms(opts) {
            // Its own Node only, in practice: RBAC cannot name the node a
            // Pod runs on (docs/security.md).
            let mut g = grant(
                &cluster_role_name(super::node_agent::NODE_AGENT, ns),
                None,
                ns,
                vec![rule(&[""], &["nodes"], &["get", "patch"], &[])],
            )?;
            for o in &mut g {
                if let Some(s) = o.pointer_mut("/subjects/0/name") {
                    *s = super::node_agent::NODE_AGENT.into();
                }
            }
            out.extend(g);
        }
        out.push(value("DaemonSet", &daemonset)?);
        if publishes_registries(opts) {
            out.push(value("ConfigMap", &registries_config_map(ns))?);
        }
        if prewarms(opts) {
            out.push(value("ConfigMap", &warm_set_config_map(ns))?);
        }
    }
    if opts.tls == Tls::CertManager {
        out.extend(cert_manager(ns));
    }
    out.push(value(
        "MutatingWebhookConfiguration",
        &webhook_configuration(opts),
    )?);
    Ok(out)
}

/// Why the node agent may not mount `secret`: it talks to the target
/// only to list it under a `"*"` allowlist, and never with the webhook's
/// push credentials.
fn node_agent_secret_problem(config: &Config, secret: &str) -> Result<(), String> {
    if !is_dns_subdomain(secret) {
        return Err(format!("{secret:?} is not a valid Secret name"));
    }
    if secret == REGISTRY_AUTH_SECRET {
        return Err(format!(
            "{secret} is the webhook's Secret, which can push to the target; every node would hold it. Name a Secret with read-only credentials"
        ));
    }
    if !config.source.registries.iter().any(|r| r.registry == "*") {
        return Err(
            "source.registries has no \"*\": the agent then renders from the config alone and never contacts the target".into(),
        );
    }
    if config.target.aws.is_some() {
        return Err(
            "target.aws: an ECR target is listed through the AWS API, not with registry credentials".into(),
        );
    }
    Ok(())
}

fn value<T: serde::Serialize>(kind: &'static str, object: &T) -> Result<Value, InstallError> {
    serde_json::to_value(object).map_err(|source| InstallError::Serialize { kind, source })
}

/// Renders objects as one multi-document YAML stream, with a header naming
/// how it was generated.
pub fn to_yaml(objects: &[Value], header: &str) -> String {
    let mut out = String::new();
    for line in header.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
    for object in objects {
        out.push_str("---\n");
        // Values built from k8s-openapi types and json! always serialise.
        out.push_str(&yaml_serde::to_string(object).unwrap_or_default());
    }
    out
}

/// Why a loopback `target.registry` (`localhost`, 127.0.0.0/8, `[::1]`)
/// will not work from the install, or `None`. A warning, not a refusal: a
/// cluster may route such a name somewhere (a proxy in the Pod, hostNetwork).
pub fn loopback_target(c: &Config) -> Option<String> {
    let target = crate::reference::MirrorTarget::parse(&c.target.registry).ok()?;
    crate::reference::is_loopback_registry(target.registry()).then(|| {
        format!(
            "target.registry {}: a loopback address, which Pods cannot reach: inside pinswap's Pods it is the Pod itself, so nothing is copied, and each node would pull rewritten images from its own loopback; name the registry by an address Pods and nodes both reach",
            c.target.registry
        )
    })
}

/// Settings that load fine but cannot work in the Deployment this module
/// writes: addresses the kubelet and the Service cannot reach, ports the
/// unprivileged container cannot bind, and credentials it cannot see.
fn in_cluster_problems(c: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut bad = |path: &str, message: String| out.push(format!("{path}: {message}"));
    for (path, addr, usual, other) in [
        (
            "server.listen",
            c.server.listen,
            8443,
            c.server.health_listen.port(),
        ),
        (
            "server.healthListen",
            c.server.health_listen,
            8080,
            c.server.listen.port(),
        ),
    ] {
        if !addr.ip().is_unspecified() {
            // Suggest a port the Pod can bind, and not the other listener's.
            let port = [addr.port(), usual, 9443, 9090]
                .into_iter()
                .find(|p| *p >= 1024 && *p != other)
                .unwrap_or(usual);
            bad(
                path,
                format!(
                    "{addr} is not reachable from the Service and the kubelet's probes; listen on 0.0.0.0:{port}"
                ),
            );
        } else if addr.port() < 1024 {
            bad(
                path,
                format!(
                    "port {} needs a capability the Pod drops (it runs as UID 65532 with none); use a port from 1024 up",
                    addr.port()
                ),
            );
        }
    }
    let mut auths = vec![("target.auth".to_owned(), c.target.auth.as_ref())];
    for (i, r) in c.source.registries.iter().enumerate() {
        auths.push((format!("source.registries[{i}].auth"), r.auth.as_ref()));
    }
    for (path, auth) in auths {
        let Some(auth) = auth else { continue };
        if auth.password_env.is_some() {
            bad(
                &format!("{path}.passwordEnv"),
                format!(
                    "the generated Deployment sets no such variable; use passwordFile under {REGISTRY_AUTH_DIR}/ (Secret {REGISTRY_AUTH_SECRET})"
                ),
            );
        }
        for (key, file) in [
            ("passwordFile", &auth.password_file),
            ("dockerConfigFile", &auth.docker_config_file),
        ] {
            if let Some(file) = file
                && !file.starts_with(REGISTRY_AUTH_DIR)
            {
                bad(
                    &format!("{path}.{key}"),
                    format!(
                        "{} is not mounted in the Pod; put the file in Secret {REGISTRY_AUTH_SECRET}, which is mounted at {REGISTRY_AUTH_DIR}/",
                        file.display()
                    ),
                );
            }
        }
    }
    out
}

/// Name of a ClusterRole and its binding: `base` in the default
/// namespace, else `base:NAMESPACE`. A namespace cannot contain `:`, so no
/// two installs (nor two roles of one install) share a name.
pub fn cluster_role_name(base: &str, namespace: &str) -> String {
    if namespace == NAME {
        base.to_owned()
    } else {
        format!("{base}:{namespace}")
    }
}

/// Name of the MutatingWebhookConfiguration (a DNS subdomain, so no `:`):
/// `pinswap` in the default namespace, else `pinswap-NAMESPACE`. One per
/// install, so distinct namespaces give distinct names.
pub fn webhook_configuration_name(namespace: &str) -> String {
    if namespace == NAME {
        NAME.to_owned()
    } else {
        format!("{NAME}-{namespace}")
    }
}

/// A DNS subdomain (RFC 1123), as Secret names are.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_dns_label(s: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(ok_char)
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/name".to_owned(), NAME.to_owned())])
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(labels()),
        ..Default::default()
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    sha256_digest(bytes).hex().to_owned()
}

fn namespace(ns: &str) -> Namespace {
    let mut metadata = meta(ns, None);
    // Belt and braces: the webhook's namespaceSelector also names it.
    metadata
        .labels
        .get_or_insert_default()
        .insert(IGNORE_LABEL.to_owned(), "true".to_owned());
    Namespace {
        metadata,
        ..Default::default()
    }
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str], names: &[&str]) -> PolicyRule {
    let v = |xs: &[&str]| xs.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(v(groups)),
        resources: Some(v(resources)),
        verbs: v(verbs),
        resource_names: (!names.is_empty()).then(|| v(names)),
        ..Default::default()
    }
}

fn subject(ns: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".into(),
        name: NAME.into(),
        namespace: Some(ns.to_owned()),
        ..Default::default()
    }]
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: "rbac.authorization.k8s.io".into(),
        kind: kind.into(),
        name: name.into(),
    }
}

/// A Role and its RoleBinding, or a ClusterRole and its binding.
fn grant(
    name: &str,
    namespace: Option<&str>,
    sa_ns: &str,
    rules: Vec<PolicyRule>,
) -> Result<[Value; 2], InstallError> {
    Ok(match namespace {
        Some(ns) => [
            value(
                "Role",
                &Role {
                    metadata: meta(name, Some(ns)),
                    rules: Some(rules),
                },
            )?,
            value(
                "RoleBinding",
                &RoleBinding {
                    metadata: meta(name, Some(ns)),
                    role_ref: role_ref("Role", name),
                    subjects: Some(subject(sa_ns)),
                },
            )?,
        ],
        None => [
            value(
                "ClusterRole",
                &ClusterRole {
                    metadata: meta(name, None),
                    rules: Some(rules),
                    ..Default::default()
                },
            )?,
            value(
                "ClusterRoleBinding",
                &ClusterRoleBinding {
                    metadata: meta(name, None),
                    role_ref: role_ref("ClusterRole", name),
                    subjects: Some(subject(sa_ns)),
                },
            )?,
        ],
    })
}

/// `list` and `watch` on the kinds whose Pod templates the leader watches
/// (src/watch/workloads.rs).
fn workload_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            &["apps"],
            &["daemonsets", "deployments", "replicasets", "statefulsets"],
            &["list", "watch"],
            &[],
        ),
        rule(&["batch"], &["cronjobs", "jobs"], &["list", "watch"], &[]),
    ]
}

/// `list` and `watch` on exactly the custom resources `customResources`
/// turns on (src/watch/resources.rs), a rule per API group, in the order
/// the config names them.
fn custom_resource_rules(c: &crate::config::CustomResources) -> Vec<PolicyRule> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for k in c.kinds() {
        match groups.iter_mut().find(|(g, _)| *g == k.group) {
            Some((_, rs)) if rs.contains(&k.resource) => {}
            Some((_, rs)) => rs.push(k.resource),
            None => groups.push((k.group, vec![k.resource])),
        }
    }
    groups
        .iter()
        .map(|(g, rs)| {
            let rs: Vec<&str> = rs.iter().map(String::as_str).collect();
            rule(&[g.as_str()], &rs, &["list", "watch"], &[])
        })
        .collect()
}

/// Least privilege for what the config turns on. Kubernetes cannot limit
/// `create` by resourceName, so each create is confined to one namespace.
/// The RBAC objects [`objects`] renders for `opts` (Roles, ClusterRoles
/// and their bindings to the `pinswap` ServiceAccount in
/// `opts.namespace`), without the checks of what a Pod can use. The tests'
/// API server authorises requests with them.
///
/// # Errors
/// [`InstallError::Serialize`] only.
pub fn rbac(opts: &Options) -> Result<Vec<Value>, InstallError> {
    let ns = opts.namespace.as_str();
    let c = &opts.config;
    let mut out = Vec::new();
    // Pull-failure recovery: read Pods, record Events (events.k8s.io/v1,
    // as kube-runtime's Recorder writes them, patching repeats).
    // The leader's workload-template watches run with the Pod watcher for
    // the backfill and retention (`Config::watches_workloads`).
    let workloads = c.watches_workloads();
    let watch = || {
        let mut rules = vec![
            rule(&[""], &["pods"], &["get", "list", "watch"], &[]),
            rule(&["events.k8s.io"], &["events"], &["create", "patch"], &[]),
        ];
        if workloads {
            rules.extend(workload_rules());
            rules.extend(custom_resource_rules(&c.custom_resources));
        }
        // Only when operators opt in: evicting disrupts. A Job's Pod is
        // evicted only when the Job's podFailurePolicy ignores it: read first.
        if c.recovery.evict.enabled {
            rules.push(rule(&[""], &["pods/eviction"], &["create"], &[]));
            rules.push(rule(&["batch"], &["jobs"], &["get"], &[]));
        }
        rules
    };
    let mut cluster = Vec::new();
    if c.recovery.enabled {
        // The leader keeps to the webhook's scope: it reads the namespaces'
        // labels (cluster-scoped; with recovery.namespaces only those, each
        // watched by name).
        let names: Vec<&str> = c.recovery.namespaces.iter().map(String::as_str).collect();
        cluster.push(rule(&[""], &["namespaces"], &["list", "watch"], &names));
        if c.recovery.namespaces.is_empty() {
            cluster.extend(watch());
        } else {
            for watched in &c.recovery.namespaces {
                out.extend(grant(RECOVERY_RBAC, Some(watched), ns, watch())?);
            }
        }
    }
    // With a platforms filter, the leader compares it with the nodes'
    // os/arch labels (nodes are cluster-scoped).
    if c.recovery.enabled && matches!(c.platforms, crate::config::Platforms::Only(_)) {
        cluster.push(rule(&[""], &["nodes"], &["list", "watch"], &[]));
    }
    // Pods in every namespace may name pull secrets.
    if c.source.image_pull_secrets {
        cluster.push(rule(&[""], &["secrets", "serviceaccounts"], &["get"], &[]));
    }
    if !cluster.is_empty() {
        out.extend(grant(&cluster_role_name(NAME, ns), None, ns, cluster)?);
    }
    if c.recovery.enabled {
        let lease_ns = match c.recovery.lease.namespace.as_str() {
            "" => ns,
            other => other,
        };
        let lease = c.recovery.lease.name.as_str();
        out.extend(grant(
            LEADER_RBAC,
            Some(lease_ns),
            ns,
            vec![
                rule(&["coordination.k8s.io"], &["leases"], &["create"], &[]),
                rule(
                    &["coordination.k8s.io"],
                    &["leases"],
                    &["get", "update"],
                    &[lease],
                ),
            ],
        )?);
    }
    if publishes_registries(opts) {
        // The install renders the ConfigMap; the leader only reads and
        // updates it.
        out.extend(grant(
            REGISTRIES_RBAC,
            Some(ns),
            ns,
            vec![rule(
                &[""],
                &["configmaps"],
                &["get", "update"],
                &[crate::nodeconfig::registries::CONFIG_MAP],
            )],
        )?);
    }
    if prewarms(opts) {
        // As the registries' ConfigMap: rendered here, only read and
        // updated by the leader.
        out.extend(grant(
            WARM_SET_RBAC,
            Some(ns),
            ns,
            vec![rule(
                &[""],
                &["configmaps"],
                &["get", "update"],
                &[crate::nodeconfig::warm::CONFIG_MAP],
            )],
        )?);
    }
    if c.recovery.enabled && c.retention.enabled {
        // The record is kept at the target; the ConfigMap an earlier
        // install kept it in is only read, once, to carry it on.
        out.extend(grant(
            RETENTION_RBAC,
            Some(ns),
            ns,
            vec![rule(
                &[""],
                &["configmaps"],
                &["get"],
                &[crate::retention::CONFIG_MAP],
            )],
        )?);
    }
    if opts.tls == Tls::SelfSigned {
        out.extend(grant(
            SELF_SIGNED_RBAC,
            Some(ns),
            ns,
            vec![
                rule(&[""], &["secrets"], &["create"], &[]),
                rule(&[""], &["secrets"], &["get", "update"], &[TLS_SECRET]),
            ],
        )?);
        out.extend(grant(
            &cluster_role_name(SELF_SIGNED_RBAC, ns),
            None,
            ns,
            vec![rule(
                &["admissionregistration.k8s.io"],
                &["mutatingwebhookconfigurations"],
                &["get", "patch"],
                &[&webhook_configuration_name(ns)],
            )],
        )?);
    }
    Ok(out)
}

/// Whether the leader lists the target's registries for the node agents:
/// a `"*"` allowlist, agents without credentials of their own to list it
/// with, and a leader (`recovery.enabled`); else each agent lists it.
fn publishes_registries(opts: &Options) -> bool {
    opts.config.recovery.enabled
        && opts
            .node_agent
            .as_ref()
            .is_some_and(|a| a.registry_auth_secret.is_none())
        && opts
            .config
            .source
            .registries
            .iter()
            .any(|r| r.registry == "*")
}

/// Whether the node agents pre-warm their nodes: the leader publishes a
/// warm set and the agents read it and mark their Node.
fn prewarms(opts: &Options) -> bool {
    opts.node_agent.is_some() && opts.config.prewarm.enabled && opts.config.recovery.enabled
}

/// The ConfigMap the leader writes the warm set into, empty and marked as
/// the leader's.
fn warm_set_config_map(ns: &str) -> ConfigMap {
    use crate::nodeconfig::warm::{ANNOTATION, ANNOTATION_VALUE, CONFIG_MAP};
    marked_config_map(ns, CONFIG_MAP, ANNOTATION, ANNOTATION_VALUE)
}

/// The ConfigMap the leader writes the registries into, empty and marked
/// as the leader's.
fn registries_config_map(ns: &str) -> ConfigMap {
    use crate::nodeconfig::registries::{ANNOTATION, ANNOTATION_VALUE, CONFIG_MAP};
    marked_config_map(ns, CONFIG_MAP, ANNOTATION, ANNOTATION_VALUE)
}

/// An empty ConfigMap `name` marked `annotation: value`: the leader writes
/// only one so marked.
fn marked_config_map(ns: &str, name: &str, annotation: &str, value: &str) -> ConfigMap {
    let mut metadata = meta(name, Some(ns));
    metadata.annotations = Some(BTreeMap::from([(annotation.to_owned(), value.to_owned())]));
    ConfigMap {
        metadata,
        ..Default::default()
    }
}

fn config_map(opts: &Options) -> ConfigMap {
    ConfigMap {
        metadata: meta(NAME, Some(&opts.namespace)),
        data: Some(BTreeMap::from([(
            "config.yaml".to_owned(),
            opts.config_text.clone(),
        )])),
        ..Default::default()
    }
}

fn selector() -> LabelSelector {
    LabelSelector {
        match_labels: Some(labels()),
        ..Default::default()
    }
}

fn service_port(name: &str, port: u16, target: &str) -> ServicePort {
    ServicePort {
        name: Some(name.to_owned()),
        port: i32::from(port),
        target_port: Some(IntOrString::String(target.to_owned())),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// The API server's way in: the webhook port only. The health port is
/// plain HTTP (and serves `/cache/purge` when enabled), so it is not
/// behind the address every webhook client is given.
fn service(opts: &Options) -> Service {
    Service {
        metadata: meta(NAME, Some(&opts.namespace)),
        spec: Some(ServiceSpec {
            selector: Some(labels()),
            ports: Some(vec![service_port("webhook", 443, "webhook")]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Headless: no virtual IP, so a scrape (a ServiceMonitor, or Prometheus'
/// endpoints discovery) reaches each replica's own counters.
fn metrics_service(opts: &Options) -> Service {
    let port = opts.config.server.health_listen.port();
    let mut metadata = meta(METRICS_SERVICE, Some(&opts.namespace));
    // What a ServiceMonitor selects, apart from the webhook's Service.
    metadata.labels.get_or_insert_default().insert(
        "app.kubernetes.io/component".to_owned(),
        "metrics".to_owned(),
    );
    Service {
        metadata,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(labels()),
            ports: Some(vec![service_port("http", port, "http")]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The TLS setup's identity, for [`TLS_CHECKSUM`].
fn tls_fingerprint(opts: &Options) -> String {
    let names = dns_names(NAME, &opts.namespace).join(",");
    sha256_hex(format!("{}\n{TLS_SECRET}\n{names}", opts.tls.as_str()).as_bytes())
}

/// Seconds the kubelet waits after SIGTERM before SIGKILL, added to
/// `server.shutdownDelay` + `server.drainTimeout`: stopping the background
/// tasks and exiting.
pub const TERMINATION_MARGIN_SECONDS: i64 = 10;

/// The Pod's `terminationGracePeriodSeconds`: on SIGTERM the webhook serves
/// for `shutdownDelay`, then requests in flight get up to `drainTimeout`
/// (30 with the defaults: 10 s + 10 s + [`TERMINATION_MARGIN_SECONDS`]).
pub fn termination_grace_seconds(server: &crate::config::Server) -> i64 {
    let stop = server.shutdown_delay + server.drain_timeout;
    i64::try_from(stop.as_secs() + u64::from(stop.subsec_nanos() > 0)).unwrap_or(i64::MAX / 2)
        + TERMINATION_MARGIN_SECONDS
}

fn deployment(opts: &Options) -> Deployment {
    let ns = opts.namespace.as_str();
    let (tls_dir, tls_volume) = match opts.tls {
        Tls::CertManager => (
            "/etc/pinswap/tls",
            Volume {
                name: "tls".into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(TLS_SECRET.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
        // Written by the bootstrap; memory-backed, so the key never
        // touches the node's disk.
        Tls::SelfSigned => (
            "/var/run/pinswap/tls",
            Volume {
                name: "tls".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    medium: Some("Memory".into()),
                    size_limit: Some(Quantity("1Mi".into())),
                }),
                ..Default::default()
            },
        ),
    };
    let mut args = vec![
        "serve".to_owned(),
        "--config".to_owned(),
        CONFIG_PATH.to_owned(),
        "--tls-cert".to_owned(),
        format!("{tls_dir}/tls.crt"),
        "--tls-key".to_owned(),
        format!("{tls_dir}/tls.key"),
    ];
    if opts.tls == Tls::SelfSigned {
        args.push("--self-signed".into());
        if ns != NAME {
            args.push("--webhook-configuration".into());
            args.push(webhook_configuration_name(ns));
        }
    }
    let field_env = |name: &str, path: &str| EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let probe = |path: &str| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        period_seconds: Some(10),
        timeout_seconds: Some(2),
        failure_threshold: Some(3),
        ..Default::default()
    };
    let mount = |name: &str, path: &str| VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(true),
        ..Default::default()
    };
    let mut tls_mount = mount("tls", tls_dir);
    if opts.tls == Tls::SelfSigned {
        tls_mount.read_only = None;
    }
    let quantities = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect::<BTreeMap<_, _>>()
    };
    let container = Container {
        name: NAME.into(),
        image: Some(opts.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(args),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            // The root filesystem is read-only; credential helpers
            // (docker-credential-ecr-login) cache their tokens under HOME.
            EnvVar {
                name: "HOME".into(),
                value: Some("/tmp".into()),
                ..Default::default()
            },
        ]),
        ports: Some(vec![
            ContainerPort {
                name: Some("webhook".into()),
                container_port: i32::from(opts.config.server.listen.port()),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some("http".into()),
                container_port: i32::from(opts.config.server.health_listen.port()),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        liveness_probe: Some(probe("/healthz")),
        readiness_probe: Some(probe("/readyz")),
        // Blobs stream through a fixed-size buffer (README, "Benchmarks"),
        // so memory does not grow with layer size.
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&[("cpu", "100m"), ("memory", "128Mi")])),
            limits: Some(quantities(&[("memory", "512Mi")])),
            ..Default::default()
        }),
        security_context: Some(super::locked_down(false)),
        // TLS first: deploy/'s overlays add it to the base, and kustomize
        // puts what a patch adds to a list before the base's items.
        volume_mounts: Some(vec![
            tls_mount,
            mount("config", "/etc/pinswap/config"),
            mount("registry-auth", REGISTRY_AUTH_DIR),
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    let annotations = BTreeMap::from([
        (
            CONFIG_CHECKSUM.to_owned(),
            sha256_hex(opts.config_text.as_bytes()),
        ),
        (TLS_CHECKSUM.to_owned(), tls_fingerprint(opts)),
        ("prometheus.io/scrape".to_owned(), "true".to_owned()),
        (
            "prometheus.io/port".to_owned(),
            opts.config.server.health_listen.port().to_string(),
        ),
        ("prometheus.io/path".to_owned(), "/metrics".to_owned()),
    ]);
    Deployment {
        metadata: meta(NAME, Some(ns)),
        spec: Some(DeploymentSpec {
            replicas: Some(opts.replicas),
            selector: selector(),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels()),
                    annotations: Some(annotations),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(NAME.into()),
                    image_pull_secrets: (!opts.image_pull_secrets.is_empty()).then(|| {
                        opts.image_pull_secrets
                            .iter()
                            .map(|name| LocalObjectReference { name: name.clone() })
                            .collect()
                    }),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        run_as_group: Some(65532),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    // Preferred, not required: a one-node cluster still runs
                    // both replicas.
                    affinity: Some(Affinity {
                        pod_anti_affinity: Some(PodAntiAffinity {
                            preferred_during_scheduling_ignored_during_execution: Some(vec![
                                WeightedPodAffinityTerm {
                                    weight: 100,
                                    pod_affinity_term: PodAffinityTerm {
                                        label_selector: Some(selector()),
                                        topology_key: "kubernetes.io/hostname".into(),
                                        ..Default::default()
                                    },
                                },
                            ]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    termination_grace_period_seconds: Some(termination_grace_seconds(
                        &opts.config.server,
                    )),
                    containers: vec![container],
                    volumes: Some(vec![
                        tls_volume,
                        Volume {
                            name: "config".into(),
                            config_map: Some(ConfigMapVolumeSource {
                                name: NAME.into(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                        Volume {
                            name: "registry-auth".into(),
                            secret: Some(SecretVolumeSource {
                                secret_name: Some(REGISTRY_AUTH_SECRET.into()),
                                optional: Some(true),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                        Volume {
                            name: "tmp".into(),
                            empty_dir: Some(EmptyDirVolumeSource {
                                size_limit: Some(Quantity("64Mi".into())),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                    ]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn disruption_budget(ns: &str) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(NAME, Some(ns)),
        spec: Some(PodDisruptionBudgetSpec {
            // One at a time, whatever the replica count: a drain never
            // blocks, and with 2 replicas one keeps serving.
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(selector()),
            // Replicas that are not ready (the target registry down) must
            // not block node drains: admission fails open without them.
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A self-signed Issuer signs a CA, and a CA Issuer signs the serving
/// certificate, so `ca.crt` (what cainjector puts in the caBundle) stays the
/// same when the serving certificate is renewed. A serving certificate from
/// the self-signed Issuer directly would be its own CA, and every renewal
/// would change the caBundle before the Pods see the new certificate.
fn cert_manager(ns: &str) -> [Value; 4] {
    let meta = |name: &str| json!({ "name": name, "namespace": ns, "labels": labels() });
    [
        json!({
            "apiVersion": "cert-manager.io/v1",
            "kind": "Issuer",
            "metadata": meta(ISSUER),
            "spec": { "selfSigned": {} },
        }),
        json!({
            "apiVersion": "cert-manager.io/v1",
            "kind": "Certificate",
            "metadata": meta(CA_CERTIFICATE),
            "spec": {
                "isCA": true,
                "commonName": "pinswap webhook CA",
                "secretName": CA_CERTIFICATE,
                "duration": "87600h",
                "renewBefore": "720h",
                "privateKey": { "algorithm": "ECDSA", "size": 256 },
                "issuerRef": { "kind": "Issuer", "name": ISSUER },
            },
        }),
        json!({
            "apiVersion": "cert-manager.io/v1",
            "kind": "Issuer",
            "metadata": meta(CA_ISSUER),
            "spec": { "ca": { "secretName": CA_CERTIFICATE } },
        }),
        json!({
            "apiVersion": "cert-manager.io/v1",
            "kind": "Certificate",
            "metadata": meta(CERTIFICATE),
            "spec": {
                "secretName": TLS_SECRET,
                "dnsNames": dns_names(NAME, ns),
                "issuerRef": { "kind": "Issuer", "name": CA_ISSUER },
                "duration": "8760h",
                "renewBefore": "720h",
                "privateKey": { "algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always" },
            },
        }),
    ]
}

/// `key NotIn [values]`.
/// The webhook's `failurePolicy` for the config's: `open` → `Ignore`,
/// `closed` → `Fail`.
pub fn webhook_failure_policy(policy: FailurePolicy) -> &'static str {
    match policy {
        FailurePolicy::Open => "Ignore",
        FailurePolicy::Closed => "Fail",
    }
}

fn webhook_configuration(opts: &Options) -> MutatingWebhookConfiguration {
    let ns = opts.namespace.as_str();
    let scope = crate::admission::scope::Scope::new(&opts.config.scope, ns);
    let mut metadata = meta(&webhook_configuration_name(ns), None);
    if opts.tls == Tls::CertManager {
        metadata.annotations = Some(BTreeMap::from([(
            "cert-manager.io/inject-ca-from".to_owned(),
            format!("{ns}/{CERTIFICATE}"),
        )]));
    }
    MutatingWebhookConfiguration {
        metadata,
        webhooks: Some(vec![MutatingWebhook {
            name: WEBHOOK.into(),
            admission_review_versions: vec!["v1".into()],
            client_config: WebhookClientConfig {
                service: Some(ServiceReference {
                    name: NAME.into(),
                    namespace: ns.to_owned(),
                    path: Some("/mutate".into()),
                    port: Some(443),
                }),
                ..Default::default()
            },
            // Fail open by default: a Pod is never blocked by pinswap being
            // down. With `failurePolicy: closed` the API server must deny
            // too when pinswap cannot answer, or the setting would hold only
            // while pinswap is up.
            failure_policy: Some(webhook_failure_policy(opts.config.failure_policy).into()),
            match_policy: Some("Equivalent".into()),
            // Its side effect, a copy into the target registry, is skipped
            // for dry-run reviews: that is what NoneOnDryRun declares. The
            // API server sends dry runs to None and NoneOnDryRun alike.
            side_effects: "NoneOnDryRun".into(),
            timeout_seconds: Some(TIMEOUT_SECONDS),
            // Another webhook may add a container after us.
            reinvocation_policy: Some("IfNeeded".into()),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["".into()]),
                api_versions: Some(vec!["v1".into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into()]),
                // kubectl debug adds ephemeral containers through the
                // subresource; their images are mirrored too.
                resources: Some(vec!["pods".into(), "pods/ephemeralcontainers".into()]),
                scope: Some("Namespaced".into()),
            }]),
            // The leader's watches apply the same scope (src/watch/namespaces.rs).
            namespace_selector: Some(scope.namespace_selector().clone()),
            object_selector: Some(scope.object_selector().clone()),
            ..Default::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(tls: Tls) -> Options {
        let text = "target: {registry: mirror.example.com/cache}\n".to_owned();
        Options {
            namespace: "pinswap".into(),
            replicas: 2,
            tls,
            image: "pinswap:test".into(),
            image_pull_secrets: Vec::new(),
            config: Config::from_yaml(&text, "t").unwrap(),
            config_text: text,
            node_agent: None,
        }
    }

    #[test]
    fn the_node_agent_is_a_daemonset_on_every_node_that_may_read_only_itself() {
        let o = Options {
            node_agent: Some(super::super::node_agent::NodeAgent {
                runtime: crate::nodeconfig::Runtime::Containerd,
                mode: crate::nodeconfig::Mode::DigestOnly,
                host_path: "/etc/containerd/certs.d".into(),
                registry_auth_secret: None,
            }),
            ..opts(Tls::SelfSigned)
        };
        let all = objects(&o).unwrap();
        let ds = all.iter().find(|v| v["kind"] == "DaemonSet").unwrap();
        let pod = &ds["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], "pinswap-node-agent");
        assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
        assert_eq!(
            pod["volumes"][0]["hostPath"],
            json!({"path": "/etc/containerd/certs.d", "type": "DirectoryOrCreate"})
        );
        let args = pod["containers"][0]["args"].as_array().unwrap();
        let args: Vec<&str> = args.iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "node-agent",
                "--config",
                CONFIG_PATH,
                "--runtime",
                "containerd",
                "--mode",
                "digest-only",
                "--dir",
                "/host-config",
                "--interval",
                "30s",
                "--daemonset",
                "pinswap-node-agent"
            ]
        );
        // No Secret: the host directory and the config.
        assert_eq!(pod["volumes"].as_array().unwrap().len(), 2);
        let sc = &pod["containers"][0]["securityContext"];
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        // CRI-O: the node's registries.conf, read-only, so that a registry
        // it configures itself gets no [[registry]] of pinswap's.
        let cri_o = Options {
            node_agent: Some(super::super::node_agent::NodeAgent {
                runtime: crate::nodeconfig::Runtime::CriO,
                mode: crate::nodeconfig::Mode::Resolve,
                host_path: "/etc/containers/registries.conf.d".into(),
                registry_auth_secret: None,
            }),
            ..opts(Tls::SelfSigned)
        };
        let all_cri_o = objects(&cri_o).unwrap();
        let pod_cri_o = &all_cri_o.iter().find(|v| v["kind"] == "DaemonSet").unwrap()["spec"]["template"]
            ["spec"];
        assert_eq!(
            pod_cri_o["volumes"][2],
            json!({"name": "host-containers", "hostPath": {"path": "/etc/containers", "type": "DirectoryOrCreate"}})
        );
        let container = &pod_cri_o["containers"][0];
        assert!(container["volumeMounts"].as_array().unwrap().contains(
            &json!({"name": "host-containers", "mountPath": "/host-containers", "readOnly": true})
        ));
        let args = container["args"].as_array().unwrap();
        let at = args.iter().position(|a| a == "--registries-conf").unwrap();
        assert_eq!(args[at + 1], "/host-containers/registries.conf");
        // Its selector is not the webhook Deployment's.
        assert_eq!(
            ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
            "pinswap-node-agent"
        );
        let role = all
            .iter()
            .find(|v| v["kind"] == "Role" && v["metadata"]["name"] == "pinswap-node-agent")
            .unwrap();
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"], "resourceNames": ["pinswap-node-agent"]}])
        );
        assert_eq!(
            ds["spec"]["template"]["metadata"]["annotations"][CONFIG_CHECKSUM],
            sha256_hex(o.config_text.as_bytes())
        );
        assert!(
            !objects(&opts(Tls::SelfSigned))
                .unwrap()
                .iter()
                .any(|v| v["kind"] == "DaemonSet")
        );
        let private = Options {
            config: Config::from_yaml(
                "target: {registry: m.example.com}\nsource: {imagePullSecrets: true}\n",
                "t",
            )
            .unwrap(),
            ..o.clone()
        };
        let filtered = Options {
            config: Config::from_yaml(
                "target: {registry: m.example.com}\nplatforms: [linux/amd64]\n",
                "t",
            )
            .unwrap(),
            ..o.clone()
        };
        let e = objects(&filtered).unwrap_err().to_string();
        assert!(e.starts_with("--node-agent: platforms is set"), "{e}");
        let repair = |mode| Options {
            config: Config::from_yaml(
                "target: {registry: m.example.com}\nidentity: {collisions: repair}\n",
                "t",
            )
            .unwrap(),
            node_agent: o
                .node_agent
                .clone()
                .map(|a| super::super::node_agent::NodeAgent { mode, ..a }),
            ..o.clone()
        };
        let e = objects(&repair(crate::nodeconfig::Mode::DigestOnly))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "--node-agent: identity.collisions is repair and the mode is digest-only"
            ),
            "{e}"
        );
        assert!(objects(&repair(crate::nodeconfig::Mode::Resolve)).is_ok());
        let e = objects(&private).unwrap_err().to_string();
        assert!(
            e.starts_with("--node-agent: source.imagePullSecrets"),
            "{e}"
        );
    }

    #[test]
    fn custom_resources_get_list_and_watch_on_exactly_their_kinds() {
        let rules = |extra: &str| {
            let text = format!("target: {{registry: m.example.com}}\n{extra}");
            let o = Options {
                config: Config::from_yaml(&text, "t").unwrap(),
                ..opts(Tls::SelfSigned)
            };
            let all = rbac(&o).unwrap();
            let role = all.iter().find(|v| v["kind"] == "ClusterRole").unwrap();
            role["rules"].as_array().unwrap().clone()
        };
        let r = rules(
            "customResources:\n  profiles: [flux, knative-serving]\n  kinds: [{group: example.com, kind: Widget, resource: widgets, paths: [spec.image]}, {group: serving.knative.dev, kind: DomainMapping, resource: domainmappings, paths: [spec.ref.image]}]\n",
        );
        let custom: Vec<&Value> = r
            .iter()
            .filter(|v| {
                !["", "apps", "batch", "events.k8s.io"]
                    .contains(&v["apiGroups"][0].as_str().unwrap())
            })
            .collect();
        assert_eq!(
            custom,
            [
                &json!({"apiGroups": ["source.toolkit.fluxcd.io"], "resources": ["ocirepositories"], "verbs": ["list", "watch"]}),
                &json!({"apiGroups": ["serving.knative.dev"], "resources": ["services", "configurations", "domainmappings"], "verbs": ["list", "watch"]}),
                &json!({"apiGroups": ["example.com"], "resources": ["widgets"], "verbs": ["list", "watch"]}),
            ]
        );
        // Without a usage record (no backfill, no retention) nothing is watched.
        let none = rules("backfill: {enabled: false}\ncustomResources: {profiles: [flux]}\n");
        assert!(
            none.iter()
                .all(|v| v["apiGroups"][0] != "source.toolkit.fluxcd.io"),
            "{none:?}"
        );
    }

    #[test]
    fn namespace_names_are_checked() {
        for bad in ["", "Pinswap", "-a", "a-", "a_b", &"a".repeat(64)] {
            let o = Options {
                namespace: bad.to_owned(),
                ..opts(Tls::SelfSigned)
            };
            assert!(
                matches!(objects(&o), Err(InstallError::Namespace(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn budget_must_stay_below_the_webhook_timeout() {
        let text = "target: {registry: m.example.com}\nserver: {admissionBudget: 10s}\n";
        let o = Options {
            config: Config::from_yaml(text, "t").unwrap(),
            ..opts(Tls::CertManager)
        };
        let e = objects(&o).unwrap_err().to_string();
        assert!(e.starts_with("server.admissionBudget: 10s"), "{e}");
    }

    #[test]
    fn configs_that_cannot_work_in_the_pod_are_refused_by_key() {
        let cases = [
            (
                "server: {listen: 127.0.0.1:8443}",
                "server.listen: 127.0.0.1:8443 is not reachable",
            ),
            (
                "server: {listen: \"127.0.0.1:80\", healthListen: \"0.0.0.0:8443\"}",
                "server.listen: 127.0.0.1:80 is not reachable from the Service and the kubelet's probes; listen on 0.0.0.0:9443",
            ),
            (
                "server: {healthListen: 0.0.0.0:80}",
                "server.healthListen: port 80 needs a capability",
            ),
            (
                "target: {registry: m.example.com, auth: {username: u, passwordEnv: PW}}",
                "target.auth.passwordEnv: the generated Deployment sets no such variable",
            ),
            (
                "source: {registries: [{registry: r.example.com, auth: {dockerConfigFile: /home/me/config.json}}]}",
                "source.registries[0].auth.dockerConfigFile: /home/me/config.json is not mounted",
            ),
        ];
        for (extra, want) in cases {
            let text = if extra.starts_with("target") {
                format!("{extra}\n")
            } else {
                format!("target: {{registry: m.example.com}}\n{extra}\n")
            };
            let o = Options {
                config: Config::from_yaml(&text, "t").unwrap(),
                config_text: text,
                ..opts(Tls::CertManager)
            };
            let e = objects(&o).unwrap_err().to_string();
            assert!(e.starts_with(want), "{extra}: {e}");
        }
        let text = "target: {registry: m.example.com, auth: {username: u, passwordFile: /var/run/secrets/pinswap/pw}}\n";
        let o = Options {
            config: Config::from_yaml(text, "t").unwrap(),
            config_text: text.into(),
            ..opts(Tls::CertManager)
        };
        objects(&o).expect("a password file in the mounted Secret");
        let text = "target: {registry: m.example.com, auth: {username: u, passwordEnv: PW}}\nserver: {listen: 127.0.0.1:8443}\n";
        let o = Options {
            config: Config::from_yaml(text, "t").unwrap(),
            config_text: text.into(),
            ..opts(Tls::CertManager)
        };
        let e = objects(&o).unwrap_err().to_string();
        let keys: Vec<&str> = e.lines().map(|l| l.split(':').next().unwrap()).collect();
        assert_eq!(
            keys,
            ["server.listen", "target.auth.passwordEnv"],
            "every problem, one per line: {e}"
        );
    }

    #[test]
    fn termination_grace_covers_the_shutdown_delay_and_the_drain() {
        let grace = |o: &Options| {
            let objs = objects(o).unwrap();
            let d = objs.iter().find(|o| o["kind"] == "Deployment").unwrap();
            d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].clone()
        };
        assert_eq!(grace(&opts(Tls::CertManager)), 30, "10 s + 10 s + 10 s");
        let text = "target: {registry: m.example.com}\nserver: {shutdownDelay: 20s, drainTimeout: 1500ms}\n";
        let o = Options {
            config: Config::from_yaml(text, "t").unwrap(),
            ..opts(Tls::CertManager)
        };
        assert_eq!(grace(&o), 32);
    }

    #[test]
    fn webhook_is_last_and_namespace_first() {
        let objs = objects(&opts(Tls::CertManager)).unwrap();
        assert_eq!(objs[0]["kind"], "Namespace");
        assert_eq!(objs.last().unwrap()["kind"], "MutatingWebhookConfiguration");
    }
}
