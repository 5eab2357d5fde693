//! The registry matrix: every registry pinswap is tested against, real or
//! a vendor's front over a real one, started alike, so that
//! `tests/registries.rs` runs each scenario on each of them. Adding a
//! registry is one [`Kind`] and one line of that file's `matrix!`.

use crate::common::TestRegistry;
use crate::common::front::{Front, Mode, Vendor};
use crate::common::registry::Engine;

/// A registry of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A real registry process.
    Real(Engine),
    /// A vendor's behaviour, as a front over a real registry.
    Front(Vendor),
}

impl Kind {
    /// The real registry under a vendor's front: go-containerregistry's,
    /// which serves the referrers API, where the vendor serves it; else a
    /// Distribution, which answers that API 404 (v3.1.2 too).
    fn engine(self) -> Engine {
        match self {
            Kind::Real(engine) => engine,
            Kind::Front(Vendor::Quay | Vendor::HarborProxy | Vendor::Ecr) => Engine::Ggcr,
            Kind::Front(Vendor::MonolithicOnly) => Engine::Distribution3,
            Kind::Front(Vendor::Ghcr | Vendor::DockerHub(_) | Vendor::NoDigestOnHead) => {
                Engine::Distribution2
            }
        }
    }

    /// Whether pinswap can mirror into it.
    pub fn takes_pushes(self) -> bool {
        match self {
            Kind::Real(_) => true,
            Kind::Front(v) => v.takes_pushes(),
        }
    }

    /// Whether it serves distribution-spec's referrers API.
    pub fn serves_referrers(self) -> bool {
        self.engine() == Engine::Ggcr
    }
}

/// One registry of the matrix, running.
pub struct Subject {
    pub kind: Kind,
    /// The real registry: the test pushes to it and reads what pinswap
    /// wrote from it directly, past any front.
    pub store: TestRegistry,
    /// The vendor's front, which pinswap is pointed at.
    pub front: Option<Front>,
}

impl Subject {
    pub async fn start(kind: Kind) -> Subject {
        let store = TestRegistry::of(kind.engine()).await;
        let front = match kind {
            Kind::Real(_) => None,
            Kind::Front(vendor) => {
                let front = Front::start(&store.host()).await;
                front.set(Mode::Vendor(vendor));
                Some(front)
            }
        };
        Subject { kind, store, front }
    }

    /// `kind` as the source, and `kind` as the target when it takes pushes,
    /// else Distribution 2.8.
    pub async fn pair(kind: Kind) -> (Subject, Subject) {
        let target = match kind.takes_pushes() {
            true => kind,
            false => Kind::Real(Engine::Distribution2),
        };
        (Subject::start(kind).await, Subject::start(target).await)
    }

    /// `127.0.0.1:PORT` as pinswap is told it: the front's, if any.
    pub fn host(&self) -> String {
        match &self.front {
            Some(front) => front.host(),
            None => self.store.host(),
        }
    }

    /// The port of [`Subject::host`].
    pub fn port(&self) -> u16 {
        self.host().rsplit_once(':').unwrap().1.parse().unwrap()
    }
}
