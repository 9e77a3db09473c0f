//! HTTP/2 wire pieces the splice needs (RFC 9113 §4, §6): frame headers,
//! padding and priority fields, and the few frames it writes itself.

use bytes::{BufMut, Bytes, BytesMut};

/// What every HTTP/2 connection starts with, client to server.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const HEADER_LEN: usize = 9;
/// Largest frame payload the protocol allows (SETTINGS_MAX_FRAME_SIZE cap).
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Frames imgbridge writes itself stay at the size every peer must accept,
/// so their size never depends on SETTINGS.
pub const EMIT_PAYLOAD: usize = 16_384;

/// Largest header block (metadata), as containerd accepts.
pub(super) const MAX_BLOCK: usize = 16 << 20;

/// Most CONTINUATION frames one header block may have. Empty ones add no
/// bytes, so [`MAX_BLOCK`] alone would not bound a flood of them: each
/// costs the splice a pass, and the block holds the connection open.
///
/// The count is the largest block over the smallest frame size every peer
/// must accept (16,384 bytes): senders fill their header frames, and
/// grpc-go (containerd, and most clients) splits header blocks at 16 KiB
/// whatever SETTINGS_MAX_FRAME_SIZE allows, so a count derived from a
/// larger negotiated frame size would cut off a legitimate large block.
/// Plus 8 for frames that are not full: an encoder may close a block with
/// an empty CONTINUATION carrying END_HEADERS after one it filled exactly,
/// and a few partial frames are no flood. A flood is cut after 1,032
/// frames (about 9 KiB of frame headers).
pub(super) const MAX_CONTINUATIONS: usize = MAX_BLOCK / EMIT_PAYLOAD + 8;

/// A frame's type (RFC 9113 §6). The splice acts on a few and relays the
/// rest; a type it does not know (an extension, RFC 9113 §5.5) is relayed
/// untouched as `Other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Data,
    Headers,
    Priority,
    RstStream,
    Settings,
    PushPromise,
    Ping,
    GoAway,
    WindowUpdate,
    Continuation,
    Other(u8),
}

impl Kind {
    pub fn from_wire(b: u8) -> Kind {
        match b {
            0x0 => Kind::Data,
            0x1 => Kind::Headers,
            0x2 => Kind::Priority,
            0x3 => Kind::RstStream,
            0x4 => Kind::Settings,
            0x5 => Kind::PushPromise,
            0x6 => Kind::Ping,
            0x7 => Kind::GoAway,
            0x8 => Kind::WindowUpdate,
            0x9 => Kind::Continuation,
            other => Kind::Other(other),
        }
    }

    pub fn wire(self) -> u8 {
        match self {
            Kind::Data => 0x0,
            Kind::Headers => 0x1,
            Kind::Priority => 0x2,
            Kind::RstStream => 0x3,
            Kind::Settings => 0x4,
            Kind::PushPromise => 0x5,
            Kind::Ping => 0x6,
            Kind::GoAway => 0x7,
            Kind::WindowUpdate => 0x8,
            Kind::Continuation => 0x9,
            Kind::Other(b) => b,
        }
    }
}

/// The RFC's name, for errors that name a frame.
impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Kind::Data => "DATA",
            Kind::Headers => "HEADERS",
            Kind::Priority => "PRIORITY",
            Kind::RstStream => "RST_STREAM",
            Kind::Settings => "SETTINGS",
            Kind::PushPromise => "PUSH_PROMISE",
            Kind::Ping => "PING",
            Kind::GoAway => "GOAWAY",
            Kind::WindowUpdate => "WINDOW_UPDATE",
            Kind::Continuation => "CONTINUATION",
            Kind::Other(b) => return write!(f, "{b:#x}"),
        };
        f.write_str(name)
    }
}

pub const END_STREAM: u8 = 0x1;
/// On SETTINGS and PING (the same bit as END_STREAM).
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;

/// An error code of RST_STREAM and GOAWAY (RFC 9113 §7): the ones the
/// splice sends itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reason(pub u32);

impl Reason {
    pub const NO_ERROR: Reason = Reason(0x0);
    pub const REFUSED_STREAM: Reason = Reason(0x7);
    pub const CANCEL: Reason = Reason(0x8);
    pub const COMPRESSION_ERROR: Reason = Reason(0x9);
}

/// A stream's id (31 bits; 0 is the connection itself). A type of its own
/// so that an id is never mistaken for a length, a count or a code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(u32);

impl StreamId {
    /// The connection (SETTINGS, PING, GOAWAY, connection WINDOW_UPDATE).
    pub const ZERO: StreamId = StreamId(0);
    /// The largest id (GOAWAY's "any stream").
    pub const MAX: StreamId = StreamId(0x7fff_ffff);

    /// The id on the wire: the reserved top bit is dropped.
    pub const fn new(id: u32) -> StreamId {
        StreamId(id & 0x7fff_ffff)
    }

    pub const fn get(self) -> u32 {
        self.0
    }

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }
}

impl From<u32> for StreamId {
    fn from(id: u32) -> StreamId {
        StreamId::new(id)
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A parsed 9-byte frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub len: usize,
    pub kind: Kind,
    pub flags: u8,
    pub stream: StreamId,
}

impl Head {
    pub fn parse(b: &[u8]) -> Head {
        Head {
            len: (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize,
            kind: Kind::from_wire(b[3]),
            flags: b[4],
            stream: StreamId::new(u32::from_be_bytes([b[5], b[6], b[7], b[8]])),
        }
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// The frame's payload was shorter than its padding or priority fields say.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("padding or priority fields overrun the {0}-byte payload")]
pub struct BadPadding(pub usize);

/// The content of a DATA or HEADERS payload: without the pad length byte,
/// the priority fields (HEADERS) and the padding.
pub fn content(head: &Head, payload: &[u8]) -> Result<std::ops::Range<usize>, BadPadding> {
    let mut start = 0;
    let mut pad = 0;
    if head.has(PADDED) {
        pad = *payload.first().ok_or(BadPadding(payload.len()))? as usize;
        start = 1;
    }
    if head.kind == Kind::Headers && head.has(PRIORITY) {
        start += 5;
    }
    let end = payload
        .len()
        .checked_sub(pad)
        .filter(|&e| e >= start)
        .ok_or(BadPadding(payload.len()))?;
    Ok(start..end)
}

/// A frame header, for frames the splice writes itself.
pub(super) fn put_head(out: &mut BytesMut, len: usize, kind: Kind, flags: u8, stream: StreamId) {
    out.put_uint(len as u64, 3);
    out.put_u8(kind.wire());
    out.put_u8(flags);
    out.put_u32(stream.get());
}

/// WINDOW_UPDATE frames returning `n` bytes of credit (none when `n` is 0).
pub fn window_update(stream: StreamId, mut n: u64) -> Option<Bytes> {
    if n == 0 {
        return None;
    }
    let mut out = BytesMut::new();
    while n > 0 {
        let step = n.min(0x7fff_ffff);
        put_head(&mut out, 4, Kind::WindowUpdate, 0, stream);
        out.put_u32(step as u32);
        n -= step;
    }
    Some(out.freeze())
}

pub fn rst_stream(stream: StreamId, code: Reason) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + 4);
    put_head(&mut out, 4, Kind::RstStream, 0, stream);
    out.put_u32(code.0);
    out.freeze()
}

pub fn goaway(last_stream: StreamId, code: Reason) -> Bytes {
    goaway_saying(last_stream, code, "")
}

/// GOAWAY with debug data: a reason the peer's HTTP/2 library logs.
pub fn goaway_saying(last_stream: StreamId, code: Reason, debug: &str) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + 8 + debug.len());
    put_head(&mut out, 8 + debug.len(), Kind::GoAway, 0, StreamId::ZERO);
    out.put_u32(last_stream.get());
    out.put_u32(code.0);
    out.put_slice(debug.as_bytes());
    out.freeze()
}

/// A HEADERS frame plus as many CONTINUATION frames as `block` needs.
pub fn headers(stream: StreamId, block: &[u8], end_stream: bool, out: &mut BytesMut) {
    let first = if end_stream { END_STREAM } else { 0 };
    chunked(
        out,
        stream,
        block,
        [Kind::Headers, Kind::Continuation],
        first,
        END_HEADERS,
    );
}

/// `payload` in frames of at most [`EMIT_PAYLOAD`] (at least one frame, so
/// the flags always have a frame to ride on): `kinds` are the first and the
/// following frames' types; `first` flags go on the first, `last` on the last.
fn chunked(
    out: &mut BytesMut,
    stream: StreamId,
    payload: &[u8],
    kinds: [Kind; 2],
    first: u8,
    last: u8,
) {
    let n = payload.len().div_ceil(EMIT_PAYLOAD).max(1);
    for i in 0..n {
        let chunk = &payload
            [(i * EMIT_PAYLOAD).min(payload.len())..((i + 1) * EMIT_PAYLOAD).min(payload.len())];
        let mut flags = if i == 0 { first } else { 0 };
        if i + 1 == n {
            flags |= last;
        }
        put_head(out, chunk.len(), kinds[(i > 0) as usize], flags, stream);
        out.put_slice(chunk);
    }
}

/// The HEADERS (+ CONTINUATION) frames of a block that `fill` encodes
/// straight into `out` behind a placeholder frame header; only a block that
/// outgrows one frame is copied to be split.
pub fn header_frames<R>(
    stream: StreamId,
    end_stream: bool,
    out: &mut BytesMut,
    fill: impl FnOnce(&mut BytesMut) -> R,
) -> R {
    let start = out.len();
    put_head(out, 0, Kind::Headers, 0, stream);
    let r = fill(out);
    let len = out.len() - start - HEADER_LEN;
    if len <= EMIT_PAYLOAD {
        out[start..start + 3].copy_from_slice(&(len as u32).to_be_bytes()[1..]);
        out[start + 4] = END_HEADERS | if end_stream { END_STREAM } else { 0 };
    } else {
        let block = out.split_off(start + HEADER_LEN);
        out.truncate(start);
        headers(stream, &block, end_stream, out);
    }
    r
}

/// DATA frames carrying `payload` (at least one frame, so END_STREAM fits).
pub fn data(stream: StreamId, payload: &[u8], end_stream: bool, out: &mut BytesMut) {
    let last = if end_stream { END_STREAM } else { 0 };
    chunked(out, stream, payload, [Kind::Data, Kind::Data], 0, last);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(block: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        loona_hpack::Decoder::new().decode(block).unwrap()
    }

    #[test]
    fn large_blocks_span_continuation_frames() {
        let block = vec![7u8; EMIT_PAYLOAD * 2 + 5];
        let mut out = BytesMut::new();
        headers(StreamId::new(3), &block, true, &mut out);
        let h1 = Head::parse(&out[..9]);
        assert_eq!(
            (h1.kind, h1.len, h1.flags),
            (Kind::Headers, EMIT_PAYLOAD, END_STREAM)
        );
        let h2 = Head::parse(&out[9 + EMIT_PAYLOAD..]);
        assert_eq!(
            (h2.kind, h2.flags, h2.stream),
            (Kind::Continuation, 0, StreamId::new(3))
        );
        let h3 = Head::parse(&out[18 + 2 * EMIT_PAYLOAD..]);
        assert_eq!(
            (h3.kind, h3.len, h3.flags),
            (Kind::Continuation, 5, END_HEADERS)
        );
        assert_eq!(out.len(), 27 + block.len());
    }

    #[test]
    fn header_frames_patch_small_blocks_and_split_large_ones() {
        let mut small = BytesMut::new();
        header_frames(StreamId::new(5), true, &mut small, |b| {
            super::super::hpack::encode_field(b, b":status", b"200")
        });
        assert_eq!(
            Head::parse(&small),
            Head {
                len: 1,
                kind: Kind::Headers,
                flags: END_HEADERS | END_STREAM,
                stream: StreamId::new(5)
            }
        );
        assert_eq!(&small[9..], &[0x88]);
        let value = vec![b'v'; EMIT_PAYLOAD];
        let mut large = BytesMut::from(&b"prefix"[..]);
        header_frames(StreamId::new(7), false, &mut large, |b| {
            super::super::hpack::encode_field(b, b"x", &value)
        });
        let mut direct = BytesMut::from(&b"prefix"[..]);
        let mut block = BytesMut::new();
        super::super::hpack::encode_field(&mut block, b"x", &value);
        headers(StreamId::new(7), &block, false, &mut direct);
        assert_eq!(large, direct);
    }

    #[test]
    fn padding_and_priority_are_stripped() {
        let head = Head {
            len: 10,
            kind: Kind::Headers,
            flags: PADDED | PRIORITY,
            stream: StreamId::new(1),
        };
        let payload = [2, 0, 0, 0, 0, 9, b'a', b'b', 0, 0];
        assert_eq!(content(&head, &payload), Ok(6..8));
        let bad = Head {
            len: 2,
            kind: Kind::Data,
            flags: PADDED,
            stream: StreamId::new(1),
        };
        assert_eq!(content(&bad, &[5, 1]), Err(BadPadding(2)));
        assert_eq!(content(&bad, &[]), Err(BadPadding(0)));
    }

    #[test]
    fn control_frames() {
        assert!(window_update(StreamId::ZERO, 0).is_none());
        let w = window_update(StreamId::ZERO, (1 << 31) + 5).unwrap();
        assert_eq!(w.len(), 26);
        assert_eq!(
            Head::parse(&rst_stream(StreamId::new(5), Reason::CANCEL)).kind,
            Kind::RstStream
        );
        let g = goaway(StreamId::new(9), Reason::NO_ERROR);
        assert_eq!(&g[9..13], &9u32.to_be_bytes());
        let mut d = BytesMut::new();
        data(StreamId::new(1), &[], true, &mut d);
        assert_eq!(Head::parse(&d).flags, END_STREAM);
        assert_eq!(
            decode(&[0x88]),
            vec![(b":status".to_vec(), b"200".to_vec())]
        );
    }
}
