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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kube::Api;
use kube::api::{ApiResource, DynamicObject};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::usage::{Kind, Usage};
use crate::config::ImageFields;

/// What discovery said of one kind.
#[derive(Debug, PartialEq)]
enum Served {
    /// Served, namespaced, at this version.
    Yes(String),
    /// Its group or the kind is not served, or it is cluster-scoped.
    No,
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
    let mut running: HashMap<Kind, (String, JoinHandle<()>)> = HashMap::new();
    // Aborts the watches when this future is dropped (leadership lost).
    struct AbortAll<'a>(&'a mut HashMap<Kind, (String, JoinHandle<()>)>);
    impl Drop for AbortAll<'_> {
        fn drop(&mut self) {
            for (_, (_, h)) in self.0.drain() {
                h.abort();
            }
        }
    }
    let running = AbortAll(&mut running);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let served = discover(&client, &kinds).await;
        for ((kind, fields), served) in kinds.iter().zip(served) {
            let current = running.0.get(kind).map(|(v, _)| v.clone());
            match (served, current) {
                (Served::Yes(v), Some(c)) if v == c => {}
                (Served::Yes(v), old) => {
                    if let Some((_, h)) = running.0.remove(kind) {
                        h.abort();
                    }
                    if old.is_none() {
                        info!(kind = kind.as_str(), version = %v, "custom resource served: watching its images");
                    }
                    for s in &scopes {
                        usage.watch(*kind, s.as_deref());
                    }
                    let h = tokio::spawn(watch_kind(
                        client.clone(),
                        usage.clone(),
                        scopes.clone(),
                        *kind,
                        fields.clone(),
                        v.clone(),
                    ));
                    running.0.insert(*kind, (v, h));
                }
                (Served::No, old) => {
                    if let Some((_, h)) = running.0.remove(kind) {
                        h.abort();
                    }
                    if old.is_some() {
                        info!(
                            kind = kind.as_str(),
                            "custom resource no longer served: its images no longer count as named"
                        );
                    }
                    usage.unwatch(*kind);
                }
                (Served::Unknown, _) => {}
            }
        }
    }
}

/// Asks discovery, once per group, which of `kinds` are served.
async fn discover(client: &kube::Client, kinds: &[(Kind, Arc<ImageFields>)]) -> Vec<Served> {
    let groups = match client.list_api_groups().await {
        Ok(g) => g,
        Err(e) => {
            warn!(error = %e, "API discovery failed; custom resource watches stay as they are");
            return kinds.iter().map(|_| Served::Unknown).collect();
        }
    };
    let mut resources: HashMap<String, Option<(String, Vec<_>)>> = HashMap::new();
    let mut out = Vec::with_capacity(kinds.len());
    for (_, f) in kinds {
        if !resources.contains_key(&f.group) {
            let listed = match groups.groups.iter().find(|g| g.name == f.group) {
                None => Some(None),
                Some(g) => {
                    let version = g
                        .preferred_version
                        .as_ref()
                        .or(g.versions.first())
                        .map(|v| v.group_version.clone());
                    match version {
                        None => Some(None),
                        Some(gv) => match client.list_api_group_resources(&gv).await {
                            Ok(list) => Some(Some((gv, list.resources))),
                            Err(e) => {
                                warn!(group_version = %gv, error = %e, "API discovery of a group failed; its custom resource watches stay as they are");
                                None
                            }
                        },
                    }
                }
            };
            match listed {
                Some(l) => {
                    resources.insert(f.group.clone(), l);
                }
                None => {
                    out.push(Served::Unknown);
                    continue;
                }
            }
        }
        out.push(match &resources[&f.group] {
            None => Served::No,
            Some((gv, list)) => match list
                .iter()
                .find(|r| r.name == f.resource && r.kind == f.kind)
            {
                Some(r) if r.namespaced => Served::Yes(gv.clone()),
                Some(_) => {
                    warn!(kind = %f.name(), "custom resource is cluster-scoped; only namespaced kinds are watched");
                    Served::No
                }
                None => Served::No,
            },
        });
    }
    out
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
