//! Leadership: only the Lease holder re-mirrors and another takes over; a
//! leader that cannot renew, faces a hanging API server or is partitioned
//! stops before the next one leads, and admission goes on.

mod common;

use std::time::{Duration, Instant};

use common::kube::KubeApi;
use common::recovery::*;
use common::review::pull_failing;
use pinswap::watch::Background;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn with_two_replicas_only_the_lease_holder_remirrors_and_the_other_takes_over() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 431).await;
    let other = push(&src, "other", 432).await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let (mut a, mut b) = (Replica::new(&cfg), Replica::new(&cfg));
    let p = admit_and_store(&a, &api, "web", &app, &dst).await;
    let q = admit_and_store(&b, &api, "api", &other, &dst).await;
    a.start(&cfg, &api);
    b.start(&cfg, &api);
    eventually("one leader", Duration::from_secs(10), || async {
        a.leading() || b.leading()
    })
    .await;
    // Both have read the Lease since one took it: three more Lease
    // requests (retryPeriod 200ms) include a try by each.
    let lease_requests = || {
        api.requests()
            .iter()
            .filter(|q| q.path.ends_with("/leases/pinswap-leader"))
            .count()
    };
    let seen = lease_requests();
    eventually("two more tries", Duration::from_secs(10), || async {
        lease_requests() >= seen + 3
    })
    .await;
    assert!(a.leading() != b.leading(), "exactly one leader");
    let (leader, follower) = if a.leading() {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(leader.metric("pinswap_leader"), 1.0);
    assert_eq!(follower.metric("pinswap_leader"), 0.0);
    let lease = api.lease("pinswap", "pinswap-leader").expect("the Lease");
    assert!(lease.spec.unwrap().holder_identity.is_some());

    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));
    eventually("re-mirrored", Duration::from_secs(20), || {
        served_again(&dst, &app)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        leader.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    assert_eq!(
        follower.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        0.0
    );
    assert_eq!(
        follower.metric("pinswap_pull_failures_total"),
        0.0,
        "the follower does not watch"
    );

    // The leader stops (releasing the Lease); the other takes over and
    // handles the next failure.
    leader.stop().await;
    eventually("the follower leads", Duration::from_secs(10), || async {
        follower.leading()
    })
    .await;
    prune(&dst, &other).await;
    store(&api, &pull_failing(&q, "app", "ErrImagePull"));
    eventually(
        "re-mirrored by the new leader",
        Duration::from_secs(20),
        || served_again(&dst, &other),
    )
    .await;
    assert_eq!(
        follower.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    follower.stop().await;
}

/// Fails every Lease read from now on (an API server partition; kube
/// retries a 503 itself, so plenty are queued) and waits for `r` to step
/// down.
async fn step_down(api: &KubeApi, r: &Replica) {
    for _ in 0..10_000 {
        api.fail_next(
            "GET",
            "/apis/coordination.k8s.io/v1/namespaces/pinswap/leases/pinswap-leader",
            503,
        );
    }
    eventually("stepped down", Duration::from_secs(5), || async {
        !r.leading()
    })
    .await;
}

/// `pinswap_nodes_without_platform` is the leader's: a replica that stops
/// leading no longer reports the nodes it saw (the alert takes the max over
/// replicas, so a stale count would keep it firing).
#[tokio::test]
async fn a_replica_that_stops_leading_reports_no_nodes() {
    let (src, dst, api) = rig().await;
    api.put_node(
        "arm",
        &[
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "arm64"),
        ],
    );
    let cfg = config_with(&src, &dst, "{reverify: 0s}", "platforms: [linux/amd64]\n");
    let mut r = Replica::new(&cfg);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    eventually(
        "the arm64 node counted",
        Duration::from_secs(10),
        || async { r.metric("pinswap_nodes_without_platform") == 1.0 },
    )
    .await;
    step_down(&api, &r).await;
    eventually("no nodes reported", Duration::from_secs(5), || async {
        r.metric("pinswap_nodes_without_platform") == 0.0
    })
    .await;
    r.stop().await;
}

#[tokio::test]
async fn a_leader_that_cannot_renew_stops_within_the_renew_deadline() {
    let (src, dst, api) = rig().await;
    let cfg = config(&src, &dst, "{reverify: 0s}");
    let mut r = Replica::new(&cfg);
    r.start(&cfg, &api);
    wait_leader(&r).await;
    step_down(&api, &r).await;
    // Seen stepped down (no earlier than it did) before the Lease record
    // let anyone else take it: its last renewTime plus its duration.
    let seen = k8s_openapi::jiff::Timestamp::now();
    let spec = api
        .lease("pinswap", "pinswap-leader")
        .and_then(|l| l.spec)
        .expect("the Lease");
    let renewed = spec.renew_time.expect("renewTime").0;
    let expires = renewed
        + k8s_openapi::jiff::SignedDuration::from_secs(
            spec.lease_duration_seconds
                .expect("leaseDurationSeconds")
                .into(),
        );
    assert!(
        seen < expires,
        "still leading at {seen}, after the Lease renewed at {renewed} expired at {expires}"
    );
    r.stop().await;
}

/// A black-hole partition: the API server accepts connections but never
/// answers (no reset, no 503). The leader must still step down on its own
/// clock, admission must go on as before, and once the API server answers
/// again the replica leads again and catches up on what it missed.
#[tokio::test]
async fn a_leader_facing_a_hanging_api_server_steps_down_and_admission_goes_on() {
    let (src, dst, api) = rig().await;
    let app = push(&src, "app", 445).await;
    let later = push(&src, "later", 446).await;
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
    let lease_path = "/apis/coordination.k8s.io/v1/namespaces/pinswap/leases/pinswap-leader";
    let lease_reads = |api: &KubeApi| {
        api.requests()
            .iter()
            .filter(|q| q.method == "GET" && q.path == lease_path)
            .count()
    };

    api.black_hole(true);
    let before = lease_reads(&api);
    // Stepped down while its renewal attempts hang unanswered.
    eventually("stepped down", Duration::from_secs(10), || async {
        !r.leading()
    })
    .await;
    assert!(
        lease_reads(&api) > before,
        "the leader did not try to renew during the partition"
    );
    assert_eq!(r.metric("pinswap_leader"), 0.0);
    // Admission needs no API server: a new image is mirrored and pinned.
    admit_and_store(&r, &api, "new", &later, &dst).await;
    assert!(served_again(&dst, &later).await);
    // A pull failure while partitioned: the watch delivers nothing now.
    prune(&dst, &app).await;
    store(&api, &pull_failing(&p, "app", "ErrImagePull"));

    api.black_hole(false);
    wait_leader(&r).await;
    eventually(
        "re-mirrored once the API server answers",
        Duration::from_secs(20),
        || served_again(&dst, &app),
    )
    .await;
    assert_eq!(
        r.metric("pinswap_remirrors_total{outcome=\"remirrored\"}"),
        1.0
    );
    r.stop().await;
}

/// How leader A loses the API server.
#[derive(Clone, Copy, Debug)]
enum Partition {
    /// Connections reset, new ones refused.
    Reset,
    /// Connections stay open and new ones are accepted, but nothing is
    /// answered (a black hole).
    Hang,
}

/// A valid Lease config (retryPeriod < renewDeadline < duration) with
/// renewDeadline + retryPeriod > duration: a partitioned leader must still
/// stop before its Lease expires and another replica leads.
#[tokio::test]
async fn a_partitioned_leader_stops_before_the_next_one_leads() {
    partitioned_leader_stops_before_the_next_one_leads(Partition::Reset).await;
}

/// As above, with a partition that answers nothing rather than resetting:
/// A's renewals hang, and A must step down on its own clock.
#[tokio::test]
async fn a_leader_behind_a_black_hole_stops_before_the_next_one_leads() {
    partitioned_leader_stops_before_the_next_one_leads(Partition::Hang).await;
}

async fn partitioned_leader_stops_before_the_next_one_leads(partition: Partition) {
    let (src, dst, api) = rig().await;
    let lease = "recovery:\n  lease: {duration: 2s, renewDeadline: 1900ms, retryPeriod: 1800ms}\n";
    let yaml = |lease: &str| {
        format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncache: {{reverify: 0s}}\n{lease}",
            dst.host(),
            src.host()
        )
    };
    let cfg_a = yaml_config(&yaml(lease));
    // B: the same Lease, polling often (equivalently: B's poll happened to
    // land right after A's last renewal).
    let cfg_b = yaml_config(&yaml(
        "recovery:\n  lease: {duration: 2s, renewDeadline: 1900ms, retryPeriod: 100ms}\n",
    ));
    let proxy = common::TcpCutProxy::start(api.url().trim_start_matches("http://")).await;
    let mut kc = ::kube::Config::new(format!("http://{}", proxy.host()).parse().unwrap());
    kc.default_namespace = "default".into();
    let client_a = ::kube::Client::try_from(kc).unwrap();
    let (ra, rb) = (Replica::new(&cfg_a), Replica::new(&cfg_b));
    let a = Background::start(
        ra.adm.mirror().clone(),
        &cfg_a,
        Some(client_a),
        CancellationToken::new(),
    );
    eventually("A leads", Duration::from_secs(10), || async {
        a.is_leader()
    })
    .await;
    let b = Background::start(
        rb.adm.mirror().clone(),
        &cfg_b,
        Some(api.client()),
        CancellationToken::new(),
    );
    // Cut A right after one of its renewals.
    let renew = |api: &KubeApi| {
        api.lease("default", "pinswap-leader")
            .and_then(|l| l.spec?.renew_time)
            .map(|t| t.0)
    };
    let first = renew(&api);
    eventually("A renews", Duration::from_secs(5), || async {
        renew(&api) != first
    })
    .await;
    let holder = |api: &KubeApi| {
        api.lease("default", "pinswap-leader")
            .and_then(|l| l.spec?.holder_identity)
    };
    let a_holder = holder(&api).expect("A holds the Lease");
    match partition {
        Partition::Reset => proxy.cut(),
        Partition::Hang => proxy.black_hole(true),
    }
    let start = Instant::now();
    let mut both = None;
    let mut b_led = false;
    while start.elapsed() < Duration::from_secs(6) {
        if a.is_leader() && b.is_leader() {
            both = Some(start.elapsed());
            break;
        }
        b_led |= b.is_leader();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (a_leads, b_leads) = (a.is_leader(), b.is_leader());
    let b_holder = holder(&api);
    b.stop().await;
    drop(a);
    assert!(
        both.is_none(),
        "two leaders at once, {:?} after A was cut off ({partition:?}; A {a_leads}, B {b_leads})",
        both
    );
    assert!(
        !a_leads,
        "A still leads 6 s into the partition ({partition:?})"
    );
    // And the other one does lead: B took the Lease over from A.
    assert!(b_led, "B never led after A was cut off");
    assert!(
        b_holder.as_ref().is_some_and(|h| *h != a_holder),
        "the Lease still names {a_holder} ({b_holder:?})"
    );
}
