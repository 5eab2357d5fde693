//! `pinswap mutate`: the admission decision applied to manifest text
//! (GitOps). Multi-document YAML or JSON in; the same text out, with only
//! the image scalars of Pods and pod templates changed and pinswap's
//! annotations added or updated. Comments, key order, quoting, indentation
//! and line endings stay byte for byte (see `yaml::edit`).
//!
//! Kinds: Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet, Job,
//! ReplicationController, PodTemplate, CronJob, and the items of a `List`;
//! with `customResources.rewrite`, the image fields of the custom resources
//! it names, decided as a Pod's containers would be, their originals
//! recorded in the object's own annotations keyed by field.
//!
//! The annotations record only what stays true on a rerun (the original
//! image and the pinned source of each rewritten slot, identity findings),
//! so `mutate` on its own output changes no byte. Each run's reasons go to
//! the [`SlotReport`]s instead.

pub(crate) mod krm;
pub mod yaml;

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::admission::notes::{IDENTITY, ORIGINAL_IMAGES, SOURCES};
use crate::admission::{Admission, SlotDecision, SlotOutcome};
use crate::config::{ImageFields, is_parameter, pointer, shown, strip_scheme};
use yaml::YamlError;
use yaml::doc::{self, Document, Kind, Node};
use yaml::edit::{self, Edits, New};

/// Errors reading or rewriting one input; each names the document or place.
#[derive(Debug, thiserror::Error)]
pub enum MutateError {
    /// The input is not YAML/JSON.
    #[error("{0}")]
    Yaml(#[from] YamlError),
    /// The rewritten text would read back differently from the intended
    /// rewrite (something besides the images would change); the input is
    /// left as it was.
    #[error("document {document}: the rewrite does not read back as intended; left unchanged")]
    Verify {
        /// 1-based document number.
        document: usize,
    },
    /// A KRM `ResourceList` is malformed.
    #[error("{0}")]
    ResourceList(String),
}

/// What happened to one image, in a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Status {
    /// Rewritten to the target, pinned.
    Rewritten,
    /// Deliberately left alone (filter, allowlist, already under the target).
    Skipped,
    /// Not rewritten because it is not at the target.
    Unpinned,
    /// Not rewritten because of an error.
    Failed,
}

/// The object an image belongs to (a KRM `resourceRef`).
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRef {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`, when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl std::fmt::Display for ResourceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}/{ns}/{}", self.kind, self.name),
            None => write!(f, "{}/{}", self.kind, self.name),
        }
    }
}

/// One image slot: where it is, what it was and became, and why.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotReport {
    /// 1-based document number in its input.
    pub document: usize,
    /// Index of the object in its document's `items` (a `List` or
    /// `ResourceList`); `None` for the document itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item: Option<usize>,
    /// The object.
    pub resource: ResourceRef,
    /// The image field, e.g. `spec.template.spec.containers[0].image`.
    pub field: String,
    /// The image as written.
    pub image: String,
    /// The image written instead, when rewritten.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_image: Option<String>,
    /// The outcome.
    pub status: Status,
    /// Why, for this run.
    pub reason: String,
}

/// The rewritten text and one report per image slot.
#[derive(Debug)]
pub struct Mutated {
    /// The input with the edits made (equal to the input when nothing
    /// changed).
    pub text: String,
    /// Every image slot found, in input order.
    pub slots: Vec<SlotReport>,
}

/// How to decide.
#[derive(Debug, Clone)]
pub struct Options {
    /// Resolve and look at the target, but copy nothing.
    pub dry_run: bool,
    /// The namespace of objects that name none, as `kubectl apply` would
    /// put them: what `mirrorOnly` sees for their Pods.
    pub namespace: String,
    /// The custom resources whose image fields are rewritten too
    /// (`customResources.rewrite`); empty: none.
    pub resources: Vec<ImageFields>,
}

/// The namespace `kubectl apply` puts an object without one in, short of
/// `-n` or a kubeconfig context's namespace.
pub const DEFAULT_NAMESPACE: &str = "default";

impl Default for Options {
    fn default() -> Self {
        Self {
            dry_run: false,
            namespace: DEFAULT_NAMESPACE.to_owned(),
            resources: Vec::new(),
        }
    }
}

/// JSON pointers to the pod templates (`{metadata, spec}`) in an object of
/// `kind`, and the field path they are reported under; the Pod itself for
/// `Pod`.
fn template_paths(kind: &str) -> Option<(&'static str, &'static str)> {
    Some(match kind {
        "Pod" => ("", ""),
        "PodTemplate" => ("/template", "template."),
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "Job"
        | "ReplicationController" => ("/spec/template", "spec.template."),
        "CronJob" => (
            "/spec/jobTemplate/spec/template",
            "spec.jobTemplate.spec.template.",
        ),
        _ => return None,
    })
}

fn resource_ref(obj: &Value) -> ResourceRef {
    let s = |p: &str| obj.pointer(p).and_then(Value::as_str).map(str::to_owned);
    ResourceRef {
        api_version: s("/apiVersion").unwrap_or_default(),
        kind: s("/kind").unwrap_or_default(),
        name: s("/metadata/name")
            .or_else(|| s("/metadata/generateName"))
            .unwrap_or_default(),
        namespace: s("/metadata/namespace"),
    }
}

/// One pod template to decide.
struct Target<'a> {
    document: usize,
    item: Option<usize>,
    /// Pointer from the document root to the template.
    pointer: String,
    field: &'static str,
    template: &'a Node,
    obj: Value,
    /// What is decided: the template, or a custom resource's images as a
    /// Pod's containers.
    decided: Value,
    /// A custom resource's image fields, by container index.
    fields: Option<Vec<Field>>,
    decisions: Vec<SlotDecision>,
}

/// One image field of a custom resource.
struct Field {
    /// JSON pointer under the object.
    pointer: String,
    /// As reported and keyed in the annotations: `spec.steps[0].image`.
    shown: String,
    /// The scheme written before the reference (`docker://`), kept when
    /// it is rewritten.
    scheme: &'static str,
}

/// The custom resource `obj`'s image fields, when `resources` names its
/// kind: each field's pointer and report path, and the Pod template its
/// images are decided as.
fn custom_target(resources: &[ImageFields], obj: &Value) -> Option<(Vec<Field>, Value)> {
    let group = obj.get("apiVersion")?.as_str()?.split_once('/')?.0;
    let kind = obj.get("kind")?.as_str()?;
    let f = resources
        .iter()
        .find(|f| f.group == group && f.kind == kind)?;
    let mut fields = Vec::new();
    let mut containers = Vec::new();
    for p in f.paths() {
        for (loc, image) in p.locations(obj) {
            // A parameter is filled in by its controller: nothing to decide.
            if is_parameter(&image) {
                continue;
            }
            let bare = strip_scheme(&image);
            let scheme = ["oci://", "docker://"]
                .into_iter()
                .find(|s| image.len() - bare.len() == s.len() && image.starts_with(s))
                .unwrap_or("");
            let (pointer, shown) = (pointer(&loc), shown(&loc));
            if fields.iter().any(|f: &Field| f.pointer == pointer) {
                continue;
            }
            containers.push(
                serde_json::json!({"name": format!("image-{}", fields.len()), "image": bare}),
            );
            fields.push(Field {
                pointer,
                shown,
                scheme,
            });
        }
    }
    let mut spec = f.pull(obj);
    spec["containers"] = Value::Array(containers);
    let meta = obj.get("metadata").cloned().unwrap_or(Value::Null);
    let template = serde_json::json!({"metadata": {
        "name": meta.get("name"), "namespace": meta.get("namespace"), "labels": meta.get("labels"),
    }, "spec": spec});
    Some((fields, template))
}

/// The objects of a document: the root, or the items of a `List`.
fn objects<'a>(doc: &'a Document, out: &mut Vec<(usize, Option<usize>, String, &'a Node)>) {
    let root = &doc.root;
    if root.get("kind").and_then(Node::as_str) == Some("List") {
        if let Some(Node {
            kind: Kind::Seq { items, .. },
            ..
        }) = root.get("items")
        {
            for (i, item) in items.iter().enumerate() {
                out.push((doc.index, Some(i), format!("/items/{i}"), item));
            }
        }
        return;
    }
    out.push((doc.index, None, String::new(), root));
}

/// Rewrites every Pod and pod template in `input` (YAML, possibly several
/// `---` documents, or JSON), mirroring as configured. With
/// `copyPolicy: delayed` (or a copy still running at the deadline) it waits
/// for the copies it started and then rewrites what is at the target.
///
/// # Errors
/// [`MutateError::Yaml`] naming the document, line and column;
/// [`MutateError::Verify`] when an edit would change more than intended.
pub async fn mutate(adm: &Admission, input: &str, opts: Options) -> Result<Mutated, MutateError> {
    let docs = doc::parse(input)?;
    let mut objs = Vec::new();
    for d in &docs {
        objects(d, &mut objs);
    }
    rewrite(adm, input, &docs, objs, opts).await
}

/// Decides and edits the templates of `objs` (document, item, pointer of
/// the object from its document root, node) in `src`.
async fn rewrite(
    adm: &Admission,
    src: &str,
    docs: &[Document],
    objs: Vec<(usize, Option<usize>, String, &Node)>,
    opts: Options,
) -> Result<Mutated, MutateError> {
    let mut targets = Vec::new();
    for (document, item, base, node) in objs {
        let obj = node.to_json();
        if let Some((fields, template)) = custom_target(&opts.resources, &obj) {
            targets.push(Target {
                document,
                item,
                pointer: base,
                field: "",
                template: node,
                obj,
                decided: template,
                fields: Some(fields),
                decisions: Vec::new(),
            });
            continue;
        }
        let Some((path, field)) = obj
            .get("kind")
            .and_then(Value::as_str)
            .and_then(template_paths)
        else {
            continue;
        };
        let Some(template) = node.pointer(path) else {
            continue;
        };
        targets.push(Target {
            document,
            item,
            pointer: format!("{base}{path}"),
            field,
            template,
            obj,
            decided: template.to_json(),
            fields: None,
            decisions: Vec::new(),
        });
    }
    for t in &mut targets {
        let obj = match t.fields {
            // Filters see a Pod, as for a workload's template.
            Some(_) => &t.decided,
            None => &t.obj,
        };
        t.decisions = adm
            .decide_template(obj, &t.decided, &opts.namespace, opts.dry_run)
            .await;
    }
    let kept = |t: &Target<'_>| {
        t.decisions
            .iter()
            .any(|d| matches!(d.outcome, SlotOutcome::Keep(_)))
    };
    // A command has no background: wait for the copies this run started
    // (those of templates mirrored only too), then look again at the
    // target (without copying) for what was kept.
    if !opts.dry_run {
        adm.wait_for_copies().await;
    }
    if !opts.dry_run && targets.iter().any(kept) {
        for t in targets.iter_mut().filter(|t| kept(t)) {
            let obj = match t.fields {
                Some(_) => &t.decided,
                None => &t.obj,
            };
            let again = adm
                .decide_template(obj, &t.decided, &opts.namespace, true)
                .await;
            for (d, a) in t.decisions.iter_mut().zip(again) {
                let SlotOutcome::Keep(first) = &d.outcome else {
                    continue;
                };
                d.outcome = match a.outcome {
                    SlotOutcome::Rewrite { image, source, .. } => SlotOutcome::Rewrite {
                        image,
                        source,
                        reason: "copied to the target (mutate waited for the copy)".into(),
                    },
                    // Mirrored only: copied now, and still not rewritten.
                    SlotOutcome::Skip(why) => SlotOutcome::Skip(why),
                    _ => SlotOutcome::Keep(format!(
                        "{first}; still not at the target after waiting for copies"
                    )),
                };
                d.identity = d.identity.take().or(a.identity);
            }
        }
    }
    let mut edits = Edits::new();
    let mut slots = Vec::new();
    let mut expected: Vec<Value> = docs.iter().map(|d| d.root.to_json()).collect();
    for t in &targets {
        let step = edit::indent_step(src, &docs[t.document - 1].root);
        let (e, reports, template_after) = edit_template(src, t, step);
        edits.extend(e);
        slots.extend(reports);
        if let Some(after) = template_after
            && let Some(at) = expected[t.document - 1].pointer_mut(&t.pointer)
        {
            *at = after;
        }
    }
    if edits.is_empty() {
        return Ok(Mutated {
            text: src.to_owned(),
            slots,
        });
    }
    let text = edits.apply(src)?;
    verify(&text, &expected)?;
    Ok(Mutated { text, slots })
}

/// The rewritten text must read back as the intended values, document by
/// document.
fn verify(text: &str, expected: &[Value]) -> Result<(), MutateError> {
    let back = doc::parse(text)?;
    for (i, want) in expected.iter().enumerate() {
        if back.get(i).map(|d| d.root.to_json()).as_ref() != Some(want) {
            return Err(MutateError::Verify { document: i + 1 });
        }
    }
    if back.len() != expected.len() {
        return Err(MutateError::Verify {
            document: expected.len() + 1,
        });
    }
    Ok(())
}

fn read_map(annotations: Option<&Value>, key: &str) -> BTreeMap<String, String> {
    annotations
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default()
}

/// The edits for one template, a report per slot, and the template's value
/// after the edits (`None` when unchanged).
fn edit_template(
    src: &str,
    t: &Target<'_>,
    step: usize,
) -> (Edits, Vec<SlotReport>, Option<Value>) {
    let resource = resource_ref(&t.obj);
    let mut value = t.template.to_json();
    let mut edits = Edits::new();
    let mut reports = Vec::new();
    let annotations = value.pointer("/metadata/annotations").cloned();
    let mut maps: Vec<(&str, BTreeMap<String, String>)> = [ORIGINAL_IMAGES, SOURCES, IDENTITY]
        .into_iter()
        .map(|k| (k, read_map(annotations.as_ref(), k)))
        .collect();
    let before: Vec<BTreeMap<String, String>> = maps.iter().map(|(_, m)| m.clone()).collect();
    // A custom resource's image is keyed and found by its field.
    let custom = |d: &SlotDecision| {
        t.fields
            .as_ref()
            .and_then(|f| f.get(d.slot.index))
            .filter(|_| d.slot.kind == "containers")
    };
    let key = |d: &SlotDecision| match custom(d) {
        Some(f) => f.shown.clone(),
        None => d.slot.key(),
    };
    // Entries for slots the template no longer has are dropped.
    let keys: Vec<String> = t.decisions.iter().map(key).collect();
    for (_, m) in &mut maps {
        m.retain(|k, _| keys.contains(k));
    }
    for d in &t.decisions {
        let slot = &d.slot;
        let field = match (custom(d), slot.is_volume()) {
            (Some(f), _) => f.shown.clone(),
            (None, true) => format!("{}spec.volumes[{}].image.reference", t.field, slot.index),
            (None, false) => format!("{}spec.{}[{}].image", t.field, slot.kind, slot.index),
        };
        let mut report = SlotReport {
            document: t.document,
            item: t.item,
            resource: resource.clone(),
            field,
            image: slot.image.clone(),
            new_image: None,
            status: Status::Skipped,
            reason: String::new(),
        };
        match &d.outcome {
            SlotOutcome::Rewrite {
                image,
                reason,
                source,
            } => {
                let (at, image) = match custom(d) {
                    Some(f) => (f.pointer.clone(), format!("{}{image}", f.scheme)),
                    None => (
                        format!("/spec/{}", slot.image_path().join("/")),
                        image.clone(),
                    ),
                };
                let image = &image;
                let edit = t
                    .template
                    .pointer(&at)
                    .ok_or_else(|| "the image field was not found".to_owned())
                    .and_then(|n| edit::set_scalar(src, n, image).map_err(|e| e.to_string()));
                match edit {
                    Ok(e) => {
                        edits.extend(e);
                        if let Some(v) = value.pointer_mut(&at) {
                            *v = Value::String(image.clone());
                        }
                        let written = match custom(d) {
                            Some(f) => format!("{}{}", f.scheme, slot.image),
                            None => slot.image.clone(),
                        };
                        maps[0].1.insert(key(d), written);
                        if !source.is_empty() {
                            maps[1].1.insert(key(d), source.clone());
                        }
                        if let Some(i) = &d.identity {
                            maps[2].1.insert(key(d), i.clone());
                        }
                        report.status = Status::Rewritten;
                        report.new_image = Some(image.clone());
                        report.reason = reason.clone();
                    }
                    Err(e) => {
                        report.status = Status::Failed;
                        report.reason = format!("not rewritten: {e}");
                    }
                }
            }
            SlotOutcome::Skip(why) => report.reason = why.clone(),
            SlotOutcome::Keep(why) => {
                report.status = Status::Unpinned;
                report.reason = why.clone();
            }
            SlotOutcome::Error(why) => {
                report.status = Status::Failed;
                report.reason = why.clone();
            }
        }
        reports.push(report);
    }
    let changed: Vec<(&str, BTreeMap<String, String>)> = maps
        .into_iter()
        .zip(&before)
        .filter(|((k, m), b)| {
            m != *b && !(m.is_empty() && read_raw(annotations.as_ref(), k).is_none())
        })
        .map(|(m, _)| m)
        .collect();
    if edits.is_empty() && changed.is_empty() {
        return (edits, reports, None);
    }
    match annotate(src, t.template, &changed, step) {
        Ok(e) => {
            edits.extend(e);
            let meta = value.as_object_mut().map(|o| {
                o.entry("metadata")
                    .or_insert_with(|| Value::Object(Default::default()))
            });
            if let Some(Value::Object(meta)) = meta {
                let ann = meta
                    .entry("annotations")
                    .or_insert_with(|| Value::Object(Default::default()));
                if let Value::Object(ann) = ann {
                    for (k, m) in &changed {
                        ann.insert((*k).to_owned(), Value::String(encode(m)));
                    }
                }
            }
            (edits, reports, Some(value))
        }
        Err(e) => {
            // Images are not changed without the annotations that record
            // their originals.
            for r in &mut reports {
                if r.status == Status::Rewritten {
                    r.status = Status::Failed;
                    r.reason = format!("not rewritten: metadata.annotations: {e}");
                    r.new_image = None;
                }
            }
            (Edits::new(), reports, None)
        }
    }
}

fn read_raw<'a>(annotations: Option<&'a Value>, key: &str) -> Option<&'a Value> {
    annotations.and_then(|a| a.get(key))
}

fn encode(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).expect("a map of strings serialises")
}

/// The edits that set `changed` annotations on `template`'s metadata,
/// adding `metadata` and `annotations` where missing.
fn annotate(
    src: &str,
    template: &Node,
    changed: &[(&str, BTreeMap<String, String>)],
    step: usize,
) -> Result<Edits, YamlError> {
    let entries = || {
        New::Map(
            changed
                .iter()
                .map(|(k, m)| ((*k).to_owned(), New::Str(encode(m))))
                .collect(),
        )
    };
    let not_map = |n: &Node, what: &str| {
        let (line, column) = doc::line_col(src, n.span.start);
        YamlError::Unsupported {
            line,
            column,
            reason: format!("{what} is not a mapping"),
        }
    };
    let meta = match template.get("metadata") {
        None => {
            let meta = New::Map(vec![("annotations".into(), entries())]);
            return edit::add_entries(src, template, &[("metadata".into(), meta)], step);
        }
        Some(m) if !matches!(m.kind, Kind::Map { .. }) => return Err(not_map(m, "metadata")),
        Some(m) => m,
    };
    let ann = match meta.get("annotations") {
        None => return edit::add_entries(src, meta, &[("annotations".into(), entries())], step),
        Some(a) if !matches!(a.kind, Kind::Map { .. }) => {
            return Err(not_map(a, "metadata.annotations"));
        }
        Some(a) => a,
    };
    let mut edits = Edits::new();
    let mut new = Vec::new();
    for (k, m) in changed {
        match ann.get(k) {
            Some(node) => edits.extend(edit::set_scalar(src, node, &encode(m))?),
            None => new.push(((*k).to_owned(), New::Str(encode(m)))),
        }
    }
    if !new.is_empty() {
        edits.extend(edit::add_entries(src, ann, &new, step)?);
    }
    Ok(edits)
}
