//! Leases keep blobs alive between their commit and the image record that
//! references them. They are per namespace and must be created in the target.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{AddResourceRequest, CreateRequest, DeleteRequest, Resource};

use super::{request, Containerd, Error, Result};

/// Makes containerd's GC drop the lease after a deadline, so a crashed
/// imgbridge never leaks content.
use crate::labels::EXPIRE;

impl Containerd {
    /// Creates a lease in `ns` that expires after `ttl` even if never deleted.
    pub async fn create_lease(&self, ns: &str, ttl: Duration) -> Result<String> {
        let id = format!("imgbridge-{}", unique());
        let expire = time::OffsetDateTime::from(SystemTime::now() + ttl)
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| Error::Protocol(format!("formatting lease expiry: {e}")))?;
        let mut labels = HashMap::new();
        labels.insert(EXPIRE.to_string(), expire);
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
}

/// A process-unique random token for lease ids and ingest refs.
pub fn unique() -> String {
    format!("{:016x}", rand::random::<u64>())
}
