//! Dev-loop benchmark under a control plane (not a test; docs/performance.md,
//! "Dev loop under an API server"): from `buildctl build` returning to the
//! Deployment's new pod running the new content, as Tilt or Skaffold see
//! it, on a one-node cluster (`imgbridge_test_support::chart::OneNode`:
//! etcd, kube-apiserver, controller manager, scheduler, a registered
//! kubelet) with the chart installed by helm. Three ways to get a fresh
//! build into `k8s.io`, alternating round by round (the order rotates every
//! round):
//!
//!   A  imgbridge       buildkitd (namespace buildkit) on the chart's pod's
//!                      socket; the Deployment applied the moment buildctl
//!                      returns
//!   B  direct k8s.io   buildkitd writing straight into k8s.io on
//!                      containerd's socket (buildkit owns kubelet's
//!                      namespace); applied at once
//!   C  export|import   buildkitd (namespace buildkit) on containerd's
//!                      socket, then `ctr images export | ctr -n k8s.io
//!                      images import` (what `kind load` does); then applied
//!
//! Each variant has its own Deployment (`IfNotPresent`, host network,
//! surge rollout); a round is over when the new pod prints its content and
//! the old pod is gone (not timed). Prints p50 / p99 / max per variant and
//! a Markdown table.
//!
//! usage: cargo run --example bench_deployments [ROUNDS]   (root; default 20)
//! env:   IMGBRIDGE_CONTAINERD=2.4 (a matrix label or bin dir), and
//!        IMGBRIDGE_STATIC_BINARY as for the tests.

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

use imgbridge_test_support::chart::{install, App, ChartNode, OneNode};
use imgbridge_test_support::ctr::ctr_command;
use imgbridge_test_support::peers::Buildkitd;
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::project::project_image;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Imgbridge,
    DirectK8s,
    ExportImport,
}

impl Variant {
    const ALL: [Variant; 3] = [
        Variant::Imgbridge,
        Variant::DirectK8s,
        Variant::ExportImport,
    ];

    fn label(self) -> &'static str {
        match self {
            Variant::Imgbridge => "A imgbridge",
            Variant::DirectK8s => "B direct k8s.io",
            Variant::ExportImport => "C export|import",
        }
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let Some(cl) = OneNode::start() else { return };
    let Some(helm) = imgbridge_test_support::chart::Helm::new(&cl.cp) else {
        return;
    };
    let image = project_image("");
    ctr_import(cl.c.socket(), "k8s.io", &image.archive);
    let node = ChartNode::new();
    install(&helm, &cl, &node, &image);
    let start =
        |sock: &std::path::Path, ns: &str| Buildkitd::start(sock, ns, None).expect("buildkitd");
    let bks = [
        start(&node.socket(), "buildkit"),
        start(cl.c.socket(), "k8s.io"),
        start(cl.c.socket(), "buildkit"),
    ];
    let apps = [
        App::new("bench-a"),
        App::new("bench-b"),
        App::new("bench-c"),
    ];
    let mut took: [Vec<Duration>; 3] = Default::default();
    // One warm-up build each (busybox layer cached), not counted.
    for round in 0..=rounds {
        for i in 0..3 {
            let v = (round + i) % 3;
            let variant = Variant::ALL[v];
            let content = unique_name(&format!("bench-{v}-{round}"));
            let tag = format!("r{round}");
            let built_ref = apps[v].build(&bks[v], &tag, &content);
            let built = Instant::now();
            if variant == Variant::ExportImport {
                export_import(&cl, &format!("docker.io/library/{built_ref}"));
            }
            cl.cp
                .apply(&apps[v].manifest(&built_ref, "/v", "IfNotPresent", false));
            apps[v].wait_running(&cl.cp, &cl.k, &built_ref, &content);
            if round > 0 {
                took[v].push(built.elapsed());
            }
            // The old pod gone before the next round (not timed).
            apps[v].wait_rolled_out(&cl.cp);
        }
        eprint!(".");
    }
    eprintln!();
    println!("| variant | rounds | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    for (v, t) in took.iter_mut().enumerate() {
        t.sort();
        let q = |p: f64| t[((t.len() as f64 - 1.0) * p).round() as usize];
        println!(
            "| {} | {} | {:.0} ms | {:.0} ms | {:.0} ms |",
            Variant::ALL[v].label(),
            t.len(),
            q(0.5).as_secs_f64() * 1e3,
            q(0.99).as_secs_f64() * 1e3,
            t[t.len() - 1].as_secs_f64() * 1e3
        );
    }
    let _ = std::io::stdout().flush();
}

/// `ctr -n buildkit images export - REF | ctr -n k8s.io images import -`,
/// as `kind load` copies an image.
fn export_import(cl: &OneNode, reference: &str) {
    let mut export = ctr_command(
        cl.c.socket(),
        "buildkit",
        ["images", "export", "-", reference],
    );
    let mut exporter = export.stdout(Stdio::piped()).spawn().expect("ctr export");
    let mut import = ctr_command(cl.c.socket(), "k8s.io", ["images", "import", "-"]);
    let out = import
        .stdin(exporter.stdout.take().expect("export's stdout"))
        .output()
        .expect("ctr import");
    let exported = exporter.wait().expect("ctr export");
    assert!(
        exported.success() && out.status.success(),
        "export|import of {reference}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
