//! Admission's credentials: the Pod's and its ServiceAccount's pull
//! secrets, target credentials read again when they rotate, and each
//! registry's credentials sent to that registry alone.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::admission::*;
use common::fixtures::Image;
use common::{TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::Value;

/// `source.imagePullSecrets`: a private (bearer-token) source is read with
/// the Pod's pull secret, or its ServiceAccount's, fetched through the
/// Kubernetes API; a Pod with neither is left unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_secrets_from_the_pod_and_its_service_account() {
    use k8s_openapi::api::core::v1::{LocalObjectReference, ServiceAccount};
    common::init();
    let src = TestRegistry::token_auth("puller", "Pull-Secret-77").await;
    let dst = TestRegistry::plain().await;
    let app = Image::oci(1, 501);
    push_image(&src, "private/app", Some("v1"), &app).await;
    let kube = common::kube::KubeApi::start().await;
    kube.put_secret(
        "shop",
        common::kube::dockerconfigjson_secret("regcred", &src.host(), "puller", "Pull-Secret-77"),
    );
    kube.put_secret(
        "shop",
        common::kube::dockerconfigjson_secret("sa-cred", &src.host(), "puller", "Pull-Secret-77"),
    );
    kube.put_service_account(
        "shop",
        ServiceAccount {
            metadata: kube::api::ObjectMeta {
                name: Some("builder".into()),
                ..Default::default()
            },
            image_pull_secrets: Some(vec![LocalObjectReference {
                name: "sa-cred".into(),
            }]),
            ..Default::default()
        },
    );
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}], imagePullSecrets: true}}\ncopyPolicy: immediate\n",
            dst.host(),
            src.host()
        ),
        "test.yaml",
    )
    .unwrap();
    // Only what the install's RBAC grants for imagePullSecrets: get.
    kube.authorize_install(&c, pinswap::install::manifests::Tls::CertManager);
    let adm = Admission::from_config(&c, Arc::new(Metrics::new()))
        .unwrap()
        .with_pull_secrets(kube.client());
    let pod_review = |spec: Value| {
        let v = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "shop",
                "operation": "CREATE",
                "userInfo": {"username": "alice"},
                "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "shop"}, "spec": spec},
                "dryRun": false
            }
        });
        bytes::Bytes::from(serde_json::to_vec(&v).unwrap())
    };
    let image = format!("{}/private/app:v1", src.host());
    let mirrored = format!(
        "{}/mirror/127.0.0.1_{}/private/app:v1@{}",
        dst.host(),
        src.port(),
        app.digest
    );

    // No secret anywhere: the source refuses, the Pod is left unchanged.
    let a = review(
        &adm,
        pod_review(serde_json::json!({"containers": [{"name": "c", "image": image}]})),
    )
    .await;
    assert_eq!(a.image("containers", 0), image);
    let d = a.annotation("pinswap.dev/decisions");
    assert!(
        d["containers/c"].contains("requires authentication"),
        "{d:?}"
    );

    // The Pod's own pull secret.
    let a = review(
        &adm,
        pod_review(serde_json::json!({
            "imagePullSecrets": [{"name": "regcred"}, {"name": "missing"}],
            "containers": [{"name": "c", "image": image}]
        })),
    )
    .await;
    assert_eq!(a.image("containers", 0), mirrored);
    let repo = format!("mirror/127.0.0.1_{}/private/app", src.port());
    let (bytes, _, _) = dst.get_manifest(&repo, &app.digest).await.expect("copied");
    assert!(bytes == app.manifest);
    let text = a.pod.to_string();
    assert!(
        !text.contains("Pull-Secret-77"),
        "secret leaked into the Pod"
    );

    // The ServiceAccount's pull secret, for an image no cache has seen.
    let other_img = Image::oci(1, 502);
    push_image(&src, "private/other", Some("v1"), &other_img).await;
    let other = format!("{}/private/other:v1", src.host());
    let a = review(
        &adm,
        pod_review(serde_json::json!({
            "serviceAccountName": "builder",
            "containers": [{"name": "c", "image": other}]
        })),
    )
    .await;
    let want = format!(
        "{}/mirror/127.0.0.1_{}/private/other:v1@{}",
        dst.host(),
        src.port(),
        other_img.digest
    );
    assert_eq!(a.image("containers", 0), want);
    assert!(
        src.token_server().log().iter().any(|t| t.granted
            && t.user.as_deref() == Some("puller")
            && t.scopes
                .iter()
                .any(|s| s == "repository:private/other:pull")),
        "read with the ServiceAccount's secret: {:?}",
        src.token_server().log()
    );

    // An empty request.namespace (k8s-image-swapper's sample review): the
    // Pod's own metadata.namespace is where its secrets are read.
    let third = Image::oci(1, 503);
    push_image(&src, "private/third", Some("v1"), &third).await;
    let image3 = format!("{}/private/third:v1", src.host());
    let mut v: Value = serde_json::from_slice(&pod_review(serde_json::json!({
        "imagePullSecrets": [{"name": "regcred"}],
        "containers": [{"name": "c", "image": image3}]
    })))
    .unwrap();
    v["request"]["namespace"] = Value::String(String::new());
    let a = review(&adm, bytes::Bytes::from(serde_json::to_vec(&v).unwrap())).await;
    assert_eq!(
        a.image("containers", 0),
        format!(
            "{}/mirror/127.0.0.1_{}/private/third:v1@{}",
            dst.host(),
            src.port(),
            third.digest
        ),
        "{:?}",
        a.annotation("pinswap.dev/decisions")
    );
    assert!(
        kube.requests()
            .iter()
            .any(|r| r.path.contains("/namespaces/shop/secrets/regcred")),
        "{:?}",
        kube.requests()
    );
    // The API calls were reads of secrets and service accounts only.
    for r in kube.requests() {
        assert_eq!(r.method, "GET", "{r:?}");
        assert!(
            r.path.contains("/secrets/") || r.path.contains("/serviceaccounts/"),
            "{r:?}"
        );
    }
}

/// A rotated target password (a Secret updated in place, a credential
/// helper's new token) is picked up by `refresh_credentials` without a
/// restart: the connected client is dropped and signs in again with it.
/// The file is a Secret volume's: `password` -> `..data/password`, and an
/// update swaps the `..data` symlink, as the kubelet does. The second
/// rotation is picked up by the periodic loop `serve` runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_target_credentials_are_read_again() {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("mirror", "Token-1").await;
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 950)).await;
    push_image(&src, "shop/web", Some("v1"), &Image::oci(1, 951)).await;
    push_image(&src, "shop/api", Some("v1"), &Image::oci(1, 952)).await;
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("password");
    // The kubelet's atomic writer: a new timestamped directory, then a
    // rename of a fresh `..data` symlink over the old one.
    let publish = |version: &str, secret: &str| {
        let data = dir.path().join(format!("..{version}"));
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("password"), format!("{secret}\n")).unwrap();
        let tmp = dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
        std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
    };
    publish("v1", "Token-1");
    std::os::unix::fs::symlink("..data/password", &password).unwrap();
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\", auth: {{username: mirror, passwordFile: {}}}}}\n\
             source: {{registries: [{{registry: \"{}\"}}]}}\ncopyPolicy: immediate\n\
             copyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery: {{enabled: false}}\n",
            dst.host(),
            password.display(),
            src.host()
        ),
        "test.yaml",
    )
    .unwrap();
    let adm = Admission::from_config(&c, Arc::new(Metrics::new())).unwrap();
    let admit = |repo: &str| {
        let pod = common::review::pod(
            "shop",
            repo,
            &[("app", &format!("{}/shop/{repo}:v1", src.host()))],
        );
        let adm = &adm;
        async move {
            let (p, _) = common::review::admit(adm, &pod).await;
            let d: BTreeMap<String, String> = serde_json::from_str(
                p["metadata"]["annotations"]["pinswap.dev/decisions"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            d["containers/app"].clone()
        }
    };

    // Signed in and working; then the registry's password rotates.
    assert_eq!(admit("app").await, "rewritten: copied to the target");
    dst.token_server().set_password("Token-2");
    let stale = admit("web").await;
    assert!(
        stale.starts_with("unchanged (error)") && stale.contains("401"),
        "{stale}"
    );
    assert_eq!(
        adm.mirror().refresh_credentials().await,
        0,
        "the file has not changed"
    );

    publish("v2", "Token-2");
    assert_eq!(adm.mirror().refresh_credentials().await, 1);
    assert_eq!(
        adm.mirror().refresh_credentials().await,
        0,
        "one change, counted once"
    );
    assert_eq!(admit("web").await, "rewritten: copied to the target");

    // The periodic refresh (serve runs it every 5 minutes; here 100 ms).
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(
        adm.mirror()
            .clone()
            .refresh_credentials_every(Duration::from_millis(100), stop.clone()),
    );
    dst.token_server().set_password("Token-3");
    publish("v3", "Token-3");
    let mut last = String::new();
    for _ in 0..50 {
        last = admit("api").await;
        if last == "rewritten: copied to the target" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    assert_eq!(last, "rewritten: copied to the target");
}

/// Credentials are kept to their side: the configured source credentials
/// and those of a Pod's pull secret (which also names the target, with
/// someone else's credentials) reach their sources only. Every registry is
/// htpasswd over plain HTTP behind a recording front, so each request's
/// `Authorization` says whose credentials it carries: at the target, only
/// the target's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_and_pull_secret_credentials_never_reach_the_target() {
    use common::front::Front;
    common::init();
    let (src, private, dst) = (
        TestRegistry::plain_auth("puller", "Source-Secret-1").await,
        TestRegistry::plain_auth("secret-user", "Pull-Secret-2").await,
        TestRegistry::plain_auth("mirror", "Target-Secret-3").await,
    );
    let (sf, pf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&private.host()).await,
        Front::start(&dst.host()).await,
    );
    let (app, own) = (Image::oci(2, 961), Image::oci(2, 962));
    push_image(&src, "shop/app", Some("v1"), &app).await;
    push_image(&private, "private/app", Some("v1"), &own).await;
    let kube = common::kube::KubeApi::start().await;
    // The Pod's pull secret: the private source, and the target too.
    let auths = serde_json::json!({"auths": {
        pf.host(): {"username": "secret-user", "password": "Pull-Secret-2"},
        tf.host(): {"username": "intruder", "password": "Pull-Secret-4"},
    }});
    let mut secret =
        common::kube::dockerconfigjson_secret("regcred", &pf.host(), "secret-user", "x");
    secret.data = Some(
        [(
            ".dockerconfigjson".to_owned(),
            k8s_openapi::ByteString(auths.to_string().into_bytes()),
        )]
        .into(),
    );
    kube.put_secret("shop", secret);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let c = Config::from_yaml(
        &format!(
            "target: {{registry: \"{}/mirror\", auth: {{username: mirror, passwordFile: {}}}}}\n\
             source:\n  registries:\n  - {{registry: \"{}\", auth: {{username: puller, passwordFile: {}}}}}\n  \
             - {{registry: \"{}\"}}\n  imagePullSecrets: true\n\
             copyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\nrecovery: {{enabled: false}}\n",
            tf.host(),
            file("target-password", "Target-Secret-3\n"),
            sf.host(),
            file("source-password", "Source-Secret-1\n"),
            pf.host(),
        ),
        "test.yaml",
    )
    .unwrap();
    kube.authorize_install(&c, pinswap::install::manifests::Tls::CertManager);
    let adm = Admission::from_config(&c, Arc::new(Metrics::new()))
        .unwrap()
        .with_pull_secrets(kube.client());
    let mut pod = common::review::pod(
        "shop",
        "web",
        &[
            ("app", &format!("{}/shop/app:v1", sf.host())),
            ("own", &format!("{}/private/app:v1", pf.host())),
        ],
    );
    pod["spec"]["imagePullSecrets"] = serde_json::json!([{"name": "regcred"}]);
    let (patched, _) = common::review::admit(&adm, &pod).await;
    for (i, (front, repo, img)) in [(&sf, "shop/app", &app), (&pf, "private/app", &own)]
        .into_iter()
        .enumerate()
    {
        let mirrored = format!("mirror/{}/{repo}", front.host().replace(':', "_"));
        assert_eq!(
            patched["spec"]["containers"][i]["image"],
            format!("{}/{mirrored}:v1@{}", tf.host(), img.digest),
            "{patched}"
        );
        let (bytes, _, _) = dst.get_manifest(&mirrored, "v1").await.expect("copied");
        assert!(bytes == img.manifest, "{repo}");
    }

    // Each source was read with its own credentials (else this test would
    // prove nothing about them)...
    assert_eq!(
        sf.credentials_sent(),
        [common::basic_auth("puller", "Source-Secret-1")]
    );
    assert_eq!(
        pf.credentials_sent(),
        [common::basic_auth("secret-user", "Pull-Secret-2")]
    );
    // ...and the target saw only its own, on every request that carried any,
    // the pushes among them.
    assert_eq!(
        tf.credentials_sent(),
        [common::basic_auth("mirror", "Target-Secret-3")]
    );
    let pushes = tf
        .authorizations()
        .into_iter()
        .filter(|(m, p, a)| m == "PUT" && p.contains("/manifests/") && a.is_some())
        .count();
    assert_eq!(pushes, 2, "{:?}", tf.authorizations());
}
