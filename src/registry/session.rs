//! Upload sessions and the leases that keep uploaded blobs alive.
//!
//! A session is opened by `POST /blobs/uploads/`: it takes a lease in the
//! registry's namespace (expiring with the session; released at once by
//! the next imgbridge if this one is killed, see
//! [`crate::containerd::orphans`]) and holds containerd's ingest open across the requests
//! that feed it. When the blob is committed the lease moves to [`Held`]: it
//! keeps the blob until a manifest names it (the record then keeps it) or
//! the expiry passes. Sessions are bounded ([`Sessions::open`]) and the
//! janitor drops idle ones, aborting the ingest and releasing the lease.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::containerd::content::Ingest;
use crate::containerd::leases::Lease;
use crate::lock::lock;
use crate::oci::Repository;

/// Where an upload stands.
pub enum State {
    /// No byte received yet: the ingest opens with the first one (or is
    /// never needed: a monolithic PUT of a blob containerd has).
    Empty,
    /// containerd's ingest is open and has `offset` bytes.
    Writing { ingest: Box<Ingest>, offset: u64 },
}

/// One upload. Dropping it aborts its ingest, then releases its lease
/// (fields drop in this order).
pub struct Session {
    pub repo: Repository,
    pub state: State,
    /// The lease its ingest and its blob are held under.
    pub lease: Lease,
}

impl Session {
    /// Ends the upload: its ingest aborted unless committed, then its
    /// lease released now (not from a spawned drop).
    pub async fn end(self) {
        let Session { state, lease, .. } = self;
        drop(state);
        lease.release().await;
    }

    pub fn offset(&self) -> u64 {
        match &self.state {
            State::Empty => 0,
            State::Writing { offset, .. } => *offset,
        }
    }
}

struct Entry {
    session: Arc<tokio::sync::Mutex<Option<Session>>>,
    touched: Instant,
}

/// The open sessions by id. A session's slot is `None` once it finished
/// (committed or cancelled) while a request still held it.
#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<String, Entry>>,
}

pub type Slot = Arc<tokio::sync::Mutex<Option<Session>>>;

impl Sessions {
    /// Registers `session` under a new id, unless `max` are open (it is
    /// dropped then: its lease released).
    pub fn open(&self, session: Session, max: usize) -> Option<String> {
        let mut open = lock(&self.open);
        if open.len() >= max {
            return None;
        }
        let id = format!(
            "{}{}",
            crate::containerd::leases::unique(),
            crate::containerd::leases::unique()
        );
        open.insert(
            id.clone(),
            Entry {
                session: Arc::new(tokio::sync::Mutex::new(Some(session))),
                touched: Instant::now(),
            },
        );
        Some(id)
    }

    /// The session `id`, marked as used now.
    pub fn get(&self, id: &str) -> Option<Slot> {
        let mut open = lock(&self.open);
        let e = open.get_mut(id)?;
        e.touched = Instant::now();
        Some(e.session.clone())
    }

    pub fn remove(&self, id: &str) {
        lock(&self.open).remove(id);
    }

    pub fn count(&self) -> usize {
        lock(&self.open).len()
    }

    /// Takes out the sessions idle for `expiry` that no request holds.
    pub fn expired(&self, expiry: Duration) -> Vec<Session> {
        let mut open = lock(&self.open);
        let now = Instant::now();
        let mut out = Vec::new();
        open.retain(|_, e| {
            if now.duration_since(e.touched) < expiry {
                return true;
            }
            match e.session.try_lock() {
                Ok(mut s) => {
                    out.extend(s.take());
                    false
                }
                Err(_) => true,
            }
        });
        out
    }
}

/// Leases of committed blobs no manifest names yet, by digest.
#[derive(Default)]
pub struct Held {
    leases: Mutex<HashMap<String, Vec<(Lease, Instant)>>>,
}

impl Held {
    pub fn add(&self, digest: &str, lease: Lease, until: Instant) {
        lock(&self.leases)
            .entry(digest.to_string())
            .or_default()
            .push((lease, until));
    }

    /// The leases of `digests`, now that a record names them.
    pub fn take<'a>(&self, digests: impl IntoIterator<Item = &'a str>) -> Vec<Lease> {
        let mut leases = lock(&self.leases);
        digests
            .into_iter()
            .filter_map(|d| leases.remove(d))
            .flatten()
            .map(|(l, _)| l)
            .collect()
    }

    /// The leases past their time (`None`: every one).
    pub fn expired(&self, now: Option<Instant>) -> Vec<Lease> {
        let mut out = Vec::new();
        let mut leases = lock(&self.leases);
        for v in leases.values_mut() {
            let (gone, kept) = std::mem::take(v)
                .into_iter()
                .partition(|(_, until)| now.is_none_or(|now| *until <= now));
            *v = kept;
            out.extend(gone.into_iter().map(|(l, _): (Lease, Instant)| l));
        }
        leases.retain(|_, v| !v.is_empty());
        out
    }

    pub fn count(&self) -> usize {
        lock(&self.leases).values().map(Vec::len).sum()
    }
}
