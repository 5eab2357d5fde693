//! How the leader's watchers take their initial lists: streamed where the
//! API server offers it, paged where it does not.
//!
//! A streamed list (`watch=true&sendInitialEvents=true`, kube-apiserver's
//! WatchList, on in the v1.37.2 the cluster suite runs) is one request the
//! API server answers from its watch cache, object by object, and the same
//! request then goes on as the watch. A paged list is a request per 500
//! objects, each a consistent read, then a watch: at 100,000 Pods, 200
//! requests (docs/benchmarks.md "At cluster scale"). The bytes are the
//! same; the API server's work and memory are not, which is why it
//! recommends the streamed one for large collections.
//!
//! An API server without WatchList (Kubernetes before 1.32, or the
//! feature off) refuses `sendInitialEvents` with 422; the first refusal
//! turns every watcher of this process to paged lists.

use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tracing::info;

/// The API server refused a streamed list: list in pages from now on.
static PAGED: AtomicBool = AtomicBool::new(false);

/// kube-runtime's `watcher` of `api` with `config`, its lists streamed
/// until the API server refuses them, then paged.
pub fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
) -> BoxStream<'static, Result<Event<K>, watcher::Error>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    if PAGED.load(Ordering::Relaxed) {
        return watcher::watcher(api, config).boxed();
    }
    let streamed = watcher::watcher(api.clone(), config.clone().streaming_lists()).boxed();
    let start = (streamed, Some((api, config)));
    futures::stream::unfold(start, |(mut events, mut paged)| async move {
        loop {
            let ev = events.next().await?;
            if let Err(e) = &ev
                && refuses_streaming(e)
                && let Some((api, config)) = paged.take()
            {
                if !PAGED.swap(true, Ordering::Relaxed) {
                    info!(
                        error = %e,
                        "the API server does not stream lists (WatchList); listing in pages"
                    );
                }
                events = watcher::watcher(api, config).boxed();
                continue;
            }
            return Some((ev, (events, paged)));
        }
    })
    .boxed()
}

/// Whether `e` is the API server's refusal of `sendInitialEvents`.
fn refuses_streaming(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::WatchStartFailed(kube::Error::Api(s))
            if matches!(s.code, 400 | 422) && s.message.contains("sendInitialEvents")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn refused(code: u16, message: &str) -> watcher::Error {
        let mut s = Status::failure(message, "Invalid");
        s.code = code;
        watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(s)))
    }

    #[test]
    fn only_the_refusal_of_send_initial_events_turns_to_paged_lists() {
        // kube-apiserver without WatchList (its ListOptions validation).
        assert!(refuses_streaming(&refused(
            422,
            "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled"
        )));
        assert!(!refuses_streaming(&refused(
            403,
            "pods is forbidden: sendInitialEvents"
        )));
        assert!(!refuses_streaming(&refused(
            422,
            "something else is invalid"
        )));
        assert!(!refuses_streaming(&watcher::Error::NoResourceVersion));
    }
}
