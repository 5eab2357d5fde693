//! The OCI image layout transport, `oci:DIR[:REF]` (image-spec §image-layout).
//!
//! A layout is a directory with `oci-layout`, `index.json` and
//! `blobs/<algorithm>/<hex>`. `REF` is the `org.opencontainers.image.ref.name`
//! annotation of an `index.json` entry, as skopeo and containerd use it.
//! Blobs are written to a temporary file, checked against their digest and
//! size, then renamed into place, so a partial write is never visible;
//! `index.json` is replaced atomically the same way, after the manifest's
//! blobs exist.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::RegistryError;
use super::check::{DigestCheck, Hasher, checked};
use super::manifest::{Descriptor, RawManifest};
use super::session::BlobStream;
use crate::reference::Digest;

/// The annotation that names an `index.json` entry.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The most bytes of a manifest read from a layout, as from a registry.
const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;
/// The most bytes of an `index.json` a reader of many images reads.
const MAX_INDEX_BYTES: u64 = 1024 * 1024 * 1024;

/// containerd's annotation with an entry's whole image name
/// (`ctr images export` writes it, `ctr images import` reads it); unlike
/// [`REF_NAME`] its grammar takes any reference, `_` included.
pub const IMAGE_NAME: &str = "io.containerd.image.name";

/// Errors reading or writing a layout; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A file could not be read or written.
    #[error("oci:{path}: {reason}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
    /// The layout's structure is wrong (missing `oci-layout`, bad `index.json`).
    #[error("oci:{path}: not a valid OCI layout: {reason}")]
    Invalid {
        /// The layout directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// No `index.json` entry has that name, or the choice is ambiguous.
    #[error("oci:{path}: {reason}")]
    NotFound {
        /// The layout directory.
        path: PathBuf,
        /// Which name and what exists.
        reason: String,
    },
    /// A blob's bytes do not match its digest or size.
    #[error("oci:{path}: blob {digest}: {reason}")]
    Corrupt {
        /// The layout directory.
        path: PathBuf,
        /// The digest.
        digest: String,
        /// Expected vs actual.
        reason: String,
    },
}

impl From<LayoutError> for RegistryError {
    fn from(e: LayoutError) -> Self {
        RegistryError::Layout(Box::new(e))
    }
}

type Result<T> = std::result::Result<T, LayoutError>;

/// An OCI layout directory. Writers in one process share one value so
/// `index.json` updates are serialised.
#[derive(Debug)]
pub struct Layout {
    dir: PathBuf,
    index_lock: Mutex<()>,
    mode: Mode,
}

/// How a layout keeps `index.json`.
#[derive(Debug)]
enum Mode {
    /// Read and rewritten at each use.
    Live,
    /// A writer of many images: [`Layout::put_top`] stores the manifest
    /// only, and the caller writes `index.json` once with
    /// [`Layout::write_index`]. Rewriting it per image would write
    /// `index.json` N times over for N images.
    BlobsOnly,
    /// A reader of many images: `index.json` read once, its names mapped
    /// to their entries ([`REF_NAME`], then [`IMAGE_NAME`]).
    Indexed(std::collections::HashMap<String, serde_json::Value>),
}

fn io(path: &Path, e: impl std::fmt::Display) -> LayoutError {
    LayoutError::Io {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

impl Layout {
    /// Opens an existing layout for reading.
    ///
    /// # Errors
    /// [`LayoutError::Invalid`] when `oci-layout` or `index.json` is missing.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(LayoutError::Invalid {
                path: dir.to_owned(),
                reason: "no such directory".into(),
            });
        }
        for f in ["oci-layout", "index.json"] {
            if !dir.join(f).is_file() {
                return Err(LayoutError::Invalid {
                    path: dir.to_owned(),
                    reason: format!("{f} is missing"),
                });
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            index_lock: Mutex::new(()),
            mode: Mode::Live,
        })
    }

    /// Opens an existing layout for reading many images: `index.json` is
    /// read once, and [`Layout::resolve`] looks a name up by
    /// [`REF_NAME`] or else [`IMAGE_NAME`].
    ///
    /// # Errors
    /// As [`Layout::open`]; [`LayoutError::Invalid`] for an `index.json`
    /// that is not one, or that names two entries alike.
    pub fn open_indexed(dir: &Path) -> Result<Self> {
        let mut layout = Self::open(dir)?;
        let path = dir.join("index.json");
        let len = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
        if len > MAX_INDEX_BYTES {
            return Err(LayoutError::Invalid {
                path: dir.to_owned(),
                reason: format!("index.json: {len} bytes, more than is read ({MAX_INDEX_BYTES})"),
            });
        }
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        let index = parse_index(dir, &bytes)?;
        let mut names = std::collections::HashMap::new();
        for entry in index["manifests"].as_array().into_iter().flatten() {
            for key in [REF_NAME, IMAGE_NAME] {
                let Some(name) = entry
                    .get("annotations")
                    .and_then(|a| a.get(key))
                    .and_then(|v| v.as_str())
                else {
                    continue;
                };
                match names.get(name) {
                    Some(other) if other != entry => {
                        return Err(LayoutError::Invalid {
                            path: dir.to_owned(),
                            reason: format!("index.json names two entries {name:?}"),
                        });
                    }
                    _ => {
                        names.insert(name.to_owned(), entry.clone());
                    }
                }
            }
        }
        layout.mode = Mode::Indexed(names);
        Ok(layout)
    }

    /// Opens a layout for writing many images, as [`Layout::create`],
    /// where [`Layout::put_top`] stores the manifest and leaves
    /// `index.json` to [`Layout::write_index`].
    ///
    /// # Errors
    /// As [`Layout::create`].
    pub fn create_blobs_only(dir: &Path) -> Result<Self> {
        let mut layout = Self::create(dir)?;
        layout.mode = Mode::BlobsOnly;
        Ok(layout)
    }

    /// The entries of `index.json`.
    ///
    /// # Errors
    /// [`LayoutError::Io`] / [`LayoutError::Invalid`].
    pub async fn entries(&self) -> Result<Vec<serde_json::Value>> {
        let index = self.read_index().await?;
        Ok(index["manifests"].as_array().cloned().unwrap_or_default())
    }

    /// Replaces `index.json` with one listing `manifests`, atomically.
    ///
    /// # Errors
    /// [`LayoutError::Io`].
    pub async fn write_index(&self, manifests: Vec<serde_json::Value>) -> Result<()> {
        let _guard = self.index_lock.lock().await;
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": super::manifest::OCI_INDEX,
            "manifests": manifests,
        });
        let path = self.dir.join("index.json");
        let bytes = serde_json::to_vec(&index).map_err(|e| io(&path, e))?;
        self.replace_index(&path, bytes).await
    }

    async fn replace_index(&self, path: &Path, bytes: Vec<u8>) -> Result<()> {
        let tmp = self
            .dir
            .join(format!(".index.json.tmp-{}", std::process::id()));
        tokio::fs::write(&tmp, bytes)
            .await
            .map_err(|e| io(&tmp, e))?;
        tokio::fs::rename(&tmp, path).await.map_err(|e| io(path, e))
    }

    /// Opens a layout for writing, creating the directory, `oci-layout` and
    /// an empty `index.json` when missing.
    ///
    /// # Errors
    /// [`LayoutError::Io`] when they cannot be created.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let marker = dir.join("oci-layout");
        if !marker.exists() {
            std::fs::write(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)
                .map_err(|e| io(&marker, e))?;
        }
        let index = dir.join("index.json");
        if !index.exists() {
            std::fs::write(&index, br#"{"schemaVersion":2,"manifests":[]}"#)
                .map_err(|e| io(&index, e))?;
        }
        Ok(Self {
            dir: dir.to_owned(),
            index_lock: Mutex::new(()),
            mode: Mode::Live,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf> {
        let d = Digest::parse(digest).map_err(|e| LayoutError::Invalid {
            path: self.dir.clone(),
            reason: e.to_string(),
        })?;
        Ok(self
            .dir
            .join("blobs")
            .join(d.algorithm().as_str())
            .join(d.hex()))
    }

    async fn read_index(&self) -> Result<serde_json::Value> {
        let path = self.dir.join("index.json");
        let bytes = tokio::fs::read(&path).await.map_err(|e| io(&path, e))?;
        parse_index(&self.dir, &bytes)
    }

    /// The `index.json` entry named `name`, or the only entry when `name` is
    /// `None`.
    ///
    /// # Errors
    /// [`LayoutError::NotFound`] when no entry matches or `None` is ambiguous.
    pub async fn resolve(&self, name: Option<&str>) -> Result<Descriptor> {
        if let (Mode::Indexed(names), Some(n)) = (&self.mode, name) {
            let entry = names.get(n).ok_or_else(|| LayoutError::NotFound {
                path: self.dir.clone(),
                reason: format!("no image named {n:?}"),
            })?;
            return serde_json::from_value(entry.clone()).map_err(|e| LayoutError::Invalid {
                path: self.dir.clone(),
                reason: format!("index.json entry {n:?}: {e}"),
            });
        }
        let index = self.read_index().await?;
        let entries = index["manifests"].as_array().cloned().unwrap_or_default();
        let named = |e: &serde_json::Value| {
            e.pointer(&format!("/annotations/{}", REF_NAME.replace('/', "~1")))
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        };
        let found: Vec<&serde_json::Value> = match name {
            Some(n) => entries
                .iter()
                .filter(|e| named(e).as_deref() == Some(n))
                .collect(),
            None => entries.iter().collect(),
        };
        match found.as_slice() {
            [one] => serde_json::from_value((*one).clone()).map_err(|e| LayoutError::Invalid {
                path: self.dir.clone(),
                reason: format!("index.json entry: {e}"),
            }),
            _ => {
                let names: Vec<String> = entries.iter().filter_map(named).collect();
                Err(LayoutError::NotFound {
                    path: self.dir.clone(),
                    reason: match name {
                        Some(n) => format!("no image named {n:?} (names: {names:?})"),
                        None => format!(
                            "{} images in index.json; name one as oci:DIR:REF (names: {names:?})",
                            entries.len()
                        ),
                    },
                })
            }
        }
    }

    /// Reads and verifies the manifest `desc`.
    ///
    /// # Errors
    /// [`LayoutError::Io`], [`LayoutError::Corrupt`] on a digest mismatch,
    /// [`LayoutError::Invalid`] when it is not a supported manifest.
    pub async fn read_manifest(&self, desc: &Descriptor) -> Result<RawManifest> {
        let path = self.blob_path(&desc.digest)?;
        let len = tokio::fs::metadata(&path)
            .await
            .map_err(|e| io(&path, e))?
            .len();
        if len > MAX_MANIFEST_BYTES {
            return Err(LayoutError::Invalid {
                path: self.dir.clone(),
                reason: format!(
                    "manifest {}: {len} bytes, more than a manifest may have ({MAX_MANIFEST_BYTES})",
                    desc.digest
                ),
            });
        }
        let bytes = tokio::fs::read(&path).await.map_err(|e| io(&path, e))?;
        let digest = Digest::parse(&desc.digest).map_err(|e| LayoutError::Invalid {
            path: self.dir.clone(),
            reason: e.to_string(),
        })?;
        let mut h = Hasher::new(digest.algorithm());
        h.update(&bytes);
        let actual = h.finish();
        if actual != desc.digest {
            return Err(LayoutError::Corrupt {
                path: self.dir.clone(),
                digest: desc.digest.clone(),
                reason: format!("content hashes to {actual}"),
            });
        }
        let ct = (!desc.media_type.is_empty()).then_some(desc.media_type.as_str());
        RawManifest::parse(Bytes::from(bytes), digest, ct).map_err(|e| LayoutError::Invalid {
            path: self.dir.clone(),
            reason: format!("manifest {}: {e}", desc.digest),
        })
    }

    /// Whether blob `desc` exists with its size (a blob of another size
    /// is not it, whatever its name).
    pub async fn has_blob_of(&self, desc: &Descriptor) -> bool {
        match self.blob_path(&desc.digest) {
            Ok(p) => tokio::fs::metadata(p)
                .await
                .is_ok_and(|m| m.len() == desc.size),
            Err(_) => false,
        }
    }

    /// Whether blob `digest` exists.
    pub async fn has_blob(&self, digest: &str) -> bool {
        match self.blob_path(digest) {
            Ok(p) => tokio::fs::metadata(p).await.is_ok(),
            Err(_) => false,
        }
    }

    /// Streams blob `desc`, failing the stream if the bytes do not hash to
    /// its digest or are not exactly its size.
    ///
    /// # Errors
    /// [`LayoutError::Io`] when the file cannot be opened.
    pub async fn read_blob(&self, desc: &Descriptor) -> Result<BlobStream> {
        let path = self.blob_path(&desc.digest)?;
        let file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| io(&path, e))?;
        let reader = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024).boxed();
        Ok(checked(reader, desc.clone(), DigestCheck::Here))
    }

    /// Writes `stream` as blob `desc`: to a temporary file, checked, then
    /// renamed into place. An existing blob is left as is.
    ///
    /// # Errors
    /// [`LayoutError::Io`], or [`LayoutError::Corrupt`] when the bytes do not
    /// match; the temporary file is removed.
    pub async fn write_blob(&self, desc: &Descriptor, mut stream: BlobStream) -> Result<()> {
        let path = self.blob_path(&desc.digest)?;
        let parent = path.parent().expect("blob path has a parent");
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io(parent, e))?;
        // Unique per write: two copies in one process may write one blob
        // at once (a layer two images share), and a name of the digest
        // alone had the second rename find the first's file gone.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent.join(format!(
            ".tmp-{}-{n}-{}",
            std::process::id(),
            &desc.digest[desc.digest.len() - 12..]
        ));
        let digest = Digest::parse(&desc.digest).map_err(|e| LayoutError::Invalid {
            path: self.dir.clone(),
            reason: e.to_string(),
        })?;
        let result: Result<()> = async {
            let mut file = tokio::fs::File::create(&tmp)
                .await
                .map_err(|e| io(&tmp, e))?;
            let mut h = Hasher::new(digest.algorithm());
            let mut n = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| LayoutError::Corrupt {
                    path: self.dir.clone(),
                    digest: desc.digest.clone(),
                    reason: super::chain(&e),
                })?;
                h.update(&chunk);
                n += chunk.len() as u64;
                file.write_all(&chunk).await.map_err(|e| io(&tmp, e))?;
            }
            file.flush().await.map_err(|e| io(&tmp, e))?;
            // On disk before its name says it is there: a blob that exists
            // is taken as whole by the next run.
            file.sync_all().await.map_err(|e| io(&tmp, e))?;
            let actual = h.finish();
            if actual != desc.digest || n != desc.size {
                return Err(LayoutError::Corrupt {
                    path: self.dir.clone(),
                    digest: desc.digest.clone(),
                    reason: format!(
                        "received {n} bytes hashing to {actual}, expected {} bytes",
                        desc.size
                    ),
                });
            }
            tokio::fs::rename(&tmp, &path)
                .await
                .map_err(|e| io(&path, e))
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }

    /// Stores the manifest bytes as a blob (no `index.json` entry).
    ///
    /// # Errors
    /// As [`Layout::write_blob`].
    pub async fn write_manifest(&self, m: &RawManifest) -> Result<()> {
        let desc = Descriptor {
            media_type: m.media_type.clone(),
            digest: m.digest.to_string(),
            size: m.bytes.len() as u64,
            platform: None,
            urls: None,
        };
        if self.has_blob(&desc.digest).await {
            return Ok(());
        }
        let bytes = m.bytes.clone();
        self.write_blob(
            &desc,
            futures::stream::once(async move { Ok(bytes) }).boxed(),
        )
        .await
    }

    /// Stores the manifest and records it in `index.json`, replacing any entry
    /// with the same name (or, unnamed, any entry with the same digest and no
    /// name).
    ///
    /// # Errors
    /// [`LayoutError::Io`] / [`LayoutError::Invalid`].
    pub async fn put_top(&self, m: &RawManifest, name: Option<&str>) -> Result<()> {
        self.write_manifest(m).await?;
        if matches!(self.mode, Mode::BlobsOnly) {
            return Ok(());
        }
        let _guard = self.index_lock.lock().await;
        // Other processes may write this layout too: hold an exclusive
        // flock on the directory across read-modify-replace of index.json.
        let dir_lock = {
            let dir = self.dir.clone();
            tokio::task::spawn_blocking(move || {
                let f = std::fs::File::open(&dir)?;
                f.lock()?;
                Ok::<_, std::io::Error>(f)
            })
            .await
            .map_err(|e| io(&self.dir, e))?
            .map_err(|e| io(&self.dir, format!("cannot lock the layout: {e}")))?
        };
        let mut index = self.read_index().await?;
        let digest = m.digest.to_string();
        let mut entry = serde_json::json!({
            "mediaType": m.media_type,
            "digest": digest,
            "size": m.bytes.len(),
        });
        if let Some(n) = name {
            entry["annotations"] = serde_json::json!({ REF_NAME: n });
        }
        let arr = index["manifests"]
            .as_array_mut()
            .expect("checked by read_index");
        arr.retain(|e| {
            let ename = e
                .get("annotations")
                .and_then(|a| a.get(REF_NAME))
                .and_then(|v| v.as_str());
            match name {
                Some(n) => ename != Some(n),
                None => {
                    !(ename.is_none() && e.get("digest").and_then(|d| d.as_str()) == Some(&digest))
                }
            }
        });
        arr.push(entry);
        let path = self.dir.join("index.json");
        let bytes = serde_json::to_vec(&index).map_err(|e| io(&path, e))?;
        let res = self.replace_index(&path, bytes).await;
        drop(dir_lock); // closing the file releases the flock
        res
    }
}

/// `bytes` read as `index.json`: JSON with a `manifests` array.
fn parse_index(dir: &Path, bytes: &[u8]) -> Result<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| LayoutError::Invalid {
        path: dir.to_owned(),
        reason: format!("index.json: {e}"),
    })?;
    if !v.get("manifests").is_some_and(|m| m.is_array()) {
        return Err(LayoutError::Invalid {
            path: dir.to_owned(),
            reason: "index.json has no \"manifests\" array".into(),
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies in one process write one blob at once (a layer two images
    /// share): every write succeeds, and the blob is whole.
    #[tokio::test]
    async fn one_blob_written_at_once_by_many() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::create(dir.path()).unwrap();
        let bytes = Bytes::from(vec![7u8; 300_000]);
        let digest = format!(
            "sha256:{}",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes))
        );
        let desc = Descriptor {
            media_type: "application/octet-stream".into(),
            digest: digest.clone(),
            size: bytes.len() as u64,
            platform: None,
            urls: None,
        };
        let writes = (0..16).map(|_| {
            let chunks: Vec<std::io::Result<Bytes>> = bytes
                .chunks(10_000)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            layout.write_blob(&desc, futures::stream::iter(chunks).boxed())
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
        let path = layout.blob_path(&digest).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "temporary files left: {left:?}");
    }
}
