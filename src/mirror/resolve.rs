//! Source resolution: tags to digests, through the resolution cache and
//! the source's breaker. [`Resolver`] holds what it needs and knows nothing
//! of the mirror, which asks it for digests and for the breakers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{MirrorError, outage_kind, source_outage};
use super::health;
use crate::cache::{self, Caches};
use crate::metrics::{ErrorCause, Metrics};
use crate::reference::{Digest, Reference, normalize_registry};
use crate::registry::auth::Credentials;
use crate::registry::{ClientPool, Role};

/// The breaker key and metric label of `src`'s registry.
pub(super) fn source_key(src: &Reference) -> String {
    normalize_registry(src.registry())
}

/// Asks source registries for digests, each through its circuit breaker.
pub(super) struct Resolver {
    pool: Arc<ClientPool>,
    breakers: Arc<health::Breakers>,
    caches: Arc<Caches>,
    metrics: Arc<Metrics>,
    /// How long an admission waits for a source (`source.timeout`).
    timeout: Duration,
    /// The target registry, normalised, as errors name it.
    target_key: String,
}

impl Resolver {
    pub(super) fn new(
        pool: Arc<ClientPool>,
        breakers: Arc<health::Breakers>,
        caches: Arc<Caches>,
        metrics: Arc<Metrics>,
        timeout: Duration,
        target_key: String,
    ) -> Self {
        Self {
            pool,
            breakers,
            caches,
            metrics,
            timeout,
            target_key,
        }
    }

    /// The source registries' circuit breakers.
    pub(super) fn breakers(&self) -> &Arc<health::Breakers> {
        &self.breakers
    }

    /// How long until `src`'s registry may be asked again (zero while its
    /// breaker is closed).
    pub(super) fn retry_in(&self, src: &Reference) -> Duration {
        self.breakers.retry_in(&source_key(src))
    }

    /// Runs `work`, a request to `src`'s registry, through its circuit
    /// breaker: refused at once while the breaker is open, bounded by
    /// `source.timeout` and half the time left before `deadline`, and
    /// counted as an answer or an outage. An outage becomes
    /// [`MirrorError::SourceDown`], of kind [`ErrorCause::Budget`] when the
    /// wait was cut short by `deadline`; other errors pass through.
    pub(super) async fn ask<T>(
        &self,
        src: &Reference,
        deadline: Option<Instant>,
        work: impl Future<Output = Result<T, MirrorError>>,
    ) -> Result<T, MirrorError> {
        let registry = source_key(src);
        let down = |cause: String, kind: ErrorCause| MirrorError::SourceDown {
            image: src.to_string(),
            registry: registry.clone(),
            cause,
            consequence: "not read from it".into(),
            kind,
        };
        let attempt = self.breakers.attempt(&registry).map_err(|open| {
            down(
                format!("circuit breaker open after {open}"),
                ErrorCause::Source,
            )
        })?;
        let limit = match deadline {
            Some(d) => {
                let now = Instant::now();
                self.timeout.min(d.saturating_duration_since(now) / 2)
            }
            None => self.timeout.max(Duration::from_secs(30)),
        };
        match tokio::time::timeout(limit, work).await {
            Err(_) => {
                let ms = Duration::from_millis(limit.as_millis() as u64);
                let cause = format!("no answer within {}", humantime::format_duration(ms));
                // A wait cut to less than half of `source.timeout` by the
                // admission's budget says little: a busy machine can miss
                // a 20 ms window with a healthy source. Only longer waits
                // count against it (docs/architecture.md §3).
                if limit < self.timeout / 2 {
                    attempt.abandoned();
                } else {
                    attempt.failed(crate::registry::Outage::Timeout, cause.clone(), None);
                }
                // Any wait the budget made shorter than `source.timeout` is
                // the budget's, not evidence of an outage: the access check
                // gives no grace for it (`access.rs`).
                let kind = match limit < self.timeout {
                    true => ErrorCause::Budget,
                    false => ErrorCause::Source,
                };
                Err(down(cause, kind))
            }
            Ok(Ok(v)) => {
                attempt.answered();
                Ok(v)
            }
            Ok(Err(e)) => match source_outage(&e, &registry) {
                Some((outage, retry_after, cause)) => {
                    attempt.failed(outage, cause.clone(), retry_after);
                    Err(down(cause, outage_kind(outage)))
                }
                None => {
                    attempt.answered();
                    Err(e)
                }
            },
        }
    }

    /// Tag → manifest digest on the source, cached for `cache.resolutionTtl`,
    /// through the source's circuit breaker.
    pub(super) async fn resolve(
        &self,
        src: &Reference,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Digest, MirrorError> {
        if let Some(d) = src.digest() {
            return Ok(d.clone());
        }
        if let Some(d) = self.cached(src).await {
            return Ok(d);
        }
        let key = src.to_string();
        // Boxed: the request's future is about ten times the size of the
        // rest of an admission's, and every cached admission moved it
        // around (memmove was the largest cost in the profile).
        Box::pin(self.at_source(src, key, creds, deadline)).await
    }

    /// `src`'s digest from the resolution cache, counted as a hit; `None`
    /// (not counted: the lookup that follows counts) on a miss.
    pub(super) async fn cached(&self, src: &Reference) -> Option<Digest> {
        let d = self.caches.resolution()?.get(&src.to_string()).await?;
        self.metrics.cache(cache::RESOLUTION, true);
        Some(d)
    }

    /// [`Resolver::resolve`] past the cache: one request per key at a time.
    async fn at_source(
        &self,
        src: &Reference,
        key: String,
        creds: Option<&Credentials>,
        deadline: Option<Instant>,
    ) -> Result<Digest, MirrorError> {
        let fetch = || {
            self.ask(src, deadline, async {
                self.metrics.cache(cache::RESOLUTION, false);
                let client = self
                    .pool
                    .get_with(src.registry(), Role::Source, creds)
                    .await?;
                Ok::<_, MirrorError>(match client.head_manifest(src).await? {
                    Some(d) => d,
                    // HEAD has no body; GET brings the registry's own error code.
                    None => client.get_manifest(src).await?.digest,
                })
            })
        };
        match self.caches.resolution() {
            // While the breaker is open or half-open, a caller must not wait
            // on another's lookup: that one may be the probe, which waits
            // out `source.timeout`. Each asks the breaker itself, and all
            // but the probe are refused at once and use the target's copy.
            Some(c) if !self.breakers.is_closed(&source_key(src)) => {
                let d = fetch().await?;
                c.insert(key, d.clone()).await;
                Ok(d)
            }
            // One lookup per key at a time: callers arriving while it runs
            // wait for it instead of resolving again (moka's coalescing).
            Some(c) => {
                let mut missed = false;
                let shared = c
                    .try_get_with(key, async {
                        missed = true;
                        fetch().await
                    })
                    .await
                    .map_err(|e| match Arc::try_unwrap(e) {
                        Ok(e) => e,
                        Err(shared) => shared.for_waiter(src, &self.target_key),
                    });
                match shared {
                    Ok(d) => {
                        if !missed {
                            self.metrics.cache(cache::RESOLUTION, true);
                        }
                        Ok(d)
                    }
                    // Another caller's credentials were refused; ours may
                    // read it, so they are asked on their own.
                    Err(MirrorError::SourceRefused { .. }) if !missed => fetch().await,
                    Err(e) => Err(e),
                }
            }
            None => fetch().await,
        }
    }
}
