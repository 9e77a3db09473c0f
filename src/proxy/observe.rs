//! Watching the data path without buffering it: which method was called,
//! its final `grpc-status`, how many calls are in flight and how many bytes
//! were relayed. The proxy only reports; counting lives in whoever implements
//! [`CallObserver`] (`ops::Metrics`).
//!
//! Cost per call: two observer calls (the path is shared, not copied); per
//! DATA frame: one observer call (an atomic add in `ops::Metrics`).

use std::sync::Arc;

/// Receives data-path events. All methods sit on the hot path: keep them to
/// atomic operations and short, uncontended locks.
pub trait CallObserver: Send + Sync + std::fmt::Debug + 'static {
    /// A call (one HTTP/2 stream) started; exactly one
    /// [`CallObserver::call_finished`] follows.
    fn call_started(&self);
    /// `n` response DATA bytes were relayed to the client (called per frame).
    fn bytes_relayed(&self, n: u64);
    /// The call ended. `method` is the raw request path (any string a client
    /// sent: bound it before using it as a label); `grpc_status` is `None`
    /// when the stream ended without one (client cancelled, connection lost).
    fn call_finished(&self, method: &str, grpc_status: Option<i32>);
    /// The splice could no longer decode a client's request headers (its
    /// HPACK mirror diverged) and closed the connection. Rare: never on the
    /// hot path.
    fn hpack_desync(&self) {}
    /// imgbridge answered a client PING itself: one containerd would have
    /// counted against the client because a held reply reached it late.
    fn ping_answered(&self) {}
}

/// One observed call; reports [`CallObserver::call_finished`] when dropped,
/// so a call abandoned at any point (even before upstream answered) still
/// ends exactly once.
pub struct CallGuard {
    observer: Arc<dyn CallObserver>,
    method: Arc<str>,
    status: Option<i32>,
}

impl CallGuard {
    pub fn new(observer: Arc<dyn CallObserver>, method: Arc<str>) -> CallGuard {
        observer.call_started();
        CallGuard {
            observer,
            method,
            status: None,
        }
    }
}

impl CallGuard {
    /// Records the call's `grpc-status` as soon as it is known.
    pub fn set_status(&mut self, status: Option<i32>) {
        if status.is_some() {
            self.status = status;
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.observer.call_finished(&self.method, self.status);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    impl CallObserver for Log {
        fn call_started(&self) {
            self.0.lock().unwrap().push("start".into());
        }
        fn bytes_relayed(&self, n: u64) {
            self.0.lock().unwrap().push(format!("bytes {n}"));
        }
        fn call_finished(&self, method: &str, s: Option<i32>) {
            self.0.lock().unwrap().push(format!("end {method} {s:?}"));
        }
    }

    #[test]
    fn a_call_ends_once_with_the_last_status_it_was_given() {
        let log = Arc::new(Log::default());
        let mut call = CallGuard::new(log.clone(), "/m".into());
        call.set_status(Some(0));
        call.set_status(None); // an unknown status does not erase a known one
        drop(call);
        // Dropped before any status (client went away): none.
        drop(CallGuard::new(log.clone(), "/gone".into()));
        assert_eq!(
            *log.0.lock().unwrap(),
            ["start", "end /m Some(0)", "start", "end /gone None"]
        );
    }
}
