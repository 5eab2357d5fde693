//! `target.aws`: an Amazon ECR target. The keys are k8s-image-swapper's
//! (`accountId`, `region`, `prefix`, `role`, `ecrOptions`), so its config
//! blocks can be carried over as they are.

use serde::{Deserialize, Serialize};

/// An Amazon ECR target. pinswap signs in with `ecr:GetAuthorizationToken`
/// (AWS credentials from the SDK's default chain, or `role` assumed through
/// STS) and creates each repository, with `ecrOptions` and the tag
/// `pinswap.dev/managed-by: pinswap`, before its first push.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {accountId: \"123456789012\", region: eu-west-1}"
)]
pub struct Aws {
    /// The 12-digit AWS account ID that owns the registry (a YAML number
    /// is read as its digits).
    #[serde(deserialize_with = "digits")]
    pub account_id: String,
    /// The AWS region, e.g. `eu-west-1`.
    pub region: String,
    /// Repository name prefix, e.g. `cache` (k8s-image-swapper writes
    /// `/cache`; both are accepted). Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// IAM role ARN to assume (STS `AssumeRole`) for every ECR call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Settings of the repositories pinswap creates.
    #[serde(default)]
    pub ecr_options: EcrOptions,
}

/// Settings applied to each repository pinswap creates, and kept on the
/// repositories it made: those tagged `pinswap.dev/managed-by: pinswap`,
/// and with a `prefix` those named as mirror paths under it. Any other
/// existing repository is pushed into as it is, never changed. Defaults
/// are k8s-image-swapper's.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {imageTagMutability: IMMUTABLE}"
)]
pub struct EcrOptions {
    /// Repository policy (IAM policy JSON), set with `SetRepositoryPolicy`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub access_policy: String,
    /// Lifecycle policy JSON, set with `PutLifecyclePolicy`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub lifecycle_policy: String,
    /// Resource tags, set with `CreateRepository` besides
    /// `pinswap.dev/managed-by: pinswap` (which replaces a tag of that key).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<Tag>,
    /// `MUTABLE` (default) or `IMMUTABLE`.
    #[serde(default = "mutable")]
    pub image_tag_mutability: String,
    /// Scan on push (default on).
    #[serde(default)]
    pub image_scanning_configuration: ImageScanningConfiguration,
    /// Encryption at rest (default `AES256`).
    #[serde(default)]
    pub encryption_configuration: EncryptionConfiguration,
}

impl Default for EcrOptions {
    fn default() -> Self {
        Self {
            access_policy: String::new(),
            lifecycle_policy: String::new(),
            tags: Vec::new(),
            image_tag_mutability: mutable(),
            image_scanning_configuration: ImageScanningConfiguration::default(),
            encryption_configuration: EncryptionConfiguration::default(),
        }
    }
}

/// A string, or an unsigned integer as its digits (k8s-image-swapper's
/// documented examples write `accountId: 123456789` unquoted).
fn digits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "a 12-digit AWS account ID such as \"123456789012\""
    )]
    enum Id {
        Text(String),
        Number(u64),
    }
    Ok(match Id::deserialize(d)? {
        Id::Text(s) => s,
        Id::Number(n) => n.to_string(),
    })
}

fn mutable() -> String {
    "MUTABLE".into()
}

/// One resource tag.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping such as {key: team, value: platform}"
)]
pub struct Tag {
    /// 1 to 128 characters.
    pub key: String,
    /// Up to 256 characters.
    #[serde(default)]
    pub value: String,
}

/// `ecrOptions.imageScanningConfiguration`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {imageScanOnPush: true}"
)]
pub struct ImageScanningConfiguration {
    /// Scan each image when it is pushed. Default: true.
    #[serde(default = "crate::config::yes")]
    pub image_scan_on_push: bool,
}

impl Default for ImageScanningConfiguration {
    fn default() -> Self {
        Self {
            image_scan_on_push: true,
        }
    }
}

/// `ecrOptions.encryptionConfiguration`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {encryptionType: KMS, kmsKey: alias/ecr}"
)]
pub struct EncryptionConfiguration {
    /// `AES256` (default) or `KMS`.
    #[serde(default = "aes256")]
    pub encryption_type: String,
    /// KMS key ARN, ID or alias; required with `KMS` and only with it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kms_key: String,
}

impl Default for EncryptionConfiguration {
    fn default() -> Self {
        Self {
            encryption_type: aes256(),
            kms_key: String::new(),
        }
    }
}

fn aes256() -> String {
    "AES256".into()
}

impl Aws {
    /// The registry host: `ACCOUNT.dkr.ecr.REGION.amazonaws.com` (`.com.cn`
    /// in the China regions).
    pub fn host(&self) -> String {
        let domain = if self.region.starts_with("cn-") {
            "amazonaws.com.cn"
        } else {
            "amazonaws.com"
        };
        format!("{}.dkr.ecr.{}.{domain}", self.account_id, self.region)
    }

    /// The prefix without its slashes; `None` when empty.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix
            .as_deref()
            .map(|p| p.trim_matches('/'))
            .filter(|p| !p.is_empty())
    }

    /// `target.registry` for this block: the host and the prefix.
    pub fn registry(&self) -> String {
        match self.prefix() {
            Some(p) => format!("{}/{p}", self.host()),
            None => self.host(),
        }
    }

    /// Every problem under `path` (`target.aws`), given the target's
    /// `registry` as written (empty when derived from this block).
    pub(super) fn problems(
        &self,
        path: &str,
        registry: &str,
        bad: &mut impl FnMut(String, String),
    ) {
        if !is_account_id(&self.account_id) {
            bad(
                format!("{path}.accountId"),
                format!(
                    "found {:?}, expected the AWS account ID: 12 digits (quote it in YAML when it starts with 0)",
                    self.account_id
                ),
            );
        }
        if !is_region(&self.region) {
            bad(
                format!("{path}.region"),
                format!(
                    "found {:?}, expected an AWS region such as eu-west-1",
                    self.region
                ),
            );
        }
        if let Some(p) = self.prefix()
            && !p.split('/').all(is_repository_component)
        {
            bad(
                format!("{path}.prefix"),
                format!(
                    "found {p:?}, expected repository path components (lowercase letters, digits, . _ -) separated by /"
                ),
            );
        }
        // The same prefix in both places is how a loaded config serialises.
        if let (Some(p), Some((_, written))) = (self.prefix(), registry.split_once('/'))
            && p != written
        {
            bad(
                format!("{path}.prefix"),
                format!("{p:?} differs from the path of target.registry ({written:?}); keep one"),
            );
        }
        // A registry written out must be this account's ECR, unless it is
        // another host altogether (an endpoint override, a local stand-in).
        if let Some(host) = registry.split('/').next()
            && host.contains(".dkr.ecr.")
            && !host.eq_ignore_ascii_case(&self.host())
        {
            bad(
                "target.registry".into(),
                format!(
                    "{host:?} is not the ECR registry of target.aws ({}); fix one of them, or leave target.registry out",
                    self.host()
                ),
            );
        }
        if let Some(role) = &self.role
            && !is_role_arn(role)
        {
            bad(
                format!("{path}.role"),
                format!("found {role:?}, expected an IAM role ARN, arn:aws:iam::ACCOUNT:role/NAME"),
            );
        }
        let o = &self.ecr_options;
        let opts = format!("{path}.ecrOptions");
        for (key, text) in [
            ("accessPolicy", &o.access_policy),
            ("lifecyclePolicy", &o.lifecycle_policy),
        ] {
            if !text.is_empty()
                && !matches!(
                    serde_json::from_str::<serde_json::Value>(text),
                    Ok(serde_json::Value::Object(_))
                )
            {
                bad(
                    format!("{opts}.{key}"),
                    "is not a JSON object; expected the policy document as a JSON string".into(),
                );
            }
        }
        for (i, t) in o.tags.iter().enumerate() {
            if t.key.is_empty() || t.key.chars().count() > 128 {
                bad(
                    format!("{opts}.tags[{i}].key"),
                    format!("found {:?}, expected 1 to 128 characters", t.key),
                );
            }
            if t.value.chars().count() > 256 {
                bad(
                    format!("{opts}.tags[{i}].value"),
                    "longer than 256 characters".into(),
                );
            }
        }
        if !["MUTABLE", "IMMUTABLE"].contains(&o.image_tag_mutability.as_str()) {
            bad(
                format!("{opts}.imageTagMutability"),
                format!(
                    "found {:?}, expected MUTABLE or IMMUTABLE",
                    o.image_tag_mutability
                ),
            );
        }
        let e = &o.encryption_configuration;
        let enc = format!("{opts}.encryptionConfiguration");
        match e.encryption_type.as_str() {
            "AES256" if !e.kms_key.is_empty() => bad(
                format!("{enc}.kmsKey"),
                "is only used with encryptionType: KMS".into(),
            ),
            "KMS" if e.kms_key.is_empty() => bad(
                format!("{enc}.kmsKey"),
                "missing; encryptionType KMS needs the KMS key's ARN, ID or alias".into(),
            ),
            "AES256" | "KMS" => {}
            other => bad(
                format!("{enc}.encryptionType"),
                format!("found {other:?}, expected AES256 or KMS"),
            ),
        }
    }
}

/// Digits, at most 12. Real IDs have 12; shorter ones (documentation
/// placeholders, converted as they are) fail at AWS with a clear error.
fn is_account_id(s: &str) -> bool {
    (1..=12).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())
}

/// `xx-name-N`, e.g. `us-east-1`, `us-gov-west-1`, `cn-north-1`.
pub(crate) fn is_region(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() >= 3
        && parts[..parts.len() - 1]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase()))
        && parts[parts.len() - 1].bytes().all(|b| b.is_ascii_digit())
        && !parts[parts.len() - 1].is_empty()
}

fn is_role_arn(s: &str) -> bool {
    let mut parts = s.splitn(6, ':');
    let arn = parts.next() == Some("arn");
    let partition = parts.next().is_some_and(|p| p.starts_with("aws"));
    let iam = parts.next() == Some("iam");
    let region = parts.next() == Some("");
    let account = parts.next().is_some_and(is_account_id);
    let role = parts
        .next()
        .is_some_and(|r| r.strip_prefix("role/").is_some_and(|n| !n.is_empty()));
    arn && partition && iam && region && account && role
}

/// One component of an ECR repository name.
fn is_repository_component(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::{Config, ConfigError};

    fn problems(y: &str) -> Vec<(String, String)> {
        match Config::from_yaml(y, "t.yaml") {
            Err(ConfigError::Invalid(v)) => v.into_iter().map(|i| (i.path, i.message)).collect(),
            Ok(_) => Vec::new(),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn registry_comes_from_the_account_region_and_prefix() {
        let c = Config::from_yaml(
            "target: {aws: {accountId: 111122223333, region: eu-west-1, prefix: /cache}}\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            c.target.registry,
            "111122223333.dkr.ecr.eu-west-1.amazonaws.com/cache"
        );
        let aws = c.target.aws.unwrap();
        assert_eq!(aws.ecr_options, EcrOptions::default());
        assert_eq!(aws.ecr_options.image_tag_mutability, "MUTABLE");
        assert!(
            aws.ecr_options
                .image_scanning_configuration
                .image_scan_on_push
        );
        assert_eq!(
            aws.ecr_options.encryption_configuration.encryption_type,
            "AES256"
        );
        // A data-plane host of its own gets the prefix appended.
        let c = Config::from_yaml(
            "target: {registry: \"127.0.0.1:5000\", aws: {accountId: \"111122223333\", region: cn-north-1, prefix: cache}}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.target.registry, "127.0.0.1:5000/cache");
        // A loaded config serialises and loads again unchanged.
        let again = Config::from_yaml(&yaml_serde::to_string(&c).unwrap(), "again").unwrap();
        assert_eq!(again, c);
        assert_eq!(
            c.target.aws.unwrap().host(),
            "111122223333.dkr.ecr.cn-north-1.amazonaws.com.cn"
        );
    }

    #[test]
    fn problems_name_the_key() {
        let p = problems(concat!(
            "target:\n  registry: 999999999999.dkr.ecr.eu-west-1.amazonaws.com/x\n",
            "  auth: {username: AWS, passwordEnv: T}\n",
            "  aws:\n    accountId: \"12a\"\n    region: Ireland\n    prefix: Cache\n    role: admin\n",
            "    ecrOptions:\n      accessPolicy: 'not json'\n      tags: [{key: \"\"}]\n",
            "      imageTagMutability: mutable\n      encryptionConfiguration: {encryptionType: KMS}\n",
        ));
        let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "target.aws.accountId",
                "target.aws.region",
                "target.aws.prefix",
                "target.aws.prefix",
                "target.registry",
                "target.aws.role",
                "target.aws.ecrOptions.accessPolicy",
                "target.aws.ecrOptions.tags[0].key",
                "target.aws.ecrOptions.imageTagMutability",
                "target.aws.ecrOptions.encryptionConfiguration.kmsKey",
                "target.auth",
            ],
            "{p:?}"
        );
        assert!(p[9].1.contains("needs the KMS key"), "{p:?}");
        assert!(p[10].1.contains("GetAuthorizationToken"), "{p:?}");
        let p = problems("target: {}\n");
        assert_eq!(p[0].0, "target.registry");
        assert!(p[0].1.contains("or target.aws"), "{p:?}");
    }

    #[test]
    fn regions_and_roles() {
        for r in [
            "us-east-1",
            "eu-west-3",
            "us-gov-west-1",
            "cn-north-1",
            "ap-southeast-2",
        ] {
            assert!(is_region(r), "{r}");
        }
        for r in ["us-east", "US-EAST-1", "us--1", "useast1", ""] {
            assert!(!is_region(r), "{r}");
        }
        assert!(is_role_arn("arn:aws:iam::111122223333:role/pinswap"));
        assert!(is_role_arn(
            "arn:aws-cn:iam::111122223333:role/path/pinswap"
        ));
        assert!(!is_role_arn("arn:aws:iam::111122223333:user/pinswap"));
        assert!(!is_role_arn("pinswap"));
        assert!(is_account_id("012345678901"));
        assert!(!is_account_id("1234567890123"));
        assert!(!is_account_id("12345678901a"));
    }
}
