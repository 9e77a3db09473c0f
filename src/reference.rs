//! Image reference normalisation, as kubelet/CRI does it
//! (`docker.ParseDockerRef`): `app:dev` → `docker.io/library/app:dev`.
//!
//! CRI only resolves normalised names, so every record imgbridge writes into
//! `k8s.io` goes through here.

use std::fmt;

/// A parsed, normalised reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// Registry host, e.g. `docker.io` or `127.0.0.1:5000`.
    pub domain: String,
    /// Repository path, e.g. `library/app`.
    pub path: String,
    pub tag: Option<String>,
    /// `sha256:<hex>` when the reference pins a digest.
    pub digest: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid image reference {input:?}: {reason}")]
pub struct ParseError {
    pub input: String,
    pub reason: &'static str,
}

impl Reference {
    /// Parses and normalises; a name with neither tag nor digest gets `latest`.
    pub fn parse(input: &str) -> Result<Reference, ParseError> {
        let err = |reason| ParseError {
            input: input.into(),
            reason,
        };
        if input.is_empty() || input.len() > 4096 {
            return Err(err("empty or too long"));
        }
        let (rest, digest) = match input.split_once('@') {
            Some((r, d)) => {
                let hex = d
                    .strip_prefix("sha256:")
                    .ok_or(err("only sha256 digests are supported"))?;
                if hex.len() != 64
                    || !hex
                        .bytes()
                        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
                {
                    return Err(err("digest must be sha256: and 64 lowercase hex digits"));
                }
                (r, Some(d.to_string()))
            }
            None => (input, None),
        };
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(rest[i + 1..].to_string())),
            _ => (rest, None),
        };
        if let Some(t) = &tag {
            let b = t.as_bytes();
            if b.is_empty()
                || b.len() > 128
                || !(b[0].is_ascii_alphanumeric() || b[0] == b'_')
                || !b
                    .iter()
                    .all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(c))
            {
                return Err(err("tag must match [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"));
            }
        }
        let (domain, path) = match name.split_once('/') {
            Some((first, remainder))
                if first.contains('.')
                    || first.contains(':')
                    || first == "localhost"
                    || first.bytes().any(|c| c.is_ascii_uppercase()) =>
            {
                (first.to_string(), remainder.to_string())
            }
            Some(_) => ("docker.io".to_string(), name.to_string()),
            None => ("docker.io".to_string(), format!("library/{name}")),
        };
        let domain = if domain == "index.docker.io" {
            "docker.io".into()
        } else {
            domain
        };
        let path = if domain == "docker.io" && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        if !valid_domain(&domain) {
            return Err(err("invalid registry host"));
        }
        if !path.split('/').all(valid_component) {
            return Err(err(
                "repository path must be lowercase [a-z0-9] separated by '.', '_', '__' or '-'",
            ));
        }
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".into())
        } else {
            tag
        };
        Ok(Reference {
            domain,
            path,
            tag,
            digest,
        })
    }

    /// `domain/path` without tag or digest.
    pub fn repository(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// The `repo@sha256:…` form for a given digest (digest-ref records).
    pub fn with_digest(&self, digest: &str) -> String {
        format!("{}@{digest}", self.repository())
    }
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

/// Normalises a name into the form CRI resolves.
pub fn normalize(input: &str) -> Result<String, ParseError> {
    Reference::parse(input).map(|r| r.to_string())
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return false;
    }
    if !b
        .iter()
        .all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || b"._-".contains(x))
    {
        return false;
    }
    // Separators: one '.', one or two '_', or any run of '-'; never mixed.
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_alphanumeric() {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !b[i].is_ascii_alphanumeric() {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
}

fn valid_domain(d: &str) -> bool {
    let (host, port) = match d.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (h, Some(p)),
        _ => (d, None),
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()) {
            return false;
        }
    }
    if host.starts_with('[') && host.ends_with(']') {
        return host.len() > 2;
    }
    !host.is_empty()
        && host.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_like_cri() {
        for (i, o) in [
            ("app:dev", "docker.io/library/app:dev"),
            ("app", "docker.io/library/app:latest"),
            ("foo/bar", "docker.io/foo/bar:latest"),
            ("docker.io/app:1", "docker.io/library/app:1"),
            ("index.docker.io/x/y:z", "docker.io/x/y:z"),
            ("localhost/app:1", "localhost/app:1"),
            ("127.0.0.1:5000/a/b:c", "127.0.0.1:5000/a/b:c"),
            (
                "reg.example.com/a__b/c-d.e:v1.2-3",
                "reg.example.com/a__b/c-d.e:v1.2-3",
            ),
        ] {
            assert_eq!(normalize(i).unwrap(), o, "{i}");
        }
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            normalize(&format!("app@{d}")).unwrap(),
            format!("docker.io/library/app@{d}")
        );
        assert_eq!(
            normalize(&format!("app:1@{d}")).unwrap(),
            format!("docker.io/library/app:1@{d}")
        );
        let r = Reference::parse("app:dev").unwrap();
        assert_eq!(r.with_digest(&d), format!("docker.io/library/app@{d}"));
    }

    #[test]
    fn rejects_invalid() {
        for bad in [
            "",
            "App:dev",
            "app:",
            "app:-x",
            "a//b",
            "app@sha256:abc",
            "app@md5:0123",
            "a..b",
            "sha256:xyz/..",
            "has space",
            "-lead",
            "trail-",
        ] {
            assert!(normalize(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
