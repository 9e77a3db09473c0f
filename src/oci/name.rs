//! The name grammar of distribution's `reference` package: repository
//! paths, tags, and what the distribution API calls a manifest's
//! reference (a tag or a digest). One set of rules for a registry push's
//! name, a record's name ([`super::reference`]) and an archive's tags, so
//! a repository the endpoint takes is one CRI can name and resolve.

use std::fmt;

use super::digest::{Digest, DigestError};

/// Longest repository name (distribution's limit), host included where
/// there is one.
pub const MAX_NAME: usize = 255;

/// Why a string is not a [`Repository`], [`Tag`] or [`ManifestRef`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{0:?} is not a valid repository name (lowercase letters, digits and separators, components joined by '/', at most {MAX_NAME} characters)")]
    Repository(String),
    #[error("{0:?} is not a valid tag (letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-')")]
    Tag(String),
    #[error(transparent)]
    Digest(#[from] DigestError),
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`: one `/`-separated component of
/// a repository path.
pub fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
}

/// `[\w][\w.-]{0,127}`
pub fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    let word = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    !b.is_empty()
        && b.len() <= 128
        && word(b[0])
        && b.iter().all(|x| word(*x) || *x == b'.' || *x == b'-')
}

/// A repository path (`team/app`): the part of an image name after its
/// host, as a registry request names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Repository(String);

impl Repository {
    pub fn parse(s: &str) -> Result<Repository, NameError> {
        if !s.is_empty() && s.len() <= MAX_NAME && s.split('/').all(valid_component) {
            Ok(Repository(s.to_string()))
        } else {
            Err(NameError::Repository(s.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A tag (`v1.2`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(String);

impl Tag {
    pub fn parse(s: &str) -> Result<Tag, NameError> {
        if valid_tag(s) {
            Ok(Tag(s.to_string()))
        } else {
            Err(NameError::Tag(s.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What names a manifest in a repository: a tag or a digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManifestRef {
    Tag(Tag),
    Digest(Digest),
}

impl ManifestRef {
    /// A digest if it has an algorithm (`:`), else a tag.
    pub fn parse(s: &str) -> Result<ManifestRef, NameError> {
        if s.contains(':') {
            Ok(ManifestRef::Digest(Digest::parse(s)?))
        } else {
            Tag::parse(s).map(ManifestRef::Tag)
        }
    }
}

macro_rules! as_text {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl AsRef<str> for $t {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
        /// Reads as the string it was parsed from.
        impl std::ops::Deref for $t {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }
    )*};
}
as_text!(Repository, Tag);

impl fmt::Display for ManifestRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestRef::Tag(t) => t.fmt(f),
            ManifestRef::Digest(d) => d.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repositories() {
        for ok in [
            "a",
            "app",
            "a/b",
            "a.b/c_d/e__f/g--h",
            "x0/1y",
            "conformance/repo1",
        ] {
            assert!(Repository::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "A", "a/../b", "..", "a//b", "/a", "a/", "a.", "-a", "a___b", "a..b", "a/B",
        ] {
            assert!(Repository::parse(bad).is_err(), "{bad}");
        }
        assert!(Repository::parse(&"a".repeat(MAX_NAME)).is_ok());
        assert!(Repository::parse(&"a".repeat(MAX_NAME + 1)).is_err());
    }

    #[test]
    fn manifest_refs() {
        assert!(matches!(
            ManifestRef::parse("v1.0"),
            Ok(ManifestRef::Tag(_))
        ));
        assert!(ManifestRef::parse("-x").is_err());
        assert!(ManifestRef::parse(&"t".repeat(129)).is_err());
        let d = format!("sha256:{}", "a".repeat(64));
        assert!(matches!(ManifestRef::parse(&d), Ok(ManifestRef::Digest(_))));
        let d = format!("sha384:{}", "a".repeat(96));
        assert!(matches!(ManifestRef::parse(&d), Ok(ManifestRef::Digest(_))));
        assert!(matches!(
            ManifestRef::parse("sha256:abc"),
            Err(NameError::Digest(_))
        ));
    }
}
