//! Two `pinswap serve` processes sharing one target and one Lease, as two
//! replicas of the Deployment: concurrent first admissions of the same
//! images, then the leader killed mid-recovery duty.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::front::Front;
use common::kube::KubeApi;
use common::review::{apply_patch, create_review, pod, pull_failing};
use common::serve::Served;
use common::{Image, Index, TestRegistry, push_image, push_index};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

/// Lease timings short enough to play out in seconds (as tests/recovery.rs).
const DURATION: Duration = Duration::from_secs(2);
const RETRY_PERIOD: Duration = Duration::from_millis(200);

/// The config both replicas load (every key but `server`); `target` is
/// the target registry's `host:port`.
fn body(src: &TestRegistry, target: &str) -> String {
    format!(
        "target: {{registry: \"{}/mirror\"}}\n\
         source: {{registries: [{{registry: \"{}\"}}]}}\n\
         copyPolicy: immediate\ncopyDeadline: 8s\n\
         cache: {{reverify: 0s}}\n\
         recovery:\n  retryInitial: 300ms\n  retryMax: 2s\n  \
         lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\n",
        target,
        src.host()
    )
}

/// A kubeconfig for the in-process API server, namespace `pinswap`.
fn kubeconfig(api: &KubeApi, dir: &Path) -> String {
    api.kubeconfig(dir).to_str().unwrap().to_owned()
}

async fn start_replica(body: &str, name: &str, kubeconfig: &str) -> Served {
    Served::start_with(
        body,
        "admissionBudget: 8s",
        &[
            ("KUBECONFIG", kubeconfig),
            ("POD_NAME", name),
            ("POD_NAMESPACE", "pinswap"),
        ],
        None,
    )
    .await
}

/// Sends `review` to `replica`; the Pod as the API server would store it.
async fn admit_via(replica: &Served, review: &Value, pod: &Value) -> Value {
    let resp = replica
        .send(&replica.client(), &review.to_string())
        .await
        .expect("an answer");
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    let response = &answer["response"];
    assert_eq!(response["allowed"], true, "{response}");
    let mut patched = pod.clone();
    apply_patch(response, &mut patched).expect("a patch");
    patched
}

/// The digests Distribution stores as manifest revisions of `repo`, read
/// from its storage: every manifest ever accepted there, tagged or not.
fn revisions(dst: &TestRegistry, repo: &str) -> BTreeSet<String> {
    let dir = dst
        .storage_dir()
        .join("docker/registry/v2/repositories")
        .join(repo)
        .join("_manifests/revisions/sha256");
    match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .map(|e| format!("sha256:{}", e.unwrap().file_name().to_string_lossy()))
            .collect(),
        Err(_) => BTreeSet::new(),
    }
}

/// The Lease record: (holder, acquireTime, renewTime).
type Record = (
    Option<String>,
    Option<k8s_openapi::jiff::Timestamp>,
    Option<k8s_openapi::jiff::Timestamp>,
);

fn lease(api: &KubeApi) -> Record {
    let spec = api
        .lease("pinswap", "pinswap-leader")
        .and_then(|l| l.spec)
        .unwrap_or_default();
    (
        spec.holder_identity,
        spec.acquire_time.map(|t| t.0),
        spec.renew_time.map(|t| t.0),
    )
}

async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Both replicas admit the same new images at once: each answer pins every
/// image to the target, the target holds one complete copy (each manifest
/// stored once, byte for byte, every blob present), neither replica pushed
/// any blob or manifest twice, and the Lease elects
/// exactly one of them. Killing that one hands recovery to the other: it
/// takes the Lease within a lease duration of the last renewal, as recorded
/// in the Lease, and mirrors a lost image again on the next pull failure.
#[tokio::test]
async fn two_replicas_share_a_target_and_hand_over_recovery() {
    common::init();
    let (src, dst, api) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        KubeApi::start().await,
    );
    let images = [Image::oci(3, 7101), Image::docker(2, 7102)];
    push_image(&src, "shop/a", Some("v1"), &images[0]).await;
    push_image(&src, "shop/b", Some("v1"), &images[1]).await;
    let index = Index::oci(7103, true);
    push_index(&src, "shop/multi", Some("v1"), &index).await;
    let repo = |name: &str| format!("mirror/127.0.0.1_{}/shop/{name}", src.port());

    // Each replica pushes through a recording front of its own: the
    // registry is content-addressed, so only the pushes show a duplicate.
    let fronts = [
        Front::start(&dst.host()).await,
        Front::start(&dst.host()).await,
    ];
    let bodies = [body(&src, &fronts[0].host()), body(&src, &fronts[1].host())];
    let config = pinswap::config::Config::from_yaml(&bodies[0], "replicas.yaml").unwrap();
    api.authorize_install(&config, pinswap::install::manifests::Tls::CertManager);
    let dir = tempfile::tempdir().unwrap();
    let kc = kubeconfig(&api, dir.path());
    let (a, b) = tokio::join!(
        start_replica(&bodies[0], "replica-a", &kc),
        start_replica(&bodies[1], "replica-b", &kc)
    );

    // Three concurrent first admissions per replica, of one Pod that runs
    // all three images.
    let the_pod = pod(
        "shop",
        "web",
        &[
            ("a", &format!("{}/shop/a:v1", src.host())),
            ("b", &format!("{}/shop/b:v1", src.host())),
            ("multi", &format!("{}/shop/multi:v1", src.host())),
        ],
    );
    let review = create_review(&the_pod);
    let sends = (0..6).map(|i| {
        let replica = if i % 2 == 0 { &a } else { &b };
        admit_via(replica, &review, &the_pod)
    });
    let answers = futures::future::join_all(sends).await;
    let want = |target: String| {
        [
            format!("{target}/{}:v1@{}", repo("a"), images[0].digest),
            format!("{target}/{}:v1@{}", repo("b"), images[1].digest),
            format!("{target}/{}:v1@{}", repo("multi"), index.digest),
        ]
    };
    for (i, patched) in answers.iter().enumerate() {
        let decoded: Pod = serde_json::from_value(patched.clone()).expect("a valid Pod");
        let got: Vec<String> = decoded
            .spec
            .unwrap()
            .containers
            .into_iter()
            .map(|c| c.image.unwrap())
            .collect();
        assert_eq!(
            got,
            want(fronts[i % 2].host()),
            "answer {i} ({}): {}",
            ["a", "b"][i % 2],
            patched["metadata"]["annotations"]["pinswap.dev/decisions"]
        );
    }

    // One complete copy: tag → digest, manifest bytes, every blob, and no
    // manifest revision beyond the ones the source holds.
    for (img, name) in images.iter().zip(["a", "b"]) {
        let (bytes, _, _) = dst.get_manifest(&repo(name), "v1").await.unwrap();
        common::assert_bytes_eq(&bytes, &img.manifest, name);
        for blob in img.blobs() {
            let got = dst.blob(&repo(name), &blob.digest).await;
            common::assert_bytes_eq(got.as_deref().unwrap_or_default(), &blob.bytes, name);
        }
        assert_eq!(
            revisions(&dst, &repo(name)),
            BTreeSet::from([img.digest.clone()])
        );
        assert_eq!(dst.tags(&repo(name)).await, ["v1"]);
    }
    let (bytes, _, _) = dst.get_manifest(&repo("multi"), "v1").await.unwrap();
    common::assert_bytes_eq(&bytes, &index.manifest, "index");
    let mut want_revisions = BTreeSet::from([index.digest.clone()]);
    for child in &index.children {
        let (bytes, _, _) = dst
            .get_manifest(&repo("multi"), &child.digest)
            .await
            .unwrap();
        common::assert_bytes_eq(&bytes, &child.manifest, &child.digest);
        for blob in child.blobs() {
            assert!(
                dst.blob_exists(&repo("multi"), &blob.digest).await,
                "{}",
                blob.digest
            );
        }
        want_revisions.insert(child.digest.clone());
    }
    assert_eq!(revisions(&dst, &repo("multi")), want_revisions);
    // Each replica pushed it at most once: one completed upload (or
    // mount) per blob and one accepted PUT per manifest, whatever its
    // three concurrent admissions did. Both may have pushed it: copies are
    // deduplicated within a process, not across replicas. A PUT that the
    // registry refused while the other replica's writes were landing, and
    // that was asked again, is not a second push.
    let count = |front: &Front, repo: &str, is: &dyn Fn(&str, &str) -> bool| {
        let prefix = format!("/v2/{repo}/");
        front
            .answered()
            .iter()
            .filter(|(m, p, status)| {
                (200..300).contains(status) && p.starts_with(&prefix) && is(m, p)
            })
            .count()
    };
    let blob_pushes = |front: &Front, repo: &str, digest: &str| {
        let hex = digest.trim_start_matches("sha256:").to_owned();
        count(front, repo, &|m, p| {
            p.contains(&hex)
                && ((m == "PUT" && p.contains("/blobs/uploads/"))
                    || (m == "POST" && p.contains("mount=")))
        })
    };
    let manifest_puts = |front: &Front, repo: &str, reference: &str| {
        let end = format!("/manifests/{reference}");
        count(front, repo, &|m, p| m == "PUT" && p.ends_with(&end))
    };
    let mut pushed = Vec::new();
    for (name, blobs, manifests) in [
        (
            "a",
            images[0].blobs().collect::<Vec<_>>(),
            vec!["v1".to_owned()],
        ),
        ("b", images[1].blobs().collect(), vec!["v1".to_owned()]),
        (
            "multi",
            index.children.iter().flat_map(|c| c.blobs()).collect(),
            std::iter::once("v1".to_owned())
                .chain(index.children.iter().map(|c| c.digest.clone()))
                .collect(),
        ),
    ] {
        let blobs: BTreeSet<&str> = blobs.iter().map(|b| b.digest.as_str()).collect();
        for digest in blobs {
            let n = fronts
                .each_ref()
                .map(|f| blob_pushes(f, &repo(name), digest));
            pushed.push((name, digest.to_owned(), n));
        }
        for reference in manifests {
            let n = fronts
                .each_ref()
                .map(|f| manifest_puts(f, &repo(name), &reference));
            pushed.push((name, reference, n));
        }
    }
    let wrong: Vec<_> = pushed
        .iter()
        .filter(|(_, _, n)| n.iter().any(|&k| k > 1) || n.iter().sum::<usize>() == 0)
        .collect();
    assert!(
        wrong.is_empty(),
        "pushed more than once by one replica, or never: {wrong:?}"
    );

    // One leader.
    eventually("a leader", Duration::from_secs(15), || async {
        lease(&api).0.is_some()
    })
    .await;
    let holder = lease(&api).0.unwrap();
    let (mut leader, follower, follower_name, follows) = if holder.starts_with("replica-a_") {
        (a, b, "replica-b_", 1)
    } else {
        assert!(holder.starts_with("replica-b_"), "holder {holder}");
        (b, a, "replica-a_", 0)
    };
    // A Pod as the follower rewrote it: its images are under its target.
    let stored = &answers[follows];
    api.apply_pod(serde_json::from_value::<Pod>(stored.clone()).unwrap());

    // Kill the leader right after one of its renewals; no release.
    let renewed = lease(&api).2;
    eventually("a renewal", Duration::from_secs(5), || async {
        lease(&api).2 != renewed
    })
    .await;
    leader.child.start_kill().unwrap();
    leader.child.wait().await.unwrap();
    let (_, _, last_renewal) = lease(&api);
    let last_renewal = last_renewal.expect("the leader renewed");

    // The image is lost at the target and a kubelet reports the failure.
    dst.delete_manifest(&repo("a"), &images[0].digest).await;
    dst.delete_blob(&repo("a"), &images[0].layers[0].digest)
        .await;
    assert_eq!(dst.head_manifest(&repo("a"), "v1").await, None);
    api.apply_pod(
        serde_json::from_value::<Pod>(pull_failing(stored, "a", "ErrImagePull")).unwrap(),
    );

    eventually(
        "the other replica mirrors it again",
        Duration::from_secs(30),
        || async {
            dst.head_manifest(&repo("a"), "v1").await.as_deref() == Some(images[0].digest.as_str())
        },
    )
    .await;
    let (bytes, _, _) = dst.get_manifest(&repo("a"), "v1").await.unwrap();
    common::assert_bytes_eq(&bytes, &images[0].manifest, "re-mirrored manifest");
    let layer = dst.blob(&repo("a"), &images[0].layers[0].digest).await;
    common::assert_bytes_eq(
        layer.as_deref().unwrap_or_default(),
        &images[0].layers[0].bytes,
        "re-mirrored layer",
    );
    let (holder, acquired, _) = lease(&api);
    let holder = holder.unwrap_or_default();
    assert!(
        holder.starts_with(follower_name),
        "the Lease names {holder}"
    );
    // The follower waits out `duration` from when it saw the last renewal,
    // which it sees within one `retryPeriod`, and then acquires at its next
    // try; one more second covers scheduling on a loaded machine.
    let acquired = acquired.expect("acquireTime");
    assert!(
        acquired > last_renewal,
        "acquired {acquired} before {last_renewal}"
    );
    let took = acquired.duration_since(last_renewal).unsigned_abs();
    let bound = DURATION + 2 * RETRY_PERIOD + Duration::from_secs(1);
    assert!(
        took <= bound,
        "took the Lease {took:?} after the last renewal (bound {bound:?})"
    );
    let remirrored: Vec<Value> = api
        .events()
        .into_iter()
        .filter(|e| {
            e["reason"] == pinswap::watch::recovery::REMIRRORED && e["regarding"]["name"] == "web"
        })
        .collect();
    assert_eq!(remirrored.len(), 1, "{remirrored:?}");
    assert!(api.forbidden().is_empty(), "refused: {:?}", api.forbidden());
    let (status, text) = follower.health_get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(
        common::metrics::sample(
            &text,
            "pinswap_remirrors_total",
            &[("outcome", "remirrored")]
        ),
        Some(1.0),
        "{text}"
    );
}
