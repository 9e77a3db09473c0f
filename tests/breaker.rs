//! A write of imgbridge's own during which containerd's connection broke is
//! not replayed blindly: held back, tried once more after the back-off, and
//! after a second break never sent again (ERROR, `/status`, metric).
//!
//! No containerd here dies on a request any more (imgbridge stopped sending
//! the target-less `Images.Update` that killed 1.7/2.x), so a front stands
//! in for one that does: it relays every call to the real containerd except
//! an `Images.Update` in k8s.io, on which it drops every connection, as the
//! crash did. That is the only fake here, and it injects only that fault.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use imgbridge_test_support::front;
use imgbridge_test_support::prelude::*;

const SRC: &str = "buildkit";
const UPDATE: &str = "/containerd.services.images.v1.Images/Update";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_broke_the_connection_twice_is_never_sent_again() {
    let mut c = Scenario::cri().containerd();
    let pid = c.pid();
    let dir = tempdir("crash-front-");
    let listen = dir.path().join("front.sock");
    let updates = Arc::new(AtomicUsize::new(0));
    // When each Update arrived (the back-off is measured between them).
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let mut f = front::Front::default();
    let killer = f.killer();
    {
        let (real, updates, killer) = (c.socket().to_path_buf(), updates.clone(), killer.clone());
        let arrivals = arrivals.clone();
        f.serve(&listen, move |req| {
            let (real, updates, killer) = (real.clone(), updates.clone(), killer.clone());
            let arrivals = arrivals.clone();
            async move {
                if req.uri().path() == UPDATE && front::namespace(&req) == "k8s.io" {
                    arrivals.lock().unwrap().push(Instant::now());
                    updates.fetch_add(1, Ordering::SeqCst);
                    killer.drop_connections();
                    std::future::pending::<()>().await;
                }
                front::relay(&real, req).await
            }
        });
    }
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, "[replication]\npin = true\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let p = Imgbridge::start(
        &listen,
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--metrics-listen",
            &metrics,
        ],
    );
    let img = TestImage::hello("crash-front:1");
    ctr_import(p.socket(), SRC, &img.docker_archive());
    let replica = img.normalized();
    assert!(get_image(c.socket(), "k8s.io", &replica).await.is_some());
    assert_eq!(
        updates.load(Ordering::SeqCst),
        0,
        "new replicas are created"
    );

    // The unpin of delete_policy is the Update that "crashes" containerd;
    // the caller's view of its delete does not matter here.
    let _ = ctr(p.socket(), SRC, ["images", "rm", &replica]);
    let first = poll_async(Duration::from_secs(20), || async {
        (updates.load(Ordering::SeqCst) >= 1).then(Instant::now)
    })
    .await
    .expect("the unpin reached containerd");

    // Every drop of the connections makes imgbridge reconnect and run a
    // catch-up pass, which owes the same unpin: it may be sent once more
    // after the back-off, never again after that.
    let bounce = |until: Instant, stop_at: usize| {
        let (killer, updates) = (killer.clone(), updates.clone());
        async move {
            while Instant::now() < until && updates.load(Ordering::SeqCst) < stop_at {
                killer.drop_connections();
                tokio::time::sleep(Duration::from_millis(250)).await; // bounce interval
            }
        }
    };
    bounce(first + Duration::from_secs(30), 2).await;
    assert_eq!(
        updates.load(Ordering::SeqCst),
        2,
        "sent once more after the back-off"
    );
    let gap = {
        let a = arrivals.lock().unwrap();
        a[1] - a[0]
    };
    assert!(
        gap >= Duration::from_millis(900),
        "the retry came {gap:?} after the first break: not held back"
    );
    // An absence needs a window: a dozen more reconnects and passes.
    bounce(Instant::now() + Duration::from_secs(3), 3).await;
    assert_eq!(updates.load(Ordering::SeqCst), 2, "never sent a third time");

    let status: serde_json::Value =
        serde_json::from_str(&http_get(&metrics, "/status").expect("/status")).unwrap();
    let stopped = status["stopped_calls"].as_array().expect("stopped_calls");
    assert!(
        stopped
            .iter()
            .any(|s| s["item"] == replica.as_str() && s["containerd"] != ""),
        "{status}"
    );
    let text = http_get(&metrics, "/metrics").expect("/metrics");
    assert!(
        text.contains("imgbridge_broken_calls_total{outcome=\"stopped\"} 1"),
        "{text}"
    );
    let log = p.log();
    assert!(
        log.contains("ERROR")
            && log.contains("not send it again")
            && log.contains(&{
                let (a, b, c) = flavor().semver;
                format!("{a}.{b}.{c}")
            }),
        "{log}"
    );
    c.assert_still_running(pid);
}
