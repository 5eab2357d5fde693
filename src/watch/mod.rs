//! Background work (docs/architecture.md §3 "Background"): the Pod watcher that turns
//! pull failures into re-mirrors, the re-verifier, and the Lease that elects
//! the one replica running the watcher.
//!
//! - [`leader`]: client-go-style election on a `coordination.k8s.io` Lease.
//! - [`lists`]: initial lists streamed where the API server offers it.
//! - [`namespaces`]: which namespaces are in the webhook's scope; the
//!   backfill, recovery and eviction keep to it.
//! - [`pods`]: what a Pod tells the watcher.
//! - [`index`]: the leader's compact Pod index.
//! - [`nodes`]: the nodes' platforms against the `platforms` filter.
//! - [`recovery`]: invalidate, HEAD, re-mirror, Event; deduplicated and
//!   retried per image.
//! - [`reverify`]: periodic HEADs of cached target manifests.
//! - [`usage`]: what the Pods and workload templates name now.
//! - [`workloads`]: the leader's watches of workload templates.
//! - [`backfill`]: mirrors what already runs and the target lacks.
//! - [`evict`]: after a re-mirror, evicting controller-owned Pods still in
//!   the kubelet's pull back-off (`recovery.evict`).
//!
//! The watcher is kube-runtime's `watcher` (list, streamed where the API
//! server offers it, then watch from the list's resourceVersion, with
//! bookmarks; on 410 Gone it lists again), restarted
//! with backoff on API errors. Each (re-)list delivers every Pod, so a Pod
//! that was failing while the watch was down, or before this replica became
//! leader, is still seen.

pub(crate) mod backfill;
pub mod evict;
pub(crate) mod index;
pub(crate) mod leader;
pub(crate) mod lists;
pub mod namespaces;
pub(crate) mod nodes;
pub(crate) mod pods;
pub mod recovery;
pub(crate) mod resources;
pub(crate) mod reverify;
pub(crate) mod usage;
pub(crate) mod workloads;

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::mirror::Mirror;
use backfill::Backfill;
use namespaces::Namespaces;
use recovery::Recovery;
use usage::Usage;

/// The running background work; [`Background::stop`] ends it.
pub struct Background {
    token: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
    leader: watch::Receiver<bool>,
    recovery: Option<Arc<Recovery>>,
    usage: Option<Arc<Usage>>,
    /// Retention as the leader would run it, for plans; with or without
    /// `retention.enabled`.
    retention: Option<Arc<crate::retention::Retention>>,
}

/// What the next retention pass would remove and keep, and why: on the
/// leader, with what its watches see in use now.
#[derive(Clone)]
pub struct Planner {
    retention: Option<Arc<crate::retention::Retention>>,
    usage: Option<Arc<Usage>>,
    leader: watch::Receiver<bool>,
}

impl Planner {
    /// [`crate::retention::Retention::plan`] with what is in use now.
    ///
    /// # Errors
    /// [`PlanError`].
    pub async fn plan(&self) -> Result<crate::retention::Report, PlanError> {
        let (Some(retention), Some(usage)) = (&self.retention, &self.usage) else {
            return Err(PlanError::NoWatches);
        };
        if !*self.leader.borrow() {
            return Err(PlanError::NotLeader);
        }
        let in_use = in_use_source(usage.clone())();
        Ok(retention.plan(&in_use).await?)
    }
}

/// Why [`Planner::plan`] has no plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Nothing here knows what is in use.
    #[error(
        "no plan here: the leader's Pod and workload watches do not run (they need recovery.enabled and a Kubernetes API client, and the backfill, retention or sharing on)"
    )]
    NoWatches,
    /// Another replica leads.
    #[error(
        "this replica does not lead: ask the replica holding the Lease (kubectl get lease -n NAMESPACE pinswap-leader -o jsonpath='{{.spec.holderIdentity}}')"
    )]
    NotLeader,
    /// The pass could not look.
    #[error(transparent)]
    Retention(#[from] crate::retention::RetentionError),
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
    ///
    /// Evictions (`recovery.evict`) go through `client` too, and so through
    /// its retry policy: kube's default retries a 429 at once, so a
    /// PodDisruptionBudget's refusal is retried out of the rate bound.
    /// `serve` passes a client without it ([`Background::start_with`]).
    pub fn start(
        mirror: Arc<Mirror>,
        config: &Config,
        client: Option<kube::Client>,
        token: CancellationToken,
    ) -> Self {
        let eviction = client.clone();
        Self::start_with(mirror, config, client, eviction, token)
    }

    /// As [`Background::start`], evicting through `eviction`: a client
    /// built without kube's default retry ([`evict::client_without_retry`]),
    /// so that the evictor sees each 429 and retries it on its own bound.
    pub fn start_with(
        mirror: Arc<Mirror>,
        config: &Config,
        client: Option<kube::Client>,
        eviction: Option<kube::Client>,
        token: CancellationToken,
    ) -> Self {
        let mut tasks = tokio::task::JoinSet::new();
        let r = &config.recovery;
        let client = client.filter(|_| r.enabled);
        // The webhook's scope, as `pinswap manifests` and the chart render
        // it for this namespace (the Downward API's, else the client's).
        let in_scope = client.as_ref().map(|c| {
            let own = std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| c.default_namespace().to_owned());
            Arc::new(Namespaces::new(crate::admission::scope::Scope::new(
                &config.scope,
                &own,
            )))
        });
        let policy = crate::admission::policy::Policy::new(config, mirror.target().clone());
        let recovery = client.as_ref().zip(policy.ok()).map(|(c, policy)| {
            Arc::new(
                Recovery::new(
                    mirror.clone(),
                    policy,
                    Some(c.clone()),
                    config.source.image_pull_secrets,
                    r.retry_initial,
                    r.retry_max,
                )
                .with_eviction(eviction.clone(), r, in_scope.clone()),
            )
        });
        // The workload watches (and so the usage record) run for the
        // backfill and retention (`Config::watches_workloads`).
        if config.backfill.enabled && !config.backfills() && client.is_some() {
            info!("copyPolicy is none: the backfill, which only copies, does not run");
        }
        let usage = client
            .as_ref()
            .filter(|_| config.watches_workloads())
            .map(|_| {
                let policy = crate::admission::policy::Policy::new(config, mirror.target().clone())
                    .ok()
                    .filter(|_| config.backfills() || config.prewarm.enabled);
                let usage = Usage::new(mirror.metrics().clone(), policy)
                    .with_warm_selector(&config.prewarm.pod_selector);
                let usage = match config.backfills() {
                    true => usage,
                    false => usage.without_backfill(),
                };
                Arc::new(match &in_scope {
                    Some(n) => usage.with_scope(n.clone()),
                    None => usage,
                })
            });
        let backfill = usage
            .as_ref()
            .zip(client.as_ref())
            .filter(|_| config.backfills())
            .map(|(u, c)| {
                Arc::new(Backfill::new(
                    mirror.clone(),
                    u.clone(),
                    Some(c.clone()).filter(|_| config.source.image_pull_secrets),
                    backfill::Settings {
                        concurrency: config.backfill.concurrency,
                        retry_initial: r.retry_initial,
                        retry_max: r.retry_max,
                    },
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
        if let (Some(c), Some(rec), Some(in_scope)) = (&client, &recovery, &in_scope) {
            let scope = Scope {
                target: mirror.target().clone(),
                namespaces: r.namespaces.clone(),
                platforms: match &config.platforms {
                    crate::config::Platforms::Only(p) => Some(p.clone()),
                    crate::config::Platforms::All => None,
                },
                resources: config.custom_resources.fields(),
                discovery_interval: config.custom_resources.discovery_interval,
            };
            let (c, rec, l, t) = (c.clone(), rec.clone(), leader.clone(), token.clone());
            let metrics = mirror.metrics().clone();
            let watched = Watched {
                usage: usage.clone(),
                backfill,
                in_scope: in_scope.clone(),
            };
            tasks.spawn(async move {
                lead_and_watch(c, rec, scope, watched, l, t, metrics).await;
            });
        }
        if config.retention.enabled && usage.is_none() {
            warn!(
                "retention.enabled, but there is no Kubernetes API client: retention does not run (it needs the leader's Pod and workload watches)"
            );
        }
        if config.sharing.enabled && usage.is_none() {
            warn!(
                "sharing.enabled, but there is no Kubernetes API client: this cluster's usage record is not published (it comes from the leader's Pod and workload watches)"
            );
        }
        let publisher = usage
            .as_ref()
            .filter(|_| config.sharing.enabled)
            .zip(config.cluster.as_deref())
            .zip(crate::admission::policy::Policy::new(config, mirror.target().clone()).ok())
            .map(|((u, cluster), policy)| {
                let p = Arc::new(crate::retention::publish::Publisher::new(
                    mirror.clone(),
                    policy,
                    cluster,
                    &config.sharing,
                ));
                let (p2, l, t) = (p.clone(), leader.clone(), token.clone());
                let in_use = in_use_source(u.clone());
                tasks.spawn(async move {
                    tokio::select! {
                        _ = crate::retention::publish::run(p2, in_use, l) => {}
                        _ = t.cancelled() => {}
                    }
                });
                p
            });
        if let Some(ecr) = mirror.ecr().cloned() {
            // ecrOptions may have changed since pinswap made its
            // repositories: the first leader after a start brings them in
            // line (and leaves every other repository alone).
            let (mut l, t) = (leader.clone(), token.clone());
            tasks.spawn(async move {
                let pass = async {
                    if l.wait_for(|l| *l).await.is_err() {
                        return;
                    }
                    match ecr.reconcile_all(ECR_RECONCILE_RATE).await {
                        Ok(n) => info!(repositories = n, not_pinswaps = ecr.stats().foreign, "ECR repositories pinswap made reconciled with ecrOptions; the others left as they are"),
                        Err(e) => warn!(error = %e, "ECR repositories could not be listed to reconcile them with ecrOptions; each is reconciled at its next push"),
                    }
                };
                tokio::select! {
                    _ = pass => {}
                    _ = t.cancelled() => {}
                }
            });
        }
        // A "*" allowlist: the node agents read the registries the leader
        // lists, instead of each listing the target.
        if let Some(c) = &client
            && config.source.registries.iter().any(|r| r.registry == "*")
        {
            let publisher = crate::nodeconfig::registries::Publisher::new(
                mirror.clone(),
                c.clone(),
                c.default_namespace(),
            );
            let (l, t) = (leader.clone(), token.clone());
            tasks.spawn(async move {
                tokio::select! {
                    _ = crate::nodeconfig::registries::run(publisher, l) => {}
                    _ = t.cancelled() => {}
                }
            });
        }
        // New nodes pull what the warm set lists (`prewarm`).
        if let (Some(c), Some(u)) = (&client, &usage)
            && config.prewarm.enabled
        {
            let publisher = crate::nodeconfig::warm::Publisher::new(
                mirror.clone(),
                c.clone(),
                c.default_namespace(),
                config.prewarm.top,
            );
            let (l, t, u) = (leader.clone(), token.clone(), u.clone());
            let (namespaces, daemon_sets) = (
                config.prewarm.namespaces.clone(),
                config.prewarm.daemon_sets,
            );
            tasks.spawn(async move {
                let candidates = move || {
                    let (synced, c) = u.warm_candidates(&namespaces, daemon_sets);
                    // Never a partial set over a whole one.
                    synced.then_some(c)
                };
                tokio::select! {
                    _ = crate::nodeconfig::warm::run(publisher, candidates, l) => {}
                    _ = t.cancelled() => {}
                }
            });
        }
        if let Some(cluster) = &config.cluster {
            mirror.metrics().sharing.cluster(cluster);
        }
        let retention = client
            .as_ref()
            .zip(usage.as_ref())
            .and_then(|(c, _)| retention_service(&mirror, config, c, publisher));
        if let (Some(service), Some(u)) = (&retention, &usage)
            && config.retention.enabled
        {
            tasks.spawn(retention_passes(
                service.clone(),
                config,
                u.clone(),
                (leader.clone(), token.clone()),
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
            let (interval, rate) = (config.cache.reverify, config.cache.reverify_rate);
            tasks.spawn(async move {
                tokio::select! {
                    _ = reverify::run(m, interval, rate, rec, l) => {}
                    _ = t.cancelled() => {}
                }
            });
        }
        Self {
            token,
            tasks,
            leader,
            recovery,
            usage,
            retention,
        }
    }

    /// Plans of the next retention pass, as the leader sees it.
    pub fn planner(&self) -> Planner {
        Planner {
            retention: self.retention.clone(),
            usage: self.usage.clone(),
            leader: self.leader.clone(),
        }
    }

    /// What the leader's Pod and workload watches see, when they run
    /// (recovery and backfill on, and a Kubernetes client); it is synced
    /// only while this replica leads.
    pub fn usage(&self) -> Option<Arc<Usage>> {
        self.usage.clone()
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

/// Retention over `mirror`'s target with the config's `retention` (and
/// `sharing`) settings, its record in the client's namespace.
fn retention_service(
    mirror: &Arc<Mirror>,
    config: &Config,
    client: &kube::Client,
    sharing: Option<Arc<crate::retention::publish::Publisher>>,
) -> Option<Arc<crate::retention::Retention>> {
    let policy = crate::admission::policy::Policy::new(config, mirror.target().clone()).ok()?;
    let store = crate::retention::Store::new(client.clone(), client.default_namespace());
    let r = crate::retention::Retention::new(mirror.clone(), policy, store, &config.retention);
    Some(Arc::new(match sharing {
        Some(s) => r.with_sharing(s),
        None => r,
    }))
}

/// The leader's retention passes, with what the usage record says is in
/// use (Pods and workload templates).
fn retention_passes(
    service: Arc<crate::retention::Retention>,
    config: &Config,
    usage: Arc<Usage>,
    (leader, token): (watch::Receiver<bool>, CancellationToken),
) -> impl Future<Output = ()> + Send + 'static {
    let in_use = in_use_source(usage);
    let interval = config.retention.interval;
    async move {
        tokio::select! {
            _ = crate::retention::run(service, in_use, interval, leader) => {}
            _ = token.cancelled() => {}
        }
    }
}

/// Repositories a second the leader reconciles with `ecrOptions` after a
/// start: each costs up to eight ECR API calls.
const ECR_RECONCILE_RATE: u32 = 5;

/// What is in use, from the leader's usage record.
fn in_use_source(usage: Arc<Usage>) -> crate::retention::InUseSource {
    Arc::new(move || {
        let (synced, images) = usage.snapshot();
        crate::retention::InUse { synced, images }
    })
}

/// What the leader watches.
struct Scope {
    target: crate::reference::MirrorTarget,
    /// Pods' namespaces; every namespace when empty.
    namespaces: Vec<String>,
    /// The `platforms` filter, when set: nodes are watched against it.
    platforms: Option<Vec<crate::platform::PlatformSpec>>,
    /// The custom resources' image fields (`customResources`).
    resources: Vec<crate::config::ImageFields>,
    /// How often discovery is asked which of them are served.
    discovery_interval: std::time::Duration,
}

/// The usage record and the backfill, when they run, and the namespaces
/// in the webhook's scope.
struct Watched {
    usage: Option<Arc<Usage>>,
    backfill: Option<Arc<Backfill>>,
    in_scope: Arc<Namespaces>,
}

/// Waits to lead, watches Pods (and nodes, with a `platforms` filter) while
/// leading, and stops within one Lease retry period of losing the lead.
async fn lead_and_watch(
    client: kube::Client,
    recovery: Arc<Recovery>,
    scope: Scope,
    watched: Watched,
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
        let usage = watched.usage.as_deref();
        let workloads = async {
            match &watched.usage {
                Some(u) => {
                    workloads::watch(client.clone(), u.clone(), scope.namespaces.clone()).await
                }
                None => std::future::pending().await,
            }
        };
        let resources = async {
            match &watched.usage {
                Some(u) => {
                    resources::watch(
                        client.clone(),
                        u.clone(),
                        scope.namespaces.clone(),
                        scope.resources.clone(),
                        scope.discovery_interval,
                    )
                    .await
                }
                None => std::future::pending().await,
            }
        };
        let backfill = async {
            match &watched.backfill {
                Some(b) => b.run().await,
                None => std::future::pending().await,
            }
        };
        let in_scope = &watched.in_scope;
        // Namespaces that entered the scope after the first list: their
        // Pods, which recovery did not keep, are read once more.
        let (entered, mut entering) = tokio::sync::mpsc::unbounded_channel::<String>();
        let namespaces = in_scope.watch(client.clone(), &scope.namespaces, |ns, admitted| {
            if let Some(u) = usage {
                u.rescope(ns);
            }
            if !admitted {
                recovery.forget_namespace(ns);
            } else if in_scope.is_listed() {
                let _ = entered.send(ns.to_owned());
            }
        });
        let rescans = async {
            while let Some(ns) = entering.recv().await {
                let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
                match api.list(&Default::default()).await {
                    Ok(list) => {
                        for pod in &list.items {
                            recovery_sees(&recovery, in_scope, pod, &scope.target, None);
                        }
                    }
                    Err(e) => {
                        warn!(namespace = %ns, error = %e, "could not list the Pods of a namespace that entered the webhook's scope; they are seen at their next change")
                    }
                }
            }
        };
        // Nothing is judged before the namespaces are known.
        let watches = async {
            in_scope.listed().await;
            tokio::select! {
                _ = watch_pods(&client, &recovery, usage, in_scope, &scope.target, &scope.namespaces) => {}
                _ = workloads => {}
                _ = resources => {}
                _ = backfill => {}
                _ = rescans => {}
            }
        };
        tokio::select! {
            _ = namespaces => {}
            _ = watches => {}
            _ = nodes => {}
            _ = lost => info!("not leading: Pod watcher stopped"),
            _ = token.cancelled() => {}
        }
        metrics.leader.set(0);
        // The nodes are the leader's to report; the alert takes the max.
        metrics.nodes_without_platform.set(0);
        recovery.clear();
        watched.in_scope.clear();
        if let Some(u) = &watched.usage {
            u.clear();
        }
        if let Some(b) = &watched.backfill {
            b.clear();
        }
        if token.is_cancelled() {
            return;
        }
    }
}

/// Feeds every Pod event to `usage`, and those of Pods in the webhook's
/// scope to `recovery` (one that leaves it is forgotten there). Runs until
/// dropped.
async fn watch_pods(
    client: &kube::Client,
    recovery: &Arc<Recovery>,
    usage: Option<&Usage>,
    in_scope: &Namespaces,
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
    if let Some(u) = usage {
        for (scope, _) in &apis {
            u.watch(usage::Kind::Pod, scope.as_deref());
        }
    }
    let mut relists = usage.map(Usage::relists);
    // The list generation in progress per scope.
    let mut listing: HashMap<Option<String>, u32> = HashMap::new();
    loop {
        let streams = apis.iter().cloned().map(|(scope, api)| {
            lists::watch(api, watcher::Config::default())
                .default_backoff()
                .map(move |ev| (scope.clone(), ev))
                .boxed()
        });
        let mut events = futures::stream::select_all(streams);
        // New watchers list first: the usage record takes in what it left out.
        while let Some(ev) = tokio::select! {
            ev = events.next() => ev,
            _ = usage::relist_asked(&mut relists) => None,
        } {
            pod_event(recovery, usage, in_scope, target, &mut listing, ev);
        }
    }
}

/// One event of [`watch_pods`]'s watchers.
fn pod_event(
    recovery: &Arc<Recovery>,
    usage: Option<&Usage>,
    in_scope: &Namespaces,
    target: &crate::reference::MirrorTarget,
    listing: &mut HashMap<Option<String>, u32>,
    (scope, ev): (Option<String>, Result<Event<Pod>, watcher::Error>),
) {
    let kind = usage::Kind::Pod;
    let ns = scope.as_deref();
    match ev {
        Ok(Event::Init) => {
            listing.insert(scope.clone(), recovery.list_started());
            if let Some(u) = usage {
                u.list_started(kind, ns);
            }
        }
        Ok(Event::InitApply(pod)) => {
            let generation = listing.get(&scope).copied();
            if let Some(u) = usage {
                u.seen(u.observe_pod(&pod), ns);
            }
            recovery_sees(recovery, in_scope, &pod, target, generation);
        }
        Ok(Event::InitDone) => {
            // Pods deleted while the watch was down are not in the new
            // list: forget them.
            if let Some(generation) = listing.remove(&scope) {
                recovery.list_done(ns, generation);
            }
            if let Some(u) = usage {
                u.list_done(kind, ns);
            }
        }
        Ok(Event::Apply(pod)) => {
            if let Some(u) = usage {
                u.seen(u.observe_pod(&pod), ns);
            }
            recovery_sees(recovery, in_scope, &pod, target, None);
        }
        Ok(Event::Delete(pod)) => {
            let key = pods::target_images(&pod, target).key();
            if let Some(u) = usage {
                u.deleted(kind, &key);
            }
            recovery.pod_deleted(&key);
        }
        Err(e) => {
            if let Some(u) = usage {
                u.watch_failed(kind, ns);
            }
            warn!(error = %e, "Pod watch failed; retrying with backoff")
        }
    }
}

/// Hands `pod` to recovery when the webhook would be sent it; else makes
/// recovery forget it: pinswap reads no pull secret, copies nothing and
/// records no Event for a Pod outside the scope.
fn recovery_sees(
    recovery: &Arc<Recovery>,
    in_scope: &Namespaces,
    pod: &Pod,
    target: &crate::reference::MirrorTarget,
    generation: Option<u32>,
) {
    let images = pods::target_images(pod, target);
    if in_scope.admits_object(images.namespace(), pod.metadata.labels.as_ref()) {
        recovery.pod_seen(images, generation);
    } else {
        recovery.pod_deleted(&images.key());
    }
}
