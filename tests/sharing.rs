//! Several clusters, one mirror: two clusters (each its own in-process
//! Kubernetes API, admission, usage record and retention) share one real
//! Distribution target. Cluster B reaches the target through a front, so
//! its requests are counted and refused at will. The real kube-apiserver
//! version of the two clusters is `cluster_sharing.rs`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fixtures::Image;
use common::front::{Front, Mode};
use common::kube::KubeApi;
use common::review::{admit, pod};
use common::{TestRegistry, push_image};
use k8s_openapi::jiff::Timestamp;
use pinswap::admission::Admission;
use pinswap::admission::policy::Policy;
use pinswap::config::Config;
use pinswap::install::manifests::Tls;
use pinswap::metrics::Metrics;
use pinswap::reference::Reference;
use pinswap::retention::clusters::{ClusterRecord, Records};
use pinswap::retention::publish::{Published, Publisher};
use pinswap::retention::{InUse, Retention, State, Store};

const NS: &str = "pinswap";

/// One cluster: its API, admission, publisher and retention.
struct Cluster {
    name: &'static str,
    host: String,
    config: Config,
    metrics: Arc<Metrics>,
    adm: Admission,
    publisher: Arc<Publisher>,
    ret: Retention,
    _api: KubeApi,
}

/// The source, the target, and B's front to it.
struct Rig {
    src: TestRegistry,
    dst: TestRegistry,
    front: Front,
}

async fn rig() -> Rig {
    common::init();
    let dst = TestRegistry::plain().await;
    let front = Front::start(&dst.host()).await;
    Rig {
        src: TestRegistry::plain().await,
        dst,
        front,
    }
}

impl Rig {
    /// Cluster `name` reaching the target at `host`, with `sharing` keys
    /// (a flow mapping's inside) and `unusedFor: 1s`.
    async fn cluster(&self, name: &'static str, host: &str, sharing: &str) -> Cluster {
        let yaml = format!(
            "target: {{registry: \"{host}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {{ttl: 0s}}\ncluster: {name}\nretention: {{enabled: true, unusedFor: 1s}}\nsharing: {{enabled: true, keepFor: 1h, checkEvery: 300ms, {sharing}}}\n",
            self.src.host()
        );
        let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
        let metrics = Arc::new(Metrics::new());
        let adm = Admission::from_config(&config, metrics.clone()).unwrap();
        let api = KubeApi::start().await;
        api.authorize_install(&config, Tls::CertManager);
        let mirror = adm.mirror().clone();
        let policy = Policy::new(&config, mirror.target().clone()).unwrap();
        let publisher = Arc::new(Publisher::new(
            mirror.clone(),
            Policy::new(&config, mirror.target().clone()).unwrap(),
            name,
            &config.sharing,
        ));
        let ret = Retention::new(
            mirror,
            policy,
            Store::new(api.install_client(), NS),
            &config.retention,
        )
        .with_sharing(publisher.clone());
        Cluster {
            name,
            host: host.to_owned(),
            config,
            metrics,
            adm,
            publisher,
            ret,
            _api: api,
        }
    }

    /// Clusters `a` (direct) and `b` (through the front).
    async fn two(&self, sharing: &str) -> (Cluster, Cluster) {
        let a = self.cluster("a", &self.dst.host(), sharing).await;
        let b = self.cluster("b", &self.front.host(), sharing).await;
        (a, b)
    }

    /// Pushes `shop/<name>:v1` to the source.
    async fn source_image(&self, name: &str, seed: u64) -> Img {
        let image = Image::oci(1, seed);
        push_image(&self.src, &format!("shop/{name}"), Some("v1"), &image).await;
        Img {
            source: format!("{}/shop/{name}:v1", self.src.host()),
            repo: format!("mirror/127.0.0.1_{}/shop/{name}", self.src.port()),
            image,
        }
    }

    /// The target holds `img`'s manifest by digest, byte for byte.
    async fn present(&self, img: &Img) -> bool {
        match self.dst.get_manifest(&img.repo, &img.image.digest).await {
            Some((bytes, _, _)) => bytes == img.image.manifest,
            None => false,
        }
    }
}

struct Img {
    image: Image,
    source: String,
    repo: String,
}

impl Img {
    /// The pinned target reference `cluster`'s Pods run.
    fn target(&self, cluster: &Cluster) -> Reference {
        Reference::parse(&format!(
            "{}/{}:v1@{}",
            cluster.host, self.repo, self.image.digest
        ))
        .unwrap()
    }

    /// As a pass of `cluster` names it.
    fn key(&self, cluster: &Cluster) -> String {
        format!("{}/{}@{}", cluster.host, self.repo, self.image.digest)
    }
}

impl Cluster {
    /// Admits a Pod running `img`; asserts it was rewritten to the target.
    async fn run(&self, img: &Img) {
        let (patched, _) = admit(&self.adm, &pod("shop", "p", &[("app", &img.source)])).await;
        assert_eq!(
            patched["spec"]["containers"][0]["image"],
            img.target(self).to_string().as_str(),
            "cluster {} rewrote its Pod",
            self.name
        );
    }

    fn uses(&self, imgs: &[&Img]) -> InUse {
        InUse {
            synced: true,
            images: imgs.iter().map(|i| i.target(self)).collect(),
        }
    }

    /// The sample `name{label="value"}`, 0 when absent.
    fn metric(&self, name: &str, label: (&str, &str)) -> f64 {
        common::metrics::sample(&self.metrics.encode(), name, &[label]).unwrap_or(0.0)
    }
}

async fn idle() {
    tokio::time::sleep(Duration::from_millis(1200)).await;
}

/// The second cluster's first admission of an image the first mirrored
/// copies nothing: no blob read at the source, no upload at the target.
#[tokio::test]
async fn a_second_cluster_copies_nothing_the_first_mirrored() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let x = r.source_image("x", 1).await;
    a.run(&x).await;
    assert!(r.present(&x).await);
    let source_before = r.src.log().lines().count();
    r.front.reset();
    b.run(&x).await;
    let at_target = r.front.requests();
    assert!(
        at_target
            .iter()
            .all(|(m, p)| m == "GET" || m == "HEAD" || !p.contains("/blobs/")),
        "no upload at the target: {at_target:?}"
    );
    assert_eq!(
        r.front.count_method("POST", "/blobs/uploads/") + r.front.count_method("PUT", "/"),
        0,
        "{at_target:?}"
    );
    let source_blob_reads = r
        .src
        .log()
        .lines()
        .skip(source_before)
        .filter(|l| l.contains("\"GET /v2/") && l.contains("/blobs/"))
        .count();
    assert_eq!(source_blob_reads, 0, "no blob read at the source");
}

/// Retention in each cluster keeps what the other uses, and still removes
/// what neither does.
#[tokio::test]
async fn each_clusters_retention_keeps_what_the_other_uses() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let (x, y, z) = (
        r.source_image("x", 11).await,
        r.source_image("y", 12).await,
        r.source_image("z", 13).await,
    );
    a.run(&x).await;
    b.run(&y).await;
    a.run(&z).await;
    // Each leader's publisher has run once.
    a.publisher.publish(&a.uses(&[&x]), true).await.unwrap();
    b.publisher.publish(&b.uses(&[&y]), true).await.unwrap();
    // First sight, then past unusedFor, in both.
    for _ in 0..2 {
        let ra = a.ret.sweep(&a.uses(&[&x])).await.unwrap();
        let rb = b.ret.sweep(&b.uses(&[&y])).await.unwrap();
        assert_eq!(ra.state(&y.key(&a)).unwrap(), State::InUse, "{ra:?}");
        assert_eq!(rb.state(&x.key(&b)).unwrap(), State::InUse, "{rb:?}");
        assert!(
            ra.find(&y.key(&a))
                .unwrap()
                .why
                .contains("in use in cluster b"),
            "{ra:?}"
        );
        idle().await;
    }
    assert!(r.present(&x).await && r.present(&y).await);
    assert!(!r.present(&z).await, "what no cluster uses goes");
    // B stops using Y: it goes once unused for unusedFor everywhere.
    b.ret.sweep(&b.uses(&[])).await.unwrap();
    idle().await;
    a.ret.sweep(&a.uses(&[&x])).await.unwrap();
    assert!(!r.present(&y).await, "unused in both clusters: removed");
    assert!(r.present(&x).await);
}

/// A cluster gone offline keeps everything it listed, until it is
/// forgotten with `pinswap clusters forget`.
#[tokio::test]
async fn a_stale_cluster_keeps_what_it_listed_until_forgotten() {
    let r = rig().await;
    let (a, b) = r.two("interval: 1s, staleAfter: 3s").await;
    let (x, y) = (r.source_image("x", 21).await, r.source_image("y", 22).await);
    a.run(&x).await;
    b.run(&y).await;
    b.ret.sweep(&b.uses(&[&y])).await.unwrap();
    // B is gone: nothing publishes its record any more.
    drop(b);
    a.ret.sweep(&a.uses(&[&x])).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    for _ in 0..2 {
        let ra = a.ret.sweep(&a.uses(&[&x])).await.unwrap();
        let kept = ra.find(&y.key(&a)).unwrap();
        assert_eq!(kept.state, State::Kept, "{ra:?}");
        assert!(
            kept.why.contains("cluster b's usage record is stale"),
            "{}",
            kept.why
        );
        idle().await;
    }
    assert!(r.present(&y).await);
    assert_eq!(
        a.metric("pinswap_usage_record_stale", ("cluster", "b")),
        1.0
    );

    let cfg = common::cache_home();
    let path = cfg.path().join("a.yaml");
    std::fs::write(&path, cli_config(&a)).unwrap();
    let list = common::cli::pinswap(&["clusters", "list", "-c", path.to_str().unwrap()]).await;
    assert_eq!(list.code, 0, "{}", list.stderr);
    let line = |name: &str| {
        list.stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{}", list.stdout))
            .to_owned()
    };
    assert!(line("b").ends_with("stale"), "{}", list.stdout);
    assert!(line("a").ends_with("fresh"), "{}", list.stdout);
    let out =
        common::cli::pinswap(&["clusters", "forget", "-c", path.to_str().unwrap(), "b"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let again =
        common::cli::pinswap(&["clusters", "forget", "-c", path.to_str().unwrap(), "b"]).await;
    assert_eq!(again.code, 1);
    again.says("no usage record of cluster b");

    let ra = a.ret.sweep(&a.uses(&[&x])).await.unwrap();
    assert_eq!(ra.state(&y.key(&a)), Some(State::Removed), "{ra:?}");
    assert!(r.present(&x).await && !r.present(&y).await);
}

/// The config file a cluster was built from, for the CLI.
fn cli_config(c: &Cluster) -> String {
    format!(
        "target: {{registry: \"{}/mirror\"}}\ncluster: {}\nsharing: {{enabled: true, interval: 1s, checkEvery: 300ms, staleAfter: {}s}}\n",
        c.host,
        c.name,
        c.config.sharing.stale_after.as_secs()
    )
}

/// Both leaders run retention at the same moment, round after round with
/// random delays and random images in use: no image in use is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaders_sweeping_at_once_never_remove_what_either_uses() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let mut pool = Vec::new();
    for i in 0..6 {
        pool.push(r.source_image(&format!("i{i}"), 40 + i).await);
    }
    let seed = Timestamp::now().as_millisecond() as u64;
    eprintln!("seed {seed}");
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut removed = 0;
    for round in 0..12 {
        let pick = |bits: u64| -> Vec<&Img> {
            pool.iter()
                .enumerate()
                .filter(|(i, _)| bits >> i & 1 == 1)
                .map(|(_, img)| img)
                .collect()
        };
        let (ua, ub) = (pick(next()), pick(next()));
        // Each cluster's Pods are admitted (and mirrored again when gone).
        for img in &ua {
            a.run(img).await;
        }
        for img in &ub {
            b.run(img).await;
        }
        let (da, db) = (next() % 400, next() % 400);
        let (ia, ib) = (a.uses(&ua), b.uses(&ub));
        let (ra, rb) = tokio::join!(
            async {
                tokio::time::sleep(Duration::from_millis(da)).await;
                a.ret.sweep(&ia).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(db)).await;
                b.ret.sweep(&ib).await
            }
        );
        for rep in [ra, rb] {
            match rep {
                Ok(rep) => removed += rep.count(State::Removed),
                // A record read while the other leader rewrites it can read
                // as missing (Distribution 2.8 rewrites a tag's link in
                // place): that pass stops, removing nothing, as designed.
                Err(e @ pinswap::retention::RetentionError::Records(_)) => {
                    eprintln!("round {round}: {e}");
                }
                Err(e) => panic!("round {round} (seed {seed}): {e}"),
            }
        }
        for img in ua.iter().chain(&ub) {
            assert!(
                r.present(img).await,
                "round {round} (seed {seed}): {} in use was removed",
                img.repo
            );
        }
        idle().await;
    }
    eprintln!("{removed} unused images removed over the rounds");
    assert!(
        removed > 0,
        "retention removed nothing: the test proved nothing"
    );
}

/// Every failure around the records ends with nothing removed, and with a
/// metric and a log line that say why.
#[tokio::test]
async fn a_record_that_cannot_be_read_or_written_removes_nothing() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let z = r.source_image("z", 31).await;
    b.run(&z).await;
    // Past unusedFor for both, used by neither.
    a.ret.sweep(&a.uses(&[])).await.unwrap();
    b.ret.sweep(&b.uses(&[])).await.unwrap();
    idle().await;

    // B cannot read A's record (the target answers 503 for it).
    r.front.set(Mode::RefuseFirst(
        "GET",
        "/pinswap-usage/manifests/a",
        503,
        None,
    ));
    let e = b.ret.sweep(&b.uses(&[])).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("reading the clusters' usage records"),
        "{e}"
    );
    assert_eq!(
        b.metric(
            "pinswap_retention_passes_total",
            ("outcome", "records_unreadable")
        ),
        1.0
    );
    assert!(r.present(&z).await);

    // B cannot publish its own record first.
    r.front.set(Mode::RefuseFirst(
        "PUT",
        "/pinswap-usage/manifests/b",
        403,
        None,
    ));
    let e = b.ret.sweep(&b.uses(&[])).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("publishing this cluster's usage record"),
        "{e}"
    );
    assert_eq!(
        b.metric(
            "pinswap_retention_passes_total",
            ("outcome", "record_not_published")
        ),
        1.0
    );
    assert_eq!(
        b.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "failed")
        ),
        1.0
    );
    assert!(r.present(&z).await);

    // A record that is not one: a plain image under a cluster's tag.
    let other = Image::oci(1, 32);
    push_image(&r.dst, "mirror/pinswap-usage", Some("c"), &other).await;
    let e = a.ret.sweep(&a.uses(&[])).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("the usage record of cluster c cannot be read"),
        "{e}"
    );
    assert!(r.present(&z).await);
    let records = Records::of(a.adm.mirror()).await.unwrap();
    assert!(records.forget("c").await.unwrap());

    // An incomplete record: its cluster uses more than a record holds.
    records
        .publish(
            &ClusterRecord {
                cluster: "d".into(),
                updated: Timestamp::now(),
                complete: false,
                in_use: 30_000,
                images: Default::default(),
                quotas: Vec::new(),
            },
            &mut Default::default(),
        )
        .await
        .unwrap();
    let e = a.ret.sweep(&a.uses(&[])).await.unwrap_err();
    assert!(e.to_string().contains("cluster d is incomplete"), "{e}");
    assert_eq!(
        a.metric(
            "pinswap_retention_passes_total",
            ("outcome", "record_incomplete")
        ),
        1.0
    );
    assert!(r.present(&z).await);
    assert!(records.forget("d").await.unwrap());

    // With the records readable again, the unused image goes.
    r.front.set(Mode::Pass);
    let rb = b.ret.sweep(&b.uses(&[])).await.unwrap();
    assert_eq!(rb.state(&z.key(&b)), Some(State::Removed), "{rb:?}");
}

/// A cluster's record survives the cluster: a new leader (or a cluster
/// rebuilt under the same name) carries on the last use it finds there.
#[tokio::test]
async fn a_clusters_record_outlives_its_leader() {
    let r = rig().await;
    let a = r.cluster("a", &r.dst.host(), "staleAfter: 1h").await;
    let x = r.source_image("x", 51).await;
    a.run(&x).await;
    a.publisher.publish(&a.uses(&[&x]), true).await.unwrap();
    let records = Records::of(a.adm.mirror()).await.unwrap();
    let first = records.read("a").await.unwrap().unwrap();
    let key = format!("{}@{}", x.repo, x.image.digest);
    assert_eq!(first.images[&key], first.updated);
    drop(a);
    let again = r.cluster("a", &r.dst.host(), "staleAfter: 1h").await;
    again
        .publisher
        .publish(&again.uses(&[]), true)
        .await
        .unwrap();
    let second = records.read("a").await.unwrap().unwrap();
    assert_eq!(
        second.images[&key], first.updated,
        "carried on, not renewed"
    );
    assert!(second.updated > first.updated);
}

/// The registry requests of a retention pass and of a record update, for
/// 1 and for 10 clusters sharing the target (the figures in
/// docs/operations.md): a pass lists the records once and GETs each other
/// record's manifest, and fetches only the shards it has not read before;
/// an update uploads only the shards that changed.
#[tokio::test]
async fn requests_per_pass_and_per_record_update() {
    let r = rig().await;
    let b = r.cluster("b", &r.front.host(), "staleAfter: 1h").await;
    let x = r.source_image("x", 61).await;
    b.run(&x).await;
    let records = Records::of(b.adm.mirror()).await.unwrap();
    let other = |i: usize, extra: usize| ClusterRecord {
        cluster: format!("o{i}"),
        updated: Timestamp::now(),
        complete: true,
        in_use: 1 + extra,
        images: std::iter::once(format!("{}@{}", x.repo, x.image.digest))
            .chain((0..extra).map(|n| format!("{}@sha256:{n:064x}", x.repo)))
            .map(|k| (k, Timestamp::now()))
            .collect(),
        quotas: Vec::new(),
    };
    let blob_gets = |reqs: &[(String, String)]| {
        reqs.iter()
            .filter(|(m, p)| m == "GET" && p.contains("/pinswap-usage/blobs/"))
            .count()
    };
    for others in [0usize, 9] {
        for i in 0..others {
            records
                .publish(&other(i, 0), &mut Default::default())
                .await
                .unwrap();
        }
        b.ret.sweep(&b.uses(&[&x])).await.unwrap();
        r.front.reset();
        b.ret.sweep(&b.uses(&[&x])).await.unwrap();
        let pass = r.front.requests();
        // Retention's own record, kept under a tag of its own there.
        let own: Vec<_> = pass
            .iter()
            .filter(|(_, p)| p.contains("/_retention"))
            .collect();
        let record_reads = pass
            .iter()
            .filter(|(_, p)| p.contains("/pinswap-usage/"))
            .count();
        let total = pass.len();
        r.front.reset();
        b.publisher.publish(&b.uses(&[&x]), true).await.unwrap();
        let update = r.front.requests();
        eprintln!(
            "{} clusters: a pass sends {total} requests, {record_reads} of them to the records; an update with nothing new sends {}",
            others + 1,
            update.len()
        );
        // An update with nothing new: a HEAD of its tag (one writer per
        // name), the manifest PUT (a new time) and the DELETE of the
        // version before; no shard changed, so none is uploaded.
        let methods: Vec<&str> = update.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(methods, ["HEAD", "PUT", "DELETE"], "{update:#?}");
        // A pass: its own update, one tag list, and a manifest GET per
        // other cluster; their shards were read in the pass before. Then
        // retention's record, with nothing changed: read (its shards
        // known), its tag checked, a new manifest, the one before removed
        // by digest.
        assert_eq!(blob_gets(&pass), 0, "{pass:#?}");
        assert_eq!(record_reads, 3 + 1 + others + 4, "{pass:#?}");
        let methods: Vec<&str> = own.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(methods, ["GET", "HEAD", "PUT"], "{own:#?}");
        // Another cluster's record changes: the next pass fetches its
        // changed shard, and only that.
        if others > 0 {
            records
                .publish(&other(0, 1), &mut Default::default())
                .await
                .unwrap();
            r.front.reset();
            b.ret.sweep(&b.uses(&[&x])).await.unwrap();
            assert_eq!(blob_gets(&r.front.requests()), 1);
        }
        for i in 0..others {
            records.forget(&format!("o{i}")).await.unwrap();
        }
    }
}

/// A record of 2,000 images, then one new image: the update uploads one
/// shard, under 64 KiB, in 5 requests, whatever the record's size; the
/// record read back holds every entry.
#[tokio::test]
async fn a_large_record_is_updated_one_shard_at_a_time() {
    let r = rig().await;
    let b = r.cluster("b", &r.front.host(), "staleAfter: 1h").await;
    let x = r.source_image("x", 62).await;
    let image =
        |n: usize| Reference::parse(&format!("{}/{}@sha256:{n:064x}", b.host, x.repo)).unwrap();
    let uses = |n: usize| InUse {
        synced: true,
        images: (0..n).map(image).collect(),
    };
    let first = b.publisher.publish(&uses(2000), true).await.unwrap();
    let Published::Written { entries, bytes } = first else {
        panic!("{first:?}")
    };
    assert_eq!(entries, 2000);
    r.front.reset();
    let next = b.publisher.publish(&uses(2001), false).await.unwrap();
    let update = r.front.requests();
    let Published::Written {
        entries,
        bytes: new,
    } = next
    else {
        panic!("{next:?}")
    };
    eprintln!(
        "a record of {entries} entries: {bytes} bytes of shards at first, {new} bytes and {} requests for one new image",
        update.len()
    );
    assert_eq!(entries, 2001);
    assert!(update.len() <= 5, "{update:#?}");
    let uploads = update.iter().filter(|(m, _)| m == "POST").count();
    assert_eq!(uploads, 1, "{update:#?}");
    assert!(new <= 64 * 1024, "{new} bytes");
    assert!(new * 4 < bytes, "{new} of {bytes} bytes");
    let read = Records::of(b.adm.mirror())
        .await
        .unwrap()
        .read("b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.images.len(), 2001);
    assert!(read.complete);
    for n in [0, 1000, 2000] {
        let key = format!("{}@sha256:{n:064x}", x.repo);
        assert_eq!(read.images.get(&key), Some(&read.updated), "{key}");
    }
}

/// A record in the earlier format, one JSON layer, is read by the other
/// clusters' retention as before, and its own cluster's next publication
/// replaces it with the sharded one, every last use carried on: the pass
/// in between keeps what it names in use and removes what no cluster
/// uses, and the version before is removed.
#[tokio::test]
async fn a_record_in_the_earlier_format_is_read_and_replaced() {
    use common::fixtures::Blob;
    use common::push::{push_blob, push_manifest};
    use pinswap::retention::clusters::{ARTIFACT_TYPE, ARTIFACT_TYPE_V1};
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let (x, y, z) = (
        r.source_image("x", 71).await,
        r.source_image("y", 72).await,
        r.source_image("z", 73).await,
    );
    for img in [&x, &y, &z] {
        a.run(img).await;
    }
    // A's record as the earlier format has it: X in use, Y last used half
    // an hour ago.
    let now = Timestamp::now();
    let half_hour_ago = now - std::time::Duration::from_secs(1800);
    let key = |img: &Img| format!("{}@{}", img.repo, img.image.digest);
    let v1 = ClusterRecord {
        cluster: "a".into(),
        updated: now,
        complete: true,
        in_use: 1,
        images: [(key(&x), now), (key(&y), half_hour_ago)].into(),
        quotas: Vec::new(),
    };
    let config = Blob::new("application/vnd.oci.empty.v1+json", b"{}".to_vec());
    let layer = Blob::new(ARTIFACT_TYPE_V1, serde_json::to_vec(&v1).unwrap());
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": ARTIFACT_TYPE_V1,
        "config": config.descriptor(),
        "layers": [layer.descriptor()],
    }))
    .unwrap();
    let repo = "mirror/pinswap-usage";
    push_blob(&r.dst, repo, &config).await;
    push_blob(&r.dst, repo, &layer).await;
    push_manifest(
        &r.dst,
        repo,
        "a",
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    )
    .await;
    let v1_digest = common::sha256_digest(&manifest);
    // B reads it: X stays, in use in A; Z, which no cluster uses, goes.
    b.publisher.publish(&b.uses(&[]), true).await.unwrap();
    b.ret.sweep(&b.uses(&[])).await.unwrap();
    idle().await;
    let rb = b.ret.sweep(&b.uses(&[])).await.unwrap();
    assert_eq!(rb.state(&x.key(&b)), Some(State::InUse), "{rb:?}");
    assert!(r.present(&x).await);
    assert!(!r.present(&z).await, "{rb:?}");
    // A publishes: the sharded format, with the half-hour-old use of Y
    // carried on exactly, and the earlier version removed.
    a.publisher.publish(&a.uses(&[&x]), false).await.unwrap();
    let (bytes, _, _) = r.dst.get_manifest(repo, "a").await.unwrap();
    let m: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(m["artifactType"], ARTIFACT_TYPE);
    assert!(r.dst.get_manifest(repo, &v1_digest).await.is_none());
    let read = Records::of(a.adm.mirror())
        .await
        .unwrap()
        .read("a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.images.get(&key(&y)), Some(&half_hour_ago));
    assert_eq!(read.images.get(&key(&x)), Some(&read.updated));
    // And B, reading the new format, still keeps X.
    idle().await;
    let rb = b.ret.sweep(&b.uses(&[])).await.unwrap();
    assert_eq!(rb.state(&x.key(&b)), Some(State::InUse), "{rb:?}");
    assert!(r.present(&x).await);
}

/// An image used again after a while is published at once, not at the
/// next interval: its old time would let another cluster remove it (a
/// rollback to an earlier image is the common case).
#[tokio::test]
async fn an_image_used_again_is_published_at_once() {
    let r = rig().await;
    let a = r.cluster("a", &r.dst.host(), "staleAfter: 1h").await;
    let x = r.source_image("x", 81).await;
    a.run(&x).await;
    a.publisher.publish(&a.uses(&[&x]), true).await.unwrap();
    a.publisher.publish(&a.uses(&[]), true).await.unwrap();
    assert_eq!(
        a.publisher.publish(&a.uses(&[]), false).await.unwrap(),
        Published::Unchanged,
        "nothing new within sharing.interval"
    );
    let again = a.publisher.publish(&a.uses(&[&x]), false).await.unwrap();
    assert!(matches!(again, Published::Written { .. }), "{again:?}");
    let records = Records::of(a.adm.mirror()).await.unwrap();
    let rec = records.read("a").await.unwrap().unwrap();
    assert_eq!(
        rec.images[&format!("{}@{}", x.repo, x.image.digest)],
        rec.updated
    );
}

/// Each publication removes the version before it, and a second install
/// under the same cluster name is found out instead of overwritten.
#[tokio::test]
async fn one_writer_per_name_and_no_versions_left_behind() {
    let r = rig().await;
    let a = r.cluster("a", &r.dst.host(), "staleAfter: 1h").await;
    let records = Records::of(a.adm.mirror()).await.unwrap();
    a.publisher.publish(&a.uses(&[]), true).await.unwrap();
    let first = records.read_full("a").await.unwrap().unwrap().digest;
    a.publisher.publish(&a.uses(&[]), true).await.unwrap();
    let second = records.read_full("a").await.unwrap().unwrap().digest;
    assert_ne!(first, second);
    let repo = "mirror/pinswap-usage";
    assert!(
        r.dst
            .head_manifest(repo, &first.to_string())
            .await
            .is_none(),
        "the version before is gone"
    );

    // Another install named "a" too: it reads the record back and writes;
    // the first one then finds a record it did not write.
    let twin = r.cluster("a", &r.front.host(), "staleAfter: 1h").await;
    twin.publisher.publish(&twin.uses(&[]), true).await.unwrap();
    let e = a.publisher.publish(&a.uses(&[]), true).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("another install publishes a usage record under cluster name a"),
        "{e}"
    );
    assert_eq!(
        a.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "conflict")
        ),
        1.0
    );
    // A conflict reads the record back: the next try writes (a write
    // whose answer was lost heals so), and the twin, still writing, is
    // found out in its turn. The twin's version, which this install did
    // not write, stays.
    let twins = records.read_full("a").await.unwrap().unwrap().digest;
    a.publisher.publish(&a.uses(&[]), true).await.unwrap();
    assert!(
        r.dst
            .head_manifest(repo, &twins.to_string())
            .await
            .is_some(),
        "another install's version stays"
    );
    assert_eq!(
        a.metric(
            "pinswap_usage_record_versions_total",
            ("outcome", "not_own")
        ),
        1.0
    );
    let e = twin
        .publisher
        .publish(&twin.uses(&[]), true)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("another install"), "{e}");
    assert_eq!(
        twin.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "conflict")
        ),
        1.0
    );
    twin.publisher.publish(&twin.uses(&[]), true).await.unwrap();
    let e = a.publisher.publish(&a.uses(&[]), true).await.unwrap_err();
    assert!(e.to_string().contains("another install"), "{e}");
    let pass = a.ret.sweep(&a.uses(&[])).await;
    assert!(pass.is_ok(), "read back, then written: {pass:?}");
}

/// An install with sharing off never removes from a target other
/// clusters publish records at: their images would look unused to it.
#[tokio::test]
async fn retention_with_sharing_off_removes_nothing_from_a_shared_target() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let z = r.source_image("z", 91).await;
    b.run(&z).await;
    b.publisher.publish(&b.uses(&[&z]), true).await.unwrap();
    let mirror = a.adm.mirror().clone();
    let policy = Policy::new(&a.config, mirror.target().clone()).unwrap();
    let api = KubeApi::start().await;
    api.authorize_install(&a.config, Tls::CertManager);
    let alone = Retention::new(
        mirror,
        policy,
        Store::new(api.install_client(), NS),
        &a.config.retention,
    );
    alone.sweep(&a.uses(&[])).await.unwrap_err();
    idle().await;
    let e = alone.sweep(&a.uses(&[])).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("the target holds usage records of clusters [\"b\"]"),
        "{e}"
    );
    assert_eq!(
        a.metric("pinswap_retention_passes_total", ("outcome", "sharing_off")),
        2.0
    );
    assert!(r.present(&z).await);
}

/// Whether the target holds other clusters' records is known only from an
/// answer: a transient error listing them (here one 503) leaves it
/// unknown, and an install with sharing off removes nothing then.
#[tokio::test]
async fn sharing_off_removes_nothing_when_the_records_cannot_be_listed() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let z = r.source_image("z", 93).await;
    a.run(&z).await;
    a.publisher.publish(&a.uses(&[&z]), true).await.unwrap();
    // An install with sharing off, reaching the target through the front.
    let mirror = b.adm.mirror().clone();
    let policy = Policy::new(&b.config, mirror.target().clone()).unwrap();
    let api = KubeApi::start().await;
    api.authorize_install(&b.config, Tls::CertManager);
    let alone = Retention::new(
        mirror,
        policy,
        Store::new(api.install_client(), NS),
        &b.config.retention,
    );
    for _ in 0..2 {
        r.front.set(Mode::RefuseFirst(
            "GET",
            "pinswap-usage/tags/list",
            503,
            None,
        ));
        let e = alone.sweep(&b.uses(&[])).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("whether other clusters publish usage records at the target is unknown"),
            "{e}"
        );
        idle().await;
    }
    assert_eq!(
        b.metric(
            "pinswap_retention_passes_total",
            ("outcome", "sharing_unknown")
        ),
        2.0
    );
    assert_eq!(r.front.count_method("DELETE", "/manifests/"), 0);
    assert!(r.present(&z).await);
    // Answered, the records are found and still nothing is removed.
    r.front.set(Mode::Pass);
    let e = alone.sweep(&b.uses(&[])).await.unwrap_err();
    assert!(e.to_string().contains("clusters [\"a\"]"), "{e}");
    assert!(r.present(&z).await);
}

/// A last use ahead of this clock (a skewed or forged record) goes into
/// the local record as now at the latest: once its cluster is forgotten,
/// the image ages out like any other.
#[tokio::test]
async fn a_future_last_use_does_not_outlive_its_record() {
    let r = rig().await;
    let (a, _b) = r.two("staleAfter: 1h").await;
    let z = r.source_image("z", 94).await;
    a.run(&z).await;
    let records = Records::of(a.adm.mirror()).await.unwrap();
    let ahead = Timestamp::now() + std::time::Duration::from_secs(365 * 24 * 3600);
    records
        .publish(
            &ClusterRecord {
                cluster: "skewed".into(),
                updated: Timestamp::now(),
                complete: true,
                in_use: 1,
                images: [(format!("{}@{}", z.repo, z.image.digest), ahead)].into(),
                quotas: Vec::new(),
            },
            &mut Default::default(),
        )
        .await
        .unwrap();
    let pass = a.ret.sweep(&a.uses(&[])).await.unwrap();
    assert_eq!(pass.state(&z.key(&a)), Some(State::InUse));
    assert!(records.forget("skewed").await.unwrap());
    idle().await;
    let pass = a.ret.sweep(&a.uses(&[])).await.unwrap();
    assert_eq!(pass.state(&z.key(&a)), Some(State::Removed), "{pass:?}");
    assert!(!r.present(&z).await);
}

/// A leader whose watches never list publishes nothing: each round counts
/// as `not_synced`, and after three `sharing.interval` the record is
/// overdue (the alert's gauge), until a publication lands.
#[tokio::test]
async fn a_leader_that_never_syncs_is_overdue() {
    let r = rig().await;
    let a = r
        .cluster("a", &r.dst.host(), "interval: 300ms, staleAfter: 1h")
        .await;
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let in_use: pinswap::retention::InUseSource = {
        let synced = synced.clone();
        Arc::new(move || InUse {
            synced: synced.load(std::sync::atomic::Ordering::SeqCst),
            images: Vec::new(),
        })
    };
    let (lead, leader) = tokio::sync::watch::channel(true);
    let run = tokio::spawn(pinswap::retention::publish::run(
        a.publisher.clone(),
        in_use,
        leader,
    ));
    let overdue = || {
        common::metrics::sample(&a.metrics.encode(), "pinswap_usage_record_overdue", &[])
            .unwrap_or(-1.0)
    };
    let started = std::time::Instant::now();
    while overdue() != 1.0 {
        assert!(started.elapsed() < Duration::from_secs(20), "never overdue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Not before three intervals (900 ms) had gone by with nothing written.
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(
        a.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "not_synced")
        ) >= 3.0
    );
    assert_eq!(
        a.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "published")
        ),
        0.0
    );
    synced.store(true, std::sync::atomic::Ordering::SeqCst);
    let started = std::time::Instant::now();
    while overdue() != 0.0 {
        assert!(started.elapsed() < Duration::from_secs(20), "still overdue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        a.metric(
            "pinswap_usage_record_publishes_total",
            ("outcome", "published")
        ) >= 1.0
    );
    lead.send(false).unwrap();
    run.abort();
}

/// A plan with sharing on keeps what another cluster's record names, says
/// so, and publishes nothing; the pass after it removes what it named.
#[tokio::test]
async fn a_plan_keeps_what_another_cluster_uses_and_publishes_nothing() {
    let r = rig().await;
    let (a, b) = r.two("staleAfter: 1h").await;
    let x = r.source_image("x", 95).await;
    let y = r.source_image("y", 96).await;
    b.run(&x).await;
    b.run(&y).await;
    a.publisher.publish(&a.uses(&[&x]), true).await.unwrap();
    b.ret.sweep(&b.uses(&[])).await.unwrap();
    idle().await;
    r.front.reset();
    let plan = b.ret.plan(&b.uses(&[])).await.unwrap();
    assert_eq!(r.front.count_method("PUT", "pinswap-usage"), 0);
    assert_eq!(r.front.count_method("DELETE", "/manifests/"), 0);
    let kept = plan.find(&x.key(&b)).unwrap();
    assert_eq!(kept.state, State::InUse);
    assert!(kept.why.contains("in use in cluster a"), "{}", kept.why);
    assert_eq!(plan.state(&y.key(&b)), Some(State::Candidate));
    let pass = b.ret.sweep(&b.uses(&[])).await.unwrap();
    assert_eq!(pass.state(&y.key(&b)), Some(State::Removed));
    assert_eq!(pass.state(&x.key(&b)), Some(State::InUse));
    assert!(r.present(&x).await);
}

/// Log lines at INFO and above of the current thread, as text.
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Captures this thread's log lines (a current-thread test runtime
    /// runs every task on it) until the guard drops.
    fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn count(&self, part: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(part))
            .count()
    }
}

/// A target that refuses deletes (`storage.delete.enabled: false`) keeps
/// every version of a record: each publication counts it, one log line
/// per stretch says so, and nothing but the version replaced is asked to
/// go.
#[tokio::test]
async fn a_target_that_refuses_deletes_is_told_once_per_stretch() {
    common::init();
    let dst = TestRegistry::plain_without_deletes().await;
    let front = Front::start(&dst.host()).await;
    let r = Rig {
        src: TestRegistry::plain().await,
        dst,
        front,
    };
    let b = r.cluster("b", &r.front.host(), "staleAfter: 1h").await;
    let records = Records::of(b.adm.mirror()).await.unwrap();
    let (logs, guard) = Logs::capture();
    let told = "keeps every version of this cluster's usage record";
    let mut versions = Vec::new();
    for _ in 0..3 {
        b.publisher.publish(&b.uses(&[]), true).await.unwrap();
        versions.push(records.read_full("b").await.unwrap().unwrap().digest);
    }
    let kept = ("outcome", "kept");
    assert_eq!(b.metric("pinswap_usage_record_versions_total", kept), 2.0);
    assert_eq!(logs.count(told), 1, "once per stretch");
    let repo = "mirror/pinswap-usage";
    for v in &versions {
        assert!(r.dst.head_manifest(repo, &v.to_string()).await.is_some());
    }
    let deletes = r.front.paths("DELETE");
    assert_eq!(
        deletes,
        versions[..2]
            .iter()
            .map(|v| format!("/v2/{repo}/manifests/{v}"))
            .collect::<Vec<_>>(),
        "only the versions replaced"
    );

    // Deletes on: the stretch ends, the version replaced goes; off again:
    // a new stretch, told once more.
    let mut r = r;
    r.dst.set_deletes(true).await;
    b.publisher.publish(&b.uses(&[]), true).await.unwrap();
    assert_eq!(
        b.metric(
            "pinswap_usage_record_versions_total",
            ("outcome", "removed")
        ),
        1.0
    );
    assert!(
        r.dst
            .head_manifest(repo, &versions[2].to_string())
            .await
            .is_none()
    );
    assert_eq!(logs.count("earlier versions are removed again"), 1);
    r.dst.set_deletes(false).await;
    for _ in 0..2 {
        b.publisher.publish(&b.uses(&[]), true).await.unwrap();
    }
    assert_eq!(b.metric("pinswap_usage_record_versions_total", kept), 4.0);
    assert_eq!(logs.count(told), 2, "once per stretch");
    drop(guard);
}

/// With nothing changing, a record is written once per third of
/// `sharing.staleAfter`, not every `sharing.interval`: between, one HEAD
/// per interval makes sure it is still there. Other clusters still see
/// its images in use now, and an image that stops being used gets its
/// true last use.
#[tokio::test]
async fn a_record_is_written_less_often_when_nothing_changes() {
    let r = rig().await;
    let b = r
        .cluster("b", &r.front.host(), "interval: 300ms, staleAfter: 1h")
        .await;
    let x = r.source_image("x", 91).await;
    let y = r.source_image("y", 92).await;
    b.run(&x).await;
    b.run(&y).await;
    let records = Records::of(b.adm.mirror()).await.unwrap();
    let both = b.uses(&[&x, &y]);
    let first = b.publisher.publish(&both, false).await.unwrap();
    assert!(matches!(first, Published::Written { .. }), "{first:?}");
    let written = records.read("b").await.unwrap().unwrap();
    r.front.reset();
    let rounds = 6;
    for _ in 0..rounds {
        tokio::time::sleep(Duration::from_millis(320)).await;
        b.publisher.publish(&both, false).await.unwrap();
    }
    let puts = r.front.count_method("PUT", "/pinswap-usage/manifests/");
    let uploads = r
        .front
        .count_method("POST", "/pinswap-usage/blobs/uploads/");
    let heads = r.front.count_method("HEAD", "/pinswap-usage/manifests/");
    eprintln!(
        "{rounds} intervals with nothing changing: {puts} manifest PUTs, {uploads} blob uploads, {heads} HEADs"
    );
    assert_eq!((puts, uploads), (0, 0), "{:#?}", r.front.requests());
    assert!((1..=rounds).contains(&(heads as usize)), "{heads}");
    // Still in use now, as other clusters read it.
    let rec = records.read("b").await.unwrap().unwrap();
    assert_eq!(rec, written);
    assert!(rec.images.values().all(|t| *t >= rec.updated));

    // y stops being used: written at the interval, with y's last use the
    // last round that saw it, not the record's earlier write.
    tokio::time::sleep(Duration::from_millis(320)).await;
    let only_x = b.uses(&[&x]);
    let next = b.publisher.publish(&only_x, false).await.unwrap();
    assert!(matches!(next, Published::Written { .. }), "{next:?}");
    let rec = records.read("b").await.unwrap().unwrap();
    let y_key = format!("{}@{}", y.repo, y.image.digest);
    assert!(rec.images[&y_key] > written.updated, "{rec:?}");
    assert!(rec.images[&y_key] < rec.updated, "no longer in use now");

    // Forgotten while it runs: written again within an interval.
    records.forget("b").await.unwrap();
    tokio::time::sleep(Duration::from_millis(320)).await;
    let again = b.publisher.publish(&only_x, false).await.unwrap();
    assert!(matches!(again, Published::Written { .. }), "{again:?}");
    assert!(records.read("b").await.unwrap().is_some());
}

/// A record that names what is in use is written again within a third of
/// `sharing.staleAfter`: it never looks stale to another cluster.
#[tokio::test]
async fn a_record_with_nothing_new_never_goes_stale() {
    let r = rig().await;
    let stale_after = Duration::from_millis(1500);
    let a = r
        .cluster("a", &r.dst.host(), "interval: 300ms, staleAfter: 1500ms")
        .await;
    let x = r.source_image("x", 93).await;
    a.run(&x).await;
    let records = Records::of(a.adm.mirror()).await.unwrap();
    let mut writes = 0;
    for _ in 0..10 {
        if matches!(
            a.publisher.publish(&a.uses(&[&x]), false).await.unwrap(),
            Published::Written { .. }
        ) {
            writes += 1;
        }
        let rec = records.read("a").await.unwrap().unwrap();
        assert!(!rec.is_stale(Timestamp::now(), stale_after), "{rec:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!((3..10).contains(&writes), "{writes} writes in 10 rounds");
}

/// A tag added to a candidate while the pass waits to read the records
/// again was never judged: the image stays, and says why. Distribution 2.8
/// writes a manifest's revision link by truncating it first, so the pass's
/// read of the image while the tag's push writes it may get a 500: that
/// pass fails and removes nothing, and the case runs again on an image of
/// its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_added_during_a_pass_keeps_the_image() {
    let r = rig().await;
    let (_a, b) = r.two("staleAfter: 1h").await;
    let mut attempt = 0;
    let (y, pass) = loop {
        attempt += 1;
        let y = r.source_image(&format!("y{attempt}"), 96 + attempt).await;
        b.run(&y).await;
        b.ret.sweep(&b.uses(&[])).await.unwrap();
        idle().await;
        r.front.reset();
        let uses = b.uses(&[]);
        let ret = &b.ret;
        let pass = ret.sweep(&uses);
        let push = async {
            // The pass has listed the target and reads the records a first
            // time; it waits two checkEvery before reading them again.
            while r.front.count_method("GET", "pinswap-usage/tags/list") == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            push_image(&r.dst, &y.repo, Some("keep"), &y.image).await;
        };
        match tokio::join!(pass, push) {
            (Ok(pass), ()) => break (y, pass),
            (Err(e), ()) if attempt < 4 && e.to_string().contains("HTTP 500") => {
                assert!(r.present(&y).await, "a failed pass removed it: {e}");
            }
            (Err(e), ()) => panic!("attempt {attempt}: {e}"),
        }
    };
    let kept = pass.find(&y.key(&b)).unwrap();
    assert_eq!(kept.state, State::Kept, "{pass:?}");
    assert!(kept.why.contains("tag keep points at it"), "{}", kept.why);
    assert!(r.present(&y).await);
    assert_eq!(
        r.dst.head_manifest(&y.repo, "keep").await.as_deref(),
        Some(y.image.digest.as_str())
    );
}
