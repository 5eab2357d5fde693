//! Node mirror configuration (`pinswap node-config`): the container
//! runtime's own mirror settings, rendered from the config, so that a node
//! pulls from the target even for Pods that are not rewritten (`mirrorOnly`).
//! containerd gets `certs.d/<source>/hosts.toml` per source registry, CRI-O
//! one `registries.conf.d` drop-in. Neither runtime copies anything: an
//! image the target lacks is pulled from the source. What the node already
//! configures for a source is carried or refused, never overridden
//! ([`admin`], [`fit`]).

pub mod admin;
pub mod agent;
pub mod cri;
pub mod prewarm;
mod published;
pub mod registries;
pub mod warm;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::reference::{
    MirrorTarget, normalize_registry, registry_of_path_component, registry_path_component,
};

/// Why node configuration was not rendered or written.
#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    /// The target may hold images only some Pods may run.
    #[error(
        "source.imagePullSecrets is true: the target may hold private images, and a node mirror serves every Pod naming an image whatever its pull secrets; render node configuration for a target that holds only shared images"
    )]
    PrivateImages,
    /// A `platforms` filter: the mirror holds filtered indexes under
    /// digests of their own.
    #[error(
        "platforms is set: the mirror holds each index filtered to those platforms, under a digest of its own; a node mirror would never find the digest Pods pin (digest-only mode: they pull from the source), or would serve the filtered index for every Pod on the node, also Pods pinswap leaves alone, which fail on a node outside the list (resolve mode); remove platforms to render node configuration"
    )]
    Platforms,
    /// `identity.collisions: repair` in digest-only mode: the mirror's tag
    /// names the repaired copy, but nodes resolve tags at the source.
    #[error(
        "identity.collisions is repair and the mode is digest-only: nodes resolve a tag at the source, to the manifest whose config collides, and pull that digest's own bytes from the mirror, never the repaired copy the mirror's tag names; use mode resolve, or let admission pin Pods to the repaired copies"
    )]
    RepairDigestOnly,
    /// No registry is named (only `"*"`).
    #[error(
        "source.registries names no registry (\"*\" alone): a node mirror is configured per source registry"
    )]
    NoRegistries,
    /// A registry name that is no single directory name.
    #[error(
        "source.registries: {0:?} cannot name a directory of the runtime's configuration (empty, \".\", \"..\", or a path separator)"
    )]
    Registry(String),
    /// The target is not a valid mirror target.
    #[error("target.registry: {0}")]
    Target(String),
    /// The node's own configuration for a source says otherwise.
    #[error(transparent)]
    Admin(#[from] admin::AdminError),
    /// A file could not be written.
    #[error("{path}: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
}

/// The container runtime to configure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Runtime {
    /// containerd's `config_path` host directories (`hosts.toml`).
    Containerd,
    /// CRI-O's `registries.conf.d` drop-in.
    CriO,
}

/// How tags resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Tags resolve at the mirror too: new Pods start while the source is
    /// down; a tag the source moved is served as last mirrored.
    Resolve,
    /// Tags resolve at the source, content comes from the mirror by digest:
    /// a moved tag is never served stale.
    DigestOnly,
}

/// One rendered file, its path relative to the runtime's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct File {
    /// `docker.io/hosts.toml`, `50-pinswap.conf`.
    pub path: PathBuf,
    /// Its text.
    pub contents: String,
}

/// The first line of every file pinswap writes: files without it are
/// never touched.
pub const HEADER: &str = "# Written by pinswap node-config; regenerate rather than edit.";

/// Whether `name` is one directory name under the runtime's directory:
/// never `.`, `..` or a path.
fn is_directory_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// CRI-O's drop-in, in `registries.conf.d`.
const CRI_O_FILE: &str = "50-pinswap.conf";

/// The most source registries `"*"` adds from the target's listing: each is
/// a host directory (or `[[registry]]`) on every node, and whoever can name
/// a repository at the target can add to that listing.
pub const ANY_REGISTRIES_MAX: usize = 32;

/// Whether `name` (normalised) is a registry host a source can be: a DNS
/// name with a dot, `localhost`, or a bracketed IPv6 address, with an
/// optional port, and the one the target's path component for it names
/// back. Never `_default` or another name a runtime gives a meaning.
fn is_source_host(name: &str) -> bool {
    let (host, port) = if name.starts_with('[') {
        match name.split_once(']') {
            Some((h, rest)) => (
                &name[..=h.len()],
                match rest {
                    "" => None,
                    r => match r.strip_prefix(':') {
                        Some(p) => Some(p),
                        None => return false,
                    },
                },
            ),
            None => return false,
        }
    } else {
        match name.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (name, None),
        }
    };
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0 && n.to_string() == p));
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        host.len() <= 253
            && (host.contains('.') || host == "localhost")
            && host.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            })
    };
    port_ok
        && host_ok
        && registry_of_path_component(&registry_path_component(name)).as_deref() == Some(name)
}

/// The runtimes' own name for Docker Hub's API host.
fn api_host(registry: &str) -> &str {
    match registry {
        "docker.io" => "registry-1.docker.io",
        r => r,
    }
}

/// Whether the node speaks plain HTTP to `registry`: where the config says
/// `insecure`, and on loopback, where pinswap itself tries plain HTTP first
/// ([`crate::reference::is_loopback_registry`]) and most registries are plain.
fn plain_http(registry: &str, insecure: bool) -> bool {
    insecure || crate::reference::is_loopback_registry(registry)
}

fn scheme(registry: &str, insecure: bool) -> &'static str {
    if plain_http(registry, insecure) {
        "http"
    } else {
        "https"
    }
}

/// Renders the node configuration for `runtime` from `config`.
///
/// # Errors
/// [`NodeConfigError::PrivateImages`] with `source.imagePullSecrets`,
/// [`NodeConfigError::NoRegistries`] when only `"*"` is allowed.
pub fn render(config: &Config, runtime: Runtime, mode: Mode) -> Result<Vec<File>, NodeConfigError> {
    render_with(config, runtime, mode, &BTreeSet::new())
}

/// As [`render`], and when `source.registries` allows `"*"`, also for each
/// registry in `mirrored` (those the target holds images of, as
/// [`crate::mirror::Mirror::mirrored_registries`] lists them).
///
/// # Errors
/// As [`render`].
pub fn render_with(
    config: &Config,
    runtime: Runtime,
    mode: Mode,
    mirrored: &BTreeSet<String>,
) -> Result<Vec<File>, NodeConfigError> {
    if config.source.image_pull_secrets {
        return Err(NodeConfigError::PrivateImages);
    }
    if matches!(config.platforms, crate::config::Platforms::Only(_)) {
        return Err(NodeConfigError::Platforms);
    }
    // In resolve mode a tag resolves at the mirror, to the repaired copy; a
    // digest is that digest's own bytes at any registry.
    if mode == Mode::DigestOnly
        && config.identity.collisions == crate::config::CollisionPolicy::Repair
    {
        return Err(NodeConfigError::RepairDigestOnly);
    }
    let target = MirrorTarget::parse(&config.target.registry)
        .map_err(|e| NodeConfigError::Target(e.to_string()))?;
    // As the runtimes name them: `index.docker.io` is `docker.io`'s
    // directory, and host names are lowercase.
    let mut sources: Vec<(String, bool)> = Vec::new();
    for r in config
        .source
        .registries
        .iter()
        .filter(|r| r.registry != "*")
    {
        let name = normalize_registry(&r.registry);
        if !is_directory_name(&name) {
            return Err(NodeConfigError::Registry(r.registry.clone()));
        }
        if !sources.iter().any(|(s, _)| *s == name) {
            sources.push((name, r.insecure));
        }
    }
    // "*" cannot be insecure (config validation): those speak HTTPS. Only
    // names that are registry hosts, and at most ANY_REGISTRIES_MAX of
    // them: anyone who can push a repository name shapes the listing.
    if config.source.registries.iter().any(|r| r.registry == "*") {
        let mut added = 0;
        let mut skipped = 0;
        for r in mirrored.iter().map(|r| normalize_registry(r)) {
            if !is_source_host(&r) || !is_directory_name(&r) || sources.iter().any(|(s, _)| *s == r)
            {
                continue;
            }
            if added == ANY_REGISTRIES_MAX {
                skipped += 1;
                continue;
            }
            sources.push((r, false));
            added += 1;
        }
        if skipped > 0 {
            tracing::warn!(
                skipped,
                max = ANY_REGISTRIES_MAX,
                "the target holds images of more registries than \"*\" configures on nodes; name the ones that matter in source.registries"
            );
        }
    }
    if sources.is_empty() {
        return Err(NodeConfigError::NoRegistries);
    }
    // The target's repository path for a source: PREFIX/COMPONENT.
    let path = |registry: &str| {
        let component = registry_path_component(registry);
        match target.prefix() {
            Some(p) => format!("{p}/{component}"),
            None => component,
        }
    };
    let target_scheme = scheme(target.registry(), config.target.insecure);
    let target_insecure = plain_http(target.registry(), config.target.insecure);
    Ok(match runtime {
        Runtime::Containerd => sources
            .iter()
            .map(|(registry, insecure)| {
                let capabilities = match mode {
                    Mode::Resolve => r#"["pull", "resolve"]"#,
                    Mode::DigestOnly => r#"["pull"]"#,
                };
                File {
                    path: PathBuf::from(registry).join("hosts.toml"),
                    contents: format!(
                        "{HEADER}\n# {registry} through the mirror {target}.\nserver = \"{src_scheme}://{api}\"\n\n[host.\"{target_scheme}://{host}/v2/{path}\"]\n  capabilities = {capabilities}\n  override_path = true\n",
                        target = config.target.registry,
                        src_scheme = scheme(registry, *insecure),
                        api = api_host(registry),
                        host = target.registry(),
                        path = path(registry),
                    ),
                }
            })
            .collect(),
        Runtime::CriO => {
            let pull_from = match mode {
                Mode::Resolve => "all",
                Mode::DigestOnly => "digest-only",
            };
            let mut text = format!("{HEADER}\n");
            for (registry, insecure) in &sources {
                text.push_str(&format!(
                    "\n[[registry]]\nprefix = \"{r}\"\nlocation = \"{r}\"\ninsecure = {src_insecure}\n\n[[registry.mirror]]\nlocation = \"{host}/{path}\"\ninsecure = {target_insecure}\npull-from-mirror = \"{pull_from}\"\n",
                    r = registry,
                    src_insecure = plain_http(registry, *insecure),
                    host = target.registry(),
                    path = path(registry),
                ));
            }
            vec![File {
                path: PathBuf::from(CRI_O_FILE),
                contents: text,
            }]
        }
    })
}

/// Rendered files fitted to what a node configures ([`fit`]).
#[derive(Debug, Default)]
pub struct Fitted {
    /// The files to write.
    pub files: Vec<File>,
    /// The sources (or files) refused, each naming the node's file and
    /// setting.
    pub refused: Vec<NodeConfigError>,
    /// Files of ours to leave as they are: what the node sets there is
    /// unknown (a file that cannot be read).
    pub hold: Vec<PathBuf>,
}

impl Fitted {
    /// The files of ours that stay: those to write and those held.
    pub fn keep(&self) -> Vec<PathBuf> {
        self.files
            .iter()
            .map(|f| f.path.clone())
            .chain(self.hold.iter().cloned())
            .collect()
    }
}

/// CRI-O's `registries.conf` beside a drop-in directory.
pub fn default_registries_conf(dropins: &Path) -> PathBuf {
    dropins
        .parent()
        .unwrap_or(Path::new("/"))
        .join("registries.conf")
}

/// Fits `files` (as [`render`] made them for `runtime`) to what the node
/// under `dir` already configures, so that none overrides it: containerd's
/// host directories get their TLS files carried into the `hosts.toml`
/// ([`admin::containerd`]); a source whose directory is a link, or that
/// `_default/hosts.toml` of someone else's configures, is refused. CRI-O's
/// drop-in leaves out each source that `registries_conf` or another
/// drop-in configures ([`admin::cri_o`]). A refusal holds back only its
/// source.
pub fn fit(runtime: Runtime, dir: &Path, registries_conf: &Path, files: Vec<File>) -> Fitted {
    let mut fitted = Fitted::default();
    for f in files {
        match runtime {
            Runtime::Containerd => {
                let host = f
                    .path
                    .parent()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                match admin::containerd(dir, &host, &f.contents) {
                    Ok(contents) => fitted.files.push(File {
                        path: f.path,
                        contents,
                    }),
                    Err(e) => {
                        if e.is_unknown() {
                            fitted.hold.push(f.path);
                        }
                        fitted.refused.push(e.into());
                    }
                }
            }
            Runtime::CriO => {
                // Our drop-in: the header, then one [[registry]] per source.
                const SEP: &str = "\n[[registry]]\n";
                let mut parts = f.contents.split(SEP);
                let head = parts.next().unwrap_or_default().to_owned();
                let blocks: Vec<(String, &str)> = parts
                    .map(|b| {
                        let prefix = b
                            .strip_prefix("prefix = \"")
                            .and_then(|r| r.split_once('"'))
                            .map(|(p, _)| p.to_owned())
                            .unwrap_or_default();
                        (prefix, b)
                    })
                    .collect();
                let prefixes: Vec<String> = blocks.iter().map(|(p, _)| p.clone()).collect();
                match admin::cri_o(registries_conf, dir, CRI_O_FILE, &prefixes) {
                    Err(e) => {
                        fitted.hold.push(f.path);
                        fitted.refused.push(e.into());
                    }
                    Ok(conflicts) => {
                        let refused: BTreeSet<String> = conflicts
                            .iter()
                            .filter_map(|c| match c {
                                admin::AdminError::Registry { registry, .. } => {
                                    Some(registry.clone())
                                }
                                _ => None,
                            })
                            .collect();
                        fitted.refused.extend(conflicts.into_iter().map(Into::into));
                        let kept: Vec<&str> = blocks
                            .iter()
                            .filter(|(p, _)| !refused.contains(p))
                            .map(|(_, b)| *b)
                            .collect();
                        // With every source refused, no drop-in: a stale one
                        // of ours would still replace the node's.
                        if !kept.is_empty() {
                            let mut contents = head;
                            for b in kept {
                                contents.push_str(SEP);
                                contents.push_str(b);
                            }
                            fitted.files.push(File {
                                path: f.path,
                                contents,
                            });
                        }
                    }
                }
            }
        }
    }
    fitted
}

/// Writes `files` under `dir`, each atomically (a temporary file renamed
/// over it) and only when its text changed. A file there that pinswap did
/// not write (without [`HEADER`]) is left alone and reported, and so is a
/// file whose directory is a link. Returns the files written, relative to
/// `dir`.
///
/// # Errors
/// [`NodeConfigError::Write`] for the first file that cannot be written or
/// that pinswap did not write.
pub fn write(dir: &Path, files: &[File]) -> Result<Vec<PathBuf>, NodeConfigError> {
    let mut changed = Vec::new();
    for f in files {
        let path = dir.join(&f.path);
        let err = |reason: String| NodeConfigError::Write {
            path: path.clone(),
            reason,
        };
        // Only a regular file with the header is ours; a link, a file that
        // cannot be read, or any other is left alone.
        match std::fs::symlink_metadata(&path) {
            Ok(m) if !m.file_type().is_file() => {
                return Err(err(
                    "exists and is not a regular file pinswap wrote; left alone".into(),
                ));
            }
            Ok(_) => match std::fs::read(&path) {
                Ok(existing) if !existing.starts_with(HEADER.as_bytes()) => {
                    return Err(err(
                        "exists and was not written by pinswap; left alone".into()
                    ));
                }
                Ok(existing) if existing == f.contents.as_bytes() => continue,
                Ok(_) => {}
                Err(e) => return Err(err(format!("cannot be read ({e}); left alone"))),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(format!("cannot be inspected ({e}); left alone"))),
        }
        let parent = path.parent().unwrap_or(dir);
        // A host directory that is a link would put the file wherever it
        // points.
        if parent != dir {
            match std::fs::symlink_metadata(parent) {
                Ok(m) if !m.file_type().is_dir() => {
                    return Err(err(format!(
                        "{} is not a directory (a link, or a file); left alone",
                        parent.display()
                    )));
                }
                _ => {}
            }
        }
        std::fs::create_dir_all(parent).map_err(|e| err(e.to_string()))?;
        let tmp = parent.join(format!(
            ".{}.pinswap-tmp",
            path.file_name().unwrap_or_default().to_string_lossy()
        ));
        std::fs::write(&tmp, &f.contents).map_err(|e| err(e.to_string()))?;
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(e.to_string())
        })?;
        changed.push(f.path.clone());
    }
    Ok(changed)
}

/// The files under `dir` that pinswap wrote for `runtime` (with
/// [`HEADER`]), relative to `dir`.
fn written(dir: &Path, runtime: Runtime) -> Vec<PathBuf> {
    let ours = |rel: PathBuf| {
        let path = dir.join(&rel);
        let regular = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file());
        (regular && std::fs::read(&path).is_ok_and(|t| t.starts_with(HEADER.as_bytes())))
            .then_some(rel)
    };
    match runtime {
        Runtime::Containerd => std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| ours(PathBuf::from(e.file_name()).join("hosts.toml")))
            .collect(),
        Runtime::CriO => ours(PathBuf::from(CRI_O_FILE)).into_iter().collect(),
    }
}

/// Removes the files pinswap wrote under `dir` for `runtime` that `keep`
/// does not name (all of them with an empty `keep`), and the host
/// directories that leaves empty. Files without [`HEADER`] are never
/// touched. Returns what was removed, relative to `dir`.
///
/// # Errors
/// [`NodeConfigError::Write`] for the first file that cannot be removed.
pub fn remove_stale(
    dir: &Path,
    runtime: Runtime,
    keep: &[PathBuf],
) -> Result<Vec<PathBuf>, NodeConfigError> {
    remove_where(dir, runtime, |rel| !keep.contains(rel))
}

/// Removes those of `paths` (relative to `dir`) that pinswap wrote, as
/// [`remove_stale`] does.
///
/// # Errors
/// As [`remove_stale`].
pub fn remove_ours(
    dir: &Path,
    runtime: Runtime,
    paths: &[PathBuf],
) -> Result<Vec<PathBuf>, NodeConfigError> {
    remove_where(dir, runtime, |rel| paths.contains(rel))
}

fn remove_where(
    dir: &Path,
    runtime: Runtime,
    remove: impl Fn(&PathBuf) -> bool,
) -> Result<Vec<PathBuf>, NodeConfigError> {
    let mut removed = Vec::new();
    for rel in written(dir, runtime) {
        if !remove(&rel) {
            continue;
        }
        let path = dir.join(&rel);
        std::fs::remove_file(&path).map_err(|e| NodeConfigError::Write {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if let Some(parent) = path.parent().filter(|p| *p != dir) {
            // Only when empty: another file there is not ours.
            let _ = std::fs::remove_dir(parent);
        }
        removed.push(rel);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `hosts.toml` of ours for `host`.
    fn ours(host: &str) -> File {
        File {
            path: PathBuf::from(host).join("hosts.toml"),
            contents: format!("{HEADER}\nserver = \"https://{host}\"\n"),
        }
    }

    fn config(yaml: &str) -> Config {
        Config::from_yaml(yaml, "c.yaml").unwrap()
    }

    #[test]
    fn containerd_gets_a_hosts_file_per_named_source() {
        let c = config(
            "target: {registry: mirror.example.com/cache}\nsource: {registries: [{registry: docker.io}, {registry: \"10.0.0.5:5000\", insecure: true}, {registry: \"*\"}]}\n",
        );
        let files = render(&c, Runtime::Containerd, Mode::Resolve).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].path, PathBuf::from("docker.io/hosts.toml"));
        let hub = &files[0].contents;
        assert!(hub.starts_with(HEADER));
        assert!(hub.contains("server = \"https://registry-1.docker.io\"\n"));
        assert!(hub.contains("[host.\"https://mirror.example.com/v2/cache/docker.io\"]\n  capabilities = [\"pull\", \"resolve\"]\n  override_path = true\n"));
        assert!(
            files[1]
                .contents
                .contains("server = \"http://10.0.0.5:5000\"")
        );
        assert!(files[1].contents.contains("/v2/cache/10.0.0.5_5000\"]"));
        let digest_only = render(&c, Runtime::Containerd, Mode::DigestOnly).unwrap();
        assert!(
            digest_only[0]
                .contents
                .contains("capabilities = [\"pull\"]\n")
        );
    }

    #[test]
    fn cri_o_gets_one_drop_in() {
        let c = config(
            "target: {registry: \"mirror.internal:5000\", insecure: true}\nsource: {registries: [{registry: quay.io}]}\n",
        );
        let files = render(&c, Runtime::CriO, Mode::DigestOnly).unwrap();
        assert_eq!(files.len(), 1);
        let text = &files[0].contents;
        assert!(text.contains(
            "[[registry]]\nprefix = \"quay.io\"\nlocation = \"quay.io\"\ninsecure = false\n"
        ));
        assert!(text.contains("[[registry.mirror]]\nlocation = \"mirror.internal:5000/quay.io\"\ninsecure = true\npull-from-mirror = \"digest-only\"\n"));
    }

    /// A platform filter would hand nodes indexes under digests of their
    /// own: refused in both modes, naming the key.
    #[test]
    fn a_platforms_filter_is_refused() {
        let c = config(
            "target: {registry: mirror.example.com/cache}\nsource: {registries: [{registry: docker.io}]}\nplatforms: [linux/amd64]\n",
        );
        for mode in [Mode::Resolve, Mode::DigestOnly] {
            for runtime in [Runtime::Containerd, Runtime::CriO] {
                let e = render(&c, runtime, mode).unwrap_err();
                assert!(e.to_string().starts_with("platforms is set"), "{e}");
            }
        }
    }

    /// With repair, the mirror's tag names the repaired copy: nodes get it
    /// when tags resolve at the mirror, never when they resolve at the
    /// source (digest-only), which is refused.
    #[test]
    fn identity_repair_is_refused_in_digest_only_mode() {
        let c = config(
            "target: {registry: mirror.example.com/cache}\nsource: {registries: [{registry: docker.io}]}\nidentity: {collisions: repair}\n",
        );
        for runtime in [Runtime::Containerd, Runtime::CriO] {
            let e = render(&c, runtime, Mode::DigestOnly).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with("identity.collisions is repair and the mode is digest-only"),
                "{e}"
            );
            assert!(!render(&c, runtime, Mode::Resolve).unwrap().is_empty());
        }
        let warn = config(
            "target: {registry: mirror.example.com/cache}\nsource: {registries: [{registry: docker.io}]}\nidentity: {collisions: deny}\n",
        );
        assert!(render(&warn, Runtime::Containerd, Mode::DigestOnly).is_ok());
    }

    #[test]
    fn private_images_or_no_named_registry_are_refused() {
        let private = config(
            "target: {registry: m.example.com}\nsource: {registries: [{registry: ghcr.io}], imagePullSecrets: true}\n",
        );
        let e = render(&private, Runtime::Containerd, Mode::Resolve).unwrap_err();
        assert!(e.to_string().contains("source.imagePullSecrets"), "{e}");
        let any = config(
            "target: {registry: m.example.com}\nsource: {registries: [{registry: \"*\"}]}\n",
        );
        assert!(matches!(
            render(&any, Runtime::CriO, Mode::Resolve),
            Err(NodeConfigError::NoRegistries)
        ));
    }

    #[test]
    fn writes_atomically_and_never_over_a_file_it_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let files = vec![File {
            path: PathBuf::from("docker.io/hosts.toml"),
            contents: format!("{HEADER}\nserver = \"x\"\n"),
        }];
        write(dir.path(), &files).unwrap();
        write(dir.path(), &files).unwrap();
        let written = dir.path().join("docker.io/hosts.toml");
        assert_eq!(
            std::fs::read_to_string(&written).unwrap(),
            files[0].contents
        );
        assert_eq!(
            std::fs::read_dir(dir.path().join("docker.io"))
                .unwrap()
                .count(),
            1
        );
        std::fs::write(&written, "server = \"theirs\"\n").unwrap();
        let e = write(dir.path(), &files).unwrap_err();
        assert!(e.to_string().contains("not written by pinswap"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&written).unwrap(),
            "server = \"theirs\"\n"
        );
    }

    #[test]
    fn with_any_registry_allowed_the_registries_the_target_holds_get_files() {
        let c = config(
            "target: {registry: m.example.com/cache}\nsource: {registries: [{registry: quay.io}, {registry: \"*\"}]}\n",
        );
        let held = BTreeSet::from(["quay.io".to_owned(), "10.0.0.5:5000".to_owned()]);
        let files = render_with(&c, Runtime::Containerd, Mode::Resolve, &held).unwrap();
        let paths: Vec<_> = files.iter().map(|f| f.path.display().to_string()).collect();
        assert_eq!(paths, ["quay.io/hosts.toml", "10.0.0.5:5000/hosts.toml"]);
        assert!(
            files[1]
                .contents
                .contains("server = \"https://10.0.0.5:5000\"")
        );
        // Without "*", only what the config names.
        let named = config(
            "target: {registry: m.example.com/cache}\nsource: {registries: [{registry: quay.io}]}\n",
        );
        assert_eq!(
            render_with(&named, Runtime::Containerd, Mode::Resolve, &held)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn stale_files_of_ours_are_removed_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (ours("a.example"), ours("b.example"));
        assert_eq!(write(dir.path(), &[a.clone(), b.clone()]).unwrap().len(), 2);
        assert!(
            write(dir.path(), &[a.clone(), b.clone()])
                .unwrap()
                .is_empty(),
            "unchanged files are not rewritten"
        );
        std::fs::create_dir_all(dir.path().join("c.example")).unwrap();
        std::fs::write(
            dir.path().join("c.example/hosts.toml"),
            "server = \"theirs\"\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("b.example/ca.crt"), "theirs").unwrap();
        let removed = remove_stale(
            dir.path(),
            Runtime::Containerd,
            std::slice::from_ref(&a.path),
        )
        .unwrap();
        assert_eq!(removed, [PathBuf::from("b.example/hosts.toml")]);
        assert!(
            dir.path().join("b.example/ca.crt").exists(),
            "a directory with another file stays"
        );
        let removed = remove_stale(dir.path(), Runtime::Containerd, &[]).unwrap();
        assert_eq!(removed, [PathBuf::from("a.example/hosts.toml")]);
        assert!(!dir.path().join("a.example").exists());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("c.example/hosts.toml")).unwrap(),
            "server = \"theirs\"\n"
        );
    }

    #[test]
    fn registry_names_are_normalised_and_never_a_path() {
        let c = config(
            "target: {registry: m.example.com/cache}\nsource: {registries: [{registry: index.docker.io}, {registry: Quay.IO}, {registry: \"*\"}]}\n",
        );
        let held = BTreeSet::from(["..".to_owned(), "ghcr.io".to_owned()]);
        let files = render_with(&c, Runtime::Containerd, Mode::Resolve, &held).unwrap();
        let paths: Vec<_> = files.iter().map(|f| f.path.display().to_string()).collect();
        assert_eq!(
            paths,
            [
                "docker.io/hosts.toml",
                "quay.io/hosts.toml",
                "ghcr.io/hosts.toml"
            ]
        );
        assert!(files[0].contents.contains("/v2/cache/docker.io\""));
        for bad in ["..", "."] {
            let c = config(&format!(
                "target: {{registry: m.example.com}}\nsource: {{registries: [{{registry: \"{bad}\"}}]}}\n"
            ));
            if let Err(e) = render(&c, Runtime::Containerd, Mode::Resolve) {
                assert!(matches!(e, NodeConfigError::Registry(_)), "{e}");
            } else {
                panic!("{bad} rendered");
            }
        }
    }

    /// A containerd host file of ours for `host`, as `render` makes it.
    fn rendered(host: &str) -> File {
        let c = config(&format!(
            "target: {{registry: m.example.com}}\nsource: {{registries: [{{registry: \"{host}\"}}]}}\n"
        ));
        render(&c, Runtime::Containerd, Mode::Resolve)
            .unwrap()
            .remove(0)
    }

    fn fit_containerd(dir: &Path, host: &str) -> Fitted {
        fit(
            Runtime::Containerd,
            dir,
            &dir.join("unused"),
            vec![rendered(host)],
        )
    }

    #[test]
    fn a_host_directorys_own_tls_files_are_carried_into_the_hosts_file() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("quay.io");
        std::fs::create_dir_all(host.join("sub.crt")).unwrap();
        for f in [
            "ca.crt",
            "client.cert",
            "client.key",
            "whole.cert",
            "notes.txt",
        ] {
            std::fs::write(host.join(f), "theirs").unwrap();
        }
        let fitted = fit_containerd(dir.path(), "quay.io");
        assert!(fitted.refused.is_empty(), "{:?}", fitted.refused);
        let text = &fitted.files[0].contents;
        let v: toml::Table = toml::from_str(text).unwrap();
        assert_eq!(v["ca"], toml::Value::from(vec!["ca.crt"]));
        assert_eq!(
            v["client"],
            toml::Value::Array(vec![
                toml::Value::from(vec!["client.cert", "client.key"]),
                toml::Value::from("whole.cert"),
            ])
        );
        assert_eq!(v["server"].as_str(), Some("https://quay.io"));
        assert!(
            v["host"]["https://m.example.com/v2/quay.io"]["override_path"].as_bool() == Some(true)
        );
        write(dir.path(), &fitted.files).unwrap();
        assert_eq!(
            std::fs::read_to_string(host.join("ca.crt")).unwrap(),
            "theirs"
        );

        // A CA added beside a file of ours is carried at the next fit.
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &[rendered("ghcr.io")]).unwrap();
        std::fs::write(dir.path().join("ghcr.io/ca.crt"), "theirs").unwrap();
        let fitted = fit_containerd(dir.path(), "ghcr.io");
        assert!(fitted.files[0].contents.contains("\nca = [\"ca.crt\"]\n"));
        assert_eq!(write(dir.path(), &fitted.files).unwrap().len(), 1);
    }

    #[test]
    fn the_nodes_default_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let default = dir.path().join("_default");
        std::fs::create_dir_all(&default).unwrap();
        std::fs::write(default.join("hosts.toml"), "server = \"https://theirs\"\n").unwrap();
        let fitted = fit_containerd(dir.path(), "quay.io");
        assert!(fitted.files.is_empty());
        let e = fitted.refused[0].to_string();
        assert!(
            e.contains("_default/hosts.toml") && e.contains("quay.io"),
            "{e}"
        );
        assert!(fitted.hold.is_empty());

        // A host directory of the node's own: `_default` does not apply.
        std::fs::create_dir_all(dir.path().join("ghcr.io")).unwrap();
        std::fs::write(dir.path().join("ghcr.io/ca.crt"), "theirs").unwrap();
        assert!(fit_containerd(dir.path(), "ghcr.io").refused.is_empty());

        // Only TLS files there: carried from `_default`.
        std::fs::remove_file(default.join("hosts.toml")).unwrap();
        std::fs::write(default.join("corp.crt"), "theirs").unwrap();
        let fitted = fit_containerd(dir.path(), "quay.io");
        assert!(
            fitted.files[0]
                .contents
                .contains("\nca = [\"../_default/corp.crt\"]\n")
        );

        // "*" never names `_default` (nor another name that is no host).
        let c = config(
            "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: \"*\"}]}\n",
        );
        let held = BTreeSet::from(["_default".to_owned(), "x_y.example".to_owned()]);
        let files = render_with(&c, Runtime::Containerd, Mode::Resolve, &held).unwrap();
        assert_eq!(files.len(), 1);
    }

    #[cfg(unix)]
    #[test]
    fn a_linked_host_directory_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("quay.io")).unwrap();
        let fitted = fit_containerd(dir.path(), "quay.io");
        assert!(fitted.files.is_empty());
        let e = fitted.refused[0].to_string();
        assert!(e.contains("quay.io: is not a directory"), "{e}");
        let e = write(dir.path(), &[rendered("quay.io")]).unwrap_err();
        assert!(e.to_string().contains("is not a directory"), "{e}");
        assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    }

    #[test]
    fn any_registry_adds_a_bounded_number_of_registry_hosts() {
        let c = config(
            "target: {registry: m.example.com/cache}\nsource: {registries: [{registry: quay.io}, {registry: \"*\"}]}\n",
        );
        let mut held: BTreeSet<String> = (0..200).map(|i| format!("r{i:03}.example")).collect();
        for bad in [
            "_default",
            "localhost:0",
            "a..b",
            "-a.example",
            "a.example:070",
            "x\".example",
            "a.example:99999",
        ] {
            held.insert(bad.to_owned());
        }
        let files = render_with(&c, Runtime::Containerd, Mode::Resolve, &held).unwrap();
        assert_eq!(files.len(), 1 + ANY_REGISTRIES_MAX);
        assert_eq!(files[1].path, PathBuf::from("r000.example/hosts.toml"));
        for f in &files {
            let host = f.path.parent().unwrap().to_str().unwrap();
            assert!(host == "quay.io" || host.starts_with('r'), "{host}");
        }
        // As the target's listing names it back.
        assert!(is_source_host("[fd00:0:0:0:0:0:0:1]:5000"));
        assert!(!is_source_host("[fd00::1]:5000"));
        assert!(is_source_host("localhost:5000"));
        assert!(!is_source_host("[fd00::1]x"));
    }

    #[test]
    fn a_cri_o_registry_the_node_configures_is_refused() {
        let etc = tempfile::tempdir().unwrap();
        let dropins = etc.path().join("registries.conf.d");
        std::fs::create_dir_all(&dropins).unwrap();
        let conf = etc.path().join("registries.conf");
        std::fs::write(
            &conf,
            "[[registry]]\nlocation = \"quay.io\"\nblocked = true\n",
        )
        .unwrap();
        std::fs::write(
            dropins.join("10-corp.conf"),
            "[[registry]]\nprefix = \"*.corp.example\"\nlocation = \"mirror.corp.example\"\ninsecure = true\n",
        )
        .unwrap();
        let c = config(
            "target: {registry: m.example.com}\nsource: {registries: [{registry: quay.io}, {registry: ghcr.io}, {registry: r.corp.example}]}\n",
        );
        let files = render(&c, Runtime::CriO, Mode::Resolve).unwrap();
        let fitted = fit(Runtime::CriO, &dropins, &conf, files.clone());
        let errors: Vec<String> = fitted.refused.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0]
                .contains("registries.conf: [[registry]] prefix = \"quay.io\" sets blocked = true"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].contains(
                "10-corp.conf: [[registry]] prefix = \"*.corp.example\" sets insecure = true"
            ),
            "{}",
            errors[1]
        );
        let text = &fitted.files[0].contents;
        assert!(text.starts_with(HEADER));
        let v: toml::Table = toml::from_str(text).unwrap();
        let prefixes: Vec<_> = v["registry"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["prefix"].as_str().unwrap())
            .collect();
        assert_eq!(prefixes, ["ghcr.io"]);

        // Every source refused: no drop-in at all.
        std::fs::write(
            dropins.join("90-late.conf"),
            "[[registry]]\nprefix = \"ghcr.io\"\nlocation = \"ghcr.io\"\n[[registry.mirror]]\nlocation = \"theirs.example/ghcr\"\n",
        )
        .unwrap();
        let fitted = fit(Runtime::CriO, &dropins, &conf, files.clone());
        assert!(fitted.files.is_empty() && fitted.hold.is_empty());
        assert!(fitted.refused[2].to_string().contains(
            "90-late.conf: [[registry]] prefix = \"ghcr.io\" sets 1 [[registry.mirror]]"
        ));

        // A file that does not parse: nothing is known, ours stays as it is.
        std::fs::write(dropins.join("20-broken.conf"), "[[registry]\n").unwrap();
        let fitted = fit(Runtime::CriO, &dropins, &conf, files);
        assert!(fitted.files.is_empty());
        assert_eq!(fitted.hold, [PathBuf::from(CRI_O_FILE)]);
        assert!(fitted.refused[0].to_string().contains("20-broken.conf"));
    }

    #[cfg(unix)]
    #[test]
    fn links_and_unreadable_files_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a.example")).unwrap();
        std::os::unix::fs::symlink("/nonexistent", dir.path().join("a.example/hosts.toml"))
            .unwrap();
        let e = write(dir.path(), &[ours("a.example")]).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::create_dir_all(dir.path().join("b.example")).unwrap();
        std::fs::write(
            dir.path().join("b.example/hosts.toml"),
            b"server=\"x\"\n# caf\xe9\n",
        )
        .unwrap();
        let e = write(dir.path(), &[ours("b.example")]).unwrap_err();
        assert!(e.to_string().contains("not written by pinswap"), "{e}");
        assert!(
            remove_stale(dir.path(), Runtime::Containerd, &[])
                .unwrap()
                .is_empty()
        );
        assert!(std::fs::symlink_metadata(dir.path().join("a.example/hosts.toml")).is_ok());
    }
}
