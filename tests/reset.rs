//! A hooked call its client resets (RST_STREAM) after the request reached
//! containerd: containerd may carry it out anyway, and then the replica must
//! follow at once, not after a catch-up. A hooked Rapid Reset.

use std::time::{Duration, Instant};

use containerd_client::services::v1 as api;
use imgbridge_test_support::prelude::*;

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";

async fn names(sock: &std::path::Path, ns: &str, prefix: &str) -> Vec<String> {
    let mut images = images_client(sock).await;
    let list = images
        .list(with_ns(api::ListImagesRequest::default(), ns))
        .await
        .expect("Images.List")
        .into_inner();
    let mut v: Vec<String> = (list.images.into_iter())
        .map(|i| i.name)
        .filter(|n| n.starts_with(prefix))
        .collect();
    v.sort();
    v
}

/// Every reset Create containerd carried out is replicated by the call's
/// own follow-up: reconcile is off and no background retry runs, so no
/// catch-up can be what replicates it. How soon is printed, not asserted:
/// it is the work of up to 200 replications on a shared machine.
#[tokio::test]
async fn creates_reset_after_sending_still_replicate_without_a_catch_up() {
    // Reconcile off: the events backstop must not be what catches them.
    let (c, p) = Scenario::cri()
        .config("[reconcile]\nenabled = false\n")
        .start();
    let img = TestImage::hello("reset-base:1");
    ctr_import(c.socket(), SRC, &img.docker_archive());
    let target = image_target(c.socket(), SRC, &img.normalized()).await;
    // How many reset calls containerd still carries out depends on timing:
    // bursts until some were (usually the first).
    let mut created = Vec::new();
    let mut prefix = String::new();
    let mut reset_at = Instant::now();
    for burst in 0..30 {
        prefix = format!("docker.io/library/rst{burst}-");
        let mut calls = Vec::new();
        for i in 0..200u64 {
            let sock = p.socket().to_path_buf();
            let (target, prefix) = (target.clone(), prefix.clone());
            calls.push(tokio::spawn(async move {
                let mut images = images_client(&sock).await;
                let req = create_image_req(SRC, &format!("{prefix}{i}:x"), &target);
                // Dropped after 0.5-10 ms: the client resets the stream,
                // some before containerd answered, some after.
                let after = Duration::from_micros(500 + (i % 40) * 250);
                let _ = tokio::time::timeout(after, images.create(req)).await;
            }));
        }
        for c in calls {
            c.await.unwrap();
        }
        reset_at = Instant::now();
        // What containerd carried out settles within a moment: poll until
        // two looks 100 ms apart agree.
        created = names(c.socket(), SRC, &prefix).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await; // poll interval
            let now = names(c.socket(), SRC, &prefix).await;
            if now == created || Instant::now() > deadline {
                break;
            }
            created = now;
        }
        if !created.is_empty() {
            break;
        }
    }
    if created.is_empty() {
        // Timing decides; on this run containerd cancelled every one.
        eprintln!("inconclusive: containerd carried out none of 6000 reset Creates");
        return;
    }
    let prefix = prefix.as_str();
    let (created, sock) = (&created, c.socket());
    let replicated = poll_async(Duration::from_secs(30), || async move {
        let there = names(sock, K8S, prefix).await;
        created.iter().all(|n| there.contains(n)).then_some(())
    })
    .await;
    let took = reset_at.elapsed();
    let there = names(c.socket(), K8S, prefix).await;
    let missing: Vec<_> = created.iter().filter(|n| !there.contains(n)).collect();
    let log = p.log();
    let about: Vec<&str> = (log.lines())
        .filter(|l| {
            missing
                .iter()
                .any(|m| l.contains(m.trim_start_matches("docker.io/library/")))
        })
        .collect();
    assert!(
        replicated.is_some(),
        "{} of {} reset Creates containerd carried out are not in {K8S} after {took:?}: {missing:?}\n{}",
        missing.len(),
        created.len(),
        about.join("\n")
    );
    let retried: Vec<&str> = (log.lines())
        .filter(|l| l.contains("retrying in the background") || l.contains("background retry"))
        .collect();
    assert!(
        retried.is_empty(),
        "a background retry, not the calls, replicated:\n{}",
        retried.join("\n")
    );
    eprintln!(
        "{} of 200 reset Creates carried out; all in {K8S} {took:?} after the resets",
        created.len()
    );
}
