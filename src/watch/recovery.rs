//! Pull-failure recovery: a Pod's container reports `ErrImagePull` or
//! `ImagePullBackOff` on a target image → invalidate the existence entry,
//! HEAD the target, mirror the image again when it is missing, and record
//! an Event on the Pod (`ImageRemirrored`, or `RemirrorFailed` with the
//! cause). The kubelet's next pull retry then succeeds.
//!
//! Per image (target `repository@digest`) at most one recovery runs; Pods
//! failing on it meanwhile join it and get its Event. After a recovery,
//! further failures of that image are ignored for [`COOLDOWN`] (statuses
//! written before the kubelet's next retry), and an `ImagePullBackOff` that
//! follows its `ErrImagePull` is never a new failure: the kubelet writes it
//! at the retry, describing the failure before it. A failed recovery is retried
//! with exponential backoff (`recovery.retryInitial` doubling up to
//! `recovery.retryMax`) while a Pod known to the watcher still fails on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{info, warn};

use super::evict::Evictor;
use super::index::PodIndex;
use super::pods::{PodImages, TargetImage};
use crate::admission::policy::Policy;
use crate::cache::Cause;
use crate::logsafe::event_note;
use crate::metrics::Metrics;
use crate::mirror::{Mirror, Recovered};
use crate::reference::Reference;
use crate::registry::pullsecrets::PullSecrets;

/// How long failures of an image are ignored after a recovery of it
/// completed (the kubelet retries after 10 s at the soonest).
pub const COOLDOWN: Duration = Duration::from_secs(5);

/// Pods whose pull secrets a recovery reads at most to find one that may
/// have a private image.
const MAX_VOUCHING_PODS: usize = 8;

/// Event reason when an image was mirrored again.
pub const REMIRRORED: &str = "ImageRemirrored";
/// Event reason when mirroring it again failed.
pub const REMIRROR_FAILED: &str = "RemirrorFailed";
/// Event reason when mirroring it again waits for a source's pull quota.
pub const QUOTA_EXHAUSTED: &str = "SourceQuotaExhausted";
/// Event reason for an image-ID finding recorded at admission (Warning).
pub const IDENTITY_NOT_UNIQUE: &str = "ImageIdentityNotUnique";
/// Event reason for an image-ID repair made at admission (Normal).
pub const IDENTITY_REPAIRED: &str = "ImageIdentityRepaired";

#[derive(Default)]
struct ImageState {
    running: bool,
    /// Pods to tell about the running (or next) recovery.
    pods: Vec<ObjectReference>,
    done: Option<Instant>,
    failures: u32,
    retry_at: Option<Instant>,
    /// A failed attempt found the manifest missing at the target: a later
    /// attempt that finds it present knows it was mirrored again meanwhile.
    lost: bool,
}

/// The recovery service: the Pod index the watcher feeds, and per-image
/// recovery state.
pub struct Recovery {
    mirror: Arc<Mirror>,
    /// The admission allowlist, applied to sources named by annotations.
    policy: Policy,
    metrics: Arc<Metrics>,
    recorder: Option<Recorder>,
    pull_secrets: Option<PullSecrets>,
    retry_initial: Duration,
    retry_max: Duration,
    pods: Arc<Mutex<PodIndex>>,
    /// With `recovery.evict.enabled`: evicts Pods still in back-off after
    /// a re-mirror.
    evictor: Option<Arc<Evictor>>,
    images: Mutex<HashMap<String, ImageState>>,
    /// Recoveries and retry timers in flight.
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// Pod key → UID, for Pods whose identity annotation has had its Event.
    identity_noted: Mutex<HashMap<String, String>>,
}

impl Recovery {
    /// A recovery service. Events are recorded through `client` when given
    /// (`events.k8s.io/v1`, reporting controller `pinswap`); pull secrets
    /// are read when `pull_secrets` is on.
    pub fn new(
        mirror: Arc<Mirror>,
        policy: Policy,
        client: Option<kube::Client>,
        pull_secrets: bool,
        retry_initial: Duration,
        retry_max: Duration,
    ) -> Self {
        let recorder = client.clone().map(|c| {
            Recorder::new(
                c,
                Reporter {
                    controller: "pinswap".into(),
                    instance: std::env::var("POD_NAME").ok(),
                },
            )
        });
        let pull_secrets = client
            .filter(|_| pull_secrets)
            .map(|c| PullSecrets::new(c, mirror.metrics().clone()));
        Self {
            metrics: mirror.metrics().clone(),
            mirror,
            policy,
            recorder,
            pull_secrets,
            retry_initial,
            retry_max,
            pods: Arc::default(),
            evictor: None,
            images: Mutex::default(),
            tasks: Mutex::default(),
            identity_noted: Mutex::default(),
        }
    }

    /// With `config.evict.enabled` and a `client`: after each re-mirror,
    /// evicts the Pods still stuck on the image ([`super::evict`]), within
    /// the webhook's scope as `in_scope` says.
    pub fn with_eviction(
        mut self,
        client: Option<kube::Client>,
        config: &crate::config::Recovery,
        in_scope: Option<Arc<super::namespaces::Namespaces>>,
    ) -> Self {
        if let (true, Some(c), Some(rec), Some(scope)) =
            (config.evict.enabled, client, &self.recorder, in_scope)
        {
            self.evictor = Some(Evictor::new(
                c,
                rec.clone(),
                self.mirror.clone(),
                self.pods.clone(),
                config,
                scope,
            ));
        }
        self
    }

    /// The evictor, with `recovery.evict.enabled`.
    pub fn evictor(&self) -> Option<&Arc<Evictor>> {
        self.evictor.as_ref()
    }

    /// Takes in a Pod seen by the watcher: updates the index and starts a
    /// recovery for each target image with a pull failure not seen before
    /// ([`new_pull_failure`]). `generation` marks a Pod delivered by a list
    /// ([`Recovery::list_started`]).
    pub fn pod_seen(self: &Arc<Self>, pod: PodImages, generation: Option<u32>) {
        self.note_identity(&pod);
        let before = {
            let mut pods = self.pods.lock().expect("pods lock");
            let before = pods.insert(&pod, generation);
            self.metrics.watched_pods.set(pods.len() as i64);
            before
        };
        for img in &pod.images {
            let Some(reason) = &img.failing else { continue };
            let was = before
                .iter()
                .flatten()
                .find(|(slot, _)| **slot == *img.slot)
                .and_then(|(_, failing)| *failing);
            if !new_pull_failure(was, reason) {
                continue;
            }
            self.metrics.pull_failures.inc();
            info!(pod = %pod.key(), image = %img.image, %reason, "pull failure on a target image");
            self.trigger(img.clone(), Some(pod.clone()), Cause::PullFailure);
        }
    }

    /// Forgets the Pods of namespace `ns`, which left the webhook's scope:
    /// no recovery, Event or eviction for them.
    pub fn forget_namespace(&self, ns: &str) {
        let inside = |k: &str| k.strip_prefix(ns).is_some_and(|r| r.starts_with('/'));
        {
            let mut pods = self.pods.lock().expect("pods lock");
            pods.retain(|k| !inside(k));
            self.metrics.watched_pods.set(pods.len() as i64);
        }
        self.identity_noted
            .lock()
            .expect("noted lock")
            .retain(|k, _| !inside(k));
        self.forget_joined(|k| !inside(k));
    }

    /// Forgets a deleted Pod, also where it waits for a recovery's Event.
    pub fn pod_deleted(&self, key: &str) {
        {
            let mut pods = self.pods.lock().expect("pods lock");
            pods.remove(key);
            self.metrics.watched_pods.set(pods.len() as i64);
        }
        self.identity_noted.lock().expect("noted lock").remove(key);
        self.forget_joined(|k| k != key);
    }

    /// Keeps only the Pods `keep` accepts among those waiting for a
    /// recovery's Event: a deleted Pod gets none.
    fn forget_joined(&self, keep: impl Fn(&str) -> bool) {
        let mut images = self.images.lock().expect("images lock");
        for st in images.values_mut() {
            st.pods.retain(|o| keep(&object_key(o)));
        }
    }

    /// Records one Event per Pod for its `pinswap.dev/identity`
    /// annotation: admission could not, as a Pod has no name or UID yet
    /// while it is admitted.
    fn note_identity(self: &Arc<Self>, pod: &PodImages) {
        let (Some(uid), Some(rec)) = (&pod.object.uid, &self.recorder) else {
            return;
        };
        if pod.identity.is_empty() {
            return;
        }
        let previous = self
            .identity_noted
            .lock()
            .expect("noted lock")
            .insert(pod.key(), uid.clone());
        if previous.as_ref() == Some(uid) {
            return;
        }
        // Normal only when every flagged image was repaired.
        let repaired = pod
            .identity
            .values()
            .all(|v| v.starts_with("repaired:") && !v.contains("not repaired"));
        let note = pod
            .identity
            .iter()
            .map(|(slot, v)| format!("{slot}: {v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let ev = Event {
            type_: if repaired {
                EventType::Normal
            } else {
                EventType::Warning
            },
            reason: if repaired {
                IDENTITY_REPAIRED
            } else {
                IDENTITY_NOT_UNIQUE
            }
            .into(),
            note: Some(event_note(note)),
            action: "CheckImageIdentity".into(),
            secondary: None,
        };
        let (rec, object) = (rec.clone(), pod.object.clone());
        self.spawn(async move {
            if let Err(e) = rec.publish(&ev, &object).await {
                warn!(pod = ?object.name, error = %e, "could not record an Event");
            }
        });
    }

    /// A (re-)list of Pods starts: pass the generation returned with each
    /// Pod it delivers, then to [`Recovery::list_done`].
    pub fn list_started(&self) -> u32 {
        self.pods.lock().expect("pods lock").next_generation()
    }

    /// List `generation` of `namespace` (`None`: every namespace) ended:
    /// forgets the Pods in it that it did not deliver (deleted while the
    /// watch was down), in the index and among those waiting for a
    /// recovery's Event.
    pub fn list_done(&self, namespace: Option<&str>, generation: u32) {
        let gone: std::collections::HashSet<String> = {
            let mut pods = self.pods.lock().expect("pods lock");
            let gone = pods.retain_listed(namespace, generation);
            self.metrics.watched_pods.set(pods.len() as i64);
            gone.into_iter().collect()
        };
        if gone.is_empty() {
            return;
        }
        self.identity_noted
            .lock()
            .expect("noted lock")
            .retain(|k, _| !gone.contains(k));
        self.forget_joined(|k| !gone.contains(k));
    }

    /// Forgets everything and aborts recoveries and retries in flight
    /// (leadership lost). A copy already started runs to its end in the
    /// mirror's copy queue (copies are idempotent), but no Event follows.
    pub fn clear(&self) {
        self.tasks.lock().expect("tasks lock").abort_all();
        self.pods.lock().expect("pods lock").clear();
        self.metrics.watched_pods.set(0);
        self.images.lock().expect("images lock").clear();
        if let Some(e) = &self.evictor {
            e.clear();
        }
    }

    /// A Pod known to the watcher whose images include `target`'s
    /// `repository@digest`, with that image.
    pub fn user_of(&self, target: &Reference) -> Option<(PodImages, TargetImage)> {
        let pods = self.pods.lock().expect("pods lock");
        pods.find(|i, _| same_manifest(i, target), 1).pop()
    }

    /// Up to `limit` Pods known to the watcher that use `image` (as
    /// [`image_key`] identifies it); only those that fail to pull it with
    /// `failing_only`.
    fn users(
        &self,
        image: &Reference,
        failing_only: bool,
        limit: usize,
    ) -> Vec<(PodImages, TargetImage)> {
        let same = |i: &Reference| match image.digest() {
            Some(_) => same_manifest(i, image),
            None => i == image,
        };
        let pods = self.pods.lock().expect("pods lock");
        pods.find(|i, failing| (!failing_only || failing) && same(i), limit)
    }

    /// Starts or joins the recovery of `img`, on behalf of `pod` (told
    /// about the outcome with an Event) when given.
    pub fn trigger(self: &Arc<Self>, img: TargetImage, pod: Option<PodImages>, cause: Cause) {
        let key = image_key(&img.image);
        let cooling = {
            let mut images = self.images.lock().expect("images lock");
            if images.len() > 256 {
                // Forget images with nothing pending, so the map stays the
                // size of what is failing now.
                let now = Instant::now();
                images.retain(|_, st| {
                    st.running
                        || st.retry_at.is_some_and(|t| now < t)
                        || st.done.is_some_and(|d| now < d + COOLDOWN)
                });
            }
            let st = images.entry(key.clone()).or_default();
            if let Some(p) = &pod
                && !st.pods.iter().any(|o| o.uid == p.object.uid)
            {
                st.pods.push(p.object.clone());
            }
            let now = Instant::now();
            let cooling = st.done.is_some_and(|d| now < d + COOLDOWN);
            let waiting = st.retry_at.is_some_and(|t| now < t);
            if st.running || waiting {
                return;
            }
            if cooling {
                st.pods.clear();
            } else {
                st.running = true;
            }
            cooling
        };
        if cooling {
            // The recovery just done does not make this failure stale: the
            // kubelet failed to pull the image, so admission must not keep
            // answering "present at the target" from the existence cache.
            if cause == Cause::PullFailure {
                let (mirror, image) = (self.mirror.clone(), img.image.clone());
                self.spawn(async move {
                    mirror.caches().invalidate(&image, Cause::PullFailure).await;
                });
            }
            return;
        }
        let this = self.clone();
        self.spawn(async move { this.run(key, img, pod, cause).await });
    }

    /// Runs `work` as a task that [`Recovery::clear`] aborts.
    fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().expect("tasks lock");
        while tasks.try_join_next().is_some() {}
        tasks.spawn(work);
    }

    async fn run(
        self: Arc<Self>,
        key: String,
        mut img: TargetImage,
        pod: Option<PodImages>,
        cause: Cause,
    ) {
        // The annotation is the Pod author's to write: its source must pass
        // the same allowlist as an admission (the mirror also checks that it
        // maps to the image's own repository).
        let mut ignored = None;
        if let Some(orig) = &img.original
            && let Err(why) = self.policy.source_allowed(orig)
        {
            warn!(image = %img.image, original = %orig, %why, "ignoring the Pod's original-images entry");
            // Said in the Event, so "no source known" is not read as "no
            // annotation given".
            ignored = Some(format!(
                "the Pod's pinswap.dev/original-images entry {orig} was ignored: {why}"
            ));
            img.original = None;
        }
        // A private image is copied only with the credentials of a Pod that
        // may have it: the failing Pod's first, then other Pods using it.
        let mut pods = Vec::new();
        if let Some(ps) = &self.pull_secrets {
            let users = pod.iter().cloned().chain(
                self.users(&img.image, false, MAX_VOUCHING_PODS + 1)
                    .into_iter()
                    .map(|(p, _)| p),
            );
            let mut seen = std::collections::HashSet::new();
            for p in users
                .filter(|p| seen.insert(p.key()))
                .take(MAX_VOUCHING_PODS)
            {
                pods.push(ps.for_pod(p.namespace(), &p.pull).await);
            }
        }
        let res = self
            .mirror
            .recover(&img.image, img.original.as_ref(), cause, &pods)
            .await;
        // Only for eviction: whether the target lacks it (a failure may
        // also be a verifying copy's, with the manifest there).
        let missing = match (&res, &self.evictor) {
            (Err(_), Some(_)) => matches!(self.mirror.target_serves(&img.image).await, Ok(false)),
            _ => false,
        };
        let (pods, retry, was_lost) = {
            let mut images = self.images.lock().expect("images lock");
            let st = images.entry(key.clone()).or_default();
            st.running = false;
            st.lost |= missing;
            let was_lost = st.lost;
            // Kept while attempts fail; an attempt that worked ends it.
            st.lost = was_lost && res.is_err();
            let pods = std::mem::take(&mut st.pods);
            match &res {
                Ok(_) => {
                    st.done = Some(Instant::now());
                    st.failures = 0;
                    st.retry_at = None;
                    (pods, None, was_lost)
                }
                Err(_) => {
                    st.failures += 1;
                    // Not before the source's breaker lets a request through:
                    // a retry while it is open would fail without asking.
                    let breaker = img
                        .original
                        .as_ref()
                        .map(|o| self.mirror.source_retry_in(o))
                        .unwrap_or_default();
                    let wait = self
                        .retry_initial
                        .saturating_mul(1 << (st.failures - 1).min(16))
                        .min(self.retry_max)
                        .max(breaker);
                    st.retry_at = Some(Instant::now() + wait);
                    (pods, Some(wait), was_lost)
                }
            }
        };
        let event = match res {
            Ok(Recovered::Present) if was_lost => {
                // Missing at an attempt before, there now: another copy (a
                // resumed one, an admission's) mirrored it again since the
                // Pods failed.
                Metrics::outcome(&self.metrics.remirrors, "present");
                info!(image = %img.image, "target has the image again, mirrored since the pull failure");
                if let Some(e) = &self.evictor {
                    e.remirrored(&img.image);
                }
                None
            }
            Ok(Recovered::Present) => {
                Metrics::outcome(&self.metrics.remirrors, "present");
                info!(image = %img.image, "target has the image; the pull failure has another cause");
                None
            }
            Ok(Recovered::Remirrored { source, seconds }) => {
                Metrics::outcome(&self.metrics.remirrors, "remirrored");
                info!(image = %img.image, %source, seconds, cause = cause.as_str(), "mirrored a lost image again");
                if let Some(e) = &self.evictor {
                    e.remirrored(&img.image);
                }
                Some(Event {
                    type_: EventType::Normal,
                    reason: REMIRRORED.into(),
                    note: Some(event_note(format!(
                        "pinswap mirrored {} again from {source}; the next pull retry will find it",
                        img.image
                    ))),
                    action: "Remirror".into(),
                    secondary: None,
                })
            }
            Err(e) => {
                Metrics::outcome(&self.metrics.remirrors, "failed");
                let quota = e.is_quota();
                let wait = retry.unwrap_or_default();
                warn!(image = %img.image, error = %e, retry_in = ?wait, "re-mirror failed");
                let e = match &ignored {
                    Some(why) => format!("{e} ({why})"),
                    None => e.to_string(),
                };
                let reason = match quota {
                    true => QUOTA_EXHAUSTED,
                    false => REMIRROR_FAILED,
                };
                Some(Event {
                    type_: EventType::Warning,
                    reason: reason.into(),
                    note: Some(event_note(format!(
                        "pinswap could not mirror {} again: {e}; retrying in {}",
                        img.image,
                        humantime::format_duration(wait)
                    ))),
                    action: "Remirror".into(),
                    secondary: None,
                })
            }
        };
        if let (Some(ev), Some(rec)) = (&event, &self.recorder) {
            for p in &pods {
                if let Err(e) = rec.publish(ev, p).await {
                    warn!(pod = ?p.name, error = %e, "could not record an Event");
                }
            }
        }
        if let Some(wait) = retry {
            let this = self.clone();
            let image = img.image.clone();
            self.spawn(async move {
                tokio::time::sleep(wait).await;
                // After a pull failure, retry while a Pod still fails; after
                // re-verification (its Pods run fine; nothing else will
                // notice), while a Pod still uses the image.
                let users = this.users(&image, cause == Cause::PullFailure, usize::MAX);
                if users.is_empty() {
                    // Nobody needs it now: forget its failures, so a later
                    // loss starts from the first backoff step.
                    let mut images = this.images.lock().expect("images lock");
                    if images.get(&key).is_some_and(|st| !st.running) {
                        images.remove(&key);
                    }
                }
                if let Some((first, image)) = users.first().cloned() {
                    for (p, i) in users {
                        this.trigger(i, Some(p), cause);
                    }
                    // Retry even if every user joined above; trigger is
                    // idempotent for a running recovery.
                    this.trigger(image, Some(first), cause);
                }
            });
        }
    }
}

/// Whether a container's `waiting.reason` `now`, after `was` (`None`: not
/// failing, or not seen), reports a failed pull the watcher has not seen.
///
/// The kubelet writes `ErrImagePull` after each failed pull, and
/// `ImagePullBackOff` when it retries once the back-off ends: that one
/// still describes the failure before the retry (a kubelet writes it about
/// 0.15 s before a retry that works, 10 s or more after `ErrImagePull`).
/// So `ImagePullBackOff` is a new failure only when its `ErrImagePull` went
/// unseen (the watcher started since); taking it for one would start a
/// second recovery of an image already mirrored again, and, with the source
/// down, a `RemirrorFailed` on a Pod about to run.
pub(crate) fn new_pull_failure(was: Option<&str>, now: &str) -> bool {
    match now {
        "ErrImagePull" => was != Some("ErrImagePull"),
        _ => was.is_none(),
    }
}

/// `namespace/name` of a Pod's reference, as [`PodImages::key`] gives it.
fn object_key(o: &ObjectReference) -> String {
    format!(
        "{}/{}",
        o.namespace.as_deref().unwrap_or("default"),
        o.name.as_deref().unwrap_or_default()
    )
}

/// Whether `a` and `b` name one manifest: registry, repository and digest
/// (a tag aside). Compared in place: the index is scanned with it.
fn same_manifest(a: &Reference, b: &Reference) -> bool {
    a.digest() == b.digest() && a.repository() == b.repository() && a.registry() == b.registry()
}

/// The per-image key: target `repository@digest` (or the reference itself
/// when it has no digest).
fn image_key(image: &Reference) -> String {
    match image.digest() {
        Some(_) => image.without_tag().to_string(),
        None => image.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::new_pull_failure;

    #[test]
    fn back_off_after_its_pull_failure_is_not_a_new_failure() {
        // The kubelet's sequence for one failed pull, then a failed retry.
        assert!(new_pull_failure(None, "ErrImagePull"));
        assert!(!new_pull_failure(Some("ErrImagePull"), "ImagePullBackOff"));
        assert!(new_pull_failure(Some("ImagePullBackOff"), "ErrImagePull"));
        assert!(!new_pull_failure(Some("ErrImagePull"), "ErrImagePull"));
        assert!(!new_pull_failure(
            Some("ImagePullBackOff"),
            "ImagePullBackOff"
        ));
        // Seen first in back-off: its ErrImagePull went unseen.
        assert!(new_pull_failure(None, "ImagePullBackOff"));
    }
}
