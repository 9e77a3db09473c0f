//! CRI's snapshotter against the source namespaces': snapshots belong to
//! one snapshotter and one namespace, so a different one keeps the node's
//! layers in two stores.

use std::collections::HashMap;
use std::path::Path;

use crate::config::Config;
use crate::containerd::Containerd;
use crate::labels::DEFAULT_SNAPSHOTTER as NS_SNAPSHOTTER_LABEL;
use crate::ops::doctor::report::Report;
use crate::ops::doctor::timed;

/// containerd's (and buildkit's containerd worker's) snapshotter on Linux
/// when nothing chooses another.
const DEFAULT_SNAPSHOTTER: &str = "overlayfs";

/// The snapshotter CRI unpacks images with for its default runtime, from
/// CRI `Status{verbose}`'s `config` JSON: that runtime's own `snapshotter`
/// (1.7+), else `containerd.snapshotter` (1.x). 2.x keeps the image
/// snapshotter out of this JSON; `None` then means "ask ImageFsInfo".
pub fn cri_snapshotter(config_json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let ctd = v.get("containerd")?;
    let non_empty = |s: Option<&serde_json::Value>| {
        s.and_then(|s| s.as_str())
            .filter(|s| !s.is_empty())
            .map(String::from)
    };
    let runtime = ctd
        .get("defaultRuntimeName")
        .and_then(|n| n.as_str())
        .and_then(|n| ctd.get("runtimes")?.get(n));
    non_empty(runtime.and_then(|r| r.get("snapshotter")))
        .or_else(|| non_empty(ctd.get("snapshotter")))
}

/// Names the snapshotter behind a CRI image filesystem path: the plugin
/// whose exported root it is, else the `io.containerd.snapshotter.v1.<id>`
/// directory containerd names snapshotter roots after.
pub fn snapshotter_of_path(path: &str, roots: &[(String, String)]) -> Option<String> {
    let path = path.trim_end_matches('/');
    if let Some((id, _)) = roots.iter().find(|(_, r)| r.trim_end_matches('/') == path) {
        return Some(id.clone());
    }
    Path::new(path)
        .file_name()?
        .to_str()?
        .strip_prefix("io.containerd.snapshotter.v1.")
        .filter(|id| !id.is_empty())
        .map(String::from)
}

/// CRI's snapshotter against each source namespace's. Snapshots belong to
/// one snapshotter and one namespace, so CRI unpacks every replica itself on
/// its first container start; a different snapshotter additionally keeps
/// the node's layers in two stores.
pub(in crate::ops::doctor) async fn snapshotters(config: &Config, c: &Containerd, r: &mut Report) {
    let what = "snapshotters";
    let cri = match cri_snapshotter_of(c).await {
        Ok(s) => s,
        Err(e) => {
            r.warn(
                what,
                format!("could not tell CRI's snapshotter: {e}"),
                "check containerd's log for CRI errors",
            );
            return;
        }
    };
    let mut sources = Vec::new();
    for ns in &config.replication.source_namespaces {
        let labels: Option<HashMap<String, String>> = match timed(c.namespace_labels(ns)).await {
            Ok(l) => l,
            Err(e) => {
                r.warn(
                    what,
                    format!("could not read namespace {ns}: {e}"),
                    "check containerd's log",
                );
                return;
            }
        };
        let (sn, why) = match labels.as_ref().and_then(|l| l.get(NS_SNAPSHOTTER_LABEL)) {
            Some(s) => (s.clone(), "namespace label"),
            None => (DEFAULT_SNAPSHOTTER.to_string(), "containerd's default"),
        };
        sources.push((ns.clone(), sn, why));
    }
    let mut described = vec![format!("CRI {cri}")];
    described.extend(
        sources
            .iter()
            .map(|(ns, sn, why)| format!("{ns} {sn} ({why})")),
    );
    let described = described.join(", ");
    if let Some((_, sn, _)) = sources.iter().find(|s| s.1 != cri) {
        r.warn(
            what,
            format!("{described}: fine, CRI unpacks each replica with {cri} on its first start either way (snapshots are per snapshotter and per namespace), but the node keeps layers in two snapshot stores"),
            format!("optional: build with {cri} too (buildkitd.toml [worker.containerd] snapshotter = \"{cri}\"; ctr/nerdctl follow the namespace label {NS_SNAPSHOTTER_LABEL}); {sn} keeps working"),
        );
    } else {
        r.pass(
            what,
            format!("{described}: the same; CRI still unpacks each replica on its first start (snapshots are per namespace)"),
        );
    }
}

/// CRI's snapshotter: from CRI Status's config (1.x), else by naming the
/// snapshotter whose root CRI reports as its image filesystem (2.x).
async fn cri_snapshotter_of(c: &Containerd) -> Result<String, String> {
    if let Some(s) = timed(c.cri_status_config())
        .await?
        .as_deref()
        .and_then(cri_snapshotter)
    {
        return Ok(s);
    }
    let fs = timed(c.cri_image_fs()).await?;
    let first = fs
        .first()
        .ok_or("CRI ImageFsInfo names no image filesystem")?;
    let roots = timed(c.snapshotter_roots()).await?;
    snapshotter_of_path(first, &roots)
        .ok_or_else(|| format!("no snapshotter has CRI's image filesystem {first} as its root"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from CRI `Status{verbose}` `info["config"]` on containerd 1.6.20.
    const STATUS_1_6: &str = r#"{"containerd":{"snapshotter":"overlayfs","defaultRuntimeName":"runc","defaultRuntime":{"runtimeType":""},"runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2"}},"noPivot":false},"cni":{"binDir":"/opt/cni/bin"},"sandboxImage":"registry.k8s.io/pause:3.6","containerdRootDir":"/var/lib/containerd"}"#;

    #[test]
    fn cri_snapshotter_from_status_config() {
        assert_eq!(cri_snapshotter(STATUS_1_6).as_deref(), Some("overlayfs"));
        // 1.7+: the default runtime's own snapshotter wins.
        let per_runtime = STATUS_1_6.replace(
            r#""runtimeType":"io.containerd.runc.v2""#,
            r#""runtimeType":"io.containerd.runc.v2","snapshotter":"native""#,
        );
        assert_eq!(cri_snapshotter(&per_runtime).as_deref(), Some("native"));
        // 2.x: no global snapshotter here, an empty per-runtime one.
        let v2 = r#"{"containerd":{"defaultRuntimeName":"runc","runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2","snapshotter":""}}},"containerdRootDir":"/var/lib/containerd"}"#;
        assert_eq!(cri_snapshotter(v2), None);
        assert_eq!(cri_snapshotter("not json"), None);
        assert_eq!(cri_snapshotter("{}"), None);
    }

    #[test]
    fn names_the_snapshotter_of_a_path() {
        let roots = vec![
            (
                "overlayfs".to_string(),
                "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs".to_string(),
            ),
            ("fuse".to_string(), "/data/fuse-root/".to_string()),
        ];
        assert_eq!(
            snapshotter_of_path(
                "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs",
                &roots
            )
            .as_deref(),
            Some("overlayfs")
        );
        assert_eq!(
            snapshotter_of_path("/data/fuse-root", &roots).as_deref(),
            Some("fuse")
        );
        assert_eq!(
            snapshotter_of_path("/x/io.containerd.snapshotter.v1.native/", &[]).as_deref(),
            Some("native")
        );
        assert_eq!(
            snapshotter_of_path("/x/io.containerd.snapshotter.v1.", &[]),
            None
        );
        assert_eq!(snapshotter_of_path("/x/elsewhere", &roots), None);
    }
}
