//! Which proxied calls trigger replication: image writes and deletes in a
//! source namespace. This is the policy the transport knows nothing about.

use std::sync::Arc;

use containerd_client::services::v1::{
    CreateImageRequest, CreateImageResponse, DeleteImageRequest, UpdateImageRequest,
    UpdateImageResponse,
};

use super::Replicator;
use crate::proxy::intercept::{typed, CallInfo, Hook, Interceptor};

pub const CREATE: &str = "/containerd.services.images.v1.Images/Create";
pub const UPDATE: &str = "/containerd.services.images.v1.Images/Update";
pub const DELETE: &str = "/containerd.services.images.v1.Images/Delete";

/// Interceptor holding image writes in source namespaces until replicated.
pub struct ImageHooks {
    r: Arc<Replicator>,
}

impl ImageHooks {
    pub fn new(r: Arc<Replicator>) -> Self {
        ImageHooks { r }
    }
}

impl Interceptor for ImageHooks {
    fn select(&self, call: &CallInfo) -> Option<Box<dyn Hook>> {
        let ns = call
            .namespace
            .as_deref()
            .filter(|ns| self.r.is_source(ns))?
            .to_string();
        let r = self.r.clone();
        match call.method.as_str() {
            CREATE => Some(typed(
                move |_: CreateImageRequest, resp: CreateImageResponse| async move {
                    match resp.image {
                        Some(img) => r.on_write(&ns, &img.name).await,
                        None => Ok(()),
                    }
                },
            )),
            UPDATE => Some(typed(
                move |_: UpdateImageRequest, resp: UpdateImageResponse| async move {
                    match resp.image {
                        Some(img) => r.on_write(&ns, &img.name).await,
                        None => Ok(()),
                    }
                },
            )),
            DELETE => Some(typed(move |req: DeleteImageRequest, _: ()| async move {
                // The source delete succeeded; a failure to apply the policy
                // is logged, never turned into an error for the caller.
                if let Err(e) = r.on_delete(&ns, &req.name).await {
                    tracing::warn!(image = %req.name, error = %e, "applying delete_policy failed");
                }
                Ok(())
            })),
            _ => None,
        }
    }
}
