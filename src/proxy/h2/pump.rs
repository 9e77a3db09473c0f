//! One direction of the splice: bytes read from one peer become whole frames
//! (first "is a whole frame here?", then "what is it?"), and go out to the
//! other peer with one vectored write, straight from the read buffer
//! wherever the splice does not change them.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Mutex;
use std::task::{ready, Context, Poll};

use bytes::Bytes;

use super::error::{malformed, SpliceError};
use super::frame::{self, Head, Kind, HEADER_LEN};
use super::headers::Block;
use super::side::{Out, Side};
use super::streams::State;
use super::verdict::Verdict;
use crate::lock::lock;
use crate::proxy::sock::Sock;

/// Read buffer per direction; as large as the floor relay's.
const BUF: usize = 256 << 10;

/// Read buffers no direction holds: a direction takes one when it reads and
/// gives it back when everything read has been written, so an idle
/// connection holds none (2 × 256 KiB each was most of what 2500 idle
/// connections cost, docs/performance.md). Kept instead of freed because a fresh
/// buffer must be zeroed: without spares (`scripts/bench.sh`, one run) a
/// unary call cost 36.5 µs of CPU instead of 15.4, +66 µs over direct
/// containerd instead of +31. A plain `Mutex<Vec>`: locked twice per call
/// per direction, uncontended.
static SPARE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// Most buffers [`SPARE`] keeps (2 MiB): the rest go back to the allocator,
/// which returns them to the system (see `main.rs`).
const SPARE_MAX: usize = 8;

fn take_buf() -> Vec<u8> {
    let spare = lock(&SPARE).pop();
    spare.unwrap_or_else(|| vec![0; BUF])
}

fn give_buf(buf: Vec<u8>) {
    if buf.len() != BUF {
        return; // grown for a big frame, or never taken
    }
    let mut spare = lock(&SPARE);
    if spare.len() < SPARE_MAX {
        spare.push(buf);
    }
}

/// One direction: reads frames from one peer and writes them to the other.
pub(super) struct Pump {
    from: Side,
    /// Empty while nothing read waits in it (see [`SPARE`]).
    buf: Vec<u8>,
    /// `buf[..scan]` is classified (written, or queued in `segs`).
    pub(super) scan: usize,
    /// `buf[scan..end]` has been read but not classified.
    pub(super) end: usize,
    /// Payload bytes of a passed-through frame that are still to come.
    pub(super) skip: usize,
    /// Bytes a whole frame needs from `scan` before it can be classified.
    want: usize,
    /// Output in order, written with one vectored write.
    segs: VecDeque<Seg>,
    /// Frames from elsewhere (the other direction, hook results), written at
    /// the next frame boundary.
    pub(super) inject: VecDeque<Bytes>,
    /// Frames [`State::frame`](super::streams::State::frame) puts in place of the one it was given; kept
    /// (empty) between frames so that a reply costs no allocation.
    emit: VecDeque<Bytes>,
    /// A header block that spans CONTINUATION frames.
    pub(super) block: Option<Block>,
    /// containerd's header frames (start, length in `buf`) that are written
    /// before they are decoded: see [`Pump::settle`].
    deferred: Vec<(usize, usize)>,
    preface: bool,
    /// The reader hung up (or, for containerd's direction, is lost: see
    /// `Conn::lose`). The client direction's is the one record of the
    /// client closing its side.
    pub(super) eof: bool,
    done: bool,
}

enum Seg {
    Buf(usize, usize),
    Own(Bytes),
}

impl Pump {
    pub(super) fn new(from: Side) -> Pump {
        Pump {
            from,
            buf: Vec::new(),
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
        self.from.other()
    }

    pub(super) fn idle(&self) -> bool {
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
    pub(super) fn settle(&mut self, st: &mut State) -> Result<(), SpliceError> {
        for (start, total) in self.deferred.drain(..) {
            let frame = &self.buf[start..start + total];
            let head = Head::parse(frame);
            let payload = &frame[HEADER_LEN..];
            let r = frame::content(&head, payload).map_err(|e| malformed(self.from, e))?;
            st.passed_headers(head.stream, head.has(frame::END_STREAM), &payload[r])?;
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
    /// rest through [`State::frame`](super::streams::State::frame).
    fn classify(&mut self, other: &mut VecDeque<Bytes>, st: &mut State) -> Result<(), SpliceError> {
        if self.preface && !self.preface()? {
            return Ok(());
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
            let limit = st.headers.frame_limit(self.from);
            if head.len > limit {
                return Err(SpliceError::FrameTooLarge(self.from, head.len, limit));
            }
            if self.from == Side::Containerd && matches!(head.kind, Kind::Data | Kind::Headers) {
                st.pings.containerd_wrote(); // may run again for the same frame: idempotent
            }
            if self.block.is_some() && head.kind != Kind::Continuation {
                return Err(SpliceError::Malformed(
                    self.from,
                    format!("frame type {} inside a header block", head.kind),
                ));
            }
            if !st.whole(self.from, &head) {
                if self.from == Side::Containerd && head.kind == Kind::Data {
                    if head.has(frame::END_STREAM) {
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
                && head.kind == Kind::Headers
                && head.has(frame::END_HEADERS)
                && !head.stream.is_zero()
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
            self.whole_frame(&head, total, other, st)?;
        }
    }

    /// The client's connection preface: `Ok(false)` while it is not all in.
    fn preface(&mut self) -> Result<bool, SpliceError> {
        if self.end - self.scan < frame::PREFACE.len() {
            self.want = frame::PREFACE.len();
            return Ok(false);
        }
        if &self.buf[self.scan..self.scan + frame::PREFACE.len()] != frame::PREFACE {
            return Err(SpliceError::Preface);
        }
        self.push_buf(self.scan, self.scan + frame::PREFACE.len());
        self.scan += frame::PREFACE.len();
        self.preface = false;
        Ok(true)
    }

    /// A whole frame at `scan` (`total` bytes), through
    /// [`State::frame`](super::streams::State::frame): forwarded or not,
    /// with what it puts in its place.
    fn whole_frame(
        &mut self,
        head: &Head,
        total: usize,
        other: &mut VecDeque<Bytes>,
        st: &mut State,
    ) -> Result<(), SpliceError> {
        let frame = &self.buf[self.scan..self.scan + total];
        let out = match self.from {
            Side::Client => Out {
                up: &mut self.emit,
                down: other,
            },
            Side::Containerd => Out {
                up: other,
                down: &mut self.emit,
            },
        };
        let verdict = st.frame(self.from, head, frame, &mut self.block, out)?;
        if verdict == Verdict::Forward {
            self.push_buf(self.scan, self.scan + total);
        }
        self.segs.extend(self.emit.drain(..).map(Seg::Own));
        self.scan += total;
        Ok(())
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

    /// Ends this direction with `last` after what is queued, reading
    /// nothing more. `false` when a frame or header block is half relayed,
    /// so `last` cannot go out at a frame boundary.
    pub(super) fn end_with(&mut self, last: Bytes) -> bool {
        if self.skip > 0 || self.block.is_some() {
            return false;
        }
        self.segs.extend(self.inject.drain(..).map(Seg::Own));
        self.segs.push_back(Seg::Own(last));
        self.eof = true;
        true
    }

    /// Writes what is queued; ready once it is all written (or failed).
    pub(super) fn flush_queued(&mut self, cx: &mut Context<'_>, dst: &mut Sock) -> Poll<()> {
        self.flush(cx, dst).map(|_| ())
    }

    /// Reads and drops what `src` sends; ready at its end of stream or error.
    pub(super) fn discard(&mut self, cx: &mut Context<'_>, src: &Sock) -> Poll<io::Result<()>> {
        let mut buf = take_buf();
        let r = loop {
            match src.poll_read(cx, &mut buf) {
                Poll::Ready(Ok(0)) => break Poll::Ready(Ok(())),
                Poll::Ready(Ok(_)) => {}
                r => break r.map_ok(|_| ()),
            }
        };
        give_buf(buf);
        r
    }

    /// Room to read at `end`, and for a whole frame from `scan`. Only called
    /// with nothing queued in `segs`, so no range points into `buf`.
    fn make_room(&mut self) {
        if self.scan == self.end {
            self.scan = 0;
            self.end = 0;
        }
        if self.buf.is_empty() {
            self.buf = take_buf();
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
    /// (the reader hung up and everything was written). `client_gone`: the
    /// client closed its side (the client direction's `eof`, the one record
    /// of it), which makes containerd's end of stream the normal end rather
    /// than a loss.
    pub(super) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        src: &mut Sock,
        dst: &mut Sock,
        other: &mut VecDeque<Bytes>,
        st: &mut State,
        client_gone: bool,
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
            if st.phase.is_lost() && self.from == Side::Client {
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
                        // still has space. Without a buffer only frames
                        // of the splice's own are queued: it waits for them.
                        if self.eof || self.end == self.buf.len() {
                            return Ok(false);
                        }
                        match self.fill(cx, src)? {
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
                if self.from == Side::Containerd && !client_gone {
                    if !st.phase.is_lost() {
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
            if self.fill(cx, src)?.is_pending() {
                return Ok(false);
            }
        }
    }

    /// Reads what `src` has into `buf[end..]`; ready with data or its end.
    /// `buf` is not empty (an empty read would look like the end).
    fn fill(&mut self, cx: &mut Context<'_>, src: &Sock) -> Result<Poll<()>, SpliceError> {
        debug_assert!(self.end < self.buf.len(), "no room to read into");
        match src.poll_read(cx, &mut self.buf[self.end..]) {
            Poll::Pending => {
                self.release_buf();
                return Ok(Poll::Pending);
            }
            Poll::Ready(Err(e)) => return Err(SpliceError::Read(self.from, e)),
            Poll::Ready(Ok(0)) => {
                self.eof = true;
                self.release_buf();
            }
            Poll::Ready(Ok(n)) => self.end += n,
        }
        Ok(Poll::Ready(()))
    }

    /// Gives the read buffer back once all it holds has been written: when
    /// the peer has nothing more to send for now, or nothing more at all
    /// (2500 connections closing at once each hold one otherwise).
    fn release_buf(&mut self) {
        if self.scan == self.end && self.segs.is_empty() && self.deferred.is_empty() {
            give_buf(std::mem::take(&mut self.buf));
            self.scan = 0;
            self.end = 0;
        }
    }
}

impl Drop for Pump {
    fn drop(&mut self) {
        give_buf(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::super::frame::{self, Kind};
    use super::super::testing::*;
    use super::super::{Side, SpliceError};
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    use tokio::sync::Notify;

    /// A frame over the SETTINGS_MAX_FRAME_SIZE containerd allows (the
    /// initial 16 384; grpc-go sends none) is the client's fault: named as
    /// such, never as containerd closing the connection.
    #[tokio::test]
    async fn a_frame_over_the_negotiated_size_blames_its_sender() {
        let rules = Rules::new(false, false, Arc::new(Notify::new()));
        let (mut client, _server, task) = start(rules);
        let mut sent = frame::PREFACE.to_vec();
        sent.extend(frame(Kind::Settings, 0, 0, &[]));
        sent.extend(frame(Kind::Data, 0, 1, &vec![0; 16_385]));
        client.write_all(&sent).await.unwrap();
        let r = task.await.unwrap();
        assert!(
            matches!(
                r,
                Err(SpliceError::FrameTooLarge(Side::Client, 16_385, 16_384))
            ),
            "{r:?}"
        );
    }
}
