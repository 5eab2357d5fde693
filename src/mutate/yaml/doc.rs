//! YAML documents with the byte span of every node, read with
//! granit-parser's event stream. yaml_serde and serde-saphyr give values
//! only; `pinswap mutate` needs to know where each scalar sits in the text
//! so it can change that scalar and nothing else.

use std::collections::HashMap;
use std::ops::Range;

use granit_parser::{Event, Parser, ScalarStyle, Span, StructureStyle};
use serde_json::Value;

use super::YamlError;

/// One node and where it is in the source.
#[derive(Debug, Clone)]
pub struct Node {
    /// Byte range in the source: a scalar's text including its quotes; a
    /// flow collection from `{`/`[` to `}`/`]`; a block collection from its
    /// first entry to the end of its last.
    pub span: Range<usize>,
    /// What the node is.
    pub kind: Kind,
}

/// The kinds of node.
#[derive(Debug, Clone)]
pub enum Kind {
    /// A scalar: its value after escapes, how it is written, and its tag
    /// (`tag:yaml.org,2002:str` for `!!str`) when it has one.
    Scalar {
        /// The value after escape processing.
        value: String,
        /// Plain, quoted or block.
        style: ScalarStyle,
        /// The resolved tag, when one is written.
        tag: Option<String>,
    },
    /// A sequence and its items.
    Seq {
        /// Written `[...]`.
        flow: bool,
        /// The items, in order.
        items: Vec<Node>,
    },
    /// A mapping and its entries, in order.
    Map {
        /// Written `{...}`.
        flow: bool,
        /// Key and value nodes.
        entries: Vec<(Node, Node)>,
    },
}

/// One document of a stream.
#[derive(Debug, Clone)]
pub struct Document {
    /// 1-based position in the stream.
    pub index: usize,
    /// The root node.
    pub root: Node,
}

impl Node {
    /// The scalar's value, when this is a scalar.
    pub fn as_str(&self) -> Option<&str> {
        match &self.kind {
            Kind::Scalar { value, .. } => Some(value),
            _ => None,
        }
    }

    /// The value of `key` in a mapping, honouring `<<` merge keys as
    /// Kubernetes' YAML reader does (own entries first).
    pub fn get(&self, key: &str) -> Option<&Node> {
        let Kind::Map { entries, .. } = &self.kind else {
            return None;
        };
        if let Some((_, v)) = entries.iter().find(|(k, _)| k.as_str() == Some(key)) {
            return Some(v);
        }
        let (_, merge) = entries.iter().find(|(k, _)| k.is_merge_key())?;
        match &merge.kind {
            Kind::Map { .. } => merge.get(key),
            Kind::Seq { items, .. } => items.iter().find_map(|m| m.get(key)),
            Kind::Scalar { .. } => None,
        }
    }

    /// The item at `index` of a sequence.
    pub fn item(&self, index: usize) -> Option<&Node> {
        match &self.kind {
            Kind::Seq { items, .. } => items.get(index),
            _ => None,
        }
    }

    /// The node at a JSON pointer (`/spec/containers/0/image`); `""` is
    /// this node.
    pub fn pointer(&self, pointer: &str) -> Option<&Node> {
        let mut node = self;
        for token in pointer.split('/').skip(1) {
            let token = token.replace("~1", "/").replace("~0", "~");
            node = match &node.kind {
                Kind::Seq { .. } => node.item(token.parse().ok()?)?,
                _ => node.get(&token)?,
            };
        }
        Some(node)
    }

    fn is_merge_key(&self) -> bool {
        matches!(&self.kind, Kind::Scalar { value, style: ScalarStyle::Plain, tag: None } if value == "<<")
    }

    /// The value as JSON, with plain scalars typed by the YAML core schema
    /// (null, booleans, numbers; everything else a string) and merge keys
    /// applied.
    pub fn to_json(&self) -> Value {
        match &self.kind {
            Kind::Scalar { value, style, tag } => scalar_json(value, *style, tag.as_deref()),
            Kind::Seq { items, .. } => Value::Array(items.iter().map(Node::to_json).collect()),
            Kind::Map { entries, .. } => {
                let mut out = serde_json::Map::new();
                let mut merged = Vec::new();
                for (k, v) in entries {
                    if k.is_merge_key() {
                        merged.push(v);
                        continue;
                    }
                    out.insert(key_text(k), v.to_json());
                }
                for m in merged {
                    let sources: Vec<&Node> = match &m.kind {
                        Kind::Seq { items, .. } => items.iter().collect(),
                        _ => vec![m],
                    };
                    for s in sources {
                        if let Value::Object(o) = s.to_json() {
                            for (k, v) in o {
                                out.entry(k).or_insert(v);
                            }
                        }
                    }
                }
                Value::Object(out)
            }
        }
    }
}

fn key_text(k: &Node) -> String {
    match k.to_json() {
        Value::String(s) => s,
        other => other.to_string(),
    }
}

/// A scalar's JSON value under the YAML 1.2 core schema.
fn scalar_json(value: &str, style: ScalarStyle, tag: Option<&str>) -> Value {
    let core = tag.and_then(|t| t.strip_prefix("tag:yaml.org,2002:"));
    match core {
        Some("str") => return Value::String(value.to_owned()),
        Some("null") | Some("bool") | Some("int") | Some("float") => {}
        _ if tag.is_some() => return Value::String(value.to_owned()),
        _ if style != ScalarStyle::Plain => return Value::String(value.to_owned()),
        _ => {}
    }
    match value {
        "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
        "true" | "True" | "TRUE" => return Value::Bool(true),
        "false" | "False" | "FALSE" => return Value::Bool(false),
        _ => {}
    }
    let digits = value.strip_prefix(['-', '+']).unwrap_or(value);
    if !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && let Ok(i) = value.parse::<i64>()
    {
        return Value::from(i);
    }
    if let Some(hex) = value.strip_prefix("0x")
        && let Ok(i) = i64::from_str_radix(hex, 16)
    {
        return Value::from(i);
    }
    if let Some(oct) = value.strip_prefix("0o")
        && let Ok(i) = i64::from_str_radix(oct, 8)
    {
        return Value::from(i);
    }
    let float_like = digits.bytes().all(|b| {
        b.is_ascii_digit() || b == b'.' || b == b'e' || b == b'E' || b == b'-' || b == b'+'
    }) && digits.bytes().any(|b| b.is_ascii_digit());
    if float_like
        && let Ok(f) = value.parse::<f64>()
        && let Some(n) = serde_json::Number::from_f64(f)
    {
        return Value::Number(n);
    }
    Value::String(value.to_owned())
}

/// The 1-based line and column of byte `at`.
pub fn line_col(src: &str, at: usize) -> (usize, usize) {
    let before = &src[..at.min(src.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

/// The 0-based column (in bytes) of byte `at`.
pub fn column(src: &str, at: usize) -> usize {
    at - src[..at].rfind('\n').map_or(0, |i| i + 1)
}

/// How many nodes aliases may add to a stream beyond the nodes written in
/// it. Each alias is a copy of its anchor, so ten levels of ten aliases
/// (an "alias bomb") would be 10^10 nodes from a few hundred bytes; with
/// this bound the nodes read stay linear in the text's size.
pub const ALIAS_NODES: usize = 100_000;

/// Reads every document of `src` with its spans. Aliases are expanded into
/// copies of their anchored node (spans and all, so an edit of an aliased
/// scalar lands on the anchor's definition), at most [`ALIAS_NODES`] nodes
/// more than the text writes out.
///
/// # Errors
/// [`YamlError::Syntax`] naming the document, line and column;
/// [`YamlError::Aliases`] when aliases would expand beyond the bound.
pub fn parse(src: &str) -> Result<Vec<Document>, YamlError> {
    let mut reader = Reader {
        src,
        events: Parser::new_from_str(src),
        peeked: None,
        doc: 0,
        anchors: HashMap::new(),
        written: 0,
        expanded: 0,
    };
    let mut docs = Vec::new();
    loop {
        match reader.next()? {
            (Event::StreamStart, _) => {}
            (Event::StreamEnd, _) => break,
            (Event::DocumentStart(..), _) => {
                reader.doc += 1;
                reader.anchors.clear();
                let root = reader.node()?;
                match reader.next()? {
                    (Event::DocumentEnd, _) => {}
                    (e, span) => return Err(reader.unexpected(&e, span)),
                }
                docs.push(Document {
                    index: reader.doc,
                    root,
                });
            }
            (e, span) => return Err(reader.unexpected(&e, span)),
        }
    }
    Ok(docs)
}

struct Reader<'a> {
    src: &'a str,
    events: Parser<'a, granit_parser::StrInput<'a>>,
    peeked: Option<(Event<'a>, Span)>,
    doc: usize,
    /// Anchored nodes and how many nodes each holds, aliases expanded.
    anchors: HashMap<usize, (Node, usize)>,
    /// Nodes read from the text itself (over the whole stream).
    written: usize,
    /// Nodes added by expanding aliases (over the whole stream).
    expanded: usize,
}

impl<'a> Reader<'a> {
    /// The next event that is not a comment.
    fn next(&mut self) -> Result<(Event<'a>, Span), YamlError> {
        if let Some(p) = self.peeked.take() {
            return Ok(p);
        }
        loop {
            match self.events.next() {
                None => {
                    return Err(self.error(self.src.len(), "unexpected end of input".into()));
                }
                Some(Err(e)) => {
                    let at = e.marker().byte_offset().unwrap_or(self.src.len());
                    return Err(self.error(at, e.info().to_string()));
                }
                Some(Ok((Event::Comment(..), _))) => continue,
                Some(Ok(ev)) => return Ok(ev),
            }
        }
    }

    fn range(&self, span: Span) -> Range<usize> {
        span.byte_range().unwrap_or(0..0)
    }

    fn error(&self, at: usize, reason: String) -> YamlError {
        let (line, column) = line_col(self.src, at);
        YamlError::Syntax {
            document: self.doc.max(1),
            line,
            column,
            reason,
        }
    }

    fn unexpected(&self, e: &Event<'_>, span: Span) -> YamlError {
        self.error(self.range(span).start, format!("unexpected {e:?}"))
    }

    /// How many nodes have been read so far, aliases expanded.
    fn read_so_far(&self) -> usize {
        self.written + self.expanded
    }

    fn remember(&mut self, anchor: usize, node: &Node, nodes_before: usize) {
        if anchor != 0 {
            let weight = self.read_so_far() - nodes_before;
            self.anchors.insert(anchor, (node.clone(), weight));
        }
    }

    fn node(&mut self) -> Result<Node, YamlError> {
        let (event, span) = self.next()?;
        let start = self.range(span);
        let nodes_before = self.read_so_far();
        if !matches!(event, Event::Alias(_)) {
            self.written += 1;
        }
        match event {
            Event::Scalar(value, style, anchor, tag) => {
                let node = Node {
                    span: start,
                    kind: Kind::Scalar {
                        value: value.into_owned(),
                        style,
                        tag: tag.map(|t| t.to_string()),
                    },
                };
                self.remember(anchor, &node, nodes_before);
                Ok(node)
            }
            Event::Alias(id) => {
                let Some((node, weight)) = self.anchors.get(&id) else {
                    return Err(self.error(start.start, "alias to an unknown anchor".into()));
                };
                // Checked before the copy is made, so refusing costs nothing.
                if self.expanded + weight > ALIAS_NODES + self.written {
                    let (line, column) = line_col(self.src, start.start);
                    return Err(YamlError::Aliases {
                        document: self.doc.max(1),
                        line,
                        column,
                        limit: ALIAS_NODES,
                    });
                }
                let node = node.clone();
                self.expanded += weight;
                Ok(node)
            }
            Event::SequenceStart(style, anchor, _) => {
                let mut items = Vec::new();
                let end = loop {
                    match self.next()? {
                        (Event::SequenceEnd, span) => break self.range(span),
                        other => {
                            self.peeked = Some(other);
                            items.push(self.node()?);
                        }
                    }
                };
                let flow = style == StructureStyle::Flow;
                // A block sequence's start event sits at its first item's
                // content; the sequence itself starts at that item's `-`.
                let from = match flow {
                    true => start.start,
                    false => {
                        let before = self.src[..start.start].trim_end_matches([' ', '\t']);
                        match before.ends_with('-') {
                            true => before.len() - 1,
                            false => start.start,
                        }
                    }
                };
                let node = Node {
                    span: from..collection_end(&start, &end, items.last()),
                    kind: Kind::Seq { flow, items },
                };
                self.remember(anchor, &node, nodes_before);
                Ok(node)
            }
            Event::MappingStart(style, anchor, _) => {
                let mut entries = Vec::new();
                let end = loop {
                    match self.next()? {
                        (Event::MappingEnd, span) => break self.range(span),
                        other => {
                            self.peeked = Some(other);
                            let k = self.node()?;
                            let v = self.node()?;
                            entries.push((k, v));
                        }
                    }
                };
                let node = Node {
                    span: start.start..collection_end(&start, &end, entries.last().map(|(_, v)| v)),
                    kind: Kind::Map {
                        flow: style == StructureStyle::Flow,
                        entries,
                    },
                };
                self.remember(anchor, &node, nodes_before);
                Ok(node)
            }
            e => Err(self.unexpected(&e, span)),
        }
    }
}

/// A flow collection ends at its closing bracket; a block one (whose end
/// event sits wherever the next token starts) at the end of its last child.
fn collection_end(start: &Range<usize>, end: &Range<usize>, last: Option<&Node>) -> usize {
    if start.end > start.start {
        end.end
    } else {
        last.map_or(start.start, |n| n.span.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_spans_aliases_and_merges() {
        let src = "# c\na: &x 'q'\nb: *x\nc: {d: 1, e: [true, ~, 1.5, \"s\"]}\nbase: &b {k: v}\nm:\n  <<: *b\n  own: 2\n---\n- !!str 12\n- 0x10\n";
        let docs = parse(src).unwrap();
        assert_eq!(docs.len(), 2);
        let r = &docs[0].root;
        assert_eq!(
            r.to_json(),
            json!({"a": "q", "b": "q", "c": {"d": 1, "e": [true, null, 1.5, "s"]}, "base": {"k": "v"}, "m": {"own": 2, "k": "v"}})
        );
        let b = r.get("b").unwrap();
        assert_eq!(&src[b.span.clone()], "'q'", "an alias points at its anchor");
        assert_eq!(
            &src[r.get("c").unwrap().span.clone()],
            "{d: 1, e: [true, ~, 1.5, \"s\"]}"
        );
        assert_eq!(r.pointer("/m/k").unwrap().as_str(), Some("v"));
        assert_eq!(docs[1].root.to_json(), json!(["12", 16]));
    }

    #[test]
    fn errors_name_document_line_and_column() {
        let e = parse("a: 1\n---\nb: [1\n").unwrap_err().to_string();
        assert!(e.starts_with("document 2: line "), "{e}");
    }

    /// `levels` levels of ten aliases each: 10^levels nodes if expanded.
    fn alias_bomb(levels: usize) -> String {
        let mut s = String::from(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: bomb}\ndata:\n  l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n",
        );
        for i in 1..levels {
            let p = i - 1;
            s.push_str(&format!(
                "  l{i}: &l{i} [*l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}]\n"
            ));
        }
        s
    }

    #[test]
    fn alias_expansion_is_bounded_and_named() {
        // Six levels: 10^6 nodes, small enough that without the bound the
        // test fails on the result rather than on memory.
        let src = format!("kind: Pod\n---\n{}", alias_bomb(6));
        let started = std::time::Instant::now();
        let e = match parse(&src) {
            Ok(docs) => panic!("read {} documents, aliases expanded", docs.len()),
            Err(e) => e,
        };
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert!(matches!(e, YamlError::Aliases { document: 2, .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("document 2: line 11 column ") && text.contains("100000 nodes"),
            "{text}"
        );
        // Four levels (12 330 nodes from aliases) are within the bound.
        let docs = parse(&alias_bomb(4)).unwrap();
        let l3 = docs[0].root.pointer("/data/l3").unwrap().to_json();
        assert_eq!(l3.pointer("/9/9/9/9").unwrap(), "x");
    }

    #[test]
    fn the_alias_bound_grows_with_the_text() {
        // Many aliases of a small anchor in a long file: linear, allowed.
        let mut src = String::from("a: &a {k: v}\nitems:\n");
        for _ in 0..40_000 {
            src.push_str("- [*a, 1, 2]\n");
        }
        let docs = parse(&src).unwrap();
        assert_eq!(
            docs[0].root.pointer("/items/39999/0/k").unwrap().as_str(),
            Some("v")
        );
    }
}
