//! Helpers of the `pinswap copy` tests: images from layers, `docker://`
//! references, and byte-exact checks of what the target serves.

use crate::common;

use crate::common::TestRegistry;
use crate::common::fixtures::{Blob, Image, Index};
use crate::common::skopeo;
use serde_json::Value;

/// Runs a copy with `--json`, asserts success, returns the first image's report.
pub async fn copy_json(args: &[&str]) -> Value {
    common::cli::copy_json(None, args).await
}

/// An OCI image made of these layers, with a config unique to `n`.
pub fn image_of(layers: Vec<Blob>, n: u64) -> Image {
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

pub fn d(reg: &TestRegistry, path: &str) -> String {
    format!("docker://{}/{path}", reg.host())
}

/// The target serves exactly the fixture's manifest bytes, type and digest.
pub async fn assert_manifest(
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
pub async fn assert_blobs(reg: &TestRegistry, repo: &str, img: &Image) {
    for b in img.blobs() {
        let got = reg
            .blob(repo, &b.digest)
            .await
            .unwrap_or_else(|| panic!("blob {} missing in {repo}", b.digest));
        assert!(got == b.bytes, "blob {} differs in {repo}", b.digest);
    }
}

pub async fn assert_image(reg: &TestRegistry, repo: &str, tag: &str, img: &Image) {
    assert_manifest(reg, repo, tag, &img.manifest, &img.media_type, &img.digest).await;
    assert_blobs(reg, repo, img).await;
}

/// The index under `reference`, and each child with its blobs, byte for
/// byte.
pub async fn assert_index(reg: &TestRegistry, repo: &str, reference: &str, idx: &Index) {
    assert_manifest(
        reg,
        repo,
        reference,
        &idx.manifest,
        &idx.media_type,
        &idx.digest,
    )
    .await;
    for child in &idx.children {
        assert_image(reg, repo, &child.digest, child).await;
    }
}

pub async fn check_index(src: &TestRegistry, dst: &TestRegistry, idx: &Index, repo: &str) {
    assert_index(dst, repo, "v1", idx).await;
    assert_eq!(skopeo::inspect_raw(dst, repo, "v1").await, idx.manifest);
    assert_eq!(
        skopeo::inspect_digest(dst, repo, "v1").await,
        skopeo::inspect_digest(src, repo, "v1").await
    );
}
