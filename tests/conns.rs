//! What idle connections cost imgbridge, and that it gives the memory back
//! once they close, against a real containerd.

use std::path::Path;
use std::time::{Duration, Instant};

use containerd_client::services::v1::version_client::VersionClient;
use futures_util::stream::{self, StreamExt};
use imgbridge_test_support::prelude::*;
use tonic::transport::Channel;

/// Connections held open at once.
const CONNS: usize = 2500;

/// What one idle connection may cost (VmRSS growth over the baseline,
/// divided by [`CONNS`]).
const PER_CONN_KIB: u64 = 64;

/// How far above the baseline VmRSS may stay once they have all closed.
const AFTER_CLOSE: f64 = 1.2;

fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// Client connections `pid` still holds on its listening socket `sock`:
/// accepted sockets carry the listener's path in /proc/net/unix.
fn held_clients(pid: u32, sock: &Path) -> usize {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let inodes: std::collections::HashSet<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Num RefCount Protocol Flags Type St Inode Path; 00010000 = listening
            (f.len() == 8 && Path::new(f[7]) == sock && f[3] != "00010000")
                .then(|| format!("socket:[{}]", f[6]))
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|l| inodes.contains(l.to_str().unwrap_or("")))
                .count()
        })
        .unwrap_or(0)
}

/// `n` connections to `sock`, each past the HTTP/2 handshake and one
/// `Version` call (so each connection's splice has read, relayed and gone
/// idle in both directions).
async fn open(sock: &Path, n: usize) -> Vec<Channel> {
    stream::iter(0..n)
        .map(|_| async {
            let ch = containerd_channel(sock).await;
            VersionClient::new(ch.clone())
                .version(())
                .await
                .expect("Version through imgbridge");
            ch
        })
        .buffer_unordered(64)
        .collect()
        .await
}

/// The test process holds [`CONNS`] sockets (and imgbridge twice as many):
/// more than a default soft limit of 1024.
fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("setrlimit");
    }
    assert!(
        hard as usize > CONNS + 256,
        "RLIMIT_NOFILE hard limit {hard} is too low for {CONNS} connections"
    );
}

/// 2500 idle connections cost at most 64 KiB each, and VmRSS comes back to
/// within 20% of its baseline once they have closed.
///
/// Why these bounds hold for a debug build as for a release one: an idle
/// connection holds the same allocations either way (its splice state, the
/// HPACK tables, two registered sockets, no read buffer), and memory goes
/// back by the allocator's own clock (jemalloc's background purge, ~1 s),
/// not by how fast the code runs. Measured, KiB per idle connection / VmRSS
/// after close over baseline: debug 5 / 1.05-1.13x, release 5 / 1.09-1.13x
/// (back within about 1.5 s). At 68e586e (a 256 KiB read buffer per
/// direction, glibc's malloc): debug 68-83 / 9.9x, release 84-86 / 15x,
/// still so 10 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cost_little_and_are_given_back() {
    raise_nofile();
    let (_c, p) = Scenario::plain().start();
    let pid = p.pid();

    // Warm up: the runtime's worker threads and every lazily built thing a
    // call needs exist from here on, as in a daemon that has served before.
    drop(open(p.socket(), 64).await);
    let closed = poll(Duration::from_secs(10), || {
        (held_clients(pid, p.socket()) == 0).then_some(())
    });
    assert!(closed.is_some(), "warm-up connections never closed");
    let base = rss_kib(pid);

    let t = Instant::now();
    let conns = open(p.socket(), CONNS).await;
    let opened = t.elapsed();
    let held = rss_kib(pid);
    // /proc/net/unix is read in pages, not at once: while another test
    // process opens and closes sockets a read can miss a line (2499 of
    // 2500 seen once, two test binaries at a time), so one read that
    // counts them all is waited for.
    let counted = poll(Duration::from_secs(10), || {
        let n = held_clients(pid, p.socket());
        (n == CONNS).then_some(n)
    });
    assert_eq!(
        counted,
        Some(CONNS),
        "connections held: last read {}",
        held_clients(pid, p.socket())
    );
    let per_conn = held.saturating_sub(base) / CONNS as u64;
    eprintln!(
        "VmRSS baseline {base} KiB; {CONNS} idle connections (opened in {opened:?}): {held} KiB, {per_conn} KiB each"
    );
    drop(conns);
    let gone = poll(Duration::from_secs(10), || {
        (held_clients(pid, p.socket()) == 0).then_some(())
    });
    assert!(
        gone.is_some(),
        "imgbridge still holds {} client connections after the clients closed",
        held_clients(pid, p.socket())
    );
    let bound = (base as f64 * AFTER_CLOSE) as u64;
    let t = Instant::now();
    let back = poll(Duration::from_secs(10), || {
        let now = rss_kib(pid);
        (now <= bound).then_some(now)
    });
    let now = rss_kib(pid);
    eprintln!(
        "after close: VmRSS {now} KiB ({:.2}x baseline) {:?} after imgbridge closed them",
        now as f64 / base as f64,
        t.elapsed()
    );
    // Both asserted only now, so that a failure shows both numbers.
    assert!(
        per_conn <= PER_CONN_KIB,
        "{CONNS} idle connections cost {per_conn} KiB each (VmRSS {base} -> {held} KiB), over {PER_CONN_KIB} KiB; after they closed: {now} KiB"
    );
    assert!(
        back.is_some(),
        "VmRSS still {now} KiB 10 s after {CONNS} connections closed: over {AFTER_CLOSE}x its baseline {base} KiB (peak {} KiB)",
        status_kib(pid, "VmHWM:")
    );
}
