//! Reloading the webhook certificate when its files change.
//!
//! cert-manager rotates the Secret, and the kubelet swaps the mounted files
//! in place; nothing restarts the Pod. [`CertWatcher`] polls the files'
//! modification time and size and reloads them into the live rustls config.
//! New connections get the new certificate; open ones keep theirs. A file
//! that fails to load (half-written, mismatched pair) is logged and the old
//! certificate stays in use; the reload is retried at the next poll.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use axum_server::tls_rustls::RustlsConfig;

/// The modification time and size of a file, or `None` while it is missing.
type Stamp = Option<(SystemTime, u64)>;

/// Reloads the certificate into the live rustls config when its files change.
pub(super) struct CertWatcher {
    tls: RustlsConfig,
    cert: PathBuf,
    key: PathBuf,
    /// The stamps of the files last loaded successfully.
    loaded: (Stamp, Stamp),
}

impl CertWatcher {
    pub(super) fn new(tls: RustlsConfig, cert: PathBuf, key: PathBuf) -> Self {
        let loaded = (stamp(&cert), stamp(&key));
        Self {
            tls,
            cert,
            key,
            loaded,
        }
    }

    pub(super) async fn run(mut self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is immediate
        loop {
            ticks.tick().await;
            self.poll().await;
        }
    }

    /// Reloads if either file changed since the last successful load. Returns
    /// whether a new certificate is now in use.
    async fn poll(&mut self) -> bool {
        let now = (stamp(&self.cert), stamp(&self.key));
        if now == self.loaded || now.0.is_none() || now.1.is_none() {
            return false;
        }
        match self.tls.reload_from_pem_file(&self.cert, &self.key).await {
            Ok(()) => {
                tracing::info!(cert = %self.cert.display(), "reloaded TLS certificate");
                self.loaded = now;
                true
            }
            Err(err) => {
                tracing::error!(
                    cert = %self.cert.display(), key = %self.key.display(), %err,
                    "cannot reload TLS certificate; keeping the previous one",
                );
                false
            }
        }
    }
}

fn stamp(path: &Path) -> Stamp {
    // `metadata` follows symlinks: the kubelet's `..data` swap shows up here.
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A self-signed certificate for 127.0.0.1: (cert PEM, key PEM).
    fn self_signed() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[tokio::test]
    async fn cert_watcher_reloads_changes_and_keeps_the_old_cert_on_errors() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let (pem, key_pem) = self_signed();
        std::fs::write(&cert, &pem).unwrap();
        std::fs::write(&key, &key_pem).unwrap();
        let tls = RustlsConfig::from_pem_file(&cert, &key).await.unwrap();
        let mut watcher = CertWatcher::new(tls.clone(), cert.clone(), key.clone());
        let first = tls.get_inner();

        assert!(!watcher.poll().await, "unchanged files must not reload");
        assert!(Arc::ptr_eq(&first, &tls.get_inner()));

        std::fs::write(&cert, "not a certificate").unwrap();
        assert!(!watcher.poll().await, "a broken file must not load");
        assert!(Arc::ptr_eq(&first, &tls.get_inner()), "old cert kept");

        std::fs::remove_file(&cert).unwrap();
        assert!(!watcher.poll().await, "a missing file must not load");

        let (pem, key_pem) = self_signed();
        std::fs::write(&cert, &pem).unwrap();
        std::fs::write(&key, &key_pem).unwrap();
        assert!(watcher.poll().await, "a new pair must load");
        assert!(!Arc::ptr_eq(&first, &tls.get_inner()));
        assert!(!watcher.poll().await, "and only once");
    }
}
