//! The copy engine: one image (manifest, index or artifact) from a source to
//! a destination, byte-exact (docs/architecture.md §3 "Copy", §5).
//!
//! Order of work, so an interrupted copy leaves nothing that looks complete:
//! blobs first (skipped when present, mounted when possible, else streamed and
//! verified), then child manifests by digest, then the top manifest by tag.
//! Manifests are pushed as the bytes the source served; the only manifest we
//! write ourselves is a platform-filtered index.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use super::auth::Credentials;
use super::check::sha256_digest;
use super::client::{ClientPool, Registry, Role};
use super::layout::Layout;
use super::locations::BlobLocations;
use super::manifest::{Descriptor, ManifestKind, RawManifest, filter_index};
use super::rate::{TooSlow, TransferFloor, floored};
use super::session::BlobStream;
use super::slots::{FairSlots, SlotPermit};
use super::upload::Mount;
use super::{RegistryError, Result};
use crate::platform::PlatformSpec;
use crate::reference::{Reference, ReferenceError};

/// One side of a copy: `docker://REF` or `oci:DIR[:REF]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A registry reference.
    Registry(Reference),
    /// An OCI layout directory and an optional `ref.name`.
    Layout {
        /// The directory.
        dir: PathBuf,
        /// The `org.opencontainers.image.ref.name`, if any.
        name: Option<String>,
    },
}

/// Why an endpoint string is not valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    /// Neither `docker://` nor `oci:`.
    #[error(
        "{0:?}: expected docker://REFERENCE, oci:DIR[:REF], or a bare REFERENCE; a bare one may not start with another transport (dir:, docker-archive:, …), which pinswap does not support"
    )]
    Transport(String),
    /// `user:password@` in a reference; never echoed.
    #[error(
        "credentials in a docker:// reference are not supported (and not echoed); use --src-creds/--dest-creds or --authfile"
    )]
    Credentials,
    /// An `oci:DIR:REF` whose REF breaks the image-layout `ref.name` grammar.
    #[error(
        "{0:?}: REF must match the OCI image-layout ref.name grammar: components of [A-Za-z0-9] joined by one of -._:@+ or --, separated by /"
    )]
    LayoutRef(String),
    /// `oci:` with an empty directory.
    #[error("{0:?}: oci: needs a directory, as oci:DIR[:REF]")]
    EmptyDir(String),
    /// The reference after `docker://` is invalid.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
}

impl std::str::FromStr for Endpoint {
    type Err = EndpointError;
    /// `docker://REF` (normalised as Docker does) or `oci:DIR[:REF]`; as in
    /// skopeo, the directory ends at the first `:`.
    fn from_str(s: &str) -> std::result::Result<Self, EndpointError> {
        let registry = |r: &str| {
            // `user:password@host/...` must not reach an error message.
            if let Some((_, after)) = r.rsplit_once('@')
                && (!after.contains(':') || after.contains('/'))
            {
                return Err(EndpointError::Credentials);
            }
            Ok(Self::Registry(Reference::parse(r)?))
        };
        if let Some(r) = s.strip_prefix("docker://") {
            return registry(r);
        }
        if let Some(rest) = s.strip_prefix("oci:") {
            let (dir, name) = match rest.split_once(':') {
                Some((d, n)) => (d, Some(n.to_owned()).filter(|n| !n.is_empty())),
                None => (rest, None),
            };
            if dir.is_empty() {
                return Err(EndpointError::EmptyDir(s.to_owned()));
            }
            if let Some(n) = &name
                && !is_layout_ref(n)
            {
                return Err(EndpointError::LayoutRef(s.to_owned()));
            }
            return Ok(Self::Layout {
                dir: PathBuf::from(dir),
                name,
            });
        }
        // A bare reference is `docker://` unless it names one of skopeo's
        // other transports, which `docker-daemon:nginx` would otherwise
        // silently become (repository `docker-daemon`, tag `nginx`).
        let transport = s.split_once(':').map(|(t, _)| t);
        if transport.is_some_and(|t| OTHER_TRANSPORTS.contains(&t)) {
            return Err(EndpointError::Transport(s.to_owned()));
        }
        registry(s)
    }
}

/// skopeo's transports other than `docker://` and `oci:`.
const OTHER_TRANSPORTS: &[&str] = &[
    "containers-storage",
    "dir",
    "docker",
    "docker-archive",
    "docker-daemon",
    "oci-archive",
    "ostree",
    "sif",
    "tarball",
];

/// image-spec §image-layout `org.opencontainers.image.ref.name`:
/// `ref ::= component ("/" component)*`, `component ::= alphanum (separator
/// alphanum)*`, `alphanum ::= [A-Za-z0-9]+`, `separator ::= [-._:@+] | "--"`.
pub fn is_layout_ref(r: &str) -> bool {
    r.split('/').all(|component| {
        let b = component.as_bytes();
        if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric()
        {
            return false;
        }
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_alphanumeric() {
                i += 1;
                continue;
            }
            let sep = if b[i] == b'-' && b.get(i + 1) == Some(&b'-') {
                2
            } else {
                1
            };
            if sep == 1 && !b"-._:@+".contains(&b[i]) {
                return false;
            }
            i += sep;
            if !b.get(i).is_some_and(u8::is_ascii_alphanumeric) {
                return false;
            }
        }
        true
    })
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Registry(r) => write!(f, "docker://{r}"),
            Self::Layout { dir, name: None } => write!(f, "oci:{}", dir.display()),
            Self::Layout { dir, name: Some(n) } => write!(f, "oci:{}:{n}", dir.display()),
        }
    }
}

/// Errors of a copy.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// Registry or layout failure.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// OCI layout failure.
    #[error(transparent)]
    Layout(#[from] super::layout::LayoutError),
    /// The destination names a digest that is not the source's.
    #[error("destination {destination} pins digest {wanted}, but the source manifest is {actual}")]
    DestinationDigest {
        /// The destination.
        destination: String,
        /// Its digest.
        wanted: String,
        /// The source's.
        actual: String,
    },
    /// A blob failed while streaming (read error, digest or size mismatch).
    #[error("blob {digest} from {source_name}: {reason}")]
    Blob {
        /// The blob digest.
        digest: String,
        /// Where it came from.
        source_name: String,
        /// Why.
        reason: String,
    },
    /// A blob came more slowly than the transfer-rate floor and was cut.
    #[error("blob {digest} from {source_name} cut short: {why}")]
    TooSlow {
        /// The blob digest.
        digest: String,
        /// Where it came from.
        source_name: String,
        /// What the last window carried.
        why: TooSlow,
    },
    /// The copy ran past its deadline and was cut (`copy.timeout`); nothing
    /// of it that looks complete was written.
    #[error("copy cut short: not done within {} (copy.timeout)", humantime::format_duration(*after))]
    Deadline {
        /// The deadline.
        after: Duration,
    },
}

impl CopyError {
    /// Why pinswap cut this copy short, as the `reason` label of
    /// `pinswap_copies_cut_total`: `deadline` or `transfer_rate`; `None`
    /// for any other failure.
    pub fn cut_reason(&self) -> Option<&'static str> {
        match self {
            Self::TooSlow { .. } => Some("transfer_rate"),
            Self::Deadline { .. } => Some("deadline"),
            _ => None,
        }
    }
}

/// What a copy did. Serialised for `--json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CopyReport {
    /// The source, as given.
    pub source: String,
    /// The destination, as given.
    pub destination: String,
    /// Digest of the top manifest at the destination.
    pub digest: String,
    /// Its mediaType (for an up-to-date registry copy, the `Content-Type`
    /// the destination answered to its HEAD; `null` if it sent none).
    pub media_type: Option<String>,
    /// Manifests pushed (top and children); 0 for an up-to-date copy.
    pub manifests_pushed: u64,
    /// Blobs streamed from the source.
    pub blobs_copied: u64,
    /// Blobs the destination already had.
    pub blobs_skipped: u64,
    /// Blobs cross-repository mounted.
    pub blobs_mounted: u64,
    /// Bytes streamed (sum of copied blobs' sizes).
    pub bytes_copied: u64,
    /// True when the destination already had this manifest under that tag.
    pub up_to_date: bool,
    /// Wall time, seconds.
    pub duration_seconds: f64,
    /// The source's manifest digest (the destination's `digest` differs
    /// for a platform-filtered index).
    #[serde(skip)]
    pub source_digest: String,
    /// What following the image's referrers did, when it was asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referrers: Option<ReferrersReport>,
}

/// What one follow of an image's referrers did (`referrers.rs`), part of
/// a [`CopyReport`]. Serialised for `--json`.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ReferrersReport {
    /// Referrer manifests pushed to the target.
    pub copied: u64,
    /// Referrers the target already had.
    pub present: u64,
    /// Referrers left out by the allowlist, or of a type not copied.
    pub skipped: u64,
    /// Referrers (or lists of them) that could not be copied.
    pub failed: u64,
    /// Fallback tag indexes written at the target.
    pub indexes_written: u64,
    /// True when the count or depth bound stopped the walk.
    pub truncated: bool,
    /// The first errors, each naming the tag or digest.
    pub errors: Vec<String>,
}

#[derive(Default)]
struct Stats {
    manifests: AtomicU64,
    copied: AtomicU64,
    skipped: AtomicU64,
    mounted: AtomicU64,
    bytes: AtomicU64,
}

/// Copy settings.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Blobs in flight at once (`--jobs`), at least 1.
    pub jobs: usize,
    /// Index children to keep; empty keeps all.
    pub platforms: Vec<PlatformSpec>,
    /// Draw a progress bar per streamed blob.
    pub progress: bool,
    /// Do not trust the target's tag: check every child manifest and blob
    /// (HEAD) and restore whatever is missing, even when the tag already has
    /// the source's digest.
    pub verify_target: bool,
    /// Of the `jobs` slots, at most this many for one source registry
    /// (`None`: all of them), so a slow source cannot hold every slot
    /// ([`super::slots`]).
    pub jobs_per_source: Option<usize>,
    /// Cut a blob transfer slower than this ([`super::rate`]); `None`: no
    /// floor.
    pub min_transfer_rate: Option<TransferFloor>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        Self {
            jobs: 4,
            platforms: Vec::new(),
            progress: false,
            verify_target: false,
            jobs_per_source: None,
            min_transfer_rate: None,
        }
    }
}

#[derive(Clone)]
enum Side {
    Registry {
        client: Arc<Registry>,
        reference: Reference,
    },
    Layout {
        layout: Arc<Layout>,
        name: Option<String>,
    },
}

impl Side {
    fn describe(&self) -> String {
        match self {
            Side::Registry { reference, .. } => reference.to_string(),
            Side::Layout { layout, name } => match name {
                Some(n) => format!("oci:{}:{n}", layout.dir().display()),
                None => format!("oci:{}", layout.dir().display()),
            },
        }
    }
}

/// The repository holding a blob in one target registry, once known.
type Holder = Arc<Mutex<Option<String>>>;

/// A copy's use of a ledger entry; the last one done removes it, on every
/// path (done, failed, cancelled).
struct LedgerEntry<'a> {
    ledger: &'a std::sync::Mutex<HashMap<(String, String), Holder>>,
    key: (String, String),
    cell: Holder,
}

impl Drop for LedgerEntry<'_> {
    fn drop(&mut self) {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        // The map's clone and ours: nobody else waits for this blob. New
        // users clone under the same lock, so none can slip in between.
        if Arc::strong_count(&self.cell) == 2 {
            ledger.remove(&self.key);
        }
    }
}

/// Async locks by key, dropped from the map once nobody holds or waits on
/// them.
///
/// Why: Distribution's filesystem driver writes a manifest's revision link
/// in place (truncate, then write). Two concurrent PUTs of one manifest to
/// one repository (two tags of one image, or one child shared by two
/// indexes, copied at once) can leave a reader seeing an empty link, and
/// the index PUT then fails with DIGEST_INVALID / MANIFEST_BLOB_UNKNOWN.
/// One process never PUTs the same (registry, repository, digest) twice at
/// once.
#[derive(Default)]
struct KeyedLocks(std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>);

struct KeyedGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
    cell: Arc<Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeyedLocks {
    async fn lock(&self, key: String) -> KeyedGuard<'_> {
        let cell = self
            .0
            .lock()
            .expect("locks map")
            .entry(key.clone())
            .or_default()
            .clone();
        let guard = Some(cell.clone().lock_owned().await);
        KeyedGuard {
            locks: self,
            key,
            cell,
            guard,
        }
    }
}

impl Drop for KeyedGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.0.lock().expect("locks map");
        // The map's reference and ours: nobody else waits.
        if Arc::strong_count(&self.cell) <= 2 {
            map.remove(&self.key);
        }
    }
}

/// Work to do before the first push into a target repository, such as
/// creating an ECR repository (ECR refuses pushes to missing ones).
pub trait BeforePush: Send + Sync {
    /// Called before anything is pushed to `repository` on `registry`
    /// (`host[:port]`); pushes to registries it does not own are no-ops.
    ///
    /// # Errors
    /// [`RegistryError::Prepare`] naming the repository; the copy then
    /// stops before any push.
    fn before_push<'a>(
        &'a self,
        registry: &'a str,
        repository: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<(), RegistryError>>;
}

/// The copy engine. One value serves many copies: it shares clients, bounds
/// blob parallelism across all of them, and remembers which target
/// repository already holds a blob so later images mount instead of
/// re-streaming it.
pub struct Copier {
    pool: Arc<ClientPool>,
    opts: CopyOptions,
    /// `--jobs` slots, keyed by source registry.
    slots: FairSlots,
    /// (target registry, digest) → repository that has it, while copies
    /// of that blob run: the mutex makes concurrent copies of one blob wait
    /// for the first. An entry goes when its last copy is done (the
    /// repository stays in `locations`, which is bounded), so the ledger
    /// holds only blobs in flight.
    ledger: Arc<std::sync::Mutex<HashMap<(String, String), Holder>>>,
    /// Where blobs live at each target registry, across copies (and, for
    /// the CLI, across processes): mounts come from here.
    locations: Arc<BlobLocations>,
    /// Manifest PUTs in progress, by `host/repository@digest`.
    manifest_puts: KeyedLocks,
    layouts: Mutex<HashMap<PathBuf, Arc<Layout>>>,
    bars: Option<MultiProgress>,
    before_push: Option<Arc<dyn BeforePush>>,
    /// Counts copies cut short (`pinswap_copies_cut_total`), when set.
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Copier {
    /// Blobs in the ledger: those copies are writing now.
    pub fn blobs_in_flight(&self) -> usize {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A copier using `pool` for registries.
    pub fn new(pool: Arc<ClientPool>, opts: CopyOptions) -> Self {
        let jobs = opts.jobs.max(1);
        Self {
            pool,
            slots: FairSlots::new(jobs, opts.jobs_per_source.unwrap_or(jobs)),
            bars: opts.progress.then(MultiProgress::new),
            opts,
            ledger: Arc::default(),
            locations: Arc::new(BlobLocations::in_memory()),
            manifest_puts: KeyedLocks::default(),
            layouts: Mutex::default(),
            before_push: None,
            metrics: None,
        }
    }

    /// This copier, counting copies it cuts short in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// A slot for a request to source `s`.
    async fn slot(&self, s: &Side) -> SlotPermit {
        self.slots.acquire(&side_registry(s)).await
    }

    /// This copier, using `layout` for every endpoint naming its directory
    /// (a layout opened in a mode of its own, [`Layout::create_blobs_only`]
    /// or [`Layout::open_indexed`]).
    pub fn with_layout(mut self, layout: Arc<Layout>) -> Self {
        let dir = layout.dir().to_owned();
        self.layouts.get_mut().insert(dir, layout);
        self
    }

    /// This copier, mounting from and recording into `locations` (the
    /// CLI's on-disk cache) instead of a map of its own.
    pub fn with_locations(mut self, locations: Arc<BlobLocations>) -> Self {
        self.locations = locations;
        self
    }

    /// This copier, calling `hook` before pushing into a registry
    /// repository.
    pub fn with_before_push(mut self, hook: Arc<dyn BeforePush>) -> Self {
        self.before_push = Some(hook);
        self
    }

    /// PUTs `manifest` to `r` (under its tag, or by digest when it has none)
    /// under the per-manifest lock every copy uses, so one process never
    /// PUTs one manifest twice at once. By digest, a manifest already there
    /// is left alone.
    ///
    /// # Errors
    /// Registry errors.
    pub async fn put_manifest(
        &self,
        client: &Registry,
        r: &Reference,
        manifest: &RawManifest,
    ) -> Result<()> {
        let key = format!("{}/{}@{}", client.host(), r.repository(), manifest.digest);
        let _put = self.manifest_puts.lock(key).await;
        if r.tag().is_none()
            && client
                .manifest_digest(&r.with_digest(manifest.digest.clone()))
                .await?
                .is_some()
        {
            return Ok(());
        }
        client.push_manifest(r, manifest).await
    }

    /// Tags manifest `digest` of `tagged`'s repository with `tagged`'s tag:
    /// read back by digest and PUT under the tag, both under the
    /// per-manifest lock, since a GET while another PUT of that manifest
    /// rewrites it can read it half-written (a 500 from Distribution).
    ///
    /// # Errors
    /// Registry errors.
    pub async fn tag_manifest(
        &self,
        client: &Registry,
        tagged: &Reference,
        digest: &crate::reference::Digest,
    ) -> Result<()> {
        let key = format!("{}/{}@{digest}", client.host(), tagged.repository());
        let _put = self.manifest_puts.lock(key).await;
        let by_digest = tagged.without_tag().with_digest(digest.clone());
        let manifest = client.get_manifest(&by_digest).await?;
        client
            .push_manifest(&tagged.without_digest(), &manifest)
            .await
    }

    /// The client pool this copier reads and writes through.
    pub fn pool(&self) -> &Arc<ClientPool> {
        &self.pool
    }

    /// Whether a platform list filters indexes (so a copy's top digest can
    /// differ from the source's).
    pub fn filters_platforms(&self) -> bool {
        !self.opts.platforms.is_empty()
    }

    async fn layout(&self, dir: &PathBuf, create: bool) -> Result<Arc<Layout>> {
        let mut map = self.layouts.lock().await;
        if let Some(l) = map.get(dir) {
            return Ok(l.clone());
        }
        let l = Arc::new(if create {
            Layout::create(dir)?
        } else {
            Layout::open(dir)?
        });
        map.insert(dir.clone(), l.clone());
        Ok(l)
    }

    async fn side(&self, e: &Endpoint, role: Role, creds: Option<&Credentials>) -> Result<Side> {
        Ok(match e {
            Endpoint::Registry(r) => Side::Registry {
                client: self.pool.get_with(r.registry(), role, creds).await?,
                reference: r.clone(),
            },
            Endpoint::Layout { dir, name } => Side::Layout {
                layout: self.layout(dir, role == Role::Target).await?,
                name: name.clone(),
            },
        })
    }

    /// The source's manifest digest, and its `index.json` descriptor for a
    /// layout.
    async fn resolve_source(
        &self,
        s: &Side,
    ) -> std::result::Result<(crate::reference::Digest, Option<Descriptor>), CopyError> {
        Ok(match s {
            Side::Registry { client, reference } => match reference.digest() {
                Some(d) => (d.clone(), None),
                None => match client.manifest_digest(reference).await? {
                    Some(d) => (d, None),
                    // HEAD has no body; GET brings the registry's own error
                    // code (MANIFEST_UNKNOWN, NAME_UNKNOWN, ...).
                    None => {
                        let m = client.get_manifest(reference).await?;
                        (m.digest, None)
                    }
                },
            },
            Side::Layout { layout, name } => {
                let desc = layout.resolve(name.as_deref()).await?;
                let d = crate::reference::Digest::parse(&desc.digest).map_err(|e| {
                    super::layout::LayoutError::Invalid {
                        path: layout.dir().to_owned(),
                        reason: e.to_string(),
                    }
                })?;
                (d, Some(desc))
            }
        })
    }

    /// The digest a copy of `src` has at its destination: the source's
    /// manifest digest, or, when `platforms` filters an index, the digest of
    /// the filtered index (computed, nothing pushed).
    ///
    /// # Errors
    /// As [`Copier::copy`] for reading the source.
    pub async fn planned_digest(
        &self,
        src: &Endpoint,
        source_creds: Option<&Credentials>,
    ) -> std::result::Result<crate::reference::Digest, CopyError> {
        let s = self.side(src, Role::Source, source_creds).await?;
        let (digest, desc) = self.resolve_source(&s).await?;
        if self.opts.platforms.is_empty() {
            return Ok(digest);
        }
        let manifest = self.source_manifest(&s, &digest, desc.as_ref()).await?;
        let ManifestKind::Index { manifests } = &manifest.kind else {
            return Ok(digest);
        };
        let (bytes, kept) =
            filter_index(&manifest, &self.opts.platforms).map_err(|e| RegistryError::Manifest {
                registry: side_registry(&s),
                reference: s.describe(),
                reason: e.to_string(),
            })?;
        Ok(if kept.len() == manifests.len() {
            digest
        } else {
            sha256_digest(&bytes)
        })
    }

    /// Copies `src` to `dst`.
    ///
    /// A layout destination without a name takes the source's tag as its
    /// `ref.name`. A registry destination pinned by digest must name the
    /// source's digest.
    ///
    /// # Errors
    /// [`CopyError::Registry`] for registry and layout failures (each names
    /// the registry, reference, status and code), [`CopyError::Blob`] when a
    /// blob's bytes are wrong, [`CopyError::DestinationDigest`]. On error no
    /// top manifest has been pushed.
    pub async fn copy(
        &self,
        src: &Endpoint,
        dst: &Endpoint,
    ) -> std::result::Result<CopyReport, CopyError> {
        self.copy_with(src, dst, None).await
    }

    /// As [`Copier::copy`], reading the source with `source_creds` (a Pod's
    /// imagePullSecrets) instead of the configured credentials.
    ///
    /// # Errors
    /// As [`Copier::copy`].
    pub async fn copy_with(
        &self,
        src: &Endpoint,
        dst: &Endpoint,
        source_creds: Option<&Credentials>,
    ) -> std::result::Result<CopyReport, CopyError> {
        let res = self.copy_once(src, dst, source_creds).await;
        if let (Err(e), Some(m)) = (&res, &self.metrics)
            && let Some(reason) = e.cut_reason()
        {
            m.copy_cut(reason);
        }
        res
    }

    async fn copy_once(
        &self,
        src: &Endpoint,
        dst: &Endpoint,
        source_creds: Option<&Credentials>,
    ) -> std::result::Result<CopyReport, CopyError> {
        let start = Instant::now();
        let s = self.side(src, Role::Source, source_creds).await?;
        let d = self.side(dst, Role::Target, None).await?;
        let stats = Stats::default();

        let (src_digest, src_desc) = self.resolve_source(&s).await?;

        let report = |digest: String,
                      media_type: Option<String>,
                      up_to_date: bool,
                      stats: &Stats| CopyReport {
            source: src.to_string(),
            destination: dst.to_string(),
            digest,
            media_type,
            manifests_pushed: stats.manifests.load(Ordering::Relaxed),
            blobs_copied: stats.copied.load(Ordering::Relaxed),
            blobs_skipped: stats.skipped.load(Ordering::Relaxed),
            blobs_mounted: stats.mounted.load(Ordering::Relaxed),
            bytes_copied: stats.bytes.load(Ordering::Relaxed),
            up_to_date,
            duration_seconds: start.elapsed().as_secs_f64(),
            source_digest: src_digest.to_string(),
            referrers: None,
        };

        // Warm path: the destination already has this digest under its name.
        if self.opts.platforms.is_empty()
            && !self.opts.verify_target
            && let Some((existing, dest_type)) = self.dest_top_digest(&d, &s).await?
            && existing == src_digest.as_str()
        {
            info!(source = %src, destination = %dst, digest = %src_digest, "destination is up to date");
            let media_type = src_desc
                .as_ref()
                .map(|d| d.media_type.clone())
                .filter(|m| !m.is_empty())
                .or(dest_type);
            return Ok(report(src_digest.to_string(), media_type, true, &stats));
        }

        let manifest = self
            .source_manifest(&s, &src_digest, src_desc.as_ref())
            .await?;
        let (top, children) = match (&manifest.kind, self.opts.platforms.is_empty()) {
            (ManifestKind::Index { manifests }, true) => (manifest.clone(), manifests.clone()),
            (ManifestKind::Index { manifests }, false) => {
                let (bytes, kept) = filter_index(&manifest, &self.opts.platforms).map_err(|e| {
                    RegistryError::Manifest {
                        registry: side_registry(&s),
                        reference: s.describe(),
                        reason: e.to_string(),
                    }
                })?;
                let filtered = if kept.len() == manifests.len() {
                    // Every platform matched: nothing to filter, keep the bytes.
                    manifest.clone()
                } else {
                    RawManifest {
                        digest: sha256_digest(&bytes),
                        bytes,
                        media_type: manifest.media_type.clone(),
                        kind: ManifestKind::Index {
                            manifests: kept.clone(),
                        },
                    }
                };
                if !self.opts.verify_target
                    && let Some((existing, _)) = self.dest_top_digest(&d, &s).await?
                    && existing == filtered.digest.as_str()
                {
                    return Ok(report(
                        filtered.digest.to_string(),
                        Some(filtered.media_type),
                        true,
                        &stats,
                    ));
                }
                (filtered, kept)
            }
            (ManifestKind::Image { .. }, filtered) => {
                if !filtered {
                    warn!(source = %src, "--platform ignored: the source is a single manifest, not an index");
                }
                (manifest.clone(), Vec::new())
            }
        };

        if let Side::Registry { reference, .. } = &d
            && let Some(want) = reference.digest()
            && want != &top.digest
        {
            return Err(CopyError::DestinationDigest {
                destination: dst.to_string(),
                wanted: want.to_string(),
                actual: top.digest.to_string(),
            });
        }

        if let (Some(hook), Side::Registry { client, reference }) = (&self.before_push, &d) {
            hook.before_push(client.host(), reference.repository())
                .await?;
        }
        if children.is_empty() {
            self.copy_blobs(&s, &d, &top, &stats).await?;
        } else {
            let futs = children
                .iter()
                .map(|c| self.copy_child(&s, &d, c.clone(), &stats));
            futures::future::try_join_all(futs).await?;
        }
        self.push_top(&d, &s, &top).await?;
        stats.manifests.fetch_add(1, Ordering::Relaxed);
        let r = report(
            top.digest.to_string(),
            Some(top.media_type.clone()),
            false,
            &stats,
        );
        info!(source = %src, destination = %dst, digest = %r.digest, copied = r.blobs_copied, skipped = r.blobs_skipped, mounted = r.blobs_mounted, bytes = r.bytes_copied, "copied");
        Ok(r)
    }

    /// The digest the destination holds under the name we would write.
    /// The destination's digest for the copy, with its mediaType when known.
    async fn dest_top_digest(
        &self,
        d: &Side,
        s: &Side,
    ) -> Result<Option<(String, Option<String>)>> {
        match d {
            // By tag when there is one: a digest alone would say "present"
            // even though the tag is missing or points elsewhere.
            Side::Registry { client, reference } => {
                let by = match reference.tag() {
                    Some(_) => reference.without_digest(),
                    None => reference.clone(),
                };
                let found = client.head_manifest_typed(&by).await?;
                Ok(found.map(|(d, t)| (d.to_string(), t)))
            }
            Side::Layout { layout, name } => {
                let name = name.clone().or_else(|| source_tag(s));
                match layout.resolve(name.as_deref()).await {
                    Ok(desc) if name.is_some() => Ok(Some((
                        desc.digest,
                        Some(desc.media_type).filter(|t| !t.is_empty()),
                    ))),
                    _ => Ok(None),
                }
            }
        }
    }

    async fn source_manifest(
        &self,
        s: &Side,
        digest: &crate::reference::Digest,
        desc: Option<&Descriptor>,
    ) -> Result<RawManifest> {
        match s {
            Side::Registry { client, reference } => {
                client
                    .get_manifest(&reference.with_digest(digest.clone()))
                    .await
            }
            Side::Layout { layout, .. } => {
                let desc = match desc {
                    Some(d) => d.clone(),
                    None => Descriptor {
                        media_type: String::new(),
                        digest: digest.to_string(),
                        size: 0,
                        platform: None,
                        urls: None,
                    },
                };
                Ok(layout.read_manifest(&desc).await?)
            }
        }
    }

    fn copy_child<'a>(
        &'a self,
        s: &'a Side,
        d: &'a Side,
        desc: Descriptor,
        stats: &'a Stats,
    ) -> BoxFuture<'a, std::result::Result<(), CopyError>> {
        async move {
            let digest = crate::reference::Digest::parse(&desc.digest).map_err(|e| {
                RegistryError::Manifest {
                    registry: side_registry(s),
                    reference: s.describe(),
                    reason: format!("index entry: {e}"),
                }
            })?;
            // Held until this child is pushed: a concurrent copy of the
            // same child waits, then finds it present.
            let _put = match d {
                Side::Registry { client, reference } => Some(
                    self.manifest_puts
                        .lock(format!(
                            "{}/{}@{digest}",
                            client.host(),
                            reference.repository()
                        ))
                        .await,
                ),
                Side::Layout { .. } => None,
            };
            let m = {
                // Slots bound these requests too; released before recursing,
                // since the children's blobs need slots of their own.
                let _permit = self.slot(s).await;
                if !self.opts.verify_target && self.dest_has_manifest(d, &digest).await? {
                    debug!(digest = %desc.digest, "child manifest already at destination");
                    return Ok(());
                }
                self.source_manifest(s, &digest, Some(&desc)).await?
            };
            match &m.kind {
                ManifestKind::Index { manifests } => {
                    let futs = manifests
                        .iter()
                        .map(|c| self.copy_child(s, d, c.clone(), stats));
                    futures::future::try_join_all(futs).await?;
                }
                ManifestKind::Image { .. } => self.copy_blobs(s, d, &m, stats).await?,
            }
            let _permit = self.slot(s).await;
            match d {
                Side::Registry { client, reference } => {
                    client
                        .push_manifest(&reference.without_tag().with_digest(digest), &m)
                        .await?
                }
                Side::Layout { layout, .. } => layout.write_manifest(&m).await?,
            }
            stats.manifests.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        .boxed()
    }

    async fn dest_has_manifest(&self, d: &Side, digest: &crate::reference::Digest) -> Result<bool> {
        match d {
            Side::Registry { client, reference } => Ok(client
                .manifest_digest(&reference.without_tag().with_digest(digest.clone()))
                .await?
                .is_some()),
            Side::Layout { layout, .. } => Ok(layout.has_blob(digest.as_str()).await),
        }
    }

    async fn push_top(&self, d: &Side, s: &Side, top: &RawManifest) -> Result<()> {
        match d {
            Side::Registry { client, reference } => {
                let key = format!(
                    "{}/{}@{}",
                    client.host(),
                    reference.repository(),
                    top.digest
                );
                let _put = self.manifest_puts.lock(key).await;
                client.push_manifest(reference, top).await
            }
            Side::Layout { layout, name } => {
                let name = name.clone().or_else(|| source_tag(s));
                Ok(layout.put_top(top, name.as_deref()).await?)
            }
        }
    }

    async fn copy_blobs(
        &self,
        s: &Side,
        d: &Side,
        m: &RawManifest,
        stats: &Stats,
    ) -> std::result::Result<(), CopyError> {
        let futs = m
            .blobs()
            .into_iter()
            .map(|b| self.copy_blob(s, d, b, stats));
        futures::future::try_join_all(futs).await?;
        Ok(())
    }

    async fn copy_blob(
        &self,
        s: &Side,
        d: &Side,
        desc: Descriptor,
        stats: &Stats,
    ) -> std::result::Result<(), CopyError> {
        match d {
            Side::Layout { layout, .. } => {
                if layout.has_blob_of(&desc).await {
                    stats.skipped.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                let _permit = self.slot(s).await;
                let (stream, fault) = self.open_blob(s, &desc).await?;
                let res = layout.write_blob(&desc, stream).await;
                res.map_err(|e| blob_error(s, &desc, &fault, e.into()))?;
            }
            Side::Registry { client, reference } => {
                let key = (client.host().to_owned(), desc.digest.clone());
                let cell = {
                    let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
                    ledger.entry(key.clone()).or_default().clone()
                };
                let entry = LedgerEntry {
                    ledger: &self.ledger,
                    key,
                    cell,
                };
                // Lock order: the blob's holder, then a slot. A slot holder
                // never waits for a holder lock, so this cannot deadlock.
                let mut holder = entry.cell.lock().await;
                let repo = reference.repository();
                // The ledger is a hint for mounts, never proof the blob is
                // still there: a long-running serve outlives registry GC, and
                // a re-mirror after a prune must not skip a collected blob.
                // Every request, HEADs included, runs under a --jobs slot.
                let _permit = self.slot(s).await;
                let host = client.host();
                let held = |holder: &mut Option<String>| {
                    *holder = Some(repo.to_owned());
                    self.locations.record(host, &desc.digest, repo);
                };
                if client.blob_exists(reference, &desc.digest).await? {
                    stats.skipped.fetch_add(1, Ordering::Relaxed);
                    held(&mut holder);
                    return Ok(());
                }
                // Mount from a repository this run already filled, else one
                // remembered from earlier runs, else the source when it is
                // the same registry.
                let mut from: Vec<String> = holder.iter().filter(|h| *h != repo).cloned().collect();
                if let Some(known) = self.locations.get(host, &desc.digest)
                    && known != repo
                    && !from.contains(&known)
                {
                    from.push(known);
                }
                if let Side::Registry {
                    client: sc,
                    reference: sr,
                } = s
                    && sc.host() == host
                    && sr.repository() != repo
                    && !from.iter().any(|f| f == sr.repository())
                {
                    from.push(sr.repository().to_owned());
                }
                for f in &from {
                    match client.mount(reference, f, &desc.digest).await {
                        Mount::Done => {
                            stats.mounted.fetch_add(1, Ordering::Relaxed);
                            held(&mut holder);
                            return Ok(());
                        }
                        // The registry no longer holds it there.
                        Mount::Absent => self.locations.forget(host, &desc.digest, f),
                        Mount::Failed => {}
                    }
                }
                let chunked = client.chunks(desc.size);
                let (stream, fault) = self.open_blob(s, &desc).await?;
                match client.push_blob(reference, &desc, stream).await {
                    Ok(()) => {}
                    // A registry that takes blobs only whole: once more,
                    // whole, from a fresh read of the source.
                    Err(e) if chunked && super::upload::refuses_chunks(&e) => {
                        let (stream, fault) = self.open_blob(s, &desc).await?;
                        let res = client.push_blob(reference, &desc, stream).await;
                        res.map_err(|e| blob_error(s, &desc, &fault, e))?;
                    }
                    Err(e) => return Err(blob_error(s, &desc, &fault, e)),
                }
                held(&mut holder);
            }
        }
        stats.copied.fetch_add(1, Ordering::Relaxed);
        stats.bytes.fetch_add(desc.size, Ordering::Relaxed);
        Ok(())
    }

    /// A blob's bytes from the source, verified (digest and size), metered,
    /// and with a [`Fault`] that records the stream's own error.
    async fn open_blob(&self, s: &Side, desc: &Descriptor) -> Result<(BlobStream, Fault)> {
        let stream = match s {
            // Already checked for size and digest as it streams.
            Side::Registry { client, reference } => client.pull_blob(reference, desc).await?,
            Side::Layout { layout, .. } => layout.read_blob(desc).await?,
        };
        let stream = match self.opts.min_transfer_rate {
            Some(floor) => floored(stream, floor).boxed(),
            None => stream,
        };
        let bar = self.bars.as_ref().map(|bars| {
            // Cleared when the stream is dropped, done or not: the summary
            // line says what happened.
            let bar = bars
                .add(ProgressBar::new(desc.size).with_finish(indicatif::ProgressFinish::AndClear));
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix:.bold} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .expect("static template")
                .progress_chars("=> "),
            );
            bar.set_prefix(short(&desc.digest));
            bar
        });
        let fault = Fault::default();
        let seen = fault.clone();
        let stream = stream
            .inspect(move |r| match r {
                Ok(b) => {
                    if let Some(bar) = &bar {
                        bar.inc(b.len() as u64);
                    }
                }
                Err(e) => {
                    let slow = e.get_ref().and_then(|i| i.downcast_ref::<TooSlow>());
                    seen.0
                        .lock()
                        .expect("fault lock")
                        .get_or_insert_with(|| match slow {
                            Some(why) => Failed::TooSlow(why.clone()),
                            None => Failed::Read(super::chain(e)),
                        });
                    if let Some(bar) = &bar {
                        bar.abandon();
                    }
                }
            })
            .boxed();
        Ok((stream, fault))
    }
}

/// The first error a source blob stream produced. Upload errors caused by a
/// failing source (bad digest, short read, source gone, cut for its rate)
/// show up as vague body errors on the upload side; this names the real
/// cause.
#[derive(Clone, Default)]
struct Fault(Arc<std::sync::Mutex<Option<Failed>>>);

/// What a source blob stream failed with.
enum Failed {
    /// A read error, or wrong bytes, in words.
    Read(String),
    /// Cut by the transfer-rate floor.
    TooSlow(TooSlow),
}

fn blob_error(s: &Side, desc: &Descriptor, fault: &Fault, e: RegistryError) -> CopyError {
    let (digest, source_name) = (desc.digest.clone(), s.describe());
    match fault.0.lock().expect("fault lock").take() {
        Some(Failed::Read(reason)) => CopyError::Blob {
            digest,
            source_name,
            reason,
        },
        Some(Failed::TooSlow(why)) => CopyError::TooSlow {
            digest,
            source_name,
            why,
        },
        None => CopyError::Registry(e),
    }
}

fn short(digest: &str) -> String {
    let hex = digest.split_once(':').map(|(_, h)| h).unwrap_or(digest);
    hex.chars().take(12).collect()
}

fn side_registry(s: &Side) -> String {
    match s {
        Side::Registry { client, .. } => client.host().to_owned(),
        Side::Layout { layout, .. } => format!("oci:{}", layout.dir().display()),
    }
}

fn source_tag(s: &Side) -> Option<String> {
    match s {
        Side::Registry { reference, .. } => reference.tag().map(str::to_owned),
        Side::Layout { name, .. } => name.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        let e: Endpoint = "docker://nginx".parse().unwrap();
        assert_eq!(e.to_string(), "docker://docker.io/library/nginx:latest");
        let e: Endpoint = "oci:/tmp/x:v1".parse().unwrap();
        assert_eq!(
            e,
            Endpoint::Layout {
                dir: "/tmp/x".into(),
                name: Some("v1".into())
            }
        );
        let e: Endpoint = "oci:rel/dir".parse().unwrap();
        assert_eq!(e.to_string(), "oci:rel/dir");
        // A bare reference is a registry reference, normalised the same way.
        assert_eq!(
            "nginx".parse::<Endpoint>().unwrap(),
            "docker://nginx".parse::<Endpoint>().unwrap()
        );
        assert_eq!(
            "127.0.0.1:5000/app:v1"
                .parse::<Endpoint>()
                .unwrap()
                .to_string(),
            "docker://127.0.0.1:5000/app:v1"
        );
        for other in ["docker-daemon:nginx", "dir:/tmp/x", "docker:nginx"] {
            let e = other.parse::<Endpoint>().unwrap_err().to_string();
            assert!(e.contains("a bare REFERENCE") && e.contains(other), "{e}");
        }
        assert!(
            "bob:hunter2@127.0.0.1:5000/app"
                .parse::<Endpoint>()
                .unwrap_err()
                .to_string()
                .contains("--src-creds")
        );
        assert_eq!(
            "oci::x".parse::<Endpoint>().unwrap_err().to_string(),
            "\"oci::x\": oci: needs a directory, as oci:DIR[:REF]"
        );
        assert!("docker://Nginx".parse::<Endpoint>().is_err());
        for bad in [
            "docker://bob:hunter2@127.0.0.1:5000/app:v1",
            "docker://bob:hunter2@host",
        ] {
            let e = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(!e.contains("hunter2") && e.contains("--src-creds"), "{e}");
        }
        let digest = format!("docker://nginx@sha256:{}", "a".repeat(64));
        assert!(digest.parse::<Endpoint>().is_ok());
        for ok in [
            "v1",
            "1.0",
            "a/b-c",
            "x--y",
            "v1.2+build",
            "sha256:abc",
            "a@b",
        ] {
            assert!(is_layout_ref(ok), "{ok}");
        }
        for bad in [
            "has space",
            "../../etc",
            "-x",
            "x-",
            "a//b",
            "a---b",
            "a..b",
            "",
        ] {
            assert!(!is_layout_ref(bad), "{bad}");
        }
        let e = "oci:/tmp/l:has space".parse::<Endpoint>().unwrap_err();
        assert!(e.to_string().contains("ref.name grammar"), "{e}");
    }
}
