//! The mirror's errors: why a decision failed, why the target is not
//! ready, and which outage an error shows.

use std::time::Duration;

use crate::metrics::ErrorCause;
use crate::reference::{Reference, ReferenceError, normalize_registry};
use crate::registry::RegistryError;
use crate::registry::copy::CopyError;

/// Why the target cannot be used now (`/readyz`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// It does not answer `GET /v2/`.
    #[error("target {host} unreachable: {reason}")]
    Unreachable {
        /// The target registry.
        host: String,
        /// The transport error chain.
        reason: String,
    },
    /// Its client cannot be built, or it answered with an error.
    #[error("target {host}: {reason}")]
    Refused {
        /// The target registry.
        host: String,
        /// What failed.
        reason: String,
    },
}

/// Errors deciding about one image. Each names the image.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    /// The config's credentials could not be read (at startup).
    #[error("{path}: {reason}")]
    Credentials {
        /// Config key path.
        path: String,
        /// Why (never the secret).
        reason: String,
    },
    /// The target reference could not be built.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    /// A registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Resolving or planning failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// The ECR target could not sign in (at startup).
    #[error("target.aws: {0}")]
    Ecr(#[from] crate::registry::ecr::EcrError),
    /// The environment's proxy settings cannot be used (at startup).
    #[error(transparent)]
    Proxy(#[from] crate::registry::proxy::ProxyError),
    /// Resolution failed for a caller that waited on another's lookup.
    #[error("resolving {image}: {reason}")]
    Resolve {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
        /// The kind of failure, as [`MirrorError::cause`] gives it.
        kind: ErrorCause,
    },
    /// The source refused the read of another caller whose lookup this
    /// one waited on: its credentials, or a 404.
    #[error("resolving {image}: {reason}")]
    SourceRefused {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
        /// [`ErrorCause::Credentials`] or, for a 404, [`ErrorCause::Source`].
        kind: ErrorCause,
    },
    /// The copy the policy waits for failed or ran out of time.
    #[error("copy of {image} failed: {reason}")]
    CopyFailed {
        /// The source image.
        image: String,
        /// Why.
        reason: String,
        /// The kind of failure, as [`MirrorError::cause`] gives it.
        kind: ErrorCause,
    },
    /// The source could not answer (down, timeout, 5xx, 429, refused
    /// credentials, or its circuit breaker is open) and the target holds no
    /// copy that can stand in.
    #[error("source registry {registry} cannot answer ({cause}); {consequence}")]
    SourceDown {
        /// The source image.
        image: String,
        /// The source registry, normalised.
        registry: String,
        /// The failure, in words.
        cause: String,
        /// What follows for this image.
        consequence: String,
        /// [`ErrorCause::Credentials`] when the source refused our
        /// credentials, else [`ErrorCause::Source`].
        kind: ErrorCause,
    },
    /// A private image (it needs a Pod's own pull secret at the source), and
    /// no Pod it was asked for proves access.
    #[error("{image}: {reason}")]
    Private {
        /// The pinned source.
        image: String,
        /// Why, in words (never a credential).
        reason: String,
    },
    /// `identity.collisions: deny` and the image's image ID is not unique.
    /// Admission denies the Pod whatever `failurePolicy` says.
    #[error("{image}: {message}")]
    IdentityDenied {
        /// The source image.
        image: String,
        /// The findings and the fix.
        message: String,
    },
}

/// The outage `e` shows at source `registry` (normalised), with the
/// `Retry-After` it asked for and the failure in words; `None` for errors
/// of other registries (the target) and for answers that are not outages.
pub(super) fn source_outage(
    e: &MirrorError,
    registry: &str,
) -> Option<(crate::registry::Outage, Option<Duration>, String)> {
    let r = match e {
        MirrorError::Registry(r) | MirrorError::Copy(CopyError::Registry(r)) => r,
        _ => return None,
    };
    if r.registry().map(normalize_registry).as_deref() != Some(registry) {
        return None;
    }
    let (outage, retry_after) = r.outage()?;
    Some((outage, retry_after, r.outage_cause()))
}

/// The kind of a source outage: refused credentials, or the source.
pub(super) fn outage_kind(outage: crate::registry::Outage) -> ErrorCause {
    match outage {
        crate::registry::Outage::Unauthorized => ErrorCause::Credentials,
        _ => ErrorCause::Source,
    }
}

/// The kind of a registry error, `target` being the target registry
/// (normalised): a 401 (or credentials that cannot be read) is about
/// credentials whichever side answered it; anything else names the side.
pub(super) fn registry_kind(r: &RegistryError, target: &str) -> ErrorCause {
    match r {
        RegistryError::Unauthorized { .. }
        | RegistryError::AuthRequired { .. }
        | RegistryError::Auth(_) => ErrorCause::Credentials,
        _ if r.registry().map(normalize_registry).as_deref() == Some(target) => ErrorCause::Target,
        _ => ErrorCause::Source,
    }
}

/// The kind of a copy error (see [`registry_kind`]); a blob that failed
/// while streaming, or a manifest that is not the pinned one, is the
/// source's.
pub(super) fn copy_kind(e: &CopyError, target: &str) -> ErrorCause {
    match e {
        CopyError::Registry(r) => registry_kind(r, target),
        _ => ErrorCause::Source,
    }
}

impl MirrorError {
    /// Whether a source's pull quota stopped it ([`crate::registry::quota`]).
    pub fn is_quota(&self) -> bool {
        match self {
            MirrorError::Registry(RegistryError::Quota { .. })
            | MirrorError::Copy(CopyError::Registry(RegistryError::Quota { .. })) => true,
            MirrorError::SourceDown { cause, .. } => {
                cause.starts_with(crate::registry::quota::EXHAUSTED)
            }
            // The copy's own error in words: a quota's names itself so.
            MirrorError::CopyFailed { reason, kind, .. } => {
                *kind == ErrorCause::Source
                    && reason.contains(&format!(": {} at ", crate::registry::quota::EXHAUSTED))
            }
            _ => false,
        }
    }

    /// What kind of failure this is, as the `cause` label of
    /// `pinswap_admission_errors_total`; `target` is the target registry
    /// (`host[:port]`, normalised).
    pub fn cause(&self, target: &str) -> ErrorCause {
        match self {
            Self::Credentials { .. } | Self::Private { .. } => ErrorCause::Credentials,
            Self::Reference(_) => ErrorCause::Reference,
            Self::Registry(r) => registry_kind(r, target),
            Self::Copy(e) => copy_kind(e, target),
            Self::Ecr(_) => ErrorCause::Target,
            Self::Proxy(_) => ErrorCause::Source,
            Self::Resolve { kind, .. }
            | Self::SourceRefused { kind, .. }
            | Self::CopyFailed { kind, .. }
            | Self::SourceDown { kind, .. } => *kind,
            // A policy decision rather than a failure: admission counts it
            // as a denial, never through this.
            Self::IdentityDenied { .. } => ErrorCause::Source,
        }
    }

    /// Whether the source refused the read: our credentials, or a 404
    /// (`MANIFEST_UNKNOWN`, `NAME_UNKNOWN`) from a registry other than
    /// `target` (as in [`MirrorError::cause`]), which GHCR and Docker Hub
    /// answer to hide a private repository from credentials that may not
    /// see it. Other credentials may read it.
    pub(super) fn is_refusal(&self, target: &str) -> bool {
        let error = match self {
            Self::SourceRefused { .. } => return true,
            _ if self.cause(target) == ErrorCause::Credentials => return true,
            Self::Registry(r) | Self::Copy(CopyError::Registry(r)) => r,
            _ => return false,
        };
        matches!(error, RegistryError::Http { status: 404, registry, .. }
            if normalize_registry(registry) != target)
    }

    /// This error for a caller that waited on another's lookup (moka hands
    /// the waiters one shared error): a source outage stays one, so the
    /// waiter can fall back to the target too. `target` as in
    /// [`MirrorError::cause`].
    pub(super) fn for_waiter(&self, src: &Reference, target: &str) -> MirrorError {
        match self {
            MirrorError::SourceDown {
                registry,
                cause,
                consequence,
                kind,
                ..
            } => MirrorError::SourceDown {
                image: src.to_string(),
                registry: registry.clone(),
                cause: cause.clone(),
                consequence: consequence.clone(),
                kind: *kind,
            },
            other if other.is_refusal(target) => MirrorError::SourceRefused {
                image: src.to_string(),
                reason: other.to_string(),
                kind: other.cause(target),
            },
            other => MirrorError::Resolve {
                image: src.to_string(),
                reason: other.to_string(),
                kind: other.cause(target),
            },
        }
    }
}
