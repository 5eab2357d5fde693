//! Helpers of the `pinswap mutate` tests: running it with input, the
//! manifests it is given and what it must make of them, and configs.

pub use crate::common::cli::Out;

use crate::common;
use std::path::Path;

use crate::common::TestRegistry;

pub async fn mutate(args: &[&str], input: &str) -> Out {
    run(&["mutate"], args, input).await
}

pub async fn run(head: &[&str], args: &[&str], input: &str) -> Out {
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
pub const MANIFESTS: &str = r#"# Shop: the storefront and its nightly job.
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
pub const EXPECTED: &str = r#"# Shop: the storefront and its nightly job.
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

pub fn write_config(dir: &Path, src: &TestRegistry, dst: &TestRegistry, extra: &str) -> String {
    let cfg = dir.join("pinswap.yaml");
    std::fs::write(&cfg, config_text(src, dst, extra)).unwrap();
    cfg.to_str().unwrap().to_owned()
}

pub fn config_text(src: &TestRegistry, dst: &TestRegistry, extra: &str) -> String {
    format!(
        "target: {{registry: \"{}/gitops\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n{extra}",
        dst.host(),
        src.host()
    )
}

pub fn mirror(src: &TestRegistry, dst: &TestRegistry) -> String {
    format!("{}/gitops/127.0.0.1_{}", dst.host(), src.port())
}
