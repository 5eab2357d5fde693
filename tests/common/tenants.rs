//! Tenants for the private-image tests: namespaces with pull secrets and
//! ServiceAccounts, written through the in-process API double
//! ([`KubeApi`]) or through a cluster admin's `kube::Client` of a real API
//! server ([`Admin`]), and Pods that use them. pinswap reads them through
//! whichever `kube::Client` the test gives it.

use std::future::Future;

use k8s_openapi::api::core::v1::{LocalObjectReference, Namespace, Secret, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Resource, ResourceExt};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};

use super::kube::{KubeApi, dockerconfigjson_secret};

/// Where tests write the objects pinswap reads.
pub trait Objects {
    /// Makes sure namespace `ns` exists.
    fn namespace(&self, ns: &str) -> impl Future<Output = ()>;
    /// Creates or replaces a Secret in `ns`.
    fn put_secret(&self, ns: &str, secret: Secret) -> impl Future<Output = ()>;
    /// Creates or replaces a ServiceAccount in `ns`.
    fn put_service_account(&self, ns: &str, sa: ServiceAccount) -> impl Future<Output = ()>;
}

impl Objects for KubeApi {
    /// The double has no Namespace objects: every namespace exists.
    async fn namespace(&self, _: &str) {}
    async fn put_secret(&self, ns: &str, secret: Secret) {
        KubeApi::put_secret(self, ns, secret);
    }
    async fn put_service_account(&self, ns: &str, sa: ServiceAccount) {
        KubeApi::put_service_account(self, ns, sa);
    }
}

/// A client allowed to write anything: a real API server's admin.
pub struct Admin(pub kube::Client);

/// Creates `obj`, or replaces the one of its name at its resourceVersion.
async fn put<K>(api: Api<K>, mut obj: K)
where
    K: Resource + Clone + std::fmt::Debug + Serialize + DeserializeOwned,
{
    let name = obj.name_any();
    match api.get_opt(&name).await.expect("read before write") {
        Some(old) => {
            obj.meta_mut().resource_version = old.resource_version();
            api.replace(&name, &PostParams::default(), &obj)
                .await
                .expect("replace");
        }
        None => {
            api.create(&PostParams::default(), &obj)
                .await
                .expect("create");
        }
    }
}

impl Objects for Admin {
    async fn namespace(&self, ns: &str) {
        let api: Api<Namespace> = Api::all(self.0.clone());
        if api.get_opt(ns).await.expect("read namespace").is_none() {
            let obj = Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            api.create(&PostParams::default(), &obj)
                .await
                .expect("create namespace");
        }
    }
    async fn put_secret(&self, ns: &str, secret: Secret) {
        put(Api::namespaced(self.0.clone(), ns), secret).await;
    }
    async fn put_service_account(&self, ns: &str, sa: ServiceAccount) {
        put(Api::namespaced(self.0.clone(), ns), sa).await;
    }
}

/// A `kubernetes.io/dockerconfigjson` Secret `name` for `user:password` at
/// `registry`, in `ns`.
pub async fn pull_secret(
    store: &impl Objects,
    ns: &str,
    name: &str,
    registry: &str,
    user: &str,
    password: &str,
) {
    store.namespace(ns).await;
    store
        .put_secret(ns, dockerconfigjson_secret(name, registry, user, password))
        .await;
}

/// ServiceAccount `name` in `ns` whose imagePullSecrets are `secrets`.
pub async fn service_account(store: &impl Objects, ns: &str, name: &str, secrets: &[&str]) {
    store.namespace(ns).await;
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        image_pull_secrets: Some(
            secrets
                .iter()
                .map(|s| LocalObjectReference {
                    name: (*s).to_owned(),
                })
                .collect(),
        ),
        ..Default::default()
    };
    store.put_service_account(ns, sa).await;
}

/// A one-container Pod `name` in `ns` running `image`, with these
/// imagePullSecrets and ServiceAccount.
pub fn pod(ns: &str, name: &str, image: &str, secrets: &[&str], sa: Option<&str>) -> Value {
    let mut p = super::review::pod(ns, name, &[("app", image)]);
    if !secrets.is_empty() {
        p["spec"]["imagePullSecrets"] = secrets.iter().map(|s| json!({"name": s})).collect();
    }
    if let Some(sa) = sa {
        p["spec"]["serviceAccountName"] = json!(sa);
    }
    p
}

/// The `pinswap.dev/decisions` note of `pod`'s container `app`.
pub fn decision(pod: &Value) -> String {
    let notes: std::collections::BTreeMap<String, String> =
        pod["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .map(|s| serde_json::from_str(s).unwrap())
            .unwrap_or_default();
    notes.get("containers/app").cloned().unwrap_or_default()
}
