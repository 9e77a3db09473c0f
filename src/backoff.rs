//! One doubling back-off for every retry loop: `initial`, twice that, and
//! so on up to `max`. Written once so that every loop's schedule reads the
//! same and caps the same way (no loop today adds jitter: each retries one
//! peer, the local containerd, so there is no herd to spread).

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// A schedule from `initial` doubling up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            current: initial,
        }
    }

    /// The delay to wait now; the next call returns twice it (capped).
    pub fn next_delay(&mut self) -> Duration {
        let now = self.current;
        self.current = now.saturating_mul(2).min(self.max);
        now
    }

    /// The delay [`Backoff::next_delay`] would return, without moving on.
    pub fn current(&self) -> Duration {
        self.current
    }

    /// Back to `initial` (the thing retried worked).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }

    /// The delay before retry number `attempt` (0-based) for loops that
    /// count attempts instead of keeping a `Backoff`: `initial` × 2^attempt,
    /// capped at `max`.
    pub fn nth(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(20 * MS, 250 * MS);
        let got: Vec<_> = (0..7).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, [20, 40, 80, 160, 250, 250, 250]);
        assert_eq!(b.current(), 250 * MS);
        b.reset();
        assert_eq!(b.next_delay(), 20 * MS);
    }

    #[test]
    fn nth_matches_the_running_schedule_and_never_overflows() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(300));
        let mut running = b;
        for attempt in 0..12 {
            assert_eq!(b.nth(attempt), running.next_delay(), "attempt {attempt}");
        }
        assert_eq!(b.nth(40), Duration::from_secs(300));
        assert_eq!(b.nth(u32::MAX), Duration::from_secs(300));
        let huge = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(huge.nth(3), Duration::MAX);
    }
}
