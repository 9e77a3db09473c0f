//! Leases keep blobs alive between their commit and the image record that
//! references them. They are per namespace and must be created in the
//! target.
//!
//! Every lease imgbridge makes carries its maker's [`owner`] id, so a
//! later imgbridge can tell a dead one's leases (and the ingests under
//! them) from a live one's and release them at once
//! ([`super::orphans`]), rather than leave them to their expiry.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{
    AddResourceRequest, CreateRequest, DeleteRequest, ListRequest, ListResourcesRequest, Resource,
};

use super::{request, Containerd, Error, Result};
use crate::labels::{EXPIRE, OWNER};

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

    /// Deletes the lease now (best effort: it expires anyway).
    pub async fn release(mut self) {
        self.armed = false;
        delete_quietly(&self.c, &self.ns, &self.id).await;
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
        rt.spawn(async move { delete_quietly(&c, &ns, &id).await });
    }
}

async fn delete_quietly(c: &Containerd, ns: &str, id: &str) {
    if let Err(e) = c.delete_lease(ns, id).await {
        if !e.is(tonic::Code::NotFound) {
            tracing::debug!(lease = %id, namespace = %ns, error = %e, "releasing a lease failed; it expires on its own");
        }
    }
}

/// A lease as containerd lists it.
#[derive(Clone, Debug)]
pub struct LeaseInfo {
    pub id: String,
    pub labels: HashMap<String, String>,
}

impl Containerd {
    /// A lease in `ns` that expires after `ttl` even if never released.
    pub async fn lease(&self, ns: &str, ttl: Duration) -> Result<Lease> {
        let id = self.create_lease(ns, ttl).await?;
        Ok(Lease {
            c: self.clone(),
            ns: ns.into(),
            id,
            armed: true,
        })
    }

    /// Creates a lease in `ns` that expires after `ttl` even if never
    /// deleted, labelled with this process's [`owner`]; the caller deletes
    /// it ([`Self::lease`] gives one that deletes itself).
    pub async fn create_lease(&self, ns: &str, ttl: Duration) -> Result<String> {
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
