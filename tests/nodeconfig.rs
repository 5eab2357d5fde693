//! The node agent against a node's own registry configuration, with a temp
//! dir as the node's /etc: what each runtime takes from the files after a
//! round is what the node configured, plus pinswap's mirror only where the
//! node said nothing for that source.
//!
//! CRI-O's view comes from its own library: `registries-conf`
//! (tests/tools/registries-conf, built by scripts/build-tools.sh) loads the
//! registries.conf and drop-ins with containers/image's sysregistriesv2 and
//! prints the `[[registry]]` it takes for an image. containerd's view is
//! its host-directory rules (core/remotes/docker/config/hosts.go) restated
//! in [`containerd_view`].

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use pinswap::nodeconfig::agent::Agent;
use pinswap::nodeconfig::{Mode, Runtime};

/// `target/tools/NAME`, or a panic saying how to build it.
fn tool(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/tools")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run scripts/build-tools.sh (scripts/test.sh does)",
        p.display()
    );
    p
}

fn agent(etc: &Path, runtime: Runtime, dir: &str) -> Agent {
    Agent {
        config: etc.join("pinswap.yaml"),
        runtime,
        mode: Mode::Resolve,
        dir: etc.join(dir),
        registries_conf: None,
        interval: Duration::from_secs(30),
        daemonset: None,
        target_auth: None,
        registries_file: None,
    }
}

/// `..` and `.` resolved lexically, as Go's filepath.Join cleans.
fn clean(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// What containerd uses for `host` from the config_path `root`.
#[derive(Debug, PartialEq, Eq)]
struct View {
    /// The directory it read (`None`: none, defaults).
    dir: Option<PathBuf>,
    /// The server's (the registry's own) CAs and client pairs.
    ca: BTreeSet<PathBuf>,
    client: BTreeSet<(PathBuf, Option<PathBuf>)>,
    /// `server`, when a hosts.toml sets it.
    server: Option<String>,
    /// The `[host."..."]` URLs, in order.
    mirrors: Vec<String>,
}

/// containerd's rules: the first of `host_port_`, `host`, `_default` that
/// exists; its hosts.toml when non-empty (paths relative to the
/// directory), else its `*.crt` (CAs) and `*.cert` with `<name>.key`.
fn containerd_view(root: &Path, host: &str) -> View {
    let mut candidates = Vec::new();
    if let Some((h, p)) = host.rsplit_once(':') {
        candidates.push(root.join(format!("{h}_{p}_")));
    }
    candidates.push(root.join(host));
    candidates.push(root.join("_default"));
    let mut view = View {
        dir: None,
        ca: BTreeSet::new(),
        client: BTreeSet::new(),
        server: None,
        mirrors: Vec::new(),
    };
    let Some(dir) = candidates.into_iter().find(|d| d.exists()) else {
        return view;
    };
    let abs = |p: &str| clean(&dir.join(p));
    let text = std::fs::read_to_string(dir.join("hosts.toml")).unwrap_or_default();
    if text.is_empty() {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| !e.file_type().unwrap().is_dir())
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        names.sort();
        for n in &names {
            if n.ends_with(".crt") {
                view.ca.insert(abs(n));
            }
            if let Some(stem) = n.strip_suffix(".cert") {
                let key = format!("{stem}.key");
                view.client
                    .insert((abs(n), names.contains(&key).then(|| abs(&key))));
            }
        }
    } else {
        let v: toml::Table = toml::from_str(&text).unwrap();
        view.server = v.get("server").and_then(|s| s.as_str()).map(str::to_owned);
        match v.get("ca") {
            Some(toml::Value::String(s)) => {
                view.ca.insert(abs(s));
            }
            Some(toml::Value::Array(a)) => {
                view.ca.extend(a.iter().map(|s| abs(s.as_str().unwrap())));
            }
            None => {}
            Some(other) => panic!("ca = {other:?}"),
        }
        let pairs = match v.get("client") {
            Some(toml::Value::String(s)) => vec![toml::Value::String(s.clone())],
            Some(toml::Value::Array(a)) => a.clone(),
            None => Vec::new(),
            Some(other) => panic!("client = {other:?}"),
        };
        for p in pairs {
            match p {
                toml::Value::String(s) => {
                    view.client.insert((abs(&s), None));
                }
                toml::Value::Array(a) => {
                    assert_eq!(a.len(), 2, "a client pair: {a:?}");
                    view.client.insert((
                        abs(a[0].as_str().unwrap()),
                        Some(abs(a[1].as_str().unwrap())),
                    ));
                }
                other => panic!("client entry {other:?}"),
            }
        }
        // Table order, as containerd reads it.
        view.mirrors = text
            .lines()
            .filter_map(|l| l.strip_prefix("[host.\""))
            .filter_map(|l| l.split_once('"'))
            .map(|(u, _)| u.to_owned())
            .collect();
    }
    view.dir = Some(dir);
    view
}

#[tokio::test]
async fn containerd_keeps_the_nodes_tls_files_and_default() {
    let etc = tempfile::tempdir().unwrap();
    let root = etc.path().join("certs.d");
    // quay.io: a CA and a client pair of the node's own; ghcr.io: none, but
    // `_default` has a CA for every host; docker.io, the same.
    std::fs::create_dir_all(root.join("quay.io")).unwrap();
    for f in ["ca.crt", "node.cert", "node.key"] {
        std::fs::write(root.join("quay.io").join(f), "theirs").unwrap();
    }
    std::fs::create_dir_all(root.join("_default")).unwrap();
    std::fs::write(root.join("_default/corp.crt"), "theirs").unwrap();
    let a = agent(etc.path(), Runtime::Containerd, "certs.d");
    std::fs::write(
        &a.config,
        "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: ghcr.io}]}\n",
    )
    .unwrap();
    let before: Vec<View> = ["quay.io", "ghcr.io"]
        .iter()
        .map(|h| containerd_view(&root, h))
        .collect();
    assert_eq!(before[0].ca.len(), 1);
    assert_eq!(before[1].ca.len(), 1, "{:?}", before[1]);

    let (written, _) = a.round(&mut BTreeSet::new()).await.unwrap();
    assert_eq!(written.len(), 2);
    for (host, before) in ["quay.io", "ghcr.io"].iter().zip(before) {
        let after = containerd_view(&root, host);
        assert_eq!(after.dir, Some(root.join(host)));
        assert_eq!(after.ca, before.ca, "{host}: the node's CAs");
        assert_eq!(
            after.client, before.client,
            "{host}: the node's client pairs"
        );
        assert_eq!(
            after.mirrors,
            [format!("https://m.example.com/v2/{host}")],
            "{host}: pinswap's mirror"
        );
    }

    // The node's own default hosts.toml: a host without a directory keeps
    // it, and a file of ours that would shadow it goes.
    std::fs::write(
        root.join("_default/hosts.toml"),
        "server = \"https://proxy.corp.example\"\n",
    )
    .unwrap();
    let (_, removed) = a.round(&mut BTreeSet::new()).await.unwrap();
    assert_eq!(removed, [PathBuf::from("ghcr.io/hosts.toml")]);
    let ghcr = containerd_view(&root, "ghcr.io");
    assert_eq!(ghcr.dir, Some(root.join("_default")));
    assert_eq!(ghcr.server.as_deref(), Some("https://proxy.corp.example"));
    assert_eq!(
        std::fs::read_to_string(root.join("_default/hosts.toml")).unwrap(),
        "server = \"https://proxy.corp.example\"\n"
    );
    // quay.io has a directory of its own: `_default` never applied to it.
    assert_eq!(containerd_view(&root, "quay.io").mirrors.len(), 1);
}

#[cfg(unix)]
#[tokio::test]
async fn containerd_never_writes_through_a_linked_host_directory() {
    let etc = tempfile::tempdir().unwrap();
    let root = etc.path().join("certs.d");
    let elsewhere = etc.path().join("elsewhere");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, root.join("quay.io")).unwrap();
    let a = agent(etc.path(), Runtime::Containerd, "certs.d");
    std::fs::write(
        &a.config,
        "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: ghcr.io}]}\n",
    )
    .unwrap();
    let (written, _) = a.round(&mut BTreeSet::new()).await.unwrap();
    assert_eq!(written, [PathBuf::from("ghcr.io/hosts.toml")]);
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
}

/// The `[[registry]]` CRI-O takes for each of `images`.
fn cri_o_view(conf: &Path, dropins: &Path, images: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(tool("registries-conf"))
        .arg("-conf")
        .arg(conf)
        .arg("-dir")
        .arg(dropins)
        .args(images)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "registries-conf: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn cri_o_never_unblocks_or_unmirrors_what_the_node_configures() {
    let etc = tempfile::tempdir().unwrap();
    let containers = etc.path().join("containers");
    let dropins = containers.join("registries.conf.d");
    std::fs::create_dir_all(&dropins).unwrap();
    let conf = containers.join("registries.conf");
    // quay.io blocked, docker.io through the node's own mirror over plain
    // HTTP, and ghcr.io insecure in a drop-in before ours.
    std::fs::write(
        &conf,
        "unqualified-search-registries = [\"docker.io\"]\n\n[[registry]]\nprefix = \"quay.io\"\nlocation = \"quay.io\"\nblocked = true\n\n[[registry]]\nprefix = \"docker.io\"\nlocation = \"docker.io\"\n[[registry.mirror]]\nlocation = \"hub-cache.corp.example:5000\"\ninsecure = true\n",
    )
    .unwrap();
    std::fs::write(
        dropins.join("10-corp.conf"),
        "[[registry]]\nprefix = \"ghcr.io\"\nlocation = \"ghcr.io\"\ninsecure = true\n",
    )
    .unwrap();
    let a = agent(&containers, Runtime::CriO, "registries.conf.d");
    std::fs::write(
        &a.config,
        "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: docker.io}, {registry: ghcr.io}, {registry: registry.k8s.io}]}\n",
    )
    .unwrap();
    let images = [
        "quay.io/org/app:1",
        "docker.io/library/nginx:1",
        "ghcr.io/org/app:1",
        "registry.k8s.io/pause:3.10",
    ];
    let before = cri_o_view(&conf, &dropins, &images);
    let (written, _) = a.round(&mut BTreeSet::new()).await.unwrap();
    assert_eq!(written, [PathBuf::from("50-pinswap.conf")]);
    let after = cri_o_view(&conf, &dropins, &images);
    assert_eq!(after[0]["blocked"], true, "quay.io: {}", after[0]);
    assert_eq!(after[..3], before[..3], "the node's own [[registry]]s");
    assert_eq!(
        after[1]["mirrors"][0]["location"],
        "hub-cache.corp.example:5000"
    );
    assert_eq!(after[1]["mirrors"][0]["insecure"], true);
    assert_eq!(after[2]["insecure"], true);
    // A source the node says nothing about gets pinswap's mirror.
    assert!(before[3].is_null());
    assert_eq!(
        after[3]["mirrors"][0]["location"],
        "m.example.com/registry.k8s.io"
    );

    // The node blocks registry.k8s.io too: pinswap's drop-in goes, and with
    // it nothing of pinswap's is left to replace the node's.
    std::fs::write(
        dropins.join("05-early.conf"),
        "[[registry]]\nprefix = \"registry.k8s.io\"\nlocation = \"registry.k8s.io\"\nblocked = true\n",
    )
    .unwrap();
    let (_, removed) = a.round(&mut BTreeSet::new()).await.unwrap();
    assert_eq!(removed, [PathBuf::from("50-pinswap.conf")]);
    let last = cri_o_view(&conf, &dropins, &images);
    assert_eq!(last[3]["blocked"], true, "registry.k8s.io: {}", last[3]);
}

#[test]
fn node_config_writes_what_the_node_leaves_open_and_names_what_it_refuses() {
    let etc = tempfile::tempdir().unwrap();
    let containers = etc.path().join("containers");
    let dropins = containers.join("registries.conf.d");
    std::fs::create_dir_all(&dropins).unwrap();
    let conf = containers.join("registries.conf");
    std::fs::write(
        &conf,
        "[[registry]]\nprefix = \"quay.io\"\nlocation = \"quay.io\"\nblocked = true\n",
    )
    .unwrap();
    let config = etc.path().join("pinswap.yaml");
    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: ghcr.io}]}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pinswap"))
        .args(["node-config", "--runtime", "cri-o", "-c"])
        .arg(&config)
        .arg("--out")
        .arg(&dropins)
        .env_clear()
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "error: {}: [[registry]] prefix = \"quay.io\" sets blocked = true",
            conf.display()
        )),
        "{stderr}"
    );
    let view = cri_o_view(&conf, &dropins, &["quay.io/a:1", "ghcr.io/a:1"]);
    assert_eq!(view[0]["blocked"], true);
    assert_eq!(view[1]["mirrors"][0]["location"], "m.example.com/ghcr.io");
}

/// `pinswap node-config` on a node, as the runtimes read its files: plain
/// HTTP to loopback registries, as pinswap reaches them itself, and a
/// `"*"` alone pointed to the node agent, which lists the target.
#[test]
fn node_config_speaks_http_to_loopback_and_points_a_wildcard_to_the_agent() {
    let etc = tempfile::tempdir().unwrap();
    let config = etc.path().join("pinswap.yaml");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pinswap"))
            .arg("node-config")
            .arg("-c")
            .arg(&config)
            .args(args)
            .env_clear()
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    std::fs::write(
        &config,
        "target: {registry: \"127.0.0.1:5000/m\"}\nsource: {registries: [{registry: \"localhost:5001\"}, {registry: quay.io}]}\n",
    )
    .unwrap();
    let certs = etc.path().join("certs.d");
    let (code, _, err) = run(&["--out", certs.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let local = containerd_view(&certs, "localhost:5001");
    assert_eq!(local.server.as_deref(), Some("http://localhost:5001"));
    assert_eq!(local.mirrors, ["http://127.0.0.1:5000/v2/m/localhost_5001"]);
    let quay = containerd_view(&certs, "quay.io");
    assert_eq!(quay.server.as_deref(), Some("https://quay.io"));
    assert_eq!(quay.mirrors, ["http://127.0.0.1:5000/v2/m/quay.io"]);

    let containers = etc.path().join("containers");
    let dropins = containers.join("registries.conf.d");
    std::fs::create_dir_all(&dropins).unwrap();
    std::fs::write(containers.join("registries.conf"), "").unwrap();
    let (code, _, err) = run(&["--runtime", "cri-o", "--out", dropins.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let view = cri_o_view(
        &containers.join("registries.conf"),
        &dropins,
        &["localhost:5001/a:1", "quay.io/a:1"],
    );
    assert_eq!(view[0]["insecure"], true, "{}", view[0]);
    assert_eq!(view[0]["mirrors"][0]["insecure"], true, "{}", view[0]);
    assert_eq!(view[1]["insecure"], false, "{}", view[1]);
    assert_eq!(
        view[1]["mirrors"][0]["location"],
        "127.0.0.1:5000/m/quay.io"
    );
    assert_eq!(view[1]["mirrors"][0]["insecure"], true, "{}", view[1]);

    std::fs::write(
        &config,
        "target: {registry: m.example.com}\nsource: {registries: [{registry: \"*\"}]}\n",
    )
    .unwrap();
    let (code, out, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.starts_with("error: source.registries names no registry"),
        "{err}"
    );
    assert!(err.contains("run `pinswap node-agent`"), "{err}");
}
