//! A source registry that is slow on purpose (a trickle of bytes no
//! per-read timeout cuts) holds no more than its share of the copy slots,
//! and not for long: another source's copy, or recovery, goes through while
//! the trickles run, the trickles are cut by `copy.minTransferRate` or
//! `copy.timeout`, counted in `pinswap_copies_cut_total{reason}`, and leave
//! no manifest at the target. Real registries; the trickle is a TCP proxy
//! (`TcpCutProxy::trickle_after`) in front of one of them.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::review::{admit, pod};
use common::{TcpCutProxy, TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;

/// Bytes of each response sent at full speed: headers, manifests and the
/// config blob fit; the 256 KiB layers trickle.
const FAST_BYTES: u64 = 8 * 1024;
const TRICKLE: Duration = Duration::from_millis(250);
/// Copies from the trickling source: as many as there are copy slots
/// (`copy.concurrency`, 5).
const SLOW_IMAGES: u64 = 5;
/// The slots one source registry may hold (`copy.concurrencyPerRegistry`).
const PER_REGISTRY: usize = 4;
/// The bound the tests state on another source's copy or recovery while
/// the trickles hold their slots; unhindered it takes well under 1 s.
const BOUND: Duration = Duration::from_secs(5);
/// A 12 s window: the trickles (4 bytes/s) run well past `BOUND` before
/// the 1 KiB/s floor cuts them.
const FLOORED: &str =
    "copyPolicy: delayed\ncopy: {minTransferRate: 1Ki, transferRateWindow: 12s, timeout: 2m}\n";

/// A target, a trickling source (behind the proxy) and a fast one.
struct Rig {
    dst: TestRegistry,
    slow: TestRegistry,
    fast: TestRegistry,
    proxy: TcpCutProxy,
}

impl Rig {
    async fn start() -> Rig {
        common::init();
        let (dst, slow, fast) = (
            TestRegistry::plain().await,
            TestRegistry::plain().await,
            TestRegistry::plain().await,
        );
        let proxy = TcpCutProxy::start(&slow.host()).await;
        Rig {
            dst,
            slow,
            fast,
            proxy,
        }
    }

    fn admission(&self, extra: &str) -> (Admission, Arc<Metrics>) {
        let yaml = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}, {{registry: \"{}\"}}]\n{extra}",
            self.dst.host(),
            self.proxy.host(),
            self.fast.host()
        );
        let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
        let metrics = Arc::new(Metrics::new());
        let adm = Admission::from_config(&config, metrics.clone()).unwrap();
        (adm, metrics)
    }

    /// The target repository `repo` of `source` is mirrored to.
    fn mirrored(source: &str, repo: &str) -> String {
        format!("mirror/{}/{repo}", source.replace(':', "_"))
    }

    /// A rig with [`SLOW_IMAGES`] at the slow source and `fast/app:v1`
    /// (seeded `seed`) at the fast one.
    async fn with_images(seed: u64) -> (Rig, Vec<Image>, Image) {
        let rig = Rig::start().await;
        let slow = rig.push_slow(SLOW_IMAGES).await;
        let fast = Image::oci(1, seed);
        push_image(&rig.fast, "fast/app", Some("v1"), &fast).await;
        (rig, slow, fast)
    }

    /// `slow/appN:v1` at the slow source, each with a 256 KiB layer.
    async fn push_slow(&self, n: u64) -> Vec<Image> {
        let mut images = Vec::new();
        for i in 0..n {
            let img = Image::random_layers(1, 256 * 1024, 900 + i);
            push_image(&self.slow, &format!("slow/app{i}"), Some("v1"), &img).await;
            images.push(img);
        }
        images
    }

    fn slow_ref(&self, i: u64) -> String {
        format!("{}/slow/app{i}:v1", self.proxy.host())
    }

    /// Waits until `n` responses trickle (each holds a copy slot).
    async fn wait_trickling(&self, n: usize) {
        let start = Instant::now();
        while self.proxy.trickling() < n {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "only {} of {n} copies from the slow source started trickling",
                self.proxy.trickling()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until at most `n` responses trickle: a cut copy closed its
    /// connections to the source.
    async fn wait_trickling_at_most(&self, n: usize) {
        let start = Instant::now();
        while self.proxy.trickling() > n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} responses still trickle to cut copies",
                self.proxy.trickling()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits up to `bound` for `repo:tag` at the target; how long it took.
    async fn wait_mirrored(&self, repo: &str, tag: &str, bound: Duration) -> Option<Duration> {
        let start = Instant::now();
        loop {
            if self.dst.head_manifest(repo, tag).await.is_some() {
                return Some(start.elapsed());
            }
            if start.elapsed() > bound {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn metric(metrics: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    common::metrics::sample(&metrics.encode(), name, labels).unwrap_or(0.0)
}

/// Waits up to `bound` for `name{labels}` to reach `at_least`.
async fn wait_metric(
    metrics: &Metrics,
    name: &str,
    labels: &[(&str, &str)],
    at_least: f64,
    bound: Duration,
) {
    let start = Instant::now();
    while metric(metrics, name, labels) < at_least {
        assert!(
            start.elapsed() < bound,
            "{name}{labels:?} still {} after {bound:?}, expected at least {at_least}\n{}",
            metric(metrics, name, labels),
            metrics.encode()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for `n` copies cut for `reason` (`pinswap_copies_cut_total`),
/// well past the windows and timeouts the tests set.
async fn wait_cut(metrics: &Metrics, reason: &str, n: usize) {
    let labels = [("reason", reason)];
    let bound = Duration::from_secs(30);
    wait_metric(
        metrics,
        "pinswap_copies_cut_total",
        &labels,
        n as f64,
        bound,
    )
    .await;
}

/// The bound this test states: with as many copies from one trickling
/// source as there are copy slots, another source's image reaches the target
/// within 5 s (well under 1 s unhindered), while the trickles still hold
/// every slot that source may have. The floor then cuts the trickles, which
/// are counted, leave no manifest whose blobs are missing, and are copied by
/// later admissions once the source is fast again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_source_does_not_hold_back_another_sources_copy() {
    let (rig, slow, fast) = Rig::with_images(950).await;
    rig.proxy.trickle_after(FAST_BYTES, TRICKLE);
    let (adm, metrics) = rig.admission(FLOORED);

    for i in 0..SLOW_IMAGES {
        admit(
            &adm,
            &pod("team", &format!("slow{i}"), &[("app", &rig.slow_ref(i))]),
        )
        .await;
    }
    rig.wait_trickling(PER_REGISTRY).await;

    let fast_ref = format!("{}/fast/app:v1", rig.fast.host());
    admit(&adm, &pod("team", "fast", &[("app", &fast_ref)])).await;
    let fast_repo = Rig::mirrored(&rig.fast.host(), "fast/app");
    let took = rig.wait_mirrored(&fast_repo, "v1", BOUND).await;
    let still = rig.proxy.trickling();
    assert!(
        took.is_some(),
        "{fast_ref} not at the target within {BOUND:?} while {still} copies from the trickling source held their slots"
    );
    eprintln!(
        "the fast source's copy took {:?} with {still} trickling",
        took.unwrap()
    );
    assert!(
        still >= PER_REGISTRY,
        "only {still} trickles left when the fast copy was done: the bound proves nothing"
    );
    assert_eq!(
        rig.dst
            .head_manifest(&fast_repo, &fast.digest)
            .await
            .as_deref(),
        Some(fast.digest.as_str())
    );

    // The floor cuts the trickles: each such copy fails, and the target
    // never holds a slow image's manifest without its blobs.
    wait_cut(&metrics, "transfer_rate", PER_REGISTRY).await;
    wait_metric(
        &metrics,
        "pinswap_copies_failed_total",
        &[],
        PER_REGISTRY as f64,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        metric(
            &metrics,
            "pinswap_copies_cut_total",
            &[("reason", "deadline")]
        ),
        0.0
    );
    let slow_host = rig.proxy.host();
    let mut absent = 0;
    for (i, img) in slow.iter().enumerate() {
        let repo = Rig::mirrored(&slow_host, &format!("slow/app{i}"));
        match rig.dst.head_manifest(&repo, "v1").await {
            None => absent += 1,
            Some(_) => {
                for b in img.blobs() {
                    assert!(
                        rig.dst.blob_exists(&repo, &b.digest).await,
                        "{repo}: {}",
                        b.digest
                    );
                }
            }
        }
    }
    assert!(absent >= PER_REGISTRY, "{absent} slow images absent");

    // A cut copy is retried like any failed one: by the next admission.
    rig.proxy.trickle_off();
    for i in 0..SLOW_IMAGES {
        admit(
            &adm,
            &pod(
                "team",
                &format!("slow{i}-again"),
                &[("app", &rig.slow_ref(i))],
            ),
        )
        .await;
    }
    for (i, img) in slow.iter().enumerate() {
        let repo = Rig::mirrored(&slow_host, &format!("slow/app{i}"));
        assert!(
            rig.wait_mirrored(&repo, "v1", Duration::from_secs(20))
                .await
                .is_some(),
            "{repo} not mirrored once its source was fast again"
        );
        common::copying::assert_image(&rig.dst, &repo, "v1", img).await;
    }
}

/// With the floor off, `copy.timeout` cuts a copy that trickles, and a
/// referrers follow that trickles, each in about the timeout: the copy
/// fails without a manifest at the target, its source connection is
/// closed, and the image whose signature trickled is mirrored without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_referrer_follows_past_copy_timeout_are_cut() {
    let rig = Rig::start().await;
    let slow = rig.push_slow(1).await.remove(0);
    // A small image (every response under FAST_BYTES) signed with a
    // cosign tag whose 256 KiB layer trickles.
    let signed = Image::oci(1, 960);
    push_image(&rig.slow, "signed/app", Some("v1"), &signed).await;
    let sig_tag = format!("sha256-{}.sig", signed.digest.trim_start_matches("sha256:"));
    let sig = Image::random_layers(1, 256 * 1024, 961);
    push_image(&rig.slow, "signed/app", Some(&sig_tag), &sig).await;
    rig.proxy.trickle_after(FAST_BYTES, TRICKLE);
    let (adm, metrics) =
        rig.admission("copyPolicy: delayed\ncopy: {minTransferRate: 0, timeout: 3s}\n");

    admit(&adm, &pod("team", "slow", &[("app", &rig.slow_ref(0))])).await;
    wait_cut(&metrics, "deadline", 1).await;
    wait_metric(
        &metrics,
        "pinswap_copies_failed_total",
        &[],
        1.0,
        Duration::from_secs(5),
    )
    .await;
    let repo = Rig::mirrored(&rig.proxy.host(), "slow/app0");
    assert_eq!(rig.dst.head_manifest(&repo, "v1").await, None);
    assert_eq!(rig.dst.head_manifest(&repo, &slow.digest).await, None);
    rig.wait_trickling_at_most(0).await;

    let signed_ref = format!("{}/signed/app:v1", rig.proxy.host());
    admit(&adm, &pod("team", "signed", &[("app", &signed_ref)])).await;
    let repo = Rig::mirrored(&rig.proxy.host(), "signed/app");
    assert!(
        rig.wait_mirrored(&repo, "v1", Duration::from_secs(10))
            .await
            .is_some(),
        "{signed_ref} not mirrored"
    );
    wait_cut(&metrics, "deadline", 2).await;
    wait_metric(
        &metrics,
        "pinswap_referrers_copied_total",
        &[("outcome", "failed")],
        1.0,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(rig.dst.head_manifest(&repo, &sig_tag).await, None);
    rig.wait_trickling_at_most(0).await;
    assert_eq!(
        metric(
            &metrics,
            "pinswap_copies_cut_total",
            &[("reason", "transfer_rate")]
        ),
        0.0
    );
}

/// Recovery has the same protection: Pods whose mirrored images lost a
/// layer make recovery copy those layers again, from a source that now
/// trickles, on every slot that source may have (background slots and the
/// verifier's); another source's lost layer is restored within the same
/// 5 s bound meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_source_does_not_hold_back_another_sources_recovery() {
    let (rig, slow, fast) = Rig::with_images(970).await;
    let (adm, _metrics) = rig.admission(FLOORED);
    let fast_ref = format!("{}/fast/app:v1", rig.fast.host());
    // Everything mirrored first, while the slow source is still fast.
    let mut images: Vec<(String, String, &Image)> = (0..SLOW_IMAGES)
        .map(|i| {
            let repo = Rig::mirrored(&rig.proxy.host(), &format!("slow/app{i}"));
            (rig.slow_ref(i), repo, &slow[i as usize])
        })
        .collect();
    images.push((fast_ref, Rig::mirrored(&rig.fast.host(), "fast/app"), &fast));
    for (i, (source, repo, _)) in images.iter().enumerate() {
        admit(&adm, &pod("team", &format!("p{i}"), &[("app", source)])).await;
        assert!(
            rig.wait_mirrored(repo, "v1", Duration::from_secs(20))
                .await
                .is_some(),
            "{repo}"
        );
    }
    // The target loses a layer of each; the slow source starts to trickle.
    for (_, repo, img) in &images {
        rig.dst.delete_blob(repo, &img.layers[0].digest).await;
    }
    rig.proxy.trickle_after(FAST_BYTES, TRICKLE);
    let mirror = adm.mirror().clone();
    let recover = |source: &str, repo: &str, img: &Image| {
        let mirror = mirror.clone();
        let target = format!("{}/{repo}@{}", rig.dst.host(), img.digest);
        let target = pinswap::reference::Reference::parse(&target).unwrap();
        let hint = pinswap::reference::Reference::parse(source).unwrap();
        async move {
            mirror
                .recover(
                    &target,
                    Some(&hint),
                    pinswap::cache::Cause::PullFailure,
                    &[],
                )
                .await
        }
    };
    let (fast_source, fast_repo, fast_img) = images.pop().unwrap();
    let slow_recoveries: Vec<_> = images
        .iter()
        .map(|(s, r, i)| tokio::spawn(recover(s, r, i)))
        .collect();
    rig.wait_trickling(PER_REGISTRY).await;

    let start = Instant::now();
    let fast_recovered =
        tokio::time::timeout(BOUND, recover(&fast_source, &fast_repo, fast_img)).await;
    let still = rig.proxy.trickling();
    assert!(
        matches!(
            fast_recovered,
            Ok(Ok(pinswap::mirror::Recovered::Remirrored { .. }))
        ),
        "{fast_source} not recovered within {BOUND:?} while {still} recoveries from the trickling source held their slots: {fast_recovered:?}"
    );
    eprintln!(
        "the fast source's recovery took {:?} with {still} trickling",
        start.elapsed()
    );
    assert!(
        still >= PER_REGISTRY,
        "only {still} trickles left: the bound proves nothing"
    );
    assert!(
        rig.dst
            .blob_exists(&fast_repo, &fast_img.layers[0].digest)
            .await
    );
    // The runtime's end drops the trickling recoveries; the first test
    // shows such copies cut.
    drop(slow_recoveries);
}
