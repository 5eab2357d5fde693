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
