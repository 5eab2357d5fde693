//! `DELETE /v2/<name>/manifests/<reference>`: what retention removes
//! (src/retention/). Distribution 2.8 deletes a manifest by digest only,
//! and with it every tag that points at it; a DELETE by tag answers 400
//! `UNSUPPORTED` (or 405 when deletion is off).

use super::client::Registry;
use super::{RegistryError, Result};
use crate::reference::{Digest, Reference};

/// What a manifest DELETE did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// Accepted (202).
    Accepted,
    /// Nothing to delete (404).
    Absent,
    /// The registry does not delete this way: a tag on Distribution, or
    /// deletion turned off (400 `UNSUPPORTED`, 405).
    Unsupported,
}

impl Registry {
    /// DELETE manifest `r` by its digest, or by its tag when it has no
    /// digest.
    ///
    /// # Errors
    /// As [`Registry::refusal`] for other statuses.
    pub async fn delete_manifest(&self, r: &Reference) -> Result<Deleted> {
        let reference = match r.digest() {
            Some(d) => d.to_string(),
            None => r.tag().unwrap_or("latest").to_owned(),
        };
        let url = format!(
            "{}/v2/{}/manifests/{reference}",
            self.base(),
            r.repository()
        );
        let scopes = [format!("repository:{}:pull,push,delete", r.repository())];
        let name = r.to_string();
        let resp = self
            .send(&scopes, &name, || self.http().delete(&url))
            .await?;
        match resp.status().as_u16() {
            200..=299 => Ok(Deleted::Accepted),
            404 => Ok(Deleted::Absent),
            405 => Ok(Deleted::Unsupported),
            _ => match self.refusal(resp, &name, "DELETE manifest").await {
                RegistryError::Http {
                    status: 400,
                    code: Some(c),
                    ..
                } if c == "UNSUPPORTED" => Ok(Deleted::Unsupported),
                e => Err(e),
            },
        }
    }

    /// DELETE the manifest `digest` of `r`'s repository.
    ///
    /// # Errors
    /// As [`Registry::delete_manifest`].
    pub async fn delete_manifest_digest(&self, r: &Reference, digest: &Digest) -> Result<Deleted> {
        self.delete_manifest(&r.without_tag().with_digest(digest.clone()))
            .await
    }
}
