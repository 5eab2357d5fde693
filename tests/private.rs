//! Private images stay private (docs/security.md): with
//! `source.imagePullSecrets`, an image that needs a Pod's own pull secret
//! is rewritten only for Pods whose own credentials read it at the source.
//! Real registries (a bearer-token private source, a plain public one, a
//! plain target), real Secrets and ServiceAccounts in the in-process
//! Kubernetes API, Pods through `Admission::review`.
//!
//! Each scenario takes the `Objects` store it writes Secrets through and
//! the `kube::Client` pinswap reads them with, so the same cases can run
//! against a real API server.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::review::{admit, pull_failing};
use common::tenants::{self, Objects, decision, pod};
use common::{TestRegistry, push_image};
use k8s_openapi::api::core::v1::Pod;
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::Value;

const USER: &str = "team-a";
const PASSWORD: &str = "A-pull-secret-1";

/// A private source (bearer tokens for one user), a public one, a target,
/// and an image in each source.
struct Rig {
    private: TestRegistry,
    public: TestRegistry,
    dst: TestRegistry,
    app: Image,
    tool: Image,
}

impl Rig {
    async fn start() -> Rig {
        common::init();
        let private = TestRegistry::token_auth(USER, PASSWORD).await;
        let (public, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
        let app = Image::oci(2, 2501);
        push_image(&private, "private/app", Some("v1"), &app).await;
        let tool = Image::oci(1, 2502);
        push_image(&public, "tools/tool", Some("v1"), &tool).await;
        Rig {
            private,
            public,
            dst,
            app,
            tool,
        }
    }

    /// `source` lines go under `source:` (indented two spaces).
    fn config(&self, source: &str, extra: &str) -> Config {
        let yaml = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}, {{registry: \"{}\"}}]\n  imagePullSecrets: true\n{source}copyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\n{extra}",
            self.dst.host(),
            self.private.host(),
            self.public.host(),
        );
        Config::from_yaml(&yaml, "test.yaml").unwrap()
    }

    fn app(&self) -> String {
        format!("{}/private/app:v1", self.private.host())
    }
    fn app_mirrored(&self) -> String {
        format!(
            "{}/mirror/127.0.0.1_{}/private/app:v1@{}",
            self.dst.host(),
            self.private.port(),
            self.app.digest
        )
    }
    fn app_repo(&self) -> String {
        format!("mirror/127.0.0.1_{}/private/app", self.private.port())
    }
    fn tool(&self) -> String {
        format!("{}/tools/tool:v1", self.public.host())
    }
    fn tool_mirrored(&self) -> String {
        format!(
            "{}/mirror/127.0.0.1_{}/tools/tool:v1@{}",
            self.dst.host(),
            self.public.port(),
            self.tool.digest
        )
    }

    /// The app's manifest at the target is the source's, byte for byte.
    async fn assert_app_copied(&self) {
        let (bytes, _, _) = self
            .dst
            .get_manifest(&self.app_repo(), &self.app.digest)
            .await
            .expect("copied");
        assert!(bytes == self.app.manifest);
    }

    /// Team A: `regcred` reads the private source. Team B: `wrong` is
    /// refused by it; `own` is B's own valid secret, on ServiceAccount
    /// `builder`.
    async fn tenants(&self, store: &impl Objects) {
        let host = self.private.host();
        tenants::pull_secret(store, "team-a", "regcred", &host, USER, PASSWORD).await;
        tenants::pull_secret(store, "team-b", "wrong", &host, USER, "guessed").await;
        tenants::pull_secret(store, "team-b", "own", &host, USER, PASSWORD).await;
        tenants::service_account(store, "team-b", "builder", &["own"]).await;
    }
}

fn handler(config: &Config, client: kube::Client) -> (Admission, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let adm = Admission::from_config(config, metrics.clone())
        .unwrap()
        .with_pull_secrets(client);
    (adm, metrics)
}

fn denials(metrics: &Metrics, reason: &str) -> f64 {
    common::metrics::sample(
        &metrics.encode(),
        "pinswap_private_image_denials_total",
        &[("reason", reason)],
    )
    .unwrap_or(0.0)
}

/// Admits `pod` and returns the patched Pod.
async fn admitted(adm: &Admission, pod: &Value) -> Value {
    admit(adm, pod).await.0
}

fn image(pod: &Value) -> &str {
    pod["spec"]["containers"][0]["image"].as_str().unwrap()
}

/// A's secret gets the rewrite; B with no secret, with a refused one, or
/// naming the digest directly does not; B with its own valid secret (on
/// its ServiceAccount) does; a public image is rewritten for everyone.
async fn only_pods_that_prove_access(r: &Rig, store: &impl Objects, client: kube::Client) {
    r.tenants(store).await;
    let (adm, metrics) = handler(&r.config("", ""), client);

    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    r.assert_app_copied().await;

    let b = admitted(&adm, &pod("team-b", "none", &r.app(), &[], None)).await;
    assert_eq!(image(&b), r.app(), "unchanged");
    let note = decision(&b);
    assert_eq!(
        note,
        format!(
            "unchanged: private image; this Pod has no pull secret for {}",
            r.private.host()
        )
    );
    // By digest the target alone could answer: still not for B.
    let by_digest = format!("{}/private/app@{}", r.private.host(), r.app.digest);
    let b = admitted(&adm, &pod("team-b", "digest", &by_digest, &[], None)).await;
    assert_eq!(image(&b), by_digest, "{}", decision(&b));
    assert!(decision(&b).contains("private image"), "{}", decision(&b));

    let b = admitted(&adm, &pod("team-b", "wrong", &r.app(), &["wrong"], None)).await;
    assert_eq!(image(&b), r.app(), "unchanged");
    assert_eq!(
        decision(&b),
        "unchanged: private image; this Pod's pull secrets are refused by the source (HTTP 401)"
    );
    assert!(
        !b.to_string().contains("guessed"),
        "no credential in the Pod"
    );

    let b = admitted(&adm, &pod("team-b", "own", &r.app(), &[], Some("builder"))).await;
    assert_eq!(image(&b), r.app_mirrored(), "{}", decision(&b));
    assert!(
        !b.to_string().contains(PASSWORD),
        "no credential in the Pod"
    );

    for (ns, name) in [("team-b", "tool"), ("team-a", "tool")] {
        let p = admitted(&adm, &pod(ns, name, &r.tool(), &[], None)).await;
        assert_eq!(image(&p), r.tool_mirrored(), "{}", decision(&p));
    }
    assert_eq!(denials(&metrics, "no_credentials"), 2.0);
    assert_eq!(denials(&metrics, "refused"), 1.0);
    assert_eq!(denials(&metrics, "unverified"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_images_go_only_to_pods_that_prove_access() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    api.authorize_install(
        &r.config("", ""),
        pinswap::install::manifests::Tls::CertManager,
    );
    // Objects go in before the install's RBAC applies to every request.
    only_pods_that_prove_access(&r, &api, api.client()).await;
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
}

/// With `visibility: private`, an image the entry's own `auth` reads is
/// private too: a Pod without a secret of its own is left unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_private_makes_images_read_with_the_configs_auth_private() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, PASSWORD).unwrap();
    let yaml = |visibility: &str| {
        format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\", auth: {{username: {USER}, passwordFile: \"{}\"}}{visibility}}}]\n  imagePullSecrets: true\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\n",
            r.dst.host(),
            r.private.host(),
            file.display()
        )
    };
    // auto: the operator's credentials make it shared.
    let c = Config::from_yaml(&yaml(""), "t.yaml").unwrap();
    let (adm, _) = handler(&c, api.client());
    let b = admitted(&adm, &pod("team-b", "none", &r.app(), &[], None)).await;
    assert_eq!(image(&b), r.app_mirrored(), "{}", decision(&b));
    // private: only a Pod's own secret.
    let c = Config::from_yaml(&yaml(", visibility: private"), "t.yaml").unwrap();
    let (adm, metrics) = handler(&c, api.client());
    let b = admitted(&adm, &pod("team-b", "none", &r.app(), &[], None)).await;
    assert_eq!(image(&b), r.app(), "{}", decision(&b));
    assert!(decision(&b).contains("no pull secret"), "{}", decision(&b));
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    assert_eq!(denials(&metrics, "no_credentials"), 1.0);
}

/// With the source down, a Pod proven within `proofGrace` is still
/// rewritten (its proof is past `proofTtl`); a Pod never proven is not,
/// even with a valid secret.
async fn outage_keeps_recent_proofs_only(r: &mut Rig, store: &impl Objects, client: kube::Client) {
    r.tenants(store).await;
    let c = r.config(
        "  proofTtl: 1s\n  proofGrace: 1h\n  timeout: 3s\n  breaker: {failures: 1, backoff: 1m}\n",
        "",
    );
    let (adm, metrics) = handler(&c, client);
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    r.private.kill();

    let a = admitted(&adm, &pod("team-a", "a2", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    // Its proof was past proofTtl: the source was asked, and could not answer.
    let open = common::metrics::sample(
        &metrics.encode(),
        "pinswap_source_breaker_open",
        &[("registry", &r.private.host())],
    );
    assert_eq!(open, Some(1.0), "the source was asked and is down");
    let b = admitted(&adm, &pod("team-b", "own", &r.app(), &[], Some("builder"))).await;
    assert_eq!(image(&b), r.app(), "unchanged");
    let note = decision(&b);
    assert!(
        note.starts_with("unchanged: private image; its source")
            && note.contains("cannot answer")
            && note.contains("in the last 1h"),
        "{note}"
    );
    let b = admitted(&adm, &pod("team-b", "none", &r.app(), &[], None)).await;
    assert_eq!(image(&b), r.app(), "{}", decision(&b));
    assert_eq!(denials(&metrics, "unverified"), 1.0);
    // Known to be private, and B has no secret at all: no need to ask.
    assert_eq!(denials(&metrics, "no_credentials"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_outage_keeps_recent_proofs_and_nothing_else() {
    let mut r = Rig::start().await;
    let api = KubeApi::start().await;
    outage_keeps_recent_proofs_only(&mut r, &api, api.client()).await;
}

/// A Secret whose content changed is proven again: the proof belongs to
/// the credentials, not to the Secret's name or the namespace alone.
async fn rotated_secret_proven_again(r: &Rig, store: &impl Objects, client: kube::Client) {
    r.tenants(store).await;
    let c = r.config("", "");
    let (adm, _) = handler(&c, client.clone());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));

    // A handler on the same mirror (its proofs) whose Secret reads are
    // fresh, as after the 30 s Secret cache.
    let again = || {
        Admission::new(&c, adm.mirror().clone(), Arc::new(Metrics::new()))
            .unwrap()
            .with_pull_secrets(client.clone())
    };
    let host = r.private.host();
    // Rotated at the source and in the Secret: proven again with the new one.
    r.private.token_server().set_password("A-pull-secret-2");
    tenants::pull_secret(store, "team-a", "regcred", &host, USER, "A-pull-secret-2").await;
    let grants = |log: &[common::token::TokenRequest]| {
        log.iter()
            .filter(|t| t.granted && t.user.as_deref() == Some(USER))
            .count()
    };
    let before = grants(&r.private.token_server().log());
    let a = admitted(&again(), &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    assert!(
        grants(&r.private.token_server().log()) > before,
        "the new secret was tried at the source"
    );
    // Replaced by one the source refuses: the earlier proofs do not count.
    tenants::pull_secret(store, "team-a", "regcred", &host, USER, "revoked").await;
    let a = admitted(&again(), &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app(), "{}", decision(&a));
    assert!(decision(&a).contains("refused"), "{}", decision(&a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_pull_secret_is_proven_again() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    rotated_secret_proven_again(&r, &api, api.client()).await;
}

/// Polls `check` every 50 ms until it holds, or panics after `timeout`.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < timeout, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn events_for(api: &KubeApi, pod: &str, reason: &str) -> Vec<Value> {
    api.events()
        .into_iter()
        .filter(|e| e["reason"] == reason && e["regarding"]["name"] == pod)
        .collect()
}

/// The recovery of a lost private image copies it with the secret of a
/// Pod that may have it: one that copied A's rewritten spec into another
/// namespace gets a refusal, and A's own failing Pod gets the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_of_a_private_image_uses_a_proven_pods_secret() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let c = r.config(
        "",
        "cache: {reverify: 0s}\nrecovery:\n  retryInitial: 300ms\n  retryMax: 2s\n  lease: {duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}\n",
    );
    let (adm, metrics) = handler(&c, api.client());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));

    api.authorize_install(&c, pinswap::install::manifests::Tls::CertManager);
    let bg = pinswap::watch::Background::start(
        adm.mirror().clone(),
        &c,
        Some(api.install_client()),
        tokio_util::sync::CancellationToken::new(),
    );
    eventually("leading and watching", Duration::from_secs(10), || async {
        bg.is_leader() && api.open_watches() > 0
    })
    .await;
    // The target loses the image.
    r.dst.delete_manifest(&r.app_repo(), &r.app.digest).await;
    assert_eq!(r.dst.head_manifest(&r.app_repo(), "v1").await, None);

    // A copy of A's rewritten Pod in team-b, without A's secret.
    let mut copied = a.clone();
    copied["metadata"]["namespace"] = "team-b".into();
    copied["metadata"]["name"] = "copied".into();
    copied["metadata"]["uid"] = "uid-team-b-copied".into();
    copied["spec"]
        .as_object_mut()
        .unwrap()
        .remove("imagePullSecrets");
    let store = |p: &Value| api.apply_pod(serde_json::from_value::<Pod>(p.clone()).unwrap());
    store(&copied);
    store(&pull_failing(&copied, "app", "ErrImagePull"));
    eventually(
        "RemirrorFailed for the copied Pod",
        Duration::from_secs(10),
        || async { !events_for(&api, "copied", "RemirrorFailed").is_empty() },
    )
    .await;
    let note = events_for(&api, "copied", "RemirrorFailed")[0]["note"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        note.contains("no Pod using it may have it: private image; this Pod has no pull secret"),
        "{note}"
    );
    assert_eq!(
        r.dst.head_manifest(&r.app_repo(), "v1").await,
        None,
        "not copied"
    );
    api.delete_pod("team-b", "copied");

    // A's own Pod fails to pull it: copied again with A's secret.
    let tokens = r.private.token_server().requests();
    store(&a);
    store(&pull_failing(&a, "app", "ErrImagePull"));
    eventually(
        "the image served again",
        Duration::from_secs(20),
        || async {
            r.dst.head_manifest(&r.app_repo(), "v1").await.as_deref() == Some(r.app.digest.as_str())
        },
    )
    .await;
    // The source refuses anonymous reads: only A's secret could copy it.
    assert!(
        !r.private.token_server().log()[tokens..]
            .iter()
            .any(|t| t.granted && t.user.as_deref() != Some(USER)),
        "nothing but A's secret was granted access"
    );
    eventually(
        "ImageRemirrored for A's Pod",
        Duration::from_secs(10),
        || async { !events_for(&api, "a", "ImageRemirrored").is_empty() },
    )
    .await;
    assert!(denials(&metrics, "no_credentials") >= 1.0);
    bg.stop().await;
}

/// Pull secrets that cannot be used are skipped, as the kubelet does, and
/// counted by reason: a malformed one, a missing one, and reads the
/// install's RBAC refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_pull_secrets_are_counted_by_reason() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let mut broken =
        common::kube::dockerconfigjson_secret("broken", &r.private.host(), USER, PASSWORD);
    broken.data = Some(
        [(
            ".dockerconfigjson".to_owned(),
            k8s_openapi::ByteString(b"{not json".to_vec()),
        )]
        .into(),
    );
    api.put_secret("team-a", broken);
    let errors = |m: &Metrics, reason: &str| {
        common::metrics::sample(
            &m.encode(),
            "pinswap_pull_secret_errors_total",
            &[("reason", reason)],
        )
        .unwrap_or(0.0)
    };
    let (adm, metrics) = handler(&r.config("", ""), api.client());
    let secrets = ["broken", "missing", "regcred"];
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &secrets, None)).await;
    assert_eq!(
        image(&a),
        r.app_mirrored(),
        "the usable secret still counts"
    );
    assert_eq!(errors(&metrics, "malformed"), 1.0);
    assert_eq!(errors(&metrics, "missing"), 1.0);
    // An install whose RBAC has no access to Secrets.
    let mut no_secrets = r.config("", "");
    no_secrets.source.image_pull_secrets = false;
    api.authorize_install(&no_secrets, pinswap::install::manifests::Tls::CertManager);
    let (adm, metrics) = handler(&r.config("", ""), api.client());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app(), "{}", decision(&a));
    assert!(errors(&metrics, "forbidden") >= 1.0);
}

/// A source wait cut short by the admission's budget is no outage: a Pod
/// proven within `proofGrace` but past `proofTtl` gets the grace when the
/// source is down, never when the budget ran out first (a Pod listing
/// enough slow images could otherwise spend it at will, and be handed a
/// revoked or newly private image).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cut_by_the_budget_is_not_an_outage() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    // `source.timeout` is longer than the budget: every wait on the
    // source is cut by the budget.
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n  imagePullSecrets: true\n  proofTtl: 1s\n  proofGrace: 1h\n  timeout: 20s\ncopyPolicy: immediate\nserver: {{admissionBudget: 3s}}\n",
        r.dst.host(),
        r.private.host(),
    );
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let (adm, metrics) = handler(&config, api.client());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    r.private.freeze();
    let a = admitted(&adm, &pod("team-a", "a2", &r.app(), &["regcred"], None)).await;
    r.private.thaw();
    assert_eq!(image(&a), r.app(), "unchanged");
    let note = decision(&a);
    assert!(
        note.starts_with("unchanged: private image; its source")
            && note.contains("could not be asked within this admission's budget"),
        "{note}"
    );
    assert_eq!(denials(&metrics, "unverified"), 1.0);
}

/// Each of a Pod's pull secrets is tried in turn: the first refused (an
/// earlier, rotated-out secret listed first) does not stop the next from
/// reading the source, and the Pod is rewritten on the one that proves
/// access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pull_secret_is_tried_in_turn() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let (adm, metrics) = handler(&r.config("", ""), api.client());
    let b = admitted(
        &adm,
        &pod("team-b", "both", &r.app(), &["wrong", "own"], None),
    )
    .await;
    assert_eq!(image(&b), r.app_mirrored(), "{}", decision(&b));
    r.assert_app_copied().await;
    assert_eq!(denials(&metrics, "refused"), 0.0);
}

/// A source that hides a private repository behind 404 (as GHCR and Docker
/// Hub do) from credentials that may not see it: the backfill takes a 404
/// as a refusal and goes on to the Pod's next pull secret, instead of
/// giving up at the first, and copies with the one that reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backfill_tries_each_pull_secret_past_a_404() {
    use base64::Engine as _;
    common::init();
    let (upstream, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(2, 2511);
    push_image(&upstream, "private/app", Some("v1"), &app).await;
    let front = common::front::Front::start(&upstream.host()).await;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    front.set(common::front::Mode::HideWithout(format!("Basic {basic}")));
    let api = KubeApi::start().await;
    let host = front.host();
    tenants::pull_secret(&api, "team-a", "old", &host, USER, "rotated-out").await;
    tenants::pull_secret(&api, "team-a", "regcred", &host, USER, PASSWORD).await;
    let source = format!("{host}/private/app:v1");
    let p: Pod =
        serde_json::from_value(pod("team-a", "a", &source, &["old", "regcred"], None)).unwrap();
    api.apply_pod(p);
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{host}\"}}]\n  imagePullSecrets: true\ncache: {{reverify: 0s}}\n{}",
        dst.host(),
        common::FAST_RECOVERY,
    );
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let metrics = Arc::new(Metrics::new());
    let adm = Admission::from_config(&config, metrics.clone()).unwrap();
    api.authorize_install(&config, pinswap::install::manifests::Tls::CertManager);
    let bg = pinswap::watch::Background::start(
        adm.mirror().clone(),
        &config,
        Some(api.install_client()),
        tokio_util::sync::CancellationToken::new(),
    );
    let repo = format!(
        "mirror/127.0.0.1_{}/private/app",
        host.rsplit_once(':').unwrap().1
    );
    common::eventually("copied", Duration::from_secs(20), || async {
        dst.get_manifest(&repo, &app.digest).await.is_some()
    })
    .await;
    let (bytes, _, _) = dst.get_manifest(&repo, &app.digest).await.unwrap();
    assert!(bytes == app.manifest);
    assert!(
        front
            .answered()
            .iter()
            .any(|(_, p, status)| *status == 404 && p.contains("/manifests/")),
        "the first secret met the 404"
    );
    bg.stop().await;
}

/// Re-verification refreshes referrers with the configured credentials
/// only, so a private image's referrers are not refreshed: they were
/// copied at admission with the proving Pod's secret, and the source would
/// refuse the configured credentials at every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_images_referrers_are_not_refreshed_without_a_pods_secret() {
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let (adm, _) = handler(&r.config("", "referrers: {enabled: true}\n"), api.client());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    // The follow after the copy, with A's secret, is done.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = r.private.token_server().requests();
    let target = pinswap::reference::Reference::parse(&r.app_mirrored()).unwrap();
    adm.mirror().refresh_referrers(&target).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let asked = &r.private.token_server().log()[before..];
    assert!(asked.is_empty(), "{asked:?}");
}

/// A node's warm set holds only what every Pod may have: the kubelet hands
/// an image it did not pull itself to any Pod that names it. The private
/// image, copied for team A with its own secret, is left out; the public
/// one goes in, pinned to the target's digest; one the target does not
/// hold is left out too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_set_holds_only_images_every_pod_may_have() {
    use pinswap::nodeconfig::warm::{Candidate, LeftOut, Publisher};
    let r = Rig::start().await;
    let api = KubeApi::start().await;
    r.tenants(&api).await;
    let (adm, _) = handler(&r.config("", ""), api.client());
    let a = admitted(&adm, &pod("team-a", "a", &r.app(), &["regcred"], None)).await;
    assert_eq!(image(&a), r.app_mirrored(), "{}", decision(&a));
    let t = admitted(&adm, &pod("team-b", "t", &r.tool(), &[], None)).await;
    assert_eq!(image(&t), r.tool_mirrored(), "{}", decision(&t));
    let publisher = Publisher::new(adm.mirror().clone(), api.client(), "pinswap", 10);
    let candidate = |s: &str, uses| Candidate {
        source: pinswap::reference::Reference::parse(s).unwrap(),
        uses,
        daemon_set: false,
    };
    let absent = format!("{}/tools/absent:v1", r.public.host());
    let (set, left) = publisher
        .choose(
            &[
                candidate(&r.app(), 5),
                candidate(&r.tool(), 1),
                candidate(&absent, 1),
            ],
            &[],
        )
        .await;
    let images: Vec<&str> = set.iter().map(|w| w.image.as_str()).collect();
    let tool = format!(
        "{}/mirror/127.0.0.1_{}/tools/tool@{}",
        r.dst.host(),
        r.public.port(),
        r.tool.digest
    );
    assert_eq!(images, [tool.as_str()]);
    assert_eq!(
        left,
        [(LeftOut::NotMirrored, 1), (LeftOut::Private, 1)].into()
    );
}
