//! gRPC wire details the transport needs: length-prefixed framing of unary
//! messages and synthesised (Trailers-Only) status replies.
//!
//! Only intercepted unary calls are ever parsed; everything else is relayed as
//! opaque HTTP/2 DATA, so this module is the whole attack surface for malformed
//! frames (see `fuzz/fuzz_targets/grpc_frame.rs`).

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body_util::Empty;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

/// Size of the gRPC message prefix: 1 byte compressed flag + 4 bytes length.
pub const PREFIX_LEN: usize = 5;

/// containerd's default max message size (`defaults.DefaultMaxRecvMsgSize`).
pub const MAX_MESSAGE: usize = 16 << 20;

/// Largest held (intercepted) request or response body: one message.
pub const MAX_HELD_BODY: usize = MAX_MESSAGE + PREFIX_LEN;

/// Why a buffered body is not exactly one plain gRPC message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("body is {0} bytes, shorter than the 5-byte gRPC prefix")]
    Short(usize),
    #[error("message is compressed (flag {0}); imgbridge relays it untouched without decoding")]
    Compressed(u8),
    #[error("prefix announces {announced} bytes but {available} follow")]
    Length { announced: usize, available: usize },
    #[error("message of {0} bytes exceeds the 16 MiB limit")]
    TooLarge(usize),
    #[error("{0} trailing bytes after the first message of a unary body")]
    Trailing(usize),
}

/// Returns the single message carried by a unary request or response body.
///
/// An empty body is not a message (`Short(0)`): a unary reply without data is
/// always an error reply, which the caller has already classified.
pub fn unary_message(body: &Bytes) -> Result<Bytes, FrameError> {
    if body.len() < PREFIX_LEN {
        return Err(FrameError::Short(body.len()));
    }
    let flag = body[0];
    if flag != 0 {
        return Err(FrameError::Compressed(flag));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(FrameError::TooLarge(len));
    }
    let available = body.len() - PREFIX_LEN;
    if len > available {
        return Err(FrameError::Length {
            announced: len,
            available,
        });
    }
    if len < available {
        return Err(FrameError::Trailing(available - len));
    }
    Ok(body.slice(PREFIX_LEN..))
}

/// Characters gRPC requires to be percent-encoded in `grpc-message`.
const GRPC_MESSAGE: &AsciiSet = &CONTROLS.add(b'%').add(b'"').add(b'\'');

/// A `grpc-message` value: percent-encoded as gRPC requires, printable ASCII.
pub fn encode_message(message: &str) -> String {
    utf8_percent_encode(message, GRPC_MESSAGE)
        .to_string()
        .chars()
        .filter(|c| c.is_ascii() && !c.is_ascii_control())
        .collect()
}

/// A `grpc-status` value as sent on the wire.
pub fn parse_status(value: &[u8]) -> Option<i32> {
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// A Trailers-Only error reply: HEADERS with END_STREAM carrying the status.
///
/// The body must report `is_end_stream() == true` (as `Empty` does), or
/// grpc-go clients fail with "server closed the stream without sending
/// trailers".
pub fn error_response(code: tonic::Code, message: &str) -> Response<Empty<Bytes>> {
    let mut resp = Response::new(Empty::new());
    let h = resp.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", HeaderValue::from(code as i32));
    if let Ok(v) = HeaderValue::from_str(&encode_message(message)) {
        h.insert("grpc-message", v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames one message (uncompressed), as a gRPC sender would.
    fn frame(message: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(PREFIX_LEN + message.len());
        out.push(0);
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out.into()
    }

    #[test]
    fn roundtrip() {
        let f = frame(b"hello");
        assert_eq!(unary_message(&f).unwrap(), Bytes::from_static(b"hello"));
        assert_eq!(unary_message(&frame(b"")).unwrap(), Bytes::new());
    }

    #[test]
    fn rejects_malformed() {
        assert_eq!(unary_message(&Bytes::new()), Err(FrameError::Short(0)));
        assert_eq!(
            unary_message(&Bytes::from_static(&[1, 0, 0, 0, 0])),
            Err(FrameError::Compressed(1))
        );
        assert_eq!(
            unary_message(&Bytes::from_static(&[0, 0, 0, 0, 9, 1])),
            Err(FrameError::Length {
                announced: 9,
                available: 1
            })
        );
        let mut two = frame(b"a").to_vec();
        two.extend_from_slice(&frame(b"b"));
        assert_eq!(unary_message(&two.into()), Err(FrameError::Trailing(6)));
        assert_eq!(
            unary_message(&Bytes::from_static(&[0, 0xff, 0xff, 0xff, 0xff])),
            Err(FrameError::TooLarge(u32::MAX as usize))
        );
    }

    #[test]
    fn error_reply_is_trailers_only_and_encoded() {
        let r = error_response(tonic::Code::Unavailable, "upstream \"x\" 100% down\n");
        assert_eq!(r.headers()["grpc-status"], "14");
        assert_eq!(
            r.headers()["grpc-message"],
            "upstream %22x%22 100%25 down%0A"
        );
        assert!(http_body::Body::is_end_stream(r.body()));
    }
}
