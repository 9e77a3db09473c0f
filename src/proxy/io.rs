//! Socket wrapper that turns many small HTTP/2 reads and writes into few
//! system calls.
//!
//! On the hosts this runs on a system call, and above all the wake-up it
//! causes in the peer (containerd or the client), costs far more than
//! copying a few kilobytes. h2 on a bare socket reads about 8 KiB at a time
//! and flushes whenever one of its tasks has queued something: a unary call
//! cost two writes to containerd (HEADERS, then DATA once the request body
//! got send capacity, one task later), the PING ack went out before the
//! reply was relayed, and a Content.Read took two `recv`s per 16 KiB frame.
//!
//! [`Coalesce`] reads into its own buffer (one `recv` for up to its size)
//! and collects writes in a bounded buffer that a flush writes out at once.
//! With [`FlushMode::EndOfTick`] the first flush after a write is postponed
//! until the runtime has run everything else that is ready (the task is woken
//! again the way `tokio::task::yield_now` does it), so frames queued by other
//! tasks meanwhile share the system call. Nothing waits on a timer and
//! nothing is held once the runtime would otherwise go idle.
//!
//! Backpressure is unchanged: a full write buffer makes `poll_write` wait for
//! the socket, as the socket itself would.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// When a flush reaches the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushMode {
    /// At once: everything queued in the same task poll goes in one write.
    Immediate,
    /// After the other ready tasks ran, so their frames join the write.
    EndOfTick,
}

/// A buffered, flush-coalescing byte stream.
#[derive(Debug)]
pub struct Coalesce<T> {
    io: T,
    rbuf: Box<[u8]>,
    rpos: usize,
    rlen: usize,
    wbuf: Vec<u8>,
    wcap: usize,
    /// Bytes at the front of `wbuf` already written.
    wpos: usize,
    flush_deferred: bool,
    mode: FlushMode,
}

impl<T> Coalesce<T> {
    /// `rbuf`, `wbuf`: buffer sizes in bytes; 0 passes that side through.
    pub fn new(io: T, rbuf: usize, wbuf: usize, mode: FlushMode) -> Self {
        Coalesce {
            io,
            rbuf: vec![0; rbuf].into_boxed_slice(),
            rpos: 0,
            rlen: 0,
            wbuf: Vec::new(),
            wcap: wbuf,
            wpos: 0,
            flush_deferred: false,
            mode,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncWrite + Unpin> Coalesce<T> {
    /// Writes buffered bytes until all are out or the socket is full.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.wpos < self.wbuf.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.wpos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.wpos += n;
        }
        self.wbuf.clear();
        self.wpos = 0;
        Poll::Ready(Ok(()))
    }

    /// Makes room in a full buffer. `Ready(false)`: nothing is buffered and
    /// `want` bytes are a buffer's worth or more, so write them directly.
    fn poll_room(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<bool>> {
        if self.wcap == 0 {
            return Poll::Ready(Ok(false));
        }
        if self.wbuf.len() >= self.wcap {
            ready!(self.poll_drain(cx))?;
        }
        Poll::Ready(Ok(!(self.wbuf.is_empty() && want >= self.wcap)))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesce<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.rpos == me.rlen {
            if buf.remaining() >= me.rbuf.len() {
                return Pin::new(&mut me.io).poll_read(cx, buf);
            }
            let mut rb = ReadBuf::new(&mut me.rbuf);
            ready!(Pin::new(&mut me.io).poll_read(cx, &mut rb))?;
            me.rpos = 0;
            me.rlen = rb.filled().len();
        }
        let n = buf.remaining().min(me.rlen - me.rpos);
        buf.put_slice(&me.rbuf[me.rpos..me.rpos + n]);
        me.rpos += n;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesce<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if !ready!(me.poll_room(cx, data.len()))? {
            return Pin::new(&mut me.io).poll_write(cx, data);
        }
        let n = data.len().min(me.wcap - me.wbuf.len());
        me.wbuf.extend_from_slice(&data[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let total = bufs.iter().map(|b| b.len()).sum();
        if !ready!(me.poll_room(cx, total))? {
            return Pin::new(&mut me.io).poll_write_vectored(cx, bufs);
        }
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(me.wcap - me.wbuf.len());
            me.wbuf.extend_from_slice(&b[..take]);
            n += take;
            if take < b.len() {
                break;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.wbuf.is_empty() {
            me.flush_deferred = false;
            return Pin::new(&mut me.io).poll_flush(cx);
        }
        if me.mode == FlushMode::EndOfTick && !me.flush_deferred {
            // Report success now and do the write when the task is polled
            // again, after the tasks this burst woke have queued theirs. h2
            // flushes at the end of every poll of its connection, so the
            // buffer is written then (or sooner, if it fills up).
            me.flush_deferred = true;
            let _ = std::pin::pin!(tokio::task::yield_now()).poll(cx);
            return Poll::Ready(Ok(()));
        }
        ready!(me.poll_drain(cx))?;
        me.flush_deferred = false;
        Pin::new(&mut me.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn data() -> Vec<u8> {
        (0..10_000u32).map(|i| (i * 7) as u8).collect()
    }

    #[tokio::test]
    async fn writes_arrive_in_order_and_flushes_complete() {
        for mode in [FlushMode::Immediate, FlushMode::EndOfTick] {
            for (wbuf, chunk) in [(0, 37), (100, 37), (100, 250), (64 << 10, 999)] {
                let (a, mut b) = tokio::io::duplex(1 << 20);
                let mut w = Coalesce::new(a, 0, wbuf, mode);
                let data = data();
                for c in data.chunks(chunk) {
                    w.write_all(c).await.unwrap();
                    w.flush().await.unwrap();
                }
                // A deferred flush is done by the next flush at the latest.
                w.flush().await.unwrap();
                drop(w);
                let mut got = Vec::new();
                b.read_to_end(&mut got).await.unwrap();
                assert_eq!(got, data, "{mode:?} wbuf={wbuf} chunk={chunk}");
            }
        }
    }

    #[tokio::test]
    async fn deferred_flush_writes_on_the_next_poll() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut w = Coalesce::new(a, 0, 1024, FlushMode::EndOfTick);
        w.write_all(b"abc").await.unwrap();
        w.flush().await.unwrap(); // deferred: nothing on the wire yet
        let mut buf = [0u8; 8];
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), b.read(&mut buf))
                .await
                .is_err()
        );
        w.flush().await.unwrap();
        assert_eq!(b.read(&mut buf).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn reads_survive_any_buffer_size() {
        for rbuf in [0, 1, 64, 4096] {
            let (mut a, b) = tokio::io::duplex(1 << 20);
            let data = data();
            a.write_all(&data).await.unwrap();
            drop(a);
            let mut r = Coalesce::new(b, rbuf, 0, FlushMode::Immediate);
            let mut got = Vec::new();
            let mut small = [0u8; 10];
            let n = r.read(&mut small).await.unwrap();
            got.extend_from_slice(&small[..n]);
            r.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, data, "rbuf={rbuf}");
        }
    }

    #[tokio::test]
    async fn full_buffer_waits_for_the_socket() {
        // A 16-byte pipe and a 32-byte buffer: writes must stall, not grow.
        let (a, mut b) = tokio::io::duplex(16);
        let mut w = Coalesce::new(a, 0, 32, FlushMode::Immediate);
        let r = tokio::time::timeout(
            std::time::Duration::from_millis(20),
            w.write_all(&[1u8; 100]),
        )
        .await;
        assert!(
            r.is_err(),
            "write of 100 bytes into 16+32 bytes of room finished"
        );
        assert!(w.wbuf.len() <= 32);
        let mut sink = [0u8; 100];
        b.read_exact(&mut sink[..16]).await.unwrap();
    }
}
