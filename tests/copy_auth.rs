//! `pinswap copy`'s credentials: TLS, basic auth from flags, auth files,
//! Docker configs, credential helpers and the environment, bearer tokens,
//! and each registry's credentials sent to that registry alone.

mod common;

use common::cli::{pinswap, pinswap_env};
use common::copying::*;
use common::fixtures::Image;
use common::{TestRegistry, pinswap_bin, push_image};

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
    out.says("credential helper docker-credential-pinswaptest failed: token expired");
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
    out.says(format!("cannot reach registry {}", dst.host()));
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
    out.says(format!("registry {} rejected our credentials", dst.host()));
    out.says("401");
    out.says("app");
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
    out.says(&want);
    out.says("no credentials were found");
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
