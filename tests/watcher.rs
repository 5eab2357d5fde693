//! The Pod watcher: expired history, closed watches, bookmarks, the first
//! list, only the configured namespaces, and only the webhook's scope.

mod common;

use std::time::Duration;

use common::kube::KubeApi;
use common::recovery::*;
use common::review::{admit, pod, pull_failing};

/// Cluster-wide Pod watch requests (`watch=true`) so far, but for the
/// streamed lists the test API server refuses, as kube-apiserver without
/// WatchList does (the watchers then list in pages).
fn pod_watches(api: &KubeApi) -> Vec<common::kube::ApiRequest> {
    api.requests()
        .into_iter()
        .filter(|q| {
            q.path == "/api/v1/pods"
                && q.query.contains("watch=true")
                && !q.query.contains("sendInitialEvents")
        })
        .collect()
}

/// The value of `key` in a recorded request's query.
fn query_param(q: &common::kube::ApiRequest, key: &str) -> Option<String> {
    q.query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

#[tokio::test]
async fn the_watcher_survives_expired_history_and_closed_watches() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 451).await;
    let mut cfg = config(&src, &dst, "{reverify: 0s}");
    // The Pod watch alone: no workload watches beside it.
    cfg.backfill.enabled = false;
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually("the watcher watches", Duration::from_secs(10), || async {
        api.open_watches() == 1
    })
    .await;
    // The history moves past what the watch has seen (Lease renewals; no
    // Pod changes), so resuming from its resourceVersion needs that history.
    let watched: u64 = query_param(&pod_watches(&api)[0], "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    eventually(
        "a newer resourceVersion",
        Duration::from_secs(10),
        || async { api.resource_version().parse::<u64>().unwrap() > watched },
    )
    .await;
    // etcd compaction and an API server restart: the watch gets 410 Gone on
    // its resume, and must list again.
    api.expire_history();
    api.close_watches();
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually(
        "re-mirrored after the re-list",
        Duration::from_secs(20),
        || served_again(&dst, &app),
    )
    .await;
    r.stop().await;
    // The resumed watch was answered 410, and a list followed it.
    let expired = api.expired();
    assert!(
        expired
            .iter()
            .any(|q| q.path == "/api/v1/pods" && q.query.contains("watch=true")),
        "no watch was answered 410 Expired: {:?}",
        pod_watches(&api)
    );
    let requests = api.requests();
    let gone = requests
        .iter()
        .position(|q| *q == expired[0])
        .expect("the expired request was recorded");
    let relisted = requests[gone + 1..]
        .iter()
        .any(|q| q.path == "/api/v1/pods" && !q.query.contains("watch=true"));
    assert!(relisted, "no list after the 410: {:?}", &requests[gone..]);
}

/// With periodic bookmarks (as from a real API server), a closed watch is
/// resumed from the latest bookmark's resourceVersion, not the older one of
/// the list, and with no re-list; pull failures are still seen after it.
#[tokio::test]
async fn the_watcher_resumes_from_a_bookmark() {
    let (src, dst, api) = rig().await;
    api.bookmark_every(Duration::from_millis(100));
    let app = push(&src, "app", 455).await;
    let mut cfg = config(&src, &dst, "{reverify: 0s}");
    // The Pod watch alone: no workload watches beside it.
    cfg.backfill.enabled = false;
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually("the watcher watches", Duration::from_secs(10), || async {
        api.open_watches() == 1
    })
    .await;
    let first = pod_watches(&api)[0].clone();
    assert_eq!(
        query_param(&first, "allowWatchBookmarks").as_deref(),
        Some("true")
    );
    let listed: u64 = query_param(&first, "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    // Lease renewals move the global resourceVersion on (no Pod changes),
    // and a periodic bookmark carries it. Sent before the close, it is
    // delivered before the close too.
    let bookmarked = || {
        api.last_bookmark()
            .map_or(0, |rv| rv.parse::<u64>().unwrap())
    };
    eventually(
        "a bookmark past the list",
        Duration::from_secs(10),
        || async { bookmarked() > listed },
    )
    .await;
    let marked = bookmarked();
    api.close_watches();
    eventually("the watch resumed", Duration::from_secs(10), || async {
        pod_watches(&api).len() >= 2
    })
    .await;
    let resumed = pod_watches(&api)[1].clone();
    let from: u64 = query_param(&resumed, "resourceVersion")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        from >= marked && from > listed,
        "resumed from {from}, not the bookmark's {marked} (the list's was {listed})"
    );
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    r.stop().await;
    let lists = api
        .requests()
        .iter()
        .filter(|q| q.path == "/api/v1/pods" && !q.query.contains("watch=true"))
        .count();
    assert_eq!(lists, 1, "no re-list: {:?}", api.requests());
    assert!(api.expired().is_empty(), "{:?}", api.expired());
}

#[tokio::test]
async fn a_pod_failing_before_the_replica_leads_is_seen_in_the_first_list() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 461).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ImagePullBackOff"));
    // Started after the failure (a restart, or a new leader).
    r.start(&cfg, &api);
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    r.stop().await;
}

#[tokio::test]
async fn only_the_configured_namespaces_are_watched() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 471).await;
    let cfg = config_with(&src, &dst, "{reverify: 0s}", "  namespaces: [prod]\n");
    let mut r = Replica::new(&cfg);
    let p = admit_and_store(&r, &api, "web", &app, &dst).await;
    r.start(&cfg, &api);
    wait_leader(&r).await;
    prune(&dst, &app).await;
    // In namespace shop, which is not watched.
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(r.metric("pinswap_pull_failures_total"), 0.0);
    assert_eq!(dst.head_manifest(&app.repo, "v1").await, None);
    // The same Pod in prod is.
    let mut q = p.clone();
    q["metadata"]["namespace"] = "prod".into();
    store(&api, &pull_failing(&q, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    assert!(
        api.requests().iter().all(|q| q.path != "/api/v1/pods"),
        "no cluster-wide list or watch"
    );
    r.stop().await;
}

/// Pods outside the webhook's scope are left alone by recovery as by
/// admission: one in a namespace labelled `pinswap.dev/ignore=true` before
/// pinswap leads, one whose namespace is labelled while it leads, and one
/// labelled so itself fail to pull an image they were rewritten to
/// before: no re-mirror, no Event. The same failure of a Pod in the scope
/// is mirrored again.
#[tokio::test]
async fn pods_outside_the_webhooks_scope_are_not_recovered() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 461).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let mut out = Vec::new();
    for (ns, name) in [("quiet", "q"), ("later", "l"), ("shop", "opted")] {
        let (mut p, _) = admit(&r.adm, &pod(ns, name, &[("app", &app.source)])).await;
        if name == "opted" {
            p["metadata"]["labels"] = serde_json::json!({"pinswap.dev/ignore": "true"});
        }
        store(&api, &p);
        out.push(p);
    }
    let web = admit_and_store(&r, &api, "web", &app, &dst).await;
    api.apply_namespace("quiet", &[("pinswap.dev/ignore", "true")]);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    api.apply_namespace("later", &[("pinswap.dev/ignore", "true")]);
    tokio::time::sleep(Duration::from_secs(1)).await;

    prune(&dst, &app).await;
    for p in &out {
        store(&api, &pull_failing(p, "app", "ErrImagePull"));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        dst.head_manifest(&app.repo, &app.image.digest).await,
        None,
        "not mirrored again for Pods outside the scope"
    );
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        0.0
    );
    assert!(api.events().is_empty(), "{:?}", api.events());

    store(&api, &pull_failing(&web, "app", "ErrImagePull"));
    eventually("the image served again", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    eventually("web's Event", Duration::from_secs(10), || async {
        !events_for(&api, "web", "ImageRemirrored").is_empty()
    })
    .await;
    for name in ["q", "l", "opted"] {
        assert!(
            events_for(&api, name, "ImageRemirrored").is_empty(),
            "{name}: {:?}",
            api.events()
        );
    }
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.stop().await;
}

/// A namespace that enters the webhook's scope while pinswap leads (its
/// `pinswap.dev/ignore` label removed): a Pod there that already fails to
/// pull is recovered without waiting for its next change.
#[tokio::test]
async fn a_namespace_entering_the_webhooks_scope_has_its_failing_pods_recovered() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 462).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    let (p, _) = admit(&r.adm, &pod("quiet", "q", &[("app", &app.source)])).await;
    store(&api, &p);
    api.apply_namespace("quiet", &[("pinswap.dev/ignore", "true")]);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    wait_watching(&api).await;
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        r.metric("pinswap_pull_failures_total"),
        0.0,
        "outside the scope"
    );
    api.apply_namespace("quiet", &[]);
    eventually("the image served again", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    eventually("q's Event", Duration::from_secs(10), || async {
        !events_for(&api, "q", "ImageRemirrored").is_empty()
    })
    .await;
    assert!(api.forbidden().is_empty(), "{:?}", api.forbidden());
    r.stop().await;
}
