//! The namespaces the leader acts in: each one's labels against the
//! webhook's `namespaceSelector` ([`Scope`]), from a watch of Namespaces
//! while it leads. The backfill, recovery and eviction act only on Pods and
//! templates the webhook would be sent, so what pinswap reads (pull
//! secrets), copies and evicts stays within what the cluster's owner
//! opted in.
//!
//! A namespace not seen yet is outside: the leader starts its Pod and
//! workload watches once this watch has listed. Every namespace is watched,
//! or with `recovery.namespaces` each of those by name (the RBAC grants
//! only them).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::admission::scope::Scope;

/// Whether each namespace seen is in the webhook's scope.
pub struct Namespaces {
    scope: Scope,
    admitted: Mutex<HashMap<String, bool>>,
    /// Every watch has listed once since [`Namespaces::clear`].
    listed: watch::Sender<bool>,
}

impl Namespaces {
    /// Nothing seen yet: every namespace counts as outside.
    pub fn new(scope: Scope) -> Self {
        Self {
            scope,
            admitted: Mutex::default(),
            listed: watch::channel(false).0,
        }
    }

    /// The selectors.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, bool>> {
        self.admitted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the webhook is sent the Pods of namespace `ns` (one not seen
    /// yet: no).
    pub fn admits(&self, ns: &str) -> bool {
        self.lock().get(ns).copied().unwrap_or(false)
    }

    /// Whether the webhook is sent a Pod labelled `labels` in `ns`.
    pub fn admits_object(
        &self,
        ns: &str,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> bool {
        self.scope.admits_object(labels) && self.admits(ns)
    }

    /// Forgets every namespace (leadership lost).
    pub fn clear(&self) {
        self.lock().clear();
        self.listed.send_replace(false);
    }

    /// Whether the watch has listed every namespace it watches.
    pub fn is_listed(&self) -> bool {
        *self.listed.borrow()
    }

    /// Waits until the watch has listed every namespace it watches.
    pub async fn listed(&self) {
        let mut rx = self.listed.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }

    /// Records namespace `name`'s verdict; whether it changed.
    fn set(&self, name: &str, admitted: bool) -> bool {
        let before = self.lock().insert(name.to_owned(), admitted);
        before.unwrap_or(false) != admitted
    }

    /// Forgets namespace `name`; whether it was in the scope.
    fn remove(&self, name: &str) -> bool {
        self.lock().remove(name).unwrap_or(false)
    }

    /// Watches every namespace, or those of `names`, and calls `changed`
    /// with a namespace and whether it is in the scope now, each time that
    /// changes. Runs until dropped.
    pub async fn watch(
        &self,
        client: kube::Client,
        names: &[String],
        changed: impl Fn(&str, bool),
    ) {
        let api: Api<Namespace> = Api::all(client);
        let scopes: Vec<Option<String>> = match names.is_empty() {
            true => vec![None],
            false => names.iter().cloned().map(Some).collect(),
        };
        let streams = scopes.iter().map(|only| {
            let config = match only {
                Some(n) => watcher::Config::default().fields(&format!("metadata.name={n}")),
                None => watcher::Config::default(),
            };
            let only = only.clone();
            super::lists::watch(api.clone(), config)
                .default_backoff()
                .map(move |ev| (only.clone(), ev))
                .boxed()
        });
        let mut events = futures::stream::select_all(streams);
        // Per watch, the namespaces its list in progress delivered.
        let mut listing: HashMap<Option<String>, HashSet<String>> = HashMap::new();
        let mut pending: HashSet<Option<String>> = scopes.iter().cloned().collect();
        let apply = |ns: &Namespace| {
            let name = ns.name_any();
            let admitted = self
                .scope
                .admits_namespace(&name, ns.metadata.labels.as_ref());
            if self.set(&name, admitted) {
                info!(namespace = %name, in_scope = admitted, "namespace scope changed");
                changed(&name, admitted);
            }
            name
        };
        while let Some((only, ev)) = events.next().await {
            match ev {
                Ok(Event::Init) => {
                    listing.insert(only, HashSet::new());
                }
                Ok(Event::InitApply(ns)) => {
                    let name = apply(&ns);
                    listing.entry(only).or_default().insert(name);
                }
                Ok(Event::InitDone) => {
                    // Namespaces deleted while the watch was down.
                    let delivered = listing.remove(&only).unwrap_or_default();
                    let known: Vec<String> = self.lock().keys().cloned().collect();
                    for name in known {
                        let ours = only.as_ref().is_none_or(|n| *n == name);
                        if ours && !delivered.contains(&name) && self.remove(&name) {
                            changed(&name, false);
                        }
                    }
                    pending.remove(&only);
                    if pending.is_empty() {
                        self.listed.send_replace(true);
                    }
                }
                Ok(Event::Apply(ns)) => {
                    apply(&ns);
                }
                Ok(Event::Delete(ns)) => {
                    if self.remove(&ns.name_any()) {
                        changed(&ns.name_any(), false);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "namespace watch failed; retrying with backoff (the leader's Pod and workload watches wait for its first list)")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unseen_namespace_is_outside() {
        let n = Namespaces::new(Scope::new(&Default::default(), "pinswap"));
        assert!(!n.admits("shop"));
        assert!(n.set("shop", true));
        assert!(n.admits("shop"));
        assert!(!n.set("shop", true), "unchanged");
        assert!(n.admits_object("shop", None));
        let opted: std::collections::BTreeMap<String, String> =
            [("pinswap.dev/ignore".to_owned(), "true".to_owned())].into();
        assert!(!n.admits_object("shop", Some(&opted)));
        assert!(n.set("shop", false));
        assert!(!n.admits("shop"));
        n.clear();
        assert!(!n.set("other", false), "unseen counts as outside already");
    }
}
