//! `pinswap mutate` through the binary, against real registries: only the
//! image scalars and pinswap's annotations change (byte for byte
//! elsewhere), a rerun changes nothing, every template kind it names is
//! rewritten where the API puts its pod template, exit codes tell pinned
//! from not, and directories and `--in-place` work on a real manifest tree
//! (git diff).

mod common;

use std::path::Path;

use common::fixtures::Image;
use common::mutating::*;
use common::{TestRegistry, push_image};
use serde_json::{Value, json};

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
    out.says("5 rewritten, 1 skipped, 0 not pinned, 0 failed");
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
    again.says("0 rewritten, 6 skipped");
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
    crlf.says("present at the target");

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
    out.says("stdin: document 2: line ");
    assert_eq!(out.stdout, broken);

    // An anchor shared by an image and another field: rewriting it would
    // change that field too, so the read-back check refuses the edit.
    let shared = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: s}}\nspec:\n  containers:\n  - name: c\n    image: &i {}/shop/app:v1\n    env: [{{name: IMAGE, value: *i}}]\n",
        src.host()
    );
    let out = mutate(&["-c", &cfg], &shared).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    out.says("does not read back as intended");
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
    out.says("dry run: not at the target");
    assert!(dst.catalog().await.is_empty());

    // A tag the source does not have fails; the other image is still pinned.
    let both = format!(
        "{good}---\n{}",
        pod(&format!("{}/shop/app:missing", src.host()))
    );
    let out = mutate(&["-c", &cfg], &both).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    out.says("1 rewritten, 0 skipped, 0 not pinned, 1 failed");
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
    out.says("; 8 file(s) written");
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
    out.says("; 0 file(s) written");
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
    out.says("9 rewritten, 0 skipped, 0 not pinned, 0 failed");
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
    out.says("imagePullPolicy is Never");

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

/// An image volume in a workload template is pinned like a container's
/// image: only its `reference` scalar and the annotations change, the
/// report names the field, and a rerun changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_volumes_in_templates_are_pinned() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (app, model) = (Image::oci(1, 437), Image::oci(1, 438));
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&src, "data/model", Some("v2"), &model).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &src, &dst, "");
    let (image, volume) = (
        format!("{}/shop/app:v1", src.host()),
        format!("{}/data/model:v2", src.host()),
    );
    let input = format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: infer}}\nspec:\n  selector: {{matchLabels: {{app: infer}}}}\n  template:\n    metadata:\n      labels: {{app: infer}}\n    spec:\n      containers:\n      - name: main\n        image: {image}\n        volumeMounts: [{{name: model, mountPath: /model}}]\n      volumes:\n      - name: model\n        image:\n          reference: {volume}   # the weights\n          pullPolicy: IfNotPresent\n"
    );
    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    out.says("2 rewritten, 0 skipped, 0 not pinned, 0 failed");
    let pinned = format!("{}/data/model:v2@{}", mirror(&src, &dst), model.digest);
    assert!(
        out.stdout
            .contains(&format!("reference: {pinned}   # the weights\n")),
        "{}",
        out.stdout
    );
    let doc: Value = yaml_serde::from_str(&out.stdout).unwrap();
    let t = &doc["spec"]["template"];
    assert_eq!(
        t["spec"]["volumes"][0]["image"]["pullPolicy"],
        "IfNotPresent"
    );
    let originals: Value = serde_json::from_str(
        t["metadata"]["annotations"]["pinswap.dev/original-images"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(originals["volumes/model"], volume.as_str());
    let repo = format!("gitops/127.0.0.1_{}/data/model", src.port());
    assert_eq!(
        dst.head_manifest(&repo, "v2").await.as_deref(),
        Some(model.digest.as_str()),
        "copied to the target"
    );
    let again = mutate(&["-c", &cfg], &out.stdout).await;
    assert_eq!(again.stdout, out.stdout, "{}", again.stderr);
}

/// A target that cannot be reached fails every image alike: its error is
/// said once, naming `target.registry`, and each image's line names only
/// the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_target_is_reported_once() {
    common::init();
    let src = TestRegistry::plain().await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 431)).await;
    push_image(&src, "shop/job", Some("v2"), &Image::oci(1, 432)).await;
    let down = format!("127.0.0.1:{}", common::registry::free_port());
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{down}/gitops\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n",
            src.host()
        ),
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let input = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n  containers:\n  - {{name: a, image: \"{0}/shop/app:v1\"}}\n  - {{name: b, image: \"{0}/shop/job:v2\"}}\n  initContainers: [{{name: i, image: \"{0}/shop/app:v1\"}}]\n",
        src.host()
    );
    let once = format!("error: target.registry {down}/gitops: cannot reach registry {down}: ");
    let out = mutate(&["-c", cfg], &input).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(out.stdout, input, "passed through unchanged");
    let each = format!("(cannot reach registry {down})\n");
    assert_eq!(out.stderr.matches(&each).count(), 3, "{}", out.stderr);
    assert_eq!(out.stderr.matches(&once).count(), 1, "{}", out.stderr);
    assert_eq!(
        out.stderr.matches("tried http").count(),
        1,
        "{}",
        out.stderr
    );
    out.says("(3 image(s))");
    out.says("3 image(s): 0 rewritten, 0 skipped, 0 not pinned, 3 failed");

    // --check: the images on stdout, the target's error once on stderr.
    let check = mutate(&["-c", cfg, "--check"], &input).await;
    assert_eq!(check.code, 1, "{}", check.stderr);
    assert_eq!(check.stdout.matches(&each).count(), 3, "{}", check.stdout);
    assert_eq!(check.stderr.matches(&once).count(), 1, "{}", check.stderr);
    assert!(!check.stdout.contains("tried http"), "{}", check.stdout);
}

/// A Tekton Task, a KubeVirt VirtualMachine and a Flux OCIRepository, with
/// comments and flow style, and a Knative Service whose kind the config
/// does not turn on.
const CUSTOM: &str = "# build task
apiVersion: tekton.dev/v1
kind: Task
metadata:
  name: build # the build
spec:
  steps:
  - name: compile
    image: {{SRC}}/ci/build:v1   # pinned by pinswap
    script: make
  - {name: lint, image: \"{{SRC}}/ci/build:v1\"}
  - {name: custom, image: $(params.builder)}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: vm, annotations: {team: infra}}
spec:
  template:
    spec:
      volumes:
      - name: root
        containerDisk: {image: {{SRC}}/disks/fedora:v1}
  dataVolumeTemplates:
  - spec: {source: {registry: {url: \"docker://{{SRC}}/disks/fedora:v1\"}}}
---
apiVersion: source.toolkit.fluxcd.io/v1
kind: OCIRepository
metadata: {name: manifests}
spec: {url: oci://{{SRC}}/ci/build, ref: {tag: v1}}
---
apiVersion: serving.knative.dev/v1
kind: Service
metadata: {name: hello}
spec: {template: {spec: {containers: [{image: {{SRC}}/ci/build:v1}]}}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_resources_are_rewritten_only_when_asked_and_by_their_fields() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let build = Image::oci(1, 411);
    let disk = Image::oci(1, 412);
    push_image(&src, "ci/build", Some("v1"), &build).await;
    push_image(&src, "disks/fedora", Some("v1"), &disk).await;
    let dir = tempfile::tempdir().unwrap();
    let input = CUSTOM.replace("{{SRC}}", &src.host());

    // Turned on but not asked to rewrite: the text is left as it was.
    let cfg = write_config(
        dir.path(),
        &src,
        &dst,
        "customResources: {profiles: [tekton, kubevirt, flux]}\n",
    );
    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, input);

    let cfg = write_config(
        dir.path(),
        &src,
        &dst,
        "customResources: {profiles: [tekton, kubevirt, flux], rewrite: true}\n",
    );
    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let m = mirror(&src, &dst);
    let s = src.host();
    let (b, d) = (&build.digest, &disk.digest);
    let expected = input
        .replace(
            "metadata:\n  name: build # the build\n",
            &format!("metadata:\n  annotations:\n    pinswap.dev/original-images: '{{\"spec.steps[0].image\":\"{s}/ci/build:v1\",\"spec.steps[1].image\":\"{s}/ci/build:v1\"}}'\n    pinswap.dev/sources: '{{\"spec.steps[0].image\":\"{s}/ci/build:v1@{b}\",\"spec.steps[1].image\":\"{s}/ci/build:v1@{b}\"}}'\n  name: build # the build\n"),
        )
        .replace(
            &format!("image: {s}/ci/build:v1   #"),
            &format!("image: {m}/ci/build:v1@{b}   #"),
        )
        .replace(
            &format!("image: \"{s}/ci/build:v1\"}}"),
            &format!("image: \"{m}/ci/build:v1@{b}\"}}"),
        )
        .replace(
            "annotations: {team: infra}",
            &format!("annotations: {{\"pinswap.dev/original-images\": \"{{\\\"spec.dataVolumeTemplates[0].spec.source.registry.url\\\":\\\"docker://{s}/disks/fedora:v1\\\",\\\"spec.template.spec.volumes[0].containerDisk.image\\\":\\\"{s}/disks/fedora:v1\\\"}}\", \"pinswap.dev/sources\": \"{{\\\"spec.dataVolumeTemplates[0].spec.source.registry.url\\\":\\\"{s}/disks/fedora:v1@{d}\\\",\\\"spec.template.spec.volumes[0].containerDisk.image\\\":\\\"{s}/disks/fedora:v1@{d}\\\"}}\", team: infra}}"),
        )
        .replace(
            &format!("containerDisk: {{image: {s}/disks/fedora:v1}}"),
            &format!("containerDisk: {{image: {m}/disks/fedora:v1@{d}}}"),
        )
        .replace(
            &format!("url: \"docker://{s}/disks/fedora:v1\""),
            &format!("url: \"docker://{m}/disks/fedora:v1@{d}\""),
        );
    assert_eq!(out.stdout, expected, "{}", out.stderr);
    // The copies are at the target, byte for byte.
    let (bytes, _, _) = dst
        .get_manifest(
            &format!("gitops/127.0.0.1_{}/disks/fedora", src.port()),
            &disk.digest,
        )
        .await
        .unwrap();
    assert!(bytes == disk.manifest);
    // A rerun changes nothing.
    let again = mutate(&["-c", &cfg], &out.stdout).await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.stdout, out.stdout);
}
