//! `pinswap export` and `pinswap import` (see [`crate::airgap`]).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use super::{RegistryArgs, Usage};
use crate::airgap::export::{ExportOptions, export};
use crate::airgap::import::{ImportOptions, import};
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::reference::MirrorTarget;
use crate::registry::ClientPool;

/// `pinswap export -c FILE [--cluster NAME]... --output DIR|FILE.tar`.
#[derive(Debug, Args)]
#[command(
    after_help = "Exit codes: 0 everything the records list was written; 1 something \
could not be (named on stderr and in the manifest's `missing`); 2 usage error.\n\nExamples:\n  \
    pinswap export -c pinswap.yaml --output running-set\n  \
    pinswap export -c pinswap.yaml --cluster eu-west --cluster us-east --output running-set.tar"
)]
pub struct ExportArgs {
    /// The config of a cluster that shares the target (its target and credentials).
    #[arg(short, long)]
    pub config: PathBuf,
    /// Export what this cluster's usage record lists (repeatable); default: every record at the target.
    #[arg(long = "cluster", value_name = "NAME")]
    pub clusters: Vec<String>,
    /// The OCI layout directory to write, or FILE.tar for a tar of one (built in FILE.tar.layout/, removed once the tar is written).
    #[arg(short, long, value_name = "DIR|FILE.tar")]
    pub output: PathBuf,
    /// Blobs in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Print the export's manifest (what it wrote) as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `pinswap import DIR|FILE.tar --to REGISTRY[/PREFIX]`.
#[derive(Debug, Args)]
#[command(
    after_help = "Exit codes: 0 every entry is at the registry; 1 an entry failed, or a \
tag there names another manifest and was left alone; 2 usage error.\n\nExamples:\n  \
    pinswap import running-set --to registry.internal:5000/mirror\n  \
    pinswap import running-set.tar --to registry.internal:5000/mirror --dest-creds \"$USER:$PASS\""
)]
pub struct ImportArgs {
    /// The export: its layout directory, or its tar.
    pub input: PathBuf,
    /// The registry and prefix to push under, as a config's `target.registry`.
    #[arg(long, value_name = "REGISTRY[/PREFIX]")]
    pub to: String,
    /// Move a tag that names another manifest at the registry (default: leave it and report it).
    #[arg(long)]
    pub replace_tags: bool,
    /// Blobs in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Print what it did as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Registry access (`--dest-creds` authenticates the pushes).
    #[command(flatten)]
    pub registry: RegistryArgs,
}

fn is_tar(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "tar")
}

/// `FILE.tar.layout`: where a tar's layout is built or unpacked.
fn beside(tar: &Path) -> PathBuf {
    let mut s = tar.as_os_str().to_owned();
    s.push(".layout");
    PathBuf::from(s)
}

/// Runs `pinswap export`.
pub async fn run_export(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let config = super::load_config(&args.config)?;
    if !config.sharing.enabled {
        return Err(Usage(format!(
            "{}: sharing is off (sharing.enabled: false), so no cluster publishes a usage record to export; export with the config of a cluster that has sharing.enabled: true",
            args.config.display()
        ))
        .into());
    }
    let mirror = Mirror::connect(&config, Arc::new(Metrics::new()))
        .await
        .map_err(|e| Usage(format!("{}: {e}", args.config.display())))?;
    let tar = is_tar(&args.output);
    let dir = if tar {
        beside(&args.output)
    } else {
        args.output.clone()
    };
    let opts = ExportOptions {
        clusters: args.clusters.clone(),
        jobs: usize::from(args.jobs),
        progress: std::io::stderr().is_terminal(),
    };
    let done = export(&mirror, &dir, &opts).await?;
    let m = &done.manifest;
    if tar {
        let (from, out, files) = (dir.clone(), args.output.clone(), done.files.clone());
        tokio::task::spawn_blocking(move || write_tar(&from, &files, &out))
            .await
            .context("the tar writer stopped")??;
        // Kept while incomplete: running the export again resumes from it.
        if done.complete() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("{}: cannot remove once tarred", dir.display()))?;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(m)?);
    }
    eprintln!(
        "exported {} manifests ({} blobs, {} bytes) of {} clusters to {}",
        m.entries.len(),
        m.blobs,
        m.bytes,
        m.clusters.len(),
        args.output.display()
    );
    for name in &m.missing {
        eprintln!("missing at the target: {name}");
    }
    for f in &m.failed {
        eprintln!("not exported: {f}");
    }
    if done.complete() {
        return Ok(ExitCode::SUCCESS);
    }
    if tar {
        eprintln!(
            "{} is kept: run the export again to resume it",
            dir.display()
        );
    }
    Ok(ExitCode::from(1))
}

/// Runs `pinswap import`.
pub async fn run_import(args: ImportArgs) -> anyhow::Result<ExitCode> {
    let to =
        MirrorTarget::parse(&args.to).map_err(|e| Usage(format!("--to {:?}: {e}", args.to)))?;
    if !args.input.exists() {
        return Err(super::unreadable("", &args.input, "no such file or directory").into());
    }
    let pool = Arc::new(ClientPool::new(args.registry.pool_options()?));
    let (dir, unpacked) = if is_tar(&args.input) {
        // A directory of its own, however many imports run beside it.
        let dir = unpack_dir(&args.input)?;
        let (tar, d) = (args.input.clone(), dir.clone());
        let read = tokio::task::spawn_blocking(move || read_tar(&tar, &d))
            .await
            .context("the tar reader stopped");
        if let Err(e) = read.and_then(|r| r) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        (dir, true)
    } else {
        (args.input.clone(), false)
    };
    let opts = ImportOptions {
        jobs: usize::from(args.jobs),
        replace_tags: args.replace_tags,
        progress: std::io::stderr().is_terminal(),
    };
    let result = import(&dir, &to, pool, &opts).await;
    if unpacked {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let done = match result {
        Ok(d) => d,
        Err(e @ crate::airgap::AirgapError::NotAnExport { .. }) => {
            return Err(Usage(e.to_string()).into());
        }
        Err(e) => return Err(e.into()),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    }
    eprintln!(
        "imported into {to}: {} pushed, {} already there, {} tags left alone, {} failed",
        done.pushed,
        done.present,
        done.conflicts.len(),
        done.failed.len()
    );
    for c in &done.conflicts {
        eprintln!("left alone (rerun with --replace-tags to move it): {c}");
    }
    for f in &done.failed {
        eprintln!("not imported: {f}");
    }
    if done.incomplete > 0 {
        eprintln!(
            "the export itself is incomplete: {} of what its records list were missing at its target or failed (its pinswap-export.json names them)",
            done.incomplete
        );
    }
    Ok(
        if done.conflicts.is_empty() && done.failed.is_empty() && done.incomplete == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        },
    )
}

/// A new directory beside `tar` to unpack it into.
fn unpack_dir(tar: &Path) -> anyhow::Result<PathBuf> {
    let mut s = tar.as_os_str().to_owned();
    s.push(format!(".import-{}", std::process::id()));
    let dir = PathBuf::from(s);
    std::fs::create_dir(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    Ok(dir)
}

/// Writes the export in `dir` into the tar `out` (through a temporary
/// file renamed into place): `oci-layout`, `index.json`, the export's
/// manifest and `files`, nothing else the directory holds.
fn write_tar(dir: &Path, files: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    let tmp = out.with_extension("tar.tmp");
    let cannot = || format!("{}: cannot write", tmp.display());
    let file = std::fs::File::create(&tmp).with_context(cannot)?;
    let mut tar = tar::Builder::new(std::io::BufWriter::new(file));
    tar.follow_symlinks(false);
    let top = [
        PathBuf::from("oci-layout"),
        PathBuf::from("index.json"),
        PathBuf::from(crate::airgap::MANIFEST_FILE),
    ];
    for f in top.iter().chain(files) {
        tar.append_path_with_name(dir.join(f), f)
            .with_context(|| format!("{}: cannot add {}", tmp.display(), f.display()))?;
    }
    let w = tar.into_inner().with_context(cannot)?;
    w.into_inner()
        .map_err(|e| anyhow::anyhow!("{}: cannot write: {}", tmp.display(), e.error()))?
        .sync_all()
        .with_context(cannot)?;
    std::fs::rename(&tmp, out).with_context(|| format!("{}: cannot write", out.display()))?;
    Ok(())
}

/// Unpacks the tar `tar` into `dir`: files and directories only, none
/// whose path leads out of `dir`.
fn read_tar(tar: &Path, dir: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(tar).map_err(|e| super::unreadable("", tar, e))?;
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(file));
    archive.set_preserve_permissions(false);
    for entry in archive
        .entries()
        .map_err(|e| Usage(format!("{}: not a tar: {e}", tar.display())))?
    {
        let mut entry = entry.map_err(|e| Usage(format!("{}: not a tar: {e}", tar.display())))?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir()) {
            return Err(Usage(format!(
                "{}: holds a {kind:?} entry; an export holds only files and directories",
                tar.display()
            ))
            .into());
        }
        let inside = entry
            .unpack_in(dir)
            .map_err(|e| Usage(format!("{}: cannot unpack: {e}", tar.display())))?;
        if !inside {
            return Err(Usage(format!(
                "{}: cannot unpack: an entry's path ({}) leads out of the export",
                tar.display(),
                crate::logsafe::clip(&String::from_utf8_lossy(&entry.path_bytes()), 200)
            ))
            .into());
        }
    }
    Ok(())
}
