//! docs/install.md's quickstart, run as written: its code blocks are read
//! from the page and run in order by bash, against a real kube-apiserver,
//! kubelet and containerd. `scripts/publish.sh` builds pinswap's image and
//! pushes it and the chart to a loopback TLS registry, `helm` (Helm's own
//! engine, `tests/chart/bin/helm`) installs the chart from `oci://`, and
//! `kubectl` runs the page's Pods. The blocks the page marks as the
//! reader's own (`<!-- install: yours -->`: the registry, the password, the
//! values) are replaced by this test's; every other block runs verbatim.
//!
//! Needs root, `scripts/build-cluster.sh`, `scripts/build-node.sh`, the
//! image's packages (`scripts/build-image.sh --fetch`), kubectl and
//! helm-python-sdk.

mod common;

use std::path::Path;
use std::process::Command;

use common::TestRegistry;
use common::cluster::Cluster;
use common::node::push_runnable;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

/// A code block of the quickstart, with how the page marks it.
#[derive(Debug)]
struct Block {
    yours: bool,
    text: String,
}

/// The `sh` blocks of the page's "Quickstart" section that carry an
/// `<!-- install: run -->` or `<!-- install: yours -->` mark, in order.
fn quickstart(page: &str) -> Vec<Block> {
    let start = page
        .find("## Quickstart")
        .expect("docs/install.md has a Quickstart section");
    let section = &page[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut blocks = Vec::new();
    let mut lines = section.lines().peekable();
    while let Some(line) = lines.next() {
        let yours = match line.trim() {
            "<!-- install: run -->" => false,
            "<!-- install: yours -->" => true,
            _ => continue,
        };
        assert_eq!(
            lines.next().map(str::trim),
            Some("```sh"),
            "a mark is followed by an sh block"
        );
        let mut text = String::new();
        for l in lines.by_ref() {
            if l.trim() == "```" {
                break;
            }
            text.push_str(l);
            text.push('\n');
        }
        blocks.push(Block { yours, text });
    }
    blocks
}

#[test]
fn the_quickstart_marks_its_blocks_and_ties_the_secret_to_the_config() {
    let page =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/install.md"))
            .unwrap();
    let blocks = quickstart(&page);
    let kinds: Vec<bool> = blocks.iter().map(|b| b.yours).collect();
    // What the node test replaces: the reader's registry, then the values.
    assert_eq!(
        kinds,
        [true, false, true, false, false, false],
        "{blocks:#?}"
    );
    let run: String = blocks
        .iter()
        .filter(|b| !b.yours)
        .map(|b| b.text.as_str())
        .collect();
    // The Secret's key is the file the config reads, under the mount the
    // chart gives the Secret and `pinswap config default` names.
    assert!(run.contains("--from-file=target-password"), "{run}");
    assert!(
        blocks[2]
            .text
            .contains("passwordFile: /var/run/secrets/pinswap/target-password"),
        "{}",
        blocks[2].text
    );
    assert!(run.contains("helm install pinswap \"oci://$REGISTRY/charts/pinswap\""));
    // The version installed is the one publish.sh pushes.
    let version = format!("--version {}", env!("CARGO_PKG_VERSION"));
    assert!(run.contains(&version), "{run}");
    for b in &blocks {
        let out = Command::new("bash")
            .args(["-n", "-c", &b.text])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            b.text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn publish_refuses_what_is_not_a_registry() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/publish.sh");
    for (args, said) in [
        (&[][..], "usage:"),
        (&["docker://registry.example.com"][..], "without a scheme"),
        (
            &["registry.example.com/app:v1@sha256:00"][..],
            "without a scheme, tag or digest",
        ),
        (&["a.example.com", "b.example.com"][..], "usage:"),
    ] {
        let out = Command::new(&script).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
}

/// The quickstart, from an empty cluster to a Pod running from the mirror.
#[tokio::test]
async fn the_install_page_runs_verbatim_to_a_rewritten_running_pod() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/install.md")).unwrap();

    // The reader's registry (pinswap's image and chart), over TLS as a real
    // one is; containerd trusts its CA for pinswap's Pods.
    let own = TestRegistry::tls().await;
    node.trust_tls(&own);
    // The mirror, with a password, and a source; Pods reach both.
    let mirror = TestRegistry::plain_auth("pinswap", "mirror-secret").await;
    let source = TestRegistry::plain().await;
    let (mirror_at, source_at) = (node.expose(&mirror).await, node.expose(&source).await);
    // The page asks for nodes that can pull from the mirror.
    node.pull_with_credentials(&mirror_at, "pinswap", "mirror-secret");
    let digest = push_runnable(&source, "shop/try", "v1", "quickstart").await;
    let image = format!("{source_at}/shop/try:v1");

    // This test's versions of the reader's blocks.
    let yours = [
        format!(
            "export REGISTRY={}/platform\nexport IMAGE={image}\nprintf '%s' 'mirror-secret' > target-password\n",
            own.host()
        ),
        // On two shared cores the default 2 s budget can run out; the
        // rest is the page's config, with plain HTTP for these registries.
        format!(
            "cat > pinswap-values.yaml <<EOF\nconfig:\n  target:\n    registry: {mirror_at}/mirror\n    insecure: true\n    auth:\n      username: pinswap\n      passwordFile: /var/run/secrets/pinswap/target-password\n  source:\n    registries:\n      - registry: {source_at}\n        insecure: true\n  copyPolicy: delayed\n  swapPolicy: exists\n  server:\n    admissionBudget: 6s\nEOF\n"
        ),
    ];
    let mut script = String::from("set -euxo pipefail\n");
    let mut mine = yours.iter();
    for b in quickstart(&page) {
        if b.yours {
            script += mine
                .next()
                .expect("as many of the reader's blocks as the test writes");
        } else {
            script += &b.text;
        }
    }

    // The reader's checkout: the page runs from its top directory.
    let work = tempfile::tempdir().unwrap();
    for d in ["scripts", "charts"] {
        std::os::unix::fs::symlink(root.join(d), work.path().join(d)).unwrap();
    }
    let path = format!(
        "{}:{}",
        root.join("tests/chart/bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::task::spawn_blocking({
        let (kubeconfig, ca, work) = (
            c.kubeconfig.clone(),
            own.ca_pem_path(),
            work.path().to_owned(),
        );
        move || {
            Command::new("bash")
                .args(["-c", &script])
                .current_dir(&work)
                .env("PATH", path)
                .env("KUBECONFIG", kubeconfig)
                // Go (Helm) and rustls-native-certs (pinswap) both read it.
                .env("SSL_CERT_FILE", ca)
                .env("PINSWAP_BIN", common::pinswap_bin())
                // The image's packages were fetched before the tests.
                .env("PINSWAP_IMAGE_OFFLINE", "1")
                .env("AWS_EC2_METADATA_DISABLED", "true")
                .env_remove("PINSWAP_DEST_CREDS")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let transcript = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let client = c.admin().await;
    assert!(
        out.status.success(),
        "the quickstart failed:\n{transcript}\n{}",
        common::node::describe(&client, "pinswap").await
    );

    // What the page promised, read back from the API server and registries.
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        own.head_manifest("platform/pinswap", version)
            .await
            .is_some(),
        "the image was published"
    );
    assert!(
        own.head_manifest("platform/charts/pinswap", version)
            .await
            .is_some(),
        "the chart was published"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let first = pods.get("pinswap-try-1").await.unwrap();
    let second = pods.get("pinswap-try-2").await.unwrap();
    let image_of = |p: &Pod| {
        p.spec.as_ref().unwrap().containers[0]
            .image
            .clone()
            .unwrap()
    };
    assert_eq!(image_of(&first), image, "the first Pod keeps its source");
    let rewritten = image_of(&second);
    assert!(
        rewritten.starts_with(&format!("{mirror_at}/mirror/")) && rewritten.ends_with(&digest),
        "the second Pod names the mirror, pinned: {rewritten}\n{transcript}"
    );
    assert!(common::node::is_running(&second), "{transcript}");
    let decisions = common::cluster::annotation(&second, "pinswap.dev/decisions").unwrap();
    assert!(decisions.contains("rewritten"), "{decisions}");
    assert!(
        transcript.contains(&rewritten),
        "the page's last command printed the rewritten image"
    );
    // The mirror holds what the Pod runs, byte for byte the source's.
    let named = rewritten.split_once('@').unwrap().0;
    let repo = named[mirror_at.len() + 1..].rsplit_once(':').unwrap().0;
    assert_eq!(
        mirror.head_manifest(repo, &digest).await.as_deref(),
        Some(digest.as_str())
    );
}
