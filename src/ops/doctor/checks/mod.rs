//! Doctor's checks, one file per subject. Each adds its typed verdicts
//! to the [`super::Report`]; none prints.

pub(super) mod containerd_config;
pub(super) mod node;
pub(super) mod snapshotters;
pub(super) mod systemd;
pub(super) mod upstream;
pub(super) mod version;
