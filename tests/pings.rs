//! A client's PINGs through imgbridge get what containerd would give them
//! directly: held replies released late must not earn the client
//! `GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings")`.
//!
//! Why it could: containerd (grpc-go) counts a strike for a client PING
//! that arrives when it has written no HEADERS/DATA since the last one, and
//! closes the connection after the third. grpc-go clients (ctr, nerdctl,
//! buildkitd) send a BDP PING on the first DATA they receive after their
//! last PING's ACK. A replicated `Images.Create` reply is held until its
//! replica exists: released, its DATA makes the client PING although
//! containerd, which sent it long ago, has been silent.

use std::path::Path;
use std::time::Duration;

use containerd_client::services::v1 as api;
use containerd_client::types::Descriptor;
use imgbridge_test_support::prelude::*;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const SRC: &str = "buildkit";
const CREATE: &str = "/containerd.services.images.v1.Images/Create";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// The payload of grpc-go's BDP PINGs (`internal/transport/bdp_estimator.go`).
const BDP: [u8; 8] = [2, 4, 16, 16, 9, 14, 7, 7];

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// What a connection came to.
#[derive(Debug, Default)]
struct Seen {
    /// Calls answered OK.
    ok: usize,
    /// How the others ended.
    failed: Vec<String>,
    /// BDP PINGs the client sent, and ACKs it got for them.
    pings: usize,
    acks: usize,
    /// (error code, debug data) of each GOAWAY the client got.
    goaways: Vec<(u32, String)>,
}

/// A gRPC client on one HTTP/2 connection that PINGs as grpc-go's
/// transport does: a BDP PING on the first DATA frame after the ACK of the
/// last one (`http2_client.go` `handleData`, `bdpEstimator.add`).
///
/// Written at the frame level because no peer the tests build (ctr,
/// nerdctl, buildkitd) makes many concurrent `Images.Create` calls on one
/// connection, and hyper's adaptive window (tonic) PINGs ever more rarely
/// as its estimate settles, which made the fault show on some containerd
/// versions only. Everything else it sends is what grpc-go sends.
struct BdpClient {
    sock: UnixStream,
    /// containerd's header blocks, decoded in order (its encoder indexes).
    dec: loona_hpack::Decoder<'static>,
    next_stream: u32,
    /// A BDP PING is out, unanswered.
    pinged: bool,
    /// A header block spanning CONTINUATION frames, and whether it ends
    /// its stream.
    block: Vec<u8>,
    block_ends: bool,
    seen: Seen,
}

impl BdpClient {
    async fn connect(sock: &Path) -> BdpClient {
        let mut sock = UnixStream::connect(sock).await.unwrap();
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        // As grpc-go: a large connection window, so replies never wait.
        hello.extend(frame(WINDOW_UPDATE, 0, 0, &(1u32 << 30).to_be_bytes()));
        sock.write_all(&hello).await.unwrap();
        BdpClient {
            sock,
            dec: loona_hpack::Decoder::new(),
            next_stream: 1,
            pinged: false,
            block: Vec::new(),
            block_ends: false,
            seen: Seen::default(),
        }
    }

    /// `n` concurrent creates of new names for `target`, answered (or the
    /// connection ended).
    async fn creates(&mut self, names: &str, target: &Descriptor, n: usize) {
        let mut enc = loona_hpack::Encoder::new();
        let mut out = Vec::new();
        for i in 0..n {
            let stream = self.next_stream;
            self.next_stream += 2;
            let fields: [(&[u8], &[u8]); 7] = [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", CREATE.as_bytes()),
                (b":authority", b"localhost"),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
                (b"containerd-namespace", SRC.as_bytes()),
            ];
            out.extend(frame(HEADERS, END_HEADERS, stream, &enc.encode(fields)));
            let msg = api::CreateImageRequest {
                image: Some(api::Image {
                    name: format!("{names}-{i}:1"),
                    target: Some(target.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            }
            .encode_to_vec();
            let mut body = vec![0];
            body.extend((msg.len() as u32).to_be_bytes());
            body.extend(msg);
            out.extend(frame(DATA, END_STREAM, stream, &body));
        }
        self.sock.write_all(&out).await.unwrap();
        let want = self.seen.ok + self.seen.failed.len() + n;
        while self.seen.ok + self.seen.failed.len() < want {
            let read = tokio::time::timeout(Duration::from_secs(120), self.frame()).await;
            if !read.expect("containerd answers within 2 minutes") {
                let left = want - self.seen.ok - self.seen.failed.len();
                self.seen
                    .failed
                    .push(format!("{left} calls: connection closed"));
                return;
            }
        }
    }

    /// Reads and handles one frame; `false` once the connection is closed.
    async fn frame(&mut self) -> bool {
        let mut h = [0u8; 9];
        if self.sock.read_exact(&mut h).await.is_err() {
            return false;
        }
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
        let mut p = vec![0; len];
        if self.sock.read_exact(&mut p).await.is_err() {
            return false;
        }
        let mut reply = Vec::new();
        match kind {
            DATA if !self.pinged => {
                self.pinged = true;
                self.seen.pings += 1;
                reply.extend(frame(PING, 0, 0, &BDP));
            }
            HEADERS | CONTINUATION => {
                if kind == HEADERS {
                    self.block_ends = flags & END_STREAM != 0;
                }
                self.block.extend(&p);
                if flags & END_HEADERS != 0 {
                    let fields = self.dec.decode(&std::mem::take(&mut self.block)).unwrap();
                    if self.block_ends {
                        self.trailers(stream, &fields);
                    }
                }
            }
            SETTINGS if flags & ACK == 0 => reply.extend(frame(SETTINGS, ACK, 0, &[])),
            PING if flags & ACK == 0 => reply.extend(frame(PING, ACK, 0, &p)),
            PING if p == BDP => {
                self.pinged = false;
                self.seen.acks += 1;
            }
            RST_STREAM => (self.seen.failed).push(format!("stream {stream} reset: {p:?}")),
            GOAWAY if p.len() >= 8 => {
                let code = u32::from_be_bytes([p[4], p[5], p[6], p[7]]);
                let debug = String::from_utf8_lossy(&p[8..]).into_owned();
                self.seen.goaways.push((code, debug));
            }
            _ => {}
        }
        if !reply.is_empty() && self.sock.write_all(&reply).await.is_err() {
            return false;
        }
        true
    }

    /// A block that may end a call: its `grpc-status` says how.
    fn trailers(&mut self, stream: u32, fields: &[(Vec<u8>, Vec<u8>)]) {
        let field = |n: &[u8]| {
            (fields.iter())
                .find(|(k, _)| k == n)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        match field(b"grpc-status").as_deref() {
            Some("0") => self.seen.ok += 1,
            Some(code) => (self.seen.failed).push(format!(
                "stream {stream}: {code} {}",
                field(b"grpc-message").unwrap_or_default()
            )),
            None => {}
        }
    }
}

/// Rounds of concurrent creates per connection, and calls per round.
const ROUNDS: usize = 2;
const CALLS: usize = 200;

/// `ROUNDS` rounds of `CALLS` concurrent `Images.Create` in the source
/// namespace, all on one connection to `sock`.
async fn creates(sock: &Path, target: &Descriptor) -> Seen {
    let mut client = BdpClient::connect(sock).await;
    let base = unique_name("ping");
    for round in 0..ROUNDS {
        client
            .creates(&format!("{base}-{round}"), target, CALLS)
            .await;
        if !client.seen.goaways.is_empty() {
            break;
        }
    }
    client.seen
}

/// The image every create names, in the source namespace.
async fn source(c: &Containerd) -> Descriptor {
    let img = TestImage::hello("pings:1");
    ctr_import(c.socket(), SRC, &img.docker_archive());
    image_target(c.socket(), SRC, &img.normalized()).await
}

fn check(seen: &Seen) {
    eprintln!(
        "ok {}, failed {}, BDP PINGs {}, ACKs {}, GOAWAYs {:?}",
        seen.ok,
        seen.failed.len(),
        seen.pings,
        seen.acks,
        seen.goaways
    );
    assert!(
        seen.goaways.is_empty(),
        "the client was sent GOAWAY: {:?}",
        seen.goaways
    );
    let first: Vec<_> = seen.failed.iter().take(3).collect();
    assert!(seen.failed.is_empty(), "calls failed, the first: {first:?}");
    assert_eq!(seen.ok, ROUNDS * CALLS);
    assert!(
        seen.pings > 3,
        "only {} PINGs: this test shows nothing",
        seen.pings
    );
}

/// The baseline: the same client straight to containerd is never sent
/// away (its PINGs follow DATA containerd has just written).
#[tokio::test]
async fn bdp_pings_straight_to_containerd_are_never_too_many() {
    let c = Scenario::cri().containerd();
    let target = source(&c).await;
    check(&creates(c.socket(), &target).await);
}

/// Through imgbridge every create is held until its replica exists and
/// released later: the client's PINGs on those releases must not add up to
/// containerd's GOAWAY.
#[tokio::test]
async fn bdp_pings_on_released_replies_do_not_get_the_client_sent_away() {
    let metrics = format!("127.0.0.1:{}", free_port());
    let (c, p) = Scenario::cri()
        .args(&["--metrics-listen", &metrics])
        .start();
    let target = source(&c).await;
    check(&creates(p.socket(), &target).await);
    let text = http_get(&metrics, "/metrics").expect("/metrics");
    let answered = text
        .lines()
        .find_map(|l| l.strip_prefix("imgbridge_pings_answered_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        answered > 0,
        "imgbridge answered no PING itself (imgbridge_pings_answered_total): {text}"
    );
}
