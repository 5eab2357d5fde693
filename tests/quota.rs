//! Pull quotas, against the Docker Hub front (`common/front/vendor.rs`):
//! manifest GETs count, HEADs do not, and `ratelimit-remaining` says what
//! is left. pinswap stops pulling when none remain, says why apart from
//! "missing" and "unreachable", keeps rewriting to what the mirror holds,
//! and with sharing, paces against the pulls of every cluster that uses
//! the same account.

mod common;

use std::sync::Arc;

use common::fixtures::Image;
use common::front::{Front, Mode, Vendor};
use common::kube::KubeApi;
use common::review::{admit, pod};
use common::{TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::admission::policy::Policy;
use pinswap::config::Config;
use pinswap::install::manifests::Tls;
use pinswap::metrics::Metrics;
use pinswap::retention::publish::Publisher;
use serde_json::Value;

/// The source (Distribution behind the Docker Hub front) and the target.
struct Rig {
    store: TestRegistry,
    hub: Front,
    dst: TestRegistry,
    password: tempfile::NamedTempFile,
}

async fn rig(limit: u64) -> Rig {
    common::init();
    let store = TestRegistry::plain().await;
    let hub = Front::start(&store.host()).await;
    hub.set(Mode::Vendor(Vendor::DockerHub(limit)));
    let password = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(password.path(), "hub-token").unwrap();
    Rig {
        store,
        hub,
        dst: TestRegistry::plain().await,
        password,
    }
}

impl Rig {
    /// A cluster's config: pulls as `account` (none: signed in as no one).
    fn config(&self, cluster: &str, account: Option<&str>) -> Config {
        let auth = match account {
            Some(user) => format!(
                ", auth: {{username: {user}, passwordFile: \"{}\"}}",
                self.password.path().display()
            ),
            None => String::new(),
        };
        let yaml = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"{auth}}}]\n\
             copyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\n\
             cache: {{ttl: 0s, reverify: 0s}}\ncluster: {cluster}\n\
             retention: {{enabled: true, unusedFor: 1h}}\n\
             sharing: {{enabled: true, keepFor: 1h, checkEvery: 300ms, staleAfter: 1h}}\n{}",
            self.dst.host(),
            self.hub.host(),
            common::FAST_RECOVERY,
        );
        Config::from_yaml(&yaml, "test.yaml").unwrap()
    }

    /// Pushes `shop/<name>:v1`; the source reference a Pod names.
    async fn image(&self, name: &str, seed: u64) -> String {
        push_image(
            &self.store,
            &format!("shop/{name}"),
            Some("v1"),
            &Image::oci(1, seed),
        )
        .await;
        format!("{}/shop/{name}:v1", self.hub.host())
    }

    /// Manifest GETs the front answered 200 (Docker Hub's pulls), and
    /// how many it answered 429.
    fn pulls(&self) -> (usize, usize) {
        let answered = self.hub.answered();
        let gets = answered
            .iter()
            .filter(|(m, p, _)| m == "GET" && p.contains("/manifests/"));
        let pulled = gets.clone().filter(|(_, _, s)| *s == 200).count();
        let refused = gets.filter(|(_, _, s)| *s == 429).count();
        (pulled, refused)
    }
}

impl Rig {
    /// Waits until nothing reached the front for 300 ms: the referrers a
    /// copy follows in the background are done, and take no pull from the
    /// next copy.
    async fn settled(&self) {
        loop {
            let before = self.hub.total();
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            if self.hub.total() == before {
                return;
            }
        }
    }
}

/// One cluster's admission and publisher.
struct Cluster {
    adm: Admission,
    metrics: Arc<Metrics>,
    publisher: Arc<Publisher>,
    _api: KubeApi,
}

async fn cluster(config: &Config, name: &str) -> Cluster {
    let metrics = Arc::new(Metrics::new());
    let adm = Admission::from_config(config, metrics.clone()).unwrap();
    let api = KubeApi::start().await;
    api.authorize_install(config, Tls::CertManager);
    let mirror = adm.mirror().clone();
    let publisher = Arc::new(Publisher::new(
        mirror.clone(),
        Policy::new(config, mirror.target().clone()).unwrap(),
        name,
        &config.sharing,
    ));
    Cluster {
        adm,
        metrics,
        publisher,
        _api: api,
    }
}

/// The image a Pod running `source` was admitted with, and the decision.
async fn run(c: &Cluster, pod_name: &str, source: &str) -> (String, String) {
    let (patched, _) = admit(&c.adm, &pod("shop", pod_name, &[("app", source)])).await;
    let image = patched["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let decisions: Value = serde_json::from_str(
        patched["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let decision = decisions["containers/app"].as_str().unwrap().to_owned();
    (image, decision)
}

fn rewritten(image: &str, target: &TestRegistry) -> bool {
    image.starts_with(&format!("{}/mirror/", target.host()))
}

/// Six pulls allowed, two a copy (the manifest is read to assess its
/// identity, then copied): three images are mirrored; the fourth is not
/// pulled at all (no 429 is ever answered), its Pod keeps its source with
/// a decision that names the quota, the metric counts it apart, and Pods
/// of the images the mirror holds are still rewritten.
#[tokio::test]
async fn an_exhausted_quota_stops_pulls_and_says_so() {
    let r = rig(6).await;
    let c = cluster(&r.config("a", None), "a").await;
    let mut sources = Vec::new();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        sources.push(r.image(name, 60 + i as u64).await);
    }
    for (i, source) in sources[..3].iter().enumerate() {
        let (image, decision) = run(&c, &format!("p{i}"), source).await;
        assert!(rewritten(&image, &r.dst), "{image}: {decision}");
        r.settled().await;
    }
    assert_eq!(r.pulls(), (6, 0), "{:?}", r.hub.answered());

    let (image, decision) = run(&c, "p3", &sources[3]).await;
    assert_eq!(image, sources[3], "{decision}");
    assert!(decision.contains("pull quota exhausted"), "{decision}");
    assert!(decision.contains("6 of 6 pulls per 6h"), "{decision}");
    assert_eq!(r.pulls(), (6, 0), "not pulled: {:?}", r.hub.answered());
    let text = c.metrics.encode();
    let failures = common::metrics::sample(
        &text,
        "pinswap_source_failures_total",
        &[("registry", &r.hub.host()), ("cause", "quota_exhausted")],
    );
    assert!(failures.unwrap_or(0.0) >= 1.0, "{text}");

    // What the mirror holds is still served.
    let (image, decision) = run(&c, "p4", &sources[0]).await;
    assert!(rewritten(&image, &r.dst), "{image}: {decision}");
    assert_eq!(r.pulls(), (6, 0));
}

/// Two clusters pull as one account, whose quota is 12 (two a copy). A
/// pulls 8 and publishes its record; B reads it, pulls 4, and then pulls
/// no more: the fleet's 12 fill the quota, and B says so before the registry has to
/// refuse anything. Pulls as no one are not shared: an address's quota
/// is not the fleet's.
#[tokio::test]
async fn clusters_that_pull_as_one_account_share_its_quota() {
    let r = rig(12).await;
    let a = cluster(&r.config("a", Some("acme")), "a").await;
    let b = cluster(&r.config("b", Some("acme")), "b").await;
    let mut sources = Vec::new();
    for i in 0..7u64 {
        sources.push(r.image(&format!("app{i}"), 70 + i).await);
    }
    for (i, source) in sources[..4].iter().enumerate() {
        let (image, decision) = run(&a, &format!("a{i}"), source).await;
        assert!(rewritten(&image, &r.dst), "{image}: {decision}");
        r.settled().await;
    }
    a.publisher
        .publish(
            &pinswap::retention::InUse {
                synced: true,
                images: Vec::new(),
            },
            true,
        )
        .await
        .unwrap();
    let others = b.publisher.others().await.unwrap();
    assert_eq!(others[0].quotas.len(), 1, "{:?}", others[0].quotas);
    assert_eq!(others[0].quotas[0].pulls, 8);
    assert_eq!(others[0].quotas[0].limit, 12);
    assert!(
        !format!("{:?}", others[0].quotas).contains("hub-token"),
        "no secret in the record"
    );

    for (i, source) in sources[4..6].iter().enumerate() {
        let (image, decision) = run(&b, &format!("b{i}"), source).await;
        assert!(rewritten(&image, &r.dst), "{image}: {decision}");
        r.settled().await;
    }
    let (image, decision) = run(&b, "b2", &sources[6]).await;
    assert_eq!(image, sources[6], "{decision}");
    assert!(
        decision.contains("12 of 12 pulls per 6h made, 4 here and 8 by the other clusters"),
        "{decision}"
    );
    assert_eq!(r.pulls(), (12, 0), "{:?}", r.hub.answered());
}

/// A Pod fails to pull an image the mirror lost while the source's quota
/// is used up: the re-mirror is not pulled, and its Event says why with a
/// reason of its own.
#[tokio::test]
async fn a_recovery_that_waits_for_the_quota_says_so() {
    use common::recovery::{Replica, events_for, store, wait_leader};
    let r = rig(2).await;
    let api = KubeApi::start().await;
    let cfg = r.config("a", None);
    let mut replica = Replica::new(&cfg);
    let source = r.image("app", 90).await;
    let (patched, _) = admit(&replica.adm, &pod("shop", "web", &[("app", &source)])).await;
    let image = patched["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(rewritten(&image, &r.dst), "{image}");
    assert_eq!(r.pulls(), (2, 0), "the quota is used up");
    store(&api, &patched);
    replica.start(&cfg, &api);
    wait_leader(&replica).await;

    let (repo, digest) = image
        .strip_prefix(&format!("{}/", r.dst.host()))
        .and_then(|rest| rest.split_once(":v1@"))
        .unwrap();
    r.dst.delete_manifest(repo, digest).await;
    store(
        &api,
        &common::review::pull_failing(&patched, "app", "ErrImagePull"),
    );
    common::eventually(
        "the recovery's Event",
        std::time::Duration::from_secs(20),
        || async { !events_for(&api, "web", "SourceQuotaExhausted").is_empty() },
    )
    .await;
    let events = events_for(&api, "web", "SourceQuotaExhausted");
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains("pull quota exhausted"), "{note}");
    assert!(events_for(&api, "web", "RemirrorFailed").is_empty());
    assert_eq!(r.pulls(), (2, 0), "not pulled: {:?}", r.hub.answered());
    replica.stop().await;
}
