//! The running set, carried across an air gap (docs/air-gap.md).
//!
//! `pinswap export` reads the usage records at a target
//! ([`crate::retention::clusters`]) and writes what they list into an OCI
//! image layout: every manifest of each image (every platform the target
//! holds), the target's tags that name them (the source's tags and the
//! anchor tags `pinswap-<hex>`), and their referrers (cosign's tags, the
//! fallback tag indexes and what the referrers API lists). Each
//! `index.json` entry carries its path under the target's prefix in
//! [`IMAGE_NAME`], and a manifest of the export, [`MANIFEST_FILE`], is
//! written last: a layout without one is an export that did not finish.
//! `pinswap import` pushes the layout into another registry under its own
//! prefix, digests unchanged, and never moves a tag that names something
//! else there unless told to.

pub mod export;
pub mod import;

use serde::{Deserialize, Serialize};

pub use crate::registry::layout::IMAGE_NAME;

/// The export's own manifest, next to `index.json`.
pub const MANIFEST_FILE: &str = "pinswap-export.json";
/// Its `kind`.
pub const KIND: &str = "pinswap-export";
/// The format version it is written in.
pub const VERSION: u32 = 1;

/// Errors of an export or an import; each names what it was about.
#[derive(Debug, thiserror::Error)]
pub enum AirgapError {
    /// The usage records could not be read.
    #[error(transparent)]
    Records(#[from] crate::retention::clusters::ClustersError),
    /// A cluster named on the command line has no record at the target.
    #[error("no usage record of cluster {cluster} at the target (records: {names})")]
    NoRecord {
        /// The name asked for.
        cluster: String,
        /// The records there are.
        names: String,
    },
    /// A record lists only part of what its cluster uses.
    #[error(
        "the usage record of cluster {cluster} is incomplete (it uses {in_use} images, more than a record holds): an export of it would not be what the cluster runs"
    )]
    Incomplete {
        /// The cluster.
        cluster: String,
        /// How many images it uses.
        in_use: usize,
    },
    /// A registry request failed.
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    /// The layout could not be read or written.
    #[error(transparent)]
    Layout(#[from] crate::registry::layout::LayoutError),
    /// A file beside the layout could not be read or written.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// The directory is not a finished export.
    #[error("{path}: {reason}")]
    NotAnExport {
        /// The directory or file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// An entry of the export is not an image name under a prefix.
    #[error("{path}: entry {name:?}: {reason}")]
    BadEntry {
        /// The export.
        path: std::path::PathBuf,
        /// The entry's name.
        name: String,
        /// Why.
        reason: String,
    },
}

pub(crate) fn io_error(path: &std::path::Path, e: impl std::fmt::Display) -> AirgapError {
    AirgapError::Io {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

/// One cluster whose record an export read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportedCluster {
    /// Its name.
    pub cluster: String,
    /// When its record was published (RFC 3339).
    pub updated: String,
    /// How many images the record lists.
    pub images: usize,
}

/// One manifest an export wrote, under one name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// `<path under the prefix>:<tag>` or `<path under the prefix>@<digest>`.
    pub name: String,
    /// The manifest's digest.
    pub digest: String,
    /// Its mediaType.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// For a referrer: the digest it refers to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// For a referrer: its artifactType (or its config's mediaType).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    /// For a referrer by digest: the annotations of the descriptor that
    /// listed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
    /// What it is: `image`, `referrer` (by digest, as the referrers API or
    /// a fallback tag index lists it) or `referrer-tag` (cosign's
    /// `sha256-<hex>.sig|.att|.sbom`).
    pub role: Role,
}

/// What an [`Entry`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// An image the records list, or a tag of one.
    Image,
    /// A referrer by digest.
    Referrer,
    /// A cosign tag.
    ReferrerTag,
}

/// [`MANIFEST_FILE`]: what an export wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportManifest {
    /// [`KIND`].
    pub kind: String,
    /// [`VERSION`].
    pub version: u32,
    /// When it finished (RFC 3339).
    pub created: String,
    /// The target it was read from, `host[:port][/prefix]`.
    pub target: String,
    /// The clusters whose records it holds.
    pub clusters: Vec<ExportedCluster>,
    /// Every manifest under every name, images first.
    pub entries: Vec<Entry>,
    /// What the records list, or a listed referrer, that the target did
    /// not hold.
    #[serde(default)]
    pub missing: Vec<String>,
    /// What could not be exported, each with why.
    #[serde(default)]
    pub failed: Vec<String>,
    /// Blobs the entries reach (manifests included).
    pub blobs: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// `name` split into its path and its tag or digest: `a/b:t` is
/// `("a/b", Some("t"), None)`, `a/b@sha256:…` is `("a/b", None, Some(…))`.
pub fn split_name(name: &str) -> Option<(&str, Option<&str>, Option<&str>)> {
    if let Some((path, digest)) = name.split_once('@') {
        return Some((path, None, Some(digest)));
    }
    let (path, tag) = name.rsplit_once(':')?;
    (!tag.contains('/')).then_some((path, Some(tag), None))
}

/// The tag's subject when it is a referrer's: `sha256-<hex>` (the
/// fallback tag index) or cosign's `sha256-<hex>.sig`, `.att`, `.sbom`.
pub fn referrer_tag_subject(tag: &str) -> Option<crate::reference::Digest> {
    let (algorithm, rest) = tag.split_once('-')?;
    let hex = match rest.split_once('.') {
        Some((hex, "sig" | "att" | "sbom")) => hex,
        Some(_) => return None,
        None => rest,
    };
    crate::reference::Digest::parse(&format!("{algorithm}:{hex}")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_into_path_and_tag_or_digest() {
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            split_name("docker.io/library/nginx:1.25"),
            Some(("docker.io/library/nginx", Some("1.25"), None))
        );
        assert_eq!(
            split_name(&format!("127.0.0.1_5001/app@{d}")),
            Some(("127.0.0.1_5001/app", None, Some(d.as_str())))
        );
        assert_eq!(split_name("no-tag"), None);
    }

    #[test]
    fn referrer_tags_name_their_subject() {
        let hex = "b".repeat(64);
        let subject = format!("sha256:{hex}");
        for tag in [
            format!("sha256-{hex}"),
            format!("sha256-{hex}.sig"),
            format!("sha256-{hex}.att"),
            format!("sha256-{hex}.sbom"),
        ] {
            assert_eq!(
                referrer_tag_subject(&tag).map(|d| d.to_string()),
                Some(subject.clone()),
                "{tag}"
            );
        }
        for tag in [
            "latest".to_owned(),
            format!("sha256-{hex}.other"),
            "sha256-short".to_owned(),
            format!("pinswap-{hex}"),
        ] {
            assert_eq!(referrer_tag_subject(&tag), None, "{tag}");
        }
    }
}
