//! The replies the splice writes itself: a gRPC error in place of
//! containerd's answer (held calls a hook failed, calls refused or ended by
//! a drain, calls in flight when containerd went away).

use bytes::{Bytes, BytesMut};

use super::frame::{self, StreamId};
use super::hpack;
use crate::proxy::grpc;

/// Trailers with a gRPC error status on `stream`, ending a call whose reply
/// headers (and maybe messages) the client has already had.
pub(super) fn error_trailers(stream: StreamId, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let mut out = BytesMut::new();
    frame::header_frames(stream, true, &mut out, |b| {
        hpack::encode_field(b, b"grpc-status", code.as_bytes());
        hpack::encode_field(b, b"grpc-message", message.as_bytes());
    });
    out.freeze()
}

/// A Trailers-Only gRPC error reply on `stream`.
pub(super) fn error_reply(stream: StreamId, code: tonic::Code, message: &str) -> Bytes {
    let code = (code as i32).to_string();
    let message = grpc::encode_message(message);
    let fields = [
        (&b":status"[..], &b"200"[..]),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", code.as_bytes()),
        (b"grpc-message", message.as_bytes()),
    ];
    let mut out = BytesMut::new();
    frame::header_frames(stream, true, &mut out, |b| {
        for (n, v) in fields {
            hpack::encode_field(b, n, v);
        }
    });
    out.freeze()
}
