//! skopeo as an independent peer: inspect and copy the same fixtures.
//!
//! Async (tokio::process) so a [`super::TcpCutProxy`] on the same runtime
//! keeps forwarding while skopeo runs.

use std::process::Output;

use tokio::process::Command;

use super::registry::TestRegistry;

/// One side of a skopeo command.
pub enum Loc<'a> {
    /// `docker://HOST/REPO:TAG` or `docker://HOST/REPO@DIGEST` on a test
    /// registry, with its TLS and credential flags.
    Registry {
        reg: &'a TestRegistry,
        repo: &'a str,
        reference: &'a str,
    },
    /// Any transport as skopeo spells it, e.g. `oci:/tmp/layout:tag`.
    Raw(String),
}

impl<'a> Loc<'a> {
    pub fn reg(reg: &'a TestRegistry, repo: &'a str, reference: &'a str) -> Loc<'a> {
        Loc::Registry {
            reg,
            repo,
            reference,
        }
    }

    fn transport(&self) -> String {
        match self {
            Loc::Registry {
                reg,
                repo,
                reference,
            } => docker_ref(reg, repo, reference),
            Loc::Raw(s) => s.clone(),
        }
    }

    /// Flags for this side; `prefix` is "", "src-" or "dest-".
    fn flags(&self, prefix: &str) -> Vec<String> {
        match self {
            Loc::Registry { reg, .. } => registry_flags(reg, prefix),
            Loc::Raw(_) => Vec::new(),
        }
    }
}

/// `docker://127.0.0.1:PORT/repo:tag` (or `@digest` for a `sha256:` reference).
pub fn docker_ref(reg: &TestRegistry, repo: &str, reference: &str) -> String {
    let sep = if reference.starts_with("sha256:") {
        '@'
    } else {
        ':'
    };
    format!("docker://{}/{repo}{sep}{reference}", reg.host())
}

fn registry_flags(reg: &TestRegistry, prefix: &str) -> Vec<String> {
    let mut f = Vec::new();
    if reg.is_tls() {
        f.push(format!("--{prefix}cert-dir={}", reg.cert_dir().display()));
    } else {
        f.push(format!("--{prefix}tls-verify=false"));
    }
    if let (Some(u), Some(p)) = (reg.username(), reg.password()) {
        f.push(format!("--{prefix}creds={u}:{p}"));
    }
    f
}

async fn run(args: &[String]) -> Output {
    Command::new("skopeo")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("run skopeo (apt-get install skopeo): {e}"))
}

fn check(args: &[String], out: Output) -> Vec<u8> {
    assert!(
        out.status.success(),
        "skopeo {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `skopeo inspect --raw`: the manifest bytes exactly as skopeo got them.
pub async fn inspect_raw(reg: &TestRegistry, repo: &str, reference: &str) -> Vec<u8> {
    let mut args = vec!["inspect".to_owned(), "--raw".to_owned()];
    args.extend(registry_flags(reg, ""));
    args.push(docker_ref(reg, repo, reference));
    check(&args, run(&args).await)
}

/// `skopeo inspect` (not raw): skopeo's parsed view, which reads the
/// config too.
pub async fn inspect(reg: &TestRegistry, repo: &str, reference: &str) -> serde_json::Value {
    let mut args = vec!["inspect".to_owned()];
    args.extend(registry_flags(reg, ""));
    args.push(docker_ref(reg, repo, reference));
    serde_json::from_slice(&check(&args, run(&args).await)).unwrap()
}

/// The manifest digest as skopeo computes it (`skopeo manifest-digest` of
/// the `inspect --raw` bytes).
pub async fn inspect_digest(reg: &TestRegistry, repo: &str, reference: &str) -> String {
    let raw = inspect_raw(reg, repo, reference).await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &raw).unwrap();
    let args = vec![
        "manifest-digest".to_owned(),
        file.path().display().to_string(),
    ];
    let out = check(&args, run(&args).await);
    String::from_utf8(out).unwrap().trim().to_owned()
}

/// `skopeo --insecure-policy copy [flags] [extra_args] SRC DST`.
/// Ok(stdout) or Err(stderr). Pass `--all` for indexes (without it skopeo
/// copies only the host's platform) and `--preserve-digests` to make skopeo
/// fail rather than rewrite a manifest.
pub async fn copy(src: &Loc<'_>, dst: &Loc<'_>, extra_args: &[&str]) -> Result<String, String> {
    let mut args = vec!["--insecure-policy".to_owned(), "copy".to_owned()];
    args.extend(src.flags("src-"));
    args.extend(dst.flags("dest-"));
    args.extend(extra_args.iter().map(|s| s.to_string()));
    args.push(src.transport());
    args.push(dst.transport());
    let out = run(&args).await;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "skopeo {} failed ({}):\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
