//! pinswap at the size of a large cluster, through a real kube-apiserver
//! (docs/benchmarks.md "At cluster scale"). A measurement, not a test:
//! `scripts/bench-scale.sh` runs it.
//!
//! One control plane of its own; Pods are created through the API and stay
//! Pending (no node, no scheduler). Every namespace names every image. In
//! half the namespaces the Pods are as admission leaves them (the
//! container names the target's copy, pinned by digest, with the
//! `pinswap.dev/original-images` annotation): the leader's Pod index holds
//! those. The other half still name the source, as Pods from before the
//! install do: the backfill wants those. Registries sit behind counting
//! fronts.
//!
//! Shapes (`BENCH_SHAPE`):
//! - `a`: 100,000 Pods in 50 namespaces sharing 2,000 images; the target
//!   starts empty, so the first run is the backfill's first pass;
//! - `b`: 20,000 Pods, each with an image of its own, every one already at
//!   the target (the backfill finds them present).
//!
//! `BENCH_PODS` and `BENCH_IMAGES` override the counts. For each config
//! (`default`: recovery and backfill on; `all`: retention and eviction on
//! too) a fresh `pinswap serve` is measured with no Pods, then with them.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::cluster::{Cluster, Install, namespace};
use common::fixtures::Image;
use common::front::Front;
use common::metrics::sample;
use common::{TestRegistry, push_image};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;

struct Shape {
    name: String,
    pods: usize,
    images: usize,
    namespaces: usize,
}

impl Shape {
    /// The image of Pod `i`.
    fn image_of(&self, i: usize) -> usize {
        match self.images >= self.pods {
            true => i,
            false => (i / self.namespaces) % self.images,
        }
    }

    /// The images the Pods that still name the source name: what the
    /// backfill wants.
    fn wanted(&self) -> usize {
        (0..self.pods)
            .filter(|i| (i % self.namespaces) % 2 == 1)
            .map(|i| self.image_of(i))
            .collect::<std::collections::HashSet<_>>()
            .len()
    }

    fn from_env() -> Shape {
        let name = std::env::var("BENCH_SHAPE").unwrap_or_else(|_| "a".into());
        let (pods, images) = match name.as_str() {
            "a" => (100_000, 2_000),
            "b" => (20_000, 20_000),
            other => panic!("BENCH_SHAPE: a or b, not {other}"),
        };
        let count = |var: &str, default: usize| {
            std::env::var(var)
                .map(|v| v.parse().unwrap_or_else(|_| panic!("{var}: a count")))
                .unwrap_or(default)
        };
        Shape {
            pods: count("BENCH_PODS", pods),
            images: count("BENCH_IMAGES", images),
            namespaces: 50,
            name,
        }
    }
}

/// What one `pinswap serve` showed.
#[derive(Default)]
struct Run {
    leading_s: f64,
    synced_s: f64,
    backfilled_s: Option<f64>,
    rss_kib: u64,
    hwm_kib: u64,
    api: BTreeMap<String, usize>,
    list_uris: Vec<String>,
    api_list_bytes: f64,
    api_watch_bytes: f64,
    src: BTreeMap<String, u64>,
    dst: BTreeMap<String, u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test; scripts/bench-scale.sh runs it"]
async fn scale_figures() {
    let shape = Shape::from_env();
    let cluster = Cluster::another();
    let client = cluster.admin().await;
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::plain().await;
    let src_front = Front::start(&src.host()).await;
    let dst_front = Front::start(&dst.host()).await;
    let mirrored = |k: usize| {
        format!(
            "{}/mirror/{}/app{k}",
            dst_front.host(),
            src_front.host().replace(':', "_")
        )
    };

    // The images: at the source, and for shape b at the target too.
    let t = Instant::now();
    let digests: Vec<String> = futures::stream::iter(0..shape.images)
        .map(|k| {
            let (src, dst) = (&src, &dst);
            let at_target = shape.name == "b";
            let path = format!("mirror/{}/app{k}", src_front.host().replace(':', "_"));
            async move {
                let img = Image::oci(1, 7_000_000 + k as u64);
                push_image(src, &format!("app{k}"), Some("v1"), &img).await;
                if at_target {
                    push_image(dst, &path, Some("v1"), &img).await;
                }
                img.digest
            }
        })
        .buffered(16)
        .collect()
        .await;
    println!(
        "scale {}: {} images pushed in {:.0} s",
        shape.name,
        shape.images,
        t.elapsed().as_secs_f64()
    );

    let default = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource: {{registries: [{{registry: \"{}\"}}]}}\n",
        dst_front.host(),
        src_front.host()
    );
    let all =
        format!("{default}retention: {{enabled: true}}\nrecovery: {{evict: {{enabled: true}}}}\n");
    let configs = [("default", default), ("all", all)];
    let mut installs = Vec::new();
    for (name, config) in &configs {
        let ns = format!("pinswap-{name}");
        installs.push(Install::new(&client, &ns, config, &[]).await);
    }

    // No Pods: each config's floor.
    let mut floors = Vec::new();
    for (install, (name, _)) in installs.iter().zip(&configs) {
        let run = measure(&cluster, install, &format!("{name}-empty"), 0, None, None).await;
        floors.push(run.rss_kib);
    }

    // The Pods, through the API.
    for n in 0..shape.namespaces {
        namespace(&client, &format!("team-{n}"), json!({})).await;
    }
    let t = Instant::now();
    let created = create_pods(
        &client,
        &shape,
        0..shape.pods,
        &src_front,
        &mirrored,
        &digests,
    )
    .await;
    println!(
        "scale {}: {created} Pods created in {:.0} s ({:.0} a second)",
        shape.name,
        t.elapsed().as_secs_f64(),
        created as f64 / t.elapsed().as_secs_f64()
    );

    // The summary: (what, figure, goal and whether it is met).
    let mut table: Vec<[String; 3]> = Vec::new();
    let goal = |met: bool, goal: &str| format!("{goal}: {}", if met { "met" } else { "missed" });
    let per_pod_goal = if shape.name == "a" { 500.0 } else { 1000.0 };
    for ((install, (name, _)), floor) in installs.iter().zip(&configs).zip(&floors) {
        src_front.reset();
        dst_front.reset();
        let backfill = (*name == "default").then(|| shape.wanted());
        let run = measure(
            &cluster,
            install,
            name,
            shape.pods,
            backfill,
            Some((&src_front, &dst_front)),
        )
        .await;
        let per_pod = (run.rss_kib as f64 - *floor as f64) * 1024.0 / shape.pods as f64;
        let per_image = (run.rss_kib as f64 - *floor as f64) * 1024.0 / shape.images as f64;
        println!(
            "scale {} {name}: {} Pods, {} images: leading after {:.1} s, synced after {:.1} s{}; \
             RSS {:.1} MiB over a floor of {:.1} MiB: {per_pod:.0} B a Pod ({per_image:.0} B an image); peak {:.1} MiB",
            shape.name,
            shape.pods,
            shape.images,
            run.leading_s,
            run.synced_s,
            run.backfilled_s
                .map(|s| format!(", every image at the target after {s:.1} s"))
                .unwrap_or_default(),
            run.rss_kib as f64 / 1024.0,
            *floor as f64 / 1024.0,
            run.hwm_kib as f64 / 1024.0,
        );
        println!(
            "scale {} {name}: API requests {:?}; LIST bytes {:.0}, WATCH event bytes {:.0}",
            shape.name, run.api, run.api_list_bytes, run.api_watch_bytes
        );
        let pages = run
            .list_uris
            .iter()
            .filter(|u| u.contains("continue="))
            .count();
        for uri in run.list_uris.iter().filter(|u| !u.contains("continue=")) {
            println!("scale {} {name}: Pods: {uri}", shape.name);
        }
        println!("scale {} {name}: Pods: {pages} continued pages", shape.name);
        println!(
            "scale {} {name}: source requests {:?}; target requests {:?}",
            shape.name, run.src, run.dst
        );
        table.push([
            format!("{name}: leader memory a Pod"),
            format!("{per_pod:.0} B"),
            goal(
                per_pod <= per_pod_goal,
                &format!(
                    "at most {per_pod_goal:.0} B (a miss is per-image caches: docs/benchmarks.md)"
                ),
            ),
        ]);
        table.push([
            format!("{name}: synced after"),
            format!("{:.1} s", run.synced_s),
            String::from("-"),
        ]);
        // A full list: a first page, or a streamed list.
        let full = run
            .list_uris
            .iter()
            .filter(|u| {
                u.contains("sendInitialEvents=true")
                    || (!u.contains("watch=true") && !u.contains("continue="))
            })
            .count();
        table.push([
            format!("{name}: full Pod lists on becoming leader"),
            format!("{full} ({} requests)", run.list_uris.len()),
            goal(full <= 1, "one a watch"),
        ]);
        if let (Some(s), Some(wanted)) = (run.backfilled_s, backfill) {
            let sent: u64 = run.src.values().chain(run.dst.values()).sum();
            table.push([
                format!("{name}: backfill, {wanted} images"),
                format!(
                    "at the target after {s:.1} s; {sent} registry requests, {:.1} an image",
                    sent as f64 / wanted as f64
                ),
                goal(
                    sent <= 20 * wanted as u64,
                    "bounded by the copies, none per Pod",
                ),
            ]);
        }
    }

    // Retention alone (no backfill, identity scan or re-verification
    // beside it): the target requests of one pass, between the ends of
    // the first and the second.
    let base = &configs[0].1;
    let retention = format!(
        "{base}retention: {{enabled: true, interval: 20s}}\nbackfill: {{enabled: false}}\n\
         identity: {{scanRate: 0}}\ncache: {{reverify: 0s}}\n"
    );
    let install = Install::new(&client, "pinswap-retention", &retention, &[]).await;
    let mut served = install.serve(&cluster, "retention-0").await;
    let passes = |text: &str| {
        sample(
            text,
            "pinswap_retention_passes_total",
            &[("outcome", "done")],
        )
    };
    let mut seen = 0.0;
    for pass in 1..=2 {
        let t = Instant::now();
        loop {
            let text = served.health_get("/metrics").await.1;
            if passes(&text).unwrap_or(0.0) >= pass as f64 {
                seen = passes(&text).unwrap_or(0.0);
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(900),
                "no retention pass {pass}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if pass == 1 {
            dst_front.reset();
        }
    }
    let text = served.health_get("/metrics").await.1;
    let inspected: f64 = text
        .lines()
        .filter(|l| l.starts_with("pinswap_retention_images{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    let heads = dst_front.count_method("HEAD", "/manifests/");
    table.push([
        format!("retention pass over {inspected} images"),
        format!(
            "{heads} HEADs, {} tag lists, {} catalog pages",
            dst_front.count_method("GET", "/tags/list"),
            dst_front.count_method("GET", "/_catalog")
        ),
        goal(
            heads as f64 <= inspected,
            "one request an image, plus paging",
        ),
    ]);
    println!(
        "scale {} retention: one pass over {} images at the target ({} passes done): target requests {:?}; images by state: {:?}",
        shape.name,
        shape.images,
        seen,
        by_method(&dst_front),
        text.lines()
            .filter(|l| l.starts_with("pinswap_retention_images"))
            .collect::<Vec<_>>()
    );
    served.sigterm();
    let _ = tokio::time::timeout(Duration::from_secs(20), served.child.wait()).await;

    // Re-verification alone: the backfill's HEADs fill the existence
    // cache; a round of `reverify` over it, HEADs counted a second at a
    // time.
    let window = Duration::from_secs(60);
    let reverify = format!("{base}identity: {{scanRate: 0}}\ncache: {{reverify: 60s}}\n");
    let install = Install::new(&client, "pinswap-reverify", &reverify, &[]).await;
    let mut served = install.serve(&cluster, "reverify-0").await;
    let t = Instant::now();
    loop {
        let text = served.health_get("/metrics").await.1;
        let present =
            sample(&text, "pinswap_backfill_images", &[("state", "present")]).unwrap_or(0.0);
        if present >= shape.wanted() as f64 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(900),
            "the backfill did not find every image"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    dst_front.reset();
    let from = Instant::now();
    tokio::time::sleep(window).await;
    let heads: Vec<Instant> = dst_front
        .arrivals("HEAD", "/manifests/")
        .into_iter()
        .filter(|a| a.duration_since(from) < window)
        .collect();
    let mut per_second = vec![0u32; window.as_secs() as usize];
    for a in &heads {
        per_second[a.duration_since(from).as_secs() as usize] += 1;
    }
    let text = served.health_get("/metrics").await.1;
    println!(
        "scale {} reverify: {} HEADs at the target in {} s (reverify 60s, reverifyRate 20), at most {} in one second; re-verifications {:?}",
        shape.name,
        heads.len(),
        window.as_secs(),
        per_second.iter().max().unwrap(),
        text.lines()
            .filter(|l| l.starts_with("pinswap_reverifications"))
            .collect::<Vec<_>>()
    );
    let busiest = *per_second.iter().max().unwrap();
    table.push([
        String::from("re-verification HEADs in the busiest second"),
        busiest.to_string(),
        goal(busiest <= 20, "at most cache.reverifyRate (20)"),
    ]);
    served.sigterm();
    let _ = tokio::time::timeout(Duration::from_secs(20), served.child.wait()).await;

    // Twice the Pods (shape a): the default config's slope and its size.
    if let Ok(more) = std::env::var("BENCH_GROW") {
        let more: usize = more.parse().expect("BENCH_GROW: a count");
        let grown = Shape {
            pods: shape.pods + more,
            ..Shape::from_env()
        };
        create_pods(
            &client,
            &grown,
            shape.pods..grown.pods,
            &src_front,
            &mirrored,
            &digests,
        )
        .await;
        let (install, floor) = (&installs[0], floors[0]);
        let run = measure(&cluster, install, "default", grown.pods, None, None).await;
        println!(
            "scale {} default: {} Pods: synced after {:.1} s; RSS {:.1} MiB ({:.0} B a Pod over the floor), peak {:.1} MiB",
            shape.name,
            grown.pods,
            run.synced_s,
            run.rss_kib as f64 / 1024.0,
            (run.rss_kib as f64 - floor as f64) * 1024.0 / grown.pods as f64,
            run.hwm_kib as f64 / 1024.0,
        );
        let mib = run.rss_kib as f64 / 1024.0;
        table.push([
            format!("default: leader memory at {} Pods", grown.pods),
            format!("{mib:.1} MiB"),
            goal(mib < 150.0, "under 150 MiB at 200,000"),
        ]);
    }
    println!("scale {} | what | figure | goal |", shape.name);
    println!("scale {} |---|---|---|", shape.name);
    for [what, figure, goal] in &table {
        println!("scale {} | {what} | {figure} | {goal} |", shape.name);
    }
}

/// Creates Pods `range` of `shape` through the API, 48 at a time.
async fn create_pods(
    client: &kube::Client,
    shape: &Shape,
    range: std::ops::Range<usize>,
    src_front: &Front,
    mirrored: &dyn Fn(usize) -> String,
    digests: &[String],
) -> usize {
    futures::stream::iter(range)
        .map(|i| {
            let client = client.clone();
            let n = i % shape.namespaces;
            // Every namespace names every image; with an image per Pod,
            // each its own.
            let k = shape.image_of(i);
            let ns = format!("team-{n}");
            let source = format!("{}/app{k}:v1", src_front.host());
            // Half the namespaces rolled since pinswap came: their Pods are
            // rewritten; the rest still name the source.
            let (image, annotations) = match n % 2 {
                0 => (
                    format!("{}:v1@{}", mirrored(k), digests[k]),
                    json!({"pinswap.dev/original-images": json!({"containers/app": source}).to_string()}),
                ),
                _ => (source, json!({})),
            };
            let pod = json!({
                "metadata": {"name": format!("web-{k}-{i:06}"), "namespace": ns,
                    "labels": {"app": format!("app{k}"), "pod-template-hash": "7d9f8c6b5"},
                    "annotations": annotations},
                "spec": {"containers": [{"name": "app", "image": image}],
                    "imagePullSecrets": [{"name": "regcred"}]},
            });
            async move {
                let pod: Pod = serde_json::from_value(pod).unwrap();
                let api: Api<Pod> = Api::namespaced(client, &ns);
                let mut tries = 0;
                loop {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => break,
                        Err(e) if tries < 5 => {
                            tries += 1;
                            eprintln!("create {}: {e}; again", i);
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err(e) => panic!("create Pod {i}: {e}"),
                    }
                }
            }
        })
        .buffer_unordered(48)
        .count()
        .await
}

/// Starts `pinswap serve` for `install`, waits until it leads and its
/// watches have listed `pods` Pods (and, given `backfill`, until that many
/// images are at the target), and reads what it cost.
async fn measure(
    cluster: &Cluster,
    install: &Install,
    name: &str,
    pods: usize,
    backfill: Option<usize>,
    fronts: Option<(&Front, &Front)>,
) -> Run {
    let client = cluster.admin().await;
    let before = apiserver_metrics(&client).await;
    let audit_from = cluster.audit_of(&install.user()).len();
    let mut served = install.serve(cluster, &format!("{name}-0")).await;
    let t = Instant::now();
    let mut run = Run::default();
    let (mut leading, mut synced, mut filled) = (None, None, backfill.map(|_| None));
    loop {
        let (_, text) = served.health_get("/metrics").await;
        let at = t.elapsed().as_secs_f64();
        if leading.is_none() && sample(&text, "pinswap_leader", &[]) == Some(1.0) {
            leading = Some(at);
        }
        let watched = sample(&text, "pinswap_watched_pods", &[]).unwrap_or(-1.0);
        let listed = sample(&text, "pinswap_usage_synced", &[]).unwrap_or(0.0);
        if leading.is_some() && synced.is_none() && watched == (pods / 2) as f64 && listed == 1.0 {
            synced = Some(at);
        }
        if let (Some(want), Some(None)) = (backfill, filled) {
            let at_target = sample(&text, "pinswap_backfill_images", &[("state", "copied")])
                .unwrap_or(0.0)
                + sample(&text, "pinswap_backfill_images", &[("state", "present")]).unwrap_or(0.0);
            if at_target >= want as f64 {
                filled = Some(Some(at));
            }
        }
        if synced.is_some() && filled.is_none_or(|f| f.is_some()) {
            break;
        }
        let limit: u64 =
            std::env::var("BENCH_WAIT").map_or(1800, |v| v.parse().expect("BENCH_WAIT: seconds"));
        assert!(
            t.elapsed() < Duration::from_secs(limit),
            "{name}: not synced: leader {leading:?}, {watched} Pods, usage synced {listed}, backfill {filled:?}; metrics:\n{}\nlog:\n{}",
            text.lines()
                .filter(|l| l.starts_with("pinswap_backfill")
                    || l.starts_with("pinswap_usage")
                    || l.starts_with("pinswap_watched"))
                .collect::<Vec<_>>()
                .join("\n"),
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    run.leading_s = leading.unwrap();
    run.synced_s = synced.unwrap();
    run.backfilled_s = filled.flatten();
    // What the list left behind is returned to the allocator by now.
    tokio::time::sleep(Duration::from_secs(5)).await;
    run.rss_kib = served.status_kib("VmRSS");
    run.hwm_kib = served.status_kib("VmHWM");
    let after = apiserver_metrics(&client).await;
    run.api_list_bytes = after.0 - before.0;
    run.api_watch_bytes = after.1 - before.1;
    for e in &cluster.audit_of(&install.user())[audit_from..] {
        let resource = e["objectRef"]["resource"].as_str().unwrap_or("-");
        let verb = e["verb"].as_str().unwrap_or("-");
        *run.api.entry(format!("{verb} {resource}")).or_default() += 1;
        if verb == "list" && resource == "pods" {
            run.list_uris
                .push(e["requestURI"].as_str().unwrap_or("").to_owned());
        }
        if verb == "watch" && resource == "pods" {
            run.list_uris
                .push(e["requestURI"].as_str().unwrap_or("").to_owned());
        }
    }
    if let Some((src, dst)) = fronts {
        run.src = by_method(src);
        run.dst = by_method(dst);
    }
    // A clean stop releases the Lease for the next run.
    served.sigterm();
    let _ = tokio::time::timeout(Duration::from_secs(20), served.child.wait()).await;
    run
}

fn by_method(front: &Front) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for (method, path) in front.requests() {
        let kind = if path.contains("/manifests/") {
            "manifest"
        } else if path.contains("/blobs/uploads") {
            "upload"
        } else if path.contains("/blobs/") {
            "blob"
        } else if path.contains("/tags/list") {
            "tags"
        } else if path.contains("/_catalog") {
            "catalog"
        } else if path.contains("/referrers/") {
            "referrers"
        } else {
            "other"
        };
        *m.entry(format!("{method} {kind}")).or_default() += 1;
    }
    m
}

/// The API server's bytes sent for Pod LISTs and in Pod watch events so
/// far, from its own `/metrics`.
async fn apiserver_metrics(client: &kube::Client) -> (f64, f64) {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    let sum = |name: &str, parts: &[&str]| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && parts.iter().all(|p| l.contains(p)))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    (
        sum(
            "apiserver_response_sizes_sum",
            &["resource=\"pods\"", "verb=\"LIST\""],
        ),
        sum("apiserver_watch_events_sizes_sum", &["resource=\"pods\""]),
    )
}
