//! Retention: the leader removes from the target the images pinswap
//! mirrored that no Pod and no workload template has named for
//! `retention.unusedFor` (docs/operations.md#retention).
//!
//! What is in use comes in as an [`InUse`] per pass. Each rule below keeps
//! an image; an image is removed only when none applies:
//! 1. Only what pinswap wrote: repositories under the target's mirror path
//!    whose first component maps back to an allowed source registry, and
//!    only pinswap's tags there (the source's tags and the anchor tags
//!    `pinswap-<hex>[-<variant>]`). A manifest that any other tag points
//!    at (the referrers tag schema `sha256-<hex>...`) is never removed.
//! 2. Nothing in use: an image a Pod or template names (as a target
//!    reference, or a source reference through the mirror path; a tag keeps
//!    the manifest the target tag points at, a digest that manifest and the
//!    copies anchored to it), and the child manifests of an index in use.
//! 3. Nothing the source no longer serves under the same digest: it could
//!    not be mirrored again. It stays, logged and counted.
//! 4. Nothing while a source cannot answer (its breaker not closed) or the
//!    Kubernetes watches have not synced.
//! 5. Last use survives restarts and leader changes ([`store`]). An image
//!    not in the record counts as used when retention first sees it; an
//!    image the full record cannot track is never removed.
//! 6. Tags go before manifests. Distribution cannot delete a tag (DELETE by
//!    tag is unsupported); deleting the manifest by digest removes its tags.
//!    Blobs are left to the registry's garbage collection.
//! 7. `dryRun` logs and counts, and removes nothing.

pub mod clusters;
mod deletes;
pub mod publish;
pub mod shards;
pub(crate) mod store;
mod sweep;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{info, warn};

use crate::admission::policy::Policy;
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::reference::Reference;
pub use store::{CONFIG_MAP, Record, Store, tag as record_tag};

/// Errors of a retention pass.
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    /// The API server refused or failed a request about the ConfigMap
    /// the record moved from.
    #[error("retention record ConfigMap {namespace}/{name}: {source}")]
    Record {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The retention record at the target could not be read or written.
    #[error("the retention record at the target: {0}")]
    Store(#[source] clusters::ClustersError),
    /// The retention record's tag moved since it was read: another
    /// writer's.
    #[error(
        "the retention record's tag {tag} names {found}, not {read} as read: another install writes it (give each cluster its own name); nothing is removed"
    )]
    Moved {
        /// The tag.
        tag: String,
        /// What it names now.
        found: String,
        /// What it named when read.
        read: String,
    },
    /// The target could not be listed.
    #[error("listing the target: {0}")]
    Target(#[from] crate::mirror::MirrorError),
    /// The ECR target's repositories could not be listed.
    #[error("listing the target: {0}")]
    Ecr(#[from] crate::registry::ecr::EcrError),
    /// A target request failed while listing.
    #[error("listing the target: {0}")]
    Registry(#[from] crate::registry::RegistryError),
    /// Another cluster's usage record could not be read, or is incomplete.
    #[error("reading the clusters' usage records: {0}")]
    Records(#[source] clusters::ClustersError),
    /// This cluster's usage record could not be published first.
    #[error("publishing this cluster's usage record: {0}")]
    Publish(#[source] clusters::ClustersError),
    /// Sharing is off, but other clusters publish usage records at the
    /// target: their images would look unused here.
    #[error(
        "the target holds usage records of clusters {clusters:?}: turn sharing on (and name this cluster), or give this install a prefix of its own; nothing is removed until then"
    )]
    Unshared {
        /// The records' names.
        clusters: Vec<String>,
    },
    /// Sharing is off, and whether the target holds other clusters'
    /// records could not be told (an error other than 401, 403 or 404).
    #[error(
        "sharing is off, and whether other clusters publish usage records at the target is unknown ({0}); nothing is removed until it can be told"
    )]
    SharingUnknown(#[source] clusters::ClustersError),
}

impl RetentionError {
    /// The `outcome` of `pinswap_retention_passes_total` for a pass that
    /// failed so.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Records(clusters::ClustersError::Incomplete { .. }) => "record_incomplete",
            Self::Records(_) => "records_unreadable",
            Self::Publish(clusters::ClustersError::Incomplete { .. }) => "record_incomplete",
            Self::Publish(_) => "record_not_published",
            Self::Unshared { .. } => "sharing_off",
            Self::SharingUnknown(_) => "sharing_unknown",
            _ => "error",
        }
    }
}

/// The source that `repository` (under the target, without the registry)
/// mirrors, when it is a mirror path of an allowed source: the one test of
/// "pinswap wrote this repository" that retention, the usage records and
/// ECR's reconcile share.
pub fn mirrored_source(
    target: &crate::reference::MirrorTarget,
    policy: &Policy,
    repository: &str,
) -> Option<Reference> {
    let source = target.source_of(repository)?;
    policy.source_allowed(&source).is_ok().then_some(source)
}

/// What is in use now, as the leader's watches know it.
#[derive(Debug, Clone, Default)]
pub struct InUse {
    /// Every watch has listed and none is listing again.
    pub synced: bool,
    /// Every image a Pod or a workload template names: target references,
    /// or source references (mapped through the mirror path).
    pub images: Vec<Reference>,
}

/// Yields what is in use, once per pass.
pub type InUseSource = Arc<dyn Fn() -> InUse + Send + Sync>;

/// An image's state in a pass (the `state` label of
/// `pinswap_retention_images`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Named by a Pod or template (or a child of an index that is).
    InUse,
    /// Unused for less than `unusedFor`.
    Unused,
    /// Unused for `unusedFor`, and kept: it could not be mirrored again,
    /// another tag points at it, or the record cannot track it.
    Kept,
    /// Due for removal: in a dry run, or in a pass that removes nothing
    /// (a source could not answer).
    Candidate,
    /// Removed in this pass.
    Removed,
}

impl State {
    /// Every state, as the gauge lists them.
    pub const ALL: [State; 5] = [
        Self::InUse,
        Self::Unused,
        Self::Kept,
        Self::Candidate,
        Self::Removed,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InUse => "in_use",
            Self::Unused => "unused",
            Self::Kept => "kept",
            Self::Candidate => "candidate",
            Self::Removed => "removed",
        }
    }
}

/// One target manifest in a pass.
#[derive(Debug, Clone)]
pub struct Image {
    /// `registry/repository@digest`.
    pub image: Reference,
    /// The tags pointing at it.
    pub tags: Vec<String>,
    /// What the pass made of it.
    pub state: State,
    /// Why, in words.
    pub why: String,
}

/// What one pass did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Why the pass removed nothing, when it did not run through.
    pub skipped: Option<String>,
    /// The pass was skipped because the watches have not synced.
    pub not_synced: bool,
    /// Source registries that could not answer in this pass, with why:
    /// their due images were held back, and only theirs.
    pub held: BTreeMap<String, String>,
    /// Every manifest under pinswap's tags, with its state.
    pub images: Vec<Image>,
    /// Removals that failed: image and why.
    pub failed: Vec<(Reference, String)>,
    /// Why the pass removed nothing it chose: the target refuses DELETE,
    /// or did not say whether it takes one.
    pub deletes: Option<String>,
}

impl Report {
    /// The state of `image` (`registry/repository@digest`), if the pass saw it.
    pub fn state(&self, image: &str) -> Option<State> {
        self.find(image).map(|i| i.state)
    }

    /// The entry of `image`, if the pass saw it.
    pub fn find(&self, image: &str) -> Option<&Image> {
        self.images.iter().find(|i| i.image.to_string() == image)
    }

    /// Images in `state`.
    pub fn count(&self, state: State) -> usize {
        self.images.iter().filter(|i| i.state == state).count()
    }

    /// As a plan: `remove` (the candidates) and `keep` (every other image,
    /// with its state), each image with its tags and why; sources that
    /// could not answer (`held`), and why nothing was looked at
    /// (`skipped`).
    pub fn plan_json(&self) -> serde_json::Value {
        let entry = |i: &Image| {
            serde_json::json!({
                "image": i.image.to_string(),
                "tags": i.tags,
                "state": i.state.as_str(),
                "why": i.why,
            })
        };
        let (remove, keep): (Vec<&Image>, Vec<&Image>) = self
            .images
            .iter()
            .partition(|i| matches!(i.state, State::Candidate | State::Removed));
        serde_json::json!({
            "skipped": self.skipped,
            "held": self.held,
            "deletes": self.deletes,
            "remove": remove.into_iter().map(entry).collect::<Vec<_>>(),
            "keep": keep.into_iter().map(entry).collect::<Vec<_>>(),
        })
    }
}

/// The retention service: the leader runs [`Retention::sweep`] every
/// `retention.interval` ([`run`]).
pub struct Retention {
    mirror: Arc<Mirror>,
    policy: Policy,
    store: Store,
    unused_for: Duration,
    /// Between passes.
    interval: Duration,
    dry_run: bool,
    metrics: Arc<Metrics>,
    /// With `sharing.enabled`: this cluster's record and the others'.
    sharing: Option<Arc<publish::Publisher>>,
    /// Why the target refused DELETE when last asked, if it did: a plan
    /// says so without asking again.
    refused: std::sync::Mutex<Option<String>>,
}

impl Retention {
    /// Retention of `mirror`'s target under `config`'s `retention` block,
    /// with the record in `store`; `policy` is the source allowlist.
    pub fn new(
        mirror: Arc<Mirror>,
        policy: Policy,
        mut store: Store,
        config: &crate::config::Retention,
    ) -> Self {
        store.place(mirror.clone(), store::tag(None), config.interval);
        Self {
            metrics: mirror.metrics().clone(),
            mirror,
            policy,
            store,
            unused_for: config.unused_for,
            interval: config.interval,
            dry_run: config.dry_run,
            sharing: None,
            refused: Default::default(),
        }
    }

    /// Retention that keeps what the other clusters' usage records name,
    /// and publishes this cluster's record before each pass.
    pub fn with_sharing(mut self, publisher: Arc<publish::Publisher>) -> Self {
        let interval = self.interval;
        self.store.place(
            self.mirror.clone(),
            store::tag(Some(publisher.cluster())),
            interval,
        );
        self.sharing = Some(publisher);
        self
    }
}

/// Runs a pass every `interval` while this replica leads (`leader`), with
/// what `in_use` yields. A pass skipped because the watches have not
/// synced is tried again within 5 s.
pub async fn run(
    retention: Arc<Retention>,
    in_use: InUseSource,
    interval: Duration,
    mut leader: watch::Receiver<bool>,
) {
    let soon = interval.min(Duration::from_secs(5));
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        info!(every = %humantime::format_duration(interval), "leading: retention passes start");
        retention.store.lead().await;
        retention.ask_deletes().await;
        let mut next = soon;
        loop {
            let lost = async {
                let _ = leader.wait_for(|l| !*l).await;
            };
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                _ = lost => break,
            }
            if !*leader.borrow() {
                break;
            }
            // A replica that stops leading mid-pass stops removing: the
            // new leader judges for itself.
            let lost = async {
                let _ = leader.wait_for(|l| !*l).await;
            };
            let now_in_use = in_use();
            let swept = tokio::select! {
                r = retention.sweep(&now_in_use) => r,
                _ = lost => {
                    warn!("retention pass stopped: this replica stopped leading; what it had not removed stays");
                    Metrics::outcome(&retention.metrics.retention.passes, "leadership_lost");
                    break;
                }
            };
            next = match swept {
                Ok(r) if r.not_synced => soon,
                Ok(_) => interval,
                Err(e) => {
                    warn!(cluster = retention.sharing.as_ref().map(|p| p.cluster()), error = %e, "retention pass failed; nothing removed");
                    interval
                }
            };
        }
        info!("not leading: retention passes stop");
    }
}
