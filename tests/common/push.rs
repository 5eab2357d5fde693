//! Pushes fixtures with the distribution API, independently of pinswap:
//! `POST /v2/<repo>/blobs/uploads/`, then `PUT <Location>?digest=` with the
//! whole blob, then `PUT /v2/<repo>/manifests/<ref>` with the exact bytes.

use reqwest::{Body, Method, StatusCode};

use super::fixtures::{Blob, Image, Index, RandomBlob, StreamedImage};
use super::registry::{TestRegistry, expect_status};

/// Monolithic upload of one blob.
pub async fn push_blob(reg: &TestRegistry, repo: &str, blob: &Blob) {
    upload(reg, repo, &blob.digest, Body::from(blob.bytes.clone())).await;
}

/// Upload of a [`RandomBlob`] generated while it is sent (chunked encoding).
pub async fn push_random_blob(reg: &TestRegistry, repo: &str, blob: &RandomBlob) {
    let stream = futures::stream::iter(
        blob.chunks()
            .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::from(c))),
    );
    upload(reg, repo, &blob.digest, Body::wrap_stream(stream)).await;
}

async fn upload(reg: &TestRegistry, repo: &str, digest: &str, body: Body) {
    let what = format!("upload {digest} to {}/{repo}", reg.host());
    let resp = reg
        .request(Method::POST, &format!("/v2/{repo}/blobs/uploads/"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{what}: POST: {e}"));
    let resp = expect_status(resp, StatusCode::ACCEPTED, &what).await;
    let location = resp
        .headers()
        .get("location")
        .unwrap_or_else(|| panic!("{what}: POST answer has no Location"))
        .to_str()
        .unwrap();
    // Location may be absolute or relative to the request URL.
    let mut url = resp.url().join(location).unwrap();
    url.query_pairs_mut().append_pair("digest", digest);
    let resp = reg
        .request_url(Method::PUT, url.as_str())
        .header("content-type", "application/octet-stream")
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{what}: PUT: {e}"));
    let resp = expect_status(resp, StatusCode::CREATED, &what).await;
    let got = resp.headers().get("docker-content-digest").unwrap();
    assert_eq!(got.to_str().unwrap(), digest, "{what}: registry digest");
}

/// PUT `bytes` as manifest `reference` (tag or digest) with `media_type`;
/// asserts the registry's digest of them is theirs.
pub async fn push_manifest(
    reg: &TestRegistry,
    repo: &str,
    reference: &str,
    media_type: &str,
    bytes: &[u8],
) {
    let what = format!("PUT manifest {}/{repo}:{reference}", reg.host());
    let resp = reg
        .request(Method::PUT, &format!("/v2/{repo}/manifests/{reference}"))
        .header("content-type", media_type)
        .body(bytes.to_vec())
        .send()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let resp = expect_status(resp, StatusCode::CREATED, &what).await;
    let got = resp.headers().get("docker-content-digest").unwrap();
    assert_eq!(
        got.to_str().unwrap(),
        super::sha256_digest(bytes),
        "{what}: registry digest"
    );
}

/// Blobs, then the manifest by `tag`, or by digest when `tag` is None.
pub async fn push_image(reg: &TestRegistry, repo: &str, tag: Option<&str>, img: &Image) {
    for blob in img.blobs() {
        push_blob(reg, repo, blob).await;
    }
    let reference = tag.unwrap_or(&img.digest);
    push_manifest(reg, repo, reference, &img.media_type, &img.manifest).await;
}

/// Children by digest, then the index by `tag` (or by digest).
pub async fn push_index(reg: &TestRegistry, repo: &str, tag: Option<&str>, idx: &Index) {
    for child in &idx.children {
        push_image(reg, repo, None, child).await;
    }
    let reference = tag.unwrap_or(&idx.digest);
    push_manifest(reg, repo, reference, &idx.media_type, &idx.manifest).await;
}

/// Like [`push_image`], streaming each layer from its seed.
pub async fn push_streamed_image(
    reg: &TestRegistry,
    repo: &str,
    tag: Option<&str>,
    img: &StreamedImage,
) {
    push_blob(reg, repo, &img.config).await;
    for layer in &img.layers {
        push_random_blob(reg, repo, layer).await;
    }
    let reference = tag.unwrap_or(&img.digest);
    push_manifest(reg, repo, reference, &img.media_type, &img.manifest).await;
}
