//! The calls open on one connection, each in its phase: passing, held,
//! watched or refused. The table owns them; what a phase does with a frame
//! lives with the phase ([`super::held`], [`super::watched`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::frame::StreamId;
use super::held::Held;
use super::watched::Watched;
use crate::proxy::observe::CallGuard;

/// What the splice does with a call's frames.
pub(super) enum CallPhase {
    /// They pass as they come; header blocks are read for the status.
    Passing,
    /// Intercepted: a hook holds the reply (or the request) until it ran.
    Held(Box<Held>),
    /// A streaming call the policy watches message by message (never held
    /// as a whole).
    Watched(Box<Watched>),
    /// Opened after GOAWAY, or ended by a drain: reset at containerd and
    /// answered to the client, its later frames dropped.
    Refused,
}

pub(super) struct Call {
    pub(super) guard: Option<CallGuard>,
    pub(super) phase: CallPhase,
    /// On the [`super::OPEN_ENDED`] list.
    pub(super) open_ended: bool,
    /// A reply header block went to the client.
    pub(super) replied: bool,
}

impl Call {
    pub(super) fn new(guard: Option<CallGuard>, phase: CallPhase, open_ended: bool) -> Call {
        Call {
            guard,
            phase,
            open_ended,
            replied: false,
        }
    }

    pub(super) fn refused(&self) -> bool {
        matches!(self.phase, CallPhase::Refused)
    }

    /// Frames pass untouched (none of them is held, watched or dropped).
    pub(super) fn passing(&self) -> bool {
        matches!(self.phase, CallPhase::Passing)
    }

    pub(super) fn held(&self) -> Option<&Held> {
        match &self.phase {
            CallPhase::Held(h) => Some(h),
            _ => None,
        }
    }

    pub(super) fn held_mut(&mut self) -> Option<&mut Held> {
        match &mut self.phase {
            CallPhase::Held(h) => Some(h),
            _ => None,
        }
    }

    pub(super) fn watched_mut(&mut self) -> Option<&mut Watched> {
        match &mut self.phase {
            CallPhase::Watched(w) => Some(w),
            _ => None,
        }
    }

    /// Held, with its whole reply in: only the hook is awaited.
    pub(super) fn reply_held(&self) -> bool {
        self.held().is_some_and(|h| h.reply_done())
    }

    /// Leaves the held phase: the call passes from here. The held call, if
    /// it was one.
    pub(super) fn take_held(&mut self) -> Option<Box<Held>> {
        match std::mem::replace(&mut self.phase, CallPhase::Passing) {
            CallPhase::Held(h) => Some(h),
            other => {
                self.phase = other;
                None
            }
        }
    }
}

/// The open calls by stream id.
pub(super) type Calls = HashMap<StreamId, Call, BuildHasherDefault<StreamIdHasher>>;

/// Stream ids are distinct small integers: a multiply spreads them over the
/// hash bits; SipHash was a measurable share of a call's CPU.
#[derive(Default)]
pub(super) struct StreamIdHasher(u64);

impl Hasher for StreamIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | *b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
