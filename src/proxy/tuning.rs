//! HTTP/2 settings of both legs, in one place so benchmarks can compare them.
//!
//! Defaults mirror what grpc-go (containerd, ctr, kubelet) accepts, so that
//! the proxy imposes no limit the client would not hit directly: unlimited
//! concurrent streams, 16 MiB of metadata.

use hyper_util::rt::TokioExecutor;

/// Window and frame settings shared by the server and client legs.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    pub stream_window: u32,
    pub conn_window: u32,
    pub max_frame: u32,
    pub max_header_list: u32,
    pub max_send_buf: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            stream_window: 1 << 20,
            conn_window: 4 << 20,
            max_frame: 1 << 16,
            max_header_list: 16 << 20,
            max_send_buf: 1 << 20,
        }
    }
}

impl Tuning {
    pub fn server(&self, b: &mut hyper::server::conn::http2::Builder<TokioExecutor>) {
        b.max_concurrent_streams(None)
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
}
