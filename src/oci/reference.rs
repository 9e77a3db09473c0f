//! Image reference normalisation, the way CRI and docker do it
//! (`docker.ParseDockerRef`): kubelet looks images up by the normalised
//! name, so a record named `app:dev` is invisible to it while
//! `docker.io/library/app:dev` is found.
//!
//! - `app:dev` → `docker.io/library/app:dev`
//! - `foo/bar` → `docker.io/foo/bar:latest`
//! - `reg:5000/x:y` → unchanged
//! - `foo:1@sha256:…` → `docker.io/library/foo@sha256:…` (a digest wins over a tag)
//!
//! Hand-written on purpose. The well-kept candidate, `oci-spec`'s
//! `distribution::Reference` (0.10, a port of distribution's `reference`
//! package), differs from `ParseDockerRef` where it matters to CRI lookups
//! (checked in `tests::where_oci_spec_differs`): it keeps the tag next to a
//! digest (CRI drops it), accepts a 64-hex image id as a name, files an
//! uppercase first component (`Reg/x`) under `docker.io` instead of treating
//! it as a host, accepts uppercase digest hex (containerd rejects it), and
//! rejects bracketed IPv6 registries (`[::1]:5000/x`). A replica named
//! differently from what kubelet asks for is invisible to it, so this file
//! follows `ParseDockerRef` and its tests, rather than wrap the crate in as
//! many fix-ups as it has lines.

use std::fmt;

use super::digest::Digest;
use super::name::{valid_component, valid_tag, MAX_NAME};

/// Registry used when a reference names none.
pub const DEFAULT_DOMAIN: &str = "docker.io";
const LEGACY_DOMAIN: &str = "index.docker.io";
const OFFICIAL_PREFIX: &str = "library/";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("invalid reference {0:?}: empty")]
    Empty(String),
    #[error("invalid reference {0:?}: a 64-hex-digit string is an image id, not a name")]
    Identifier(String),
    #[error("invalid reference {0:?}: repository name must be lowercase")]
    Uppercase(String),
    #[error("invalid reference {0:?}: bad registry host {1:?}")]
    Domain(String, String),
    #[error("invalid reference {0:?}: bad repository path component {1:?}")]
    Path(String, String),
    #[error("invalid reference {0:?}: bad tag {1:?}")]
    Tag(String, String),
    #[error("invalid reference {0:?}: bad digest {1:?}")]
    Digest(String, String),
    #[error("invalid reference {0:?}: name longer than {MAX_NAME} characters")]
    TooLong(String),
}

/// A fully qualified reference: `domain/path[:tag][@digest]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    pub domain: String,
    pub path: String,
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.domain, self.path)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

impl Reference {
    /// `domain/path` without tag or digest.
    pub fn name(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// The `name@sha256:…` form for `digest` (digest-ref records, which
    /// spegel and embedded registry mirrors serve from).
    pub fn with_digest(&self, digest: &str) -> String {
        format!("{}@{digest}", self.name())
    }

    /// Parses and normalises like `docker.ParseDockerRef`: default domain and
    /// `library/`, `:latest` when neither tag nor digest, and a tag dropped
    /// when a digest is present.
    pub fn parse(s: &str) -> Result<Reference, ReferenceError> {
        let mut r = parse_normalized(s)?;
        if r.digest.is_some() {
            r.tag = None;
        } else if r.tag.is_none() {
            r.tag = Some("latest".into());
        }
        Ok(r)
    }
}

/// Normalises `s` to the name CRI resolves (see module docs).
pub fn normalize(s: &str) -> Result<String, ReferenceError> {
    Reference::parse(s).map(|r| r.to_string())
}

/// `ParseNormalizedNamed`: adds the default domain and `library/` but no tag.
fn parse_normalized(s: &str) -> Result<Reference, ReferenceError> {
    let err_s = || s.to_string();
    if s.is_empty() {
        return Err(ReferenceError::Empty(err_s()));
    }
    if s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(ReferenceError::Identifier(err_s()));
    }
    let (mut domain, mut rest) = match s.find('/') {
        Some(i)
            if s[..i].contains(['.', ':'])
                || &s[..i] == "localhost"
                || s[..i].to_lowercase() != s[..i] =>
        {
            (s[..i].to_string(), s[i + 1..].to_string())
        }
        _ => (DEFAULT_DOMAIN.to_string(), s.to_string()),
    };
    if domain == LEGACY_DOMAIN {
        domain = DEFAULT_DOMAIN.into();
    }
    if domain == DEFAULT_DOMAIN && !rest.contains('/') {
        rest = format!("{OFFICIAL_PREFIX}{rest}");
    }
    let (named, digest) = match rest.split_once('@') {
        Some((n, d)) => (n.to_string(), Some(d.to_string())),
        None => (rest, None),
    };
    let (path, tag) = match named.rfind(':') {
        Some(i) if !named[i..].contains('/') => {
            (named[..i].to_string(), Some(named[i + 1..].to_string()))
        }
        _ => (named, None),
    };
    if path.to_lowercase() != path {
        return Err(ReferenceError::Uppercase(err_s()));
    }
    if !valid_domain(&domain) {
        return Err(ReferenceError::Domain(err_s(), domain));
    }
    for c in path.split('/') {
        if !valid_component(c) {
            return Err(ReferenceError::Path(err_s(), c.into()));
        }
    }
    if domain.len() + 1 + path.len() > MAX_NAME {
        return Err(ReferenceError::TooLong(err_s()));
    }
    if let Some(t) = &tag {
        if !valid_tag(t) {
            return Err(ReferenceError::Tag(err_s(), t.clone()));
        }
    }
    let digest = match digest {
        Some(d) => Some(Digest::parse(&d).map_err(|_| ReferenceError::Digest(err_s(), d))?),
        None => None,
    };
    Ok(Reference {
        domain,
        path,
        tag,
        digest,
    })
}

/// `host[:port]`, host a DNS name, IPv4 or `[IPv6]`.
fn valid_domain(d: &str) -> bool {
    let (host, port) = if let Some(rest) = d.strip_prefix('[') {
        let Some((h, after)) = rest.split_once(']') else {
            return false;
        };
        if h.is_empty() || !h.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
            return false;
        }
        match after {
            "" => return true,
            p => match p.strip_prefix(':') {
                Some(p) => ("x", Some(p)),
                None => return false,
            },
        }
    } else {
        match d.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (d, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
    }
    !host.is_empty()
        && host.split('.').all(|c| {
            let b = c.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter().all(|x| x.is_ascii_alphanumeric() || *x == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn normalises_like_cri() {
        let cases = [
            ("app:dev", "docker.io/library/app:dev"),
            ("app", "docker.io/library/app:latest"),
            ("foo/bar", "docker.io/foo/bar:latest"),
            ("docker.io/foo/bar:1", "docker.io/foo/bar:1"),
            ("index.docker.io/foo", "docker.io/library/foo:latest"),
            ("docker.io/busybox", "docker.io/library/busybox:latest"),
            ("reg:5000/x:y", "reg:5000/x:y"),
            ("reg:5000/x", "reg:5000/x:latest"),
            ("127.0.0.1:5000/a/b/c:v1.2", "127.0.0.1:5000/a/b/c:v1.2"),
            ("localhost/x", "localhost/x:latest"),
            ("[::1]:5000/x:y", "[::1]:5000/x:y"),
            ("quay.io/a_b/c-d:T_1", "quay.io/a_b/c-d:T_1"),
            ("a__b/c---d", "docker.io/a__b/c---d:latest"),
            ("reg:5000", "docker.io/library/reg:5000"),
        ];
        for (i, o) in cases {
            assert_eq!(normalize(i).unwrap(), o, "{i}");
        }
    }

    #[test]
    fn digests() {
        assert_eq!(
            normalize(&format!("foo@{D}")).unwrap(),
            format!("docker.io/library/foo@{D}")
        );
        // A digest wins over a tag, as in ParseDockerRef.
        assert_eq!(
            normalize(&format!("reg:5000/foo:1@{D}")).unwrap(),
            format!("reg:5000/foo@{D}")
        );
        assert!(normalize("foo@sha256:abc").is_err());
        assert!(normalize("foo@md5:0123456789abcdef0123456789abcdef").is_err());
        assert!(normalize(&format!("foo@{}", D.to_uppercase())).is_err());
    }

    #[test]
    fn rejects_invalid() {
        for bad in [
            "",
            "Foo",
            "foo/Bar",
            "foo:",
            "foo:-x",
            "foo::x",
            "-foo",
            "foo-",
            "foo..bar",
            "foo/",
            "/foo",
            "foo//bar",
            "foo bar",
            "reg:port/x",
            "re_g.io/x",
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "foo:a/b",
        ] {
            assert!(normalize(bad).is_err(), "{bad:?} should be rejected");
        }
        let long = format!("x/{}", "a".repeat(300));
        assert!(matches!(normalize(&long), Err(ReferenceError::TooLong(_))));
        let tag = format!("x:{}", "t".repeat(129));
        assert!(normalize(&tag).is_err());
    }

    /// The inputs where `oci-spec`'s parser (the crate this file could use)
    /// and `ParseDockerRef` disagree: ours must give docker's answer. The
    /// `oci-spec` half fails once the crate changes, a cue to look again.
    #[test]
    fn where_oci_spec_differs() {
        use oci_spec::distribution::Reference as Oci;
        let oci = |s: &str| Oci::try_from(s).map(|r| r.whole());
        // Tag and digest: CRI names the record by the digest alone.
        let both = format!("reg:5000/foo:1@{D}");
        assert_eq!(normalize(&both).unwrap(), format!("reg:5000/foo@{D}"));
        assert_eq!(oci(&both).unwrap(), both);
        // An image id is not a name.
        let id = &D["sha256:".len()..];
        assert!(normalize(id).is_err());
        assert!(oci(id).is_ok());
        // An uppercase first component is a host.
        assert_eq!(normalize("Reg/x").unwrap(), "Reg/x:latest");
        assert_eq!(oci("Reg/x").unwrap(), "docker.io/Reg/x:latest");
        // containerd accepts lowercase digest hex only.
        let upper = format!("foo@sha256:{}", D["sha256:".len()..].to_uppercase());
        assert!(normalize(&upper).is_err());
        assert!(oci(&upper).is_ok());
        // Bracketed IPv6 registries.
        assert_eq!(normalize("[::1]:5000/x:y").unwrap(), "[::1]:5000/x:y");
        assert!(oci("[::1]:5000/x:y").is_err());
    }

    #[test]
    fn uppercase_first_component_is_a_domain() {
        // docker treats an uppercase first component as a host name.
        assert_eq!(normalize("Reg/x").unwrap(), "Reg/x:latest");
    }
}
