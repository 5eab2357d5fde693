//! The node agent (`pinswap node-agent`): keeps the node mirror files of
//! [`super::render`] true on one node, run by a DaemonSet with the
//! runtime's directory as a hostPath.
//!
//! Each round it reads the config file again (a ConfigMap volume follows
//! edits), lists the source registries the target holds when the
//! allowlist has `"*"`, fits the files to what the node configures itself
//! ([`super::fit`]: a source the node configures otherwise is refused, and
//! a file of ours for it removed), writes what changed and removes the
//! files it wrote that no longer apply. A config that does not load, or a target that
//! cannot be listed, leaves the files as they are: the node keeps pulling
//! as before. On SIGTERM it removes its files only when its DaemonSet is
//! gone or being deleted (an uninstall); a rolling update leaves them for
//! the next Pod.
//!
//! With [`Agent::registries_file`] it reads the set the leader lists
//! ([`super::registries`]) and sends the target nothing. Without, it lists
//! the target anonymously, or with the read-only credentials of
//! [`Agent::target_auth`]; never with the config's `auth` blocks, which
//! name the webhook's push credentials.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use tracing::{info, warn};

use super::{
    Mode, NodeConfigError, Runtime, default_registries_conf, fit, remove_stale, render_with, write,
};
use crate::config::{Auth, Config};
use crate::metrics::Metrics;
use crate::mirror::{Mirror, MirrorError};
use crate::registry::RegistryError;

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
    /// CRI-O's `registries.conf`, as mounted; `None`: beside [`Agent::dir`].
    pub registries_conf: Option<PathBuf>,
    /// Between rounds.
    pub interval: Duration,
    /// `namespace/name` of the agent's DaemonSet: its files are removed at
    /// exit when it is gone. Without it they are always kept.
    pub daemonset: Option<(String, String)>,
    /// A Docker config.json with read-only credentials for the target,
    /// for listing it; `None` lists anonymously.
    pub target_auth: Option<PathBuf>,
    /// The set the leader publishes ([`super::registries`]), read instead
    /// of listing the target.
    pub registries_file: Option<PathBuf>,
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
    /// The target refused the listing (401 or 403).
    #[error(
        "{registry} refused to list its repositories for the \"*\" allowlist (HTTP {status}) {who}; the files keep the registries as last listed"
    )]
    Refused {
        /// The target registry.
        registry: String,
        /// 401 or 403.
        status: u16,
        /// Whose request it refused, and what to do.
        who: &'static str,
    },
    /// Rendering or writing failed.
    #[error(transparent)]
    Files(#[from] NodeConfigError),
}

impl Agent {
    /// One round: renders from the config file and brings the directory
    /// in line. `known` holds the registries the target held at the last
    /// listing that worked (for `"*"`), used while listing fails. Returns
    /// the files written and removed.
    ///
    /// # Errors
    /// [`AgentError`]; nothing is removed then, except that a config with
    /// `source.imagePullSecrets` removes every file the agent wrote.
    pub async fn round(
        &self,
        known: &mut BTreeSet<String>,
    ) -> Result<(Vec<PathBuf>, Vec<PathBuf>), AgentError> {
        let config = Config::load(&self.config).map_err(|e| AgentError::Config(e.to_string()))?;
        // With nothing listed yet (a new agent Pod), a failed listing
        // leaves unknown which files of ours "*" wrote: none is removed or
        // rewritten then, and only files not there yet are written.
        let mut unknown = false;
        if config.source.registries.iter().any(|r| r.registry == "*") {
            let listed = match &self.registries_file {
                Some(file) => super::registries::read(file)
                    .map(|p| p.registries)
                    .map_err(|e| AgentError::Target(e.to_string())),
                None => self.list(&config).await,
            };
            match listed {
                Ok(held) => *known = held,
                // The registries the config names still get their files.
                Err(e) => {
                    unknown = known.is_empty();
                    warn!(error = %e, "the target's registries as last listed");
                }
            }
        }
        let files = match render_with(&config, self.runtime, self.mode, known) {
            Ok(f) => f,
            Err(
                e @ (NodeConfigError::PrivateImages
                | NodeConfigError::Platforms
                | NodeConfigError::RepairDigestOnly),
            ) => {
                // The target may now hold private images, or copies under
                // digests of their own that these nodes would not pull:
                // no node may serve them in place of what Pods name.
                let removed = remove_stale(&self.dir, self.runtime, &[])?;
                warn!(
                    removed = removed.len(),
                    "{e}; removed the node mirror configuration"
                );
                return Ok((Vec::new(), removed));
            }
            Err(e) => return Err(e.into()),
        };
        let registries_conf = self
            .registries_conf
            .clone()
            .unwrap_or_else(|| default_registries_conf(&self.dir));
        let fitted = fit(self.runtime, &self.dir, &registries_conf, files);
        for e in &fitted.refused {
            warn!(error = %e, "node mirror configuration refused for a source the node configures itself");
        }
        // File by file: one someone else wrote holds back only itself.
        let mut written = Vec::new();
        for f in &fitted.files {
            if unknown && std::fs::symlink_metadata(self.dir.join(&f.path)).is_ok() {
                continue;
            }
            match write(&self.dir, std::slice::from_ref(f)) {
                Ok(w) => written.extend(w),
                Err(e) => warn!(error = %e, "node mirror file not written"),
            }
        }
        // A refused source's file of ours goes: the node's own setting
        // applies again.
        let removed = match unknown {
            true => Vec::new(),
            false => remove_stale(&self.dir, self.runtime, &fitted.keep())?,
        };
        Ok((written, removed))
    }

    /// The registries the target holds images of, listed with
    /// [`Agent::target_auth`] or anonymously.
    ///
    /// # Errors
    /// [`AgentError::Refused`] when the target answers 401 or 403,
    /// [`AgentError::Target`] for any other failure.
    pub async fn list(&self, config: &Config) -> Result<BTreeSet<String>, AgentError> {
        let mirror = Mirror::connect(&self.listing_config(config), Arc::new(Metrics::new()))
            .await
            .map_err(|e| AgentError::Target(e.to_string()))?;
        mirror
            .mirrored_registries()
            .await
            .map_err(|e| self.listing_error(&e))
    }

    /// `config` with [`Agent::target_auth`] as the target's only
    /// credentials: the config's own `auth` files are the webhook's, not
    /// mounted here, and sources are never contacted.
    fn listing_config(&self, config: &Config) -> Config {
        let mut c = config.clone();
        for r in &mut c.source.registries {
            r.auth = None;
        }
        c.target.auth = self.target_auth.as_ref().map(|file| {
            let mut a = Auth::default();
            a.docker_config_file = Some(file.clone());
            a
        });
        c
    }

    fn listing_error(&self, e: &MirrorError) -> AgentError {
        let (registry, status) = match e {
            MirrorError::Registry(
                RegistryError::Unauthorized { registry, .. }
                | RegistryError::AuthRequired { registry, .. },
            ) => (registry, 401),
            MirrorError::Registry(RegistryError::Http {
                registry, status, ..
            }) if *status == 401 || *status == 403 => (registry, *status),
            other => return AgentError::Target(other.to_string()),
        };
        AgentError::Refused {
            registry: registry.clone(),
            status,
            who: match self.target_auth {
                None => {
                    "to an anonymous request; give the node agent read-only credentials for it (nodeAgent.registryAuthSecret, or pinswap manifests --node-agent-registry-auth-secret)"
                }
                Some(_) => "to the node agent's credentials (--target-auth)",
            },
        }
    }

    /// Rounds every [`Agent::interval`], and within [`CONFIG_POLL`] of a
    /// change to the config file, until `shutdown` resolves; then removes
    /// the files when the DaemonSet is gone.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut known = BTreeSet::new();
        loop {
            let read = || std::fs::read(&self.config).ok();
            let seen = read();
            let outcome = tokio::select! {
                r = self.round(&mut known) => r,
                () = &mut shutdown => break,
            };
            match outcome {
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

    /// Whether the DaemonSet, or the agent's access to it, is gone, or it
    /// is being deleted. Unknown (no
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
            // Its ServiceAccount (401) or Role (403) went first: an
            // uninstall deletes them with the DaemonSet, before the
            // garbage collector stops its Pods; a rolling update keeps them.
            Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
                info!(code = s.code, "the agent's access is gone with its install");
                true
            }
            Err(e) => {
                warn!(error = %e, daemonset = %format!("{ns}/{name}"), "could not read the DaemonSet; keeping the files");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(dir: &std::path::Path) -> Agent {
        Agent {
            config: dir.join("pinswap.yaml"),
            runtime: Runtime::Containerd,
            mode: Mode::Resolve,
            dir: dir.join("certs.d"),
            registries_conf: None,
            interval: Duration::from_secs(30),
            daemonset: None,
            target_auth: None,
            registries_file: None,
        }
    }

    #[tokio::test]
    async fn a_round_follows_the_config_and_private_images_remove_every_file() {
        let tmp = tempfile::tempdir().unwrap();
        let a = agent(tmp.path());
        let mut known = BTreeSet::new();
        std::fs::write(
            &a.config,
            "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: ghcr.io}]}\n",
        )
        .unwrap();
        let (written, removed) = a.round(&mut known).await.unwrap();
        assert_eq!(written.len(), 2);
        assert!(removed.is_empty());
        assert!(a.round(&mut known).await.unwrap().0.is_empty(), "unchanged");

        // A source dropped from the config: its file goes.
        std::fs::write(
            &a.config,
            "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}]}\n",
        )
        .unwrap();
        let (_, removed) = a.round(&mut known).await.unwrap();
        assert_eq!(removed, [PathBuf::from("ghcr.io/hosts.toml")]);

        // A config that does not load leaves the files.
        std::fs::write(&a.config, "target: [\n").unwrap();
        assert!(matches!(
            a.round(&mut known).await,
            Err(AgentError::Config(_))
        ));
        assert!(a.dir.join("quay.io/hosts.toml").exists());

        // The target may hold private images now: every file goes.
        std::fs::write(
            &a.config,
            "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}], imagePullSecrets: true}\n",
        )
        .unwrap();
        let (_, removed) = a.round(&mut known).await.unwrap();
        assert_eq!(removed, [PathBuf::from("quay.io/hosts.toml")]);
        assert!(!a.dir.join("quay.io").exists());
    }
}
