//! Helpers of the identity tests: Spin apps sharing one config, configs
//! and admissions under each collision policy, and reading back the
//! configs the target serves.

use crate::common;
use std::sync::Arc;

use crate::common::fixtures::{Image, OCI_INDEX};
use crate::common::review::{admit, pod};
use crate::common::{TestRegistry, push_image, sha256_digest};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::{Value, json};

/// Three Spin apps sharing the pre-2.4 config, pushed as `spin/hello:v1`,
/// `spin/hello:v2` and `spin/other:w`.
pub struct Spin {
    pub src: TestRegistry,
    pub dst: TestRegistry,
    pub apps: Vec<(String, Image)>,
}

pub async fn spin() -> Spin {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let apps = vec![
        ("spin/hello:v1", Image::spin("hello", 1, None)),
        ("spin/hello:v2", Image::spin("hello-v2", 1, None)),
        ("spin/other:w", Image::spin("other", 2, None)),
    ];
    let mut out = Vec::new();
    for (name, img) in apps {
        let (repo, tag) = name.split_once(':').unwrap();
        push_image(&src, repo, Some(tag), &img).await;
        out.push((name.to_owned(), img));
    }
    Spin {
        src,
        dst,
        apps: out,
    }
}

pub fn config(src: &TestRegistry, dst: &TestRegistry, collisions: &str) -> Config {
    config_extra(src, dst, collisions, "")
}

/// As [`config`], with more top-level keys.
pub fn config_extra(
    src: &TestRegistry,
    dst: &TestRegistry,
    collisions: &str,
    extra: &str,
) -> Config {
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nidentity: {{collisions: {collisions}}}\nrecovery: {{enabled: false}}\n{extra}",
        dst.host(),
        src.host()
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

pub fn admission(cfg: &Config) -> (Arc<Admission>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (
        Arc::new(Admission::from_config(cfg, metrics.clone()).unwrap()),
        metrics,
    )
}

/// A Pod with one container per Spin app.
pub fn spin_pod(s: &Spin, name: &str) -> Value {
    let containers: Vec<(String, String)> = s
        .apps
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (format!("c{i}"), format!("{}/{n}", s.src.host())))
        .collect();
    let refs: Vec<(&str, &str)> = containers
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    pod("wasm", name, &refs)
}

pub fn annotation(pod: &Value, key: &str) -> serde_json::Map<String, Value> {
    pod["metadata"]["annotations"][key]
        .as_str()
        .map(|s| serde_json::from_str(s).unwrap())
        .unwrap_or_default()
}

pub fn metric(m: &Metrics, series: &str) -> f64 {
    m.encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// An OCI index (bytes) over `children`, each with its platform.
pub fn index_of(children: &[(&Image, Value)]) -> Vec<u8> {
    let manifests: Vec<Value> = children
        .iter()
        .map(|(img, platform)| {
            json!({"mediaType": img.media_type, "digest": img.digest,
                   "size": img.manifest.len(), "platform": platform})
        })
        .collect();
    serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}))
        .unwrap()
}

/// Two Spin apps sharing the config, pushed by digest into `repo`.
pub async fn spin_pair(src: &TestRegistry, repo: &str, a: &str, b: &str) -> (Image, Image) {
    let (a, b) = (Image::spin(a, 1, None), Image::spin(b, 1, None));
    push_image(src, repo, None, &a).await;
    push_image(src, repo, None, &b).await;
    (a, b)
}

pub fn wasm(variant: &str) -> Value {
    json!({"architecture": "wasm", "os": "wasip1", "variant": variant})
}

/// The config at the target for `repo:tag`, and its manifest.
pub async fn target_config(dst: &TestRegistry, repo: &str, tag: &str) -> (Value, Vec<u8>, Value) {
    let (bytes, _, _) = dst.get_manifest(repo, tag).await.unwrap();
    let m: Value = serde_json::from_slice(&bytes).unwrap();
    let d = m["config"]["digest"].as_str().unwrap();
    let config = dst.blob(repo, d).await.unwrap();
    (
        m.clone(),
        config.clone(),
        serde_json::from_slice(&config).unwrap(),
    )
}

/// The watcher and recovery, talking to `api` as an install does: with the
/// install's RBAC and its namespace.
pub fn watch_as_installed(
    api: &common::kube::KubeApi,
    adm: &Admission,
    cfg: &Config,
) -> pinswap::watch::Background {
    api.authorize_install(cfg, pinswap::install::manifests::Tls::CertManager);
    pinswap::watch::Background::start(
        adm.mirror().clone(),
        cfg,
        Some(api.install_client()),
        tokio_util::sync::CancellationToken::new(),
    )
}

/// Follows `digest` at the target down to its image manifests and returns
/// their config digests.
pub async fn image_configs(dst: &TestRegistry, repo: &str, digest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut queue = vec![digest.to_owned()];
    while let Some(d) = queue.pop() {
        let (bytes, _, _) = dst.get_manifest(repo, &d).await.unwrap();
        let m: Value = serde_json::from_slice(&bytes).unwrap();
        if let Some(list) = m["manifests"].as_array() {
            for c in list {
                queue.push(c["digest"].as_str().unwrap().to_owned());
            }
        } else {
            out.push(m["config"]["digest"].as_str().unwrap().to_owned());
        }
    }
    out
}

pub fn split_pinned<'a>(dst: &TestRegistry, image: &'a str) -> (&'a str, &'a str) {
    let host = format!("{}/", dst.host());
    let (repo_tag, digest) = image
        .strip_prefix(host.as_str())
        .unwrap()
        .split_once('@')
        .unwrap();
    let repo = match repo_tag.rsplit_once(':') {
        Some((r, _)) => r,
        None => repo_tag,
    };
    (repo, digest)
}

/// The descriptor of `bytes` as `media_type`.
pub fn descriptor(media_type: &str, bytes: &[u8]) -> pinswap::registry::manifest::Descriptor {
    pinswap::registry::manifest::Descriptor {
        media_type: media_type.into(),
        digest: sha256_digest(bytes),
        size: bytes.len() as u64,
        platform: None,
        urls: None,
    }
}

pub async fn admit_one(adm: &Admission, image: &str, name: &str) -> Value {
    admit(adm, &pod("wasm", name, &[("app", image)])).await.0
}

pub fn image_of(p: &Value) -> String {
    p["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned()
}
