//! Which peer a frame came from, and where the frames the splice writes
//! itself are queued.

use std::collections::VecDeque;
use std::fmt;

use bytes::Bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Containerd,
}

impl Side {
    /// The peer on the other end of the splice.
    pub(super) fn other(self) -> Side {
        match self {
            Side::Client => Side::Containerd,
            Side::Containerd => Side::Client,
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Client => "the client",
            Side::Containerd => "containerd",
        })
    }
}

/// Where frames the splice writes itself go, written at the next frame
/// boundary of each direction: `up` toward containerd, `down` toward the
/// client.
pub(super) struct Out<'a> {
    pub(super) up: &'a mut VecDeque<Bytes>,
    pub(super) down: &'a mut VecDeque<Bytes>,
}

impl Out<'_> {
    /// The queue toward `side`.
    pub(super) fn to(&mut self, side: Side) -> &mut VecDeque<Bytes> {
        match side {
            Side::Containerd => self.up,
            Side::Client => self.down,
        }
    }
}
