//! Self-test of the in-process Kubernetes API server, continued: Events and
//! their limits, Leases, workloads, and authorisation as the install
//! grants it.

mod common;

use common::api_objects::*;
use common::kube::{KubeApi, dockerconfigjson_secret};
use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event as CoreEvent, ObjectReference, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

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
