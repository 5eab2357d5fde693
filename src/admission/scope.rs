//! Which Pods pinswap handles: those the API server sends to the webhook.
//! Never pinswap's own namespace or `kube-system`, nor a namespace or a Pod
//! labelled `pinswap.dev/ignore=true`; and within the config's `scope`
//! selectors. The webhook's `namespaceSelector` and `objectSelector`
//! (`pinswap manifests`, the chart) and the leader's watches (backfill,
//! recovery, eviction) are all made from [`Scope`], so they cannot drift.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::core::{Selector, SelectorExt};

/// Label that opts a namespace or a Pod out of the webhook.
pub const IGNORE_LABEL: &str = "pinswap.dev/ignore";

/// The label the API server sets on every namespace: its name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Namespaces never handled besides pinswap's own: Kubernetes' own Pods
/// there must start even when pinswap cannot answer.
pub const SYSTEM_NAMESPACES: [&str; 1] = ["kube-system"];

/// The webhook's selectors, rendered and compiled.
#[derive(Debug, Clone)]
pub struct Scope {
    namespace_selector: LabelSelector,
    object_selector: LabelSelector,
    namespaces: Selector,
    objects: Selector,
}

fn not_in(key: &str, values: &[&str]) -> LabelSelectorRequirement {
    LabelSelectorRequirement {
        key: key.to_owned(),
        operator: "NotIn".into(),
        values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
    }
}

/// The built-in `requirements`, then the config's selector.
pub(super) fn selector(
    mut requirements: Vec<LabelSelectorRequirement>,
    config: &crate::config::LabelSelector,
) -> LabelSelector {
    requirements.extend(
        config
            .match_expressions
            .iter()
            .map(|r| LabelSelectorRequirement {
                key: r.key.clone(),
                operator: r.operator.as_str().into(),
                values: (!r.values.is_empty()).then(|| r.values.clone()),
            }),
    );
    LabelSelector {
        match_labels: (!config.match_labels.is_empty()).then(|| config.match_labels.clone()),
        match_expressions: Some(requirements),
    }
}

/// The config's label selector compiled; `None` when it is empty (it
/// selects everything). One that does not compile selects nothing.
pub fn label_selector(config: &crate::config::LabelSelector) -> Option<Selector> {
    if config.match_labels.is_empty() && config.match_expressions.is_empty() {
        return None;
    }
    Some(compiled(&selector(Vec::new(), config)))
}

/// A selector the config validated; one that does not compile selects
/// nothing, so a check that was skipped never widens the scope.
fn compiled(s: &LabelSelector) -> Selector {
    Selector::try_from(s.clone()).unwrap_or_else(|_| {
        std::iter::once(kube::core::Expression::In(
            NAMESPACE_NAME_LABEL.into(),
            Default::default(),
        ))
        .collect()
    })
}

impl Scope {
    /// The scope of an install in namespace `own` with the config's
    /// `scope` selectors.
    pub fn new(config: &crate::config::Scope, own: &str) -> Self {
        let excluded: Vec<&str> = std::iter::once(own).chain(SYSTEM_NAMESPACES).collect();
        let namespace_selector = selector(
            vec![
                not_in(NAMESPACE_NAME_LABEL, &excluded),
                not_in(IGNORE_LABEL, &["true"]),
            ],
            &config.namespace_selector,
        );
        let object_selector = selector(
            vec![not_in(IGNORE_LABEL, &["true"])],
            &config.object_selector,
        );
        Self {
            namespaces: compiled(&namespace_selector),
            objects: compiled(&object_selector),
            namespace_selector,
            object_selector,
        }
    }

    /// The webhook's `namespaceSelector`.
    pub fn namespace_selector(&self) -> &LabelSelector {
        &self.namespace_selector
    }

    /// The webhook's `objectSelector`.
    pub fn object_selector(&self) -> &LabelSelector {
        &self.object_selector
    }

    /// Whether the webhook is sent the Pods of namespace `name`, labelled
    /// `labels`. The API server labels every namespace with its name; that
    /// label is taken from `name`, so a namespace read without it is judged
    /// the same.
    pub fn admits_namespace(&self, name: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        let mut labels = labels.cloned().unwrap_or_default();
        labels.insert(NAMESPACE_NAME_LABEL.to_owned(), name.to_owned());
        self.namespaces.matches(&labels)
    }

    /// Whether the webhook is sent a Pod labelled `labels` (for a workload,
    /// its template's labels: those of the Pods it makes).
    pub fn admits_object(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        match labels {
            Some(l) => self.objects.matches(l),
            None => self.objects.matches(&BTreeMap::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn config(yaml: &str) -> crate::config::Scope {
        yaml_serde::from_str(yaml).unwrap()
    }

    #[test]
    fn the_built_in_exclusions() {
        let s = Scope::new(&crate::config::Scope::default(), "mirror");
        let ns = |name: &str, kv: &[(&str, &str)]| s.admits_namespace(name, Some(&labels(kv)));
        assert!(ns("shop", &[]));
        assert!(!ns("mirror", &[]), "pinswap's own");
        assert!(!ns("kube-system", &[]));
        assert!(!ns("quiet", &[(IGNORE_LABEL, "true")]));
        assert!(ns("loud", &[(IGNORE_LABEL, "false")]));
        assert!(s.admits_object(None));
        assert!(!s.admits_object(Some(&labels(&[(IGNORE_LABEL, "true")]))));
        let rendered = serde_json::to_value(s.namespace_selector()).unwrap();
        assert_eq!(
            rendered,
            serde_json::json!({"matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": ["mirror", "kube-system"]},
                {"key": IGNORE_LABEL, "operator": "NotIn", "values": ["true"]}
            ]})
        );
    }

    #[test]
    fn the_configs_selectors_narrow_it() {
        let s = Scope::new(
            &config(
                "namespaceSelector: {matchLabels: {mirror: 'on'}}\nobjectSelector: {matchExpressions: [{key: app, operator: Exists}, {key: tier, operator: NotIn, values: [db]}]}",
            ),
            "pinswap",
        );
        assert!(s.admits_namespace("shop", Some(&labels(&[("mirror", "on")]))));
        assert!(!s.admits_namespace("shop", None));
        assert!(!s.admits_namespace("pinswap", Some(&labels(&[("mirror", "on")]))));
        assert!(s.admits_object(Some(&labels(&[("app", "web")]))));
        assert!(!s.admits_object(Some(&labels(&[("app", "db"), ("tier", "db")]))));
        assert!(!s.admits_object(None));
        assert_eq!(
            serde_json::to_value(s.object_selector()).unwrap(),
            serde_json::json!({"matchExpressions": [
                {"key": IGNORE_LABEL, "operator": "NotIn", "values": ["true"]},
                {"key": "app", "operator": "Exists"},
                {"key": "tier", "operator": "NotIn", "values": ["db"]}
            ]})
        );
        assert_eq!(
            serde_json::to_value(s.namespace_selector()).unwrap()["matchLabels"],
            serde_json::json!({"mirror": "on"})
        );
    }
}
