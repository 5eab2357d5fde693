//! Retention: removing mirrored images nothing uses, and only those, against
//! real Distribution registries and the in-process Kubernetes API (with
//! the install's RBAC). Passes are driven through the library with an
//! explicit `InUse`; one test runs them on the leader through the Pod index.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::review::{admit, pod, pull_failing};
use common::{TestRegistry, push_image, push_index, push_manifest};
use k8s_openapi::api::core::v1::Pod;
use pinswap::admission::Admission;
use pinswap::admission::policy::Policy;
use pinswap::config::Config;
use pinswap::install::manifests::Tls;
use pinswap::reference::Reference;
use pinswap::retention::{CONFIG_MAP, InUse, Record, Retention, State, Store};
use pinswap::watch::Background;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The install's namespace, where earlier installs kept the record.
const NS: &str = "pinswap";

/// The repository of the usage records and the retention record.
const RECORDS: &str = "mirror/pinswap-usage";

struct Rig {
    src: TestRegistry,
    dst: TestRegistry,
    api: KubeApi,
}

async fn rig() -> Rig {
    common::init();
    Rig {
        src: TestRegistry::plain().await,
        dst: TestRegistry::plain().await,
        api: KubeApi::start().await,
    }
}

impl Rig {
    /// The config with `retention` keys (a flow mapping's inside).
    fn config(&self, retention: &str) -> Config {
        let yaml = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery:\n  retryInitial: 300ms\n  retryMax: 2s\n  lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\nretention: {{enabled: true, {retention}}}\n",
            self.dst.host(),
            self.src.host()
        );
        Config::from_yaml(&yaml, "test.yaml").unwrap()
    }

    /// A Retention as the leader runs it, its API requests authorised by
    /// the install's RBAC.
    fn retention(&self, config: &Config, adm: &Admission) -> Retention {
        self.api.authorize_install(config, Tls::CertManager);
        let mirror = adm.mirror().clone();
        let policy = Policy::new(config, mirror.target().clone()).unwrap();
        let store = Store::new(self.api.install_client(), NS);
        Retention::new(mirror, policy, store, &config.retention)
    }

    /// Pushes `shop/<name>:v1` to the source and mirrors it by admitting
    /// a Pod that runs it (not stored in the API).
    async fn mirrored(&self, adm: &Admission, name: &str, seed: u64) -> Mirrored {
        let image = Image::oci(1, seed);
        push_image(&self.src, &format!("shop/{name}"), Some("v1"), &image).await;
        let m = Mirrored {
            source: format!("{}/shop/{name}:v1", self.src.host()),
            repo: format!("mirror/127.0.0.1_{}/shop/{name}", self.src.port()),
            image,
        };
        let (patched, _) = admit(adm, &pod("shop", name, &[("app", &m.source)])).await;
        assert_eq!(
            patched["spec"]["containers"][0]["image"],
            m.target(&self.dst).as_str()
        );
        assert!(self.present(&m).await, "mirrored");
        m
    }

    /// The target still has the image: its tag names its digest and the
    /// manifest's bytes are the source's.
    async fn present(&self, m: &Mirrored) -> bool {
        if self.dst.head_manifest(&m.repo, "v1").await.as_deref() != Some(&m.image.digest) {
            return false;
        }
        let (bytes, _, _) = self
            .dst
            .get_manifest(&m.repo, &m.image.digest)
            .await
            .unwrap();
        bytes == m.image.manifest
    }

    /// The target has the manifest by digest at all.
    async fn has_digest(&self, m: &Mirrored) -> bool {
        self.dst
            .head_manifest(&m.repo, &m.image.digest)
            .await
            .is_some()
    }

    /// The retention record at the target, read as a reader outside
    /// pinswap would: its manifest, then each shard.
    async fn record(&self) -> Option<Record> {
        use pinswap::retention::shards;
        let (bytes, _, _) = self
            .dst
            .get_manifest(RECORDS, &pinswap::retention::record_tag(None))
            .await?;
        let m: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let updated: k8s_openapi::jiff::Timestamp =
            m["annotations"]["org.opencontainers.image.created"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
        let mut parts = Vec::new();
        for l in m["layers"].as_array().unwrap() {
            let blob = self
                .dst
                .blob(RECORDS, l["digest"].as_str().unwrap())
                .await
                .unwrap();
            parts.push(Arc::new(shards::parse(&blob).unwrap()));
        }
        Some(Record {
            since: updated,
            images: shards::join(&parts, updated).unwrap(),
        })
    }
}

struct Mirrored {
    image: Image,
    source: String,
    repo: String,
}

impl Mirrored {
    /// `registry/repository:v1@digest` at the target, as a Pod names it.
    fn target(&self, dst: &TestRegistry) -> String {
        format!("{}/{}:v1@{}", dst.host(), self.repo, self.image.digest)
    }

    /// `registry/repository@digest` at the target, as the pass names it.
    fn key(&self, dst: &TestRegistry) -> String {
        format!("{}/{}@{}", dst.host(), self.repo, self.image.digest)
    }

    fn source_ref(&self) -> Reference {
        Reference::parse(&self.source).unwrap()
    }
}

fn in_use(images: &[Reference]) -> InUse {
    InUse {
        synced: true,
        images: images.to_vec(),
    }
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// Waits out `unusedFor` (`d`) past the first pass.
async fn idle(d: Duration) {
    tokio::time::sleep(d + Duration::from_millis(200)).await;
}

const SHORT: Duration = Duration::from_secs(1);

/// A rig, its config with `retention` keys, and a replica's metrics,
/// admission and retention.
async fn setup(
    retention: &str,
) -> (
    Rig,
    Config,
    Arc<pinswap::metrics::Metrics>,
    Admission,
    Retention,
) {
    let r = rig().await;
    let cfg = r.config(retention);
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = Admission::from_config(&cfg, metrics.clone()).unwrap();
    let ret = r.retention(&cfg, &adm);
    (r, cfg, metrics, adm, ret)
}

/// A pass that records first sight, then one past `unusedFor` (1s).
async fn two_passes(ret: &Retention, used: &InUse) -> pinswap::retention::Report {
    ret.sweep(used).await.unwrap();
    idle(SHORT).await;
    ret.sweep(used).await.unwrap()
}

#[tokio::test]
async fn only_what_pinswap_wrote_is_removed() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1s").await;
    let gone = r.mirrored(&adm, "gone", 1).await;
    let signed = r.mirrored(&adm, "signed", 2).await;
    // Another tool's tag on a mirrored manifest (the referrers tag schema).
    let foreign_tag = format!("sha256-{}", &signed.image.digest["sha256:".len()..]);
    push_manifest(
        &r.dst,
        &signed.repo,
        &foreign_tag,
        &signed.image.media_type,
        &signed.image.manifest,
    )
    .await;
    // Repositories pinswap does not mirror into: outside the prefix, and
    // under it without a registry as first component.
    let outside = Image::oci(1, 3);
    push_image(&r.dst, "tools/app", Some("v1"), &outside).await;
    let unmapped = Image::oci(1, 4);
    push_image(&r.dst, "mirror/team/app", Some("v1"), &unmapped).await;

    let first = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(first.state(&gone.key(&r.dst)), Some(State::Unused));
    assert_eq!(first.images.len(), 2, "{:?}", first.images);
    idle(SHORT).await;
    let second = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(second.state(&gone.key(&r.dst)), Some(State::Removed));
    let kept = second.find(&signed.key(&r.dst)).unwrap();
    assert_eq!(kept.state, State::Kept);
    assert!(kept.why.contains(&foreign_tag), "{}", kept.why);

    assert!(!r.has_digest(&gone).await, "removed by digest");
    assert!(
        r.dst.tags(&gone.repo).await.is_empty(),
        "its tag went with it"
    );
    // The tag first (Distribution refuses a DELETE by tag), then the
    // manifest by digest, which took the tag with it.
    let log = r.dst.log();
    let deletes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("\"DELETE ") && l.contains(&gone.repo))
        .collect();
    let at = |what: &str| deletes.iter().position(|l| l.contains(what));
    let by_tag = at(&format!("/v2/{}/manifests/v1 ", gone.repo));
    let by_digest = at(&format!(
        "/v2/{}/manifests/{} ",
        gone.repo, gone.image.digest
    ));
    assert!(
        by_tag.is_some() && by_tag < by_digest,
        "DELETEs: {deletes:#?}"
    );
    assert!(r.present(&signed).await, "another tag points at it: kept");
    assert_eq!(
        r.dst.head_manifest("tools/app", "v1").await.as_deref(),
        Some(outside.digest.as_str())
    );
    assert_eq!(
        r.dst
            .head_manifest("mirror/team/app", "v1")
            .await
            .as_deref(),
        Some(unmapped.digest.as_str())
    );
    assert!(r.api.forbidden().is_empty(), "{:?}", r.api.forbidden());
}

/// A tagged child of an index that stays (another tool's tag keeps it
/// here) stays too: removing it would leave the index pointing at a
/// manifest the target no longer has, for good if its source lost it.
#[tokio::test]
async fn the_children_of_an_index_that_stays_stay() {
    let (r, _, _, _adm, ret) = setup("unusedFor: 1s").await;
    let idx = common::fixtures::Index::oci(21, false);
    push_index(&r.src, "shop/multi", Some("v1"), &idx).await;
    let repo = format!("mirror/127.0.0.1_{}/shop/multi", r.src.port());
    push_index(&r.dst, &repo, Some("v1"), &idx).await;
    // The amd64 child once pinned on its own: its anchor tag.
    let child = &idx.children[0];
    let anchor = format!("pinswap-{}", &child.digest["sha256:".len()..]);
    push_manifest(&r.dst, &repo, &anchor, &child.media_type, &child.manifest).await;
    let foreign = format!("sha256-{}", &idx.digest["sha256:".len()..]);
    push_manifest(&r.dst, &repo, &foreign, &idx.media_type, &idx.manifest).await;

    let report = two_passes(&ret, &in_use(&[])).await;
    let key = |d: &str| format!("{}/{repo}@{d}", r.dst.host());
    assert_eq!(
        report.state(&key(&idx.digest)),
        Some(State::Kept),
        "{:?}",
        report.images
    );
    assert_eq!(
        report.state(&key(&child.digest)),
        Some(State::InUse),
        "{:?}",
        report.images
    );
    assert_eq!(
        r.dst.head_manifest(&repo, &child.digest).await.as_deref(),
        Some(child.digest.as_str()),
        "the child is still at the target"
    );
}

/// An index Pods pin by digest keeps its children after its tag moved: it
/// is listed by no tag then, and a child carrying its own anchor tag would
/// otherwise be due on its own.
#[tokio::test]
async fn the_children_of_an_index_in_use_stay_after_its_tag_moved() {
    let (r, _, _, _adm, ret) = setup("unusedFor: 1s").await;
    let idx = common::fixtures::Index::oci(23, false);
    push_index(&r.src, "shop/multi", Some("v1"), &idx).await;
    let repo = format!("mirror/127.0.0.1_{}/shop/multi", r.src.port());
    push_index(&r.dst, &repo, Some("v1"), &idx).await;
    let child = &idx.children[0];
    let anchor = format!("pinswap-{}", &child.digest["sha256:".len()..]);
    push_manifest(&r.dst, &repo, &anchor, &child.media_type, &child.manifest).await;
    // The tag moves on: the index is listed by no tag.
    push_image(&r.dst, &repo, Some("v1"), &Image::oci(1, 24)).await;
    let pinned = Reference::parse(&format!("{}/{repo}@{}", r.dst.host(), idx.digest)).unwrap();

    let report = two_passes(&ret, &in_use(&[pinned])).await;
    let key = format!("{}/{repo}@{}", r.dst.host(), child.digest);
    assert_eq!(
        report.state(&key),
        Some(State::InUse),
        "{:?}",
        report.images
    );
    assert_eq!(
        r.dst.head_manifest(&repo, &child.digest).await.as_deref(),
        Some(child.digest.as_str()),
        "the child is still at the target"
    );
}

/// A source that cannot answer holds back its own images only: another
/// source's unused image still goes, and the pass names the one held.
#[tokio::test]
async fn a_source_that_cannot_answer_holds_back_its_images_only() {
    let mut r = rig().await;
    let other = TestRegistry::plain().await;
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}, {{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nretention: {{enabled: true, unusedFor: 1s}}\n",
        r.dst.host(),
        r.src.host(),
        other.host()
    );
    let cfg = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = Admission::from_config(&cfg, metrics.clone()).unwrap();
    let ret = r.retention(&cfg, &adm);
    let held = r.mirrored(&adm, "held", 41).await;
    let image = Image::oci(1, 42);
    push_image(&other, "shop/goes", Some("v1"), &image).await;
    let goes = Mirrored {
        source: format!("{}/shop/goes:v1", other.host()),
        repo: format!("mirror/127.0.0.1_{}/shop/goes", other.port()),
        image,
    };
    let (patched, _) = admit(&adm, &pod("shop", "goes", &[("app", &goes.source)])).await;
    assert_eq!(
        patched["spec"]["containers"][0]["image"],
        goes.target(&r.dst).as_str()
    );

    ret.sweep(&in_use(&[])).await.unwrap();
    idle(SHORT).await;
    r.src.kill();
    let report = ret.sweep(&in_use(&[])).await.unwrap();
    let why = |k: &str| {
        let i = report.images.iter().find(|i| i.image.to_string() == k);
        i.map(|i| (i.state, i.why.clone()))
    };
    let (state, note) = why(&held.key(&r.dst)).expect("listed");
    assert_eq!(state, State::Kept, "{note}");
    assert!(note.contains("cannot answer"), "{note}");
    assert_eq!(
        why(&goes.key(&r.dst)).map(|w| w.0),
        Some(State::Removed),
        "{:?}",
        report.images
    );
    assert!(report.held.contains_key(&r.src.host()), "{:?}", report.held);
    assert!(r.present(&held).await, "kept while its source is down");
    assert!(
        !r.has_digest(&goes).await,
        "another source's unused image went"
    );
}

#[tokio::test]
async fn images_in_use_stay_by_target_reference_source_tag_or_source_digest() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1s").await;
    let pod_image = r.mirrored(&adm, "pod", 11).await;
    let template = r.mirrored(&adm, "cron", 12).await;
    let pinned = r.mirrored(&adm, "pinned", 13).await;
    let unused = r.mirrored(&adm, "unused", 14).await;
    let names = [
        // A Pod's rewritten image.
        Reference::parse(&pod_image.target(&r.dst)).unwrap(),
        // A suspended CronJob's template, naming the source by tag.
        template.source_ref(),
        // A template naming the source by digest only.
        Reference::parse(&format!(
            "{}/shop/pinned@{}",
            r.src.host(),
            pinned.image.digest
        ))
        .unwrap(),
    ];
    let report = two_passes(&ret, &in_use(&names)).await;
    for m in [&pod_image, &template, &pinned] {
        assert_eq!(
            report.state(&m.key(&r.dst)),
            Some(State::InUse),
            "{}",
            m.repo
        );
        assert!(r.present(m).await, "{} kept", m.repo);
    }
    assert_eq!(report.state(&unused.key(&r.dst)), Some(State::Removed));
    assert!(!r.has_digest(&unused).await);
}

#[tokio::test]
async fn an_image_the_source_no_longer_serves_stays_and_is_reported() {
    let (r, _, metrics, adm, ret) = setup("unusedFor: 1s").await;
    let lost = r.mirrored(&adm, "lost", 21).await;
    let served = r.mirrored(&adm, "served", 22).await;
    // The source deletes one; the other's tag moves on, but its digest is
    // still served (it could be mirrored again by digest).
    r.src.delete_manifest("shop/lost", &lost.image.digest).await;
    push_image(&r.src, "shop/served", Some("v1"), &Image::oci(1, 23)).await;

    let report = two_passes(&ret, &in_use(&[])).await;
    let kept = report.find(&lost.key(&r.dst)).unwrap();
    assert_eq!(kept.state, State::Kept);
    assert!(kept.why.starts_with("unrecoverable"), "{}", kept.why);
    assert!(r.present(&lost).await, "kept at the target");
    assert_eq!(report.state(&served.key(&r.dst)), Some(State::Removed));
    let text = metrics.encode();
    assert_eq!(sample(&text, "pinswap_retention_unrecoverable"), 1.0);
    assert_eq!(
        sample(&text, "pinswap_retention_images{state=\"kept\"}"),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "pinswap_retention_removed_total{outcome=\"removed\"}"
        ),
        1.0
    );
}

#[tokio::test]
async fn nothing_goes_while_a_source_cannot_answer_or_the_watches_have_not_synced() {
    let (mut r, _, metrics, adm, ret) = setup("unusedFor: 1s").await;
    let img = r.mirrored(&adm, "app", 31).await;
    let not_synced = InUse {
        synced: false,
        images: Vec::new(),
    };

    // Not synced: the pass does nothing, not even write the record.
    let unsynced = ret.sweep(&not_synced).await.unwrap();
    assert!(unsynced.not_synced && unsynced.images.is_empty());
    assert!(r.record().await.is_none(), "no record written");

    ret.sweep(&in_use(&[])).await.unwrap();
    idle(SHORT).await;
    let unsynced = ret.sweep(&not_synced).await.unwrap();
    assert!(unsynced.skipped.is_some());
    assert!(r.present(&img).await, "kept while not synced");

    // The source is down: the image is due, but nothing goes.
    r.src.kill();
    let down = ret.sweep(&in_use(&[])).await.unwrap();
    let why = down.held.get(&r.src.host()).expect("held back");
    assert!(why.contains("refused"), "{why}");
    assert_eq!(down.state(&img.key(&r.dst)), Some(State::Kept));
    assert!(r.present(&img).await, "kept while the source is down");
    // Still down: still nothing.
    let again = ret.sweep(&in_use(&[])).await.unwrap();
    assert!(!again.held.is_empty());
    assert!(r.present(&img).await);
    let text = metrics.encode();
    assert_eq!(
        sample(
            &text,
            "pinswap_retention_passes_total{outcome=\"source_down\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &text,
            "pinswap_retention_passes_total{outcome=\"not_synced\"}"
        ),
        2.0
    );
}

#[tokio::test]
async fn last_use_survives_a_restart_and_a_new_leader() {
    let r = rig().await;
    let unused_for = Duration::from_secs(3);
    let cfg = r.config("unusedFor: 3s");
    let adm = Admission::from_config(&cfg, Arc::new(pinswap::metrics::Metrics::new())).unwrap();
    let img = r.mirrored(&adm, "app", 41).await;
    let key = img.key(&r.dst);

    // The first leader sees it in use.
    let first = r.retention(&cfg, &adm);
    first
        .sweep(&in_use(&[Reference::parse(&img.target(&r.dst)).unwrap()]))
        .await
        .unwrap();
    let used_at = Instant::now();
    let record = r.record().await.expect("record written");
    assert!(record.images.contains_key(&key), "{record:?}");
    drop(first);

    // A new leader (a fresh process) no longer sees it in use: it reads
    // the last use from the record and does not remove it early.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let replica = Admission::from_config(&cfg, Arc::new(pinswap::metrics::Metrics::new())).unwrap();
    let second = r.retention(&cfg, &replica);
    let early = second.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(early.state(&key), Some(State::Unused));
    assert!(r.present(&img).await);
    assert_eq!(
        r.record().await.unwrap().images[&key],
        record.images[&key],
        "last use unchanged"
    );

    tokio::time::sleep(
        (used_at + unused_for + Duration::from_millis(200))
            .saturating_duration_since(Instant::now()),
    )
    .await;
    let due = second.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(due.state(&key), Some(State::Removed));
    assert!(!r.has_digest(&img).await);
    assert!(r.api.forbidden().is_empty(), "{:?}", r.api.forbidden());
}

#[tokio::test]
async fn an_image_new_to_the_record_counts_as_used_when_first_seen() {
    let r = rig().await;
    let cfg = r.config("unusedFor: 2s");
    let adm = Admission::from_config(&cfg, Arc::new(pinswap::metrics::Metrics::new())).unwrap();
    let img = r.mirrored(&adm, "old", 51).await;
    // Mirrored long before retention was turned on: still not removed at
    // once, nor on the next pass within unusedFor.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let ret = r.retention(&cfg, &adm);
    let first = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(first.state(&img.key(&r.dst)), Some(State::Unused));
    let next = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(next.state(&img.key(&r.dst)), Some(State::Unused));
    assert!(r.present(&img).await);
}

#[tokio::test]
async fn a_dry_run_counts_and_removes_nothing() {
    let (r, _, metrics, adm, ret) = setup("unusedFor: 1s, dryRun: true").await;
    let img = r.mirrored(&adm, "app", 61).await;
    let report = two_passes(&ret, &in_use(&[])).await;
    assert_eq!(report.state(&img.key(&r.dst)), Some(State::Candidate));
    assert!(r.present(&img).await, "nothing removed");
    assert_eq!(r.dst.tags(&img.repo).await, ["v1"]);
    let text = metrics.encode();
    assert_eq!(
        sample(
            &text,
            "pinswap_retention_removed_total{outcome=\"dry_run\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "pinswap_retention_removed_total{outcome=\"removed\"}"
        ),
        0.0
    );
    assert_eq!(
        sample(&text, "pinswap_retention_images{state=\"candidate\"}"),
        1.0
    );
}

#[tokio::test]
async fn a_removed_image_a_pod_needs_again_comes_back_through_recovery() {
    let (r, cfg, _, adm, ret) = setup("unusedFor: 1s").await;
    let img = r.mirrored(&adm, "app", 71).await;
    let target = Reference::parse(&img.target(&r.dst)).unwrap();
    assert!(
        adm.mirror().caches().has(&target).await,
        "cached at admission"
    );
    let report = two_passes(&ret, &in_use(&[])).await;
    assert_eq!(report.state(&img.key(&r.dst)), Some(State::Removed));
    assert!(!r.has_digest(&img).await);
    // Admission no longer takes it for present.
    assert!(
        !adm.mirror().caches().has(&target).await,
        "existence entry dropped"
    );

    // A Pod pinned to it fails to pull it: recovery mirrors it again.
    let bg = Background::start(
        adm.mirror().clone(),
        &cfg,
        Some(r.api.install_client()),
        CancellationToken::new(),
    );
    let mut p = pod("shop", "web", &[("app", &img.source)]);
    p["spec"]["containers"][0]["image"] = Value::String(img.target(&r.dst));
    p["metadata"]["annotations"] = serde_json::json!({
        "pinswap.dev/original-images": serde_json::json!({"containers/app": img.source}).to_string()
    });
    r.api
        .apply_pod(serde_json::from_value::<Pod>(p.clone()).unwrap());
    common::wait_until("leading", Duration::from_secs(10), || bg.is_leader()).await;
    common::wait_until("the Pod watch is open", Duration::from_secs(10), || {
        r.api.open_watches() > 0
    })
    .await;
    r.api
        .apply_pod(serde_json::from_value::<Pod>(pull_failing(&p, "app", "ErrImagePull")).unwrap());
    let start = Instant::now();
    while !r.present(&img).await {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not mirrored again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bg.stop().await;
}

/// The leader removes what no Pod uses and keeps what one does, also a Pod
/// outside the webhook's scope: one rewritten before its namespace opted
/// out still pulls from the target, and recovery, keeping to the scope,
/// would not bring the image back.
#[tokio::test]
async fn the_leader_removes_what_no_pod_uses_and_keeps_what_one_does() {
    let r = rig().await;
    let cfg = r.config("unusedFor: 1s, interval: 500ms");
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = Admission::from_config(&cfg, metrics.clone()).unwrap();
    let used = r.mirrored(&adm, "used", 81).await;
    let unused = r.mirrored(&adm, "unused", 82).await;
    let quiet = r.mirrored(&adm, "quiet", 83).await;
    let (patched, _) = admit(&adm, &pod("shop", "web", &[("app", &used.source)])).await;
    r.api
        .apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    let (patched, _) = admit(&adm, &pod("quiet", "q", &[("app", &quiet.source)])).await;
    r.api
        .apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    r.api
        .apply_namespace("quiet", &[("pinswap.dev/ignore", "true")]);
    r.api.authorize_install(&cfg, Tls::CertManager);
    let bg = Background::start(
        adm.mirror().clone(),
        &cfg,
        Some(r.api.install_client()),
        CancellationToken::new(),
    );
    let start = Instant::now();
    while r.has_digest(&unused).await {
        assert!(start.elapsed() < Duration::from_secs(20), "not removed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // More passes ran since; the Pod's image stays.
    let passes = |m: &pinswap::metrics::Metrics| {
        sample(
            &m.encode(),
            "pinswap_retention_passes_total{outcome=\"done\"}",
        )
    };
    let now = passes(&metrics);
    let start = Instant::now();
    while passes(&metrics) < now + 2.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no more passes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(r.present(&used).await, "a Pod uses it");
    assert!(r.present(&quiet).await, "a Pod outside the scope uses it");
    let record = r.record().await.expect("record");
    assert!(record.images.contains_key(&used.key(&r.dst)));
    assert!(r.api.forbidden().is_empty(), "{:?}", r.api.forbidden());
    bg.stop().await;
}

/// The kustomize component grants what `pinswap manifests` grants with
/// retention on, and nothing is granted with it off.
#[test]
fn the_kustomize_component_grants_what_pinswap_manifests_does() {
    let opts = |retention: bool| pinswap::install::manifests::Options {
        namespace: "pinswap".into(),
        replicas: 1,
        tls: Tls::CertManager,
        image: "registry.example/pinswap:0".into(),
        image_pull_secrets: Vec::new(),
        config_text: String::new(),
        config: Config::from_yaml(
            &format!("target: {{registry: m.example.com}}\nretention: {{enabled: {retention}}}\n"),
            "t.yaml",
        )
        .unwrap(),
        node_agent: None,
    };
    let ours = |objects: Vec<Value>| -> Vec<Value> {
        objects
            .into_iter()
            .filter(|o| o["metadata"]["name"] == "pinswap-retention")
            .collect()
    };
    let printed = ours(pinswap::install::manifests::rbac(&opts(true)).unwrap());
    assert_eq!(printed.len(), 2, "a Role and its RoleBinding");
    assert!(ours(pinswap::install::manifests::rbac(&opts(false)).unwrap()).is_empty());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/components/retention");
    let text = std::fs::read_to_string(dir.join("rbac.yaml")).unwrap();
    let component: Vec<Value> = text
        .split("\n---\n")
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
        })
        .map(|d| yaml_serde::from_str(d).unwrap())
        .collect();
    assert_eq!(component, printed);
}

/// The record moved from its ConfigMap, as an earlier install kept it:
/// the first pass after the upgrade carries every last use on (an image
/// used a minute ago stays; one unused for two hours goes, so the pass is
/// not one that removes nothing), the ConfigMap is read once and never
/// written, and the record at the target holds the times read.
#[tokio::test]
async fn the_record_moves_from_its_config_map_with_every_last_use() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1h").await;
    let old = r.mirrored(&adm, "old", 95).await;
    let recent = r.mirrored(&adm, "recent", 96).await;
    let fresh = r.mirrored(&adm, "fresh", 97).await;
    let now = k8s_openapi::jiff::Timestamp::now();
    let two_hours_ago = now - Duration::from_secs(7200);
    let a_minute_ago = now - Duration::from_secs(60);
    let legacy = Record {
        since: now - Duration::from_secs(86_400),
        images: [
            (old.key(&r.dst), two_hours_ago),
            (recent.key(&r.dst), a_minute_ago),
        ]
        .into(),
    };
    let cm = r.api.put_config_map(
        NS,
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": CONFIG_MAP, "namespace": NS},
            "data": {"record.json": serde_json::to_string(&legacy).unwrap()},
        }))
        .unwrap(),
    );
    let path = format!("/api/v1/namespaces/{NS}/configmaps/{CONFIG_MAP}");
    let report = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(
        report.state(&old.key(&r.dst)),
        Some(State::Removed),
        "{report:?}"
    );
    assert_eq!(report.state(&recent.key(&r.dst)), Some(State::Unused));
    assert_eq!(report.state(&fresh.key(&r.dst)), Some(State::Unused));
    assert!(!r.has_digest(&old).await);
    assert!(r.present(&recent).await && r.present(&fresh).await);
    let record = r.record().await.expect("the record is at the target");
    assert_eq!(record.images[&recent.key(&r.dst)], a_minute_ago);
    assert!(record.images[&fresh.key(&r.dst)] >= now);
    // Another pass reads the target's record, not the ConfigMap.
    ret.sweep(&in_use(&[])).await.unwrap();
    let asked: Vec<String> = r
        .api
        .requests()
        .into_iter()
        .filter(|q| q.path == path)
        .map(|q| q.method)
        .collect();
    assert_eq!(asked, ["GET"]);
    assert_eq!(r.api.config_map(NS, CONFIG_MAP), Some(cm));
    assert_eq!(
        r.record().await.unwrap().images[&recent.key(&r.dst)],
        a_minute_ago
    );
}

/// A ConfigMap left behind long after its install stopped writing it (the
/// record moved, then its tag was removed) is not carried on: its times
/// stopped at the move, so an image used since would look unused since
/// then. Tracking starts again from now, and nothing is removed.
#[tokio::test]
async fn a_config_map_left_behind_is_not_carried_on() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1h").await;
    let img = r.mirrored(&adm, "stale", 94).await;
    let three_hours_ago = k8s_openapi::jiff::Timestamp::now() - Duration::from_secs(3 * 3600);
    let legacy = Record {
        since: three_hours_ago,
        images: [(img.key(&r.dst), three_hours_ago)].into(),
    };
    r.api.put_config_map(
        NS,
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": CONFIG_MAP, "namespace": NS},
            "data": {"record.json": serde_json::to_string(&legacy).unwrap()},
        }))
        .unwrap(),
    );
    let report = ret.sweep(&in_use(&[])).await.unwrap();
    assert_eq!(
        report.state(&img.key(&r.dst)),
        Some(State::Unused),
        "{report:?}"
    );
    assert!(r.present(&img).await);
    let record = r.record().await.unwrap();
    assert!(record.images[&img.key(&r.dst)] > three_hours_ago);
}

/// A record's tag that holds what pinswap did not write (an image pushed
/// under it) is left as it is, and the pass removes nothing.
#[tokio::test]
async fn a_record_tag_holding_something_else_is_left_alone() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1s").await;
    let img = r.mirrored(&adm, "app", 98).await;
    ret.sweep(&in_use(&[])).await.unwrap();
    idle(SHORT).await;
    let other = Image::oci(1, 99);
    let tag = pinswap::retention::record_tag(None);
    common::push_image(&r.dst, RECORDS, Some(&tag), &other).await;
    let e = ret.sweep(&in_use(&[])).await.unwrap_err();
    assert!(
        e.to_string().contains("the retention record at the target"),
        "{e}"
    );
    assert!(r.present(&img).await, "nothing removed");
    let (bytes, _, _) = r.dst.get_manifest(RECORDS, &tag).await.unwrap();
    assert_eq!(bytes, other.manifest, "left as it was");
}

#[tokio::test]
async fn a_pass_lists_each_repositorys_tags_once() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1h").await;
    let one = r.mirrored(&adm, "one", 61).await;
    let two = r.mirrored(&adm, "two", 62).await;
    // Distribution 2.8 sends no `Link` and ignores `last`: a page of a few
    // tags is the whole list, and asking again would repeat it.
    let lists = |m: &Mirrored| {
        let asked = format!("GET /v2/{}/tags/list", m.repo);
        r.dst.log().lines().filter(|l| l.contains(&asked)).count()
    };
    let before = (lists(&one), lists(&two));
    let report = ret
        .sweep(&in_use(&[one.source_ref(), two.source_ref()]))
        .await
        .unwrap();
    assert_eq!(report.state(&one.key(&r.dst)), Some(State::InUse));
    assert_eq!(
        (lists(&one) - before.0, lists(&two) - before.1),
        (1, 1),
        "{}",
        r.dst.log()
    );
}

/// A plan says what the next pass removes and keeps, and why, and writes
/// nothing: the target and the local record are as they were, and the
/// pass that follows removes exactly what the plan named.
#[tokio::test]
async fn a_plan_names_what_the_next_pass_removes_and_writes_nothing() {
    let (r, _, _, adm, ret) = setup("unusedFor: 1s").await;
    let unused = r.mirrored(&adm, "unused", 31).await;
    let used = r.mirrored(&adm, "used", 32).await;
    let lost = r.mirrored(&adm, "lost", 33).await;
    r.src.delete_manifest("shop/lost", &lost.image.digest).await;
    let uses = in_use(&[Reference::parse(&used.target(&r.dst)).unwrap()]);
    ret.sweep(&uses).await.unwrap();
    idle(SHORT).await;
    let record = r.record().await;
    let plan = ret.plan(&uses).await.unwrap();
    assert_eq!(plan.state(&unused.key(&r.dst)), Some(State::Candidate));
    assert_eq!(plan.state(&used.key(&r.dst)), Some(State::InUse));
    let kept = plan.find(&lost.key(&r.dst)).unwrap();
    assert_eq!(kept.state, State::Kept);
    assert!(kept.why.starts_with("unrecoverable"), "{}", kept.why);
    // Nothing written.
    assert_eq!(r.record().await, record);
    assert!(r.present(&unused).await);
    let json = plan.plan_json();
    let remove: Vec<&str> = json["remove"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["image"].as_str().unwrap())
        .collect();
    assert_eq!(remove, vec![unused.key(&r.dst).as_str()]);
    assert_eq!(json["keep"].as_array().unwrap().len(), 2);
    // The pass removes what the plan named, and only that.
    let pass = ret.sweep(&uses).await.unwrap();
    let removed: Vec<String> = pass
        .images
        .iter()
        .filter(|i| i.state == State::Removed)
        .map(|i| i.image.to_string())
        .collect();
    assert_eq!(removed, remove);
    assert!(!r.has_digest(&unused).await);
    assert!(r.present(&used).await);
    assert!(r.present(&lost).await);
}

/// The leader plans with retention off (what operators read before they
/// turn it on): what its watches see in use, with nothing written and
/// nothing removed; a replica without the watches says why it has none.
#[tokio::test]
async fn the_leader_plans_with_retention_off() {
    let r = rig().await;
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery:\n  lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\nretention: {{enabled: false, unusedFor: 1s}}\n",
        r.dst.host(),
        r.src.host()
    );
    let cfg = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = Admission::from_config(&cfg, metrics.clone()).unwrap();
    let used = r.mirrored(&adm, "used", 91).await;
    let unused = r.mirrored(&adm, "unused", 92).await;
    let (patched, _) = admit(&adm, &pod("shop", "web", &[("app", &used.source)])).await;
    r.api
        .apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    r.api.authorize_install(&cfg, Tls::CertManager);
    let none = Background::start(adm.mirror().clone(), &cfg, None, CancellationToken::new());
    let e = none.planner().plan().await.unwrap_err().to_string();
    assert!(e.contains("watches do not run"), "{e}");
    none.stop().await;
    let bg = Background::start(
        adm.mirror().clone(),
        &cfg,
        Some(r.api.install_client()),
        CancellationToken::new(),
    );
    let planner = bg.planner();
    common::wait_until("leading", Duration::from_secs(10), || bg.is_leader()).await;
    let start = Instant::now();
    let plan = loop {
        let plan = planner.plan().await.unwrap();
        if !plan.not_synced {
            break plan;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "never synced");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(plan.state(&used.key(&r.dst)), Some(State::InUse));
    // Never seen by a pass: a first pass would only start its clock.
    assert_eq!(plan.state(&unused.key(&r.dst)), Some(State::Unused));
    assert!(r.record().await.is_none(), "no record written");
    assert!(r.present(&unused).await);
    bg.stop().await;
}

/// `pinswap retention plan` asks a running `pinswap serve`'s leader over
/// its health port, as an operator does before turning retention on, and
/// prints what it would remove and keep, as text and as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinswap_retention_plan_asks_the_leader() {
    let r = rig().await;
    let cfg = r.config("unusedFor: 1s");
    let metrics = Arc::new(pinswap::metrics::Metrics::new());
    let adm = Admission::from_config(&cfg, metrics).unwrap();
    let used = r.mirrored(&adm, "used", 97).await;
    let unused = r.mirrored(&adm, "unused", 98).await;
    let (patched, _) = admit(&adm, &pod("shop", "web", &[("app", &used.source)])).await;
    r.api
        .apply_pod(serde_json::from_value::<Pod>(patched).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let kc = r.api.kubeconfig(dir.path());
    let body = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\ncache: {{reverify: 0s}}\nidentity: {{scanRate: 0}}\nrecovery:\n  lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\n",
        r.dst.host(),
        r.src.host()
    );
    let env = [
        ("KUBECONFIG", kc.to_str().unwrap()),
        ("POD_NAMESPACE", "pinswap"),
    ];
    let served = common::serve::Served::start_with(&body, "", &env, None).await;
    let server = format!("http://{}", served.health);
    let start = Instant::now();
    let plan = loop {
        let out = common::cli::pinswap(&["retention", "plan", "--server", &server, "--json"]).await;
        if out.code == 0 {
            let plan: Value = serde_json::from_str(&out.stdout).unwrap();
            if plan["skipped"].is_null() {
                break plan;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no plan: {} {}",
            out.stderr,
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let keep = plan["keep"].as_array().unwrap();
    let state = |m: &Mirrored| {
        keep.iter()
            .find(|i| i["image"] == m.key(&r.dst).as_str())
            .map(|i| i["state"].as_str().unwrap().to_owned())
    };
    assert_eq!(state(&used).as_deref(), Some("in_use"), "{plan}");
    assert_eq!(state(&unused).as_deref(), Some("unused"), "{plan}");
    assert!(plan["remove"].as_array().unwrap().is_empty(), "{plan}");
    let text = common::cli::pinswap(&["retention", "plan", "--server", &server]).await;
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout.starts_with("0 to remove, 2 kept\n"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains(&format!(
            "KEEP\tin_use\t{}\t[v1]\tnamed by a Pod or workload template",
            used.key(&r.dst)
        )),
        "{}",
        text.stdout
    );
    assert!(r.present(&unused).await);
    assert!(r.record().await.is_none(), "no record written");
    // A replica that cannot plan says why, with a non-zero exit.
    let other =
        common::cli::pinswap(&["retention", "plan", "--server", "http://127.0.0.1:1"]).await;
    assert_ne!(other.code, 0);
}
