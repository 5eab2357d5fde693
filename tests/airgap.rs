//! The running set carried across an air gap (docs/air-gap.md):
//! `pinswap export` from a target whose usage records list what two
//! clusters run, `pinswap import` into an empty registry of another
//! engine, and every manifest, blob, tag and referrer compared there with
//! skopeo and oras, byte for byte. Registries are real processes on
//! 127.0.0.1: Distribution 2.8 (cosign's tags and fallback tag indexes),
//! Distribution 3, and go-containerregistry's registry (the referrers
//! API).

mod common;

use std::path::Path;

use common::front::Front;
use common::records::{publish, sharing_yaml};
use common::registry::Engine;
use common::tools::oras_discover;
use common::{Image, Index, TestRegistry, assert_bytes_eq, push_image, push_index, push_manifest};
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::{Value, json};

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// The source registry the mirror paths name. Nothing here reaches it:
/// the images are pushed into the target as pinswap would have copied
/// them.
const SOURCE: &str = "registry.example";
const SBOM: &str = "application/spdx+json";

fn repo(name: &str) -> String {
    format!("mirror/{SOURCE}/{name}")
}

fn tag_of(digest: &str, suffix: &str) -> String {
    format!("{}{suffix}", digest.replace(':', "-"))
}

/// A config file whose target is `host/mirror`, sharing on.
fn config(dir: &Path, host: &str) -> std::path::PathBuf {
    let path = dir.join("pinswap.yaml");
    std::fs::write(&path, sharing_yaml(host)).unwrap();
    path
}

/// `pinswap export -c CONFIG --output OUT EXTRA...`.
async fn export(config: &Path, out: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "export",
        "-c",
        config.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    common::run_pinswap(&args).await
}

/// `pinswap import FROM --to TO EXTRA...`.
async fn import(from: &Path, to: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["import", from.to_str().unwrap(), "--to", to];
    args.extend(extra);
    common::run_pinswap(&args).await
}

/// `skopeo inspect --raw` of a reference in any transport.
async fn skopeo_raw(transport: &str) -> Vec<u8> {
    let out = tokio::process::Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false", transport])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "skopeo inspect --raw {transport}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Every blob `manifest` names (config, layers; an index's children
/// recursively) is at `b` under `b_repo` as at `a` under `a_repo`.
async fn same_blobs(
    a: &TestRegistry,
    a_repo: &str,
    b: &TestRegistry,
    b_repo: &str,
    manifest: &[u8],
) {
    let m: Value = serde_json::from_slice(manifest).unwrap();
    for child in m["manifests"].as_array().into_iter().flatten() {
        let d = child["digest"].as_str().unwrap();
        let (want, _, _) = a.get_manifest(a_repo, d).await.unwrap();
        let (got, _, _) = b
            .get_manifest(b_repo, d)
            .await
            .unwrap_or_else(|| panic!("child {d} of {b_repo} was not imported"));
        assert_bytes_eq(&got, &want, &format!("child {d}"));
        Box::pin(same_blobs(a, a_repo, b, b_repo, &want)).await;
    }
    let blobs = m["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(m.get("config"));
    for blob in blobs {
        let d = blob["digest"].as_str().unwrap();
        let want = a.blob(a_repo, d).await.unwrap();
        let got = b
            .blob(b_repo, d)
            .await
            .unwrap_or_else(|| panic!("blob {d} of {b_repo} was not imported"));
        assert_bytes_eq(&got, &want, &format!("blob {d}"));
    }
}

fn manifest_of(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("pinswap-export.json")).unwrap()).unwrap()
}

fn names(m: &Value) -> Vec<String> {
    let mut n: Vec<String> = m["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect();
    n.sort();
    n
}

/// The target as two clusters left it, on Distribution 2.8:
/// - `app:v1`, an index of two platforms, signed with cosign's `.sig`
///   tag and with an SBOM in its fallback tag index (cluster a);
/// - `tool:v2` and another tag of it, `stable` (cluster a names the tag);
/// - `solo`, digest-only, with its anchor tag (cluster b);
/// - `old:v1`, mirrored once and named by no record.
struct Target {
    reg: TestRegistry,
    app: Index,
    sig: Image,
    sbom: Image,
    tool: Image,
    solo: Image,
    /// An anchor tag as a copy under a platform filter gets, naming the
    /// app's index though its hex is another digest's.
    filtered_anchor: String,
}

async fn target() -> Target {
    let reg = TestRegistry::plain().await;
    let app = Index::oci(11, false);
    push_index(&reg, &repo("app"), Some("v1"), &app).await;
    let subject = app.descriptor();
    let sig = Image::referrer(
        &subject,
        "application/vnd.dev.cosign.simplesigning.v1+json",
        b"sig",
    );
    push_image(&reg, &repo("app"), Some(&tag_of(&app.digest, ".sig")), &sig).await;
    let sbom = Image::referrer(&subject, SBOM, b"{\"spdxVersion\":\"SPDX-2.3\"}");
    push_image(&reg, &repo("app"), None, &sbom).await;
    let mut desc = sbom.descriptor();
    desc["artifactType"] = json!(SBOM);
    let fallback = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": INDEX, "manifests": [desc],
    }))
    .unwrap();
    push_manifest(
        &reg,
        &repo("app"),
        &tag_of(&app.digest, ""),
        INDEX,
        &fallback,
    )
    .await;
    let tool = Image::oci(2, 12);
    push_image(&reg, &repo("tool"), Some("v2"), &tool).await;
    push_image(&reg, &repo("tool"), Some("stable"), &tool).await;
    // An older tag of tool, which no record names.
    push_image(&reg, &repo("tool"), Some("v1"), &Image::oci(1, 13)).await;
    let solo = Image::oci(1, 14);
    let anchor = format!("pinswap-{}", &solo.digest["sha256:".len()..]);
    push_image(&reg, &repo("solo"), Some(&anchor), &solo).await;
    let filtered_anchor = format!("pinswap-{}-0123456789ab", "c".repeat(64));
    push_index(&reg, &repo("app"), Some(&filtered_anchor), &app).await;
    push_image(&reg, &repo("old"), Some("v1"), &Image::oci(1, 15)).await;
    let host = reg.host();
    publish(
        &host,
        "a",
        &[
            format!("{}@{}", repo("app"), app.digest),
            format!("{}:v2", repo("tool")),
        ],
    )
    .await;
    publish(&host, "b", &[format!("{}@{}", repo("solo"), solo.digest)]).await;
    Target {
        reg,
        app,
        sig,
        sbom,
        tool,
        solo,
        filtered_anchor,
    }
}

/// [`target`], exported into a temporary directory (the last value).
async fn exported() -> (Target, std::path::PathBuf, tempfile::TempDir) {
    common::init();
    let t = target().await;
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &t.reg.host());
    let out = work.path().join("set");
    let (code, o, e) = export(&cfg, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    (t, out, work)
}

#[tokio::test]
async fn the_running_set_crosses_the_air_gap_byte_for_byte() {
    common::init();
    let t = target().await;
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &t.reg.host());
    let out = work.path().join("running-set");
    let (code, stdout, stderr) = export(&cfg, &out, &["--json"]).await;
    assert_eq!(code, 0, "export: {stdout}{stderr}");
    let m = manifest_of(&out);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap(), m);
    let solo_anchor = format!("pinswap-{}", &t.solo.digest["sha256:".len()..]);
    let mut want = vec![
        format!("{SOURCE}/app:v1"),
        format!("{SOURCE}/app@{}", t.app.digest),
        format!("{SOURCE}/app:{}", tag_of(&t.app.digest, ".sig")),
        format!("{SOURCE}/app:{}", t.filtered_anchor),
        // The fallback tag index is not carried as a tag: what it lists is,
        // by digest, and the import lists it again at its subject.
        format!("{SOURCE}/app@{}", t.sbom.digest),
        format!("{SOURCE}/solo:{solo_anchor}"),
        format!("{SOURCE}/solo@{}", t.solo.digest),
        format!("{SOURCE}/tool:stable"),
        format!("{SOURCE}/tool:v2"),
        format!("{SOURCE}/tool@{}", t.tool.digest),
    ];
    want.sort();
    // Not old:v1, nor tool:v1: no record names them.
    assert_eq!(names(&m), want);
    let clusters: Vec<&str> = m["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["cluster"].as_str().unwrap())
        .collect();
    assert_eq!(clusters, ["a", "b"]);
    assert_eq!(m["missing"], json!([]));
    // The layout is one skopeo reads: the app's index by its ref.name.
    let layout_app = skopeo_raw(&format!("oci:{}:{SOURCE}/app:v1", out.display())).await;
    assert_bytes_eq(
        &layout_app,
        &t.app.manifest,
        "the app's index in the layout",
    );

    // Into an empty Distribution 3, under another prefix.
    let new = TestRegistry::of(Engine::Distribution3).await;
    let to = format!("{}/air", new.host());
    let (code, stdout, stderr) = import(&out, &to, &["--json"]).await;
    assert_eq!(code, 0, "import: {stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    // Several names of one manifest: whichever goes second finds it there.
    let (pushed, present) = (
        report["pushed"].as_u64().unwrap(),
        report["present"].as_u64().unwrap(),
    );
    assert_eq!(pushed + present, want.len() as u64, "{report}");
    assert!(pushed >= 6, "{report}");
    assert_eq!(
        (report["failed"].clone(), report["conflicts"].clone()),
        (json!([]), json!([]))
    );
    assert_eq!(
        report["indexesWritten"],
        json!(1),
        "the SBOM listed at its subject"
    );
    for name in &want {
        let (path, reference) = match name.split_once('@') {
            Some((p, d)) => (p.to_owned(), d.to_owned()),
            None => {
                let (p, t) = name.rsplit_once(':').unwrap();
                (p.to_owned(), t.to_owned())
            }
        };
        let (old_repo, new_repo) = (format!("mirror/{path}"), format!("air/{path}"));
        let was = common::skopeo::inspect_raw(&t.reg, &old_repo, &reference).await;
        let is = common::skopeo::inspect_raw(&new, &new_repo, &reference).await;
        assert_bytes_eq(&is, &was, name);
        same_blobs(&t.reg, &old_repo, &new, &new_repo, &was).await;
    }
    // Exactly the exported tags, and the referrers oras finds at the old
    // target are those it finds at the new one.
    assert_eq!(
        new.tags(&format!("air/{SOURCE}/tool")).await,
        ["stable", "v2"]
    );
    assert!(new.tags(&format!("air/{SOURCE}/old")).await.is_empty());
    let discovered =
        |host: String, prefix: &str| format!("{host}/{prefix}/{SOURCE}/app@{}", t.app.digest);
    // cosign's `.sig` tag is not an OCI referrer; the SBOM in the
    // fallback tag index is.
    let before = oras_discover(&discovered(t.reg.host(), "mirror")).await;
    assert_eq!(before, std::slice::from_ref(&t.sbom.digest));
    let after = oras_discover(&discovered(new.host(), "air")).await;
    assert_eq!(after, before);

    // Again: everything is there already.
    let (code, stdout, stderr) = import(&out, &to, &["--json"]).await;
    assert_eq!(code, 0, "second import: {stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (report["pushed"].clone(), report["present"].clone()),
        (json!(0), json!(want.len()))
    );
    let sig = format!("air/{SOURCE}/app");
    let (got, _, _) = new
        .get_manifest(&sig, &tag_of(&t.app.digest, ".sig"))
        .await
        .unwrap();
    assert_bytes_eq(&got, &t.sig.manifest, "the signature");
}

/// A pinswap whose target is the imported registry rewrites the Pods of
/// the exported clusters, by tag and by digest, with the source and the
/// old target both stopped.
#[tokio::test]
async fn a_pinswap_at_the_imported_mirror_serves_with_every_source_stopped() {
    use common::review::{admit, pod};
    use pinswap::admission::Admission;
    common::init();
    let mut src = TestRegistry::plain().await;
    let mut old = TestRegistry::plain().await;
    let app = Image::oci(2, 31);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let solo = Image::oci(1, 32);
    push_image(&src, "shop/solo", None, &solo).await;
    let src_host = src.host();
    let admission = |target: &str| {
        let yaml = format!(
            "target: {{registry: \"{target}\"}}\nsource:\n  registries: [{{registry: \"{src_host}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {{ttl: 0s, resolutionTtl: 0s}}\ncluster: a\nsharing: {{enabled: true}}\n"
        );
        let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
        Admission::from_config(&config, std::sync::Arc::new(Metrics::new())).unwrap()
    };
    let (by_tag, by_digest) = (
        format!("{src_host}/shop/app:v1"),
        format!("{src_host}/shop/solo@{}", solo.digest),
    );
    let running = pod("shop", "web", &[("app", &by_tag), ("solo", &by_digest)]);
    let port = src.port();
    let at = |host: &str, prefix: &str| {
        let path = format!("{host}/{prefix}/127.0.0.1_{port}/shop");
        (
            format!("{path}/app:v1@{}", app.digest),
            format!("{path}/solo@{}", solo.digest),
        )
    };
    let images = |p: &Value| {
        let c = p["spec"]["containers"].as_array().unwrap();
        (
            c[0]["image"].as_str().unwrap().to_owned(),
            c[1]["image"].as_str().unwrap().to_owned(),
        )
    };
    let (patched, _) = admit(&admission(&format!("{}/mirror", old.host())), &running).await;
    assert_eq!(images(&patched), at(&old.host(), "mirror"));
    let path = format!("mirror/127.0.0.1_{port}/shop");
    publish(
        &old.host(),
        "a",
        &[
            format!("{path}/app@{}", app.digest),
            format!("{path}/solo@{}", solo.digest),
        ],
    )
    .await;
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &old.host());
    let out = work.path().join("set");
    let (code, o, e) = export(&cfg, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let new = TestRegistry::plain().await;
    let (code, o, e) = import(&out, &format!("{}/air", new.host()), &[]).await;
    assert_eq!(code, 0, "{o}{e}");

    src.kill();
    old.kill();
    let (patched, response) = admit(&admission(&format!("{}/air", new.host())), &running).await;
    assert_eq!(images(&patched), at(&new.host(), "air"), "{response}");
}

/// A tag at the registry that names another manifest is left alone and
/// reported, until the import is told to replace tags.
#[tokio::test]
async fn an_import_moves_no_tag_it_did_not_bring_unless_told() {
    let (t, out, _work) = exported().await;
    let new = TestRegistry::plain().await;
    let theirs = Image::oci(1, 99);
    let tool = format!("air/{SOURCE}/tool");
    push_image(&new, &tool, Some("v2"), &theirs).await;
    let to = format!("{}/air", new.host());
    let (code, stdout, stderr) = import(&out, &to, &[]).await;
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stderr.contains("tool:v2: has ") && stderr.contains("--replace-tags"),
        "{stderr}"
    );
    assert_eq!(
        new.head_manifest(&tool, "v2").await.as_deref(),
        Some(theirs.digest.as_str())
    );
    // Everything else arrived.
    assert_eq!(
        new.head_manifest(&tool, "stable").await.as_deref(),
        Some(t.tool.digest.as_str())
    );
    let (code, stdout, stderr) = import(&out, &to, &["--replace-tags"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(
        new.head_manifest(&tool, "v2").await.as_deref(),
        Some(t.tool.digest.as_str())
    );
}

/// An interrupted export resumes: run again, it fetches only the blobs the
/// layout lacks. A tar export imports as its directory does.
#[tokio::test]
async fn an_export_resumes_and_travels_as_a_tar() {
    common::init();
    let t = target().await;
    let front = Front::start(&t.reg.host()).await;
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("set");
    let direct = config(work.path(), &t.reg.host());
    let (code, o, e) = export(&direct, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    // As if cut short: one layer not yet written, another cut short (a
    // file of the right name and the wrong size), neither index.json nor
    // the manifest written yet.
    let layer = t.tool.blobs().nth(1).unwrap().digest.clone();
    let path = out.join("blobs/sha256").join(&layer["sha256:".len()..]);
    std::fs::remove_file(&path).unwrap();
    let cut = t.tool.blobs().nth(2).unwrap().digest.clone();
    let cut_path = out.join("blobs/sha256").join(&cut["sha256:".len()..]);
    std::fs::write(&cut_path, b"half").unwrap();
    std::fs::remove_file(out.join("pinswap-export.json")).unwrap();
    std::fs::remove_file(out.join("index.json")).unwrap();
    let new = TestRegistry::plain().await;
    let to = format!("{}/air", new.host());
    let (code, _, stderr) = import(&out, &to, &[]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("did not finish (run it again: it resumes)"),
        "{stderr}"
    );

    let through = tempfile::tempdir().unwrap();
    let cfg = config(through.path(), &front.host());
    let (code, o, e) = export(&cfg, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let blob_gets: Vec<String> = front
        .requests()
        .into_iter()
        .filter(|(m, p)| m == "GET" && p.contains("/blobs/") && !p.contains("pinswap-usage"))
        .map(|(_, p)| p)
        .collect();
    let mut fetched: Vec<&str> = blob_gets
        .iter()
        .map(|p| p.rsplit('/').next().unwrap())
        .collect();
    fetched.sort();
    let mut want = vec![layer.as_str(), cut.as_str()];
    want.sort();
    assert_eq!(fetched, want, "{blob_gets:?}");
    assert_eq!(common::sha256_digest(&std::fs::read(&path).unwrap()), layer);
    assert_eq!(
        common::sha256_digest(&std::fs::read(&cut_path).unwrap()),
        cut
    );

    let tar = work.path().join("set.tar");
    let (code, o, e) = export(&direct, &tar, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    assert!(tar.is_file() && !work.path().join("set.tar.layout").exists());
    let (code, o, e) = import(&tar, &to, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    assert_eq!(
        new.head_manifest(&format!("air/{SOURCE}/app"), "v1")
            .await
            .as_deref(),
        Some(t.app.digest.as_str())
    );
    assert!(!work.path().join("set.tar.layout").exists());
}

/// Referrers the target lists through the referrers API (go-containerregistry's),
/// and one another client listed only in a fallback tag index there, arrive
/// where there is no API (Distribution 2.8) in one fallback tag index per
/// subject, every one of them, and oras finds the same ones.
#[tokio::test]
async fn referrers_from_the_api_arrive_in_a_fallback_tag() {
    common::init();
    let reg = TestRegistry::of(Engine::Ggcr).await;
    let img = Image::oci(1, 21);
    push_image(&reg, &repo("app"), Some("v1"), &img).await;
    let sbom = Image::referrer(&img.descriptor(), SBOM, b"{}");
    push_image(&reg, &repo("app"), None, &sbom).await;
    let sig = Image::referrer(&sbom.descriptor(), "application/vnd.example.sig", b"s");
    push_image(&reg, &repo("app"), None, &sig).await;
    let vex = Image::referrer(&img.descriptor(), "application/vnd.example.vex", b"v");
    push_image(&reg, &repo("app"), None, &vex).await;
    let provenance = Image::referrer(&img.descriptor(), "application/vnd.example.slsa", b"p");
    push_image(&reg, &repo("app"), None, &provenance).await;
    // The fallback tag index another client wrote (as on a registry
    // without the API), listing one of them.
    let mut listed = provenance.descriptor();
    listed["artifactType"] = json!("application/vnd.example.slsa");
    listed["annotations"] = json!({"org.opencontainers.image.created": "2026-12-06T00:00:00Z"});
    let fallback = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": INDEX, "manifests": [listed],
    }))
    .unwrap();
    push_manifest(
        &reg,
        &repo("app"),
        &tag_of(&img.digest, ""),
        INDEX,
        &fallback,
    )
    .await;
    publish(
        &reg.host(),
        "a",
        &[format!("{}@{}", repo("app"), img.digest)],
    )
    .await;
    let before = oras_discover(&format!("{}/{}@{}", reg.host(), repo("app"), img.digest)).await;
    let mut want = vec![
        sbom.digest.clone(),
        sig.digest.clone(),
        vex.digest.clone(),
        provenance.digest.clone(),
    ];
    want.sort();
    assert_eq!(
        before, want,
        "the target lists the referrers and the signature"
    );

    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &reg.host());
    let out = work.path().join("set");
    let (code, o, e) = export(&cfg, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let m = manifest_of(&out);
    let referrers: Vec<(&str, &str)> = m["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["role"] == "referrer")
        .map(|e| {
            (
                e["digest"].as_str().unwrap(),
                e["subject"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(referrers.len(), 4, "{m}");
    for (r, subject) in [
        (&sbom, &img),
        (&sig, &sbom),
        (&vex, &img),
        (&provenance, &img),
    ] {
        assert!(
            referrers.contains(&(r.digest.as_str(), subject.digest.as_str())),
            "{m}"
        );
    }
    assert!(
        !names(&m).contains(&format!("{SOURCE}/app:{}", tag_of(&img.digest, ""))),
        "the fallback tag itself is not carried: {m}"
    );

    let new = TestRegistry::plain().await;
    let to = format!("{}/air", new.host());
    let (code, o, e) = import(&out, &to, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let after = oras_discover(&format!("{}/air/{SOURCE}/app@{}", new.host(), img.digest)).await;
    assert_eq!(after, before);
    // Three referrers of one subject, pushed at once, in one index; the
    // descriptor another client wrote keeps its annotations.
    let (index, _, _) = new
        .get_manifest(&format!("air/{SOURCE}/app"), &tag_of(&img.digest, ""))
        .await
        .unwrap();
    let index: Value = serde_json::from_slice(&index).unwrap();
    let entries = index["manifests"].as_array().unwrap();
    assert_eq!(entries.len(), 3, "{index}");
    let kept = entries
        .iter()
        .find(|d| d["digest"] == json!(provenance.digest))
        .unwrap();
    assert_eq!(kept["annotations"], listed["annotations"], "{index}");
    // Again: nothing to push, nothing left alone.
    let (code, o, e) = import(&out, &to, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    assert_eq!(
        oras_discover(&format!("{}/air/{SOURCE}/app@{}", new.host(), img.digest)).await,
        before
    );
    for r in [&sbom, &sig, &vex, &provenance] {
        let (got, _, _) = new
            .get_manifest(&format!("air/{SOURCE}/app"), &r.digest)
            .await
            .unwrap();
        assert_bytes_eq(&got, &r.manifest, "a referrer");
    }
}

/// What cannot be exported is said, naming it, and loses nothing.
#[tokio::test]
async fn exports_and_imports_refuse_what_they_cannot_do_whole() {
    common::init();
    let t = target().await;
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &t.reg.host());
    let out = work.path().join("set");
    let (code, o, e) = export(&cfg, &out, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let finished = std::fs::read(out.join("pinswap-export.json")).unwrap();
    let (code, _, stderr) = export(&cfg, &out, &["--cluster", "nope"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("no usage record of cluster nope at the target (records: a, b)"),
        "{stderr}"
    );
    // Refused before the layout is touched: the finished export stands.
    assert_eq!(
        std::fs::read(out.join("pinswap-export.json")).unwrap(),
        finished
    );

    // A record naming an image the target lost: the rest is exported, the
    // loss is named, and the exit says so.
    let gone = format!("{}@sha256:{}", repo("solo"), "0".repeat(64));
    publish(
        &t.reg.host(),
        "c",
        &[format!("{}:gone", repo("tool")), gone.clone()],
    )
    .await;
    let (code, _, stderr) = export(&cfg, &out, &["--cluster", "c", "--cluster", "b"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&format!("missing at the target: {}:gone", repo("tool"))),
        "{stderr}"
    );
    let m = manifest_of(&out);
    assert_eq!(
        m["missing"],
        json!([gone, format!("{}:gone", repo("tool"))])
    );
    assert!(names(&m).contains(&format!("{SOURCE}/solo@{}", t.solo.digest)));
    // Imported, what there is arrives, and the exit says the export was
    // not whole.
    let new = TestRegistry::plain().await;
    let (code, _, stderr) = import(&out, &format!("{}/air", new.host()), &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("the export itself is incomplete: 2 of what its records list"),
        "{stderr}"
    );
    assert_eq!(
        new.head_manifest(&format!("air/{SOURCE}/solo"), &t.solo.digest)
            .await
            .as_deref(),
        Some(t.solo.digest.as_str())
    );

    // A manifest that says another digest than index.json names is
    // refused before anything is pushed.
    let new = TestRegistry::plain().await;
    let to = format!("{}/air", new.host());
    let mut swapped = m.clone();
    swapped["entries"][0]["digest"] = json!(format!("sha256:{}", "1".repeat(64)));
    std::fs::write(
        out.join("pinswap-export.json"),
        serde_json::to_vec(&swapped).unwrap(),
    )
    .unwrap();
    let (code, _, stderr) = import(&out, &to, &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("index.json names sha256:"), "{stderr}");
    assert!(new.catalog().await.is_empty());

    // A layout that names an entry outside any path is refused before
    // anything is pushed.
    let mut bad = m.clone();
    bad["entries"][0]["name"] = json!("../../etc:v1");
    std::fs::write(
        out.join("pinswap-export.json"),
        serde_json::to_vec(&bad).unwrap(),
    )
    .unwrap();
    let new = TestRegistry::plain().await;
    let (code, _, stderr) = import(&out, &format!("{}/air", new.host()), &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("entry \"../../etc:v1\""), "{stderr}");
    assert!(new.catalog().await.is_empty());

    // pinswap's own records are never taken for an image.
    let mut usage = m.clone();
    usage["entries"][0]["name"] = json!(format!(
        "pinswap-usage@{}",
        m["entries"][0]["digest"].as_str().unwrap()
    ));
    std::fs::write(
        out.join("pinswap-export.json"),
        serde_json::to_vec(&usage).unwrap(),
    )
    .unwrap();
    let (code, _, stderr) = import(&out, &format!("{}/air", new.host()), &[]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("holds pinswap's usage records, not images"),
        "{stderr}"
    );
    assert!(new.catalog().await.is_empty());

    let (code, _, stderr) = import(&out, "no registry", &[]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--to \"no registry\""), "{stderr}");
}

/// An import never moves a tag it cannot see: under each class of error
/// on the HEAD that reads the registry's tag, the tag that names another
/// manifest stays, and the entry is named. (A 404 there is an answer, "no
/// such tag", as in the fault matrix.)
#[tokio::test]
async fn an_import_that_cannot_read_a_tag_moves_nothing() {
    use common::front::{Fault, Mode};
    let (t, out, _work) = exported().await;
    let tool = format!("air/{SOURCE}/tool");
    for fault in [
        Fault::Status(401),
        Fault::Status(403),
        Fault::Status(429),
        Fault::Status(500),
        Fault::Status(503),
        Fault::Reset,
    ] {
        let new = TestRegistry::plain().await;
        let theirs = Image::oci(1, 98);
        push_image(&new, &tool, Some("v2"), &theirs).await;
        let front = Front::start(&new.host()).await;
        front.set(Mode::Fault("HEAD", "/tool/manifests/v2", fault));
        let to = format!("{}/air", front.host());
        let (code, stdout, stderr) = import(&out, &to, &[]).await;
        assert_eq!(code, 1, "{fault:?}: {stdout}{stderr}");
        // Failed; or, where a 403 sends pinswap to GET the manifest
        // instead, seen and left alone.
        let tag = format!("{}/air/{SOURCE}/tool:v2", front.host());
        let left = format!(
            "left alone (rerun with --replace-tags to move it): {tag}: has {}",
            theirs.digest
        );
        assert!(
            stderr.contains(&format!("not imported: {SOURCE}/tool:v2: ")) || stderr.contains(&left),
            "{fault:?}: {stderr}"
        );
        assert_eq!(
            new.head_manifest(&tool, "v2").await.as_deref(),
            Some(theirs.digest.as_str()),
            "{fault:?}"
        );
        assert_eq!(
            new.head_manifest(&tool, "stable").await.as_deref(),
            Some(t.tool.digest.as_str()),
            "{fault:?}: the rest arrives"
        );
    }
}

/// A tar holds the export and nothing else its directory held; an
/// incomplete one keeps its directory to resume from; and a tar that is
/// not one pinswap writes (a link, a path out of it) is refused whole.
#[tokio::test]
async fn a_tar_holds_the_export_alone_and_odd_tars_are_refused() {
    common::init();
    let t = target().await;
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), &t.reg.host());
    let tar_path = work.path().join("set.tar");
    // Left in the build directory by something else.
    let stray = work
        .path()
        .join("set.tar.layout/blobs/sha256")
        .join("f".repeat(64));
    std::fs::create_dir_all(stray.parent().unwrap()).unwrap();
    std::fs::write(&stray, b"not part of it").unwrap();
    let (code, o, e) = export(&cfg, &tar_path, &[]).await;
    assert_eq!(code, 0, "{o}{e}");
    let mut names = Vec::new();
    let mut manifest = Value::Null;
    let mut archive = tar::Archive::new(std::fs::File::open(&tar_path).unwrap());
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().display().to_string();
        if name == "pinswap-export.json" {
            manifest = serde_json::from_reader(&mut entry).unwrap();
        }
        names.push(name);
    }
    let blobs = names.iter().filter(|n| n.starts_with("blobs/")).count();
    assert_eq!(names.len(), blobs + 3, "{names:?}");
    for top in ["oci-layout", "index.json", "pinswap-export.json"] {
        assert!(names.iter().any(|n| n == top), "{names:?}");
    }
    assert_eq!(json!(blobs), manifest["blobs"], "{names:?}");
    assert!(
        !names.iter().any(|n| n.contains(&"f".repeat(64))),
        "{names:?}"
    );

    // Incomplete: the tar is written, and its directory kept to resume.
    publish(&t.reg.host(), "c", &[format!("{}:gone", repo("tool"))]).await;
    let partial = work.path().join("partial.tar");
    let (code, _, stderr) = export(&cfg, &partial, &["--cluster", "c", "--cluster", "a"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(partial.is_file(), "{stderr}");
    assert!(
        work.path()
            .join("partial.tar.layout/pinswap-export.json")
            .is_file(),
        "{stderr}"
    );
    assert!(
        stderr.contains("is kept: run the export again to resume it"),
        "{stderr}"
    );

    // Tars pinswap never writes.
    let new = TestRegistry::plain().await;
    let to = format!("{}/air", new.host());
    let link = work.path().join("link.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&link).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "index.json", "/etc/passwd").unwrap();
        b.finish().unwrap();
    }
    let escape = work.path().join("escape.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&escape).unwrap());
        let mut h = tar::Header::new_old();
        let name = b"../escaped";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_size(2);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, &b"hi"[..]).unwrap();
        b.finish().unwrap();
    }
    for (tar, says) in [(&link, "Symlink entry"), (&escape, "cannot unpack")] {
        let (code, _, stderr) = import(tar, &to, &[]).await;
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert!(!work.path().join("escaped").exists());
        let left: Vec<_> = std::fs::read_dir(work.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".import-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    assert!(new.catalog().await.is_empty());
}
