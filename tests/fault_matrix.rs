//! The fault matrix: every step that deletes or overwrites something at
//! a target other clusters share, under every class of error a registry
//! or the network between shows, each at every kind of request the step
//! makes. Each cell builds a fresh target (a real Distribution registry)
//! holding what pinswap made and what it did not, runs the step through
//! a front that injects the fault, then reads the registry directly:
//! nothing pinswap did not make is changed, nothing in use is removed,
//! and where the error leaves an answer unknown, nothing is removed.
//!
//! The steps: a retention pass with sharing on, one with sharing off, the
//! publication of this cluster's usage record (which removes its previous
//! version), and `clusters forget` of another record. The fixture:
//! - `y`, in use here; `x`, in use in cluster `a` only (its record);
//! - `u`, mirrored and unused for longer than `unusedFor`: the one image
//!   a pass may remove;
//! - `w`, mirrored and unused, but an operator added a tag of their own to
//!   it in the mirror path (`keep`);
//! - `v`, a manifest someone pushed into a mirror path that its source
//!   never served;
//! - `team/app:v1`, an image outside any mirror path.
//!
//! A pass the fixture lets remove something (no fault) removes `u` and
//! only `u`: the cells that expect nothing removed can fail.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::fixtures::Image;
use common::front::{Fault, Front, Mode};
use common::kube::KubeApi;
use common::review::{admit, pod};
use common::{TestRegistry, push_image};
use k8s_openapi::jiff::Timestamp;
use pinswap::admission::Admission;
use pinswap::admission::policy::Policy;
use pinswap::config::Config;
use pinswap::install::manifests::Tls;
use pinswap::metrics::Metrics;
use pinswap::reference::Reference;
use pinswap::retention::clusters::{ClusterRecord, Records};
use pinswap::retention::publish::Publisher;
use pinswap::retention::{InUse, Retention, State, Store};

const NS: &str = "pinswap";

/// A destructive step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    /// A retention pass, sharing on.
    Shared,
    /// A retention pass, sharing off.
    Unshared,
    /// This cluster's record published again (its old version removed).
    Publish,
    /// `clusters forget gone`.
    Forget,
}

/// Where a fault is put: the method and a part of the path.
type Site = (&'static str, &'static str);

const CATALOG: Site = ("GET", "/v2/_catalog");
const TAGS: Site = ("GET", "shop/u/tags/list");
const HEADS: Site = ("HEAD", "/manifests/");
const RECORDS_LIST: Site = ("GET", "pinswap-usage/tags/list");
const RECORD_GETS: Site = ("GET", "pinswap-usage/");
const DELETES: Site = ("DELETE", "/manifests/");
const RECORD_PUTS: Site = ("PUT", "pinswap-usage/manifests/");
const RECORD_UPLOADS: Site = ("*", "pinswap-usage/blobs/uploads");
const RECORD_HEADS: Site = ("HEAD", "pinswap-usage/manifests/");
const RECORD_DELETES: Site = ("DELETE", "pinswap-usage/manifests/");

/// The requests each step makes, by kind.
fn sites(step: Step) -> &'static [Site] {
    match step {
        Step::Shared => &[
            CATALOG,
            TAGS,
            HEADS,
            RECORDS_LIST,
            RECORD_GETS,
            RECORD_PUTS,
            DELETES,
        ],
        Step::Unshared => &[CATALOG, TAGS, HEADS, RECORDS_LIST, DELETES],
        Step::Publish => &[RECORD_HEADS, RECORD_UPLOADS, RECORD_PUTS, RECORD_DELETES],
        Step::Forget => &[RECORD_HEADS, RECORD_DELETES],
    }
}

/// The classes of error.
const FAULTS: &[Fault] = &[
    Fault::Status(401),
    Fault::Status(403),
    Fault::Status(404),
    Fault::Status(429),
    Fault::Status(500),
    Fault::Status(503),
    Fault::Hang,
    Fault::Reset,
    Fault::CutBody,
    Fault::EndEarly,
];

fn is_list(site: Site) -> bool {
    site.1.contains("tags/list") || site.1.contains("_catalog")
}

/// One cell's fixture.
struct Cell {
    src: TestRegistry,
    dst: TestRegistry,
    front: Front,
    adm: Admission,
    metrics: Arc<Metrics>,
    publisher: Arc<Publisher>,
    retention: Retention,
    _api: KubeApi,
    /// name -> (target repository, image) for x, y, u, w, v.
    images: Vec<(&'static str, String, Image)>,
    foreign: Image,
    /// The digests of the records of `a` and `gone` before the step.
    records: Vec<(&'static str, Option<String>)>,
}

impl Cell {
    async fn start(sharing: bool) -> Cell {
        common::init();
        let src = TestRegistry::plain().await;
        let dst = TestRegistry::plain().await;
        let front = Front::start(&dst.host()).await;
        let sharing_keys = match sharing {
            true => {
                "sharing: {enabled: true, interval: 1s, checkEvery: 100ms, staleAfter: 1h, keepFor: 1h}\n"
            }
            false => "",
        };
        let yaml = format!(
            "target: {{registry: \"{}/mirror\"}}\nsource:\n  registries: [{{registry: \"{}\"}}]\ncopyPolicy: immediate\ncopyDeadline: 8s\nserver: {{admissionBudget: 8s}}\ncache: {{ttl: 0s}}\ncluster: b\nretention: {{enabled: true, unusedFor: 1s}}\n{sharing_keys}",
            front.host(),
            src.host()
        );
        let config = Config::from_yaml(&yaml, "test.yaml").unwrap();
        let metrics = Arc::new(Metrics::new());
        let adm = Admission::from_config(&config, metrics.clone()).unwrap();
        let api = KubeApi::start().await;
        api.authorize_install(&config, Tls::CertManager);
        let mirror = adm.mirror().clone();
        let policy = Policy::new(&config, mirror.target().clone()).unwrap();
        let publisher = Arc::new(Publisher::new(
            mirror.clone(),
            Policy::new(&config, mirror.target().clone()).unwrap(),
            "b",
            &config.sharing,
        ));
        let mut retention = Retention::new(
            mirror,
            policy,
            Store::new(api.install_client(), NS),
            &config.retention,
        );
        if sharing {
            retention = retention.with_sharing(publisher.clone());
        }
        let mut cell = Cell {
            src,
            dst,
            front,
            adm,
            metrics,
            publisher,
            retention,
            _api: api,
            images: Vec::new(),
            foreign: Image::oci(1, 900),
            records: Vec::new(),
        };
        cell.fill().await;
        cell
    }

    /// Mirrors x, y, u, w through admission, adds the foreign objects and
    /// the records of `a` (naming x) and `gone`.
    async fn fill(&mut self) {
        let mirror_path = format!("mirror/127.0.0.1_{}/shop", self.src.port());
        for (seed, name) in [(901u64, "x"), (902, "y"), (903, "u"), (904, "w")] {
            let image = Image::oci(1, seed);
            push_image(&self.src, &format!("shop/{name}"), Some("v1"), &image).await;
            let source = format!("{}/shop/{name}:v1", self.src.host());
            let (patched, _) = admit(&self.adm, &pod("shop", name, &[("app", &source)])).await;
            let image_ref = patched["spec"]["containers"][0]["image"].as_str().unwrap();
            assert!(image_ref.ends_with(&image.digest), "{image_ref}");
            self.images
                .push((name, format!("{mirror_path}/{name}"), image));
        }
        // An operator's own tag on w, in the mirror path.
        let w = self.image("w").clone();
        push_image(&self.dst, &format!("{mirror_path}/w"), Some("keep"), &w).await;
        // v: in a mirror path, never served by its source.
        let v = Image::oci(1, 905);
        push_image(&self.src, "shop/v", Some("v1"), &Image::oci(1, 906)).await;
        push_image(&self.dst, &format!("{mirror_path}/v"), Some("v1"), &v).await;
        self.images.push(("v", format!("{mirror_path}/v"), v));
        // Outside any mirror path.
        push_image(&self.dst, "team/app", Some("v1"), &self.foreign).await;
        let records = Records::of(self.adm.mirror()).await.unwrap();
        let x_key = format!("{mirror_path}/x@{}", self.image("x").digest);
        for (cluster, images) in [("a", vec![x_key]), ("gone", vec![])] {
            records
                .publish(
                    &ClusterRecord {
                        cluster: cluster.into(),
                        updated: Timestamp::now(),
                        complete: true,
                        in_use: images.len(),
                        images: images.into_iter().map(|k| (k, Timestamp::now())).collect(),
                        quotas: Vec::new(),
                    },
                    &mut Default::default(),
                )
                .await
                .unwrap();
        }
        for c in ["a", "gone"] {
            let d = self.record_digest(c).await;
            self.records.push((c, d));
        }
    }

    fn image(&self, name: &str) -> &Image {
        &self.images.iter().find(|(n, _, _)| *n == name).unwrap().2
    }

    /// What this cluster uses: y, pinned as its Pod runs it.
    fn uses(&self) -> InUse {
        let (_, repo, y) = self.images.iter().find(|(n, _, _)| *n == "y").unwrap();
        InUse {
            synced: true,
            images: vec![
                Reference::parse(&format!("{}/{repo}:v1@{}", self.front.host(), y.digest)).unwrap(),
            ],
        }
    }

    /// Retention passes counted as failed (nothing removed) so far.
    fn failed_passes(&self) -> f64 {
        let text = self.metrics.encode();
        [
            "error",
            "records_unreadable",
            "record_incomplete",
            "record_not_published",
            "sharing_off",
            "sharing_unknown",
        ]
        .iter()
        .filter_map(|o| {
            common::metrics::sample(&text, "pinswap_retention_passes_total", &[("outcome", o)])
        })
        .sum()
    }

    /// DELETEs of image manifests sent so far (a record's earlier version
    /// is the publication's own).
    fn image_deletes(&self) -> usize {
        self.front
            .requests()
            .iter()
            .filter(|(m, p)| {
                m == "DELETE" && p.contains("/manifests/") && !p.contains("pinswap-usage")
            })
            .count()
    }

    async fn record_digest(&self, cluster: &str) -> Option<String> {
        self.dst
            .get_manifest("mirror/pinswap-usage", cluster)
            .await
            .map(|(_, _, d)| d)
    }

    /// The fixture's images the target no longer holds byte for byte (by
    /// digest), and whether the foreign image and w's own tag are intact.
    async fn gone(&self) -> BTreeSet<&'static str> {
        let mut out = BTreeSet::new();
        for (name, repo, image) in &self.images {
            match self.dst.get_manifest(repo, &image.digest).await {
                Some((bytes, _, _)) if bytes == image.manifest => {}
                _ => {
                    out.insert(*name);
                }
            }
        }
        match self.dst.get_manifest("team/app", "v1").await {
            Some((bytes, _, _)) if bytes == self.foreign.manifest => {}
            _ => {
                out.insert("team/app");
            }
        }
        let (_, w_repo, w) = self.images.iter().find(|(n, _, _)| *n == "w").unwrap();
        match self.dst.get_manifest(w_repo, "keep").await {
            Some((_, _, d)) if d == w.digest => {}
            _ => {
                out.insert("w:keep");
            }
        }
        out
    }

    /// Runs `step` with the front passing, so that the local record has
    /// seen every image, then waits past `unusedFor`. With sharing off
    /// the records answer 404 meanwhile (the pass would refuse to start).
    async fn age(&self, step: Step) {
        if step == Step::Unshared {
            self.front.set(Mode::Fault(
                "GET",
                "pinswap-usage/tags/list",
                Fault::Status(404),
            ));
        }
        let first = self.retention.sweep(&self.uses()).await.unwrap();
        assert!(
            first.images.iter().all(|i| i.state != State::Removed),
            "{first:?}"
        );
        self.front.set(Mode::Pass);
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }

    /// Runs `step` under `fault` at `site` (none: no fault), then reads
    /// the target directly: what is gone, and which records changed.
    async fn run(&self, step: Step, fault: Option<(Site, Fault)>) -> Outcome {
        if matches!(step, Step::Shared | Step::Unshared) {
            self.age(step).await;
        } else {
            self.publisher.publish(&self.uses(), true).await.unwrap();
        }
        let before_b = self.record_digest("b").await;
        if let Some(((method, part), f)) = fault {
            self.front.set(Mode::Fault(method, part, f));
        }
        let deletes_before = self.image_deletes();
        let failed_before = self.failed_passes();
        let ran = async {
            match step {
                Step::Shared | Step::Unshared => self
                    .retention
                    .sweep(&self.uses())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Step::Publish => self
                    .publisher
                    .publish(&self.uses(), true)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Step::Forget => {
                    let records = Records::of(self.adm.mirror())
                        .await
                        .map_err(|e| e.to_string())?;
                    records
                        .forget("gone")
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            }
        };
        // A hung request holds the step until its caller's deadline.
        let result = match tokio::time::timeout(Duration::from_secs(5), ran).await {
            Ok(r) => r,
            Err(_) => Err("timed out".into()),
        };
        self.front.set(Mode::Pass);
        let mut changed = BTreeSet::new();
        for (c, d) in &self.records {
            if self.record_digest(c).await != *d {
                changed.insert(*c);
            }
        }
        // This cluster's own record stays readable, whatever happened.
        if before_b.is_some() {
            let records = Records::of(self.adm.mirror()).await.unwrap();
            let own = records.read("b").await;
            assert!(
                matches!(own, Ok(Some(_))),
                "this cluster's record after {step:?} {fault:?}: {own:?} (was {before_b:?})"
            );
        }
        let failed_passes = self.failed_passes() - failed_before;
        Outcome {
            failed_passes,
            result,
            gone: self.gone().await,
            records_changed: changed,
            deletes: self.image_deletes() - deletes_before,
        }
    }
}

#[derive(Debug)]
struct Outcome {
    result: Result<(), String>,
    /// Passes counted under an outcome that removed nothing.
    failed_passes: f64,
    gone: BTreeSet<&'static str>,
    records_changed: BTreeSet<&'static str>,
    deletes: usize,
}

/// What a cell must show.
fn judge(step: Step, fault: Option<(Site, Fault)>, o: &Outcome) -> Result<(), String> {
    let set = |v: &[&'static str]| v.iter().copied().collect::<BTreeSet<_>>();
    let removed_ok: Vec<BTreeSet<&str>> = match (step, fault) {
        // Without a fault, a pass removes u, and only u.
        (Step::Shared, None) => vec![set(&["u"])],
        // Sharing off on a target with records: nothing.
        (Step::Unshared, None) => vec![set(&[])],
        // Records that may not be listed, or are not there, mean an
        // unshared target (documented): the pass goes on, and x, which
        // only a record names, is unprotected.
        (Step::Unshared, Some((RECORDS_LIST, Fault::Status(401 | 403 | 404)))) => {
            vec![set(&["u", "x"])]
        }
        // The registry carried out the DELETE of u, chosen with every
        // answer in, and only its answer was lost.
        (Step::Shared, Some((DELETES, Fault::CutBody))) => vec![set(&[]), set(&["u"])],
        // A HEAD the registry refuses is asked again as a GET, which
        // answers: nothing is unknown then.
        (Step::Shared, Some((HEADS, _))) => vec![set(&[]), set(&["u"])],
        _ => vec![set(&[])],
    };
    if !removed_ok.contains(&o.gone) {
        return Err(format!(
            "removed {:?}, expected one of {removed_ok:?}",
            o.gone
        ));
    }
    let removed_ok = removed_ok.into_iter().next_back().unwrap_or_default();
    let records_ok = match step {
        Step::Forget => set(&["gone"]),
        _ => set(&[]),
    };
    if !o.records_changed.is_subset(&records_ok) {
        return Err(format!(
            "records changed {:?}, expected at most {records_ok:?}",
            o.records_changed
        ));
    }
    match (step, fault) {
        (Step::Forget | Step::Publish, None) if o.result.is_err() => {
            Err(format!("failed without a fault: {:?}", o.result))
        }
        (Step::Forget, None) if o.records_changed != records_ok => {
            Err("forget removed nothing without a fault".into())
        }
        // A pass that failed is counted so.
        (Step::Shared | Step::Unshared, _)
            if o.result.as_ref().is_err_and(|e| e != "timed out") && o.failed_passes != 1.0 =>
        {
            Err(format!(
                "failed, but counted {} failed passes",
                o.failed_passes
            ))
        }
        // Where an error leaves the answer unknown, no DELETE is sent
        // (at the DELETEs themselves, the one tried is the fault's).
        (Step::Shared | Step::Unshared, Some((site, _)))
            if site != DELETES && removed_ok.is_empty() && o.deletes > 0 =>
        {
            Err(format!("{} DELETEs sent", o.deletes))
        }
        _ => Ok(()),
    }
}

async fn run_matrix(step: Step) {
    let mut cells: Vec<Option<(Site, Fault)>> = vec![None];
    for &site in sites(step) {
        for &f in FAULTS {
            if f == Fault::EndEarly && !is_list(site) {
                continue;
            }
            cells.push(Some((site, f)));
        }
    }
    let total = cells.len();
    let mut failures = Vec::new();
    // A few cells at a time: each has its own registries and API.
    for batch in cells.chunks(6) {
        let mut set = tokio::task::JoinSet::new();
        for &fault in batch {
            set.spawn(async move {
                let cell = Cell::start(step != Step::Unshared).await;
                let o = cell.run(step, fault).await;
                (fault, judge(step, fault, &o), o)
            });
        }
        while let Some(done) = set.join_next().await {
            let (fault, verdict, o) = done.unwrap();
            if let Err(why) = verdict {
                failures.push(format!("{step:?} {fault:?}: {why} ({o:?})"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} cells failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_with_sharing_on() {
    run_matrix(Step::Shared).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_with_sharing_off() {
    run_matrix(Step::Unshared).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishing_the_usage_record() {
    run_matrix(Step::Publish).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forgetting_a_cluster() {
    run_matrix(Step::Forget).await;
}
