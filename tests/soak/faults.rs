//! The faults of a soak run: a seeded schedule, each fault injected into
//! the real processes, and the time until the node serves again.
//!
//! Two of them need a client of our own, as no real peer does it on cue:
//! `write-cut` is a `Content.Write` cancelled mid-stream (what a build
//! killed mid-layer sends), the other five act on the real processes.

use std::fs;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_client::services::v1 as api;
use imgbridge_test_support::bridge::Imgbridge;
use imgbridge_test_support::containerd::Containerd;
use imgbridge_test_support::ctr::ctr;
use imgbridge_test_support::grpc::{try_containerd_channel, with_ns};
use imgbridge_test_support::images::TestImage;
use imgbridge_test_support::util::{block_on_thread, http_status, poll, unique_name};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_stream::wrappers::ReceiverStream;

use crate::record::Fault;
use crate::Node;

/// What can go wrong on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    ImgbridgeKill,
    ImgbridgeTerm,
    ContainerdRestart,
    ContainerdKill,
    /// A real client killed mid-call: skopeo mid-upload to the registry
    /// endpoint, or `ctr content ingest` mid-stream on the socket.
    ClientReset,
    /// A `Content.Write` cancelled (RST_STREAM) mid-stream.
    WriteCut,
    /// containerd's root filesystem full for a few seconds, then freed.
    DiskFull,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::ImgbridgeKill => "imgbridge-sigkill",
            Kind::ImgbridgeTerm => "imgbridge-sigterm",
            Kind::ContainerdRestart => "containerd-restart",
            Kind::ContainerdKill => "containerd-sigkill",
            Kind::ClientReset => "client-reset",
            Kind::WriteCut => "write-cut",
            Kind::DiskFull => "disk-full",
        }
    }
}

/// The share of the run in which imgbridge itself is killed: its process
/// then lives through the rest, whose memory, descriptors and threads
/// must stay flat (docs/reliability.md, "What is measured").
pub const PROCESS_FAULTS_UNTIL: f64 = 0.2;

/// When each fault lands, from `seed`: gaps drawn from `gap` seconds;
/// imgbridge's own faults (each at least once) in the first
/// [`PROCESS_FAULTS_UNTIL`] of the run, the others anywhere.
pub fn schedule(seed: u64, run_s: f64, gap: (f64, f64)) -> Vec<(f64, Kind)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let others = [
        Kind::ContainerdRestart,
        Kind::ContainerdKill,
        Kind::ClientReset,
        Kind::WriteCut,
        Kind::DiskFull,
    ];
    let early = run_s * PROCESS_FAULTS_UNTIL;
    let mut out = Vec::new();
    let mut t = rng.random_range(gap.0 / 2.0..gap.1 / 2.0);
    let mut process = [Kind::ImgbridgeKill, Kind::ImgbridgeTerm].into_iter();
    // The last stretch is left for the drain's own checks.
    while t < run_s - gap.0 {
        let kind = match (t < early, rng.random_bool(0.5)) {
            (true, true) => process.next(),
            _ => None,
        }
        .unwrap_or_else(|| others[rng.random_range(0..others.len())]);
        out.push((t, kind));
        t += rng.random_range(gap.0..gap.1);
    }
    // Each of imgbridge's faults at least once, early, however the dice fell.
    for (i, kind) in process.enumerate() {
        let at = early * (0.4 + 0.3 * i as f64);
        out.retain(|(t, _)| (t - at).abs() > gap.0 / 2.0);
        out.push((at, kind));
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The processes faults act on, owned here so only this thread restarts them.
pub struct Injector {
    pub c: Containerd,
    pub p: Imgbridge,
    pub args: Vec<String>,
    pub node: Arc<Node>,
    pub rng: StdRng,
    /// imgbridge logs kept so far (each process's log is copied out before
    /// its temp dir goes).
    pub logs: Vec<PathBuf>,
}

impl Injector {
    /// Injects `kind` now and records it with the time to serving again.
    pub fn inject(&mut self, kind: Kind) {
        let t = self.node.rec.now();
        let detail = match kind {
            Kind::ImgbridgeKill => {
                self.p.kill9();
                self.restart_imgbridge();
                "SIGKILL, started again on the same socket".to_string()
            }
            Kind::ImgbridgeTerm => {
                let st = self.p.sigterm();
                self.restart_imgbridge();
                format!("SIGTERM ({st}), started again on the same socket")
            }
            Kind::ContainerdRestart => {
                self.c.restart();
                "SIGTERM and start".to_string()
            }
            Kind::ContainerdKill => {
                self.c.kill9();
                self.c.restart();
                "SIGKILL and start".to_string()
            }
            Kind::ClientReset => match self.rng.random_bool(0.5) {
                true => self.kill_skopeo_mid_push(),
                false => self.kill_ctr_mid_ingest(),
            },
            Kind::WriteCut => {
                let sock = self.node.ib_sock.clone();
                block_on_thread(cut_write(sock))
            }
            Kind::DiskFull => {
                let (file, bytes) = self.c.fill_root();
                // The fault's length, not a wait for anything: the disk
                // stays full this long while the workload runs on.
                std::thread::sleep(Duration::from_secs(5));
                let _ = fs::remove_file(&file);
                format!("{} MiB filled for 5 s, then freed", bytes >> 20)
            }
        };
        let took = self.node.rec.now() - t;
        let recovered = self.wait_serving();
        self.node.rec.fault(Fault {
            t,
            kind: kind.name(),
            took,
            recovered,
            detail,
        });
    }

    /// Seconds from now until a call through imgbridge, the registry
    /// endpoint and CRI all answer (two minutes at most).
    fn wait_serving(&self) -> Option<f64> {
        let n = &self.node;
        let t = n.rec.now();
        poll(Duration::from_secs(120), || {
            let socket = ctr(&n.ib_sock, "default", ["version"]).status.success();
            let endpoint = http_status(&n.endpoint, "/v2/") == Some(200);
            let cri = socket && endpoint && n.crictl.run(["version"]).status.success();
            cri.then(|| n.rec.now() - t)
        })
    }

    fn restart_imgbridge(&mut self) {
        self.keep_log();
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let p = Imgbridge::start_at_logging(&self.node.ib_sock, self.c.socket(), &args, crate::LOG);
        *self.node.ib_pid.lock().unwrap() = Some(p.pid());
        self.p = p;
    }

    /// Copies the running imgbridge's log out of its temp dir.
    pub fn keep_log(&mut self) {
        let to = self
            .node
            .out
            .join(format!("imgbridge-{}.log", self.logs.len()));
        let _ = fs::copy(self.p.log_path(), &to);
        self.logs.push(to);
    }

    /// skopeo uploading a 64 MiB layer to the endpoint, killed once
    /// containerd shows the upload's ingest.
    fn kill_skopeo_mid_push(&mut self) -> String {
        let img = TestImage::cached("soak-big:1", 1, &["/bin/busybox", "true"], 64 << 20);
        let dest = format!(
            "docker://{}/soak/big:{}",
            self.node.endpoint,
            unique_name("r")
        );
        let mut child = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(img.oci_ref())
            .arg(&dest)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn skopeo");
        let started = Instant::now();
        let mid = poll(Duration::from_secs(30), || {
            let busy = self.c.ingests("buildkit").iter().any(|&o| o > 1 << 20);
            let done = matches!(child.try_wait(), Ok(Some(_)));
            (busy || done).then_some(busy)
        });
        let _ = child.kill();
        let _ = child.wait();
        match mid {
            Some(true) => format!(
                "skopeo killed mid-upload after {:.1} s",
                started.elapsed().as_secs_f64()
            ),
            _ => "skopeo killed (the upload had not shown yet)".to_string(),
        }
    }

    /// `ctr content ingest` through imgbridge, fed 4 MiB of a 16 MiB blob
    /// from a pipe, then killed; its ingest is aborted afterwards, as the
    /// client's next run would.
    fn kill_ctr_mid_ingest(&mut self) -> String {
        let r = unique_name("soak-reset");
        let mut cmd = imgbridge_test_support::ctr::ctr_command(
            &self.node.ib_sock,
            "buildkit",
            ["content", "ingest", "--expected-size", "16777216", &r],
        );
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ctr");
        let mut stdin = child.stdin.take().unwrap();
        let chunk = vec![0x5a_u8; 1 << 20];
        for _ in 0..4 {
            if stdin.write_all(&chunk).is_err() {
                break;
            }
        }
        let offset = poll(Duration::from_secs(10), || {
            self.c.ingests("buildkit").into_iter().find(|&o| o > 0)
        });
        let _ = child.kill();
        let _ = child.wait();
        drop(stdin);
        let aborted = abort(&self.node.ib_sock, &r);
        format!("ctr content ingest killed at {offset:?} bytes; abort: {aborted}")
    }
}

/// Aborts ingest `r` in `buildkit` through `sock`.
fn abort(sock: &std::path::Path, r: &str) -> String {
    let out = ctr(sock, "buildkit", ["content", "active"]);
    if !String::from_utf8_lossy(&out.stdout).contains(r) {
        return "nothing to abort".into();
    }
    let (sock, r) = (sock.to_path_buf(), r.to_string());
    block_on_thread(async move {
        let ch = try_containerd_channel(&sock)
            .await
            .map_err(|e| e.to_string())?;
        api::content_client::ContentClient::new(ch)
            .abort(with_ns(api::AbortRequest { r#ref: r }, "buildkit"))
            .await
            .map(|_| "aborted".to_string())
            .map_err(|e| e.to_string())
    })
    .unwrap_or_else(|e| e)
}

/// A `Content.Write` of 16 MiB through imgbridge in `buildkit`, cancelled
/// after 4 MiB were acknowledged; its ingest is then aborted.
async fn cut_write(sock: PathBuf) -> String {
    let r = unique_name("soak-cut");
    let sent = async {
        let ch = try_containerd_channel(&sock)
            .await
            .map_err(|e| e.to_string())?;
        let mut content = api::content_client::ContentClient::new(ch);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let total = 16_i64 << 20;
        tx.send(api::WriteContentRequest {
            action: api::WriteAction::Stat as i32,
            r#ref: r.clone(),
            total,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
        let mut replies = content
            .write(with_ns(ReceiverStream::new(rx), "buildkit"))
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        replies.message().await.map_err(|e| e.to_string())?;
        let chunk = vec![0xa5_u8; 1 << 20];
        for i in 0..4_i64 {
            tx.send(api::WriteContentRequest {
                action: api::WriteAction::Write as i32,
                r#ref: r.clone(),
                offset: i << 20,
                data: chunk.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
            replies.message().await.map_err(|e| e.to_string())?;
        }
        // Dropping the call mid-stream: tonic resets the stream (CANCEL).
        drop(replies);
        drop(tx);
        Ok::<_, String>(())
    }
    .await;
    let aborted = abort(&sock, &r);
    match sent {
        Ok(()) => format!("Content.Write cancelled after 4 of 16 MiB; abort: {aborted}"),
        Err(e) => format!("Content.Write failed before the cut ({e}); abort: {aborted}"),
    }
}
