//! What the watcher needs from a Pod: its images under the target, the
//! source each was mirrored from, and which of them the kubelet fails to
//! pull.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ContainerStatus, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource;
use serde_json::{Value, json};

use crate::admission::notes::{IDENTITY, ORIGINAL_IMAGES, SOURCES};
use crate::reference::{MirrorTarget, Reference};

/// `waiting.reason`s that mean the kubelet could not pull the image
/// (kubelet `images.ErrImagePull` and `images.ErrImagePullBackOff`).
pub const PULL_FAILURE_REASONS: [&str; 2] = ["ErrImagePull", "ImagePullBackOff"];

/// One container image of a Pod that lives under the target.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetImage {
    /// `containers/NAME`, `initContainers/NAME`, `ephemeralContainers/NAME`
    /// or `volumes/NAME` (an image volume), the key of the `pinswap.dev/*`
    /// annotations.
    pub slot: String,
    /// The image as the Pod names it, under the target.
    pub image: Reference,
    /// Its source: the pinned one from `pinswap.dev/sources`, else the
    /// original image from `pinswap.dev/original-images`, if recorded.
    pub original: Option<Reference>,
    /// `waiting.reason` when the kubelet reports a pull failure for it (for
    /// an image volume, on a container that mounts it).
    pub failing: Option<String>,
}

/// A Pod as the watcher keeps it: enough to name it in an Event, to read its
/// pull secrets, and its target images.
#[derive(Debug, Clone)]
pub struct PodImages {
    /// For Events.
    pub object: ObjectReference,
    /// `{"spec": {"imagePullSecrets", "serviceAccountName"}}`, for
    /// [`crate::registry::pullsecrets::PullSecrets::for_pod`].
    pub pull: Value,
    /// Its images under the target.
    pub images: Vec<TargetImage>,
    /// The `pinswap.dev/identity` annotation: slot → finding or repair.
    pub identity: BTreeMap<String, String>,
    /// Whether an owner reference is its controller (`controller: true`),
    /// which recreates it when it is evicted.
    pub controlled: bool,
}

impl PodImages {
    /// The Pod's namespace.
    pub fn namespace(&self) -> &str {
        self.object.namespace.as_deref().unwrap_or("default")
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.namespace(),
            self.object.name.as_deref().unwrap_or_default()
        )
    }
}

/// One image the kubelet pulls for a Pod: a container's or an image
/// volume's, with the pull failure the kubelet reports for it.
struct Pull<'a> {
    kind: &'static str,
    name: &'a str,
    image: &'a str,
    failing: Option<String>,
}

/// Every image `pod` names, each with its pull failure. The kubelet
/// reports an image volume's failure on the containers that mount it, with
/// the volume's reference quoted in the message ("Failed to pull image
/// \"REF\": …", "Back-off pulling image \"REF\""), so a failure goes to
/// the image its message names; one without a message is the container's.
fn pulls(pod: &Pod) -> Vec<Pull<'_>> {
    let mut out = Vec::new();
    let Some(spec) = pod.spec.as_ref() else {
        return out;
    };
    let status = pod.status.as_ref();
    let names = |message: &Option<String>, image: &str| {
        message
            .as_deref()
            .is_some_and(|m| m.contains(&format!("\"{image}\"")))
    };
    let volumes: BTreeMap<&str, &str> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.image.as_ref()?.reference.as_deref()?)))
        .collect();
    let mut volume_failures: BTreeMap<&str, String> = BTreeMap::new();
    let lists = [
        (
            "initContainers",
            spec.init_containers.iter().flatten().collect::<Vec<_>>(),
            status.and_then(|s| s.init_container_statuses.as_ref()),
        ),
        (
            "containers",
            spec.containers.iter().collect(),
            status.and_then(|s| s.container_statuses.as_ref()),
        ),
    ];
    let failure = |name: &str, statuses: Option<&Vec<ContainerStatus>>| {
        let s = statuses.into_iter().flatten().find(|s| s.name == name)?;
        let waiting = s.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.clone()?;
        PULL_FAILURE_REASONS
            .contains(&reason.as_str())
            .then(|| (reason, waiting.message.clone()))
    };
    for (kind, containers, statuses) in lists {
        for c in containers {
            let failed = failure(&c.name, statuses);
            let mut own = failed.clone();
            if let Some((reason, message)) = &failed {
                for m in c.volume_mounts.iter().flatten() {
                    if let Some(reference) = volumes.get(m.name.as_str())
                        && names(message, reference)
                    {
                        volume_failures.insert(m.name.as_str(), reason.clone());
                        if c.image.as_deref().is_none_or(|i| !names(message, i)) {
                            own = None;
                        }
                    }
                }
            }
            if let Some(image) = c.image.as_deref() {
                out.push(Pull {
                    kind,
                    name: &c.name,
                    image,
                    failing: own.map(|(r, _)| r),
                });
            }
        }
    }
    let ephemeral_statuses = status.and_then(|s| s.ephemeral_container_statuses.as_ref());
    for c in spec.ephemeral_containers.iter().flatten() {
        if let Some(image) = c.image.as_deref() {
            out.push(Pull {
                kind: "ephemeralContainers",
                name: &c.name,
                image,
                failing: failure(&c.name, ephemeral_statuses).map(|(r, _)| r),
            });
        }
    }
    for (name, image) in volumes {
        out.push(Pull {
            kind: "volumes",
            name,
            image,
            failing: volume_failures.get(name).cloned(),
        });
    }
    out
}

/// Reads `pod`'s images under `target`, each with its original image and
/// pull-failure state. Images that do not parse, or live elsewhere, are left
/// out.
pub fn target_images(pod: &Pod, target: &MirrorTarget) -> PodImages {
    let note = |key: &str| -> BTreeMap<String, String> {
        pod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or_default()
    };
    let originals = note(ORIGINAL_IMAGES);
    let sources = note(SOURCES);
    let spec = pod.spec.as_ref();
    let mut images = Vec::new();
    for pull in pulls(pod) {
        let Ok(image) = Reference::parse(pull.image) else {
            continue;
        };
        if !target.contains(&image) {
            continue;
        }
        let slot = format!("{}/{}", pull.kind, pull.name);
        images.push(TargetImage {
            // The pinned source when recorded, else the original as written.
            original: sources
                .get(&slot)
                .or_else(|| originals.get(&slot))
                .and_then(|o| Reference::parse(o).ok()),
            slot,
            image,
            failing: pull.failing,
        });
    }
    PodImages {
        object: pod.object_ref(&()),
        pull: json!({"spec": {
            "imagePullSecrets": spec.and_then(|s| s.image_pull_secrets.clone()),
            "serviceAccountName": spec.and_then(|s| s.service_account_name.clone()),
        }}),
        images,
        identity: note(IDENTITY),
        controlled: has_controller(pod),
    }
}

/// Controllers that create a replacement as soon as one of their Pods is
/// evicted. A Pod another controller owns (a workflow engine's, a CI
/// system's) may not be replaced, so eviction leaves it alone.
const REPLACING_CONTROLLERS: [(&str, &str); 4] = [
    ("apps/v1", "ReplicaSet"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "DaemonSet"),
    ("batch/v1", "Job"),
];

/// Whether `pod`'s controller (its owner reference with `controller: true`)
/// is a ReplicaSet, StatefulSet, DaemonSet or Job.
pub fn has_controller(pod: &Pod) -> bool {
    controller(pod).is_some_and(|o| {
        REPLACING_CONTROLLERS
            .iter()
            .any(|(v, k)| o.api_version == *v && o.kind == *k)
    })
}

/// `pod`'s owner reference with `controller: true`.
pub fn controller(pod: &Pod) -> Option<&OwnerReference> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
}

/// The Pod condition the API server adds to a Pod it evicts.
pub const DISRUPTION_TARGET: &str = "DisruptionTarget";

/// Whether `job` lets one of its Pods be evicted without counting it: the
/// Job controller counts an evicted Pod as failed (toward `backoffLimit`,
/// failing the Job once it is used up) unless the first `podFailurePolicy`
/// rule that matches it is `Ignore`. The rules are taken in order, as the
/// controller takes them; an exit code or another condition cannot be
/// known before the eviction, so any rule that counts or fails a Pod ahead
/// of an `Ignore` on `DisruptionTarget` makes the eviction unsafe.
pub fn ignores_disruption(job: &Job) -> bool {
    let rules = job
        .spec
        .as_ref()
        .and_then(|s| s.pod_failure_policy.as_ref())
        .map(|p| p.rules.as_slice())
        .unwrap_or_default();
    for rule in rules {
        let disruption = rule
            .on_pod_conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == DISRUPTION_TARGET && matches!(c.status.as_str(), "True" | ""));
        if disruption || rule.action != "Ignore" {
            return disruption && rule.action == "Ignore";
        }
    }
    false
}

/// Whether `a` and `b` name one manifest by digest: registry, repository
/// and a digest both carry. References without a digest never match, as
/// nothing says which content they named.
pub fn same_pinned(a: &Reference, b: &Reference) -> bool {
    a.digest().is_some()
        && a.digest() == b.digest()
        && a.repository() == b.repository()
        && a.registry() == b.registry()
}

/// Whether `pod` still waits with a pull failure on `image` (a container
/// or image volume whose spec names that manifest: registry, repository and
/// digest). A debugging (ephemeral) container's failure does not count: the
/// Pod runs without it.
pub fn waits_on(pod: &Pod, image: &Reference) -> bool {
    pulls(pod).iter().any(|p| {
        p.failing.is_some()
            && p.kind != "ephemeralContainers"
            && Reference::parse(p.image).is_ok_and(|r| same_pinned(&r, image))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn owned_by(api_version: &str, kind: &str, controller: bool) -> Pod {
        pod(json!({"metadata": {"name": "p", "ownerReferences": [{
            "apiVersion": api_version, "kind": kind, "name": "o",
            "uid": "00000000-0000-4000-8000-000000000001", "controller": controller
        }]}}))
    }

    #[test]
    fn only_controllers_that_replace_their_pods_count() {
        for (v, k) in REPLACING_CONTROLLERS {
            assert!(has_controller(&owned_by(v, k, true)), "{k}");
            assert!(
                !has_controller(&owned_by(v, k, false)),
                "{k}, not controller"
            );
        }
        // A workflow step and a pipeline task are not recreated when evicted.
        assert!(!has_controller(&owned_by(
            "argoproj.io/v1alpha1",
            "Workflow",
            true
        )));
        assert!(!has_controller(&owned_by("tekton.dev/v1", "TaskRun", true)));
        assert!(!has_controller(&pod(json!({"metadata": {"name": "bare"}}))));
    }

    fn job(rules: Value) -> Job {
        serde_json::from_value(json!({
            "metadata": {"name": "j"},
            "spec": {"template": {}, "podFailurePolicy": {"rules": rules}}
        }))
        .unwrap()
    }

    #[test]
    fn a_job_lets_its_pod_be_evicted_only_when_an_ignore_on_disruption_comes_first() {
        let ignore = json!({"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]});
        let fail_on = |codes: Value| json!({"action": "FailJob", "onExitCodes": {"operator": "In", "values": codes}});
        let safe = [
            json!([ignore]),
            // Another Ignore first changes nothing.
            json!([{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [3]}}, ignore]),
            json!([ignore, fail_on(json!([42]))]),
        ];
        for rules in safe {
            assert!(ignores_disruption(&job(rules.clone())), "{rules}");
        }
        let unsafe_ = [
            json!([]),
            // Counted, or failed, before the Ignore is reached.
            json!([fail_on(json!([42])), ignore]),
            json!([{"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}, ignore]),
            json!([{"action": "FailJob", "onPodConditions": [{"type": "ConfigIssue", "status": "True"}]}, ignore]),
            // Ignored only when the condition is False: an evicted Pod's is True.
            json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}]),
        ];
        for rules in unsafe_ {
            assert!(!ignores_disruption(&job(rules.clone())), "{rules}");
        }
        let none: Job =
            serde_json::from_value(json!({"metadata": {"name": "j"}, "spec": {"template": {}}}))
                .unwrap();
        assert!(!ignores_disruption(&none), "no podFailurePolicy");
    }

    #[test]
    fn references_without_a_digest_never_name_the_same_manifest() {
        let d = format!("sha256:{}", "b".repeat(64));
        let r = |s: &str| Reference::parse(s).unwrap();
        let pinned = r(&format!("mirror.example/m/app:v1@{d}"));
        assert!(same_pinned(
            &pinned,
            &r(&format!("mirror.example/m/app@{d}"))
        ));
        assert!(!same_pinned(
            &pinned,
            &r(&format!("mirror.example/m/other@{d}"))
        ));
        // Two tag-only references of one repository, even one tag: what
        // each named is unknown.
        let v1 = r("mirror.example/m/app:v1");
        assert!(!same_pinned(&v1, &r("mirror.example/m/app:v2")));
        assert!(!same_pinned(&v1, &v1));
    }

    #[test]
    fn finds_failing_target_images_with_their_originals() {
        let target = MirrorTarget::parse("mirror.example/m").unwrap();
        let d = format!("sha256:{}", "a".repeat(64));
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "annotations": {
                ORIGINAL_IMAGES: serde_json::to_string(&json!({
                    "containers/app": "docker.io/team/app:v1",
                    "initContainers/init": "busybox"
                })).unwrap()
            }},
            "spec": {
                "initContainers": [{"name": "init", "image": format!("mirror.example/m/docker.io/library/busybox:latest@{d}")}],
                "containers": [
                    {"name": "app", "image": format!("mirror.example/m/docker.io/team/app:v1@{d}")},
                    {"name": "side", "image": "docker.io/library/nginx:1"},
                    {"name": "bad", "image": "Not A Reference"}
                ],
                "serviceAccountName": "builder",
                "imagePullSecrets": [{"name": "regcred"}]
            },
            "status": {
                "initContainerStatuses": [{"name": "init", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "state": {"waiting": {"reason": "PodInitializing"}}}],
                "containerStatuses": [{"name": "app", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]
            }
        }));
        let got = target_images(&p, &target);
        assert_eq!(got.key(), "ns/p");
        assert_eq!(got.object.uid.as_deref(), Some("u1"));
        assert_eq!(got.pull["spec"]["serviceAccountName"], "builder");
        assert_eq!(got.pull["spec"]["imagePullSecrets"][0]["name"], "regcred");
        assert_eq!(got.images.len(), 2, "{:?}", got.images);
        let init = &got.images[0];
        assert_eq!(init.slot, "initContainers/init");
        assert_eq!(init.failing, None, "PodInitializing is not a pull failure");
        assert_eq!(
            init.original.as_ref().unwrap().to_string(),
            "docker.io/library/busybox:latest"
        );
        let app = &got.images[1];
        assert_eq!(app.slot, "containers/app");
        assert_eq!(app.failing.as_deref(), Some("ImagePullBackOff"));
        assert_eq!(app.image.digest().unwrap().as_str(), d);
        assert_eq!(
            app.original.as_ref().unwrap().to_string(),
            "docker.io/team/app:v1"
        );
    }

    #[test]
    fn an_image_volumes_pull_failure_is_the_volumes_not_the_containers() {
        let target = MirrorTarget::parse("mirror.example/m").unwrap();
        let d = format!("sha256:{}", "b".repeat(64));
        let app = format!("mirror.example/m/docker.io/team/app:v1@{d}");
        let model = format!("mirror.example/m/ghcr.io/o/model:v1@{d}");
        let status = |name: &str, reason: &str, message: &str| {
            json!({"name": name, "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}})
        };
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "annotations": {
                SOURCES: serde_json::to_string(&json!({"volumes/model": "ghcr.io/o/model:v1"})).unwrap()
            }},
            "spec": {
                "containers": [
                    {"name": "app", "image": app, "volumeMounts": [{"name": "model", "mountPath": "/m"}]},
                    {"name": "other", "image": app}
                ],
                "volumes": [{"name": "model", "image": {"reference": model}}, {"name": "tmp", "emptyDir": {}}]
            },
            "status": {"containerStatuses": [
                status("app", "ErrImagePull", &format!("Failed to pull image \"{model}\": not found")),
                status("other", "ImagePullBackOff", &format!("Back-off pulling image \"{app}\""))
            ]}
        }));
        let got = target_images(&p, &target);
        let failing: Vec<(&str, Option<&str>)> = got
            .images
            .iter()
            .map(|i| (i.slot.as_str(), i.failing.as_deref()))
            .collect();
        assert_eq!(
            failing,
            [
                ("containers/app", None),
                ("containers/other", Some("ImagePullBackOff")),
                ("volumes/model", Some("ErrImagePull")),
            ]
        );
        assert_eq!(
            got.images[2].original.as_ref().unwrap().to_string(),
            "ghcr.io/o/model:v1"
        );
        let model = Reference::parse(&model).unwrap();
        assert!(waits_on(&p, &model));
    }

    #[test]
    fn a_pod_without_status_or_annotations_is_fine() {
        let target = MirrorTarget::parse("mirror.example").unwrap();
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "a", "image": "mirror.example/docker.io/library/nginx:1"}]}
        }));
        let got = target_images(&p, &target);
        assert_eq!(got.images.len(), 1);
        assert_eq!(got.images[0].failing, None);
        assert_eq!(got.images[0].original, None);
    }
}
