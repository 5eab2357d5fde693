//! What retention (src/retention/) asks of the mirror: the target's client,
//! whether a source still serves a digest (through its breaker and the
//! guard, with the source entry's auth), and forgetting a removed image.

use std::sync::Arc;

use super::{Mirror, MirrorError};
use crate::cache::Purge;
use crate::metrics::ErrorCause;
use crate::reference::Reference;
use crate::registry::Role;
use crate::registry::client::Registry;

/// Whether a source serves a pinned image, as [`Mirror::source_serves`]
/// found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceCheck {
    /// The source answers that digest: the image could be mirrored again.
    Serves,
    /// The source answered, but not with that digest (gone, moved, refused):
    /// why, in words.
    NotServed(String),
    /// The source cannot answer now (its breaker is not closed, down, a
    /// timeout, 5xx): why, in words.
    Down(String),
}

impl Mirror {
    /// The target registry's client.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when it cannot be reached.
    pub async fn target_client(&self) -> Result<Arc<Registry>, MirrorError> {
        Ok(self.pool.get(self.target.registry(), Role::Target).await?)
    }

    /// The name of the setting a copy's digest may differ from the
    /// source's under ([`super::copy_variant`]), when one is set.
    pub fn copy_variant(&self) -> Option<&str> {
        self.queue.variant()
    }

    /// Whether the source still serves `pinned` (a source reference with a
    /// digest): one HEAD by digest with the config's credentials for its
    /// registry, through its circuit breaker. Nothing is asked while the
    /// breaker is open or half-open.
    pub async fn source_serves(&self, pinned: &Reference) -> SourceCheck {
        let Some(digest) = pinned.digest() else {
            return SourceCheck::NotServed("no digest to compare".into());
        };
        let key = super::resolve::source_key(pinned);
        if !self.resolver.breakers().is_closed(&key) {
            return SourceCheck::Down(format!(
                "source registry {key} cannot answer (its circuit breaker is not closed)"
            ));
        }
        let head = self.resolver.ask(pinned, None, async {
            let client = self.pool.get(pinned.registry(), Role::Source).await?;
            Ok(client.head_manifest(&pinned.without_tag()).await?)
        });
        match head.await {
            Ok(Some(d)) if &d == digest => SourceCheck::Serves,
            Ok(Some(d)) => SourceCheck::NotServed(format!("the source answers {d} for it")),
            Ok(None) => SourceCheck::NotServed("the source no longer has this digest (404)".into()),
            Err(MirrorError::SourceDown {
                kind: ErrorCause::Credentials,
                cause,
                ..
            }) => SourceCheck::NotServed(format!(
                "the source refuses pinswap's credentials for it ({cause})"
            )),
            Err(MirrorError::SourceDown { cause, .. }) => {
                SourceCheck::Down(format!("source registry {key} cannot answer ({cause})"))
            }
            Err(e) => SourceCheck::NotServed(e.to_string()),
        }
    }

    /// Whether the source still has the tag of `tagged` (a source
    /// reference with a tag), whatever digest it names now: one HEAD, as
    /// [`Mirror::source_serves`]. A tag at the target that its source does
    /// not have is not known to be pinswap's.
    pub async fn source_has_tag(&self, tagged: &Reference) -> SourceCheck {
        let key = super::resolve::source_key(tagged);
        if !self.resolver.breakers().is_closed(&key) {
            return SourceCheck::Down(format!(
                "source registry {key} cannot answer (its circuit breaker is not closed)"
            ));
        }
        let head = self.resolver.ask(tagged, None, async {
            let client = self.pool.get(tagged.registry(), Role::Source).await?;
            Ok(client.head_manifest(tagged).await?)
        });
        match head.await {
            Ok(Some(_)) => SourceCheck::Serves,
            Ok(None) => SourceCheck::NotServed("the source has no such tag (404)".into()),
            Err(MirrorError::SourceDown {
                kind: ErrorCause::Credentials,
                cause,
                ..
            }) => SourceCheck::NotServed(format!(
                "the source refuses pinswap's credentials for it ({cause})"
            )),
            Err(MirrorError::SourceDown { cause, .. }) => {
                SourceCheck::Down(format!("source registry {key} cannot answer ({cause})"))
            }
            Err(e) => SourceCheck::NotServed(e.to_string()),
        }
    }

    /// Forgets what this replica knows of removed target `repository@digest`
    /// and its `tags`, so admission does not rewrite to it without asking
    /// the target again.
    pub async fn forget_removed(&self, target: &Reference, tags: &[String]) {
        let at = target.without_tag();
        self.caches.purge(&Purge::Existence(at.clone())).await;
        self.sources.invalidate(&at.to_string()).await;
        for t in tags {
            if let Ok(tagged) = at.without_digest().with_tag(t) {
                self.held_tags.invalidate(&tagged.to_string()).await;
            }
        }
    }
}
