//! `pinswap serve`: the routers in-process, then the real HTTPS server with a
//! certificate rotated under it and a graceful shutdown.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::mirror::Mirror;
use pinswap::server::{self, ServerError, ServerOptions};
use serde_json::Value;
use tower::ServiceExt;

const POD_CREATE: &str = include_str!("data/admission/pod-create.json");
const POD_CREATE_UID: &str = "705ab4f5-6393-11e8-b7cc-42010a800002";

/// An [`Admission`] built from `yaml`, with the metrics it and the routers
/// share.
fn admission_from(yaml: &str) -> (Arc<Admission>, Arc<Metrics>) {
    let config = Config::from_yaml(yaml, "test.yaml").unwrap();
    let metrics = Arc::new(Metrics::new());
    let mirror = Arc::new(Mirror::from_config(&config, metrics.clone()).unwrap());
    let admission = Admission::new(&config, mirror, metrics.clone()).unwrap();
    (Arc::new(admission), metrics)
}

/// An [`Admission`] mirroring into `target` that allows only a source no
/// fixture uses, so reviews never reach the network.
fn admission_for(target: &str) -> (Arc<Admission>, Arc<Metrics>) {
    admission_from(&format!(
        "target: {{registry: \"{target}\", insecure: true}}\n\
         source: {{registries: [{{registry: \"registry.invalid\"}}]}}\n"
    ))
}

/// An in-process registry that only answers `GET /v2/`: enough for
/// `/readyz`. Returns its `host:port`.
async fn fake_target() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/v2/", axum::routing::get(|| async { "{}" }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr.to_string()
}

/// An [`Admission`] whose target is down.
fn offline_admission() -> (Arc<Admission>, Arc<Metrics>) {
    admission_for(&format!("127.0.0.1:{}", common::registry::free_port()))
}

/// Sends one request through `router`: (status, content type, body).
async fn call(
    router: &Router,
    method: Method,
    uri: &str,
    body: Body,
) -> (StatusCode, String, String) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        content_type,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn response_uid(review: &str) -> String {
    let review: Value = serde_json::from_str(review).expect("response is JSON");
    assert_eq!(review["kind"], "AdmissionReview", "{review}");
    review["response"]["uid"]
        .as_str()
        .expect("response.uid")
        .to_owned()
}

#[tokio::test]
async fn mutate_answers_a_review_with_its_uid_and_observes_it_once() {
    let (admission, metrics) = offline_admission();
    let router = server::webhook_router(admission.clone(), metrics.clone());
    let (status, content_type, body) =
        call(&router, Method::POST, "/mutate", Body::from(POD_CREATE)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(content_type, "application/json");
    assert_eq!(response_uid(&body), POD_CREATE_UID);
    let text = metrics.encode();
    assert!(
        common::metrics::sample(&text, "pinswap_admission_duration_seconds_count", &[])
            == Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn mutate_refuses_a_body_over_4_mib() {
    let (admission, metrics) = offline_admission();
    let router = server::webhook_router(admission, metrics.clone());
    let body = Body::from(vec![b' '; 5 * 1024 * 1024]);
    let (status, _, _) = call(&router, Method::POST, "/mutate", body).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let text = metrics.encode();
    assert!(
        common::metrics::sample(&text, "pinswap_admissions_total", &[("outcome", "invalid")])
            == Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn mutate_refuses_what_is_not_a_review_and_counts_it() {
    let (admission, metrics) = offline_admission();
    let router = server::webhook_router(admission.clone(), metrics.clone());
    for body in [r#"{"not":"a review"}"#, "not json"] {
        let (status, _, message) = call(&router, Method::POST, "/mutate", Body::from(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let parse_error = message.strip_prefix("malformed AdmissionReview: ");
        assert!(
            parse_error.is_some_and(|e| !e.is_empty()),
            "{body} → {message}"
        );
    }
    // Only the versions the API server sends.
    for version in ["admission.k8s.io/v9", "v1", ""] {
        let body = POD_CREATE.replace("admission.k8s.io/v1", version);
        let (status, _, message) = call(&router, Method::POST, "/mutate", Body::from(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{version}: {message}");
        assert!(
            message.contains(
                "expected an AdmissionReview of admission.k8s.io/v1 or admission.k8s.io/v1beta1"
            ),
            "{message}"
        );
    }
    let (status, _, _) = call(&router, Method::GET, "/mutate", Body::empty()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let (status, _, _) = call(&router, Method::POST, "/validate", Body::from(POD_CREATE)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let health = server::health_router(admission, metrics);
    let (status, content_type, text) = call(&health, Method::GET, "/metrics", Body::empty()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, server::OPENMETRICS_CONTENT_TYPE);
    assert!(
        common::metrics::sample(&text, "pinswap_admissions_total", &[("outcome", "invalid")])
            == Some(5.0),
        "{text}"
    );
    assert!(
        common::metrics::sample(&text, "pinswap_admission_duration_seconds_count", &[])
            == Some(5.0),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[tokio::test]
async fn health_and_readiness_follow_the_target() {
    common::init();
    let (admission, metrics) = admission_for(&fake_target().await);
    let up = server::health_router(admission, metrics);
    let (status, _, body) = call(&up, Method::GET, "/healthz", Body::empty()).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    let (status, _, body) = call(&up, Method::GET, "/readyz", Body::empty()).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));

    let (admission, metrics) = offline_admission();
    let down = server::health_router(admission, metrics);
    let (status, _, _) = call(&down, Method::GET, "/healthz", Body::empty()).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "liveness does not depend on the target"
    );
    let (status, _, body) = call(&down, Method::GET, "/readyz", Body::empty()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.starts_with("target 127.0.0.1:"), "{body}");
}

/// Writes `ca.crt`, and `tls.crt`/`tls.key` for 127.0.0.1 signed by it, into
/// `dir`, replacing the files in place as cert-manager does.
fn write_ca_and_cert(dir: &Path, name: &str) {
    let pki = common::tls::pki(name, &["127.0.0.1"]);
    std::fs::write(dir.join(format!("{name}-ca.crt")), pki.ca_pem).unwrap();
    std::fs::write(dir.join("tls.crt"), pki.cert_pem).unwrap();
    std::fs::write(dir.join("tls.key"), pki.key_pem).unwrap();
}

/// `serve` running on free loopback ports with `dir/tls.{crt,key}`.
struct Running {
    mutate_url: String,
    healthz_url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
}

impl Running {
    async fn start(dir: &Path, (admission, metrics): (Arc<Admission>, Arc<Metrics>)) -> Self {
        common::init();
        let opts = ServerOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], common::registry::free_port())),
            health_listen: SocketAddr::from(([127, 0, 0, 1], common::registry::free_port())),
            reload_interval: Duration::from_millis(100),
            ..ServerOptions::new(dir.join("tls.crt"), dir.join("tls.key"))
        };
        let opts = ServerOptions {
            limits: server::Limits {
                shutdown_delay: Duration::from_millis(300),
                ..opts.limits.clone()
            },
            ..opts
        };
        let mutate_url = format!("https://{}/mutate", opts.listen);
        let healthz_url = format!("http://{}/healthz", opts.health_listen);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(opts, admission, metrics, async move {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(5);
        while !Self::healthy(&healthz_url).await {
            assert!(Instant::now() < deadline, "health server never came up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            mutate_url,
            healthz_url,
            stop,
            task,
        }
    }

    async fn healthy(url: &str) -> bool {
        let client = common::registry::http_client(None);
        client.get(url).send().await.is_ok()
    }

    /// Resolves the shutdown future; returns the sender's instant.
    fn shut_down(self) -> (Instant, tokio::task::JoinHandle<Result<(), ServerError>>) {
        self.stop.send(()).unwrap();
        (Instant::now(), self.task)
    }
}

/// POSTs `review` to `url` with a fresh client trusting only `ca`.
async fn post_review(url: &str, ca: &Path, review: &str) -> reqwest::Result<reqwest::Response> {
    common::registry::http_client(Some(ca))
        .post(url)
        .header("content-type", "application/json")
        .body(review.to_owned())
        .send()
        .await
}

/// Waits for `serve` to return after shutdown; asserts it did within 5 s
/// and with `Ok`.
async fn assert_stops(sent: Instant, task: tokio::task::JoinHandle<Result<(), ServerError>>) {
    let result = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("serve returned within 5 s of shutdown")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    eprintln!("serve returned {:?} after shutdown", sent.elapsed());
}

#[tokio::test]
async fn https_webhook_reloads_its_certificate_and_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    write_ca_and_cert(dir.path(), "first");
    let first_ca = dir.path().join("first-ca.crt");
    let second_ca = dir.path().join("second-ca.crt");
    let server = Running::start(dir.path(), offline_admission()).await;
    let url = server.mutate_url.clone();

    let response = post_review(&url, &first_ca, POD_CREATE)
        .await
        .expect("HTTPS with the first CA");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response_uid(&response.text().await.unwrap()),
        POD_CREATE_UID
    );

    // A client kept open across the rotation and the shutdown: its pooled
    // keep-alive connection must not hold the shutdown up.
    let kept = common::registry::http_client(Some(&first_ca));
    let response = kept.post(&url).body(POD_CREATE).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    // Rotate: a new key and certificate from a different CA, written over the
    // old files.
    write_ca_and_cert(dir.path(), "second");
    let rotated = Instant::now();
    loop {
        match post_review(&url, &second_ca, POD_CREATE).await {
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::OK);
                break;
            }
            Err(err) if rotated.elapsed() < Duration::from_secs(5) => {
                tracing::debug!(%err, "not reloaded yet");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("the new certificate was not served after 5 s: {err}"),
        }
    }
    eprintln!("certificate reloaded after {:?}", rotated.elapsed());
    let err = post_review(&url, &first_ca, POD_CREATE)
        .await
        .expect_err("a new connection must not validate with the old CA");
    assert!(err.is_connect(), "{err:?}");

    let healthz_url = server.healthz_url.clone();
    let (sent, task) = server.shut_down();
    assert_stops(sent, task).await;
    assert!(
        !Running::healthy(&healthz_url).await,
        "health listener closed"
    );
    drop(kept);
}

#[tokio::test]
async fn shutdown_finishes_the_review_in_flight() {
    // A source and a target that accept connections and never answer: the
    // source's wait ends at half the budget, the target's stand-in lookup
    // then waits out the rest of the 1.5 s budget, and the Pod is admitted
    // unchanged (fail open).
    let mut holes = Vec::new();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..2 {
        let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        holes.push(black_hole.local_addr().unwrap());
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = black_hole.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(stream);
            }
        });
    }
    let (source, target) = (holes[0], holes[1]);
    let admission = admission_from(&format!(
        "target: {{registry: \"{target}\", insecure: true}}\n\
         source: {{registries: [{{registry: \"{source}\", insecure: true}}]}}\n\
         server: {{admissionBudget: 1500ms}}\n"
    ));
    let review = POD_CREATE.replace("nginx:1.27", &format!("{source}/shop/web:1.0"));
    let dir = tempfile::tempdir().unwrap();
    write_ca_and_cert(dir.path(), "only");
    let server = Running::start(dir.path(), admission).await;
    let (url, healthz_url) = (server.mutate_url.clone(), server.healthz_url.clone());

    let ca = dir.path().join("only-ca.crt");
    let started = Instant::now();
    let in_flight = tokio::spawn(async move { post_review(&url, &ca, &review).await });
    // The review is in flight once it has reached the source.
    while accepted.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the review never reached the source"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (sent, task) = server.shut_down();
    let readyz = healthz_url.replace("/healthz", "/readyz");
    let ready = common::registry::http_client(None)
        .get(&readyz)
        .send()
        .await
        .unwrap();
    assert_eq!(
        ready.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "readiness fails at once"
    );
    assert_eq!(ready.text().await.unwrap(), "shutting down");
    assert!(
        Running::healthy(&healthz_url).await,
        "liveness holds during the delay"
    );
    assert!(
        !in_flight.is_finished(),
        "the review should still be running"
    );

    let response = in_flight
        .await
        .unwrap()
        .expect("the review in flight is answered");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response_uid(&response.text().await.unwrap()),
        POD_CREATE_UID
    );
    eprintln!("review in flight answered after {:?}", started.elapsed());
    assert!(
        started.elapsed() >= Duration::from_millis(1300),
        "it waited for its budget (decisions stop a tenth early)"
    );
    assert_stops(sent, task).await;
    assert!(!Running::healthy(&healthz_url).await, "health stops last");
}

#[tokio::test]
async fn startup_errors_name_the_address_or_the_files() {
    common::init();
    let dir = tempfile::tempdir().unwrap();
    let opts = ServerOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], common::registry::free_port())),
        health_listen: SocketAddr::from(([127, 0, 0, 1], common::registry::free_port())),
        ..ServerOptions::new(dir.path().join("tls.crt"), dir.path().join("tls.key"))
    };
    let never = std::future::pending::<()>;
    let (admission, metrics) = offline_admission();

    let err = server::serve(opts.clone(), admission.clone(), metrics.clone(), never())
        .await
        .unwrap_err();
    assert!(matches!(err, ServerError::Tls { .. }), "{err:?}");
    assert!(err.to_string().contains("tls.crt"), "{err}");

    write_ca_and_cert(dir.path(), "only");
    let taken = std::net::TcpListener::bind(opts.health_listen).unwrap();
    let err = server::serve(opts.clone(), admission, metrics, never())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ServerError::Bind { what: "health", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&opts.health_listen.to_string()),
        "{err}"
    );
    drop(taken);
}

/// An [`Admission`] with `cache.purgeEndpoint` set to `on`, its existence
/// cache holding two digests of one repository and one of another.
async fn with_cached_entries(on: bool) -> (Arc<Admission>, Arc<Metrics>) {
    let (admission, metrics) = admission_from(&format!(
        "target: {{registry: \"mirror.example/m\"}}\n\
         source: {{registries: [{{registry: docker.io}}]}}\n\
         cache: {{purgeEndpoint: {on}}}\n"
    ));
    for (repo, d) in [("app", 'a'), ("app", 'b'), ("db", 'a')] {
        let r = pinswap::reference::Reference::parse(&format!(
            "mirror.example/m/docker.io/library/{repo}:v1@sha256:{}",
            d.to_string().repeat(64)
        ))
        .unwrap();
        admission.mirror().caches().verified(&r).await;
    }
    (admission, metrics)
}

#[tokio::test]
async fn cache_purge_selects_entries_and_refuses_bad_requests() {
    let (admission, metrics) = with_cached_entries(true).await;
    let health = server::health_router(admission.clone(), metrics);
    let post = |body: &'static str| {
        let health = health.clone();
        async move { call(&health, Method::POST, "/cache/purge", Body::from(body)).await }
    };
    let (status, _, text) = call(&health, Method::GET, "/metrics", Body::empty()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        common::metrics::sample(&text, "pinswap_cache_entries", &[("cache", "existence")])
            == Some(3.0),
        "{text}"
    );

    for (body, want) in [
        (r#"{"reference": "nginx"}"#, "purged 0"),
        // A source: its mirror's entries, every digest when untagged.
        (r#"{"reference": "docker.io/library/app"}"#, "purged 2"),
        (r#"{"all": true}"#, "purged 1"),
    ] {
        let (status, _, text) = post(body).await;
        assert_eq!(status, StatusCode::OK, "{body}: {text}");
        let n: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(format!("purged {}", n["purged"]), want, "{body}");
    }
    assert!(admission.mirror().caches().existence_entries().is_empty());
    let (_, _, text) = call(&health, Method::GET, "/metrics", Body::empty()).await;
    assert!(
        common::metrics::sample(
            &text,
            "pinswap_cache_invalidations_total",
            &[("cache", "existence"), ("cause", "purge")]
        ) == Some(3.0),
        "{text}"
    );
    assert!(
        common::metrics::sample(&text, "pinswap_cache_entries", &[("cache", "existence")])
            == Some(0.0),
        "{text}"
    );

    for (body, want) in [
        ("", "expected {\"all\": true} or {\"reference\": \"REF\"}"),
        (r#"{"all": true, "reference": "x"}"#, "exactly one of"),
        (r#"{"all": false}"#, "exactly one of"),
        (r#"{"ref": "x"}"#, "unknown field `ref`"),
        (r#"{"reference": "Bad:Ref"}"#, "reference: "),
    ] {
        let (status, _, text) = post(body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        assert!(text.contains(want), "{body}: {text}");
    }
}

#[tokio::test]
async fn cache_purge_is_off_unless_configured() {
    let (admission, metrics) = with_cached_entries(false).await;
    let health = server::health_router(admission.clone(), metrics);
    let (status, _, text) = call(
        &health,
        Method::POST,
        "/cache/purge",
        Body::from(r#"{"all":true}"#),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(text.contains("cache.purgeEndpoint: true"), "{text}");
    assert_eq!(
        admission.mirror().caches().existence_entries().len(),
        3,
        "nothing purged"
    );
}

#[tokio::test]
async fn the_cache_purge_command_talks_to_the_health_port() {
    for on in [true, false] {
        let (admission, metrics) = with_cached_entries(on).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = server::health_router(admission.clone(), metrics);
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let target_repo = "mirror.example/m/docker.io/library/db";
        let (code, stdout, stderr) =
            common::run_pinswap(&["cache", "purge", target_repo, "--server", &url]).await;
        if on {
            assert_eq!(
                (code, stdout.as_str()),
                (0, "purged 1 cache entries\n"),
                "{stderr}"
            );
            let (code, stdout, _) =
                common::run_pinswap(&["cache", "purge", "--all", "--server", &url]).await;
            assert_eq!((code, stdout.as_str()), (0, "purged 2 cache entries\n"));
        } else {
            assert_eq!(code, 1, "{stderr}");
            assert!(
                stderr.contains("404 Not Found: cache purge is off"),
                "{stderr}"
            );
        }
    }
    let (code, _, stderr) = common::run_pinswap(&["cache", "purge", "Bad:Ref"]).await;
    assert_eq!(code, 2, "{stderr}");
    let (code, _, stderr) = common::run_pinswap(&["cache", "purge"]).await;
    assert_eq!(code, 2, "neither --all nor REF: {stderr}");
    let (code, _, stderr) =
        common::run_pinswap(&["cache", "purge", "--all", "--server", "http://127.0.0.1:1"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("POST http://127.0.0.1:1/cache/purge"),
        "{stderr}"
    );
}

/// SIGTERM to `pinswap serve` while a background copy runs (its layers
/// held by a stalled source): the process stops, and the target holds no
/// manifest of the image, by tag or by digest; the released source then
/// completes nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_copy_in_flight_leaves_no_manifest_at_the_target() {
    use common::fixtures::Image;
    common::init();
    let (src, dst) = (
        common::TestRegistry::plain().await,
        common::TestRegistry::plain().await,
    );
    let proxy = common::TcpCutProxy::start(&src.host()).await;
    let image = Image::random_layers(2, 1 << 20, 1031);
    common::push_image(&src, "slow/app", Some("v1"), &image).await;
    // Manifests and the config pass; the layers stall.
    proxy.stall_after(256 * 1024);
    let head = format!(
        "target: {{registry: \"{}/mirror\"}}\n\
         source: {{registries: [{{registry: \"{}\"}}]}}\n\
         copyPolicy: delayed\nrecovery: {{enabled: false}}\n",
        dst.host(),
        proxy.host()
    );
    let mut s =
        common::serve::Served::start_with(&head, "shutdownDelay: 0s, drainTimeout: 2s", &[], None)
            .await;
    let source = format!("{}/slow/app:v1", proxy.host());
    let pod = common::review::pod("apps", "slow", &[("app", &source)]);
    let review = serde_json::to_string(&common::review::create_review(&pod)).unwrap();
    let answer: Value = s
        .send(&s.client(), &review)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    // The copy is in flight: both layers have reached the stall.
    let start = Instant::now();
    while proxy.bytes_down() < 2 * 256 * 1024 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the copy never reached the layers: {}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let repo = format!("mirror/{}/slow/app", proxy.host().replace(':', "_"));
    assert_eq!(dst.head_manifest(&repo, &image.digest).await, None);

    s.sigterm();
    let status = tokio::time::timeout(Duration::from_secs(20), s.child.wait())
        .await
        .expect("serve exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}: {}", s.log_text());
    proxy.release();
    assert!(
        dst.tags(&repo).await.is_empty(),
        "{:?}",
        dst.tags(&repo).await
    );
    assert_eq!(dst.head_manifest(&repo, "v1").await, None);
    assert_eq!(dst.head_manifest(&repo, &image.digest).await, None);
    for layer in &image.layers {
        assert!(!dst.blob_exists(&repo, &layer.digest).await, "a held layer");
    }
}
