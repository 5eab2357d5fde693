//! The copy queue: copies in flight shared by every waiter, their slots,
//! and the resumes of those whose source could not answer. [`Queue`] holds
//! what a copy needs, so a copy task never reaches back into the mirror.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tracing::{debug, info, warn};

use super::error::copy_kind;
use super::plan::Plan;
use super::resolve::source_key;
use super::{anchor_tag, health, identity_check, referrers, resume, variant_anchor_tag};
use crate::cache::Caches;
use crate::metrics::{ErrorCause, Metrics};
use crate::reference::{Digest, normalize_registry};
use crate::registry::auth::Credentials;
use crate::registry::copy::{Copier, CopyError, Endpoint};
use crate::registry::slots::FairSlots;
use crate::registry::{ClientPool, Role};

/// Why a copy failed: the error in words and its kind.
#[derive(Debug, Clone)]
pub(super) struct CopyFailure {
    pub(super) reason: String,
    pub(super) cause: ErrorCause,
}

/// A copy's outcome: blobs copied or mounted (what a verifying copy
/// restored), or the failure.
pub(super) type CopyHandle = Shared<BoxFuture<'static, Result<u64, CopyFailure>>>;

/// A copy-queue entry, removed from the map when the copy's task ends.
struct Inflight(Arc<Mutex<HashMap<String, CopyHandle>>>, String);

impl Drop for Inflight {
    fn drop(&mut self) {
        // A poisoned lock still holds a consistent map: entries are only
        // inserted and removed whole.
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.1);
    }
}

/// The existence-cache and copy-queue key: `repository:tag@digest`.
pub(super) fn key(plan: &Plan) -> String {
    plan.target.to_string()
}

/// What every copy needs, and the copies in flight.
pub(super) struct Queue {
    inflight: Arc<Mutex<HashMap<String, CopyHandle>>>,
    /// Slots for background copies (admissions' copies start at once),
    /// shared fairly by source registry ([`FairSlots`]).
    slots: Arc<FairSlots>,
    copier: Arc<Copier>,
    /// As `copier`, with `verify_target`: restores lost blobs and children.
    verifier: Arc<Copier>,
    pool: Arc<ClientPool>,
    metrics: Arc<Metrics>,
    caches: Arc<Caches>,
    breakers: Arc<health::Breakers>,
    /// Copies that failed because their source could not answer, to retry.
    resumes: Arc<resume::Resumes>,
    /// Copies referrers after their image (`referrers`); `None` when off.
    referrers: Option<Arc<referrers::Follower>>,
    /// How long a breaker's probe waits for the source.
    source_timeout: Duration,
    /// How long a copy may run (`copy.timeout`).
    copy_timeout: Duration,
    /// The target registry, normalised, as errors name it.
    target_key: String,
    /// [`super::copy_variant`] of this config: `Some` when a copy's digest
    /// may differ from the source's.
    variant: Option<String>,
}

/// The parts a [`Queue`] is built from.
pub(super) struct QueueParts {
    pub(super) copier: Arc<Copier>,
    pub(super) verifier: Arc<Copier>,
    pub(super) pool: Arc<ClientPool>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) caches: Arc<Caches>,
    pub(super) breakers: Arc<health::Breakers>,
    pub(super) resumes: Arc<resume::Resumes>,
    pub(super) referrers: Option<Arc<referrers::Follower>>,
    pub(super) source_timeout: Duration,
    pub(super) copy_timeout: Duration,
    /// Background copy slots: in all, and for one source registry.
    pub(super) slots: (usize, usize),
    pub(super) target_key: String,
    pub(super) variant: Option<String>,
}

impl Queue {
    pub(super) fn new(p: QueueParts) -> Self {
        Self {
            inflight: Arc::default(),
            slots: Arc::new(FairSlots::new(p.slots.0, p.slots.1)),
            copier: p.copier,
            verifier: p.verifier,
            pool: p.pool,
            metrics: p.metrics,
            caches: p.caches,
            breakers: p.breakers,
            resumes: p.resumes,
            referrers: p.referrers,
            source_timeout: p.source_timeout,
            copy_timeout: p.copy_timeout,
            target_key: p.target_key,
            variant: p.variant,
        }
    }

    /// The copier (no target verification).
    pub(super) fn copier(&self) -> &Arc<Copier> {
        &self.copier
    }

    /// The referrers follower, when referrers travel.
    pub(super) fn referrers(&self) -> Option<&Arc<referrers::Follower>> {
        self.referrers.as_ref()
    }

    /// Copies waiting for their source to answer again.
    pub(super) fn resumes(&self) -> &resume::Resumes {
        &self.resumes
    }

    /// The copy variant of this config, when copies may differ from the
    /// source's digest.
    pub(super) fn variant(&self) -> Option<&str> {
        self.variant.as_deref()
    }

    /// The anchor tag at the target for source digest `d`: the plain one
    /// while copies keep the source's digest, else the one naming this
    /// config's platform filter and repair setting.
    pub(super) fn anchor(&self, d: &Digest) -> String {
        match &self.variant {
            None => anchor_tag(d),
            Some(v) => variant_anchor_tag(d, v),
        }
    }

    /// Whether no copy is in flight.
    #[cfg(test)]
    pub(super) fn is_idle(&self) -> bool {
        self.inflight.lock().expect("inflight lock").is_empty()
    }

    /// Starts (or joins) the copy for `plan`; it runs to the end in the
    /// background whoever stops waiting for it.
    ///
    /// Background (`delayed`) copies queue for one of the copy slots;
    /// copies an admission waits for (`immediate`, `force`) start at once,
    /// so a backlog of background work cannot make them miss their deadline.
    /// Blob transfers stay bounded by the copier's `--jobs` slots either way.
    /// `resumed`: a retry of the resume queue, whose failures count there.
    pub(super) fn copy(
        &self,
        plan: &Plan,
        creds: Option<&Credentials>,
        waited_for: bool,
        resumed: bool,
    ) -> CopyHandle {
        let key = key(plan);
        let mut inflight = self.inflight.lock().expect("inflight lock");
        if let Some(h) = inflight.get(&key) {
            return h.clone();
        }
        let (src, dst, creds) = (plan.source.clone(), plan.target.clone(), creds.cloned());
        let (repair, pool) = (plan.repair.clone(), self.pool.clone());
        // Without the tag, pushes go by digest and the tag stays put.
        let dst = if plan.untagged {
            dst.without_tag()
        } else {
            dst
        };
        let copier = match plan.verify {
            true => self.verifier.clone(),
            false => self.copier.clone(),
        };
        let (metrics, slots) = (self.metrics.clone(), self.slots.clone());
        let (breakers, resumes, retry) =
            (self.breakers.clone(), self.resumes.clone(), plan.clone());
        let source_key = source_key(&plan.source);
        let target_key = self.target_key.clone();
        let (caches, inflight_map, k) = (self.caches.clone(), self.inflight.clone(), key.clone());
        let follower = self.referrers.clone();
        let source_timeout = self.source_timeout.max(Duration::from_secs(30));
        let copy_timeout = self.copy_timeout;
        // A tagged copy whose digest may differ from the source's gets the
        // anchor tag of its source digest too: how another replica finds it
        // while the source cannot answer (a digest-only one has it as its tag).
        let anchor = match (&self.variant, plan.source.digest(), plan.target.digest()) {
            (Some(_), Some(s), Some(d)) if plan.tagged && !plan.untagged => {
                let tagged = plan.target.without_digest().with_tag(&self.anchor(s)).ok();
                tagged.map(|t| (t, d.clone()))
            }
            _ => None,
        };
        // An untagged push verifies the digest, not the tag.
        let target_ref = match plan.untagged {
            true => plan.target.without_tag(),
            false => plan.target.clone(),
        };
        let task = tokio::spawn(async move {
            // Removes the queue entry however the task ends: returned,
            // panicked or aborted. Otherwise a failed handle would be
            // shared with every later caller for the life of the process.
            let _entry = Inflight(inflight_map, k.clone());
            #[cfg(test)]
            super::tests::maybe_panic(&k);
            let _permit = match waited_for {
                true => None,
                false => Some(slots.acquire(&source_key).await),
            };
            metrics.copies_started.inc();
            let start = Instant::now();
            // A source whose breaker is open is not asked: the copy fails at
            // once and waits in `resumes` for the source to answer again.
            let refused = |open: health::Open| {
                metrics.copies_failed.inc();
                // Never sent: no retry of the resume queue is spent.
                resumes.failed(&k, &retry, creds.as_ref(), false);
                debug!(source = %src, target = %k, %open, "copy waits for its source");
                Err(CopyFailure {
                    reason: format!(
                        "source registry {source_key} cannot answer (circuit breaker open after {open})"
                    ),
                    cause: ErrorCause::Source,
                })
            };
            let attempt = match breakers.attempt(&source_key) {
                Ok(a) => a,
                Err(open) => return refused(open),
            };
            // The breaker's probe is one HEAD, not the whole copy: a copy
            // may run for minutes, and while the probe runs every admission
            // is refused the source.
            let attempt = match attempt.is_probe() {
                false => attempt,
                true => {
                    let probe = async {
                        let client = pool
                            .get_with(src.registry(), Role::Source, creds.as_ref())
                            .await?;
                        client.head_manifest(&src).await.map(drop)
                    };
                    let outage = match tokio::time::timeout(source_timeout, probe).await {
                        Err(_) => Some((
                            crate::registry::Outage::Timeout,
                            None,
                            format!(
                                "no answer within {}",
                                humantime::format_duration(source_timeout)
                            ),
                        )),
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => match (e.registry().map(normalize_registry), e.outage()) {
                            (Some(r), Some((o, retry_after))) if r == source_key => {
                                Some((o, retry_after, e.outage_cause()))
                            }
                            _ => None,
                        },
                    };
                    if let Some((o, retry_after, cause)) = outage {
                        attempt.failed(o, cause.clone(), retry_after);
                        metrics.copies_failed.inc();
                        resumes.failed(&k, &retry, creds.as_ref(), resumed);
                        return Err(CopyFailure {
                            reason: format!("source registry {source_key} cannot answer: {cause}"),
                            cause: ErrorCause::Source,
                        });
                    }
                    attempt.answered();
                    match breakers.attempt(&source_key) {
                        Ok(a) => a,
                        Err(open) => return refused(open),
                    }
                }
            };
            let work = async {
                let res = match &repair {
                    None => {
                        copier
                            .copy_with(
                                &Endpoint::Registry(src.clone()),
                                &Endpoint::Registry(dst),
                                creds.as_ref(),
                            )
                            .await
                    }
                    // The original by digest (its blobs and child manifests),
                    // then the repaired configs and manifests, the top by tag.
                    Some(r) => {
                        let original = dst.without_tag().with_digest(r.original.clone());
                        match copier
                            .copy_with(
                                &Endpoint::Registry(src.clone()),
                                &Endpoint::Registry(original),
                                creds.as_ref(),
                            )
                            .await
                        {
                            Ok(report) => identity_check::push_repair(&pool, &copier, &dst, r)
                                .await
                                .map(|()| report),
                            Err(e) => Err(e),
                        }
                    }
                };
                match (res, &anchor) {
                    (Ok(report), Some((a, d))) => {
                        let tagged = async {
                            let client = pool.get(a.registry(), Role::Target).await?;
                            copier.tag_manifest(&client, a, d).await
                        };
                        tagged.await.map(|()| report).map_err(CopyError::from)
                    }
                    (res, _) => res,
                }
            };
            // Dropping the work on the deadline stops every request in
            // flight; manifests go up only after their blobs, so what was
            // written is never a manifest missing its blobs.
            let res = match tokio::time::timeout(copy_timeout, work).await {
                Ok(res) => res,
                Err(_) => {
                    metrics.copy_cut("deadline");
                    Err(CopyError::Deadline {
                        after: copy_timeout,
                    })
                }
            };
            metrics.copy_seconds.observe(start.elapsed().as_secs_f64());
            let outage = res.as_ref().err().and_then(|e| match e {
                CopyError::Registry(r)
                    if r.registry().map(normalize_registry).as_deref() == Some(&source_key) =>
                {
                    r.outage().map(|(o, retry)| (o, retry, r.outage_cause()))
                }
                _ => None,
            });
            match outage {
                Some((o, retry_after, cause)) => {
                    attempt.failed(o, cause, retry_after);
                    resumes.failed(&k, &retry, creds.as_ref(), resumed);
                }
                None => {
                    attempt.answered();
                    resumes.settled(&k);
                }
            }
            match res {
                Ok(r) => {
                    metrics.copies_succeeded.inc();
                    metrics.copy_bytes.inc_by(r.bytes_copied);
                    caches.verified(&target_ref).await;
                    // Referrers follow in the background: the admission
                    // waits for the image alone.
                    if let Some(follower) = &follower
                        && let (Ok(sd), Ok(td)) =
                            (Digest::parse(&r.source_digest), Digest::parse(&r.digest))
                    {
                        follower.spawn(referrers::Follow {
                            source: src.clone(),
                            source_digest: sd,
                            target: target_ref.without_tag().without_digest(),
                            target_digest: td,
                            target_media_type: r.media_type.clone(),
                            creds: creds.clone(),
                            cold: !r.up_to_date,
                        });
                    }
                    info!(source = %src, target = %k, bytes = r.bytes_copied, "mirrored");
                    Ok(r.blobs_copied + r.blobs_mounted)
                }
                Err(e) => {
                    metrics.copies_failed.inc();
                    warn!(source = %src, target = %k, error = %e, "mirror copy failed");
                    Err(CopyFailure {
                        reason: e.to_string(),
                        cause: copy_kind(&e, &target_key),
                    })
                }
            }
        });
        // A copy task that panicked failed writing the copy: the target's.
        let handle = async move {
            task.await.unwrap_or_else(|e| {
                Err(CopyFailure {
                    reason: e.to_string(),
                    cause: ErrorCause::Target,
                })
            })
        }
        .boxed()
        .shared();
        inflight.insert(key, handle.clone());
        handle
    }

    /// Waits for every copy started so far (a CLI run must not exit while
    /// `copyPolicy: delayed` copies are still in flight). Returns how many
    /// failed.
    pub(super) async fn wait(&self) -> usize {
        let handles: Vec<CopyHandle> = self
            .inflight
            .lock()
            .expect("inflight lock")
            .values()
            .cloned()
            .collect();
        let failed = futures::future::join_all(handles)
            .await
            .iter()
            .filter(|r| r.is_err())
            .count();
        // The referrers those copies handed on, too.
        if let Some(f) = &self.referrers {
            f.idle().await;
        }
        failed
    }
}
