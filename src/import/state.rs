//! The import state file: which files were imported, with what result, so a
//! restart does not re-import unchanged archives (k3s users waited minutes
//! for that at every boot) while images that vanished meanwhile (kubelet GC,
//! `ctr rm`) are noticed and imported again.
//!
//! Written atomically (temp file in the same directory, fsync, rename), so a
//! crash leaves either the old or the new version.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

const VERSION: u32 = 1;

/// The modification time [`FileState::importing`] records (no file has it).
const IMPORTING: i128 = i128::MIN;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("writing state file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    Archive,
    List,
}

/// What we know about one source file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileState {
    pub kind: FileKind,
    /// Short path hash, as written in the `io.imgbridge.import` label.
    pub hash: String,
    pub namespace: String,
    pub size: u64,
    pub mtime_ns: i128,
    /// sha256 of the file's bytes (archives), to skip a touched but equal file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Image name → target digest it was recorded with.
    #[serde(default)]
    pub images: BTreeMap<String, String>,
    /// Why the last import failed; an unchanged failed file is not retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// Source path (as seen under the watched directory) → state.
    pub files: BTreeMap<PathBuf, FileState>,
}

/// Size and modification time: what "unchanged" means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub size: u64,
    pub mtime_ns: i128,
}

impl Stamp {
    pub fn of(m: &std::fs::Metadata) -> Stamp {
        let mtime_ns = m
            .modified()
            .ok()
            .map(|t| match t.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_nanos() as i128,
                Err(e) => -(e.duration().as_nanos() as i128),
            })
            .unwrap_or(0);
        Stamp {
            size: m.len(),
            mtime_ns,
        }
    }
}

impl FileState {
    /// What is recorded of a file's version `stamp`, before any image.
    pub fn new(kind: FileKind, hash: String, namespace: String, stamp: Stamp) -> FileState {
        FileState {
            kind,
            hash,
            namespace,
            size: stamp.size,
            mtime_ns: stamp.mtime_ns,
            sha256: None,
            images: BTreeMap::new(),
            error: None,
        }
    }

    /// The same file with an import of it begun: written (and saved)
    /// before the import pins anything, so a crash before its result is
    /// recorded still leaves the file and the hash its pins carry in the
    /// state. Its stamp is one no file has, so a restart imports the file
    /// again if it is still there, and unpins its images if it is gone.
    pub fn importing(self) -> FileState {
        FileState {
            mtime_ns: IMPORTING,
            ..self
        }
    }

    pub fn stamp(&self) -> Stamp {
        Stamp {
            size: self.size,
            mtime_ns: self.mtime_ns,
        }
    }
}

impl State {
    /// Loads the state; a missing file is an empty state, an unreadable one
    /// is logged and replaced (everything is then checked again).
    pub fn load(path: &Path) -> State {
        match std::fs::read(path) {
            Ok(b) => match serde_json::from_slice::<State>(&b) {
                Ok(s) if s.version == VERSION => s,
                Ok(s) => {
                    tracing::warn!(file = %crate::import::esc(path.display()), version = s.version, "import state file has an unknown version; starting afresh");
                    State::new()
                }
                Err(e) => {
                    tracing::warn!(file = %crate::import::esc(path.display()), error = %crate::import::esc(&e), "import state file is corrupt; starting afresh");
                    State::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::new(),
            Err(e) => {
                tracing::warn!(file = %crate::import::esc(path.display()), error = %crate::import::esc(&e), "cannot read import state file; starting afresh");
                State::new()
            }
        }
    }

    pub fn new() -> State {
        State {
            version: VERSION,
            files: BTreeMap::new(),
        }
    }

    /// Writes atomically ([`crate::atomic_file`]): readers never see half a file.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let err = |source| StateError::Write {
            path: path.into(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let body = serde_json::to_vec_pretty(self).map_err(|e| err(e.into()))?;
        crate::atomic_file::write(path, &body, 0o600).map_err(err)
    }

    /// Sources (other than `except`) in `ns` that still provide `name`.
    pub fn providers(&self, ns: &str, name: &str, except: &Path) -> BTreeSet<String> {
        self.files
            .iter()
            .filter(|(p, f)| {
                p.as_path() != except && f.namespace == ns && f.images.contains_key(name)
            })
            .map(|(_, f)| f.hash.clone())
            .collect()
    }

    /// Every entry, copied: for a pass that changes the state as it goes.
    pub fn entries(&self) -> Vec<(PathBuf, FileState)> {
        self.files
            .iter()
            .map(|(p, f)| (p.clone(), f.clone()))
            .collect()
    }

    /// Entries at `path` or below it.
    pub fn under(&self, path: &Path) -> Vec<PathBuf> {
        self.files
            .keys()
            .filter(|p| p.starts_with(path))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/state.json");
        assert_eq!(State::load(&p), State::new());
        let mut s = State::new();
        s.files.insert(
            "/d/a.tar".into(),
            FileState {
                kind: FileKind::Archive,
                hash: "abc".into(),
                namespace: "k8s.io".into(),
                size: 3,
                mtime_ns: 4,
                sha256: Some("sha256:x".into()),
                images: BTreeMap::from([("docker.io/library/a:1".into(), "sha256:y".into())]),
                error: None,
            },
        );
        s.save(&p).unwrap();
        assert_eq!(State::load(&p), s);
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temp file left behind");
        assert_eq!(
            s.providers("k8s.io", "docker.io/library/a:1", Path::new("/d/b.tar")),
            BTreeSet::from(["abc".to_string()])
        );
        assert!(s
            .providers("k8s.io", "docker.io/library/a:1", Path::new("/d/a.tar"))
            .is_empty());
        std::fs::write(&p, b"{not json").unwrap();
        assert_eq!(State::load(&p), State::new());
    }
}
