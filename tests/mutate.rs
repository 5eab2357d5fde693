//! `pinswap mutate` through the binary, against real registries: only the
//! image scalars and pinswap's annotations change (byte for byte elsewhere),
//! a rerun changes nothing, every template kind it names is rewritten
//! where the API puts its pod template, exit codes tell pinned from not, directories and
//! `--in-place` work on a real manifest tree (git diff), and the KRM function
//! contract holds, directly and through `kubectl kustomize`.

mod common;

use std::path::Path;

use common::fixtures::Image;
use common::{TestRegistry, pinswap_bin, push_image};
use serde_json::{Value, json};

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn mutate(args: &[&str], input: &str) -> Out {
    run(&["mutate"], args, input).await
}

async fn run(head: &[&str], args: &[&str], input: &str) -> Out {
    let all: Vec<&str> = head.iter().chain(args).copied().collect();
    let (code, stdout, stderr) = common::run_pinswap_with_input(&all, input).await;
    Out {
        code,
        stdout,
        stderr,
    }
}

/// Comments, blank lines, anchors and aliases, flow and block style, every
/// quoting style, an explicit `...` document end, and kinds that are not
/// workloads.
const MANIFESTS: &str = r#"# Shop: the storefront and its nightly job.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web   # the storefront
  namespace: shop
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata:
      labels: {app: web}
      annotations:
        team: "storefront"
    spec:
      containers:
        - name: web
          image: &app '{{SRC}}/shop/app:v1'

          ports:
          - containerPort: 8080
        - name: other
          image: ghcr.io/x/y:1   # not in source.registries
      initContainers: [{name: init, image: *app}]
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly}
spec:
  schedule: "0 1 * * *"
  jobTemplate:
    spec:
      template:
        spec:
          restartPolicy: Never
          containers:
          - name: job
            image: {{SRC}}/shop/job:v2
---
apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Pod
    metadata: {name: p}
    spec:
      containers: [{name: c, image: "{{SRC}}/shop/app:v1"}]
  - apiVersion: apps/v1
    kind: StatefulSet
    metadata: {name: db}
    spec:
      serviceName: db
      selector: {matchLabels: {app: db}}
      template:
        metadata: {labels: {app: db}}
        spec:
          containers: [{name: db, image: "{{SRC}}/shop/job:v2"}]
...
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {image: "{{SRC}}/shop/app:v1", enabled: yes, at: 12:30}
"#;

/// [`MANIFESTS`] after `mutate`: `{{MIRROR}}` is the target's path for the
/// source registry; `{{APPD}}` and `{{JOBD}}` the images' digests.
const EXPECTED: &str = r#"# Shop: the storefront and its nightly job.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web   # the storefront
  namespace: shop
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata:
      labels: {app: web}
      annotations:
        pinswap.dev/original-images: '{"containers/web":"{{SRC}}/shop/app:v1","initContainers/init":"{{SRC}}/shop/app:v1"}'
        pinswap.dev/sources: '{"containers/web":"{{SRC}}/shop/app:v1@{{APPD}}","initContainers/init":"{{SRC}}/shop/app:v1@{{APPD}}"}'
        team: "storefront"
    spec:
      containers:
        - name: web
          image: &app '{{MIRROR}}/shop/app:v1@{{APPD}}'

          ports:
          - containerPort: 8080
        - name: other
          image: ghcr.io/x/y:1   # not in source.registries
      initContainers: [{name: init, image: *app}]
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly}
spec:
  schedule: "0 1 * * *"
  jobTemplate:
    spec:
      template:
        metadata:
          annotations:
            pinswap.dev/original-images: '{"containers/job":"{{SRC}}/shop/job:v2"}'
            pinswap.dev/sources: '{"containers/job":"{{SRC}}/shop/job:v2@{{JOBD}}"}'
        spec:
          restartPolicy: Never
          containers:
          - name: job
            image: {{MIRROR}}/shop/job:v2@{{JOBD}}
---
apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Pod
    metadata: {"annotations": {"pinswap.dev/original-images": "{\"containers/c\":\"{{SRC}}/shop/app:v1\"}", "pinswap.dev/sources": "{\"containers/c\":\"{{SRC}}/shop/app:v1@{{APPD}}\"}"}, name: p}
    spec:
      containers: [{name: c, image: "{{MIRROR}}/shop/app:v1@{{APPD}}"}]
  - apiVersion: apps/v1
    kind: StatefulSet
    metadata: {name: db}
    spec:
      serviceName: db
      selector: {matchLabels: {app: db}}
      template:
        metadata: {"annotations": {"pinswap.dev/original-images": "{\"containers/db\":\"{{SRC}}/shop/job:v2\"}", "pinswap.dev/sources": "{\"containers/db\":\"{{SRC}}/shop/job:v2@{{JOBD}}\"}"}, labels: {app: db}}
        spec:
          containers: [{name: db, image: "{{MIRROR}}/shop/job:v2@{{JOBD}}"}]
...
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {image: "{{SRC}}/shop/app:v1", enabled: yes, at: 12:30}
"#;

fn write_config(dir: &Path, src: &TestRegistry, dst: &TestRegistry, extra: &str) -> String {
    let cfg = dir.join("pinswap.yaml");
    std::fs::write(&cfg, config_text(src, dst, extra)).unwrap();
    cfg.to_str().unwrap().to_owned()
}

fn config_text(src: &TestRegistry, dst: &TestRegistry, extra: &str) -> String {
    format!(
        "target: {{registry: \"{}/gitops\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n{extra}",
        dst.host(),
        src.host()
    )
}

fn mirror(src: &TestRegistry, dst: &TestRegistry) -> String {
    format!("{}/gitops/127.0.0.1_{}", dst.host(), src.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_images_and_annotations_change_and_a_rerun_changes_nothing() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 401);
    let job = Image::docker(1, 402);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&src, "shop/job", Some("v2"), &job).await;
    let dir = tempfile::tempdir().unwrap();
    // The default copyPolicy, delayed: a command has no background, so
    // mutate waits for its copies and then rewrites.
    let cfg = write_config(dir.path(), &src, &dst, "");
    let input = MANIFESTS.replace("{{SRC}}", &src.host());
    let expected = EXPECTED
        .replace("{{MIRROR}}", &mirror(&src, &dst))
        .replace("{{SRC}}", &src.host())
        .replace("{{APPD}}", &app.digest)
        .replace("{{JOBD}}", &job.digest);

    // Before anything is copied, the CI gate flags every image it would
    // change, prints no manifests, and copies nothing.
    let check = mutate(&["-c", &cfg, "--check"], &input).await;
    assert_eq!(check.code, 1, "{}", check.stderr);
    assert_eq!(check.stdout.matches("would be rewritten").count(), 0);
    assert_eq!(
        check.stdout.matches(": not pinned: ").count(),
        5,
        "{}",
        check.stdout
    );
    assert!(!check.stdout.contains("apiVersion"), "{}", check.stdout);
    assert!(dst.catalog().await.is_empty(), "--check copies nothing");

    let out = mutate(&["-c", &cfg, "-f", "-"], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        out.stdout, expected,
        "byte for byte outside the images and annotations"
    );
    assert_eq!(
        out.stderr.matches("copied to the target").count(),
        5,
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("5 rewritten, 1 skipped, 0 not pinned, 0 failed"),
        "{}",
        out.stderr
    );
    // The copies are complete and byte-exact.
    let comp = format!("127.0.0.1_{}", src.port());
    assert_eq!(
        dst.head_manifest(&format!("gitops/{comp}/shop/app"), "v1")
            .await
            .as_deref(),
        Some(app.digest.as_str())
    );
    let (bytes, ct, _) = dst
        .get_manifest(&format!("gitops/{comp}/shop/job"), &job.digest)
        .await
        .unwrap();
    assert!(bytes == job.manifest, "byte-exact Docker manifest");
    assert_eq!(ct, job.media_type);

    // Stable: mutate on its own output changes no byte, and --check passes.
    let again = mutate(&["-c", &cfg], &out.stdout).await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.stdout, out.stdout);
    assert!(
        again.stderr.contains("0 rewritten, 6 skipped"),
        "{}",
        again.stderr
    );
    let check = mutate(&["-c", &cfg, "--check"], &out.stdout).await;
    assert_eq!(
        (check.code, check.stdout.as_str()),
        (0, ""),
        "{}",
        check.stderr
    );
    // --check on the original now that the images are at the target: every
    // rewrite is listed.
    let check = mutate(&["-c", &cfg, "--check"], &input).await;
    assert_eq!(check.code, 1);
    assert_eq!(
        check.stdout.matches("would be rewritten").count(),
        5,
        "{}",
        check.stdout
    );

    // CRLF line endings are kept, inserted lines included.
    let crlf = mutate(&["-c", &cfg], &input.replace('\n', "\r\n")).await;
    assert_eq!(crlf.code, 0, "{}", crlf.stderr);
    assert_eq!(crlf.stdout, expected.replace('\n', "\r\n"));
    assert!(
        crlf.stderr.contains("present at the target"),
        "{}",
        crlf.stderr
    );

    // JSON in, JSON out, its layout kept.
    let pod = format!(
        "{{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Pod\",\n  \"metadata\": {{\n    \"name\": \"j\"\n  }},\n  \"spec\": {{\n    \"containers\": [{{\"name\": \"c\", \"image\": \"{}/shop/app:v1\"}}]\n  }}\n}}\n",
        src.host()
    );
    let out = mutate(&["-c", &cfg], &pod).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).expect("JSON output for JSON input");
    let app_image = format!("{}/shop/app:v1@{}", mirror(&src, &dst), app.digest);
    assert_eq!(v["spec"]["containers"][0]["image"], app_image.as_str());
    let original: Value = serde_json::from_str(
        v["metadata"]["annotations"]["pinswap.dev/original-images"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        original,
        json!({"containers/c": format!("{}/shop/app:v1", src.host())})
    );
    assert!(out.stdout.starts_with("{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Pod\",\n  \"metadata\": {\n    \"annotations\": {"), "{}", out.stdout);
    let tail = format!(
        "    \"name\": \"j\"\n  }},\n  \"spec\": {{\n    \"containers\": [{{\"name\": \"c\", \"image\": \"{app_image}\"}}]\n  }}\n}}\n"
    );
    assert!(out.stdout.ends_with(&tail), "{}", out.stdout);

    // Broken input names the document, line and column, and loses nothing:
    // it is passed through as it was.
    let broken = "kind: Pod\n---\nspec: [1\n";
    let out = mutate(&["-c", &cfg], broken).await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("stdin: document 2: line "),
        "{}",
        out.stderr
    );
    assert_eq!(out.stdout, broken);

    // An anchor shared by an image and another field: rewriting it would
    // change that field too, so the read-back check refuses the edit.
    let shared = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: s}}\nspec:\n  containers:\n  - name: c\n    image: &i {}/shop/app:v1\n    env: [{{name: IMAGE, value: *i}}]\n",
        src.host()
    );
    let out = mutate(&["-c", &cfg], &shared).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("does not read back as intended"),
        "{}",
        out.stderr
    );
    assert_eq!(out.stdout, shared);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_say_whether_every_image_was_pinned() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 411);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let dir = tempfile::tempdir().unwrap();
    let pod = |image: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers:\n  - name: c\n    image: {image}\n"
        )
    };
    let good = pod(&format!("{}/shop/app:v1", src.host()));

    // copyPolicy none: nothing copied, so nothing pinned, and it says so.
    let none = write_config(dir.path(), &src, &dst, "copyPolicy: none\n");
    let out = mutate(&["-c", &none], &good).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(out.stdout, good, "unchanged, byte for byte");
    assert!(
        out.stderr.contains("not pinned") && out.stderr.contains("copyPolicy is none"),
        "{}",
        out.stderr
    );

    // A dry run copies nothing and records nothing it did not do.
    let cfg = write_config(dir.path(), &src, &dst, "");
    let out = mutate(&["-c", &cfg, "--dry-run"], &good).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(out.stdout, good);
    assert!(
        out.stderr.contains("dry run: not at the target"),
        "{}",
        out.stderr
    );
    assert!(dst.catalog().await.is_empty());

    // A tag the source does not have fails; the other image is still pinned.
    let both = format!(
        "{good}---\n{}",
        pod(&format!("{}/shop/app:missing", src.host()))
    );
    let out = mutate(&["-c", &cfg], &both).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("1 rewritten, 0 skipped, 0 not pinned, 1 failed"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.contains(&format!(
        "image: {}/shop/app:v1@{}",
        mirror(&src, &dst),
        app.digest
    )));
    assert!(
        out.stdout
            .contains(&format!("image: {}/shop/app:missing\n", src.host()))
    );

    // --json is the report; it needs somewhere else for the manifests.
    let out = mutate(&["-c", &cfg, "--json"], &good).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    let out = mutate(&["-c", &cfg, "--check", "--json"], &both).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    let images = &report["files"][0]["images"];
    // The first image is at the target: --check flags the rewrite the
    // manifest lacks.
    assert_eq!(images[0]["status"], "rewritten", "{report}");
    assert_eq!(images[0]["reason"], "present at the target");
    assert_eq!(images[1]["status"], "failed");
    assert_eq!(images[1]["field"], "spec.containers[0].image");
    assert_eq!(
        images[1]["resource"],
        json!({"apiVersion": "v1", "kind": "Pod", "name": "p"})
    );
    assert_eq!(report["failed"], 1);
    // --in-place needs files.
    let out = mutate(&["-c", &cfg, "--in-place"], &good).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args([
            "-c",
            "user.email=t@example.com",
            "-c",
            "user.name=t",
            "-c",
            "core.autocrlf=false",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_manifest_tree_in_place_diffs_only_in_images_and_annotations() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let work = tempfile::tempdir().unwrap();
    let tree = work.path().join("tree");
    let kp = tree.join("monitoring/kube-prometheus");
    std::fs::create_dir_all(&kp).unwrap();
    // Real rendered manifests; each image moved under the test's source
    // registry, which changes only the image lines.
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/manifests/kube-prometheus");
    let mut images = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(&data).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let mut out = String::new();
        for line in text.split_inclusive('\n') {
            match line.split_once("image: ") {
                Some((head, image)) => {
                    images.insert(image.trim().to_owned());
                    out.push_str(&format!("{head}image: {}/{image}", src.host()));
                }
                None => out.push_str(line),
            }
        }
        std::fs::write(kp.join(p.file_name().unwrap()), out).unwrap();
    }
    assert!(images.len() >= 6, "{images:?}");
    for (i, image) in images.iter().enumerate() {
        let (repo, tag) = image.rsplit_once(':').unwrap();
        push_image(&src, repo, Some(tag), &Image::oci(1, 500 + i as u64)).await;
    }
    // Hand-written ones: comments, anchors, flow, CRLF, JSON; and files
    // mutate must leave alone.
    std::fs::create_dir_all(tree.join("apps/shop")).unwrap();
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 421)).await;
    push_image(&src, "shop/job", Some("v2"), &Image::docker(1, 422)).await;
    let shop = MANIFESTS.replace("{{SRC}}", &src.host());
    std::fs::write(tree.join("apps/shop/shop.yml"), &shop).unwrap();
    std::fs::write(tree.join("apps/shop/crlf.yaml"), shop.replace('\n', "\r\n")).unwrap();
    let pod = format!(
        "{{\"apiVersion\": \"v1\", \"kind\": \"Pod\", \"metadata\": {{\"name\": \"j\"}}, \"spec\": {{\"containers\": [{{\"name\": \"c\", \"image\": \"{}/shop/app:v1\"}}]}}}}\n",
        src.host()
    );
    std::fs::write(tree.join("apps/pod.json"), &pod).unwrap();
    std::fs::write(
        tree.join("apps/kustomization.yaml"),
        "resources:\n- shop/shop.yml\n",
    )
    .unwrap();
    std::fs::write(
        tree.join("apps/README.md"),
        format!("image: {}/shop/app:v1\n", src.host()),
    )
    .unwrap();
    std::fs::create_dir_all(tree.join(".hidden")).unwrap();
    std::fs::write(tree.join(".hidden/pod.yaml"), pod.as_bytes()).unwrap();
    git(work.path(), &["init", "-q"]);
    git(work.path(), &["add", "-A"]);
    git(work.path(), &["commit", "-qm", "base"]);

    let cfg = write_config(work.path(), &src, &dst, "");
    let tree_s = tree.to_str().unwrap();
    let out = mutate(&["-c", &cfg, "--in-place", "-f", tree_s], "").await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "");
    let changed = git(work.path(), &["diff", "--name-only"]);
    let mut changed: Vec<&str> = changed.lines().collect();
    changed.sort();
    assert_eq!(
        changed,
        [
            "tree/apps/pod.json",
            "tree/apps/shop/crlf.yaml",
            "tree/apps/shop/shop.yml",
            "tree/monitoring/kube-prometheus/blackboxExporter-deployment.yaml",
            "tree/monitoring/kube-prometheus/grafana-deployment.yaml",
            "tree/monitoring/kube-prometheus/kubeStateMetrics-deployment.yaml",
            "tree/monitoring/kube-prometheus/nodeExporter-daemonset.yaml",
            "tree/monitoring/kube-prometheus/prometheusOperator-deployment.yaml",
        ],
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("; 8 file(s) written"), "{}", out.stderr);
    // Every removed line is an image line; every added line is an image
    // line or pinswap's annotations (with the metadata/annotations keys
    // they needed).
    let diff = git(work.path(), &["diff", "-U0", "--no-color"]);
    let mirror = mirror(&src, &dst);
    let (mut minus, mut plus) = (0, 0);
    for l in diff.lines() {
        if l.starts_with("---") || l.starts_with("+++") {
            continue;
        }
        if let Some(l) = l.strip_prefix('-') {
            minus += 1;
            // An image line, or a flow-style metadata line that gained
            // the annotations.
            assert!(
                (l.contains(&format!("{}/", src.host())) && l.contains("image"))
                    || l.contains("metadata: {"),
                "removed: {l}"
            );
        } else if let Some(l) = l.strip_prefix('+') {
            plus += 1;
            let t = l.trim_end_matches('\r').trim();
            assert!(
                (l.contains("image") && l.contains(&mirror))
                    || l.contains("pinswap.dev/")
                    || t == "metadata:"
                    || t == "annotations:",
                "added: {l}"
            );
        }
    }
    assert!(minus >= 20 && plus > minus, "-{minus} +{plus}\n{diff}");
    let kube_rbac = std::fs::read_to_string(kp.join("nodeExporter-daemonset.yaml")).unwrap();
    assert!(
        kube_rbac.contains("pinswap.dev/original-images: '{\"containers/kube-rbac-proxy\":"),
        "{kube_rbac}"
    );
    // A second run writes nothing and leaves no diff beyond the first.
    let out = mutate(&["-c", &cfg, "--in-place", "-f", tree_s], "").await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("; 0 file(s) written"), "{}", out.stderr);
    assert_eq!(git(work.path(), &["diff", "-U0", "--no-color"]), diff);
    // Several -f, files and directories, to stdout: one stream.
    let out = mutate(
        &[
            "-c",
            &cfg,
            "-f",
            tree.join("apps/pod.json").to_str().unwrap(),
            "-f",
            tree.join("apps/shop").to_str().unwrap(),
        ],
        "",
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let crlf = std::fs::read_to_string(tree.join("apps/shop/crlf.yaml")).unwrap();
    let shop = std::fs::read_to_string(tree.join("apps/shop/shop.yml")).unwrap();
    let pod = std::fs::read_to_string(tree.join("apps/pod.json")).unwrap();
    assert_eq!(out.stdout, format!("{pod}---\n{crlf}---\n{shop}"));
}

/// A ConfigMap whose `levels` levels of ten aliases each would expand to
/// 10^`levels` nodes.
fn alias_bomb(levels: usize) -> String {
    let mut s = String::from(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: bomb}\ndata:\n  l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n",
    );
    for i in 1..levels {
        let p = format!("*l{}", i - 1);
        s.push_str(&format!("  l{i}: &l{i} [{}]\n", vec![p; 10].join(", ")));
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_alias_bombs_are_refused_naming_the_file_and_document() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &src, &dst, "");
    let file = dir.path().join("bomb.yaml");
    let text = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec: {{containers: [{{name: c, image: {}/shop/app:v1}}]}}\n---\n{}",
        src.host(),
        alias_bomb(6)
    );
    std::fs::write(&file, &text).unwrap();
    let path = file.to_str().unwrap();
    let out = mutate(&["-c", &cfg, "-f", path], "").await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("{path}: document 2: line 14 column ")),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("aliases expand to more than"),
        "{}",
        out.stderr
    );
    assert_eq!(out.stdout, text, "the input passes through unchanged");

    // The KRM function: the bomb inside an item of the ResourceList.
    let item: String = alias_bomb(6)
        .lines()
        .enumerate()
        .map(|(i, l)| match i {
            0 => format!("- {l}\n"),
            _ => format!("  {l}\n"),
        })
        .collect();
    let config = config_text(&src, &dst, "");
    let indented: String = config.lines().map(|l| format!("      {l}\n")).collect();
    let cm = format!(
        "functionConfig:\n  apiVersion: v1\n  kind: ConfigMap\n  metadata: {{name: pinswap}}\n  data:\n    config: |\n{indented}"
    );
    let out = run(&["mutate", "--krm"], &[], &resource_list(&item, &cm)).await;
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("stdin: document 1: line ")
            && out.stderr.contains("aliases expand to more than"),
        "{}",
        out.stderr
    );
}

fn resource_list(items: &str, function_config: &str) -> String {
    format!(
        "apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n{items}{function_config}"
    )
}

const ITEM: &str = r#"- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: web # the storefront
    namespace: shop
    annotations:
      config.kubernetes.io/index: '0'
      internal.config.kubernetes.io/path: 'apps/web.yaml'
  spec:
    template:
      spec:
        containers:
        - name: web
          image: "{{IMAGE}}"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn krm_function_contract() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 431);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let config = config_text(&src, &dst, "");
    let indented: String = config.lines().map(|l| format!("      {l}\n")).collect();
    let cm = format!(
        "functionConfig:\n  apiVersion: v1\n  kind: ConfigMap\n  metadata: {{name: pinswap}}\n  data:\n    config: |\n{indented}"
    );
    let good = ITEM.replace("{{IMAGE}}", &format!("{}/shop/app:v1", src.host()));
    let bad = ITEM
        .replace("{{IMAGE}}", &format!("{}/shop/app:missing", src.host()))
        .replace("name: web #", "name: broken #");
    let input = resource_list(&format!("{good}{bad}"), &cm);
    let out = run(&["mutate", "--krm"], &[], &input).await;
    assert_eq!(
        out.code, 1,
        "an error result fails the function: {}",
        out.stderr
    );
    let image = format!("{}/shop/app:v1@{}", mirror(&src, &dst), app.digest);
    assert!(
        out.stdout
            .starts_with(&input[..input.find("    template:\n").unwrap()]),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("          image: \"{image}\"\n")),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("    name: web # the storefront\n"),
        "comments kept"
    );
    let list: Value = yaml_serde::from_str(&out.stdout).unwrap();
    assert_eq!(list["kind"], "ResourceList");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    let results = list["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0]["severity"], "info");
    assert_eq!(
        results[0]["resourceRef"],
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "namespace": "shop"})
    );
    assert_eq!(
        results[0]["field"]["path"],
        "spec.template.spec.containers[0].image"
    );
    assert_eq!(
        results[0]["field"]["currentValue"],
        format!("{}/shop/app:v1", src.host())
    );
    assert_eq!(results[0]["field"]["proposedValue"], image.as_str());
    assert_eq!(
        results[0]["file"],
        json!({"path": "apps/web.yaml", "index": 0})
    );
    assert_eq!(results[1]["severity"], "error");
    assert_eq!(results[1]["resourceRef"]["name"], "broken");
    assert!(
        results[1]["message"]
            .as_str()
            .unwrap()
            .starts_with("failed: "),
        "{results:?}"
    );

    // The config as an object's spec; all pinned: exit 0; rerun is stable.
    let spec: String = config.lines().map(|l| format!("    {l}\n")).collect();
    let fc = format!(
        "functionConfig:\n  apiVersion: pinswap.dev/v1alpha1\n  kind: PinswapMutate\n  metadata: {{name: pin}}\n  spec:\n{spec}"
    );
    let input = resource_list(&good, &fc);
    let out = run(&["mutate", "--krm"], &[], &input).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stderr, out.stdout);
    let first: Value = yaml_serde::from_str(&out.stdout).unwrap();
    assert_eq!(
        first["items"][0]["spec"]["template"]["spec"]["containers"][0]["image"],
        image.as_str()
    );
    let again = run(&["mutate", "--krm"], &[], &out.stdout).await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(again.stdout.ends_with("results: []\n"), "{}", again.stdout);
    assert_eq!(
        again.stdout.replace("results: []\n", ""),
        out.stdout[..out.stdout.find("results:").unwrap()],
        "items unchanged on a rerun"
    );

    // No config: one error result naming what is missing; the items pass
    // through unchanged.
    let input = resource_list(&good, "");
    let out = run(&["mutate", "--krm"], &[], &input).await;
    assert_eq!(out.code, 1);
    assert!(out.stdout.starts_with(&input), "{}", out.stdout);
    let list: Value = yaml_serde::from_str(&out.stdout).unwrap();
    assert_eq!(list["results"][0]["severity"], "error");
    assert!(
        list["results"][0]["message"]
            .as_str()
            .unwrap()
            .contains("functionConfig")
    );
    // A bad config names the key.
    let fc = "functionConfig:\n  kind: PinswapMutate\n  spec: {target: {registry: \"x.example\"}, copyPolicy: sometimes}\n";
    let out = run(&["mutate", "--krm"], &[], &resource_list(&good, fc)).await;
    assert_eq!(out.code, 1);
    assert!(out.stdout.contains("copyPolicy"), "{}", out.stdout);
    // Not a ResourceList: a usage error.
    let out = run(&["mutate", "--krm"], &[], "kind: Pod\n").await;
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("ResourceList"), "{}", out.stderr);
}

/// kpt runs it as an exec function over a directory, in place. (kubectl
/// 1.32's built-in kustomize has no `--enable-exec`, and skips exec
/// functions without one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpt_runs_it_as_an_exec_function() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 441);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("pkg");
    std::fs::create_dir(&pkg).unwrap();
    let web = format!(
        "# the storefront\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web # comment\nspec:\n  template:\n    spec:\n      containers:\n      - name: web\n        image: \"{}/shop/app:v1\"\n",
        src.host()
    );
    std::fs::write(pkg.join("web.yaml"), &web).unwrap();
    let spec: String = config_text(&src, &dst, "")
        .lines()
        .map(|l| format!("  {l}\n"))
        .collect();
    let fn_config = dir.path().join("pinswap-fn.yaml");
    std::fs::write(
        &fn_config,
        format!("apiVersion: pinswap.dev/v1alpha1\nkind: PinswapMutate\nmetadata:\n  name: pin\nspec:\n{spec}"),
    )
    .unwrap();
    let script = dir.path().join("pinswap-krm");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec '{}' mutate --krm\n",
            pinswap_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let kpt = |pkg: &Path| {
        tokio::process::Command::new("kpt")
            .args(["fn", "eval"])
            .arg(pkg)
            .arg("--exec")
            .arg(&script)
            .arg("--fn-config")
            .arg(&fn_config)
            .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
            .output()
    };
    let out = kpt(&pkg).await.expect("kpt is installed");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{log}");
    let after = std::fs::read_to_string(pkg.join("web.yaml")).unwrap();
    let image = format!("{}/shop/app:v1@{}", mirror(&src, &dst), app.digest);
    assert!(
        after.contains(&format!("        image: \"{image}\"\n")),
        "{after}"
    );
    assert!(
        after.starts_with("# the storefront\n") && after.contains("  name: web # comment\n"),
        "{after}"
    );
    let v: Value = yaml_serde::from_str(&after).unwrap();
    let original = v["spec"]["template"]["metadata"]["annotations"]["pinswap.dev/original-images"]
        .as_str()
        .unwrap();
    assert!(original.contains("shop/app:v1"), "{after}");
    // Again: nothing changes.
    let out = kpt(&pkg).await.unwrap();
    assert!(out.status.success());
    assert_eq!(
        std::fs::read_to_string(pkg.join("web.yaml")).unwrap(),
        after
    );
}

/// Every kind `pinswap mutate` names (src/mutate/), each with its
/// pod template where the API puts it: (apiVersion, kind, the lines between
/// the object's `metadata` and its template, the template's indentation,
/// JSON pointer to the template).
const KINDS: [(&str, &str, &str, usize, &str); 9] = [
    ("v1", "Pod", "", 0, ""),
    ("v1", "PodTemplate", "template:\n", 2, "/template"),
    (
        "apps/v1",
        "Deployment",
        "spec:\n  selector: {matchLabels: {app: x}}\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "apps/v1",
        "StatefulSet",
        "spec:\n  serviceName: x  # headless\n  selector: {matchLabels: {app: x}}\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "apps/v1",
        "DaemonSet",
        "spec:\n  selector:\n    matchLabels: {app: x}\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "apps/v1",
        "ReplicaSet",
        "spec:\n  replicas: 3\n  selector: {matchLabels: {app: x}}\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "batch/v1",
        "Job",
        "spec:\n  backoffLimit: 2\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "v1",
        "ReplicationController",
        "spec:\n  replicas: 1\n  selector: {app: x}\n  template:\n",
        4,
        "/spec/template",
    ),
    (
        "batch/v1",
        "CronJob",
        "spec:\n  schedule: \"*/5 * * * *\"\n  jobTemplate:\n    spec:\n      template:\n",
        8,
        "/spec/jobTemplate/spec/template",
    ),
];

/// One document of `kind` whose template (for a Pod, the Pod) runs `image`
/// in container `main`, with a comment, flow and block style, and both
/// quoting styles. With `annotations` (pinswap's two, as `mutate` writes
/// them), they lead the template's metadata.
fn kind_doc(
    (api, kind, head, indent, _): (&str, &str, &str, usize, &str),
    image: &str,
    annotations: Option<(&str, &str)>,
) -> String {
    let pad = " ".repeat(indent);
    let notes = annotations.map_or(String::new(), |(original, source)| {
        format!(
            "{pad}  annotations:\n{pad}    pinswap.dev/original-images: '{{\"containers/main\":\"{original}\"}}'\n{pad}    pinswap.dev/sources: '{{\"containers/main\":\"{source}\"}}'\n"
        )
    });
    let name = kind.to_lowercase();
    let (top, template) = match kind {
        "Pod" => (format!("metadata:\n{notes}  name: {name}\n"), String::new()),
        _ => (
            format!("metadata:\n  name: {name}\n"),
            format!("{pad}metadata:\n{notes}{pad}  labels: {{app: x}}   # selected\n"),
        ),
    };
    format!(
        "apiVersion: {api}\nkind: {kind}\n{top}{head}{template}{pad}spec:\n{pad}  restartPolicy: Always\n{pad}  containers:\n{pad}  - name: main\n{pad}    image: \"{image}\"\n{pad}    args: [--port, '8080']\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_template_kind_is_rewritten_and_nothing_else_changes() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 431);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &src, &dst, "");
    let image = format!("{}/shop/app:v1", src.host());
    let source = format!("{image}@{}", app.digest);
    let pinned = format!("{}/shop/app:v1@{}", mirror(&src, &dst), app.digest);
    let docs = |image: &str, notes: Option<(&str, &str)>| {
        KINDS
            .iter()
            .map(|k| kind_doc(*k, image, notes))
            .collect::<Vec<_>>()
            .join("---\n")
    };
    let input = docs(&image, None);
    let expected = docs(&pinned, Some((&image, &source)));

    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("9 rewritten, 0 skipped, 0 not pinned, 0 failed"),
        "{}",
        out.stderr
    );
    // Byte for byte: only the image scalar and the two annotations differ.
    assert_eq!(out.stdout, expected);
    // Each document reads back as its kind, with the image pinned in its
    // pod template and the annotations where the API reads them.
    let decoded: Vec<Value> = yaml_serde::Deserializer::from_str(&out.stdout)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .collect();
    assert_eq!(decoded.len(), KINDS.len());
    for ((api, kind, _, _, template), doc) in KINDS.iter().zip(&decoded) {
        assert_eq!(
            (doc["apiVersion"].as_str(), doc["kind"].as_str()),
            (Some(*api), Some(*kind))
        );
        let t = doc
            .pointer(template)
            .unwrap_or_else(|| panic!("{kind}: no template"));
        assert_eq!(
            t["spec"]["containers"][0]["image"],
            pinned.as_str(),
            "{kind}"
        );
        assert_eq!(
            t["spec"]["containers"][0]["args"],
            json!(["--port", "8080"]),
            "{kind}"
        );
        let note = |key: &str| -> Value {
            serde_json::from_str(t["metadata"]["annotations"][key].as_str().unwrap()).unwrap()
        };
        assert_eq!(
            note("pinswap.dev/original-images"),
            json!({"containers/main": image}),
            "{kind}"
        );
        assert_eq!(
            note("pinswap.dev/sources"),
            json!({"containers/main": source}),
            "{kind}"
        );
    }
    // Stable: a rerun changes no byte.
    let again = mutate(&["-c", &cfg], &out.stdout).await;
    assert_eq!(
        (again.code, again.stdout.as_str()),
        (0, expected.as_str()),
        "{}",
        again.stderr
    );
}

/// `mutate` decides as the webhook does: a container with
/// `imagePullPolicy: Never` keeps its image (the node holds only that
/// name), unless the config opts in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_pulled_containers_keep_their_image() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 413);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let dir = tempfile::tempdir().unwrap();
    let image = format!("{}/shop/app:v1", src.host());
    let input = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n  containers:\n  - name: preloaded\n    image: {image}\n    imagePullPolicy: Never\n  - name: pulled\n    image: {image}\n    imagePullPolicy: IfNotPresent\n"
    );
    let pinned = format!("{}/shop/app:v1@{}", mirror(&src, &dst), app.digest);
    let cfg = write_config(dir.path(), &src, &dst, "");
    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let pod: Value = yaml_serde::from_str(&out.stdout).unwrap();
    assert_eq!(pod["spec"]["containers"][0]["image"], image.as_str());
    assert_eq!(pod["spec"]["containers"][1]["image"], pinned.as_str());
    assert!(
        out.stderr.contains("imagePullPolicy is Never"),
        "{}",
        out.stderr
    );

    let opted = dir.path().join("opted.yaml");
    std::fs::write(
        &opted,
        config_text(&src, &dst, "rewriteImagePullPolicyNever: true\n"),
    )
    .unwrap();
    let out = mutate(&["-c", opted.to_str().unwrap()], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let pod: Value = yaml_serde::from_str(&out.stdout).unwrap();
    assert_eq!(pod["spec"]["containers"][0]["image"], pinned.as_str());
}
