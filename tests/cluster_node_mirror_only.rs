//! Pods that must not be rewritten, on a real node: pinswap admits them
//! exactly as written (`mirrorOnly`) and copies their images, and containerd,
//! configured by `pinswap node-config`'s `hosts.toml`, pulls them from the
//! target, also while the source is down.
//!
//! Needs root, `scripts/build-cluster.sh` and `scripts/build-node.sh`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::cluster::Cluster;
use common::node::{NodeRig, Via, create_pod, forget_images, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use serde_json::{Value, json};

/// Puts the harness's own `hosts.toml` for a host back when dropped.
struct Restore {
    file: PathBuf,
    saved: String,
}

impl Restore {
    /// Takes the harness's `hosts.toml` for the rig's source off the node,
    /// so pinswap's can take its place.
    fn take(rig: &NodeRig, node: &common::node::NodeInfo) -> Restore {
        let file = node.certs_d.join(&rig.src_at).join("hosts.toml");
        let saved = std::fs::read_to_string(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        Restore { file, saved }
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(dir) = self.file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::write(&self.file, &self.saved);
    }
}

/// The node's mirror for the rig's source, as `pinswap node-config ARGS`
/// writes it into containerd's certs.d (the harness's file for that host
/// put back when the guard drops).
async fn node_config(rig: &NodeRig, node: &common::node::NodeInfo, args: &[&str]) -> Restore {
    node_config_with(rig, node, "", args).await
}

/// The config `node-config` reads for `rig`, with `extra` at its top level.
fn node_config_file(rig: &NodeRig, dir: &std::path::Path, extra: &str) -> PathBuf {
    let cfg = dir.join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{}/mirror\", insecure: true}}\nsource: {{registries: [{{registry: \"{}\", insecure: true}}]}}\n{extra}",
            rig.dst_at, rig.src_at
        ),
    )
    .unwrap();
    cfg
}

/// As [`node_config`], with `extra` added to the config's top level.
async fn node_config_with(
    rig: &NodeRig,
    node: &common::node::NodeInfo,
    extra: &str,
    args: &[&str],
) -> Restore {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node_config_file(rig, dir.path(), extra);
    let restore = Restore::take(rig, node);
    let hosts = restore.file.clone();
    let mut cmd = vec![
        "node-config",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        node.certs_d.to_str().unwrap(),
    ];
    cmd.extend_from_slice(args);
    let (code, _, err) = common::run_pinswap(&cmd).await;
    assert_eq!(code, 0, "{err}");
    let written = std::fs::read_to_string(&hosts).unwrap();
    assert!(
        written.contains(&format!("/v2/mirror/{}", rig.src_at.replace(':', "_"))),
        "{written}"
    );
    restore
}

fn pod(ns: &str, name: &str, app: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent"}]
        }
    })
}

/// Creates Pod `name` (label `app`) naming `image` in the rig's namespace
/// and asserts that it was stored with the image as written.
async fn create_as_written(rig: &NodeRig, name: &str, app: &str, image: &str) -> Pod {
    let stored = create_pod(&rig.client, &rig.ns, pod(&rig.ns, name, app, image))
        .await
        .unwrap();
    assert_eq!(
        stored.spec.as_ref().unwrap().containers[0].image.as_deref(),
        Some(image),
        "the image as written"
    );
    stored
}

/// A Pod `mirrorOnly` matches is stored as it was sent (no image changed,
/// no annotation), its image is copied, and containerd, with the
/// `hosts.toml` that `pinswap node-config` wrote for the source, pulls it
/// from the target: the registries' access logs show no pull at the
/// source. With the source stopped, a new Pod naming the same tag starts.
#[tokio::test]
async fn a_pod_admitted_as_written_is_pulled_from_the_mirror_by_node_config() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let mut rig = NodeRig::start(
        c,
        "asis",
        Via::Manifests,
        1,
        "",
        "mirrorOnly: {pods: [{podSelector: {matchLabels: {app: ledger}}}]}\n",
    )
    .await;
    let digest = common::node::push_runnable(&rig.src, "shop/ledger", "v1", "ledger").await;

    let _restore = node_config(&rig, node, &[]).await;

    let source = rig.source("shop/ledger:v1");
    let stored = create_as_written(&rig, "ledger-1", "ledger", &source).await;
    let notes = common::node::pinswap_notes(&stored);
    assert!(notes.is_empty(), "annotated: {notes:?}");
    let running = wait_running(
        &rig.client,
        "asis",
        "app=ledger",
        1,
        Duration::from_secs(120),
    )
    .await;
    let st = common::node::first_status(&running[0]);
    assert!(st.image_id.ends_with(&digest), "{}", st.image_id);
    rig.assert_pulled_from_target("shop/ledger");

    // The source goes down; a new Pod naming the tag still starts.
    rig.src.kill();
    forget_images(node, &[&source]);
    rig.pods()
        .delete("ledger-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    create_pod(
        &rig.client,
        "asis",
        pod("asis", "ledger-2", "ledger", &source),
    )
    .await
    .unwrap();
    let running = wait_running(
        &rig.client,
        "asis",
        "app=ledger",
        1,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(running[0].metadata.name.as_deref(), Some("ledger-2"));
}

/// Seed 000 for Pods admitted as written: with `identity.collisions:
/// repair` the mirror's tags name repaired copies, and containerd, with
/// the `hosts.toml` node-config writes in resolve mode, resolves each tag
/// at the mirror. Three Spin apps sharing one config get three image IDs
/// on the node, none the shared config's. node-config refuses the same
/// config in digest-only mode, where tags resolve at the source, to the
/// colliding manifests.
#[tokio::test]
async fn apps_sharing_a_config_get_the_repaired_copies_through_the_node_mirror() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let repair = "identity: {collisions: repair}\n";
    let rig = NodeRig::start(
        c,
        "spinasis",
        Via::Manifests,
        1,
        "",
        &format!(
            "{repair}mirrorOnly: {{pods: [{{podSelector: {{matchLabels: {{app: spin}}}}}}]}}\n"
        ),
    )
    .await;
    let apps = common::node::push_spin_apps(&rig.src).await;
    let shared = apps[0].1.config.digest.to_string();
    assert!(apps.iter().all(|(_, i)| i.config.digest == shared));

    let dir = tempfile::tempdir().unwrap();
    let cfg = node_config_file(&rig, dir.path(), repair);
    let out = dir.path().join("certs.d");
    let (code, _, err) = common::run_pinswap(&[
        "node-config",
        "--config",
        cfg.to_str().unwrap(),
        "--mode",
        "digest-only",
        "--out",
        out.to_str().unwrap(),
    ])
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("identity.collisions is repair and the mode is digest-only"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written");

    let _restore = node_config_with(&rig, node, repair, &["--mode", "resolve"]).await;
    let mut ids = std::collections::BTreeSet::new();
    for (i, (name, _)) in apps.iter().enumerate() {
        let source = rig.source(name);
        create_as_written(&rig, &format!("app-{i}"), "spin", &source).await;
        ids.insert(common::node::pulled(node, &source).await);
    }
    assert_eq!(ids.len(), 3, "three apps, three image IDs: {ids:?}");
    assert!(!ids.contains(&shared), "{ids:?}");
    rig.assert_pulled_from_target("spin/hello");
    let pulled: Vec<String> = apps.iter().map(|(name, _)| rig.source(name)).collect();
    forget_images(node, &pulled.iter().map(String::as_str).collect::<Vec<_>>());
}

/// Removes a host directory the test made in containerd's certs.d.
struct HostDir(PathBuf);

impl Drop for HostDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the node configures for a source is kept, on containerd itself: the
/// source's host directory holds the node's own `ca.crt` and no
/// `hosts.toml`, so containerd trusts that CA for the source. The
/// `hosts.toml` `pinswap node-config` writes in digest-only mode carries
/// it, so containerd still resolves the tag at the TLS source and takes the
/// content from the mirror. A `hosts.toml` pinswap did not write is never
/// replaced.
#[tokio::test]
async fn containerd_keeps_the_nodes_own_ca_for_a_source() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let src = common::TestRegistry::tls().await;
    let dst = common::TestRegistry::plain().await;
    let dst_at = node.expose(&dst).await;
    let mirrored = format!("mirror/{}/app", src.host().replace(':', "_"));
    let digest = common::node::push_runnable(&dst, &mirrored, "v1", "own-ca").await;
    let ca = src.ca_pem_path();
    let (code, _, err) = common::run_pinswap(&[
        "copy",
        "--ca-cert",
        ca.to_str().unwrap(),
        &format!("docker://{}/{mirrored}:v1", dst.host()),
        &format!("docker://{}/app:v1", src.host()),
    ])
    .await;
    assert_eq!(code, 0, "{err}");

    // The node's own setting for the source: its CA, no hosts.toml.
    let host_dir = HostDir(node.certs_d.join(src.host()));
    std::fs::create_dir_all(&host_dir.0).unwrap();
    std::fs::copy(&ca, host_dir.0.join("ca.crt")).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{dst_at}/mirror\", insecure: true}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n",
            src.host()
        ),
    )
    .unwrap();
    let node_config = |mode: &'static str| {
        let cfg = cfg.clone();
        let out = node.certs_d.clone();
        async move {
            common::run_pinswap(&[
                "node-config",
                "--config",
                cfg.to_str().unwrap(),
                "--mode",
                mode,
                "--out",
                out.to_str().unwrap(),
            ])
            .await
        }
    };
    let (code, _, err) = node_config("digest-only").await;
    assert_eq!(code, 0, "{err}");
    let hosts = std::fs::read_to_string(host_dir.0.join("hosts.toml")).unwrap();
    assert!(hosts.contains("ca = [\"ca.crt\"]\n"), "{hosts}");

    let ns = "ownca";
    common::cluster::namespace(&c.admin().await, ns, json!({"pinswap.dev/ignore": "true"})).await;
    let client = c.admin().await;
    let source = format!("{}/app:v1", src.host());
    create_pod(&client, ns, pod(ns, "app", "app", &source))
        .await
        .unwrap();
    let running = wait_running(&client, ns, "app=app", 1, Duration::from_secs(120)).await;
    let st = common::node::first_status(&running[0]);
    assert!(st.image_id.ends_with(&digest), "{}", st.image_id);
    // The tag from the source over TLS, with the node's CA; the content
    // from the mirror.
    let from_source: Vec<String> = src
        .log()
        .lines()
        .filter(|l| l.contains("containerd/") && l.contains("/v2/app/"))
        .map(str::to_owned)
        .collect();
    assert!(
        from_source
            .iter()
            .any(|l| l.contains("/v2/app/manifests/v1")),
        "the tag was not resolved at the source:\n{}",
        src.log()
    );
    assert!(
        !from_source.iter().any(|l| l.contains("/blobs/")),
        "content from the source: {from_source:?}"
    );
    assert!(NodeRig::node_pulls(&dst, &mirrored) > 0, "{}", dst.log());

    // A hosts.toml the node's admin wrote is kept as it is.
    let own = "server = \"https://example.invalid\"\n";
    std::fs::write(host_dir.0.join("hosts.toml"), own).unwrap();
    let (code, _, err) = node_config("resolve").await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("was not written by pinswap; left alone"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(host_dir.0.join("hosts.toml")).unwrap(),
        own
    );
    forget_images(node, &[&source]);
}

/// `pinswap manifests --node-agent`'s objects (DaemonSet, its account and
/// Role) for `rig`'s config, with `extra` flags, applied.
async fn apply_agent(rig: &NodeRig, node: &common::node::NodeInfo, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(&cfg, &rig.install.config).unwrap();
    let image = common::node::pinswap_image(node).await;
    let mut args = vec![
        "manifests",
        "--namespace",
        &rig.install.namespace,
        "--tls",
        "self-signed",
        "--config",
        cfg.to_str().unwrap(),
        "--image",
        &image,
        "--node-agent",
        "--node-agent-dir",
        node.certs_d.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = common::run_pinswap(&args).await;
    assert_eq!(code, 0, "pinswap manifests --node-agent: {err}");
    let ours: Vec<Value> = common::cluster::yaml_documents(&out)
        .into_iter()
        .filter(|o| o["metadata"]["name"] == "pinswap-node-agent")
        .collect();
    assert_eq!(ours.len(), 4, "{out}");
    for obj in &ours {
        common::cluster::apply(&rig.client, obj)
            .await
            .unwrap_or_else(|e| panic!("apply {}: {e}", obj["kind"]));
    }
}

/// Waits until `check` holds for the text of `file` (`None`: absent),
/// asserting on the way that `never` does not hold.
async fn wait_file(
    file: &std::path::Path,
    what: &str,
    check: impl Fn(Option<&str>) -> bool,
    never: impl Fn(Option<&str>) -> bool,
) {
    let t = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(file).ok();
        assert!(
            !never(text.as_deref()),
            "{what}: {}: {text:?}",
            file.display()
        );
        if check(text.as_deref()) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{what}: not after 120 s; {} is {text:?}",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The node agent, installed by `pinswap manifests --node-agent`, writes
/// the source's `hosts.toml` on the node; a postgres-operator Pod (its
/// profile) is stored as its StatefulSet wrote it and pulled from the
/// target through that file; a config change reaches the node through the
/// ConfigMap, a mode change through a rolling update that never leaves
/// the node without the file; deleting the DaemonSet removes what the
/// agent wrote and nothing else.
#[tokio::test]
async fn the_node_agent_keeps_the_nodes_mirror_files_for_a_profiled_operator() {
    use k8s_openapi::api::apps::v1::{DaemonSet, StatefulSet};
    use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube::Api;

    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let rig = NodeRig::start(
        c,
        "agent",
        Via::Manifests,
        1,
        "",
        "mirrorOnly: {profiles: [postgres-operator]}\n",
    )
    .await;
    let digest = common::node::push_runnable(&rig.src, "zalando/spilo", "v1", "spilo").await;

    // The harness's own file for the source goes; the agent's replaces it.
    let restore = Restore::take(&rig, node);
    let hosts = restore.file.clone();
    // A file the agent did not write, which it never touches.
    let foreign = node.certs_d.join("theirs.example").join("hosts.toml");
    std::fs::create_dir_all(foreign.parent().unwrap()).unwrap();
    std::fs::write(&foreign, "server = \"https://theirs.example\"\n").unwrap();

    apply_agent(&rig, node, &[]).await;
    let ours = |t: Option<&str>| t.is_some_and(|t| t.starts_with(pinswap::nodeconfig::HEADER));
    wait_file(&hosts, "the agent's hosts.toml", &ours, |_| false).await;
    let written = std::fs::read_to_string(&hosts).unwrap();
    assert!(
        written.contains("capabilities = [\"pull\", \"resolve\"]")
            && written.contains(&format!(
                "/v2/{}\"",
                rig.mirrored_repo("").trim_end_matches('/')
            )),
        "{written}"
    );

    // The operator's StatefulSet, as postgres-operator writes it.
    let source = rig.source("zalando/spilo:v1");
    let sts = json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "acid-main", "namespace": "agent",
                     "labels": {"application": "spilo", "cluster-name": "acid-main"}},
        "spec": {
            "serviceName": "acid-main", "replicas": 1,
            "selector": {"matchLabels": {"application": "spilo", "cluster-name": "acid-main"}},
            "template": {
                "metadata": {"labels": {"application": "spilo", "cluster-name": "acid-main",
                                        "spilo-role": "master"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "postgres", "image": source,
                                    "imagePullPolicy": "IfNotPresent"}]
                }
            }
        }
    });
    common::cluster::apply(&rig.client, &sts).await.unwrap();
    let running = wait_running(
        &rig.client,
        "agent",
        "application=spilo",
        1,
        Duration::from_secs(120),
    )
    .await;
    let pod = &running[0];
    assert_eq!(
        pod.spec.as_ref().unwrap().containers[0].image.as_deref(),
        Some(source.as_str()),
        "the operator's Pod as its StatefulSet wrote it"
    );
    let notes = common::node::pinswap_notes(pod);
    assert!(notes.is_empty(), "annotated: {notes:?}");
    let stored: StatefulSet = Api::namespaced(rig.client.clone(), "agent")
        .get("acid-main")
        .await
        .unwrap();
    assert_eq!(
        serde_json::to_value(&stored.spec.unwrap().template.spec.unwrap().containers[0].image)
            .unwrap(),
        json!(source)
    );
    let st = common::node::first_status(pod);
    assert!(st.image_id.ends_with(&digest), "{}", st.image_id);
    rig.assert_pulled_from_target("zalando/spilo");

    // A config change: a source added in the ConfigMap gets its file.
    let added = "127.0.0.1:1";
    let cms: Api<ConfigMap> = Api::namespaced(rig.client.clone(), &rig.install.namespace);
    let mut cm = cms.get("pinswap").await.unwrap();
    let data = cm.data.get_or_insert_default();
    let text = data["config.yaml"].replace(
        "source:\n  registries: [",
        &format!("source:\n  registries: [{{registry: \"{added}\", insecure: true}}, "),
    );
    assert_ne!(&text, &data["config.yaml"], "{text}");
    data.insert("config.yaml".into(), text);
    cms.replace("pinswap", &Default::default(), &cm)
        .await
        .unwrap();
    let other = node.certs_d.join(added).join("hosts.toml");
    wait_file(&other, "the added source's hosts.toml", &ours, |_| false).await;

    // A mode change rolls the DaemonSet; the file is there all along.
    apply_agent(&rig, node, &["--node-agent-mode", "digest-only"]).await;
    wait_file(
        &hosts,
        "digest-only hosts.toml",
        |t| t.is_some_and(|t| t.contains("capabilities = [\"pull\"]\n")),
        |t| t.is_none(),
    )
    .await;

    // Uninstall as `kubectl delete -f` does it, in the output's order: the
    // account and its Role go before the DaemonSet's Pods get SIGTERM.
    // What the agent wrote goes, the foreign file stays.
    let ns = &rig.install.namespace;
    let dp = DeleteParams::default();
    let accounts: Api<ServiceAccount> = Api::namespaced(rig.client.clone(), ns);
    accounts.delete("pinswap-node-agent", &dp).await.unwrap();
    let roles: Api<Role> = Api::namespaced(rig.client.clone(), ns);
    roles.delete("pinswap-node-agent", &dp).await.unwrap();
    let bindings: Api<RoleBinding> = Api::namespaced(rig.client.clone(), ns);
    bindings.delete("pinswap-node-agent", &dp).await.unwrap();
    let daemonsets: Api<DaemonSet> = Api::namespaced(rig.client.clone(), ns);
    daemonsets.delete("pinswap-node-agent", &dp).await.unwrap();
    wait_file(
        &hosts,
        "hosts.toml removed at uninstall",
        |t| t.is_none(),
        |_| false,
    )
    .await;
    wait_file(
        &other,
        "the added source's file removed",
        |t| t.is_none(),
        |_| false,
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(&foreign).unwrap(),
        "server = \"https://theirs.example\"\n"
    );
    std::fs::remove_dir_all(foreign.parent().unwrap()).unwrap();
}

/// Digest-only mode, rendered by `pinswap node-config --mode digest-only`:
/// containerd resolves the tag at the source and reads the content from
/// the mirror. The source moves the tag; a new Pod naming it runs the new
/// digest, which its admission mirrored (`cache.resolutionTtl: 0s`: every
/// admission resolves the tag), and still no content comes from the
/// source.
#[tokio::test]
async fn in_digest_only_mode_a_moved_tag_runs_its_new_digest_from_the_mirror() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let rig = NodeRig::start(
        c,
        "digests",
        Via::Manifests,
        1,
        "",
        "mirrorOnly: {pods: [{podSelector: {matchLabels: {app: ledger}}}]}\ncache: {reverify: 1h, resolutionTtl: 0s}\n",
    )
    .await;
    let first = common::node::push_runnable(&rig.src, "shop/ledger", "v1", "ledger-a").await;
    let _restore = node_config(&rig, node, &["--mode", "digest-only"]).await;
    let written =
        std::fs::read_to_string(node.certs_d.join(&rig.src_at).join("hosts.toml")).unwrap();
    assert!(written.contains("capabilities = [\"pull\"]\n"), "{written}");
    let source = rig.source("shop/ledger:v1");

    let mut runs = Vec::new();
    for i in 1..=2 {
        let digest = if i == 1 {
            first.clone()
        } else {
            // The source moves the tag.
            let moved =
                common::node::push_runnable(&rig.src, "shop/ledger", "v1", "ledger-b").await;
            assert_ne!(moved, first);
            forget_images(node, &[&source]);
            rig.pods()
                .delete("ledger-1", &DeleteParams::default().grace_period(0))
                .await
                .unwrap();
            moved
        };
        let name = format!("ledger-{i}");
        create_pod(
            &rig.client,
            "digests",
            pod("digests", &name, "ledger", &source),
        )
        .await
        .unwrap();
        let running = wait_running(
            &rig.client,
            "digests",
            "app=ledger",
            1,
            Duration::from_secs(120),
        )
        .await;
        assert_eq!(running[0].metadata.name.as_deref(), Some(name.as_str()));
        let st = common::node::first_status(&running[0]);
        assert!(
            st.image_id.ends_with(&digest),
            "{} runs {}, not {digest}",
            name,
            st.image_id
        );
        // Its manifest by digest came from the mirror.
        let at_target = format!(
            "GET /v2/{}/manifests/{digest}",
            rig.mirrored_repo("shop/ledger")
        );
        assert!(
            rig.dst
                .log()
                .lines()
                .any(|l| l.contains(&at_target) && l.contains("containerd/")),
            "containerd did not read {digest} from the mirror:\n{}",
            rig.dst.log()
        );
        runs.push(digest);
    }
    // The source answered the tag's resolution only: no manifest by
    // digest, no blob.
    let src_log = rig.src.log();
    let asked: Vec<&str> = src_log
        .lines()
        .filter(|l| l.contains("/v2/shop/ledger/") && l.contains("containerd/"))
        .collect();
    assert!(!asked.is_empty(), "containerd never resolved at the source");
    assert!(
        asked
            .iter()
            .all(|l| l.contains("/manifests/v1 ") && l.contains("\"HEAD ")),
        "containerd read content from the source:\n{}",
        asked.join("\n")
    );
    assert_ne!(runs[0], runs[1]);
}
