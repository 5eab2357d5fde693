//! Build information for `pinswap version`: the git commit (from
//! `PINSWAP_GIT_COMMIT`, else `git`, else none), the target triple and the
//! rustc version, as compile-time environment variables.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PINSWAP_GIT_COMMIT");
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let commit = std::env::var("PINSWAP_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    // A new commit moves HEAD or the branch it names (`--git-path` finds
    // both in a worktree too).
    let mut watched = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        // A missing path would make cargo rerun this on every build.
        if let Some(path) = git(&["rev-parse", "--git-path", &name])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!(
        "cargo:rustc-env=PINSWAP_GIT_COMMIT={}",
        commit.unwrap_or_default()
    );
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=PINSWAP_TARGET={target}");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    println!("cargo:rustc-env=PINSWAP_RUSTC={version}");
}
