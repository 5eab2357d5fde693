//! The memory budget for request bodies in flight, and reading a body
//! within it and within a deadline.
//!
//! Every `/mutate` body is buffered whole (it is parsed as one JSON
//! document), so what a client can make the server hold is the sum of the
//! bodies it has started sending. A semaphore over bytes bounds that sum
//! across all connections and streams. A body reserves what its
//! `Content-Length` says before a byte is read, or, without one (chunked
//! HTTP/1.1, HTTP/2), reserves as its bytes arrive. A reservation that
//! cannot be had is refused at once (503) instead of waiting: a waiting
//! request holds a connection and its buffers too.
//!
//! Large bodies (over [`LARGE_BODY`]) may hold at most half the budget, so
//! clients stalling big bodies cannot starve the API server's usual
//! reviews of a few KiB.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bodies above this size draw on the large half of the budget as well.
pub const LARGE_BODY: u64 = 256 * 1024;

/// What a body without `Content-Length` reserves at a time.
const STEP: u64 = 64 * 1024;

/// Why a body was not read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    /// Above the size limit (413), from `Content-Length` or as counted.
    #[error("request body over {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// The budget is in use by other bodies (503).
    #[error("too many request bodies in flight; retry")]
    Busy,
    /// Parsing it would take more than the whole budget can ever hold, so a
    /// retry cannot help (413).
    #[error(
        "parsing this review takes about {needed} bytes, more than server.bodyMemory can hold for one review ({most} bytes); raise server.bodyMemory"
    )]
    OverBudget {
        /// What the review needs.
        needed: u64,
        /// The most one review can hold.
        most: u64,
    },
    /// Not received within the body timeout (408).
    #[error("request body not received within the body timeout")]
    Timeout,
    /// The client broke off or sent a malformed body (400).
    #[error("cannot read the request body: {0}")]
    Read(String),
}

/// The byte budget shared by every connection of one listener.
#[derive(Clone, Debug)]
pub struct BodyBudget {
    all: Arc<Semaphore>,
    large: Arc<Semaphore>,
    bytes: u64,
}

impl BodyBudget {
    /// A budget of `bytes` (at least two [`LARGE_BODY`]s).
    pub fn new(bytes: u64) -> Self {
        let bytes = bytes.max(2 * LARGE_BODY);
        let permits = |n: u64| {
            usize::try_from(n)
                .unwrap_or(usize::MAX)
                .min(Semaphore::MAX_PERMITS)
        };
        Self {
            all: Arc::new(Semaphore::new(permits(bytes))),
            large: Arc::new(Semaphore::new(permits(bytes / 2))),
            bytes,
        }
    }

    /// The budget in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes reserved by bodies now.
    pub fn in_use(&self) -> u64 {
        self.bytes
            .saturating_sub(self.all.available_permits() as u64)
    }

    /// An empty reservation, grown with [`Reservation::grow_to`].
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.clone(),
            all: None,
            large: None,
            reserved: 0,
            large_reserved: 0,
        }
    }
}

/// Bytes of the budget held for one body, released on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: BodyBudget,
    all: Option<OwnedSemaphorePermit>,
    large: Option<OwnedSemaphorePermit>,
    reserved: u64,
    large_reserved: u64,
}

fn take(
    sem: &Arc<Semaphore>,
    held: &mut Option<OwnedSemaphorePermit>,
    n: u64,
) -> Result<(), BodyError> {
    let n = u32::try_from(n).map_err(|_| BodyError::Busy)?;
    let permit = sem
        .clone()
        .try_acquire_many_owned(n)
        .map_err(|_| BodyError::Busy)?;
    match held {
        Some(h) => h.merge(permit),
        None => *held = Some(permit),
    }
    Ok(())
}

impl Reservation {
    /// Holds at least `bytes` of the budget.
    ///
    /// # Errors
    /// [`BodyError::Busy`] when the budget (or its large half, for a body
    /// over [`LARGE_BODY`]) cannot cover it now; what was held stays held.
    pub fn grow_to(&mut self, bytes: u64) -> Result<(), BodyError> {
        // A large body may hold the large half of the budget at most.
        let most = match bytes > LARGE_BODY {
            true => self.budget.bytes / 2,
            false => self.budget.bytes,
        };
        if bytes > most {
            return Err(BodyError::OverBudget {
                needed: bytes,
                most,
            });
        }
        if bytes > self.reserved {
            take(&self.budget.all, &mut self.all, bytes - self.reserved)?;
            self.reserved = bytes;
        }
        if bytes > LARGE_BODY && bytes > self.large_reserved {
            take(
                &self.budget.large,
                &mut self.large,
                bytes - self.large_reserved,
            )?;
            self.large_reserved = bytes;
        }
        Ok(())
    }
}

/// Checks a declared length before any byte is read: a reservation holding
/// it, or why the body is refused.
///
/// # Errors
/// [`BodyError::TooLarge`] above `limit`; [`BodyError::Busy`] when the
/// budget cannot hold it now.
pub fn admit(
    content_length: Option<u64>,
    limit: u64,
    budget: &BodyBudget,
) -> Result<Reservation, BodyError> {
    if content_length.is_some_and(|n| n > limit) {
        return Err(BodyError::TooLarge { limit });
    }
    let mut reservation = budget.reservation();
    reservation.grow_to(content_length.unwrap_or(0))?;
    Ok(reservation)
}

/// Reads `body` whole: at most `limit` bytes, by `deadline`, growing
/// `reservation` (from [`admit`]) as bytes arrive beyond what it holds. A
/// body longer than `content_length` is cut off as too large.
///
/// # Errors
/// As [`BodyError`].
pub async fn read_body(
    body: Body,
    content_length: Option<u64>,
    limit: u64,
    mut reservation: Reservation,
    deadline: Instant,
) -> Result<(Bytes, Reservation), BodyError> {
    let declared = content_length.unwrap_or(0);
    let read = async {
        let mut body = body.into_data_stream();
        let mut buf = BytesMut::with_capacity(usize::try_from(declared).unwrap_or(0));
        while let Some(data) = body.next().await {
            let data = data.map_err(|e| BodyError::Read(e.to_string()))?;
            let len = (buf.len() + data.len()) as u64;
            if len > limit || content_length.is_some_and(|n| len > n) {
                return Err(BodyError::TooLarge {
                    limit: content_length.unwrap_or(limit).min(limit),
                });
            }
            if len > reservation.reserved {
                reservation.grow_to((len.div_ceil(STEP) * STEP).min(limit))?;
            }
            buf.extend_from_slice(&data);
        }
        Ok(buf.freeze())
    };
    match tokio::time::timeout_at(deadline.into(), read).await {
        Ok(Ok(bytes)) => Ok((bytes, reservation)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(BodyError::Timeout),
    }
}

/// Reads and drops up to `max` bytes of `body` until `deadline`, holding
/// none of them.
pub async fn discard(body: Body, max: u64, deadline: Instant) {
    let mut body = body.into_data_stream();
    let mut seen = 0u64;
    let drain = async {
        while let Some(Ok(data)) = body.next().await {
            seen += data.len() as u64;
            if seen >= max {
                break;
            }
        }
    };
    let _ = tokio::time::timeout_at(deadline.into(), drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn reservations_share_the_budget_and_large_bodies_half_of_it() {
        let budget = BodyBudget::new(4 * 1024 * 1024);
        let mut a = budget.reservation();
        a.grow_to(1024 * 1024).unwrap();
        let mut b = budget.reservation();
        b.grow_to(1024 * 1024).unwrap();
        // The large half (2 MiB) is taken: another large body is refused,
        // a small one still fits.
        let mut c = budget.reservation();
        assert_eq!(c.grow_to(1024 * 1024), Err(BodyError::Busy));
        let mut small = budget.reservation();
        small.grow_to(16 * 1024).unwrap();
        assert_eq!(budget.in_use(), 2 * 1024 * 1024 + 16 * 1024 + c.reserved);
        drop(a);
        c.grow_to(1024 * 1024).unwrap();
        drop((b, c, small));
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn declared_lengths_are_refused_before_reading() {
        let budget = BodyBudget::new(1024 * 1024);
        let soon = Instant::now() + Duration::from_secs(5);
        let err = admit(Some(5 << 20), 4 << 20, &budget).unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit: 4 << 20 });
        // Over the large half of a 1 MiB budget: it can never fit.
        let err = admit(Some(600 << 10), 4 << 20, &budget).unwrap_err();
        assert_eq!(
            err,
            BodyError::OverBudget {
                needed: 600 << 10,
                most: 512 << 10
            }
        );
        let held = admit(Some(2), 4 << 20, &budget).unwrap();
        let (bytes, held) = read_body(Body::from("{}"), Some(2), 4 << 20, held, soon)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"{}");
        assert_eq!(budget.in_use(), 2);
        drop(held);
        // A body longer than declared is cut off.
        let held = admit(Some(2), 4 << 20, &budget).unwrap();
        let err = read_body(Body::from("{}x"), Some(2), 4 << 20, held, soon)
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit: 2 });
        // Without a length, it reserves as bytes arrive.
        let held = admit(None, 4 << 20, &budget).unwrap();
        let (bytes, held) = read_body(Body::from(vec![b' '; 100_000]), None, 4 << 20, held, soon)
            .await
            .unwrap();
        assert_eq!(bytes.len(), 100_000);
        assert_eq!(budget.in_use(), 2 * STEP);
        drop(held);
        let held = admit(None, 4 << 20, &budget).unwrap();
        let err = read_body(Body::from(vec![b' '; 600_000]), None, 4 << 20, held, soon)
            .await
            .unwrap_err();
        assert!(
            matches!(err, BodyError::OverBudget { most, .. } if most == 512 << 10),
            "past the large half: {err:?}"
        );
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn a_stalled_body_times_out_and_frees_its_reservation() {
        let budget = BodyBudget::new(1024 * 1024);
        let first = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"{"))]);
        let body = Body::from_stream(first.chain(futures::stream::pending()));
        let deadline = Instant::now() + Duration::from_millis(100);
        let held = admit(Some(100), 4 << 20, &budget).unwrap();
        let err = read_body(body, Some(100), 4 << 20, held, deadline)
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::Timeout);
        assert_eq!(budget.in_use(), 0);
    }
}
