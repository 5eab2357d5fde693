//! The manifest model the copy engine needs: media types, raw manifests and
//! a lenient read of their descriptors.
//!
//! Manifests are kept as the bytes the registry served; the parsed view is
//! only used to find children and blobs (OCI image-spec §manifest, §image
//! index; Docker schema2 manifest and manifest list are read the same way, as
//! the image-spec allows). Unknown fields and any config or layer mediaType
//! are accepted, so artifacts (Spin, Wasm, Helm, ORAS) copy like images.
//! oci-client's typed manifests are not used here because they reject
//! manifests without layers and re-serialise on push.

use bytes::Bytes;
use serde::Deserialize;

use crate::platform::{Platform, PlatformSpec};
use crate::reference::Digest;

/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Docker schema2 manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker schema2 manifest list.
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker schema1 (signed) manifest; refused, see [`ManifestKind`].
pub const DOCKER_SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1+prettyjws";

/// The Accept list sent for manifests: every type we copy.
pub const ACCEPT: &[&str] = &[
    OCI_MANIFEST,
    OCI_INDEX,
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
];

/// Layer media types whose blobs are not distributable and are not copied
/// (Docker foreign layers and OCI non-distributable layers, image-spec
/// §layer "non-distributable"); skopeo behaves the same by default.
pub fn is_non_distributable(media_type: &str) -> bool {
    media_type.starts_with("application/vnd.docker.image.rootfs.foreign.")
        || media_type.starts_with("application/vnd.oci.image.layer.nondistributable.")
}

/// Whether a mediaType names an index (OCI index or Docker manifest list).
pub fn is_index(media_type: &str) -> bool {
    media_type == OCI_INDEX || media_type == DOCKER_MANIFEST_LIST
}

/// A descriptor (image-spec §descriptor), the fields we use.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// mediaType of the referenced content.
    #[serde(default)]
    pub media_type: String,
    /// Digest of the referenced content, `algorithm:hex`.
    pub digest: String,
    /// Size in bytes.
    pub size: u64,
    /// Platform, for index entries.
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Alternate URLs (foreign layers); never fetched.
    #[serde(default)]
    pub urls: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shape {
    #[serde(default)]
    schema_version: Option<i64>,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

/// What a manifest references.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestKind {
    /// An image manifest (OCI or Docker schema2, image or artifact): its
    /// config and layers are blobs.
    Image {
        /// The config descriptor.
        config: Descriptor,
        /// The layer descriptors, in order.
        layers: Vec<Descriptor>,
    },
    /// An index or manifest list: its entries are manifests.
    Index {
        /// The child manifest descriptors, in order.
        manifests: Vec<Descriptor>,
    },
}

/// A manifest exactly as served, with its content type and digest.
#[derive(Debug, Clone)]
pub struct RawManifest {
    /// The bytes; the digest is over these.
    pub bytes: Bytes,
    /// The mediaType used as Content-Type when pushing.
    pub media_type: String,
    /// sha256 (or the reference's algorithm) of `bytes`.
    pub digest: Digest,
    /// The parsed view.
    pub kind: ManifestKind,
}

/// Why a manifest cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    /// Not JSON or the wrong shape.
    #[error("not a valid manifest: {0}")]
    Invalid(String),
    /// `--platform` matched no entry of the index.
    #[error("no entry of index {index} matches platform(s) {wanted}")]
    NoPlatformMatch {
        /// The index digest.
        index: String,
        /// The platforms asked for.
        wanted: String,
    },
    /// Docker schema1 or another version.
    #[error(
        "unsupported manifest (schemaVersion {0}); Docker schema1 manifests are not copied, convert them to schema2 first"
    )]
    Schema(i64),
}

impl RawManifest {
    /// Reads `bytes` as a manifest. `content_type` is the registry's
    /// Content-Type (if known); the manifest's own `mediaType` field wins, and
    /// without either the shape decides (`manifests` → OCI index, else OCI
    /// manifest), as image-spec §image index allows.
    ///
    /// # Errors
    /// [`ManifestError::Invalid`] for non-JSON or missing config/manifests;
    /// [`ManifestError::Schema`] for schemaVersion other than 2.
    pub fn parse(
        bytes: Bytes,
        digest: Digest,
        content_type: Option<&str>,
    ) -> Result<Self, ManifestError> {
        let shape: Shape =
            serde_json::from_slice(&bytes).map_err(|e| ManifestError::Invalid(e.to_string()))?;
        match shape.schema_version {
            Some(2) => {}
            Some(v) => return Err(ManifestError::Schema(v)),
            None => return Err(ManifestError::Invalid("missing schemaVersion".into())),
        }
        let content_type = content_type
            .map(|c| c.split(';').next().unwrap_or(c).trim())
            .filter(|c| ACCEPT.contains(c));
        let media_type = shape
            .media_type
            .clone()
            .or(content_type.map(str::to_owned))
            .unwrap_or_else(|| {
                if shape.manifests.is_some() {
                    OCI_INDEX.to_owned()
                } else {
                    OCI_MANIFEST.to_owned()
                }
            });
        let kind = if is_index(&media_type) {
            ManifestKind::Index {
                manifests: shape.manifests.ok_or_else(|| {
                    ManifestError::Invalid(format!("{media_type} without \"manifests\""))
                })?,
            }
        } else if media_type == OCI_MANIFEST || media_type == DOCKER_MANIFEST {
            ManifestKind::Image {
                config: shape.config.ok_or_else(|| {
                    ManifestError::Invalid(format!("{media_type} without \"config\""))
                })?,
                layers: shape.layers.unwrap_or_default(),
            }
        } else {
            return Err(ManifestError::Invalid(format!(
                "unsupported manifest mediaType {media_type:?}"
            )));
        };
        Ok(Self {
            bytes,
            media_type,
            digest,
            kind,
        })
    }

    /// Blobs to copy for an image manifest: config first, then layers,
    /// duplicates and non-distributable layers removed. Empty for an index.
    pub fn blobs(&self) -> Vec<Descriptor> {
        let ManifestKind::Image { config, layers } = &self.kind else {
            return Vec::new();
        };
        let mut out: Vec<Descriptor> = Vec::with_capacity(layers.len() + 1);
        for d in std::iter::once(config).chain(layers) {
            if is_non_distributable(&d.media_type) || out.iter().any(|o| o.digest == d.digest) {
                continue;
            }
            out.push(d.clone());
        }
        out
    }
}

/// Writes an index holding only the entries whose platform matches one of
/// `platforms`. The result is new JSON (compact, keys in serde_json's order),
/// so its digest differs from the source index's: this is the one place the
/// copy engine writes a manifest it did not read. Entries without a platform
/// are dropped. When every entry matches, the caller copies the source index
/// unchanged instead.
///
/// Returns the new bytes and the kept entries.
///
/// # Errors
/// [`ManifestError::Invalid`] if the source is not a JSON object with a
/// `manifests` array, or no entry matches.
pub fn filter_index(
    source: &RawManifest,
    platforms: &[PlatformSpec],
) -> Result<(Bytes, Vec<Descriptor>), ManifestError> {
    let ManifestKind::Index { manifests } = &source.kind else {
        return Err(ManifestError::Invalid("not an index".into()));
    };
    let mut value: serde_json::Value =
        serde_json::from_slice(&source.bytes).map_err(|e| ManifestError::Invalid(e.to_string()))?;
    let keep: Vec<bool> = manifests
        .iter()
        .map(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| platforms.iter().any(|s| s.matches(p)))
        })
        .collect();
    if !keep.iter().any(|k| *k) {
        return Err(ManifestError::NoPlatformMatch {
            index: source.digest.to_string(),
            wanted: platforms
                .iter()
                .map(|p| match &p.variant {
                    Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                    None => format!("{}/{}", p.os, p.architecture),
                })
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let arr = value
        .get_mut("manifests")
        .and_then(|m| m.as_array_mut())
        .ok_or_else(|| ManifestError::Invalid("\"manifests\" is not an array".into()))?;
    let mut i = 0;
    arr.retain(|_| {
        i += 1;
        keep[i - 1]
    });
    let bytes = serde_json::to_vec(&value).map_err(|e| ManifestError::Invalid(e.to_string()))?;
    let kept = manifests
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(d, _)| d.clone())
        .collect();
    Ok((Bytes::from(bytes), kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> Digest {
        Digest::parse(&format!("sha256:{}", "a".repeat(64))).unwrap()
    }

    #[test]
    fn media_type_from_field_header_or_shape() {
        let m = br#"{"schemaVersion":2,"config":{"mediaType":"x","digest":"sha256:1","size":2},"layers":[]}"#;
        let r = RawManifest::parse(Bytes::from_static(m), d(), None).unwrap();
        assert_eq!(r.media_type, OCI_MANIFEST);
        let r = RawManifest::parse(Bytes::from_static(m), d(), Some(DOCKER_MANIFEST)).unwrap();
        assert_eq!(r.media_type, DOCKER_MANIFEST);
        let i = br#"{"schemaVersion":2,"manifests":[]}"#;
        let r = RawManifest::parse(Bytes::from_static(i), d(), None).unwrap();
        assert_eq!(r.media_type, OCI_INDEX);
    }

    #[test]
    fn rejects_schema1_and_garbage() {
        let e = RawManifest::parse(Bytes::from_static(br#"{"schemaVersion":1}"#), d(), None)
            .unwrap_err();
        assert_eq!(e, ManifestError::Schema(1));
        assert!(
            RawManifest::parse(Bytes::from_static(b"nope"), d(), None)
                .unwrap_err()
                .to_string()
                .starts_with("not a valid manifest")
        );
        let e = RawManifest::parse(
            Bytes::from_static(
                br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}"#,
            ),
            d(),
            None,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "not a valid manifest: application/vnd.oci.image.manifest.v1+json without \"config\""
        );
    }

    #[test]
    fn blobs_dedup_and_skip_foreign() {
        let m = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
          "config":{"mediaType":"c","digest":"sha256:c","size":1},
          "layers":[{"mediaType":"l","digest":"sha256:a","size":1},
                    {"mediaType":"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip","digest":"sha256:f","size":1,"urls":["https://example.com"]},
                    {"mediaType":"l","digest":"sha256:a","size":1}]}"#;
        let r = RawManifest::parse(Bytes::from_static(m), d(), None).unwrap();
        let got: Vec<_> = r.blobs().into_iter().map(|b| b.digest).collect();
        assert_eq!(got, ["sha256:c", "sha256:a"]);
    }

    #[test]
    fn platform_filter() {
        let i = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:1","size":1,"platform":{"os":"linux","architecture":"amd64"}},
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:2","size":1,"platform":{"os":"linux","architecture":"arm64","variant":"v8"}},
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:3","size":1}]}"#;
        let r = RawManifest::parse(Bytes::from_static(i), d(), None).unwrap();
        let arm: PlatformSpec = "linux/arm64".parse().unwrap();
        let (bytes, kept) = filter_index(&r, std::slice::from_ref(&arm)).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].digest, "sha256:2");
        let back = RawManifest::parse(bytes, d(), None).unwrap();
        assert_eq!(
            back.kind,
            ManifestKind::Index {
                manifests: kept.clone()
            }
        );
        let v7: PlatformSpec = "linux/arm64/v7".parse().unwrap();
        let e = filter_index(&r, &[v7]).unwrap_err();
        assert!(
            e.to_string().contains("matches platform(s) linux/arm64/v7"),
            "{e}"
        );
    }
}
