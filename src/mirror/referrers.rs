//! Referrers follow a mirrored image in the background (docs/referrers.md):
//! an admission waits for the image, not for its signatures, so each copy
//! that ends well hands its referrers to a task here, retried a few times
//! and counted in `pinswap_referrers_copied_total{outcome}`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::reference::{Digest, Reference};
use crate::registry::auth::Credentials;
use crate::registry::referrers::{ReferrerCopier, ReferrersReport};

/// Attempts of one follow; a failed one waits `RETRY_BASE` times its
/// number before the next.
const ATTEMPTS: u32 = 3;
const RETRY_BASE: Duration = Duration::from_secs(1);

/// Follows at once; more wait for a slot.
const SLOTS: usize = 2;

/// Images whose follow is queued or running, at most; past it a follow is
/// dropped (re-verification offers it again).
const MAX_QUEUED: usize = 1024;

/// What the mirror needs to follow an image's referrers.
pub(super) struct Follower {
    copier: ReferrerCopier,
    metrics: Arc<Metrics>,
    /// The sources' circuit breakers: a source that is not answering is
    /// not asked for referrers either (re-verification offers them again).
    breakers: Arc<super::health::Breakers>,
    slots: Semaphore,
    /// Target `repository@digest` queued or running.
    queued: Mutex<HashSet<String>>,
    /// How long one attempt may run (`copy.timeout`).
    timeout: Duration,
}

/// One follow: the pinned source and its digest, the target repository and
/// the top digest there.
#[derive(Clone)]
pub(super) struct Follow {
    pub source: Reference,
    pub source_digest: Digest,
    pub target: Reference,
    pub target_digest: Digest,
    /// The top's media type, when the copy knows it.
    pub target_media_type: Option<String>,
    pub creds: Option<Credentials>,
    /// The copy wrote the image: every cosign tag is asked for, whatever
    /// the source's tag list says ([`ReferrerCopier::copy`]).
    pub cold: bool,
}

impl Follower {
    pub(super) fn new(
        copier: ReferrerCopier,
        metrics: Arc<Metrics>,
        breakers: Arc<super::health::Breakers>,
        timeout: Duration,
    ) -> Self {
        Self {
            copier,
            metrics,
            breakers,
            slots: Semaphore::new(SLOTS),
            queued: Mutex::default(),
            timeout,
        }
    }

    /// Starts following `f` in the background unless it already is queued.
    pub(super) fn spawn(self: &Arc<Self>, f: Follow) {
        let key = format!("{}@{}", f.target.name(), f.target_digest);
        {
            let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            if queued.len() >= MAX_QUEUED {
                debug!(target = %key, "referrer follows at their bound; left to re-verification");
                return;
            }
            if !queued.insert(key.clone()) {
                return;
            }
        }
        let me = self.clone();
        tokio::spawn(async move {
            let _entry = Queued(&me.queued, key);
            let _slot = me.slots.acquire().await.expect("never closed");
            me.run(&f).await;
        });
    }

    /// Waits until no follow is queued or running (a command's end: it
    /// has no background to leave them to).
    pub(super) async fn idle(&self) {
        while !self
            .queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Follows `f` now, retrying failures; the last attempt's report.
    pub(super) async fn run(&self, f: &Follow) -> ReferrersReport {
        let mut attempt = 0;
        let source = crate::reference::normalize_registry(f.source.registry());
        loop {
            if !self.breakers.is_closed(&source) {
                debug!(source = %f.source, "source breaker not closed; referrers left to re-verification");
                return ReferrersReport::default();
            }
            attempt += 1;
            let follow = self.copier.follow(
                &f.source,
                &f.source_digest,
                &f.target,
                (&f.target_digest, f.target_media_type.as_deref()),
                f.creds.as_ref(),
                f.cold,
            );
            // A cut follow is not tried again at once: a source that slow
            // would hold a slot for every attempt. Re-verification offers
            // it again later.
            let Ok(report) = tokio::time::timeout(self.timeout, follow).await else {
                self.metrics.copy_cut("deadline");
                Metrics::outcome(&self.metrics.referrers_copied, "failed");
                let cut = format!(
                    "referrers of {}@{} cut short: not done within {} (copy.timeout)",
                    f.source.name(),
                    f.source_digest,
                    humantime::format_duration(self.timeout)
                );
                warn!(source = %f.source, target = %f.target, "{cut}");
                return ReferrersReport {
                    failed: 1,
                    errors: vec![cut],
                    ..ReferrersReport::default()
                };
            };
            for (outcome, n) in [
                ("copied", report.copied),
                ("present", report.present),
                ("skipped", report.skipped),
                ("failed", report.failed),
            ] {
                self.metrics
                    .referrers_copied
                    .get_or_create(&crate::metrics::OutcomeLabel {
                        outcome: outcome.to_owned(),
                    })
                    .inc_by(n);
            }
            if report.failed == 0 {
                if report.copied > 0 {
                    info!(source = %f.source, target = %f.target, copied = report.copied, "referrers mirrored");
                }
                return report;
            }
            if attempt >= ATTEMPTS {
                warn!(source = %f.source, target = %f.target, failed = report.failed, errors = ?report.errors, "referrers not all mirrored");
                return report;
            }
            tokio::time::sleep(RETRY_BASE * attempt).await;
        }
    }
}

/// Removes a queued follow however its task ends.
struct Queued<'a>(&'a Mutex<HashSet<String>>, String);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut set = self.0.lock().unwrap_or_else(|e| e.into_inner());
        set.remove(&self.1);
    }
}
