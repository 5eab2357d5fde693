//! HTTP proxies for the registry clients (docs/security.md "Proxies").
//!
//! `HTTPS_PROXY`, `HTTP_PROXY` and `NO_PROXY` (each also in lowercase; the
//! uppercase one wins) are read here, once, rather than by reqwest on its
//! own, so the outbound guard stays in front of the proxy:
//! - every connection's destination is resolved here and checked before
//!   the proxy is asked to reach it; a name that does not resolve here is
//!   refused ([`Guard::destinations`]);
//! - the proxy's own address is checked like a registry's (a literal when
//!   the client is built, a name when it is resolved); it may be loopback
//!   or private, since the environment names it, not a Pod.
//!
//! `ALL_PROXY` and SOCKS proxies are not used.

use super::guard::{Guard, Refused};

/// Why the proxy settings cannot be used. Values are never echoed: a proxy
/// URL may carry credentials.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    /// Not an `http://` or `https://` URL with a host.
    #[error(
        "{var}: {reason}; expected http://[user:password@]host[:port] (the value is not shown, it may hold credentials)"
    )]
    Invalid {
        /// The environment variable.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The proxy is at an address the guard refuses.
    #[error("{var}: the proxy {refused}")]
    Refused {
        /// The environment variable.
        var: &'static str,
        /// The refusal.
        refused: Refused,
    },
}

/// One proxy: the variable that named it and its URL.
#[derive(Clone)]
struct Proxy {
    var: &'static str,
    url: url::Url,
}

/// The URL without its password: `Proxies` is in the pool's options, whose
/// `Debug` may end up in a log.
impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut url = self.url.clone();
        if url.password().is_some() {
            // Fails only for URLs that cannot carry a password at all.
            let _ = url.set_password(Some("redacted"));
        }
        write!(f, "{}={url}", self.var)
    }
}

/// The proxies the registry clients use. The default is none.
#[derive(Debug, Clone, Default)]
pub struct Proxies {
    https: Option<Proxy>,
    http: Option<Proxy>,
    /// `NO_PROXY` in reqwest's syntax (names, `.suffix`, `*`, addresses
    /// and CIDR blocks), from [`no_proxy_hosts`].
    no_proxy: Option<String>,
}

impl Proxies {
    /// The proxies the process environment names.
    ///
    /// # Errors
    /// [`ProxyError::Invalid`] naming the variable.
    pub fn from_env() -> Result<Self, ProxyError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The proxies `get` names (`get("HTTPS_PROXY")` and so on); an empty
    /// value counts as unset.
    ///
    /// # Errors
    /// As [`Proxies::from_env`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, ProxyError> {
        let read = |upper: &'static str, lower: &'static str| {
            [upper, lower]
                .into_iter()
                .find_map(|var| get(var).filter(|v| !v.trim().is_empty()).map(|v| (var, v)))
        };
        let proxy = |upper, lower| {
            read(upper, lower)
                .map(|(var, value)| parse(var, value.trim()))
                .transpose()
        };
        Ok(Self {
            https: proxy("HTTPS_PROXY", "https_proxy")?,
            http: proxy("HTTP_PROXY", "http_proxy")?,
            no_proxy: read("NO_PROXY", "no_proxy").map(|(_, v)| no_proxy_hosts(&v)),
        })
    }

    /// Whether any proxy is set.
    pub fn is_set(&self) -> bool {
        self.https.is_some() || self.http.is_some()
    }

    /// `guard`, also allowing the proxies' hosts loopback and private
    /// addresses as proxies (not as registries or redirect targets); a
    /// proxy given as a refused literal is refused here.
    ///
    /// # Errors
    /// [`ProxyError::Refused`].
    pub fn guard(&self, guard: &Guard) -> Result<Guard, ProxyError> {
        let mut guard = guard.clone();
        for p in self.https.iter().chain(&self.http) {
            let host = p.url.host_str().unwrap_or_default();
            guard = guard.allowing_proxy(host);
            guard
                .check_proxy_url(&p.url)
                .map_err(|refused| ProxyError::Refused {
                    var: p.var,
                    refused,
                })?;
        }
        Ok(guard)
    }

    /// `builder` with these proxies and no other (reqwest's own reading of
    /// the environment is turned off), each connection's destination
    /// checked by `guard` first ([`Guard::destinations`]). `guard` is the one
    /// [`Proxies::guard`] gave.
    ///
    /// # Errors
    /// [`ProxyError::Invalid`] when reqwest does not take a proxy URL.
    pub fn apply(
        &self,
        builder: reqwest::ClientBuilder,
        guard: &Guard,
    ) -> Result<reqwest::ClientBuilder, ProxyError> {
        let mut builder = builder.no_proxy();
        let no_proxy = || {
            self.no_proxy
                .as_deref()
                .and_then(reqwest::NoProxy::from_string)
        };
        let invalid = |var, e: reqwest::Error| ProxyError::Invalid {
            var,
            reason: super::chain(&e.without_url()),
        };
        if let Some(p) = &self.https {
            let proxy = reqwest::Proxy::https(p.url.as_str()).map_err(|e| invalid(p.var, e))?;
            builder = builder.proxy(proxy.no_proxy(no_proxy()));
        }
        if let Some(p) = &self.http {
            let proxy = reqwest::Proxy::http(p.url.as_str()).map_err(|e| invalid(p.var, e))?;
            builder = builder.proxy(proxy.no_proxy(no_proxy()));
        }
        Ok(builder.connector_layer(guard.destinations(self.is_set())))
    }
}

/// `NO_PROXY` with each entry's port and IPv6 brackets dropped
/// (`registry.internal:5000` → `registry.internal`, `[fd00::5]:443` →
/// `fd00::5`): reqwest takes such entries for names that never match, so
/// the registry would go through the proxy. The host then matches on every
/// port.
fn no_proxy_hosts(value: &str) -> String {
    value
        .split(',')
        .map(|part| {
            let part = part.trim();
            if let Some((addr, after)) = part.strip_prefix('[').and_then(|r| r.split_once(']')) {
                // `[fd00::]/8` keeps its prefix length.
                return match after.strip_prefix('/') {
                    Some(bits) => format!("{addr}/{bits}"),
                    None => addr.to_owned(),
                };
            }
            match part.split_once(':') {
                Some((host, port))
                    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    host.to_owned()
                }
                _ => part.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A proxy URL; `host:port` alone means `http://host:port`, as curl reads it.
fn parse(var: &'static str, value: &str) -> Result<Proxy, ProxyError> {
    let invalid = |reason: &str| ProxyError::Invalid {
        var,
        reason: reason.to_owned(),
    };
    let text = match value.contains("://") {
        true => value.to_owned(),
        false => format!("http://{value}"),
    };
    let url = url::Url::parse(&text).map_err(|e| invalid(&format!("not a URL ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid("the scheme is not http or https"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("no host"));
    }
    Ok(Proxy { var, url })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> Result<Proxies, ProxyError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Proxies::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn variables_in_both_cases_the_uppercase_first() {
        let p = vars(&[
            ("https_proxy", "http://lower:3128"),
            ("HTTPS_PROXY", "http://upper:3128"),
            ("http_proxy", "squid.internal:3128"),
            ("no_proxy", ".cluster.local,10.0.0.0/8"),
        ])
        .unwrap();
        let https = p.https.unwrap();
        assert_eq!(
            (https.var, https.url.as_str()),
            ("HTTPS_PROXY", "http://upper:3128/")
        );
        let http = p.http.unwrap();
        assert_eq!(
            (http.var, http.url.as_str()),
            ("http_proxy", "http://squid.internal:3128/")
        );
        assert_eq!(p.no_proxy.as_deref(), Some(".cluster.local,10.0.0.0/8"));
        let p = vars(&[(
            "NO_PROXY",
            "registry.internal:5000, [fd00::5]:443,[::1],::1,fd00::/8,[fc00::]/7,*",
        )])
        .unwrap();
        assert_eq!(
            p.no_proxy.as_deref(),
            Some("registry.internal,fd00::5,::1,::1,fd00::/8,fc00::/7,*")
        );
        assert!(!vars(&[("HTTPS_PROXY", " ")]).unwrap().is_set());
    }

    #[test]
    fn bad_values_name_the_variable_and_hide_the_value() {
        for (value, want) in [
            (
                "socks5://user:Secret-1@proxy:1080",
                "the scheme is not http or https",
            ),
            ("http://user:Secret-1@:3128", "not a URL"),
        ] {
            let e = vars(&[("HTTPS_PROXY", value)]).unwrap_err().to_string();
            assert!(e.starts_with("HTTPS_PROXY: "), "{e}");
            assert!(e.contains(want), "{e}");
            assert!(!e.contains("Secret-1"), "{e}");
        }
    }

    #[test]
    fn debug_hides_the_password() {
        let p = vars(&[("HTTPS_PROXY", "http://user:Secret-1@proxy:3128")]).unwrap();
        let shown = format!("{p:?}");
        assert!(!shown.contains("Secret-1"), "{shown}");
        assert!(
            shown.contains("HTTPS_PROXY=http://user:redacted@proxy:3128/"),
            "{shown}"
        );
    }

    #[test]
    fn a_proxy_at_a_refused_literal_is_refused() {
        let guard = Guard::private_only_for(["registry.internal"]);
        let p = vars(&[("HTTP_PROXY", "http://169.254.169.254:3128")]).unwrap();
        let e = p.guard(&guard).unwrap_err().to_string();
        assert_eq!(
            e,
            "HTTP_PROXY: the proxy 169.254.169.254 resolves to 169.254.169.254, a cloud metadata address; refused by the outbound guard"
        );
        // A private proxy is the environment's choice.
        let p = vars(&[("HTTP_PROXY", "http://10.0.0.3:3128")]).unwrap();
        let g = p.guard(&guard).unwrap();
        let addr = "10.0.0.3".parse().unwrap();
        assert!(g.check_proxy("10.0.0.3", addr).is_ok());
        assert!(g.check_proxy("elsewhere", addr).is_err());
        // As the proxy only, not as a registry a Pod names.
        assert!(g.check("10.0.0.3", 3128, addr).is_err());
    }
}
