//! A Pod's image slots and the JSONPatch that rewrites them. Works on the
//! Pod as JSON, so fields this version of k8s-openapi does not know survive
//! untouched (the API server applies our patch to its own object).

use std::collections::BTreeMap;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation};
use serde_json::Value;

use super::notes::{DECISIONS, IDENTITY, ORIGINAL_IMAGES, OURS, SOURCES};

/// The per-slot notes a patch writes into annotations.
pub struct Notes<'a> {
    /// Slot key → reason ([`DECISIONS`]).
    pub decisions: &'a BTreeMap<String, String>,
    /// Slot key → identity finding ([`IDENTITY`]); written when non-empty.
    pub identity: &'a BTreeMap<String, String>,
    /// Slot key → pinned source ([`SOURCES`]), for rewritten slots.
    pub sources: &'a BTreeMap<String, String>,
}

/// The decision of a slot already under the target (idempotence).
pub const ALREADY: &str = "unchanged: already under the target";

/// The container lists that hold images, in Pod spec order.
pub const SLOT_KINDS: [&str; 3] = ["initContainers", "containers", "ephemeralContainers"];

/// The list whose image volumes (`volumes[].image.reference`, KEP-4639)
/// are slots too, after the containers.
pub const VOLUMES: &str = "volumes";

/// One image in a Pod: a container's, or an image volume's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// `containers`, `initContainers`, `ephemeralContainers` or `volumes`.
    pub kind: &'static str,
    /// Index in that list.
    pub index: usize,
    /// The container's name.
    pub name: String,
    /// The image as written in the Pod.
    pub image: String,
    /// The container's `imagePullPolicy` (an image volume's
    /// `image.pullPolicy`), when written.
    pub pull_policy: Option<String>,
    /// The container object, for filters; for an image volume
    /// `{name, image, imagePullPolicy, volume}`, `volume` the volume object.
    pub container: Value,
    /// The key used in the annotations: `kind/name`, or `kind[index]` when
    /// the name is missing or shared within its list (so two slots never
    /// share a note).
    pub key: String,
}

impl Slot {
    /// The key used in the annotations (see [`Slot::key`] the field).
    pub fn key(&self) -> String {
        self.key.clone()
    }

    /// Where the image is under the spec: `containers/0/image`, or
    /// `volumes/0/image/reference`.
    pub fn image_path(&self) -> Vec<String> {
        let mut at = vec![self.kind.to_owned(), self.index.to_string(), "image".into()];
        if self.kind == VOLUMES {
            at.push("reference".into());
        }
        at
    }

    /// Whether this is an image volume's slot.
    pub fn is_volume(&self) -> bool {
        self.kind == VOLUMES
    }
}

/// Every image slot of a Pod (or pod template) `spec`, in order. Containers
/// without an `image` string are skipped.
pub fn slots(spec: &Value) -> Vec<Slot> {
    slots_for(spec, true)
}

/// [`slots`], with each [`Slot::container`] copied only when `containers`
/// (filters read them) and `null` otherwise.
pub fn slots_for(spec: &Value, containers: bool) -> Vec<Slot> {
    let mut out = Vec::new();
    fn name(c: &Value) -> &str {
        c.get("name").and_then(Value::as_str).unwrap_or_default()
    }
    for kind in SLOT_KINDS.into_iter().chain([VOLUMES]) {
        let Some(list) = spec.get(kind).and_then(Value::as_array) else {
            continue;
        };
        let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for c in list {
            *seen.entry(name(c)).or_default() += 1;
        }
        for (index, c) in list.iter().enumerate() {
            let (image, pull_policy) = match kind {
                VOLUMES => {
                    let v = c.get("image");
                    (
                        v.and_then(|v| v.get("reference")),
                        v.and_then(|v| v.get("pullPolicy")),
                    )
                }
                _ => (c.get("image"), c.get("imagePullPolicy")),
            };
            if let Some(image) = image.and_then(Value::as_str) {
                let name = name(c);
                let key = if name.is_empty() || seen[name] > 1 {
                    format!("{kind}[{index}]")
                } else {
                    format!("{kind}/{name}")
                };
                out.push(Slot {
                    kind,
                    index,
                    name: name.to_owned(),
                    image: image.to_owned(),
                    pull_policy: pull_policy.and_then(Value::as_str).map(str::to_owned),
                    container: match (containers, kind) {
                        (false, _) => Value::Null,
                        // Filters written for containers (`container.image`)
                        // apply to image volumes as they are.
                        (true, VOLUMES) => serde_json::json!({
                            "name": name,
                            "image": image,
                            "imagePullPolicy": pull_policy,
                            "volume": c,
                        }),
                        (true, _) => c.clone(),
                    },
                    key,
                });
            }
        }
    }
    out
}

/// The JSONPatch for a Pod at `spec_path` (e.g. `["spec"]`): a `replace` per
/// rewritten slot, and the two annotations merged with any earlier ones (a
/// reinvoked webhook keeps the first invocation's originals).
///
/// `rewrites` maps slot → new image; `notes` holds the reasons and identity
/// findings by slot key. Without `annotate` only the image ops are written
/// (a subresource update, where the API server keeps no metadata changes).
pub fn patch(
    pod: &Value,
    spec_path: &[&str],
    rewrites: &[(&Slot, String)],
    notes: &Notes<'_>,
    annotate: bool,
) -> Patch {
    let decisions = notes.decisions;
    let mut ops = Vec::new();
    for (slot, image) in rewrites {
        let mut tokens: Vec<String> = spec_path.iter().map(|s| s.to_string()).collect();
        tokens.extend(slot.image_path());
        ops.push(PatchOperation::Replace(ReplaceOperation {
            path: PointerBuf::from_tokens(tokens),
            value: Value::String(image.clone()),
        }));
    }
    if !annotate {
        return Patch(ops);
    }
    let existing = pod.pointer("/metadata/annotations");
    let read = |key: &str| -> BTreeMap<String, String> {
        existing
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default()
    };
    // A slot rewritten now had this image as its source, whatever an
    // earlier entry (or the Pod's author) wrote; a slot already under the
    // target is not rewritten, so reinvocation keeps the first original.
    let mut originals = read(ORIGINAL_IMAGES);
    for (slot, _) in rewrites {
        originals.insert(slot.key(), slot.image.clone());
    }
    let mut all_decisions = read(DECISIONS);
    for (k, v) in decisions {
        // On reinvocation a rewritten slot is "already under the target";
        // the first invocation's reason is the one worth keeping.
        if v == ALREADY && all_decisions.contains_key(k) {
            continue;
        }
        all_decisions.insert(k.clone(), v.clone());
    }
    let notes_sources = notes.sources;
    let mut identity = read(IDENTITY);
    identity.extend(notes.identity.iter().map(|(k, v)| (k.clone(), v.clone())));
    let mut notes = vec![(DECISIONS, all_decisions)];
    if !originals.is_empty() {
        notes.push((ORIGINAL_IMAGES, originals));
    }
    if !identity.is_empty() {
        notes.push((IDENTITY, identity));
    }
    let mut sources = read(SOURCES);
    sources.extend(notes_sources.iter().map(|(k, v)| (k.clone(), v.clone())));
    if !sources.is_empty() {
        notes.push((SOURCES, sources));
    }
    // The Pod's other annotations count toward the same limit.
    let others = existing.and_then(Value::as_object).map_or(0, |a| {
        super::notes::size(
            a.iter()
                .filter(|(k, _)| !OURS.contains(&k.as_str()))
                .map(|(k, v)| (k.as_str(), v.as_str().unwrap_or_default())),
        )
    });
    let notes = super::notes::fit(&notes, others);
    if notes.is_empty() {
        return Patch(ops);
    }
    if existing.is_some_and(Value::is_object) {
        for (key, value) in notes {
            ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["metadata", "annotations", key]),
                value: Value::String(value),
            }));
        }
    } else {
        let obj: serde_json::Map<String, Value> = notes
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Value::String(v)))
            .collect();
        if pod.get("metadata").is_none() {
            ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["metadata"]),
                value: serde_json::json!({}),
            }));
        }
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["metadata", "annotations"]),
            value: Value::Object(obj),
        }));
    }
    Patch(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {
                "initContainers": [{"name": "init", "image": "busybox:1.36"}],
                "containers": [{"name": "web", "image": "nginx:1.25"}, {"name": "side", "image": "nginx:1.25"}],
                "ephemeralContainers": [{"name": "debug", "image": "alpine"}]
            }
        })
    }

    #[test]
    fn slots_in_order() {
        let p = pod();
        let s = slots(&p["spec"]);
        let keys: Vec<String> = s.iter().map(Slot::key).collect();
        assert_eq!(
            keys,
            [
                "initContainers/init",
                "containers/web",
                "containers/side",
                "ephemeralContainers/debug"
            ]
        );
        assert_eq!(s[2].index, 1);
    }

    #[test]
    fn slots_without_a_name_of_their_own_are_keyed_by_index() {
        let spec = json!({
            "containers": [
                {"image": "a"}, {"name": "x", "image": "b"}, {"name": "x", "image": "c"},
                {"name": "y", "image": "d"}
            ],
            "initContainers": [{"name": "y", "image": "e"}]
        });
        let keys: Vec<String> = slots(&spec).iter().map(Slot::key).collect();
        assert_eq!(
            keys,
            [
                "initContainers/y",
                "containers[0]",
                "containers[1]",
                "containers[2]",
                "containers/y"
            ]
        );
    }

    #[test]
    fn image_volumes_are_slots_and_their_reference_is_patched() {
        let mut p = json!({
            "metadata": {"name": "p"},
            "spec": {
                "containers": [{"name": "app", "image": "nginx:1.25"}],
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "c"}},
                    {"name": "model", "image": {"reference": "ghcr.io/o/model:v1", "pullPolicy": "Never"}},
                    {"name": "bad", "image": {"pullPolicy": "Always"}}
                ]
            }
        });
        let s = slots(&p["spec"]);
        let keys: Vec<String> = s.iter().map(Slot::key).collect();
        assert_eq!(keys, ["containers/app", "volumes/model"]);
        let v = &s[1];
        assert!(v.is_volume());
        assert_eq!(
            (v.index, v.image.as_str(), v.pull_policy.as_deref()),
            (1, "ghcr.io/o/model:v1", Some("Never"))
        );
        assert_eq!(
            v.container["image"], "ghcr.io/o/model:v1",
            "filters see it as a container"
        );
        assert_eq!(v.container["volume"]["name"], "model");
        let none = BTreeMap::new();
        let notes = Notes {
            decisions: &none,
            identity: &none,
            sources: &none,
        };
        let ops = patch(
            &p,
            &["spec"],
            &[(v, "m/model@sha256:aa".into())],
            &notes,
            false,
        );
        json_patch::patch(&mut p, &ops).unwrap();
        assert_eq!(
            p["spec"]["volumes"][1]["image"]["reference"],
            "m/model@sha256:aa"
        );
        assert_eq!(p["spec"]["volumes"][1]["image"]["pullPolicy"], "Never");
        assert_eq!(p["spec"]["containers"][0]["image"], "nginx:1.25");
    }

    #[test]
    fn patch_applies_and_merges_annotations() {
        let mut p = pod();
        let s = slots(&p["spec"]);
        let mut decisions = BTreeMap::new();
        decisions.insert(s[1].key(), "rewritten".to_owned());
        let none = BTreeMap::new();
        let notes = Notes {
            decisions: &decisions,
            identity: &none,
            sources: &none,
        };
        let ops = patch(
            &p,
            &["spec"],
            &[(&s[1], "m/x:1@sha256:aa".into())],
            &notes,
            true,
        );
        json_patch::patch(&mut p, &ops).unwrap();
        assert_eq!(p["spec"]["containers"][0]["image"], "m/x:1@sha256:aa");
        assert_eq!(p["spec"]["containers"][1]["image"], "nginx:1.25");
        let orig: BTreeMap<String, String> = serde_json::from_str(
            p["metadata"]["annotations"][ORIGINAL_IMAGES]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(orig["containers/web"], "nginx:1.25");

        // Reinvocation: the rewritten image is now the target's; the first
        // original stays, a new rewrite is added.
        let s = slots(&p["spec"]);
        let mut d2 = BTreeMap::new();
        d2.insert(s[2].key(), "rewritten".to_owned());
        let notes = Notes {
            decisions: &d2,
            identity: &none,
            sources: &none,
        };
        let ops = patch(
            &p,
            &["spec"],
            &[(&s[2], "m/x:1@sha256:aa".into())],
            &notes,
            true,
        );
        json_patch::patch(&mut p, &ops).unwrap();
        let orig: BTreeMap<String, String> = serde_json::from_str(
            p["metadata"]["annotations"][ORIGINAL_IMAGES]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(orig["containers/web"], "nginx:1.25");
        assert_eq!(orig["containers/side"], "nginx:1.25");
        let dec: BTreeMap<String, String> =
            serde_json::from_str(p["metadata"]["annotations"][DECISIONS].as_str().unwrap())
                .unwrap();
        assert_eq!(dec.len(), 2);
    }
}
