//! An in-process Kubernetes API server for the calls pinswap makes
//! (docs/architecture.md §7), speaking the real API's JSON through k8s-openapi types.
//!
//! Plain HTTP on 127.0.0.1 and a free port; [`KubeApi::client`] gives a
//! `kube::Client` pointed at it. It serves:
//! - GET of core/v1 Secrets, ServiceAccounts and Pods;
//! - Namespaces, list and watch (also one by name, with the field selector
//!   `metadata.name=NAME`, which RBAC authorises by that name as the API
//!   server does), and GET; a namespace is created, with the label
//!   `kubernetes.io/metadata.name`, when something is first stored in it
//!   ([`KubeApi::apply_namespace`] labels it);
//! - Pods list and watch, cluster-wide or per namespace, with one global
//!   resourceVersion, bookmarks, `timeoutSeconds`, and 410 Expired after
//!   [`KubeApi::expire_history`]; the same for the workload kinds apps/v1
//!   Deployments, StatefulSets, DaemonSets, ReplicaSets and batch/v1 Jobs,
//!   CronJobs ([`KubeApi::apply_object`]);
//! - Events, core/v1 and events.k8s.io/v1 (one store, as in the real API):
//!   POST (with `generateName`) and PATCH (merge, and strategic merge
//!   treated as merge);
//! - Leases, coordination.k8s.io/v1, and Secrets: GET, POST, and PUT with
//!   optimistic concurrency (a stale `metadata.resourceVersion` gets 409
//!   Conflict);
//! - MutatingWebhookConfigurations (cluster-scoped): GET, and PATCH with a
//!   JSON patch (RFC 6902, `test` ops included; a failed one gets 422).
//! - `pods/eviction` (policy/v1 Eviction): deletes the Pod, or 429 as a
//!   PodDisruptionBudget would ([`KubeApi::refuse_evictions`]); RBAC
//!   authorises it as `create` on `pods/eviction`.
//!
//! Errors are `Status` objects with the real API's reasons and messages.
//! Pod lists page with `limit` and `continue`. Events are validated with
//! the API server's limits (a note of at most 1 KiB; reason, action and
//! reportingInstance of at most 128 characters), on create and on patch.
//! What it doesn't implement (label selectors, field selectors but
//! `metadata.name=NAME`, `resourceVersionMatch`, other verbs) is refused,
//! never silently ignored; a streamed list (`sendInitialEvents`) is
//! refused with the 422 of a kube-apiserver without WatchList. Every request is
//! recorded ([`KubeApi::requests`]), and those answered 410 Expired too
//! ([`KubeApi::expired`]); [`KubeApi::fail_next`] injects failures.
//! Watches that allow bookmarks get a BOOKMARK at the latest
//! resourceVersion every [`BOOKMARK_PERIOD`] (the real API's watch cache
//! sends one about every minute), or as [`KubeApi::bookmark_every`] says.
//! [`KubeApi::black_hole`] partitions it the hard way: requests are
//! accepted and recorded but never answered, and open watches go silent.

// Handlers answer `Result<Response, Response>`: both sides are responses.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use base64::Engine as _;
use futures::{FutureExt as _, StreamExt as _, stream};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Event as CoreEvent, Namespace, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ListMeta, ObjectMeta, Status, StatusDetails};
use k8s_openapi::{ByteString, Metadata, Resource};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

/// A resource as URLs and error messages name it: (API group, plural).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Kind(&'static str, &'static str);

const SECRETS: Kind = Kind("", "secrets");
const SERVICE_ACCOUNTS: Kind = Kind("", "serviceaccounts");
const PODS: Kind = Kind("", "pods");
const CORE_EVENTS: Kind = Kind("", "events");
const EVENTS: Kind = Kind("events.k8s.io", "events");
const LEASES: Kind = Kind("coordination.k8s.io", "leases");
const CONFIG_MAPS: Kind = Kind("", "configmaps");
const WEBHOOKS: Kind = Kind(
    "admissionregistration.k8s.io",
    "mutatingwebhookconfigurations",
);
const DEPLOYMENTS: Kind = Kind("apps", "deployments");
const STATEFUL_SETS: Kind = Kind("apps", "statefulsets");
const DAEMON_SETS: Kind = Kind("apps", "daemonsets");
const REPLICA_SETS: Kind = Kind("apps", "replicasets");
const JOBS: Kind = Kind("batch", "jobs");
const CRON_JOBS: Kind = Kind("batch", "cronjobs");
const NAMESPACES: Kind = Kind("", "namespaces");
const KINDS: [Kind; 15] = [
    SECRETS,
    CONFIG_MAPS,
    SERVICE_ACCOUNTS,
    PODS,
    CORE_EVENTS,
    EVENTS,
    LEASES,
    WEBHOOKS,
    DEPLOYMENTS,
    STATEFUL_SETS,
    DAEMON_SETS,
    REPLICA_SETS,
    JOBS,
    CRON_JOBS,
    NAMESPACES,
];
/// The kinds that list and watch: (kind, apiVersion, `kind`).
const WATCHABLE: [(Kind, &str, &str); 8] = [
    (PODS, "v1", "Pod"),
    (DEPLOYMENTS, "apps/v1", "Deployment"),
    (STATEFUL_SETS, "apps/v1", "StatefulSet"),
    (DAEMON_SETS, "apps/v1", "DaemonSet"),
    (REPLICA_SETS, "apps/v1", "ReplicaSet"),
    (JOBS, "batch/v1", "Job"),
    (CRON_JOBS, "batch/v1", "CronJob"),
    (NAMESPACES, "v1", "Namespace"),
];

impl Kind {
    /// `leases.coordination.k8s.io "NAME"`, as in the API's messages.
    fn named(self, name: &str) -> String {
        match self.0 {
            "" => format!("{} {name:?}", self.1),
            group => format!("{}.{group} {name:?}", self.1),
        }
    }
}

/// One request the server received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiRequest {
    pub method: String,
    pub path: String,
    /// The raw query string, `""` when there is none.
    pub query: String,
}

/// What live watches are fed.
#[derive(Clone)]
enum Feed {
    Pod {
        plural: &'static str,
        rv: u64,
        ns: String,
        line: Arc<str>,
    },
    Bookmark(u64),
    Close,
}

#[derive(Default)]
struct Store {
    /// The global resourceVersion, bumped by every write of any kind.
    rv: u64,
    /// (plural, namespace, name) → the object as the API returns it.
    objects: BTreeMap<(&'static str, String, String), Value>,
    /// Watch events of Pods and workloads: (plural, resourceVersion,
    /// namespace, JSON line).
    pod_history: Vec<(&'static str, u64, String, Arc<str>)>,
    /// A watch from an older resourceVersion gets 410 Expired.
    oldest_watchable: u64,
    requests: Vec<ApiRequest>,
    /// Nodes as `PartialObjectMetadata` (name and labels), for list only:
    /// a watch of them is answered 404, so a watcher lists again.
    nodes: Vec<Value>,
    /// Requests answered 410 Expired (a watch's ERROR event, or a list's
    /// stale `continue`).
    expired: Vec<ApiRequest>,
    /// The resourceVersion of the last BOOKMARK sent.
    last_bookmark: Option<u64>,
    /// (method, path, HTTP code) for the next matching requests.
    failures: Vec<(String, String, u16)>,
    /// When set, every request is authorised against these rules, as the
    /// API server's RBAC authoriser does for pinswap's ServiceAccount.
    rbac: Option<Rbac>,
    /// Requests refused by `rbac`: "verb path".
    forbidden: Vec<String>,
    /// Evictions still to refuse with 429 (a PodDisruptionBudget).
    refuse_evictions: u32,
    /// Eviction requests: (`namespace/name`, HTTP code answered).
    evictions: Vec<(String, u16)>,
    /// (namespace or "", resourceVersion) → the Pods a paged list started
    /// with, for its later pages.
    list_snapshots: HashMap<(&'static str, String, u64), Arc<Vec<Value>>>,
    /// Where watch events go ([`Shared::feed`]).
    feed: Option<broadcast::Sender<Feed>>,
    /// Open watches by plural.
    watching: HashMap<&'static str, usize>,
}

/// RBAC rules bound to one ServiceAccount: cluster-wide ones (a ClusterRole
/// through a ClusterRoleBinding) and per namespace (a Role or ClusterRole
/// through a RoleBinding).
#[derive(Debug, Clone, Default)]
pub struct Rbac {
    cluster: Vec<Value>,
    namespaced: Vec<(String, Value)>,
}

/// What a request asks to do, in RBAC's terms.
struct Attributes {
    verb: &'static str,
    group: String,
    resource: String,
    namespace: Option<String>,
    name: Option<String>,
}

impl Rbac {
    /// The rules `objects` (rendered RBAC) bind to `system:serviceaccount:NS:NAME`.
    pub fn for_service_account(objects: &[Value], ns: &str, name: &str) -> Rbac {
        let role = |kind: &str, role_name: &str, role_ns: Option<&str>| -> Vec<Value> {
            objects
                .iter()
                .find(|o| {
                    o["kind"] == kind
                        && o["metadata"]["name"] == role_name
                        && (kind == "ClusterRole" || o["metadata"]["namespace"].as_str() == role_ns)
                })
                .and_then(|o| o["rules"].as_array().cloned())
                .unwrap_or_default()
        };
        let mut out = Rbac::default();
        for b in objects {
            let kind = b["kind"].as_str().unwrap_or("");
            if kind != "ClusterRoleBinding" && kind != "RoleBinding" {
                continue;
            }
            let ours = b["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == name && s["namespace"] == ns
            });
            if !ours {
                continue;
            }
            let (ref_kind, ref_name) = (
                b["roleRef"]["kind"].as_str().unwrap_or(""),
                b["roleRef"]["name"].as_str().unwrap_or(""),
            );
            let binding_ns = b["metadata"]["namespace"].as_str();
            let rules = role(ref_kind, ref_name, binding_ns);
            match (kind, binding_ns) {
                ("ClusterRoleBinding", _) => out.cluster.extend(rules),
                (_, Some(bns)) => out
                    .namespaced
                    .extend(rules.into_iter().map(|r| (bns.to_owned(), r))),
                _ => {}
            }
        }
        out
    }

    fn allows(&self, a: &Attributes) -> bool {
        let matches = |rule: &Value| {
            let has = |field: &str, want: &str| {
                rule[field]
                    .as_array()
                    .is_some_and(|xs| xs.iter().any(|x| x == want || x == "*"))
            };
            let names = rule["resourceNames"].as_array().filter(|n| !n.is_empty());
            // A rule naming objects allows only requests that name one of
            // them: never create, list or watch.
            let named = match (names, &a.name) {
                (None, _) => true,
                (Some(names), Some(n)) => names.iter().any(|x| x == n.as_str()),
                (Some(_), None) => false,
            };
            has("apiGroups", &a.group)
                && has("resources", &a.resource)
                && has("verbs", a.verb)
                && named
        };
        self.cluster.iter().any(matches)
            || a.namespace.as_deref().is_some_and(|ns| {
                self.namespaced
                    .iter()
                    .any(|(rns, rule)| rns == ns && matches(rule))
            })
    }
}

/// RBAC attributes of a request to one of the paths this server routes.
fn attributes(method: &str, path: &str, query: &str) -> Option<Attributes> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => ((*group).to_owned(), rest),
        _ => return None,
    };
    let (namespace, resource, name) = match rest {
        ["namespaces", ns, resource] => (Some(*ns), (*resource).to_owned(), None),
        ["namespaces", ns, resource, name] => (Some(*ns), (*resource).to_owned(), Some(*name)),
        // A subresource is authorised as "pods/status", not as the Pod.
        ["namespaces", ns, resource, name, sub] => {
            (Some(*ns), format!("{resource}/{sub}"), Some(*name))
        }
        [resource] => (None, (*resource).to_owned(), None),
        [resource, name] => (None, (*resource).to_owned(), Some(*name)),
        [resource, name, sub] => (None, format!("{resource}/{sub}"), Some(*name)),
        _ => return None,
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    // A list or watch of one object by name is authorised by that name,
    // as the API server's request info has it.
    let by_name = url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "fieldSelector")
        .and_then(|(_, f)| {
            f.strip_prefix("metadata.name=")
                .filter(|n| !n.contains(','))
                .map(str::to_owned)
        });
    let verb = match (method, name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    };
    let name = match verb {
        "list" | "watch" => by_name,
        _ => name.map(str::to_owned),
    };
    Some(Attributes {
        verb,
        group,
        resource,
        namespace: namespace.map(str::to_owned),
        name,
    })
}

/// The API server's 403 for `a`, worded as its RBAC authoriser words it.
fn forbidden(a: &Attributes, user: &str) -> Response {
    let scope = match &a.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".into(),
    };
    // Named as in other messages (`leases.coordination.k8s.io "x"`), by
    // the resource without its subresource.
    let base = a.resource.split('/').next().unwrap_or_default();
    let qualified = match a.group.as_str() {
        "" => base.to_owned(),
        g => format!("{base}.{g}"),
    };
    let what = match &a.name {
        Some(n) => format!("{qualified} \"{n}\""),
        None => qualified,
    };
    let message = format!(
        "{what} is forbidden: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
        a.verb, a.resource, a.group
    );
    let mut body = serde_json::to_value(status(403, "Forbidden", message, None)).expect("status");
    let mut details = json!({"kind": base});
    if let Some(n) = &a.name {
        details["name"] = n.as_str().into();
    }
    if !a.group.is_empty() {
        details["group"] = a.group.as_str().into();
    }
    body["details"] = details;
    (StatusCode::FORBIDDEN, Json(body)).into_response()
}

/// The ServiceAccount the authorised requests come from.
const PINSWAP_USER: (&str, &str) = ("pinswap", "pinswap");

impl Store {
    /// Stores `obj` under a new resourceVersion, setting the metadata the
    /// API server owns (uid and creationTimestamp survive updates). Returns
    /// it and the version it replaced.
    fn write(
        &mut self,
        kind: Kind,
        ns: &str,
        name: &str,
        mut obj: Value,
    ) -> (Value, Option<Value>) {
        if kind != NAMESPACES {
            self.ensure_namespace(ns);
        }
        self.rv += 1;
        let key = (kind.1, ns.to_owned(), name.to_owned());
        let previous = self.objects.get(&key).cloned();
        let kept = |field: &str, new: Value| {
            previous
                .as_ref()
                .map_or(new, |p| p["metadata"][field].clone())
        };
        let uid = kept(
            "uid",
            format!("00000000-0000-4000-8000-{:012x}", self.rv).into(),
        );
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        let created = kept(
            "creationTimestamp",
            serde_json::to_value(now).expect("time"),
        );
        let meta = &mut obj["metadata"];
        meta["name"] = name.into();
        if !ns.is_empty() {
            meta["namespace"] = ns.into();
        }
        meta["resourceVersion"] = self.rv.to_string().into();
        meta["uid"] = uid;
        meta["creationTimestamp"] = created;
        self.objects.insert(key, obj.clone());
        (obj, previous)
    }

    /// Creates namespace `ns` (sending ADDED) unless it exists, as a
    /// cluster needs it before anything is stored in it. The API server
    /// labels every namespace with its name.
    fn ensure_namespace(&mut self, ns: &str) {
        let key = (NAMESPACES.1, String::new(), ns.to_owned());
        if ns.is_empty() || self.objects.contains_key(&key) {
            return;
        }
        let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "labels": {"kubernetes.io/metadata.name": ns}}});
        let (stored, _) = self.write(NAMESPACES, "", ns, obj);
        self.record(NAMESPACES, "ADDED", "", &stored);
    }

    /// Keeps a watch event in the history and sends it to live watches.
    fn record(&mut self, kind: Kind, type_: &str, ns: &str, obj: &Value) {
        let line: Arc<str> = json!({ "type": type_, "object": obj }).to_string().into();
        self.pod_history
            .push((kind.1, self.rv, ns.to_owned(), line.clone()));
        if let Some(feed) = &self.feed {
            let _ = feed.send(Feed::Pod {
                plural: kind.1,
                rv: self.rv,
                ns: ns.to_owned(),
                line,
            });
        }
    }
}

struct Shared {
    store: Mutex<Store>,
    feed: broadcast::Sender<Feed>,
    /// Time between periodic bookmarks.
    bookmark_period: tokio::sync::watch::Sender<Duration>,
    /// While true, nothing is answered (see [`KubeApi::black_hole`]).
    black_hole: tokio::sync::watch::Sender<bool>,
}

/// How often watches that allow bookmarks get one, unless
/// [`KubeApi::bookmark_every`] says otherwise: about as often as the real
/// API server's watch cache sends them.
pub const BOOKMARK_PERIOD: Duration = Duration::from_secs(60);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running test API server; stops, ending its watches, when dropped.
pub struct KubeApi {
    url: String,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
    bookmarks: JoinHandle<()>,
}

impl KubeApi {
    /// Listens on 127.0.0.1 and a free port. Call inside a tokio runtime.
    pub async fn start() -> KubeApi {
        // resourceVersion "0" would mean "any": real servers never hand it out.
        let feed = broadcast::channel(4096).0;
        let store = Mutex::new(Store {
            rv: 1,
            feed: Some(feed.clone()),
            ..Store::default()
        });
        let shared = Arc::new(Shared {
            store,
            feed,
            bookmark_period: tokio::sync::watch::channel(BOOKMARK_PERIOD).0,
            black_hole: tokio::sync::watch::channel(false).0,
        });
        let core = "/api/v1/namespaces/{ns}/{plural}";
        let grouped = "/apis/{group}/v1/namespaces/{ns}/{plural}";
        let app = axum::Router::new()
            .route("/api/v1/pods", get(all_pods))
            .route("/apis/{group}/v1/{plural}", get(list_all))
            .route("/api/v1/nodes", get(list_nodes))
            .route("/api/v1/namespaces", get(list_namespaces))
            .route("/api/v1/namespaces/{ns}", get(read_namespace))
            .route(core, get(list).post(create))
            .route(
                &format!("{core}/{{name}}"),
                get(read).put(replace).patch(patch),
            )
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}/eviction",
                axum::routing::post(evict),
            )
            .route(
                "/apis/{group}/v1/{plural}/{name}",
                get(read_cluster).patch(json_patch_cluster),
            )
            .route(grouped, get(list).post(create))
            .route(
                &format!("{grouped}/{{name}}"),
                get(read).put(replace).patch(patch),
            )
            .fallback(|| async { no_such_resource() })
            .method_not_allowed_fallback(|| async { unsupported() })
            .layer(middleware::from_fn_with_state(shared.clone(), record))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1");
        let url = format!("http://{}", listener.local_addr().expect("local address"));
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("test Kubernetes API server");
        });
        let bookmarks = tokio::spawn(periodic_bookmarks(shared.clone()));
        KubeApi {
            url,
            shared,
            task,
            bookmarks,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Writes a kubeconfig for this server into `dir` (namespace
    /// `pinswap`, no credentials) for a `pinswap serve` process.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster: {{server: \"{}\"}}\n\
                 users:\n- name: t\n  user: {{}}\ncontexts:\n- name: t\n  context: {{cluster: t, user: t, namespace: pinswap}}\n\
                 current-context: t\n",
                self.url
            ),
        )
        .expect("write a kubeconfig");
        path
    }

    /// A client whose default namespace is `default`.
    pub fn client(&self) -> ::kube::Client {
        self.client_in("default")
    }

    /// A client as pinswap's in-cluster one: its default namespace (where
    /// the Lease goes) is the install's, `pinswap`.
    pub fn install_client(&self) -> ::kube::Client {
        self.client_in(PINSWAP_USER.0)
    }

    /// As [`KubeApi::install_client`], without kube's default retry of
    /// 429s, as `serve` evicts.
    pub fn eviction_client(&self) -> ::kube::Client {
        let mut config = ::kube::Config::new(self.url.parse().expect("server URL as a URI"));
        config.default_namespace = PINSWAP_USER.0.to_owned();
        pinswap::watch::evict::client_without_retry(config).expect("kube client")
    }

    /// A client whose default namespace is `ns`.
    pub fn client_in(&self, ns: &str) -> ::kube::Client {
        let mut config = ::kube::Config::new(self.url.parse().expect("server URL as a URI"));
        config.default_namespace = ns.to_owned();
        ::kube::Client::try_from(config).expect("kube client for the test API server")
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> String {
        self.shared.lock().rv.to_string()
    }

    /// Creates or replaces a Secret; `stringData` is folded into `data`, as
    /// the API server does.
    pub fn put_secret(&self, ns: &str, mut secret: Secret) -> Secret {
        for (k, v) in secret.string_data.take().unwrap_or_default() {
            let data = secret.data.get_or_insert_with(BTreeMap::new);
            data.insert(k, ByteString(v.into_bytes()));
        }
        self.put(SECRETS, ns, &secret).0
    }

    pub fn put_service_account(&self, ns: &str, sa: ServiceAccount) -> ServiceAccount {
        self.put(SERVICE_ACCOUNTS, ns, &sa).0
    }

    /// Adds a node with these labels, listed as metadata only.
    pub fn put_node(&self, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
            .collect();
        self.shared.lock().nodes.push(serde_json::json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"name": name, "labels": labels},
        }));
    }

    /// Creates or replaces a Lease, e.g. one held by another replica.
    pub fn put_lease(&self, ns: &str, lease: Lease) -> Lease {
        self.put(LEASES, ns, &lease).0
    }

    pub fn secret(&self, ns: &str, name: &str) -> Option<Secret> {
        self.get(SECRETS, ns, name)
    }

    /// Creates or replaces a (cluster-scoped) MutatingWebhookConfiguration.
    pub fn put_webhook_configuration(
        &self,
        config: MutatingWebhookConfiguration,
    ) -> MutatingWebhookConfiguration {
        self.put(WEBHOOKS, "", &config).0
    }

    pub fn webhook_configuration(&self, name: &str) -> Option<MutatingWebhookConfiguration> {
        self.get(WEBHOOKS, "", name)
    }

    pub fn config_map(&self, ns: &str, name: &str) -> Option<ConfigMap> {
        self.get(CONFIG_MAPS, ns, name)
    }

    pub fn put_config_map(&self, ns: &str, cm: ConfigMap) -> ConfigMap {
        self.put(CONFIG_MAPS, ns, &cm).0
    }

    pub fn lease(&self, ns: &str, name: &str) -> Option<Lease> {
        self.get(LEASES, ns, name)
    }

    pub fn pod(&self, ns: &str, name: &str) -> Option<Pod> {
        self.get(PODS, ns, name)
    }

    /// Creates or relabels namespace `name` with `labels` (beside the
    /// `kubernetes.io/metadata.name` label the API server sets), sending
    /// ADDED or MODIFIED to namespace watches.
    pub fn apply_namespace(&self, name: &str, labels: &[(&str, &str)]) -> Namespace {
        let mut st = self.shared.lock();
        let mut map: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        map.insert("kubernetes.io/metadata.name".into(), name.into());
        let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"labels": map}});
        let (stored, previous) = st.write(NAMESPACES, "", name, obj);
        let type_ = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        st.record(NAMESPACES, type_, "", &stored);
        serde_json::from_value(stored).expect("stored namespace")
    }

    /// Creates or updates a Pod (in `default` if it names no namespace),
    /// sending ADDED or MODIFIED to watches. Returns it as stored.
    pub fn apply_pod(&self, pod: Pod) -> Pod {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().expect("apply_pod: no name");
        let mut st = self.shared.lock();
        let value = serde_json::to_value(&pod).expect("serialise");
        let (stored, previous) = st.write(PODS, ns, name, value);
        let type_ = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.emit_pod(&mut st, type_, ns, &stored);
        serde_json::from_value(stored).expect("stored pod")
    }

    /// Creates or updates a workload (Deployment, StatefulSet, DaemonSet,
    /// ReplicaSet, Job, CronJob; in `default` if it names no namespace),
    /// sending ADDED or MODIFIED to watches. Returns it as stored.
    pub fn apply_object<K>(&self, obj: K) -> K
    where
        K: Resource + Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned,
    {
        let kind = watchable::<K>();
        let ns = obj.metadata().namespace.as_deref().unwrap_or("default");
        let name = obj
            .metadata()
            .name
            .as_deref()
            .expect("apply_object: no name");
        let mut st = self.shared.lock();
        let mut value = serde_json::to_value(&obj).expect("serialise");
        value["apiVersion"] = K::API_VERSION.into();
        value["kind"] = K::KIND.into();
        let (stored, previous) = st.write(kind, ns, name, value);
        let type_ = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        emit(&self.shared, &mut st, kind, type_, ns, &stored);
        serde_json::from_value(stored).expect("stored object")
    }

    /// Deletes a workload, sending DELETED with a new resourceVersion.
    pub fn delete_object<K: Resource>(&self, ns: &str, name: &str) {
        let kind = watchable::<K>();
        let mut st = self.shared.lock();
        let key = (kind.1, ns.to_owned(), name.to_owned());
        let mut obj = st
            .objects
            .remove(&key)
            .unwrap_or_else(|| panic!("delete_object: no {} {ns}/{name}", kind.1));
        st.rv += 1;
        obj["metadata"]["resourceVersion"] = st.rv.to_string().into();
        emit(&self.shared, &mut st, kind, "DELETED", ns, &obj);
    }

    /// Deletes a Pod, sending DELETED with a new resourceVersion.
    pub fn delete_pod(&self, ns: &str, name: &str) -> Pod {
        let mut st = self.shared.lock();
        let key = (PODS.1, ns.to_owned(), name.to_owned());
        let mut pod = st
            .objects
            .remove(&key)
            .unwrap_or_else(|| panic!("delete_pod: no pod {ns}/{name}"));
        st.rv += 1;
        pod["metadata"]["resourceVersion"] = st.rv.to_string().into();
        self.emit_pod(&mut st, "DELETED", ns, &pod);
        serde_json::from_value(pod).expect("stored pod")
    }

    /// Deletes a Pod unseen, as while every watch was down and the history
    /// was compacted: no DELETED goes out, the history is forgotten and
    /// open watches end, so a watcher learns of it only by listing again.
    pub fn delete_pod_unseen(&self, ns: &str, name: &str) {
        {
            let mut st = self.shared.lock();
            let key = (PODS.1, ns.to_owned(), name.to_owned());
            st.objects
                .remove(&key)
                .unwrap_or_else(|| panic!("delete_pod_unseen: no pod {ns}/{name}"));
            st.rv += 1;
        }
        self.expire_history();
        self.close_watches();
    }

    /// Sends a BOOKMARK at the current resourceVersion to the watches that
    /// allowed bookmarks, and returns that resourceVersion.
    pub fn bookmark(&self) -> String {
        send_bookmark(&self.shared).to_string()
    }

    /// From now on, sends the periodic BOOKMARK every `period` (first one
    /// `period` from now).
    pub fn bookmark_every(&self, period: Duration) {
        self.shared.bookmark_period.send_replace(period);
    }

    /// With `on`, requests are accepted and recorded but not answered, and
    /// open watches deliver nothing, until `black_hole(false)` (then they go
    /// on, as TCP does once a partition heals, unless the client gave up).
    pub fn black_hole(&self, on: bool) {
        self.shared.black_hole.send_replace(on);
    }

    /// Forgets the Pod event history, as etcd compaction does: a watch from
    /// any older resourceVersion gets an ERROR event with 410 Expired.
    pub fn expire_history(&self) {
        let mut st = self.shared.lock();
        st.oldest_watchable = st.rv;
        st.pod_history.clear();
        st.list_snapshots.clear();
    }

    /// How many watches of Pods and workloads are open (the leader's
    /// watch of namespaces, open first, is left out).
    pub fn open_watches(&self) -> usize {
        let st = self.shared.lock();
        st.watching
            .iter()
            .filter(|(p, _)| **p != NAMESPACES.1)
            .map(|(_, n)| n)
            .sum()
    }

    /// How many watches of `plural` (`pods`, `namespaces`, ...) are open.
    pub fn open_watches_of(&self, plural: &str) -> usize {
        self.shared
            .lock()
            .watching
            .get(plural)
            .copied()
            .unwrap_or(0)
    }

    /// Ends every open watch, as an API server restart does.
    pub fn close_watches(&self) {
        let _ = self.shared.feed.send(Feed::Close);
    }

    /// From now on, authorises every request as coming from the `pinswap`
    /// ServiceAccount in namespace `pinswap`, with the RBAC `pinswap
    /// manifests` renders for `config` and `tls`: a verb or resource the
    /// install does not grant gets 403, as in a cluster.
    pub fn authorize_install(
        &self,
        config: &pinswap::config::Config,
        tls: pinswap::install::manifests::Tls,
    ) {
        self.authorize_install_with(config, tls, None);
    }

    /// As [`KubeApi::authorize_install`], for an install with `node_agent`.
    pub fn authorize_install_with(
        &self,
        config: &pinswap::config::Config,
        tls: pinswap::install::manifests::Tls,
        node_agent: Option<pinswap::install::node_agent::NodeAgent>,
    ) {
        let opts = pinswap::install::manifests::Options {
            namespace: PINSWAP_USER.0.into(),
            replicas: 1,
            tls,
            image: "registry.example/pinswap:0".into(),
            image_pull_secrets: Vec::new(),
            config_text: String::new(),
            config: config.clone(),
            node_agent,
        };
        let objects = pinswap::install::manifests::rbac(&opts).expect("render RBAC");
        self.shared.lock().rbac = Some(Rbac::for_service_account(
            &objects,
            PINSWAP_USER.0,
            PINSWAP_USER.1,
        ));
    }

    /// Requests refused by [`KubeApi::authorize_install`]'s rules, as
    /// "verb path".
    pub fn forbidden(&self) -> Vec<String> {
        self.shared.lock().forbidden.clone()
    }

    /// Every Event stored, as the API returns it (core/v1 or events.k8s.io/v1).
    pub fn events(&self) -> Vec<Value> {
        let st = self.shared.lock();
        let events = st
            .objects
            .iter()
            .filter(|((plural, _, _), _)| *plural == "events");
        events.map(|(_, v)| v.clone()).collect()
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<ApiRequest> {
        self.shared.lock().requests.clone()
    }

    /// The resourceVersion of the last BOOKMARK sent, periodic or not.
    pub fn last_bookmark(&self) -> Option<String> {
        self.shared.lock().last_bookmark.map(|rv| rv.to_string())
    }

    /// Every request answered 410 Expired so far, in order.
    pub fn expired(&self) -> Vec<ApiRequest> {
        self.shared.lock().expired.clone()
    }

    /// The next `method` request to exactly `path` fails with `code` and a
    /// `Status` body. Calls queue up.
    pub fn fail_next(&self, method: &str, path: &str, code: u16) {
        let failure = (method.to_owned(), path.to_owned(), code);
        self.shared.lock().failures.push(failure);
    }

    fn get<K: DeserializeOwned>(&self, kind: Kind, ns: &str, name: &str) -> Option<K> {
        let st = self.shared.lock();
        let value = st.objects.get(&(kind.1, ns.to_owned(), name.to_owned()))?;
        Some(serde_json::from_value(value.clone()).expect("stored object"))
    }

    /// Stores `obj`; true if it replaced one.
    fn put<K: Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned>(
        &self,
        kind: Kind,
        ns: &str,
        obj: &K,
    ) -> (K, bool) {
        let name = obj
            .metadata()
            .name
            .as_deref()
            .expect("test object without metadata.name");
        let value = serde_json::to_value(obj).expect("serialise");
        let (stored, previous) = self.shared.lock().write(kind, ns, name, value);
        (
            serde_json::from_value(stored).expect("stored object"),
            previous.is_some(),
        )
    }

    /// Records and sends a Pod event at the current resourceVersion. Called
    /// under the lock with the write, so that a watch, which reads the
    /// history and subscribes under it too, sees every event once, in order.
    fn emit_pod(&self, st: &mut Store, type_: &str, ns: &str, pod: &Value) {
        emit(&self.shared, st, PODS, type_, ns, pod);
    }

    /// The next `n` evictions are refused with 429, as the API server
    /// refuses one that a PodDisruptionBudget does not allow.
    pub fn refuse_evictions(&self, n: u32) {
        self.shared.lock().refuse_evictions = n;
    }

    /// Every eviction request, in order: (`namespace/name`, HTTP code).
    pub fn evictions(&self) -> Vec<(String, u16)> {
        self.shared.lock().evictions.clone()
    }

    /// The Pods evicted (answered 201), as `namespace/name`, in order.
    pub fn evicted(&self) -> Vec<String> {
        let st = self.shared.lock();
        let ok = st.evictions.iter().filter(|(_, code)| *code == 201);
        ok.map(|(k, _)| k.clone()).collect()
    }
}

/// See [`KubeApi::emit_pod`]; for any watchable kind.
fn emit(_shared: &Shared, st: &mut Store, kind: Kind, type_: &str, ns: &str, obj: &Value) {
    st.record(kind, type_, ns, obj);
}

/// POST `pods/{name}/eviction`: a policy/v1 Eviction (apiVersion and kind
/// may be left out, as the API server defaults them). As the API server
/// does: the body's name must be the URL's, a `deleteOptions.preconditions`
/// UID must be the Pod's (else 409), and unknown fields are dropped. A
/// Pod evicted is deleted (DELETED to watches); [`KubeApi::refuse_evictions`]
/// stands in for a PodDisruptionBudget that does not allow it (429).
async fn evict(State(s): ApiState, Path(p): Params, body: Bytes) -> Response {
    let (ns, name) = (p["ns"].clone(), p["name"].clone());
    let (code, response) = evict_pod(&s, &ns, &name, &body);
    s.lock().evictions.push((format!("{ns}/{name}"), code));
    response
}

fn evict_pod(s: &Shared, ns: &str, name: &str, body: &[u8]) -> (u16, Response) {
    let eviction: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return (400, bad_request(format!("decoding the Eviction: {e}"))),
    };
    let api_version = eviction["apiVersion"].as_str().unwrap_or("policy/v1");
    let kind = eviction["kind"].as_str().unwrap_or("Eviction");
    if (api_version, kind) != ("policy/v1", "Eviction") {
        let message = format!("no kind \"{kind}\" is registered for version \"{api_version}\"");
        return (400, bad_request(message));
    }
    if eviction["metadata"]["name"].as_str() != Some(name) {
        let message = "name in URL does not match name in Eviction object".to_owned();
        return (400, bad_request(message));
    }
    let mut st = s.lock();
    let key = (PODS.1, ns.to_owned(), name.to_owned());
    let Some(pod) = st.objects.get(&key).cloned() else {
        return (404, not_found(PODS, name));
    };
    if let Some(uid) = eviction["deleteOptions"]["preconditions"]["uid"].as_str()
        && pod["metadata"]["uid"].as_str() != Some(uid)
    {
        let message = format!(
            "Operation cannot be fulfilled on {}: Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
            PODS.named(name),
            pod["metadata"]["uid"].as_str().unwrap_or_default()
        );
        return (
            409,
            failure_about(409, "Conflict", message, Some((PODS, name))),
        );
    }
    if st.refuse_evictions > 0 {
        st.refuse_evictions -= 1;
        let mut body = serde_json::to_value(status(
            429,
            "TooManyRequests",
            "Cannot evict pod as it would violate the pod's disruption budget.".into(),
            None,
        ))
        .expect("status");
        body["details"] = json!({"causes": [{"reason": "DisruptionBudget",
            "message": "The disruption budget test-pdb needs 1 healthy pods and has 1 currently"}]});
        return (
            429,
            (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response(),
        );
    }
    let mut pod = st.objects.remove(&key).expect("read above");
    st.rv += 1;
    pod["metadata"]["resourceVersion"] = st.rv.to_string().into();
    emit(s, &mut st, PODS, "DELETED", ns, &pod);
    let ok = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201});
    (201, (StatusCode::CREATED, Json(ok)).into_response())
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        let _ = self.shared.feed.send(Feed::Close);
        self.task.abort();
        self.bookmarks.abort();
    }
}

/// The watchable kind of `K`.
fn watchable<K: Resource>() -> Kind {
    WATCHABLE
        .iter()
        .map(|(k, _, _)| *k)
        .find(|k| k.0 == K::GROUP && k.1 == K::URL_PATH_SEGMENT)
        .unwrap_or_else(|| panic!("the test API server does not watch {}", K::KIND))
}

/// Sends a BOOKMARK at the current resourceVersion, under the store's lock
/// so it follows every Pod event at or before it; returns that version.
fn send_bookmark(shared: &Shared) -> u64 {
    let mut st = shared.lock();
    let _ = shared.feed.send(Feed::Bookmark(st.rv));
    st.last_bookmark = Some(st.rv);
    st.rv
}

/// A BOOKMARK every `bookmark_period`, restarting the wait when it changes.
async fn periodic_bookmarks(shared: Arc<Shared>) {
    let mut period = shared.bookmark_period.subscribe();
    loop {
        let wait = *period.borrow_and_update();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {
                send_bookmark(&shared);
            }
            changed = period.changed() => if changed.is_err() { return },
        }
    }
}

/// A `kubernetes.io/dockerconfigjson` pull secret for `user:password` at
/// `registry`.
pub fn dockerconfigjson_secret(name: &str, registry: &str, user: &str, password: &str) -> Secret {
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let config = json!({ "auths": { registry: { "auth": auth } } }).to_string();
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        type_: Some("kubernetes.io/dockerconfigjson".into()),
        data: Some(BTreeMap::from([(
            ".dockerconfigjson".into(),
            ByteString(config.into_bytes()),
        )])),
        ..Default::default()
    }
}

/// A `Status` failure, as the API server sends it.
fn failure(code: u16, reason: &str, message: String) -> Response {
    failure_about(code, reason, message, None)
}

fn failure_about(
    code: u16,
    reason: &str,
    message: String,
    about: Option<(Kind, &str)>,
) -> Response {
    let code_ = StatusCode::from_u16(code).expect("HTTP status");
    (code_, Json(status(code, reason, message, about))).into_response()
}

fn status(code: u16, reason: &str, message: String, about: Option<(Kind, &str)>) -> Status {
    let details = about.map(|(kind, name)| StatusDetails {
        name: Some(name.to_owned()),
        group: Some(kind.0.to_owned()).filter(|g| !g.is_empty()),
        kind: Some(kind.1.to_owned()),
        ..Default::default()
    });
    Status {
        code: Some(code.into()),
        details,
        message: Some(message),
        metadata: ListMeta::default(),
        reason: Some(reason.to_owned()),
        status: Some("Failure".to_owned()),
    }
}

fn not_found(kind: Kind, name: &str) -> Response {
    let message = format!("{} not found", kind.named(name));
    failure_about(404, "NotFound", message, Some((kind, name)))
}

/// kube-apiserver's answer to a streamed list without its WatchList feature
/// (its ListOptions validation).
fn no_watch_list() -> Response {
    failure(
        422,
        "Invalid",
        "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled".into(),
    )
}

fn bad_request(message: String) -> Response {
    failure(400, "BadRequest", message)
}

/// One field error of a 422, as the API's `details.causes` carry it:
/// (reason, field, detail).
type Cause = (&'static str, String, String);

fn required(field: &str) -> Cause {
    ("FieldValueRequired", field.into(), "Required value".into())
}

fn invalid_value(field: &str, value: &str, detail: &str) -> Cause {
    let detail = format!("Invalid value: {value:?}: {detail}");
    ("FieldValueInvalid", field.into(), detail)
}

/// A 422 from validation, worded as the API server words it: the type's
/// Kind (`Event "NAME" is invalid: ...`), every field error listed, in
/// `details.causes` too.
fn invalid_causes(type_kind: &str, name: &str, causes: &[Cause]) -> Response {
    let mut errors: Vec<String> = causes
        .iter()
        .map(|(_, field, detail)| format!("{field}: {detail}"))
        .collect();
    let listed = match errors.len() {
        1 => errors.remove(0),
        _ => format!("[{}]", errors.join(", ")),
    };
    let message = format!("{type_kind} {name:?} is invalid: {listed}");
    let mut body = serde_json::to_value(status(422, "Invalid", message, None)).expect("status");
    body["details"] = json!({
        "name": name,
        "kind": type_kind,
        "causes": causes.iter().map(|(reason, field, detail)| json!({
            "reason": reason, "message": detail, "field": field,
        })).collect::<Vec<_>>(),
    });
    (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response()
}

fn invalid(kind: Kind, name: &str, problem: String) -> Response {
    let message = format!("{} is invalid: {problem}", kind.named(name));
    failure_about(422, "Invalid", message, Some((kind, name)))
}

fn unsupported() -> Response {
    let message = "the test API server does not implement this call (tests/common/kube.rs)";
    failure(405, "MethodNotAllowed", message.into())
}

async fn record(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let (method, uri) = (req.method().to_string(), req.uri());
    let seen = ApiRequest {
        method,
        path: uri.path().into(),
        query: uri.query().unwrap_or("").into(),
    };
    let injected = {
        let mut st = shared.lock();
        let hit = st
            .failures
            .iter()
            .position(|(m, p, _)| *m == seen.method && *p == seen.path);
        st.requests.push(seen);
        hit.map(|i| st.failures.remove(i).2)
    };
    let mut hole = shared.black_hole.subscribe();
    let _ = hole.wait_for(|on| !*on).await;
    let message = "injected by the test API server";
    if let Some(code) = injected {
        return failure(code, "InternalError", message.into());
    }
    let rbac = shared.lock().rbac.clone();
    if let Some(rbac) = rbac {
        let (path, query) = (req.uri().path(), req.uri().query().unwrap_or(""));
        if let Some(a) = attributes(req.method().as_str(), path, query)
            && !rbac.allows(&a)
        {
            let user = format!(
                "system:serviceaccount:{}:{}",
                PINSWAP_USER.0, PINSWAP_USER.1
            );
            shared.lock().forbidden.push(format!("{} {path}", a.verb));
            return forbidden(&a, &user);
        }
    }
    next.run(req).await
}

type ApiState = State<Arc<Shared>>;
type Params = Path<HashMap<String, String>>;

/// The resource a URL names, `None` for one this server doesn't know.
fn kind_of(p: &HashMap<String, String>) -> Option<Kind> {
    let group = p.get("group").map_or("", String::as_str);
    KINDS
        .into_iter()
        .find(|k| k.0 == group && Some(k.1) == p.get("plural").map(String::as_str))
}

fn no_such_resource() -> Response {
    let message = "the server could not find the requested resource";
    failure(404, "NotFound", message.into())
}

async fn read(State(s): ApiState, Path(p): Params) -> Response {
    let Some(kind) = kind_of(&p) else {
        return no_such_resource();
    };
    match s
        .lock()
        .objects
        .get(&(kind.1, p["ns"].clone(), p["name"].clone()))
    {
        Some(obj) => Json(obj.clone()).into_response(),
        None => not_found(kind, &p["name"]),
    }
}

async fn list_nodes(State(s): ApiState, Query(q): Query<HashMap<String, String>>) -> Response {
    if q.contains_key("sendInitialEvents") {
        return no_watch_list();
    }
    if q.contains_key("watch") {
        return no_such_resource();
    }
    let st = s.lock();
    Json(serde_json::json!({
        "kind": "PartialObjectMetadataList",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": st.rv.to_string()},
        "items": st.nodes,
    }))
    .into_response()
}

/// List or watch of Namespaces (cluster-scoped).
async fn list_namespaces(
    State(s): ApiState,
    uri: axum::http::Uri,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch_pods(&s, &uri, NAMESPACES, None, q)
}

async fn read_namespace(State(s): ApiState, Path(p): Params) -> Response {
    let name = &p["ns"];
    match s
        .lock()
        .objects
        .get(&(NAMESPACES.1, String::new(), name.clone()))
    {
        Some(obj) => Json(obj.clone()).into_response(),
        None => not_found(NAMESPACES, name),
    }
}

async fn all_pods(
    State(s): ApiState,
    uri: axum::http::Uri,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch_pods(&s, &uri, PODS, None, q)
}

/// Cluster-wide list or watch of a workload kind.
async fn list_all(
    State(s): ApiState,
    Path(p): Params,
    uri: axum::http::Uri,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    match kind_of(&p) {
        Some(k) if k != PODS && WATCHABLE.iter().any(|(w, _, _)| *w == k) => {
            list_or_watch_pods(&s, &uri, k, None, q)
        }
        Some(_) => unsupported(),
        None => no_such_resource(),
    }
}

async fn list(
    State(s): ApiState,
    Path(p): Params,
    uri: axum::http::Uri,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    match kind_of(&p) {
        Some(k) if WATCHABLE.iter().any(|(w, _, _)| *w == k) => {
            list_or_watch_pods(&s, &uri, k, Some(p["ns"].clone()), q)
        }
        Some(_) => unsupported(),
        None => no_such_resource(),
    }
}

/// List or watch `kind` (Pods or a workload kind).
fn list_or_watch_pods(
    shared: &Arc<Shared>,
    uri: &axum::http::Uri,
    kind: Kind,
    ns: Option<String>,
    q: HashMap<String, String>,
) -> Response {
    let (_, api_version, kind_name) = *WATCHABLE
        .iter()
        .find(|(k, _, _)| *k == kind)
        .expect("a watchable kind");
    let plural = kind.1;
    let expired = || ApiRequest {
        method: "GET".into(),
        path: uri.path().into(),
        query: uri.query().unwrap_or("").into(),
    };
    let param = |k: &str| q.get(k).map_or("", String::as_str);
    // `metadata.name=NAME` only, as a watch of one object asks.
    let only: Option<String> = match param("fieldSelector") {
        "" => None,
        f => match f.strip_prefix("metadata.name=") {
            Some(n) if !n.contains(',') => Some(n.to_owned()),
            _ => {
                return bad_request(format!(
                    "fieldSelector {f:?} is not implemented by the test API server (only metadata.name=NAME)"
                ));
            }
        },
    };
    let only_name = only.clone();
    let named = move |line: &str| {
        only.as_deref().is_none_or(|n| {
            serde_json::from_str::<Value>(line).is_ok_and(|v| v["object"]["metadata"]["name"] == n)
        })
    };
    // As kube-apiserver without its WatchList feature: the watchers then
    // list in pages.
    if !param("sendInitialEvents").is_empty() {
        return no_watch_list();
    }
    for refused in ["labelSelector", "resourceVersionMatch"] {
        if !param(refused).is_empty() {
            return bad_request(format!(
                "{refused} is not implemented by the test API server"
            ));
        }
    }
    let ns_key = ns.clone().unwrap_or_default();
    let in_scope = move |pod_ns: &str| ns.as_deref().is_none_or(|n| n == pod_ns);
    let mut st = shared.lock();
    let pods_of = |st: &Store| -> Vec<Value> {
        st.objects
            .iter()
            .filter(|((p, ns, name), _)| {
                *p == plural && in_scope(ns) && only_name.as_deref().is_none_or(|n| n == name)
            })
            .map(|(_, pod)| pod.clone())
            .collect()
    };
    if !matches!(param("watch"), "true" | "1") {
        // Pages of `limit` items; `continue` is "RV/OFFSET", the list's
        // resourceVersion and how many items came before. Unlike etcd's
        // snapshot, later pages read the current store; a token older than
        // the watch history gets 410, as a compacted one does.
        let limit = match param("limit") {
            "" | "0" => usize::MAX,
            n => match n.parse::<usize>() {
                Ok(n) => n,
                Err(_) => return bad_request(format!("invalid limit {n:?}")),
            },
        };
        let (rv, offset) = match param("continue") {
            "" => (st.rv, 0),
            token => match token
                .split_once('/')
                .and_then(|(rv, off)| Some((rv.parse::<u64>().ok()?, off.parse::<usize>().ok()?)))
            {
                Some((rv, offset)) if rv < st.oldest_watchable => {
                    st.expired.push(expired());
                    let message = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.".to_owned();
                    // As etcd's store: a token to go on from the current
                    // state, inconsistently.
                    let mut body = serde_json::to_value(status(410, "Expired", message, None))
                        .expect("status");
                    body["metadata"]["continue"] = format!("{}/{offset}", st.rv).into();
                    return (StatusCode::GONE, Json(body)).into_response();
                }
                Some(parsed) => parsed,
                None => return bad_request(format!("invalid continue token {token:?}")),
            },
        };
        // Later pages read the snapshot the first one took, as etcd's
        // list at the token's revision does.
        let key = (plural, ns_key.clone(), rv);
        // Shared, not copied: a paged list of N Pods reads N Pods, not N
        // per page.
        let all = match st.list_snapshots.get(&key) {
            Some(snapshot) if offset > 0 => snapshot.clone(),
            _ => Arc::new(pods_of(&st)),
        };
        let end = offset.saturating_add(limit).min(all.len());
        if end < all.len() {
            st.list_snapshots.insert(key, all.clone());
        }
        let more = end < all.len();
        let metadata = ListMeta {
            resource_version: Some(rv.to_string()),
            continue_: more.then(|| format!("{rv}/{end}")),
            remaining_item_count: more.then(|| (all.len() - end) as i64),
            ..Default::default()
        };
        if kind != PODS {
            return Json(json!({
                "kind": format!("{kind_name}List"),
                "apiVersion": api_version,
                "metadata": metadata,
                "items": all[offset.min(end)..end],
            }))
            .into_response();
        }
        let items = all[offset.min(end)..end]
            .iter()
            .map(|p| serde_json::from_value(p.clone()).expect("stored pod"))
            .collect();
        return Json(k8s_openapi::List::<Pod> { items, metadata }).into_response();
    }

    // A watch replays what happened after `resourceVersion`, then goes live.
    let pods = pods_of(&st);
    let (since, backlog): (u64, Vec<Arc<str>>) = match param("resourceVersion") {
        // "" and "0": from now, with a synthetic ADDED for every Pod.
        "" | "0" => (
            st.rv,
            pods.iter()
                .map(|p| json!({"type": "ADDED", "object": p}).to_string().into())
                .collect(),
        ),
        rv => match rv.parse::<u64>() {
            Ok(rv) if rv < st.oldest_watchable => {
                st.expired.push(expired());
                let message = format!("too old resource version: {rv} ({})", st.oldest_watchable);
                let status = status(410, "Expired", message, None);
                let line = json!({"type": "ERROR", "object": status}).to_string();
                return watch_response(stream::iter([line.into()]).boxed());
            }
            Ok(rv) => {
                let newer = st.pod_history.iter().filter(|(p, v, ns, line)| {
                    *p == plural && *v > rv && in_scope(ns) && named(line)
                });
                (rv, newer.map(|(_, _, _, line)| line.clone()).collect())
            }
            Err(_) => return bad_request(format!("invalid resource version {rv:?}")),
        },
    };
    let bookmarks = param("allowWatchBookmarks") == "true";
    let mut backlog = backlog;
    if bookmarks && param("resourceVersion") == "0" {
        // kube-apiserver ends the synthetic ADDEDs with this bookmark.
        let object = json!({"kind": kind_name, "apiVersion": api_version, "metadata": {
            "resourceVersion": since.to_string(),
            "annotations": {"k8s.io/initial-events-end": "true"},
        }});
        backlog.push(
            json!({"type": "BOOKMARK", "object": object})
                .to_string()
                .into(),
        );
    }
    let rx = shared.feed.subscribe();
    let hole = shared.black_hole.subscribe();
    *st.watching.entry(plural).or_default() += 1;
    drop(st);
    let open = Watching(shared.clone(), plural);

    let live = stream::unfold((rx, hole, open), move |(mut rx, mut hole, open)| {
        let in_scope = in_scope.clone();
        let named = named.clone();
        async move {
            loop {
                let line: Arc<str> = match rx.recv().await {
                    Ok(Feed::Pod {
                        plural: p,
                        rv,
                        ns,
                        line,
                    }) if p == plural && rv > since && in_scope(&ns) && named(&line) => line,
                    // kube needs the apiVersion and kind the real API puts in
                    // a bookmark (k8s-openapi's WatchEvent::Bookmark leaves them out).
                    Ok(Feed::Bookmark(rv)) if bookmarks => {
                        let object = json!({"kind": kind_name, "apiVersion": api_version, "metadata": {"resourceVersion": rv.to_string()}});
                        json!({"type": "BOOKMARK", "object": object})
                            .to_string()
                            .into()
                    }
                    Ok(Feed::Pod { .. } | Feed::Bookmark(_)) => continue,
                    // Closed, or lagging too far behind: the API ends such watches too.
                    Ok(Feed::Close) | Err(_) => return None,
                };
                // Partitioned: nothing more arrives until it heals.
                let _ = hole.wait_for(|on| !*on).await;
                return Some((line, (rx, hole, open)));
            }
        }
    });
    let deadline = match param("timeoutSeconds").parse::<u64>() {
        Ok(secs) => tokio::time::sleep(Duration::from_secs(secs)).boxed(),
        Err(_) => std::future::pending().boxed(),
    };
    watch_response(
        stream::iter(backlog)
            .chain(live)
            .take_until(deadline)
            .boxed(),
    )
}

/// An open watch of a kind, counted in [`Store::watching`] while it lives.
struct Watching(Arc<Shared>, &'static str);

impl Drop for Watching {
    fn drop(&mut self) {
        if let Some(n) = self.0.lock().watching.get_mut(self.1) {
            *n -= 1;
        }
    }
}

fn watch_response(lines: stream::BoxStream<'static, Arc<str>>) -> Response {
    let body = lines.map(|line| Ok::<_, Infallible>(Bytes::from(format!("{line}\n"))));
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

/// Decodes a `K` for namespace `ns`, as the API's request decoding does.
fn decode<K: Resource + Metadata<Ty = ObjectMeta> + DeserializeOwned>(
    body: &[u8],
    ns: &str,
) -> Result<K, Response> {
    let obj: K = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("decoding {}: {e}", K::KIND)))?;
    if obj.metadata().namespace.as_deref().is_some_and(|n| n != ns) {
        let message =
            "the namespace of the provided object does not match the namespace sent on the request";
        return Err(bad_request(message.into()));
    }
    Ok(obj)
}

async fn create(State(s): ApiState, Path(p): Params, body: Bytes) -> Response {
    let result = match kind_of(&p) {
        Some(CORE_EVENTS) => {
            create_as::<CoreEvent>(&s, CORE_EVENTS, &p["ns"], &body, check_core_event)
        }
        Some(EVENTS) => create_as::<Event>(&s, EVENTS, &p["ns"], &body, check_event),
        Some(LEASES) => create_as::<Lease>(&s, LEASES, &p["ns"], &body, |_, _, _| vec![]),
        Some(SECRETS) => create_as::<Secret>(&s, SECRETS, &p["ns"], &body, |_, _, _| vec![]),
        Some(CONFIG_MAPS) => {
            create_as::<ConfigMap>(&s, CONFIG_MAPS, &p["ns"], &body, |_, _, _| vec![])
        }
        Some(_) => Err(unsupported()),
        None => Err(no_such_resource()),
    };
    result.unwrap_or_else(|e| e)
}

/// Validation of a new object, or of an update of `old`: its field errors.
type Check<K> = fn(&K, Option<&K>, &str) -> Vec<Cause>;

fn create_as<K>(
    s: &Shared,
    kind: Kind,
    ns: &str,
    body: &[u8],
    check: Check<K>,
) -> Result<Response, Response>
where
    K: Resource + Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned,
{
    let obj: K = decode(body, ns)?;
    let mut st = s.lock();
    let name = match (&obj.metadata().name, &obj.metadata().generate_name) {
        (Some(name), _) if !name.is_empty() => name.clone(),
        (_, Some(prefix)) if !prefix.is_empty() => {
            format!("{prefix}{}", generated_suffix(st.rv + 1))
        }
        _ => {
            return Err(invalid(
                kind,
                "",
                "metadata.name: Required value: name or generateName is required".into(),
            ));
        }
    };
    let causes = check(&obj, None, ns);
    if !causes.is_empty() {
        return Err(invalid_causes(K::KIND, &name, &causes));
    }
    if st
        .objects
        .contains_key(&(kind.1, ns.to_owned(), name.clone()))
    {
        let message = format!("{} already exists", kind.named(&name));
        let about = Some((kind, name.as_str()));
        return Err(failure_about(409, "AlreadyExists", message, about));
    }
    let value = serde_json::to_value(&obj).expect("serialise");
    Ok((
        StatusCode::CREATED,
        Json(st.write(kind, ns, &name, value).0),
    )
        .into_response())
}

/// Like the API server's random 5-character `generateName` suffix, but
/// derived from `n`, so unique per resourceVersion.
fn generated_suffix(mut n: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut next = || {
        let c = ALPHABET[(n % 27) as usize] as char;
        n /= 27;
        c
    };
    (0..5).map(|_| next()).collect()
}

/// events.k8s.io/v1 validation, as kube-apiserver's (pkg/apis/core/validation,
/// events.go) words it: the internal type's field names (`message` for
/// the note), limits in bytes, and on update only the series may change.
fn check_event(e: &Event, old: Option<&Event>, _ns: &str) -> Vec<Cause> {
    let mut out = Vec::new();
    let text = |v: &Option<String>| v.clone().unwrap_or_default();
    let controller = text(&e.reporting_controller);
    if controller.is_empty() {
        out.push(required("reportingController"));
    }
    out.extend(qualified_name(&controller, "reportingController"));
    let limited = [
        ("reportingInstance", &e.reporting_instance, true),
        ("action", &e.action, true),
        ("reason", &e.reason, true),
        ("message", &e.note, false),
    ];
    for (field, value, needed) in limited {
        let v = text(value);
        let max = if field == "message" { 1024 } else { 128 };
        if needed && v.is_empty() {
            out.push(required(field));
        }
        if v.len() > max {
            out.push(invalid_value(
                field,
                "",
                &format!("can have at most {max} characters"),
            ));
        }
    }
    if e.event_time.is_none() {
        out.push(required("eventTime"));
    }
    let type_ = text(&e.type_);
    if type_ != "Normal" && type_ != "Warning" {
        out.push(invalid_value(
            "type",
            "",
            &format!("has invalid value: {type_}"),
        ));
    }
    let Some(old) = old else { return out };
    if e.series != old.series
        && let Some(series) = &e.series
        && series.count < 2
    {
        out.push(invalid_value("series.count", "", "should be at least 2"));
    }
    let json = |v: &dyn erased::Json| v.json();
    let immutable: [(&str, Value, Value); 9] = [
        ("regarding", json(&e.regarding), json(&old.regarding)),
        ("reason", json(&e.reason), json(&old.reason)),
        ("message", json(&e.note), json(&old.note)),
        ("type", json(&e.type_), json(&old.type_)),
        ("eventTime", json(&e.event_time), json(&old.event_time)),
        ("action", json(&e.action), json(&old.action)),
        ("related", json(&e.related), json(&old.related)),
        (
            "reportingController",
            json(&e.reporting_controller),
            json(&old.reporting_controller),
        ),
        (
            "reportingInstance",
            json(&e.reporting_instance),
            json(&old.reporting_instance),
        ),
    ];
    for (field, new, was) in immutable {
        if new != was {
            let shown = new.as_str().map_or_else(|| new.to_string(), str::to_owned);
            out.push(invalid_value(field, &shown, "field is immutable"));
        }
    }
    out
}

mod erased {
    /// Any field as JSON, to compare old and new alike.
    pub trait Json {
        fn json(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> serde_json::Value {
            serde_json::to_value(self).expect("serialise")
        }
    }
}

/// apimachinery's IsQualifiedName: an optional DNS-subdomain prefix and a
/// name part of at most 63 bytes.
fn qualified_name(v: &str, field: &str) -> Vec<Cause> {
    let mut out = Vec::new();
    let name = match v.split('/').collect::<Vec<_>>()[..] {
        [name] => name,
        [prefix, name] => {
            if prefix.is_empty() {
                out.push(invalid_value(field, v, "prefix part must be non-empty"));
            }
            name
        }
        _ => {
            let detail = "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')";
            return vec![invalid_value(field, v, detail)];
        }
    };
    if name.is_empty() {
        out.push(invalid_value(field, v, "name part must be non-empty"));
    } else if name.len() > 63 {
        out.push(invalid_value(
            field,
            v,
            "name part must be no more than 63 bytes",
        ));
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    let ok = name.starts_with(alnum)
        && name.ends_with(alnum)
        && name.chars().all(|c| alnum(c) || "-_.".contains(c));
    if !ok {
        let detail = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
        out.push(invalid_value(field, v, detail));
    }
    out
}

// Not judged against kube-apiserver: pinswap writes events.k8s.io/v1 only.
fn check_core_event(e: &CoreEvent, _old: Option<&CoreEvent>, ns: &str) -> Vec<Cause> {
    let problem =
        |field: &str, detail: String| vec![("FieldValueInvalid", field.to_owned(), detail)];
    for (field, value) in [("reason", &e.reason), ("action", &e.action)] {
        let n = value.as_deref().unwrap_or("").chars().count();
        if n > 128 {
            return problem(
                field,
                format!("Too long: may not be more than 128 characters ({n})"),
            );
        }
    }
    let message = e.message.as_deref().unwrap_or("").len();
    if e.reporting_component
        .as_deref()
        .is_some_and(|c| !c.is_empty())
        && message > 1024
    {
        return problem(
            "message",
            format!("Too long: may not be more than 1024 bytes ({message})"),
        );
    }
    match e.involved_object.namespace.as_deref() {
        Some(n) if !n.is_empty() && n != ns => vec![invalid_value(
            "involvedObject.namespace",
            n,
            "does not match event.namespace",
        )],
        _ => vec![],
    }
}

/// PUT, for Leases, Secrets and ConfigMaps: a `metadata.resourceVersion` other than the
/// stored one gets 409 Conflict; none at all is an unconditional update.
async fn replace(State(s): ApiState, Path(p): Params, body: Bytes) -> Response {
    match kind_of(&p) {
        Some(LEASES) => {
            replace_as::<Lease>(&s, LEASES, &p["ns"], &p["name"], &body).unwrap_or_else(|e| e)
        }
        Some(SECRETS) => secret_update_allowed(&s, &p["ns"], &p["name"], &body)
            .and_then(|()| replace_as::<Secret>(&s, SECRETS, &p["ns"], &p["name"], &body))
            .unwrap_or_else(|e| e),
        // As the API server: no create on update, a stale resourceVersion
        // gets 409.
        Some(CONFIG_MAPS) => replace_as::<ConfigMap>(&s, CONFIG_MAPS, &p["ns"], &p["name"], &body)
            .unwrap_or_else(|e| e),
        Some(_) => unsupported(),
        None => no_such_resource(),
    }
}

fn replace_as<K>(
    s: &Shared,
    kind: Kind,
    ns: &str,
    name: &str,
    body: &[u8],
) -> Result<Response, Response>
where
    K: Resource + Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned,
{
    let obj: K = decode(body, ns)?;
    let meta = obj.metadata();
    if let Some(named) = meta.name.as_deref().filter(|n| *n != name) {
        return Err(bad_request(format!(
            "the name of the object ({named}) does not match the name on the URL ({name})"
        )));
    }
    let mut st = s.lock();
    let Some(current) = st.objects.get(&(kind.1, ns.to_owned(), name.to_owned())) else {
        // Leases are created by a PUT (AllowCreateOnUpdate); Secrets not.
        if kind == LEASES {
            let value = serde_json::to_value(&obj).expect("serialise");
            let created = st.write(kind, ns, name, value).0;
            return Ok((StatusCode::CREATED, Json(created)).into_response());
        }
        return Err(not_found(kind, name));
    };
    if kind == LEASES && meta.resource_version.as_deref().unwrap_or("").is_empty() {
        // No unconditional update of a Lease.
        let detail = "Invalid value: 0: must be specified for an update";
        let message = format!(
            "{} is invalid: metadata.resourceVersion: {detail}",
            kind.named(name)
        );
        let mut body = serde_json::to_value(status(422, "Invalid", message, Some((kind, name))))
            .expect("status");
        body["details"]["causes"] = json!([{
            "reason": "FieldValueInvalid", "message": detail, "field": "metadata.resourceVersion",
        }]);
        return Err((StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response());
    }
    if meta
        .resource_version
        .as_ref()
        .is_some_and(|rv| current["metadata"]["resourceVersion"] != *rv)
    {
        let message = format!(
            "Operation cannot be fulfilled on {}: the object has been modified; {}",
            kind.named(name),
            "please apply your changes to the latest version and try again"
        );
        return Err(failure_about(409, "Conflict", message, Some((kind, name))));
    }
    let value = serde_json::to_value(&obj).expect("serialise");
    Ok(Json(st.write(kind, ns, name, value).0).into_response())
}

/// The API's Secret update validation: `type` cannot change, and an
/// `immutable` Secret's data cannot either (422 Invalid).
fn secret_update_allowed(s: &Shared, ns: &str, name: &str, body: &[u8]) -> Result<(), Response> {
    let new: Value =
        serde_json::from_slice(body).map_err(|e| bad_request(format!("decoding Secret: {e}")))?;
    let st = s.lock();
    let Some(old) = st.objects.get(&(SECRETS.1, ns.to_owned(), name.to_owned())) else {
        return Ok(());
    };
    let type_of = |v: &Value| v["type"].as_str().unwrap_or("Opaque").to_owned();
    if type_of(old) != type_of(&new) {
        let cause = invalid_value("type", &type_of(&new), "field is immutable");
        return Err(invalid_causes("Secret", name, &[cause]));
    }
    if old["immutable"] == true && (old["data"] != new["data"] || new["immutable"] != true) {
        let detail = "Forbidden: field is immutable when `immutable` is set".into();
        return Err(invalid_causes(
            "Secret",
            name,
            &[("FieldValueForbidden", "data".into(), detail)],
        ));
    }
    Ok(())
}

/// PATCH, for Events: merge patch, or strategic merge patch, which is the
/// same for an Event's fields. (kube sends JSON patches only with its
/// `jsonpatch` feature, and server-side apply isn't implemented.)
async fn patch(State(s): ApiState, Path(p): Params, headers: HeaderMap, body: Bytes) -> Response {
    let (ns, name) = (&p["ns"], &p["name"]);
    let result = match kind_of(&p) {
        Some(CORE_EVENTS) => {
            patch_as::<CoreEvent>(&s, CORE_EVENTS, ns, name, &headers, &body, check_core_event)
        }
        Some(EVENTS) => patch_as::<Event>(&s, EVENTS, ns, name, &headers, &body, check_event),
        Some(_) => Err(unsupported()),
        None => Err(no_such_resource()),
    };
    result.unwrap_or_else(|e| e)
}

fn patch_as<K: Resource + DeserializeOwned>(
    s: &Shared,
    kind: Kind,
    ns: &str,
    name: &str,
    headers: &HeaderMap,
    body: &[u8],
    check: Check<K>,
) -> Result<Response, Response> {
    let mut st = s.lock();
    let key = (kind.1, ns.to_owned(), name.to_owned());
    let mut obj = st
        .objects
        .get(&key)
        .cloned()
        .ok_or_else(|| not_found(kind, name))?;
    if obj["apiVersion"] != K::API_VERSION {
        // The real API converts between the two Event APIs; this one doesn't.
        let created_as = &obj["apiVersion"];
        return Err(bad_request(format!(
            "{} was created as {created_as}: patch it through that API",
            kind.named(name)
        )));
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    if !matches!(
        content_type.unwrap_or(""),
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) {
        let message = format!("unsupported patch type {content_type:?} (only merge patches here)");
        return Err(failure(415, "UnsupportedMediaType", message));
    }
    let patch: Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("decoding the patch: {e}")))?;
    let old = serde_json::from_value::<K>(obj.clone()).expect("stored object");
    json_patch::merge(&mut obj, &patch);
    let patched =
        serde_json::from_value::<K>(obj.clone()).map_err(|e| invalid(kind, name, e.to_string()))?;
    let causes = check(&patched, Some(&old), ns);
    if !causes.is_empty() {
        return Err(invalid_causes(K::KIND, name, &causes));
    }
    Ok(Json(st.write(kind, ns, name, obj).0).into_response())
}

/// GET of a cluster-scoped object (MutatingWebhookConfigurations).
async fn read_cluster(State(s): ApiState, Path(p): Params) -> Response {
    match kind_of(&p) {
        Some(WEBHOOKS) => {
            match s
                .lock()
                .objects
                .get(&(WEBHOOKS.1, String::new(), p["name"].clone()))
            {
                Some(obj) => Json(obj.clone()).into_response(),
                None => not_found(WEBHOOKS, &p["name"]),
            }
        }
        _ => no_such_resource(),
    }
}

/// PATCH of a MutatingWebhookConfiguration with a JSON patch, applied
/// atomically: a failed `test` op changes nothing and gets 422.
async fn json_patch_cluster(
    State(s): ApiState,
    Path(p): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if kind_of(&p) != Some(WEBHOOKS) {
        return no_such_resource();
    }
    let name = &p["name"];
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    if content_type != Some("application/json-patch+json") {
        let message = format!("unsupported patch type {content_type:?} (only JSON patches here)");
        return failure(415, "UnsupportedMediaType", message);
    }
    let ops: json_patch::Patch = match serde_json::from_slice(&body) {
        Ok(ops) => ops,
        Err(e) => return bad_request(format!("decoding the patch: {e}")),
    };
    let mut st = s.lock();
    let key = (WEBHOOKS.1, String::new(), name.clone());
    let Some(mut obj) = st.objects.get(&key).cloned() else {
        return not_found(WEBHOOKS, name);
    };
    if let Err(e) = json_patch::patch(&mut obj, &ops) {
        return failure(
            422,
            "Invalid",
            format!("the server rejected our request due to an error in our request: {e}"),
        );
    }
    if let Err(e) = serde_json::from_value::<MutatingWebhookConfiguration>(obj.clone()) {
        return invalid(WEBHOOKS, name, e.to_string());
    }
    Json(st.write(WEBHOOKS, "", name, obj).0).into_response()
}
