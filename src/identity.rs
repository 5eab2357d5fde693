//! Image identity (docs/architecture.md §2 "image ID", "identity collision"): detect
//! config-digest collisions and repair them on the mirror.
//!
//! containerd and CRI identify an image by its config digest. When
//! different artifacts share one config blob, a node that already has one of
//! them runs it in place of the others. Known cases: Spin apps pushed before
//! Spin 2.4 (one 78-byte wasm config for every app), ORAS and wasm-to-oci
//! artifacts (the `{}` config), Helm charts with identical Chart.yaml.
//!
//! - [`assess`] judges one image manifest from its config bytes:
//!   **content-bearing** configs commit to the layers (`rootfs.diff_ids`, a
//!   layer digest, or the [`CONTENT_LABEL`]); two manifests sharing such a
//!   config have the same uncompressed content and are legitimately one
//!   image ID. A config is **non-unique** on first sight when it is one of
//!   the [`KNOWN_SHARED`] configs, or carries no layer-derived content
//!   while the manifest has layers.
//! - [`Record`] remembers config digest → {manifest digest, ordered layer
//!   digests, references}. A **collision** is one config digest seen with
//!   two different layer lists.
//! - [`repair_config`], [`repair_manifest`] and [`repair_index`] build the
//!   repaired copy: the config gains [`CONTENT_LABEL`] = sha256 over the
//!   ordered layer digests (under `config.Labels` for image configs, as a
//!   top-level field for other JSON configs); layers stay byte-identical;
//!   the manifest is re-serialised with the new config descriptor and the
//!   annotation [`REPAIRED_FROM`] (OCI manifests); an index gets the
//!   repaired children. Repair is deterministic and idempotent: a repaired
//!   config carries the label, so it is content-bearing and never repaired
//!   again. A config that is not a JSON object is not repaired; the finding
//!   stays a warning that says so.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::Value;

use crate::platform::PlatformSpec;
use crate::reference::{Digest, Reference};
use crate::registry::RegistryError;
use crate::registry::check::sha256_digest;
use crate::registry::client::Registry;
use crate::registry::manifest::{
    DOCKER_MANIFEST, Descriptor, ManifestError, ManifestKind, OCI_MANIFEST, RawManifest,
    filter_index,
};

/// The label a repaired config carries: `sha256:<hex>` over the ordered
/// layer digests, each followed by `\n`.
pub const CONTENT_LABEL: &str = "dev.pinswap.content-digest";

/// Manifest annotation of a repaired manifest: the original's digest.
pub const REPAIRED_FROM: &str = "dev.pinswap.repaired-from";

/// The OCI empty descriptor's mediaType (content `{}`).
pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";

/// The config mediaType a repaired `{}` config gets: its content is no
/// longer `{}`, which the empty type requires. Artifacts with an empty
/// config carry their own `artifactType` (image-spec requires it), so the
/// artifact's type is unchanged.
pub const LABELLED_EMPTY: &str = "application/vnd.pinswap.config.v1+json";

/// Configs known to be shared by unrelated artifacts: (digest, what it is).
pub const KNOWN_SHARED: [(&str, &str); 2] = [
    (
        "sha256:aabedf0b094944b344cecbffcfa0a9172e905a5d156bdf67c4c6cbb6d27d1d92",
        "the wasm config every Spin app pushed before Spin 2.4 shares",
    ),
    (
        "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
        "the empty {} config of ORAS and wasm-to-oci artifacts",
    ),
];

/// Config mediaTypes that are image configs (labels go under
/// `config.Labels`, image-spec §config).
const IMAGE_CONFIGS: [&str; 2] = [
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

/// Errors building a repaired copy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    /// The config is not a JSON object, so no label can be added.
    #[error(
        "config {0} is not a JSON object; pinswap cannot label it (republish the artifact with a unique config)"
    )]
    NotJson(String),
    /// The manifest could not be rewritten.
    #[error("manifest {digest}: {reason}")]
    Manifest {
        /// Its digest.
        digest: String,
        /// Why.
        reason: String,
    },
}

/// What one image manifest says about its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// The image manifest's digest.
    pub manifest: String,
    /// The config descriptor (its digest is the image ID).
    pub config: Descriptor,
    /// Layer digests, in order.
    pub layers: Vec<String>,
    /// The config commits to the layers.
    pub content_bearing: bool,
    /// Why the config is non-unique on first sight, if it is.
    pub non_unique: Option<String>,
    /// The config is a JSON object (so it can be repaired).
    pub repairable: bool,
}

/// Judges an image manifest's config. `config` holds the config's bytes.
pub fn assess(
    manifest_digest: &str,
    config: &Descriptor,
    layers: &[Descriptor],
    bytes: &[u8],
) -> Facts {
    let layer_digests: Vec<String> = layers.iter().map(|l| l.digest.clone()).collect();
    let json: Option<Value> = serde_json::from_slice(bytes).ok().filter(Value::is_object);
    let content_bearing = json
        .as_ref()
        .is_some_and(|v| carries_layer_content(v, &layer_digests));
    let known = KNOWN_SHARED
        .iter()
        .find(|(d, _)| *d == config.digest)
        .map(|(_, what)| (*what).to_owned());
    let non_unique = known.or_else(|| {
        (!content_bearing && !layers.is_empty())
            .then(|| "the config carries no layer-derived content (no rootfs.diff_ids, layer digest or content label)".to_owned())
    });
    Facts {
        manifest: manifest_digest.to_owned(),
        config: config.clone(),
        layers: layer_digests,
        content_bearing,
        non_unique,
        repairable: json.is_some(),
    }
}

/// Whether a config commits to its layers: non-empty `rootfs.diff_ids`
/// (containerd checks them when unpacking), the content label with the
/// value these layers give (a copied or forged label does not count), or
/// every layer digest named somewhere in it (naming one shared base layer
/// does not tell artifacts apart).
fn carries_layer_content(config: &Value, layers: &[String]) -> bool {
    let diff_ids = config
        .pointer("/rootfs/diff_ids")
        .and_then(Value::as_array)
        .is_some_and(|d| !d.is_empty());
    let want = content_digest(layers).to_string();
    let labelled = config
        .pointer("/config/Labels")
        .and_then(|l| l.get(CONTENT_LABEL))
        .or_else(|| config.get(CONTENT_LABEL))
        .and_then(Value::as_str)
        == Some(want.as_str());
    let mut named = std::collections::HashSet::new();
    strings(config, &mut named);
    let all_named = !layers.is_empty() && layers.iter().all(|l| named.contains(l.as_str()));
    diff_ids || labelled || all_named
}

fn strings<'a>(v: &'a Value, out: &mut std::collections::HashSet<&'a str>) {
    match v {
        Value::String(s) => {
            out.insert(s);
        }
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

/// `sha256:<hex>` over the ordered layer digests, each followed by `\n`.
pub fn content_digest(layers: &[String]) -> Digest {
    let mut text = String::new();
    for l in layers {
        text.push_str(l);
        text.push('\n');
    }
    sha256_digest(text.as_bytes())
}

/// The repaired config: `config` plus [`CONTENT_LABEL`] over `layers`,
/// under `config.Labels` for image configs (by `media_type`, or a `rootfs`
/// field), else as a top-level field. Re-serialised compactly with the key
/// order kept.
///
/// # Errors
/// [`IdentityError::NotJson`] when the config is not a JSON object.
pub fn repair_config(
    config: &[u8],
    config_desc: &Descriptor,
    layers: &[String],
) -> Result<Vec<u8>, IdentityError> {
    let mut v: Value = serde_json::from_slice(config)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| IdentityError::NotJson(config_desc.digest.clone()))?;
    let label = Value::String(content_digest(layers).to_string());
    let obj = v.as_object_mut().expect("checked is_object");
    let image_config =
        IMAGE_CONFIGS.contains(&config_desc.media_type.as_str()) || obj.contains_key("rootfs");
    if image_config {
        let cfg = obj
            .entry("config")
            .or_insert_with(|| Value::Object(Default::default()));
        if !cfg.is_object() {
            *cfg = Value::Object(Default::default());
        }
        let labels = cfg
            .as_object_mut()
            .expect("an object")
            .entry("Labels")
            .or_insert_with(|| Value::Object(Default::default()));
        if !labels.is_object() {
            *labels = Value::Object(Default::default());
        }
        labels
            .as_object_mut()
            .expect("an object")
            .insert(CONTENT_LABEL.into(), label);
    } else {
        obj.insert(CONTENT_LABEL.into(), label);
    }
    Ok(serde_json::to_vec(&v).expect("a JSON value serialises"))
}

fn rewrite(
    m: &RawManifest,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> Result<RawManifest, IdentityError> {
    let bad = |reason: String| IdentityError::Manifest {
        digest: m.digest.to_string(),
        reason,
    };
    let mut v: Value = serde_json::from_slice(&m.bytes).map_err(|e| bad(e.to_string()))?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    edit(obj);
    let bytes = Bytes::from(serde_json::to_vec(&v).expect("a JSON value serialises"));
    let digest = sha256_digest(&bytes);
    RawManifest::parse(bytes, digest, Some(&m.media_type))
        .map_err(|e: ManifestError| bad(e.to_string()))
}

/// The image manifest `m` with its config descriptor pointing at
/// `config` (digest, size) and, for OCI manifests, the annotation
/// [`REPAIRED_FROM`] = `m`'s digest. Docker schema2 has no annotations.
///
/// # Errors
/// [`IdentityError::Manifest`] when `m` is not a JSON object.
pub fn repair_manifest(
    m: &RawManifest,
    config: (&Digest, u64),
) -> Result<RawManifest, IdentityError> {
    let original = m.digest.to_string();
    let oci = m.media_type == OCI_MANIFEST;
    rewrite(m, |obj| {
        if let Some(c) = obj.get_mut("config").and_then(Value::as_object_mut) {
            c.insert("digest".into(), Value::String(config.0.to_string()));
            c.insert("size".into(), Value::from(config.1));
            // Embedded `data` must match the digest (image-spec §descriptor),
            // and the empty type's content must be `{}`.
            c.remove("data");
            if c.get("mediaType").and_then(Value::as_str) == Some(OCI_EMPTY) {
                c.insert("mediaType".into(), Value::String(LABELLED_EMPTY.into()));
            }
        }
        if oci {
            let a = obj
                .entry("annotations")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Some(a) = a.as_object_mut() {
                a.insert(REPAIRED_FROM.into(), Value::String(original));
            }
        }
    })
}

/// The index `m` with each child in `replaced` (old digest → new digest and
/// size) swapped for its repaired manifest.
///
/// # Errors
/// [`IdentityError::Manifest`] when `m` is not a JSON object.
pub fn repair_index(
    m: &RawManifest,
    replaced: &HashMap<String, (Digest, u64)>,
) -> Result<RawManifest, IdentityError> {
    rewrite(m, |obj| {
        if let Some(list) = obj.get_mut("manifests").and_then(Value::as_array_mut) {
            for entry in list {
                let old = entry
                    .get("digest")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                if let (Some(old), Some(e)) = (old, entry.as_object_mut())
                    && let Some((d, size)) = replaced.get(&old)
                {
                    e.insert("digest".into(), Value::String(d.to_string()));
                    e.insert("size".into(), Value::from(*size));
                }
            }
        }
    })
}

/// Whether `m` is an image manifest pinswap can repair (OCI or Docker
/// schema2 image manifest).
pub fn is_image_manifest(m: &RawManifest) -> bool {
    matches!(m.kind, ManifestKind::Image { .. })
        && (m.media_type == OCI_MANIFEST || m.media_type == DOCKER_MANIFEST)
}

/// Requests an inspection makes at once.
const INSPECT_CONCURRENCY: usize = 8;

/// Largest config read (bytes); image configs with long histories stay far
/// below it.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// One image manifest of an inspected reference.
#[derive(Debug, Clone)]
pub struct ImageInfo {
    /// The manifest as served.
    pub manifest: RawManifest,
    /// `os/arch[/variant]` from its index entry, if it has one.
    pub platform: Option<String>,
    /// 0 for the top manifest, 1 for a child of the top index, 2 and more
    /// inside nested indexes.
    pub depth: usize,
    /// The config's bytes.
    pub config: Bytes,
    /// What they say about identity.
    pub facts: Facts,
}

/// A reference's top manifest and every image manifest under it.
#[derive(Debug, Clone)]
pub struct Inspection {
    /// The top manifest; with `platforms`, an index filtered as the copy
    /// filters it.
    pub top: RawManifest,
    /// The image manifests, in index order (one for a single image).
    pub images: Vec<ImageInfo>,
}

/// Reads `r`'s manifest, its children (filtered by `platforms` as
/// [`crate::registry::copy::Copier`] filters them) and each image's config
/// (at most [`MAX_CONFIG_BYTES`]), and assesses each image.
///
/// # Errors
/// Registry errors; [`RegistryError::Manifest`] when a platform filter
/// matches nothing.
pub async fn inspect(
    client: &Registry,
    r: &Reference,
    platforms: &[PlatformSpec],
) -> Result<Inspection, RegistryError> {
    let top = client.get_manifest(r).await?;
    let mut queue: Vec<(Descriptor, usize)> = Vec::new();
    let mut images = Vec::new();
    let top = match &top.kind {
        ManifestKind::Index { manifests } if !platforms.is_empty() => {
            let (bytes, kept) =
                filter_index(&top, platforms).map_err(|e| RegistryError::Manifest {
                    registry: client.host().to_owned(),
                    reference: r.to_string(),
                    reason: e.to_string(),
                })?;
            queue.extend(kept.iter().map(|d| (d.clone(), 1)));
            if kept.len() == manifests.len() {
                top.clone()
            } else {
                RawManifest {
                    digest: sha256_digest(&bytes),
                    bytes,
                    media_type: top.media_type.clone(),
                    kind: ManifestKind::Index { manifests: kept },
                }
            }
        }
        ManifestKind::Index { manifests } => {
            queue.extend(manifests.iter().map(|d| (d.clone(), 1)));
            top.clone()
        }
        ManifestKind::Image { .. } => {
            images.push(image_info(client, r, top.clone(), None, 0).await?);
            top.clone()
        }
    };
    // Level by level, INSPECT_CONCURRENCY requests at a time, order kept:
    // an index with many platforms and attestations would otherwise cost
    // one round trip per child and per config, in series.
    let mut pending: Vec<(RawManifest, Option<String>, usize)> = Vec::new();
    let mut level = queue;
    while !level.is_empty() {
        let fetched: Vec<(Descriptor, usize, RawManifest)> = futures::stream::iter(level)
            .map(|(d, depth)| async move {
                let digest = Digest::parse(&d.digest).map_err(|e| RegistryError::Manifest {
                    registry: client.host().to_owned(),
                    reference: r.to_string(),
                    reason: format!("index entry: {e}"),
                })?;
                let child = client
                    .get_manifest(&r.without_tag().with_digest(digest))
                    .await?;
                Ok::<_, RegistryError>((d, depth, child))
            })
            .buffered(INSPECT_CONCURRENCY)
            .try_collect()
            .await?;
        level = Vec::new();
        for (d, depth, child) in fetched {
            match &child.kind {
                ManifestKind::Index { manifests } => {
                    level.extend(manifests.iter().map(|c| (c.clone(), depth + 1)));
                }
                ManifestKind::Image { .. } => {
                    let platform = d.platform.as_ref().map(|p| {
                        let mut s = format!("{}/{}", p.os, p.architecture);
                        if let Some(v) = &p.variant {
                            s.push('/');
                            s.push_str(v);
                        }
                        s
                    });
                    pending.push((child, platform, depth));
                }
            }
        }
    }
    let children: Vec<ImageInfo> = futures::stream::iter(pending)
        .map(|(m, platform, depth)| image_info(client, r, m, platform, depth))
        .buffered(INSPECT_CONCURRENCY)
        .try_collect()
        .await?;
    images.extend(children);
    Ok(Inspection { top, images })
}

async fn image_info(
    client: &Registry,
    r: &Reference,
    manifest: RawManifest,
    platform: Option<String>,
    depth: usize,
) -> Result<ImageInfo, RegistryError> {
    let ManifestKind::Image { config, layers } = &manifest.kind else {
        unreachable!("called for image manifests only")
    };
    let bytes = client.blob_bytes(r, config, MAX_CONFIG_BYTES).await?;
    let facts = assess(manifest.digest.as_str(), config, layers, &bytes);
    Ok(ImageInfo {
        manifest,
        platform,
        depth,
        config: bytes,
        facts,
    })
}

/// A repaired copy of an inspected reference, ready to push after the
/// original's blobs are at the target: new configs, then `children` by
/// digest, then `top` by tag.
#[derive(Debug, Clone)]
pub struct Repair {
    /// The original top manifest's digest.
    pub original: Digest,
    /// The repaired top manifest (an image manifest, or an index).
    pub top: RawManifest,
    /// Repaired child manifests of an index (empty for a single image).
    pub children: Vec<RawManifest>,
    /// The new configs with their descriptors.
    pub configs: Vec<(Descriptor, Bytes)>,
    /// (original config digest, repaired config digest) per repaired image.
    pub replaced_configs: Vec<(String, String)>,
}

/// Flagged images a repair leaves as they are: (manifest digest, why).
pub type Unrepaired = Vec<(String, &'static str)>;

/// Plans the repair of every non-unique image of `ins` whose config is a
/// JSON object and that is the top manifest or a child of the top index.
/// Returns the repair (`None` when nothing can be repaired) and the flagged
/// images left as they are, with why: config not a JSON object, or inside a
/// nested index (only the top index's own children are rewritten).
///
/// # Errors
/// [`IdentityError::Manifest`] when a manifest cannot be rewritten.
pub fn plan_repair(ins: &Inspection) -> Result<(Option<Repair>, Unrepaired), IdentityError> {
    let mut replaced = HashMap::new();
    let mut children = Vec::new();
    let mut configs = Vec::new();
    let mut replaced_configs = Vec::new();
    let mut unrepaired = Vec::new();
    for img in &ins.images {
        if img.facts.non_unique.is_none() {
            continue;
        }
        let why = if img.depth > 1 {
            Some("inside a nested index")
        } else if !img.facts.repairable || !is_image_manifest(&img.manifest) {
            Some("config not a JSON object")
        } else {
            None
        };
        if let Some(why) = why {
            unrepaired.push((img.manifest.digest.to_string(), why));
            continue;
        }
        let new_config = repair_config(&img.config, &img.facts.config, &img.facts.layers)?;
        let digest = sha256_digest(&new_config);
        let desc = Descriptor {
            media_type: img.facts.config.media_type.clone(),
            digest: digest.to_string(),
            size: new_config.len() as u64,
            platform: None,
            urls: None,
        };
        let m = repair_manifest(&img.manifest, (&digest, desc.size))?;
        replaced.insert(
            img.manifest.digest.to_string(),
            (m.digest.clone(), m.bytes.len() as u64),
        );
        replaced_configs.push((img.facts.config.digest.clone(), desc.digest.clone()));
        configs.push((desc, Bytes::from(new_config)));
        children.push(m);
    }
    if replaced.is_empty() {
        return Ok((None, unrepaired));
    }
    let top = match ins.top.kind {
        ManifestKind::Image { .. } => children.pop().expect("one repaired image"),
        ManifestKind::Index { .. } => repair_index(&ins.top, &replaced)?,
    };
    Ok((
        Some(Repair {
            original: ins.top.digest.clone(),
            top,
            children,
            configs,
            replaced_configs,
        }),
        unrepaired,
    ))
}

/// One manifest seen with a config.
#[derive(Debug, Clone)]
struct Seen {
    manifest: String,
    layers: Vec<String>,
    references: BTreeSet<String>,
}

/// A finding about one image manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The config digest (image ID).
    pub config: String,
    /// The manifest it was found on.
    pub manifest: String,
    /// Why the config is non-unique on first sight, if it is.
    pub non_unique: Option<String>,
    /// Other references seen with this config but different layers (a
    /// collision), sorted.
    pub colliding: Vec<String>,
}

impl Finding {
    /// `collision` when colliding references are known, else `non_unique`.
    pub fn kind(&self) -> &'static str {
        if self.colliding.is_empty() {
            "non_unique"
        } else {
            "collision"
        }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "image ID (config {}) ", self.config)?;
        match &self.non_unique {
            Some(why) => write!(f, "is not unique: {why}")?,
            None => write!(f, "is shared")?,
        }
        if !self.colliding.is_empty() {
            let named = self
                .colliding
                .iter()
                .take(NAMED_IN_TEXT)
                .cloned()
                .collect::<Vec<_>>();
            write!(f, "; collides with {}", named.join(", "))?;
            if self.colliding.len() > NAMED_IN_TEXT {
                write!(f, " and {} more", self.colliding.len() - NAMED_IN_TEXT)?;
            }
            write!(f, " (same config, different layers)")?;
        }
        Ok(())
    }
}

/// Config digest → the manifests seen with it. Shared by every entry point
/// of one process; rebuilt from the target at startup.
#[derive(Debug, Default)]
pub struct Record {
    by_config: Mutex<HashMap<String, Vec<Seen>>>,
}

/// At most this many references are kept per (config, layer list), so a
/// config shared by thousands of tags cannot grow the record without bound.
const MAX_REFERENCES: usize = 16;
/// At most this many layer lists are kept per config (every ORAS artifact
/// shares `{}`); a collision is already certain with two.
const MAX_LAYER_LISTS: usize = 64;
/// At most this many configs are recorded; beyond it, new configs are
/// judged (first sight) but not remembered.
const MAX_CONFIGS: usize = 100_000;
/// Colliding references named in a finding's text; the rest are counted.
const NAMED_IN_TEXT: usize = 5;

impl Record {
    /// Records `facts` as seen under `reference` and returns the finding,
    /// if any: non-unique on first sight, and a collision when the same
    /// config was seen with a different layer list (never for a
    /// content-bearing config: same config, same uncompressed content).
    pub fn observe(&self, reference: &str, facts: &Facts) -> Option<Finding> {
        self.judge(reference, facts, true)
    }

    /// As [`Record::observe`] without recording anything (dry runs).
    pub fn peek(&self, reference: &str, facts: &Facts) -> Option<Finding> {
        self.judge(reference, facts, false)
    }

    fn judge(&self, reference: &str, facts: &Facts, record: bool) -> Option<Finding> {
        let mut map = self.by_config.lock().expect("identity record lock");
        if record && (map.len() < MAX_CONFIGS || map.contains_key(&facts.config.digest)) {
            let seen = map.entry(facts.config.digest.clone()).or_default();
            match seen.iter().position(|s| s.layers == facts.layers) {
                Some(i) => {
                    let refs = &mut seen[i].references;
                    if refs.len() < MAX_REFERENCES {
                        refs.insert(reference.to_owned());
                    }
                }
                None if seen.len() < MAX_LAYER_LISTS => seen.push(Seen {
                    manifest: facts.manifest.clone(),
                    layers: facts.layers.clone(),
                    references: BTreeSet::from([reference.to_owned()]),
                }),
                None => {}
            }
        }
        let colliding: Vec<String> = match (facts.content_bearing, map.get(&facts.config.digest)) {
            (false, Some(seen)) => {
                let mut refs: Vec<String> = seen
                    .iter()
                    .filter(|s| s.layers != facts.layers)
                    .map(|s| {
                        s.references
                            .iter()
                            .next()
                            .cloned()
                            .unwrap_or_else(|| s.manifest.clone())
                    })
                    .collect();
                refs.sort();
                refs
            }
            _ => Vec::new(),
        };
        (facts.non_unique.is_some() || !colliding.is_empty()).then(|| Finding {
            config: facts.config.digest.clone(),
            manifest: facts.manifest.clone(),
            non_unique: facts.non_unique.clone(),
            colliding,
        })
    }

    /// How many distinct config digests are recorded.
    pub fn configs(&self) -> usize {
        self.by_config.lock().expect("identity record lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN_CONFIG: &[u8] =
        br#"{"architecture":"wasm","os":"wasip1","rootfs":{"type":"layers","diff_ids":[]}}"#;

    fn desc(media_type: &str, bytes: &[u8]) -> Descriptor {
        Descriptor {
            media_type: media_type.into(),
            digest: sha256_digest(bytes).to_string(),
            size: bytes.len() as u64,
            platform: None,
            urls: None,
        }
    }

    fn layer(n: u8) -> Descriptor {
        desc("application/vnd.wasm.content.layer.v1+wasm", &[n; 8])
    }

    #[test]
    fn the_known_configs_are_what_the_issue_says() {
        assert_eq!(SPIN_CONFIG.len(), 78);
        assert_eq!(sha256_digest(SPIN_CONFIG).to_string(), KNOWN_SHARED[0].0);
        assert_eq!(sha256_digest(b"{}").to_string(), KNOWN_SHARED[1].0);
    }

    #[test]
    fn spin_configs_are_non_unique_and_collide_across_apps() {
        let c = desc(IMAGE_CONFIGS[0], SPIN_CONFIG);
        let r = Record::default();
        let a = assess("sha256:a", &c, &[layer(1)], SPIN_CONFIG);
        assert!(!a.content_bearing && a.repairable);
        let f = r.observe("m/spin/hello:v1", &a).unwrap();
        assert!(f.non_unique.as_deref().unwrap().contains("before Spin 2.4"));
        assert!(f.colliding.is_empty(), "first sight");
        // The same manifest under another tag is not a collision.
        let f = r.observe("m/spin/hello:latest", &a).unwrap();
        assert!(f.colliding.is_empty());
        let b = assess("sha256:b", &c, &[layer(2)], SPIN_CONFIG);
        let f = r.observe("m/spin/other:w", &b).unwrap();
        assert_eq!(f.colliding, ["m/spin/hello:latest"]);
        assert_eq!(f.kind(), "collision");
        assert!(
            f.to_string().contains("collides with m/spin/hello:latest"),
            "{f}"
        );
    }

    #[test]
    fn configs_with_diff_ids_are_one_image_id_legitimately() {
        let cfg = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:1111"]}}"#;
        let c = desc(IMAGE_CONFIGS[0], cfg);
        let r = Record::default();
        // Same rootfs, different compression: different layer digests.
        assert_eq!(
            r.observe("m/a:1", &assess("sha256:a", &c, &[layer(1)], cfg)),
            None
        );
        assert_eq!(
            r.observe("m/b:1", &assess("sha256:b", &c, &[layer(2)], cfg)),
            None
        );
    }

    #[test]
    fn configs_naming_a_layer_or_labelled_are_content_bearing() {
        let l = layer(3);
        let names = format!(r#"{{"layers":["{}"]}}"#, l.digest);
        let c = desc("application/x-custom+json", names.as_bytes());
        assert!(assess("sha256:a", &c, std::slice::from_ref(&l), names.as_bytes()).content_bearing);
        let helm = br#"{"name":"chart","version":"1.0.0","apiVersion":"v2"}"#;
        let h = assess(
            "sha256:h",
            &desc("application/vnd.cncf.helm.config.v1+json", helm),
            std::slice::from_ref(&l),
            helm,
        );
        assert!(
            h.non_unique.is_some(),
            "a Helm config carries no layer content"
        );
        let none = assess("sha256:n", &desc("application/x", b"{}"), &[], b"{}");
        assert!(
            none.non_unique.is_some(),
            "the empty config is known shared"
        );
        let bare = assess(
            "sha256:n",
            &desc("application/x", b"{\"a\":1}"),
            &[],
            b"{\"a\":1}",
        );
        assert_eq!(bare.non_unique, None, "no layers, nothing to confuse");
    }

    #[test]
    fn repair_labels_image_configs_under_labels_and_others_at_the_top() {
        let layers = vec![layer(1).digest, layer(2).digest];
        let spin =
            repair_config(SPIN_CONFIG, &desc(IMAGE_CONFIGS[0], SPIN_CONFIG), &layers).unwrap();
        let v: Value = serde_json::from_slice(&spin).unwrap();
        let want = content_digest(&layers).to_string();
        assert_eq!(v["config"]["Labels"][CONTENT_LABEL], want.as_str());
        assert_eq!(v["architecture"], "wasm", "the rest is kept");
        assert!(
            String::from_utf8(spin.clone())
                .unwrap()
                .starts_with(r#"{"architecture":"wasm","os":"wasip1""#),
            "key order kept"
        );
        let oras = repair_config(
            b"{}",
            &desc("application/vnd.oci.empty.v1+json", b"{}"),
            &layers,
        )
        .unwrap();
        assert_eq!(
            oras,
            format!(r#"{{"{CONTENT_LABEL}":"{want}"}}"#).into_bytes()
        );
        // Deterministic, and the repaired config is never flagged again.
        assert_eq!(
            repair_config(SPIN_CONFIG, &desc(IMAGE_CONFIGS[0], SPIN_CONFIG), &layers).unwrap(),
            spin
        );
        let d = desc(IMAGE_CONFIGS[0], &spin);
        let l: Vec<Descriptor> = vec![layer(1), layer(2)];
        assert!(assess("sha256:r", &d, &l, &spin).non_unique.is_none());
        assert_eq!(
            repair_config(
                b"\x00binary",
                &desc("application/octet-stream", b"\x00binary"),
                &layers
            ),
            Err(IdentityError::NotJson(
                sha256_digest(b"\x00binary").to_string()
            ))
        );
        // Different layer orders give different labels.
        let rev: Vec<String> = layers.iter().rev().cloned().collect();
        assert_ne!(content_digest(&rev), content_digest(&layers));
    }

    #[test]
    fn repaired_manifests_and_indexes_point_at_the_new_content() {
        let cfg = desc(IMAGE_CONFIGS[0], SPIN_CONFIG);
        let l = layer(1);
        let body = serde_json::json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": cfg.media_type, "digest": cfg.digest, "size": cfg.size},
            "layers": [{"mediaType": l.media_type, "digest": l.digest, "size": l.size}]
        });
        let bytes = Bytes::from(serde_json::to_vec(&body).unwrap());
        let m = RawManifest::parse(bytes.clone(), sha256_digest(&bytes), None).unwrap();
        let new_cfg = sha256_digest(b"new");
        let r = repair_manifest(&m, (&new_cfg, 3)).unwrap();
        let ManifestKind::Image { config, layers } = &r.kind else {
            panic!()
        };
        assert_eq!((config.digest.as_str(), config.size), (new_cfg.as_str(), 3));
        assert_eq!(layers[0], l, "layers unchanged");
        let v: Value = serde_json::from_slice(&r.bytes).unwrap();
        assert_eq!(v["annotations"][REPAIRED_FROM], m.digest.as_str());
        assert_eq!(
            repair_manifest(&m, (&new_cfg, 3)).unwrap().digest,
            r.digest,
            "deterministic"
        );

        let idx = serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{"mediaType": OCI_MANIFEST, "digest": m.digest.to_string(), "size": m.bytes.len(),
                           "platform": {"os": "wasip1", "architecture": "wasm"}}]});
        let ib = Bytes::from(serde_json::to_vec(&idx).unwrap());
        let i = RawManifest::parse(ib.clone(), sha256_digest(&ib), None).unwrap();
        let replaced = HashMap::from([(
            m.digest.to_string(),
            (r.digest.clone(), r.bytes.len() as u64),
        )]);
        let ri = repair_index(&i, &replaced).unwrap();
        let ManifestKind::Index { manifests } = &ri.kind else {
            panic!()
        };
        assert_eq!(manifests[0].digest, r.digest.as_str());
        assert_eq!(
            manifests[0].platform.as_ref().unwrap().os,
            "wasip1",
            "platform kept"
        );
    }
}
