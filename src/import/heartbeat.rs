//! An import's heartbeat: each step it completes (a lease made, a chunk
//! handed on, a blob committed, a record written) beats, and an import
//! whose heart stopped for longer than `import.progress_timeout` is
//! cancelled and tried again, as containerd's CRI cancels a pull that made
//! no progress for `image_pull_progress_timeout`. A call that never
//! answers then costs one import a few minutes, not the importer for good
//! ([docs/import.md](../../docs/import.md), "Stalls").

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::lock::lock;

/// When the import last made progress, and the step it made.
#[derive(Clone, Debug)]
pub struct Heartbeat(Arc<Mutex<(Instant, &'static str)>>);

impl Heartbeat {
    pub fn new() -> Heartbeat {
        Heartbeat(Arc::new(Mutex::new((Instant::now(), "starting"))))
    }

    /// The import completed `step` (logged at debug: a stalled import's
    /// log ends with the last step it made).
    pub fn beat(&self, step: &'static str) {
        tracing::debug!(step, "import step");
        *lock(&self.0) = (Instant::now(), step);
    }

    /// Returns once no beat came for `timeout`: the last step made, and
    /// how long ago. Never returns while the import keeps beating.
    pub async fn stopped(&self, timeout: Duration) -> (&'static str, Duration) {
        loop {
            let (at, step) = *lock(&self.0);
            let quiet = at.elapsed();
            if quiet >= timeout {
                return (step, quiet);
            }
            tokio::time::sleep(timeout - quiet).await;
        }
    }
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_heart_that_keeps_beating_never_stops_and_a_silent_one_does() {
        let hb = Heartbeat::new();
        let beating = hb.clone();
        let beats = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(3)).await;
                beating.beat("a chunk handed on");
            }
        });
        let started = tokio::time::Instant::now();
        let (step, quiet) = hb.stopped(Duration::from_secs(5)).await;
        beats.await.unwrap();
        assert_eq!(step, "a chunk handed on");
        assert!(quiet >= Duration::from_secs(5));
        // Ten beats 3 s apart, then 5 s of silence.
        assert!(
            started.elapsed() >= Duration::from_secs(35),
            "{:?}",
            started.elapsed()
        );
    }
}
