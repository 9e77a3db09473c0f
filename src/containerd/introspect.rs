//! Questions `doctor` asks about a node: which plugins are loaded, which
//! snapshotter CRI unpacks with, a namespace's default labels. Read-only.

use std::collections::HashMap;

use containerd_client::services::v1 as api;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{ImageFsInfoRequest, StatusRequest};

use super::{Containerd, Error, Result};

/// How a plugin answered Introspection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginState {
    /// Not registered: not built in, or listed in `disabled_plugins`.
    Absent,
    Loaded,
    /// Registered, but its init failed with this message.
    Failed(String),
}

impl Containerd {
    /// The plugins matching one Introspection filter (`type==…,id==…`).
    pub async fn plugins(&self, filter: &str) -> Result<Vec<api::Plugin>> {
        let r = self
            .introspection()
            .plugins(api::PluginsRequest {
                filters: vec![filter.into()],
            })
            .await
            .map_err(Error::status("Introspection.Plugins"))?;
        Ok(r.into_inner().plugins)
    }

    /// State of plugin `ty`/`id`.
    pub async fn plugin_state(&self, ty: &str, id: &str) -> Result<PluginState> {
        let ps = self.plugins(&format!("type=={ty},id=={id}")).await?;
        Ok(match ps.first() {
            None => PluginState::Absent,
            Some(p) => match &p.init_err {
                None => PluginState::Loaded,
                Some(e) => PluginState::Failed(e.message.clone()),
            },
        })
    }

    /// `(id, root directory)` of every snapshotter plugin that exports one,
    /// to name the snapshotter behind a CRI image filesystem path.
    pub async fn snapshotter_roots(&self) -> Result<Vec<(String, String)>> {
        let ps = self.plugins("type==io.containerd.snapshotter.v1").await?;
        Ok(ps
            .into_iter()
            .filter_map(|p| Some((p.id, p.exports.get("root")?.clone())))
            .collect())
    }

    /// CRI `Status{verbose}`'s `info["config"]`: CRI's effective runtime
    /// configuration as a JSON string (its layout differs between 1.x and 2.x).
    pub async fn cri_status_config(&self) -> Result<Option<String>> {
        let r = RuntimeServiceClient::new(self.channel())
            .max_decoding_message_size(super::MAX_MESSAGE)
            .status(StatusRequest { verbose: true })
            .await
            .map_err(Error::status("CRI Status"))?;
        Ok(r.into_inner().info.remove("config"))
    }

    /// Mount points of CRI's image filesystems, the default snapshotter's first.
    pub async fn cri_image_fs(&self) -> Result<Vec<String>> {
        let r = k8s_cri::v1::image_service_client::ImageServiceClient::new(self.channel())
            .image_fs_info(ImageFsInfoRequest {})
            .await
            .map_err(Error::status("CRI ImageFsInfo"))?;
        Ok(r.into_inner()
            .image_filesystems
            .into_iter()
            .filter_map(|f| f.fs_id.map(|i| i.mountpoint))
            .collect())
    }

    /// The names of every namespace.
    pub async fn list_namespaces(&self) -> Result<Vec<String>> {
        Ok(self
            .namespaces()
            .list(api::ListNamespacesRequest::default())
            .await
            .map_err(Error::status("Namespaces.List"))?
            .into_inner()
            .namespaces
            .into_iter()
            .map(|n| n.name)
            .collect())
    }

    /// Labels of namespace `name`, `None` if it does not exist.
    pub async fn namespace_labels(&self, name: &str) -> Result<Option<HashMap<String, String>>> {
        match self
            .namespaces()
            .get(api::GetNamespaceRequest { name: name.into() })
            .await
        {
            Ok(r) => Ok(Some(
                r.into_inner()
                    .namespace
                    .map(|n| n.labels)
                    .unwrap_or_default(),
            )),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(Error::status(format!("Namespaces.Get {name}"))(s)),
        }
    }
}
