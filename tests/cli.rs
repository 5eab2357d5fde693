//! The CLI's own commands (`version`, `completions`, `man`) and the
//! conventions every command shares (unreadable files, logging options,
//! bare references), run as the built binary.

mod common;

use common::fixtures::Image;
use common::{TestRegistry, push_image, run_pinswap};

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

/// Every command that reads a file named on its command line says the same
/// when it cannot: exit 2, `error: [FLAG ]PATH: cannot read: REASON`.
#[tokio::test]
async fn a_file_that_cannot_be_read_is_named_alike_in_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pinswap.yaml");
    std::fs::write(
        &config,
        "target: {registry: registry.example.com/m}\nsource: {registries: [{registry: docker.io}]}\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let missing = dir.path().join("missing");
    let missing = missing.to_str().unwrap();
    let agent_dir = dir.path().to_str().unwrap();
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["serve", "-c", missing], format!("--config {missing}")),
        (
            vec![
                "serve",
                "-c",
                config,
                "--tls-cert",
                missing,
                "--tls-key",
                missing,
            ],
            format!("--tls-cert {missing}"),
        ),
        (vec!["mutate", "-c", missing], format!("--config {missing}")),
        (vec!["config", "validate", missing], missing.to_owned()),
        (vec!["config", "convert", missing], missing.to_owned()),
        (
            vec!["mutate", "-c", config, "-f", missing],
            missing.to_owned(),
        ),
        (
            vec!["clusters", "list", "-c", missing],
            format!("--config {missing}"),
        ),
        (
            vec!["clusters", "forget", "-c", missing, "old"],
            format!("--config {missing}"),
        ),
        (
            vec!["manifests", "-c", missing],
            format!("--config {missing}"),
        ),
        (
            vec!["node-config", "-c", missing],
            format!("--config {missing}"),
        ),
        (
            vec!["node-agent", "-c", missing, "--dir", agent_dir],
            format!("--config {missing}"),
        ),
        (
            vec![
                "node-agent",
                "-c",
                config,
                "--dir",
                agent_dir,
                "--target-auth",
                missing,
            ],
            format!("--target-auth {missing}"),
        ),
        (
            vec![
                "copy",
                "--from-file",
                missing,
                "--to",
                "registry.example.com/m",
            ],
            format!("--from-file {missing}"),
        ),
        (
            vec![
                "copy",
                "--authfile",
                missing,
                "a.example/b:1",
                "c.example/d:1",
            ],
            format!("--authfile {missing}"),
        ),
        (
            vec!["check", "--ca-cert", missing, "a.example/b:1"],
            format!("--ca-cert {missing}"),
        ),
    ];
    for (args, named) in cases {
        let (code, out, err) = run_pinswap(&args).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        let want = format!("error: {named}: cannot read: ");
        assert!(
            err.lines().next().is_some_and(|l| l.starts_with(&want)),
            "{args:?}: expected {want:?} first:\n{err}"
        );
    }
}

/// `--log-level` and `--log-format` are every command's: `--help` shows
/// them under their own heading, apart from the command's options.
#[tokio::test]
async fn logging_options_have_their_own_heading() {
    for command in [vec!["--help"], vec!["copy", "--help"], vec!["mutate", "-h"]] {
        let (code, out, err) = run_pinswap(&command).await;
        assert_eq!(code, 0, "{command:?}: {err}");
        let (options, logging) = out
            .split_once("\nLogging:\n")
            .unwrap_or_else(|| panic!("{command:?}: no Logging heading:\n{out}"));
        for flag in ["--log-level", "--log-format"] {
            assert!(logging.contains(flag), "{command:?}: {flag}:\n{out}");
            assert!(!options.contains(flag), "{command:?}: {flag}:\n{out}");
        }
    }
}

/// `copy --to` takes a bare target as SOURCE and DESTINATION take bare
/// references, and refuses a layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_to_takes_a_bare_target() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(1, 611);
    push_image(&src, "team/app", Some("v1"), &img).await;
    let list = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(list.path(), format!("{}/team/app:v1\n", src.host())).unwrap();
    let list = list.path().to_str().unwrap();
    let to = format!("{}/mirror", dst.host());
    let (code, out, err) = run_pinswap(&["copy", "--from-file", list, "--to", &to]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 images: 1 copied"), "{out}");
    let repo = format!("mirror/127.0.0.1_{}/team/app", src.port());
    assert_eq!(
        dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(img.digest.as_str())
    );
    // With docker:// it is the same target: nothing left to copy.
    let (code, out, err) = run_pinswap(&[
        "copy",
        "--from-file",
        list,
        "--to",
        &format!("docker://{to}"),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 up to date"), "{out}");

    let (code, _, err) = run_pinswap(&["copy", "--from-file", list, "--to", "oci:/tmp/x"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("a mirror target is a registry: expected [docker://]REGISTRY[/prefix]"),
        "{err}"
    );
}

/// With sharing off, `clusters list` says so, naming the key, without
/// asking the target.
#[tokio::test]
async fn clusters_list_with_sharing_off_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pinswap.yaml");
    // A target nobody answers at: the answer must not depend on it.
    std::fs::write(
        &config,
        "target: {registry: \"127.0.0.1:1/m\"}\nsource: {registries: [{registry: docker.io}]}\ncluster: eu-west\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    for json in [false, true] {
        let mut args = vec!["clusters", "list", "-c", config];
        if json {
            args.push("--json");
        }
        let (code, out, err) = run_pinswap(&args).await;
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty(), "no list: {out}");
        assert!(
            err.starts_with(&format!(
                "error: {config}: sharing is off (sharing.enabled: false)"
            )),
            "{err}"
        );
        assert!(!err.contains("cannot reach"), "{err}");
    }
}
