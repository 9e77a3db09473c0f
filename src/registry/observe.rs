//! What the registry endpoint reports; `ops::Metrics` counts it.

/// Receives registry events; called per request and per chunk received,
/// so implementations must be cheap (atomic counters).
pub trait RegistryObserver: Send + Sync + 'static {
    /// One request answered: method, route kind (`blob`, `upload`,
    /// `manifest`, …) and status.
    fn request(&self, method: &str, route: &'static str, status: u16);
    /// Blob bytes received from clients and sent on to containerd.
    fn blob_bytes(&self, n: u64);
}
