//! Usage records of the clusters that share a target: the registry itself
//! is the only shared state (docs/operations.md#several-clusters-one-mirror).
//!
//! Each cluster's leader publishes what its cluster uses as an OCI
//! artifact at `<target>/pinswap-usage:<cluster>`: an image manifest with
//! artifactType [`ARTIFACT_TYPE`], the empty config, and the record's
//! entries in shards, one layer each ([`super::shards`]); the manifest's
//! annotations hold the rest of the [`ClusterRecord`]. Entries name target
//! repositories without the registry host (`repository@digest`, or
//! `repository:tag` for a Pod that names a tag), each with when this
//! cluster last used it. A record in the earlier format, one JSON layer of
//! artifactType [`ARTIFACT_TYPE_V1`], is still read, and replaced at its
//! cluster's next publication.
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

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::shards::{self, Cache, Shard};
use crate::mirror::Mirror;
use crate::reference::{MirrorTarget, Reference};
use crate::registry::Registry;
use crate::registry::delete::Deleted;
use crate::registry::manifest::{Descriptor, RawManifest};

/// The repository under the target's prefix that holds the records.
pub use crate::reference::USAGE_REPOSITORY as REPOSITORY;
/// The records' artifactType.
pub const ARTIFACT_TYPE: &str = "application/vnd.pinswap.usage.v2+json";
/// The artifactType and layer media type of a record in the earlier
/// format: one layer, the whole [`ClusterRecord`] as JSON.
pub const ARTIFACT_TYPE_V1: &str = "application/vnd.pinswap.usage.v1+json";
/// The most entries a record holds, about a million. A cluster that uses
/// more publishes an incomplete record, and no cluster's retention removes
/// anything while one is.
pub const MAX_ENTRIES: usize = super::shards::MAX_SHARDS * super::shards::SHARD_ENTRIES;
/// The most bytes of a record's entries.
pub const MAX_BYTES: usize = 256 * 1024 * 1024;
/// The most bytes of an earlier-format record's one layer.
const MAX_V1_BYTES: u64 = 8 * 1024 * 1024;
/// The most records read: more stops retention, as unreadable.
pub const MAX_CLUSTERS: usize = 1024;
/// The most bytes of all records read in one pass together.
pub const MAX_TOTAL_BYTES: u64 = 512 * 1024 * 1024;
/// Shards read at once.
const READ_CONCURRENCY: usize = 8;

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

/// A record as read, with its manifest's digest and its layers' size.
#[derive(Debug, Clone)]
pub struct Read {
    /// The record.
    pub record: ClusterRecord,
    /// Its manifest's digest.
    pub digest: crate::reference::Digest,
    /// Its layers' bytes.
    pub bytes: u64,
    /// Its layers' digests: blobs the target holds.
    pub layers: Vec<crate::reference::Digest>,
}

/// The blobs a writer knows the target holds, so that it uploads only the
/// shards that changed.
#[derive(Debug, Default, Clone)]
pub struct Present {
    /// The empty config.
    pub config: bool,
    /// The layers of the record's version now at the target.
    pub layers: HashSet<crate::reference::Digest>,
}

/// The records' repository at one target.
pub struct Records {
    client: Arc<Registry>,
    repository: Reference,
    ecr: Option<Arc<crate::registry::ecr::Ecr>>,
    cache: Arc<Cache>,
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
            cache: Arc::default(),
        })
    }

    /// Reads through `cache`: a shard read before is not fetched again.
    pub fn with_cache(mut self, cache: Arc<Cache>) -> Self {
        self.cache = cache;
        self
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

    /// The clusters that have a record: the repository's tags, but the
    /// retention records' (`_…`, never a cluster name).
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
        let tags = match first {
            None => Vec::new(),
            Some((tags, true)) => tags,
            Some((_, false)) => self
                .client
                .tags(&self.repository)
                .await
                .map_err(|e| self.registry_error(e))?,
        };
        // The retention records' tags, never cluster names.
        let mut tags: Vec<String> = tags
            .into_iter()
            .filter(|t| t != "_retention" && !t.starts_with("_retention."))
            .collect();
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
        if let Some(why) = crate::config::cluster_name_problem(cluster) {
            return Err(ClustersError::Unreadable {
                cluster: crate::logsafe::clip(cluster, 80),
                why: format!("its tag is not a cluster name: {why}"),
            });
        }
        self.read_at(cluster).await
    }

    /// The record under `tag`, which names it (a cluster's, or the
    /// retention record's); `None` when there is none.
    ///
    /// # Errors
    /// As [`Records::read`].
    pub async fn read_at(&self, tag: &str) -> Result<Option<Read>, ClustersError> {
        let cluster = tag;
        let unreadable = |why: String| ClustersError::Unreadable {
            cluster: crate::logsafe::clip(cluster, 80),
            why,
        };
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
            #[serde(default)]
            annotations: BTreeMap<String, String>,
        }
        let shape: Shape = serde_json::from_slice(&m.bytes)
            .map_err(|e| unreadable(format!("its manifest is not JSON: {e}")))?;
        let digest_of = |l: &Descriptor| {
            crate::reference::Digest::parse(&l.digest)
                .map_err(|e| unreadable(format!("a layer's digest: {e}")))
        };
        let (record, bytes) = match shape.artifact_type.as_deref() {
            Some(ARTIFACT_TYPE_V1) => match shape.layers.as_slice() {
                [l] if l.media_type == ARTIFACT_TYPE_V1 => {
                    let bytes = self
                        .client
                        .blob_bytes(&tagged, l, MAX_V1_BYTES)
                        .await
                        .map_err(|e| unreadable(e.to_string()))?;
                    let record: ClusterRecord = serde_json::from_slice(&bytes)
                        .map_err(|e| unreadable(format!("its layer is not a usage record: {e}")))?;
                    (record, bytes.len() as u64)
                }
                _ => {
                    return Err(unreadable(format!(
                        "its manifest is not a {ARTIFACT_TYPE_V1} artifact with one layer"
                    )));
                }
            },
            Some(ARTIFACT_TYPE) => {
                let layers = &shape.layers;
                if layers.is_empty()
                    || layers.len() > shards::MAX_SHARDS
                    || !layers.len().is_power_of_two()
                    || layers.iter().any(|l| l.media_type != shards::MEDIA_TYPE)
                {
                    return Err(unreadable(format!(
                        "its manifest is not a {ARTIFACT_TYPE} artifact of 1 to {} {} layers, a power of two",
                        shards::MAX_SHARDS,
                        shards::MEDIA_TYPE
                    )));
                }
                let head = Head::of(&shape.annotations).map_err(unreadable)?;
                let bytes: u64 = layers.iter().map(|l| l.size).sum();
                // Before any shard is read: a record's size is bounded.
                if bytes > MAX_BYTES as u64 {
                    return Err(unreadable(format!(
                        "its shards take {bytes} bytes, more than a record holds ({MAX_BYTES})"
                    )));
                }
                let parts = self.shards(&tagged, layers).await.map_err(unreadable)?;
                let images = shards::join(&parts, head.updated).map_err(unreadable)?;
                let record = ClusterRecord {
                    cluster: head.cluster,
                    updated: head.updated,
                    complete: head.complete,
                    in_use: head.in_use,
                    images,
                    quotas: head.quotas,
                };
                (record, bytes)
            }
            _ => {
                return Err(unreadable(format!(
                    "its manifest's artifactType is not {ARTIFACT_TYPE} (nor {ARTIFACT_TYPE_V1})"
                )));
            }
        };
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
        let layers = shape
            .layers
            .iter()
            .map(digest_of)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Read {
            record,
            digest: m.digest,
            bytes,
            layers,
        }))
    }

    /// The shards `layers` name, each read from the cache or else fetched
    /// (a few at once) and kept there.
    async fn shards(
        &self,
        tagged: &Reference,
        layers: &[Descriptor],
    ) -> Result<Vec<Arc<Shard>>, String> {
        use futures::StreamExt;
        let fetch = |l: &Descriptor| {
            let l = l.clone();
            async move {
                let digest = crate::reference::Digest::parse(&l.digest)
                    .map_err(|e| format!("a layer's digest: {e}"))?;
                if let Some(s) = self.cache.get(&digest) {
                    return Ok(s);
                }
                let bytes = self
                    .client
                    .blob_bytes(tagged, &l, shards::MAX_SHARD_BYTES)
                    .await
                    .map_err(|e| e.to_string())?;
                let s = Arc::new(shards::parse(&bytes)?);
                self.cache.put(digest, s.clone());
                Ok::<_, String>(s)
            }
        };
        futures::stream::iter(layers.iter().map(fetch))
            .buffered(READ_CONCURRENCY)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
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
        let mut live = HashSet::new();
        for name in names {
            if Some(name.as_str()) == except {
                continue;
            }
            match self.read_full(&name).await? {
                Some(r) => {
                    live.extend(r.layers.iter().cloned());
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
        // Only what the records name now stays cached.
        self.cache.retain(&live);
        Ok(out)
    }

    /// Publishes `record` under its cluster's tag: the empty config and
    /// the shards that `present` does not hold, then the manifest; on
    /// success `present` holds the new version's layers. Returns the bytes
    /// uploaded and the manifest's digest, which [`Records::digest_of`]
    /// tells before.
    ///
    /// # Errors
    /// [`ClustersError::Registry`] or [`ClustersError::Ecr`] when a write
    /// is refused; the record stored before stays as it was.
    pub async fn publish(
        &self,
        record: &ClusterRecord,
        present: &mut Present,
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
        if !present.config {
            let exists = self
                .client
                .blob_exists(&tagged, &artifact.config.digest)
                .await
                .map_err(|e| self.registry_error(e))?;
            if !exists {
                self.push(&tagged, &artifact.config, Bytes::from_static(EMPTY))
                    .await?;
            }
            present.config = true;
        }
        let mut uploaded = 0;
        let mut layers = HashSet::new();
        for (desc, bytes) in &artifact.layers {
            let digest = crate::reference::Digest::parse(&desc.digest)
                .expect("a digest computed here parses");
            if !present.layers.contains(&digest) {
                uploaded += bytes.len();
                self.push(&tagged, desc, bytes.clone()).await?;
                // The writer's next read finds it known.
                if let Ok(shard) = shards::parse(bytes) {
                    self.cache.put(digest.clone(), Arc::new(shard));
                }
            }
            layers.insert(digest);
        }
        self.client
            .push_manifest(&tagged, &artifact.manifest)
            .await
            .map_err(|e| self.registry_error(e))?;
        present.layers = layers;
        Ok((uploaded, artifact.manifest.digest))
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

/// The manifest annotations that hold a record's fields other than its
/// entries.
const CLUSTER: &str = "dev.pinswap.cluster";
const CREATED: &str = "org.opencontainers.image.created";
const IN_USE: &str = "dev.pinswap.in-use";
const COMPLETE: &str = "dev.pinswap.complete";
const QUOTAS: &str = "dev.pinswap.quotas";

/// A record's fields other than its entries, as its manifest's
/// annotations hold them.
struct Head {
    cluster: String,
    updated: Timestamp,
    complete: bool,
    in_use: usize,
    quotas: Vec<crate::registry::quota::QuotaUse>,
}

impl Head {
    fn of(a: &BTreeMap<String, String>) -> Result<Self, String> {
        let get = |k: &str| {
            a.get(k)
                .ok_or_else(|| format!("its manifest has no annotation {k}"))
        };
        let bad = |k: &str, e: &dyn std::fmt::Display| format!("its annotation {k}: {e}");
        Ok(Self {
            cluster: get(CLUSTER)?.clone(),
            updated: get(CREATED)?.parse().map_err(|e| bad(CREATED, &e))?,
            complete: get(COMPLETE)?.parse().map_err(|e| bad(COMPLETE, &e))?,
            in_use: get(IN_USE)?.parse().map_err(|e| bad(IN_USE, &e))?,
            quotas: match a.get(QUOTAS) {
                Some(q) => serde_json::from_str(q).map_err(|e| bad(QUOTAS, &e))?,
                None => Vec::new(),
            },
        })
    }
}

/// A record as pushed: its shards and the manifest naming them.
struct Artifact {
    config: Descriptor,
    layers: Vec<(Descriptor, Bytes)>,
    manifest: RawManifest,
}

impl Artifact {
    fn of(record: &ClusterRecord) -> Result<Self, ClustersError> {
        let config = descriptor("application/vnd.oci.empty.v1+json", EMPTY);
        let layers: Vec<(Descriptor, Bytes)> = shards::split(&record.images, record.updated)
            .into_iter()
            .map(|b| (descriptor(shards::MEDIA_TYPE, &b), b))
            .collect();
        let mut annotations = serde_json::json!({
            CREATED: record.updated.to_string(),
            CLUSTER: record.cluster,
            IN_USE: record.in_use.to_string(),
            COMPLETE: record.complete.to_string(),
        });
        if !record.quotas.is_empty() {
            annotations[QUOTAS] = serde_json::to_string(&record.quotas)
                .expect("quotas serialise")
                .into();
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": ARTIFACT_TYPE,
            "config": {"mediaType": config.media_type, "digest": config.digest, "size": config.size},
            "layers": layers.iter().map(|(d, _)| serde_json::json!({"mediaType": d.media_type, "digest": d.digest, "size": d.size})).collect::<Vec<_>>(),
            "annotations": annotations,
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
            layers,
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
