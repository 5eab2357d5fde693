//! pinswap at the size of a fleet sharing one mirror, through a real
//! kube-apiserver (docs/benchmarks.md "At fleet scale"). A measurement, not
//! a test: `scripts/bench-scale.sh fleet` runs it.
//!
//! The target holds 100,000 images (10,000 repositories of 10 tags). 49
//! other clusters are their usage records, about 2,000 images each and
//! overlapping (93,200 images in all), published at the target as their
//! leaders would. This cluster runs 200,000 Pods (50 namespaces) sharing
//! 900 images, and its leader runs retention with sharing on. What nobody
//! uses, the other 5,900 images, is also at the source, so that retention
//! may remove it. Registries are
//! real Distribution processes; the target sits behind a counting front.
//!
//! Figures: the time from the leader's start to its first complete usage
//! record; one retention pass's requests, and what it removed, read back
//! from the registry; a 100,000-image record's update after one new image.
//! `BENCH_REPOS`, `BENCH_TAGS` and `BENCH_FLEET_PODS` shrink it.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TestRegistry;
use common::cluster::{Cluster, Install, namespace};
use common::fixtures::{Blob, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST};
use common::front::Front;
use common::metrics::sample;
use common::push::push_blob;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use pinswap::retention::clusters::{ClusterRecord, Present, Records};
use serde_json::json;

/// Where every image is, and who uses it.
struct Fleet {
    repos: usize,
    tags: usize,
    pods: usize,
    /// Images `[c * step, c * step + per_cluster)` are other cluster `c`'s.
    clusters: usize,
    per_cluster: usize,
    step: usize,
    /// Images this cluster's Pods name.
    local: std::ops::Range<usize>,
}

const NAMESPACES: usize = 50;

impl Fleet {
    fn from_env() -> Fleet {
        let count = |var: &str, default: usize| {
            std::env::var(var)
                .map(|v| v.parse().unwrap_or_else(|_| panic!("{var}: a count")))
                .unwrap_or(default)
        };
        let (repos, tags) = (count("BENCH_REPOS", 10_000), count("BENCH_TAGS", 10));
        let images = repos * tags;
        assert!(
            images >= 1_000,
            "BENCH_REPOS × BENCH_TAGS: at least 1,000 images"
        );
        // 49 others, each naming 2% of the images and overlapping the
        // next by a twentieth of that; this cluster uses 0.9% more.
        let (per_cluster, clusters) = (images / 50, 49);
        let step = per_cluster * 19 / 20;
        let claimed = (clusters - 1) * step + per_cluster;
        Fleet {
            repos,
            tags,
            pods: count("BENCH_FLEET_PODS", 200_000),
            clusters,
            per_cluster,
            step,
            local: claimed..claimed + images * 9 / 1000,
        }
    }

    fn images(&self) -> usize {
        self.repos * self.tags
    }

    /// Image `i`: its repository and tag.
    fn place(&self, i: usize) -> (usize, String) {
        (i / self.tags, format!("v{}", i % self.tags))
    }

    fn unused(&self) -> std::ops::Range<usize> {
        self.local.end..self.images()
    }
}

/// Image `i`'s manifest: one shared config and layer, an annotation of its
/// own (a digest of its own).
fn manifest(config: &Blob, layer: &Blob, i: usize) -> (Vec<u8>, String) {
    let bytes = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config.descriptor(),
        "layers": [layer.descriptor()],
        "annotations": {"dev.pinswap.bench.image": i.to_string()},
    }))
    .unwrap();
    let digest = common::sha256_digest(&bytes);
    (bytes, digest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test; scripts/bench-scale.sh fleet runs it"]
async fn fleet_figures() {
    common::init();
    let fleet = Fleet::from_env();
    let cluster = Cluster::another();
    let client = cluster.admin().await;
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    let dst_front = Front::start(&dst.host()).await;
    let path = format!("mirror/{}", src.host().replace(':', "_"));
    let config = Blob::new(
        OCI_CONFIG,
        br#"{"architecture":"amd64","os":"linux"}"#.to_vec(),
    );
    let layer = Blob::new(OCI_LAYER_GZIP, common::fixtures::gzip(b"fleet"));

    // The images: every one at the target, the unused ones at the source.
    // The blobs go in through the API once; the repositories are written
    // into the registries' storage, in Distribution's layout, which the
    // API then serves (a push of 100,000 manifests takes minutes here).
    let t = Instant::now();
    let unused = fleet.unused();
    for reg in [&src, &dst] {
        push_blob(reg, "seed", &config).await;
        push_blob(reg, "seed", &layer).await;
    }
    let digests: Vec<String> = {
        let (src, dst, config, layer, path, fleet, unused) =
            (&src, &dst, &config, &layer, &path, &fleet, &unused);
        futures::stream::iter(0..fleet.repos)
            .map(|r| async move {
                let mut out = Vec::new();
                for i in r * fleet.tags..(r + 1) * fleet.tags {
                    let (bytes, digest) = manifest(config, layer, i);
                    let tag = fleet.place(i).1;
                    let blobs = [&config.digest, &layer.digest];
                    seed(
                        dst,
                        &format!("{path}/app{r}"),
                        &blobs,
                        &tag,
                        &bytes,
                        &digest,
                    );
                    if unused.contains(&i) {
                        seed(src, &format!("app{r}"), &blobs, &tag, &bytes, &digest);
                    }
                    out.push(digest);
                }
                out
            })
            .buffered(4)
            .flat_map(futures::stream::iter)
            .collect()
            .await
    };
    println!(
        "fleet: {} images in {} repositories pushed in {:.0} s",
        fleet.images(),
        fleet.repos,
        t.elapsed().as_secs_f64()
    );

    // The other clusters: their records, as their leaders publish them.
    let base = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n",
        dst.host(),
        src.host()
    );
    let direct = mirror_of(&base).await;
    let records = Records::of(&direct).await.unwrap();
    let key = |i: usize| {
        let (r, _) = fleet.place(i);
        format!("{path}/app{r}@{}", digests[i])
    };
    let t = Instant::now();
    for c in 0..fleet.clusters {
        let now = Timestamp::now();
        let images: BTreeMap<String, Timestamp> = (c * fleet.step
            ..c * fleet.step + fleet.per_cluster)
            .map(|i| (key(i), now))
            .collect();
        let record = ClusterRecord {
            cluster: format!("east-{c}"),
            updated: now,
            complete: true,
            in_use: images.len(),
            images,
            quotas: Vec::new(),
        };
        records
            .publish(&record, &mut Present::default())
            .await
            .unwrap();
    }
    println!(
        "fleet: {} other clusters' records published in {:.1} s",
        fleet.clusters,
        t.elapsed().as_secs_f64()
    );

    // This cluster's Pods, as admission leaves them.
    for n in 0..NAMESPACES {
        namespace(&client, &format!("team-{n}"), json!({})).await;
    }
    let t = Instant::now();
    let local = fleet.local.clone();
    let created = futures::stream::iter(0..fleet.pods)
        .map(|p| {
            let client = client.clone();
            let i = local.start + p % local.len();
            let (r, tag) = fleet.place(i);
            let ns = format!("team-{}", p % NAMESPACES);
            let image = format!("{}/{path}/app{r}:{tag}@{}", dst_front.host(), digests[i]);
            let source = format!("{}/app{r}:{tag}", src.host());
            let pod = json!({
                "metadata": {"name": format!("web-{p:06}"), "namespace": ns,
                    "annotations": {"pinswap.dev/original-images":
                        json!({"containers/app": source}).to_string()}},
                "spec": {"containers": [{"name": "app", "image": image}]},
            });
            async move {
                let pod: Pod = serde_json::from_value(pod).unwrap();
                let api: Api<Pod> = Api::namespaced(client, &ns);
                for tries in 0.. {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => break,
                        Err(e) if tries < 5 => {
                            eprintln!("create Pod {p}: {e}; again");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err(e) => panic!("create Pod {p}: {e}"),
                    }
                }
            }
        })
        .buffer_unordered(48)
        .count()
        .await;
    println!(
        "fleet: {created} Pods created in {:.0} s",
        t.elapsed().as_secs_f64()
    );

    // The leader: sharing and retention on, nothing else at the registries.
    let served_config = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n\
         cluster: local\nsharing: {{enabled: true, keepFor: 60s}}\n\
         retention: {{enabled: true, interval: 60s, unusedFor: 60s}}\n\
         backfill: {{enabled: false}}\nidentity: {{scanRate: 0}}\ncache: {{reverify: 0s}}\n",
        dst_front.host(),
        src.host()
    );
    let install = Install::new(&client, "pinswap-fleet", &served_config, &[]).await;
    let mut served = install.serve(&cluster, "fleet-0").await;
    let t = Instant::now();
    let (mut leading, mut synced, mut recorded) = (None, None, None);
    let mut record_digest = String::new();
    while recorded.is_none() {
        let text = served.health_get("/metrics").await.1;
        let at = t.elapsed().as_secs_f64();
        if leading.is_none() && sample(&text, "pinswap_leader", &[]) == Some(1.0) {
            leading = Some(at);
        }
        if synced.is_none() && sample(&text, "pinswap_usage_synced", &[]) == Some(1.0) {
            synced = Some(at);
        }
        if let Some((digest, head)) = record_head(&dst, "local").await
            && head["dev.pinswap.complete"] == "true"
        {
            recorded = Some(at);
            record_digest = digest;
        }
        assert!(
            t.elapsed() < Duration::from_secs(900),
            "no complete record: leading {leading:?}, synced {synced:?}; log:\n{}",
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "fleet: leader after {:.1} s, synced after {:.1} s, first complete record ({record_digest}) after {:.1} s, at {} Pods",
        leading.unwrap_or(f64::NAN),
        synced.unwrap_or(f64::NAN),
        recorded.unwrap(),
        fleet.pods
    );

    // Retention: the first pass meets every image; the second removes what
    // nobody used since.
    let passes = |text: &str| {
        sample(
            text,
            "pinswap_retention_passes_total",
            &[("outcome", "done")],
        )
        .unwrap_or(0.0)
    };
    let wait_pass = |n: f64| {
        let served = &served;
        async move {
            let t = Instant::now();
            loop {
                let text = served.health_get("/metrics").await.1;
                if passes(&text) >= n {
                    return (t.elapsed().as_secs_f64(), text);
                }
                assert!(
                    t.elapsed() < Duration::from_secs(1800),
                    "no retention pass {n}: {}",
                    text.lines()
                        .filter(|l| l.starts_with("pinswap_retention"))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let (first_s, _) = wait_pass(1.0).await;
    dst_front.reset();
    let (second_s, text) = wait_pass(2.0).await;
    let requests = dst_front.requests();
    let rss = served.status_kib("VmRSS");
    let hwm = served.status_kib("VmHWM");
    served.sigterm();
    let _ = tokio::time::timeout(Duration::from_secs(20), served.child.wait()).await;
    let by_kind = |want: &dyn Fn(&str, &str) -> bool| {
        requests.iter().filter(|(m, p)| want(m, p)).fold(
            BTreeMap::<String, usize>::new(),
            |mut m, (method, p)| {
                *m.entry(format!("{method} {}", kind(p))).or_default() += 1;
                m
            },
        )
    };
    let records_path = "/mirror/pinswap-usage/";
    let on_images = by_kind(&|_, p| !p.contains(records_path) && !p.contains("/_catalog"));
    let on_records = by_kind(&|_, p| p.contains(records_path));
    let catalog = requests
        .iter()
        .filter(|(_, p)| p.contains("/_catalog"))
        .count();
    let state = |s: &str| sample(&text, "pinswap_retention_images", &[("state", s)]);
    println!(
        "fleet: retention pass 1 done {first_s:.0} s after the record; pass 2 {second_s:.0} s later: {catalog} catalog pages; image requests {on_images:?}; record requests {on_records:?}; images by state: {:?}",
        text.lines()
            .filter(|l| l.starts_with("pinswap_retention_images{"))
            .collect::<Vec<_>>()
    );

    // What is left at the target, from the registry itself.
    let left: Vec<BTreeSet<String>> = futures::stream::iter(0..fleet.repos)
        .map(|r| {
            let (dst, path) = (&dst, &path);
            async move { tags_of(dst, &format!("{path}/app{r}")).await }
        })
        .buffered(16)
        .collect()
        .await;
    let (mut kept_wrongly, mut removed_wrongly) = (0, 0);
    for i in 0..fleet.images() {
        let (r, tag) = fleet.place(i);
        match (unused.contains(&i), left[r].contains(&tag)) {
            (true, true) => kept_wrongly += 1,
            (false, false) => removed_wrongly += 1,
            _ => {}
        }
    }
    let removed = unused.len() - kept_wrongly;
    println!(
        "fleet: at the target after pass 2: {removed} of the {} unused images removed, {kept_wrongly} left, {removed_wrongly} used images missing",
        unused.len()
    );

    // One record of every image at the target, then one image more.
    let via_front = mirror_of(&base.replace(&dst.host(), &dst_front.host())).await;
    let big = Records::of(&via_front).await.unwrap();
    let now = Timestamp::now();
    let mut record = ClusterRecord {
        cluster: "big".into(),
        updated: now,
        complete: true,
        in_use: fleet.images(),
        images: (0..fleet.images()).map(|i| (key(i), now)).collect(),
        quotas: Vec::new(),
    };
    let mut present = Present::default();
    let (whole, _) = big.publish(&record, &mut present).await.unwrap();
    record.images.insert(
        format!("{path}/app0@sha256:{:064x}", fleet.images()),
        Timestamp::now(),
    );
    record.in_use += 1;
    // As a leader publishes: what is in use was last used at `updated`.
    record.updated = Timestamp::now();
    for last in record.images.values_mut() {
        *last = record.updated;
    }
    dst_front.reset();
    let (uploaded, _) = big.publish(&record, &mut present).await.unwrap();
    let update = dst_front.requests().len();
    println!(
        "fleet: a record of {} images ({whole} bytes of shards): one image more uploads {uploaded} bytes in {update} requests",
        fleet.images()
    );

    let tag_lists = on_images.get("GET tags").copied().unwrap_or(0);
    let heads = on_images.get("HEAD manifest").copied().unwrap_or(0);
    let goal = |met: bool, goal: &str| format!("{goal}: {}", if met { "met" } else { "missed" });
    let table = [
        [
            format!(
                "retention pass over {} images in {} repositories, {} other clusters' records",
                fleet.images(),
                fleet.repos,
                fleet.clusters
            ),
            format!(
                "removed {removed} of {} unused; {removed_wrongly} in use removed",
                unused.len()
            ),
            goal(
                kept_wrongly == 0 && removed_wrongly == 0,
                "exactly the unused images",
            ),
        ],
        [
            String::from("that pass's requests"),
            format!(
                "{catalog} catalog pages, {tag_lists} tag lists, {heads} HEADs at the target; {} to the records",
                on_records.values().sum::<usize>()
            ),
            goal(
                tag_lists + heads <= fleet.repos + removed,
                "one a repository plus paging (and one tag list for each image removed)",
            ),
        ],
        [
            format!("a {}-image record, one image more", fleet.images()),
            format!("{update} requests, {uploaded} bytes"),
            goal(
                update <= 5 && uploaded <= 64 * 1024,
                "≤ 5 requests, ≤ 64 KB",
            ),
        ],
        [
            format!(
                "leader start to its first complete record, {} Pods",
                fleet.pods
            ),
            format!("{:.1} s", recorded.unwrap()),
            goal(recorded.unwrap() <= 30.0, "≤ 30 s"),
        ],
        [
            String::from("leader memory after the passes"),
            format!(
                "{:.1} MiB (peak {:.1} MiB)",
                rss as f64 / 1024.0,
                hwm as f64 / 1024.0
            ),
            String::from("-"),
        ],
    ];
    println!("fleet | what | figure | goal |");
    println!("fleet |---|---|---|");
    for [what, figure, goal] in &table {
        println!("fleet | {what} | {figure} | {goal} |");
    }
    assert_eq!(
        (kept_wrongly, removed_wrongly),
        (0, 0),
        "retention removes exactly the unused images"
    );
    assert!(state("in_use").is_some_and(|n| n > 0.0), "{text}");
}

/// Writes manifest `bytes` into `reg`'s storage under `repo:tag`, linking
/// `blobs` (already stored) into `repo`.
fn seed(reg: &TestRegistry, repo: &str, blobs: &[&String], tag: &str, bytes: &[u8], digest: &str) {
    let link = |path: std::path::PathBuf, digest: &str| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, digest).unwrap();
    };
    let hex = |d: &str| d.strip_prefix("sha256:").unwrap().to_owned();
    let root = reg.storage_dir().join("docker/registry/v2");
    let data = reg.blob_data_path(digest);
    std::fs::create_dir_all(data.parent().unwrap()).unwrap();
    std::fs::write(&data, bytes).unwrap();
    let repo = root.join("repositories").join(repo);
    for b in blobs {
        link(repo.join("_layers/sha256").join(hex(b)).join("link"), b);
    }
    let manifests = repo.join("_manifests");
    link(
        manifests
            .join("revisions/sha256")
            .join(hex(digest))
            .join("link"),
        digest,
    );
    link(
        manifests.join("tags").join(tag).join("current/link"),
        digest,
    );
    link(
        manifests
            .join("tags")
            .join(tag)
            .join("index/sha256")
            .join(hex(digest))
            .join("link"),
        digest,
    );
}

async fn mirror_of(config: &str) -> pinswap::mirror::Mirror {
    let config = pinswap::config::Config::from_yaml(config, "fleet.yaml").unwrap();
    pinswap::mirror::Mirror::connect(&config, Arc::new(pinswap::metrics::Metrics::new()))
        .await
        .unwrap()
}

/// The digest and annotations of cluster `name`'s usage record.
async fn record_head(dst: &TestRegistry, name: &str) -> Option<(String, serde_json::Value)> {
    let resp = dst
        .request(
            http::Method::GET,
            &format!("/v2/mirror/pinswap-usage/manifests/{name}"),
        )
        .header("accept", OCI_MANIFEST)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let bytes = resp.bytes().await.ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    Some((common::sha256_digest(&bytes), v["annotations"].clone()))
}

async fn tags_of(dst: &TestRegistry, repo: &str) -> BTreeSet<String> {
    let resp = dst
        .request(http::Method::GET, &format!("/v2/{repo}/tags/list"))
        .send()
        .await
        .unwrap();
    if resp.status() == http::StatusCode::NOT_FOUND {
        return BTreeSet::new();
    }
    let v: serde_json::Value = resp.json().await.unwrap();
    v["tags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect()
}

fn kind(path: &str) -> &'static str {
    if path.contains("/manifests/") {
        "manifest"
    } else if path.contains("/blobs/uploads") {
        "upload"
    } else if path.contains("/blobs/") {
        "blob"
    } else if path.contains("/tags/list") {
        "tags"
    } else {
        "other"
    }
}
