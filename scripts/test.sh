#!/usr/bin/env bash
# Full local/CI check: formatting, clippy, and every test target.
#
# Must run as root: the integration tests start private containerd daemons
# (CRI pods, overlay mounts) and a loopback registry. Each daemon lives on
# sockets in its own temp dir; a system containerd (e.g. one the Debian
# package started on /run/containerd/containerd.sock) is never used, stopped
# or otherwise touched.
#
# IMGBRIDGE_SKIP_APT=1 skips apt when every needed tool is already present.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "scripts/test.sh: must run as root (tests start containerd and CRI pods)" >&2
    exit 1
fi

# Tools the harness needs: the binaries, plus a static busybox for test images.
needed_bins=(containerd ctr runc protoc skopeo umoci docker-registry)
missing=()
for bin in "${needed_bins[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
[[ -x /bin/busybox ]] || missing+=(/bin/busybox)

if [[ "${IMGBRIDGE_SKIP_APT:-0}" == "1" && ${#missing[@]} -eq 0 ]]; then
    echo "==> apt skipped (IMGBRIDGE_SKIP_APT=1, all tools present)"
else
    echo "==> installing test dependencies with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends \
        containerd runc protobuf-compiler skopeo umoci busybox-static \
        docker-registry ca-certificates
fi

if ! command -v cargo >/dev/null 2>&1; then
    if [[ -f "${HOME:-/root}/.cargo/env" ]]; then
        # shellcheck disable=SC1091
        source "${HOME:-/root}/.cargo/env"
    fi
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo not found (install rustup, or put cargo on PATH)" >&2
    exit 1
fi

# Never let a client default to the system containerd.
unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER

echo "==> cargo fmt --check"
cargo fmt --check

echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

echo "==> cargo test --all-targets -- --test-threads=2"
cargo test --all-targets -- --test-threads=2

# Builds the .deb, installs it with dpkg and verifies the units (CI machines
# are throwaway). IMGBRIDGE_SKIP_PACKAGING=1 skips it on a developer machine.
if [[ "${IMGBRIDGE_SKIP_PACKAGING:-0}" == "1" ]]; then
    echo "==> packaging test skipped (IMGBRIDGE_SKIP_PACKAGING=1)"
else
    echo "==> scripts/test-packaging.sh"
    scripts/test-packaging.sh
fi
