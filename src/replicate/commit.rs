//! Read-your-writes for blobs: a `Content.Write` in a source namespace that
//! commits a blob a replica is waiting for (buildkit's lazy layers, written
//! after the image record) finishes, as the client sees it, only once the
//! blob is in every target. The proxy shows this watch the head of each
//! request message and holds the reply to each COMMIT message (found by
//! its position, however many messages the client sent before reading a
//! reply) while it links.
//!
//! Writes of blobs nobody waits for cost one hash lookup per COMMIT.

use std::sync::Arc;

use bytes::Bytes;
use containerd_client::services::v1::{WriteAction, WriteContentResponse};
use prost::encoding::{decode_key, decode_varint, WireType};
use prost::Message;

use super::Replicator;
use crate::proxy::intercept::{StreamWatch, WatchFuture};

pub const WRITE: &str = "/containerd.services.content.v1.Content/Write";

/// gRPC's ALREADY_EXISTS: a Write whose `expected` blob is already there.
const ALREADY_EXISTS: i32 = 6;

/// Distinct `expected` digests one write may name that are remembered. A
/// write names one blob; this only bounds what an odd client costs.
const EXPECTED_MAX: usize = 4;

/// The fields of a `WriteContentRequest` that come before its data.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Head {
    pub action: i32,
    pub expected: Option<String>,
}

/// Reads `action` (1) and `expected` (4) from the start of an encoded
/// `WriteContentRequest`, stopping at `data` (6) or where `buf` is cut off.
/// Hand-written because prost decodes only whole messages, and the data
/// field (up to megabytes) must not be copied to read two small fields.
pub fn head(mut buf: &[u8]) -> Head {
    let mut h = Head::default();
    while !buf.is_empty() {
        let Ok((tag, wire)) = decode_key(&mut buf) else {
            break;
        };
        match wire {
            WireType::Varint => {
                let Ok(v) = decode_varint(&mut buf) else {
                    break;
                };
                if tag == 1 {
                    h.action = v as i32;
                }
            }
            WireType::LengthDelimited => {
                if tag == 6 {
                    break;
                }
                let Ok(len) = decode_varint(&mut buf) else {
                    break;
                };
                let Ok(len) = usize::try_from(len) else { break };
                if len > buf.len() {
                    break;
                }
                if tag == 4 {
                    h.expected = std::str::from_utf8(&buf[..len]).ok().map(str::to_string);
                }
                buf = &buf[len..];
            }
            WireType::SixtyFourBit if buf.len() >= 8 => buf = &buf[8..],
            WireType::ThirtyTwoBit if buf.len() >= 4 => buf = &buf[4..],
            _ => break,
        }
    }
    h
}

/// Watches one `Content.Write` call in a source namespace.
pub struct WriteWatch {
    r: Arc<Replicator>,
    ns: String,
    /// The digests the client said it writes (any message may say one).
    /// All of them, not the last: a pipelining client's later messages
    /// pass before containerd answers the one it found already there.
    expected: Vec<String>,
}

impl WriteWatch {
    pub fn new(r: Arc<Replicator>, ns: String) -> Self {
        WriteWatch {
            r,
            ns,
            expected: Vec::new(),
        }
    }

    /// Links `digest` into the targets waiting for it, if any. Bounded by
    /// the replication timeout: a stuck containerd delays the client's
    /// commit, it never hangs it.
    fn link(&self, digest: String) -> Option<WatchFuture> {
        if !self.r.awaits(&self.ns, &digest) {
            return None;
        }
        let r = self.r.clone();
        let ns = self.ns.clone();
        Some(Box::pin(async move {
            let limit = r.settings().timeout;
            if tokio::time::timeout(limit, r.committed(&ns, &digest))
                .await
                .is_err()
            {
                tracing::warn!(digest = %digest, source = ?ns, timeout_s = limit.as_secs(),
                    "a committed blob that images wait for was not linked into every target in time; released the client's commit, the backstop keeps trying");
            }
        }))
    }
}

impl StreamWatch for WriteWatch {
    fn request(&mut self, bytes: &[u8]) -> bool {
        let h = head(bytes);
        if let Some(e) = h.expected {
            if !self.expected.contains(&e) && self.expected.len() < EXPECTED_MAX {
                self.expected.push(e);
            }
        }
        h.action == WriteAction::Commit as i32
    }

    fn reply(&mut self, message: Bytes) -> Option<WatchFuture> {
        let resp = WriteContentResponse::decode(message).ok()?;
        if resp.action != WriteAction::Commit as i32 || resp.digest.is_empty() {
            return None;
        }
        self.link(resp.digest)
    }

    fn end(&mut self, grpc_status: Option<i32>) -> Option<WatchFuture> {
        // Someone else committed the blob first: the client takes this as
        // success, so it must be in the targets by now too.
        if grpc_status != Some(ALREADY_EXISTS) {
            return None;
        }
        let links: Vec<_> = (self.expected.iter())
            .filter_map(|d| self.link(d.clone()))
            .collect();
        match links.len() {
            0 => None,
            1 => links.into_iter().next(),
            _ => Some(Box::pin(async move {
                futures_util::future::join_all(links).await;
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_client::services::v1::WriteContentRequest;

    fn encode(r: &WriteContentRequest) -> Vec<u8> {
        r.encode_to_vec()
    }

    #[test]
    fn head_reads_action_and_expected_before_the_data() {
        let r = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: "buildkit/1/layer-sha256:abc".into(),
            total: 42,
            expected: "sha256:abc".into(),
            offset: 42,
            data: vec![7; 4096],
            labels: [("a".to_string(), "b".to_string())].into(),
        };
        let b = encode(&r);
        assert_eq!(
            head(&b),
            Head {
                action: 2,
                expected: Some("sha256:abc".into())
            }
        );
        // Cut anywhere: never panics, never invents a field.
        for n in 0..b.len().min(200) {
            let h = head(&b[..n]);
            assert!(h.action == 0 || h.action == 2);
            if let Some(e) = h.expected {
                assert_eq!(e, "sha256:abc");
            }
        }
    }

    #[test]
    fn head_of_a_write_stops_at_the_data() {
        let r = WriteContentRequest {
            action: WriteAction::Write as i32,
            offset: 10,
            data: vec![1; 100],
            ..Default::default()
        };
        let b = encode(&r);
        assert_eq!(head(&b[..8]).action, 1);
        assert_eq!(head(&b).expected, None);
    }

    /// A pipelining client's messages all pass before containerd answers
    /// the first one whose blob it finds already there: the end links
    /// every digest the write named, not only the last one seen.
    #[tokio::test]
    async fn already_exists_links_a_digest_named_before_the_last_message() {
        let (a, b) = (
            "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        );
        let settings = super::super::Settings::from(&crate::config::Replication::default());
        let r = Replicator::new(
            crate::containerd::Containerd::new("/nonexistent/imgbridge-test.sock"),
            settings,
        );
        r.pending.add(super::super::pending::Item {
            source: "buildkit".into(),
            target: "k8s.io".into(),
            owner: super::super::pending::Owner {
                image: "docker.io/library/x:1".into(),
                root: "sha256:cccc".into(),
                need: super::super::tree::Need::Node,
            },
            child: super::super::tree::Child::new(
                "application/vnd.oci.image.layer.v1.tar",
                crate::oci::Digest::parse(a).unwrap(),
                1,
            ),
        });
        let mut w = WriteWatch::new(r, "buildkit".into());
        for (action, expected) in [(WriteAction::Stat, a), (WriteAction::Commit, b)] {
            let m = WriteContentRequest {
                action: action as i32,
                expected: expected.into(),
                ..Default::default()
            };
            w.request(&encode(&m));
        }
        assert!(w.end(Some(0)).is_none(), "an OK end links nothing");
        assert!(
            w.end(Some(ALREADY_EXISTS)).is_some(),
            "{a}, which an image waits for, is linked"
        );
    }

    #[test]
    fn head_of_garbage_is_empty() {
        assert_eq!(head(&[0xff; 16]), Head::default());
        assert_eq!(head(&[]), Head::default());
    }
}
