//! What happened during a soak run, on one clock: every call of the
//! workload, every fault and every sample, written as the TSV files
//! `scripts/soak.sh` plots (docs/reliability.md).

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Seconds after a fault's recovery during which a failed call or a
/// warning is still blamed on it: clients retry, builds that started
/// before the fault end, containerd's GC catches up.
pub const AFTERMATH: Duration = Duration::from_secs(30);

/// One call of the workload: a build, a push, an import or a pod.
#[derive(Clone, Debug)]
pub struct Call {
    pub start: f64,
    pub end: f64,
    pub worker: &'static str,
    pub kind: String,
    pub name: String,
    pub outcome: Outcome,
    /// Milliseconds from the write's return until CRI resolved it (0 for
    /// at once; imports are asynchronous, so theirs is a wait).
    pub cri_ms: Option<u64>,
    /// Whether the pod started from the image printed what it must.
    pub pod: Option<Result<(), String>>,
    /// When the pod's attempt ended (`end` without one): a pod runs after
    /// the write returned, so a fault after the write can still explain it.
    pub pod_end: f64,
}

/// How a write ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The client got success.
    Ok,
    /// The client got success but CRI did not know the image at once: the
    /// read-your-writes contract broken.
    Miss(String),
    /// The client got success, then CRI could not be asked (containerd
    /// restarting): neither a hit nor a miss.
    Unconfirmed(String),
    /// The client got an error.
    Failed(String),
}

impl Outcome {
    fn word(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Miss(_) => "miss",
            Outcome::Unconfirmed(_) => "unconfirmed",
            Outcome::Failed(_) => "failed",
        }
    }
}

/// One injected fault.
#[derive(Clone, Debug)]
pub struct Fault {
    pub t: f64,
    pub kind: &'static str,
    /// Seconds the fault itself lasted: a restart until the process
    /// answered, a full disk until freed.
    pub took: f64,
    /// Seconds after that until imgbridge, its registry endpoint and CRI
    /// all answered again (`None`: not within the deadline).
    pub recovered: Option<f64>,
    pub detail: String,
}

impl Fault {
    /// Failed calls that overlap this fault's window.
    pub fn failed_calls(&self, calls: &[Call]) -> usize {
        let (a, b) = self.window();
        calls
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_)) && c.start <= b && c.end >= a)
            .count()
    }

    /// The interval in which failures are this fault's doing.
    pub fn window(&self) -> (f64, f64) {
        let until = self.took + self.recovered.unwrap_or(120.0);
        (self.t - 1.0, self.t + until + AFTERMATH.as_secs_f64())
    }
}

/// One sample of imgbridge's process and containerd's state; `None` where
/// it could not be read (the process or containerd down at that moment).
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub t: f64,
    pub pid: Option<u32>,
    pub rss_kib: Option<u64>,
    pub fds: Option<u64>,
    pub threads: Option<u64>,
    /// Tokio tasks alive (`imgbridge_tasks_alive`).
    pub tasks: Option<u64>,
    pub streams: Option<u64>,
    /// Every lease but buildkitd's cache and history (`buildkit_leases`).
    pub leases: Option<u64>,
    pub buildkit_leases: Option<u64>,
    pub imgbridge_leases: Option<u64>,
    pub ingests: Option<u64>,
    pub images_src: Option<u64>,
    pub images_k8s: Option<u64>,
    /// Of them, those CRI reports pinned: kubelet's GC cannot take them.
    pub pinned_k8s: Option<u64>,
    pub pending_blobs: Option<u64>,
    pub import_pending: Option<u64>,
}

/// The run's clock and its records, shared by every thread.
pub struct Record {
    t0: Instant,
    /// Wall-clock time at `t0` (log lines carry wall-clock stamps).
    pub wall0: f64,
    pub calls: Mutex<Vec<Call>>,
    pub faults: Mutex<Vec<Fault>>,
    pub samples: Mutex<Vec<Sample>>,
}

impl Record {
    pub fn new() -> Record {
        Record {
            t0: Instant::now(),
            wall0: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs_f64(),
            calls: Mutex::default(),
            faults: Mutex::default(),
            samples: Mutex::default(),
        }
    }

    /// Seconds since the start.
    pub fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    pub fn call(&self, c: Call) {
        if !matches!(c.outcome, Outcome::Ok) || matches!(c.pod, Some(Err(_))) {
            let line = format!("{:?} pod {:?}", c.outcome, c.pod);
            eprintln!(
                "[{:7.1}] {} {} {}: {}",
                c.end,
                c.worker,
                c.kind,
                c.name,
                line.chars().take(400).collect::<String>()
            );
        }
        self.calls.lock().unwrap().push(c);
    }

    pub fn fault(&self, f: Fault) {
        eprintln!(
            "[{:7.1}] fault {} ({}) for {:.2} s: serving again {:?} s after",
            f.t, f.kind, f.detail, f.took, f.recovered
        );
        self.faults.lock().unwrap().push(f);
    }

    pub fn sample(&self, s: Sample) {
        self.samples.lock().unwrap().push(s);
    }

    /// Whether a fault's window overlaps `[start, end]`.
    pub fn explained(&self, start: f64, end: f64) -> bool {
        self.explained_by(start, end, |_| true)
    }

    /// Whether the window of a fault whose kind `can` accepts overlaps
    /// `[start, end]`.
    pub fn explained_by(&self, start: f64, end: f64, can: impl Fn(&str) -> bool) -> bool {
        self.faults.lock().unwrap().iter().any(|f| {
            let (a, b) = f.window();
            can(f.kind) && start <= b && end >= a
        })
    }

    /// Writes samples.tsv, faults.tsv and calls.tsv into `dir`.
    pub fn write_tsv(&self, dir: &Path) {
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        let mut s = String::from(
            "t_s\tpid\trss_kib\tfds\tthreads\tstreams\tleases\timgbridge_leases\tingests\timages_src\timages_k8s\tpending_blobs\timport_pending\tbuildkit_leases\ttasks\tpinned_k8s\n",
        );
        for x in self.samples.lock().unwrap().iter() {
            let _ = writeln!(
                s,
                "{:.1}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                x.t,
                opt(x.pid.map(u64::from)),
                opt(x.rss_kib),
                opt(x.fds),
                opt(x.threads),
                opt(x.streams),
                opt(x.leases),
                opt(x.imgbridge_leases),
                opt(x.ingests),
                opt(x.images_src),
                opt(x.images_k8s),
                opt(x.pending_blobs),
                opt(x.import_pending),
                opt(x.buildkit_leases),
                opt(x.tasks),
                opt(x.pinned_k8s),
            );
        }
        fs::write(dir.join("samples.tsv"), s).unwrap();

        let calls = self.calls.lock().unwrap().clone();
        let faults = self.faults.lock().unwrap().clone();
        let mut s = String::from("t_s\tkind\ttook_s\trecovered_s\tfailed_calls\tdetail\n");
        for f in &faults {
            let failed = f.failed_calls(&calls);
            let rec = f.recovered.map_or("-".into(), |r| format!("{r:.2}"));
            let _ = writeln!(
                s,
                "{:.1}\t{}\t{:.2}\t{rec}\t{failed}\t{}",
                f.t,
                f.kind,
                f.took,
                f.detail.replace(['\t', '\n'], " ")
            );
        }
        fs::write(dir.join("faults.tsv"), s).unwrap();

        let mut s = String::from(
            "t_start_s\tt_end_s\tworker\tkind\tname\toutcome\tcri_ms\tpod\texplained\n",
        );
        for c in &calls {
            let pod = match &c.pod {
                None => "-",
                Some(Ok(())) => "ok",
                Some(Err(_)) => "fail",
            };
            let bad = !matches!(c.outcome, Outcome::Ok) || matches!(c.pod, Some(Err(_)));
            let explained = match bad {
                false => "-",
                true if self.explained(c.start, c.pod_end) => "yes",
                true => "no",
            };
            let _ = writeln!(
                s,
                "{:.2}\t{:.2}\t{}\t{}\t{}\t{}\t{}\t{pod}\t{explained}",
                c.start,
                c.end,
                c.worker,
                c.kind,
                c.name,
                c.outcome.word(),
                opt(c.cri_ms),
            );
        }
        fs::write(dir.join("calls.tsv"), s).unwrap();
    }
}
