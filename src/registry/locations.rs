//! Where a blob already lives at a registry: `(registry, digest)` → the
//! repository that held it last, so a copy into another repository of that
//! registry mounts it (distribution-spec §Mounting a blob) instead of
//! streaming it again, as skopeo's blob-info cache does.
//!
//! A location is a hint, never proof: a mount the registry answers with 202
//! (it does not have the blob there) drops the entry, and the copy streams.
//! `serve` keeps the map in memory; the CLI also loads it from and saves it
//! to a small file under the user's cache directory
//! (`$XDG_CACHE_HOME/pinswap/blob-locations.json`, else
//! `~/.cache/pinswap/…`), bounded to [`MAX_ENTRIES`] entries, the least
//! recently used dropped first. Processes that run at once each merge their
//! changes into what the file holds when they save, and write it through a
//! temporary file and a rename, so a reader never sees a partial file and
//! no process loses more than the other's concurrent changes to one entry.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::debug;

/// Entries kept, in memory and on disk (about 200 bytes each on disk).
pub const MAX_ENTRIES: usize = 10_000;

/// The file's name inside the cache directory.
const FILE_NAME: &str = "blob-locations.json";

/// Errors saving the cache file.
#[derive(Debug, thiserror::Error)]
pub enum LocationsError {
    /// The directory or file could not be written.
    #[error("blob location cache {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// One remembered location, as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Entry {
    /// `host[:port]` as the client names the registry.
    registry: String,
    /// `algorithm:hex`.
    digest: String,
    /// The repository that held the blob.
    repository: String,
    /// When it was last recorded or used, Unix seconds.
    used: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    version: u32,
    entries: Vec<Entry>,
}

#[derive(Default)]
struct State {
    /// (registry, digest) → (repository, used).
    map: HashMap<(String, String), (String, u64)>,
    /// Locations this process found stale, to drop from the file too
    /// (only with a file; at most [`MAX_ENTRIES`]).
    stale: HashSet<(String, String, String)>,
    /// Whether anything changed since loading.
    dirty: bool,
}

/// Remembered blob locations. Shared by every copy of a [`super::copy::Copier`].
pub struct BlobLocations {
    state: Mutex<State>,
    file: Option<PathBuf>,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl BlobLocations {
    /// Locations kept in memory only (`serve`).
    pub fn in_memory() -> Self {
        Self {
            state: Mutex::default(),
            file: None,
        }
    }

    /// `$XDG_CACHE_HOME/pinswap/blob-locations.json`, else
    /// `$HOME/.cache/pinswap/blob-locations.json`; `None` when neither
    /// variable is set (or is not absolute).
    pub fn default_file() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| {
                std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .filter(|p| p.is_absolute())
                    .map(|h| h.join(".cache"))
            })?;
        Some(base.join("pinswap").join(FILE_NAME))
    }

    /// Locations loaded from `file`, saved there by [`BlobLocations::save`].
    /// A missing or unreadable file is an empty cache (logged at debug):
    /// the cache only saves requests, so it never stops a copy.
    pub fn load(file: PathBuf) -> Self {
        let mut state = State::default();
        for e in read(&file) {
            state
                .map
                .insert((e.registry, e.digest), (e.repository, e.used));
        }
        Self {
            state: Mutex::new(state),
            file: Some(file),
        }
    }

    /// The repository of `registry` that held `digest` last, if known.
    pub fn get(&self, registry: &str, digest: &str) -> Option<String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (repo, used) = st.map.get_mut(&(registry.to_owned(), digest.to_owned()))?;
        *used = now();
        Some(repo.clone())
    }

    /// Records that `repository` of `registry` holds `digest`.
    pub fn record(&self, registry: &str, digest: &str, repository: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let key = (registry.to_owned(), digest.to_owned());
        if st.map.get(&key).is_some_and(|(r, _)| r == repository) {
            return;
        }
        st.map.insert(key, (repository.to_owned(), now()));
        st.dirty = true;
        // Down to 90 %, so the sort runs once per thousand new entries, not
        // on each one.
        if st.map.len() > MAX_ENTRIES {
            bound(&mut st.map, MAX_ENTRIES * 9 / 10);
        }
    }

    /// Drops the location `repository` for `digest` at `registry`: a mount
    /// from it was refused (202), so the registry does not hold it there.
    pub fn forget(&self, registry: &str, digest: &str, repository: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let key = (registry.to_owned(), digest.to_owned());
        if st.map.get(&key).is_some_and(|(r, _)| r == repository) {
            st.map.remove(&key);
        }
        // Without a file (serve) there is nothing to drop it from; with
        // one, past the bound a stale entry may stay in the file, where the
        // next refused mount drops it again.
        if self.file.is_some() && st.stale.len() < MAX_ENTRIES {
            st.stale.insert((
                registry.to_owned(),
                digest.to_owned(),
                repository.to_owned(),
            ));
            st.dirty = true;
        }
    }

    /// Writes the locations to the file, when there is one and anything
    /// changed: merged with what the file holds now (another process may
    /// have saved since this one loaded; the later `used` wins), without the
    /// entries found stale, bounded to [`MAX_ENTRIES`], through a temporary
    /// file in the same directory renamed over the old one.
    ///
    /// # Errors
    /// [`LocationsError::Io`] when the directory or file cannot be written.
    pub fn save(&self) -> Result<(), LocationsError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let (mut map, stale) = {
            let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if !st.dirty {
                return Ok(());
            }
            (st.map.clone(), st.stale.clone())
        };
        for e in read(file) {
            let key = (e.registry.clone(), e.digest.clone());
            if stale.contains(&(e.registry.clone(), e.digest.clone(), e.repository.clone())) {
                continue;
            }
            match map.get(&key) {
                Some((_, used)) if *used >= e.used => {}
                _ => {
                    map.insert(key, (e.repository, e.used));
                }
            }
        }
        bound(&mut map, MAX_ENTRIES);
        let mut entries: Vec<Entry> = map
            .into_iter()
            .map(|((registry, digest), (repository, used))| Entry {
                registry,
                digest,
                repository,
                used,
            })
            .collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.used));
        let body = serde_json::to_vec(&File {
            version: 1,
            entries,
        })
        .expect("entries serialise");
        write_atomically(file, &body)
    }
}

/// Keeps the `keep` most recently used entries when there are more than
/// [`MAX_ENTRIES`].
fn bound(map: &mut HashMap<(String, String), (String, u64)>, keep: usize) {
    if map.len() <= MAX_ENTRIES {
        return;
    }
    let mut used: Vec<u64> = map.values().map(|(_, u)| *u).collect();
    used.sort_unstable_by(|a, b| b.cmp(a));
    let cutoff = used[keep - 1];
    map.retain(|_, (_, u)| *u >= cutoff);
    // Ties at the cutoff may leave a few too many.
    while map.len() > keep {
        let Some(k) = map.keys().next().cloned() else {
            break;
        };
        map.remove(&k);
    }
}

fn read(file: &Path) -> Vec<Entry> {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            debug!(path = %file.display(), error = %e, "blob location cache not read");
            return Vec::new();
        }
    };
    match serde_json::from_slice::<File>(&bytes) {
        Ok(f) if f.version == 1 => f.entries,
        Ok(f) => {
            debug!(path = %file.display(), version = f.version, "blob location cache of another version ignored");
            Vec::new()
        }
        Err(e) => {
            debug!(path = %file.display(), error = %e, "blob location cache not valid; starting empty");
            Vec::new()
        }
    }
}

/// Writes `body` to a temporary file next to `file`, then renames it over
/// `file`: readers see the old file or the new one, never a partial one.
fn write_atomically(file: &Path, body: &[u8]) -> Result<(), LocationsError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| LocationsError::Io { path, source }
    };
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".{FILE_NAME}.{}.{nanos}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, file));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(file)(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_merge_concurrent_changes_drop_stale_entries_and_stay_bounded() {
        let dir = std::env::temp_dir().join(format!("pinswap-locations-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join(FILE_NAME);
        let a = BlobLocations::load(file.clone());
        let b = BlobLocations::load(file.clone());
        a.record("r:5000", "sha256:1", "one");
        a.record("r:5000", "sha256:2", "two");
        a.save().unwrap();
        // b loaded before a saved; its save keeps a's entries.
        b.record("r:5000", "sha256:3", "three");
        b.save().unwrap();
        let c = BlobLocations::load(file.clone());
        assert_eq!(c.get("r:5000", "sha256:1").as_deref(), Some("one"));
        assert_eq!(c.get("r:5000", "sha256:3").as_deref(), Some("three"));
        assert_eq!(c.get("other:5000", "sha256:1"), None);
        // A stale entry goes from memory and from the file.
        c.forget("r:5000", "sha256:2", "two");
        assert_eq!(c.get("r:5000", "sha256:2"), None);
        c.save().unwrap();
        let d = BlobLocations::load(file.clone());
        assert_eq!(d.get("r:5000", "sha256:2"), None);
        assert_eq!(d.get("r:5000", "sha256:1").as_deref(), Some("one"));
        // Bounded.
        for i in 0..MAX_ENTRIES + 10 {
            d.record("r:5000", &format!("sha256:x{i}"), "many");
        }
        d.save().unwrap();
        let e = BlobLocations::load(file.clone());
        assert!(e.state.lock().unwrap().map.len() <= MAX_ENTRIES);
        // A corrupt file is an empty cache.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(
            BlobLocations::load(file.clone()).get("r:5000", "sha256:1"),
            None
        );
        // Stale records are bounded too.
        let f = BlobLocations::load(file);
        for i in 0..3 * MAX_ENTRIES {
            f.forget("r:5000", &format!("sha256:s{i}"), "gone");
        }
        assert_eq!(f.state.lock().unwrap().stale.len(), MAX_ENTRIES);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `serve` keeps locations in memory only: whatever it records and
    /// forgets over its life, far beyond any soak, stays bounded.
    #[test]
    fn in_memory_locations_stay_bounded() {
        let l = BlobLocations::in_memory();
        for i in 0..10 * MAX_ENTRIES {
            let digest = format!("sha256:{i}");
            l.record("r:5000", &digest, "a");
            l.forget("r:5000", &digest, "b");
        }
        let st = l.state.lock().unwrap();
        assert!(st.map.len() <= MAX_ENTRIES, "{}", st.map.len());
        assert!(st.stale.is_empty(), "no file, nothing stale to keep");
    }
}
