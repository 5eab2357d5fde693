//! Registry access: a pool of per-registry clients with auth, the manifest
//! model, the OCI layout transport and the copy engine.
//!
//! The distribution protocol itself is oci-client's. What lives here is what
//! oci-client leaves to its callers: picking HTTPS or plain HTTP per registry,
//! choosing credentials per registry, and turning its errors into messages
//! that name the reference, the registry, the HTTP status and the registry's
//! error code (distribution-spec §Error Codes).

pub mod auth;
mod check;
pub mod client;
pub mod copy;
pub mod layout;
pub mod manifest;
mod token;
mod upload;

pub use client::{ClientPool, PoolOptions, Registry, Role};

use oci_client::errors::{OciDistributionError, OciErrorCode};

/// Errors from talking to a registry. Every variant names the registry; none
/// ever carries a credential.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry could not be reached at all (DNS, TCP, TLS).
    #[error("cannot reach registry {registry}: {reason}")]
    Unreachable {
        /// `host[:port]` of the registry.
        registry: String,
        /// The transport error chain.
        reason: String,
    },
    /// The registry answered 401: no or wrong credentials.
    #[error(
        "registry {registry} rejected our credentials for {operation} {reference} (HTTP 401 UNAUTHORIZED); \
         check the credentials for {registry} (--src-creds/--dest-creds, --authfile or docker login)"
    )]
    Unauthorized {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference or `repository@digest` being accessed.
        reference: String,
        /// What we were doing, e.g. `GET manifest`.
        operation: &'static str,
    },
    /// The registry answered with an error status.
    #[error("{operation} {reference} on registry {registry} failed: HTTP {status}{code}: {message}", code = code.as_deref().map(|c| format!(" {c}")).unwrap_or_default())]
    Http {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference or `repository@digest` being accessed.
        reference: String,
        /// What we were doing.
        operation: &'static str,
        /// HTTP status code.
        status: u16,
        /// The distribution-spec error code (`MANIFEST_UNKNOWN`, `DENIED`, ...), if the body had one.
        code: Option<String>,
        /// The registry's message, or the body text.
        message: String,
    },
    /// Bytes did not match the digest that names them.
    #[error(
        "{what} {reference} from {registry}: digest mismatch, expected {expected}, got {actual}"
    )]
    DigestMismatch {
        /// `host[:port]`, or `oci:DIR` for a layout.
        registry: String,
        /// What was checked (`manifest`, `blob`).
        what: &'static str,
        /// The reference or `repository@digest`.
        reference: String,
        /// The digest we asked for.
        expected: String,
        /// What the bytes hash to, or a description of the fault.
        actual: String,
    },
    /// A manifest we cannot copy faithfully.
    #[error("manifest {reference} on {registry}: {reason}")]
    Manifest {
        /// `host[:port]`, or `oci:DIR` for a layout.
        registry: String,
        /// The reference.
        reference: String,
        /// Why.
        reason: String,
    },
    /// Any other failure, with context.
    #[error("{operation} {reference} on registry {registry} failed: {message}")]
    Other {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference or `repository@digest`.
        reference: String,
        /// What we were doing.
        operation: &'static str,
        /// The underlying error.
        message: String,
    },
    /// Credentials could not be read.
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    /// The OCI layout could not be read or written.
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
}

/// Result alias for this module.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Where an error happened, for [`RegistryError`] context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub registry: &'a str,
    pub reference: &'a str,
    pub operation: &'static str,
}

/// Canonical HTTP status of a distribution-spec error code, for errors that
/// oci-client reports without the status (its `RegistryError` variant).
fn status_of(code: &OciErrorCode) -> u16 {
    match code {
        OciErrorCode::BlobUnknown
        | OciErrorCode::BlobUploadUnknown
        | OciErrorCode::ManifestUnknown
        | OciErrorCode::NameUnknown
        | OciErrorCode::NotFound
        | OciErrorCode::ManifestBlobUnknown => 404,
        OciErrorCode::Unauthorized => 401,
        OciErrorCode::Denied => 403,
        OciErrorCode::Toomanyrequests => 429,
        OciErrorCode::Unsupported => 405,
        _ => 400,
    }
}

fn code_name(code: &OciErrorCode) -> String {
    match code {
        OciErrorCode::Other(s) => s.clone(),
        other => serde_json::to_value(other)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("{other:?}")),
    }
}

/// Whether an oci-client error means "no such manifest/blob/repository".
pub(crate) fn is_not_found(err: &OciDistributionError) -> bool {
    match err {
        OciDistributionError::RegistryError { envelope, .. } => {
            envelope.errors.iter().any(|e| status_of(&e.code) == 404)
        }
        OciDistributionError::ServerError { code, .. } => *code == 404,
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        _ => false,
    }
}

/// Renders an error and its sources on one line.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut src = err.source();
    while let Some(e) = src {
        let s = e.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        src = e.source();
    }
    out
}

impl RegistryError {
    /// Maps an oci-client error into one that names registry, reference,
    /// status and code.
    pub(crate) fn from_oci(ctx: Ctx<'_>, err: OciDistributionError) -> Self {
        let Ctx {
            registry,
            reference,
            operation,
        } = ctx;
        let (registry, reference) = (registry.to_owned(), reference.to_owned());
        match err {
            OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::AuthenticationFailure(_) => Self::Unauthorized {
                registry,
                reference,
                operation,
            },
            OciDistributionError::RegistryError { envelope, .. } => {
                let first = envelope.errors.first();
                let status = first.map(|e| status_of(&e.code)).unwrap_or(400);
                if status == 401 {
                    return Self::Unauthorized {
                        registry,
                        reference,
                        operation,
                    };
                }
                Self::Http {
                    registry,
                    reference,
                    operation,
                    status,
                    code: first.map(|e| code_name(&e.code)),
                    message: envelope
                        .errors
                        .iter()
                        .map(|e| e.message.clone())
                        .collect::<Vec<_>>()
                        .join("; "),
                }
            }
            OciDistributionError::ServerError { code, message, .. } => {
                if code == 401 {
                    return Self::Unauthorized {
                        registry,
                        reference,
                        operation,
                    };
                }
                let parsed: Option<oci_client::errors::OciEnvelope> =
                    serde_json::from_str(&message).ok();
                let (ecode, msg) = match parsed.as_ref().and_then(|p| p.errors.first()) {
                    Some(e) => (Some(code_name(&e.code)), e.message.clone()),
                    None => (None, message.trim().chars().take(300).collect()),
                };
                Self::Http {
                    registry,
                    reference,
                    operation,
                    status: code,
                    code: ecode,
                    message: msg,
                }
            }
            OciDistributionError::DigestError(e) => Self::DigestMismatch {
                registry,
                what: "content",
                reference,
                expected: "the digest in the reference".into(),
                actual: e.to_string(),
            },
            OciDistributionError::RequestError(e) if e.is_connect() || e.is_timeout() => {
                Self::Unreachable {
                    registry,
                    reason: chain(&e),
                }
            }
            other => Self::Other {
                registry,
                reference,
                operation,
                message: chain(&other),
            },
        }
    }
}
