//! Source credentials from a Pod's imagePullSecrets and those of its
//! ServiceAccount, read through the Kubernetes API (kube).
//!
//! The kubelet merges the same two lists (Pod first, then ServiceAccount)
//! and ignores secrets it cannot find; so do we. Secrets of type
//! `kubernetes.io/dockerconfigjson` (`.dockerconfigjson`) and
//! `kubernetes.io/dockercfg` (`.dockercfg`) are read. Nothing read here is
//! ever logged: [`Credentials`] redacts its `Debug`.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::Api;
use serde_json::Value;
use tracing::debug;

use super::auth::Credentials;

/// Reads pull secrets. Cheap to share; results are cached for 30 s per
/// namespace and name, so a burst of Pods costs one API read per secret.
pub struct PullSecrets {
    client: kube::Client,
    secrets: moka::future::Cache<(String, String), Option<Secret>>,
}

/// The registry a Docker config `auths` key names: scheme and path dropped,
/// Docker Hub's v1 index URL and `index.docker.io` as `docker.io`.
fn registry_of(key: &str) -> String {
    let host = key
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or("");
    crate::reference::normalize_registry(host)
}

fn credentials_of(entry: &Value) -> Option<Credentials> {
    if let (Some(u), Some(p)) = (
        entry.get("username").and_then(Value::as_str),
        entry.get("password").and_then(Value::as_str),
    ) {
        return Some(Credentials::new(u, p));
    }
    use base64::Engine as _;
    let auth = entry.get("auth").and_then(Value::as_str)?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth)
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (u, p) = text.split_once(':')?;
    Some(Credentials::new(u, p))
}

/// Registry → credentials from one pull secret; unreadable ones give none.
pub fn parse_secret(secret: &Secret) -> HashMap<String, Credentials> {
    let data = secret.data.as_ref();
    let json = |key: &str| -> Option<Value> { serde_json::from_slice(&data?.get(key)?.0).ok() };
    let auths = match json(".dockerconfigjson") {
        Some(v) => v.get("auths").cloned(),
        None => json(".dockercfg"),
    };
    let Some(Value::Object(map)) = auths else {
        return HashMap::new();
    };
    map.iter()
        .filter_map(|(k, v)| Some((registry_of(k), credentials_of(v)?)))
        .collect()
}

impl PullSecrets {
    /// Uses `client` for API reads (RBAC: get on secrets and serviceaccounts).
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            secrets: moka::future::Cache::builder()
                .time_to_live(Duration::from_secs(30))
                .max_capacity(10_000)
                .build(),
        }
    }

    async fn secret(&self, namespace: &str, name: &str) -> Option<Secret> {
        let key = (namespace.to_owned(), name.to_owned());
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        self.secrets
            .get_with(key, async move {
                match api.get_opt(name).await {
                    Ok(s) => s,
                    Err(e) => {
                        debug!(namespace, secret = name, error = %e, "pull secret unreadable");
                        None
                    }
                }
            })
            .await
    }

    /// Registry → credentials for a Pod in `namespace`: its own
    /// `imagePullSecrets` first, then its ServiceAccount's (default
    /// `default`). Missing or unreadable secrets are skipped.
    pub async fn for_pod(&self, namespace: &str, pod: &Value) -> HashMap<String, Credentials> {
        let mut names: Vec<String> = pod
            .pointer("/spec/imagePullSecrets")
            .and_then(Value::as_array)
            .map(|l| {
                l.iter()
                    .filter_map(|r| r.get("name").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let sa = pod
            .pointer("/spec/serviceAccountName")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let sas: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        if let Ok(Some(account)) = sas.get_opt(sa).await {
            names.extend(
                account
                    .image_pull_secrets
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.name),
            );
        }
        let mut out = HashMap::new();
        for name in names {
            if let Some(secret) = self.secret(namespace, &name).await {
                for (registry, creds) in parse_secret(&secret) {
                    // The first secret naming a registry wins, as in the kubelet.
                    out.entry(registry).or_insert(creds);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn both_secret_formats() {
        let mut s = Secret {
            data: Some(
                [(
                    ".dockerconfigjson".to_owned(),
                    ByteString(
                        br#"{"auths":{"https://index.docker.io/v1/":{"auth":"dTpw"},"127.0.0.1:5000":{"username":"a","password":"b:c"}}}"#
                            .to_vec(),
                    ),
                )]
                .into(),
            ),
            ..Secret::default()
        };
        let m = parse_secret(&s);
        assert_eq!(m["docker.io"], Credentials::new("u", "p"));
        assert_eq!(m["127.0.0.1:5000"], Credentials::new("a", "b:c"));
        s.data = Some(
            [(
                ".dockercfg".to_owned(),
                ByteString(br#"{"quay.io":{"auth":"eDp5"}}"#.to_vec()),
            )]
            .into(),
        );
        assert_eq!(parse_secret(&s)["quay.io"], Credentials::new("x", "y"));
        s.data = Some([(".dockercfg".to_owned(), ByteString(b"garbage".to_vec()))].into());
        assert!(parse_secret(&s).is_empty());
    }
}
