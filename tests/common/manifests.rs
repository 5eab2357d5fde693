//! `pinswap manifests` decoded: its documents, one object by kind and
//! name, and an object as its k8s-openapi type.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::common;

/// `pinswap manifests ARGS`, decoded document by document.
pub async fn manifests(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["manifests"];
    all.extend_from_slice(args);
    let (code, out, err) = common::run_pinswap(&all).await;
    assert_eq!(code, 0, "pinswap manifests {args:?}: {err}");
    documents(&out)
}

pub fn documents(yaml: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("a YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

pub fn key(v: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    (
        s(&v["kind"]),
        s(&v["metadata"]["namespace"]),
        s(&v["metadata"]["name"]),
    )
}

pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

pub fn typed<K: DeserializeOwned>(v: &Value) -> K {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{}: {e}", key(v).0))
}
