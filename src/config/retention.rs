//! `retention`: removing mirrored images nothing has used for a while
//! (docs/configuration.md#retention; the rules are in src/retention/).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration;

/// Retention of mirrored images. Off by default: the mirror only grows.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
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
        recovery: bool,
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
        if self.enabled && !recovery {
            bad(
                format!("{path}.enabled"),
                "found true with recovery.enabled false; retention runs on the leader and learns what is in use from its Pod watch: turn recovery on".into(),
            );
        }
    }
}
