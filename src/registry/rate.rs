//! A floor under a blob's transfer rate (`copy.minTransferRate`).
//!
//! The HTTP client's read timeout restarts with every byte, so a source that
//! sends one byte a minute holds a copy slot forever. Here the bytes are
//! counted in windows of `window`: a window that ends with fewer than
//! `bytes_per_second × window` bytes cuts the stream with [`TooSlow`]. A
//! slow but steady link passes; a trickle or a stall is cut within two
//! windows. The bytes counted are those read from the source, so a target
//! that accepts them more slowly than the floor cuts the transfer too.

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::time::{Instant, Sleep};

/// The floor: at least `bytes_per_second` on average over each `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferFloor {
    /// Bytes per second, averaged over a window; above 0.
    pub bytes_per_second: u64,
    /// How long each measurement runs; above 0.
    pub window: Duration,
}

impl TransferFloor {
    /// The bytes a window must carry.
    fn per_window(&self) -> u64 {
        let bytes = u128::from(self.bytes_per_second) * self.window.as_millis() / 1000;
        u64::try_from(bytes).unwrap_or(u64::MAX).max(1)
    }
}

/// Why a blob transfer was cut: the stream's error, readable through
/// [`std::io::Error::get_ref`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "transfer too slow: {bytes} bytes in {}, below the floor of {} bytes/s (copy.minTransferRate)",
    humantime::format_duration(*window),
    floor
)]
pub struct TooSlow {
    /// Bytes the last window carried.
    pub bytes: u64,
    /// The window.
    pub window: Duration,
    /// The floor, bytes per second.
    pub floor: u64,
}

/// `inner`, cut with [`TooSlow`] once a window carries less than `floor`
/// asks.
pub fn floored<S>(inner: S, floor: TransferFloor) -> Floored<S> {
    Floored {
        inner,
        floor,
        bytes: 0,
        deadline: Box::pin(tokio::time::sleep(floor.window)),
        done: false,
    }
}

/// The stream [`floored`] returns.
pub struct Floored<S> {
    inner: S,
    floor: TransferFloor,
    /// Bytes in the current window.
    bytes: u64,
    /// When the current window ends.
    deadline: Pin<Box<Sleep>>,
    /// Ended or cut: nothing more is read.
    done: bool,
}

impl<S> Floored<S> {
    /// At a window's end: the cut, or a fresh window.
    fn window_ended(&mut self) -> Option<std::io::Error> {
        if self.bytes < self.floor.per_window() {
            self.done = true;
            return Some(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                TooSlow {
                    bytes: self.bytes,
                    window: self.floor.window,
                    floor: self.floor.bytes_per_second,
                },
            ));
        }
        self.bytes = 0;
        let next = Instant::now() + self.floor.window;
        self.deadline.as_mut().reset(next);
        None
    }
}

impl<S> Stream for Floored<S>
where
    S: Stream<Item = std::io::Result<Bytes>> + Unpin,
{
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = &mut *self;
        if me.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut me.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                me.bytes = me.bytes.saturating_add(chunk.len() as u64);
                // A window that ran out while the consumer was busy is
                // judged with what arrived by now.
                if me.deadline.as_mut().poll(cx).is_ready()
                    && let Some(e) = me.window_ended()
                {
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(other) => {
                me.done = true;
                Poll::Ready(other)
            }
            Poll::Pending => {
                // Nothing to read: the window's end wakes us to judge it.
                while me.deadline.as_mut().poll(cx).is_ready() {
                    if let Some(e) = me.window_ended() {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    const FLOOR: TransferFloor = TransferFloor {
        bytes_per_second: 100,
        window: Duration::from_secs(1),
    };

    fn chunks(
        every: Duration,
        size: usize,
        count: usize,
    ) -> impl Stream<Item = std::io::Result<Bytes>> + Unpin {
        futures::stream::iter(0..count)
            .then(move |_| async move {
                tokio::time::sleep(every).await;
                Ok(Bytes::from(vec![0u8; size]))
            })
            .boxed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_slow_link_passes() {
        // 50 bytes every 250 ms: 200 bytes/s, twice the floor, for 10 s.
        let s = floored(chunks(Duration::from_millis(250), 50, 40), FLOOR);
        let all: Vec<_> = s.collect().await;
        assert_eq!(all.len(), 40);
        assert!(all.iter().all(Result::is_ok));
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_is_cut_within_a_window() {
        // 1 byte every 200 ms: 5 bytes/s.
        let start = Instant::now();
        let mut s = floored(chunks(Duration::from_millis(200), 1, 1000), FLOOR);
        let err = loop {
            match s.next().await.expect("cut before the end") {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert!(
            start.elapsed() <= Duration::from_millis(1200),
            "{:?}",
            start.elapsed()
        );
        let why = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<TooSlow>())
            .expect("TooSlow");
        assert!(why.bytes < 100, "{why}");
        assert!(why.to_string().contains("copy.minTransferRate"), "{why}");
        assert!(s.next().await.is_none(), "nothing after the cut");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_is_cut_without_another_byte() {
        let stalled = futures::stream::pending::<std::io::Result<Bytes>>();
        let start = Instant::now();
        let mut s = floored(stalled, FLOOR);
        let err = s.next().await.unwrap().unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(
            err.get_ref().and_then(|e| e.downcast_ref::<TooSlow>()),
            Some(&TooSlow {
                bytes: 0,
                window: Duration::from_secs(1),
                floor: 100
            })
        );
    }
}
