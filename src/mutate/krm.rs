//! `pinswap mutate --krm`: a KRM function (KRM Functions Specification):
//! a `ResourceList` (`config.kubernetes.io/v1`) on stdin, the same one on
//! stdout with its `items` rewritten as `mutate` rewrites files and a
//! `results` entry per image that was rewritten or could not be pinned.
//! Usable as an exec function from `kustomize build --enable-alpha-plugins
//! --enable-exec` and `kpt fn eval --exec`.
//!
//! The config comes from `functionConfig`: a `ConfigMap` whose
//! `data.config` holds pinswap's YAML config, or any object whose `spec` is
//! that config (e.g. `kind: PinswapMutate`).

use serde_json::{Value, json};

use super::yaml::doc::{self, Document, Kind, Node, column};
use super::yaml::edit::{self, Edits};
use super::yaml::to_yaml;
use super::{MutateError, Mutated, Options, SlotReport, Status, rewrite};
use crate::admission::Admission;

/// The `apiVersion` of a `ResourceList`.
pub const API_VERSION: &str = "config.kubernetes.io/v1";

/// A function's output: the `ResourceList` text and whether any result is
/// an error (the function then exits non-zero).
#[derive(Debug)]
pub struct Output {
    /// The `ResourceList`, with `results`.
    pub text: String,
    /// Whether a result has severity `error`.
    pub failed: bool,
}

fn read(input: &str) -> Result<Document, MutateError> {
    // A function reads stdin: name it, as `mutate` names each file.
    let mut docs =
        doc::parse(input).map_err(|e| MutateError::ResourceList(format!("stdin: {e}")))?;
    if docs.len() != 1 {
        return Err(MutateError::ResourceList(format!(
            "stdin: expected one ResourceList document, got {}",
            docs.len()
        )));
    }
    let d = docs.remove(0);
    let kind = d.root.get("kind").and_then(Node::as_str).unwrap_or("");
    if kind != "ResourceList" {
        return Err(MutateError::ResourceList(format!(
            "stdin: kind: expected ResourceList ({API_VERSION}), got {kind:?}"
        )));
    }
    Ok(d)
}

/// The pinswap config that `functionConfig` carries, as YAML text, and the
/// name to give it in messages; `None` without a `functionConfig`.
///
/// # Errors
/// [`MutateError::Yaml`] or [`MutateError::ResourceList`] for input that
/// is not a `ResourceList`, or a `functionConfig` of neither form.
pub fn function_config(input: &str) -> Result<Option<(String, String)>, MutateError> {
    let d = read(input)?;
    let Some(fc) = d.root.get("functionConfig").map(Node::to_json) else {
        return Ok(None);
    };
    if fc.is_null() {
        return Ok(None);
    }
    if fc.get("kind").and_then(Value::as_str) == Some("ConfigMap") {
        return match fc.pointer("/data/config").and_then(Value::as_str) {
            Some(text) => Ok(Some((text.to_owned(), "functionConfig.data.config".into()))),
            None => Err(MutateError::ResourceList(
                "functionConfig.data.config: expected pinswap's YAML config as a string".into(),
            )),
        };
    }
    match fc.get("spec") {
        Some(spec @ Value::Object(_)) => Ok(Some((to_yaml(spec), "functionConfig.spec".into()))),
        _ => Err(MutateError::ResourceList(
            "functionConfig.spec: expected pinswap's config (target, source, ...), or a ConfigMap with data.config"
                .into(),
        )),
    }
}

/// Runs the function on `input`.
///
/// # Errors
/// [`MutateError`] for input that is not a `ResourceList`; errors deciding
/// images are results, not errors.
pub async fn run(adm: &Admission, input: &str, opts: Options) -> Result<Output, MutateError> {
    let docs = [read(input)?];
    let mut objs = Vec::new();
    if let Some(Node {
        kind: Kind::Seq { items, .. },
        ..
    }) = docs[0].root.get("items")
    {
        for (i, item) in items.iter().enumerate() {
            objs.push((1, Some(i), format!("/items/{i}"), item));
        }
    }
    let Mutated { text, slots } = rewrite(adm, input, &docs, objs, opts).await?;
    let results = results(&docs[0], &slots);
    let failed = results.iter().any(|r| r["severity"] == "error");
    let text = with_results(&text, results)?;
    Ok(Output { text, failed })
}

/// `input` unchanged, with one error result: for a config that does not
/// load, so kustomize and kpt show why.
///
/// # Errors
/// As [`run`].
pub fn fail(input: &str, message: &str) -> Result<String, MutateError> {
    read(input)?;
    with_results(
        input,
        vec![json!({"message": message, "severity": "error"})],
    )
}

fn results(d: &Document, slots: &[SlotReport]) -> Vec<Value> {
    let mut out = Vec::new();
    for s in slots {
        let severity = match s.status {
            Status::Skipped => continue,
            Status::Rewritten => "info",
            Status::Unpinned | Status::Failed => "error",
        };
        let message = match s.status {
            Status::Rewritten => format!("rewritten: {}", s.reason),
            Status::Unpinned => format!("not pinned: {}", s.reason),
            _ => format!("failed: {}", s.reason),
        };
        let mut r = json!({
            "message": message,
            "severity": severity,
            "resourceRef": s.resource,
            "field": {"path": s.field, "currentValue": s.image},
        });
        if let Some(new) = &s.new_image {
            r["field"]["proposedValue"] = json!(new);
        }
        if let Some(i) = s.item {
            let ann = d.root.pointer(&format!("/items/{i}/metadata/annotations"));
            let get = |k: &str| ann.and_then(|a| a.get(k)).and_then(Node::as_str);
            let path =
                get("internal.config.kubernetes.io/path").or(get("config.kubernetes.io/path"));
            if let Some(p) = path {
                r["file"] = json!({"path": p});
                let index = get("internal.config.kubernetes.io/index")
                    .or(get("config.kubernetes.io/index"))
                    .and_then(|i| i.parse::<u64>().ok());
                if let Some(index) = index {
                    r["file"]["index"] = json!(index);
                }
            }
        }
        out.push(r);
    }
    out
}

/// `text` (one `ResourceList`) with its `results` set to `results`: the
/// existing value replaced, or a `results` key added at the end.
fn with_results(text: &str, results: Vec<Value>) -> Result<String, MutateError> {
    let d = read(text)?;
    let root = &d.root;
    let nl = edit::eol(text);
    let list = Value::Array(results);
    let flow = matches!(root.kind, Kind::Map { flow: true, .. });
    let mut e = Edits::new();
    let existing = match &root.kind {
        Kind::Map { entries, .. } => entries.iter().find(|(k, _)| k.as_str() == Some("results")),
        _ => None,
    };
    match existing {
        Some((key, old)) => {
            let block_seq = matches!(old.kind, Kind::Seq { flow: false, .. });
            let empty = list.as_array().is_some_and(Vec::is_empty);
            let (range, new) = match (block_seq, empty) {
                (true, false) => {
                    let col = column(text, old.span.start);
                    let new = to_yaml(&list)
                        .trim_end()
                        .replace('\n', &format!("{nl}{}", " ".repeat(col)));
                    (old.span.clone(), new)
                }
                // A flow value cannot start on the next line at the key's
                // indentation: write it after the key.
                (true, true) => (key.span.end..old.span.end, ": []".to_owned()),
                (false, _) => (old.span.clone(), list.to_string()),
            };
            e.replace(range, new);
        }
        None if flow => {
            let close = root.span.end - 1;
            e.replace(close..close, format!(", \"results\": {list}"));
        }
        None => {
            let end = root.span.end;
            let rest = &text[end..];
            let line_end = rest.find('\n').map_or(text.len(), |i| end + i + 1);
            let tail = text[end..line_end].trim();
            let at = if tail.is_empty() || tail.starts_with('#') {
                line_end
            } else {
                end
            };
            let mut block = to_yaml(&json!({ "results": list })).replace('\n', nl);
            if at == text.len() && !text.ends_with('\n') || at == end {
                block.insert_str(0, nl);
            }
            e.replace(at..at, block);
        }
    }
    Ok(e.apply(text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_added_or_replaced() {
        let r = vec![json!({"message": "m", "severity": "info"})];
        let src = "apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems: [] # none\n";
        let out = with_results(src, r.clone()).unwrap();
        assert_eq!(
            out,
            format!("{src}results:\n- message: \"m\"\n  severity: \"info\"\n")
        );
        let out2 = with_results(&out, vec![]).unwrap();
        assert!(out2.ends_with("results: []\n"), "{out2}");
        let src = "{\"apiVersion\": \"config.kubernetes.io/v1\", \"kind\": \"ResourceList\", \"items\": []}";
        let v: Value = serde_json::from_str(&with_results(src, r).unwrap()).unwrap();
        assert_eq!(v["results"][0]["message"], "m");
        assert!(read("kind: List\n").is_err());
    }
}
