//! The run's verdict: every invariant of docs/reliability.md as a number,
//! computed from what was recorded and from what is left after the drain.

use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use imgbridge_test_support::containerd::Containerd;
use imgbridge_test_support::ctr::ctr;
use imgbridge_test_support::flavor::flavor;
use imgbridge_test_support::util::poll;

use crate::faults::{Kind, PROCESS_FAULTS_UNTIL};
use crate::record::{Outcome, Sample};
use crate::sample;
use crate::workload::collect_unpinned;
use crate::Node;

/// What is left once the work stopped.
pub struct Drained {
    /// Seconds until imgbridge held no lease, containerd no ingest and
    /// `/status` no pending work (`None`: not within the deadline).
    pub secs: Option<f64>,
    /// imgbridge's leases and ingests at the end of the drain.
    pub held: Holdings,
    pub last: Sample,
    /// `ctr images check` of `k8s.io`: images, and those not complete.
    pub check: (usize, Vec<String>),
    /// Failed writes whose name `k8s.io` holds while the source does not.
    pub orphans: Vec<String>,
    /// Images of builds and pushes CRI reports pinned in `k8s.io` although
    /// no source record names them: kubelet's GC can never take them.
    pub pinned_orphans: Vec<String>,
    /// What is left, by kind: leases by namespace and id shape, ingests,
    /// the images of `k8s.io`.
    pub leftovers: String,
    /// Leases left by neither imgbridge nor buildkitd (whose namespace is
    /// its own): namespace, id, and when made (seconds into the run).
    pub others: Vec<(String, String, f64)>,
}

/// What imgbridge holds in containerd: its leases that hold something,
/// its empty ones, its ingests (refs `imgbridge-…`).
#[derive(Clone, Debug, Default)]
pub struct Holdings {
    pub holding: usize,
    pub empty: usize,
    pub ingests: usize,
    /// Each of its leases: namespace, id, seconds into the run it was
    /// made, its expiry and owner, what it holds; printed when the drain
    /// fails so that the reader can name the one too many.
    pub leases: Vec<String>,
}

/// One lease as containerd lists it, for the drain's judgements.
struct LeaseRow {
    ns: String,
    id: String,
    labels: std::collections::HashMap<String, String>,
    /// Seconds into the run it was made.
    made: f64,
    /// What it holds (`type id`): listed for imgbridge's leases and those
    /// of `k8s.io` only (buildkitd keeps thousands).
    resources: Vec<String>,
}

impl LeaseRow {
    fn imgbridge(&self) -> bool {
        self.labels.contains_key("io.imgbridge.owner")
    }
}

/// Every lease of every namespace, and the count of imgbridge's ingests
/// (refs `imgbridge-…`); `None` if containerd did not answer.
fn leases_now(node: &Node) -> Option<(Vec<LeaseRow>, usize)> {
    use containerd_client::services::v1::{
        content_client::ContentClient, leases_client::LeasesClient,
        namespaces_client::NamespacesClient, ListNamespacesRequest, ListRequest,
        ListResourcesRequest, ListStatusesRequest,
    };
    use imgbridge_test_support::grpc::with_ns;
    let (sock, wall0) = (node.ctd_sock.clone(), node.rec.wall0);
    imgbridge_test_support::util::block_on_thread(async move {
        let ch = imgbridge_test_support::grpc::try_containerd_channel(&sock)
            .await
            .ok()?;
        let (mut rows, mut ingests) = (Vec::new(), 0);
        let nss = NamespacesClient::new(ch.clone())
            .list(ListNamespacesRequest::default())
            .await
            .ok()?
            .into_inner()
            .namespaces;
        for ns in nss.into_iter().map(|n| n.name) {
            let mut leases = LeasesClient::new(ch.clone());
            let list = leases
                .list(with_ns(ListRequest::default(), &ns))
                .await
                .ok()?
                .into_inner()
                .leases;
            for l in list {
                let mut row = LeaseRow {
                    ns: ns.clone(),
                    made: l.created_at.map_or(f64::NAN, |t| {
                        t.seconds as f64 + f64::from(t.nanos) / 1e9 - wall0
                    }),
                    id: l.id,
                    labels: l.labels,
                    resources: Vec::new(),
                };
                if row.imgbridge() || ns == "k8s.io" {
                    row.resources = leases
                        .list_resources(with_ns(ListResourcesRequest { id: row.id.clone() }, &ns))
                        .await
                        .ok()?
                        .into_inner()
                        .resources
                        .iter()
                        .map(|r| format!("{} {}", r.r#type, r.id))
                        .collect();
                }
                rows.push(row);
            }
            ingests += ContentClient::new(ch.clone())
                .list_statuses(with_ns(ListStatusesRequest::default(), &ns))
                .await
                .ok()?
                .into_inner()
                .statuses
                .iter()
                .filter(|s| s.r#ref.starts_with("imgbridge-"))
                .count();
        }
        Some((rows, ingests))
    })
}

/// What imgbridge holds in containerd now ([`Holdings`]).
fn holdings(node: &Node) -> Option<Holdings> {
    let (rows, ingests) = leases_now(node)?;
    let mut h = Holdings {
        ingests,
        ..Holdings::default()
    };
    for l in rows.iter().filter(|l| l.imgbridge()) {
        match l.resources.is_empty() {
            true => h.empty += 1,
            false => h.holding += 1,
        }
        let label = |k: &str| l.labels.get(k).map_or("-", String::as_str);
        h.leases.push(format!(
            "{} {} made at {:.1} s, expires {}, owner {}, holds {:?}",
            l.ns,
            l.id,
            l.made,
            label("containerd.io/gc.expire"),
            label("io.imgbridge.owner"),
            l.resources,
        ));
    }
    Some(h)
}

/// Leases outside buildkitd's namespace that carry no imgbridge owner:
/// `(namespace, id, made at, seconds into the run)`.
fn other_leases(node: &Node) -> Vec<(String, String, f64)> {
    leases_now(node)
        .map(|(rows, _)| rows)
        .unwrap_or_default()
        .into_iter()
        .filter(|l| !l.ns.starts_with("buildkit") && !l.imgbridge())
        .map(|l| (l.ns, l.id, l.made))
        .collect()
}

/// The leases of `k8s.io`: labels and what each holds.
fn lease_details(node: &Node) -> String {
    let mut s = String::new();
    for l in leases_now(node)
        .map(|(rows, _)| rows)
        .unwrap_or_default()
        .into_iter()
        .filter(|l| l.ns == "k8s.io")
    {
        let _ = writeln!(
            s,
            "    k8s.io lease {} labels {:?} made at {:.1} s resources {:?}",
            l.id,
            l.labels,
            l.made,
            l.resources.iter().take(5).collect::<Vec<_>>()
        );
    }
    s
}

/// A lease id with its random parts (hex or digits, 6 or more) as `N`:
/// ids grouped by who makes them.
fn shape(id: &str) -> String {
    let mut out = String::new();
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        let random = token.len() >= 6 && token.chars().all(|c| c.is_ascii_hexdigit());
        out.push_str(if random { "N" } else { token });
        token.clear();
    };
    for ch in id.chars() {
        if ch.is_ascii_alphanumeric() {
            token.push(ch);
        } else {
            flush(&mut token, &mut out);
            out.push(ch);
        }
    }
    flush(&mut token, &mut out);
    out
}

/// Build and push images (not imports: their files pin them) CRI reports
/// pinned with no tag the source still holds.
fn pinned_orphans(node: &Node, src: &[String]) -> Vec<String> {
    let out = node.crictl.run(["images", "-o", "json"]);
    let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
        return vec!["crictl images failed".into()];
    };
    let mut orphans = Vec::new();
    for img in list["images"].as_array().into_iter().flatten() {
        let names: Vec<&str> = ["repoTags", "repoDigests"]
            .iter()
            .flat_map(|k| img[*k].as_array().into_iter().flatten())
            .filter_map(|t| t.as_str())
            .collect();
        let ours = names
            .iter()
            .any(|t| (t.contains("soak-") || t.contains("/soak/")) && !t.contains("import"));
        let tagged_in_source = img["repoTags"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str())
            .any(|t| src.iter().any(|x| x == t));
        if ours && img["pinned"] == true && !tagged_in_source {
            orphans.push(names.join(","));
        }
    }
    orphans
}

fn leftovers(node: &Node) -> String {
    use std::collections::BTreeMap;
    let sock = node.ctd_sock.clone();
    let li = imgbridge_test_support::util::block_on_thread(async move {
        imgbridge_test_support::grpc::try_leases_and_ingests(&sock).await
    });
    let mut s = String::new();
    if let Ok((leases, ingests)) = li {
        let mut by: BTreeMap<String, usize> = BTreeMap::new();
        for (ns, id, owner) in &leases {
            let who = if owner.is_some() {
                "imgbridge"
            } else {
                "other"
            };
            *by.entry(format!("{ns} {who} {}", shape(id))).or_default() += 1;
        }
        for (k, n) in by {
            // buildkitd's own cache and history, each a lease per record.
            if !k.starts_with("buildkit") || k.contains(" imgbridge ") {
                let _ = writeln!(s, "  lease {k}: {n}");
            }
        }
        let buildkit = leases
            .iter()
            .filter(|l| l.0.starts_with("buildkit"))
            .count();
        let _ = writeln!(s, "  leases of buildkitd's cache and history: {buildkit}");
        s += &lease_details(node);
        for (ns, r) in ingests {
            let _ = writeln!(s, "  ingest {ns} {r}");
        }
    }
    let out = node.crictl.run(["images", "-o", "json"]);
    if let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
        let all: Vec<String> = list["images"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| {
                format!(
                    "{}{}",
                    i["repoTags"],
                    if i["pinned"] == true { " (pinned)" } else { "" }
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "  k8s.io images: {} {:?}",
            all.len(),
            &all[..all.len().min(20)]
        );
        let recs = ctr(&node.ctd_sock, "k8s.io", ["images", "ls"]);
        for l in String::from_utf8_lossy(&recs.stdout).lines() {
            if l.contains("pinned=pinned") && l.contains("soak") {
                let _ = writeln!(
                    s,
                    "    pinned record: {}",
                    l.split_whitespace().next().unwrap_or_default()
                );
            }
        }
    }
    s
}

/// Stops the work's leftovers as a user would (the images it made deleted at
/// their source, one GC pass) and waits for imgbridge to let go.
pub fn drain(node: &Node) -> Drained {
    let made: Vec<_> = node.made.lock().unwrap().drain(..).collect();
    for c in made {
        if let Some(ns) = c.source_ns {
            let _ = ctr(&node.ib_sock, ns, ["images", "rm", &c.name]);
        }
    }
    collect_unpinned(node, true);
    let t = node.rec.now();
    let mut last = Sample::default();
    // Two upload expiries (30 s) and a sweep: an upload a killed client
    // left behind holds its lease until then, by design.
    let mut held = Holdings::default();
    let secs = poll(Duration::from_secs(150), || {
        last = sample::take(node);
        held = holdings(node)?;
        let zero = |v: Option<u64>| v == Some(0);
        // The spare: one empty lease per target, by design (docs/design.md,
        // "Leases").
        (held.holding == 0
            && held.empty <= 1
            && held.ingests == 0
            && zero(last.pending_blobs)
            && zero(last.import_pending))
        .then(|| node.rec.now() - t)
    });
    let names = |ns: &str| -> Vec<String> {
        let out = ctr(&node.ctd_sock, ns, ["images", "ls", "-q"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    };
    let check = ctr(&node.ctd_sock, "k8s.io", ["images", "check"]);
    let check = String::from_utf8_lossy(&check.stdout).into_owned();
    let rows: Vec<&str> = check.lines().skip(1).collect();
    let incomplete = rows
        .iter()
        .filter(|l| l.contains("incomplete") || l.contains("missing"))
        .map(|l| l.to_string())
        .collect();
    let (src, k8s) = (names("buildkit"), names("k8s.io"));
    let orphans = node
        .rec
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Failed(_)) && c.kind != "rebuild")
        .filter(|c| matches!(c.worker, "build" | "push"))
        .filter(|c| k8s.contains(&c.name) && !src.contains(&c.name))
        .map(|c| c.name.clone())
        .collect();
    Drained {
        secs,
        held,
        last,
        check: (rows.len(), incomplete),
        orphans,
        pinned_orphans: pinned_orphans(node, &src),
        leftovers: leftovers(node),
        others: other_leases(node),
    }
}

/// One invariant: its name, the figures, whether it held.
struct Line {
    what: String,
    value: String,
    held: bool,
}

pub struct Report {
    lines: Vec<Line>,
    faults: String,
}

/// Whether a fault of `kind` can cost an import: one that takes imgbridge,
/// containerd or containerd's disk away. A client's reset or cut write
/// touches nothing the importer uses.
fn can_cost_import(kind: &str) -> bool {
    kind != Kind::ClientReset.name() && kind != Kind::WriteCut.name()
}

/// The longest the importer may go without an import resolving while
/// files keep landing: three files in a row missed (each given 60 s), a
/// containerd or imgbridge restart and the importer's first retries fit
/// in it; an importer that stopped does not.
const MAX_IMPORT_STALL: Duration = Duration::from_secs(180);

/// The longest stretch of the work in which no import resolved, as (its
/// start, its length) in seconds: from the first file landing, through
/// each import CRI resolved, to the last call's end.
fn longest_stall(writes: &[&crate::record::Call]) -> (f64, f64) {
    let imports: Vec<_> = writes.iter().filter(|c| c.worker == "import").collect();
    let Some(first) = imports.iter().map(|c| c.start).reduce(f64::min) else {
        return (0.0, 0.0);
    };
    let end = imports.iter().map(|c| c.end).fold(first, f64::max);
    let mut resolved: Vec<f64> = imports
        .iter()
        .filter(|c| c.outcome == Outcome::Ok)
        .filter_map(|c| c.cri_ms.map(|ms| c.start + ms as f64 / 1000.0))
        .collect();
    resolved.sort_by(f64::total_cmp);
    resolved.push(end);
    let mut last = first;
    let mut worst = (first, 0.0);
    for t in resolved {
        if t - last > worst.1 {
            worst = (last, t - last);
        }
        last = last.max(t);
    }
    worst
}

/// A least-squares line through `pts`: the rise it makes over their span
/// and the residuals' standard deviation (the noise it is judged against).
fn fit(pts: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    if pts.len() < 10 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = sxy / sxx;
    let sd = (pts
        .iter()
        .map(|p| (p.1 - (my + slope * (p.0 - mx))).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let span = pts.last()?.0 - pts[0].0;
    Some((slope, slope * span, sd))
}

impl Report {
    pub fn new(
        node: &Node,
        run_s: f64,
        logs: &[PathBuf],
        drained: Drained,
        panicked: Vec<String>,
    ) -> Report {
        let rec = &node.rec;
        let calls = rec.calls.lock().unwrap().clone();
        let faults = rec.faults.lock().unwrap().clone();
        let samples = rec.samples.lock().unwrap().clone();
        let mut lines = Vec::new();
        let mut add = |what: &str, value: String, held: bool| {
            lines.push(Line {
                what: what.into(),
                value,
                held,
            })
        };
        add(
            "workers ran to the end",
            panicked.join("; ").chars().take(400).collect(),
            panicked.is_empty(),
        );

        // Read-your-writes.
        let bad = |c: &&crate::record::Call| !rec.explained(c.start, c.end);
        let writes: Vec<_> = calls
            .iter()
            .filter(|c| matches!(c.worker, "build" | "push" | "import"))
            .filter(|c| c.kind != "nerdctl-tag-rmi")
            .collect();
        let count = |w: &str, f: &dyn Fn(&Outcome) -> bool| {
            writes
                .iter()
                .filter(|c| c.worker == w && f(&c.outcome))
                .count()
        };
        for w in ["build", "push", "import"] {
            let ok = count(w, &|o| matches!(o, Outcome::Ok));
            let miss = count(w, &|o| matches!(o, Outcome::Miss(_)));
            let failed = count(w, &|o| matches!(o, Outcome::Failed(_)));
            let unconfirmed = count(w, &|o| matches!(o, Outcome::Unconfirmed(_)));
            let what = match w {
                "import" => "imports: resolved by CRI once the file landed (60 s)".to_string(),
                "push" => "pushes returned OK and resolved by CRI at once".to_string(),
                _ => "builds returned OK and resolved by CRI at once".to_string(),
            };
            // An import is asynchronous: a fault that takes imgbridge,
            // containerd or its disk away may hold it up (a client's reset
            // or cut write cannot); a build or push that returned OK has
            // no excuse.
            let unexplained_miss = writes
                .iter()
                .filter(|c| c.worker == w && matches!(c.outcome, Outcome::Miss(_)))
                .filter(|c| w != "import" || !rec.explained_by(c.start, c.end, can_cost_import))
                .count();
            add(
                &what,
                format!("{ok} ok, {miss} missed ({unexplained_miss} outside a fault), {unconfirmed} CRI unreachable at that moment, {failed} failed"),
                unexplained_miss == 0,
            );
        }
        // Each miss may have its fault, yet an importer that stopped for
        // good must still fail the run (run 5's did, at t = 908 s).
        let stall = longest_stall(&writes);
        add(
            "the importer kept importing",
            format!(
                "longest stretch without an import resolved: {:.0} s (from t = {:.0} s; at most {:.0} s)",
                stall.1, stall.0, MAX_IMPORT_STALL.as_secs_f64()
            ),
            stall.1 <= MAX_IMPORT_STALL.as_secs_f64(),
        );
        if let Some(ms) = {
            let mut v: Vec<u64> = writes
                .iter()
                .filter(|c| c.worker == "import")
                .filter_map(|c| c.cri_ms)
                .collect();
            v.sort();
            (!v.is_empty()).then(|| (v[v.len() / 2], v[v.len() - 1]))
        } {
            add(
                "import: file landed -> CRI resolves",
                format!("p50 {} ms, max {} ms", ms.0, ms.1),
                true,
            );
        }
        let pods: Vec<_> = calls.iter().filter(|c| c.pod.is_some()).collect();
        let pod_fail: Vec<_> = pods
            .iter()
            .filter(|c| matches!(c.pod, Some(Err(_))))
            .collect();
        let pod_unexplained = pod_fail
            .iter()
            .filter(|c| !rec.explained(c.start, c.pod_end))
            .count();
        add(
            "pods started from each image the moment it was there",
            format!(
                "{} ran, {} failed ({pod_unexplained} outside a fault)",
                pods.len() - pod_fail.len(),
                pod_fail.len()
            ),
            pod_unexplained == 0,
        );
        let failed: Vec<_> = calls
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_) | Outcome::Unconfirmed(_)))
            .collect();
        let failed_unexplained: Vec<_> = failed.iter().filter(|c| bad(c)).collect();
        add(
            "calls failed outside a fault's window",
            format!(
                "{} of {} failed calls{}",
                failed_unexplained.len(),
                failed.len(),
                failed_unexplained
                    .first()
                    .map(|c| format!("; first: {} {} {:?}", c.worker, c.name, c.outcome))
                    .unwrap_or_default()
            ),
            failed_unexplained.is_empty(),
        );
        add(
            "failed writes left no half image in k8s.io",
            format!(
                "{} images checked, {} incomplete, {} orphaned names{}",
                drained.check.0,
                drained.check.1.len(),
                drained.orphans.len(),
                drained
                    .check
                    .1
                    .first()
                    .or(drained.orphans.first())
                    .map(|x| format!("; first: {x}"))
                    .unwrap_or_default()
            ),
            drained.check.1.is_empty() && drained.orphans.is_empty() && drained.check.0 > 0,
        );

        add(
            "replicas whose source is gone are unpinned (kubelet's GC can take them)",
            format!(
                "{} pinned with no source{}",
                drained.pinned_orphans.len(),
                drained
                    .pinned_orphans
                    .first()
                    .map(|x| format!("; first: {}", x.chars().take(200).collect::<String>()))
                    .unwrap_or_default()
            ),
            drained.pinned_orphans.is_empty(),
        );

        // Flat over the last 80 %: one imgbridge process (its faults all
        // land before), under every other fault.
        let from = run_s * PROCESS_FAULTS_UNTIL;
        let last_pid = samples.iter().rev().find_map(|s| s.pid);
        let window: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.t >= from && s.t <= run_s)
            .collect();
        let series = |f: &dyn Fn(&Sample) -> Option<u64>, same_pid: bool| -> Vec<(f64, f64)> {
            window
                .iter()
                .filter(|s| !same_pid || s.pid == last_pid)
                .filter_map(|s| f(s).map(|v| (s.t, v as f64)))
                .collect()
        };
        let mut flat = |what: &str, unit: &str, scale: f64, pts: Vec<(f64, f64)>, floor: f64| {
            let peak = pts.iter().map(|p| p.1).fold(0.0, f64::max) / scale;
            match fit(&pts) {
                Some((slope, rise, sd)) => {
                    let allowed = (3.0 * sd).max(floor);
                    add(
                        what,
                        format!(
                            "rise {:+.1} {unit} over the window ({:+.1} {unit}/h), noise sd {:.1}, allowed {:.1}; peak {:.1} {unit}",
                            rise / scale,
                            slope * 3600.0 / scale,
                            sd / scale,
                            allowed / scale,
                            peak
                        ),
                        rise <= allowed,
                    )
                }
                None => add(what, "too few samples".into(), false),
            }
        };
        flat(
            "imgbridge RSS flat",
            "MiB",
            1024.0,
            series(&|s| s.rss_kib, true),
            8.0 * 1024.0,
        );
        flat(
            "imgbridge open descriptors flat",
            "fds",
            1.0,
            series(&|s| s.fds, true),
            8.0,
        );
        flat(
            "imgbridge threads flat",
            "threads",
            1.0,
            series(&|s| s.threads, true),
            4.0,
        );
        flat(
            "imgbridge tokio tasks flat",
            "tasks",
            1.0,
            series(&|s| s.tasks, true),
            8.0,
        );
        flat(
            "leases held by imgbridge flat",
            "leases",
            1.0,
            series(&|s| s.imgbridge_leases, false),
            2.0,
        );
        flat(
            "containerd active ingests flat",
            "ingests",
            1.0,
            series(&|s| s.ingests, false),
            2.0,
        );
        // Pinned ones only: an unpinned image waits for kubelet's GC (here
        // the gc worker, a pass every few seconds that a loaded node slows),
        // and all of them are gone after the drain's pass.
        flat(
            "k8s.io images CRI reports pinned flat",
            "images",
            1.0,
            series(&|s| s.pinned_k8s, false),
            6.0,
        );
        let peak_pending = samples
            .iter()
            .filter_map(|s| s.pending_blobs)
            .max()
            .unwrap_or(0);
        let d = &drained.last;
        add(
            "after the drain: imgbridge's leases, ingests, pending work",
            format!(
                "{} in {}; imgbridge's leases holding something {}, empty (the spare) {}, its ingests {}; leases by imgbridge {:?}, all ingests {:?}, pending blobs {:?} (peak during the run {peak_pending}), pending files {:?}, streams in flight {:?}, all leases {:?}",
                if drained.secs.is_some() { "drained" } else { "NOT drained" },
                drained.secs.map_or("150 s".into(), |s| format!("{s:.1} s")),
                drained.held.holding,
                drained.held.empty,
                drained.held.ingests,
                d.imgbridge_leases,
                d.ingests,
                d.pending_blobs,
                d.import_pending,
                d.streams,
                d.leases,
            ) + &match drained.secs {
                Some(_) => String::new(),
                None => format!("; imgbridge's leases at the deadline: {}", drained.held.leases.join("; ")),
            },
            drained.secs.is_some(),
        );

        // Leases neither imgbridge's nor buildkitd's: containerd's CRI
        // makes one per RunPodSandbox (id: the sandbox's) and deletes it
        // when the sandbox fails or goes; a containerd stopped in between
        // leaves it for good (internal/cri/server/sandbox_run.go). Those
        // are containerd's; any other is not explained.
        let stopped = |t: f64| {
            faults.iter().any(|f| {
                matches!(f.kind, "containerd-restart" | "containerd-sigkill")
                    && t >= f.t - 1.0
                    && t <= f.t + f.took + 2.0
            })
        };
        let unexplained: Vec<_> = drained
            .others
            .iter()
            .filter(|(_, _, t)| !stopped(*t))
            .collect();
        add(
            "leases left by neither imgbridge nor buildkitd were made as containerd was stopped",
            format!(
                "{} left, {} made within 2 s of a containerd stop (CRI's sandbox leases: containerd's own){}",
                drained.others.len(),
                drained.others.len() - unexplained.len(),
                unexplained
                    .iter()
                    .map(|(ns, id, t)| format!("; {ns} {id} made at {t:.1} s"))
                    .collect::<String>()
            ),
            unexplained.is_empty(),
        );

        // Warnings and errors, each within some fault's window; a panic
        // (printed by Rust's hook, not a log line) whenever it came.
        let (mut warns, mut unexplained, mut panics) = (0, Vec::new(), Vec::new());
        for log in logs {
            let text = fs::read_to_string(log).unwrap_or_default();
            for line in text.lines() {
                let clean = strip_ansi(line);
                if clean.contains("panicked at") {
                    panics.push(clean.chars().take(300).collect::<String>());
                }
                let mut words = clean.split_whitespace();
                let (Some(stamp), Some(level)) = (words.next(), words.next()) else {
                    continue;
                };
                if level != "WARN" && level != "ERROR" {
                    continue;
                }
                warns += 1;
                let at = epoch(stamp).map(|e| e - rec.wall0);
                if at.is_none_or(|t| !rec.explained(t, t)) {
                    unexplained.push(clean.chars().take(300).collect::<String>());
                }
            }
        }
        add(
            "imgbridge WARN/ERROR lines outside a fault's window",
            format!(
                "{} of {warns}{}",
                unexplained.len(),
                unexplained
                    .first()
                    .map(|l| format!("; first: {l}"))
                    .unwrap_or_default()
            ),
            unexplained.is_empty(),
        );
        add(
            "imgbridge panics",
            format!(
                "{}{}",
                panics.len(),
                panics
                    .first()
                    .map(|l| format!("; first: {l}"))
                    .unwrap_or_default()
            ),
            panics.is_empty(),
        );
        let not_recovered = faults.iter().filter(|f| f.recovered.is_none()).count();
        add(
            "serving again after every fault (2 min at most)",
            format!("{} faults, {not_recovered} not recovered", faults.len()),
            not_recovered == 0 && !faults.is_empty(),
        );
        let mut fl = String::new();
        let mut kinds: Vec<&str> = faults.iter().map(|f| f.kind).collect();
        kinds.sort();
        kinds.dedup();
        for k in kinds {
            let of_kind: Vec<&crate::record::Fault> =
                faults.iter().filter(|f| f.kind == k).collect();
            let sorted = |f: &dyn Fn(&crate::record::Fault) -> Option<f64>| {
                let mut v: Vec<f64> = of_kind.iter().filter_map(|x| f(x)).collect();
                v.sort_by(f64::total_cmp);
                v
            };
            let (r, took) = (sorted(&|f| f.recovered), sorted(&|f| Some(f.took)));
            let failed: usize = of_kind.iter().map(|f| f.failed_calls(&calls)).sum();
            let n = of_kind.len();
            let _ = writeln!(
                fl,
                "  {k:<20} {n:>3}×  lasted p50 {:>6.2} s; then serving again p50 {:>6.2} s, max {:>6.2} s; {failed} calls failed in their windows",
                took[took.len() / 2],
                r.get(r.len() / 2).copied().unwrap_or(f64::NAN),
                r.last().copied().unwrap_or(f64::NAN),
            );
        }
        Report {
            lines,
            faults: fl + "left after the drain:\n" + &drained.leftovers,
        }
    }

    pub fn passed(&self) -> bool {
        self.lines.iter().all(|l| l.held)
    }

    pub fn text(&self, minutes: f64, seed: u64, c: &Containerd) -> String {
        let mut s = format!(
            "soak: {minutes} min, seed {seed}, containerd {} (root on a tmpfs at {})\n",
            flavor().version,
            c.root().display()
        );
        for l in &self.lines {
            let _ = writeln!(
                s,
                "{} {}: {}",
                if l.held { "ok  " } else { "FAIL" },
                l.what,
                l.value
            );
        }
        s + "faults:\n" + &self.faults
    }
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut esc = false;
    for ch in line.chars() {
        match (esc, ch) {
            (false, '\u{1b}') => esc = true,
            (true, c) if c.is_ascii_alphabetic() => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// Seconds since the epoch of a log stamp `2026-12-07T07:12:33.123456Z`.
fn epoch(stamp: &str) -> Option<f64> {
    let stamp = stamp.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, mi, s) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + mi * 60.0 + s)
}

#[test]
fn epoch_of_a_log_stamp() {
    assert_eq!(epoch("1970-01-02T00:00:01.5Z"), Some(86_401.5));
    assert_eq!(epoch("2026-12-07T00:00:00Z"), Some(1_796_601_600.0));
}

#[test]
fn an_importer_that_stopped_is_one_long_stall() {
    use crate::record::Call;
    let call = |start: f64, ok: bool| Call {
        start,
        end: start + if ok { 2.0 } else { 60.0 },
        worker: "import",
        kind: "archive".into(),
        name: String::new(),
        outcome: if ok {
            Outcome::Ok
        } else {
            Outcome::Miss(String::new())
        },
        cri_ms: ok.then_some(1500),
        pod: None,
        pod_end: start,
    };
    // Imports every 5 s, one miss at a fault: short stalls only.
    let steady: Vec<Call> = (0..100).map(|i| call(i as f64 * 5.0, i != 40)).collect();
    let (_, s) = longest_stall(&steady.iter().collect::<Vec<_>>());
    assert!(s < 15.0, "{s}");
    // Run 5: imports until t = 900 s, then every file missed.
    let hung: Vec<Call> = (0..180)
        .map(|i| call(i as f64 * 5.0, true))
        .chain((0..45).map(|i| call(900.0 + i as f64 * 62.0, false)))
        .collect();
    let (from, s) = longest_stall(&hung.iter().collect::<Vec<_>>());
    assert!(
        (895.0..=900.0).contains(&from) && s > MAX_IMPORT_STALL.as_secs_f64(),
        "{from} {s}"
    );
}
