//! Request counts: what pinswap sends a registry per image, counted by the
//! test front (method and path of every request) in front of real
//! Distribution registries. Against a real registry every request is a
//! round trip, so these are behaviour, not timing: a `/v2/` probe per
//! registry and process, one manifest HEAD per side for an image, each
//! blob fetched once, a token per scope set, not per request, and blobs a
//! registry already holds in another repository mounted, not streamed.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::front::{Front, Mode};
use common::review::{admit, pod};
use common::{Blob, Image, Index, TestRegistry, push_image, push_index};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::{Value, json};

/// `pinswap copy --json --no-referrers ARGS...` with a cache of its own,
/// asserting success; the first report. These counts are the image's own;
/// referrers add their requests after it (counted in tests/referrers.rs).
async fn copy(args: &[&str]) -> Value {
    copy_in(common::cache_home().path(), args).await
}

/// As [`copy`], with `cache` as `XDG_CACHE_HOME`.
async fn copy_in(cache: &Path, args: &[&str]) -> Value {
    common::cli::copy_json(Some(cache), &no_referrers(args)).await
}

/// As [`copy_in`], success or not: (succeeded, first report, stderr).
async fn try_copy_in(cache: &Path, args: &[&str]) -> (bool, Value, String) {
    let (out, report) = common::cli::try_copy_json(Some(cache), &no_referrers(args)).await;
    (out.code == 0, report, out.stderr)
}

fn no_referrers<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["--no-referrers"];
    all.extend_from_slice(args);
    all
}

fn show(front: &Front) -> String {
    front
        .requests()
        .iter()
        .map(|(m, p)| format!("{m} {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// An uncached admission of a new image, with clients already made by an
/// earlier admission: one manifest HEAD to the source, one to the target,
/// no `/v2/` probe, and no GET of the manifest the target has not got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncached_admission_heads_each_side_once() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    let (warm, new) = (Image::oci(1, 7001), Image::oci(1, 7002));
    push_image(&src, "shop/warm", Some("v1"), &warm).await;
    push_image(&src, "shop/new", Some("v1"), &new).await;
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: none\n",
        tf.host(),
        sf.host()
    );
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let adm = Admission::from_config(&config, Arc::new(Metrics::new())).unwrap();
    let image = |repo: &str| format!("{}/shop/{repo}:v1", sf.host());
    admit(&adm, &pod("shop", "warm", &[("app", &image("warm"))])).await;
    assert!(sf.count_exact("GET", "/v2/") >= 1, "{}", show(&sf));
    sf.reset();
    tf.reset();

    let (patched, _) = admit(&adm, &pod("shop", "new", &[("app", &image("new"))])).await;
    assert_eq!(patched["spec"]["containers"][0]["image"], image("new"));
    assert_eq!(
        sf.count_method("HEAD", "/manifests/"),
        1,
        "source:\n{}",
        show(&sf)
    );
    assert_eq!(
        tf.count_method("HEAD", "/manifests/"),
        1,
        "target:\n{}",
        show(&tf)
    );
    for (side, f) in [("source", &sf), ("target", &tf)] {
        assert_eq!(f.count_exact("GET", "/v2/"), 0, "{side}:\n{}", show(f));
    }
    assert_eq!(tf.total(), 1, "target:\n{}", show(&tf));
}

/// An uncached admission of an image the target holds asks both sides at
/// once: with the source frozen, the target's HEAD arrives while the
/// source's is unanswered. Still one HEAD per side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncached_admission_asks_both_sides_at_once() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    push_image(&src, "shop/app", Some("v1"), &Image::oci(1, 7003)).await;
    // Neither cache vouches for anything; the source may take its time.
    let yaml = format!(
        "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\n  timeout: 8s\ncopyPolicy: immediate\nreferrers: false\ncache: {{ttl: 0s, resolutionTtl: 0s}}\nserver: {{admissionBudget: 20s}}\n",
        tf.host(),
        sf.host()
    );
    let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
    let adm = Arc::new(Admission::from_config(&config, Arc::new(Metrics::new())).unwrap());
    let image = format!("{}/shop/app:v1", sf.host());
    let the_pod = pod("shop", "app", &[("app", &image)]);
    let (copied, _) = admit(&adm, &the_pod).await;
    let mirrored = copied["spec"]["containers"][0]["image"].clone();
    assert!(
        mirrored.as_str().unwrap().starts_with(&tf.host()),
        "{copied}"
    );
    sf.reset();
    tf.reset();

    src.freeze();
    let admission = tokio::spawn({
        let (adm, the_pod) = (adm.clone(), the_pod.clone());
        async move { admit(&adm, &the_pod).await }
    });
    common::wait_until(
        "the target's HEAD while the source is frozen",
        std::time::Duration::from_secs(5),
        || tf.count_method("HEAD", "/manifests/") == 1,
    )
    .await;
    assert_eq!(sf.count_method("HEAD", "/manifests/"), 1, "{}", show(&sf));
    assert!(!admission.is_finished(), "answered before the source did");
    src.thaw();
    let (patched, _) = admission.await.unwrap();
    assert_eq!(patched["spec"]["containers"][0]["image"], mirrored);
    assert_eq!(sf.count_method("HEAD", "/manifests/"), 1, "{}", show(&sf));
    assert_eq!(tf.total(), 1, "target:\n{}", show(&tf));
}

/// A warm `pinswap copy` (the target already has the image under its tag):
/// one manifest HEAD per side and at most one `/v2/` probe per registry,
/// also when source and target are one registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_copy_heads_each_side_once_and_probes_each_registry_once() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    let img = Image::oci(2, 7101);
    push_image(&src, "app", Some("v1"), &img).await;
    let from = format!("docker://{}/app:v1", sf.host());
    let to = format!("docker://{}/app:v1", tf.host());
    copy(&[&from, &to]).await;
    sf.reset();
    tf.reset();

    let r = copy(&[&from, &to]).await;
    assert_eq!(r["upToDate"], true, "{r}");
    for (side, f) in [("source", &sf), ("target", &tf)] {
        assert_eq!(
            f.count_method("HEAD", "/manifests/"),
            1,
            "{side}:\n{}",
            show(f)
        );
        assert!(f.count_exact("GET", "/v2/") <= 1, "{side}:\n{}", show(f));
        assert_eq!(
            f.total(),
            1 + f.count_exact("GET", "/v2/"),
            "{side}:\n{}",
            show(f)
        );
    }

    // One registry on both sides: one probe for both.
    let same = format!("docker://{}/copy/app:v1", sf.host());
    copy(&[&from, &same]).await;
    sf.reset();
    let r = copy(&[&from, &same]).await;
    assert_eq!(r["upToDate"], true, "{r}");
    assert_eq!(sf.count_exact("GET", "/v2/"), 1, "{}", show(&sf));
    assert_eq!(sf.count_method("HEAD", "/manifests/"), 2, "{}", show(&sf));
    assert_eq!(sf.total(), 3, "{}", show(&sf));
}

/// A warm copy that follows referrers lists the source's tags once instead
/// of asking for each cosign tag and the fallback tag, and reads no target
/// manifest to find subjects when the top is a single manifest: 4 requests
/// to the source (probe, HEAD, tag list, referrers API) and 2 to the
/// target. A signature tag that exists is still found and copied, and only
/// the tags the listing names are asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_copy_with_referrers_lists_the_sources_tags_once() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    let img = Image::oci(2, 7151);
    push_image(&src, "app", Some("v1"), &img).await;
    let from = format!("docker://{}/app:v1", sf.host());
    let to = format!("docker://{}/app:v1", tf.host());
    let cache = common::cache_home();
    common::cli::copy_json(Some(cache.path()), &[&from, &to]).await;
    sf.reset();
    tf.reset();

    let r = common::cli::copy_json(Some(cache.path()), &[&from, &to]).await;
    assert_eq!(r["upToDate"], true, "{r}");
    assert_eq!(r["referrers"]["failed"], 0, "{r}");
    assert_eq!(sf.count_method("GET", "/tags/list"), 1, "{}", show(&sf));
    assert_eq!(sf.count_method("GET", "/referrers/"), 1, "{}", show(&sf));
    assert_eq!(sf.total(), 4, "source:\n{}", show(&sf));
    assert_eq!(tf.total(), 2, "target:\n{}", show(&tf));

    // A signature under cosign's tag: found through the listing, copied
    // byte for byte, and the absent .att and .sbom never asked for.
    let sig = Image::oci(1, 7152);
    let hex = img.digest.strip_prefix("sha256:").unwrap();
    let sig_tag = format!("sha256-{hex}.sig");
    push_image(&src, "app", Some(&sig_tag), &sig).await;
    sf.reset();
    let r = common::cli::copy_json(Some(cache.path()), &[&from, &to]).await;
    assert_eq!(r["referrers"]["copied"], 1, "{r}");
    let (bytes, _, digest) = dst.get_manifest("app", &sig_tag).await.expect("copied");
    assert_eq!(bytes, sig.manifest);
    assert_eq!(digest, sig.digest);
    for absent in [".att", ".sbom"] {
        assert_eq!(sf.count_method("HEAD", absent), 0, "{}", show(&sf));
    }
    assert_eq!(sf.count_method("GET", "/tags/list"), 1, "{}", show(&sf));
}

/// Two platform images built from one layer set: they share every layer,
/// and differ in their configs.
fn shared_layer_index(seed: u64) -> Index {
    let amd64 = Image::oci_for("amd64", None, 3, seed);
    let arm64 = Image::oci_for("arm64", None, 3, seed);
    let descs: Vec<Value> = [(&amd64, "amd64"), (&arm64, "arm64")]
        .iter()
        .map(|(img, arch)| {
            let mut d = img.descriptor();
            d["platform"] = json!({"architecture": arch, "os": "linux"});
            d
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": descs,
    }))
    .unwrap();
    Index {
        digest: common::sha256_digest(&manifest),
        manifest,
        media_type: "application/vnd.oci.image.index.v1+json".into(),
        children: vec![amd64, arm64],
    }
}

/// A cold copy of an index whose children share their layers fetches each
/// blob from the source once, uploads it once, and probes each registry
/// once; no manifest is read twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_copy_fetches_each_blob_once() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (sf, tf) = (
        Front::start(&src.host()).await,
        Front::start(&dst.host()).await,
    );
    let idx = shared_layer_index(7201);
    assert_eq!(idx.children[0].layers, idx.children[1].layers);
    push_index(&src, "multi", Some("v1"), &idx).await;
    let r = copy(&[
        &format!("docker://{}/multi:v1", sf.host()),
        &format!("docker://{}/multi:v1", tf.host()),
    ])
    .await;
    let blobs: Vec<&Blob> =
        idx.children
            .iter()
            .flat_map(|c| c.blobs())
            .fold(Vec::new(), |mut all, b| {
                if !all.iter().any(|a: &&Blob| a.digest == b.digest) {
                    all.push(b);
                }
                all
            });
    assert_eq!(blobs.len(), 5, "three shared layers and two configs");
    assert_eq!(r["blobsCopied"], 5, "{r}");
    let mut gets: HashMap<String, u64> = HashMap::new();
    for (m, p) in sf.requests() {
        if m == "GET"
            && let Some((_, digest)) = p.split_once("/blobs/")
        {
            *gets.entry(digest.to_owned()).or_default() += 1;
        }
    }
    for b in &blobs {
        assert_eq!(
            gets.get(&b.digest),
            Some(&1),
            "{}:\n{}",
            b.digest,
            show(&sf)
        );
        let got = dst.blob("multi", &b.digest).await;
        assert!(
            got.as_deref() == Some(&b.bytes[..]),
            "{} at the target",
            b.digest
        );
    }
    assert_eq!(
        tf.count_method("PUT", "/blobs/uploads/"),
        5,
        "one upload per blob:\n{}",
        show(&tf)
    );
    assert_eq!(gets.len(), blobs.len(), "{}", show(&sf));
    for (side, f) in [("source", &sf), ("target", &tf)] {
        assert_eq!(f.count_exact("GET", "/v2/"), 1, "{side}:\n{}", show(f));
    }
    // Source: one HEAD of the tag, then one GET per manifest (index, two
    // children).
    assert_eq!(sf.count_method("GET", "/manifests/"), 3, "{}", show(&sf));
    assert_eq!(sf.count_method("HEAD", "/manifests/"), 1, "{}", show(&sf));
    let (bytes, _, digest) = dst.get_manifest("multi", "v1").await.unwrap();
    assert!(bytes == idx.manifest && digest == idx.digest);
}

/// A bearer-token registry: a chunked upload and a pull ask the token
/// server once per scope set, never per request or per chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_fetched_once_per_scope_set_not_per_chunk() {
    common::init();
    let src = TestRegistry::plain().await;
    let tok = TestRegistry::token_auth("mirror", "t0ken-pw").await;
    let tf = Front::start(&tok.host()).await;
    let big = Image::random_layers(1, 3 * 1024 * 1024, 7301);
    push_image(&src, "big", Some("v1"), &big).await;
    let server = tok.token_server();
    let before = server.requests();
    copy(&[
        "--chunked-threshold",
        "1048576",
        "--dest-creds",
        "mirror:t0ken-pw",
        &format!("docker://{}/big:v1", src.host()),
        &format!("docker://{}/m/big:v1", tf.host()),
    ])
    .await;
    assert_eq!(
        tf.count_method("PATCH", "/blobs/uploads/"),
        3,
        "{}",
        show(&tf)
    );
    let log = server.log()[before..].to_vec();
    let mut sets: Vec<Vec<String>> = log.iter().map(|t| t.scopes.clone()).collect();
    let asked = sets.len();
    sets.sort();
    sets.dedup();
    assert_eq!(asked, sets.len(), "a scope set asked for twice: {log:?}");
    assert!(asked <= 2, "{log:?}");
    assert_eq!(tf.count_exact("GET", "/v2/"), 1, "{}", show(&tf));
}

/// The chunked upload maps its answers as every other request does: a 401
/// to the POST that opens it is retried once with a fresh token, and a 503
/// keeps its `Retry-After`. The target already holds the config, so the one
/// upload, and the refused POST, is the layer's, in chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chunked_upload_maps_errors_as_every_request_does() {
    common::init();
    let src = TestRegistry::plain().await;
    let tok = TestRegistry::token_auth("mirror", "t0ken-pw").await;
    let tf = Front::start(&tok.host()).await;
    let img = Image::random_layers(1, 3 * 1024 * 1024, 7311);
    push_image(&src, "small", Some("v1"), &img).await;
    for repo in ["m/revoked", "m/busy"] {
        common::push::push_blob(&tok, repo, &img.config).await;
    }
    let args = |repo: &str| {
        [
            "--chunked-threshold".to_owned(),
            "1048576".to_owned(),
            "--dest-creds".to_owned(),
            "mirror:t0ken-pw".to_owned(),
            format!("docker://{}/small:v1", src.host()),
            format!("docker://{}/{repo}:v1", tf.host()),
        ]
    };
    let server = tok.token_server();
    let tokens = server.requests();
    tf.set(Mode::RefuseFirst("POST", "/blobs/uploads/", 401, None));
    let a = args("m/revoked");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, _, stderr) = try_copy_in(common::cache_home().path(), &a).await;
    assert!(ok, "a 401 is retried with a fresh token: {stderr}");
    assert!(
        tf.count_method("PATCH", "/blobs/uploads/") > 2,
        "{}",
        show(&tf)
    );
    assert!(server.requests() > tokens, "a token was fetched again");
    let (_, _, digest) = tok.get_manifest("m/revoked", "v1").await.unwrap();
    assert_eq!(digest, img.digest);

    tf.set(Mode::RefuseFirst("POST", "/blobs/uploads/", 503, Some(7)));
    let a = args("m/busy");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, report, stderr) = try_copy_in(common::cache_home().path(), &a).await;
    assert!(!ok);
    let error = report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("POST blob upload")
            && error.contains("HTTP 503")
            && error.contains("(Retry-After 7s)"),
        "{report} {stderr}"
    );
}

/// A manifest PUT that the registry refuses with MANIFEST_BLOB_UNKNOWN,
/// as Distribution does while another writer rewrites the blob's link, is
/// asked again, and the copy completes: one refused PUT and one accepted,
/// and the target holds the manifest byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_put_refused_while_another_writer_lands_is_asked_again() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let front = Front::start(&dst.host()).await;
    let img = Image::oci(2, 7321);
    push_image(&src, "raced", Some("v1"), &img).await;
    front.set(Mode::RefuseFirst("PUT", "/manifests/", 400, None));
    copy(&[
        &format!("docker://{}/raced:v1", src.host()),
        &format!("docker://{}/m/raced:v1", front.host()),
    ])
    .await;
    let puts: Vec<u16> = front
        .answered()
        .into_iter()
        .filter(|(m, p, _)| m == "PUT" && p == "/v2/m/raced/manifests/v1")
        .map(|(_, _, status)| status)
        .collect();
    assert_eq!(puts, [400, 201], "{}", show(&front));
    let (bytes, _, digest) = dst.get_manifest("m/raced", "v1").await.unwrap();
    common::assert_bytes_eq(&bytes, &img.manifest, "manifest");
    assert_eq!(digest, img.digest);
}

/// The remembered locations in the CLI's cache file: (registry, digest,
/// repository).
fn cached_locations(cache: &Path) -> Vec<(String, String, String)> {
    let text = std::fs::read(cache.join("pinswap/blob-locations.json")).unwrap();
    let v: Value = serde_json::from_slice(&text).unwrap();
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap().to_owned();
            (s("registry"), s("digest"), s("repository"))
        })
        .collect()
}

/// 130 small layers already in repository `a` of a registry, put there by
/// an earlier `pinswap copy`: a copy of the same image from another source
/// into a new repository `b` mounts every blob from `a` and fetches none.
/// A location a mount proves stale (202) is dropped from the cache file,
/// and that blob alone is streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_locations_mount_into_a_new_repository() {
    common::init();
    let (one, two, reg) = (
        TestRegistry::plain().await,
        TestRegistry::plain().await,
        TestRegistry::plain().await,
    );
    let (rf, two_f) = (
        Front::start(&reg.host()).await,
        Front::start(&two.host()).await,
    );
    let img = Image::random_layers(130, 512, 7401);
    push_image(&one, "app", Some("v1"), &img).await;
    push_image(&two, "app", Some("v1"), &img).await;
    let cache = common::cache_home();
    let to = |repo: &str| format!("docker://{}/{repo}/app:v1", rf.host());
    let r = copy_in(
        cache.path(),
        &[&format!("docker://{}/app:v1", one.host()), &to("a")],
    )
    .await;
    assert_eq!(r["blobsCopied"], 131, "{r}");
    rf.reset();

    let from_two = format!("docker://{}/app:v1", two_f.host());
    let r = copy_in(cache.path(), &[&from_two, &to("b")]).await;
    assert_eq!(
        (r["blobsMounted"].as_u64(), r["blobsCopied"].as_u64()),
        (Some(131), Some(0)),
        "{r}"
    );
    let mounts = rf
        .requests()
        .iter()
        .filter(|(m, p)| m == "POST" && p.contains("mount=") && p.contains("from=a%2Fapp"))
        .count();
    assert_eq!(mounts, 131, "{}", show(&rf));
    assert_eq!(two_f.count_method("GET", "/blobs/"), 0, "{}", show(&two_f));
    assert_eq!(rf.count_method("PATCH", "/blobs/"), 0);
    assert_eq!(rf.count_method("PUT", "/blobs/"), 0);
    for b in img.blobs() {
        let got = reg.blob("b/app", &b.digest).await;
        assert!(got.as_deref() == Some(&b.bytes[..]), "{} in b", b.digest);
    }

    // The cache now says `b`; the registry loses the first layer there, and
    // the source loses it too, so this copy fails after the mount from `b`
    // was refused: the stale location is dropped all the same.
    let gone = &img.layers[0];
    reg.delete_blob("b/app", &gone.digest).await;
    two.delete_blob("app", &gone.digest).await;
    let (ok, _, stderr) = try_copy_in(cache.path(), &[&from_two, &to("c")]).await;
    assert!(!ok, "{stderr}");
    let refused = rf
        .requests()
        .iter()
        .filter(|(m, p)| {
            m == "POST"
                && p.contains(&format!("mount={}", gone.digest.replace(':', "%3A")))
                && p.contains("from=b%2Fapp")
        })
        .count();
    assert_eq!(refused, 1, "{}", show(&rf));
    let locations = cached_locations(cache.path());
    assert!(
        !locations.iter().any(|(_, d, _)| *d == gone.digest),
        "the stale location stays: {locations:?}"
    );
    assert!(
        locations
            .iter()
            .any(|(r, _, repo)| *r == rf.host() && repo == "b/app"),
        "the others stay: {locations:?}"
    );
    // With the layer back at the source, it is streamed.
    common::push_blob(&two, "app", gone).await;
    let r = copy_in(cache.path(), &[&from_two, &to("c")]).await;
    assert_eq!(r["blobsCopied"], 1, "{r}");
    let got = reg.blob("c/app", &gone.digest).await;
    assert!(got.as_deref() == Some(&gone.bytes[..]));
}
