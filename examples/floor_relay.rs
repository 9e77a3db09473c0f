//! The benchmark floor: the cheapest possible user-space hop.
//!
//! A byte relay between two Unix sockets, one task per connection, 256 KiB
//! buffers each way. It does not parse HTTP/2 at all, so whatever it costs is
//! the price of one extra process on the path. `scripts/bench.sh` runs it next
//! to imgbridge and reports imgbridge's overhead against this one.
//!
//! Usage: `floor_relay <listen.sock> <upstream.sock>`
//!
//! `FLOOR_SNDBUF=<bytes>` (not set by bench.sh) gives both sockets that send
//! buffer, as imgbridge's splice asks for: to see how much of a difference
//! is the socket setting rather than the relay.

use std::path::PathBuf;
use std::sync::Arc;

use nix::sys::socket::{setsockopt, sockopt};
use tokio::net::{UnixListener, UnixStream};

const BUF: usize = 256 << 10;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: floor_relay <listen.sock> <upstream.sock>");
        std::process::exit(2);
    };
    let upstream = Arc::new(PathBuf::from(upstream));
    let sndbuf: Option<usize> = std::env::var("FLOOR_SNDBUF")
        .ok()
        .and_then(|v| v.parse().ok());
    let _ = std::fs::remove_file(&listen);
    let listener = UnixListener::bind(&listen)?;
    loop {
        let (mut down, _) = listener.accept().await?;
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let Ok(mut up) = UnixStream::connect(&*upstream).await else {
                return;
            };
            if let Some(n) = sndbuf {
                for s in [&down, &up] {
                    let _ = setsockopt(s, sockopt::SndBuf, &n);
                }
            }
            let _ = tokio::io::copy_bidirectional_with_sizes(&mut down, &mut up, BUF, BUF).await;
        });
    }
}
