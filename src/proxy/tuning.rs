//! HTTP/2, socket and threading settings, in one place so benchmarks can
//! compare them (`scripts/bench.sh`, README "Performance"). The HTTP/2 ones
//! apply to hyper's legs, which serve clients that connected while
//! containerd was down; the splice negotiates nothing of its own.
//!
//! Defaults mirror what grpc-go (containerd, ctr, kubelet) accepts, so that
//! the proxy imposes no limit the client would not hit directly: unlimited
//! concurrent streams, 16 MiB of metadata.

use hyper_util::rt::TokioExecutor;

use super::io::{Coalesce, FlushMode};

/// Settings shared by the server (client-facing) and client (containerd) legs.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    pub stream_window: u32,
    pub conn_window: u32,
    pub max_frame: u32,
    pub max_header_list: u32,
    pub max_send_buf: usize,
    /// Read and write buffer of each socket, see [`Coalesce`]; 0 = none.
    pub io_buf: usize,
    /// Threads serving connections, each a single-threaded runtime that owns
    /// its connections outright; 0 = one per CPU.
    pub shards: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            stream_window: 1 << 20,
            conn_window: 4 << 20,
            max_frame: 1 << 16,
            max_header_list: 16 << 20,
            max_send_buf: 1 << 20,
            io_buf: 256 << 10,
            shards: 0,
        }
    }
}

impl Tuning {
    pub fn server(&self, b: &mut hyper::server::conn::http2::Builder<TokioExecutor>) {
        b.max_concurrent_streams(None)
            // Relay containerd's headers as they are: hyper would add `date`.
            .auto_date_header(false)
            .max_header_list_size(self.max_header_list)
            .initial_stream_window_size(self.stream_window)
            .initial_connection_window_size(self.conn_window)
            .max_frame_size(self.max_frame)
            .max_send_buf_size(self.max_send_buf);
    }

    pub fn client(&self, b: &mut hyper::client::conn::http2::Builder<TokioExecutor>) {
        b.max_header_list_size(self.max_header_list)
            .initial_stream_window_size(self.stream_window)
            .initial_connection_window_size(self.conn_window)
            .max_frame_size(self.max_frame)
            .max_send_buf_size(self.max_send_buf)
            .initial_max_send_streams(usize::MAX >> 1);
    }

    /// The client's socket. Replies go out as soon as they are ready.
    pub fn server_io<T>(&self, io: T) -> Coalesce<T> {
        Coalesce::new(io, self.io_buf, self.io_buf, FlushMode::Immediate)
    }

    /// containerd's socket. A request's HEADERS and DATA leave in one write
    /// (hyper queues them from two tasks), and the PING ack containerd asks
    /// for with every reply waits until the reply has been relayed.
    pub fn client_io<T>(&self, io: T) -> Coalesce<T> {
        Coalesce::new(io, self.io_buf, self.io_buf, FlushMode::EndOfTick)
    }

    /// Number of connection threads.
    pub fn shard_count(&self) -> usize {
        match self.shards {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}
