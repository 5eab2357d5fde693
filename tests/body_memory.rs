//! What a review costs in memory while it is parsed and answered, as a
//! multiple of its body: the factor `/mutate` reserves of
//! `server.bodyMemory` ([`pinswap::server::PARSED_FACTOR`]). Measured by
//! counting every heap allocation of this process (its own binary, so the
//! global allocator counts nothing else) around `Admission::review` of wide
//! AdmissionReviews near the 4 MiB limit, in the shapes that cost the most
//! per byte: many containers, many env vars, many annotations. Each slot
//! names an image outside the allowlist, so no request leaves the process
//! and every slot still gets its decision note.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::server::{MAX_BODY_BYTES, PARSED_FACTOR};
use serde_json::{Value, json};

/// The system allocator, counting the bytes live now and the most live
/// since the last [`reset_peak`].
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            if new_size >= layout.size() {
                let grown = new_size - layout.size();
                let now = LIVE.fetch_add(grown, Ordering::Relaxed) + grown;
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn reset_peak() -> usize {
    let now = LIVE.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// A Pod CREATE review of `pod` grown by `unit(pod, 0, n)` (n units), n
/// as large as keeps the body under 4 MiB.
fn review(pod: Value, unit: impl Fn(&mut Value, usize, usize)) -> String {
    let wrap = |pod: &Value| {
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
          "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop", "operation": "CREATE",
            "userInfo": {"username": "admin"}, "object": pod, "dryRun": false}})
        .to_string()
    };
    let build = |n: usize| {
        let mut p = pod.clone();
        unit(&mut p, 0, n);
        wrap(&p)
    };
    let limit = MAX_BODY_BYTES - 16 * 1024;
    let (base, probe) = (wrap(&pod).len(), build(1000).len());
    let mut n = (limit - base) * 1000 / (probe - base);
    loop {
        let body = build(n);
        if body.len() <= limit {
            return body;
        }
        n -= n / 100 + 1;
    }
}

fn base_pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
      "metadata": {"name": "wide", "namespace": "shop", "annotations": {}},
      "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}})
}

/// The shapes, each just under 4 MiB: (name, body).
fn shapes() -> Vec<(&'static str, String)> {
    let containers = review(base_pod(), |p, from, step| {
        let c = p["spec"]["containers"].as_array_mut().unwrap();
        for i in from..from + step {
            c.push(json!({"name": format!("c{i}"), "image": format!("registry.invalid/x{i}:1")}));
        }
    });
    let env = review(base_pod(), |p, from, step| {
        let e = p["spec"]["containers"][0]
            .as_object_mut()
            .unwrap()
            .entry("env")
            .or_insert_with(|| json!([]));
        for i in from..from + step {
            e.as_array_mut()
                .unwrap()
                .push(json!({"name": format!("V{i}"), "value": "1"}));
        }
    });
    let annotations = review(base_pod(), |p, from, step| {
        let a = p["metadata"]["annotations"].as_object_mut().unwrap();
        for i in from..from + step {
            a.insert(format!("a{i}"), json!("1"));
        }
    });
    // Containers with a few env vars each: objects nested in objects.
    let mixed = review(base_pod(), |p, from, step| {
        let c = p["spec"]["containers"].as_array_mut().unwrap();
        for i in from..from + step {
            c.push(
                json!({"name": format!("c{i}"), "image": format!("registry.invalid/x{i}:1"),
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "ports": [{"containerPort": 80}]}),
            );
        }
    });
    vec![
        ("containers", containers),
        ("env", env),
        ("annotations", annotations),
        ("mixed", mixed),
    ]
}

/// The most any shape holds while it is reviewed, as a multiple of its
/// body, stays within what `/mutate` reserves for it.
#[test]
fn a_review_holds_at_most_parsed_factor_times_its_body() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let config = Config::from_yaml(
        "target: {registry: \"127.0.0.1:9/mirror\"}\nsource: {registries: [{registry: \"127.0.0.1:9\"}]}\n",
        "test.yaml",
    )
    .unwrap();
    let adm = Admission::from_config(&config, Arc::new(Metrics::new())).unwrap();
    // Warm: lazily built state (metrics, caches) is not a review's.
    let small = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
      "request": {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE", "namespace": "shop", "object": base_pod()}});
    runtime
        .block_on(adm.review(small.to_string().into()))
        .unwrap();
    let mut worst = (0.0, "");
    for (name, text) in shapes() {
        let len = text.len();
        // The body is held from its read; the review drops it once parsed.
        let body = bytes::Bytes::from(text.into_bytes());
        let before = reset_peak();
        let answer = runtime.block_on(adm.review(body)).unwrap();
        let peak = PEAK.load(Ordering::Relaxed) - before + len;
        drop(answer);
        let factor = peak as f64 / len as f64;
        eprintln!("{name}: body {len} bytes, peak {peak} bytes while reviewed: {factor:.1} times");
        if factor > worst.0 {
            worst = (factor, name);
        }
    }
    assert!(
        worst.0 <= PARSED_FACTOR as f64,
        "{} holds {:.1} times its body; PARSED_FACTOR is {PARSED_FACTOR}",
        worst.1,
        worst.0
    );
}
