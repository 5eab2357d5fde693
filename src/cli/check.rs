//! `pinswap check`: each manifest's config digest (image ID), with
//! non-unique configs and collisions flagged (see [`crate::identity`]).

use std::io::Write;
use std::process::ExitCode;

use serde::Serialize;

use super::{CheckArgs, Usage};
use crate::reference::Reference;
use crate::registry::ClientPool;

/// One image manifest in `pinswap check --json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CheckedImage {
    reference: String,
    platform: Option<String>,
    manifest: String,
    config: String,
    layers: Vec<String>,
    content_bearing: bool,
    non_unique: Option<String>,
    collides_with: Vec<String>,
}

/// `pinswap check --json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CheckReport {
    images: Vec<CheckedImage>,
    flagged: usize,
    errors: Vec<String>,
}

pub(super) async fn check(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let mut refs = Vec::new();
    // `docker://` as `copy` takes it; a registry is all `check` reads.
    let bare = |r: &str| r.strip_prefix("docker://").unwrap_or(r).to_owned();
    for r in &args.references {
        let r = bare(r);
        if r.starts_with("oci:") {
            return Err(Usage(format!(
                "{r}: check reads registries only: expected [docker://]REFERENCE"
            ))
            .into());
        }
        refs.push(Reference::parse(&r).map_err(|e| Usage(e.to_string()))?);
    }
    let pool = ClientPool::new(args.registry.pool_options()?);
    let mut errors = Vec::new();
    for repo in &args.repository {
        let repo = &bare(repo);
        let r = Reference::parse(repo)
            .map_err(|e| Usage(format!("--repository {repo}: {e}")))?
            .without_tag();
        if r.digest().is_some() {
            return Err(Usage(format!(
                "--repository {repo}: expected REGISTRY/REPOSITORY, without tag or digest"
            ))
            .into());
        }
        let tags = match pool.get(r.registry(), crate::registry::Role::Source).await {
            Ok(c) => c.tags(&r).await,
            Err(e) => Err(e),
        };
        match tags {
            Ok(tags) if tags.is_empty() => errors.push(format!("{}: no tags", r.name())),
            Ok(tags) => refs.extend(tags.iter().filter_map(|t| r.with_tag(t).ok())),
            Err(e) => errors.push(format!("{}: {e}", r.name())),
        }
    }
    let mut seen: Vec<(String, Option<String>, crate::identity::Facts)> = Vec::new();
    for r in &refs {
        let inspected = match pool.get(r.registry(), crate::registry::Role::Source).await {
            Ok(c) => crate::identity::inspect(&c, r, &[]).await,
            Err(e) => Err(e),
        };
        match inspected {
            Ok(ins) => seen.extend(
                ins.images
                    .into_iter()
                    .map(|i| (r.to_string(), i.platform, i.facts)),
            ),
            Err(e) => errors.push(format!("{r}: {e}")),
        }
    }
    // Two passes: every image is recorded before any is judged, so each
    // collision is reported on every side of it.
    let record = crate::identity::Record::default();
    let label = |r: &str, p: &Option<String>| match p {
        Some(p) => format!("{r} ({p})"),
        None => r.to_owned(),
    };
    for (r, p, f) in &seen {
        record.observe(&label(r, p), f);
    }
    let images: Vec<CheckedImage> = seen
        .into_iter()
        .map(|(reference, platform, f)| {
            let finding = record.observe(&label(&reference, &platform), &f);
            CheckedImage {
                reference,
                platform,
                manifest: f.manifest,
                config: f.config.digest,
                layers: f.layers,
                content_bearing: f.content_bearing,
                non_unique: f.non_unique,
                collides_with: finding.map(|x| x.colliding).unwrap_or_default(),
            }
        })
        .collect();
    let flagged = images
        .iter()
        .filter(|i| i.non_unique.is_some() || !i.collides_with.is_empty())
        .count();
    let report = CheckReport {
        images,
        flagged,
        errors,
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        for i in &report.images {
            let platform = i
                .platform
                .as_deref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default();
            writeln!(out, "{}{platform}", i.reference)?;
            writeln!(out, "  manifest {}", i.manifest)?;
            writeln!(out, "  config   {} (image ID)", i.config)?;
            match (&i.non_unique, i.collides_with.is_empty()) {
                (None, true) => writeln!(out, "  ok: the image ID is unique to this content")?,
                (why, _) => {
                    if let Some(why) = why {
                        writeln!(out, "  NON-UNIQUE: {why}")?;
                    }
                    if !i.collides_with.is_empty() {
                        writeln!(
                            out,
                            "  COLLISION: same config, different layers as {}",
                            i.collides_with.join(", ")
                        )?;
                    }
                }
            }
        }
        if report.flagged > 0 {
            writeln!(
                out,
                "\n{} flagged. Nodes may run one of these artifacts in place of another. Republish with Spin 2.4 or later, or with a config unique to each artifact, or mirror through pinswap with identity.collisions: repair.",
                report.flagged
            )?;
        }
    }
    for e in &report.errors {
        eprintln!("error: {e}");
    }
    Ok(if report.flagged > 0 {
        ExitCode::from(3)
    } else if !report.errors.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
