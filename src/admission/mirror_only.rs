//! Which Pods are mirrored but admitted as written (`mirrorOnly`): the
//! config's entries and the operator profiles, compiled once.
//!
//! Each profile names the Pods an operator compares with its own spec and
//! recreates when their image differs, read from that operator's source:
//! - `cloudnative-pg`: instance Pods, labelled `cnpg.io/podRole=instance`
//!   (`pkg/specs/pods.go`, `buildInstance`) and controlled by their
//!   `postgresql.cnpg.io` `Cluster`; `isPodNeedingRollout` in
//!   `internal/controller/cluster_upgrade.go` compares the `postgres` and
//!   `bootstrap-controller` images with the wanted ones and deletes the Pod.
//! - `postgres-operator` (Zalando): Spilo Pods, labelled `application=spilo`
//!   and `cluster-name` (the operator's default `cluster_labels` and
//!   `cluster_name_label`, `pkg/cluster/util.go` `labelsSet`), controlled
//!   by a StatefulSet; `syncStatefulSet` in `pkg/cluster/sync.go` compares
//!   the Pod's `postgres` image with the StatefulSet's and recreates it.
//! - `aerospike`: Pods labelled `app=aerospike-cluster` and
//!   `aerospike.com/cr` (`pkg/utils/utils.go`
//!   `LabelsForAerospikeClusterRack`), controlled by a StatefulSet per rack;
//!   `isPodOnDesiredImage` in `internal/controller/cluster/statefulset.go`
//!   requires each container's registry and image to equal the spec's.

use std::collections::BTreeMap;

use kube::core::{Selector, SelectorExt};
use serde_json::Value;

use crate::config::{LabelSelector, Operator, PodMatch, Profile, Requirement};

/// One compiled entry.
struct Rule {
    /// How logs and reports name it: `profile cloudnative-pg`,
    /// `mirrorOnly.pods[0]`.
    name: String,
    namespaces: Vec<String>,
    selector: Option<Selector>,
    /// `(group, kind)`; `None` group: any.
    owner_kinds: Vec<(Option<String>, String)>,
    jmespath: Option<(String, jmespath::Expression<'static>)>,
}

/// The `mirrorOnly` rules.
#[derive(Default)]
pub struct MirrorOnly {
    rules: Vec<Rule>,
}

impl std::fmt::Debug for MirrorOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.rules.iter().map(|r| &r.name))
            .finish()
    }
}

fn exists(key: &str) -> Requirement {
    Requirement {
        key: key.into(),
        operator: Operator::Exists,
        values: Vec::new(),
    }
}

fn is(key: &str, value: &str) -> Requirement {
    Requirement {
        key: key.into(),
        operator: Operator::In,
        values: vec![value.into()],
    }
}

/// What a profile matches (see the module's doc for where each comes from).
pub fn profile(p: Profile) -> PodMatch {
    let (expressions, owner) = match p {
        Profile::CloudnativePg => (
            vec![is("cnpg.io/podRole", "instance"), exists("cnpg.io/cluster")],
            "postgresql.cnpg.io/Cluster",
        ),
        Profile::PostgresOperator => (
            vec![is("application", "spilo"), exists("cluster-name")],
            "apps/StatefulSet",
        ),
        Profile::Aerospike => (
            vec![is("app", "aerospike-cluster"), exists("aerospike.com/cr")],
            "apps/StatefulSet",
        ),
    };
    PodMatch {
        pod_selector: LabelSelector {
            match_labels: BTreeMap::new(),
            match_expressions: expressions,
        },
        owner_kinds: vec![owner.into()],
        ..PodMatch::default()
    }
}

impl MirrorOnly {
    /// Compiles the config's `mirrorOnly` (validated when it loaded: an
    /// entry that still does not compile matches nothing).
    pub fn new(config: &crate::config::MirrorOnly) -> Self {
        let entries = config
            .profiles
            .iter()
            .map(|p| (format!("profile {}", p.as_str()), profile(*p)))
            .chain(
                config
                    .pods
                    .iter()
                    .enumerate()
                    .map(|(i, m)| (format!("mirrorOnly.pods[{i}]"), m.clone())),
            );
        let rules = entries
            .filter_map(|(name, m)| {
                let selector = match m.pod_selector.match_labels.is_empty()
                    && m.pod_selector.match_expressions.is_empty()
                {
                    true => None,
                    false => Some(
                        Selector::try_from(super::scope::selector(Vec::new(), &m.pod_selector))
                            .ok()?,
                    ),
                };
                let jmespath = match &m.jmespath {
                    Some(text) => Some((text.clone(), jmespath::compile(text).ok()?)),
                    None => None,
                };
                let owner_kinds = m
                    .owner_kinds
                    .iter()
                    .map(|k| match k.rsplit_once('/') {
                        Some((g, k)) => (Some(g.to_owned()), k.to_owned()),
                        None => (None, k.clone()),
                    })
                    .collect();
                Some(Rule {
                    name,
                    namespaces: m.namespaces,
                    selector,
                    owner_kinds,
                    jmespath,
                })
            })
            .collect();
        Self { rules }
    }

    /// Whether no Pod is mirrored only.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The first rule `pod` (a Pod, or a workload's template as the Pod it
    /// makes) in `namespace` matches, by name.
    pub fn matches(&self, pod: &Value, namespace: &str) -> Option<&str> {
        if self.rules.is_empty() {
            return None;
        }
        let labels: BTreeMap<String, String> = pod
            .pointer("/metadata/labels")
            .and_then(|l| serde_json::from_value(l.clone()).ok())
            .unwrap_or_default();
        let controller = pod
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .and_then(|o| {
                o.iter()
                    .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
            });
        let owner = controller.map(|r| {
            let api = r.get("apiVersion").and_then(Value::as_str).unwrap_or("");
            let group = api.rsplit_once('/').map_or("", |(g, _)| g);
            let kind = r.get("kind").and_then(Value::as_str).unwrap_or("");
            (group.to_owned(), kind.to_owned())
        });
        let mut prepared = None;
        self.rules
            .iter()
            .find(|r| {
                (r.namespaces.is_empty() || r.namespaces.iter().any(|n| n == namespace))
                    && r.selector.as_ref().is_none_or(|s| s.matches(&labels))
                    && (r.owner_kinds.is_empty()
                        || owner.as_ref().is_some_and(|(g, k)| {
                            r.owner_kinds
                                .iter()
                                .any(|(wg, wk)| wk == k && wg.as_ref().is_none_or(|wg| wg == g))
                        }))
                    && r.jmespath.as_ref().is_none_or(|(_, e)| {
                        let input = prepared.get_or_insert_with(|| {
                            jmespath::Variable::from_serializable(serde_json::json!({ "obj": pod }))
                                .map(jmespath::Rcvar::new)
                                .ok()
                        });
                        input.as_ref().is_some_and(|i| {
                            e.search(i)
                                .is_ok_and(|v| *v == jmespath::Variable::Bool(true))
                        })
                    })
            })
            .map(|r| r.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn all_profiles() -> MirrorOnly {
        MirrorOnly::new(&crate::config::MirrorOnly {
            profiles: Profile::ALL.to_vec(),
            pods: Vec::new(),
        })
    }

    fn pod(labels: Value, owner: (&str, &str)) -> Value {
        json!({"metadata": {
            "name": "p", "labels": labels,
            "ownerReferences": [{"apiVersion": owner.0, "kind": owner.1, "name": "o", "uid": "u", "controller": true}]
        }})
    }

    /// Pods shaped as each operator creates them (labels and controller
    /// from its source, see the module's doc), and their neighbours that
    /// the operator does not compare.
    #[test]
    fn each_profile_matches_its_operators_pods_only() {
        let m = all_profiles();
        let cnpg = json!({
            "cnpg.io/cluster": "pg", "cnpg.io/instanceName": "pg-1", "cnpg.io/podRole": "instance",
            "app.kubernetes.io/managed-by": "cloudnative-pg", "cnpg.io/instanceRole": "primary"
        });
        let spilo = json!({"application": "spilo", "cluster-name": "acid-main", "team": "acid", "spilo-role": "master"});
        let aero = json!({"app": "aerospike-cluster", "aerospike.com/cr": "aero", "aerospike.com/rack-id": "0"});
        let cases = [
            (
                pod(cnpg.clone(), ("postgresql.cnpg.io/v1", "Cluster")),
                Some("profile cloudnative-pg"),
            ),
            (
                pod(spilo, ("apps/v1", "StatefulSet")),
                Some("profile postgres-operator"),
            ),
            (
                pod(aero, ("apps/v1", "StatefulSet")),
                Some("profile aerospike"),
            ),
            // CloudNativePG's initdb Job and its pooler: not compared.
            (
                pod(
                    json!({"cnpg.io/cluster": "pg", "cnpg.io/jobRole": "initdb"}),
                    ("batch/v1", "Job"),
                ),
                None,
            ),
            (
                pod(
                    json!({"cnpg.io/cluster": "pg", "cnpg.io/podRole": "pooler"}),
                    ("apps/v1", "ReplicaSet"),
                ),
                None,
            ),
            // The same labels under another controller: not the operator's.
            (pod(cnpg, ("apps/v1", "StatefulSet")), None),
            // Zalando's connection pooler and logical backup.
            (
                pod(
                    json!({"application": "db-connection-pooler", "connection-pooler": "acid-main-pooler"}),
                    ("apps/v1", "ReplicaSet"),
                ),
                None,
            ),
            (
                pod(
                    json!({"application": "spilo-logical-backup"}),
                    ("batch/v1", "Job"),
                ),
                None,
            ),
            (pod(json!({"app": "web"}), ("apps/v1", "ReplicaSet")), None),
        ];
        for (p, want) in cases {
            assert_eq!(m.matches(&p, "db"), want, "{p}");
        }
        let none = MirrorOnly::new(&Default::default());
        assert!(
            none.matches(&pod(json!({}), ("apps/v1", "ReplicaSet")), "db")
                .is_none()
        );
    }

    #[test]
    fn every_condition_of_an_entry_must_hold() {
        let config: crate::config::MirrorOnly = yaml_serde::from_str(
            "pods:\n- namespaces: [payments]\n  podSelector: {matchLabels: {app: ledger}}\n  ownerKinds: [StatefulSet]\n  jmespath: \"obj.metadata.name == 'p'\"\n- ownerKinds: [example.com/Thing]\n",
        )
        .unwrap();
        let m = MirrorOnly::new(&config);
        let ledger = pod(json!({"app": "ledger"}), ("apps/v1", "StatefulSet"));
        assert_eq!(m.matches(&ledger, "payments"), Some("mirrorOnly.pods[0]"));
        assert_eq!(m.matches(&ledger, "shop"), None, "namespace");
        let other = pod(json!({"app": "web"}), ("apps/v1", "StatefulSet"));
        assert_eq!(m.matches(&other, "payments"), None, "labels");
        let mut renamed = ledger.clone();
        renamed["metadata"]["name"] = json!("q");
        assert_eq!(m.matches(&renamed, "payments"), None, "jmespath");
        let thing = pod(json!({}), ("example.com/v1alpha1", "Thing"));
        assert_eq!(m.matches(&thing, "any"), Some("mirrorOnly.pods[1]"));
        let other_group = pod(json!({}), ("other.io/v1", "Thing"));
        assert_eq!(m.matches(&other_group, "any"), None, "group");
        let uncontrolled = json!({"metadata": {"labels": {"app": "ledger"}}});
        assert_eq!(m.matches(&uncontrolled, "payments"), None, "no controller");
    }
}
