//! Label keys and media types imgbridge reads or writes: one place, so the
//! replicator, the importer and `doctor` agree on every key, and on which
//! pin is whose (both pin records in `k8s.io`).
//!
//! OCI media types come from `oci-spec` ([`MediaType`]); Docker's, which it
//! has no constants for, are in [`media_type`].

use std::collections::HashMap;

pub use oci_spec::image::MediaType;

/// The namespace CRI (kubelet) reads.
pub const CRI_NAMESPACE: &str = "k8s.io";

// ---- imgbridge's own ---------------------------------------------------

/// Names the source namespace of a replica; only such records are ever
/// unpinned or deleted by the replicator.
pub const SOURCE: &str = "io.imgbridge.source";
/// Sources (path hashes) of watched files that pinned the record.
pub const IMPORT: &str = "io.imgbridge.import";

/// `false` on a source record the replicator leaves alone: what the
/// registry endpoint stores that is not an image for CRI (artefacts such
/// as Helm charts, referrers, manifests pushed by digest only).
pub const REPLICATE: &str = "io.imgbridge.replicate";
pub const REPLICATE_NO: &str = "false";
/// The repository (`app`, `team/app`) a registry record belongs to: the
/// endpoint lists a repository's records by it, whatever host name the
/// client used.
pub const REGISTRY_REPOSITORY: &str = "io.imgbridge.registry.repository";
/// The `subject` digest of a manifest pushed through the registry (the
/// referrers API lists records by it).
pub const REGISTRY_SUBJECT: &str = "io.imgbridge.registry.subject";
/// The imgbridge process that made a lease ([`crate::containerd::leases::owner`]):
/// what a later one goes by to release a dead one's leases at once
/// ([`crate::containerd::orphans`]).
pub const OWNER: &str = "io.imgbridge.owner";
/// The media type a manifest was pushed with, on its content blob (a
/// manifest need not name its own `mediaType`).
pub const REGISTRY_MEDIA_TYPE: &str = "io.imgbridge.registry.media-type";

// ---- CRI's (containerd's CRI plugin) -------------------------------------

/// Prefix of the labels CRI owns on image records; never copied from a
/// source record (a replica gets its own, see [`CRI_MANAGED`]).
pub const CRI_PREFIX: &str = "io.cri-containerd.";
/// CRI's pin label (honoured by containerd ≥ 1.6.22 / 1.7.3).
pub const PINNED: &str = "io.cri-containerd.pinned";
pub const PINNED_VALUE: &str = "pinned";
/// CRI's mark on a record it manages. CRI's pull writes records with it;
/// so does the replicator when it knows the image id (and writes the id
/// record first). Otherwise CRI sets it on the record's first event, and it
/// is cleared when the digest changes so CRI re-reads the image
/// ([docs/design.md](../docs/design.md#replication), step 3).
pub const CRI_MANAGED: &str = "io.cri-containerd.image";
pub const CRI_MANAGED_VALUE: &str = "managed";

// ---- containerd's ------------------------------------------------------

/// containerd's lease-style expiry label; never copied to a replica.
pub const EXPIRE: &str = "containerd.io/gc.expire";
/// Prefix of the GC references from a parent blob to its children
/// (`<prefix>.m.<i>`, `<prefix>.config`, `<prefix>.l.<i>`, as
/// `images.ChildGCLabels` writes them).
pub const GC_REF_CONTENT: &str = "containerd.io/gc.ref.content";
/// Prefix of the content label naming where a blob can be fetched:
/// `<prefix>.<registry host>` = comma-separated repositories (containerd's
/// pull handlers write it). spegel advertises a blob only if it has one,
/// so a replica's blobs carry it for the image's own repository.
pub const DISTRIBUTION_SOURCE: &str = "containerd.io/distribution.source";
/// Namespace label naming the namespace's default snapshotter.
pub const DEFAULT_SNAPSHOTTER: &str = "containerd.io/defaults/snapshotter";

/// Docker media types (schema 2). `oci-spec` maps four of them from OCI ones
/// (`ToDockerV2S2`, a `Result`), not the uncompressed and zstd layers, and
/// none as constants; the test below checks these agree with it.
pub mod media_type {
    pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    pub const DOCKER_MANIFEST_LIST: &str =
        "application/vnd.docker.distribution.manifest.list.v2+json";
    pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
    pub const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";
    pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
    pub const DOCKER_LAYER_ZSTD: &str = "application/vnd.docker.image.rootfs.diff.tar.zstd";
    /// `oci-spec`'s `MediaType::ImageManifest` and `ImageIndex`, as
    /// constants (for patterns and `format!`).
    pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

    use super::MediaType;

    /// True for an index (OCI index, Docker manifest list).
    pub fn is_index(media_type: &str) -> bool {
        media_type == DOCKER_MANIFEST_LIST || media_type == MediaType::ImageIndex.as_ref()
    }

    /// True for an image manifest (OCI or Docker schema 2).
    pub fn is_manifest(media_type: &str) -> bool {
        media_type == DOCKER_MANIFEST || media_type == MediaType::ImageManifest.as_ref()
    }
}

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

    #[test]
    fn docker_media_types_agree_with_oci_spec() {
        use media_type::*;
        use oci_spec::image::ToDockerV2S2;
        for (oci, docker) in [
            (MediaType::ImageIndex, DOCKER_MANIFEST_LIST),
            (MediaType::ImageManifest, DOCKER_MANIFEST),
            (MediaType::ImageConfig, DOCKER_CONFIG),
            (MediaType::ImageLayerGzip, DOCKER_LAYER_GZIP),
        ] {
            assert_eq!(oci.to_docker_v2s2().unwrap(), docker);
        }
        assert_eq!(format!("{DOCKER_LAYER}.gzip"), DOCKER_LAYER_GZIP);
        assert_eq!(format!("{DOCKER_LAYER}.zstd"), DOCKER_LAYER_ZSTD);
        assert_eq!(OCI_MANIFEST, MediaType::ImageManifest.as_ref());
        assert_eq!(OCI_INDEX, MediaType::ImageIndex.as_ref());
        assert!(is_index("application/vnd.oci.image.index.v1+json"));
        assert!(is_manifest("application/vnd.oci.image.manifest.v1+json"));
        assert!(!is_manifest(DOCKER_CONFIG) && !is_index(DOCKER_MANIFEST));
    }
}
