//! `pinswap mutate`: the admission rewrite applied to manifest files
//! (GitOps). Multi-document YAML or JSON in, the same documents out, with
//! Pods and every pod template rewritten: Deployment, StatefulSet, DaemonSet,
//! ReplicaSet, Job, ReplicationController (`spec.template`), CronJob
//! (`spec.jobTemplate.spec.template`), and the items of a `List`.
//!
//! Key order is kept (serde_json with `preserve_order`). YAML comments are
//! not: yaml_serde reads documents into values and has no comment model.
//! Output strings are always quoted (see [`super::yaml`]).

use serde_json::Value;

use super::Admission;

/// Errors reading or writing manifests; each names the document.
#[derive(Debug, thiserror::Error)]
pub enum MutateError {
    /// A document is not valid YAML/JSON.
    #[error("document {index}: {reason}")]
    Parse {
        /// 1-based document number.
        index: usize,
        /// The parser's message (with line and column).
        reason: String,
    },
    /// The result could not be serialised.
    #[error("writing the result: {0}")]
    Write(String),
}

/// The rewritten text and the slot errors (`kind/name: image: cause`).
#[derive(Debug)]
pub struct Mutated {
    /// The documents, rewritten, in the input's format.
    pub text: String,
    /// Slots left unchanged because of an error.
    pub errors: Vec<String>,
}

/// JSON pointers to the pod templates (`{metadata, spec}`) in an object of
/// `kind`; the Pod itself for `Pod`.
fn template_paths(kind: &str) -> &'static [&'static str] {
    match kind {
        "Pod" => &[""],
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "Job"
        | "ReplicationController" => &["/spec/template"],
        "CronJob" => &["/spec/jobTemplate/spec/template"],
        _ => &[],
    }
}

fn describe(obj: &Value) -> String {
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("?");
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("?");
    format!("{kind}/{name}")
}

async fn rewrite_object(adm: &Admission, obj: &mut Value, dry_run: bool, errors: &mut Vec<String>) {
    let kind = obj
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    if kind == "List" {
        if let Some(items) = obj.get_mut("items").and_then(Value::as_array_mut) {
            for item in items {
                Box::pin(rewrite_object(adm, item, dry_run, errors)).await;
            }
        }
        return;
    }
    let whole = obj.clone();
    for path in template_paths(&kind) {
        let Some(template) = obj.pointer_mut(path) else {
            continue;
        };
        if template.get("metadata").is_none()
            && let Some(t) = template.as_object_mut()
        {
            t.insert("metadata".into(), Value::Object(Default::default()));
        }
        for e in adm.rewrite_template(&whole, template, dry_run).await {
            errors.push(format!("{}: {e}", describe(&whole)));
        }
    }
}

/// Rewrites every Pod and pod template in `input` (YAML, possibly several
/// `---` documents, or JSON), mirroring as configured; with `dry_run`,
/// images are resolved and rewritten but nothing is checked at or copied to
/// the target.
///
/// # Errors
/// [`MutateError::Parse`] naming the document, [`MutateError::Write`].
pub async fn mutate(adm: &Admission, input: &str, dry_run: bool) -> Result<Mutated, MutateError> {
    let json_input = input.trim_start().starts_with(['{', '[']);
    let mut docs: Vec<Value> = Vec::new();
    for (i, de) in yaml_serde::Deserializer::from_str(input).enumerate() {
        let v: Value = serde::Deserialize::deserialize(de).map_err(|e| MutateError::Parse {
            index: i + 1,
            reason: e.to_string(),
        })?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    let mut errors = Vec::new();
    for doc in &mut docs {
        rewrite_object(adm, doc, dry_run, &mut errors).await;
    }
    let text = if json_input {
        let mut out = String::new();
        for d in &docs {
            out.push_str(
                &serde_json::to_string_pretty(d).map_err(|e| MutateError::Write(e.to_string()))?,
            );
            out.push('\n');
        }
        out
    } else {
        let mut parts = Vec::new();
        for d in &docs {
            parts.push(super::yaml::to_yaml(d));
        }
        parts.join("---\n")
    };
    Ok(Mutated { text, errors })
}
