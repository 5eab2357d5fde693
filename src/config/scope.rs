//! `scope`: which Pods pinswap handles, beyond the built-in exclusions
//! (docs/configuration.md#scope). The webhook's `namespaceSelector` and
//! `objectSelector` are rendered from it, and the leader's watches apply
//! it ([`crate::admission::scope`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Label selectors added to the built-in exclusions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {namespaceSelector: {matchLabels: {team: web}}}"
)]
pub struct Scope {
    /// Namespaces whose Pods pinswap handles, by their labels.
    #[serde(default)]
    pub namespace_selector: LabelSelector,
    /// Pods (and workload templates) pinswap handles, by their labels.
    #[serde(default)]
    pub object_selector: LabelSelector,
}

/// A Kubernetes label selector, as a webhook's selectors take it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a label selector such as {matchLabels: {app: web}}"
)]
pub struct LabelSelector {
    /// Each label must have this value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Each requirement must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

/// One `matchExpressions` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {key: app, operator: In, values: [web]}"
)]
pub struct Requirement {
    /// The label key.
    pub key: String,
    /// How its value is compared.
    pub operator: Operator,
    /// For `In` and `NotIn`; none for `Exists` and `DoesNotExist`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// A `matchExpressions` operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Operator {
    /// The label is set to one of the values.
    In,
    /// The label is unset, or set to none of the values.
    NotIn,
    /// The label is set.
    Exists,
    /// The label is unset.
    DoesNotExist,
}

impl<'de> Deserialize<'de> for Operator {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const WORDS: &[&str] = &["In", "NotIn", "Exists", "DoesNotExist"];
        Ok([Self::In, Self::NotIn, Self::Exists, Self::DoesNotExist][super::word(d, WORDS)?])
    }
}

impl Operator {
    /// As Kubernetes writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::In => "In",
            Self::NotIn => "NotIn",
            Self::Exists => "Exists",
            Self::DoesNotExist => "DoesNotExist",
        }
    }
}

impl Scope {
    /// The problems of this block, at key path `path`: what the API server
    /// would refuse in a webhook's selectors.
    pub(super) fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        for (key, s) in [
            ("namespaceSelector", &self.namespace_selector),
            ("objectSelector", &self.object_selector),
        ] {
            s.problems(&format!("{path}.{key}"), bad);
        }
    }
}

impl LabelSelector {
    pub(super) fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        for (k, v) in &self.match_labels {
            let at = format!("{path}.matchLabels.{k}");
            if let Err(why) = label_key(k) {
                bad(at.clone(), why);
            }
            if let Err(why) = label_value(v) {
                bad(at, why);
            }
        }
        for (i, r) in self.match_expressions.iter().enumerate() {
            let at = format!("{path}.matchExpressions[{i}]");
            if let Err(why) = label_key(&r.key) {
                bad(format!("{at}.key"), why);
            }
            let wants_values = matches!(r.operator, Operator::In | Operator::NotIn);
            if wants_values && r.values.is_empty() {
                bad(
                    format!("{at}.values"),
                    format!("missing; {} needs at least one value", r.operator.as_str()),
                );
            }
            if !wants_values && !r.values.is_empty() {
                bad(
                    format!("{at}.values"),
                    format!(
                        "found {:?}; {} takes no values",
                        r.values,
                        r.operator.as_str()
                    ),
                );
            }
            for (j, v) in r.values.iter().enumerate() {
                if let Err(why) = label_value(v) {
                    bad(format!("{at}.values[{j}]"), why);
                }
            }
        }
    }
}

/// A label name: up to 63 characters, alphanumeric at both ends, `-`, `_`
/// and `.` between.
fn label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name.
pub(super) fn label_key(k: &str) -> Result<(), String> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if prefix.is_some_and(|p| !super::is_dns_subdomain(p)) || !label_name(name) {
        return Err(format!(
            "found label key {k:?}, expected [PREFIX/]NAME: a DNS subdomain as the prefix, and a name of up to 63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
        ));
    }
    Ok(())
}

/// A label value: empty, or a label name.
fn label_value(v: &str) -> Result<(), String> {
    if v.is_empty() || label_name(v) {
        return Ok(());
    }
    Err(format!(
        "found label value {v:?}, expected up to 63 letters, digits, '-', '_' or '.', alphanumeric at both ends (or empty)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(yaml: &str) -> Vec<String> {
        let s: Scope = yaml_serde::from_str(yaml).unwrap();
        let mut out = Vec::new();
        s.problems("scope", &mut |p, m| out.push(format!("{p}: {m}")));
        out
    }

    #[test]
    fn selectors_are_checked_as_the_api_server_checks_them() {
        assert!(problems("namespaceSelector: {matchLabels: {team: a, example.com/tier: ''}}\nobjectSelector: {matchExpressions: [{key: app, operator: Exists}, {key: tier, operator: In, values: [web]}]}").is_empty());
        let got = problems(
            "namespaceSelector: {matchLabels: {'-x': a}, matchExpressions: [{key: t, operator: In}, {key: u, operator: Exists, values: [a]}, {key: v, operator: NotIn, values: ['a b']}]}",
        );
        assert_eq!(got.len(), 4, "{got:#?}");
        assert!(got[0].starts_with("scope.namespaceSelector.matchLabels.-x: found label key"));
        assert_eq!(
            got[1],
            "scope.namespaceSelector.matchExpressions[0].values: missing; In needs at least one value"
        );
        assert!(got[2].contains("Exists takes no values"), "{}", got[2]);
        assert!(got[3].starts_with(
            "scope.namespaceSelector.matchExpressions[2].values[0]: found label value \"a b\""
        ));
    }

    #[test]
    fn unknown_keys_and_operators_are_refused() {
        assert!(yaml_serde::from_str::<Scope>("namespaceSelector: {matchLabel: {a: b}}").is_err());
        assert!(
            yaml_serde::from_str::<Scope>(
                "objectSelector: {matchExpressions: [{key: a, operator: Gt}]}"
            )
            .is_err()
        );
    }
}
