//! Connection threads: each runs a single-threaded tokio runtime, and every
//! accepted connection lives on one of them, with its upstream connection.
//!
//! A spliced connection is one task whose two sockets are registered with
//! its thread's own I/O driver, so a call's wake-ups never cross threads
//! (on the multi-threaded runtime the same splice measured 3 to 4 µs slower
//! per call). Several threads still spread several connections over the
//! CPUs, and the process's other work (replication, reconcile) stays on the
//! main runtime, off the threads that relay calls.

use std::future::Future;
use std::io;
use std::thread::JoinHandle;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

pub struct Shards {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    next: usize,
}

impl Shards {
    /// Starts `n` (at least one) connection threads.
    pub fn start(n: usize) -> io::Result<Shards> {
        let mut s = Shards {
            handles: Vec::new(),
            stops: Vec::new(),
            threads: Vec::new(),
            next: 0,
        };
        for i in 0..n.max(1) {
            // Connections need sockets and timers, nothing more.
            let rt = Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            s.handles.push(rt.handle().clone());
            s.stops.push(stop);
            s.threads.push(
                std::thread::Builder::new()
                    .name(format!("imgbridge-conn-{i}"))
                    .spawn(move || {
                        rt.block_on(async {
                            let _ = stopped.await;
                        });
                        // Whatever is left was given up on by the caller
                        // (drain timeout); do not wait for it.
                        rt.shutdown_background();
                    })?,
            );
        }
        Ok(s)
    }

    /// Runs `f` on the next thread, round-robin.
    pub fn spawn<F>(&mut self, f: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let h = &self.handles[self.next % self.handles.len()];
        self.next = self.next.wrapping_add(1);
        h.spawn(f);
    }

    /// Stops the threads, dropping any connection still on them.
    pub async fn stop(mut self) {
        self.stops.clear();
        let threads = std::mem::take(&mut self.threads);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }
}
