//! The backfill: the leader mirrors the images that running Pods and
//! workload templates name, that admission would mirror, and that the
//! target does not hold (Pods created before pinswap, admitted while it
//! failed open, a CronJob's image between runs). Once after the initial
//! lists, then as the watches bring new or changed objects.
//!
//! Per image one state; images nothing names any more are forgotten, so the
//! state is the size of [`Usage`]'s wanted set. At most
//! `backfill.concurrency` copies run, outside admission's copy slots. An
//! image whose source cannot answer (its breaker open) waits until it can;
//! a failed one is retried with backoff (`recovery.retryInitial` doubling
//! up to `recovery.retryMax`); a private image no object proves access to
//! is tried again when an object naming it appears or changes. Running
//! Pods are never touched: their next replacement is rewritten at
//! admission.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;
use tracing::{info, warn};

use super::usage::Usage;
use crate::metrics::{Metrics, StateLabel};
use crate::mirror::{Backfilled, Mirror, MirrorError};
use crate::reference::Reference;
use crate::registry::pullsecrets::PullSecrets;

/// Objects whose pull secrets are read at most to find one that may have a
/// private image.
const MAX_VOUCHING: usize = 8;

/// How long a pass waits for more changes to gather before it starts.
const GATHER: Duration = Duration::from_millis(200);

/// The states of `pinswap_backfill_images`.
pub const STATES: [&str; 5] = ["present", "copied", "pending", "failed", "denied"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Present,
    Copied,
    /// Waiting for its source to answer.
    Pending,
    Failed,
    /// Private, and no object naming it proves access.
    Denied,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        STATES[self as usize]
    }
}

struct State {
    outcome: Outcome,
    failures: u32,
    retry_at: Option<Instant>,
}

/// Settings of [`Backfill`].
pub struct Settings {
    /// Copies at once.
    pub concurrency: usize,
    /// First wait before a retry.
    pub retry_initial: Duration,
    /// Longest wait between retries.
    pub retry_max: Duration,
}

/// The backfill service.
pub struct Backfill {
    mirror: Arc<Mirror>,
    usage: Arc<Usage>,
    pull_secrets: Option<PullSecrets>,
    settings: Settings,
    metrics: Arc<Metrics>,
    states: Mutex<HashMap<Arc<Reference>, State>>,
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Images tried, by outcome (as [`STATES`] names them).
    pub outcomes: HashMap<&'static str, usize>,
}

impl Backfill {
    /// A backfill of what `usage` records; pull secrets are read through
    /// `client` when given (`source.imagePullSecrets`).
    pub fn new(
        mirror: Arc<Mirror>,
        usage: Arc<Usage>,
        client: Option<kube::Client>,
        settings: Settings,
    ) -> Self {
        let metrics = mirror.metrics().clone();
        Self {
            pull_secrets: client.map(|c| PullSecrets::new(c, metrics.clone())),
            mirror,
            usage,
            settings,
            metrics,
            states: Mutex::default(),
        }
    }

    fn states(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<Reference>, State>> {
        self.states.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets every image's state (leadership lost).
    pub fn clear(&self) {
        self.states().clear();
        self.report();
    }

    /// Waits for the initial lists, runs the first pass, then a pass
    /// whenever an object names a wanted image anew or a retry is due.
    /// Runs until dropped.
    pub async fn run(&self) {
        while !self.usage.synced() {
            tokio::time::sleep(GATHER).await;
        }
        let start = Instant::now();
        let pass = self.pass().await;
        info!(
            images = self.usage.wanted().len(),
            seconds = start.elapsed().as_secs_f64(),
            outcomes = ?pass.outcomes,
            "backfill: first pass done"
        );
        loop {
            let due = self.next_due();
            tokio::select! {
                _ = self.usage.changed() => {}
                _ = async {
                    match due {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
            tokio::time::sleep(GATHER).await;
            let start = Instant::now();
            let pass = self.pass().await;
            if !pass.outcomes.is_empty() {
                info!(
                    seconds = start.elapsed().as_secs_f64(),
                    outcomes = ?pass.outcomes,
                    "backfill: pass done"
                );
            }
        }
    }

    /// The soonest retry.
    fn next_due(&self) -> Option<Instant> {
        self.states().values().filter_map(|s| s.retry_at).min()
    }

    /// One pass over the images not handled yet, or due again.
    pub async fn pass(&self) -> Pass {
        let changed = self.usage.take_changed();
        let wanted = self.usage.wanted();
        let now = Instant::now();
        let todo: Vec<Arc<Reference>> = {
            let mut states = self.states();
            let keep: HashSet<&Reference> = wanted.iter().map(|r| &**r).collect();
            states.retain(|r, _| keep.contains(&**r));
            wanted
                .iter()
                .filter(|r| match states.get(*r) {
                    None => true,
                    Some(s) => match s.outcome {
                        Outcome::Present | Outcome::Copied => false,
                        Outcome::Denied => changed.contains(*r),
                        Outcome::Pending | Outcome::Failed => s.retry_at.is_none_or(|t| t <= now),
                    },
                })
                .cloned()
                .collect()
        };
        let mut pass = Pass::default();
        if todo.is_empty() {
            return pass;
        }
        let users = match &self.pull_secrets {
            Some(_) => self
                .usage
                .users(&todo.iter().cloned().collect(), MAX_VOUCHING),
            None => HashMap::new(),
        };
        let users = &users;
        let mut results = futures::stream::iter(todo)
            .map(|image| async move {
                let outcome = self.one(&image, users.get(&image)).await;
                (image, outcome)
            })
            .buffer_unordered(self.settings.concurrency.max(1));
        while let Some((image, outcome)) = results.next().await {
            *pass.outcomes.entry(outcome.as_str()).or_default() += 1;
            if !self.usage.is_wanted(&image) {
                continue;
            }
            let mut states = self.states();
            let failures = states.get(&image).map_or(0, |s| s.failures);
            let (failures, retry_at) = match outcome {
                Outcome::Pending | Outcome::Failed => {
                    let backoff = self
                        .settings
                        .retry_initial
                        .saturating_mul(1 << failures.min(16))
                        .min(self.settings.retry_max);
                    let breaker = self.mirror.source_retry_in(&image);
                    (failures + 1, Some(Instant::now() + backoff.max(breaker)))
                }
                _ => (0, None),
            };
            states.insert(
                image,
                State {
                    outcome,
                    failures,
                    retry_at,
                },
            );
        }
        drop(results);
        self.report();
        pass
    }

    /// Backfills one image, logging the outcome.
    async fn one(
        &self,
        image: &Reference,
        users: Option<&Vec<(String, serde_json::Value)>>,
    ) -> Outcome {
        let mut pods = Vec::new();
        if let Some(ps) = &self.pull_secrets {
            for (ns, pull) in users.into_iter().flatten() {
                pods.push(ps.for_pod(ns, pull).await);
            }
        }
        match self.mirror.backfill(image, &pods).await {
            Ok(Backfilled::Present) => {
                info!(%image, "backfill: present at the target");
                Outcome::Present
            }
            Ok(Backfilled::Copied { target, seconds }) => {
                info!(%image, %target, seconds, "backfill: mirrored");
                Outcome::Copied
            }
            Err(e @ MirrorError::Private { .. }) => {
                info!(%image, reason = %e, "backfill: private image, and no Pod or template naming it proves access; left alone");
                Outcome::Denied
            }
            Err(e)
                if self.mirror.source_retry_in(image) > Duration::ZERO
                    || matches!(e, MirrorError::SourceDown { .. }) =>
            {
                warn!(%image, error = %e, "backfill: source cannot answer; retried once it can");
                Outcome::Pending
            }
            Err(e) => {
                warn!(%image, error = %e, "backfill failed; retried with backoff");
                Outcome::Failed
            }
        }
    }

    /// Sets `pinswap_backfill_images`.
    fn report(&self) {
        let mut counts = [0i64; STATES.len()];
        let states = self.states();
        for s in states.values() {
            counts[s.outcome as usize] += 1;
        }
        // Not tried yet.
        counts[Outcome::Pending as usize] +=
            self.usage.wanted_len().saturating_sub(states.len()) as i64;
        drop(states);
        for (state, n) in STATES.iter().zip(counts) {
            self.metrics
                .backfill_images
                .get_or_create(&StateLabel {
                    state: (*state).to_owned(),
                })
                .set(n);
        }
    }
}
