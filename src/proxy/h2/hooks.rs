//! The hooks' work in flight on one connection, and what each brings back
//! to the connection's task when it ends.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, Stream};

use super::frame::StreamId;
use crate::proxy::intercept::Hook;

/// A hook's result, back on the connection's task.
pub(super) enum Outcome {
    Before {
        stream: StreamId,
        hook: Box<dyn Hook>,
        result: Result<(), tonic::Status>,
    },
    After {
        stream: StreamId,
        result: Result<(), tonic::Status>,
    },
    /// A watched call's future ended: what its hold kept goes on.
    Watch { stream: StreamId },
}

/// The hooks' futures. Polled by the connection loop; `added` tells it to
/// go round once more when work was queued after it polled them.
pub(super) struct Hooks {
    running: FuturesUnordered<BoxFuture<'static, Outcome>>,
    added: bool,
}

impl Default for Hooks {
    fn default() -> Hooks {
        Hooks {
            running: FuturesUnordered::new(),
            added: false,
        }
    }
}

impl Hooks {
    /// Runs `work` on the connection's task: dropped with the connection.
    pub(super) fn push(&mut self, work: BoxFuture<'static, Outcome>) {
        self.added = true;
        self.running.push(work);
    }

    /// Runs `work`, for a call containerd has carried out, as a task of its
    /// own, then queues `then` of its result: a client that hangs up ends
    /// the connection and drops the hooks, which must not cancel the work
    /// (a reset Create's replication once was, before it had started).
    pub(super) fn detach<T: Send + 'static>(
        &mut self,
        work: impl std::future::Future<Output = T> + Send + 'static,
        then: impl FnOnce(Result<T, tokio::task::JoinError>) -> Outcome + Send + 'static,
    ) {
        let task = tokio::spawn(work);
        self.push(Box::pin(async move { then(task.await) }));
    }

    /// The next hook that ended, if any.
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Option<Outcome> {
        if self.running.is_empty() {
            return None;
        }
        match Pin::new(&mut self.running).poll_next(cx) {
            Poll::Ready(Some(o)) => Some(o),
            _ => None,
        }
    }

    /// Whether work was queued since the last call.
    pub(super) fn take_added(&mut self) -> bool {
        std::mem::take(&mut self.added)
    }
}
