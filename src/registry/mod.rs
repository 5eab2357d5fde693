//! Registry access: a pool of per-registry clients with auth, the manifest
//! model, the OCI layout transport and the copy engine.
//!
//! Picking HTTPS or plain HTTP per registry, choosing credentials per
//! registry, every request to a registry (`requests.rs`: manifests, blobs,
//! the tag and catalog lists; ours rather than oci-client's, which pings
//! `/v2/` before each one), and errors that name the reference, the
//! registry, the HTTP status and the registry's error code
//! (distribution-spec §Error Codes). Of oci-client only the credential and
//! error-envelope types are used.

pub mod auth;
pub mod check;
pub mod client;
pub mod copy;
pub(crate) mod delete;
pub mod ecr;
mod error;
pub mod guard;
pub(crate) mod layout;
pub(crate) mod locations;
pub mod manifest;
pub mod proxy;
pub(crate) mod pullsecrets;
pub mod quota;
pub mod rate;
pub(crate) mod referrers;
mod requests;
pub(crate) mod session;
pub mod slots;
mod token;
mod upload;

pub use client::{ClientPool, PoolOptions, Registry, Role};
pub(crate) use error::{Ctx, chain, describe_body, retry_after};
pub use error::{Outage, RegistryError, Result};
pub use requests::{FetchedManifest, Precondition};
pub use upload::Mount;
