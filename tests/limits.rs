//! What a client on the network can make `pinswap serve` hold, tried as an
//! attacker would against the real binary: stalled bodies over HTTP/1.1 and
//! HTTP/2, early 413s, slow and idle connections, a lowered file-descriptor
//! limit, log injection, and a SIGTERM under a steady stream of admissions.
//! Memory is read from the server's `/proc/PID/status`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::serve::{Served, post_head, read_until_closed, status_of, write_spaces};
use pinswap::server::PARSED_FACTOR;
use tokio::io::AsyncWriteExt;

const POD_CREATE: &str = include_str!("data/admission/pod-create.json");
const MIB: u64 = 1024 * 1024;
const BODY: u64 = 4 * MIB;

/// Counts of what stalled-body clients got back.
#[derive(Default)]
struct Outcomes {
    by_status: std::sync::Mutex<std::collections::BTreeMap<u16, usize>>,
}

impl Outcomes {
    fn add(&self, status: u16) {
        *self.by_status.lock().unwrap().entry(status).or_default() += 1;
    }
    fn get(&self, status: u16) -> usize {
        self.by_status
            .lock()
            .unwrap()
            .get(&status)
            .copied()
            .unwrap_or(0)
    }

    /// RSS grew (from `before` to `peak` KiB) by at most `budget` bytes, at
    /// most 8 bodies (the large half of a 64 MiB budget) were held until
    /// their timeout (408), and at least `refused` were refused at once.
    fn assert_bounded(&self, before: u64, peak: u64, budget: u64, refused: usize) {
        let grown = peak.saturating_sub(before) * 1024;
        let seen = format!("{:?}", self.by_status.lock().unwrap());
        eprintln!(
            "RSS before {before} KiB, peak {peak} KiB (+{} MiB); outcomes {seen}",
            grown / MIB
        );
        assert!(
            grown <= budget,
            "peak RSS grew by {grown} bytes, over the {budget}-byte budget"
        );
        assert!(self.get(408) <= 8, "{seen}");
        assert!(self.get(503) >= refused, "{seen}");
    }
}

#[tokio::test]
async fn stalled_http1_bodies_stay_within_the_body_budget() {
    let budget = 64 * MIB;
    let s = Served::start("bodyMemory: 64Mi, bodyTimeout: 4s", "", None).await;
    let before = s.status_kib("VmRSS");
    let outcomes = Arc::new(Outcomes::default());
    // Every connection is up before any body starts, so the 130 bodies
    // arrive together, well inside the body timeout, however slow the
    // handshakes are on a loaded machine.
    let mut streams = Vec::new();
    for _ in 0..130 {
        streams.push(s.tls(b"http/1.1").await);
    }
    let mut tasks = Vec::new();
    for stream in streams {
        let outcomes = outcomes.clone();
        tasks.push(tokio::spawn(async move {
            let (mut rd, mut wr) = tokio::io::split(stream);
            let writer = tokio::spawn(async move {
                wr.write_all(post_head(BODY).as_bytes()).await.ok();
                write_spaces(&mut wr, BODY - 1).await;
                wr // held open: the body stalls one byte short
            });
            let (got, _) = read_until_closed(&mut rd, Duration::from_secs(8)).await;
            outcomes.add(status_of(&got).unwrap_or(0));
            drop(writer);
        }));
    }
    // While the bodies stall (the budget is full: refusals have begun),
    // the webhook still answers a usual review.
    s.wait_for_body_refusals().await;
    let client = s.client();
    let t = Instant::now();
    assert_eq!(s.post(&client, POD_CREATE).await.unwrap(), 200);
    eprintln!("a usual review during the attack: {:?}", t.elapsed());
    assert!(s.healthz().await);
    let peak = s.status_kib("VmHWM");
    for t in tasks {
        t.await.unwrap();
    }
    // Half the budget (32 MiB) holds 8 large bodies: they time out (408);
    // every other one is refused at once (503).
    outcomes.assert_bounded(before, peak, budget, 122);
    let (_, metrics) = s.health_get("/metrics").await;
    assert!(
        common::metrics::sample(
            &metrics,
            "pinswap_requests_refused_total",
            &[("reason", "body_memory")]
        )
        .is_some_and(|v| v >= 1.0),
        "{metrics}"
    );
    assert!(
        common::metrics::sample(&metrics, "pinswap_body_budget_bytes", &[]) == Some(67108864.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn stalled_http2_streams_stay_within_the_body_budget() {
    let budget = 64 * MIB;
    let s = Served::start("bodyMemory: 64Mi, bodyTimeout: 4s", "", None).await;
    let before = s.status_kib("VmRSS");
    let tls = s.tls(b"h2").await;
    let (client, connection) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(connection);
    // One request first, so the client has the server's SETTINGS (its
    // stream limit) before it opens more; streams past the limit would be
    // refused (REFUSED_STREAM), which a client retries.
    let warm_up = http::Request::get("https://127.0.0.1/healthz")
        .body(())
        .unwrap();
    let (response, _) = client
        .clone()
        .ready()
        .await
        .unwrap()
        .send_request(warm_up, true)
        .unwrap();
    assert_eq!(
        response.await.unwrap().status(),
        404,
        "the webhook port has no /healthz"
    );
    let outcomes = Arc::new(Outcomes::default());
    let opened = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..150 {
        let client = client.clone();
        let (outcomes, opened) = (outcomes.clone(), opened.clone());
        tasks.push(tokio::spawn(async move {
            let request = http::Request::post("https://127.0.0.1/mutate")
                .header("content-type", "application/json")
                .header("content-length", BODY.to_string())
                .body(())
                .unwrap();
            let mut client = client.ready().await.unwrap();
            let (response, mut body) = client.send_request(request, false).unwrap();
            opened.fetch_add(1, Ordering::Relaxed);
            let sender = tokio::spawn(async move {
                let mut sent = 0u64;
                while sent < BODY - 1 {
                    body.reserve_capacity(64 * 1024);
                    let Some(Ok(n)) = std::future::poll_fn(|cx| body.poll_capacity(cx)).await
                    else {
                        break;
                    };
                    let n = (n as u64).min(BODY - 1 - sent);
                    if body
                        .send_data(Bytes::from(vec![b' '; n as usize]), false)
                        .is_err()
                    {
                        break;
                    }
                    sent += n;
                }
                body
            });
            let status = match tokio::time::timeout(Duration::from_secs(8), response).await {
                Ok(Ok(r)) => r.status().as_u16(),
                Ok(Err(e)) => {
                    eprintln!("stream error: {e:?}");
                    0
                }
                Err(_) => 0,
            };
            outcomes.add(status);
            sender.abort();
        }));
    }
    s.wait_for_body_refusals().await;
    assert_eq!(s.post(&s.client(), POD_CREATE).await.unwrap(), 200);
    let peak = s.status_kib("VmHWM");
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(opened.load(Ordering::Relaxed), 150);
    outcomes.assert_bounded(before, peak, budget, 142);
}

#[tokio::test]
async fn a_declared_oversize_body_gets_413_before_any_byte() {
    let s = Served::start("", "", None).await;
    let mut stream = s.tls(b"http/1.1").await;
    stream
        .write_all(post_head(5 * MIB).as_bytes())
        .await
        .unwrap();
    // Answered at once, not after a body that never comes.
    let mut head = [0u8; 12];
    tokio::time::timeout(
        Duration::from_secs(1),
        tokio::io::AsyncReadExt::read_exact(&mut stream, &mut head),
    )
    .await
    .expect("413 within 1 s")
    .unwrap();
    assert_eq!(status_of(&head), Some(413));
    let (rest, _) = read_until_closed(&mut stream, Duration::from_millis(500)).await;
    let text = String::from_utf8_lossy(&rest).to_ascii_lowercase();
    assert!(text.contains("connection: close"), "{text}");
}

/// How long after `from` the server closed `stream` (`None`: still open
/// after `within`).
async fn closed_after<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    from: Instant,
    within: Duration,
) -> Option<Duration> {
    let (_, closed) = read_until_closed(stream, within).await;
    closed.then(|| from.elapsed())
}

#[tokio::test]
async fn slow_and_idle_connections_are_closed_by_the_timeouts() {
    let s = Served::start(
        "tlsHandshakeTimeout: 1s, headerReadTimeout: 1s, idleTimeout: 3s",
        "",
        None,
    )
    .await;
    let within = Duration::from_secs(8);
    // Never starts TLS.
    let raw = {
        let addr = s.webhook;
        tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            closed_after(&mut c, Instant::now(), within).await
        })
    };
    // Finishes TLS, then sends nothing.
    let mut silent = s.tls(b"http/1.1").await;
    let silent =
        tokio::spawn(async move { closed_after(&mut silent, Instant::now(), within).await });
    // Sends its headers a byte at a time, for ever (slowloris).
    let mut slow = s.tls(b"http/1.1").await;
    let slow = tokio::spawn(async move {
        let start = Instant::now();
        for b in "POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
            .bytes()
            .cycle()
        {
            if slow.write_all(&[b]).await.is_err() || start.elapsed() > within {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        start.elapsed()
    });
    // One request, then kept alive.
    let mut kept = s.tls(b"http/1.1").await;
    let review = POD_CREATE.as_bytes();
    kept.write_all(post_head(review.len() as u64).as_bytes())
        .await
        .unwrap();
    kept.write_all(review).await.unwrap();
    let mut head = [0u8; 12];
    tokio::io::AsyncReadExt::read_exact(&mut kept, &mut head)
        .await
        .unwrap();
    assert_eq!(status_of(&head), Some(200));
    let answered = Instant::now();
    let kept = tokio::spawn(async move { closed_after(&mut kept, answered, within).await });

    let raw = raw.await.unwrap().expect("no TLS: closed");
    let silent = silent.await.unwrap().expect("no request: closed");
    let slow = slow.await.unwrap();
    let kept = kept.await.unwrap().expect("kept alive: closed at last");
    eprintln!(
        "closed after: no TLS {raw:?}, no request {silent:?}, slowloris {slow:?}, kept alive {kept:?}"
    );
    let around = |d: Duration, secs: f64| (secs - 0.2..secs + 1.5).contains(&d.as_secs_f64());
    assert!(around(raw, 1.0), "handshake timeout: {raw:?}");
    assert!(around(silent, 1.0), "header timeout: {silent:?}");
    assert!(
        slow < Duration::from_secs(4),
        "slowloris cut off after {slow:?}"
    );
    assert!(
        around(kept, 3.0),
        "idle timeout, not the header timeout: {kept:?}"
    );
    let (_, metrics) = s.health_get("/metrics").await;
    for reason in ["handshake_timeout", "header_timeout", "idle_timeout"] {
        assert!(
            metrics.contains(&format!(
                "pinswap_connections_closed_total{{listener=\"webhook\",reason=\"{reason}\"}}"
            )),
            "{reason}: {metrics}"
        );
    }
}

#[tokio::test]
async fn a_thousand_idle_connections_under_a_low_fd_limit() {
    let nofile = 512;
    let s = Served::start(
        "tlsHandshakeTimeout: 2s, headerReadTimeout: 2s",
        "",
        Some(nofile),
    )
    .await;
    let s = Arc::new(s);
    // Probes throughout: liveness and a review.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let (s, stop) = (s.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut probes, mut failed, mut max_fds) = (0, 0, 0);
            let client = s.client();
            while !stop.load(Ordering::Relaxed) {
                probes += 1;
                if !s.healthz().await {
                    failed += 1;
                }
                max_fds = max_fds.max(s.fds());
                if probes % 5 == 0 && s.post(&client, POD_CREATE).await.ok() != Some(200) {
                    failed += 1;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (probes, failed, max_fds)
        })
    };
    // 500 that never start TLS, 500 that finish it and send nothing.
    let mut conns = Vec::new();
    for _ in 0..500 {
        conns.push(tokio::spawn({
            let addr = s.webhook;
            async move {
                let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
                let closed = read_until_closed(&mut c, Duration::from_secs(10)).await.1;
                if !closed {
                    eprintln!("plain {:?} still open", c.local_addr());
                }
                closed
            }
        }));
    }
    let handshakes = Arc::new(tokio::sync::Semaphore::new(64));
    for _ in 0..500 {
        let (s, handshakes) = (s.clone(), handshakes.clone());
        conns.push(tokio::spawn(async move {
            let permit = handshakes.acquire_owned().await.unwrap();
            let tcp = tokio::net::TcpStream::connect(s.webhook).await.unwrap();
            let tls = s
                .connector(b"http/1.1")
                .connect("127.0.0.1".try_into().unwrap(), tcp)
                .await;
            drop(permit);
            match tls {
                Ok(mut c) => {
                    let closed = read_until_closed(&mut c, Duration::from_secs(10)).await.1;
                    if !closed {
                        eprintln!("tls {:?} still open", c.get_ref().0.local_addr());
                    }
                    closed
                }
                // Closed for room before or during the handshake.
                Err(_) => true,
            }
        }));
    }
    let mut closed = 0;
    for c in conns {
        if c.await.unwrap() {
            closed += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (probes, failed, max_fds) = probe.await.unwrap();
    eprintln!(
        "{closed}/1000 closed by the server; {probes} probes, {failed} failed; at most {max_fds} fds of {nofile}"
    );
    assert_eq!(
        closed, 1000,
        "every idle connection is closed by the server"
    );
    assert_eq!(failed, 0, "/healthz and /mutate answered throughout");
    assert!(max_fds < nofile as usize, "{max_fds}");
    // Limit hits are logged at warn, but rate-limited.
    let log = s.log_text();
    let warned = log
        .lines()
        .filter(|l| l.contains("connection limit hit"))
        .count();
    assert!((1..=20).contains(&warned), "{warned} warnings:\n{log}");
}

#[tokio::test]
async fn request_values_cannot_forge_log_lines_and_denials_stay_short() {
    let s = Served::start("", "failurePolicy: closed", None).await;
    let mut review: serde_json::Value = serde_json::from_str(POD_CREATE).unwrap();
    review["request"]["uid"] = "u1\nFORGED admitted\u{1b}[31m".into();
    let image = format!("registry.invalid/x\n\u{1b}[2J{}:1", "a".repeat(1 << 20));
    review["request"]["object"]["spec"]["containers"][0]["image"] = image.into();
    review["request"]["object"]["metadata"]["name"] = "p\nFORGED pod".into();
    let r = s.send(&s.client(), &review.to_string()).await.unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = r.json().await.unwrap();
    assert_eq!(answer["response"]["allowed"], false, "{answer:#}");
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(message.len() < 8 * 1024, "{} bytes", message.len());
    assert!(!message.contains('\u{1b}'), "{message}");
    let t = Instant::now();
    while !s.log_text().contains("denied") {
        assert!(t.elapsed() < Duration::from_secs(10), "no denial logged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = s.log_text();
    assert!(!log.contains('\u{1b}'), "an escape reached the log");
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a forged line:\n{log}"
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 16 * 1024, "a {longest}-byte log line");
}

#[tokio::test]
async fn sigterm_under_load_answers_every_request_sent_during_the_delay() {
    let delay = Duration::from_secs(2);
    let s = Arc::new(Served::start("shutdownDelay: 2s, drainTimeout: 3s", "", None).await);
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut streams = Vec::new();
    // Two clients: one kept alive, one with a fresh connection each time.
    for keep_alive in [true, false] {
        let (s, results, stop) = (s.clone(), results.clone(), stop.clone());
        streams.push(tokio::spawn(async move {
            let mut client = s.client();
            while !stop.load(Ordering::Relaxed) {
                if !keep_alive {
                    client = s.client();
                }
                let sent = Instant::now();
                let r = s.post(&client, POD_CREATE).await;
                results
                    .lock()
                    .unwrap()
                    .push((sent, r.map_err(|e| e.to_string())));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    // Both streams answered before the signal.
    let answered = |results: &std::sync::Mutex<Vec<(Instant, Result<u16, String>)>>| {
        results
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r)| r == &Ok(200))
            .count()
    };
    let t = Instant::now();
    while answered(&results) < 10 {
        assert!(t.elapsed() < Duration::from_secs(10), "no steady stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let term = Instant::now();
    s.sigterm();
    // Readiness fails as soon as the signal is handled; liveness holds.
    while s.health_get("/readyz").await.0 != 503 {
        assert!(term.elapsed() < delay, "readiness still passes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.health_get("/readyz").await, (503, "shutting down".into()));
    assert!(s.healthz().await, "liveness holds during the delay");
    // The streams run until the listener is gone (a request fails) or a
    // request sent after the delay was answered.
    let past = |results: &std::sync::Mutex<Vec<(Instant, Result<u16, String>)>>| {
        results
            .lock()
            .unwrap()
            .iter()
            .any(|(sent, r)| r.is_err() || *sent > term + delay)
    };
    while !past(&results) {
        assert!(
            term.elapsed() < delay * 4,
            "neither closed nor answered after the delay"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in streams {
        t.await.unwrap();
    }
    let s = Arc::try_unwrap(s).ok().expect("no other owner");
    let mut child = s.child;
    let status = tokio::time::timeout(Duration::from_secs(6), child.wait())
        .await
        .expect("exits after the delay and the drain")
        .unwrap();
    assert!(status.success(), "{status}");
    let results = results.lock().unwrap();
    let during: Vec<_> = results
        .iter()
        .filter(|(sent, _)| *sent >= term && *sent < term + delay - Duration::from_millis(100))
        .collect();
    let before = results.iter().filter(|(sent, _)| *sent < term).count();
    eprintln!(
        "{before} requests before SIGTERM, {} during the delay",
        during.len()
    );
    assert!(during.len() >= 20, "a steady stream: {}", during.len());
    for (sent, r) in &during {
        assert_eq!(
            r,
            &Ok(200),
            "sent {:?} after SIGTERM",
            sent.duration_since(term)
        );
    }
}

/// A review of a Pod with `n` containers, each its own image.
fn wide_review(n: usize) -> String {
    let containers: Vec<serde_json::Value> = (0..n)
        .map(|i| serde_json::json!({"name": format!("c{i}"), "image": format!("registry.invalid/x{i}:1")}))
        .collect();
    let mut review: serde_json::Value = serde_json::from_str(POD_CREATE).unwrap();
    review["request"]["object"]["spec"]["containers"] = containers.into();
    review.to_string()
}

/// A review holds `PARSED_FACTOR` (32) times its body while it is parsed:
/// under `bodyMemory: 128Mi` (a large half of 64 MiB) a 3.8 MiB review of
/// 75,000 distinct images (123 MiB parsed) is refused with 413 (it can
/// never fit: a retry cannot help), naming the setting to raise, and a
/// 1.3 MiB one (43 MiB parsed) is answered. Counted at 8 times its body,
/// the large one was parsed too, though it takes 23 times that much.
#[tokio::test]
async fn a_review_reserves_its_parsed_size() {
    let s = Served::start("bodyMemory: 128Mi, bodyTimeout: 20s", "", None).await;
    // A debug build on a loaded machine answers such reviews in seconds.
    let client = s.client_with_timeout(Duration::from_secs(300));
    let large = wide_review(75_000);
    let small = wide_review(25_000);
    assert!(
        large.len() as u64 * PARSED_FACTOR > 64 * MIB,
        "{}",
        large.len()
    );
    assert!(
        small.len() as u64 * PARSED_FACTOR < 64 * MIB,
        "{}",
        small.len()
    );
    let answer = |r: &str| {
        let (s, client, r) = (&s, &client, r.to_owned());
        async move {
            let a = s.send(client, &r).await.unwrap();
            (a.status().as_u16(), a.text().await.unwrap())
        }
    };
    let (status, text) = answer(&large).await;
    assert_eq!(status, 413, "{} bytes: {text}", large.len());
    assert!(text.contains("raise server.bodyMemory"), "{text}");
    assert_eq!(answer(&small).await.0, 200, "{} bytes", small.len());
}

/// Large reviews with `bodyMemory` at the install's whole 512 MiB: eight
/// 3.8 MiB reviews of 75,000 distinct images at once. The large half
/// (256 MiB) holds two being parsed; the others are refused with 503, and
/// the process stays under the memory limit.
#[tokio::test]
async fn large_reviews_stay_inside_the_budget_and_the_memory_limit() {
    let s = Arc::new(Served::start("bodyMemory: 512Mi, bodyTimeout: 20s", "", None).await);
    let review = Arc::new(wide_review(75_000));
    eprintln!("review of {} bytes", review.len());
    let before = s.status_kib("VmRSS");
    // A debug build on a loaded machine answers such reviews in seconds.
    let client = s.client_with_timeout(Duration::from_secs(300));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (s, review, client) = (s.clone(), review.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            let r = s.send(&client, &review).await.unwrap();
            let status = r.status().as_u16();
            let answer = r.bytes().await.unwrap();
            (status, answer.len())
        }));
    }
    let mut answered = 0;
    for t in tasks {
        let (status, size) = t.await.unwrap();
        assert!(status == 200 || status == 503, "{status}");
        if status == 200 {
            answered += 1;
            assert!(size < 512 * 1024, "{size}");
        }
    }
    assert!(answered >= 1, "none of eight answered");
    let peak = s.status_kib("VmHWM");
    eprintln!("{answered} of 8 answered; RSS before {before} KiB, peak {peak} KiB");
    assert!(peak < 512 * 1024, "the install's memory limit: {peak} KiB");
}
