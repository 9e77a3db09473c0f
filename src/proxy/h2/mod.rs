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
//!   dynamic table ([`hpack::encode_field`]), so they can go out after later
//!   blocks. Every other block goes out as containerd encoded it, which keeps
//!   the client's HPACK table a mirror of containerd's encoder. Should a held
//!   or dropped block have changed containerd's table, the mirror is broken
//!   for good: from then on every containerd block is re-encoded that way;
//! - a client PING that a released held reply caused, and that containerd
//!   would count against the client, is answered by the splice (`ping`);
//! - on shutdown it sends GOAWAY, refuses calls opened after it, and ends the
//!   calls that never end on their own with UNAVAILABLE ([`OPEN_ENDED`]).
//!
//! Where each job lives (the seams hyperium/h2 has too):
//! - [`frame`]: the wire format: frame heads, padding, the frames the splice
//!   writes itself;
//! - [`hpack`]: header-block decoding (one mirror per direction) and the
//!   re-encoder that never touches a dynamic table;
//! - `pump`: one direction's bytes: read buffer → whole frames → write queue;
//! - `conn`: the connection loop: both pumps, hooks, drain, containerd lost;
//! - `streams`: per-stream tracking, header blocks, DATA of refused calls;
//! - `held`: the life of an intercepted call (`held::CallState`);
//! - `ping`: the client PINGs the splice answers itself (those a released
//!   held reply causes, which containerd would count against the client).

pub mod frame;
pub mod hpack;

mod conn;
mod held;
mod ping;
mod pump;
mod settings;
mod streams;
#[cfg(test)]
mod testing;
mod watched;

use std::fmt;
use std::io;
use std::sync::Arc;

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::intercept::Interceptor;
use super::observe::CallObserver;

/// Largest header block (metadata), as containerd accepts.
const MAX_BLOCK: usize = 16 << 20;

/// Most CONTINUATION frames one header block may have. Empty ones add no
/// bytes, so [`MAX_BLOCK`] alone would not bound a flood of them: each
/// costs the splice a pass, and the block holds the connection open.
///
/// The count is the largest block over the smallest frame size every peer
/// must accept (16,384 bytes): senders fill their header frames, and
/// grpc-go (containerd, and most clients) splits header blocks at 16 KiB
/// whatever SETTINGS_MAX_FRAME_SIZE allows, so a count derived from a
/// larger negotiated frame size would cut off a legitimate large block.
/// Plus 8 for frames that are not full: an encoder may close a block with
/// an empty CONTINUATION carrying END_HEADERS after one it filled exactly,
/// and a few partial frames are no flood. A flood is cut after 1,032
/// frames (about 9 KiB of frame headers).
const MAX_CONTINUATIONS: usize = MAX_BLOCK / frame::EMIT_PAYLOAD + 8;

/// What the client is told when the splice can no longer read its header
/// blocks (GOAWAY debug data, which client libraries log).
const DESYNC: &str = "imgbridge lost track of this connection's header compression (HPACK) \
    and cannot tell which calls it carries; reconnect";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Containerd,
}

impl Side {
    /// The peer on the other end of the splice.
    fn other(self) -> Side {
        match self {
            Side::Client => Side::Containerd,
            Side::Containerd => Side::Client,
        }
    }
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
    #[error("{0} sent a header block in over {MAX_CONTINUATIONS} CONTINUATION frames")]
    Continuations(Side),
    #[error("{0}: {1}")]
    Settings(Side, String),
    /// A frame over the SETTINGS_MAX_FRAME_SIZE its receiver allows: the
    /// receiver would end the connection, and the fault is the sender's.
    #[error("{0} sent a frame of {1} bytes, over the {2} the other side allows (SETTINGS_MAX_FRAME_SIZE)")]
    FrameTooLarge(Side, usize, usize),
    /// The HPACK mirror of the client's encoder cannot decode a request
    /// block: which method it calls is unknown, so the connection is closed.
    #[error("the client's header block does not decode against imgbridge's copy of its HPACK table (the copy diverged, or the block is malformed): {0}")]
    HpackDesync(String),
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

    /// The splice lost track of the client's header compression.
    pub fn is_desync(&self) -> bool {
        matches!(self, SpliceError::HpackDesync(_))
    }

    /// Resets and broken pipes are how peers hang up; everything else is news.
    pub fn is_hangup(&self) -> bool {
        matches!(self, SpliceError::Read(_, e) | SpliceError::Write(_, e)
            if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted | io::ErrorKind::NotConnected))
    }
}

fn malformed(side: Side, e: impl fmt::Display) -> SpliceError {
    SpliceError::Malformed(side, e.to_string())
}

fn hpack_error(side: Side, e: hpack::HpackError) -> SpliceError {
    SpliceError::Hpack(side, e.to_string())
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
    let mut conn = conn::Conn::new(client, upstream, ctx, drain)?;
    std::future::poll_fn(|cx| conn.poll(cx)).await
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

/// Where frames the splice writes itself go, written at the next frame
/// boundary of each direction: `up` toward containerd, `down` toward the
/// client.
struct Out<'a> {
    up: &'a mut std::collections::VecDeque<bytes::Bytes>,
    down: &'a mut std::collections::VecDeque<bytes::Bytes>,
}

impl Out<'_> {
    /// The queue toward `side`.
    fn to(&mut self, side: Side) -> &mut std::collections::VecDeque<bytes::Bytes> {
        match side {
            Side::Containerd => self.up,
            Side::Client => self.down,
        }
    }
}
