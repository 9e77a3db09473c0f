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
//! Where each job lives (the seams hyperium/h2 has too). No file below
//! imports one above it:
//! - `conn`: the connection loop: both pumps, hooks, drain, containerd lost;
//! - `pump`: one direction's bytes: read buffer → whole frames → write queue;
//! - `streams`: the connection's calls driven by frames, and what held and
//!   watched calls ask of it (the effects they return);
//! - `calls`: the calls table, each call in its [`calls::CallPhase`];
//! - `held`: the life of an intercepted call (`held::CallState`);
//! - `watched`: a streaming call watched message by message;
//! - `headers`: both peers' HPACK mirrors, their SETTINGS, and memos;
//! - `hooks`: the hooks' work in flight and what it brings back;
//! - `ping`: the client PINGs the splice answers itself (those a released
//!   held reply causes, which containerd would count against the client);
//! - `reply`: the gRPC error replies the splice writes itself;
//! - `open_ended`: the calls a drain ends at once ([`OPEN_ENDED`]);
//! - `phase`: where the connection is in its life (open, draining, lost,
//!   closing, lingering): the loop moves it on, the pumps and calls read it;
//! - `verdict`, `side`, `error`, `ctx`: small shared types;
//! - [`frame`]: the wire format: frame heads, padding, the frames the splice
//!   writes itself, the header-block limits;
//! - [`hpack`]: header-block decoding (one mirror per direction) and the
//!   re-encoder that never touches a dynamic table.

pub mod frame;
pub mod hpack;

mod calls;
mod conn;
mod ctx;
mod error;
mod headers;
mod held;
mod hooks;
mod open_ended;
mod phase;
mod ping;
mod pump;
mod reply;
mod settings;
mod side;
mod streams;
#[cfg(test)]
mod testing;
mod verdict;
mod watched;

use std::sync::Arc;

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

pub use ctx::Ctx;
pub use error::SpliceError;
pub use open_ended::{OPEN_ENDED, RESTARTING};
pub use side::Side;

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
