//! Parse time of a big pull list, for scripts/bench-pull-list.sh (not a
//! test): a 1 MiB list of ~145k references, the shape `tests/hostile.rs`
//! drops (deduplicated in quadratic time, such a list once stalled the
//! proxy).
//!
//! ```text
//! bench_pull_list [--rounds N] [--dir D]
//! ```
//!
//! Variants, alternated round by round (the order flips each round) so
//! background load hits all alike; medians and minimums reported, lines
//! starting with `RESULT` for the script:
//!
//! - `floor`: read the file as `pull::read` does (capped read, lossy UTF-8)
//!   and count its non-blank lines. Any correct design does at least this.
//! - `floor+dedupe`: the floor, each line kept once in a hash set as
//!   written (no normalising): what is left of `read` is the references'
//!   parse and normalisation.
//! - `read`: `imgbridge::import::pull::read`, what the importer runs off the
//!   async runtime: read, normalise every reference, drop duplicates.
//! - `read+policy`: `read`, then the host policy checked for every
//!   reference (`import.pull_hosts_deny = ["docker.io"]`, as the test), as
//!   the importer does next, on the runtime.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imgbridge::import::pull::{self, HostPolicy, MAX_LIST_BYTES};

/// The list `tests/hostile.rs` writes: `r0`, `r1`, … up to just under 1 MiB.
fn list() -> (String, usize) {
    let mut list = String::new();
    let mut n = 0;
    while list.len() < (1 << 20) - 16 {
        list.push_str(&format!("r{n}\n"));
        n += 1;
    }
    (list, n)
}

/// The list's bytes, read as `pull::read` reads them (capped).
fn read_capped(path: &Path) -> Vec<u8> {
    let f = std::fs::File::open(path).expect("open");
    let mut b = Vec::new();
    f.take(MAX_LIST_BYTES + 1)
        .read_to_end(&mut b)
        .expect("read");
    b
}

/// Reads as `pull::read` does, then only finds the lines.
fn floor(path: &Path) -> usize {
    String::from_utf8_lossy(&read_capped(path))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count()
}

fn floor_dedupe(path: &Path) -> usize {
    let b = read_capped(path);
    let text = String::from_utf8_lossy(&b);
    let mut seen = std::collections::HashSet::new();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && seen.insert(l.to_string()))
        .count()
}

fn read(path: &Path) -> usize {
    pull::read(path).expect("pull::read").refs.len()
}

fn read_policy(path: &Path) -> usize {
    let list = pull::read(path).expect("pull::read");
    let policy = HostPolicy {
        allow: Vec::new(),
        deny: vec!["docker.io".into()],
    };
    list.refs
        .iter()
        .filter(|r| policy.check(r).is_err())
        .count()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

fn main() {
    let mut rounds = 10usize;
    let mut dir: Option<PathBuf> = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for kv in args.chunks(2) {
        match (kv[0].as_str(), kv.get(1)) {
            ("--rounds", Some(v)) => rounds = v.parse().expect("--rounds N"),
            ("--dir", Some(v)) => dir = Some(v.into()),
            _ => {
                eprintln!("usage: bench_pull_list [--rounds N] [--dir D]");
                std::process::exit(2);
            }
        }
    }
    let tmp = tempfile::tempdir_in(dir.unwrap_or_else(std::env::temp_dir)).expect("temp dir");
    let path = tmp.path().join("big.txt");
    let (text, n) = list();
    std::fs::write(&path, &text).expect("write the list");
    println!(
        "list: {} bytes, {n} references; {rounds} rounds",
        text.len()
    );

    type Variant = (&'static str, fn(&Path) -> usize, usize);
    let variants: [Variant; 4] = [
        ("floor", floor, n),
        ("floor+dedupe", floor_dedupe, n),
        ("read", read, n),
        ("read+policy", read_policy, n),
    ];
    // One untimed run each: page cache and allocator warm, results checked.
    for (name, f, want) in &variants {
        assert_eq!(f(&path), *want, "{name}");
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for r in 0..rounds {
        let order: Vec<usize> = match r % 2 {
            0 => (0..variants.len()).collect(),
            _ => (0..variants.len()).rev().collect(),
        };
        for i in order {
            let t = Instant::now();
            std::hint::black_box((variants[i].1)(std::hint::black_box(&path)));
            times[i].push(ms(t.elapsed()));
        }
    }
    let floor_median = median(&mut times[0].clone());
    for (i, (name, _, _)) in variants.iter().enumerate() {
        let min = times[i].iter().copied().fold(f64::INFINITY, f64::min);
        let med = median(&mut times[i]);
        println!(
            "RESULT {name:<13} median {med:8.1} ms  min {min:8.1} ms  {:5.2}x floor",
            med / floor_median
        );
    }
}
