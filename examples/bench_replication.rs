//! Timed containerd calls for scripts/bench-replication.sh (not a test).
//!
//! Every comparison alternates its variants round by round (the order flips
//! each round) so background load on a shared machine hits both alike, and
//! reports medians. Lines starting with `RESULT` are parsed by the script.
//!
//! ```text
//! bench_replication create   --containerd S --proxy P --image NAME [--rounds N] [--cold] [--baseline P2]
//!     Images.Create of a new name for NAME (in buildkit) directly vs through
//!     the proxy (= + replication + CRI wait). --cold empties k8s.io and runs
//!     a GC before every call so each proxied Create links every blob, and
//!     adds the containerd floor (blobs linked + record, nothing else).
//!     --baseline: a second imgbridge (another build) as one more variant.
//!     --rebuild: every call names a fresh variant of NAME (a new config
//!     and manifest over the same layers, written untimed before it), as a
//!     rebuild does; k8s.io holds the layers.
//! bench_replication isolated --containerd S --proxy P --image NAME [--rounds N] [--baseline P2]
//!     Replication as a byte copy (isolated content) vs raw Content.Write of
//!     fresh random blobs of the same sizes (concurrent and sequential).
//! bench_replication records  --containerd S --image NAME --count N [--targets K] [--prefix P]
//!     Creates N records in buildkit directly (no replication), spread over K
//!     variants of NAME (distinct config + manifest, shared layers).
//! bench_replication seqcopy  --containerd S [--prefix P]
//!     The plain sequential copy: for each buildkit image named P*, read its
//!     manifest, link each blob into k8s.io (STAT+COMMIT), create the record.
//! bench_replication burst    --containerd S --proxy P --image NAME [--count 200] [--rounds 3] [--conns 20]
//!     COUNT concurrent Images.Create of new names for NAME in buildkit,
//!     spread over CONNS connections: directly vs through the proxy (each
//!     replicated into k8s.io and confirmed through CRI). Total time per
//!     burst and how many calls failed, with their errors.
//! bench_replication clean    --containerd S --ns NS... [--keep PREFIX]...
//!     Deletes every record (except the kept ones and what shares their
//!     target) in the namespaces, the last one with a synchronous GC.
//! ```

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use imgbridge::containerd::content::BlobRef;
use imgbridge::containerd::{request, Containerd, Descriptor, Image};
use imgbridge::oci::Reference;
use imgbridge::replicate::cri_view::CriView;
use imgbridge::replicate::tree;
use sha2::{Digest, Sha256};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SOURCE: &str = "buildkit";
const TARGET: &str = "k8s.io";
const RAW_NS: &str = "bench-raw";

struct Args {
    cmd: String,
    kv: HashMap<String, Vec<String>>,
    flags: HashSet<String>,
}

impl Args {
    fn parse() -> Args {
        let mut it = std::env::args().skip(1);
        let cmd = it.next().unwrap_or_default();
        let mut kv: HashMap<String, Vec<String>> = HashMap::new();
        let mut flags = HashSet::new();
        let rest: Vec<String> = it.collect();
        let mut i = 0;
        while i < rest.len() {
            let k = rest[i].trim_start_matches("--").to_string();
            if k == "cold" || k == "rebuild" {
                flags.insert(k);
                i += 1;
            } else {
                let v = rest.get(i + 1).cloned().unwrap_or_default();
                kv.entry(k).or_default().push(v);
                i += 2;
            }
        }
        Args { cmd, kv, flags }
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.kv.get(k).and_then(|v| v.last()).map(String::as_str)
    }
    fn req(&self, k: &str) -> Res<&str> {
        self.get(k)
            .ok_or_else(|| format!("--{k} is required").into())
    }
    fn num(&self, k: &str, d: usize) -> Res<usize> {
        Ok(match self.get(k) {
            Some(v) => v.parse()?,
            None => d,
        })
    }
    fn all(&self, k: &str) -> Vec<String> {
        self.kv.get(k).cloned().unwrap_or_default()
    }
}

#[tokio::main]
async fn main() -> Res<()> {
    let a = Args::parse();
    let c = Containerd::new(a.req("containerd")?);
    c.version().await?;
    match a.cmd.as_str() {
        "create" => create(&a, &c).await,
        "isolated" => isolated(&a, &c).await,
        "records" => records(&a, &c).await,
        "seqcopy" => seqcopy(&a, &c).await,
        "burst" => burst(&a, &c).await,
        "clean" => {
            let keep = a.all("keep");
            let n = clean(&c, &a.all("ns"), &keep).await?;
            println!("deleted {n} records");
            Ok(())
        }
        other => Err(format!("unknown subcommand {other:?} (see the source header)").into()),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// (median, p90, min) in ms.
fn stats(v: &[Duration]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().map(|d| ms(*d)).collect();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    let p90 = s[((n as f64 * 0.9).ceil() as usize).clamp(1, n) - 1];
    (median, p90, s[0])
}

/// The imgbridge under test (`--proxy`) and, with `--baseline`, another
/// build run as one more variant; both checked to answer.
async fn proxies(a: &Args) -> Res<(Containerd, Option<Containerd>)> {
    let proxy = Containerd::new(a.req("proxy")?);
    proxy.version().await?;
    let baseline = match a.get("baseline") {
        Some(b) => {
            let b = Containerd::new(b);
            b.version().await?;
            Some(b)
        }
        None => None,
    };
    Ok((proxy, baseline))
}

async fn source_image(c: &Containerd, name: &str) -> Res<(Image, Descriptor)> {
    let img = c
        .get_image(SOURCE, name)
        .await?
        .ok_or_else(|| format!("image {name} not found in {SOURCE}"))?;
    let t = img.target.clone().ok_or("image without target")?;
    Ok((img, t))
}

async fn create_record(c: &Containerd, ns: &str, name: &str, target: &Descriptor) -> Res<()> {
    c.create_image(
        ns,
        Image {
            name: name.into(),
            target: Some(target.clone()),
            ..Default::default()
        },
    )
    .await?;
    Ok(())
}

/// C: bursts of concurrent Images.Create: direct, proxied, and what the
/// same work costs straight on containerd, with no proxy:
///
/// - floor: the contract's writes for every name: the source record, then
///   in `k8s.io` the tag and its `name@sha256` record (each name is its own
///   repository here), both marked managed as imgbridge writes them, after
///   the tree is linked and the id record written once for the burst (as
///   imgbridge's shared walk does); each tag polled through CRI
///   `ImageStatus` until it resolves (polls spread to about one per
///   millisecond in all, as imgbridge's are). No reads, lease or labels.
/// - CRI alone, unmarked: one record per name straight into `k8s.io`, as a
///   client that leaves the marking to CRI writes it, then CRI resolves it.
/// - CRI alone, marked: the same records marked managed, after the id
///   record: what confirming through CRI costs at the least.
///
/// Each record is a bolt transaction with an fsync, and CRI handles image
/// events one at a time, so these are what containerd allows, not what a
/// proxy could do better.
async fn burst(a: &Args, c: &Containerd) -> Res<()> {
    const DIRECT: usize = 0;
    const PROXY: usize = 1;
    const FLOOR: usize = 2;
    const CRI_UNMARKED: usize = 3;
    const CRI_MARKED: usize = 4;
    let proxy = a.req("proxy")?;
    let (_, target) = source_image(c, a.req("image")?).await?;
    let count = a.num("count", 200)?;
    let rounds = a.num("rounds", 3)?;
    let conns = a.num("conns", 20)?.clamp(1, count.max(1));
    let keep = a.all("keep");
    let mut t: [Vec<Duration>; 5] = Default::default();
    let mut failed = [0usize; 5];
    let mut errors: HashMap<String, usize> = HashMap::new();
    let labelled = labelled_blobs(c, SOURCE, &target).await?;
    let config = tree::parse(
        &c.read_small(SOURCE, &target.digest, tree::MAX_MANIFEST)
            .await?,
    )?
    .doc
    .config
    .ok_or("the burst image has no config")?
    .digest
    .to_string();
    for r in 0..rounds {
        for v in round_order(&[DIRECT, PROXY, FLOOR, CRI_UNMARKED, CRI_MARKED], r) {
            clean(c, &[SOURCE.to_string(), TARGET.to_string()], &keep).await?;
            let socket = if v == PROXY {
                proxy
            } else {
                a.req("containerd")?
            };
            let clients: Vec<Containerd> = (0..conns).map(|_| Containerd::new(socket)).collect();
            for cl in &clients {
                cl.version().await?;
            }
            let tag = format!("{:x}", rand::random::<u32>());
            // CRI's answers shared by every waiter, as imgbridge waits.
            let waiting = CriView::new(Containerd::new(a.req("containerd")?));
            let waiting = &waiting;
            // The tree is linked into k8s.io once for the burst (as
            // imgbridge's shared walk does); replica records wait for it.
            let linked = tokio::sync::OnceCell::new();
            let linked = &linked;
            let labelled = &labelled;
            let s = Instant::now();
            let calls = (0..count).map(|i| {
                let cl = &clients[i % conns];
                let repo = format!("burst-{v}-{tag}-{i}");
                let target = &target;
                let config = &config;
                async move {
                    if v == DIRECT || v == PROXY || v == FLOOR {
                        create_record(cl, SOURCE, &format!("{repo}:x"), target).await?;
                    }
                    if v == DIRECT || v == PROXY {
                        return Ok(());
                    }
                    let marked = v != CRI_UNMARKED;
                    linked
                        .get_or_init(|| async {
                            link_all(cl, labelled).await.map_err(|e| e.to_string())?;
                            if marked {
                                managed_record(cl, config, target)
                                    .await
                                    .map_err(|e| e.to_string())?;
                            }
                            Ok::<_, String>(())
                        })
                        .await
                        .clone()?;
                    // The replica's name is the normalised reference, as
                    // imgbridge writes it (CRI looks names up so).
                    let full = format!("docker.io/library/{repo}:x");
                    if marked {
                        managed_record(cl, &full, target).await?;
                    } else {
                        create_record(cl, TARGET, &full, target).await?;
                    }
                    if v == FLOOR {
                        let by_digest = format!("docker.io/library/{repo}@{}", target.digest);
                        let (digest_ref, resolved) = tokio::join!(
                            managed_record(cl, &by_digest, target),
                            cri_resolves(&full, waiting)
                        );
                        digest_ref?;
                        return resolved;
                    }
                    cri_resolves(&full, waiting).await
                }
            });
            let results = futures_util::future::join_all(calls).await;
            t[v].push(s.elapsed());
            for e in results.into_iter().filter_map(Result::err) {
                failed[v] += 1;
                let msg = e.to_string();
                *errors.entry(msg.chars().take(160).collect()).or_default() += 1;
            }
        }
    }
    let (d, _, _) = stats(&t[DIRECT]);
    let (p, _, _) = stats(&t[PROXY]);
    let (f, _, _) = stats(&t[FLOOR]);
    let (unmarked, _, _) = stats(&t[CRI_UNMARKED]);
    let (marked, _, _) = stats(&t[CRI_MARKED]);
    println!("RESULT burst_direct_ms {d:.0}");
    println!("RESULT burst_proxy_ms {p:.0}");
    println!("RESULT burst_ratio {:.2}", p / d);
    println!("RESULT burst_floor_ms {f:.0}");
    println!("RESULT burst_floor_ratio {:.2}", f / d);
    println!("RESULT burst_ratio_vs_floor {:.2}", p / f);
    println!("RESULT burst_cri_alone_ms {unmarked:.0}");
    println!("RESULT burst_cri_alone_ratio {:.2}", unmarked / d);
    println!("RESULT burst_cri_marked_ms {marked:.0}");
    println!("RESULT burst_cri_marked_ratio {:.2}", marked / d);
    println!("RESULT burst_direct_failed {}", failed[DIRECT]);
    println!("RESULT burst_proxy_failed {}", failed[PROXY]);
    println!(
        "RESULT burst_floor_failed {}",
        failed[FLOOR] + failed[CRI_UNMARKED] + failed[CRI_MARKED]
    );
    for (e, n) in errors {
        println!("error ×{n}: {e}");
    }
    Ok(())
}

/// A record in k8s.io already marked managed by CRI, as CRI's own pull
/// writes it (no second write by CRI's event handler).
async fn managed_record(c: &Containerd, name: &str, target: &Descriptor) -> Res<()> {
    let r = c
        .create_image(
            TARGET,
            Image {
                name: name.into(),
                target: Some(target.clone()),
                labels: [("io.cri-containerd.image".to_string(), "managed".to_string())].into(),
                ..Default::default()
            },
        )
        .await;
    match r {
        Err(e) if e.is(tonic::Code::AlreadyExists) => Ok(()),
        r => r.map(|_| ()).map_err(Into::into),
    }
}

/// Waits until CRI resolves `name` (written before the call), in the
/// `ListImages` answers every waiter of the burst shares ([`CriView`]).
async fn cri_resolves(name: &str, view: &CriView) -> Res<()> {
    let _waiting = view.enter();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(30);
    let mut after = started;
    loop {
        let (asked, id) = view.id_after(name, after).await;
        if id.is_some() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("CRI did not resolve {name} in 30 s").into());
        }
        after = asked + Duration::from_nanos(1);
    }
}

/// A2: Images.Create directly vs through the proxy; with --cold also the
/// containerd floor: the least a client can do to make the tree visible in
/// k8s.io (every blob linked by one COMMIT message, 16 at once, then the
/// record), with the blob list and labels precomputed. `--baseline SOCK`
/// adds a second imgbridge (another build) as one more variant.
async fn create(a: &Args, c: &Containerd) -> Res<()> {
    let (proxy, baseline) = proxies(a).await?;
    let (_, target) = source_image(c, a.req("image")?).await?;
    let rounds = a.num("rounds", 20)?;
    let cold = a.flags.contains("cold");
    let rebuild = a.flags.contains("rebuild");
    let keep = a.all("keep");
    let tag = format!("{:x}", rand::random::<u32>());
    let labelled = labelled_blobs(c, SOURCE, &target).await?;
    // 0 direct, 1 proxy, 2 floor (cold only), 3 baseline (if given)
    let mut variants = vec![0usize, 1];
    if cold {
        variants.push(2);
    }
    if baseline.is_some() {
        variants.push(3);
    }
    let mut t: [Vec<Duration>; 4] = Default::default();
    // Warm-up (connections, imgbridge's CRI detection), not counted.
    create_record(c, SOURCE, &format!("bench-warm-d-{tag}:x"), &target).await?;
    create_record(&proxy, SOURCE, &format!("bench-warm-p-{tag}:x"), &target).await?;
    if let Some(b) = &baseline {
        create_record(b, SOURCE, &format!("bench-warm-b-{tag}:x"), &target).await?;
    }
    let base = match rebuild {
        true => Some(Base::read(c, &target).await?),
        false => None,
    };
    let mut leases = Vec::new();
    for r in 0..rounds {
        for v in round_order(&variants, r) {
            if cold {
                clean(c, &[TARGET.to_string()], &keep).await?;
            }
            let target = match &base {
                Some(b) => {
                    let (t, lease) = b.variant(c, &format!("{tag}-{r}-{v}")).await?;
                    leases.push(lease);
                    t
                }
                None => target.clone(),
            };
            let s = Instant::now();
            match v {
                0 => {
                    create_record(
                        c,
                        SOURCE,
                        &format!("bench-a2-direct-{tag}-{r}:latest"),
                        &target,
                    )
                    .await?
                }
                1 => {
                    create_record(
                        &proxy,
                        SOURCE,
                        &format!("bench-a2-proxy-{tag}-{r}:latest"),
                        &target,
                    )
                    .await?
                }
                2 => {
                    floor(
                        c,
                        &labelled,
                        &format!("docker.io/library/bench-a2-floor-{tag}-{r}:latest"),
                        &target,
                    )
                    .await?
                }
                _ => {
                    let b = baseline.as_ref().expect("baseline");
                    create_record(
                        b,
                        SOURCE,
                        &format!("bench-a2-base-{tag}-{r}:latest"),
                        &target,
                    )
                    .await?
                }
            }
            t[v].push(s.elapsed());
        }
    }
    // Leave buildkit as we found it.
    for img in c.list_images(SOURCE, Vec::new()).await? {
        if img.name.starts_with("bench-a2-") || img.name.starts_with("bench-warm-") {
            c.delete_image(SOURCE, &img.name, false).await?;
        }
    }
    for l in leases {
        c.delete_lease(SOURCE, &l).await?;
    }
    let (dm, dp, dmin) = stats(&t[0]);
    let (pm, pp, pmin) = stats(&t[1]);
    let (mode, k8s) = match (cold, rebuild) {
        (true, _) => ("cold", "emptied + GC before each call"),
        (false, true) => ("rebuild", "holds the layers; config and manifest are new"),
        (false, false) => ("warm", "already holds the blobs"),
    };
    println!(
        "Images.Create, {} blobs, {rounds} rounds, {mode} (k8s.io {k8s}):",
        labelled.len(),
    );
    println!("  direct   : median {dm:8.2} ms  p90 {dp:8.2}  min {dmin:8.2}");
    println!(
        "  proxy    : median {pm:8.2} ms  p90 {pp:8.2}  min {pmin:8.2}   added {:8.2} ms",
        pm - dm
    );
    let mut extra = String::new();
    if cold {
        let (fm, fp, fmin) = stats(&t[2]);
        println!("  floor    : median {fm:8.2} ms  p90 {fp:8.2}  min {fmin:8.2}   (link {} blobs + record, no CRI wait)", labelled.len());
        extra += &format!(" floor_ms={fm:.2} floor_p90_ms={fp:.2}");
    }
    if baseline.is_some() {
        let (bm, bp, bmin) = stats(&t[3]);
        println!(
            "  baseline : median {bm:8.2} ms  p90 {bp:8.2}  min {bmin:8.2}   added {:8.2} ms",
            bm - dm
        );
        extra += &format!(
            " base_ms={bm:.2} base_p90_ms={bp:.2} base_added_ms={:.2}",
            bm - dm
        );
    }
    println!(
        "RESULT create_{mode} direct_ms={dm:.2} proxy_ms={pm:.2} direct_p90_ms={dp:.2} proxy_p90_ms={pp:.2} added_ms={:.2}{extra}",
        pm - dm
    );
    Ok(())
}

/// Links every blob into k8s.io with a single COMMIT message each (shared
/// content only), then writes the record.
async fn floor(
    c: &Containerd,
    blobs: &[(String, i64, HashMap<String, String>)],
    name: &str,
    target: &Descriptor,
) -> Res<()> {
    link_all(c, blobs).await?;
    create_record(c, TARGET, name, target).await
}

/// Links every blob into k8s.io with a single COMMIT message each, 16 at
/// once (shared content only).
async fn link_all(c: &Containerd, blobs: &[(String, i64, HashMap<String, String>)]) -> Res<()> {
    let res: Vec<Res<()>> = stream::iter(blobs)
        .map(|(d, size, labels)| async move {
            let msg = containerd_client::services::v1::WriteContentRequest {
                action: containerd_client::services::v1::WriteAction::Commit as i32,
                r#ref: format!("bench-floor-{:x}-{d}", rand::random::<u64>()),
                total: *size,
                offset: *size,
                expected: d.clone(),
                labels: labels.clone(),
                ..Default::default()
            };
            let mut s = match c
                .content()
                .write(request(TARGET, None, stream::iter(vec![msg])))
                .await
            {
                Ok(s) => s.into_inner(),
                Err(e) if e.code() == tonic::Code::AlreadyExists => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            match s.message().await {
                Ok(_) => Ok(()),
                Err(e) if e.code() == tonic::Code::AlreadyExists => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for r in res {
        r?;
    }
    Ok(())
}

/// The blobs of the tree from `root` in `ns`, with their labels.
async fn labelled_blobs(
    c: &Containerd,
    ns: &str,
    root: &Descriptor,
) -> Res<Vec<(String, i64, HashMap<String, String>)>> {
    let mut labelled = Vec::new();
    for (d, size) in tree_blobs(c, ns, root).await? {
        let info = c
            .content_info(ns, &d)
            .await?
            .ok_or("blob missing in source")?;
        labelled.push((d, size, info.labels));
    }
    Ok(labelled)
}

/// All blobs of a manifest tree (manifest target only: what ctr import and
/// umoci/skopeo produce), with sizes.
async fn tree_blobs(c: &Containerd, ns: &str, root: &Descriptor) -> Res<Vec<(String, i64)>> {
    let mut out = vec![(root.digest.clone(), root.size)];
    let mut queue = vec![root.digest.clone()];
    while let Some(d) = queue.pop() {
        let node = tree::parse(&c.read_small(ns, &d, tree::MAX_MANIFEST).await?)?;
        for ch in node.children() {
            out.push((ch.digest.to_string(), ch.size));
            if tree::is_parent(&ch.media_type) {
                queue.push(ch.digest.to_string());
            }
        }
    }
    Ok(out)
}

fn random_blob(size: usize) -> (Vec<u8>, String) {
    let mut v = vec![0u8; size];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut v);
    let d = format!("sha256:{}", hex::encode(Sha256::digest(&v)));
    (v, d)
}

async fn raw_write(c: &Containerd, blobs: &[(Vec<u8>, String)], parallel: usize) -> Res<()> {
    let none = HashMap::new();
    let res: Vec<_> = stream::iter(blobs)
        .map(|(data, digest)| {
            let none = &none;
            async move {
                let chunks: Vec<_> = data
                    .chunks(1 << 20)
                    .map(|ch| Ok(bytes::Bytes::copy_from_slice(ch)))
                    .collect();
                c.write_blob(
                    RAW_NS,
                    None,
                    BlobRef {
                        digest,
                        size: data.len() as i64,
                        labels: none,
                    },
                    stream::iter(chunks),
                )
                .await
            }
        })
        .buffer_unordered(parallel)
        .collect()
        .await;
    for r in res {
        r?;
    }
    Ok(())
}

async fn delete_raw(c: &Containerd, blobs: &[(Vec<u8>, String)]) -> Res<()> {
    for (_, d) in blobs {
        let _ = c
            .content()
            .delete(request(
                RAW_NS,
                None,
                containerd_client::services::v1::DeleteContentRequest { digest: d.clone() },
            ))
            .await;
    }
    Ok(())
}

/// A3: byte copy by replication vs raw Content.Write of as many bytes;
/// `--baseline SOCK` adds a second imgbridge as one more variant.
async fn isolated(a: &Args, c: &Containerd) -> Res<()> {
    let (proxy, baseline) = proxies(a).await?;
    let policy = c.sharing_policy().await?;
    let (_, target) = source_image(c, a.req("image")?).await?;
    let sizes = tree_blobs(c, SOURCE, &target).await?;
    let total: i64 = sizes.iter().map(|s| s.1).sum();
    let rounds = a.num("rounds", 5)?;
    let keep = a.all("keep");
    let tag = format!("{:x}", rand::random::<u32>());
    let mb = total as f64 / 1e6;
    println!(
        "content policy {policy}; image tree: {} blobs, {mb:.1} MB",
        sizes.len()
    );
    let mut t: [Vec<Duration>; 4] = Default::default();
    let names = [
        "raw Content.Write, concurrent",
        "raw Content.Write, sequential",
        "replication copy (proxy Create)",
        "baseline imgbridge copy",
    ];
    let variants: Vec<usize> = if baseline.is_some() {
        vec![0, 1, 2, 3]
    } else {
        vec![0, 1, 2]
    };
    for r in 0..rounds {
        for v in round_order(&variants, r) {
            clean(c, &[TARGET.to_string()], &keep).await?;
            if v >= 2 {
                let conn = if v == 2 {
                    &proxy
                } else {
                    baseline.as_ref().expect("baseline")
                };
                let name = format!("bench-a3-{tag}-{r}-{v}:latest");
                let s = Instant::now();
                create_record(conn, SOURCE, &name, &target).await?;
                t[v].push(s.elapsed());
                c.delete_image(SOURCE, &name, false).await?;
            } else {
                let blobs: Vec<_> = sizes
                    .iter()
                    .map(|(_, n)| random_blob(*n as usize))
                    .collect();
                let s = Instant::now();
                raw_write(c, &blobs, if v == 0 { 16 } else { 1 }).await?;
                t[v].push(s.elapsed());
                delete_raw(c, &blobs).await?;
            }
        }
    }
    clean(c, &[TARGET.to_string()], &keep).await?;
    let mut mbps = [0f64; 4];
    for &v in &variants {
        let (m, p, min) = stats(&t[v]);
        mbps[v] = mb / (m / 1000.0);
        println!(
            "  {:32}: median {m:8.1} ms  p90 {p:8.1}  min {min:8.1}  -> {:7.1} MB/s",
            names[v], mbps[v]
        );
    }
    let base = if baseline.is_some() {
        format!(
            " base_mbps={:.1} base_ratio_vs_par={:.2}",
            mbps[3],
            mbps[3] / mbps[0]
        )
    } else {
        String::new()
    };
    println!(
        "RESULT isolated bytes={total} raw_par_mbps={:.1} raw_seq_mbps={:.1} copy_mbps={:.1} ratio_vs_par={:.2} ratio_vs_seq={:.2}{base}",
        mbps[0],
        mbps[1],
        mbps[2],
        mbps[2] / mbps[0],
        mbps[2] / mbps[1]
    );
    Ok(())
}

/// A single-manifest image in buildkit whose variants share its layers.
struct Base {
    root: Descriptor,
    manifest: serde_json::Value,
    config: serde_json::Value,
}

impl Base {
    async fn read(c: &Containerd, root: &Descriptor) -> Res<Base> {
        if !tree::is_parent(&root.media_type)
            || root.media_type.contains("index")
            || root.media_type.contains("list")
        {
            return Err(format!("{} is not a single manifest", root.digest).into());
        }
        let manifest: serde_json::Value = serde_json::from_slice(
            &c.read_small(SOURCE, &root.digest, tree::MAX_MANIFEST)
                .await?,
        )?;
        let cfg_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or("no config")?
            .to_string();
        let config: serde_json::Value = serde_json::from_slice(
            &c.read_small(SOURCE, &cfg_digest, tree::MAX_MANIFEST)
                .await?,
        )?;
        Ok(Base {
            root: root.clone(),
            manifest,
            config,
        })
    }

    /// A variant: one more env var in the config, same layers; written in
    /// buildkit under a lease of its own (returned: delete it once a
    /// record holds the variant).
    async fn variant(&self, c: &Containerd, id: &str) -> Res<(Descriptor, String)> {
        let mut cfg = self.config.clone();
        let mut env = cfg["config"]["Env"].as_array().cloned().unwrap_or_default();
        env.push(serde_json::Value::String(format!("BENCH_VARIANT={id}")));
        cfg["config"]["Env"] = serde_json::Value::Array(env);
        let cbytes = serde_json::to_vec(&cfg)?;
        let cd = format!("sha256:{}", hex::encode(Sha256::digest(&cbytes)));
        let mut m = self.manifest.clone();
        m["config"]["digest"] = cd.clone().into();
        m["config"]["size"] = (cbytes.len() as i64).into();
        let mbytes = serde_json::to_vec(&m)?;
        let md = format!("sha256:{}", hex::encode(Sha256::digest(&mbytes)));
        let node = tree::parse(&mbytes)?;
        let lease = c.create_lease(SOURCE, Duration::from_secs(600)).await?;
        // The config, then the manifest with the GC labels that keep it.
        let blobs = [
            (&cd, &cbytes, HashMap::new()),
            (&md, &mbytes, node.gc_labels()),
        ];
        for (digest, raw, labels) in blobs {
            let blob = BlobRef {
                digest,
                size: raw.len() as i64,
                labels: &labels,
            };
            let data = stream::iter(vec![Ok(bytes::Bytes::from(raw.clone()))]);
            c.write_blob(SOURCE, Some(&lease), blob, data).await?;
        }
        let t = Descriptor {
            media_type: self.root.media_type.clone(),
            digest: md,
            size: mbytes.len() as i64,
            ..Default::default()
        };
        Ok((t, lease))
    }
}

/// B setup: `count` records in buildkit over `targets` variants of `image`.
async fn records(a: &Args, c: &Containerd) -> Res<()> {
    let (_, base) = source_image(c, a.req("image")?).await?;
    let count = a.num("count", 500)?;
    let k = a.num("targets", 1)?.max(1);
    let prefix = a.get("prefix").unwrap_or("bench-b-").to_string();
    let b = Base::read(c, &base).await?;
    let mut targets = vec![base.clone()];
    for i in 1..k {
        let (t, lease) = b.variant(c, &i.to_string()).await?;
        // The first record of each variant holds it before the lease goes.
        create_record(c, SOURCE, &format!("{prefix}{i:04}:latest"), &t).await?;
        c.delete_lease(SOURCE, &lease).await?;
        targets.push(t);
    }
    let s = Instant::now();
    let res: Vec<_> = stream::iter(0..count)
        .filter(|i| std::future::ready(*i == 0 || *i >= k))
        .map(|i| {
            let t = &targets[i % k];
            let name = format!("{prefix}{i:04}:latest");
            async move {
                match create_record(c, SOURCE, &name, t).await {
                    Err(e) if e.to_string().contains("already exists") => Ok(()),
                    r => r,
                }
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for r in res {
        r?;
    }
    println!(
        "created {count} records in {SOURCE} over {k} targets in {:.0} ms",
        ms(s.elapsed())
    );
    Ok(())
}

/// B baseline: a plain sequential copy of every buildkit image named P*.
async fn seqcopy(a: &Args, c: &Containerd) -> Res<()> {
    let prefix = a.get("prefix").unwrap_or("bench-b-").to_string();
    let s = Instant::now();
    let images: Vec<_> = c
        .list_images(SOURCE, Vec::new())
        .await?
        .into_iter()
        .filter(|i| i.name.starts_with(&prefix))
        .collect();
    let none = HashMap::new();
    let mut blobs_linked = 0;
    for img in &images {
        let root = img.target.clone().ok_or("no target")?;
        let node = tree::parse(
            &c.read_small(SOURCE, &root.digest, tree::MAX_MANIFEST)
                .await?,
        )?;
        for ch in node.children() {
            c.link_or_copy(
                SOURCE,
                TARGET,
                None,
                BlobRef {
                    digest: &ch.digest,
                    size: ch.size,
                    labels: &none,
                },
            )
            .await?;
            blobs_linked += 1;
        }
        let labels = node.gc_labels();
        c.link_or_copy(
            SOURCE,
            TARGET,
            None,
            BlobRef {
                digest: &root.digest,
                size: root.size,
                labels: &labels,
            },
        )
        .await?;
        let name = Reference::parse(&img.name)?.to_string();
        c.put_image(
            TARGET,
            Image {
                name,
                target: Some(root),
                ..Default::default()
            },
        )
        .await?;
    }
    let el = s.elapsed();
    println!(
        "sequential copy: {} images ({} blobs linked or present) in {:.0} ms = {:.1} images/s",
        images.len(),
        blobs_linked + images.len(),
        ms(el),
        images.len() as f64 / el.as_secs_f64()
    );
    Ok(())
}

/// Deletes every record in `namespaces` except names starting with a `keep`
/// prefix and records sharing their target; the last delete runs the GC.
/// Repeats until nothing reappears: CRI may still be handling the events of
/// a replica (and recreate its `sha256:<config>` record) when we list.
async fn clean(c: &Containerd, namespaces: &[String], keep: &[String]) -> Res<usize> {
    let mut total = 0;
    for _ in 0..20 {
        let n = clean_once(c, namespaces, keep).await?;
        if n == 0 {
            return Ok(total);
        }
        total += n;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("records keep reappearing; is something still writing?".into())
}

async fn clean_once(c: &Containerd, namespaces: &[String], keep: &[String]) -> Res<usize> {
    let mut doomed = Vec::new();
    for ns in namespaces {
        let images = c.list_images(ns, Vec::new()).await?;
        let kept: HashSet<String> = images
            .iter()
            .filter(|i| keep.iter().any(|k| i.name.starts_with(k.as_str())))
            .filter_map(|i| i.target.as_ref().map(|t| t.digest.clone()))
            .collect();
        for i in images {
            let t = i
                .target
                .as_ref()
                .map(|t| t.digest.clone())
                .unwrap_or_default();
            if !keep.iter().any(|k| i.name.starts_with(k.as_str())) && !kept.contains(&t) {
                doomed.push((ns.clone(), i.name));
            }
        }
    }
    let n = doomed.len();
    let Some(last) = doomed.pop() else {
        return Ok(0);
    };
    let res: Vec<_> = stream::iter(doomed)
        .map(|(ns, name)| async move { c.delete_image(&ns, &name, false).await })
        .buffer_unordered(16)
        .collect()
        .await;
    for r in res {
        r?;
    }
    c.delete_image(&last.0, &last.1, true).await?;
    Ok(n)
}

/// The variants in the order round `r` runs them: rotated each round and
/// reversed every other one, so no variant always follows the same one.
fn round_order<T: Clone>(variants: &[T], r: usize) -> Vec<T> {
    let mut order = variants.to_vec();
    order.rotate_left(r % variants.len());
    if r % 2 == 1 {
        order.reverse();
    }
    order
}
