//! Who may be given the mirror's copy of an image (docs/security.md).
//!
//! Every node reads the mirror, so a rewrite hands the image to the Pod
//! whatever its own credentials. An image is shared when its source serves
//! it with the baseline credentials: anonymously, or with the registry
//! entry's `auth` (which the operator gave the whole cluster), unless the
//! entry says `visibility: private`. Any other image is private, and is
//! rewritten only for a Pod whose own pull secret (its own or its
//! ServiceAccount's, in its namespace) reads that digest at the source:
//! one HEAD by digest, the proof. The rule applies where a Pod's secret
//! can have been used to copy (`source.imagePullSecrets`) and to entries
//! that say `visibility: private`.
//!
//! Verdicts are cached: a public one per image, a proof per namespace,
//! credential and image (never per image alone). A success counts for
//! `source.proofTtl`, a refusal for [`REFUSAL_TTL`]; while the source
//! cannot answer, a success no older than `source.proofGrace` still counts.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moka::future::Cache;
use sha2::Digest as _;

use super::{ErrorCause, Mirror, MirrorError};
use crate::config::{Config, Visibility};
use crate::reference::{Reference, normalize_registry};
use crate::registry::auth::Credentials;
use crate::registry::pullsecrets::PodCredentials;
use crate::registry::{RegistryError, Role};

/// How long a refusal is kept: a secret fixed at the source counts soon.
pub const REFUSAL_TTL: Duration = Duration::from_secs(30);
/// Public verdicts kept at most.
const MAX_SHARED: u64 = 10_000;
/// Proofs kept at most. Keys are what Pods supply, so this bounds them.
const MAX_PROOFS: u64 = 100_000;

/// Which credentials make an image of a registry shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Baseline {
    /// The entry's `auth`, or anonymous without one.
    Configured,
    /// Anonymous only (`visibility: private`).
    Anonymous,
}

/// One answer of the source, and when it came.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    /// `None`: the image was read; else how the source refused it.
    refused: Option<String>,
}

impl Seen {
    fn read_within(&self, now: Instant, within: Duration) -> bool {
        self.refused.is_none() && now.saturating_duration_since(self.at) < within
    }
    fn fresh_refusal(&self, now: Instant) -> bool {
        self.refused.is_some() && now.saturating_duration_since(self.at) < REFUSAL_TTL
    }
}

/// The access rule's settings and caches.
pub(super) struct Access {
    /// Normalised registry → its baseline, `None` when the rule does not
    /// apply to it.
    registries: HashMap<String, Option<Baseline>>,
    /// The same for registries only `"*"` lets in.
    star: Option<Baseline>,
    ttl: Duration,
    grace: Duration,
    /// Pinned source (`registry/repository@digest`) → the baseline's answer.
    shared: Cache<String, Seen>,
    /// Hash of (namespace, credential fingerprint, pinned source) → answer.
    proofs: Cache<[u8; 32], Seen>,
}

/// What a Pod may be given.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Anyone: the image is public, read with the operator's credentials,
    /// or the rule does not apply to its registry.
    Shared,
    /// This Pod: these of its credentials read it.
    Proven(Credentials),
    /// Not this Pod.
    Denied(Denial),
}

/// Why a Pod is not given a private image.
#[derive(Debug, Clone)]
pub(super) struct Denial {
    /// The `reason` label: `no_credentials`, `refused`, `unverified`.
    pub reason: &'static str,
    /// The decision note (never a credential).
    pub note: String,
}

/// How the source answered one HEAD.
enum Answer {
    Read,
    Refused(String),
}

impl Access {
    pub(super) fn new(config: &Config) -> Self {
        let baseline = |v: Visibility| match v {
            Visibility::Private => Some(Baseline::Anonymous),
            Visibility::Auto if config.source.image_pull_secrets => Some(Baseline::Configured),
            Visibility::Auto => None,
        };
        let mut registries = HashMap::new();
        let mut star = None;
        for r in &config.source.registries {
            match r.registry.as_str() {
                "*" => star = baseline(r.visibility),
                host => {
                    registries.insert(normalize_registry(host), baseline(r.visibility));
                }
            }
        }
        let ttl = config.source.proof_ttl;
        let grace = config.source.proof_grace.max(ttl);
        // Entries live for the grace period: a success past `ttl` still
        // counts while the source cannot answer.
        let live = grace.clamp(Duration::from_secs(1), super::HELD_TAGS_TTL_MAX);
        Self {
            registries,
            star,
            ttl,
            grace,
            shared: Cache::builder()
                .time_to_live(live)
                .max_capacity(MAX_SHARED)
                .build(),
            proofs: Cache::builder()
                .time_to_live(live)
                .max_capacity(MAX_PROOFS)
                .build(),
        }
    }

    fn baseline(&self, registry: &str) -> Option<Baseline> {
        match self.registries.get(registry) {
            Some(b) => *b,
            None => self.star,
        }
    }

    /// Whether the rule applies to `registry` (normalised).
    pub(super) fn applies(&self, registry: &str) -> bool {
        self.baseline(registry).is_some()
    }

    /// Whether `pinned` (a source pinned by digest) may be read without a
    /// Pod's credentials: the rule does not apply to its registry, or the
    /// source answered its baseline HEAD within the grace period.
    pub(super) async fn readable_without_pods(&self, pinned: &Reference) -> bool {
        if !self.applies(&normalize_registry(pinned.registry())) {
            return true;
        }
        let seen = self.shared.get(&pinned.without_tag().to_string()).await;
        seen.is_some_and(|s| s.read_within(Instant::now(), self.grace))
    }
}

/// The proof cache key: a hash, so no fingerprint is kept as such.
fn proof_key(namespace: &str, creds: &Credentials, image: &str) -> [u8; 32] {
    let mut h = sha2::Sha256::new();
    for part in [namespace, &creds.fingerprint(), image] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

/// A registry error as the source's refusal (`Ok`), or as an outage.
fn refusal(e: RegistryError) -> Result<Answer, MirrorError> {
    match &e {
        RegistryError::Unauthorized { .. } | RegistryError::AuthRequired { .. } => {
            Ok(Answer::Refused("HTTP 401".into()))
        }
        _ if e.outage().is_some() => Err(e.into()),
        RegistryError::Http { status, code, .. } => Ok(Answer::Refused(match code {
            Some(c) => format!("HTTP {status} {c}"),
            None => format!("HTTP {status}"),
        })),
        other => Ok(Answer::Refused(
            other.to_string().chars().take(160).collect(),
        )),
    }
}

/// `a, b and c`, each once.
fn listed(items: &[String]) -> String {
    let mut once: Vec<&str> = Vec::new();
    for i in items {
        if !once.contains(&i.as_str()) {
            once.push(i);
        }
    }
    once.join(", ")
}

impl Mirror {
    /// One HEAD by digest of `pinned` at its source, as the baseline
    /// (`creds` `None`) or with a Pod's credentials, through the source's
    /// breaker. A refusal (401, 403, 404) is an answer; an outage is the
    /// error.
    async fn head_as(
        &self,
        pinned: &Reference,
        baseline: Baseline,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Answer, MirrorError> {
        let registry = pinned.registry();
        self.resolver
            .ask(pinned, deadline, async {
                let client = match (creds, baseline) {
                    (Some(c), _) => self.pool.get_with(registry, Role::Source, Some(c)).await,
                    (None, Baseline::Configured) => self.pool.get(registry, Role::Source).await,
                    (None, Baseline::Anonymous) => {
                        self.pool.get_anonymous(registry, Role::Source).await
                    }
                };
                let client = match client {
                    Ok(c) => c,
                    Err(e) => return refusal(e),
                };
                match client.head_manifest(pinned).await {
                    Ok(Some(_)) => Ok(Answer::Read),
                    Ok(None) => Ok(Answer::Refused("HTTP 404".into())),
                    Err(e) => refusal(e),
                }
            })
            .await
    }

    /// Whether every Pod may be given `pinned` (a source pinned by
    /// digest): the access rule does not apply to its registry, or the
    /// source serves that digest with the baseline credentials now (or did
    /// within `source.proofTtl`), as admission judges it. `Some(false)`: not
    /// pinned, or refused; `None`: the source could not answer. A node's
    /// warm set holds only what the kubelet may hand any Pod
    /// (docs/security.md).
    pub async fn readable_by_every_pod(&self, pinned: &Reference) -> Option<bool> {
        let registry = normalize_registry(pinned.registry());
        let Some(baseline) = self.access.baseline(&registry) else {
            return Some(true);
        };
        if pinned.digest().is_none() {
            return Some(false);
        }
        let pinned = pinned.without_tag();
        let image = pinned.to_string();
        let now = Instant::now();
        if let Some(seen) = self.access.shared.get(&image).await {
            if seen.read_within(now, self.access.ttl) {
                return Some(true);
            }
            if seen.fresh_refusal(now) {
                return Some(false);
            }
        }
        let answer = self.head_as(&pinned, baseline, None, None).await;
        let at = Instant::now();
        match answer {
            Ok(Answer::Read) => {
                self.access
                    .shared
                    .insert(image, Seen { at, refused: None })
                    .await;
                Some(true)
            }
            Ok(Answer::Refused(why)) => {
                let seen = Seen {
                    at,
                    refused: Some(why),
                };
                self.access.shared.insert(image, seen).await;
                Some(false)
            }
            Err(_) => None,
        }
    }

    /// What the Pod with `pod`'s credentials may be given of `source` (the
    /// pinned source a plan mirrors; `known` false when the target's copy
    /// stood in and its source digest is not known here).
    pub(super) async fn access(
        &self,
        source: &Reference,
        known: bool,
        pod: &PodCredentials,
        deadline: Option<Instant>,
    ) -> Verdict {
        let registry = normalize_registry(source.registry());
        let Some(baseline) = self.access.baseline(&registry) else {
            return Verdict::Shared;
        };
        let (ttl, grace) = (self.access.ttl, self.access.grace);
        if !known || source.digest().is_none() {
            return Verdict::Denied(Denial {
                reason: "unverified",
                note: "the source digest of the mirror's copy is not known here, so whether this Pod may have it cannot be checked".into(),
            });
        }
        let pinned = source.without_tag();
        let image = pinned.to_string();
        let creds = pod.for_registry(&registry);
        let now = Instant::now();
        let shared = self.access.shared.get(&image).await;
        if shared.as_ref().is_some_and(|s| s.read_within(now, ttl)) {
            return Verdict::Shared;
        }
        let keys: Vec<[u8; 32]> = creds
            .iter()
            .map(|c| proof_key(pod.namespace(), c, &image))
            .collect();
        let mut proofs = Vec::with_capacity(keys.len());
        for k in &keys {
            proofs.push(self.access.proofs.get(k).await);
        }
        if let Some(i) = proofs
            .iter()
            .position(|p| p.as_ref().is_some_and(|p| p.read_within(now, ttl)))
        {
            return Verdict::Proven(creds[i].clone());
        }
        // Ask the source what is not known: the baseline and each of the
        // Pod's credentials, at once.
        let ask_shared = !shared.as_ref().is_some_and(|s| s.fresh_refusal(now));
        let asked: Vec<usize> = (0..creds.len())
            .filter(|&i| !proofs[i].as_ref().is_some_and(|p| p.fresh_refusal(now)))
            .collect();
        let (shared_answer, answers) = futures::join!(
            async {
                match ask_shared {
                    true => Some(self.head_as(&pinned, baseline, None, deadline).await),
                    false => None,
                }
            },
            futures::future::join_all(asked.iter().map(|&i| self.head_as(
                &pinned,
                baseline,
                Some(&creds[i]),
                deadline
            )))
        );
        let at = Instant::now();
        let mut outage = None;
        // What still counts if the source cannot answer: earlier successes
        // that no answer now contradicts.
        let mut shared_before = shared.as_ref().is_some_and(|s| s.read_within(at, grace));
        let mut private = shared.as_ref().is_some_and(|s| s.refused.is_some());
        match shared_answer {
            Some(Ok(Answer::Read)) => {
                self.access
                    .shared
                    .insert(image, Seen { at, refused: None })
                    .await;
                return Verdict::Shared;
            }
            Some(Ok(Answer::Refused(why))) => {
                (shared_before, private) = (false, true);
                let seen = Seen {
                    at,
                    refused: Some(why),
                };
                self.access.shared.insert(image.clone(), seen).await;
            }
            Some(Err(e)) => outage = Some(e),
            None => {}
        }
        // A wait the admission's budget cut short says nothing of the
        // source: it must not open the grace an outage gets, or a Pod
        // listing enough slow images first would get it at will.
        let cut = |e: &MirrorError| {
            matches!(
                e,
                MirrorError::SourceDown {
                    kind: ErrorCause::Budget,
                    ..
                }
            )
        };
        let mut unasked = outage.as_ref().is_some_and(cut);
        let mut before: Vec<bool> = proofs
            .iter()
            .map(|p| p.as_ref().is_some_and(|p| p.read_within(at, grace)))
            .collect();
        let mut proven = None;
        let mut refusals: Vec<String> = proofs
            .iter()
            .flatten()
            .filter(|p| p.fresh_refusal(now))
            .filter_map(|p| p.refused.clone())
            .collect();
        for (&i, answer) in asked.iter().zip(answers) {
            match answer {
                Ok(Answer::Read) => {
                    self.access
                        .proofs
                        .insert(keys[i], Seen { at, refused: None })
                        .await;
                    proven.get_or_insert(i);
                }
                Ok(Answer::Refused(why)) => {
                    before[i] = false;
                    refusals.push(why.clone());
                    let seen = Seen {
                        at,
                        refused: Some(why),
                    };
                    self.access.proofs.insert(keys[i], seen).await;
                }
                Err(e) => {
                    unasked |= cut(&e);
                    outage.get_or_insert(e);
                }
            }
        }
        if let Some(i) = proven {
            return Verdict::Proven(creds[i].clone());
        }
        let what = match private {
            true => "private image",
            false => "not known to be public",
        };
        if unasked {
            return Verdict::Denied(Denial {
                reason: "unverified",
                note: format!(
                    "{what}; its source {registry} could not be asked within this admission's budget, so whether this Pod may have it is not known"
                ),
            });
        }
        if let Some(e) = outage {
            // The source cannot say now: an earlier success still counts
            // for the grace period, for the Pods it was for.
            if shared_before {
                return Verdict::Shared;
            }
            if let Some(i) = before.iter().position(|&b| b) {
                return Verdict::Proven(creds[i].clone());
            }
            let cause = match &e {
                MirrorError::SourceDown { cause, .. } => cause.clone(),
                other => other.to_string(),
            };
            return Verdict::Denied(Denial {
                reason: "unverified",
                note: format!(
                    "{what}; its source {registry} cannot answer ({cause}), and no pull secret of this Pod proved access in the last {}",
                    humantime::format_duration(grace)
                ),
            });
        }
        if creds.is_empty() {
            return Verdict::Denied(Denial {
                reason: "no_credentials",
                note: format!("private image; this Pod has no pull secret for {registry}"),
            });
        }
        Verdict::Denied(Denial {
            reason: "refused",
            note: format!(
                "private image; this Pod's pull secrets are refused by the source ({})",
                listed(&refusals)
            ),
        })
    }

    /// The credentials to copy `source` with for the first of `pods` that
    /// may have it (recovery: any Pod using the image can vouch for it),
    /// `None` when it is shared and no Pod has credentials for it.
    ///
    /// # Errors
    /// [`MirrorError::Private`] when none of them may.
    pub(super) async fn access_among(
        &self,
        source: &Reference,
        known: bool,
        pods: &[PodCredentials],
    ) -> Result<Option<Credentials>, MirrorError> {
        let registry = normalize_registry(source.registry());
        let first = || pods.iter().find_map(|p| p.first(&registry)).cloned();
        if !self.access.applies(&registry) {
            return Ok(first());
        }
        let none = [PodCredentials::none()];
        let pods = match pods.is_empty() {
            true => &none[..],
            false => pods,
        };
        let mut denial = None;
        for pod in pods {
            match self.access(source, known, pod, None).await {
                Verdict::Shared => return Ok(first()),
                Verdict::Proven(c) => return Ok(Some(c)),
                Verdict::Denied(d) => {
                    denial.get_or_insert(d);
                }
            }
        }
        let d = denial.expect("at least one Pod was asked");
        self.metrics.private_denial(d.reason);
        Err(MirrorError::Private {
            image: source.to_string(),
            reason: format!("no Pod using it may have it: {}", d.note),
        })
    }
}
