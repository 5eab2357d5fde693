//! Copies that failed because their source could not answer, retried when
//! it can again (docs/architecture.md §3 "Background": the copy queue retries copies
//! whose source was down once its breaker closes).
//!
//! Bounded: at most [`MAX_PENDING`] images wait, each retried at most
//! [`MAX_ATTEMPTS`] times, with a backoff from `source.breaker.backoff`
//! doubling up to `source.breaker.maxBackoff`. An entry is keyed like the
//! copy queue (target `repository:tag@digest`), so an image waits once
//! however many admissions asked for it, and only the retries made from
//! here count: admissions failing during the outage spend none of them.
//! A retry goes only when its source's breaker lets a request through, and
//! while the breaker is not closed, one retry per source at a time (it is
//! the probe).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::health::Breakers;
use super::{Mirror, Plan};
use crate::config::Breaker;
use crate::registry::auth::Credentials;

/// Images waiting for their source at most.
pub const MAX_PENDING: usize = 1000;

/// Retries of one image at most.
pub const MAX_ATTEMPTS: u32 = 10;

struct Pending {
    plan: Plan,
    creds: Option<Credentials>,
    /// Failed retries so far.
    attempts: u32,
    /// Not before this; `None` while a retry is running.
    due: Option<Instant>,
}

/// The copies waiting for their source.
pub(super) struct Resumes {
    settings: Breaker,
    pending: Mutex<HashMap<String, Pending>>,
}

impl Resumes {
    pub(super) fn new(settings: Breaker) -> Self {
        Self {
            settings,
            pending: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a copy of `plan` that failed for a source outage; `retried`
    /// when it was one of this queue's retries (only those count).
    pub(super) fn failed(
        &self,
        key: &str,
        plan: &Plan,
        creds: Option<&Credentials>,
        retried: bool,
    ) {
        let mut pending = self.lock();
        let attempts = pending.get(key).map_or(0, |p| p.attempts) + u32::from(retried);
        if attempts >= MAX_ATTEMPTS {
            pending.remove(key);
            warn!(
                target = key,
                attempts = MAX_ATTEMPTS,
                "giving up retrying a copy whose source cannot answer; the next admission of the image starts it again"
            );
            return;
        }
        // An admission's copy failed while this one waits: it keeps its
        // place, its count and its credentials.
        if !retried && pending.get(key).is_some_and(|p| p.due.is_some()) {
            return;
        }
        if !pending.contains_key(key) && pending.len() >= MAX_PENDING {
            warn!(
                target = key,
                "too many copies wait for their source; not retrying this one"
            );
            return;
        }
        let wait = self
            .settings
            .backoff
            .saturating_mul(1 << attempts.min(16))
            .min(self.settings.max_backoff);
        pending.insert(
            key.to_owned(),
            Pending {
                plan: plan.clone(),
                creds: creds.cloned(),
                attempts,
                due: Some(Instant::now() + wait),
            },
        );
    }

    /// The copy of `key` completed (or failed for another reason): stop
    /// retrying it.
    pub(super) fn settled(&self, key: &str) {
        if self.lock().remove(key).is_some() {
            info!(target = key, "copy resumed after its source came back");
        }
    }

    /// Drops `key` without a word: its caller retries it itself.
    pub(super) fn forget(&self, key: &str) {
        self.lock().remove(key);
    }

    /// Makes every waiting image due now (a breaker closed).
    fn all_due(&self) {
        for p in self.lock().values_mut() {
            if p.due.is_some() {
                p.due = Some(Instant::now());
            }
        }
    }

    /// Takes the due entries whose source may be asked (`ready`, which is
    /// asked once per entry, in no particular order), marking them running.
    fn take_due(&self, mut ready: impl FnMut(&Plan) -> bool) -> Vec<(Plan, Option<Credentials>)> {
        let now = Instant::now();
        let mut out = Vec::new();
        for p in self.lock().values_mut() {
            if p.due.is_some_and(|d| d <= now) && ready(&p.plan) {
                p.due = None;
                out.push((p.plan.clone(), p.creds.clone()));
            }
        }
        out
    }

    /// How many images wait.
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Whether a retry for `registry` may go in this round: always while its
/// breaker is closed; else only when the breaker would let a request
/// through (not open, no probe running) and no other retry of this round
/// (`probing`) is already its probe.
fn retry_now(breakers: &Breakers, registry: &str, probing: &mut HashSet<String>) -> bool {
    if breakers.is_closed(registry) {
        return true;
    }
    breakers.admits(registry) && probing.insert(registry.to_owned())
}

impl Mirror {
    /// Retries copies that failed because their source could not answer:
    /// each due one whose source's breaker lets a request through (the
    /// retry is then the breaker's probe), and every one as soon as a
    /// breaker closes. Runs until `token` is cancelled (`pinswap serve`).
    pub async fn resume_copies(self: Arc<Self>, token: tokio_util::sync::CancellationToken) {
        let mut closings = self.resolver.breakers().closings();
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                r = closings.changed() => {
                    if r.is_err() {
                        return;
                    }
                    self.queue.resumes().all_due();
                }
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let mut probing = HashSet::new();
            let breakers = self.resolver.breakers();
            let due = self.queue.resumes().take_due(|p| {
                retry_now(
                    breakers,
                    &super::resolve::source_key(&p.source),
                    &mut probing,
                )
            });
            for (plan, creds) in due {
                drop(self.queue.copy(&plan, creds.as_ref(), false, true));
            }
        }
    }

    /// How many copies wait for their source to answer again.
    pub fn copies_waiting_for_source(&self) -> usize {
        self.queue.resumes().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    fn settings() -> Breaker {
        Breaker {
            failures: 1,
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(60),
        }
    }

    /// During an outage every admission's copy fails; none of those spends
    /// a retry, so an image is still retried up to MAX_ATTEMPTS times.
    #[tokio::test(start_paused = true)]
    async fn only_retries_count_against_the_limit() {
        let r = Resumes::new(settings());
        let plan = super::super::tests::plan("127.0.0.1:9/shop/app:v1");
        for _ in 0..100 {
            r.failed("k", &plan, None, false);
        }
        assert_eq!(r.len(), 1);
        assert_eq!(r.lock()["k"].attempts, 0, "admissions spend nothing");
        let first = r.lock()["k"].due.unwrap();
        assert_eq!(first, Instant::now() + Duration::from_secs(5));
        for n in 1..MAX_ATTEMPTS {
            r.failed("k", &plan, None, true);
            assert_eq!(r.lock()["k"].attempts, n);
            // An admission in between neither counts nor moves it.
            r.failed("k", &plan, None, false);
            assert_eq!(r.lock()["k"].attempts, n);
        }
        r.failed("k", &plan, None, true);
        assert_eq!(r.len(), 0, "given up after {MAX_ATTEMPTS} retries");
    }

    /// A retry goes only when the breaker lets a request through, and one
    /// per source while it is not closed: never while a probe runs.
    #[tokio::test(start_paused = true)]
    async fn retries_wait_for_a_running_probe_and_go_one_at_a_time() {
        let b = Arc::new(Breakers::new(
            settings(),
            Arc::new(Metrics::new()),
            ["r".to_owned()],
        ));
        let mut round = HashSet::new();
        assert!(
            retry_now(&b, "r", &mut round) && retry_now(&b, "r", &mut round),
            "closed"
        );
        b.attempt("r").unwrap().failed(
            crate::registry::Outage::ServerError,
            "HTTP 503".into(),
            None,
        );
        let mut round = HashSet::new();
        assert!(!retry_now(&b, "r", &mut round), "open");
        tokio::time::advance(Duration::from_secs(5)).await;
        let probe = b.attempt("r").expect("half-open");
        assert!(!retry_now(&b, "r", &mut round), "a probe is running");
        drop(probe);
        assert!(retry_now(&b, "r", &mut round), "the retry is the probe");
        assert!(!retry_now(&b, "r", &mut round), "one per round");
        assert!(retry_now(&b, "other", &mut round), "other sources go");
    }
}
