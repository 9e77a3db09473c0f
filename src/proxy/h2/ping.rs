//! The client's PINGs, and the one case the splice answers them itself.
//!
//! containerd (a grpc-go server, with the default keepalive policy) counts
//! a strike for a client PING that arrives when it has written no HEADERS
//! or DATA since the previous PING, and after the third sends
//! `GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings")` and closes the connection.
//! Clients with an adaptive window (grpc-go always: ctr, nerdctl, buildkitd;
//! hyper/tonic when asked) send a BDP PING on the first DATA they receive
//! after their last PING's ACK. Straight to containerd that never strikes:
//! DATA read after the ACK was written after containerd read the PING.
//!
//! A held reply breaks that. containerd wrote it long ago; released, its
//! DATA makes the client PING a containerd that has been silent since its
//! last ACK, and a burst of held calls released one by one adds up to the
//! GOAWAY (200 parallel `Images.Create` in a source namespace; see
//! docs/performance.md).
//!
//! So the splice answers (ACK, same payload) a client PING only when both:
//! - a held reply was released to the client since the last PING ACK it
//!   was sent: that release is what the client answers with a PING (what
//!   reaches it before the ACK makes no PING: a client has one BDP PING
//!   out at a time). One answer per release at most, so a client flooding
//!   PINGs gets containerd's answer to all but a few of them;
//! - containerd may count it: it has written no HEADERS/DATA since it
//!   ACKed every PING it was sent. What it writes while a PING is on its
//!   way may have been written before it read that PING, so it does not
//!   count (an answer too many costs nothing; a strike too many adds up).
//!
//! Every other PING, and every PING ACK, passes untouched: containerd's own
//! flood protection keeps working.

use bytes::{BufMut, Bytes, BytesMut};

use super::frame::{put_head, Head, Kind, StreamId, HEADER_LEN};
use super::side::{Out, Side};
use super::verdict::Verdict;

/// The PING frame type (RFC 9113 §6.7).
/// A PING's payload: always 8 bytes.
const PAYLOAD: usize = 8;

/// What containerd will make of the client's next PING, as far as the
/// splice can tell from the frames between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Upstream {
    /// This many PINGs are on their way to containerd, unanswered.
    Asked(u32),
    /// containerd has answered every PING and written no HEADERS/DATA
    /// since: the next PING is a strike.
    Silent,
    /// containerd has written HEADERS/DATA since it answered the last PING:
    /// the next one clears its strikes.
    Spoke,
}

impl Upstream {
    /// A PING went to containerd.
    fn asked(self) -> Upstream {
        match self {
            Upstream::Asked(n) => Upstream::Asked(n.saturating_add(1)),
            Upstream::Silent | Upstream::Spoke => Upstream::Asked(1),
        }
    }

    /// containerd answered a PING.
    fn answered(self) -> Upstream {
        match self {
            Upstream::Asked(n) if n > 1 => Upstream::Asked(n - 1),
            Upstream::Asked(_) => Upstream::Silent,
            // An ACK of nothing the splice sent on: not ours to judge.
            other => other,
        }
    }

    /// containerd wrote HEADERS or DATA.
    fn wrote(self) -> Upstream {
        match self {
            Upstream::Silent => Upstream::Spoke,
            other => other,
        }
    }
}

/// One connection's PING bookkeeping (see the module doc).
#[derive(Debug)]
pub(super) struct Pings {
    upstream: Upstream,
    /// A held reply went to the client after the last PING ACK it was sent.
    released: bool,
}

impl Default for Pings {
    fn default() -> Pings {
        Pings {
            // Nothing written yet (containerd's first PING is never a
            // strike, but nothing is released before it writes anyway).
            upstream: Upstream::Silent,
            released: false,
        }
    }
}

impl Pings {
    /// containerd wrote a HEADERS or DATA frame (held or not).
    pub(super) fn containerd_wrote(&mut self) {
        self.upstream = self.upstream.wrote();
    }

    /// A held reply (or what a watch held) was queued for the client.
    pub(super) fn released(&mut self) {
        self.released = true;
    }

    /// A whole PING frame from `from`. A client PING the splice answers is
    /// swallowed, its ACK queued for the client; everything else is
    /// forwarded as it came.
    pub(super) fn frame(&mut self, from: Side, head: &Head, frame: &[u8], out: Out<'_>) -> Verdict {
        if !head.stream.is_zero() || head.len != PAYLOAD {
            return Verdict::Forward; // the receiver ends the connection
        }
        let ack = head.has(super::frame::ACK);
        match (from, ack) {
            (Side::Containerd, true) => {
                self.upstream = self.upstream.answered();
                self.released = false;
            }
            (Side::Client, false) => {
                if self.released && self.upstream != Upstream::Spoke {
                    self.released = false;
                    out.down.push_back(ack_of(&frame[HEADER_LEN..]));
                    tracing::debug!("answered a client PING that follows a released held reply (containerd would count it against the client)");
                    return Verdict::Swallow;
                }
                self.upstream = self.upstream.asked();
                self.released = false;
            }
            // containerd's own PINGs and the client's ACKs of them.
            (Side::Containerd, false) | (Side::Client, true) => {}
        }
        Verdict::Forward
    }
}

/// The ACK of a PING with `payload`.
fn ack_of(payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + PAYLOAD);
    put_head(
        &mut out,
        PAYLOAD,
        Kind::Ping,
        super::frame::ACK,
        StreamId::ZERO,
    );
    out.put_slice(payload);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::super::frame::{self, Head};
    use super::super::testing::*;
    use super::*;
    use std::collections::VecDeque;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const DATA: [u8; 8] = [2, 4, 16, 16, 9, 14, 7, 7];

    /// What `pings` does with `from`'s PING (ACK if `ack`), and the frames
    /// it queued for the client.
    fn ping(pings: &mut Pings, from: Side, ack: bool) -> (Verdict, Vec<Bytes>) {
        let f = frame(Kind::Ping, if ack { frame::ACK } else { 0 }, 0, &DATA);
        let (mut up, mut down) = (VecDeque::new(), VecDeque::new());
        let out = Out {
            up: &mut up,
            down: &mut down,
        };
        let v = pings.frame(from, &Head::parse(&f), &f, out);
        assert!(up.is_empty());
        (v, down.into())
    }

    fn client(pings: &mut Pings) -> Verdict {
        ping(pings, Side::Client, false).0
    }

    /// containerd answers the PING it was sent.
    fn acked(pings: &mut Pings) {
        assert_eq!(ping(pings, Side::Containerd, true).0, Verdict::Forward);
    }

    #[test]
    fn a_ping_after_a_release_into_silence_is_answered_once() {
        let mut p = Pings::default();
        p.containerd_wrote();
        assert_eq!(client(&mut p), Verdict::Forward);
        acked(&mut p);
        p.released();
        let (v, down) = ping(&mut p, Side::Client, false);
        assert_eq!(v, Verdict::Swallow);
        assert_eq!(
            down,
            [Bytes::from(frame(Kind::Ping, frame::ACK, 0, &DATA))],
            "ACK with the same payload"
        );
        assert_eq!(client(&mut p), Verdict::Forward, "one answer per release");
    }

    #[test]
    fn a_ping_after_containerd_spoke_goes_to_containerd() {
        let mut p = Pings::default();
        assert_eq!(client(&mut p), Verdict::Forward);
        acked(&mut p);
        p.released();
        p.containerd_wrote();
        assert_eq!(client(&mut p), Verdict::Forward, "containerd clears");
    }

    /// What containerd writes while a PING is on its way may predate it.
    #[test]
    fn what_containerd_writes_before_its_ack_does_not_count() {
        let mut p = Pings::default();
        assert_eq!(client(&mut p), Verdict::Forward);
        p.containerd_wrote();
        acked(&mut p);
        p.released();
        assert_eq!(client(&mut p), Verdict::Swallow);

        // Two PINGs out: only the last ACK ends the doubt.
        let mut p = Pings::default();
        assert_eq!(client(&mut p), Verdict::Forward);
        assert_eq!(client(&mut p), Verdict::Forward);
        acked(&mut p);
        p.containerd_wrote();
        acked(&mut p);
        p.released();
        assert_eq!(client(&mut p), Verdict::Swallow);
    }

    /// A release that reaches the client before the ACK of its PING makes
    /// no PING of its own: it earns no answer.
    #[test]
    fn a_release_before_the_ack_earns_nothing() {
        let mut p = Pings::default();
        assert_eq!(client(&mut p), Verdict::Forward);
        p.released();
        acked(&mut p);
        assert_eq!(client(&mut p), Verdict::Forward);
    }

    #[test]
    fn a_ping_flood_gets_one_answer_per_release() {
        let mut p = Pings::default();
        p.released();
        let answered = (0..100)
            .filter(|_| client(&mut p) == Verdict::Swallow)
            .count();
        assert_eq!(answered, 1);
    }

    /// containerd's own PINGs, the client's ACKs of them, and malformed
    /// PINGs pass untouched and change nothing.
    #[test]
    fn other_pings_pass_untouched() {
        let mut p = Pings::default();
        p.released();
        assert_eq!(ping(&mut p, Side::Containerd, false).0, Verdict::Forward);
        assert_eq!(ping(&mut p, Side::Client, true).0, Verdict::Forward);
        let (mut up, mut down) = (VecDeque::new(), VecDeque::new());
        for bad in [
            frame(Kind::Ping, 0, 1, &DATA),
            frame(Kind::Ping, 0, 0, &DATA[..7]),
        ] {
            let out = Out {
                up: &mut up,
                down: &mut down,
            };
            let v = p.frame(Side::Client, &Head::parse(&bad), &bad, out);
            assert_eq!(v, Verdict::Forward);
        }
        assert_eq!(client(&mut p), Verdict::Swallow, "the release still counts");
    }

    /// Through a splice: a held reply released after containerd's last ACK
    /// and the client's PING on it; containerd never sees that PING and
    /// the client gets its ACK. A plain reply after that lets the next
    /// PING through.
    #[tokio::test]
    async fn the_ping_a_release_causes_is_answered_by_the_splice() {
        let (mut client, mut server, _task, gate, _) =
            held_call_sent(&frame(Kind::Ping, 0, 0, &DATA)).await;
        // containerd answers the call (held), then the PING.
        let mut reply = ok_reply(1);
        reply.extend(frame(Kind::Ping, frame::ACK, 0, &DATA));
        server.write_all(&reply).await.unwrap();
        let (h, p) = read_frame(&mut client).await;
        assert_eq!(
            (h.kind, h.flags, &p[..]),
            (Kind::Ping, frame::ACK, &DATA[..])
        );

        gate.notify_one();
        for kind in [Kind::Headers, Kind::Data, Kind::Headers] {
            assert_eq!(read_frame(&mut client).await.0.kind, kind);
        }
        let bdp = frame(Kind::Ping, 0, 0, &[9; 8]);
        client.write_all(&bdp).await.unwrap();
        let answer = read_frame(&mut client);
        let (h, p) = tokio::time::timeout(std::time::Duration::from_secs(5), answer)
            .await
            .expect("the splice answers the PING");
        assert_eq!(
            (h.kind, h.flags, &p[..]),
            (Kind::Ping, frame::ACK, &[9; 8][..])
        );

        // containerd speaks: the next PING is its to answer.
        let mut sent = request(3, "/t.S/Plain");
        sent.extend(frame(Kind::Data, frame::END_STREAM, 3, &MSG));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);
        let plain = ok_reply(3);
        server.write_all(&plain).await.unwrap();
        let mut got = vec![0; plain.len()];
        client.read_exact(&mut got).await.unwrap();
        let next = frame(Kind::Ping, 0, 0, &[7; 8]);
        assert_eq!(relay(&mut client, &mut server, &next).await, next);
    }
}
