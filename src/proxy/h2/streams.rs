//! Per-stream tracking, shared by both directions: which calls are open,
//! what their header blocks say (method, namespace, status), the HPACK
//! mirror of each peer's encoder, and the calls that are refused.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;

use super::frame::{self, Head, Kind, Reason, HEADER_LEN};
use super::held::{Held, Outcome};
use super::hpack::{self, Decoder};
use super::ping::Pings;
use super::pump::{Block, Verdict};
use super::settings::Advertised;
use super::watched::{Step, Watched};
use super::MAX_CONTINUATIONS;
use super::RESTARTING;
use super::{hpack_error, malformed, open_ended, Ctx, Out, Side, SpliceError, MAX_BLOCK};
use crate::proxy::grpc;
use crate::proxy::intercept::CallInfo;
use crate::proxy::observe::CallGuard;

/// The HPACK table size every decoder starts with (RFC 7541 §4.2), until
/// SETTINGS allow more.
const INITIAL_TABLE: usize = 4096;

/// Per-connection call state, shared by both directions.
pub(super) struct State {
    pub(super) ctx: Arc<Ctx>,
    pub(super) calls: HashMap<u32, Call, BuildHasherDefault<StreamIdHasher>>,
    pub(super) client_dec: Decoder,
    pub(super) server_dec: Decoder,
    /// What the client's SETTINGS allow containerd's encoder, and the
    /// other way round.
    pub(super) client_settings: Advertised,
    pub(super) server_settings: Advertised,
    pub(super) hooks: FuturesUnordered<BoxFuture<'static, Outcome>>,
    pub(super) hooks_added: bool,
    pub(super) last_stream: u32,
    /// Set once GOAWAY was sent: streams above it are refused.
    pub(super) goaway: Option<u32>,
    /// containerd went away; new calls are answered UNAVAILABLE.
    pub(super) lost: bool,
    /// The client closed its side: containerd's EOF is the normal end.
    pub(super) client_gone: bool,
    /// The client's HPACK table for containerd's blocks is the same as
    /// containerd's: blocks of calls that are neither held nor refused go
    /// out byte for byte.
    pub(super) mirror: bool,
    /// The last `:path` and namespace seen: calls on a connection mostly
    /// repeat them, and sharing saves an allocation per call.
    pub(super) seen_path: Option<Arc<str>>,
    pub(super) seen_namespace: Option<Arc<str>>,
    /// The last request block and what it said (method, namespace).
    pub(super) request_seen: Repeat<(Arc<str>, Option<Arc<str>>)>,
    /// The last passed reply block and its `grpc-status`.
    pub(super) reply_seen: Repeat<Option<i32>>,
    /// Where containerd's header blocks are re-encoded: each frame is split
    /// off, and the space is reused once the frames are written.
    pub(super) out: BytesMut,
    /// Calls answered in this round, reported to the observer once the
    /// round's writes are done.
    pub(super) ended: Vec<CallGuard>,
    /// Calls no hook holds, whose bookkeeping waits until their request is
    /// written: see [`State::open_calls`].
    pub(super) opening: Vec<(u32, Arc<str>)>,
    /// Which client PINGs containerd would count against it.
    pub(super) pings: Pings,
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
pub(super) struct Repeat<T> {
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
    pub(super) fn get(&self, dec: &Decoder, block: &[u8]) -> Option<&T> {
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

pub(super) struct Call {
    pub(super) guard: Option<CallGuard>,
    pub(super) held: Option<Box<Held>>,
    /// Opened after GOAWAY, or ended by a drain: reset at containerd and
    /// answered to the client, its later frames dropped.
    pub(super) refused: bool,
    /// On the [`OPEN_ENDED`] list.
    pub(super) open_ended: bool,
    /// A reply header block went to the client.
    pub(super) replied: bool,
    /// A streaming call the policy watches (never held as a whole).
    pub(super) watch: Option<Box<Watched>>,
}

/// Room for the re-encoded header frames of many replies: the space is
/// reclaimed in place once they are written.
const OUT_ARENA: usize = 4096;

/// Stream ids are distinct small integers: a multiply spreads them over the
/// hash bits; SipHash was a measurable share of a call's CPU.
#[derive(Default)]
pub(super) struct StreamIdHasher(u64);

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

impl State {
    pub(super) fn new(ctx: Arc<Ctx>) -> State {
        State {
            ctx,
            calls: HashMap::default(),
            client_dec: Decoder::new(INITIAL_TABLE),
            server_dec: Decoder::new(INITIAL_TABLE),
            client_settings: Advertised::default(),
            server_settings: Advertised::default(),
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
            pings: Pings::default(),
        }
    }

    /// The largest frame `from` may send: what the other side's SETTINGS
    /// allow.
    pub(super) fn frame_limit(&self, from: Side) -> usize {
        match from {
            Side::Client => self.server_settings.frame_limit(),
            Side::Containerd => self.client_settings.frame_limit(),
        }
    }

    /// Whether a frame must be in the buffer whole before it is classified.
    pub(super) fn whole(&self, from: Side, head: &Head) -> bool {
        match head.kind {
            Kind::Headers
            | Kind::Continuation
            | Kind::RstStream
            | Kind::PushPromise
            | Kind::Settings
            | Kind::Ping => true,
            Kind::Data => self.calls.get(&head.stream).is_some_and(|c| {
                c.refused
                    || c.watch.is_some()
                    || c.held
                        .as_ref()
                        .is_some_and(|h| from == Side::Containerd || !h.request_done())
            }),
            _ => false,
        }
    }

    /// A passed-through containerd DATA frame.
    pub(super) fn relayed(&mut self, head: &Head) {
        if let Some(o) = &self.ctx.observer {
            o.bytes_relayed(head.len as u64);
        }
        if head.has(frame::END_STREAM) {
            self.end_call(head.stream);
        }
    }

    /// Forgets an answered call. Its metrics are recorded after the reply
    /// is written (see `ended`), not between reading and writing it.
    pub(super) fn end_call(&mut self, stream: u32) {
        if let Some(guard) = self.calls.remove(&stream).and_then(|c| c.guard) {
            self.ended.push(guard);
        }
    }

    /// Ends every open-ended call that is neither answered nor held: reset
    /// at containerd, UNAVAILABLE to the client (see [`OPEN_ENDED`]).
    pub(super) fn end_open_ended(&mut self, out: Out<'_>) {
        for (&stream, call) in self.calls.iter_mut() {
            if !call.open_ended || call.refused || call.held.is_some() {
                continue;
            }
            call.refused = true;
            out.up.push_back(frame::rst_stream(stream, Reason::CANCEL));
            let code = tonic::Code::Unavailable;
            out.down.push_back(match call.replied {
                true => error_trailers(stream, code, RESTARTING),
                false => error_reply(stream, code, RESTARTING),
            });
            if let Some(mut g) = call.guard.take() {
                g.set_status(Some(code as i32));
                self.ended.push(g);
            }
        }
    }

    pub(super) fn awaiting_hooks(&self) -> bool {
        (self.calls.values()).any(|c| {
            c.held.as_ref().is_some_and(|h| h.reply_done())
                || c.watch.as_ref().is_some_and(|w| w.waiting())
        })
    }

    /// A whole frame that is not plain DATA. `out` takes frames to write
    /// after it.
    pub(super) fn frame(
        &mut self,
        from: Side,
        head: &Head,
        frame: &[u8],
        block: &mut Option<Block>,
        out: Out<'_>,
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
            Kind::Headers => {
                if head.stream == 0 {
                    return Err(malformed(from, "HEADERS on stream 0"));
                }
                let r = frame::content(head, payload).map_err(|e| malformed(from, e))?;
                // The client's blocks always go out as they are.
                let forward = from == Side::Client || self.passes(head.stream);
                if head.has(frame::END_HEADERS) {
                    let end = head.has(frame::END_STREAM);
                    self.block_done(from, head.stream, end, forward, &payload[r], out)?;
                } else {
                    *block = Some(Block {
                        stream: head.stream,
                        end_stream: head.has(frame::END_STREAM),
                        forward,
                        bytes: payload[r].to_vec(),
                        continuations: 0,
                    });
                }
                Ok(verdict(forward))
            }
            Kind::Continuation => {
                let mut b = match block.take() {
                    Some(b) if b.stream == head.stream => b,
                    _ => return Err(malformed(from, "CONTINUATION without its HEADERS")),
                };
                if b.bytes.len() + payload.len() > MAX_BLOCK {
                    return Err(SpliceError::BlockTooLarge(from));
                }
                b.continuations += 1;
                if b.continuations > MAX_CONTINUATIONS {
                    return Err(SpliceError::Continuations(from));
                }
                b.bytes.extend_from_slice(payload);
                let forward = b.forward;
                if head.has(frame::END_HEADERS) {
                    self.block_done(from, b.stream, b.end_stream, forward, &b.bytes, out)?;
                } else {
                    *block = Some(b);
                }
                Ok(verdict(forward))
            }
            Kind::Data => self.data(from, head, frame, out),
            Kind::RstStream => {
                if payload.len() != 4 {
                    return Err(malformed(from, "RST_STREAM is not 4 bytes"));
                }
                Ok(self.reset(from, head.stream, frame, out))
            }
            Kind::PushPromise if from == Side::Containerd => Err(SpliceError::Push),
            Kind::Ping => {
                let v = self.pings.frame(from, head, frame, out);
                if v == Verdict::Swallow && from == Side::Client {
                    if let Some(o) = &self.ctx.observer {
                        o.ping_answered();
                    }
                }
                Ok(v)
            }
            Kind::Settings if head.stream == 0 => {
                self.settings(from, head, payload)?;
                Ok(Verdict::Forward)
            }
            _ => Ok(Verdict::Forward),
        }
    }

    /// SETTINGS from `from` (passed on untouched): the table size the other
    /// peer's encoder may use follows them once sent, and `from`'s own once
    /// `from` acknowledges the other's.
    fn settings(&mut self, from: Side, head: &Head, payload: &[u8]) -> Result<(), SpliceError> {
        let (own, others) = match from {
            Side::Client => (&mut self.client_settings, &mut self.server_settings),
            Side::Containerd => (&mut self.server_settings, &mut self.client_settings),
        };
        if head.has(frame::ACK) {
            others.acked();
        } else {
            (own.sent(payload)).map_err(|e| SpliceError::Settings(from, e.to_string()))?;
        }
        // Blocks from the client are read with what containerd allowed it.
        (self.client_dec).set_limit(self.server_settings.table_limit());
        (self.server_dec).set_limit(self.client_settings.table_limit());
        Ok(())
    }

    /// Records the calls that [`State::request_headers`] let through before
    /// their request was written (see [`super::pump::Pump::settle`] for why). Runs before
    /// any later client frame is looked at and before any reply is.
    pub(super) fn open_calls(&mut self) {
        // Popped, not taken: the vector keeps its room for the next call.
        while let Some((stream, method)) = self.opening.pop() {
            self.open(stream, method, None);
        }
    }

    /// Starts tracking call `stream`: its metrics, and its hook if held.
    pub(super) fn open(&mut self, stream: u32, method: Arc<str>, held: Option<Box<Held>>) {
        let open_ended = open_ended(&method);
        let guard = (self.ctx.observer.as_ref()).map(|o| CallGuard::new(o.clone(), method));
        let call = Call {
            guard,
            held,
            refused: false,
            open_ended,
            replied: false,
            watch: None,
        };
        self.calls.insert(stream, call);
    }

    /// Whether containerd's block for `stream` goes out as it came.
    pub(super) fn passes(&self, stream: u32) -> bool {
        self.mirror
            && !(self.calls.get(&stream))
                .is_some_and(|c| c.refused || c.held.is_some() || c.watch.is_some())
    }

    /// After a containerd block that did not go out as it came: if it changed
    /// containerd's table, the client's no longer mirrors it.
    pub(super) fn kept_back(&mut self, changes_before: u64) {
        if self.mirror && self.server_dec.changes() != changes_before {
            self.mirror = false;
            tracing::debug!("a held reply changed containerd's HPACK table: re-encoding its header blocks from now on");
        }
    }

    /// A whole header block from `from`; `forwarded` when its frames went
    /// out as they came.
    fn block_done(
        &mut self,
        from: Side,
        stream: u32,
        end_stream: bool,
        forwarded: bool,
        block: &[u8],
        out: Out<'_>,
    ) -> Result<(), SpliceError> {
        match from {
            Side::Client => self.request_headers(stream, end_stream, block, out),
            Side::Containerd if forwarded => self.passed_headers(stream, end_stream, block),
            Side::Containerd => self.response_headers(stream, end_stream, block, out),
        }
    }

    /// containerd's block that went out as it came: read for the status.
    pub(super) fn passed_headers(
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

    /// The client's block does not decode: the mirror of its encoder is
    /// lost, and with it which method each later call is. Counted, and the
    /// connection is closed (see [`SpliceError::HpackDesync`]).
    fn desync(&self, e: hpack::HpackError) -> SpliceError {
        if let Some(o) = &self.ctx.observer {
            o.hpack_desync();
        }
        SpliceError::HpackDesync(e.to_string())
    }

    pub(super) fn record_status(&mut self, stream: u32, end_stream: bool, status: Option<i32>) {
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

    pub(super) fn request_headers(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        out: Out<'_>,
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
                    .map_err(|e| self.desync(e))?;
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
                self.request_end(stream, out);
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
            out.down
                .push_back(error_reply(stream, tonic::Code::Unavailable, &msg));
            return Ok(());
        }
        if self.goaway.is_some_and(|last| stream > last) {
            out.up.push_back(frame::rst_stream(stream, Reason::CANCEL));
            (out.down).push_back(frame::rst_stream(stream, Reason::REFUSED_STREAM));
            let call = Call {
                guard: None,
                held: None,
                refused: true,
                open_ended: false,
                replied: false,
                watch: None,
            };
            self.calls.insert(stream, call);
            return Ok(());
        }
        let info = CallInfo {
            method: path.unwrap_or_else(|| "".into()),
            namespace,
        };
        let Some(hook) = self.ctx.interceptor.select(&info) else {
            if let Some(watch) = self.ctx.interceptor.watch(&info) {
                self.open(stream, info.method, None);
                if let Some(c) = self.calls.get_mut(&stream) {
                    c.watch = Some(Box::new(Watched::new(watch)));
                }
                return Ok(());
            }
            // Its frames pass as they are; the rest can wait for the write.
            self.opening.push((stream, info.method));
            return Ok(());
        };
        let held = Box::new(Held::new(info.method.to_string(), hook));
        self.open(stream, info.method, Some(held));
        if end_stream {
            self.request_end(stream, out);
        }
        Ok(())
    }

    fn response_headers(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        out: Out<'_>,
    ) -> Result<(), SpliceError> {
        let changes = self.server_dec.changes();
        if let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held.as_mut()) {
            let mut fields = Vec::new();
            (self.server_dec)
                .decode(block, |n, v| {
                    fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
                })
                .map_err(|e| hpack_error(Side::Containerd, e))?;
            held.reply_headers(fields, end_stream);
            self.kept_back(changes);
            if end_stream {
                self.try_finish(stream, out);
            }
            return Ok(());
        }
        if (self.calls.get(&stream)).is_some_and(|c| c.watch.is_some()) {
            let mut fields = Vec::new();
            (self.server_dec)
                .decode(block, |n, v| {
                    fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
                })
                .map_err(|e| hpack_error(Side::Containerd, e))?;
            self.kept_back(changes);
            let w = self.calls.get_mut(&stream).and_then(|c| c.watch.as_mut());
            let step = w.map_or(Step::Pass, |w| w.reply_block(&fields, end_stream));
            if let Step::Pass = step {
                let status = (fields.iter())
                    .find(|(n, _)| &n[..] == b"grpc-status")
                    .and_then(|(_, v)| grpc::parse_status(v));
                let mut frames = BytesMut::new();
                frame::header_frames(stream, end_stream, &mut frames, |b| {
                    for (n, v) in &fields {
                        hpack::encode_field(b, n, v);
                    }
                });
                out.down.push_back(frames.freeze());
                self.record_status(stream, end_stream, status);
            } else {
                self.watch_step(stream, step, out);
            }
            return Ok(());
        }
        let refused = self.calls.get(&stream).is_some_and(|c| c.refused);
        let mut status = None;
        let frame = &mut self.out;
        frame.reserve(block.len() + 64);
        let dec = &mut self.server_dec;
        frame::header_frames(stream, end_stream, frame, |b| {
            dec.decode(block, |n, v| {
                if n == b"grpc-status" {
                    status = grpc::parse_status(v);
                }
                hpack::encode_field(b, n, v);
            })
        })
        .map_err(|e| hpack_error(Side::Containerd, e))?;
        self.kept_back(changes);
        self.record_status(stream, end_stream, status);
        let frame = self.out.split().freeze();
        if !refused {
            out.down.push_back(frame);
        }
        Ok(())
    }

    /// RST_STREAM on `stream`: what it ends, and whether it goes on.
    fn reset(&mut self, from: Side, stream: u32, frame: &[u8], out: Out<'_>) -> Verdict {
        if from == Side::Containerd {
            if let Some(call) = self.calls.get_mut(&stream) {
                if call.refused {
                    // The client has its answer for this stream already.
                    self.calls.remove(&stream);
                    return Verdict::Swallow;
                }
                match call.watch.as_mut().map(|w| w.reply_reset(frame)) {
                    None | Some(Step::Pass) => {}
                    Some(step) => {
                        self.watch_step(stream, step, out);
                        return Verdict::Swallow;
                    }
                }
            }
            if let Some(call) = self.calls.get_mut(&stream) {
                if let Some(held) = call.held.as_mut().filter(|h| h.reply_done()) {
                    // grpc-go resets (NO_ERROR) a stream it has answered
                    // before the client's END_STREAM: it follows the reply.
                    held.reset_after_reply(Bytes::copy_from_slice(frame));
                    return Verdict::Swallow;
                }
            }
        }
        if let Some(call) = self.calls.remove(&stream) {
            if let Some(held) = call.held {
                held.credit_back(out);
                if from == Side::Client {
                    if let Some(work) = held.abandon() {
                        tokio::spawn(work);
                    }
                }
            } else if let Some(w) = call.watch {
                out.up.extend(frame::window_update(0, w.kept_credit()));
            }
        }
        Verdict::Forward
    }

    /// DATA of a refused or held call (any other passes without a look).
    fn data(
        &mut self,
        from: Side,
        head: &Head,
        frame: &[u8],
        mut out: Out<'_>,
    ) -> Result<Verdict, SpliceError> {
        let Some(call) = self.calls.get_mut(&head.stream) else {
            return Ok(Verdict::Forward);
        };
        if call.refused {
            // Dropped: the sender gets its flow-control credit back.
            let credit = frame::window_update(0, head.len as u64);
            out.to(from).extend(credit);
            return Ok(Verdict::Swallow);
        }
        if let Some(w) = call.watch.as_mut() {
            let payload = &frame[HEADER_LEN..];
            let r = frame::content(head, payload).map_err(|e| malformed(from, e))?;
            let content = &payload[r];
            if from == Side::Client {
                w.request_data(content);
                return Ok(Verdict::Forward);
            }
            return Ok(match w.reply_data(head, frame, content) {
                Step::Pass => {
                    self.relayed(head);
                    Verdict::Forward
                }
                step => {
                    self.watch_step(head.stream, step, out);
                    Verdict::Swallow
                }
            });
        }
        let Some(held) = call.held.as_mut() else {
            return Ok(Verdict::Forward);
        };
        let payload = &frame[HEADER_LEN..];
        let r = frame::content(head, payload).map_err(|e| malformed(from, e))?;
        let content = &payload[r];
        Ok(match from {
            Side::Client => match held.request_data(head, frame, content) {
                Ok(verdict) => {
                    if head.has(frame::END_STREAM) {
                        self.request_end(head.stream, out);
                    }
                    verdict
                }
                Err(parked) => {
                    // Over the hold limit: the call passes through from here.
                    out.up.extend(parked);
                    call.held = None;
                    Verdict::Forward
                }
            },
            Side::Containerd => {
                if held.reply_data(head, content) {
                    self.release(head.stream, out, false);
                } else if held.reply_done() {
                    self.try_finish(head.stream, out);
                }
                Verdict::Swallow
            }
        })
    }
}

/// Trailers with a gRPC error status on `stream`, ending a call whose reply
/// headers (and maybe messages) the client has already had.
pub(super) fn error_trailers(stream: u32, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let mut out = BytesMut::new();
    frame::header_frames(stream, true, &mut out, |b| {
        hpack::encode_field(b, b"grpc-status", code.as_bytes());
        hpack::encode_field(b, b"grpc-message", message.as_bytes());
    });
    out.freeze()
}

/// A Trailers-Only gRPC error reply on `stream`.
pub(super) fn error_reply(stream: u32, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let fields = [
        (&b":status"[..], &b"200"[..]),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", code.as_bytes()),
        (b"grpc-message", message.as_bytes()),
    ];
    let mut out = BytesMut::new();
    frame::header_frames(stream, true, &mut out, |b| {
        for (n, v) in fields {
            hpack::encode_field(b, n, v);
        }
    });
    out.freeze()
}

#[cfg(test)]
mod tests {
    //! Frame-level checks with both peers played by hand.
    use super::super::frame::{self, Kind};
    use super::super::testing::*;
    use super::super::MAX_CONTINUATIONS;
    use super::*;
    use std::collections::VecDeque;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::Notify;

    #[tokio::test]
    async fn held_reply_released_after_later_replies_decodes_with_one_hpack_state() {
        let mut plain = request(3, "/t.S/Plain");
        plain.extend(frame(Kind::Data, frame::END_STREAM, 3, &MSG));
        let (mut client, mut server, _task, gate, _) = held_call_sent(&plain).await;

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
            reply.extend(frame(Kind::Headers, frame::END_HEADERS, stream, &b));
            reply.extend(frame(Kind::Data, 0, stream, &MSG));
            let t = enc.encode([(&b"grpc-status"[..], &b"0"[..])]);
            reply.extend(frame(
                Kind::Headers,
                frame::END_HEADERS | frame::END_STREAM,
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
            if h.kind == Kind::Headers {
                let f = dec.decode(&p).unwrap();
                let has = |n: &[u8], v: &[u8]| f.contains(&(n.to_vec(), v.to_vec()));
                assert!(
                    has(b"x-custom", b"first") || has(b"grpc-status", b"0"),
                    "{f:?}"
                );
            }
            order.push((h.stream, h.kind));
        }
        let h = (Kind::Headers, Kind::Data);
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
        let mut sent = frame::PREFACE.to_vec();
        for (stream, path) in [(1, "/t.S/Plain"), (3, "/t.S/Held"), (5, "/t.S/Plain")] {
            sent.extend(request(stream, path));
            sent.extend(frame(Kind::Data, frame::END_STREAM, stream, &MSG));
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
            let mut r = frame(Kind::Headers, frame::END_HEADERS, stream, &h);
            r.extend(frame(Kind::Data, 0, stream, &MSG));
            let end = frame::END_HEADERS | frame::END_STREAM;
            r.extend(frame(Kind::Headers, end, stream, &t));
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
            if h.kind == Kind::Headers {
                let f = dec.decode(&p).unwrap();
                assert!(
                    f.contains(&(b"content-type".to_vec(), b"application/grpc".to_vec()))
                        || f.contains(&(b"grpc-status".to_vec(), b"0".to_vec())),
                    "{f:?}"
                );
            }
            kinds.push(h.kind);
        }
        assert_eq!(kinds, [Kind::Headers, Kind::Data, Kind::Headers]);
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
            let out = Out {
                up: &mut up,
                down: &mut down,
            };
            st.request_headers(*stream, false, b, out).unwrap();
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

    /// Empty CONTINUATION frames add no bytes to a header block, so only
    /// counting them bounds one: past the count any sender needs, the
    /// connection ends instead of waiting for the block's end forever.
    #[tokio::test]
    async fn a_continuation_flood_ends_the_connection() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, _server, task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        let b = block(&[(":method", "POST"), (":path", "/t.S/Plain")]);
        sent.extend(frame(Kind::Headers, 0, 1, &b));
        for _ in 0..=MAX_CONTINUATIONS {
            sent.extend(frame(Kind::Continuation, 0, 1, &[]));
        }
        let _ = client.write_all(&sent).await; // the splice may stop reading
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("the flood is cut off")
            .unwrap();
        assert!(
            matches!(r, Err(SpliceError::Continuations(Side::Client))),
            "{r:?}"
        );
    }

    /// A block split into as many frames as the cap allows still passes.
    #[tokio::test]
    async fn a_block_in_many_small_frames_passes() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        let b = block(&[(":method", "POST"), (":path", "/t.S/Plain")]);
        sent.extend(frame(Kind::Headers, 0, 1, &b));
        for _ in 1..MAX_CONTINUATIONS {
            sent.extend(frame(Kind::Continuation, 0, 1, &[]));
        }
        sent.extend(frame(Kind::Continuation, frame::END_HEADERS, 1, &[]));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
    }

    /// A dynamic table size update may go as far as the receiver's
    /// SETTINGS_HEADER_TABLE_SIZE allows (from the moment it was sent), and
    /// no further: the protocol's 4096 bytes until the receiver says more.
    #[test]
    fn table_size_updates_are_bounded_by_the_receivers_settings() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let mut st = State::new(Arc::new(Ctx {
            interceptor: Arc::new(rules),
            observer: None,
            upstream: "/run/test.sock".into(),
        }));
        let (mut up, mut down) = (VecDeque::new(), VecDeque::new());
        // Size update to 8192 (5-bit prefix: 31, then 8161), `:method:
        // POST`, `:path: /`.
        let block = [0x3f, 0xe1, 0x3f, 0x83, 0x84];
        let out = Out {
            up: &mut up,
            down: &mut down,
        };
        let r = st.request_headers(1, true, &block, out);
        assert!(r.is_err(), "over the 4096 containerd allows: {r:?}");

        let mut st = State::new(st.ctx.clone());
        let settings = frame(Kind::Settings, 0, 0, &[0, 1, 0, 0, 0x20, 0]);
        let head = Head::parse(&settings);
        for from in [Side::Client, Side::Containerd] {
            // The client's SETTINGS say nothing about its own blocks.
            let out = Out {
                up: &mut up,
                down: &mut down,
            };
            let v = st.frame(from, &head, &settings, &mut None, out).unwrap();
            assert_eq!(v, Verdict::Forward, "SETTINGS pass untouched");
        }
        let out = Out {
            up: &mut up,
            down: &mut down,
        };
        st.request_headers(1, true, &block, out).unwrap();
        // containerd's own blocks follow the client's SETTINGS.
        let reply = [0x3f, 0xe1, 0x3f, 0x88];
        st.passed_headers(1, false, &reply).unwrap();
        let r = st.passed_headers(1, false, &[0x3f, 0xe1, 0x7f, 0x88]);
        assert!(r.is_err(), "over the 8192 the client allows: {r:?}");
    }
}
