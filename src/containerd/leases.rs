//! Leases keep blobs alive between their commit and the image record that
//! references them. They are per namespace and must be created in the
//! target.
//!
//! Every lease imgbridge makes carries its maker's [`owner`] id, so a
//! later imgbridge can tell a dead one's leases (and the ingests under
//! them) from a live one's and release them at once
//! ([`super::orphans`]), rather than leave them to their expiry. A lease
//! whose release found containerd gone (restarting, SIGKILLed) is released
//! again once it answers ([`Containerd::release_lease`]).

use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{
    AddResourceRequest, CreateRequest, DeleteRequest, ListRequest, ListResourcesRequest, Resource,
};

use super::{request, Containerd, Error, Result};
use crate::backoff::Backoff;
use crate::labels::{EXPIRE, OWNER};
use crate::lock::lock;

/// The leases this process made and has not let go of yet, by namespace
/// and id: a lease of its own that containerd lists and this table does
/// not is one whose release failed or whose id was lost, and the sweep
/// ([`super::orphans`]) ends it rather than leave it to its expiry (the
/// hour under faults left one, holding three blobs: docs/reliability.md).
static HELD: LazyLock<Mutex<HashSet<(String, String)>>> = LazyLock::new(Mutex::default);

/// Whether this process still holds lease `id` of `ns`.
pub fn holds(ns: &str, id: &str) -> bool {
    lock(&HELD).contains(&(ns.to_string(), id.to_string()))
}

/// This process's id among imgbridges: random, once per process.
pub fn owner() -> &'static str {
    static OWNER_ID: OnceLock<String> = OnceLock::new();
    OWNER_ID.get_or_init(unique)
}

/// A lease of this process, released when dropped (from a spawned task:
/// a handler cancelled with its client, a session expired) or at once by
/// [`Lease::release`]. One that is never released expires on its own.
#[derive(Debug)]
pub struct Lease {
    c: Containerd,
    ns: String,
    id: String,
    armed: bool,
}

impl Lease {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The lease's id, no longer released on drop: the caller releases it.
    pub fn into_id(mut self) -> String {
        self.armed = false;
        std::mem::take(&mut self.id)
    }

    /// Deletes the lease now, or once containerd is back
    /// ([`Containerd::release_lease`]).
    pub async fn release(mut self) {
        self.armed = false;
        self.c.release_lease(&self.ns, &self.id).await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (c, ns, id) = (
            self.c.clone(),
            std::mem::take(&mut self.ns),
            std::mem::take(&mut self.id),
        );
        rt.spawn(async move { c.release_lease(&ns, &id).await });
    }
}

/// Retries of a release that found containerd gone: soon after a restart
/// (which takes it well under a second), then at most every 30 s.
const RELEASE_RETRY: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(30));

/// A lease as containerd lists it.
#[derive(Clone, Debug)]
pub struct LeaseInfo {
    pub id: String,
    pub labels: HashMap<String, String>,
    /// When containerd made it (`None`: not said).
    pub created: Option<SystemTime>,
}

impl Containerd {
    /// A lease in `ns` that expires after `ttl` even if never released.
    ///
    /// `Leases.Create` runs in a task of its own and hands back a lease
    /// that releases itself when dropped: a caller cancelled while the call
    /// was in flight (its client gone, a timeout) would otherwise leave the
    /// lease containerd made for it, empty and named by nobody, until its
    /// expiry (tests/reconcile.rs shows it with a stopped containerd).
    pub async fn lease(&self, ns: &str, ttl: Duration) -> Result<Lease> {
        let (c, ns) = (self.clone(), ns.to_string());
        tokio::spawn(async move {
            let id = c.make_lease(&ns, ttl).await?;
            Ok(Lease {
                c,
                ns,
                id,
                armed: true,
            })
        })
        .await
        .map_err(|e| Error::Protocol(format!("Leases.Create task: {e}")))?
    }

    /// Creates a lease in `ns` that expires after `ttl` even if never
    /// deleted; the caller deletes it ([`Self::lease`] gives one that
    /// deletes itself).
    pub async fn create_lease(&self, ns: &str, ttl: Duration) -> Result<String> {
        Ok(self.lease(ns, ttl).await?.into_id())
    }

    /// `Leases.Create` of a lease labelled with its expiry and this
    /// process's [`owner`].
    async fn make_lease(&self, ns: &str, ttl: Duration) -> Result<String> {
        let id = format!("imgbridge-{}", unique());
        let expire = time::OffsetDateTime::from(SystemTime::now() + ttl)
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| Error::Protocol(format!("formatting lease expiry: {e}")))?;
        let labels = HashMap::from([
            (EXPIRE.to_string(), expire),
            (OWNER.to_string(), owner().to_string()),
        ]);
        self.leases()
            .create(request(
                ns,
                None,
                CreateRequest {
                    id: id.clone(),
                    labels,
                },
            ))
            .await
            .map_err(Error::status(format!("Leases.Create in {ns}")))?;
        lock(&HELD).insert((ns.to_string(), id.clone()));
        Ok(id)
    }

    /// Adds an existing blob to a lease: containerd answers a COMMIT of an
    /// already present digest with ALREADY_EXISTS without leasing it.
    pub async fn lease_content(&self, ns: &str, id: &str, digest: &str) -> Result<()> {
        self.leases()
            .add_resource(request(
                ns,
                None,
                AddResourceRequest {
                    id: id.into(),
                    resource: Some(Resource {
                        id: digest.into(),
                        r#type: "content".into(),
                    }),
                },
            ))
            .await
            .map_err(Error::status(format!(
                "Leases.AddResource {digest} to {id} in {ns}"
            )))?;
        Ok(())
    }

    /// Releases lease `id` of this process: deleted now, or, when
    /// containerd cannot be reached (a restart, a SIGKILL), again from a
    /// task of its own once it answers, the ingests under it aborted first
    /// ([`Self::end_lease`]). Left to its expiry, such a lease held what it
    /// leased, a half-written ingest included, for up to four hours (the
    /// soak found one per few containerd kills: docs/reliability.md).
    pub async fn release_lease(&self, ns: &str, id: &str) {
        lock(&HELD).remove(&(ns.to_string(), id.to_string()));
        let item = format!("lease {id}");
        match self
            .guarded("Leases.Delete", ns, &item, self.delete_lease(ns, id))
            .await
        {
            Ok(()) => {}
            Err(e) if e.is(tonic::Code::NotFound) => {}
            Err(e) if e.unreachable() => {
                let (c, ns, id) = (self.clone(), ns.to_string(), id.to_string());
                tokio::spawn(async move { c.release_when_back(&ns, &id).await });
            }
            Err(e) => {
                tracing::info!(lease = %id, namespace = %ns, error = %e, "releasing a lease failed; the next sweep of imgbridge's leases ends it");
            }
        }
    }

    /// Retries [`Self::end_lease`] while containerd is unreachable. Each
    /// try is a guarded write: one that broke the connection is held back,
    /// and after a second break not sent again ([`super::breaker`]).
    async fn release_when_back(&self, ns: &str, id: &str) {
        let mut backoff = RELEASE_RETRY;
        let item = format!("lease {id}");
        loop {
            tokio::time::sleep(backoff.next_delay()).await;
            match self
                .guarded("Leases.Delete", ns, &item, self.end_lease(ns, id))
                .await
            {
                Ok(ingests) => {
                    tracing::info!(lease = %id, namespace = %ns, ingests, "released a lease containerd was not there to release");
                    return;
                }
                Err(e) if e.unreachable() => {}
                Err(e) => {
                    tracing::info!(lease = %id, namespace = %ns, error = %e, "releasing a lease failed; the next sweep of imgbridge's leases ends it");
                    return;
                }
            }
        }
    }

    /// Aborts the ingests lease `id` holds (their bytes stay on disk until
    /// aborted or the lease's GC runs), then deletes it; a lease already
    /// gone is done. Returns the ingests aborted.
    pub async fn end_lease(&self, ns: &str, id: &str) -> Result<usize> {
        let ingests = match self.leased_ingests(ns, id).await {
            Ok(refs) => refs,
            Err(e) if e.is(tonic::Code::NotFound) => return Ok(0),
            Err(e) => return Err(e),
        };
        for r in &ingests {
            self.abort_ingest(ns, Some(id), r).await;
        }
        match self.delete_lease(ns, id).await {
            Err(e) if !e.is(tonic::Code::NotFound) => Err(e),
            _ => Ok(ingests.len()),
        }
    }

    /// Releases a lease; GC runs asynchronously (not `sync`).
    pub async fn delete_lease(&self, ns: &str, id: &str) -> Result<()> {
        self.leases()
            .delete(request(
                ns,
                None,
                DeleteRequest {
                    id: id.into(),
                    sync: false,
                },
            ))
            .await
            .map_err(Error::status(format!("Leases.Delete {id} in {ns}")))?;
        Ok(())
    }

    /// The leases of `ns` that carry label `key` (any value).
    pub async fn leases_labelled(&self, ns: &str, key: &str) -> Result<Vec<LeaseInfo>> {
        Ok(self
            .leases()
            .list(request(
                ns,
                None,
                ListRequest {
                    filters: vec![format!("labels.\"{key}\"")],
                },
            ))
            .await
            .map_err(Error::status(format!("Leases.List in {ns}")))?
            .into_inner()
            .leases
            .into_iter()
            .map(|l| LeaseInfo {
                created: l.created_at.and_then(|t| SystemTime::try_from(t).ok()),
                id: l.id,
                labels: l.labels,
            })
            .collect())
    }

    /// The refs of the ingests lease `id` holds.
    pub async fn leased_ingests(&self, ns: &str, id: &str) -> Result<Vec<String>> {
        Ok(self
            .leases()
            .list_resources(request(ns, None, ListResourcesRequest { id: id.into() }))
            .await
            .map_err(Error::status(format!("Leases.ListResources {id} in {ns}")))?
            .into_inner()
            .resources
            .into_iter()
            .filter(|r| r.r#type == "ingests")
            .map(|r| r.id)
            .collect())
    }
}

/// A process-unique random token for lease ids and ingest refs.
pub fn unique() -> String {
    format!("{:016x}", rand::random::<u64>())
}
