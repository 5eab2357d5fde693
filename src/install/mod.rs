//! Installing pinswap on Kubernetes: the objects `pinswap manifests` prints
//! ([`manifests`]) and the self-signed TLS bootstrap of `pinswap serve
//! --self-signed` ([`self_signed`]).
//!
//! Both share the names below, so the Deployment, the RBAC rules and the
//! bootstrap always refer to the same objects. `deploy/` holds the same
//! objects as a kustomize base and overlays; a test keeps them equal.

pub mod manifests;
pub mod node_agent;
pub mod self_signed;

/// Name of the Service, ServiceAccount, Deployment, ConfigMap, RBAC objects
/// and MutatingWebhookConfiguration.
pub const NAME: &str = "pinswap";
/// Name of the Secret holding the webhook's serving certificate
/// (`tls.crt`, `tls.key`, `ca.crt`; type `kubernetes.io/tls`).
pub const TLS_SECRET: &str = "pinswap-tls";
/// Name of the single webhook inside the MutatingWebhookConfiguration.
pub const WEBHOOK: &str = "mutate.pinswap.dev";
pub use crate::admission::scope::IGNORE_LABEL;
/// Webhook `timeoutSeconds`; `server.admissionBudget` must stay below it.
pub const TIMEOUT_SECONDS: i32 = 10;

/// The DNS names a serving certificate for `service` in `namespace` needs:
/// the API server calls `https://SERVICE.NAMESPACE.svc:443`.
pub fn dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A container's securityContext: no privilege escalation, a read-only
/// root filesystem, no capability, seccomp `RuntimeDefault`. Root only for
/// the node agent, which writes a root-owned directory of the node.
pub(crate) fn locked_down(root: bool) -> k8s_openapi::api::core::v1::SecurityContext {
    use k8s_openapi::api::core::v1::{Capabilities, SeccompProfile, SecurityContext};
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(!root),
        run_as_user: root.then_some(0),
        run_as_group: root.then_some(0),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}
