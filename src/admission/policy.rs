//! Which slots pinswap may touch: JMESPath filters, the source allowlist,
//! refused addresses and idempotence (DESIGN.md §3 step 1, §5).

use std::net::IpAddr;

use serde_json::Value;

use super::pod::Slot;
use crate::config::Config;
use crate::reference::{MirrorTarget, Reference};

/// Why a slot is not decided by the mirror.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Left alone on purpose.
    Keep(String),
    /// Left alone because of an error (denies under `failurePolicy: closed`).
    Error(String),
}

/// The compiled slot policy.
pub struct Policy {
    filters: Vec<(String, jmespath::Expression<'static>)>,
    allowed: Vec<String>,
    any: bool,
    target: MirrorTarget,
}

/// Cloud metadata endpoints that a Pod must never make pinswap contact,
/// whatever the allowlist says.
const METADATA_HOSTS: [&str; 3] = ["metadata.google.internal", "metadata", "metadata.azure.com"];

/// Whether a registry host is link-local or a known metadata address.
pub fn is_refused_host(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.ends_with(':') => h,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if METADATA_HOSTS.contains(&host.to_ascii_lowercase().as_str()) {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_link_local() || v4.octets() == [100, 100, 100, 200],
        Ok(IpAddr::V6(v6)) => {
            (v6.segments()[0] & 0xffc0) == 0xfe80
                || v6
                    == "fd00:ec2::254"
                        .parse::<std::net::Ipv6Addr>()
                        .expect("literal")
                || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_link_local())
        }
        Err(_) => false,
    }
}

impl Policy {
    /// Compiles the config's filters and allowlist.
    ///
    /// # Errors
    /// A message naming the filter that does not compile.
    pub fn new(config: &Config, target: MirrorTarget) -> Result<Self, String> {
        let filters = config
            .source
            .filters
            .iter()
            .enumerate()
            .map(|(i, f)| {
                jmespath::compile(&f.jmespath)
                    .map(|e| (f.jmespath.clone(), e))
                    .map_err(|e| format!("source.filters[{i}].jmespath: {e}"))
            })
            .collect::<Result<_, _>>()?;
        let any = config.source.registries.iter().any(|r| r.registry == "*");
        let allowed = config
            .source
            .registries
            .iter()
            .map(|r| r.registry.to_ascii_lowercase())
            .collect();
        Ok(Self {
            filters,
            allowed,
            any,
            target,
        })
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
                .map_err(|e| Skip::Error(format!("filter input: {e}")))?;
            let input = jmespath::Rcvar::new(jmespath::Variable::Object(
                [
                    ("obj".to_owned(), pod.clone()),
                    ("container".to_owned(), container),
                ]
                .into(),
            ));
            for (text, expr) in &self.filters {
                let mut ctx = jmespath::Context::new(text, &jmespath::DEFAULT_RUNTIME);
                match jmespath::interpret(&input, expr.as_ast(), &mut ctx) {
                    Ok(v) if v.as_boolean() == Some(true) => {
                        return Err(Skip::Keep(format!("filter {text:?} matched")));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(filter = %text, error = %e, "filter failed; treated as not matching")
                    }
                }
            }
        }
        let reference = Reference::parse(&slot.image).map_err(|e| Skip::Error(e.to_string()))?;
        if self.target.contains(&reference) {
            return Err(Skip::Keep("already under the target".into()));
        }
        if is_refused_host(reference.registry()) {
            return Err(Skip::Keep(format!(
                "registry {} is link-local or a metadata address; never contacted",
                reference.registry()
            )));
        }
        let registry = reference.registry().to_ascii_lowercase();
        if !self.any && !self.allowed.contains(&registry) {
            return Err(Skip::Keep(format!(
                "registry {} is not in source.registries",
                reference.registry()
            )));
        }
        Ok(reference)
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
            container: json!({"name": "c", "image": image}),
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
            Err(Skip::Error(_))
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
        let any =
            policy("target: {registry: mirror.local}\nsource: {registries: [{registry: \"*\"}]}\n");
        assert!(any.check(None, &slot("ghcr.io/a/b:1")).is_ok());
        assert!(
            matches!(any.check(None, &slot("169.254.169.254/x:1")), Err(Skip::Keep(m)) if m.contains("never contacted"))
        );
    }
}
