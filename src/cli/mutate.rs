//! `pinswap mutate`: inputs (files, directories, stdin), outputs (stdout or
//! in place), the per-image report, `--check`, `--krm`, and exit codes.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use super::{Usage, unreadable};
use crate::admission::Admission;
use crate::mutate::{self, Options, SlotReport, Status, krm};

/// `pinswap mutate -c FILE [-f PATH]... [-n NS] [--in-place|--check] [--json]`, or
/// `pinswap mutate --krm`.
#[derive(Debug, Args)]
#[command(
    after_help = "Exit codes: 0 every image was pinned or deliberately skipped \
(filter, source.registries, already under the target); 1 an image could not be pinned, \
or with --check an image would change; 2 usage error, or an input that is not YAML/JSON.\n\n\
Examples:\n  \
    pinswap mutate -c pinswap.yaml -f deploy/ --in-place\n  \
    pinswap mutate -c pinswap.yaml -f app.yaml -f db.yaml > pinned.yaml\n  \
    pinswap mutate -c pinswap.yaml -f deploy/ --check   # CI gate\n  \
    kustomize build --enable-alpha-plugins --enable-exec .   # with pinswap mutate --krm as a transformer"
)]
pub struct MutateArgs {
    /// The YAML config, as for `serve` (with --krm: instead of functionConfig).
    #[arg(
        long,
        short = 'c',
        value_name = "FILE",
        required_unless_present = "krm"
    )]
    pub config: Option<PathBuf>,
    /// Manifests (multi-document YAML or JSON), or directories to search
    /// recursively for *.yaml, *.yml and *.json; `-` for stdin (the default).
    /// Repeatable.
    #[arg(long = "filename", short = 'f', value_name = "PATH")]
    pub files: Vec<PathBuf>,
    /// Write each changed file back in place instead of printing the result.
    #[arg(long, short = 'i', conflicts_with_all = ["check", "krm"])]
    pub in_place: bool,
    /// Change nothing and copy nothing: list every image that would change or
    /// could not be pinned, and exit 1 if there is any (a CI gate).
    #[arg(long, conflicts_with = "krm")]
    pub check: bool,
    /// Decide without copying anything: images already at the target are
    /// rewritten, others only with `swapPolicy: always`.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the per-image report as JSON on stdout (needs --in-place or
    /// --check, since stdout carries the manifests otherwise).
    #[arg(long, conflicts_with = "krm")]
    pub json: bool,
    /// Run as a KRM function: a ResourceList on stdin, one on stdout, the
    /// config from its functionConfig (a ConfigMap with data.config, or an
    /// object whose spec is the config) unless --config is given.
    #[arg(long, conflicts_with = "files")]
    pub krm: bool,
    /// The namespace of manifests that name none, as `kubectl apply -n` would
    /// put them: the namespace `mirrorOnly` sees for their Pods.
    #[arg(long, short = 'n', value_name = "NS", default_value = crate::mutate::DEFAULT_NAMESPACE)]
    pub namespace: String,
}

/// One input and what became of it, in the JSON report.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FileReport {
    path: String,
    changed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    images: Vec<SlotReport>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report {
    files: Vec<FileReport>,
    rewritten: usize,
    skipped: usize,
    unpinned: usize,
    failed: usize,
}

/// Every file `paths` names: files as given, directories searched
/// recursively (sorted; hidden entries and symlinked directories skipped).
fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Usage> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), Usage> {
        let read = std::fs::read_dir(dir).map_err(|e| unreadable("", dir, e))?;
        let mut entries: Vec<_> = read
            .collect::<Result<_, _>>()
            .map_err(|e| unreadable("", dir, e))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let ty = e.file_type().map_err(|err| unreadable("", &path, err))?;
            if ty.is_dir() {
                walk(&path, out)?;
            } else if path.is_file()
                && path
                    .extension()
                    .is_some_and(|x| x == "yaml" || x == "yml" || x == "json")
            {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        if p.as_os_str() != "-" && p.is_dir() {
            walk(p, &mut out)?;
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

fn read_input(path: &Path) -> Result<String, Usage> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| Usage(format!("stdin: {e}")))?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|e| unreadable("", path, e))
}

/// Replaces `path` by `text` through a temporary file in the same
/// directory, keeping its permissions, so an interrupted run leaves the old
/// file or the new one.
fn write_in_place(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile_in(dir, path)?;
    std::io::Write::write_all(&mut tmp.1, text.as_bytes())?;
    tmp.1.sync_all()?;
    let perms = std::fs::metadata(path)?.permissions();
    std::fs::set_permissions(&tmp.0, perms)?;
    std::fs::rename(&tmp.0, path)
}

fn tempfile_in(dir: &Path, path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for i in 0..100u32 {
        let tmp = dir.join(format!(".{name}.pinswap-{}-{i}", std::process::id()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free temporary name"))
}

fn line(file: &str, s: &SlotReport) -> String {
    let what = match s.status {
        Status::Rewritten => "rewritten",
        Status::Skipped => "skipped",
        Status::Unpinned => "not pinned",
        Status::Failed => "failed",
    };
    let change = match &s.new_image {
        Some(new) => format!("{} -> {new}", s.image),
        None => s.image.clone(),
    };
    format!(
        "{file}: {} {}: {what}: {change} ({})",
        s.resource, s.field, s.reason
    )
}

/// The registry an image's failure `reason` could not reach at all, and
/// the error from `cannot reach registry` on.
fn unreachable_registry(reason: &str) -> Option<(&str, &str)> {
    const UNREACHABLE: &str = "cannot reach registry ";
    let message = &reason[reason.find(UNREACHABLE)?..];
    let (registry, _) = message[UNREACHABLE.len()..].split_once(": ")?;
    Some((registry, message))
}

fn config(path: &Path) -> Result<crate::config::Config, Usage> {
    super::load_config(path)
}

// `connect`, not `from_config`: an ECR target signs in through the AWS API.
async fn admission(config: &crate::config::Config, label: &str) -> Result<Admission, Usage> {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    Admission::connect(config, metrics)
        .await
        .map_err(|e| Usage(format!("{label}: {e}")))
}

/// Runs `pinswap mutate`.
///
/// # Errors
/// [`Usage`] for bad flags, unreadable inputs or config.
/// The custom resources `mutate` rewrites: those `customResources` turns
/// on, when its `rewrite` is set.
fn rewritten_resources(config: &crate::config::Config) -> Vec<crate::config::ImageFields> {
    match config.custom_resources.rewrite {
        true => config.custom_resources.fields(),
        false => Vec::new(),
    }
}

pub async fn run(args: MutateArgs) -> anyhow::Result<ExitCode> {
    if args.krm {
        return run_krm(args).await;
    }
    let config_path = args.config.clone().context("--config is required")?;
    let files = if args.files.is_empty() {
        vec![PathBuf::from("-")]
    } else {
        args.files.clone()
    };
    if args.json && !(args.in_place || args.check) {
        return Err(Usage(
            "--json needs --in-place or --check: stdout carries the manifests otherwise".into(),
        )
        .into());
    }
    let files = expand(&files)?;
    if args.in_place && files.iter().any(|f| f.as_os_str() == "-") {
        return Err(Usage("--in-place needs files or directories, not stdin".into()).into());
    }
    let config = config(&config_path)?;
    let adm = admission(&config, &config_path.display().to_string()).await?;
    let opts = Options {
        dry_run: args.dry_run || args.check,
        namespace: args.namespace.clone(),
        resources: rewritten_resources(&config),
    };
    let mut reports = Vec::new();
    let mut outputs: Vec<String> = Vec::new();
    let mut bad_input = false;
    for path in &files {
        let name = match path.as_os_str() == "-" {
            true => "stdin".to_owned(),
            false => path.display().to_string(),
        };
        let mut report = FileReport {
            path: name.clone(),
            changed: false,
            error: None,
            images: Vec::new(),
        };
        let result = match read_input(path) {
            Ok(input) => match mutate::mutate(&adm, &input, opts.clone()).await {
                Ok(m) => Ok((input, m)),
                Err(e) => {
                    // On stdout the stream stays whole: this input as it was.
                    if !args.in_place && !args.check {
                        outputs.push(input);
                    }
                    Err(e.to_string())
                }
            },
            Err(e) => Err(e.0),
        };
        match result {
            Ok((input, m)) => {
                report.changed = m.text != input;
                if args.in_place && report.changed {
                    write_in_place(path, &m.text)
                        .with_context(|| format!("writing {}", path.display()))?;
                } else if !args.in_place && !args.check {
                    outputs.push(m.text);
                }
                report.images = m.slots;
            }
            Err(e) => {
                bad_input = true;
                let e = match e.starts_with(&name) {
                    true => e,
                    false => format!("{name}: {e}"),
                };
                report.error = Some(e);
            }
        }
        reports.push(report);
    }
    let failed_copies = adm.wait_for_copies().await;
    let count = |st: Status| {
        reports
            .iter()
            .flat_map(|r| &r.images)
            .filter(|s| s.status == st)
            .count()
    };
    let summary = Report {
        rewritten: count(Status::Rewritten),
        skipped: count(Status::Skipped),
        unpinned: count(Status::Unpinned),
        failed: count(Status::Failed),
        files: reports,
    };
    // --check: a rewrite it would make is a change the manifests lack.
    let flagged =
        summary.unpinned + summary.failed + if args.check { summary.rewritten } else { 0 };
    let mut out = String::new();
    for (i, text) in outputs.iter().enumerate() {
        if i > 0 {
            if !out.ends_with('\n') {
                out.push('\n');
            }
            if !text.trim_start().starts_with("---") {
                out.push_str("---\n");
            }
        }
        out.push_str(text);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{out}");
        // A registry that cannot be reached fails every image it holds
        // alike: its error is said once, each image names only it.
        let mut unreachable: Vec<(String, String, usize)> = Vec::new();
        for f in &summary.files {
            if let Some(e) = &f.error {
                eprintln!("error: {e}");
            }
            for s in &f.images {
                let l = match unreachable_registry(&s.reason) {
                    Some((registry, message)) => {
                        match unreachable.iter_mut().find(|(r, _, _)| r == registry) {
                            Some((_, _, n)) => *n += 1,
                            None => unreachable.push((registry.to_owned(), message.to_owned(), 1)),
                        }
                        let mut short = s.clone();
                        short.reason = format!("cannot reach registry {registry}");
                        line(&f.path, &short)
                    }
                    None => line(&f.path, s),
                };
                match (args.check, s.status) {
                    (true, Status::Skipped) => {}
                    (true, Status::Rewritten) => println!(
                        "{}",
                        l.replacen(": rewritten: ", ": would be rewritten: ", 1)
                    ),
                    (true, _) => println!("{l}"),
                    (false, _) => eprintln!("{l}"),
                }
            }
        }
        let target = crate::reference::MirrorTarget::parse(&config.target.registry).ok();
        for (registry, message, n) in &unreachable {
            let what = match target.as_ref().is_some_and(|t| t.registry() == registry) {
                true => format!("target.registry {}: ", config.target.registry),
                false => String::new(),
            };
            eprintln!("error: {what}{message} ({n} image(s))");
        }
        let changed = summary.files.iter().filter(|f| f.changed).count();
        eprintln!(
            "{} image(s): {} rewritten, {} skipped, {} not pinned, {} failed{}",
            summary.rewritten + summary.skipped + summary.unpinned + summary.failed,
            summary.rewritten,
            summary.skipped,
            summary.unpinned,
            summary.failed,
            match (args.in_place, args.check) {
                (true, _) => format!("; {changed} file(s) written"),
                (_, true) if flagged > 0 => "; the manifests are not pinned".into(),
                _ => String::new(),
            }
        );
    }
    if failed_copies > 0 {
        eprintln!("warning: {failed_copies} copies failed; see the log");
    }
    Ok(if bad_input {
        ExitCode::from(2)
    } else if flagged > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

async fn run_krm(args: MutateArgs) -> anyhow::Result<ExitCode> {
    let input = read_input(Path::new("-"))?;
    let loaded = match &args.config {
        Some(path) => config(path).map_err(|e| e.0),
        None => match krm::function_config(&input).map_err(|e| Usage(e.to_string()))? {
            Some((text, label)) => crate::config::Config::from_yaml(&text, &label).map_err(|e| e.to_string()),
            None => Err("functionConfig: missing; expected a ConfigMap with data.config, or an object whose spec is pinswap's config (or pass --config)".into()),
        },
    };
    let resources = loaded.as_ref().map(rewritten_resources).unwrap_or_default();
    let adm = match loaded {
        Ok(c) => admission(&c, "functionConfig").await.map_err(|e| e.0),
        Err(e) => Err(e),
    };
    let adm = match adm {
        Ok(a) => a,
        Err(message) => {
            print!(
                "{}",
                krm::fail(&input, &message).map_err(|e| Usage(e.to_string()))?
            );
            return Ok(ExitCode::from(1));
        }
    };
    let out = krm::run(
        &adm,
        &input,
        Options {
            dry_run: args.dry_run,
            namespace: args.namespace.clone(),
            resources,
        },
    )
    .await
    .map_err(|e| Usage(e.to_string()))?;
    adm.wait_for_copies().await;
    print!("{}", out.text);
    Ok(if out.failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
