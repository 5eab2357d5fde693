//! `pinswap mutate` as a KRM function: the ResourceList contract, directly
//! and through kpt, and YAML alias bombs refused naming the file and
//! document.

mod common;

use std::path::Path;

use common::fixtures::Image;
use common::mutating::*;
use common::{TestRegistry, pinswap_bin, push_image};
use serde_json::{Value, json};

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
    out.says(format!("{path}: document 2: line 14 column "));
    out.says("aliases expand to more than");
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
    out.says("ResourceList");
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
