//! `pinswap export`: what the usage records list, from the target into
//! an OCI image layout.
//!
//! Per repository the records name: the target's tags are listed and each
//! read by a HEAD, then every manifest the records name (and every tag
//! that names one of them) is copied into the layout with its children
//! and blobs, then its referrers. A blob already in the layout is not
//! fetched again, so running the export again after an interruption
//! resumes it; `index.json` and [`super::MANIFEST_FILE`] are written once,
//! at the end.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use serde_json::Value;
use tracing::{info, warn};

use super::{AirgapError, Entry, ExportManifest, ExportedCluster, IMAGE_NAME, Role};
use crate::mirror::Mirror;
use crate::reference::{Digest, MirrorTarget, Reference};
use crate::registry::auth::Credentials;
use crate::registry::copy::{Copier, CopyOptions, Endpoint};
use crate::registry::layout::{Layout, REF_NAME};
use crate::registry::manifest::{Descriptor, ManifestKind, OCI_INDEX, OCI_MANIFEST};
use crate::registry::{Registry, Role as Side};
use crate::retention::clusters::Records;

/// Repositories exported at once.
const REPOSITORIES_AT_ONCE: usize = 4;
/// Tag HEADs in flight per repository.
const HEADS_AT_ONCE: usize = 8;
/// Referrers exported per repository at most; more are left out and
/// named in the log.
const MAX_REFERRERS: usize = 10_000;
/// Pages of the referrers API read per subject.
const REFERRER_PAGES: usize = 16;

/// How an export runs.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The clusters whose records are read; empty: every record.
    pub clusters: Vec<String>,
    /// Blobs in flight at once.
    pub jobs: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// What [`export`] did.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The manifest it wrote.
    pub manifest: ExportManifest,
    /// The blob files its entries reach, relative to the layout: what a
    /// tar of it holds besides `oci-layout`, `index.json` and the
    /// manifest (a directory used before may hold more).
    pub files: Vec<PathBuf>,
}

impl Exported {
    /// Whether everything the records list was written.
    pub fn complete(&self) -> bool {
        self.manifest.missing.is_empty() && self.manifest.failed.is_empty()
    }
}

/// One repository's part of the records.
#[derive(Debug, Default)]
struct Wanted {
    digests: BTreeSet<Digest>,
    tags: BTreeSet<String>,
}

/// What one repository contributed.
#[derive(Debug, Default)]
struct Part {
    entries: Vec<Entry>,
    missing: Vec<String>,
    failed: Vec<String>,
    /// Every blob the entries reach (manifests included), with its size.
    blobs: BTreeSet<(Digest, u64)>,
}

struct Run {
    client: Arc<Registry>,
    copier: Arc<Copier>,
    layout: Arc<Layout>,
    creds: Option<Credentials>,
    target: MirrorTarget,
    bar: Option<indicatif::ProgressBar>,
    failed: AtomicU64,
}

/// Exports what the records of `opts.clusters` (all, when empty) at
/// `mirror`'s target list into the layout at `dir`.
///
/// # Errors
/// The records cannot be read, a named cluster has none, a record is
/// incomplete, or the layout cannot be written. An image that cannot be
/// copied is not an error of the whole: it is in [`Exported::failed`].
pub async fn export(
    mirror: &Mirror,
    dir: &Path,
    opts: &ExportOptions,
) -> Result<Exported, AirgapError> {
    let records = Records::of(mirror).await?;
    let names = records.names().await?;
    let chosen: Vec<String> = if opts.clusters.is_empty() {
        names.clone()
    } else {
        for c in &opts.clusters {
            if !names.contains(c) {
                return Err(AirgapError::NoRecord {
                    cluster: c.clone(),
                    names: names.join(", "),
                });
            }
        }
        opts.clusters.clone()
    };
    let target = mirror.target().clone();
    let mut wanted: BTreeMap<String, Wanted> = BTreeMap::new();
    let mut clusters = Vec::new();
    let mut left_out = Vec::new();
    for name in &chosen {
        let Some(record) = records.read(name).await? else {
            return Err(AirgapError::NoRecord {
                cluster: name.clone(),
                names: names.join(", "),
            });
        };
        if !record.complete {
            return Err(AirgapError::Incomplete {
                cluster: name.clone(),
                in_use: record.in_use,
            });
        }
        for key in record.images.keys() {
            let Some((repository, tag, digest)) = super::split_name(key) else {
                left_out.push(format!(
                    "cluster {name}'s record entry {key:?}: names no image"
                ));
                continue;
            };
            let w = wanted.entry(repository.to_owned()).or_default();
            match (tag, digest.map(Digest::parse)) {
                (_, Some(Ok(d))) => {
                    w.digests.insert(d);
                }
                (Some(t), None) => {
                    w.tags.insert(t.to_owned());
                }
                _ => left_out.push(format!(
                    "cluster {name}'s record entry {key:?}: a bad digest"
                )),
            }
        }
        clusters.push(ExportedCluster {
            cluster: name.clone(),
            updated: record.updated.to_string(),
            images: record.images.len(),
        });
    }

    let layout = Arc::new(Layout::create_blobs_only(dir)?);
    // A layout without its manifest is an export that did not finish:
    // the one an earlier run wrote goes before anything changes.
    let earlier = dir.join(super::MANIFEST_FILE);
    if let Err(e) = tokio::fs::remove_file(&earlier).await
        && e.kind() != std::io::ErrorKind::NotFound
    {
        return Err(super::io_error(&earlier, e));
    }
    let creds = mirror.pool().configured(target.registry(), Side::Target);
    let copier = Copier::new(
        mirror.pool().clone(),
        CopyOptions {
            jobs: opts.jobs.max(1),
            ..CopyOptions::default()
        },
    )
    .with_layout(layout.clone());
    let total: u64 = wanted
        .values()
        .map(|w| (w.digests.len() + w.tags.len()) as u64)
        .sum();
    let bar = opts.progress.then(|| {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} exporting [{bar:30}] {pos}/{len} images, {msg}, {elapsed}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar
    });
    let run = Arc::new(Run {
        client: mirror.target_client().await.map_err(|e| {
            AirgapError::Records(crate::retention::clusters::ClustersError::Target {
                repository: target.to_string(),
                source: Box::new(e),
            })
        })?,
        copier: Arc::new(copier),
        layout: layout.clone(),
        creds,
        target: target.clone(),
        bar,
        failed: AtomicU64::new(0),
    });
    info!(clusters = chosen.len(), repositories = wanted.len(), images = total, dir = %dir.display(), "exporting");

    let parts: Vec<Part> = futures::stream::iter(wanted)
        .map(|(repository, w)| {
            let run = run.clone();
            async move { run.repository(&repository, w).await }
        })
        .buffer_unordered(REPOSITORIES_AT_ONCE)
        .collect()
        .await;
    if let Some(bar) = &run.bar {
        bar.finish_and_clear();
    }

    let mut entries = Vec::new();
    let (mut missing, mut failed) = (Vec::new(), left_out);
    let mut reached: BTreeSet<(Digest, u64)> = BTreeSet::new();
    for p in parts {
        entries.extend(p.entries);
        missing.extend(p.missing);
        failed.extend(p.failed);
        reached.extend(p.blobs);
    }
    entries.sort_by(|a, b| (a.role, &a.name).cmp(&(b.role, &b.name)));
    missing.sort();
    failed.sort();
    let index: Vec<Value> = entries.iter().map(index_entry).collect();
    layout.write_index(index).await?;
    let blobs = reached.len() as u64;
    let bytes = reached.iter().map(|(_, n)| n).sum();
    let files = reached
        .iter()
        .map(|(d, _)| {
            PathBuf::from("blobs")
                .join(d.algorithm().as_str())
                .join(d.hex())
        })
        .collect();
    let manifest = ExportManifest {
        kind: super::KIND.to_owned(),
        version: super::VERSION,
        created: k8s_openapi::jiff::Timestamp::now().to_string(),
        target: target.to_string(),
        clusters,
        entries,
        missing,
        failed,
        blobs,
        bytes,
    };
    write_manifest(dir, &manifest).await?;
    Ok(Exported { manifest, files })
}

/// The `index.json` entry of `e`: its name as containerd's image name,
/// and as `ref.name` where that grammar takes it.
fn index_entry(e: &Entry) -> Value {
    let mut annotations = serde_json::Map::new();
    annotations.insert(IMAGE_NAME.into(), e.name.clone().into());
    if crate::registry::copy::is_layout_ref(&e.name) {
        annotations.insert(REF_NAME.into(), e.name.clone().into());
    }
    serde_json::json!({
        "mediaType": e.media_type,
        "digest": e.digest,
        "size": e.size,
        "annotations": annotations,
    })
}

async fn write_manifest(dir: &Path, m: &ExportManifest) -> Result<(), AirgapError> {
    let path = dir.join(super::MANIFEST_FILE);
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        super::MANIFEST_FILE,
        std::process::id()
    ));
    let bytes = serde_json::to_vec_pretty(m).map_err(|e| super::io_error(&path, e))?;
    tokio::fs::write(&tmp, bytes)
        .await
        .map_err(|e| super::io_error(&tmp, e))?;
    tokio::fs::rename(&tmp, &path)
        .await
        .map_err(|e| super::io_error(&path, e))
}

/// What the layout holds of one manifest.
#[derive(Debug, Clone)]
struct Held {
    media_type: String,
    size: u64,
    /// An index's children.
    children: Vec<Digest>,
    subject: Option<String>,
    artifact_type: Option<String>,
    /// The blobs it reaches, itself and its children included.
    blobs: Vec<(Digest, u64)>,
}

impl Run {
    fn tick(&self, failed: usize) {
        let failed = self.failed.fetch_add(failed as u64, Ordering::Relaxed) + failed as u64;
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(format!("{failed} failed"));
        }
    }

    /// `repository` (with the prefix) as a reference at the target.
    fn reference(&self, repository: &str) -> Result<Reference, AirgapError> {
        Ok(
            Reference::new(self.target.registry(), repository, None, None).map_err(|e| {
                crate::registry::RegistryError::Other {
                    registry: self.target.registry().to_owned(),
                    reference: repository.to_owned(),
                    operation: "name a repository",
                    message: e.to_string(),
                }
            })?,
        )
    }

    /// `repository` without the target's prefix: the name an import
    /// puts under its own.
    fn relative<'a>(&self, repository: &'a str) -> &'a str {
        match self.target.prefix() {
            Some(p) => repository
                .strip_prefix(p)
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(repository),
            None => repository,
        }
    }

    async fn repository(&self, repository: &str, wanted: Wanted) -> Part {
        let mut part = Part::default();
        let n = (wanted.digests.len() + wanted.tags.len()) as u64;
        let result = self.export_repository(repository, wanted, &mut part).await;
        if let Err(e) = result {
            warn!(repository, error = %e, "repository not exported");
            part.failed.push(format!("{repository}: {e}"));
        }
        let failed = part.failed.len() + part.missing.len();
        for i in 0..n {
            self.tick(if i == 0 { failed } else { 0 });
        }
        part
    }

    async fn export_repository(
        &self,
        repository: &str,
        wanted: Wanted,
        part: &mut Part,
    ) -> Result<(), AirgapError> {
        let repo = self.reference(repository)?;
        let rel = self.relative(repository).to_owned();
        // Every tag, with the digest it names now.
        let tags = self.client.tags(&repo).await?;
        let heads: Vec<(String, Result<Option<Digest>, _>)> = futures::stream::iter(tags)
            .map(|tag| {
                let repo = repo.clone();
                async move {
                    let r = match repo.with_tag(&tag) {
                        Ok(r) => r,
                        Err(_) => return (tag, Ok(None)),
                    };
                    let d = self.client.manifest_digest(&r).await;
                    (tag, d)
                }
            })
            .buffer_unordered(HEADS_AT_ONCE)
            .collect()
            .await;
        let mut tagged: BTreeMap<String, Digest> = BTreeMap::new();
        for (tag, d) in heads {
            match d {
                Ok(Some(d)) => {
                    tagged.insert(tag, d);
                }
                Ok(None) => {}
                Err(e) => return Err(e.into()),
            }
        }

        // The images: the records' digests, and what their tags name.
        let mut images: BTreeSet<Digest> = wanted.digests.clone();
        for t in &wanted.tags {
            match tagged.get(t) {
                Some(d) => {
                    images.insert(d.clone());
                }
                None => part.missing.push(format!("{repository}:{t}")),
            }
        }
        let mut held: HashMap<Digest, Held> = HashMap::new();
        for d in &images {
            match self.copy(&repo, d).await {
                Ok(Some(h)) => {
                    held.insert(d.clone(), h);
                }
                Ok(None) => part.missing.push(format!("{repository}@{d}")),
                Err(e) => part.failed.push(format!("{repository}@{d}: {e}")),
            }
        }
        // Subjects: each image and its children, then each referrer.
        let mut subjects: BTreeSet<Digest> = BTreeSet::new();
        for (d, h) in &held {
            subjects.insert(d.clone());
            subjects.extend(h.children.iter().cloned());
        }
        // cosign's tags, copied as tags; the referrers a fallback tag index
        // or the referrers API lists, copied by digest with the
        // descriptor that listed them (an import indexes them again).
        let mut cosign_tags: BTreeMap<String, Digest> = BTreeMap::new();
        let mut referrers: BTreeMap<Digest, (Held, Digest, Value)> = BTreeMap::new();
        let mut asked: BTreeSet<Digest> = BTreeSet::new();
        let mut api: Option<bool> = None;
        let mut full = false;
        while !full {
            let pending: Vec<Digest> = subjects.difference(&asked).cloned().collect();
            if pending.is_empty() {
                break;
            }
            for subject in pending {
                asked.insert(subject.clone());
                let mut listed: Vec<Value> = Vec::new();
                for (tag, d) in &tagged {
                    if super::referrer_tag_subject(tag).as_ref() != Some(&subject) {
                        continue;
                    }
                    if !tag.contains('.') {
                        // The fallback tag index: its list, not itself.
                        listed.extend(self.fallback_list(&repo, tag, part).await);
                        continue;
                    }
                    if !room(repository, referrers.len() + cosign_tags.len(), part) {
                        full = true;
                        break;
                    }
                    let what = format!("{repository}:{tag}");
                    if let Some(h) = self.copy_or_note(&repo, d, what, part).await {
                        subjects.insert(d.clone());
                        subjects.extend(h.children.iter().cloned());
                        held.insert(d.clone(), h);
                        cosign_tags.insert(tag.clone(), d.clone());
                    }
                }
                if api != Some(false) {
                    let found = self
                        .client
                        .referrers(&repo, &subject, REFERRER_PAGES, MAX_REFERRERS)
                        .await?;
                    api = Some(found.is_some());
                    listed.extend(found.unwrap_or_default());
                }
                for desc in listed {
                    let media_type = desc.get("mediaType").and_then(Value::as_str);
                    let digest = desc
                        .get("digest")
                        .and_then(Value::as_str)
                        .and_then(|d| Digest::parse(d).ok());
                    let Some(digest) = digest else {
                        part.failed.push(format!(
                            "{repository}@{subject}: a referrer descriptor without a valid digest"
                        ));
                        continue;
                    };
                    if !matches!(media_type, Some(OCI_MANIFEST) | Some(OCI_INDEX))
                        || referrers.contains_key(&digest)
                        || held.contains_key(&digest)
                    {
                        continue;
                    }
                    if full || !room(repository, referrers.len() + cosign_tags.len(), part) {
                        full = true;
                        break;
                    }
                    let what = format!("{repository}@{digest}");
                    if let Some(h) = self.copy_or_note(&repo, &digest, what, part).await {
                        subjects.insert(digest.clone());
                        subjects.extend(h.children.iter().cloned());
                        referrers.insert(digest, (h, subject.clone(), desc));
                    }
                }
                if full {
                    break;
                }
            }
        }

        // The entries: every tag naming an image, each image by digest,
        // each cosign tag, each referrer by digest.
        for (tag, d) in &tagged {
            if !images.contains(d) {
                continue;
            }
            let Some(h) = held.get(d) else { continue };
            part.entries
                .push(entry(format!("{rel}:{tag}"), d, h, Role::Image, None));
            part.blobs.extend(h.blobs.iter().cloned());
        }
        for d in &images {
            if let Some(h) = held.get(d) {
                part.entries
                    .push(entry(format!("{rel}@{d}"), d, h, Role::Image, None));
                part.blobs.extend(h.blobs.iter().cloned());
            }
        }
        for (tag, d) in &cosign_tags {
            let h = &held[d];
            let subject = super::referrer_tag_subject(tag).map(|s| s.to_string());
            part.entries.push(entry(
                format!("{rel}:{tag}"),
                d,
                h,
                Role::ReferrerTag,
                subject,
            ));
            part.blobs.extend(h.blobs.iter().cloned());
        }
        for (d, (h, subject, desc)) in &referrers {
            let mut e = entry(
                format!("{rel}@{d}"),
                d,
                h,
                Role::Referrer,
                Some(subject.to_string()),
            );
            // As the list gave them: an import lists them so again.
            if let Some(t) = desc.get("artifactType").and_then(Value::as_str) {
                e.artifact_type = Some(t.to_owned());
            }
            e.annotations = desc
                .get("annotations")
                .and_then(|a| serde_json::from_value(a.clone()).ok());
            part.entries.push(e);
            part.blobs.extend(h.blobs.iter().cloned());
        }
        Ok(())
    }

    /// The descriptors the fallback tag index `repo:tag` lists; a tag that
    /// is not such an index is noted as failed.
    async fn fallback_list(&self, repo: &Reference, tag: &str, part: &mut Part) -> Vec<Value> {
        let what = format!("{}:{tag}", repo.repository());
        let r = match repo.with_tag(tag) {
            Ok(r) => r,
            Err(e) => {
                part.failed.push(format!("{what}: {e}"));
                return Vec::new();
            }
        };
        match self.client.get_manifest_raw(&r).await {
            Ok(Some(m)) => {
                let v: Value = serde_json::from_slice(&m.bytes).unwrap_or_default();
                match v.get("manifests").and_then(Value::as_array) {
                    Some(list) if v.get("subject").is_none() => list.clone(),
                    _ => {
                        part.failed.push(format!(
                            "{what}: not a referrers index (an image index with a manifests list and no subject)"
                        ));
                        Vec::new()
                    }
                }
            }
            Ok(None) => Vec::new(),
            Err(e) => {
                part.failed.push(format!("{what}: {e}"));
                Vec::new()
            }
        }
    }

    /// As [`Run::copy`], a failure noted in `part` under `what`.
    async fn copy_or_note(
        &self,
        repo: &Reference,
        digest: &Digest,
        what: String,
        part: &mut Part,
    ) -> Option<Held> {
        match self.copy(repo, digest).await {
            Ok(Some(h)) => Some(h),
            Ok(None) => {
                part.missing.push(what);
                None
            }
            Err(e) => {
                part.failed.push(format!("{what}: {e}"));
                None
            }
        }
    }

    /// Copies `repo@digest` into the layout; what it holds of the
    /// manifest, or `None` when the target has no such manifest.
    async fn copy(&self, repo: &Reference, digest: &Digest) -> Result<Option<Held>, AirgapError> {
        let src = Endpoint::Registry(repo.with_digest(digest.clone()));
        let dst = Endpoint::Layout {
            dir: self.layout.dir().to_owned(),
            name: None,
        };
        match self.copier.copy_with(&src, &dst, self.creds.as_ref()).await {
            Ok(_) => {}
            Err(crate::registry::copy::CopyError::Registry(
                crate::registry::RegistryError::Http { status: 404, .. },
            )) => return Ok(None),
            Err(e) => {
                return Err(AirgapError::Registry(
                    crate::registry::RegistryError::Other {
                        registry: repo.registry().to_owned(),
                        reference: format!("{}@{digest}", repo.name()),
                        operation: "export",
                        message: e.to_string(),
                    },
                ));
            }
        }
        let desc = Descriptor {
            media_type: String::new(),
            digest: digest.to_string(),
            size: 0,
            platform: None,
            urls: None,
        };
        let m = self.layout.read_manifest(&desc).await?;
        let children = match &m.kind {
            ManifestKind::Index { manifests } => manifests
                .iter()
                .filter_map(|c| Digest::parse(&c.digest).ok())
                .collect(),
            ManifestKind::Image { .. } => Vec::new(),
        };
        let mut blobs = vec![(digest.clone(), m.bytes.len() as u64)];
        self.reach(&m, &mut blobs, 0).await?;
        let v: Value = serde_json::from_slice(&m.bytes).unwrap_or_default();
        let artifact_type = v
            .get("artifactType")
            .or_else(|| v.pointer("/config/mediaType"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        Ok(Some(Held {
            media_type: m.media_type.clone(),
            size: m.bytes.len() as u64,
            children,
            subject: v
                .pointer("/subject/digest")
                .and_then(Value::as_str)
                .map(str::to_owned),
            artifact_type,
            blobs,
        }))
    }

    /// Adds the blobs `m` names to `out`: an image's config and layers, an
    /// index's children and theirs, read back from the layout.
    fn reach<'a>(
        &'a self,
        m: &'a crate::registry::manifest::RawManifest,
        out: &'a mut Vec<(Digest, u64)>,
        depth: usize,
    ) -> futures::future::BoxFuture<'a, Result<(), AirgapError>> {
        Box::pin(async move {
            match &m.kind {
                ManifestKind::Image { .. } => {
                    for b in m.blobs() {
                        if let Ok(d) = Digest::parse(&b.digest) {
                            out.push((d, b.size));
                        }
                    }
                }
                // The copy engine refuses deeper nesting before this.
                ManifestKind::Index { .. } if depth > 8 => {}
                ManifestKind::Index { manifests } => {
                    for c in manifests {
                        let child = self.layout.read_manifest(c).await?;
                        out.push((child.digest.clone(), child.bytes.len() as u64));
                        self.reach(&child, out, depth + 1).await?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// Whether one more referrer fits, `n` taken; notes it in `part` when not.
fn room(repository: &str, n: usize, part: &mut Part) -> bool {
    if n < MAX_REFERRERS {
        return true;
    }
    part.failed.push(format!(
        "{repository}: more referrers than an export takes ({MAX_REFERRERS}); the rest left out"
    ));
    false
}

fn entry(name: String, d: &Digest, h: &Held, role: Role, subject: Option<String>) -> Entry {
    Entry {
        name,
        digest: d.to_string(),
        media_type: h.media_type.clone(),
        size: h.size,
        subject: subject.or_else(|| (role != Role::Image).then(|| h.subject.clone()).flatten()),
        artifact_type: (role != Role::Image)
            .then(|| h.artifact_type.clone())
            .flatten(),
        annotations: None,
        role,
    }
}
