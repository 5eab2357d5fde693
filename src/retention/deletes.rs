//! Whether the target takes DELETE at all. Some registries never do: GHCR
//! through the registry API (packages go through GitHub's REST API), a
//! Distribution with `storage.delete.enabled` off, credentials without the
//! right to delete. On such a target retention removes nothing, and says
//! so once per stretch, instead of failing on every image at every pass.
//!
//! The question is one DELETE of a manifest digest that no registry holds
//! (the digest of a text pinswap never pushes): it cannot remove anything,
//! and a registry answers it as it would answer a real one.

use crate::reference::Reference;
use crate::registry::client::Registry;
use crate::registry::delete::Deleted;
use crate::registry::{RegistryError, chain};

/// What the target said about DELETE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Deletes {
    /// It deletes.
    Taken,
    /// It refuses every DELETE: why.
    Refused(String),
    /// It did not answer the question: why. Nothing is removed this pass.
    Unknown(String),
}

/// Hashed into the digest asked about; never pushed anywhere.
const PROBE: &[u8] =
    b"pinswap: a manifest no registry holds, asked to learn whether DELETE is taken";

/// Asks `client` to DELETE a manifest no registry holds in `repo`.
pub(super) async fn probe(client: &Registry, repo: &Reference) -> Deletes {
    let digest = crate::registry::check::sha256_digest(PROBE);
    match client.delete_manifest_digest(repo, &digest).await {
        Ok(Deleted::Absent | Deleted::Accepted) => Deletes::Taken,
        Ok(Deleted::Unsupported) => Deletes::Refused(format!(
            "the target registry {} refuses DELETE (405 or UNSUPPORTED: GHCR always does, \
             Distribution with storage.delete.enabled off)",
            client.host()
        )),
        Err(
            e @ RegistryError::Http {
                status: 401 | 403, ..
            },
        ) => Deletes::Refused(format!(
            "the target's credentials may not delete: {}",
            chain(&e)
        )),
        Err(e) => Deletes::Unknown(chain(&e)),
    }
}
