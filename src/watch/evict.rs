//! Eviction of Pods stuck in the kubelet's pull back-off after a late
//! re-mirror (`recovery.evict`; docs/operations.md "Recovery timeline").
//!
//! When a recovery mirrored an image again (or found back an image an
//! earlier attempt found missing), the kubelet retries a Pod that
//! failed to pull it only when its back-off ends (doubling up to 5 min).
//! The leader then evicts, through the Eviction API (so PodDisruptionBudgets
//! hold), each Pod that still waits on that image, whose first pull failure
//! the watcher saw more than `after` ago, and that has a controller to
//! replace it at once (admission rewrites the replacement). Right before
//! each eviction it reads the Pod again from the API and HEADs the image at
//! the target by digest, as the kubelet pulls it. Evictions are spread to at most `perMinute` in any minute;
//! the rest wait in a bounded queue, one entry per Pod.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::Api;
use kube::api::PostParams;
use kube::runtime::events::{Event, EventType, Recorder};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::index::PodIndex;
use super::namespaces::Namespaces;
use super::pods::{controller, has_controller, ignores_disruption, same_pinned, waits_on};
use crate::logsafe::event_note;
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::reference::Reference;

/// Event reason on a Pod pinswap evicted.
pub const EVICTED: &str = "EvictedAfterRemirror";

/// Pods waiting for their eviction at most; more are dropped (and
/// counted): a large outage must not grow the leader's memory.
pub const MAX_QUEUED: usize = 1024;

/// Attempts per Pod while a PodDisruptionBudget refuses (429) or the API
/// fails, the first retry after [`RETRY_FIRST`], doubling (5 s to 80 s:
/// about 2.5 minutes in all).
pub const MAX_ATTEMPTS: u32 = 5;
/// The wait before the first retry.
pub const RETRY_FIRST: Duration = Duration::from_secs(5);

/// The window `perMinute` counts in.
const WINDOW: Duration = Duration::from_secs(60);

/// A client for evictions from `config`, without kube's default retry of
/// 429s (up to 15 times, honouring `Retry-After`): a budget's refusal must
/// reach the evictor, which retries it on its own bound and counts it.
pub fn client_without_retry(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    config.default_retry = false;
    kube::Client::try_from(config)
}

/// What an eviction attempt came to (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Evicted,
    /// A PodDisruptionBudget refused it (429); retried within the bound.
    Budget,
    /// The Pod was deleted or replaced (another UID) meanwhile.
    Gone,
    /// The Pod no longer waits on the image.
    Recovered,
    /// The target does not serve the image (or could not say).
    NotServed,
    /// The Pod lost its controller or left the webhook's scope meanwhile,
    /// or its Job would count the eviction as a failure.
    Skipped,
    /// The API failed otherwise; retried within the bound.
    Failed,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::Budget => "budget",
            Self::Gone => "gone",
            Self::Recovered => "recovered",
            Self::NotServed => "not_served",
            Self::Skipped => "skipped",
            Self::Failed => "failed",
        }
    }
}

/// One Pod waiting for its eviction.
struct Item {
    uid: Option<String>,
    image: Reference,
    /// Not before.
    due: Instant,
    /// Requests sent so far.
    attempts: u32,
}

#[derive(Default)]
struct Queue {
    /// By Pod `namespace/name`.
    items: HashMap<String, Item>,
    /// When the eviction requests of the last [`WINDOW`] were sent.
    sent: VecDeque<Instant>,
}

/// The leader's evictions.
pub struct Evictor {
    client: kube::Client,
    mirror: Arc<Mirror>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    pods: Arc<Mutex<PodIndex>>,
    after: Duration,
    per_minute: usize,
    /// `recovery.namespaces`; every namespace when empty.
    namespaces: Vec<String>,
    /// The webhook's scope.
    in_scope: Arc<Namespaces>,
    queue: Mutex<Queue>,
    wake: Notify,
    worker: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Evictor {
    /// An evictor for `config` over the watcher's index `pods`, within the
    /// webhook's scope as `in_scope` says.
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        mirror: Arc<Mirror>,
        pods: Arc<Mutex<PodIndex>>,
        config: &crate::config::Recovery,
        in_scope: Arc<Namespaces>,
    ) -> Arc<Self> {
        Arc::new(Self {
            client,
            metrics: mirror.metrics().clone(),
            mirror,
            recorder,
            pods,
            after: config.evict.after,
            per_minute: config.evict.per_minute.max(1) as usize,
            namespaces: config.namespaces.clone(),
            in_scope,
            queue: Mutex::default(),
            wake: Notify::new(),
            worker: Mutex::default(),
        })
    }

    /// `image` (a target `repository@digest`) was mirrored again: queues
    /// the Pods with a controller that the watcher sees failing on it, each
    /// due `after` past its first failure.
    pub fn remirrored(self: &Arc<Self>, image: &Reference) {
        // Only an image pinned by digest: for a tag, the HEAD before an
        // eviction could not tell the content the Pods failed on.
        if image.digest().is_none() {
            return;
        }
        let stuck = self
            .pods
            .lock()
            .expect("pods lock")
            .stuck(|i| same_pinned(i, image), MAX_QUEUED);
        if stuck.is_empty() {
            return;
        }
        let mut added = 0;
        {
            let mut q = self.queue.lock().expect("queue lock");
            for (pod, img, since) in stuck {
                if !self.in_scope(pod.namespace()) {
                    continue;
                }
                let key = pod.key();
                if q.items.contains_key(&key) {
                    continue;
                }
                if q.items.len() >= MAX_QUEUED {
                    Metrics::outcome(&self.metrics.evictions, "dropped");
                    continue;
                }
                q.items.insert(
                    key,
                    Item {
                        uid: pod.object.uid.clone(),
                        image: img.image,
                        due: since + self.after,
                        attempts: 0,
                    },
                );
                added += 1;
            }
        }
        if added > 0 {
            info!(%image, pods = added, "queued Pods still in pull back-off for eviction");
            self.ensure_worker();
            self.wake.notify_one();
        }
    }

    /// Forgets the queue and stops the worker (leadership lost).
    pub fn clear(&self) {
        if let Some(w) = self.worker.lock().expect("worker lock").take() {
            w.abort();
        }
        self.queue.lock().expect("queue lock").items.clear();
    }

    /// Pods waiting for their eviction.
    pub fn queued(&self) -> usize {
        self.queue.lock().expect("queue lock").items.len()
    }

    fn in_scope(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
    }

    fn ensure_worker(self: &Arc<Self>) {
        let mut w = self.worker.lock().expect("worker lock");
        if w.as_ref().is_none_or(|h| h.is_finished()) {
            let this = self.clone();
            *w = Some(tokio::spawn(async move { this.work().await }));
        }
    }

    /// Takes due Pods one at a time, at most `perMinute` requests a minute.
    async fn work(self: Arc<Self>) {
        loop {
            let wake = self.wake.notified();
            let now = Instant::now();
            let next = {
                let mut q = self.queue.lock().expect("queue lock");
                while q.sent.front().is_some_and(|t| now >= *t + WINDOW) {
                    q.sent.pop_front();
                }
                let rate_free = if q.sent.len() < self.per_minute {
                    now
                } else {
                    q.sent[0] + WINDOW
                };
                let first = q
                    .items
                    .iter()
                    .min_by_key(|(_, i)| i.due)
                    .map(|(k, i)| (k.clone(), i.due));
                match first {
                    None => Err(None),
                    Some((key, due)) => {
                        let at = due.max(rate_free);
                        if at <= now {
                            let item = q.items.remove(&key).expect("queued");
                            Ok((key, item))
                        } else {
                            Err(Some(at))
                        }
                    }
                }
            };
            match next {
                Ok((key, item)) => self.attempt(key, item).await,
                Err(Some(at)) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = wake => {}
                    }
                }
                Err(None) => wake.await,
            }
        }
    }

    /// Checks `key` once more and evicts it; requeues it when its time has
    /// not come or a budget refused.
    async fn attempt(&self, key: String, mut item: Item) {
        let now = Instant::now();
        let since =
            self.pods
                .lock()
                .expect("pods lock")
                .failing_since(&key, item.uid.as_deref(), |i| same_pinned(i, &item.image));
        // It failed again since it was queued (a pull that worked, then
        // another loss): its own `after` counts from then.
        if let Some(since) = since
            && since + self.after > now
        {
            item.due = since + self.after;
            self.requeue(key, item);
            return;
        }
        let (ns, name) = key.split_once('/').unwrap_or(("default", key.as_str()));
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        // Counted before the checks too: a GET that fails is retried
        // within the same bound.
        item.attempts += 1;
        let outcome = match self.check(&api, name, &item, since.is_some()).await {
            Err(o) => o,
            Ok(pod) => {
                {
                    let mut q = self.queue.lock().expect("queue lock");
                    q.sent.push_back(Instant::now());
                }
                let o = self.evict(&api, ns, name, &item).await;
                if o == Outcome::Evicted {
                    self.record(&pod, &item, since.map(|s| now.saturating_duration_since(s)));
                }
                o
            }
        };
        Metrics::outcome(&self.metrics.evictions, outcome.as_str());
        match outcome {
            Outcome::Budget | Outcome::Failed if item.attempts < MAX_ATTEMPTS => {
                let wait = RETRY_FIRST.saturating_mul(1 << (item.attempts - 1).min(16));
                info!(pod = %key, outcome = outcome.as_str(), retry_in = ?wait, "eviction refused; retrying");
                item.due = Instant::now() + wait;
                self.requeue(key, item);
            }
            Outcome::Budget | Outcome::Failed => {
                warn!(pod = %key, image = %item.image, attempts = item.attempts, outcome = outcome.as_str(), "gave up evicting a Pod in pull back-off; the kubelet's own retry will pull the image");
            }
            Outcome::Evicted => {}
            other => {
                info!(pod = %key, image = %item.image, outcome = other.as_str(), "not evicting");
            }
        }
    }

    fn requeue(&self, key: String, item: Item) {
        let mut q = self.queue.lock().expect("queue lock");
        q.items.entry(key).or_insert(item);
        drop(q);
        self.wake.notify_one();
    }

    /// The Pod as the API has it now, when every condition for evicting it
    /// holds; else why not.
    async fn check(
        &self,
        api: &Api<Pod>,
        name: &str,
        item: &Item,
        failing: bool,
    ) -> Result<Pod, Outcome> {
        let pod = match api.get_opt(name).await {
            Ok(Some(p)) => p,
            Ok(None) => return Err(Outcome::Gone),
            Err(e) => {
                warn!(pod = name, error = %e, "could not read a Pod before evicting it");
                return Err(Outcome::Failed);
            }
        };
        if pod.metadata.uid != item.uid || pod.metadata.deletion_timestamp.is_some() {
            return Err(Outcome::Gone);
        }
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        if !has_controller(&pod)
            || !self
                .in_scope
                .admits_object(ns, pod.metadata.labels.as_ref())
        {
            return Err(Outcome::Skipped);
        }
        if !failing || !waits_on(&pod, &item.image) {
            return Err(Outcome::Recovered);
        }
        self.job_allows(&pod).await?;
        match self.mirror.target_serves(&item.image).await {
            Ok(true) => Ok(pod),
            Ok(false) => Err(Outcome::NotServed),
            Err(e) => {
                warn!(image = %item.image, error = %e, "could not HEAD the image at the target before evicting");
                Err(Outcome::NotServed)
            }
        }
    }

    /// When a Job controls `pod`: whether the Job lets it be evicted
    /// without counting it as a failure ([`ignores_disruption`]). Its
    /// `backoffLimit` may be 0, or used up: the eviction would fail the Job
    /// where the kubelet's next retry pulls the image.
    async fn job_allows(&self, pod: &Pod) -> Result<(), Outcome> {
        let Some(owner) =
            controller(pod).filter(|o| o.api_version == "batch/v1" && o.kind == "Job")
        else {
            return Ok(());
        };
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), ns);
        let why = match jobs.get_opt(&owner.name).await {
            Ok(Some(job)) if job.metadata.uid.as_deref() == Some(owner.uid.as_str()) => {
                if ignores_disruption(&job) {
                    return Ok(());
                }
                "its Job's podFailurePolicy does not ignore DisruptionTarget before any rule that counts or fails a Pod, so the Job would count the eviction as a failure"
            }
            Ok(_) => "its Job is gone",
            Err(e) => {
                warn!(job = %format!("{ns}/{}", owner.name), error = %e, "could not read a Pod's Job before evicting it");
                return Err(Outcome::Failed);
            }
        };
        info!(pod = ?pod.metadata.name, job = %format!("{ns}/{}", owner.name), why, "not evicting");
        Err(Outcome::Skipped)
    }

    /// POSTs a policy/v1 Eviction for exactly this Pod (its UID as a
    /// precondition: a Pod recreated under the same name is not touched).
    async fn evict(&self, api: &Api<Pod>, ns: &str, name: &str, item: &Item) -> Outcome {
        let eviction = Eviction {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(ns.to_owned()),
                ..Default::default()
            },
            delete_options: Some(DeleteOptions {
                preconditions: Some(Preconditions {
                    uid: item.uid.clone(),
                    resource_version: None,
                }),
                ..Default::default()
            }),
        };
        let res: Result<serde_json::Value, kube::Error> = api
            .create_subresource("eviction", name, &PostParams::default(), &eviction)
            .await;
        match res {
            Ok(_) => Outcome::Evicted,
            Err(kube::Error::Api(s)) if s.code == 429 => Outcome::Budget,
            // 409: the UID precondition failed (another Pod by that name).
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Outcome::Gone,
            Err(e) => {
                warn!(pod = name, error = %e, "eviction failed");
                Outcome::Failed
            }
        }
    }

    fn record(&self, pod: &Pod, item: &Item, waited: Option<Duration>) {
        let waited = waited.map(|d| Duration::from_secs(d.as_secs()));
        let waited = waited
            .map(|d| humantime::format_duration(d).to_string())
            .unwrap_or_default();
        let key = format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or("default"),
            pod.metadata.name.as_deref().unwrap_or_default()
        );
        info!(pod = %key, image = %item.image, failing_for = %waited, "evicted a Pod still in pull back-off after its image was mirrored again");
        let ev = Event {
            type_: EventType::Normal,
            reason: EVICTED.into(),
            note: Some(event_note(format!(
                "pinswap evicted this Pod: it was still failing to pull {} ({waited} since the first failure) after pinswap mirrored that image again; its controller replaces it",
                item.image
            ))),
            action: "Evict".into(),
            secondary: None,
        };
        let object = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: pod.metadata.namespace.clone(),
            name: pod.metadata.name.clone(),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        };
        let rec = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(e) = rec.publish(&ev, &object).await {
                warn!(pod = ?object.name, error = %e, "could not record an Event");
            }
        });
    }
}
