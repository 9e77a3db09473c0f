//! Which proxied calls trigger replication: image writes and deletes in a
//! source namespace. This is the policy the transport knows nothing about.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use containerd_client::services::v1::TransferRequest;
use prost::Message;

use containerd_client::services::v1::{
    CreateImageRequest, CreateImageResponse, DeleteImageRequest, Image, UpdateImageRequest,
    UpdateImageResponse,
};

use super::commit::{WriteWatch, WRITE};
use super::Replicator;
use crate::containerd::Descriptor;
use crate::proxy::intercept::{
    typed, CallInfo, Hook, HookFuture, Interceptor, StreamWatch, WatchFuture,
};

pub const CREATE: &str = "/containerd.services.images.v1.Images/Create";
pub const UPDATE: &str = "/containerd.services.images.v1.Images/Update";
pub const DELETE: &str = "/containerd.services.images.v1.Images/Delete";
pub const TRANSFER: &str = "/containerd.services.transfer.v1.Transfer/Transfer";
/// Transfer destination that stores images (pull, tag, import).
pub const IMAGE_STORE: &str = "containerd.types.transfer.ImageStore";

/// Interceptor holding image writes in source namespaces until replicated.
pub struct ImageHooks {
    r: Arc<Replicator>,
}

impl ImageHooks {
    pub fn new(r: Arc<Replicator>) -> Self {
        ImageHooks { r }
    }

    /// A write straight into `k8s.io`, held only with `confirm_direct_writes`.
    fn direct(&self, call: &CallInfo, ns: &str) -> Option<Box<dyn Hook>> {
        let held = self.r.settings().confirm_direct
            && ns == super::CRI_NAMESPACE
            && matches!(&*call.method, CREATE | UPDATE);
        held.then(|| {
            Box::new(DirectWrite {
                r: self.r.clone(),
                create: &*call.method == CREATE,
            }) as Box<dyn Hook>
        })
    }
}

/// The image a Create (`create`) or Update reply carries.
fn written(create: bool, response: Bytes) -> Result<Option<Image>, prost::DecodeError> {
    match create {
        true => CreateImageResponse::decode(response).map(|r| r.image),
        false => UpdateImageResponse::decode(response).map(|r| r.image),
    }
}

impl Interceptor for ImageHooks {
    fn select(&self, call: &CallInfo) -> Option<Box<dyn Hook>> {
        // Every call comes through here: the method test first, allocation
        // only for a call that is held.
        if !matches!(&*call.method, CREATE | UPDATE | DELETE | TRANSFER) {
            return None;
        }
        let ns = call.namespace.as_deref()?;
        if !self.r.is_source(ns) {
            return self.direct(call, ns);
        }
        let (r, ns) = (self.r.clone(), ns.to_string());
        match &*call.method {
            CREATE | UPDATE => Some(Box::new(ImageWrite {
                r,
                ns,
                create: &*call.method == CREATE,
            })),
            DELETE => Some(typed(move |req: DeleteImageRequest, _: ()| async move {
                // The source delete succeeded; a failure to apply the policy
                // is logged, never turned into an error for the caller.
                if let Err(e) = r.on_delete(&ns, &req.name).await {
                    tracing::warn!(image = %req.name, error = %e, "applying delete_policy failed");
                }
                Ok(())
            })),
            TRANSFER => Some(Box::new(TransferHook {
                r,
                ns,
                before: None,
            })),
            _ => None,
        }
    }

    fn watch(&self, call: &CallInfo) -> Option<Box<dyn StreamWatch>> {
        if &*call.method != WRITE {
            return None;
        }
        let ns = call
            .namespace
            .as_deref()
            .filter(|ns| self.r.is_source(ns))?;
        Some(Box::new(WriteWatch::new(self.r.clone(), ns.to_string())))
    }
}

/// Images Create / Update: replicate the image the reply names before the
/// reply goes back; if the client resets the call after containerd got it,
/// replicate the name the request gave anyway, detached.
struct ImageWrite {
    r: Arc<Replicator>,
    ns: String,
    create: bool,
}

impl Hook for ImageWrite {
    fn after(self: Box<Self>, _request: Bytes, response: Bytes) -> HookFuture<'static> {
        let image = written(self.create, response);
        Box::pin(async move {
            let method = if self.create { CREATE } else { UPDATE };
            match image {
                Ok(Some(img)) => self.r.on_write(method, &self.ns, &img.name, img.target).await,
                Ok(None) => Ok(()),
                Err(e) => Err(tonic::Status::internal(format!(
                    "imgbridge could not decode the call to act on it (the upstream call succeeded): {e}"
                ))),
            }
        })
    }

    fn abandoned(self: Box<Self>, request: Bytes) -> Option<WatchFuture> {
        let name = match self.create {
            true => CreateImageRequest::decode(request).ok()?.image?.name,
            false => UpdateImageRequest::decode(request).ok()?.image?.name,
        };
        let (r, ns) = (self.r, self.ns);
        Some(Box::pin(async move { r.on_abandoned(&ns, &name) }))
    }
}

/// Images Create / Update straight into `k8s.io` (`confirm_direct_writes`):
/// the reply waits until CRI resolves the name. A reply that does not
/// decode is passed on as it is: this write is the client's, not ours.
struct DirectWrite {
    r: Arc<Replicator>,
    create: bool,
}

impl Hook for DirectWrite {
    fn after(self: Box<Self>, _request: Bytes, response: Bytes) -> HookFuture<'static> {
        let image = written(self.create, response);
        Box::pin(async move {
            if let Ok(Some(img)) = image {
                let method = if self.create { CREATE } else { UPDATE };
                self.r.on_direct_write(method, &img.name, img.target).await;
            }
            Ok(())
        })
    }
}

/// Transfer (containerd 1.7/2.x) stores images server-side, so the names
/// are not on the wire: list the namespace before and after, replicate what
/// changed.
struct TransferHook {
    r: Arc<Replicator>,
    ns: String,
    before: Option<HashMap<String, Snapshot>>,
}

type Snapshot = (Option<Descriptor>, Option<prost_types::Timestamp>);

impl TransferHook {
    async fn snapshot(&self) -> Result<HashMap<String, Snapshot>, tonic::Status> {
        let images = self
            .r
            .containerd()
            .list_images(&self.ns, Vec::new())
            .await
            .map_err(|e| {
                tonic::Status::unavailable(format!(
                    "imgbridge: listing images in {} around Transfer: {e}",
                    self.ns
                ))
            })?;
        Ok(images
            .into_iter()
            .map(|i| (i.name, (i.target, i.updated_at)))
            .collect())
    }
}

impl Hook for TransferHook {
    fn wants_before(&self) -> bool {
        true
    }

    fn before<'a>(&'a mut self, request: &'a Bytes) -> HookFuture<'a> {
        Box::pin(async move {
            let Ok(req) = TransferRequest::decode(request.clone()) else {
                return Ok(()); // containerd judges malformed requests
            };
            let stores_images = req.destination.as_ref().is_some_and(|d| {
                d.type_url.trim_start_matches("type.googleapis.com/") == IMAGE_STORE
            });
            if stores_images {
                self.before = Some(self.snapshot().await?);
            }
            Ok(())
        })
    }

    fn after(self: Box<Self>, _request: Bytes, _response: Bytes) -> HookFuture<'static> {
        Box::pin(async move {
            let Some(before) = &self.before else {
                return Ok(());
            };
            let after = self.snapshot().await?;
            let mut changed: Vec<_> = after
                .iter()
                .filter(|(name, snap)| before.get(*name) != Some(snap))
                .map(|(name, _)| name.clone())
                .collect();
            changed.sort();
            // Every name is replicated even if one is refused or fails: the
            // client hears of the first such.
            let mut first_err = None;
            for name in changed {
                if let Err(e) = self.r.on_write(TRANSFER, &self.ns, &name, None).await {
                    first_err.get_or_insert(e);
                }
            }
            // Blobs it fetched for images replicated earlier.
            self.r.source_written(&self.ns).await;
            first_err.map_or(Ok(()), Err)
        })
    }
}
