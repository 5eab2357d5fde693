//! The registries a `"*"` allowlist has at the target, listed once per
//! cluster: the leader lists the target (or ECR's repositories) and
//! writes the set into the ConfigMap [`CONFIG_MAP`], which the node
//! agents' DaemonSet mounts, so the target's requests do not grow with the
//! number of nodes, and the agents hold no credentials for it.
//!
//! The install renders the ConfigMap, empty and marked with
//! [`ANNOTATION`]; the leader only updates one so marked (never creates
//! one, nor writes over another's), with the `resourceVersion` it read,
//! and only when the set changed. An agent reads [`KEY`] from the volume;
//! while it is absent (not listed yet), the agent keeps its files as they
//! are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::info;

use super::published::{Lines, Outcome, marked, while_leading};

use crate::mirror::Mirror;

/// The ConfigMap's name.
pub const CONFIG_MAP: &str = "pinswap-registries";
/// Its data key, and the file's name in the agents' volume.
pub const KEY: &str = "registries.json";
/// The annotation that marks the ConfigMap as the one the leader writes.
pub const ANNOTATION: &str = "pinswap.dev/registries";
/// Its value.
pub const ANNOTATION_VALUE: &str = "written by the leader";
/// Between the leader's listings (the agents' round).
pub const INTERVAL: Duration = Duration::from_secs(30);

/// The set as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Published {
    /// When the leader listed this set (it is written only when it
    /// changes).
    pub listed: Timestamp,
    /// The source registries the target holds images of.
    pub registries: BTreeSet<String>,
}

/// Errors about the published set.
#[derive(Debug, thiserror::Error)]
pub enum RegistriesError {
    /// The agent's file is not there yet: the leader has not listed.
    #[error("{path}: the leader has not published the target's registries yet")]
    NotPublished {
        /// The file.
        path: String,
    },
    /// The agent's file cannot be read or is not a published set.
    #[error("{path}: {why}")]
    Unreadable {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// The API server refused or failed.
    #[error("ConfigMap {namespace}/{CONFIG_MAP}: {source}")]
    Api {
        /// Its namespace.
        namespace: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The target could not be listed.
    #[error("listing the target's repositories: {0}")]
    Target(#[source] Box<crate::mirror::MirrorError>),
}

/// Reads the set an agent's volume holds at `path`.
///
/// # Errors
/// [`RegistriesError::NotPublished`] when the file is absent or empty
/// (the install's empty ConfigMap); [`RegistriesError::Unreadable`].
pub fn read(path: &Path) -> Result<Published, RegistriesError> {
    let shown = path.display().to_string();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RegistriesError::NotPublished { path: shown });
        }
        Err(e) => {
            return Err(RegistriesError::Unreadable {
                path: shown,
                why: e.to_string(),
            });
        }
    };
    if text.trim().is_empty() {
        return Err(RegistriesError::NotPublished { path: shown });
    }
    serde_json::from_str(&text).map_err(|e| RegistriesError::Unreadable {
        path: shown,
        why: format!("not a published set of registries: {e}"),
    })
}

/// What a leader's round did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Round {
    /// Written: the set changed.
    Written(BTreeSet<String>),
    /// The ConfigMap holds this set already.
    Unchanged,
    /// No ConfigMap marked as the leader's (none installed, or another's
    /// under that name): nothing written.
    NotInstalled,
}

/// The leader's side: lists the target and writes the set.
pub struct Publisher {
    mirror: Arc<Mirror>,
    api: Api<ConfigMap>,
    namespace: String,
}

impl Publisher {
    /// Publishes `mirror`'s target's registries into [`CONFIG_MAP`] in
    /// `namespace`.
    pub fn new(mirror: Arc<Mirror>, client: kube::Client, namespace: &str) -> Self {
        Self {
            mirror,
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
        }
    }

    fn api_error(&self, source: kube::Error) -> RegistriesError {
        RegistriesError::Api {
            namespace: self.namespace.clone(),
            source,
        }
    }

    /// One round: read the ConfigMap; when it is the leader's, list the
    /// target and write the set if it changed.
    ///
    /// # Errors
    /// [`RegistriesError`]; nothing is written then.
    pub async fn round(&self) -> Result<Round, RegistriesError> {
        let Some(mut cm) = marked(&self.api, CONFIG_MAP, ANNOTATION, ANNOTATION_VALUE)
            .await
            .map_err(|e| self.api_error(e))?
        else {
            return Ok(Round::NotInstalled);
        };
        let registries = self
            .mirror
            .mirrored_registries()
            .await
            .map_err(|e| RegistriesError::Target(Box::new(e)))?
            .into_iter()
            // The agents use this many, in name order: the ConfigMap
            // stays small whatever names are pushed to the target.
            .take(super::ANY_REGISTRIES_MAX)
            .collect::<BTreeSet<String>>();
        let current = cm
            .data
            .as_ref()
            .and_then(|d| d.get(KEY))
            .and_then(|t| serde_json::from_str::<Published>(t).ok());
        if current.is_some_and(|c| c.registries == registries) {
            return Ok(Round::Unchanged);
        }
        let published = Published {
            listed: Timestamp::now(),
            registries: registries.clone(),
        };
        let text = serde_json::to_string(&published).expect("a set serialises");
        cm.data = Some(BTreeMap::from([(KEY.to_owned(), text)]));
        // With the resourceVersion read: a conflict waits for the next
        // round.
        self.api
            .replace(CONFIG_MAP, &PostParams::default(), &cm)
            .await
            .map_err(|e| self.api_error(e))?;
        Ok(Round::Written(registries))
    }
}

/// Rounds every [`INTERVAL`] while this replica leads.
pub async fn run(publisher: Publisher, leader: watch::Receiver<bool>) {
    let lines = Lines {
        configmap: CONFIG_MAP,
        absent: "no ConfigMap for the node agents' registries (no node agent with \"*\" installed): nothing published",
        failed: "the target's registries could not be published for the node agents; they keep the set published last",
    };
    while_leading(leader, INTERVAL, lines, || async {
        match publisher.round().await {
            Ok(Round::Written(set)) => {
                info!(
                    registries = set.len(),
                    configmap = CONFIG_MAP,
                    "published the target's registries for the node agents"
                );
                Outcome::Done
            }
            Ok(Round::Unchanged) => Outcome::Done,
            Ok(Round::NotInstalled) => Outcome::NotInstalled,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_reads_a_set_and_tells_one_not_yet_published() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(KEY);
        assert!(matches!(
            read(&path),
            Err(RegistriesError::NotPublished { .. })
        ));
        std::fs::write(&path, "").unwrap();
        assert!(matches!(
            read(&path),
            Err(RegistriesError::NotPublished { .. })
        ));
        std::fs::write(&path, "{\"registries\": 1}").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("not a published set"), "{e}");
        let set = Published {
            listed: Timestamp::from_second(1).unwrap(),
            registries: ["docker.io".to_owned(), "quay.io".to_owned()].into(),
        };
        std::fs::write(&path, serde_json::to_string(&set).unwrap()).unwrap();
        assert_eq!(read(&path).unwrap(), set);
    }
}
