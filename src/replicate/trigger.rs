//! What starts a replication, and what its caller hears
//! ([docs/design.md](../../docs/design.md#replication), steps 1 and 5): a
//! client's image write held by the proxy ([`super::hooks`]), a write
//! straight into `k8s.io` waited for until CRI sees it, a write the client
//! reset after containerd got it, a Transfer that wrote into a source, and
//! the background retry of a failed replication. The reconcile pass and the
//! events backstop call [`Replicator::replicate`] directly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{span, Error, Outcome, Replicator};
use crate::backoff::Backoff;
use crate::config::OnFailure;
use crate::containerd::{self as ctrd, Descriptor};
use crate::labels::CRI_NAMESPACE;
use crate::oci::Reference;

/// What the client of a held write hears once its replication ended.
#[derive(Debug)]
enum Answer {
    Ok,
    /// OK, and the replication is tried again in the background.
    RetryLater(Error),
    Fail(tonic::Status),
}

/// The answer `on_failure` gives a write of `name` into `source` whose
/// replication ended with `res`. The write itself was carried out: an
/// error says so. A refusal ([`Error::Protected`]) is never retried:
/// trying again changes nothing until the operator does.
fn answer(on_failure: OnFailure, source: &str, name: &str, res: Result<Outcome, Error>) -> Answer {
    match (res, on_failure) {
        (Ok(_), _) => Answer::Ok,
        (Err(e), OnFailure::Fail) if e.is_protected() => {
            Answer::Fail(tonic::Status::failed_precondition(format!(
                "imgbridge: image {name} was stored in namespace {source} (left there as written), but {e}"
            )))
        }
        // Logged by the replication.
        (Err(e), OnFailure::Warn) if e.is_protected() => Answer::Ok,
        (Err(e), OnFailure::Fail) => Answer::Fail(tonic::Status::internal(format!(
            "imgbridge: image {name} was stored in namespace {source} (kept), but {e}"
        ))),
        (Err(e), OnFailure::Warn) => Answer::RetryLater(e),
    }
}

impl Replicator {
    /// Something wrote into `source` server-side (a Transfer pull): link
    /// every pending blob of it that is there now, before the call returns.
    pub async fn source_written(&self, source: &str) {
        let digests = self.pending.digests(source);
        futures_util::future::join_all(digests.iter().map(|d| self.committed(source, d))).await;
    }

    /// The proxy path: replicate, then apply `on_failure`. An error here is
    /// what the caller receives. `root`: the tree the write's reply named.
    pub async fn on_write(
        self: &Arc<Self>,
        method: &str,
        source: &str,
        name: &str,
        root: Option<Descriptor>,
    ) -> Result<(), tonic::Status> {
        use tracing::Instrument;
        let me = self.clone();
        let (src, n) = (source.to_string(), name.to_string());
        let span = span::InterceptSpan::new(method, source, name);
        let task = async move { me.replicate_from(&src, &n, true, root.as_ref()).await }
            .instrument(span.span().clone());
        let res = self.detached(task).await.unwrap_or_else(|e| {
            Err(Error::Containerd {
                image: name.into(),
                source_ns: source.into(),
                target: "*".into(),
                cause: ctrd::Error::Protocol(format!("replication task failed: {e}")),
            })
        });
        span.finish(&res);
        match answer(self.s.on_failure, source, name, res) {
            Answer::Ok => Ok(()),
            Answer::Fail(status) => Err(status),
            Answer::RetryLater(e) => {
                tracing::warn!(image = name, source, error = %e, "replication failed; replying OK (on_failure = warn) and retrying in the background");
                self.retry_later(source, name);
                Ok(())
            }
        }
    }

    /// Runs a held write's work on the replicator's runtime, not the
    /// connection's, detached: a caller that gives up (any caller, not only
    /// the splice, which runs hooks as tasks too) never leaves it half done.
    fn detached<T: Send + 'static>(
        &self,
        task: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        match &self.rt {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        }
    }

    /// A write straight into `k8s.io` (`confirm_direct_writes`): nothing
    /// to replicate, only CRI's view to wait for, as for a replica. It
    /// never fails the call: containerd has carried it out.
    pub async fn on_direct_write(
        self: &Arc<Self>,
        method: &str,
        name: &str,
        root: Option<Descriptor>,
    ) {
        use tracing::Instrument;
        let Some(root) = root else { return };
        // CRI resolves a record by its full name only (kubelet asks for
        // `docker.io/library/app:1`, never `app:1`): a record named
        // otherwise (`sha256:…`, `app:1`) is never resolved, so not waited
        // for.
        if Reference::parse(name)
            .map(|r| r.to_string())
            .ok()
            .as_deref()
            != Some(name)
        {
            return;
        }
        let me = self.clone();
        let n = name.to_string();
        let span = span::InterceptSpan::new(method, CRI_NAMESPACE, name);
        let task = async move {
            if !me.has_cri().await {
                return;
            }
            let Some(id) = me.cri_id(CRI_NAMESPACE, &root).await else {
                return;
            };
            let (polls, resolved) = me.wait_cri(CRI_NAMESPACE, &n, &[id]).await;
            tracing::debug!(cri_polls = polls, resolved, "direct write waited for CRI");
        }
        .instrument(span.span().clone());
        let _ = self.detached(task).await;
        span.finish(&Ok::<(), std::convert::Infallible>(()));
    }

    /// A client reset its write of `name` after containerd got it
    /// (containerd may or may not carry it out): replicate it once it is
    /// there, looking for up to 3 s. Later writes are the events backstop's.
    pub fn on_abandoned(self: &Arc<Self>, source: &str, name: &str) {
        // Bounded: a hooked Rapid Reset must not turn into as many pollers;
        // past the bound the events backstop catches what was carried out.
        let Ok(permit) = self.abandoned.clone().try_acquire_owned() else {
            tracing::debug!(image = ?name, source, "too many reset writes being followed; leaving this one to the events backstop");
            return;
        };
        let (me, source, name) = (self.clone(), source.to_string(), name.to_string());
        let task = async move {
            let _permit = permit;
            // containerd may commit a reset call late when it is busy:
            // look for up to 3 s, every 250 ms at most.
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut delay = Backoff::new(Duration::from_millis(20), Duration::from_millis(250));
            while Instant::now() < deadline {
                tokio::time::sleep(delay.next_delay()).await;
                if !matches!(me.c.get_image(&source, &name).await, Ok(Some(_))) {
                    continue;
                }
                match me.replicate(&source, &name, false).await {
                    Ok(_) => {
                        tracing::info!(image = ?name, source, "replicated a write its client reset after containerd got it")
                    }
                    Err(e) => {
                        tracing::warn!(image = ?name, source, error = %e, "replicating a write its client reset failed; the events backstop retries")
                    }
                }
                return;
            }
        };
        match &self.rt {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        };
    }

    fn retry_later(self: &Arc<Self>, source: &str, name: &str) {
        let (me, src, n) = (self.clone(), source.to_string(), name.to_string());
        tokio::spawn(async move {
            let start = Instant::now();
            let mut delay = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
            while start.elapsed() < me.s.pending_give_up {
                tokio::time::sleep(delay.next_delay()).await;
                match me.replicate(&src, &n, false).await {
                    Ok(_) => {
                        tracing::info!(image = %n, source = %src, "background retry replicated the image");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(image = %n, source = %src, error = %e, "background retry failed")
                    }
                }
            }
            tracing::error!(image = %n, source = %src, "gave up retrying replication; run `imgbridge sync` once the cause is fixed");
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicate::protect::Protection;

    fn protected() -> Error {
        Error::Protected {
            image: "pause:3.10".into(),
            source_ns: "buildkit".into(),
            target: CRI_NAMESPACE.into(),
            replica: "docker.io/library/pause:3.10".into(),
            protection: Protection::Sandbox,
        }
    }

    fn failed() -> Error {
        Error::Timeout {
            image: "app:dev".into(),
            target: CRI_NAMESPACE.into(),
            after: Duration::from_secs(30),
        }
    }

    /// `on_failure = fail`: the client hears the error, a refusal as a
    /// failed precondition, a failure as internal, each saying the write
    /// itself was kept. `warn`: OK, a failure retried in the background, a
    /// refusal not (it would be refused again).
    #[test]
    fn on_failure_decides_what_the_client_hears() {
        for policy in [OnFailure::Fail, OnFailure::Warn] {
            let ok = Ok(Outcome::default());
            assert!(matches!(
                answer(policy, "buildkit", "app:dev", ok),
                Answer::Ok
            ));
        }
        let Answer::Fail(s) = answer(OnFailure::Fail, "buildkit", "pause:3.10", Err(protected()))
        else {
            panic!("a refusal under fail is an error")
        };
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(
            s.message().contains("left there as written"),
            "{}",
            s.message()
        );
        assert!(
            s.message().contains("replication.overwrite"),
            "{}",
            s.message()
        );
        let Answer::Fail(s) = answer(OnFailure::Fail, "buildkit", "app:dev", Err(failed())) else {
            panic!("a failure under fail is an error")
        };
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(s
            .message()
            .starts_with("imgbridge: image app:dev was stored in namespace buildkit (kept), but"));
        assert!(matches!(
            answer(OnFailure::Warn, "buildkit", "pause:3.10", Err(protected())),
            Answer::Ok
        ));
        assert!(matches!(
            answer(OnFailure::Warn, "buildkit", "app:dev", Err(failed())),
            Answer::RetryLater(Error::Timeout { .. })
        ));
    }
}
