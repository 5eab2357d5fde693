//! The cluster suite's node: [`Cluster::with_node`] starts the harness with
//! `-node` (containerd 2.x and runc, kube-scheduler and a kubelet; see
//! `tests/cluster/node.go`), and this module gives what node tests share:
//! - [`system_registry`]: a loopback registry holding the pause image and
//!   pinswap's own image ([`pinswap_image`], from `scripts/build-image.sh`);
//! - [`NodeInfo::expose`]: a loopback registry reachable from the Pods'
//!   network and pullable by containerd, at the node IP;
//! - [`crictl`]: CRI as the kubelet sees it;
//! - [`NodeInstall`]: pinswap installed as Pods from its image, with Helm's
//!   engine (`tests/chart/install.py`) or from `pinswap manifests`;
//! - waits on Pods read back from the API server.
//!
//! Pods reach the node IP and the kubernetes Service's address, nothing
//! off the machine: pinswap's Pods read registries through [`NodeInfo::expose`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use super::TestRegistry;
use super::cluster::{Cluster, apply, namespace, yaml_documents};

/// What the harness printed about its node.
pub struct NodeInfo {
    pub name: String,
    /// The node's address, on the harness's bridge; Pods reach it.
    pub ip: String,
    /// `unix://…` of containerd's CRI socket.
    pub containerd: String,
    /// containerd's registry host directory (`HOST:PORT/hosts.toml`).
    pub certs_d: PathBuf,
    /// The registry holding the pause image and pinswap's image.
    pub(crate) system: Option<TestRegistry>,
    control: String,
}

impl NodeInfo {
    pub(crate) fn from_fields(fields: &HashMap<String, String>) -> Option<NodeInfo> {
        Some(NodeInfo {
            name: fields.get("node")?.clone(),
            ip: fields["node-ip"].clone(),
            containerd: fields["containerd"].clone(),
            certs_d: PathBuf::from(&fields["certs.d"]),
            system: None,
            control: fields["control"].clone(),
        })
    }

    /// `reg` at an address on the node IP that Pods reach and containerd
    /// pulls from over plain HTTP (its `hosts.toml` is written). Image
    /// references that Pods and pinswap's Pods both use name this address.
    pub async fn expose(&self, reg: &TestRegistry) -> String {
        self.expose_addr(&reg.host()).await
    }

    /// As [`NodeInfo::expose`], for any loopback `HOST:PORT` (a proxy in
    /// front of a registry).
    pub async fn expose_addr(&self, host: &str) -> String {
        let resp = reqwest::Client::new()
            .post(format!("{}/node/expose", self.control))
            .body(host.to_owned())
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert!(status.is_success(), "expose {host}: {text}");
        text.trim().to_owned()
    }

    /// Replaces the node with a new, cold one named `name` (an empty
    /// image store), registered with `taint` (`key=value:Effect`) if given:
    /// a second kubelet joining, as an autoscaler's node does. The old
    /// Node is deleted. containerd's socket stays where it was. Returns
    /// the new node's name ([`NodeInfo::name`] keeps the first one's).
    pub async fn replace(&self, name: &str, taint: Option<&str>) -> String {
        let body = match taint {
            Some(t) => format!("{name} {t}"),
            None => name.to_owned(),
        };
        let resp = reqwest::Client::new()
            .post(format!("{}/node/replace", self.control))
            .body(body)
            .timeout(Duration::from_secs(240))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert!(status.is_success(), "replacing the node: {text}");
        text.trim().to_owned()
    }

    /// Lets containerd pull from the loopback registry `reg` itself.
    pub fn trust(&self, reg: &TestRegistry) {
        self.serve_host(&reg.host(), &reg.host());
    }

    /// Lets containerd pull from the loopback TLS registry `reg`, trusting
    /// its test CA.
    pub fn trust_tls(&self, reg: &TestRegistry) {
        let host = reg.host();
        let ca = format!("  ca = \"{}\"\n", reg.ca_pem_path().display());
        self.hosts_toml(&host, &format!("https://{host}"), &ca);
    }

    /// containerd pulls from `exposed` (an address [`NodeInfo::expose`]
    /// gave) with basic-auth credentials, as a node configured for a
    /// private mirror does.
    pub fn pull_with_credentials(&self, exposed: &str, user: &str, password: &str) {
        use base64::Engine as _;
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let server = format!("http://{exposed}");
        let header =
            format!("  [host.\"{server}\".header]\n    Authorization = \"Basic {token}\"\n");
        self.hosts_toml(exposed, &server, &header);
    }

    /// containerd's `hosts.toml` for registry host `name`: pulled from
    /// `at` over plain HTTP. Returns the host directory.
    pub fn serve_host(&self, name: &str, at: &str) -> PathBuf {
        self.hosts_toml(name, &format!("http://{at}"), "")
    }

    /// Writes containerd's `hosts.toml` for registry host `name`: pulled
    /// and resolved at `server`, with `more` lines for that host.
    fn hosts_toml(&self, name: &str, server: &str, more: &str) -> PathBuf {
        let dir = self.certs_d.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("hosts.toml"),
            format!(
                "server = \"{server}\"\n\n[host.\"{server}\"]\n  capabilities = [\"pull\", \"resolve\"]\n{more}"
            ),
        )
        .unwrap();
        dir
    }

    /// The system registry (pause, pinswap's image).
    pub fn system(&self) -> &TestRegistry {
        self.system.as_ref().unwrap()
    }
}

/// Where `scripts/build-node.sh` put containerd, its shim, crictl and the
/// pause layout: `PINSWAP_NODE_BIN`, else `target/node`.
pub fn node_bin() -> PathBuf {
    let dir = std::env::var_os("PINSWAP_NODE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/node"));
    assert!(
        dir.join("containerd").exists() && dir.join("pause/index.json").exists(),
        "{} lacks containerd or the pause image: run scripts/build-node.sh",
        dir.display()
    );
    dir
}

/// The `org.opencontainers.image.ref.name` of a one-image layout.
fn layout_ref(layout: &Path) -> String {
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Starts the system registry on a runtime of its own (it outlives every
/// test's) and pushes the pause image into it with skopeo. Returns the
/// registry and the pause reference.
pub(crate) fn system_registry() -> (TestRegistry, String) {
    let reg = std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(TestRegistry::plain())
    })
    .join()
    .unwrap();
    let layout = node_bin().join("pause");
    let tag = layout_ref(&layout);
    let pause = format!("{}/pause:{tag}", reg.host());
    let out = Command::new("skopeo")
        .args([
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            &format!("oci:{}:{tag}", layout.display()),
            &format!("docker://{pause}"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pushing pause: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (reg, pause)
}

/// pinswap's image, built by `scripts/build-image.sh` from the binary
/// under test and pushed with `pinswap copy` into the system registry,
/// once per test binary: `HOST:PORT/pinswap:VERSION@sha256:…`.
pub async fn pinswap_image(node: &NodeInfo) -> String {
    static IMAGE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    IMAGE
        .get_or_init(|| async {
            let layout = build_image(
                &std::env::temp_dir().join(format!("pinswap-image-{}", std::process::id())),
            );
            let tag = layout_ref(&layout);
            let target = format!("{}/pinswap:{tag}", node.system().host());
            let (code, _, err) = super::run_pinswap(&[
                "copy",
                &format!("oci:{}:{tag}", layout.display()),
                &format!("docker://{target}"),
            ])
            .await;
            assert_eq!(code, 0, "pinswap copy of its own image: {err}");
            let digest = node
                .system()
                .head_manifest("pinswap", &tag)
                .await
                .expect("the image at the system registry");
            let _ = std::fs::remove_dir_all(&layout);
            format!("{target}@{digest}")
        })
        .await
        .clone()
}

/// Runs `scripts/build-image.sh` on the binary under test into `out`;
/// returns the layout.
pub fn build_image(out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let res = Command::new(root.join("scripts/build-image.sh"))
        .args(["--binary", super::pinswap_bin().to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        // Its packages were fetched before the tests (scripts/test-cluster.sh).
        .env("PINSWAP_IMAGE_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "scripts/build-image.sh: {}",
        String::from_utf8_lossy(&res.stderr)
    );
    out.to_path_buf()
}

/// `crictl ARGS` against the node's containerd; stdout.
pub fn crictl(node: &NodeInfo, args: &[&str]) -> String {
    let out = Command::new(node_bin().join("crictl"))
        .args(["--runtime-endpoint", &node.containerd, "--timeout", "30s"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "crictl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The image ID (config digest) containerd's CRI gives `image`.
pub fn image_id(node: &NodeInfo, image: &str) -> String {
    let v: Value = serde_json::from_str(&crictl(node, &["inspecti", "-o", "json", image])).unwrap();
    v["status"]["id"].as_str().unwrap().to_owned()
}

/// Removes `images` from containerd (a later pull goes to a registry).
pub fn forget_images(node: &NodeInfo, images: &[&str]) {
    for i in images {
        let _ = Command::new(node_bin().join("crictl"))
            .args(["--runtime-endpoint", &node.containerd, "rmi", i])
            .output();
    }
}

/// Seed 000: three Spin apps (before Spin 2.4) sharing one config blob,
/// pushed to `reg` under the tags returned with them.
pub async fn push_spin_apps(reg: &TestRegistry) -> [(&'static str, super::fixtures::Image); 3] {
    use super::fixtures::Image;
    let apps = [
        ("spin/hello:v1", Image::spin("hello", 1, None)),
        ("spin/hello:v2", Image::spin("hello-v2", 1, None)),
        ("spin/other:w", Image::spin("other", 2, None)),
    ];
    for (name, img) in &apps {
        let (repo, tag) = name.split_once(':').unwrap();
        super::push_image(reg, repo, Some(tag), img).await;
    }
    apps
}

/// Waits until containerd holds `image` (the kubelet pulled it), and returns
/// its image ID through CRI.
pub async fn pulled(node: &NodeInfo, image: &str) -> String {
    let listed = || {
        let images = crictl(node, &["images", "--digests", "-o", "json"]);
        let v: Value = serde_json::from_str(&images).unwrap();
        v["images"].as_array().unwrap().iter().any(|i| {
            i["repoDigests"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(i["repoTags"].as_array().into_iter().flatten())
                .any(|r| {
                    let r = r.as_str().unwrap();
                    r == image || image.ends_with(r.rsplit('@').next().unwrap())
                })
        })
    };
    until(
        &format!("containerd holds {image}"),
        Duration::from_secs(90),
        || async { listed() },
    )
    .await;
    image_id(node, image)
}

/// Polls `f` every 100 ms until it holds; panics after `limit`.
pub async fn until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < limit, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `waiting.reason` of a Pod's first container, or `Running`.
pub fn container_state(p: &Pod) -> Option<String> {
    let st = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let state = st.state.as_ref()?;
    if state.running.is_some() {
        return Some("Running".into());
    }
    state.waiting.as_ref()?.reason.clone()
}

/// The status of `p`'s first container (the test's Pods have one).
pub fn first_status(p: &Pod) -> &ContainerStatus {
    &p.status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
}

/// The `pinswap.dev/` annotation keys on `p`.
pub fn pinswap_notes(p: &Pod) -> Vec<String> {
    p.metadata
        .annotations
        .iter()
        .flatten()
        .map(|(k, _)| k.clone())
        .filter(|k| k.starts_with("pinswap.dev/"))
        .collect()
}

/// Whether `p` runs (phase Running, every container running).
pub fn is_running(p: &Pod) -> bool {
    let st = p.status.as_ref();
    st.and_then(|s| s.phase.as_deref()) == Some("Running")
        && st
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
}

/// Waits until every Pod of `ns` matching `selector` (at least `count`)
/// runs; returns them.
pub async fn wait_running(
    client: &kube::Client,
    ns: &str,
    selector: &str,
    count: usize,
    limit: Duration,
) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(selector);
    let t = Instant::now();
    loop {
        let list = pods.list(&lp).await.unwrap().items;
        let live: Vec<Pod> = list
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        if live.len() >= count && live.iter().all(is_running) {
            return live;
        }
        if t.elapsed() > limit {
            let states: Vec<_> = live
                .iter()
                .map(|p| {
                    format!(
                        "{}: {:?} {:?}",
                        p.metadata.name.as_deref().unwrap_or("?"),
                        p.status.as_ref().and_then(|s| s.phase.clone()),
                        p.status.as_ref().and_then(|s| s.container_statuses.clone())
                    )
                })
                .collect();
            panic!("{ns} {selector}: not {count} Pods running after {limit:?}: {states:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Deployment of `replicas` Pods running `image` (the pause program, so
/// it runs) in `ns`, labelled `app=NAME`.
pub fn deployment(ns: &str, name: &str, image: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent"}],
                },
            },
        },
    })
}

/// Pushes the pause image (a program that runs and waits) to `reg` as
/// `repo:tag`, with `variant` in a layer of its own so each variant is an
/// image of its own (its own config, manifest and image ID). Returns the
/// manifest digest.
pub async fn push_runnable(reg: &TestRegistry, repo: &str, tag: &str, variant: &str) -> String {
    push_runnable_sized(reg, repo, tag, variant, 0).await
}

/// As [`push_runnable`], with `size` bytes of data (drawn from `variant`)
/// in the variant's layer.
pub async fn push_runnable_sized(
    reg: &TestRegistry,
    repo: &str,
    tag: &str,
    variant: &str,
    size: usize,
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let pause_root = dir.path().join("pause");
    std::fs::create_dir_all(&pause_root).unwrap();
    extract_pause(&pause_root);
    let extra = dir.path().join("variant");
    std::fs::create_dir_all(extra.join("etc")).unwrap();
    std::fs::write(extra.join("etc/variant"), variant).unwrap();
    if size > 0 {
        let seed = variant.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let blob = super::fixtures::RandomBlob::new("application/octet-stream", size as u64, seed);
        let data: Vec<u8> = blob.chunks().flatten().collect();
        std::fs::write(extra.join("etc/data"), data).unwrap();
    }
    let layout = dir.path().join("layout");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(root.join("scripts/oci-image.py"))
        .args(["--out", layout.to_str().unwrap()])
        .args(["--rootfs", pause_root.to_str().unwrap()])
        .args(["--rootfs", extra.to_str().unwrap()])
        .args([
            "--entrypoint",
            "/pause",
            "--user",
            "65535:65535",
            "--ref",
            tag,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "oci-image.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, _, err) = super::run_pinswap(&[
        "copy",
        &format!("oci:{}:{tag}", layout.display()),
        &format!("docker://{}/{repo}:{tag}", reg.host()),
    ])
    .await;
    assert_eq!(code, 0, "pushing {repo}:{tag}: {err}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The pause program out of the pause layout's one layer, into `dir`.
fn extract_pause(dir: &Path) {
    let layout = node_bin().join("pause");
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let blob = |d: &str| {
        layout
            .join("blobs/sha256")
            .join(d.trim_start_matches("sha256:"))
    };
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    let layer = blob(manifest["layers"][0]["digest"].as_str().unwrap());
    let out = Command::new("tar")
        .args(["-xzf", layer.to_str().unwrap(), "-C", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Requests for `/v2/REPO/blobs/` in a registry's access log: which
/// registry served an image's bytes.
pub fn blob_gets(reg: &TestRegistry, repo: &str) -> usize {
    let needle = format!("GET /v2/{repo}/blobs/");
    reg.log().lines().filter(|l| l.contains(&needle)).count()
}

/// How pinswap gets onto the node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Via {
    /// The Helm chart, installed by Helm's engine (helm-python-sdk).
    Helm,
    /// `pinswap manifests`, applied with server-side apply.
    Manifests,
}

/// pinswap running as Pods from its own image on the node.
pub struct NodeInstall {
    pub namespace: String,
    pub via: Via,
    /// The config as installed.
    pub config: String,
    dir: tempfile::TempDir,
}

impl NodeInstall {
    /// Installs pinswap into `ns` with `config` (the pinswap config, YAML)
    /// and `replicas`, and waits until its Deployment is available and the
    /// webhook has its CA bundle.
    pub async fn install(
        cluster: &Cluster,
        via: Via,
        ns: &str,
        config: &str,
        replicas: i32,
    ) -> NodeInstall {
        Self::install_with(cluster, via, ns, config, replicas, "").await
    }

    /// As [`NodeInstall::install`], with `helm_values` (a JSON object, or
    /// empty) merged into the chart's values; only [`Via::Helm`].
    pub async fn install_with(
        cluster: &Cluster,
        via: Via,
        ns: &str,
        config: &str,
        replicas: i32,
        helm_values: &str,
    ) -> NodeInstall {
        assert!(helm_values.is_empty() || via == Via::Helm);
        let node = cluster.node.as_ref().unwrap();
        let image = pinswap_image(node).await;
        let client = cluster.admin().await;
        super::cluster::remove_webhooks(&client).await;
        let dir = tempfile::tempdir().unwrap();
        let install = NodeInstall {
            namespace: ns.to_owned(),
            via,
            config: config.to_owned(),
            dir,
        };
        match via {
            Via::Helm => install.helm(cluster, "install", &image, replicas, helm_values),
            Via::Manifests => {
                namespace(&client, ns, json!({})).await;
                let file = install.dir.path().join("pinswap.yaml");
                std::fs::write(&file, config).unwrap();
                let (code, out, err) = super::run_pinswap(&[
                    "manifests",
                    "--namespace",
                    ns,
                    "--tls",
                    "self-signed",
                    "--config",
                    file.to_str().unwrap(),
                    "--image",
                    &image,
                    "--replicas",
                    &replicas.to_string(),
                ])
                .await;
                assert_eq!(code, 0, "pinswap manifests: {err}");
                for obj in yaml_documents(&out) {
                    if obj["kind"] == "Namespace" {
                        continue;
                    }
                    apply(&client, &obj).await.unwrap_or_else(|e| {
                        panic!("apply {} {}: {e}", obj["kind"], obj["metadata"]["name"])
                    });
                }
            }
        }
        install.wait_available(cluster, replicas).await;
        install
    }

    /// `helm install` or `helm upgrade` of the chart in this repository
    /// through tests/chart/install.py; `extra` is a JSON object merged
    /// into the values.
    pub fn helm(&self, cluster: &Cluster, verb: &str, image: &str, replicas: i32, extra: &str) {
        let (repo, digest) = image.split_once('@').unwrap();
        let (repo, _tag) = repo.rsplit_once(':').unwrap();
        let config: Value = serde_json::to_value(
            yaml_documents(&self.config)
                .into_iter()
                .next()
                .unwrap_or(json!({})),
        )
        .unwrap();
        let mut values = json!({
            "image": {"repository": repo, "tag": _tag, "digest": digest},
            "replicaCount": replicas,
            "config": config,
        });
        if !extra.is_empty() {
            let more: Value = serde_json::from_str(extra).unwrap();
            for (k, v) in more.as_object().unwrap() {
                values[k] = v.clone();
            }
        }
        let file = self.dir.path().join("values.json");
        std::fs::write(&file, values.to_string()).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = Command::new("python3")
            .arg(root.join("tests/chart/install.py"))
            .arg(verb)
            .args(["--kubeconfig", cluster.kubeconfig.to_str().unwrap()])
            .args(["--namespace", &self.namespace, "--name", "pinswap"])
            .args(["--values", file.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "helm {verb}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Waits until the Deployment has `replicas` available Pods and the
    /// webhook's caBundle is set (the self-signed bootstrap patches it).
    pub async fn wait_available(&self, cluster: &Cluster, replicas: i32) {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let client = cluster.admin().await;
        let deps: Api<Deployment> = Api::namespaced(client.clone(), &self.namespace);
        let t = Instant::now();
        loop {
            let available = deps.get_opt("pinswap").await.unwrap().is_some_and(|d| {
                let st = d.status.unwrap_or_default();
                st.available_replicas == Some(replicas)
                    && st.updated_replicas == Some(replicas)
                    && st.replicas == Some(replicas)
            });
            if available {
                break;
            }
            if t.elapsed() > Duration::from_secs(180) {
                panic!(
                    "pinswap's Deployment not available after 180 s:\n{}",
                    describe(&client, &self.namespace).await
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let hooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let ns = self.namespace.clone();
        until("the webhook's caBundle", Duration::from_secs(60), || {
            let (hooks, ns) = (hooks.clone(), ns.clone());
            async move {
                let ours: Vec<_> = hooks
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
                    .into_iter()
                    .flat_map(|w| w.webhooks.unwrap_or_default())
                    .filter(|h| {
                        h.client_config
                            .service
                            .as_ref()
                            .is_some_and(|s| s.namespace == ns)
                    })
                    .collect();
                !ours.is_empty()
                    && ours.iter().all(|h| {
                        h.client_config
                            .ca_bundle
                            .as_ref()
                            .is_some_and(|b| !b.0.is_empty())
                    })
            }
        })
        .await;
    }

    /// pinswap's Pods.
    pub async fn pods(&self, cluster: &Cluster) -> Vec<Pod> {
        let pods: Api<Pod> = Api::namespaced(cluster.admin().await, &self.namespace);
        pods.list(&ListParams::default().labels("app.kubernetes.io/name=pinswap"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect()
    }

    /// `kubectl logs` of every pinswap Pod, through the API server and the
    /// kubelet.
    pub async fn logs(&self, cluster: &Cluster) -> String {
        let client = cluster.admin().await;
        let pods: Api<Pod> = Api::namespaced(client, &self.namespace);
        let mut all = String::new();
        for p in self.pods(cluster).await {
            let name = p.metadata.name.unwrap();
            if let Ok(text) = pods.logs(&name, &Default::default()).await {
                all.push_str(&text);
            }
        }
        all
    }
}

/// A workload namespace for one test.
pub async fn workload_namespace(cluster: &Cluster, name: &str) -> kube::Client {
    let client = cluster.admin().await;
    namespace(&client, name, json!({})).await;
    client
}

/// Creates `obj` (a Pod or a workload) and returns it as stored.
pub async fn create_pod(client: &kube::Client, ns: &str, pod: Value) -> Result<Pod, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod).unwrap(),
    )
    .await
}

/// A source and a target registry exposed to the node, pinswap installed
/// from its image in `pinswap-NAME`, and a workload namespace `NAME`.
pub struct NodeRig {
    pub src: TestRegistry,
    pub dst: TestRegistry,
    /// The source as Pods, pinswap and containerd reach it.
    pub src_at: String,
    /// The target as Pods, pinswap and containerd reach it.
    pub dst_at: String,
    pub client: kube::Client,
    pub install: NodeInstall,
    pub ns: String,
    /// The API server's audit log, and where it stood once pinswap
    /// answered admissions for `ns`.
    audit_log: PathBuf,
    audit_from: u64,
    /// The cause of failed-open admissions this test injects, if any.
    fail_open_cause: std::sync::Mutex<Option<String>>,
    /// containerd's host directory for an aliased target.
    alias_dir: Option<PathBuf>,
}

/// Short Lease and retry timings, so leadership plays out in seconds;
/// re-verification off the way (an hour), so admission trusts its cache as
/// k8s-image-swapper does and a lost image shows on the node first.
pub const NODE_RECOVERY: &str = "  retryInitial: 300ms
  retryMax: 2s
  lease: {duration: 4s, renewDeadline: 3s, retryPeriod: 500ms}
";

impl NodeRig {
    /// `recovery` is added to the `recovery` mapping (indented two spaces),
    /// `extra` to the config's top level.
    pub async fn start(
        cluster: &Cluster,
        name: &str,
        via: Via,
        replicas: i32,
        recovery: &str,
        extra: &str,
    ) -> NodeRig {
        let src = TestRegistry::plain().await;
        Self::start_with(cluster, name, via, replicas, recovery, extra, "", src, None).await
    }

    /// As [`NodeRig::start`] with the chart, the target named `alias`
    /// (with the exposed target's port): pinswap's Pods get it from the
    /// chart's `hostAliases`, containerd from a `hosts.toml` for that name
    /// (removed when the rig drops). Nothing else resolves it.
    pub async fn start_aliased(cluster: &Cluster, name: &str, alias: &str) -> NodeRig {
        let src = TestRegistry::plain().await;
        Self::start_with(cluster, name, Via::Helm, 1, "", "", "", src, Some(alias)).await
    }

    /// As [`NodeRig::start`], mirroring from `src`, with `source_keys` added
    /// to the `source` mapping (indented two spaces), and the target named
    /// `alias` as [`NodeRig::start_aliased`] names it.
    #[allow(clippy::too_many_arguments)]
    pub async fn start_with(
        cluster: &Cluster,
        name: &str,
        via: Via,
        replicas: i32,
        recovery: &str,
        extra: &str,
        source_keys: &str,
        src: TestRegistry,
        alias: Option<&str>,
    ) -> NodeRig {
        let node = cluster.node.as_ref().expect("a cluster with a node");
        let dst = TestRegistry::plain().await;
        let (src_at, exposed) = (node.expose(&src).await, node.expose(&dst).await);
        let (dst_at, helm_values, alias_dir) = match alias {
            None => (exposed, String::new(), None),
            Some(host) => {
                let port = exposed.rsplit_once(':').unwrap().1;
                let named = format!("{host}:{port}");
                let dir = node.serve_host(&named, &exposed);
                let values = json!({"hostAliases": [{"ip": node.ip, "hostnames": [host]}]});
                (named, values.to_string(), Some(dir))
            }
        };
        // `immediate` unless `extra` names a policy of its own.
        let copy_policy = if extra.contains("copyPolicy:") {
            ""
        } else {
            "copyPolicy: immediate\n"
        };
        // A budget well under the webhook's 10 s timeoutSeconds: on two
        // shared cores answering after the budget can take seconds, and an
        // answer after the timeout lets the Pod through unchanged.
        // Re-verification off the way, unless `extra` sets `cache` itself.
        let cache = if extra.contains("cache:") {
            ""
        } else {
            "cache: {reverify: 1h}\n"
        };
        let config = format!(
            "target: {{registry: \"{dst_at}/mirror\", insecure: true}}\nsource:\n  registries: [{{registry: \"{src_at}\", insecure: true}}]\n{source_keys}{copy_policy}copyDeadline: 6s\nserver: {{admissionBudget: 6s}}\n{cache}recovery:\n{NODE_RECOVERY}{recovery}{extra}\n"
        );
        let client = workload_namespace(cluster, name).await;
        let install = NodeInstall::install_with(
            cluster,
            via,
            &format!("pinswap-{name}"),
            &config,
            replicas,
            &helm_values,
        )
        .await;
        wait_admitting(&client, name).await;
        wait_leading(cluster, &format!("pinswap-{name}")).await;
        let audit_log = cluster.dir.join("audit.log");
        let audit_from = std::fs::metadata(&audit_log).map_or(0, |m| m.len());
        NodeRig {
            src,
            dst,
            src_at,
            dst_at,
            client,
            install,
            ns: name.to_owned(),
            audit_log,
            audit_from,
            fail_open_cause: Default::default(),
            alias_dir,
        }
    }

    /// Pod creates in this rig's namespace that the API server let through
    /// without pinswap's answer since pinswap first answered there: the
    /// mutating webhook's `failed-open` audit annotation, read back from
    /// the audit log. A Pod admitted so names the source, not the mirror.
    /// [`wait_admitting`]'s probes are left out.
    pub fn failed_open(&self) -> Vec<String> {
        use std::io::{Read, Seek, SeekFrom};
        // Lossy: the last line may be half written.
        let mut bytes = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.audit_log) {
            f.seek(SeekFrom::Start(self.audit_from)).unwrap();
            f.read_to_end(&mut bytes).unwrap();
        }
        let text = String::from_utf8_lossy(&bytes);
        text.lines()
            .filter(|l| l.contains("failed-open.mutation.webhook.admission.k8s.io/"))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| {
                let obj = &e["objectRef"];
                obj["namespace"] == self.ns.as_str()
                    && obj["resource"] == "pods"
                    && obj["name"] != "pinswap-probe"
            })
            .map(|e| {
                format!(
                    "{} {} pods/{} by {} at {} ({})",
                    e["verb"].as_str().unwrap_or_default(),
                    self.ns,
                    e["objectRef"]["name"]
                        .as_str()
                        .unwrap_or("(generated name)"),
                    e["user"]["username"].as_str().unwrap_or_default(),
                    e["requestReceivedTimestamp"].as_str().unwrap_or_default(),
                    e["annotations"]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .filter(|(k, _)| k.starts_with("failed-open."))
                        .map(|(_, v)| v.as_str().unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join(", "),
                )
            })
            .collect()
    }

    /// The test injects `cause`, under which admissions may fail open;
    /// without this, one that does fails the test when the rig is dropped.
    pub fn expect_fail_open(&self, cause: &str) {
        *self.fail_open_cause.lock().unwrap() = Some(cause.to_owned());
    }

    /// `repo:tag` at the source, as Pods name it.
    pub fn source(&self, image: &str) -> String {
        format!("{}/{image}", self.src_at)
    }

    /// The target repository `repo` of the source is mirrored to.
    pub fn mirrored_repo(&self, repo: &str) -> String {
        format!("mirror/{}/{repo}", self.src_at.replace(':', "_"))
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Asserts that containerd pulled the source's `repo` from the target
    /// and never asked the source for it.
    pub fn assert_pulled_from_target(&self, repo: &str) {
        assert!(
            Self::node_pulls(&self.dst, &self.mirrored_repo(repo)) > 0,
            "containerd did not pull {repo} from the target:\n{}",
            self.dst.log()
        );
        assert_eq!(
            Self::node_pulls(&self.src, repo),
            0,
            "containerd asked the source:\n{}",
            self.src.log()
        );
    }

    /// Registry requests made by containerd (its User-Agent), for `repo`.
    pub fn node_pulls(reg: &TestRegistry, repo: &str) -> usize {
        let needle = format!("/v2/{repo}/");
        reg.log()
            .lines()
            .filter(|l| l.contains(&needle) && l.contains("containerd/"))
            .count()
    }
}

/// A Pod that fails open on the node is a Pod pulled from the source, which
/// is what pinswap exists to prevent: every node test fails when one did
/// without a cause it injected ([`NodeRig::expect_fail_open`]).
impl Drop for NodeRig {
    fn drop(&mut self) {
        if let Some(dir) = &self.alias_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if std::thread::panicking() {
            return;
        }
        let failed = self.failed_open();
        if failed.is_empty() {
            return;
        }
        match self.fail_open_cause.lock().unwrap().as_deref() {
            Some(cause) => eprintln!(
                "{} admission(s) failed open under {cause}:\n  {}",
                failed.len(),
                failed.join("\n  ")
            ),
            None => panic!(
                "{} admission(s) failed open, with no cause the test injected: the API server let the Pod through without pinswap's answer, so it names the source:\n  {}",
                failed.len(),
                failed.join("\n  ")
            ),
        }
    }
}

/// The Pods of `ns` with their container states, and its Events: what a
/// test that waited in vain prints.
pub async fn describe(client: &kube::Client, ns: &str) -> String {
    use k8s_openapi::api::core::v1::Event;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut out = String::new();
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let st = p.status.unwrap_or_default();
        let name = p.metadata.name.unwrap_or_default();
        out += &format!(
            "pod {name}: {:?} {}\n",
            st.phase,
            serde_json::to_string(&st.container_statuses).unwrap()
        );
        if let Ok(logs) = pods.logs(&name, &Default::default()).await {
            let lines: Vec<&str> = logs.lines().collect();
            for l in &lines[lines.len().saturating_sub(15)..] {
                out += &format!("  log {name}: {l}\n");
            }
        }
    }
    // A Pod left Pending by a taint names no taint; the node's own say does.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for n in nodes.list(&ListParams::default()).await.unwrap().items {
        let name = n.metadata.name.unwrap_or_default();
        let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
        out += &format!(
            "node {name} taints: {}\n",
            serde_json::to_string(&taints).unwrap()
        );
        for c in n.status.and_then(|s| s.conditions).unwrap_or_default() {
            if c.status != "False" || c.type_ == "Ready" {
                let msg = c.message.unwrap_or_default();
                out += &format!("node {name} {}={}: {msg}\n", c.type_, c.status);
            }
        }
    }
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    for e in events.list(&ListParams::default()).await.unwrap().items {
        out += &format!(
            "event {} {}: {}\n",
            e.involved_object.name.unwrap_or_default(),
            e.reason.unwrap_or_default(),
            e.message.unwrap_or_default()
        );
    }
    out
}

/// Waits until a replica in `ns` holds the `pinswap-leader` Lease, so
/// that the leader's recovery watches Pods before a test makes one fail.
pub async fn wait_leading(cluster: &Cluster, ns: &str) {
    use k8s_openapi::api::coordination::v1::Lease;
    let leases: Api<Lease> = Api::namespaced(cluster.admin().await, ns);
    until("a leader", Duration::from_secs(60), || {
        let leases = leases.clone();
        async move {
            leases
                .get_opt("pinswap-leader")
                .await
                .ok()
                .flatten()
                .is_some_and(|l| {
                    l.spec
                        .and_then(|s| s.holder_identity)
                        .is_some_and(|h| !h.is_empty())
                })
        }
    })
    .await;
}

/// Waits until pinswap answers admissions for `ns`: a Pod created there as
/// a dry run comes back with `pinswap.dev/decisions`. A Deployment is
/// available before the API server routes to its endpoints; the webhook
/// fails open meanwhile.
pub async fn wait_admitting(client: &kube::Client, ns: &str) {
    wait_probe(client, ns, true).await;
}

/// Waits until a dry-run Pod in `ns` comes back with pinswap's
/// `pinswap.dev/decisions` (`answered`) or without them: the API server
/// reads webhook configurations from a cache, so a change to one takes
/// effect a moment after it is written.
pub async fn wait_probe(client: &kube::Client, ns: &str, answered: bool) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let probe: Pod = serde_json::from_value(json!({
        "metadata": {"name": "pinswap-probe"},
        "spec": {"containers": [{"name": "probe", "image": "registry.invalid/probe:v1"}]},
    }))
    .unwrap();
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let what = match answered {
        true => "pinswap answering admissions",
        false => "admissions without pinswap's answer",
    };
    until(what, Duration::from_secs(60), || {
        let (pods, probe, dry) = (pods.clone(), probe.clone(), dry.clone());
        async move {
            pods.create(&dry, &probe).await.is_ok_and(|p| {
                p.metadata
                    .annotations
                    .is_some_and(|a| a.contains_key("pinswap.dev/decisions"))
                    == answered
            })
        }
    })
    .await;
}
