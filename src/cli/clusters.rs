//! `pinswap clusters list|forget`: the usage records of the clusters that
//! share a target (see [`crate::retention::clusters`]).

use std::process::ExitCode;
use std::sync::Arc;

use clap::Subcommand;
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use super::Usage;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::retention::clusters::{Records, age};

/// `pinswap clusters ...`.
#[derive(Debug, Subcommand)]
pub enum ClustersCommand {
    /// List each cluster's usage record at the target: name, last update, images, state.
    #[command(after_help = "Examples:\n  \
        pinswap clusters list -c pinswap.yaml\n  \
        pinswap clusters list -c pinswap.yaml --json")]
    List {
        /// The webhook's config file (its target, credentials and sharing.staleAfter).
        #[arg(short, long)]
        config: std::path::PathBuf,
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Remove a retired cluster's usage record, so that retention stops keeping what it listed; exit 1 when it has none.
    #[command(after_help = "Examples:\n  \
        pinswap clusters forget -c pinswap.yaml eu-west-old")]
    Forget {
        /// The webhook's config file.
        #[arg(short, long)]
        config: std::path::PathBuf,
        /// The cluster's name.
        name: String,
    },
}

/// One row of `pinswap clusters list --json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Row {
    cluster: String,
    updated: String,
    age_seconds: u64,
    images: usize,
    in_use: usize,
    state: &'static str,
}

async fn records(path: &std::path::Path) -> anyhow::Result<(Config, Records)> {
    let config = super::load_config(path)?;
    records_of(path, config).await
}

async fn records_of(path: &std::path::Path, config: Config) -> anyhow::Result<(Config, Records)> {
    // As `serve` and `mutate` say it: the config's credentials (a missing
    // passwordFile) are the config's problem.
    let mirror = Mirror::connect(&config, Arc::new(Metrics::new()))
        .await
        .map_err(|e| Usage(format!("{}: {e}", path.display())))?;
    let records = Records::of(&mirror).await?;
    Ok((config, records))
}

/// Runs a `clusters` command.
pub async fn run(command: ClustersCommand) -> anyhow::Result<ExitCode> {
    match command {
        ClustersCommand::List { config: path, json } => {
            let config = super::load_config(&path)?;
            // Without sharing no cluster of this config publishes a record:
            // an empty list, or the target's answer for a repository nobody
            // wrote, would say nothing about why.
            if !config.sharing.enabled {
                return Err(Usage(format!(
                    "{}: sharing is off (sharing.enabled: false), so this cluster publishes no usage record and retention reads none; list with the config of a cluster that has sharing.enabled: true, or turn sharing on (with cluster) here",
                    path.display()
                ))
                .into());
            }
            let (config, records) = records_of(&path, config).await?;
            let now = Timestamp::now();
            let mut rows = Vec::new();
            for name in records.names().await? {
                let row = match records.read(&name).await {
                    Ok(Some(r)) => Row {
                        state: match (r.complete, r.is_stale(now, config.sharing.stale_after)) {
                            (false, _) => "incomplete",
                            (true, true) => "stale",
                            (true, false) => "fresh",
                        },
                        age_seconds: age(now, r.updated).as_secs(),
                        updated: r.updated.to_string(),
                        images: r.images.len(),
                        in_use: r.in_use,
                        cluster: name,
                    },
                    Ok(None) | Err(_) => Row {
                        cluster: name,
                        updated: String::new(),
                        age_seconds: 0,
                        images: 0,
                        in_use: 0,
                        state: "unreadable",
                    },
                };
                rows.push(row);
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!(
                    "{:<24} {:<26} {:>10} {:>8} {:>8}  STATE",
                    "CLUSTER", "UPDATED", "AGE", "IMAGES", "IN USE"
                );
                for r in &rows {
                    let age =
                        humantime::format_duration(std::time::Duration::from_secs(r.age_seconds));
                    println!(
                        "{:<24} {:<26} {:>10} {:>8} {:>8}  {}",
                        r.cluster,
                        r.updated,
                        age.to_string(),
                        r.images,
                        r.in_use,
                        r.state
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        ClustersCommand::Forget { config, name } => {
            // Any tag, not only a cluster name: a tag another tool left in
            // the records' repository stops retention until it goes.
            let (config, records) = records(&config).await?;
            if let Err(e) = records.repository().with_tag(&name) {
                return Err(Usage(format!("NAME: {e}")).into());
            }
            if config.cluster.as_deref() == Some(name.as_str()) {
                eprintln!(
                    "note: {name} is this config's own cluster; while its leader runs, it publishes its record again within sharing.interval"
                );
            }
            if records.forget(&name).await? {
                println!("forgot cluster {name}: retention no longer keeps what it listed");
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!("no usage record of cluster {name} at the target");
                Ok(ExitCode::from(1))
            }
        }
    }
}
