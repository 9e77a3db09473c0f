//! Image records.

use containerd_client::services::v1::{
    CreateImageRequest, DeleteImageRequest, GetImageRequest, Image, ListImagesRequest,
    UpdateImageRequest,
};

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
        let r = self
            .images()
            .create(request(
                ns,
                None,
                CreateImageRequest {
                    image: Some(image),
                    ..Default::default()
                },
            ))
            .await
            .map_err(Error::status(op.clone()))?;
        replied_image(r.into_inner().image, &op)
    }

    /// Update; an empty `mask` replaces the whole record (labels and target).
    pub async fn update_image(&self, ns: &str, image: Image, mask: Vec<String>) -> Result<Image> {
        let op = format!("Images.Update {} in {ns}", image.name);
        let r = self
            .images()
            .update(request(
                ns,
                None,
                UpdateImageRequest {
                    image: Some(image),
                    update_mask: (!mask.is_empty())
                        .then_some(prost_types::FieldMask { paths: mask }),
                    ..Default::default()
                },
            ))
            .await
            .map_err(Error::status(op.clone()))?;
        replied_image(r.into_inner().image, &op)
    }

    /// Sets `labels` on image `name` and touches nothing else (an empty
    /// value removes the label). `None` when the image is gone.
    pub async fn update_image_labels(
        &self,
        ns: &str,
        name: &str,
        labels: std::collections::HashMap<String, String>,
    ) -> Result<Option<Image>> {
        let mask = labels.keys().map(|k| format!("labels.{k}")).collect();
        let image = Image {
            name: name.into(),
            labels,
            ..Default::default()
        };
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
                op: format!("Images.Delete {name} in {ns}"),
                status,
            }),
        }
    }
}

/// The image a Create or Update reply carries; containerd always sends one.
fn replied_image(image: Option<Image>, op: &str) -> Result<Image> {
    image.ok_or_else(|| Error::Protocol(format!("{op}: reply without image")))
}
