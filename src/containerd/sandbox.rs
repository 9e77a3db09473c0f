//! CRI's sandbox (pause) image: every pod on the node starts from it, so a
//! replica must never replace it ([`crate::replicate::protect`]). containerd
//! 1.x reports it in CRI `Status{verbose}`; 2.x moved it to the images
//! plugin's `pinned_images.sandbox`, which no API reports, so it is read
//! from the config file, else it is that release's built-in default.

use std::path::Path;

use super::node_config::parse_version;
use super::{Containerd, Result};

/// The sandbox image from CRI `Status{verbose}`'s `config` JSON (1.x:
/// `sandboxImage`).
pub fn from_status_config(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let s = v.get("sandboxImage")?.as_str()?;
    (!s.is_empty()).then(|| s.to_string())
}

/// The sandbox image a config file sets: `pinned_images.sandbox` of the
/// 2.x images plugin, or `sandbox_image` of a `version = 2` file (which
/// 2.x migrates). `None` when the file does not set it.
pub fn from_config_file(text: &str) -> Option<String> {
    let t: toml::Table = toml::from_str(text).ok()?;
    let plugins = t.get("plugins")?.as_table()?;
    let get = |plugin: &str, path: &[&str]| {
        let mut v = plugins.get(plugin)?;
        for key in path {
            v = v.get(key)?;
        }
        v.as_str().filter(|s| !s.is_empty()).map(str::to_string)
    };
    get("io.containerd.cri.v1.images", &["pinned_images", "sandbox"])
        .or_else(|| get("io.containerd.grpc.v1.cri", &["sandbox_image"]))
}

/// containerd 2.x's built-in sandbox image, by release (its
/// `DefaultSandboxImage`); 1.x always reports it over CRI.
pub fn default_for((major, minor, _): (u64, u64, u64)) -> Option<&'static str> {
    match (major, minor) {
        (2, 0 | 1) => Some("registry.k8s.io/pause:3.10"),
        (2, 2) => Some("registry.k8s.io/pause:3.10.1"),
        (2, _) => Some("registry.k8s.io/pause:3.10.2"),
        _ => None,
    }
}

impl Containerd {
    /// CRI's sandbox image as the running containerd uses it (`None`: no CRI,
    /// or a version that does not say). `config_file`: containerd's config
    /// file, read only where CRI does not report it (2.x).
    pub async fn cri_sandbox_image(&self, config_file: Option<&Path>) -> Result<Option<String>> {
        if let Some(s) = self
            .cri_status_config()
            .await?
            .as_deref()
            .and_then(from_status_config)
        {
            return Ok(Some(s));
        }
        let Some(version) = parse_version(&self.version().await?) else {
            return Ok(None);
        };
        if version.0 < 2 {
            return Ok(None);
        }
        let from_file = config_file
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| from_config_file(&t));
        Ok(from_file.or_else(|| default_for(version).map(str::to_string)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_config_of_1_x_names_it() {
        let j = r#"{"containerd":{"snapshotter":"overlayfs"},"sandboxImage":"registry.k8s.io/pause:3.6"}"#;
        assert_eq!(
            from_status_config(j).as_deref(),
            Some("registry.k8s.io/pause:3.6")
        );
        // 2.x's runtime config has no such key.
        assert_eq!(from_status_config(r#"{"containerd":{}}"#), None);
        assert_eq!(from_status_config(r#"{"sandboxImage":""}"#), None);
        assert_eq!(from_status_config("not json"), None);
    }

    #[test]
    fn config_files_of_each_version() {
        let v3 = "version = 3\n[plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = 'example.test/pause:9'\n";
        assert_eq!(
            from_config_file(v3).as_deref(),
            Some("example.test/pause:9")
        );
        let v2 = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"k8s.gcr.io/pause:3.2\"\n";
        assert_eq!(
            from_config_file(v2).as_deref(),
            Some("k8s.gcr.io/pause:3.2")
        );
        assert_eq!(from_config_file("version = 3\n"), None);
        assert_eq!(from_config_file("[[[ not toml"), None);
    }

    #[test]
    fn built_in_defaults_by_release() {
        assert_eq!(default_for((1, 7, 24)), None);
        assert_eq!(default_for((2, 1, 9)), Some("registry.k8s.io/pause:3.10"));
        assert_eq!(default_for((2, 2, 0)), Some("registry.k8s.io/pause:3.10.1"));
        assert_eq!(default_for((2, 4, 2)), Some("registry.k8s.io/pause:3.10.2"));
    }
}
