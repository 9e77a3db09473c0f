//! `imgbridge doctor`: checks a node and says what to fix, one line per
//! check: `✓` fine, `!` works but worth fixing, `✗` broken (exit status 1).
//!
//! Besides imgbridge's own setup it reports the containerd facts that change
//! imgbridge's behaviour: version (against [`TESTED`]), pinned-label support,
//! the Transfer service, the config file's `version`, content sharing, CRI,
//! and CRI's snapshotter against the source namespaces'. containerd's config
//! file is not visible over its API, so doctor reads it from disk: the path in
//! `IMGBRIDGE_CONTAINERD_CONFIG` ([`CONFIG_ENV`]) if set, else the first of
//! [`CONFIG_PATHS`] that exists.
//!
//! On a node with CRI it also checks sharing images with other nodes
//! through a node-local registry mirror ([`mirror`]).

pub mod mirror;
mod protected;

mod checks;
pub mod report;
pub mod versions;

use std::fmt::Display;
use std::time::Duration;

use crate::config::Config;

pub use crate::containerd::node_config::{
    candidates as config_candidates, parse_version, CONFIG_ENV, CONFIG_PATHS,
};
pub use checks::containerd_config::config_file_version;
pub use checks::snapshotters::{cri_snapshotter, snapshotter_of_path};
pub use report::{Check, Level, Report, Verdict};
pub use versions::{
    matrix, native_config_version, pinned_support, ships_transfer, Matrix, PinnedSupport, Version,
    TESTED,
};

/// Upper bound for each question asked to containerd or the proxy.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) async fn timed<T, E: Display>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

/// Runs every check for `config`. `load_error` is the configuration file's
/// error, if it could not be loaded (the other checks then use defaults).
/// containerd's own config file is read from `$IMGBRIDGE_CONTAINERD_CONFIG`
/// or the usual paths ([`CONFIG_PATHS`]).
pub async fn run(config: &Config, load_error: Option<&dyn Display>) -> Report {
    let mut r = Report::default();
    match load_error {
        Some(e) => r.fail(
            "configuration",
            e.to_string(),
            "correct the file (imgbridge serve --print-config shows every key with its default)",
        ),
        None => match config.validate() {
            Ok(()) => r.pass(
                "configuration",
                format!(
                    "valid; replicating {} → {}",
                    config.replication.source_namespaces.join(", "),
                    config.replication.target_namespaces.join(", ")
                ),
            ),
            Err(e) => r.fail("configuration", e.to_string(), "correct the named key"),
        },
    }
    // Under the socket swap the service's upstream is containerd's real
    // socket; the file's (the default path) is imgbridge itself then.
    let swapped;
    let config = match checks::systemd::sockets(config, &mut r) {
        Some(up) => {
            swapped = Config {
                upstream: up,
                ..config.clone()
            };
            &swapped
        }
        None => config,
    };
    if checks::upstream::upstream_checks(config, &mut r).await {
        checks::node::namespaces(config, &mut r).await;
    }
    checks::node::proxy_socket(config, &mut r).await;
    checks::node::watched_dirs(config, &mut r);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_upstream_fails() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            upstream: dir.path().join("none.sock"),
            listen: dir.path().join("ib.sock"),
            ..Config::default()
        };
        let r = run(&config, None).await;
        assert!(r.failed());
        let s = r.to_string();
        assert!(s.contains("✗ upstream:"), "{s}");
        assert!(s.contains("! proxy socket:"), "{s}");
    }
}
