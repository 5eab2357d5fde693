//! The module map of docs/architecture.md §4 against the code. Which file
//! depends on which is read from the paths each file writes (`crate::…`,
//! `super::…`, `self::…`, a child module's name), with re-exports followed
//! to the file that defines the name. Test modules are left out. A method
//! called on a type defined in another file is not a path and is not seen,
//! so a type split over files (`Registry`) keeps its lower files free of
//! calls into the higher ones by review, not by this test.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One source file: its module path and its text without comments,
/// literals and test modules.
struct Source {
    file: String,
    module: Vec<String>,
    code: String,
}

/// `text` with comments, string and char literals blanked (lines kept).
fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == 'r'
            && matches!(next, Some('"') | Some('#'))
            && (i == 0 || !is_ident(b[i - 1]))
        {
            // Raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            while j < b.len() {
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == '\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if b.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            out.push_str("\"\"");
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                out.push_str("' '");
                i = j + 1;
            } else if b.get(i + 2) == Some(&'\'') {
                out.push_str("' '");
                i += 3;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `code` without `#[cfg(test)]` items (the test modules).
fn without_tests(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at its `;` or at the `}` closing its first `{`.
        let mut depth = 0;
        let mut end = after.len();
        for (k, ch) in after.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn sources(src: &Path) -> Vec<Source> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|p| {
            let rel = p.strip_prefix(src).unwrap().to_string_lossy().into_owned();
            let mut module: Vec<String> = rel
                .trim_end_matches(".rs")
                .split('/')
                .map(str::to_owned)
                .collect();
            match module.last().map(String::as_str) {
                Some("main") if module.len() == 1 => return None,
                Some("lib") if module.len() == 1 => module.clear(),
                Some("mod") => {
                    module.pop();
                }
                _ => {}
            }
            let text = std::fs::read_to_string(&p).unwrap();
            Some(Source {
                file: format!("src/{rel}"),
                module,
                code: without_tests(&strip(&text)),
            })
        })
        .collect()
}

/// Reads one path from `chars[i..]` (after its prefix): segments joined by
/// `::`, ending in a name or a `{…}` group. Pushes every full path.
fn read_path(
    chars: &[char],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut path = prefix;
    loop {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if chars.get(i) == Some(&'{') {
            i += 1;
            loop {
                while i < chars.len() && (chars[i].is_whitespace() || chars[i] == ',') {
                    i += 1;
                }
                if i >= chars.len() || chars[i] == '}' {
                    return i + 1;
                }
                i = read_path(chars, i, path.clone(), out);
                // Skip `as Alias` and anything to the item's end.
                while i < chars.len() && chars[i] != ',' && chars[i] != '}' {
                    i += 1;
                }
            }
        }
        let start = i;
        while i < chars.len() && (is_ident(chars[i]) || chars[i] == '*') {
            i += 1;
        }
        if start == i {
            out.push(path);
            return i;
        }
        let seg: String = chars[start..i].iter().collect();
        if seg != "self" || path.is_empty() {
            path.push(seg);
        }
        if chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':') {
            i += 2;
        } else {
            out.push(path);
            return i;
        }
    }
}

/// Every crate path `s` writes, made absolute, with the line it is on.
fn paths(s: &Source, children: &BTreeSet<String>) -> Vec<(Vec<String>, usize)> {
    let chars: Vec<char> = s.code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\n' {
            line += 1;
        }
        let boundary = i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == ':');
        if !boundary || !is_ident(chars[i]) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && is_ident(chars[j]) {
            j += 1;
        }
        let word: String = chars[i..j].iter().collect();
        let followed = chars.get(j) == Some(&':') && chars.get(j + 1) == Some(&':');
        let base: Option<Vec<String>> = match word.as_str() {
            _ if !followed => None,
            "crate" => Some(Vec::new()),
            "self" => Some(s.module.clone()),
            "super" => {
                let mut m = s.module.clone();
                m.pop();
                // super::super::…
                let mut k = j + 2;
                while chars[k..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                    m.pop();
                    k += 7;
                }
                let mut found = Vec::new();
                let end = read_path(&chars, k, m, &mut found);
                out.extend(found.into_iter().map(|p| (p, line)));
                i = end;
                continue;
            }
            w if children.contains(w) => {
                let mut m = s.module.clone();
                m.push(w.to_owned());
                let mut found = Vec::new();
                let end = read_path(&chars, j + 2, m, &mut found);
                out.extend(found.into_iter().map(|p| (p, line)));
                i = end;
                continue;
            }
            _ => None,
        };
        match base {
            Some(m) => {
                let mut found = Vec::new();
                i = read_path(&chars, j + 2, m, &mut found);
                out.extend(found.into_iter().map(|p| (p, line)));
            }
            None => i = j,
        }
    }
    out
}

struct Graph {
    /// Module path → file.
    files: BTreeMap<Vec<String>, String>,
    /// (file, name) → the file a `pub use` there takes `name` from.
    reexports: HashMap<(String, String), Vec<String>>,
    /// file → file → the first line naming it.
    edges: BTreeMap<String, BTreeMap<String, usize>>,
}

impl Graph {
    fn build(src: &Path) -> Graph {
        let all = sources(src);
        let files: BTreeMap<Vec<String>, String> = all
            .iter()
            .map(|s| (s.module.clone(), s.file.clone()))
            .collect();
        let children = |m: &Vec<String>| -> BTreeSet<String> {
            files
                .keys()
                .filter(|k| k.len() == m.len() + 1 && k.starts_with(m))
                .map(|k| k.last().unwrap().clone())
                .collect()
        };
        let mut g = Graph {
            files: files.clone(),
            reexports: HashMap::new(),
            edges: BTreeMap::new(),
        };
        let mut written = Vec::new();
        for s in &all {
            let found = paths(s, &children(&s.module));
            // `pub use a::b::Name;` (or `pub(crate) use`) re-exports Name.
            for stmt in s.code.split(';') {
                let t = stmt.trim();
                let Some(rest) = ["pub use ", "pub(crate) use ", "pub(super) use "]
                    .iter()
                    .find_map(|p| t.rfind(p).map(|at| &t[at + p.len()..]))
                else {
                    continue;
                };
                let mut names = Vec::new();
                let chars: Vec<char> = rest.chars().collect();
                let prefix = match rest.split("::").next() {
                    Some("crate") => Vec::new(),
                    Some("super") => {
                        let mut m = s.module.clone();
                        m.pop();
                        m
                    }
                    Some("self") => s.module.clone(),
                    _ => s.module.clone(),
                };
                let skip = match rest.split("::").next() {
                    Some("crate" | "super" | "self") => rest.find("::").unwrap() + 2,
                    _ => 0,
                };
                let skip = rest[..skip].chars().count();
                read_path(&chars, skip, prefix, &mut names);
                for n in names {
                    if let Some(last) = n.last() {
                        g.reexports
                            .insert((s.file.clone(), last.clone()), n.clone());
                    }
                }
            }
            written.push((s.file.clone(), found));
        }
        for (file, found) in written {
            for (path, line) in found {
                if let Some(to) = g.resolve(&path, 0)
                    && to != file
                {
                    g.edges
                        .entry(file.clone())
                        .or_default()
                        .entry(to)
                        .or_insert(line);
                }
            }
        }
        g
    }

    /// The file that defines what `path` names.
    fn resolve(&self, path: &[String], depth: usize) -> Option<String> {
        let (len, file) = (0..=path.len())
            .rev()
            .find_map(|n| self.files.get(&path[..n]).map(|f| (n, f)))?;
        if depth < 8
            && let Some(name) = path.get(len)
            && let Some(to) = self.reexports.get(&(file.clone(), name.clone()))
            && let Some(f) = self.resolve(to, depth + 1)
        {
            return Some(f);
        }
        Some(file.clone())
    }

    /// The arrows between the direct children of `dir` (`mod` for its own
    /// file), each with the first place that draws it.
    fn within(&self, dir: &str) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for (from, tos) in &self.edges {
            let Some(a) = Graph::unit(dir, from) else {
                continue;
            };
            for (to, line) in tos {
                if let Some(b) = Graph::unit(dir, to)
                    && a != b
                {
                    out.push((a.clone(), b, format!("{from}:{line} → {to}")));
                }
            }
        }
        out
    }

    /// The direct child of `dir` that `file` is in (`src/a/b/c.rs` in
    /// `src/a/` is `b`), or `mod` for the folder's own file.
    fn unit(dir: &str, file: &str) -> Option<String> {
        let rest = file.strip_prefix(dir)?;
        let first = rest.split('/').next()?;
        Some(first.trim_end_matches(".rs").to_owned())
    }
}

/// A cycle in `edges`, as the nodes along it.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut HashMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_owned(), 1);
        stack.push(n.to_owned());
        for m in edges.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let at = stack.iter().position(|s| s == m).unwrap();
                    let mut c = stack[at..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.to_owned(), 2);
        None
    }
    let mut state = HashMap::new();
    for n in edges.keys() {
        if !state.contains_key(n)
            && let Some(c) = visit(n, edges, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The arrows a paragraph of docs/architecture.md draws between names in
/// backticks: `a`, `b` → `c` → `d`, and `e` → `f`. Clauses end at `;`,
/// `, and ` or a line's end; `x::y` stands for `x`; words in parentheses
/// are prose. Names in a line saying "leaves every layer uses" may be used
/// by every name.
fn arrows(text: &str) -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut leaves = BTreeSet::new();
    let mut plain = String::new();
    let mut depth = 0;
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    let names = |s: &str| -> Vec<String> {
        s.split('`')
            .skip(1)
            .step_by(2)
            .map(|n| n.split("::").next().unwrap().to_owned())
            .collect()
    };
    for line in plain.lines() {
        if line.contains("leaves every layer uses") {
            leaves.extend(names(line));
            continue;
        }
        for clause in line.split(';').flat_map(|c| c.split(", and ")) {
            let clause = clause.replace("also reach", "→");
            let groups: Vec<Vec<String>> = clause.split('→').map(names).collect();
            for w in groups.windows(2) {
                for a in &w[0] {
                    for b in &w[1] {
                        edges.entry(a.clone()).or_default().insert(b.clone());
                    }
                }
            }
        }
    }
    (edges, leaves)
}

fn reaches(edges: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_owned()];
    while let Some(n) = todo.pop() {
        for m in edges.get(&n).into_iter().flatten() {
            if m == to {
                return true;
            }
            if seen.insert(m.clone()) {
                todo.push(m.clone());
            }
        }
    }
    false
}

fn doc() -> String {
    std::fs::read_to_string(root().join("docs/architecture.md")).unwrap()
}

/// The text of §4 between `from` and the next blank line.
fn paragraph(doc: &str, from: &str) -> String {
    let at = doc
        .find(from)
        .unwrap_or_else(|| panic!("docs/architecture.md has no {from:?}"));
    let rest = &doc[at + from.len()..];
    let rest = rest.trim_start_matches('\n');
    rest[..rest.find("\n\n").unwrap_or(rest.len())].to_owned()
}

/// Every dependency between top modules is an arrow of §4 (or a path of
/// them, or a leaf), and none points back up.
#[test]
fn modules_depend_on_each_other_as_the_map_draws() {
    let g = Graph::build(&root().join("src"));
    let (allowed, leaves) = arrows(&paragraph(
        &doc(),
        "Dependencies point one way, from the entry points down to the leaves:",
    ));
    let top = |file: &str| Graph::unit("src/", file).unwrap();
    let mut modules: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stray = Vec::new();
    for (from, tos) in &g.edges {
        let a = top(from);
        if a == "lib" {
            continue;
        }
        for (to, line) in tos {
            let b = top(to);
            if a == b || b == "lib" {
                continue;
            }
            modules.entry(a.clone()).or_default().insert(b.clone());
            if !leaves.contains(&b) && !reaches(&allowed, &a, &b) {
                stray.push(format!("{from}:{line} → {to}"));
            }
        }
    }
    assert!(
        stray.is_empty(),
        "dependencies docs/architecture.md §4 does not draw:\n{}",
        stray.join("\n")
    );
    assert_eq!(cycle(&modules), None, "modules in a cycle");
}

/// Inside every folder the files import one way: no cycle among a
/// folder's files (a subfolder counts as one). Its `mod.rs` is the
/// folder's face, declaring the files and extended by them (`impl Mirror`
/// in `access.rs`), so its own arrows are not counted.
#[test]
fn the_files_of_each_folder_import_one_way() {
    let g = Graph::build(&root().join("src"));
    let mut dirs: BTreeSet<String> = BTreeSet::new();
    for f in g.files.values() {
        let mut d = f.as_str();
        while let Some(slash) = d.rfind('/') {
            d = &d[..slash];
            dirs.insert(format!("{d}/"));
        }
    }
    let mut cycles = Vec::new();
    for dir in &dirs {
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut lines: HashMap<(String, String), String> = HashMap::new();
        for (a, b, place) in g.within(dir) {
            if a != "mod" && b != "mod" {
                edges.entry(a.clone()).or_default().insert(b.clone());
                lines.entry((a, b)).or_insert(place);
            }
        }
        if let Some(c) = cycle(&edges) {
            let evidence: Vec<&String> = c
                .windows(2)
                .map(|w| &lines[&(w[0].clone(), w[1].clone())])
                .collect();
            cycles.push(format!("{dir}: {}\n  {evidence:#?}", c.join(" → ")));
        }
    }
    assert!(
        cycles.is_empty(),
        "files in a cycle:\n{}",
        cycles.join("\n")
    );
}

/// `registry/`'s files import only from those after them in §4's order.
#[test]
fn the_registry_files_import_in_the_documented_order() {
    let g = Graph::build(&root().join("src"));
    let text = paragraph(
        &doc(),
        "Inside `registry/` too, each file imports only from those after it:",
    );
    let sentence = text
        .split(". ")
        .next()
        .unwrap()
        .replace("all of them", "`*`");
    let (allowed, _) = arrows(&sentence);
    let named: BTreeSet<&String> = allowed.keys().chain(allowed.values().flatten()).collect();
    let dir = "src/registry/";
    let mut stray = Vec::new();
    let mut unnamed = BTreeSet::new();
    for (a, b, place) in g.within(dir) {
        if a == "mod" {
            continue;
        }
        for n in [&a, &b] {
            if !named.contains(n) {
                unnamed.insert(n.clone());
            }
        }
        let to_all = allowed.get("*").is_some_and(|t| t.contains(&b));
        if !to_all && !reaches(&allowed, &a, &b) {
            stray.push(place);
        }
    }
    assert!(
        unnamed.is_empty(),
        "registry files the order in docs/architecture.md §4 leaves out: {unnamed:?}"
    );
    assert!(
        stray.is_empty(),
        "imports against the order in docs/architecture.md §4:\n{}",
        stray.join("\n")
    );
}

#[test]
fn paths_are_read_through_groups_aliases_and_reexports() {
    let s = Source {
        file: "src/a/b.rs".into(),
        module: vec!["a".into(), "b".into()],
        code: without_tests(&strip(
            "use super::{c::{D, e as f}, g};\nuse crate::h::I;\n// super::no\nlet x = \"super::no\";\nself::k::L;\n#[cfg(test)]\nmod tests { use super::super::no; }\n",
        )),
    };
    let got: Vec<(String, usize)> = paths(&s, &BTreeSet::from(["k".to_owned()]))
        .into_iter()
        .map(|(p, l)| (p.join("::"), l))
        .collect();
    assert_eq!(
        got,
        [
            ("a::c::D".to_owned(), 1),
            ("a::c::e".to_owned(), 1),
            ("a::g".to_owned(), 1),
            ("h::I".to_owned(), 2),
            ("a::b::k::L".to_owned(), 5),
        ]
    );
    let (edges, leaves) = arrows(
        "- `a`, `b` → `c` (`x`) → `d::e`, and `f` → `c`;\n- `m` are leaves every layer uses.",
    );
    assert!(reaches(&edges, "a", "d") && reaches(&edges, "f", "d"));
    assert!(!reaches(&edges, "c", "a") && !reaches(&edges, "a", "x"));
    assert_eq!(leaves, BTreeSet::from(["m".to_owned()]));
}
