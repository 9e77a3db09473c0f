//! containerd outages as the proxy sees them: one WARN when containerd stops
//! answering, one INFO when it is back with how long it was gone and how
//! many calls failed meanwhile (answered UNAVAILABLE; ttrpc connections
//! closed). Once per call drowned
//! the journal (57 lines in 5 s under a client loop) and said nothing about
//! the outage as a whole.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Shared by every connection of one proxy and its ttrpc relays: one
/// containerd, one outage.
#[derive(Debug, Default)]
pub struct Outage {
    /// Set while an outage is on: every connection that reaches containerd
    /// reads only this, so the connect path takes no lock while it answers.
    down: AtomicBool,
    /// When the current outage began.
    since: Mutex<Option<Instant>>,
    /// Calls failed in the current outage.
    calls: AtomicU64,
}

impl Outage {
    /// A connection to containerd failed: the first failure of an outage
    /// is logged, the rest only counted.
    pub fn down(&self, upstream: &Path, error: &std::io::Error) {
        let mut since = crate::lock::lock(&self.since);
        if since.is_none() {
            *since = Some(Instant::now());
            self.calls.store(0, Ordering::Relaxed);
            self.down.store(true, Ordering::Release);
            tracing::warn!(upstream = %upstream.display(), error = %error, "containerd unavailable; calls through imgbridge fail until it is back (logged once per outage)");
        }
    }

    /// One call failed for the outage.
    pub fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// containerd accepted a connection: ends the outage, if one is on.
    pub fn up(&self, upstream: &Path) {
        if !self.down.load(Ordering::Acquire) {
            return;
        }
        let mut since = crate::lock::lock(&self.since);
        if let Some(t) = since.take() {
            self.down.store(false, Ordering::Release);
            let calls = self.calls.swap(0, Ordering::Relaxed);
            tracing::info!(upstream = %upstream.display(), down_for = ?t.elapsed(), unavailable_calls = calls, "containerd is back");
        }
    }

    /// Whether an outage is on.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_outage_counts_its_calls_and_ends_once() {
        let o = Outage::default();
        let p = Path::new("/run/containerd/containerd.sock");
        let e = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(!o.is_down());
        o.down(p, &e);
        let first = *o.since.lock().unwrap();
        o.down(p, &e);
        o.call();
        o.call();
        assert_eq!(
            *o.since.lock().unwrap(),
            first,
            "a second failure is the same outage"
        );
        assert_eq!(o.calls.load(Ordering::Relaxed), 2);
        o.up(p);
        assert!(!o.is_down());
        assert_eq!(o.calls.load(Ordering::Relaxed), 0);
        o.up(p); // no outage: nothing to end
        assert!(!o.is_down());
    }
}
