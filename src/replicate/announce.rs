//! `/content/create` events for blobs a replica gains, where containerd
//! publishes none itself.
//!
//! Registry mirrors that serve what a node holds (spegel ≥ 0.3) learn a
//! node's new blobs only from containerd's `ContentCreate` events. containerd
//! 2.x publishes one for every committed blob; 1.6 and 1.7 never do, so a
//! replica linked there would be served by tag and then 404 by digest
//! (seen with spegel v0.7.3 on 1.6.20 and 1.7.24). imgbridge publishes the
//! event itself on 1.x, through the Events API every version accepts (the
//! reconciler's barrier uses it too). A blob that only gains its
//! distribution-source label now is announced on every version: the mirror
//! skipped it when it came without one.
//!
//! Best effort: a mirror is an optimisation, so a failed publish is logged
//! and never fails the replication.

use containerd_client::events::ContentCreate;
use containerd_client::services::v1::PublishRequest;
use prost::Message;

use crate::containerd::{request, Containerd};

/// The event's topic and type, as containerd 2.x publishes them.
const TOPIC: &str = "/content/create";
const TYPE_URL: &str = "containerd.events.ContentCreate";

/// Whether containerd `version` publishes `ContentCreate` itself (2.0 on).
pub(super) fn publishes_content_events(version: &str) -> bool {
    let v = version.trim_start_matches('v');
    let major = v.split(['.', '-', '~', '+']).next().unwrap_or("");
    major.parse::<u64>().is_ok_and(|m| m >= 2)
}

/// Publishes `ContentCreate { digest, size }` in `ns`.
pub(super) async fn content_created(c: &Containerd, ns: &str, digest: &str, size: i64) {
    let event = ContentCreate {
        digest: digest.into(),
        size,
    };
    let req = PublishRequest {
        topic: TOPIC.into(),
        event: Some(prost_types::Any {
            type_url: TYPE_URL.into(),
            value: event.encode_to_vec(),
        }),
    };
    if let Err(e) = c.events().publish(request(ns, None, req)).await {
        tracing::debug!(ns, digest, error = %e, "announcing a replica's blob to registry mirrors failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_events_from_2_0() {
        for v in ["1.6.20~ds1", "1.7.24~ds1-6+deb13u1", "v1.7.3", "", "devel"] {
            assert!(!publishes_content_events(v), "{v}");
        }
        for v in ["2.1.9+ds1-5", "v2.4.2", "2.0.0-rc.1", "v3.0.0"] {
            assert!(publishes_content_events(v), "{v}");
        }
    }
}
