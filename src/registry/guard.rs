//! The outbound guard (docs/architecture.md §5, §8 "Our own outbound
//! guard"): which addresses the registry clients we build may connect to,
//! checked after DNS resolution and on every redirect.
//!
//! - Link-local (`169.254.0.0/16`, `fe80::/10`), cloud metadata
//!   (`169.254.169.254`, `fd00:ec2::254`, `100.100.100.200`) and
//!   unspecified (`0.0.0.0`, `::`) addresses are always refused, in any
//!   form (IPv4-mapped, IPv4-compatible, NAT64).
//! - Loopback and private addresses (RFC 1918, `100.64.0.0/10`,
//!   `fc00::/7`) are refused unless the host is one the guard allows: the
//!   webhook allows the registries its config names (by name or address).
//!
//! Names are checked in the resolver reqwest calls, after DNS, so the
//! address checked is the one connected to. Behind an `HTTPS_PROXY` or
//! `HTTP_PROXY` from the environment (which reqwest honours) that is the
//! proxy's: the proxy resolves the registry's name, unchecked here. reqwest does not resolve IP
//! literals, so URLs with a literal host are checked as they are met: the
//! redirect policy, token realms and upload locations.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// A connection the guard refused.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{host} resolves to {addr}, {why}; refused by the outbound guard")]
pub struct Refused {
    /// The host as the URL names it.
    pub host: String,
    /// The address refused.
    pub addr: IpAddr,
    /// Why, in words.
    pub why: &'static str,
}

/// The IPv4 address an IPv6 address carries (IPv4-mapped, IPv4-compatible,
/// NAT64 `64:ff9b::/96`), if any.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let seg = v6.segments();
    let low = Ipv4Addr::from((u32::from(seg[6]) << 16) | u32::from(seg[7]));
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    // `::` and `::1` are IPv6's own, not IPv4-compatible forms.
    ((seg[..6] == [0; 6] && u32::from(low) > 1) || seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0])
        .then_some(low)
}

/// Why `ip` is never connected to, or `None`.
pub fn refused_ip(ip: IpAddr) -> Option<&'static str> {
    const METADATA: &str = "a cloud metadata address";
    match ip {
        IpAddr::V4(v4) if v4.octets() == [169, 254, 169, 254] => Some(METADATA),
        IpAddr::V4(v4) if v4.octets() == [100, 100, 100, 200] => Some(METADATA),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_unspecified() => Some("unspecified"),
        IpAddr::V4(_) => None,
        IpAddr::V6(v6) if v6 == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) => {
            Some(METADATA)
        }
        IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80 => Some("link-local"),
        IpAddr::V6(v6) if v6.is_unspecified() => Some("unspecified"),
        IpAddr::V6(v6) => embedded_v4(v6).and_then(|v4| refused_ip(IpAddr::V4(v4))),
    }
}

/// Whether `ip` is loopback or private: reachable only inside the cluster
/// or the host.
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback() || v4.is_private() || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.segments()[0] & 0xfe00 == 0xfc00
                || embedded_v4(v6).is_some_and(|v4| is_private(IpAddr::V4(v4)))
        }
    }
}

/// What the registry clients may connect to. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Hosts (lowercase, without port) that may be loopback or private;
    /// `None` allows any (the CLI, whose user names every registry).
    private: Option<Arc<HashSet<String>>>,
    /// Name → addresses, used instead of DNS for those names and checked
    /// the same way (tests map names to loopback with it).
    hosts: Arc<HashMap<String, Vec<IpAddr>>>,
}

/// `host` of `host[:port]` (IPv6 in brackets), lowercase.
fn host_of(registry: &str) -> String {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

impl Guard {
    /// A guard that allows loopback and private addresses only for these
    /// registries (`host[:port]`, the port ignored).
    pub fn private_only_for<S: AsRef<str>>(registries: impl IntoIterator<Item = S>) -> Self {
        Self {
            private: Some(Arc::new(
                registries
                    .into_iter()
                    .map(|r| host_of(r.as_ref()))
                    .collect(),
            )),
            ..Self::default()
        }
    }

    /// This guard, resolving each name of `hosts` to its addresses instead
    /// of asking DNS.
    pub fn with_hosts(mut self, hosts: HashMap<String, Vec<IpAddr>>) -> Self {
        self.hosts = Arc::new(
            hosts
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
        );
        self
    }

    /// Whether `host` (a name or a literal, as a URL writes it) may be
    /// connected to at `addr`.
    ///
    /// # Errors
    /// [`Refused`] naming the address and why.
    pub fn check(&self, host: &str, addr: IpAddr) -> Result<(), Refused> {
        let refused = |why| Refused {
            host: host.to_owned(),
            addr,
            why,
        };
        if let Some(why) = refused_ip(addr) {
            return Err(refused(why));
        }
        match &self.private {
            Some(allowed) if is_private(addr) && !allowed.contains(&host_of(host)) => Err(refused(
                "a loopback or private address, and not a registry the config names",
            )),
            _ => Ok(()),
        }
    }

    /// Checks a URL whose host is an IP literal (names are checked when
    /// they are resolved).
    ///
    /// # Errors
    /// [`Refused`] for a literal the guard refuses.
    pub fn check_url(&self, url: &url::Url) -> Result<(), Refused> {
        let addr = match url.host() {
            Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
            Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
            _ => return Ok(()),
        };
        self.check(url.host_str().unwrap_or_default(), addr)
    }

    /// [`Guard::check_url`] for a URL as text; text that is not a URL
    /// passes (the request then fails on its own).
    ///
    /// # Errors
    /// As [`Guard::check_url`].
    pub fn check_str(&self, url: &str) -> Result<(), Refused> {
        match url::Url::parse(url) {
            Ok(u) => self.check_url(&u),
            Err(_) => Ok(()),
        }
    }

    /// The resolver for `reqwest::ClientBuilder::dns_resolver`: DNS (or
    /// [`Guard::with_hosts`]), then every address checked; refused ones are
    /// dropped, and a name left with none fails with the first refusal.
    pub fn resolver(&self) -> Arc<GuardResolver> {
        Arc::new(GuardResolver(self.clone()))
    }

    /// The redirect policy: at most 10 redirects, each to a URL the guard
    /// allows (reqwest itself drops `Authorization` on a redirect to another
    /// host, port or scheme).
    pub fn redirect_policy(&self) -> reqwest::redirect::Policy {
        let guard = self.clone();
        reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= 10 {
                return attempt.error("too many redirects");
            }
            match guard.check_url(attempt.url()) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(e),
            }
        })
    }
}

/// See [`Guard::resolver`].
#[derive(Debug)]
pub struct GuardResolver(Guard);

impl reqwest::dns::Resolve for GuardResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.0.clone();
        let host = name.as_str().to_ascii_lowercase();
        Box::pin(async move {
            let found: Vec<IpAddr> = match guard.hosts.get(&host) {
                Some(addrs) => addrs.clone(),
                None => tokio::net::lookup_host((host.as_str(), 0))
                    .await?
                    .map(|a| a.ip())
                    .collect(),
            };
            let mut refusal = None;
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                .filter_map(|ip| match guard.check(&host, ip) {
                    Ok(()) => Some(SocketAddr::new(ip, 0)),
                    Err(e) => {
                        refusal.get_or_insert(e);
                        None
                    }
                })
                .collect();
            match (allowed.is_empty(), refusal) {
                (true, Some(e)) => Err(e.into()),
                _ => Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::Resolve;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn refused_and_private_addresses() {
        for (a, why) in [
            ("169.254.169.254", "a cloud metadata address"),
            ("100.100.100.200", "a cloud metadata address"),
            ("fd00:ec2::254", "a cloud metadata address"),
            ("::ffff:169.254.169.254", "a cloud metadata address"),
            ("64:ff9b::a9fe:a9fe", "a cloud metadata address"),
            ("::a9fe:a9fe", "a cloud metadata address"),
            ("169.254.1.1", "link-local"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("::ffff:0.0.0.0", "unspecified"),
        ] {
            assert_eq!(refused_ip(ip(a)), Some(why), "{a}");
        }
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "::1",
            "fd12::1",
            "::ffff:10.0.0.1",
        ] {
            assert_eq!(refused_ip(ip(a)), None, "{a}");
            assert!(is_private(ip(a)), "{a}");
        }
        for a in [
            "8.8.8.8",
            "100.128.0.1",
            "2001:db8::1",
            "fec0::1",
            "172.32.0.1",
        ] {
            assert_eq!(refused_ip(ip(a)), None, "{a}");
            assert!(!is_private(ip(a)), "{a}");
        }
    }

    #[test]
    fn private_addresses_only_for_named_registries() {
        let g = Guard::private_only_for(["registry.internal:5000", "10.0.0.5", "[fd00::5]:443"]);
        assert!(g.check("registry.internal", ip("10.1.1.1")).is_ok());
        assert!(g.check("REGISTRY.internal.", ip("127.0.0.1")).is_ok());
        assert!(g.check("10.0.0.5", ip("10.0.0.5")).is_ok());
        assert!(g.check("[fd00::5]", ip("fd00::5")).is_ok());
        assert!(g.check("other.example", ip("8.8.8.8")).is_ok());
        let e = g.check("other.example", ip("10.1.1.1")).unwrap_err();
        assert!(e.why.starts_with("a loopback or private address"), "{e}");
        assert!(g.check("registry.internal", ip("169.254.169.254")).is_err());
        // The CLI's guard allows private addresses, never refused ones.
        let any = Guard::default();
        assert!(any.check("x", ip("10.1.1.1")).is_ok());
        assert!(any.check("x", ip("fe80::1")).is_err());
    }

    #[test]
    fn literal_urls_are_checked_in_every_form() {
        let g = Guard::private_only_for(["127.0.0.1:5000"]);
        for u in [
            "http://169.254.169.254/latest/meta-data/",
            "http://2852039166/",
            "http://0xa9fea9fe/",
            "http://[::ffff:a9fe:a9fe]/",
            "http://0.0.0.0:5000/",
            "http://10.0.0.1/",
        ] {
            assert!(g.check_str(u).is_err(), "{u}");
        }
        for u in [
            "http://127.0.0.1:6000/token",
            "https://cdn.example/blob",
            "not a url",
        ] {
            assert!(g.check_str(u).is_ok(), "{u}");
        }
    }

    /// The resolver is called directly: nothing connects anywhere.
    #[tokio::test]
    async fn the_resolver_drops_refused_addresses() {
        let hosts = HashMap::from([
            ("meta.test".to_owned(), vec![ip("169.254.169.254")]),
            (
                "mixed.test".to_owned(),
                vec![ip("fe80::1"), ip("192.0.2.7")],
            ),
            ("inside.test".to_owned(), vec![ip("10.0.0.9")]),
        ]);
        let g = Guard::private_only_for(["registry.test"]).with_hosts(hosts);
        let r = g.resolver();
        let resolve = |n: &str| r.resolve(n.parse().unwrap());
        let e = resolve("meta.test")
            .await
            .err()
            .expect("refused")
            .to_string();
        assert_eq!(
            e,
            "meta.test resolves to 169.254.169.254, a cloud metadata address; refused by the outbound guard"
        );
        let left: Vec<SocketAddr> = resolve("MIXED.test").await.unwrap().collect();
        assert_eq!(left, vec![SocketAddr::new(ip("192.0.2.7"), 0)]);
        assert!(resolve("inside.test").await.is_err());
    }
}
