//! The mirror's side of image identity (docs/architecture.md §3 step 7): reading a
//! source's identity facts, reporting findings, and pushing the repaired
//! copy; the rules themselves are in [`crate::identity`].

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::{Assessed, Mirror, MirrorError, Plan};
use crate::config::CollisionPolicy;
use crate::identity::{self, Finding, Repair};
use crate::metrics::ErrorCause;
use crate::reference::Reference;
use crate::reference::normalize_registry;
use crate::registry::auth::Credentials;
use crate::registry::copy::{Copier, CopyError};
use crate::registry::{ClientPool, RegistryError, Role};

/// Pushes a repaired copy next to the original already at `dst`'s
/// repository: the new configs, the repaired children by digest, then the
/// repaired top under `dst`'s tag.
pub(super) async fn push_repair(
    pool: &ClientPool,
    copier: &Copier,
    dst: &Reference,
    r: &Repair,
) -> Result<(), CopyError> {
    let client = pool.get(dst.registry(), Role::Target).await?;
    for (desc, bytes) in &r.configs {
        if !client.blob_exists(dst, &desc.digest).await? {
            let b = bytes.clone();
            let stream: crate::registry::session::BlobStream = Box::pin(futures::stream::once(
                async move { Ok::<_, std::io::Error>(b) },
            ));
            client.push_blob(dst, desc, stream).await?;
        }
    }
    // Through the copier's per-manifest lock, as every manifest PUT is.
    for m in &r.children {
        let by_digest = dst.without_tag().with_digest(m.digest.clone());
        copier.put_manifest(&client, &by_digest, m).await?;
    }
    copier.put_manifest(&client, dst, &r.top).await?;
    info!(target = %dst, original = %r.original, "pushed a repaired copy (unique image IDs)");
    Ok(())
}

impl Mirror {
    /// The identity facts of `pinned` (an image pinned by digest), read once
    /// per digest from the source (`role` Source, through its circuit
    /// breaker) or from the target's copy (`role` Target), and the repair
    /// they call for.
    pub(super) async fn assess(
        &self,
        pinned: &Reference,
        role: Role,
        creds: Option<&Credentials>,
    ) -> Result<Arc<Assessed>, MirrorError> {
        // Cached (the usual case): no task to spawn.
        if let Some(hit) = self.assessed.get(&pinned.to_string()).await {
            return Ok(hit);
        }
        // In a task of its own: an admission that runs out of time drops
        // its wait, not the inspection, which finishes and is cached for the
        // next admission (moka joins concurrent lookups of one key).
        let (cache, pool, platforms) = (
            self.assessed.clone(),
            self.pool.clone(),
            self.platforms.clone(),
        );
        let (pinned, creds) = (pinned.clone(), creds.cloned());
        let breakers = self.resolver.breakers().clone();
        let target_key = self.target_key();
        let task = tokio::spawn(async move {
            cache
                .try_get_with(pinned.to_string(), async {
                    let registry = normalize_registry(pinned.registry());
                    let attempt = match role {
                        Role::Source => Some(breakers.attempt(&registry).map_err(|open| {
                            MirrorError::SourceDown {
                                image: pinned.to_string(),
                                registry: registry.clone(),
                                cause: format!("circuit breaker open after {open}"),
                                consequence: "its identity was not checked".into(),
                                kind: ErrorCause::Source,
                            }
                        })?),
                        Role::Target => None,
                    };
                    let inspected = async {
                        let client = pool
                            .get_with(pinned.registry(), role, creds.as_ref())
                            .await?;
                        identity::inspect(&client, &pinned, &platforms).await
                    }
                    .await;
                    if let Some(a) = attempt {
                        match inspected.as_ref().err().and_then(RegistryError::outage) {
                            Some((o, retry)) => a.failed(
                                o,
                                inspected
                                    .as_ref()
                                    .err()
                                    .map(RegistryError::outage_cause)
                                    .unwrap_or_default(),
                                retry,
                            ),
                            None => a.answered(),
                        }
                    }
                    let ins = inspected.map_err(|e| match (role, e.outage()) {
                        (Role::Source, Some((o, _))) => MirrorError::SourceDown {
                            image: pinned.to_string(),
                            registry: registry.clone(),
                            cause: e.outage_cause(),
                            consequence: "its identity was not checked".into(),
                            kind: super::outage_kind(o),
                        },
                        _ => e.into(),
                    })?;
                    let (repair, unrepaired) =
                        identity::plan_repair(&ins).map_err(|e| MirrorError::Resolve {
                            image: pinned.to_string(),
                            reason: e.to_string(),
                            kind: ErrorCause::Source,
                        })?;
                    Ok::<_, MirrorError>(Arc::new(Assessed {
                        images: ins
                            .images
                            .into_iter()
                            .map(|i| (i.platform, i.facts))
                            .collect(),
                        repair: repair.map(Arc::new),
                        unrepaired,
                    }))
                })
                .await
                .map_err(|e| match Arc::try_unwrap(e) {
                    Ok(e) => e,
                    Err(shared) => shared.for_waiter(&pinned, &target_key),
                })
        });
        task.await.unwrap_or_else(|e| {
            Err(MirrorError::Resolve {
                image: String::new(),
                reason: format!("identity check task: {e}"),
                kind: ErrorCause::Source,
            })
        })
    }

    /// The findings for `plan`'s images under their target references.
    /// Unless `dry`, they are recorded, and new ones are logged and counted
    /// once per (config, manifest).
    fn findings(&self, plan: &Plan, dry: bool) -> Vec<Finding> {
        let Some(a) = &plan.assessed else {
            return Vec::new();
        };
        let name = plan.target.without_digest().to_string();
        let found: Vec<Finding> = a
            .images
            .iter()
            .filter_map(|(platform, facts)| {
                let reference = match platform {
                    Some(p) => format!("{name} ({p})"),
                    None => name.clone(),
                };
                match dry {
                    true => self.record.peek(&reference, facts),
                    false => self.record.observe(&reference, facts),
                }
            })
            .collect();
        if !dry {
            for f in &found {
                let key = format!("{} {} {}", f.config, f.manifest, f.kind());
                let new = {
                    let mut reported = self.reported.lock().expect("reported lock");
                    // Bounded: forgetting only means logging a finding again.
                    if reported.len() >= 100_000 {
                        reported.clear();
                    }
                    reported.insert(key)
                };
                if new {
                    self.metrics.identity_finding(f.kind());
                    warn!(image = %name, source = %plan.source, finding = %f, "identity finding");
                }
            }
        }
        found
    }

    /// The identity annotation for `plan`, or the denial under
    /// `collisions: deny`. A `dry` run records nothing.
    pub(super) fn identity_note(
        &self,
        plan: &Plan,
        src: &Reference,
        dry: bool,
    ) -> Result<Option<String>, MirrorError> {
        let found = self.findings(plan, dry);
        if found.is_empty() {
            return Ok(None);
        }
        let join = |fs: &[&Finding]| {
            fs.iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        };
        let all: Vec<&Finding> = found.iter().collect();
        match self.collisions {
            CollisionPolicy::Deny => Err(MirrorError::IdentityDenied {
                image: src.to_string(),
                message: format!(
                    "{}. Nodes would run one of these artifacts in place of another. Fix: republish with Spin 2.4 or later, or with a config unique to the artifact, or set identity.collisions: repair",
                    join(&all)
                ),
            }),
            CollisionPolicy::Warn => Ok(Some(join(&all))),
            CollisionPolicy::Repair => {
                let mut parts = Vec::new();
                if let Some(r) = &plan.repair {
                    let configs = r
                        .replaced_configs
                        .iter()
                        .map(|(a, b)| format!("{a} -> {b}"))
                        .collect::<Vec<_>>()
                        .join(", ");
                    parts.push(format!(
                        "repaired: config {configs} (label {}); original manifest {}",
                        identity::CONTENT_LABEL,
                        r.original
                    ));
                }
                let unrepaired: &[(String, &str)] = plan
                    .assessed
                    .as_ref()
                    .map_or(&[], |a| a.unrepaired.as_slice());
                for (manifest, why) in unrepaired {
                    let these: Vec<&Finding> =
                        found.iter().filter(|f| &f.manifest == manifest).collect();
                    if !these.is_empty() {
                        parts.push(format!("not repaired ({why}): {}", join(&these)));
                    }
                }
                // Repair only touches configs that are non-unique on their
                // own; a layerless manifest colliding with a layered one has
                // nothing to label its config with. Its note must still say
                // what was found.
                let replaced = |f: &Finding| {
                    plan.repair.as_ref().is_some_and(|r| {
                        r.replaced_configs.iter().any(|(from, _)| from == &f.config)
                    })
                };
                let rest: Vec<&Finding> = found
                    .iter()
                    .filter(|f| !replaced(f) && !unrepaired.iter().any(|(m, _)| m == &f.manifest))
                    .collect();
                if !rest.is_empty() {
                    parts.push(format!(
                        "not repaired (no layers to label the config with): {}",
                        join(&rest)
                    ));
                }
                Ok(Some(parts.join("; ")))
            }
        }
    }

    /// Rebuilds the identity record from the target: every tag of every
    /// repository under the target (`GET /v2/_catalog`, then each
    /// repository's tags), at most `rate` tags a second, each inspected
    /// (manifest, children, configs) and recorded under its target
    /// reference. Findings are recorded, not reported: they are reported
    /// when an admission meets the image. Returns how many tags were read.
    ///
    /// # Errors
    /// [`MirrorError::Registry`] when the catalog cannot be listed (e.g. the
    /// registry does not serve it, or the credentials may not read it).
    /// Errors on single tags are logged and skipped.
    pub async fn rebuild_identity(&self, rate: u32) -> Result<usize, MirrorError> {
        let client = self.pool.get(self.target.registry(), Role::Target).await?;
        let prefix = self.target.prefix().map(|p| format!("{p}/"));
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
        let mut read = 0;
        for repo in client.catalog().await? {
            if prefix
                .as_ref()
                .is_some_and(|p| !repo.starts_with(p.as_str()))
            {
                continue;
            }
            let Ok(r) = Reference::parse(&format!("{}/{repo}", self.target.registry())) else {
                continue;
            };
            tick.tick().await;
            let tags = match client.tags(&r).await {
                Ok(t) => t,
                Err(e) => {
                    warn!(repository = %r.name(), error = %e, "identity scan: tags unreadable");
                    continue;
                }
            };
            for tag in tags {
                tick.tick().await;
                let Ok(tagged) = r.with_tag(&tag) else {
                    continue;
                };
                match identity::inspect(&client, &tagged, &[]).await {
                    Ok(ins) => {
                        read += 1;
                        let name = tagged.to_string();
                        for img in &ins.images {
                            let reference = match &img.platform {
                                Some(p) => format!("{name} ({p})"),
                                None => name.clone(),
                            };
                            self.record.observe(&reference, &img.facts);
                        }
                    }
                    Err(e) => debug!(image = %tagged, error = %e, "identity scan: skipped"),
                }
            }
        }
        info!(
            tags = read,
            configs = self.record.configs(),
            "identity record rebuilt from the target"
        );
        Ok(read)
    }
}
