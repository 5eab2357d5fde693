//! Copies that failed because their source could not answer, retried when
//! it can again (docs/architecture.md §3 "Background": the copy queue retries copies
//! whose source was down once its breaker closes).
//!
//! Bounded: at most [`MAX_PENDING`] images wait, each retried at most
//! [`MAX_ATTEMPTS`] times, with a backoff from `source.breaker.backoff`
//! doubling up to `source.breaker.maxBackoff`. An entry is keyed like the
//! copy queue (target `repository:tag@digest`), so an image waits once
//! however many admissions asked for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

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
    /// Failed attempts so far.
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

    /// Records a copy of `plan` that failed for a source outage.
    pub(super) fn failed(&self, key: &str, plan: &Plan, creds: Option<&Credentials>) {
        let mut pending = self.lock();
        let attempts = pending.get(key).map_or(0, |p| p.attempts) + 1;
        if attempts > MAX_ATTEMPTS {
            pending.remove(key);
            warn!(
                target = key,
                attempts = MAX_ATTEMPTS,
                "giving up retrying a copy whose source cannot answer; the next admission of the image starts it again"
            );
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
            .saturating_mul(1 << (attempts - 1).min(16))
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

    /// Makes every waiting image due now (a breaker closed).
    fn all_due(&self) {
        for p in self.lock().values_mut() {
            if p.due.is_some() {
                p.due = Some(Instant::now());
            }
        }
    }

    /// Takes the due entries whose source may be asked (`ready`), marking
    /// them running.
    fn take_due(&self, ready: impl Fn(&Plan) -> bool) -> Vec<(Plan, Option<Credentials>)> {
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

impl Mirror {
    /// Retries copies that failed because their source could not answer:
    /// each due one whose source's breaker lets a request through (the
    /// retry is then the breaker's probe), and every one as soon as a
    /// breaker closes. Runs until `token` is cancelled (`pinswap serve`).
    pub async fn resume_copies(self: Arc<Self>, token: tokio_util::sync::CancellationToken) {
        let mut closings = self.breakers.closings();
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                r = closings.changed() => {
                    if r.is_err() {
                        return;
                    }
                    self.resumes.all_due();
                }
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let due = self
                .resumes
                .take_due(|p| self.source_retry_in(&p.source).is_zero());
            for (plan, creds) in due {
                drop(self.copy(&plan, creds.as_ref(), false));
            }
        }
    }

    /// How many copies wait for their source to answer again.
    pub fn copies_waiting_for_source(&self) -> usize {
        self.resumes.len()
    }
}
