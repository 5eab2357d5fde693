//! Background work (docs/architecture.md §3 "Background"): the Pod watcher that turns
//! pull failures into re-mirrors, the re-verifier, and the Lease that elects
//! the one replica running the watcher.
//!
//! - [`leader`]: client-go-style election on a `coordination.k8s.io` Lease.
//! - [`pods`]: what a Pod tells the watcher.
//! - [`index`]: the leader's compact Pod index.
//! - [`nodes`]: the nodes' platforms against the `platforms` filter.
//! - [`recovery`]: invalidate, HEAD, re-mirror, Event; deduplicated and
//!   retried per image.
//! - [`reverify`]: periodic HEADs of cached target manifests.
//!
//! The watcher is kube-runtime's `watcher` (list, then watch from the list's
//! resourceVersion, with bookmarks; on 410 Gone it lists again), restarted
//! with backoff on API errors. Each (re-)list delivers every Pod, so a Pod
//! that was failing while the watch was down, or before this replica became
//! leader, is still seen.

pub mod index;
pub mod leader;
pub mod nodes;
pub mod pods;
pub mod recovery;
pub mod reverify;

use std::collections::HashMap;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::mirror::Mirror;
use recovery::Recovery;

/// The running background work; [`Background::stop`] ends it.
pub struct Background {
    token: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
    leader: watch::Receiver<bool>,
    recovery: Option<Arc<Recovery>>,
}

impl Background {
    /// Starts the background work for `config`:
    /// - with a Kubernetes `client` and `recovery.enabled`: the Lease
    ///   election, and the Pod watcher while this replica leads;
    /// - with `cache.reverify` above zero: the re-verifier (every replica;
    ///   only the leader mirrors again);
    /// - with `identity.scanRate` above zero: one scan of the target that
    ///   rebuilds the identity record.
    ///
    /// Everything stops when `token` is cancelled; a leader then releases
    /// its Lease.
    pub fn start(
        mirror: Arc<Mirror>,
        config: &Config,
        client: Option<kube::Client>,
        token: CancellationToken,
    ) -> Self {
        let mut tasks = tokio::task::JoinSet::new();
        let r = &config.recovery;
        let client = client.filter(|_| r.enabled);
        let policy = crate::admission::policy::Policy::new(config, mirror.target().clone());
        let recovery = client.as_ref().zip(policy.ok()).map(|(c, policy)| {
            Arc::new(Recovery::new(
                mirror.clone(),
                policy,
                Some(c.clone()),
                config.source.image_pull_secrets,
                r.retry_initial,
                r.retry_max,
            ))
        });
        let leader = match &client {
            Some(c) => {
                let namespace = match r.lease.namespace.as_str() {
                    "" => c.default_namespace().to_owned(),
                    ns => ns.to_owned(),
                };
                let opts = leader::LeaseOptions {
                    name: r.lease.name.clone(),
                    namespace,
                    identity: leader::identity(),
                    duration: r.lease.duration,
                    renew_deadline: r.lease.renew_deadline,
                    retry_period: r.lease.retry_period,
                };
                info!(lease = %format!("{}/{}", opts.namespace, opts.name), identity = %opts.identity, "joining the leader election");
                let (rx, task) = leader::run(c.clone(), opts, token.clone().cancelled_owned());
                tasks.spawn(async move {
                    let _ = task.await;
                });
                rx
            }
            None => watch::channel(false).1,
        };
        if let (Some(c), Some(rec)) = (&client, &recovery) {
            let scope = Scope {
                target: mirror.target().clone(),
                namespaces: r.namespaces.clone(),
                platforms: match &config.platforms {
                    crate::config::Platforms::Only(p) => Some(p.clone()),
                    crate::config::Platforms::All => None,
                },
            };
            let (c, rec, l, t) = (c.clone(), rec.clone(), leader.clone(), token.clone());
            let metrics = mirror.metrics().clone();
            tasks.spawn(async move {
                lead_and_watch(c, rec, scope, l, t, metrics).await;
            });
        }
        if config.retention.enabled && recovery.is_none() {
            warn!(
                "retention.enabled, but there is no Kubernetes API client: retention does not run (it needs the leader's Pod watch)"
            );
        }
        if let (Some(c), Some(rec)) = (&client, &recovery)
            && config.retention.enabled
        {
            tasks.spawn(retention(
                &mirror,
                config,
                c,
                rec.clone(),
                leader.clone(),
                token.clone(),
            ));
        }
        if config.identity.scan_rate > 0 {
            let (m, t, rate) = (mirror.clone(), token.clone(), config.identity.scan_rate);
            tasks.spawn(async move {
                tokio::select! {
                    r = m.rebuild_identity(rate) => if let Err(e) = r {
                        warn!(error = %e, "could not rebuild the identity record from the target; collisions with images mirrored before this start are found only once met again");
                    },
                    _ = t.cancelled() => {}
                }
            });
        }
        if !config.cache.reverify.is_zero() {
            let (m, rec, l, t) = (
                mirror.clone(),
                recovery.clone(),
                leader.clone(),
                token.clone(),
            );
            let interval = config.cache.reverify;
            tasks.spawn(async move {
                tokio::select! {
                    _ = reverify::run(m, interval, rec, l) => {}
                    _ = t.cancelled() => {}
                }
            });
        }
        Self {
            token,
            tasks,
            leader,
            recovery,
        }
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// The recovery service, when the watcher runs.
    pub fn recovery(&self) -> Option<&Arc<Recovery>> {
        self.recovery.as_ref()
    }

    /// Stops everything and waits for it (a leader releases its Lease).
    pub async fn stop(mut self) {
        self.token.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// The leader's retention passes, with what the Pod index knows is in use.
fn retention(
    mirror: &Arc<Mirror>,
    config: &Config,
    client: &kube::Client,
    recovery: Arc<Recovery>,
    leader: watch::Receiver<bool>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let policy = crate::admission::policy::Policy::new(config, mirror.target().clone());
    let store = crate::retention::Store::new(client.clone(), client.default_namespace());
    let r = &config.retention;
    let service = policy.map(|p| {
        Arc::new(crate::retention::Retention::new(
            mirror.clone(),
            p,
            store,
            r,
        ))
    });
    // For now the Pod index alone: its Pods' target images and their
    // sources, synced once the Pod watch has listed. Workload templates
    // join here when their watches exist.
    let in_use: crate::retention::InUseSource = Arc::new(move || crate::retention::InUse {
        synced: recovery.pods_synced(),
        images: recovery.images_in_use(),
    });
    let interval = r.interval;
    async move {
        let Ok(service) = service else { return };
        tokio::select! {
            _ = crate::retention::run(service, in_use, interval, leader) => {}
            _ = token.cancelled() => {}
        }
    }
}

/// What the leader watches.
struct Scope {
    target: crate::reference::MirrorTarget,
    /// Pods' namespaces; every namespace when empty.
    namespaces: Vec<String>,
    /// The `platforms` filter, when set: nodes are watched against it.
    platforms: Option<Vec<crate::registry::manifest::PlatformSpec>>,
}

/// Waits to lead, watches Pods (and nodes, with a `platforms` filter) while
/// leading, and stops within one Lease retry period of losing the lead.
async fn lead_and_watch(
    client: kube::Client,
    recovery: Arc<Recovery>,
    scope: Scope,
    mut leader: watch::Receiver<bool>,
    token: CancellationToken,
    metrics: Arc<crate::metrics::Metrics>,
) {
    loop {
        while !*leader.borrow_and_update() {
            tokio::select! {
                r = leader.changed() => if r.is_err() { return },
                _ = token.cancelled() => return,
            }
        }
        metrics.leader.set(1);
        info!("leading: watching Pods for pull failures");
        let lost = async {
            while *leader.borrow_and_update() {
                if leader.changed().await.is_err() {
                    return;
                }
            }
        };
        let nodes = async {
            match &scope.platforms {
                Some(p) => nodes::watch(client.clone(), p.clone(), metrics.clone()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = watch_pods(&client, &recovery, &scope.target, &scope.namespaces) => {}
            _ = nodes => {}
            _ = lost => info!("not leading: Pod watcher stopped"),
            _ = token.cancelled() => {}
        }
        metrics.leader.set(0);
        // The nodes are the leader's to report; the alert takes the max.
        metrics.nodes_without_platform.set(0);
        recovery.clear();
        if token.is_cancelled() {
            return;
        }
    }
}

/// Feeds every Pod event to `recovery`. Runs until dropped.
async fn watch_pods(
    client: &kube::Client,
    recovery: &Arc<Recovery>,
    target: &crate::reference::MirrorTarget,
    namespaces: &[String],
) {
    let apis: Vec<(Option<String>, Api<Pod>)> = if namespaces.is_empty() {
        vec![(None, Api::all(client.clone()))]
    } else {
        namespaces
            .iter()
            .map(|n| (Some(n.clone()), Api::namespaced(client.clone(), n)))
            .collect()
    };
    let streams = apis.into_iter().map(|(scope, api)| {
        watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .map_ok(move |ev| (scope.clone(), ev))
            .boxed()
    });
    let scopes = streams.len();
    let mut events = futures::stream::select_all(streams);
    // The list generation in progress per scope.
    let mut listing: HashMap<Option<String>, u32> = HashMap::new();
    // Scopes that have listed once, for `Recovery::pods_synced`.
    let mut listed: std::collections::HashSet<Option<String>> = Default::default();
    while let Some(ev) = events.next().await {
        match ev {
            Ok((scope, Event::Init)) => {
                recovery.set_pods_synced(false);
                listing.insert(scope, recovery.list_started());
            }
            Ok((scope, Event::InitApply(pod))) => {
                let generation = listing.get(&scope).copied();
                recovery.pod_seen(pods::target_images(&pod, target), generation);
            }
            Ok((scope, Event::InitDone)) => {
                // Pods deleted while the watch was down are not in the new
                // list: forget them.
                if let Some(generation) = listing.remove(&scope) {
                    recovery.list_done(scope.as_deref(), generation);
                }
                listed.insert(scope);
                recovery.set_pods_synced(listing.is_empty() && listed.len() == scopes);
            }
            Ok((_, Event::Apply(pod))) => {
                recovery.pod_seen(pods::target_images(&pod, target), None);
            }
            Ok((_, Event::Delete(pod))) => {
                recovery.pod_deleted(&pods::target_images(&pod, target).key());
            }
            Err(e) => warn!(error = %e, "Pod watch failed; retrying with backoff"),
        }
    }
}
