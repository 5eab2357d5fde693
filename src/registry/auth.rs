//! Credentials: explicit `user:password`, an authfile, or the Docker config
//! (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`), credential
//! helpers included.
//!
//! Lookup follows Docker and skopeo: explicit credentials for that side of the
//! copy win, then `--authfile`, then the Docker config; otherwise anonymous.
//! Parsing and helper calls are docker_credential's. Credentials are never
//! formatted into logs or errors: [`Credentials`] redacts its `Debug`.

use std::path::{Path, PathBuf};

use oci_client::secrets::RegistryAuth;

use super::RegistryError;

/// Errors reading credentials. Messages name the file and the registry,
/// never a secret.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// `--src-creds`/`--dest-creds` was not `USER:PASSWORD`.
    #[error(
        "{flag}: expected USER:PASSWORD, a non-empty user and a ':' (the password after it may be empty, as in `USER:`)"
    )]
    BadCreds {
        /// The flag or env var name.
        flag: &'static str,
    },
    /// The authfile could not be read or parsed.
    #[error("authfile {path}: {reason}")]
    AuthFile {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A credential helper failed.
    #[error("credentials for {registry} from {source_name}: {reason}")]
    Helper {
        /// The registry.
        registry: String,
        /// Where the lookup came from.
        source_name: String,
        /// Why: docker_credential's error on one line of at most 200
        /// characters (it can quote the helper's output).
        reason: String,
    },
}

impl From<AuthError> for RegistryError {
    fn from(e: AuthError) -> Self {
        RegistryError::Auth(Box::new(e))
    }
}

/// A username and password. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The username.
    pub username: String,
    password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}:<redacted>)", self.username)
    }
}

impl Credentials {
    /// Parses `USER:PASSWORD` as skopeo's `--creds` does (split at the first
    /// `:`). `flag` names the flag for the error message.
    ///
    /// # Errors
    /// [`AuthError::BadCreds`] when there is no `:` or the user is empty.
    pub fn parse(s: &str, flag: &'static str) -> Result<Self, AuthError> {
        match s.split_once(':') {
            Some((u, p)) if !u.is_empty() => Ok(Self {
                username: u.to_owned(),
                password: p.to_owned(),
            }),
            _ => Err(AuthError::BadCreds { flag }),
        }
    }

    /// Credentials from parts (config files, env).
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            username: username.into(),
            password: password.into(),
        }
    }

    /// A stable, non-reversible key for these credentials (sha256 of
    /// `user:password`), to keep clients apart per credentials.
    pub fn fingerprint(&self) -> String {
        use sha2::Digest as _;
        let hash = sha2::Sha256::digest(format!("{}:{}", self.username, self.password));
        format!("sha256:{}", hex::encode(hash))
    }

    /// The credentials as oci-client's basic auth.
    pub fn to_auth(&self) -> RegistryAuth {
        RegistryAuth::Basic(self.username.clone(), self.password.clone())
    }
}

/// Where to look for credentials, in order.
#[derive(Debug, Clone, Default)]
pub struct CredentialSources {
    /// An explicit authfile (`--authfile`), Docker config.json format.
    pub authfile: Option<PathBuf>,
    /// Whether to read `$DOCKER_CONFIG/config.json` / `~/.docker/config.json`.
    pub docker_config: bool,
}

/// The keys a Docker config may use for `registry`: Docker Hub is stored
/// under its v1 index URL; other registries by host, sometimes with scheme.
fn config_keys(registry: &str) -> Vec<String> {
    if registry == "docker.io" {
        vec![
            "https://index.docker.io/v1/".into(),
            "index.docker.io".into(),
            "docker.io".into(),
        ]
    } else {
        vec![registry.to_owned(), format!("https://{registry}")]
    }
}

fn to_auth(c: docker_credential::DockerCredential) -> RegistryAuth {
    match c {
        docker_credential::DockerCredential::UsernamePassword(u, p) => RegistryAuth::Basic(u, p),
        // An identity token is a refresh token for the bearer flow; registries
        // accept it as the password of the `<token>` user.
        docker_credential::DockerCredential::IdentityToken(t) => {
            RegistryAuth::Basic("<token>".into(), t)
        }
    }
}

/// The credential helper a Docker config names for `key`, if any
/// (`credHelpers[key]`, else `credsStore`), for error messages.
fn helper_for(conf: &serde_json::Value, key: &str) -> Option<String> {
    conf.get("credHelpers")
        .and_then(|h| h.get(key))
        .or_else(|| conf.get("credsStore"))
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(|s| format!("docker-credential-{s}"))
}

/// Looks `registry` up in one Docker-format config file's bytes.
fn lookup(registry: &str, path: &Path, bytes: &[u8]) -> Result<Option<RegistryAuth>, AuthError> {
    use docker_credential::CredentialRetrievalError as E;
    let conf: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| AuthError::AuthFile {
            path: path.to_owned(),
            reason: format!("not valid JSON: {e}"),
        })?;
    for key in config_keys(registry) {
        match docker_credential::get_credential_from_reader(bytes, &key) {
            Ok(c) => return Ok(Some(to_auth(c))),
            Err(E::NoCredentialConfigured | E::ConfigNotFound) => {}
            Err(e) => {
                let helper = helper_for(&conf, &key);
                let source_name = match &helper {
                    Some(h) => format!("{} (helper {h})", path.display()),
                    None => path.display().to_string(),
                };
                // docker_credential's message can hold the helper's whole
                // stdout and stderr: keep one short line of it.
                // stdout is dropped: a helper writes credentials there.
                let mut reason = match &e {
                    E::HelperFailure { helper, stderr, .. } => {
                        one_line(&format!("credential helper {helper} failed: {stderr}"), 200)
                    }
                    e => one_line(&e.to_string(), 200),
                };
                // "Unable to communicate" usually means a helper that is
                // not installed.
                if let Some(h) = helper
                    && !on_path(&h)
                {
                    reason = format!(
                        "{h} is not on PATH (the pinswap image holds only pinswap: add the helper to an image built from it); {reason}"
                    );
                }
                return Err(AuthError::Helper {
                    registry: registry.to_owned(),
                    source_name,
                    reason,
                });
            }
        }
    }
    Ok(None)
}

/// `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, as Docker
/// and docker_credential resolve it.
fn docker_config_path() -> Option<PathBuf> {
    std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker")))
        .map(|d| d.join("config.json"))
}

/// `text` on one line (controls and line breaks become spaces), at most
/// `max` characters, with `…` when cut.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let flat = flat.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &flat[..i]),
        None => flat,
    }
}

/// Whether an executable `name` is in one of `$PATH`'s directories.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

impl CredentialSources {
    /// Credentials for `registry` (`host[:port]`, Docker Hub as `docker.io`),
    /// or `None` for anonymous access. Blocking (file reads, helper
    /// processes): call from `spawn_blocking`.
    ///
    /// # Errors
    /// [`AuthError::AuthFile`] when the authfile is unreadable or not JSON,
    /// [`AuthError::Helper`] when a credential helper fails.
    pub fn lookup_blocking(&self, registry: &str) -> Result<Option<RegistryAuth>, AuthError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| AuthError::AuthFile {
                path: path.to_owned(),
                reason: e.to_string(),
            })
        };
        if let Some(path) = &self.authfile {
            let found = lookup(registry, path, &read(path)?)?;
            if found.is_some() {
                return Ok(found);
            }
        }
        // A missing Docker config is normal; a broken one is an error, not
        // silently anonymous.
        if self.docker_config
            && let Some(path) = docker_config_path()
            && path.is_file()
        {
            return lookup(registry, &path, &read(&path)?);
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_text_is_kept_to_one_short_line() {
        assert_eq!(one_line("a\n\nb\tc  ", 10), "a b c");
        assert_eq!(
            one_line(&"x".repeat(300), 200),
            format!("{}…", "x".repeat(200))
        );
    }

    #[test]
    fn a_missing_credential_helper_is_named() {
        let conf = br#"{"credHelpers": {"reg.example": "pinswap-test-absent"}}"#;
        let e = lookup("reg.example", Path::new("/c/config.json"), conf)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("credentials for reg.example from /c/config.json (helper docker-credential-pinswap-test-absent): docker-credential-pinswap-test-absent is not on PATH"),
            "{e}"
        );
    }

    #[test]
    fn creds_parse_and_redact() {
        let c = Credentials::parse("alice:s3cr:et", "--src-creds").unwrap();
        assert_eq!(c.username, "alice");
        assert_eq!(
            c.to_auth(),
            RegistryAuth::Basic("alice".into(), "s3cr:et".into())
        );
        assert!(!format!("{c:?}").contains("s3cr"));
        let e = Credentials::parse("alice", "--dest-creds").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--dest-creds: expected USER:PASSWORD, a non-empty user and a ':' (the password after it may be empty, as in `USER:`)"
        );
        assert!(Credentials::parse(":pw", "--src-creds").is_err());
        // What the message promises: an empty password after the ':'.
        let c = Credentials::parse("alice:", "--src-creds").unwrap();
        assert_eq!(c.to_auth(), RegistryAuth::Basic("alice".into(), "".into()));
    }

    #[test]
    fn authfile_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("auth.json");
        // "bob:hunter2"
        std::fs::write(
            &path,
            r#"{"auths":{"127.0.0.1:5000":{"auth":"Ym9iOmh1bnRlcjI="},"https://index.docker.io/v1/":{"auth":"Ym9iOmh1bnRlcjI="}}}"#,
        )
        .unwrap();
        let s = CredentialSources {
            authfile: Some(path.clone()),
            docker_config: false,
        };
        let want = Some(RegistryAuth::Basic("bob".into(), "hunter2".into()));
        assert_eq!(s.lookup_blocking("127.0.0.1:5000").unwrap(), want);
        assert_eq!(s.lookup_blocking("docker.io").unwrap(), want);
        assert_eq!(s.lookup_blocking("127.0.0.1:5001").unwrap(), None);

        std::fs::write(&path, "{not json").unwrap();
        let e = s.lookup_blocking("127.0.0.1:5000").unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("authfile {}: not valid JSON", path.display())),
            "{e}"
        );
    }

    #[test]
    fn missing_helper_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("auth.json");
        std::fs::write(
            &path,
            r#"{"credHelpers":{"127.0.0.1:5000":"pinswap-test-no-such-helper"}}"#,
        )
        .unwrap();
        let s = CredentialSources {
            authfile: Some(path),
            docker_config: false,
        };
        let e = s.lookup_blocking("127.0.0.1:5000").unwrap_err().to_string();
        assert!(e.starts_with("credentials for 127.0.0.1:5000 from "), "{e}");
        assert!(
            e.contains("(helper docker-credential-pinswap-test-no-such-helper)"),
            "{e}"
        );
    }
}
