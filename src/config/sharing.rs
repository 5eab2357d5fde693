//! `cluster` and `sharing`: several clusters mirroring into one target
//! (docs/operations.md#several-clusters-one-mirror; the rules are in
//! src/retention/clusters.rs).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration;

/// The most characters of a cluster name: it is a tag at the target and a
/// metric label.
pub const MAX_CLUSTER_NAME: usize = 63;

/// Sharing one target between clusters. Off by default: a target holds one
/// cluster's copies, and retention sees only that cluster's Pods.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, interval: 5m}"
)]
pub struct Sharing {
    /// Publish this cluster's usage record at the target, and let
    /// retention keep what any cluster's record names. Needs `cluster`
    /// and `recovery.enabled` (the leader publishes).
    #[serde(default)]
    pub enabled: bool,
    /// Time between two publications of this cluster's record when an
    /// image it names as in use stopped being used, and between two looks
    /// at its tag when nothing changed (it is written again then every
    /// third of `stale_after`). An image new to the record is published
    /// within `check_every`.
    #[serde(default = "d_5m", with = "duration")]
    pub interval: Duration,
    /// How often the leader looks for images new to its record. Retention
    /// waits two of these between choosing what to remove and reading
    /// the records again, so that a cluster that just started to use a
    /// candidate has published it.
    #[serde(default = "d_5s", with = "duration")]
    pub check_every: Duration,
    /// A record not updated for this long belongs to a cluster that may be
    /// gone: it counts as using everything it lists until an operator
    /// runs `pinswap clusters forget NAME`.
    #[serde(default = "super::d_1h", with = "duration")]
    pub stale_after: Duration,
    /// How long an image stays in this cluster's record after its last
    /// use; at least the longest `retention.unusedFor` of the clusters
    /// sharing the target.
    #[serde(default = "d_720h", with = "duration")]
    pub keep_for: Duration,
}

impl Default for Sharing {
    fn default() -> Self {
        Self {
            enabled: false,
            interval: d_5m(),
            check_every: d_5s(),
            stale_after: super::d_1h(),
            keep_for: d_720h(),
        }
    }
}

fn d_5s() -> Duration {
    Duration::from_secs(5)
}

fn d_5m() -> Duration {
    Duration::from_secs(300)
}

fn d_720h() -> Duration {
    Duration::from_secs(720 * 3600)
}

/// Why `name` is not a cluster name, if it is not: 1 to 63 lowercase
/// letters, digits, `-` and `.`, starting and ending with a letter or
/// digit (a valid OCI tag and metric label value).
pub fn cluster_name_problem(name: &str) -> Option<String> {
    let ok_end = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() || name.len() > MAX_CLUSTER_NAME {
        return Some(format!(
            "found {} characters, expected 1 to {MAX_CLUSTER_NAME}",
            name.chars().count()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        return Some(format!(
            "found {:?} in {name:?}, expected lowercase letters, digits, '-' and '.'",
            c
        ));
    }
    if !ok_end(name.chars().next()) || !ok_end(name.chars().last()) {
        return Some(format!(
            "found {name:?}, expected a letter or digit at each end"
        ));
    }
    None
}

impl Sharing {
    /// The problems of this block and of `cluster`.
    pub(super) fn problems(
        &self,
        cluster: Option<&str>,
        config: &super::Config,
        bad: &mut impl FnMut(String, String),
    ) {
        if let Some(name) = cluster
            && let Some(why) = cluster_name_problem(name)
        {
            bad("cluster".into(), why);
        }
        for (key, d) in [
            ("interval", self.interval),
            ("checkEvery", self.check_every),
            ("staleAfter", self.stale_after),
            ("keepFor", self.keep_for),
        ] {
            if d.is_zero() {
                bad(
                    format!("sharing.{key}"),
                    "found 0s, expected a duration above 0s".into(),
                );
            }
        }
        if !self.enabled {
            return;
        }
        if cluster.is_none() {
            bad(
                "cluster".into(),
                "is required with sharing.enabled: each cluster's usage record at the target is named by it".into(),
            );
        }
        if !config.recovery.enabled {
            bad(
                "sharing.enabled".into(),
                "found true with recovery.enabled false; the leader publishes what its Pod watch sees in use: turn recovery on".into(),
            );
        }
        if !config.recovery.namespaces.is_empty() {
            bad(
                "sharing.enabled".into(),
                "found true with recovery.namespaces set; the record must name what every Pod uses, or another cluster's retention would remove it: leave recovery.namespaces empty".into(),
            );
        }
        // A stale record must not be taken for a live one between two
        // publications.
        if self.stale_after < self.interval * 3 {
            bad(
                "sharing.staleAfter".into(),
                format!(
                    "found {}, expected at least three sharing.interval ({})",
                    humantime::format_duration(self.stale_after),
                    humantime::format_duration(self.interval * 3)
                ),
            );
        }
        if self.check_every > self.interval {
            bad(
                "sharing.checkEvery".into(),
                format!(
                    "found {}, expected at most sharing.interval ({})",
                    humantime::format_duration(self.check_every),
                    humantime::format_duration(self.interval)
                ),
            );
        }
        if self.keep_for < config.retention.unused_for {
            bad(
                "sharing.keepFor".into(),
                format!(
                    "found {}, expected at least retention.unusedFor ({}): another cluster would otherwise stop seeing this one's use before its images are due",
                    humantime::format_duration(self.keep_for),
                    humantime::format_duration(config.retention.unused_for)
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn problems(yaml: &str) -> String {
        match Config::from_yaml(yaml, "t.yaml") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn cluster_names_are_dns_labels() {
        for ok in ["eu-west-1", "prod", "a", "stage.2", &"a".repeat(63)] {
            assert_eq!(cluster_name_problem(ok), None, "{ok}");
        }
        for bad in ["", "Prod", "-a", "a-", "a_b", "a/b", "é", &"a".repeat(64)] {
            assert!(cluster_name_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn sharing_needs_a_cluster_name_and_the_leaders_watch() {
        let base = "target: {registry: m.example.com}\n";
        assert_eq!(
            problems(&format!(
                "{base}cluster: eu-1\nsharing: {{enabled: true}}\n"
            )),
            ""
        );
        let none = problems(&format!("{base}sharing: {{enabled: true}}\n"));
        assert!(
            none.contains("cluster: is required with sharing.enabled"),
            "{none}"
        );
        let bad = problems(&format!("{base}cluster: EU_1\n"));
        assert!(bad.contains("t.yaml: cluster: found 'E'"), "{bad}");
        let off = problems(&format!(
            "{base}cluster: a\nrecovery: {{enabled: false}}\nsharing: {{enabled: true}}\n"
        ));
        assert!(
            off.contains("sharing.enabled: found true with recovery.enabled false"),
            "{off}"
        );
        let stale = problems(&format!(
            "{base}cluster: a\nsharing: {{enabled: true, interval: 1m, staleAfter: 2m}}\n"
        ));
        assert!(
            stale.contains(
                "sharing.staleAfter: found 2m, expected at least three sharing.interval (3m)"
            ),
            "{stale}"
        );
        let keep = problems(&format!(
            "{base}cluster: a\nretention: {{unusedFor: 48h}}\nsharing: {{enabled: true, keepFor: 24h}}\n"
        ));
        assert!(
            keep.contains(
                "sharing.keepFor: found 1day, expected at least retention.unusedFor (2days)"
            ),
            "{keep}"
        );
        let unknown = problems(&format!("{base}sharing: {{stale: 1h}}\n"));
        assert!(unknown.contains("sharing"), "{unknown}");
    }
}
