//! Node mirror configuration (`pinswap node-config`): the container
//! runtime's own mirror settings, rendered from the config, so that a node
//! pulls from the target even for Pods that are not rewritten (`mirrorOnly`).
//! containerd gets `certs.d/<source>/hosts.toml` per source registry, CRI-O
//! one `registries.conf.d` drop-in. Neither runtime copies anything: an
//! image the target lacks is pulled from the source.

pub mod agent;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::reference::{MirrorTarget, normalize_registry, registry_path_component};

/// Why node configuration was not rendered or written.
#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    /// The target may hold images only some Pods may run.
    #[error(
        "source.imagePullSecrets is true: the target may hold private images, and a node mirror serves every Pod naming an image whatever its pull secrets; render node configuration for a target that holds only shared images"
    )]
    PrivateImages,
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

/// The runtimes' own name for Docker Hub's API host.
fn api_host(registry: &str) -> &str {
    match registry {
        "docker.io" => "registry-1.docker.io",
        r => r,
    }
}

fn scheme(insecure: bool) -> &'static str {
    if insecure { "http" } else { "https" }
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
    // "*" cannot be insecure (config validation): those speak HTTPS. A
    // name from the target's listing that is no directory name is skipped.
    if config.source.registries.iter().any(|r| r.registry == "*") {
        for r in mirrored.iter().map(|r| normalize_registry(r)) {
            if is_directory_name(&r) && !sources.iter().any(|(s, _)| *s == r) {
                sources.push((r, false));
            }
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
    let target_scheme = scheme(config.target.insecure);
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
                        src_scheme = scheme(*insecure),
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
                    src_insecure = insecure,
                    host = target.registry(),
                    path = path(registry),
                    target_insecure = config.target.insecure,
                ));
            }
            vec![File {
                path: PathBuf::from(CRI_O_FILE),
                contents: text,
            }]
        }
    })
}

/// Writes `files` under `dir`, each atomically (a temporary file renamed
/// over it) and only when its text changed. A file there that pinswap did
/// not write (without [`HEADER`]) is left alone and reported. Returns the
/// files written, relative to `dir`.
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
    keep: &[File],
) -> Result<Vec<PathBuf>, NodeConfigError> {
    let mut removed = Vec::new();
    for rel in written(dir, runtime) {
        if keep.iter().any(|f| f.path == rel) {
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
        let removed =
            remove_stale(dir.path(), Runtime::Containerd, std::slice::from_ref(&a)).unwrap();
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
