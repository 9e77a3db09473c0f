//! The SETTINGS each peer sent and which of them the other peer has
//! acknowledged (RFC 9113 §6.5.3): the limits a sender must keep to follow
//! from them, and the splice's mirrors keep the same ones.

use std::collections::VecDeque;

/// SETTINGS_HEADER_TABLE_SIZE.
const HEADER_TABLE_SIZE: u16 = 0x1;
/// SETTINGS_MAX_FRAME_SIZE.
const MAX_FRAME_SIZE: u16 = 0x5;
/// The protocol's initial SETTINGS_MAX_FRAME_SIZE (RFC 9113 §6.5.2).
pub(super) const INITIAL_FRAME: u32 = 16_384;
/// The protocol's initial SETTINGS_HEADER_TABLE_SIZE (RFC 9113 §6.5.2).
const INITIAL_TABLE: u32 = 4096;
/// SETTINGS frames a peer may have outstanding (sent, not yet acknowledged)
/// before the splice gives up on it. Peers acknowledge at once (grpc-go,
/// h2), so only a SETTINGS flood reaches this; each costs 8 bytes here.
const MAX_UNACKED: usize = 1024;

/// What one peer (the receiver) told the other (the sender) it accepts.
#[derive(Debug)]
pub(super) struct Advertised {
    /// SETTINGS_HEADER_TABLE_SIZE the sender has acknowledged.
    table_acked: u32,
    /// SETTINGS_MAX_FRAME_SIZE the sender has acknowledged.
    frame_acked: u32,
    /// Per SETTINGS frame not yet acknowledged, in order: the table size
    /// and the frame size it set, if it set them.
    pending: VecDeque<(Option<u32>, Option<u32>)>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("over {MAX_UNACKED} SETTINGS frames sent without acknowledgement")]
pub(super) struct SettingsFlood;

impl Default for Advertised {
    fn default() -> Self {
        Advertised {
            table_acked: INITIAL_TABLE,
            frame_acked: INITIAL_FRAME,
            pending: VecDeque::new(),
        }
    }
}

impl Advertised {
    /// The receiver sent a SETTINGS frame (not an ACK) with `payload`.
    /// A payload that is not whole entries is the sender's to reject; the
    /// whole entries in it are counted.
    pub(super) fn sent(&mut self, payload: &[u8]) -> Result<(), SettingsFlood> {
        if self.pending.len() >= MAX_UNACKED {
            return Err(SettingsFlood);
        }
        // The last value for an id is the one that counts (§6.5).
        let last = |id| {
            (payload.chunks_exact(6))
                .rfind(|e| u16::from_be_bytes([e[0], e[1]]) == id)
                .map(|e| u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
        };
        self.pending
            .push_back((last(HEADER_TABLE_SIZE), last(MAX_FRAME_SIZE)));
        Ok(())
    }

    /// The sender acknowledged the oldest outstanding SETTINGS frame. An
    /// ACK with nothing outstanding is the receiver's to reject.
    pub(super) fn acked(&mut self) {
        if let Some((table, frame)) = self.pending.pop_front() {
            self.table_acked = table.unwrap_or(self.table_acked);
            self.frame_acked = frame.unwrap_or(self.frame_acked);
        }
    }

    /// The largest dynamic table size update the sender may send now: the
    /// value it acknowledged, or a larger one it was sent and may be using
    /// already (RFC 9113 §6.5.3 lets it apply a setting before its ACK).
    pub(super) fn table_limit(&self) -> usize {
        let pending = self.pending.iter().filter_map(|p| p.0);
        pending.fold(self.table_acked, u32::max) as usize
    }

    /// The largest frame payload the sender may send now (acknowledged, or
    /// a larger one it was sent), as for [`Advertised::table_limit`].
    pub(super) fn frame_limit(&self) -> usize {
        let pending = self.pending.iter().filter_map(|p| p.1);
        pending.fold(self.frame_acked, u32::max) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u16, v: u32) -> Vec<u8> {
        [&id.to_be_bytes()[..], &v.to_be_bytes()].concat()
    }

    #[test]
    fn the_table_limit_follows_settings_and_their_acks() {
        let mut a = Advertised::default();
        assert_eq!(a.table_limit(), 4096);
        // Raised: the sender may use it before it acknowledges.
        a.sent(&entry(HEADER_TABLE_SIZE, 65536)).unwrap();
        assert_eq!(a.table_limit(), 65536);
        a.acked();
        assert_eq!(a.table_limit(), 65536);
        // Lowered: the higher value stands until the ACK.
        a.sent(&[entry(0x4, 1 << 20), entry(HEADER_TABLE_SIZE, 0)].concat())
            .unwrap();
        a.sent(&entry(0x5, 1 << 20)).unwrap();
        assert_eq!(a.table_limit(), 65536);
        a.acked();
        assert_eq!(a.table_limit(), 0);
        a.acked(); // a frame that did not set it
        a.acked(); // nothing outstanding
        assert_eq!(a.table_limit(), 0);
    }

    #[test]
    fn the_frame_limit_follows_settings_and_their_acks() {
        let mut a = Advertised::default();
        assert_eq!(a.frame_limit(), 16_384);
        a.sent(&entry(MAX_FRAME_SIZE, 1 << 20)).unwrap();
        assert_eq!(a.frame_limit(), 1 << 20, "usable before its ACK");
        a.acked();
        assert_eq!(a.frame_limit(), 1 << 20);
        a.sent(&entry(HEADER_TABLE_SIZE, 0)).unwrap();
        a.acked();
        assert_eq!(a.frame_limit(), 1 << 20, "other settings leave it");
    }

    #[test]
    fn a_settings_flood_is_refused() {
        let mut a = Advertised::default();
        for _ in 0..MAX_UNACKED {
            a.sent(&[]).unwrap();
        }
        assert_eq!(a.sent(&[]), Err(SettingsFlood));
        a.acked();
        assert!(a.sent(&[]).is_ok());
    }
}
