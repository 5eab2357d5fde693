//! Both API servers, kube-apiserver and the double, set up alike, and the
//! observations `tests/cluster_double.rs` compares between them.

use crate::common;
use std::time::Duration;

use crate::common::cluster::Cluster;
use crate::common::kube::KubeApi;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent};
use serde_json::{Value, json};

/// One of the two servers, and how a test sets it up: the double through
/// its own handles, kube-apiserver through an admin client.
pub struct Server {
    pub who: &'static str,
    pub double: Option<KubeApi>,
    pub cluster: Option<&'static Cluster>,
    pub admin: kube::Client,
}

impl Server {
    pub async fn double() -> Server {
        common::init();
        let api = KubeApi::start().await;
        Server {
            who: "the double",
            admin: api.client(),
            double: Some(api),
            cluster: None,
        }
    }

    pub async fn real(cluster: &'static Cluster) -> Server {
        Server {
            who: "kube-apiserver",
            admin: cluster.admin().await,
            double: None,
            cluster: Some(cluster),
        }
    }

    pub fn api(&self) -> &KubeApi {
        self.double.as_ref().expect("the double")
    }

    /// A namespace to work in (the double needs none).
    pub async fn namespace(&self, ns: &str) {
        if self.cluster.is_some() {
            common::cluster::namespace(&self.admin, ns, json!({})).await;
        }
    }

    pub async fn add_pod(&self, ns: &str, name: &str) -> Pod {
        let mut pod: Pod = serde_json::from_value(common::cluster::pod(
            name,
            &[("c", "registry.invalid/x")],
            &[],
        ))
        .unwrap();
        pod.metadata.namespace = Some(ns.into());
        match &self.double {
            Some(api) => api.apply_pod(pod),
            None => Api::namespaced(self.admin.clone(), ns)
                .create(&PostParams::default(), &pod)
                .await
                .unwrap(),
        }
    }

    /// Changes a label: a MODIFIED event.
    pub async fn touch_pod(&self, ns: &str, name: &str, value: &str) -> Pod {
        match &self.double {
            Some(api) => {
                let mut pod = api.pod(ns, name).unwrap();
                pod.metadata
                    .labels
                    .get_or_insert_default()
                    .insert("touched".into(), value.into());
                api.apply_pod(pod)
            }
            None => {
                let patch = json!({"metadata": {"labels": {"touched": value}}});
                Api::<Pod>::namespaced(self.admin.clone(), ns)
                    .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                    .unwrap()
            }
        }
    }

    pub async fn delete_pod(&self, ns: &str, name: &str) {
        match &self.double {
            Some(api) => {
                api.delete_pod(ns, name);
            }
            None => {
                // At once, as the double does (no kubelet would end it).
                let now = kube::api::DeleteParams::default().grace_period(0);
                Api::<Pod>::namespaced(self.admin.clone(), ns)
                    .delete(name, &now)
                    .await
                    .unwrap();
            }
        }
    }

    /// Forgets the history older than now. The real server's watch cache
    /// keeps serving it across an etcd compaction, so it takes a
    /// compaction and a restart (a cache started after it).
    pub async fn compact(&self) {
        match (&self.double, self.cluster) {
            (Some(api), _) => api.expire_history(),
            (None, Some(c)) => {
                c.compact().await;
                c.restart_apiserver().await;
                // Until its RBAC caches sync, it refuses some requests.
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            _ => unreachable!(),
        }
    }

    pub async fn put_secret(&self, ns: &str, secret: Secret) {
        match &self.double {
            Some(api) => {
                api.put_secret(ns, secret);
            }
            None => {
                Api::<Secret>::namespaced(self.admin.clone(), ns)
                    .create(&PostParams::default(), &secret)
                    .await
                    .unwrap();
            }
        }
    }

    pub async fn put_service_account(&self, ns: &str, sa: ServiceAccount) {
        match &self.double {
            Some(api) => {
                api.put_service_account(ns, sa);
            }
            None => {
                Api::<ServiceAccount>::namespaced(self.admin.clone(), ns)
                    .create(&PostParams::default(), &sa)
                    .await
                    .unwrap();
            }
        }
    }

    /// The events.k8s.io/v1 Events in `ns`.
    pub async fn events(&self, ns: &str) -> Vec<Event> {
        match &self.double {
            Some(api) => api
                .events()
                .into_iter()
                .filter(|e| e["metadata"]["namespace"] == ns)
                .map(|e| serde_json::from_value(e).unwrap())
                .collect(),
            None => {
                Api::<Event>::namespaced(self.admin.clone(), ns)
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
            }
        }
    }
}

/// Namespaces are per server run: the double has none, the cluster keeps them.
pub fn unique(base: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{base}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// The Status of a failed call, as JSON, or `"ok"`.
pub fn outcome<T>(r: kube::Result<T>) -> Value {
    match r {
        Ok(_) => json!("ok"),
        Err(kube::Error::Api(s)) => serde_json::to_value(&*s).unwrap(),
        Err(e) => json!(format!("not an API error: {e}")),
    }
}

/// Fails listing every case where the double's outcome is not the real
/// server's.
pub fn disagreements(judge: &[(String, Value)], seen: &[(String, Value)]) {
    assert_eq!(judge.len(), seen.len());
    let differ: Vec<String> = judge
        .iter()
        .zip(seen)
        .filter(|((_, want), (_, got))| got != want)
        .map(|((what, want), (_, got))| {
            format!("{what}:\n  double: {got}\n  kube-apiserver: {want}")
        })
        .collect();
    assert!(
        differ.is_empty(),
        "the double disagrees:\n{}",
        differ.join("\n")
    );
}

/// The next watch event within `limit`.
pub async fn next_within<S>(who: &str, stream: &mut S, limit: Duration) -> WatchEvent<Pod>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<Pod>>> + Unpin,
{
    match tokio::time::timeout(limit, stream.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(e))) => panic!("{who}: watch error: {e:?}"),
        Ok(None) => panic!("{who}: watch ended early"),
        Err(_) => panic!("{who}: no watch event within {limit:?}"),
    }
}

pub async fn next<S>(who: &str, stream: &mut S) -> WatchEvent<Pod>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<Pod>>> + Unpin,
{
    next_within(who, stream, Duration::from_secs(10)).await
}

pub fn rv_of(pod: &Pod) -> u64 {
    pod.metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

/// "ADDED a", ... and the resourceVersion of each event.
pub fn describe(e: &WatchEvent<Pod>) -> (String, u64) {
    match e {
        WatchEvent::Added(p) => (
            format!("ADDED {}", p.metadata.name.as_ref().unwrap()),
            rv_of(p),
        ),
        WatchEvent::Modified(p) => (
            format!("MODIFIED {}", p.metadata.name.as_ref().unwrap()),
            rv_of(p),
        ),
        WatchEvent::Deleted(p) => (
            format!("DELETED {}", p.metadata.name.as_ref().unwrap()),
            rv_of(p),
        ),
        WatchEvent::Bookmark(b) => (
            "BOOKMARK".into(),
            b.metadata.resource_version.parse().unwrap(),
        ),
        WatchEvent::Error(s) => (format!("ERROR {} {}", s.code, s.reason), 0),
    }
}
