//! The outbound guard: names are checked after resolution, redirects, token
//! realms and upload locations on the way, and behind a proxy before the
//! proxy is asked, with a test resolver mapping names to loopback.
//! No test connects to a metadata address: refused names map to 0.0.0.0,
//! which Linux delivers to loopback, so a guard that let one through would
//! show as a request counted by a sink on 127.0.0.1.

mod common;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use common::forward::ForwardProxy;
use common::front::{Front, Mode};
use common::{Image, TestRegistry, push_image};
use pinswap::reference::Reference;
use pinswap::registry::auth::Credentials;
use pinswap::registry::copy::{Copier, CopyOptions, Endpoint};
use pinswap::registry::guard::Guard;
use pinswap::registry::proxy::Proxies;
use pinswap::registry::{ClientPool, PoolOptions, Role};

/// What one server was asked: (path, whether it carried `Authorization`).
type Seen = Arc<Mutex<Vec<(String, bool)>>>;

/// Binds 127.0.0.1 on a free port; the port and the listener.
async fn bind() -> (u16, tokio::net::TcpListener) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    (l.local_addr().unwrap().port(), l)
}

fn record(seen: &Seen, req: &Request) {
    seen.lock().unwrap().push((
        req.uri().path().to_owned(),
        req.headers().contains_key(header::AUTHORIZATION),
    ));
}

/// How a test server answers a path, given the CDN and sink ports.
type Answer = fn(&str, u16, u16) -> Response;

/// A test server's state: what it saw, how it answers, the ports it names.
type Served = (Seen, Answer, (u16, u16));

/// A server answering every request with `answer(path)`, recording each.
fn serve(listener: tokio::net::TcpListener, answer: Answer, ports: (u16, u16)) -> Seen {
    let seen = Seen::default();
    let state: Served = (seen.clone(), answer, ports);
    let app = Router::new().fallback(
        async |State((seen, answer, (b, c))): State<Served>, req: Request| {
            record(&seen, &req);
            answer(req.uri().path(), b, c)
        },
    );
    tokio::spawn(async move { axum::serve(listener, app.with_state(state)).await.unwrap() });
    seen
}

const DIGEST: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000001";

/// The registry: `/v2/` asks for Basic auth; each manifest redirects.
fn registry(path: &str, cdn: u16, sink: u16) -> Response {
    let redirect = |to: String| {
        let mut h = HeaderMap::new();
        h.insert(header::LOCATION, to.parse().unwrap());
        (StatusCode::TEMPORARY_REDIRECT, h).into_response()
    };
    match path {
        "/v2/" => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"test\"")],
        )
            .into_response(),
        "/v2/shop/app/manifests/v1" => redirect(format!("http://cdn.test:{cdn}/blobs/m1")),
        "/v2/literal/app/manifests/v1" => redirect(format!("http://0.0.0.0:{sink}/literal")),
        "/v2/named/app/manifests/v1" => redirect(format!("http://zero.test:{sink}/named")),
        "/v2/private/app/manifests/v1" => redirect(format!("http://inside.test:{sink}/private")),
        "/v2/shop/app/tags/list" => redirect(format!("http://cdn.test:{cdn}/lists/tags")),
        "/v2/named/app/tags/list" => redirect(format!("http://zero.test:{sink}/tags")),
        "/v2/_catalog" => redirect(format!("http://inside.test:{sink}/catalog")),
        "/v2/proxy/app/manifests/v1" => redirect(format!("http://127.0.0.1:{sink}/proxy")),
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The CDN: a tag list under `/lists/`, else the manifest.
fn cdn(path: &str, _: u16, _: u16) -> Response {
    if path.starts_with("/lists/") {
        return r#"{"name": "shop/app", "tags": ["v1", "v2"]}"#.into_response();
    }
    (
        [
            ("docker-content-digest", DIGEST),
            ("content-type", "application/vnd.oci.image.manifest.v1+json"),
        ],
        "",
    )
        .into_response()
}

fn sink(_: &str, _: u16, _: u16) -> Response {
    "{}".into_response()
}

fn loopback() -> Vec<IpAddr> {
    vec!["127.0.0.1".parse().unwrap()]
}

fn hosts(pairs: &[(&str, Vec<IpAddr>)]) -> HashMap<String, Vec<IpAddr>> {
    pairs
        .iter()
        .map(|(n, a)| ((*n).to_owned(), a.clone()))
        .collect()
}

fn pool(guard: Guard, insecure: &[String]) -> ClientPool {
    ClientPool::new(PoolOptions {
        insecure: insecure.to_vec(),
        source_creds: Some(Credentials::new("puller", "Secret-9")),
        guard,
        ..PoolOptions::default()
    })
}

#[tokio::test]
async fn names_are_checked_after_resolution() {
    common::init();
    let reg = common::TestRegistry::plain().await;
    let port = reg.port();
    let front = common::front::Front::start(&reg.host()).await;
    let fport: u16 = front.host().rsplit_once(':').unwrap().1.parse().unwrap();
    let (sink_port, sink_listener) = bind().await;
    let sunk = serve(sink_listener, sink, (0, 0));
    let guard = Guard::private_only_for([format!("registry.test:{port}")]).with_hosts(hosts(&[
        ("registry.test", loopback()),
        ("other.test", loopback()),
        ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
    ]));
    let named = |n: &str, p: u16| format!("{n}:{p}");
    let p = pool(
        guard,
        &[
            named("registry.test", port),
            named("other.test", fport),
            named("zero.test", sink_port),
        ],
    );

    // A registry the config names may be loopback.
    let ok = p
        .get(&named("registry.test", port), Role::Source)
        .await
        .unwrap();
    assert_eq!(ok.ping().await, Ok(()));

    // Another name on loopback is refused before any connection.
    let e = p
        .get(&named("other.test", fport), Role::Source)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("other.test resolves to 127.0.0.1, a loopback or private address"),
        "{e}"
    );
    assert_eq!(
        front.total(),
        0,
        "nothing reached the registry behind other.test"
    );

    // An unspecified (always refused) address, whatever the allowlist.
    let e = p
        .get(&named("zero.test", sink_port), Role::Source)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("zero.test resolves to 0.0.0.0, unspecified"),
        "{e}"
    );
    // A literal is checked before the probe.
    let e = p
        .get(&format!("0.0.0.0:{sink_port}"), Role::Source)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("resolves to 0.0.0.0, unspecified"), "{e}");
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

#[tokio::test]
async fn redirects_are_checked_and_drop_the_registry_credentials() {
    common::init();
    let (reg_port, reg_listener) = bind().await;
    let (cdn_port, cdn_listener) = bind().await;
    let (sink_port, sink_listener) = bind().await;
    let asked = serve(reg_listener, registry, (cdn_port, sink_port));
    let fetched = serve(cdn_listener, cdn, (0, 0));
    let sunk = serve(sink_listener, sink, (0, 0));
    let registry_host = format!("registry.test:{reg_port}");
    // The CDN is allowed explicitly: here it is on loopback too.
    let guard = Guard::private_only_for([registry_host.clone(), format!("cdn.test:{cdn_port}")])
        .with_hosts(hosts(&[
            ("registry.test", loopback()),
            ("cdn.test", loopback()),
            ("inside.test", loopback()),
            ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
        ]));
    let p = pool(guard, std::slice::from_ref(&registry_host));
    let client = p.get(&registry_host, Role::Source).await.unwrap();
    let r = |repo: &str| Reference::parse(&format!("{registry_host}/{repo}:v1")).unwrap();

    // Followed to the CDN, without the registry's Authorization.
    let got = client.head_manifest(&r("shop/app")).await.unwrap();
    assert_eq!(got.map(|d| d.to_string()).as_deref(), Some(DIGEST));
    assert!(
        asked
            .lock()
            .unwrap()
            .contains(&("/v2/shop/app/manifests/v1".to_owned(), true)),
        "the registry got the credentials: {:?}",
        asked.lock().unwrap()
    );
    assert_eq!(
        *fetched.lock().unwrap(),
        vec![("/blobs/m1".to_owned(), false)],
        "the CDN did not"
    );

    // Redirects to a refused literal, a name resolving to one, and a
    // loopback name not allowed: refused, and the sink saw nothing.
    for (repo, want) in [
        ("literal/app", "0.0.0.0 resolves to 0.0.0.0, unspecified"),
        ("named/app", "zero.test resolves to 0.0.0.0, unspecified"),
        (
            "private/app",
            "inside.test resolves to 127.0.0.1, a loopback or private address",
        ),
    ] {
        let e = client
            .head_manifest(&r(repo))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{repo}: {e}");
    }
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

/// The tag and catalog lists are our own requests too: a redirect is
/// followed to an allowed host without the credentials, and refused to an
/// unspecified or a private address the config does not name.
#[tokio::test]
async fn tag_and_catalog_lists_are_checked_on_redirect() {
    common::init();
    let (reg_port, reg_listener) = bind().await;
    let (cdn_port, cdn_listener) = bind().await;
    let (sink_port, sink_listener) = bind().await;
    let asked = serve(reg_listener, registry, (cdn_port, sink_port));
    let fetched = serve(cdn_listener, cdn, (0, 0));
    let sunk = serve(sink_listener, sink, (0, 0));
    let registry_host = format!("registry.test:{reg_port}");
    let guard = Guard::private_only_for([registry_host.clone(), format!("cdn.test:{cdn_port}")])
        .with_hosts(hosts(&[
            ("registry.test", loopback()),
            ("cdn.test", loopback()),
            ("inside.test", loopback()),
            ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
        ]));
    let p = pool(guard, std::slice::from_ref(&registry_host));
    let client = p.get(&registry_host, Role::Source).await.unwrap();
    let r = |repo: &str| Reference::parse(&format!("{registry_host}/{repo}:v1")).unwrap();

    assert_eq!(client.tags(&r("shop/app")).await.unwrap(), ["v1", "v2"]);
    assert!(
        asked
            .lock()
            .unwrap()
            .contains(&("/v2/shop/app/tags/list".to_owned(), true)),
        "{:?}",
        asked.lock().unwrap()
    );
    // One page: short and without `Link`, it is the whole list.
    assert_eq!(
        *fetched.lock().unwrap(),
        vec![("/lists/tags".to_owned(), false)],
        "the CDN got no credentials"
    );

    let e = client.tags(&r("named/app")).await.unwrap_err().to_string();
    assert!(
        e.contains("zero.test resolves to 0.0.0.0, unspecified"),
        "{e}"
    );
    let e = client.catalog().await.unwrap_err().to_string();
    assert!(
        e.contains("inside.test resolves to 127.0.0.1, a loopback or private address"),
        "{e}"
    );
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

/// A pool for `registries` (plain HTTP, private addresses allowed) behind
/// `proxy` (`HTTPS_PROXY` and `HTTP_PROXY`) with `no_proxy`.
fn proxied(guard: &Guard, registries: &[String], proxy: &str, no_proxy: &str) -> Arc<ClientPool> {
    let proxies = Proxies::from_vars(|k| match k {
        "HTTPS_PROXY" | "HTTP_PROXY" => Some(proxy.to_owned()),
        "NO_PROXY" => Some(no_proxy.to_owned()),
        _ => None,
    })
    .unwrap();
    Arc::new(ClientPool::new(PoolOptions {
        insecure: registries.to_vec(),
        guard: guard.clone(),
        proxies,
        ..PoolOptions::default()
    }))
}

/// Copies `from` to `to` with `pool` and checks the copy byte for byte.
async fn copy_exact(
    pool: Arc<ClientPool>,
    from: &str,
    to: &str,
    dst: &TestRegistry,
    image: &Image,
) {
    let r = |s: &str| Endpoint::Registry(Reference::parse(s).unwrap());
    Copier::new(pool, CopyOptions::default())
        .copy(&r(from), &r(to))
        .await
        .unwrap_or_else(|e| panic!("{from} → {to}: {e}"));
    let (repo, tag) = to.split_once('/').unwrap().1.rsplit_once(':').unwrap();
    let (bytes, _, digest) = dst.get_manifest(repo, tag).await.expect("copied");
    common::assert_bytes_eq(&bytes, &image.manifest, "manifest");
    assert_eq!(digest, image.digest);
    for blob in image.blobs() {
        let got = dst.blob(repo, &blob.digest).await.expect("blob copied");
        common::assert_bytes_eq(&got, &blob.bytes, &blob.digest);
    }
}

/// Behind a proxy, names are resolved and checked here before the proxy is
/// asked: a refused or unresolvable name never reaches it, a good registry
/// is reached through it (the copy byte for byte), `NO_PROXY` bypasses it,
/// and the proxy's own address is checked.
#[tokio::test]
async fn a_proxy_is_asked_only_after_the_guard() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let image = Image::oci(2, 71);
    push_image(&src, "app", Some("v1"), &image).await;
    let proxy = ForwardProxy::start().await;
    let (src_host, dst_host) = (
        format!("src.test:{}", src.port()),
        format!("dst.test:{}", dst.port()),
    );
    let named = [src_host.clone(), dst_host.clone()];
    let guard = Guard::private_only_for(&named).with_hosts(hosts(&[
        ("src.test", loopback()),
        ("dst.test", loopback()),
        ("meta.test", vec!["169.254.169.254".parse().unwrap()]),
        ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
        ("inside.test", loopback()),
        ("nowhere.test", vec![]),
    ]));

    let pool = proxied(&guard, &named, &proxy.url(), "");
    let (from, to) = (
        format!("{src_host}/app:v1"),
        format!("{dst_host}/mirror/app:v1"),
    );
    copy_exact(pool.clone(), &from, &to, &dst, &image).await;
    assert!(
        proxy.saw(&format!("HEAD http://{src_host}/v2/app/manifests/v1"))
            && proxy.saw(&format!("PUT http://{dst_host}/v2/mirror/app/manifests/v1")),
        "{:?}",
        proxy.seen()
    );

    proxy.reset();
    for (registry, want) in [
        (
            "meta.test:443",
            "meta.test resolves to 169.254.169.254, a cloud metadata address",
        ),
        (
            "zero.test:5000",
            "zero.test resolves to 0.0.0.0, unspecified",
        ),
        (
            "inside.test:5000",
            "inside.test resolves to 127.0.0.1, a loopback or private address",
        ),
        ("nowhere.test:5000", "nowhere.test cannot be resolved here"),
    ] {
        let e = pool
            .get(registry, Role::Source)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{registry}: {e}");
    }
    assert!(
        proxy.seen().is_empty(),
        "reached the proxy: {:?}",
        proxy.seen()
    );

    // NO_PROXY by name, and as `host:port` (the port is not matched).
    for (i, no_proxy) in ["dst.test".to_owned(), format!("other.test,{dst_host}")]
        .iter()
        .enumerate()
    {
        proxy.reset();
        let pool = proxied(&guard, &named, &proxy.url(), no_proxy);
        let to = format!("{dst_host}/direct{i}/app:v1");
        copy_exact(pool, &from, &to, &dst, &image).await;
        assert!(proxy.saw(&src_host), "{:?}", proxy.seen());
        assert!(
            !proxy.saw("dst.test"),
            "NO_PROXY={no_proxy}: {:?}",
            proxy.seen()
        );
    }

    proxy.reset();
    for url in [
        format!("http://0.0.0.0:{}", proxy.port()),
        format!("http://zero.test:{}", proxy.port()),
    ] {
        let e = proxied(&guard, &named, &url, "")
            .get(&src_host, Role::Source)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("resolves to 0.0.0.0, unspecified"), "{url}: {e}");
    }
    assert!(
        proxy.seen().is_empty(),
        "reached the proxy: {:?}",
        proxy.seen()
    );
}

/// The proxy may be on loopback as the proxy only: a Pod naming the
/// proxy's host as a registry, or a redirect to it, is refused like any
/// other loopback destination, and neither the proxy nor the sink behind it
/// is asked; so is a redirect through the proxy to a refused name.
#[tokio::test]
async fn the_proxys_host_is_allowed_as_the_proxy_only() {
    common::init();
    let (reg_port, reg_listener) = bind().await;
    let (sink_port, sink_listener) = bind().await;
    serve(reg_listener, registry, (0, sink_port));
    let sunk = serve(sink_listener, sink, (0, 0));
    let proxy = ForwardProxy::start().await;
    let registry_host = format!("registry.test:{reg_port}");
    let guard = Guard::private_only_for([registry_host.clone()]).with_hosts(hosts(&[
        ("registry.test", loopback()),
        ("proxy.test", loopback()),
        ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
    ]));

    // The proxy by name; a Pod names that name as a registry.
    let named_proxy = format!("http://proxy.test:{}", proxy.port());
    let as_registry = format!("proxy.test:{sink_port}");
    let insecure = [registry_host.clone(), as_registry.clone()];
    let pool = proxied(&guard, &insecure, &named_proxy, "");
    let e = pool
        .get(&as_registry, Role::Source)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("proxy.test resolves to 127.0.0.1, a loopback or private address"),
        "{e}"
    );
    assert!(
        proxy.seen().is_empty(),
        "reached the proxy: {:?}",
        proxy.seen()
    );

    // The proxy as a literal; a registry redirects to that address.
    let pool = proxied(&guard, &insecure, &proxy.url(), "");
    let client = pool.get(&registry_host, Role::Source).await.unwrap();
    assert!(proxy.saw(&registry_host), "{:?}", proxy.seen());
    // A redirect to the proxy's address, and one to a name resolving to a
    // refused address (checked before the proxy is asked).
    for (repo, want) in [
        (
            "proxy/app",
            "127.0.0.1 resolves to 127.0.0.1, a loopback or private address",
        ),
        ("named/app", "zero.test resolves to 0.0.0.0, unspecified"),
    ] {
        let r = Reference::parse(&format!("{registry_host}/{repo}:v1")).unwrap();
        let e = client.head_manifest(&r).await.unwrap_err().to_string();
        assert!(e.contains(want), "{repo}: {e}");
    }
    assert!(!proxy.saw("zero.test"), "{:?}", proxy.seen());
    assert!(
        !proxy.saw(&format!("127.0.0.1:{sink_port}")),
        "{:?}",
        proxy.seen()
    );
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

/// `pinswap copy` takes its proxies from the environment, in either case,
/// and `NO_PROXY` from there too.
#[tokio::test]
async fn the_cli_uses_the_environments_proxy() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let image = Image::oci(1, 72);
    push_image(&src, "app", Some("v1"), &image).await;
    let proxy = ForwardProxy::start().await;
    let run = |vars: Vec<(&'static str, String)>, to: &'static str| {
        let cache = common::cache_home();
        let mut cmd = tokio::process::Command::new(common::pinswap_bin());
        cmd.args([
            "copy",
            &format!("docker://{}/app:v1", src.host()),
            &format!("docker://{}/{to}:v1", dst.host()),
        ])
        .env("XDG_CACHE_HOME", cache.path());
        for k in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "NO_PROXY",
            "no_proxy",
        ] {
            cmd.env_remove(k);
        }
        cmd.envs(vars);
        async move {
            let out = cmd.output().await.unwrap();
            let _keep = cache;
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (code, err) = run(vec![("http_proxy", proxy.url())], "through").await;
    assert_eq!(code, Some(0), "{err}");
    let (bytes, ..) = dst.get_manifest("through", "v1").await.expect("copied");
    common::assert_bytes_eq(&bytes, &image.manifest, "manifest");
    assert!(
        proxy.saw(&format!("HEAD http://{}/v2/app/manifests/v1", src.host())),
        "{:?}",
        proxy.seen()
    );

    proxy.reset();
    let vars = vec![
        ("HTTP_PROXY", proxy.url()),
        ("NO_PROXY", "127.0.0.1".into()),
    ];
    let (code, err) = run(vars, "direct").await;
    assert_eq!(code, Some(0), "{err}");
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());

    let vars = vec![("HTTP_PROXY", "socks5://127.0.0.1:1".into())];
    let (code, err) = run(vars, "never").await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("HTTP_PROXY: the scheme is not http or https"),
        "{err}"
    );
    let vars = vec![("https_proxy", format!("http://0.0.0.0:{}", proxy.port()))];
    let (code, err) = run(vars, "never").await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("https_proxy: the proxy 0.0.0.0 resolves to 0.0.0.0, unspecified"),
        "{err}"
    );
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
}

/// A token realm the registry names is checked before any request goes
/// there: a refused literal, a name resolving to a refused address, and a
/// private name the config does not name.
#[tokio::test]
async fn token_realms_are_checked_before_the_token_request() {
    common::init();
    let reg = TestRegistry::plain().await;
    let front = Front::start(&reg.host()).await;
    let (sink_port, sink_listener) = bind().await;
    let sunk = serve(sink_listener, sink, (0, 0));
    let registry_host = format!("registry.test:{}", front.host().rsplit_once(':').unwrap().1);
    let guard = Guard::private_only_for([registry_host.clone()]).with_hosts(hosts(&[
        ("registry.test", loopback()),
        ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
        ("inside.test", loopback()),
    ]));
    let r = Reference::parse(&format!("{registry_host}/app:v1")).unwrap();
    for (realm, want) in [
        (
            format!("http://0.0.0.0:{sink_port}/token"),
            "0.0.0.0 resolves to 0.0.0.0, unspecified",
        ),
        (
            format!("http://zero.test:{sink_port}/token"),
            "zero.test resolves to 0.0.0.0, unspecified",
        ),
        (
            format!("http://inside.test:{sink_port}/token"),
            "inside.test resolves to 127.0.0.1, a loopback or private address",
        ),
    ] {
        front.set(Mode::Challenge(format!(
            r#"Bearer realm="{realm}",service="registry.test""#
        )));
        let client = pool(guard.clone(), std::slice::from_ref(&registry_host))
            .get(&registry_host, Role::Source)
            .await
            .unwrap();
        let e = client.head_manifest(&r).await.unwrap_err().to_string();
        assert!(
            e.contains("get a token for") && e.contains(want),
            "{realm}: {e}"
        );
    }
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

/// An upload `Location` the registry names is checked before the upload
/// goes there.
#[tokio::test]
async fn upload_locations_are_checked_before_the_upload() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let image = Image::oci(1, 73);
    push_image(&src, "app", Some("v1"), &image).await;
    let front = Front::start(&dst.host()).await;
    let (sink_port, sink_listener) = bind().await;
    let sunk = serve(sink_listener, sink, (0, 0));
    let src_host = format!("src.test:{}", src.port());
    let dst_host = format!("dst.test:{}", front.host().rsplit_once(':').unwrap().1);
    let named = [src_host.clone(), dst_host.clone()];
    let guard = Guard::private_only_for(&named).with_hosts(hosts(&[
        ("src.test", loopback()),
        ("dst.test", loopback()),
        ("zero.test", vec!["0.0.0.0".parse().unwrap()]),
        ("inside.test", loopback()),
    ]));
    let r = |s: String| Endpoint::Registry(Reference::parse(&s).unwrap());
    for (i, (location, want)) in [
        (
            format!("http://0.0.0.0:{sink_port}/upload/1"),
            "0.0.0.0 resolves to 0.0.0.0, unspecified",
        ),
        (
            format!("http://zero.test:{sink_port}/upload/2"),
            "zero.test resolves to 0.0.0.0, unspecified",
        ),
        (
            format!("http://inside.test:{sink_port}/upload/3"),
            "inside.test resolves to 127.0.0.1, a loopback or private address",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        front.set(Mode::Relocate(location.clone()));
        let pool = Arc::new(ClientPool::new(PoolOptions {
            insecure: named.to_vec(),
            guard: guard.clone(),
            ..PoolOptions::default()
        }));
        let e = Copier::new(pool, CopyOptions::default())
            .copy(
                &r(format!("{src_host}/app:v1")),
                &r(format!("{dst_host}/mirror/app{i}:v1")),
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{location}: {e}");
        assert!(
            front.count_method("POST", "/blobs/uploads/") > 0,
            "an upload was opened"
        );
    }
    assert!(
        sunk.lock().unwrap().is_empty(),
        "{:?}",
        sunk.lock().unwrap()
    );
}

/// The pool holds a bounded number of clients and `/v2/` answers however
/// many registries and credentials Pods bring: registries that cannot be
/// reached hold none, and a registry with thousands of credentials (a
/// rotating token) holds at most the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_is_bounded_by_registry_and_credentials() {
    use pinswap::registry::client::{MAX_CLIENTS, MAX_PROBES};
    common::init();
    let reg = TestRegistry::plain().await;
    let pool = Arc::new(ClientPool::new(PoolOptions::default()));
    // Closed ports on loopback: each connect is refused at once.
    let closed = common::registry::free_port();
    let names: Vec<String> = (0..3000u32)
        .map(|i| format!("127.0.{}.{}:{closed}", i / 250, 1 + i % 250))
        .collect();
    futures::future::join_all(names.chunks(100).map(|chunk| {
        let pool = pool.clone();
        async move {
            for name in chunk {
                let e = pool.get(name, Role::Source).await.unwrap_err();
                assert!(e.to_string().contains("cannot reach registry"), "{e}");
            }
        }
    }))
    .await;
    assert_eq!(pool.held().await, (0, 0), "failed connects hold nothing");

    for i in 0..3 * MAX_CLIENTS {
        let creds = Credentials::new("puller", format!("token-{i}"));
        pool.get_with(&reg.host(), Role::Source, Some(&creds))
            .await
            .unwrap();
    }
    let (clients, probes) = pool.held().await;
    assert!(clients <= MAX_CLIENTS, "{clients} clients");
    assert!((1..=MAX_PROBES).contains(&probes), "{probes} probes");
    let client = pool.get(&reg.host(), Role::Source).await.unwrap();
    assert_eq!(client.ping().await, Ok(()));
}

/// Counts the TCP connections a listener accepts, answering none.
fn accepts(listener: tokio::net::TcpListener) -> Arc<std::sync::atomic::AtomicUsize> {
    let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = n.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(conn);
        }
    });
    n
}

/// A registry the config names at a private address lets that host in on
/// its own port only: under `"*"`, a Pod naming another port of the
/// target's host (or of a named source's) is refused before any connection,
/// by name and by literal, while the named ports keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_private_exception_is_for_the_named_port_only() {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 8101)).await;
    let (other, listener) = bind().await;
    let accepted = accepts(listener);
    // The source is named by name, the target by literal.
    let named = format!("localhost:{}", src.port());
    let config = pinswap::config::Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"*\"}}, {{registry: \"{}\"}}]}}\ncopyPolicy: immediate\nrecovery: {{enabled: false}}\n",
            dst.host(),
            named
        ),
        "test.yaml",
    )
    .unwrap();
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = pinswap::admission::Admission::from_config(&config, metrics).unwrap();
    let wanted = format!("{named}/shop/app:v1");
    let elsewhere = [
        format!("127.0.0.1:{other}/shop/app:v1"),
        format!("localhost:{other}/shop/app:v1"),
    ];
    let slots = [
        ("named", wanted.as_str()),
        ("literal", elsewhere[0].as_str()),
        ("name", elsewhere[1].as_str()),
    ];
    let (patched, _) = common::review::admit(&adm, &common::review::pod("shop", "p", &slots)).await;
    let notes: HashMap<String, String> = serde_json::from_str(
        patched["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let image = |i: usize| patched["spec"]["containers"][i]["image"].as_str().unwrap();
    assert!(
        image(0).starts_with(&format!("{}/mirror/", dst.host())),
        "{notes:?}"
    );
    for (i, slot) in [(1, "literal"), (2, "name")] {
        assert_eq!(image(i), elsewhere[i - 1]);
        let note = &notes[&format!("containers/{slot}")];
        assert!(
            note.contains("resolves to 127.0.0.1, a loopback or private address"),
            "{slot}: {note}"
        );
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no connection to another port of a named host"
    );
}
