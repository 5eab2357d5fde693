//! Self-tests of the harness in `tests/common/`: if these pass, the registries,
//! fixtures, push helpers, fault helpers and skopeo wrappers do what they say.

mod common;

use std::time::Duration;

use common::fixtures::{self, Blob, Image, Index, StreamedImage};
use common::skopeo::{self, Loc};
use common::{TcpCutProxy, TestRegistry, assert_bytes_eq, push_image, push_index, sha256_digest};
use flate2::read::GzDecoder;
use reqwest::{Method, StatusCode};
use serde_json::Value;

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut GzDecoder::new(bytes), &mut out).unwrap();
    out
}

/// File names in a tar, as GNU tar (an independent reader) lists them.
fn tar_list(tar: &[u8]) -> Vec<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("tar")
        .arg("-tf")
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(tar).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn assert_descriptor(d: &Value, blob: &Blob) {
    assert_eq!(d["mediaType"], blob.media_type.as_str());
    assert_eq!(d["digest"], blob.digest.as_str());
    assert_eq!(d["size"], blob.size());
}

/// The manifest names exactly the fixture's config and layers, and every
/// digest is the sha256 of the bytes.
fn assert_consistent(img: &Image) {
    assert_eq!(img.digest, sha256_digest(&img.manifest));
    let m = json(&img.manifest);
    assert_eq!(m["schemaVersion"], 2);
    assert_eq!(m["mediaType"], img.media_type.as_str());
    assert_descriptor(&m["config"], &img.config);
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), img.layers.len());
    for (d, blob) in layers.iter().zip(&img.layers) {
        assert_descriptor(d, blob);
    }
    for blob in img.blobs() {
        assert_eq!(blob.digest, sha256_digest(&blob.bytes));
    }
}

/// An image config's diff_ids are the sha256 of each uncompressed layer tar.
fn assert_diff_ids(img: &Image, arch: &str) {
    let cfg = json(&img.config.bytes);
    assert_eq!(cfg["architecture"], arch);
    assert_eq!(cfg["os"], "linux");
    let diff_ids: Vec<&str> = cfg["rootfs"]["diff_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(diff_ids.len(), img.layers.len());
    for (id, layer) in diff_ids.iter().zip(&img.layers) {
        let tar = gunzip(&layer.bytes);
        assert_eq!(*id, sha256_digest(&tar));
        assert!(!tar_list(&tar).is_empty());
    }
}

fn assert_index_consistent(idx: &Index) {
    assert_eq!(idx.digest, sha256_digest(&idx.manifest));
    let m = json(&idx.manifest);
    assert_eq!(m["mediaType"], idx.media_type.as_str());
    let descs = m["manifests"].as_array().unwrap();
    assert_eq!(descs.len(), idx.children.len());
    for (d, child) in descs.iter().zip(&idx.children) {
        assert_eq!(d["mediaType"], child.media_type.as_str());
        assert_eq!(d["digest"], child.digest.as_str());
        assert_eq!(d["size"], child.manifest.len());
        assert_consistent(child);
    }
}

#[test]
fn fixtures_are_consistent_and_deterministic() {
    // Spin: the shared config is exactly the documented 78 bytes.
    assert_eq!(fixtures::SPIN_CONFIG.len(), 78);
    assert_eq!(
        sha256_digest(fixtures::SPIN_CONFIG),
        "sha256:aabedf0b094944b344cecbffcfa0a9172e905a5d156bdf67c4c6cbb6d27d1d92"
    );
    assert_eq!(
        sha256_digest(fixtures::EMPTY_CONFIG),
        "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    );
    let a = Image::spin("hello", 2, None);
    let b = Image::spin("goodbye", 2, Some(fixtures::SPIN_LOCKED_APP));
    for s in [&a, &b] {
        assert_consistent(s);
        assert_eq!(s.config.digest, fixtures::SPIN_CONFIG_DIGEST);
        assert_eq!(s.config.size(), 78);
        assert_eq!(s.config.media_type, fixtures::OCI_CONFIG);
        assert_eq!(s.layers[0].media_type, fixtures::SPIN_LOCKED_APP);
        assert_eq!(s.layers.len(), 3);
        for w in &s.layers[1..] {
            assert_eq!(w.media_type, fixtures::WASM_LAYER);
            assert!(w.bytes.starts_with(b"\0asm\x01\0\0\0"));
        }
        // The locked app names the wasm layers by digest.
        let locked = json(&s.layers[0].bytes);
        assert_eq!(
            locked["components"][1]["source"]["content"]["digest"],
            s.layers[2].digest.as_str()
        );
    }
    // Same image ID, different artifacts: the identity-collision case.
    assert_ne!(a.digest, b.digest);
    assert_ne!(a.layers[1].digest, b.layers[1].digest);
    assert_eq!(json(&b.manifest)["artifactType"], fixtures::SPIN_LOCKED_APP);
    assert!(json(&a.manifest).get("artifactType").is_none());

    let oci = Image::oci(3, 7);
    assert_consistent(&oci);
    assert_diff_ids(&oci, "amd64");
    assert_eq!(oci.layers[0].media_type, fixtures::OCI_LAYER_GZIP);
    assert_eq!(
        tar_list(&gunzip(&oci.layers[1].bytes)),
        ["etc/pinswap/layer-1.txt", "usr/share/pinswap/noise-1.bin"]
    );
    assert_bytes_eq(&Image::oci(3, 7).manifest, &oci.manifest, "deterministic");
    assert_ne!(Image::oci(3, 8).digest, oci.digest, "seed matters");

    let docker = Image::docker(2, 7);
    assert_consistent(&docker);
    assert_diff_ids(&docker, "amd64");
    assert_eq!(docker.config.media_type, fixtures::DOCKER_CONFIG);
    assert_eq!(docker.layers[0].media_type, fixtures::DOCKER_LAYER_GZIP);
    // Pretty-printed, Docker-style, so re-serialisation would show.
    assert!(docker.manifest.starts_with(b"{\n   \""));
    assert_ne!(
        serde_json::to_vec(&json(&docker.manifest)).unwrap(),
        docker.manifest
    );

    let idx = Index::oci(1, true);
    assert_index_consistent(&idx);
    let m = json(&idx.manifest);
    assert_eq!(m["manifests"][1]["platform"]["variant"], "v8");
    assert_eq!(m["manifests"][2]["platform"]["os"], "unknown");
    assert_eq!(
        m["manifests"][2]["annotations"]["vnd.docker.reference.digest"],
        idx.children[0].digest.as_str()
    );
    assert_diff_ids(&idx.children[1], "arm64");
    let list = Index::docker(1);
    assert_index_consistent(&list);
    assert_eq!(list.media_type, fixtures::DOCKER_LIST);

    let oras = Image::oras("application/vnd.example.sbom", "sbom.json", b"{\"sbom\":1}");
    assert_consistent(&oras);
    assert_eq!(oras.config.digest, fixtures::EMPTY_CONFIG_DIGEST);
    assert_eq!(oras.config.media_type, fixtures::OCI_EMPTY);
    let sig = Image::referrer(&oci.descriptor(), "application/vnd.example.sig", b"sig");
    assert_consistent(&sig);
    assert_eq!(
        json(&sig.manifest)["subject"]["digest"],
        oci.digest.as_str()
    );
    let helm = Image::helm("demo", "1.2.3");
    assert_consistent(&helm);
    assert_eq!(
        tar_list(&gunzip(&helm.layers[0].bytes)),
        ["demo/Chart.yaml"]
    );

    // In-memory and streamed random images agree, across a chunk boundary.
    let size = fixtures::RANDOM_CHUNK as u64 * 2 + 5;
    let mem = Image::random_layers(2, size, 42);
    let streamed = StreamedImage::random(2, size, 42);
    assert_consistent(&mem);
    assert_bytes_eq(&mem.manifest, &streamed.manifest, "random manifests");
    assert_eq!(mem.layers[0].size(), size);
    assert_ne!(mem.layers[0].bytes, mem.layers[1].bytes);
    let chunk = fixtures::RANDOM_CHUNK;
    assert_ne!(
        mem.layers[0].bytes[..chunk],
        mem.layers[0].bytes[chunk..2 * chunk]
    );
    assert_bytes_eq(
        &Image::random_layers(1, 100, 42).layers[0].bytes,
        &mem.layers[0].bytes[..100],
        "same seed, same stream, whatever the size",
    );
}

/// Push every fixture kind and read it all back byte for byte.
async fn roundtrip_all(reg: &TestRegistry) {
    let oci = Image::oci(3, 1);
    let docker = Image::docker(2, 2);
    let spin = Image::spin("hello", 2, Some(fixtures::SPIN_LOCKED_APP));
    let oras = Image::oras("application/vnd.example.sbom", "sbom.json", b"{}\n");
    let helm = Image::helm("demo", "0.1.0");
    let random = Image::random_layers(1, 300_000, 3);
    let sig = Image::referrer(&oci.descriptor(), "application/vnd.example.sig", b"sig");
    let images = [
        ("oci", "v1", &oci),
        ("docker", "v1", &docker),
        ("spin", "v1", &spin),
        ("oras", "v1", &oras),
        ("helm", "0.1.0", &helm),
        ("random", "v1", &random),
        ("oci", "sig", &sig),
    ];
    for (repo, tag, img) in images {
        push_image(reg, repo, Some(tag), img).await;
    }
    for (repo, tag, img) in images {
        for reference in [tag, img.digest.as_str()] {
            let (bytes, ct, digest) = reg.get_manifest(repo, reference).await.unwrap();
            assert_bytes_eq(&bytes, &img.manifest, &format!("{repo}:{reference}"));
            assert_eq!(ct, img.media_type, "{repo}:{reference}");
            assert_eq!(digest, img.digest, "{repo}:{reference}");
        }
        assert_eq!(reg.head_manifest(repo, tag).await.unwrap(), img.digest);
        for blob in img.blobs() {
            assert!(reg.blob_exists(repo, &blob.digest).await);
            let got = reg.blob(repo, &blob.digest).await.unwrap();
            assert_bytes_eq(&got, &blob.bytes, &blob.digest);
        }
    }

    let idx = Index::oci(4, true);
    let list = Index::docker(5);
    push_index(reg, "multi", Some("oci"), &idx).await;
    push_index(reg, "multi", Some("docker"), &list).await;
    for (tag, i) in [("oci", &idx), ("docker", &list)] {
        let (bytes, ct, digest) = reg.get_manifest("multi", tag).await.unwrap();
        assert_bytes_eq(&bytes, &i.manifest, tag);
        assert_eq!((ct, digest), (i.media_type.clone(), i.digest.clone()));
        for child in &i.children {
            let (bytes, _, _) = reg.get_manifest("multi", &child.digest).await.unwrap();
            assert_bytes_eq(&bytes, &child.manifest, &child.digest);
        }
    }

    assert_eq!(reg.tags("oci").await, ["sig", "v1"]);
    assert_eq!(reg.tags("multi").await, ["docker", "oci"]);
    assert!(reg.tags("nope").await.is_empty());
    assert_eq!(
        reg.catalog().await,
        ["docker", "helm", "multi", "oci", "oras", "random", "spin"]
    );
    assert!(reg.get_manifest("oci", "missing").await.is_none());
    assert!(reg.head_manifest("oci", "missing").await.is_none());
    assert!(reg.blob("oci", &sha256_digest(b"absent")).await.is_none());
    assert!(!reg.blob_exists("oci", &sha256_digest(b"absent")).await);
}

#[tokio::test]
async fn plain_registry_roundtrips_every_fixture() {
    let reg = TestRegistry::plain().await;
    assert!(!reg.is_tls());
    assert!(reg.base_url().starts_with("http://127.0.0.1:"));
    assert!(reg.storage_dir().is_dir());
    roundtrip_all(&reg).await;
}

#[tokio::test]
async fn tls_auth_registry_roundtrips_and_rejects_bad_credentials() {
    let reg = TestRegistry::tls_auth("alice", "s3cret").await;
    assert!(reg.is_tls());
    assert_eq!(reg.base_url(), format!("https://{}", reg.host()));
    assert!(reg.ca_pem_path().is_file());
    assert_eq!(
        (reg.username(), reg.password()),
        (Some("alice"), Some("s3cret"))
    );
    roundtrip_all(&reg).await;

    let url = format!("{}/v2/oci/manifests/v1", reg.base_url());
    let client = reg.http();
    let anonymous = client.get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let challenge = anonymous.headers()["www-authenticate"].to_str().unwrap();
    assert!(challenge.starts_with("Basic"), "{challenge}");
    let wrong = client
        .get(&url)
        .basic_auth("alice", Some("nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let right = reg.request(Method::GET, "/v2/").send().await.unwrap();
    assert_eq!(right.status(), StatusCode::OK);

    // The server certificate really is checked against the test CA.
    let untrusting = common::registry::http_client(None);
    assert!(untrusting.get(&url).send().await.is_err());
    let other = TestRegistry::tls_auth("bob", "x").await;
    let wrong_ca = common::registry::http_client(Some(&other.ca_pem_path()));
    assert!(wrong_ca.get(&url).send().await.is_err());
    let by_name = format!("https://localhost:{}/v2/", reg.port());
    assert_eq!(
        client.get(&by_name).send().await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn skopeo_sees_the_same_bytes_and_digests() {
    let plain = TestRegistry::plain().await;
    let tls = TestRegistry::tls_auth("alice", "s3cret").await;
    let oci = Image::oci(2, 11);
    let docker = Image::docker(2, 12);
    let spin = Image::spin("hello", 1, None);
    let idx = Index::oci(13, true);
    let list = Index::docker(14);
    for reg in [&plain, &tls] {
        push_image(reg, "oci", Some("v1"), &oci).await;
        push_image(reg, "docker", Some("v1"), &docker).await;
        push_image(reg, "spin", Some("v1"), &spin).await;
        push_index(reg, "idx", Some("v1"), &idx).await;
        push_index(reg, "list", Some("v1"), &list).await;
        for (repo, manifest, digest) in [
            ("oci", &oci.manifest, &oci.digest),
            ("docker", &docker.manifest, &docker.digest),
            ("spin", &spin.manifest, &spin.digest),
            ("idx", &idx.manifest, &idx.digest),
            ("list", &list.manifest, &list.digest),
        ] {
            let raw = skopeo::inspect_raw(reg, repo, "v1").await;
            assert_bytes_eq(&raw, manifest, repo);
            let raw = skopeo::inspect_raw(reg, repo, digest).await;
            assert_bytes_eq(&raw, manifest, repo);
            assert_eq!(
                &skopeo::inspect_digest(reg, repo, "v1").await,
                digest,
                "{repo}"
            );
        }
    }

    // skopeo copy between the two registries preserves every byte.
    let dst = TestRegistry::plain().await;
    skopeo::copy(
        &Loc::reg(&tls, "docker", "v1"),
        &Loc::reg(&dst, "copied/docker", "v1"),
        &["--preserve-digests"],
    )
    .await
    .unwrap();
    let (bytes, ct, _) = dst.get_manifest("copied/docker", "v1").await.unwrap();
    assert_bytes_eq(&bytes, &docker.manifest, "skopeo-copied docker image");
    assert_eq!(ct, docker.media_type);
    skopeo::copy(
        &Loc::reg(&plain, "idx", "v1"),
        &Loc::reg(&dst, "copied/idx", "v1"),
        &["--all", "--preserve-digests"],
    )
    .await
    .unwrap();
    assert_eq!(
        dst.head_manifest("copied/idx", "v1").await.unwrap(),
        idx.digest
    );
    for child in &idx.children {
        let (bytes, _, _) = dst.get_manifest("copied/idx", &child.digest).await.unwrap();
        assert_bytes_eq(&bytes, &child.manifest, &child.digest);
    }
    // A failing copy is reported as Err.
    let err = skopeo::copy(
        &Loc::reg(&plain, "nope", "v1"),
        &Loc::reg(&dst, "nope", "v1"),
        &[],
    )
    .await
    .unwrap_err();
    assert!(err.contains("nope"), "{err}");
}

#[tokio::test]
async fn corrupt_blob_and_delete_manifest() {
    let reg = TestRegistry::plain().await;
    let img = Image::oci(2, 21);
    push_image(&reg, "app", Some("v1"), &img).await;

    let layer = &img.layers[0];
    assert!(reg.blob_data_path(&layer.digest).is_file());
    reg.corrupt_blob(&layer.digest, b"not the layer you pushed");
    assert_eq!(
        reg.blob("app", &layer.digest).await.unwrap(),
        b"not the layer you pushed"
    );

    reg.delete_manifest("app", &img.digest).await;
    assert_eq!(reg.head_manifest("app", &img.digest).await, None);
    assert_eq!(reg.head_manifest("app", "v1").await, None);
    assert!(reg.get_manifest("app", "v1").await.is_none());
    // Blobs stay until garbage collection.
    assert!(reg.blob_exists("app", &img.config.digest).await);
}

#[tokio::test]
async fn streamed_push_matches_in_memory_fixture() {
    let reg = TestRegistry::plain().await;
    let size = fixtures::RANDOM_CHUNK as u64 + 12_345;
    let streamed = StreamedImage::random(2, size, 99);
    common::push_streamed_image(&reg, "big", Some("v1"), &streamed).await;
    let mem = Image::random_layers(2, size, 99);
    let (bytes, _, _) = reg.get_manifest("big", "v1").await.unwrap();
    assert_bytes_eq(&bytes, &mem.manifest, "big manifest");
    for layer in &mem.layers {
        let got = reg.blob("big", &layer.digest).await.unwrap();
        assert_bytes_eq(&got, &layer.bytes, &layer.digest);
    }
}

#[tokio::test]
async fn proxy_forwards_then_cuts() {
    let reg = TestRegistry::plain().await;
    let img = Image::random_layers(1, 8 << 20, 31);
    push_image(&reg, "app", Some("v1"), &img).await;
    let layer = &img.layers[0];

    let client = common::registry::http_client(None);
    let proxy = TcpCutProxy::start(&reg.host()).await;
    let blob_url = format!("http://{}/v2/app/blobs/{}", proxy.host(), layer.digest);
    let full = client
        .get(&blob_url)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_bytes_eq(&full, &layer.bytes, "blob through the proxy");
    assert!(proxy.bytes_down() > layer.size());

    // cut() kills a transfer in flight and refuses new connections.
    let mut resp = client.get(&blob_url).send().await.unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    proxy.cut();
    assert!(proxy.is_cut());
    let mut got = first.len();
    let rest = loop {
        match resp.chunk().await {
            Ok(Some(c)) => got += c.len(),
            other => break other,
        }
    };
    assert!(
        rest.is_err(),
        "transfer should fail after cut, got {got} bytes"
    );
    assert!(got < layer.bytes.len());
    let refused = client
        .get(format!("http://{}/v2/", proxy.host()))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(refused.unwrap_err().is_connect());
    // The registry itself is fine.
    assert!(reg.blob_exists("app", &layer.digest).await);

    // cut_after_bytes lets exactly n bytes through, then cuts.
    let proxy = TcpCutProxy::start(&reg.host()).await;
    let limit = 1_000_000;
    proxy.cut_after_bytes(limit);
    let url = format!("http://{}/v2/app/blobs/{}", proxy.host(), layer.digest);
    let result = async { client.get(&url).send().await?.bytes().await }.await;
    assert!(result.is_err(), "an 8 MiB blob cannot pass a 1 MB cut");
    assert_eq!(proxy.bytes_down(), limit);
    assert!(proxy.is_cut());
}

#[tokio::test]
async fn front_counts_requests_in_flight_until_their_bodies_end() {
    let reg = TestRegistry::plain().await;
    let img = Image::oci(1, 32);
    push_image(&reg, "app", Some("v1"), &img).await;
    let layer = img.layers[0].clone();
    let front = common::front::Front::start(&reg.host()).await;
    let client = common::registry::http_client(None);
    let url = format!("http://{}/v2/app/blobs/{}", front.host(), layer.digest);
    let get = |client: reqwest::Client, url: String| async move {
        client.get(url).send().await.unwrap().bytes().await.unwrap()
    };
    // One after another: never two at once.
    for _ in 0..3 {
        assert_bytes_eq(
            &get(client.clone(), url.clone()).await,
            &layer.bytes,
            "blob",
        );
    }
    assert_eq!(front.max_concurrent("GET", "/blobs/"), 1);
    // Three held by a frozen registry are in flight together.
    reg.freeze();
    let held: Vec<_> = (0..3)
        .map(|_| tokio::spawn(get(client.clone(), url.clone())))
        .collect();
    while front.count_method("GET", "/blobs/") < 6 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(front.max_concurrent("GET", "/blobs/"), 3);
    assert_eq!(front.max_concurrent("HEAD", "/blobs/"), 0);
    reg.thaw();
    for h in held {
        assert_bytes_eq(&h.await.unwrap(), &layer.bytes, "held blob");
    }
    // Once they ended, one more does not overlap them.
    get(client.clone(), url.clone()).await;
    assert_eq!(front.max_concurrent("GET", "/blobs/"), 3);
    assert_eq!(front.max_concurrent("*", "/blobs/"), 3);
}

#[tokio::test]
async fn kill_and_restart_keep_content_and_port() {
    let mut reg = TestRegistry::plain().await;
    let img = Image::docker(1, 41);
    push_image(&reg, "app", Some("v1"), &img).await;
    let host = reg.host();

    reg.kill();
    let down = reg
        .request(Method::GET, "/v2/")
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(down.is_err(), "registry still answering after kill");

    reg.restart().await;
    assert_eq!(reg.host(), host);
    let (bytes, _, digest) = reg.get_manifest("app", "v1").await.unwrap();
    assert_bytes_eq(&bytes, &img.manifest, "manifest after restart");
    assert_eq!(digest, img.digest);
    let layer = &img.layers[0];
    let got = reg.blob("app", &layer.digest).await.unwrap();
    assert_bytes_eq(&got, &layer.bytes, "layer after restart");
    assert!(!reg.log().contains("panic"), "{}", reg.log());
}

#[test]
fn pinswap_bin_is_built() {
    assert!(common::pinswap_bin().is_file());
}

/// `(header, claims)` of a compact JWT, unverified.
fn jwt_parts(token: &str) -> (Value, Value) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "not a compact JWT: {token}");
    let part = |i: usize| json(&b64.decode(parts[i]).unwrap());
    (part(0), part(1))
}

#[tokio::test]
async fn token_registry_roundtrips_and_enforces_token_scopes() {
    use common::token::{self, Access, TokenServer};
    let reg = TestRegistry::token_auth("alice", "s3cret").await;
    assert!(!reg.is_tls());
    roundtrip_all(&reg).await;
    let server = reg.token_server();
    assert_eq!(
        server.requests(),
        0,
        "harness helpers mint their own tokens"
    );

    // The registry challenges with our realm, service and the scope it needs.
    let client = reg.http();
    let url = format!("{}/v2/oci/manifests/v1", reg.base_url());
    let accept = common::registry::MANIFEST_ACCEPT;
    let anonymous = client
        .get(&url)
        .header("accept", accept)
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let challenge = anonymous.headers()["www-authenticate"].to_str().unwrap();
    for want in [
        "Bearer ".to_owned(),
        format!("realm=\"{}\"", server.realm()),
        format!("service=\"{}\"", token::SERVICE),
        "scope=\"repository:oci:pull\"".to_owned(),
    ] {
        assert!(challenge.contains(&want), "{want} not in {challenge}");
    }

    // The realm: basic credentials in, a token for exactly the scopes out.
    let ask = |creds: Option<(&str, &str)>, scopes: &[&str]| {
        let mut q = vec![("service", token::SERVICE)];
        q.extend(scopes.iter().map(|s| ("scope", *s)));
        let rb = client.get(server.realm()).query(&q);
        match creds {
            Some((u, p)) => rb.basic_auth(u, Some(p)),
            None => rb,
        }
        .send()
    };
    let pull = ["repository:oci:pull"];
    let wrong = ask(Some(("alice", "nope")), &pull).await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let missing = ask(None, &pull).await.unwrap();
    assert_eq!(missing.status(), StatusCode::UNAUTHORIZED);
    assert_eq!((server.requests(), server.denied()), (2, 2));
    let resp = ask(Some(("alice", "s3cret")), &pull).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.unwrap();
    let tok = body["token"].as_str().unwrap().to_owned();
    let (header, claims) = jwt_parts(&tok);
    assert_eq!(header["alg"], "ES256");
    assert_eq!(header["typ"], "JWT");
    assert_eq!(header["x5c"].as_array().unwrap().len(), 1);
    assert_eq!(claims["aud"], token::SERVICE);
    assert_eq!(claims["iss"], token::ISSUER);
    assert_eq!(claims["sub"], "alice");
    assert_eq!(
        claims["access"],
        serde_json::json!([{"type": "repository", "name": "oci", "actions": ["pull"]}])
    );
    assert_eq!(server.granted_scopes(), pull);
    let log = server.log();
    assert_eq!(log[2].service.as_deref(), Some(token::SERVICE));
    assert_eq!(log[0].user.as_deref(), Some("alice"));

    // Distribution accepts it for what it grants, and only that.
    let status = |rb: reqwest::RequestBuilder| async move { rb.send().await.unwrap().status() };
    let (oci, _, _) = reg.get_manifest("oci", "v1").await.unwrap();
    let got = client
        .get(&url)
        .header("accept", accept)
        .bearer_auth(&tok)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), StatusCode::OK);
    assert_bytes_eq(&got.bytes().await.unwrap(), &oci, "oci:v1 with a token");
    let other = format!("{}/v2/docker/manifests/v1", reg.base_url());
    let upload = format!("{}/v2/oci/blobs/uploads/", reg.base_url());
    assert_eq!(
        status(client.get(&other).bearer_auth(&tok)).await,
        StatusCode::UNAUTHORIZED,
        "pull on oci is not pull on docker"
    );
    assert_eq!(
        status(client.post(&upload).bearer_auth(&tok)).await,
        StatusCode::UNAUTHORIZED,
        "pull is not push"
    );

    // Several scopes in one request; each is granted.
    let both = ask(
        Some(("alice", "s3cret")),
        &["repository:oci:pull,push", "repository:docker:pull"],
    )
    .await
    .unwrap();
    let tok2 = both.json::<Value>().await.unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        status(client.get(&other).bearer_auth(&tok2)).await,
        StatusCode::OK
    );
    assert_eq!(
        status(client.post(&upload).bearer_auth(&tok2)).await,
        StatusCode::ACCEPTED
    );

    // A token signed by a key the registry does not trust is refused.
    let stranger = TokenServer::start("alice", "s3cret").await;
    let forged = stranger.mint("alice", &[Access::repository("oci", &["pull"])]);
    assert_eq!(
        status(client.get(&url).bearer_auth(&forged)).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        Access::parse("repository:127.0.0.1:5000/a/b:pull,push"),
        Some(Access::repository("127.0.0.1:5000/a/b", &["pull", "push"]))
    );
    assert_eq!(Access::parse("repository:nope"), None);
}

/// A restart whose port is briefly held by someone else (another test's
/// free-port probe) retries, as a first start does, and keeps the storage.
#[tokio::test]
async fn a_restart_waits_out_a_port_held_for_a_moment() {
    let mut reg = TestRegistry::plain().await;
    let img = Image::oci(1, 3301);
    push_image(&reg, "held/app", Some("v1"), &img).await;
    reg.kill();
    let holder = std::net::TcpListener::bind(("127.0.0.1", reg.port())).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        drop(holder);
    });
    reg.restart().await;
    release.join().unwrap();
    assert!(
        reg.log().contains("address already in use"),
        "the first try met the held port: {}",
        reg.log()
    );
    assert_eq!(
        reg.head_manifest("held/app", "v1").await.as_deref(),
        Some(img.digest.as_str())
    );
}
