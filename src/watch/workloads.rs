//! The leader's watches of workload templates (Deployments, StatefulSets,
//! DaemonSets, ReplicaSets, Jobs, CronJobs): only the images, pull fields
//! and namespace of each template are kept, in [`Usage`]. kube-runtime's
//! `watcher` lists (streamed where the API server offers it, else paged)
//! and watches each kind, re-listing on 410 Gone.

use std::fmt::Debug;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tracing::warn;

use super::usage::{Kind, Observed, Usage};

/// Registers every workload watch with `usage` (so [`Usage::synced`] waits
/// for them), then runs them until dropped.
pub async fn watch(client: kube::Client, usage: Arc<Usage>, namespaces: Vec<String>) {
    let scopes: Vec<Option<String>> = match namespaces.is_empty() {
        true => vec![None],
        false => namespaces.into_iter().map(Some).collect(),
    };
    for kind in Kind::WORKLOADS {
        for s in &scopes {
            usage.watch(kind, s.as_deref());
        }
    }
    let (c, u, s) = (&client, &usage, &scopes);
    tokio::join!(
        watch_kind::<Deployment>(c, u, s, Kind::Deployment, |o| o
            .spec
            .as_ref()
            .map(|s| &s.template)),
        watch_kind::<StatefulSet>(c, u, s, Kind::StatefulSet, |o| o
            .spec
            .as_ref()
            .map(|s| &s.template)),
        watch_kind::<DaemonSet>(c, u, s, Kind::DaemonSet, |o| o
            .spec
            .as_ref()
            .map(|s| &s.template)),
        watch_kind::<ReplicaSet>(c, u, s, Kind::ReplicaSet, |o| o
            .spec
            .as_ref()
            .and_then(|s| s.template.as_ref())),
        watch_kind::<Job>(c, u, s, Kind::Job, |o| o.spec.as_ref().map(|s| &s.template)),
        watch_kind::<CronJob>(c, u, s, Kind::CronJob, |o| o
            .spec
            .as_ref()
            .and_then(|s| s.job_template.spec.as_ref())
            .map(|s| &s.template)),
    );
}

/// Feeds every event of `kind`'s watches (one per scope) to `usage`.
async fn watch_kind<K>(
    client: &kube::Client,
    usage: &Usage,
    scopes: &[Option<String>],
    kind: Kind,
    template: fn(&K) -> Option<&PodTemplateSpec>,
) where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let apis = scopes
        .iter()
        .map(|scope| {
            let api: Api<K> = match scope {
                None => Api::all(client.clone()),
                Some(ns) => Api::namespaced(client.clone(), ns),
            };
            (scope.clone(), api)
        })
        .collect();
    let observe = |o: &K| template(o).map(|t| usage.observe_template(kind, o.meta(), t));
    feed(usage, kind, apis, observe).await
}

/// Feeds every event of the watches of `apis` (one per scope) to `usage`
/// as `kind`: `observe` reads an object, `None` when it names nothing
/// (then it counts as deleted). Runs until dropped.
pub(super) async fn feed<K>(
    usage: &Usage,
    kind: Kind,
    apis: Vec<(Option<String>, Api<K>)>,
    observe: impl Fn(&K) -> Option<Observed>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut relists = Some(usage.relists());
    loop {
        let streams = apis.iter().cloned().map(|(scope, api)| {
            super::lists::watch(api, watcher::Config::default())
                .default_backoff()
                .map(move |ev| (scope.clone(), ev))
                .boxed()
        });
        let mut events = futures::stream::select_all(streams);
        // New watchers list first: the usage record takes in what it left out.
        while let Some((scope, ev)) = tokio::select! {
            ev = events.next() => ev,
            _ = super::usage::relist_asked(&mut relists) => None,
        } {
            let scope = scope.as_deref();
            match ev {
                Ok(Event::Init) => usage.list_started(kind, scope),
                Ok(Event::InitApply(o) | Event::Apply(o)) => match observe(&o) {
                    Some(seen) => usage.seen(seen, scope),
                    None => usage.deleted(kind, &key(&o)),
                },
                Ok(Event::InitDone) => usage.list_done(kind, scope),
                Ok(Event::Delete(o)) => usage.deleted(kind, &key(&o)),
                Err(e) => {
                    usage.watch_failed(kind, scope);
                    warn!(kind = kind.as_str(), error = %e, "watch failed; retrying with backoff");
                }
            }
        }
    }
}

/// `namespace/name`, as [`super::usage::Observed::key`] has it.
fn key<K: Resource>(o: &K) -> String {
    format!(
        "{}/{}",
        o.namespace().unwrap_or_else(|| "default".into()),
        o.name_any()
    )
}
