//! A client's PINGs through imgbridge get what containerd would give them
//! directly: held replies released late must not earn the client
//! `GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings")` (issue 17).
//!
//! Why it could: containerd (grpc-go) counts a strike for a client PING
//! that arrives when it has written no HEADERS/DATA since the last one, and
//! closes the connection after the third. Clients with an adaptive window
//! (grpc-go always; tonic with `http2_adaptive_window`) send a BDP PING on
//! the first DATA after their last PING's ACK. A replicated `Images.Create`
//! reply is held until its replica exists: released, its DATA makes the
//! client PING although containerd, which sent it long ago, has been silent.

mod common;

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use common::*;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::types::Descriptor;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

const SRC: &str = "buildkit";

/// The HTTP/2 frames one direction of a connection carried, as far as this
/// test cares: PINGs and GOAWAYs.
#[derive(Debug, Default)]
struct Frames {
    /// Bytes still to skip before the next frame header (the client
    /// preface, or the rest of a frame's payload).
    skip: usize,
    head: Vec<u8>,
    /// The payload of the frame being read, when it is one kept here.
    keep: Option<(u8, u8, Vec<u8>, usize)>,
    pings: usize,
    ping_acks: usize,
    /// (error code, debug data) of each GOAWAY.
    goaways: Vec<(u32, String)>,
}

impl Frames {
    fn after_preface() -> Frames {
        Frames {
            skip: 24,
            ..Frames::default()
        }
    }

    fn feed(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(b.len());
                self.skip -= n;
                b = &b[n..];
                continue;
            }
            if let Some((kind, flags, payload, len)) = self.keep.as_mut() {
                let n = (*len - payload.len()).min(b.len());
                payload.extend_from_slice(&b[..n]);
                b = &b[n..];
                if payload.len() == *len {
                    let (kind, flags) = (*kind, *flags);
                    let payload = std::mem::take(payload);
                    self.keep = None;
                    self.frame(kind, flags, &payload);
                }
                continue;
            }
            let n = (9 - self.head.len()).min(b.len());
            self.head.extend_from_slice(&b[..n]);
            b = &b[n..];
            if self.head.len() < 9 {
                continue;
            }
            let h = std::mem::take(&mut self.head);
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            if kind == 6 || kind == 7 {
                self.keep = Some((kind, flags, Vec::new(), len));
                if len == 0 {
                    self.keep = None;
                    self.frame(kind, flags, &[]);
                }
            } else {
                self.skip = len;
            }
        }
    }

    fn frame(&mut self, kind: u8, flags: u8, payload: &[u8]) {
        match kind {
            6 if flags & 1 == 1 => self.ping_acks += 1,
            6 => self.pings += 1,
            7 if payload.len() >= 8 => {
                let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                let debug = String::from_utf8_lossy(&payload[8..]).into_owned();
                self.goaways.push((code, debug));
            }
            _ => {}
        }
    }
}

/// Both directions of the client's connection.
#[derive(Debug)]
struct Wire {
    /// What the client read (containerd's frames, or imgbridge's).
    read: Frames,
    /// What the client wrote.
    written: Frames,
}

/// What the client's connection carried, in the end.
#[derive(Debug)]
struct Seen {
    /// PINGs the client sent.
    pings: usize,
    /// PING ACKs it got.
    acks: usize,
    /// (error code, debug data) of each GOAWAY it got.
    goaways: Vec<(u32, String)>,
    /// Connections the channel opened.
    connections: usize,
}

/// The client's socket, noting the frames that cross it.
struct Tapped {
    sock: UnixStream,
    wire: Arc<Mutex<Wire>>,
}

impl AsyncRead for Tapped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.sock).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let read = &buf.filled()[before..];
            self.wire.lock().unwrap().read.feed(read);
        }
        r
    }
}

impl AsyncWrite for Tapped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.sock).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.wire.lock().unwrap().written.feed(&buf[..n]);
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.sock).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.sock).poll_shutdown(cx)
    }
}

/// A tonic channel on `sock` whose client sends BDP PINGs (adaptive
/// window), each connection it opens tapped.
async fn pinging_channel(sock: &Path) -> (Channel, Arc<Mutex<Vec<Arc<Mutex<Wire>>>>>) {
    let wires = Arc::new(Mutex::new(Vec::new()));
    let (path, all) = (sock.to_path_buf(), wires.clone());
    let channel = Endpoint::try_from("http://[::]")
        .unwrap()
        .http2_adaptive_window(true)
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let wire = Arc::new(Mutex::new(Wire {
                read: Frames::default(),
                written: Frames::after_preface(),
            }));
            all.lock().unwrap().push(wire.clone());
            let path = path.clone();
            async move {
                let sock = UnixStream::connect(path).await?;
                Ok::<_, io::Error>(TokioIo::new(Tapped { sock, wire }))
            }
        }))
        .await
        .unwrap();
    (channel, wires)
}

/// `rounds` rounds of `n` concurrent `Images.Create` of new names for
/// `target` in the source namespace, all on one connection. The errors of
/// calls that failed, and what crossed the wire.
async fn creates(sock: &Path, target: &Descriptor, rounds: usize, n: usize) -> (Vec<String>, Seen) {
    let (channel, wires) = pinging_channel(sock).await;
    let base = unique_name("ping");
    let mut errors = Vec::new();
    for round in 0..rounds {
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let mut cl = ImagesClient::new(channel.clone());
                let req = create_image_req(SRC, &format!("{base}-{round}-{i}:1"), target);
                tokio::spawn(async move { cl.create(req).await })
            })
            .collect();
        for c in calls {
            if let Err(e) = c.await.unwrap() {
                errors.push(format!("{}: {}", e.code(), e.message()));
            }
        }
    }
    let wires = wires.lock().unwrap();
    let mut seen = Seen {
        pings: 0,
        acks: 0,
        goaways: Vec::new(),
        connections: wires.len(),
    };
    for w in wires.iter() {
        let w = w.lock().unwrap();
        seen.pings += w.written.pings;
        seen.acks += w.read.ping_acks;
        seen.goaways.extend(w.read.goaways.iter().cloned());
    }
    (errors, seen)
}

const ROUNDS: usize = 3;
const CALLS: usize = 200;

/// The image every create names, in the source namespace.
async fn source(c: &Containerd) -> Descriptor {
    let img = TestImage::hello("pings:1");
    ctr_import(c.socket(), SRC, &img.docker_archive());
    image_target(c.socket(), SRC, &img.normalized()).await
}

fn check(errors: &[String], seen: &Seen) {
    eprintln!("{seen:?}");
    let first: Vec<_> = errors.iter().take(3).collect();
    assert!(
        errors.is_empty(),
        "{} calls failed, the first: {first:?}; {seen:?}",
        errors.len()
    );
    assert!(
        seen.goaways.is_empty(),
        "the client was sent GOAWAY: {:?}",
        seen.goaways
    );
    assert_eq!(seen.connections, 1, "the client had to reconnect");
    assert_eq!(
        seen.acks, seen.pings,
        "every PING the client sent was answered"
    );
}

/// The baseline: the same client, straight to containerd, is never sent
/// away (its PINGs follow DATA containerd has just written).
#[tokio::test]
async fn bdp_pings_straight_to_containerd_are_never_too_many() {
    let c = Scenario::cri().containerd();
    let target = source(&c).await;
    let (errors, seen) = creates(c.socket(), &target, ROUNDS, CALLS).await;
    check(&errors, &seen);
}

/// Through imgbridge every create is held until its replica exists, and
/// released later: the client's PINGs on those releases must not add up to
/// containerd's GOAWAY.
#[tokio::test]
async fn bdp_pings_on_released_replies_do_not_get_the_client_sent_away() {
    let (c, p) = Scenario::cri().start();
    let target = source(&c).await;
    let (errors, seen) = creates(p.socket(), &target, ROUNDS, CALLS).await;
    check(&errors, &seen);
    assert!(
        seen.pings > 3,
        "the client sent only {} PINGs: this test shows nothing",
        seen.pings
    );
}
