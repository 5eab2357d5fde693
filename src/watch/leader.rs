//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's
//! algorithm (`k8s.io/client-go/tools/leaderelection`), through kube's
//! `Api<Lease>`.
//!
//! Why not a crate: kube-rs 5 ships no leader election. kube-lease-manager,
//! the maintained crate for kube 5, takes the Lease with server-side apply
//! (so it needs `patch` and relies on field-manager conflicts), and its
//! `watch()` reports a change only after a successful read, so a leader
//! that can no longer reach the API server keeps acting after its Lease has
//! expired and another replica has taken over. Here mutual exclusion is the
//! API server's own: an `update` carries the `resourceVersion` that was read
//! and fails with 409 if anyone wrote in between. RBAC: leases get, create,
//! update.
//!
//! Timing (client-go's defaults, configurable): a candidate tries every
//! `retryPeriod` (2 s); a Lease not renewed for `duration` (15 s), measured
//! on the candidate's own clock from when it last saw the Lease change, may
//! be taken; the leader steps down when it has not renewed for
//! `renewDeadline` (10 s), before anyone may take over. A leader that sees
//! another holder steps down at once, so losing the Lease stops the
//! background work within one `retryPeriod`.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tracing::{info, warn};

/// Errors talking to the API server about the Lease.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The API server refused or failed a request.
    #[error("lease {namespace}/{name}: {source}")]
    Api {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// kube's error.
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// The Lease to hold and the timings (see the module docs).
#[derive(Debug, Clone)]
pub struct LeaseOptions {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This replica's `holderIdentity`; unique per process.
    pub identity: String,
    /// `leaseDurationSeconds` (whole seconds).
    pub duration: Duration,
    /// Step down after this long without a renewal.
    pub renew_deadline: Duration,
    /// Time between tries.
    pub retry_period: Duration,
}

/// A unique holder identity: `POD_NAME` or the host name, plus a random
/// suffix so two processes on one host never share it (client-go uses
/// `hostname_uuid`).
pub fn identity() -> String {
    let host = std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "pinswap".into());
    let h = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        (std::process::id(), Instant::now()),
    );
    format!("{host}_{h:016x}")
}

/// The Lease record as last seen, and when (on our clock).
struct Observed {
    record: (Option<String>, Option<Timestamp>, Option<i32>),
    at: Instant,
}

/// Runs the election until `shutdown` resolves, publishing `true` on the
/// returned channel while this replica leads. On shutdown a leader releases
/// the Lease (empty holder, 1 s duration, as client-go's
/// `ReleaseOnCancel`), so a successor takes over at its next try.
pub fn run(
    client: kube::Client,
    opts: LeaseOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let api: Api<Lease> = Api::namespaced(client, &opts.namespace);
        let mut elector = Elector {
            api,
            opts,
            observed: None,
            last_renew: None,
        };
        tokio::pin!(shutdown);
        loop {
            let leading = elector.step().await;
            tx.send_if_modified(|v| std::mem::replace(v, leading) != leading);
            // A leader wakes by its renew deadline at the latest, so it stops
            // then even when retryPeriod is long.
            let wait = match (leading, elector.last_renew) {
                (true, Some(t)) => elector.opts.retry_period.min(
                    (t + elector.opts.renew_deadline).saturating_duration_since(Instant::now()),
                ),
                _ => elector.opts.retry_period,
            };
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep(wait) => {}
            }
            if elector
                .last_renew
                .is_some_and(|t| t.elapsed() >= elector.opts.renew_deadline)
            {
                tx.send_if_modified(|v| std::mem::replace(v, false));
            }
        }
        if *tx.borrow() {
            tx.send_replace(false);
            // Bounded: a partitioned API server must not stall shutdown.
            let _ = tokio::time::timeout(elector.opts.renew_deadline, elector.release()).await;
        }
    });
    (rx, task)
}

struct Elector {
    api: Api<Lease>,
    opts: LeaseOptions,
    observed: Option<Observed>,
    last_renew: Option<Instant>,
}

impl Elector {
    /// One try; returns whether this replica leads now.
    async fn step(&mut self) -> bool {
        // Bound each try: kube retries 429/503/504 with backoff, and a
        // partitioned API server may not answer at all. A leader's try ends
        // by its renew deadline, so it steps down on time.
        let budget = match self.last_renew {
            Some(t) => self.opts.renew_deadline.saturating_sub(t.elapsed()),
            None => self.opts.renew_deadline,
        };
        // The renewal counts from when it was sent: other replicas time the
        // Lease from when they see it change, which is no earlier.
        let sent = Instant::now();
        let tried = tokio::time::timeout(budget, self.try_acquire_or_renew()).await;
        let result = tried.unwrap_or(Err(LeaderError::Timeout(budget)));
        match result {
            Ok(true) => {
                if self.last_renew.is_none() {
                    info!(lease = %self.opts.name, identity = %self.opts.identity, "became leader");
                }
                self.last_renew = Some(sent);
                true
            }
            Ok(false) => {
                if self.last_renew.take().is_some() {
                    warn!(lease = %self.opts.name, "lost the lease to another replica; background work stops");
                }
                false
            }
            Err(e) => {
                let within = self
                    .last_renew
                    .is_some_and(|t| t.elapsed() < self.opts.renew_deadline);
                if within {
                    warn!(error = %e, "lease renewal failed; retrying");
                } else if self.last_renew.take().is_some() {
                    warn!(error = %e, "could not renew the lease within renewDeadline; background work stops");
                } else {
                    warn!(error = %e, "lease unavailable");
                }
                within
            }
        }
    }

    fn error(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            namespace: self.opts.namespace.clone(),
            name: self.opts.name.clone(),
            source,
        }
    }

    fn duration_seconds(&self) -> i32 {
        self.opts.duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }

    async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaderError> {
        let now = Timestamp::now();
        let me = &self.opts.identity;
        let Some(mut lease) = self
            .api
            .get_opt(&self.opts.name)
            .await
            .map_err(|e| self.error(e))?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.opts.name.clone()),
                    namespace: Some(self.opts.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(me.clone()),
                    lease_duration_seconds: Some(self.duration_seconds()),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                // Another candidate created it first.
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(self.error(e)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (
            holder.clone(),
            spec.renew_time.as_ref().map(|t| t.0),
            spec.lease_duration_seconds,
        );
        if self.observed.as_ref().is_none_or(|o| o.record != record) {
            self.observed = Some(Observed {
                record,
                at: Instant::now(),
            });
        }
        let held_by_other = holder.as_ref().is_some_and(|h| h != me);
        if held_by_other {
            let duration =
                Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
            let seen = self
                .observed
                .as_ref()
                .map(|o| o.at)
                .unwrap_or_else(Instant::now);
            if seen.elapsed() < duration {
                return Ok(false);
            }
        }
        let ours = holder.as_ref() == Some(me);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(me.clone()),
            lease_duration_seconds: Some(self.duration_seconds()),
            acquire_time: if ours {
                spec.acquire_time.clone()
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + if ours { 0 } else { 1 }),
            ..spec
        });
        // `replace` sends the resourceVersion we read: a concurrent writer
        // makes this fail with 409, and the other one wins.
        match self
            .api
            .replace(&self.opts.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(self.error(e)),
        }
    }

    async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.opts.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.opts.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        match self
            .api
            .replace(&self.opts.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!(lease = %self.opts.name, "released the lease"),
            Err(e) => warn!(error = %e, "could not release the lease; it expires on its own"),
        }
    }
}
