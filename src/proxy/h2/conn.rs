//! The connection loop: both directions' pumps, the hooks' results, the
//! drain, and what happens when containerd goes away.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio::net::UnixStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::ctx::Ctx;
use super::error::SpliceError;
use super::frame::{self, Reason, StreamId};
use super::phase::{Linger, Phase};
use super::pump::Pump;
use super::reply::error_reply;
use super::side::{Out, Side};
use super::streams::State;
use crate::proxy::sock::Sock;

/// What the client is told when the splice can no longer read its header
/// blocks (GOAWAY debug data, which client libraries log).
const DESYNC: &str = "imgbridge lost track of this connection's header compression (HPACK) \
    and cannot tell which calls it carries; reconnect";

/// One client connection and its containerd connection.
pub(super) struct Conn {
    client: Sock,
    upstream: Sock,
    /// Client to containerd.
    up: Pump,
    /// containerd to client.
    down: Pump,
    /// The calls, and the connection's [`Phase`] (`st.phase`).
    st: State,
    /// The drain signal, until it fires.
    drain: Option<Drain>,
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

impl Conn {
    pub(super) fn new(
        client: UnixStream,
        upstream: UnixStream,
        ctx: Arc<Ctx>,
        drain: CancellationToken,
    ) -> Result<Conn, SpliceError> {
        let (client, upstream) = match (Sock::new(client), Sock::new(upstream)) {
            (Ok(c), Ok(u)) => (c, u),
            (Err(e), _) => return Err(SpliceError::Read(Side::Client, e)),
            (_, Err(e)) => return Err(SpliceError::Read(Side::Containerd, e)),
        };
        Ok(Conn {
            client,
            upstream,
            up: Pump::new(Side::Client),
            down: Pump::new(Side::Containerd),
            st: State::new(ctx),
            drain: Some(Drain::new(drain)),
        })
    }

    /// containerd closed the connection or broke it. Calls in flight are
    /// answered UNAVAILABLE naming the socket, and GOAWAY sends the client to
    /// a new connection, like containerd's own restart would, but with a
    /// reason. `Err` when that is not possible (a frame was cut in half).
    fn lose(&mut self, why: &dyn fmt::Display) -> Result<(), SpliceError> {
        if self.st.phase.is_lost() {
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
        self.st.phase = Phase::lost();
        self.down.eof = true;
        self.down.scan = self.down.end;
        let msg = format!(
            "imgbridge: containerd at {} closed the connection",
            self.st.ctx.upstream.display()
        );
        let waiting: Vec<StreamId> = (self.st.calls.iter())
            .filter(|(_, c)| !c.refused() && !c.reply_held())
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
        (self.down.inject).push_back(frame::goaway(StreamId::MAX, Reason::NO_ERROR));
        Ok(())
    }

    /// The splice no longer knows which calls the client makes (its HPACK
    /// mirror diverged): a hooked call must not pass unseen, so nothing more
    /// goes to containerd, and the client is told with GOAWAY(
    /// COMPRESSION_ERROR) and a reason, then the connection ends with `e`
    /// (the client reconnects, with fresh HPACK state).
    fn close_loudly(&mut self, e: SpliceError) -> Result<(), SpliceError> {
        let goaway = frame::goaway_saying(self.st.last_stream, Reason::COMPRESSION_ERROR, DESYNC);
        if !self.down.end_with(goaway) {
            return Err(e); // mid-frame: the client sees the close
        }
        self.st.phase = Phase::closing(e);
        Ok(())
    }

    /// Ends the open-ended calls in flight ([`super::OPEN_ENDED`]).
    fn end_open_ended(&mut self) -> Result<(), SpliceError> {
        if self.st.phase.is_lost() {
            return Ok(()); // all answered already
        }
        // Which calls have had a reply: the reply blocks written but not yet
        // read count too.
        self.st.open_calls();
        self.down.settle(&mut self.st)?;
        self.st.end_open_ended(Out {
            up: &mut self.up.inject,
            down: &mut self.down.inject,
        });
        Ok(())
    }

    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), SpliceError>> {
        self.check_drain(cx);
        loop {
            match &mut self.st.phase {
                Phase::Closing { .. } => return self.poll_closing(cx),
                Phase::Lingering(linger) => {
                    // Our side is closed; the client's frames go nowhere.
                    if self.up.discard(cx, &self.client).is_ready()
                        || linger.poll(cx, &self.client).is_ready()
                    {
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Pending;
                }
                Phase::Draining { ending } if *ending && self.down.block.is_none() => {
                    // A reply block that is half read may be the first reply
                    // of a call to end, which decides how it ends: wait for
                    // its end.
                    *ending = false;
                    self.end_open_ended()?;
                }
                Phase::Open | Phase::Draining { .. } | Phase::Lost { .. } => {}
            }
            while let Some(outcome) = self.st.hooks.poll_next(cx) {
                let out = Out {
                    up: &mut self.up.inject,
                    down: &mut self.down.inject,
                };
                self.st.outcome(outcome, out);
            }
            let queued_up = self.up.inject.len();
            // With both directions failed, the guards see either error.
            let (up_done, down_done) = match self.poll_pumps(cx) {
                (Ok(u), Ok(d)) => (u, d),
                (Err(e), _) | (_, Err(e)) if e.is_desync() => {
                    self.close_loudly(e)?;
                    continue;
                }
                (Err(e), _) | (_, Err(e)) if e.is_containerd_io() => {
                    self.lose(&e)?;
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => return Poll::Ready(Err(e)),
            };
            if let Phase::Lost { grace } = &mut self.st.phase {
                // The client hung up, or had its time to.
                let grace_over = grace.as_mut().poll(cx).is_ready();
                if up_done || (grace_over && !self.st.awaiting_hooks()) {
                    return Poll::Ready(Ok(()));
                }
            } else if up_done && down_done {
                return Poll::Ready(Ok(()));
            }
            if self.st.goaway.is_some()
                && self.st.calls.values().all(|c| c.refused())
                && self.up.idle()
                && self.down.idle()
            {
                // Every call is answered. Closing the socket now would make
                // the client's next write (a WINDOW_UPDATE for the reply it
                // is still reading) fail with EPIPE, and that error would
                // fail the reply: half-close, and read until it hangs up.
                let _ = self.client.shutdown_write();
                self.st.phase = Phase::Lingering(Linger::new());
                continue;
            }
            // Go round again only for work queued after its pump was polled.
            let again = self.up.inject.len() > queued_up
                || self.st.hooks.take_added()
                || (matches!(self.st.phase, Phase::Draining { ending: true })
                    && self.down.block.is_none());
            if !again {
                return Poll::Pending;
            }
        }
    }

    /// Once the drain fires: calls up to here finish, later ones are
    /// refused (see `State::request_headers`), and GOAWAY tells the client.
    fn check_drain(&mut self, cx: &mut Context<'_>) {
        let Some(d) = self.drain.as_mut() else {
            return;
        };
        if !d.fired(cx) {
            return;
        }
        self.drain = None;
        self.st.goaway = Some(self.st.last_stream);
        (self.down.inject).push_back(frame::goaway(self.st.last_stream, Reason::NO_ERROR));
        if let Phase::Open = self.st.phase {
            self.st.phase = Phase::Draining { ending: true };
        }
    }

    /// Both directions, as far as they go: whether each is finished.
    fn poll_pumps(
        &mut self,
        cx: &mut Context<'_>,
    ) -> (Result<bool, SpliceError>, Result<bool, SpliceError>) {
        let up = (self.up).poll(
            cx,
            &mut self.client,
            &mut self.upstream,
            &mut self.down.inject,
            &mut self.st,
            self.up.eof,
        );
        self.st.open_calls();
        let down = (self.down).poll(
            cx,
            &mut self.upstream,
            &mut self.client,
            &mut self.up.inject,
            &mut self.st,
            self.up.eof,
        );
        self.st.ended.clear();
        (up, down)
    }

    /// Only the GOAWAY (and what was queued before it) is left to write.
    fn poll_closing(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), SpliceError>> {
        match std::mem::replace(&mut self.st.phase, Phase::Open) {
            Phase::Closing { error, mut grace } => {
                let written = self.down.flush_queued(cx, &mut self.client).is_ready();
                let late = grace.as_mut().poll(cx).is_ready();
                if written || late {
                    return Poll::Ready(Err(error));
                }
                self.st.phase = Phase::Closing { error, grace };
                Poll::Pending
            }
            other => {
                self.st.phase = other;
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Frame-level checks with both peers played by hand.
    use super::super::frame::{self, Kind, Reason};
    use super::super::phase::{DRAIN_LINGER, LINGER_CHECK};
    use super::super::testing::*;
    use super::*;
    use crate::proxy::observe::CallObserver;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::Notify;

    #[tokio::test]
    async fn containerd_lost_mid_call_answers_unavailable_naming_the_socket() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Plain"));
        sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        drop(server); // containerd dies with the call in flight

        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(1)));
        assert!(h.has(frame::END_STREAM));
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
            Kind::GoAway,
            "the client is sent to a new connection"
        );

        // A call that was already on its way is answered the same way.
        client.write_all(&request(3, "/t.S/Plain")).await.unwrap();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(3)));
        let fields = loona_hpack::Decoder::new().decode(&p).unwrap();
        assert!(fields.contains(&(b"grpc-status".to_vec(), b"14".to_vec())));
        drop(client);
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("splice ends once the client hangs up")
            .unwrap()
            .unwrap();
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

    /// A subscription with no reply yet is answered Trailers-Only
    /// UNAVAILABLE and reset at containerd the moment the drain starts;
    /// an event containerd sent meanwhile is dropped (its credit given
    /// back), while a plain call in flight still gets its reply.
    #[tokio::test]
    async fn drain_ends_a_waiting_subscription_at_once_and_lets_other_calls_finish() {
        let drain = CancellationToken::new();
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain.clone());
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(request(1, SUBSCRIBE));
        sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
        sent.extend(request(3, "/t.S/Plain"));
        sent.extend(frame(Kind::Data, frame::END_STREAM, 3, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        drain.cancel();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!(h.kind, Kind::GoAway);
        assert_eq!(&p[..4], &3u32.to_be_bytes(), "both calls were accepted");
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(1)));
        assert!(h.has(frame::END_STREAM));
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
            (
                Kind::RstStream,
                StreamId::new(1),
                &Reason::CANCEL.0.to_be_bytes()[..]
            )
        );

        // An event that crossed the reset, then the plain call's reply.
        let mut late = frame(
            Kind::Headers,
            frame::END_HEADERS,
            1,
            &block(&[(":status", "200")]),
        );
        late.extend(frame(Kind::Data, 0, 1, &MSG));
        late.extend(ok_reply(3));
        server.write_all(&late).await.unwrap();
        let (h, p) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (Kind::WindowUpdate, StreamId::ZERO));
        assert_eq!(p, 5u32.to_be_bytes(), "the dropped event's credit");
        for kind in [Kind::Headers, Kind::Data, Kind::Headers] {
            let (h, _) = read_frame(&mut client).await;
            assert_eq!(
                (h.kind, h.stream),
                (kind, StreamId::new(3)),
                "nothing more on stream 1"
            );
        }
        nothing_more(&mut client).await;
        drop(client);
        tokio::time::timeout(DRAIN_LINGER, task)
            .await
            .expect("splice ends after the last call")
            .unwrap()
            .unwrap();
    }

    /// A subscription that has had replies ends with trailers (no second
    /// `:status`), and the drained connection closes right after.
    /// A splice with a drain token and an open (relayed) event subscription.
    async fn subscribed() -> (CancellationToken, UnixStream, UnixStream, Task) {
        let drain = CancellationToken::new();
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_with(rules, drain.clone());
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(request(1, SUBSCRIBE));
        sent.extend(frame(Kind::Data, frame::END_STREAM, 1, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        (drain, client, server, task)
    }

    /// The client reads to the end and gets nothing more.
    async fn nothing_more(client: &mut UnixStream) {
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
    }

    #[tokio::test]
    async fn drain_ends_a_streaming_subscription_with_trailers() {
        let (drain, mut client, mut server, task) = subscribed().await;
        let mut event = frame(
            Kind::Headers,
            frame::END_HEADERS,
            1,
            &block(&[(":status", "200"), ("content-type", "application/grpc")]),
        );
        event.extend(frame(Kind::Data, 0, 1, &MSG));
        server.write_all(&event).await.unwrap();
        let mut got = vec![0; event.len()];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(got, event);

        drain.cancel();
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, Kind::GoAway);
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(1)));
        assert!(h.has(frame::END_STREAM));
        let f = fields(&p);
        assert!(has(&f, "grpc-status", "14"), "{f:?}");
        assert!(!f.iter().any(|(n, _)| n == ":status"), "trailers: {f:?}");
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (Kind::RstStream, StreamId::new(1)));
        nothing_more(&mut client).await;
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
        let (drain, mut client, mut server, task) = subscribed().await;
        let b = block(&[(":status", "200"), ("content-type", "application/grpc")]);
        let (first, second) = b.split_at(3);
        let head = frame(Kind::Headers, 0, 1, first);
        server.write_all(&head).await.unwrap();
        let mut got = vec![0; head.len()];
        client.read_exact(&mut got).await.unwrap();

        drain.cancel();
        // Only once the block is whole: GOAWAY, then trailers.
        let cont = frame(Kind::Continuation, frame::END_HEADERS, 1, second);
        server.write_all(&cont).await.unwrap();
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, Kind::Continuation);
        let (h, _) = read_frame(&mut client).await;
        assert_eq!(h.kind, Kind::GoAway);
        let (h, p) = read_frame(&mut client).await;
        assert_eq!((h.kind, h.stream), (Kind::Headers, StreamId::new(1)));
        let f = fields(&p);
        assert!(has(&f, "grpc-status", "14"), "{f:?}");
        assert!(!f.iter().any(|(n, _)| n == ":status"), "trailers: {f:?}");
        let (h, _) = read_frame(&mut server).await;
        assert_eq!((h.kind, h.stream), (Kind::RstStream, StreamId::new(1)));
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
        assert_eq!(h.kind, Kind::GoAway);
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
            (Kind::RstStream, StreamId::new(3), &7u32.to_be_bytes()[..])
        );
        let mut got = vec![0; late.len()];
        server.read_exact(&mut got).await.unwrap();
        let (h, _) = read_frame(&mut server).await;
        assert_eq!(
            (h.kind, h.stream),
            (Kind::RstStream, StreamId::new(3)),
            "containerd drops it too"
        );

        // The call in flight completes, then the splice closes.
        let reply = ok_reply(1);
        server.write_all(&reply).await.unwrap();
        let mut kinds = Vec::new();
        for _ in 0..3 {
            kinds.push(read_frame(&mut client).await.0.kind);
        }
        assert_eq!(kinds, [Kind::Headers, Kind::Data, Kind::Headers]);
        // Our side is closed, yet the client may still write (a window
        // update for the reply it read) without EPIPE; its hang-up ends
        // the splice well before the linger time.
        nothing_more(&mut client).await;
        client
            .write_all(&frame(Kind::WindowUpdate, 0, 0, &[0, 0, 0, 9]))
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

    #[derive(Debug, Default)]
    struct Desyncs(std::sync::atomic::AtomicU64);

    impl CallObserver for Desyncs {
        fn call_started(&self) {}
        fn bytes_relayed(&self, _: u64) {}
        fn call_finished(&self, _: &str, _: Option<i32>) {}
        fn hpack_desync(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The client's block refers to a dynamic-table entry the mirror does
    /// not have, as if the mirror had missed an insertion. A hooked method
    /// could hide behind it, so nothing of the block reaches containerd:
    /// the client is sent GOAWAY(COMPRESSION_ERROR) saying why (it
    /// reconnects), the connection ends, and the desync is counted.
    #[tokio::test]
    async fn a_request_block_the_mirror_cannot_decode_closes_the_connection_loudly() {
        let desyncs = Arc::new(Desyncs::default());
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, mut server, task) = start_observed(rules, desyncs.clone());
        let sent = frame::PREFACE.to_vec();
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        // `:method: POST`, then dynamic index 62, which was never inserted.
        let hidden = frame(
            Kind::Headers,
            frame::END_HEADERS | frame::END_STREAM,
            1,
            &[0x83, 0xbe],
        );
        client.write_all(&hidden).await.unwrap();

        let (h, p) = read_frame(&mut client).await;
        assert_eq!(h.kind, Kind::GoAway);
        assert_eq!(&p[4..8], &Reason::COMPRESSION_ERROR.0.to_be_bytes());
        let debug = String::from_utf8_lossy(&p[8..]);
        assert!(debug.contains("HPACK"), "{debug}");
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("the connection ends")
            .unwrap();
        assert!(matches!(r, Err(SpliceError::HpackDesync(_))), "{r:?}");
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "containerd got {rest:?}");
        assert_eq!(desyncs.0.load(Ordering::SeqCst), 1);
    }
}
