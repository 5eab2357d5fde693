//! Self-test of the in-process Kubernetes API server (tests/common/kube.rs),
//! driven through kube's own client.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::kube::{ApiRequest, KubeApi, dockerconfigjson_secret};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ContainerState, ContainerStateWaiting, ContainerStatus, Event as CoreEvent,
    LocalObjectReference, ObjectReference, Pod, PodStatus, Secret, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::core::Status;
use serde_json::{Value, json};

fn meta(ns: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(ns.into()),
        ..Default::default()
    }
}

fn pod(ns: &str, name: &str) -> Pod {
    Pod {
        metadata: meta(ns, name),
        ..Default::default()
    }
}

fn pull_failing(mut pod: Pod, image: &str) -> Pod {
    pod.status = Some(PodStatus {
        container_statuses: Some(vec![ContainerStatus {
            name: "app".into(),
            image: image.into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ErrImagePull".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    });
    pod
}

/// The `Status` of a `kube::Error::Api`, or a panic naming what came instead.
#[track_caller]
fn api_error<T: std::fmt::Debug>(result: kube::Result<T>) -> Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected kube::Error::Api, got {other:?}"),
    }
}

/// The next watch event, within 5 s.
async fn next<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin,
{
    match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(e))) => panic!("watch error: {e:?}"),
        Ok(None) => panic!("watch ended early"),
        Err(_) => panic!("no watch event within 5 s"),
    }
}

fn name_rv(pod: &Pod) -> (String, u64) {
    let rv = pod
        .metadata
        .resource_version
        .as_deref()
        .expect("resourceVersion");
    (
        pod.metadata.name.clone().unwrap(),
        rv.parse().expect("numeric resourceVersion"),
    )
}

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

#[tokio::test]
async fn events_past_the_api_servers_limits_are_invalid() {
    common::init();
    let api = KubeApi::start().await;
    let events: Api<Event> = Api::namespaced(api.client(), "apps");
    let with = |f: &dyn Fn(&mut Event)| {
        let mut e = new_event("apps", "ImageRemirrored");
        f(&mut e);
        e
    };
    // At the limits: accepted.
    let at = with(&|e| {
        e.note = Some("n".repeat(1024));
        e.reason = Some("R".repeat(128));
        e.action = Some("A".repeat(128));
    });
    let created = events.create(&PostParams::default(), &at).await.unwrap();
    // One past each: 422 naming the field, as the API's internal type
    // names it (the note is `message`). The note counts bytes.
    type Edit = Box<dyn Fn(&mut Event)>;
    let cases: [(&str, Edit); 4] = [
        ("message", Box::new(|e| e.note = Some("é".repeat(513)))),
        ("reason", Box::new(|e| e.reason = Some("R".repeat(129)))),
        ("action", Box::new(|e| e.action = Some("A".repeat(129)))),
        (
            "reportingInstance",
            Box::new(|e| e.reporting_instance = Some("i".repeat(129))),
        ),
    ];
    for (field, f) in cases {
        let err = api_error(events.create(&PostParams::default(), &with(&*f)).await);
        assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"), "{field}");
        assert!(err.message.contains(field), "{field}: {}", err.message);
    }
    // A patch cannot bring the note past the limit either.
    let name = created.metadata.name.unwrap();
    let patch = json!({"note": "n".repeat(1025)});
    let err = api_error(
        events
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    let stored = events.get(&name).await.unwrap();
    assert_eq!(
        stored.note.unwrap().len(),
        1024,
        "the refused patch changed nothing"
    );
}

#[tokio::test]
async fn authorised_as_the_install_grants() {
    use pinswap::install::manifests::Tls;
    common::init();
    let config = |extra: &str| {
        pinswap::config::Config::from_yaml(
            &format!("target: {{registry: m.example}}\n{extra}"),
            "t",
        )
        .unwrap()
    };
    let api = KubeApi::start().await;
    api.apply_pod(pod("apps", "a"));
    let pods: Api<Pod> = Api::all(api.client());
    let secrets: Api<Secret> = Api::namespaced(api.client(), "apps");
    api.put_secret(
        "apps",
        dockerconfigjson_secret("regcred", "r.example", "u", "p"),
    );

    // Recovery off, no pull secrets: no Pods, no Secrets.
    api.authorize_install(&config("recovery: {enabled: false}"), Tls::CertManager);
    let err = api_error(pods.list(&ListParams::default()).await);
    assert_eq!((err.code, err.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        err.message,
        "pods is forbidden: User \"system:serviceaccount:pinswap:pinswap\" cannot list resource \"pods\" in API group \"\" at the cluster scope"
    );
    assert_eq!(api_error(secrets.get("regcred").await).code, 403);

    // Recovery on: Pods read and watched everywhere, the Lease by name only.
    api.authorize_install(&config(""), Tls::CertManager);
    pods.list(&ListParams::default()).await.expect("list pods");
    let mut watch = pods
        .watch(&WatchParams::default(), "0")
        .await
        .expect("watch")
        .boxed();
    assert!(matches!(next(&mut watch).await, WatchEvent::Added(_)));
    assert_eq!(
        api_error(secrets.get("regcred").await).code,
        403,
        "no pull secrets"
    );
    let leases: Api<Lease> = Api::namespaced(api.client(), "pinswap");
    let err = api_error(leases.get("someone-else").await);
    assert_eq!(err.code, 403, "{}", err.message);
    assert_eq!(
        api_error(leases.get("pinswap-leader").await).code,
        404,
        "allowed, absent"
    );
    let elsewhere: Api<Lease> = Api::namespaced(api.client(), "apps");
    assert_eq!(api_error(elsewhere.get("pinswap-leader").await).code, 403);

    // Pull secrets: get, never list.
    api.authorize_install(
        &config("source: {imagePullSecrets: true}"),
        Tls::CertManager,
    );
    secrets.get("regcred").await.expect("get a pull secret");
    assert_eq!(
        api_error(secrets.list(&ListParams::default()).await).code,
        403
    );
    assert_eq!(
        api.forbidden(),
        [
            "list /api/v1/pods",
            "get /api/v1/namespaces/apps/secrets/regcred",
            "get /api/v1/namespaces/apps/secrets/regcred",
            "get /apis/coordination.k8s.io/v1/namespaces/pinswap/leases/someone-else",
            "get /apis/coordination.k8s.io/v1/namespaces/apps/leases/pinswap-leader",
            "list /api/v1/namespaces/apps/secrets",
        ]
    );
}

fn new_event(ns: &str, reason: &str) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some("pinswap-".into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Remirror".into()),
        reason: Some(reason.into()),
        note: Some("mirror.test/app@sha256:00 copied again".into()),
        type_: Some("Normal".into()),
        reporting_controller: Some("pinswap.dev/watcher".into()),
        reporting_instance: Some("pinswap-0".into()),
        regarding: Some(ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some(ns.into()),
            name: Some("a".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn events_are_created_and_patched() {
    common::init();
    let api = KubeApi::start().await;
    let events: Api<Event> = Api::namespaced(api.client(), "apps");
    let created = events
        .create(
            &PostParams::default(),
            &new_event("apps", "ImageRemirrored"),
        )
        .await;
    let created = created.expect("create events.k8s.io/v1 Event");
    let name = created
        .metadata
        .name
        .clone()
        .expect("name from generateName");
    assert!(
        name.starts_with("pinswap-") && name.len() == "pinswap-".len() + 5,
        "{name}"
    );
    assert!(created.metadata.resource_version.is_some());
    let second = events
        .create(&PostParams::default(), &new_event("apps", "RemirrorFailed"))
        .await;
    assert_ne!(
        second.unwrap().metadata.name.unwrap(),
        name,
        "generated names are unique"
    );

    // A repeat patches the series; the rest of an Event is immutable.
    let series = |count: i32| {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        json!({"series": {"count": count, "lastObservedTime": now}})
    };
    let patched = events
        .patch(&name, &PatchParams::default(), &Patch::Merge(series(2)))
        .await
        .expect("merge-patch the event");
    assert_eq!(patched.series.map(|s| s.count), Some(2));
    assert_eq!(patched.reason.as_deref(), Some("ImageRemirrored"));
    let strategic = Patch::Strategic(series(3));
    let patched = events
        .patch(&name, &PatchParams::default(), &strategic)
        .await;
    assert_eq!(
        patched
            .expect("strategic-merge-patch")
            .series
            .map(|s| s.count),
        Some(3)
    );
    let err = api_error(
        events
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"note": "again"})),
            )
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert!(
        err.message
            .ends_with("message: Invalid value: \"again\": field is immutable"),
        "{}",
        err.message
    );
    let apply = Patch::Apply(json!({"note": "fourth"}));
    let err = api_error(
        events
            .patch(&name, &PatchParams::apply("pinswap"), &apply)
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_str()),
        (415, "UnsupportedMediaType")
    );
    let missing = events
        .patch("nope", &PatchParams::default(), &Patch::Merge(json!({})))
        .await;
    assert_eq!(api_error(missing).code, 404);

    // The API's validation: a reporting controller is required, and the
    // namespace must match the URL's.
    let mut incomplete = new_event("apps", "X");
    incomplete.reporting_controller = None;
    let err = api_error(events.create(&PostParams::default(), &incomplete).await);
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    let err = api_error(
        events
            .create(&PostParams::default(), &new_event("kube-system", "X"))
            .await,
    );
    assert_eq!(err.code, 400);

    let core: Api<CoreEvent> = Api::namespaced(api.client(), "apps");
    let core_event = CoreEvent {
        metadata: ObjectMeta {
            name: Some("a.1".into()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            kind: Some("Pod".into()),
            name: Some("a".into()),
            namespace: Some("apps".into()),
            ..Default::default()
        },
        reason: Some("ImageRemirrored".into()),
        type_: Some("Normal".into()),
        ..Default::default()
    };
    let stored = core
        .create(&PostParams::default(), &core_event)
        .await
        .expect("core/v1 Event");
    assert_eq!(stored.metadata.name.as_deref(), Some("a.1"));
    let again = api_error(core.create(&PostParams::default(), &core_event).await);
    assert_eq!((again.code, again.reason.as_str()), (409, "AlreadyExists"));

    let all = api.events();
    let mut reasons: Vec<_> = all.iter().map(|e| e["reason"].as_str().unwrap()).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        ["ImageRemirrored", "ImageRemirrored", "RemirrorFailed"]
    );
    assert!(all.iter().all(|e| e["metadata"]["namespace"] == "apps"));
    let posts = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(posts, 6);
}

#[tokio::test]
async fn leases_use_optimistic_concurrency() {
    common::init();
    let api = KubeApi::start().await;
    let leases: Api<Lease> = Api::namespaced(api.client(), "pinswap");
    assert_eq!(api_error(leases.get("pinswap-leader").await).code, 404);

    let held_by = |who: &str| Lease {
        metadata: ObjectMeta {
            name: Some("pinswap-leader".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(who.into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    };
    let first = leases
        .create(&PostParams::default(), &held_by("a"))
        .await
        .expect("create");
    let err = api_error(leases.create(&PostParams::default(), &held_by("b")).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));

    let mut take = held_by("b");
    take.metadata.resource_version = first.metadata.resource_version.clone();
    let second = leases
        .replace("pinswap-leader", &PostParams::default(), &take)
        .await;
    let second = second.expect("replace with the current resourceVersion");
    assert_ne!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    assert_eq!(second.metadata.uid, first.metadata.uid);

    let err = api_error(leases.replace("other", &PostParams::default(), &take).await);
    assert_eq!(err.code, 400, "name mismatch: {err:?}");
    let mut absent = held_by("a");
    absent.metadata.name = Some("absent".into());
    // A PUT creates an absent Lease (kube-apiserver's AllowCreateOnUpdate),
    // but never updates one unconditionally.
    leases
        .replace("absent", &PostParams::default(), &absent)
        .await
        .expect("created by PUT");
    let err = api_error(
        leases
            .replace("absent", &PostParams::default(), &absent)
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert!(
        err.message.contains("must be specified for an update"),
        "{err:?}"
    );

    // `a` still holds the first version: its update is stale.
    let mut stale = held_by("a");
    stale.metadata.resource_version = first.metadata.resource_version.clone();
    let err = api_error(
        leases
            .replace("pinswap-leader", &PostParams::default(), &stale)
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("the object has been modified"),
        "{err:?}"
    );
    let holder = |l: Lease| l.spec.unwrap().holder_identity.unwrap();
    assert_eq!(holder(leases.get("pinswap-leader").await.unwrap()), "b");
    assert_eq!(holder(api.lease("pinswap", "pinswap-leader").unwrap()), "b");

    // kube's Entry API (get, then create or replace) races the same way.
    let mut one = leases
        .entry("race")
        .await
        .unwrap()
        .or_insert(Lease::default);
    one.commit(&PostParams::default())
        .await
        .expect("create via entry");
    let mut a = leases
        .entry("race")
        .await
        .unwrap()
        .or_insert(Lease::default);
    let mut b = leases
        .entry("race")
        .await
        .unwrap()
        .or_insert(Lease::default);
    a.get_mut().spec = Some(LeaseSpec {
        holder_identity: Some("a".into()),
        ..Default::default()
    });
    b.get_mut().spec = Some(LeaseSpec {
        holder_identity: Some("b".into()),
        ..Default::default()
    });
    a.commit(&PostParams::default())
        .await
        .expect("first writer wins");
    match b.commit(&PostParams::default()).await {
        Err(kube::api::entry::CommitError::Save(kube::Error::Api(s))) => assert_eq!(s.code, 409),
        other => panic!("second writer must conflict, got {other:?}"),
    }
    let puts: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "PUT")
        .collect();
    assert_eq!(puts.len(), 7);
    assert!(puts.iter().all(|r| {
        r.path
            .starts_with("/apis/coordination.k8s.io/v1/namespaces/pinswap/leases/")
    }));
}

/// The workload kinds list (paged), watch from a list's resourceVersion
/// and are authorised as the install grants: with the backfill on, list and
/// watch of each; with it off, 403.
#[tokio::test]
async fn workloads_list_watch_and_are_authorised() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::batch::v1::CronJob;
    use pinswap::install::manifests::Tls;
    common::init();
    let api = KubeApi::start().await;
    let deployment = |ns: &str, name: &str| -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": name}}, "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": "nginx:1"}]}}}
        }))
        .unwrap()
    };
    for i in 0..3 {
        api.apply_object(deployment("apps", &format!("d{i}")));
    }
    let config = |extra: &str| {
        pinswap::config::Config::from_yaml(
            &format!("target: {{registry: m.example}}\n{extra}"),
            "t",
        )
        .unwrap()
    };
    api.authorize_install(&config("backfill: {enabled: false}"), Tls::CertManager);
    let all: Api<Deployment> = Api::all(api.client());
    let err = api_error(all.list(&ListParams::default()).await);
    assert_eq!(err.code, 403, "{}", err.message);
    assert!(
        err.message
            .contains("cannot list resource \"deployments\" in API group \"apps\""),
        "{}",
        err.message
    );

    api.authorize_install(&config(""), Tls::CertManager);
    let page = all.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let rest = all
        .list(&ListParams::default().continue_token(page.metadata.continue_.as_deref().unwrap()))
        .await
        .unwrap();
    assert_eq!(rest.items.len(), 1);
    let rv = page.metadata.resource_version.unwrap();
    let mut watch = all
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    api.apply_object(deployment("web", "new"));
    api.delete_object::<Deployment>("apps", "d0");
    match next(&mut watch).await {
        WatchEvent::Added(d) => assert_eq!(d.metadata.name.as_deref(), Some("new")),
        other => panic!("{other:?}"),
    }
    assert!(matches!(next(&mut watch).await, WatchEvent::Deleted(_)));
    // Another kind's events are not in this watch; its own list is empty.
    let cron: Api<CronJob> = Api::namespaced(api.client(), "apps");
    assert!(
        cron.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(api.forbidden().len() == 1, "{:?}", api.forbidden());
}
