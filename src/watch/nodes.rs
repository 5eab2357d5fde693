//! The nodes' platforms against the `platforms` filter. A filtered index
//! holds only the listed platforms, so a Pod scheduled on a node of another
//! os/arch cannot pull it ("no matching manifest"). While it leads, the
//! watcher reads the nodes' `kubernetes.io/os` and `kubernetes.io/arch`
//! labels (the kubelet sets both), warns when the filter leaves a platform
//! the cluster runs, and counts those nodes in
//! `pinswap_nodes_without_platform`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::platform::PlatformSpec;

const OS_LABEL: &str = "kubernetes.io/os";
const ARCH_LABEL: &str = "kubernetes.io/arch";

/// `os/arch` of a node, from its labels; `None` when either is missing.
fn platform(node: &PartialObjectMeta<Node>) -> Option<String> {
    let labels = node.metadata.labels.as_ref()?;
    Some(format!(
        "{}/{}",
        labels.get(OS_LABEL)?,
        labels.get(ARCH_LABEL)?
    ))
}

/// Whether the filter mirrors some variant of `os/arch`. Node labels carry
/// no variant, so an entry with one counts.
fn covered(filter: &[PlatformSpec], platform: &str) -> bool {
    filter
        .iter()
        .any(|p| platform.split_once('/') == Some((p.os.as_str(), p.architecture.as_str())))
}

/// The nodes seen, by name, and what was last reported.
#[derive(Default)]
pub struct NodePlatforms {
    nodes: BTreeMap<String, Option<String>>,
    reported: Option<BTreeSet<String>>,
}

impl NodePlatforms {
    fn apply(&mut self, node: &PartialObjectMeta<Node>) {
        if let Some(name) = &node.metadata.name {
            self.nodes.insert(name.clone(), platform(node));
        }
    }

    fn delete(&mut self, node: &PartialObjectMeta<Node>) {
        if let Some(name) = &node.metadata.name {
            self.nodes.remove(name);
        }
    }

    /// Sets the gauge, and logs when the set of platforms the filter leaves
    /// out changed (or on the first call). Returns that set.
    fn report(&mut self, filter: &[PlatformSpec], metrics: &Metrics) -> BTreeSet<String> {
        let mut missing = BTreeSet::new();
        let mut nodes = 0;
        for p in self.nodes.values().flatten() {
            if !covered(filter, p) {
                missing.insert(p.clone());
                nodes += 1;
            }
        }
        metrics.nodes_without_platform.set(nodes);
        if self.reported.as_ref() != Some(&missing) {
            let filter = filter
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            if missing.is_empty() {
                info!(platforms = %filter, nodes = self.nodes.len(), "the platforms filter covers every node's os/arch");
            } else {
                let list = missing.iter().cloned().collect::<Vec<_>>().join(", ");
                warn!(platforms = %filter, missing = %list, nodes, "the platforms filter leaves out platforms this cluster's nodes run: Pods there cannot pull filtered images (\"no matching manifest\"); add them to platforms, or use platforms: all");
            }
            self.reported = Some(missing.clone());
        }
        missing
    }
}

/// Watches the nodes' metadata and reports against `filter`. Runs until
/// dropped.
pub async fn watch(client: kube::Client, filter: Vec<PlatformSpec>, metrics: Arc<Metrics>) {
    // Metadata only: the labels are all it reads.
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    let mut events = super::lists::watch(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut state = NodePlatforms::default();
    let mut listing = BTreeMap::new();
    let mut synced = false;
    while let Some(ev) = events.next().await {
        match ev {
            Ok(Event::Init) => listing.clear(),
            Ok(Event::InitApply(n)) => {
                if let Some(name) = &n.metadata.name {
                    listing.insert(name.clone(), platform(&n));
                }
            }
            Ok(Event::InitDone) => {
                state.nodes = std::mem::take(&mut listing);
                synced = true;
                state.report(&filter, &metrics);
            }
            Ok(Event::Apply(n)) => {
                state.apply(&n);
                if synced {
                    state.report(&filter, &metrics);
                }
            }
            Ok(Event::Delete(n)) => {
                state.delete(&n);
                if synced {
                    state.report(&filter, &metrics);
                }
            }
            Err(e) => warn!(error = %e, "node watch failed; retrying with backoff"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, os: &str, arch: &str) -> PartialObjectMeta<Node> {
        let mut n = PartialObjectMeta::<Node>::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(
            [(OS_LABEL, os), (ARCH_LABEL, arch)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n
    }

    #[test]
    fn reports_nodes_the_filter_leaves_out() {
        let filter: Vec<PlatformSpec> = vec!["linux/amd64".parse().unwrap()];
        let m = Metrics::new();
        let mut s = NodePlatforms::default();
        s.apply(&node("a", "linux", "amd64"));
        assert!(s.report(&filter, &m).is_empty());
        assert!(m.encode().contains("pinswap_nodes_without_platform 0"));
        s.apply(&node("b", "linux", "arm64"));
        s.apply(&node("c", "linux", "arm64"));
        let missing = s.report(&filter, &m);
        assert_eq!(missing.into_iter().collect::<Vec<_>>(), ["linux/arm64"]);
        assert!(m.encode().contains("pinswap_nodes_without_platform 2"));
        s.delete(&node("b", "", ""));
        s.delete(&node("c", "", ""));
        assert!(s.report(&filter, &m).is_empty());
        assert!(m.encode().contains("pinswap_nodes_without_platform 0"));
    }

    #[test]
    fn a_variant_in_the_filter_covers_its_arch_and_unlabelled_nodes_are_skipped() {
        let filter: Vec<PlatformSpec> = vec!["linux/arm64/v8".parse().unwrap()];
        assert!(covered(&filter, "linux/arm64"));
        assert!(!covered(&filter, "windows/arm64"));
        let mut n = node("x", "linux", "amd64");
        n.metadata.labels = None;
        assert_eq!(platform(&n), None);
    }
}
