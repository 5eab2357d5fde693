//! Referrers travel with the image: signatures, attestations, SBOMs and any
//! other artifact that refers to a manifest (docs/referrers.md).
//!
//! For each subject (the image's top manifest, each child of an index, and,
//! recursively, each referrer copied) two schemes are read at the source:
//! cosign's tags (`sha256-<hex>.sig`, `.att`, `.sbom`), copied under the same
//! tags; and OCI 1.1 referrers (distribution-spec §Listing Referrers), from
//! the API or, where it answers 404, the fallback tag `sha256-<hex>`. Each
//! referrer manifest is copied byte-exact by digest with its blobs, so a
//! signature over a digest stays valid at the target. A target that serves
//! the referrers API indexes a pushed referrer by its `subject` itself;
//! elsewhere pinswap merges the referrer's descriptor into the target's
//! fallback tag index, keeping every descriptor already there.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;
use tracing::{debug, warn};

use super::auth::Credentials;
pub use super::copy::ReferrersReport;
use super::copy::{Copier, CopyError, Endpoint};
use super::manifest::{OCI_INDEX, OCI_MANIFEST};
use super::requests::Precondition;
use super::{Registry, RegistryError, Role};
use crate::reference::{Digest, Reference};

/// cosign's tag suffixes, with the artifactType an allowlist names them by
/// (the types cosign gives the same artifacts as OCI 1.1 referrers).
pub const COSIGN_TAGS: [(&str, &str); 3] = [
    ("sig", "application/vnd.dev.cosign.artifact.sig.v1+json"),
    ("att", "application/vnd.dev.cosign.artifact.att.v1+json"),
    ("sbom", "application/vnd.dev.cosign.artifact.sbom.v1+json"),
];

/// Pages of a referrers list read per subject.
const MAX_PAGES: usize = 16;

/// Tags asked for in the one listing a follow reads (more, and the tags
/// are asked for one by one).
const TAGS_PAGE: usize = 1000;

/// Merges of one fallback tag retried after a 412 (another writer won).
const MERGE_ATTEMPTS: usize = 4;

/// Errors kept in a report; later ones are only counted.
const MAX_ERRORS: usize = 8;

/// What travels and how far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferrerOptions {
    /// Only referrers of these artifactTypes (cosign's tags by
    /// [`COSIGN_TAGS`]); empty: all.
    pub artifact_types: Vec<String>,
    /// Levels of referrers of referrers followed (1: only the image's own).
    pub max_depth: usize,
    /// Referrers copied per image at most.
    pub max_count: usize,
    /// Subjects whose referrers are looked up per image at most: each costs
    /// a referrers list at the source (and a HEAD per cosign tag where the
    /// tags cannot be listed in one page), and an index names as many
    /// children as its author likes.
    pub max_lookups: usize,
}

impl Default for ReferrerOptions {
    fn default() -> Self {
        Self {
            artifact_types: Vec::new(),
            max_depth: 4,
            max_count: 128,
            max_lookups: 256,
        }
    }
}

impl ReferrerOptions {
    fn allows(&self, artifact_type: Option<&str>) -> bool {
        self.artifact_types.is_empty()
            || artifact_type.is_some_and(|t| self.artifact_types.iter().any(|a| a == t))
    }
}

impl ReferrersReport {
    fn fail(&mut self, what: &str, e: impl std::fmt::Display) {
        self.failed += 1;
        warn!(referrer = %what, error = %e, "referrer not copied");
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(format!("{what}: {e}"));
        }
    }
}

/// Why a fallback tag could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ReferrersError {
    /// The fallback tag holds something other than a referrers index.
    #[error("fallback tag {reference}: {reason}")]
    FallbackTag {
        /// `registry/repository:sha256-<hex>`.
        reference: String,
        /// Why it is not used.
        reason: String,
    },
    /// A registry request failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Copying a referrer failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
}

/// Copies referrers with one [`Copier`]; remembers which target registries
/// serve the referrers API.
pub struct ReferrerCopier {
    copier: Arc<Copier>,
    opts: ReferrerOptions,
    /// Target `host[:port]` → whether it serves the referrers API.
    api: std::sync::Mutex<HashMap<String, bool>>,
}

/// The tag a digest's referrers go under: `<algorithm>-<hex>`, with a
/// suffix for cosign's tags.
pub fn fallback_tag(digest: &Digest, suffix: Option<&str>) -> String {
    let base = format!("{}-{}", digest.algorithm().as_str(), digest.hex());
    match suffix {
        Some(s) => format!("{base}.{s}"),
        None => base,
    }
}

impl ReferrerCopier {
    /// Follows referrers with `copier` as `opts` says.
    pub fn new(copier: Arc<Copier>, opts: ReferrerOptions) -> Self {
        Self {
            copier,
            opts,
            api: std::sync::Mutex::default(),
        }
    }

    /// The subjects of a copy of `src` (pinned to the source digest) at
    /// `dst`, whose top manifest is `dst_digest`: the top itself when it is
    /// the source's (a platform-filtered index is not, and signatures over
    /// the original do not apply to it), and every child of the copied
    /// index. `dst_media_type`, when the copy knows it, spares reading a
    /// top that is a single manifest.
    ///
    /// # Errors
    /// Reading the target's manifest.
    pub async fn subjects(
        &self,
        dst: &Reference,
        source_digest: &Digest,
        dst_digest: &Digest,
        dst_media_type: Option<&str>,
    ) -> Result<Vec<Digest>, RegistryError> {
        // Only a type known to be a single manifest: a registry that
        // answers with something vaguer may be describing an index.
        let single = [OCI_MANIFEST, super::manifest::DOCKER_MANIFEST];
        if let Some(t) = dst_media_type.filter(|t| single.contains(t)) {
            debug!(target = %dst, media_type = t, "top is not an index: its only subject is itself");
            return Ok(if source_digest == dst_digest {
                vec![dst_digest.clone()]
            } else {
                Vec::new()
            });
        }
        let client = self.copier.pool().get(dst.registry(), Role::Target).await?;
        let top = client
            .get_manifest(&dst.without_tag().with_digest(dst_digest.clone()))
            .await?;
        let mut out = Vec::new();
        if source_digest == dst_digest {
            out.push(dst_digest.clone());
        }
        if let super::manifest::ManifestKind::Index { manifests } = &top.kind {
            out.extend(
                manifests
                    .iter()
                    .filter_map(|m| Digest::parse(&m.digest).ok()),
            );
        }
        Ok(out)
    }

    /// Copies the referrers of a finished copy: `src` pinned to
    /// `source_digest`, whose top is `dst_digest` in `dst`'s repository
    /// ([`ReferrerCopier::subjects`], then [`ReferrerCopier::copy`]);
    /// `dst_media_type` is the top's, when the copy knows it. `cold`: the
    /// copy wrote the image, as in [`ReferrerCopier::copy`].
    pub async fn follow(
        &self,
        src: &Reference,
        source_digest: &Digest,
        dst: &Reference,
        (dst_digest, dst_media_type): (&Digest, Option<&str>),
        creds: Option<&Credentials>,
        cold: bool,
    ) -> ReferrersReport {
        match self
            .subjects(dst, source_digest, dst_digest, dst_media_type)
            .await
        {
            Ok(subjects) => {
                let src = src.without_tag().with_digest(source_digest.clone());
                self.copy(&src, dst, &subjects, creds, cold).await
            }
            Err(e) => {
                let mut report = ReferrersReport::default();
                report.fail(&dst.name(), e);
                report
            }
        }
    }

    /// Copies the referrers of each of `subjects` from `src`'s repository to
    /// `dst`'s, reading the source with `creds` when given. Never fails as
    /// a whole: each referrer's failure is counted and named in the report.
    ///
    /// Cosign and fallback tags are asked for only when the source's tag
    /// list names them (when one page lists them all), except those of
    /// `src`'s own digest in a `cold` follow (the image was just copied).
    /// A pull-through cache (Harbor's proxy-cache projects) lists only the
    /// tags it has cached, so its listing leaves out signatures nobody
    /// pulled through it yet: trusted at the first copy, it would mirror
    /// the image without the signature of what the Pod named.
    pub async fn copy(
        &self,
        src: &Reference,
        dst: &Reference,
        subjects: &[Digest],
        creds: Option<&Credentials>,
        cold: bool,
    ) -> ReferrersReport {
        let mut report = ReferrersReport::default();
        let pool = self.copier.pool();
        let clients = async {
            let s = pool.get_with(src.registry(), Role::Source, creds).await?;
            let d = pool.get(dst.registry(), Role::Target).await?;
            Ok::<_, RegistryError>((s, d))
        };
        let (sc, dc) = match clients.await {
            Ok(c) => c,
            Err(e) => {
                report.fail(&src.name(), e);
                return report;
            }
        };
        let asked = src.digest().filter(|_| cold).cloned();
        let (src, dst) = (
            src.without_tag().without_digest(),
            dst.without_tag().without_digest(),
        );
        let tags = self.source_tags(&sc, &src).await;
        // Each subject once, however often an index lists it.
        let mut seen: HashSet<Digest> = HashSet::new();
        let mut queue: VecDeque<(Digest, usize)> = subjects
            .iter()
            .filter(|d| seen.insert((*d).clone()))
            .map(|d| (d.clone(), 1))
            .collect();
        let (mut count, mut looked_up) = (0usize, 0usize);
        while let Some((subject, depth)) = queue.pop_front() {
            if looked_up == self.opts.max_lookups {
                report.truncated = true;
                break;
            }
            looked_up += 1;
            let found = self
                .follow_subject(
                    (&sc, &dc),
                    &src,
                    &dst,
                    &subject,
                    (
                        creds,
                        tags.as_ref().filter(|_| asked.as_ref() != Some(&subject)),
                    ),
                    &mut count,
                    &mut report,
                )
                .await;
            for d in found {
                if !seen.insert(d.clone()) {
                    continue;
                }
                match depth < self.opts.max_depth {
                    true => queue.push_back((d, depth + 1)),
                    false => report.truncated = true,
                }
            }
        }
        debug!(source = %src, target = %dst, ?report, "referrers followed");
        report
    }

    /// The referrers of one subject: copies them and returns their digests
    /// (the next level's subjects). `tags` is the source's whole tag list
    /// when one request gave it ([`ReferrerCopier::source_tags`]): a tag
    /// not in it is not asked for.
    #[allow(clippy::too_many_arguments)]
    async fn follow_subject(
        &self,
        (sc, dc): (&Registry, &Registry),
        src: &Reference,
        dst: &Reference,
        subject: &Digest,
        (creds, tags): (Option<&Credentials>, Option<&HashSet<String>>),
        count: &mut usize,
        report: &mut ReferrersReport,
    ) -> Vec<Digest> {
        let mut found = Vec::new();
        for (suffix, artifact_type) in COSIGN_TAGS {
            if !self.opts.allows(Some(artifact_type)) {
                continue;
            }
            let tag = fallback_tag(subject, Some(suffix));
            if tags.is_some_and(|t| !t.contains(&tag)) {
                continue;
            }
            let what = format!("{}:{tag}", src.name());
            let (from, to) = match (src.with_tag(&tag), dst.with_tag(&tag)) {
                (Ok(f), Ok(t)) => (f, t),
                (Err(e), _) | (_, Err(e)) => {
                    report.fail(&what, e);
                    continue;
                }
            };
            let digest = match sc.manifest_digest(&from).await {
                Ok(Some(d)) => d,
                Ok(None) => continue,
                Err(e) => {
                    report.fail(&what, e);
                    continue;
                }
            };
            if !self.take(count, report) {
                return found;
            }
            if self
                .copy_one(from.with_digest(digest.clone()), to, creds, &what, report)
                .await
            {
                found.push(digest);
            }
        }

        let listed = match self.listed(sc, src, subject, tags).await {
            Ok(l) => l,
            Err(e) => {
                report.fail(&format!("{}@{subject}", src.name()), e);
                return found;
            }
        };
        let mut for_index: Vec<Value> = Vec::new();
        for desc in listed {
            let media_type = desc.get("mediaType").and_then(Value::as_str);
            let artifact_type = desc.get("artifactType").and_then(Value::as_str);
            let digest = desc
                .get("digest")
                .and_then(Value::as_str)
                .and_then(|d| Digest::parse(d).ok());
            let Some(digest) = digest else {
                report.fail(
                    &format!("{}@{subject}", src.name()),
                    "a referrer descriptor without a valid digest",
                );
                continue;
            };
            // Only manifest types the copy engine copies byte-exact.
            if !self.opts.allows(artifact_type)
                || !matches!(media_type, Some(OCI_MANIFEST) | Some(OCI_INDEX))
            {
                report.skipped += 1;
                continue;
            }
            if !self.take(count, report) {
                break;
            }
            let what = format!("{}@{digest}", src.name());
            let (from, to) = (
                src.with_digest(digest.clone()),
                dst.with_digest(digest.clone()),
            );
            if self.copy_one(from, to, creds, &what, report).await {
                for_index.push(desc);
                found.push(digest);
            }
        }
        if !for_index.is_empty() {
            match self.serves_api(dc, dst, subject).await {
                Ok(true) => {}
                Ok(false) => match self.merge_fallback(dc, dst, subject, &for_index).await {
                    Ok(true) => report.indexes_written += 1,
                    Ok(false) => {}
                    Err(e) => report.fail(
                        &format!("{}:{}", dst.name(), fallback_tag(subject, None)),
                        e,
                    ),
                },
                Err(e) => report.fail(&format!("{}@{subject}", dst.name()), e),
            }
        }
        found
    }

    /// Makes the referrers `descriptors` of `subject`, already pushed to
    /// `dst`'s repository, findable there: nothing where the target serves
    /// the referrers API, else a merge into the fallback tag index.
    /// Whether the index was written.
    ///
    /// # Errors
    /// Reading or writing the target.
    pub async fn index(
        &self,
        dst: &Reference,
        subject: &Digest,
        descriptors: &[Value],
    ) -> Result<bool, ReferrersError> {
        let dc = self.copier.pool().get(dst.registry(), Role::Target).await?;
        let dst = dst.without_tag().without_digest();
        if self.serves_api(&dc, &dst, subject).await? {
            return Ok(false);
        }
        self.merge_fallback(&dc, &dst, subject, descriptors).await
    }

    /// Copies one referrer manifest (with its blobs) and counts the
    /// outcome; whether it is at the target now.
    async fn copy_one(
        &self,
        from: Reference,
        to: Reference,
        creds: Option<&Credentials>,
        what: &str,
        report: &mut ReferrersReport,
    ) -> bool {
        let copied = self
            .copier
            .copy_with(&Endpoint::Registry(from), &Endpoint::Registry(to), creds)
            .await;
        match copied {
            Ok(r) if r.up_to_date => report.present += 1,
            Ok(_) => report.copied += 1,
            Err(e) => {
                report.fail(what, e);
                return false;
            }
        }
        true
    }

    /// Every tag of the source repository `src` when one request lists them
    /// all, so that a follow asks only for the cosign and fallback tags
    /// that exist: one request in place of one per tag and subject. `None`
    /// (ask tag by tag) when the list takes more than a page or cannot be
    /// read.
    async fn source_tags(&self, sc: &Registry, src: &Reference) -> Option<HashSet<String>> {
        match sc.tags_page(src, TAGS_PAGE).await {
            Ok(Some((tags, true))) => Some(tags.into_iter().collect()),
            // The repository holds the subject: a 404 is a registry that
            // does not list, not an empty list.
            Ok(None) | Ok(Some((_, false))) => None,
            Err(e) => {
                debug!(source = %src, error = %e, "tags not listed; referrer tags asked one by one");
                None
            }
        }
    }

    /// Counts one more referrer, or marks the report truncated at the bound.
    fn take(&self, count: &mut usize, report: &mut ReferrersReport) -> bool {
        if *count >= self.opts.max_count {
            report.truncated = true;
            return false;
        }
        *count += 1;
        true
    }

    /// The OCI 1.1 referrers of `subject` at the source: the API's list, or
    /// where it answers 404, the fallback tag's index (unless `tags`, the
    /// whole tag list, lacks it).
    async fn listed(
        &self,
        sc: &Registry,
        src: &Reference,
        subject: &Digest,
        tags: Option<&HashSet<String>>,
    ) -> Result<Vec<Value>, ReferrersError> {
        let max = self.opts.max_count;
        if let Some(list) = sc.referrers(src, subject, MAX_PAGES, max).await? {
            return Ok(list);
        }
        let tag = fallback_tag(subject, None);
        if tags.is_some_and(|t| !t.contains(&tag)) {
            return Ok(Vec::new());
        }
        let r = src.with_tag(&tag).map_err(|e| RegistryError::Other {
            registry: sc.host().to_owned(),
            reference: src.to_string(),
            operation: "read fallback tag",
            message: e.to_string(),
        })?;
        let Some(found) = sc.get_manifest_raw(&r).await? else {
            return Ok(Vec::new());
        };
        // Some registries (GitLab) answer this tag with the subject itself.
        if found.digest == *subject {
            return Ok(Vec::new());
        }
        let index = referrers_index(&r, &found.bytes)?;
        Ok(index["manifests"].as_array().cloned().unwrap_or_default())
    }

    /// Whether the target serves the referrers API, asked once per target
    /// registry with a GET for `subject` (which the target now holds). Not
    /// read from `OCI-Subject` on the push: ECR sends that header without
    /// serving the API.
    async fn serves_api(
        &self,
        dc: &Registry,
        dst: &Reference,
        subject: &Digest,
    ) -> Result<bool, RegistryError> {
        let host = dc.host().to_owned();
        if let Some(known) = self.api.lock().expect("api lock").get(&host) {
            return Ok(*known);
        }
        let serves = dc.referrers(dst, subject, 1, 1).await?.is_some();
        self.api.lock().expect("api lock").insert(host, serves);
        Ok(serves)
    }

    /// Adds `descriptors` to the target's fallback tag index of `subject`,
    /// keeping every descriptor already there (another client's too), with
    /// a conditional PUT where the target sends ETags. `Ok(false)` when
    /// every descriptor was already listed.
    async fn merge_fallback(
        &self,
        dc: &Registry,
        dst: &Reference,
        subject: &Digest,
        descriptors: &[Value],
    ) -> Result<bool, ReferrersError> {
        let tag = fallback_tag(subject, None);
        let r = dst.with_tag(&tag).map_err(|e| RegistryError::Other {
            registry: dc.host().to_owned(),
            reference: dst.to_string(),
            operation: "write fallback tag",
            message: e.to_string(),
        })?;
        for _ in 0..MERGE_ATTEMPTS {
            let (mut index, when) = match dc.get_manifest_raw(&r).await? {
                None => (
                    serde_json::json!({
                        "schemaVersion": 2,
                        "mediaType": OCI_INDEX,
                        "manifests": [],
                    }),
                    Precondition::Absent,
                ),
                // Never replace an image someone tagged so (the image
                // itself, as some registries answer, or anything else).
                Some(found) if found.digest == *subject => {
                    return Err(ReferrersError::FallbackTag {
                        reference: r.to_string(),
                        reason: "names the image itself; left alone".into(),
                    });
                }
                Some(found) => (
                    referrers_index(&r, &found.bytes)?,
                    found.etag.map_or(Precondition::None, Precondition::Match),
                ),
            };
            let list = index["manifests"]
                .as_array_mut()
                .expect("referrers_index checked the list");
            let have: HashSet<String> = list
                .iter()
                .filter_map(|d| d.get("digest").and_then(Value::as_str).map(str::to_owned))
                .collect();
            let fresh: Vec<Value> = descriptors
                .iter()
                .filter(|d| {
                    d.get("digest")
                        .and_then(Value::as_str)
                        .is_some_and(|g| !have.contains(g))
                })
                .cloned()
                .collect();
            if fresh.is_empty() {
                return Ok(false);
            }
            list.extend(fresh);
            let bytes = Bytes::from(serde_json::to_vec(&index).expect("a JSON value serialises"));
            if dc.put_manifest_if(&r, bytes, OCI_INDEX, when).await? {
                return Ok(true);
            }
            debug!(tag = %r, "fallback tag changed meanwhile; merging again");
        }
        Err(ReferrersError::FallbackTag {
            reference: r.to_string(),
            reason: format!("still changing after {MERGE_ATTEMPTS} merges"),
        })
    }
}

/// `bytes` read as a fallback tag's referrers index: an image index with a
/// `manifests` list and no `subject`.
fn referrers_index(r: &Reference, bytes: &[u8]) -> Result<Value, ReferrersError> {
    let bad = |reason: String| ReferrersError::FallbackTag {
        reference: r.to_string(),
        reason,
    };
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
    match v.get("mediaType").and_then(Value::as_str) {
        Some(OCI_INDEX) | None => {}
        Some(other) => return Err(bad(format!("mediaType {other:?}, not an image index"))),
    }
    if !v.get("manifests").is_some_and(Value::is_array) {
        return Err(bad("not an image index (no `manifests` list)".into()));
    }
    if v.get("subject").is_some() {
        return Err(bad(
            "an index with a `subject` is a referrer, not a referrers list".into(),
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r() -> Reference {
        Reference::parse("127.0.0.1:5000/app:sha256-00").unwrap()
    }

    #[test]
    fn fallback_tags() {
        let d = Digest::parse(&format!("sha256:{}", "a".repeat(64))).unwrap();
        assert_eq!(fallback_tag(&d, None), format!("sha256-{}", "a".repeat(64)));
        assert_eq!(
            fallback_tag(&d, Some("sig")),
            format!("sha256-{}.sig", "a".repeat(64))
        );
    }

    #[test]
    fn referrers_indexes() {
        let ok = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
        assert!(referrers_index(&r(), ok).is_ok());
        for (bad, says) in [
            (&b"not json"[..], "not JSON"),
            (br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{}}"#, "not an image index"),
            (br#"{"schemaVersion":2}"#, "no `manifests` list"),
            (br#"{"schemaVersion":2,"manifests":[],"subject":{"digest":"sha256:1"}}"#, "subject"),
        ] {
            let e = referrers_index(&r(), bad).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("sha256-00"), "{e}");
        }
    }

    #[test]
    fn allowlist() {
        let all = ReferrerOptions::default();
        assert!(all.allows(None) && all.allows(Some("x")));
        let some = ReferrerOptions {
            artifact_types: vec!["x".into()],
            ..ReferrerOptions::default()
        };
        assert!(some.allows(Some("x")) && !some.allows(Some("y")) && !some.allows(None));
    }
}
