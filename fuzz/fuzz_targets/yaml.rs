//! The YAML reader of `mutate` and the KRM function: any text is documents
//! or an error, never a panic, and aliases never expand without bound.
//! Every span it reports slices the text on character boundaries.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinswap::mutate::yaml::doc::{self, Kind, Node};

fn spans(src: &str, node: &Node) {
    assert!(src.get(node.span.clone()).is_some(), "span {:?}", node.span);
    match &node.kind {
        Kind::Scalar { .. } => {}
        Kind::Seq { items, .. } => items.iter().for_each(|n| spans(src, n)),
        Kind::Map { entries, .. } => entries.iter().for_each(|(k, v)| {
            spans(src, k);
            spans(src, v);
        }),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(docs) = doc::parse(s) {
        for d in &docs {
            spans(s, &d.root);
            let _ = d.root.to_json();
            let _ = d.root.pointer("/spec/template/spec/containers/0/image");
        }
    }
});
