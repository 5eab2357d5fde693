//! Re-verification (docs/architecture.md §2): every `cache.reverify`, HEAD each cached
//! target manifest, spread over the interval, at most `cache.reverifyRate`
//! a second, with at most [`CONCURRENCY`] requests at once. A missing manifest is evicted (cause
//! `reverification`); when a Pod the watcher knows still uses it, it is
//! mirrored again.
//!
//! Every replica re-verifies its own cache, because each has one and only
//! a HEAD is involved; only the leader, which runs the watcher and so knows
//! the Pods, mirrors anything again.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tracing::{debug, info, warn};

use super::recovery::Recovery;
use crate::cache::{Cause, ExistenceEntry};
use crate::metrics::Metrics;
use crate::mirror::Mirror;

/// Re-verification HEADs in flight at once.
pub const CONCURRENCY: usize = 4;

/// The time after re-verifying an entry that takes `heads` HEADs (its
/// digest and each of its tags) in a round over `entries`: the round spread
/// over `interval`, and no more than `rate` HEADs a second (`0`: no cap).
pub fn gap(interval: Duration, entries: usize, rate: u32, heads: usize) -> Duration {
    let spread = interval / u32::try_from(entries.max(1)).unwrap_or(u32::MAX);
    match rate {
        0 => spread,
        r => spread.max(Duration::from_secs(1) * u32::try_from(heads).unwrap_or(u32::MAX) / r),
    }
}

/// Runs rounds every `interval` until the task is dropped, at most `rate`
/// HEADs a second. `recovery` and `leader` decide whether a missing,
/// in-use image is mirrored again.
pub async fn run(
    mirror: Arc<Mirror>,
    interval: Duration,
    rate: u32,
    recovery: Option<Arc<Recovery>>,
    leader: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        let entries = mirror.caches().existence_entries();
        if entries.is_empty() {
            tokio::time::sleep(interval).await;
            continue;
        }
        // Spread the round over the interval so HEADs trickle rather than
        // burst.
        let n = entries.len();
        debug!(entries = n, "re-verification round");
        let mut tasks = tokio::task::JoinSet::new();
        for e in entries {
            let pause = gap(interval, n, rate, 1 + e.tags.len());
            let permit = slots.clone().acquire_owned().await.expect("never closed");
            let (m, r, l) = (mirror.clone(), recovery.clone(), leader.clone());
            tasks.spawn(async move {
                let leading = *l.borrow();
                check(&m, e, r.as_ref(), leading).await;
                drop(permit);
            });
            tokio::time::sleep(pause).await;
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// Re-verifies one entry by digest (tags that moved on are forgotten, not
/// treated as loss: Pods pin the digest).
async fn check(
    mirror: &Arc<Mirror>,
    e: ExistenceEntry,
    recovery: Option<&Arc<Recovery>>,
    leading: bool,
) {
    let metrics = mirror.metrics().clone();
    let t = &e.target;
    match mirror.reverify(t, &e.tags).await {
        Ok(true) => {
            Metrics::outcome(&metrics.reverifications, "present");
            // Referrers added at the source since the copy follow now: on
            // the leader, or on every replica when there is no election
            // (the merge makes a repeat harmless).
            if leading || recovery.is_none() {
                mirror.refresh_referrers(t).await;
            }
        }
        Ok(false) => {
            Metrics::outcome(&metrics.reverifications, "missing");
            mirror.caches().invalidate(t, Cause::Reverification).await;
            let user = recovery.filter(|_| leading).and_then(|r| r.user_of(t));
            match (user, recovery) {
                (Some((pod, img)), Some(r)) => {
                    info!(image = %t, pod = %pod.key(), "re-verification: missing and in use; mirroring it again");
                    r.trigger(img, Some(pod), Cause::Reverification);
                }
                _ => info!(image = %t, "re-verification: missing; evicted"),
            }
        }
        Err(err) => {
            Metrics::outcome(&metrics.reverifications, "error");
            warn!(image = %t, error = %err, "re-verification HEAD failed; entry kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_spread_over_the_interval_and_capped_by_the_rate() {
        let ten_min = Duration::from_secs(600);
        // 1,000 entries of one tag over 10 minutes: 0.6 s apart, under the
        // cap of 20 HEADs a second (2 an entry: 0.1 s).
        assert_eq!(gap(ten_min, 1000, 20, 2), Duration::from_millis(600));
        // 100,000 would be 6 ms apart; 20 HEADs a second holds an entry of
        // one HEAD to 50 ms, one with a tag to 100 ms.
        assert_eq!(gap(ten_min, 100_000, 20, 1), Duration::from_millis(50));
        assert_eq!(gap(ten_min, 100_000, 20, 2), Duration::from_millis(100));
        assert_eq!(gap(ten_min, 100_000, 0, 2), Duration::from_millis(6));
        assert_eq!(gap(ten_min, 0, 20, 1), ten_min);
    }
}
