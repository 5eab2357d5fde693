//! `mirrorOnly`: Pods whose images are mirrored but which are admitted
//! exactly as written, with no image rewritten and no annotation
//! (docs/configuration.md#mirroronly). For operators that recreate a Pod
//! whose image differs from their own spec, and for clusters where Pods
//! must not be changed at all; nodes then pull the mirror's copies through
//! node mirror configuration.

use serde::{Deserialize, Serialize};

use super::LabelSelector;

/// Which Pods are mirrored only: those of any profile, or matching any
/// entry of `pods`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {profiles: [cloudnative-pg]}"
)]
pub struct MirrorOnly {
    /// Named presets for operators that must not see their Pods changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<Profile>,
    /// Pods matched by their namespace, labels, owner and a JMESPath
    /// expression.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodMatch>,
}

/// An operator whose Pods are never rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// CloudNativePG (`postgresql.cnpg.io`).
    CloudnativePg,
    /// Zalando's postgres-operator (`acid.zalan.do`).
    PostgresOperator,
    /// Aerospike's Kubernetes operator (`asdb.aerospike.com`).
    Aerospike,
}

impl<'de> Deserialize<'de> for Profile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const WORDS: &[&str] = &["cloudnative-pg", "postgres-operator", "aerospike"];
        Ok(Self::ALL[super::word(d, WORDS)?])
    }
}

impl Profile {
    /// Every profile, in the order the docs list them.
    pub const ALL: [Profile; 3] = [
        Profile::CloudnativePg,
        Profile::PostgresOperator,
        Profile::Aerospike,
    ];

    /// As the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CloudnativePg => "cloudnative-pg",
            Self::PostgresOperator => "postgres-operator",
            Self::Aerospike => "aerospike",
        }
    }
}

/// One set of conditions on a Pod; all that are given must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {namespaces: [payments], podSelector: {matchLabels: {app: ledger}}}"
)]
pub struct PodMatch {
    /// The Pod's namespace is one of these; empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// The Pod's labels (a workload's template labels) match.
    #[serde(default, skip_serializing_if = "is_empty")]
    pub pod_selector: LabelSelector,
    /// The Pod's controller (the owner reference with `controller: true`)
    /// is of one of these kinds, `Kind` or `group/Kind` (`apps/StatefulSet`,
    /// `postgresql.cnpg.io/Cluster`); empty: any, or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_kinds: Vec<String>,
    /// JMESPath over `{"obj": <Pod>}`; matches when it gives `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jmespath: Option<String>,
}

fn is_empty(s: &LabelSelector) -> bool {
    s.match_labels.is_empty() && s.match_expressions.is_empty()
}

impl MirrorOnly {
    /// Whether any Pod is mirrored only.
    pub fn is_empty(&self) -> bool {
        self.profiles.is_empty() && self.pods.is_empty()
    }

    /// The problems of this block, at key path `path`.
    pub(super) fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        for (i, m) in self.pods.iter().enumerate() {
            let at = format!("{path}.pods[{i}]");
            m.pod_selector
                .problems(&format!("{at}.podSelector"), &mut *bad);
            for (j, k) in m.owner_kinds.iter().enumerate() {
                let kind = k.rsplit('/').next().unwrap_or_default();
                let group_ok = match k.rsplit_once('/') {
                    Some((g, _)) => !g.is_empty() && !g.contains('/'),
                    None => true,
                };
                if !group_ok
                    || kind.is_empty()
                    || !kind.chars().all(|c| c.is_ascii_alphanumeric())
                    || !kind.starts_with(|c: char| c.is_ascii_uppercase())
                {
                    bad(
                        format!("{at}.ownerKinds[{j}]"),
                        format!("{k:?} is not `Kind` or `group/Kind` (e.g. `apps/StatefulSet`)"),
                    );
                }
            }
            for (j, n) in m.namespaces.iter().enumerate() {
                if n.is_empty()
                    || n.len() > 63
                    || !n
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                {
                    bad(
                        format!("{at}.namespaces[{j}]"),
                        format!("{n:?} is not a namespace name"),
                    );
                }
            }
            if let Some(why) = m.jmespath.as_deref().and_then(super::jmespath_problem) {
                bad(format!("{at}.jmespath"), why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn each_bad_entry_is_named_by_its_key() {
        let yaml = "target: {registry: m.example}\nmirrorOnly:\n  profiles: [cloudnative-pg]\n  pods:\n  - ownerKinds: [statefulset, apps/v1/StatefulSet]\n    namespaces: [Bad_NS]\n    podSelector: {matchExpressions: [{key: app, operator: In}]}\n    jmespath: \"obj.[[\"\n";
        let err = Config::from_yaml(yaml, "c.yaml").unwrap_err().to_string();
        for key in [
            "mirrorOnly.pods[0].ownerKinds[0]",
            "mirrorOnly.pods[0].ownerKinds[1]",
            "mirrorOnly.pods[0].namespaces[0]",
            "mirrorOnly.pods[0].podSelector.matchExpressions[0].values",
            "mirrorOnly.pods[0].jmespath",
        ] {
            assert!(err.contains(key), "{key} not named: {err}");
        }
        let unknown = Config::from_yaml(
            "target: {registry: m.example}\nmirrorOnly: {profiles: [mysql-operator]}\n",
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(unknown.contains("mirrorOnly.profiles"), "{unknown}");
        assert!(
            unknown.contains("cloudnative-pg"),
            "names the accepted ones: {unknown}"
        );
    }
}
