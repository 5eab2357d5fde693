//! The node agent (`pinswap node-agent`): keeps the node mirror files of
//! [`super::render`] true on one node, run by a DaemonSet with the
//! runtime's directory as a hostPath.
//!
//! Each round it reads the config file again (a ConfigMap volume follows
//! edits), lists the source registries the target holds when the
//! allowlist has `"*"`, writes what changed and removes the files it wrote
//! that no longer apply. A config that does not load, or a target that
//! cannot be listed, leaves the files as they are: the node keeps pulling
//! as before. On SIGTERM it removes its files only when its DaemonSet is
//! gone or being deleted (an uninstall); a rolling update leaves them for
//! the next Pod.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use tracing::{info, warn};

use super::{Mode, NodeConfigError, Runtime, remove_stale, render_with, write};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::mirror::Mirror;

/// How often the config file is compared with the one the last round
/// read (a ConfigMap volume changes when the kubelet syncs it).
pub const CONFIG_POLL: Duration = Duration::from_secs(2);

/// What the agent runs with.
#[derive(Debug, Clone)]
pub struct Agent {
    /// The config file, read each round.
    pub config: PathBuf,
    /// The node's container runtime.
    pub runtime: Runtime,
    /// How tags resolve.
    pub mode: Mode,
    /// The runtime's directory, as mounted.
    pub dir: PathBuf,
    /// Between rounds.
    pub interval: Duration,
    /// `namespace/name` of the agent's DaemonSet: its files are removed at
    /// exit when it is gone. Without it they are always kept.
    pub daemonset: Option<(String, String)>,
}

/// Why a round changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The config file did not load.
    #[error("{0}")]
    Config(String),
    /// The target's repositories could not be listed (for `"*"`).
    #[error("listing the target's repositories for the \"*\" allowlist: {0}")]
    Target(String),
    /// Rendering or writing failed.
    #[error(transparent)]
    Files(#[from] NodeConfigError),
}

impl Agent {
    /// One round: renders from the config file and brings the directory
    /// in line. Returns the files written and removed.
    ///
    /// # Errors
    /// [`AgentError`]; nothing is removed then.
    pub async fn round(&self) -> Result<(Vec<PathBuf>, Vec<PathBuf>), AgentError> {
        let config = Config::load(&self.config).map_err(|e| AgentError::Config(e.to_string()))?;
        let mut mirrored = BTreeSet::new();
        if config.source.registries.iter().any(|r| r.registry == "*") {
            let mirror = Mirror::connect(&config, Arc::new(Metrics::new()))
                .await
                .map_err(|e| AgentError::Target(e.to_string()))?;
            mirrored = mirror
                .mirrored_registries()
                .await
                .map_err(|e| AgentError::Target(e.to_string()))?;
        }
        let files = render_with(&config, self.runtime, self.mode, &mirrored)?;
        // File by file: one someone else wrote holds back only itself.
        let mut written = Vec::new();
        for f in &files {
            match write(&self.dir, std::slice::from_ref(f)) {
                Ok(w) => written.extend(w),
                Err(e) => warn!(error = %e, "node mirror file not written"),
            }
        }
        let removed = remove_stale(&self.dir, self.runtime, &files)?;
        Ok((written, removed))
    }

    /// Rounds every [`Agent::interval`], and within [`CONFIG_POLL`] of a
    /// change to the config file, until `shutdown` resolves; then removes
    /// the files when the DaemonSet is gone.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let read = || std::fs::read(&self.config).ok();
            let seen = read();
            match self.round().await {
                Ok((written, removed)) => {
                    for f in &written {
                        info!(file = %self.dir.join(f).display(), "wrote node mirror configuration");
                    }
                    for f in &removed {
                        info!(file = %self.dir.join(f).display(), "removed node mirror configuration that no longer applies");
                    }
                }
                Err(e) => {
                    warn!(error = %e, "node mirror configuration left as it is");
                }
            }
            let next = tokio::time::Instant::now() + self.interval;
            let stop = loop {
                let step = next.min(tokio::time::Instant::now() + CONFIG_POLL);
                tokio::select! {
                    () = tokio::time::sleep_until(step) => {}
                    () = &mut shutdown => break true,
                }
                if step >= next || read() != seen {
                    break false;
                }
            };
            if stop {
                break;
            }
        }
        if self.uninstalled().await {
            match remove_stale(&self.dir, self.runtime, &[]) {
                Ok(removed) => {
                    for f in &removed {
                        info!(file = %self.dir.join(f).display(), "uninstalled: removed node mirror configuration");
                    }
                }
                Err(e) => warn!(error = %e, "uninstalled, but a file could not be removed"),
            }
        } else {
            info!("exiting; node mirror configuration kept for the next agent");
        }
    }

    /// Whether the DaemonSet is gone or being deleted. Unknown (no
    /// DaemonSet named, the API unreachable) counts as not: a node left
    /// with the files keeps pulling through the mirror, with the source as
    /// its fallback.
    async fn uninstalled(&self) -> bool {
        let Some((ns, name)) = &self.daemonset else {
            return false;
        };
        let client = match kube::Client::try_default().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "no API client; keeping the files");
                return false;
            }
        };
        let api: kube::Api<DaemonSet> = kube::Api::namespaced(client, ns);
        match api.get_opt(name).await {
            Ok(None) => true,
            Ok(Some(ds)) => ds.metadata.deletion_timestamp.is_some(),
            Err(e) => {
                warn!(error = %e, daemonset = %format!("{ns}/{name}"), "could not read the DaemonSet; keeping the files");
                false
            }
        }
    }
}
