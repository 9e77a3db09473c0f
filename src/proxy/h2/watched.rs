//! A streaming call watched message by message ([`StreamWatch`]; today a
//! `Content.Write` in a source namespace, see `replicate::commit`): the
//! request passes frame by frame while the head of each message is shown to
//! the watch, and the reply to each message the watch asks for is held —
//! from the DATA frame where it begins, with everything after it, DATA
//! frames as they came and header blocks decoded — until the watch's
//! future ends, then sent on in order.
//!
//! Replies are matched to requests by position: a watched call answers
//! each request message with exactly one reply message, in order
//! (containerd's `Content.Write` does), so the reply to request N is reply
//! N however many messages a client sends before it reads one. Counting,
//! not "the next reply", is what holds a pipelining client's COMMIT: its
//! first reply after the COMMIT went out is the reply to an earlier WRITE.
//!
//! Request DATA is never kept. Reply DATA is kept only from the start of
//! a wanted reply (one small message) to the end of the hold, with
//! whatever containerd sends meanwhile (for a write: a repeat of the
//! COMMIT reply, then the trailers). Held DATA is delivered later, never
//! dropped, so flow control is unaffected unless the client gives up on
//! the call: then the credit the held frames took goes back to containerd.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::frame::{self, Head, Kind, StreamId};
use super::hpack;
use crate::proxy::grpc;
use crate::proxy::intercept::{StreamWatch, WatchFuture, WATCH_HEAD};

/// A wanted reply message is shown whole to the watch up to this size (a
/// COMMIT reply is under 200 bytes); a larger one is released unread.
const REPLY_MAX: usize = 64 << 10;

/// Request messages whose replies are wanted at once, at most. containerd
/// ends a write at its first COMMIT, so it never answers a later one: this
/// only bounds what a client that sends many makes the splice remember.
const WANTED_MAX: usize = 16;

/// gRPC message boundaries in a stream of DATA payloads, counting the
/// messages and keeping the first bytes of each.
#[derive(Default)]
struct Messages {
    prefix: [u8; 5],
    /// Prefix bytes seen of the current message (5: in its body; 0: between
    /// messages).
    have: usize,
    /// Body bytes of the current message still to come.
    left: usize,
    /// The current message's first bytes, up to `want`.
    head: Vec<u8>,
    want: usize,
    /// The current message's length.
    len: usize,
    compressed: bool,
    /// The current message's head has been shown.
    shown: bool,
    /// Messages begun (the current one's index is one less).
    begun: u64,
}

/// One message's head, as [`Messages::feed`] shows it.
struct MessageHead<'a> {
    /// Its position in the stream, from 0.
    index: u64,
    bytes: &'a [u8],
    /// The whole message's length: more than `bytes` when cut at the limit.
    len: usize,
    compressed: bool,
}

impl Messages {
    /// Walks `data`; `on` sees the first `max(index)` bytes of each message
    /// (or all of a shorter one) once they are in.
    fn feed(
        &mut self,
        mut data: &[u8],
        max: impl Fn(u64) -> usize,
        mut on: impl FnMut(MessageHead<'_>),
    ) {
        // A message is shown in the pass that completes its head, so an
        // empty message whose prefix ends `data` is shown before the loop
        // ends: nothing is left to do once `data` is used up.
        while !data.is_empty() {
            if self.have < 5 {
                if self.have == 0 {
                    self.begun += 1;
                }
                let n = (5 - self.have).min(data.len());
                self.prefix[self.have..self.have + n].copy_from_slice(&data[..n]);
                self.have += n;
                data = &data[n..];
                if self.have < 5 {
                    return;
                }
                self.compressed = self.prefix[0] != 0;
                self.left = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]) as usize;
                self.len = self.left;
                self.want = self.left.min(max(self.begun - 1));
                self.head.clear();
                self.shown = false;
            }
            let n = self.left.min(data.len());
            let keep = (self.want - self.head.len()).min(n);
            self.head.extend_from_slice(&data[..keep]);
            data = &data[n..];
            self.left -= n;
            if !self.shown && self.head.len() == self.want {
                self.shown = true;
                on(MessageHead {
                    index: self.begun - 1,
                    bytes: &self.head,
                    len: self.len,
                    compressed: self.compressed,
                });
            }
            if self.left == 0 {
                self.have = 0;
            }
        }
    }

    /// The index of the message begun and not yet whole, if any.
    fn open(&self) -> Option<u64> {
        (self.have > 0).then(|| self.begun - 1)
    }
}

/// A reply frame kept back by a hold.
enum Kept {
    /// DATA or RST_STREAM, as containerd sent it.
    Frame(Bytes),
    /// A header block, decoded (it is re-encoded without the dynamic table
    /// when sent, like a held call's).
    Block {
        fields: Vec<(Bytes, Bytes)>,
        end_stream: bool,
    },
}

/// Where the watched call's replies are.
enum Hold {
    /// They pass as they come (and are counted).
    Off,
    /// Kept from the frame where a wanted reply began until it is whole.
    /// `then`: the watch's work for wanted replies already whole.
    Collecting {
        kept: Vec<Kept>,
        then: Option<WatchFuture>,
    },
    /// Kept while the watch's future runs. `then`: work for what came
    /// meanwhile (another wanted reply, the end), run after it.
    Waiting {
        kept: Vec<Kept>,
        then: Option<WatchFuture>,
    },
}

/// What to do with a reply frame or block of a watched call.
pub(super) enum Step {
    /// Send it on now.
    Pass,
    /// Kept back.
    Kept,
    /// Kept back; run this before sending on what is kept.
    Run(WatchFuture),
    /// Kept back, and what is kept goes now.
    Release,
}

/// Both futures, run together: the hold ends when both have.
fn join(a: Option<WatchFuture>, b: Option<WatchFuture>) -> Option<WatchFuture> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Box::pin(async move {
            futures_util::future::join(a, b).await;
        })),
        (a, b) => a.or(b),
    }
}

/// A watched call.
pub(super) struct Watched {
    watch: Box<dyn StreamWatch>,
    request: Messages,
    reply: Messages,
    /// The request messages whose replies the watch wants, oldest first;
    /// none has begun.
    wanted: VecDeque<u64>,
    hold: Hold,
    /// containerd ended the stream (it is among what is kept).
    ended: bool,
    /// Flow-control credit the kept DATA frames took.
    flow: u64,
}

impl Watched {
    pub(super) fn new(watch: Box<dyn StreamWatch>) -> Watched {
        Watched {
            watch,
            request: Messages::default(),
            reply: Messages::default(),
            wanted: VecDeque::new(),
            hold: Hold::Off,
            ended: false,
            flow: 0,
        }
    }

    /// Whether the watch's future is running.
    pub(super) fn waiting(&self) -> bool {
        matches!(self.hold, Hold::Waiting { .. })
    }

    fn holding(&self) -> bool {
        !matches!(self.hold, Hold::Off)
    }

    /// A request DATA payload (padding removed), passing on as it is.
    pub(super) fn request_data(&mut self, content: &[u8]) {
        let (watch, wanted, answered) = (&mut self.watch, &mut self.wanted, self.reply.begun);
        self.request.feed(
            content,
            |_| WATCH_HEAD,
            |m| {
                // Its reply cannot have begun (containerd has not had the
                // whole message yet) unless containerd answers out of
                // turn; then it is not looked for.
                if !m.compressed
                    && watch.request(m.bytes)
                    && m.index >= answered
                    && wanted.len() < WANTED_MAX
                {
                    wanted.push_back(m.index);
                }
            },
        );
    }

    /// A reply DATA frame (`content` without padding).
    pub(super) fn reply_data(&mut self, head: &Head, frame: &[u8], content: &[u8]) -> Step {
        let wanted = &self.wanted;
        let mut whole = Vec::new();
        self.reply.feed(
            content,
            |i| if wanted.contains(&i) { REPLY_MAX } else { 0 },
            |m| {
                if wanted.contains(&m.index) {
                    let readable = !m.compressed && m.len == m.bytes.len();
                    whole.push(readable.then(|| Bytes::copy_from_slice(m.bytes)));
                }
            },
        );
        // A wanted reply began in this frame (or before, and it is kept).
        let began = self.wanted.front().is_some_and(|&w| w < self.reply.begun);
        if !began && !self.holding() {
            return Step::Pass;
        }
        self.wanted.drain(..whole.len());
        let mut work = None;
        for msg in whole {
            work = join(work, msg.and_then(|m| self.watch.reply(m)));
        }
        self.ended |= head.has(frame::END_STREAM);
        self.flow += head.len as u64;
        self.keep(Kept::Frame(Bytes::copy_from_slice(frame)), work)
    }

    /// A reply header block, decoded. `Step::Pass`: the caller sends it.
    pub(super) fn reply_block(&mut self, fields: &[(Bytes, Bytes)], end_stream: bool) -> Step {
        let work = match end_stream {
            true => {
                let status = (fields.iter())
                    .find(|(n, _)| &n[..] == b"grpc-status")
                    .and_then(|(_, v)| grpc::parse_status(v));
                self.watch.end(status)
            }
            false => None,
        };
        if work.is_none() && !self.holding() {
            return Step::Pass;
        }
        self.ended |= end_stream;
        let block = Kept::Block {
            fields: fields.to_vec(),
            end_stream,
        };
        self.keep(block, work)
    }

    /// containerd reset the stream: it follows what is kept.
    pub(super) fn reply_reset(&mut self, frame: &[u8]) -> Step {
        if !self.holding() {
            return Step::Pass;
        }
        self.ended = true;
        self.keep(Kept::Frame(Bytes::copy_from_slice(frame)), None)
    }

    /// Keeps `k` (starting a hold if none is on) and adds `work` to the
    /// hold's.
    fn keep(&mut self, k: Kept, work: Option<WatchFuture>) -> Step {
        match &mut self.hold {
            Hold::Off => {
                self.hold = Hold::Collecting {
                    kept: vec![k],
                    then: work,
                }
            }
            Hold::Collecting { kept, then } | Hold::Waiting { kept, then } => {
                kept.push(k);
                *then = join(then.take(), work);
            }
        }
        self.settle()
    }

    /// What a hold does next: it collects while a wanted reply is coming,
    /// then runs the watch's work, then lets go.
    fn settle(&mut self) -> Step {
        let coming =
            !self.ended && (self.reply.open()).is_some_and(|i| self.wanted.front() == Some(&i));
        match &mut self.hold {
            Hold::Off | Hold::Waiting { .. } => Step::Kept,
            Hold::Collecting { .. } if coming => Step::Kept,
            Hold::Collecting { kept, then } => match then.take() {
                Some(f) => {
                    self.hold = Hold::Waiting {
                        kept: std::mem::take(kept),
                        then: None,
                    };
                    Step::Run(f)
                }
                None => Step::Release,
            },
        }
    }

    /// The watch's future ended: run what came meanwhile, or let go.
    pub(super) fn resume(&mut self) -> Step {
        if let Hold::Waiting { kept, then } = &mut self.hold {
            self.hold = Hold::Collecting {
                kept: std::mem::take(kept),
                then: then.take(),
            };
        }
        self.settle()
    }

    /// Ends the hold: the kept frames, in order, for the client, whether
    /// they ended the stream, and the last `grpc-status` among them.
    pub(super) fn release(&mut self, stream: StreamId) -> Released {
        let kept = match std::mem::replace(&mut self.hold, Hold::Off) {
            Hold::Collecting { kept, .. } | Hold::Waiting { kept, .. } => kept,
            Hold::Off => Vec::new(),
        };
        self.flow = 0;
        let mut r = Released::default();
        let mut frames = BytesMut::new();
        for k in kept {
            match k {
                Kept::Frame(f) => {
                    let head = Head::parse(&f);
                    r.ended |= head.kind == Kind::RstStream || head.has(frame::END_STREAM);
                    if head.kind == Kind::Data {
                        r.data += head.len as u64;
                    }
                    frames.extend_from_slice(&f);
                }
                Kept::Block { fields, end_stream } => {
                    let status = (fields.iter())
                        .find(|(n, _)| &n[..] == b"grpc-status")
                        .and_then(|(_, v)| grpc::parse_status(v));
                    r.status = status.or(r.status);
                    r.block = true;
                    r.ended |= end_stream;
                    frame::header_frames(stream, end_stream, &mut frames, |b| {
                        for (n, v) in &fields {
                            hpack::encode_field(b, n, v);
                        }
                    });
                }
            }
        }
        r.frames = frames.freeze();
        r
    }

    /// Credit the kept DATA frames took, when the call is dropped unsent.
    pub(super) fn kept_credit(&self) -> u64 {
        if self.holding() {
            self.flow
        } else {
            0
        }
    }
}

/// What a hold let go.
#[derive(Default)]
pub(super) struct Released {
    pub(super) frames: Bytes,
    pub(super) ended: bool,
    pub(super) block: bool,
    pub(super) status: Option<i32>,
    pub(super) data: u64,
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use futures_util::FutureExt;

    use tokio::io::AsyncWriteExt;
    use tokio::sync::Notify;
    use tokio_util::sync::CancellationToken;

    use super::super::testing::*;
    use super::*;
    use crate::proxy::intercept::{CallInfo, Hook, Interceptor};

    fn message(body: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend((body.len() as u32).to_be_bytes());
        m.extend(body);
        m
    }

    fn messages(bodies: &[&[u8]]) -> Vec<u8> {
        bodies.iter().flat_map(|b| message(b)).collect()
    }

    fn heads(data: &[u8], cut: &[usize], max: usize) -> Vec<(u64, Vec<u8>, usize)> {
        let mut m = Messages::default();
        let mut seen = Vec::new();
        let mut at = 0;
        for &c in cut.iter().chain([&data.len()]) {
            m.feed(
                &data[at..c],
                |_| max,
                |h| seen.push((h.index, h.bytes.to_vec(), h.len)),
            );
            at = c;
        }
        seen
    }

    #[test]
    fn message_heads_are_seen_once_however_the_frames_cut_them() {
        let mut data = message(b"first");
        data.extend(message(&[7; 3000]));
        data.extend(message(b""));
        data.extend(message(b"last"));
        let want = vec![
            (0, b"first".to_vec(), 5),
            (1, vec![7; 1024], 3000),
            (2, Vec::new(), 0),
            (3, b"last".to_vec(), 4),
        ];
        assert_eq!(heads(&data, &[], 1024), want);
        for cut in 0..data.len() {
            assert_eq!(heads(&data, &[cut], 1024), want, "cut at {cut}");
        }
        let every: Vec<usize> = (1..data.len()).collect();
        assert_eq!(heads(&data, &every, 1024), want);
    }

    /// Wants the reply of each request message that starts with `COMMIT`;
    /// a reply starting with `COMMITTED` and an ALREADY_EXISTS end start
    /// work (that waits for `gate`, if any). Notes what it is shown and
    /// counts the work done.
    #[derive(Clone, Default)]
    struct Script {
        seen: Arc<Mutex<Vec<String>>>,
        gate: Option<Arc<Notify>>,
        done: Arc<AtomicUsize>,
    }

    impl Script {
        fn note(&self, what: String) {
            self.seen.lock().unwrap().push(what);
        }

        fn seen(&self) -> Vec<String> {
            self.seen.lock().unwrap().clone()
        }

        fn work(&self) -> WatchFuture {
            let (gate, done) = (self.gate.clone(), self.done.clone());
            Box::pin(async move {
                if let Some(g) = gate {
                    g.notified().await;
                }
                done.fetch_add(1, Ordering::SeqCst);
            })
        }

        fn done(&self) -> usize {
            self.done.load(Ordering::SeqCst)
        }
    }

    impl StreamWatch for Script {
        fn request(&mut self, head: &[u8]) -> bool {
            head.starts_with(b"COMMIT")
        }

        fn reply(&mut self, message: Bytes) -> Option<WatchFuture> {
            self.note(format!("reply {}", String::from_utf8_lossy(&message)));
            message.starts_with(b"COMMITTED").then(|| self.work())
        }

        fn end(&mut self, grpc_status: Option<i32>) -> Option<WatchFuture> {
            self.note(format!("end {grpc_status:?}"));
            (grpc_status == Some(6)).then(|| self.work())
        }
    }

    fn data_frame(payload: &[u8]) -> Vec<u8> {
        frame(Kind::Data, 0, 1, payload)
    }

    fn block_fields(fields: &[(&str, &str)]) -> Vec<(Bytes, Bytes)> {
        (fields.iter())
            .map(|(n, v)| {
                (
                    Bytes::copy_from_slice(n.as_bytes()),
                    Bytes::copy_from_slice(v.as_bytes()),
                )
            })
            .collect()
    }

    /// What became of one watched call's replies.
    #[derive(Debug, Default)]
    struct Seen {
        /// Reply DATA the client had at once.
        passed: Vec<u8>,
        /// Futures the hold ran, one after the other.
        runs: usize,
        /// Reply DATA the hold kept, then released.
        released: Vec<u8>,
        /// The release ended the stream with this status.
        status: Option<i32>,
    }

    impl Seen {
        fn step(&mut self, w: &mut Watched, step: Step, data: &[u8]) {
            match step {
                Step::Pass => self.passed.extend(data),
                Step::Kept => {}
                Step::Run(f) => self.run(f),
                Step::Release => self.release(w),
            }
        }

        /// Runs a hold's future (ungated work ends at once).
        fn run(&mut self, f: WatchFuture) {
            assert!(f.now_or_never().is_some(), "ungated work ends at once");
            self.runs += 1;
        }

        fn release(&mut self, w: &mut Watched) {
            let r = w.release(StreamId::new(1));
            let mut f = &r.frames[..];
            while !f.is_empty() {
                let head = Head::parse(f);
                if head.kind == Kind::Data {
                    self.released.extend(&f[frame::HEADER_LEN..][..head.len]);
                }
                f = &f[frame::HEADER_LEN + head.len..];
            }
            assert!(r.ended, "the kept trailers went with the release");
            self.status = r.status;
        }

        /// Ends the futures the hold runs, one at a time, until it lets go.
        fn finish(&mut self, w: &mut Watched) {
            for _ in 0..8 {
                if !w.holding() {
                    return;
                }
                match w.resume() {
                    Step::Run(f) => self.run(f),
                    Step::Release => self.release(w),
                    Step::Kept | Step::Pass => panic!("a hold with nothing to run stays on"),
                }
            }
            panic!("the hold never let go");
        }
    }

    /// A watched call whose requests (`requests`, all sent before any
    /// reply: a pipelining client) are answered by `replies`, their bytes
    /// cut into DATA frames at `cuts`, then trailers with `status`.
    fn pipelined(
        script: &Script,
        requests: &[&[u8]],
        replies: &[u8],
        cuts: &[usize],
        status: &str,
    ) -> Seen {
        let mut w = Watched::new(Box::new(script.clone()));
        w.request_data(&messages(requests));
        answer(&mut w, replies, cuts, status)
    }

    fn answer(w: &mut Watched, replies: &[u8], cuts: &[usize], status: &str) -> Seen {
        let mut seen = Seen::default();
        let headers = block_fields(&[(":status", "200")]);
        assert!(matches!(w.reply_block(&headers, false), Step::Pass));
        let mut at = 0;
        for &c in cuts.iter().chain([&replies.len()]).filter(|&&c| c > 0) {
            let f = data_frame(&replies[at..c]);
            let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
            seen.step(w, step, &replies[at..c]);
            at = c;
        }
        let trailers = block_fields(&[("grpc-status", status)]);
        match w.reply_block(&trailers, true) {
            Step::Pass => seen.status = grpc::parse_status(status.as_bytes()),
            step => seen.step(w, step, &[]),
        }
        seen.finish(w);
        seen
    }

    /// Where the reply to request `n` begins in `replies`.
    fn start_of(replies: &[&[u8]], n: usize) -> usize {
        replies[..n].iter().map(|r| r.len() + 5).sum()
    }

    /// The bytes a frame-cut reply stream lets through before a hold that
    /// begins at byte `start`: every frame that ends by then.
    fn before(cuts: &[usize], start: usize) -> usize {
        cuts.iter()
            .copied()
            .filter(|&c| c <= start)
            .max()
            .unwrap_or(0)
    }

    const STAT_WRITE_COMMIT: [&[u8]; 5] = [b"STAT", b"WRITE a", b"WRITE b", b"WRITE c", b"COMMIT"];
    const ANSWERS: [&[u8]; 6] = [
        b"STATUS",
        b"WROTE a",
        b"WROTE b",
        b"WROTE c",
        b"COMMITTED sha256:x",
        // containerd repeats its last reply as it returns.
        b"COMMITTED sha256:x",
    ];

    fn check(cuts: &[usize]) {
        let replies = messages(&ANSWERS);
        let start = start_of(&ANSWERS, 4);
        let script = Script::default();
        let seen = pipelined(&script, &STAT_WRITE_COMMIT, &replies, cuts, "0");
        let held = before(cuts, start);
        assert_eq!(seen.passed, replies[..held], "cuts {cuts:?}");
        assert_eq!(seen.released, replies[held..], "cuts {cuts:?}");
        assert_eq!(seen.runs, 1, "cuts {cuts:?}");
        assert_eq!(seen.status, Some(0));
        assert_eq!(script.seen(), ["reply COMMITTED sha256:x", "end Some(0)"]);
    }

    /// STAT, three WRITEs and the COMMIT sent before any reply: the
    /// replies to the STAT and the WRITEs pass, the COMMIT's is held from
    /// the frame its first byte is in, however containerd's DATA frames
    /// cut the replies (one frame may end one reply and begin the next).
    #[test]
    fn a_pipelined_commit_reply_is_held_from_its_first_byte_however_frames_cut_it() {
        let len = messages(&ANSWERS).len();
        check(&[]);
        for a in 1..len {
            check(&[a]);
            for b in a + 1..len {
                check(&[a, b]);
            }
        }
        check(&(1..len).collect::<Vec<_>>());
        // One frame per reply: the COMMIT's is the fifth.
        let per_reply: Vec<usize> = (1..=ANSWERS.len()).map(|n| start_of(&ANSWERS, n)).collect();
        check(&per_reply);
    }

    /// What the watch used to do: take the first reply after the COMMIT
    /// went out for the COMMIT's. With WRITE and COMMIT sent together that
    /// is the WRITE's, and the COMMIT reply went out unheld.
    #[test]
    fn the_write_reply_before_a_pipelined_commit_passes_and_is_not_shown() {
        let script = Script::default();
        let answers: [&[u8]; 2] = [b"WROTE", b"COMMITTED sha256:x"];
        let replies = messages(&answers);
        let first = start_of(&answers, 1);
        let seen = pipelined(&script, &[b"WRITE", b"COMMIT"], &replies, &[first], "0");
        assert_eq!(seen.passed, replies[..first]);
        assert_eq!(seen.released, replies[first..]);
        assert_eq!(script.seen(), ["reply COMMITTED sha256:x", "end Some(0)"]);
    }

    /// A writer that waits for each reply before it sends the next
    /// message (containerd's Go client) is held as before.
    #[test]
    fn a_synchronous_writer_is_held_at_its_commit_reply() {
        let script = Script::default();
        let mut w = Watched::new(Box::new(script.clone()));
        let mut seen = Seen::default();
        let headers = block_fields(&[(":status", "200")]);
        assert!(matches!(w.reply_block(&headers, false), Step::Pass));
        for (req, rep) in [(&b"STAT"[..], &b"STATUS"[..]), (b"WRITE", b"WROTE")] {
            w.request_data(&message(req));
            let f = data_frame(&message(rep));
            let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
            seen.step(&mut w, step, &message(rep));
        }
        w.request_data(&message(b"COMMIT"));
        let rest = messages(&[b"COMMITTED sha256:x", b"COMMITTED sha256:x"]);
        let seen2 = answer_rest(&mut w, &rest);
        assert_eq!(seen.passed, messages(&[b"STATUS", b"WROTE"]));
        assert_eq!(seen2.released, rest);
        assert_eq!(seen2.runs, 1);
    }

    /// Reply DATA (one frame) and OK trailers on a call whose headers went.
    fn answer_rest(w: &mut Watched, replies: &[u8]) -> Seen {
        let mut seen = Seen::default();
        let f = data_frame(replies);
        let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
        seen.step(w, step, replies);
        let trailers = block_fields(&[("grpc-status", "0")]);
        let step = w.reply_block(&trailers, true);
        seen.step(w, step, &[]);
        seen.finish(w);
        seen
    }

    /// Two COMMITs in one call: each one's reply is held until its work
    /// is done (containerd answers the first and repeats that answer, in
    /// the second's place), whether the replies share a frame or not.
    #[test]
    fn several_commits_hold_until_the_work_of_each_reply_is_done() {
        let answers: [&[u8]; 3] = [b"WROTE", b"COMMITTED sha256:x", b"COMMITTED sha256:x"];
        let replies = messages(&answers);
        for cuts in [vec![], vec![start_of(&answers, 1), start_of(&answers, 2)]] {
            let script = Script::default();
            let requests: [&[u8]; 3] = [b"WRITE", b"COMMIT", b"COMMIT"];
            let seen = pipelined(&script, &requests, &replies, &cuts, "0");
            let held = before(&cuts, start_of(&answers, 1));
            assert_eq!(seen.passed, replies[..held]);
            assert_eq!(seen.released, replies[held..]);
            assert_eq!(script.done(), 2, "the work of both, {cuts:?}");
            assert_eq!(
                script.seen(),
                [
                    "reply COMMITTED sha256:x",
                    "reply COMMITTED sha256:x",
                    "end Some(0)"
                ]
            );
        }
    }

    /// The data and the COMMIT in one message (a small blob), its head cut
    /// across request frames: its reply, the only one, is held.
    #[test]
    fn write_and_commit_in_one_message_holds_its_reply() {
        let script = Script::default();
        let mut w = Watched::new(Box::new(script.clone()));
        let mut body = b"COMMIT with data ".to_vec();
        body.extend([9; 5000]);
        let req = message(&body);
        for part in req.chunks(700) {
            w.request_data(part);
        }
        let replies = message(b"COMMITTED sha256:y");
        let seen = answer(&mut w, &replies, &[3], "0");
        assert_eq!(seen.passed, b"");
        assert_eq!(seen.released, replies);
        assert_eq!(seen.runs, 1);
        assert_eq!(script.seen(), ["reply COMMITTED sha256:y", "end Some(0)"]);
    }

    /// The blob is there already: containerd ends the call ALREADY_EXISTS
    /// with no reply to the COMMIT (at once, or after the replies to the
    /// messages before the one that named the digest); the end is held.
    #[test]
    fn an_already_exists_end_without_a_commit_reply_is_held() {
        // Trailers-only: no reply message at all.
        let script = Script::default();
        let mut w = Watched::new(Box::new(script.clone()));
        w.request_data(&messages(&STAT_WRITE_COMMIT));
        let end = block_fields(&[(":status", "200"), ("grpc-status", "6")]);
        let mut seen = Seen::default();
        let step = w.reply_block(&end, true);
        assert!(matches!(step, Step::Run(_)));
        seen.step(&mut w, step, &[]);
        seen.finish(&mut w);
        assert_eq!((seen.runs, seen.status), (1, Some(6)));
        assert_eq!(script.seen(), ["end Some(6)"]);

        // After two replies that passed.
        let script = Script::default();
        let answers: [&[u8]; 2] = [b"STATUS", b"WROTE a"];
        let replies = messages(&answers);
        let seen = pipelined(&script, &STAT_WRITE_COMMIT, &replies, &[4], "6");
        assert_eq!(seen.passed, replies);
        assert_eq!((seen.runs, seen.status), (1, Some(6)));
        assert_eq!(script.seen(), ["end Some(6)"]);
    }

    /// A reply the watch does not act on, or one too large to show it,
    /// lets the hold go at once; the rest passes.
    #[test]
    fn a_commit_reply_with_no_work_or_too_large_to_read_lets_go_at_once() {
        for (body, shown) in [
            (b"NOTHING TO DO".to_vec(), true),
            (vec![b'C'; REPLY_MAX + 1], false),
        ] {
            let script = Script::default();
            let mut w = Watched::new(Box::new(script.clone()));
            w.request_data(&messages(&[b"WRITE", b"COMMIT"]));
            let mut replies = message(b"WROTE");
            replies.extend(message(&body));
            let cut = replies.len() - 1;
            let f = data_frame(&replies[..cut]);
            let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
            let release = matches!(step, Step::Release);
            assert_eq!(release, !shown, "a large reply lets go once its head is in");
            if release {
                w.release(StreamId::new(1));
            }
            let f = data_frame(&replies[cut..]);
            let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
            assert_eq!(matches!(step, Step::Pass), !shown);
            assert_eq!(matches!(step, Step::Release), shown);
            assert_eq!(script.seen().len(), usize::from(shown));
        }
    }

    /// containerd resets the stream in the middle of the COMMIT's reply:
    /// nothing more comes, so the hold lets go with the reset.
    #[test]
    fn a_reset_in_the_middle_of_a_wanted_reply_lets_go() {
        let mut w = Watched::new(Box::new(Script::default()));
        w.request_data(&messages(&[b"WRITE", b"COMMIT"]));
        let replies = messages(&[b"WROTE", b"COMMITTED sha256:x"]);
        let f = data_frame(&replies[..replies.len() - 3]);
        let step = w.reply_data(&Head::parse(&f), &f, &f[frame::HEADER_LEN..]);
        assert!(matches!(step, Step::Kept));
        let rst = frame(Kind::RstStream, 0, 1, &[0, 0, 0, 2]);
        assert!(matches!(w.reply_reset(&rst), Step::Release));
        let r = w.release(StreamId::new(1));
        assert!(r.ended);
        assert_eq!(r.frames.len(), f.len() + rst.len());
    }

    /// Splices `/t.S/Write` through [`Script`].
    struct Watching(Script);

    impl Interceptor for Watching {
        fn select(&self, _: &CallInfo) -> Option<Box<dyn Hook>> {
            None
        }

        fn watch(&self, call: &CallInfo) -> Option<Box<dyn StreamWatch>> {
            (&*call.method == "/t.S/Write").then(|| Box::new(self.0.clone()) as _)
        }
    }

    /// Through the splice: a client sends WRITE and COMMIT in one DATA
    /// frame; containerd answers in a frame that holds the WRITE's reply
    /// and the head of the COMMIT's, then one with the rest. The client
    /// has nothing of the second reply (a later call's answer overtakes
    /// it) until the watch's work is done, then all of it in order.
    #[tokio::test]
    async fn a_pipelined_commit_reply_waits_in_the_splice_while_later_calls_pass() {
        let gate = Arc::new(Notify::new());
        let script = Script {
            gate: Some(gate.clone()),
            ..Default::default()
        };
        let (mut client, mut server, _task) =
            start_intercepted(Arc::new(Watching(script.clone())), CancellationToken::new());
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(request(1, "/t.S/Write"));
        sent.extend(frame(
            Kind::Data,
            frame::END_STREAM,
            1,
            &messages(&[b"WRITE", b"COMMIT"]),
        ));
        assert_eq!(relay(&mut client, &mut server, &sent).await, sent);

        let replies = messages(&[b"WROTE", b"COMMITTED sha256:x"]);
        let cut = start_of(&[b"WROTE"], 1) + 3;
        let mut answer = frame(
            Kind::Headers,
            frame::END_HEADERS,
            1,
            &block(&[(":status", "200")]),
        );
        answer.extend(data_frame(&replies[..4]));
        answer.extend(data_frame(&replies[4..cut]));
        answer.extend(data_frame(&replies[cut..]));
        answer.extend(frame(
            Kind::Headers,
            frame::END_HEADERS | frame::END_STREAM,
            1,
            &block(&[("grpc-status", "0")]),
        ));
        server.write_all(&answer).await.unwrap();

        // A later call, answered after: its reply is the barrier.
        let mut later = request(3, "/t.S/Plain");
        later.extend(frame(Kind::Data, frame::END_STREAM, 3, &MSG));
        assert_eq!(relay(&mut client, &mut server, &later).await, later);
        server.write_all(&ok_reply(3)).await.unwrap();
        let mut first = Vec::new();
        loop {
            let (h, p) = read_frame(&mut client).await;
            if h.stream == StreamId::new(3) {
                if h.has(frame::END_STREAM) {
                    break;
                }
                continue;
            }
            assert_eq!(h.stream, StreamId::new(1));
            assert!(!h.has(frame::END_STREAM), "the end is held too");
            if h.kind == Kind::Data {
                first.extend(p);
            }
        }
        assert_eq!(
            first,
            replies[..4],
            "only the frame before the COMMIT reply began"
        );
        assert_eq!(script.seen(), ["reply COMMITTED sha256:x", "end Some(0)"]);
        assert_eq!(script.done(), 0);

        gate.notify_one();
        let mut rest = Vec::new();
        let status = loop {
            let (h, p) = read_frame(&mut client).await;
            assert_eq!(h.stream, StreamId::new(1));
            match h.kind {
                Kind::Data => rest.extend(p),
                Kind::Headers if h.has(frame::END_STREAM) => break fields(&p),
                k => panic!("unexpected {k}"),
            }
        };
        assert_eq!(rest, replies[4..]);
        assert!(has(&status, "grpc-status", "0"), "{status:?}");
    }
}
