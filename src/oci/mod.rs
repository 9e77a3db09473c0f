//! The OCI vocabulary every room speaks: [`Digest`], the name grammar
//! ([`Repository`], [`Tag`], [`ManifestRef`]), image references as CRI
//! normalises them ([`reference`]), and one model of indexes and
//! manifests ([`Manifest`]). The registry endpoint, replication and
//! archive imports use these and no vocabulary of their own, so a name or
//! digest one of them accepts is one the others (and containerd) accept.

pub mod digest;
pub mod manifest;
pub mod name;
pub mod reference;

pub use digest::{Digest, DigestError};
pub use manifest::{Child, Entry, Manifest, ManifestError};
pub use name::{ManifestRef, NameError, Repository, Tag};
pub use reference::{Reference, ReferenceError};
