//! An hour of real work under faults (docs/reliability.md): buildkitd
//! builds, skopeo and crane pushes, archives and pull lists in a watched
//! directory, a pod from every image the moment its write returns and
//! kubelet's image GC, all at once through one imgbridge, while imgbridge
//! and containerd are killed and restarted, clients reset mid-call, writes
//! cut and the disk filled, at seeded moments. Invariants are checked on
//! what was recorded, and after the drain on what is left.
//!
//! `SOAK_MINUTES` (default 4: the CI variant), `SOAK_SEED` (default 41),
//! `SOAK_OUT` (the run's TSVs and report; default the harness's temp dir,
//! kept with `IMGBRIDGE_TEST_KEEP=1`). The hour is `scripts/soak.sh`.

mod faults;
mod record;
mod report;
mod sample;
mod workload;

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use imgbridge_test_support::bridge::Imgbridge;
use imgbridge_test_support::containerd::{Containerd, ContainerdOpts};
use imgbridge_test_support::images::TestImage;
use imgbridge_test_support::peers::{peer, Buildkitd, Crictl, Nerdctl};
use imgbridge_test_support::registry::Registry;
use imgbridge_test_support::scenario::config_file;
use imgbridge_test_support::util::{free_port, http_status, poll, tempdir, READY_TIMEOUT};
use rand::SeedableRng;

use crate::faults::{schedule, Injector};
use crate::record::Record;

/// What every thread of the run shares.
pub struct Node {
    pub rec: Record,
    /// imgbridge's socket: every client's.
    pub ib_sock: PathBuf,
    /// containerd's own socket: CRI's and the samples'.
    pub ctd_sock: PathBuf,
    /// imgbridge's registry endpoint, `127.0.0.1:PORT`.
    pub endpoint: String,
    /// imgbridge's /metrics and /status, `127.0.0.1:PORT`.
    pub metrics: String,
    /// The loopback docker-registry: bases and pull lists.
    pub registry: String,
    /// The lazy base image, in `registry`.
    pub base: String,
    /// The watched directory.
    pub watch: PathBuf,
    /// Where the run's files go.
    pub out: PathBuf,
    pub crictl: Crictl,
    pub buildkit: Buildkitd,
    pub nerdctl: Option<Nerdctl>,
    /// The running imgbridge's pid (`None` while it is down).
    pub ib_pid: Mutex<Option<u32>>,
    pub stop: AtomicBool,
    /// Images the work wrote, oldest first, for the GC worker to delete.
    pub made: Mutex<Vec<workload::Made>>,
    /// When the GC worker first saw each image of `k8s.io`, by id (as
    /// kubelet's image GC keeps it).
    pub first_seen: Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

/// imgbridge's log filter: `info`, as a node logs, and the importer's
/// steps at `debug`, so a stalled import names the step it stopped in.
pub const LOG: &str = "info,imgbridge::import=debug";

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn soak() {
    let (Some(_), Some(_), Some(_)) = (peer("buildkit"), peer("crictl"), peer("crane")) else {
        return;
    };
    let minutes: f64 = env("SOAK_MINUTES", 4.0);
    let seed: u64 = env("SOAK_SEED", 41);
    let run_s = minutes * 60.0;
    // About one fault every 18 s in a short run, every 45 s in an hour.
    let gap = if minutes <= 10.0 {
        (12.0, 24.0)
    } else {
        (30.0, 60.0)
    };
    let keep = tempdir("soak-");
    let out = std::env::var_os("SOAK_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| keep.path().join("out"));
    fs::create_dir_all(&out).unwrap();
    eprintln!(
        "soak: {minutes} min, seed {seed}, files in {}",
        out.display()
    );

    let registry = Registry::start();
    let base = TestImage::hello("soak/base:1").push(&registry.addr());
    let c = Containerd::start(ContainerdOpts {
        cri: true,
        // Room for the work the GC keeps, small enough to fill in a moment.
        root_mib: Some(3072),
        ..Default::default()
    });
    let d = keep.path();
    let (watch, run_dir) = (d.join("images"), d.join("run"));
    fs::create_dir_all(&watch).unwrap();
    fs::create_dir_all(&run_dir).unwrap();
    let (metrics, endpoint) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    // A node's settings, but short drain and upload expiry so that a run of
    // minutes sees them act (drain_timeout within the harness's 10 s stop).
    let cfg = config_file(&format!(
        r#"drain_timeout = "5s"
[replication]
pin = true
[metrics]
listen = "{metrics}"
[registry]
listen = "{endpoint}"
upload_expiry = "30s"
[import]
state_file = "{state}"
debounce = "300ms"
[[import.dirs]]
path = "{watch}"
"#,
        state = d.join("import-state.json").display(),
        watch = watch.display(),
    ));
    let args = vec!["--config".to_string(), cfg.display().to_string()];
    let ib_sock = run_dir.join("imgbridge.sock");
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = Imgbridge::start_at_logging(&ib_sock, c.socket(), &argv, crate::LOG);
    let up = poll(READY_TIMEOUT, || {
        (http_status(&endpoint, "/v2/") == Some(200)).then_some(())
    });
    assert!(up.is_some(), "endpoint not up:\n{}", p.log_tail());
    let buildkit = Buildkitd::start(&ib_sock, "buildkit", Some(&registry.addr())).unwrap();
    let nerdctl = Nerdctl::new(&ib_sock, "buildkit", Some(&buildkit));
    let node = Arc::new(Node {
        rec: Record::new(),
        ctd_sock: c.socket().to_path_buf(),
        ib_sock,
        endpoint,
        metrics,
        registry: registry.addr(),
        base,
        watch,
        out: out.clone(),
        crictl: Crictl::new(c.socket()).unwrap(),
        buildkit,
        nerdctl,
        ib_pid: Mutex::new(Some(p.pid())),
        stop: AtomicBool::new(false),
        made: Mutex::default(),
        first_seen: Mutex::default(),
    });

    let workers: Vec<(&str, thread::JoinHandle<()>)> = vec![
        ("build", {
            let n = node.clone();
            thread::spawn(move || workload::builder(n, seed + 1))
        }),
        ("push", {
            let n = node.clone();
            thread::spawn(move || workload::pusher(n, seed + 2))
        }),
        ("import", {
            let n = node.clone();
            thread::spawn(move || workload::importer(n, seed + 3))
        }),
        ("gc", {
            let n = node.clone();
            thread::spawn(move || workload::gc(n))
        }),
        ("sample", {
            let n = node.clone();
            thread::spawn(move || sample::sampler(n))
        }),
    ];

    let mut inj = Injector {
        c,
        p,
        args,
        node: node.clone(),
        rng: rand::rngs::StdRng::seed_from_u64(seed),
        logs: Vec::new(),
    };
    for (at, kind) in schedule(seed, run_s, gap) {
        let wait = at - node.rec.now();
        if wait > 0.0 {
            // The schedule: the next fault's moment, not a wait for a state.
            thread::sleep(Duration::from_secs_f64(wait));
        }
        inj.inject(kind);
    }
    let left = run_s - node.rec.now();
    if left > 0.0 {
        // The rest of the run's time under load.
        thread::sleep(Duration::from_secs_f64(left));
    }
    node.stop.store(true, Ordering::Relaxed);
    let mut panicked = Vec::new();
    for (name, w) in workers {
        if let Err(e) = w.join() {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panicked.push(format!("worker {name} panicked: {msg}"));
        }
    }

    let drained = report::drain(&node);
    inj.keep_log();
    let verdict = report::Report::new(&node, run_s, &inj.logs, drained, panicked);
    node.rec.write_tsv(&out);
    let text = verdict.text(minutes, seed, &inj.c);
    fs::write(out.join("report.txt"), &text).unwrap();
    println!("{text}");
    drop(inj);
    assert!(verdict.passed(), "soak invariants broken (report above)");
}
