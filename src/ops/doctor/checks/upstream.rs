//! containerd itself: reachable, and what it offers imgbridge (content
//! sharing, CRI); then the checks that need it answering.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use super::containerd_config::containerd_config;
use super::snapshotters::snapshotters;
use super::version::{pinned, transfer, version_matrix};
use crate::config::Config;
use crate::containerd::Containerd;
use crate::ops::doctor::report::Report;
use crate::ops::doctor::versions::Version;
use crate::ops::doctor::{config_candidates, mirror, timed, CONFIG_ENV};

/// Upstream reachability, version, pinned label, sharing policy, CRI.
/// Returns whether containerd answered.
pub(in crate::ops::doctor) async fn upstream_checks(config: &Config, r: &mut Report) -> bool {
    let sock = &config.upstream;
    let Some((c, version)) = reach(sock, r).await else {
        return false;
    };
    r.pass(
        "upstream",
        format!("containerd {version} answers at {}", sock.display()),
    );
    let parsed = Version::parse(&version);
    version_matrix(&version, parsed, r);
    pinned(config, &version, r);
    transfer(&c, &version, parsed, r).await;
    let env = std::env::var_os(CONFIG_ENV).map(PathBuf::from);
    containerd_config(
        &version,
        parsed,
        env.as_deref(),
        &config_candidates(sock),
        r,
    );
    sharing(&c, r).await;
    let cri = timed(c.has_cri()).await;
    cri_plugin(&cri, r);
    let cri_loaded = matches!(cri, Ok(true));
    match cri {
        Ok(true) => snapshotters(config, &c, r).await,
        Ok(false) => r.pass("snapshotters", "not compared: the CRI plugin is not loaded"),
        Err(_) => r.pass(
            "snapshotters",
            "not compared: cannot tell whether the CRI plugin is loaded",
        ),
    }
    if cri_loaded {
        let tuple = parsed.map(|v| (v.major, v.minor, v.patch));
        mirror::checks(&c, tuple, env.as_deref(), &config_candidates(sock), r).await;
    }
    true
}

/// containerd at `sock`, and its version; `None` (reported) when there is
/// no socket there or nothing answers.
async fn reach(sock: &Path, r: &mut Report) -> Option<(Containerd, String)> {
    let fix_reach = "start containerd (systemctl start containerd), or point --upstream / upstream = at its socket \
         (k3s: /run/k3s/containerd/containerd.sock; drop-in swap: /run/containerd/containerd-real.sock)";
    match std::fs::symlink_metadata(sock) {
        Err(e) => {
            r.fail("upstream", format!("{}: {e}", sock.display()), fix_reach);
            return None;
        }
        Ok(m) if !m.file_type().is_socket() && !m.file_type().is_symlink() => {
            r.fail(
                "upstream",
                format!("{} exists but is not a socket", sock.display()),
                fix_reach,
            );
            return None;
        }
        Ok(_) => {}
    }
    let c = Containerd::new(sock);
    let version = match timed(c.version()).await {
        Ok(v) => v,
        Err(e) => {
            r.fail(
                "upstream",
                format!("{} does not answer: {e}", sock.display()),
                fix_reach,
            );
            return None;
        }
    };
    Some((c, version))
}

/// Whether replication can link blobs instead of copying them.
async fn sharing(c: &Containerd, r: &mut Report) {
    match timed(c.sharing_policy()).await {
        Ok(p) if p == "shared" => r.pass(
            "content sharing",
            "policy \"shared\": replication links blobs without copying bytes",
        ),
        Ok(p) => r.warn(
            "content sharing",
            format!("policy {p:?}: every replicated blob is copied byte for byte (slower, uses disk)"),
            "set content_sharing_policy = \"shared\" under [plugins.\"io.containerd.metadata.v1.bolt\"] in containerd's config and restart it",
        ),
        Err(e) => r.warn(
            "content sharing",
            format!("could not read the policy: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
}

/// Whether CRI is there to use (and confirm) replicas.
fn cri_plugin(cri: &Result<bool, String>, r: &mut Report) {
    match cri {
        Ok(true) => r.pass(
            "CRI plugin",
            "loaded: replicas are confirmed with CRI ImageStatus",
        ),
        Ok(false) => r.warn(
            "CRI plugin",
            "not loaded: kubelet cannot use replicas and imgbridge cannot confirm they are visible",
            "remove \"cri\" from disabled_plugins in containerd's config and restart it",
        ),
        Err(e) => r.warn(
            "CRI plugin",
            format!("could not tell: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
}
