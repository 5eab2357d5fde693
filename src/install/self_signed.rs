//! `pinswap serve --self-signed`: the webhook makes and distributes its own
//! serving certificate, for clusters without cert-manager.
//!
//! Every replica runs the same steps, so none needs to lead:
//! 1. Read the Secret (`pinswap-tls`, type `kubernetes.io/tls`). If it is
//!    missing, generate a CA and a serving certificate with rcgen and create
//!    it; a 409 AlreadyExists means another replica won, and its Secret is
//!    read instead. A Secret that is due for renewal (less than
//!    [`RENEW_BEFORE`] left, or other DNS names) is replaced with optimistic
//!    concurrency on `resourceVersion`; a 409 Conflict is retried from the
//!    read.
//!    A Secret is reused only if its certificate and key match, chain to its
//!    `ca.crt` and stay valid for [`RENEW_BEFORE`]; one of another `type`
//!    is an error, since the API cannot change a Secret's type.
//! 2. Patch the MutatingWebhookConfiguration's `caBundle` to the Secret's
//!    `ca.crt` unless it already trusts every CA in it, with a JSON patch
//!    that first tests the `resourceVersion` read.
//! 3. Write `tls.crt` and `tls.key` to files, which the server reloads.
//!
//! Then it repeats every [`RECHECK`], so a renewal by one replica reaches
//! the others and a `caBundle` reset by a re-apply is restored. A renewal
//! makes a new CA and keeps the previous one in `ca.crt` until the next
//! renewal, so Pods still serving the old certificate stay trusted.
//!
//! The CA key is not stored: nothing is ever signed with it again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio_util::sync::CancellationToken;

/// Lifetime of a generated serving certificate and of its CA.
pub const VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// A certificate with less than this left is replaced.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How often a running replica re-reads the Secret and the `caBundle`.
pub const RECHECK: Duration = Duration::from_secs(60);
/// Secret annotation: the serving certificate's notAfter (RFC 3339).
pub const NOT_AFTER: &str = "pinswap.dev/not-after";
/// Secret annotation: the serving certificate's DNS names, comma-separated.
pub const DNS_NAMES: &str = "pinswap.dev/dns-names";

/// Why the bootstrap failed.
#[derive(Debug, thiserror::Error)]
pub enum SelfSignedError {
    /// A Kubernetes API call failed (RBAC, connectivity, validation).
    #[error("{what}: {source}")]
    Kube {
        /// The call, e.g. `create Secret pinswap/pinswap-tls`.
        what: String,
        /// kube's error.
        source: kube::Error,
    },
    /// rcgen could not generate a key or certificate.
    #[error("cannot generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// The certificate files could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Renewals kept conflicting with other writers.
    #[error("Secret {0}: still conflicting after {1} attempts")]
    Conflicts(String, usize),
    /// The Secret exists but cannot be updated into a TLS Secret: its
    /// `type` (immutable in the API) is not `kubernetes.io/tls`, or it is
    /// marked `immutable`.
    #[error("{secret} has type {type_:?}{}; delete it and pinswap creates its own", if *.immutable { " and is immutable" } else { "" })]
    Foreign {
        /// `Secret NAMESPACE/NAME`.
        secret: String,
        /// Its `type`.
        type_: String,
        /// Whether it is marked immutable.
        immutable: bool,
    },
    /// The Secret is due for a new certificate, but pinswap did not make
    /// it (none of its annotations): it is never overwritten.
    #[error(
        "{0} is due for a new certificate, but pinswap did not make it (it has no {NOT_AFTER} or {DNS_NAMES} annotation, as one cert-manager or a person wrote); pinswap does not overwrite it: delete it and pinswap creates its own, or renew it where it came from"
    )]
    NotOurs(String),
}

/// What one pass did to the MutatingWebhookConfiguration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaBundle {
    /// It already held the Secret's `ca.crt`.
    Unchanged,
    /// It was patched.
    Patched,
    /// It does not exist (yet), or has no webhook calling our Service.
    Missing,
}

/// The certificate material, as stored in the Secret (PEM text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Material {
    /// The serving certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
    /// The CA bundle the API server must trust: the current CA, then the
    /// previous one during a renewal.
    pub ca_pem: String,
    /// The serving certificate's notAfter.
    pub not_after: SystemTime,
    /// The serving certificate's DNS names.
    pub dns_names: Vec<String>,
}

/// The objects one replica keeps true, and where it writes the files.
pub struct SelfSigned {
    secrets: Api<Secret>,
    webhooks: Api<MutatingWebhookConfiguration>,
    namespace: String,
    service: String,
    secret: String,
    webhook_configuration: String,
    cert_path: PathBuf,
    key_path: PathBuf,
}

impl SelfSigned {
    /// For Service `service` in `namespace`, Secret `secret` in the same
    /// namespace, and the cluster-scoped `webhook_configuration`. Files go
    /// to `cert_path` and `key_path` (their directory is created).
    pub fn new(
        client: kube::Client,
        namespace: &str,
        service: &str,
        secret: &str,
        webhook_configuration: &str,
        cert_path: PathBuf,
        key_path: PathBuf,
    ) -> Self {
        Self {
            secrets: Api::namespaced(client.clone(), namespace),
            webhooks: Api::all(client),
            namespace: namespace.to_owned(),
            service: service.to_owned(),
            secret: secret.to_owned(),
            webhook_configuration: webhook_configuration.to_owned(),
            cert_path,
            key_path,
        }
    }

    /// The startup pass: the Secret (created or renewed as needed) and the
    /// files. The `caBundle` is patched too, but a missing or unpatchable
    /// webhook configuration is only logged: [`SelfSigned::run`] retries it,
    /// and the API server's calls fail open meanwhile.
    ///
    /// # Errors
    /// As [`SelfSigned::secret`], or [`SelfSignedError::Write`].
    pub async fn bootstrap(&self) -> Result<Material, SelfSignedError> {
        let material = self.secret().await?;
        // caBundle first: a replica must not serve a certificate the API
        // server does not trust yet.
        self.patch_logged(&material).await;
        self.write_files(&material).await?;
        Ok(material)
    }

    /// Re-checks every [`RECHECK`] until `token` is cancelled: renews or
    /// picks up a renewed Secret, rewrites changed files, restores the
    /// `caBundle`. Errors are logged and retried on the next pass.
    pub async fn run(self, token: CancellationToken) {
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(RECHECK) => {}
            }
            match self.secret().await {
                Ok(material) => {
                    self.patch_logged(&material).await;
                    if let Err(e) = self.write_files(&material).await {
                        tracing::warn!(error = %e, "self-signed TLS: cannot write the certificate");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "self-signed TLS: cannot read or renew the Secret")
                }
            }
        }
    }

    async fn patch_logged(&self, material: &Material) {
        match self.patch_ca_bundle(material).await {
            Ok(CaBundle::Patched) => tracing::info!(
                webhook = %self.webhook_configuration,
                "self-signed TLS: caBundle set"
            ),
            Ok(CaBundle::Unchanged) => {}
            Ok(CaBundle::Missing) => tracing::warn!(
                webhook = %self.webhook_configuration,
                service = %format!("{}/{}", self.namespace, self.service),
                "self-signed TLS: no such MutatingWebhookConfiguration, or no webhook in it calls this Service; retrying"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "self-signed TLS: cannot patch the caBundle; retrying")
            }
        }
    }

    fn secret_path(&self) -> String {
        format!("Secret {}/{}", self.namespace, self.secret)
    }

    /// Reads the Secret, creating or renewing it when needed, and returns
    /// its material. Any replica may call it at any time.
    ///
    /// # Errors
    /// [`SelfSignedError::Kube`] when an API call fails other than by the
    /// expected 409s, [`SelfSignedError::Generate`], or
    /// [`SelfSignedError::Conflicts`] after 5 lost races in a row.
    pub async fn secret(&self) -> Result<Material, SelfSignedError> {
        const ATTEMPTS: usize = 5;
        let dns = super::dns_names(&self.service, &self.namespace);
        let kube_err = |what: &str| {
            let what = format!("{what} {}", self.secret_path());
            move |source| SelfSignedError::Kube { what, source }
        };
        for _ in 0..ATTEMPTS {
            let current = self
                .secrets
                .get_opt(&self.secret)
                .await
                .map_err(kube_err("get"))?;
            if let Some(c) = &current {
                let type_ = c.type_.as_deref().unwrap_or("Opaque");
                let immutable = c.immutable == Some(true);
                if type_ != "kubernetes.io/tls" || immutable {
                    return Err(SelfSignedError::Foreign {
                        secret: self.secret_path(),
                        type_: type_.to_owned(),
                        immutable,
                    });
                }
            }
            let previous = current.as_ref().and_then(material_of);
            // Judged by the certificate itself, not only by our annotation:
            // a Secret restored from a backup or edited by hand may not match.
            if let Some(m) = &previous
                && m.dns_names == dns
                && !due(m.not_after)
                && usable(m, &dns, SystemTime::now() + RENEW_BEFORE)
            {
                return Ok(m.clone());
            }
            let fresh = generate(&dns, previous.as_ref())?;
            let mut secret = secret_of(&self.secret, &fresh);
            let written = match current {
                None => self.secrets.create(&PostParams::default(), &secret).await,
                Some(current) if !made_here(&current) => {
                    return Err(SelfSignedError::NotOurs(self.secret_path()));
                }
                Some(current) => {
                    // Keep what others put there (labels, owner) and guard
                    // the write with the version we read.
                    secret.metadata = ObjectMeta {
                        annotations: merged(
                            current.metadata.annotations,
                            secret.metadata.annotations,
                        ),
                        ..current.metadata
                    };
                    self.secrets
                        .replace(&self.secret, &PostParams::default(), &secret)
                        .await
                }
            };
            match written {
                Ok(_) => {
                    tracing::info!(secret = %self.secret_path(), dns = ?dns, "self-signed TLS: stored a new certificate");
                    return Ok(fresh);
                }
                // Another replica created or renewed it first: use theirs.
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(kube_err("write")(e)),
            }
        }
        Err(SelfSignedError::Conflicts(self.secret_path(), ATTEMPTS))
    }

    /// Writes the certificate and key files when their content differs;
    /// returns whether anything was written. Each file is replaced by a
    /// rename, so the server never reads a half-written one.
    ///
    /// # Errors
    /// [`SelfSignedError::Write`].
    pub async fn write_files(&self, m: &Material) -> Result<bool, SelfSignedError> {
        let mut wrote = false;
        for (path, text) in [(&self.key_path, &m.key_pem), (&self.cert_path, &m.cert_pem)] {
            if tokio::fs::read(path).await.ok().as_deref() == Some(text.as_bytes()) {
                continue;
            }
            write_atomic(path, text.as_bytes())
                .await
                .map_err(|source| SelfSignedError::Write {
                    path: path.clone(),
                    source,
                })?;
            wrote = true;
        }
        Ok(wrote)
    }

    /// Sets `caBundle` of every webhook in the configuration whose
    /// `clientConfig.service` is our Service to `m.ca_pem`.
    ///
    /// # Errors
    /// [`SelfSignedError::Kube`] when the get or the patch fails (a failed
    /// `test` op, from a concurrent edit, is a 422).
    pub async fn patch_ca_bundle(&self, m: &Material) -> Result<CaBundle, SelfSignedError> {
        let name = &self.webhook_configuration;
        let kube_err = |what: &str| {
            let what = format!("{what} MutatingWebhookConfiguration {name}");
            move |source| SelfSignedError::Kube { what, source }
        };
        let Some(config) = self.webhooks.get_opt(name).await.map_err(kube_err("get"))? else {
            return Ok(CaBundle::Missing);
        };
        // Guards the whole patch: a concurrent change makes it fail (422)
        // instead of being overwritten; the next pass reads it again.
        let mut ops = vec![serde_json::json!({
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": config.metadata.resource_version,
        })];
        let mut ours = 0;
        for (i, webhook) in config.webhooks.iter().flatten().enumerate() {
            let calls_us = webhook
                .client_config
                .service
                .as_ref()
                .is_some_and(|s| s.name == self.service && s.namespace == self.namespace);
            if !calls_us {
                continue;
            }
            ours += 1;
            // Already trusting every CA we have: leave it, even with more.
            // A replica with older material must not drop a newer CA that
            // another replica added.
            let current = webhook
                .client_config
                .ca_bundle
                .as_ref()
                .map_or(&[][..], |b| &b.0[..]);
            if trusts_all(current, m.ca_pem.as_bytes()) {
                continue;
            }
            ops.push(serde_json::json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": webhook.name}));
            ops.push(serde_json::json!({
                "op": "add",
                "path": format!("/webhooks/{i}/clientConfig/caBundle"),
                "value": ByteString(m.ca_pem.clone().into_bytes()),
            }));
        }
        if ours == 0 {
            return Ok(CaBundle::Missing);
        }
        if ops.len() == 1 {
            return Ok(CaBundle::Unchanged);
        }
        // Built from valid ops above; a parse failure would be a bug.
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap_or_default();
        self.webhooks
            .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
            .map_err(kube_err("patch"))?;
        Ok(CaBundle::Patched)
    }
}

fn merged(
    a: Option<BTreeMap<String, String>>,
    b: Option<BTreeMap<String, String>>,
) -> Option<BTreeMap<String, String>> {
    let mut out = a.unwrap_or_default();
    out.extend(b.unwrap_or_default());
    Some(out)
}

/// Whether every certificate in `bundle` (PEM) is also in `current` (PEM).
fn trusts_all(current: &[u8], bundle: &[u8]) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let certs = |pem: &[u8]| {
        CertificateDer::pem_slice_iter(pem)
            .filter_map(Result::ok)
            .collect::<Vec<_>>()
    };
    let have = certs(current);
    let want = certs(bundle);
    !want.is_empty() && want.iter().all(|c| have.contains(c))
}

/// Whether the material serves TLS for every name in `dns` at time `at`:
/// the certificate and key parse and match, and the certificate chains to
/// `ca.crt` and is valid then (checked by rustls' WebPKI verifier).
fn usable(m: &Material, dns: &[String], at: SystemTime) -> bool {
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let Ok(certs) =
        CertificateDer::pem_slice_iter(m.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()
    else {
        return false;
    };
    let Some(leaf) = certs.first().cloned() else {
        return false;
    };
    let Ok(key) = PrivateKeyDer::from_pem_slice(m.key_pem.as_bytes()) else {
        return false;
    };
    // with_single_cert checks that the key belongs to the certificate.
    let keyed = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map(|b| b.with_no_client_auth().with_single_cert(certs.clone(), key));
    if !matches!(keyed, Ok(Ok(_))) {
        return false;
    }
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(m.ca_pem.as_bytes()) {
        if ca.ok().and_then(|ca| roots.add(ca).ok()).is_none() {
            return false;
        }
    }
    let Ok(verifier) = WebPkiServerVerifier::builder_with_provider(roots.into(), provider).build()
    else {
        return false;
    };
    let at = UnixTime::since_unix_epoch(
        at.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    dns.iter().all(|name| {
        ServerName::try_from(name.clone()).is_ok_and(|n| {
            verifier
                .verify_server_cert(&leaf, &certs[1..], &n, &[], at)
                .is_ok()
        })
    })
}

fn due(not_after: SystemTime) -> bool {
    not_after
        .duration_since(SystemTime::now())
        .map_or(true, |left| left < RENEW_BEFORE)
}

/// The material in a Secret, `None` when any part is missing or unreadable
/// (which makes the caller replace it).
fn material_of(secret: &Secret) -> Option<Material> {
    let data = secret.data.as_ref()?;
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.is_empty())
    };
    let notes = secret.metadata.annotations.as_ref()?;
    let not_after = humantime::parse_rfc3339(notes.get(NOT_AFTER)?).ok()?;
    Some(Material {
        cert_pem: text("tls.crt")?,
        key_pem: text("tls.key")?,
        ca_pem: text("ca.crt")?,
        not_after,
        dns_names: notes
            .get(DNS_NAMES)?
            .split(',')
            .map(str::to_owned)
            .collect(),
    })
}

/// Whether pinswap wrote `secret`: it carries one of pinswap's own
/// annotations (a copy restored from a backup keeps them).
fn made_here(secret: &Secret) -> bool {
    secret
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(NOT_AFTER) || a.contains_key(DNS_NAMES))
}

fn secret_of(name: &str, m: &Material) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                super::NAME.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (
                    NOT_AFTER.to_owned(),
                    humantime::format_rfc3339_seconds(m.not_after).to_string(),
                ),
                (DNS_NAMES.to_owned(), m.dns_names.join(",")),
            ])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("tls.crt".to_owned(), bytes(&m.cert_pem)),
            ("tls.key".to_owned(), bytes(&m.key_pem)),
            ("ca.crt".to_owned(), bytes(&m.ca_pem)),
        ])),
        ..Default::default()
    }
}

/// A new CA and a serving certificate for `dns` signed by it, both valid
/// for [`VALIDITY`] from one minute ago (clock skew). The previous bundle's
/// first CA is kept after the new one.
///
/// # Errors
/// [`SelfSignedError::Generate`] from rcgen.
pub fn generate(dns: &[String], previous: Option<&Material>) -> Result<Material, SelfSignedError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let now = SystemTime::now();
    let not_before = now - Duration::from_secs(60);
    let not_after = now + VALIDITY;
    // X.509 times have whole seconds; keep the annotation equal to the cert.
    let not_after = SystemTime::UNIX_EPOCH
        + Duration::from_secs(
            not_after
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        );

    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "pinswap webhook CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = not_before.into();
    ca.not_after = not_after.into();
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(dns.to_vec())?;
    if let Some(first) = dns.first() {
        leaf.distinguished_name
            .push(DnType::CommonName, first.as_str());
    }
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.not_before = not_before.into();
    leaf.not_after = not_after.into();
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

    let mut ca_pem = ca_cert.pem();
    if let Some(old) = previous.and_then(|p| first_pem(&p.ca_pem)) {
        ca_pem.push_str(old);
    }
    Ok(Material {
        cert_pem: leaf_cert.pem(),
        key_pem: leaf_key.serialize_pem(),
        ca_pem,
        not_after,
        dns_names: dns.to_vec(),
    })
}

/// The first PEM block of a bundle, with its trailing newline.
fn first_pem(bundle: &str) -> Option<&str> {
    const END: &str = "-----END CERTIFICATE-----";
    let end = bundle.find(END)? + END.len();
    let end = if bundle[end..].starts_with('\n') {
        end + 1
    } else {
        end
    };
    Some(&bundle[..end])
}

async fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await?;
    }
    let tmp = path.with_extension("tmp");
    tokio::fs::write(&tmp, bytes).await?;
    tokio::fs::rename(&tmp, path).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_keeps_the_previous_ca_and_only_that_one() {
        let dns = vec!["pinswap.pinswap.svc".to_owned()];
        let first = generate(&dns, None).unwrap();
        assert_eq!(first.ca_pem.matches("BEGIN CERTIFICATE").count(), 1);
        let second = generate(&dns, Some(&first)).unwrap();
        assert_eq!(second.ca_pem.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(second.ca_pem.ends_with(&first.ca_pem));
        let third = generate(&dns, Some(&second)).unwrap();
        assert_eq!(third.ca_pem.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(third.ca_pem.ends_with(first_pem(&second.ca_pem).unwrap()));
        assert!(!third.ca_pem.contains(&first.ca_pem));
    }

    #[test]
    fn secrets_round_trip_and_incomplete_ones_are_replaced() {
        let m = generate(&["a.b.svc".to_owned()], None).unwrap();
        let s = secret_of("x", &m);
        assert_eq!(material_of(&s), Some(m.clone()));
        let mut broken = s.clone();
        broken.data.as_mut().unwrap().remove("tls.key");
        assert_eq!(material_of(&broken), None);
        assert!(!due(SystemTime::now() + VALIDITY));
        let dns = m.dns_names.clone();
        assert!(usable(&m, &dns, SystemTime::now()));
        assert!(
            !usable(
                &m,
                &dns,
                SystemTime::now() + VALIDITY + Duration::from_secs(3600)
            ),
            "expired then"
        );
        assert!(
            !usable(&m, &["other.b.svc".to_owned()], SystemTime::now()),
            "another name"
        );
        let other = generate(&dns, None).unwrap();
        let swapped = Material {
            key_pem: other.key_pem.clone(),
            ..m.clone()
        };
        assert!(
            !usable(&swapped, &dns, SystemTime::now()),
            "a key of another certificate"
        );
        let foreign_ca = Material {
            ca_pem: other.ca_pem.clone(),
            ..m.clone()
        };
        assert!(
            !usable(&foreign_ca, &dns, SystemTime::now()),
            "a CA that did not sign it"
        );
        assert!(trusts_all(
            format!("{}{}", other.ca_pem, m.ca_pem).as_bytes(),
            m.ca_pem.as_bytes()
        ));
        assert!(!trusts_all(other.ca_pem.as_bytes(), m.ca_pem.as_bytes()));
        assert!(due(
            SystemTime::now() + RENEW_BEFORE - Duration::from_secs(1)
        ));
    }
}
