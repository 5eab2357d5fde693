//! A soak of `pinswap serve`: admissions at a fixed rate with image churn
//! (new tags at the source, images pruned at the target, Pods whose pulls
//! fail, a source restart and a target restart), recovery and
//! re-verification running against the in-process Kubernetes API server.
//!
//! `soak_smoke` runs in the default suite for a few seconds; `soak` is the
//! long run, through `scripts/soak.sh` (`SOAK_SECONDS`, default 1800;
//! `SOAK_RATE` in admissions per second, default 200; `SOAK_REPORT`, a file
//! for the Markdown table).
//!
//! Asserted: no admission error beyond the injected faults (every answer is
//! 200 and allowed; every rewrite pins the digest the source tag names; an
//! unchanged Pod only while a registry is down or just back, or when its
//! note says the admission budget ran out first), the process stays up and
//! its open file descriptors stay within a bound, and every pruned image a
//! Pod failed to pull is mirrored again. Reported, not asserted: RSS,
//! descriptors, latency percentiles over time, and how many answers the
//! budget cut short (that depends on how loaded the machine is).

mod common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::RwLock;

use common::kube::KubeApi;
use common::review::{apply_patch, create_review, pod, pull_failing};
use common::serve::Served;
use common::{Image, TestRegistry, push_image};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

const REPOS: usize = 12;
/// Pods kept in the API server; older ones are deleted.
const STORED_PODS: usize = 100;
/// After a registry comes back, answers may still be unchanged this long
/// (breakers close, connections are re-established).
const GRACE: Duration = Duration::from_secs(5);
/// Descriptors the second half of a run may hold beyond the first half's
/// peak.
const FD_SLACK: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_smoke() {
    run(Duration::from_secs(12), 40, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a long run: scripts/soak.sh"]
async fn soak() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let seconds = env("SOAK_SECONDS").unwrap_or(1800);
    let rate = env("SOAK_RATE").unwrap_or(200) as u32;
    let report = std::env::var("SOAK_REPORT").ok();
    run(Duration::from_secs(seconds), rate, report).await;
}

/// One image the source holds under a tag.
#[derive(Clone)]
struct Tagged {
    repo: usize,
    tag: String,
    digest: String,
    /// The first layer's digest (pruned with the manifest).
    layer: String,
}

#[derive(Default)]
struct State {
    images: Vec<Tagged>,
    /// Stored Pods, oldest first: (name, the Pod as stored, images by
    /// container name).
    pods: std::collections::VecDeque<StoredPod>,
    /// Images (index into `images`) that a stored Pod failed to pull after
    /// a prune.
    failed_pulls: Vec<usize>,
    /// When each registry was last down: (went down, came back).
    source_down: Option<(Instant, Option<Instant>)>,
    target_down: Option<(Instant, Option<Instant>)>,
    /// Images seen rewritten since they were last pruned, with when the
    /// last prune was (a rewrite answered to a request sent before it
    /// proves nothing).
    mirrored: std::collections::HashSet<usize>,
    pruned_at: HashMap<usize, Instant>,
    errors: Vec<String>,
    error_count: u64,
    /// Unchanged answers while the target was down (or just back), and
    /// while only the source was, for images never mirrored or pruned.
    unchanged_target_down: u64,
    unchanged_source_down: u64,
    /// Unchanged answers because the admission budget ran out first.
    unchanged_budget: u64,
    /// Latencies of the current sample interval, µs.
    latencies: Vec<u64>,
    sent: u64,
}

impl State {
    /// Whether the source and the target were down (or just back) at any
    /// time between `from` and `to`.
    fn faults(&self, from: Instant, to: Instant) -> (bool, bool) {
        let within = |w: &Option<(Instant, Option<Instant>)>| match w {
            Some((down, up)) => to >= *down && up.is_none_or(|up| from <= up + GRACE),
            None => false,
        };
        (within(&self.source_down), within(&self.target_down))
    }

    fn error(&mut self, e: String) {
        self.error_count += 1;
        if self.errors.len() < 20 {
            self.errors.push(e);
        }
    }
}

/// A stored Pod: its name, the Pod as stored, and the image (an index
/// into `State::images`) of each container, by container name.
type StoredPod = (String, Value, Vec<(String, usize)>);

/// xorshift64*: the soak's choices, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

fn repo_name(i: usize) -> String {
    format!("shop/app{i}")
}

/// The registries sit behind locks only so the churn can restart them:
/// requests take the read side, a kill or a restart the write side.
struct Rig {
    src: RwLock<TestRegistry>,
    dst: RwLock<TestRegistry>,
    src_host: String,
    src_port: u16,
    dst_host: String,
    api: KubeApi,
    state: Mutex<State>,
}

impl Rig {
    fn mirror_repo(&self, repo: usize) -> String {
        format!("mirror/127.0.0.1_{}/{}", self.src_port, repo_name(repo))
    }

    fn source_ref(&self, img: &Tagged) -> String {
        format!("{}/{}:{}", self.src_host, repo_name(img.repo), img.tag)
    }

    fn pinned_ref(&self, img: &Tagged) -> String {
        format!(
            "{}/{}:{}@{}",
            self.dst_host,
            self.mirror_repo(img.repo),
            img.tag,
            img.digest
        )
    }

    async fn push(&self, repo: usize, tag: &str, seed: u64) -> Tagged {
        let image = Image::oci(2, seed);
        let src = self.src.read().await;
        push_image(&src, &repo_name(repo), Some(tag), &image).await;
        Tagged {
            repo,
            tag: tag.to_owned(),
            digest: image.digest.clone(),
            layer: image.layers[0].digest.clone(),
        }
    }
}

/// One admission: a Pod of 1–3 containers; checks the answer.
async fn admit_one(
    rig: &Rig,
    served: &Served,
    client: &reqwest::Client,
    n: u64,
    picks: Vec<usize>,
) {
    let chosen: Vec<Tagged> = {
        let st = rig.state.lock().unwrap();
        picks.iter().map(|&i| st.images[i].clone()).collect()
    };
    let names: Vec<String> = (0..chosen.len()).map(|c| format!("c{c}")).collect();
    let refs: Vec<String> = chosen.iter().map(|t| rig.source_ref(t)).collect();
    let containers: Vec<(&str, &str)> = names
        .iter()
        .zip(&refs)
        .map(|(n, r)| (n.as_str(), r.as_str()))
        .collect();
    let name = format!("p{n}");
    let the_pod = pod("soak", &name, &containers);
    let body = create_review(&the_pod).to_string();
    let sent = Instant::now();
    let result = served.send(client, &body).await;
    let took = sent.elapsed();
    let answer = match result {
        Ok(r) if r.status() == 200 => r.json::<Value>().await.map_err(|e| e.to_string()),
        Ok(r) => Err(format!("HTTP {}", r.status())),
        Err(e) => Err(format!("transport: {e}")),
    };
    let mut st = rig.state.lock().unwrap();
    st.latencies.push(took.as_micros() as u64);
    let answer = match answer {
        Ok(a) => a,
        Err(e) => return st.error(format!("{name}: {e}")),
    };
    let response = &answer["response"];
    if response["allowed"] != true {
        return st.error(format!("{name}: not allowed: {response}"));
    }
    let mut patched = the_pod.clone();
    apply_patch(response, &mut patched);
    let mut unchanged = Vec::new();
    for (c, img) in chosen.iter().enumerate() {
        let got = patched["spec"]["containers"][c]["image"]
            .as_str()
            .unwrap_or_default();
        if got == rig.source_ref(img) {
            unchanged.push(picks[c]);
        } else if got != rig.pinned_ref(img) {
            let want = rig.pinned_ref(img);
            return st.error(format!("{name}: {got} instead of {want}"));
        } else if st.pruned_at.get(&picks[c]).is_none_or(|t| *t < sent) {
            st.mirrored.insert(picks[c]);
        }
    }
    if !unchanged.is_empty() {
        let note = patched["metadata"]["annotations"]["pinswap.dev/decisions"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        // A copy or a decision the budget could not wait for: what
        // admission does when the machine cannot keep up (counted and
        // reported, not an error).
        if note.contains("copy still running") || note.contains("exhausted") {
            st.unchanged_budget += 1;
            return;
        }
        match st.faults(sent, Instant::now()) {
            (_, true) => st.unchanged_target_down += 1,
            // The target is the authority for what it holds: only an image
            // it does not hold may go unchanged while the source is down.
            (true, false) if unchanged.iter().all(|i| !st.mirrored.contains(i)) => {
                st.unchanged_source_down += 1
            }
            (true, false) => st.error(format!(
                "{name}: a mirrored image unchanged while the source was down: {note}"
            )),
            (false, false) => st.error(format!("{name}: unchanged outside a fault: {note}")),
        }
        return;
    }
    // Every 20th rewritten Pod is stored, as if it was created.
    if n.is_multiple_of(20) {
        let images = names.into_iter().zip(picks).collect();
        st.pods.push_back((name.clone(), patched.clone(), images));
        let evicted = (st.pods.len() > STORED_PODS).then(|| st.pods.pop_front());
        drop(st);
        rig.api
            .apply_pod(serde_json::from_value::<Pod>(patched).expect("a valid Pod"));
        if let Some(Some((old, _, _))) = evicted {
            rig.api.delete_pod("soak", &old);
        }
    }
}

/// Prunes a stored Pod's image at the target and reports its pull failure.
async fn prune_one(rig: &Rig, rng: &mut Rng) {
    let pick = {
        let st = rig.state.lock().unwrap();
        if st.pods.is_empty() {
            return;
        }
        let (_, pod, images) = st.pods[rng.below(st.pods.len())].clone();
        let (container, image) = images[rng.below(images.len())].clone();
        (pod, container, image, st.images[image].clone())
    };
    let (pod, container, index, img) = pick;
    rig.state
        .lock()
        .unwrap()
        .pruned_at
        .insert(index, Instant::now());
    let repo = rig.mirror_repo(img.repo);
    {
        let dst = rig.dst.read().await;
        dst.delete_manifest(&repo, &img.digest).await;
        dst.delete_blob(&repo, &img.layer).await;
    }
    rig.api.apply_pod(
        serde_json::from_value::<Pod>(pull_failing(&pod, &container, "ErrImagePull"))
            .expect("a valid Pod"),
    );
    let mut st = rig.state.lock().unwrap();
    st.failed_pulls.push(index);
    st.mirrored.remove(&index);
    st.pruned_at.insert(index, Instant::now());
}

struct Sample {
    at: Duration,
    rss_kib: u64,
    hwm_kib: u64,
    fds: usize,
    count: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    errors: u64,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

async fn run(duration: Duration, rate: u32, report: Option<String>) {
    common::init();
    let (src, dst, api) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        KubeApi::start().await,
    );
    let rig = Arc::new(Rig {
        src_host: src.host(),
        src_port: src.port(),
        dst_host: dst.host(),
        src: RwLock::new(src),
        dst: RwLock::new(dst),
        api,
        state: Mutex::default(),
    });
    let mut seed = 9000u64;
    for r in 0..REPOS {
        seed += 1;
        let t = rig.push(r, "v1", seed).await;
        rig.state.lock().unwrap().images.push(t);
    }
    let body = format!(
        "target: {{registry: \"{}/mirror\"}}\n\
         source: {{registries: [{{registry: \"{}\"}}]}}\n\
         copyPolicy: immediate\n\
         cache: {{reverify: 5s}}\n\
         recovery:\n  retryInitial: 300ms\n  retryMax: 2s\n  \
         lease: {{duration: 2s, renewDeadline: 1500ms, retryPeriod: 200ms}}\n",
        rig.dst_host, rig.src_host
    );
    let config = pinswap::config::Config::from_yaml(&body, "soak.yaml").unwrap();
    rig.api
        .authorize_install(&config, pinswap::install::manifests::Tls::CertManager);
    let dir = tempfile::tempdir().unwrap();
    let kc = rig.api.kubeconfig(dir.path());
    let kc = kc.to_str().unwrap().to_owned();
    let env = [("KUBECONFIG", kc.as_str()), ("POD_NAMESPACE", "pinswap")];
    let served = Arc::new(Served::start_with(&body, "", &env, None).await);
    let client = served.client();

    let start = Instant::now();
    let end = start + duration;
    let stop = tokio_util::sync::CancellationToken::new();

    // Load: an open loop at `rate`, each admission its own task.
    let load = {
        let (rig, served, stop) = (rig.clone(), served.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut rng = Rng(0x5eed_0001);
            let mut tasks = tokio::task::JoinSet::new();
            let mut n = 0u64;
            while !stop.is_cancelled() {
                tick.tick().await;
                n += 1;
                let picks: Vec<usize> = {
                    let mut st = rig.state.lock().unwrap();
                    st.sent += 1;
                    let len = st.images.len();
                    (0..1 + rng.below(3)).map(|_| rng.below(len)).collect()
                };
                let (rig, served, client) = (rig.clone(), served.clone(), client.clone());
                tasks.spawn(async move { admit_one(&rig, &served, &client, n, picks).await });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    // Churn: a new tag every 2 s, a prune every 5 s; the source restarts at
    // a third of the run and the target at two thirds, each down 3 s.
    let churn = {
        let (rig, stop) = (rig.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rng = Rng(0x5eed_0002);
            let mut seed = 20_000u64;
            let mut version = 1;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut second = 0u64;
            let third = (duration.as_secs() / 3).max(3);
            while !stop.is_cancelled() {
                tick.tick().await;
                second += 1;
                let source_up = rig
                    .state
                    .lock()
                    .unwrap()
                    .source_down
                    .is_none_or(|w| w.1.is_some());
                if second.is_multiple_of(2) && source_up {
                    version += 1;
                    seed += 1;
                    let repo = rng.below(REPOS);
                    let t = rig.push(repo, &format!("v{version}"), seed).await;
                    rig.state.lock().unwrap().images.push(t);
                }
                if second.is_multiple_of(5) {
                    prune_one(&rig, &mut rng).await;
                }
                if second == third || second == 2 * third {
                    let source = second == third;
                    let down = Instant::now();
                    {
                        let mut st = rig.state.lock().unwrap();
                        let w = if source {
                            &mut st.source_down
                        } else {
                            &mut st.target_down
                        };
                        *w = Some((down, None));
                    }
                    let reg = if source { &rig.src } else { &rig.dst };
                    reg.write().await.kill();
                    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself
                    reg.write().await.restart().await;
                    let mut st = rig.state.lock().unwrap();
                    let w = if source {
                        &mut st.source_down
                    } else {
                        &mut st.target_down
                    };
                    *w = Some((down, Some(Instant::now())));
                }
            }
        })
    };

    // Samples every tenth of the run (at most every 30 s, at least 2 s).
    let every = (duration / 10).clamp(Duration::from_secs(2), Duration::from_secs(30));
    let mut samples = Vec::new();
    while Instant::now() < end {
        tokio::time::sleep(every.min(end - Instant::now())).await;
        let mut lat = std::mem::take(&mut rig.state.lock().unwrap().latencies);
        lat.sort_unstable();
        let errors = rig.state.lock().unwrap().error_count;
        samples.push(Sample {
            at: start.elapsed(),
            rss_kib: served.status_kib("VmRSS"),
            hwm_kib: served.status_kib("VmHWM"),
            fds: served.fds(),
            count: lat.len(),
            p50_ms: percentile(&lat, 0.5),
            p99_ms: percentile(&lat, 0.99),
            max_ms: percentile(&lat, 1.0),
            errors,
        });
    }
    stop.cancel();
    load.await.unwrap();
    churn.await.unwrap();

    // Every image a Pod failed to pull is mirrored again.
    let failed: Vec<Tagged> = {
        let st = rig.state.lock().unwrap();
        let mut seen = std::collections::BTreeSet::new();
        st.failed_pulls
            .iter()
            .filter(|i| seen.insert(**i))
            .map(|&i| st.images[i].clone())
            .collect()
    };
    let mut missing = Vec::new();
    for img in &failed {
        let repo = rig.mirror_repo(img.repo);
        let t = Instant::now();
        let dst = rig.dst.read().await;
        loop {
            let served_again = dst.head_manifest(&repo, &img.digest).await.as_deref()
                == Some(img.digest.as_str())
                && dst.blob_exists(&repo, &img.layer).await;
            if served_again {
                break;
            }
            if t.elapsed() > Duration::from_secs(30) {
                missing.push(rig.pinned_ref(img));
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let healthy = served.healthz().await;
    let st = rig.state.lock().unwrap();
    let mut table = format!(
        "soak: {:?} at {rate} req/s; {} sent; unchanged: {} while the target was down, \
         {} for images the target did not hold while the source was down, \
         {} because the admission budget ran out first; \
         {} errors; {} images ({} pruned, each a failed pull)\n\n\
         | t (s) | admissions | p50 ms | p99 ms | max ms | RSS MiB | peak RSS MiB | fds | errors |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        duration,
        st.sent,
        st.unchanged_target_down,
        st.unchanged_source_down,
        st.unchanged_budget,
        st.error_count,
        st.images.len(),
        failed.len(),
    );
    for s in &samples {
        let _ = writeln!(
            table,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            s.at.as_secs(),
            s.count,
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            s.rss_kib as f64 / 1024.0,
            s.hwm_kib as f64 / 1024.0,
            s.fds,
            s.errors
        );
    }
    eprintln!("{table}");
    if let Some(path) = report {
        std::fs::write(path, &table).unwrap();
    }
    let log = served.log_text();
    let tail: String = log.lines().rev().take(20).collect::<Vec<_>>().join("\n");
    assert!(
        st.errors.is_empty(),
        "{} errors, first: {:#?}\nlog tail:\n{tail}",
        st.error_count,
        st.errors
    );
    assert!(
        missing.is_empty(),
        "not mirrored again after a failed pull: {missing:?}\nlog tail:\n{tail}"
    );
    // Flat: the second half never holds more than the first half's peak
    // (which includes the cold start's burst of registry connections).
    let (early, late) = samples.split_at(samples.len() / 2);
    let peak = |s: &[Sample]| s.iter().map(|s| s.fds).max().unwrap_or(0);
    let (early, late) = (peak(early), peak(late));
    assert!(
        late <= early + FD_SLACK,
        "descriptors grew from a peak of {early} to {late}"
    );
    assert!(healthy, "serve is down\nlog tail:\n{tail}");
}
