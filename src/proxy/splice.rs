//! The data path: one client connection spliced to one containerd connection,
//! frame by frame.
//!
//! The two peers speak HTTP/2 to each other through the splice. SETTINGS,
//! PING, GOAWAY and flow control pass end to end untouched, and DATA goes out
//! straight from the read buffer, so a call costs about what a byte relay
//! costs (a full HTTP/2 server plus client per hop cost +80 µs a call, and a
//! quarter of read throughput: see README, Performance). The splice reads
//! frame headers and HPACK-decodes header blocks to learn each call's method,
//! namespace and status; it changes only these things:
//! - frames of intercepted calls are held (see [`super::intercept`]), and
//!   flow-control credit taken by frames that are dropped is given back;
//! - header blocks it holds or drops are sent later re-encoded without the
//!   dynamic table ([`frames::encode_field`]), so they can go out after later
//!   blocks. Every other block goes out as containerd encoded it, which keeps
//!   the client's HPACK table a mirror of containerd's encoder. Should a held
//!   or dropped block have changed containerd's table, the mirror is broken
//!   for good: from then on every containerd block is re-encoded that way;
//! - on shutdown it sends GOAWAY, refuses calls opened after it, and ends the
//!   calls that never end on their own with UNAVAILABLE ([`OPEN_ENDED`]).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Wake, Waker};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, Stream};
use futures_util::task::AtomicWaker;
use tokio::net::UnixStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::frames::{self, Head, HEADER_LEN};
use super::grpc;
use super::hpack::Decoder;
use super::intercept::{CallInfo, Hook, Interceptor};
use super::observe::{CallGuard, CallObserver};
use super::sock::Sock;

/// Read buffer per direction; as large as the floor relay's.
const BUF: usize = 256 << 10;
/// Largest header block (metadata), as containerd accepts.
const MAX_BLOCK: usize = 16 << 20;
/// Largest HPACK dynamic table a peer may make us mirror.
const MAX_TABLE: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Containerd,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Client => "the client",
            Side::Containerd => "containerd",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpliceError {
    #[error("the client did not open with the HTTP/2 preface; only gRPC (h2c) clients are served")]
    Preface,
    #[error("{0} sent a malformed frame: {1}")]
    Malformed(Side, String),
    #[error("{0} sent a header block that does not decode (HPACK): {1}")]
    Hpack(Side, String),
    #[error("{0} sent a header block over {MAX_BLOCK} bytes")]
    BlockTooLarge(Side),
    #[error("containerd sent PUSH_PROMISE, which gRPC never uses")]
    Push,
    #[error("reading from {0}: {1}")]
    Read(Side, #[source] io::Error),
    #[error("writing to {0}: {1}")]
    Write(Side, #[source] io::Error),
}

impl SpliceError {
    /// containerd's socket failed or closed: the client can still be told.
    fn is_containerd_io(&self) -> bool {
        matches!(
            self,
            SpliceError::Read(Side::Containerd, _) | SpliceError::Write(Side::Containerd, _)
        )
    }

    /// Resets and broken pipes are how peers hang up; everything else is news.
    pub fn is_hangup(&self) -> bool {
        matches!(self, SpliceError::Read(_, e) | SpliceError::Write(_, e)
            if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted | io::ErrorKind::NotConnected))
    }
}

/// What every connection's splice shares.
pub struct Ctx {
    pub interceptor: Arc<dyn Interceptor>,
    pub observer: Option<Arc<dyn CallObserver>>,
    /// containerd's socket, named in errors.
    pub upstream: std::path::PathBuf,
}

/// Relays until both peers are done, a peer breaks the protocol, or `drain`
/// fires and the calls in flight have finished (new ones are refused).
pub async fn run(
    client: UnixStream,
    upstream: UnixStream,
    ctx: Arc<Ctx>,
    drain: CancellationToken,
) -> Result<(), SpliceError> {
    let (client, upstream) = match (Sock::new(client), Sock::new(upstream)) {
        (Ok(c), Ok(u)) => (c, u),
        (Err(e), _) => return Err(SpliceError::Read(Side::Client, e)),
        (_, Err(e)) => return Err(SpliceError::Read(Side::Containerd, e)),
    };
    let mut s = Splice {
        client,
        upstream,
        up: Pump::new(Side::Client),
        down: Pump::new(Side::Containerd),
        st: State::new(ctx),
        drain: Some(Drain::new(drain)),
        ending: false,
        grace: None,
        linger: None,
    };
    std::future::poll_fn(|cx| s.poll(cx)).await
}

struct Splice {
    client: Sock,
    upstream: Sock,
    /// Client to containerd.
    up: Pump,
    /// containerd to client.
    down: Pump,
    st: State,
    drain: Option<Drain>,
    /// The drain has started and the open-ended calls are still to be ended
    /// (at the next point where no reply header block is half read).
    ending: bool,
    /// Runs once containerd is lost: how long the client gets to hang up.
    grace: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set once a drain has answered every call and our side is closed.
    linger: Option<Linger>,
}

/// Calls that never end on their own: the client has sent its whole
/// request and waits for a stream of replies that lasts until it hangs up
/// (subscriptions to containerd's events, CRI's container events, health
/// watches).
///
/// How a drain treats the calls in flight, once GOAWAY told the client to
/// open no more:
/// - a call on this list is ended at once: RST_STREAM(CANCEL) to containerd,
///   and to the client UNAVAILABLE ([`RESTARTING`]; Trailers-Only, or
///   trailers after the replies it already has), its later frames dropped.
///   Waiting could only run into the drain timeout, and its clients (`ctr
///   events`, kubelet, buildkit) subscribe again on UNAVAILABLE, meeting the
///   next instance;
/// - every other call is let finish (the drain timeout bounds them all):
///   unary calls, those a hook holds (a replication in progress), transfers
///   such as `Content.Read` or `Content.Write`, even when they look idle (a
///   `Diff.Apply` or a writer waiting for its registry sends nothing for
///   seconds), and `Tasks.Wait`, which ends when its process does and whose
///   callers do not retry it. `Streaming.Stream` (containerd 2) serves a
///   `Transfer` call in flight and ends with it.
///
/// The list is matched once per call when it opens (a length compare for
/// nearly every method); the drain itself costs nothing per frame.
pub const OPEN_ENDED: [&str; 3] = [
    "/containerd.services.events.v1.Events/Subscribe",
    "/runtime.v1.RuntimeService/GetContainerEvents",
    "/grpc.health.v1.Health/Watch",
];

/// What the client of an open-ended call is told when a drain ends it.
pub const RESTARTING: &str =
    "imgbridge is restarting: this stream was ended; call again to continue";

fn open_ended(method: &str) -> bool {
    OPEN_ENDED.contains(&method)
}

/// After containerd went away: how long a client that received GOAWAY may
/// keep the connection before it is closed.
const LOST_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// After a drain answered every call: how long the client may keep the
/// connection (it may still be reading the last reply) before it is closed.
const DRAIN_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a lingering connection checks whether the client has read
/// everything.
const LINGER_CHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// Keeps a drained connection open while the client is still reading: until
/// it hangs up, or has left nothing unread for a whole check period (time to
/// act on what it read), or `DRAIN_LINGER` is over.
struct Linger {
    deadline: tokio::time::Instant,
    check: Pin<Box<tokio::time::Sleep>>,
    drained_once: bool,
}

impl Linger {
    fn new() -> Linger {
        let now = tokio::time::Instant::now();
        Linger {
            deadline: now + DRAIN_LINGER,
            check: Box::pin(tokio::time::sleep_until(now + LINGER_CHECK)),
            drained_once: false,
        }
    }

    /// Ready when the connection may be closed.
    fn poll(&mut self, cx: &mut Context<'_>, client: &Sock) -> Poll<()> {
        while self.check.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            let drained = client.unread().map_or(true, |n| n == 0);
            if (drained && self.drained_once) || now >= self.deadline {
                return Poll::Ready(());
            }
            self.drained_once = drained;
            self.check.as_mut().reset(now + LINGER_CHECK);
        }
        Poll::Pending
    }
}

/// The drain signal, checked with one atomic load per wake-up. Polling the
/// token itself takes a lock, and the splice wakes for every frame.
struct Drain {
    wait: Pin<Box<WaitForCancellationFutureOwned>>,
    flag: Arc<DrainFlag>,
    /// The task waker `flag` passes wake-ups on to; replaced if the task's
    /// waker changes.
    task: Option<Waker>,
}

#[derive(Default)]
struct DrainFlag {
    raised: AtomicBool,
    task: AtomicWaker,
}

impl Wake for DrainFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.raised.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Drain {
    fn new(token: CancellationToken) -> Drain {
        let flag = Arc::new(DrainFlag::default());
        // Polled once up front (and again whenever the token wakes it).
        flag.raised.store(true, Ordering::Relaxed);
        Drain {
            wait: Box::pin(token.cancelled_owned()),
            flag,
            task: None,
        }
    }

    /// Whether the drain has started.
    fn fired(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            self.flag.task.register(cx.waker());
            self.task = Some(cx.waker().clone());
        }
        if !self.flag.raised.swap(false, Ordering::Acquire) {
            return false;
        }
        let waker = Waker::from(self.flag.clone());
        self.wait
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_ready()
    }
}

impl Splice {
    /// containerd closed the connection or broke it. Calls in flight are
    /// answered UNAVAILABLE naming the socket, and GOAWAY sends the client to
    /// a new connection, like containerd's own restart would, but with a
    /// reason. `Err` when that is not possible (a frame was cut in half).
    fn lose(&mut self, why: &dyn fmt::Display) -> Result<(), SpliceError> {
        if self.st.lost {
            return Ok(());
        }
        // Replies already on their way to the client end their calls.
        self.st.open_calls();
        self.down.settle(&mut self.st)?;
        if self.down.skip > 0 || self.down.block.is_some() {
            return Err(SpliceError::Read(
                Side::Containerd,
                io::Error::new(io::ErrorKind::UnexpectedEof, why.to_string()),
            ));
        }
        tracing::info!(upstream = %self.st.ctx.upstream.display(), reason = %why, "containerd connection lost; answering UNAVAILABLE and sending the client away");
        self.st.lost = true;
        self.down.eof = true;
        self.down.scan = self.down.end;
        let msg = format!(
            "imgbridge: containerd at {} closed the connection",
            self.st.ctx.upstream.display()
        );
        let waiting: Vec<u32> = (self.st.calls.iter())
            .filter(|(_, c)| !c.refused && !c.held.as_ref().is_some_and(|h| h.response_done))
            .map(|(id, _)| *id)
            .collect();
        for id in waiting {
            if let Some(mut call) = self.st.calls.remove(&id) {
                if let Some(g) = call.guard.as_mut() {
                    g.set_status(Some(tonic::Code::Unavailable as i32));
                }
                self.down
                    .inject
                    .push_back(error_reply(id, tonic::Code::Unavailable, &msg));
            }
        }
        // The first step of a graceful GOAWAY (RFC 9113 §6.8): no new calls
        // here, but calls already on their way are still answered.
        (self.down.inject).push_back(frames::goaway(0x7fff_ffff, frames::NO_ERROR));
        self.grace = Some(Box::pin(tokio::time::sleep(LOST_GRACE)));
        Ok(())
    }

    /// Ends the open-ended calls in flight ([`OPEN_ENDED`]).
    fn end_open_ended(&mut self) -> Result<(), SpliceError> {
        if self.st.lost {
            return Ok(()); // all answered already
        }
        // Which calls have had a reply: the reply blocks written but not yet
        // read count too.
        self.st.open_calls();
        self.down.settle(&mut self.st)?;
        self.st
            .end_open_ended(&mut self.up.inject, &mut self.down.inject);
        Ok(())
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), SpliceError>> {
        if let Some(d) = self.drain.as_mut() {
            if d.fired(cx) {
                self.drain = None;
                // Calls up to here finish; later ones are refused (see `open`).
                self.st.goaway = Some(self.st.last_stream);
                (self.down.inject).push_back(frames::goaway(self.st.last_stream, frames::NO_ERROR));
                self.ending = true;
            }
        }
        loop {
            if self.ending && self.down.block.is_none() {
                // A reply block that is half read may be the first reply of
                // a call to end, which decides how it ends: wait for its end.
                self.ending = false;
                self.end_open_ended()?;
            }
            if let Some(linger) = self.linger.as_mut() {
                // Our side is closed; the client's frames go nowhere.
                if self.up.discard(cx, &self.client).is_ready()
                    || linger.poll(cx, &self.client).is_ready()
                {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Pending;
            }
            while !self.st.hooks.is_empty() {
                let Poll::Ready(Some(outcome)) = Pin::new(&mut self.st.hooks).poll_next(cx) else {
                    break;
                };
                self.st
                    .outcome(outcome, &mut self.up.inject, &mut self.down.inject);
            }
            let up = (self.up).poll(
                cx,
                &mut self.client,
                &mut self.upstream,
                &mut self.down.inject,
                &mut self.st,
            );
            self.st.open_calls();
            let queued_up = self.up.inject.len();
            let down = (self.down).poll(
                cx,
                &mut self.upstream,
                &mut self.client,
                &mut self.up.inject,
                &mut self.st,
            );
            self.st.ended.clear();
            let (up_done, down_done) = match (up, down) {
                (Ok(u), Ok(d)) => (u, d),
                (Err(e), _) | (_, Err(e)) if e.is_containerd_io() => {
                    self.lose(&e)?;
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => return Poll::Ready(Err(e)),
            };
            if self.st.lost {
                // The client hung up, or had its time to.
                let grace_over = self
                    .grace
                    .as_mut()
                    .is_some_and(|g| g.as_mut().poll(cx).is_ready());
                if up_done || (grace_over && !self.st.awaiting_hooks()) {
                    return Poll::Ready(Ok(()));
                }
            } else if up_done && down_done {
                return Poll::Ready(Ok(()));
            }
            if self.st.goaway.is_some()
                && self.st.calls.values().all(|c| c.refused)
                && self.up.idle()
                && self.down.idle()
            {
                // Every call is answered. Closing the socket now would make
                // the client's next write (a WINDOW_UPDATE for the reply it
                // is still reading) fail with EPIPE, and that error would
                // fail the reply: half-close, and read until it hangs up.
                let _ = self.client.shutdown_write();
                self.linger = Some(Linger::new());
                continue;
            }
            // Go round again only for work queued after its pump was polled.
            let again = self.up.inject.len() > queued_up
                || std::mem::take(&mut self.st.hooks_added)
                || (self.ending && self.down.block.is_none());
            if !again {
                return Poll::Pending;
            }
        }
    }
}

/// One direction: reads frames from one peer and writes them to the other.
struct Pump {
    from: Side,
    buf: Vec<u8>,
    /// `buf[..scan]` is classified (written, or queued in `segs`).
    scan: usize,
    /// `buf[scan..end]` has been read but not classified.
    end: usize,
    /// Payload bytes of a passed-through frame that are still to come.
    skip: usize,
    /// Bytes a whole frame needs from `scan` before it can be classified.
    want: usize,
    /// Output in order, written with one vectored write.
    segs: VecDeque<Seg>,
    /// Frames from elsewhere (the other direction, hook results), written at
    /// the next frame boundary.
    inject: VecDeque<Bytes>,
    /// Frames [`State::frame`] puts in place of the one it was given; kept
    /// (empty) between frames so that a reply costs no allocation.
    emit: VecDeque<Bytes>,
    /// A header block that spans CONTINUATION frames.
    block: Option<Block>,
    /// containerd's header frames (start, length in `buf`) that are written
    /// before they are decoded: see [`Pump::settle`].
    deferred: Vec<(usize, usize)>,
    preface: bool,
    eof: bool,
    done: bool,
}

enum Seg {
    Buf(usize, usize),
    Own(Bytes),
}

struct Block {
    stream: u32,
    end_stream: bool,
    /// Its frames go out as they came (see [`State::mirror`]).
    forward: bool,
    bytes: Vec<u8>,
}

impl Pump {
    fn new(from: Side) -> Pump {
        Pump {
            from,
            buf: vec![0; BUF],
            scan: 0,
            end: 0,
            skip: 0,
            want: HEADER_LEN,
            segs: VecDeque::new(),
            inject: VecDeque::new(),
            emit: VecDeque::new(),
            block: None,
            deferred: Vec::new(),
            preface: from == Side::Client,
            eof: false,
            done: false,
        }
    }

    fn to(&self) -> Side {
        match self.from {
            Side::Client => Side::Containerd,
            Side::Containerd => Side::Client,
        }
    }

    fn idle(&self) -> bool {
        self.segs.is_empty()
            && self.inject.is_empty()
            && self.skip == 0
            && self.block.is_none()
            && self.deferred.is_empty()
    }

    /// Decodes the header frames that were written before they were read.
    ///
    /// Work done between reading a reply and writing it delays the reply by
    /// more than its own time (measured: 4 µs of work before each write cost
    /// 12 µs per call, the same work after it nothing), so a reply block that
    /// goes out unchanged is written first and decoded (for the call's status
    /// and the HPACK state) right after. It must be decoded before any later
    /// block: every frame that is not deferred settles the deferred ones first.
    fn settle(&mut self, st: &mut State) -> Result<(), SpliceError> {
        for (start, total) in self.deferred.drain(..) {
            let frame = &self.buf[start..start + total];
            let head = Head::parse(frame);
            let payload = &frame[HEADER_LEN..];
            let r = frames::content(&head, payload).map_err(|e| malformed(self.from, e))?;
            st.passed_headers(head.stream, head.has(frames::END_STREAM), &payload[r])?;
        }
        Ok(())
    }

    fn push_buf(&mut self, from: usize, to: usize) {
        if let Some(Seg::Buf(_, end)) = self.segs.back_mut() {
            if *end == from {
                *end = to;
                return;
            }
        }
        self.segs.push_back(Seg::Buf(from, to));
    }

    /// Moves the bytes read so far forward: DATA of ordinary calls as is, the
    /// rest through [`State::frame`].
    fn classify(&mut self, other: &mut VecDeque<Bytes>, st: &mut State) -> Result<(), SpliceError> {
        if self.preface {
            if self.end - self.scan < frames::PREFACE.len() {
                self.want = frames::PREFACE.len();
                return Ok(());
            }
            if &self.buf[self.scan..self.scan + frames::PREFACE.len()] != frames::PREFACE {
                return Err(SpliceError::Preface);
            }
            self.push_buf(self.scan, self.scan + frames::PREFACE.len());
            self.scan += frames::PREFACE.len();
            self.preface = false;
        }
        loop {
            if self.skip > 0 {
                let n = self.skip.min(self.end - self.scan);
                if n == 0 {
                    self.want = 1;
                    return Ok(());
                }
                self.push_buf(self.scan, self.scan + n);
                self.scan += n;
                self.skip -= n;
                continue;
            }
            if self.block.is_none() {
                while let Some(b) = self.inject.pop_front() {
                    self.segs.push_back(Seg::Own(b));
                }
            }
            let avail = self.end - self.scan;
            if avail < HEADER_LEN {
                self.want = HEADER_LEN;
                return Ok(());
            }
            let head = Head::parse(&self.buf[self.scan..]);
            if self.block.is_some() && head.kind != frames::CONTINUATION {
                return Err(SpliceError::Malformed(
                    self.from,
                    format!("frame type {} inside a header block", head.kind),
                ));
            }
            if !st.whole(self.from, &head) {
                if self.from == Side::Containerd && head.kind == frames::DATA {
                    if head.has(frames::END_STREAM) {
                        self.settle(st)?; // the call's status first
                    }
                    st.relayed(&head);
                }
                self.push_buf(self.scan, self.scan + HEADER_LEN);
                self.scan += HEADER_LEN;
                self.skip = head.len;
                continue;
            }
            let total = HEADER_LEN + head.len;
            if avail < total {
                self.want = total;
                return Ok(());
            }
            if self.from == Side::Containerd
                && head.kind == frames::HEADERS
                && head.has(frames::END_HEADERS)
                && head.stream != 0
                && st.passes(head.stream)
            {
                self.push_buf(self.scan, self.scan + total);
                self.deferred.push((self.scan, total));
                self.scan += total;
                continue;
            }
            if self.from == Side::Containerd {
                self.settle(st)?;
            }
            let frame = &self.buf[self.scan..self.scan + total];
            let verdict = match self.from {
                Side::Client => st.frame(
                    self.from,
                    &head,
                    frame,
                    &mut self.block,
                    &mut self.emit,
                    other,
                ),
                Side::Containerd => st.frame(
                    self.from,
                    &head,
                    frame,
                    &mut self.block,
                    other,
                    &mut self.emit,
                ),
            }?;
            if verdict == Verdict::Forward {
                self.push_buf(self.scan, self.scan + total);
            }
            self.segs.extend(self.emit.drain(..).map(Seg::Own));
            self.scan += total;
        }
    }

    fn flush(&mut self, cx: &mut Context<'_>, dst: &mut Sock) -> Poll<io::Result<()>> {
        while !self.segs.is_empty() {
            let mut iov = [IoSlice::new(&[]); 16];
            let mut k = 0;
            for s in self.segs.iter().take(iov.len()) {
                iov[k] = IoSlice::new(match s {
                    Seg::Buf(a, b) => &self.buf[*a..*b],
                    Seg::Own(b) => b,
                });
                k += 1;
            }
            let mut n = ready!(dst.poll_write_vectored(cx, &iov[..k]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            while n > 0 {
                let Some(front) = self.segs.front_mut() else {
                    break;
                };
                let len = match front {
                    Seg::Buf(a, b) => *b - *a,
                    Seg::Own(b) => b.len(),
                };
                if n >= len {
                    self.segs.pop_front();
                    n -= len;
                } else {
                    match front {
                        Seg::Buf(a, _) => *a += n,
                        Seg::Own(b) => {
                            let _ = b.split_to(n);
                        }
                    }
                    n = 0;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Reads and drops what `src` sends; ready at its end of stream or error.
    fn discard(&mut self, cx: &mut Context<'_>, src: &Sock) -> Poll<io::Result<()>> {
        loop {
            match ready!(src.poll_read(cx, &mut self.buf)) {
                Ok(0) => return Poll::Ready(Ok(())),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Room to read at `end`, and for a whole frame from `scan`. Only called
    /// with nothing queued in `segs`, so no range points into `buf`.
    fn make_room(&mut self) {
        if self.scan == self.end {
            self.scan = 0;
            self.end = 0;
        }
        let need = self.want.max(1);
        if self.end == self.buf.len() || self.buf.len() - self.scan < need {
            self.buf.copy_within(self.scan..self.end, 0);
            self.end -= self.scan;
            self.scan = 0;
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
        }
        if self.buf.len() > BUF && self.end <= BUF && need <= BUF {
            // A big header block or held frame has passed: give it back.
            self.buf.truncate(BUF);
            self.buf.shrink_to_fit();
        }
    }

    /// Runs this direction as far as it can; `Ok(true)` once it is finished
    /// (the reader hung up and everything was written).
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        src: &mut Sock,
        dst: &mut Sock,
        other: &mut VecDeque<Bytes>,
        st: &mut State,
    ) -> Result<bool, SpliceError> {
        if self.done {
            return Ok(true);
        }
        loop {
            if !self.eof {
                self.classify(other, st)?;
            } else if self.skip == 0 && self.block.is_none() {
                self.segs.extend(self.inject.drain(..).map(Seg::Own));
            }
            if st.lost && self.from == Side::Client {
                // containerd is gone: the client's frames go nowhere.
                self.segs.clear();
                self.inject.clear();
            }
            if !self.segs.is_empty() {
                match self.flush(cx, dst) {
                    Poll::Pending => {
                        // The reader is slow: go on reading into the room
                        // behind the queued bytes (they stay where they
                        // are), as a byte relay does, so that the sender
                        // is not held up by a full socket while this buffer
                        // still has space.
                        if self.eof || self.end == self.buf.len() {
                            return Ok(false);
                        }
                        match self.fill(cx, src, st)? {
                            Poll::Pending => return Ok(false),
                            Poll::Ready(()) => continue,
                        }
                    }
                    Poll::Ready(Err(e)) => return Err(SpliceError::Write(self.to(), e)),
                    Poll::Ready(Ok(())) => {
                        self.settle(st)?;
                        continue;
                    }
                }
            }
            if self.eof {
                if self.from == Side::Containerd && !st.client_gone {
                    if !st.lost {
                        return Err(SpliceError::Read(
                            Side::Containerd,
                            io::ErrorKind::UnexpectedEof.into(),
                        ));
                    }
                    // Keep writing to the client until the splice ends.
                    return Ok(false);
                }
                // Whether the peer took the half-close or had gone already,
                // this direction is finished.
                let _ = dst.shutdown_write();
                self.done = true;
                return Ok(true);
            }
            // Deferred frames are in `segs`, and settled once those are written.
            debug_assert!(
                self.deferred.is_empty(),
                "deferred frames outlive their write"
            );
            self.make_room();
            if self.fill(cx, src, st)?.is_pending() {
                return Ok(false);
            }
        }
    }

    /// Reads what `src` has into `buf[end..]`; ready with data or its end.
    fn fill(
        &mut self,
        cx: &mut Context<'_>,
        src: &Sock,
        st: &mut State,
    ) -> Result<Poll<()>, SpliceError> {
        match src.poll_read(cx, &mut self.buf[self.end..]) {
            Poll::Pending => return Ok(Poll::Pending),
            Poll::Ready(Err(e)) => return Err(SpliceError::Read(self.from, e)),
            Poll::Ready(Ok(0)) => {
                self.eof = true;
                st.client_gone |= self.from == Side::Client;
            }
            Poll::Ready(Ok(n)) => self.end += n,
        }
        Ok(Poll::Ready(()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Forward,
    Swallow,
}

/// Per-connection call state, shared by both directions.
struct State {
    ctx: Arc<Ctx>,
    calls: HashMap<u32, Call, BuildHasherDefault<StreamIdHasher>>,
    client_dec: Decoder,
    server_dec: Decoder,
    hooks: FuturesUnordered<BoxFuture<'static, Outcome>>,
    hooks_added: bool,
    last_stream: u32,
    /// Set once GOAWAY was sent: streams above it are refused.
    goaway: Option<u32>,
    /// containerd went away; new calls are answered UNAVAILABLE.
    lost: bool,
    /// The client closed its side: containerd's EOF is the normal end.
    client_gone: bool,
    /// The client's HPACK table for containerd's blocks is the same as
    /// containerd's: blocks of calls that are neither held nor refused go
    /// out byte for byte.
    mirror: bool,
    /// The last `:path` and namespace seen: calls on a connection mostly
    /// repeat them, and sharing saves an allocation per call.
    seen_path: Option<Arc<str>>,
    seen_namespace: Option<Arc<str>>,
    /// The last request block and what it said (method, namespace).
    request_seen: Repeat<(Arc<str>, Option<Arc<str>>)>,
    /// The last passed reply block and its `grpc-status`.
    reply_seen: Repeat<Option<i32>>,
    /// Where containerd's header blocks are re-encoded: each frame is split
    /// off, and the space is reused once the frames are written.
    out: BytesMut,
    /// Calls answered in this round, reported to the observer once the
    /// round's writes are done.
    ended: Vec<CallGuard>,
    /// Calls no hook holds, whose bookkeeping waits until their request is
    /// written: see [`State::open_calls`].
    opening: Vec<(u32, Arc<str>)>,
}

/// `v` as a shared string, reusing `seen` when it holds the same text.
fn intern(seen: &mut Option<Arc<str>>, v: &[u8]) -> Arc<str> {
    match seen {
        Some(s) if s.as_bytes() == v => s.clone(),
        _ => seen.insert(String::from_utf8_lossy(v).into()).clone(),
    }
}

/// A header block that decoded without changing its decoder's table, and
/// what it said. Calls on a connection repeat their blocks byte for byte
/// (every field indexed), and the same bytes against the same table decode
/// to the same fields: comparing them is cheaper than decoding again.
struct Repeat<T> {
    block: Vec<u8>,
    /// The decoder's change count when it was seen; any change since
    /// invalidates it.
    changes: u64,
    value: Option<T>,
}

impl<T> Default for Repeat<T> {
    fn default() -> Self {
        Repeat {
            block: Vec::new(),
            changes: 0,
            value: None,
        }
    }
}

/// Longer blocks are decoded every time: they are rare and compare slowly.
const REPEAT_MAX: usize = 256;

impl<T> Repeat<T> {
    fn get(&self, dec: &Decoder, block: &[u8]) -> Option<&T> {
        let v = self.value.as_ref()?;
        (self.changes == dec.changes() && self.block == block).then_some(v)
    }

    /// Remembers `block` if decoding it (from change count `before`) left
    /// the table as it was.
    fn put(&mut self, dec: &Decoder, before: u64, block: &[u8], value: T) {
        if dec.changes() != before || block.len() > REPEAT_MAX {
            return;
        }
        self.block.clear();
        self.block.extend_from_slice(block);
        self.changes = before;
        self.value = Some(value);
    }
}

struct Call {
    guard: Option<CallGuard>,
    held: Option<Box<Held>>,
    /// Opened after GOAWAY, or ended by a drain: reset at containerd and
    /// answered to the client, its later frames dropped.
    refused: bool,
    /// On the [`OPEN_ENDED`] list.
    open_ended: bool,
    /// A reply header block went to the client.
    replied: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Before {
    #[default]
    NotWanted,
    /// Request DATA is parked until the whole request is in.
    Collecting,
    Running,
    Done,
}

/// Room for the re-encoded header frames of many replies: the space is
/// reclaimed in place once they are written.
const OUT_ARENA: usize = 4096;

/// Stream ids are distinct small integers: a multiply spreads them over the
/// hash bits; SipHash was a measurable share of a call's CPU.
#[derive(Default)]
struct StreamIdHasher(u64);

impl Hasher for StreamIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | *b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// An intercepted call: request copied as it passes, reply held until the
/// hook has run.
#[derive(Default)]
struct Held {
    hook: Option<Box<dyn Hook>>,
    method: String,
    before: Before,
    request: BytesMut,
    request_done: bool,
    /// Client DATA frames not yet forwarded (while `before` runs).
    parked: Vec<Bytes>,
    parked_flow: u64,
    head: Option<Vec<(Bytes, Bytes)>>,
    head_end: bool,
    data: BytesMut,
    data_flow: u64,
    data_end: bool,
    trailers: Option<Vec<(Bytes, Bytes)>>,
    response_done: bool,
    after_running: bool,
    /// containerd's RST_STREAM after a complete reply, sent on after it.
    reset: Option<Bytes>,
}

impl Held {
    fn parked_unsent(&self) -> bool {
        matches!(self.before, Before::Collecting | Before::Running)
    }

    fn status(&self) -> Option<i32> {
        let find = |f: &Option<Vec<(Bytes, Bytes)>>| {
            f.as_ref()?
                .iter()
                .find(|(n, _)| &n[..] == b"grpc-status")
                .and_then(|(_, v)| grpc::parse_status(v))
        };
        find(&self.trailers).or_else(|| find(&self.head))
    }
}

enum Outcome {
    Before {
        stream: u32,
        hook: Box<dyn Hook>,
        result: Result<(), tonic::Status>,
    },
    After {
        stream: u32,
        result: Result<(), tonic::Status>,
    },
}

fn malformed(side: Side, e: impl fmt::Display) -> SpliceError {
    SpliceError::Malformed(side, e.to_string())
}

impl State {
    fn new(ctx: Arc<Ctx>) -> State {
        State {
            ctx,
            calls: HashMap::default(),
            client_dec: Decoder::new(MAX_TABLE),
            server_dec: Decoder::new(MAX_TABLE),
            hooks: FuturesUnordered::new(),
            hooks_added: false,
            last_stream: 0,
            goaway: None,
            lost: false,
            client_gone: false,
            mirror: true,
            seen_path: None,
            seen_namespace: None,
            request_seen: Repeat::default(),
            reply_seen: Repeat::default(),
            out: BytesMut::with_capacity(OUT_ARENA),
            ended: Vec::new(),
            opening: Vec::new(),
        }
    }

    /// Whether a frame must be in the buffer whole before it is classified.
    fn whole(&self, from: Side, head: &Head) -> bool {
        match head.kind {
            frames::HEADERS | frames::CONTINUATION | frames::RST_STREAM | frames::PUSH_PROMISE => {
                true
            }
            frames::DATA => self.calls.get(&head.stream).is_some_and(|c| {
                c.refused
                    || c.held
                        .as_ref()
                        .is_some_and(|h| from == Side::Containerd || !h.request_done)
            }),
            _ => false,
        }
    }

    /// A passed-through containerd DATA frame.
    fn relayed(&mut self, head: &Head) {
        if let Some(o) = &self.ctx.observer {
            o.bytes_relayed(head.len as u64);
        }
        if head.has(frames::END_STREAM) {
            self.end_call(head.stream);
        }
    }

    /// Forgets an answered call. Its metrics are recorded after the reply
    /// is written (see `ended`), not between reading and writing it.
    fn end_call(&mut self, stream: u32) {
        if let Some(guard) = self.calls.remove(&stream).and_then(|c| c.guard) {
            self.ended.push(guard);
        }
    }

    /// Ends every open-ended call that is neither answered nor held: reset
    /// at containerd, UNAVAILABLE to the client (see [`OPEN_ENDED`]).
    fn end_open_ended(&mut self, up: &mut VecDeque<Bytes>, down: &mut VecDeque<Bytes>) {
        for (&stream, call) in self.calls.iter_mut() {
            if !call.open_ended || call.refused || call.held.is_some() {
                continue;
            }
            call.refused = true;
            up.push_back(frames::rst_stream(stream, frames::CANCEL));
            let code = tonic::Code::Unavailable;
            down.push_back(match call.replied {
                true => error_trailers(stream, code, RESTARTING),
                false => error_reply(stream, code, RESTARTING),
            });
            if let Some(mut g) = call.guard.take() {
                g.set_status(Some(code as i32));
                self.ended.push(g);
            }
        }
    }

    fn awaiting_hooks(&self) -> bool {
        (self.calls.values()).any(|c| c.held.as_ref().is_some_and(|h| h.response_done))
    }

    /// A whole frame that is not plain DATA. `up` and `down` take frames to
    /// write after it toward containerd and toward the client.
    fn frame(
        &mut self,
        from: Side,
        head: &Head,
        frame: &[u8],
        block: &mut Option<Block>,
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Result<Verdict, SpliceError> {
        if from == Side::Client {
            self.open_calls();
        }
        let payload = &frame[HEADER_LEN..];
        let verdict = |forward| match forward {
            true => Verdict::Forward,
            false => Verdict::Swallow,
        };
        match head.kind {
            frames::HEADERS => {
                if head.stream == 0 {
                    return Err(malformed(from, "HEADERS on stream 0"));
                }
                let r = frames::content(head, payload).map_err(|e| malformed(from, e))?;
                // The client's blocks always go out as they are.
                let forward = from == Side::Client || self.passes(head.stream);
                if head.has(frames::END_HEADERS) {
                    let end = head.has(frames::END_STREAM);
                    self.block_done(from, head.stream, end, forward, &payload[r], up, down)?;
                } else {
                    *block = Some(Block {
                        stream: head.stream,
                        end_stream: head.has(frames::END_STREAM),
                        forward,
                        bytes: payload[r].to_vec(),
                    });
                }
                Ok(verdict(forward))
            }
            frames::CONTINUATION => {
                let Some(b) = block.as_mut().filter(|b| b.stream == head.stream) else {
                    return Err(malformed(from, "CONTINUATION without its HEADERS"));
                };
                if b.bytes.len() + payload.len() > MAX_BLOCK {
                    return Err(SpliceError::BlockTooLarge(from));
                }
                b.bytes.extend_from_slice(payload);
                let forward = b.forward;
                if head.has(frames::END_HEADERS) {
                    let b = block.take().expect("checked above");
                    self.block_done(from, b.stream, b.end_stream, forward, &b.bytes, up, down)?;
                }
                Ok(verdict(forward))
            }
            frames::DATA => self.data(from, head, frame, up, down),
            frames::RST_STREAM => {
                if payload.len() != 4 {
                    return Err(malformed(from, "RST_STREAM is not 4 bytes"));
                }
                let call = self.calls.get_mut(&head.stream);
                if from == Side::Containerd && call.as_ref().is_some_and(|c| c.refused) {
                    // The client has its answer for this stream already.
                    self.calls.remove(&head.stream);
                    return Ok(Verdict::Swallow);
                }
                if let Some(held) = call.and_then(|c| c.held.as_mut()) {
                    if from == Side::Containerd && held.response_done {
                        // grpc-go resets (NO_ERROR) a stream it has answered
                        // before the client's END_STREAM: it follows the reply.
                        held.reset = Some(Bytes::copy_from_slice(frame));
                        return Ok(Verdict::Swallow);
                    }
                }
                if let Some(call) = self.calls.remove(&head.stream) {
                    if let Some(held) = call.held {
                        credit_back(&held, up, down);
                    }
                }
                Ok(Verdict::Forward)
            }
            frames::PUSH_PROMISE if from == Side::Containerd => Err(SpliceError::Push),
            _ => Ok(Verdict::Forward),
        }
    }

    /// Records the calls that [`State::request_headers`] let through before
    /// their request was written (see [`Pump::settle`] for why). Runs before
    /// any later client frame is looked at and before any reply is.
    fn open_calls(&mut self) {
        // Popped, not taken: the vector keeps its room for the next call.
        while let Some((stream, method)) = self.opening.pop() {
            self.open(stream, method, None);
        }
    }

    /// Starts tracking call `stream`: its metrics, and its hook if held.
    fn open(&mut self, stream: u32, method: Arc<str>, held: Option<Box<Held>>) {
        let open_ended = open_ended(&method);
        let guard = (self.ctx.observer.as_ref()).map(|o| CallGuard::new(o.clone(), method));
        let call = Call {
            guard,
            held,
            refused: false,
            open_ended,
            replied: false,
        };
        self.calls.insert(stream, call);
    }

    /// Whether containerd's block for `stream` goes out as it came.
    fn passes(&self, stream: u32) -> bool {
        self.mirror && !(self.calls.get(&stream)).is_some_and(|c| c.refused || c.held.is_some())
    }

    /// After a containerd block that did not go out as it came: if it changed
    /// containerd's table, the client's no longer mirrors it.
    fn kept_back(&mut self, changes_before: u64) {
        if self.mirror && self.server_dec.changes() != changes_before {
            self.mirror = false;
            tracing::debug!("a held reply changed containerd's HPACK table: re-encoding its header blocks from now on");
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn block_done(
        &mut self,
        from: Side,
        stream: u32,
        end_stream: bool,
        forwarded: bool,
        block: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Result<(), SpliceError> {
        match from {
            Side::Client => self.request_headers(stream, end_stream, block, up, down),
            Side::Containerd if forwarded => self.passed_headers(stream, end_stream, block),
            Side::Containerd => self.response_headers(stream, end_stream, block, up, down),
        }
    }

    /// containerd's block that went out as it came: read for the status.
    fn passed_headers(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
    ) -> Result<(), SpliceError> {
        let status = match self.reply_seen.get(&self.server_dec, block) {
            Some(status) => *status,
            None => {
                let mut status = None;
                let changes = self.server_dec.changes();
                (self.server_dec)
                    .decode(block, |n, v| {
                        if n == b"grpc-status" {
                            status = grpc::parse_status(v);
                        }
                    })
                    .map_err(|e| hpack_error(Side::Containerd, e))?;
                self.reply_seen
                    .put(&self.server_dec, changes, block, status);
                status
            }
        };
        self.record_status(stream, end_stream, status);
        Ok(())
    }

    fn record_status(&mut self, stream: u32, end_stream: bool, status: Option<i32>) {
        if let Some(c) = self.calls.get_mut(&stream) {
            c.replied = true;
            if let Some(g) = c.guard.as_mut() {
                g.set_status(status);
            }
        }
        if end_stream {
            self.end_call(stream);
        }
    }

    fn request_headers(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Result<(), SpliceError> {
        let (path, namespace) = match self.request_seen.get(&self.client_dec, block) {
            Some((p, ns)) => (Some(p.clone()), ns.clone()),
            None => {
                let mut path = None;
                let mut namespace = None;
                let (seen_path, seen_ns) = (&mut self.seen_path, &mut self.seen_namespace);
                let changes = self.client_dec.changes();
                (self.client_dec)
                    .decode(block, |n, v| match n {
                        b":path" => path = Some(intern(seen_path, v)),
                        b"containerd-namespace" if namespace.is_none() => {
                            namespace = Some(intern(seen_ns, v))
                        }
                        _ => {}
                    })
                    .map_err(|e| hpack_error(Side::Client, e))?;
                if let Some(p) = &path {
                    let value = (p.clone(), namespace.clone());
                    self.request_seen
                        .put(&self.client_dec, changes, block, value);
                }
                (path, namespace)
            }
        };
        if self.calls.contains_key(&stream) {
            // Request trailers.
            if end_stream {
                self.request_end(stream, up, down);
            }
            return Ok(());
        }
        if stream <= self.last_stream {
            return Ok(()); // a closed stream: containerd answers that
        }
        self.last_stream = stream;
        if self.lost {
            let msg = format!(
                "imgbridge: containerd at {} closed the connection",
                self.ctx.upstream.display()
            );
            down.push_back(error_reply(stream, tonic::Code::Unavailable, &msg));
            return Ok(());
        }
        if self.goaway.is_some_and(|last| stream > last) {
            up.push_back(frames::rst_stream(stream, frames::CANCEL));
            down.push_back(frames::rst_stream(stream, frames::REFUSED_STREAM));
            let call = Call {
                guard: None,
                held: None,
                refused: true,
                open_ended: false,
                replied: false,
            };
            self.calls.insert(stream, call);
            return Ok(());
        }
        let info = CallInfo {
            method: path.unwrap_or_else(|| "".into()),
            namespace,
        };
        let Some(hook) = self.ctx.interceptor.select(&info) else {
            // Its frames pass as they are; the rest can wait for the write.
            self.opening.push((stream, info.method));
            return Ok(());
        };
        let held = Box::new(Held {
            before: if hook.wants_before() {
                Before::Collecting
            } else {
                Before::NotWanted
            },
            hook: Some(hook),
            method: info.method.to_string(),
            ..Held::default()
        });
        self.open(stream, info.method, Some(held));
        if end_stream {
            self.request_end(stream, up, down);
        }
        Ok(())
    }

    fn response_headers(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Result<(), SpliceError> {
        let (held, refused) = self
            .calls
            .get(&stream)
            .map_or((false, false), |c| (c.held.is_some(), c.refused));
        let changes = self.server_dec.changes();
        if held {
            let mut fields = Vec::new();
            (self.server_dec)
                .decode(block, |n, v| {
                    fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
                })
                .map_err(|e| hpack_error(Side::Containerd, e))?;
            self.kept_back(changes);
            let held = (self.calls.get_mut(&stream))
                .and_then(|c| c.held.as_mut())
                .expect("checked above");
            if held.head.is_none() {
                held.head = Some(fields);
                held.head_end = end_stream;
            } else {
                held.trailers = Some(fields);
            }
            if end_stream {
                held.response_done = true;
                self.try_finish(stream, up, down);
            }
            return Ok(());
        }
        let mut status = None;
        let frame = &mut self.out;
        frame.reserve(block.len() + 64);
        let dec = &mut self.server_dec;
        frames::header_frames(stream, end_stream, frame, |out| {
            dec.decode(block, |n, v| {
                if n == b"grpc-status" {
                    status = grpc::parse_status(v);
                }
                frames::encode_field(out, n, v);
            })
        })
        .map_err(|e| hpack_error(Side::Containerd, e))?;
        self.kept_back(changes);
        self.record_status(stream, end_stream, status);
        let frame = self.out.split().freeze();
        if !refused {
            down.push_back(frame);
        }
        Ok(())
    }

    /// DATA of a refused or held call (any other passes without a look).
    fn data(
        &mut self,
        from: Side,
        head: &Head,
        frame: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Result<Verdict, SpliceError> {
        let Some(call) = self.calls.get_mut(&head.stream) else {
            return Ok(Verdict::Forward);
        };
        if call.refused {
            // Dropped: the sender gets its flow-control credit back.
            let credit = frames::window_update(0, head.len as u64);
            match from {
                Side::Client => down.extend(credit),
                Side::Containerd => up.extend(credit),
            }
            return Ok(Verdict::Swallow);
        }
        if call.held.is_none() {
            return Ok(Verdict::Forward);
        }
        let payload = &frame[HEADER_LEN..];
        let r = frames::content(head, payload).map_err(|e| malformed(from, e))?;
        match from {
            Side::Client => Ok(self.client_data(head, frame, &payload[r], up, down)),
            Side::Containerd => Ok(self.server_data(head, &payload[r], up, down)),
        }
    }

    fn client_data(
        &mut self,
        head: &Head,
        frame: &[u8],
        content: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Verdict {
        let call = self.calls.get_mut(&head.stream).expect("checked by data()");
        let held = call.held.as_mut().expect("checked by data()");
        let mut verdict = Verdict::Forward;
        if held.request.len() + content.len() > grpc::MAX_HELD_BODY {
            tracing::warn!(method = %held.method, "request over 16 MiB; relaying it without interception");
            if held.parked_unsent() {
                up.extend(held.parked.drain(..));
            }
            call.held = None;
            return verdict;
        }
        held.request.extend_from_slice(content);
        if held.before == Before::Collecting {
            held.parked.push(Bytes::copy_from_slice(frame));
            held.parked_flow += head.len as u64;
            verdict = Verdict::Swallow;
        }
        if head.has(frames::END_STREAM) {
            if verdict == Verdict::Swallow {
                // Parked: `request_end` decides when it goes out.
                self.request_end(head.stream, up, down);
                return Verdict::Swallow;
            }
            self.request_end(head.stream, up, down);
        }
        verdict
    }

    fn request_end(&mut self, stream: u32, up: &mut VecDeque<Bytes>, down: &mut VecDeque<Bytes>) {
        let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held.as_mut()) else {
            return;
        };
        held.request_done = true;
        if held.before == Before::Collecting {
            let request = held.request.clone().freeze();
            match (grpc::unary_message(&request), held.hook.take()) {
                (Ok(msg), Some(mut hook)) => {
                    held.before = Before::Running;
                    self.hooks_added = true;
                    self.hooks.push(Box::pin(async move {
                        let result = hook.before(&msg).await;
                        Outcome::Before {
                            stream,
                            hook,
                            result,
                        }
                    }));
                }
                (msg, _) => {
                    // Compressed or malformed: never guess, let containerd judge it.
                    let error = msg.err();
                    tracing::warn!(method = %held.method, ?error, "request not interceptable; relaying untouched");
                    held.before = Before::Done;
                    up.extend(held.parked.drain(..));
                    held.parked_flow = 0;
                }
            }
            return;
        }
        if held.response_done {
            self.try_finish(stream, up, down);
        }
    }

    fn server_data(
        &mut self,
        head: &Head,
        content: &[u8],
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) -> Verdict {
        let call = self.calls.get_mut(&head.stream).expect("checked by data()");
        let held = call.held.as_mut().expect("checked by data()");
        held.data.extend_from_slice(content);
        held.data_flow += head.len as u64;
        if head.has(frames::END_STREAM) {
            held.data_end = true;
            held.response_done = true;
        }
        if held.data.len() > grpc::MAX_HELD_BODY {
            tracing::warn!(method = %held.method, "reply over 16 MiB; relaying it without interception");
            self.release(head.stream, up, down, false);
            return Verdict::Swallow;
        }
        if held.response_done {
            self.try_finish(head.stream, up, down);
        }
        Verdict::Swallow
    }

    /// Runs the `after` hook once both request and reply are in, or releases
    /// the reply untouched when there is nothing to act on.
    fn try_finish(&mut self, stream: u32, up: &mut VecDeque<Bytes>, down: &mut VecDeque<Bytes>) {
        let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held.as_mut()) else {
            return;
        };
        if !held.response_done || held.after_running || held.before == Before::Running {
            return;
        }
        if held.status() == Some(0) && held.hook.is_some() {
            let request = held.request.clone().freeze();
            let reply = held.data.clone().freeze();
            let rq = grpc::unary_message(&request);
            if !held.request_done
                && matches!(
                    rq,
                    Err(grpc::FrameError::Short(_) | grpc::FrameError::Length { .. })
                )
            {
                // grpc-go answers a unary call as soon as it has the message,
                // maybe before the client's END_STREAM: wait for the rest.
                return;
            }
            match (rq, grpc::unary_message(&reply)) {
                (Ok(rq), Ok(rs)) => {
                    let hook = held.hook.take().expect("checked above");
                    held.after_running = true;
                    self.hooks_added = true;
                    self.hooks.push(Box::pin(async move {
                        Outcome::After {
                            stream,
                            result: hook.after(rq, rs).await,
                        }
                    }));
                    return;
                }
                (rq, rs) => {
                    let e = rq.err().or(rs.err());
                    tracing::warn!(method = %held.method, error = ?e, "call not interceptable; relaying the reply untouched");
                }
            }
        }
        self.release(stream, up, down, true);
    }

    /// Sends a held reply on as containerd sent it. With `whole == false` the
    /// reply is still arriving: the call is left to pass through from here.
    fn release(
        &mut self,
        stream: u32,
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
        whole: bool,
    ) {
        let Some(call) = self.calls.get_mut(&stream) else {
            return;
        };
        let Some(held) = call.held.take() else {
            return;
        };
        let mut out = BytesMut::new();
        if let Some(head) = &held.head {
            frames::header_frames(stream, held.head_end, &mut out, |b| encode(b, head));
        }
        if !held.data.is_empty() || held.data_end {
            frames::data(stream, &held.data, held.data_end, &mut out);
        }
        if let Some(t) = &held.trailers {
            frames::header_frames(stream, true, &mut out, |b| encode(b, t));
        }
        down.push_back(out.freeze());
        down.extend(held.reset.clone());
        // Padding the client never saw is credited back to containerd.
        up.extend(frames::window_update(
            0,
            held.data_flow - held.data.len() as u64,
        ));
        if held.parked_unsent() {
            down.extend(frames::window_update(0, held.parked_flow));
        }
        if let Some(g) = call.guard.as_mut() {
            g.set_status(held.status());
        }
        if whole {
            self.calls.remove(&stream);
        }
    }

    /// Answers a held call with `status` instead of containerd's reply.
    fn fail(
        &mut self,
        stream: u32,
        status: tonic::Status,
        up: &mut VecDeque<Bytes>,
        down: &mut VecDeque<Bytes>,
    ) {
        let Some(mut call) = self.calls.remove(&stream) else {
            return;
        };
        let Some(held) = call.held.take() else {
            return;
        };
        down.push_back(error_reply(stream, status.code(), status.message()));
        down.extend(held.reset.clone());
        if !held.response_done {
            up.push_back(frames::rst_stream(stream, frames::CANCEL));
        }
        credit_back(&held, up, down);
        if let Some(g) = call.guard.as_mut() {
            g.set_status(Some(status.code() as i32));
        }
    }

    fn outcome(&mut self, o: Outcome, up: &mut VecDeque<Bytes>, down: &mut VecDeque<Bytes>) {
        match o {
            Outcome::Before {
                stream,
                hook,
                result,
            } => {
                let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held.as_mut()) else {
                    return; // the client gave up meanwhile
                };
                held.hook = Some(hook);
                match result {
                    Ok(()) => {
                        held.before = Before::Done;
                        up.extend(held.parked.drain(..));
                        held.parked_flow = 0;
                        self.try_finish(stream, up, down);
                    }
                    Err(status) => self.fail(stream, status, up, down),
                }
            }
            Outcome::After { stream, result } => match result {
                Ok(()) => self.release(stream, up, down, true),
                Err(status) => self.fail(stream, status, up, down),
            },
        }
    }
}

/// Gives back flow-control credit held frames took and never delivered.
fn credit_back(held: &Held, up: &mut VecDeque<Bytes>, down: &mut VecDeque<Bytes>) {
    up.extend(frames::window_update(0, held.data_flow));
    if held.parked_unsent() {
        down.extend(frames::window_update(0, held.parked_flow));
    }
}

fn encode(out: &mut BytesMut, fields: &[(Bytes, Bytes)]) {
    for (n, v) in fields {
        frames::encode_field(out, n, v);
    }
}

fn hpack_error(side: Side, e: super::hpack::HpackError) -> SpliceError {
    SpliceError::Hpack(side, e.to_string())
}

/// Trailers with a gRPC error status on `stream`, ending a call whose reply
/// headers (and maybe messages) the client has already had.
fn error_trailers(stream: u32, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let mut out = BytesMut::new();
    frames::header_frames(stream, true, &mut out, |b| {
        frames::encode_field(b, b"grpc-status", code.as_bytes());
        frames::encode_field(b, b"grpc-message", message.as_bytes());
    });
    out.freeze()
}

/// A Trailers-Only gRPC error reply on `stream`.
fn error_reply(stream: u32, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let fields = [
        (&b":status"[..], &b"200"[..]),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", code.as_bytes()),
        (b"grpc-message", message.as_bytes()),
    ];
    let mut out = BytesMut::new();
    frames::header_frames(stream, true, &mut out, |b| {
        for (n, v) in fields {
            frames::encode_field(b, n, v);
        }
    });
    out.freeze()
}

#[cfg(test)]
mod tests {
    //! Frame-level checks with both peers played by hand, for what real
    //! clients and containerd do too rarely to catch in integration tests.
    use super::*;
    use crate::proxy::intercept::typed;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::Notify;

    struct Rules {
        fail: bool,
        gate: Arc<Notify>,
        wait: AtomicBool,
    }

    impl Rules {
        /// Hooks on `/t.S/Held` that fail or pass, after `gate` if `wait`.
        fn new(fail: bool, wait: bool, gate: Arc<Notify>) -> Rules {
            Rules {
                fail,
                gate,
                wait: AtomicBool::new(wait),
            }
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
            Some(typed(move |_: (), _: ()| async move {
                if wait {
                    gate.notified().await;
                }
                if fail {
                    Err(tonic::Status::internal("boom"))
                } else {
                    Ok(())
                }
            }))
        }
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn block(fields: &[(&str, &str)]) -> Vec<u8> {
        let mut b = BytesMut::new();
        for (n, v) in fields {
            frames::encode_field(&mut b, n.as_bytes(), v.as_bytes());
        }
        b.to_vec()
    }

    fn request(stream: u32, path: &str) -> Vec<u8> {
        let b = block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "x"),
        ]);
        frame(frames::HEADERS, frames::END_HEADERS, stream, &b)
    }

    async fn read_frame(s: &mut UnixStream) -> (Head, Vec<u8>) {
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h).await.unwrap();
        let head = Head::parse(&h);
        let mut p = vec![0; head.len];
        s.read_exact(&mut p).await.unwrap();
        (head, p)
    }

    type Task = tokio::task::JoinHandle<Result<(), SpliceError>>;

    fn start(rules: Rules) -> (UnixStream, UnixStream, Task) {
        start_with(rules, CancellationToken::new())
    }

    fn start_with(rules: Rules, drain: CancellationToken) -> (UnixStream, UnixStream, Task) {
        let (client, proxy_down) = UnixStream::pair().unwrap();
        let (proxy_up, server) = UnixStream::pair().unwrap();
        let ctx = Arc::new(Ctx {
            interceptor: Arc::new(rules),
            observer: None,
            upstream: "/run/test.sock".into(),
        });
        let task = tokio::spawn(run(proxy_down, proxy_up, ctx, drain));
        (client, server, task)
    }

    const MSG: [u8; 5] = [0, 0, 0, 0, 0];

    /// containerd's OK reply to a unary call: headers, one message, trailers.
    fn ok_reply(stream: u32) -> Vec<u8> {
        let mut r = frame(
            frames::HEADERS,
            frames::END_HEADERS,
            stream,
            &block(&[(":status", "200")]),
        );
        r.extend(frame(frames::DATA, 0, stream, &MSG));
        let t = block(&[("grpc-status", "0")]);
        r.extend(frame(
            frames::HEADERS,
            frames::END_HEADERS | frames::END_STREAM,
            stream,
            &t,
        ));
        r
    }

    /// Writes `sent` as the client and returns what containerd received.
    async fn relay(client: &mut UnixStream, server: &mut UnixStream, sent: &[u8]) -> Vec<u8> {
        client.write_all(sent).await.unwrap();
        let mut got = vec![0; sent.len()];
        server.read_exact(&mut got).await.unwrap();
        got
    }

    #[tokio::test]
    async fn reply_before_end_stream_still_runs_the_hook_and_its_error_wins() {
        let rules = Rules::new(true, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(frame(4, 0, 0, &[]));
        sent.extend(request(1, "/t.S/Held"));
        sent.extend(frame(frames::DATA, 0, 1, &MSG));
        let got = relay(&mut client, &mut server, &sent).await;
        assert_eq!(got, sent, "client frames reach containerd byte for byte");

        // grpc-go replies once it has the message, before END_STREAM.
        let reply = ok_reply(1);
        server.write_all(&reply).await.unwrap();
        client
            .write_all(&frame(frames::DATA, frames::END_STREAM, 1, &[]))
            .await
            .unwrap();

        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 1));
        assert!(h.has(frames::END_STREAM), "Trailers-Only error reply");
        let fields = loona_hpack::Decoder::new().decode(&p).unwrap();
        assert!(
            fields.contains(&(b"grpc-status".to_vec(), b"13".to_vec())),
            "{fields:?}"
        );
        assert!(fields.contains(&(b"grpc-message".to_vec(), b"boom".to_vec())));

        // containerd gets the END_STREAM and its 5 DATA bytes of credit back.
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.flags), (frames::DATA, frames::END_STREAM));
        let (h, p) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (frames::WINDOW_UPDATE, 0));
        assert_eq!(p, 5u32.to_be_bytes());
    }

    /// A compressed request (grpc-encoding, flag 1) for a hooked method is
    /// not decoded: it reaches containerd byte for byte, the hook (here one
    /// that fails every call) never runs, and containerd's reply stands.
    #[tokio::test]
    async fn compressed_request_passes_untouched_and_skips_the_hook() {
        let rules = Rules::new(true, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Held"));
        let compressed = [1, 0, 0, 0, 3, 0xaa, 0xbb, 0xcc];
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &compressed));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        server.write_all(&ok_reply(1)).await.unwrap();
        let mut dec = loona_hpack::Decoder::new();
        let mut statuses = Vec::new();
        let mut data = Vec::new();
        loop {
            let (h, p) = read_frame(&mut client).await;
            match h.kind {
                frames::HEADERS => {
                    for (n, v) in dec.decode(&p).unwrap() {
                        if n == b"grpc-status" {
                            statuses.push(v);
                        }
                    }
                }
                frames::DATA => data.extend(p),
                _ => {}
            }
            if h.has(frames::END_STREAM) {
                break;
            }
        }
        assert_eq!(
            statuses,
            vec![b"0".to_vec()],
            "containerd's status, not the hook's"
        );
        assert_eq!(data, MSG, "containerd's reply message");
    }

    #[tokio::test]
    async fn held_reply_released_after_later_replies_decodes_with_one_hpack_state() {
        let gate = Arc::new(Notify::new());
        let rules = Rules::new(false, true, gate.clone());
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Held"));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        sent.extend(request(3, "/t.S/Plain"));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 3, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        // containerd's encoder indexes: the second block refers to entries
        // the first one (the held reply) inserted.
        let mut enc = loona_hpack::Encoder::new();
        let fields: [(&[u8], &[u8]); 3] = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"x-custom", b"first"),
        ];
        let mut reply = Vec::new();
        let mut blocks = Vec::new();
        for stream in [1u32, 3] {
            let b = enc.encode(fields.iter().copied());
            blocks.push(b.clone());
            reply.extend(frame(frames::HEADERS, frames::END_HEADERS, stream, &b));
            reply.extend(frame(frames::DATA, 0, stream, &MSG));
            let t = enc.encode([(&b"grpc-status"[..], &b"0"[..])]);
            reply.extend(frame(
                frames::HEADERS,
                frames::END_HEADERS | frames::END_STREAM,
                stream,
                &t,
            ));
        }
        assert!(
            loona_hpack::Decoder::new().decode(&blocks[1]).is_err(),
            "the second block must depend on the first one's table entries"
        );
        server.write_all(&reply).await.unwrap();

        let mut dec = loona_hpack::Decoder::new();
        let mut order = Vec::new();
        for i in 0..6 {
            if i == 3 {
                gate.notify_one();
            }
            let (h, p) = read_frame(&mut client).await;
            if h.kind == frames::HEADERS {
                let f = dec.decode(&p).unwrap();
                let has = |n: &[u8], v: &[u8]| f.contains(&(n.to_vec(), v.to_vec()));
                assert!(
                    has(b"x-custom", b"first") || has(b"grpc-status", b"0"),
                    "{f:?}"
                );
            }
            order.push((h.stream, h.kind));
        }
        let h = (frames::HEADERS, frames::DATA);
        assert_eq!(
            order,
            [(3, h.0), (3, h.1), (3, h.0), (1, h.0), (1, h.1), (1, h.0)]
        );
    }

    #[tokio::test]
    async fn replies_pass_byte_for_byte_while_held_ones_leave_the_hpack_table_alone() {
        let gate = Arc::new(Notify::new());
        let rules = Rules::new(false, true, gate.clone());
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frames::PREFACE.to_vec();
        for (stream, path) in [(1, "/t.S/Plain"), (3, "/t.S/Held"), (5, "/t.S/Plain")] {
            sent.extend(request(stream, path));
            sent.extend(frame(frames::DATA, frames::END_STREAM, stream, &MSG));
        }
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        // An indexing encoder, as containerd's: stream 1's reply inserts
        // entries, the held stream 3 only refers to them, stream 5 refers to
        // them and inserts one more.
        let mut enc = loona_hpack::Encoder::new();
        let mut blocks = Vec::new(); // per reply, in order
        let mut reply = |stream: u32, extra: &[(&'static [u8], &'static [u8])]| {
            let mut head: Vec<(&[u8], &[u8])> =
                vec![(b":status", b"200"), (b"content-type", b"application/grpc")];
            head.extend_from_slice(extra);
            let (h, t) = (
                enc.encode(head),
                enc.encode([(&b"grpc-status"[..], &b"0"[..])]),
            );
            let mut r = frame(frames::HEADERS, frames::END_HEADERS, stream, &h);
            r.extend(frame(frames::DATA, 0, stream, &MSG));
            let end = frames::END_HEADERS | frames::END_STREAM;
            r.extend(frame(frames::HEADERS, end, stream, &t));
            blocks.push([h, t]);
            r
        };
        let (r1, r3, r5) = (reply(1, &[]), reply(3, &[]), reply(5, &[(b"x-new", b"v")]));
        let mut all = r1.clone();
        all.extend(&r3);
        all.extend(&r5);
        server.write_all(&all).await.unwrap();

        // The held reply changed nothing in the table, so the replies after
        // it still go out exactly as containerd wrote them.
        let mut got = vec![0; r1.len() + r5.len()];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(got[..r1.len()], r1[..]);
        assert_eq!(got[r1.len()..], r5[..]);

        // The held one, released later, decodes with the client's one table
        // (which has seen the blocks of replies 1 and 5).
        let mut dec = loona_hpack::Decoder::new();
        for b in [&blocks[0], &blocks[2]].into_iter().flatten() {
            dec.decode(b).unwrap();
        }
        gate.notify_one();
        let mut kinds = Vec::new();
        for _ in 0..3 {
            let (h, p) = read_frame(&mut client).await;
            assert_eq!(h.stream, 3);
            if h.kind == frames::HEADERS {
                let f = dec.decode(&p).unwrap();
                assert!(
                    f.contains(&(b"content-type".to_vec(), b"application/grpc".to_vec()))
                        || f.contains(&(b"grpc-status".to_vec(), b"0".to_vec())),
                    "{f:?}"
                );
            }
            kinds.push(h.kind);
        }
        assert_eq!(kinds, [frames::HEADERS, frames::DATA, frames::HEADERS]);
    }

    #[tokio::test]
    async fn containerd_lost_mid_call_answers_unavailable_naming_the_socket() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start(rules);
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Plain"));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        drop(server); // containerd dies with the call in flight

        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 1));
        assert!(h.has(frames::END_STREAM));
        let fields = loona_hpack::Decoder::new().decode(&p).unwrap();
        assert!(
            fields.contains(&(b"grpc-status".to_vec(), b"14".to_vec())),
            "{fields:?}"
        );
        let msg = fields.iter().find(|(n, _)| n == b"grpc-message").unwrap();
        assert!(
            String::from_utf8_lossy(&msg.1).contains("/run/test.sock"),
            "{msg:?}"
        );
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(
            h.kind,
            frames::GOAWAY,
            "the client is sent to a new connection"
        );

        // A call that was already on its way is answered the same way.
        client.write_all(&request(3, "/t.S/Plain")).await.unwrap();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 3));
        let fields = loona_hpack::Decoder::new().decode(&p).unwrap();
        assert!(fields.contains(&(b"grpc-status".to_vec(), b"14".to_vec())));
        drop(client);
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("splice ends once the client hangs up")
            .unwrap()
            .unwrap();
    }

    /// Requests repeat their header block byte for byte, and the decoded
    /// method is reused, but only while the table those bytes index into
    /// has not changed: the same bytes then name another method.
    #[test]
    fn a_repeated_request_block_is_decoded_again_once_the_table_changed() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let mut st = State::new(Arc::new(Ctx {
            interceptor: Arc::new(rules),
            observer: None,
            upstream: "/run/test.sock".into(),
        }));
        // `:path` (static 4) as a literal added to the table (index 62).
        let insert = |path: &str| [&[0x44, path.len() as u8], path.as_bytes()].concat();
        // `:method: POST` (static 3), then dynamic index 62.
        let indexed = [0x83, 0xbe];
        let blocks = [
            (1, insert("/t.S/Plain")),
            (3, indexed.to_vec()),
            (5, indexed.to_vec()),
            (7, insert("/t.S/Held")),
            (9, indexed.to_vec()),
        ];
        let (mut up, mut down) = (VecDeque::new(), VecDeque::new());
        for (stream, b) in &blocks {
            st.request_headers(*stream, false, b, &mut up, &mut down)
                .unwrap();
            if *stream == 5 {
                let seen = st.request_seen.get(&st.client_dec, &indexed);
                assert_eq!(seen.map(|(p, _)| &**p), Some("/t.S/Plain"), "reused");
            }
        }
        let held: Vec<u32> = (1..=9)
            .filter(|s| st.calls.get(s).is_some_and(|c| c.held.is_some()))
            .collect();
        assert_eq!(held, [7, 9]);
        let mut plain: Vec<u32> = st.opening.iter().map(|(s, _)| *s).collect();
        plain.sort();
        assert_eq!(plain, [1, 3, 5]);
    }

    /// A splice with stream 1 (a plain call) sent to containerd, unanswered.
    async fn call_in_flight(drain: CancellationToken) -> (UnixStream, UnixStream, Task) {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain);
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Plain"));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        (client, server, task)
    }

    /// A drained connection whose client never reads the last reply is not
    /// kept open: it closes once the linger time is over.
    #[tokio::test]
    async fn drained_connection_of_a_client_that_stops_reading_closes_after_the_linger() {
        let drain = CancellationToken::new();
        let (client, mut server, task) = call_in_flight(drain.clone()).await;
        drain.cancel();
        server.write_all(&ok_reply(1)).await.unwrap();
        // The client reads nothing from here on.
        let started = std::time::Instant::now();
        tokio::time::timeout(DRAIN_LINGER * 3, task)
            .await
            .expect("the linger has a deadline")
            .unwrap()
            .unwrap();
        let took = started.elapsed();
        assert!(
            took >= DRAIN_LINGER - LINGER_CHECK,
            "closed after {took:?} while the client still had a reply to read"
        );
        drop(client);
    }

    const SUBSCRIBE: &str = "/containerd.services.events.v1.Events/Subscribe";

    /// The fields of a header block written without the dynamic table.
    fn fields(block: &[u8]) -> Vec<(String, String)> {
        let f = loona_hpack::Decoder::new().decode(block).unwrap();
        f.into_iter()
            .map(|(n, v)| {
                let v = String::from_utf8_lossy(&v).into_owned();
                (String::from_utf8_lossy(&n).into_owned(), v)
            })
            .collect()
    }

    fn has(f: &[(String, String)], n: &str, v: &str) -> bool {
        f.iter().any(|(a, b)| a == n && b == v)
    }

    /// A subscription with no reply yet is answered Trailers-Only
    /// UNAVAILABLE and reset at containerd the moment the drain starts;
    /// an event containerd sent meanwhile is dropped (its credit given
    /// back), while a plain call in flight still gets its reply.
    #[tokio::test]
    async fn drain_ends_a_waiting_subscription_at_once_and_lets_other_calls_finish() {
        let drain = CancellationToken::new();
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain.clone());
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, SUBSCRIBE));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        sent.extend(request(3, "/t.S/Plain"));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 3, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        drain.cancel();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!(h.kind, frames::GOAWAY);
        assert_eq!(&p[..4], &3u32.to_be_bytes(), "both calls were accepted");
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 1));
        assert!(h.has(frames::END_STREAM));
        let f = fields(&p);
        assert!(
            has(&f, ":status", "200") && has(&f, "grpc-status", "14"),
            "{f:?}"
        );
        let msg = f.iter().find(|(n, _)| n == "grpc-message").unwrap();
        assert!(msg.1.contains("restarting"), "{msg:?}");
        let (h, p) = read_frame(&mut server).await;
        assert_eq!(
            (h.kind, h.stream, &p[..]),
            (frames::RST_STREAM, 1, &frames::CANCEL.to_be_bytes()[..])
        );

        // An event that crossed the reset, then the plain call's reply.
        let mut late = frame(
            frames::HEADERS,
            frames::END_HEADERS,
            1,
            &block(&[(":status", "200")]),
        );
        late.extend(frame(frames::DATA, 0, 1, &MSG));
        late.extend(ok_reply(3));
        server.write_all(&late).await.unwrap();
        let (h, p) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (frames::WINDOW_UPDATE, 0));
        assert_eq!(p, 5u32.to_be_bytes(), "the dropped event's credit");
        for kind in [frames::HEADERS, frames::DATA, frames::HEADERS] {
            let (h, _) = read_frame(&mut client).await;
            assert_eq!((h.kind, h.stream), (kind, 3), "nothing more on stream 1");
        }
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        drop(client);
        tokio::time::timeout(DRAIN_LINGER, task)
            .await
            .expect("splice ends after the last call")
            .unwrap()
            .unwrap();
    }

    /// A subscription that has had replies ends with trailers (no second
    /// `:status`), and the drained connection closes right after.
    #[tokio::test]
    async fn drain_ends_a_streaming_subscription_with_trailers() {
        let drain = CancellationToken::new();
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain.clone());
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, SUBSCRIBE));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        let mut event = frame(
            frames::HEADERS,
            frames::END_HEADERS,
            1,
            &block(&[(":status", "200"), ("content-type", "application/grpc")]),
        );
        event.extend(frame(frames::DATA, 0, 1, &MSG));
        server.write_all(&event).await.unwrap();
        let mut got = vec![0; event.len()];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(got, event);

        drain.cancel();
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, frames::GOAWAY);
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 1));
        assert!(h.has(frames::END_STREAM));
        let f = fields(&p);
        assert!(has(&f, "grpc-status", "14"), "{f:?}");
        assert!(!f.iter().any(|(n, _)| n == ":status"), "trailers: {f:?}");
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (frames::RST_STREAM, 1));
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        tokio::time::timeout(DRAIN_LINGER, task)
            .await
            .expect("splice ends without waiting for the subscription")
            .unwrap()
            .unwrap();
    }

    /// The drain starts while the first reply block of a subscription is
    /// half read: it is ended once the block is through, with trailers.
    #[tokio::test]
    async fn drain_during_a_split_reply_block_ends_the_subscription_after_it() {
        let drain = CancellationToken::new();
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain.clone());
        let mut sent = frames::PREFACE.to_vec();
        sent.extend(request(1, SUBSCRIBE));
        sent.extend(frame(frames::DATA, frames::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        let b = block(&[(":status", "200"), ("content-type", "application/grpc")]);
        let (first, second) = b.split_at(3);
        let head = frame(frames::HEADERS, 0, 1, first);
        server.write_all(&head).await.unwrap();
        let mut got = vec![0; head.len()];
        client.read_exact(&mut got).await.unwrap();

        drain.cancel();
        // Only once the block is whole: GOAWAY, then trailers.
        let cont = frame(frames::CONTINUATION, frames::END_HEADERS, 1, second);
        server.write_all(&cont).await.unwrap();
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, frames::CONTINUATION);
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, frames::GOAWAY);
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (frames::HEADERS, 1));
        let f = fields(&p);
        assert!(has(&f, "grpc-status", "14"), "{f:?}");
        assert!(!f.iter().any(|(n, _)| n == ":status"), "trailers: {f:?}");
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (frames::RST_STREAM, 1));
        drop(client);
        tokio::time::timeout(DRAIN_LINGER, task)
            .await
            .expect("splice ends")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn drain_finishes_calls_in_flight_and_refuses_new_ones() {
        let drain = CancellationToken::new();
        let (mut client, mut server, task) = call_in_flight(drain.clone()).await;

        drain.cancel();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!(h.kind, frames::GOAWAY);
        assert_eq!(
            &p[..4],
            &1u32.to_be_bytes(),
            "calls up to stream 1 still run"
        );

        // A call the client opened before it saw GOAWAY: refused both ways.
        let late = request(3, "/t.S/Plain");
        client.write_all(&late).await.unwrap();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!(
            (h.kind, h.stream, &p[..]),
            (frames::RST_STREAM, 3, &7u32.to_be_bytes()[..])
        );
        let mut got = vec![0; late.len()];
        server.read_exact(&mut got).await.unwrap();
        let (h, _) = read_frame(&mut server).await;
        assert_eq!(
            (h.kind, h.stream),
            (frames::RST_STREAM, 3),
            "containerd drops it too"
        );

        // The call in flight completes, then the splice closes.
        let reply = ok_reply(1);
        server.write_all(&reply).await.unwrap();
        let mut kinds = Vec::new();
        for _ in 0..3 {
            kinds.push(read_frame(&mut client).await.0.kind);
        }
        assert_eq!(kinds, [frames::HEADERS, frames::DATA, frames::HEADERS]);
        // Our side is closed, yet the client may still write (a window
        // update for the reply it read) without EPIPE; its hang-up ends
        // the splice well before the linger time.
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        client
            .write_all(&frame(frames::WINDOW_UPDATE, 0, 0, &[0, 0, 0, 9]))
            .await
            .unwrap();
        // Having read everything, it need not hang up: the splice ends once
        // nothing was left unread for a check period.
        tokio::time::timeout(DRAIN_LINGER / 2, task)
            .await
            .expect("splice ends after the last call")
            .unwrap()
            .unwrap();
    }
}
