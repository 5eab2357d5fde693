//! What the node's own registry configuration already says for a source,
//! so that a file of ours never overrides it unseen.
//!
//! - containerd reads `ca.crt`, `*.cert` and `*.key` in a host directory
//!   only while it has no `hosts.toml`, and reads `_default/` only for a
//!   host without a directory: a `hosts.toml` of ours carries those files
//!   (`ca`, `client`, relative to its directory as containerd resolves
//!   them), and a `hosts.toml` someone else wrote is never replaced.
//! - CRI-O keeps one `[[registry]]` per prefix, a later drop-in's replacing
//!   an earlier one whole: a prefix that `registries.conf` or another
//!   drop-in configures is refused, since ours would unblock, unmirror or
//!   make secure what the admin set.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::HEADER;

/// A setting of the node's own that a file of ours would override.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The host directory is a link or not a directory.
    #[error(
        "{path}: is not a directory (a link, or a file); pinswap writes only into a host directory of its own node; {host} left alone"
    )]
    NotADirectory {
        /// The host directory.
        path: PathBuf,
        /// The source registry.
        host: String,
    },
    /// containerd's `_default` holds a `hosts.toml` pinswap did not write:
    /// it applies to every host without a directory of its own.
    #[error(
        "{path}: the node's default host configuration (server, mirrors, TLS) applies to {host} until {host} has a directory of its own, and pinswap's would replace it; {host} left alone (write {host}/hosts.toml yourself with pinswap's mirror in it, or remove this file)"
    )]
    Default {
        /// `_default/hosts.toml`.
        path: PathBuf,
        /// The source registry.
        host: String,
    },
    /// A file name containerd would read that a `hosts.toml` cannot name.
    #[error(
        "{path}: containerd reads it as {setting} for {host}, and its name is no UTF-8 text a hosts.toml can carry; {host} left alone"
    )]
    Unnamable {
        /// The file.
        path: PathBuf,
        /// `ca` or `client`.
        setting: &'static str,
        /// The source registry.
        host: String,
    },
    /// An admin's `[[registry]]` for the same prefix.
    #[error(
        "{path}: [[registry]] prefix = {prefix:?} sets {settings}; CRI-O keeps one [[registry]] per prefix (the last file's, whole), so pinswap's would replace it or be replaced by it: {registry} gets no mirror from pinswap (add pinswap's [[registry.mirror]] to that entry yourself, or remove it)"
    )]
    Registry {
        /// The registries.conf or drop-in.
        path: PathBuf,
        /// Its prefix, as written.
        prefix: String,
        /// Its settings: `blocked = true`, `insecure = true`, `mirror`,
        /// `location = ...`.
        settings: String,
        /// The source registry.
        registry: String,
    },
    /// A file of the node's configuration that cannot be read or parsed:
    /// what it sets is unknown.
    #[error("{path}: {reason}; what it sets is unknown, so {what} left as it is")]
    Unreadable {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        reason: String,
        /// What is held back.
        what: String,
    },
}

impl AdminError {
    /// Whether what the node sets is unknown: the files of ours stay as
    /// they are, neither rewritten nor removed.
    pub fn is_unknown(&self) -> bool {
        matches!(self, Self::Unreadable { .. })
    }
}

/// containerd's directory for the hosts that have none of their own.
pub const CONTAINERD_DEFAULT: &str = "_default";

/// Whether `path` is a regular file starting with [`HEADER`].
fn is_ours(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file())
        && std::fs::read(path).is_ok_and(|t| t.starts_with(HEADER.as_bytes()))
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The TLS files containerd loads from a host directory without a
/// `hosts.toml`, as paths relative to the host's own directory.
#[derive(Debug, Default, PartialEq, Eq)]
struct CertFiles {
    ca: Vec<String>,
    /// A certificate and its key (`None`: the key is in the certificate's
    /// file, as containerd then reads it).
    client: Vec<(String, Option<String>)>,
}

/// Reads `certs_dir` as containerd's loader does: `*.crt` are CAs, `*.cert`
/// client certificates with `<name>.key` beside them. `prefix` leads each
/// path (`""`, or `../_default/`). `Ok(None)` when it does not exist.
fn cert_files(
    certs_dir: &Path,
    prefix: &str,
    host: &str,
) -> Result<Option<(CertFiles, bool)>, AdminError> {
    let unreadable = |reason: String| AdminError::Unreadable {
        path: certs_dir.to_owned(),
        reason,
        what: host.to_owned(),
    };
    let entries = match std::fs::read_dir(certs_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(format!("cannot be listed ({e})"))),
    };
    let mut names = Vec::new();
    // Whether anything but a hosts.toml of ours is there.
    let mut others = false;
    for e in entries {
        let e = e.map_err(|e| unreadable(format!("cannot be listed ({e})")))?;
        let name = e.file_name();
        if name == "hosts.toml" && is_ours(&e.path()) {
            continue;
        }
        if name.to_string_lossy().ends_with(".pinswap-tmp") {
            continue;
        }
        others = true;
        // containerd skips directories (not links to them).
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        names.push(name);
    }
    names.sort();
    let mut files = CertFiles::default();
    for name in &names {
        let lossy = name.to_string_lossy();
        let setting = if lossy.ends_with(".crt") {
            "ca"
        } else if lossy.ends_with(".cert") {
            "client"
        } else {
            continue;
        };
        let Some(text) = name.to_str() else {
            return Err(AdminError::Unnamable {
                path: certs_dir.join(name),
                setting,
                host: host.to_owned(),
            });
        };
        if setting == "ca" {
            files.ca.push(format!("{prefix}{text}"));
        } else {
            let key = format!("{}.key", &text[..text.len() - ".cert".len()]);
            let has_key = names.iter().any(|n| n.to_str() == Some(&key));
            files.client.push((
                format!("{prefix}{text}"),
                has_key.then(|| format!("{prefix}{key}")),
            ));
        }
    }
    Ok(Some((files, others)))
}

/// The `hosts.toml` of ours for `host` (`contents`, as rendered) fitted to
/// the host directory under `dir`: the TLS files containerd would read
/// without it carried as `ca` and `client`.
///
/// # Errors
/// [`AdminError`] when the host directory is a link or no directory,
/// `_default` holds a `hosts.toml` of someone else's that would stop
/// applying to `host`, or a directory cannot be read.
pub fn containerd(dir: &Path, host: &str, contents: &str) -> Result<String, AdminError> {
    let host_dir = dir.join(host);
    match std::fs::symlink_metadata(&host_dir) {
        Ok(m) if !m.file_type().is_dir() => {
            return Err(AdminError::NotADirectory {
                path: host_dir,
                host: host.to_owned(),
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(AdminError::Unreadable {
                path: host_dir,
                reason: format!("cannot be inspected ({e})"),
                what: host.to_owned(),
            });
        }
    }
    // A directory with nothing of anyone else's in it: containerd would use
    // `_default` for the host once ours is gone, so `_default` is what the
    // node says for it.
    let files = match cert_files(&host_dir, "", host)? {
        Some((files, true)) => files,
        _ => {
            let default = dir.join(CONTAINERD_DEFAULT);
            let hosts = default.join("hosts.toml");
            match std::fs::symlink_metadata(&hosts) {
                Ok(_) if !is_ours(&hosts) => {
                    return Err(AdminError::Default {
                        path: hosts,
                        host: host.to_owned(),
                    });
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(AdminError::Unreadable {
                        path: hosts,
                        reason: format!("cannot be inspected ({e})"),
                        what: host.to_owned(),
                    });
                }
            }
            cert_files(&default, "../_default/", host)?
                .map(|(files, _)| files)
                .unwrap_or_default()
        }
    };
    if files == CertFiles::default() {
        return Ok(contents.to_owned());
    }
    let mut tls = String::from(
        "# The node's own TLS files for it, as containerd reads them without a hosts.toml.\n",
    );
    if !files.ca.is_empty() {
        let ca: Vec<String> = files.ca.iter().map(|c| toml_string(c)).collect();
        tls.push_str(&format!("ca = [{}]\n", ca.join(", ")));
    }
    if !files.client.is_empty() {
        let client: Vec<String> = files
            .client
            .iter()
            .map(|(cert, key)| match key {
                Some(key) => format!("[{}, {}]", toml_string(cert), toml_string(key)),
                None => toml_string(cert),
            })
            .collect();
        tls.push_str(&format!("client = [{}]\n", client.join(", ")));
    }
    // Top-level keys go before the first table: after `server = ...`.
    Ok(match contents.find("\n[") {
        Some(i) => format!("{}{tls}{}", &contents[..=i], &contents[i + 1..]),
        None => format!("{contents}{tls}"),
    })
}

/// A `[[registry]]` as registries.conf writes it.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Registry {
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    location: String,
    #[serde(default)]
    blocked: bool,
    #[serde(default)]
    insecure: bool,
    #[serde(default)]
    mirror: Vec<toml::Value>,
    #[serde(default)]
    mirror_by_digest_only: bool,
}

/// The version 1 tables (`[registries.block]`, `[registries.insecure]`).
#[derive(Debug, Default, Deserialize)]
struct V1Table {
    #[serde(default)]
    registries: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
struct V1 {
    #[serde(default)]
    block: V1Table,
    #[serde(default)]
    insecure: V1Table,
}

#[derive(Debug, Default, Deserialize)]
struct RegistriesConf {
    #[serde(default)]
    registry: Vec<Registry>,
    #[serde(default)]
    registries: V1,
}

/// Whether `prefix` (as sysregistriesv2 matches it) is the same as, or a
/// wildcard over, the registry `registry`: then a `[[registry]]` of ours
/// for `registry` decides for it instead.
fn covers(prefix: &str, registry: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    if prefix.eq_ignore_ascii_case(registry) {
        return true;
    }
    match prefix.strip_prefix("*.") {
        Some(suffix) => {
            let host = match registry.rsplit_once(':') {
                Some((h, p))
                    if !registry.ends_with(']')
                        && !p.is_empty()
                        && p.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    h
                }
                _ => registry,
            };
            host.to_ascii_lowercase()
                .ends_with(&format!(".{}", suffix.to_ascii_lowercase()))
        }
        None => false,
    }
}

/// The node's CRI-O configuration files: `registries_conf`, then each
/// `*.conf` in `dropins` but `ours`, in name order.
fn cri_o_files(
    registries_conf: &Path,
    dropins: &Path,
    ours: &str,
) -> Result<Vec<PathBuf>, AdminError> {
    let mut files = vec![registries_conf.to_owned()];
    let entries = match std::fs::read_dir(dropins) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(e) => {
            return Err(AdminError::Unreadable {
                path: dropins.to_owned(),
                reason: format!("cannot be listed ({e})"),
                what: "every registry".into(),
            });
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        // An entry that cannot be read may be a drop-in of the admin's.
        let entry = entry.map_err(|e| AdminError::Unreadable {
            path: dropins.to_owned(),
            reason: format!("cannot be listed ({e})"),
            what: "every registry".into(),
        })?;
        let n = entry.file_name();
        if n.to_string_lossy().ends_with(".conf") && n != ours {
            names.push(n);
        }
    }
    names.sort();
    files.extend(names.into_iter().map(|n| dropins.join(n)));
    Ok(files)
}

/// For each of `registries` (the prefixes of our drop-in `ours` in
/// `dropins`), whether `registries_conf` or another drop-in configures it:
/// those are refused with the file and its settings.
///
/// # Errors
/// [`AdminError::Unreadable`] when a file cannot be read or parsed: what
/// the node sets is unknown for every registry.
pub fn cri_o(
    registries_conf: &Path,
    dropins: &Path,
    ours: &str,
    registries: &[String],
) -> Result<Vec<AdminError>, AdminError> {
    let mut refused = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for path in cri_o_files(registries_conf, dropins, ours)? {
        let unreadable = |reason: String| AdminError::Unreadable {
            path: path.clone(),
            reason,
            what: "every registry".into(),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(unreadable(format!("cannot be read ({e})"))),
        };
        let conf: RegistriesConf = toml::from_str(&text)
            .map_err(|e| unreadable(format!("is no registries.conf pinswap can read ({e})")))?;
        let mut entries: Vec<(String, String)> = Vec::new();
        for r in &conf.registry {
            let prefix = if r.prefix.is_empty() {
                r.location.clone()
            } else {
                r.prefix.clone()
            };
            let mut settings = Vec::new();
            if r.blocked {
                settings.push("blocked = true".to_owned());
            }
            if r.insecure {
                settings.push("insecure = true".to_owned());
            }
            if !r.mirror.is_empty() {
                settings.push(format!("{} [[registry.mirror]]", r.mirror.len()));
            }
            if r.mirror_by_digest_only {
                settings.push("mirror-by-digest-only = true".to_owned());
            }
            if !r.location.is_empty() && r.location != prefix {
                settings.push(format!("location = {:?}", r.location));
            }
            if settings.is_empty() {
                settings.push(format!("location = {:?}", r.location));
            }
            entries.push((prefix, settings.join(", ")));
        }
        for r in &conf.registries.block.registries {
            entries.push((r.clone(), "[registries.block] (blocked)".to_owned()));
        }
        for r in &conf.registries.insecure.registries {
            entries.push((r.clone(), "[registries.insecure] (insecure)".to_owned()));
        }
        for (prefix, settings) in entries {
            for registry in registries.iter().filter(|r| covers(&prefix, r)) {
                if seen.insert((path.clone(), prefix.clone(), registry.clone())) {
                    refused.push(AdminError::Registry {
                        path: path.clone(),
                        prefix: prefix.clone(),
                        settings: settings.clone(),
                        registry: registry.clone(),
                    });
                }
            }
        }
    }
    Ok(refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_cover_subdomains_with_any_port() {
        assert!(covers("quay.io", "quay.io"));
        assert!(covers("Quay.io/", "quay.io"));
        assert!(covers("*.example.com", "r.example.com:5000"));
        assert!(covers("*.example.com", "a.r.example.com"));
        assert!(!covers("*.example.com", "example.com"));
        assert!(!covers("quay.io/org", "quay.io"));
        assert!(!covers("quay.io", "quay.io:5000"));
    }

    #[test]
    fn names_are_toml_strings() {
        assert_eq!(toml_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000A\"");
    }
}
