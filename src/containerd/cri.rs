//! CRI calls on containerd's socket: the kubelet's view of images.

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::{ImageSpec, ImageStatusRequest, ListImagesRequest, PullImageRequest};

use super::{Containerd, Error, Result};

impl Containerd {
    fn cri_images(&self) -> ImageServiceClient<tonic::transport::Channel> {
        ImageServiceClient::new(self.channel()).max_decoding_message_size(super::MAX_MESSAGE)
    }

    /// CRI `ImageStatus`: the image id (config digest) CRI resolves `name`
    /// to, or `None` if kubelet would not find it.
    pub async fn cri_image_id(&self, name: &str) -> Result<Option<String>> {
        let r = self
            .cri_images()
            .image_status(ImageStatusRequest {
                image: Some(ImageSpec {
                    image: name.into(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .map_err(Error::status(format!("CRI ImageStatus {name}")))?;
        Ok(r.into_inner().image.map(|i| i.id))
    }

    /// CRI `PullImage`: pulls through containerd's registry configuration
    /// (mirrors, auth) into `k8s.io`; returns the image reference.
    pub async fn cri_pull(&self, name: &str) -> Result<String> {
        let r = self
            .cri_images()
            .pull_image(PullImageRequest {
                image: Some(ImageSpec {
                    image: name.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .map_err(Error::status(format!("CRI PullImage {name}")))?;
        Ok(r.into_inner().image_ref)
    }

    /// CRI `ListImages`: every image kubelet sees, as (id, its names: repo
    /// tags and repo digests).
    pub async fn cri_list_images(&self) -> Result<Vec<(String, Vec<String>)>> {
        let r = self
            .cri_images()
            .list_images(ListImagesRequest { filter: None })
            .await
            .map_err(Error::status("CRI ListImages".to_string()))?;
        Ok(r.into_inner()
            .images
            .into_iter()
            .map(|i| {
                let mut names = i.repo_tags;
                names.extend(i.repo_digests);
                (i.id, names)
            })
            .collect())
    }
}
