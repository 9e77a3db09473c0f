//! Watching the data path without buffering it: which method was called,
//! its final `grpc-status`, how many calls are in flight and how many bytes
//! were relayed. The proxy only reports; counting lives in whoever implements
//! [`CallObserver`] (`ops::Metrics`).
//!
//! Cost per call: two observer calls (the path is shared, not copied); per
//! DATA frame: one observer call (an atomic add in `ops::Metrics`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Buf;
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::grpc;

/// Receives data-path events. All methods sit on the hot path: keep them to
/// atomic operations and short, uncontended locks.
pub trait CallObserver: Send + Sync + std::fmt::Debug + 'static {
    /// A call (one HTTP/2 stream) started; exactly one
    /// [`CallObserver::call_finished`] follows.
    fn call_started(&self);
    /// `n` response DATA bytes were relayed to the client (called per frame).
    fn bytes_relayed(&self, n: u64);
    /// The call ended. `method` is the raw request path (any string a client
    /// sent: bound it before using it as a label); `grpc_status` is `None`
    /// when the stream ended without one (client cancelled, connection lost).
    fn call_finished(&self, method: &str, grpc_status: Option<i32>);
}

/// One observed call; reports [`CallObserver::call_finished`] when dropped,
/// so a call abandoned at any point (even before upstream answered) still
/// ends exactly once.
pub struct CallGuard {
    observer: Arc<dyn CallObserver>,
    method: Arc<str>,
    status: Option<i32>,
}

impl CallGuard {
    pub fn new(observer: Arc<dyn CallObserver>, method: Arc<str>) -> CallGuard {
        observer.call_started();
        CallGuard {
            observer,
            method,
            status: None,
        }
    }
}

impl CallGuard {
    /// Records the call's `grpc-status` as soon as it is known.
    pub fn set_status(&mut self, status: Option<i32>) {
        if status.is_some() {
            self.status = status;
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.observer.call_finished(&self.method, self.status);
    }
}

pin_project! {
    /// A response body that reports to a [`CallGuard`] as frames pass: DATA
    /// lengths, `grpc-status` from trailers (or from the headers of a
    /// Trailers-Only reply), and the end of the call on end-of-stream, error
    /// or drop. Frames are passed through untouched.
    pub struct Observed<B> {
        #[pin]
        inner: B,
        call: Option<CallGuard>,
    }
}

impl<B> Observed<B> {
    /// Wraps `inner`; `None` observes nothing (proxy without metrics).
    pub fn new(inner: B, headers: &HeaderMap, call: Option<CallGuard>) -> Observed<B> {
        let call = call.map(|mut c| {
            c.status = grpc::status_code(headers, None);
            c
        });
        Observed { inner, call }
    }
}

/// Wraps a response so that `call` (if any) observes its body.
pub fn response<B>(resp: Response<B>, call: Option<CallGuard>) -> Response<Observed<B>> {
    let (parts, body) = resp.into_parts();
    let body = Observed::new(body, &parts.headers, call);
    Response::from_parts(parts, body)
}

impl<B> Body for Observed<B>
where
    B: Body,
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        if let Some(call) = this.call.as_mut() {
            match &frame {
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        call.observer.bytes_relayed(d.remaining() as u64);
                    } else if let Some(t) = f.trailers_ref() {
                        // Trailers are the last frame: the call is decided.
                        if let Some(s) = grpc::status_code(&HeaderMap::new(), Some(t)) {
                            call.status = Some(s);
                        }
                        *this.call = None;
                    }
                }
                // End of stream or a broken stream: the call is over.
                Some(Err(_)) | None => *this.call = None,
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::body::Replay;
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    impl CallObserver for Log {
        fn call_started(&self) {
            self.0.lock().unwrap().push("start".into());
        }
        fn bytes_relayed(&self, n: u64) {
            self.0.lock().unwrap().push(format!("bytes {n}"));
        }
        fn call_finished(&self, method: &str, s: Option<i32>) {
            self.0.lock().unwrap().push(format!("end {method} {s:?}"));
        }
    }

    fn trailers(code: &str) -> HeaderMap {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", code.parse().unwrap());
        t
    }

    #[tokio::test]
    async fn counts_data_and_reads_trailers_once() {
        let log = Arc::new(Log::default());
        let guard = CallGuard::new(log.clone(), "/m".into());
        let body = Observed::new(
            Replay::new(Bytes::from_static(b"hello"), Some(trailers("0"))),
            &HeaderMap::new(),
            Some(guard),
        );
        let c = body.collect().await.unwrap();
        assert_eq!(c.to_bytes(), Bytes::from_static(b"hello"));
        assert_eq!(
            *log.0.lock().unwrap(),
            ["start", "bytes 5", "end /m Some(0)"]
        );
    }

    #[tokio::test]
    async fn trailers_only_and_drop_are_recorded() {
        let log = Arc::new(Log::default());
        // Trailers-Only: the status is in the headers, the body is never polled.
        let body = Observed::new(
            Replay::default(),
            &trailers("5"),
            Some(CallGuard::new(log.clone(), "/nf".into())),
        );
        assert!(body.is_end_stream());
        drop(body);
        // Dropped mid-stream (client went away): no status.
        let body = Observed::new(
            Replay::new(Bytes::from_static(b"x"), Some(trailers("0"))),
            &HeaderMap::new(),
            Some(CallGuard::new(log.clone(), "/gone".into())),
        );
        drop(body);
        assert_eq!(
            *log.0.lock().unwrap(),
            ["start", "end /nf Some(5)", "start", "end /gone None"]
        );
    }

    #[tokio::test]
    async fn without_observer_is_passthrough() {
        let body = Observed::new(
            Replay::new(Bytes::from_static(b"abc"), None),
            &HeaderMap::new(),
            None,
        );
        assert_eq!(
            body.collect().await.unwrap().to_bytes(),
            Bytes::from_static(b"abc")
        );
    }
}
