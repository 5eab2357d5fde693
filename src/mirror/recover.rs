//! Recovery of a lost image (docs/architecture.md §3 "Background"): re-verification
//! of a cached entry, and restoring an image a Pod pins.

use std::time::Instant;

use tracing::{debug, info};

use super::{Mirror, MirrorError, Plan};
use crate::cache::Cause;
use crate::config::CollisionPolicy;
use crate::metrics::ErrorCause;
use crate::reference::Reference;
use crate::registry::Role;
use crate::registry::auth::Credentials;
use crate::registry::pullsecrets::PodCredentials;

/// What [`Mirror::recover`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Recovered {
    /// The target has the image; the pull failure has another cause.
    Present,
    /// The image was missing and has been mirrored again.
    Remirrored {
        /// The pinned source it was copied from.
        source: Reference,
        /// How long the copy took, in seconds.
        seconds: f64,
    },
}

impl Mirror {
    /// Re-verifies an existence entry: HEAD `target` (`repository@digest`)
    /// by digest; when present, HEAD each of `tags` and forget those that
    /// now name other content (the source tag moved on; the digest is still
    /// there for the Pods pinned to it). Returns whether the manifest is
    /// present; a present one has its verification time refreshed.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when the target does not answer.
    pub async fn reverify(&self, target: &Reference, tags: &[String]) -> Result<bool, MirrorError> {
        let client = self.pool.get(target.registry(), Role::Target).await?;
        if client
            .manifest_digest(&target.without_tag())
            .await?
            .is_none()
        {
            return Ok(false);
        }
        self.caches.verified(&target.without_tag()).await;
        for t in tags {
            let tagged = target.with_tag(t)?;
            if client
                .manifest_digest(&tagged.without_digest())
                .await?
                .as_ref()
                != target.digest()
            {
                info!(image = %tagged, "re-verification: the tag names other content now; forgetting it for this digest");
                self.caches.forget_tag(&tagged).await;
            }
        }
        Ok(true)
    }

    /// Offers the referrers of `target` (`repository@digest`, which this
    /// replica planned) to the background follow again, so referrers that
    /// appeared at the source since the copy reach the target too.
    pub async fn refresh_referrers(&self, target: &Reference) {
        let (Some(follower), Some(digest)) = (self.queue.referrers(), target.digest()) else {
            return;
        };
        let Some(source) = self.sources.get(&target.without_tag().to_string()).await else {
            return;
        };
        let Some(source_digest) = source.digest().cloned() else {
            return;
        };
        // Only the configured credentials are at hand here: the referrers
        // of an image that needs a Pod's own pull secret are copied at
        // admission and not refreshed (docs/referrers.md), rather than
        // refused by the source at every round.
        if !self.access.readable_without_pods(&source).await {
            debug!(image = %source, "referrers not refreshed: a private image");
            return;
        }
        follower.spawn(super::referrers::Follow {
            source,
            source_digest,
            target: target.without_tag().without_digest(),
            target_digest: digest.clone(),
            target_media_type: None,
            creds: None,
            cold: false,
        });
    }

    /// Mirrors `target` again if the target registry lost it: the recovery
    /// step of docs/architecture.md §3 "Background". `target` is the image as a Pod
    /// names it (`repository:tag@digest`, or `repository@digest`);
    /// `source_hint` is the Pod's original image (from the
    /// `pinswap.dev/original-images` annotation), used when this process
    /// did not plan the image itself.
    ///
    /// `pods` are the credentials of Pods that use the image (the failing
    /// one first): a private image is copied only with credentials of one
    /// of them that read it at the source (docs/security.md).
    ///
    /// Steps: invalidate the existence entry under `cause`; HEAD the target;
    /// when missing, copy the source pinned to the digest the Pod pins, and
    /// wait for it. Concurrent calls for one image share one copy (the copy
    /// queue's key), and share it with admissions copying the same image.
    ///
    /// # Errors
    /// [`MirrorError::Resolve`] when no source can be found for the digest
    /// (see [`Mirror::source_for`]); registry errors from the HEAD;
    /// [`MirrorError::CopyFailed`] when the copy fails;
    /// [`MirrorError::Private`] when no Pod of `pods` may have the image.
    pub async fn recover(
        &self,
        target: &Reference,
        source_hint: Option<&Reference>,
        cause: Cause,
        pods: &[PodCredentials],
    ) -> Result<Recovered, MirrorError> {
        self.caches.invalidate(target, cause).await;
        // A hint comes from a Pod annotation, which the Pod's author writes:
        // it may only name the source this target repository mirrors.
        let hint = match source_hint {
            Some(h) if self.target.map(h)?.name() != target.name() => {
                return Err(MirrorError::Resolve {
                    image: target.to_string(),
                    reason: format!(
                        "its pinswap.dev/sources (or original-images) entry {h} does not mirror to {}; refusing it",
                        target.name()
                    ),
                    kind: ErrorCause::Source,
                });
            }
            h => h,
        };
        let verify = cause == Cause::PullFailure;
        let creds = hint.and_then(|h| pods.iter().find_map(|p| p.first(h.registry())));
        if target.digest().is_none()
            && let Some(hint) = hint
        {
            // An unpinned rewrite (`pin: false`) names a tag only: the
            // source tag's current content is what the kubelet wants.
            let candidates = super::plan::candidates(pods, hint.registry());
            let (mut plan, _) = self
                .plan_with_any(
                    &hint.without_digest(),
                    &candidates,
                    None,
                    super::plan::Assess::All,
                )
                .await?;
            plan.verify = verify;
            return self.restore(plan, pods).await;
        }
        let source = self.source_for(target, hint, creds).await?;
        let tag = match (target.tag(), source.digest()) {
            (Some(t), _) => t.to_owned(),
            (None, Some(d)) => self.anchor(d),
            // A stand-in (source down) for a filtered or repaired copy
            // names the source's tag, not the digest it was made from; the
            // Pod's image names no tag to restore it under.
            (None, None) => {
                return Err(MirrorError::Resolve {
                    image: target.to_string(),
                    reason: format!(
                        "the source {source} cannot say which digest this copy was made from (it did not answer, and the mirror's digest differs from the source's under a platform filter or identity repair); retried when it answers"
                    ),
                    kind: ErrorCause::Source,
                });
            }
        };
        // Planned again from the pinned source, so a repaired image is
        // repaired again the same way (repair is deterministic).
        let mut plan = self
            .plan(
                &source.with_tag(&tag)?,
                creds,
                None,
                super::plan::Assess::All,
            )
            .await?;
        if plan.target.digest() != target.digest() {
            return Err(MirrorError::Resolve {
                image: target.to_string(),
                reason: format!(
                    "its source {source} now plans to {}, not the digest the Pod pins",
                    plan.target
                ),
                kind: ErrorCause::Source,
            });
        }
        plan.verify = verify;
        self.restore(plan, pods).await
    }

    /// Restores `plan`'s target. Presence is by digest: the kubelet pulls a
    /// pinned image by digest, and a tag moved on to newer content (the
    /// source tag moved) does not make older content missing. Then:
    /// - present and not `plan.verify`: nothing to do;
    /// - present and `plan.verify`: a verifying copy restores any lost
    ///   blob or child manifest (the kubelet failed for a reason);
    /// - missing: copy it, through the copy queue, with the credentials of
    ///   the first of `pods` that may have it.
    ///
    /// The tag is pushed only when it is missing or names this digest or
    /// content that is gone: recovery never moves a tag away from other
    /// content at the target.
    async fn restore(
        &self,
        mut plan: Plan,
        pods: &[PodCredentials],
    ) -> Result<Recovered, MirrorError> {
        let client = self.pool.get(plan.target.registry(), Role::Target).await?;
        let present = client
            .manifest_digest(&plan.target.without_tag())
            .await?
            .is_some();
        if let Some(tag_ref) = plan.target.tag().map(|_| plan.target.without_digest()) {
            match client.manifest_digest(&tag_ref).await? {
                Some(d) if Some(&d) != plan.target.digest() => {
                    let other = tag_ref.with_digest(d);
                    plan.untagged = client
                        .manifest_digest(&other.without_tag())
                        .await?
                        .is_some();
                }
                _ => {}
            }
        }
        if present && !plan.verify {
            if !plan.untagged {
                self.caches.verified(&plan.target).await;
            }
            return Ok(Recovered::Present);
        }
        let creds = self
            .access_among(&plan.source, plan.source_known, pods)
            .await?;
        let start = Instant::now();
        let restored = self
            .queue
            .copy(&plan, creds.as_ref(), false, false)
            .await
            .map_err(|f| MirrorError::CopyFailed {
                image: plan.source.to_string(),
                reason: f.reason,
                kind: f.cause,
            })?;
        if present && restored == 0 {
            return Ok(Recovered::Present);
        }
        Ok(Recovered::Remirrored {
            source: plan.source,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// The source that target image `target` was mirrored from, pinned by
    /// digest, except where a stand-in answered for a source that is down
    /// (then the hint's tag, unpinned):
    /// 1. the one this process planned for `target`'s `repository@digest`;
    /// 2. else `hint`'s repository at `target`'s digest when every platform
    ///    is mirrored (the copy keeps the digest);
    /// 3. else, with a platform filter, `hint` resolved now, when planning
    ///    it still gives `target`'s digest.
    ///
    /// # Errors
    /// [`MirrorError::Resolve`] when `target` has no digest, when there is no
    /// hint, or when the hint's tag now names other content.
    pub async fn source_for(
        &self,
        target: &Reference,
        hint: Option<&Reference>,
        creds: Option<&Credentials>,
    ) -> Result<Reference, MirrorError> {
        let unknown = |reason: &str| MirrorError::Resolve {
            image: target.to_string(),
            reason: reason.to_owned(),
            kind: ErrorCause::Source,
        };
        let digest = target
            .digest()
            .ok_or_else(|| unknown("not pinned by digest, so the content it named is unknown"))?;
        if let Some(s) = self.sources.get(&target.without_tag().to_string()).await {
            return Ok(s);
        }
        let hint = hint.ok_or_else(|| {
            unknown("no pinswap.dev/sources or original-images entry names its source, and this replica did not mirror it")
        })?;
        // A platform filter or a repair gives the mirror a digest of its own:
        // plan the hint again (by its digest when it pins one, else by its
        // tag as it resolves now) and accept it if it plans to `digest`.
        if self.queue.copier().filters_platforms() || self.collisions == CollisionPolicy::Repair {
            let hint = match hint.digest() {
                Some(_) => hint.clone(),
                None => hint.without_digest(),
            };
            let plan = self
                .plan(&hint, creds, None, super::plan::Assess::All)
                .await?;
            if plan.target.digest() == Some(digest) {
                return Ok(plan.source);
            }
            return Err(unknown(&format!(
                "{} now resolves to other content, and the mirror's digest differs from the source's (platform filter or identity repair); the source for {digest} is unknown",
                hint.without_digest()
            )));
        }
        Ok(hint.without_tag().with_digest(digest.clone()))
    }
}
