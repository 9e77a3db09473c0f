//! Blob reads and deletes (`/v2/<name>/blobs/<digest>`). Blobs are the
//! namespace's content: one store for every repository, as containerd
//! keeps them (a layer two repositories share is stored once). A blob
//! only another namespace holds is linked into ours first: in containerd's
//! default `shared` policy no byte moves, so a client that asks HEAD
//! before uploading never sends a layer the node already has.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

use futures_util::StreamExt;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};

use crate::containerd::content::BlobRef;
use crate::labels::GC_REF_CONTENT;

use crate::lock::lock;
use crate::oci::Digest;

use super::errors::{Code, Error, Result};
use super::{answer, Body, Registry};

/// Blobs a client deleted: not linked back from another namespace (a
/// replica in `k8s.io` holds most of them), so a DELETE sticks until the
/// blob is uploaded again. Bounded: the oldest are forgotten first.
#[derive(Default)]
pub struct Tombstones {
    inner: Mutex<(HashSet<String>, VecDeque<String>)>,
}

const TOMBSTONES: usize = 65536;

impl Tombstones {
    fn lock(&self) -> MutexGuard<'_, (HashSet<String>, VecDeque<String>)> {
        lock(&self.inner)
    }

    pub fn bury(&self, d: &str) {
        let mut g = self.lock();
        if g.0.insert(d.to_string()) {
            g.1.push_back(d.to_string());
        }
        while g.1.len() > TOMBSTONES {
            if let Some(old) = g.1.pop_front() {
                g.0.remove(&old);
            }
        }
    }

    pub fn lift(&self, d: &str) {
        let mut g = self.lock();
        if g.0.remove(d) {
            g.1.retain(|x| x != d);
        }
    }

    fn buried(&self, d: &str) -> bool {
        self.lock().0.contains(d)
    }
}

/// A `Range: bytes=…` request against a blob of `size` bytes: the
/// inclusive first and last byte, `Err` if unsatisfiable, `None` if there
/// is no (usable) range.
fn byte_range(header: Option<&str>, size: i64) -> Option<Result<(i64, i64), ()>> {
    let spec = header?.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None; // multipart ranges: the whole blob instead
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let r = match (a.parse::<i64>().ok(), b.parse::<i64>().ok()) {
        (Some(a), Some(b)) if a <= b => (a, b.min(size - 1)),
        (Some(a), None) if b.is_empty() => (a, size - 1),
        (None, Some(n)) if a.is_empty() && n > 0 => ((size - n).max(0), size - 1),
        _ => return Some(Err(())),
    };
    if r.0 >= size || r.0 > r.1 {
        return Some(Err(()));
    }
    Some(Ok(r))
}

impl Registry {
    /// The size of `d` in the namespace, linking it from another namespace
    /// when only there (unless a client deleted it); `None` if containerd
    /// has it nowhere.
    pub(super) async fn blob_size(&self, d: &Digest) -> Result<Option<i64>> {
        if let Some(i) = self.c.content_info(self.ns(), d.as_str()).await? {
            return Ok(Some(i.size));
        }
        if self.tombstones.buried(d.as_str()) {
            return Ok(None);
        }
        self.link_from_elsewhere(d).await
    }

    async fn link_from_elsewhere(&self, d: &Digest) -> Result<Option<i64>> {
        for ns in self.c.list_namespaces().await? {
            let ns = ns.as_str();
            if ns == self.ns() {
                continue;
            }
            let Some(info) = self.c.content_info(ns, d.as_str()).await? else {
                continue;
            };
            // Its children stay referenced (a manifest's GC labels).
            let labels: HashMap<String, String> = info
                .labels
                .iter()
                .filter(|(k, _)| k.starts_with(GC_REF_CONTENT))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let lease = self.upload_lease().await?;
            let blob = BlobRef {
                digest: d.as_str(),
                size: info.size,
                labels: &labels,
            };
            match self
                .c
                .link_or_copy(ns, self.ns(), Some(lease.id()), blob)
                .await
            {
                Ok(how) => {
                    tracing::debug!(digest = %d, from = ns, ?how, "registry: blob linked from another namespace");
                    self.hold(d.as_str(), lease);
                    return Ok(Some(info.size));
                }
                Err(e) => {
                    lease.release().await;
                    return Err(e.into());
                }
            }
        }
        Ok(None)
    }

    pub(super) async fn get_blob(
        &self,
        d: &Digest,
        range: Option<&str>,
        head: bool,
    ) -> Result<Response<Body>> {
        let unknown = || Error::new(Code::BlobUnknown, format!("blob {d} is not here"));
        let size = self.blob_size(d).await?.ok_or_else(unknown)?;
        let (status, first, last) = match byte_range(range, size) {
            None => (StatusCode::OK, 0, size - 1),
            Some(Ok((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b),
            Some(Err(())) => {
                return Ok(answer(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    &[("content-range", format!("bytes */{size}"))],
                ))
            }
        };
        let mut headers = vec![
            ("content-length", (last - first + 1).max(0).to_string()),
            ("content-type", "application/octet-stream".to_string()),
            ("docker-content-digest", d.to_string()),
            ("accept-ranges", "bytes".to_string()),
        ];
        if status == StatusCode::PARTIAL_CONTENT {
            headers.push(("content-range", format!("bytes {first}-{last}/{size}")));
        }
        let mut r = answer(status, &headers);
        if head || size == 0 {
            return Ok(r);
        }
        let stream = match self
            .c
            .read_range(self.ns(), d.as_str(), first, last - first + 1)
            .await
        {
            Ok(s) => s,
            Err(e) if e.is(tonic::Code::NotFound) => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        let body = StreamBody::new(stream.map(|r| {
            r.map(hyper::body::Frame::data)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        }));
        *r.body_mut() = BodyExt::boxed(body);
        Ok(r)
    }

    pub(super) async fn delete_blob(&self, d: &Digest) -> Result<Response<Body>> {
        self.tombstones.bury(d.as_str());
        if self.c.delete_content(self.ns(), d.as_str()).await? {
            Ok(answer(StatusCode::ACCEPTED, &[]))
        } else {
            Err(Error::new(
                Code::BlobUnknown,
                format!("blob {d} is not here"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        let r = |h: &str| byte_range(Some(h), 1000);
        assert_eq!(r("bytes=500-599"), Some(Ok((500, 599))));
        assert_eq!(r("bytes=500-"), Some(Ok((500, 999))));
        assert_eq!(r("bytes=-100"), Some(Ok((900, 999))));
        assert_eq!(r("bytes=900-5000"), Some(Ok((900, 999))));
        assert_eq!(r("bytes=5000-10000"), Some(Err(())));
        assert_eq!(r("bytes=500-0"), Some(Err(())));
        assert_eq!(r("bytes=0-1,5-6"), None);
        assert_eq!(byte_range(None, 10), None);
    }
}
