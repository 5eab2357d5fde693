//! `pinswap config convert`: a k8s-image-swapper config turned into a pinswap
//! config (docs/architecture.md §6).
//!
//! Input: k8s-image-swapper's YAML config (`.k8s-image-swapper.yaml`, the
//! format of its `docs/configuration.md`, read by its `pkg/config` through
//! viper), or a values file of its Helm chart, whose `config:` block holds
//! that config. A top-level `config` mapping selects the Helm form: the
//! config itself has no such key.
//!
//! Output: pinswap YAML that [`Config::from_yaml`] loads, headed by comment
//! lines that list every key that was not carried over, every value that was
//! changed on the way, and the decisions taken for the user
//! ([`Conversion::report`] holds the same items). Every key of the input is
//! visited; none is dropped without an item that names its full key path.
//! Keys match ignoring case, as viper matches them; values do not (the
//! policies are compared exactly, as k8s-image-swapper compares them).
//!
//! What maps:
//! - `imageSwapPolicy` → `swapPolicy`; `imageCopyPolicy` → `copyPolicy`;
//!   `imageCopyDeadline` (a Go duration) → `copyDeadline`, at most 30s;
//! - `source.filters[].jmespath` → `source.filters[].jmespath`, verbatim;
//! - `target.type: aws` with `target.aws.{accountId, region, prefix}` →
//!   `target.registry: ACCOUNT.dkr.ecr.REGION.amazonaws.com/PREFIX` and a
//!   `target.aws` block with the account, region, `role` and every
//!   `ecrOptions` key (pinswap creates the repositories too); `target.type:
//!   gcp` with `target.gcp.{location, projectId, repositoryId}` →
//!   `LOCATION-docker.pkg.dev/PROJECT/REPOSITORY`;
//! - `source.registries[]` (AWS or GCP registries k8s-image-swapper signed in
//!   to) → their hosts in `source.registries`, after `"*"`: k8s-image-swapper
//!   mirrors from any registry, and the converted allowlist keeps that;
//! - `cacheTtlMinutes`, `cacheJitterMaxMinutes` → `cache.ttl`, `cache.jitter`;
//! - `listenAddress`, `tlsCertFile`, `tlsKeyFile` → `server.*`;
//! - Helm form: `secretReader.enabled: true` → `source.imagePullSecrets`.
//!
//! What does not (reported): `dryRun`, `logLevel`, `logFormat` (command-line
//! flags in pinswap), the cloud credentials of source registries,
//! unknown keys (k8s-image-swapper ignored them too), and the Helm chart's
//! deployment values.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use yaml_serde::Value;

use crate::config::{Config, ConfigError};
use crate::reference::MirrorTarget;

/// Conversion errors: the input cannot be converted at all. Each names the
/// file and, past syntax errors, the key path.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The file could not be read.
    #[error("{file}: cannot read: {reason}")]
    Read {
        /// The input file (`<stdin>` for `-`).
        file: String,
        /// The OS error.
        reason: String,
    },
    /// The text is not one YAML document (syntax error, duplicate key,
    /// several documents).
    #[error("{file}{}: not valid YAML: {message}", if *line > 0 { format!(":{line}:{column}") } else { String::new() })]
    Yaml {
        /// The input file.
        file: String,
        /// 1-based line, 0 when unknown.
        line: usize,
        /// 1-based column, 0 when unknown.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// A key k8s-image-swapper reads holds a value that cannot be converted
    /// (wrong type, unknown policy, a target that cannot be built), or a
    /// key the conversion needs is missing.
    #[error("{file}: {path}: {message}")]
    Value {
        /// The input file.
        file: String,
        /// Key path in the input, e.g. `target.aws.region` (`.` for the
        /// document itself).
        path: String,
        /// What was found and what is accepted.
        message: String,
    },
    /// The converted config does not load: a bug in the conversion.
    #[error(
        "{file}: the converted config does not load (a bug in pinswap config convert): {error}"
    )]
    Output {
        /// The input file.
        file: String,
        /// Why pinswap's loader refused it.
        error: ConfigError,
    },
}

/// `Result` with [`ConvertError`].
pub type Result<T, E = ConvertError> = std::result::Result<T, E>;

/// What an [`Item`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemKind {
    /// The key has no place in the pinswap config; the item says why and
    /// what to do instead.
    NotCarriedOver,
    /// The key was carried over with a different value.
    Changed,
    /// A decision the conversion took, or a difference in behaviour.
    Note,
}

impl fmt::Display for ItemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotCarriedOver => "not carried over",
            Self::Changed => "changed",
            Self::Note => "note",
        })
    }
}

/// One reported item. Displays as `KIND: PATH: MESSAGE` on one line, e.g.
/// `not carried over: dryRun: ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// What kind of item.
    pub kind: ItemKind,
    /// The key path in the input, as written there (`config.` first in the
    /// Helm form), e.g. `target.aws.ecrOptions.tags`.
    pub path: String,
    /// Why, and what to do instead.
    pub message: String,
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys come from the input: a line break in one must not start a
        // new report line (or, in the header, leave the comment).
        let line = format!("{}: {}: {}", self.kind, self.path, self.message);
        f.write_str(&comment_text(&line))
    }
}

/// A finished conversion.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The pinswap config: the report as comment lines, then the YAML.
    pub yaml: String,
    /// Every item, in input order.
    pub report: Vec<Item>,
    /// The converted config, as pinswap loads `yaml`.
    pub config: Config,
}

/// Reads and converts a k8s-image-swapper config file; `-` reads stdin.
///
/// # Errors
/// [`ConvertError::Read`], or as [`convert`].
pub fn convert_file(path: &Path) -> Result<Conversion> {
    let (file, text) = if path.as_os_str() == "-" {
        let file = "<stdin>".to_owned();
        let text = std::io::read_to_string(std::io::stdin()).map_err(|e| ConvertError::Read {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        (file, text)
    } else {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConvertError::Read {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        (file, text)
    };
    convert(&text, &file)
}

/// Converts k8s-image-swapper YAML; `file` names the input in messages and
/// in the output's header.
///
/// # Errors
/// [`ConvertError::Yaml`] for text that is not one YAML document;
/// [`ConvertError::Value`] for the first value that cannot be converted
/// (a policy of the wrong type or an unknown one, a deadline that is not a
/// duration, a missing or unusable target, a filter that does not compile);
/// [`ConvertError::Output`] if the result would not load (a bug).
pub fn convert(text: &str, file: &str) -> Result<Conversion> {
    // Editors on Windows write a BOM; yaml.v3 (k8s-image-swapper's) skips it.
    let text = text.strip_prefix('\u{FEFF}').unwrap_or(text);
    let mut root: Value = yaml_serde::from_str(text).map_err(|e| {
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let mut message = e.to_string();
        if let Some(i) = message.find(" at line ") {
            message.truncate(i);
        }
        ConvertError::Yaml {
            file: file.to_owned(),
            line,
            column,
            message,
        }
    })?;
    // Viper (yaml.v3) applies `<<` merge keys; so do we.
    root.apply_merge().map_err(|e| ConvertError::Value {
        file: file.to_owned(),
        path: ".".into(),
        message: format!("merge key `<<`: {e}"),
    })?;
    let mut cx = Cx {
        file,
        items: Vec::new(),
        out: Out::default(),
    };
    cx.document(&root)?;
    let yaml = cx.render();
    let config =
        Config::from_yaml(&yaml, "converted config").map_err(|error| ConvertError::Output {
            file: file.to_owned(),
            error,
        })?;
    Ok(Conversion {
        yaml,
        report: cx.items,
        config,
    })
}

/// `pinswap config convert FILE`: the converted config on stdout, the report
/// on stderr. Exit 0 when converted (reported items included), 1 when the
/// input cannot be converted (nothing on stdout).
pub fn run(path: &Path) -> ExitCode {
    use std::io::Write;
    let c = match convert_file(path) {
        Ok(c) => c,
        // A file that cannot be read is a usage error, as in every command.
        Err(e @ ConvertError::Read { .. }) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(c.yaml.as_bytes()).and_then(|()| out.flush()) {
        eprintln!("error: writing the converted config: {e}");
        return ExitCode::from(1);
    }
    let file = if path.as_os_str() == "-" {
        "<stdin>".to_owned()
    } else {
        path.display().to_string()
    };
    let count = |k: ItemKind| c.report.iter().filter(|i| i.kind == k).count();
    eprintln!(
        "{file}: converted; {} not carried over, {} changed, {} notes (also in the output's header)",
        count(ItemKind::NotCarriedOver),
        count(ItemKind::Changed),
        count(ItemKind::Note),
    );
    for item in &c.report {
        eprintln!("{item}");
    }
    ExitCode::SUCCESS
}

/// The pieces of the pinswap config, filled while walking the input.
#[derive(Debug, Default)]
struct Out {
    target: Option<Target>,
    /// Source hosts with the input path they come from.
    sources: Vec<(String, String)>,
    filters: Vec<String>,
    image_pull_secrets: bool,
    swap: Option<&'static str>,
    copy: Option<&'static str>,
    deadline: Option<Duration>,
    cache_ttl_min: Option<u64>,
    cache_jitter_min: Option<u64>,
    listen: Option<SocketAddr>,
    health_listen: Option<SocketAddr>,
    tls_cert: Option<(String, String)>,
    tls_key: Option<(String, String)>,
    cache: Option<(Duration, f64)>,
}

#[derive(Debug)]
struct Target {
    registry: String,
    kind: Cloud,
    /// The ECR block of an AWS target (`None` for sources).
    aws: Option<crate::config::Aws>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cloud {
    Aws,
    Gcp,
}

/// One mapping entry: its key as written, lowercased (viper's view), its
/// full path and its value.
struct Entry<'v> {
    key: String,
    lower: String,
    path: String,
    value: &'v Value,
}

struct Cx<'f> {
    file: &'f str,
    items: Vec<Item>,
    out: Out,
}

/// k8s-image-swapper's top-level keys, as its docs spell them (for
/// suggestions): the ones pinswap has no key of that name for, and the two
/// both have.
fn top_keys() -> Vec<&'static str> {
    let shared = ["source", "target"];
    crate::config::K8S_IMAGE_SWAPPER_KEYS
        .iter()
        .copied()
        .chain(shared)
        .collect()
}
const SOURCE_KEYS: &[&str] = &["registries", "privateRegistries", "filters"];
const FILTER_KEYS: &[&str] = &["jmespath"];
const REGISTRY_KEYS: &[&str] = &["type", "aws", "gcp"];
const AWS_KEYS: &[&str] = &["accountId", "region", "prefix", "role", "ecrOptions"];
const GCP_KEYS: &[&str] = &["location", "projectId", "repositoryId"];
const ECR_OPTIONS: &[&str] = &[
    "accessPolicy",
    "lifecyclePolicy",
    "tags",
    "imageTagMutability",
    "imageScanningConfiguration",
    "encryptionConfiguration",
];
/// pinswap's limit on `copyDeadline`: the API server's webhook timeout cap.
const DEADLINE_MAX: Duration = Duration::from_secs(30);
/// k8s-image-swapper's default `imageCopyDeadline`, also used for `0`.
const DEADLINE_DEFAULT: Duration = Duration::from_secs(8);
/// pinswap's default `server.admissionBudget`.
const BUDGET_DEFAULT: Duration = Duration::from_secs(2);

/// `  aws:` and the block, indented under `target:`.
fn aws_block(aws: &crate::config::Aws) -> String {
    let text = yaml_serde::to_string(aws).unwrap_or_default();
    let mut y = String::from("  aws:\n");
    for line in text.lines() {
        y.push_str("    ");
        y.push_str(line);
        y.push('\n');
    }
    y
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// How a value reads in a message: its kind and, for scalars, the value.
fn found(v: &Value) -> String {
    match v {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

/// The closest known key within two edits, ignoring case.
fn suggest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    crate::config::suggest(key, known.iter().copied())
}

/// Parses a Go `time.Duration` string (`8s`, `1m30s`, `1.5h`, `300ms`), as
/// viper decodes `imageCopyDeadline`. Negative durations are refused.
fn parse_go_duration(s: &str) -> std::result::Result<Duration, String> {
    let expected = "expected a Go duration such as 8s, 1m30s or 500ms";
    let (negative, mut rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(expected.into());
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let int_end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let int = &rest[..int_end];
        rest = &rest[int_end..];
        let mut frac = "";
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
            frac = &r[..end];
            rest = &r[end..];
        }
        if int.is_empty() && frac.is_empty() {
            return Err(expected.into());
        }
        let unit_end = rest
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit: u128 = match &rest[..unit_end] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => {
                return Err(format!(
                    "missing unit after {int}{}; {expected}",
                    if frac.is_empty() {
                        String::new()
                    } else {
                        format!(".{frac}")
                    }
                ));
            }
            u => return Err(format!("unknown unit {u:?}; {expected}")),
        };
        rest = &rest[unit_end..];
        let too_long = || format!("too long; {expected}");
        let whole: u128 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| too_long())?
        };
        nanos = whole
            .checked_mul(unit)
            .and_then(|n| nanos.checked_add(n))
            .ok_or_else(too_long)?;
        let frac = &frac[..frac.len().min(18)];
        if !frac.is_empty() {
            let digits: u128 = frac.parse().map_err(|_| too_long())?;
            // digits < 10^18 and unit <= 3.6e12, so the product fits; the
            // sum may not when the whole part is already near u128::MAX.
            nanos = nanos
                .checked_add(digits * unit / 10u128.pow(frac.len() as u32))
                .ok_or_else(too_long)?;
        }
    }
    if negative && nanos > 0 {
        return Err("negative; expected a positive duration such as 8s".into());
    }
    // Go's time.Duration is an int64 of nanoseconds.
    i64::try_from(nanos)
        .map(|n| Duration::from_nanos(n.unsigned_abs()))
        .map_err(|_| format!("too long (over 2562047h); {expected}"))
}

/// Parses a Go listen address (`:8443`, `0.0.0.0:8443`, `[::]:8443`,
/// `localhost:8443`) into pinswap's socket address.
fn parse_listen(s: &str) -> std::result::Result<SocketAddr, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or("expected HOST:PORT or :PORT, e.g. :8443")?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a number from 0 to 65535"))?;
    let ip = match host {
        "" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        h => h
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(h)
            .parse()
            .map_err(|_| format!("{h:?} is a host name; pinswap listens on an IP address"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// Characters YAML (1.2, §5) treats as line breaks or does not allow raw
/// in a document, beyond the C0/C1 controls: NEL is a C1 control, and
/// U+2028/U+2029 are line breaks to a YAML reader.
/// `us-east-1`, `us-gov-west-1`, `cn-north-1`, `ap-southeast-4`.
fn is_aws_region(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() >= 3
        && parts[0].len() == 2
        && parts[..parts.len() - 1]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase()))
        && parts[parts.len() - 1].bytes().all(|b| b.is_ascii_digit())
        && !parts[parts.len() - 1].is_empty()
}

fn yaml_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{FEFF}' | '\u{FFFE}' | '\u{FFFF}'
        )
}

/// A YAML double-quoted scalar that reads back as exactly `s`: JSON string
/// syntax, with every character [`yaml_unsafe`] flags written as `\uXXXX`
/// (serde_json leaves DEL, C1 controls and U+2028/9 raw).
fn q(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    for c in serde_json::to_string(s)
        .unwrap_or_else(|_| "\"\"".into())
        .chars()
    {
        if yaml_unsafe(c) {
            out.push_str(&format!("\\u{:04X}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// One comment line: line breaks, controls and characters YAML refuses
/// become spaces, so the text stays one printable comment and can never
/// end it early.
fn comment_text(s: &str) -> String {
    s.chars()
        .map(|c| if yaml_unsafe(c) { ' ' } else { c })
        .collect()
}

impl Cx<'_> {
    fn err(&self, path: &str, message: impl Into<String>) -> ConvertError {
        ConvertError::Value {
            file: self.file.to_owned(),
            path: if path.is_empty() {
                ".".into()
            } else {
                path.to_owned()
            },
            message: message.into(),
        }
    }

    fn item(&mut self, kind: ItemKind, path: &str, message: impl Into<String>) {
        self.items.push(Item {
            kind,
            path: path.to_owned(),
            message: message.into(),
        });
    }

    fn not_carried(&mut self, path: &str, message: impl Into<String>) {
        self.item(ItemKind::NotCarriedOver, path, message);
    }

    fn unknown(&mut self, e: &Entry<'_>, known: &[&'static str]) {
        let hint = match suggest(&e.key, known) {
            Some(k) => format!(" (did you mean `{k}`?)"),
            None => String::new(),
        };
        self.not_carried(
            &e.path,
            format!(
                "not a k8s-image-swapper key{hint}, so k8s-image-swapper ignored it; correct it and convert again, or delete it"
            ),
        );
    }

    /// The entries of a mapping (`null` reads as empty, as viper reads it).
    fn entries<'v>(&self, v: &'v Value, path: &str) -> Result<Vec<Entry<'v>>> {
        let map = match v {
            Value::Mapping(m) => m,
            Value::Null => return Ok(Vec::new()),
            other => {
                return Err(self.err(path, format!("found {}, expected a mapping", found(other))));
            }
        };
        let mut out: Vec<Entry<'v>> = Vec::with_capacity(map.len());
        for (k, value) in map {
            let key = match k {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                other => {
                    return Err(
                        self.err(path, format!("a key is {}, expected a name", found(other)))
                    );
                }
            };
            let lower = key.to_ascii_lowercase();
            let path_here = join(path, &key);
            if let Some(first) = out.iter().find(|e| e.lower == lower) {
                return Err(self.err(
                    &path_here,
                    format!(
                        "the same key as {} to k8s-image-swapper, which ignores case; keep one",
                        first.path
                    ),
                ));
            }
            out.push(Entry {
                key,
                lower,
                path: path_here,
                value,
            });
        }
        Ok(out)
    }

    /// A list (`null` reads as empty).
    fn list<'v>(&self, v: &'v Value, path: &str, expected: &str) -> Result<&'v [Value]> {
        match v {
            Value::Sequence(s) => Ok(s),
            Value::Null => Ok(&[]),
            other => Err(self.err(path, format!("found {}, expected {expected}", found(other)))),
        }
    }

    /// A string; `None` for null or empty (k8s-image-swapper's "unset").
    fn string<'v>(&self, v: &'v Value, path: &str, expected: &str) -> Result<Option<&'v str>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) if s.is_empty() => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => Err(self.err(path, format!("found {}, expected {expected}", found(other)))),
        }
    }

    /// A string, or an integer read as one (viper decodes weakly, and the
    /// documented examples write `accountId: 123456789`).
    fn id(&self, v: &Value, path: &str, expected: &str) -> Result<Option<String>> {
        match v {
            Value::Number(n) if n.is_u64() => Ok(Some(n.to_string())),
            other => Ok(self.string(other, path, expected)?.map(str::to_owned)),
        }
    }

    /// A whole number of minutes (an integer or a numeric string).
    fn minutes(&self, v: &Value, path: &str) -> Result<Option<u64>> {
        let expected = "expected a whole number of minutes, e.g. 1440";
        match v {
            Value::Null => Ok(None),
            Value::Number(n) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(path, format!("found {}, {expected}", found(v)))),
            Value::String(s) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| self.err(path, format!("found {}, {expected}", found(v)))),
            other => Err(self.err(path, format!("found {}, {expected}", found(other)))),
        }
    }

    fn policy(
        &self,
        v: &Value,
        path: &str,
        accepted: &[&'static str],
    ) -> Result<Option<&'static str>> {
        let list = accepted.join(", ");
        let Some(s) = self.string(v, path, &format!("one of {list}"))? else {
            return Ok(None);
        };
        accepted.iter().copied().find(|a| *a == s).map(Some).ok_or_else(|| {
            self.err(
                path,
                format!(
                    "found {s:?}, expected one of {list} (k8s-image-swapper compares exactly and falls back to {} for anything else; write the policy you mean)",
                    accepted[0]
                ),
            )
        })
    }

    /// The whole input: the config, or Helm values with a `config:` block.
    fn document(&mut self, root: &Value) -> Result<()> {
        if let Value::Mapping(m) = root
            && matches!(m.get("config"), Some(Value::Mapping(_) | Value::Null))
        {
            return self.helm(root);
        }
        if !matches!(root, Value::Mapping(_) | Value::Null) {
            return Err(self.err(
                "",
                format!(
                    "found {}, expected a mapping of k8s-image-swapper keys",
                    found(root)
                ),
            ));
        }
        self.config(root, "")
    }

    /// Helm chart values: `config` is converted; `secretReader.enabled`
    /// maps; the rest is deployment and is reported.
    fn helm(&mut self, root: &Value) -> Result<()> {
        let mut config = &Value::Null;
        for e in self.entries(root, "")? {
            match e.key.as_str() {
                "config" => config = e.value,
                "secretReader" => {
                    for s in self.entries(e.value, &e.path)? {
                        match s.key.as_str() {
                            "enabled" => match s.value {
                                Value::Bool(true) => self.out.image_pull_secrets = true,
                                Value::Bool(false) | Value::Null => {}
                                other => {
                                    return Err(self.err(
                                        &s.path,
                                        format!("found {}, expected true or false", found(other)),
                                    ));
                                }
                            },
                            "secretNames" => self.not_carried(
                                &s.path,
                                "the chart limited its secret reads to these names; pinswap's RBAC comes from `pinswap manifests`: narrow its Role to these secrets there if you need to",
                            ),
                            _ => self.not_carried(
                                &s.path,
                                "not a value of k8s-image-swapper's Helm chart; delete it",
                            ),
                        }
                    }
                }
                "awsSecretName" => self.not_carried(
                    &e.path,
                    "the Secret with AWS access keys for k8s-image-swapper's AWS SDK; pinswap's AWS SDK reads the same keys from its environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY): add this Secret to its Deployment with envFrom, or use IRSA or EKS Pod Identity instead",
                ),
                _ => self.not_carried(
                    &e.path,
                    "a Helm chart value for k8s-image-swapper's deployment, not part of its config; pinswap's deployment comes from `pinswap manifests --config FILE`: carry this setting over there by hand if you need it",
                ),
            }
        }
        self.config(config, "config")
    }

    /// The k8s-image-swapper config at `path` ("" for the document).
    fn config(&mut self, v: &Value, path: &str) -> Result<()> {
        let mut target = None;
        for e in self.entries(v, path)? {
            match e.lower.as_str() {
                "dryrun" => {
                    let message = match e.value {
                        Value::Bool(false) => "pinswap serve always copies and rewrites, as with dryRun: false; nothing to do".to_owned(),
                        _ => "documented as running without copying or rewriting; pinswap serve has no dry run. Instead: see the decisions offline with `pinswap mutate --dry-run --config FILE -f MANIFESTS`, or register the webhook for a test namespace first".to_owned(),
                    };
                    self.not_carried(&e.path, message);
                }
                "loglevel" => {
                    let level = match e.value.as_str() {
                        Some("trace") => "trace",
                        Some("debug") => "debug",
                        Some("warn") => "warn",
                        Some("error" | "fatal" | "panic") => "error",
                        _ => "info",
                    };
                    self.not_carried(
                        &e.path,
                        format!("pinswap takes its log level from the command line: pass --log-level {level} (or set PINSWAP_LOG={level}) to pinswap serve"),
                    );
                }
                "logformat" => {
                    let flag = match e.value.as_str() {
                        Some("json") => "--log-format json",
                        Some("console") => "--log-format text",
                        _ => "--log-format text (or json)",
                    };
                    self.not_carried(
                        &e.path,
                        format!("pinswap takes its log format from the command line: pass {flag} to pinswap serve"),
                    );
                }
                "listenaddress" => {
                    if let Some(s) = self.string(e.value, &e.path, "an address such as :8443")? {
                        match parse_listen(s) {
                            Ok(addr) => self.out.listen = Some(addr),
                            Err(why) => self.not_carried(
                                &e.path,
                                format!("{s:?}: {why}; set server.listen (or pass --listen to pinswap serve) to an IP:PORT"),
                            ),
                        }
                    }
                }
                "tlscertfile" => {
                    let s = self.string(e.value, &e.path, "a file path")?;
                    self.out.tls_cert = s.map(|s| (s.to_owned(), e.path.clone()));
                }
                "tlskeyfile" => {
                    let s = self.string(e.value, &e.path, "a file path")?;
                    self.out.tls_key = s.map(|s| (s.to_owned(), e.path.clone()));
                }
                "imageswappolicy" => {
                    self.out.swap = self.policy(e.value, &e.path, &["exists", "always"])?;
                }
                "imagecopypolicy" => {
                    self.out.copy =
                        self.policy(e.value, &e.path, &["delayed", "immediate", "force", "none"])?;
                }
                "imagecopydeadline" => self.deadline(&e)?,
                "cachettlminutes" => self.out.cache_ttl_min = self.minutes(e.value, &e.path)?,
                "cachejittermaxminutes" => {
                    self.out.cache_jitter_min = self.minutes(e.value, &e.path)?
                }
                // config.go's ImageCopySkipRegistries (viper matches the
                // field name; its yaml tag skipRegistries is not used).
                "imagecopyskipregistries" => self.not_carried(
                    &e.path,
                    "k8s-image-swapper rewrote images from these registries without copying them (a pull-through cache); pinswap has no per-registry copy switch and will copy them: leave them out of source.registries, or skip them with a filter on container.image",
                ),
                "source" => self.source(&e)?,
                "target" => target = Some(e),
                _ => self.unknown(&e, &top_keys()),
            }
        }
        let Some(target) = target else {
            return Err(self.err(
                &join(path, "target"),
                "missing; expected target.type (aws or gcp) with target.aws.{accountId, region} or target.gcp.{location, projectId, repositoryId}",
            ));
        };
        let t = self.registry(target.value, &target.path, true)?;
        self.out.target = Some(t);
        self.finish(path);
        Ok(())
    }

    fn deadline(&mut self, e: &Entry<'_>) -> Result<()> {
        let d = match e.value {
            Value::Null => return Ok(()),
            Value::String(s) if s.is_empty() => return Ok(()),
            Value::String(s) => parse_go_duration(s)
                .map_err(|why| self.err(&e.path, format!("found {s:?}: {why}")))?,
            // 0 ns is k8s-image-swapper's "use the default" (8s).
            Value::Number(n) if n.as_u64() == Some(0) => std::time::Duration::ZERO,
            Value::Number(n) => {
                return Err(self.err(
                    &e.path,
                    format!("found the number {n}, which k8s-image-swapper reads as nanoseconds; write a duration with a unit, e.g. 8s"),
                ));
            }
            other => {
                return Err(self.err(
                    &e.path,
                    format!("found {}, expected a Go duration such as 8s", found(other)),
                ));
            }
        };
        let d = if d.is_zero() {
            self.item(
                ItemKind::Changed,
                &e.path,
                "0 means the default (8s) to k8s-image-swapper; written as copyDeadline: 8s",
            );
            DEADLINE_DEFAULT
        } else if d > DEADLINE_MAX {
            self.item(
                ItemKind::Changed,
                &e.path,
                format!(
                    "{} is longer than pinswap's 30s maximum (the API server's webhook timeout limit); written as copyDeadline: 30s",
                    humantime::format_duration(d)
                ),
            );
            DEADLINE_MAX
        } else {
            d
        };
        self.out.deadline = Some(d);
        Ok(())
    }

    fn source(&mut self, e: &Entry<'_>) -> Result<()> {
        for s in self.entries(e.value, &e.path)? {
            match s.lower.as_str() {
                "filters" => {
                    let list = self.list(s.value, &s.path, "a list of {jmespath: EXPRESSION}")?;
                    for (i, f) in list.iter().enumerate() {
                        let path = format!("{}[{i}]", s.path);
                        let mut expr = None;
                        for fe in self.entries(f, &path)? {
                            if fe.lower == "jmespath" {
                                expr = self.string(fe.value, &fe.path, "a JMESPath expression")?;
                            } else {
                                self.unknown(&fe, FILTER_KEYS);
                            }
                        }
                        let jpath = join(&path, "jmespath");
                        let Some(expr) = expr else {
                            return Err(
                                self.err(&jpath, "missing; every filter needs an expression")
                            );
                        };
                        if let Err(why) = jmespath::compile(expr) {
                            let why = why
                                .to_string()
                                .split_whitespace()
                                .collect::<Vec<_>>()
                                .join(" ");
                            return Err(self.err(
                                &jpath,
                                format!("not a valid JMESPath expression ({why}); k8s-image-swapper treated it as not matching and skipped the filters after it"),
                            ));
                        }
                        self.out.filters.push(expr.to_owned());
                    }
                }
                // privateRegistries: the same list, in k8s-image-swapper's
                // format before source.registries.
                "registries" | "privateregistries" => {
                    let list = self.list(
                        s.value,
                        &s.path,
                        "a list of registries with type aws or gcp",
                    )?;
                    for (i, r) in list.iter().enumerate() {
                        let path = format!("{}[{i}]", s.path);
                        if let Some(host) = self.generic_source(r, &path) {
                            if let Some(host) = host {
                                self.push_source(host, path);
                            }
                            continue;
                        }
                        let t = self.registry(r, &path, false)?;
                        let (section, helper, scope) = match t.kind {
                            Cloud::Aws => ("aws", "docker-credential-ecr-login", ""),
                            Cloud::Gcp => (
                                "gcp",
                                "docker-credential-gcr",
                                " (pinswap allows a source by host, so every project and repository there)",
                            ),
                        };
                        self.not_carried(
                            &join(&path, section),
                            format!(
                                "k8s-image-swapper signed in to {} with its own cloud credentials; pinswap signs in to sources with their auth only. The host is listed under source.registries{scope} without credentials: give it auth.dockerConfigFile with {helper} in credHelpers (pinswap serve runs it again every 5 minutes), or set source.imagePullSecrets: true",
                                t.registry
                            ),
                        );
                        self.push_source(t.registry, path);
                    }
                }
                _ => self.unknown(&s, SOURCE_KEYS),
            }
        }
        Ok(())
    }

    /// Lists `host` under source.registries once: pinswap refuses two
    /// entries for one registry (their settings would collide).
    fn push_source(&mut self, host: String, path: String) {
        let norm = crate::reference::normalize_registry(&host);
        let first = self
            .out
            .sources
            .iter()
            .find(|(h, _)| crate::reference::normalize_registry(h) == norm)
            .map(|(_, p)| p.clone());
        match first {
            Some(first) => self.item(
                ItemKind::Note,
                &path,
                format!("{host} is already listed, from {first}; pinswap lists a registry once"),
            ),
            None => self.out.sources.push((host, path)),
        }
    }

    /// A source of `type: generic` (`generic: {name, genericOptions:
    /// {domain, username, password}}`, in some k8s-image-swapper versions):
    /// `None` for another type, else the host to allow, if it names one.
    /// The entry is reported whole: its credentials are not carried over.
    fn generic_source(&mut self, v: &Value, path: &str) -> Option<Option<String>> {
        let field = |v: &Value, key: &str| -> Option<Value> {
            v.as_mapping()?
                .iter()
                .find(|(k, _)| k.as_str().is_some_and(|k| k.eq_ignore_ascii_case(key)))
                .map(|(_, v)| v.clone())
        };
        if field(v, "type")?.as_str()? != "generic" {
            return None;
        }
        let domain = field(v, "generic")
            .and_then(|g| field(&g, "genericOptions"))
            .and_then(|o| field(&o, "domain"))
            .and_then(|d| d.as_str().map(str::to_owned))
            .filter(|d| self.check_host(d, path, false).is_ok());
        let message = match &domain {
            Some(d) => format!("a generic registry; {d} is listed under source.registries without credentials (pinswap takes no inline passwords): give it auth.username with auth.passwordFile"),
            None => "a generic registry without a usable genericOptions.domain; add its host to source.registries by hand".to_owned(),
        };
        self.not_carried(path, message);
        Some(domain)
    }

    /// A `{type, aws, gcp}` registry: the target (`ECR host` or `GAR
    /// host/project/repository`) or a source (its host only).
    fn registry(&mut self, v: &Value, path: &str, is_target: bool) -> Result<Target> {
        let entries = self.entries(v, path)?;
        let type_path = join(path, "type");
        let mut kind = Cloud::Aws; // k8s-image-swapper's default (viper default "aws")
        for e in entries.iter().filter(|e| e.lower == "type") {
            kind = match self.string(e.value, &e.path, "aws or gcp")? {
                None | Some("aws") => Cloud::Aws,
                Some("gcp") => Cloud::Gcp,
                Some(other) => {
                    return Err(self.err(
                        &e.path,
                        format!("found {other:?}, expected aws or gcp (the registry types k8s-image-swapper documents); for another registry, write pinswap's target.registry by hand"),
                    ));
                }
            };
        }
        let mut aws = None;
        let mut early = false;
        let mut gcp = None;
        for e in entries {
            match e.lower.as_str() {
                "type" => {}
                "aws" if kind == Cloud::Aws => aws = Some(e),
                "gcp" if kind == Cloud::Gcp => gcp = Some(e),
                "aws" | "gcp" => {
                    let other = if kind == Cloud::Aws { "aws" } else { "gcp" };
                    self.not_carried(
                        &e.path,
                        format!("ignored by k8s-image-swapper, because {type_path} is {other}; delete it"),
                    );
                }
                "registry" if is_target => {
                    early = true;
                    self.not_carried(
                        &e.path,
                        "the format of k8s-image-swapper before target.type (target.registry.aws), which current versions ignore; move its keys to target.aws and convert again",
                    )
                }
                _ => self.unknown(&e, REGISTRY_KEYS),
            }
        }
        let target = match kind {
            Cloud::Aws => {
                let section = join(path, "aws");
                let why = if early {
                    "missing; expected accountId and region (target.registry.aws is the format before target.type: move its keys to target.aws)"
                } else {
                    "missing; expected accountId and region"
                };
                let e = aws.ok_or_else(|| self.err(&section, why))?;
                self.aws(e.value, &e.path, is_target)?
            }
            Cloud::Gcp => {
                let section = join(path, "gcp");
                let e = gcp.ok_or_else(|| {
                    self.err(
                        &section,
                        "missing; expected location, projectId and repositoryId",
                    )
                })?;
                self.gcp(e.value, &e.path, is_target)?
            }
        };
        Ok(target)
    }

    fn aws(&mut self, v: &Value, path: &str, is_target: bool) -> Result<Target> {
        let mut account = None;
        let mut region = None;
        let mut prefix = None;
        let mut role = None;
        let mut options = crate::config::EcrOptions::default();
        for e in self.entries(v, path)? {
            match e.lower.as_str() {
                "accountid" => {
                    account = self.id(e.value, &e.path, "the 12-digit AWS account ID")?;
                }
                "region" => {
                    region = self.string(e.value, &e.path, "an AWS region such as eu-west-1")?.map(str::to_owned);
                }
                "prefix" if is_target => {
                    prefix = self
                        .string(e.value, &e.path, "a repository prefix such as /cache")?
                        .map(|p| self.prefix(p, &e.path));
                }
                "role" if is_target => {
                    role = self.string(e.value, &e.path, "an IAM role ARN")?.map(str::to_owned);
                }
                "ecroptions" if is_target => options = self.ecr_options(e.value, &e.path)?,
                "prefix" | "role" | "ecroptions" => self.not_carried(
                    &e.path,
                    "a setting of k8s-image-swapper's ECR client for this source; pinswap reads a source with the source's auth (or the Pod's imagePullSecrets), so it has no use here",
                ),
                "accesspolicy" | "lifecyclepolicy" => self.not_carried(
                    &e.path,
                    format!(
                        "k8s-image-swapper reads this only as {}.ecrOptions.{}, so it had no effect here; move it under ecrOptions to have pinswap apply it to the repositories it creates",
                        path, e.key
                    ),
                ),
                _ => self.unknown(&e, AWS_KEYS),
            }
        }
        let account = account.ok_or_else(|| {
            self.err(
                &join(path, "accountId"),
                "missing; the ECR host is ACCOUNT.dkr.ecr.REGION.amazonaws.com",
            )
        })?;
        let region = region.ok_or_else(|| {
            self.err(
                &join(path, "region"),
                "missing; the ECR host is ACCOUNT.dkr.ecr.REGION.amazonaws.com",
            )
        })?;
        // The values become a host name: anything else would send pushes
        // somewhere other than ECR.
        if account.is_empty() || !account.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.err(
                &join(path, "accountId"),
                format!("found {account:?}, expected the AWS account ID (digits)"),
            ));
        }
        if !is_aws_region(&region) {
            return Err(self.err(
                &join(path, "region"),
                format!("found {region:?}, expected an AWS region such as us-east-1"),
            ));
        }
        if account.len() != 12 {
            self.item(
                ItemKind::Note,
                &join(path, "accountId"),
                format!("{account:?} is not a 12-digit AWS account ID; check the registry host"),
            );
        }
        // ECR in the China regions is under amazonaws.com.cn.
        let domain = if region.starts_with("cn-") {
            "amazonaws.com.cn"
        } else {
            "amazonaws.com"
        };
        let host = format!("{account}.dkr.ecr.{region}.{domain}");
        self.check_host(&host, path, is_target)?;
        let aws = is_target.then_some(crate::config::Aws {
            account_id: account,
            region,
            prefix: None,
            role,
            ecr_options: options,
        });
        let registry = match &prefix {
            Some(p) => format!("{host}/{p}"),
            None => host,
        };
        self.check_host(&registry, path, is_target)?;
        Ok(Target {
            registry,
            kind: Cloud::Aws,
            aws,
        })
    }

    /// `target.aws.prefix`: k8s-image-swapper appends it to the host as
    /// written, so `/cache` is the working form; without the slash it built
    /// a host name of its own.
    fn prefix(&mut self, p: &str, path: &str) -> String {
        let trimmed = p.trim_matches('/').to_owned();
        if !p.starts_with('/') {
            self.item(
                ItemKind::Changed,
                path,
                format!("k8s-image-swapper appended {p:?} to the host without a slash; pinswap reads it as the path prefix /{trimmed}"),
            );
        }
        trimmed
    }

    /// `target.aws.ecrOptions`, every key k8s-image-swapper reads.
    fn ecr_options(&mut self, v: &Value, path: &str) -> Result<crate::config::EcrOptions> {
        let mut o = crate::config::EcrOptions::default();
        for e in self.entries(v, path)? {
            match e.lower.as_str() {
                "accesspolicy" => {
                    o.access_policy = self.policy_text(e.value, &e.path)?;
                }
                "lifecyclepolicy" => {
                    o.lifecycle_policy = self.policy_text(e.value, &e.path)?;
                }
                "imagetagmutability" => {
                    if let Some(m) = self.string(e.value, &e.path, "MUTABLE or IMMUTABLE")? {
                        o.image_tag_mutability = m.to_owned();
                    }
                }
                "tags" => {
                    for (i, t) in self
                        .list(e.value, &e.path, "a list of {key, value}")?
                        .iter()
                        .enumerate()
                    {
                        let tpath = format!("{}[{i}]", e.path);
                        let mut tag = crate::config::Tag {
                            key: String::new(),
                            value: String::new(),
                        };
                        for f in self.entries(t, &tpath)? {
                            match f.lower.as_str() {
                                "key" => tag.key = self.scalar(f.value, &f.path)?,
                                "value" => tag.value = self.scalar(f.value, &f.path)?,
                                _ => self.unknown(&f, &["key", "value"]),
                            }
                        }
                        o.tags.push(tag);
                    }
                }
                "imagescanningconfiguration" => {
                    for f in self.entries(e.value, &e.path)? {
                        match f.lower.as_str() {
                            "imagescanonpush" => {
                                o.image_scanning_configuration.image_scan_on_push =
                                    self.boolean(f.value, &f.path)?;
                            }
                            _ => self.unknown(&f, &["imageScanOnPush"]),
                        }
                    }
                }
                "encryptionconfiguration" => {
                    let mut kms_key_path = None;
                    for f in self.entries(e.value, &e.path)? {
                        match f.lower.as_str() {
                            "encryptiontype" => {
                                if let Some(t) = self.string(f.value, &f.path, "AES256 or KMS")? {
                                    o.encryption_configuration.encryption_type = t.to_owned();
                                }
                            }
                            "kmskey" => {
                                o.encryption_configuration.kms_key = self
                                    .string(f.value, &f.path, "a KMS key ARN, ID or alias")?
                                    .unwrap_or_default()
                                    .to_owned();
                                kms_key_path = Some(f.path.clone());
                            }
                            _ => self.unknown(&f, &["encryptionType", "kmsKey"]),
                        }
                    }
                    // k8s-image-swapper sends kmsKey to CreateRepository only
                    // with KMS, so with AES256 (its own sample config has
                    // `kmsKey: string`) the key never mattered.
                    let enc = &mut o.encryption_configuration;
                    if enc.encryption_type == "AES256"
                        && !enc.kms_key.is_empty()
                        && let Some(path) = kms_key_path
                    {
                        enc.kms_key.clear();
                        self.not_carried(
                            &path,
                            "k8s-image-swapper uses kmsKey only with encryptionType KMS and ignored it with AES256, so it is not carried over",
                        );
                    }
                }
                _ => self.unknown(&e, ECR_OPTIONS),
            }
        }
        Ok(o)
    }

    /// A policy document: JSON text, as k8s-image-swapper takes it.
    fn policy_text(&self, v: &Value, path: &str) -> Result<String> {
        Ok(self
            .string(v, path, "the policy as a JSON string")?
            .unwrap_or_default()
            .to_owned())
    }

    /// A string, or a number or boolean read as text (viper decodes weakly).
    fn scalar(&self, v: &Value, path: &str) -> Result<String> {
        match v {
            Value::Number(n) => Ok(n.to_string()),
            Value::Bool(b) => Ok(b.to_string()),
            other => Ok(self
                .string(other, path, "a string")?
                .unwrap_or_default()
                .to_owned()),
        }
    }

    /// A boolean, or `"true"`/`"false"` (viper decodes weakly).
    fn boolean(&self, v: &Value, path: &str) -> Result<bool> {
        match v {
            Value::Bool(b) => Ok(*b),
            Value::String(s) if s.eq_ignore_ascii_case("true") => Ok(true),
            Value::String(s) if s.eq_ignore_ascii_case("false") => Ok(false),
            other => Err(self.err(
                path,
                format!("found {}, expected true or false", found(other)),
            )),
        }
    }

    fn gcp(&mut self, v: &Value, path: &str, is_target: bool) -> Result<Target> {
        let mut location = None;
        let mut project = None;
        let mut repository = None;
        for e in self.entries(v, path)? {
            match e.lower.as_str() {
                "location" => {
                    location = self
                        .string(e.value, &e.path, "a location such as us-central1")?
                        .map(str::to_owned)
                }
                "projectid" => project = self.id(e.value, &e.path, "a Google Cloud project ID")?,
                "repositoryid" => {
                    repository = self.id(e.value, &e.path, "an Artifact Registry repository ID")?
                }
                _ => self.unknown(&e, GCP_KEYS),
            }
        }
        let need = |v: Option<String>, key: &str| {
            v.ok_or_else(|| {
                self.err(
                    &join(path, key),
                    "missing; the Artifact Registry target is LOCATION-docker.pkg.dev/PROJECT/REPOSITORY",
                )
            })
        };
        let location = need(location, "location")?;
        let dns_part = |v: &str| {
            !v.is_empty()
                && v.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        };
        if !dns_part(&location) {
            return Err(self.err(
                &join(path, "location"),
                format!("found {location:?}, expected an Artifact Registry location such as us-central1 or europe"),
            ));
        }
        let host = format!("{location}-docker.pkg.dev");
        if !is_target {
            // A source is allowed by host; project and repository are not needed.
            self.check_host(&host, path, false)?;
            return Ok(Target {
                registry: host,
                kind: Cloud::Gcp,
                aws: None,
            });
        }
        let project = need(project, "projectId")?;
        let repository = need(repository, "repositoryId")?;
        for (key, v) in [("projectId", &project), ("repositoryId", &repository)] {
            if !dns_part(&v.replace(['.', '_'], "")) {
                return Err(self.err(
                    &join(path, key),
                    format!(
                        "found {v:?}, expected lowercase letters, digits, '-' (and '.' or '_')"
                    ),
                ));
            }
        }
        let target = format!("{host}/{project}/{repository}");
        self.check_host(&target, path, true)?;
        Ok(Target {
            registry: target,
            kind: Cloud::Gcp,
            aws: None,
        })
    }

    /// The built registry must be one pinswap accepts.
    fn check_host(&self, built: &str, path: &str, is_target: bool) -> Result<()> {
        let ok = MirrorTarget::parse(built).map_err(|e| e.to_string());
        let ok = ok.and_then(|_| {
            if is_target || !built.contains('/') {
                Ok(())
            } else {
                Err("a source registry is a host only".into())
            }
        });
        ok.map_err(|why| {
            self.err(
                path,
                format!("builds the registry {built:?}, which pinswap cannot use: {why}"),
            )
        })
    }

    /// Everything that needs the whole config: TLS pairs, the cache, the
    /// health port, and the notes on decisions.
    fn finish(&mut self, path: &str) {
        match (self.out.tls_cert.clone(), self.out.tls_key.clone()) {
            (Some((_, p)), None) | (None, Some((_, p))) => {
                self.not_carried(
                    &p,
                    "pinswap needs tlsCert and tlsKey together (k8s-image-swapper served plain HTTP with only one); set both server.tlsCert and server.tlsKey, or pass --tls-cert and --tls-key to pinswap serve",
                );
                self.out.tls_cert = None;
                self.out.tls_key = None;
            }
            _ => {}
        }
        if let Some(listen) = self.out.listen
            && listen.port() == 8080
        {
            let health = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8081);
            self.out.health_listen = Some(health);
            self.item(
                ItemKind::Note,
                &join(path, "listenAddress"),
                "port 8080 is pinswap's default health and metrics port; server.healthListen is set to 0.0.0.0:8081",
            );
        }
        if self.out.cache_ttl_min.is_some() || self.out.cache_jitter_min.is_some() {
            // k8s-image-swapper keeps an entry TTL + random(0..jitter)
            // minutes; pinswap keeps it ttl * (1 - random(0..jitter)).
            // ttl' = TTL + JITTER and jitter' = JITTER / ttl' give the same
            // range, [TTL, TTL + JITTER].
            let ttl = self.out.cache_ttl_min.unwrap_or(1440);
            let jit = if ttl == 0 {
                0
            } else {
                self.out.cache_jitter_min.unwrap_or(180)
            };
            let total = ttl.saturating_add(jit);
            let mut fraction = if total == 0 {
                0.0
            } else {
                jit as f64 / total as f64
            };
            if fraction > 0.5 {
                fraction = 0.5;
                let low = total / 2;
                // Report under a key the file has: the jitter may be
                // k8s-image-swapper's default.
                let (key, default_note) = if self.out.cache_jitter_min.is_some() {
                    ("cacheJitterMaxMinutes", "")
                } else {
                    (
                        "cacheTtlMinutes",
                        " (with the default cacheJitterMaxMinutes, 180)",
                    )
                };
                self.item(
                    ItemKind::Changed,
                    &join(path, key),
                    format!(
                        "k8s-image-swapper kept entries {ttl} to {total} minutes{default_note}; pinswap's cache.jitter is at most half the TTL, so entries now live {low} to {total} minutes"
                    ),
                );
            }
            // Four decimals, rounded down so 0.5 stays valid.
            let fraction = (fraction * 10_000.0).floor() / 10_000.0;
            self.out.cache = Some((Duration::from_secs(total.saturating_mul(60)), fraction));
        }
        if let Some(t) = &self.out.target
            && let Some(aws) = &t.aws
            && let Some((_, prefix)) = t.registry.split_once('/')
        {
            self.item(
                ItemKind::Note,
                &join(path, "target.aws.prefix"),
                format!(
                    "pinswap creates repositories under the prefix ({prefix}/docker.io/library/nginx), where it pushes; k8s-image-swapper created them without it (docker.io/library/nginx) in account {}",
                    aws.account_id
                ),
            );
        }
        self.item(
            ItemKind::Note,
            &join(path, "target"),
            match self.out.target.as_ref().map(|t| t.kind) {
                Some(Cloud::Gcp) => "k8s-image-swapper signed in to Artifact Registry with its Google Cloud SDK; pinswap needs target.auth, which pinswap serve reads again every 5 minutes: a service account key (username _json_key) or a credential helper (tokens last an hour) both keep working; see the commented example under target",
                _ => "written as target.aws: pinswap signs in to ECR as k8s-image-swapper did, with AWS credentials from the default chain (IRSA, EKS Pod Identity, environment) and target.aws.role when set; pinswap serve renews the 12-hour registry token; its IAM policy is in docs/configuration.md (Amazon ECR)",
            },
        );
        self.item(
            ItemKind::Note,
            &join(path, "source.registries"),
            "\"*\" lets pinswap mirror from any registry, as k8s-image-swapper did; list the registries your Pods use instead to narrow it",
        );
        if self.out.image_pull_secrets {
            self.item(
                ItemKind::Note,
                "secretReader.enabled",
                "written as source.imagePullSecrets: true; pinswap then reads Pods' and ServiceAccounts' imagePullSecrets, so its RBAC needs get on secrets and serviceaccounts. Unlike k8s-image-swapper, which rewrote every Pod to an image the target held, pinswap gives an image that needs a Pod's own pull secret only to Pods whose pull secrets read it at the source (docs/security.md); public images and those the config's auth reads stay shared",
            );
        } else {
            self.item(
                ItemKind::Note,
                &join(path, "source"),
                "k8s-image-swapper used Pods' imagePullSecrets whenever its RBAC let it read them (Helm secretReader.enabled); pinswap does only with source.imagePullSecrets: true, left false here",
            );
        }
        let copy = self.out.copy.unwrap_or("delayed");
        let deadline = self.out.deadline.unwrap_or(DEADLINE_DEFAULT);
        if matches!(copy, "immediate" | "force") && deadline > BUDGET_DEFAULT {
            self.item(
                ItemKind::Note,
                &join(path, "imageCopyPolicy"),
                format!(
                    "an admission waits for a copy at most server.admissionBudget (2s), not the whole copyDeadline ({}) as k8s-image-swapper did; raise server.admissionBudget (below the webhook's timeoutSeconds) to wait longer",
                    humantime::format_duration(deadline)
                ),
            );
        }
    }

    fn render(&self) -> String {
        let o = &self.out;
        let mut y = String::new();
        y.push_str(&format!(
            "# pinswap config, converted by `pinswap config convert` from the k8s-image-swapper\n# config {}. Every key not carried over, every changed value and every decision\n# taken is listed here, as it was printed on stderr:\n#\n",
            comment_text(self.file)
        ));
        for item in &self.items {
            y.push_str(&format!("# {}\n", comment_text(&item.to_string())));
        }
        y.push('\n');
        let target = o.target.as_ref().map(|t| t.registry.as_str()).unwrap_or("");
        y.push_str(&format!("target:\n  registry: {}\n", q(target)));
        match o.target.as_ref().map(|t| t.kind) {
            Some(Cloud::Aws) => {
                y.push_str("  # Amazon ECR: pinswap signs in with AWS credentials from the default chain\n  # (IRSA, EKS Pod Identity, environment) and creates repositories before the\n  # first push, with these options.\n");
                if let Some(aws) = o.target.as_ref().and_then(|t| t.aws.as_ref()) {
                    y.push_str(&aws_block(aws));
                }
            }
            Some(Cloud::Gcp) => y.push_str(
                "  # Credentials: a service account key (JSON), which keeps working (a credential helper\n  # works too: pinswap serve reads target.auth again every 5 minutes):\n  # auth:\n  #   username: _json_key\n  #   passwordFile: /var/run/secrets/pinswap/gar-key.json  # Secret pinswap-registry-auth\n",
            ),
            None => {}
        }
        y.push_str("\nsource:\n  # \"*\": any registry, as k8s-image-swapper mirrored from any.\n  registries:\n    - registry: \"*\"\n");
        for (host, from) in &o.sources {
            y.push_str(&format!(
                "    # {}: add auth for it\n    - registry: {}\n",
                comment_text(from),
                q(host)
            ));
        }
        if o.filters.is_empty() {
            y.push_str("  filters: []\n");
        } else {
            y.push_str("  filters:\n");
            for f in &o.filters {
                y.push_str(&format!("    - jmespath: {}\n", q(f)));
            }
        }
        y.push_str(&format!("  imagePullSecrets: {}\n\n", o.image_pull_secrets));
        y.push_str(&format!(
            "swapPolicy: {}\ncopyPolicy: {}\ncopyDeadline: {}\n",
            o.swap.unwrap_or("exists"),
            o.copy.unwrap_or("delayed"),
            q(&humantime::format_duration(o.deadline.unwrap_or(DEADLINE_DEFAULT)).to_string())
        ));
        y.push_str("# Pods are rewritten to target/...:tag@sha256:..., pinned by digest;\n# k8s-image-swapper wrote target/...:tag. pin: false writes the tag only.\npin: true\n");
        if let Some((ttl, jitter)) = o.cache {
            y.push_str(&format!(
                "\ncache:\n  ttl: {}\n  jitter: {jitter:?}\n",
                q(&humantime::format_duration(ttl).to_string())
            ));
        }
        let tls = o.tls_cert.as_ref().zip(o.tls_key.as_ref());
        if o.listen.is_some() || o.health_listen.is_some() || tls.is_some() {
            y.push_str("\nserver:\n");
            if let Some(l) = o.listen {
                y.push_str(&format!("  listen: {}\n", q(&l.to_string())));
            }
            if let Some(h) = o.health_listen {
                y.push_str(&format!("  healthListen: {}\n", q(&h.to_string())));
            }
            if let Some(((cert, _), (key, _))) = tls {
                y.push_str(&format!("  tlsCert: {}\n  tlsKey: {}\n", q(cert), q(key)));
            }
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ok = [
            ("8s", Duration::from_secs(8)),
            ("0", Duration::ZERO),
            ("1m30s", Duration::from_secs(90)),
            ("1.5h", Duration::from_secs(5400)),
            ("300ms", Duration::from_millis(300)),
            ("2h45m", Duration::from_secs(9900)),
            ("1µs", Duration::from_micros(1)),
            ("+.5s", Duration::from_millis(500)),
            (
                "9223372036854775807ns",
                Duration::from_nanos(i64::MAX as u64),
            ),
        ];
        for (s, want) in ok {
            assert_eq!(parse_go_duration(s), Ok(want), "{s}");
        }
        // As time.ParseDuration: no surrounding spaces, at most int64 ns.
        for s in [
            "",
            "8",
            "s",
            "1x",
            "-8s",
            "1.s5",
            "99999999999999999999h",
            " 8s ",
            "9223372036854775808ns",
            "2562048h",
            // The whole part ends within 3.6e12 ns of u128::MAX, so adding
            // the fraction overflowed (a panic in debug builds, a wrapped
            // and accepted duration in release builds).
            "94522879700260684295381835.999999999999999999h",
        ] {
            assert!(parse_go_duration(s).is_err(), "{s} should be refused");
        }
    }

    #[test]
    fn listen_addresses() {
        let ok = [
            (":8443", "0.0.0.0:8443"),
            ("0.0.0.0:9443", "0.0.0.0:9443"),
            ("[::]:8443", "[::]:8443"),
            ("localhost:8443", "127.0.0.1:8443"),
        ];
        for (s, want) in ok {
            assert_eq!(parse_listen(s).unwrap().to_string(), want, "{s}");
        }
        for s in ["8443", "webhook.local:8443", ":https"] {
            assert!(parse_listen(s).is_err(), "{s} should be refused");
        }
    }

    #[test]
    fn suggestions_are_close_keys_only() {
        assert_eq!(
            suggest("imageSwapPolcy", &top_keys()),
            Some("imageSwapPolicy")
        );
        assert_eq!(suggest("filter", SOURCE_KEYS), Some("filters"));
        assert_eq!(suggest("acountid", AWS_KEYS), Some("accountId"));
        assert_eq!(suggest("replicaCount", &top_keys()), None);
    }

    #[test]
    fn keys_match_ignoring_case_and_duplicates_are_refused() {
        let c = convert(
            "IMAGESWAPPOLICY: always\ntarget: {AWS: {AccountID: \"111122223333\", Region: us-east-1}}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.config.swap_policy, crate::config::SwapPolicy::Always);
        assert_eq!(
            c.config.target.registry,
            "111122223333.dkr.ecr.us-east-1.amazonaws.com"
        );
        let e = convert(
            "imageSwapPolicy: always\nimageswappolicy: exists\ntarget: {aws: {accountId: \"1\", region: r}}\n",
            "t.yaml",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "t.yaml: imageswappolicy: the same key as imageSwapPolicy to k8s-image-swapper, which ignores case; keep one"
        );
    }

    #[test]
    fn cache_range_is_kept() {
        let c = convert(
            "cacheTtlMinutes: 240\ncacheJitterMaxMinutes: 30\ntarget: {aws: {accountId: \"111122223333\", region: us-east-1}}\n",
            "t.yaml",
        )
        .unwrap();
        // [240, 270] minutes: ttl 270m, jitter 30/270.
        assert_eq!(c.config.cache.ttl, Duration::from_secs(270 * 60));
        assert_eq!(c.config.cache.jitter, 0.1111);
        let c = convert(
            "cacheTtlMinutes: 0\ntarget: {aws: {accountId: \"111122223333\", region: us-east-1}}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.config.cache.ttl, Duration::ZERO);
        assert_eq!(c.config.cache.jitter, 0.0);
    }

    #[test]
    fn odd_keys_stay_inside_their_comment_line() {
        let c = convert(
            "\"a\\nb\\u0007\": 1\ntarget: {aws: {accountId: \"111122223333\", region: us-east-1}}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.report[0].path, "a\nb\u{7}");
        assert!(
            c.yaml
                .contains("# not carried over: a b : not a k8s-image-swapper key")
        );
    }

    #[test]
    fn china_regions_use_their_domain() {
        let c = convert(
            "target: {aws: {accountId: \"111122223333\", region: cn-north-1}}\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(
            c.config.target.registry,
            "111122223333.dkr.ecr.cn-north-1.amazonaws.com.cn"
        );
    }
}
