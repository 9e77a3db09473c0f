//! What the splice knows of both peers' header compression: the HPACK
//! mirror of each peer's encoder, the SETTINGS that bound their tables and
//! frames, and memos of blocks calls repeat. Every header block is read
//! here; the calls table ([`super::calls`]) only hears what they said.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::error::{hpack_error, SpliceError};
use super::frame::{self, Head, StreamId};
use super::hpack::{self, Decoder};
use super::settings::Advertised;
use super::side::Side;
use crate::proxy::grpc;

/// The HPACK table size every decoder starts with (RFC 7541 §4.2), until
/// SETTINGS allow more.
const INITIAL_TABLE: usize = 4096;

/// Room for the re-encoded header frames of many replies: the space is
/// reclaimed in place once they are written.
const OUT_ARENA: usize = 4096;

/// A header block that spans CONTINUATION frames, gathered until its end.
pub(super) struct Block {
    pub(super) stream: StreamId,
    pub(super) end_stream: bool,
    /// Its frames go out as they came (see [`Headers::mirrored`]).
    pub(super) forward: bool,
    pub(super) bytes: Vec<u8>,
    /// CONTINUATION frames so far (empty ones too).
    pub(super) continuations: usize,
}

/// A request block's `:path` and `containerd-namespace`.
pub(super) type RequestFields = (Option<Arc<str>>, Option<Arc<str>>);

/// Both peers' header compression, and the SETTINGS that bound it.
pub(super) struct Headers {
    pub(super) client_dec: Decoder,
    server_dec: Decoder,
    /// What the client's SETTINGS allow containerd's encoder, and the
    /// other way round.
    client_settings: Advertised,
    server_settings: Advertised,
    /// The client's HPACK table for containerd's blocks is the same as
    /// containerd's: blocks of calls that are neither held nor refused go
    /// out byte for byte.
    mirror: bool,
    /// The last `:path` and namespace seen: calls on a connection mostly
    /// repeat them, and sharing saves an allocation per call.
    seen_path: Option<Arc<str>>,
    seen_namespace: Option<Arc<str>>,
    /// The last request block and what it said (method, namespace).
    pub(super) request_seen: Repeat<(Arc<str>, Option<Arc<str>>)>,
    /// The last passed reply block and its `grpc-status`.
    reply_seen: Repeat<Option<i32>>,
    /// Where containerd's header blocks are re-encoded: each frame is split
    /// off, and the space is reused once the frames are written.
    out: BytesMut,
}

impl Default for Headers {
    fn default() -> Headers {
        Headers {
            client_dec: Decoder::new(INITIAL_TABLE),
            server_dec: Decoder::new(INITIAL_TABLE),
            client_settings: Advertised::default(),
            server_settings: Advertised::default(),
            mirror: true,
            seen_path: None,
            seen_namespace: None,
            request_seen: Repeat::default(),
            reply_seen: Repeat::default(),
            out: BytesMut::with_capacity(OUT_ARENA),
        }
    }
}

impl Headers {
    /// The largest frame `from` may send: what the other side's SETTINGS
    /// allow.
    pub(super) fn frame_limit(&self, from: Side) -> usize {
        match from {
            Side::Client => self.server_settings.frame_limit(),
            Side::Containerd => self.client_settings.frame_limit(),
        }
    }

    /// Whether containerd's blocks may go out as they came (the client's
    /// table still mirrors containerd's).
    pub(super) fn mirrored(&self) -> bool {
        self.mirror
    }

    /// SETTINGS from `from` (passed on untouched): the table size the other
    /// peer's encoder may use follows them once sent, and `from`'s own once
    /// `from` acknowledges the other's.
    pub(super) fn settings(
        &mut self,
        from: Side,
        head: &Head,
        payload: &[u8],
    ) -> Result<(), SpliceError> {
        let (own, others) = match from {
            Side::Client => (&mut self.client_settings, &mut self.server_settings),
            Side::Containerd => (&mut self.server_settings, &mut self.client_settings),
        };
        if head.has(frame::ACK) {
            others.acked();
        } else {
            (own.sent(payload)).map_err(|e| SpliceError::Settings(from, e.to_string()))?;
        }
        // Blocks from the client are read with what containerd allowed it.
        (self.client_dec).set_limit(self.server_settings.table_limit());
        (self.server_dec).set_limit(self.client_settings.table_limit());
        Ok(())
    }

    /// A client block's `:path` and namespace (from the memo when the
    /// block repeats the last one).
    pub(super) fn request(&mut self, block: &[u8]) -> Result<RequestFields, hpack::HpackError> {
        if let Some((p, ns)) = self.request_seen.get(&self.client_dec, block) {
            return Ok((Some(p.clone()), ns.clone()));
        }
        let mut path = None;
        let mut namespace = None;
        let (seen_path, seen_ns) = (&mut self.seen_path, &mut self.seen_namespace);
        let changes = self.client_dec.changes();
        self.client_dec.decode(block, |n, v| match n {
            b":path" => path = Some(intern(seen_path, v)),
            b"containerd-namespace" if namespace.is_none() => namespace = Some(intern(seen_ns, v)),
            _ => {}
        })?;
        if let Some(p) = &path {
            let value = (p.clone(), namespace.clone());
            self.request_seen
                .put(&self.client_dec, changes, block, value);
        }
        Ok((path, namespace))
    }

    /// containerd's block that went out as it came: its `grpc-status`.
    pub(super) fn passed_status(&mut self, block: &[u8]) -> Result<Option<i32>, SpliceError> {
        if let Some(status) = self.reply_seen.get(&self.server_dec, block) {
            return Ok(*status);
        }
        let mut status = None;
        let changes = self.server_dec.changes();
        (self.server_dec)
            .decode(block, |n, v| {
                if n == b"grpc-status" {
                    status = grpc::parse_status(v);
                }
            })
            .map_err(|e| hpack_error(Side::Containerd, e))?;
        self.reply_seen
            .put(&self.server_dec, changes, block, status);
        Ok(status)
    }

    /// containerd's block kept back (held or watched), decoded to be sent
    /// later re-encoded.
    pub(super) fn kept_fields(&mut self, block: &[u8]) -> Result<Vec<(Bytes, Bytes)>, SpliceError> {
        let changes = self.server_dec.changes();
        let mut fields = Vec::new();
        (self.server_dec)
            .decode(block, |n, v| {
                fields.push((Bytes::copy_from_slice(n), Bytes::copy_from_slice(v)))
            })
            .map_err(|e| hpack_error(Side::Containerd, e))?;
        self.kept_back(changes);
        Ok(fields)
    }

    /// containerd's block re-encoded without the dynamic table, as header
    /// frames on `stream`, and its `grpc-status`.
    pub(super) fn reencode(
        &mut self,
        stream: StreamId,
        end_stream: bool,
        block: &[u8],
    ) -> Result<(Bytes, Option<i32>), SpliceError> {
        let changes = self.server_dec.changes();
        let mut status = None;
        let frame = &mut self.out;
        frame.reserve(block.len() + 64);
        let dec = &mut self.server_dec;
        frame::header_frames(stream, end_stream, frame, |b| {
            dec.decode(block, |n, v| {
                if n == b"grpc-status" {
                    status = grpc::parse_status(v);
                }
                hpack::encode_field(b, n, v);
            })
        })
        .map_err(|e| hpack_error(Side::Containerd, e))?;
        self.kept_back(changes);
        Ok((self.out.split().freeze(), status))
    }

    /// After a containerd block that did not go out as it came: if it changed
    /// containerd's table, the client's no longer mirrors it.
    fn kept_back(&mut self, changes_before: u64) {
        if self.mirror && self.server_dec.changes() != changes_before {
            self.mirror = false;
            tracing::debug!("a held reply changed containerd's HPACK table: re-encoding its header blocks from now on");
        }
    }
}

/// `v` as a shared string, reusing `seen` when it holds the same text.
fn intern(seen: &mut Option<Arc<str>>, v: &[u8]) -> Arc<str> {
    match seen {
        Some(s) if s.as_bytes() == v => s.clone(),
        _ => seen.insert(String::from_utf8_lossy(v).into()).clone(),
    }
}

/// A header block that decoded without changing its decoder's table, and
/// what it said. Calls on a connection repeat their blocks byte for byte
/// (every field indexed), and the same bytes against the same table decode
/// to the same fields: comparing them is cheaper than decoding again.
pub(super) struct Repeat<T> {
    block: Vec<u8>,
    /// The decoder's change count when it was seen; any change since
    /// invalidates it.
    changes: u64,
    value: Option<T>,
}

impl<T> Default for Repeat<T> {
    fn default() -> Self {
        Repeat {
            block: Vec::new(),
            changes: 0,
            value: None,
        }
    }
}

/// Longer blocks are decoded every time: they are rare and compare slowly.
const REPEAT_MAX: usize = 256;

impl<T> Repeat<T> {
    pub(super) fn get(&self, dec: &Decoder, block: &[u8]) -> Option<&T> {
        let v = self.value.as_ref()?;
        (self.changes == dec.changes() && self.block == block).then_some(v)
    }

    /// Remembers `block` if decoding it (from change count `before`) left
    /// the table as it was.
    fn put(&mut self, dec: &Decoder, before: u64, block: &[u8], value: T) {
        if dec.changes() != before || block.len() > REPEAT_MAX {
            return;
        }
        self.block.clear();
        self.block.extend_from_slice(block);
        self.changes = before;
        self.value = Some(value);
    }
}
