//! How a splice fails, and the helpers that name the side at fault.

use std::fmt;
use std::io;

use super::frame::{MAX_BLOCK, MAX_CONTINUATIONS};
use super::hpack;
use super::side::Side;

#[derive(Debug, thiserror::Error)]
pub enum SpliceError {
    #[error("the client did not open with the HTTP/2 preface; only gRPC (h2c) clients are served")]
    Preface,
    #[error("{0} sent a malformed frame: {1}")]
    Malformed(Side, String),
    #[error("{0} sent a header block that does not decode (HPACK): {1}")]
    Hpack(Side, String),
    #[error("{0} sent a header block over {MAX_BLOCK} bytes")]
    BlockTooLarge(Side),
    #[error("{0} sent a header block in over {MAX_CONTINUATIONS} CONTINUATION frames")]
    Continuations(Side),
    #[error("{0}: {1}")]
    Settings(Side, String),
    /// A frame over the SETTINGS_MAX_FRAME_SIZE its receiver allows: the
    /// receiver would end the connection, and the fault is the sender's.
    #[error("{0} sent a frame of {1} bytes, over the {2} the other side allows (SETTINGS_MAX_FRAME_SIZE)")]
    FrameTooLarge(Side, usize, usize),
    /// The HPACK mirror of the client's encoder cannot decode a request
    /// block: which method it calls is unknown, so the connection is closed.
    #[error("the client's header block does not decode against imgbridge's copy of its HPACK table (the copy diverged, or the block is malformed): {0}")]
    HpackDesync(String),
    #[error("containerd sent PUSH_PROMISE, which gRPC never uses")]
    Push,
    #[error("reading from {0}: {1}")]
    Read(Side, #[source] io::Error),
    #[error("writing to {0}: {1}")]
    Write(Side, #[source] io::Error),
}

impl SpliceError {
    /// containerd's socket failed or closed: the client can still be told.
    pub(super) fn is_containerd_io(&self) -> bool {
        matches!(
            self,
            SpliceError::Read(Side::Containerd, _) | SpliceError::Write(Side::Containerd, _)
        )
    }

    /// The splice lost track of the client's header compression.
    pub fn is_desync(&self) -> bool {
        matches!(self, SpliceError::HpackDesync(_))
    }

    /// Resets and broken pipes are how peers hang up; everything else is news.
    pub fn is_hangup(&self) -> bool {
        matches!(self, SpliceError::Read(_, e) | SpliceError::Write(_, e)
            if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted | io::ErrorKind::NotConnected))
    }
}

pub(super) fn malformed(side: Side, e: impl fmt::Display) -> SpliceError {
    SpliceError::Malformed(side, e.to_string())
}

pub(super) fn hpack_error(side: Side, e: hpack::HpackError) -> SpliceError {
    SpliceError::Hpack(side, e.to_string())
}
