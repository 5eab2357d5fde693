//! `collisions: repair`: each app gets a config, and so an image ID, of its
//! own, child by child in an index, across restarts, replicas, platform
//! filters, Docker schema 2 and ORAS manifests; what it cannot repair it
//! reports.

mod common;

use std::collections::BTreeSet;

use common::fixtures::{Image, OCI_INDEX, SPIN_CONFIG_DIGEST};
use common::identity::*;
use common::review::{admit, pod};
use common::{TestRegistry, push_image, push_manifest, sha256_digest, skopeo};
use serde_json::{Value, json};

#[tokio::test]
async fn repair_gives_each_app_its_own_image_id_and_a_second_run_changes_nothing() {
    common::init();
    let s = spin().await;
    let cfg = config(&s.src, &s.dst, "repair");
    let (adm, metrics) = admission(&cfg);
    let (patched, _) = admit(&adm, &spin_pod(&s, "apps")).await;
    let identity = annotation(&patched, "pinswap.dev/identity");
    let mut configs = BTreeSet::new();
    let mut pinned = Vec::new();
    for (i, (name, img)) in s.apps.iter().enumerate() {
        let image = patched["spec"]["containers"][i]["image"]
            .as_str()
            .unwrap()
            .to_owned();
        let (repo_tag, digest) = image.split_once('@').unwrap();
        assert_ne!(digest, img.digest, "pinned to the repaired digest");
        let repo_tag = repo_tag
            .strip_prefix(&format!("{}/", s.dst.host()))
            .unwrap();
        let (repo, tag) = repo_tag.rsplit_once(':').unwrap();
        assert_eq!(
            s.dst.head_manifest(repo, tag).await.as_deref(),
            Some(digest),
            "the tag names the repaired copy"
        );
        let (m, config_bytes, config) = target_config(&s.dst, repo, tag).await;
        let want_label = {
            let mut t = String::new();
            for l in &img.layers {
                t.push_str(&l.digest);
                t.push('\n');
            }
            sha256_digest(t.as_bytes())
        };
        assert_eq!(
            config["config"]["Labels"]["dev.pinswap.content-digest"],
            want_label.as_str()
        );
        assert_eq!(
            config["architecture"], "wasm",
            "the rest of the config is kept"
        );
        assert_eq!(
            m["annotations"]["dev.pinswap.repaired-from"],
            img.digest.as_str()
        );
        assert_eq!(m["config"]["digest"], sha256_digest(&config_bytes).as_str());
        configs.insert(m["config"]["digest"].as_str().unwrap().to_owned());
        // Layers byte-identical to the source.
        for l in &img.layers {
            assert_eq!(
                s.dst.blob(repo, &l.digest).await.as_deref(),
                Some(&l.bytes[..]),
                "{name}"
            );
        }
        let layers: Vec<&str> = m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["digest"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = img.layers.iter().map(|l| l.digest.as_str()).collect();
        assert_eq!(layers, want);
        // skopeo reads the repaired copy, config included.
        assert_eq!(skopeo::inspect_digest(&s.dst, repo, tag).await, digest);
        let inspected = skopeo::inspect(&s.dst, repo, tag).await;
        assert_eq!(inspected["Digest"], digest);
        assert_eq!(
            inspected["Labels"]["dev.pinswap.content-digest"],
            want_label.as_str()
        );
        let note = identity[&format!("containers/c{i}")].as_str().unwrap();
        assert!(
            note.starts_with("repaired:") && note.contains(&img.digest),
            "{note}"
        );
        pinned.push(image);
    }
    assert_eq!(configs.len(), 3, "three distinct image IDs");
    assert!(!configs.contains(SPIN_CONFIG_DIGEST));
    assert_eq!(metric(&metrics, "pinswap_copies_succeeded_total"), 3.0);

    // A second run (a new process): same digests, nothing copied or pushed.
    let (adm2, metrics2) = admission(&cfg);
    let (again, _) = admit(&adm2, &spin_pod(&s, "apps-again")).await;
    for (i, p) in pinned.iter().enumerate() {
        assert_eq!(
            again["spec"]["containers"][i]["image"],
            p.as_str(),
            "repair is deterministic"
        );
    }
    assert_eq!(
        metric(&metrics2, "pinswap_copies_started_total"),
        0.0,
        "present already"
    );
    let decisions = annotation(&again, "pinswap.dev/decisions");
    assert!(
        decisions
            .values()
            .all(|d| d == "rewritten: present at the target"),
        "{decisions:?}"
    );
}

#[tokio::test]
async fn repair_rewrites_an_index_child_by_child() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/multi", "multi-a", "multi-b").await;
    let index = index_of(&[(&a, wasm("a")), (&b, wasm("b"))]);
    push_manifest(&src, "spin/multi", "v1", OCI_INDEX, &index).await;
    let cfg = config(&src, &dst, "repair");
    let (adm, _) = admission(&cfg);
    let (patched, _) = admit(
        &adm,
        &pod(
            "wasm",
            "multi",
            &[("app", &format!("{}/spin/multi:v1", src.host()))],
        ),
    )
    .await;
    let image = patched["spec"]["containers"][0]["image"].as_str().unwrap();
    let digest = image.split_once('@').unwrap().1;
    assert_ne!(digest, sha256_digest(&index));
    let repo = format!("mirror/127.0.0.1_{}/spin/multi", src.port());
    let (bytes, _, _) = dst.get_manifest(&repo, "v1").await.unwrap();
    assert_eq!(sha256_digest(&bytes), digest);
    let idx: Value = serde_json::from_slice(&bytes).unwrap();
    let mut configs = BTreeSet::new();
    for (i, child) in idx["manifests"].as_array().unwrap().iter().enumerate() {
        let d = child["digest"].as_str().unwrap();
        assert_ne!(d, [&a, &b][i].digest, "child {i} repaired");
        assert_eq!(child["platform"]["variant"], ["a", "b"][i], "platform kept");
        let (mb, _, _) = dst.get_manifest(&repo, d).await.unwrap();
        let m: Value = serde_json::from_slice(&mb).unwrap();
        configs.insert(m["config"]["digest"].as_str().unwrap().to_owned());
    }
    assert_eq!(configs.len(), 2);
    assert_eq!(skopeo::inspect_digest(&dst, &repo, "v1").await, digest);
}

#[tokio::test]
async fn a_restart_does_not_forget_a_collision() {
    common::init();
    let s = spin().await;
    let cfg = config(&s.src, &s.dst, "warn");
    let (first, _) = admission(&cfg);
    let h = s.src.host();
    admit(
        &first,
        &pod("wasm", "one", &[("app", &format!("{h}/spin/hello:v1"))]),
    )
    .await;
    drop(first);
    // A new process: its record is rebuilt from the target before it sees
    // the other app.
    let (second, _) = admission(&cfg);
    let tags = second.mirror().rebuild_identity(100).await.unwrap();
    assert_eq!(tags, 1);
    let (patched, _) = admit(
        &second,
        &pod("wasm", "two", &[("app", &format!("{h}/spin/other:w"))]),
    )
    .await;
    let note = annotation(&patched, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        note.contains(&format!(
            "collides with {}/mirror/127.0.0.1_{}/spin/hello:v1",
            s.dst.host(),
            s.src.port()
        )),
        "{note}"
    );
}

/// An index whose child is itself an index (nested), holding Spin apps that
/// share the config: not repaired, and said so.
#[tokio::test]
async fn a_nested_index_is_not_repaired_and_the_note_says_so() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/nested", "nest-a", "nest-b").await;
    let inner = index_of(&[(&a, wasm("a")), (&b, wasm("b"))]);
    let inner_digest = sha256_digest(&inner);
    push_manifest(&src, "spin/nested", &inner_digest, OCI_INDEX, &inner).await;
    let outer = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": OCI_INDEX, "digest": inner_digest, "size": inner.len()}]}))
    .unwrap();
    push_manifest(&src, "spin/nested", "v1", OCI_INDEX, &outer).await;
    let (adm, _) = admission(&config(&src, &dst, "repair"));
    let (patched, _) = admit(
        &adm,
        &pod(
            "wasm",
            "nested",
            &[("app", &format!("{}/spin/nested:v1", src.host()))],
        ),
    )
    .await;
    let image = patched["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let note = annotation(&patched, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    // Only the top index's own children are rewritten: the images inside
    // the nested index are mirrored as they are, and the note says so
    // rather than claiming a repair.
    let (_, digest) = split_pinned(&dst, &image);
    assert_eq!(digest, sha256_digest(&outer), "pinned to the original");
    assert!(
        note.contains("not repaired (inside a nested index)"),
        "{note}"
    );
    assert!(!note.contains("repaired: config"), "{note}");
}

/// A repaired image lost at the target is recovered by a replica that did
/// not plan it (another replica, a restart, or after the 24 h `sources`
/// TTL), even once the source tag has moved, from the `pinswap.dev/sources`
/// entry; `warn` is the control.
#[tokio::test]
async fn a_repaired_image_is_recovered_by_another_replica_after_the_tag_moved() {
    use pinswap::cache::Cause;
    use pinswap::reference::Reference;
    common::init();
    for policy in ["warn", "repair"] {
        let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
        push_image(
            &src,
            "spin/hello",
            Some("v1"),
            &Image::spin("rec-a", 1, None),
        )
        .await;
        let cfg = config(&src, &dst, policy);
        let (first, _) = admission(&cfg);
        let original = format!("{}/spin/hello:v1", src.host());
        let p = admit_one(&first, &original, "web").await;
        let image = image_of(&p);
        // What the watcher reads: the pinned source the admission recorded.
        let pinned_source = annotation(&p, "pinswap.dev/sources")["containers/app"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            pinned_source.starts_with(&format!("{original}@sha256:")),
            "{pinned_source}"
        );
        // The tag moves upstream (a new release).
        push_image(
            &src,
            "spin/hello",
            Some("v1"),
            &Image::spin("rec-b", 1, None),
        )
        .await;
        let (repo, digest) = split_pinned(&dst, &image);
        dst.delete_manifest(repo, digest).await;
        let (other, _) = admission(&cfg);
        let target = Reference::parse(&image).unwrap();
        let hint = Reference::parse(&pinned_source).unwrap();
        let r = other
            .mirror()
            .recover(&target, Some(&hint), Cause::PullFailure, &[])
            .await;
        assert!(
            r.is_ok() && dst.head_manifest(repo, digest).await.is_some(),
            "{policy}: {image} not recovered: {r:?}"
        );
    }
}

/// A platform filter with repair, on an index of two Spin apps.
#[tokio::test]
async fn repair_with_a_platform_filter() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let (a, b) = spin_pair(&src, "spin/pf", "pf-a", "pf-b").await;
    let linux = |arch: &str| json!({"architecture": arch, "os": "linux"});
    let index = index_of(&[(&a, linux("amd64")), (&b, linux("arm64"))]);
    push_manifest(&src, "spin/pf", "v1", OCI_INDEX, &index).await;
    let cfg = config_extra(&src, &dst, "repair", "platforms: [linux/amd64]\n");
    let (adm, _) = admission(&cfg);
    let p = admit_one(&adm, &format!("{}/spin/pf:v1", src.host()), "pf").await;
    let image = image_of(&p);
    assert!(
        image.starts_with(&dst.host()),
        "{image} {:?}",
        annotation(&p, "pinswap.dev/decisions")
    );
    let (repo, digest) = split_pinned(&dst, &image);
    let configs = image_configs(&dst, repo, digest).await;
    assert_eq!(configs.len(), 1, "{configs:?}");
    assert_ne!(configs[0], SPIN_CONFIG_DIGEST);
    // A second process plans the same digest (deterministic).
    let (adm2, m2) = admission(&cfg);
    let p2 = admit_one(&adm2, &format!("{}/spin/pf:v1", src.host()), "pf2").await;
    assert_eq!(image_of(&p2), image);
    assert_eq!(metric(&m2, "pinswap_copies_started_total"), 0.0);
}

/// Docker schema2 images (pretty-printed manifests, no annotations)
/// sharing one config, with a digest-only source and pin: false.
#[tokio::test]
async fn repair_of_docker_schema2_images_sharing_a_config() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let cfg_bytes = br#"{"architecture":"amd64","os":"linux","config":{"Labels":{"a":"b"}},"rootfs":{"type":"layers","diff_ids":[]}}"#;
    let config = common::fixtures::Blob::new(
        "application/vnd.docker.container.image.v1+json",
        cfg_bytes.to_vec(),
    );
    let mk = |seed: &str| {
        let layer = common::fixtures::Blob::new(
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            common::fixtures::gzip(seed.as_bytes()),
        );
        let m = serde_json::to_vec_pretty(&json!({"schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": config.descriptor(), "layers": [layer.descriptor()]}))
        .unwrap();
        Image {
            digest: sha256_digest(&m),
            manifest: m,
            media_type: "application/vnd.docker.distribution.manifest.v2+json".into(),
            config: config.clone(),
            layers: vec![layer],
        }
    };
    let (a, b) = (mk("docker-a"), mk("docker-b"));
    push_image(&src, "dock/a", Some("v1"), &a).await;
    push_image(&src, "dock/b", None, &b).await;
    let cfg = config_extra(&src, &dst, "repair", "pin: false\n");
    let (adm, _) = admission(&cfg);
    let pa = admit_one(&adm, &format!("{}/dock/a:v1", src.host()), "a").await;
    let pb = admit_one(&adm, &format!("{}/dock/b@{}", src.host(), b.digest), "b").await;
    let (ia, ib) = (image_of(&pa), image_of(&pb));
    assert!(!ia.contains('@'), "pin: false keeps the tag only: {ia}");
    let repo_a = ia
        .strip_prefix(&format!("{}/", dst.host()))
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .0
        .to_owned();
    let (da, _, _) = dst.get_manifest(&repo_a, "v1").await.unwrap();
    let da = sha256_digest(&da);
    let (repo_b, db) = split_pinned(&dst, &ib);
    assert_ne!(
        db, b.digest,
        "digest-only source pinned to the repaired digest"
    );
    let ca = image_configs(&dst, &repo_a, &da).await;
    let cb = image_configs(&dst, repo_b, db).await;
    assert_ne!(ca, cb, "unique image IDs");
    // The anchor tag names the repaired copy.
    let tags = dst.tags(repo_b).await;
    assert_eq!(tags.len(), 1, "{tags:?}");
    assert_eq!(
        dst.head_manifest(repo_b, &tags[0]).await.as_deref(),
        Some(db)
    );
    let (cfgb, _, _) = {
        let (bytes, _, _) = dst.get_manifest(repo_b, db).await.unwrap();
        let m: Value = serde_json::from_slice(&bytes).unwrap();
        let c = dst
            .blob(repo_b, m["config"]["digest"].as_str().unwrap())
            .await
            .unwrap();
        (serde_json::from_slice::<Value>(&c).unwrap(), (), ())
    };
    assert_eq!(cfgb["config"]["Labels"]["a"], "b", "existing labels kept");
    assert!(cfgb["config"]["Labels"]["dev.pinswap.content-digest"].is_string());
    assert_eq!(
        common::skopeo::inspect_digest(&dst, repo_b, &tags[0]).await,
        db
    );
}

/// The target has the original under the tag (mirrored under warn), then
/// the operator switches to repair: the tag moves to the repaired copy and
/// the original stays by digest.
#[tokio::test]
async fn switching_from_warn_to_repair_repairs_what_warn_mirrored() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let a = Image::spin("sw-a", 1, None);
    push_image(&src, "spin/sw", Some("v1"), &a).await;
    let (warn, _) = admission(&config(&src, &dst, "warn"));
    let image = format!("{}/spin/sw:v1", src.host());
    let p = admit_one(&warn, &image, "w").await;
    assert!(image_of(&p).ends_with(&a.digest));
    let (repair, _) = admission(&config(&src, &dst, "repair"));
    let p = admit_one(&repair, &image, "r").await;
    let pinned = image_of(&p);
    let (repo, digest) = split_pinned(&dst, &pinned);
    assert_ne!(digest, a.digest);
    assert_eq!(dst.head_manifest(repo, "v1").await.as_deref(), Some(digest));
    assert!(
        dst.head_manifest(repo, &a.digest).await.is_some(),
        "original still there for old Pods"
    );
}

/// Two admissions of one Spin index at once, by tag and by digest (two
/// copy-queue keys), under repair: both repaired pushes succeed (they share
/// the copier's per-manifest lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_repairs_of_one_index_under_two_tags_both_succeed() {
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let mut failures = Vec::new();
    for round in 0..10 {
        let repo = format!("spin/c{round}");
        let kids: Vec<Image> = (0..4)
            .map(|i| Image::spin(&format!("c{round}-{i}"), 1, None))
            .collect();
        let mut entries = Vec::new();
        for (i, k) in kids.iter().enumerate() {
            push_image(&src, &repo, None, k).await;
            entries.push(
                json!({"mediaType": k.media_type, "digest": k.digest, "size": k.manifest.len(),
                "platform": {"architecture": "wasm", "os": "wasip1", "variant": format!("v{i}")}}),
            );
        }
        let index = serde_json::to_vec(
            &json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}),
        )
        .unwrap();
        push_manifest(&src, &repo, "v1", OCI_INDEX, &index).await;
        let (adm, _) = admission(&config(&src, &dst, "repair"));
        let by_tag = format!("{}/{repo}:v1", src.host());
        let by_digest = format!("{}/{repo}@{}", src.host(), sha256_digest(&index));
        let (a, b) = tokio::join!(
            admit_one(&adm, &by_tag, "t"),
            admit_one(&adm, &by_digest, "d")
        );
        for p in [a, b] {
            let d = annotation(&p, "pinswap.dev/decisions")["containers/app"].clone();
            if !d.as_str().unwrap().starts_with("rewritten") {
                failures.push(format!("round {round}: {d}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// OCI 1.1 artifacts embed the empty config in the descriptor (`"data":
/// "e30="`). The repaired descriptor must not contradict itself: `data`
/// matches the digest or is gone, and the empty mediaType (which must hold
/// `{}`) is replaced.
#[test]
fn a_repaired_oras_manifest_keeps_a_consistent_config_descriptor() {
    use pinswap::identity::{repair_config, repair_manifest};
    use pinswap::registry::manifest::RawManifest;
    let layer =
        common::fixtures::Blob::new("application/vnd.oci.image.layer.v1.tar", b"x".to_vec());
    let body = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.example",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": common::fixtures::EMPTY_CONFIG_DIGEST, "size": 2, "data": "e30="},
        "layers": [layer.descriptor()]});
    let bytes = bytes::Bytes::from(serde_json::to_vec(&body).unwrap());
    let m = RawManifest::parse(
        bytes.clone(),
        pinswap::reference::Digest::parse(&sha256_digest(&bytes)).unwrap(),
        None,
    )
    .unwrap();
    let desc = descriptor("application/vnd.oci.empty.v1+json", b"{}");
    let cfg = repair_config(b"{}", &desc, std::slice::from_ref(&layer.digest)).unwrap();
    let d = pinswap::reference::Digest::parse(&sha256_digest(&cfg)).unwrap();
    let r = repair_manifest(&m, (&d, cfg.len() as u64)).unwrap();
    let v: Value = serde_json::from_slice(&r.bytes).unwrap();
    let c = &v["config"];
    use base64::Engine as _;
    let data_ok = c.get("data").is_none_or(|x| {
        base64::engine::general_purpose::STANDARD
            .decode(x.as_str().unwrap())
            .unwrap()
            == cfg
    });
    let mt_ok = c["mediaType"] != "application/vnd.oci.empty.v1+json";
    assert!(data_ok && mt_ok, "repaired config descriptor: {c}");
}

/// A layerless manifest that shares its config with a layered image has no
/// layers to label its config with; under `repair` its identity note says
/// it is not repaired and names the collision, instead of being empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layerless_manifest_in_a_collision_is_reported_not_repaired() {
    use common::fixtures::{Blob, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, gzip};
    common::init();
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let shared = Blob::new(
        OCI_CONFIG,
        br#"{"architecture":"amd64","os":"linux"}"#.to_vec(),
    );
    let layered = Image::with_parts(
        OCI_MANIFEST,
        shared.clone(),
        vec![Blob::new(OCI_LAYER_GZIP, gzip(b"app"))],
    );
    let bare = Image::with_parts(OCI_MANIFEST, shared, vec![]);
    push_image(&src, "art/layered", Some("v1"), &layered).await;
    push_image(&src, "art/bare", Some("v1"), &bare).await;
    let (adm, _) = admission(&config(&src, &dst, "repair"));
    let first = admit_one(&adm, &format!("{}/art/layered:v1", src.host()), "a").await;
    let note = annotation(&first, "pinswap.dev/identity")["containers/app"].clone();
    assert!(
        note.as_str().unwrap().starts_with("repaired: config"),
        "{note}"
    );
    let second = admit_one(&adm, &format!("{}/art/bare:v1", src.host()), "b").await;
    let note = annotation(&second, "pinswap.dev/identity")["containers/app"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        note.starts_with("not repaired (no layers to label the config with): "),
        "{note}"
    );
    assert!(
        note.contains("art/layered:v1"),
        "names the collision: {note}"
    );
}
