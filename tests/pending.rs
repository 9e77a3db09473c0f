//! Which missing blobs imgbridge reports: only those a pod on
//! this node could need, and only while an image still names them. A pull
//! for this node's platform never fetches the other platforms of an
//! index, and an image deleted from the source needs nothing any more:
//! neither may be WARNed about, listed under `/status`'s `pending_blobs`
//! or counted in `imgbridge_pending_blobs`. A lazy layer of this node's
//! platform that never comes still is.

use std::path::Path;
use std::time::Duration;

use containerd_client::types::Descriptor;
use imgbridge_test_support::ctr::ingest_bytes;
use imgbridge_test_support::grpc::{content_info, create_image, update_image};
use imgbridge_test_support::images::{
    host_arch, index_of, other_archs, MultiPlatform, PlatformImage,
};
use imgbridge_test_support::prelude::*;

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";
/// The WARN about a blob a pod here could need.
const WARNED: &str = "pods of them fail to start";
/// Its quiet counterpart for a blob only other platforms need (DEBUG).
const NOT_REPORTED: &str = "not reported (no pod on this node runs it)";
/// The INFO for a blob no image names any more.
const FORGOTTEN: &str = "stopped waiting for a blob";
/// Long enough for the backstop (every second at most) to have looked
/// several times past `pending_warn_after`.
const DEADLINE: Duration = Duration::from_secs(30);

/// containerd (with CRI if `cri`) and an imgbridge warning after `warn`
/// (a humantime string), serving `/status` and `/metrics` at the returned
/// address.
fn start(cri: bool, warn: &str) -> (Containerd, Imgbridge, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let scenario = if cri {
        Scenario::cri()
    } else {
        Scenario::plain()
    };
    let (c, p) = scenario
        .config(&format!("[replication]\npending_warn_after = \"{warn}\"\n"))
        .args(&["--metrics-listen", &metrics])
        .start();
    (c, p, metrics)
}

fn status(metrics: &str) -> serde_json::Value {
    let body = http_get(metrics, "/status").expect("/status answers");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status: {e}: {body}"))
}

/// The digests `/status` lists under `pending_blobs`.
fn listed(metrics: &str) -> Vec<String> {
    status(metrics)["pending_blobs"]
        .as_array()
        .expect("pending_blobs is a list")
        .iter()
        .map(|b| b["digest"].as_str().unwrap().to_string())
        .collect()
}

fn gauge(metrics: &str) -> String {
    let text = http_get(metrics, "/metrics").expect("/metrics answers");
    text.lines()
        .find(|l| l.starts_with("imgbridge_pending_blobs "))
        .unwrap_or("imgbridge_pending_blobs (absent)")
        .to_string()
}

/// The log lines naming `digest` that contain `what`.
fn lines(p: &Imgbridge, digest: &str, what: &str) -> Vec<String> {
    p.log()
        .lines()
        .filter(|l| l.contains(digest) && l.contains(what))
        .map(str::to_string)
        .collect()
}

/// Waits until imgbridge has said, one way or the other, that `digest` is
/// overdue: the WARN (a pod here could need it) or the DEBUG line saying it
/// is not reported. Returns whether it warned. This is the point where a
/// WARN would have come: waiting for it (rather than for a while) is what
/// lets a test say that none came.
fn overdue_warned(p: &Imgbridge, digest: &str) -> bool {
    let said = poll(DEADLINE, || {
        let warned = !lines(p, digest, WARNED).is_empty();
        (warned || !lines(p, digest, NOT_REPORTED).is_empty()).then_some(warned)
    });
    said.unwrap_or_else(|| {
        panic!(
            "imgbridge never said {digest} is overdue:\n{}",
            p.log_tail()
        )
    })
}

fn descriptor(media_type: &str, data: &[u8]) -> Descriptor {
    Descriptor {
        media_type: media_type.into(),
        digest: sha256_digest(data),
        size: data.len() as i64,
        ..Default::default()
    }
}

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Writes the config and manifest of `img` straight into the source, not
/// its layer: a lazy layer, as buildkit leaves a base it never needed.
fn write_all_but_layer(sock: &Path, img: &PlatformImage) {
    ingest_bytes(sock, SRC, &img.config);
    ingest_bytes(sock, SRC, &img.manifest);
}

/// `ctr pull` of a multi-platform index for this node's platform, through
/// imgbridge into `buildkit`, as a user of containerd's client would (1.x:
/// the client fetches, then writes the record through imgbridge; 2.x:
/// Transfer, which also fetches the other platforms' manifests and
/// configs). The other platforms' layers are never fetched: nothing
/// is pending that a pod here could need, so nothing is reported: no WARN,
/// an empty `pending_blobs`, a zero gauge; they are counted apart. A later
/// `--all-platforms` pull still brings them into `k8s.io`.
#[tokio::test]
async fn single_platform_pull_of_an_index_reports_nothing() {
    let reg = Registry::start();
    let img = TestImage::hello("multi-pull:1");
    let index = MultiPlatform::new(&img, &other_archs(2));
    let pushed = index.push(&reg.addr(), "multi-pull");
    let (c, p, metrics) = start(true, "1s");

    ctr_ok(p.socket(), SRC, ["images", "pull", "--plain-http", &pushed]);
    let replica = image_target(c.socket(), K8S, &pushed).await;
    assert_eq!(
        replica.digest,
        index.index_digest(),
        "the index is replicated"
    );
    let st = cri_image_status(c.socket(), &pushed).await;
    assert_eq!(
        st.expect("CRI resolves the replica").id,
        img.config_digest(),
        "CRI runs this node's platform"
    );
    // What imgbridge finds missing of each other platform: its manifest,
    // or (containerd 2.x's ctr pulls every platform's metadata through
    // Transfer) its layer.
    let mut foreign = Vec::new();
    for other in &index.others {
        let (m, l) = (other.manifest_digest(), other.layer_digest());
        assert!(
            content_info(c.socket(), SRC, &l).await.is_none(),
            "the pull fetched {}'s layer {l}: the test needs it absent",
            other.arch
        );
        match content_info(c.socket(), SRC, &m).await {
            None => foreign.push((other.arch.clone(), m)),
            Some(_) => foreign.push((other.arch.clone(), l)),
        }
    }

    for (arch, blob) in &foreign {
        assert!(
            !overdue_warned(&p, blob),
            "a WARN for {arch}'s {blob}, which no pod here runs:\n{}",
            lines(&p, blob, WARNED).join("\n")
        );
    }
    assert_eq!(listed(&metrics), Vec::<String>::new(), "pending_blobs");
    let pending = &status(&metrics)["pending"];
    assert_eq!(pending["blobs"], 0, "{pending}");
    assert_eq!(pending["other_platform_blobs"], foreign.len(), "{pending}");
    assert_eq!(gauge(&metrics), "imgbridge_pending_blobs 0");

    ctr_ok(
        p.socket(),
        SRC,
        ["images", "pull", "--plain-http", "--all-platforms", &pushed],
    );
    for other in &index.others {
        for blob in other.blobs() {
            let d = sha256_digest(blob);
            let linked = poll_async(DEADLINE, || async {
                content_info(c.socket(), K8S, &d).await.map(|_| ())
            })
            .await;
            assert!(
                linked.is_some(),
                "{} blob {d} not in k8s.io after --all-platforms:\n{}",
                other.arch,
                p.log_tail()
            );
        }
    }
    let drained = poll(DEADLINE, || {
        (status(&metrics)["pending"]["other_platform_blobs"] == 0).then_some(())
    });
    assert!(drained.is_some(), "{}", status(&metrics)["pending"]);
}

/// The real case stays visible: an index whose entry for this node has a
/// layer that never arrives warns about that layer (and lists and counts
/// it), not about the other platforms' manifests beside it. Once the
/// layer is written (straight to containerd), it is linked and gone.
#[tokio::test]
async fn lazy_layer_of_this_platform_still_warns() {
    let (c, p, metrics) = start(false, "1s");
    let here = PlatformImage::new(host_arch(), "lazy-here");
    let others: Vec<_> = other_archs(2)
        .into_iter()
        .map(|a| PlatformImage::new(a, "lazy-here"))
        .collect();
    write_all_but_layer(c.socket(), &here);
    let mut entries = vec![here.entry()];
    entries.extend(others.iter().map(PlatformImage::entry));
    let index = index_of(&entries);
    ingest_bytes(c.socket(), SRC, &index);
    let name = "docker.io/library/lazy-here:1";
    create_image(p.socket(), SRC, name, &descriptor(INDEX, &index)).await;

    let layer = here.layer_digest();
    assert!(
        overdue_warned(&p, &layer),
        "no WARN for the lazy layer of this node's platform:\n{}",
        p.log_tail()
    );
    let warn = lines(&p, &layer, WARNED).join("\n");
    assert!(warn.contains(name), "the WARN names the image: {warn}");
    for other in &others {
        let m = other.manifest_digest();
        assert!(
            !overdue_warned(&p, &m),
            "a WARN for {}'s manifest:\n{}",
            other.arch,
            lines(&p, &m, WARNED).join("\n")
        );
    }
    assert_eq!(listed(&metrics), vec![layer.clone()], "pending_blobs");
    let blob = &status(&metrics)["pending_blobs"][0];
    assert_eq!(blob["images"], serde_json::json!([name]), "{blob}");
    assert_eq!(gauge(&metrics), "imgbridge_pending_blobs 1");

    ingest_bytes(c.socket(), SRC, &here.layer);
    let linked = poll_async(DEADLINE, || async {
        content_info(c.socket(), K8S, &layer).await.map(|_| ())
    })
    .await;
    assert!(linked.is_some(), "layer never linked:\n{}", p.log_tail());
    let empty = poll(DEADLINE, || listed(&metrics).is_empty().then_some(()));
    assert!(empty.is_some(), "still listed: {:?}", listed(&metrics));
}

/// An image deleted from the source while its blob is pending takes the
/// pending entry with it, without a warning, whichever way it goes: deleted
/// through imgbridge, deleted straight on containerd's socket, or its
/// record pointed at another tree (straight on containerd) that does not
/// name the blob.
#[tokio::test]
async fn deleted_images_leave_nothing_pending() {
    // Long enough that the deletes below land before any of the three is
    // overdue even on a loaded machine: the claim is that a deleted
    // image's blob is never warned about, not that a WARN already said
    // is taken back.
    let (c, p, metrics) = start(false, "4s");
    let complete = PlatformImage::new(host_arch(), "complete");
    for b in complete.blobs() {
        ingest_bytes(c.socket(), SRC, b);
    }
    let mut images = Vec::new();
    for how in ["via-imgbridge", "direct", "moved"] {
        let img = PlatformImage::new(host_arch(), how);
        write_all_but_layer(c.socket(), &img);
        let name = format!("docker.io/library/deleted-{how}:1");
        create_image(p.socket(), SRC, &name, &descriptor(MANIFEST, &img.manifest)).await;
        images.push((name, img.layer_digest()));
    }
    let mut layers: Vec<String> = images.iter().map(|(_, l)| l.clone()).collect();
    layers.sort();
    let all = poll(DEADLINE, || {
        let mut l = listed(&metrics);
        l.sort();
        (l == layers).then_some(())
    });
    assert!(all.is_some(), "listed: {:?}", listed(&metrics));

    ctr_ok(p.socket(), SRC, ["images", "rm", &images[0].0]);
    ctr_ok(c.socket(), SRC, ["images", "rm", &images[1].0]);
    let mut moved = get_image(c.socket(), SRC, &images[2].0).await.unwrap();
    moved.target = Some(descriptor(MANIFEST, &complete.manifest));
    update_image(c.socket(), SRC, moved).await;

    let empty = poll(DEADLINE, || listed(&metrics).is_empty().then_some(()));
    assert!(
        empty.is_some(),
        "still pending after the deletes: {:?}\n{}",
        listed(&metrics),
        p.log_tail()
    );
    // The entries are gone: no WARN can come for them any more.
    for (name, layer) in &images {
        assert_eq!(lines(&p, layer, WARNED), Vec::<String>::new(), "{name}");
        assert!(!lines(&p, layer, FORGOTTEN).is_empty(), "{name}: no INFO");
    }
    let pending = &status(&metrics)["pending"];
    assert_eq!(pending["blobs"], 0, "{pending}");
    assert_eq!(gauge(&metrics), "imgbridge_pending_blobs 0");
}
