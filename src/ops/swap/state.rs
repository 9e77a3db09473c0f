//! The swap's state file (`/var/lib/imgbridge/swap-state.toml`): what apply
//! found before it changed anything, so rollback puts back exactly that,
//! also after a failed or interrupted apply. It is written before the first
//! change and removed once rollback has restored containerd's config.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[cfg(test)]
use super::containerd_config::sha256;
use super::containerd_config::Previous;
use crate::atomic_file as atomic;

/// Where the state file lives (under [`super::SwapOptions::root`]).
pub const PATH: &str = "/var/lib/imgbridge/swap-state.toml";
/// Format of the file; a newer one is refused rather than misread.
const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "{path} is not a swap state file ({why}); move it away and run `imgbridge swap status`"
    )]
    Corrupt { path: PathBuf, why: String },
    #[error("{path} has format {found}, newer than this imgbridge ({FORMAT}); use the imgbridge that wrote it")]
    Newer { path: PathBuf, found: u32 },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub format: u32,
    /// containerd's config file as the host sees it.
    pub containerd_config: PathBuf,
    pub real_socket: PathBuf,
    pub default_socket: PathBuf,
    /// There was no config file: apply created it.
    #[serde(default)]
    pub config_created: bool,
    /// SHA-256 of the config as apply wrote it: a created file is removed
    /// again only if it still has these bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_written_sha256: Option<String>,
    /// SHA-256 of the config before apply (`None`: there was none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_before_sha256: Option<String>,
    /// The gRPC address before apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<Previous>,
    /// The ttrpc address before apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttrpc: Option<Previous>,
    /// Directories apply created (host paths); rollback removes them when
    /// they are empty again.
    #[serde(default)]
    pub created_dirs: Vec<PathBuf>,
}

impl State {
    pub fn new(containerd_config: &Path, real_socket: &Path, default_socket: &Path) -> State {
        State {
            format: FORMAT,
            containerd_config: containerd_config.to_path_buf(),
            real_socket: real_socket.to_path_buf(),
            default_socket: default_socket.to_path_buf(),
            config_created: false,
            config_written_sha256: None,
            config_before_sha256: None,
            grpc: None,
            ttrpc: None,
            created_dirs: Vec::new(),
        }
    }

    /// The state at `path` (a host path under the root); `None` if there is none.
    pub fn load(path: &Path) -> Result<Option<State>, StateError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: path.into(),
                    source,
                })
            }
        };
        let state: State = toml::from_str(&text).map_err(|e| StateError::Corrupt {
            path: path.into(),
            why: crate::ops::doctor::report::one_line(&e.to_string()),
        })?;
        if state.format > FORMAT {
            return Err(StateError::Newer {
                path: path.into(),
                found: state.format,
            });
        }
        Ok(Some(state))
    }

    /// Writes the state atomically, readable by root only (it names the
    /// values of containerd's config).
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let err = |source| StateError::Write {
            path: path.into(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let body = toml::to_string(self).map_err(|e| err(io::Error::other(e)))?;
        let text = format!(
            "# Written by `imgbridge swap`: what it changed, for `imgbridge swap rollback`.\n\
             # Do not edit; rollback removes it.\n{body}"
        );
        atomic::write(path, text.as_bytes(), 0o600).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("var/lib/imgbridge/swap-state.toml");
        assert_eq!(State::load(&path).unwrap(), None);
        let mut s = State::new(
            Path::new("/etc/containerd/config.toml"),
            Path::new("/run/containerd/containerd-real.sock"),
            Path::new("/run/containerd/containerd.sock"),
        );
        s.grpc = Some(Previous {
            table: vec!["grpc".into()],
            created_tables: 0,
            value: Some("'/run/containerd/containerd.sock'".into()),
        });
        s.ttrpc = Some(Previous {
            table: vec!["ttrpc".into()],
            created_tables: 1,
            value: None,
        });
        s.created_dirs
            .push("/etc/systemd/system/kubelet.service.d".into());
        s.config_written_sha256 = Some(sha256(b"x"));
        s.save(&path).unwrap();
        assert_eq!(State::load(&path).unwrap(), Some(s.clone()));

        std::fs::write(&path, "format = 9\n").unwrap();
        assert!(matches!(
            State::load(&path),
            Err(StateError::Corrupt { .. })
        ));
        let newer = toml::to_string(&State { format: 9, ..s }).unwrap();
        std::fs::write(&path, newer).unwrap();
        assert!(matches!(
            State::load(&path),
            Err(StateError::Newer { found: 9, .. })
        ));
    }
}
