//! Amazon ECR targets (`target.aws`) against moto as the ECR, STS and IAM
//! API and a real Distribution registry as the data plane: repositories
//! created with every `ecrOptions` field (read back from moto), once under
//! concurrent first pushes; the registry token fetched, used and renewed;
//! `role` assumed through STS; permission errors naming the IAM action; a
//! converted k8s-image-swapper config mirroring an image end to end; and
//! only repositories pinswap made reconciled with `ecrOptions`, none when
//! their tags cannot be read.
//! Nothing here reaches an AWS host or the instance metadata address.

mod common;

use std::sync::Arc;

use aws_sdk_ecr::types::{EncryptionType, ImageTagMutability};
use common::front::{Front, Mode};
use common::moto::{ACCOUNT, MotoServer, xml_field};
use common::{Image, TestRegistry, push_image};
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::mirror::Mirror;
use pinswap::reference::Reference;
use pinswap::registry::copy::{Copier, CopyOptions, Endpoint};
use pinswap::registry::ecr::Ecr;
use pinswap::registry::{ClientPool, PoolOptions};

/// moto's registry password for `ACCOUNT` (fixed by moto).
fn moto_token() -> String {
    format!("{ACCOUNT}-auth-token")
}

const ACCESS_POLICY: &str = r#"{"Version":"2008-10-17","Statement":[{"Sid":"OrgPull","Effect":"Allow","Principal":{"AWS":"*"},"Action":["ecr:BatchGetImage","ecr:GetDownloadUrlForLayer"]}]}"#;
const LIFECYCLE_POLICY: &str = r#"{"rules":[{"rulePriority":1,"description":"keep 500","selection":{"tagStatus":"any","countType":"imageCountMoreThan","countNumber":500},"action":{"type":"expire"}}]}"#;
const KMS_KEY: &str = "arn:aws:kms:eu-west-1:123456789012:key/0a1b2c3d-4e5f-6789-abcd-ef0123456789";

fn config(target: &str, extra: &str) -> Config {
    let y = format!(
        "target:\n  registry: \"{target}\"\n  aws:\n    accountId: \"{ACCOUNT}\"\n    region: eu-west-1\n    prefix: /cache\n{extra}source: {{registries: [{{registry: \"*\"}}]}}\n"
    );
    Config::from_yaml(&y, "ecr.yaml").unwrap_or_else(|e| panic!("{e}\n{y}"))
}

fn options_yaml() -> String {
    format!(
        "    ecrOptions:\n      accessPolicy: '{ACCESS_POLICY}'\n      lifecyclePolicy: '{LIFECYCLE_POLICY}'\n      tags: [{{key: CreatedBy, value: pinswap}}, {{key: team, value: platform}}]\n      imageTagMutability: IMMUTABLE\n      imageScanningConfiguration: {{imageScanOnPush: false}}\n      encryptionConfiguration: {{encryptionType: KMS, kmsKey: \"{KMS_KEY}\"}}\n"
    )
}

/// Every ecrOptions field is applied to the repository pinswap creates
/// (read back from moto), and 20 concurrent first pushes into one
/// repository describe and create it once; every push lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repository_created_once_with_every_option() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("AWS", &moto_token()).await;
    let cfg = config(&dst.host(), &options_yaml());
    assert_eq!(cfg.target.registry, format!("{}/cache", dst.host()));
    let aws = cfg.target.aws.clone().unwrap();
    let ecr =
        Arc::new(Ecr::connect_with(&aws, &dst.host(), moto.sdk("testing", "testing").await).await);
    let token = ecr.authorization().await.unwrap();
    assert_eq!(token.username, "AWS");

    let pool = Arc::new(ClientPool::new(PoolOptions {
        target_creds: Some(token),
        ..PoolOptions::default()
    }));
    let copier = Arc::new(Copier::new(pool, CopyOptions::default()).with_before_push(ecr.clone()));
    let img = Image::oci(1, 7001);
    push_image(&src, "team/app", Some("v1"), &img).await;
    let from = Reference::parse(&format!("{}/team/app:v1", src.host())).unwrap();
    let copies = (0..20).map(|i| {
        let (copier, from) = (copier.clone(), from.clone());
        let to = Reference::parse(&format!("{}/cache/team/app:t{i}", dst.host())).unwrap();
        tokio::spawn(async move {
            copier
                .copy(&Endpoint::Registry(from), &Endpoint::Registry(to))
                .await
        })
    });
    for r in futures::future::join_all(copies).await {
        r.unwrap().unwrap();
    }
    let stats = ecr.stats();
    assert_eq!((stats.describes, stats.creates), (1, 1), "{stats:?}");
    let mut tags = dst.tags("cache/team/app").await;
    tags.sort();
    assert_eq!(tags.len(), 20, "{tags:?}");
    // Later pushes into a known repository ask AWS nothing.
    copier
        .copy(
            &Endpoint::Registry(from.clone()),
            &Endpoint::Registry(
                Reference::parse(&format!("{}/cache/team/app:later", dst.host())).unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ecr.stats().describes, 1);

    // Read back from moto.
    let client = aws_sdk_ecr::Client::new(&moto.sdk("testing", "testing").await);
    let repos = client.describe_repositories().send().await.unwrap();
    let names: Vec<&str> = repos
        .repositories()
        .iter()
        .filter_map(|r| r.repository_name())
        .collect();
    assert_eq!(names, ["cache/team/app"]);
    let repo = &repos.repositories()[0];
    assert_eq!(
        repo.image_tag_mutability(),
        Some(&ImageTagMutability::Immutable)
    );
    assert_eq!(
        repo.image_scanning_configuration()
            .map(|s| s.scan_on_push()),
        Some(false)
    );
    let enc = repo.encryption_configuration().unwrap();
    assert_eq!(enc.encryption_type(), &EncryptionType::Kms);
    assert_eq!(enc.kms_key(), Some(KMS_KEY));
    let tags = client
        .list_tags_for_resource()
        .resource_arn(repo.repository_arn().unwrap())
        .send()
        .await
        .unwrap();
    let tags: Vec<(&str, &str)> = tags.tags().iter().map(|t| (t.key(), t.value())).collect();
    assert_eq!(
        tags,
        [
            ("CreatedBy", "pinswap"),
            ("team", "platform"),
            pinswap::registry::ecr::MANAGED_BY
        ]
    );
    let policy = client
        .get_repository_policy()
        .repository_name("cache/team/app")
        .send()
        .await
        .unwrap();
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    assert_eq!(json(policy.policy_text().unwrap()), json(ACCESS_POLICY));
    let lifecycle = client
        .get_lifecycle_policy()
        .repository_name("cache/team/app")
        .send()
        .await
        .unwrap();
    assert_eq!(
        json(lifecycle.lifecycle_policy_text().unwrap()),
        json(LIFECYCLE_POLICY)
    );

    // A repository created by someone else in the meantime counts as
    // created (RepositoryAlreadyExistsException), and one that exists is
    // only described.
    client
        .create_repository()
        .repository_name("cache/other")
        .send()
        .await
        .unwrap();
    ecr.ensure_repository("cache/other").await.unwrap();
    assert_eq!(ecr.stats().creates, 1, "described, not created");
}

/// SetRepositoryPolicy failing after CreateRepository succeeded (refused
/// once by a front before moto): that push fails naming the action, and
/// the next one, which finds the repository, applies both policies before
/// it goes on. Failures are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_that_fail_after_the_create_are_applied_before_the_next_push() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let front = Front::start(moto.endpoint().trim_start_matches("http://")).await;
    let sdk = pinswap::registry::ecr::sdk_loader(common::moto::REGION)
        .credentials_provider(aws_credential_types::Credentials::new(
            "testing", "testing", None, None, "test",
        ))
        .endpoint_url(format!("http://{}", front.host()))
        .load()
        .await;
    let host = "127.0.0.1:5999";
    let aws = config(host, &options_yaml()).target.aws.unwrap();
    let metrics = Arc::new(Metrics::new());
    let ecr = Ecr::connect_with(&aws, host, sdk)
        .await
        .with_metrics(metrics.clone());
    front.set(Mode::RefuseFirst(
        "POST",
        "AmazonEC2ContainerRegistry_V20150921.SetRepositoryPolicy",
        400,
        None,
    ));
    let repo = "cache/team/app";
    let e = ecr.ensure_repository(repo).await.unwrap_err().to_string();
    assert!(
        e.starts_with("ecr:SetRepositoryPolicy on repository cache/team/app failed"),
        "{e}"
    );
    let client = aws_sdk_ecr::Client::new(&moto.sdk("testing", "testing").await);
    let policy = || client.get_repository_policy().repository_name(repo).send();
    assert!(policy().await.is_err(), "no policy yet");
    ecr.ensure_repository(repo)
        .await
        .expect("the policies are applied now");
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    assert_eq!(
        json(policy().await.unwrap().policy_text().unwrap()),
        json(ACCESS_POLICY)
    );
    let lifecycle = client
        .get_lifecycle_policy()
        .repository_name(repo)
        .send()
        .await
        .unwrap();
    assert_eq!(
        json(lifecycle.lifecycle_policy_text().unwrap()),
        json(LIFECYCLE_POLICY)
    );
    let stats = ecr.stats();
    assert_eq!(
        (stats.creates, stats.describes, stats.policy_failures),
        (1, 2, 1),
        "{stats:?}"
    );
    assert!(
        metrics
            .encode()
            .contains("pinswap_ecr_policy_failures_total{action=\"ecr:SetRepositoryPolicy\"} 1"),
        "{}",
        metrics.encode()
    );
    // Configured and remembered: nothing more is asked.
    let asked = front.total();
    ecr.ensure_repository(repo).await.unwrap();
    assert_eq!(front.total(), asked);
}

/// The mirror signs in with the token from GetAuthorizationToken (the
/// registry's token server sees user AWS), and `refresh_credentials`
/// fetches a new one once the old one is half-way to expiry (moto's tokens
/// are already expired, so every refresh renews); the mirror keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_is_used_and_renewed() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("AWS", &moto_token()).await;
    let cfg = config(&dst.host(), "");
    let mirror = Mirror::connect_with(
        &cfg,
        Arc::new(Metrics::new()),
        moto.sdk("testing", "testing").await,
    )
    .await
    .unwrap();
    let ecr = mirror.ecr().unwrap().clone();
    assert_eq!(ecr.stats().tokens, 1);
    let img = Image::oci(1, 7002);
    push_image(&src, "lib/web", Some("1.0"), &img).await;
    let target = Reference::parse(&format!(
        "{}/cache/127.0.0.1_{}/lib/web:1.0@{}",
        dst.host(),
        src.port(),
        img.digest
    ))
    .unwrap();
    assert!(!mirror.head_target(&target).await.unwrap());
    assert!(
        dst.token_server()
            .log()
            .iter()
            .any(|t| t.granted && t.user.as_deref() == Some("AWS")),
        "{:?}",
        dst.token_server().log()
    );
    // Renewal: fetched again, same token from moto, so nothing changes.
    assert_eq!(mirror.refresh_credentials().await, 0);
    assert_eq!(ecr.stats().tokens, 2);
    assert!(ecr.token_due(std::time::SystemTime::now()));
    assert!(!mirror.head_target(&target).await.unwrap());
}

/// IAM enforced by moto: a user that may only sign in and describe gets an
/// error naming ecr:CreateRepository and the repository (never its secret
/// key); with `role` (which may do everything) assumed through STS, the
/// same user creates the repository.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_errors_name_the_action_and_role_is_assumed() {
    let Some(moto) = MotoServer::enforcing(5).await else {
        return;
    };
    moto.iam(&[("Action", "CreateUser"), ("UserName", "limited")])
        .await;
    let key = moto
        .iam(&[("Action", "CreateAccessKey"), ("UserName", "limited")])
        .await;
    let (id, secret) = (
        xml_field(&key, "AccessKeyId"),
        xml_field(&key, "SecretAccessKey"),
    );
    let user_policy = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["ecr:GetAuthorizationToken","ecr:DescribeRepositories","sts:AssumeRole"],"Resource":"*"}]}"#;
    moto.iam(&[
        ("Action", "PutUserPolicy"),
        ("UserName", "limited"),
        ("PolicyName", "sign-in-only"),
        ("PolicyDocument", user_policy),
    ])
    .await;
    let trust = format!(
        r#"{{"Version":"2012-10-17","Statement":[{{"Effect":"Allow","Principal":{{"AWS":"arn:aws:iam::{ACCOUNT}:user/limited"}},"Action":"sts:AssumeRole"}}]}}"#
    );
    moto.iam(&[
        ("Action", "CreateRole"),
        ("RoleName", "pinswap-mirror"),
        ("AssumeRolePolicyDocument", &trust),
    ])
    .await;
    moto.iam(&[
        ("Action", "PutRolePolicy"),
        ("RoleName", "pinswap-mirror"),
        ("PolicyName", "ecr"),
        (
            "PolicyDocument",
            r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"ecr:*","Resource":"*"}]}"#,
        ),
    ])
    .await;

    let host = "127.0.0.1:5999";
    let mut aws = config(host, "").target.aws.unwrap();
    let ecr = Ecr::connect_with(&aws, host, moto.sdk(&id, &secret).await).await;
    ecr.authorization().await.expect("allowed to sign in");
    let e = ecr
        .ensure_repository("cache/docker.io/library/nginx")
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            "missing IAM permission ecr:CreateRepository on repository cache/docker.io/library/nginx: AccessDenied"
        ),
        "{text}"
    );
    assert!(!text.contains(&secret), "secret key in {text}");

    aws.role = Some(format!("arn:aws:iam::{ACCOUNT}:role/pinswap-mirror"));
    let ecr = Ecr::connect_with(&aws, host, moto.sdk(&id, &secret).await).await;
    ecr.ensure_repository("cache/docker.io/library/nginx")
        .await
        .expect("created with the role's permissions");
    assert_eq!(ecr.stats().creates, 1);
}

/// Done as a user would: k8s-image-swapper's production-style ECR config
/// (role, policies, tags, immutable tags, KMS), converted, pointed at moto
/// and a local registry, then `pinswap mutate` with AWS credentials from
/// the environment mirrors an image into a repository it created with the
/// same options.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converted_config_mirrors_into_a_created_repository() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("AWS", &moto_token()).await;
    let img = Image::oci(2, 7003);
    push_image(&src, "shop/app", Some("v1"), &img).await;

    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/k8s-image-swapper");
    let (code, converted, stderr) =
        common::run_pinswap(&["config", "convert", &format!("{data}/ecr-production.yaml")]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("not carried over: target"), "{stderr}");
    // The data plane is the local registry; everything else as converted.
    let ecr_host = "\"123456789012.dkr.ecr.eu-west-1.amazonaws.com\"";
    assert!(converted.contains(&format!("registry: {ecr_host}")));
    // The source is on loopback, which `"*"` never lets in: it is named,
    // as a private registry must be.
    let cfg = converted
        .replace(
            &format!("registry: {ecr_host}"),
            &format!("registry: \"{}\"", dst.host()),
        )
        .replace(
            "    - registry: \"*\"\n",
            &format!(
                "    - registry: \"*\"\n    - registry: \"{}\"\n",
                src.host()
            ),
        );
    assert!(cfg.contains(&src.host()), "{cfg}");
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("pinswap.yaml");
    std::fs::write(&cfg_path, &cfg).unwrap();
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: shop}}\nspec:\n  containers: [{{name: c, image: \"{}/shop/app:v1\"}}]\n",
        src.host()
    );
    let pod_path = dir.path().join("pod.yaml");
    std::fs::write(&pod_path, pod).unwrap();
    let out = tokio::process::Command::new(common::pinswap_bin())
        .args(["mutate", "-c"])
        .arg(&cfg_path)
        .arg("-f")
        .arg(&pod_path)
        .envs(moto.env())
        .env("DOCKER_CONFIG", "/nonexistent-pinswap-test")
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    let repo = format!("127.0.0.1_{}/shop/app", src.port());
    let want = format!("{}/{repo}:v1@{}", dst.host(), img.digest);
    assert!(stdout.contains(&want), "{stdout}\n{stderr}");
    let (bytes, _, _) = dst
        .get_manifest(&repo, &img.digest)
        .await
        .expect("mirrored");
    assert!(bytes == img.manifest);

    let client = aws_sdk_ecr::Client::new(&moto.sdk("testing", "testing").await);
    let repos = client
        .describe_repositories()
        .repository_names(&repo)
        .send()
        .await
        .unwrap();
    let r = &repos.repositories()[0];
    assert_eq!(
        r.image_tag_mutability(),
        Some(&ImageTagMutability::Immutable)
    );
    let enc = r.encryption_configuration().unwrap();
    assert_eq!(enc.encryption_type(), &EncryptionType::Kms);
    assert!(
        enc.kms_key()
            .unwrap()
            .ends_with("key/0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    );
    let policy = client
        .get_repository_policy()
        .repository_name(&repo)
        .send()
        .await
        .unwrap();
    assert!(
        policy
            .policy_text()
            .unwrap()
            .contains("AllowOrganisationPull")
    );
    let lifecycle = client
        .get_lifecycle_policy()
        .repository_name(&repo)
        .send()
        .await
        .unwrap();
    assert!(
        lifecycle
            .lifecycle_policy_text()
            .unwrap()
            .contains("keep the last 500 images")
    );
    let tags = client
        .list_tags_for_resource()
        .resource_arn(r.repository_arn().unwrap())
        .send()
        .await
        .unwrap();
    assert!(
        tags.tags()
            .iter()
            .any(|t| t.key() == "cost-centre" && t.value() == "platform")
    );
}

/// Retention's ECR calls against moto: the repositories pinswap created
/// are listed with DescribeRepositories, and BatchDeleteImage (tags, then
/// the digest) removes the image, read back with ListImages. moto drops an
/// image with its last tag, so the order itself is not observable here.
#[tokio::test]
async fn retention_lists_repositories_and_deletes_tags_then_the_digest() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let cfg = config("", "");
    let aws = cfg.target.aws.clone().unwrap();
    let host = cfg.target.registry.split('/').next().unwrap().to_owned();
    let ecr = Ecr::connect_with(&aws, &host, moto.sdk("testing", "testing").await).await;
    let repo = "cache/docker.io/library/app";
    ecr.ensure_repository(repo).await.unwrap();
    let client = aws_sdk_ecr::Client::new(&moto.sdk("testing", "testing").await);
    let img = Image::oci(1, 7301);
    let put = |tag: &'static str| {
        client
            .put_image()
            .repository_name(repo)
            .image_manifest(String::from_utf8(img.manifest.clone()).unwrap())
            .image_manifest_media_type(&img.media_type)
            .image_tag(tag)
            .send()
    };
    put("v1").await.unwrap();
    put("pinswap-keep").await.unwrap();
    assert!(ecr.repositories().await.unwrap().contains(&repo.to_owned()));
    let images = || async {
        let listed = client
            .list_images()
            .repository_name(repo)
            .send()
            .await
            .unwrap();
        listed
            .image_ids()
            .iter()
            .map(|i| {
                (
                    i.image_tag().map(str::to_owned),
                    i.image_digest().map(str::to_owned),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(images().await.len(), 2, "{:?}", images().await);
    let digest = pinswap::reference::Digest::parse(&img.digest).unwrap();
    ecr.delete_image(repo, &["v1".to_owned(), "pinswap-keep".to_owned()], &digest)
        .await
        .unwrap();
    assert_eq!(images().await, Vec::new());
    // Already gone: no failure.
    ecr.delete_image(repo, &["v1".to_owned()], &digest)
        .await
        .unwrap();
}

/// A lifecycle policy that expires all but one image.
const EXPIRE_ALL_BUT_ONE: &str = r#"{"rules":[{"rulePriority":1,"description":"expire all but 1","selection":{"tagStatus":"any","countType":"imageCountMoreThan","countNumber":1},"action":{"type":"expire"}}]}"#;
/// Another owner's access and lifecycle policies.
const THEIR_POLICY: &str = r#"{"Version":"2008-10-17","Statement":[{"Sid":"TeamPush","Effect":"Allow","Principal":{"AWS":"arn:aws:iam::123456789012:root"},"Action":["ecr:PutImage"]}]}"#;
const THEIR_LIFECYCLE: &str = r#"{"rules":[{"rulePriority":1,"description":"keep 1000","selection":{"tagStatus":"any","countType":"imageCountMoreThan","countNumber":1000},"action":{"type":"expire"}}]}"#;

/// `target.aws` with `prefix` (none when `None`) and these `ecrOptions`
/// lines.
fn aws_block(prefix: Option<&str>, options: &str) -> pinswap::config::Aws {
    let prefix = prefix
        .map(|p| format!("    prefix: {p}\n"))
        .unwrap_or_default();
    let y = format!(
        "target:\n  registry: \"127.0.0.1:5999\"\n  aws:\n    accountId: \"{ACCOUNT}\"\n    region: eu-west-1\n{prefix}{options}source: {{registries: [{{registry: \"*\"}}]}}\n"
    );
    Config::from_yaml(&y, "ecr.yaml")
        .unwrap_or_else(|e| panic!("{e}\n{y}"))
        .target
        .aws
        .unwrap()
}

/// ecrOptions unlike anything the repositories below were made with:
/// MUTABLE, all but one image expired, an access policy.
fn expire_all_but_one() -> String {
    format!(
        "    ecrOptions:\n      imageTagMutability: MUTABLE\n      lifecyclePolicy: '{EXPIRE_ALL_BUT_ONE}'\n      accessPolicy: '{ACCESS_POLICY}'\n"
    )
}

/// A repository's settings as moto has them.
#[derive(Debug, PartialEq)]
struct Settings {
    mutability: Option<ImageTagMutability>,
    scan_on_push: Option<bool>,
    access_policy: Option<serde_json::Value>,
    lifecycle_policy: Option<serde_json::Value>,
}

async fn settings(client: &aws_sdk_ecr::Client, repo: &str) -> Settings {
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    let d = client
        .describe_repositories()
        .repository_names(repo)
        .send()
        .await
        .unwrap();
    let r = &d.repositories()[0];
    Settings {
        mutability: r.image_tag_mutability().cloned(),
        scan_on_push: r.image_scanning_configuration().map(|c| c.scan_on_push()),
        access_policy: client
            .get_repository_policy()
            .repository_name(repo)
            .send()
            .await
            .ok()
            .and_then(|p| p.policy_text().map(json)),
        lifecycle_policy: client
            .get_lifecycle_policy()
            .repository_name(repo)
            .send()
            .await
            .ok()
            .and_then(|p| p.lifecycle_policy_text().map(json)),
    }
}

/// Another team's repository, made directly through the API: IMMUTABLE,
/// with its own access and lifecycle policies.
async fn create_theirs(client: &aws_sdk_ecr::Client, repo: &str) -> Settings {
    client
        .create_repository()
        .repository_name(repo)
        .image_tag_mutability(ImageTagMutability::Immutable)
        .send()
        .await
        .unwrap();
    client
        .set_repository_policy()
        .repository_name(repo)
        .policy_text(THEIR_POLICY)
        .send()
        .await
        .unwrap();
    client
        .put_lifecycle_policy()
        .repository_name(repo)
        .lifecycle_policy_text(THEIR_LIFECYCLE)
        .send()
        .await
        .unwrap();
    let made = settings(client, repo).await;
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    assert_eq!(made.mutability, Some(ImageTagMutability::Immutable));
    assert_eq!(made.access_policy, Some(json(THEIR_POLICY)));
    assert_eq!(made.lifecycle_policy, Some(json(THEIR_LIFECYCLE)));
    made
}

/// A repository pinswap did not make is never changed by the leader's
/// pass, without a prefix (every repository of the registry is looked at)
/// or with one it sits under: its tag mutability and policies read back
/// from moto as its owner left them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leaders_pass_leaves_repositories_pinswap_did_not_make_alone() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let sdk = moto.sdk("testing", "testing").await;
    let client = aws_sdk_ecr::Client::new(&sdk);
    let before = create_theirs(&client, "team/app").await;
    for prefix in [None, Some("team")] {
        let aws = aws_block(prefix, &expire_all_but_one());
        let ecr = Ecr::connect_with(&aws, "127.0.0.1:5999", sdk.clone()).await;
        assert_eq!(ecr.reconcile_all(100).await.unwrap(), 1, "{prefix:?}");
        assert_eq!(
            settings(&client, "team/app").await,
            before,
            "prefix {prefix:?}"
        );
        let stats = ecr.stats();
        assert_eq!(
            (stats.foreign, stats.policy_failures, stats.creates),
            (1, 0, 0),
            "prefix {prefix:?}: {stats:?}"
        );
    }
}

/// An image pushed into a repository that exists but that pinswap did not
/// make lands there, and the repository keeps its settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_push_into_a_repository_pinswap_did_not_make_changes_nothing() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let sdk = moto.sdk("testing", "testing").await;
    let client = aws_sdk_ecr::Client::new(&sdk);
    let src = TestRegistry::plain().await;
    let dst = TestRegistry::token_auth("AWS", &moto_token()).await;
    let before = create_theirs(&client, "team/app").await;
    let aws = aws_block(None, &expire_all_but_one());
    let ecr = Arc::new(Ecr::connect_with(&aws, &dst.host(), sdk.clone()).await);
    let pool = Arc::new(ClientPool::new(PoolOptions {
        target_creds: Some(ecr.authorization().await.unwrap()),
        ..PoolOptions::default()
    }));
    let copier = Copier::new(pool, CopyOptions::default()).with_before_push(ecr.clone());
    push_image(&src, "team/app", Some("v1"), &Image::oci(1, 7401)).await;
    let from = Reference::parse(&format!("{}/team/app:v1", src.host())).unwrap();
    let to = Reference::parse(&format!("{}/team/app:v1", dst.host())).unwrap();
    copier
        .copy(&Endpoint::Registry(from), &Endpoint::Registry(to))
        .await
        .unwrap();
    assert_eq!(dst.tags("team/app").await, ["v1"]);
    assert_eq!(settings(&client, "team/app").await, before);
    let stats = ecr.stats();
    assert_eq!(
        (stats.describes, stats.creates, stats.foreign),
        (1, 0, 1),
        "{stats:?}"
    );
}

/// Repositories pinswap made under other settings are brought in line
/// with `ecrOptions`: one it marked, at its first push and by the leader's
/// pass (with or without a prefix), and, with a prefix, an unmarked one
/// named as a mirror path under it (made before repositories were
/// marked). Another team's repository under the prefix and one outside it
/// are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repositories_pinswap_made_are_reconciled_with_changed_ecr_options() {
    use aws_sdk_ecr::types::ImageScanningConfiguration;
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let sdk = moto.sdk("testing", "testing").await;
    let client = aws_sdk_ecr::Client::new(&sdk);
    let host = "127.0.0.1:5999";
    let (made, made_too, legacy) = (
        "cache/team/made",
        "cache/team/made-too",
        "cache/docker.io/team/app",
    );
    let (theirs, outside) = ("cache/team/other", "tools/x");
    // Made by pinswap under the defaults (MUTABLE, no policies).
    let old = Ecr::connect_with(&aws_block(Some("cache"), ""), host, sdk.clone()).await;
    for repo in [made, made_too] {
        old.ensure_repository(repo).await.unwrap();
    }
    Ecr::connect_with(&aws_block(None, ""), host, sdk.clone())
        .await
        .ensure_repository("solo/made")
        .await
        .unwrap();
    for repo in [legacy, theirs, outside] {
        client
            .create_repository()
            .repository_name(repo)
            .image_scanning_configuration(
                ImageScanningConfiguration::builder()
                    .scan_on_push(false)
                    .build(),
            )
            .send()
            .await
            .unwrap();
    }
    let (theirs_before, outside_before) = (
        settings(&client, theirs).await,
        settings(&client, outside).await,
    );
    // Scan on push turned on: the SDK leaves a false out of the request,
    // which moto then takes for no change.
    let options = options_yaml().replace("imageScanOnPush: false", "imageScanOnPush: true");
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    let settled = Settings {
        mutability: Some(ImageTagMutability::Immutable),
        scan_on_push: Some(true),
        access_policy: Some(json(ACCESS_POLICY)),
        lifecycle_policy: Some(json(LIFECYCLE_POLICY)),
    };
    assert_ne!(
        settings(&client, made).await,
        settled,
        "made under other settings"
    );

    let ecr = Ecr::connect_with(&aws_block(Some("cache"), &options), host, sdk.clone()).await;
    ecr.ensure_repository(made).await.unwrap();
    assert_eq!(
        settings(&client, made).await,
        settled,
        "reconciled at its first push"
    );
    assert_ne!(settings(&client, made_too).await, settled, "not met yet");

    let ecr = Ecr::connect_with(&aws_block(Some("cache"), &options), host, sdk.clone()).await;
    assert_eq!(ecr.reconcile_all(100).await.unwrap(), 4);
    for repo in [made, made_too, legacy] {
        assert_eq!(settings(&client, repo).await, settled, "{repo}");
    }
    assert_eq!(settings(&client, theirs).await, theirs_before);
    assert_eq!(settings(&client, outside).await, outside_before);
    assert_ne!(
        settings(&client, "solo/made").await,
        settled,
        "outside the prefix"
    );
    let stats = ecr.stats();
    assert_eq!(
        (stats.foreign, stats.policy_failures, stats.creates),
        (1, 0, 0),
        "{stats:?}"
    );

    // Without a prefix only the mark tells: the unmarked mirror path is
    // not pinswap's then.
    let ecr = Ecr::connect_with(&aws_block(None, &options), host, sdk.clone()).await;
    assert_eq!(ecr.reconcile_all(100).await.unwrap(), 6);
    assert_eq!(settings(&client, "solo/made").await, settled);
    assert_eq!(settings(&client, theirs).await, theirs_before);
    assert_eq!(settings(&client, outside).await, outside_before);
    let stats = ecr.stats();
    assert_eq!(
        (stats.foreign, stats.policy_failures, stats.creates),
        (3, 0, 0),
        "{stats:?}"
    );
}

/// When a repository's tags cannot be read (ListTagsForResource answered
/// 500, then 403, by a front before moto), whether pinswap made it is
/// unknown: neither a first push nor the leader's pass changes it, the
/// failure is counted under the action, and the push goes on. Once the
/// tags can be read, the same repository (pinswap's) is reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repositories_whose_tags_cannot_be_read_are_left_alone() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let front = Front::start(moto.endpoint().trim_start_matches("http://")).await;
    let through_front = || {
        pinswap::registry::ecr::sdk_loader(common::moto::REGION)
            .credentials_provider(aws_credential_types::Credentials::new(
                "testing", "testing", None, None, "test",
            ))
            .endpoint_url(format!("http://{}", front.host()))
            .load()
    };
    let client = aws_sdk_ecr::Client::new(&moto.sdk("testing", "testing").await);
    let host = "127.0.0.1:5999";
    let repo = "cache/team/made";
    Ecr::connect_with(&aws_block(Some("cache"), ""), host, through_front().await)
        .await
        .ensure_repository(repo)
        .await
        .unwrap();
    let before = settings(&client, repo).await;
    let aws = aws_block(Some("cache"), &expire_all_but_one());
    for status in [500, 403] {
        front.set(Mode::RefuseEvery("POST", "ListTagsForResource", status));
        let metrics = Arc::new(Metrics::new());
        let ecr = Ecr::connect_with(&aws, host, through_front().await)
            .await
            .with_metrics(metrics.clone());
        ecr.ensure_repository(repo).await.expect("the push goes on");
        assert_eq!(settings(&client, repo).await, before, "HTTP {status}");
        let ecr = Ecr::connect_with(&aws, host, through_front().await)
            .await
            .with_metrics(metrics.clone());
        assert_eq!(ecr.reconcile_all(100).await.unwrap(), 1);
        assert_eq!(settings(&client, repo).await, before, "HTTP {status}");
        assert_eq!(ecr.stats().policy_failures, 1, "HTTP {status}");
        assert!(
            metrics.encode().contains(
                "pinswap_ecr_policy_failures_total{action=\"ecr:ListTagsForResource\"} 2"
            ),
            "{}",
            metrics.encode()
        );
    }
    front.set(Mode::Pass);
    let ecr = Ecr::connect_with(&aws, host, through_front().await).await;
    assert_eq!(ecr.reconcile_all(100).await.unwrap(), 1);
    let after = settings(&client, repo).await;
    assert_eq!(after.mutability, Some(ImageTagMutability::Mutable));
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
    assert_eq!(after.lifecycle_policy, Some(json(EXPIRE_ALL_BUT_ONE)));
}

/// A repository named as the mirror path of a source the allowlist does
/// not name is not pinswap's by its name: left as it is. With `"*"`
/// allowed, the same name is one of pinswap's (made before repositories
/// were marked) and is reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_path_of_a_source_not_allowed_is_left_alone() {
    let Some(moto) = MotoServer::start().await else {
        return;
    };
    let sdk = moto.sdk("testing", "testing").await;
    let client = aws_sdk_ecr::Client::new(&sdk);
    let before = create_theirs(&client, "team/ghcr.io/org/app").await;
    let aws = aws_block(Some("team"), &expire_all_but_one());
    let named = Ecr::connect_with(&aws, "127.0.0.1:5999", sdk.clone())
        .await
        .with_sources(["docker.io", "quay.io"]);
    named.reconcile_all(100).await.unwrap();
    assert_eq!(settings(&client, "team/ghcr.io/org/app").await, before);
    assert_eq!(named.stats().foreign, 1);
    let any = Ecr::connect_with(&aws, "127.0.0.1:5999", sdk.clone())
        .await
        .with_sources(["*"]);
    any.reconcile_all(100).await.unwrap();
    assert_ne!(settings(&client, "team/ghcr.io/org/app").await, before);
}
