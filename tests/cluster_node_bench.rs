//! The time from `kubectl apply` of a Deployment to its Pod Running on the
//! node, in four cases measured in one run: without pinswap (pulled from
//! the source), through pinswap with the image already mirrored, and on a
//! cold mirror with `copyPolicy: immediate` and with `delayed`; with the
//! time `pinswap copy` takes for the same image alongside. A benchmark, not
//! a test: `scripts/bench-node.sh` runs it (ignored otherwise) and
//! docs/benchmarks.md holds its figures.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, apply, namespace};
use common::node::{NodeRig, Via, deployment, forget_images, push_runnable_sized, wait_running};
use serde_json::json;

/// Image size: the pause program and this much data in one layer.
const DATA: usize = 32 << 20;
/// Rounds per case; `PINSWAP_BENCH_ROUNDS` overrides.
fn rounds() -> usize {
    std::env::var("PINSWAP_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5)
}

async fn apply_to_running(rig: &NodeRig, ns: &str, name: &str, image: &str) -> Duration {
    let client = &rig.client;
    let t = Instant::now();
    apply(client, &deployment(ns, name, image, 1))
        .await
        .unwrap();
    wait_running(
        client,
        ns,
        &format!("app={name}"),
        1,
        Duration::from_secs(180),
    )
    .await;
    let took = t.elapsed();
    // A kubelet pull back-off shows as 10 s more: say why.
    if took > Duration::from_secs(5) {
        let c = Cluster::with_node();
        println!(
            "{ns}/{name} took {took:.1?}:\n{}\npinswap:\n{}",
            common::node::describe(client, ns).await,
            rig.install.logs(c).await
        );
    }
    took
}

fn stats(name: &str, v: &mut [Duration]) -> Duration {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let median = v[v.len() / 2];
    println!(
        "{name:<28} median {:>7.0} ms  min {:>7.0} ms  max {:>7.0} ms  ({} runs)",
        ms(median),
        ms(v[0]),
        ms(v[v.len() - 1]),
        v.len()
    );
    median
}

#[tokio::test]
#[ignore = "a benchmark: scripts/bench-node.sh"]
async fn bench_apply_to_running() {
    let c = Cluster::with_node();
    let _held = c.lock().await;
    let node = c.node.as_ref().unwrap();
    let (mut direct, mut warm, mut immediate, mut delayed, mut copy) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut failed_open = vec![];
    for (policy, first) in [("immediate", true), ("delayed", false)] {
        let name = format!("bench-{policy}");
        let rig = NodeRig::start(
            c,
            &name,
            Via::Manifests,
            1,
            "",
            &format!("copyPolicy: {policy}\n"),
        )
        .await;
        let direct_ns = format!("{name}-direct");
        namespace(
            &rig.client,
            &direct_ns,
            json!({"pinswap.dev/ignore": "true"}),
        )
        .await;
        for round in 0..rounds() {
            let variant = |case: &str| format!("{policy}-{case}-{round}");
            if first {
                // Without pinswap: a fresh image from the source.
                let tag = variant("direct");
                push_runnable_sized(&rig.src, "bench/app", &tag, &tag, DATA).await;
                let image = rig.source(&format!("bench/app:{tag}"));
                direct.push(apply_to_running(&rig, &direct_ns, &format!("d{round}"), &image).await);
                forget_images(node, &[&image]);

                // Warm: in the mirror already (copied there as pinswap
                // would), never pulled by the node.
                let tag = variant("warm");
                push_runnable_sized(&rig.src, "bench/app", &tag, &tag, DATA).await;
                let (code, _, err) = common::run_pinswap(&[
                    "copy",
                    &format!("docker://{}/bench/app:{tag}", rig.src.host()),
                    &format!(
                        "docker://{}/{}:{tag}",
                        rig.dst.host(),
                        rig.mirrored_repo("bench/app")
                    ),
                ])
                .await;
                assert_eq!(code, 0, "{err}");
                let image = rig.source(&format!("bench/app:{tag}"));
                warm.push(apply_to_running(&rig, &name, &format!("w{round}"), &image).await);

                // The copy alone, for the same size.
                let tag = variant("copy");
                push_runnable_sized(&rig.src, "bench/copy", &tag, &tag, DATA).await;
                let t = Instant::now();
                let (code, _, err) = common::run_pinswap(&[
                    "copy",
                    &format!("docker://{}/bench/copy:{tag}", rig.src.host()),
                    &format!("docker://{}/bench/copy:{tag}", rig.dst.host()),
                ])
                .await;
                assert_eq!(code, 0, "{err}");
                copy.push(t.elapsed());
            }
            // Cold: nothing mirrored, nothing on the node.
            let tag = variant("cold");
            push_runnable_sized(&rig.src, "bench/app", &tag, &tag, DATA).await;
            let image = rig.source(&format!("bench/app:{tag}"));
            let took = apply_to_running(&rig, &name, &format!("c{round}"), &image).await;
            if first {
                immediate.push(took);
            } else {
                delayed.push(took);
            }
        }
        // Counted and reported here, not failed on: a Pod let through
        // unanswered is a figure of this run.
        failed_open.extend(rig.failed_open());
        rig.expect_fail_open("load, measured by this benchmark");
    }
    println!("apply to Running, image {} MiB:", DATA >> 20);
    let d = stats("without pinswap", &mut direct);
    let w = stats("pinswap, warm mirror", &mut warm);
    let i = stats("pinswap, cold, immediate", &mut immediate);
    let l = stats("pinswap, cold, delayed", &mut delayed);
    let cp = stats("pinswap copy alone", &mut copy);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    let over = (i.as_secs_f64() - d.as_secs_f64() - cp.as_secs_f64()) * 1000.0;
    println!(
        "warm / direct {:.2}x (goal 1.1x: {}); cold immediate - (direct + copy) {over:+.0} ms (goal 1000 ms: {}); delayed / direct {:.2}x",
        ratio(w, d),
        if ratio(w, d) <= 1.1 { "met" } else { "missed" },
        if over <= 1000.0 { "met" } else { "missed" },
        ratio(l, d)
    );
    println!(
        "admissions failed open (the Pod let through unrewritten): {}",
        failed_open.len()
    );
    for f in &failed_open {
        println!("  {f}");
    }
}
