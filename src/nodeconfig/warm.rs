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
use tracing::{debug, info};

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
        let mut answers = futures::stream::iter(asked)
            .map(|c| async move {
                let answer = self.pin(&c).await;
                (c, answer)
            })
            .buffered(HEADS_AT_ONCE);
        let mut add = |image: String, uses, daemon_set, chosen: &mut Vec<WarmImage>| {
            if chosen.len() < self.top && seen.insert(image.clone()) {
                chosen.push(WarmImage {
                    image,
                    uses,
                    daemon_set,
                });
            }
        };
        while let Some((c, answer)) = answers.next().await {
            match answer {
                Ok(image) => add(image, c.uses, c.daemon_set, &mut chosen),
                Err((why, repository)) => {
                    *left_out.entry(why).or_insert(0) += 1;
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
    /// else why not, with the target repository when it is known.
    async fn pin(&self, c: &Candidate) -> Result<String, (LeftOut, Option<String>)> {
        let target = self
            .mirror
            .target()
            .map(&c.source)
            .map_err(|_| (LeftOut::NotMirrored, None))?;
        let repository = target.without_tag().without_digest();
        let unknown = || (LeftOut::Unknown, Some(repository.to_string()));
        let client = self
            .mirror
            .pool()
            .get(target.registry(), Role::Target)
            .await
            .map_err(|_| unknown())?;
        let digest = match client.head_manifest(&target).await {
            Ok(Some(d)) => d,
            Ok(None) => return Err((LeftOut::NotMirrored, None)),
            Err(_) => return Err(unknown()),
        };
        // The digest the set names, at its source: what admission judges,
        // not what the source's tag names now.
        let pinned = c.source.without_digest().with_digest(digest.clone());
        match self.mirror.readable_by_every_pod(&pinned).await {
            Some(true) => Ok(repository.with_digest(digest).to_string()),
            Some(false) => Err((LeftOut::Private, None)),
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
    while_leading(leader, INTERVAL, lines, || async {
        let Some(c) = candidates() else {
            debug!("the usage record has not listed everything: no warm set yet");
            return Outcome::Done;
        };
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
