//! A streaming call watched message by message ([`StreamWatch`]; today a
//! `Content.Write` in a source namespace, see `replicate::commit`): the
//! request passes frame by frame while the head of each message is shown to
//! the watch, and when the watch asks, the replies that follow are held —
//! DATA frames as they came, header blocks decoded — until the watch's
//! future ends, then sent on in order.
//!
//! Nothing is buffered while no hold is on, and a hold covers one small
//! reply message (and whatever containerd sends after it meanwhile: for a
//! write, only its trailers). Held DATA is delivered later, never dropped,
//! so flow control is unaffected unless the client gives up on the call:
//! then the credit the held frames took goes back to containerd.

use bytes::{Bytes, BytesMut};

use super::frame::{self, Head, Kind};
use super::held::Outcome;
use super::hpack;
use super::streams::State;
use super::Out;
use crate::proxy::grpc;
use crate::proxy::intercept::{StreamWatch, WATCH_HEAD};

/// The first reply message after a hold began is shown whole to the watch
/// up to this size (a COMMIT reply is under 200 bytes); a larger one is
/// released unread.
const REPLY_MAX: usize = 64 << 10;

/// gRPC message boundaries in a stream of DATA payloads, keeping the first
/// bytes of each message.
#[derive(Default)]
struct Messages {
    prefix: [u8; 5],
    /// Prefix bytes seen of the current message (5: in its body).
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
}

/// One message's head, as [`Messages::feed`] shows it.
struct MessageHead<'a> {
    bytes: &'a [u8],
    /// The whole message's length: more than `bytes` when cut at the limit.
    len: usize,
    compressed: bool,
}

impl Messages {
    /// Walks `data`; `on` sees each message's first `max` bytes (or all of
    /// a shorter message) once they are in.
    fn feed(&mut self, mut data: &[u8], max: usize, mut on: impl FnMut(MessageHead<'_>)) {
        // A message is shown in the pass that completes its head, so an
        // empty message whose prefix ends `data` is shown before the loop
        // ends: nothing is left to do once `data` is used up.
        while !data.is_empty() {
            if self.have < 5 {
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
                self.want = self.left.min(max);
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
    /// They pass as they come.
    Off,
    /// Held until the first whole reply message is in.
    Collecting { kept: Vec<Kept>, reply: Messages },
    /// Held while the watch's future runs.
    Waiting { kept: Vec<Kept> },
}

/// What to do with a reply frame or block of a watched call.
pub(super) enum Step {
    /// Send it on now.
    Pass,
    /// Kept back.
    Kept,
    /// Kept back; run this before sending on what is kept.
    Run(crate::proxy::intercept::WatchFuture),
    /// Kept back, and what is kept goes now.
    Release,
}

/// A watched call.
pub(super) struct Watched {
    watch: Box<dyn StreamWatch>,
    request: Messages,
    hold: Hold,
    /// Flow-control credit the kept DATA frames took.
    flow: u64,
}

impl Watched {
    pub(super) fn new(watch: Box<dyn StreamWatch>) -> Watched {
        Watched {
            watch,
            request: Messages::default(),
            hold: Hold::Off,
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
        let (watch, hold) = (&mut self.watch, &mut self.hold);
        self.request.feed(content, WATCH_HEAD, |m| {
            if !m.compressed && watch.request(m.bytes) && matches!(hold, Hold::Off) {
                *hold = Hold::Collecting {
                    kept: Vec::new(),
                    reply: Messages::default(),
                };
            }
        });
    }

    /// A reply DATA frame (`content` without padding).
    pub(super) fn reply_data(&mut self, head: &Head, frame: &[u8], content: &[u8]) -> Step {
        let first = match &mut self.hold {
            Hold::Off => return Step::Pass,
            Hold::Waiting { kept } => {
                kept.push(Kept::Frame(Bytes::copy_from_slice(frame)));
                self.flow += head.len as u64;
                return Step::Kept;
            }
            Hold::Collecting { kept, reply } => {
                kept.push(Kept::Frame(Bytes::copy_from_slice(frame)));
                self.flow += head.len as u64;
                let mut first = None;
                reply.feed(content, REPLY_MAX, |m| {
                    if first.is_none() {
                        first = Some(
                            (!m.compressed && m.len == m.bytes.len())
                                .then(|| Bytes::copy_from_slice(m.bytes)),
                        );
                    }
                });
                first
            }
        };
        match first {
            None => Step::Kept,
            Some(Some(msg)) => {
                let f = self.watch.reply(msg);
                self.run(f)
            }
            Some(None) => Step::Release,
        }
    }

    /// A reply header block, decoded. `Step::Pass`: the caller sends it.
    pub(super) fn reply_block(&mut self, fields: &[(Bytes, Bytes)], end_stream: bool) -> Step {
        let status = || {
            (fields.iter())
                .find(|(n, _)| &n[..] == b"grpc-status")
                .and_then(|(_, v)| grpc::parse_status(v))
        };
        let kept = || Kept::Block {
            fields: fields.to_vec(),
            end_stream,
        };
        match &mut self.hold {
            Hold::Off if !end_stream => Step::Pass,
            Hold::Off => match self.watch.end(status()) {
                None => Step::Pass,
                Some(f) => {
                    self.hold = Hold::Waiting { kept: vec![kept()] };
                    Step::Run(f)
                }
            },
            Hold::Waiting { kept: k } => {
                k.push(kept());
                Step::Kept
            }
            Hold::Collecting { kept: k, .. } => {
                k.push(kept());
                if end_stream {
                    // No reply message came: the call ended without one.
                    let f = self.watch.end(status());
                    self.run(f)
                } else {
                    Step::Kept
                }
            }
        }
    }

    /// containerd reset the stream: it follows what is kept.
    pub(super) fn reply_reset(&mut self, frame: &[u8]) -> Step {
        match &mut self.hold {
            Hold::Off => Step::Pass,
            Hold::Collecting { kept, .. } | Hold::Waiting { kept } => {
                kept.push(Kept::Frame(Bytes::copy_from_slice(frame)));
                Step::Kept
            }
        }
    }

    fn run(&mut self, f: Option<crate::proxy::intercept::WatchFuture>) -> Step {
        let kept = match std::mem::replace(&mut self.hold, Hold::Off) {
            Hold::Collecting { kept, .. } | Hold::Waiting { kept } => kept,
            Hold::Off => Vec::new(),
        };
        match f {
            Some(f) => {
                self.hold = Hold::Waiting { kept };
                Step::Run(f)
            }
            None => {
                self.hold = Hold::Waiting { kept };
                Step::Release
            }
        }
    }

    /// Ends the hold: the kept frames, in order, for the client, whether
    /// they ended the stream, and the last `grpc-status` among them.
    pub(super) fn release(&mut self, stream: u32) -> Released {
        let kept = match std::mem::replace(&mut self.hold, Hold::Off) {
            Hold::Collecting { kept, .. } | Hold::Waiting { kept } => kept,
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

impl State {
    /// Acts on a watched call's [`Step`] for a reply frame or block.
    pub(super) fn watch_step(&mut self, stream: u32, step: Step, out: Out<'_>) {
        match step {
            Step::Pass | Step::Kept => {}
            // Linking a blob containerd has committed.
            Step::Run(f) => self.detach(f, move |_| Outcome::Watch { stream }),
            Step::Release => self.watch_release(stream, out),
        }
    }

    /// Sends on what a watched call's hold kept.
    pub(super) fn watch_release(&mut self, stream: u32, out: Out<'_>) {
        let Some(w) = self.calls.get_mut(&stream).and_then(|c| c.watch.as_mut()) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend((body.len() as u32).to_be_bytes());
        m.extend(body);
        m
    }

    fn heads(data: &[u8], cut: &[usize], max: usize) -> Vec<(Vec<u8>, usize)> {
        let mut m = Messages::default();
        let mut seen = Vec::new();
        let mut at = 0;
        for &c in cut.iter().chain([&data.len()]) {
            m.feed(&data[at..c], max, |h| seen.push((h.bytes.to_vec(), h.len)));
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
            (b"first".to_vec(), 5),
            (vec![7; 1024], 3000),
            (Vec::new(), 0),
            (b"last".to_vec(), 4),
        ];
        assert_eq!(heads(&data, &[], 1024), want);
        for cut in 0..data.len() {
            assert_eq!(heads(&data, &[cut], 1024), want, "cut at {cut}");
        }
        let every: Vec<usize> = (1..data.len()).collect();
        assert_eq!(heads(&data, &every, 1024), want);
    }
}
