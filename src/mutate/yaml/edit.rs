//! Edits of YAML source text at node spans: a scalar rewritten in its own
//! style, entries added to a mapping at its indentation (block) or inside
//! its braces (flow). Everything outside the edited ranges stays byte for
//! byte, comments and line endings included.

use std::ops::Range;

use granit_parser::ScalarStyle;

use super::YamlError;
use super::doc::{Kind, Node, column, line_col};

/// A set of non-overlapping replacements of the source text.
#[derive(Debug, Default, Clone)]
pub struct Edits {
    list: Vec<(Range<usize>, String)>,
}

impl Edits {
    /// No edits yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the bytes `range` by `text`; an empty range inserts.
    pub fn replace(&mut self, range: Range<usize>, text: String) {
        self.list.push((range, text));
    }

    /// Whether nothing is to change.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Adds every edit of `other`.
    pub fn extend(&mut self, other: Edits) {
        self.list.extend(other.list);
    }

    /// `src` with the edits made. The same edit twice (an aliased scalar
    /// reached through two paths) is made once.
    ///
    /// # Errors
    /// [`YamlError::Unsupported`] when two different edits overlap.
    pub fn apply(&self, src: &str) -> Result<String, YamlError> {
        let mut list = self.list.clone();
        // Stable: inserts at one point keep the order they were made in.
        list.sort_by_key(|(r, _)| (r.start, r.end));
        list.dedup();
        let mut out = String::with_capacity(src.len() + 256);
        let mut at = 0;
        for (r, text) in &list {
            if r.start < at {
                let (line, column) = line_col(src, r.start);
                return Err(YamlError::Unsupported {
                    line,
                    column,
                    reason: "two rewrites of the same text (an anchor used in different places?)"
                        .into(),
                });
            }
            out.push_str(&src[at..r.start]);
            out.push_str(text);
            at = r.end;
        }
        out.push_str(&src[at..]);
        Ok(out)
    }
}

/// The line ending the text uses: CRLF when its first line ends so.
pub fn eol(src: &str) -> &'static str {
    match src.find('\n') {
        Some(i) if i > 0 && src.as_bytes()[i - 1] == b'\r' => "\r\n",
        _ => "\n",
    }
}

/// The indentation step of a document: the column difference between a
/// block key and its block-mapping value's keys, the first such pair found;
/// 2 when there is none.
pub fn indent_step(src: &str, root: &Node) -> usize {
    fn find(src: &str, n: &Node) -> Option<usize> {
        match &n.kind {
            Kind::Map {
                flow: false,
                entries,
            } => entries.iter().find_map(|(k, v)| match &v.kind {
                Kind::Map {
                    flow: false,
                    entries: inner,
                } if !inner.is_empty() => {
                    let (kc, vc) = (
                        column(src, k.span.start),
                        column(src, inner[0].0.span.start),
                    );
                    (vc > kc).then(|| vc - kc).or_else(|| find(src, v))
                }
                _ => find(src, v),
            }),
            Kind::Map { entries, .. } => entries.iter().find_map(|(_, v)| find(src, v)),
            Kind::Seq { items, .. } => items.iter().find_map(|i| find(src, i)),
            Kind::Scalar { .. } => None,
        }
    }
    find(src, root).unwrap_or(2)
}

/// A value to add: a string or a mapping of them.
#[derive(Debug, Clone, PartialEq)]
pub enum New {
    /// A string scalar.
    Str(String),
    /// A mapping, entries in order.
    Map(Vec<(String, New)>),
}

fn double(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

fn single(s: &str) -> String {
    if s.chars().any(char::is_control) {
        return double(s);
    }
    format!("'{}'", s.replace('\'', "''"))
}

/// Whether `s` reads back as the same string when written plain, in block
/// or flow context, by YAML 1.2 readers and by the YAML 1.1 reader kubectl
/// uses (where `yes`, `on` or `12:30` are not strings).
pub fn plain_ok(s: &str) -> bool {
    const WORDS: [&str; 12] = [
        "y", "yes", "n", "no", "true", "false", "on", "off", "null", "~", "", "<<",
    ];
    let Some(first) = s.chars().next() else {
        return false;
    };
    if WORDS.contains(&s.to_ascii_lowercase().as_str())
        || "-?:,[]{}#&*!|>'\"%@`".contains(first)
        || s.ends_with([':', ' '])
        || s.starts_with(' ')
        || s.contains(": ")
        || s.contains(" #")
        || s.contains(['\t', ',', '[', ']', '{', '}'])
        || s.chars().any(char::is_control)
    {
        return false;
    }
    // Numbers, sexagesimals, timestamps: anything made of digits and
    // `.:-+_eE` only, or `0x`/`0o`/`.inf`-like.
    let numeric = s
        .chars()
        .all(|c| c.is_ascii_digit() || ".:-+_eE".contains(c));
    !numeric && !s.starts_with("0x") && !s.starts_with("0o") && !s.starts_with('.')
}

/// `value` written as `style` writes it (plain only where that reads back
/// as the same string; else single-quoted).
///
/// # Errors
/// [`YamlError::Unsupported`] for block scalars (`|`, `>`), whose
/// indentation rules this edit does not reproduce.
pub fn render_scalar(
    src: &str,
    node: &Node,
    style: ScalarStyle,
    value: &str,
) -> Result<String, YamlError> {
    Ok(match style {
        ScalarStyle::Plain if plain_ok(value) => value.to_owned(),
        ScalarStyle::Plain | ScalarStyle::SingleQuoted => single(value),
        ScalarStyle::DoubleQuoted => double(value),
        ScalarStyle::Literal | ScalarStyle::Folded => {
            let (line, column) = line_col(src, node.span.start);
            return Err(YamlError::Unsupported {
                line,
                column,
                reason: "a block scalar (| or >) is not rewritten; write it on one line".into(),
            });
        }
    })
}

/// The edit that sets scalar `node` to `value`, keeping its style; JSON
/// input stays JSON (its scalars are double-quoted).
///
/// # Errors
/// [`YamlError::Unsupported`] when `node` is not a scalar or is a block
/// scalar.
pub fn set_scalar(src: &str, node: &Node, value: &str) -> Result<Edits, YamlError> {
    let Kind::Scalar { style, .. } = &node.kind else {
        let (line, column) = line_col(src, node.span.start);
        return Err(YamlError::Unsupported {
            line,
            column,
            reason: "expected a string".into(),
        });
    };
    let mut e = Edits::new();
    e.replace(node.span.clone(), render_scalar(src, node, *style, value)?);
    Ok(e)
}

fn flow_text(entries: &[(String, New)]) -> String {
    let parts: Vec<String> = entries
        .iter()
        .map(|(k, v)| {
            let v = match v {
                New::Str(s) => double(s),
                New::Map(m) => format!("{{{}}}", flow_text(m)),
            };
            format!("{}: {v}", double(k))
        })
        .collect();
    parts.join(", ")
}

fn block_lines(
    entries: &[(String, New)],
    indent: usize,
    step: usize,
    out: &mut Vec<(usize, String)>,
) {
    for (k, v) in entries {
        let key = if plain_ok(k) { k.clone() } else { double(k) };
        match v {
            New::Str(s) => out.push((indent, format!("{key}: {}", single(s)))),
            New::Map(m) => {
                out.push((indent, format!("{key}:")));
                block_lines(m, indent + step, step, out);
            }
        }
    }
}

/// The edit that adds `entries` to mapping `map`: in a block mapping, as
/// lines before its first key at that key's indentation (`step` deeper per
/// level); in a flow mapping, after its `{`, double-quoted (valid JSON).
///
/// # Errors
/// [`YamlError::Unsupported`] when `map` is not a mapping.
pub fn add_entries(
    src: &str,
    map: &Node,
    entries: &[(String, New)],
    step: usize,
) -> Result<Edits, YamlError> {
    let mut e = Edits::new();
    let Kind::Map {
        flow,
        entries: existing,
    } = &map.kind
    else {
        let (line, column) = line_col(src, map.span.start);
        return Err(YamlError::Unsupported {
            line,
            column,
            reason: "expected a mapping".into(),
        });
    };
    let nl = eol(src);
    match (flow, existing.first()) {
        (true, None) => {
            e.replace(map.span.start + 1..map.span.start + 1, flow_text(entries));
        }
        (true, Some((first, _))) => {
            let at = first.span.start;
            let same_line = !src[map.span.start..at].contains('\n');
            let sep = match same_line {
                true => " ".to_owned(),
                false => format!("{nl}{}", " ".repeat(column(src, at))),
            };
            e.replace(at..at, format!("{},{sep}", flow_text(entries)));
        }
        (false, first) => {
            let at = first.map_or(map.span.start, |(k, _)| k.span.start);
            let col = column(src, at);
            let mut lines = Vec::new();
            block_lines(entries, col, step, &mut lines);
            let mut text = String::new();
            for (i, (indent, line)) in lines.iter().enumerate() {
                if i > 0 {
                    text.push_str(nl);
                    text.push_str(&" ".repeat(*indent));
                }
                text.push_str(line);
            }
            text.push_str(nl);
            text.push_str(&" ".repeat(col));
            e.replace(at..at, text);
        }
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::super::doc::parse;
    use super::*;

    fn one(src: &str) -> Node {
        parse(src).unwrap().remove(0).root
    }

    #[test]
    fn scalars_keep_their_style() {
        let src = "a: x:1   # keep\nb: 'y:1'\nc: \"z:1\"\nd: |\n  w\n";
        let r = one(src);
        let mut e = Edits::new();
        for (k, v) in [("a", "m/x:1@sha256:aa"), ("b", "it's"), ("c", "m/z\"1")] {
            e.extend(set_scalar(src, r.get(k).unwrap(), v).unwrap());
        }
        assert_eq!(
            e.apply(src).unwrap(),
            "a: m/x:1@sha256:aa   # keep\nb: 'it''s'\nc: \"m/z\\\"1\"\nd: |\n  w\n"
        );
        assert!(set_scalar(src, r.get("d").unwrap(), "v").is_err());
        // Plain only where it reads back the same in YAML 1.1 and 1.2.
        for s in ["yes", "12:30", "1.5", "0x1f", "a: b", "- x", "", "x #y"] {
            assert!(!plain_ok(s), "{s}");
        }
        for s in ["127.0.0.1:5000/a/b:v1@sha256:ab", "nginx", "ghcr.io/x/y:1"] {
            assert!(plain_ok(s), "{s}");
        }
    }

    #[test]
    fn entries_go_in_at_the_mappings_indentation() {
        let new = vec![(
            "annotations".to_owned(),
            New::Map(vec![(
                "pinswap.dev/x".into(),
                New::Str("{\"a\":\"b\"}".into()),
            )]),
        )];
        let src = "metadata:\r\n    # c\r\n    name: p\r\nspec: {}\r\n";
        let r = one(src);
        let out = add_entries(src, r.get("metadata").unwrap(), &new, 4)
            .unwrap()
            .apply(src)
            .unwrap();
        assert_eq!(
            out,
            "metadata:\r\n    # c\r\n    annotations:\r\n        pinswap.dev/x: '{\"a\":\"b\"}'\r\n    name: p\r\nspec: {}\r\n"
        );
        let src = "{\n  \"metadata\": {\n    \"name\": \"p\"\n  },\n  \"spec\": {}\n}\n";
        let r = one(src);
        let mut e = add_entries(src, r.get("metadata").unwrap(), &new, 2).unwrap();
        e.extend(add_entries(src, r.get("spec").unwrap(), &new, 2).unwrap());
        let out = e.apply(src).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).expect("still JSON");
        assert_eq!(
            v["metadata"]["annotations"]["pinswap.dev/x"],
            "{\"a\":\"b\"}"
        );
        assert_eq!(v["spec"]["annotations"]["pinswap.dev/x"], "{\"a\":\"b\"}");
        assert!(out.contains("{\n    \"annotations\": {\"pinswap.dev/x\": \"{\\\"a\\\":\\\"b\\\"}\"},\n    \"name\""), "{out}");
        // A compact mapping in a sequence item.
        let src = "- name: a\n  image: b\n";
        let r = one(src);
        let out = add_entries(src, r.item(0).unwrap(), &new, 2)
            .unwrap()
            .apply(src)
            .unwrap();
        assert_eq!(
            out,
            "- annotations:\n    pinswap.dev/x: '{\"a\":\"b\"}'\n  name: a\n  image: b\n"
        );
    }
}
