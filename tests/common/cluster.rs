//! A real Kubernetes control plane for the cluster suite: the Go harness in
//! `tests/cluster/` (embedded etcd, kube-apiserver, kube-controller-manager,
//! built by `scripts/build-cluster.sh`), started once per test binary.
//!
//! Tests in one binary share the control plane and take [`Cluster::lock`]
//! for their whole run: every install registers a cluster-wide webhook, so
//! two at once would mutate each other's Pods. Each test works in namespaces
//! of its own.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

/// The field manager of everything the suite applies.
pub const MANAGER: &str = "pinswap-cluster-suite";

/// The running harness. Its standard input stays open for the life of the
/// test process; when the process exits, the harness sees EOF, stops and
/// removes its directory.
pub struct Cluster {
    /// `kube-apiserver vX.Y.Z`, as the harness printed it.
    pub version: String,
    /// An admin (`system:masters`) kubeconfig.
    pub kubeconfig: PathBuf,
    /// The API server's URL.
    pub server: String,
    /// The CA that signed the API server's certificate, PEM.
    pub ca_pem: String,
    /// The harness's second mutating webhook, which adds a sidecar.
    pub sidecar_url: String,
    /// Logs (`apiserver.log`, `controller-manager.log`) and `audit.log`.
    pub dir: PathBuf,
    /// With [`Cluster::with_node`]: the node (see `super::node`).
    pub node: Option<super::node::NodeInfo>,
    pub(crate) control: String,
    /// When the API server was down or starting, from each restart.
    restarts: std::sync::Mutex<Vec<(std::time::SystemTime, std::time::SystemTime)>>,
    lock: tokio::sync::Mutex<()>,
    _child: std::sync::Mutex<(Child, ChildStdin)>,
}

/// The harness binary: `PINSWAP_CLUSTER_BIN`, else what
/// `scripts/build-cluster.sh` builds.
pub fn harness_bin() -> PathBuf {
    std::env::var_os("PINSWAP_CLUSTER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/cluster/pinswap-cluster")
        })
}

impl Cluster {
    /// The control plane of this test binary, started on first use.
    pub fn get() -> &'static Cluster {
        static CLUSTER: OnceLock<Cluster> = OnceLock::new();
        CLUSTER.get_or_init(|| Cluster::start(&[]))
    }

    /// The control plane of this test binary with kube-scheduler and a
    /// node (containerd, runc and a kubelet), started on first use; its
    /// pause image comes from a loopback registry of its own.
    pub fn with_node() -> &'static Cluster {
        static CLUSTER: OnceLock<Cluster> = OnceLock::new();
        CLUSTER.get_or_init(|| {
            let (system, pause) = super::node::system_registry();
            let bin = super::node::node_bin();
            let mut c = Cluster::start(&[
                "-node",
                "-node-bin",
                bin.to_str().unwrap(),
                "-pause-image",
                &pause,
            ]);
            let info = c.node.as_mut().expect("the harness printed no node lines");
            info.system = Some(system);
            c
        })
    }

    /// Another control plane, this test's own: it stops when dropped
    /// (the harness sees its standard input close).
    pub fn another() -> Cluster {
        Cluster::start(&[])
    }

    fn start(args: &[&str]) -> Cluster {
        super::init();
        let bin = harness_bin();
        assert!(
            bin.exists(),
            "{} is missing: run scripts/build-cluster.sh (needs Go and the Go module proxy)",
            bin.display()
        );
        let mut child = Command::new(&bin)
            .arg("-exit-on-stdin-eof")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        // The ready lines, read on a thread so a hung start has a deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut fields = std::collections::HashMap::new();
        let t = Instant::now();
        while !fields.contains_key("dir") {
            // A node waits for one already running on the machine.
            let left = Duration::from_secs(300).saturating_sub(t.elapsed());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some((k, v)) = line.split_once(' ') {
                        fields.insert(k.to_owned(), v.to_owned());
                    }
                }
                Err(e) => panic!("the cluster harness did not get ready: {e}"),
            }
        }
        let version = format!("kube-apiserver {}", fields["kube-apiserver"]);
        eprintln!("{version}");
        let kubeconfig = PathBuf::from(&fields["kubeconfig"]);
        let ca = std::fs::read_to_string(&fields["ca"]).unwrap();
        let server = Kubeconfig::read_from(&kubeconfig).unwrap().clusters[0]
            .cluster
            .as_ref()
            .unwrap()
            .server
            .clone()
            .unwrap();
        Cluster {
            version,
            kubeconfig,
            server,
            ca_pem: ca,
            sidecar_url: fields["sidecar"].clone(),
            dir: PathBuf::from(&fields["dir"]),
            node: super::node::NodeInfo::from_fields(&fields),
            control: fields["control"].clone(),
            restarts: Default::default(),
            lock: tokio::sync::Mutex::new(()),
            _child: std::sync::Mutex::new((child, stdin)),
        }
    }

    /// Holds the cluster for one test (see the module docs).
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.lock.lock().await
    }

    /// A client with the admin kubeconfig.
    pub async fn admin(&self) -> kube::Client {
        client_from(&self.kubeconfig).await
    }

    async fn control(&self, path: &str) -> String {
        let resp = reqwest::Client::new()
            .post(format!("{}{path}", self.control))
            .timeout(Duration::from_secs(200))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert!(status.is_success(), "harness {path}: {status}: {text}");
        text.trim().to_owned()
    }

    /// Compacts etcd at its current revision; returns that revision.
    pub async fn compact(&self) -> i64 {
        self.control("/compact").await.parse().unwrap()
    }

    /// Stops kube-apiserver and starts it again on the same port; returns
    /// once it is ready.
    pub async fn restart_apiserver(&self) {
        let from = std::time::SystemTime::now();
        self.control("/apiserver/restart").await;
        // Until its RBAC caches have synced, a restarted API server answers
        // some requests 403 whatever the roles say; clients retry.
        let to = std::time::SystemTime::now() + Duration::from_secs(5);
        self.restarts.lock().unwrap().push((from, to));
    }

    /// Whether audit event `e` was received while the API server restarted.
    fn during_restart(&self, e: &Value) -> bool {
        let Some(at) = e["requestReceivedTimestamp"]
            .as_str()
            .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
        else {
            return false;
        };
        self.restarts
            .lock()
            .unwrap()
            .iter()
            .any(|(from, to)| (*from..=*to).contains(&at))
    }

    /// Every audit event so far (the harness records all requests at
    /// Metadata level).
    pub fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The audit events of requests made as `user`.
    pub fn audit_of(&self, user: &str) -> Vec<Value> {
        // Tests poll this: only the lines naming `user` are decoded.
        let needle = format!("\"username\":\"{user}\"");
        std::fs::read_to_string(self.dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&needle))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["user"]["username"] == user)
            .collect()
    }

    /// A kubeconfig in `dir` that authenticates as ServiceAccount `ns/name`
    /// with a token from the TokenRequest API (what `kubectl create token`
    /// asks for), its context namespace `ns`.
    pub async fn service_account_kubeconfig(&self, dir: &Path, ns: &str, name: &str) -> PathBuf {
        self.service_account_kubeconfig_via(dir, ns, name, &self.server)
            .await
    }

    /// As [`Cluster::service_account_kubeconfig`], reaching the API server
    /// at `server` (a proxy in front of it).
    pub async fn service_account_kubeconfig_via(
        &self,
        dir: &Path,
        ns: &str,
        name: &str,
        server: &str,
    ) -> PathBuf {
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin().await, ns);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let token = sas
            .create_token_request(name, &PostParams::default(), &req)
            .await
            .unwrap()
            .status
            .unwrap()
            .token;
        let path = dir.join(format!("{ns}-{name}.kubeconfig"));
        std::fs::write(&path, self.token_kubeconfig(server, &token, ns)).unwrap();
        path
    }

    fn token_kubeconfig(&self, server: &str, token: &str, ns: &str) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{server}\", certificate-authority-data: {ca}}}\n\
             users:\n- name: u\n  user: {{token: \"{token}\"}}\n\
             contexts:\n- name: c\n  context: {{cluster: c, user: u, namespace: \"{ns}\"}}\ncurrent-context: c\n",
        )
    }
}

/// A client for `kubeconfig`.
pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// Creates namespace `name` with `labels` and waits for the
/// controller-manager to give it its `default` ServiceAccount (the
/// ServiceAccount admission plugin refuses Pods until then).
pub async fn namespace(client: &kube::Client, name: &str, labels: Value) -> Namespace {
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels},
    }))
    .unwrap();
    let ns = nss.create(&PostParams::default(), &ns).await.unwrap();
    wait_for_service_account(client, name, "default").await;
    ns
}

/// Waits until ServiceAccount `ns/name` exists.
pub async fn wait_for_service_account(client: &kube::Client, ns: &str, name: &str) {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let t = Instant::now();
    while sas.get_opt(name).await.unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no ServiceAccount {ns}/{name} after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The API for `obj`'s kind, found through discovery, in its namespace.
pub async fn api_for(client: &kube::Client, obj: &Value) -> Api<DynamicObject> {
    let (group, version) = match obj["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", obj["apiVersion"].as_str().unwrap()),
    };
    let gvk = GroupVersionKind::gvk(group, version, obj["kind"].as_str().unwrap());
    let (ar, caps) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .unwrap_or_else(|e| panic!("discovery of {gvk:?}: {e}"));
    match (caps.scope, obj["metadata"]["namespace"].as_str()) {
        (kube::discovery::Scope::Namespaced, Some(ns)) => {
            Api::namespaced_with(client.clone(), ns, &ar)
        }
        (kube::discovery::Scope::Namespaced, None) => {
            Api::default_namespaced_with(client.clone(), &ar)
        }
        (kube::discovery::Scope::Cluster, _) => Api::all_with(client.clone(), &ar),
    }
}

/// Applies `obj` with server-side apply and strict field validation, as
/// `kubectl apply --server-side --validate=strict` does.
pub async fn apply(client: &kube::Client, obj: &Value) -> Result<DynamicObject, kube::Error> {
    let api = api_for(client, obj).await;
    let name = obj["metadata"]["name"].as_str().unwrap();
    api.patch(
        name,
        &PatchParams::apply(MANAGER).force().validation_strict(),
        &Patch::Apply(obj),
    )
    .await
}

/// Deletes `obj` if it exists.
pub async fn delete(client: &kube::Client, obj: &Value) {
    let api = api_for(client, obj).await;
    let name = obj["metadata"]["name"].as_str().unwrap();
    let _ = api.delete(name, &DeleteParams::default()).await;
}

/// Deletes every MutatingWebhookConfiguration an earlier test left, so
/// only the current test's webhooks see its Pods.
pub async fn remove_webhooks(client: &kube::Client) {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    for w in api.list(&ListParams::default()).await.unwrap() {
        let name = w.metadata.name.unwrap();
        api.delete(&name, &DeleteParams::default()).await.unwrap();
    }
}

/// The YAML documents of `text` as JSON values (empty documents skipped).
pub fn yaml_documents(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    yaml_serde::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// pinswap installed from `pinswap manifests`, as a user installs it, with
/// `serve` running on the host in place of the Deployment's Pods.
pub struct Install {
    /// The install's namespace.
    pub namespace: String,
    /// Every object `pinswap manifests` rendered, in its order.
    pub objects: Vec<Value>,
    /// The config, without `server` (the host process adds its own).
    pub config: String,
    pub dir: tempfile::TempDir,
}

impl Install {
    /// Renders the install for `config` in namespace `ns` (with
    /// `--tls self-signed`: no cert-manager runs here) and applies every
    /// object but the MutatingWebhookConfiguration, which
    /// [`Install::register`] applies once `serve` is up.
    pub async fn new(client: &kube::Client, ns: &str, config: &str, args: &[&str]) -> Install {
        Self::new_skipping(client, ns, config, args, &[]).await
    }

    /// As [`Install::new`], leaving out objects of the kinds in `skip`
    /// (such as the node agent's DaemonSet, whose image no registry here
    /// serves).
    pub async fn new_skipping(
        client: &kube::Client,
        ns: &str,
        config: &str,
        args: &[&str],
        skip: &[&str],
    ) -> Install {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pinswap.yaml");
        std::fs::write(&file, config).unwrap();
        let mut all = vec![
            "manifests",
            "--namespace",
            ns,
            "--tls",
            "self-signed",
            "--config",
            file.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let (code, out, err) = super::run_pinswap(&all).await;
        assert_eq!(code, 0, "pinswap manifests: {err}");
        let objects = yaml_documents(&out);
        for obj in &objects {
            let kind = obj["kind"].as_str().unwrap_or_default();
            if kind != "MutatingWebhookConfiguration" && !skip.contains(&kind) {
                apply(client, obj).await.unwrap_or_else(|e| {
                    panic!("apply {} {}: {e}", obj["kind"], obj["metadata"]["name"])
                });
            }
        }
        wait_for_service_account(client, ns, "pinswap").await;
        Install {
            namespace: ns.to_owned(),
            objects,
            config: config.to_owned(),
            dir,
        }
    }

    /// The rendered object of `kind` (the first one).
    pub fn object(&self, kind: &str) -> &Value {
        self.objects
            .iter()
            .find(|o| o["kind"] == kind)
            .unwrap_or_else(|| panic!("the install renders no {kind}"))
    }

    /// The rendered MutatingWebhookConfiguration with `clientConfig` a URL
    /// to `served` and its CA; everything else as rendered.
    pub fn webhook_for(&self, served: &super::serve::Served) -> Value {
        use base64::Engine;
        let mut w = self.object("MutatingWebhookConfiguration").clone();
        let ca = base64::engine::general_purpose::STANDARD.encode(&served.ca_pem);
        w["webhooks"][0]["clientConfig"] = json!({
            "url": format!("https://{}/mutate", served.webhook),
            "caBundle": ca,
        });
        w
    }

    /// Registers the webhook for `served` with the API server.
    pub async fn register(&self, client: &kube::Client, served: &super::serve::Served) -> Value {
        let w = self.webhook_for(served);
        apply(client, &w).await.unwrap();
        w
    }

    /// The ServiceAccount's user name in audit events.
    pub fn user(&self) -> String {
        format!("system:serviceaccount:{}:pinswap", self.namespace)
    }

    /// `pinswap serve` on the host with this install's config and a
    /// kubeconfig holding a token of the install's ServiceAccount, so the
    /// install's own RBAC decides what it may do. `name` is its POD_NAME.
    pub async fn serve(&self, cluster: &Cluster, name: &str) -> super::serve::Served {
        self.serve_via(cluster, name, &cluster.server).await
    }

    /// As [`Install::serve`], reaching the API server at `server`.
    pub async fn serve_via(
        &self,
        cluster: &Cluster,
        name: &str,
        server: &str,
    ) -> super::serve::Served {
        let kubeconfig = cluster
            .service_account_kubeconfig_via(self.dir.path(), &self.namespace, "pinswap", server)
            .await;
        super::serve::Served::start_with(
            &self.config,
            "",
            &[
                ("KUBECONFIG", kubeconfig.to_str().unwrap()),
                ("POD_NAME", name),
                ("POD_NAMESPACE", &self.namespace),
            ],
            None,
        )
        .await
    }
}

/// The audit events answered 403 for `user`: a permission the code uses
/// and the install does not grant. Requests made while the API server
/// restarted are not counted (see [`Cluster::restart_apiserver`]).
pub fn forbidden(cluster: &Cluster, user: &str) -> Vec<String> {
    cluster
        .audit_of(user)
        .iter()
        .filter(|e| e["responseStatus"]["code"] == 403 && !cluster.during_restart(e))
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect()
}

/// A source and a target registry, pinswap installed in `pinswap-<name>`
/// and serving, and a workload namespace `<name>`.
pub struct Rig {
    pub src: super::TestRegistry,
    pub dst: super::TestRegistry,
    pub client: kube::Client,
    pub install: Install,
    pub served: Option<super::serve::Served>,
    pub ns: String,
}

pub const IMAGE: &str = "app:v1";

impl Rig {
    /// `extra` is added to the config's top level.
    pub async fn start(cluster: &Cluster, name: &str, extra: &str) -> Rig {
        Self::start_with(cluster, name, extra, "", super::TestRegistry::plain().await).await
    }

    /// As [`Rig::start`], mirroring from `src`, with `source_keys` added to
    /// the `source` mapping (block YAML indented two spaces).
    pub async fn start_with(
        cluster: &Cluster,
        name: &str,
        extra: &str,
        source_keys: &str,
        src: super::TestRegistry,
    ) -> Rig {
        let dst = super::TestRegistry::plain().await;
        let client = cluster.admin().await;
        remove_webhooks(&client).await;
        let config = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n{source_keys}\ncopyPolicy: immediate\ncopyDeadline: 8s\n{extra}\n",
            dst.host(),
            src.host()
        );
        let install_ns = format!("pinswap-{name}");
        // First: with recovery.namespaces the install grants into it.
        namespace(&client, name, json!({})).await;
        let install = Install::new(&client, &install_ns, &config, &[]).await;
        let served = install.serve(cluster, &format!("{name}-0")).await;
        install.register(&client, &served).await;
        Rig {
            src,
            dst,
            client,
            install,
            served: Some(served),
            ns: name.to_owned(),
        }
    }

    pub fn source(&self, repo: &str) -> String {
        format!("{}/{repo}", self.src.host())
    }

    pub fn mirrored(&self, repo: &str) -> String {
        format!(
            "{}/mirror/127.0.0.1_{}/{repo}",
            self.dst.host(),
            self.src.port()
        )
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn push(&self, repo: &str, tag: &str, seed: u64) -> super::fixtures::Image {
        let img = super::fixtures::Image::oci(1, seed);
        super::push_image(&self.src, repo, Some(tag), &img).await;
        img
    }

    pub async fn create(&self, pod: Value) -> Result<Pod, kube::Error> {
        let pod: Pod = serde_json::from_value(pod).unwrap();
        self.pods().create(&PostParams::default(), &pod).await
    }

    pub fn served(&self) -> &super::serve::Served {
        self.served.as_ref().unwrap()
    }
}

pub fn pod(name: &str, containers: &[(&str, &str)], init: &[(&str, &str)]) -> Value {
    let list = |cs: &[(&str, &str)]| -> Vec<Value> {
        cs.iter()
            .map(|(n, i)| json!({"name": n, "image": i}))
            .collect()
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": list(containers), "initContainers": list(init)},
    })
}

pub fn images(p: &Pod, field: &str) -> Vec<String> {
    let v = serde_json::to_value(p).unwrap();
    v["spec"][field]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| c["image"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

pub fn annotation(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref()?.get(key).cloned()
}

/// Asserts that the install's ServiceAccount was never refused anything.
pub fn no_forbidden(cluster: &Cluster, rig: &Rig) {
    let refused = forbidden(cluster, &rig.install.user());
    assert!(
        refused.is_empty(),
        "403s for the install's ServiceAccount: {refused:?}"
    );
}
