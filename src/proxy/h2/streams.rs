//! The connection's calls, driven by the frames of both directions: which
//! calls are open and in what phase ([`super::calls`]), what their header
//! blocks say ([`super::headers`]), and what the effects that held and
//! watched calls return ask of the connection (start a hook, write frames,
//! forget a call). Held and watched calls never reach back in here: they
//! return [`Effect`]s and [`Step`]s, and this file acts on them.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::calls::{Call, CallPhase, Calls};
use super::ctx::Ctx;
use super::error::{malformed, SpliceError};
use super::frame::{self, Head, Kind, Reason, StreamId, HEADER_LEN, MAX_BLOCK, MAX_CONTINUATIONS};
use super::headers::{Block, Headers};
use super::held::{Effect, Held};
use super::hooks::{Hooks, Outcome};
use super::hpack;
use super::open_ended::{open_ended, RESTARTING};
use super::phase::Phase;
use super::ping::Pings;
use super::reply::{error_reply, error_trailers};
use super::side::{Out, Side};
use super::verdict::Verdict;
use super::watched::{Step, Watched};
use crate::proxy::grpc;
use crate::proxy::intercept::CallInfo;
use crate::proxy::observe::CallGuard;

/// Per-connection call state, shared by both directions.
pub(super) struct State {
    pub(super) ctx: Arc<Ctx>,
    pub(super) calls: Calls,
    pub(super) headers: Headers,
    pub(super) hooks: Hooks,
    pub(super) last_stream: StreamId,
    /// Set once GOAWAY was sent: streams above it are refused.
    pub(super) goaway: Option<StreamId>,
    /// Where the connection is in its life: the one record of it, here
    /// because both directions and the calls act on it (a lost containerd
    /// answers new calls UNAVAILABLE).
    pub(super) phase: Phase,
    /// Calls answered in this round, reported to the observer once the
    /// round's writes are done.
    pub(super) ended: Vec<CallGuard>,
    /// Calls no hook holds, whose bookkeeping waits until their request is
    /// written: see [`State::open_calls`].
    pub(super) opening: Vec<(StreamId, Arc<str>)>,
    /// Which client PINGs containerd would count against it.
    pub(super) pings: Pings,
}

impl State {
    pub(super) fn new(ctx: Arc<Ctx>) -> State {
        State {
            ctx,
            calls: Calls::default(),
            headers: Headers::default(),
            hooks: Hooks::default(),
            last_stream: StreamId::ZERO,
            goaway: None,
            phase: Phase::Open,
            ended: Vec::new(),
            opening: Vec::new(),
            pings: Pings::default(),
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
            Kind::Data => self
                .calls
                .get(&head.stream)
                .is_some_and(|c| match &c.phase {
                    CallPhase::Passing => false,
                    CallPhase::Refused | CallPhase::Watched(_) => true,
                    CallPhase::Held(h) => from == Side::Containerd || !h.request_done(),
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
    pub(super) fn end_call(&mut self, stream: StreamId) {
        if let Some(guard) = self.calls.remove(&stream).and_then(|c| c.guard) {
            self.ended.push(guard);
        }
    }

    /// Ends every open-ended call that is neither answered nor held: reset
    /// at containerd, UNAVAILABLE to the client (see [`super::OPEN_ENDED`]).
    pub(super) fn end_open_ended(&mut self, out: Out<'_>) {
        for (&stream, call) in self.calls.iter_mut() {
            if !call.open_ended || call.refused() || call.held().is_some() {
                continue;
            }
            call.phase = CallPhase::Refused;
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
        (self.calls.values()).any(|c| match &c.phase {
            CallPhase::Held(h) => h.reply_done(),
            CallPhase::Watched(w) => w.waiting(),
            CallPhase::Passing | CallPhase::Refused => false,
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
        match head.kind {
            Kind::Headers | Kind::Continuation => {
                self.header_frame(from, head, payload, block, out)
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
            Kind::Settings if head.stream.is_zero() => {
                self.headers.settings(from, head, payload)?;
                Ok(Verdict::Forward)
            }
            _ => Ok(Verdict::Forward),
        }
    }

    /// A HEADERS or CONTINUATION frame: gathered into `block` until the
    /// header block ends, then read.
    fn header_frame(
        &mut self,
        from: Side,
        head: &Head,
        payload: &[u8],
        block: &mut Option<Block>,
        out: Out<'_>,
    ) -> Result<Verdict, SpliceError> {
        if head.kind == Kind::Headers {
            if head.stream.is_zero() {
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
            return Ok(Verdict::forward_if(forward));
        }
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
        Ok(Verdict::forward_if(forward))
    }

    /// Records the calls that [`State::request_headers`] let through before
    /// their request was written (see [`super::pump::Pump::settle`] for why). Runs before
    /// any later client frame is looked at and before any reply is.
    pub(super) fn open_calls(&mut self) {
        // Popped, not taken: the vector keeps its room for the next call.
        while let Some((stream, method)) = self.opening.pop() {
            self.open(stream, method, CallPhase::Passing);
        }
    }

    /// Starts tracking call `stream` in `phase`, with its metrics.
    fn open(&mut self, stream: StreamId, method: Arc<str>, phase: CallPhase) {
        let open_ended = open_ended(&method);
        let guard = (self.ctx.observer.as_ref()).map(|o| CallGuard::new(o.clone(), method));
        self.calls
            .insert(stream, Call::new(guard, phase, open_ended));
    }

    /// Whether containerd's block for `stream` goes out as it came.
    pub(super) fn passes(&self, stream: StreamId) -> bool {
        self.headers.mirrored() && self.calls.get(&stream).is_none_or(|c| c.passing())
    }

    /// A whole header block from `from`; `forwarded` when its frames went
    /// out as they came.
    fn block_done(
        &mut self,
        from: Side,
        stream: StreamId,
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
        stream: StreamId,
        end_stream: bool,
        block: &[u8],
    ) -> Result<(), SpliceError> {
        let status = self.headers.passed_status(block)?;
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

    pub(super) fn record_status(
        &mut self,
        stream: StreamId,
        end_stream: bool,
        status: Option<i32>,
    ) {
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

    /// A client header block: a new call (opened in the phase the policy
    /// gives it, or refused), or request trailers.
    pub(super) fn request_headers(
        &mut self,
        stream: StreamId,
        end_stream: bool,
        block: &[u8],
        out: Out<'_>,
    ) -> Result<(), SpliceError> {
        let (path, namespace) = self.headers.request(block).map_err(|e| self.desync(e))?;
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
        if self.phase.is_lost() {
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
            self.calls
                .insert(stream, Call::new(None, CallPhase::Refused, false));
            return Ok(());
        }
        let info = CallInfo {
            method: path.unwrap_or_else(|| "".into()),
            namespace,
        };
        let Some(hook) = self.ctx.interceptor.select(&info) else {
            if let Some(watch) = self.ctx.interceptor.watch(&info) {
                let phase = CallPhase::Watched(Box::new(Watched::new(watch)));
                self.open(stream, info.method, phase);
                return Ok(());
            }
            // Its frames pass as they are; the rest can wait for the write.
            self.opening.push((stream, info.method));
            return Ok(());
        };
        let held = Box::new(Held::new(info.method.to_string(), hook));
        self.open(stream, info.method, CallPhase::Held(held));
        if end_stream {
            self.request_end(stream, out);
        }
        Ok(())
    }

    /// containerd's block that did not go out as it came: kept by a held
    /// or watched call, or re-encoded (dropped for a refused call).
    fn response_headers(
        &mut self,
        stream: StreamId,
        end_stream: bool,
        block: &[u8],
        out: Out<'_>,
    ) -> Result<(), SpliceError> {
        let phase = self.calls.get(&stream).map(|c| &c.phase);
        if let Some(CallPhase::Held(_) | CallPhase::Watched(_)) = phase {
            let fields = self.headers.kept_fields(block)?;
            let Some(call) = self.calls.get_mut(&stream) else {
                return Ok(());
            };
            match &mut call.phase {
                CallPhase::Held(held) => {
                    let effect = held.reply_headers(fields, end_stream);
                    self.held_effect(stream, effect, out);
                }
                CallPhase::Watched(w) => match w.reply_block(&fields, end_stream) {
                    Step::Pass => {
                        let status = grpc_status(&fields);
                        let mut frames = BytesMut::new();
                        frame::header_frames(stream, end_stream, &mut frames, |b| {
                            for (n, v) in &fields {
                                hpack::encode_field(b, n, v);
                            }
                        });
                        out.down.push_back(frames.freeze());
                        self.record_status(stream, end_stream, status);
                    }
                    step => self.watch_step(stream, step, out),
                },
                CallPhase::Passing | CallPhase::Refused => {}
            }
            return Ok(());
        }
        let refused = phase.is_some_and(|p| matches!(p, CallPhase::Refused));
        let (frame, status) = self.headers.reencode(stream, end_stream, block)?;
        self.record_status(stream, end_stream, status);
        if !refused {
            out.down.push_back(frame);
        }
        Ok(())
    }

    /// RST_STREAM on `stream`: what it ends, and whether it goes on.
    fn reset(&mut self, from: Side, stream: StreamId, frame: &[u8], out: Out<'_>) -> Verdict {
        if let (Side::Containerd, Some(call)) = (from, self.calls.get_mut(&stream)) {
            match &mut call.phase {
                CallPhase::Refused => {
                    // The client has its answer for this stream already.
                    self.calls.remove(&stream);
                    return Verdict::Swallow;
                }
                CallPhase::Watched(w) => match w.reply_reset(frame) {
                    Step::Pass => {}
                    step => {
                        self.watch_step(stream, step, out);
                        return Verdict::Swallow;
                    }
                },
                // grpc-go resets (NO_ERROR) a stream it has answered
                // before the client's END_STREAM: it follows the reply.
                CallPhase::Held(held) if held.reply_done() => {
                    held.reset_after_reply(Bytes::copy_from_slice(frame));
                    return Verdict::Swallow;
                }
                CallPhase::Held(_) | CallPhase::Passing => {}
            }
        }
        if let Some(call) = self.calls.remove(&stream) {
            match call.phase {
                CallPhase::Held(held) => {
                    held.credit_back(out);
                    if from == Side::Client {
                        if let Some(work) = held.abandon() {
                            tokio::spawn(work);
                        }
                    }
                }
                CallPhase::Watched(w) => out
                    .up
                    .extend(frame::window_update(StreamId::ZERO, w.kept_credit())),
                CallPhase::Passing | CallPhase::Refused => {}
            }
        }
        Verdict::Forward
    }

    /// DATA of a refused, watched or held call (any other passes without a
    /// look).
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
        let content = |from| {
            let payload = &frame[HEADER_LEN..];
            let r = frame::content(head, payload).map_err(|e| malformed(from, e))?;
            Ok::<_, SpliceError>(&payload[r])
        };
        match &mut call.phase {
            CallPhase::Passing => Ok(Verdict::Forward),
            CallPhase::Refused => {
                // Dropped: the sender gets its flow-control credit back.
                let credit = frame::window_update(StreamId::ZERO, head.len as u64);
                out.to(from).extend(credit);
                Ok(Verdict::Swallow)
            }
            CallPhase::Watched(w) if from == Side::Client => {
                w.request_data(content(from)?);
                Ok(Verdict::Forward)
            }
            CallPhase::Watched(w) => Ok(match w.reply_data(head, frame, content(from)?) {
                Step::Pass => {
                    self.relayed(head);
                    Verdict::Forward
                }
                step => {
                    self.watch_step(head.stream, step, out);
                    Verdict::Swallow
                }
            }),
            CallPhase::Held(held) if from == Side::Client => {
                match held.request_data(head, frame, content(from)?) {
                    Ok(verdict) => {
                        if head.has(frame::END_STREAM) {
                            self.request_end(head.stream, out);
                        }
                        Ok(verdict)
                    }
                    Err(parked) => {
                        // Over the hold limit: the call passes through from here.
                        out.up.extend(parked);
                        call.phase = CallPhase::Passing;
                        Ok(Verdict::Forward)
                    }
                }
            }
            CallPhase::Held(held) => {
                let effect = held.reply_data(head, content(from)?);
                self.held_effect(head.stream, effect, out);
                Ok(Verdict::Swallow)
            }
        }
    }
}

/// The `grpc-status` among decoded header fields.
fn grpc_status(fields: &[(Bytes, Bytes)]) -> Option<i32> {
    (fields.iter())
        .find(|(n, _)| &n[..] == b"grpc-status")
        .and_then(|(_, v)| grpc::parse_status(v))
}

/// What held and watched calls ask of the connection.
impl State {
    /// The client's END_STREAM on a held call.
    pub(super) fn request_end(&mut self, stream: StreamId, mut out: Out<'_>) {
        let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held_mut()) else {
            return;
        };
        let effect = held.request_end(&mut out);
        self.held_effect(stream, effect, out);
    }

    /// Acts on what a held call asked for.
    fn held_effect(&mut self, stream: StreamId, effect: Effect, out: Out<'_>) {
        match effect {
            Effect::Wait => {}
            Effect::RunBefore(mut hook, msg) => self.hooks.push(Box::pin(async move {
                let result = hook.before(&msg).await;
                Outcome::Before {
                    stream,
                    hook,
                    result,
                }
            })),
            Effect::RunAfter(hook, rq, rs) => {
                self.hooks
                    .detach(hook.after(rq, rs), move |r| Outcome::After {
                        stream,
                        result: r.unwrap_or_else(|e| {
                            tracing::error!(error = %e, "a replication hook panicked");
                            Err(tonic::Status::internal(format!(
                                "imgbridge: hook failed: {e}"
                            )))
                        }),
                    })
            }
            Effect::Release { whole } => self.release(stream, out, whole),
        }
    }

    /// Sends a held reply on as containerd sent it. With `whole == false` the
    /// reply is still arriving: the call is left to pass through from here.
    fn release(&mut self, stream: StreamId, out: Out<'_>, whole: bool) {
        let Some(call) = self.calls.get_mut(&stream) else {
            return;
        };
        let Some(held) = call.take_held() else {
            return;
        };
        if let Some(g) = call.guard.as_mut() {
            g.set_status(held.status());
        }
        held.release(stream, out);
        self.pings.released();
        if whole {
            self.calls.remove(&stream);
        }
    }

    /// Answers a held call with `status` instead of containerd's reply.
    fn fail(&mut self, stream: StreamId, status: tonic::Status, out: Out<'_>) {
        let Some(mut call) = self.calls.remove(&stream) else {
            return;
        };
        let Some(held) = call.take_held() else {
            return;
        };
        held.fail(stream, &status, out);
        if let Some(g) = call.guard.as_mut() {
            g.set_status(Some(status.code() as i32));
        }
    }

    /// A hook finished.
    pub(super) fn outcome(&mut self, o: Outcome, mut out: Out<'_>) {
        match o {
            Outcome::Before {
                stream,
                hook,
                result,
            } => {
                let Some(held) = self.calls.get_mut(&stream).and_then(|c| c.held_mut()) else {
                    return; // the client gave up meanwhile
                };
                match result {
                    Ok(()) => {
                        let effect = held.before_passed(hook, &mut out);
                        self.held_effect(stream, effect, out);
                    }
                    Err(status) => self.fail(stream, status, out),
                }
            }
            Outcome::After { stream, result } => match result {
                Ok(()) => self.release(stream, out, true),
                Err(status) => self.fail(stream, status, out),
            },
            Outcome::Watch { stream } => {
                self.watch_resume(stream, out);
                self.pings.released();
            }
        }
    }

    /// Acts on a watched call's [`Step`] for a reply frame or block.
    fn watch_step(&mut self, stream: StreamId, step: Step, out: Out<'_>) {
        match step {
            Step::Pass | Step::Kept => {}
            // Linking a blob containerd has committed.
            Step::Run(f) => self.hooks.detach(f, move |_| Outcome::Watch { stream }),
            Step::Release => self.watch_release(stream, out),
        }
    }

    /// A watched call's future ended.
    fn watch_resume(&mut self, stream: StreamId, out: Out<'_>) {
        let Some(w) = self.calls.get_mut(&stream).and_then(|c| c.watched_mut()) else {
            return; // the client gave up meanwhile
        };
        let step = w.resume();
        self.watch_step(stream, step, out);
    }

    /// Sends on what a watched call's hold kept.
    fn watch_release(&mut self, stream: StreamId, out: Out<'_>) {
        let Some(w) = self.calls.get_mut(&stream).and_then(|c| c.watched_mut()) else {
            return; // the client gave up meanwhile
        };
        let r = w.release(stream);
        if !r.frames.is_empty() {
            out.down.push_back(r.frames);
        }
        if let Some(o) = &self.ctx.observer {
            o.bytes_relayed(r.data);
        }
        if r.block {
            self.record_status(stream, r.ended, r.status);
        } else if r.ended {
            self.end_call(stream);
        }
    }
}

/// The connection ended (client gone, or broken) with held calls whose
/// request containerd has whole: it may still carry them out, so they are
/// followed detached, as when the client resets one.
impl Drop for State {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for (_, mut call) in self.calls.drain() {
            if let Some(work) = call.take_held().and_then(|h| h.abandon()) {
                rt.spawn(work);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Frame-level checks with both peers played by hand.
    use super::super::frame::MAX_CONTINUATIONS;
    use super::super::frame::{self, Kind};
    use super::super::testing::*;
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
        let (one, three) = (StreamId::new(1), StreamId::new(3));
        assert_eq!(
            order,
            [
                (three, h.0),
                (three, h.1),
                (three, h.0),
                (one, h.0),
                (one, h.1),
                (one, h.0)
            ]
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
            assert_eq!(h.stream, StreamId::new(3));
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
        for (n, b) in &blocks {
            let out = Out {
                up: &mut up,
                down: &mut down,
            };
            let stream = StreamId::new(*n);
            st.request_headers(stream, false, b, out).unwrap();
            if stream == StreamId::new(5) {
                let seen = st
                    .headers
                    .request_seen
                    .get(&st.headers.client_dec, &indexed);
                assert_eq!(seen.map(|(p, _)| &**p), Some("/t.S/Plain"), "reused");
            }
        }
        let held: Vec<StreamId> = (1..=9)
            .map(StreamId::new)
            .filter(|s| (st.calls.get(s)).is_some_and(|c| c.held().is_some()))
            .collect();
        assert_eq!(held, [7, 9].map(StreamId::new));
        let mut plain: Vec<StreamId> = st.opening.iter().map(|(s, _)| *s).collect();
        plain.sort();
        assert_eq!(plain, [1, 3, 5].map(StreamId::new));
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
        let r = st.request_headers(StreamId::new(1), true, &block, out);
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
        st.request_headers(StreamId::new(1), true, &block, out)
            .unwrap();
        // containerd's own blocks follow the client's SETTINGS.
        let reply = [0x3f, 0xe1, 0x3f, 0x88];
        st.passed_headers(StreamId::new(1), false, &reply).unwrap();
        let r = st.passed_headers(StreamId::new(1), false, &[0x3f, 0xe1, 0x7f, 0x88]);
        assert!(r.is_err(), "over the 8192 the client allows: {r:?}");
    }
}
