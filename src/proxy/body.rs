//! Body types of the data path. Passthrough uses hyper's `Incoming` directly;
//! `Replay` carries a held unary message (and its trailers) back out.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;

/// Body sent to containerd and to the client: streamed or replayed.
pub type ProxyBody = Either<Incoming, Replay>;

/// A fully buffered body: optional data, then optional trailers.
///
/// `Replay::default()` is empty and reports end-of-stream at once, which is
/// what makes hyper send a Trailers-Only reply.
#[derive(Debug, Default)]
pub struct Replay {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Replay {
    pub fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Replay {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }
}

impl Body for Replay {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// Wraps a replay as a proxy body.
pub fn replay(data: Bytes, trailers: Option<HeaderMap>) -> ProxyBody {
    Either::Right(Replay::new(data, trailers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn replays_data_then_trailers() {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        let c = Replay::new(Bytes::from_static(b"abc"), Some(t))
            .collect()
            .await
            .unwrap();
        assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(c.to_bytes(), Bytes::from_static(b"abc"));
        assert!(Replay::default().is_end_stream());
        assert!(!Replay::new(Bytes::new(), Some(HeaderMap::new())).is_end_stream());
    }
}
