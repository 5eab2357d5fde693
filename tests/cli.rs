//! The CLI's own commands: `version`, `completions` and `man`, run as the
//! built binary.

mod common;

use common::run_pinswap;

#[tokio::test]
async fn version_names_the_build() {
    let (code, out, err) = run_pinswap(&["version"]).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], format!("pinswap {}", env!("CARGO_PKG_VERSION")));
    assert!(lines[1].starts_with("commit: "), "{out}");
    let arch = std::env::consts::ARCH;
    assert!(lines[2].starts_with(&format!("target: {arch}-")), "{out}");
    assert!(lines[3].contains("rustc "), "{out}");

    let (code, out, _) = run_pinswap(&["version", "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    for key in ["commit", "target", "rustc"] {
        assert!(v[key].is_string(), "{key}: {v}");
    }
    // Built from a git checkout, so the commit is known.
    let commit = v["commit"].as_str().unwrap();
    assert!(
        commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit()),
        "{v}"
    );
}

#[tokio::test]
async fn completions_cover_every_command_and_flag() {
    for (shell, marker) in [
        ("bash", "complete -F _pinswap"),
        ("zsh", "#compdef pinswap"),
        ("fish", "complete -c pinswap"),
    ] {
        let (code, out, err) = run_pinswap(&["completions", shell]).await;
        assert_eq!(code, 0, "{shell}: {err}");
        assert!(out.contains(marker), "{shell}:\n{out}");
        for word in ["copy", "serve", "mutate", "check", "from-file", "src-creds"] {
            assert!(out.contains(word), "{shell} lacks {word}");
        }
    }
    let (code, _, err) = run_pinswap(&["completions", "tcsh"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("possible values"), "{err}");
}

#[tokio::test]
async fn man_prints_a_page_and_writes_one_per_command() {
    let (code, out, err) = run_pinswap(&["man"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(".TH pinswap 1"), "{out}");
    assert!(out.contains("copy"), "{out}");

    let dir = tempfile::tempdir().unwrap();
    let pages = dir.path().join("man1");
    let (code, _, err) = run_pinswap(&["man", "--dir", pages.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{err}");
    let copy = std::fs::read_to_string(pages.join("pinswap-copy.1")).unwrap();
    assert!(copy.contains(".TH pinswap-copy 1"), "{copy}");
    assert!(copy.contains("from\\-file"), "{copy}");
    for page in ["pinswap.1", "pinswap-serve.1", "pinswap-config-validate.1"] {
        assert!(pages.join(page).is_file(), "{page}");
    }
}
