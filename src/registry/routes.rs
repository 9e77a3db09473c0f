//! Which endpoint a request path names, its parts parsed into the house's
//! types ([`crate::oci`]) before anything reaches containerd: a name like
//! `../x` or `App` never becomes a record, and no handler parses again.

use crate::oci::{Digest, ManifestRef, Repository};

use super::errors::{Error, Result};

/// An upload session's id, as the endpoint handed it out (opaque: an
/// unknown one is `BLOB_UPLOAD_UNKNOWN`, not a malformed request).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadId(pub String);

/// Which endpoint a path names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`
    Ping,
    /// `/v2/<name>/blobs/<digest>`
    Blob(Repository, Digest),
    /// `/v2/<name>/blobs/uploads/`
    Uploads(Repository),
    /// `/v2/<name>/blobs/uploads/<id>`
    Upload(Repository, UploadId),
    /// `/v2/<name>/manifests/<reference>`
    Manifest(Repository, ManifestRef),
    /// `/v2/<name>/tags/list`
    Tags(Repository),
    /// `/v2/<name>/referrers/<digest>`
    Referrers(Repository, Digest),
}

impl Route {
    /// The route of `path`, its parts checked; `None`: not an API path.
    pub fn parse(path: &str) -> Option<Result<Route>> {
        let rest = path.strip_prefix("/v2")?;
        if rest.is_empty() || rest == "/" {
            return Some(Ok(Route::Ping));
        }
        let rest = rest.strip_prefix('/')?;
        let seg: Vec<&str> = rest.split('/').collect();
        let n = seg.len();
        let name_of = |k: usize| Repository::parse(&seg[..k].join("/"));
        let last = seg[n - 1];
        let route: Result<Route> = if n >= 3 && seg[n - 2] == "tags" && last == "list" {
            name_of(n - 2).map(Route::Tags).map_err(Error::from)
        } else if n >= 3 && seg[n - 2] == "blobs" && last == "uploads" {
            name_of(n - 2).map(Route::Uploads).map_err(Error::from)
        } else if n >= 4 && seg[n - 3] == "blobs" && seg[n - 2] == "uploads" {
            name_of(n - 3)
                .map(|name| match last {
                    "" => Route::Uploads(name),
                    id => Route::Upload(name, UploadId(id.into())),
                })
                .map_err(Error::from)
        } else if n >= 3 && seg[n - 2] == "manifests" {
            (|| Ok(Route::Manifest(name_of(n - 2)?, ManifestRef::parse(last)?)))()
        } else if n >= 3 && seg[n - 2] == "blobs" {
            (|| Ok(Route::Blob(name_of(n - 2)?, Digest::parse(last)?)))()
        } else if n >= 3 && seg[n - 2] == "referrers" {
            (|| Ok(Route::Referrers(name_of(n - 2)?, Digest::parse(last)?)))()
        } else {
            return None;
        };
        Some(route)
    }

    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Route::Ping => "ping",
            Route::Blob(..) => "blob",
            Route::Uploads(..) | Route::Upload(..) => "upload",
            Route::Manifest(..) => "manifest",
            Route::Tags(..) => "tags",
            Route::Referrers(..) => "referrers",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::errors::Code;

    #[test]
    fn routes() {
        let r = |p: &str| Route::parse(p).map(|r| r.map_err(|e| e.code));
        let repo = |s: &str| Repository::parse(s).unwrap();
        let d = format!("sha256:{}", "0".repeat(64));
        assert_eq!(r("/v2/"), Some(Ok(Route::Ping)));
        assert_eq!(r("/v2"), Some(Ok(Route::Ping)));
        assert_eq!(r("/v2/a/b/tags/list"), Some(Ok(Route::Tags(repo("a/b")))));
        assert_eq!(
            r("/v2/a/blobs/uploads/"),
            Some(Ok(Route::Uploads(repo("a"))))
        );
        assert_eq!(
            r("/v2/a/blobs/uploads/xyz"),
            Some(Ok(Route::Upload(repo("a"), UploadId("xyz".into()))))
        );
        assert_eq!(
            r("/v2/a/blobs/manifests/t"),
            Some(Ok(Route::Manifest(
                repo("a/blobs"),
                ManifestRef::parse("t").unwrap()
            )))
        );
        assert_eq!(
            r(&format!("/v2/a/blobs/{d}")),
            Some(Ok(Route::Blob(repo("a"), Digest::parse(&d).unwrap())))
        );
        assert_eq!(r("/v2/a/blobs/sha256:00"), Some(Err(Code::DigestInvalid)));
        assert_eq!(r("/v2/a/referrers/x"), Some(Err(Code::DigestInvalid)));
        assert_eq!(r("/v2/a/manifests/-x"), Some(Err(Code::ManifestInvalid)));
        assert_eq!(r("/v2/../x/manifests/t"), Some(Err(Code::NameInvalid)));
        assert_eq!(r("/v2/App/manifests/t"), Some(Err(Code::NameInvalid)));
        assert_eq!(r("/metrics"), None);
        assert_eq!(r("/v2/a/nothing"), None);
    }
}
