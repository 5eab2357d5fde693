//! The leader's Pod index: for each Pod with images under the target, only
//! what recovery needs, in a compact form (docs/benchmarks.md, "The Pod
//! index"). A cluster's Pods share few images, container names and pull
//! secret lists, so those are interned; a Pod costs its key, its UID and
//! one small record per target image.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use serde_json::{Value, json};

use super::pods::{PULL_FAILURE_REASONS, PodImages, TargetImage};
use crate::reference::Reference;

/// Shares equal values among Pods. Values no Pod holds any more are
/// dropped once the interner has doubled since its last sweep.
pub(super) struct Interner<T: ?Sized + Eq + Hash> {
    set: HashSet<Arc<T>>,
    swept_at: usize,
}

impl<T: ?Sized + Eq + Hash> Default for Interner<T> {
    fn default() -> Self {
        Self {
            set: HashSet::new(),
            swept_at: 0,
        }
    }
}

impl<T: ?Sized + Eq + Hash> Interner<T> {
    pub(super) fn get<Q>(&mut self, value: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Eq + Hash,
    {
        if let Some(v) = self.set.get(value) {
            return v.clone();
        }
        if self.set.len() >= 2 * self.swept_at.max(64) {
            self.set.retain(|v| Arc::strong_count(v) > 1);
            self.swept_at = self.set.len();
        }
        let v = make(value);
        self.set.insert(v.clone());
        v
    }

    pub(super) fn clear(&mut self) {
        self.set.clear();
        self.swept_at = 0;
    }
}

/// What a Pod names to pull with: its `imagePullSecrets` and ServiceAccount.
#[derive(PartialEq, Eq, Hash)]
pub(super) struct PullRefs {
    secrets: Box<[Box<str>]>,
    service_account: Option<Box<str>>,
}

impl PullRefs {
    pub(super) fn of(pull: &Value) -> Self {
        let secrets = pull
            .pointer("/spec/imagePullSecrets")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|r| r.get("name").and_then(Value::as_str))
            .map(Box::from)
            .collect();
        let service_account = pull
            .pointer("/spec/serviceAccountName")
            .and_then(Value::as_str)
            .map(Box::from);
        Self {
            secrets,
            service_account,
        }
    }

    pub(super) fn to_value(&self) -> Value {
        let secrets: Vec<Value> = self.secrets.iter().map(|n| json!({"name": n})).collect();
        json!({"spec": {
            "imagePullSecrets": (!secrets.is_empty()).then_some(secrets),
            "serviceAccountName": self.service_account,
        }})
    }
}

/// One target image of an indexed Pod.
struct Slot {
    slot: Arc<str>,
    image: Arc<Reference>,
    original: Option<Arc<Reference>>,
    /// An index into [`PULL_FAILURE_REASONS`].
    failing: Option<u8>,
}

impl Slot {
    fn failing(&self) -> Option<&'static str> {
        self.failing.map(|i| PULL_FAILURE_REASONS[usize::from(i)])
    }
}

/// A Pod's UID: the API server's are UUIDs, kept as their 16 bytes.
enum Uid {
    Uuid([u8; 16]),
    Other(Box<str>),
    None,
}

impl Uid {
    fn of(uid: Option<&str>) -> Self {
        let Some(uid) = uid else { return Self::None };
        let b = uid.as_bytes();
        let canonical = b.len() == 36
            && b.iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
            });
        let hex: String = uid.chars().filter(|c| *c != '-').collect();
        match u128::from_str_radix(&hex, 16) {
            Ok(n) if canonical => Self::Uuid(n.to_be_bytes()),
            _ => Self::Other(uid.into()),
        }
    }

    fn as_string(&self) -> Option<String> {
        match self {
            Self::Uuid(b) => {
                let h = format!("{:032x}", u128::from_be_bytes(*b));
                Some(format!(
                    "{}-{}-{}-{}-{}",
                    &h[..8],
                    &h[8..12],
                    &h[12..16],
                    &h[16..20],
                    &h[20..]
                ))
            }
            Self::Other(s) => Some(s.to_string()),
            Self::None => None,
        }
    }
}

struct Entry {
    uid: Uid,
    pull: Arc<PullRefs>,
    slots: Box<[Slot]>,
    /// The list generation that last delivered this Pod.
    listed: u32,
}

/// Pods by `namespace/name`.
#[derive(Default)]
pub struct PodIndex {
    pods: HashMap<Box<str>, Entry>,
    refs: Interner<Reference>,
    names: Interner<str>,
    pulls: Interner<PullRefs>,
    generation: u32,
}

/// What [`PodIndex::insert`] replaced: each slot's pull failure.
pub type Previous = Vec<(Arc<str>, Option<&'static str>)>;

impl PodIndex {
    /// Pods indexed.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no Pod is indexed.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Starts a new list: Pods it delivers are marked with the generation
    /// returned, for [`PodIndex::retain_listed`].
    pub fn next_generation(&mut self) -> u32 {
        self.generation = self.generation.wrapping_add(1);
        self.generation
    }

    /// Indexes `pod` (or forgets it when it has no target image), marked as
    /// delivered by list `generation` when given. Returns the pull failures
    /// of the entry it replaced.
    pub fn insert(&mut self, pod: &PodImages, generation: Option<u32>) -> Option<Previous> {
        let key = pod.key();
        if pod.images.is_empty() {
            return self.pods.remove(key.as_str()).map(previous);
        }
        let slots = pod
            .images
            .iter()
            .map(|i| Slot {
                slot: self.names.get(i.slot.as_str(), |s: &str| Arc::from(s)),
                image: self.refs.get(&i.image, |r| Arc::new(r.clone())),
                original: i
                    .original
                    .as_ref()
                    .map(|o| self.refs.get(o, |r| Arc::new(r.clone()))),
                failing: i.failing.as_deref().and_then(|f| {
                    PULL_FAILURE_REASONS
                        .iter()
                        .position(|r| *r == f)
                        .and_then(|p| u8::try_from(p).ok())
                }),
            })
            .collect();
        let pull = PullRefs::of(&pod.pull);
        let listed = match generation {
            Some(g) => g,
            None => self.pods.get(key.as_str()).map_or(0, |e| e.listed),
        };
        let entry = Entry {
            uid: Uid::of(pod.object.uid.as_deref()),
            pull: self.pulls.get(&pull, |_| Arc::new(pull_clone(&pull))),
            slots,
            listed,
        };
        self.pods.insert(key.into_boxed_str(), entry).map(previous)
    }

    /// Forgets the Pod `key`.
    pub fn remove(&mut self, key: &str) {
        self.pods.remove(key);
    }

    /// Keeps the Pods `keep` accepts.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.pods.retain(|k, _| keep(k));
    }

    /// After list `generation` of `namespace` (or of every namespace, with
    /// `None`) ended, forgets the Pods in it that the list did not deliver:
    /// they were deleted while the watch was down.
    pub fn retain_listed(&mut self, namespace: Option<&str>, generation: u32) -> Vec<String> {
        let mut gone = Vec::new();
        self.pods.retain(|k, e| {
            let in_scope = namespace
                .is_none_or(|ns| k.strip_prefix(ns).is_some_and(|rest| rest.starts_with('/')));
            let keep = !in_scope || e.listed == generation;
            if !keep {
                gone.push(k.to_string());
            }
            keep
        });
        gone
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.pods.clear();
        self.refs.clear();
        self.names.clear();
        self.pulls.clear();
    }

    /// Pods whose target images `matches` accepts, each with the first such
    /// image.
    pub fn find(
        &self,
        mut matches: impl FnMut(&Reference, bool) -> bool,
        limit: usize,
    ) -> Vec<(PodImages, TargetImage)> {
        let mut out = Vec::new();
        for (key, e) in &self.pods {
            if out.len() >= limit {
                break;
            }
            if let Some(s) = e
                .slots
                .iter()
                .find(|s| matches(&s.image, s.failing.is_some()))
            {
                out.push((pod_images(key, e), target_image(s)));
            }
        }
        out
    }
}

pub(super) fn pull_clone(p: &PullRefs) -> PullRefs {
    PullRefs {
        secrets: p.secrets.clone(),
        service_account: p.service_account.clone(),
    }
}

fn previous(e: Entry) -> Previous {
    e.slots
        .iter()
        .map(|s| (s.slot.clone(), s.failing()))
        .collect()
}

fn target_image(s: &Slot) -> TargetImage {
    TargetImage {
        slot: s.slot.to_string(),
        image: (*s.image).clone(),
        original: s.original.as_deref().cloned(),
        failing: s.failing().map(str::to_owned),
    }
}

fn pod_images(key: &str, e: &Entry) -> PodImages {
    let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
    PodImages {
        object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: e.uid.as_string(),
            ..Default::default()
        },
        pull: e.pull.to_value(),
        images: e.slots.iter().map(target_image).collect(),
        identity: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::MirrorTarget;
    use k8s_openapi::api::core::v1::Pod;

    fn pod(ns: &str, name: &str, reason: Option<&str>) -> PodImages {
        let d = format!("sha256:{}", "a".repeat(64));
        let mut status = json!({});
        if let Some(r) = reason {
            status = json!({"containerStatuses": [{"name": "app", "image": "x", "imageID": "",
                "ready": false, "restartCount": 0, "state": {"waiting": {"reason": r}}}]});
        }
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
                "annotations": {"pinswap.dev/original-images": r#"{"containers/app":"docker.io/team/app:v1"}"#}},
            "spec": {"containers": [{"name": "app", "image": format!("mirror.example/docker.io/team/app:v1@{d}")}],
                "serviceAccountName": "builder", "imagePullSecrets": [{"name": "regcred"}]},
            "status": status,
        }))
        .unwrap();
        super::super::pods::target_images(&p, &MirrorTarget::parse("mirror.example").unwrap())
    }

    #[test]
    fn gives_back_what_recovery_reads() {
        let mut idx = PodIndex::default();
        let p = pod("ns", "p", Some("ImagePullBackOff"));
        assert!(idx.insert(&p, None).is_none());
        let found = idx.find(|_, failing| failing, 10);
        assert_eq!(found.len(), 1);
        let (back, img) = &found[0];
        assert_eq!(back.key(), "ns/p");
        assert_eq!(back.object.uid.as_deref(), Some("uid-p"));
        assert_eq!(back.object.kind.as_deref(), Some("Pod"));
        assert_eq!(back.pull, p.pull);
        assert_eq!(img, &p.images[0]);
        let before = idx.insert(&pod("ns", "p", None), None).unwrap();
        assert_eq!(
            before,
            vec![(Arc::from("containers/app"), Some("ImagePullBackOff"))]
        );
        assert!(idx.find(|_, failing| failing, 10).is_empty());
    }

    #[test]
    fn uids_round_trip() {
        for uid in [
            "0b9f6c3e-5d1a-4c8e-9f2b-7a6d5e4c3b2a",
            "00000000-0000-0000-0000-000000000042",
            "uid-p",
            "0B9F6C3E-5D1A-4C8E-9F2B-7A6D5E4C3B2A",
            "0b9f6c3e5d1a4c8e9f2b7a6d5e4c3b2a",
            "0b9f6c3e-5d1a-4c8e-9f2b-7a6d5e4c3b2+",
            "",
        ] {
            assert_eq!(Uid::of(Some(uid)).as_string().as_deref(), Some(uid));
        }
        assert!(matches!(
            Uid::of(Some("0b9f6c3e-5d1a-4c8e-9f2b-7a6d5e4c3b2a")),
            Uid::Uuid(_)
        ));
        assert_eq!(Uid::of(None).as_string(), None);
    }

    #[test]
    fn pods_share_images_names_and_pull_secrets() {
        let mut idx = PodIndex::default();
        for i in 0..1000 {
            idx.insert(&pod("ns", &format!("p{i}"), None), None);
        }
        assert_eq!(idx.len(), 1000);
        assert_eq!(idx.refs.set.len(), 2, "the image and its original");
        assert_eq!(idx.names.set.len(), 1);
        assert_eq!(idx.pulls.set.len(), 1);
    }

    #[test]
    fn interned_values_no_pod_holds_are_swept() {
        let mut idx = PodIndex::default();
        let d = |i: usize| format!("sha256:{i:064x}");
        for i in 0..10_000 {
            let mut p = pod("ns", "same", None);
            p.images[0].image =
                Reference::parse(&format!("mirror.example/docker.io/team/app@{}", d(i))).unwrap();
            idx.insert(&p, None);
        }
        assert_eq!(idx.len(), 1);
        assert!(idx.refs.set.len() <= 200, "{}", idx.refs.set.len());
    }

    #[test]
    fn a_list_forgets_pods_it_did_not_deliver_in_its_namespace_only() {
        let mut idx = PodIndex::default();
        for (ns, name) in [
            ("a", "kept"),
            ("a", "gone"),
            ("ab", "other"),
            ("b", "other"),
        ] {
            idx.insert(&pod(ns, name, None), None);
        }
        let g = idx.next_generation();
        idx.insert(&pod("a", "kept", None), Some(g));
        assert_eq!(idx.retain_listed(Some("a"), g), vec!["a/gone".to_string()]);
        assert_eq!(idx.len(), 3);
        let g = idx.next_generation();
        idx.insert(&pod("b", "other", None), Some(g));
        let mut gone = idx.retain_listed(None, g);
        gone.sort();
        assert_eq!(gone, vec!["a/kept".to_string(), "ab/other".to_string()]);
    }
}
