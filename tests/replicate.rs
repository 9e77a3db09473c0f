//! Synchronous replication from `buildkit` into `k8s.io` against a real
//! containerd 1.6 with CRI: every check reads containerd's own socket right
//! after the proxied call returns (no polling where read-your-writes is the
//! claim).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_client::services::v1 as api;
use containerd_client::types::Descriptor;
use imgbridge_test_support::cri::run_hello_pod;
use imgbridge_test_support::ctr::ctr_ingest;
use imgbridge_test_support::grpc::{
    assert_cri_managed, content_info, create_image, placeholder_manifest, update_image,
};
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::scenario::config_file;
use serde_json::json;

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";

/// Blobs of a test image's OCI layout: (manifest, config, layers).
struct Blobs {
    layout: PathBuf,
    manifest: Descriptor,
    config: String,
    layers: Vec<Descriptor>,
}

fn blobs(img: &TestImage) -> Blobs {
    let layout = img.layout().to_path_buf();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let m = &index["manifests"][0];
    let digest = m["digest"].as_str().unwrap().to_string();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(blob_path(&layout, &digest)).unwrap()).unwrap();
    let desc = |v: &serde_json::Value| Descriptor {
        media_type: v["mediaType"].as_str().unwrap().into(),
        digest: v["digest"].as_str().unwrap().into(),
        size: v["size"].as_i64().unwrap(),
        ..Default::default()
    };
    Blobs {
        manifest: desc(m),
        config: manifest["config"]["digest"].as_str().unwrap().into(),
        layers: manifest["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(desc)
            .collect(),
        layout,
    }
}

fn blob_path(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// Labels a manifest/index in `ns` with the gc.ref labels buildkit writes,
/// so its children are kept alive there once they land.
fn gc_label(sock: &Path, ns: &str, parent: &str, children: &[(&str, &str)]) {
    let mut args = vec!["content".to_string(), "label".into(), parent.into()];
    for (k, d) in children {
        args.push(format!("containerd.io/gc.ref.content.{k}={d}"));
    }
    ctr_ok(sock, ns, args);
}

/// Digests of the manifest, config and layers of the replica `name` in
/// k8s.io, read from the manifest as stored in `ns`.
async fn replica_blobs(sock: &Path, ns: &str, name: &str) -> Vec<String> {
    let manifest = image_target(sock, K8S, name).await.digest;
    let out = ctr_ok(sock, ns, ["content", "get", &manifest]);
    let m: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut d = vec![
        manifest,
        m["config"]["digest"].as_str().unwrap().to_string(),
    ];
    d.extend(
        m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["digest"].as_str().unwrap().to_string()),
    );
    d
}

fn target_of(img: &api::Image) -> String {
    img.target.as_ref().unwrap().digest.clone()
}

#[tokio::test]
async fn ctr_import_is_visible_to_cri_on_return_and_runs_as_pod() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("rywimport:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    // Read-your-writes: no polling.
    let st = cri_image_status(c.socket(), &img.normalized())
        .await
        .expect("CRI must resolve the image as soon as the import returns");
    assert_eq!(st.id, img.config_digest());
    let replica = get_image(c.socket(), K8S, &img.normalized()).await.unwrap();
    assert_eq!(
        replica
            .labels
            .get("io.imgbridge.source")
            .map(String::as_str),
        Some(SRC)
    );
    assert!(
        !replica.labels.contains_key("io.cri-containerd.pinned"),
        "pin defaults to false"
    );
    let digest_ref = format!("docker.io/library/rywimport@{}", target_of(&replica));
    assert!(
        get_image(c.socket(), K8S, &digest_ref).await.is_some(),
        "digest ref record"
    );
    run_hello_pod(c.socket(), &img.normalized(), "rywimport:1").await;
}

#[tokio::test]
async fn pull_tag_label_rm_through_proxy() {
    let (c, p) = Scenario::cri()
        .config("[replication]\npin = true\n")
        .start();
    let reg = Registry::start();
    let img = TestImage::hello("pulled:2");
    let pushed = img.push(&reg.addr());
    ctr_ok(p.socket(), SRC, ["images", "pull", "--plain-http", &pushed]);
    let r = get_image(c.socket(), K8S, &pushed)
        .await
        .expect("pulled image replicated");
    assert_eq!(
        r.labels.get("io.cri-containerd.pinned").map(String::as_str),
        Some("pinned")
    );
    assert!(cri_image_status(c.socket(), &pushed).await.is_some());

    ctr_ok(p.socket(), SRC, ["images", "tag", &pushed, "app:dev"]);
    assert!(
        cri_image_status(c.socket(), "app:dev").await.is_some(),
        "tag normalised to docker.io/library/app:dev"
    );
    ctr_ok(p.socket(), SRC, ["images", "label", "app:dev", "team=blue"]);
    let r = get_image(c.socket(), K8S, "docker.io/library/app:dev")
        .await
        .unwrap();
    assert_eq!(r.labels.get("team").map(String::as_str), Some("blue"));

    // delete_policy = unpin (default): replica stays, pin is gone.
    ctr_ok(p.socket(), SRC, ["images", "rm", "app:dev"]);
    let r = get_image(c.socket(), K8S, "docker.io/library/app:dev")
        .await
        .expect("replica kept");
    assert!(
        !r.labels.contains_key("io.cri-containerd.pinned"),
        "{:?}",
        r.labels
    );
}

#[tokio::test]
async fn buildkit_sequence_update_notfound_create() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("bk:1");
    // Content in buildkit under another name, written directly (not replicated).
    ctr_import(c.socket(), SRC, &img.docker_archive());
    let target = image_target(c.socket(), SRC, &img.normalized()).await;
    let mut cl = images_client(p.socket()).await;
    let image = api::Image {
        name: "bk-export:1".into(),
        target: Some(target.clone()),
        ..Default::default()
    };
    let e = cl
        .update(with_ns(
            api::UpdateImageRequest {
                image: Some(image.clone()),
                update_mask: None,
                ..Default::default()
            },
            SRC,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    cl.create(with_ns(
        api::CreateImageRequest {
            image: Some(image),
            ..Default::default()
        },
        SRC,
    ))
    .await
    .unwrap();
    let st = cri_image_status(c.socket(), "docker.io/library/bk-export:1").await;
    assert_eq!(st.expect("visible on return").id, img.config_digest());
    // buildkit re-exports: Update without mask now succeeds and stays in sync.
    let other = TestImage::hello("bk:2");
    ctr_import(c.socket(), SRC, &other.docker_archive());
    let t2 = image_target(c.socket(), SRC, &other.normalized()).await;
    let image = api::Image {
        name: "bk-export:1".into(),
        target: Some(t2.clone()),
        ..Default::default()
    };
    cl.update(with_ns(
        api::UpdateImageRequest {
            image: Some(image),
            update_mask: None,
            ..Default::default()
        },
        SRC,
    ))
    .await
    .unwrap();
    let st = cri_image_status(c.socket(), "docker.io/library/bk-export:1")
        .await
        .unwrap();
    assert_eq!(
        st.id,
        other.config_digest(),
        "digest change must reach CRI before the reply"
    );
    let r = get_image(c.socket(), K8S, "docker.io/library/bk-export:1")
        .await
        .unwrap();
    assert_eq!(r.target.unwrap().digest, t2.digest);
}

#[tokio::test]
async fn isolated_content_sharing_copies_bytes() {
    let (c, p) = Scenario::cri().isolated().start();
    let img = TestImage::hello("iso:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    assert!(cri_image_status(c.socket(), &img.normalized())
        .await
        .is_some());
    for d in replica_blobs(c.socket(), SRC, &img.normalized()).await {
        let src = ctr(c.socket(), SRC, ["content", "get", &d]);
        let dst = ctr(c.socket(), K8S, ["content", "get", &d]);
        assert!(
            dst.status.success(),
            "{d} not readable in k8s.io: {}",
            String::from_utf8_lossy(&dst.stderr)
        );
        assert!(
            !dst.stdout.is_empty() && dst.stdout == src.stdout,
            "{d}: bytes differ"
        );
    }
    run_hello_pod(c.socket(), &img.normalized(), "iso:1").await;
}

/// Several large blobs copied at once (isolated content): the copies must
/// not starve each other's WRITE acknowledgements (they used to deadlock on
/// one shared HTTP/2 connection until the replication timed out). So the
/// replication completes rather than times out; how fast the copy runs is
/// `scripts/bench-replication.sh`'s (A3).
#[tokio::test]
async fn isolated_concurrent_large_copies_complete() {
    let (c, p) = Scenario::cri().isolated().start();
    let img = TestImage::build("isobig:1", 4, &[], 12 << 20);
    ctr_import(p.socket(), SRC, &img.docker_archive());
    let log = p.log();
    assert!(
        !log.contains("replication timed out") && !log.contains("replication failed"),
        "the copies did not complete:\n{}",
        p.log_tail()
    );
    assert!(cri_image_status(c.socket(), &img.normalized())
        .await
        .is_some());
    for d in replica_blobs(c.socket(), SRC, &img.normalized()).await {
        let src = content_info(c.socket(), SRC, &d).await.expect("in source");
        let dst = content_info(c.socket(), K8S, &d)
            .await
            .unwrap_or_else(|| panic!("{d} missing in {K8S}"));
        assert_eq!(src.size, dst.size, "{d}");
    }
}

/// An image created before its layers are in the source: the reply does
/// not wait for them, and layers written later behind imgbridge's back are
/// linked by the backstop, which checks a missing blob at least once a
/// second (docs/design.md, "Pending blobs").
#[tokio::test]
async fn lazy_layer_written_after_create_is_linked_within_a_second() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("lazy:1");
    let b = blobs(&img);
    ctr_ingest(c.socket(), SRC, &b.config, &blob_path(&b.layout, &b.config));
    ctr_ingest(
        c.socket(),
        SRC,
        &b.manifest.digest,
        &blob_path(&b.layout, &b.manifest.digest),
    );
    let mut refs = vec![("config".to_string(), b.config.clone())];
    refs.extend(
        b.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("l.{i}"), l.digest.clone())),
    );
    let refs: Vec<(&str, &str)> = refs.iter().map(|(k, d)| (k.as_str(), d.as_str())).collect();
    gc_label(c.socket(), SRC, &b.manifest.digest, &refs);
    // The layers come only after the reply, so any reply shows it did not
    // wait for them; the deadline (half of `replication.timeout`, which a
    // reply held for them would wait out) keeps a hold from hanging the test.
    tokio::time::timeout(
        Duration::from_secs(60),
        create_image(p.socket(), SRC, "lazy:1", &b.manifest),
    )
    .await
    .expect("missing layers must not block the reply");
    // ImageStatus needs only the config: resolvable already.
    assert!(cri_image_status(c.socket(), "docker.io/library/lazy:1")
        .await
        .is_some());
    for l in &b.layers {
        assert!(content_info(c.socket(), K8S, &l.digest).await.is_none());
    }
    let ingest = Instant::now();
    for l in &b.layers {
        ctr_ingest(c.socket(), SRC, &l.digest, &blob_path(&b.layout, &l.digest));
    }
    let appeared = Instant::now();
    let linked = poll_async(Duration::from_secs(30), || async {
        let mut all = true;
        for l in &b.layers {
            all &= content_info(c.socket(), K8S, &l.digest).await.is_some();
        }
        all.then(|| appeared.elapsed())
    })
    .await;
    let Some(linked) = linked else {
        panic!("late layers never linked:\n{}", p.log_tail());
    };
    // The backstop's second, then the link: less work than the `ctr`
    // ingest of the same layers just now, so that ingest's time (at least
    // 500 ms) is the allowance for it on a loaded machine. A backstop
    // checking every few seconds fails.
    let ingest = appeared - ingest;
    let bound = Duration::from_secs(1) + ingest.max(Duration::from_millis(500));
    eprintln!("late layers linked {linked:?} after their ingest, which took {ingest:?}");
    assert!(
        linked <= bound,
        "linked {linked:?} after the layers were written, over {bound:?} (their ingest took {ingest:?})"
    );
    run_hello_pod(c.socket(), "docker.io/library/lazy:1", "lazy:1").await;
}

/// Writes `img`'s blobs into the source namespace straight to containerd,
/// and an index naming its manifest for linux/amd64 and an absent one for
/// linux/arm64; returns the index's descriptor and the absent digest.
fn two_platform_index(sock: &Path, img: &TestImage) -> (Descriptor, String) {
    let b = blobs(img);
    for d in b
        .layers
        .iter()
        .map(|l| l.digest.clone())
        .chain([b.config.clone(), b.manifest.digest.clone()])
    {
        ctr_ingest(sock, SRC, &d, &blob_path(&b.layout, &d));
    }
    let absent = format!("sha256:{}", "e".repeat(64));
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": b.manifest.media_type, "digest": b.manifest.digest, "size": b.manifest.size,
             "platform": {"architecture": "amd64", "os": "linux"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": absent, "size": 500,
             "platform": {"architecture": "arm64", "os": "linux"}}
        ]
    })
    .to_string();
    let dir = tempdir("index-");
    let f = dir.path().join("index.json");
    std::fs::write(&f, &index).unwrap();
    let idx_digest = format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(index.as_bytes()))
    );
    ctr_ingest(sock, SRC, &idx_digest, &f);
    let target = Descriptor {
        media_type: "application/vnd.oci.image.index.v1+json".into(),
        digest: idx_digest,
        size: index.len() as i64,
        ..Default::default()
    };
    (target, absent)
}

#[tokio::test]
async fn two_platform_index_with_only_host_platform_present_runs() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("multi:1");
    let (target, absent) = two_platform_index(c.socket(), &img);
    let idx_digest = target.digest.clone();
    create_image(p.socket(), SRC, "multi:1", &target).await;
    let st = cri_image_status(c.socket(), "docker.io/library/multi:1")
        .await
        .expect("host platform resolves");
    assert_eq!(st.id, img.config_digest());
    let idx = content_info(c.socket(), K8S, &idx_digest).await.unwrap();
    assert_eq!(
        idx.labels.get("containerd.io/gc.ref.content.m.1"),
        Some(&absent),
        "children kept alive via gc labels"
    );
    run_hello_pod(c.socket(), "docker.io/library/multi:1", "multi:1").await;
    assert!(
        p.log().contains("will link it when it appears"),
        "pending work is logged"
    );
}

/// One config under two trees (a docker-archive's manifest, and an index
/// naming that manifest): the id record CRI keeps stays where it was first
/// written. Replicating either again writes nothing in `k8s.io`; moving the
/// record to the tree at hand would flip it on every pass.
#[tokio::test]
async fn one_config_under_two_trees_leaves_its_id_record_alone() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("twotrees:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    let (index, _) = two_platform_index(c.socket(), &img);
    create_image(p.socket(), SRC, "twotrees-index:1", &index).await;
    let id = img.config_digest();
    let manifest = target_of(&get_image(c.socket(), K8S, &img.normalized()).await.unwrap());
    let record = id_record(c.socket(), &id).await;
    assert_eq!(target_of(&record), manifest, "written with the first tree");
    let mut events = ImageEvents::start(c.socket()).await;
    // Both source records written again as they are: each replicates.
    for name in [img.normalized(), "twotrees-index:1".to_string()] {
        let image = get_image(c.socket(), SRC, &name).await.unwrap();
        update_image(p.socket(), SRC, image).await;
    }
    events.mark().await;
    assert_eq!(events.seen, vec![], "nothing written in k8s.io");
    let st = cri_image_status(c.socket(), "docker.io/library/twotrees-index:1").await;
    assert_eq!(st.expect("the index name resolves").id, id);
}

#[tokio::test]
async fn delete_policies() {
    let c = Scenario::cri().containerd();
    let img = TestImage::hello("del:1");
    ctr_import(c.socket(), SRC, &img.docker_archive());
    let target = image_target(c.socket(), SRC, &img.normalized()).await;
    for (policy, name) in [
        ("unpin", "del-unpin:1"),
        ("delete", "del-delete:1"),
        ("keep", "del-keep:1"),
    ] {
        let p = Imgbridge::with_config(
            c.socket(),
            &format!("[replication]\npin = true\ndelete_policy = \"{policy}\"\n"),
        );
        let mut cl = images_client(p.socket()).await;
        cl.create(create_image_req(SRC, name, &target))
            .await
            .unwrap();
        let full = format!("docker.io/library/{name}");
        assert!(get_image(c.socket(), K8S, &full)
            .await
            .unwrap()
            .labels
            .contains_key("io.cri-containerd.pinned"));
        cl.delete(with_ns(
            api::DeleteImageRequest {
                name: name.into(),
                ..Default::default()
            },
            SRC,
        ))
        .await
        .unwrap();
        let after = get_image(c.socket(), K8S, &full).await;
        let repo = name.split(':').next().unwrap();
        let dref = get_image(
            c.socket(),
            K8S,
            &format!("docker.io/library/{repo}@{}", target.digest),
        )
        .await;
        let pinned =
            |i: Option<api::Image>| i.unwrap().labels.contains_key("io.cri-containerd.pinned");
        match policy {
            "unpin" => assert!(
                !pinned(after) && !pinned(dref),
                "name and digest records unpinned"
            ),
            "delete" => assert!(
                after.is_none() && dref.is_none(),
                "name and digest records deleted"
            ),
            _ => assert!(pinned(after) && pinned(dref), "kept as they were"),
        }
    }
    // A k8s.io image imgbridge did not write is never touched. Reconcile is
    // off so the source record created behind our back is not replicated.
    let p = Imgbridge::with_config(
        c.socket(),
        "[replication]\npin = true\ndelete_policy = \"delete\"\n[reconcile]\nenabled = false\n",
    );
    let direct = |ns: &str, name: &str| create_image_req(ns, name, &target);
    let mut cl = images_client(c.socket()).await;
    cl.create(direct(K8S, "docker.io/library/theirs:1"))
        .await
        .unwrap();
    cl.create(direct(SRC, "theirs:1")).await.unwrap();
    images_client(p.socket())
        .await
        .delete(with_ns(
            api::DeleteImageRequest {
                name: "theirs:1".into(),
                ..Default::default()
            },
            SRC,
        ))
        .await
        .unwrap();
    assert!(get_image(c.socket(), SRC, "theirs:1").await.is_none());
    assert!(
        get_image(c.socket(), K8S, "docker.io/library/theirs:1")
            .await
            .is_some(),
        "foreign image untouched"
    );
}

/// A tag rebuilt in place (a dev loop's `app:dev`, buildkit's
/// `Images.Update`): the digest record of the image it left is unpinned at
/// once, so kubelet's image GC may take that image; it stayed pinned until
/// the next catch-up pass before (the soak's finding, docs/reliability.md).
/// Reconcile is off: only the write itself can have done it.
#[tokio::test]
async fn a_moved_tag_unpins_the_digest_record_it_left() {
    let c = Scenario::cri().containerd();
    let (one, two) = (TestImage::hello("moved-a:1"), TestImage::hello("moved-b:1"));
    ctr_import(c.socket(), SRC, &one.docker_archive());
    ctr_import(c.socket(), SRC, &two.docker_archive());
    let old = image_target(c.socket(), SRC, &one.normalized()).await;
    let new = image_target(c.socket(), SRC, &two.normalized()).await;
    let p = Imgbridge::with_config(
        c.socket(),
        "[replication]\npin = true\n[reconcile]\nenabled = false\n",
    );
    create_image(p.socket(), SRC, "moved:dev", &old).await;
    let pinned = |i: Option<api::Image>| {
        i.expect("record")
            .labels
            .contains_key("io.cri-containerd.pinned")
    };
    let dref = |d: &Descriptor| format!("docker.io/library/moved@{}", d.digest);
    assert!(pinned(get_image(c.socket(), K8S, &dref(&old)).await));
    let mut rec = get_image(c.socket(), SRC, "moved:dev").await.unwrap();
    rec.target = Some(new.clone());
    update_image(p.socket(), SRC, rec).await;
    assert!(pinned(get_image(c.socket(), K8S, &dref(&new)).await));
    assert!(
        !pinned(get_image(c.socket(), K8S, &dref(&old)).await),
        "the digest record of the image the tag left is still pinned"
    );
    // Another tag of the repository still on the old image keeps it pinned.
    create_image(p.socket(), SRC, "moved:keep", &old).await;
    create_image(p.socket(), SRC, "moved:dev2", &old).await;
    let mut rec = get_image(c.socket(), SRC, "moved:dev2").await.unwrap();
    rec.target = Some(new.clone());
    update_image(p.socket(), SRC, rec).await;
    assert!(
        pinned(get_image(c.socket(), K8S, &dref(&old)).await),
        "moved:keep still names the old image"
    );
}

#[tokio::test]
async fn replica_survives_gc_and_pod_still_runs() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("gcsafe:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    // Remove the source too, so only the replica holds the content.
    c.ctr_ok(SRC, ["images", "rm", &img.normalized()]);
    let dummy = api::Image {
        name: "dummy:1".into(),
        target: Some(placeholder_manifest('4')),
        ..Default::default()
    };
    let mut cl = images_client(c.socket()).await;
    cl.create(with_ns(
        api::CreateImageRequest {
            image: Some(dummy),
            ..Default::default()
        },
        K8S,
    ))
    .await
    .unwrap();
    cl.delete(with_ns(
        api::DeleteImageRequest {
            name: "dummy:1".into(),
            sync: true,
            ..Default::default()
        },
        K8S,
    ))
    .await
    .unwrap();
    for d in replica_blobs(c.socket(), K8S, &img.normalized()).await {
        assert!(
            content_info(c.socket(), K8S, &d).await.is_some(),
            "{d} collected by GC"
        );
    }
    run_hello_pod(c.socket(), &img.normalized(), "gcsafe:1").await;
}

/// `k8s.io`'s image events on containerd's own socket, in order, as
/// (topic, name); `mark` writes a record straight to containerd and
/// returns once its event is in, so every event before it is too.
/// (containerd answers a Subscribe with its first event, not before.)
struct ImageEvents {
    sock: PathBuf,
    rx: tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
    seen: Vec<(String, String)>,
}

impl ImageEvents {
    async fn start(sock: &Path) -> ImageEvents {
        /// ImageCreate, ImageUpdate and ImageDelete all carry the name as field 1.
        #[derive(Clone, PartialEq, prost::Message)]
        struct Named {
            #[prost(string, tag = "1")]
            name: String,
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let channel = containerd_channel(sock).await;
        tokio::spawn(async move {
            let mut events = api::events_client::EventsClient::new(channel);
            let mut stream = events
                .subscribe(api::SubscribeRequest {
                    filters: vec![format!("namespace=={K8S},topic~=\"^/images/\"")],
                })
                .await
                .expect("subscribe to k8s.io image events")
                .into_inner();
            while let Ok(Some(e)) = stream.message().await {
                let name = e
                    .event
                    .map(|a| {
                        <Named as prost::Message>::decode(&a.value[..])
                            .unwrap()
                            .name
                    })
                    .unwrap_or_default();
                if tx.send((e.topic, name)).is_err() {
                    return;
                }
            }
        });
        let mut ev = ImageEvents {
            sock: sock.to_path_buf(),
            rx,
            seen: Vec::new(),
        };
        // The subscription is live once one of these marks comes back
        // (a poll: a mark written before it was live has no event).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ev.try_mark(Duration::from_millis(200)).await {
            assert!(
                Instant::now() < deadline,
                "no k8s.io image event within 10 s"
            );
        }
        ev.seen.clear();
        ev
    }

    /// Writes a mark and waits for its event (every event before it is
    /// then in `seen`); `false` if it did not come within `wait`.
    async fn try_mark(&mut self, wait: Duration) -> bool {
        let name = unique_name("events-mark");
        create_image(&self.sock, K8S, &name, &placeholder_manifest('7')).await;
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(e)) if e.1 == name => return true,
                Ok(Some(e)) if e.1.contains("events-mark") => {}
                Ok(Some(e)) => self.seen.push(e),
                _ => return false,
            }
        }
    }

    async fn mark(&mut self) {
        assert!(
            self.try_mark(Duration::from_secs(10)).await,
            "a mark's event did not come within 10 s; seen {:?}",
            self.seen
        );
    }
}

/// A replica is written the way CRI's own pull writes its records: marked
/// `io.cri-containerd.image=managed`, with the id record `sha256:<config>`
/// after them (after the write returns: CRI does not need it). CRI's event
/// handler then only refreshes its cache: it writes nothing back. (It used
/// to create the id record and Update every replica record to mark it, name
/// and digest ref: two more bolt transactions and events per name, one name
/// at a time, the most of a burst's time.) A rebuild under the same name
/// gets its new id record too, and the pod runs the new image.
#[tokio::test]
async fn replicas_are_written_managed_so_cri_writes_nothing_back() {
    let (c, p) = Scenario::cri().start();
    let mut events = ImageEvents::start(c.socket()).await;
    let img = TestImage::hello("premanaged:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    let id = img.config_digest();
    id_record(c.socket(), &id).await;
    events.mark().await;
    let name = img.normalized();
    let replica = get_image(c.socket(), K8S, &name).await.unwrap();
    let digest_ref = format!("docker.io/library/premanaged@{}", target_of(&replica));
    let created = |n: &str| ("/images/create".to_string(), n.to_string());
    assert_eq!(
        events.seen,
        vec![created(&name), created(&digest_ref), created(&id)],
        "k8s.io's image events: the tag, the digest ref, the id record, and nothing from CRI"
    );
    let record = get_image(c.socket(), K8S, &id).await.unwrap();
    assert_eq!(target_of(&record), target_of(&replica));
    assert_cri_managed(&[&record, &replica]);
    assert_eq!(cri_image_status(c.socket(), &name).await.unwrap().id, id);

    // A rebuild under the same name: the name moves, then the new id record.
    events.seen.clear();
    let next = TestImage::build("premanaged:1", 2, &["/bin/busybox", "echo", "rebuilt"], 0);
    ctr_import(p.socket(), SRC, &next.docker_archive());
    let new_id = next.config_digest();
    id_record(c.socket(), &new_id).await;
    events.mark().await;
    assert_ne!(new_id, id);
    let updated = ("/images/update".to_string(), name.clone());
    let at = |e: &(String, String)| events.seen.iter().position(|s| s == e);
    assert!(
        at(&updated).is_some() && at(&updated) < at(&created(&new_id)),
        "the name moves, then the new id record is written: {:?}",
        events.seen
    );
    assert_eq!(
        events
            .seen
            .iter()
            .filter(|e| e.0 == "/images/update")
            .count(),
        1,
        "one update, imgbridge's own: {:?}",
        events.seen
    );
    assert_eq!(
        cri_image_status(c.socket(), &name).await.unwrap().id,
        new_id
    );
    run_pod(c.socket(), &name, &[], "rebuilt")
        .await
        .cleanup()
        .await;
}

/// The id record `id` in `k8s.io`, polled for: it is written after the
/// write that named the image has returned.
async fn id_record(sock: &Path, id: &str) -> api::Image {
    poll_async(Duration::from_secs(10), || get_image(sock, K8S, id))
        .await
        .unwrap_or_else(|| panic!("no id record {id} in {K8S} within 10 s"))
}

/// A pod may name its image by digest (Skaffold deploys `tag@sha256:…`):
/// the `name@sha256` record must resolve in CRI when the write returns, as
/// the tag does, also in a burst (CRI handles the events of every name in
/// the order they come). 50 names of their own repositories written at
/// once; each checked once, the moment its write returns.
#[tokio::test]
async fn digest_refs_resolve_in_cri_when_the_write_returns() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("bydigest:1");
    ctr_import(c.socket(), SRC, &img.docker_archive());
    let target = image_target(c.socket(), SRC, &img.normalized()).await;
    fifty_resolve_on_return("the digest ref", &p, |i| {
        let (c, p, target) = (&c, &p, &target);
        async move {
            create_image(p.socket(), SRC, &format!("bydigest-{i}:1"), target).await;
            let by_digest = format!("docker.io/library/bydigest-{i}@{}", target.digest);
            cri_image_status(c.socket(), &by_digest).await.is_some()
        }
    })
    .await;
}

/// Runs `write` for 0..50 at once; each writes through imgbridge `p` and
/// asks CRI once, the moment its write returns (`true`: resolved). Panics
/// naming the misses, or if a write gave up waiting for CRI: fifty waiting
/// at once share CRI's answers, so none should return on the timeout.
async fn fifty_resolve_on_return<F, Fut>(what: &str, p: &Imgbridge, write: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let checks = (0..50).map(|i| {
        let resolved = write(i);
        async move { (!resolved.await).then_some(i) }
    });
    let misses: Vec<usize> = futures_util::future::join_all(checks)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(
        misses.is_empty(),
        "CRI did not resolve {what} on return for {} of 50: {misses:?}",
        misses.len()
    );
    assert!(
        !p.log().contains("did not resolve it in time"),
        "a write gave up waiting for CRI:\n{}",
        p.log_tail()
    );
}

/// `confirm_direct_writes`: a tool writing straight into `k8s.io` through
/// imgbridge gets CRI's read-your-writes too. 50 names written at once
/// (CRI handles their events one at a time, so without the wait the last
/// lag the first by tens of milliseconds), each checked once, the moment
/// its write returns. Nothing is replicated and no source image appears.
#[tokio::test]
async fn direct_writes_into_k8s_io_resolve_in_cri_when_confirmed() {
    // Long, so that a write held for CRI is told from a slow one on a
    // loaded machine: a hold lasts all of it.
    const CRI_WAIT: Duration = Duration::from_secs(60);
    let (c, p) = Scenario::cri()
        .config(&format!(
            "[replication]\nconfirm_direct_writes = true\ncri_wait = \"{}s\"\n",
            CRI_WAIT.as_secs()
        ))
        .start();
    let img = TestImage::hello("direct:1");
    ctr_import(c.socket(), K8S, &img.docker_archive());
    let target = image_target(c.socket(), K8S, &img.normalized()).await;
    fifty_resolve_on_return("a direct write", &p, |i| {
        let (c, p, target) = (&c, &p, &target);
        async move {
            // Tools writing into `k8s.io` name images in full, as CRI
            // and kubelet do.
            let name = format!("docker.io/library/direct-{i}:1");
            create_image(p.socket(), K8S, &name, target).await;
            cri_image_status(c.socket(), &name).await.is_some()
        }
    })
    .await;
    assert!(
        get_image(c.socket(), SRC, "docker.io/library/direct-0:1")
            .await
            .is_none(),
        "a direct write was copied into a source namespace"
    );
    // A record CRI never resolves under its name (kubelet would ask for
    // `docker.io/library/direct-short:1`) is not waited for: waiting would
    // hold the write for all of `cri_wait`, half of which is the deadline.
    let t = Instant::now();
    tokio::time::timeout(
        CRI_WAIT / 2,
        create_image(p.socket(), K8S, "direct-short:1", &target),
    )
    .await
    .unwrap_or_else(|_| panic!("a write of a short name was held {:?}", t.elapsed()));
}

#[tokio::test]
async fn two_hundred_back_to_back_tags_and_imports_zero_cri_misses() {
    let (c, p) = Scenario::cri().start();
    let img = TestImage::hello("burst:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    let target = image_target(c.socket(), SRC, &img.normalized()).await;
    let mut cl = images_client(p.socket()).await;
    let mut misses = Vec::new();
    for i in 0..200 {
        let name = format!("burst-tag-{i}:v{i}");
        cl.create(create_image_req(SRC, &name, &target))
            .await
            .unwrap();
        if cri_image_status(c.socket(), &format!("docker.io/library/{name}"))
            .await
            .is_none()
        {
            misses.push(name);
        }
    }
    for i in 0..10 {
        let name = format!("burst-import-{i}:1");
        let dir = tempdir("arch-");
        let f = dir.path().join("a.tar");
        img.export_docker_archive(&f, &name);
        ctr_import(p.socket(), SRC, &f);
        if cri_image_status(c.socket(), &format!("docker.io/library/{name}"))
            .await
            .is_none()
        {
            misses.push(name);
        }
    }
    assert!(
        misses.is_empty(),
        "CRI misses right after return: {misses:?}"
    );
}

#[tokio::test]
async fn concurrent_creates_and_tags_over_fifty_names_converge() {
    let (c, p) = Scenario::cri().start();
    let a = TestImage::hello("conv:a");
    let b = TestImage::hello("conv:b");
    ctr_import(c.socket(), SRC, &a.docker_archive());
    ctr_import(c.socket(), SRC, &b.docker_archive());
    let ta = image_target(c.socket(), SRC, &a.normalized()).await;
    let tb = image_target(c.socket(), SRC, &b.normalized()).await;
    let sock = Arc::new(p.socket().to_path_buf());
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (sock, t) = (
            sock.clone(),
            if i % 3 == 0 { ta.clone() } else { tb.clone() },
        );
        tasks.push(tokio::spawn(async move {
            let name = format!("conv-{}:1", i % 50);
            let mut cl = images_client(&sock).await;
            let image = api::Image {
                name: name.clone(),
                target: Some(t),
                ..Default::default()
            };
            // Create, or (as ctr/buildkit do) Update when it exists.
            match cl
                .create(create_image_req(SRC, &name, image.target.as_ref().unwrap()))
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::AlreadyExists => {
                    cl.update(with_ns(
                        api::UpdateImageRequest {
                            image: Some(image),
                            ..Default::default()
                        },
                        SRC,
                    ))
                    .await
                    .unwrap();
                }
                Err(e) => panic!("{e:?}"),
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut diverged = Vec::new();
    for i in 0..50 {
        let name = format!("conv-{i}:1");
        let src = target_of(&get_image(c.socket(), SRC, &name).await.unwrap());
        let dst = get_image(c.socket(), K8S, &format!("docker.io/library/{name}"))
            .await
            .map(|i| target_of(&i));
        if dst.as_deref() != Some(src.as_str()) {
            diverged.push((name, src, dst));
        }
    }
    assert!(
        diverged.is_empty(),
        "replicas differ from source: {diverged:?}"
    );
}

#[tokio::test]
async fn on_failure_fail_and_warn() {
    let c = Scenario::cri().containerd();
    // A manifest blob that is not JSON: upstream accepts the record, the
    // replication cannot walk it.
    let dir = tempdir("bad-");
    let f = dir.path().join("m");
    std::fs::write(&f, b"this is not a manifest").unwrap();
    let d = format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            b"this is not a manifest"
        ))
    );
    // An unreferenced blob is fair game for containerd's GC (its startup
    // GC included): root it, and ingest again if a GC won the race.
    let rooted = poll_async(Duration::from_secs(20), || async {
        if content_info(c.socket(), SRC, &d).await.is_none() {
            ctr_ingest(c.socket(), SRC, &d, &f);
        }
        // Not ctr_ok: the blob may vanish in between; the check below tells.
        let _ = Command::new("ctr")
            .arg("-a")
            .arg(c.socket())
            .args([
                "-n",
                SRC,
                "content",
                "label",
                &d,
                "containerd.io/gc.root=test",
            ])
            .output();
        content_info(c.socket(), SRC, &d).await.map(|_| ())
    })
    .await;
    assert!(rooted.is_some(), "could not keep the broken blob in {SRC}");
    let target = Descriptor {
        media_type: "application/vnd.oci.image.manifest.v1+json".into(),
        digest: d.clone(),
        size: 22,
        ..Default::default()
    };
    let p = Imgbridge::start(c.socket(), &[]);
    let e = images_client(p.socket())
        .await
        .create(create_image_req(SRC, "broken:1", &target))
        .await
        .map(|r| panic!("replication must fail: {r:?}\n{}", p.log_tail()))
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal);
    for part in ["broken:1", "k8s.io", "not a valid manifest", "kept"] {
        assert!(
            e.message().contains(part),
            "message must name {part:?}: {}",
            e.message()
        );
    }
    assert!(
        get_image(c.socket(), SRC, "broken:1").await.is_some(),
        "source image stays"
    );
    let w = Imgbridge::with_config(c.socket(), "[replication]\non_failure = \"warn\"\n");
    images_client(w.socket())
        .await
        .create(create_image_req(SRC, "broken:2", &target))
        .await
        .expect("warn replies OK");
    w.wait_for_log(
        "on_failure = warn",
        Duration::from_secs(5),
        "failure logged",
    );
}

#[test]
fn config_refuses_loops_and_empty_lists() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_imgbridge"))
            .arg("serve")
            .args([
                "--listen",
                "/tmp/imgbridge-never.sock",
                "--upstream",
                "/tmp/never-containerd.sock",
            ])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(&["--source-namespace", "k8s.io"]);
    assert!(e.contains("both a replication source and a target"), "{e}");
    let cfg = config_file("[replication]\ntarget_namespaces = []\n");
    let e = run(&["--config", cfg.to_str().unwrap()]);
    assert!(e.contains("target_namespaces is empty"), "{e}");
    assert!(!Path::new("/tmp/imgbridge-never.sock").exists());
}

/// imgbridge's leases in `ns`: (id, resources it holds).
async fn imgbridge_leases(sock: &Path, ns: &str) -> Vec<(String, usize)> {
    use api::leases_client::LeasesClient;
    let mut cl = LeasesClient::new(containerd_channel(sock).await);
    let list = cl
        .list(with_ns(api::ListRequest::default(), ns))
        .await
        .unwrap()
        .into_inner()
        .leases;
    let mut out = Vec::new();
    for l in list.into_iter().filter(|l| l.id.starts_with("imgbridge-")) {
        let held = cl
            .list_resources(with_ns(api::ListResourcesRequest { id: l.id.clone() }, ns))
            .await
            .unwrap()
            .into_inner()
            .resources
            .len();
        out.push((l.id, held));
    }
    out
}

/// Polls until imgbridge holds exactly one lease in `k8s.io`, the spare,
/// other than `not`; returns it.
async fn one_spare(sock: &Path, not: Option<&str>) -> (String, usize) {
    let found = poll_async(Duration::from_secs(10), || async {
        match &imgbridge_leases(sock, K8S).await[..] {
            [one] if Some(one.0.as_str()) != not => Some(one.clone()),
            _ => None,
        }
    })
    .await;
    found.unwrap_or_else(|| panic!("expected one spare lease besides {not:?} within 10 s"))
}

/// A replication links its first blob under a lease made before it was
/// needed (Leases.Create is an fsync'd transaction the held write would
/// otherwise wait for): after each replication exactly one lease of
/// imgbridge's is left in `k8s.io`, holding nothing, and the next
/// replication takes it (its own is released once its records are
/// written). None is left once imgbridge stops.
#[tokio::test]
async fn a_spare_lease_is_ready_holds_nothing_and_goes_at_shutdown() {
    let (c, mut p) = Scenario::cri().start();
    ctr_import(
        p.socket(),
        SRC,
        &TestImage::hello("spare:1").docker_archive(),
    );
    let (first, held) = one_spare(c.socket(), None).await;
    assert_eq!(held, 0, "the spare holds nothing");
    let next = TestImage::build("spare:2", 2, &["/bin/busybox", "echo", "two"], 0);
    ctr_import(p.socket(), SRC, &next.docker_archive());
    let (second, held) = one_spare(c.socket(), Some(&first)).await;
    assert_eq!(held, 0, "the new spare holds nothing");
    assert!(cri_image_status(c.socket(), &next.normalized())
        .await
        .is_some());
    p.sigterm();
    assert_eq!(
        imgbridge_leases(c.socket(), K8S).await,
        vec![],
        "no lease left once imgbridge stopped (the spare was {second})"
    );
}
