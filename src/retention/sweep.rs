//! One retention pass: list what pinswap wrote at the target, map what is
//! in use onto it, update the record, check the sources, remove.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tracing::{debug, error, info, warn};

use super::clusters::{ClusterRecord, age};
use super::deletes::Deletes;
use super::{Image, InUse, Report, Retention, RetentionError, State};
use crate::metrics::{Metrics, StateLabel};
use crate::mirror::retention::SourceCheck;
use crate::reference::{Digest, Reference};
use crate::registry::client::Registry;
use crate::registry::delete::Deleted;

/// A target repository pinswap mirrors into.
struct Repository {
    /// `registry/repository`, no tag or digest.
    target: Reference,
    /// The source it mirrors (no tag or digest).
    source: Reference,
    /// Manifest → the tags pointing at it.
    manifests: BTreeMap<Digest, Vec<String>>,
}

/// Another cluster's claim on a manifest, from its usage record.
#[derive(Debug, Clone)]
struct Claim {
    /// The cluster.
    cluster: String,
    /// When it last used it.
    last: Timestamp,
    /// In use there when the record was published.
    now: bool,
    /// The record is stale: it keeps everything it lists.
    stale: bool,
}

impl Claim {
    /// Which of two claims on one manifest counts: stale, then in use,
    /// then the later use.
    fn rank(&self) -> (bool, bool, Timestamp) {
        (self.stale, self.now, self.last)
    }
}

fn by_name(repos: &[Repository]) -> HashMap<String, &Repository> {
    repos.iter().map(|r| (r.target.to_string(), r)).collect()
}

/// The manifests `mapped` (a target reference) names: its digest, and
/// those listed under its tag or an anchor of its digest.
fn named(mapped: &Reference, by_name: &HashMap<String, &Repository>) -> Vec<String> {
    let repo = mapped.without_tag().without_digest();
    let mut out = Vec::new();
    if let Some(d) = mapped.digest() {
        out.push(repo.with_digest(d.clone()).to_string());
    }
    let Some(listed) = by_name.get(&repo.to_string()) else {
        return out;
    };
    for (d, tags) in &listed.manifests {
        let named = tags.iter().any(|t| {
            Some(t.as_str()) == mapped.tag()
                || anchor(t).is_some_and(|(s, _)| Some(&s) == mapped.digest())
        });
        if named {
            out.push(repo.with_digest(d.clone()).to_string());
        }
    }
    out
}

/// The source registry `repo` mirrors, normalised.
/// Whether a pass removes, or only says what it would remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Run,
    Plan,
}

fn source_registry(repo: &Repository) -> String {
    crate::reference::normalize_registry(repo.source.registry())
}

/// The source digest an anchor tag names (`pinswap-<hex>` or
/// `pinswap-<hex>-<variant>`), with its variant.
fn anchor(tag: &str) -> Option<(Digest, Option<&str>)> {
    let rest = tag.strip_prefix("pinswap-")?;
    let (hex, variant) = match rest.split_once('-') {
        Some((h, v)) => (h, Some(v)),
        None => (rest, None),
    };
    let lower_hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if hex.len() != 64 || !lower_hex(hex) || variant.is_some_and(|v| v.len() != 12 || !lower_hex(v))
    {
        return None;
    }
    Some((Digest::parse(&format!("sha256:{hex}")).ok()?, variant))
}

/// The source registry of `image` (by its repository in `sources`) and
/// why it could not answer, when it is in `down`.
fn held_by<'d>(
    sources: &HashMap<String, String>,
    image: &Reference,
    down: &'d BTreeMap<String, String>,
) -> Option<(&'d String, &'d String)> {
    let source = sources.get(&image.without_digest().without_tag().to_string())?;
    down.get_key_value(source)
}

/// Whether `tag` is one pinswap writes: anything but the referrers tag
/// schema (`sha256-<hex>`, with cosign's `.sig`, `.att`, `.sbom`), which
/// names signatures and attestations by their subject.
fn is_own(tag: &str) -> bool {
    !(tag.starts_with("sha256-") || tag.starts_with("sha512-"))
}

impl Retention {
    /// The source `repository` mirrors ([`super::mirrored_source`]).
    fn source_of(&self, repository: &str) -> Option<Reference> {
        super::mirrored_source(self.mirror.target(), &self.policy, repository)
    }

    /// Every repository pinswap mirrors into, with its manifests by tag.
    async fn list(
        &self,
        client: &crate::registry::client::Registry,
    ) -> Result<Vec<Repository>, RetentionError> {
        let registry = self.mirror.target().registry();
        let mut out = Vec::new();
        let names = match self.mirror.ecr() {
            Some(ecr) => ecr.repositories().await?,
            None => client.catalog().await?,
        };
        for name in names {
            let Some(source) = self.source_of(&name) else {
                continue;
            };
            let Ok(target) = Reference::parse(&format!("{registry}/{name}")) else {
                continue;
            };
            let target = target.without_tag();
            let mut manifests: BTreeMap<Digest, Vec<String>> = BTreeMap::new();
            for tag in client.tags(&target).await? {
                let Ok(tagged) = target.with_tag(&tag) else {
                    continue;
                };
                if let Some(d) = client.manifest_digest(&tagged).await? {
                    manifests.entry(d).or_default().push(tag);
                }
            }
            out.push(Repository {
                target,
                source,
                manifests,
            });
        }
        Ok(out)
    }

    /// The manifests `in_use` names, as `registry/repository@digest`.
    fn in_use(&self, in_use: &InUse, repos: &[Repository]) -> HashSet<String> {
        let target = self.mirror.target();
        let by_name = by_name(repos);
        let mut out = HashSet::new();
        for image in &in_use.images {
            let mapped = match target.contains(image) {
                // Host names match ignoring case (`contains` does too), so
                // the key takes the target's own spelling of its registry.
                true => match Reference::new(
                    target.registry(),
                    image.repository(),
                    image.tag(),
                    image.digest().cloned(),
                ) {
                    Ok(m) => m,
                    Err(_) => image.clone(),
                },
                false => match target.map(image) {
                    Ok(m) => m,
                    Err(_) => continue,
                },
            };
            out.extend(named(&mapped, &by_name));
        }
        out
    }

    /// What the other clusters' `records` claim, by manifest
    /// (`registry/repository@digest`) as `repos` lists them.
    fn claims(
        &self,
        records: &[ClusterRecord],
        repos: &[Repository],
        now: Timestamp,
        stale_after: Duration,
    ) -> HashMap<String, Claim> {
        let registry = self.mirror.target().registry();
        let by_name = by_name(repos);
        let mut out: HashMap<String, Claim> = HashMap::new();
        for r in records {
            let stale = r.is_stale(now, stale_after);
            for (key, last) in &r.images {
                let Ok(image) = Reference::parse(&format!("{registry}/{key}")) else {
                    continue;
                };
                let claim = Claim {
                    cluster: r.cluster.clone(),
                    // A time ahead of this clock (a skewed or forged
                    // record) would go into the local record and keep the
                    // image past the record's own `clusters forget`.
                    last: (*last).min(now),
                    // The publisher writes the images in use at `updated`.
                    now: *last >= r.updated,
                    stale,
                };
                for k in named(&image, &by_name) {
                    match out.get(&k) {
                        Some(c) if c.rank() >= claim.rank() => {}
                        _ => {
                            out.insert(k, claim.clone());
                        }
                    }
                }
            }
        }
        out
    }

    /// Adds the child manifests of every index listed in `repo`, and of
    /// every manifest of `repo` in use, to `used`: an index that stays (in
    /// use, not yet due, or kept for a reason of its own) must keep its
    /// children, and so must one Pods pin by digest after its tag moved
    /// (it is listed by no tag then); a child of an index removed now goes
    /// at a later pass, once nothing lists it.
    async fn children_in_use(
        &self,
        client: &crate::registry::client::Registry,
        repo: &Repository,
        pinned_by: &HashSet<String>,
        used: &mut HashSet<String>,
    ) -> Result<(), RetentionError> {
        let prefix = format!("{}@", repo.target);
        let pinned = pinned_by
            .iter()
            .filter_map(|k| Digest::parse(k.strip_prefix(&prefix)?).ok())
            .filter(|d| !repo.manifests.contains_key(d));
        let parents: Vec<Reference> = repo
            .manifests
            .keys()
            .cloned()
            .chain(pinned.collect::<Vec<_>>())
            .map(|d| repo.target.with_digest(d))
            .collect();
        for parent in parents {
            let Some(m) = client.get_manifest_raw(&parent).await? else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m.bytes) else {
                continue;
            };
            for child in v["manifests"].as_array().into_iter().flatten() {
                if let Some(d) = child["digest"].as_str().and_then(|d| Digest::parse(d).ok()) {
                    used.insert(repo.target.with_digest(d).to_string());
                }
            }
        }
        Ok(())
    }

    /// The source digests a target manifest with `tags` was copied from:
    /// those its anchor tags name; else its own digest when copies keep
    /// the source's digest. `None` when not known.
    fn source_digests(&self, digest: &Digest, tags: &[String]) -> Option<Vec<Digest>> {
        let variant = self.mirror.copy_variant();
        let anchored: Vec<Digest> = tags
            .iter()
            .filter_map(|t| anchor(t))
            .filter(|(_, v)| *v == variant)
            .map(|(d, _)| d)
            .collect();
        match (anchored.is_empty(), variant) {
            (false, _) => Some(anchored),
            (true, None) => Some(vec![digest.clone()]),
            (true, Some(_)) => None,
        }
    }

    /// One pass with what `in_use` says is in use.
    ///
    /// # Errors
    /// The target could not be listed, or the record not read or written:
    /// nothing is removed then.
    pub async fn sweep(&self, in_use: &InUse) -> Result<Report, RetentionError> {
        let passes = &self.metrics.retention.passes;
        if !in_use.synced {
            info!(
                "retention pass skipped: the Kubernetes watches have not listed everything yet, so what is in use is not known"
            );
            Metrics::outcome(passes, "not_synced");
            return Ok(Report {
                skipped: Some("the Kubernetes watches have not synced".into()),
                not_synced: true,
                ..Report::default()
            });
        }
        let result = self.pass(in_use, Mode::Run).await;
        match &result {
            Ok(r) if r.skipped.is_some() || !r.held.is_empty() => {
                Metrics::outcome(passes, "source_down")
            }
            Ok(_) => Metrics::outcome(passes, "done"),
            Err(e) => Metrics::outcome(passes, e.outcome()),
        }
        if let Ok(r) = &result {
            let m = &self.metrics.retention;
            for s in State::ALL {
                m.images
                    .get_or_create(&StateLabel {
                        state: s.as_str().into(),
                    })
                    .set(r.count(s) as i64);
            }
            let unrecoverable = r
                .images
                .iter()
                .filter(|i| i.why.starts_with(UNRECOVERABLE))
                .count();
            m.unrecoverable.set(unrecoverable as i64);
        }
        result
    }

    /// What the next pass would remove and keep, and why, without writing
    /// anything: no record is published, the local record is read, not
    /// updated, and nothing is removed. Its candidates are what a pass
    /// run now would remove, unless a cluster claims one in the pass's
    /// second read of the records.
    ///
    /// # Errors
    /// As [`Retention::sweep`].
    pub async fn plan(&self, in_use: &InUse) -> Result<Report, RetentionError> {
        if !in_use.synced {
            return Ok(Report {
                skipped: Some("the Kubernetes watches have not synced".into()),
                not_synced: true,
                ..Report::default()
            });
        }
        self.pass(in_use, Mode::Plan).await
    }

    async fn pass(&self, in_use: &InUse, mode: Mode) -> Result<Report, RetentionError> {
        let client = self.mirror.target_client().await?;
        let repos = self.list(&client).await?;
        let mut used = self.in_use(in_use, &repos);
        let mut claims = HashMap::new();
        if self.sharing.is_none() {
            // A shared target seen from an install with sharing off. A
            // target this install may not list records at (credentials
            // scoped to the mirror paths, a prefix too long for them) is
            // taken for an unshared one, as before sharing existed.
            // Only an answer that says "you may not look" (401, 403) or
            // "there is nothing" (404) means unshared: any other error
            // leaves the records unknown, and the pass removes nothing.
            let clusters = match super::clusters::Records::of(&self.mirror).await {
                Ok(records) => match records.names().await {
                    Ok(names) => names,
                    Err(e) if e.refused() => Vec::new(),
                    Err(e) => return Err(RetentionError::SharingUnknown(e)),
                },
                // A prefix that leaves no room for the records: no
                // cluster can publish any there.
                Err(e @ super::clusters::ClustersError::Unreadable { .. }) => {
                    debug!(error = %e, "no usage records can exist at this target");
                    Vec::new()
                }
                Err(e) => return Err(RetentionError::SharingUnknown(e)),
            };
            if !clusters.is_empty() {
                return Err(RetentionError::Unshared { clusters });
            }
        }
        if let Some(p) = &self.sharing {
            // This cluster's use first, so that the others see it before
            // anything is removed here.
            if mode == Mode::Run {
                p.publish(in_use, true)
                    .await
                    .map_err(RetentionError::Publish)?;
            }
            let others = p.others().await.map_err(RetentionError::Records)?;
            claims = self.claims(&others, &repos, Timestamp::now(), p.stale_after());
        }
        let now = Timestamp::now();
        let keys: Vec<String> = repos
            .iter()
            .flat_map(|r| {
                r.manifests
                    .keys()
                    .map(|d| r.target.with_digest(d.clone()).to_string())
            })
            .collect();
        // What is in use first, so the cap never leaves one of them out.
        let mut tracked = HashSet::new();
        let apply = |rec: &mut super::Record| {
            tracked.clear();
            let listed: HashSet<&String> = keys.iter().collect();
            // Gone from the target: forgotten (it starts again if it
            // comes back).
            rec.images
                .retain(|k, _| listed.contains(k) || used.contains(k));
            let mut bytes = rec.bytes();
            for k in keys.iter().filter(|k| used.contains(*k)) {
                if rec.seen(k, now, &mut bytes) {
                    tracked.insert(k.clone());
                }
            }
            for k in keys.iter().filter(|k| !used.contains(*k)) {
                let first = !rec.images.contains_key(k);
                let known = match first {
                    true => rec.seen(k, now, &mut bytes),
                    false => true,
                };
                if known {
                    tracked.insert(k.clone());
                }
            }
            // Another cluster's later use only moves last use on: an
            // image first seen here counts as used now all the same.
            for (k, c) in &claims {
                if tracked.contains(k) {
                    rec.seen(k, c.last, &mut bytes);
                }
            }
        };
        let record = match mode {
            Mode::Run => self.store.update(now, apply).await?,
            Mode::Plan => {
                let mut apply = apply;
                // With retention off, the install may not read the
                // record: there is none then, and every image is new to it.
                let read = match self.store.read().await {
                    Err(RetentionError::Record {
                        source: kube::Error::Api(s),
                        ..
                    }) if s.code == 403 => None,
                    r => r?,
                };
                let mut rec = read.unwrap_or_else(|| super::Record::new(now));
                apply(&mut rec);
                rec
            }
        };
        let unused_for = self.unused_for;
        let due = |k: &str| -> Option<Duration> {
            let last = record.images.get(k)?;
            // A last use ahead of this clock (another leader's) is idle 0.
            let idle = Duration::try_from(now.duration_since(*last)).unwrap_or_default();
            (idle >= unused_for).then_some(idle)
        };
        // Child manifests of the indexes listed, in repositories with
        // anything due; an index any cluster pins by digest keeps its
        // children too.
        let mut pinned_by = used.clone();
        pinned_by.extend(claims.keys().cloned());
        let mut children = HashSet::new();
        for repo in &repos {
            let any_due = repo.manifests.keys().any(|d| {
                let k = repo.target.with_digest(d.clone()).to_string();
                !used.contains(&k)
                    && !claims.get(&k).is_some_and(|c| c.stale || c.now)
                    && due(&k).is_some()
            });
            if any_due {
                self.children_in_use(&client, repo, &pinned_by, &mut children)
                    .await?;
            }
        }
        used.extend(children);
        let mut report = Report::default();
        let mut candidates = Vec::new();
        // Source registries that could not answer, with why: only their
        // images are held back, so one decommissioned registry does not
        // stop every pass.
        let mut down = BTreeMap::new();
        for repo in &repos {
            for (d, tags) in &repo.manifests {
                let image = repo.target.with_digest(d.clone());
                let k = image.to_string();
                let claim = claims.get(&k);
                let (state, why) = if used.contains(&k) {
                    (
                        State::InUse,
                        "named by a Pod or workload template".to_owned(),
                    )
                } else if let Some(c) = claim.filter(|c| c.stale) {
                    (
                        State::Kept,
                        format!(
                            "cluster {}'s usage record is stale (not updated within sharing.staleAfter): it counts as using everything it lists until `pinswap clusters forget {}`",
                            c.cluster, c.cluster
                        ),
                    )
                } else if let Some(c) = claim.filter(|c| c.now) {
                    (
                        State::InUse,
                        format!("in use in cluster {} (its usage record)", c.cluster),
                    )
                } else if !tracked.contains(&k) {
                    (
                        State::Kept,
                        format!(
                            "the retention record is full ({} images); an untracked image is never removed",
                            store_cap()
                        ),
                    )
                } else if let Some(idle) = due(&k) {
                    match self.check(repo, d, tags, &mut down).await {
                        Ok(()) => {
                            candidates.push(report.images.len());
                            (
                                State::Candidate,
                                format!("unused for {}", humantime::format_duration(round(idle))),
                            )
                        }
                        Err(why) => (State::Kept, why),
                    }
                } else {
                    (
                        State::Unused,
                        "unused for less than retention.unusedFor".to_owned(),
                    )
                };
                if state == State::Kept && why.starts_with(UNRECOVERABLE) {
                    warn!(image = %k, tags = ?tags, %why, "retention keeps an unused image: it could not be mirrored again");
                }
                report.images.push(Image {
                    image,
                    tags: tags.clone(),
                    state,
                    why,
                });
            }
        }
        // A source that failed later in the pass may have answered for an
        // earlier candidate: none of its images goes in this pass.
        let sources: HashMap<String, String> = match down.is_empty() {
            true => HashMap::new(),
            false => repos
                .iter()
                .map(|r| (r.target.to_string(), source_registry(r)))
                .collect(),
        };
        candidates.retain(|&i| {
            let img = &mut report.images[i];
            let Some((registry, why)) = held_by(&sources, &img.image, &down) else {
                return true;
            };
            img.state = State::Kept;
            img.why = format!("not checked: its source {registry} cannot answer ({why})");
            false
        });
        for (registry, why) in &down {
            warn!(source = %registry, %why, "retention holds back this source's images: it cannot answer");
        }
        report.held = down;
        // Asked only when there is something to remove; a plan writes
        // nothing, so it does not ask: it says what the last question found.
        let no_deletes = match (mode, candidates.first()) {
            (Mode::Plan, _) => self.last_refusal().map(|text| NoDeletes {
                refused: true,
                text,
            }),
            (_, Some(&first)) if !self.dry_run => {
                let repo = report.images[first].image.without_digest();
                self.deletes_refused(&client, &repo).await
            }
            (_, _) => None,
        };
        if let Some(why) = no_deletes {
            for &i in &candidates {
                let img = &mut report.images[i];
                if why.refused {
                    img.state = State::Kept;
                    img.why = why.text.clone();
                }
            }
            report.deletes = Some(why.text);
            candidates.clear();
        }
        if mode == Mode::Plan {
            return Ok(report);
        }
        if let Some(p) = &self.sharing
            && !candidates.is_empty()
            && !self.dry_run
        {
            // Read again just before removing, after long enough for a
            // cluster that started to use a candidate to have published it;
            // this cluster's own record too, which its publisher keeps
            // current meanwhile.
            tokio::time::sleep(p.settle()).await;
            let again = p.all().await.map_err(RetentionError::Records)?;
            let at = Timestamp::now();
            let claims = self.claims(&again, &repos, at, p.stale_after());
            // Children of an index claimed now by digest alone (not listed:
            // its tag moved), in the repositories with a candidate.
            let pinned_by: HashSet<String> = claims.keys().cloned().collect();
            let mut children = HashSet::new();
            // By name: a pass of 10,000 repositories and as many candidates
            // must not compare each with each (it held the runtime long
            // enough for the leader to lose its Lease).
            let with_candidate: HashSet<String> = candidates
                .iter()
                .map(|&i| report.images[i].image.without_digest().to_string())
                .collect();
            for repo in &repos {
                if with_candidate.contains(&repo.target.to_string()) {
                    self.children_in_use(&client, repo, &pinned_by, &mut children)
                        .await?;
                }
            }
            candidates.retain(|&i| {
                let img = &mut report.images[i];
                let k = img.image.to_string();
                let claim = claims.get(&k);
                match claim {
                    Some(c) if c.stale || c.now || age(at, c.last) < self.unused_for => {
                        img.state = State::Kept;
                        img.why = format!(
                            "claimed by cluster {}'s usage record when read again before removal",
                            c.cluster
                        );
                        false
                    }
                    _ if children.contains(&k) => {
                        img.state = State::Kept;
                        img.why = "a child of an index claimed when the usage records were read again before removal".into();
                        false
                    }
                    _ => true,
                }
            });
        }
        for i in candidates {
            let img = &mut report.images[i];
            if self.dry_run {
                info!(image = %img.image, tags = ?img.tags, why = %img.why, "retention dry run: would remove");
                Metrics::outcome(&self.metrics.retention.removed, "dry_run");
                continue;
            }
            match self.remove(&client, &img.image, &img.tags).await {
                Ok(()) => {
                    info!(image = %img.image, tags = ?img.tags, why = %img.why, "retention removed an unused image");
                    Metrics::outcome(&self.metrics.retention.removed, "removed");
                    self.mirror.forget_removed(&img.image, &img.tags).await;
                    img.state = State::Removed;
                }
                Err(e) if e.starts_with(KEPT) => {
                    info!(image = %img.image, why = %e, "retention keeps an image it chose: a tag was added to it meanwhile");
                    img.state = State::Kept;
                    img.why = e.trim_start_matches(KEPT).to_owned();
                }
                Err(e) => {
                    warn!(image = %img.image, error = %e, "retention could not remove an unused image");
                    Metrics::outcome(&self.metrics.retention.removed, "failed");
                    report.failed.push((img.image.clone(), e));
                }
            }
        }
        Ok(report)
    }

    /// Whether a due manifest may go: only pinswap's tags point at it and
    /// its source still serves what it was copied from. `Err` says why it
    /// stays. A source that cannot answer goes into `down` (by registry),
    /// and is not asked again in this pass.
    async fn check(
        &self,
        repo: &Repository,
        digest: &Digest,
        tags: &[String],
        down: &mut BTreeMap<String, String>,
    ) -> Result<(), String> {
        if let Some(t) = tags.iter().find(|t| !is_own(t)) {
            return Err(format!("tag {t} is not one pinswap writes"));
        }
        let registry = source_registry(repo);
        if let Some(why) = down.get(&registry) {
            return Err(format!(
                "not checked: its source {registry} cannot answer ({why})"
            ));
        }
        let Some(sources) = self.source_digests(digest, tags) else {
            return Err(format!(
                "{UNRECOVERABLE}: a copy made under a platform filter or repair, with no anchor tag naming its source digest"
            ));
        };
        for s in sources {
            let pinned = repo.source.with_digest(s);
            match self.mirror.source_serves(&pinned).await {
                SourceCheck::Serves => {}
                SourceCheck::NotServed(why) => {
                    return Err(format!("{UNRECOVERABLE}: {pinned}: {why}"));
                }
                SourceCheck::Down(why) => {
                    let e = format!("not checked: its source {registry} cannot answer ({why})");
                    down.insert(registry, why);
                    return Err(e);
                }
            }
        }
        // A tag pinswap writes is an anchor or one the source has: any
        // other (an operator's own tag in the mirror path) is not known to
        // be pinswap's, and deleting the manifest would delete it too.
        for t in tags.iter().filter(|t| anchor(t).is_none()) {
            let Ok(tagged) = repo.source.with_tag(t) else {
                return Err(format!("tag {t} is not one pinswap writes"));
            };
            match self.mirror.source_has_tag(&tagged).await {
                SourceCheck::Serves => {}
                SourceCheck::NotServed(why) => {
                    return Err(format!(
                        "tag {t} is not known to be pinswap's: {tagged}: {why}"
                    ));
                }
                SourceCheck::Down(why) => {
                    let e = format!("not checked: its source {registry} cannot answer ({why})");
                    down.insert(registry, why);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Removes `image`: its tags first where the registry deletes tags,
    /// then the manifest by digest (which removes the tags left).
    async fn remove(
        &self,
        client: &crate::registry::client::Registry,
        image: &Reference,
        tags: &[String],
    ) -> Result<(), String> {
        let repo = image.without_digest();
        let d = image.digest().expect("a digest");
        // Deleting the manifest deletes every tag on it: one added since
        // the listing (an operator's, another tool's) was never judged.
        for t in client.tags(&repo).await.map_err(|e| e.to_string())? {
            if tags.contains(&t) {
                continue;
            }
            let tagged = repo.with_tag(&t).map_err(|e| e.to_string())?;
            if client
                .manifest_digest(&tagged)
                .await
                .map_err(|e| e.to_string())?
                == Some(d.clone())
            {
                return Err(format!(
                    "{KEPT}tag {t} points at it since the pass listed the repository"
                ));
            }
        }
        if let Some(ecr) = self.mirror.ecr() {
            // By digest only: a tag an admission moved to new content since
            // the listing would take that image with it on ECR (an image
            // goes with its last tag).
            return ecr
                .delete_image(image.repository(), &[], d)
                .await
                .map_err(|e| e.to_string());
        }
        for t in tags {
            let tagged = repo.with_tag(t).map_err(|e| e.to_string())?;
            // A tag moved since the listing (an admission copied the
            // source's new content under it) names another image now: only
            // a tag still on this manifest goes.
            match client.manifest_digest(&tagged).await {
                Ok(Some(now)) if now == *d => {}
                Ok(_) => continue,
                Err(e) => return Err(e.to_string()),
            }
            match client.delete_manifest(&tagged).await {
                Ok(Deleted::Accepted | Deleted::Absent) => {}
                // Distribution: the manifest's deletion removes its tags.
                Ok(Deleted::Unsupported) => break,
                Err(crate::registry::RegistryError::Http { status: 400, .. }) => break,
                Err(e) => return Err(e.to_string()),
            }
        }
        match client.delete_manifest_digest(&repo, d).await {
            Ok(Deleted::Accepted | Deleted::Absent) => Ok(()),
            Ok(Deleted::Unsupported) => Err(
                "the target registry refuses deletes (Distribution: storage.delete.enabled)".into(),
            ),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Why a pass removes nothing it chose ([`Retention::deletes_refused`]).
struct NoDeletes {
    /// The target refuses DELETE (else it did not say).
    refused: bool,
    text: String,
}

impl Retention {
    /// Whether the target takes DELETE, asked at the start of leadership:
    /// a target that refuses it is reported, in the log and in plans,
    /// before any pass.
    pub async fn ask_deletes(&self) {
        // A dry run removes nothing, so it asks nothing.
        if self.mirror.ecr().is_some() || self.dry_run {
            return;
        }
        let target = self.mirror.target();
        let repo = match target.prefix() {
            Some(p) => format!(
                "{}/{p}/{}",
                target.registry(),
                crate::reference::USAGE_REPOSITORY
            ),
            None => format!(
                "{}/{}",
                target.registry(),
                crate::reference::USAGE_REPOSITORY
            ),
        };
        let (Ok(client), Ok(repo)) = (self.mirror.target_client().await, Reference::parse(&repo))
        else {
            return;
        };
        let _ = self.deletes_refused(&client, &repo).await;
    }

    /// Why the target refused DELETE when last asked, if it did.
    fn last_refusal(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Asks whether the target takes DELETE in `repo` (ECR's API deletes
    /// by itself): `None` when it does, else why nothing is removed. A
    /// refusal is logged once until the target takes DELETE again.
    async fn deletes_refused(&self, client: &Registry, repo: &Reference) -> Option<NoDeletes> {
        if self.mirror.ecr().is_some() {
            return None;
        }
        let answer = super::deletes::probe(client, repo).await;
        let before = {
            let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
            match &answer {
                Deletes::Taken => refused.take(),
                Deletes::Refused(why) => refused.replace(why.clone()),
                Deletes::Unknown(_) => refused.clone(),
            }
        };
        match answer {
            Deletes::Taken => {
                if before.is_some() {
                    info!(target = %client.host(), "the target takes DELETE again: retention removes unused images");
                }
                None
            }
            Deletes::Refused(why) => {
                if before.is_none() {
                    error!(%why, "retention removes nothing: the target refuses DELETE; turn retention off, or let the target delete");
                }
                Some(NoDeletes {
                    refused: true,
                    text: why,
                })
            }
            Deletes::Unknown(why) => {
                warn!(%why, "retention removes nothing in this pass: the target did not say whether it takes DELETE");
                Some(NoDeletes {
                    refused: false,
                    text: format!(
                        "nothing removed: whether the target takes DELETE is not known ({why})"
                    ),
                })
            }
        }
    }
}

/// How [`Retention::remove`] says it kept an image rather than failed.
const KEPT: &str = "kept: ";

/// How a kept image that could not be mirrored again is described.
const UNRECOVERABLE: &str = "unrecoverable";

fn store_cap() -> usize {
    super::store::MAX_IMAGES
}

/// `d` in whole seconds, for logs.
fn round(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_name_their_source_digest() {
        let hex = "ab".repeat(32);
        let plain = format!("pinswap-{hex}");
        let (d, v) = anchor(&plain).unwrap();
        assert_eq!(d.to_string(), format!("sha256:{hex}"));
        assert_eq!(v, None);
        let variant = format!("pinswap-{hex}-0123456789ab");
        let (_, v) = anchor(&variant).unwrap();
        assert_eq!(v, Some("0123456789ab"));
        assert!(anchor("pinswap-v1").is_none());
        assert!(anchor(&format!("pinswap-{hex}-x")).is_none());
    }

    #[test]
    fn referrers_tags_are_not_pinswaps() {
        assert!(is_own("v1"));
        assert!(is_own("pinswap-abc"));
        assert!(!is_own(&format!("sha256-{}.sig", "a".repeat(64))));
    }
}
