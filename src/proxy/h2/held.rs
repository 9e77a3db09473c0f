//! The life of an intercepted ("held") call: its request is copied as it
//! passes (or parked, for a `before` hook), containerd's reply is collected
//! and held until the hook has run, then released as containerd sent it or
//! replaced by the hook's error. Flow-control credit that held frames took
//! and the client never saw is given back.
//!
//! The request and the reply progress on their own (grpc-go answers a unary
//! call once it has the message, maybe before the client's END_STREAM);
//! [`CallState`] is what the splice does with them, and changes only
//! through the transition methods here.
//!
//! A held reply larger than the client's stream window: the client sees
//! none of it until it is whole, so containerd can send only as much as the
//! windows the client granted allow. The splice passes the client's
//! SETTINGS and WINDOW_UPDATEs to containerd untouched and gives containerd
//! no credit of its own for held DATA, so the released reply never exceeds
//! what the client granted; but a reply larger than the window stalls at
//! containerd until the client grants more, and a client that grants only
//! after reading waits for its deadline. Hooked calls are unary with small
//! replies (far under the 65,535 bytes every HTTP/2 stream starts with), so
//! this does not arise for them; a reply over the hold limit
//! ([`grpc::MAX_HELD_BODY`]) is released and relayed unheld.

use bytes::{Bytes, BytesMut};

use super::frame::{self, Head, Reason, StreamId};
use super::hpack;
use super::reply::error_reply;
use super::side::Out;
use super::verdict::Verdict;
use crate::proxy::grpc;
use crate::proxy::intercept::Hook;

/// Where an intercepted call is in its life.
///
/// ```text
///            (hook wants the request)          (reply whole, status OK)
/// Parking ──request end──▶ Before ──ok──▶ Collecting ─────────────▶ After
///                                   └err─▶ answered with the error     │
///                (no `before`) ────────────────────▶ Collecting        ok: reply released
///                                                                      err: error instead
/// ```
///
/// A later change that holds one reply message of a streaming call (a
/// `Content.Write` COMMIT) while the rest flows fits as one more state
/// beside `Collecting`: the reply side ([`Reply`]) is kept apart from these
/// states for that reason.
pub(super) enum CallState {
    /// A `before` hook wants the whole request first: the request's DATA
    /// frames are parked here, not sent to containerd.
    Parking { hook: Box<dyn Hook>, parked: Parked },
    /// The `before` hook runs on the whole request; its DATA stays parked.
    Before { parked: Parked },
    /// The request goes to containerd (copied as it passes) and the reply
    /// is collected until it is whole. `hook` is `None` once the call
    /// turned out not interceptable: its reply is released as it came.
    Collecting { hook: Option<Box<dyn Hook>> },
    /// The `after` hook runs on request and reply; the reply waits for it.
    After,
}

/// Request DATA frames kept from containerd while a `before` hook waits.
#[derive(Default)]
pub(super) struct Parked {
    frames: Vec<Bytes>,
    /// The flow-control credit they took from the client.
    flow: u64,
}

/// containerd's reply to a held call, collected until it is whole.
#[derive(Default)]
struct Reply {
    head: Option<Vec<(Bytes, Bytes)>>,
    head_end: bool,
    data: BytesMut,
    /// Flow-control credit the DATA frames took (padding included).
    flow: u64,
    data_end: bool,
    trailers: Option<Vec<(Bytes, Bytes)>>,
    done: bool,
    /// containerd's RST_STREAM after a complete reply, sent on after it.
    reset: Option<Bytes>,
}

/// An intercepted call.
pub(super) struct Held {
    method: String,
    state: CallState,
    /// The request's content as it passed, for the hooks.
    request: BytesMut,
    request_done: bool,
    reply: Reply,
}

/// What the connection does next for a held call: the call's own methods
/// decide, the connection acts (starts a hook, writes frames, forgets it).
pub(super) enum Effect {
    /// Nothing yet: the request or the reply is not all in, or a hook runs.
    Wait,
    /// Run the `before` hook on the whole request message.
    RunBefore(Box<dyn Hook>, Bytes),
    /// Run the `after` hook on the request and reply messages.
    RunAfter(Box<dyn Hook>, Bytes, Bytes),
    /// Send the reply on as containerd sent it ([`Held::release`]). With
    /// `whole == false` it is still arriving: the call passes from here.
    Release { whole: bool },
}

impl Held {
    pub(super) fn new(method: String, hook: Box<dyn Hook>) -> Held {
        let state = if hook.wants_before() {
            CallState::Parking {
                hook,
                parked: Parked::default(),
            }
        } else {
            CallState::Collecting { hook: Some(hook) }
        };
        Held {
            method,
            state,
            request: BytesMut::new(),
            request_done: false,
            reply: Reply::default(),
        }
    }

    pub(super) fn request_done(&self) -> bool {
        self.request_done
    }

    pub(super) fn reply_done(&self) -> bool {
        self.reply.done
    }

    /// Request DATA frames containerd has not been sent.
    fn parked(&self) -> Option<&Parked> {
        match &self.state {
            CallState::Parking { parked, .. } | CallState::Before { parked } => Some(parked),
            _ => None,
        }
    }

    /// The `grpc-status` of the reply collected so far.
    pub(super) fn status(&self) -> Option<i32> {
        let find = |f: &Option<Vec<(Bytes, Bytes)>>| {
            f.as_ref()?
                .iter()
                .find(|(n, _)| &n[..] == b"grpc-status")
                .and_then(|(_, v)| grpc::parse_status(v))
        };
        find(&self.reply.trailers).or_else(|| find(&self.reply.head))
    }

    /// A request DATA frame (`content` without padding). `Err` with the
    /// parked frames, to send on, when the request outgrew what is held:
    /// the call is then relayed without interception.
    pub(super) fn request_data(
        &mut self,
        head: &Head,
        frame: &[u8],
        content: &[u8],
    ) -> Result<Verdict, Vec<Bytes>> {
        if self.request.len() + content.len() > grpc::MAX_HELD_BODY {
            tracing::warn!(method = %self.method, "request over 16 MiB; relaying it without interception");
            return Err(match &mut self.state {
                CallState::Parking { parked, .. } | CallState::Before { parked } => {
                    std::mem::take(&mut parked.frames)
                }
                _ => Vec::new(),
            });
        }
        self.request.extend_from_slice(content);
        if let CallState::Parking { parked, .. } = &mut self.state {
            parked.frames.push(Bytes::copy_from_slice(frame));
            parked.flow += head.len as u64;
            return Ok(Verdict::Swallow);
        }
        Ok(Verdict::Forward)
    }

    /// A reply header block (headers, or trailers if headers came already).
    pub(super) fn reply_headers(
        &mut self,
        fields: Vec<(Bytes, Bytes)>,
        end_stream: bool,
    ) -> Effect {
        if self.reply.head.is_none() {
            self.reply.head = Some(fields);
            self.reply.head_end = end_stream;
        } else {
            self.reply.trailers = Some(fields);
        }
        self.reply.done |= end_stream;
        match end_stream {
            true => self.finish(),
            false => Effect::Wait,
        }
    }

    /// A reply DATA frame. When the reply outgrew what is held it is
    /// released as far as it came, and the rest passes through.
    pub(super) fn reply_data(&mut self, head: &Head, content: &[u8]) -> Effect {
        self.reply.data.extend_from_slice(content);
        self.reply.flow += head.len as u64;
        if head.has(frame::END_STREAM) {
            self.reply.data_end = true;
            self.reply.done = true;
        }
        if self.reply.data.len() > grpc::MAX_HELD_BODY {
            tracing::warn!(method = %self.method, "reply over 16 MiB; relaying it without interception");
            return Effect::Release { whole: false };
        }
        self.finish()
    }

    /// The client's END_STREAM: with a `before` hook, the whole request is
    /// in and the hook runs (or, not interceptable, the parked frames go on
    /// into `out`); otherwise the call may be finished.
    pub(super) fn request_end(&mut self, out: &mut Out<'_>) -> Effect {
        self.request_done = true;
        if let CallState::Parking { .. } = self.state {
            return match self.request_complete(out) {
                Some((hook, msg)) => Effect::RunBefore(hook, msg),
                None => Effect::Wait,
            };
        }
        self.finish()
    }

    /// Once both request and reply are in: the `after` hook to run, or the
    /// reply to release untouched when there is nothing to act on.
    pub(super) fn finish(&mut self) -> Effect {
        if !self.reply.done {
            return Effect::Wait;
        }
        self.reply_complete()
    }

    /// containerd reset the stream after its whole reply.
    pub(super) fn reset_after_reply(&mut self, frame: Bytes) {
        self.reply.reset = Some(frame);
    }

    /// The client reset the call: if its whole request message reached
    /// containerd (nothing parked), the hook's work for an abandoned call,
    /// to run detached: containerd may still carry the call out.
    pub(super) fn abandon(self) -> Option<crate::proxy::intercept::WatchFuture> {
        let CallState::Collecting { hook: Some(hook) } = self.state else {
            return None;
        };
        // The whole message went to containerd (grpc-go acts on it before
        // the client's END_STREAM, which a reset may never send).
        let msg = grpc::unary_message(&self.request.freeze()).ok()?;
        hook.abandoned(msg)
    }

    /// Gives back flow-control credit held frames took and never delivered.
    pub(super) fn credit_back(&self, out: Out<'_>) {
        out.up
            .extend(frame::window_update(StreamId::ZERO, self.reply.flow));
        if let Some(p) = self.parked() {
            out.down
                .extend(frame::window_update(StreamId::ZERO, p.flow));
        }
    }

    /// Parking → Before: the whole request is in. `Some` with the message
    /// for the `before` hook; `None` when it cannot be intercepted, and the
    /// parked frames are sent on (into `up`) untouched.
    fn request_complete(&mut self, out: &mut Out<'_>) -> Option<(Box<dyn Hook>, Bytes)> {
        let placeholder = CallState::Collecting { hook: None };
        let (hook, parked) = match std::mem::replace(&mut self.state, placeholder) {
            CallState::Parking { hook, parked } => (hook, parked),
            other => {
                self.state = other;
                return None;
            }
        };
        match grpc::unary_message(&self.request.clone().freeze()) {
            Ok(msg) => {
                self.state = CallState::Before { parked };
                Some((hook, msg))
            }
            Err(error) => {
                // Compressed or malformed: never guess, let containerd judge it.
                tracing::warn!(method = %self.method, ?error, "request not interceptable; relaying untouched");
                out.up.extend(parked.frames);
                None
            }
        }
    }

    /// Before → Collecting: the `before` hook allowed the call; the parked
    /// request goes on to containerd, and the call may be finished.
    pub(super) fn before_passed(&mut self, hook: Box<dyn Hook>, out: &mut Out<'_>) -> Effect {
        let old = std::mem::replace(&mut self.state, CallState::Collecting { hook: Some(hook) });
        if let CallState::Before { parked } | CallState::Parking { parked, .. } = old {
            out.up.extend(parked.frames);
        }
        self.finish()
    }

    /// Collecting → After when the reply is whole and the `after` hook
    /// should run (with the request and reply messages for it).
    fn reply_complete(&mut self) -> Effect {
        const RELEASE: Effect = Effect::Release { whole: true };
        match &self.state {
            CallState::After | CallState::Before { .. } => return Effect::Wait,
            // containerd cannot have answered OK a request it was not sent:
            // the `before` hook runs first; an error reply is released.
            CallState::Parking { .. } if self.status() == Some(0) => return Effect::Wait,
            CallState::Parking { .. } => return RELEASE,
            CallState::Collecting { hook: None } => return RELEASE,
            CallState::Collecting { hook: Some(_) } => {}
        }
        if self.status() != Some(0) {
            return RELEASE;
        }
        let rq = grpc::unary_message(&self.request.clone().freeze());
        if !self.request_done
            && matches!(
                rq,
                Err(grpc::FrameError::Short(_) | grpc::FrameError::Length { .. })
            )
        {
            // grpc-go answers a unary call as soon as it has the message,
            // maybe before the client's END_STREAM: wait for the rest.
            return Effect::Wait;
        }
        match (rq, grpc::unary_message(&self.reply.data.clone().freeze())) {
            (Ok(rq), Ok(rs)) => match std::mem::replace(&mut self.state, CallState::After) {
                CallState::Collecting { hook: Some(hook) } => Effect::RunAfter(hook, rq, rs),
                other => {
                    self.state = other;
                    RELEASE
                }
            },
            (rq, rs) => {
                let e = rq.err().or(rs.err());
                tracing::warn!(method = %self.method, error = ?e, "call not interceptable; relaying the reply untouched");
                RELEASE
            }
        }
    }

    /// The held reply as containerd sent it (re-encoded without the dynamic
    /// table), with the credit its padding and any parked request took.
    pub(super) fn release(self, stream: StreamId, out: Out<'_>) {
        let reply = &self.reply;
        let mut frames = BytesMut::new();
        if let Some(head) = &reply.head {
            frame::header_frames(stream, reply.head_end, &mut frames, |b| encode(b, head));
        }
        if !reply.data.is_empty() || reply.data_end {
            frame::data(stream, &reply.data, reply.data_end, &mut frames);
        }
        if let Some(t) = &reply.trailers {
            frame::header_frames(stream, true, &mut frames, |b| encode(b, t));
        }
        out.down.push_back(frames.freeze());
        out.down.extend(reply.reset.clone());
        // Padding the client never saw is credited back to containerd.
        out.up.extend(frame::window_update(
            StreamId::ZERO,
            reply.flow - reply.data.len() as u64,
        ));
        if let Some(p) = self.parked() {
            out.down
                .extend(frame::window_update(StreamId::ZERO, p.flow));
        }
    }

    /// The call answered with `status` instead of containerd's reply.
    pub(super) fn fail(self, stream: StreamId, status: &tonic::Status, out: Out<'_>) {
        out.down
            .push_back(error_reply(stream, status.code(), status.message()));
        out.down.extend(self.reply.reset.clone());
        if !self.reply.done {
            out.up.push_back(frame::rst_stream(stream, Reason::CANCEL));
        }
        self.credit_back(out);
    }
}

fn encode(out: &mut BytesMut, fields: &[(Bytes, Bytes)]) {
    for (n, v) in fields {
        hpack::encode_field(out, n, v);
    }
}

#[cfg(test)]
mod tests {
    //! Frame-level checks with both peers played by hand.
    use super::super::frame::Head;
    use super::super::frame::{self, Kind, StreamId};
    use super::super::testing::*;
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    use tokio::sync::Notify;

    /// A client that hangs up while the `after` hook runs: containerd
    /// carried the call out, so the hook (the replication) runs to its end
    /// although the connection is gone. Dropping it with the connection
    /// lost one reset Create in 41 under CI load.
    #[tokio::test]
    async fn after_hook_outlives_the_connection_of_a_client_that_hung_up() {
        use std::sync::atomic::Ordering;
        let (client, mut server, task, gate, counts) = held_call_sent(&[]).await;
        server.write_all(&ok_reply(1)).await.unwrap();
        let reached = |i: usize| {
            let counts = counts.clone();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            async move {
                while counts[i].load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline
                {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    // poll interval
                }
                counts[i].load(Ordering::SeqCst)
            }
        };
        assert_eq!(reached(0).await, 1, "the reply is whole: the hook runs");
        drop(client);
        drop(server);
        let _ = task.await;
        gate.notify_one();
        assert_eq!(reached(1).await, 1, "the after hook was dropped");
    }

    #[tokio::test]
    async fn reply_before_end_stream_still_runs_the_hook_and_its_error_wins() {
        let rules = Rules::new(true, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(frame(Kind::Settings, 0, 0, &[]));
        sent.extend(request(1, "/t.S/Held"));
        sent.extend(frame(Kind::Data, 0, 1, &MSG));
        let got = relay(&mut client, &mut server, &sent).await;
        assert_eq!(got, sent, "client frames reach containerd byte for byte");

        // grpc-go replies once it has the message, before END_STREAM.
        let reply = ok_reply(1);
        server.write_all(&reply).await.unwrap();
        client
            .write_all(&frame(Kind::Data, frame::END_STREAM, 1, &[]))
            .await
            .unwrap();

        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(1)));
        assert!(h.has(frame::END_STREAM), "Trailers-Only error reply");
        let fields = loona_hpack::Decoder::new().decode(&p).unwrap();
        assert!(
            fields.contains(&(b"grpc-status".to_vec(), b"13".to_vec())),
            "{fields:?}"
        );
        assert!(fields.contains(&(b"grpc-message".to_vec(), b"boom".to_vec())));

        // containerd gets the END_STREAM and its 5 DATA bytes of credit back.
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.flags), (Kind::Data, frame::END_STREAM));
        let (h, p) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (Kind::WindowUpdate, StreamId::ZERO));
        assert_eq!(p, 5u32.to_be_bytes());
    }

    /// A compressed request (grpc-encoding, flag 1) for a hooked method is
    /// not decoded: it reaches containerd byte for byte, the hook (here one
    /// that fails every call) never runs, and containerd's reply stands.
    #[tokio::test]
    async fn compressed_request_passes_untouched_and_skips_the_hook() {
        let rules = Rules::new(true, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Held"));
        let compressed = [1, 0, 0, 0, 3, 0xaa, 0xbb, 0xcc];
        sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &compressed));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        server.write_all(&ok_reply(1)).await.unwrap();
        let mut dec = loona_hpack::Decoder::new();
        let mut statuses = Vec::new();
        let mut data = Vec::new();
        loop {
            let (h, p) = read_frame(&mut client).await;
            match h.kind {
                Kind::Headers => {
                    for (n, v) in dec.decode(&p).unwrap() {
                        if n == b"grpc-status" {
                            statuses.push(v);
                        }
                    }
                }
                Kind::Data => data.extend(p),
                _ => {}
            }
            if h.has(frame::END_STREAM) {
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

    /// A held reply bigger than the client's stream window: containerd
    /// sends what the window allows and waits; the client grants more; the
    /// whole reply reaches the client intact once the hook has run, and no
    /// more DATA than it granted.
    #[tokio::test]
    async fn a_held_reply_bigger_than_the_client_window_arrives_whole_once_it_grants_more() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, _task) = start(rules);
        const WINDOW: usize = 1000;
        let initial_window = [&4u16.to_be_bytes()[..], &(WINDOW as u32).to_be_bytes()].concat();
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(frame(Kind::Settings, 0, 0, &initial_window));
        sent.extend(request(1, "/t.S/Held"));
        sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        // One reply message of 3000 bytes: field 1, 2997 bytes long.
        let mut msg = vec![0x0a, 0xb5, 0x17];
        msg.extend((0..2997u32).map(|i| i as u8));
        let mut data = vec![0];
        data.extend((msg.len() as u32).to_be_bytes());
        data.extend(&msg);
        assert!(data.len() > WINDOW);
        // containerd, keeping to the window: headers and the first WINDOW bytes.
        let mut first = frame(
            Kind::Headers,
            frame::END_HEADERS,
            1,
            &block(&[(":status", "200")]),
        );
        first.extend(frame(Kind::Data, 0, 1, &data[..WINDOW]));
        server.write_all(&first).await.unwrap();

        // The client grants the rest; containerd sees the grant and sends it.
        let rest = (data.len() - WINDOW) as u32;
        let grant = frame(Kind::WindowUpdate, 0, 1, &rest.to_be_bytes());
        client.write_all(&grant).await.unwrap();
        assert_eq!(
            read_frame(&mut server).await,
            (Head::parse(&grant), grant[9..].to_vec())
        );
        let mut second = frame(Kind::Data, 0, 1, &data[WINDOW..]);
        let trailers = block(&[("grpc-status", "0")]);
        second.extend(frame(
            Kind::Headers,
            frame::END_HEADERS | frame::END_STREAM,
            1,
            &trailers,
        ));
        server.write_all(&second).await.unwrap();

        let mut got = Vec::new();
        let mut status = None;
        loop {
            let (h, p) = read_frame(&mut client).await;
            assert_eq!(h.stream, StreamId::new(1), "{h:?}");
            match h.kind {
                Kind::Data => got.extend(p),
                Kind::Headers => {
                    let f = fields(&p);
                    if let Some((_, v)) = f.iter().find(|(n, _)| n == "grpc-status") {
                        status = Some(v.clone());
                    }
                }
                k => panic!("unexpected frame type {k}"),
            }
            if h.has(frame::END_STREAM) {
                break;
            }
        }
        assert_eq!(status.as_deref(), Some("0"));
        assert!(
            got.len() <= WINDOW + rest as usize,
            "more DATA than granted"
        );
        assert_eq!(got, data, "the whole reply, intact");
    }
}
