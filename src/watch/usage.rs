//! What the cluster's Pods and workload templates name now, as the leader's
//! watches see them: every image reference (for retention), and the images
//! admission would mirror with who names them (for the backfill).
//!
//! Only objects the webhook would be sent want images ([`Namespaces`]): the
//! backfill reads no pull secret and copies nothing for a namespace or
//! object outside its scope. Every object's references still count as in
//! use: a Pod rewritten before its namespace opted out pulls from the
//! target, and recovery, keeping to the scope too, would never bring back
//! an image retention removed under it. Retention only ever keeps more for
//! that, and reads nothing of those objects but their image names.
//!
//! Bounded: references are shared among objects and counted, so an object
//! costs its key and a few pointers. At most [`MAX_IMAGES`] distinct
//! references are kept; past that, an object's further references are left
//! out, counted in `pinswap_usage_images_dropped_total`, and [`Usage::synced`]
//! says false while an object recorded without some of its references
//! remains, so nothing deletes on a partial view. Once there is room again,
//! the record asks its watches to list again ([`Usage::relists`]), which
//! brings those objects back whole.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};
use tracing::{info, warn};

use super::index::{Interner, PullRefs, pull_clone};
use super::namespaces::Namespaces;
use crate::admission::notes::{ORIGINAL_IMAGES, SOURCES};
use crate::admission::pod::slots_for;
use crate::admission::policy::Policy;
use crate::config::ImageFields;
use crate::metrics::Metrics;
use crate::reference::Reference;

/// Distinct image references kept at most.
pub const MAX_IMAGES: usize = 100_000;

/// References read from one custom resource at most. A Pod's images are
/// bounded at admission (`server.maxImages`); nothing bounds a custom
/// resource's but the API server's object size (about 1.5 MiB, so tens of
/// thousands), and each is decided on every change of the object.
pub const MAX_IMAGES_PER_OBJECT: usize = 1_000;

/// The kinds whose objects name images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` Pods.
    Pod,
    /// `apps/v1` Deployments.
    Deployment,
    /// `apps/v1` StatefulSets.
    StatefulSet,
    /// `apps/v1` DaemonSets.
    DaemonSet,
    /// `apps/v1` ReplicaSets.
    ReplicaSet,
    /// `batch/v1` Jobs.
    Job,
    /// `batch/v1` CronJobs.
    CronJob,
    /// A custom resource's kind, `group/Kind` ([`Kind::custom`]).
    Custom(&'static str),
}

impl Kind {
    /// The workload kinds (all but Pods).
    pub const WORKLOADS: [Kind; 6] = [
        Kind::Deployment,
        Kind::StatefulSet,
        Kind::DaemonSet,
        Kind::ReplicaSet,
        Kind::Job,
        Kind::CronJob,
    ];

    /// The kind's name, as in `kind:`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Deployment => "Deployment",
            Kind::StatefulSet => "StatefulSet",
            Kind::DaemonSet => "DaemonSet",
            Kind::ReplicaSet => "ReplicaSet",
            Kind::Job => "Job",
            Kind::CronJob => "CronJob",
            Kind::Custom(name) => name,
        }
    }

    /// The kind of custom resource `name` (`group/Kind`). Names are
    /// interned for the process's life: they come from the config, one per
    /// kind it turns on, so the set stays as small as the config.
    pub fn custom(name: &str) -> Kind {
        static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
        let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = names.iter().find(|n| **n == name) {
            return Kind::Custom(n);
        }
        let n: &'static str = Box::leak(name.to_owned().into_boxed_str());
        names.push(n);
        Kind::Custom(n)
    }
}

/// What one object names: read once from it, then the object is dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// Its kind.
    pub kind: Kind,
    /// `namespace/name`.
    pub key: String,
    /// `{"spec": {"imagePullSecrets", "serviceAccountName"}}` of the Pod or
    /// template, for [`crate::registry::pullsecrets::PullSecrets::for_pod`].
    pub pull: Value,
    /// Every image it names: container images as written, and the
    /// `pinswap.dev/original-images` entries of a rewritten Pod.
    pub images: Vec<Reference>,
    /// Those admission would mirror (the policy passes them: allowlisted,
    /// not under the target, no filter matches).
    pub wanted: Vec<Reference>,
    /// It names more than [`MAX_IMAGES_PER_OBJECT`] references: those past
    /// it were left out, and the record says unsynced while it remains.
    pub oversized: bool,
    /// `prewarm.podSelector` selects its labels (true without one).
    pub selected: bool,
}

impl Observed {
    /// Its namespace.
    pub fn namespace(&self) -> &str {
        self.key.split_once('/').map_or("default", |(ns, _)| ns)
    }
}

/// Reads a Pod. `policy` decides which images admission would mirror;
/// without it none are wanted.
pub fn observe_pod(pod: &Pod, policy: Option<&Policy>) -> Observed {
    let meta = &pod.metadata;
    let spec = serde_json::to_value(&pod.spec).unwrap_or(Value::Null);
    let mut extra: Vec<Reference> = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_IMAGES))
        .and_then(|v| serde_json::from_str::<HashMap<String, String>>(v).ok())
        .into_iter()
        .flatten()
        .filter_map(|(_, i)| Reference::parse(&i).ok())
        .collect();
    extra.sort_by_key(|r| r.to_string());
    let obj = || serde_json::to_value(pod).unwrap_or(Value::Null);
    observe(Kind::Pod, meta, &spec, obj, extra, policy)
}

/// Reads the Pod template of a workload (`meta` is the workload's).
/// Filters see a Pod made from the template, as at admission.
pub fn observe_template(
    kind: Kind,
    meta: &ObjectMeta,
    template: &PodTemplateSpec,
    policy: Option<&Policy>,
) -> Observed {
    let spec = serde_json::to_value(&template.spec).unwrap_or(Value::Null);
    let obj = || {
        let mut m = serde_json::to_value(&template.metadata).unwrap_or(json!({}));
        if let (Some(o), Some(ns)) = (m.as_object_mut(), &meta.namespace) {
            o.insert("namespace".into(), json!(ns));
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": m, "spec": spec})
    };
    observe(kind, meta, &spec, obj, Vec::new(), policy)
}

/// Reads a custom resource (`obj`, its `meta`) through `fields`: its
/// images stand as a Pod's containers, with the pull settings `fields`
/// names, so filters, the allowlist and the pull-secret proof treat them as
/// a Pod's.
pub fn observe_custom(
    kind: Kind,
    meta: &ObjectMeta,
    obj: &Value,
    fields: &ImageFields,
    policy: Option<&Policy>,
) -> Observed {
    let mut images = fields.images(obj, MAX_IMAGES_PER_OBJECT + 1);
    let oversized = images.len() > MAX_IMAGES_PER_OBJECT;
    images.truncate(MAX_IMAGES_PER_OBJECT);
    // An object `pinswap mutate` rewrote names the mirror; the sources it
    // recorded for fields the object still has are wanted too, so the
    // backfill brings back a copy the mirror lost. Only within the bound,
    // and never making the object count as oversized: the annotation is
    // the object's author's to write.
    if let Some(recorded) = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SOURCES))
        .and_then(|v| serde_json::from_str::<std::collections::BTreeMap<String, String>>(v).ok())
    {
        let now = fields.field_keys(obj);
        for (field, source) in recorded {
            if images.len() >= MAX_IMAGES_PER_OBJECT {
                break;
            }
            if now.contains(&field) && !images.contains(&source) {
                images.push(source);
            }
        }
    }
    let containers: Vec<Value> = images
        .into_iter()
        .enumerate()
        .map(|(i, image)| json!({"name": format!("image-{i}"), "image": image}))
        .collect();
    let mut spec = fields.pull(obj);
    spec["containers"] = Value::Array(containers);
    let pod = || {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": meta.name, "namespace": meta.namespace, "labels": meta.labels,
        }, "spec": spec})
    };
    let mut o = observe(kind, meta, &spec, pod, Vec::new(), policy);
    o.oversized = oversized;
    o
}

fn observe(
    kind: Kind,
    meta: &ObjectMeta,
    spec: &Value,
    obj: impl FnOnce() -> Value,
    extra: Vec<Reference>,
    policy: Option<&Policy>,
) -> Observed {
    let key = format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    );
    let filters = policy.is_some_and(Policy::has_filters);
    let slots = slots_for(spec, filters);
    let mut images: Vec<Reference> = slots
        .iter()
        .filter_map(|s| Reference::parse(&s.image).ok())
        .collect();
    let mut wanted = Vec::new();
    if let Some(policy) = policy {
        let prepared = match filters {
            true => policy.prepare(&obj()),
            false => None,
        };
        for s in &slots {
            if let Ok(r) = policy.check(prepared.as_ref(), s)
                && !wanted.contains(&r)
            {
                wanted.push(r);
            }
        }
    }
    for r in extra {
        if !images.contains(&r) {
            images.push(r);
        }
    }
    images.dedup();
    Observed {
        kind,
        key,
        pull: json!({"spec": {
            "imagePullSecrets": spec.get("imagePullSecrets"),
            "serviceAccountName": spec.get("serviceAccountName"),
        }}),
        images,
        wanted,
        oversized: false,
        selected: true,
    }
}

/// Waits until `relists` ([`Usage::relists`]) asks the watches to list
/// again; forever without it.
pub(crate) async fn relist_asked(relists: &mut Option<watch::Receiver<u64>>) {
    if let Some(rx) = relists
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// One watched object.
struct Entry {
    namespace: Arc<str>,
    pull: Arc<PullRefs>,
    images: Box<[Arc<Reference>]>,
    wanted: Box<[Arc<Reference>]>,
    /// Its namespace is in the webhook's scope: its `wanted` count.
    active: bool,
    /// The list generation that last delivered it.
    listed: u32,
    /// Some of its references were left out for [`MAX_IMAGES`].
    truncated: bool,
    /// It names more than [`MAX_IMAGES_PER_OBJECT`].
    oversized: bool,
    /// `prewarm.podSelector` selects it.
    selected: bool,
}

/// One watch: a kind in a namespace (or in all, `None`).
type WatchKey = (Kind, Option<String>);

#[derive(Default)]
struct WatchState {
    /// Its list generation in progress.
    listing: Option<u32>,
    /// A list completed since it was registered.
    listed: bool,
    /// It failed and has delivered nothing since.
    erred: bool,
    /// A list completed since the watches were last asked to list again.
    relisted: bool,
}

#[derive(Default)]
struct Inner {
    objects: HashMap<(Kind, Box<str>), Entry>,
    /// Reference → objects naming it.
    counts: HashMap<Arc<Reference>, u32>,
    /// Wanted reference → objects in the scope wanting it.
    wanted: HashMap<Arc<Reference>, u32>,
    /// Wanted references of objects new or changed since the last
    /// [`Usage::take_changed`].
    changed: HashSet<Arc<Reference>>,
    pulls: Interner<PullRefs>,
    namespaces: Interner<str>,
    watches: HashMap<WatchKey, WatchState>,
    generation: u32,
    /// Objects recorded with references left out for [`MAX_IMAGES`].
    truncated: usize,
    /// Objects naming more than [`MAX_IMAGES_PER_OBJECT`]: never whole, so
    /// not relisted for, but unsynced while they remain.
    oversized: usize,
    /// The watches were asked to list again, and not all have listed since.
    relisting: bool,
}

/// What the cluster's Pods and workload templates name now, as the leader's watches see them.
pub struct Usage {
    inner: Mutex<Inner>,
    changed: Notify,
    metrics: Arc<Metrics>,
    /// Decides which images admission would mirror; `None`: none (no
    /// backfill).
    policy: Option<Policy>,
    /// Bumped to ask the watches to list again.
    relist: watch::Sender<u64>,
    /// The webhook's scope; `None`: every object is in it.
    scope: Option<Arc<Namespaces>>,
    /// `prewarm.podSelector`; `None`: every object.
    warm: Option<kube::core::Selector>,
    /// A backfill takes the changed references ([`Usage::take_changed`]);
    /// without one they are not kept, or they would only grow.
    backfilled: bool,
}

impl Usage {
    /// An empty record; the watches register with [`Usage::watch`].
    /// `policy` decides which images are wanted (admission would mirror
    /// them); with `None`, none are.
    pub fn new(metrics: Arc<Metrics>, policy: Option<Policy>) -> Self {
        Self {
            inner: Mutex::default(),
            changed: Notify::new(),
            metrics,
            policy,
            relist: watch::channel(0).0,
            scope: None,
            warm: None,
            backfilled: true,
        }
    }

    /// Only objects in the webhook's scope, as `namespaces` says, want
    /// images.
    pub fn with_scope(mut self, namespaces: Arc<Namespaces>) -> Self {
        self.scope = Some(namespaces);
        self
    }

    /// No backfill takes the changed references: they are not kept.
    pub fn without_backfill(mut self) -> Self {
        self.backfilled = false;
        self
    }

    /// Objects `prewarm.podSelector` selects are marked so for
    /// [`Usage::warm_candidates`].
    pub fn with_warm_selector(mut self, selector: &crate::config::LabelSelector) -> Self {
        self.warm = crate::admission::scope::label_selector(selector);
        self
    }

    fn warm_selects(&self, labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
        use kube::core::SelectorExt;
        match (&self.warm, labels) {
            (None, _) => true,
            (Some(s), Some(l)) => s.matches(l),
            (Some(s), None) => s.matches(&std::collections::BTreeMap::new()),
        }
    }

    /// The policy, for an object labelled `labels`: none outside the
    /// webhook's scope, which then wants nothing.
    fn policy_for(
        &self,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Option<&Policy> {
        self.policy.as_ref().filter(|_| {
            self.scope
                .as_ref()
                .is_none_or(|s| s.scope().admits_object(labels))
        })
    }

    /// Whether objects in namespace `ns` are in the webhook's scope now.
    fn admits(&self, ns: &str) -> bool {
        self.scope.as_ref().is_none_or(|s| s.admits(ns))
    }

    /// Changes when the watches should list again: references were left out
    /// of objects still recorded, and there is room for them now.
    pub fn relists(&self) -> watch::Receiver<u64> {
        self.relist.subscribe()
    }

    /// [`observe_pod`] under this record's policy and scope.
    pub fn observe_pod(&self, pod: &Pod) -> Observed {
        let labels = pod.metadata.labels.as_ref();
        Observed {
            selected: self.warm_selects(labels),
            ..observe_pod(pod, self.policy_for(labels))
        }
    }

    /// [`observe_template`] under this record's policy and scope (the
    /// template's labels are its Pods').
    pub fn observe_template(
        &self,
        kind: Kind,
        meta: &ObjectMeta,
        template: &PodTemplateSpec,
    ) -> Observed {
        let labels = template.metadata.as_ref().and_then(|m| m.labels.as_ref());
        Observed {
            selected: self.warm_selects(labels),
            ..observe_template(kind, meta, template, self.policy_for(labels))
        }
    }

    /// [`observe_custom`] under this record's policy and scope.
    pub fn observe_custom(
        &self,
        kind: Kind,
        meta: &ObjectMeta,
        obj: &Value,
        fields: &ImageFields,
    ) -> Observed {
        Observed {
            selected: self.warm_selects(meta.labels.as_ref()),
            ..observe_custom(
                kind,
                meta,
                obj,
                fields,
                self.policy_for(meta.labels.as_ref()),
            )
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether every watch (Pods and each workload kind) has completed its initial list since this replica began leading, and none is currently re-listing after an error.
    pub fn synced(&self) -> bool {
        Self::all_synced(&self.lock())
    }

    fn all_synced(inner: &Inner) -> bool {
        inner.truncated == 0
            && inner.oversized == 0
            && inner.watches.keys().any(|(k, _)| *k == Kind::Pod)
            && inner
                .watches
                .values()
                .all(|w| w.listed && w.listing.is_none() && !w.erred)
    }

    /// [`Usage::synced`] and [`Usage::images`] under one lock, so that a
    /// [`Usage::clear`] between them (leadership lost) cannot pair "synced"
    /// with an empty list.
    pub fn snapshot(&self) -> (bool, Vec<Reference>) {
        let inner = self.lock();
        let synced = Self::all_synced(&inner);
        let images = inner.counts.keys().map(|r| (**r).clone()).collect();
        (synced, images)
    }

    /// Every image reference named now by a Pod (container image as written, and for rewritten Pods also their `pinswap.dev/original-images` entries) or a workload template, deduplicated.
    pub fn images(&self) -> Vec<Reference> {
        self.lock().counts.keys().map(|r| (**r).clone()).collect()
    }

    /// The images a warm set may hold: what objects in the webhook's
    /// scope want, counted over the objects that `namespaces` (empty:
    /// all) and `prewarm.podSelector` select, and over every DaemonSet
    /// with `daemon_sets`. DaemonSets' images first, then by use, then by
    /// name.
    ///
    /// Also whether the record is synced, read under the same lock (as
    /// [`Usage::snapshot`]).
    pub fn warm_candidates(
        &self,
        namespaces: &[String],
        daemon_sets: bool,
    ) -> (bool, Vec<crate::nodeconfig::warm::Candidate>) {
        let inner = self.lock();
        let synced = Self::all_synced(&inner);
        let mut counted: HashMap<Arc<Reference>, (u32, bool)> = HashMap::new();
        for ((kind, _), e) in &inner.objects {
            let daemon_set = daemon_sets && *kind == Kind::DaemonSet;
            let chosen = e.selected
                && (namespaces.is_empty() || namespaces.iter().any(|n| **n == *e.namespace));
            if !e.active || !(chosen || daemon_set) {
                continue;
            }
            for r in &*e.wanted {
                let c = counted.entry(r.clone()).or_insert((0, false));
                c.0 = c.0.saturating_add(1);
                c.1 |= daemon_set;
            }
        }
        drop(inner);
        let mut out: Vec<crate::nodeconfig::warm::Candidate> = counted
            .into_iter()
            .map(
                |(r, (uses, daemon_set))| crate::nodeconfig::warm::Candidate {
                    source: (*r).clone(),
                    uses,
                    daemon_set,
                },
            )
            .collect();
        out.sort_by(|a, b| {
            (b.daemon_set, b.uses)
                .cmp(&(a.daemon_set, a.uses))
                .then_with(|| a.source.to_string().cmp(&b.source.to_string()))
        });
        (synced, out)
    }

    /// Registers a watch that [`Usage::synced`] waits for.
    pub fn watch(&self, kind: Kind, namespace: Option<&str>) {
        self.lock()
            .watches
            .insert((kind, namespace.map(str::to_owned)), WatchState::default());
    }

    /// Drops every watch of `kind` and its objects: the API server said it
    /// no longer serves the kind, so none of its objects remain.
    pub fn unwatch(&self, kind: Kind) {
        let mut inner = self.lock();
        inner.watches.retain(|(k, _), _| *k != kind);
        let gone: Vec<(Kind, Box<str>)> = inner
            .objects
            .keys()
            .filter(|(k, _)| *k == kind)
            .cloned()
            .collect();
        for k in gone {
            inner.remove(&k);
        }
        self.after_removal(&mut inner);
    }

    /// Forgets everything, watches included (leadership lost).
    pub fn clear(&self) {
        *self.lock() = Inner::default();
        self.metrics.usage_images.set(0);
        self.metrics.usage_synced.set(0);
    }

    /// The watch of `kind` in `namespace` starts a (re-)list.
    pub fn list_started(&self, kind: Kind, namespace: Option<&str>) {
        let mut inner = self.lock();
        inner.generation = inner.generation.wrapping_add(1);
        let g = inner.generation;
        let w = inner
            .watches
            .entry((kind, namespace.map(str::to_owned)))
            .or_default();
        w.listing = Some(g);
        w.erred = false;
        self.metrics.usage_synced.set(0);
    }

    /// The watch's list ended: objects of its kind and namespace that it
    /// did not deliver are gone.
    pub fn list_done(&self, kind: Kind, namespace: Option<&str>) {
        let mut inner = self.lock();
        let key = (kind, namespace.map(str::to_owned));
        let Some(g) = inner.watches.get_mut(&key).and_then(|w| w.listing.take()) else {
            return;
        };
        if let Some(w) = inner.watches.get_mut(&key) {
            w.listed = true;
            w.relisted = true;
        }
        let gone: Vec<(Kind, Box<str>)> = inner
            .objects
            .iter()
            .filter(|((k, name), e)| {
                *k == kind
                    && e.listed != g
                    && namespace
                        .is_none_or(|ns| name.strip_prefix(ns).is_some_and(|r| r.starts_with('/')))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            inner.remove(&k);
        }
        if inner.watches.values().all(|w| w.relisted) {
            inner.relisting = false;
        }
        self.after_removal(&mut inner);
    }

    /// The watch failed; it counts as unsynced until it delivers again.
    pub fn watch_failed(&self, kind: Kind, namespace: Option<&str>) {
        if let Some(w) = self
            .lock()
            .watches
            .get_mut(&(kind, namespace.map(str::to_owned)))
        {
            w.erred = true;
        }
        self.metrics.usage_synced.set(0);
    }

    /// Takes in an object seen by a watch (delivered by its current list,
    /// or by the watch after it).
    pub fn seen(&self, o: Observed, namespace: Option<&str>) {
        let mut inner = self.lock();
        let wk = (o.kind, namespace.map(str::to_owned));
        let listing = match inner.watches.get_mut(&wk) {
            Some(w) => {
                w.erred = false;
                w.listing
            }
            None => None,
        };
        let key = (o.kind, Box::<str>::from(o.key.as_str()));
        let listed = match listing {
            Some(g) => g,
            None => inner.objects.get(&key).map_or(0, |e| e.listed),
        };
        let pull = PullRefs::of(&o.pull);
        // Unchanged: only the list mark moves (status updates of Pods are
        // most of a watch's events).
        if let Some(e) = inner.objects.get_mut(&key)
            && *e.pull == pull
            && e.images.iter().map(|r| &**r).eq(o.images.iter())
            && e.wanted.iter().map(|r| &**r).eq(o.wanted.iter())
            && e.oversized == o.oversized
            && e.selected == o.selected
        {
            e.listed = listed;
            return;
        }
        inner.remove(&key);
        let mut fresh = false;
        let mut truncated = false;
        let mut images = Vec::with_capacity(o.images.len());
        for r in &o.images {
            match inner.count(r, false) {
                Some(r) => images.push(r),
                None => truncated = true,
            }
        }
        // Read under the record's lock: a namespace's change of scope
        // (`Usage::rescope`) then finds this object.
        let active = self.admits(o.namespace());
        let mut wanted = Vec::with_capacity(o.wanted.len());
        for r in &o.wanted {
            if !active {
                wanted.push(inner.share(r));
                continue;
            }
            match inner.count(r, true) {
                Some(r) => {
                    if self.backfilled {
                        inner.changed.insert(r.clone());
                    }
                    fresh = true;
                    wanted.push(r)
                }
                None => truncated = true,
            }
        }
        if truncated {
            self.overflow(
                &mut inner,
                o.images.len() + o.wanted.len() - images.len() - wanted.len(),
            );
        }
        let entry = Entry {
            namespace: inner.namespaces.get(o.namespace(), |s: &str| Arc::from(s)),
            pull: inner.pulls.get(&pull, |p| Arc::new(pull_clone(p))),
            images: images.into(),
            wanted: wanted.into(),
            active,
            listed,
            truncated,
            oversized: o.oversized,
            selected: o.selected,
        };
        if o.oversized {
            inner.oversized += 1;
            warn!(
                kind = o.kind.as_str(),
                object = %o.key,
                max = MAX_IMAGES_PER_OBJECT,
                "an object names more image references than are read from one; the usage record stays unsynced (retention removes nothing) while it does"
            );
        }
        inner.objects.insert(key, entry);
        self.after_removal(&mut inner);
        drop(inner);
        if fresh {
            self.changed.notify_one();
        }
    }

    /// Forgets a deleted object.
    pub fn deleted(&self, kind: Kind, key: &str) {
        let mut inner = self.lock();
        inner.remove(&(kind, Box::from(key)));
        self.after_removal(&mut inner);
    }

    /// Namespace `ns` entered or left the webhook's scope: its objects'
    /// wanted images count, or stop counting.
    pub fn rescope(&self, ns: &str) {
        let active = self.admits(ns);
        let mut inner = self.lock();
        let keys: Vec<(Kind, Box<str>)> = inner
            .objects
            .iter()
            .filter(|(_, e)| &*e.namespace == ns && e.active != active)
            .map(|(k, _)| k.clone())
            .collect();
        let mut fresh = false;
        for k in keys {
            let Some(mut e) = inner.objects.remove(&k) else {
                continue;
            };
            e.active = active;
            if active {
                let mut kept = Vec::with_capacity(e.wanted.len());
                for r in e.wanted.iter() {
                    match inner.count(r, true) {
                        Some(r) => {
                            if self.backfilled {
                                inner.changed.insert(r.clone());
                            }
                            fresh = true;
                            kept.push(r);
                        }
                        None if !e.truncated => {
                            e.truncated = true;
                            self.overflow(&mut inner, 1);
                        }
                        None => {
                            self.metrics.usage_images_dropped.inc();
                        }
                    }
                }
                e.wanted = kept.into();
            } else {
                inner.uncount_wanted(&e.wanted);
            }
            inner.objects.insert(k, e);
        }
        self.after_removal(&mut inner);
        drop(inner);
        if fresh {
            self.changed.notify_one();
        }
    }

    /// Records an object whose `dropped` references did not fit.
    fn overflow(&self, inner: &mut Inner, dropped: usize) {
        self.metrics.usage_images_dropped.inc_by(dropped as u64);
        if inner.truncated == 0 {
            warn!(
                max = MAX_IMAGES,
                "more distinct image references than the usage record keeps; leaving the rest out (usage counts as unsynced until there is room and the watches have listed again)"
            );
        }
        inner.truncated += 1;
    }

    /// After references went: updates the gauge and, when objects lack
    /// references that now fit, asks the watches to list again (once per
    /// round of lists).
    fn after_removal(&self, inner: &mut Inner) {
        self.metrics.usage_images.set(inner.counts.len() as i64);
        self.metrics
            .usage_synced
            .set(i64::from(Self::all_synced(inner)));
        let room = inner.counts.len() < MAX_IMAGES && inner.wanted.len() < MAX_IMAGES;
        if inner.truncated == 0 {
            inner.relisting = false;
        } else if room && !inner.relisting {
            inner.relisting = true;
            for w in inner.watches.values_mut() {
                w.relisted = false;
            }
            info!(
                objects = inner.truncated,
                "the usage record has room again; listing the watches again for the references it left out"
            );
            self.relist.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Waits until an object names a wanted image anew.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await
    }

    /// The wanted images of objects new or changed since the last call.
    pub(crate) fn take_changed(&self) -> HashSet<Arc<Reference>> {
        std::mem::take(&mut self.lock().changed)
    }

    /// Every wanted image, deduplicated.
    pub(crate) fn wanted(&self) -> Vec<Arc<Reference>> {
        self.lock().wanted.keys().cloned().collect()
    }

    /// How many images are wanted.
    pub(crate) fn wanted_len(&self) -> usize {
        self.lock().wanted.len()
    }

    /// Whether `image` is wanted now.
    pub(crate) fn is_wanted(&self, image: &Reference) -> bool {
        self.lock().wanted.contains_key(image)
    }

    /// Up to `per_image` objects wanting each of `images`, as (namespace,
    /// pull fields): whose credentials may prove access to a private image.
    pub(crate) fn users(
        &self,
        images: &HashSet<Arc<Reference>>,
        per_image: usize,
    ) -> HashMap<Arc<Reference>, Vec<(String, Value)>> {
        let inner = self.lock();
        let mut out: HashMap<Arc<Reference>, Vec<(String, Value)>> = HashMap::new();
        let mut seen: HashSet<(*const str, *const PullRefs, *const Reference)> = HashSet::new();
        for e in inner.objects.values().filter(|e| e.active) {
            for r in e.wanted.iter().filter(|r| images.contains(*r)) {
                let users = out.entry(r.clone()).or_default();
                // Objects with the same namespace and pull fields prove the same.
                if users.len() < per_image
                    && seen.insert((
                        Arc::as_ptr(&e.namespace),
                        Arc::as_ptr(&e.pull),
                        Arc::as_ptr(r),
                    ))
                {
                    users.push((e.namespace.to_string(), e.pull.to_value()));
                }
            }
        }
        out
    }

    /// Objects recorded.
    pub fn objects(&self) -> usize {
        self.lock().objects.len()
    }
}

impl Inner {
    /// The shared reference for `r`, counted once more (in `wanted` too
    /// when `wanted`); `None` when it is new and [`MAX_IMAGES`] are kept.
    fn count(&mut self, r: &Reference, wanted: bool) -> Option<Arc<Reference>> {
        let (map, other) = match wanted {
            true => (&mut self.wanted, &self.counts),
            false => (&mut self.counts, &self.wanted),
        };
        if let Some(k) = map.get_key_value(r).map(|(k, _)| k.clone()) {
            *map.entry(k.clone()).or_default() += 1;
            return Some(k);
        }
        if map.len() >= MAX_IMAGES {
            return None;
        }
        // Wanted references share the allocation of the named ones.
        let k = match other.get_key_value(r) {
            Some((k, _)) => k.clone(),
            None => Arc::new(r.clone()),
        };
        map.insert(k.clone(), 1);
        Some(k)
    }

    /// The shared reference for `r`, not counted.
    fn share(&self, r: &Reference) -> Arc<Reference> {
        self.counts
            .get_key_value(r)
            .or_else(|| self.wanted.get_key_value(r))
            .map_or_else(|| Arc::new(r.clone()), |(k, _)| k.clone())
    }

    fn remove(&mut self, key: &(Kind, Box<str>)) {
        let Some(e) = self.objects.remove(key) else {
            return;
        };
        if e.truncated {
            self.truncated -= 1;
        }
        if e.oversized {
            self.oversized -= 1;
        }
        uncount(&mut self.counts, &e.images);
        if e.active {
            self.uncount_wanted(&e.wanted);
        }
    }

    fn uncount_wanted(&mut self, refs: &[Arc<Reference>]) {
        uncount(&mut self.wanted, refs);
    }
}

/// One object fewer names each of `refs`.
fn uncount(map: &mut HashMap<Arc<Reference>, u32>, refs: &[Arc<Reference>]) {
    for r in refs {
        if let Some(n) = map.get_mut(&**r) {
            *n -= 1;
            if *n == 0 {
                map.remove(&**r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::reference::MirrorTarget;

    fn policy() -> Policy {
        let config = Config::from_yaml(
            "target: {registry: mirror.example}\nsource: {registries: [{registry: docker.io}], filters: [{jmespath: \"obj.metadata.namespace == 'kube-system'\"}]}\n",
            "t.yaml",
        )
        .unwrap();
        Policy::new(&config, MirrorTarget::parse("mirror.example").unwrap()).unwrap()
    }

    fn pod(ns: &str, name: &str, images: &[&str]) -> Pod {
        let containers: Vec<Value> = images
            .iter()
            .enumerate()
            .map(|(i, im)| json!({"name": format!("c{i}"), "image": im}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "annotations": {
                ORIGINAL_IMAGES: r#"{"containers/c0":"docker.io/team/was:v0"}"#}},
            "spec": {"containers": containers, "imagePullSecrets": [{"name": "regcred"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_names_its_images_and_wants_what_admission_mirrors() {
        let p = policy();
        let o = observe_pod(
            &pod(
                "apps",
                "a",
                &[
                    "nginx:1",
                    "quay.io/x/y:2",
                    "mirror.example/docker.io/team/app:v1",
                ],
            ),
            Some(&p),
        );
        assert_eq!(o.key, "apps/a");
        let names: Vec<String> = o.images.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            names,
            [
                "docker.io/library/nginx:1",
                "quay.io/x/y:2",
                "mirror.example/docker.io/team/app:v1",
                "docker.io/team/was:v0"
            ]
        );
        let wanted: Vec<String> = o.wanted.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            wanted,
            ["docker.io/library/nginx:1"],
            "allowlist and target"
        );
        assert_eq!(o.pull["spec"]["imagePullSecrets"][0]["name"], "regcred");
        let filtered = observe_pod(&pod("kube-system", "b", &["nginx:1"]), Some(&p));
        assert!(filtered.wanted.is_empty(), "a filter matched");
    }

    #[test]
    fn an_image_volume_is_in_use_and_wanted_like_a_container_image() {
        let p = policy();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "v", "namespace": "apps"},
            "spec": {
                "containers": [{"name": "app", "image": "nginx:1"}],
                "volumes": [{"name": "model", "image": {"reference": "docker.io/o/model:v1"}}]
            }
        }))
        .unwrap();
        let o = observe_pod(&pod, Some(&p));
        let names: Vec<String> = o.images.iter().map(|r| r.to_string()).collect();
        assert_eq!(names, ["docker.io/library/nginx:1", "docker.io/o/model:v1"]);
        assert_eq!(o.wanted.len(), 2, "the backfill copies both");
    }

    #[test]
    fn a_custom_kind_counts_until_discovery_answers_and_its_objects_stand_as_pods() {
        let u = Usage::new(Arc::new(Metrics::new()), Some(policy()));
        let wf = Kind::custom("argoproj.io/Workflow");
        assert_eq!(wf, Kind::custom("argoproj.io/Workflow"), "interned once");
        assert_eq!(wf.as_str(), "argoproj.io/Workflow");
        for kind in [Kind::Pod, wf] {
            u.watch(kind, None);
        }
        u.list_started(Kind::Pod, None);
        u.list_done(Kind::Pod, None);
        assert!(
            !u.synced(),
            "a configured kind not yet discovered holds retention back"
        );
        let cr = crate::config::CustomResources {
            profiles: vec![crate::config::ResourceProfile::ArgoWorkflows],
            ..Default::default()
        };
        let fields = cr
            .fields()
            .into_iter()
            .find(|f| f.kind == "Workflow")
            .unwrap();
        let obj = json!({"metadata": {"name": "w", "namespace": "ci", "annotations": {
            "pinswap.dev/sources": "{\"spec.templates[1].script.image\":\"docker.io/x/y:1@sha256:0000000000000000000000000000000000000000000000000000000000000001\",\"spec.templates[9].script.image\":\"docker.io/x/gone:1\"}"
        }}, "spec": {
            "serviceAccountName": "runner",
            "templates": [{"container": {"image": "nginx:1"}}, {"script": {"image": "mirror.example/docker.io/x/y:1"}}]
        }});
        let meta: ObjectMeta = serde_json::from_value(obj["metadata"].clone()).unwrap();
        let o = u.observe_custom(wf, &meta, &obj, &fields);
        assert_eq!(o.key, "ci/w");
        assert_eq!(o.images.len(), 3);
        let wanted: Vec<String> = o.wanted.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            wanted,
            [
                "docker.io/library/nginx:1",
                "docker.io/x/y:1@sha256:0000000000000000000000000000000000000000000000000000000000000001"
            ],
            "the target's own image is not wanted; the source a rewrite recorded for a field the object has is"
        );
        assert_eq!(o.pull["spec"]["serviceAccountName"], "runner");
        u.list_started(wf, None);
        u.seen(o, None);
        u.list_done(wf, None);
        assert!(u.synced());
        assert_eq!(u.images().len(), 3);
        // Discovery says the kind is gone: so are its objects, and it no
        // longer holds the record back.
        u.watch(wf, None);
        assert!(!u.synced());
        u.unwatch(wf);
        assert!(u.synced());
        assert!(u.images().is_empty());
    }

    #[test]
    fn an_object_naming_too_many_images_holds_the_record_unsynced_until_it_goes() {
        let u = Usage::new(Arc::new(Metrics::new()), None);
        let kind = Kind::custom("example.com/Widget");
        for k in [Kind::Pod, kind] {
            u.watch(k, None);
            u.list_started(k, None);
            u.list_done(k, None);
        }
        let cr = crate::config::CustomResources {
            kinds: vec![crate::config::CustomKind {
                group: "example.com".into(),
                kind: "Widget".into(),
                resource: "widgets".into(),
                paths: vec!["spec.images[*]".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let fields = &cr.fields()[0];
        let images: Vec<String> = (0..=MAX_IMAGES_PER_OBJECT)
            .map(|i| format!("r.example/w/i{i}:1"))
            .collect();
        let obj =
            json!({"metadata": {"name": "big", "namespace": "a"}, "spec": {"images": images}});
        let meta: ObjectMeta = serde_json::from_value(obj["metadata"].clone()).unwrap();
        let o = u.observe_custom(kind, &meta, &obj, fields);
        assert!(o.oversized);
        assert_eq!(o.images.len(), MAX_IMAGES_PER_OBJECT);
        u.seen(o, None);
        assert!(!u.synced(), "what was left out may be in use");
        u.deleted(kind, "a/big");
        assert!(u.synced());
    }

    #[test]
    fn references_are_counted_and_shared() {
        let u = Usage::new(Arc::new(Metrics::new()), None);
        u.watch(Kind::Pod, None);
        assert!(!u.synced());
        u.list_started(Kind::Pod, None);
        let p = policy();
        for i in 0..1000 {
            u.seen(
                observe_pod(&pod("ns", &format!("p{i}"), &["nginx:1"]), Some(&p)),
                None,
            );
        }
        assert!(!u.synced(), "still listing");
        u.list_done(Kind::Pod, None);
        assert!(u.synced());
        assert_eq!(u.images().len(), 2);
        assert_eq!(u.wanted().len(), 1);
        for i in 0..999 {
            u.deleted(Kind::Pod, &format!("ns/p{i}"));
        }
        assert_eq!(u.images().len(), 2);
        u.deleted(Kind::Pod, "ns/p999");
        assert!(u.images().is_empty());
        assert!(u.wanted().is_empty());
        u.list_started(Kind::Pod, None);
        assert!(!u.synced(), "re-listing");
        u.watch(Kind::CronJob, None);
        u.list_done(Kind::Pod, None);
        assert!(!u.synced(), "the CronJob watch has not listed");
    }

    /// An object naming `n` distinct references.
    fn naming(kind: Kind, key: &str, n: usize) -> Observed {
        Observed {
            kind,
            key: key.into(),
            pull: Value::Null,
            images: (0..n)
                .map(|i| Reference::parse(&format!("r.example/{key}/i{i}:1")).unwrap())
                .collect(),
            wanted: Vec::new(),
            oversized: false,
            selected: true,
        }
    }

    #[test]
    fn warm_candidates_count_selected_objects_and_every_daemonset() {
        let r = |s: &str| Reference::parse(s).unwrap();
        let o = |kind, key: &str, wanted: &[&str], selected| Observed {
            kind,
            key: key.into(),
            pull: Value::Null,
            images: wanted.iter().map(|w| r(w)).collect(),
            wanted: wanted.iter().map(|w| r(w)).collect(),
            oversized: false,
            selected,
        };
        let u = Usage::new(Arc::new(Metrics::new()), None);
        u.seen(o(Kind::Pod, "apps/a-1", &["src.example/web:1"], true), None);
        u.seen(
            o(Kind::Deployment, "apps/a", &["src.example/web:1"], true),
            None,
        );
        u.seen(o(Kind::Pod, "apps/b-1", &["src.example/api:1"], true), None);
        // Not selected by prewarm.podSelector; another namespace.
        u.seen(
            o(Kind::Pod, "apps/c-1", &["src.example/batch:1"], false),
            None,
        );
        u.seen(
            o(Kind::Pod, "other/d-1", &["src.example/other:1"], true),
            None,
        );
        // A DaemonSet counts wherever it is and whatever its labels.
        u.seen(
            o(
                Kind::DaemonSet,
                "kube-system/log",
                &["src.example/log:1"],
                false,
            ),
            None,
        );
        let got = |namespaces: &[String], daemon_sets| -> Vec<(String, u32, bool)> {
            u.warm_candidates(namespaces, daemon_sets)
                .1
                .into_iter()
                .map(|c| (c.source.to_string(), c.uses, c.daemon_set))
                .collect()
        };
        assert_eq!(
            got(&["apps".into()], true),
            [
                ("src.example/log:1".into(), 1, true),
                ("src.example/web:1".into(), 2, false),
                ("src.example/api:1".into(), 1, false),
            ]
        );
        assert_eq!(
            got(&[], false),
            [
                ("src.example/web:1".into(), 2, false),
                ("src.example/api:1".into(), 1, false),
                ("src.example/other:1".into(), 1, false),
            ]
        );
    }

    #[test]
    fn the_record_is_synced_again_once_what_overflowed_it_is_gone() {
        let u = Usage::new(Arc::new(Metrics::new()), None);
        for kind in [Kind::Pod, Kind::Deployment] {
            u.watch(kind, None);
            u.list_started(kind, None);
        }
        // Templates of one tenant fill the record; a Pod seen after them
        // loses its reference.
        u.seen(naming(Kind::Deployment, "t/big", MAX_IMAGES), None);
        u.seen(naming(Kind::Pod, "a/web", 1), None);
        u.list_done(Kind::Deployment, None);
        u.list_done(Kind::Pod, None);
        assert!(!u.synced(), "a reference was left out");
        let relists = u.relists();
        u.deleted(Kind::Deployment, "t/big");
        assert!(!u.synced(), "a/web is still recorded without its reference");
        assert!(
            relists.has_changed().unwrap(),
            "the watches are asked to list again, now that it fits"
        );
        // The Pods' watch lists again and brings a/web back whole.
        u.list_started(Kind::Pod, None);
        u.seen(naming(Kind::Pod, "a/web", 1), None);
        u.list_done(Kind::Pod, None);
        assert!(u.synced(), "nothing recorded lacks a reference now");
        let images: Vec<String> = u.images().iter().map(|r| r.to_string()).collect();
        assert_eq!(images, ["r.example/a/web/i0:1"]);
    }

    #[test]
    fn a_list_forgets_objects_it_did_not_deliver() {
        let u = Usage::new(Arc::new(Metrics::new()), None);
        u.list_started(Kind::Pod, None);
        u.seen(observe_pod(&pod("a", "kept", &["nginx:1"]), None), None);
        u.seen(observe_pod(&pod("a", "gone", &["redis:7"]), None), None);
        u.list_done(Kind::Pod, None);
        u.list_started(Kind::Pod, None);
        u.seen(observe_pod(&pod("a", "kept", &["nginx:1"]), None), None);
        u.list_done(Kind::Pod, None);
        let mut names: Vec<String> = u.images().iter().map(|r| r.to_string()).collect();
        names.sort();
        assert_eq!(
            names,
            ["docker.io/library/nginx:1", "docker.io/team/was:v0"]
        );
    }
}
