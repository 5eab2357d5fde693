//! The registry matrix: each scenario below runs on each registry of
//! `common::matrix`, the registry as the source and, when it takes pushes,
//! as the target too. The real registries are processes; a vendor's
//! registry is a front over one that behaves as the vendor documents
//! (`common/front/vendor.rs`). What pinswap wrote is read back from the
//! real registry behind, byte for byte.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::copying::{assert_image, assert_index, copy_json};
use common::fixtures::{Image, Index};
use common::front::Vendor;
use common::kube::KubeApi;
use common::matrix::{Kind, Subject};
use common::registry::Engine;
use common::review::{admit, pod};
use common::{push_image, push_index};
use pinswap::admission::Admission;
use pinswap::admission::policy::Policy;
use pinswap::config::Config;
use pinswap::install::manifests::Tls;
use pinswap::reference::Reference;
use pinswap::retention::clusters::Records;
use pinswap::retention::publish::Publisher;
use pinswap::retention::{InUse, Retention, State, Store};
use serde_json::Value;

/// One module per registry, each with every scenario.
macro_rules! matrix {
    ($($name:ident => $kind:expr,)*) => {$(
        mod $name {
            use super::*;
            const KIND: Kind = $kind;
            #[tokio::test]
            async fn copies_every_media_type() {
                super::copies_every_media_type(KIND).await
            }
            #[tokio::test]
            async fn copies_signatures_and_referrers() {
                super::copies_signatures_and_referrers(KIND).await
            }
            #[tokio::test]
            async fn admits_and_recovers_a_lost_image() {
                super::admits_and_recovers_a_lost_image(KIND).await
            }
            #[tokio::test]
            async fn retention_removes_only_the_unused() {
                super::retention_removes_only_the_unused(KIND).await
            }
            #[tokio::test]
            async fn sharing_keeps_what_another_cluster_uses() {
                super::sharing_keeps_what_another_cluster_uses(KIND).await
            }
            #[tokio::test]
            async fn check_reads_every_tag() {
                super::check_reads_every_tag(KIND).await
            }
        }
    )*};
}

matrix! {
    distribution2 => Kind::Real(Engine::Distribution2),
    distribution3 => Kind::Real(Engine::Distribution3),
    ggcr => Kind::Real(Engine::Ggcr),
    quay => Kind::Front(Vendor::Quay),
    harbor_proxy_cache => Kind::Front(Vendor::HarborProxy),
    ghcr => Kind::Front(Vendor::Ghcr),
    docker_hub => Kind::Front(Vendor::DockerHub(1000)),
    ecr => Kind::Front(Vendor::Ecr),
    no_digest_on_head => Kind::Front(Vendor::NoDigestOnHead),
    monolithic_only => Kind::Front(Vendor::MonolithicOnly),
}

fn docker(s: &Subject, path: &str) -> String {
    format!("docker://{}/{path}", s.host())
}

/// Every media type of the copy fixtures, each copied by `pinswap copy`
/// and read back byte for byte, children and blobs included.
async fn copies_every_media_type(kind: Kind) {
    common::init();
    let (src, dst) = Subject::pair(kind).await;
    let images = [
        ("oci", Image::oci(2, 1)),
        ("docker", Image::docker(2, 2)),
        ("spin", Image::spin("hello", 2, None)),
        ("helm", Image::helm("web", "1.0.0")),
        (
            "oras",
            Image::oras("application/vnd.example.sbom+json", "sbom.json", b"{}"),
        ),
    ];
    let indexes = [
        ("oci-index", Index::oci(3, true)),
        ("docker-list", Index::docker(5)),
    ];
    for (name, img) in &images {
        push_image(&src.store, &format!("m/{name}"), Some("v1"), img).await;
    }
    for (name, idx) in &indexes {
        push_index(&src.store, &format!("m/{name}"), Some("v1"), idx).await;
    }
    for (name, img) in &images {
        let r = copy_json(&[
            &docker(&src, &format!("m/{name}:v1")),
            &docker(&dst, &format!("c/{name}:v1")),
        ])
        .await;
        assert_eq!(r["digest"], img.digest.as_str(), "{name}: {r}");
        assert_image(&dst.store, &format!("c/{name}"), "v1", img).await;
    }
    // Again: the target has it, so nothing is pushed (ECR would refuse a
    // second PUT of the tag).
    let again = copy_json(&[&docker(&src, "m/oci:v1"), &docker(&dst, "c/oci:v1")]).await;
    assert_eq!(again["upToDate"], true, "{again}");
    // In chunks of 1 MiB: three PATCHes, or, where the registry refuses
    // a chunk, the blob once more whole.
    let big = Image::random_layers(1, 3 << 20, 3);
    push_image(&src.store, "m/big", Some("v1"), &big).await;
    let r = copy_json(&[
        "--chunked-threshold",
        "1048576",
        &docker(&src, "m/big:v1"),
        &docker(&dst, "c/big:v1"),
    ])
    .await;
    assert_eq!(r["digest"], big.digest.as_str(), "{r}");
    assert_image(&dst.store, "c/big", "v1", &big).await;
    if let Some(front) = &dst.front {
        let patches = front.count_method("PATCH", "/c/big/blobs/uploads/");
        match dst.kind {
            Kind::Front(Vendor::MonolithicOnly) => assert_eq!(patches, 1, "refused once"),
            _ => assert_eq!(patches, 3),
        }
    }
    for (name, idx) in &indexes {
        let r = copy_json(&[
            &docker(&src, &format!("m/{name}:v1")),
            &docker(&dst, &format!("c/{name}:v1")),
        ])
        .await;
        assert_eq!(r["digest"], idx.digest.as_str(), "{name}: {r}");
        assert_index(&dst.store, &format!("c/{name}"), "v1", idx).await;
    }
}

/// cosign's tag schema (`sha256-<hex>.sig`) travels with the image from
/// every source, a pull-through cache's partial tag list included; an
/// OCI 1.1 referrer too, where the source serves the referrers API.
async fn copies_signatures_and_referrers(kind: Kind) {
    common::init();
    let (src, dst) = Subject::pair(kind).await;
    let img = Image::oci(1, 11);
    push_image(&src.store, "app", Some("v1"), &img).await;
    let sig_tag = format!("sha256-{}.sig", &img.digest["sha256:".len()..]);
    let sig = Image::oras(
        "application/vnd.dev.cosign.artifact.sig.v1+json",
        "signature",
        b"a signature",
    );
    push_image(&src.store, "app", Some(&sig_tag), &sig).await;
    let referrer = kind.serves_referrers().then(|| {
        Image::referrer(
            &img.descriptor(),
            "application/vnd.example.sbom+json",
            b"{}",
        )
    });
    if let Some(r) = &referrer {
        push_image(&src.store, "app", None, r).await;
    }

    copy_json(&[&docker(&src, "app:v1"), &docker(&dst, "mirror/app:v1")]).await;
    assert_image(&dst.store, "mirror/app", "v1", &img).await;
    assert_image(&dst.store, "mirror/app", &sig_tag, &sig).await;
    if let Some(r) = &referrer {
        assert_image(&dst.store, "mirror/app", &r.digest, r).await;
    }
}

/// The config for `src` → `dst` with `more` keys, copying at admission
/// and verifying the target at every admission.
fn config(src: &Subject, dst: &Subject, more: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n\
         copyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\n\
         cache: {{ttl: 0s, reverify: 0s}}\n{}{more}",
        dst.host(),
        src.host(),
        common::FAST_RECOVERY,
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

/// An image at the source and where admission mirrors it.
struct Mirrored {
    image: Image,
    source: String,
    repo: String,
}

impl Mirrored {
    async fn push(src: &Subject, name: &str, seed: u64) -> Mirrored {
        let image = Image::oci(1, seed);
        push_image(&src.store, &format!("shop/{name}"), Some("v1"), &image).await;
        Mirrored {
            source: format!("{}/shop/{name}:v1", src.host()),
            repo: format!("mirror/127.0.0.1_{}/shop/{name}", src.port()),
            image,
        }
    }

    /// As a rewritten Pod names it.
    fn target(&self, dst: &Subject) -> String {
        format!("{}/{}:v1@{}", dst.host(), self.repo, self.image.digest)
    }

    /// As retention names it.
    fn key(&self, dst: &Subject) -> String {
        format!("{}/{}@{}", dst.host(), self.repo, self.image.digest)
    }

    /// Admits a Pod named `pod_name` running it; asserts it was rewritten
    /// and the target has it.
    async fn admit(&self, adm: &Admission, dst: &Subject, pod_name: &str) {
        let (patched, response) =
            admit(adm, &pod("shop", pod_name, &[("app", &self.source)])).await;
        assert_eq!(
            patched["spec"]["containers"][0]["image"],
            self.target(dst).as_str(),
            "{response}"
        );
        assert_image(&dst.store, &self.repo, "v1", &self.image).await;
    }
}

/// A Pod is rewritten to the target; the target loses the image (its tag
/// and manifest); the next Pod's admission finds it gone and mirrors it
/// again before rewriting.
async fn admits_and_recovers_a_lost_image(kind: Kind) {
    common::init();
    let (src, dst) = Subject::pair(kind).await;
    let adm = Admission::from_config(&config(&src, &dst, ""), Default::default()).unwrap();
    let app = Mirrored::push(&src, "app", 21).await;
    app.admit(&adm, &dst, "a").await;

    lose(&dst, &app.repo, &app.image.digest).await;
    assert!(dst.store.head_manifest(&app.repo, "v1").await.is_none());
    app.admit(&adm, &dst, "b").await;
}

/// The target loses the manifest, and its tag with it: Distribution drops
/// the tag with the manifest, go-containerregistry keeps them apart.
async fn lose(dst: &Subject, repo: &str, digest: &str) {
    if dst.store.engine() == Engine::Ggcr {
        dst.store.delete_manifest(repo, "v1").await;
    }
    dst.store.delete_manifest(repo, digest).await;
}

/// Two images mirrored by admission; one stays in use. Two passes later
/// the other is gone from the target and the one in use is intact; a
/// target that refuses DELETE keeps both, and the pass says why.
async fn retention_removes_only_the_unused(kind: Kind) {
    common::init();
    let (src, dst) = Subject::pair(kind).await;
    let api = KubeApi::start().await;
    let cfg = config(&src, &dst, "retention: {enabled: true, unusedFor: 1s}\n");
    let adm = Admission::from_config(&cfg, Arc::new(pinswap::metrics::Metrics::new())).unwrap();
    api.authorize_install(&cfg, Tls::CertManager);
    let policy = Policy::new(&cfg, adm.mirror().target().clone()).unwrap();
    let ret = Retention::new(
        adm.mirror().clone(),
        policy,
        Store::new(api.install_client(), "pinswap"),
        &cfg.retention,
    );
    let used = Mirrored::push(&src, "used", 31).await;
    let unused = Mirrored::push(&src, "unused", 32).await;
    used.admit(&adm, &dst, "a").await;
    unused.admit(&adm, &dst, "b").await;

    let in_use = InUse {
        synced: true,
        images: vec![pinswap::reference::Reference::parse(&used.key(&dst)).unwrap()],
    };
    ret.sweep(&in_use).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let report = ret.sweep(&in_use).await.unwrap();
    assert_eq!(
        report.state(&used.key(&dst)),
        Some(State::InUse),
        "{:?}",
        report.images
    );
    assert_image(&dst.store, &used.repo, "v1", &used.image).await;
    let unused_left = dst
        .store
        .head_manifest(&unused.repo, &unused.image.digest)
        .await;
    if dst.kind != Kind::Front(Vendor::Ghcr) {
        assert_eq!(
            report.state(&unused.key(&dst)),
            Some(State::Removed),
            "{:?}",
            report.images
        );
        assert!(unused_left.is_none(), "removed at the target");
        assert_eq!(report.deletes, None);
        return;
    }
    // GHCR refuses DELETE: the pass says so, keeps it, and asks no DELETE
    // of it, in this pass or the next.
    let kept = report.find(&unused.key(&dst)).unwrap();
    assert_eq!(kept.state, State::Kept);
    assert!(kept.why.contains("refuses DELETE"), "{}", kept.why);
    assert_eq!(report.deletes.as_deref(), Some(kept.why.as_str()));
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_image(&dst.store, &unused.repo, "v1", &unused.image).await;
    ret.sweep(&in_use).await.unwrap();
    let front = dst.front.as_ref().unwrap();
    // Retention's record asks once to remove its version before, and
    // keeps them from then on.
    let (record, deletes): (Vec<String>, Vec<String>) = front
        .paths("DELETE")
        .into_iter()
        .partition(|p| p.contains("/pinswap-usage/"));
    assert_eq!(record.len(), 1, "{record:?}");
    assert_eq!(
        deletes.len(),
        2,
        "one question a pass, none of the image: {deletes:?}"
    );
    assert!(
        deletes.iter().all(|p| !p.contains(&unused.image.digest)),
        "{deletes:?}"
    );
}

/// One cluster sharing the target: its admission, publisher and
/// retention, and its own API.
struct Sharing {
    adm: Admission,
    publisher: Arc<Publisher>,
    ret: Retention,
    _api: KubeApi,
}

impl Sharing {
    async fn start(name: &str, src: &Subject, dst: &Subject) -> Sharing {
        let more = format!(
            "cluster: {name}\nretention: {{enabled: true, unusedFor: 1s}}\n\
             sharing: {{enabled: true, keepFor: 1h, checkEvery: 300ms, staleAfter: 1h}}\n"
        );
        let cfg = config(src, dst, &more);
        let adm = Admission::from_config(&cfg, Arc::new(pinswap::metrics::Metrics::new())).unwrap();
        let api = KubeApi::start().await;
        api.authorize_install(&cfg, Tls::CertManager);
        let mirror = adm.mirror().clone();
        let policy = || Policy::new(&cfg, mirror.target().clone()).unwrap();
        let publisher = Arc::new(Publisher::new(mirror.clone(), policy(), name, &cfg.sharing));
        let ret = Retention::new(
            mirror.clone(),
            policy(),
            Store::new(api.install_client(), "pinswap"),
            &cfg.retention,
        )
        .with_sharing(publisher.clone());
        Sharing {
            adm,
            publisher,
            ret,
            _api: api,
        }
    }
}

fn uses(dst: &Subject, images: &[&Mirrored]) -> InUse {
    InUse {
        synced: true,
        images: images
            .iter()
            .map(|m| Reference::parse(&m.target(dst)).unwrap())
            .collect(),
    }
}

/// Two clusters share the target. Each publishes its usage record there
/// (and reads the other's back through the registry's tag list); B's
/// retention keeps what A's record names and removes what neither uses,
/// or, on a target that refuses DELETE, keeps that too and says why.
async fn sharing_keeps_what_another_cluster_uses(kind: Kind) {
    common::init();
    let (src, dst) = Subject::pair(kind).await;
    let (a, b) = (
        Sharing::start("a", &src, &dst).await,
        Sharing::start("b", &src, &dst).await,
    );
    let x = Mirrored::push(&src, "x", 51).await;
    let y = Mirrored::push(&src, "y", 52).await;
    x.admit(&b.adm, &dst, "p").await;
    y.admit(&b.adm, &dst, "q").await;
    a.publisher.publish(&uses(&dst, &[&x]), true).await.unwrap();
    b.publisher.publish(&uses(&dst, &[]), true).await.unwrap();
    let records = Records::of(b.adm.mirror()).await.unwrap();
    assert_eq!(records.names().await.unwrap(), ["a", "b"]);
    let others = b.publisher.others().await.unwrap();
    assert_eq!(others.len(), 1);

    b.ret.sweep(&uses(&dst, &[])).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let report = b.ret.sweep(&uses(&dst, &[])).await.unwrap();
    let kept = report.find(&x.key(&dst)).unwrap();
    assert_eq!(kept.state, State::InUse, "{}", kept.why);
    assert!(kept.why.contains("in use in cluster a"), "{}", kept.why);
    assert_image(&dst.store, &x.repo, "v1", &x.image).await;
    let y_left = dst.store.head_manifest(&y.repo, &y.image.digest).await;
    match dst.kind {
        Kind::Front(Vendor::Ghcr) => {
            assert_eq!(report.state(&y.key(&dst)), Some(State::Kept));
            assert!(y_left.is_some());
        }
        _ => {
            assert_eq!(
                report.state(&y.key(&dst)),
                Some(State::Removed),
                "{:?}",
                report.images
            );
            assert!(y_left.is_none());
        }
    }
}

/// `pinswap check --repository` reads every tag of a repository longer
/// than any registry's page, and flags Spin apps sharing one config.
async fn check_reads_every_tag(kind: Kind) {
    common::init();
    let src = Subject::start(kind).await;
    let plain = Image::oci(1, 41);
    for i in 0..120 {
        push_image(&src.store, "many", Some(&format!("t{i:03}")), &plain).await;
    }
    for app in ["one", "two"] {
        push_image(&src.store, "many", Some(app), &Image::spin(app, 1, None)).await;
    }
    if kind == Kind::Front(Vendor::HarborProxy) {
        // A proxy cache lists what was pulled through it: pull every tag.
        let http = reqwest::Client::new();
        for tag in (0..120)
            .map(|i| format!("t{i:03}"))
            .chain(["one".into(), "two".into()])
        {
            let url = format!("http://{}/v2/many/manifests/{tag}", src.host());
            let resp = http
                .get(url)
                .header("accept", common::registry::MANIFEST_ACCEPT)
                .send()
                .await
                .unwrap();
            assert!(resp.status().is_success(), "{tag}: {}", resp.status());
        }
    }
    let repo = format!("{}/many", src.host());
    let (code, stdout, stderr) =
        common::run_pinswap(&["check", "--json", "--repository", &repo]).await;
    assert_eq!(code, 3, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["images"].as_array().unwrap().len(), 122, "{stdout}");
    assert_eq!(report["flagged"], 2, "{stdout}");
}
