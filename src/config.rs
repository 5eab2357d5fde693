//! The YAML config (docs/architecture.md §6): schema, defaults, durations such as `8s`
//! or `1h`, and strict validation.
//!
//! A config file either loads completely or fails with messages that name
//! the key path, what was found and what is accepted. Unknown keys are
//! errors. Secrets are never inline: credentials are referenced as a file
//! (`passwordFile`, `dockerConfigFile`) or an environment variable
//! (`passwordEnv`), and a `password` key is refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::platform::PlatformSpec;
use crate::reference::MirrorTarget;

mod aws;
mod mirror_only;
mod prewarm;
mod resources;
mod retention;
mod scope;
mod sharing;
pub use aws::{Aws, EcrOptions, EncryptionConfiguration, ImageScanningConfiguration, Tag};
pub use mirror_only::{MirrorOnly, PodMatch, Profile};
pub use prewarm::Prewarm;
pub use resources::{
    CustomKind, CustomResources, FieldPath, ImageFields, Location, ResourceProfile, Step,
    is_parameter, pointer, shown, strip_scheme,
};
pub use retention::Retention;
pub use scope::{LabelSelector, Operator, Requirement, Scope};
pub use sharing::{MAX_CLUSTER_NAME, Sharing, cluster_name_problem};

/// Config loading errors. Each names the file and the key path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {reason}")]
    Read {
        /// The config file.
        file: String,
        /// The OS error.
        reason: String,
    },
    /// The YAML does not fit the schema (syntax, unknown key, wrong type).
    #[error("{file}{}: {path}: {message}", if *line > 0 { format!(":{line}:{column}") } else { String::new() })]
    Parse {
        /// The config file.
        file: String,
        /// Key path, e.g. `cache.ttl` (`.` for the top level).
        path: String,
        /// 1-based line, 0 when unknown.
        line: usize,
        /// 1-based column, 0 when unknown.
        column: usize,
        /// What was found and what is accepted.
        message: String,
    },
    /// A k8s-image-swapper config: `pinswap config convert` reads it.
    #[error(
        "{file}: a k8s-image-swapper config (it has {keys}), not a pinswap one; convert it with `pinswap config convert {file} > pinswap.yaml` and check the result with `pinswap config validate pinswap.yaml`"
    )]
    K8sImageSwapper {
        /// The config file.
        file: String,
        /// The key paths that only k8s-image-swapper has, comma-separated.
        keys: String,
    },
    /// Values that parse but cannot work together or at all.
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Invalid>),
}

/// One semantic problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {path}: {message}")]
pub struct Invalid {
    /// The config file.
    pub file: String,
    /// Key path.
    pub path: String,
    /// What was found and what is accepted.
    pub message: String,
}

/// A setting that loads but that `serve` or `pinswap manifests` would warn
/// about or refuse; `pinswap config validate` prints it, and fails on it
/// with `--strict`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {path}: {message}")]
pub struct Warning {
    /// The config file.
    pub file: String,
    /// Key path.
    pub path: String,
    /// What was found and what to do.
    pub message: String,
}

/// The `target.registry` that `pinswap config default` writes (and the
/// chart's values hold) until the user sets their own.
pub const PLACEHOLDER_REGISTRY: &str = "mirror.example.com/cache";

/// `exists`: rewrite only when the target has the image; `always`: rewrite
/// regardless (docs/architecture.md §2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SwapPolicy {
    /// Rewrite only when the target has the image.
    #[default]
    Exists,
    /// Always rewrite.
    Always,
}

/// When to copy (docs/architecture.md §2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyPolicy {
    /// Copy in the background.
    #[default]
    Delayed,
    /// Start the copy and wait up to `copyDeadline`.
    Immediate,
    /// Copy inline, up to `copyDeadline`.
    Force,
    /// Never copy.
    None,
}

/// What to do on an identity collision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CollisionPolicy {
    /// Rewrite as usual and report.
    #[default]
    Warn,
    /// Write a repaired copy at the target.
    Repair,
    /// Reject the Pod.
    Deny,
}

/// Whether an admission error leaves the Pod unchanged or denies it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// Leave the slot unchanged.
    #[default]
    Open,
    /// Deny the Pod.
    Closed,
}

impl<'de> Deserialize<'de> for SwapPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok([Self::Exists, Self::Always][word(d, &["exists", "always"])?])
    }
}

impl<'de> Deserialize<'de> for CopyPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const WORDS: &[&str] = &["delayed", "immediate", "force", "none"];
        Ok([Self::Delayed, Self::Immediate, Self::Force, Self::None][word(d, WORDS)?])
    }
}

impl<'de> Deserialize<'de> for CollisionPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok([Self::Warn, Self::Repair, Self::Deny][word(d, &["warn", "repair", "deny"])?])
    }
}

impl<'de> Deserialize<'de> for FailurePolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok([Self::Open, Self::Closed][word(d, &["open", "closed"])?])
    }
}

/// Reads a setting that is one of `words` and returns its index. A derived
/// enum would answer a list or a mapping with the YAML parser's "expected a
/// YAML tag"; this names the words, at the value's line and column.
pub(crate) fn word<'de, D: Deserializer<'de>>(
    d: D,
    words: &'static [&'static str],
) -> Result<usize, D::Error> {
    struct Word(&'static [&'static str]);
    impl serde::de::Visitor<'_> for Word {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&one_of(self.0))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<usize, E> {
            self.0
                .iter()
                .position(|w| *w == v)
                .ok_or_else(|| E::unknown_variant(v, self.0))
        }
    }
    d.deserialize_str(Word(words))
}

/// `` `a` ``, `` `a` or `b` `` or `` one of `a`, `b`, `c` ``, as serde words
/// its own lists.
fn one_of(words: &[&str]) -> String {
    let quoted: Vec<String> = words.iter().map(|w| format!("`{w}`")).collect();
    match quoted.as_slice() {
        [one] => one.clone(),
        [a, b] => format!("{a} or {b}"),
        _ => format!("one of {}", quoted.join(", ")),
    }
}

/// Registry credentials, by reference only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {username: pinswap, passwordFile: /var/run/secrets/pinswap/target-password}"
)]
pub struct Auth {
    /// User name for basic auth or the token flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// File whose content (trailing newline trimmed) is the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// A Docker config.json to read credentials from (helpers included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docker_config_file: Option<PathBuf>,
    /// Refused with a clear message; present only to give one.
    #[serde(default, skip_serializing)]
    password: Option<Present>,
}

/// Deserialises from any value and keeps none of it, so a refused key (an
/// inline password) can be reported without the secret staying in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Present;

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Present)
    }
}

/// The registry (and optional path prefix) that pinswap mirrors into.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {registry: mirror.example.com/cache}"
)]
pub struct Target {
    /// `host[:port][/prefix]`. With `aws`, it defaults to the account's ECR
    /// host and `aws.prefix`; a host written here (a local stand-in, a
    /// pull-through endpoint) gets `aws.prefix` appended.
    #[serde(default)]
    pub registry: String,
    /// Allow plain HTTP.
    #[serde(default)]
    pub insecure: bool,
    /// Credentials for the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<Auth>,
    /// An Amazon ECR target: sign in and create repositories through the
    /// AWS API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aws: Option<Aws>,
}

/// An allowed source registry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {registry: docker.io}"
)]
pub struct SourceRegistry {
    /// `host[:port]` (Docker Hub as `docker.io`), or `*` for any.
    pub registry: String,
    /// Allow plain HTTP.
    #[serde(default)]
    pub insecure: bool,
    /// Credentials for this source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<Auth>,
    /// Which of its images the mirror shares (docs/security.md).
    #[serde(default, skip_serializing_if = "Visibility::is_auto")]
    pub visibility: Visibility,
}

/// Which images of a source registry every Pod may be given from the
/// mirror (docs/security.md). An image that needs a Pod's own pull secret
/// is private under either setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Visibility {
    /// Public images (served anonymously) and images the registry's `auth`
    /// reads are shared.
    #[default]
    Auto,
    /// Only public images are shared; every other image is rewritten only
    /// for Pods whose own pull secrets read it at the source.
    Private,
}

impl Visibility {
    fn is_auto(&self) -> bool {
        *self == Self::Auto
    }
}

impl<'de> Deserialize<'de> for Visibility {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok([Self::Auto, Self::Private][word(d, &["auto", "private"])?])
    }
}

/// A JMESPath filter; `true` skips the container (as in k8s-image-swapper).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping such as {jmespath: \"obj.metadata.namespace == 'kube-system'\"}"
)]
pub struct Filter {
    /// Evaluated against `{"obj": <Pod>, "container": <container>}`.
    pub jmespath: String,
}

/// Where images may come from, and which containers to leave alone.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {registries: [{registry: docker.io}]}"
)]
pub struct Source {
    /// Allowlist. Only these registries are ever contacted.
    #[serde(default = "default_registries")]
    pub registries: Vec<SourceRegistry>,
    /// Skip filters.
    #[serde(default)]
    pub filters: Vec<Filter>,
    /// Authenticate to sources with the Pod's imagePullSecrets and its
    /// ServiceAccount's, read through the Kubernetes API (RBAC: get secrets
    /// and serviceaccounts).
    #[serde(default)]
    pub image_pull_secrets: bool,
    /// How long a private image's proof (a Pod's pull secret read the
    /// digest at the source) counts, and a public verdict too.
    #[serde(default = "d_10m", with = "duration")]
    pub proof_ttl: Duration,
    /// While the source cannot answer, a proof or public verdict no older
    /// than this still counts.
    #[serde(default = "d_24h", with = "duration")]
    pub proof_grace: Duration,
    /// How long an admission waits for a source to resolve a tag before it
    /// uses the target's copy instead (at most half the time left in the
    /// admission budget).
    #[serde(default = "d_1s", with = "duration")]
    pub timeout: Duration,
    /// Per-registry circuit breaker for failing sources.
    #[serde(default)]
    pub breaker: Breaker,
}

/// The circuit breaker each source registry gets (docs/architecture.md §3 "Source
/// health"): after `failures` consecutive failures (connect errors,
/// timeouts, 5xx, 429) the source is not asked for `backoff`, doubling on
/// each failed probe up to `maxBackoff`; a 429 or 503 `Retry-After` (capped
/// at `maxBackoff`) lengthens the window, and a 429 opens it at once.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {failures: 3, backoff: 5s, maxBackoff: 5m}"
)]
pub struct Breaker {
    /// Consecutive failures that open the breaker (1 to 100).
    #[serde(default = "breaker_failures")]
    pub failures: u32,
    /// First open window.
    #[serde(default = "d_5s", with = "duration")]
    pub backoff: Duration,
    /// Longest open window, and the cap on `Retry-After`.
    #[serde(default = "d_5m", with = "duration")]
    pub max_backoff: Duration,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            failures: breaker_failures(),
            backoff: d_5s(),
            max_backoff: d_5m(),
        }
    }
}

fn breaker_failures() -> u32 {
    3
}

fn default_registries() -> Vec<SourceRegistry> {
    vec![SourceRegistry {
        registry: "docker.io".into(),
        insecure: false,
        auth: None,
        visibility: Visibility::Auto,
    }]
}

impl Default for Source {
    fn default() -> Self {
        Self {
            registries: default_registries(),
            filters: Vec::new(),
            image_pull_secrets: false,
            proof_ttl: d_10m(),
            proof_grace: d_24h(),
            timeout: d_1s(),
            breaker: Breaker::default(),
        }
    }
}

/// Which platforms of an index to mirror.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Platforms {
    /// Every child.
    #[default]
    All,
    /// Only these.
    Only(Vec<PlatformSpec>),
}

impl<'de> Deserialize<'de> for Platforms {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            List(Vec<String>),
        }
        let expected = "\"all\" or a list of os/arch[/variant], e.g. [linux/amd64, linux/arm64]";
        match Raw::deserialize(d).map_err(|_| own_error(format!("expected {expected}")))? {
            Raw::Word(w) if w == "all" => Ok(Self::All),
            Raw::Word(w) => Err(own_error(format!("found {w:?}, expected {expected}"))),
            Raw::List(l) if l.is_empty() => Err(own_error(format!(
                "found an empty list, expected {expected}"
            ))),
            Raw::List(l) => l
                .iter()
                .map(|p| p.parse::<PlatformSpec>())
                .collect::<Result<_, _>>()
                .map(Self::Only)
                .map_err(own_error),
        }
    }
}

impl Serialize for Platforms {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::All => s.serialize_str("all"),
            Self::Only(l) => s.collect_seq(l.iter().map(|p| match &p.variant {
                Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                None => format!("{}/{}", p.os, p.architecture),
            })),
        }
    }
}

/// Which referrers of an image travel with it (docs/referrers.md):
/// `referrers: true` (the default), `false`, or `{enabled: BOOL,
/// artifactTypes: [TYPE, ...]}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Referrers {
    /// Copy referrers at all.
    pub enabled: bool,
    /// Only referrers of these artifactTypes; empty: every one.
    pub artifact_types: Vec<String>,
}

impl Default for Referrers {
    fn default() -> Self {
        Self {
            enabled: true,
            artifact_types: Vec::new(),
        }
    }
}

impl<'de> Deserialize<'de> for Referrers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde_json::Value;
        let expected = "true, false, or {enabled: true|false, artifactTypes: [TYPE, ...]}";
        let found = |v: &Value| match v {
            Value::Null => "nothing".to_owned(),
            Value::String(s) => format!("{s:?}"),
            Value::Array(_) => "a list".to_owned(),
            other => other.to_string(),
        };
        let v = Value::deserialize(d).map_err(|_| own_error(format!("expected {expected}")))?;
        let map = match v {
            Value::Bool(enabled) => {
                return Ok(Self {
                    enabled,
                    ..Self::default()
                });
            }
            Value::Object(map) => map,
            other => {
                return Err(own_error(format!(
                    "found {}, expected {expected}",
                    found(&other)
                )));
            }
        };
        let mut out = Self::default();
        for (key, value) in map {
            match key.as_str() {
                "enabled" => {
                    out.enabled = value.as_bool().ok_or_else(|| {
                        own_error(format!(
                            "enabled: found {}, expected true or false",
                            found(&value)
                        ))
                    })?
                }
                "artifactTypes" => {
                    let list = value.as_array().ok_or_else(|| {
                        own_error(format!(
                            "artifactTypes: found {}, expected a list of media types such as [application/vnd.dev.sigstore.bundle.v0.3+json]",
                            found(&value)
                        ))
                    })?;
                    if list.is_empty() {
                        return Err(own_error(
                            "artifactTypes: found an empty list; leave artifactTypes out to copy every referrer, or set referrers: false to copy none",
                        ));
                    }
                    for t in list {
                        match t.as_str() {
                            Some(t) if is_media_type(t) => out.artifact_types.push(t.to_owned()),
                            _ => {
                                return Err(own_error(format!(
                                    "artifactTypes: found {}, expected a media type TYPE/SUBTYPE such as application/spdx+json",
                                    found(t)
                                )));
                            }
                        }
                    }
                }
                other => {
                    let near = suggest(other, ["enabled", "artifactTypes"])
                        .map(|k| format!(" (did you mean {k}?)"))
                        .unwrap_or_default();
                    return Err(own_error(format!(
                        "unknown key {other:?}{near}, expected enabled or artifactTypes"
                    )));
                }
            }
        }
        Ok(out)
    }
}

impl Serialize for Referrers {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        if self.artifact_types.is_empty() {
            return s.serialize_bool(self.enabled);
        }
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("enabled", &self.enabled)?;
        m.serialize_entry("artifactTypes", &self.artifact_types)?;
        m.end()
    }
}

/// `type/subtype` with RFC 6838's restricted-name characters.
fn is_media_type(t: &str) -> bool {
    let name = |n: &str| {
        !n.is_empty()
            && n.len() <= 127
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
    };
    matches!(t.split_once('/'), Some((a, b)) if name(a) && name(b))
}

/// serde's and yaml_serde's wording of a schema error, made readable for
/// someone who writes YAML: the nearest key for an unknown one, and no
/// Rust type names.
fn in_user_terms(message: &str) -> String {
    let mut m = message.to_owned();
    if let Some(rest) = m.strip_prefix("unknown field `")
        && let Some((key, expected)) = rest.split_once('`')
    {
        // serde lists the accepted keys in backticks after "expected".
        let known: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
        if let Some(near) = suggest(key, known.iter().copied()) {
            m = format!("unknown field `{key}` (did you mean `{near}`?){expected}");
        }
    }
    for (rust, user) in [
        ("expected u8", "expected a whole number from 0 to 255"),
        ("expected u16", "expected a whole number from 0 to 65535"),
        (
            "expected u32",
            "expected a whole number from 0 to 4294967295",
        ),
        ("expected u64", "expected a whole number, 0 or more"),
        ("expected usize", "expected a whole number, 0 or more"),
        ("expected i32", "expected a whole number"),
        ("expected i64", "expected a whole number"),
        ("expected f32", "expected a number such as 0.5"),
        ("expected f64", "expected a number such as 0.5"),
    ] {
        if let Some(head) = m.strip_suffix(rust) {
            m = format!("{head}{user}");
        }
    }
    for (yaml, user) in [
        ("invalid type: map,", "invalid type: mapping,"),
        ("invalid type: sequence,", "invalid type: list,"),
        ("invalid type: unit value,", "invalid type: null,"),
    ] {
        m = m.replacen(yaml, user, 1);
    }
    for (yaml, user) in [
        ("expected a map", "expected a mapping"),
        ("expected a sequence", "expected a list"),
    ] {
        if let Some(head) = m.strip_suffix(yaml) {
            m = format!("{head}{user}");
        }
    }
    m
}

/// Levenshtein distance, for "did you mean" hints.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The closest known key within two edits, ignoring case (`copypolicy`,
/// `copyPolicyy` and `copyPolcy` all find `copyPolicy`).
pub(crate) fn suggest<'k>(key: &str, known: impl IntoIterator<Item = &'k str>) -> Option<&'k str> {
    let key = key.to_ascii_lowercase();
    known
        .into_iter()
        .map(|k| (distance(&key, &k.to_ascii_lowercase()), k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// k8s-image-swapper's top-level keys that pinswap has no key of that name
/// for (docs/migrating-from-k8s-image-swapper.md).
pub(crate) const K8S_IMAGE_SWAPPER_KEYS: &[&str] = &[
    "dryRun",
    "logLevel",
    "logFormat",
    "listenAddress",
    "tlsCertFile",
    "tlsKeyFile",
    "imageSwapPolicy",
    "imageCopyPolicy",
    "imageCopyDeadline",
    "imageCopySkipRegistries",
    "cacheTtlMinutes",
    "cacheJitterMaxMinutes",
];

/// The key paths that mark `text` as a k8s-image-swapper config (or its
/// Helm values, under `config:`); empty for anything else. Keys match
/// ignoring case, as k8s-image-swapper reads them.
fn k8s_image_swapper_keys(text: &str) -> Vec<String> {
    use yaml_serde::Value;
    let Ok(Value::Mapping(root)) = yaml_serde::from_str::<Value>(text) else {
        return Vec::new();
    };
    let key = |k: &Value| k.as_str().map(str::to_owned).unwrap_or_default();
    let get = |m: &yaml_serde::Mapping, name: &str| {
        m.iter()
            .find(|(k, _)| key(k).eq_ignore_ascii_case(name))
            .map(|(k, v)| (key(k), v.clone()))
    };
    let (prefix, config) = match get(&root, "config") {
        Some((k, Value::Mapping(m))) => (format!("{k}."), m),
        _ => (String::new(), root),
    };
    // A key only pinswap has (the default config lists them all) makes it
    // a pinswap config with a stray key, which gets the unknown-key error.
    let ours = match yaml_serde::from_str::<Value>(DEFAULT_YAML) {
        Ok(Value::Mapping(m)) => m.keys().map(key).collect(),
        _ => Vec::new(),
    };
    let mut found = Vec::new();
    for (k, _) in &config {
        let k = key(k);
        if K8S_IMAGE_SWAPPER_KEYS
            .iter()
            .any(|s| s.eq_ignore_ascii_case(&k))
        {
            found.push(format!("{prefix}{k}"));
        } else if k != "source" && k != "target" && ours.contains(&k) {
            return Vec::new();
        }
    }
    if let Some((t, Value::Mapping(target))) = get(&config, "target")
        && let Some((k, _)) = get(&target, "type")
    {
        found.push(format!("{prefix}{t}.{k}"));
    }
    if let Some((s, Value::Mapping(source))) = get(&config, "source") {
        if let Some((k, _)) = get(&source, "privateRegistries") {
            found.push(format!("{prefix}{s}.{k}"));
        }
        if let Some((r, Value::Sequence(list))) = get(&source, "registries") {
            for (i, entry) in list.iter().enumerate() {
                if let Value::Mapping(entry) = entry
                    && let Some((k, _)) = get(entry, "type")
                {
                    found.push(format!("{prefix}{s}.{r}[{i}].{k}"));
                }
            }
        }
    }
    found
}

/// Marks errors raised by our own field parsers: yaml_serde gives them the
/// position of the enclosing mapping, not of the value, so
/// [`Config::from_yaml`] drops it and names the key path alone.
const OWN_ERROR: &str = "\u{1}";

fn own_error<E: serde::de::Error>(message: impl std::fmt::Display) -> E {
    E::custom(format!("{OWN_ERROR}{message}"))
}

/// `IP:PORT`; a host name gets a message saying so, not the standard
/// library's "invalid socket address syntax".
fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<std::net::SocketAddr, D::Error> {
    let s = String::deserialize(d).map_err(|_| own_error("expected IP:PORT, e.g. 0.0.0.0:8443"))?;
    s.parse().map_err(|_| {
        own_error(format!(
            "found {s:?}, expected IP:PORT, e.g. 0.0.0.0:8443 or [::]:8443 (an IP address, not a host name)"
        ))
    })
}

/// Durations as `8s`, `500ms`, `1h 30m` (humantime), serialised the same way.
pub(crate) mod duration {
    use super::*;

    /// What every duration error ends with: the forms humantime reads.
    pub(crate) const EXPECTED: &str = "expected a duration such as 30s, 500ms, 5m or 1h 30m (a number and a unit: ms, s, m, h, d; several add up)";

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d).map_err(|_| own_error(EXPECTED))?;
        parse(&s).map_err(own_error)
    }

    /// Parses a duration; the error says what was wrong in the user's
    /// terms, not humantime's (`expected number at 0`).
    pub(crate) fn parse(s: &str) -> Result<Duration, String> {
        use humantime::DurationError as E;
        humantime::parse_duration(s).map_err(|e| {
            let why = match e {
                E::Empty => return format!("found an empty value, {EXPECTED}"),
                E::UnknownUnit { unit, value, .. } if unit.is_empty() => {
                    format!("a number without a unit; write {value}s, {value}m or {value}ms")
                }
                E::UnknownUnit { unit, .. } => format!("{unit:?} is not a unit"),
                E::NumberOverflow => {
                    "too large, or a fraction finer than its unit takes: 1ns, and whole seconds for h, d, w, M and y".to_owned()
                }
                E::InvalidCharacter(_) | E::NumberExpected(_) if s.starts_with(['P', 'p']) => {
                    "ISO 8601 durations are not read".to_owned()
                }
                E::InvalidCharacter(_) | E::NumberExpected(_) => {
                    return format!("found {s:?}, {EXPECTED}");
                }
            };
            format!("found {s:?} ({why}), {EXPECTED}")
        })
    }

    pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*v).to_string())
    }
}

/// Cache lifetimes (docs/architecture.md §2 existence and resolution caches).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {ttl: 1h, resolutionTtl: 30s}"
)]
pub struct Cache {
    /// Existence cache lifetime; `0s` turns it off.
    #[serde(default = "d_1h", with = "duration")]
    pub ttl: Duration,
    /// Tag → digest cache lifetime; `0s` turns it off.
    #[serde(default = "d_30s", with = "duration")]
    pub resolution_ttl: Duration,
    /// Each entry's lifetime is shortened by a random part of this fraction
    /// of its TTL (0 to 0.5), so entries cached together do not all expire
    /// and re-check the registry at the same moment.
    #[serde(default = "jitter")]
    pub jitter: f64,
    /// Re-verification interval of cached target manifests; `0s` turns it off.
    #[serde(default = "d_10m", with = "duration")]
    pub reverify: Duration,
    /// Re-verification HEADs a second at most (an entry's digest and each
    /// of its tags), per replica; `0` leaves the round spread evenly over
    /// `reverify` alone. A round needing more HEADs than `reverify` allows
    /// at this rate takes longer than `reverify`.
    #[serde(default = "reverify_rate")]
    pub reverify_rate: u32,
    /// Serve `POST /cache/purge` on the health port. Off by default: that
    /// port is plain HTTP without authentication.
    #[serde(default)]
    pub purge_endpoint: bool,
}

// `jitter` is validated finite (0 to 0.5), so equality is total.
impl Eq for Cache {}

impl Default for Cache {
    fn default() -> Self {
        Self {
            ttl: d_1h(),
            resolution_ttl: d_30s(),
            jitter: jitter(),
            reverify: d_10m(),
            reverify_rate: reverify_rate(),
            purge_endpoint: false,
        }
    }
}

fn jitter() -> f64 {
    0.1
}

fn reverify_rate() -> u32 {
    20
}

/// Pull-failure recovery (docs/architecture.md §3 "Background"): the Pod watcher and
/// the Lease that elects the one replica running it and the re-verifier.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, namespaces: [apps]}"
)]
pub struct Recovery {
    /// Watch Pods for pull failures on target images. Needs a Kubernetes API
    /// client (in-cluster, or KUBECONFIG); without one `serve` warns and runs
    /// admission and re-verification alone.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Namespaces whose Pods are watched; empty for all.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// First wait before retrying a failed re-mirror; doubles up to `retryMax`.
    #[serde(default = "d_5s", with = "duration")]
    pub retry_initial: Duration,
    /// Longest wait between retries of a failed re-mirror.
    #[serde(default = "d_5m", with = "duration")]
    pub retry_max: Duration,
    /// Leader election.
    #[serde(default)]
    pub lease: Lease,
    /// Eviction of controller-owned Pods still in the kubelet's pull
    /// back-off after their image was mirrored again.
    #[serde(default)]
    pub evict: Evict,
}

impl Default for Recovery {
    fn default() -> Self {
        Self {
            enabled: true,
            namespaces: Vec::new(),
            retry_initial: d_5s(),
            retry_max: d_5m(),
            lease: Lease::default(),
            evict: Evict::default(),
        }
    }
}

/// The backfill (docs/architecture.md §3 "Background"): the leader mirrors
/// the images running Pods and workload templates name that the target does
/// not hold yet. It runs where the Pod watcher runs (`recovery.enabled`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, concurrency: 2}"
)]
pub struct Backfill {
    /// Mirror what is already running, and watch workload templates.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Images the backfill copies at once, apart from admission's copies.
    #[serde(default = "backfill_concurrency")]
    pub concurrency: usize,
}

impl Default for Backfill {
    fn default() -> Self {
        Self {
            enabled: true,
            concurrency: backfill_concurrency(),
        }
    }
}

/// Evicting Pods stuck in `ImagePullBackOff` after a late re-mirror
/// (docs/operations.md "Recovery timeline"). Off by default: an eviction
/// disrupts, and operators opt in.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {enabled: true, after: 30s, perMinute: 10}"
)]
pub struct Evict {
    /// Evict (through the Eviction API) Pods with a controller that still
    /// fail to pull an image pinswap has mirrored again.
    #[serde(default)]
    pub enabled: bool,
    /// Only Pods whose first pull failure on the image is older than this.
    #[serde(default = "d_30s", with = "duration")]
    pub after: Duration,
    /// At most this many evictions in any minute.
    #[serde(default = "evict_per_minute")]
    pub per_minute: u32,
}

impl Default for Evict {
    fn default() -> Self {
        Self {
            enabled: false,
            after: d_30s(),
            per_minute: evict_per_minute(),
        }
    }
}

fn backfill_concurrency() -> usize {
    2
}

/// How copies share their slots and how long one may take
/// (docs/configuration.md "copy"): a source that answers slowly on purpose
/// must not hold back every other copy.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {timeout: 30m, concurrency: 5}"
)]
pub struct Copying {
    /// A copy (an image with its children and blobs, or one follow of its
    /// referrers) still running after this is cut and fails.
    #[serde(default = "d_30m", with = "duration")]
    pub timeout: Duration,
    /// A blob transfer that carries fewer bytes than this per second,
    /// averaged over each `transferRateWindow`, is cut; 0 turns it off.
    #[serde(default = "min_transfer_rate")]
    pub min_transfer_rate: ByteRate,
    /// The window `minTransferRate` is measured over.
    #[serde(default = "d_30s", with = "duration")]
    pub transfer_rate_window: Duration,
    /// Requests that copies hold a slot for at once (blob transfers,
    /// manifest reads, HEADs), over all copies, and background copies at
    /// once; recovery's copies have as many slots again of their own.
    #[serde(default = "copy_concurrency")]
    pub concurrency: usize,
    /// Of those slots, at most this many for one source registry.
    #[serde(default = "copy_concurrency_per_registry")]
    pub concurrency_per_registry: usize,
}

impl Default for Copying {
    fn default() -> Self {
        Self {
            timeout: d_30m(),
            min_transfer_rate: min_transfer_rate(),
            transfer_rate_window: d_30s(),
            concurrency: copy_concurrency(),
            concurrency_per_registry: copy_concurrency_per_registry(),
        }
    }
}

impl Copying {
    fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        let d = |v: Duration| humantime::format_duration(v).to_string();
        if self.timeout < Duration::from_secs(1) {
            bad(
                format!("{path}.timeout"),
                format!("found {}, expected at least 1s, e.g. 30m", d(self.timeout)),
            );
        }
        let w = self.transfer_rate_window;
        if w < Duration::from_secs(1) || w > Duration::from_secs(3600) {
            bad(
                format!("{path}.transferRateWindow"),
                format!("found {}, expected 1s to 1h, e.g. 30s", d(w)),
            );
        }
        if !(1..=MAX_COPY_CONCURRENCY).contains(&self.concurrency) {
            bad(
                format!("{path}.concurrency"),
                format!(
                    "found {}, expected 1 to {MAX_COPY_CONCURRENCY}",
                    self.concurrency
                ),
            );
        } else if !(1..=self.concurrency).contains(&self.concurrency_per_registry) {
            bad(
                format!("{path}.concurrencyPerRegistry"),
                format!(
                    "found {}, expected 1 to {path}.concurrency ({}); below it, one registry cannot hold every slot",
                    self.concurrency_per_registry, self.concurrency
                ),
            );
        }
    }
}

/// A byte count as YAML gives it: a number, or a string with a unit.
#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    N(u64),
    S(String),
}

/// Bytes per second: a number, or a size such as `32Ki`, `1Mi` or `100k`,
/// optionally followed by `/s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct ByteRate(pub u64);

impl<'de> Deserialize<'de> for ByteRate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const EXPECTED: &str =
            "expected bytes per second such as 32Ki, 1Mi or 100k (0 turns the floor off)";
        match Raw::deserialize(d).map_err(|_| own_error(EXPECTED))? {
            Raw::N(n) => Ok(ByteRate(n)),
            Raw::S(s) => match Memory::parse(s.strip_suffix("/s").unwrap_or(&s)) {
                Ok(Memory::Bytes(n)) => Ok(ByteRate(n)),
                _ => Err(own_error(format!("found {s:?}, {EXPECTED}"))),
            },
        }
    }
}

/// One more than the 4 slots copies had before slots were shared by
/// registry, so one registry alone still gets 4.
fn copy_concurrency() -> usize {
    5
}

/// One less than the default `copy.concurrency`: one slot is always left
/// for the other registries.
fn copy_concurrency_per_registry() -> usize {
    4
}

fn min_transfer_rate() -> ByteRate {
    ByteRate(32 * 1024)
}

/// The largest `copy.concurrency`.
pub const MAX_COPY_CONCURRENCY: usize = 64;

/// The most images the backfill copies at once.
pub const MAX_BACKFILL_CONCURRENCY: usize = 64;

fn evict_per_minute() -> u32 {
    10
}

/// The largest `recovery.evict.perMinute`: a bound, not a firehose.
pub const EVICT_PER_MINUTE_MAX: u32 = 600;

/// The `coordination.k8s.io/v1` Lease that elects the recovery leader, with
/// client-go's leader-election timings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {name: pinswap-leader, duration: 15s}"
)]
pub struct Lease {
    /// Lease name.
    #[serde(default = "lease_name")]
    pub name: String,
    /// Lease namespace; empty for the namespace pinswap runs in.
    #[serde(default)]
    pub namespace: String,
    /// How long a Lease is held without renewal before others may take it.
    #[serde(default = "d_15s", with = "duration")]
    pub duration: Duration,
    /// The leader stops its background work when it could not renew for
    /// this long (less than `duration`, so it stops before anyone takes over).
    #[serde(default = "d_10s", with = "duration")]
    pub renew_deadline: Duration,
    /// How often the Lease is renewed or tried.
    #[serde(default = "d_2s", with = "duration")]
    pub retry_period: Duration,
}

impl Default for Lease {
    fn default() -> Self {
        Self {
            name: lease_name(),
            namespace: String::new(),
            duration: d_15s(),
            renew_deadline: d_10s(),
            retry_period: d_2s(),
        }
    }
}

fn lease_name() -> String {
    "pinswap-leader".into()
}

/// Image-identity handling (docs/architecture.md §2 "identity collision").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {collisions: warn, scanRate: 10}"
)]
pub struct Identity {
    /// `warn`, `repair` or `deny`.
    #[serde(default)]
    pub collisions: CollisionPolicy,
    /// Tags per second read from the target at startup to rebuild the
    /// config-digest record, so a restart doesn't forget a collision; `0`
    /// turns the scan off.
    #[serde(default = "scan_rate")]
    pub scan_rate: u32,
}

impl Default for Identity {
    fn default() -> Self {
        Self {
            collisions: CollisionPolicy::default(),
            scan_rate: scan_rate(),
        }
    }
}

fn scan_rate() -> u32 {
    10
}

/// Listen addresses, TLS files and the admission budget.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {listen: 0.0.0.0:8443, admissionBudget: 2s}"
)]
pub struct Server {
    /// HTTPS webhook address.
    #[serde(default = "listen", deserialize_with = "socket_addr")]
    pub listen: std::net::SocketAddr,
    /// Plain-HTTP health and metrics address.
    #[serde(default = "health_listen", deserialize_with = "socket_addr")]
    pub health_listen: std::net::SocketAddr,
    /// PEM certificate chain for the webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for the webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Time budget of one admission.
    #[serde(default = "d_2s", with = "duration")]
    pub admission_budget: Duration,
    /// Distinct images decided per review; the rest are left unchanged.
    #[serde(default = "max_images")]
    pub max_images: usize,
    /// Time a new connection has to finish its TLS handshake.
    #[serde(default = "d_5s", with = "duration")]
    pub tls_handshake_timeout: Duration,
    /// Time a client has to send a request's headers: on a new connection
    /// from the handshake, on a kept-alive one from the first byte.
    #[serde(default = "d_5s", with = "duration")]
    pub header_read_timeout: Duration,
    /// Time a client has to send a request body, from its headers.
    #[serde(default = "d_5s", with = "duration")]
    pub body_timeout: Duration,
    /// Time a kept-alive connection may wait for its next request.
    #[serde(default = "d_120s", with = "duration")]
    pub idle_timeout: Duration,
    /// Open webhook connections; at the limit the idlest is closed.
    #[serde(default = "max_connections")]
    pub max_connections: usize,
    /// HTTP/2 streams one connection may have open at once.
    #[serde(default = "max_concurrent_streams")]
    pub max_concurrent_streams: u32,
    /// Request bodies buffered at once, over all connections: bytes
    /// (`128Mi`) or a share of the container's memory limit (`25%`).
    #[serde(default)]
    pub body_memory: Memory,
    /// How long the webhook keeps serving after SIGTERM, with `/readyz`
    /// failing, before it stops accepting connections.
    #[serde(default = "d_10s", with = "duration")]
    pub shutdown_delay: Duration,
    /// How long requests in flight may take to finish after the delay.
    #[serde(default = "d_10s", with = "duration")]
    pub drain_timeout: Duration,
}

impl Default for Server {
    fn default() -> Self {
        Self {
            listen: listen(),
            health_listen: health_listen(),
            tls_cert: None,
            tls_key: None,
            admission_budget: d_2s(),
            max_images: max_images(),
            tls_handshake_timeout: d_5s(),
            header_read_timeout: d_5s(),
            body_timeout: d_5s(),
            idle_timeout: d_120s(),
            max_connections: max_connections(),
            max_concurrent_streams: max_concurrent_streams(),
            body_memory: Memory::default(),
            shutdown_delay: d_10s(),
            drain_timeout: d_10s(),
        }
    }
}

fn max_images() -> usize {
    256
}
fn max_connections() -> usize {
    1000
}
fn max_concurrent_streams() -> u32 {
    32
}
fn d_120s() -> Duration {
    Duration::from_secs(120)
}

/// An amount of memory: a byte count or a percentage of the container's
/// memory limit. Written as `64Mi`, `1Gi`, `500M`, `1048576` or `25%`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Bytes.
    Bytes(u64),
    /// Percent (1 to 100) of the container's memory limit.
    Percent(u8),
}

impl Default for Memory {
    fn default() -> Self {
        Memory::Percent(25)
    }
}

/// The memory limit assumed when no cgroup limit is found: the limit
/// `pinswap manifests` sets.
pub const ASSUMED_MEMORY_LIMIT: u64 = 512 * 1024 * 1024;

/// A memory size that [`Memory::parse`] does not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "found {found:?}, expected bytes such as 64Mi, 1Gi or 500M, or a share of the memory limit such as 25%{}",
    if *percent { " (1% to 100%)" } else { "" }
)]
pub struct InvalidMemory {
    /// The value given.
    pub found: String,
    /// Whether it was a percentage out of range.
    pub percent: bool,
}

impl Memory {
    /// Parses `64Mi`, `1Gi`, `500M`, `1048576` or `25%`.
    ///
    /// # Errors
    /// A message naming the accepted forms.
    pub fn parse(s: &str) -> Result<Self, InvalidMemory> {
        let invalid = |percent| InvalidMemory {
            found: s.to_owned(),
            percent,
        };
        if let Some(p) = s.strip_suffix('%') {
            return match p.parse::<u8>() {
                Ok(n @ 1..=100) => Ok(Memory::Percent(n)),
                _ => Err(invalid(true)),
            };
        }
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let scale: u64 = match unit {
            "" => 1,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "k" => 1000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            _ => return Err(invalid(false)),
        };
        digits
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(scale))
            .map(Memory::Bytes)
            .ok_or_else(|| invalid(false))
    }

    /// The byte count, with a percentage taken of `limit`.
    pub fn bytes(self, limit: u64) -> u64 {
        match self {
            Memory::Bytes(n) => n,
            Memory::Percent(p) => limit / 100 * u64::from(p),
        }
    }
}

impl<'de> Deserialize<'de> for Memory {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Raw::deserialize(d).map_err(|_| {
            own_error("expected bytes such as 64Mi, 1Gi or 500M, or a share of the memory limit such as 25%")
        })? {
            Raw::N(n) => Ok(Memory::Bytes(n)),
            Raw::S(s) => Memory::parse(&s).map_err(own_error),
        }
    }
}

impl Serialize for Memory {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Memory::Bytes(n) => s.serialize_u64(*n),
            Memory::Percent(p) => s.serialize_str(&format!("{p}%")),
        }
    }
}

fn listen() -> std::net::SocketAddr {
    ([0, 0, 0, 0], 8443).into()
}
fn health_listen() -> std::net::SocketAddr {
    ([0, 0, 0, 0], 8080).into()
}
fn d_1s() -> Duration {
    Duration::from_secs(1)
}
fn d_2s() -> Duration {
    Duration::from_secs(2)
}
fn d_5s() -> Duration {
    Duration::from_secs(5)
}
fn d_10s() -> Duration {
    Duration::from_secs(10)
}
fn d_15s() -> Duration {
    Duration::from_secs(15)
}
fn d_5m() -> Duration {
    Duration::from_secs(300)
}
fn d_30s() -> Duration {
    Duration::from_secs(30)
}
fn d_24h() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn d_10m() -> Duration {
    Duration::from_secs(600)
}
fn d_1h() -> Duration {
    Duration::from_secs(3600)
}
fn d_30m() -> Duration {
    Duration::from_secs(1800)
}
fn yes() -> bool {
    true
}

/// The whole config. Every key but `target` has a default.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping of settings such as {target: {registry: mirror.example.com/cache}}"
)]
pub struct Config {
    /// Where images are mirrored to.
    pub target: Target,
    /// Where they may come from.
    #[serde(default)]
    pub source: Source,
    /// Which Pods pinswap handles, beyond the built-in exclusions.
    #[serde(default)]
    pub scope: Scope,
    /// Pods mirrored but admitted as written (no rewrite, no annotation).
    #[serde(default)]
    pub mirror_only: MirrorOnly,
    /// Images named in custom resources, copied ahead of their Pods.
    #[serde(default)]
    pub custom_resources: CustomResources,
    /// New nodes pull the working set before they take Pods.
    #[serde(default)]
    pub prewarm: Prewarm,
    /// `exists` or `always`.
    #[serde(default)]
    pub swap_policy: SwapPolicy,
    /// `delayed`, `immediate`, `force` or `none`.
    #[serde(default)]
    pub copy_policy: CopyPolicy,
    /// How long `immediate` and `force` wait for a copy. Default 2s, the
    /// default `server.admissionBudget`: an admission never waits longer.
    #[serde(default = "d_2s", with = "duration")]
    pub copy_deadline: Duration,
    /// Rewrite to `target:tag@sha256:...`.
    #[serde(default = "yes")]
    pub pin: bool,
    /// Rewrite containers whose `imagePullPolicy` is `Never` too. Off by
    /// default: the kubelet then only looks on the node, which holds the
    /// original image (preloaded, `kind load`), not the mirror's name.
    #[serde(default)]
    pub rewrite_image_pull_policy_never: bool,
    /// `all` or a platform list.
    #[serde(default)]
    pub platforms: Platforms,
    /// Which referrers (signatures, attestations, SBOMs) travel with an
    /// image.
    #[serde(default)]
    pub referrers: Referrers,
    /// Cache lifetimes.
    #[serde(default)]
    pub cache: Cache,
    /// Identity-collision handling.
    #[serde(default)]
    pub identity: Identity,
    /// Pull-failure recovery and leader election.
    #[serde(default)]
    pub recovery: Recovery,
    /// Mirroring what already runs.
    #[serde(default)]
    pub backfill: Backfill,
    /// Copy slots and how long a copy may take.
    #[serde(default)]
    pub copy: Copying,
    /// Removal of mirrored images nothing uses any more.
    #[serde(default)]
    pub retention: Retention,
    /// This cluster's name: in logs, metrics and, with `sharing`, its
    /// usage record at the target.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Several clusters sharing one target.
    #[serde(default)]
    pub sharing: Sharing,
    /// `open` or `closed`.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Server settings.
    #[serde(default)]
    pub server: Server,
}

/// The API server's upper bound on a webhook's `timeoutSeconds`.
const WEBHOOK_TIMEOUT_MAX: Duration = Duration::from_secs(30);

impl Config {
    /// Parses and validates YAML; `file` names the source in messages.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] for syntax, unknown keys and wrong types (the
    /// first one, with line and column); [`ConfigError::Invalid`] listing
    /// every semantic problem.
    pub fn from_yaml(text: &str, file: &str) -> Result<Self, ConfigError> {
        let de = yaml_serde::Deserializer::from_str(text);
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let (line, column) = inner
                .location()
                .map(|l| (l.line(), l.column()))
                .unwrap_or((0, 0));
            let mut message = inner.to_string();
            // yaml_serde appends " at line L column C" (we print it up front)
            // and, for its own errors, prefixes a path we already print.
            if let Some(i) = message.find(" at line ") {
                message.truncate(i);
            }
            if let Some((head, rest)) = message.split_once(": ")
                && (path == head || path.starts_with(&format!("{head}.")))
            {
                message = rest.to_owned();
            }
            // Errors raised by our own field parsers carry no position of
            // their own; the key path locates them instead.
            let own = message.starts_with(OWN_ERROR);
            if own {
                message = message.replacen(OWN_ERROR, "", 1);
            }
            let (line, column) = if own || ((line, column) == (1, 1) && path != ".") {
                (0, 0)
            } else {
                (line, column)
            };
            let mut message = in_user_terms(&message);
            // A string where an auth block belongs may be a password
            // written inline: say what was wrong without echoing it.
            if path.split('.').any(|k| k == "auth")
                && let Some(rest) = message.strip_prefix("invalid type: string \"")
                && let Some(i) = rest.rfind("\", expected ")
            {
                message = format!("invalid type: string, {}", &rest[i + 3..]);
            }
            let swapper = k8s_image_swapper_keys(text);
            if !swapper.is_empty() {
                return ConfigError::K8sImageSwapper {
                    file: file.to_owned(),
                    keys: swapper.join(", "),
                };
            }
            ConfigError::Parse {
                file: file.to_owned(),
                path,
                line,
                column,
                message,
            }
        })?;
        let written = config.target.registry.clone();
        if let Some(aws) = &config.target.aws {
            let r = &mut config.target.registry;
            match aws.prefix() {
                _ if r.is_empty() => *r = aws.registry(),
                Some(p) if !r.contains('/') => *r = format!("{r}/{p}"),
                _ => {}
            }
        }
        let problems = config.problems(file, &written);
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Whether the backfill runs: `backfill.enabled`, unless `copyPolicy`
    /// is `none`. The backfill only copies, and `none` copies nothing.
    /// The leader's watches and the install's RBAC follow this.
    pub fn backfills(&self) -> bool {
        self.backfill.enabled && self.copy_policy != CopyPolicy::None
    }

    /// Whether the leader watches workload templates (for the backfill or
    /// retention); the install grants their `list` and `watch` then.
    pub fn watches_workloads(&self) -> bool {
        self.backfills() || self.retention.enabled || self.sharing.enabled || self.prewarm.enabled
    }

    /// Whether `copyPolicy` waits for copies (`immediate`, `force`) longer
    /// than an admission may: `copyDeadline` above `server.admissionBudget`.
    /// `serve` warns then, since the budget cuts the wait short.
    pub fn copy_deadline_exceeds_budget(&self) -> bool {
        matches!(self.copy_policy, CopyPolicy::Immediate | CopyPolicy::Force)
            && self.copy_deadline > self.server.admission_budget
    }

    /// What loads but will not work as written: the placeholder target,
    /// and a `copyDeadline` the admission budget cuts short (which `serve`
    /// warns about at startup). `file` names the source in messages.
    pub fn warnings(&self, file: &str) -> Vec<Warning> {
        let mut out = Vec::new();
        let mut warn = |path: &str, message: String| {
            out.push(Warning {
                file: file.to_owned(),
                path: path.to_owned(),
                message,
            })
        };
        let registry = &self.target.registry;
        let host = registry.split('/').next().unwrap_or_default();
        let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
        if registry == PLACEHOLDER_REGISTRY {
            warn(
                "target.registry",
                format!(
                    "{registry} is the placeholder `pinswap config default` writes; set the registry to mirror into, HOST[:PORT][/prefix]"
                ),
            );
        } else if ["example.com", "example.net", "example.org"]
            .iter()
            .any(|d| host == *d || host.ends_with(&format!(".{d}")))
        {
            // Reserved for documentation (RFC 2606): no registry answers there.
            warn(
                "target.registry",
                format!(
                    "{host} is a documentation domain that no registry answers on; set the registry to mirror into, HOST[:PORT][/prefix]"
                ),
            );
        }
        if self.copy_deadline_exceeds_budget() {
            let d = |v: Duration| humantime::format_duration(v).to_string();
            warn(
                "copyDeadline",
                format!(
                    "found {} with copyPolicy {}, longer than server.admissionBudget ({}): an admission waits for a copy at most the budget; raise server.admissionBudget too, or lower copyDeadline",
                    d(self.copy_deadline),
                    if self.copy_policy == CopyPolicy::Force {
                        "force"
                    } else {
                        "immediate"
                    },
                    d(self.server.admission_budget)
                ),
            );
        }
        out
    }

    /// Reads, parses and validates a config file.
    ///
    /// # Errors
    /// [`ConfigError::Read`], or as [`Config::from_yaml`].
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        Self::from_yaml(&text, &file)
    }

    /// Every semantic problem, in key order; `written` is `target.registry`
    /// as the file has it (before `target.aws` fills it in).
    fn problems(&self, file: &str, written: &str) -> Vec<Invalid> {
        let mut out = Vec::new();
        let mut bad = |path: String, message: String| {
            out.push(Invalid {
                file: file.to_owned(),
                path,
                message,
            })
        };
        if let Some(aws) = &self.target.aws {
            aws.problems("target.aws", written, &mut bad);
            if self.target.auth.is_some() {
                bad(
                    "target.auth".into(),
                    "is not used with target.aws: pinswap signs in to ECR with GetAuthorizationToken; remove one".into(),
                );
            }
        }
        if self.target.registry.is_empty() {
            bad(
                "target.registry".into(),
                "missing; expected HOST[:PORT][/prefix], e.g. mirror.example.com/cache, or target.aws for Amazon ECR".into(),
            );
        } else if let Err(e) = MirrorTarget::parse(&self.target.registry) {
            bad(
                "target.registry".into(),
                format!("{e}; expected HOST[:PORT][/prefix], e.g. mirror.example.com/cache"),
            );
        }
        check_auth(self.target.auth.as_ref(), "target.auth", &mut bad);
        if self.source.registries.is_empty() {
            bad(
                "source.registries".into(),
                "found an empty list; list the registries to mirror from, or \"*\" for any".into(),
            );
        }
        let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (i, r) in self.source.registries.iter().enumerate() {
            let path = format!("source.registries[{i}]");
            // Settings are looked up by normalised host: two entries for one
            // registry would fight over its credentials and plain-HTTP flag.
            let host = crate::reference::normalize_registry(&r.registry);
            if let Some(&first) = seen.get(&host) {
                bad(
                    format!("{path}.registry"),
                    format!(
                        "{:?} is the same registry as source.registries[{first}] ({host}); list it once",
                        r.registry
                    ),
                );
            } else {
                seen.insert(host, i);
            }
            if r.registry != "*" && !is_registry_host(&r.registry) {
                bad(
                    format!("{path}.registry"),
                    format!(
                        "found {:?}, expected HOST[:PORT] (no scheme, no path) or \"*\"",
                        r.registry
                    ),
                );
            }
            check_auth(r.auth.as_ref(), &format!("{path}.auth"), &mut bad);
            // Settings are looked up by the registry's own host, so on "*"
            // they would silently never apply.
            if r.registry == "*" && (r.insecure || r.auth.is_some()) {
                let key = if r.insecure { "insecure" } else { "auth" };
                bad(
                    format!("{path}.{key}"),
                    "has no effect on \"*\"; add an entry for the registry itself (e.g. {registry: registry.example.com, insecure: true})".into(),
                );
            }
        }
        for (i, r) in self.source.registries.iter().enumerate() {
            if r.visibility == Visibility::Private && !self.source.image_pull_secrets {
                bad(
                    format!("source.registries[{i}].visibility"),
                    "private needs source.imagePullSecrets: true: without a Pod's own pull secrets no Pod can prove access, and only public images would ever be rewritten".into(),
                );
            }
        }
        let (ttl, grace) = (self.source.proof_ttl, self.source.proof_grace);
        if ttl.is_zero() {
            bad(
                "source.proofTtl".into(),
                "found 0s, expected a duration of at least 1s, e.g. 10m".into(),
            );
        }
        if grace < ttl {
            bad(
                "source.proofGrace".into(),
                format!(
                    "found {}, expected at least source.proofTtl ({})",
                    humantime::format_duration(grace),
                    humantime::format_duration(ttl)
                ),
            );
        }
        for (i, f) in self.source.filters.iter().enumerate() {
            if let Some(why) = jmespath_problem(&f.jmespath) {
                bad(format!("source.filters[{i}].jmespath"), why);
            }
        }
        let t = self.source.timeout;
        if t.is_zero() || t > WEBHOOK_TIMEOUT_MAX {
            bad(
                "source.timeout".into(),
                format!(
                    "found {}, expected more than 0s and at most 30s",
                    humantime::format_duration(t)
                ),
            );
        }
        let b = &self.source.breaker;
        if !(1..=100).contains(&b.failures) {
            bad(
                "source.breaker.failures".into(),
                format!("found {}, expected 1 to 100", b.failures),
            );
        }
        if b.backoff.is_zero() || b.backoff > b.max_backoff {
            bad(
                "source.breaker.backoff".into(),
                format!(
                    "found {}, expected more than 0s and at most source.breaker.maxBackoff ({})",
                    humantime::format_duration(b.backoff),
                    humantime::format_duration(b.max_backoff)
                ),
            );
        }
        self.scope.problems("scope", &mut bad);
        self.mirror_only.problems("mirrorOnly", &mut bad);
        self.custom_resources.problems("customResources", &mut bad);
        self.prewarm.problems("prewarm", &mut bad);
        if self.copy_deadline.is_zero() || self.copy_deadline > WEBHOOK_TIMEOUT_MAX {
            bad(
                "copyDeadline".into(),
                format!(
                    "found {}, expected more than 0s and at most 30s (the API server's webhook timeout limit)",
                    humantime::format_duration(self.copy_deadline)
                ),
            );
        }
        let budget = self.server.admission_budget;
        if budget.is_zero() || budget > WEBHOOK_TIMEOUT_MAX {
            bad(
                "server.admissionBudget".into(),
                format!(
                    "found {}, expected more than 0s and at most 30s",
                    humantime::format_duration(budget)
                ),
            );
        }
        if !(0.0..=0.5).contains(&self.cache.jitter) {
            bad(
                "cache.jitter".into(),
                format!(
                    "found {}, expected a fraction of the TTL from 0 to 0.5",
                    self.cache.jitter
                ),
            );
        }
        for (i, ns) in self.recovery.namespaces.iter().enumerate() {
            if !is_dns_label(ns) {
                bad(
                    format!("recovery.namespaces[{i}]"),
                    format!("found {ns:?}, expected a namespace name (a DNS-1123 label)"),
                );
            } else if let Some(first) = self.recovery.namespaces[..i].iter().position(|n| n == ns) {
                // Each namespace gets one watch; two would share its list.
                bad(
                    format!("recovery.namespaces[{i}]"),
                    format!("found {ns:?} again (first at recovery.namespaces[{first}])"),
                );
            }
        }
        if self.recovery.retry_initial.is_zero()
            || self.recovery.retry_initial > self.recovery.retry_max
        {
            bad(
                "recovery.retryInitial".into(),
                format!(
                    "found {}, expected more than 0s and at most recovery.retryMax ({})",
                    humantime::format_duration(self.recovery.retry_initial),
                    humantime::format_duration(self.recovery.retry_max)
                ),
            );
        }
        let e = &self.recovery.evict;
        if e.per_minute == 0 || e.per_minute > EVICT_PER_MINUTE_MAX {
            bad(
                "recovery.evict.perMinute".into(),
                format!(
                    "found {}, expected 1 to {EVICT_PER_MINUTE_MAX} (set recovery.evict.enabled: false to evict nothing)",
                    e.per_minute
                ),
            );
        }
        if e.after > Duration::from_secs(3600) {
            bad(
                "recovery.evict.after".into(),
                format!(
                    "found {}, expected at most 1h (the kubelet retries a pull every 5m at the longest)",
                    humantime::format_duration(e.after)
                ),
            );
        }
        if e.enabled && !self.recovery.enabled {
            bad(
                "recovery.evict.enabled".into(),
                "found true with recovery.enabled: false; eviction follows a recovery's re-mirror, so it needs recovery on".into(),
            );
        }
        if self.prewarm.enabled && !self.recovery.enabled {
            bad(
                "prewarm.enabled".into(),
                "found true with recovery.enabled: false; the warm set is chosen and published by the leader, which runs with recovery on".into(),
            );
        }
        let l = &self.recovery.lease;
        if !is_dns_subdomain(&l.name) {
            bad(
                "recovery.lease.name".into(),
                format!("found {:?}, expected a DNS-1123 subdomain", l.name),
            );
        }
        if !l.namespace.is_empty() && !is_dns_label(&l.namespace) {
            bad(
                "recovery.lease.namespace".into(),
                format!(
                    "found {:?}, expected a namespace name or empty",
                    l.namespace
                ),
            );
        }
        // client-go's rule: retryPeriod < renewDeadline < duration, so the
        // leader stops before its Lease can expire under it.
        if l.retry_period.is_zero()
            || l.retry_period >= l.renew_deadline
            || l.renew_deadline >= l.duration
        {
            bad(
                "recovery.lease".into(),
                format!(
                    "found retryPeriod {}, renewDeadline {}, duration {}; expected 0 < retryPeriod < renewDeadline < duration",
                    humantime::format_duration(l.retry_period),
                    humantime::format_duration(l.renew_deadline),
                    humantime::format_duration(l.duration)
                ),
            );
        } else if l.duration.subsec_nanos() != 0 {
            bad(
                "recovery.lease.duration".into(),
                format!(
                    "found {}, expected whole seconds (a Lease stores leaseDurationSeconds)",
                    humantime::format_duration(l.duration)
                ),
            );
        }
        if !(1..=MAX_BACKFILL_CONCURRENCY).contains(&self.backfill.concurrency) {
            bad(
                "backfill.concurrency".into(),
                format!(
                    "found {}, expected 1 to {MAX_BACKFILL_CONCURRENCY}",
                    self.backfill.concurrency
                ),
            );
        }
        self.copy.problems("copy", &mut bad);
        self.retention
            .problems("retention", &self.recovery, &mut bad);
        self.sharing
            .problems(self.cluster.as_deref(), self, &mut bad);
        self.server_problems(&mut bad);
        if self.server.tls_cert.is_some() != self.server.tls_key.is_some() {
            bad(
                "server".into(),
                "tlsCert and tlsKey go together: set both or neither".into(),
            );
        }
        // Port 0 asks for any free port, so two of them never clash.
        if self.server.listen == self.server.health_listen && self.server.listen.port() != 0 {
            bad(
                "server.healthListen".into(),
                format!(
                    "found {}, the same address as server.listen",
                    self.server.health_listen
                ),
            );
        }
        out
    }
}

impl Config {
    /// The `server` timeouts and limits that cannot work.
    fn server_problems(&self, bad: &mut impl FnMut(String, String)) {
        let s = &self.server;
        let d = |v: Duration| humantime::format_duration(v).to_string();
        for (key, v) in [
            ("tlsHandshakeTimeout", s.tls_handshake_timeout),
            ("headerReadTimeout", s.header_read_timeout),
            ("bodyTimeout", s.body_timeout),
            ("idleTimeout", s.idle_timeout),
            ("drainTimeout", s.drain_timeout),
        ] {
            if v.is_zero() {
                bad(
                    format!("server.{key}"),
                    "found 0s, expected a duration above 0s such as 5s".into(),
                );
            }
        }
        // Headers, body and the admission all happen inside one call of the
        // API server, which gives up after the webhook's timeoutSeconds.
        // Saturating: each is a humantime duration of up to u64::MAX seconds.
        let request = s
            .header_read_timeout
            .saturating_add(s.body_timeout)
            .saturating_add(s.admission_budget);
        if request > WEBHOOK_TIMEOUT_MAX {
            bad(
                "server.bodyTimeout".into(),
                format!(
                    "headerReadTimeout {} + bodyTimeout {} + admissionBudget {} is {}, expected at most 30s (the API server's webhook timeout limit)",
                    d(s.header_read_timeout),
                    d(s.body_timeout),
                    d(s.admission_budget),
                    d(request)
                ),
            );
        }
        if s.max_images == 0 {
            bad(
                "server.maxImages".into(),
                "found 0, expected at least 1".into(),
            );
        }
        if s.max_connections == 0 {
            bad(
                "server.maxConnections".into(),
                "found 0, expected at least 1".into(),
            );
        }
        if s.max_concurrent_streams == 0 {
            bad(
                "server.maxConcurrentStreams".into(),
                "found 0, expected at least 1".into(),
            );
        }
        if let Memory::Bytes(n) = s.body_memory
            && n < MIN_BODY_MEMORY
        {
            bad(
                "server.bodyMemory".into(),
                format!(
                    "found {n} bytes, expected at least 64Mi (its large half holds one 1Mi review while it is parsed, 32 times its body)"
                ),
            );
        }
    }
}

/// The smallest `server.bodyMemory`: its large half holds one 1 MiB review
/// while it is parsed (32 times its body, `server::PARSED_FACTOR`).
pub const MIN_BODY_MEMORY: u64 = 64 * 1024 * 1024;

fn is_registry_host(s: &str) -> bool {
    !s.is_empty()
        && !s.contains('/')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
}

/// What is wrong with JMESPath expression `e`, on one line; `None` when it
/// compiles.
pub(crate) fn jmespath_problem(e: &str) -> Option<String> {
    let why = jmespath::compile(e).err()?;
    Some(format!(
        "not a valid JMESPath expression: {}",
        why.to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    ))
}

/// A DNS-1123 label, as Kubernetes requires of namespace names.
pub(crate) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain, as Kubernetes requires of most object names.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn check_auth(auth: Option<&Auth>, path: &str, bad: &mut impl FnMut(String, String)) {
    let Some(a) = auth else { return };
    if a.password.is_some() {
        bad(
            format!("{path}.password"),
            "inline secrets are not accepted; use passwordFile or passwordEnv".into(),
        );
    }
    let sources = [
        a.password_file.is_some(),
        a.password_env.is_some(),
        a.docker_config_file.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if sources > 1 {
        bad(
            path.to_owned(),
            "found more than one of passwordFile, passwordEnv and dockerConfigFile; use one".into(),
        );
    }
    if (a.password_file.is_some() || a.password_env.is_some()) && a.username.is_none() {
        bad(
            format!("{path}.username"),
            "missing; passwordFile and passwordEnv need a username".into(),
        );
    }
    if sources == 0 && a.password.is_none() {
        bad(
            path.to_owned(),
            "found no credentials; set username with passwordFile or passwordEnv, or dockerConfigFile"
                .into(),
        );
    }
}

/// The commented default config printed by `pinswap config default`. A test
/// checks that it parses to [`Config`]'s defaults with this target.
pub const DEFAULT_YAML: &str = r#"# pinswap config. Every key but target.registry has the default shown.

target:
  # Registry (and optional path prefix) to mirror into: HOST[:PORT][/prefix].
  registry: mirror.example.com/cache
  # Allow plain HTTP to the target.
  insecure: false
  # Credentials, by reference only (never inline):
  # auth:
  #   username: pinswap
  #   passwordFile: /var/run/secrets/pinswap/target-password
  #   # or passwordEnv: PINSWAP_TARGET_PASSWORD (not under `pinswap manifests`)
  #   # or dockerConfigFile: /var/run/secrets/pinswap/config.json

source:
  # Registries that may be mirrored; no other registry is ever contacted.
  # "*" allows any (link-local and metadata addresses stay refused).
  registries:
    - registry: docker.io
      # With imagePullSecrets, images a Pod's own pull secret reads are
      # private; `visibility: private` makes images this entry's auth reads
      # private too (only public images are shared then).
      # visibility: auto
  # JMESPath over {"obj": <Pod>, "container": <container>}; true skips the container.
  filters: []
  #  - jmespath: "obj.metadata.namespace == 'kube-system'"
  # Authenticate to sources with the Pod's imagePullSecrets (and its
  # ServiceAccount's), read through the Kubernetes API. An image that needs
  # them is private: a Pod gets the mirror's copy only when its own pull
  # secrets read that digest at the source (docs/security.md).
  imagePullSecrets: false
  # How long such a proof counts, and how long it still counts while the
  # source cannot answer.
  proofTtl: 10m
  proofGrace: 24h

scope:
  # Which Pods pinswap handles, beyond the built-in exclusions (its own
  # namespace, kube-system, and namespaces or Pods labelled
  # pinswap.dev/ignore=true): label selectors that the webhook's
  # namespaceSelector and objectSelector get too, and that the leader's
  # backfill, recovery and eviction apply.
  namespaceSelector: {}
  #  matchLabels: {pinswap.dev/mirror: "true"}
  objectSelector: {}
  #  matchExpressions: [{key: app, operator: Exists}]

mirrorOnly:
  # Pods whose images are mirrored but which are admitted exactly as
  # written: no image rewritten, no annotation. For operators that recreate
  # a Pod whose image differs from their spec; nodes then pull from the
  # mirror through their own mirror configuration (docs/operations.md).
  profiles: []
  #  - cloudnative-pg      # instance Pods of CloudNativePG clusters
  #  - postgres-operator   # Zalando's Spilo Pods
  #  - aerospike           # Aerospike cluster Pods
  pods: []
  #  - namespaces: [payments]
  #    podSelector: {matchLabels: {app: ledger}}
  #    ownerKinds: [apps/StatefulSet]
  #    jmespath: "obj.metadata.annotations.\"example.com/managed\" == 'true'"

customResources:
  # Images named in custom resources, copied ahead of their Pods and kept
  # by retention; the objects are never changed in the cluster. Kinds
  # without their CRD are no error (docs/configuration.md#customresources).
  profiles: []
  #  - argo-workflows      # Workflow, WorkflowTemplate, CronWorkflow
  #  - tekton              # Task, Pipeline, TaskRun, PipelineRun, StepAction
  #  - knative-serving     # Service, Configuration
  #  - kubevirt            # containerDisk of VirtualMachine(Instance)
  #  - flux                # OCIRepository
  kinds: []
  #  - {group: example.com, kind: Widget, resource: widgets, paths: [spec.image]}
  discoveryInterval: 1m
  rewrite: false          # pinswap mutate rewrites their paths too

prewarm:
  # New nodes pull the images the cluster uses most from the mirror before
  # they take Pods (pinswap node-agent; docs/configuration.md#prewarm).
  enabled: false
  namespaces: []          # objects in these namespaces; empty: every namespace
  podSelector: {}         # objects whose labels it selects; empty: every object
  daemonSets: true        # every DaemonSet's images, whatever the two above say
  top: 50                 # the images most objects name, at most
  concurrency: 2          # pulls at once on a node
  maxBytes: 20Gi          # the image filesystem grows by at most this much
  freeSpaceFloor: 5Gi     # no pull starts with less free on it
  deadline: 10m           # the node is labelled and released by then, warm or not
  # startupTaint: pinswap.dev/warming   # removed from the node once it is warm

# exists: rewrite only when the target has the image; always: rewrite regardless.
swapPolicy: exists
# delayed: copy in the background; immediate: start the copy and wait up to
# copyDeadline; force: copy inline up to copyDeadline; none: never copy.
# An admission waits at most server.admissionBudget (2s), so the default
# copyDeadline is the same; raise both together to wait longer.
copyPolicy: delayed
copyDeadline: 2s
# Rewrite to target/registry/repo:tag@sha256:... (pinned by manifest digest).
pin: true
# Containers with imagePullPolicy: Never are left unchanged: the kubelet only
# looks on the node, which holds the original name. true rewrites them too.
rewriteImagePullPolicyNever: false
# Index children to mirror: all, or a list such as [linux/amd64, linux/arm64].
platforms: all
# Signatures, attestations, SBOMs and other referrers of each image follow it
# to the target (cosign's tags and OCI 1.1 referrers; docs/referrers.md).
# false turns that off; {artifactTypes: [TYPE, ...]} copies only those types.
referrers: true

cache:
  # How long "target has repository@digest" is trusted; 0s turns the cache off.
  ttl: 1h
  # How long tag -> digest resolutions are kept; 0s turns the cache off.
  resolutionTtl: 30s
  # Each entry lives up to this fraction of its TTL less, at random, so
  # entries cached together are not all re-checked at once (0 to 0.5).
  jitter: 0.1
  # How often cached target manifests are re-checked (HEAD); a missing one is
  # evicted, and mirrored again when a Pod still uses it. 0s turns it off.
  reverify: 10m
  # At most this many re-verification HEADs a second (0: no cap beyond
  # spreading each round over reverify).
  reverifyRate: 20
  # Serve POST /cache/purge on the health port (plain HTTP, no auth).
  purgeEndpoint: false

recovery:
  # Watch Pods for ErrImagePull/ImagePullBackOff on target images and mirror
  # a lost image again. Needs the Kubernetes API (pods get/list/watch,
  # events create/patch, leases get/create/update).
  enabled: true
  # Namespaces to watch; empty for all.
  namespaces: []
  # Backoff between retries of a failed re-mirror.
  retryInitial: 5s
  retryMax: 5m
  # One replica runs the watcher and the re-mirroring; a Lease elects it.
  lease:
    name: pinswap-leader
    # Empty: the namespace pinswap runs in.
    namespace: ""
    duration: 15s
    renewDeadline: 10s
    retryPeriod: 2s
  # After a re-mirror, evict Pods that still wait in ImagePullBackOff on the
  # image, so their controller replaces them at once instead of after the
  # kubelet's back-off (up to 5m). Only Pods with a controller (ReplicaSet,
  # StatefulSet, DaemonSet, Job) whose first pull failure is older than
  # `after`; through the Eviction API (PodDisruptionBudgets hold), at most
  # perMinute a minute. Needs pods/eviction create.
  evict:
    enabled: false
    after: 30s
    perMinute: 10

backfill:
  # Mirror the images that Pods already running and workload templates
  # (Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs)
  # name and the target lacks: once on becoming leader, then as they change.
  # Runs with recovery; needs list/watch on those workload kinds. Running
  # Pods are never restarted: their next replacement is rewritten.
  enabled: true
  # Images copied at once, apart from admission's copies.
  concurrency: 2

copy:
  # A copy (an image with its children and blobs, or one follow of its
  # referrers) still running after this is cut; it fails like any other and
  # is tried again by the next admission, recovery or backfill pass.
  timeout: 30m
  # A blob transfer slower than this many bytes per second, averaged over
  # each transferRateWindow, is cut (0 turns it off): a source that sends a
  # trickle holds a slot for one window, not forever.
  minTransferRate: 32Ki
  transferRateWindow: 30s
  # Slots copies share: blob transfers, manifest reads and HEADs in flight,
  # and background copies at once (recovery has as many of its own). One
  # source registry holds at most concurrencyPerRegistry of them, so a slow
  # one leaves the rest to the others.
  concurrency: 5
  concurrencyPerRegistry: 4
retention:
  # Remove images pinswap mirrored that no Pod (and no workload template)
  # has named for unusedFor. The leader does it; what may go, what stays and
  # why: docs/operations.md#retention.
  enabled: false
  unusedFor: 720h
  interval: 1h
  # Log and count what would be removed, and remove nothing.
  dryRun: false

# This cluster's name (1 to 63 lowercase letters, digits, '-' and '.'), such
# as eu-west-1: in logs, pinswap_cluster_info and, with sharing, its usage
# record's tag. None by default.
cluster: null

sharing:
  # Several clusters mirroring into one target and prefix: the leader
  # publishes what this cluster uses at <target>/pinswap-usage:<cluster>,
  # and retention keeps what any cluster's record names. Needs cluster:
  # docs/operations.md#several-clusters-one-mirror.
  enabled: false
  # Publish again this long after an image stopped being used (with
  # nothing changed, every third of staleAfter); an image new to the
  # record within checkEvery.
  interval: 5m
  checkEvery: 5s
  # A record older than this counts as using everything it lists until
  # `pinswap clusters forget NAME`.
  staleAfter: 1h
  # How long an image stays in the record after its last use here: at
  # least the longest unusedFor of the clusters sharing the target.
  keepFor: 720h

identity:
  # Config-digest (image ID) collisions: warn (annotate, Event, metric, log),
  # repair (push a copy whose config is labelled with its layers' digest, and
  # pin Pods to it) or deny (reject the Pod).
  collisions: warn
  # Tags per second read from the target at startup to rebuild the record of
  # config digests (0 turns the scan off).
  scanRate: 10

# open: on any error leave the container unchanged; closed: deny the Pod.
failurePolicy: open

server:
  listen: 0.0.0.0:8443
  healthListen: 0.0.0.0:8080
  # tlsCert: /etc/pinswap/tls/tls.crt
  # tlsKey: /etc/pinswap/tls/tls.key
  # Time budget of one admission, well under the webhook's timeoutSeconds.
  admissionBudget: 2s
  # Distinct images decided per review; the rest are left unchanged.
  maxImages: 256
  # Connection limits: a client that stalls is cut off, not waited for.
  tlsHandshakeTimeout: 5s
  # For the headers of a request: on a new connection from the handshake,
  # on a kept-alive one from the request's first byte.
  headerReadTimeout: 5s
  # For a request body, from its headers.
  bodyTimeout: 5s
  # A kept-alive connection waiting for its next request; longer than the
  # API server's 90 s, so the client closes first.
  idleTimeout: 2m
  # Open webhook connections; at the limit the idlest one is closed.
  maxConnections: 1000
  maxConcurrentStreams: 32
  # Request bodies buffered at once over all connections: bytes (128Mi) or a
  # share of the container's memory limit (25%; 512Mi is assumed without a
  # limit). Over it, requests get 503 at once.
  bodyMemory: 25%
  # After SIGTERM: keep serving with /readyz failing, then stop accepting
  # and let requests in flight finish.
  shutdownDelay: 10s
  drainTimeout: 10s
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(y: &str) -> Result<Config, ConfigError> {
        Config::from_yaml(y, "test.yaml")
    }

    #[test]
    fn waiting_policies_with_default_deadlines_fit_the_budget() {
        for policy in ["immediate", "force"] {
            let c = parse(&format!(
                "target: {{registry: m.example.com}}\ncopyPolicy: {policy}\n"
            ))
            .unwrap();
            assert!(!c.copy_deadline_exceeds_budget(), "{policy}");
            let c = parse(&format!(
                "target: {{registry: m.example.com}}\ncopyPolicy: {policy}\ncopyDeadline: 3s\n"
            ))
            .unwrap();
            assert!(c.copy_deadline_exceeds_budget(), "{policy} with 3s");
        }
    }

    #[test]
    fn copy_rates_take_sizes_per_second() {
        for (rate, bytes) in [
            ("32Ki", 32768),
            ("32Ki/s", 32768),
            ("100k", 100_000),
            ("0", 0),
        ] {
            let c = parse(&format!(
                "target: {{registry: m.example.com}}\ncopy: {{minTransferRate: \"{rate}\"}}\n"
            ))
            .unwrap();
            assert_eq!(c.copy.min_transfer_rate, ByteRate(bytes), "{rate}");
        }
        let c =
            parse("target: {registry: m.example.com}\ncopy: {minTransferRate: 4096}\n").unwrap();
        assert_eq!(c.copy.min_transfer_rate, ByteRate(4096));
        let c = parse("target: {registry: m.example.com}\ncopy: {concurrency: 1, concurrencyPerRegistry: 1}\n").unwrap();
        assert_eq!(
            (c.copy.concurrency, c.copy.concurrency_per_registry),
            (1, 1)
        );
    }

    #[test]
    fn default_yaml_is_the_defaults() {
        let c = parse(DEFAULT_YAML).unwrap();
        let minimal = parse("target: {registry: mirror.example.com/cache}\n").unwrap();
        assert_eq!(c, minimal);
        assert_eq!(c.copy_deadline, Duration::from_secs(2));
        assert_eq!(c.cache.ttl, Duration::from_secs(3600));
        assert_eq!(c.cache.resolution_ttl, Duration::from_secs(30));
        assert_eq!(c.cache.reverify, Duration::from_secs(600));
        assert_eq!(c.server.admission_budget, Duration::from_secs(2));
        assert!(c.pin);
        assert_eq!(c.platforms, Platforms::All);
        assert_eq!(c.source.registries[0].registry, "docker.io");
        // And it survives a round trip through its own serialisation.
        let again = parse(&yaml_serde::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn full_config() {
        let c = parse(
            r#"
target: {registry: "127.0.0.1:5002/mirror", insecure: true, auth: {username: u, passwordEnv: PW}}
source:
  registries:
    - {registry: docker.io, auth: {dockerConfigFile: /etc/pinswap/config.json}}
    - registry: "*"
  filters: [{jmespath: "obj.metadata.namespace == 'kube-system'"}]
swapPolicy: always
copyPolicy: force
copyDeadline: 1500ms
pin: false
platforms: [linux/amd64, linux/arm64/v8]
cache: {ttl: 0s, resolutionTtl: 5s, reverify: 1m}
identity: {collisions: repair}
failurePolicy: closed
server: {listen: "127.0.0.1:9443", healthListen: "127.0.0.1:9080", tlsCert: /c, tlsKey: /k, admissionBudget: 1s}
"#,
        )
        .unwrap();
        assert_eq!(c.copy_policy, CopyPolicy::Force);
        assert_eq!(c.copy_deadline, Duration::from_millis(1500));
        assert_eq!(c.cache.ttl, Duration::ZERO);
        assert_eq!(c.identity.collisions, CollisionPolicy::Repair);
        assert_eq!(c.failure_policy, FailurePolicy::Closed);
        let Platforms::Only(p) = &c.platforms else {
            panic!("platform list expected")
        };
        assert_eq!(p[1].variant.as_deref(), Some("v8"));
    }

    /// Two timeouts near u64::MAX seconds: their sum overflowed `Duration`
    /// and validation panicked instead of naming the key.
    #[test]
    fn huge_server_timeouts_are_refused_not_a_panic() {
        let e = parse(
            "target: {registry: m.example.com}\nserver: {headerReadTimeout: 400000000000years, bodyTimeout: 400000000000years}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("server.bodyTimeout: headerReadTimeout"), "{e}");
    }

    /// Port 0 (any free port) on both listeners is two ports, not one.
    #[test]
    fn both_listeners_may_ask_for_port_zero_but_not_share_a_port() {
        let listen = |a: &str, b: &str| {
            parse(&format!(
                "target: {{registry: m.example.com}}\nserver: {{listen: \"{a}\", healthListen: \"{b}\"}}\n"
            ))
        };
        assert!(listen("127.0.0.1:0", "127.0.0.1:0").is_ok());
        let e = listen("127.0.0.1:8443", "127.0.0.1:8443")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "server.healthListen: found 127.0.0.1:8443, the same address as server.listen"
            ),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_key_what_was_found_and_what_is_accepted() {
        let cases: &[(&str, &str)] = &[
            (
                "target: {registry: m.example.com}\ncache: {ttll: 1h}\n",
                "test.yaml:2:9: cache.ttll: unknown field `ttll` (did you mean `ttl`?), expected one of `ttl`, `resolutionTtl`, `jitter`, `reverify`, `reverifyRate`, `purgeEndpoint`",
            ),
            (
                "target: {registry: m.example.com}\nswapPolicy: sometimes\n",
                "test.yaml:2:13: swapPolicy: unknown variant `sometimes`, expected `exists` or `always`",
            ),
            (
                "target: {registry: m.example.com}\ncopyDeadline: soon\n",
                "test.yaml: copyDeadline: found \"soon\", expected a duration such as 30s, 500ms, 5m or 1h 30m (a number and a unit: ms, s, m, h, d; several add up)",
            ),
            (
                // Not the mapping's first key: still no misleading position.
                "target: {registry: m.example.com}\ncache:\n  ttl: 1h\n  reverify: soon\n",
                "test.yaml: cache.reverify: found \"soon\", expected a duration such as 30s, 500ms, 5m or 1h 30m (a number and a unit: ms, s, m, h, d; several add up)",
            ),
            (
                "target: {registry: m.example.com}\npin: maybe\n",
                "test.yaml:2:6: pin: invalid type: string \"maybe\", expected a boolean",
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {namespaces: [apps, web, apps]}\n",
                "test.yaml: recovery.namespaces[2]: found \"apps\" again (first at recovery.namespaces[0])",
            ),
            (
                "target: {registry: m.example.com}\ncopy: {concurrency: 2}\n",
                "test.yaml: copy.concurrencyPerRegistry: found 4, expected 1 to copy.concurrency (2); below it, one registry cannot hold every slot",
            ),
            (
                "target: {registry: m.example.com}\ncopy: {concurrency: 0}\n",
                "test.yaml: copy.concurrency: found 0, expected 1 to 64",
            ),
            (
                "target: {registry: m.example.com}\ncopy: {timeout: 500ms}\n",
                "test.yaml: copy.timeout: found 500ms, expected at least 1s, e.g. 30m",
            ),
            (
                "target: {registry: m.example.com}\ncopy: {transferRateWindow: 2h}\n",
                "test.yaml: copy.transferRateWindow: found 2h, expected 1s to 1h, e.g. 30s",
            ),
            (
                "target: {registry: m.example.com}\ncopy: {minTransferRate: 10%}\n",
                "test.yaml: copy.minTransferRate: found \"10%\", expected bytes per second such as 32Ki, 1Mi or 100k (0 turns the floor off)",
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {evict: {enabled: true, perMinute: 0}}\n",
                "test.yaml: recovery.evict.perMinute: found 0, expected 1 to 600 (set recovery.evict.enabled: false to evict nothing)",
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {evict: {after: 2h}}\n",
                "test.yaml: recovery.evict.after: found 2h, expected at most 1h (the kubelet retries a pull every 5m at the longest)",
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {enabled: false, evict: {enabled: true}}\n",
                "test.yaml: recovery.evict.enabled: found true with recovery.enabled: false; eviction follows a recovery's re-mirror, so it needs recovery on",
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {evict: {enable: true}}\n",
                "test.yaml:2:20: recovery.evict.enable: unknown field `enable` (did you mean `enabled`?), expected one of `enabled`, `after`, `perMinute`",
            ),
            (
                "target: {registry: m.example.com}\nplatforms: [linux]\n",
                "test.yaml: platforms: invalid platform \"linux\": expected os/arch[/variant], e.g. linux/arm64/v8",
            ),
            (
                "source: {registries: [{registry: docker.io}]}\n",
                "test.yaml:1:1: .: missing field `target`",
            ),
        ];
        for (yaml, want) in cases {
            let got = parse(yaml).unwrap_err().to_string();
            assert_eq!(&got, want, "for {yaml:?}");
        }
    }

    #[test]
    fn referrers_read_as_a_switch_or_a_mapping() {
        let r = |y: &str| parse(&format!("target: {{registry: m.example.com}}\n{y}\n"));
        assert_eq!(r("").unwrap().referrers, Referrers::default());
        assert!(!r("referrers: false").unwrap().referrers.enabled);
        let c = r("referrers: {artifactTypes: [application/spdx+json]}").unwrap();
        assert!(c.referrers.enabled);
        assert_eq!(c.referrers.artifact_types, ["application/spdx+json"]);
        let off = r("referrers: {enabled: false}").unwrap();
        assert!(!off.referrers.enabled);
        // Both forms survive their own serialisation.
        for c in [c, off] {
            assert_eq!(parse(&yaml_serde::to_string(&c).unwrap()).unwrap(), c);
        }
        for (yaml, want) in [
            (
                "referrers: maybe",
                "referrers: found \"maybe\", expected true, false, or {enabled: true|false, artifactTypes: [TYPE, ...]}",
            ),
            (
                "referrers: {enabled: yes please}",
                "referrers: enabled: found \"yes please\", expected true or false",
            ),
            (
                "referrers: {artifactType: [a/b]}",
                "referrers: unknown key \"artifactType\" (did you mean artifactTypes?), expected enabled or artifactTypes",
            ),
            (
                "referrers: {artifactTypes: []}",
                "referrers: artifactTypes: found an empty list; leave artifactTypes out to copy every referrer, or set referrers: false to copy none",
            ),
            (
                "referrers: {artifactTypes: [sbom]}",
                "referrers: artifactTypes: found \"sbom\", expected a media type TYPE/SUBTYPE such as application/spdx+json",
            ),
            (
                "referrers: {artifactTypes: application/spdx+json}",
                "referrers: artifactTypes: found \"application/spdx+json\", expected a list of media types such as [application/vnd.dev.sigstore.bundle.v0.3+json]",
            ),
        ] {
            let got = r(yaml).unwrap_err().to_string();
            assert_eq!(got, format!("test.yaml: {want}"), "for {yaml:?}");
        }
    }

    #[test]
    fn one_registry_listed_twice_is_refused() {
        let got = parse("target: {registry: m.example.com}\nsource: {registries: [{registry: docker.io}, {registry: r.example.com}, {registry: Index.Docker.io}]}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            got,
            "test.yaml: source.registries[2].registry: \"Index.Docker.io\" is the same registry as source.registries[0] (docker.io); list it once"
        );
    }

    #[test]
    fn settings_on_the_wildcard_registry_are_refused() {
        for (entry, key) in [
            ("insecure: true", "insecure"),
            ("auth: {username: u, passwordEnv: P}", "auth"),
        ] {
            let yaml = format!(
                "target: {{registry: m.example.com}}\nsource: {{registries: [{{registry: \"*\", {entry}}}]}}\n"
            );
            let got = parse(&yaml).unwrap_err().to_string();
            assert!(
                got.starts_with(&format!(
                    "test.yaml: source.registries[0].{key}: has no effect on \"*\""
                )),
                "{got}"
            );
        }
        parse("target: {registry: m.example.com}\nsource: {registries: [{registry: \"*\"}, {registry: r.example.com, insecure: true}]}\n").unwrap();
    }

    #[test]
    fn semantic_problems_are_all_listed() {
        let e = parse(
            r#"
target: {registry: "https://mirror.example.com", auth: {username: u, password: hunter2}}
source:
  registries: [{registry: "http://quay.io"}]
  filters: [{jmespath: "obj.metadata.[["}]
copyDeadline: 45s
server: {tlsCert: /c, listen: "0.0.0.0:8080"}
"#,
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(!text.contains("hunter2"), "secret echoed: {text}");
        let lines: Vec<&str> = text.lines().collect();
        let paths: Vec<&str> = lines
            .iter()
            .map(|l| l.split(": ").nth(1).unwrap_or(""))
            .collect();
        assert_eq!(
            paths,
            [
                "target.registry",
                "target.auth.password",
                "source.registries[0].registry",
                "source.filters[0].jmespath",
                "copyDeadline",
                "server",
                "server.healthListen",
            ],
            "{text}"
        );
        assert!(text.contains("inline secrets are not accepted; use passwordFile or passwordEnv"));
        assert!(text.contains("copyDeadline: found 45s, expected more than 0s and at most 30s"));
    }

    /// Schema errors in the words of the YAML: what to write instead of a
    /// Rust type, durations as they are written, the nearest key.
    #[test]
    fn schema_errors_say_what_to_write() {
        let d = "expected a duration such as 30s, 500ms, 5m or 1h 30m (a number and a unit: ms, s, m, h, d; several add up)";
        let cases: Vec<(&str, String)> = vec![
            (
                "target: {registry: m.example.com}\nsource: {registries: [docker.io]}\n",
                "test.yaml:2:23: source.registries[0]: invalid type: string \"docker.io\", expected a mapping such as {registry: docker.io}".into(),
            ),
            (
                "target: m.example.com\n",
                "test.yaml:1:9: target: invalid type: string \"m.example.com\", expected a mapping such as {registry: mirror.example.com/cache}".into(),
            ),
            (
                "- target\n",
                "test.yaml:1:1: .: invalid type: list, expected a mapping of settings such as {target: {registry: mirror.example.com/cache}}".into(),
            ),
            (
                "target: {registry: m.example.com, auth: u}\n",
                "test.yaml:1:41: target.auth: invalid type: string, expected a mapping such as {username: pinswap, passwordFile: /var/run/secrets/pinswap/target-password}".into(),
            ),
            (
                // Perhaps a password: not echoed.
                "target: {registry: m.example.com}\nsource: {registries: [{registry: docker.io, auth: hunter2}]}\n",
                "test.yaml:2:51: source.registries[0].auth: invalid type: string, expected a mapping such as {username: pinswap, passwordFile: /var/run/secrets/pinswap/target-password}".into(),
            ),
            (
                "target: {registry: m.example.com}\ncache: 5\n",
                "test.yaml:2:8: cache: invalid type: integer `5`, expected a mapping such as {ttl: 1h, resolutionTtl: 30s}".into(),
            ),
            (
                "target: {registry: m.example.com}\nsource: {filters: [\"obj.x\"]}\n",
                "test.yaml:2:20: source.filters[0]: invalid type: string \"obj.x\", expected a mapping such as {jmespath: \"obj.metadata.namespace == 'kube-system'\"}".into(),
            ),
            (
                "target: {registry: m.example.com}\nscope: {objectSelector: {matchExpressions: [app]}}\n",
                "test.yaml:2:45: scope.objectSelector.matchExpressions[0]: invalid type: string \"app\", expected a mapping such as {key: app, operator: In, values: [web]}".into(),
            ),
            (
                "target: {registry: m.example.com}\nmirrorOnly: {pods: [ledger]}\n",
                "test.yaml:2:21: mirrorOnly.pods[0]: invalid type: string \"ledger\", expected a mapping such as {namespaces: [payments], podSelector: {matchLabels: {app: ledger}}}".into(),
            ),
            (
                "target: {registry: m.example.com, aws: ecr}\n",
                "test.yaml:1:40: target.aws: invalid type: string \"ecr\", expected a mapping such as {accountId: \"123456789012\", region: eu-west-1}".into(),
            ),
            (
                "target: {aws: {accountId: [1], region: eu-west-1}}\n",
                "test.yaml:1:15: target.aws.accountId: a 12-digit AWS account ID such as \"123456789012\"".into(),
            ),
            (
                "target: {registry: m.example.com}\nswapPolicy: [always]\n",
                "test.yaml:2:13: swapPolicy: invalid type: list, expected `exists` or `always`".into(),
            ),
            (
                "target: {registry: m.example.com}\ncopyPolicy: {force: true}\n",
                "test.yaml:2:13: copyPolicy: invalid type: mapping, expected one of `delayed`, `immediate`, `force`, `none`".into(),
            ),
            (
                "target: {registry: m.example.com}\nmirrorOnly: {profiles: [[cnpg]]}\n",
                "test.yaml:2:25: mirrorOnly.profiles[0]: invalid type: list, expected one of `cloudnative-pg`, `postgres-operator`, `aerospike`".into(),
            ),
            (
                "target: {registry: m.example.com}\nsource: {breaker: {failures: many}}\n",
                "test.yaml:2:30: source.breaker.failures: invalid type: string \"many\", expected a whole number from 0 to 4294967295".into(),
            ),
            (
                "target: {registry: m.example.com}\nidentity: {scanRate: -1}\n",
                "test.yaml:2:22: identity.scanRate: invalid type: integer `-1`, expected a whole number from 0 to 4294967295".into(),
            ),
            (
                "target: {registry: m.example.com}\nbackfill: {concurrency: two}\n",
                "test.yaml:2:25: backfill.concurrency: invalid type: string \"two\", expected a whole number, 0 or more".into(),
            ),
            (
                "target: {registry: m.example.com}\ncache: {jitter: some}\n",
                "test.yaml:2:17: cache.jitter: invalid type: string \"some\", expected a number such as 0.5".into(),
            ),
            (
                "target: {registry: m.example.com}\nrecovery: {namespaces: apps}\n",
                "test.yaml:2:24: recovery.namespaces: invalid type: string \"apps\", expected a list".into(),
            ),
            (
                "target: {registry: m.example.com}\ncopyDeadline: PT30S\n",
                format!("test.yaml: copyDeadline: found \"PT30S\" (ISO 8601 durations are not read), {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncopyDeadline: 5\n",
                format!("test.yaml: copyDeadline: found \"5\" (a number without a unit; write 5s, 5m or 5ms), {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncache: {ttl: 2 fortnights}\n",
                format!("test.yaml: cache.ttl: found \"2 fortnights\" (\"fortnights\" is not a unit), {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncache: {ttl: \"\"}\n",
                format!("test.yaml: cache.ttl: found an empty value, {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncache: {ttl: 0.001h}\n",
                format!("test.yaml: cache.ttl: found \"0.001h\" (too large, or a fraction finer than its unit takes: 1ns, and whole seconds for h, d, w, M and y), {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncache: {ttl: [1h]}\n",
                format!("test.yaml: cache.ttl: {d}"),
            ),
            (
                "target: {registry: m.example.com}\ncopyPolcy: force\n",
                "test.yaml:2:1: copyPolcy: unknown field `copyPolcy` (did you mean `copyPolicy`?), expected one of `target`, `source`, `scope`, `mirrorOnly`, `customResources`, `prewarm`, `swapPolicy`, `copyPolicy`, `copyDeadline`, `pin`, `rewriteImagePullPolicyNever`, `platforms`, `referrers`, `cache`, `identity`, `recovery`, `backfill`, `copy`, `retention`, `cluster`, `sharing`, `failurePolicy`, `server`".into(),
            ),
            (
                "target: {registry: m.example.com}\nfailurepolicy: closed\n",
                "test.yaml:2:1: failurepolicy: unknown field `failurepolicy` (did you mean `failurePolicy`?), expected one of `target`, `source`, `scope`, `mirrorOnly`, `customResources`, `prewarm`, `swapPolicy`, `copyPolicy`, `copyDeadline`, `pin`, `rewriteImagePullPolicyNever`, `platforms`, `referrers`, `cache`, `identity`, `recovery`, `backfill`, `copy`, `retention`, `cluster`, `sharing`, `failurePolicy`, `server`".into(),
            ),
            (
                // Nothing near: no guess.
                "target: {registry: m.example.com, mirror: x}\n",
                "test.yaml:1:35: target.mirror: unknown field `mirror`, expected one of `registry`, `insecure`, `auth`, `aws`".into(),
            ),
        ];
        for (yaml, want) in &cases {
            let got = parse(yaml).unwrap_err().to_string();
            assert_eq!(&got, want, "for {yaml:?}");
            // No Rust type or parser internals reach the user.
            for internal in [
                "struct ", "enum ", "YAML tag", " at 0", "u32", "usize", "f64", "hunter2",
            ] {
                assert!(!got.contains(internal), "{internal:?} in {got}");
            }
        }
    }

    /// Durations read as the docs and the chart's schema say: humantime's
    /// forms, with or without spaces, and a bare 0.
    #[test]
    fn durations_take_humantime_forms() {
        for (text, secs) in [
            ("0", 0),
            ("5sec", 5),
            ("1h 30m", 5400),
            ("1h30m", 5400),
            ("2 hours", 7200),
            ("1.5m", 90),
            (" 10s ", 10),
            ("1d", 86400),
        ] {
            assert_eq!(
                duration::parse(text),
                Ok(Duration::from_secs(secs)),
                "{text:?}"
            );
        }
        for text in [
            "5", "PT30S", "1h-30m", "-5s", "1.s", "s", "30S", "5 s m", "",
        ] {
            assert!(duration::parse(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn a_k8s_image_swapper_config_points_to_convert() {
        for (yaml, keys) in [
            (
                "dryRun: true\nlogLevel: debug\nimageSwapPolicy: exists\ntarget: {aws: {accountId: \"123456789012\", region: eu-west-1}}\n",
                "dryRun, logLevel, imageSwapPolicy",
            ),
            (
                "target: {type: aws, aws: {accountId: \"123456789012\", region: eu-west-1}}\n",
                "target.type",
            ),
            (
                "source: {registries: [{type: aws, aws: {accountId: \"1\", region: r}}]}\ntarget: {registry: m.example.com}\n",
                "source.registries[0].type",
            ),
            (
                // The Helm chart's values, keys matched ignoring case.
                "replicaCount: 2\nconfig:\n  ImageCopyPolicy: delayed\n  target: {aws: {accountId: \"1\", region: r}}\n",
                "config.ImageCopyPolicy",
            ),
        ] {
            let got = parse(yaml).unwrap_err().to_string();
            assert_eq!(
                got,
                format!(
                    "test.yaml: a k8s-image-swapper config (it has {keys}), not a pinswap one; convert it with `pinswap config convert test.yaml > pinswap.yaml` and check the result with `pinswap config validate pinswap.yaml`"
                )
            );
        }
        // A pinswap config (it has pinswap's own keys) is not taken for one.
        let got = parse("target: {registry: m.example.com}\ncopyPolicy: force\ndryrun: true\n")
            .unwrap_err()
            .to_string();
        assert!(got.contains("unknown field `dryrun`"), "{got}");
    }

    #[test]
    fn warnings_name_the_key() {
        let w = |y: &str| {
            parse(y)
                .unwrap()
                .warnings("test.yaml")
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        };
        assert!(DEFAULT_YAML.contains(&format!("registry: {PLACEHOLDER_REGISTRY}\n")));
        assert_eq!(
            w(DEFAULT_YAML),
            [
                "test.yaml: target.registry: mirror.example.com/cache is the placeholder `pinswap config default` writes; set the registry to mirror into, HOST[:PORT][/prefix]"
            ]
        );
        assert_eq!(
            w("target: {registry: \"registry.example.org:5000/p\"}\n"),
            [
                "test.yaml: target.registry: registry.example.org is a documentation domain that no registry answers on; set the registry to mirror into, HOST[:PORT][/prefix]"
            ]
        );
        assert_eq!(
            w("target: {registry: m.internal}\ncopyPolicy: force\ncopyDeadline: 5s\n"),
            [
                "test.yaml: copyDeadline: found 5s with copyPolicy force, longer than server.admissionBudget (2s): an admission waits for a copy at most the budget; raise server.admissionBudget too, or lower copyDeadline"
            ]
        );
        // Delayed copies never wait, so their deadline is no concern.
        assert!(w("target: {registry: m.internal}\ncopyDeadline: 5s\n").is_empty());
        assert!(w("target: {registry: notexample.com/cache}\n").is_empty());
    }
}
