//! `prewarm`: new nodes pull the cluster's working set from the mirror
//! before they take Pods (docs/configuration.md#prewarm). The leader
//! chooses the set from its usage record (`namespaces`, `podSelector`,
//! `daemonSets`, `top`) and publishes it; each node agent pulls it within
//! the node's bounds (`concurrency`, `maxBytes`, `freeSpaceFloor`,
//! `deadline`), then labels its node and removes `startupTaint`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::LabelSelector;

/// The most images a warm set lists: each is one HEAD at the target per
/// leader round and one pull per new node.
pub const MAX_TOP: usize = 1_000;
/// The most pulls a node agent runs at once.
pub const MAX_CONCURRENCY: usize = 16;

/// The `prewarm` block.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, top: 50}"
)]
pub struct Prewarm {
    /// The leader publishes a warm set and node agents pull it.
    #[serde(default)]
    pub enabled: bool,
    /// Only objects in these namespaces; empty: every namespace.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Only objects whose labels (a Pod's, a template's) it selects; empty:
    /// every object.
    #[serde(default)]
    pub pod_selector: LabelSelector,
    /// Every DaemonSet's images, whatever `namespaces` and `podSelector`
    /// say: each new node runs them.
    #[serde(default = "yes")]
    pub daemon_sets: bool,
    /// The images most objects name, at most this many.
    #[serde(default = "d_top")]
    pub top: usize,
    /// Pulls at once on a node.
    #[serde(default = "d_concurrency")]
    pub concurrency: usize,
    /// How much the node's image filesystem may grow; no pull starts past
    /// it.
    #[serde(default = "d_max_bytes", with = "bytes")]
    pub max_bytes: u64,
    /// No pull starts while the image filesystem has less free.
    #[serde(default = "d_floor", with = "bytes")]
    pub free_space_floor: u64,
    /// When the node is marked and released, warm or not.
    #[serde(default = "d_deadline", with = "super::duration")]
    pub deadline: Duration,
    /// A taint the nodes register with (Karpenter's `startupTaints`, a
    /// kubelet's `--register-with-taints`), removed once the node is warm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_taint: Option<String>,
}

fn yes() -> bool {
    true
}
fn d_top() -> usize {
    50
}
fn d_concurrency() -> usize {
    2
}
fn d_max_bytes() -> u64 {
    20 << 30
}
fn d_floor() -> u64 {
    5 << 30
}
fn d_deadline() -> Duration {
    Duration::from_secs(600)
}

impl Default for Prewarm {
    fn default() -> Self {
        Self {
            enabled: false,
            namespaces: Vec::new(),
            pod_selector: LabelSelector::default(),
            daemon_sets: true,
            top: d_top(),
            concurrency: d_concurrency(),
            max_bytes: d_max_bytes(),
            free_space_floor: d_floor(),
            deadline: d_deadline(),
            startup_taint: None,
        }
    }
}

/// Byte sizes: `20Gi`, `500M` or a number.
mod bytes {
    use super::*;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        let expected = "expected bytes such as 20Gi, 512Mi or 500M";
        match Raw::deserialize(d).map_err(|_| super::super::own_error(expected))? {
            Raw::N(n) => Ok(n),
            Raw::S(s) => match super::super::Memory::parse(&s) {
                Ok(super::super::Memory::Bytes(n)) => Ok(n),
                _ => Err(super::super::own_error(format!("found {s:?}, {expected}"))),
            },
        }
    }

    pub fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        let units = [(30, "Gi"), (20, "Mi"), (10, "Ki")];
        match units
            .iter()
            .find(|(shift, _)| *n > 0 && n.is_multiple_of(1u64 << shift))
        {
            Some((shift, unit)) => s.serialize_str(&format!("{}{unit}", n >> shift)),
            None => s.serialize_u64(*n),
        }
    }
}

impl Prewarm {
    pub(super) fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        for (i, ns) in self.namespaces.iter().enumerate() {
            if !super::is_dns_label(ns) {
                bad(
                    format!("{path}.namespaces[{i}]"),
                    format!("found {ns:?}, expected a namespace name"),
                );
            }
        }
        self.pod_selector
            .problems(&format!("{path}.podSelector"), bad);
        if self.top == 0 || self.top > MAX_TOP {
            bad(
                format!("{path}.top"),
                format!("found {}, expected 1 to {MAX_TOP}", self.top),
            );
        }
        if self.concurrency == 0 || self.concurrency > MAX_CONCURRENCY {
            bad(
                format!("{path}.concurrency"),
                format!(
                    "found {}, expected 1 to {MAX_CONCURRENCY}",
                    self.concurrency
                ),
            );
        }
        if self.max_bytes == 0 {
            bad(
                format!("{path}.maxBytes"),
                "found 0, expected bytes such as 20Gi".into(),
            );
        }
        let d = self.deadline;
        if d < Duration::from_secs(1) || d > Duration::from_secs(86_400) {
            bad(
                format!("{path}.deadline"),
                format!(
                    "found {}, expected 1s to 24h, e.g. 10m",
                    humantime::format_duration(d)
                ),
            );
        }
        if let Some(t) = &self.startup_taint
            && let Err(why) = super::scope::label_key(t)
        {
            bad(
                format!("{path}.startupTaint"),
                why.replace("label key", "taint key"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(yaml: &str) -> Vec<String> {
        let p: Prewarm = yaml_serde::from_str(yaml).unwrap();
        let mut out = Vec::new();
        p.problems("prewarm", &mut |k, m| out.push(format!("{k}: {m}")));
        out
    }

    #[test]
    fn defaults_sizes_and_bad_keys() {
        let p: Prewarm = yaml_serde::from_str("enabled: true").unwrap();
        assert_eq!(p.max_bytes, 20 << 30);
        assert_eq!(p.free_space_floor, 5 << 30);
        assert!(p.daemon_sets && p.startup_taint.is_none());
        let text = yaml_serde::to_string(&p).unwrap();
        assert!(text.contains("maxBytes: 20Gi"), "{text}");
        assert_eq!(yaml_serde::from_str::<Prewarm>(&text).unwrap(), p);
        let p: Prewarm = yaml_serde::from_str("maxBytes: 500M\nfreeSpaceFloor: 1048576").unwrap();
        assert_eq!((p.max_bytes, p.free_space_floor), (500_000_000, 1 << 20));
        let e = yaml_serde::from_str::<Prewarm>("maxBytes: 10%").unwrap_err();
        assert!(e.to_string().contains("expected bytes such as 20Gi"), "{e}");
        assert!(problems("namespaces: [apps]\nstartupTaint: example.com/warming").is_empty());
        let got = problems(
            "namespaces: [Apps]\ntop: 0\nconcurrency: 99\nmaxBytes: 0\ndeadline: 0s\nstartupTaint: 'a b'\npodSelector: {matchLabels: {'-x': a}}",
        );
        let keys: Vec<&str> = got.iter().map(|g| g.split(':').next().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "prewarm.namespaces[0]",
                "prewarm.podSelector.matchLabels.-x",
                "prewarm.top",
                "prewarm.concurrency",
                "prewarm.maxBytes",
                "prewarm.deadline",
                "prewarm.startupTaint"
            ],
            "{got:#?}"
        );
        assert!(got[6].contains("taint key"), "{}", got[6]);
    }
}
