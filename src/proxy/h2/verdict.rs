//! What becomes of a whole frame the splice looked at: shared by every
//! part that judges frames (calls, PINGs), so it lives apart from them all.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It goes out as it came.
    Forward,
    /// Dropped (the splice may have queued something in its place).
    Swallow,
}

impl Verdict {
    /// `Forward` when `forward`, else `Swallow`.
    pub(super) fn forward_if(forward: bool) -> Verdict {
        match forward {
            true => Verdict::Forward,
            false => Verdict::Swallow,
        }
    }
}
