//! Which slots pinswap may touch: JMESPath filters, the source allowlist,
//! refused addresses and idempotence (docs/architecture.md §3 step 1, §5).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use serde_json::Value;

use super::pod::Slot;
use crate::config::Config;
use crate::metrics::{ErrorCause, Metrics};
use crate::reference::{MirrorTarget, Reference};

/// Why a slot is not decided by the mirror.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Left alone on purpose.
    Keep(String),
    /// Left alone because of an error (denies under `failurePolicy: closed`),
    /// with its kind.
    Error(ErrorCause, String),
}

/// The decision of a container with `imagePullPolicy: Never`.
pub const NEVER_PULLED: &str = "imagePullPolicy is Never: the node must already hold this image under its own name, so it is left unchanged (rewriteImagePullPolicyNever: true rewrites it)";

/// A policy that cannot be compiled from the config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A `source.filters` entry is not a JMESPath expression.
    #[error("source.filters[{index}].jmespath: {reason}")]
    Filter {
        /// Its position in `source.filters`.
        index: usize,
        /// jmespath's error.
        reason: String,
    },
}

/// Why a registry is never contacted as a source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceRefused {
    /// A link-local or metadata address.
    #[error("registry {0} is link-local or a metadata address; never contacted")]
    Metadata(String),
    /// Not in `source.registries`.
    #[error("registry {0} is not in source.registries")]
    NotListed(String),
}

/// The compiled slot policy.
pub struct Policy {
    filters: Vec<(String, jmespath::Expression<'static>)>,
    allowed: HashSet<String>,
    /// The listed registries that are no link-local or metadata address,
    /// as found once here: a slot naming one skips parsing its host again,
    /// which was the largest part of a cached slot's policy check.
    safe: HashSet<String>,
    any: bool,
    target: MirrorTarget,
    /// `rewriteImagePullPolicyNever`.
    rewrite_never: bool,
    /// Where a filter that fails at run time is counted.
    metrics: Option<Arc<Metrics>>,
}

/// Cloud metadata endpoints that a Pod must never make pinswap contact,
/// whatever the allowlist says.
const METADATA_HOSTS: [&str; 3] = ["metadata.google.internal", "metadata", "metadata.azure.com"];

/// Link-local and metadata addresses (the guard's list, but for
/// unspecified, which is no host a Pod can name).
fn refused_ip(ip: IpAddr) -> bool {
    crate::registry::guard::refused_ip(ip).is_some_and(|why| why != "unspecified")
}

/// Whether a registry host is link-local or a known metadata address. The
/// host is parsed as a URL parser (and so reqwest) would: decimal, hex and
/// octal IPv4 forms such as `2852039166` or `0xa9fea9fe` count. Names are
/// not resolved here: [`crate::registry::guard`] checks what they resolve to.
pub fn is_refused_host(registry: &str) -> bool {
    let Ok(url) = url::Url::parse(&format!("http://{registry}/")) else {
        return false;
    };
    match url.host() {
        Some(url::Host::Ipv4(v4)) => refused_ip(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => refused_ip(IpAddr::V6(v6)),
        Some(url::Host::Domain(d)) => {
            METADATA_HOSTS.contains(&d.trim_end_matches('.').to_ascii_lowercase().as_str())
        }
        None => false,
    }
}

impl Policy {
    /// Compiles the config's filters and allowlist.
    ///
    /// # Errors
    /// [`PolicyError::Filter`] naming the filter that does not compile.
    pub fn new(config: &Config, target: MirrorTarget) -> Result<Self, PolicyError> {
        let filters = config
            .source
            .filters
            .iter()
            .enumerate()
            .map(|(i, f)| {
                jmespath::compile(&f.jmespath)
                    .map(|e| (f.jmespath.clone(), e))
                    .map_err(|e| PolicyError::Filter {
                        index: i,
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let any = config.source.registries.iter().any(|r| r.registry == "*");
        let allowed = config
            .source
            .registries
            .iter()
            .map(|r| crate::reference::normalize_registry(&r.registry))
            .collect::<HashSet<_>>();
        let safe = allowed
            .iter()
            .filter(|r| !is_refused_host(r))
            .cloned()
            .collect();
        Ok(Self {
            filters,
            allowed,
            safe,
            any,
            target,
            rewrite_never: config.rewrite_image_pull_policy_never,
            metrics: None,
        })
    }

    /// Counts filters that fail at run time in
    /// `pinswap_admission_errors_total{cause="filter"}`, once per slot.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Whether any filter is configured (filters read each container).
    pub fn has_filters(&self) -> bool {
        !self.filters.is_empty()
    }

    /// The Pod as a JMESPath value, built once per review: filters then
    /// see it without re-serialising it for every slot. `None` without
    /// filters.
    pub fn prepare(&self, pod: &Value) -> Option<jmespath::Rcvar> {
        if self.filters.is_empty() {
            return None;
        }
        jmespath::Variable::from_serializable(pod)
            .ok()
            .map(jmespath::Rcvar::new)
    }

    /// The normalised reference to decide, or why the slot is skipped.
    /// `pod` is [`Policy::prepare`]'s value. A filter that fails at run
    /// time counts as not matching (logged), as in k8s-image-swapper.
    pub fn check(&self, pod: Option<&jmespath::Rcvar>, slot: &Slot) -> Result<Reference, Skip> {
        if let Some(pod) = pod {
            let container = jmespath::Variable::from_serializable(&slot.container)
                .map(jmespath::Rcvar::new)
                .map_err(|e| Skip::Error(ErrorCause::Filter, format!("filter input: {e}")))?;
            let input = jmespath::Rcvar::new(jmespath::Variable::Object(
                [
                    ("obj".to_owned(), pod.clone()),
                    ("container".to_owned(), container),
                ]
                .into(),
            ));
            let mut failed = false;
            for (text, expr) in &self.filters {
                let mut ctx = jmespath::Context::new(text, &jmespath::DEFAULT_RUNTIME);
                match jmespath::interpret(&input, expr.as_ast(), &mut ctx) {
                    Ok(v) if v.as_boolean() == Some(true) => {
                        return Err(Skip::Keep(format!("filter {text:?} matched")));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        failed = true;
                        tracing::warn!(filter = %text, error = %e, "filter failed; treated as not matching")
                    }
                }
            }
            if let (true, Some(m)) = (failed, &self.metrics) {
                m.admission_error(ErrorCause::Filter);
            }
        }
        // The kubelet never pulls such an image: it must already be on the
        // node under the name written, which a rewrite would change.
        if slot.pull_policy.as_deref() == Some("Never") && !self.rewrite_never {
            return Err(Skip::Keep(NEVER_PULLED.into()));
        }
        let reference = Reference::parse(&slot.image)
            .map_err(|e| Skip::Error(ErrorCause::Reference, e.to_string()))?;
        if self.target.contains(&reference) {
            return Err(Skip::Keep("already under the target".into()));
        }
        self.source_allowed(&reference)
            .map_err(|e| Skip::Keep(e.to_string()))?;
        Ok(reference)
    }

    /// Whether `reference`'s registry may be contacted as a source: not a
    /// link-local or metadata address, and in `source.registries` (or `"*"`).
    /// The pull-failure recovery checks Pod annotations with this too.
    ///
    /// # Errors
    /// [`SourceRefused`], saying why not.
    pub fn source_allowed(&self, reference: &Reference) -> Result<(), SourceRefused> {
        if !self.safe.contains(reference.registry()) && is_refused_host(reference.registry()) {
            return Err(SourceRefused::Metadata(reference.registry().to_owned()));
        }
        if !self.any
            && !self.allowed.contains(reference.registry())
            && !self
                .allowed
                .contains(&crate::reference::normalize_registry(reference.registry()))
        {
            return Err(SourceRefused::NotListed(reference.registry().to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn refused_hosts() {
        for h in [
            "169.254.169.254",
            "169.254.1.1:5000",
            "metadata.google.internal",
            "[fe80::1]:5000",
            "[fd00:ec2::254]",
            "100.100.100.200",
            "2852039166:80",
            "0xa9fea9fe:80",
            "0251.0376.0251.0376",
            "[::a9fe:a9fe]",
            "[64:ff9b::a9fe:a9fe]",
            "[::ffff:169.254.169.254]",
            "METADATA.google.internal",
        ] {
            assert!(is_refused_host(h), "{h}");
        }
        for h in [
            "docker.io",
            "127.0.0.1:5000",
            "10.0.0.1",
            "[::1]:5000",
            "ghcr.io",
        ] {
            assert!(!is_refused_host(h), "{h}");
        }
    }

    fn policy(yaml: &str) -> Policy {
        let c = Config::from_yaml(yaml, "t").unwrap();
        Policy::new(&c, MirrorTarget::parse(&c.target.registry).unwrap()).unwrap()
    }

    fn slot(image: &str) -> Slot {
        Slot {
            kind: "containers",
            index: 0,
            name: "c".into(),
            image: image.into(),
            pull_policy: None,
            container: json!({"name": "c", "image": image}),
            key: "containers/c".into(),
        }
    }

    #[test]
    fn checks_in_order() {
        let p = policy(
            "target: {registry: mirror.local/m}\nsource:\n  registries: [{registry: docker.io}, {registry: \"quay.io\"}]\n  filters: [{jmespath: \"obj.metadata.namespace == 'kube-system'\"}]\n",
        );
        let pod_json = json!({"metadata": {"namespace": "default"}});
        let pod = p.prepare(&pod_json);
        let pod = pod.as_ref();
        assert_eq!(
            p.check(pod, &slot("nginx")).unwrap().to_string(),
            "docker.io/library/nginx:latest"
        );
        assert!(p.check(pod, &slot("quay.io/a/b:1")).is_ok());
        assert!(
            matches!(p.check(pod, &slot("ghcr.io/a/b:1")), Err(Skip::Keep(m)) if m.contains("not in source.registries"))
        );
        assert!(
            matches!(p.check(pod, &slot("mirror.local/m/docker.io/library/nginx:1")), Err(Skip::Keep(m)) if m == "already under the target")
        );
        assert!(matches!(
            p.check(pod, &slot("Bad/Image:x")),
            Err(Skip::Error(ErrorCause::Reference, _))
        ));
        let sys = p.prepare(&json!({"metadata": {"namespace": "kube-system"}}));
        assert!(
            matches!(p.check(sys.as_ref(), &slot("nginx")), Err(Skip::Keep(m)) if m.contains("matched"))
        );
        // A filter that fails at run time does not match.
        let bad = policy(
            "target: {registry: mirror.local}\nsource:\n  registries: [{registry: docker.io}]\n  filters: [{jmespath: \"abs(obj.metadata.name)\"}]\n",
        );
        let named = bad.prepare(&json!({"metadata": {"name": "p"}}));
        assert!(bad.check(named.as_ref(), &slot("nginx")).is_ok());
        // Config entries are normalised like references.
        let hub = policy(
            "target: {registry: mirror.local}\nsource: {registries: [{registry: index.docker.io}, {registry: Quay.IO}]}\n",
        );
        assert!(hub.check(None, &slot("nginx")).is_ok());
        assert!(hub.check(None, &slot("quay.io/a/b:1")).is_ok());
        // A registry written otherwise than listed is normalised to match.
        assert!(hub.check(None, &slot("Quay.IO/a/b:1")).is_ok());
        let any =
            policy("target: {registry: mirror.local}\nsource: {registries: [{registry: \"*\"}]}\n");
        assert!(any.check(None, &slot("ghcr.io/a/b:1")).is_ok());
        assert!(
            matches!(any.check(None, &slot("169.254.169.254/x:1")), Err(Skip::Keep(m)) if m.contains("never contacted"))
        );
        // Listing a metadata address does not make it a source: only the
        // listed registries found safe skip the host check.
        let listed = policy(
            "target: {registry: mirror.local}\nsource: {registries: [{registry: \"169.254.169.254\"}, {registry: \"0xa9fea9fe:80\"}, {registry: quay.io}]}\n",
        );
        for image in ["169.254.169.254/x:1", "0xa9fea9fe:80/x:1"] {
            assert!(
                matches!(listed.check(None, &slot(image)), Err(Skip::Keep(m)) if m.contains("never contacted")),
                "{image}"
            );
        }
        assert!(listed.check(None, &slot("quay.io/a/b:1")).is_ok());
        assert_eq!(listed.safe, HashSet::from(["quay.io".to_owned()]));
    }

    #[test]
    fn never_pulled_containers_are_kept_unless_opted_in() {
        let never = Slot {
            pull_policy: Some("Never".into()),
            ..slot("nginx:1")
        };
        let if_not_present = Slot {
            pull_policy: Some("IfNotPresent".into()),
            ..slot("nginx:1")
        };
        let p = policy("target: {registry: mirror.local}\n");
        assert_eq!(p.check(None, &never), Err(Skip::Keep(NEVER_PULLED.into())));
        assert!(p.check(None, &if_not_present).is_ok());
        let opted = policy("target: {registry: mirror.local}\nrewriteImagePullPolicyNever: true\n");
        assert!(opted.check(None, &never).is_ok());
    }
}
