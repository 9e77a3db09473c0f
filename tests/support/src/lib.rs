//! imgbridge's integration-test harness: private containerd daemons, a
//! loopback registry, offline-built test images, the imgbridge launcher,
//! `ctr` wrappers, async containerd / CRI gRPC helpers and the real clients
//! (buildkit, nerdctl, crictl, kubelet, spegel) and a control plane.
//!
//! A crate of its own (as h2's `tests/h2-support`), a dev-dependency of
//! imgbridge: built once rather than into every test binary, and what a
//! test binary does not use is not dead code. A test starts with
//!
//! ```ignore
//! use imgbridge_test_support::prelude::*;
//! ```
//!
//! for what nearly every test uses ([`prelude`]), and names the rest by
//! path (`imgbridge_test_support::kubelet::Kubelet`,
//! `imgbridge_test_support::grpc::content_client`).
//!
//! # Process hygiene
//!
//! * Every daemon (containerd, docker-registry, imgbridge) is spawned from a
//!   single long-lived "spawner" thread with `PR_SET_PDEATHSIG = SIGKILL`.
//!   (The death signal fires when the *thread* that forked the child exits;
//!   spawning from short-lived test threads would kill a daemon as soon as the
//!   test thread that started it ends.)
//! * Every daemon pid is recorded in a global registry until it is reaped. A
//!   `libc::atexit` handler (registered once) SIGKILLs and reaps whatever is
//!   still registered, kills the containerd shims of registered containerds,
//!   unmounts leftovers and removes the per-process scratch directory, so
//!   nothing survives even when statics are never dropped.
//! * Each daemon struct stops its own process on `Drop` (SIGTERM, wait with a
//!   deadline, then SIGKILL) and unregisters it. `Containerd`'s `Drop`
//!   additionally kills the runc shims (and their container processes) that it
//!   started for *its* socket, and detaches mounts under its temp dir.
//! * Only processes started here (or by a containerd started here, identified
//!   by `-address <our socket>` on the shim command line) are ever signalled.
//!
//! All temporary files live under one per-process scratch dir
//! (`$TMPDIR/imgbridge-test-<pid>-XXXXXX`; dirs of SIGKILLed test processes are
//! swept when the next test process starts). Set `IMGBRIDGE_TEST_KEEP=1` to keep it
//! for post-mortem inspection (its path is printed once).
//!
//! # Waiting
//!
//! Nothing sleeps as a way of waiting: everything polls a condition with
//! short sleeps until a deadline ([`util::poll`], [`util::poll_async`]) and
//! panics with the tail of the relevant daemon log when the deadline passes.

pub mod bridge;
pub mod chart;
pub mod cluster;
pub mod containerd;
pub mod cri;
pub mod ctr;
pub mod flavor;
pub mod front;
pub mod grpc;
pub mod images;
pub mod kubelet;
pub mod netns;
pub mod peers;
pub mod project;
pub mod registry;
pub mod repo;
pub mod scenario;
pub mod util;

// Internal to the harness: the daemon registry and the shim sweep.
mod daemon;
mod shims;

/// What nearly every test uses, by name (a test binary starts with
/// `use imgbridge_test_support::prelude::*;`). The rest is named by path.
pub mod prelude {
    pub use crate::bridge::Imgbridge;
    pub use crate::containerd::{Containerd, ContainerdOpts};
    pub use crate::cri::{cri_image_status, run_pod};
    pub use crate::ctr::{ctr, ctr_ok};
    pub use crate::flavor::flavor;
    pub use crate::grpc::{
        containerd_channel, create_image_req, get_image, image_target, images_client,
        sha256_digest, with_ns,
    };
    pub use crate::images::{hello_text, TestImage};
    pub use crate::registry::Registry;
    pub use crate::scenario::{ctr_import, Scenario};
    pub use crate::util::{free_port, http_get, poll, poll_async, tempdir, unique_name};
}
