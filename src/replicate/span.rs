//! Tracing spans for intercepted calls, so every log line of one replication
//! carries the call's method, namespace and image, and the end of the call is
//! logged once with its duration and outcome.
//!
//! It lives here, not in `ops`, because only the replication path opens it and
//! it is plain `tracing` (the subscriber `ops::logging` installs formats it):
//! reporting it needs no observer, and replication depends on nothing in `ops`.
//!
//! Use from the replication code:
//! ```no_run
//! # use imgbridge::replicate::span::InterceptSpan;
//! # use tracing::Instrument;
//! # async fn replicate() -> Result<(), String> { Ok(()) }
//! # async fn hook() {
//! let call = InterceptSpan::new("/containerd.services.images.v1.Images/Create", "buildkit", "docker.io/library/app:dev");
//! let result = replicate().instrument(call.span().clone()).await;
//! call.finish(&result); // logs "intercepted call done" with duration_ms and outcome
//! # }
//! ```

use std::fmt::Display;
use std::time::Instant;

use tracing::field::Empty;
use tracing::Span;

/// A span around one intercepted call, with its start time.
#[derive(Debug)]
pub struct InterceptSpan {
    span: Span,
    start: Instant,
    finished: bool,
}

impl InterceptSpan {
    /// Opens the `intercept` span with fields `method`, `namespace`, `image`
    /// (`duration_ms` and `outcome` are filled in by [`InterceptSpan::finish`]).
    pub fn new(method: &str, namespace: &str, image: &str) -> InterceptSpan {
        InterceptSpan {
            span: tracing::info_span!(
                "intercept",
                method,
                namespace,
                image,
                duration_ms = Empty,
                outcome = Empty
            ),
            start: Instant::now(),
            finished: false,
        }
    }

    /// The span, to `.instrument()` futures with or to `enter()`.
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// Milliseconds since the span was opened, to 0.01 ms: a held write
    /// takes a few ms, and whole ones hid changes of a third of that.
    pub fn elapsed_ms(&self) -> f64 {
        (self.start.elapsed().as_secs_f64() * 1e5).round() / 100.0
    }

    /// Records duration and outcome and logs the end of the call: `info` on
    /// `Ok`, `warn` with the error on `Err`.
    pub fn finish<T, E: Display>(mut self, result: &Result<T, E>) {
        self.finished = true;
        let ms = self.elapsed_ms();
        self.span.record("duration_ms", ms);
        let _g = self.span.enter();
        match result {
            Ok(_) => {
                self.span.record("outcome", "ok");
                tracing::info!(duration_ms = ms, "intercepted call done");
            }
            Err(e) => {
                self.span.record("outcome", "failed");
                tracing::warn!(duration_ms = ms, error = %e, "intercepted call failed");
            }
        }
    }
}

impl Drop for InterceptSpan {
    fn drop(&mut self) {
        if !self.finished {
            let ms = self.elapsed_ms();
            let _g = self.span.enter();
            tracing::debug!(
                duration_ms = ms,
                "intercepted call abandoned (client went away)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_carry_span_fields_and_duration() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .json()
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            let s = InterceptSpan::new(
                "/containerd.services.images.v1.Images/Create",
                "buildkit",
                "docker.io/library/app:dev",
            );
            s.span().in_scope(|| tracing::info!("linking blobs"));
            s.finish(&Err::<(), _>("target k8s.io: boom"));
        });
        let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(lines[0]["span"]["image"], "docker.io/library/app:dev");
        assert_eq!(lines[0]["span"]["namespace"], "buildkit");
        assert_eq!(lines[1]["level"], "WARN");
        assert!(lines[1]["fields"]["duration_ms"].is_f64());
        assert_eq!(lines[1]["fields"]["error"], "target k8s.io: boom");
        assert_eq!(
            lines[1]["span"]["method"],
            "/containerd.services.images.v1.Images/Create"
        );
    }
}
