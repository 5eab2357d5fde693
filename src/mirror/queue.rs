//! The copy queue: copies in flight shared by every waiter, their slots,
//! and the purge.

use super::*;

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
pub(super) struct Inflight(
    pub(super) Arc<Mutex<HashMap<String, CopyHandle>>>,
    pub(super) String,
);

impl Drop for Inflight {
    fn drop(&mut self) {
        // A poisoned lock still holds a consistent map: entries are only
        // inserted and removed whole.
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.1);
    }
}

impl Mirror {
    /// The existence-cache and copy-queue key: `repository:tag@digest`.
    pub(super) fn key(&self, plan: &Plan) -> String {
        plan.target.to_string()
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
        let key = self.key(plan);
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
        let (metrics, slots) = (self.metrics.clone(), self.copy_slots.clone());
        let (breakers, resumes, retry) =
            (self.breakers.clone(), self.resumes.clone(), plan.clone());
        let source_key = Self::source_key(&plan.source);
        let target_key = self.target_key();
        let (caches, inflight_map, k) = (self.caches.clone(), self.inflight.clone(), key.clone());
        let follower = self.referrers.clone();
        let source_timeout = self.source_timeout.max(Duration::from_secs(30));
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
            tests::maybe_panic(&k);
            let _permit = match waited_for {
                true => None,
                false => Some(slots.acquire_owned().await.expect("never closed")),
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
            let res = match (res, &anchor) {
                (Ok(report), Some((a, d))) => {
                    let tagged = async {
                        let client = pool.get(a.registry(), Role::Target).await?;
                        copier.tag_manifest(&client, a, d).await
                    };
                    tagged.await.map(|()| report).map_err(CopyError::from)
                }
                (res, _) => res,
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
                            creds: creds.clone(),
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
    pub async fn wait_for_copies(&self) -> usize {
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

    /// Purges cache entries: all of them with `None`; else those `selector`
    /// names. A reference under the target selects existence entries of
    /// that repository (narrowed by its tag and digest when written); any
    /// other reference is a source, and selects its resolution entries and
    /// the existence entries of where it mirrors to. A selector without a
    /// tag or digest covers the whole repository. Returns how many entries
    /// went.
    ///
    /// # Errors
    /// [`MirrorError::Reference`] for a malformed selector.
    pub async fn purge(&self, selector: Option<&str>) -> Result<u64, MirrorError> {
        let Some(s) = selector else {
            return Ok(self.caches.purge(&Purge::All).await);
        };
        let parsed = Reference::parse(s)?;
        let last = s.rsplit('/').next().unwrap_or(s);
        let r = match last.split('@').next().is_some_and(|n| n.contains(':')) {
            true => parsed,
            false => parsed.without_tag(),
        };
        if self.target.contains(&r) {
            return Ok(self.caches.purge(&Purge::Existence(r)).await);
        }
        let mapped = self.target.map(&r)?;
        Ok(self.caches.purge(&Purge::Resolution(r)).await
            + self.caches.purge(&Purge::Existence(mapped)).await)
    }
}
