//! The node agent's pre-warm (`prewarm`, docs/configuration.md#prewarm):
//! when the agent starts on a node, it pulls the warm set the leader
//! published ([`super::warm`]) through the runtime's CRI image service,
//! within the node's bounds, then labels the node [`WARM_LABEL`] and
//! removes the startup taint the config names, so Pods land on a node that
//! holds their images.
//!
//! Bounds: `concurrency` pulls at once; no pull starts once the image
//! filesystem has grown by `maxBytes`, has less than `freeSpaceFloor`
//! free, or `deadline` has passed (a pull in flight is cut at it). Whatever
//! stops it, the node is labelled and released by the deadline: a warm
//! set never keeps a node from taking Pods.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::Api;
use kube::api::{Patch, PatchParams};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::json;
use tracing::{error, info, warn};

use super::cri::{AuthConfig, Cri, CriError};
use super::warm::{self, WarmSet};
use crate::config::Prewarm;

/// The node label the agent sets: `true` when the whole set is on the
/// node, `partial` when a bound, the deadline or a failed pull left some
/// out.
pub const WARM_LABEL: &str = "pinswap.dev/warm";
/// The annotation that says what the pre-warm did, in one line.
pub const REPORT_ANNOTATION: &str = "pinswap.dev/warm-report";
/// How often the agent asks for the warm set until the leader has
/// published one.
const SET_POLL: Duration = Duration::from_secs(2);
/// Attempts at removing the taint when the Node changes meanwhile.
const TAINT_ATTEMPTS: usize = 5;

/// Errors of the pre-warm.
#[derive(Debug, thiserror::Error)]
pub enum PrewarmError {
    /// The runtime could not be asked.
    #[error(transparent)]
    Cri(#[from] CriError),
    /// The Node could not be read or patched.
    #[error("Node {node}: {source}")]
    Node {
        /// The node.
        node: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("Node {node}: no answer from the API server within 30s")]
    Timeout {
        /// The node.
        node: String,
    },
    /// The credentials file could not be read.
    #[error("{0}")]
    Auth(String),
}

/// Why pulling stopped before the set was on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `deadline` passed.
    Deadline,
    /// The image filesystem grew by `maxBytes`.
    MaxBytes,
    /// The image filesystem had less than `freeSpaceFloor` free.
    FreeSpace,
    /// The leader published no set before the deadline.
    NoSet,
    /// The image filesystem's free space could not be read.
    Unmeasured,
}

impl Stop {
    /// In the report and the logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Stop::Deadline => "the deadline passed",
            Stop::MaxBytes => "the image filesystem grew by maxBytes",
            Stop::FreeSpace => "free space on the image filesystem fell below freeSpaceFloor",
            Stop::NoSet => "no warm set was published before the deadline",
            Stop::Unmeasured => "the image filesystem's free space could not be read",
        }
    }
}

/// What one pre-warm did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Images the set lists.
    pub listed: usize,
    /// Already on the node.
    pub present: usize,
    /// Pulled now.
    pub pulled: usize,
    /// Pulls that failed.
    pub failed: usize,
    /// Not tried: a bound or the deadline stopped the pulls first.
    pub skipped: usize,
    /// How much the image filesystem grew.
    pub bytes: u64,
    /// Why pulling stopped early.
    pub stopped: Option<Stop>,
}

impl Report {
    /// The whole set is on the node.
    pub fn warm(&self) -> bool {
        self.stopped.is_none() && self.failed == 0 && self.skipped == 0
    }

    fn line(&self, seconds: f64) -> String {
        let mut s = format!(
            "{} of {} images on the node ({} pulled, {} already present, {} failed, {} not tried), image filesystem +{} MiB, {:.1}s",
            self.present + self.pulled,
            self.listed,
            self.pulled,
            self.present,
            self.failed,
            self.skipped,
            self.bytes >> 20,
            seconds
        );
        if let Some(stop) = self.stopped {
            s.push_str("; stopped: ");
            s.push_str(stop.as_str());
        }
        s
    }
}

/// The pre-warm's progress, as metrics.
#[derive(Debug, Default)]
pub struct PrewarmMetrics {
    /// `pinswap_prewarm_images{state}`.
    pub images: Family<Vec<(String, String)>, Gauge>,
    /// `pinswap_prewarm_image_fs_growth_bytes`.
    pub bytes: Gauge,
    /// `pinswap_prewarm_done`: 1 once the node is labelled.
    pub done: Gauge,
}

impl PrewarmMetrics {
    /// Registers them in `registry`.
    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        registry.register(
            "pinswap_prewarm_images",
            "Images of the warm set on this node, by state: listed, present, pulled, failed, skipped",
            self.images.clone(),
        );
        registry.register(
            "pinswap_prewarm_image_fs_growth_bytes",
            "How much the image filesystem grew while the warm set was pulled",
            self.bytes.clone(),
        );
        registry.register(
            "pinswap_prewarm_done",
            "1 once the node is labelled pinswap.dev/warm (and its startup taint removed)",
            self.done.clone(),
        );
    }

    fn set(&self, state: &str, n: usize) {
        self.images
            .get_or_create(&vec![("state".to_owned(), state.to_owned())])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// What the pre-warm runs with.
pub struct Prewarmer {
    /// The runtime.
    pub cri: Cri,
    /// The API server.
    pub client: kube::Client,
    /// The install's namespace (the warm set's ConfigMap).
    pub namespace: String,
    /// This node's name.
    pub node: String,
    /// Where to measure free space; `None`: the mountpoint the runtime
    /// reports for its image filesystem.
    pub image_fs: Option<PathBuf>,
    /// A Docker config.json with read-only credentials for the target.
    pub target_auth: Option<PathBuf>,
    /// The target: the agent pulls only images under it. `None`: any,
    /// pinned by digest.
    pub target: Option<crate::reference::MirrorTarget>,
    /// Progress.
    pub metrics: Arc<PrewarmMetrics>,
}

/// The shared state of one run's pulls.
struct Pulls {
    report: Mutex<Report>,
    /// Free bytes of the image filesystem when the pulls began.
    free0: u64,
    grown: AtomicU64,
}

/// How long one API request may take: kube's client has no read timeout.
const API_TIMEOUT: Duration = Duration::from_secs(30);
/// After the node is marked, how long the agent still looks for the
/// startup taint: an autoscaler may add it to the Node after it registers.
const LATE_TAINT_WINDOW: Duration = Duration::from_secs(120);
/// Between looks for a late taint, and the longest wait between attempts
/// at marking the node.
const MARK_RETRY_MAX: Duration = Duration::from_secs(30);

impl Prewarmer {
    /// Waits for the warm set, pulls it within `settings`' bounds, then
    /// labels the node and removes the startup taint. The deadline counts
    /// from the Node's creation, so an agent restarted on a new node does
    /// not extend it. A node already marked and untainted (an agent Pod
    /// replaced on an old node) is left as it is. Marking is retried until
    /// it succeeds.
    pub async fn run(&self, settings: &Prewarm) -> Report {
        let started = Instant::now();
        let taint = settings.startup_taint.as_deref();
        let node = self.node_state(taint).await;
        if let Some((true, false, _)) = node {
            info!(node = %self.node, "the node was pre-warmed before; nothing to do");
            self.metrics.done.set(1);
            return Report::default();
        }
        // Time the node has existed counts against the deadline.
        let age = node.and_then(|(_, _, age)| age).unwrap_or_default();
        let deadline = started + settings.deadline.saturating_sub(age);
        let report = match self.wait_for_set(deadline).await {
            Some(set) => self.pull(&set, settings, deadline).await,
            None => Report {
                stopped: Some(Stop::NoSet),
                ..Report::default()
            },
        };
        let line = report.line(started.elapsed().as_secs_f64());
        match report.warm() {
            true => info!(node = %self.node, report = %line, "the node is warm"),
            false => {
                warn!(node = %self.node, report = %line, "the node is released only partly warm")
            }
        }
        let mut wait = Duration::from_secs(1);
        loop {
            match self.mark(&report, &line, taint).await {
                Ok(()) => break,
                Err(e) => {
                    error!(error = %e, retry_in = ?wait, "the node could not be marked after the pre-warm; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MARK_RETRY_MAX);
                }
            }
        }
        self.metrics.done.set(1);
        // A taint an autoscaler adds after registration comes late.
        if let Some(key) = taint {
            let until = Instant::now() + LATE_TAINT_WINDOW;
            while Instant::now() < until {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if let Err(e) = self.untaint(key).await {
                    warn!(error = %e, "the Node could not be read for a late startup taint");
                }
            }
        }
        report
    }

    /// Whether the Node is labelled warm, whether it has `taint`, and its
    /// age; `None` when it cannot be read.
    async fn node_state(&self, taint: Option<&str>) -> Option<(bool, bool, Option<Duration>)> {
        let api: Api<Node> = Api::all(self.client.clone());
        let node = match tokio::time::timeout(API_TIMEOUT, api.get(&self.node)).await {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                warn!(node = %self.node, error = %e, "the Node cannot be read; pre-warming as a new node");
                return None;
            }
            Err(_) => return None,
        };
        let marked = node
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(WARM_LABEL));
        let tainted = taint.is_some_and(|key| {
            node.spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == key))
        });
        let age = node.metadata.creation_timestamp.and_then(|t| {
            let secs = k8s_openapi::jiff::Timestamp::now()
                .duration_since(t.0)
                .as_secs();
            u64::try_from(secs).ok().map(Duration::from_secs)
        });
        Some((marked, tainted, age))
    }

    /// The published set, asked for every [`SET_POLL`] until `deadline`.
    async fn wait_for_set(&self, deadline: Instant) -> Option<WarmSet> {
        let mut said = false;
        loop {
            let read = tokio::time::timeout(
                API_TIMEOUT,
                warm::read(self.client.clone(), &self.namespace),
            );
            match read.await {
                Ok(Ok(Some(set))) => return Some(set),
                Ok(Ok(None)) if !said => {
                    info!("waiting for the leader to publish the warm set");
                    said = true;
                }
                Ok(Err(e)) if !said => {
                    warn!(error = %e, "the warm set cannot be read yet");
                    said = true;
                }
                _ => {}
            }
            if Instant::now() + SET_POLL >= deadline {
                return None;
            }
            tokio::time::sleep(SET_POLL).await;
        }
    }

    async fn pull(&self, set: &WarmSet, settings: &Prewarm, deadline: Instant) -> Report {
        let listed = set.images.len();
        self.metrics.set("listed", listed);
        let unmeasured = || {
            warn!("the image filesystem cannot be measured; nothing is pulled");
            Report {
                listed,
                skipped: listed,
                stopped: Some(Stop::Unmeasured),
                ..Report::default()
            }
        };
        let fs_path = match &self.image_fs {
            Some(p) => p.clone(),
            None => match self.cri.image_fs().await {
                Ok(fs) => fs.mountpoint,
                Err(e) => {
                    warn!(error = %e, "the runtime does not say where its images are");
                    return unmeasured();
                }
            },
        };
        // Without the filesystem's free space neither bound can hold.
        let Ok(free0) = super::cri::free_bytes(&fs_path) else {
            return unmeasured();
        };
        let state = Pulls {
            report: Mutex::new(Report {
                listed,
                ..Report::default()
            }),
            free0,
            grown: AtomicU64::new(0),
        };
        let state = &state;
        let fs_path = &fs_path;
        futures::stream::iter(&set.images)
            .for_each_concurrent(settings.concurrency, |w| async move {
                let outcome = self.one(&w.image, settings, deadline, state, fs_path).await;
                let mut r = state.report.lock().unwrap_or_else(|e| e.into_inner());
                match outcome {
                    Outcome::Present => r.present += 1,
                    Outcome::Pulled => r.pulled += 1,
                    Outcome::Failed => r.failed += 1,
                    Outcome::Skipped(why) => {
                        r.skipped += 1;
                        r.stopped.get_or_insert(why);
                    }
                }
                self.metrics.set("present", r.present);
                self.metrics.set("pulled", r.pulled);
                self.metrics.set("failed", r.failed);
                self.metrics.set("skipped", r.skipped);
            })
            .await;
        let mut r = state
            .report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        r.bytes = state.grown.load(Ordering::Relaxed);
        r
    }

    /// One image: left when present, else pulled if the bounds allow.
    /// Growth and free space are read from the filesystem itself when each
    /// pull is about to start; pulls already running may add up to
    /// `concurrency` images past a bound.
    async fn one(
        &self,
        image: &str,
        settings: &Prewarm,
        deadline: Instant,
        state: &Pulls,
        fs_path: &std::path::Path,
    ) -> Outcome {
        if Instant::now() >= deadline {
            return Outcome::Skipped(Stop::Deadline);
        }
        if !self.is_target_digest(image) {
            warn!(
                image,
                "the warm set names an image that is not the target's, pinned by digest; not pulled"
            );
            return Outcome::Failed;
        }
        if let Ok(Some(_)) = self.cri.image_status(image).await {
            return Outcome::Present;
        }
        let Ok(free) = super::cri::free_bytes(fs_path) else {
            return Outcome::Skipped(Stop::Unmeasured);
        };
        let grown = state.free0.saturating_sub(free);
        state.grown.fetch_max(grown, Ordering::Relaxed);
        self.metrics
            .bytes
            .set(i64::try_from(grown).unwrap_or(i64::MAX));
        if grown >= settings.max_bytes {
            return Outcome::Skipped(Stop::MaxBytes);
        }
        if free < settings.free_space_floor {
            return Outcome::Skipped(Stop::FreeSpace);
        }
        let auth = match self.auth_for(image).await {
            Ok(a) => a,
            Err(e) => {
                warn!(image, error = %e, "no credentials for a warm image; not pulled");
                return Outcome::Failed;
            }
        };
        let began = Instant::now();
        let Some(left) = deadline
            .checked_duration_since(began)
            .filter(|d| !d.is_zero())
        else {
            return Outcome::Skipped(Stop::Deadline);
        };
        match self.cri.pull(image, auth, left).await {
            Ok(_) => {
                info!(
                    image,
                    seconds = began.elapsed().as_secs_f64(),
                    "pulled a warm image"
                );
                Outcome::Pulled
            }
            // Cut at the deadline, however the runtime or the client says it.
            Err(_) if Instant::now() >= deadline => Outcome::Skipped(Stop::Deadline),
            Err(e) => {
                warn!(image, error = %e, "a warm image could not be pulled");
                Outcome::Failed
            }
        }
    }

    /// Whether `image` is `<target registry>/…@sha256:…`: the set is the
    /// leader's, but the agent pulls nothing else whoever wrote it.
    fn is_target_digest(&self, image: &str) -> bool {
        let Ok(r) = crate::reference::Reference::parse(image) else {
            return false;
        };
        r.digest().is_some()
            && r.tag().is_none()
            && self.target.as_ref().is_none_or(|t| t.contains(&r))
    }

    /// The target's read-only credentials for `image`'s registry, from
    /// [`Prewarmer::target_auth`]; `None`: anonymous (or the runtime's own
    /// configuration).
    async fn auth_for(&self, image: &str) -> Result<Option<AuthConfig>, PrewarmError> {
        let Some(file) = self.target_auth.clone() else {
            return Ok(None);
        };
        let registry = image.split('/').next().unwrap_or_default().to_owned();
        let sources = crate::registry::auth::CredentialSources {
            authfile: Some(file),
            docker_config: false,
        };
        let host = registry.clone();
        let found = tokio::task::spawn_blocking(move || sources.lookup_blocking(&host))
            .await
            .map_err(|e| PrewarmError::Auth(e.to_string()))?
            .map_err(|e| PrewarmError::Auth(e.to_string()))?;
        Ok(match found {
            Some(oci_client::secrets::RegistryAuth::Basic(username, password)) => {
                Some(AuthConfig {
                    username,
                    password,
                    server_address: registry,
                })
            }
            _ => None,
        })
    }

    /// Removes `taint` (a key) from the node, then labels it: a node
    /// labelled warm has been released.
    async fn mark(
        &self,
        report: &Report,
        line: &str,
        taint: Option<&str>,
    ) -> Result<(), PrewarmError> {
        if let Some(key) = taint {
            self.untaint(key).await?;
        }
        let api: Api<Node> = Api::all(self.client.clone());
        let value = if report.warm() { "true" } else { "partial" };
        let patch = json!({"metadata": {
            "labels": {WARM_LABEL: value},
            "annotations": {REPORT_ANNOTATION: line},
        }});
        let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
        self.in_time(api.patch(&self.node, &params, &patch)).await?;
        Ok(())
    }

    /// `call` within [`API_TIMEOUT`].
    async fn in_time<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, PrewarmError> {
        let node = || self.node.clone();
        match tokio::time::timeout(API_TIMEOUT, call).await {
            Ok(r) => r.map_err(|source| PrewarmError::Node {
                node: node(),
                source,
            }),
            Err(_) => Err(PrewarmError::Timeout { node: node() }),
        }
    }

    /// Removes the taint `key` from the Node, if it has it.
    async fn untaint(&self, key: &str) -> Result<(), PrewarmError> {
        let api: Api<Node> = Api::all(self.client.clone());
        for attempt in 1..=TAINT_ATTEMPTS {
            let node = self.in_time(api.get(&self.node)).await?;
            let taints: Vec<Taint> = node.spec.and_then(|s| s.taints).unwrap_or_default();
            if !taints.iter().any(|t| t.key == key) {
                return Ok(());
            }
            let kept: Vec<&Taint> = taints.iter().filter(|t| t.key != key).collect();
            // The test makes the change apply only to the taints read: one
            // another controller added meanwhile is never dropped.
            let ops = json!([
                {"op": "test", "path": "/spec/taints", "value": taints},
                {"op": "replace", "path": "/spec/taints", "value": kept},
            ]);
            let ops: json_patch::Patch =
                serde_json::from_value(ops).expect("a JSON patch deserialises");
            let (params, patch) = (PatchParams::default(), Patch::Json::<()>(ops));
            match self.in_time(api.patch(&self.node, &params, &patch)).await {
                Ok(_) => {
                    info!(node = %self.node, taint = key, "removed the startup taint");
                    return Ok(());
                }
                Err(PrewarmError::Node {
                    source: kube::Error::Api(s),
                    ..
                }) if (s.code == 409 || s.code == 422) && attempt < TAINT_ATTEMPTS => {
                    tokio::time::sleep(Duration::from_millis(200 * attempt as u64)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

enum Outcome {
    Present,
    Pulled,
    Failed,
    Skipped(Stop),
}

/// The metrics text of `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_warm_only_when_the_whole_set_is_there() {
        let mut r = Report {
            listed: 3,
            present: 1,
            pulled: 2,
            ..Report::default()
        };
        assert!(r.warm());
        let line = r.line(1.5);
        assert!(
            line.starts_with("3 of 3 images on the node (2 pulled, 1 already present"),
            "{line}"
        );
        r.pulled = 1;
        r.skipped = 1;
        r.stopped = Some(Stop::FreeSpace);
        assert!(!r.warm());
        assert!(
            r.line(2.0)
                .ends_with("stopped: free space on the image filesystem fell below freeSpaceFloor")
        );
    }
}
