//! Pull quotas. Docker Hub counts each manifest GET as a pull against a
//! limit per account (or per address, signed in as no one) over a sliding
//! window, and says where a client stands on every manifest GET and HEAD:
//! `ratelimit-limit: 100;w=21600`, `ratelimit-remaining: 20;w=21600`. A
//! HEAD is not counted (docs.docker.com "Docker Hub pull usage and
//! limits"). Past the limit it answers 429, and no `Retry-After`.
//!
//! [`Quotas`] keeps, per source registry and credential, what the registry
//! said and the pulls made in the window, by this process and (with
//! sharing) by the other clusters whose usage records name the same
//! registry and credential. Before a counted GET the client asks
//! [`Quotas::check`]: when the registry said none remain, one uncounted
//! HEAD asks again; when the fleet's pulls fill the limit, nothing is
//! sent. The copy then fails as a source outage of its own kind
//! ([`super::Outage::QuotaExhausted`]), and admission serves what the
//! mirror holds.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// How a quota outage's cause starts, in decisions, logs and Events.
pub const EXHAUSTED: &str = "pull quota exhausted";

/// Source registry and credential pairs tracked at most: both come from
/// Pods (`"*"`, pull secrets), so the map is bounded; the least recently
/// seen goes first.
pub const MAX_KEYS: usize = 1024;

/// Own pulls remembered per key at most: the window's count is exact up
/// to this, and "at least this" above it.
const MAX_PULLS: usize = 10_000;

/// Quotas a usage record carries at most, the most used first: each is
/// about 150 bytes, within the record's reserve.
pub const MAX_RECORDED: usize = 64;

/// How long a "none remain" answer is believed before an uncounted HEAD
/// asks again.
const RECHECK: Duration = Duration::from_secs(10);

/// What the registry said on a manifest request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Pulls allowed per window.
    pub limit: u64,
    /// Pulls left in the window.
    pub remaining: u64,
    /// The window.
    pub window: Duration,
}

/// `N;w=SECONDS` as the header writes it: the number, and the window when
/// given.
fn field(headers: &HeaderMap, name: &str) -> Option<(u64, Option<u64>)> {
    let text = headers.get(name)?.to_str().ok()?;
    let mut parts = text.split(';').map(str::trim);
    let n = parts.next()?.parse().ok()?;
    let w = parts.find_map(|p| p.strip_prefix("w=")?.parse().ok());
    Some((n, w))
}

impl RateLimit {
    /// The quota the headers describe, if both fields are there and sane.
    pub fn from_headers(headers: &HeaderMap) -> Option<RateLimit> {
        let (limit, w1) = field(headers, "ratelimit-limit")?;
        let (remaining, w2) = field(headers, "ratelimit-remaining")?;
        let window = Duration::from_secs(w1.or(w2)?);
        (limit > 0 && !window.is_zero()).then_some(RateLimit {
            limit,
            remaining: remaining.min(limit),
            window,
        })
    }
}

/// A source registry and the credential that pulls from it: its
/// fingerprint (never the secret), or `anonymous`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct QuotaKey {
    /// The registry, normalised.
    pub registry: String,
    /// The credential's fingerprint, or `anonymous`.
    pub credential: String,
}

impl QuotaKey {
    /// Whether clusters share its quota: an account's is the same from
    /// anywhere; signed in as no one, the quota is the address's, which
    /// clusters need not share, and a bearer token's account is not known.
    fn shared(&self) -> bool {
        self.credential.starts_with("user:")
    }
}

/// One cluster's recent pulls under a quota, as its usage record carries
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaUse {
    /// The registry and credential.
    #[serde(flatten)]
    pub key: QuotaKey,
    /// Pulls allowed per window, as the registry last said.
    pub limit: u64,
    /// The window, in seconds.
    pub window_seconds: u64,
    /// Pulls this cluster made in the window before publishing.
    pub pulls: u64,
}

#[derive(Debug)]
struct State {
    limit: u64,
    window: Duration,
    /// What the registry last said remains, and when.
    remaining: Option<(u64, Instant)>,
    /// This process's counted pulls in the window, oldest first.
    own: VecDeque<Instant>,
    /// The other clusters' pulls in their windows, as last read, and when
    /// the read was.
    fleet: (u64, Instant),
    seen: Instant,
}

impl State {
    fn own_in_window(&mut self, now: Instant) -> u64 {
        while self
            .own
            .front()
            .is_some_and(|t| now.duration_since(*t) >= self.window)
        {
            self.own.pop_front();
        }
        self.own.len() as u64
    }

    /// The others' pulls, for as long as a window since they were read.
    fn fleet_in_window(&self, now: Instant) -> u64 {
        match now.duration_since(self.fleet.1) < self.window {
            true => self.fleet.0,
            false => 0,
        }
    }
}

/// What [`Quotas::take`] allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    /// Pull: a pull is taken from the quota when one is known (give it
    /// back with [`Quotas::give_back`] if the GET is not counted).
    Go {
        /// A pull was taken.
        taken: bool,
    },
    /// The registry said none remain a while ago: ask again with an
    /// uncounted HEAD, then check once more.
    Ask,
    /// Do not pull: why, and when to try again.
    Exhausted(String, Duration),
}

/// The quotas of every source registry and credential seen.
#[derive(Debug, Default)]
pub struct Quotas {
    states: Mutex<HashMap<QuotaKey, State>>,
}

impl Quotas {
    /// Records what the registry said on a manifest request; `pulled`: the
    /// request was a GET it counted that no [`Gate::Go`] took.
    pub fn observe(&self, key: &QuotaKey, said: RateLimit, pulled: bool) {
        let now = Instant::now();
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        if !states.contains_key(key) && states.len() >= MAX_KEYS {
            let oldest = states
                .iter()
                .min_by_key(|(_, s)| s.seen)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                states.remove(&k);
            }
        }
        let state = states.entry(key.clone()).or_insert_with(|| State {
            limit: said.limit,
            window: said.window,
            remaining: None,
            own: VecDeque::new(),
            fleet: (0, now),
            seen: now,
        });
        state.limit = said.limit;
        state.window = said.window;
        state.remaining = Some((said.remaining, now));
        state.seen = now;
        if pulled {
            if state.own.len() == MAX_PULLS {
                state.own.pop_front();
            }
            state.own.push_back(now);
        }
    }

    /// Whether a counted pull under `key` may go now; when it may and the
    /// quota is known, the pull is taken at once, so that pulls made at
    /// the same moment do not all pass on the same count.
    pub fn take(&self, key: &QuotaKey) -> Gate {
        let now = Instant::now();
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = states.get_mut(key) else {
            return Gate::Go { taken: false };
        };
        let own = state.own_in_window(now);
        let fleet = state.fleet_in_window(now);
        let window = humantime::format_duration(state.window);
        // When this process's oldest pull leaves the window, or in a minute.
        let later = state
            .own
            .front()
            .map(|t| state.window.saturating_sub(now.duration_since(*t)))
            .unwrap_or(Duration::from_secs(60))
            .clamp(Duration::from_secs(1), Duration::from_secs(3600));
        if own.saturating_add(fleet) >= state.limit {
            return Gate::Exhausted(
                format!(
                    "{EXHAUSTED} at {} ({}): {} of {} pulls per {window} made, {own} here and {fleet} by the other clusters",
                    key.registry,
                    key.credential,
                    own.saturating_add(fleet),
                    state.limit
                ),
                later,
            );
        }
        match state.remaining {
            Some((0, at)) if now.duration_since(at) >= RECHECK => Gate::Ask,
            Some((0, _)) => Gate::Exhausted(
                format!(
                    "{EXHAUSTED} at {} ({}): it says 0 of {} pulls per {window} remain",
                    key.registry, key.credential, state.limit
                ),
                RECHECK,
            ),
            _ => {
                if state.own.len() == MAX_PULLS {
                    state.own.pop_front();
                }
                state.own.push_back(now);
                // Counted down here too: the registry's next answer says
                // what is left, whoever else pulled meanwhile.
                if let Some((remaining, _)) = &mut state.remaining {
                    *remaining = remaining.saturating_sub(1);
                }
                Gate::Go { taken: true }
            }
        }
    }

    /// Gives back a pull [`Quotas::take`] took for a GET that was not
    /// counted (it failed, found nothing, or was dropped): the newest taken,
    /// and the one counted down from what the registry said, unless the
    /// registry has said more since.
    pub fn give_back(&self, key: &QuotaKey) {
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = states.get_mut(key)
            && let Some(taken) = state.own.pop_back()
            && let Some((remaining, at)) = &mut state.remaining
            && *at <= taken
        {
            *remaining = (*remaining + 1).min(state.limit);
        }
    }

    /// This process's pulls in the window under each shared quota, for its
    /// usage record, in key order.
    pub fn uses(&self) -> Vec<QuotaUse> {
        let now = Instant::now();
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<QuotaUse> = states
            .iter_mut()
            .filter(|(k, _)| k.shared())
            .map(|(k, s)| QuotaUse {
                key: k.clone(),
                limit: s.limit,
                window_seconds: s.window.as_secs(),
                pulls: s.own_in_window(now),
            })
            .filter(|u| u.pulls > 0)
            .collect();
        out.sort_by(|a, b| b.pulls.cmp(&a.pulls).then_with(|| a.key.cmp(&b.key)));
        out.truncate(MAX_RECORDED);
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Takes the other clusters' pulls from their usage records: each
    /// shared quota's total replaces the last one read, and a quota seen
    /// only there is learnt from them.
    pub fn set_fleet<'a>(&self, others: impl IntoIterator<Item = &'a QuotaUse>) {
        let now = Instant::now();
        let mut totals: HashMap<&QuotaKey, (u64, &QuotaUse)> = HashMap::new();
        for u in others {
            if u.key.shared() && u.limit > 0 && u.window_seconds > 0 {
                let total = &mut totals.entry(&u.key).or_insert((0, u)).0;
                *total = total.saturating_add(u.pulls);
            }
        }
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        for state in states.values_mut() {
            state.fleet = (0, now);
        }
        for (key, (pulls, u)) in totals {
            if !states.contains_key(key) && states.len() >= MAX_KEYS {
                continue;
            }
            let state = states.entry(key.clone()).or_insert_with(|| State {
                limit: u.limit,
                window: Duration::from_secs(u.window_seconds),
                remaining: None,
                own: VecDeque::new(),
                fleet: (0, now),
                seen: now,
            });
            state.fleet = (pulls, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn key(credential: &str) -> QuotaKey {
        QuotaKey {
            registry: "docker.io".into(),
            credential: credential.into(),
        }
    }

    fn said(limit: u64, remaining: u64) -> RateLimit {
        RateLimit {
            limit,
            remaining,
            window: Duration::from_secs(21600),
        }
    }

    #[test]
    fn headers_are_read_as_docker_hub_writes_them() {
        let mut h = HeaderMap::new();
        h.insert("ratelimit-limit", HeaderValue::from_static("100;w=21600"));
        h.insert(
            "ratelimit-remaining",
            HeaderValue::from_static("20;w=21600"),
        );
        assert_eq!(RateLimit::from_headers(&h), Some(said(100, 20)));
        h.insert("ratelimit-remaining", HeaderValue::from_static("lots"));
        assert_eq!(RateLimit::from_headers(&h), None);
        h.insert("ratelimit-remaining", HeaderValue::from_static("0"));
        h.insert("ratelimit-limit", HeaderValue::from_static("100"));
        assert_eq!(RateLimit::from_headers(&h), None, "no window anywhere");
    }

    #[tokio::test(start_paused = true)]
    async fn none_remaining_is_asked_again_after_a_while() {
        let q = Quotas::default();
        let k = key("anonymous");
        assert_eq!(q.take(&k), Gate::Go { taken: false }, "nothing known");
        q.observe(&k, said(3, 0), true);
        assert!(matches!(q.take(&k), Gate::Exhausted(why, _) if why.contains("0 of 3")));
        tokio::time::advance(RECHECK).await;
        assert_eq!(q.take(&k), Gate::Ask);
        q.observe(&k, said(3, 1), false);
        assert_eq!(q.take(&k), Gate::Go { taken: true });
        assert!(
            matches!(q.take(&k), Gate::Exhausted(..)),
            "the one left was taken"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_fleets_pulls_fill_the_limit_and_leave_with_the_window() {
        let (a, b) = (Quotas::default(), Quotas::default());
        let k = key("user:abc");
        for _ in 0..4 {
            a.observe(&k, said(6, 6), true);
        }
        let uses = a.uses();
        assert_eq!(uses.len(), 1);
        assert_eq!(uses[0].pulls, 4);
        b.set_fleet(&uses);
        assert_eq!(b.take(&k), Gate::Go { taken: true });
        b.observe(&k, said(6, 1), false);
        assert_eq!(b.take(&k), Gate::Go { taken: true });
        let third = b.take(&k);
        assert!(
            matches!(&third, Gate::Exhausted(why, _) if why.contains("6 of 6")),
            "{third:?}"
        );
        b.give_back(&k);
        assert_eq!(b.take(&k), Gate::Go { taken: true }, "one given back");
        tokio::time::advance(Duration::from_secs(21600)).await;
        // The window passed: the fleet's count is gone, and the registry's
        // "none remain" is asked again.
        assert_eq!(b.take(&k), Gate::Ask);
        // Signed in as no one: the address's quota, not shared.
        let anon = key("anonymous");
        a.observe(&anon, said(6, 6), true);
        assert!(a.uses().iter().all(|u| u.key != anon));
    }
}
