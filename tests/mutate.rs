//! `pinswap mutate` through the binary, against real registries: every pod
//! template kind is rewritten, other objects pass through, key order is
//! kept, and the target then serves the images by digest.

mod common;

use common::fixtures::Image;
use common::{TestRegistry, pinswap_bin, push_image};
use serde_json::Value;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn mutate(args: &[&str], input: &str) -> Out {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(pinswap_bin())
        .arg("mutate")
        .args(args)
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .await
        .unwrap();
    let out = child.wait_with_output().await.unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

const MANIFESTS: &str = r#"# comments are not kept (yaml_serde has no comment model)
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: shop
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata:
      labels: {app: web}
    spec:
      initContainers: [{name: init, image: "{{SRC}}/shop/app:v1"}]
      containers:
        - name: web
          image: "{{SRC}}/shop/app:v1"
        - name: other
          image: ghcr.io/x/y:1
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
          containers: [{name: job, image: "{{SRC}}/shop/job:v2"}]
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
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {image: "{{SRC}}/shop/app:v1", enabled: "yes", at: "12:30"}
"#;

fn docs(text: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrites_every_template_kind_and_copies() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 401);
    let job = Image::docker(1, 402);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&src, "shop/job", Some("v2"), &job).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(
        &cfg,
        format!(
            "target: {{registry: \"{}/gitops\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\ncopyPolicy: delayed\n",
            dst.host(),
            src.host()
        ),
    )
    .unwrap();
    let input = MANIFESTS.replace("{{SRC}}", &src.host());
    let cfg = cfg.to_str().unwrap();

    // Dry run: rewritten, nothing copied.
    let dry = mutate(&["-c", cfg, "--dry-run"], &input).await;
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    let comp = format!("127.0.0.1_{}", src.port());
    let app_image = format!("{}/gitops/{comp}/shop/app:v1@{}", dst.host(), app.digest);
    let job_image = format!("{}/gitops/{comp}/shop/job:v2@{}", dst.host(), job.digest);
    assert!(
        !dry.stdout.contains(&app_image),
        "not at the target yet: {}",
        dry.stdout
    );
    assert!(
        dry.stdout
            .contains("dry run: not at the target, not copied"),
        "{}",
        dry.stdout
    );
    assert!(dst.catalog().await.is_empty(), "a dry run copies nothing");

    // For real, with copyPolicy delayed: the process waits for its copies.
    let out = mutate(&["-c", cfg, "-f", "-"], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let d = docs(&out.stdout);
    assert_eq!(d.len(), 4);
    let deploy = &d[0];
    // Key order kept: apiVersion, kind, metadata, spec.
    let keys: Vec<&String> = deploy.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["apiVersion", "kind", "metadata", "spec"]);
    let spec = &deploy["spec"]["template"]["spec"];
    // copyPolicy delayed + swapPolicy exists: not there at decision time,
    // so unchanged, and the decision says a copy was started.
    assert_eq!(
        spec["containers"][0]["image"],
        format!("{}/shop/app:v1", src.host())
    );
    let notes: serde_json::Map<String, Value> = serde_json::from_str(
        deploy["spec"]["template"]["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(
        notes["containers/web"]
            .as_str()
            .unwrap()
            .contains("copy started"),
        "{notes:?}"
    );
    assert!(
        notes["containers/other"]
            .as_str()
            .unwrap()
            .contains("not in source.registries")
    );
    // ...and the copies completed before the process exited.
    let repo = format!("gitops/{comp}/shop/app");
    assert_eq!(
        dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(app.digest.as_str())
    );
    let jrepo = format!("gitops/{comp}/shop/job");
    let (bytes, ct, _) = dst.get_manifest(&jrepo, &job.digest).await.unwrap();
    assert!(bytes == job.manifest, "byte-exact Docker manifest");
    assert_eq!(ct, job.media_type);

    // Second run: everything is at the target now, every template rewritten.
    let out = mutate(&["-c", cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let d = docs(&out.stdout);
    let t = &d[0]["spec"]["template"]["spec"];
    assert_eq!(t["initContainers"][0]["image"], app_image.as_str());
    assert_eq!(t["containers"][0]["image"], app_image.as_str());
    assert_eq!(t["containers"][1]["image"], "ghcr.io/x/y:1");
    assert_eq!(
        d[1]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"],
        job_image.as_str()
    );
    assert_eq!(
        d[2]["items"][0]["spec"]["containers"][0]["image"],
        app_image.as_str()
    );
    assert_eq!(
        d[2]["items"][1]["spec"]["template"]["spec"]["containers"][0]["image"],
        job_image.as_str()
    );
    // Not a workload: untouched, and strings a YAML 1.1 reader (kubectl's
    // go-yaml v2) would turn into booleans or numbers stay quoted.
    assert_eq!(d[3]["data"]["image"], format!("{}/shop/app:v1", src.host()));
    assert!(
        out.stdout.contains("enabled: \"yes\"") && out.stdout.contains("at: \"12:30\""),
        "{}",
        out.stdout
    );
    let original: serde_json::Map<String, Value> = serde_json::from_str(
        d[2]["items"][0]["metadata"]["annotations"]["pinswap.dev/original-images"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        original["containers/c"],
        format!("{}/shop/app:v1", src.host())
    );

    // JSON in, JSON out.
    let pod = format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"j"}},"spec":{{"containers":[{{"name":"c","image":"{}/shop/app:v1"}}]}}}}"#,
        src.host()
    );
    let out = mutate(&["-c", cfg], &pod).await;
    let v: Value = serde_json::from_str(&out.stdout).expect("JSON output for JSON input");
    assert_eq!(v["spec"]["containers"][0]["image"], app_image.as_str());

    // Broken input names the document.
    let out = mutate(&["-c", cfg], "kind: Pod\n---\n: : bad\n").await;
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("document 2"), "{}", out.stderr);
}
