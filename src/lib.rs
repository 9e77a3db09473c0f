//! imgbridge: a containerd proxy shim that replicates images written into
//! build namespaces (e.g. `buildkit`) into `k8s.io` before the write returns.
//!
//! Layout: [`proxy`] is transport only; [`replicate`] owns the replication
//! contract; [`containerd`] wraps the typed API; [`app`] wires them together.

pub mod app;
pub mod config;
pub mod containerd;
pub mod import;
pub mod labels;
pub mod listener;
pub mod ops;
pub mod proxy;
pub mod reconcile;
pub mod reference;
pub mod replicate;

pub use app::serve;
pub use config::Config;
