//! imgbridge: a containerd proxy shim that replicates images written into
//! build namespaces (e.g. `buildkit`) into `k8s.io` before the write returns.
//!
//! Layout: [`proxy`] is transport only; [`replicate`] owns the replication
//! contract; [`reconcile`] and [`import`] feed it or write images themselves,
//! as does [`registry`], the node-local OCI distribution endpoint;
//! [`containerd`] wraps the typed API; [`oci`] is the vocabulary all of them
//! share (digests, names, references, manifests); [`labels`] holds every
//! label key and media type; [`app`] wires them together. Only [`ops`] knows about metrics
//! and readiness: the other modules report through observer traits they own,
//! which `ops` implements.

pub mod app;
pub mod atomic_file;
pub mod backoff;
pub mod config;
pub mod containerd;
pub mod etc_group;
pub mod globs;
pub mod import;
pub mod labels;
pub mod listener;
pub mod lock;
pub mod oci;
pub mod ops;
pub mod proxy;
pub mod reconcile;
pub mod registry;
pub mod replicate;

/// imgbridge's version (Cargo.toml's), as `--version` and `/status` print
/// it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub use app::serve;
pub use config::Config;
