//! What the leader's publishers for the node agents share
//! ([`super::registries`], [`super::warm`]): a ConfigMap the install
//! renders marked as the leader's, and rounds while this replica leads.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use tokio::sync::watch;
use tracing::{debug, warn};

/// The ConfigMap `name` when it carries `annotation: value`; `None` when
/// it is absent, another's, or not ours to read (403: no Role, so no node
/// agent reading it installed).
///
/// # Errors
/// kube's error.
pub(super) async fn marked(
    api: &Api<ConfigMap>,
    name: &str,
    annotation: &str,
    value: &str,
) -> Result<Option<ConfigMap>, kube::Error> {
    let cm = match api.get_opt(name).await {
        Ok(Some(cm)) => cm,
        Ok(None) => return Ok(None),
        Err(kube::Error::Api(s)) if s.code == 403 => return Ok(None),
        Err(e) => return Err(e),
    };
    let ours = cm
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotation))
        .is_some_and(|v| v == value);
    Ok(ours.then_some(cm))
}

/// How a round ended, for [`while_leading`]'s log lines.
pub(super) enum Outcome {
    /// Written or unchanged (the round logs a write itself).
    Done,
    /// No ConfigMap of the leader's.
    NotInstalled,
    /// The round failed.
    Failed(String),
}

/// What [`while_leading`] logs, once per change of state.
pub(super) struct Lines {
    /// The ConfigMap.
    pub configmap: &'static str,
    /// At debug level, when there is no ConfigMap of the leader's.
    pub absent: &'static str,
    /// At warn level, when a round fails.
    pub failed: &'static str,
}

/// Runs `round` every `interval` while this replica leads (`leader`).
pub(super) async fn while_leading<F, Fut>(
    mut leader: watch::Receiver<bool>,
    interval: Duration,
    lines: Lines,
    mut round: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Outcome>,
{
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        let (mut failing, mut absent) = (false, false);
        loop {
            match round().await {
                Outcome::Done => failing = false,
                Outcome::NotInstalled => {
                    if !absent {
                        debug!(configmap = lines.configmap, "{}", lines.absent);
                    }
                    absent = true;
                }
                Outcome::Failed(e) => {
                    if !failing {
                        warn!(error = %e, "{}", lines.failed);
                    }
                    failing = true;
                }
            }
            let lost = async {
                let _ = leader.wait_for(|l| !*l).await;
            };
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = lost => break,
            }
        }
    }
}
