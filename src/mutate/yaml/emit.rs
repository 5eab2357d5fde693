//! A YAML writer, for the YAML pinswap writes itself (KRM `results`), that
//! every Kubernetes YAML reader takes the same way.
//!
//! yaml_serde writes YAML 1.2, where `yes`, `on`, `y` or `12:30` are plain
//! strings; kubectl reads YAML with go-yaml v2, a YAML 1.1 parser, where
//! they are booleans and numbers. So a ConfigMap value `"yes"` would come
//! back as `true`. Here every string is double-quoted (JSON escapes are
//! valid YAML), and map keys are quoted unless they are plainly safe; the
//! layout is ordinary block style with key order kept.

use serde_json::Value;

/// Keys written without quotes: letters, digits and `-_./`, starting with a
/// letter, and not a YAML 1.1 boolean or null word.
fn plain_key(k: &str) -> bool {
    const WORDS: [&str; 12] = [
        "y", "yes", "n", "no", "true", "false", "on", "off", "null", "~", "Y", "N",
    ];
    k.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !WORDS.contains(&k.to_ascii_lowercase().as_str())
}

fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

fn key(k: &str) -> String {
    if plain_key(k) { k.to_owned() } else { quote(k) }
}

fn scalar(v: &Value) -> Option<String> {
    Some(match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => quote(s),
        Value::Array(a) if a.is_empty() => "[]".into(),
        Value::Object(o) if o.is_empty() => "{}".into(),
        _ => return None,
    })
}

fn emit(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                out.push_str(&pad);
                out.push_str(&key(k));
                out.push(':');
                match scalar(val) {
                    Some(s) => {
                        out.push(' ');
                        out.push_str(&s);
                        out.push('\n');
                    }
                    None => {
                        out.push('\n');
                        // Sequences sit at the key's indentation, as kubectl writes them.
                        let inner = if val.is_array() { indent } else { indent + 2 };
                        emit(val, inner, out);
                    }
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                out.push_str(&pad);
                out.push_str("- ");
                match scalar(item) {
                    Some(s) => {
                        out.push_str(&s);
                        out.push('\n');
                    }
                    None => {
                        // The item's first line follows "- "; the rest align under it.
                        let mut inner = String::new();
                        emit(item, indent + 2, &mut inner);
                        out.push_str(&inner[indent + 2..]);
                    }
                }
            }
        }
        other => {
            out.push_str(&pad);
            out.push_str(&scalar(other).unwrap_or_default());
            out.push('\n');
        }
    }
}

/// One document as block-style YAML, strings always double-quoted.
pub fn to_yaml(v: &Value) -> String {
    let mut out = String::new();
    match scalar(v) {
        Some(s) => {
            out.push_str(&s);
            out.push('\n');
        }
        None => emit(v, 0, &mut out),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trips_and_quotes_what_yaml_1_1_would_misread() {
        let v = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {}, "annotations": {"a/b": "x\ny"}},
            "data": {"a": "yes", "b": "no", "c": "on", "e": "y", "f": "12:30", "k": "1_000", "on": "x", "empty": ""},
            "spec": {"containers": [
                {"name": "web", "image": "r/x:1@sha256:aa", "ports": [{"containerPort": 80}], "args": ["--a", "b"]},
                {"name": "side", "env": [], "command": [["nested"]]}
            ], "replicas": 2, "paused": false, "x": null}
        });
        let y = to_yaml(&v);
        let back: Value = yaml_serde::from_str(&y).unwrap();
        assert_eq!(back, v, "{y}");
        for want in [
            "a: \"yes\"",
            "\"on\": \"x\"",
            "f: \"12:30\"",
            "- name: \"web\"",
            "  image: \"r/x:1@sha256:aa\"",
        ] {
            assert!(y.contains(want), "missing {want:?} in\n{y}");
        }
        // Key order kept.
        assert!(
            y.starts_with("apiVersion: \"v1\"\nkind: \"ConfigMap\"\nmetadata:\n"),
            "{y}"
        );
    }
}
