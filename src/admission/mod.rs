//! AdmissionReview in, AdmissionReview out (docs/architecture.md §3 "Admission").
//!
//! For a Pod on CREATE or UPDATE: find the image slots, skip those a filter,
//! the allowlist or idempotence rules out, decide the rest through the
//! [`Mirror`] (each distinct image once, concurrently, within one time
//! budget), and answer with JSONPatch `replace` ops plus the
//! `pinswap.dev/original-images` and `pinswap.dev/decisions` annotations.
//! Any error leaves its slot unchanged (fail open) unless `failurePolicy` is
//! `closed`, which denies the Pod naming the image and the cause.

pub mod mirror_only;
pub mod notes;
pub(crate) mod pod;
pub mod policy;
mod review;
pub mod scope;

pub use review::ReviewError;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kube::core::admission::{AdmissionResponse, Operation};
use tracing::{debug, info, warn};

use crate::config::{Config, FailurePolicy};
use crate::logsafe::{Untrusted, clip};
use crate::metrics::{ErrorCause, Metrics};
use crate::mirror::{Mirror, MirrorError, NotReady};
use crate::reference::Reference;
use crate::registry::pullsecrets::PodCredentials;
use policy::{Policy, PolicyError, Skip};

/// Bounds an annotation value, so many slots cannot push the Pod past the
/// API server's 256 KiB annotation limit.
fn cap(note: String) -> String {
    if note.chars().count() > 600 {
        note.chars().take(599).chain(['…']).collect()
    } else {
        note
    }
}

/// Distinct images of one review decided at the same time.
const MAX_CONCURRENT_IMAGES: usize = 16;

/// Errors listed by name in a `failurePolicy: closed` denial, and the
/// characters kept of each: the API server shows the message to the user.
const DENIAL_ERRORS: usize = 10;
const DENIAL_ERROR_CHARS: usize = 400;

/// `prefix: e1; e2; …; and N more`, each error escaped and clipped.
fn denial(prefix: &str, errors: &[String]) -> String {
    let mut listed: Vec<String> = errors
        .iter()
        .take(DENIAL_ERRORS)
        .map(|e| clip(e, DENIAL_ERROR_CHARS))
        .collect();
    if errors.len() > DENIAL_ERRORS {
        listed.push(format!("and {} more", errors.len() - DENIAL_ERRORS));
    }
    format!("{prefix}: {}", listed.join("; "))
}

/// How [`Admission::decide_template`] decided one slot.
#[derive(Debug, Clone)]
pub enum SlotOutcome {
    /// Rewrite to `image`.
    Rewrite {
        /// The new image.
        image: String,
        /// Why (this run's reason).
        reason: String,
        /// The source pinned to the digest mirrored; empty when unknown.
        source: String,
    },
    /// Left alone on purpose (a filter, the allowlist, already mirrored).
    Skip(String),
    /// Left alone because it is not at the target (not copied, copy not
    /// done, dry run).
    Keep(String),
    /// Left alone because of an error.
    Error(String),
}

/// One slot and its outcome.
#[derive(Debug, Clone)]
pub struct SlotDecision {
    /// The slot.
    pub slot: pod::Slot,
    /// What happened.
    pub outcome: SlotOutcome,
    /// The identity finding, if any.
    pub identity: Option<String>,
}

/// Answers AdmissionReviews for Pods.
pub struct Admission {
    mirror: Arc<Mirror>,
    pull_secrets: Option<crate::registry::pullsecrets::PullSecrets>,
    policy: Policy,
    mirror_only: mirror_only::MirrorOnly,
    failure: FailurePolicy,
    budget: Duration,
    max_images: usize,
    metrics: Arc<Metrics>,
    cache_purge: bool,
}

/// Every slot of one pod spec, decided.
struct Decided<'a> {
    rewrites: Vec<(&'a pod::Slot, String)>,
    /// The `pinswap_rewrites_total` reason of each rewrite.
    causes: Vec<&'static str>,
    decisions: BTreeMap<String, String>,
    /// Slot key → identity finding or repair (`pinswap.dev/identity`).
    identity: BTreeMap<String, String>,
    /// Slot key → pinned source of a rewritten slot (`pinswap.dev/sources`).
    sources: BTreeMap<String, String>,
    errors: Vec<String>,
    /// `identity.collisions: deny` findings (`image: message`).
    denials: Vec<String>,
}

/// What happened to one slot.
enum Outcome {
    /// New image, why, pinned source (empty when unknown), the
    /// `pinswap_rewrites_total` reason.
    Rewrite(String, String, String, &'static str),
    /// Left alone on purpose: a filter, the allowlist, already mirrored.
    Skip(String),
    Keep(String),
    /// Left alone (or the Pod denied, `failurePolicy: closed`): why, and
    /// the kind of failure.
    Error(String, ErrorCause),
    Deny(String),
}

/// Why the mirror gave no decision for an image.
#[derive(Debug)]
enum Undecided {
    /// `identity.collisions: deny` refused it.
    Denied(String),
    /// It failed: why, and the kind of failure.
    Failed(String, ErrorCause),
}

/// Why the admission handler cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The mirror service: credentials, the target, ECR.
    #[error(transparent)]
    Mirror(#[from] Box<MirrorError>),
    /// A filter does not compile.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl Admission {
    /// Builds the handler from a validated config.
    ///
    /// # Errors
    /// [`AdmissionError::Policy`] when a filter does not compile (validation
    /// normally caught it already).
    pub fn new(
        config: &Config,
        mirror: Arc<Mirror>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, AdmissionError> {
        Ok(Self {
            pull_secrets: None,
            policy: Policy::new(config, mirror.target().clone())?.with_metrics(metrics.clone()),
            mirror_only: mirror_only::MirrorOnly::new(&config.mirror_only),
            mirror,
            failure: config.failure_policy,
            budget: config.server.admission_budget,
            max_images: config.server.max_images,
            metrics,
            cache_purge: config.cache.purge_endpoint,
        })
    }

    /// Builds the mirror service and the handler from a validated config.
    ///
    /// # Errors
    /// A message naming the config key whose credentials cannot be read, or
    /// the filter that does not compile.
    pub fn from_config(config: &Config, metrics: Arc<Metrics>) -> Result<Self, AdmissionError> {
        let mirror = Mirror::from_config(config, metrics.clone()).map_err(Box::new)?;
        Self::new(config, Arc::new(mirror), metrics)
    }

    /// As [`Admission::from_config`], through [`Mirror::connect`], which
    /// also signs in to an ECR target (`target.aws`).
    ///
    /// # Errors
    /// As [`Admission::from_config`], and AWS errors naming the IAM action.
    pub async fn connect(config: &Config, metrics: Arc<Metrics>) -> Result<Self, AdmissionError> {
        let mirror = Mirror::connect(config, metrics.clone())
            .await
            .map_err(Box::new)?;
        Self::new(config, Arc::new(mirror), metrics)
    }

    /// Reads source credentials from each Pod's imagePullSecrets through
    /// `client` (`source.imagePullSecrets: true`).
    pub fn with_pull_secrets(mut self, client: kube::Client) -> Self {
        self.pull_secrets = Some(crate::registry::pullsecrets::PullSecrets::new(
            client,
            self.metrics.clone(),
        ));
        self
    }

    /// The mirror service behind this handler.
    pub fn mirror(&self) -> &Arc<Mirror> {
        &self.mirror
    }

    /// Whether `POST /cache/purge` is on (`cache.purgeEndpoint`).
    pub fn cache_purge(&self) -> bool {
        self.cache_purge
    }

    /// Whether the webhook can serve: the target registry answers.
    ///
    /// # Errors
    /// Why not, in one line (see [`Mirror::target_ready`]).
    pub async fn ready(&self) -> Result<(), NotReady> {
        self.mirror.target_ready().await
    }

    /// Answers one AdmissionReview body (`admission.k8s.io/v1` or `v1beta1`;
    /// the response uses the request's version) with the response
    /// AdmissionReview's JSON. A kind other than Pod, or an operation other
    /// than CREATE and UPDATE, is allowed unchanged. The admission budget
    /// runs from the call, parsing included; at most `server.maxImages`
    /// distinct images are decided.
    ///
    /// # Errors
    /// [`ReviewError::Malformed`] when the body is not an AdmissionReview of
    /// a version the API server sends.
    pub async fn review(&self, body: Bytes) -> Result<Vec<u8>, ReviewError> {
        let start = Instant::now();
        // Decisions stop a little early: patching, annotating and encoding
        // the answer take time proportional to the slots.
        let deadline = start + self.budget - self.budget / 10;
        let (api_version, mut req) = review::decode(&body)?;
        drop(body);
        let object = req.object.take();
        let (resp, outcome) = self.answer(&req, &api_version, object, deadline).await;
        self.metrics.admission(outcome);
        self.metrics
            .admission_seconds
            .observe(start.elapsed().as_secs_f64());
        review::encode(resp).map_err(|e| ReviewError::Malformed(e.to_string()))
    }

    async fn answer(
        &self,
        req: &review::Request,
        api_version: &str,
        object: Option<serde_json::Value>,
        deadline: Instant,
    ) -> (AdmissionResponse, &'static str) {
        let uid = Untrusted(&req.uid);
        let allow = req.allow(api_version);
        let is_pod = req.kind.group.is_empty() && req.kind.kind == "Pod";
        if !is_pod || !matches!(req.operation, Operation::Create | Operation::Update) {
            return (allow, "skipped");
        }
        // Of the Pod subresources only `ephemeralcontainers` can change an
        // image, and through it the API server keeps nothing else.
        let ephemeral_only = match req.sub_resource.as_deref() {
            None | Some("") => false,
            Some("ephemeralcontainers") => true,
            Some(_) => return (allow, "skipped"),
        };
        let Some(mut pod) = object else {
            return (allow, "skipped");
        };
        let mut slots = pod::slots_for(
            pod.get("spec").unwrap_or(&serde_json::Value::Null),
            self.policy.has_filters(),
        );
        if ephemeral_only {
            slots.retain(|s| s.kind == "ephemeralContainers");
        }
        // On UPDATE only images this update changes are considered: a running
        // container whose image changed would be restarted by the kubelet.
        if req.operation == Operation::Update {
            let before = pod::slots_for(
                req.old_object
                    .as_ref()
                    .and_then(|o| o.get("spec"))
                    .unwrap_or(&serde_json::Value::Null),
                false,
            );
            let before: std::collections::HashSet<(&str, &str, &str)> = before
                .iter()
                .map(|b| (b.kind, b.name.as_str(), b.image.as_str()))
                .collect();
            slots.retain(|s| !before.contains(&(s.kind, s.name.as_str(), s.image.as_str())));
        }
        if slots.is_empty() {
            return (allow, "unchanged");
        }
        // Patching and annotating grow with the slots too (a few µs each):
        // decisions end that much earlier, up to a quarter of the budget.
        let finishing =
            (Duration::from_micros(5) * slots.len().min(1 << 20) as u32).min(self.budget / 4);
        let deadline = deadline - finishing;
        // Filters see the request's namespace even when the object has none
        // yet (as k8s-image-swapper's filter context does).
        if pod.pointer("/metadata/namespace").is_none()
            && let (Some(ns), Some(meta)) = (
                req.namespace.as_ref().filter(|n| !n.is_empty()),
                pod.get_mut("metadata").and_then(|m| m.as_object_mut()),
            )
        {
            meta.insert("namespace".into(), serde_json::Value::String(ns.clone()));
        }
        // The request's namespace, else the Pod's own (a review can come
        // with an empty request.namespace, as k8s-image-swapper's sample does).
        let namespace = req
            .namespace
            .as_deref()
            .filter(|n| !n.is_empty())
            .or_else(|| {
                pod.pointer("/metadata/namespace")
                    .and_then(|n| n.as_str())
                    .filter(|n| !n.is_empty())
            })
            .map(str::to_owned);
        if self.pull_secrets.is_some() && namespace.is_none() {
            debug!(uid = %req.uid, "no namespace in the request or the Pod: imagePullSecrets not read");
        }
        let creds = match (&self.pull_secrets, &namespace) {
            (Some(ps), Some(ns)) => {
                match tokio::time::timeout_at(deadline.into(), ps.for_pod(ns, &pod)).await {
                    Ok(c) => c,
                    Err(_) => {
                        // Private images are then left unchanged for it.
                        warn!(%uid, "pull secrets not read within the admission budget");
                        PodCredentials::new(ns, [])
                    }
                }
            }
            _ => PodCredentials::none(),
        };
        let Decided {
            rewrites,
            causes,
            decisions,
            identity,
            sources,
            errors,
            denials,
        } = self
            // A dry-run request must have no side effects: plan, don't copy.
            .decide_spec(&pod, &slots, deadline, req.is_dry_run(), &creds)
            .await;
        let name = Untrusted(
            pod.pointer("/metadata/name")
                .or_else(|| pod.pointer("/metadata/generateName"))
                .and_then(|v| v.as_str())
                .unwrap_or(""),
        );
        // A deny finding rejects the Pod whatever failurePolicy says: it is
        // a policy decision, not an error.
        if !denials.is_empty() {
            let msg = denial("pinswap (identity.collisions deny)", &denials);
            warn!(%uid, pod = %name, message = %msg, "denied");
            return (allow.deny(msg), "denied");
        }
        if !errors.is_empty() && self.failure == FailurePolicy::Closed {
            let msg = denial("pinswap (failurePolicy closed)", &errors);
            warn!(%uid, pod = %name, message = %msg, "denied");
            return (allow.deny(msg), "denied");
        }
        // Mirrored only: the copies above ran as for any Pod; the Pod is
        // admitted exactly as written, so an operator comparing its images
        // with its own spec sees no difference.
        if let Some(rule) = namespace
            .as_deref()
            .and_then(|ns| self.mirror_only.matches(&pod, ns))
        {
            info!(%uid, namespace = %Untrusted(req.namespace.as_deref().unwrap_or("")), pod = %name, mirror_only = rule, slots = slots.len(), "admitted as written (mirrorOnly)");
            for (slot, decision) in &decisions {
                debug!(%uid, slot, decision, "mirrored only");
            }
            return (allow, "mirror_only");
        }
        let outcome = if rewrites.is_empty() {
            "unchanged"
        } else {
            "rewritten"
        };
        for cause in causes {
            self.metrics.rewrite(cause);
        }
        info!(%uid, namespace = %Untrusted(req.namespace.as_deref().unwrap_or("")), pod = %name, rewritten = rewrites.len(), slots = slots.len(), "admitted");
        let patch = pod::patch(
            &pod,
            &["spec"],
            &rewrites,
            &pod::Notes {
                decisions: &decisions,
                identity: &identity,
                sources: &sources,
            },
            !ephemeral_only,
        );
        match allow.clone().with_patch(patch) {
            Ok(r) => (r, outcome),
            Err(e) => {
                warn!(%uid, error = %e, "patch not serialisable; allowed unchanged");
                (allow, "unchanged")
            }
        }
    }

    /// Decides every slot of one pod spec: the rewrites, a reason per slot,
    /// and the errors (`image: cause`).
    async fn decide_spec<'a>(
        &self,
        obj: &serde_json::Value,
        slots: &'a [pod::Slot],
        deadline: Instant,
        dry_run: bool,
        creds: &PodCredentials,
    ) -> Decided<'a> {
        let outcomes = self
            .decide_slots(obj, slots, deadline, dry_run, creds)
            .await;
        let mut out = Decided {
            rewrites: Vec::new(),
            causes: Vec::new(),
            decisions: BTreeMap::new(),
            identity: BTreeMap::new(),
            sources: BTreeMap::new(),
            errors: Vec::new(),
            denials: Vec::new(),
        };
        for (slot, (outcome, identity)) in slots.iter().zip(outcomes) {
            if let Some(i) = identity {
                out.identity.insert(slot.key(), cap(i));
            }
            let note = match outcome {
                Outcome::Rewrite(image, why, source, cause) => {
                    if !source.is_empty() {
                        out.sources.insert(slot.key(), source);
                    }
                    out.causes.push(cause);
                    out.rewrites.push((slot, image));
                    format!("rewritten: {why}")
                }
                Outcome::Skip(why) | Outcome::Keep(why) => format!("unchanged: {why}"),
                Outcome::Error(why, cause) => {
                    // Counted per slot whatever failurePolicy does with it.
                    self.metrics.admission_error(cause);
                    out.errors.push(format!("{}: {why}", slot.image));
                    format!("unchanged (error): {why}")
                }
                Outcome::Deny(why) => {
                    out.denials.push(why.clone());
                    format!("denied: {why}")
                }
            };
            out.decisions.insert(slot.key(), cap(note));
        }
        out
    }

    /// Decides every slot of a pod template (`{metadata, spec}`) as
    /// admission would decide the Pod made from it, changing nothing
    /// (`pinswap mutate` edits the text itself). `obj` is what filters see
    /// as `obj`. A template `mirrorOnly` matches has its images copied and
    /// none rewritten.
    pub async fn decide_template(
        &self,
        obj: &serde_json::Value,
        template: &serde_json::Value,
        default_namespace: &str,
        dry_run: bool,
    ) -> Vec<SlotDecision> {
        let slots = pod::slots(template.get("spec").unwrap_or(&serde_json::Value::Null));
        let deadline = Instant::now() + self.budget;
        let outcomes = self
            .decide_slots(obj, &slots, deadline, dry_run, &PodCredentials::none())
            .await;
        let mirror_only = self.mirror_only_template(obj, template, default_namespace);
        slots
            .into_iter()
            .zip(outcomes)
            .map(|(slot, (o, identity))| SlotDecision {
                slot,
                identity,
                outcome: match o {
                    Outcome::Rewrite(_, reason, _, _) if let Some(rule) = mirror_only => {
                        SlotOutcome::Skip(format!(
                            "mirrored only ({rule}), not rewritten: {reason}"
                        ))
                    }
                    Outcome::Rewrite(image, reason, source, _) => SlotOutcome::Rewrite {
                        image,
                        reason,
                        source,
                    },
                    Outcome::Skip(why) => SlotOutcome::Skip(why),
                    Outcome::Keep(why) => SlotOutcome::Keep(why),
                    Outcome::Error(why, _) | Outcome::Deny(why) => SlotOutcome::Error(why),
                },
            })
            .collect()
    }

    /// The `mirrorOnly` rule the Pods made from `template`, the pod
    /// template of workload `obj`, match, seen as Pod admission sees them:
    /// the Pod built from the template (its metadata and spec), in `obj`'s
    /// namespace, or `default_namespace` when `obj` names none (where
    /// `kubectl apply` would put it), with the controller such a Pod has (a
    /// Deployment's Pods are its ReplicaSet's, a CronJob's its Job's; a
    /// Pod's own).
    fn mirror_only_template(
        &self,
        obj: &serde_json::Value,
        template: &serde_json::Value,
        default_namespace: &str,
    ) -> Option<&str> {
        if self.mirror_only.is_empty() {
            return None;
        }
        let kind = obj.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        let namespace = obj
            .pointer("/metadata/namespace")
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty())
            .unwrap_or(default_namespace);
        let controller = match kind {
            "Pod" => None,
            "Deployment" | "ReplicaSet" => Some(("apps/v1", "ReplicaSet")),
            "StatefulSet" => Some(("apps/v1", "StatefulSet")),
            "DaemonSet" => Some(("apps/v1", "DaemonSet")),
            "Job" | "CronJob" => Some(("batch/v1", "Job")),
            "ReplicationController" => Some(("v1", "ReplicationController")),
            _ => None,
        };
        let mut pod = match kind {
            "Pod" => obj.clone(),
            _ => serde_json::json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": template.get("metadata").cloned().unwrap_or_else(|| serde_json::json!({})),
                "spec": template.get("spec").cloned().unwrap_or_else(|| serde_json::json!({})),
            }),
        };
        if let Some(m) = pod.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            // A workload's Pods are made in its namespace, whatever the
            // template says.
            m.insert("namespace".into(), namespace.into());
            if let Some((api, kind)) = controller {
                m.insert(
                    "ownerReferences".into(),
                    serde_json::json!([{"apiVersion": api, "kind": kind, "controller": true}]),
                );
            }
        }
        self.mirror_only.matches(&pod, namespace)
    }

    /// Waits for the copies decisions have started; returns how many failed.
    pub async fn wait_for_copies(&self) -> usize {
        self.mirror.wait_for_copies().await
    }

    /// Whether errors should fail the whole object (`failurePolicy: closed`).
    pub fn fails_closed(&self) -> bool {
        self.failure == FailurePolicy::Closed
    }

    /// One outcome per slot. Each distinct image is decided once.
    async fn decide_slots(
        &self,
        pod: &serde_json::Value,
        slots: &[pod::Slot],
        deadline: Instant,
        dry_run: bool,
        creds: &PodCredentials,
    ) -> Vec<(Outcome, Option<String>)> {
        let mut pending: HashMap<String, Reference> = HashMap::new();
        let mut first: Vec<Option<Outcome>> = Vec::with_capacity(slots.len());
        let prepared = self.policy.prepare(pod);
        let over = || {
            format!(
                "not decided: more than server.maxImages ({}) distinct images in one review",
                self.max_images
            )
        };
        for slot in slots {
            // Work per review stays bounded by the image limit, however
            // many containers the Pod lists.
            if pending.len() >= self.max_images && !pending.contains_key(&slot.image) {
                first.push(Some(Outcome::Keep(over())));
                continue;
            }
            match self.policy.check(prepared.as_ref(), slot) {
                Ok(reference) => {
                    pending.insert(slot.image.clone(), reference);
                    first.push(None);
                }
                Err(Skip::Keep(why)) => first.push(Some(Outcome::Skip(why))),
                Err(Skip::Error(cause, why)) => first.push(Some(Outcome::Error(why, cause))),
            }
        }
        // Distinct images are decided concurrently, but at most
        // MAX_CONCURRENT_IMAGES at a time: a Pod with hundreds of images
        // must not open hundreds of registry connections at once.
        type Decided = Result<crate::mirror::Decision, Undecided>;
        let decided: HashMap<String, Decided> =
            futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
                futures::stream::iter(pending.into_iter().map(|(image, reference)| async move {
                    let exhausted = || {
                        format!(
                            "admission budget of {} exhausted",
                            humantime::format_duration(self.budget)
                        )
                    };
                    // Images still queued at the deadline are not started.
                    if Instant::now() >= deadline {
                        return (
                            image,
                            Err(Undecided::Failed(exhausted(), ErrorCause::Budget)),
                        );
                    }
                    let decide = async {
                        if dry_run {
                            self.mirror.decide_dry(&reference, creds).await
                        } else {
                            self.mirror.decide(&reference, deadline, creds).await
                        }
                    };
                    let r = tokio::time::timeout_at(deadline.into(), decide).await;
                    let r = match r {
                        Ok(Ok(d)) => Ok(d),
                        Ok(Err(e @ crate::mirror::MirrorError::IdentityDenied { .. })) => {
                            Err(Undecided::Denied(e.to_string()))
                        }
                        Ok(Err(e)) => Err(Undecided::Failed(
                            e.to_string(),
                            self.mirror.error_cause(&e),
                        )),
                        Err(_) => Err(Undecided::Failed(exhausted(), ErrorCause::Budget)),
                    };
                    debug!(image = %Untrusted(&image), ?r, "decided");
                    (image, r)
                })),
                MAX_CONCURRENT_IMAGES,
            ))
            .await;
        slots
            .iter()
            .zip(first)
            .map(|(slot, early)| match early {
                Some(o) => (o, None),
                None => match &decided[&slot.image] {
                    Ok(d) => {
                        let o = match &d.image {
                            Some(new) if *new != slot.image => Outcome::Rewrite(
                                new.clone(),
                                d.reason.clone(),
                                d.source.clone(),
                                d.cause,
                            ),
                            Some(_) => Outcome::Keep("already the mirrored image".into()),
                            None => Outcome::Keep(d.reason.clone()),
                        };
                        (o, d.identity.clone())
                    }
                    Err(Undecided::Denied(e)) => (Outcome::Deny(e.clone()), None),
                    Err(Undecided::Failed(e, cause)) => (Outcome::Error(e.clone(), *cause), None),
                },
            })
            .collect()
    }
}
