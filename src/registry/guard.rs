//! The outbound guard (docs/architecture.md §5, §8 "Our own outbound
//! guard"): which addresses the registry clients we build may connect to,
//! checked after DNS resolution and on every redirect.
//!
//! - Link-local (`169.254.0.0/16`, `fe80::/10`), cloud metadata
//!   (`169.254.169.254`, `fd00:ec2::254`, `100.100.100.200`) and
//!   unspecified (`0.0.0.0`, `::`) addresses are always refused, in any
//!   form (IPv4-mapped, IPv4-compatible, NAT64).
//! - Loopback and private addresses (RFC 1918, `100.64.0.0/10`,
//!   `fc00::/7`) are refused unless the host and port are a registry the
//!   guard allows: the webhook allows the registries its config names (by
//!   name or address, on the port named, or on 443 and 80 when none is).
//!
//! Names are checked in the resolver reqwest calls, after DNS, so the
//! address checked is the one connected to. reqwest does not resolve IP
//! literals, so URLs with a literal host are checked as they are met: the
//! redirect policy, token realms and upload locations. The resolver is not
//! told the port, so every connection's destination is checked again, with
//! its port, before it is opened ([`Guard::destinations`]). Behind a proxy
//! (`proxy.rs`) reqwest resolves only the proxy's name, so there every
//! destination is resolved and checked that way.
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

/// A destination that could not be resolved here, so could not be checked
/// before a proxy was asked to reach it.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "{host} cannot be resolved here ({reason}); behind a proxy every registry name is resolved and checked before the proxy is asked, so it must resolve here too; refused by the outbound guard"
)]
pub struct Unresolved {
    /// The host as the URL names it.
    pub host: String,
    /// The resolver's error, or that it found no address.
    pub reason: String,
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
    /// Hosts (lowercase, without port) that may be loopback or private,
    /// each with the ports named for it (`None`: none was, so the schemes'
    /// defaults); `None` allows any (the CLI, whose user names every
    /// registry).
    private: Option<Arc<HashMap<String, HashSet<Option<u16>>>>>,
    /// Name → addresses, used instead of DNS for those names and checked
    /// the same way (tests map names to loopback with it).
    hosts: Arc<HashMap<String, Vec<IpAddr>>>,
    /// Token realms (host, ports) that registries the config names sent
    /// us to: where such a registry authenticates is as trusted as it is,
    /// on that port only. Shared by every clone: the clients' resolvers
    /// and connectors see what a probe adds.
    realms: Arc<std::sync::RwLock<HashMap<String, HashSet<u16>>>>,
    /// Proxy hosts (lowercase, without port) that may be loopback or
    /// private, as the proxy only: a Pod naming one as a registry, or a
    /// redirect to one, is checked like any other destination.
    proxies: Arc<HashSet<String>>,
}

/// `host` of `host[:port]` (IPv6 in brackets), lowercase.
fn host_of(registry: &str) -> String {
    endpoint_of(registry).0
}

/// `host` (lowercase) and `port` of `host[:port]` (IPv6 in brackets).
fn endpoint_of(registry: &str) -> (String, Option<u16>) {
    let (host, port) = match registry.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((h, tail)) => (h, tail.strip_prefix(':')),
            None => (rest, None),
        },
        None => match registry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (registry, None),
        },
    };
    (
        host.trim_end_matches('.').to_ascii_lowercase(),
        port.and_then(|p| p.parse().ok()),
    )
}

/// The ports a connection may use: a registry named without one is
/// reached on `https`'s or, when insecure, `http`'s default.
fn port_allowed(named: &HashSet<Option<u16>>, port: u16) -> bool {
    named.contains(&Some(port)) || (named.contains(&None) && matches!(port, 443 | 80))
}

impl Guard {
    /// A guard that allows loopback and private addresses only for these
    /// registries (`host[:port]`), each on its own port: 443 and 80 for
    /// one named without a port.
    pub fn private_only_for<S: AsRef<str>>(registries: impl IntoIterator<Item = S>) -> Self {
        let mut private: HashMap<String, HashSet<Option<u16>>> = HashMap::new();
        for r in registries {
            let (host, port) = endpoint_of(r.as_ref());
            private.entry(host).or_default().insert(port);
        }
        Self {
            private: Some(Arc::new(private)),
            ..Self::default()
        }
    }

    /// This guard, also allowing `host` (`host[:port]`) loopback and
    /// private addresses when it is connected to as a proxy: a proxy the
    /// environment names ([`Guard::check_proxy`], and the resolver, which
    /// resolves the proxy's name). As a destination it stays refused.
    pub fn allowing_proxy(mut self, host: &str) -> Self {
        Arc::make_mut(&mut self.proxies).insert(host_of(host));
        self
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
    /// connected to at `addr` on `port`.
    ///
    /// # Errors
    /// [`Refused`] naming the address and why.
    pub fn check(&self, host: &str, port: u16, addr: IpAddr) -> Result<(), Refused> {
        self.check_as(host, Some(port), addr, false)
    }

    /// [`Guard::check`] for the proxy at `host`: also allowed loopback and
    /// private addresses when [`Guard::allowing_proxy`] named it.
    ///
    /// # Errors
    /// As [`Guard::check`].
    pub fn check_proxy(&self, host: &str, addr: IpAddr) -> Result<(), Refused> {
        self.check_as(host, None, addr, true)
    }

    /// `port` is `None` where it is not known (the resolver, and proxies,
    /// which are allowed by host): the host alone is checked then, and
    /// [`Guard::destinations`] checks the port before the connection.
    fn check_as(
        &self,
        host: &str,
        port: Option<u16>,
        addr: IpAddr,
        proxy: bool,
    ) -> Result<(), Refused> {
        let refused = |why| Refused {
            host: host.to_owned(),
            addr,
            why,
        };
        if let Some(why) = refused_ip(addr) {
            return Err(refused(why));
        }
        let h = host_of(host);
        let named = self.allowed_at(&h, port);
        match is_private(addr) && !named && !(proxy && self.proxies.contains(&h)) {
            true => Err(refused(
                "a loopback or private address, and not a registry the config names (host and port)",
            )),
            false => Ok(()),
        }
    }

    /// Whether `host` (lowercase, without port) may be private on `port`
    /// (`None`: on some port): a registry the config names, or a token
    /// realm one of those sent us to.
    fn allowed_at(&self, host: &str, port: Option<u16>) -> bool {
        let Some(named) = &self.private else {
            return true;
        };
        let registry = named
            .get(host)
            .is_some_and(|ports| port.is_none_or(|p| port_allowed(ports, p)));
        registry
            || self
                .realms
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(host)
                .is_some_and(|ports| port.is_none_or(|p| ports.contains(&p)))
    }

    /// Whether a connection to `host` on `port` must be checked again
    /// before it is opened, though the resolver checked the name: the
    /// host may be private, on other ports only.
    fn port_unnamed(&self, host: &str, port: u16) -> bool {
        let h = host_of(host);
        self.allowed_at(&h, None) && !self.allowed_at(&h, Some(port))
    }

    /// Trusts `realm`, the token endpoint `registry` (`host[:port]`) asked
    /// for, when the config names `registry` and the realm is on the same
    /// host: an auth server beside the registry on a port of its own (as
    /// docker_auth runs) may then be private on that port. A realm on
    /// another host, or from a registry the config does not name, gains
    /// nothing. Bounded: a few realms per named registry are all a config
    /// can bring.
    pub fn trust_realm(&self, registry: &str, realm: &str) {
        const MAX_REALMS: usize = 64;
        let (host, port) = endpoint_of(registry);
        let named = self.private.as_ref().is_some_and(|a| {
            a.get(&host).is_some_and(|ports| match port {
                Some(p) => port_allowed(ports, p),
                None => ports.contains(&None),
            })
        });
        let Ok(url) = url::Url::parse(realm) else {
            return;
        };
        let (Some(h), Some(p)) = (url.host_str(), url.port_or_known_default()) else {
            return;
        };
        let mut realms = self
            .realms
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let beside = host_of(h) == host;
        if named && beside && realms.values().map(HashSet::len).sum::<usize>() < MAX_REALMS {
            realms.entry(host_of(h)).or_default().insert(p);
        }
    }

    /// Checks a URL whose host is an IP literal (names are checked when
    /// they are resolved, and with the port before the connection).
    ///
    /// # Errors
    /// [`Refused`] for a literal the guard refuses.
    pub fn check_url(&self, url: &url::Url) -> Result<(), Refused> {
        match literal(url) {
            Some(addr) => self.check(
                url.host_str().unwrap_or_default(),
                url.port_or_known_default().unwrap_or(443),
                addr,
            ),
            None => Ok(()),
        }
    }

    /// [`Guard::check_url`] for the URL of a proxy ([`Guard::check_proxy`]).
    ///
    /// # Errors
    /// As [`Guard::check_url`].
    pub fn check_proxy_url(&self, url: &url::Url) -> Result<(), Refused> {
        match literal(url) {
            Some(addr) => self.check_proxy(url.host_str().unwrap_or_default(), addr),
            None => Ok(()),
        }
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

    /// The addresses of `host` (a name): [`Guard::with_hosts`], else DNS.
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>> {
        Ok(match self.hosts.get(host) {
            Some(addrs) => addrs.clone(),
            None => tokio::net::lookup_host((host, 0))
                .await?
                .map(|a| a.ip())
                .collect(),
        })
    }

    /// Resolves `host` (a name or a literal, IPv6 in brackets) here and
    /// checks every address it has for a connection on `port`: where a
    /// proxy carries the connection, the proxy picks among them, so each
    /// must pass.
    ///
    /// # Errors
    /// [`Refused`] for the first address refused; [`Unresolved`] when the
    /// name has no address here.
    pub async fn check_destination(&self, host: &str, port: u16) -> Result<(), BoxError> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(self.check(host, port, ip)?);
        }
        let name = host.trim_end_matches('.').to_ascii_lowercase();
        let unresolved = |reason: String| Unresolved {
            host: host.to_owned(),
            reason,
        };
        let found = self
            .lookup(&name)
            .await
            .map_err(|e| unresolved(e.to_string()))?;
        if found.is_empty() {
            return Err(unresolved("no address".into()).into());
        }
        for ip in found {
            self.check(host, port, ip)?;
        }
        Ok(())
    }

    /// A reqwest connector layer that checks every connection's destination,
    /// with its port, before it is opened: with `proxied` (proxies are set)
    /// by [`Guard::check_destination`] always; otherwise literals, and names
    /// the config allows on other ports only (the resolver, which is not
    /// told the port, checked the rest).
    pub fn destinations(&self, proxied: bool) -> Destinations {
        Destinations {
            guard: self.clone(),
            proxied,
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

/// The address a URL's host is, when it is an IP literal.
fn literal(url: &url::Url) -> Option<IpAddr> {
    match url.host() {
        Some(url::Host::Ipv4(v4)) => Some(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => Some(IpAddr::V6(v6)),
        _ => None,
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
            let found = guard.lookup(&host).await?;
            let mut refusal = None;
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                // Proxy names are resolved here too; destinations behind a
                // proxy were checked before ([`Guard::destinations`]).
                .filter_map(|ip| match guard.check_proxy(&host, ip) {
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

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// See [`Guard::destinations`]. reqwest resolves only the proxy's name when
/// a proxy carries a request, its resolver is never told the port, and it
/// hands its connector layers the destination in a sealed type whose one
/// public face is `Debug`; so the destination is read from that, and a
/// connection whose destination cannot be read is refused rather than let
/// through.
#[derive(Debug, Clone)]
pub struct Destinations {
    guard: Guard,
    proxied: bool,
}

impl<S> tower_layer::Layer<S> for Destinations {
    type Service = CheckDestination<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CheckDestination {
            guard: self.guard.clone(),
            proxied: self.proxied,
            inner,
        }
    }
}

/// The service [`Destinations`] wraps around reqwest's connector.
#[derive(Debug, Clone)]
pub struct CheckDestination<S> {
    guard: Guard,
    proxied: bool,
    inner: S,
}

/// The host and port of a connector request's `Debug` text
/// (`Name(scheme://host:port/)`; the scheme's default port where none is
/// written).
fn destination(debug: &str) -> Option<(String, u16)> {
    let (_, uri) = debug.strip_suffix(')')?.split_once('(')?;
    let uri: http::Uri = uri.parse().ok()?;
    let port = uri.port_u16().or(match uri.scheme_str()? {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    })?;
    Some((uri.host()?.to_owned(), port))
}

impl<S, R> tower_service::Service<R> for CheckDestination<S>
where
    S: tower_service::Service<R> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    R: std::fmt::Debug + Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, BoxError>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let guard = self.guard.clone();
        // The service polled ready is the one to call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let to = destination(&format!("{req:?}"));
        let proxied = self.proxied;
        Box::pin(async move {
            let (host, port) =
                to.ok_or("cannot tell where a connection goes; refused by the outbound guard")?;
            let literal = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
                .is_ok();
            if proxied || literal || guard.port_unnamed(&host, port) {
                guard.check_destination(&host, port).await?;
            }
            inner.call(req).await.map_err(Into::into)
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
        assert!(g.check("registry.internal", 5000, ip("10.1.1.1")).is_ok());
        assert!(g.check("REGISTRY.internal.", 5000, ip("127.0.0.1")).is_ok());
        assert!(g.check("10.0.0.5", 443, ip("10.0.0.5")).is_ok());
        assert!(g.check("10.0.0.5", 80, ip("10.0.0.5")).is_ok());
        assert!(g.check("[fd00::5]", 443, ip("fd00::5")).is_ok());
        assert!(g.check("other.example", 22, ip("8.8.8.8")).is_ok());
        let e = g.check("other.example", 443, ip("10.1.1.1")).unwrap_err();
        assert!(e.why.starts_with("a loopback or private address"), "{e}");
        assert!(
            g.check("registry.internal", 5000, ip("169.254.169.254"))
                .is_err()
        );
        // A named host on a port the config does not name is any other host.
        for (h, port, a) in [
            ("registry.internal", 22, "10.1.1.1"),
            ("registry.internal", 443, "10.1.1.1"),
            ("10.0.0.5", 5000, "10.0.0.5"),
            ("[fd00::5]", 80, "fd00::5"),
        ] {
            assert!(g.check(h, port, ip(a)).is_err(), "{h}:{port}");
            assert!(g.port_unnamed(h, port), "{h}:{port}");
        }
        assert!(!g.port_unnamed("registry.internal", 5000));
        assert!(
            !g.port_unnamed("other.example", 22),
            "the resolver checks it"
        );
        // The resolver is not told the port: it checks the host.
        assert!(
            g.check_as("registry.internal", None, ip("10.1.1.1"), false)
                .is_ok()
        );
        // The CLI's guard allows private addresses, never refused ones.
        let any = Guard::default();
        assert!(any.check("x", 1, ip("10.1.1.1")).is_ok());
        assert!(any.check("x", 1, ip("fe80::1")).is_err());
        assert!(!any.port_unnamed("x", 1));
    }

    #[test]
    fn a_named_registrys_token_realm_is_trusted_on_its_port() {
        let g = Guard::private_only_for(["registry.internal:5000"]);
        let clone = g.clone();
        // A registry the config does not name gains nothing.
        g.trust_realm("evil.example", "http://registry.internal:22/token");
        g.trust_realm("registry.internal:6000", "http://registry.internal:22/");
        assert!(g.check("registry.internal", 22, ip("10.0.0.1")).is_err());
        // Nor does a realm on another host.
        g.trust_realm("registry.internal:5000", "https://auth.internal:5001/token");
        assert!(g.check("auth.internal", 5001, ip("10.0.0.2")).is_err());
        g.trust_realm(
            "registry.internal:5000",
            "https://REGISTRY.internal:5001/token",
        );
        assert!(
            clone
                .check("registry.internal", 5001, ip("10.0.0.2"))
                .is_ok()
        );
        assert!(
            clone
                .check("registry.internal", 5002, ip("10.0.0.2"))
                .is_err()
        );
        assert!(clone.port_unnamed("registry.internal", 5002));
        assert!(!clone.port_unnamed("registry.internal", 5001));
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
            "http://127.0.0.1:6000/token",
            "https://127.0.0.1/token",
        ] {
            assert!(g.check_str(u).is_err(), "{u}");
        }
        for u in [
            "http://127.0.0.1:5000/token",
            "https://cdn.example/blob",
            "not a url",
        ] {
            assert!(g.check_str(u).is_ok(), "{u}");
        }
    }

    /// Nothing connects: names come from the guard's own table.
    #[tokio::test]
    async fn destinations_are_checked_at_every_address() {
        assert_eq!(
            destination("Unnameable(https://meta.test/)"),
            Some(("meta.test".to_owned(), 443))
        );
        assert_eq!(
            destination("Unnameable(http://[::1]:5000/)"),
            Some(("[::1]".to_owned(), 5000))
        );
        assert_eq!(destination("Unnameable"), None);
        let hosts = HashMap::from([
            ("registry.test".to_owned(), vec![ip("10.0.0.1")]),
            (
                "mixed.test".to_owned(),
                vec![ip("192.0.2.7"), ip("fe80::1")],
            ),
            ("empty.test".to_owned(), vec![]),
        ]);
        let g = Guard::private_only_for(["registry.test"]).with_hosts(hosts);
        assert!(g.check_destination("registry.test", 443).await.is_ok());
        assert!(g.check_destination("registry.test", 5000).await.is_err());
        assert!(g.check_destination("192.0.2.7", 1).await.is_ok());
        let e = g.check_destination("MIXED.test.", 443).await.unwrap_err();
        assert!(
            e.to_string().contains("resolves to fe80::1, link-local"),
            "every address counts: {e}"
        );
        assert!(g.check_destination("[fe80::1]", 443).await.is_err());
        let e = g.check_destination("empty.test", 443).await.unwrap_err();
        assert!(e.to_string().contains("cannot be resolved here"), "{e}");
        // A proxy the environment names may be private, as the proxy: as
        // a destination it is checked like any other.
        let g = g.allowing_proxy("10.0.0.1:3128");
        assert!(g.check_proxy("10.0.0.1", ip("10.0.0.1")).is_ok());
        assert!(g.check_destination("10.0.0.1", 3128).await.is_err());
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
