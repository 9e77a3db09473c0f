//! Labels imgbridge reads or writes on image records, and who owns a pin.
//! One place, because the replicator and the importer both pin records in
//! `k8s.io` and must agree on which pin is whose.

use std::collections::HashMap;

/// The namespace CRI (kubelet) reads.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Names the source namespace of a replica; only such records are ever
/// unpinned or deleted by the replicator.
pub const SOURCE: &str = "io.imgbridge.source";
/// Sources (path hashes) of watched files that pinned the record.
pub const IMPORT: &str = "io.imgbridge.import";
/// CRI's pin label (honoured by containerd ≥ 1.6.22 / 1.7.3).
pub const PINNED: &str = "io.cri-containerd.pinned";
pub const PINNED_VALUE: &str = "pinned";
/// Set by CRI once it manages a record; cleared when the digest changes so
/// CRI re-reads the image (reference §5).
pub const CRI_MANAGED: &str = "io.cri-containerd.image";
/// containerd's lease-style expiry label; never copied to a replica.
pub use crate::containerd::leases::EXPIRE;

/// Who holds a record's CRI pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinOwner {
    Nobody,
    /// A watched file (possibly along with the replicator): the importer
    /// removes it when its last file is gone.
    Import,
    /// The replicator alone (`replication.pin = true`).
    Replication,
    /// Someone else (an operator, another tool): never touched.
    Other,
}

pub fn pin_owner(labels: &HashMap<String, String>) -> PinOwner {
    if !labels.contains_key(PINNED) {
        PinOwner::Nobody
    } else if labels.contains_key(IMPORT) {
        PinOwner::Import
    } else if labels.contains_key(SOURCE) {
        PinOwner::Replication
    } else {
        PinOwner::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(keys: &[&str]) -> HashMap<String, String> {
        keys.iter().map(|k| (k.to_string(), "x".into())).collect()
    }

    #[test]
    fn pin_ownership() {
        assert_eq!(pin_owner(&labels(&[SOURCE])), PinOwner::Nobody);
        assert_eq!(pin_owner(&labels(&[PINNED])), PinOwner::Other);
        assert_eq!(pin_owner(&labels(&[PINNED, SOURCE])), PinOwner::Replication);
        // A replica the importer also pinned: its files own the pin now.
        assert_eq!(
            pin_owner(&labels(&[PINNED, SOURCE, IMPORT])),
            PinOwner::Import
        );
        assert_eq!(pin_owner(&labels(&[PINNED, IMPORT])), PinOwner::Import);
    }
}
