//! Every two seconds: imgbridge's process (memory, descriptors, threads)
//! from /proc, its streams and tokio tasks from /metrics, pending work from /status, and
//! containerd's leases, ingests and images read on its own socket.

use std::fs;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use imgbridge_test_support::ctr::ctr;
use imgbridge_test_support::grpc::try_leases_and_ingests;
use imgbridge_test_support::util::{block_on_thread, http_get};

use crate::record::Sample;
use crate::Node;

pub const PERIOD: Duration = Duration::from_secs(2);

pub fn sampler(node: Arc<Node>) {
    while !node.stop.load(Ordering::Relaxed) {
        let s = take(&node);
        node.rec.sample(s);
        // The sampling period.
        std::thread::sleep(PERIOD);
    }
}

/// One sample now.
pub fn take(node: &Node) -> Sample {
    let t = node.rec.now();
    let pid = *node.ib_pid.lock().unwrap();
    let status = pid.and_then(|p| fs::read_to_string(format!("/proc/{p}/status")).ok());
    let field = |name: &str| {
        status.as_deref().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(name))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
    };
    let fds = pid.and_then(|p| {
        fs::read_dir(format!("/proc/{p}/fd"))
            .ok()
            .map(|d| d.count() as u64)
    });
    let metrics = http_get(&node.metrics, "/metrics").unwrap_or_default();
    let gauge = |name: &str| {
        metrics
            .lines()
            .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(' ')))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
    };
    let streams = gauge("imgbridge_proxy_streams_in_flight");
    let tasks = gauge("imgbridge_tasks_alive");
    let status: Option<serde_json::Value> =
        http_get(&node.metrics, "/status").and_then(|b| serde_json::from_str(&b).ok());
    let pending = |k: &str| status.as_ref().and_then(|s| s["pending"][k].as_u64());
    let sock = node.ctd_sock.clone();
    let li = block_on_thread(async move { try_leases_and_ingests(&sock).await }).ok();
    let images = |ns: &str, filters: &[&str]| {
        let out = ctr(
            &node.ctd_sock,
            ns,
            [&["images", "ls", "-q"], filters].concat(),
        );
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).lines().count() as u64)
    };
    Sample {
        t,
        pid,
        rss_kib: field("VmRSS:"),
        fds,
        threads: field("Threads:"),
        tasks,
        streams,
        leases: li
            .as_ref()
            .map(|(l, _)| l.iter().filter(|x| !buildkitd_own(x)).count() as u64),
        buildkit_leases: li
            .as_ref()
            .map(|(l, _)| l.iter().filter(|x| buildkitd_own(x)).count() as u64),
        imgbridge_leases: li
            .as_ref()
            .map(|(l, _)| l.iter().filter(|x| x.2.is_some()).count() as u64),
        ingests: li.as_ref().map(|(_, i)| i.len() as u64),
        images_src: images("buildkit", &[]),
        images_k8s: images("k8s.io", &[]),
        pinned_k8s: images("k8s.io", &[r#"labels."io.cri-containerd.pinned"==pinned"#]),
        pending_blobs: pending("blobs"),
        import_pending: pending("files"),
    }
}

/// A lease buildkitd keeps for its cache or build history: a record per
/// lease in its namespaces, pruned by its own GC, not the node's concern.
fn buildkitd_own((ns, _, owner): &(String, String, Option<String>)) -> bool {
    ns.starts_with("buildkit") && owner.is_none()
}
