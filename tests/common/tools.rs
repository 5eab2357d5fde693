//! The signing and artifact clients `scripts/build-tools.sh` builds into
//! `target/tools/`: cosign and oras run as processes against registries on
//! 127.0.0.1, and a registry that serves the OCI 1.1 referrers API
//! (go-containerregistry's, in memory). pinswap never links them.
//!
//! cosign runs offline: a key pair, no transparency log, no Fulcio, and
//! TUF_ROOT and HOME in a temp dir with SIGSTORE_NO_CACHE, so it reads no
//! trust root from the network or from the machine.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

/// `target/tools/NAME`, or a panic saying how to build it.
pub fn tool(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/tools")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run scripts/build-tools.sh (scripts/test.sh does)",
        p.display()
    );
    p
}

/// A running referrers-API registry; killed when dropped.
pub struct ReferrersRegistry {
    child: tokio::process::Child,
    host: String,
}

impl ReferrersRegistry {
    /// Starts one on 127.0.0.1 and a free port.
    pub async fn start() -> ReferrersRegistry {
        let mut child = tokio::process::Command::new(tool("referrers-registry"))
            .args(["-addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("referrers-registry did not start within 10 s")
            .unwrap()
            .expect("referrers-registry printed nothing");
        let host = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("referrers-registry said {line:?}"))
            .to_owned();
        ReferrersRegistry { child, host }
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        self.host.clone()
    }
}

impl Drop for ReferrersRegistry {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// cosign with a fresh key pair and an offline environment.
pub struct Cosign {
    dir: tempfile::TempDir,
}

/// The outcome of a tool run.
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Cosign {
    /// Generates `cosign.key` / `cosign.pub` (empty password).
    pub async fn new() -> Cosign {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("tuf")).unwrap();
        let c = Cosign { dir };
        let r = c.run(&["generate-key-pair"]).await;
        assert!(r.ok, "cosign generate-key-pair: {}", r.stderr);
        c
    }

    /// The public key's path.
    pub fn public_key(&self) -> PathBuf {
        self.dir.path().join("cosign.pub")
    }

    fn key(&self) -> String {
        self.dir.path().join("cosign.key").display().to_string()
    }

    /// Runs cosign with `args` in the key directory, offline.
    pub async fn run(&self, args: &[&str]) -> Run {
        let home = self.dir.path();
        let out = tokio::process::Command::new(tool("cosign"))
            .args(args)
            .current_dir(home)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", home)
            .env("TUF_ROOT", home.join("tuf"))
            .env("SIGSTORE_NO_CACHE", "true")
            .env("COSIGN_PASSWORD", "")
            .env("COSIGN_YES", "true")
            // Anything that tried a host but 127.0.0.1 fails fast.
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("HTTP_PROXY", "http://127.0.0.1:9")
            .env("NO_PROXY", "127.0.0.1")
            .output();
        let out = tokio::time::timeout(Duration::from_secs(120), out)
            .await
            .expect("cosign ran over 120 s")
            .unwrap();
        Run {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// `cosign sign` of `image` (`host/repo@digest`) with the key, no tlog;
    /// `mode` is cosign's `--registry-referrers-mode` (`legacy` writes the
    /// `.sig` tag, `oci-1-1` an OCI 1.1 referrer).
    pub async fn sign(&self, image: &str, mode: Mode) {
        let key = self.key();
        let mut args = vec![
            "sign",
            "--key",
            &key,
            "--tlog-upload=false",
            "--use-signing-config=false",
            "--allow-insecure-registry",
            "--allow-http-registry",
        ];
        args.extend(mode.flags());
        args.push(image);
        let r = self.run(&args).await;
        assert!(r.ok, "cosign sign {image}: {}", r.stderr);
    }

    /// `cosign attest` of an SPDX predicate over `image`.
    pub async fn attest(&self, image: &str, mode: Mode) {
        let predicate = self.dir.path().join("sbom.spdx.json");
        std::fs::write(
            &predicate,
            br#"{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"pinswap-test","dataLicense":"CC0-1.0","documentNamespace":"https://pinswap.invalid/spdx/test","creationInfo":{"created":"2024-01-01T00:00:00Z","creators":["Tool: pinswap-tests"]},"packages":[]}"#,
        )
        .unwrap();
        let (key, predicate) = (self.key(), predicate.display().to_string());
        let mut args = vec![
            "attest",
            "--key",
            &key,
            "--type",
            "spdxjson",
            "--predicate",
            &predicate,
            "--tlog-upload=false",
            "--use-signing-config=false",
            "--allow-insecure-registry",
            "--allow-http-registry",
        ];
        // attest has no --registry-referrers-mode: the bundle format decides.
        args.extend(mode.verify_flags());
        args.push(image);
        let r = self.run(&args).await;
        assert!(r.ok, "cosign attest {image}: {}", r.stderr);
    }

    /// `cosign verify` (or `verify-attestation` with `attestation`) of
    /// `image` with the public key, no tlog.
    pub async fn verify(&self, image: &str, attestation: bool, mode: Mode) -> Run {
        let key = self.public_key().display().to_string();
        let verb = if attestation {
            "verify-attestation"
        } else {
            "verify"
        };
        let mut args = vec![
            verb,
            "--key",
            &key,
            "--insecure-ignore-tlog=true",
            "--allow-insecure-registry",
            "--allow-http-registry",
        ];
        if attestation {
            args.extend(["--type", "spdxjson"]);
        }
        args.extend(mode.verify_flags());
        args.push(image);
        self.run(&args).await
    }
}

/// Where cosign puts and looks for signatures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// cosign's tags: `sha256-<hex>.sig` / `.att`.
    Legacy,
    /// OCI 1.1 referrers (the API, or the fallback tag where it is missing).
    Oci11,
}

impl Mode {
    fn flags(self) -> Vec<&'static str> {
        match self {
            Mode::Legacy => vec![
                "--new-bundle-format=false",
                "--registry-referrers-mode=legacy",
            ],
            Mode::Oci11 => vec!["--new-bundle-format=true"],
        }
    }

    fn verify_flags(self) -> Vec<&'static str> {
        match self {
            Mode::Legacy => vec!["--new-bundle-format=false"],
            Mode::Oci11 => vec!["--new-bundle-format=true"],
        }
    }
}

/// `oras discover` of `image` on a plain-HTTP registry: the referrers'
/// digests, sorted, every level. Not their artifactTypes: the referrers
/// registry derives those from the config's mediaType, Distribution's
/// fallback index keeps what its writer put there.
pub async fn oras_discover(image: &str) -> Vec<String> {
    let out = tokio::process::Command::new(tool("oras"))
        .args(["discover", "--plain-http", "--format", "json", image])
        .env("HOME", std::env::temp_dir())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "oras discover {image}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut found = Vec::new();
    collect(&v, &mut found);
    found.sort();
    found
}

fn collect(v: &serde_json::Value, out: &mut Vec<String>) {
    for r in v["referrers"].as_array().into_iter().flatten() {
        out.push(r["digest"].as_str().unwrap_or_default().to_owned());
        collect(r, out);
    }
}
