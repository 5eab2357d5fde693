//! The node agent: what `pinswap manifests --node-agent` gives it (no
//! Secret, or a read-only one named for a `"*"` allowlist), and how
//! `pinswap node-agent` lists the target: anonymously or with those
//! credentials, never with the config's own, against a real registry.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use common::manifests::*;
use common::{Image, TestRegistry, push_image};
use k8s_openapi::api::apps::v1::DaemonSet;
use pinswap::nodeconfig::agent::{Agent, AgentError};
use pinswap::nodeconfig::{Mode, Runtime};
use serde_json::{Value, json};

/// Every Secret a Pod template reaches: volumes (plain and projected) and
/// environment variables.
fn secrets_of(pod: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for v in pod["volumes"].as_array().into_iter().flatten() {
        if let Some(s) = v["secret"]["secretName"].as_str() {
            out.push(s.to_owned());
        }
        for p in v["projected"]["sources"].as_array().into_iter().flatten() {
            if let Some(s) = p["secret"]["name"].as_str() {
                out.push(s.to_owned());
            }
        }
    }
    for c in pod["containers"].as_array().into_iter().flatten() {
        for e in c["env"].as_array().into_iter().flatten() {
            if let Some(s) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
                out.push(s.to_owned());
            }
        }
        for e in c["envFrom"].as_array().into_iter().flatten() {
            if let Some(s) = e["secretRef"]["name"].as_str() {
                out.push(s.to_owned());
            }
        }
    }
    out
}

/// The node agent's four objects.
fn agent_objects(objects: &[Value]) -> Vec<&Value> {
    objects
        .iter()
        .filter(|o| o["metadata"]["name"] == "pinswap-node-agent")
        .collect()
}

#[tokio::test]
async fn the_node_agent_gets_no_secret_but_a_read_only_one_named_for_a_star_allowlist() {
    let dir = tempfile::tempdir().unwrap();
    let named = dir.path().join("named.yaml");
    std::fs::write(
        &named,
        "target: {registry: m.example.com, auth: {username: u, passwordFile: /var/run/secrets/pinswap/pw}}\nsource: {registries: [{registry: quay.io}]}\n",
    )
    .unwrap();
    let star = dir.path().join("star.yaml");
    std::fs::write(
        &star,
        "target: {registry: m.example.com, auth: {username: u, passwordFile: /var/run/secrets/pinswap/pw}}\nsource: {registries: [{registry: \"*\"}]}\n",
    )
    .unwrap();
    let (named, star) = (named.to_str().unwrap(), star.to_str().unwrap());
    for config in [None, Some(named), Some(star)] {
        let mut args = vec!["--tls", "self-signed", "--node-agent"];
        if let Some(c) = config {
            args.extend(["--config", c]);
        }
        let objects = manifests(&args).await;
        let ds = find(&objects, "DaemonSet", "pinswap-node-agent");
        let _: DaemonSet = typed(ds);
        let pod = &ds["spec"]["template"]["spec"];
        assert_eq!(secrets_of(pod), Vec::<String>::new(), "{config:?}");
        let text = serde_json::to_string(&agent_objects(&objects)).unwrap();
        assert!(!text.contains("registry-auth"), "{config:?}: {text}");
        assert!(!text.contains("/var/run/secrets/pinswap"), "{config:?}");
        // The webhook keeps its own.
        let d = find(&objects, "Deployment", "pinswap");
        assert_eq!(
            secrets_of(&d["spec"]["template"]["spec"]),
            ["pinswap-registry-auth"]
        );
    }

    let objects = manifests(&[
        "--tls",
        "self-signed",
        "--config",
        star,
        "--node-agent",
        "--node-agent-registry-auth-secret",
        "node-agent-pull",
    ])
    .await;
    let ds = find(&objects, "DaemonSet", "pinswap-node-agent");
    let _: DaemonSet = typed(ds);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(secrets_of(pod), ["node-agent-pull"]);
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"].is_object())
        .unwrap();
    assert_eq!(volume["secret"], json!({"secretName": "node-agent-pull"}));
    let container = &pod["containers"][0];
    let mounts: Vec<&Value> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["name"] == volume["name"])
        .collect();
    assert_eq!(
        mounts,
        [
            &json!({"name": "registry-auth", "mountPath": "/var/run/secrets/pinswap-node-agent", "readOnly": true})
        ]
    );
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.ends_with(&[
            "--target-auth",
            "/var/run/secrets/pinswap-node-agent/.dockerconfigjson"
        ]),
        "{args:?}"
    );
    let text = serde_json::to_string(&agent_objects(&objects)).unwrap();
    assert!(!text.contains("pinswap-registry-auth"), "{text}");

    // Refused: the webhook's Secret, a named allowlist, an ECR target.
    let ecr = dir.path().join("ecr.yaml");
    std::fs::write(
        &ecr,
        "target: {aws: {accountId: \"123456789012\", region: eu-west-1}}\nsource: {registries: [{registry: \"*\"}]}\n",
    )
    .unwrap();
    let cases = [
        (star, "pinswap-registry-auth", "is the webhook's Secret"),
        (named, "node-agent-pull", "source.registries has no \"*\""),
        (ecr.to_str().unwrap(), "node-agent-pull", "target.aws"),
        (star, "Node_Pull", "not a valid Secret name"),
    ];
    for (config, secret, want) in cases {
        let (code, out, err) = common::run_pinswap(&[
            "manifests",
            "--config",
            config,
            "--node-agent",
            "--node-agent-registry-auth-secret",
            secret,
        ])
        .await;
        assert_eq!(code, 2, "{secret}: {err}");
        assert!(out.is_empty());
        assert!(
            err.contains("--node-agent-registry-auth-secret: ") && err.contains(want),
            "{secret}: {err}"
        );
    }
}

fn agent(dir: &Path, target_auth: Option<&Path>) -> Agent {
    Agent {
        config: dir.join("pinswap.yaml"),
        runtime: Runtime::Containerd,
        mode: Mode::Resolve,
        dir: dir.join("certs.d"),
        registries_conf: None,
        interval: Duration::from_secs(30),
        daemonset: None,
        target_auth: target_auth.map(Path::to_path_buf),
        registries_file: None,
    }
}

#[tokio::test]
async fn the_agent_lists_the_target_anonymously_or_with_its_own_credentials_never_the_webhooks() {
    let target = TestRegistry::plain_auth("pusher", "push-secret").await;
    push_image(&target, "cache/quay.io/app", Some("v1"), &Image::oci(1, 41)).await;
    let tmp = tempfile::tempdir().unwrap();
    // The webhook's credentials, readable where the config says: the
    // agent must not use them.
    let pw = tmp.path().join("pw");
    std::fs::write(&pw, "push-secret\n").unwrap();
    let config_text = format!(
        "target: {{registry: {}/cache, insecure: true, auth: {{username: pusher, passwordFile: {}}}}}\nsource: {{registries: [{{registry: \"*\"}}, {{registry: ghcr.io}}]}}\n",
        target.host(),
        pw.display()
    );
    let anonymous = agent(tmp.path(), None);
    std::fs::write(&anonymous.config, &config_text).unwrap();
    let config = pinswap::config::Config::load(&anonymous.config).unwrap();

    // Anonymous: refused, and said so with what to do.
    let e = anonymous.list(&config).await.unwrap_err();
    assert!(
        matches!(e, AgentError::Refused { status: 401, .. }),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(text.contains("nodeAgent.registryAuthSecret"), "{text}");
    assert!(!text.contains("push-secret"), "{text}");
    let mut known = BTreeSet::new();
    let (written, _) = anonymous.round(&mut known).await.unwrap();
    assert_eq!(
        written,
        [Path::new("ghcr.io/hosts.toml")],
        "only the named registry"
    );
    assert!(!anonymous.dir.join("quay.io").exists());

    // Its own read-only credentials (a dockerconfigjson Secret's file).
    let auth = tmp.path().join(".dockerconfigjson");
    let basic = base64::engine::general_purpose::STANDARD.encode("pusher:push-secret");
    std::fs::write(
        &auth,
        json!({"auths": {target.host(): {"auth": basic}}}).to_string(),
    )
    .unwrap();
    let credentialed = agent(tmp.path(), Some(&auth));
    assert_eq!(
        credentialed.list(&config).await.unwrap(),
        BTreeSet::from(["quay.io".to_owned()])
    );
    let (written, _) = credentialed.round(&mut known).await.unwrap();
    assert_eq!(written, [Path::new("quay.io/hosts.toml")]);

    // Refused later: the files keep the registries as last listed.
    let (written, removed) = anonymous.round(&mut known).await.unwrap();
    assert!(
        written.is_empty() && removed.is_empty(),
        "{written:?} {removed:?}"
    );
    assert!(anonymous.dir.join("quay.io/hosts.toml").exists());
    assert!(anonymous.dir.join("ghcr.io/hosts.toml").exists());

    // A new agent (an upgrade rolled its Pod), refused at its first
    // listing: what the one before it wrote for "*" is unknown to it, and
    // stays.
    let mut fresh = BTreeSet::new();
    let (written, removed) = anonymous.round(&mut fresh).await.unwrap();
    assert!(
        written.is_empty() && removed.is_empty(),
        "{written:?} {removed:?}"
    );
    assert!(anonymous.dir.join("quay.io/hosts.toml").exists());
}

/// One listing per cluster: the leader lists the target and writes the set
/// into the ConfigMap the install renders (marked as the leader's), with
/// the install's RBAC; the agents read it from their volume and send the
/// target nothing, however many there are. An unchanged set is not
/// written again, a ConfigMap without the mark is left alone, and an agent
/// whose volume has no set yet keeps its files.
#[tokio::test]
async fn the_leader_lists_the_target_once_for_every_node_agent() {
    use pinswap::nodeconfig::registries::{KEY, Round};
    let star = Star::start(&["quay.io/app"]).await;
    let (front, config_text, tmp, objects) =
        (&star.front, &star.config_text, &star.tmp, &star.objects);

    // What the install renders.
    let rendered = find(objects, "ConfigMap", "pinswap-registries");
    assert_eq!(
        rendered["metadata"]["annotations"]["pinswap.dev/registries"],
        "written by the leader"
    );
    assert!(rendered.get("data").is_none(), "{rendered}");
    let ds = find(objects, "DaemonSet", "pinswap-node-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let args = pod["containers"][0]["args"].to_string();
    assert!(
        args.contains(r#""--registries-file","/etc/pinswap/registries/registries.json""#),
        "{args}"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "registries")
        .unwrap();
    assert_eq!(
        volume["configMap"],
        json!({"name": "pinswap-registries", "optional": true})
    );
    assert_eq!(secrets_of(pod), Vec::<String>::new());

    // The leader, through the API server with the install's RBAC.
    let (api, publisher) = star.leader().await;
    let quay = BTreeSet::from(["quay.io".to_owned()]);
    assert_eq!(
        publisher.round().await.unwrap(),
        Round::Written(quay.clone())
    );
    assert_eq!(publisher.round().await.unwrap(), Round::Unchanged);
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    let puts = api
        .requests()
        .into_iter()
        .filter(|q| q.method == "PUT" && q.path.ends_with("/configmaps/pinswap-registries"))
        .count();
    assert_eq!(puts, 1, "written once, when the set changed");
    let data = published_set(&api);

    // Ten nodes' agents: the kubelet's copy of the ConfigMap, no request
    // to the target.
    let volume = tmp.path().join("volume");
    std::fs::create_dir_all(&volume).unwrap();
    let file = volume.join(KEY);
    front.reset();
    for n in 0..10 {
        let node = tmp.path().join(format!("node{n}"));
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("pinswap.yaml"), config_text).unwrap();
        let mut a = agent(&node, None);
        a.registries_file = Some(file.clone());
        // Before the leader lists: nothing to go on, nothing changed.
        let mut known = BTreeSet::new();
        let e = a.round(&mut known).await;
        assert!(!a.dir.join("quay.io").exists(), "{e:?}");
        std::fs::write(&file, &data).unwrap();
        let (written, _) = a.round(&mut known).await.unwrap();
        assert_eq!(written, [Path::new("quay.io/hosts.toml")]);
        std::fs::remove_file(&file).unwrap();
    }
    assert!(front.requests().is_empty(), "{:?}", front.requests());

    // Another's ConfigMap under the name: left as it is.
    let mut theirs: k8s_openapi::api::core::v1::ConfigMap =
        serde_json::from_value(rendered.clone()).unwrap();
    theirs.metadata.annotations = None;
    theirs.data = Some([("other".to_owned(), "theirs".to_owned())].into());
    let theirs = api.put_config_map("pinswap", theirs);
    assert_eq!(publisher.round().await.unwrap(), Round::NotInstalled);
    assert_eq!(
        api.config_map("pinswap", "pinswap-registries"),
        Some(theirs)
    );
}

/// The registry set the leader wrote into `pinswap-registries`.
fn published_set(api: &common::kube::KubeApi) -> String {
    api.config_map("pinswap", "pinswap-registries")
        .unwrap()
        .data
        .unwrap()[pinswap::nodeconfig::registries::KEY]
        .clone()
}

/// A minute of the target's requests (two 30 s rounds) from the leader
/// and `nodes` agents: each agent reads the leader's set from its copy of
/// the ConfigMap when `published`, or lists the target itself.
async fn a_minute_of_requests(
    tmp: &Path,
    config_text: &str,
    front: &common::front::Front,
    publisher: &pinswap::nodeconfig::registries::Publisher,
    api: &common::kube::KubeApi,
    nodes: usize,
    published: bool,
) -> usize {
    use pinswap::nodeconfig::registries::KEY;
    let run = tmp.join(format!("{nodes}-{published}"));
    let volume = run.join("volume");
    std::fs::create_dir_all(&volume).unwrap();
    let mut agents = Vec::new();
    for n in 0..nodes {
        let node = run.join(format!("node{n}"));
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("pinswap.yaml"), config_text).unwrap();
        let mut a = agent(&node, None);
        a.registries_file = published.then(|| volume.join(KEY));
        agents.push((a, BTreeSet::new()));
    }
    front.reset();
    for _round in 0..2 {
        if published {
            publisher.round().await.unwrap();
            // The kubelet's copy of the ConfigMap.
            std::fs::write(volume.join(KEY), published_set(api)).unwrap();
        }
        for (a, known) in &mut agents {
            a.round(known).await.unwrap();
            assert!(a.dir.join("ghcr.io/hosts.toml").exists());
        }
    }
    front.requests().len()
}

#[tokio::test]
async fn the_targets_requests_do_not_grow_with_the_nodes() {
    let star = Star::start(&["quay.io/app", "ghcr.io/org/tool", "docker.io/library/nginx"]).await;
    let (api, publisher) = star.leader().await;
    // The leader's client has met the target before the minute counted.
    publisher.round().await.unwrap();

    let mut figures = Vec::new();
    for (nodes, published) in [(10, true), (1000, true), (10, false), (100, false)] {
        {
            let t = std::time::Instant::now();
            let n = a_minute_of_requests(
                star.tmp.path(),
                &star.config_text,
                &star.front,
                &publisher,
                &api,
                nodes,
                published,
            )
            .await;
            eprintln!(
                "{nodes} nodes, {}: {n} requests a minute ({:.1} s)",
                if published {
                    "the leader's set"
                } else {
                    "each listing"
                },
                t.elapsed().as_secs_f64()
            );
            figures.push(n);
        }
    }
    // The leader lists the catalog once a round, whatever the nodes;
    // agents listing for themselves cost the target in proportion.
    assert_eq!((figures[0], figures[1]), (2, 2), "{figures:?}");
    assert_eq!(figures[3], 10 * figures[2], "{figures:?}");
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
}

/// A target behind a counting front holding `repos` under `cache/`, a
/// `"*"` config for it, and what `pinswap manifests --node-agent` renders
/// for that config.
struct Star {
    _target: TestRegistry,
    front: common::front::Front,
    config_text: String,
    tmp: tempfile::TempDir,
    objects: Vec<Value>,
}

impl Star {
    async fn start(repos: &[&str]) -> Star {
        common::init();
        let target = TestRegistry::plain().await;
        for (k, repo) in repos.iter().enumerate() {
            let image = Image::oci(1, 43 + k as u64);
            push_image(&target, &format!("cache/{repo}"), Some("v1"), &image).await;
        }
        let front = common::front::Front::start(&target.host()).await;
        let config_text = format!(
            "target: {{registry: {}/cache, insecure: true}}\nsource: {{registries: [{{registry: \"*\"}}]}}\n",
            front.host()
        );
        let tmp = tempfile::tempdir().unwrap();
        let config_file = tmp.path().join("pinswap.yaml");
        std::fs::write(&config_file, &config_text).unwrap();
        let objects = manifests(&[
            "--tls",
            "self-signed",
            "--config",
            config_file.to_str().unwrap(),
            "--node-agent",
        ])
        .await;
        Star {
            _target: target,
            front,
            config_text,
            tmp,
            objects,
        }
    }

    /// The leader's publisher, through an API server that enforces the
    /// install's RBAC and holds the rendered ConfigMap.
    async fn leader(
        &self,
    ) -> (
        common::kube::KubeApi,
        pinswap::nodeconfig::registries::Publisher,
    ) {
        let api = common::kube::KubeApi::start().await;
        let config = pinswap::config::Config::from_yaml(&self.config_text, "c.yaml").unwrap();
        api.authorize_install_with(
            &config,
            pinswap::install::manifests::Tls::SelfSigned,
            Some(pinswap::install::node_agent::NodeAgent {
                runtime: Runtime::Containerd,
                mode: Mode::Resolve,
                host_path: "/etc/containerd/certs.d".into(),
                registry_auth_secret: None,
            }),
        );
        let rendered = find(&self.objects, "ConfigMap", "pinswap-registries");
        api.put_config_map("pinswap", serde_json::from_value(rendered.clone()).unwrap());
        let mirror = pinswap::mirror::Mirror::connect(
            &config,
            std::sync::Arc::new(pinswap::metrics::Metrics::new()),
        )
        .await
        .unwrap();
        let publisher = pinswap::nodeconfig::registries::Publisher::new(
            std::sync::Arc::new(mirror),
            api.install_client(),
            "pinswap",
        );
        (api, publisher)
    }
}
