//! Plans: where a source image lives at the target, the target checks,
//! held tags and stand-ins while a source is down.

use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};

use super::{Mirror, MirrorError};
use crate::config::CollisionPolicy;
use crate::identity::{Facts, Repair};
use crate::reference::{Digest, Reference};
use crate::registry::Role;
use crate::registry::auth::Credentials;
use crate::registry::copy::Endpoint;
use crate::registry::pullsecrets::PodCredentials;

/// A source image mapped to where it lives at the target.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    /// The source, pinned to the digest it resolved to.
    pub(super) source: Reference,
    /// The target reference with the tag to push and the digest to pin.
    pub(super) target: Reference,
    /// Whether the source named a tag (else the target tag is an anchor).
    pub(super) tagged: bool,
    /// Push by digest only, leaving the tag where it is (a recovery of
    /// content the tag no longer names).
    pub(super) untagged: bool,
    /// Check every blob and child manifest at the target and restore what
    /// is missing (recovery after a pull failure).
    pub(super) verify: bool,
    /// What the source's manifests say about identity (`None` when the
    /// inspection failed under `collisions: warn`).
    pub(super) assessed: Option<Arc<Assessed>>,
    /// The repaired copy to push instead (`collisions: repair`).
    pub(super) repair: Option<Arc<Repair>>,
    /// Whether the target has the image under `target`'s tag: known while
    /// planning (`Some`), or to be checked (`None`).
    pub(super) present: Option<bool>,
    /// The source could not answer and the target's copy of the tag stands
    /// in: the failure, in words.
    pub(super) fallback: Option<String>,
    /// `source` is known (a stand-in copy of a filtered or repaired image
    /// does not say which source digest it was made from).
    pub(super) source_known: bool,
}

impl Plan {
    /// The decision note for an image the target holds.
    pub(super) fn held_note(&self) -> String {
        match &self.fallback {
            None => "present at the target".into(),
            Some(cause) => format!(
                "source unreachable ({cause}); pinned to the mirror's copy of {}",
                self.source.tag().unwrap_or("the image")
            ),
        }
    }

    /// `present`'s label, or `source_down` when the target's copy stood in.
    pub(super) fn rewrite_cause(&self, present: &'static str) -> &'static str {
        match self.fallback {
            Some(_) => "source_down",
            None => present,
        }
    }

    /// The pinned source for `pinswap.dev/sources`, empty when not known.
    pub(super) fn source_note(&self) -> String {
        match self.source_known {
            true => self.source.to_string(),
            false => String::new(),
        }
    }
}

/// The identity facts of one pinned source (content under a digest never
/// changes, so they are cached by digest).
#[derive(Debug)]
pub(super) struct Assessed {
    /// (platform, facts) per image manifest.
    pub(super) images: Vec<(Option<String>, Facts)>,
    /// The planned repair, when any image needs one.
    pub(super) repair: Option<Arc<Repair>>,
    /// Flagged images a repair leaves as they are, with why.
    pub(super) unrepaired: crate::identity::Unrepaired,
}

/// What [`Mirror::plan_with_any`] tries for `registry`: every credential
/// of `pods` for it, in order, then the config's own (`None`).
pub(super) fn candidates<'c>(
    pods: impl IntoIterator<Item = &'c PodCredentials>,
    registry: &str,
) -> Vec<Option<&'c Credentials>> {
    pods.into_iter()
        .flat_map(|p| p.for_registry(registry))
        .map(Some)
        .chain([None])
        .collect()
}

/// Which images a plan checks the identity of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Assess {
    /// Every image: admission reports what it finds on the Pod.
    All,
    /// Only images about to be copied, whose copy may need repairing: the
    /// backfill, which only records whether the target has the rest
    /// (docs/benchmarks.md, memory at cluster scale).
    Copied,
}

impl Mirror {
    /// Resolves, maps and assesses `src` (docs/architecture.md §3 steps 3 to 5). The
    /// target is the authority for what it holds: a digest it has is planned
    /// without the source, and a tag whose source cannot answer is planned
    /// from the target's copy of that tag. Under `collisions: warn` the
    /// identity check is advisory: with a `deadline` it waits at most half
    /// the time left, and the check goes on in the background for the next
    /// admission.
    ///
    /// # Errors
    /// [`MirrorError::SourceDown`] when the source cannot answer and the
    /// target holds no copy; resolution, registry and identity errors.
    pub(super) async fn plan(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
        assess: Assess,
    ) -> Result<Plan, MirrorError> {
        if src.digest().is_some()
            && let Some(plan) = self.plan_held(src, deadline, None, assess).await?
        {
            return Ok(plan);
        }
        match self.plan_from_source(src, creds, deadline, assess).await {
            Err(MirrorError::SourceDown {
                image,
                registry,
                cause,
                kind,
                ..
            }) => match self.plan_stand_in(src, &cause, deadline, assess).await? {
                Some(plan) => Ok(plan),
                None => Err(MirrorError::SourceDown {
                    image,
                    registry,
                    cause,
                    consequence: "the target has no copy of this image yet".into(),
                    kind,
                }),
            },
            other => other,
        }
    }

    /// [`Mirror::plan`] with the first of `candidates` (each a Pod's or an
    /// object's credentials, `None` the config's own) that the source does
    /// not refuse, and those credentials. A refusal is our credentials
    /// refused, or a 404, which GHCR and Docker Hub answer to hide a
    /// private repository from credentials that may not see it; either
    /// goes on to the next candidate.
    ///
    /// # Errors
    /// The last refusal when every candidate is refused; any other error
    /// at once.
    pub(super) async fn plan_with_any<'c>(
        &self,
        src: &Reference,
        candidates: &[Option<&'c Credentials>],
        deadline: Option<Instant>,
        assess: Assess,
    ) -> Result<(Plan, Option<&'c Credentials>), MirrorError> {
        let mut refused = None;
        for (i, &creds) in candidates.iter().enumerate() {
            if candidates[..i].contains(&creds) {
                continue;
            }
            match self.plan(src, creds, deadline, assess).await {
                Ok(p) => return Ok((p, creds)),
                Err(e) if self.refused_by_source(&e) => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(refused.unwrap_or_else(|| MirrorError::Private {
            image: src.to_string(),
            reason: "no credentials to read it with".into(),
        }))
    }

    /// Whether `e` is the source refusing the credentials a read used
    /// ([`MirrorError::is_refusal`]).
    pub(super) fn refused_by_source(&self, e: &MirrorError) -> bool {
        e.is_refusal(&self.target_key())
    }

    /// The plan for `pinned` (a source pinned by digest, with or without a
    /// tag) when the target already holds it under its tag (the source tag,
    /// or the anchor tag of a digest-only source), else `None`. Asks the
    /// target only. The target digest is the source's when nothing changes
    /// it; under a platform filter or `collisions: repair` it is the one
    /// planned earlier, else the one the anchor tag for this source digest
    /// and this setting names ([`variant_anchor_tag`]), so a fresh replica
    /// finds the copy without the source, and never one made under another
    /// setting.
    ///
    /// `ahead` is the target's answer for the tag when it was already
    /// asked (at the same time as the source): it replaces the HEAD.
    pub(super) async fn plan_held(
        &self,
        pinned: &Reference,
        deadline: Option<Instant>,
        ahead: Option<Result<Option<Digest>, MirrorError>>,
        assess: Assess,
    ) -> Result<Option<Plan>, MirrorError> {
        let Some(source_digest) = pinned.digest() else {
            return Ok(None);
        };
        let tag = match pinned.tag() {
            Some(t) => t.to_owned(),
            None => self.anchor(source_digest),
        };
        let tagged = self.target.map(&pinned.without_digest().with_tag(&tag)?)?;
        let (d, read) = match self.queue.variant() {
            None => (source_digest.clone(), false),
            Some(_) => match self.planned.get(&pinned.to_string()).await {
                Some(d) => (d, false),
                None => {
                    let anchor = tagged.with_tag(&self.anchor(source_digest))?;
                    let Some(d) = Box::pin(self.target_tag_digest(&anchor)).await? else {
                        return Ok(None);
                    };
                    self.planned.insert(pinned.to_string(), d.clone()).await;
                    (d, true)
                }
            },
        };
        let target = tagged.with_digest(d.clone());
        let present = match ahead {
            Some(answer) => {
                let present = answer?.as_ref() == Some(&d);
                if present {
                    self.caches.verified(&target).await;
                }
                present
            }
            // The anchor tag just read is a digest-only source's own tag.
            None if read && pinned.tag().is_none() => {
                self.caches.verified(&target).await;
                true
            }
            None => self.target_has_ref(&target).await?,
        };
        if !present {
            return Ok(None);
        }
        if pinned.tag().is_some() {
            self.held_tag(&tagged, &d).await;
        }
        let plan = self
            .held(pinned.clone(), true, target, deadline, None, assess)
            .await?;
        Ok(Some(plan))
    }

    /// When the source cannot answer: the target's own copy of `src`'s tag
    /// stands in, pinned to the digest the target has under it (the last
    /// copy pinswap made). A digest reference was already looked up at the
    /// target by [`Mirror::plan_held`]. `None` when the target has no copy.
    pub(super) async fn plan_stand_in(
        &self,
        src: &Reference,
        cause: &str,
        deadline: Option<Instant>,
        assess: Assess,
    ) -> Result<Option<Plan>, MirrorError> {
        if src.digest().is_some() {
            return Ok(None);
        }
        let Some(tag) = src.tag() else {
            return Ok(None);
        };
        let tagged = self.target.map(src)?;
        let d = match self.held_tags.get(&tagged.to_string()).await {
            Some(d) if self.caches.has(&tagged.with_digest(d.clone())).await => d,
            _ => {
                let Some(d) = Box::pin(self.target_tag_digest(&tagged)).await? else {
                    return Ok(None);
                };
                self.caches.verified(&tagged.with_digest(d.clone())).await;
                self.held_tag(&tagged, &d).await;
                d
            }
        };
        let target = tagged.with_digest(d.clone());
        // The source digest is the target's unless a filter or a repair
        // made the copy; then only this process's own record knows it.
        let unchanged = self.queue.variant().is_none();
        let (source, known) = match unchanged {
            true => (src.with_digest(d), true),
            false => match self.sources.get(&target.without_tag().to_string()).await {
                Some(s) => (s, true),
                None => (src.clone(), false),
            },
        };
        debug!(image = %src, %cause, target = %target, tag, "source cannot answer; the target's copy stands in");
        let plan = self
            .held(source, known, target, deadline, Some(cause), assess)
            .await?;
        Ok(Some(plan))
    }

    /// A plan for an image the target holds at `target`
    /// (`repository:tag@digest`), made from `source`. Its identity facts
    /// come from the source's earlier assessment when this process has it
    /// (no request), else from the target's copy, unless `assess` says to
    /// skip it.
    pub(super) async fn held(
        &self,
        source: Reference,
        source_known: bool,
        target: Reference,
        deadline: Option<Instant>,
        fallback: Option<&str>,
        assess: Assess,
    ) -> Result<Plan, MirrorError> {
        let assessed = match self.assessed.get(&source.to_string()).await {
            Some(hit) if source_known => Some(hit),
            _ if assess == Assess::Copied => None,
            _ => {
                let at = target.without_tag();
                Box::pin(self.bounded_assessment(
                    &at,
                    self.assess(&at, Role::Target, None),
                    deadline,
                ))
                .await?
            }
        };
        if source_known {
            self.record_source(&target, &source).await;
        }
        Ok(Plan {
            tagged: source.tag().is_some(),
            source,
            target,
            untagged: false,
            verify: false,
            assessed,
            repair: None,
            present: Some(true),
            fallback: fallback.map(str::to_owned),
            source_known,
        })
    }

    /// Waits for an identity assessment as the policy says: under `warn`
    /// with a `deadline`, at most half the time left, and a failure only
    /// logs; otherwise to the end, and a failure is the plan's error.
    pub(super) async fn bounded_assessment(
        &self,
        image: &Reference,
        assessing: impl Future<Output = Result<Arc<Assessed>, MirrorError>>,
        deadline: Option<Instant>,
    ) -> Result<Option<Arc<Assessed>>, MirrorError> {
        let assessed = match (self.collisions, deadline) {
            (CollisionPolicy::Warn, Some(d)) => {
                let now = Instant::now();
                let until = now + d.saturating_duration_since(now) / 2;
                match tokio::time::timeout_at(until.into(), assessing).await {
                    Ok(r) => Some(r),
                    Err(_) => {
                        debug!(%image, "identity check still running; this admission goes without it");
                        None
                    }
                }
            }
            _ => Some(assessing.await),
        };
        match assessed {
            Some(Ok(a)) => Ok(Some(a)),
            None => Ok(None),
            Some(Err(e)) if self.collisions == CollisionPolicy::Warn => {
                warn!(%image, error = %e, "identity check failed; rewriting without it");
                Ok(None)
            }
            Some(Err(e)) => Err(e),
        }
    }

    /// Records that target `tagged` (`repository:tag`) holds `digest`; a
    /// moka insert is a write, so only when that changes.
    pub(super) async fn held_tag(&self, tagged: &Reference, digest: &Digest) {
        let key = tagged.to_string();
        if self.held_tags.get(&key).await.as_ref() != Some(digest) {
            self.held_tags.insert(key, digest.clone()).await;
        }
    }

    /// Records that target `repository@digest` was planned from `source`.
    /// A moka insert is a write (queued, then applied by housekeeping):
    /// skipped when the entry already says this.
    pub(super) async fn record_source(&self, target: &Reference, source: &Reference) {
        let key = target.without_tag().to_string();
        if self.sources.get(&key).await.as_ref() != Some(source) {
            self.sources.insert(key, source.clone()).await;
        }
    }

    /// The plan when the source answers: resolve, then the target first
    /// (it may hold the digest already), else the target digest and the
    /// identity facts from the source.
    pub(super) async fn plan_from_source(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
        assess: Assess,
    ) -> Result<Plan, MirrorError> {
        let unchanged = self.queue.variant().is_none();
        let (source_digest, ahead) = match src.tag() {
            Some(tag) if src.digest().is_none() && unchanged => {
                self.resolve_and_look_ahead(src, tag, creds, deadline)
                    .await?
            }
            _ => (self.resolver.resolve(src, creds, deadline).await?, None),
        };
        let pinned_source = src.with_digest(source_digest.clone());
        if src.digest().is_none()
            && let Some(plan) = self
                .plan_held(&pinned_source, deadline, ahead, assess)
                .await?
        {
            return Ok(plan);
        }
        // With a platform filter the target holds a filtered index with its
        // own digest; planned_digest computes it without pushing anything.
        // Content under a digest never changes, so it is cached by digest.
        let target_digest = match self.queue.copier().filters_platforms() {
            false => source_digest.clone(),
            // Boxed, as in `resolve`: a request's future is large.
            true => Box::pin(self.planned.try_get_with(
                pinned_source.to_string(),
                self.resolver.ask(src, deadline, async {
                    Ok(self
                        .queue
                        .copier()
                        .planned_digest(&Endpoint::Registry(pinned_source.clone()), creds)
                        .await?)
                }),
            ))
            .await
            .map_err(|e| match Arc::try_unwrap(e) {
                Ok(e) => e,
                Err(shared) => shared.for_waiter(src, &self.target_key()),
            })?,
        };
        let assessed = Box::pin(self.bounded_assessment(
            &pinned_source,
            self.assess(&pinned_source, Role::Source, creds),
            deadline,
        ))
        .await?;
        let repair = match self.collisions {
            CollisionPolicy::Repair => assessed.as_ref().and_then(|a| a.repair.clone()),
            _ => None,
        };
        let target_digest = match &repair {
            Some(r) => r.top.digest.clone(),
            None => target_digest,
        };
        if self.collisions == CollisionPolicy::Repair
            && self.planned.get(&pinned_source.to_string()).await.as_ref() != Some(&target_digest)
        {
            self.planned
                .insert(pinned_source.to_string(), target_digest.clone())
                .await;
        }
        let tag = match src.tag() {
            Some(t) => t.to_owned(),
            None => self.anchor(&source_digest),
        };
        let target = self
            .target
            .map(&src.without_digest().with_tag(&tag)?)?
            .with_digest(target_digest);
        self.record_source(&target, &pinned_source).await;
        // Without a filter or repair, plan_held has just looked.
        let present = unchanged.then_some(false);
        Ok(Plan {
            source: pinned_source,
            target,
            tagged: src.tag().is_some(),
            untagged: false,
            verify: false,
            assessed,
            repair,
            present,
            fallback: None,
            source_known: true,
        })
    }

    /// Whether the target has the plan's manifest under the plan's tag, as
    /// planning found, else as [`Mirror::target_has_ref`] finds.
    pub(super) async fn target_has(&self, plan: &Plan) -> Result<bool, MirrorError> {
        match plan.present {
            Some(p) => Ok(p),
            None => self.target_has_ref(&plan.target).await,
        }
    }

    /// Whether the target has `target` (`repository:tag@digest`) under its tag (the
    /// source tag, or the anchor tag of a digest-only source): the existence
    /// cache, else a HEAD by tag compared with the digest, recorded in the
    /// cache when present. By tag, not by digest: the tag must exist too,
    /// both for an unpinned rewrite and so "delete untagged" lifecycle rules
    /// leave the copy alone.
    pub(super) async fn target_has_ref(&self, target: &Reference) -> Result<bool, MirrorError> {
        if self.caches.has(target).await {
            return Ok(true);
        }
        // Boxed, as in `resolve`: a request's future is large.
        Box::pin(self.head_target(target)).await
    }

    /// The digest the target registry has under `tagged`
    /// (`repository:tag`), by HEAD; `None` when it has none. Called boxed:
    /// a request's future is large, and cached admissions should not carry
    /// its space.
    pub(super) async fn target_tag_digest(
        &self,
        tagged: &Reference,
    ) -> Result<Option<Digest>, MirrorError> {
        let client = self.pool.get(tagged.registry(), Role::Target).await?;
        Ok(client.manifest_digest(tagged).await?)
    }

    /// HEAD `target` (`repository:tag@digest`) at the target registry: true
    /// when the tag resolves to the digest. Records a hit in the existence
    /// cache.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when the target does not answer.
    pub async fn head_target(&self, target: &Reference) -> Result<bool, MirrorError> {
        let client = self.pool.get(target.registry(), Role::Target).await?;
        let present = match target.tag() {
            Some(_) => {
                client
                    .manifest_digest(&target.without_digest())
                    .await?
                    .as_ref()
                    == target.digest()
            }
            None => client.manifest_digest(target).await?.is_some(),
        };
        if present {
            self.caches.verified(target).await;
        }
        Ok(present)
    }

    /// Whether the target serves `image` as the kubelet pulls it: by digest
    /// when it has one (containerd pulls `name:tag@digest` by the digest
    /// alone, so a tag moved on to newer content does not matter), else by
    /// tag.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when the target does not answer.
    pub async fn target_serves(&self, image: &Reference) -> Result<bool, MirrorError> {
        let client = self.pool.get(image.registry(), Role::Target).await?;
        let by = match image.digest() {
            Some(_) => image.without_tag(),
            None => image.clone(),
        };
        Ok(client.manifest_digest(&by).await?.is_some())
    }

    /// Resolves `src` (a tag, no digest; no filter or repair, so the
    /// target's digest is the source's) and, when the resolution is not
    /// cached and the existence cache does not vouch for the tag's last
    /// digest, asks the target for the tag at the same time: an uncached
    /// admission then waits for one round trip instead of two, with no
    /// extra request. Returns the source digest and, when asked, the
    /// target's answer.
    ///
    /// # Errors
    /// The resolution's; the target's answer is the caller's to read.
    pub(super) async fn resolve_and_look_ahead(
        &self,
        src: &Reference,
        tag: &str,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<(Digest, Option<Result<Option<Digest>, MirrorError>>), MirrorError> {
        if let Some(d) = self.resolver.cached(src).await {
            return Ok((d, None));
        }
        let tagged = self.target.map(&src.without_digest().with_tag(tag)?)?;
        let vouched = match self.held_tags.get(&tagged.to_string()).await {
            Some(d) => self.caches.vouches(&tagged.with_digest(d)).await,
            None => false,
        };
        if vouched {
            return Ok((self.resolver.resolve(src, creds, deadline).await?, None));
        }
        let (digest, ahead) = tokio::join!(
            self.resolver.resolve(src, creds, deadline),
            Box::pin(self.target_tag_digest(&tagged))
        );
        Ok((digest?, Some(ahead)))
    }
}
