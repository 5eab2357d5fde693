//! The registry error type, the outages it can mean, and the description
//! of a registry's error envelope (distribution-spec §Error Codes).

use oci_client::errors::OciErrorCode;

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
         check the credentials for {registry}: the config's auth for it (serve, mutate), \
         or --src-creds/--dest-creds, --authfile or docker login (copy, check)"
    )]
    Unauthorized {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference or `repository@digest` being accessed.
        reference: String,
        /// What we were doing, e.g. `GET manifest`.
        operation: &'static str,
    },
    /// The registry answered 401 and we had no credentials for it.
    #[error(
        "registry {registry} requires authentication for {operation} {reference} (HTTP 401 UNAUTHORIZED) \
         and no credentials were found for it; give it auth in the config (serve, mutate), \
         or pass --src-creds/--dest-creds or --authfile, or run docker login (copy, check)"
    )]
    AuthRequired {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference or `repository@digest` being accessed.
        reference: String,
        /// What we were doing.
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
    /// The registry answered 429 or 5xx: it is there but will not serve now.
    #[error("{operation} {reference} on registry {registry} failed: HTTP {status} {}{}", status_text(*status), retry_after.map(|d| format!(" (Retry-After {}s)", d.as_secs())).unwrap_or_default())]
    Unavailable {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference being accessed.
        reference: String,
        /// What we were doing.
        operation: &'static str,
        /// HTTP status code (429 or 5xx).
        status: u16,
        /// The `Retry-After` the registry asked for, in whole seconds.
        retry_after: Option<std::time::Duration>,
    },
    /// A source's pull quota is used up ([`super::quota`]): nothing was
    /// pulled, or the registry answered 429 saying none remain.
    #[error("{reference}: {why}")]
    Quota {
        /// `host[:port]` of the registry.
        registry: String,
        /// The reference being pulled.
        reference: String,
        /// Whose quota, how much of it, in words.
        why: String,
        /// When to try again.
        retry_after: std::time::Duration,
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
    /// A target repository could not be made ready for the first push
    /// (an ECR repository that could not be created).
    #[error("preparing repository {repository} on registry {registry}: {reason}")]
    Prepare {
        /// `host[:port]` of the registry.
        registry: String,
        /// The repository.
        repository: String,
        /// Why.
        reason: String,
    },
    /// Credentials could not be read (an `auth::AuthError`). Boxed, here
    /// and in `Layout`, so that this file names neither module: both use
    /// it, and each converts its own error (`From` in its file).
    #[error(transparent)]
    Auth(Box<dyn std::error::Error + Send + Sync>),
    /// The OCI layout could not be read or written (a `layout::LayoutError`).
    #[error(transparent)]
    Layout(Box<dyn std::error::Error + Send + Sync>),
}

/// The distribution-spec code for 429, or the HTTP reason phrase.
fn status_text(status: u16) -> &'static str {
    match status {
        429 => "TOOMANYREQUESTS",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Server Error",
    }
}

/// `Retry-After` as delay-seconds (RFC 9110 §10.2.3). The HTTP-date form is
/// read as absent: registries send seconds, and a clock skew between us and
/// them would make a date meaningless.
pub(crate) fn retry_after(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(std::time::Duration::from_secs)
}

/// Why a registry could not answer at all (docs/architecture.md §3 "Source health"),
/// as opposed to answering that something is missing or invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outage {
    /// DNS, TCP or TLS failed, or the connection broke.
    Unreachable,
    /// No answer in time.
    Timeout,
    /// HTTP 429 (Docker Hub's pull rate limit).
    RateLimited,
    /// A pull quota is used up: the registry said none remain, or the
    /// fleet's pulls fill it ([`super::quota`]).
    QuotaExhausted,
    /// HTTP 5xx.
    ServerError,
    /// HTTP 401: the credentials stopped working.
    Unauthorized,
}

impl Outage {
    /// The metric label: `unreachable`, `timeout`, `rate_limited`,
    /// `quota_exhausted`, `server_error`, `unauthorized`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::Timeout => "timeout",
            Self::RateLimited => "rate_limited",
            Self::QuotaExhausted => "quota_exhausted",
            Self::ServerError => "server_error",
            Self::Unauthorized => "unauthorized",
        }
    }

    /// Whether it counts towards opening the circuit breaker: a registry in
    /// trouble, not one that refuses our credentials, nor a quota that is
    /// one account's (other accounts, and Pods' own pull secrets, still
    /// pull).
    pub fn trips(self) -> bool {
        !matches!(self, Self::Unauthorized | Self::QuotaExhausted)
    }
}

impl RegistryError {
    /// The registry (`host[:port]`) the error is about, when it names one.
    pub fn registry(&self) -> Option<&str> {
        match self {
            Self::Unreachable { registry, .. }
            | Self::Unauthorized { registry, .. }
            | Self::AuthRequired { registry, .. }
            | Self::Http { registry, .. }
            | Self::Unavailable { registry, .. }
            | Self::Quota { registry, .. }
            | Self::DigestMismatch { registry, .. }
            | Self::Manifest { registry, .. }
            | Self::Prepare { registry, .. }
            | Self::Other { registry, .. } => Some(registry),
            Self::Auth(_) | Self::Layout(_) => None,
        }
    }

    /// An outage in a few words, for decision notes and logs:
    /// `HTTP 429 TOOMANYREQUESTS`, `HTTP 503 Service Unavailable`,
    /// `connection refused`, or the transport error (at most 160
    /// characters); a 401 keeps the whole message, which names the fix.
    pub fn outage_cause(&self) -> String {
        match self {
            Self::Unavailable { status, .. } => format!("HTTP {status} {}", status_text(*status)),
            Self::Quota { why, .. } => why.clone(),
            Self::Http { status, code, .. } => match code {
                Some(c) => format!("HTTP {status} {c}"),
                None => format!("HTTP {status} {}", status_text(*status)),
            },
            // The whole text: it says which credentials to fix.
            Self::Unauthorized { .. } | Self::AuthRequired { .. } => self.to_string(),
            Self::Unreachable { reason, .. } => {
                let lower = reason.to_ascii_lowercase();
                if lower.contains("connection refused") {
                    "connection refused".into()
                } else if lower.contains("timed out") || lower.contains("timeout") {
                    "timed out".into()
                } else {
                    reason.chars().take(160).collect()
                }
            }
            other => other.to_string().chars().take(160).collect(),
        }
    }

    /// The outage this error shows, with the `Retry-After` the registry
    /// asked for, or `None` when the registry answered (404, a bad manifest,
    /// a digest mismatch...).
    pub fn outage(&self) -> Option<(Outage, Option<std::time::Duration>)> {
        let by_status = |status: u16| match status {
            429 => Some(Outage::RateLimited),
            408 => Some(Outage::Timeout),
            500..=599 => Some(Outage::ServerError),
            _ => None,
        };
        match self {
            Self::Unreachable { reason, .. } => Some((
                if reason.contains("timed out") || reason.contains("timeout") {
                    Outage::Timeout
                } else {
                    Outage::Unreachable
                },
                None,
            )),
            Self::Unavailable {
                status,
                retry_after,
                ..
            } => by_status(*status).map(|o| (o, *retry_after)),
            Self::Http { status, .. } => by_status(*status).map(|o| (o, None)),
            Self::Quota { retry_after, .. } => Some((Outage::QuotaExhausted, Some(*retry_after))),
            Self::Unauthorized { .. } | Self::AuthRequired { .. } => {
                Some((Outage::Unauthorized, None))
            }
            _ => None,
        }
    }
}

/// Result alias for this module.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Where an error happened, for [`RegistryError`] context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub registry: &'a str,
    pub reference: &'a str,
    pub operation: &'static str,
    /// No credentials were configured: a 401 means "log in", not "wrong password".
    pub anonymous: bool,
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

/// The code and message of a registry error body (distribution-spec §Error
/// Codes): the first error's code, and every error's message with its
/// `detail` (which often holds the real cause) and, after the first, its code.
/// A body that is not an error envelope is not quoted, only measured: it may
/// come from whatever a redirect led to, and errors can end up where a Pod's
/// author reads them (the decisions annotation).
pub(crate) fn describe_body(body: &str) -> (Option<String>, String) {
    match serde_json::from_str::<oci_client::errors::OciEnvelope>(body) {
        Ok(env) if !env.errors.is_empty() => describe_envelope(&env),
        _ if body.trim().is_empty() => (None, "empty body".into()),
        _ => (
            None,
            format!("a {}-byte body that is not a registry error", body.len()),
        ),
    }
}

fn describe_envelope(env: &oci_client::errors::OciEnvelope) -> (Option<String>, String) {
    let parts: Vec<String> = env
        .errors
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut m = if i == 0 {
                e.message.clone()
            } else {
                format!("{}: {}", code_name(&e.code), e.message)
            };
            if !e.detail.is_null() {
                let d = match &e.detail {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                m.push_str(&format!(" ({})", d.chars().take(200).collect::<String>()));
            }
            m
        })
        .collect();
    (
        env.errors.first().map(|e| code_name(&e.code)),
        parts.join("; "),
    )
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
    /// The error for a 401 at `ctx`.
    pub(crate) fn unauthorized(ctx: Ctx<'_>) -> Self {
        let (registry, reference, operation) = (
            ctx.registry.to_owned(),
            ctx.reference.to_owned(),
            ctx.operation,
        );
        if ctx.anonymous {
            Self::AuthRequired {
                registry,
                reference,
                operation,
            }
        } else {
            Self::Unauthorized {
                registry,
                reference,
                operation,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_keep_detail_and_every_code() {
        let (c, m) = describe_body(
            r#"{"errors":[{"code":"MANIFEST_INVALID","message":"manifest invalid","detail":"http: request body too large"}]}"#,
        );
        assert_eq!(c.as_deref(), Some("MANIFEST_INVALID"));
        assert_eq!(m, "manifest invalid (http: request body too large)");
        let (c, m) = describe_body(
            r#"{"errors":[{"code":"UNKNOWN","message":"unknown error"},{"code":"MANIFEST_BLOB_UNKNOWN","message":"blob unknown to registry","detail":"sha256:abc"}]}"#,
        );
        assert_eq!(c.as_deref(), Some("UNKNOWN"));
        assert_eq!(
            m,
            "unknown error; MANIFEST_BLOB_UNKNOWN: blob unknown to registry (sha256:abc)"
        );
        assert_eq!(
            describe_body("  bad gateway \n"),
            (None, "a 15-byte body that is not a registry error".into())
        );
        assert_eq!(describe_body(""), (None, "empty body".into()));
    }
}
