//! The leader's watches of custom resources that name images
//! (`customResources`, src/config/resources.rs): each object's images are
//! kept in [`Usage`] as a Pod's would be, so the backfill copies them ahead
//! of any Pod, and retention and the usage record count them. The objects
//! are never changed.
//!
//! Which kinds exist is the API server's discovery, asked again every
//! `discoveryInterval`: a kind it does not serve is not an error, and is
//! watched once its CRD is installed. Fail closed: every configured kind
//! counts as unsynced ([`Usage::synced`], so retention removes nothing)
//! until discovery has answered for it; only an answer that the kind is
//! not served drops it, never a failed request.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::{AbortHandle, Abortable};
use futures::stream::FuturesUnordered;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResource;
use kube::Api;
use kube::api::{ApiResource, DynamicObject};
use tracing::{info, warn};

use super::usage::{Kind, Usage};
use crate::config::ImageFields;

/// A group's versions, each with its resources, `None` where listing them
/// failed.
type Versions = Vec<(String, Option<Vec<APIResource>>)>;

/// What discovery said of one kind.
#[derive(Debug, PartialEq)]
enum Served {
    /// Served, namespaced, at this version.
    Yes(String),
    /// Its group or the kind is not served at any version, or it is
    /// cluster-scoped; `group_served`: the group is.
    No { group_served: bool },
    /// Discovery failed: keep what was known.
    Unknown,
}

/// Registers a watch per kind and scope with `usage`, then keeps one
/// running for each kind the API server serves, until dropped.
pub async fn watch(
    client: kube::Client,
    usage: Arc<Usage>,
    namespaces: Vec<String>,
    fields: Vec<ImageFields>,
    interval: Duration,
) {
    if fields.is_empty() {
        return std::future::pending().await;
    }
    let scopes: Vec<Option<String>> = match namespaces.is_empty() {
        true => vec![None],
        false => namespaces.into_iter().map(Some).collect(),
    };
    let kinds: Vec<(Kind, Arc<ImageFields>)> = fields
        .into_iter()
        .map(|f| (Kind::custom(&f.name()), Arc::new(f)))
        .collect();
    for (kind, _) in &kinds {
        for s in &scopes {
            usage.watch(*kind, s.as_deref());
        }
    }
    // The watches run inside this future, not spawned: a stopped one is
    // never polled again, so no event of it can reach `usage` after its
    // kind is watched anew or forgotten, and dropping this future (lost
    // leadership) stops them all at once.
    let mut running: HashMap<Kind, (String, AbortHandle)> = HashMap::new();
    let mut tasks = FuturesUnordered::new();
    let mut warned: HashSet<Kind> = HashSet::new();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // An aborted watch ends; the others never do.
            Some(_) = tasks.next(), if !tasks.is_empty() => continue,
        }
        // The watches go on while discovery asks: it may take a while.
        let running_versions: HashMap<Kind, String> =
            running.iter().map(|(k, (v, _))| (*k, v.clone())).collect();
        let asking = discover(&client, &kinds, &running_versions);
        tokio::pin!(asking);
        let served = loop {
            tokio::select! {
                s = &mut asking => break s,
                Some(_) = tasks.next(), if !tasks.is_empty() => {}
            }
        };
        for ((kind, fields), served) in kinds.iter().zip(served) {
            let current = running.get(kind).map(|(v, _)| v.clone());
            match (served, current) {
                (Served::Yes(v), Some(c)) if v == c => {}
                (Served::Yes(v), old) => {
                    if let Some((_, h)) = running.remove(kind) {
                        h.abort();
                    }
                    if old.is_none() {
                        info!(kind = kind.as_str(), version = %v, "custom resource served: watching its images");
                    }
                    warned.remove(kind);
                    for s in &scopes {
                        usage.watch(*kind, s.as_deref());
                    }
                    let (handle, registration) = AbortHandle::new_pair();
                    let task = watch_kind(
                        client.clone(),
                        usage.clone(),
                        scopes.clone(),
                        *kind,
                        fields.clone(),
                        v.clone(),
                    );
                    tasks.push(Abortable::new(task, registration));
                    running.insert(*kind, (v, handle));
                }
                (Served::No { group_served }, old) => {
                    if let Some((_, h)) = running.remove(kind) {
                        h.abort();
                    }
                    if old.is_some() {
                        info!(
                            kind = kind.as_str(),
                            "custom resource no longer served: its images no longer count as named"
                        );
                    } else if group_served && warned.insert(*kind) {
                        warn!(
                            kind = kind.as_str(),
                            resource = %fields.resource,
                            "the API group is served but no version of it serves this kind and resource; check customResources"
                        );
                    }
                    usage.unwatch(*kind);
                }
                // Unknown: a kind not watched now counts as unsynced again,
                // so that one whose CRD came meanwhile holds retention back.
                (Served::Unknown, None) => {
                    for s in &scopes {
                        usage.watch(*kind, s.as_deref());
                    }
                }
                (Served::Unknown, Some(_)) => {}
            }
        }
    }
}

/// Asks discovery which of `kinds` are served, and at which version: the
/// group's preferred version first, then its others (a kind may be served
/// only at an older one, as Tekton's StepAction is).
async fn discover(
    client: &kube::Client,
    kinds: &[(Kind, Arc<ImageFields>)],
    running: &HashMap<Kind, String>,
) -> Vec<Served> {
    let groups = match bounded(client.list_api_groups()).await {
        Ok(g) => g,
        Err(e) => {
            warn!(error = %e, "API discovery failed; custom resource watches stay as they are");
            return kinds.iter().map(|_| Served::Unknown).collect();
        }
    };
    let mut listed: HashMap<String, Option<Versions>> = HashMap::new();
    let mut out = Vec::with_capacity(kinds.len());
    for (kind, f) in kinds {
        if !listed.contains_key(&f.group) {
            let versions = match groups.groups.iter().find(|g| g.name == f.group) {
                None => None,
                Some(g) => {
                    let mut order: Vec<String> = g
                        .preferred_version
                        .iter()
                        .map(|v| v.group_version.clone())
                        .collect();
                    for v in &g.versions {
                        if !order.contains(&v.group_version) {
                            order.push(v.group_version.clone());
                        }
                    }
                    let mut versions = Vec::new();
                    for gv in order {
                        let resources = match bounded(client.list_api_group_resources(&gv)).await {
                            Ok(list) => Some(list.resources),
                            Err(e) => {
                                warn!(group_version = %gv, error = %e, "API discovery of a group version failed; its custom resource watches stay as they are");
                                None
                            }
                        };
                        versions.push((gv, resources));
                    }
                    Some(versions)
                }
            };
            listed.insert(f.group.clone(), versions);
        }
        out.push(served(listed[&f.group].as_ref(), f, running.get(kind)));
    }
    out
}

/// How long one discovery request may take, kube's retries of a 503
/// included: an aggregated API whose backend is down answers 503 to every
/// try, and the other kinds must not wait for it.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// `request`, cut at [`DISCOVERY_TIMEOUT`].
async fn bounded<T>(
    request: impl std::future::Future<Output = kube::Result<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(DISCOVERY_TIMEOUT, request).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {DISCOVERY_TIMEOUT:?}")),
    }
}

/// What `versions` (a group's, `None` when it is not served) say of `f`,
/// watched at `current` if at all: a version that still serves it is
/// kept, and one that could not be listed this time says nothing, so one
/// failed request never restarts a watch.
fn served(versions: Option<&Versions>, f: &ImageFields, current: Option<&String>) -> Served {
    let Some(versions) = versions else {
        return Served::No {
            group_served: false,
        };
    };
    if let Some(c) = current
        && let Some((_, listed)) = versions.iter().find(|(gv, _)| gv == c)
    {
        match listed {
            None => return Served::Unknown,
            Some(rs)
                if rs
                    .iter()
                    .any(|r| r.name == f.resource && r.kind == f.kind && r.namespaced) =>
            {
                return Served::Yes(c.clone());
            }
            Some(_) => {}
        }
    }
    let mut unknown = false;
    for (gv, resources) in versions {
        let Some(resources) = resources else {
            unknown = true;
            continue;
        };
        // `widgets/status` and other subresources share the kind.
        if let Some(r) = resources
            .iter()
            .find(|r| r.name == f.resource && r.kind == f.kind)
        {
            if r.namespaced {
                return Served::Yes(gv.clone());
            }
            warn!(kind = %f.name(), "custom resource is cluster-scoped; only namespaced kinds are watched");
            return Served::No { group_served: true };
        }
    }
    match unknown {
        true => Served::Unknown,
        false => Served::No { group_served: true },
    }
}

/// Feeds every event of one kind's watches (one per scope) to `usage`.
async fn watch_kind(
    client: kube::Client,
    usage: Arc<Usage>,
    scopes: Vec<Option<String>>,
    kind: Kind,
    fields: Arc<ImageFields>,
    group_version: String,
) {
    let (group, version) = group_version
        .split_once('/')
        .unwrap_or(("", group_version.as_str()));
    let ar = ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: group_version.clone(),
        kind: fields.kind.clone(),
        plural: fields.resource.clone(),
    };
    let apis = scopes
        .iter()
        .map(|scope| {
            let api: Api<DynamicObject> = match scope {
                None => Api::all_with(client.clone(), &ar),
                Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            };
            (scope.clone(), api)
        })
        .collect();
    let observe = |o: &DynamicObject| {
        let obj = serde_json::to_value(o).unwrap_or_default();
        Some(usage.observe_custom(kind, &o.metadata, &obj, &fields))
    };
    super::workloads::feed(&usage, kind, apis, observe).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CustomResources, ResourceProfile};

    fn step_action() -> ImageFields {
        let c = CustomResources {
            profiles: vec![ResourceProfile::Tekton],
            ..Default::default()
        };
        c.fields()
            .into_iter()
            .find(|f| f.kind == "StepAction")
            .unwrap()
    }

    fn resource(name: &str, kind: &str, namespaced: bool) -> APIResource {
        APIResource {
            name: name.into(),
            kind: kind.into(),
            namespaced,
            ..Default::default()
        }
    }

    #[test]
    fn a_kind_is_found_at_whichever_version_serves_it() {
        let f = step_action();
        // tekton.dev prefers v1, where StepAction is not served.
        let versions = vec![
            (
                "tekton.dev/v1".to_owned(),
                Some(vec![resource("tasks", "Task", true)]),
            ),
            (
                "tekton.dev/v1beta1".to_owned(),
                Some(vec![
                    resource("stepactions", "StepAction", true),
                    resource("stepactions/status", "StepAction", true),
                ]),
            ),
        ];
        assert_eq!(
            served(Some(&versions), &f, None),
            Served::Yes("tekton.dev/v1beta1".into())
        );
        // A version that could not be listed may be the one serving it.
        let failed = vec![
            (
                "tekton.dev/v1".to_owned(),
                Some(vec![resource("tasks", "Task", true)]),
            ),
            ("tekton.dev/v1beta1".to_owned(), None),
        ];
        assert_eq!(served(Some(&failed), &f, None), Served::Unknown);
        // Every version listed, none with it: not served.
        let none = vec![(
            "tekton.dev/v1".to_owned(),
            Some(vec![resource("tasks", "Task", true)]),
        )];
        assert_eq!(
            served(Some(&none), &f, None),
            Served::No { group_served: true }
        );
        assert_eq!(
            served(None, &f, None),
            Served::No {
                group_served: false
            }
        );
        // Watched at v1beta1: kept there even where v1 serves it too, and a
        // failed listing of it says nothing rather than restarting the watch.
        let both = vec![
            (
                "tekton.dev/v1".to_owned(),
                Some(vec![resource("stepactions", "StepAction", true)]),
            ),
            (
                "tekton.dev/v1beta1".to_owned(),
                Some(vec![resource("stepactions", "StepAction", true)]),
            ),
        ];
        let current = "tekton.dev/v1beta1".to_owned();
        assert_eq!(
            served(Some(&both), &f, Some(&current)),
            Served::Yes(current.clone())
        );
        assert_eq!(
            served(Some(&both), &f, None),
            Served::Yes("tekton.dev/v1".into())
        );
        let flaky = vec![
            (
                "tekton.dev/v1".to_owned(),
                Some(vec![resource("stepactions", "StepAction", true)]),
            ),
            ("tekton.dev/v1beta1".to_owned(), None),
        ];
        assert_eq!(served(Some(&flaky), &f, Some(&current)), Served::Unknown);
        let cluster = vec![(
            "tekton.dev/v1beta1".to_owned(),
            Some(vec![resource("stepactions", "StepAction", false)]),
        )];
        assert_eq!(
            served(Some(&cluster), &f, None),
            Served::No { group_served: true }
        );
    }
}
