//! `pinswap serve --self-signed`: the bootstrap converges to one Secret and
//! a matching caBundle against the in-process Kubernetes API server, across
//! replicas, renewals, resets and foreign Secrets.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime};

use common::kube::KubeApi;
use common::manifests::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use pinswap::install::self_signed::{self, CaBundle, SelfSigned};

const NS: &str = "pinswap";

/// The webhook configuration exactly as `pinswap manifests --tls
/// self-signed` prints it, stored in the test API server.
async fn install_webhook(api: &KubeApi) -> MutatingWebhookConfiguration {
    authorize(api);
    let objects = manifests(&["--tls", "self-signed"]).await;
    api.put_webhook_configuration(typed(find(
        &objects,
        "MutatingWebhookConfiguration",
        "pinswap",
    )))
}

/// The test API server answers as a cluster would for the RBAC `pinswap
/// manifests --tls self-signed` grants (recovery off, as in these tests).
fn authorize(api: &KubeApi) {
    let config = pinswap::config::Config::from_yaml(
        "target: {registry: 127.0.0.1:9/mirror}\nrecovery: {enabled: false}\n",
        "test",
    )
    .unwrap();
    api.authorize_install(&config, pinswap::install::manifests::Tls::SelfSigned);
}

fn bootstrap(api: &KubeApi, dir: &Path) -> SelfSigned {
    authorize(api);
    SelfSigned::new(
        api.client_in(NS),
        NS,
        "pinswap",
        "pinswap-tls",
        "pinswap",
        dir.join("tls.crt"),
        dir.join("tls.key"),
    )
}

fn data(secret: &Secret, key: &str) -> String {
    String::from_utf8(secret.data.as_ref().unwrap()[key].0.clone()).unwrap()
}

fn ca_bundle(api: &KubeApi) -> String {
    let config = api.webhook_configuration("pinswap").unwrap();
    let hooks = config.webhooks.unwrap();
    String::from_utf8(hooks[0].client_config.ca_bundle.clone().unwrap().0).unwrap()
}

fn posts(api: &KubeApi, path: &str) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path == path)
        .count()
}

#[tokio::test]
async fn replicas_bootstrapping_at_once_share_one_secret_and_a_matching_ca_bundle() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dirs: Vec<_> = (0..6).map(|_| tempfile::tempdir().unwrap()).collect();
    let replicas: Vec<_> = dirs.iter().map(|d| bootstrap(&api, d.path())).collect();
    let results = futures::future::join_all(replicas.iter().map(|r| r.bootstrap())).await;
    let materials: Vec<_> = results.into_iter().map(Result::unwrap).collect();

    let secret = api.secret(NS, "pinswap-tls").expect("the Secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let creates = posts(&api, "/api/v1/namespaces/pinswap/secrets");
    assert!(creates >= 2, "the replicas raced ({creates} creates)");
    for (m, dir) in materials.iter().zip(&dirs) {
        assert_eq!(
            m.cert_pem,
            data(&secret, "tls.crt"),
            "every replica uses the stored one"
        );
        assert_eq!(m.key_pem, data(&secret, "tls.key"));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("tls.crt")).unwrap(),
            m.cert_pem
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("tls.key")).unwrap(),
            m.key_pem
        );
    }
    assert_eq!(ca_bundle(&api), data(&secret, "ca.crt"));
    verify_chain(
        &data(&secret, "tls.crt"),
        &ca_bundle(&api),
        "pinswap.pinswap.svc",
    );

    // A second pass changes nothing.
    assert_eq!(replicas[0].secret().await.unwrap(), materials[0]);
    assert_eq!(
        replicas[0].patch_ca_bundle(&materials[0]).await.unwrap(),
        CaBundle::Unchanged
    );
}

/// The serving certificate chains to the CA bundle for `name`, checked by
/// rustls' own verifier, as the API server's client would.
fn verify_chain(cert_pem: &str, bundle_pem: &str, name: &str) {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(bundle_pem.as_bytes()) {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        roots.into(),
        rustls::crypto::ring::default_provider().into(),
    )
    .build()
    .unwrap();
    let leaf = CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap();
    verifier
        .verify_server_cert(
            &leaf,
            &[],
            &ServerName::try_from(name.to_owned()).unwrap(),
            &[],
            UnixTime::now(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
}

#[tokio::test]
async fn a_certificate_due_for_renewal_is_replaced_and_the_old_ca_stays_trusted() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let first = replica.bootstrap().await.unwrap();

    // Ten days left: inside the 30-day renewal window.
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    let soon = SystemTime::now() + Duration::from_secs(10 * 24 * 3600);
    secret.metadata.annotations.as_mut().unwrap().insert(
        self_signed::NOT_AFTER.into(),
        humantime::format_rfc3339_seconds(soon).to_string(),
    );
    secret
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("team".into(), "platform".into());
    api.put_secret(NS, secret);

    let renewed = replica.secret().await.unwrap();
    assert_ne!(renewed.cert_pem, first.cert_pem);
    assert!(renewed.not_after > soon + Duration::from_secs(300 * 24 * 3600));
    assert!(
        renewed.ca_pem.ends_with(&first.ca_pem),
        "the previous CA stays in the bundle"
    );
    let stored = api.secret(NS, "pinswap-tls").unwrap();
    assert_eq!(data(&stored, "tls.crt"), renewed.cert_pem);
    assert_eq!(
        stored.metadata.labels.unwrap()["team"],
        "platform",
        "others' labels kept"
    );
    verify_chain(
        &renewed.cert_pem,
        &renewed.ca_pem,
        "pinswap.pinswap.svc.cluster.local",
    );
    verify_chain(&first.cert_pem, &renewed.ca_pem, "pinswap.pinswap.svc");

    assert!(replica.write_files(&renewed).await.unwrap());
    assert!(
        !replica.write_files(&renewed).await.unwrap(),
        "unchanged files are left alone"
    );
    assert_eq!(
        replica.patch_ca_bundle(&renewed).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(ca_bundle(&api), renewed.ca_pem);
}

#[tokio::test]
async fn a_reset_ca_bundle_is_restored_and_other_webhooks_are_left_alone() {
    common::init();
    let api = KubeApi::start().await;
    let mut config = install_webhook(&api).await;
    // A second webhook in the same configuration, calling someone else.
    let mut other = config.webhooks.as_ref().unwrap()[0].clone();
    other.name = "other.example.com".into();
    other.client_config.service.as_mut().unwrap().name = "other".into();
    config.webhooks.as_mut().unwrap().insert(0, other);
    config.metadata.resource_version = None;
    api.put_webhook_configuration(config);

    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let m = replica.bootstrap().await.unwrap();
    let hooks = api
        .webhook_configuration("pinswap")
        .unwrap()
        .webhooks
        .unwrap();
    assert!(hooks[0].client_config.ca_bundle.is_none(), "not ours");
    assert_eq!(
        hooks[1].client_config.ca_bundle.as_ref().unwrap().0,
        m.ca_pem.as_bytes()
    );

    // `kubectl apply` of a manifest with an empty caBundle, say.
    let mut reset = api.webhook_configuration("pinswap").unwrap();
    reset.webhooks.as_mut().unwrap()[1].client_config.ca_bundle = None;
    api.put_webhook_configuration(reset);
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Patched
    );
    let hooks = api
        .webhook_configuration("pinswap")
        .unwrap()
        .webhooks
        .unwrap();
    assert_eq!(
        hooks[1].client_config.ca_bundle.as_ref().unwrap().0,
        m.ca_pem.as_bytes()
    );
    assert!(hooks[0].client_config.ca_bundle.is_none());
}

#[tokio::test]
async fn a_missing_webhook_configuration_does_not_stop_the_bootstrap() {
    common::init();
    let api = KubeApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let m = replica
        .bootstrap()
        .await
        .expect("serves without the webhook object");
    assert!(dir.path().join("tls.crt").exists());
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Missing
    );
    install_webhook(&api).await;
    assert_eq!(
        replica.patch_ca_bundle(&m).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(ca_bundle(&api), m.ca_pem);
}

/// Two `pinswap serve --self-signed` processes started at once, as two
/// replicas: one Secret, a matching caBundle, and both serve the stored
/// certificate over HTTPS to a client that trusts only the caBundle.
#[tokio::test]
async fn two_serve_processes_come_up_with_one_shared_certificate() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{}\"}}\n\
             users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test, namespace: {NS}}}\n\
             current-context: test\n",
            api.url()
        ),
    )
    .unwrap();
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for i in 0..2 {
        let (port, health) = (common::registry::free_port(), common::registry::free_port());
        let config = dir.path().join(format!("c{i}.yaml"));
        std::fs::write(
            &config,
            format!(
                "target: {{registry: 127.0.0.1:9/mirror, insecure: true}}\nrecovery: {{enabled: false}}\n\
                 identity: {{scanRate: 0}}\nserver: {{listen: 127.0.0.1:{port}, healthListen: 127.0.0.1:{health}}}\n"
            ),
        )
        .unwrap();
        let tls = dir.path().join(format!("tls{i}"));
        let child = tokio::process::Command::new(common::pinswap_bin())
            .args(["serve", "--self-signed", "--config"])
            .arg(&config)
            .arg("--tls-cert")
            .arg(tls.join("tls.crt"))
            .arg("--tls-key")
            .arg(tls.join("tls.key"))
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", NS)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .kill_on_drop(true)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        children.push(child);
        ports.push((port, health));
    }
    let http = common::registry::http_client(None);
    for (_, health) in &ports {
        let url = format!("http://127.0.0.1:{health}/healthz");
        let mut up = false;
        for _ in 0..100 {
            if http
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !up {
            let child = children.pop().unwrap();
            let out = child.wait_with_output().await.unwrap();
            panic!(
                "serve did not come up: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let secret = api.secret(NS, "pinswap-tls").expect("one Secret");
    let bundle = ca_bundle(&api);
    assert_eq!(bundle, data(&secret, "ca.crt"));

    let served = data(&secret, "tls.crt");
    let ca = reqwest::Certificate::from_pem(bundle.as_bytes()).unwrap();
    for (port, _) in &ports {
        // The API server calls https://pinswap.pinswap.svc:443/mutate.
        let client = reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only([ca.clone()])
            .resolve(
                "pinswap.pinswap.svc",
                std::net::SocketAddr::from(([127, 0, 0, 1], *port)),
            )
            .tls_info(true)
            .build()
            .unwrap();
        let resp = client
            .post(format!("https://pinswap.pinswap.svc:{port}/mutate"))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("TLS handshake trusting only the caBundle");
        assert_eq!(resp.status(), 400, "an empty review is refused");
        let info = resp.extensions().get::<reqwest::tls::TlsInfo>().unwrap();
        use rustls::pki_types::pem::PemObject;
        let want = rustls::pki_types::CertificateDer::from_pem_slice(served.as_bytes()).unwrap();
        assert_eq!(
            info.peer_certificate(),
            Some(want.as_ref()),
            "the stored certificate"
        );
    }
    let patches = api
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH")
        .count();
    assert!(
        (1..=2).contains(&patches),
        "one caBundle patch per replica at most: {patches}"
    );
}

#[tokio::test]
async fn a_secret_that_does_not_serve_is_replaced_and_a_foreign_one_is_named() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let replica = bootstrap(&api, dir.path());
    let good = replica.bootstrap().await.unwrap();

    // Garbage certificate, annotations still claiming a long life (a bad
    // restore, a hand edit): replaced, not served.
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    secret.data.as_mut().unwrap().insert(
        "tls.crt".into(),
        k8s_openapi::ByteString(
            b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n".to_vec(),
        ),
    );
    api.put_secret(NS, secret);
    let fresh = replica.bootstrap().await.unwrap();
    assert_ne!(fresh.cert_pem, good.cert_pem);
    verify_chain(&fresh.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
    assert_eq!(
        data(&api.secret(NS, "pinswap-tls").unwrap(), "tls.crt"),
        fresh.cert_pem
    );

    // A key that belongs to another certificate: replaced too.
    let other = self_signed::generate(&fresh.dns_names, None).unwrap();
    let mut secret = api.secret(NS, "pinswap-tls").unwrap();
    secret.data.as_mut().unwrap().insert(
        "tls.key".into(),
        k8s_openapi::ByteString(other.key_pem.into_bytes()),
    );
    api.put_secret(NS, secret);
    let again = replica.bootstrap().await.unwrap();
    assert_ne!(again.cert_pem, fresh.cert_pem);

    // An Opaque Secret of that name, made by someone else: its type cannot
    // change, so the error says what to do, and the Secret is untouched.
    let api = KubeApi::start().await;
    let opaque = Secret {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("pinswap-tls".into()),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    api.put_secret(NS, opaque);
    let e = bootstrap(&api, dir.path())
        .bootstrap()
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "Secret pinswap/pinswap-tls has type \"Opaque\"; delete it and pinswap creates its own"
    );
    assert_eq!(
        api.secret(NS, "pinswap-tls").unwrap().type_.as_deref(),
        Some("Opaque")
    );
}

/// A `kubernetes.io/tls` Secret of that name that pinswap did not make
/// (cert-manager's, one a person created) is never overwritten, even when
/// its certificate does not serve: the error says so and what to do.
#[tokio::test]
async fn a_tls_secret_pinswap_did_not_make_is_never_overwritten() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let theirs = self_signed::generate(&["someone-else.example".to_owned()], None).unwrap();
    let foreign = Secret {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("pinswap-tls".into()),
            annotations: Some(
                [(
                    "cert-manager.io/certificate-name".to_owned(),
                    "pinswap".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(
            [
                (
                    "tls.crt".to_owned(),
                    k8s_openapi::ByteString(theirs.cert_pem.clone().into_bytes()),
                ),
                (
                    "tls.key".to_owned(),
                    k8s_openapi::ByteString(theirs.key_pem.clone().into_bytes()),
                ),
            ]
            .into(),
        ),
        ..Default::default()
    };
    api.put_secret(NS, foreign.clone());
    let e = bootstrap(&api, dir.path())
        .bootstrap()
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("pinswap did not make it"), "{e}");
    let after = api.secret(NS, "pinswap-tls").unwrap();
    assert_eq!(after.data, foreign.data);
    assert_eq!(after.metadata.annotations, foreign.metadata.annotations);
}

#[tokio::test]
async fn a_replica_with_older_material_never_drops_a_newer_ca() {
    common::init();
    let api = KubeApi::start().await;
    install_webhook(&api).await;
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (bootstrap(&api, da.path()), bootstrap(&api, db.path()));
    let old = a.bootstrap().await.unwrap();
    // A renews (the bundle becomes new CA + old CA); B still holds `old`.
    let renewed = self_signed::generate(&old.dns_names, Some(&old)).unwrap();
    assert_eq!(
        a.patch_ca_bundle(&renewed).await.unwrap(),
        CaBundle::Patched
    );
    assert_eq!(b.patch_ca_bundle(&old).await.unwrap(), CaBundle::Unchanged);
    assert_eq!(ca_bundle(&api), renewed.ca_pem, "B left A's bundle alone");
    verify_chain(&renewed.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
    verify_chain(&old.cert_pem, &ca_bundle(&api), "pinswap.pinswap.svc");
}
