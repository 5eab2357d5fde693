//! The recovery rig: a source and a target registry, the in-process
//! Kubernetes API, pinswap replicas with their background work, and images
//! to prune and find served again.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::watch::Background;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common;
use crate::common::fixtures::Image;
use crate::common::kube::KubeApi;
use crate::common::review::{admit, pod};
use crate::common::{TestRegistry, push_image};

pub use crate::common::{FAST_RECOVERY as FAST, eventually};

/// A config for `src` → `dst` with `cache` and the fast recovery timings.
pub fn config(src: &TestRegistry, dst: &TestRegistry, cache: &str) -> Config {
    config_with(src, dst, cache, "")
}

/// As [`config`], with more `recovery` keys (indented two spaces).
pub fn config_with(src: &TestRegistry, dst: &TestRegistry, cache: &str, recovery: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {cache}\n{FAST}{recovery}",
        dst.host(),
        src.host()
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

/// A source and a target registry and the Kubernetes API test server.
pub async fn rig() -> (TestRegistry, TestRegistry, KubeApi) {
    common::init();
    (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        KubeApi::start().await,
    )
}

/// One pinswap replica: its admission handler, metrics and background work.
pub struct Replica {
    pub adm: Arc<Admission>,
    pub metrics: Arc<Metrics>,
    pub bg: Option<Background>,
}

impl Replica {
    pub fn new(config: &Config) -> Replica {
        let metrics = Arc::new(Metrics::new());
        let adm = Arc::new(Admission::from_config(config, metrics.clone()).unwrap());
        Replica {
            adm,
            metrics,
            bg: None,
        }
    }

    /// Starts the watcher, recovery and leader election against `api`,
    /// which from then on allows only what the install's RBAC grants.
    pub fn start(&mut self, config: &Config, api: &KubeApi) {
        api.authorize_install(config, pinswap::install::manifests::Tls::CertManager);
        self.bg = Some(Background::start_with(
            self.adm.mirror().clone(),
            config,
            Some(api.install_client()),
            Some(api.eviction_client()),
            CancellationToken::new(),
        ));
    }

    pub async fn stop(&mut self) {
        if let Some(bg) = self.bg.take() {
            bg.stop().await;
        }
    }

    pub fn leading(&self) -> bool {
        self.bg.as_ref().is_some_and(Background::is_leader)
    }

    /// The value of the sample whose line starts with `series` (0 if absent).
    pub fn metric(&self, series: &str) -> f64 {
        sample(&self.metrics.encode(), series)
    }
}

pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// An image in `src` as `shop/<name>:v1`, and where it mirrors to.
pub struct Pushed {
    pub image: Image,
    pub source: String,
    pub repo: String,
}

pub async fn push(src: &TestRegistry, name: &str, seed: u64) -> Pushed {
    push_this(src, name, Image::oci(2, seed)).await
}

pub async fn push_this(src: &TestRegistry, name: &str, image: Image) -> Pushed {
    push_image(src, &format!("shop/{name}"), Some("v1"), &image).await;
    Pushed {
        source: format!("{}/shop/{name}:v1", src.host()),
        repo: format!("mirror/127.0.0.1_{}/shop/{name}", src.port()),
        image,
    }
}

/// Admits a one-container Pod running `image` in namespace `shop`, checks
/// it was rewritten and pinned, stores it in the API server, and returns it.
pub async fn admit_and_store(
    r: &Replica,
    api: &KubeApi,
    name: &str,
    img: &Pushed,
    dst: &TestRegistry,
) -> Value {
    let (patched, _) = admit(&r.adm, &pod("shop", name, &[("app", &img.source)])).await;
    let want = format!("{}/{}:v1@{}", dst.host(), img.repo, img.image.digest);
    assert_eq!(patched["spec"]["containers"][0]["image"], want.as_str());
    store(api, &patched);
    patched
}

pub fn store(api: &KubeApi, pod: &Value) {
    api.apply_pod(serde_json::from_value::<Pod>(pod.clone()).unwrap());
}

/// Deletes the image's manifest (and so its tag) at the target, and one of
/// its layers, as a lifecycle rule followed by garbage collection would.
pub async fn prune(dst: &TestRegistry, img: &Pushed) {
    dst.delete_manifest(&img.repo, &img.image.digest).await;
    dst.delete_blob(&img.repo, &img.image.layers[0].digest)
        .await;
    assert_eq!(dst.head_manifest(&img.repo, "v1").await, None, "pruned");
}

/// The target serves the image again: tag → same digest, same bytes, and
/// every layer byte-identical.
pub async fn served_again(dst: &TestRegistry, img: &Pushed) -> bool {
    if dst.head_manifest(&img.repo, "v1").await.as_deref() != Some(img.image.digest.as_str()) {
        return false;
    }
    for l in &img.image.layers {
        if dst.blob(&img.repo, &l.digest).await.as_deref() != Some(l.bytes.as_slice()) {
            return false;
        }
    }
    let (bytes, _, _) = dst.get_manifest(&img.repo, "v1").await.unwrap();
    bytes == img.image.manifest
}

pub fn events_for(api: &KubeApi, pod: &str, reason: &str) -> Vec<Value> {
    api.events()
        .into_iter()
        .filter(|e| e["reason"] == reason && e["regarding"]["name"] == pod)
        .collect()
}

/// Waits until the Pod watch is open: the watcher has listed the Pods.
pub async fn wait_watching(api: &KubeApi) {
    eventually("the Pod watch is open", Duration::from_secs(10), || async {
        api.open_watches() > 0
    })
    .await;
}

pub async fn wait_leader(r: &Replica) {
    eventually("leadership", Duration::from_secs(10), || async {
        r.leading()
    })
    .await;
}

/// A config from YAML text.
pub fn yaml_config(yaml: &str) -> Config {
    Config::from_yaml(yaml, "review.yaml").unwrap()
}
