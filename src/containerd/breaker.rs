//! Writes imgbridge makes on its own that broke containerd's connection are
//! never replayed blindly.
//!
//! A request that kills containerd (1.7/2.x panicked on a target-less
//! `Images.Update`) looks, from here, like a connection that broke while the
//! call was in flight. Retrying it after the reconnect kills containerd
//! again: a crash loop that takes every pod operation on the node with it.
//! So each item (namespace + image name or blob digest) whose write broke
//! the connection is held back for a capped, exponentially growing delay
//! (its next write waits it out), and after [`STOP_AFTER`] breaks it is not
//! written again by this process:
//! an ERROR names the call, the item and containerd's version, and the
//! observer (ops: a metric and `/status`) is told. A later success clears
//! the item. A call that could not even connect proves nothing and counts
//! for nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::backoff::Backoff;
use crate::lock::lock;

/// Breaks after which an item is no longer written.
pub const STOP_AFTER: u32 = 2;
/// Hold-back after the first break; doubles per break up to [`MAX_DELAY`].
/// Long enough for a containerd that crashed on the request to be seen
/// restarting (the write then fails to connect, which counts for nothing),
/// short enough that one that only restarted under an unrelated write gets
/// it promptly.
const BASE_DELAY: Duration = Duration::from_secs(1);
const MAX_DELAY: Duration = Duration::from_secs(300);

/// Told about every break (ops turns it into a metric and `/status`).
pub trait BreakObserver: Send + Sync {
    /// `stopped`: the item will not be written again by this process.
    fn call_broke(&self, call: &Broken, stopped: bool);
}

/// One write whose connection broke.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Broken {
    /// The call as logged: `Images.Update docker.io/library/a:1 in k8s.io`.
    pub op: String,
    pub namespace: String,
    pub item: String,
    /// containerd's version as last seen answering (empty if never seen).
    pub containerd: String,
}

/// What is known of one item, as a state machine: a first break makes it
/// `Suspect` (held back until `until`); a further break while suspect (or
/// after) makes it `Stopped` once [`STOP_AFTER`] breaks are reached.
#[derive(Clone, Debug)]
enum ItemState {
    Suspect { breaks: u32, until: Instant },
    Stopped,
}

impl ItemState {
    fn first(now: Instant) -> ItemState {
        ItemState::Suspect {
            breaks: 1,
            until: now + delay(1),
        }
        .settle()
    }

    fn broke_again(self, now: Instant) -> ItemState {
        match self {
            ItemState::Suspect { breaks, .. } => ItemState::Suspect {
                breaks: breaks + 1,
                until: now + delay(breaks + 1),
            }
            .settle(),
            ItemState::Stopped => ItemState::Stopped,
        }
    }

    /// Suspect with enough breaks is stopped.
    fn settle(self) -> ItemState {
        match self {
            ItemState::Suspect { breaks, .. } if breaks >= STOP_AFTER => ItemState::Stopped,
            s => s,
        }
    }
}

/// How long an item that broke the connection `breaks` times is held back.
fn delay(breaks: u32) -> Duration {
    const BACKOFF: Backoff = Backoff::new(BASE_DELAY, MAX_DELAY);
    BACKOFF.nth(breaks.saturating_sub(1))
}

/// Why a write was not sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Broke the connection once; may be tried again after `remaining`.
    HeldBack { remaining: Duration },
    /// Broke it [`STOP_AFTER`] times; not sent again by this process.
    Stopped,
}

/// Shared by every clone of one [`super::Containerd`].
#[derive(Default)]
pub struct Breaker {
    items: Mutex<HashMap<(String, String), ItemState>>,
    observer: OnceLock<Arc<dyn BreakObserver>>,
    /// containerd's version as last seen, for the ERROR line.
    version: Mutex<String>,
}

impl std::fmt::Debug for Breaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker").finish_non_exhaustive()
    }
}

impl Breaker {
    pub fn observe(&self, o: Arc<dyn BreakObserver>) {
        let _ = self.observer.set(o);
    }

    pub fn saw_version(&self, v: &str) {
        let mut cur = lock(&self.version);
        if *cur != v {
            *cur = v.to_string();
        }
    }

    /// May a write of `item` in `ns` be sent now?
    pub fn admit(&self, ns: &str, item: &str) -> Result<(), Refusal> {
        let items = lock(&self.items);
        match items.get(&(ns.to_string(), item.to_string())) {
            None => Ok(()),
            Some(ItemState::Stopped) => Err(Refusal::Stopped),
            Some(ItemState::Suspect { until, .. }) => {
                let now = Instant::now();
                if now >= *until {
                    Ok(())
                } else {
                    Err(Refusal::HeldBack {
                        remaining: *until - now,
                    })
                }
            }
        }
    }

    /// The write went through: the item is healthy again.
    pub fn succeeded(&self, ns: &str, item: &str) {
        let mut items = lock(&self.items);
        if !items.is_empty() {
            items.remove(&(ns.to_string(), item.to_string()));
        }
    }

    /// The connection broke while `op` on `item` was in flight.
    pub fn broke(&self, op: &str, ns: &str, item: &str) {
        let now = Instant::now();
        let state = {
            let mut items = lock(&self.items);
            let key = (ns.to_string(), item.to_string());
            let next = match items.remove(&key) {
                None => ItemState::first(now),
                Some(s) => s.broke_again(now),
            };
            items.insert(key, next.clone());
            next
        };
        let call = Broken {
            op: op.into(),
            namespace: ns.into(),
            item: item.into(),
            containerd: lock(&self.version).clone(),
        };
        let stopped = matches!(state, ItemState::Stopped);
        if stopped {
            tracing::error!(
                call = %call.op, namespace = ns, image = item, containerd = %call.containerd,
                "containerd's connection broke twice during this call (did containerd crash?); \
                 imgbridge will not send it again until it restarts — check containerd's log \
                 for a panic and report it with this line"
            );
        } else if let ItemState::Suspect { until, .. } = state {
            tracing::warn!(
                call = %call.op, namespace = ns, image = item, containerd = %call.containerd,
                retry_in = ?until.saturating_duration_since(now),
                "containerd's connection broke during this call; not replaying it at once"
            );
        }
        if let Some(o) = self.observer.get() {
            o.call_broke(&call, stopped);
        }
    }
}

/// Did the connection break after `status`'s request may have reached
/// containerd? A status containerd sent itself carries no source error; one
/// tonic made up locally does. Of those, failures to connect at all (nothing
/// was sent) do not count.
pub fn broke_connection(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    if !matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal
    ) {
        return false;
    }
    let Some(mut e) = status.source() else {
        return false;
    };
    loop {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::PermissionDenied
            ) {
                return false;
            }
        }
        match e.source() {
            Some(next) => e = next,
            None => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(Broken, bool)>>);
    impl BreakObserver for Seen {
        fn call_broke(&self, call: &Broken, stopped: bool) {
            self.0.lock().unwrap().push((call.clone(), stopped));
        }
    }

    #[test]
    fn a_second_break_stops_the_item_and_a_success_clears_it() {
        let b = Breaker::default();
        let seen = Arc::new(Seen::default());
        b.observe(seen.clone());
        b.saw_version("v2.4.2");
        assert_eq!(b.admit("k8s.io", "a"), Ok(()));
        b.broke("Images.Update a in k8s.io", "k8s.io", "a");
        assert!(matches!(
            b.admit("k8s.io", "a"),
            Err(Refusal::HeldBack { remaining }) if remaining > BASE_DELAY / 2
        ));
        assert_eq!(b.admit("k8s.io", "b"), Ok(()), "other items are unaffected");
        b.broke("Images.Update a in k8s.io", "k8s.io", "a");
        assert_eq!(b.admit("k8s.io", "a"), Err(Refusal::Stopped));
        let seen = seen.0.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert!(!seen[0].1 && seen[1].1);
        assert_eq!(seen[1].0.containerd, "v2.4.2");
        drop(seen);
        b.succeeded("k8s.io", "a");
        assert_eq!(b.admit("k8s.io", "a"), Ok(()));
    }

    #[test]
    fn delays_grow_and_are_capped() {
        assert_eq!(delay(1), BASE_DELAY);
        assert_eq!(delay(2), BASE_DELAY * 2);
        assert_eq!(delay(40), MAX_DELAY);
    }

    /// Fault injection (no real containerd dies on request any more): a
    /// server that reads a request's HEADERS frame and drops the
    /// connection, as containerd 1.7/2.x did when they panicked on it.
    async fn drops_on_request(sock: std::path::PathBuf) {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::UnixListener::bind(&sock).unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 24];
        s.read_exact(&mut buf).await.unwrap(); // client preface
        loop {
            let mut head = [0u8; 9];
            s.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).await.unwrap();
            if head[3] == 1 {
                return; // HEADERS: the request is here; "crash"
            }
        }
    }

    #[tokio::test]
    async fn a_dropped_connection_is_a_break_and_a_missing_socket_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let missing = crate::containerd::Containerd::new(dir.path().join("none.sock"));
        let e = missing.version().await.unwrap_err();
        let crate::containerd::Error::Status { status, .. } = &e else {
            panic!("{e}")
        };
        assert!(!broke_connection(status), "connect failure: {status:?}");

        let sock = dir.path().join("c.sock");
        let server = tokio::spawn(drops_on_request(sock.clone()));
        while !sock.exists() {
            tokio::task::yield_now().await;
        }
        let c = crate::containerd::Containerd::new(&sock);
        let e = c.version().await.unwrap_err();
        server.await.unwrap();
        let crate::containerd::Error::Status { status, .. } = &e else {
            panic!("{e}")
        };
        assert!(broke_connection(status), "dropped mid-call: {status:?}");
    }

    #[test]
    fn statuses_from_containerd_are_not_breaks() {
        assert!(!broke_connection(&tonic::Status::unavailable("no")));
        assert!(!broke_connection(&tonic::Status::not_found("no")));
    }
}
