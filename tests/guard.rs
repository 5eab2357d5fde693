//! The outbound guard: names are checked after resolution and redirects
//! are checked on the way, with a test resolver mapping names to loopback.
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
use pinswap::reference::Reference;
use pinswap::registry::auth::Credentials;
use pinswap::registry::guard::Guard;
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
    let guard =
        Guard::private_only_for([registry_host.clone(), "cdn.test".into()]).with_hosts(hosts(&[
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
    let guard =
        Guard::private_only_for([registry_host.clone(), "cdn.test".into()]).with_hosts(hosts(&[
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
    // Two pages: the second (`last=v2`) repeats the first, which ends it.
    assert_eq!(
        *fetched.lock().unwrap(),
        vec![("/lists/tags".to_owned(), false); 2],
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
