//! pinswap: mirror container images into a registry you own and pin Pods to
//! them by manifest digest.
//!
//! The crate is one library with a thin binary (`src/main.rs`). Modules follow
//! `docs/architecture.md` §4, where their dependencies are drawn.
//!
//! The library is not published for other crates: its one user outside the
//! crate is the binary, through [`cli::main`]. The other `pub` modules are
//! public so that the integration tests (`tests/`) and the fuzz targets
//! (`fuzz/`) can drive them; they carry no stability promise. Modules only
//! the crate itself uses are `pub(crate)`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admission;
pub mod airgap;
pub mod cache;
pub mod cli;
pub mod config;
pub mod convert;
pub mod identity;
pub mod install;
pub(crate) mod logsafe;
pub mod metrics;
pub mod mirror;
pub mod mutate;
pub mod nodeconfig;
pub mod platform;
pub mod reference;
pub mod registry;
pub mod retention;
pub mod server;
pub mod watch;
