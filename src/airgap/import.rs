//! `pinswap import`: an export's layout pushed into a registry under a
//! prefix of its own, digests unchanged.
//!
//! Images go first, then referrers by digest (indexed in the fallback tag
//! where the registry has no referrers API), then the referrers' tags. A
//! tag that names another manifest at the registry is left as it is and
//! reported, unless the import is told to replace tags: the import knows
//! what it brings, not who put the other manifest there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;
use tracing::{info, warn};

use super::{AirgapError, Entry, ExportManifest, Role};
use crate::reference::{Digest, MirrorTarget, Reference};
use crate::registry::copy::{Copier, CopyOptions, Endpoint};
use crate::registry::layout::Layout;
use crate::registry::referrers::{ReferrerCopier, ReferrerOptions};
use crate::registry::{ClientPool, Role as Side};

/// Entries pushed at once.
const ENTRIES_AT_ONCE: usize = 4;

/// How an import runs.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Blobs in flight at once.
    pub jobs: usize,
    /// Move a tag that names another manifest at the registry.
    pub replace_tags: bool,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// What [`import`] did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Imported {
    /// Entries pushed.
    pub pushed: u64,
    /// Entries the registry already had.
    pub present: u64,
    /// Tags left alone because they name another manifest there, each as
    /// `NAME: has DIGEST, the export DIGEST`.
    pub conflicts: Vec<String>,
    /// Entries that failed, each with why.
    pub failed: Vec<String>,
    /// Fallback tag indexes written for referrers.
    pub indexes_written: u64,
    /// What the export itself lists as missing at its target or failed:
    /// an import of it is not all its clusters run.
    pub incomplete: usize,
}

/// The most bytes of `pinswap-export.json` read.
pub const MAX_MANIFEST_BYTES: u64 = 1024 * 1024 * 1024;

/// Reads the export manifest of the layout at `dir`.
///
/// # Errors
/// [`AirgapError::NotAnExport`] when it is missing (an export that did not
/// finish) or not one.
pub fn read_manifest(dir: &Path) -> Result<ExportManifest, AirgapError> {
    let path = dir.join(super::MANIFEST_FILE);
    if let Ok(meta) = std::fs::metadata(&path)
        && meta.len() > MAX_MANIFEST_BYTES
    {
        return Err(AirgapError::NotAnExport {
            path,
            reason: format!("larger than {MAX_MANIFEST_BYTES} bytes, more than an export writes"),
        });
    }
    let bytes = std::fs::read(&path).map_err(|e| AirgapError::NotAnExport {
        path: dir.to_owned(),
        reason: format!(
            "no {} ({e}): not an export, or one that did not finish (run it again: it resumes)",
            super::MANIFEST_FILE
        ),
    })?;
    let m: ExportManifest =
        serde_json::from_slice(&bytes).map_err(|e| AirgapError::NotAnExport {
            path: path.clone(),
            reason: format!("not a pinswap export manifest: {e}"),
        })?;
    if m.kind != super::KIND || m.version != super::VERSION {
        return Err(AirgapError::NotAnExport {
            path,
            reason: format!(
                "kind {:?} version {}; this pinswap reads {:?} version {}",
                m.kind,
                m.version,
                super::KIND,
                super::VERSION
            ),
        });
    }
    Ok(m)
}

/// Pushes the export at `dir` into `to` (`host[:port][/prefix]`), each
/// entry under `<to>/<its name>`, with the clients of `pool`.
///
/// # Errors
/// The export cannot be read, or names an entry that is not an image
/// name. A failed or refused entry is not an error of the whole: it is
/// in [`Imported`].
pub async fn import(
    dir: &Path,
    to: &MirrorTarget,
    pool: Arc<ClientPool>,
    opts: &ImportOptions,
) -> Result<Imported, AirgapError> {
    let manifest = read_manifest(dir)?;
    let layout = Arc::new(Layout::open_indexed(dir)?);
    // Every name is checked before anything is pushed: a valid image name
    // under `to`, naming in `index.json` the digest the manifest says.
    let mut planned: Vec<(Entry, Reference)> = Vec::new();
    for e in &manifest.entries {
        let dst = destination(dir, to, e)?;
        let found = layout.resolve(Some(&e.name)).await?;
        if found.digest != e.digest {
            return Err(AirgapError::BadEntry {
                path: dir.to_owned(),
                name: crate::logsafe::clip(&e.name, 200),
                reason: format!(
                    "index.json names {}, {} says {}",
                    found.digest,
                    super::MANIFEST_FILE,
                    e.digest
                ),
            });
        }
        planned.push((e.clone(), dst));
    }
    let copier = Arc::new(
        Copier::new(
            pool,
            CopyOptions {
                jobs: opts.jobs.max(1),
                ..CopyOptions::default()
            },
        )
        .with_layout(layout),
    );
    let referrers = ReferrerCopier::new(copier.clone(), ReferrerOptions::default());
    let bar = opts.progress.then(|| {
        let bar = indicatif::ProgressBar::new(planned.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} importing [{bar:30}] {pos}/{len} manifests, {elapsed}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar
    });
    info!(entries = planned.len(), to = %to, "importing");
    let mut out = Imported {
        incomplete: manifest.missing.len() + manifest.failed.len(),
        ..Imported::default()
    };
    // Images, then referrers by digest, then referrer tags: a tag index
    // lists referrers, and a referrer's subject goes first.
    for role in [Role::Image, Role::Referrer, Role::ReferrerTag] {
        let step: Vec<Outcome> =
            futures::stream::iter(planned.iter().filter(|(e, _)| e.role == role))
                .map(|(e, dst)| {
                    let (copier, bar) = (&copier, &bar);
                    async move {
                        let o = push(dir, copier, e, dst, opts.replace_tags).await;
                        if let Some(b) = bar {
                            b.inc(1);
                        }
                        o
                    }
                })
                .buffer_unordered(ENTRIES_AT_ONCE)
                .collect()
                .await;
        // The referrers at their subjects, one merge per subject: merges
        // of one fallback tag at once would lose each other's entries on a
        // registry that takes no conditional PUT.
        let mut listed: BTreeMap<(String, String), Vec<Value>> = BTreeMap::new();
        for o in step {
            match o {
                Outcome::Pushed(l) => {
                    out.pushed += 1;
                    listed.extend_one_of(l);
                }
                Outcome::Present(l) => {
                    out.present += 1;
                    listed.extend_one_of(l);
                }
                Outcome::Conflict(c) => out.conflicts.push(c),
                Outcome::Failed(f) => out.failed.push(f),
            }
        }
        for ((repository, subject), descriptors) in listed {
            let Ok(subject) = Digest::parse(&subject) else {
                continue;
            };
            let dst = match Reference::new(to.registry(), &repository, None, None) {
                Ok(r) => r,
                Err(e) => {
                    out.failed.push(format!("{repository}@{subject}: {e}"));
                    continue;
                }
            };
            match referrers.index(&dst, &subject, &descriptors).await {
                Ok(written) => out.indexes_written += u64::from(written),
                Err(e) => out.failed.push(format!(
                    "{repository}@{subject}: {} referrers pushed, but not listed at their subject: {e}",
                    descriptors.len()
                )),
            }
        }
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    out.conflicts.sort();
    out.failed.sort();
    Ok(out)
}

/// Where `e` goes under `to`.
fn destination(dir: &Path, to: &MirrorTarget, e: &Entry) -> Result<Reference, AirgapError> {
    let bad = |reason: String| AirgapError::BadEntry {
        path: dir.to_owned(),
        name: crate::logsafe::clip(&e.name, 200),
        reason,
    };
    let (path, tag, digest) =
        super::split_name(&e.name).ok_or_else(|| bad("not PATH:TAG or PATH@DIGEST".into()))?;
    let digest_of_entry = Digest::parse(&e.digest).map_err(|err| bad(err.to_string()))?;
    if let Some(d) = digest
        && d != e.digest
    {
        return Err(bad(format!(
            "its name's digest is not the entry's, {}",
            e.digest
        )));
    }
    // pinswap's own records at a target are never an image to import.
    if path.split('/').next() == Some(crate::reference::USAGE_REPOSITORY) {
        return Err(bad(format!(
            "{} holds pinswap's usage records, not images",
            crate::reference::USAGE_REPOSITORY
        )));
    }
    let repository = match to.prefix() {
        Some(p) => format!("{p}/{path}"),
        None => path.to_owned(),
    };
    let r = Reference::new(to.registry(), &repository, tag, None)
        .map_err(|err| bad(err.to_string()))?;
    Ok(match tag {
        Some(_) => r,
        None => r.with_digest(digest_of_entry),
    })
}

/// A referrer to list at its subject: (repository, subject) and its
/// descriptor.
type Listing = Option<((String, String), Value)>;

enum Outcome {
    Pushed(Listing),
    Present(Listing),
    Conflict(String),
    Failed(String),
}

trait ExtendOneOf {
    fn extend_one_of(&mut self, l: Listing);
}

impl ExtendOneOf for BTreeMap<(String, String), Vec<Value>> {
    fn extend_one_of(&mut self, l: Listing) {
        if let Some((key, desc)) = l {
            self.entry(key).or_default().push(desc);
        }
    }
}

async fn push(
    dir: &Path,
    copier: &Copier,
    e: &Entry,
    dst: &Reference,
    replace_tags: bool,
) -> Outcome {
    let failed = |why: String| {
        warn!(entry = %e.name, error = %why, "not imported");
        Outcome::Failed(format!("{}: {why}", e.name))
    };
    // A tag there that names something else is not ours to move.
    if dst.tag().is_some() {
        let client = match copier.pool().get(dst.registry(), Side::Target).await {
            Ok(c) => c,
            Err(err) => return failed(err.to_string()),
        };
        match client.manifest_digest(dst).await {
            Ok(Some(d)) if d.as_str() == e.digest => return Outcome::Present(None),
            Ok(Some(d)) if !replace_tags => {
                return Outcome::Conflict(format!("{dst}: has {d}, the export {}", e.digest));
            }
            Ok(_) => {}
            // Unknown: nothing is moved.
            Err(err) => return failed(err.to_string()),
        }
    }
    let src = Endpoint::Layout {
        dir: PathBuf::from(dir),
        name: Some(e.name.clone()),
    };
    let report = match copier.copy(&src, &Endpoint::Registry(dst.clone())).await {
        Ok(r) => r,
        Err(err) => return failed(err.to_string()),
    };
    if report.digest != e.digest {
        return failed(format!(
            "pushed as {}, not the export's {}",
            report.digest, e.digest
        ));
    }
    let listing = match (e.role, e.subject.as_deref()) {
        (Role::Referrer, Some(subject)) => {
            let mut desc = serde_json::json!({
                "mediaType": e.media_type,
                "digest": e.digest,
                "size": e.size,
            });
            if let Some(t) = &e.artifact_type {
                desc["artifactType"] = Value::from(t.clone());
            }
            if let Some(a) = &e.annotations {
                desc["annotations"] = serde_json::to_value(a).unwrap_or_default();
            }
            Some(((dst.repository().to_owned(), subject.to_owned()), desc))
        }
        _ => None,
    };
    if report.up_to_date {
        Outcome::Present(listing)
    } else {
        Outcome::Pushed(listing)
    }
}
