//! Usage records of the clusters that share a target: the registry itself
//! is the only shared state (docs/operations.md#several-clusters-one-mirror).
//!
//! Each cluster's leader publishes what its cluster uses as an OCI
//! artifact at `<target>/pinswap-usage:<cluster>`: an image manifest with
//! artifactType [`ARTIFACT_TYPE`], the empty config and one JSON layer,
//! [`ClusterRecord`]. Entries name target repositories without the
//! registry host (`repository@digest`, or `repository:tag` for a Pod that
//! names a tag), each with when this cluster last used it.
//!
//! One writer per record, the leader of its cluster: records never
//! conflict with each other, so no conditional request is needed between
//! clusters. Distribution 2.8 keeps no ETags and writes a tag's link by
//! truncating it first, so a record read while it is written may read as
//! missing: a tag that is listed but cannot be read stops retention for
//! that pass instead of counting as an unused cluster.
//!
//! `pinswap-usage` is one path component under the prefix; mirror paths
//! always have two or more (`<registry>/<path>`), so it never names a
//! mirrored image.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::mirror::Mirror;
use crate::reference::{MirrorTarget, Reference};
use crate::registry::Registry;
use crate::registry::delete::Deleted;
use crate::registry::manifest::{Descriptor, RawManifest};

/// The repository under the target's prefix that holds the records.
pub use crate::reference::USAGE_REPOSITORY as REPOSITORY;
/// The records' artifactType and layer media type.
pub const ARTIFACT_TYPE: &str = "application/vnd.pinswap.usage.v1+json";
/// The most entries a record holds. A cluster that uses more publishes an
/// incomplete record, and no cluster's retention removes anything while
/// one is.
pub const MAX_ENTRIES: usize = 20_000;
/// The most bytes of a record's layer (read and written).
pub const MAX_BYTES: usize = 8 * 1024 * 1024;
/// The most records read: more stops retention, as unreadable.
pub const MAX_CLUSTERS: usize = 256;
/// The most bytes of all records read in one pass together.
pub const MAX_TOTAL_BYTES: u64 = 64 * 1024 * 1024;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const EMPTY: &[u8] = b"{}";

/// Errors about the records.
#[derive(Debug, thiserror::Error)]
pub enum ClustersError {
    /// The target could not be reached.
    #[error("usage records at {repository}: {source}")]
    Target {
        /// `registry/prefix/pinswap-usage`.
        repository: String,
        /// Why.
        source: Box<crate::mirror::MirrorError>,
    },
    /// A request to the target failed or was refused.
    #[error("usage records at {repository}: {source}")]
    Registry {
        /// `registry/prefix/pinswap-usage`.
        repository: String,
        /// Why.
        source: Box<crate::registry::RegistryError>,
    },
    /// ECR refused to create or delete in the records' repository.
    #[error("usage records at {repository}: {source}")]
    Ecr {
        /// `registry/prefix/pinswap-usage`.
        repository: String,
        /// Why.
        source: Box<crate::registry::ecr::EcrError>,
    },
    /// A cluster's record is listed but cannot be read.
    #[error("the usage record of cluster {cluster} cannot be read: {why}")]
    Unreadable {
        /// The tag.
        cluster: String,
        /// Why.
        why: String,
    },
    /// The target holds more records than are read, or larger ones
    /// together than a pass reads.
    #[error("usage records at {repository}: {why}")]
    TooMany {
        /// `registry/prefix/pinswap-usage`.
        repository: String,
        /// How many, or how large.
        why: String,
    },
    /// Another install publishes under this cluster's name.
    #[error(
        "another install publishes a usage record under cluster name {cluster} (the record is {found}, this install last wrote {wrote}): give each cluster its own name"
    )]
    Conflict {
        /// The name.
        cluster: String,
        /// The digest the tag names now.
        found: String,
        /// The digest this install wrote last.
        wrote: String,
    },
    /// A cluster uses more images than a record holds.
    #[error(
        "the usage record of cluster {cluster} is incomplete: it uses {entries} images, more than a record holds ({MAX_ENTRIES})"
    )]
    Incomplete {
        /// The cluster.
        cluster: String,
        /// Images it uses.
        entries: usize,
    },
}

impl ClustersError {
    /// Whether the target refused to show the records (401, 403) or has
    /// none (404): an answer, where every other error leaves it unknown.
    pub fn refused(&self) -> bool {
        use crate::registry::RegistryError as R;
        match self {
            Self::Registry { source, .. } => matches!(
                **source,
                R::Unauthorized { .. }
                    | R::AuthRequired { .. }
                    | R::Http {
                        status: 401 | 403 | 404,
                        ..
                    }
            ),
            _ => false,
        }
    }
}

/// What one cluster uses, as its leader published it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterRecord {
    /// The cluster's name (its tag).
    pub cluster: String,
    /// When it was published.
    pub updated: Timestamp,
    /// False when the cluster uses more than [`MAX_ENTRIES`] images:
    /// `images` is a part of them, and retention removes nothing.
    pub complete: bool,
    /// How many images the cluster uses (all of them, also when
    /// `complete` is false).
    pub in_use: usize,
    /// Target `repository@digest` (or `repository:tag`) → last use.
    pub images: BTreeMap<String, Timestamp>,
    /// The cluster's recent pulls under each source quota it shares with
    /// other clusters (an account's), so that each leader paces against
    /// the fleet's total. Left out when empty: a reader from before it
    /// reads such a record as it always did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<crate::registry::quota::QuotaUse>,
}

impl ClusterRecord {
    /// Whether it was not updated within `stale_after` of `now`.
    pub fn is_stale(&self, now: Timestamp, stale_after: std::time::Duration) -> bool {
        age(now, self.updated) > stale_after
    }
}

/// `now - then`, 0 when `then` is ahead (another machine's clock).
pub fn age(now: Timestamp, then: Timestamp) -> std::time::Duration {
    std::time::Duration::try_from(now.duration_since(then)).unwrap_or_default()
}

/// The key a record gives a target reference: its repository, and its
/// digest or else its tag; `None` for one outside `target`.
pub fn entry_key(target: &MirrorTarget, image: &Reference) -> Option<String> {
    if !target.contains(image) {
        return None;
    }
    let repo = image.repository();
    match (image.digest(), image.tag()) {
        (Some(d), _) => Some(format!("{repo}@{d}")),
        (None, Some(t)) => Some(format!("{repo}:{t}")),
        (None, None) => None,
    }
}

/// A record as read, with its manifest's digest and its layer's size.
#[derive(Debug, Clone)]
pub struct Read {
    /// The record.
    pub record: ClusterRecord,
    /// Its manifest's digest.
    pub digest: crate::reference::Digest,
    /// Its layer's bytes.
    pub bytes: u64,
}

/// The records' repository at one target.
pub struct Records {
    client: Arc<Registry>,
    repository: Reference,
    ecr: Option<Arc<crate::registry::ecr::Ecr>>,
}

impl Records {
    /// The records of `mirror`'s target.
    ///
    /// # Errors
    /// [`ClustersError::Target`] when the target cannot be reached.
    pub async fn of(mirror: &Mirror) -> Result<Self, ClustersError> {
        let repository = records_repository(mirror.target())?;
        let client = mirror
            .target_client()
            .await
            .map_err(|e| ClustersError::Target {
                repository: repository.to_string(),
                source: Box::new(e),
            })?;
        Ok(Self {
            client,
            repository,
            ecr: mirror.ecr().cloned(),
        })
    }

    /// `registry/prefix/pinswap-usage`.
    pub fn repository(&self) -> &Reference {
        &self.repository
    }

    /// `cluster`'s tag in the records' repository.
    fn tagged(&self, cluster: &str) -> Result<Reference, ClustersError> {
        self.repository
            .with_tag(cluster)
            .map_err(|e| ClustersError::Unreadable {
                cluster: crate::logsafe::clip(cluster, 80),
                why: e.to_string(),
            })
    }

    fn registry_error(&self, e: crate::registry::RegistryError) -> ClustersError {
        ClustersError::Registry {
            repository: self.repository.to_string(),
            source: Box::new(e),
        }
    }

    /// The clusters that have a record: the repository's tags.
    ///
    /// # Errors
    /// [`ClustersError::Registry`].
    pub async fn names(&self) -> Result<Vec<String>, ClustersError> {
        // One request where the first page is the whole list.
        let first = self
            .client
            .tags_page(&self.repository, 1000)
            .await
            .map_err(|e| self.registry_error(e))?;
        let mut tags = match first {
            None => Vec::new(),
            Some((tags, true)) => tags,
            Some((_, false)) => self
                .client
                .tags(&self.repository)
                .await
                .map_err(|e| self.registry_error(e))?,
        };
        if tags.len() > MAX_CLUSTERS {
            return Err(ClustersError::TooMany {
                repository: self.repository.to_string(),
                why: format!(
                    "{} records, more than are read ({MAX_CLUSTERS}): forget retired clusters",
                    tags.len()
                ),
            });
        }
        tags.sort();
        Ok(tags)
    }

    /// `cluster`'s record; `None` when it has none.
    ///
    /// # Errors
    /// [`ClustersError::Registry`]; [`ClustersError::Unreadable`] for a
    /// record that is not one pinswap writes, or names another cluster.
    pub async fn read(&self, cluster: &str) -> Result<Option<ClusterRecord>, ClustersError> {
        Ok(self.read_full(cluster).await?.map(|r| r.record))
    }

    /// As [`Records::read`], with the manifest's digest and the layer's
    /// size.
    ///
    /// # Errors
    /// As [`Records::read`].
    pub async fn read_full(&self, cluster: &str) -> Result<Option<Read>, ClustersError> {
        let unreadable = |why: String| ClustersError::Unreadable {
            cluster: crate::logsafe::clip(cluster, 80),
            why,
        };
        if let Some(why) = crate::config::cluster_name_problem(cluster) {
            return Err(unreadable(format!("its tag is not a cluster name: {why}")));
        }
        let tagged = self.tagged(cluster)?;
        let Some(m) = self
            .client
            .get_manifest_raw(&tagged)
            .await
            .map_err(|e| self.registry_error(e))?
        else {
            return Ok(None);
        };
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Shape {
            #[serde(default)]
            artifact_type: Option<String>,
            #[serde(default)]
            layers: Vec<Descriptor>,
        }
        let shape: Shape = serde_json::from_slice(&m.bytes)
            .map_err(|e| unreadable(format!("its manifest is not JSON: {e}")))?;
        let layer = match (shape.artifact_type.as_deref(), shape.layers.as_slice()) {
            (Some(ARTIFACT_TYPE), [l]) if l.media_type == ARTIFACT_TYPE => l,
            _ => {
                return Err(unreadable(format!(
                    "its manifest is not a {ARTIFACT_TYPE} artifact with one layer"
                )));
            }
        };
        let bytes = self
            .client
            .blob_bytes(&tagged, layer, MAX_BYTES as u64)
            .await
            .map_err(|e| unreadable(e.to_string()))?;
        let record: ClusterRecord = serde_json::from_slice(&bytes)
            .map_err(|e| unreadable(format!("its layer is not a usage record: {e}")))?;
        if record.cluster != cluster {
            return Err(unreadable(format!(
                "it names cluster {:?}",
                crate::logsafe::clip(&record.cluster, 80)
            )));
        }
        if record.images.len() > MAX_ENTRIES {
            return Err(unreadable(format!(
                "{} entries, more than a record holds ({MAX_ENTRIES})",
                record.images.len()
            )));
        }
        Ok(Some(Read {
            record,
            digest: m.digest,
            bytes: bytes.len() as u64,
        }))
    }

    /// Every cluster's record but `except`'s; `listed` names a record the
    /// caller knows is there (its own, just written).
    ///
    /// # Errors
    /// As [`Records::read`]; [`ClustersError::Unreadable`] for a listed
    /// cluster whose record is gone (being written, or just forgotten), and
    /// when the listing leaves `listed` out.
    pub async fn read_all(
        &self,
        except: Option<&str>,
        listed: Option<&str>,
    ) -> Result<Vec<ClusterRecord>, ClustersError> {
        let mut out = Vec::new();
        let mut total = 0;
        let names = self.names().await?;
        // A record known to be there (this cluster's, just written) that
        // the listing leaves out: the listing is short (a 404, a list cut
        // short), and what else it leaves out is unknown.
        if let Some(own) = listed
            && !names.iter().any(|n| n == own)
        {
            return Err(ClustersError::Unreadable {
                cluster: own.to_owned(),
                why: "the target's listing of the records leaves out this cluster's own, just written: the listing is incomplete".into(),
            });
        }
        for name in names {
            if Some(name.as_str()) == except {
                continue;
            }
            match self.read_full(&name).await? {
                Some(r) => {
                    total += r.bytes;
                    if total > MAX_TOTAL_BYTES {
                        return Err(ClustersError::TooMany {
                            repository: self.repository.to_string(),
                            why: format!(
                                "the records are larger together than a pass reads ({MAX_TOTAL_BYTES} bytes)"
                            ),
                        });
                    }
                    out.push(r.record);
                }
                None => {
                    return Err(ClustersError::Unreadable {
                        cluster: name,
                        why: "its tag is listed but its manifest is not found".into(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Publishes `record` under its cluster's tag: the empty config (unless
    /// `config_present` says it is there; set once it is), the layer, the
    /// manifest. Returns the bytes of the layer and the manifest's digest,
    /// which [`Records::digest_of`] tells before.
    ///
    /// # Errors
    /// [`ClustersError::Registry`] or [`ClustersError::Ecr`] when a write
    /// is refused; the record stored before stays as it was.
    pub async fn publish(
        &self,
        record: &ClusterRecord,
        config_present: &mut bool,
    ) -> Result<(usize, crate::reference::Digest), ClustersError> {
        let tagged = self.tagged(&record.cluster)?;
        if let Some(ecr) = &self.ecr {
            ecr.ensure_repository(self.repository.repository())
                .await
                .map_err(|e| ClustersError::Ecr {
                    repository: self.repository.to_string(),
                    source: Box::new(e),
                })?;
        }
        let artifact = Artifact::of(record)?;
        if !*config_present {
            let exists = self
                .client
                .blob_exists(&tagged, &artifact.config.digest)
                .await
                .map_err(|e| self.registry_error(e))?;
            if !exists {
                self.push(&tagged, &artifact.config, Bytes::from_static(EMPTY))
                    .await?;
            }
            *config_present = true;
        }
        self.push(&tagged, &artifact.layer_desc, artifact.layer.clone())
            .await?;
        self.client
            .push_manifest(&tagged, &artifact.manifest)
            .await
            .map_err(|e| self.registry_error(e))?;
        Ok((artifact.layer.len(), artifact.manifest.digest))
    }

    /// The digest of the manifest [`Records::publish`] writes for `record`.
    ///
    /// # Errors
    /// [`ClustersError::Unreadable`] when it cannot be built.
    pub fn digest_of(record: &ClusterRecord) -> Result<crate::reference::Digest, ClustersError> {
        Ok(Artifact::of(record)?.manifest.digest)
    }

    /// The digest `cluster`'s tag names now, if any.
    ///
    /// # Errors
    /// [`ClustersError::Registry`].
    pub async fn current(
        &self,
        cluster: &str,
    ) -> Result<Option<crate::reference::Digest>, ClustersError> {
        let tagged = self.tagged(cluster)?;
        self.client
            .head_manifest(&tagged)
            .await
            .map_err(|e| self.registry_error(e))
    }

    /// Removes an earlier version of a record (by digest, no tag names it
    /// any more), so versions do not pile up at the target.
    /// [`Deleted::Unsupported`]: the registry refuses deletes, and keeps
    /// every version.
    ///
    /// # Errors
    /// [`ClustersError::Registry`] or [`ClustersError::Ecr`].
    pub async fn remove_version(
        &self,
        digest: &crate::reference::Digest,
    ) -> Result<Deleted, ClustersError> {
        if let Some(ecr) = &self.ecr {
            return ecr
                .delete_image(self.repository.repository(), &[], digest)
                .await
                .map(|()| Deleted::Accepted)
                .map_err(|e| ClustersError::Ecr {
                    repository: self.repository.to_string(),
                    source: Box::new(e),
                });
        }
        self.client
            .delete_manifest_digest(&self.repository, digest)
            .await
            .map_err(|e| self.registry_error(e))
    }

    async fn push(
        &self,
        r: &Reference,
        desc: &Descriptor,
        bytes: Bytes,
    ) -> Result<(), ClustersError> {
        let stream: crate::registry::session::BlobStream =
            Box::pin(futures::stream::once(async move { Ok(bytes) }));
        self.client
            .push_blob(r, desc, stream)
            .await
            .map_err(|e| self.registry_error(e))
    }

    /// Removes `cluster`'s record; false when it had none.
    ///
    /// # Errors
    /// [`ClustersError::Registry`] or [`ClustersError::Ecr`].
    pub async fn forget(&self, cluster: &str) -> Result<bool, ClustersError> {
        let tagged = self.tagged(cluster)?;
        let Some(digest) = self
            .client
            .head_manifest(&tagged)
            .await
            .map_err(|e| self.registry_error(e))?
        else {
            return Ok(false);
        };
        if let Some(ecr) = &self.ecr {
            ecr.delete_image(self.repository.repository(), &[cluster.to_owned()], &digest)
                .await
                .map_err(|e| ClustersError::Ecr {
                    repository: self.repository.to_string(),
                    source: Box::new(e),
                })?;
            return Ok(true);
        }
        // By digest: Distribution cannot delete a tag, and removes the
        // tags of a manifest deleted.
        match self
            .client
            .delete_manifest_digest(&self.repository, &digest)
            .await
            .map_err(|e| self.registry_error(e))?
        {
            Deleted::Accepted | Deleted::Absent => Ok(true),
            Deleted::Unsupported => Err(ClustersError::Unreadable {
                cluster: cluster.to_owned(),
                why: "the target registry refuses deletes (Distribution: storage.delete.enabled)"
                    .into(),
            }),
        }
    }
}

/// `<target registry>/<prefix>/pinswap-usage`.
///
/// # Errors
/// [`ClustersError::Unreadable`] when the prefix leaves no room for it (a
/// repository name is at most 255 characters).
pub fn records_repository(target: &MirrorTarget) -> Result<Reference, ClustersError> {
    let path = match target.prefix() {
        Some(p) => format!("{}/{p}/{REPOSITORY}", target.registry()),
        None => format!("{}/{REPOSITORY}", target.registry()),
    };
    Reference::parse(&path)
        .map(|r| r.without_tag())
        .map_err(|e| ClustersError::Unreadable {
            cluster: String::new(),
            why: format!("the target's prefix leaves no room for {REPOSITORY}: {e}"),
        })
}

/// A record as pushed: its layer and the manifest naming it.
struct Artifact {
    config: Descriptor,
    layer: Bytes,
    layer_desc: Descriptor,
    manifest: RawManifest,
}

impl Artifact {
    fn of(record: &ClusterRecord) -> Result<Self, ClustersError> {
        let layer = Bytes::from(serde_json::to_vec(record).expect("a record serialises"));
        let config = descriptor("application/vnd.oci.empty.v1+json", EMPTY);
        let layer_desc = descriptor(ARTIFACT_TYPE, &layer);
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": ARTIFACT_TYPE,
            "config": {"mediaType": config.media_type, "digest": config.digest, "size": config.size},
            "layers": [{"mediaType": layer_desc.media_type, "digest": layer_desc.digest, "size": layer_desc.size}],
            "annotations": {
                "org.opencontainers.image.created": record.updated.to_string(),
                "dev.pinswap.cluster": record.cluster,
            },
        });
        let bytes = Bytes::from(serde_json::to_vec(&manifest).expect("a manifest serialises"));
        let digest = crate::registry::check::sha256_digest(&bytes);
        let manifest = RawManifest::parse(bytes, digest, Some(OCI_MANIFEST)).map_err(|e| {
            ClustersError::Unreadable {
                cluster: record.cluster.clone(),
                why: e.to_string(),
            }
        })?;
        Ok(Self {
            config,
            layer,
            layer_desc,
            manifest,
        })
    }
}

fn descriptor(media_type: &str, bytes: &[u8]) -> Descriptor {
    Descriptor {
        media_type: media_type.to_owned(),
        digest: crate::registry::check::sha256_digest(bytes).to_string(),
        size: bytes.len() as u64,
        platform: None,
        urls: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_target_repositories_by_digest_or_tag() {
        let target = MirrorTarget::parse("m.example.com/mirror").unwrap();
        let d = format!("sha256:{}", "a".repeat(64));
        let pinned = Reference::parse(&format!(
            "m.example.com/mirror/docker.io/library/nginx:1@{d}"
        ))
        .unwrap();
        assert_eq!(
            entry_key(&target, &pinned).unwrap(),
            format!("mirror/docker.io/library/nginx@{d}")
        );
        let tagged = Reference::parse("m.example.com/mirror/docker.io/library/nginx:1").unwrap();
        assert_eq!(
            entry_key(&target, &tagged).unwrap(),
            "mirror/docker.io/library/nginx:1"
        );
        let outside = Reference::parse("docker.io/library/nginx:1").unwrap();
        assert_eq!(entry_key(&target, &outside), None);
        assert_eq!(
            records_repository(&target).unwrap().to_string(),
            "m.example.com/mirror/pinswap-usage"
        );
    }

    #[test]
    fn a_record_is_stale_past_stale_after_and_never_from_a_clock_ahead() {
        let now = Timestamp::from_second(10_000).unwrap();
        let r = |s| ClusterRecord {
            cluster: "a".into(),
            updated: Timestamp::from_second(s).unwrap(),
            complete: true,
            in_use: 0,
            images: BTreeMap::new(),
            quotas: Vec::new(),
        };
        let hour = std::time::Duration::from_secs(3600);
        assert!(!r(10_000 - 3600).is_stale(now, hour));
        assert!(r(10_000 - 3601).is_stale(now, hour));
        assert!(!r(20_000).is_stale(now, hour));
    }
}
