//! Image records.

use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::{
    CreateImageRequest, DeleteImageRequest, GetImageRequest, Image, ListImagesRequest,
    UpdateImageRequest,
};

use tonic::transport::Channel;

use super::{request, Containerd, Error, Result};

impl Containerd {
    pub async fn get_image(&self, ns: &str, name: &str) -> Result<Option<Image>> {
        match self
            .images()
            .get(request(ns, None, GetImageRequest { name: name.into() }))
            .await
        {
            Ok(r) => Ok(r.into_inner().image),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(Error::Status {
                op: format!("Images.Get {name} in {ns}"),
                status,
            }),
        }
    }

    /// Lists images in `ns` (filters as containerd understands them).
    pub async fn list_images(&self, ns: &str, filters: Vec<String>) -> Result<Vec<Image>> {
        Ok(self
            .images()
            .list(request(ns, None, ListImagesRequest { filters }))
            .await
            .map_err(Error::status(format!("Images.List in {ns}")))?
            .into_inner()
            .images)
    }

    pub async fn create_image(&self, ns: &str, image: Image) -> Result<Image> {
        let op = format!("Images.Create {} in {ns}", image.name);
        self.write_record(op, ns, image, |mut c, image| async move {
            let req = CreateImageRequest {
                image: Some(image),
                ..Default::default()
            };
            c.create(request(ns, None, req))
                .await
                .map(|r| r.into_inner().image)
        })
        .await
    }

    /// Update; an empty `mask` replaces the whole record (labels and target).
    /// `image` is always the whole record, even when the mask names only
    /// labels: see `with_target`.
    pub async fn update_image(&self, ns: &str, image: Image, mask: Vec<String>) -> Result<Image> {
        let op = format!("Images.Update {} in {ns}", image.name);
        self.write_record(op, ns, image, |mut c, image| async move {
            let req = UpdateImageRequest {
                image: Some(image),
                update_mask: (!mask.is_empty()).then_some(prost_types::FieldMask { paths: mask }),
                ..Default::default()
            };
            c.update(request(ns, None, req))
                .await
                .map(|r| r.into_inner().image)
        })
        .await
    }

    /// One Create or Update of `image`: refused without a complete target
    /// ([`with_target`]), sent under the breaker; the record containerd
    /// stored.
    async fn write_record<F, Fut>(
        &self,
        op: String,
        ns: &str,
        image: Image,
        send: F,
    ) -> Result<Image>
    where
        F: FnOnce(ImagesClient<Channel>, Image) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<Option<Image>, tonic::Status>>,
    {
        let image = with_target(image, &op)?;
        let name = image.name.clone();
        let call = async {
            send(self.images(), image)
                .await
                .map_err(Error::status(op.clone()))
        };
        let stored = self.guarded(&op, ns, &name, call).await?;
        replied_image(stored, &op)
    }

    /// Sets `labels` on image `name` and touches nothing else (an empty
    /// value removes the label). `None` when the image is gone.
    ///
    /// The request carries the current record (name, target, labels) with
    /// the changes applied, and a mask naming only the changed labels: the
    /// mask keeps a target that moved since the read, and the target keeps
    /// containerd 1.7/2.x alive (see `with_target`). Callers serialise
    /// writes to one record (the replicator's per-name lock, the importer's
    /// single task), so the labels read here are the ones being changed.
    pub async fn update_image_labels(
        &self,
        ns: &str,
        name: &str,
        labels: std::collections::HashMap<String, String>,
    ) -> Result<Option<Image>> {
        let Some(mut image) = self.get_image(ns, name).await? else {
            return Ok(None);
        };
        let mask = labels.keys().map(|k| format!("labels.{k}")).collect();
        for (k, v) in labels {
            if v.is_empty() {
                image.labels.remove(&k);
            } else {
                image.labels.insert(k, v);
            }
        }
        match self.update_image(ns, image, mask).await {
            Ok(i) => Ok(Some(i)),
            Err(e) if e.is(tonic::Code::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Create, or replace the whole record when the name exists (and create
    /// again if it vanished in between), like containerd's own clients do.
    pub async fn put_image(&self, ns: &str, image: Image) -> Result<Image> {
        for _ in 0..3 {
            match self.create_image(ns, image.clone()).await {
                Err(e) if e.is(tonic::Code::AlreadyExists) => {}
                other => return other,
            }
            match self.update_image(ns, image.clone(), Vec::new()).await {
                Err(e) if e.is(tonic::Code::NotFound) => {}
                other => return other,
            }
        }
        Err(Error::Protocol(format!(
            "image {} in {ns} kept appearing and disappearing; giving up",
            image.name
        )))
    }

    /// Deletes an image; a missing one is not an error.
    pub async fn delete_image(&self, ns: &str, name: &str, sync: bool) -> Result<()> {
        let op = format!("Images.Delete {name} in {ns}");
        let call = async {
            match self
                .images()
                .delete(request(
                    ns,
                    None,
                    DeleteImageRequest {
                        name: name.into(),
                        sync,
                        ..Default::default()
                    },
                ))
                .await
            {
                Ok(_) => Ok(()),
                Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
                Err(status) => Err(Error::Status {
                    op: op.clone(),
                    status,
                }),
            }
        };
        self.guarded(&op, ns, name, call).await
    }
}

/// containerd 1.7 and 2.x convert the record's target before they look at
/// the mask and dereference it unchecked: an Images.Create or Update without
/// one kills the whole daemon (1.6 accepted it). Such a request is refused
/// here, before anything is sent, whatever the caller built.
fn with_target(image: Image, op: &str) -> Result<Image> {
    match &image.target {
        Some(t) if !t.digest.is_empty() && !t.media_type.is_empty() && t.size > 0 => Ok(image),
        _ => Err(Error::Protocol(format!(
            "{op}: refusing to send an image record without a complete target \
             (containerd 1.7 and 2.x crash on it); this is a bug in imgbridge"
        ))),
    }
}

/// The image a Create or Update reply carries; containerd always sends one.
fn replied_image(image: Option<Image>, op: &str) -> Result<Image> {
    image.ok_or_else(|| Error::Protocol(format!("{op}: reply without image")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::containerd::Descriptor;

    fn image(target: Option<Descriptor>) -> Image {
        Image {
            name: "docker.io/library/a:1".into(),
            target,
            ..Default::default()
        }
    }

    #[test]
    fn a_record_without_a_complete_target_is_never_sent() {
        assert!(with_target(image(None), "Images.Update").is_err());
        let partial = Descriptor {
            digest: "sha256:ab".into(),
            ..Default::default()
        };
        assert!(with_target(image(Some(partial)), "Images.Update").is_err());
        let full = Descriptor {
            media_type: crate::labels::MediaType::ImageManifest.to_string(),
            digest: "sha256:ab".into(),
            size: 2,
            ..Default::default()
        };
        assert!(with_target(image(Some(full)), "Images.Update").is_ok());
    }
}
