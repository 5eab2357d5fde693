//! The file map of docs/architecture.md (§9) against the tree: every file
//! under `src/` and `scripts/`, every integration test and every harness
//! file is named there, and every file it names exists, so the map cannot
//! go stale.

use std::collections::BTreeSet;
use std::path::Path;

/// The section of `doc` from the heading that starts with `heading` to the
/// next heading of its level.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("no heading {heading:?}"));
    let rest = &doc[start + heading.len()..];
    match rest.find("\n## ") {
        Some(end) => &rest[..end],
        None => rest,
    }
}

/// What a bare file name ends with; other words in backticks with a dot
/// are config keys (`recovery.evict`).
const FILE_ENDINGS: [&str; 7] = [".rs", ".sh", ".py", ".cjs", ".go", ".yaml", ".json"];

/// The files a table row names. A path in backticks with a `/` sets the
/// directory that the bare file names after it (`pods.rs`) are in; a path
/// ending in `/` is a directory, not a file.
fn named_files(row: &str) -> Vec<String> {
    let mut files = Vec::new();
    let mut dir = String::new();
    for (i, part) in row.split('`').enumerate() {
        // Prose, globs and patterns (`os/arch[/variant]`) are not paths.
        let path_like = part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c));
        if i % 2 == 0 || !path_like {
            continue;
        }
        if let Some(slash) = part.rfind('/') {
            dir = part[..=slash].to_owned();
            if slash + 1 < part.len() {
                files.push(part.to_owned());
            }
        } else if !dir.is_empty() && FILE_ENDINGS.iter().any(|e| part.ends_with(e)) {
            files.push(format!("{dir}{part}"));
        }
    }
    files
}

fn tree(dir: &Path, root: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            tree(&path, root, out);
        } else {
            let rel = path.strip_prefix(root).unwrap();
            out.insert(rel.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn the_file_map_names_every_source_file_and_script() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let map = section(&doc, "## 9. Files");
    let named: BTreeSet<String> = map
        .lines()
        .filter(|l| l.starts_with("| `"))
        .flat_map(named_files)
        .collect();
    let mut files = BTreeSet::new();
    for dir in ["src", "scripts"] {
        tree(&root.join(dir), root, &mut files);
    }
    let unnamed: Vec<_> = files.difference(&named).collect();
    assert!(
        unnamed.is_empty(),
        "in the tree, not in docs/architecture.md §9: {unnamed:?}"
    );
    let gone: Vec<_> = named.iter().filter(|f| !root.join(f).exists()).collect();
    assert!(
        gone.is_empty(),
        "in docs/architecture.md §9, not in the tree: {gone:?}"
    );
}

#[test]
fn a_row_names_bare_files_in_the_directory_before_them() {
    assert_eq!(
        named_files(
            "| `src/watch/mod.rs`, `pods.rs`, `src/install/` | x (`manifests.rs`; `a b`, `os/arch[/v]`) |"
        ),
        [
            "src/watch/mod.rs",
            "src/watch/pods.rs",
            "src/install/manifests.rs"
        ]
    );
}

/// The words in backticks of the §9 row that starts with `start`.
fn row_words(map: &str, start: &str) -> BTreeSet<String> {
    let row = map
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no row {start:?} in docs/architecture.md §9"));
    row.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The `.rs` files directly in `dir`, by name.
fn rust_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".rs"))
        .collect();
    names.sort();
    names
}

#[test]
fn the_file_map_names_every_test_file_and_harness_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let map = section(&doc, "## 9. Files");
    // The cluster suite (`cluster_*.rs`) has a row of its own.
    let tests = row_words(map, "| `tests/*.rs`");
    let unnamed: Vec<_> = rust_files(&root.join("tests"))
        .into_iter()
        .filter(|f| !f.starts_with("cluster_"))
        .map(|f| f.trim_end_matches(".rs").to_owned())
        .filter(|stem| !tests.contains(stem))
        .collect();
    assert!(
        unnamed.is_empty(),
        "test files not in the `tests/*.rs` row of docs/architecture.md §9: {unnamed:?}"
    );
    let gone: Vec<_> = tests
        .iter()
        .filter(|t| *t != "tests/*.rs" && !root.join(format!("tests/{t}.rs")).exists())
        .collect();
    assert!(
        gone.is_empty(),
        "named in the `tests/*.rs` row, not in tests/: {gone:?}"
    );
    let harness = row_words(map, "| `tests/common/`");
    let unnamed: Vec<_> = rust_files(&root.join("tests/common"))
        .into_iter()
        .filter(|f| !harness.contains(f))
        .collect();
    assert!(
        unnamed.is_empty(),
        "harness files not in the `tests/common/` row of docs/architecture.md §9: {unnamed:?}"
    );
}

/// The markdown files a reader follows: the READMEs and every page under
/// docs/.
fn pages(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![
        root.join("README.md"),
        root.join("charts/pinswap/README.md"),
    ];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The pinswap commands in a page's `sh` and `console` blocks: continued
/// lines joined, each command of a pipeline or list on its own, its words
/// as the shell splits them, redirections dropped.
fn pinswap_commands(page: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut line = String::new();
    for raw in page.lines() {
        let t = raw.trim();
        if let Some(lang) = t.strip_prefix("```") {
            in_block = !in_block && matches!(lang, "sh" | "console" | "bash");
            continue;
        }
        if !in_block {
            continue;
        }
        let t = t.strip_prefix("$ ").unwrap_or(t);
        if let Some(head) = t.strip_suffix('\\') {
            line.push_str(head);
            line.push(' ');
            continue;
        }
        line.push_str(t);
        let full = std::mem::take(&mut line);
        // A comment ends the command; `#` inside quotes is rare in these
        // pages and never in a pinswap command.
        let code = full.split(" #").next().unwrap_or("");
        for part in code.split(['|', ';']).flat_map(|p| p.split("&&")) {
            let Some(words) = shlex::split(part.trim()) else {
                continue;
            };
            let Some(first) = words.first() else { continue };
            if !(first == "pinswap" || first.ends_with("/pinswap")) || first.contains('$') {
                continue;
            }
            let mut args = vec!["pinswap".to_owned()];
            let mut rest = words[1..].iter();
            while let Some(w) = rest.next() {
                if matches!(w.as_str(), ">" | ">>" | "<" | "2>" | "2>&1") {
                    if w != "2>&1" {
                        rest.next();
                    }
                    continue;
                }
                if w.starts_with('>') || w.starts_with("2>") {
                    continue;
                }
                args.push(w.clone());
            }
            out.push(args);
        }
    }
    out
}

#[test]
fn every_pinswap_command_shown_in_the_docs_parses() {
    use clap::Parser;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seen = 0;
    let mut failures = Vec::new();
    for page in pages(root) {
        let text = std::fs::read_to_string(&page).unwrap();
        for args in pinswap_commands(&text) {
            seen += 1;
            if let Err(e) = pinswap::cli::Cli::try_parse_from(&args) {
                // --help and --version end parsing on purpose.
                use clap::error::ErrorKind::{DisplayHelp, DisplayVersion};
                if !matches!(e.kind(), DisplayHelp | DisplayVersion) {
                    let first = e.to_string().lines().next().unwrap_or("").to_owned();
                    failures.push(format!(
                        "{}: `{}`: {first}",
                        page.strip_prefix(root).unwrap().display(),
                        args.join(" ")
                    ));
                }
            }
        }
    }
    assert!(seen > 20, "only {seen} pinswap commands found in the docs");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_command_that_no_longer_parses_is_caught() {
    let page = "```sh\npinswap copy --to docker://m.example.com \\\n  --no-such-flag a b # c\ntarget/release/pinswap version | head\n```\n";
    let cmds = pinswap_commands(page);
    assert_eq!(cmds.len(), 2, "{cmds:?}");
    use clap::Parser;
    assert!(pinswap::cli::Cli::try_parse_from(&cmds[0]).is_err());
    assert!(pinswap::cli::Cli::try_parse_from(&cmds[1]).is_ok());
}
