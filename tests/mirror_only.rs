//! `mirrorOnly`: Pods an operator must find as it wrote them are admitted
//! with no patch at all while their images are copied to the target, in
//! admission (dry runs too) and in `pinswap mutate`.

mod common;

use common::admission::{review, rig};
use common::fixtures::Image;
use common::mutating::{mirror, mutate, write_config};
use common::review::create_review;
use common::{TestRegistry, push_image};
use serde_json::{Value, json};

/// A Pod as CloudNativePG creates an instance: its labels, and its
/// `Cluster` as controller.
fn cnpg_instance(image: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "pg-1", "namespace": "db",
            "labels": {"cnpg.io/cluster": "pg", "cnpg.io/instanceName": "pg-1", "cnpg.io/podRole": "instance"},
            "ownerReferences": [{"apiVersion": "postgresql.cnpg.io/v1", "kind": "Cluster", "name": "pg",
                "uid": "6f1c0e1e-0000-4000-8000-000000000001", "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "initContainers": [{"name": "bootstrap-controller", "image": image}],
            "containers": [{"name": "postgres", "image": image}],
        }
    })
}

fn body(pod: &Value, dry_run: bool) -> bytes::Bytes {
    let mut r = create_review(pod);
    r["request"]["dryRun"] = json!(dry_run);
    bytes::Bytes::from(serde_json::to_vec(&r).unwrap())
}

/// The profiled operator's Pod gets no patch and no annotation, and its
/// image is at the target after admission; the same image in an ordinary
/// Pod is rewritten. Counted as `outcome="mirror_only"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiled_operators_pod_is_admitted_as_written_and_its_image_mirrored() {
    common::init();
    let r = rig().await;
    let (adm, metrics) =
        r.admission("copyPolicy: immediate\nmirrorOnly: {profiles: [cloudnative-pg]}\n");
    let image = format!("{}/shop/app:v1", r.src.host());

    let dry = review(&adm, body(&cnpg_instance(&image), true)).await;
    assert!(dry.allowed());
    assert_eq!(dry.response.get("patch"), None, "{}", dry.response);
    assert_eq!(
        r.dst.catalog().await,
        Vec::<String>::new(),
        "a dry run copies nothing"
    );

    let a = review(&adm, body(&cnpg_instance(&image), false)).await;
    assert!(a.allowed());
    assert_eq!(a.response.get("patch"), None, "{}", a.response);
    assert_eq!(a.pod, a.original, "stored exactly as submitted");
    let repo = format!("mirror/127.0.0.1_{}/shop/app", r.src.port());
    assert_eq!(
        r.dst.head_manifest(&repo, "v1").await.as_deref(),
        Some(r.app.digest.as_str()),
        "the image is at the target"
    );
    let text = metrics.encode();
    assert_eq!(
        common::metrics::sample(
            &text,
            "pinswap_admissions_total",
            &[("outcome", "mirror_only")]
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        common::metrics::total(&text, "pinswap_rewrites_total"),
        0.0,
        "{text}"
    );

    // Not the operator's Pod: the same image is rewritten.
    let mut other = cnpg_instance(&image);
    other["metadata"]["ownerReferences"][0]["kind"] = json!("StatefulSet");
    other["metadata"]["ownerReferences"][0]["apiVersion"] = json!("apps/v1");
    let b = review(&adm, body(&other, false)).await;
    assert_eq!(
        b.image("containers", 0),
        format!("{}:v1@{}", r.mirrored("shop/app"), r.app.digest)
    );
}

/// `pinswap mutate` leaves a template `mirrorOnly` matches byte for byte
/// as it was, copies its image, and says why in its report; another
/// template in the same stream is pinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutate_leaves_mirrored_only_templates_as_written() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(1, 451);
    push_image(&src, "acid/spilo", Some("16"), &app).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        &src,
        &dst,
        "mirrorOnly:\n  pods:\n  - podSelector: {matchLabels: {application: spilo}}\n    ownerKinds: [apps/StatefulSet]\n",
    );
    let image = format!("{}/acid/spilo:16", src.host());
    let sts = format!(
        "apiVersion: apps/v1\nkind: StatefulSet\nmetadata: {{name: acid-main, namespace: db}}\nspec:\n  selector: {{matchLabels: {{application: spilo}}}}\n  template:\n    metadata:\n      labels: {{application: spilo, cluster-name: acid-main}}\n    spec:\n      containers:\n      - name: postgres\n        image: {image}\n"
    );
    let deploy = sts
        .replace("kind: StatefulSet", "kind: Deployment")
        .replace("name: acid-main", "name: tools");
    let input = format!("{sts}---\n{deploy}");
    let out = mutate(&["-c", &cfg], &input).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let (first, second) = out.stdout.split_once("---\n").unwrap();
    assert_eq!(first, sts, "the StatefulSet is unchanged");
    let pinned = format!("{}/acid/spilo:16@{}", mirror(&src, &dst), app.digest);
    assert!(second.contains(&format!("image: {pinned}\n")), "{second}");
    out.says("mirrored only (mirrorOnly.pods[0]), not rewritten");
    let repo = format!("gitops/127.0.0.1_{}/acid/spilo", src.port());
    assert_eq!(
        dst.head_manifest(&repo, "16").await.as_deref(),
        Some(app.digest.as_str())
    );
}

/// A Deployment in `namespace` (none written when `None`) whose template
/// makes the Pod [`plain_pod`] describes.
fn deployment(namespace: Option<&str>, container: &str, image: &str) -> String {
    let ns = namespace.map_or(String::new(), |n| format!(", namespace: {n}"));
    format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: web{ns}}}\nspec:\n  selector: {{matchLabels: {{app: web}}}}\n  template:\n    metadata:\n      labels: {{app: web}}\n    spec:\n      containers:\n      - name: {container}\n        image: {image}\n"
    )
}

/// The Pod that Deployment's ReplicaSet creates, as admission gets it.
fn plain_pod(namespace: &str, container: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": "web-5d9c7b-", "namespace": namespace, "labels": {"app": "web"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d9c7b",
                "uid": "6f1c0e1e-0000-4000-8000-000000000002", "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {"containers": [{"name": container, "image": image}]}
    })
}

/// The same `mirrorOnly` rule decides alike for a Pod in admission and for
/// the template that makes it in `pinswap mutate`: a JMESPath over the
/// Pod's spec and namespace, and a `namespaces` entry for a manifest that
/// names no namespace (it goes where `kubectl apply` puts it: `default`,
/// or `mutate --namespace`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_is_mirrored_only_exactly_when_the_pod_it_makes_would_be() {
    common::init();
    let r = rig().await;
    let image = format!("{}/shop/app:v1", r.src.host());
    let rules = [
        "mirrorOnly: {pods: [{jmespath: \"obj.spec.containers[0].name == 'postgres' && obj.metadata.namespace == 'db' && obj.kind == 'Pod'\"}]}\n",
        "mirrorOnly: {pods: [{namespaces: [default, db]}]}\n",
    ];
    // (rule, namespace written in the manifest, namespace given to mutate,
    // container, mirrored only)
    let cases = [
        (0, Some("db"), "default", "postgres", true),
        (0, Some("db"), "default", "web", false),
        (0, Some("shop"), "default", "postgres", false),
        (0, None, "db", "postgres", true),
        (1, None, "default", "web", true),
        (1, None, "shop", "web", false),
        (1, Some("shop"), "default", "web", false),
        (1, Some("db"), "shop", "web", true),
    ];
    for (rule, written, given, container, want) in cases {
        let (adm, _) = r.admission(&format!("copyPolicy: immediate\n{}", rules[rule]));
        let namespace = written.unwrap_or(given);
        let admitted = review(&adm, body(&plain_pod(namespace, container, &image), false)).await;
        assert!(admitted.allowed());
        let pod_mirrored_only = admitted.response.get("patch").is_none();

        let input = deployment(written, container, &image);
        let out = pinswap::mutate::mutate(
            &adm,
            &input,
            pinswap::mutate::Options {
                dry_run: false,
                namespace: given.to_owned(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let template_mirrored_only = out.text == input;
        assert_eq!(
            out.slots[0].reason.starts_with("mirrored only"),
            template_mirrored_only,
            "{:?}",
            out.slots
        );
        let case =
            format!("rule {rule}, written {written:?}, given {given}, container {container}");
        assert_eq!(pod_mirrored_only, want, "{case}: the Pod");
        assert_eq!(template_mirrored_only, want, "{case}: the template");
    }
}
