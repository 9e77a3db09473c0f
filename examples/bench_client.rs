//! Load generator for `scripts/bench.sh`: the same gRPC client against
//! containerd directly, the floor relay and imgbridge.
//!
//! ```text
//! bench_client unary --sockets A,B,C --calls 5000 [--warmup 200] [--block 20]
//!     Version calls, one by one, in blocks of --block calls per socket, the
//!     sockets taken in turn (so drift hits all alike); --calls per socket.
//!     Prints p50/p90/p99 per socket.
//! bench_client write --socket S --ns NS --size BYTES [--delete]
//!     Content.Write of fresh random bytes in 1 MiB chunks, then commit.
//! bench_client read --socket S --ns NS --digest D [--concurrency N] [--connections M]
//!     N concurrent Content.Read streams of the whole blob, aggregate MB/s.
//! ```
//!
//! One connection per socket unless `--connections` says otherwise; message
//! limits are containerd's 16 MiB. MB is 10^6 bytes. Output lines are
//! `key=value` pairs for the script to parse.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use containerd_client::services::v1::{
    content_client::ContentClient, leases_client::LeasesClient, version_client::VersionClient,
    CreateRequest, DeleteContentRequest, ReadContentRequest, WriteAction, WriteContentRequest,
};
use hyper_util::rt::TokioIo;
use rand::RngCore;
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::Request;

const MAX_MESSAGE: usize = 16 << 20;
const CHUNK: usize = 1 << 20;
/// Lease holding the benchmark's blobs so containerd's GC leaves them alone.
const LEASE: &str = "imgbridge-bench";

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Sequential Version calls interleaved across sockets.
    Unary {
        /// Comma-separated sockets.
        #[arg(long, value_delimiter = ',', required = true)]
        sockets: Vec<PathBuf>,
        /// Measured calls per socket.
        #[arg(long, default_value_t = 5000)]
        calls: usize,
        /// Unmeasured calls per socket first.
        #[arg(long, default_value_t = 200)]
        warmup: usize,
        /// Calls in a row to one socket before moving to the next. What a
        /// relay does after it has written a reply (its own bookkeeping, the
        /// wake-ups a tokio socket takes for writability) runs while the
        /// client already makes its next call: with 1, that cost landed on
        /// whichever socket came next (measured: the same binary in the slot
        /// after the floor relay was 3-5 µs slower than in the slot after
        /// itself). In blocks, each socket pays its own, but for one call in
        /// `block`.
        #[arg(long, default_value_t = 20)]
        block: usize,
    },
    /// Content.Write of random bytes, then commit.
    Write {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long, default_value = "bench")]
        ns: String,
        /// Bytes to write.
        #[arg(long)]
        size: u64,
        /// Delete the blob again after the measurement.
        #[arg(long)]
        delete: bool,
    },
    /// Concurrent Content.Read streams of one blob.
    Read {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long, default_value = "bench")]
        ns: String,
        #[arg(long)]
        digest: String,
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Spread the streams over this many connections.
        #[arg(long, default_value_t = 1)]
        connections: usize,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // One thread: the client should take as little of the 2 cores as it can,
    // and the same little for every target.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.command {
            Cmd::Unary {
                sockets,
                calls,
                warmup,
                block,
            } => unary(&sockets, calls, warmup, block.max(1)).await,
            Cmd::Write {
                socket,
                ns,
                size,
                delete,
            } => write(&socket, &ns, size, delete).await,
            Cmd::Read {
                socket,
                ns,
                digest,
                concurrency,
                connections,
            } => read(&socket, &ns, &digest, concurrency, connections).await,
        }
    })
}

async fn connect(socket: &Path) -> anyhow::Result<Channel> {
    let path = socket.to_path_buf();
    Endpoint::try_from("http://[::]")?
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .with_context(|| format!("connecting to {}", socket.display()))
}

fn with_ns<T>(msg: T, ns: &str) -> anyhow::Result<Request<T>> {
    let mut req = Request::new(msg);
    let md = req.metadata_mut();
    md.insert("containerd-namespace", MetadataValue::try_from(ns)?);
    md.insert("containerd-lease", MetadataValue::from_static(LEASE));
    Ok(req)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn unary(
    sockets: &[PathBuf],
    calls: usize,
    warmup: usize,
    block: usize,
) -> anyhow::Result<()> {
    let mut clients = Vec::new();
    for s in sockets {
        clients.push(VersionClient::new(connect(s).await?));
    }
    let n = clients.len();
    let mut samples = vec![Vec::with_capacity(calls); n];
    let total = warmup + calls;
    for first in (0..total).step_by(block) {
        for s in 0..n {
            for k in first..total.min(first + block) {
                let t = Instant::now();
                clients[s]
                    .version(())
                    .await
                    .with_context(|| format!("Version via {}", sockets[s].display()))?;
                if k >= warmup {
                    samples[s].push(micros(t.elapsed()));
                }
            }
        }
    }
    for (s, mut v) in samples.into_iter().enumerate() {
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "unary socket={} calls={} p50_us={:.1} p90_us={:.1} p99_us={:.1} mean_us={:.1}",
            sockets[s].display(),
            v.len(),
            percentile(&v, 0.50),
            percentile(&v, 0.90),
            percentile(&v, 0.99),
            mean
        );
    }
    Ok(())
}

/// Chunk `i` of a run: the random base with the run's nonce and the index
/// stamped in front, so every chunk and every run differs.
fn chunk(base: &[u8], nonce: u64, i: u64, len: usize) -> Vec<u8> {
    let mut c = base[..len].to_vec();
    let n = len.min(16);
    let mut stamp = [0u8; 16];
    stamp[..8].copy_from_slice(&nonce.to_le_bytes());
    stamp[8..].copy_from_slice(&i.to_le_bytes());
    c[..n].copy_from_slice(&stamp[..n]);
    c
}

async fn ensure_lease(ch: Channel, ns: &str) -> anyhow::Result<()> {
    let req = with_ns(
        CreateRequest {
            id: LEASE.into(),
            labels: Default::default(),
        },
        ns,
    )?;
    match LeasesClient::new(ch).create(req).await {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::AlreadyExists => Ok(()),
        Err(s) => bail!("creating lease {LEASE}: {s}"),
    }
}

async fn write(socket: &Path, ns: &str, size: u64, delete: bool) -> anyhow::Result<()> {
    let ch = connect(socket).await?;
    ensure_lease(ch.clone(), ns).await?;
    let mut base = vec![0u8; CHUNK];
    rand::rng().fill_bytes(&mut base);
    let nonce = rand::rng().next_u64();
    let chunks = size.div_ceil(CHUNK as u64);
    let len_of = move |i: u64| (size - i * CHUNK as u64).min(CHUNK as u64) as usize;
    // Digest first, outside the measurement.
    let mut h = Sha256::new();
    for i in 0..chunks {
        h.update(chunk(&base, nonce, i, len_of(i)));
    }
    let digest = format!("sha256:{}", hex::encode(h.finalize()));
    let reference = format!("imgbridge-bench-{nonce:016x}");
    let expected = digest.clone();
    let reqs = futures_util::stream::iter((0..chunks).map(move |i| {
        let last = i + 1 == chunks;
        WriteContentRequest {
            action: if last {
                WriteAction::Commit
            } else {
                WriteAction::Write
            } as i32,
            r#ref: if i == 0 {
                reference.clone()
            } else {
                String::new()
            },
            total: size as i64,
            expected: if last {
                expected.clone()
            } else {
                String::new()
            },
            offset: (i * CHUNK as u64) as i64,
            data: chunk(&base, nonce, i, len_of(i)),
            labels: Default::default(),
        }
    }));
    let mut client = ContentClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let t = Instant::now();
    let mut replies = client
        .write(with_ns(reqs, ns)?)
        .await
        .context("Content.Write")?
        .into_inner();
    let mut last = None;
    while let Some(r) = replies.message().await.context("Content.Write reply")? {
        last = Some(r);
    }
    let secs = t.elapsed().as_secs_f64();
    let last = last.context("Content.Write: no reply")?;
    if last.action != WriteAction::Commit as i32 || last.offset as u64 != size {
        bail!(
            "Content.Write did not commit: last reply action={} offset={}",
            last.action,
            last.offset
        );
    }
    println!(
        "write bytes={size} secs={secs:.3} mbps={:.1} digest={digest}",
        size as f64 / secs / 1e6
    );
    if delete {
        client
            .delete(with_ns(
                DeleteContentRequest {
                    digest: digest.clone(),
                },
                ns,
            )?)
            .await
            .context("Content.Delete")?;
    }
    Ok(())
}

async fn read(
    socket: &Path,
    ns: &str,
    digest: &str,
    concurrency: usize,
    connections: usize,
) -> anyhow::Result<()> {
    let mut clients = Vec::new();
    for _ in 0..connections.max(1) {
        clients.push(
            ContentClient::new(connect(socket).await?)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        );
    }
    let t = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..concurrency {
        let mut c = clients[k % clients.len()].clone();
        let req = with_ns(
            ReadContentRequest {
                digest: digest.to_owned(),
                offset: 0,
                size: 0,
            },
            ns,
        )?;
        tasks.push(tokio::spawn(async move {
            let mut s = c.read(req).await?.into_inner();
            let mut n = 0u64;
            while let Some(m) = s.message().await? {
                n += m.data.len() as u64;
            }
            Ok::<_, tonic::Status>(n)
        }));
    }
    let mut total = 0u64;
    let mut each = None;
    for task in tasks {
        let n = task.await?.context("Content.Read")?;
        if *each.get_or_insert(n) != n {
            bail!("Content.Read streams returned different sizes");
        }
        total += n;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "read bytes={total} streams={concurrency} secs={secs:.3} mbps={:.1}",
        total as f64 / secs / 1e6
    );
    Ok(())
}
