//! Running the `pinswap` binary as a user would, with no ambient
//! credentials: every test says where its credentials come from.

use std::path::Path;

use serde_json::Value;

use super::{cache_home, pinswap_bin};

/// What one run left: its exit code and output.
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    /// Asserts that standard error says `what`.
    #[track_caller]
    pub fn says(&self, what: impl AsRef<str>) {
        let what = what.as_ref();
        assert!(
            self.stderr.contains(what),
            "stderr does not say {what:?}:\n{}",
            self.stderr
        );
    }
}

/// Runs `pinswap args` with `env` set, no credential variables or Docker
/// config from the environment, and the blob location cache in `cache`
/// (a fresh directory when `None`). Async, so servers in the test process
/// keep answering.
pub async fn pinswap_in(cache: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Out {
    let fresh = cache_home();
    let mut cmd = tokio::process::Command::new(pinswap_bin());
    cmd.args(args)
        .env("XDG_CACHE_HOME", cache.unwrap_or(fresh.path()))
        .env_remove("PINSWAP_SRC_CREDS")
        .env_remove("PINSWAP_DEST_CREDS")
        .env_remove("REGISTRY_AUTH_FILE")
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().await.expect("run pinswap");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// As [`pinswap_in`] with a fresh cache.
pub async fn pinswap_env(args: &[&str], env: &[(&str, &str)]) -> Out {
    pinswap_in(None, args, env).await
}

/// As [`pinswap_env`] with no variables set.
pub async fn pinswap(args: &[&str]) -> Out {
    pinswap_in(None, args, &[]).await
}

/// `pinswap copy --json args` with the cache in `cache` (fresh when
/// `None`): the run, and the first image's report (`Null` when the output
/// has none).
pub async fn try_copy_json(cache: Option<&Path>, args: &[&str]) -> (Out, Value) {
    let mut all = vec!["copy", "--json"];
    all.extend_from_slice(args);
    let out = pinswap_in(cache, &all, &[]).await;
    let v: Value = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
    let first = v["images"][0].clone();
    (out, first)
}

/// As [`try_copy_json`], asserting that every image copied.
pub async fn copy_json(cache: Option<&Path>, args: &[&str]) -> Value {
    let (out, first) = try_copy_json(cache, args).await;
    assert_eq!(
        out.code, 0,
        "pinswap copy --json {args:?} failed:\n{}{}",
        out.stderr, out.stdout
    );
    let v: Value = serde_json::from_str(&out.stdout).expect("--json output is JSON");
    assert_eq!(v["failed"], 0, "{v}");
    first
}
