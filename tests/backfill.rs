//! The backfill: images that Pods created before pinswap (or admitted
//! while it failed open) and workload templates name are mirrored by the
//! leader, as admission would mirror them, without touching the Pods. Real
//! registries and the in-process Kubernetes API server, with the install's
//! RBAC enforced.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixtures::Image;
use common::kube::KubeApi;
use common::review::pod;
use common::tenants;
use common::{FAST_RECOVERY as FAST, TestRegistry, eventually, push_image};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::Pod;
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::watch::Background;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// `sources` are the allowlist's registries; `extra` more top-level keys.
fn config(dst: &TestRegistry, sources: &[&TestRegistry], extra: &str) -> Config {
    config_with(dst, sources, "", extra)
}

/// As [`config`], with more `source` keys (`source` lines, indented).
fn config_with(dst: &TestRegistry, sources: &[&TestRegistry], source: &str, extra: &str) -> Config {
    let registries: Vec<String> = sources
        .iter()
        .map(|s| format!("{{registry: \"{}\"}}", s.host()))
        .collect();
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{}]\n{source}cache: {{reverify: 0s}}\n{FAST}{extra}",
        dst.host(),
        registries.join(", ")
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

/// An image in `src` as `shop/<name>:v1`, and where it mirrors to.
struct Pushed {
    image: Image,
    source: String,
    repo: String,
}

async fn push(src: &TestRegistry, name: &str, seed: u64) -> Pushed {
    let image = Image::oci(2, seed);
    push_image(src, &format!("shop/{name}"), Some("v1"), &image).await;
    Pushed {
        source: format!("{}/shop/{name}:v1", src.host()),
        repo: format!("mirror/127.0.0.1_{}/shop/{name}", src.port()),
        image,
    }
}

/// The target serves the image: tag → same digest, the same manifest
/// bytes, every layer and the config byte for byte.
async fn mirrored(dst: &TestRegistry, img: &Pushed) -> bool {
    if dst.head_manifest(&img.repo, "v1").await.as_deref() != Some(img.image.digest.as_str()) {
        return false;
    }
    for b in img.image.blobs() {
        if dst.blob(&img.repo, &b.digest).await.as_deref() != Some(b.bytes.as_slice()) {
            return false;
        }
    }
    let (bytes, _, _) = dst.get_manifest(&img.repo, "v1").await.unwrap();
    bytes == img.image.manifest
}

fn store_pod(api: &KubeApi, p: &Value) -> Pod {
    api.apply_pod(serde_json::from_value::<Pod>(p.clone()).unwrap())
}

fn cron_job(ns: &str, name: &str, image: &str) -> CronJob {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {"spec": {
            "restartPolicy": "OnFailure",
            "containers": [{"name": "job", "image": image}]
        }}}}}
    }))
    .unwrap()
}

fn deployment(ns: &str, name: &str, image: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": name}}, "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "app", "image": image}]}
        }}
    }))
    .unwrap()
}

/// One replica's background work, against `api` with the install's RBAC.
struct Replica {
    metrics: Arc<Metrics>,
    bg: Background,
}

impl Replica {
    fn start(config: &Config, api: &KubeApi) -> Replica {
        let metrics = Arc::new(Metrics::new());
        let adm = Admission::from_config(config, metrics.clone()).unwrap();
        api.authorize_install(config, pinswap::install::manifests::Tls::CertManager);
        let bg = Background::start(
            adm.mirror().clone(),
            config,
            Some(api.install_client()),
            CancellationToken::new(),
        );
        Replica { metrics, bg }
    }

    fn backfilled(&self, state: &str) -> f64 {
        common::metrics::sample(
            &self.metrics.encode(),
            "pinswap_backfill_images",
            &[("state", state)],
        )
        .unwrap_or(0.0)
    }
}

/// Pods that ran before pinswap, and a CronJob between its runs: their
/// images reach the target byte for byte; an image outside the allowlist
/// and one already under the target are left alone; the Pods are not
/// touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_pods_and_a_cron_jobs_template_are_mirrored_and_nothing_else() {
    common::init();
    let (src, other, dst) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        TestRegistry::plain().await,
    );
    let api = KubeApi::start().await;
    let app = push(&src, "app", 7101).await;
    let side = push(&src, "side", 7102).await;
    let job = push(&src, "job", 7103).await;
    let outside = push(&other, "outside", 7104).await;
    let before = store_pod(
        &api,
        &pod(
            "shop",
            "web",
            &[("app", &app.source), ("side", &side.source)],
        ),
    );
    store_pod(&api, &pod("shop", "web-2", &[("app", &app.source)]));
    store_pod(&api, &pod("shop", "stray", &[("app", &outside.source)]));
    api.apply_object(cron_job("shop", "nightly", &job.source));

    let cfg = config(&dst, &[&src], "");
    let r = Replica::start(&cfg, &api);
    for img in [&app, &side, &job] {
        eventually(
            &format!("{} mirrored", img.source),
            Duration::from_secs(20),
            || mirrored(&dst, img),
        )
        .await;
    }
    eventually("three copied", Duration::from_secs(5), || async {
        r.backfilled("copied") == 3.0
    })
    .await;
    assert_eq!(r.backfilled("failed"), 0.0);
    assert_eq!(r.backfilled("pending"), 0.0);
    let catalog = dst.catalog().await;
    assert!(
        !catalog.iter().any(|c| c.contains("outside")),
        "outside the allowlist: {catalog:?}"
    );
    assert_eq!(catalog.len(), 3, "{catalog:?}");
    // Never restarted or patched: the Pod is as it was stored.
    let now = api.pod("shop", "web").unwrap();
    assert_eq!(
        now.metadata.resource_version,
        before.metadata.resource_version
    );
    assert_eq!(now.spec, before.spec);
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.bg.stop().await;
}

/// After the first pass, a new workload naming a new image is mirrored
/// from the watch; a Pod naming one of the first pass's images again
/// costs no copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deployment_is_backfilled_from_the_watch() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let app = push(&src, "app", 7201).await;
    let next = push(&src, "next", 7202).await;
    store_pod(&api, &pod("shop", "web", &[("app", &app.source)]));
    let cfg = config(&dst, &[&src], "");
    let r = Replica::start(&cfg, &api);
    eventually("first pass", Duration::from_secs(20), || {
        mirrored(&dst, &app)
    })
    .await;
    api.apply_object(deployment("shop", "next", &next.source));
    eventually("the Deployment's image", Duration::from_secs(20), || {
        mirrored(&dst, &next)
    })
    .await;
    store_pod(&api, &pod("shop", "web-2", &[("app", &app.source)]));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(r.backfilled("copied"), 2.0);
    assert_eq!(
        common::metrics::sample(&r.metrics.encode(), "pinswap_copies_started_total", &[])
            .unwrap_or(0.0),
        2.0,
        "one copy per image"
    );
    r.bg.stop().await;
}

/// The source is down during the first pass: the image waits (pending),
/// and is mirrored once the source answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_down_during_a_pass_is_backfilled_once_it_returns() {
    common::init();
    let (mut src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let app = push(&src, "app", 7301).await;
    store_pod(&api, &pod("shop", "web", &[("app", &app.source)]));
    src.kill();
    let cfg = config_with(
        &dst,
        &[&src],
        "  breaker: {backoff: 1s, maxBackoff: 2s}\n",
        "",
    );
    let r = Replica::start(&cfg, &api);
    eventually("pending while down", Duration::from_secs(20), || async {
        r.backfilled("pending") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(dst.catalog().await.is_empty());
    src.restart().await;
    eventually("mirrored once back", Duration::from_secs(30), || {
        mirrored(&dst, &app)
    })
    .await;
    eventually("counted as copied", Duration::from_secs(5), || async {
        r.backfilled("copied") == 1.0 && r.backfilled("pending") == 0.0
    })
    .await;
    r.bg.stop().await;
}

/// With `extra` config keys, a running Pod and a CronJob: nothing is copied
/// and no workload is watched (the install grants no workload RBAC then).
async fn backfill_does_not_run(extra: &str, seed: u64) {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let app = push(&src, "app", seed).await;
    store_pod(&api, &pod("shop", "web", &[("app", &app.source)]));
    api.apply_object(cron_job("shop", "nightly", &app.source));
    let cfg = config(&dst, &[&src], extra);
    let r = Replica::start(&cfg, &api);
    eventually(
        "leading and watching Pods",
        Duration::from_secs(10),
        || async { r.bg.is_leader() && api.open_watches() > 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(dst.catalog().await.is_empty(), "{:?}", dst.catalog().await);
    assert!(
        !api.requests().iter().any(|q| q.path.contains("cronjobs")),
        "no workload watch"
    );
    assert!(r.bg.usage().is_none());
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.bg.stop().await;
}

/// `backfill: {enabled: false}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_off_copies_nothing() {
    backfill_does_not_run("backfill: {enabled: false}\n", 7401).await;
}

/// `copyPolicy: none` copies nothing, so the backfill (on by default) does
/// not copy either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_policy_none_backfills_nothing() {
    backfill_does_not_run("copyPolicy: none\n", 7411).await;
}

/// The webhook is never sent Pods in pinswap's own namespace, in
/// kube-system, in a namespace labelled `pinswap.dev/ignore=true`, or
/// labelled so themselves: the backfill leaves what those name alone too,
/// templates included, and reads none of their pull secrets. Only the
/// image of the Pod in the scope is mirrored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backfill_keeps_to_the_webhooks_scope() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let web = push(&src, "web", 7601).await;
    let out: Vec<Pushed> = futures::future::join_all(
        ["system", "own", "quiet", "opted", "quiet-job", "opted-tpl"]
            .iter()
            .enumerate()
            .map(|(i, n)| push(&src, n, 7602 + i as u64)),
    )
    .await;
    api.apply_namespace("quiet", &[("pinswap.dev/ignore", "true")]);
    let with_secret =
        |ns: &str, name: &str, image: &str| tenants::pod(ns, name, image, &["regcred"], None);
    for (ns, name, img) in [
        ("shop", "web", &web),
        ("kube-system", "dns", &out[0]),
        ("pinswap", "agent", &out[1]),
        ("quiet", "q", &out[2]),
    ] {
        store_pod(&api, &with_secret(ns, name, &img.source));
    }
    let mut opted = with_secret("shop", "opted", &out[3].source);
    opted["metadata"]["labels"] = json!({"pinswap.dev/ignore": "true"});
    store_pod(&api, &opted);
    api.apply_object(cron_job("quiet", "nightly", &out[4].source));
    let mut tpl = deployment("shop", "opted-tpl", &out[5].source);
    let t = tpl
        .spec
        .as_mut()
        .unwrap()
        .template
        .metadata
        .as_mut()
        .unwrap();
    t.labels
        .get_or_insert_default()
        .insert("pinswap.dev/ignore".into(), "true".into());
    api.apply_object(tpl);

    let cfg = config_with(&dst, &[&src], "  imagePullSecrets: true\n", "");
    let r = Replica::start(&cfg, &api);
    eventually(
        "the Pod's image in the scope",
        Duration::from_secs(20),
        || mirrored(&dst, &web),
    )
    .await;
    eventually("the first pass done", Duration::from_secs(20), || async {
        r.backfilled("copied") >= 1.0 && r.backfilled("pending") == 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(dst.catalog().await, [web.repo.as_str()]);
    assert_eq!(r.backfilled("copied"), 1.0);
    let read: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|q| q.path.contains("/secrets") || q.path.contains("/serviceaccounts"))
        .map(|q| q.path)
        .collect();
    assert!(
        read.contains(&"/api/v1/namespaces/shop/secrets/regcred".to_owned())
            && read
                .iter()
                .all(|p| p.starts_with("/api/v1/namespaces/shop/")),
        "only the pull secrets of the Pod in the scope: {read:?}"
    );
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.bg.stop().await;
}

/// The config's `scope` narrows it further (the same selectors as the
/// webhook's), and namespaces' labels are followed as they change: a
/// namespace given the label its `namespaceSelector` asks for has its
/// images backfilled then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backfill_follows_the_configs_scope_as_namespace_labels_change() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let on = push(&src, "on", 7701).await;
    let later = push(&src, "later", 7702).await;
    api.apply_namespace("lit", &[("mirror", "enabled")]);
    api.apply_namespace("dark", &[]);
    store_pod(&api, &pod("lit", "a", &[("app", &on.source)]));
    api.apply_object(deployment("dark", "b", &later.source));
    let cfg = config(
        &dst,
        &[&src],
        "scope: {namespaceSelector: {matchLabels: {mirror: enabled}}}\n",
    );
    let r = Replica::start(&cfg, &api);
    eventually("the first pass done", Duration::from_secs(20), || async {
        r.backfilled("copied") == 1.0 && r.backfilled("pending") == 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(dst.catalog().await, [on.repo.as_str()]);
    api.apply_namespace("dark", &[("mirror", "enabled")]);
    eventually("dark's template image", Duration::from_secs(20), || {
        mirrored(&dst, &later)
    })
    .await;
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.bg.stop().await;
}

/// With `source.imagePullSecrets`, a private image is copied only with the
/// credentials of a Pod that proves access: not for a Pod without them,
/// then with the secret of a Pod that has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_image_is_backfilled_only_with_a_proving_pods_credentials() {
    common::init();
    let (user, password) = ("team-a", "A-pull-secret-1");
    let private = TestRegistry::token_auth(user, password).await;
    let dst = TestRegistry::plain().await;
    let api = KubeApi::start().await;
    let image = Image::oci(2, 7501);
    push_image(&private, "private/app", Some("v1"), &image).await;
    let app = Pushed {
        source: format!("{}/private/app:v1", private.host()),
        repo: format!("mirror/127.0.0.1_{}/private/app", private.port()),
        image,
    };
    tenants::pull_secret(&api, "team-a", "regcred", &private.host(), user, password).await;
    tenants::pull_secret(&api, "team-b", "wrong", &private.host(), user, "guessed").await;
    store_pod(
        &api,
        &tenants::pod("team-b", "b", &app.source, &["wrong"], None),
    );
    let cfg = config_with(&dst, &[&private], "  imagePullSecrets: true\n", "");
    let r = Replica::start(&cfg, &api);
    eventually("denied", Duration::from_secs(20), || async {
        r.backfilled("denied") == 1.0
    })
    .await;
    assert!(dst.catalog().await.is_empty(), "not copied without a proof");
    let tokens = private.token_server().requests();
    store_pod(
        &api,
        &tenants::pod("team-a", "a", &app.source, &["regcred"], None),
    );
    eventually("copied with A's secret", Duration::from_secs(20), || {
        mirrored(&dst, &app)
    })
    .await;
    assert!(
        !private.token_server().log()[tokens..]
            .iter()
            .any(|t| t.granted && t.user.as_deref() != Some(user)),
        "nothing but A's secret was granted access"
    );
    assert_eq!(r.backfilled("copied"), 1.0);
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.bg.stop().await;
}

/// The figures in docs/benchmarks.md ("Backfill"): `pinswap serve` (the
/// test profile's build) against the in-process API server holding
/// `BENCH_PODS` Pods (default 10,000) in 20 namespaces that share
/// `BENCH_IMAGES` images (default 500) of a real source registry, none at
/// the target. Reports the time from start until every image is copied,
/// and the process's peak RSS. Run with `scripts/bench-backfill.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test; scripts/bench-backfill.sh runs it"]
async fn backfill_pass_figures() {
    let env_or = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .map_or(d, |v| v.parse().expect("a count"))
    };
    let (pods, images) = (env_or("BENCH_PODS", 10_000), env_or("BENCH_IMAGES", 500));
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let api = KubeApi::start().await;
    let mut sources = Vec::new();
    for i in 0..images {
        let img = Image::oci(1, 9000 + i as u64);
        push_image(&src, &format!("team/app{i}"), Some("v1"), &img).await;
        sources.push(format!("{}/team/app{i}:v1", src.host()));
    }
    for i in 0..pods {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("web-7d9f8c6b5-{i:06}"), "namespace": format!("team-{}", i % 20),
                "uid": format!("00000000-0000-0000-0000-{i:012}"),
                "labels": {"app": "web", "pod-template-hash": "7d9f8c6b5"}},
            "spec": {"containers": [{"name": "app", "image": sources[i % images]}],
                "serviceAccountName": "web", "imagePullSecrets": [{"name": "regcred"}]},
            "status": {"phase": "Running"},
        }))
        .unwrap();
        api.apply_pod(p);
    }
    let dir = tempfile::tempdir().unwrap();
    let kc = api.kubeconfig(dir.path());
    let body = format!(
        "target: {{registry: \"{}/mirror\", insecure: true}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n\
         cache: {{reverify: 0s}}\nidentity: {{scanRate: 0}}\nreferrers: false\n",
        dst.host(),
        src.host()
    );
    let env = [
        ("KUBECONFIG", kc.to_str().unwrap()),
        ("POD_NAMESPACE", "pinswap"),
    ];
    let t = Instant::now();
    let served = common::serve::Served::start_with(&body, "", &env, None).await;
    let scrape = reqwest::Client::builder().no_proxy().build().unwrap();
    let metrics = format!("http://{}/metrics", served.health);
    loop {
        let text = scrape
            .get(&metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let copied =
            common::metrics::sample(&text, "pinswap_backfill_images", &[("state", "copied")]);
        if copied == Some(images as f64) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "not done: {copied:?}: {}",
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let done = t.elapsed();
    let hwm = served.status_kib("VmHWM");
    let rss = served.status_kib("VmRSS");
    assert_eq!(dst.catalog().await.len(), images);
    let pass = served
        .log_text()
        .lines()
        .find(|l| l.contains("backfill: first pass done"))
        .map(str::to_owned)
        .unwrap_or_default();
    println!(
        "backfill: {pods} Pods, {images} images, all copied {:.1} s after start, RSS {:.1} MiB (peak {:.1} MiB); {pass}",
        done.as_secs_f64(),
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
    );
}

/// `visibility: private`: the config's own credentials read the image,
/// but only a Pod's proof lets the backfill copy it. A Pod without a
/// secret leaves it alone; then one with its own secret proves access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_private_needs_a_pods_proof_even_when_the_config_reads_it() {
    common::init();
    let (user, password) = ("team-a", "A-pull-secret-1");
    let private = TestRegistry::token_auth(user, password).await;
    let dst = TestRegistry::plain().await;
    let api = KubeApi::start().await;
    let image = Image::oci(2, 7601);
    push_image(&private, "private/app", Some("v1"), &image).await;
    let app = Pushed {
        source: format!("{}/private/app:v1", private.host()),
        repo: format!("mirror/127.0.0.1_{}/private/app", private.port()),
        image,
    };
    tenants::pull_secret(&api, "team-a", "regcred", &private.host(), user, password).await;
    store_pod(&api, &tenants::pod("team-b", "b", &app.source, &[], None));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, password).unwrap();
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\", auth: {{username: {user}, passwordFile: \"{}\"}}, visibility: private}}]\n  imagePullSecrets: true\ncache: {{reverify: 0s}}\n{FAST}",
        dst.host(),
        private.host(),
        file.display()
    );
    let cfg = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let r = Replica::start(&cfg, &api);
    eventually("denied", Duration::from_secs(20), || async {
        r.backfilled("denied") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        dst.catalog().await.is_empty(),
        "not copied with the config's credentials alone"
    );
    store_pod(
        &api,
        &tenants::pod("team-a", "a", &app.source, &["regcred"], None),
    );
    eventually(
        "copied once a Pod proves access",
        Duration::from_secs(20),
        || mirrored(&dst, &app),
    )
    .await;
    assert_eq!(r.backfilled("denied"), 0.0);
    r.bg.stop().await;
}

/// An image the target holds is found there with one HEAD, and not read:
/// the backfill checks the identity of what it copies only, so a replica
/// that takes over a cluster whose images are all mirrored keeps no
/// identity facts for them. A tag and a digest, each with and without the
/// source's tag.
#[tokio::test]
async fn an_image_the_target_holds_is_backfilled_without_reading_it() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let front = common::front::Front::start(&dst.host()).await;
    let img = push(&src, "held", 611).await;
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\nreferrers: false\n",
        front.host(),
        src.host()
    );
    let cfg = Config::from_yaml(&yaml, "t.yaml").unwrap();
    let replica = || Admission::from_config(&cfg, Arc::new(Metrics::new())).unwrap();
    let by_tag = pinswap::reference::Reference::parse(&img.source).unwrap();
    let by_digest = by_tag.with_digest(img.image.digest.parse().unwrap());
    let first = replica();
    let copied = first.mirror().backfill(&by_tag, &[]).await.unwrap();
    assert!(
        matches!(copied, pinswap::mirror::Backfilled::Copied { .. }),
        "{copied:?}"
    );
    assert!(mirrored(&dst, &img).await);
    for r in [&by_tag, &by_digest] {
        let fresh = replica();
        front.reset();
        let found = fresh.mirror().backfill(r, &[]).await.unwrap();
        assert_eq!(found, pinswap::mirror::Backfilled::Present, "{r}");
        // Past the API version check, a fresh client's first request.
        let asked: Vec<_> = front
            .requests()
            .into_iter()
            .filter(|(_, p)| p != "/v2/")
            .collect();
        assert!(
            asked.iter().all(|(m, _)| m == "HEAD"),
            "{r}: only HEADs at the target: {asked:#?}"
        );
        assert!(!asked.is_empty());
    }
}
