//! `pinswap version`, `pinswap completions` and `pinswap man`: what the
//! binary is, and the shell completions and man pages generated from the
//! clap definitions (so they never drift from the flags).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory};
use serde::Serialize;

use super::{Cli, Usage};

/// `pinswap version [--json]`.
#[derive(Debug, Args)]
pub struct VersionArgs {
    /// Print `{version, commit, target, rustc}` as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `pinswap completions SHELL`.
#[derive(Debug, Args)]
#[command(after_help = "Install (the shell loads them at its next start):\n  \
    pinswap completions bash > ~/.local/share/bash-completion/completions/pinswap\n  \
    pinswap completions zsh > \"${fpath[1]}/_pinswap\"\n  \
    pinswap completions fish > ~/.config/fish/completions/pinswap.fish")]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `pinswap man [--dir DIR]`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pinswap man | man -l -\n  \
    pinswap man --dir ~/.local/share/man/man1   # pinswap.1, pinswap-copy.1, ...")]
pub struct ManArgs {
    /// Write `pinswap.1` and a page per subcommand (`pinswap-copy.1`, ...)
    /// into this directory instead of printing `pinswap.1`.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Build information, set by `build.rs`.
#[derive(Debug, Serialize)]
struct BuildInfo {
    version: &'static str,
    /// Empty when neither `PINSWAP_GIT_COMMIT` nor git was there at build time.
    commit: &'static str,
    target: &'static str,
    rustc: &'static str,
}

const BUILD: BuildInfo = BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
    commit: env!("PINSWAP_GIT_COMMIT"),
    target: env!("PINSWAP_TARGET"),
    rustc: env!("PINSWAP_RUSTC"),
};

pub(super) fn version(args: &VersionArgs) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &BUILD)?;
        writeln!(out)?;
    } else {
        let unknown = |s: &'static str| if s.is_empty() { "unknown" } else { s };
        writeln!(out, "pinswap {}", BUILD.version)?;
        writeln!(out, "commit: {}", unknown(BUILD.commit))?;
        writeln!(out, "target: {}", unknown(BUILD.target))?;
        writeln!(out, "rustc:  {}", unknown(BUILD.rustc))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) fn completions(args: &CompletionsArgs) -> anyhow::Result<ExitCode> {
    let mut cmd = Cli::command();
    // Into a buffer first: clap_complete panics when its writer fails (a
    // closed pipe, as in `| head`); ours reports the error instead.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "pinswap", &mut script);
    std::io::stdout().lock().write_all(&script)?;
    Ok(ExitCode::SUCCESS)
}

pub(super) fn man(args: &ManArgs) -> anyhow::Result<ExitCode> {
    let cmd = Cli::command();
    match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .and_then(|()| clap_mangen::generate_to(cmd, dir))
                .map_err(|e| Usage(format!("--dir {}: {e}", dir.display())))?;
            println!("wrote man pages to {}", dir.display());
        }
        None => clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?,
    }
    Ok(ExitCode::SUCCESS)
}
