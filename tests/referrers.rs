//! Signatures, attestations, SBOMs and other referrers travel with the
//! image (docs/referrers.md), proven with the real clients: cosign signs
//! and verifies, oras discovers, against Distribution 2.8 (no referrers
//! API: cosign's tags and the fallback tag) and a registry that serves the
//! referrers API (target/tools/referrers-registry). Tools come from
//! scripts/build-tools.sh; every registry is on 127.0.0.1.

mod common;

use std::time::Duration;

use common::front::{Front, Mode as FrontMode};
use common::tools::{Cosign, Mode, ReferrersRegistry, oras_discover};
use common::{Image, TestRegistry, assert_bytes_eq, push_image, push_manifest, run_pinswap};
use serde_json::{Value, json};

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.v2+json";

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// GET `path` on plain-HTTP `host`: (status, body).
async fn get(host: &str, path: &str) -> (u16, Vec<u8>) {
    let resp = http()
        .get(format!("http://{host}{path}"))
        .header("accept", MANIFEST_ACCEPT)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.bytes().await.unwrap().to_vec())
}

async fn manifest(host: &str, repo: &str, reference: &str) -> Option<Vec<u8>> {
    match get(host, &format!("/v2/{repo}/manifests/{reference}")).await {
        (200, body) => Some(body),
        (404, _) => None,
        (s, body) => panic!(
            "GET {host}/{repo}:{reference}: {s} {}",
            String::from_utf8_lossy(&body)
        ),
    }
}

async fn tags(host: &str, repo: &str) -> Vec<String> {
    let (status, body) = get(host, &format!("/v2/{repo}/tags/list")).await;
    if status == 404 {
        return Vec::new();
    }
    let v: Value = serde_json::from_slice(&body).unwrap();
    let mut t: Vec<String> = v["tags"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    t.sort();
    t
}

/// The manifest `reference` of `repo` at `src` is at `dst` byte for byte,
/// with every blob it names; returns its parsed form.
async fn assert_same_manifest(
    src: &str,
    dst: &str,
    src_repo: &str,
    dst_repo: &str,
    reference: &str,
) -> Value {
    let want = manifest(src, src_repo, reference)
        .await
        .unwrap_or_else(|| panic!("{src}/{src_repo}:{reference} is missing at the source"));
    let got = manifest(dst, dst_repo, reference)
        .await
        .unwrap_or_else(|| panic!("{dst}/{dst_repo}:{reference} was not copied"));
    assert_bytes_eq(&got, &want, &format!("manifest {reference}"));
    let m: Value = serde_json::from_slice(&got).unwrap();
    let blobs = m["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(m.get("config"));
    for b in blobs {
        let d = b["digest"].as_str().unwrap();
        let (s1, want) = get(src, &format!("/v2/{src_repo}/blobs/{d}")).await;
        let (s2, got) = get(dst, &format!("/v2/{dst_repo}/blobs/{d}")).await;
        assert_eq!((s1, s2), (200, 200), "blob {d} of {reference}");
        assert_bytes_eq(&got, &want, &format!("blob {d} of {reference}"));
    }
    m
}

fn tag_of(digest: &str, suffix: &str) -> String {
    format!("{}{suffix}", digest.replace(':', "-"))
}

/// `pinswap copy docker://SRC/REPO:v1 docker://DST/DST_REPO:v1` with
/// `extra` flags; asserts exit 0 and returns stdout and stderr.
async fn mirror(
    src: &str,
    repo: &str,
    dst: &str,
    dst_repo: &str,
    extra: &[&str],
) -> (String, String) {
    let (from, to) = (
        format!("docker://{src}/{repo}:v1"),
        format!("docker://{dst}/{dst_repo}:v1"),
    );
    let mut args = vec!["copy", from.as_str(), to.as_str()];
    args.extend(extra);
    let (code, out, err) = run_pinswap(&args).await;
    assert_eq!(code, 0, "pinswap copy {from} {to}: {out}{err}");
    (out, err)
}

/// An image at `reg` (Distribution) as `repo:v1`; its digest.
async fn image_at(reg: &TestRegistry, repo: &str, seed: u64) -> Image {
    let img = Image::oci(2, seed);
    push_image(reg, repo, Some("v1"), &img).await;
    img
}

/// An image at `src` as `app:v1`, signed and attested with cosign's tags.
async fn signed_image(src: &TestRegistry, seed: u64) -> (Image, Cosign) {
    let img = image_at(src, "app", seed).await;
    let signed = format!("{}/app@{}", src.host(), img.digest);
    let cosign = Cosign::new().await;
    cosign.sign(&signed, Mode::Legacy).await;
    cosign.attest(&signed, Mode::Legacy).await;
    (img, cosign)
}

/// Pushes `img` by its digest to a referrers-API registry (plain HTTP,
/// monolithic uploads).
async fn push_to(host: &str, repo: &str, tag: Option<&str>, img: &Image) {
    for b in img.blobs() {
        let resp = http()
            .post(format!(
                "http://{host}/v2/{repo}/blobs/uploads/?digest={}",
                b.digest
            ))
            .header("content-type", "application/octet-stream")
            .body(b.bytes.clone())
            .send()
            .await
            .unwrap();
        assert!(
            resp.status().is_success(),
            "blob {}: {}",
            b.digest,
            resp.status()
        );
    }
    let reference = tag.unwrap_or(&img.digest);
    let resp = http()
        .put(format!("http://{host}/v2/{repo}/manifests/{reference}"))
        .header("content-type", &img.media_type)
        .body(img.manifest.clone())
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "manifest: {}", resp.status());
}

#[tokio::test]
async fn cosign_tags_travel_with_the_image_through_copy() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (img, cosign) = signed_image(&src, 1).await;
    assert_eq!(
        tags(&src.host(), "app").await,
        [
            tag_of(&img.digest, ".att"),
            tag_of(&img.digest, ".sig"),
            "v1".into()
        ]
    );

    let (out, _) = mirror(&src.host(), "app", &dst.host(), "mirror/app", &[]).await;
    assert!(out.contains("referrers   2 copied"), "{out}");
    for suffix in [".sig", ".att"] {
        assert_same_manifest(
            &src.host(),
            &dst.host(),
            "app",
            "mirror/app",
            &tag_of(&img.digest, suffix),
        )
        .await;
    }
    // Only cosign's tags: no bare sha256-<hex> tag, which would name an image.
    assert_eq!(
        tags(&dst.host(), "mirror/app").await,
        [
            tag_of(&img.digest, ".att"),
            tag_of(&img.digest, ".sig"),
            "v1".into()
        ]
    );
    let mirrored = format!("{}/mirror/app@{}", dst.host(), img.digest);
    let v = cosign.verify(&mirrored, false, Mode::Legacy).await;
    assert!(v.ok, "cosign verify {mirrored}: {}", v.stderr);
    let v = cosign.verify(&mirrored, true, Mode::Legacy).await;
    assert!(v.ok, "cosign verify-attestation {mirrored}: {}", v.stderr);

    // A second copy finds them present.
    let (out, _) = mirror(&src.host(), "app", &dst.host(), "mirror/app", &[]).await;
    assert!(out.contains("0 copied, 2 present"), "{out}");

    // --no-referrers: the image alone, and verification at the mirror fails.
    mirror(
        &src.host(),
        "app",
        &dst.host(),
        "bare/app",
        &["--no-referrers"],
    )
    .await;
    assert_eq!(tags(&dst.host(), "bare/app").await, ["v1"]);
    let bare = format!("{}/bare/app@{}", dst.host(), img.digest);
    assert!(!cosign.verify(&bare, false, Mode::Legacy).await.ok);
}

/// Signs and attests `image` in OCI 1.1 mode, copies it from `src_host`
/// to `dst_host`, and checks cosign verify, verify-attestation and oras
/// discover at the mirror.
async fn oci11_round_trip(src_host: &str, dst_host: &str, digest: &str) -> Vec<String> {
    let signed = format!("{src_host}/app@{digest}");
    let cosign = Cosign::new().await;
    cosign.sign(&signed, Mode::Oci11).await;
    cosign.attest(&signed, Mode::Oci11).await;
    let at_source = oras_discover(&signed).await;
    assert_eq!(at_source.len(), 2, "{at_source:?}");

    let (out, _) = mirror(src_host, "app", dst_host, "mirror/app", &[]).await;
    assert!(out.contains("referrers   2 copied"), "{out}");
    let mirrored = format!("{dst_host}/mirror/app@{digest}");
    let v = cosign.verify(&mirrored, false, Mode::Oci11).await;
    assert!(v.ok, "cosign verify {mirrored}: {}", v.stderr);
    let v = cosign.verify(&mirrored, true, Mode::Oci11).await;
    assert!(v.ok, "cosign verify-attestation {mirrored}: {}", v.stderr);
    assert_eq!(oras_discover(&mirrored).await, at_source);
    for d in &at_source {
        assert_same_manifest(src_host, dst_host, "app", "mirror/app", d).await;
    }
    at_source
}

#[tokio::test]
async fn oci_referrers_travel_from_a_fallback_tag_to_the_referrers_api() {
    common::init();
    let src = TestRegistry::plain().await;
    let dst = ReferrersRegistry::start().await;
    let img = image_at(&src, "app", 2).await;
    oci11_round_trip(&src.host(), &dst.host(), &img.digest).await;
    // cosign wrote the fallback tag at the source; the target serves the
    // API, so pinswap writes none there.
    assert!(
        tags(&src.host(), "app")
            .await
            .contains(&tag_of(&img.digest, ""))
    );
    assert_eq!(tags(&dst.host(), "mirror/app").await, ["v1"]);
}

#[tokio::test]
async fn oci_referrers_travel_from_the_referrers_api_to_a_fallback_tag() {
    common::init();
    let src = ReferrersRegistry::start().await;
    let dst = TestRegistry::plain().await;
    let img = Image::oci(2, 3);
    push_to(&src.host(), "app", Some("v1"), &img).await;
    let found = oci11_round_trip(&src.host(), &dst.host(), &img.digest).await;
    // Distribution has no API: pinswap wrote the fallback tag index.
    let index = manifest(&dst.host(), "mirror/app", &tag_of(&img.digest, ""))
        .await
        .expect("the fallback tag at the target");
    let index: Value = serde_json::from_slice(&index).unwrap();
    assert_eq!(index["mediaType"], INDEX);
    let mut listed: Vec<String> = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["digest"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, found);
}

/// An OCI 1.1 referrer of `subject` (an image's descriptor), as a client
/// that writes the fallback tag pushes it: the manifest, and its
/// descriptor for the index.
fn referrer(subject: &Value, artifact_type: &str, payload: &[u8]) -> (Image, Value) {
    let r = Image::referrer(subject, artifact_type, payload);
    let mut desc = r.descriptor();
    desc["artifactType"] = json!(artifact_type);
    (r, desc)
}

async fn push_fallback_index(reg: &TestRegistry, repo: &str, subject: &str, descs: &[Value]) {
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": descs,
    }))
    .unwrap();
    push_manifest(reg, repo, &tag_of(subject, ""), INDEX, &index).await;
}

async fn index_digests(reg: &TestRegistry, repo: &str, subject: &str) -> Vec<String> {
    let (bytes, _, _) = reg
        .get_manifest(repo, &tag_of(subject, ""))
        .await
        .unwrap_or_else(|| panic!("no fallback tag for {subject}"));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let mut d: Vec<String> = v["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["digest"].as_str().unwrap().to_owned())
        .collect();
    d.sort();
    d
}

/// An image with an SBOM referrer in the source's fallback index, and at
/// the target the image with another client's referrer in its fallback
/// index: (image, SBOM, the other client's referrer).
async fn merge_rig(src: &TestRegistry, dst: &TestRegistry, seed: u64) -> (Image, Image, Image) {
    let img = image_at(src, "app", seed).await;
    let payload = format!("{{\"spdx\":{seed}}}");
    let (sbom, sbom_desc) = referrer(
        &img.descriptor(),
        "application/spdx+json",
        payload.as_bytes(),
    );
    push_image(src, "app", None, &sbom).await;
    push_fallback_index(src, "app", &img.digest, &[sbom_desc]).await;
    push_image(dst, "mirror/app", Some("v1"), &img).await;
    let scan = format!("scan {seed}");
    let (theirs, theirs_desc) = referrer(
        &img.descriptor(),
        "application/vnd.example.scan",
        scan.as_bytes(),
    );
    push_image(dst, "mirror/app", None, &theirs).await;
    push_fallback_index(dst, "mirror/app", &img.digest, &[theirs_desc]).await;
    (img, sbom, theirs)
}

#[tokio::test]
async fn the_fallback_index_at_the_target_keeps_other_clients_descriptors() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (img, sbom, theirs) = merge_rig(&src, &dst, 4).await;

    let (out, _) = mirror(&src.host(), "app", &dst.host(), "mirror/app", &[]).await;
    assert!(out.contains("referrers   1 copied"), "{out}");
    assert_same_manifest(&src.host(), &dst.host(), "app", "mirror/app", &sbom.digest).await;
    let mut want = vec![sbom.digest.clone(), theirs.digest.clone()];
    want.sort();
    assert_eq!(index_digests(&dst, "mirror/app", &img.digest).await, want);
}

#[tokio::test]
async fn referrers_of_referrers_follow_with_a_bound() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = image_at(&src, "app", 5).await;
    // An SBOM of the image, and a signature over the SBOM.
    let (sbom, sbom_desc) = referrer(&img.descriptor(), "application/spdx+json", b"{\"spdx\":2}");
    let (sig, sig_desc) = referrer(&sbom.descriptor(), "application/vnd.example.sig", b"sig");
    for r in [&sbom, &sig] {
        push_image(&src, "app", None, r).await;
    }
    push_fallback_index(&src, "app", &img.digest, &[sbom_desc]).await;
    push_fallback_index(&src, "app", &sbom.digest, &[sig_desc]).await;

    let (out, _) = mirror(&src.host(), "app", &dst.host(), "mirror/app", &[]).await;
    assert!(out.contains("referrers   2 copied"), "{out}");
    for r in [&sbom, &sig] {
        assert_same_manifest(&src.host(), &dst.host(), "app", "mirror/app", &r.digest).await;
    }
    assert_eq!(
        index_digests(&dst, "mirror/app", &img.digest).await,
        std::slice::from_ref(&sbom.digest)
    );
    assert_eq!(
        index_digests(&dst, "mirror/app", &sbom.digest).await,
        std::slice::from_ref(&sig.digest)
    );
}

#[tokio::test]
async fn fallback_tags_that_are_no_referrers_list_are_left_alone() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);

    // No referrers at all (the API and the fallback tag both 404).
    let plain = image_at(&src, "plain", 6).await;
    let (out, _) = mirror(&src.host(), "plain", &dst.host(), "mirror/plain", &[]).await;
    assert!(!out.contains("referrers"), "{out}");
    assert_eq!(tags(&dst.host(), "mirror/plain").await, ["v1"]);
    assert!(
        dst.head_manifest("mirror/plain", &plain.digest)
            .await
            .is_some()
    );

    // The fallback tag answered with the image itself, as GitLab does.
    let gitlab = image_at(&src, "gitlab", 7).await;
    push_image(&src, "gitlab", Some(&tag_of(&gitlab.digest, "")), &gitlab).await;
    let (out, err) = mirror(&src.host(), "gitlab", &dst.host(), "mirror/gitlab", &[]).await;
    assert!(
        !out.contains("referrers") && !err.contains("referrer"),
        "{out}{err}"
    );
    assert_eq!(tags(&dst.host(), "mirror/gitlab").await, ["v1"]);

    // A malformed fallback tag: an index with a subject is a referrer, not
    // a list. The image is still copied; the tag is named in a warning.
    let odd = image_at(&src, "odd", 8).await;
    let bad = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [],
        "subject": odd.descriptor(),
    }))
    .unwrap();
    push_manifest(&src, "odd", &tag_of(&odd.digest, ""), INDEX, &bad).await;
    let (out, err) = mirror(&src.host(), "odd", &dst.host(), "mirror/odd", &[]).await;
    assert!(out.contains("1 failed"), "{out}");
    assert!(
        err.contains(&tag_of(&odd.digest, ""))
            && err.contains("is a referrer, not a referrers list"),
        "{err}"
    );
    assert_eq!(tags(&dst.host(), "mirror/odd").await, ["v1"]);
}

#[tokio::test]
async fn referrers_lists_are_read_page_by_page() {
    common::init();
    let reg = ReferrersRegistry::start().await;
    let front = Front::start(&reg.host()).await;
    front.set(FrontMode::PageReferrers(1));
    let dst = TestRegistry::plain().await;
    let img = Image::oci(1, 9);
    push_to(&reg.host(), "app", Some("v1"), &img).await;
    let mut want = Vec::new();
    for i in 0..3u8 {
        let (r, _) = referrer(&img.descriptor(), "application/vnd.example.page", &[i]);
        push_to(&reg.host(), "app", None, &r).await;
        want.push(r.digest.clone());
    }
    want.sort();
    let (out, _) = mirror(&front.host(), "app", &dst.host(), "mirror/app", &[]).await;
    assert!(out.contains("referrers   3 copied"), "{out}");
    assert_eq!(index_digests(&dst, "mirror/app", &img.digest).await, want);
    let pages = front
        .requests()
        .iter()
        .filter(|(m, p)| m == "GET" && p.contains(&format!("/referrers/{}", img.digest)))
        .count();
    assert_eq!(pages, 3, "{:?}", front.requests());
}

/// A config for `pinswap mutate` mirroring `src` into `dst` under `prefix`.
fn config(src: &TestRegistry, dst: &TestRegistry, prefix: &str, extra: &str) -> String {
    format!(
        "target: {{registry: \"{}/{prefix}\", insecure: true}}\n\
         source: {{registries: [{{registry: \"{}\", insecure: true}}]}}\n\
         recovery: {{enabled: false}}\n\
         identity: {{scanRate: 0}}\n\
         {extra}\n",
        dst.host(),
        src.host()
    )
}

async fn mutate(config: &str, image: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("pinswap.yaml");
    std::fs::write(&cfg, config).unwrap();
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: default}}\nspec: {{containers: [{{name: c, image: \"{image}\"}}]}}\n"
    );
    let args = ["mutate", "-c", cfg.to_str().unwrap(), "-f", "-"];
    let (code, out, err) = common::run_pinswap_with_input(&args, &pod).await;
    assert_eq!(code, 0, "pinswap mutate: {out}{err}");
    out
}

#[tokio::test]
async fn mutate_mirrors_referrers_unless_the_config_says_not_to() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (img, cosign) = signed_image(&src, 10).await;
    let source = format!("{}/app:v1", src.host());
    let repo = |prefix: &str| format!("{prefix}/{}/app", src.host().replace(':', "_"));

    // referrers: false: the image alone.
    let off = config(&src, &dst, "off", "copyPolicy: force\nreferrers: false");
    let out = mutate(&off, &source).await;
    assert!(
        out.contains(&format!("{}/{}:v1@{}", dst.host(), repo("off"), img.digest)),
        "{out}"
    );
    assert_eq!(tags(&dst.host(), &repo("off")).await, ["v1"]);

    // An allowlist: the signature travels, the attestation does not.
    let only_sig = "copyPolicy: force\nreferrers: {artifactTypes: [application/vnd.dev.cosign.artifact.sig.v1+json]}";
    mutate(&config(&src, &dst, "sig", only_sig), &source).await;
    assert_eq!(
        tags(&dst.host(), &repo("sig")).await,
        [tag_of(&img.digest, ".sig"), "v1".into()]
    );

    // The default: both, and cosign verifies the rewritten image.
    let repo = repo("all");
    let out = mutate(&config(&src, &dst, "all", "copyPolicy: force"), &source).await;
    let rewritten = format!("{}/{repo}:v1@{}", dst.host(), img.digest);
    assert!(out.contains(&rewritten), "{out}");
    assert_eq!(
        tags(&dst.host(), &repo).await,
        [
            tag_of(&img.digest, ".att"),
            tag_of(&img.digest, ".sig"),
            "v1".into()
        ]
    );
    let v = cosign.verify(&rewritten, false, Mode::Legacy).await;
    assert!(v.ok, "cosign verify {rewritten}: {}", v.stderr);
    let v = cosign.verify(&rewritten, true, Mode::Legacy).await;
    assert!(v.ok, "cosign verify-attestation {rewritten}: {}", v.stderr);
}

/// `pinswap serve` mirroring `src` into `dst/mirror` with `copyPolicy:
/// immediate` and `extra` config lines, and one Pod running `src/app:v1`
/// admitted through it: the server and the Pod as patched.
async fn serve_and_admit(src: &str, dst: &str, extra: &str) -> (common::serve::Served, Value) {
    let body = format!(
        "target: {{registry: \"{dst}/mirror\", insecure: true}}\n\
         source: {{registries: [{{registry: \"{src}\", insecure: true}}]}}\n\
         recovery: {{enabled: false}}\n\
         identity: {{scanRate: 0}}\n\
         copyPolicy: immediate\n{extra}"
    );
    let served = common::serve::Served::start_with(&body, "", &[], None).await;
    let pod = common::review::pod("default", "p", &[("c", &format!("{src}/app:v1"))]);
    let review = common::review::create_review(&pod).to_string();
    let resp = served.send(&served.client(), &review).await.unwrap();
    let review: Value = resp.json().await.unwrap();
    let mut patched = pod.clone();
    common::review::apply_patch(&review["response"], &mut patched);
    (served, patched)
}

#[tokio::test]
async fn serve_copies_referrers_after_the_image_and_counts_them() {
    common::init();
    let (src, dst) = (
        TestRegistry::plain().await,
        ReferrersRegistry::start().await,
    );
    let img = image_at(&src, "app", 11).await;
    let signed = format!("{}/app@{}", src.host(), img.digest);
    let cosign = Cosign::new().await;
    cosign.sign(&signed, Mode::Oci11).await;
    cosign.attest(&signed, Mode::Oci11).await;
    let (served, patched) = serve_and_admit(&src.host(), &dst.host(), "").await;
    let rewritten = patched["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let repo = format!("mirror/{}/app", src.host().replace(':', "_"));
    assert_eq!(
        rewritten,
        format!("{}/{repo}:v1@{}", dst.host(), img.digest)
    );

    // The signature follows in the background; the metric says when.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, text) = served.health_get("/metrics").await;
        let copied = common::metrics::sample(
            &text,
            "pinswap_referrers_copied_total",
            &[("outcome", "copied")],
        );
        if copied.unwrap_or(0.0) >= 2.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not both referrers copied within 30 s:\n{}",
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let v = cosign.verify(&rewritten, false, Mode::Oci11).await;
    assert!(v.ok, "cosign verify {rewritten}: {}", v.stderr);
    let v = cosign.verify(&rewritten, true, Mode::Oci11).await;
    assert!(v.ok, "cosign verify-attestation {rewritten}: {}", v.stderr);
    assert_eq!(
        oras_discover(&rewritten).await,
        oras_discover(&signed).await
    );
}

#[tokio::test]
async fn reverification_brings_referrers_added_after_the_copy() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let img = image_at(&src, "app", 12).await;
    let (served, patched) =
        serve_and_admit(&src.host(), &dst.host(), "cache: {reverify: 1s}\n").await;
    let repo = format!("mirror/{}/app", src.host().replace(':', "_"));
    let rewritten = format!("{}/{repo}:v1@{}", dst.host(), img.digest);
    assert_eq!(
        patched["spec"]["containers"][0]["image"],
        rewritten.as_str()
    );

    // Signed only now, after the image was mirrored.
    let cosign = Cosign::new().await;
    cosign
        .sign(&format!("{}/app@{}", src.host(), img.digest), Mode::Legacy)
        .await;
    let sig = tag_of(&img.digest, ".sig");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !tags(&dst.host(), &repo).await.contains(&sig) {
        assert!(
            std::time::Instant::now() < deadline,
            "the signature did not reach the mirror within 30 s:\n{}",
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_same_manifest(&src.host(), &dst.host(), "app", &repo, &sig).await;
    let v = cosign.verify(&rewritten, false, Mode::Legacy).await;
    assert!(v.ok, "cosign verify {rewritten}: {}", v.stderr);
}

#[tokio::test]
async fn a_platform_filtered_index_gets_its_childrens_signatures_and_says_why_not_its_own() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let idx = common::Index::oci(13, false);
    common::push_index(&src, "app", Some("v1"), &idx).await;
    let cosign = Cosign::new().await;
    for d in [&idx.digest, &idx.children[0].digest] {
        cosign
            .sign(&format!("{}/app@{d}", src.host()), Mode::Legacy)
            .await;
    }
    let (served, patched) =
        serve_and_admit(&src.host(), &dst.host(), "platforms: [linux/amd64]\n").await;
    let decisions = patched["metadata"]["annotations"]["pinswap.dev/decisions"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        decisions.contains("signatures over the source index do not apply to it"),
        "{decisions}"
    );
    let repo = format!("mirror/{}/app", src.host().replace(':', "_"));
    let child_sig = tag_of(&idx.children[0].digest, ".sig");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !tags(&dst.host(), &repo).await.contains(&child_sig) {
        assert!(
            std::time::Instant::now() < deadline,
            "the child's signature did not reach the mirror within 30 s:\n{}",
            served.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_same_manifest(&src.host(), &dst.host(), "app", &repo, &child_sig).await;
    // The source index's own signature names a digest the mirror does not hold.
    assert!(
        !tags(&dst.host(), &repo)
            .await
            .contains(&tag_of(&idx.digest, ".sig"))
    );
    let child = format!("{}/{repo}@{}", dst.host(), idx.children[0].digest);
    let v = cosign.verify(&child, false, Mode::Legacy).await;
    assert!(v.ok, "cosign verify {child}: {}", v.stderr);
}

#[tokio::test]
async fn a_fallback_tag_written_meanwhile_is_read_and_merged_again() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (img, sbom, theirs) = merge_rig(&src, &dst, 14).await;
    // The target refuses the first write of the fallback tag with 412, as
    // a registry with ETags does when another client wrote it in between.
    let front = Front::start(&dst.host()).await;
    let tag = tag_of(&img.digest, "");
    front.set(FrontMode::RefuseFirst(
        "PUT",
        "/manifests/sha256-",
        412,
        None,
    ));
    let (out, err) = mirror(&src.host(), "app", &front.host(), "mirror/app", &[]).await;
    assert!(
        out.contains("referrers   1 copied") && !out.contains("1 failed"),
        "{out}{err}"
    );
    let puts = front.count_exact("PUT", &format!("/v2/mirror/app/manifests/{tag}"));
    assert_eq!(puts, 2, "{:?}", front.requests());
    let mut want = vec![sbom.digest.clone(), theirs.digest.clone()];
    want.sort();
    assert_eq!(index_digests(&dst, "mirror/app", &img.digest).await, want);
}

/// An index that lists 300 children three times each: every subject is
/// looked up once, and at most 256 per image, whatever the index lists
/// (each lookup costs a referrers list at the source; the children's
/// cosign tags come from one tag listing). The copy says the bound was
/// reached.
#[tokio::test]
async fn referrer_lookups_are_deduplicated_and_bounded() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let children: Vec<Image> = (0..300).map(|i| Image::oci(1, 9000 + i)).collect();
    for c in &children {
        push_image(&src, "wide", None, c).await;
    }
    let descs: Vec<Value> = (0..3)
        .flat_map(|_| children.iter().map(Image::descriptor))
        .collect();
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": descs,
    }))
    .unwrap();
    push_manifest(&src, "wide", "v1", INDEX, &index).await;
    let front = Front::start(&src.host()).await;

    let (out, _) = mirror(&front.host(), "wide", &dst.host(), "mirror/wide", &[]).await;
    assert!(out.contains("(bound reached)"), "{out}");
    let lookups = front.count_method("GET", "/referrers/");
    assert_eq!(lookups, 256, "{out}");
    let mut listed: Vec<String> = front
        .requests()
        .into_iter()
        .filter(|(m, p)| m == "GET" && p.contains("/referrers/"))
        .map(|(_, p)| p)
        .collect();
    listed.sort();
    listed.dedup();
    assert_eq!(listed.len(), 256, "each subject once");
    assert_eq!(front.count_method("GET", "/tags/list"), 1, "{out}");
    // The index's own: a first copy asks for it whatever the list says.
    assert_eq!(
        front.count_method("HEAD", ".sig"),
        1,
        "the children's are not listed"
    );
}
