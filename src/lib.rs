//! pinswap: mirror container images into a registry you own and pin Pods to
//! them by manifest digest.
//!
//! The crate is one library with a thin binary (`src/main.rs`). Modules follow
//! `docs/architecture.md` §4; dependencies point one way: `cli`/`server` →
//! `admission`/`watch` → `mirror` → `registry`/`cache` → `reference`/`config`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admission;
pub mod cache;
pub mod cli;
pub mod config;
pub mod convert;
pub mod identity;
pub mod install;
pub mod logsafe;
pub mod metrics;
pub mod mirror;
pub mod mutate;
pub mod platform;
pub mod reference;
pub mod registry;
pub mod retention;
pub mod server;
pub mod watch;
