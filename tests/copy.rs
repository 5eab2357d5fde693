//! `pinswap copy` against real Distribution registries: every media type,
//! indexes, platform filters, blob handling, batch, layouts and
//! concurrency. Each test checks what the target registry serves
//! afterwards, byte for byte.

mod common;

use std::sync::Arc;

use common::cli::pinswap;
use common::copying::*;
use common::fixtures::{Blob, Image, Index};
use common::skopeo;
use common::{TestRegistry, pinswap_bin, push_image, push_index};
use serde_json::Value;

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
    none.says(format!(
        "no entry of index {} matches platform(s) windows/amd64",
        plain.digest
    ));
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
    out.says(format!("pins digest {other}"));
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
    out.says("oci:/nonexistent/dir: not a valid OCI layout: no such directory");
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
