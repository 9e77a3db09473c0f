//! The confirm phase ([docs/design.md](../../docs/design.md#replication),
//! step 4): a replica written into CRI's namespace is usable by kubelet
//! only once CRI has handled the record's event, so the write that caused
//! it waits until CRI `ImageStatus` resolves the name to the new config,
//! then the digest ref. CRI follows containerd's events a few ms behind the
//! record; many waiting at once share one `ListImages` ([`super::cri_view`]).

use std::time::{Duration, Instant};

use super::record::Plan;
use super::Replicator;
use crate::labels::CRI_NAMESPACE;

/// Whether a replication into `target` waits for CRI: only in CRI's
/// namespace, and there when the caller asks (`wait_cri`, a client's
/// write) or when it wrote something (a pass that changed a replica).
pub(super) fn needed(target: &str, wait_cri: bool, writes: usize) -> bool {
    target == CRI_NAMESPACE && (wait_cri || writes > 0)
}

/// CRI poll interval: 1 ms while CRI usually catches up, then backing off
/// so a slow (or failing) CRI is not hammered until `cri_wait` runs out.
/// With `waiters` replications polling at once, each polls that much less
/// often: all together stay near 1000 ImageStatus calls a second (a burst of
/// 200 Creates polling every millisecond each kept containerd, and with it
/// CRI's own event handling, which they wait for, busy answering them). From
/// [`super::cri_view::SHARED_FROM`] waiters on they share one `ListImages`
/// instead ([`super::cri_view::CriView::shared`]).
fn cri_poll_delay(waited: Duration, waiters: usize) -> Duration {
    let alone = match waited.as_millis() {
        0..=50 => Duration::from_millis(1),
        51..=500 => Duration::from_millis(5),
        _ => Duration::from_millis(25),
    };
    alone.max(Duration::from_millis(waiters as u64).min(Duration::from_millis(250)))
}

impl Replicator {
    /// Whether containerd runs CRI. Cached only once known: a probe that
    /// failed (containerd restarting) must not turn CRI's part off for the
    /// life of the process.
    pub(super) async fn has_cri(&self) -> bool {
        match self.cri.get_or_try_init(|| self.c.has_cri()).await {
            Ok(known) => *known,
            Err(_) => true,
        }
    }

    /// The tag confirmed when `needed` ([`needed`]): the polls made and
    /// whether CRI resolved it; `(0, false)` when not needed.
    pub(super) async fn confirm(
        &self,
        target: &str,
        name: &str,
        configs: &[String],
        needed: bool,
    ) -> (usize, bool) {
        match needed {
            true => self.wait_cri(target, name, configs).await,
            false => (0, false),
        }
    }

    /// A pod may name the image by digest (`repo:tag@sha256:…`): the
    /// digest ref is confirmed after the tag. CRI handles events in order,
    /// so it usually is by now (one poll). Returns the polls.
    pub(super) async fn confirm_digest_ref(
        &self,
        target: &str,
        plan: &Plan<'_>,
        configs: &[String],
    ) -> usize {
        match &plan.digest_ref {
            Some(n) => self.wait_cri(target, n, configs).await.0,
            None => 0,
        }
    }

    /// Polls CRI until `name` resolves to one of `configs` (any id if the
    /// config is not known yet); returns the number of polls and whether it
    /// resolved (or needs no confirmation) before `cri_wait` ran out. CRI follows
    /// containerd's events a few ms behind the record, so the first poll is
    /// immediate and the next ones come every millisecond before backing off.
    /// With many waiting, they share one `ListImages` ([`super::cri_view`]).
    pub(super) async fn wait_cri(
        &self,
        target: &str,
        name: &str,
        configs: &[String],
    ) -> (usize, bool) {
        if configs.is_empty() || !self.has_cri().await {
            return (0, true);
        }
        let _waiting = self.cri_view.enter();
        let started = Instant::now();
        let deadline = started + self.s.cri_wait;
        // The record was written before: any answer asked from now on
        // has it if CRI has handled it.
        let mut after = started;
        let mut polls = 0;
        loop {
            polls += 1;
            let shared = self.cri_view.shared();
            let id = if shared {
                let answer = self.cri_view.id_after(name, after);
                match tokio::time::timeout_at(deadline.into(), answer).await {
                    Ok((asked, id)) => {
                        after = asked + Duration::from_nanos(1);
                        id
                    }
                    Err(_) => None,
                }
            } else {
                self.c
                    .cri_image_id(name)
                    .await
                    .inspect_err(
                        |e| tracing::debug!(name, error = %e, "CRI ImageStatus failed; retrying"),
                    )
                    .ok()
                    .flatten()
            };
            if id.is_some_and(|id| configs.contains(&id)) {
                if let Some(o) = self.observer() {
                    o.cri_confirmed(started.elapsed());
                }
                return (polls, true);
            }
            if Instant::now() >= deadline {
                // The replica is written: failing the client's write now
                // would report a change containerd made as not made.
                tracing::warn!(image = name, target, expected = ?configs, waited = ?self.s.cri_wait,
                    "the image is written into k8s.io but CRI ImageStatus did not resolve it in time; kubelet sees it once CRI catches up (is containerd overloaded, or a blob of it still missing?)");
                return (polls, false);
            }
            if !shared {
                let waiters = self.cri_view.waiters();
                tokio::time::sleep(cri_poll_delay(started.elapsed(), waiters)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRI is asked only about its own namespace: always for a client's
    /// write, for a pass only when the pass changed the replica.
    #[test]
    fn cri_is_waited_for_in_its_namespace_only() {
        assert!(needed(CRI_NAMESPACE, true, 0));
        assert!(needed(CRI_NAMESPACE, false, 1));
        assert!(!needed(CRI_NAMESPACE, false, 0));
        assert!(!needed("default", true, 3));
    }

    /// 1 ms while CRI usually catches up, backing off to 25 ms; with many
    /// waiting, each polls less often (1 ms per waiter, at most 250 ms).
    #[test]
    fn polls_back_off_and_spread_over_waiters() {
        let ms = Duration::from_millis;
        assert_eq!(cri_poll_delay(ms(0), 1), ms(1));
        assert_eq!(cri_poll_delay(ms(50), 0), ms(1));
        assert_eq!(cri_poll_delay(ms(51), 1), ms(5));
        assert_eq!(cri_poll_delay(ms(501), 1), ms(25));
        assert_eq!(cri_poll_delay(ms(0), 7), ms(7));
        assert_eq!(cri_poll_delay(ms(501), 100), ms(100));
        assert_eq!(cri_poll_delay(ms(0), 10_000), ms(250));
    }
}
