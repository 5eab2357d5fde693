//! Self-test of the in-process Kubernetes API server (tests/common/kube.rs),
//! driven through kube's own client: Secrets and ServiceAccounts, Pod lists
//! and watches, expiry, bookmarks, faults and paging.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::api_objects::*;
use common::kube::{ApiRequest, KubeApi, dockerconfigjson_secret};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, LocalObjectReference, Pod, Secret, ServiceAccount};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

#[tokio::test]
async fn secrets_and_service_accounts() {
    common::init();
    let api = KubeApi::start().await;
    api.put_secret(
        "apps",
        dockerconfigjson_secret("pull", "reg.test:5000", "alice", "s3cret"),
    );
    let sa = ServiceAccount {
        metadata: meta("apps", "runner"),
        image_pull_secrets: Some(vec![LocalObjectReference {
            name: "pull".into(),
        }]),
        ..Default::default()
    };
    api.put_service_account("apps", sa);

    let secrets: Api<Secret> = Api::namespaced(api.client(), "apps");
    let secret = secrets.get("pull").await.expect("get secret");
    assert_eq!(
        secret.type_.as_deref(),
        Some("kubernetes.io/dockerconfigjson")
    );
    assert_eq!(secret.metadata.namespace.as_deref(), Some("apps"));
    assert!(secret.metadata.resource_version.is_some() && secret.metadata.uid.is_some());
    let config: Value =
        serde_json::from_slice(&secret.data.unwrap()[".dockerconfigjson"].0).expect("JSON");
    let auth = config["auths"]["reg.test:5000"]["auth"]
        .as_str()
        .expect("auth");
    let auth = base64::engine::general_purpose::STANDARD
        .decode(auth)
        .unwrap();
    assert_eq!(auth, b"alice:s3cret");

    // The client's default namespace is used by Api::default_namespaced.
    let sas: Api<ServiceAccount> = Api::default_namespaced(api.client_in("apps"));
    let got = sas.get("runner").await.expect("get service account");
    assert_eq!(got.image_pull_secrets.unwrap()[0].name, "pull");

    let missing = api_error(secrets.get("nope").await);
    assert_eq!((missing.code, missing.reason.as_str()), (404, "NotFound"));
    assert_eq!(missing.message, "secrets \"nope\" not found");
    let other_ns: Api<Secret> = Api::namespaced(api.client(), "elsewhere");
    assert_eq!(api_error(other_ns.get("pull").await).code, 404);
    // A missing ConfigMap is a 404 Status too, not an empty body.
    let cms: Api<ConfigMap> = Api::namespaced(api.client(), "apps");
    assert_eq!(api_error(cms.get("x").await).reason, "NotFound");

    // The raw 404 body is a real Status object.
    let url = format!("{}/api/v1/namespaces/apps/secrets/nope", api.url());
    let raw = reqwest::get(&url).await.expect("GET");
    assert_eq!(raw.status(), 404);
    let body: Value = raw.json().await.expect("JSON body");
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["apiVersion"], "v1");
    assert_eq!(body["status"], "Failure");
    assert_eq!(body["reason"], "NotFound");
    assert_eq!(body["code"], 404);
    assert_eq!(body["details"], json!({"name": "nope", "kind": "secrets"}));

    let get = |path: &str| ApiRequest {
        method: "GET".into(),
        path: path.into(),
        query: "".into(),
    };
    assert_eq!(
        api.requests(),
        [
            get("/api/v1/namespaces/apps/secrets/pull"),
            get("/api/v1/namespaces/apps/serviceaccounts/runner"),
            get("/api/v1/namespaces/apps/secrets/nope"),
            get("/api/v1/namespaces/elsewhere/secrets/pull"),
            get("/api/v1/namespaces/apps/configmaps/x"),
            get("/api/v1/namespaces/apps/secrets/nope"),
        ]
    );
}

#[tokio::test]
async fn list_then_watch_pods_in_order() {
    common::init();
    let api = KubeApi::start().await;
    api.apply_pod(pod("apps", "a"));
    api.apply_pod(pod("other", "x"));
    let pods: Api<Pod> = Api::all(api.client());
    let list = pods.list(&ListParams::default()).await.expect("list pods");
    let mut names: Vec<_> = list.items.iter().map(|p| name_rv(p).0).collect();
    names.sort();
    assert_eq!(names, ["a", "x"]);
    let list_rv = list
        .metadata
        .resource_version
        .clone()
        .expect("list resourceVersion");
    assert_eq!(list_rv, api.resource_version());
    let namespaced: Api<Pod> = Api::namespaced(api.client(), "apps");
    let apps = namespaced
        .list(&ListParams::default())
        .await
        .expect("list apps pods");
    assert_eq!(apps.items.len(), 1);

    let wp = WatchParams::default().timeout(30);
    let mut all = pods.watch(&wp, &list_rv).await.expect("watch").boxed();
    let mut in_apps = namespaced
        .watch(&wp, &list_rv)
        .await
        .expect("watch apps")
        .boxed();
    api.apply_pod(pod("apps", "b"));
    api.apply_pod(pod("other", "y"));
    let failing = api.apply_pod(pull_failing(pod("apps", "a"), "mirror.test/app@sha256:00"));
    let bookmark_rv = api.bookmark();
    let deleted = api.delete_pod("apps", "b");

    let base: u64 = list_rv.parse().unwrap();
    match next(&mut all).await {
        WatchEvent::Added(p) => assert_eq!(name_rv(&p), ("b".into(), base + 1)),
        e => panic!("want ADDED b, got {e:?}"),
    }
    match next(&mut all).await {
        WatchEvent::Added(p) => assert_eq!(name_rv(&p), ("y".into(), base + 2)),
        e => panic!("want ADDED y, got {e:?}"),
    }
    match next(&mut all).await {
        WatchEvent::Modified(p) => {
            assert_eq!(name_rv(&p), ("a".into(), base + 3));
            assert_eq!(p, failing);
            let status = &p.status.unwrap().container_statuses.unwrap()[0];
            let waiting = status.state.as_ref().unwrap().waiting.as_ref().unwrap();
            assert_eq!(waiting.reason.as_deref(), Some("ErrImagePull"));
        }
        e => panic!("want MODIFIED a, got {e:?}"),
    }
    match next(&mut all).await {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version, bookmark_rv);
            assert_eq!(
                (b.types.api_version.as_str(), b.types.kind.as_str()),
                ("v1", "Pod")
            );
        }
        e => panic!("want BOOKMARK, got {e:?}"),
    }
    match next(&mut all).await {
        WatchEvent::Deleted(p) => {
            assert_eq!(name_rv(&p), ("b".into(), base + 4));
            assert_eq!(
                deleted.metadata.resource_version.as_deref(),
                Some(&*(base + 4).to_string())
            );
        }
        e => panic!("want DELETED b, got {e:?}"),
    }
    // The namespaced watch sees only its namespace.
    let seen: Vec<String> = [
        next(&mut in_apps).await,
        next(&mut in_apps).await,
        next(&mut in_apps).await,
        next(&mut in_apps).await,
    ]
    .into_iter()
    .map(|e| match e {
        WatchEvent::Added(p) => format!("ADDED {}", name_rv(&p).0),
        WatchEvent::Modified(p) => format!("MODIFIED {}", name_rv(&p).0),
        WatchEvent::Deleted(p) => format!("DELETED {}", name_rv(&p).0),
        WatchEvent::Bookmark(_) => "BOOKMARK".into(),
        WatchEvent::Error(s) => format!("ERROR {s:?}"),
    })
    .collect();
    assert_eq!(seen, ["ADDED b", "MODIFIED a", "BOOKMARK", "DELETED b"]);

    // A watch from the same resourceVersion replays the history (bookmarks
    // are live only), and one without bookmarks doesn't get them.
    let quiet = WatchParams {
        bookmarks: false,
        ..WatchParams::default().timeout(30)
    };
    let mut replay = namespaced
        .watch(&quiet, &list_rv)
        .await
        .expect("re-watch")
        .boxed();
    assert!(matches!(next(&mut replay).await, WatchEvent::Added(p) if name_rv(&p).0 == "b"));
    assert!(matches!(next(&mut replay).await, WatchEvent::Modified(p) if name_rv(&p).0 == "a"));
    assert!(matches!(next(&mut replay).await, WatchEvent::Deleted(p) if name_rv(&p).0 == "b"));
    api.bookmark();
    api.apply_pod(pod("apps", "c"));
    assert!(matches!(next(&mut replay).await, WatchEvent::Added(p) if name_rv(&p).0 == "c"));

    // kube sends what the real API expects.
    let watches: Vec<ApiRequest> = api
        .requests()
        .into_iter()
        .filter(|r| r.query.contains("watch=true"))
        .collect();
    assert_eq!(watches.len(), 3);
    assert_eq!(watches[0].path, "/api/v1/pods");
    assert_eq!(watches[1].path, "/api/v1/namespaces/apps/pods");
    let q = &watches[0].query;
    for part in [
        "timeoutSeconds=30",
        "allowWatchBookmarks=true",
        &format!("resourceVersion={list_rv}"),
    ] {
        assert!(q.split('&').any(|p| p == part), "{part} missing from {q}");
    }
    assert!(!watches[2].query.contains("allowWatchBookmarks"));
}

#[tokio::test]
async fn watch_from_zero_gets_current_pods_as_added() {
    common::init();
    let api = KubeApi::start().await;
    api.apply_pod(pod("apps", "a"));
    let pods: Api<Pod> = Api::all(api.client());
    let mut watch = pods
        .watch(&WatchParams::default(), "0")
        .await
        .expect("watch")
        .boxed();
    assert!(matches!(next(&mut watch).await, WatchEvent::Added(p) if name_rv(&p).0 == "a"));
    // With bookmarks allowed, kube-apiserver ends the synthetic ADDEDs with one.
    match next(&mut watch).await {
        WatchEvent::Bookmark(b) => assert_eq!(
            b.metadata
                .annotations
                .get("k8s.io/initial-events-end")
                .map(String::as_str),
            Some("true")
        ),
        e => panic!("want the initial-events-end BOOKMARK, got {e:?}"),
    }
    api.apply_pod(pod("apps", "b"));
    assert!(matches!(next(&mut watch).await, WatchEvent::Added(p) if name_rv(&p).0 == "b"));
}

#[tokio::test]
async fn expired_resource_version_gets_410() {
    common::init();
    let api = KubeApi::start().await;
    let pods: Api<Pod> = Api::all(api.client());
    let old = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    api.apply_pod(pod("apps", "a"));
    api.apply_pod(pod("apps", "b"));
    api.expire_history();

    let mut stale = pods
        .watch(&WatchParams::default(), &old)
        .await
        .expect("watch")
        .boxed();
    match next(&mut stale).await {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert!(
                status.message.starts_with("too old resource version"),
                "{status:?}"
            );
        }
        e => panic!("want ERROR 410, got {e:?}"),
    }
    assert!(stale.next().await.is_none(), "an expired watch ends");
    // The server says whom it answered 410: that watch, and no one else.
    let expired = api.expired();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0].path, "/api/v1/pods");
    let q = &expired[0].query;
    for part in ["watch=true", &format!("resourceVersion={old}")] {
        assert!(q.split('&').any(|p| p == part), "{part} missing from {q}");
    }

    // Re-listing gives a resourceVersion that can be watched again.
    let list = pods.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 2);
    let rv = list.metadata.resource_version.unwrap();
    let mut fresh = pods
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch")
        .boxed();
    api.apply_pod(pod("apps", "c"));
    assert!(matches!(next(&mut fresh).await, WatchEvent::Added(p) if name_rv(&p).0 == "c"));
    // Recorded in order: the 410, the re-list, the watch from its version.
    let requests = api.requests();
    let gone = requests.iter().position(|r| *r == expired[0]).unwrap();
    let after: Vec<&str> = requests[gone + 1..]
        .iter()
        .map(|r| {
            if r.query.contains("watch=true") {
                "watch"
            } else {
                "list"
            }
        })
        .collect();
    assert_eq!(after, ["list", "watch"], "{requests:?}");
    assert!(
        requests[gone + 2]
            .query
            .split('&')
            .any(|p| p == format!("resourceVersion={rv}")),
        "{requests:?}"
    );
    // A list whose `continue` token predates the compaction gets 410 too.
    api.apply_pod(pod("apps", "d"));
    let page = pods.list(&ListParams::default().limit(1)).await.unwrap();
    let token = page.metadata.continue_.expect("a continue token");
    api.apply_pod(pod("apps", "e"));
    api.expire_history();
    let stale = pods
        .list(&ListParams::default().limit(1).continue_token(&token))
        .await;
    assert_eq!(api_error(stale).code, 410);
    let expired = api.expired();
    assert_eq!(expired.len(), 2, "{expired:?}");
    assert!(expired[1].query.contains("continue="), "{expired:?}");
}

#[tokio::test]
async fn periodic_bookmarks_carry_the_latest_resource_version() {
    common::init();
    let api = KubeApi::start().await;
    let pods: Api<Pod> = Api::all(api.client());
    let rv = api.resource_version();
    let mut watch = pods
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch")
        .boxed();
    api.bookmark_every(Duration::from_millis(50));
    let a = name_rv(&api.apply_pod(pod("apps", "a"))).1;
    assert!(matches!(next(&mut watch).await, WatchEvent::Added(p) if name_rv(&p).0 == "a"));
    // A write that is no Pod event moves the resourceVersion on; a later
    // bookmark carries it, and only bookmarks come meanwhile.
    let secret = Secret {
        metadata: meta("apps", "s"),
        ..Default::default()
    };
    let later: u64 = api
        .put_secret("apps", secret)
        .metadata
        .resource_version
        .unwrap()
        .parse()
        .unwrap();
    assert!(later > a);
    let mut marks = Vec::new();
    while marks.last().is_none_or(|rv| *rv < later) {
        match next(&mut watch).await {
            WatchEvent::Bookmark(b) => {
                marks.push(b.metadata.resource_version.parse::<u64>().unwrap())
            }
            e => panic!("want only BOOKMARKs, got {e:?}"),
        }
    }
    assert!(marks.iter().all(|rv| *rv >= a), "{marks:?}");
    assert!(marks.is_sorted(), "{marks:?}");
    assert!(api.last_bookmark().unwrap().parse::<u64>().unwrap() >= later);
}

#[tokio::test]
async fn a_black_hole_answers_nothing_until_lifted() {
    common::init();
    let api = KubeApi::start().await;
    let pods: Api<Pod> = Api::all(api.client());
    let mut watch = pods
        .watch(&WatchParams::default(), &api.resource_version())
        .await
        .expect("watch")
        .boxed();
    while api.open_watches() == 0 {
        tokio::task::yield_now().await;
    }
    api.black_hole(true);
    let secrets: Api<Secret> = Api::namespaced(api.client(), "apps");
    let get = tokio::spawn(async move { secrets.get_opt("s").await });
    let path = "/api/v1/namespaces/apps/secrets/s";
    while !api.requests().iter().any(|r| r.path == path) {
        tokio::task::yield_now().await;
    }
    api.apply_pod(pod("apps", "a"));
    // Recorded, but neither the request nor the open watch is answered.
    let quiet = tokio::time::timeout(Duration::from_millis(500), watch.next()).await;
    assert!(quiet.is_err(), "the watch delivered {quiet:?}");
    assert!(!get.is_finished(), "the GET was answered");
    api.black_hole(false);
    assert!(get.await.unwrap().unwrap().is_none());
    assert!(matches!(next(&mut watch).await, WatchEvent::Added(p) if name_rv(&p).0 == "a"));
}

#[tokio::test]
async fn watches_end_on_timeout_and_on_close() {
    common::init();
    let api = KubeApi::start().await;
    let pods: Api<Pod> = Api::all(api.client());
    let started = std::time::Instant::now();
    let quiet = WatchParams {
        bookmarks: false,
        ..WatchParams::default()
    };
    let mut short = pods
        .watch(&quiet.clone().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    let end = tokio::time::timeout(Duration::from_secs(5), short.try_next()).await;
    assert!(
        matches!(end, Ok(Ok(None))),
        "timeoutSeconds=1 ends the watch: {end:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));

    let mut long = pods.watch(&quiet, "0").await.unwrap().boxed();
    api.close_watches();
    let end = tokio::time::timeout(Duration::from_secs(5), long.try_next()).await;
    assert!(
        matches!(end, Ok(Ok(None))),
        "close_watches ends the watch: {end:?}"
    );
}

#[tokio::test]
async fn selectors_are_refused_not_ignored_and_failures_inject() {
    common::init();
    let api = KubeApi::start().await;
    let pods: Api<Pod> = Api::all(api.client());
    let err = api_error(pods.list(&ListParams::default().labels("app=x")).await);
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));

    // Calls the server doesn't implement are refused with a Status too.
    let accounts: Api<ServiceAccount> = Api::namespaced(api.client(), "apps");
    let err = api_error(
        accounts
            .create(&PostParams::default(), &Default::default())
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (405, "MethodNotAllowed"));
    let secrets: Api<Secret> = Api::namespaced(api.client(), "apps");
    let err = api_error(secrets.delete("s", &Default::default()).await);
    assert_eq!((err.code, err.reason.as_str()), (405, "MethodNotAllowed"));

    api.fail_next("GET", "/api/v1/pods", 500);
    let err = api_error(pods.list(&ListParams::default()).await);
    assert_eq!(err.code, 500);
    pods.list(&ListParams::default())
        .await
        .expect("only the next request fails");
}

#[tokio::test]
async fn pod_lists_page_with_limit_and_continue() {
    common::init();
    let api = KubeApi::start().await;
    for i in 0..5 {
        api.apply_pod(pod("apps", &format!("p{i}")));
    }
    let pods: Api<Pod> = Api::all(api.client());
    let mut names = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = Vec::new();
    loop {
        let mut lp = ListParams::default().limit(2);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = pods.list(&lp).await.expect("page");
        pages.push(page.items.len());
        names.extend(page.items.iter().map(|p| p.metadata.name.clone().unwrap()));
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
        assert!(page.metadata.remaining_item_count.unwrap() > 0);
    }
    assert_eq!(pages, [2, 2, 1]);
    assert_eq!(names, ["p0", "p1", "p2", "p3", "p4"]);

    // A token from before the history was compacted gets 410, as etcd's.
    let first = pods.list(&ListParams::default().limit(2)).await.unwrap();
    api.apply_pod(pod("apps", "p5"));
    api.expire_history();
    let lp = ListParams::default()
        .limit(2)
        .continue_token(first.metadata.continue_.as_deref().unwrap());
    let err = api_error(pods.list(&lp).await);
    assert_eq!((err.code, err.reason.as_str()), (410, "Expired"));

    // resourceVersionMatch is not implemented: refused, not ignored.
    let lp = ListParams::default()
        .at("0")
        .matching(kube::api::VersionMatch::NotOlderThan);
    let err = api_error(pods.list(&lp).await);
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    assert!(
        err.message.contains("resourceVersionMatch"),
        "{}",
        err.message
    );
}
