//! Shared integration-test harness: private containerd daemons, a loopback
//! registry, offline-built test images, the imgbridge launcher, `ctr`
//! wrappers and async containerd / CRI gRPC helpers.
//!
//! Use it from a test binary with `mod common;`.
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
//! Nothing sleeps as a way of waiting: everything polls a condition with short
//! sleeps until a deadline ([`poll`], [`poll_async`]) and panics with the tail
//! of the relevant daemon log when the deadline passes.

#![allow(dead_code)]

pub mod front;
pub mod kubelet;
pub mod peers;
pub mod project;

mod bridge;
mod containerd;
mod cri;
mod ctr;
mod daemon;
mod flavor;
mod grpc;
mod images;
pub mod netns;
mod registry;
mod scenario;
mod shims;
mod util;

// One re-export for all: a test binary that uses nothing of one module
// (ops.rs, import.rs) would otherwise warn about that module's line.
#[allow(unused_imports)]
pub use self::{
    bridge::*, containerd::*, cri::*, ctr::*, flavor::*, grpc::*, images::*, registry::*,
    scenario::*, util::*,
};
// Internal to the harness: the daemon registry and the shim sweep.
use self::{daemon::*, shims::*};
