//! Both peers of a splice played by hand, for the frame-level unit tests
//! of what real clients and containerd do too rarely to catch in
//! integration tests.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::frame::{self, Head, Kind, HEADER_LEN};
use super::{hpack, run, Ctx, SpliceError};
use crate::proxy::intercept::{typed, CallInfo, Hook, Interceptor};
use crate::proxy::observe::CallObserver;

pub(super) struct Rules {
    fail: bool,
    gate: Arc<Notify>,
    wait: AtomicBool,
    /// `after` hooks that started, and that ran to their end.
    counts: Arc<[AtomicUsize; 2]>,
}

impl Rules {
    /// Hooks on `/t.S/Held` that fail or pass, after `gate` if `wait`.
    pub(super) fn new(fail: bool, wait: bool, gate: Arc<Notify>) -> Rules {
        Rules {
            fail,
            gate,
            wait: AtomicBool::new(wait),
            counts: Arc::default(),
        }
    }

    /// Counts the `after` hooks that started (`[0]`) and that ran to
    /// their end (`[1]`).
    pub(super) fn counts(&self) -> Arc<[AtomicUsize; 2]> {
        self.counts.clone()
    }
}

impl Interceptor for Rules {
    fn select(&self, call: &CallInfo) -> Option<Box<dyn Hook>> {
        if &*call.method != "/t.S/Held" {
            return None;
        }
        let (fail, gate, wait) = (
            self.fail,
            self.gate.clone(),
            self.wait.load(Ordering::SeqCst),
        );
        let counts = self.counts.clone();
        Some(typed(move |_: (), _: ()| async move {
            counts[0].fetch_add(1, Ordering::SeqCst);
            if wait {
                gate.notified().await;
            }
            counts[1].fetch_add(1, Ordering::SeqCst);
            if fail {
                Err(tonic::Status::internal("boom"))
            } else {
                Ok(())
            }
        }))
    }
}

pub(super) fn frame(kind: Kind, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    f.extend_from_slice(&[kind.wire(), flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

pub(super) fn block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut b = BytesMut::new();
    for (n, v) in fields {
        hpack::encode_field(&mut b, n.as_bytes(), v.as_bytes());
    }
    b.to_vec()
}

pub(super) fn request(stream: u32, path: &str) -> Vec<u8> {
    let b = block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "x"),
    ]);
    frame(Kind::Headers, frame::END_HEADERS, stream, &b)
}

pub(super) async fn read_frame(s: &mut UnixStream) -> (Head, Vec<u8>) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).await.unwrap();
    let head = Head::parse(&h);
    let mut p = vec![0; head.len];
    s.read_exact(&mut p).await.unwrap();
    (head, p)
}

pub(super) type Task = tokio::task::JoinHandle<Result<(), SpliceError>>;

pub(super) fn start(rules: Rules) -> (UnixStream, UnixStream, Task) {
    start_with(rules, CancellationToken::new())
}

/// A splice that reports to `observer`.
pub(super) fn start_observed(
    rules: Rules,
    observer: Arc<dyn CallObserver>,
) -> (UnixStream, UnixStream, Task) {
    let (client, proxy_down) = UnixStream::pair().unwrap();
    let (proxy_up, server) = UnixStream::pair().unwrap();
    let ctx = Arc::new(Ctx {
        interceptor: Arc::new(rules),
        observer: Some(observer),
        upstream: "/run/test.sock".into(),
    });
    let task = tokio::spawn(run(proxy_down, proxy_up, ctx, CancellationToken::new()));
    (client, server, task)
}

pub(super) fn start_with(rules: Rules, drain: CancellationToken) -> (UnixStream, UnixStream, Task) {
    start_intercepted(Arc::new(rules), drain)
}

/// A splice with any policy.
pub(super) fn start_intercepted(
    interceptor: Arc<dyn Interceptor>,
    drain: CancellationToken,
) -> (UnixStream, UnixStream, Task) {
    let (client, proxy_down) = UnixStream::pair().unwrap();
    let (proxy_up, server) = UnixStream::pair().unwrap();
    let ctx = Arc::new(Ctx {
        interceptor,
        observer: None,
        upstream: "/run/test.sock".into(),
    });
    let task = tokio::spawn(run(proxy_down, proxy_up, ctx, drain));
    (client, server, task)
}

/// A splice that holds `/t.S/Held` replies until the returned gate is
/// notified, after the preface, a `/t.S/Held` call on stream 1 and `more`
/// went through it unchanged; with its rules' [`Rules::counts`].
pub(super) async fn held_call_sent(
    more: &[u8],
) -> (
    UnixStream,
    UnixStream,
    Task,
    Arc<Notify>,
    Arc<[AtomicUsize; 2]>,
) {
    let gate = Arc::new(Notify::new());
    let rules = Rules::new(false, true, gate.clone());
    let counts = rules.counts();
    let (mut client, mut server, task) = start(rules);
    let mut sent = frame::PREFACE.to_vec();
    sent.extend(request(1, "/t.S/Held"));
    sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
    sent.extend(more);
    assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
    (client, server, task, gate, counts)
}

pub(super) const MSG: [u8; 5] = [0, 0, 0, 0, 0];

/// containerd's OK reply to a unary call: headers, one message, trailers.
pub(super) fn ok_reply(stream: u32) -> Vec<u8> {
    let mut r = frame(
        Kind::Headers,
        frame::END_HEADERS,
        stream,
        &block(&[(":status", "200")]),
    );
    r.extend(frame(Kind::Data, 0, stream, &MSG));
    let t = block(&[("grpc-status", "0")]);
    r.extend(frame(
        Kind::Headers,
        frame::END_HEADERS | frame::END_STREAM,
        stream,
        &t,
    ));
    r
}

/// Writes `sent` as the client and returns what containerd received.
pub(super) async fn relay(
    client: &mut UnixStream,
    server: &mut UnixStream,
    sent: &[u8],
) -> Vec<u8> {
    client.write_all(sent).await.unwrap();
    let mut got = vec![0; sent.len()];
    server.read_exact(&mut got).await.unwrap();
    got
}

/// A splice with stream 1 (a plain call) sent to containerd, unanswered.
pub(super) async fn call_in_flight(drain: CancellationToken) -> (UnixStream, UnixStream, Task) {
    let rules = Rules::new(false, false, Arc::new(Notify::new()));
    let (mut client, mut server, task) = start_with(rules, drain);
    let mut sent = frame::PREFACE.to_vec();
    sent.extend(request(1, "/t.S/Plain"));
    sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
    assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
    (client, server, task)
}

pub(super) const SUBSCRIBE: &str = "/containerd.services.events.v1.Events/Subscribe";

/// The fields of a header block written without the dynamic table.
pub(super) fn fields(block: &[u8]) -> Vec<(String, String)> {
    let f = loona_hpack::Decoder::new().decode(block).unwrap();
    f.into_iter()
        .map(|(n, v)| {
            let v = String::from_utf8_lossy(&v).into_owned();
            (String::from_utf8_lossy(&n).into_owned(), v)
        })
        .collect()
}

pub(super) fn has(f: &[(String, String)], n: &str, v: &str) -> bool {
    f.iter().any(|(a, b)| a == n && b == v)
}
