//! Where a connection is in its life. The one record of it: the connection
//! loop moves it on, and the pumps and the calls read it (see
//! [`State::phase`](super::streams::State::phase)).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::error::SpliceError;
use crate::proxy::sock::Sock;

/// Where the connection is in its life. A later phase wins over an earlier
/// one: `Closing` over all, `Lingering` over `Lost` and `Draining`.
pub(super) enum Phase {
    /// Calls come and go.
    Open,
    /// GOAWAY was sent (a drain): calls up to it finish, later ones are
    /// refused. `ending`: the open-ended calls are still to be ended (at the
    /// next point where no reply header block is half read).
    Draining { ending: bool },
    /// containerd is gone: calls were answered UNAVAILABLE, new ones are
    /// too, and the client's frames go nowhere; `grace` is how long the
    /// client gets to hang up.
    Lost { grace: Pin<Box<tokio::time::Sleep>> },
    /// The client has been told why the connection closes (see
    /// `Conn::close_loudly`); it ends with `error` once that is written,
    /// or when `grace` is over.
    Closing {
        error: SpliceError,
        grace: Pin<Box<tokio::time::Sleep>>,
    },
    /// A drain answered every call and our side is closed: reading until
    /// the client hangs up.
    Lingering(Linger),
}

impl Phase {
    /// containerd went away (with [`LOST_GRACE`] for the client to hang up).
    pub(super) fn lost() -> Phase {
        Phase::Lost {
            grace: Box::pin(tokio::time::sleep(LOST_GRACE)),
        }
    }

    /// The client was told why the connection ends with `error`.
    pub(super) fn closing(error: SpliceError) -> Phase {
        Phase::Closing {
            error,
            grace: Box::pin(tokio::time::sleep(LOST_GRACE)),
        }
    }

    pub(super) fn is_lost(&self) -> bool {
        matches!(self, Phase::Lost { .. })
    }
}

/// After containerd went away, or the client was told why the connection
/// closes (both with GOAWAY): how long the client may keep the connection
/// before it is closed.
const LOST_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// After a drain answered every call: how long the client may keep the
/// connection (it may still be reading the last reply) before it is closed.
pub(super) const DRAIN_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a lingering connection checks whether the client has read
/// everything.
pub(super) const LINGER_CHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// Keeps a drained connection open while the client is still reading: until
/// it hangs up, or has left nothing unread for a whole check period (time to
/// act on what it read), or `DRAIN_LINGER` is over.
pub(super) struct Linger {
    deadline: tokio::time::Instant,
    check: Pin<Box<tokio::time::Sleep>>,
    drained_once: bool,
}

impl Linger {
    pub(super) fn new() -> Linger {
        let now = tokio::time::Instant::now();
        Linger {
            deadline: now + DRAIN_LINGER,
            check: Box::pin(tokio::time::sleep_until(now + LINGER_CHECK)),
            drained_once: false,
        }
    }

    /// Ready when the connection may be closed.
    pub(super) fn poll(&mut self, cx: &mut Context<'_>, client: &Sock) -> Poll<()> {
        while self.check.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            let drained = client.unread().map_or(true, |n| n == 0);
            if (drained && self.drained_once) || now >= self.deadline {
                return Poll::Ready(());
            }
            self.drained_once = drained;
            self.check.as_mut().reset(now + LINGER_CHECK);
        }
        Poll::Pending
    }
}
