//! Mirroring an image something already running names (the backfill,
//! docs/architecture.md §3 "Background"): what admission would copy, planned
//! and copied the same way, but outside admission's copy slots (the caller
//! bounds how many run) and never while the source's breaker is open.

use std::time::Instant;

use super::{Mirror, MirrorError};
use crate::metrics::ErrorCause;
use crate::reference::Reference;
use crate::registry::pullsecrets::PodCredentials;

/// What [`Mirror::backfill`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Backfilled {
    /// The target holds the image already.
    Present,
    /// The image was copied to the target.
    Copied {
        /// Where it went, `repository:tag@digest`.
        target: Reference,
        /// How long the copy took, in seconds.
        seconds: f64,
    },
}

impl Mirror {
    /// Mirrors `src` as an admission of a Pod naming it would, when the
    /// target does not hold it, and waits for the copy. `pods` are the
    /// credentials of the objects naming it: a private image is copied only
    /// with those of one that may have it (docs/security.md).
    ///
    /// # Errors
    /// [`MirrorError::SourceDown`] while the source cannot answer (its
    /// breaker is open: nothing is sent); [`MirrorError::Private`] when no
    /// object of `pods` may have it; resolution, registry and copy errors.
    pub async fn backfill(
        &self,
        src: &Reference,
        pods: &[PodCredentials],
    ) -> Result<Backfilled, MirrorError> {
        // Resolved with the first credentials the source accepts: each
        // object's in turn, then the config's own (a refusal does not trip
        // the breaker).
        let candidates = super::plan::candidates(pods, src.registry());
        let plan = match self
            .plan_with_any(src, &candidates, None, super::plan::Assess::Copied)
            .await
        {
            Ok((plan, _)) => plan,
            Err(e) if self.refused_by_source(&e) => {
                return Err(MirrorError::Private {
                    image: src.to_string(),
                    reason: format!(
                        "no Pod or template naming it may have it: the source refuses their credentials ({e})"
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        if self.target_has(&plan).await? {
            return Ok(Backfilled::Present);
        }
        let creds = self
            .access_among(&plan.source, plan.source_known, pods)
            .await?;
        // A copy refused by the breaker would wait in the resume queue,
        // whose retries take admission's copy slots: the backfill retries
        // on its own once the breaker lets requests through.
        let wait = self.source_retry_in(&plan.source);
        if !wait.is_zero() {
            return Err(MirrorError::SourceDown {
                image: src.to_string(),
                registry: super::resolve::source_key(&plan.source),
                cause: "circuit breaker open".into(),
                consequence: "backfilled once it answers".into(),
                kind: ErrorCause::Source,
            });
        }
        let start = Instant::now();
        // Waited for (`true`): no copy slot is taken; the caller bounds how
        // many run.
        if let Err(f) = self.queue.copy(&plan, creds.as_ref(), true, false).await {
            // The backfill retries it itself, outside the copy slots the
            // resume queue's retries take.
            self.queue.resumes().forget(&super::queue::key(&plan));
            return Err(MirrorError::CopyFailed {
                image: plan.source.to_string(),
                reason: f.reason,
                kind: f.cause,
            });
        }
        Ok(Backfilled::Copied {
            target: plan.target,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}
