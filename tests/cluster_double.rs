//! The API double (tests/common/kube.rs) judged by the real kube-apiserver:
//! each test runs one client-side check against both, so where they
//! disagree, it fails. Only what pinswap relies on is checked. Selectors,
//! which the double refuses, are not (but `metadata.name=NAME`, a watch of
//! one namespace): that is a limitation, not a match.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::judge::*;
use common::kube::{KubeApi, dockerconfigjson_secret};
use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    LocalObjectReference, ObjectReference, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

/// Runs `check` against kube-apiserver, then the double; both must pass
/// it, and return the same observation.
macro_rules! judged {
    ($cluster:expr, $check:ident $(, $arg:expr)*) => {{
        let real = Server::real($cluster).await;
        let judge = $check(&real $(, $arg)*).await;
        let double = Server::double().await;
        let seen = $check(&double $(, $arg)*).await;
        assert_eq!(
            seen, judge,
            "the double (left) and kube-apiserver (right) disagree"
        );
        (real, double)
    }};
}

// ---------------------------------------------------------------------------
// Pods: list, watch, resourceVersions.

/// kube-apiserver sends a deletion as MODIFIED (deletionTimestamp set, even
/// with no grace period) then DELETED; the double only DELETED. Known and
/// left: pinswap acts on DELETED alone.
fn marks_deletion(e: &WatchEvent<Pod>) -> bool {
    matches!(e, WatchEvent::Modified(p) if p.metadata.deletion_timestamp.is_some())
}

/// List, then watch from the list's version: every change after it, in
/// order, with increasing versions; a namespaced watch sees only its own.
async fn list_then_watch(s: &Server, base: &str) -> Vec<String> {
    let (ns, other) = (unique(base), unique(base));
    s.namespace(&ns).await;
    s.namespace(&other).await;
    s.add_pod(&ns, "a").await;
    s.add_pod(&ns, "b").await;
    s.add_pod(&other, "x").await;
    let client = s.admin.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let list = pods.list(&ListParams::default()).await.unwrap();
    let names: Vec<_> = list
        .items
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"], "{}", s.who);
    let list_rv: u64 = list
        .metadata
        .resource_version
        .clone()
        .unwrap()
        .parse()
        .unwrap();
    assert!(list.items.iter().all(|p| rv_of(p) <= list_rv), "{}", s.who);

    let quiet = WatchParams {
        bookmarks: false,
        ..WatchParams::default().timeout(60)
    };
    let rv = list_rv.to_string();
    let mut ours = pods.watch(&quiet, &rv).await.unwrap().boxed();
    let mut all = Api::<Pod>::all(client)
        .watch(&quiet, &rv)
        .await
        .unwrap()
        .boxed();
    s.add_pod(&ns, "c").await;
    s.add_pod(&other, "y").await;
    s.touch_pod(&ns, "a", "1").await;
    s.delete_pod(&ns, "b").await;

    let mut seen = Vec::new();
    let mut last = list_rv;
    while seen.len() < 3 {
        let e = next(s.who, &mut ours).await;
        if marks_deletion(&e) {
            continue;
        }
        let (what, rv) = describe(&e);
        assert!(rv > last, "{}: {what} at {rv} after {last}", s.who);
        last = rv;
        seen.push(what);
    }
    // The cluster-wide watch: the same, with the other namespace's between.
    let mut everywhere = Vec::new();
    let mut last = list_rv;
    while everywhere.len() < 4 {
        let e = next(s.who, &mut all).await;
        if marks_deletion(&e) {
            continue;
        }
        let (what, rv) = describe(&e);
        assert!(rv > last, "{}: {what} at {rv} after {last}", s.who);
        last = rv;
        let pod_ns = match &e {
            WatchEvent::Added(p) | WatchEvent::Modified(p) | WatchEvent::Deleted(p) => {
                p.metadata.namespace.clone().unwrap()
            }
            _ => panic!("{}: {what}", s.who),
        };
        if pod_ns == ns || pod_ns == other {
            everywhere.push(what);
        }
    }
    assert_eq!(
        everywhere,
        ["ADDED c", "ADDED y", "MODIFIED a", "DELETED b"],
        "{}",
        s.who
    );
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_listed_then_watched_in_order_with_increasing_versions() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, list_then_watch, "order");
}

/// A watch from "0" starts with every current Pod as ADDED, then goes live.
async fn watch_from_zero(s: &Server, base: &str) -> Vec<String> {
    let ns = unique(base);
    s.namespace(&ns).await;
    s.add_pod(&ns, "a").await;
    s.add_pod(&ns, "b").await;
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &ns);
    let mut w = pods
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .unwrap()
        .boxed();
    // Bookmarks come when the server's timer says, between any two events
    // on a loaded machine: the order of the others is what is compared.
    let mut seen = Vec::new();
    let t = Instant::now();
    while seen.len() < 2 || t.elapsed() < Duration::from_secs(2) {
        let e = match tokio::time::timeout(Duration::from_secs(3), w.next()).await {
            Ok(Some(e)) => e.unwrap(),
            _ => break,
        };
        let what = describe(&e).0;
        if what != "BOOKMARK" {
            seen.push(what);
        }
    }
    s.add_pod(&ns, "c").await;
    loop {
        let what = describe(&next(s.who, &mut w).await).0;
        if what != "BOOKMARK" {
            seen.push(what);
            break;
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_zero_starts_with_the_current_pods() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, watch_from_zero, "zero");
}

/// A watch from a version older than the history gets one ERROR event,
/// 410 Expired, and ends; the Status is what kube-runtime's watcher reads.
async fn stale_watch(s: &Server, base: &str) -> Value {
    let ns = unique(base);
    s.namespace(&ns).await;
    s.add_pod(&ns, "a").await;
    s.compact().await;
    s.add_pod(&ns, "b").await;
    let pods: Api<Pod> = Api::all(s.admin.clone());
    let mut w = pods
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    let status = match next(s.who, &mut w).await {
        WatchEvent::Error(status) => status,
        e => panic!("{}: want ERROR 410, got {:?}", s.who, describe(&e)),
    };
    let end = tokio::time::timeout(Duration::from_secs(10), w.next()).await;
    assert!(matches!(end, Ok(None)), "{}: the expired watch ends", s.who);
    let mut v = serde_json::to_value(&status).unwrap();
    // "too old resource version: 1 (N)": N is the server's own.
    let message = v["message"].as_str().unwrap();
    let (head, tail) = message.split_once(" (").unwrap_or((message, ""));
    assert!(
        tail.trim_end_matches(')').parse::<u64>().is_ok(),
        "{}: {message}",
        s.who
    );
    v["message"] = format!("{head} (N)").into();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_stale_version_gets_410_expired_as_an_error_event() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, stale_watch, "stale");
}

/// Pages of `limit` with `continue`: a consistent snapshot at the first
/// page's version, with remainingItemCount; changes between pages don't
/// show.
async fn paged_list(s: &Server, base: &str) -> Vec<Value> {
    let ns = unique(base);
    s.namespace(&ns).await;
    for i in 0..5 {
        s.add_pod(&ns, &format!("p{i}")).await;
    }
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &ns);
    let mut pages = Vec::new();
    let mut token: Option<String> = None;
    let mut rvs = Vec::new();
    loop {
        let mut lp = ListParams::default().limit(2);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = pods.list(&lp).await.unwrap();
        if token.is_none() {
            // Between the pages: one Pod goes, one comes.
            s.delete_pod(&ns, "p3").await;
            s.add_pod(&ns, "p9").await;
        }
        rvs.push(page.metadata.resource_version.clone().unwrap());
        let names: Vec<_> = page
            .items
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        pages.push(json!({"names": names, "remaining": page.metadata.remaining_item_count}));
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
    }
    assert!(rvs.iter().all(|rv| *rv == rvs[0]), "{}: {rvs:?}", s.who);
    pages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_lists_page_with_limit_and_continue_on_one_snapshot() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, paged_list, "pages");
}

/// A `continue` token from before a compaction gets 410 Expired.
async fn stale_continue(s: &Server, base: &str) -> Value {
    let ns = unique(base);
    s.namespace(&ns).await;
    for i in 0..3 {
        s.add_pod(&ns, &format!("p{i}")).await;
    }
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &ns);
    let first = pods.list(&ListParams::default().limit(1)).await.unwrap();
    let token = first.metadata.continue_.unwrap();
    s.add_pod(&ns, "p3").await;
    s.compact().await;
    let lp = ListParams::default().limit(1).continue_token(&token);
    let mut v = outcome(pods.list(&lp).await);
    // The server may offer a token to go on inconsistently: its own format.
    if let Some(t) = v["metadata"]["continue"].as_str() {
        assert!(!t.is_empty(), "{}", s.who);
        v["metadata"]["continue"] = "TOKEN".into();
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continue_token_older_than_a_compaction_gets_410_expired() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, stale_continue, "continue");
}

/// With allowWatchBookmarks, a watch with nothing to deliver gets a
/// BOOKMARK (apiVersion v1, kind Pod) carrying a newer version, moved on
/// by changes elsewhere; a watch without it gets none.
async fn bookmarks(s: &Server, base: &str, limit: Duration) -> Vec<String> {
    let (ns, noise) = (unique(base), unique(base));
    s.namespace(&ns).await;
    s.namespace(&noise).await;
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &ns);
    let start: u64 = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap()
        .parse()
        .unwrap();
    let with = WatchParams::default().timeout(290);
    let without = WatchParams {
        bookmarks: false,
        ..with.clone()
    };
    let mut marked = pods.watch(&with, &start.to_string()).await.unwrap().boxed();
    let mut quiet = pods
        .watch(&without, &start.to_string())
        .await
        .unwrap()
        .boxed();
    let t = Instant::now();
    let churn = async {
        for i in 0.. {
            s.add_pod(&noise, &format!("n{i}")).await;
            s.delete_pod(&noise, &format!("n{i}")).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let mark = tokio::select! {
        e = next_within(s.who, &mut marked, limit) => e,
        _ = churn => unreachable!(),
    };
    let WatchEvent::Bookmark(b) = &mark else {
        panic!("{}: want BOOKMARK, got {:?}", s.who, describe(&mark));
    };
    let at: u64 = b.metadata.resource_version.parse().unwrap();
    assert!(
        at > start,
        "{}: bookmark at {at}, watch from {start}",
        s.who
    );
    eprintln!("{}: first bookmark after {:?}", s.who, t.elapsed());
    let none = tokio::time::timeout(Duration::from_secs(5), quiet.next()).await;
    assert!(
        none.is_err(),
        "{}: a watch without bookmarks got {none:?}",
        s.who
    );
    vec![
        "BOOKMARK".into(),
        b.types.api_version.clone(),
        b.types.kind.clone(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_that_allow_bookmarks_get_them_with_a_newer_version() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    // The real server sends one about once a minute; the double, as told.
    let real = Server::real(cluster).await;
    let judge = bookmarks(&real, "bookmarks", Duration::from_secs(90)).await;
    let double = Server::double().await;
    double.api().bookmark_every(Duration::from_millis(300));
    let seen = bookmarks(&double, "bookmarks", Duration::from_secs(10)).await;
    assert_eq!(seen, judge);
}

// ---------------------------------------------------------------------------
// Events.

/// What pinswap's Recorder (kube-runtime) does: create an Event, then
/// patch the same one with a series on each repeat.
async fn recorded_repeats(s: &Server, base: &str) -> Value {
    use kube::runtime::events::{Event as Ev, EventType, Recorder, Reporter};
    let ns = unique(base);
    s.namespace(&ns).await;
    let recorder = Recorder::new(
        s.admin.clone(),
        Reporter {
            controller: "pinswap".into(),
            instance: Some("pinswap-0".into()),
        },
    );
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(ns.clone()),
        name: Some("a".into()),
        ..Default::default()
    };
    let ev = |note: &str| Ev {
        type_: EventType::Normal,
        reason: "ImageRemirrored".into(),
        note: Some(note.into()),
        action: "Remirror".into(),
        secondary: None,
    };
    for note in ["first", "second", "third"] {
        recorder
            .publish(&ev(note), &regarding)
            .await
            .unwrap_or_else(|e| panic!("{}: publish: {e}", s.who));
    }
    let events = s.events(&ns).await;
    assert_eq!(events.len(), 1, "{}: one Event, with a series", s.who);
    let e = &events[0];
    json!({
        "note": e.note, "reason": e.reason, "action": e.action, "type": e.type_,
        "count": e.series.as_ref().map(|s| s.count),
        "controller": e.reporting_controller, "instance": e.reporting_instance,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_event_is_created_once_then_patched_with_a_series() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, recorded_repeats, "repeats");
}

fn new_event(ns: &str) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some("pinswap-".into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Remirror".into()),
        reason: Some("ImageRemirrored".into()),
        note: Some("mirror.test/app@sha256:00 copied again".into()),
        type_: Some("Normal".into()),
        reporting_controller: Some("pinswap".into()),
        reporting_instance: Some("pinswap-0".into()),
        regarding: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(ns.into()),
            name: Some("a".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Which Events the server refuses, and how: each case's outcome, with the
/// generated name taken out.
async fn event_limits(s: &Server, base: &str) -> Vec<(String, Value)> {
    let ns = unique(base);
    s.namespace(&ns).await;
    let events: Api<Event> = Api::namespaced(s.admin.clone(), &ns);
    type Edit = Box<dyn Fn(&mut Event)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("as pinswap sends it", Box::new(|_| {})),
        (
            "at every limit",
            Box::new(|e| {
                e.note = Some("é".repeat(512));
                e.reason = Some("R".repeat(128));
                e.action = Some("A".repeat(128));
                e.reporting_instance = Some("i".repeat(128));
            }),
        ),
        (
            "note of 1025 bytes",
            Box::new(|e| e.note = Some("é".repeat(512) + "n")),
        ),
        (
            "reason of 129",
            Box::new(|e| e.reason = Some("R".repeat(129))),
        ),
        (
            "action of 129",
            Box::new(|e| e.action = Some("A".repeat(129))),
        ),
        (
            "reportingInstance of 129",
            Box::new(|e| e.reporting_instance = Some("i".repeat(129))),
        ),
        ("no reason", Box::new(|e| e.reason = None)),
        ("no action", Box::new(|e| e.action = None)),
        (
            "no reportingController",
            Box::new(|e| e.reporting_controller = None),
        ),
        (
            "no reportingInstance",
            Box::new(|e| e.reporting_instance = None),
        ),
        ("no eventTime", Box::new(|e| e.event_time = None)),
        ("no type", Box::new(|e| e.type_ = None)),
        ("type Info", Box::new(|e| e.type_ = Some("Info".into()))),
        (
            "reportingController with a space",
            Box::new(|e| e.reporting_controller = Some("pin swap".into())),
        ),
        (
            "reportingController prefixed",
            Box::new(|e| e.reporting_controller = Some("pinswap.dev/watcher".into())),
        ),
        (
            "reportingController name of 64",
            Box::new(|e| e.reporting_controller = Some("c".repeat(64))),
        ),
        (
            "regarding another namespace",
            Box::new(|e| e.regarding.as_mut().unwrap().namespace = Some("elsewhere".into())),
        ),
    ];
    let mut out = Vec::new();
    for (what, edit) in cases {
        let mut e = new_event(&ns);
        edit(&mut e);
        let mut v = outcome(events.create(&PostParams::default(), &e).await);
        if let Some(name) = v["details"]["name"]
            .as_str()
            .filter(|n| n.starts_with("pinswap-"))
        {
            let name = name.to_owned();
            v["details"]["name"] = "NAME".into();
            v["message"] = v["message"].as_str().unwrap().replace(&name, "NAME").into();
        }
        out.push((what.to_owned(), v));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_past_the_api_servers_limits_are_refused_alike() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let real = Server::real(cluster).await;
    let judge = event_limits(&real, "limits").await;
    let double = Server::double().await;
    let seen = event_limits(&double, "limits").await;
    disagreements(&judge, &seen);
}

/// Patches of a stored Event: which fields may change.
async fn event_patches(s: &Server, base: &str) -> Vec<(String, Value)> {
    let ns = unique(base);
    s.namespace(&ns).await;
    let events: Api<Event> = Api::namespaced(s.admin.clone(), &ns);
    let created = events
        .create(&PostParams::default(), &new_event(&ns))
        .await
        .unwrap();
    let name = created.metadata.name.unwrap();
    let now = serde_json::to_value(MicroTime(k8s_openapi::jiff::Timestamp::now())).unwrap();
    let cases = [
        (
            "series",
            json!({"series": {"count": 2, "lastObservedTime": now}}),
        ),
        (
            "series count 1",
            json!({"series": {"count": 1, "lastObservedTime": now}}),
        ),
        ("note", json!({"note": "changed"})),
        ("note past the limit", json!({"note": "n".repeat(1025)})),
        ("reason", json!({"reason": "Other"})),
        ("type", json!({"type": "Warning"})),
    ];
    let mut out = Vec::new();
    for (what, patch) in cases {
        for p in [Patch::Merge(&patch), Patch::Strategic(&patch)] {
            let mut v = outcome(events.patch(&name, &PatchParams::default(), &p).await);
            if let Some(m) = v["message"].as_str() {
                v["message"] = m.replace(&name, "NAME").into();
                v["details"]["name"] = "NAME".into();
            }
            out.push((what.to_owned(), v));
        }
    }
    let missing = events
        .patch("nope", &PatchParams::default(), &Patch::Merge(json!({})))
        .await;
    out.push(("missing".into(), outcome(missing)));
    let stored = events.get(&name).await.unwrap();
    out.push(("stored note".into(), json!(stored.note)));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_patches_may_change_the_series_only() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let real = Server::real(cluster).await;
    let judge = event_patches(&real, "patches").await;
    let double = Server::double().await;
    let seen = event_patches(&double, "patches").await;
    disagreements(&judge, &seen);
}

// ---------------------------------------------------------------------------
// Leases, Secrets, ServiceAccounts.

/// The Lease's optimistic concurrency, as pinswap's election uses it; the
/// Status of every refusal.
async fn leases(s: &Server, base: &str) -> Vec<Value> {
    let ns = unique(base);
    s.namespace(&ns).await;
    let leases: Api<Lease> = Api::namespaced(s.admin.clone(), &ns);
    let held_by = |who: &str, rv: Option<&String>| Lease {
        metadata: ObjectMeta {
            name: Some("pinswap-leader".into()),
            resource_version: rv.cloned(),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(who.into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    };
    let mut out = vec![outcome(leases.get("pinswap-leader").await)];
    let first = leases
        .create(&PostParams::default(), &held_by("a", None))
        .await
        .unwrap();
    let rv1 = first.metadata.resource_version.as_ref();
    out.push(outcome(
        leases
            .create(&PostParams::default(), &held_by("b", None))
            .await,
    ));
    let pp = PostParams::default();
    let second = leases
        .replace("pinswap-leader", &pp, &held_by("b", rv1))
        .await
        .unwrap();
    assert_ne!(
        second.metadata.resource_version, first.metadata.resource_version,
        "{}",
        s.who
    );
    assert_eq!(second.metadata.uid, first.metadata.uid, "{}", s.who);
    // `a` still holds the first version.
    out.push(outcome(
        leases
            .replace("pinswap-leader", &pp, &held_by("a", rv1))
            .await,
    ));
    let holder = leases
        .get("pinswap-leader")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    out.push(json!(holder));
    out.push(outcome(
        leases.replace("other", &pp, &held_by("a", None)).await,
    ));
    let mut absent = held_by("a", None);
    absent.metadata.name = Some("absent".into());
    out.push(outcome(leases.replace("absent", &pp, &absent).await));
    // No resourceVersion: an unconditional update.
    out.push(outcome(
        leases
            .replace("pinswap-leader", &pp, &held_by("c", None))
            .await,
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_use_optimistic_concurrency_with_the_same_statuses() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, leases, "leases");
}

/// Secrets and ServiceAccounts as pull-secret lookup reads them, and the
/// Secret updates of `--self-signed`.
async fn secrets(s: &Server, base: &str) -> Vec<Value> {
    let ns = unique(base);
    s.namespace(&ns).await;
    s.put_secret(
        &ns,
        dockerconfigjson_secret("pull", "reg.test:5000", "alice", "s3cret"),
    )
    .await;
    let mut folded = Secret {
        metadata: ObjectMeta {
            name: Some("folded".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    folded.string_data = Some([("k".to_owned(), "v".to_owned())].into());
    s.put_secret(&ns, folded).await;
    s.put_service_account(
        &ns,
        ServiceAccount {
            metadata: ObjectMeta {
                name: Some("runner".into()),
                ..Default::default()
            },
            image_pull_secrets: Some(vec![LocalObjectReference {
                name: "pull".into(),
            }]),
            ..Default::default()
        },
    )
    .await;
    let secrets: Api<Secret> = Api::namespaced(s.admin.clone(), &ns);
    let sas: Api<ServiceAccount> = Api::namespaced(s.admin.clone(), &ns);
    let pull = secrets.get("pull").await.unwrap();
    let folded = secrets.get("folded").await.unwrap();
    let runner = sas.get("runner").await.unwrap();
    let mut out = vec![
        json!(pull.type_),
        json!(
            pull.data
                .as_ref()
                .map(|d| d.keys().cloned().collect::<Vec<_>>())
        ),
        json!(
            folded
                .data
                .as_ref()
                .map(|d| d.get("k").map(|v| v.0.clone()))
        ),
        json!(folded.string_data),
        json!(runner.image_pull_secrets),
        outcome(secrets.get("nope").await),
        outcome(sas.get("nope").await),
        outcome(
            Api::<Secret>::namespaced(s.admin.clone(), "no-such-namespace")
                .get("pull")
                .await,
        ),
    ];
    let pp = PostParams::default();
    let mut again = pull.clone();
    again.metadata.resource_version = None;
    out.push(outcome(secrets.create(&pp, &again).await));
    let mut stale = pull.clone();
    let mut newer = pull.clone();
    newer
        .data
        .as_mut()
        .unwrap()
        .insert("x".into(), k8s_openapi::ByteString(b"1".to_vec()));
    secrets.replace("pull", &pp, &newer).await.unwrap();
    stale
        .data
        .as_mut()
        .unwrap()
        .insert("y".into(), k8s_openapi::ByteString(b"2".to_vec()));
    out.push(outcome(secrets.replace("pull", &pp, &stale).await));
    let mut retyped = secrets.get("pull").await.unwrap();
    retyped.type_ = Some("Opaque".into());
    out.push(outcome(secrets.replace("pull", &pp, &retyped).await));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_and_service_accounts_are_read_and_missing_alike() {
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    judged!(cluster, secrets, "secrets");
}

// ---------------------------------------------------------------------------
// RBAC as installed.

const RBAC_CONFIG: &str = "target: {registry: m.example}\nsource: {imagePullSecrets: true}\n";

/// What the install's ServiceAccount may do: each request pinswap makes,
/// and some it must not, with the outcome (a 403's Status in full).
async fn as_installed(client: kube::Client, apps: &str) -> Vec<(String, Value)> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::ConfigMap;
    let pods_all: Api<Pod> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), apps);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), apps);
    let own_secrets: Api<Secret> = Api::namespaced(client.clone(), "pinswap");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), apps);
    let events: Api<Event> = Api::namespaced(client.clone(), apps);
    let leases: Api<Lease> = Api::namespaced(client.clone(), "pinswap");
    let other_leases: Api<Lease> = Api::namespaced(client.clone(), apps);
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), apps);
    let pp = PostParams::default();
    let mut out: Vec<(String, Value)> = Vec::new();
    let mut note = |what: &str, v: Value| out.push((what.to_owned(), v));

    note(
        "list pods",
        outcome(pods_all.list(&ListParams::default()).await),
    );
    let watch = pods_all
        .watch(&WatchParams::default().timeout(5), "0")
        .await;
    note("watch pods", outcome(watch.map(|_| ())));
    note("get a pod", outcome(pods.get("absent").await));
    note(
        "get a pod's status",
        outcome(pods.get_status("absent").await),
    );
    note(
        "delete a pod",
        outcome(pods.delete("absent", &Default::default()).await),
    );
    note("get a pull secret", outcome(secrets.get("regcred").await));
    note(
        "list secrets",
        outcome(secrets.list(&ListParams::default()).await),
    );
    note("get a service account", outcome(sas.get("default").await));
    let created = events.create(&pp, &new_event(apps)).await;
    let name = created.as_ref().ok().and_then(|e| e.metadata.name.clone());
    note("create an event", outcome(created.map(|_| ())));
    let series = json!({"series": {"count": 2, "lastObservedTime": serde_json::to_value(MicroTime(k8s_openapi::jiff::Timestamp::now())).unwrap()}});
    let patched = events
        .patch(
            &name.unwrap_or_default(),
            &PatchParams::default(),
            &Patch::Merge(series),
        )
        .await;
    note("patch an event", outcome(patched));
    note("get an event", outcome(events.get("absent").await));
    note("get the lease", outcome(leases.get("pinswap-leader").await));
    note(
        "get another lease",
        outcome(leases.get("someone-else").await),
    );
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("pinswap-leader".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("pinswap-0".into()),
            ..Default::default()
        }),
    };
    let made = leases.create(&pp, &lease).await;
    let made_rv = made
        .as_ref()
        .ok()
        .and_then(|l| l.metadata.resource_version.clone());
    note("create the lease", outcome(made));
    let mut renewed = lease.clone();
    renewed.metadata.resource_version = made_rv;
    note(
        "update the lease",
        outcome(leases.replace("pinswap-leader", &pp, &renewed).await),
    );
    note(
        "get the lease elsewhere",
        outcome(other_leases.get("pinswap-leader").await),
    );
    note(
        "get the TLS secret",
        outcome(own_secrets.get("pinswap-tls").await),
    );
    note(
        "get another own secret",
        outcome(own_secrets.get("pinswap-registry-auth").await),
    );
    note(
        "get the webhook configuration",
        outcome(webhooks.get("pinswap").await),
    );
    note(
        "get another webhook configuration",
        outcome(webhooks.get("someone-else").await),
    );
    note(
        "list config maps",
        outcome(cms.list(&ListParams::default()).await),
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installs_rbac_allows_and_refuses_alike() {
    use pinswap::install::manifests::Tls;
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let admin = cluster.admin().await;
    let apps = "rbac-apps";
    common::cluster::namespace(&admin, apps, json!({})).await;
    let install = common::cluster::Install::new(&admin, "pinswap", RBAC_CONFIG, &[]).await;
    let secret = dockerconfigjson_secret("regcred", "r.example", "u", "p");
    Api::<Secret>::namespaced(admin.clone(), apps)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let kubeconfig = cluster
        .service_account_kubeconfig(install.dir.path(), "pinswap", "pinswap")
        .await;
    let token_client = common::cluster::client_from(&kubeconfig).await;
    let judge = as_installed(token_client, apps).await;

    common::init();
    let api = KubeApi::start().await;
    api.put_secret(apps, secret);
    api.put_service_account(
        apps,
        ServiceAccount {
            metadata: ObjectMeta {
                name: Some("default".into()),
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let config = pinswap::config::Config::from_yaml(RBAC_CONFIG, "t").unwrap();
    api.authorize_install(&config, Tls::SelfSigned);
    let seen = as_installed(api.install_client(), apps).await;
    disagreements(&judge, &seen);
    assert_eq!(seen.len(), judge.len());
}

/// With `recovery.namespaces`, the leader reads the labels of only those
/// namespaces, each watched by name (`fieldSelector=metadata.name=NAME`,
/// which RBAC authorises by that name): allowed and refused alike.
async fn namespaces_as_installed(client: kube::Client, watched: &str) -> Vec<(String, Value)> {
    use k8s_openapi::api::core::v1::Namespace;
    let namespaces: Api<Namespace> = Api::all(client);
    let by_name = |n: &str| ListParams::default().fields(&format!("metadata.name={n}"));
    let mut out: Vec<(String, Value)> = Vec::new();
    out.push((
        "list every namespace".into(),
        outcome(namespaces.list(&ListParams::default()).await),
    ));
    let listed = namespaces.list(&by_name(watched)).await;
    let names: Vec<String> = listed
        .as_ref()
        .map(|l| {
            l.items
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect()
        })
        .unwrap_or_default();
    out.push(("list the watched namespace by name".into(), outcome(listed)));
    out.push(("its name".into(), json!(names)));
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={watched}"))
        .timeout(2);
    let watch = namespaces.watch(&wp, "0").await;
    out.push((
        "watch the watched namespace by name".into(),
        outcome(watch.map(|_| ())),
    ));
    out.push((
        "list another namespace by name".into(),
        outcome(namespaces.list(&by_name("default")).await),
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installs_namespace_rbac_allows_a_watch_by_name_alike() {
    use pinswap::install::manifests::Tls;
    let cluster = Cluster::get();
    let _g = cluster.lock().await;
    let admin = cluster.admin().await;
    let watched = "rbac-scope";
    common::cluster::namespace(&admin, watched, json!({})).await;
    let config =
        format!("target: {{registry: m.example}}\nrecovery: {{namespaces: [{watched}]}}\n");
    let install = common::cluster::Install::new(&admin, "pinswap", &config, &[]).await;
    let kubeconfig = cluster
        .service_account_kubeconfig(install.dir.path(), "pinswap", "pinswap")
        .await;
    let token_client = common::cluster::client_from(&kubeconfig).await;
    let judge = namespaces_as_installed(token_client, watched).await;

    common::init();
    let api = KubeApi::start().await;
    api.apply_namespace(watched, &[]);
    api.apply_namespace("default", &[]);
    let config = pinswap::config::Config::from_yaml(&config, "t").unwrap();
    api.authorize_install(&config, Tls::SelfSigned);
    let seen = namespaces_as_installed(api.install_client(), watched).await;
    disagreements(&judge, &seen);
    assert_eq!(judge[0].1["code"], 403, "{judge:?}");
    assert_eq!(judge[1].1, "ok", "{judge:?}");
}
