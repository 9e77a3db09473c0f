//! Catch-up passes, the events backstop, `imgbridge sync`, the Transfer path
//! (against a fake 2.x Transfer front) and fault recovery, with a real
//! containerd 1.6.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_client::services::v1 as api;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::types::Descriptor;
use http_body_util::BodyExt;
use imgbridge_test_support::ctr::ctr_ingest;
use imgbridge_test_support::front;
use imgbridge_test_support::grpc::{create_image, leases_and_ingests, try_containerd_channel};
use imgbridge_test_support::prelude::*;
use prost::Message;

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";

/// A containerd with CRI whose `buildkit` already holds `name_tag`
/// (written directly, before any imgbridge), and that image's target.
async fn seeded(name_tag: &str) -> (Containerd, Arc<TestImage>, Descriptor) {
    let c = Scenario::cri().containerd();
    let img = TestImage::hello(name_tag);
    ctr_import(c.socket(), SRC, &img.docker_archive());
    let t = image_target(c.socket(), SRC, &img.normalized()).await;
    (c, img, t)
}

/// Images of `buildkit` whose replica is missing or has another target.
async fn unreplicated(sock: &Path) -> Vec<String> {
    let Ok(src) = images_client(sock)
        .await
        .list(with_ns(api::ListImagesRequest::default(), SRC))
        .await
    else {
        return vec!["<list failed>".into()];
    };
    let mut missing = Vec::new();
    for i in src.into_inner().images {
        let name = imgbridge::oci::reference::normalize(&i.name).unwrap();
        let r = get_image(sock, K8S, &name).await;
        if r.and_then(|r| r.target).map(|t| t.digest) != i.target.map(|t| t.digest) {
            missing.push(name);
        }
    }
    missing
}

/// Waits until every image of `buildkit` has a replica with the same target.
async fn all_replicated(sock: &Path, within: Duration) -> Result<(), Vec<String>> {
    match poll_async(within, || async {
        unreplicated(sock).await.is_empty().then_some(())
    })
    .await
    {
        Some(()) => Ok(()),
        None => Err(unreplicated(sock).await),
    }
}

#[tokio::test]
async fn start_pass_repairs_and_second_pass_writes_nothing() {
    let (c, img, t) = seeded("pre:1").await;
    create_image(c.socket(), SRC, "pre-tag:1", &t).await;
    // A stale replica (other digest) and a replica missing its label.
    let other = Descriptor {
        digest: format!("sha256:{}", "5".repeat(64)),
        ..t.clone()
    };
    create_image(c.socket(), K8S, "docker.io/library/pre-tag:1", &other).await;
    let sync = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_imgbridge"))
            .args(["sync", "--upstream", c.socket().to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = sync(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains(" 0 writes"),
        "first pass must repair: {stdout}"
    );
    assert_eq!(
        image_target(c.socket(), K8S, "docker.io/library/pre-tag:1")
            .await
            .digest,
        t.digest
    );
    assert!(cri_image_status(c.socket(), &img.normalized())
        .await
        .is_some());
    let out = sync(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        stdout.contains("checked 2 images, 0 writes"),
        "second pass must be idempotent: {stdout}"
    );

    // A source image whose manifest is not readable cannot be repaired: exit 1 naming it.
    let dir = tempdir("bad-");
    let f = dir.path().join("m");
    std::fs::write(&f, b"garbage").unwrap();
    let d = sha256_digest(b"garbage");
    ctr_ingest(c.socket(), SRC, &d, &f);
    let garbage = Descriptor {
        digest: d,
        size: 7,
        ..t.clone()
    };
    create_image(c.socket(), SRC, "garbage:1", &garbage).await;
    let out = sync(&[]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("could not repair buildkit/garbage:1"),
        "{stdout}"
    );
}

/// The start pass replicates what was there; a write on containerd's own
/// socket is then replicated by the events subscription, with no pass in
/// between, before and after a containerd restart (which renews the
/// subscription and passes again).
#[tokio::test]
async fn serve_start_pass_and_events_backstop_catch_bypass_writes() {
    let (mut c, _img, t) = seeded("early:1").await;
    let p = Imgbridge::start(c.socket(), &[]);
    all_replicated(c.socket(), Duration::from_secs(10))
        .await
        .expect("start pass");
    poll_async(Duration::from_secs(10), || async {
        (passes(&p) >= 1).then_some(())
    })
    .await
    .expect("the start pass logged");
    bypass_write_replicated_by_events(&c, &p, "bypass:1", &t).await;
    // After a containerd restart the subscription is renewed.
    c.kill9();
    c.restart();
    p.wait_for_log(
        "event subscription ended",
        Duration::from_secs(10),
        "the subscription did not see containerd go",
    );
    poll_async(Duration::from_secs(10), || async {
        (passes(&p) >= 2).then_some(())
    })
    .await
    .expect("second pass after reconnect");
    bypass_write_replicated_by_events(&c, &p, "after-restart:1", &t).await;
}

/// How many catch-up passes `p` has finished.
fn passes(p: &Imgbridge) -> usize {
    p.log().matches("reconcile pass done").count()
}

/// Writes image `name` on containerd's own socket, bypassing imgbridge: the
/// events backstop replicates it, not a pass. The deadline is for that
/// event; how fast it comes is the work of a replication on a shared
/// machine, printed, not asserted.
async fn bypass_write_replicated_by_events(
    c: &Containerd,
    p: &Imgbridge,
    name: &str,
    t: &Descriptor,
) {
    let before = passes(p);
    let written = Instant::now();
    create_image(c.socket(), SRC, name, t).await;
    if let Err(missing) = all_replicated(c.socket(), Duration::from_secs(30)).await {
        panic!("{name}: not replicated by the events backstop: {missing:?}");
    }
    eprintln!("{name}: replicated {:?} after the write", written.elapsed());
    assert_eq!(
        passes(p),
        before,
        "{name}: a pass, not the events, replicated it"
    );
}

/// containerd killed in the middle of Creates, half through imgbridge and
/// half straight on its socket: once it is back, the catch-up pass after
/// the reconnect replicates every image the Creates left.
#[tokio::test]
async fn containerd_killed_during_creates_converges() {
    let (mut c, _img, t) = seeded("fault:1").await;
    let p = Imgbridge::start(c.socket(), &[]);
    let mut created = 0;
    for i in 0..20 {
        let via = if i % 2 == 0 {
            p.socket().to_path_buf()
        } else {
            c.socket().to_path_buf()
        };
        // Creates may fail around the kill; the ones before it may not.
        created += images_client(&via)
            .await
            .create(create_image_req(SRC, &format!("f-{i}:1"), &t))
            .await
            .is_ok() as usize;
        if i == 10 {
            assert_eq!(created, 11, "creates before the kill must succeed");
            c.kill9();
            c.restart();
        }
    }
    let back = Instant::now();
    if let Err(missing) = all_replicated(c.socket(), Duration::from_secs(30)).await {
        panic!("not converged: {missing:?}\n{}", p.log_tail());
    }
    eprintln!("converged {:?} after the last Create", back.elapsed());
}

#[tokio::test]
async fn imgbridge_killed_mid_replication_restart_converges() {
    let (c, _img, t) = seeded("crash:1").await;
    let mut p = Imgbridge::start(c.socket(), &[]);
    let sock = p.socket().to_path_buf();
    let listen = sock.clone();
    let writer = tokio::spawn(async move {
        let sock = listen;
        // Creates fail once imgbridge is killed (and connecting is refused
        // after it); count those that went through.
        let mut created = 0;
        for i in 0..40 {
            let Ok(ch) = try_containerd_channel(&sock).await else {
                break;
            };
            created += ImagesClient::new(ch)
                .create(create_image_req(SRC, &format!("k-{i}:1"), &t))
                .await
                .is_ok() as usize;
        }
        created
    });
    // Kill while creates are in flight. (Polled asynchronously: a blocking
    // poll would starve the writer on this single-threaded test runtime.)
    poll_async(Duration::from_secs(20), || async {
        (p.log().matches("replicated").count() >= 3).then_some(())
    })
    .await
    .expect("replications before the kill");
    p.kill9();
    let created = writer.await.unwrap();
    assert!(created >= 1, "no create went through before the kill");
    // What the killed one left: its leases (replications', the spare).
    let (leases, _) = leases_and_ingests(c.socket()).await;
    let dead: Vec<String> = leases.into_iter().filter_map(|(_, _, o)| o).collect();
    assert!(!dead.is_empty(), "the killed imgbridge left no lease");
    let _p2 = Imgbridge::start_at(&sock, c.socket(), &[]);
    let r = all_replicated(c.socket(), Duration::from_secs(10)).await;
    assert!(r.is_ok(), "restart did not converge: {r:?}");
    // The next imgbridge on the socket releases them at once, not at their
    // expiry.
    let clean = poll_async(Duration::from_secs(10), || async {
        let (leases, ingests) = leases_and_ingests(c.socket()).await;
        let left = leases
            .iter()
            .any(|(_, _, o)| o.as_ref().is_some_and(|o| dead.contains(o)));
        (!left && ingests.is_empty()).then_some(())
    })
    .await;
    let (leases, ingests) = leases_and_ingests(c.socket()).await;
    assert!(
        clean.is_some(),
        "the killed imgbridge's leases ({dead:?}) remain: {leases:?}, ingests {ingests:?}"
    );
}

// ---------------------------------------------------------------------------
// Transfer (containerd 2.x) through a fake front
// ---------------------------------------------------------------------------

/// A stand-in for containerd 2.x's Transfer service in front of a containerd
/// that has none (1.6, which the matrix still runs): it answers
/// `Transfer/Transfer` itself the way 2.x does for an ImageStore →
/// ImageStore transfer (a tag: server-side Create, AlreadyExists → Update,
/// reply `Empty`, no Images RPC on the wire), echoes `Streaming/Stream`
/// frames, and relays everything else to the real containerd. On 1.7 and
/// 2.x the tests use the real Transfer service instead; this front exists
/// only for what 1.6 cannot produce.
fn fake_2x(real: PathBuf, listen: &Path) -> front::Front {
    let mut f = front::Front::default();
    f.serve(listen, move |req| fake_handle(real.clone(), req));
    f
}

async fn fake_handle(real: PathBuf, req: front::Request) -> front::Response {
    let path = req.uri().path().to_string();
    let ns = front::namespace(&req);
    if path == "/containerd.services.transfer.v1.Transfer/Transfer" {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let treq = api::TransferRequest::decode(&body[5..]).unwrap();
        let store = |a: &Option<prost_types::Any>| {
            let a = a.as_ref().unwrap();
            assert_eq!(a.type_url, "containerd.types.transfer.ImageStore");
            containerd_client::types::transfer::ImageStore::decode(a.value.as_slice()).unwrap()
        };
        let (src, dst) = (store(&treq.source), store(&treq.destination));
        let Some(from) = get_image(&real, &ns, &src.name).await else {
            return front::grpc_reply(&[], 5, &format!("image \"{}\": not found", src.name));
        };
        let image = api::Image {
            name: dst.name.clone(),
            target: from.target,
            labels: dst.labels,
            ..Default::default()
        };
        let mut cl = images_client(&real).await;
        if cl
            .create(with_ns(
                api::CreateImageRequest {
                    image: Some(image.clone()),
                    ..Default::default()
                },
                &ns,
            ))
            .await
            .is_err()
        {
            cl.update(with_ns(
                api::UpdateImageRequest {
                    image: Some(image),
                    ..Default::default()
                },
                &ns,
            ))
            .await
            .unwrap();
        }
        return front::grpc_reply(&[], 0, "");
    }
    if path == "/containerd.services.streaming.v1.Streaming/Stream" {
        // Echo: bidi frames come back as they were sent.
        let body = req.into_body();
        let echoed = body.boxed();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", 0.into());
        return http::Response::builder()
            .header("content-type", "application/grpc")
            .body(
                echoed
                    .with_trailers(async move { Some(Ok(trailers)) })
                    .boxed(),
            )
            .unwrap();
    }
    front::relay(&real, req).await
}

#[tokio::test]
async fn transfer_tag_into_source_namespace_is_replicated_before_reply() {
    let (c, img, _t) = seeded("xfer:1").await;
    let dir = tempdir("fake2x-");
    // The real Transfer service where there is one (1.7, 2.x).
    let real = flavor().has_transfer();
    let mut _fake = None;
    let upstream = if real {
        c.socket().to_path_buf()
    } else {
        let fake_sock = dir.path().join("containerd2.sock");
        _fake = Some(fake_2x(c.socket().to_path_buf(), &fake_sock));
        fake_sock
    };
    // Reconcile off: only the Transfer hook can replicate the tag.
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[reconcile]\nenabled = false\n").unwrap();
    let p = Imgbridge::start(&upstream, &["--config", cfg.to_str().unwrap()]);
    let store = |name: &str| {
        containerd_client::to_any(&containerd_client::types::transfer::ImageStore {
            name: name.into(),
            ..Default::default()
        })
    };
    // A Streaming.Stream stays open alongside the held Transfer.
    let chan = containerd_channel(p.socket()).await;
    let mut streaming = api::streaming_client::StreamingClient::new(chan.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(containerd_client::to_any(&api::StreamInit {
        id: "progress-1".into(),
    }))
    .await
    .unwrap();
    let mut echo = streaming
        .stream(with_ns(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            SRC,
        ))
        .await
        .unwrap()
        .into_inner();
    // containerd acknowledges the registration (an `Empty`); the fake
    // echoes the init. Either way the stream is known before the transfer.
    let first = echo.message().await.unwrap().unwrap();
    if !real {
        let init = api::StreamInit::decode(first.value.as_slice()).unwrap();
        assert_eq!(init.id, "progress-1");
    }
    let mut transfer = api::transfer_client::TransferClient::new(chan);
    transfer
        .transfer(with_ns(
            api::TransferRequest {
                source: Some(store(&img.normalized())),
                destination: Some(store("docker.io/library/xfer-tag:2")),
                options: Some(api::TransferOptions {
                    progress_stream: "progress-1".into(),
                }),
            },
            SRC,
        ))
        .await
        .expect("transfer through the proxy");
    let st = cri_image_status(c.socket(), "docker.io/library/xfer-tag:2").await;
    assert_eq!(
        st.expect("replicated before the Transfer reply").id,
        img.config_digest()
    );
    drop(tx);
}

/// A lease released while containerd is down (SIGKILLed under an import,
/// an upload, a replication) is released once containerd is back, the
/// half-written ingest under it aborted: the hour's soak found one such
/// lease per few containerd kills, each holding its bytes until its expiry
/// (four hours for an import; docs/reliability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_released_while_containerd_is_down_goes_once_it_is_back() {
    use imgbridge::containerd::content::IngestStart;
    let mut c = Scenario::cri().containerd();
    let lib = imgbridge::containerd::Containerd::new(c.socket());
    let lease = lib.lease(K8S, Duration::from_secs(4 * 3600)).await.unwrap();
    let id = lease.id().to_string();
    let data = vec![7u8; 4 << 20];
    let digest = imgbridge_test_support::grpc::sha256_digest(&data);
    let IngestStart::Open(mut ingest) = lib
        .open_ingest(K8S, Some(&id), Some(&digest), 2 * data.len() as i64)
        .await
        .unwrap()
    else {
        panic!("a new blob is opened, not present");
    };
    ingest.write(data).await.unwrap();
    let half = poll(imgbridge_test_support::util::READY_TIMEOUT, || {
        c.ingests(K8S).iter().any(|&o| o >= 4 << 20).then_some(())
    });
    assert!(half.is_some(), "the ingest never reached containerd");

    let held = |(leases, ingests): imgbridge_test_support::grpc::LeasesAndIngests| {
        let mine: Vec<_> = leases.into_iter().filter(|(_, l, _)| *l == id).collect();
        (mine, ingests)
    };
    let (mine, ingests) = held(leases_and_ingests(c.socket()).await);
    assert!(
        !mine.is_empty() && !ingests.is_empty(),
        "nothing to release (leases {mine:?}, ingests {ingests:?})"
    );

    c.kill9();
    drop(ingest);
    lease.release().await;
    c.restart();
    let gone = poll_async(Duration::from_secs(10), || async {
        let (mine, ingests) = held(leases_and_ingests(c.socket()).await);
        (mine.is_empty() && ingests.is_empty()).then_some(())
    })
    .await;
    let (mine, ingests) = held(leases_and_ingests(c.socket()).await);
    assert!(
        gone.is_some(),
        "10 s after containerd was back, the lease released while it was down is still there: \
         leases {mine:?}, ingests {ingests:?}"
    );
}

/// A lease whose maker gave up while `Leases.Create` was in flight (a
/// replication whose client went, a timeout) is released once the answer
/// comes, not left empty until its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_maker_gave_up_mid_call_is_released() {
    let (c, _dir, _front, lib) = behind(slow_lease_answers);

    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        lib.create_lease(K8S, Duration::from_secs(4 * 3600)),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the slow answer came at once: {gave_up:?}"
    );
    let made = poll_async(Duration::from_secs(10), || async {
        (!my_leases(c.socket()).await.is_empty()).then_some(())
    })
    .await;
    assert!(made.is_some(), "containerd never made the lease");

    let gone = poll_async(Duration::from_secs(10), || async {
        my_leases(c.socket()).await.is_empty().then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "10 s after containerd answered, the lease nobody waited for is still there: {:?}",
        my_leases(c.socket()).await
    );
}

/// A containerd, and a client of this crate's that reaches it through the
/// front `make` puts before it (on a socket in the dir returned).
fn behind(
    make: fn(PathBuf, &Path) -> front::Front,
) -> (
    imgbridge_test_support::containerd::Containerd,
    tempfile::TempDir,
    front::Front,
    imgbridge::containerd::Containerd,
) {
    let c = Scenario::cri().containerd();
    let dir = tempfile::tempdir().unwrap();
    let listen = dir.path().join("front.sock");
    let f = make(c.socket().to_path_buf(), &listen);
    let lib = imgbridge::containerd::Containerd::new(&listen);
    (c, dir, f, lib)
}

/// The leases this process made in the containerd at `sock`.
async fn my_leases(sock: &Path) -> Vec<String> {
    let owner = imgbridge::containerd::leases::owner();
    leases_and_ingests(sock)
        .await
        .0
        .into_iter()
        .filter(|(_, _, o)| o.as_deref() == Some(owner))
        .map(|(_, id, _)| id)
        .collect()
}

/// Relays every call to the containerd at `real`, but holds each answer
/// to `Leases.Create` back for two seconds after containerd gave it: the
/// window in which a caller that stops waiting leaves a lease behind. A
/// real containerd answers too fast to open it on purpose (frozen, it
/// sees the cancel before the call and makes nothing), so a front does.
fn slow_lease_answers(real: PathBuf, listen: &Path) -> front::Front {
    let mut f = front::Front::default();
    f.serve(listen, move |req| {
        let real = real.clone();
        async move {
            let slow = req.uri().path().ends_with(".Leases/Create");
            // Its own task: containerd gets the whole call even when the
            // caller resets it.
            let resp = tokio::spawn(async move { front::relay(&real, req).await })
                .await
                .unwrap();
            if slow {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            resp
        }
    });
    f
}

/// A lease whose release failed for good (containerd answered the delete
/// with an error that is not worth a retry) is ended by the next sweep of
/// imgbridge's leases, not left to its expiry: the hour under faults left
/// one, holding three blobs (docs/reliability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_release_failed_is_ended_by_the_sweep() {
    use imgbridge::containerd::{leases, orphans, Containerd};
    let (c, dir, _front, lib) = behind(failing_lease_deletes);
    let id = lib
        .create_lease(K8S, Duration::from_secs(4 * 3600))
        .await
        .unwrap();
    lib.release_lease(K8S, &id).await;
    assert_eq!(
        my_leases(c.socket()).await,
        vec![id.clone()],
        "the failing front let the delete through"
    );
    assert!(
        !leases::holds(K8S, &id),
        "a released lease is still counted as held"
    );

    let owners = dir.path().join("owners");
    std::fs::create_dir_all(&owners).unwrap();
    let swept = orphans::sweep(&Containerd::new(c.socket()), &owners, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        my_leases(c.socket()).await,
        Vec::<String>::new(),
        "the sweep left the lease nobody holds ({swept:?})"
    );
    assert_eq!(swept.own, 1, "{swept:?}");
}

/// Relays every call to the containerd at `real` but answers each
/// `Leases.Delete` itself with INTERNAL: a release that fails in a way no
/// retry mends, which no real containerd here answers on demand.
fn failing_lease_deletes(real: PathBuf, listen: &Path) -> front::Front {
    let mut f = front::Front::default();
    f.serve(listen, move |req| {
        let real = real.clone();
        async move {
            if req.uri().path().ends_with(".Leases/Delete") {
                return front::grpc_reply(&[], 13, "injected: delete failed");
            }
            front::relay(&real, req).await
        }
    });
    f
}
