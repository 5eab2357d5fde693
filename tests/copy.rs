//! `pinswap copy` against real Distribution registries: every media type,
//! indexes, blob handling, batch, auth, output and faults. Each test checks
//! what the target registry serves afterwards, byte for byte.

mod common;

use std::sync::Arc;

use common::cli::{pinswap, pinswap_env};
use common::fixtures::{Blob, Image, Index};
use common::skopeo;
use common::{TcpCutProxy, TestRegistry, pinswap_bin, push_image, push_index};
use serde_json::Value;

/// Runs a copy with `--json`, asserts success, returns the first image's report.
async fn copy_json(args: &[&str]) -> Value {
    common::cli::copy_json(None, args).await
}

/// An OCI image made of these layers, with a config unique to `n`.
fn image_of(layers: Vec<Blob>, n: u64) -> Image {
    let config = Blob::new(
        "application/vnd.oci.image.config.v1+json",
        format!(r#"{{"architecture":"amd64","os":"linux","config":{{"Labels":{{"n":"{n}"}}}}}}"#)
            .into_bytes(),
    );
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config.descriptor(),
        "layers": layers.iter().map(Blob::descriptor).collect::<Vec<_>>(),
    }))
    .unwrap();
    Image {
        digest: common::sha256_digest(&manifest),
        manifest,
        media_type: "application/vnd.oci.image.manifest.v1+json".into(),
        config,
        layers,
    }
}

fn d(reg: &TestRegistry, path: &str) -> String {
    format!("docker://{}/{path}", reg.host())
}

/// The target serves exactly the fixture's manifest bytes, type and digest.
async fn assert_manifest(
    reg: &TestRegistry,
    repo: &str,
    reference: &str,
    manifest: &[u8],
    media_type: &str,
    digest: &str,
) {
    let (bytes, ct, dg) = reg
        .get_manifest(repo, reference)
        .await
        .unwrap_or_else(|| panic!("{repo}:{reference} missing at {}", reg.host()));
    assert!(
        bytes == manifest,
        "{repo}:{reference}: manifest bytes differ"
    );
    assert_eq!(ct, media_type, "{repo}:{reference}: content type");
    assert_eq!(dg, digest, "{repo}:{reference}: digest");
}

/// Every blob of `img` is in `repo` with the same bytes.
async fn assert_blobs(reg: &TestRegistry, repo: &str, img: &Image) {
    for b in img.blobs() {
        let got = reg
            .blob(repo, &b.digest)
            .await
            .unwrap_or_else(|| panic!("blob {} missing in {repo}", b.digest));
        assert!(got == b.bytes, "blob {} differs in {repo}", b.digest);
    }
}

async fn assert_image(reg: &TestRegistry, repo: &str, tag: &str, img: &Image) {
    assert_manifest(reg, repo, tag, &img.manifest, &img.media_type, &img.digest).await;
    assert_blobs(reg, repo, img).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_image_is_copied_byte_exact() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(3, 1);
    push_image(&src, "app", Some("v1"), &img).await;
    let r = copy_json(&[&d(&src, "app:v1"), &d(&dst, "mirror/app:v1")]).await;
    assert_image(&dst, "mirror/app", "v1", &img).await;
    assert_eq!(r["digest"], img.digest.as_str());
    assert_eq!(r["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(r["blobsCopied"], 4);
    assert_eq!(r["blobsSkipped"], 0);
    assert_eq!(r["manifestsPushed"], 1);
    let bytes: u64 = img.blobs().map(|b| b.size()).sum();
    assert_eq!(r["bytesCopied"], bytes);
    assert_eq!(r["upToDate"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_schema2_keeps_its_bytes_and_type() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::docker(2, 2);
    push_image(&src, "lib/web", Some("1.0"), &img).await;
    copy_json(&[&d(&src, "lib/web:1.0"), &d(&dst, "lib/web:1.0")]).await;
    assert_image(&dst, "lib/web", "1.0", &img).await;
    // skopeo, an independent client, sees the same bytes.
    assert_eq!(
        skopeo::inspect_raw(&dst, "lib/web", "1.0").await,
        img.manifest
    );
    assert_eq!(
        skopeo::inspect_digest(&dst, "lib/web", "1.0").await,
        img.digest
    );
}

async fn check_index(src: &TestRegistry, dst: &TestRegistry, idx: &Index, repo: &str) {
    assert_manifest(dst, repo, "v1", &idx.manifest, &idx.media_type, &idx.digest).await;
    for child in &idx.children {
        assert_image(dst, repo, &child.digest, child).await;
    }
    assert_eq!(skopeo::inspect_raw(dst, repo, "v1").await, idx.manifest);
    assert_eq!(
        skopeo::inspect_digest(dst, repo, "v1").await,
        skopeo::inspect_digest(src, repo, "v1").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_index_copies_every_child() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::oci(3, true);
    push_index(&src, "multi", Some("v1"), &idx).await;
    let r = copy_json(&[&d(&src, "multi:v1"), &d(&dst, "multi:v1")]).await;
    assert_eq!(r["manifestsPushed"], 4, "3 children + the index");
    check_index(&src, &dst, &idx, "multi").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_manifest_list_copies_every_child() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::docker(4);
    push_index(&src, "multi", Some("v1"), &idx).await;
    copy_json(&[&d(&src, "multi:v1"), &d(&dst, "multi:v1")]).await;
    check_index(&src, &dst, &idx, "multi").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_filter_writes_a_filtered_index() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::oci(5, true);
    push_index(&src, "multi", Some("v1"), &idx).await;
    let r = copy_json(&[
        "--platform",
        "linux/arm64",
        &d(&src, "multi:v1"),
        &d(&dst, "multi:v1"),
    ])
    .await;
    let (bytes, ct, digest) = dst.get_manifest("multi", "v1").await.unwrap();
    assert_ne!(digest, idx.digest, "a filtered index is a new manifest");
    assert_eq!(r["digest"], digest.as_str());
    assert_eq!(ct, idx.media_type);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let entries = v["manifests"].as_array().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["platform"]["architecture"], "arm64");
    let arm = &idx.children[1];
    assert_eq!(entries[0]["digest"], arm.digest.as_str());
    assert_image(&dst, "multi", &arm.digest, arm).await;
    // The other platforms were not copied.
    assert!(
        dst.head_manifest("multi", &idx.children[0].digest)
            .await
            .is_none()
    );
    assert!(
        !dst.blob_exists("multi", &idx.children[0].layers[0].digest)
            .await
    );
    // A second run sees the same filtered digest and does nothing.
    let again = copy_json(&[
        "--platform",
        "linux/arm64",
        &d(&src, "multi:v1"),
        &d(&dst, "multi:v1"),
    ])
    .await;
    assert_eq!(again["upToDate"], true);
    assert_eq!(again["digest"], digest.as_str());
    // When every entry matches there is nothing to filter: the index stays as it is.
    let plain = Index::oci(6, false);
    push_index(&src, "two", Some("v1"), &plain).await;
    let all = copy_json(&[
        "--platform",
        "linux/amd64",
        "--platform",
        "linux/arm64",
        &d(&src, "two:v1"),
        &d(&dst, "two:v1"),
    ])
    .await;
    assert_eq!(all["digest"], plain.digest.as_str());
    check_index(&src, &dst, &plain, "two").await;
    let none = pinswap(&[
        "copy",
        "--platform",
        "windows/amd64",
        &d(&src, "two:v1"),
        &d(&dst, "three:v1"),
    ])
    .await;
    assert_eq!(none.code, 1);
    assert!(
        none.stderr.contains(&format!(
            "no entry of index {} matches platform(s) windows/amd64",
            plain.digest
        )),
        "{}",
        none.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_of_any_media_type_copy_byte_exact() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let spin = Image::spin(
        "hello",
        2,
        Some("application/vnd.fermyon.spin.application.v1+config"),
    );
    let oras = Image::oras(
        "application/vnd.example.sbom.v1",
        "sbom.json",
        b"{\"sbom\":true}",
    );
    let helm = Image::helm("mychart", "0.1.0");
    let sig = Image::referrer(
        &spin.descriptor(),
        "application/vnd.dev.cosign.artifact.sig.v1+json",
        b"sig",
    );
    for (repo, img) in [
        ("spin/hello", &spin),
        ("oras/sbom", &oras),
        ("charts/mychart", &helm),
        ("spin/hello-sig", &sig),
    ] {
        push_image(&src, repo, Some("v1"), img).await;
        copy_json(&[
            &d(&src, &format!("{repo}:v1")),
            &d(&dst, &format!("m/{repo}:v1")),
        ])
        .await;
        assert_image(&dst, &format!("m/{repo}"), "v1", img).await;
    }
    assert_eq!(spin.config.bytes.len(), 78);
    assert_eq!(
        skopeo::inspect_raw(&dst, "m/spin/hello", "v1").await,
        spin.manifest
    );
    let v: Value = serde_json::from_slice(&sig.manifest).unwrap();
    assert_eq!(
        v["subject"]["digest"],
        spin.digest.as_str(),
        "fixture has a subject"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn present_blobs_are_skipped_and_same_registry_blobs_mounted() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(3, 7);
    push_image(&src, "app", Some("v1"), &img).await;
    // Target already holds the config and first layer.
    common::push_blob(&dst, "app", &img.config).await;
    common::push_blob(&dst, "app", &img.layers[0]).await;
    let r = copy_json(&[&d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_eq!(
        (r["blobsSkipped"].as_u64(), r["blobsCopied"].as_u64()),
        (Some(2), Some(2))
    );
    assert_image(&dst, "app", "v1", &img).await;

    // Within one registry, blobs are mounted, not streamed.
    let r = copy_json(&[&d(&src, "app:v1"), &d(&src, "other/app:v1")]).await;
    assert_eq!(r["blobsMounted"], 4, "{r}");
    assert_eq!(r["blobsCopied"], 0);
    assert_eq!(r["bytesCopied"], 0);
    assert_image(&src, "other/app", "v1", &img).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_copy_only_checks() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(2, 9);
    push_image(&src, "app", Some("v1"), &img).await;
    copy_json(&[&d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    let r = copy_json(&[&d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_eq!(r["upToDate"], true);
    // A warm copy only HEADs, and the HEAD's Content-Type is the mediaType.
    assert_eq!(r["mediaType"], img.media_type.as_str(), "{r}");
    assert_eq!(r["manifestsPushed"], 0);
    assert_eq!(r["blobsCopied"], 0);
    assert_eq!(r["digest"], img.digest.as_str());
    let text = pinswap(&["copy", &d(&src, "app:v1"), &d(&dst, "app:v1")]).await;
    assert_eq!(text.code, 0);
    assert!(text.stdout.starts_with("up to date"), "{}", text.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_upload_is_byte_exact() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    // 3 MiB layers with 1 MiB chunks: three PATCH requests per layer.
    let img = Image::random_layers(2, 3 * 1024 * 1024 + 17, 11);
    push_image(&src, "big", Some("v1"), &img).await;
    let r = copy_json(&[
        "--chunked-threshold",
        "1048576",
        &d(&src, "big:v1"),
        &d(&dst, "big:v1"),
    ])
    .await;
    assert_eq!(r["blobsCopied"], 3);
    assert_image(&dst, "big", "v1", &img).await;
    // Chunked for real: each layer took four PATCHes (3 MiB and 17 bytes in
    // 1 MiB chunks); the small config went up in one PUT.
    let patches = dst
        .log()
        .lines()
        .filter(|l| l.contains("\"PATCH /v2/big/blobs/uploads/"))
        .count();
    assert_eq!(patches, 8, "{}", dst.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_references_and_pinned_destinations() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::oci(1, 12);
    push_image(&src, "app", Some("v1"), &img).await;
    let by_digest = format!("app@{}", img.digest);
    // Digest-only source to tag+digest destination.
    copy_json(&[
        &d(&src, &by_digest),
        &d(&dst, &format!("app:v1@{}", img.digest)),
    ])
    .await;
    assert_image(&dst, "app", "v1", &img).await;
    // The digest is already there under v1; a pinned v2 still gets its tag.
    let r = copy_json(&[
        &d(&src, &by_digest),
        &d(&dst, &format!("app:v2@{}", img.digest)),
    ])
    .await;
    assert_eq!(r["upToDate"], false);
    assert_eq!(r["manifestsPushed"], 1);
    assert_eq!(r["blobsSkipped"], 2);
    assert_eq!(
        dst.head_manifest("app", "v2").await.as_deref(),
        Some(img.digest.as_str())
    );
    // A destination pinned to another digest is refused before any push.
    let other = format!("sha256:{}", "0".repeat(64));
    let out = pinswap(&[
        "copy",
        &d(&src, "app:v1"),
        &d(&dst, &format!("app2:v1@{other}")),
    ])
    .await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains(&format!("pins digest {other}")),
        "{}",
        out.stderr
    );
    assert!(dst.head_manifest("app2", "v1").await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mirrors_by_path_and_streams_shared_blobs_once() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    // Three images sharing one base layer (the same seed gives the same layer 0).
    let base = Image::oci(1, 21);
    let mut images = Vec::new();
    for i in 0..3 {
        let own = Image::oci(1, 100 + i);
        let img = image_of(vec![base.layers[0].clone(), own.layers[0].clone()], i);
        push_image(&src, &format!("team/app{i}"), Some("v1"), &img).await;
        images.push(img);
    }
    let list = tempfile::NamedTempFile::new().unwrap();
    let mut text = String::from("# images to mirror\n\n");
    for i in 0..3 {
        // `#` starts a comment anywhere on a line.
        let comment = if i == 1 { "  # the second app" } else { "" };
        text.push_str(&format!("{}/team/app{i}:v1{comment}\n", src.host()));
    }
    text.push_str(&format!("docker://{}/team/app0:v1\n", src.host())); // duplicate
    std::fs::write(list.path(), text).unwrap();
    let to = format!("docker://{}/mirror", dst.host());
    let out = pinswap(&[
        "copy",
        "--json",
        "--from-file",
        list.path().to_str().unwrap(),
        "--to",
        &to,
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["succeeded"], 3);
    let comp = format!("127.0.0.1_{}", src.port());
    let mut streamed = 0;
    let mut mounted = 0;
    for (i, img) in images.iter().enumerate() {
        let repo = format!("mirror/{comp}/team/app{i}");
        assert_image(&dst, &repo, "v1", img).await;
        let r = v["images"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["destination"] == format!("docker://{}/{repo}:v1", dst.host()).as_str())
            .unwrap_or_else(|| panic!("no report for {repo}: {v}"));
        streamed += r["blobsCopied"].as_u64().unwrap();
        mounted += r["blobsMounted"].as_u64().unwrap();
    }
    // 3 configs + 3 unique layers + the shared base once; the base is mounted twice.
    assert_eq!(streamed, 7, "{v}");
    assert_eq!(mounted, 2, "{v}");

    // Again: all up to date, and each still reports its mediaType.
    let list_arg = list.path().to_str().unwrap();
    let out = pinswap(&["copy", "--json", "--from-file", list_arg, "--to", &to]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    for r in v["images"].as_array().unwrap() {
        assert_eq!(r["upToDate"], true, "{v}");
        assert_eq!(r["mediaType"], images[0].media_type.as_str(), "{v}");
    }

    // In text mode a batch ends with its tally, failures included.
    let mut text = std::fs::read_to_string(list.path()).unwrap();
    text.push_str(&format!("{}/team/missing:v1\n", src.host()));
    std::fs::write(list.path(), text).unwrap();
    let out = pinswap(&["copy", "--from-file", list_arg, "--to", &to]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(
        out.stdout.lines().last(),
        Some("4 images: 0 copied, 3 up to date, 1 failed"),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_layouts_both_ways() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::oci(31, false);
    push_index(&src, "multi", Some("v1"), &idx).await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let lref = format!("oci:{}:v1", layout.display());
    copy_json(&[&d(&src, "multi:v1"), &lref]).await;
    // skopeo reads our layout and sees the same index bytes.
    let raw = tokio::process::Command::new("skopeo")
        .args(["inspect", "--raw", &lref])
        .output()
        .await
        .unwrap();
    assert!(
        raw.status.success(),
        "{}",
        String::from_utf8_lossy(&raw.stderr)
    );
    assert!(raw.stdout == idx.manifest, "layout index bytes differ");
    // And back into a registry.
    copy_json(&[&lref, &d(&dst, "multi:v1")]).await;
    check_index(&src, &dst, &idx, "multi").await;
    // A corrupted layout blob is caught before anything is pushed.
    let victim = &idx.children[0].layers[1];
    let hex = victim.digest.trim_start_matches("sha256:");
    let mut bad = victim.bytes.clone();
    bad[7] ^= 0x01;
    std::fs::write(layout.join("blobs/sha256").join(hex), bad).unwrap();
    let out = pinswap(&["copy", &lref, &d(&dst, "fresh:v1")]).await;
    assert_eq!(out.code, 1);
    let want = format!(
        "blob {} from oci:{}:v1: blob {} hashes to sha256:",
        victim.digest,
        layout.display(),
        victim.digest
    );
    assert!(
        out.stderr.contains(&want),
        "want {want:?} in {}",
        out.stderr
    );
    assert!(dst.head_manifest("fresh", "v1").await.is_none());
    assert!(!dst.blob_exists("fresh", &victim.digest).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_basic_auth_with_flags_authfile_docker_config_and_helper() {
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::tls_auth("mirror", "s3cret-pw").await;
    let img = Image::oci(1, 41);
    push_image(&src, "app", Some("v1"), &img).await;
    let ca = dst.ca_pem_path();
    let ca = ca.to_str().unwrap();

    // Flags.
    copy_json(&[
        "--ca-cert",
        ca,
        "--dest-creds",
        "mirror:s3cret-pw",
        &d(&src, "app:v1"),
        &d(&dst, "a1:v1"),
    ])
    .await;
    assert_image(&dst, "a1", "v1", &img).await;

    // --authfile.
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.json");
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode("mirror:s3cret-pw");
    std::fs::write(
        &auth,
        format!(r#"{{"auths":{{"{}":{{"auth":"{b64}"}}}}}}"#, dst.host()),
    )
    .unwrap();
    copy_json(&[
        "--ca-cert",
        ca,
        "--authfile",
        auth.to_str().unwrap(),
        &d(&src, "app:v1"),
        &d(&dst, "a2:v1"),
    ])
    .await;
    assert_image(&dst, "a2", "v1", &img).await;

    // $DOCKER_CONFIG/config.json.
    let out = pinswap_env(
        &[
            "copy",
            "--ca-cert",
            ca,
            &d(&src, "app:v1"),
            &d(&dst, "a3:v1"),
        ],
        &[("DOCKER_CONFIG", dir.path().to_str().unwrap())],
    )
    .await;
    assert_eq!(out.code, 1, "auth.json is not config.json");
    std::fs::copy(&auth, dir.path().join("config.json")).unwrap();
    let out = pinswap_env(
        &[
            "copy",
            "--ca-cert",
            ca,
            &d(&src, "app:v1"),
            &d(&dst, "a3:v1"),
        ],
        &[("DOCKER_CONFIG", dir.path().to_str().unwrap())],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_image(&dst, "a3", "v1", &img).await;

    // A credential helper (docker-credential-<name> on PATH).
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let helper = bin.join("docker-credential-pinswaptest");
    std::fs::write(
        &helper,
        "#!/bin/sh\nread server\necho \"{\\\"ServerURL\\\":\\\"$server\\\",\\\"Username\\\":\\\"mirror\\\",\\\"Secret\\\":\\\"s3cret-pw\\\"}\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = dir.path().join("helper");
    std::fs::create_dir(&cfg).unwrap();
    std::fs::write(
        cfg.join("config.json"),
        format!(r#"{{"credHelpers":{{"{}":"pinswaptest"}}}}"#, dst.host()),
    )
    .unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = pinswap_env(
        &[
            "copy",
            "--ca-cert",
            ca,
            &d(&src, "app:v1"),
            &d(&dst, "a4:v1"),
        ],
        &[("DOCKER_CONFIG", cfg.to_str().unwrap()), ("PATH", &path)],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_image(&dst, "a4", "v1", &img).await;

    // A failing helper: its stderr is named, its stdout (where helpers put
    // credentials) never is.
    std::fs::write(
        &helper,
        "#!/bin/sh\necho '{\"Secret\":\"leaked-token-9\"}'\necho 'token expired' >&2\nexit 1\n",
    )
    .unwrap();
    let mut out = pinswap_env(
        &[
            "copy",
            "--ca-cert",
            ca,
            &d(&src, "app:v1"),
            &d(&dst, "a5:v1"),
        ],
        &[("DOCKER_CONFIG", cfg.to_str().unwrap()), ("PATH", &path)],
    )
    .await;
    // Linux refuses to run a file another thread's fork still holds open
    // for writing (ETXTBSY), which docker_credential reports as "Unable to
    // communicate": a race of this test process, not of pinswap. Retry.
    for _ in 0..5 {
        if !out.stderr.contains("Unable to communicate") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        out = pinswap_env(
            &[
                "copy",
                "--ca-cert",
                ca,
                &d(&src, "app:v1"),
                &d(&dst, "a5:v1"),
            ],
            &[("DOCKER_CONFIG", cfg.to_str().unwrap()), ("PATH", &path)],
        )
        .await;
    }
    assert_ne!(out.code, 0);
    assert!(
        out.stderr
            .contains("credential helper docker-credential-pinswaptest failed: token expired"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("leaked-token-9"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_needs_the_ca_and_wrong_credentials_are_named_without_the_secret() {
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::tls_auth("mirror", "right-pw").await;
    let img = Image::oci(1, 43);
    push_image(&src, "app", Some("v1"), &img).await;

    let out = pinswap(&[
        "copy",
        "--dest-creds",
        "mirror:right-pw",
        &d(&src, "app:v1"),
        &d(&dst, "app:v1"),
    ])
    .await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .contains(&format!("cannot reach registry {}", dst.host())),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.to_lowercase().contains("certificate"),
        "{}",
        out.stderr
    );

    let ca = dst.ca_pem_path();
    let out = pinswap(&[
        "copy",
        "--ca-cert",
        ca.to_str().unwrap(),
        "--dest-creds",
        "mirror:Wrong-Secret-42",
        &d(&src, "app:v1"),
        &d(&dst, "app:v1"),
    ])
    .await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .contains(&format!("registry {} rejected our credentials", dst.host())),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("401"), "{}", out.stderr);
    assert!(out.stderr.contains("app"), "{}", out.stderr);
    assert!(
        !out.stderr.contains("Wrong-Secret-42"),
        "secret leaked: {}",
        out.stderr
    );
    assert!(dst.head_manifest("app", "v1").await.is_none());

    // No credentials at all: a different, equally clear error.
    let out = pinswap(&[
        "copy",
        "--ca-cert",
        ca.to_str().unwrap(),
        &d(&src, "app:v1"),
        &d(&dst, "app:v1"),
    ])
    .await;
    assert_eq!(out.code, 1);
    let want = format!("registry {} requires authentication", dst.host());
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    assert!(
        out.stderr.contains("no credentials were found"),
        "{}",
        out.stderr
    );
}

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
    assert!(
        out.stderr.contains("cannot reach registry nosuch.invalid"),
        "{}",
        out.stderr
    );
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
    assert!(
        out.stderr
            .contains(&format!("{}:2:", list.path().display())),
        "{}",
        out.stderr
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_bars_on_a_terminal_and_env_credentials() {
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::tls_auth("envuser", "env-pw").await;
    let img = Image::random_layers(1, 8 * 1024 * 1024, 91);
    push_image(&src, "app", Some("v1"), &img).await;
    // `script` runs pinswap with a pseudo-terminal as stdout.
    let cmd = format!(
        "{} copy --ca-cert {} {} {}",
        pinswap_bin().display(),
        dst.ca_pem_path().display(),
        d(&src, "app:v1"),
        d(&dst, "app:v1")
    );
    let cache = common::cache_home();
    let out = tokio::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("XDG_CACHE_HOME", cache.path())
        .env("PINSWAP_DEST_CREDS", "envuser:env-pw")
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .output()
        .await
        .expect("run script(1)");
    let tty = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{tty}");
    let layer = img.layers[0].digest.trim_start_matches("sha256:");
    assert!(
        tty.contains(&layer[..12]),
        "a bar named after the layer: {tty:?}"
    );
    assert!(
        tty.contains("MiB") && tty.contains('\x1b'),
        "drawn bars: {tty:?}"
    );
    assert!(tty.contains("copied "), "{tty:?}");
    assert_image(&dst, "app", "v1", &img).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_token_auth_push_chunked_pull_and_wrong_password() {
    let src = TestRegistry::plain().await;
    let tok = TestRegistry::token_auth("mirror", "t0ken-pw").await;
    let back = TestRegistry::plain().await;
    let img = Image::oci(2, 91);
    // 3 MiB layer with 1 MiB chunks: pinswap's own chunked uploader.
    let big = Image::random_layers(1, 3 * 1024 * 1024, 92);
    push_image(&src, "app", Some("v1"), &img).await;
    push_image(&src, "big", Some("v1"), &big).await;
    let server = tok.token_server();
    let creds = "mirror:t0ken-pw";

    // Push: the registry challenges, pinswap gets tokens with our basic
    // credentials and retries with Bearer.
    let r = copy_json(&[
        "--dest-creds",
        creds,
        &d(&src, "app:v1"),
        &d(&tok, "m/app:v1"),
    ])
    .await;
    assert_eq!(r["blobsCopied"], 3);
    assert_image(&tok, "m/app", "v1", &img).await;
    let scopes = server.granted_scopes();
    assert!(
        scopes.iter().any(|s| s == "repository:m/app:pull,push"),
        "{scopes:?}"
    );
    assert_eq!(server.denied(), 0);
    assert!(
        server
            .log()
            .iter()
            .all(|t| t.user.as_deref() == Some("mirror"))
    );

    let r = copy_json(&[
        "--chunked-threshold",
        "1048576",
        "--dest-creds",
        creds,
        &d(&src, "big:v1"),
        &d(&tok, "m/big:v1"),
    ])
    .await;
    assert_eq!(r["blobsCopied"], 2);
    assert_image(&tok, "m/big", "v1", &big).await;

    // Within the token registry, blobs are mounted: the mount's token must
    // also grant pull on the source repository.
    let r = copy_json(&[
        "--src-creds",
        creds,
        "--dest-creds",
        creds,
        &d(&tok, "m/app:v1"),
        &d(&tok, "other/app:v1"),
    ])
    .await;
    assert_eq!(r["blobsMounted"], 3, "{r}");
    assert_eq!(r["bytesCopied"], 0);
    assert_image(&tok, "other/app", "v1", &img).await;
    assert!(
        server.log().iter().any(|t| t.granted
            && t.scopes
                .iter()
                .any(|s| s == "repository:other/app:pull,push")
            && t.scopes.iter().any(|s| s == "repository:m/app:pull")),
        "one token for both repositories: {:?}",
        server.log()
    );

    // Pull: from the token registry to a plain one.
    let before = server.requests();
    for repo in ["app", "big"] {
        copy_json(&[
            "--src-creds",
            creds,
            &d(&tok, &format!("m/{repo}:v1")),
            &d(&back, &format!("{repo}:v1")),
        ])
        .await;
    }
    assert_image(&back, "app", "v1", &img).await;
    assert_image(&back, "big", "v1", &big).await;
    assert!(server.requests() > before);
    assert!(
        server
            .granted_scopes()
            .iter()
            .any(|s| s == "repository:m/big:pull"),
        "{:?}",
        server.granted_scopes()
    );

    // A wrong password is named as such, with the registry, never echoed.
    for (flag, from, to) in [
        ("--dest-creds", d(&src, "app:v1"), d(&tok, "w/app:v1")),
        ("--src-creds", d(&tok, "m/app:v1"), d(&back, "w/app:v1")),
    ] {
        let denied = server.denied();
        let out = pinswap(&["copy", flag, "mirror:Wrong-T0ken-Pw", &from, &to]).await;
        assert_eq!(out.code, 1, "{flag}: {}", out.stderr);
        assert!(
            out.stderr
                .contains(&format!("registry {} rejected our credentials", tok.host())),
            "{flag}: {}",
            out.stderr
        );
        assert!(
            !out.stderr.contains("Wrong-T0ken-Pw"),
            "secret leaked: {}",
            out.stderr
        );
        assert!(server.denied() > denied, "{flag}: token server not asked");
    }
    assert!(tok.head_manifest("w/app", "v1").await.is_none());
    assert!(back.head_manifest("w/app", "v1").await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_target_restores_what_the_target_lost() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::oci(101, false);
    push_index(&src, "multi", Some("v1"), &idx).await;
    copy_json(&[&d(&src, "multi:v1"), &d(&dst, "multi:v1")]).await;
    // The target loses a layer of one child and the whole other child.
    let lost_blob = &idx.children[0].layers[1];
    dst.delete_blob("multi", &lost_blob.digest).await;
    dst.delete_manifest("multi", &idx.children[1].digest).await;
    assert!(!dst.blob_exists("multi", &lost_blob.digest).await);
    // A warm copy trusts the tag...
    let warm = copy_json(&[&d(&src, "multi:v1"), &d(&dst, "multi:v1")]).await;
    assert_eq!(warm["upToDate"], true);
    // ...--verify-target does not, and restores both.
    let r = copy_json(&[
        "--verify-target",
        &d(&src, "multi:v1"),
        &d(&dst, "multi:v1"),
    ])
    .await;
    assert_eq!(r["upToDate"], false);
    assert_eq!(r["blobsCopied"], 1, "only the lost layer is streamed: {r}");
    assert_eq!(r["manifestsPushed"], 3, "both children and the index: {r}");
    check_index(&src, &dst, &idx, "multi").await;
}

/// `--jobs 4` keeps at most four blob requests in flight at each registry,
/// counted at recording fronts (from a request's arrival to the end of its
/// response body), and so bounds the open connections: it copies under a
/// descriptor limit that one connection per blob would exceed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_bounds_open_connections() {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (src_front, dst_front) = (
        common::front::Front::start(&src.host()).await,
        common::front::Front::start(&dst.host()).await,
    );
    // 300 tiny layers: one connection per blob would need 300+ descriptors.
    let layers: Vec<Blob> = (0..300u32)
        .map(|i| {
            Blob::new(
                "application/vnd.oci.image.layer.v1.tar",
                i.to_be_bytes().to_vec(),
            )
        })
        .collect();
    let img = image_of(layers, 7);
    push_image(&src, "many", Some("v1"), &img).await;
    let cmd = format!(
        "ulimit -n 64 && exec {} copy --jobs 4 docker://{}/many:v1 docker://{}/many:v1",
        pinswap_bin().display(),
        src_front.host(),
        dst_front.host()
    );
    let cache = common::cache_home();
    let out = tokio::process::Command::new("sh")
        .args(["-c", &cmd])
        .env("XDG_CACHE_HOME", cache.path())
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_image(&dst, "many", "v1", &img).await;
    // Every layer and the config went through the fronts.
    assert_eq!(src_front.count_method("GET", "/blobs/"), 301);
    let (reads, writes) = (
        src_front.max_concurrent("GET", "/blobs/"),
        dst_front.max_concurrent("*", "/blobs/"),
    );
    assert!(
        reads <= 4 && writes <= 4,
        "--jobs 4, yet at once: {reads} blob GETs at the source, {writes} blob requests at the target"
    );
    assert!(reads >= 2, "the blobs were copied one at a time: {reads}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_processes_writing_one_layout_keep_every_entry() {
    let src = TestRegistry::plain().await;
    let img = Image::oci(1, 111);
    push_image(&src, "app", Some("v1"), &img).await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("shared");
    let runs: Vec<_> = (0..20)
        .map(|i| {
            let dst = format!("oci:{}:t{i}", layout.display());
            let src = d(&src, "app:v1");
            tokio::spawn(async move { pinswap(&["copy", &src, &dst]).await })
        })
        .collect();
    for r in runs {
        let out = r.await.unwrap();
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let mut names: Vec<String> = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e["annotations"]["org.opencontainers.image.ref.name"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..20).map(|i| format!("t{i}")).collect();
    want.sort();
    assert_eq!(names, want);
    let out = pinswap(&["copy", "oci:/nonexistent/dir:v1", "oci:/tmp/x"]).await;
    assert!(
        out.stderr
            .contains("oci:/nonexistent/dir: not a valid OCI layout: no such directory"),
        "{}",
        out.stderr
    );
}

/// One process copying one index under two tags at once (a tagged and a
/// digest-only reference of the same image, as two admissions do) must not
/// PUT the same manifests concurrently: Distribution's filesystem driver can
/// then serve an empty revision link, and the index PUT fails with
/// DIGEST_INVALID / MANIFEST_BLOB_UNKNOWN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_copies_of_one_index_under_two_tags_both_succeed() {
    use pinswap::reference::Reference;
    use pinswap::registry::copy::{Copier, CopyOptions, Endpoint};
    use pinswap::registry::{ClientPool, PoolOptions};
    use std::sync::Arc;
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = Index::oci(7, true);
    push_index(&src, "multi", Some("v1"), &idx).await;
    let copier = Copier::new(
        Arc::new(ClientPool::new(PoolOptions::default())),
        CopyOptions {
            jobs: 4,
            ..CopyOptions::default()
        },
    );
    let r = |s: String| Endpoint::Registry(Reference::parse(&s).unwrap());
    for round in 0..60 {
        let repo = format!("mirror/r{round}");
        let (src_tag, dst_tag, src_digest, dst_digest) = (
            r(format!("{}/multi:v1", src.host())),
            r(format!("{}/{repo}:v1", dst.host())),
            r(format!("{}/multi@{}", src.host(), idx.digest)),
            r(format!("{}/{repo}:anchor@{}", dst.host(), idx.digest)),
        );
        let by_tag = copier.copy(&src_tag, &dst_tag);
        let by_digest = copier.copy(&src_digest, &dst_digest);
        let (a, b) = tokio::join!(by_tag, by_digest);
        a.unwrap_or_else(|e| panic!("round {round}, by tag: {e}"));
        b.unwrap_or_else(|e| panic!("round {round}, by digest: {e}"));
        assert_manifest(
            &dst,
            &repo,
            "v1",
            &idx.manifest,
            &idx.media_type,
            &idx.digest,
        )
        .await;
        assert_manifest(
            &dst,
            &repo,
            "anchor",
            &idx.manifest,
            &idx.media_type,
            &idx.digest,
        )
        .await;
        for child in &idx.children {
            assert_image(&dst, &repo, &child.digest, child).await;
        }
    }
}

/// `--src-creds` and `--dest-creds` stay on their sides: the source's
/// credentials never reach the target, whose recording front sees every
/// request's `Authorization`. Both registries are htpasswd over plain HTTP,
/// so a header names its owner. A second image sharing the first one's
/// layers goes to another target repository: its blobs are mounted there,
/// with the target's credentials too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_credentials_never_reach_the_target() {
    use common::front::Front;
    let src = TestRegistry::plain_auth("puller", "Source-Secret-1").await;
    let dst = TestRegistry::plain_auth("mirror", "Target-Secret-3").await;
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    let first = Image::oci(2, 971);
    let second = image_of(first.layers.clone(), 972);
    push_image(&src, "shop/app", Some("v1"), &first).await;
    push_image(&src, "shop/web", Some("v1"), &second).await;
    // One run, so the second image's layers are mounted from the first's
    // repository at the target.
    let list = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        list.path(),
        format!("{0}/shop/app:v1\n{0}/shop/web:v1\n", sf.host()),
    )
    .unwrap();
    let to = format!("docker://{}/mirror", tf.host());
    let out = pinswap(&[
        "copy",
        "--json",
        "--jobs",
        "1",
        "--src-creds",
        "puller:Source-Secret-1",
        "--dest-creds",
        "mirror:Target-Secret-3",
        "--from-file",
        list.path().to_str().unwrap(),
        "--to",
        &to,
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let comp = sf.host().replace(':', "_");
    for (repo, img) in [("shop/app", &first), ("shop/web", &second)] {
        assert_image(&dst, &format!("mirror/{comp}/{repo}"), "v1", img).await;
    }
    assert_eq!(
        sf.credentials_sent(),
        [common::basic_auth("puller", "Source-Secret-1")]
    );
    assert_eq!(
        tf.credentials_sent(),
        [common::basic_auth("mirror", "Target-Secret-3")]
    );
    let mounts = tf
        .authorizations()
        .into_iter()
        .filter(|(m, p, a)| m == "POST" && p.contains("mount=") && a.is_some())
        .count();
    assert!(mounts >= 1, "{:?}", tf.authorizations());
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

/// The copy engine's ledger holds only blobs being copied: after copies
/// of far more blobs than a soak moves, successful and failed, it is
/// empty, while later copies still mount what earlier ones wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_ledger_holds_only_blobs_in_flight() {
    use pinswap::reference::Reference;
    use pinswap::registry::copy::{Copier, CopyOptions, Endpoint};
    use pinswap::registry::{ClientPool, PoolOptions};
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = Image::random_layers(400, 64, 7351);
    push_image(&src, "many", Some("v1"), &img).await;
    let copier = Copier::new(
        Arc::new(ClientPool::new(PoolOptions::default())),
        CopyOptions::default(),
    );
    let from = Endpoint::Registry(Reference::parse(&format!("{}/many:v1", src.host())).unwrap());
    let to = |repo: &str| {
        Endpoint::Registry(Reference::parse(&format!("{}/{repo}:v1", dst.host())).unwrap())
    };
    let report = copier.copy(&from, &to("a")).await.unwrap();
    assert_eq!(report.blobs_copied, 401, "{report:?}");
    assert_eq!(copier.blobs_in_flight(), 0);
    // Another repository mounts every blob from the first.
    let report = copier.copy(&from, &to("b")).await.unwrap();
    assert_eq!(report.blobs_mounted, 401, "{report:?}");
    assert_eq!(copier.blobs_in_flight(), 0);
    // A copy that fails (the target gone) leaves nothing behind either.
    let mut gone = TestRegistry::plain().await;
    let host = gone.host();
    gone.kill();
    let to_gone = Endpoint::Registry(Reference::parse(&format!("{host}/c:v1")).unwrap());
    assert!(copier.copy(&from, &to_gone).await.is_err());
    assert_eq!(copier.blobs_in_flight(), 0);
}
