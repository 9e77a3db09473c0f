//! The calls a drain ends at once instead of letting them finish.

/// Calls that never end on their own: the client has sent its whole
/// request and waits for a stream of replies that lasts until it hangs up
/// (subscriptions to containerd's events, CRI's container events, health
/// watches).
///
/// How a drain treats the calls in flight, once GOAWAY told the client to
/// open no more:
/// - a call on this list is ended at once: RST_STREAM(CANCEL) to containerd,
///   and to the client UNAVAILABLE ([`RESTARTING`]; Trailers-Only, or
///   trailers after the replies it already has), its later frames dropped.
///   Waiting could only run into the drain timeout, and its clients (`ctr
///   events`, kubelet, buildkit) subscribe again on UNAVAILABLE, meeting the
///   next instance;
/// - every other call is let finish (the drain timeout bounds them all):
///   unary calls, those a hook holds (a replication in progress), transfers
///   such as `Content.Read` or `Content.Write`, even when they look idle (a
///   `Diff.Apply` or a writer waiting for its registry sends nothing for
///   seconds), and `Tasks.Wait`, which ends when its process does and whose
///   callers do not retry it. `Streaming.Stream` (containerd 2) serves a
///   `Transfer` call in flight and ends with it.
///
/// The list is matched once per call when it opens (a length compare for
/// nearly every method); the drain itself costs nothing per frame.
pub const OPEN_ENDED: [&str; 3] = [
    "/containerd.services.events.v1.Events/Subscribe",
    "/runtime.v1.RuntimeService/GetContainerEvents",
    "/grpc.health.v1.Health/Watch",
];

/// What the client of an open-ended call is told when a drain ends it.
pub const RESTARTING: &str =
    "imgbridge is restarting: this stream was ended; call again to continue";

pub(super) fn open_ended(method: &str) -> bool {
    OPEN_ENDED.contains(&method)
}
