//! Source health (docs/architecture.md §3): a circuit breaker per source registry, so
//! a source that is down, rate-limiting or stalled costs one bounded attempt
//! per window instead of every admission's budget.
//!
//! - **Closed**: requests go to the source. `failures` consecutive outages
//!   (connect errors, timeouts, 5xx, 429) open it; a 429 opens it at once,
//!   since the registry said so itself.
//! - **Open** for a window: the first `backoff`, doubled after each failed
//!   probe up to `maxBackoff`, and never shorter than a `Retry-After` (capped
//!   at `maxBackoff`). Nothing is sent; callers use the target's copies.
//! - **Half-open** when the window ends: one caller at a time probes. Any
//!   answer from the registry (even a 404) closes the breaker, an outage
//!   opens it again.
//!
//! Each transition is logged once at warn (opened) or info (closed), never
//! per request, and `pinswap_source_breaker_open{registry}` follows it.
//!
//! The registries the config names keep their breakers for the life of the
//! process. Any other (under `"*"`, named by Pods) is in a bounded LRU of
//! [`MAX_UNNAMED`]: evicting one forgets its outage, so it is asked again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::watch;
use tracing::{info, warn};

use crate::config::Breaker as Settings;
use crate::metrics::Metrics;
use crate::registry::Outage;

/// Why a source is not asked now: the outage that opened its breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// The last failure, in words (`HTTP 429 TOOMANYREQUESTS`, `timed out
    /// after 1s`, ...).
    pub cause: String,
    /// How long until the next probe may go.
    pub retry_in: Duration,
}

impl std::fmt::Display for Open {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; not asked again for {}",
            self.cause,
            humantime::format_duration(Duration::from_secs(self.retry_in.as_secs().max(1)))
        )
    }
}

#[derive(Debug, Default)]
struct State {
    /// Consecutive outages while closed.
    failures: u32,
    /// Open until this instant (`None`: closed).
    open_until: Option<Instant>,
    /// The current open window (doubles on each failed probe).
    window: Duration,
    /// A half-open probe is in flight.
    probing: bool,
    cause: String,
    /// Dropped from the LRU: its transitions no longer move the gauge.
    evicted: bool,
}

/// One registry's breaker.
type Shared = Arc<Mutex<State>>;

/// Breakers kept at most for registries the config does not name.
pub const MAX_UNNAMED: u64 = 1024;

/// The breakers of every source registry. Cheap to share (`Arc`).
pub struct Breakers {
    settings: Settings,
    metrics: Arc<Metrics>,
    /// The registries the config names (normalised), never evicted.
    named: HashMap<String, Shared>,
    /// Any other, least recently used evicted.
    others: moka::sync::Cache<String, Shared>,
    /// Bumped each time a breaker closes (a source answers again), so
    /// copies waiting on a source can resume.
    closed: watch::Sender<u64>,
}

/// Permission to send one request to a source. Report its outcome with
/// [`Attempt::answered`] or [`Attempt::failed`]; dropped unreported, it
/// counts as a timeout (its caller stopped waiting).
#[must_use]
pub struct Attempt {
    breakers: Arc<Breakers>,
    registry: String,
    probe: bool,
    done: bool,
}

impl Breakers {
    /// Breakers with these settings (`source.breaker`), all closed; those
    /// of `named` registries (normalised) are never evicted.
    pub fn new(
        settings: Settings,
        metrics: Arc<Metrics>,
        named: impl IntoIterator<Item = String>,
    ) -> Self {
        let gauge = metrics.clone();
        let others = moka::sync::Cache::builder()
            .max_capacity(MAX_UNNAMED)
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            .eviction_listener(move |registry: Arc<String>, state: Shared, _| {
                let mut st = lock(&state);
                st.evicted = true;
                if st.open_until.is_some() {
                    gauge.breaker_open(&registry, false);
                }
            })
            .build();
        Self {
            settings,
            metrics,
            named: named.into_iter().map(|r| (r, Shared::default())).collect(),
            others,
            closed: watch::channel(0).0,
        }
    }

    /// How many breakers are kept (for tests of the bound).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.others.run_pending_tasks();
        self.named.len() + self.others.entry_count() as usize
    }

    /// `registry`'s breaker, if it has one (a closed breaker needs none).
    fn get(&self, registry: &str) -> Option<Shared> {
        self.named
            .get(registry)
            .cloned()
            .or_else(|| self.others.get(registry))
    }

    /// `registry`'s breaker, made closed when it has none.
    fn get_or_insert(&self, registry: &str) -> Shared {
        match self.named.get(registry) {
            Some(s) => s.clone(),
            None => self.others.get_with(registry.to_owned(), Shared::default),
        }
    }

    /// A receiver that changes each time some breaker closes.
    pub fn closings(&self) -> watch::Receiver<u64> {
        self.closed.subscribe()
    }

    /// Whether `registry` may be asked now.
    ///
    /// # Errors
    /// [`Open`] while its breaker is open, or half-open with a probe
    /// already in flight.
    pub fn attempt(self: &Arc<Self>, registry: &str) -> Result<Attempt, Open> {
        let state = self.get(registry);
        let mut guard = state.as_ref().map(|s| lock(s));
        let probe = match guard.as_deref_mut() {
            Some(st) => match st.open_until {
                Some(until) => {
                    let now = Instant::now();
                    if now < until || st.probing {
                        return Err(Open {
                            cause: st.cause.clone(),
                            retry_in: until.saturating_duration_since(now),
                        });
                    }
                    st.probing = true;
                    true
                }
                None => false,
            },
            None => false,
        };
        Ok(Attempt {
            breakers: self.clone(),
            registry: registry.to_owned(),
            probe,
            done: false,
        })
    }

    /// Whether [`Breakers::attempt`] would let a request to `registry` go
    /// now: closed, or half-open with no probe in flight.
    pub fn admits(&self, registry: &str) -> bool {
        self.get(registry).is_none_or(|s| {
            let s = lock(&s);
            match s.open_until {
                None => true,
                Some(until) => Instant::now() >= until && !s.probing,
            }
        })
    }

    /// Whether `registry`'s breaker is closed: not open, and no half-open
    /// probe in flight.
    pub fn is_closed(&self, registry: &str) -> bool {
        self.get(registry)
            .is_none_or(|s| lock(&s).open_until.is_none())
    }

    /// How long until `registry` may be asked again (zero when closed).
    pub fn retry_in(&self, registry: &str) -> Duration {
        self.get(registry)
            .and_then(|s| lock(&s).open_until)
            .map(|u| u.saturating_duration_since(Instant::now()))
            .unwrap_or_default()
    }

    fn answered(&self, registry: &str, probe: bool) {
        let Some(state) = self.get(registry) else {
            return;
        };
        let mut st = lock(&state);
        // A request sent before the breaker opened may answer while it is
        // open: only a probe's answer closes it.
        if st.open_until.is_some() && !probe {
            return;
        }
        let was_open = st.open_until.is_some();
        let evicted = st.evicted;
        *st = State {
            evicted,
            ..State::default()
        };
        drop(st);
        if was_open {
            if !evicted {
                self.metrics.breaker_open(registry, false);
            }
            info!(
                registry,
                "source registry answers again; circuit breaker closed"
            );
            self.closed.send_modify(|n| *n += 1);
        }
    }

    fn failed(
        &self,
        registry: &str,
        probe: bool,
        outage: Outage,
        cause: String,
        retry_after: Option<Duration>,
    ) {
        self.metrics.source_failure(registry, outage.as_str());
        if !outage.trips() {
            // Refused credentials, or one account's used-up quota, say
            // nothing about the registry's health; a probe that got them
            // still leaves the window as it was.
            if probe {
                self.release(registry);
            }
            return;
        }
        let max = self.settings.max_backoff;
        let hint = retry_after.map(|r| r.min(max)).unwrap_or_default();
        let state = self.get_or_insert(registry);
        let mut st = lock(&state);
        st.cause = cause;
        let now = Instant::now();
        let window = if st.open_until.is_some() {
            if !probe {
                return;
            }
            st.probing = false;
            st.window.saturating_mul(2).min(max)
        } else {
            st.failures += 1;
            if st.failures < self.settings.failures && outage != Outage::RateLimited {
                return;
            }
            self.settings.backoff
        };
        st.window = window;
        let open_for = window.max(hint);
        let was_open = st.open_until.is_some();
        st.open_until = Some(now + open_for);
        let cause = st.cause.clone();
        let evicted = st.evicted;
        drop(st);
        if !was_open {
            if !evicted {
                self.metrics.breaker_open(registry, true);
            }
            warn!(registry, %cause, open_for = %humantime::format_duration(open_for), "source registry failing; circuit breaker open, admissions use the target's copies");
        }
    }

    /// Ends a probe that neither closed nor reopened the breaker.
    fn release(&self, registry: &str) {
        if let Some(state) = self.get(registry) {
            lock(&state).probing = false;
        }
    }
}

/// A breaker's state, whoever panicked holding it.
fn lock(state: &Shared) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Attempt {
    /// Whether this is the half-open breaker's one probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// The source answered (any status that is not an outage).
    pub fn answered(mut self) {
        self.done = true;
        self.breakers.answered(&self.registry, self.probe);
    }

    /// No verdict: the request was cut short by pinswap's own budget before
    /// `source.timeout`, which says nothing about the source.
    pub fn abandoned(self) {
        // Drop releases a probe slot.
    }

    /// The source had an outage; `cause` says which, in words.
    pub fn failed(mut self, outage: Outage, cause: String, retry_after: Option<Duration>) {
        self.done = true;
        self.breakers
            .failed(&self.registry, self.probe, outage, cause, retry_after);
    }
}

impl Drop for Attempt {
    /// Dropped without a verdict (the admission was cancelled, or ran out
    /// of its own budget first): it says nothing about the source, so it
    /// only frees a probe slot for the next request.
    fn drop(&mut self) {
        if !self.done && self.probe {
            self.breakers.release(&self.registry);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Breakers where the config names `r`.
    fn breakers(failures: u32) -> Arc<Breakers> {
        let metrics = Arc::new(Metrics::new());
        metrics.label_registries(["r".to_owned()]);
        Arc::new(Breakers::new(
            Settings {
                failures,
                backoff: Duration::from_secs(5),
                max_backoff: Duration::from_secs(60),
            },
            metrics,
            ["r".to_owned()],
        ))
    }

    fn fail(b: &Arc<Breakers>, outage: Outage, retry_after: Option<u64>) {
        b.attempt("r").unwrap().failed(
            outage,
            "HTTP 503".into(),
            retry_after.map(Duration::from_secs),
        );
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_probes_one_at_a_time() {
        let b = breakers(3);
        fail(&b, Outage::ServerError, None);
        fail(&b, Outage::Unreachable, None);
        b.attempt("r").unwrap().answered();
        fail(&b, Outage::ServerError, None);
        fail(&b, Outage::Timeout, None);
        assert_eq!(b.retry_in("r"), Duration::ZERO, "two in a row: closed");
        fail(&b, Outage::ServerError, None);
        let open = b.attempt("r").err().expect("open after three in a row");
        assert_eq!(open.cause, "HTTP 503");
        assert_eq!(open.retry_in, Duration::from_secs(5));
        b.attempt("other").unwrap().answered();
        tokio::time::advance(Duration::from_secs(5)).await;
        let probe = b.attempt("r").expect("half-open: one probe");
        assert!(b.attempt("r").is_err(), "a second caller waits");
        probe.failed(Outage::ServerError, "HTTP 503".into(), None);
        assert_eq!(b.retry_in("r"), Duration::from_secs(10), "doubled");
        tokio::time::advance(Duration::from_secs(10)).await;
        let closings = b.closings();
        b.attempt("r").unwrap().answered();
        assert!(closings.has_changed().unwrap(), "closing is announced");
        assert_eq!(b.retry_in("r"), Duration::ZERO);
        b.attempt("r").unwrap().answered();
        let text = b.metrics.encode();
        assert!(text.contains("pinswap_source_breaker_open{registry=\"r\"} 0"));
        assert!(
            text.contains("pinswap_source_failures_total{registry=\"r\",cause=\"server_error\"} 4"),
            "{text}"
        );
    }

    /// Thousands of registries the config does not name: their breakers
    /// stay within the bound and share one label, while the named one's
    /// open breaker and its label survive.
    #[tokio::test(start_paused = true)]
    async fn unnamed_registries_are_bounded_and_labelled_other() {
        let b = breakers(1);
        fail(&b, Outage::ServerError, None);
        let n = 3 * MAX_UNNAMED as usize;
        for i in 0..n {
            let registry = format!("r{i}.example:5000");
            b.attempt(&registry)
                .unwrap()
                .failed(Outage::Unreachable, "refused".into(), None);
            assert!(b.attempt(&registry).is_err(), "open");
        }
        assert!(b.held() <= 1 + MAX_UNNAMED as usize, "{}", b.held());
        assert!(b.held() > MAX_UNNAMED as usize / 2, "{}", b.held());
        assert!(b.attempt("r").is_err(), "the named breaker is still open");
        let text = b.metrics.encode();
        let mut got: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("pinswap_source_"))
            .collect();
        got.sort_unstable();
        let open_others = b.held() - 1;
        let want = [
            "pinswap_source_breaker_open{registry=\"other\"} ".to_owned()
                + &open_others.to_string(),
            "pinswap_source_breaker_open{registry=\"r\"} 1".to_owned(),
            format!(
                "pinswap_source_failures_total{{registry=\"other\",cause=\"unreachable\"}} {n}"
            ),
            "pinswap_source_failures_total{registry=\"r\",cause=\"server_error\"} 1".to_owned(),
        ];
        assert_eq!(got, want, "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limits_open_at_once_for_their_retry_after_capped() {
        let b = breakers(3);
        fail(&b, Outage::RateLimited, Some(30));
        assert_eq!(b.retry_in("r"), Duration::from_secs(30));
        tokio::time::advance(Duration::from_secs(30)).await;
        b.attempt("r").unwrap().failed(
            Outage::RateLimited,
            "429".into(),
            Some(Duration::from_secs(3600)),
        );
        assert_eq!(b.retry_in("r"), Duration::from_secs(60), "capped");
    }

    #[tokio::test(start_paused = true)]
    async fn refused_credentials_and_abandoned_attempts() {
        let b = breakers(1);
        fail(&b, Outage::Unauthorized, None);
        assert_eq!(b.retry_in("r"), Duration::ZERO, "401 does not trip");
        drop(b.attempt("r").unwrap());
        b.attempt("r").unwrap().abandoned();
        assert_eq!(b.retry_in("r"), Duration::ZERO, "no verdict, no trip");
        fail(&b, Outage::Timeout, None);
        tokio::time::advance(Duration::from_secs(5)).await;
        let probe = b.attempt("r").unwrap();
        probe.failed(Outage::Unauthorized, "401".into(), None);
        let probe = b.attempt("r").expect("the probe slot is released");
        drop(probe);
        let probe = b.attempt("r").expect("a dropped probe releases it too");
        probe.abandoned();
        assert!(b.attempt("r").is_ok(), "and an abandoned one");
    }
}
