//! `pinswap copy` when things go wrong: registry errors and usage errors
//! named precisely, quiet and JSON output, a source dying or serving wrong
//! bytes, a refused mount, and SIGTERM mid-copy.

mod common;

use common::cli::pinswap;
use common::copying::*;
use common::fixtures::Image;
use common::{TcpCutProxy, TestRegistry, pinswap_bin, push_image};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_reference_registry_status_and_code() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    push_image(&src, "app", Some("v1"), &Image::oci(1, 51)).await;
    let out = pinswap(&["copy", &d(&src, "app:nope"), &d(&dst, "app:v1")]).await;
    assert_eq!(out.code, 1);
    for want in [src.host().as_str(), "app:nope", "404", "MANIFEST_UNKNOWN"] {
        assert!(
            out.stderr.contains(want),
            "missing {want:?} in {}",
            out.stderr
        );
    }
    let out = pinswap(&["copy", "docker://nosuch.invalid/app:v1", &d(&dst, "app:v1")]).await;
    assert_eq!(out.code, 1);
    out.says("cannot reach registry nosuch.invalid");
    // A loopback registry is tried over plain HTTP, then HTTPS: both are named.
    let down = format!("127.0.0.1:{}", common::registry::free_port());
    let out = pinswap(&[
        "copy",
        &format!("docker://{down}/app:v1"),
        "oci:/nonexistent",
    ])
    .await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .contains(&format!("cannot reach registry {down}: tried http"))
            && out.stderr.contains("https"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2_with_a_precise_message() {
    for (args, want) in [
        (vec!["copy", "docker://Upper/Case:v1"], "DESTINATION"),
        (
            vec!["copy", "docker://nginx", "docker://x/Nginx:v1"],
            "must be lowercase",
        ),
        (
            vec!["copy", "docker-daemon:nginx", "docker://x/y:v1"],
            "expected docker://REFERENCE, oci:DIR[:REF], or a bare REFERENCE",
        ),
        (
            vec!["copy", "--jobs", "0", "docker://a/b", "docker://c/d"],
            "--jobs",
        ),
        (
            vec![
                "copy",
                "--platform",
                "linux",
                "docker://a/b",
                "docker://c/d",
            ],
            "expected os/arch[/variant]",
        ),
        (
            vec![
                "copy",
                "--from-file",
                "/nonexistent/list",
                "--to",
                "docker://127.0.0.1:1/m",
            ],
            "/nonexistent/list",
        ),
        (
            vec![
                "copy",
                "--dest-creds",
                "nocolon",
                "docker://a/b",
                "docker://c/d",
            ],
            "--dest-creds: expected USER:PASSWORD",
        ),
        (
            vec!["copy", "docker://bob:hunter2@h:5000/a", "docker://c/d"],
            "credentials in a docker:// reference are not supported",
        ),
        (
            vec!["copy", "docker://a/b", "oci:/tmp/x:has space"],
            "ref.name grammar",
        ),
        (
            vec![
                "copy",
                "--chunked-threshold",
                "1",
                "docker://a/b",
                "docker://c/d",
            ],
            "--chunked-threshold",
        ),
        (
            vec![
                "copy",
                "--ca-cert",
                "/etc/hostname",
                "docker://a/b",
                "docker://c/d",
            ],
            "no PEM certificate",
        ),
        (
            vec![
                "copy",
                "--insecure-registry",
                "http://x",
                "docker://a/b",
                "docker://c/d",
            ],
            "expected HOST[:PORT]",
        ),
        (
            vec![
                "copy",
                "--authfile",
                "/nonexistent/auth.json",
                "docker://a/b",
                "docker://c/d",
            ],
            "--authfile /nonexistent/auth.json",
        ),
        (
            vec![
                "copy",
                "--platform",
                "linux/amd64",
                "docker://a/b:v1",
                "docker://a/b:v1",
            ],
            "would replace the index",
        ),
    ] {
        let out = pinswap(&args).await;
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(want),
            "{args:?}: want {want:?} in {}",
            out.stderr
        );
    }
    let list = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(list.path(), "ok.example/a:v1\nBad/Ref:Ω\n").unwrap();
    let out = pinswap(&[
        "copy",
        "--from-file",
        list.path().to_str().unwrap(),
        "--to",
        "docker://127.0.0.1:1/m",
    ])
    .await;
    assert_eq!(out.code, 2);
    out.says(format!("{}:2:", list.path().display()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_is_quiet_off_a_terminal_and_json_is_stable() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(2, 61);
    push_image(&src, "app", Some("v1"), &img).await;
    let out = pinswap(&["copy", &d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_eq!(out.code, 0);
    assert_eq!(
        out.stdout.lines().count(),
        1,
        "one summary line: {:?}",
        out.stdout
    );
    assert!(out.stdout.starts_with("copied "), "{:?}", out.stdout);
    assert!(
        !out.stdout.contains('\r') && !out.stdout.contains('\x1b'),
        "no progress bars off a TTY"
    );
    let r = copy_json(&[&d(&src, "app:v1"), &d(&dst, "app2:v1")]).await;
    let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
    for k in [
        "source",
        "destination",
        "digest",
        "mediaType",
        "manifestsPushed",
        "blobsCopied",
        "blobsSkipped",
        "blobsMounted",
        "bytesCopied",
        "upToDate",
        "durationSeconds",
    ] {
        assert!(keys.contains(&k), "missing {k} in {r}");
    }
    // --log-format json writes JSON lines on stderr.
    let out = pinswap(&[
        "--log-format",
        "json",
        "--log-level",
        "info",
        "copy",
        &d(&src, "app:v1"),
        &d(&dst, "app3:v1"),
    ])
    .await;
    assert_eq!(out.code, 0);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("copied"))
        .expect("an info line");
    let v: Value = serde_json::from_str(line).expect("log line is JSON");
    assert_eq!(v["level"], "INFO");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_dying_mid_copy_leaves_no_manifest_and_a_rerun_completes() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::random_layers(4, 2 * 1024 * 1024, 71);
    push_image(&src, "app", Some("v1"), &img).await;
    let proxy = TcpCutProxy::start(&src.host()).await;
    proxy.cut_after_bytes(3 * 1024 * 1024);
    let via = format!("docker://{}/app:v1", proxy.host());
    let out = pinswap(&["copy", "--jobs", "1", &via, &d(&dst, "app:v1")]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(proxy.is_cut());
    assert!(
        dst.head_manifest("app", "v1").await.is_none(),
        "no manifest after a failed copy"
    );
    assert!(dst.tags("app").await.is_empty());
    // The registry process itself dies and comes back; a rerun completes.
    let mut src = src;
    src.kill();
    let out = pinswap(&["copy", &d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_eq!(out.code, 1);
    assert!(dst.head_manifest("app", "v1").await.is_none());
    src.restart().await;
    let r = copy_json(&[&d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_image(&dst, "app", "v1", &img).await;
    assert_eq!(
        r["blobsCopied"].as_u64().unwrap() + r["blobsSkipped"].as_u64().unwrap(),
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_source_bytes_fail_and_push_nothing() {
    for threshold in ["67108864", "1048576"] {
        let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
        let img = Image::random_layers(2, 5 * 1024 * 1024 / 2, 81);
        push_image(&src, "app", Some("v1"), &img).await;
        let victim = &img.layers[1];
        // Same length, different bytes: only the digest can catch it.
        let mut bad = victim.bytes.clone();
        bad[1000] ^= 0xff;
        src.corrupt_blob(&victim.digest, &bad);
        let out = pinswap(&[
            "copy",
            "--chunked-threshold",
            threshold,
            &d(&src, "app:v1"),
            &d(&dst, "app:v1"),
        ])
        .await;
        assert_eq!(out.code, 1, "threshold {threshold}: {}", out.stderr);
        // The same words as for a layout source: pinswap hashes both.
        let want = format!(
            "blob {} from {}/app:v1: blob {} hashes to sha256:",
            victim.digest,
            src.host(),
            victim.digest
        );
        assert!(
            out.stderr.contains(&want),
            "threshold {threshold}: want {want:?} in {}",
            out.stderr
        );
        assert!(
            !dst.blob_exists("app", &victim.digest).await,
            "bad blob committed"
        );
        assert!(dst.head_manifest("app", "v1").await.is_none());
        assert!(dst.tags("app").await.is_empty());
    }
}

/// A mount the registry refuses by starting an upload instead (HTTP 202:
/// Distribution does so when the `from` repository lacks the blob) falls
/// back to streaming that blob from the source in the same copy, and the
/// copy is byte-exact. Here the CLI's remembered location is stale: the
/// first copy's repository lost a layer since. The upload the refused
/// mount started is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_mount_falls_back_to_streaming() {
    use common::front::Front;
    let (src, reg) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let rf = Front::start(&reg.host()).await;
    let img = Image::oci(3, 1021);
    push_image(&src, "app", Some("v1"), &img).await;
    let cache = common::cache_home();
    let copy = |to: String| {
        let cache = cache.path().to_owned();
        let from = d(&src, "app:v1");
        async move {
            let out = tokio::process::Command::new(pinswap_bin())
                .args(["copy", "--json", &from, &to])
                .env("XDG_CACHE_HOME", &cache)
                .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
                .env_remove("REGISTRY_AUTH_FILE")
                .output()
                .await
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "{stderr}");
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            v["images"][0].clone()
        }
    };
    copy(format!("docker://{}/a/app:v1", rf.host())).await;
    let lost = &img.layers[1];
    reg.delete_blob("a/app", &lost.digest).await;
    rf.reset();

    let r = copy(format!("docker://{}/b/app:v1", rf.host())).await;
    assert_eq!(
        (r["blobsMounted"].as_u64(), r["blobsCopied"].as_u64()),
        (Some(3), Some(1)),
        "{r}"
    );
    let requests = rf.requests();
    let mount = format!("mount={}", lost.digest.replace(':', "%3A"));
    let refused: Vec<_> = requests
        .iter()
        .filter(|(m, p)| m == "POST" && p.contains(&mount) && p.contains("from=a%2Fapp"))
        .collect();
    assert_eq!(refused.len(), 1, "{requests:?}");
    assert!(
        requests
            .iter()
            .any(|(m, p)| m == "DELETE" && p.starts_with("/v2/b/app/blobs/uploads/")),
        "the started upload is cancelled: {requests:?}"
    );
    assert_image(&reg, "b/app", "v1", &img).await;
}

/// SIGTERM to `pinswap copy` while its layers are held by a stalled source
/// leaves no manifest at the target: a registry has no tag and no manifest
/// of the image, an OCI layout no `index.json` entry and no manifest blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_copy_leaves_no_manifest_at_the_target() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let proxy = TcpCutProxy::start(&src.host()).await;
    let img = Image::random_layers(2, 1 << 20, 1041);
    push_image(&src, "app", Some("v1"), &img).await;
    // Manifests and the config pass; the layers stall.
    proxy.stall_after(256 * 1024);
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let via = format!("docker://{}/app:v1", proxy.host());
    let cache = common::cache_home();
    for to in [d(&dst, "app:v1"), format!("oci:{}:v1", layout.display())] {
        let before = proxy.bytes_down();
        let mut child = tokio::process::Command::new(pinswap_bin())
            .args(["copy", &via, &to])
            .env("XDG_CACHE_HOME", cache.path())
            .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // In flight: both layers have reached the stall.
        let start = std::time::Instant::now();
        while proxy.bytes_down() < before + 2 * 256 * 1024 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(20),
                "{to}: the copy never reached the layers"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let pid = child.id().unwrap();
        let killed = std::process::Command::new("sh")
            .args(["-c", &format!("kill -TERM {pid}")])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = child.wait().await.unwrap();
        assert!(!status.success(), "{to}: {status}");
    }
    proxy.release();
    assert!(dst.tags("app").await.is_empty());
    assert_eq!(dst.head_manifest("app", &img.digest).await, None);
    let index = std::fs::read(layout.join("index.json")).unwrap_or_default();
    let entries = serde_json::from_slice::<Value>(&index)
        .ok()
        .and_then(|v| v["manifests"].as_array().map(Vec::len))
        .unwrap_or(0);
    assert_eq!(entries, 0, "{}", String::from_utf8_lossy(&index));
    let hex = img.digest.strip_prefix("sha256:").unwrap();
    assert!(
        !layout.join("blobs/sha256").join(hex).exists(),
        "the manifest blob is in the layout"
    );
}
