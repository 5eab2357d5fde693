//! The warm set: the images a new node pulls before it takes Pods
//! (`prewarm`, docs/configuration.md#prewarm). The leader chooses them from
//! its usage record, pins each to the digest the target holds, and writes
//! them into the ConfigMap [`CONFIG_MAP`]; each node agent reads it when
//! its node starts ([`super::prewarm`]).
//!
//! As with [`super::registries`], the install renders the ConfigMap, empty
//! and marked with [`ANNOTATION`]; the leader only updates one so marked,
//! with the `resourceVersion` it read, and only when the set changed.
//!
//! Only images every Pod may be given go in: a node's kubelet hands an
//! image it did not pull itself to any Pod that names it
//! (`NeverVerifyPreloadedImages`, docs/security.md), so an image the access
//! rule holds back from some Pods is left out.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::published::{Lines, Outcome, marked, while_leading};

use crate::mirror::Mirror;
use crate::reference::Reference;
use crate::registry::Role;

/// The ConfigMap's name.
pub const CONFIG_MAP: &str = "pinswap-warm-set";
/// Its data key.
pub const KEY: &str = "warm-set.json";
/// The annotation that marks the ConfigMap as the one the leader writes.
pub const ANNOTATION: &str = "pinswap.dev/warm-set";
/// Its value.
pub const ANNOTATION_VALUE: &str = "written by the leader";
/// Between the leader's rounds.
pub const INTERVAL: Duration = Duration::from_secs(30);
/// Target HEADs in flight in a round.
const HEADS_AT_ONCE: usize = 8;

/// The set as published. Unknown fields are ignored: an agent older than
/// its leader still reads the set during a rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmSet {
    /// When the leader chose it (it is written only when it changes).
    pub listed: Timestamp,
    /// The images, most used first (DaemonSets' before all).
    pub images: Vec<WarmImage>,
}

/// One image of the set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmImage {
    /// The target's copy, `registry/repository@digest`.
    pub image: String,
    /// Objects in the cluster naming it.
    pub uses: u32,
    /// A DaemonSet names it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub daemon_set: bool,
}

/// An image the usage record offers, as its objects name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The source reference.
    pub source: Reference,
    /// Objects naming it.
    pub uses: u32,
    /// A DaemonSet names it.
    pub daemon_set: bool,
}

/// Why a candidate is not in the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeftOut {
    /// The target does not hold it (not copied yet).
    NotMirrored,
    /// Some Pods may not be given it.
    Private,
    /// The target or the source could not be asked: the image's entry in
    /// the set published last, if any, is kept.
    Unknown,
}

impl LeftOut {
    fn as_str(self) -> &'static str {
        match self {
            LeftOut::NotMirrored => "not_mirrored",
            LeftOut::Private => "private",
            LeftOut::Unknown => "target_error",
        }
    }
}

/// Errors about the set.
#[derive(Debug, thiserror::Error)]
pub enum WarmError {
    /// The API server refused or failed.
    #[error("ConfigMap {namespace}/{CONFIG_MAP}: {source}")]
    Api {
        /// Its namespace.
        namespace: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The ConfigMap holds something that is not a warm set.
    #[error("ConfigMap {namespace}/{CONFIG_MAP}: {KEY} is not a warm set: {why}")]
    Unreadable {
        /// Its namespace.
        namespace: String,
        /// Why.
        why: String,
    },
}

/// What a leader's round did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Round {
    /// Written: the set changed.
    Written {
        /// Images in it.
        images: usize,
        /// Candidates left out, by why.
        left_out: BTreeMap<LeftOut, usize>,
    },
    /// The ConfigMap holds this set already.
    Unchanged,
    /// No ConfigMap marked as the leader's: nothing written.
    NotInstalled,
}

/// The set a node agent reads: `None` until the leader has published one.
///
/// # Errors
/// [`WarmError`].
pub async fn read(client: kube::Client, namespace: &str) -> Result<Option<WarmSet>, WarmError> {
    let api: Api<ConfigMap> = Api::namespaced(client, namespace);
    let cm = api
        .get_opt(CONFIG_MAP)
        .await
        .map_err(|source| WarmError::Api {
            namespace: namespace.to_owned(),
            source,
        })?;
    let Some(text) = cm.and_then(|c| c.data).and_then(|mut d| d.remove(KEY)) else {
        return Ok(None);
    };
    if text.trim().is_empty() {
        return Ok(None);
    }
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| WarmError::Unreadable {
            namespace: namespace.to_owned(),
            why: e.to_string(),
        })
}

/// A candidate pinned at the target, or why not: the reason, the target
/// repository when it could not be asked, the target's image when refused.
type Pinned = Result<String, (LeftOut, Option<String>, Option<String>)>;

/// The leader's side.
pub struct Publisher {
    mirror: Arc<Mirror>,
    api: Api<ConfigMap>,
    namespace: String,
    top: usize,
}

impl Publisher {
    /// Publishes at most `top` images into [`CONFIG_MAP`] in `namespace`.
    pub fn new(mirror: Arc<Mirror>, client: kube::Client, namespace: &str, top: usize) -> Self {
        Self {
            mirror,
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            top,
        }
    }

    /// The set for `candidates` (in the order they come): each pinned to
    /// the digest the target holds, and only images every Pod may be
    /// given; at most `top`, after at most twice as many were asked about.
    /// A candidate the target or its source could not be asked about keeps
    /// its entries in `current` (the set published last): an outage never
    /// shrinks the set.
    pub async fn choose(
        &self,
        candidates: &[Candidate],
        current: &[WarmImage],
    ) -> (Vec<WarmImage>, BTreeMap<LeftOut, usize>) {
        let mut left_out = BTreeMap::new();
        let mut chosen = Vec::new();
        let mut seen = HashSet::new();
        // Owned: futures borrowing the slice would not be Send for every
        // lifetime, which a spawned task needs.
        let asked: Vec<Candidate> = candidates
            .iter()
            .take(self.top.saturating_mul(2).max(16))
            .cloned()
            .collect();
        let answers: Vec<(Candidate, Pinned)> = futures::stream::iter(asked)
            .map(|c| async move {
                let answer = self.pin(&c).await;
                (c, answer)
            })
            .buffered(HEADS_AT_ONCE)
            .collect()
            .await;
        // What this round refused is never carried over from the last set.
        let refused: HashSet<&str> = answers
            .iter()
            .filter_map(|(_, a)| match a {
                Err((LeftOut::Private, _, Some(image))) => Some(image.as_str()),
                _ => None,
            })
            .collect();
        let mut add = |image: String, uses, daemon_set, chosen: &mut Vec<WarmImage>| {
            if chosen.len() < self.top
                && !refused.contains(image.as_str())
                && seen.insert(image.clone())
            {
                chosen.push(WarmImage {
                    image,
                    uses,
                    daemon_set,
                });
            }
        };
        for (c, answer) in &answers {
            match answer {
                Ok(image) => add(image.clone(), c.uses, c.daemon_set, &mut chosen),
                Err((why, repository, _)) => {
                    *left_out.entry(*why).or_insert(0) += 1;
                    if let (LeftOut::Unknown, Some(repo)) = (why, repository) {
                        let at = format!("{repo}@");
                        for kept in current.iter().filter(|w| w.image.starts_with(&at)) {
                            add(kept.image.clone(), c.uses, c.daemon_set, &mut chosen);
                        }
                    }
                }
            }
            if chosen.len() >= self.top {
                break;
            }
        }
        (chosen, left_out)
    }

    /// The target's copy of `c`, by digest, when every Pod may have it;
    /// else why not, with the target repository when it could not be asked
    /// and the target's image when it was refused.
    async fn pin(&self, c: &Candidate) -> Pinned {
        let target = self
            .mirror
            .target()
            .map(&c.source)
            .map_err(|_| (LeftOut::NotMirrored, None, None))?;
        let repository = target.without_tag().without_digest();
        let unknown = || (LeftOut::Unknown, Some(repository.to_string()), None);
        let client = self
            .mirror
            .pool()
            .get(target.registry(), Role::Target)
            .await
            .map_err(|_| unknown())?;
        let digest = match client.head_manifest(&target).await {
            Ok(Some(d)) => d,
            Ok(None) => return Err((LeftOut::NotMirrored, None, None)),
            Err(_) => return Err(unknown()),
        };
        // The digest the set names, at its source: what admission judges,
        // not what the source's tag names now.
        let pinned = c.source.without_digest().with_digest(digest.clone());
        let image = repository.with_digest(digest).to_string();
        match self.mirror.readable_by_every_pod(&pinned).await {
            Some(true) => Ok(image),
            Some(false) => Err((LeftOut::Private, None, Some(image))),
            None => Err(unknown()),
        }
    }

    /// One round: when the ConfigMap is the leader's, choose from
    /// `candidates` and write the set if it changed.
    ///
    /// # Errors
    /// [`WarmError`]; nothing is written then.
    pub async fn round(&self, candidates: &[Candidate]) -> Result<Round, WarmError> {
        let api_error = |source| WarmError::Api {
            namespace: self.namespace.clone(),
            source,
        };
        let Some(mut cm) = marked(&self.api, CONFIG_MAP, ANNOTATION, ANNOTATION_VALUE)
            .await
            .map_err(api_error)?
        else {
            return Ok(Round::NotInstalled);
        };
        let current = cm
            .data
            .as_ref()
            .and_then(|d| d.get(KEY))
            .and_then(|t| serde_json::from_str::<WarmSet>(t).ok());
        let kept = current.as_ref().map_or(&[][..], |c| &c.images[..]);
        let (images, left_out) = self.choose(candidates, kept).await;
        let asked = candidates.len().min(self.top.saturating_mul(2).max(16));
        // Nothing could be asked (the target is down): the set stands.
        if asked > 0 && left_out.get(&LeftOut::Unknown) == Some(&asked) {
            return Ok(Round::Unchanged);
        }
        if current.is_some_and(|c| c.images == images) {
            return Ok(Round::Unchanged);
        }
        let set = WarmSet {
            listed: Timestamp::now(),
            images,
        };
        let text = serde_json::to_string(&set).expect("a set serialises");
        cm.data = Some(BTreeMap::from([(KEY.to_owned(), text)]));
        // With the resourceVersion read: a conflict waits for the next
        // round.
        self.api
            .replace(CONFIG_MAP, &PostParams::default(), &cm)
            .await
            .map_err(api_error)?;
        Ok(Round::Written {
            images: set.images.len(),
            left_out,
        })
    }
}

/// Rounds every [`INTERVAL`] while this replica leads. `candidates` gives
/// what the usage record offers, or `None` while it has not listed
/// everything (a partial set is not published over a whole one).
pub async fn run(
    publisher: Publisher,
    candidates: impl Fn() -> Option<Vec<Candidate>>,
    leader: watch::Receiver<bool>,
) {
    let lines = Lines {
        configmap: CONFIG_MAP,
        absent: "no ConfigMap for the warm set (prewarm without the node agent): nothing published",
        failed: "the warm set could not be published; new nodes pull the set published last",
    };
    // Rounds in a row with the usage record unsynced.
    let waiting = std::sync::atomic::AtomicU32::new(0);
    while_leading(leader, INTERVAL, lines, || async {
        let Some(c) = candidates() else {
            // Ten rounds: five minutes, past any list at start.
            match waiting.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
                10 => warn!("the usage record has not been whole for 5 minutes (a watch failing, or an object naming more images than are read): the warm set is not updated meanwhile"),
                _ => debug!("the usage record has not listed everything: the warm set is not updated"),
            }
            return Outcome::Done;
        };
        waiting.store(0, std::sync::atomic::Ordering::Relaxed);
        match publisher.round(&c).await {
            Ok(Round::Written { images, left_out }) => {
                let left: Vec<String> = left_out
                    .iter()
                    .map(|(k, n)| format!("{}={n}", k.as_str()))
                    .collect();
                info!(
                    images,
                    left_out = %left.join(","),
                    configmap = CONFIG_MAP,
                    "published the warm set for new nodes"
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
