//! What a request names: repository, tag, digest, upload id, by the
//! distribution spec's grammar. Checked before anything reaches
//! containerd, so a name like `../x` or `App` never becomes a record.

use super::errors::{Code, Error, Result};

/// Longest repository name accepted (distribution's limit).
const MAX_NAME: usize = 255;

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*` for each `/`-separated component.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME && name.split('/').all(valid_component)
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: &u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(&b[0]) || !alnum(&b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(&b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(&b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
}

/// `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|x| x.is_ascii_alphanumeric() || b"._-".contains(x))
}

/// A digest this endpoint can verify: containerd checks sha256 and sha512.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digest(String);

impl Digest {
    pub fn parse(s: &str) -> Result<Digest> {
        let ok = match s.split_once(':') {
            Some(("sha256", h)) => h.len() == 64,
            Some(("sha512", h)) => h.len() == 128,
            _ => false,
        } && s.split_once(':').is_some_and(|(_, h)| {
            h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        });
        if ok {
            Ok(Digest(s.to_string()))
        } else {
            Err(Error::new(
                Code::DigestInvalid,
                format!("{s:?} is not a sha256 or sha512 digest"),
            ))
        }
    }

    /// The digest of `data` with this digest's algorithm.
    pub fn of(algorithm: &str, data: &[u8]) -> Digest {
        use sha2::Digest as _;
        Digest(match algorithm {
            "sha512" => format!("sha512:{}", hex::encode(sha2::Sha512::digest(data))),
            _ => format!("sha256:{}", hex::encode(sha2::Sha256::digest(data))),
        })
    }

    pub fn algorithm(&self) -> &str {
        self.0.split_once(':').map_or("sha256", |(a, _)| a)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A manifest reference: a tag or a digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    Tag(String),
    Digest(Digest),
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference> {
        if s.contains(':') {
            return Digest::parse(s).map(Reference::Digest);
        }
        if valid_tag(s) {
            Ok(Reference::Tag(s.to_string()))
        } else {
            Err(Error::new(
                Code::ManifestInvalid,
                format!("{s:?} is neither a tag nor a digest"),
            ))
        }
    }
}

/// Which endpoint a path names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`
    Ping,
    /// `/v2/<name>/blobs/<digest>`
    Blob(String, String),
    /// `/v2/<name>/blobs/uploads/`
    Uploads(String),
    /// `/v2/<name>/blobs/uploads/<id>`
    Upload(String, String),
    /// `/v2/<name>/manifests/<reference>`
    Manifest(String, String),
    /// `/v2/<name>/tags/list`
    Tags(String),
    /// `/v2/<name>/referrers/<digest>`
    Referrers(String, String),
}

impl Route {
    /// The route of `path`, its name checked; `None`: not an API path.
    pub fn parse(path: &str) -> Option<Result<Route>> {
        let rest = path.strip_prefix("/v2")?;
        if rest.is_empty() || rest == "/" {
            return Some(Ok(Route::Ping));
        }
        let rest = rest.strip_prefix('/')?;
        let seg: Vec<&str> = rest.split('/').collect();
        let n = seg.len();
        let name_of = |k: usize| -> Result<String> {
            let name = seg[..k].join("/");
            if valid_name(&name) {
                Ok(name)
            } else {
                Err(Error::new(
                    Code::NameInvalid,
                    format!("{name:?} is not a valid repository name (lowercase letters, digits and separators, components joined by '/')"),
                ))
            }
        };
        let route = if n >= 3 && seg[n - 2] == "tags" && seg[n - 1] == "list" {
            name_of(n - 2).map(Route::Tags)
        } else if n >= 3 && seg[n - 2] == "blobs" && seg[n - 1] == "uploads" {
            name_of(n - 2).map(Route::Uploads)
        } else if n >= 4 && seg[n - 3] == "blobs" && seg[n - 2] == "uploads" {
            let id = seg[n - 1];
            name_of(n - 3).map(|name| match id {
                "" => Route::Uploads(name),
                id => Route::Upload(name, id.into()),
            })
        } else if n >= 3 && seg[n - 2] == "manifests" {
            name_of(n - 2).map(|name| Route::Manifest(name, seg[n - 1].into()))
        } else if n >= 3 && seg[n - 2] == "blobs" {
            name_of(n - 2).map(|name| Route::Blob(name, seg[n - 1].into()))
        } else if n >= 3 && seg[n - 2] == "referrers" {
            name_of(n - 2).map(|name| Route::Referrers(name, seg[n - 1].into()))
        } else {
            return None;
        };
        Some(route)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in [
            "a",
            "app",
            "a/b",
            "a.b/c_d/e__f/g--h",
            "x0/1y",
            "conformance/repo1",
        ] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "", "A", "a/../b", "..", "a//b", "/a", "a/", "a.", "-a", "a___b", "a..b", "a/B",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn routes() {
        let r = |p: &str| Route::parse(p).map(|r| r.map_err(|e| e.code));
        assert_eq!(r("/v2/"), Some(Ok(Route::Ping)));
        assert_eq!(r("/v2"), Some(Ok(Route::Ping)));
        assert_eq!(r("/v2/a/b/tags/list"), Some(Ok(Route::Tags("a/b".into()))));
        assert_eq!(
            r("/v2/a/blobs/uploads/"),
            Some(Ok(Route::Uploads("a".into())))
        );
        assert_eq!(
            r("/v2/a/blobs/uploads/xyz"),
            Some(Ok(Route::Upload("a".into(), "xyz".into())))
        );
        assert_eq!(
            r("/v2/a/blobs/manifests/t"),
            Some(Ok(Route::Manifest("a/blobs".into(), "t".into())))
        );
        assert_eq!(
            r("/v2/a/blobs/sha256:00"),
            Some(Ok(Route::Blob("a".into(), "sha256:00".into())))
        );
        assert_eq!(r("/v2/../x/manifests/t"), Some(Err(Code::NameInvalid)));
        assert_eq!(r("/v2/App/manifests/t"), Some(Err(Code::NameInvalid)));
        assert_eq!(r("/metrics"), None);
        assert_eq!(r("/v2/a/nothing"), None);
    }

    #[test]
    fn references() {
        assert!(matches!(Reference::parse("v1.0"), Ok(Reference::Tag(_))));
        assert!(Reference::parse("-x").is_err());
        let d = format!("sha256:{}", "a".repeat(64));
        assert!(matches!(Reference::parse(&d), Ok(Reference::Digest(_))));
        assert!(Digest::parse("sha256:abc").is_err());
        assert!(Digest::parse(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(Digest::parse(&format!("sha512:{}", "0".repeat(128))).is_ok());
        assert!(Digest::parse(&format!("md5:{}", "0".repeat(32))).is_err());
    }
}
