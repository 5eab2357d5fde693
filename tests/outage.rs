//! Source outages: the target is the authority for what it holds. With the
//! source killed, frozen (SIGSTOP), or behind a front answering 429 or 503,
//! images the target holds are still rewritten to their pinned mirror
//! digests, on a warm replica and on a fresh one; digests the target holds
//! never reach the source; a circuit breaker bounds the attempts; and a
//! copy that waited for the source completes when it returns.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::front::{Front, Mode};
use common::metrics::sample;
use common::review::{admit, pod};
use common::{Image, Index, TestRegistry, push_image, push_index};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::Value;

/// The images every case uses, at the source.
struct Images {
    app: Image,
    index: Index,
    spin: Image,
    /// At the source only: never mirrored.
    fresh: Image,
}

async fn seed(src: &TestRegistry) -> Images {
    let i = Images {
        app: Image::oci(2, 901),
        index: Index::oci(902, false),
        spin: Image::spin("outage", 1, None),
        fresh: Image::oci(1, 903),
    };
    push_image(src, "shop/app", Some("v1"), &i.app).await;
    push_index(src, "shop/multi", Some("v1"), &i.index).await;
    push_image(src, "spin/app", Some("v1"), &i.spin).await;
    push_image(src, "shop/fresh", Some("v1"), &i.fresh).await;
    i
}

/// A handler mirroring `source` into `target/mirror`; `breaker` is the
/// `source.breaker` flow mapping (empty for the defaults), `extra` more
/// top-level keys.
fn admission(source: &str, target: &str, breaker: &str, extra: &str) -> (Admission, Arc<Metrics>) {
    let breaker = match breaker {
        "" => String::new(),
        b => format!("  breaker: {b}\n"),
    };
    // Referrers off: these count the source's requests for images alone.
    let yaml = format!(
        "target: {{registry: \"{target}/mirror\"}}\nsource:\n  registries: [{{registry: \"{source}\"}}]\n{breaker}referrers: false\n{extra}"
    );
    let metrics = Arc::new(Metrics::new());
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let adm = Admission::from_config(&config, metrics.clone()).unwrap();
    (adm, metrics)
}

/// Two registries, the images at the source, and a front before it.
async fn rig() -> (TestRegistry, TestRegistry, Images, Front) {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    let i = seed(&src).await;
    let front = Front::start(&src.host()).await;
    (src, dst, i, front)
}

/// The containers of the outage Pod: (name, image as written).
fn slots(host: &str, i: &Images) -> Vec<(&'static str, String)> {
    vec![
        ("tag", format!("{host}/shop/app:v1")),
        ("digest", format!("{host}/shop/app@{}", i.app.digest)),
        ("both", format!("{host}/shop/app:v1@{}", i.app.digest)),
        ("index", format!("{host}/shop/multi:v1")),
        (
            "index-digest",
            format!("{host}/shop/multi@{}", i.index.digest),
        ),
        ("spin", format!("{host}/spin/app:v1")),
    ]
}

/// What each slot must become: the mirror path pinned to the digest.
fn mirrored(target: &str, host: &str, i: &Images) -> BTreeMap<&'static str, String> {
    let m = format!("{target}/mirror/{}", host.replace(':', "_"));
    BTreeMap::from([
        ("tag", format!("{m}/shop/app:v1@{}", i.app.digest)),
        ("digest", format!("{m}/shop/app@{}", i.app.digest)),
        ("both", format!("{m}/shop/app:v1@{}", i.app.digest)),
        ("index", format!("{m}/shop/multi:v1@{}", i.index.digest)),
        ("index-digest", format!("{m}/shop/multi@{}", i.index.digest)),
        ("spin", format!("{m}/spin/app:v1@{}", i.spin.digest)),
    ])
}

fn the_pod(host: &str, i: &Images, extra: &[(&'static str, String)]) -> Value {
    let mut all = slots(host, i);
    all.extend(extra.iter().cloned());
    let refs: Vec<(&str, &str)> = all.iter().map(|(n, s)| (*n, s.as_str())).collect();
    pod("shop", "outage", &refs)
}

fn images(p: &Value) -> BTreeMap<String, String> {
    p["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                c["image"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn decisions(p: &Value) -> BTreeMap<String, String> {
    p["metadata"]["annotations"]["pinswap.dev/decisions"]
        .as_str()
        .map(|s| serde_json::from_str(s).unwrap())
        .unwrap_or_default()
}

/// Mirrors every image of the Pod while the source is healthy. A copy
/// that outlasts one admission's budget (a loaded machine) goes on in the
/// background, so the Pod is admitted again until every slot is rewritten.
async fn mirror_all(adm: &Admission, host: &str, target: &str, i: &Images) {
    let want = mirrored(target, host, i);
    let mut got = BTreeMap::new();
    for _ in 0..50 {
        let (patched, _) = admit(adm, &the_pod(host, i, &[])).await;
        got = images(&patched);
        if want.iter().all(|(slot, w)| &got[*slot] == w) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("not every image mirrored while healthy: {got:?}");
}

/// Admits the outage Pod plus a never-mirrored image and checks that every
/// held image is rewritten to its pinned mirror digest with its note, and
/// that the never-mirrored one is left unchanged and says why.
async fn assert_rewritten_from_the_target(
    adm: &Admission,
    metrics: &Metrics,
    host: &str,
    target: &str,
    i: &Images,
    cause: &str,
    case: &str,
) {
    let before = sample(
        &metrics.encode(),
        "pinswap_rewrites_total",
        &[("reason", "source_down")],
    )
    .unwrap_or(0.0);
    let fresh = format!("{host}/shop/fresh:v1");
    let (patched, response) = admit(adm, &the_pod(host, i, &[("fresh", fresh.clone())])).await;
    let got = images(&patched);
    let notes = decisions(&patched);
    for (slot, want) in mirrored(target, host, i) {
        assert_eq!(got[slot], want, "{case}: {slot}: {notes:?} {response}");
    }
    for slot in ["tag", "index", "spin"] {
        let note = &notes[&format!("containers/{slot}")];
        assert!(
            note.starts_with("rewritten: source unreachable (")
                && note.contains(cause)
                && note.ends_with("); pinned to the mirror's copy of v1"),
            "{case}: {slot}: {note}"
        );
    }
    for slot in ["digest", "both", "index-digest"] {
        assert_eq!(
            notes[&format!("containers/{slot}")],
            "rewritten: present at the target",
            "{case}: {slot}"
        );
    }
    assert_eq!(got["fresh"], fresh, "{case}: never mirrored: unchanged");
    let note = &notes["containers/fresh"];
    assert!(
        note.starts_with("unchanged (error): source registry")
            && note.contains("the target has no copy of this image yet"),
        "{case}: {note}"
    );
    // The tag slots' pinned sources are recorded for recovery.
    let sources: BTreeMap<String, String> = serde_json::from_str(
        patched["metadata"]["annotations"]["pinswap.dev/sources"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        sources["containers/tag"],
        format!("{host}/shop/app:v1@{}", i.app.digest)
    );
    let after = sample(
        &metrics.encode(),
        "pinswap_rewrites_total",
        &[("reason", "source_down")],
    )
    .unwrap();
    assert_eq!(after - before, 3.0, "{case}: three tag slots stood in");
}

/// One fault, warm and fresh: the replica that mirrored the images (its
/// resolution cache off, as after `resolutionTtl`), then a new process
/// with empty caches.
async fn outage_case(fault: &str) {
    let (mut src, dst, i, front) = rig().await;
    // Kill and freeze act on the registry itself; the front's refusals
    // stand for a registry that answers with an error.
    let host = match fault {
        "killed" | "frozen" => src.host(),
        _ => front.host(),
    };
    let extra = "copyPolicy: immediate\ncache: {resolutionTtl: 0s}\n";
    let (warm, warm_metrics) = admission(&host, &dst.host(), "", extra);
    mirror_all(&warm, &host, &dst.host(), &i).await;
    let cause = match fault {
        "killed" => {
            src.kill();
            "connection refused"
        }
        "frozen" => {
            src.freeze();
            "no answer within "
        }
        "429" => {
            front.set(Mode::Refuse(429, Some(30)));
            "HTTP 429 TOOMANYREQUESTS"
        }
        _ => {
            front.set(Mode::Refuse(503, None));
            "HTTP 503"
        }
    };
    assert_rewritten_from_the_target(&warm, &warm_metrics, &host, &dst.host(), &i, cause, "warm")
        .await;
    let (fresh, fresh_metrics) = admission(&host, &dst.host(), "", extra);
    assert_rewritten_from_the_target(
        &fresh,
        &fresh_metrics,
        &host,
        &dst.host(),
        &i,
        cause,
        "fresh",
    )
    .await;
    let text = fresh_metrics.encode();
    let registry = [("registry", host.as_str())];
    let failures: f64 = ["unreachable", "timeout", "rate_limited", "server_error"]
        .iter()
        .filter_map(|c| {
            sample(
                &text,
                "pinswap_source_failures_total",
                &[("registry", &host), ("cause", c)],
            )
        })
        .sum();
    assert!(failures >= 1.0, "{text}");
    if fault == "429" {
        // A 429 opens the breaker at once.
        assert_eq!(
            sample(&text, "pinswap_source_breaker_open", &registry),
            Some(1.0),
            "{text}"
        );
    }
    if fault == "frozen" {
        src.thaw();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_source_rewrites_to_the_mirror() {
    outage_case("killed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_source_rewrites_to_the_mirror_within_the_budget() {
    outage_case("frozen").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limited_source_rewrites_to_the_mirror() {
    outage_case("429").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_source_rewrites_to_the_mirror() {
    outage_case("503").await;
}

/// A healthy source gets no request at all for digest references the
/// target holds, on a fresh replica: no `/v2/` probe, no HEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digests_the_target_holds_never_reach_the_source() {
    let (_src, dst, i, front) = rig().await;
    let host = front.host();
    let (warm, _) = admission(&host, &dst.host(), "", "copyPolicy: immediate\n");
    mirror_all(&warm, &host, &dst.host(), &i).await;
    front.reset();
    let (fresh, metrics) = admission(&host, &dst.host(), "", "copyPolicy: immediate\n");
    let digests: Vec<(&str, String)> = slots(&host, &i)
        .into_iter()
        .filter(|(n, _)| ["digest", "both", "index-digest"].contains(n))
        .collect();
    let refs: Vec<(&str, &str)> = digests.iter().map(|(n, s)| (*n, s.as_str())).collect();
    let (patched, _) = admit(&fresh, &pod("shop", "pinned", &refs)).await;
    let want = mirrored(&dst.host(), &host, &i);
    let got = images(&patched);
    for (slot, _) in &digests {
        assert_eq!(got[*slot], want[slot], "{slot}");
    }
    assert_eq!(front.total(), 0, "the source was asked");
    assert_eq!(
        sample(
            &metrics.encode(),
            "pinswap_rewrites_total",
            &[("reason", "present")]
        ),
        Some(3.0)
    );
}

/// After `failures` outages the breaker opens: further admissions go
/// straight to the target, so a failing source sees a bounded number of
/// requests, not one per admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_bounds_requests_to_a_failing_source() {
    let (_src, dst, i, front) = rig().await;
    let host = front.host();
    let (adm, metrics) = admission(
        &host,
        &dst.host(),
        "{failures: 3, backoff: 1m}",
        "copyPolicy: immediate\ncache: {resolutionTtl: 0s}\n",
    );
    let tag = format!("{host}/shop/app:v1");
    let want = mirrored(&dst.host(), &host, &i)["tag"].clone();
    let (patched, _) = admit(&adm, &pod("shop", "p", &[("tag", tag.as_str())])).await;
    assert_eq!(images(&patched)["tag"], want);

    front.set(Mode::Refuse(503, None));
    front.reset();
    for n in 0..10 {
        let (patched, _) = admit(&adm, &pod("shop", "p", &[("tag", tag.as_str())])).await;
        assert_eq!(images(&patched)["tag"], want, "admission {n}");
    }
    let manifests = front.count("/manifests/");
    assert_eq!(manifests, 3, "three failures open the breaker");
    let text = metrics.encode();
    assert_eq!(
        sample(
            &text,
            "pinswap_source_breaker_open",
            &[("registry", host.as_str())]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "pinswap_source_failures_total",
            &[("registry", host.as_str()), ("cause", "server_error")]
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "pinswap_rewrites_total",
            &[("reason", "source_down")]
        ),
        Some(10.0)
    );
}

/// While the breaker is half-open one admission probes the source and waits
/// out `source.timeout`; others asking for the same tag meanwhile do not
/// wait on that probe's lookup (the resolution cache would make them join
/// it) but are answered from the target's copy at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admissions_do_not_wait_for_the_breakers_probe() {
    let (src, dst, i, front) = rig().await;
    let host = front.host();
    let (adm, _) = admission(
        &host,
        &dst.host(),
        "{failures: 1, backoff: 1s}",
        "copyPolicy: immediate\ncache: {resolutionTtl: 1s}\n",
    );
    let adm = Arc::new(adm);
    let tag = format!("{host}/shop/app:v1");
    let want = mirrored(&dst.host(), &host, &i)["tag"].clone();
    let the_pod = pod("shop", "p", &[("tag", tag.as_str())]);
    let (patched, _) = admit(&adm, &the_pod).await;
    assert_eq!(images(&patched)["tag"], want);

    src.freeze();
    // The resolution expires, then one admission's lookup opens the breaker.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (patched, _) = admit(&adm, &the_pod).await;
    assert_eq!(images(&patched)["tag"], want, "stood in after the failure");
    // The breaker's window (1s) ends: the next lookup is the probe.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let seen = front.count("/manifests/");
    let probe = tokio::spawn({
        let (adm, the_pod) = (adm.clone(), the_pod.clone());
        async move { admit(&adm, &the_pod).await }
    });
    common::wait_until(
        "the probe reaches the source",
        Duration::from_secs(5),
        || front.count("/manifests/") > seen,
    )
    .await;
    let (patched, _) = admit(&adm, &the_pod).await;
    assert!(
        !probe.is_finished(),
        "an admission during the probe waited for it"
    );
    assert_eq!(images(&patched)["tag"], want, "stood in during the probe");
    let note = &decisions(&patched)["containers/tag"];
    assert!(
        note.starts_with("rewritten: source unreachable (circuit breaker open"),
        "{note}"
    );
    let (patched, _) = probe.await.unwrap();
    assert_eq!(images(&patched)["tag"], want, "the probe stood in too");
    src.thaw();
}

/// A `delayed` copy asked for while the source cannot answer waits, and
/// completes once the source answers again; meanwhile the Pod is left
/// unchanged with a note that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_copy_completes_when_the_source_returns() {
    let (_src, dst, i, front) = rig().await;
    let host = front.host();
    let (adm, _) = admission(
        &host,
        &dst.host(),
        "{failures: 1, backoff: 200ms, maxBackoff: 1s}",
        "",
    );
    let token = tokio_util::sync::CancellationToken::new();
    tokio::spawn(adm.mirror().clone().resume_copies(token.clone()));

    front.set(Mode::Refuse(429, Some(1)));
    let image = format!("{host}/shop/fresh@{}", i.fresh.digest);
    let (patched, _) = admit(&adm, &pod("shop", "p", &[("c", image.as_str())])).await;
    assert_eq!(images(&patched)["c"], image, "not at the target: unchanged");
    let note = &decisions(&patched)["containers/c"];
    assert!(note.contains("cannot answer"), "{note}");
    let repo = format!("mirror/{}/shop/fresh", host.replace(':', "_"));
    assert!(dst.head_manifest(&repo, &i.fresh.digest).await.is_none());

    front.set(Mode::Pass);
    // Done when the anchor tag names it (the registry shows a manifest by
    // digest a moment before the tag pushed with it).
    let anchor = format!("pinswap-{}", i.fresh.digest.trim_start_matches("sha256:"));
    let mut tagged = None;
    for _ in 0..200 {
        tagged = dst.head_manifest(&repo, &anchor).await;
        if tagged.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        tagged.as_deref(),
        Some(i.fresh.digest.as_str()),
        "the waiting copy completed"
    );
    let (bytes, _, digest) = dst.get_manifest(&repo, &i.fresh.digest).await.unwrap();
    assert_eq!(digest, i.fresh.digest);
    assert!(bytes == i.fresh.manifest, "byte for byte");
    let (patched, _) = admit(&adm, &pod("shop", "p", &[("c", image.as_str())])).await;
    assert_eq!(
        images(&patched)["c"],
        format!("{}/{repo}@{}", dst.host(), i.fresh.digest),
        "{:?}",
        decisions(&patched)
    );
    assert_eq!(adm.mirror().copies_waiting_for_source(), 0);
    token.cancel();
}

/// `failurePolicy: closed` keeps its meaning under an outage: an image the
/// target holds is rewritten, one it lacks denies the Pod naming the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policy_closed_denies_only_what_the_target_lacks() {
    let (mut src, dst, i, _front) = rig().await;
    let host = src.host();
    let (adm, _) = admission(
        &host,
        &dst.host(),
        "",
        "copyPolicy: immediate\nfailurePolicy: closed\ncache: {resolutionTtl: 0s}\n",
    );
    mirror_all(&adm, &host, &dst.host(), &i).await;
    src.kill();
    let tag = format!("{host}/shop/app:v1");
    let (patched, _) = admit(&adm, &pod("shop", "held", &[("tag", tag.as_str())])).await;
    assert_eq!(
        images(&patched)["tag"],
        mirrored(&dst.host(), &host, &i)["tag"]
    );
    let fresh = format!("{host}/shop/fresh:v1");
    let body = serde_json::to_vec(&common::review::create_review(&pod(
        "shop",
        "lacking",
        &[("fresh", fresh.as_str())],
    )))
    .unwrap();
    let out: Value = serde_json::from_slice(&adm.review(body.into()).await.unwrap()).unwrap();
    assert_eq!(out["response"]["allowed"], false, "{out}");
    let message = out["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains(&fresh) && message.contains("cannot answer (connection refused)"),
        "{message}"
    );
}

/// During an outage every admission of an image starts a copy that fails
/// at once; none of those spends one of the resume queue's retries, so
/// after far more admissions than retries the copy still completes when
/// the source returns, with no admission after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admissions_during_an_outage_spend_no_retries() {
    let (_src, dst, i, front) = rig().await;
    let host = front.host();
    let (adm, metrics) = admission(
        &host,
        &dst.host(),
        "{failures: 1, backoff: 2s, maxBackoff: 2s}",
        "",
    );
    let token = tokio_util::sync::CancellationToken::new();
    tokio::spawn(adm.mirror().clone().resume_copies(token.clone()));
    front.set(Mode::Refuse(503, None));
    let image = format!("{host}/shop/fresh@{}", i.fresh.digest);
    // One more failed copy than the retries allowed, each done before the
    // next admission (so none joins another's copy).
    let failed = || sample(&metrics.encode(), "pinswap_copies_failed_total", &[]).unwrap_or(0.0);
    for n in 1..=11 {
        let (patched, _) = admit(&adm, &pod("shop", "p", &[("c", image.as_str())])).await;
        assert_eq!(images(&patched)["c"], image);
        let start = std::time::Instant::now();
        while failed() < f64::from(n) {
            assert!(start.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(failed(), 11.0);
    assert_eq!(adm.mirror().copies_waiting_for_source(), 1, "still waiting");
    front.set(Mode::Pass);
    let repo = format!("mirror/{}/shop/fresh", host.replace(':', "_"));
    let anchor = format!("pinswap-{}", i.fresh.digest.trim_start_matches("sha256:"));
    let mut tagged = None;
    for _ in 0..100 {
        tagged = dst.head_manifest(&repo, &anchor).await;
        if tagged.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        tagged.as_deref(),
        Some(i.fresh.digest.as_str()),
        "the waiting copy was retried and completed"
    );
    token.cancel();
}

/// The copy that probes a half-open breaker asks one HEAD first, so the
/// breaker closes as soon as the source answers, not when the copy ends:
/// here the copy's layer is held mid-transfer, and the breaker is closed
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_probing_the_breaker_does_not_hold_it_half_open() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let big = Image::random_layers(1, 4 * 1024 * 1024, 7331);
    push_image(&src, "shop/big", Some("v1"), &big).await;
    let front = Front::start(&src.host()).await;
    let proxy = common::TcpCutProxy::start(&front.host()).await;
    let host = proxy.host();
    let (adm, metrics) = admission(
        &host,
        &dst.host(),
        "{failures: 1, backoff: 200ms, maxBackoff: 1s}",
        "",
    );
    let token = tokio_util::sync::CancellationToken::new();
    tokio::spawn(adm.mirror().clone().resume_copies(token.clone()));
    front.set(Mode::Refuse(503, None));
    let image = format!("{host}/shop/big@{}", big.digest);
    let (patched, _) = admit(&adm, &pod("shop", "p", &[("c", image.as_str())])).await;
    assert!(
        decisions(&patched)["containers/c"].contains("the copy waits for it"),
        "{:?}",
        decisions(&patched)
    );
    let open = || {
        sample(
            &metrics.encode(),
            "pinswap_source_breaker_open",
            &[("registry", host.as_str())],
        )
    };
    assert_eq!(open(), Some(1.0));
    // The background copy fails at once and waits.
    for _ in 0..100 {
        if adm.mirror().copies_waiting_for_source() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(adm.mirror().copies_waiting_for_source(), 1);
    // The layer (4 MiB) is held after 256 KiB; manifests and HEADs pass.
    proxy.stall_after(256 * 1024);
    front.set(Mode::Pass);
    let start = std::time::Instant::now();
    while front.count_method("GET", "/blobs/") == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no retry");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Well past the 256 KiB: the copy is held mid-layer now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = metrics.encode();
    let count = |name: &str| sample(&text, name, &[]).unwrap_or(0.0);
    assert_eq!(
        count("pinswap_copies_started_total")
            - count("pinswap_copies_succeeded_total")
            - count("pinswap_copies_failed_total"),
        1.0,
        "the retry is still copying: {text}"
    );
    let repo = format!("mirror/{}/shop/big", host.replace(':', "_"));
    assert!(dst.head_manifest(&repo, &big.digest).await.is_none());
    assert_eq!(
        open(),
        Some(0.0),
        "the breaker closed when its probe was answered, before the copy ended"
    );
    proxy.release();
    let anchor = format!("pinswap-{}", big.digest.trim_start_matches("sha256:"));
    let mut tagged = None;
    for _ in 0..100 {
        tagged = dst.head_manifest(&repo, &anchor).await;
        if tagged.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        tagged.as_deref(),
        Some(big.digest.as_str()),
        "{}",
        metrics.encode()
    );
    token.cancel();
}

/// Admits a Pod of one container `image` to `adm` until it is rewritten
/// (a copy may outlast one admission's budget); returns the rewrite.
async fn mirror_one(adm: &Admission, image: &str) -> String {
    for _ in 0..50 {
        let (patched, _) = admit(adm, &pod("shop", "one", &[("c", image)])).await;
        let got = images(&patched)["c"].clone();
        if got != image {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{image} not mirrored while healthy");
}

/// Under a platform filter or identity repair the mirror's copy has a
/// digest of its own. With the source frozen, a fresh replica (no record
/// of what the first one planned) pins digest reference `image` to the
/// copy the first replica made, and asks the source nothing; a replica
/// under `other_setting` does not take that copy.
async fn reshaped_copy_case(setting: &str, other_setting: &str, image: &str, source_digest: &str) {
    let (src, dst, _i, front) = rig().await;
    let host = front.host();
    let image = format!("{host}/{image}");
    let extra = |s: &str| format!("copyPolicy: immediate\n{s}");
    let (first, _) = admission(&host, &dst.host(), "", &extra(setting));
    let pinned = mirror_one(&first, &image).await;
    let (_, digest) = pinned.rsplit_once('@').unwrap();
    assert_ne!(digest, source_digest, "the mirror's copy differs: {pinned}");
    src.freeze();
    front.reset();
    let (fresh, metrics) = admission(&host, &dst.host(), "", &extra(setting));
    let (patched, response) = admit(&fresh, &pod("shop", "fresh", &[("c", &image)])).await;
    assert_eq!(
        images(&patched)["c"],
        pinned,
        "{:?} {response}",
        decisions(&patched)
    );
    assert_eq!(
        decisions(&patched)["containers/c"],
        "rewritten: present at the target"
    );
    assert_eq!(
        front.total(),
        0,
        "the source was asked: {:?}",
        front.requests()
    );
    assert_eq!(
        sample(
            &metrics.encode(),
            "pinswap_rewrites_total",
            &[("reason", "present")]
        ),
        Some(1.0)
    );
    // The copy was made under another setting: not this replica's to use.
    let (other, _) = admission(&host, &dst.host(), "", &extra(other_setting));
    let (patched, _) = admit(&other, &pod("shop", "other", &[("c", &image)])).await;
    assert_eq!(images(&patched)["c"], image, "{:?}", decisions(&patched));
    src.thaw();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_pins_a_filtered_tag_and_digest_to_the_mirrors_copy() {
    let index = Index::oci(902, false);
    reshaped_copy_case(
        "platforms: [linux/amd64]\n",
        "platforms: [linux/arm64]\n",
        &format!("shop/multi:v1@{}", index.digest),
        &index.digest,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_pins_a_repaired_digest_to_the_mirrors_copy() {
    let spin = Image::spin("outage", 1, None);
    reshaped_copy_case(
        "identity: {collisions: repair}\n",
        "identity: {collisions: repair}\nplatforms: [linux/amd64]\n",
        &format!("spin/app@{}", spin.digest),
        &spin.digest,
    )
    .await;
}

/// A source that starts answering 401 (credentials revoked, anonymous
/// pulls disabled) cannot resolve a tag: a fresh replica pins the tag to
/// the digest the target holds under it. Under the private-image rule
/// (docs/security.md) that 401 may mean the image is private now, and a
/// Pod that proves no access is left unchanged instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_answering_401_pins_the_tag_to_the_targets_copy() {
    let (_src, dst, _i, front) = rig().await;
    let host = front.host();
    let image = format!("{host}/shop/app:v1");
    let (first, _) = admission(&host, &dst.host(), "", "copyPolicy: immediate\n");
    let pinned = mirror_one(&first, &image).await;
    let repo = format!("mirror/{}/shop/app", host.replace(':', "_"));
    let held = dst.head_manifest(&repo, "v1").await.expect("copied");
    assert_eq!(pinned, format!("{}/{repo}:v1@{held}", dst.host()));
    front.set(Mode::Refuse(401, None));

    let (fresh, metrics) = admission(&host, &dst.host(), "", "copyPolicy: immediate\n");
    let (patched, response) = admit(&fresh, &pod("shop", "revoked", &[("c", &image)])).await;
    let note = &decisions(&patched)["containers/c"];
    assert_eq!(images(&patched)["c"], pinned, "{note} {response}");
    assert!(
        note.starts_with("rewritten: source unreachable (")
            && note.contains("401")
            && note.ends_with("); pinned to the mirror's copy of v1"),
        "{note}"
    );
    assert!(
        front.count_method("HEAD", "/manifests/v1") >= 1,
        "the source was asked and refused: {:?}",
        front.requests()
    );
    assert_eq!(
        sample(
            &metrics.encode(),
            "pinswap_rewrites_total",
            &[("reason", "source_down")]
        ),
        Some(1.0)
    );

    // Under the private-image rule, nothing proves this Pod may have it.
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{host}\"}}]\n  imagePullSecrets: true\ncopyPolicy: immediate\n",
        dst.host()
    );
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let api = common::kube::KubeApi::start().await;
    api.authorize_install(&config, pinswap::install::manifests::Tls::CertManager);
    let metrics = Arc::new(Metrics::new());
    let private = Admission::from_config(&config, metrics.clone())
        .unwrap()
        .with_pull_secrets(api.client());
    let (patched, _) = admit(&private, &pod("shop", "unproven", &[("c", &image)])).await;
    let note = &decisions(&patched)["containers/c"];
    assert_eq!(images(&patched)["c"], image, "unchanged: {note}");
    assert!(
        note.starts_with("unchanged: private image;")
            || note.starts_with("unchanged: not known to be public;"),
        "{note}"
    );
    let denied: f64 = ["no_credentials", "refused", "unverified"]
        .iter()
        .filter_map(|r| {
            sample(
                &metrics.encode(),
                "pinswap_private_image_denials_total",
                &[("reason", r)],
            )
        })
        .sum();
    assert_eq!(denied, 1.0);
}
