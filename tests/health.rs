//! Health that says why: `/readyz` names its reason and logs each change
//! once, `pinswap_admission_errors_total{cause}` counts each kind of
//! failure after a real one (registries killed, frozen, refusing
//! credentials), and `pinswap_build_info` names the build.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::metrics::{sample, total};
use common::review::{admit, create_review, pod};
use common::{Image, TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::server;
use serde_json::Value;
use tower::ServiceExt;

/// Every `cause` of `pinswap_admission_errors_total`, as documented.
const CAUSES: [&str; 6] = [
    "credentials",
    "source",
    "target",
    "budget",
    "filter",
    "reference",
];

fn admission(yaml: &str) -> (Arc<Admission>, Arc<Metrics>) {
    let config = Config::from_yaml(yaml, "test.yaml").unwrap();
    let metrics = Arc::new(Metrics::new());
    let adm = Admission::from_config(&config, metrics.clone()).unwrap();
    (Arc::new(adm), metrics)
}

/// `GET path` through `router`: (status, body).
async fn get(router: &Router, path: &str) -> (StatusCode, String) {
    let request = Request::builder().uri(path).body(Body::empty()).unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// JSON log lines written by a subscriber set for this thread (the tests
/// here run on a current-thread runtime, so every event lands here).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        tracing_subscriber::fmt()
            .json()
            .with_max_level(tracing::Level::INFO)
            .with_writer(self.clone())
            .finish()
    }

    /// The events of the health server whose message is `message`.
    fn events(&self, message: &str) -> Vec<Value> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["target"] == "pinswap::server" && e["fields"]["message"] == message)
            .collect()
    }
}

#[tokio::test]
async fn readyz_names_why_and_logs_each_change_once() {
    common::init();
    let log = Captured::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());
    let mut target = TestRegistry::plain().await;
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: registry.invalid}}]}}\n",
        target.host()
    ));
    let health = server::health_router(adm, metrics);
    for _ in 0..3 {
        assert_eq!(
            get(&health, "/readyz").await,
            (StatusCode::OK, "ok".to_owned())
        );
    }
    assert_eq!(log.events("ready").len(), 1, "the first probe is logged");

    target.kill();
    let prefix = format!("target {} unreachable: ", target.host());
    let mut answers = Vec::new();
    for _ in 0..3 {
        let (status, body) = get(&health, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            body.starts_with(&prefix) && body.len() > prefix.len(),
            "names the target and the cause: {body:?}"
        );
        assert_eq!(body.lines().count(), 1, "one line: {body:?}");
        answers.push(body);
    }
    let down = log.events("not ready");
    assert_eq!(down.len(), 1, "logged once for three probes: {down:?}");
    assert_eq!(down[0]["level"], "WARN");
    assert_eq!(down[0]["fields"]["reason"], answers[0].as_str());

    target.restart().await;
    for _ in 0..3 {
        assert_eq!(
            get(&health, "/readyz").await,
            (StatusCode::OK, "ok".to_owned())
        );
    }
    assert_eq!(log.events("ready").len(), 2, "back: logged once more");
    assert_eq!(log.events("not ready").len(), 1);
}

#[tokio::test]
async fn build_info_names_the_version_and_commit() {
    common::init();
    let (code, out, err) = common::run_pinswap(&["version", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let built: Value = serde_json::from_str(&out).unwrap();
    let commit = match built["commit"].as_str().unwrap() {
        "" => "unknown",
        c => c,
    };
    let version = built["version"].as_str().unwrap();
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"127.0.0.1:{}\"}}\nsource: {{registries: [{{registry: registry.invalid}}]}}\n",
        common::registry::free_port()
    ));
    let (status, text) = get(&server::health_router(adm, metrics), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        sample(
            &text,
            "pinswap_build_info",
            &[("version", version), ("commit", commit)]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(total(&text, "pinswap_build_info"), 1.0, "one series");
}

/// `pinswap_admission_errors_total` by cause; every cause is exposed.
fn errors(metrics: &Metrics) -> BTreeMap<&'static str, f64> {
    let text = metrics.encode();
    CAUSES
        .iter()
        .map(|c| {
            let n = sample(&text, "pinswap_admission_errors_total", &[("cause", c)]);
            (
                *c,
                n.unwrap_or_else(|| panic!("cause {c} not exposed in\n{text}")),
            )
        })
        .collect()
}

/// `n` errors of `cause`, none of any other.
fn only(cause: &str, n: f64) -> BTreeMap<&'static str, f64> {
    CAUSES
        .iter()
        .map(|c| (*c, if *c == cause { n } else { 0.0 }))
        .collect()
}

/// The `pinswap.dev/decisions` annotation of a patched Pod.
fn decisions(p: &Value) -> BTreeMap<String, String> {
    serde_json::from_str(
        p["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .expect("decisions annotation"),
    )
    .unwrap()
}

/// Admits a Pod with `image` in containers `a` and `b`; asserts both were
/// left unchanged for an error.
async fn admit_failing(adm: &Admission, image: &str) {
    let (patched, _) = admit(adm, &pod("shop", "p", &[("a", image), ("b", image)])).await;
    for (slot, note) in decisions(&patched) {
        assert!(note.starts_with("unchanged (error): "), "{slot}: {note}");
    }
}

/// A source and a target registry, `shop/app:v1` at the source, and a
/// handler mirroring one into the other with `extra` config.
async fn rig(extra: &str) -> (TestRegistry, TestRegistry, Arc<Admission>, Arc<Metrics>) {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 4401)).await;
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\nrecovery: {{enabled: false}}\n{extra}",
        dst.host(),
        src.host()
    ));
    (src, dst, adm, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_outage_counts_as_source_per_slot() {
    let (mut src, _dst, adm, metrics) = rig("").await;
    assert_eq!(errors(&metrics), only("source", 0.0));
    src.kill();
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    assert_eq!(errors(&metrics), only("source", 2.0), "one per slot");
    // The outcome counter is as before.
    let text = metrics.encode();
    assert_eq!(
        sample(
            &text,
            "pinswap_admissions_total",
            &[("outcome", "unchanged")]
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_source_credentials_count_as_credentials() {
    common::init();
    let src = TestRegistry::token_auth("puller", "Right-1").await;
    let dst = TestRegistry::plain().await;
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("password");
    std::fs::write(&password, "Wrong-1\n").unwrap();
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"{}/mirror\"}}\n\
         source: {{registries: [{{registry: \"{}\", auth: {{username: puller, passwordFile: {}}}}}]}}\n\
         recovery: {{enabled: false}}\n",
        dst.host(),
        src.host(),
        password.display()
    ));
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    assert_eq!(errors(&metrics), only("credentials", 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_outage_counts_as_target() {
    let (src, mut dst, adm, metrics) = rig("").await;
    dst.kill();
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    assert_eq!(errors(&metrics), only("target", 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_target_counts_as_budget() {
    let (src, dst, adm, metrics) = rig("server: {admissionBudget: 1s}\n").await;
    dst.freeze();
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    dst.thaw();
    assert_eq!(errors(&metrics), only("budget", 2.0));
}

#[tokio::test]
async fn a_failing_filter_counts_as_filter() {
    common::init();
    // `abs` of a string fails at run time: the filter counts as not
    // matching, and the slot goes on to the allowlist, which skips it.
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"127.0.0.1:{}\"}}\n\
         source:\n  registries: [{{registry: registry.invalid}}]\n  filters: [{{jmespath: \"abs(obj.metadata.name)\"}}]\n",
        common::registry::free_port()
    ));
    let (patched, _) = admit(&adm, &pod("shop", "p", &[("a", "ghcr.io/a/b:1")])).await;
    assert_eq!(
        decisions(&patched)["containers/a"],
        "unchanged: registry ghcr.io is not in source.registries"
    );
    assert_eq!(errors(&metrics), only("filter", 1.0));
}

#[tokio::test]
async fn a_bad_reference_counts_as_reference_when_failing_closed() {
    common::init();
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"127.0.0.1:{}\"}}\nsource: {{registries: [{{registry: \"*\"}}]}}\nfailurePolicy: closed\n",
        common::registry::free_port()
    ));
    let review = create_review(&pod("shop", "p", &[("a", "Bad/Image:x")]));
    let out = adm
        .review(serde_json::to_vec(&review).unwrap().into())
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    assert_eq!(errors(&metrics), only("reference", 1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_target_credentials_count_as_credentials() {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("mirror", "Right-2").await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 4402)).await;
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("password");
    std::fs::write(&password, "Wrong-2\n").unwrap();
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"{}/mirror\", auth: {{username: mirror, passwordFile: {}}}}}\n\
         source: {{registries: [{{registry: \"{}\"}}]}}\nrecovery: {{enabled: false}}\n",
        dst.host(),
        password.display(),
        src.host()
    ));
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    assert_eq!(errors(&metrics), only("credentials", 2.0));
}

/// Registries Pods bring under `"*"` add no metric series: each is labelled
/// `other`. A registry the config names keeps its own label, and its open
/// breaker, however many others come and go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnamed_registries_share_one_label() {
    common::init();
    let mut src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    let (adm, metrics) = admission(&format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"*\"}}, {{registry: \"{}\"}}], breaker: {{failures: 1, backoff: 5m}}}}\nrecovery: {{enabled: false}}\n\
         server: {{admissionBudget: 20s}}\n",
        dst.host(),
        src.host()
    ));
    // The budget is wide so that every refusal is counted on a loaded
    // machine: a slot cut short by the budget is never sent.
    src.kill();
    admit_failing(&adm, &format!("{}/shop/app:v1", src.host())).await;
    let host = src.host();
    let named = [("registry", host.as_str())];
    assert_eq!(
        sample(&metrics.encode(), "pinswap_source_breaker_open", &named),
        Some(1.0)
    );

    // 2000 registries no config names, at private addresses: the guard
    // refuses each before any connection, and each counts as an outage.
    let closed = common::registry::free_port();
    for round in 0..10 {
        let images: Vec<String> = (0..200)
            .map(|i| format!("10.{round}.{}.{}:{closed}/app:v1", i / 100, 1 + i % 100))
            .collect();
        let slots: Vec<(String, &str)> = images
            .iter()
            .enumerate()
            .map(|(i, img)| (format!("c{i}"), img.as_str()))
            .collect();
        let slots: Vec<(&str, &str)> = slots.iter().map(|(n, i)| (n.as_str(), *i)).collect();
        admit(&adm, &pod("shop", &format!("p{round}"), &slots)).await;
    }
    let text = metrics.encode();
    let labels: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("pinswap_source_"))
        .filter_map(|l| l.split("registry=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(
        labels,
        [host.as_str(), "other"].into_iter().collect(),
        "{text}"
    );
    assert!(
        total(&text, "pinswap_source_failures_total") >= 2000.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "pinswap_source_breaker_open", &named),
        Some(1.0),
        "{text}"
    );
}
