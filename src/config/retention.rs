//! `retention`: removing mirrored images nothing has used for a while
//! (docs/configuration.md#retention; the rules are in src/retention/).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration;

/// Retention of mirrored images. Off by default: the mirror only grows.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, unusedFor: 720h}"
)]
pub struct Retention {
    /// Remove images that no Pod or workload template has named for
    /// `unusedFor`. Runs on the leader only; needs `recovery.enabled`.
    #[serde(default)]
    pub enabled: bool,
    /// How long an image must have gone unused before it is removed.
    #[serde(default = "d_720h", with = "duration")]
    pub unused_for: Duration,
    /// Time between two retention passes.
    #[serde(default = "super::d_1h", with = "duration")]
    pub interval: Duration,
    /// Log and count what would be removed; remove nothing.
    #[serde(default)]
    pub dry_run: bool,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            enabled: false,
            unused_for: d_720h(),
            interval: super::d_1h(),
            dry_run: false,
        }
    }
}

fn d_720h() -> Duration {
    Duration::from_secs(720 * 3600)
}

impl Retention {
    /// The problems of this block, at key path `path`; `recovery` is
    /// whether `recovery.enabled` is on.
    pub(super) fn problems(
        &self,
        path: &str,
        recovery: &super::Recovery,
        bad: &mut impl FnMut(String, String),
    ) {
        if self.unused_for.is_zero() {
            bad(
                format!("{path}.unusedFor"),
                "found 0s, expected a duration above 0s such as 720h".into(),
            );
        }
        if self.interval.is_zero() {
            bad(
                format!("{path}.interval"),
                "found 0s, expected a duration above 0s such as 1h".into(),
            );
        }
        // The Pod watch is what is in use: Pods it does not see would lose
        // their images.
        if self.enabled && recovery.enabled && !recovery.namespaces.is_empty() {
            bad(
                format!("{path}.enabled"),
                "found true with recovery.namespaces set; retention must see every Pod, or it would remove images that Pods in other namespaces use: leave recovery.namespaces empty".into(),
            );
        }
        if self.enabled && !recovery.enabled {
            bad(
                format!("{path}.enabled"),
                "found true with recovery.enabled false; retention runs on the leader and learns what is in use from its Pod watch: turn recovery on".into(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn problems(yaml: &str) -> String {
        match Config::from_yaml(yaml, "t.yaml") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn retention_needs_a_watch_of_every_pod() {
        let base = "target: {registry: m.example.com}\n";
        assert_eq!(
            problems(&format!("{base}retention: {{enabled: true}}\n")),
            ""
        );
        let off = problems(&format!(
            "{base}recovery: {{enabled: false}}\nretention: {{enabled: true}}\n"
        ));
        assert!(
            off.contains("retention.enabled: found true with recovery.enabled false"),
            "{off}"
        );
        let some = problems(&format!(
            "{base}recovery: {{namespaces: [apps]}}\nretention: {{enabled: true}}\n"
        ));
        assert!(
            some.contains("retention.enabled: found true with recovery.namespaces set"),
            "{some}"
        );
        let zero = problems(&format!(
            "{base}retention: {{unusedFor: 0s, interval: 0s}}\n"
        ));
        assert!(zero.contains("retention.unusedFor: found 0s"), "{zero}");
        assert!(zero.contains("retention.interval: found 0s"), "{zero}");
        let unknown = problems(&format!("{base}retention: {{unusedfor: 1h}}\n"));
        assert!(unknown.contains("unusedfor"), "{unknown}");
    }
}
