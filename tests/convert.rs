//! `pinswap config convert` through the binary, on k8s-image-swapper configs
//! written in that project's documented format (tests/data/k8s-image-swapper).
//!
//! Each converted config is loaded with pinswap's own loader and compared
//! value by value; the keys reported as not carried over are compared, as
//! a set, with the ones expected, on stderr and in the output's header.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use pinswap::config::{Config, CopyPolicy, SwapPolicy};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/k8s-image-swapper")
        .join(name)
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn convert(name: &str) -> Run {
    convert_path(&data(name))
}

fn convert_path(path: &std::path::Path) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_pinswap"))
        .args(["config", "convert"])
        .arg(path)
        .output()
        .expect("run pinswap");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// A successful conversion: exit 0, the output loads with pinswap's config
/// loader, and the report is the same on stderr and in the header.
struct Converted {
    run: Run,
    config: Config,
}

fn converted(name: &str) -> Converted {
    converted_run(name, convert(name))
}

/// As [`converted`], for a config given as text (written to a temp file).
fn converted_text(text: &str) -> Converted {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swapper.yaml");
    std::fs::write(&path, text).unwrap();
    converted_run("swapper.yaml", convert_path(&path))
}

fn converted_run(name: &str, run: Run) -> Converted {
    assert_eq!(run.code, 0, "{name}: {}", run.stderr);
    let config = Config::from_yaml(&run.stdout, name)
        .unwrap_or_else(|e| panic!("{name}: the output does not load: {e}\n{}", run.stdout));
    // The header (comment lines before the first key) carries exactly the
    // item lines printed on stderr, in the same order.
    let header: Vec<&str> = run
        .stdout
        .lines()
        .take_while(|l| l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("# "))
        .filter(|l| is_item(l))
        .collect();
    let stderr: Vec<&str> = run.stderr.lines().filter(|l| is_item(l)).collect();
    assert!(!stderr.is_empty(), "{name}: no items on stderr");
    assert_eq!(header, stderr, "{name}: header and stderr differ");
    Converted { run, config }
}

fn is_item(line: &str) -> bool {
    ["not carried over: ", "changed: ", "note: "]
        .iter()
        .any(|p| line.starts_with(p))
}

impl Converted {
    /// The key paths of the items of one kind, from stderr.
    fn paths(&self, kind: &str) -> BTreeSet<String> {
        let prefix = format!("{kind}: ");
        self.run
            .stderr
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(|l| l.split_once(": ").expect("PATH: MESSAGE").0.to_owned())
            .collect()
    }

    /// The one item line for `path` of `kind`.
    fn item(&self, kind: &str, path: &str) -> &str {
        let prefix = format!("{kind}: {path}: ");
        let lines: Vec<&str> = self
            .run
            .stderr
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "one {kind} item for {path}:\n{}",
            self.run.stderr
        );
        lines[0]
    }

    fn sources(&self) -> Vec<&str> {
        self.config
            .source
            .registries
            .iter()
            .map(|r| r.registry.as_str())
            .collect()
    }

    fn filters(&self) -> Vec<&str> {
        self.config
            .source
            .filters
            .iter()
            .map(|f| f.jmespath.as_str())
            .collect()
    }
}

fn set(paths: &[&str]) -> BTreeSet<String> {
    paths.iter().map(|p| (*p).to_owned()).collect()
}

#[test]
fn documented_example_maps_the_policies_filter_and_ecr_target() {
    let c = converted("docs-example.yaml");
    assert_eq!(
        c.config.target.registry,
        "123456789.dkr.ecr.ap-southeast-2.amazonaws.com"
    );
    assert_eq!(c.config.swap_policy, SwapPolicy::Exists);
    assert_eq!(c.config.copy_policy, CopyPolicy::Delayed);
    assert_eq!(c.config.copy_deadline, Duration::from_secs(8));
    assert_eq!(c.filters(), ["obj.metadata.namespace == 'kube-system'"]);
    assert_eq!(c.sources(), ["*"]);
    assert!(c.config.pin);
    assert!(!c.config.source.image_pull_secrets);
    assert_eq!(
        c.paths("not carried over"),
        set(&["dryRun", "logLevel", "logFormat",])
    );
    assert!(c.paths("changed").is_empty());
    // Every ecrOptions key is carried into target.aws.
    let aws = c.config.target.aws.as_ref().expect("target.aws");
    assert_eq!(aws.account_id, "123456789");
    assert_eq!(aws.region, "ap-southeast-2");
    assert_eq!(aws.role, None);
    let o = &aws.ecr_options;
    assert_eq!(
        o.tags,
        [pinswap::config::Tag {
            key: "cluster".into(),
            value: "myCluster".into()
        }]
    );
    assert_eq!(o.image_tag_mutability, "MUTABLE");
    assert!(o.image_scanning_configuration.image_scan_on_push);
    assert_eq!(o.encryption_configuration.encryption_type, "AES256");
    // The accountId of the docs is 9 digits: flagged, not silently used.
    assert!(
        c.item("note", "target.aws.accountId")
            .contains("not a 12-digit AWS account ID")
    );
    assert!(
        c.item("not carried over", "logLevel")
            .contains("--log-level debug")
    );
    assert!(
        c.item("not carried over", "logFormat")
            .contains("--log-format text")
    );
    assert!(
        c.item("note", "target")
            .contains("written as target.aws: pinswap signs in to ECR")
    );
    assert!(!c.run.stderr.contains("creates no ECR repositories"));
    assert!(c.run.stderr.lines().next().unwrap().ends_with(
        "docs-example.yaml: converted; 3 not carried over, 0 changed, 4 notes (also in the output's header)"
    ));
    // The decisions: "*" as the allowlist, pull secrets off, target auth and
    // repositories left to the user, and the short account ID.
    assert_eq!(
        c.paths("note"),
        set(&[
            "source.registries",
            "source",
            "target",
            "target.aws.accountId"
        ])
    );
}

#[test]
fn ecr_production_config_with_role_options_sources_and_cache() {
    let c = converted("ecr-production.yaml");
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    );
    assert_eq!(c.config.swap_policy, SwapPolicy::Always);
    assert_eq!(c.config.copy_policy, CopyPolicy::Immediate);
    // 45s is over pinswap's 30s limit: written as 30s and reported.
    assert_eq!(c.config.copy_deadline, Duration::from_secs(30));
    assert_eq!(c.paths("changed"), set(&["imageCopyDeadline"]));
    assert!(
        c.item("changed", "imageCopyDeadline")
            .contains("45s is longer than pinswap's 30s maximum")
    );
    // Entries live 240 to 270 minutes in both.
    assert_eq!(c.config.cache.ttl, Duration::from_secs(270 * 60));
    assert_eq!(c.config.cache.jitter, 0.1111);
    assert_eq!(
        c.sources(),
        [
            "*",
            "234567890123.dkr.ecr.us-east-1.amazonaws.com",
            "345678901234.dkr.ecr.eu-central-1.amazonaws.com",
        ]
    );
    assert!(c.config.source.registries.iter().all(|r| r.auth.is_none()));
    assert_eq!(
        c.filters(),
        [
            "obj.metadata.namespace == 'kube-system'",
            "starts_with(obj.metadata.namespace, 'istio-')",
            "contains(container.image, '.dkr.ecr.') && contains(container.image, '.amazonaws.com')",
        ]
    );
    assert_eq!(
        c.paths("not carried over"),
        set(&[
            "logLevel",
            "logFormat",
            "source.registries[0].aws",
            "source.registries[1].aws",
        ])
    );
    // The role and every ecrOptions key are carried into target.aws.
    let aws = c.config.target.aws.as_ref().expect("target.aws");
    assert_eq!(
        aws.role.as_deref(),
        Some("arn:aws:iam::123456789012:role/k8s-image-swapper")
    );
    let o = &aws.ecr_options;
    let policy: serde_json::Value = serde_json::from_str(&o.access_policy).unwrap();
    assert_eq!(
        policy["Statement"][0]["Sid"], "AllowOrganisationPull",
        "{}",
        o.access_policy
    );
    let lifecycle: serde_json::Value = serde_json::from_str(&o.lifecycle_policy).unwrap();
    assert_eq!(lifecycle["rules"][0]["selection"]["countNumber"], 500);
    let tags: Vec<(&str, &str)> = o
        .tags
        .iter()
        .map(|t| (t.key.as_str(), t.value.as_str()))
        .collect();
    assert_eq!(
        tags,
        [
            ("CreatedBy", "k8s-image-swapper"),
            ("cost-centre", "platform")
        ]
    );
    assert_eq!(o.image_tag_mutability, "IMMUTABLE");
    // k8s-image-swapper's default, as the file leaves it out.
    assert!(o.image_scanning_configuration.image_scan_on_push);
    assert_eq!(o.encryption_configuration.encryption_type, "KMS");
    assert_eq!(
        o.encryption_configuration.kms_key,
        "arn:aws:kms:eu-west-1:123456789012:key/0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    );
    assert!(
        c.item("not carried over", "source.registries[1].aws")
            .contains("345678901234.dkr.ecr.eu-central-1.amazonaws.com")
    );
    // Filters see the container as the Pod writes it, in both tools: no note.
    assert!(!c.run.stderr.contains("source.filters"));
    // immediate with 30s, but an admission waits at most the 2s budget.
    assert!(
        c.item("note", "imageCopyPolicy")
            .contains("server.admissionBudget (2s)")
    );
}

#[test]
fn ecr_prefix_is_carried_into_the_target_path() {
    let c = converted("ecr-prefix.yaml");
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.ap-southeast-2.amazonaws.com/cache"
    );
    let aws = c.config.target.aws.as_ref().expect("target.aws");
    assert_eq!(aws.account_id, "123456789012");
    assert!(c.paths("not carried over").is_empty(), "{}", c.run.stderr);
    assert!(c.paths("changed").is_empty());
    assert!(
        c.item("note", "target.aws.prefix")
            .contains("under the prefix (cache/docker.io/library/nginx)")
    );
    // Without the slash k8s-image-swapper glued it to the host; reported.
    let c = converted_text(
        "target: {aws: {accountId: \"123456789012\", region: eu-west-1, prefix: mirror}}\n",
    );
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.eu-west-1.amazonaws.com/mirror"
    );
    assert!(
        c.item("changed", "target.aws.prefix")
            .contains("without a slash")
    );
}

#[test]
fn gar_target_and_source() {
    let c = converted("gar.yaml");
    assert_eq!(
        c.config.target.registry,
        "us-central1-docker.pkg.dev/gcp-project-123/main"
    );
    assert_eq!(c.config.swap_policy, SwapPolicy::Exists);
    assert_eq!(c.config.copy_policy, CopyPolicy::Force);
    assert_eq!(c.config.copy_deadline, Duration::from_secs(5));
    assert_eq!(c.sources(), ["*", "europe-west1-docker.pkg.dev"]);
    assert_eq!(c.filters(), ["!ends_with(obj.metadata.namespace, '-dev')"]);
    assert_eq!(
        c.paths("not carried over"),
        set(&["source.registries[0].gcp"])
    );
    assert!(c.paths("changed").is_empty());
    // No ECR note for an Artifact Registry target; the GAR auth example instead.
    assert!(!c.run.stderr.contains("ECR repositories"));
    assert!(c.run.stdout.contains("#   username: _json_key"));
}

#[test]
fn dry_run_logging_listen_and_tls() {
    let c = converted("dryrun-logging.yaml");
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.ap-southeast-2.amazonaws.com"
    );
    assert_eq!(c.config.copy_policy, CopyPolicy::None);
    assert_eq!(c.config.server.listen.to_string(), "0.0.0.0:9443");
    assert_eq!(
        c.config.server.tls_cert,
        Some(PathBuf::from("/usr/local/certificates/cert"))
    );
    assert_eq!(
        c.config.server.tls_key,
        Some(PathBuf::from("/usr/local/certificates/key"))
    );
    assert_eq!(
        c.paths("not carried over"),
        set(&["dryRun", "logLevel", "logFormat"])
    );
    assert!(
        c.item("not carried over", "dryRun")
            .contains("as with dryRun: false; nothing to do")
    );
    assert!(
        c.item("not carried over", "logLevel")
            .contains("--log-level trace")
    );
    assert!(
        c.item("not carried over", "logFormat")
            .contains("--log-format json")
    );
}

#[test]
fn misspelt_keys_are_reported_with_the_key_they_resemble() {
    let c = converted("typos.yaml");
    // k8s-image-swapper ignored the misspelt keys, so the defaults apply.
    assert_eq!(c.config.swap_policy, SwapPolicy::Exists);
    assert!(c.filters().is_empty());
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    );
    assert_eq!(
        c.paths("not carried over"),
        set(&["imageSwapPolcy", "source.filter", "target.aws.ecrOption"])
    );
    for (path, meant) in [
        ("imageSwapPolcy", "imageSwapPolicy"),
        ("source.filter", "filters"),
        ("target.aws.ecrOption", "ecrOptions"),
    ] {
        let line = c.item("not carried over", path);
        assert!(line.contains(&format!("did you mean `{meant}`?")), "{line}");
    }
}

#[test]
fn helm_values_convert_their_config_block_and_report_the_rest() {
    let c = converted("helm-values.yaml");
    assert_eq!(
        c.config.target.registry,
        "123456789012.dkr.ecr.ap-southeast-1.amazonaws.com"
    );
    assert_eq!(
        c.filters(),
        [
            "obj.metadata.namespace != 'default'",
            "contains(container.image, '.dkr.ecr.') && contains(container.image, '.amazonaws.com')",
        ]
    );
    // secretReader.enabled: the chart let k8s-image-swapper read pull secrets.
    assert!(c.config.source.image_pull_secrets);
    assert_eq!(
        c.paths("not carried over"),
        set(&[
            "replicaCount",
            "config.dryRun",
            "config.logLevel",
            "config.logFormat",
            "serviceAccount",
            "webhook",
        ])
    );
    assert!(
        c.item("note", "secretReader.enabled")
            .contains("get on secrets and serviceaccounts")
    );
}

#[test]
fn converted_output_passes_config_validate() {
    let c = converted("ecr-production.yaml");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pinswap.yaml");
    std::fs::write(&file, &c.run.stdout).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pinswap"))
        .args(["config", "validate"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn stdin_is_read_for_dash() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_pinswap"))
        .args(["config", "convert", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(data("gar.yaml")).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let config = Config::from_yaml(&stdout, "stdin").unwrap();
    assert_eq!(
        config.target.registry,
        "us-central1-docker.pkg.dev/gcp-project-123/main"
    );
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .starts_with("<stdin>: converted;")
    );
}

#[test]
fn malformed_inputs_fail_naming_the_key() {
    let cases = [
        ("not-yaml.yaml", "not-yaml.yaml:6:4: not valid YAML: "),
        (
            "swap-policy-number.yaml",
            "swap-policy-number.yaml: imageSwapPolicy: found the number 3, expected one of exists, always",
        ),
        (
            "copy-policy-unknown.yaml",
            "copy-policy-unknown.yaml: imageCopyPolicy: found \"lazy\", expected one of delayed, immediate, force, none",
        ),
        (
            "deadline-number.yaml",
            "deadline-number.yaml: imageCopyDeadline: found the number 8, which k8s-image-swapper reads as nanoseconds",
        ),
        (
            "target-missing-region.yaml",
            "target-missing-region.yaml: target.aws.region: missing",
        ),
        (
            "filters-not-a-list.yaml",
            "filters-not-a-list.yaml: source.filters: found the string",
        ),
        (
            "filter-bad-jmespath.yaml",
            "filter-bad-jmespath.yaml: source.filters[1].jmespath: not a valid JMESPath expression",
        ),
        (
            "target-early-format.yaml",
            "target-early-format.yaml: target.aws: missing; expected accountId and region (target.registry.aws is the format before target.type: move its keys to target.aws)",
        ),
        (
            "target-type-unknown.yaml",
            "target-type-unknown.yaml: target.type: found \"azure\", expected aws or gcp",
        ),
    ];
    for (name, want) in cases {
        let r = convert(&format!("invalid/{name}"));
        assert_eq!(r.code, 1, "{name}: {}", r.stderr);
        assert_eq!(r.stdout, "", "{name}: nothing on stdout");
        let first = r.stderr.lines().next().unwrap_or("");
        assert!(first.starts_with("error: "), "{name}: {first}");
        assert!(
            first.contains(want),
            "{name}: expected {want:?} in {first:?}"
        );
        assert!(!r.stderr.contains("panicked"), "{name}: {}", r.stderr);
    }
}

#[test]
fn a_missing_file_is_an_error() {
    let r = convert("no-such-file.yaml");
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with("error: ") && r.stderr.contains("no-such-file.yaml: cannot read: "),
        "{}",
        r.stderr
    );
}

const ECR: &str = "target: {aws: {accountId: \"111122223333\", region: us-east-1}}\n";

/// Line breaks YAML knows beyond \\n (U+2028, U+2029, NEL) and characters
/// it refuses raw can neither smuggle keys out of a report comment nor
/// change a filter: the output loads and holds exactly the input.
#[test]
fn odd_characters_cannot_change_the_converted_config() {
    let c = converted_text(&format!(
        "\"x\\u2028failurePolicy: closed\\u2028#\": 1\n\"y\\u2029recovery: {{enabled: false}}\\u2029#\": 2\n{ECR}"
    ));
    assert_eq!(
        c.config.failure_policy,
        pinswap::config::FailurePolicy::Open
    );
    assert!(c.config.recovery.enabled);
    assert_eq!(c.paths("not carried over").len(), 2, "{}", c.run.stderr);

    let exprs = [
        "obj.metadata.annotations.x == 'a\u{85}b'",
        "obj.metadata.annotations.x == 'a\u{2028}b\u{2029}c'",
        "obj.metadata.annotations.x == 'del\u{7f} bom\u{feff} fffe\u{fffe}'",
        "obj.metadata.name == 'yes # no ~'",
    ];
    // Written with YAML escapes, as a valid input file must.
    let escaped = |e: &str| {
        e.chars()
            .map(|c| match c {
                '\'' | ' ' | '#' | '~' | '.' | '=' => c.to_string(),
                c if c.is_ascii_alphanumeric() => c.to_string(),
                c => format!("\\u{:04X}", c as u32),
            })
            .collect::<String>()
    };
    let filters: String = exprs
        .iter()
        .map(|e| format!("  - jmespath: \"{}\"\n", escaped(e)))
        .collect();
    let c = converted_text(&format!("source:\n filters:\n{filters}{ECR}"));
    assert_eq!(c.filters(), exprs, "filters byte for byte");
}

#[test]
fn a_byte_order_mark_and_a_bare_zero_deadline_are_what_k8s_image_swapper_reads() {
    let c = converted_text(&format!("\u{feff}imageCopyDeadline: 0\n{ECR}"));
    assert_eq!(c.config.copy_deadline, Duration::from_secs(8));
    assert!(
        c.item("changed", "imageCopyDeadline")
            .contains("0 means the default (8s)")
    );
}

/// ECR and GAR fields become the registry host, so anything but an ID is
/// refused by key instead of sending pushes elsewhere.
#[test]
fn endpoint_fields_that_are_not_ids_are_refused() {
    let cases = [
        (
            "target: {aws: {accountId: \"evil.example/x\", region: us-east-1}}",
            "target.aws.accountId: found \"evil.example/x\"",
        ),
        (
            "target: {aws: {accountId: \"111122223333\", region: \"x/y\"}}",
            "target.aws.region: found \"x/y\"",
        ),
        (
            "target: {type: gcp, gcp: {location: \"evil.example/x\", projectId: p, repositoryId: r}}",
            "target.gcp.location: found \"evil.example/x\"",
        ),
        (
            "target: {type: gcp, gcp: {location: us, projectId: \"p/q\", repositoryId: r}}",
            "target.gcp.projectId: found \"p/q\"",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (text, want) in cases {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, format!("{text}\n")).unwrap();
        let r = convert_path(&path);
        assert_eq!(r.code, 1, "{text}: {}", r.stderr);
        assert_eq!(r.stdout, "");
        assert!(r.stderr.contains(want), "{text}: {}", r.stderr);
    }
    for region in ["us-gov-west-1", "cn-north-1", "ap-southeast-4"] {
        let c = converted_text(&format!(
            "target: {{aws: {{accountId: \"111122223333\", region: {region}}}}}\n"
        ));
        assert!(
            c.config
                .target
                .registry
                .contains(&format!(".dkr.ecr.{region}."))
        );
    }
}

/// Keys of released k8s-image-swapper versions outside its current docs.
#[test]
fn skip_registries_private_registries_and_generic_sources_are_reported() {
    let c = converted_text(&format!(
        "imageCopySkipRegistries: [k8s.gcr.io]\nsource:\n  privateRegistries: [{{aws: {{accountId: \"222233334444\", region: eu-west-1}}}}]\n  registries: [{{type: generic, generic: {{name: h, genericOptions: {{domain: harbor.example.com, username: u, password: p}}}}}}]\n{ECR}"
    ));
    assert!(
        c.item("not carried over", "imageCopySkipRegistries")
            .contains("without copying them")
    );
    assert!(
        c.item("not carried over", "source.registries[0]")
            .contains("harbor.example.com")
    );
    c.item("not carried over", "source.privateRegistries[0].aws");
    let sources = c.sources();
    for host in [
        "*",
        "222233334444.dkr.ecr.eu-west-1.amazonaws.com",
        "harbor.example.com",
    ] {
        assert!(sources.contains(&host), "{host}: {sources:?}");
    }
    assert!(
        !c.run.stdout.contains("password: p"),
        "no credentials carried"
    );
}

/// A changed value is reported under a key the file has, even when the
/// other cache key took k8s-image-swapper's default.
#[test]
fn a_cache_change_is_reported_under_a_key_in_the_file() {
    let c = converted_text(&format!("cacheTtlMinutes: 60\n{ECR}"));
    let line = c.item("changed", "cacheTtlMinutes");
    assert!(
        line.contains("default cacheJitterMaxMinutes, 180"),
        "{line}"
    );
    assert!(
        !c.run.stderr.contains("changed: cacheJitterMaxMinutes"),
        "{}",
        c.run.stderr
    );
    assert_eq!(c.config.cache.ttl, Duration::from_secs(240 * 60));
}

/// One registry reached twice (two entries, or two spellings) is listed
/// once, since pinswap refuses duplicates; the second is noted.
#[test]
fn a_source_registry_listed_twice_is_written_once() {
    let c = converted_text(&format!(
        "source:\n  registries:\n  - {{aws: {{accountId: \"222233334444\", region: eu-west-1}}}}\n  - {{aws: {{accountId: \"222233334444\", region: eu-west-1}}}}\n{ECR}"
    ));
    assert_eq!(
        c.sources(),
        ["*", "222233334444.dkr.ecr.eu-west-1.amazonaws.com"]
    );
    assert!(
        c.item("note", "source.registries[1]")
            .contains("already listed, from source.registries[0]")
    );
}

/// k8s-image-swapper's own example config (its repository's
/// `.k8s-image-swapper.yml`) has `encryptionType: AES256` with
/// `kmsKey: string`. k8s-image-swapper sends kmsKey only with KMS, so the
/// key is dropped with a note, and the rest carries over.
#[test]
fn the_upstream_example_config_converts_with_its_kms_key_dropped() {
    let c = converted("upstream/k8s-image-swapper.yml");
    let aws = c.config.target.aws.as_ref().expect("target.aws");
    assert_eq!(aws.account_id, "123456789");
    assert_eq!(
        aws.role.as_deref(),
        Some("arn:aws:iam::123456789012:role/roleName")
    );
    let o = &aws.ecr_options;
    assert_eq!(o.encryption_configuration.encryption_type, "AES256");
    assert_eq!(o.encryption_configuration.kms_key, "");
    assert_eq!(o.tags.len(), 2);
    assert!(o.access_policy.contains("AllowCrossAccountPull"));
    assert!(o.lifecycle_policy.contains("imageCountMoreThan"));
    assert!(
        c.item(
            "not carried over",
            "target.aws.ecrOptions.encryptionConfiguration.kmsKey"
        )
        .contains("ignored it with AES256"),
        "{}",
        c.run.stderr
    );
    assert_eq!(c.filters(), ["obj.metadata.namespace == 'kube-system'"]);
    // With KMS, the key is what the repositories are encrypted with.
    let kms = std::fs::read_to_string(data("upstream/k8s-image-swapper.yml"))
        .unwrap()
        .replace("encryptionType: AES256", "encryptionType: KMS");
    let c = converted_text(&kms);
    let o = &c.config.target.aws.as_ref().unwrap().ecr_options;
    assert_eq!(o.encryption_configuration.kms_key, "string");
}

/// Every config sample in k8s-image-swapper's repository
/// (tests/data/k8s-image-swapper/upstream, see its README): each converts
/// to a config that loads, or fails naming the key k8s-image-swapper's
/// own docs leave out. None is "a bug in pinswap config convert".
#[test]
fn every_upstream_sample_config_converts_or_names_what_is_missing() {
    let dir = data("upstream");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 19, "{names:?}");
    let mut failed = Vec::new();
    for name in &names {
        let run = convert_path(&dir.join(name));
        assert!(
            !run.stderr.contains("a bug in pinswap") && !run.stderr.contains("panicked"),
            "{name}: {}",
            run.stderr
        );
        match run.code {
            0 => {
                converted_run(name, run);
            }
            _ => {
                assert_eq!(run.code, 1, "{name}: {}", run.stderr);
                let first = run.stderr.lines().next().unwrap_or("").to_owned();
                assert!(
                    first.starts_with(&format!("error: {}", dir.join(name).display())),
                    "{name}: {first}"
                );
                failed.push((name.clone(), first));
            }
        }
    }
    // The snippets that show one key and no target: k8s-image-swapper
    // defaults to an ECR target without an account, which cannot run, and
    // pinswap names the key to add.
    let refused: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        refused,
        [
            "config-test-empty-config-with-defaults.yaml",
            "config-test-multiple-filters.yaml",
            "config-test-multiple-source-registries.yaml",
            "configuration-dry-run.yaml",
            "configuration-filter-dev-suffix.yaml",
            "configuration-filter-ecr-images.yaml",
            "configuration-filter-kube-system.yaml",
            "configuration-filter-playground.yaml",
            "configuration-log-level.yaml",
            "configuration-source-registries-aws.yaml",
            "configuration-target-ecr-tags.yaml",
        ]
    );
    for (name, first) in &failed {
        let want = match name.as_str() {
            "configuration-target-ecr-tags.yaml" => ": target.aws.accountId: missing; ",
            _ => ": target: missing; expected target.type (aws or gcp)",
        };
        assert!(first.contains(want), "{name}: {first}");
    }
}
