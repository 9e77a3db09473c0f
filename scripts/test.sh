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

# Disk: a run writes about 5 GiB (target/, then a few hundred MiB of
# images under TMPDIR at a time); a fresh machine adds about 9 GiB of Go
# module and build caches for the peers (docs/testing.md, "Disk"). Checked
# first, so a full disk is one clear line rather than thirty failing tests
# half an hour in.
cache="${IMGBRIDGE_CACHE:-/var/cache/imgbridge-test}"
if compgen -G "$cache/peers/kubelet-*" >/dev/null; then need_gib=6; else need_gib=16; fi
need_gib="${IMGBRIDGE_NEED_DISK_GIB:-$need_gib}"
for dir in "$repo_root" "${TMPDIR:-/tmp}"; do
    free_gib=$(( $(df -Pk "$dir" | awk 'NR == 2 {print $4}') / 1048576 ))
    if (( free_gib < need_gib )); then
        echo "scripts/test.sh: only ${free_gib} GiB free under $dir; a run needs about ${need_gib} GiB (free some space, or set IMGBRIDGE_NEED_DISK_GIB if you know better)" >&2
        exit 1
    fi
done
# One clean build per run: incremental state would double target/ and CI
# never reuses it.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Tools the harness needs: the binaries, plus a static busybox for test images.
# ip/nsenter/curl: the multi-node test's network namespaces and spegel's
# readiness; unshare: kubelet's own mount namespace; make/gcc: jemalloc is
# built from source.
needed_bins=(containerd ctr runc protoc skopeo umoci docker-registry ip nsenter unshare curl make gcc)
missing=()
for bin in "${needed_bins[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
[[ -x /bin/busybox ]] || missing+=(/bin/busybox)
# yq/jq: the chart test; musl-gcc/file/objcopy: the static release binary.
for bin in yq jq musl-gcc file objcopy; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done

if [[ "${IMGBRIDGE_SKIP_APT:-0}" == "1" && ${#missing[@]} -eq 0 ]]; then
    echo "==> apt skipped (IMGBRIDGE_SKIP_APT=1, all tools present)"
else
    echo "==> installing test dependencies with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends \
        containerd runc protobuf-compiler skopeo umoci busybox-static \
        docker-registry ca-certificates iproute2 util-linux curl make gcc libc6-dev \
        yq jq musl-tools file binutils
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

# --all / --workspace: the test harness (tests/support) is a crate of its own.
echo "==> cargo fmt --all --check"
cargo fmt --all --check

echo "==> cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

echo "==> scripts/module-graph.py (no import cycle in src/)"
scripts/module-graph.py

echo "==> cargo test --lib --bins (unit tests, once)"
cargo test --lib --bins -- --test-threads=2

# The Helm chart: helm lint and helm template for every runtime preset, each
# rendered config.toml loaded by the debug binary (built here, as the
# integration tests below need it anyway), the static-pod rendering. helm
# is a pinned Go peer (tests/peers/helm), built once into the peers' cache.
stage_start=$SECONDS
echo "==> chart: scripts/test-chart.sh"
cargo build --bin imgbridge
scripts/test-chart.sh target/debug/imgbridge
echo "    (chart checked in $((SECONDS - stage_start)) s)"

# The integration tests run once per containerd of the version matrix:
# Debian bookworm's 1.6 (the system package), trixie's 1.7, sid's 2.1 and the
# newest 2.x from the Go module proxy. scripts/containerd-matrix.sh fetches or
# builds each into a cache outside the repo. IMGBRIDGE_MATRIX="2.4" (labels,
# space-separated) runs a subset.
matrix="${IMGBRIDGE_MATRIX:-1.6 1.7 2.1 2.4}"
echo "==> containerd matrix: $matrix"
echo "    pinned Go peers (tests/peers/*/go.mod):"
scripts/containerd-matrix.sh versions | sed 's/^/      /'
stage_start=$SECONDS
# shellcheck disable=SC2086
scripts/containerd-matrix.sh fetch $matrix > target/containerd-matrix.txt
cat target/containerd-matrix.txt
echo "    (containerd matrix ready in $((SECONDS - stage_start)) s)"
# The one containerd config generator (the harness's, try.sh's, the bench
# scripts'): every kind of config it writes loads on every version.
echo "==> scripts/lib/containerd-config-check.sh"
# shellcheck disable=SC2086
scripts/lib/containerd-config-check.sh $matrix

# The real clients (buildkitd, buildctl, nerdctl, crictl, spegel, kubelet,
# crane, oras) and the OCI distribution-spec conformance suite (tests/registry.rs
# runs it against the registry endpoint), built once into their cache; the
# tests that need them use the same builds (kubelet: about 11 min cold on two
# busy cores, under a second warm; crane and conformance: about 1 min cold).
# IMGBRIDGE_SKIP_PEERS=1 skips both the builds and those tests (a quick
# local loop only: CI never sets it).
if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" == "1" ]]; then
    echo "==> peers skipped (IMGBRIDGE_SKIP_PEERS=1): the buildkit, nerdctl, crictl, spegel (multinode), kubelet, crane, oras and conformance (registry) tests will not run"
else
    stage_start=$SECONDS
    echo "==> peers: scripts/peers.sh fetch"
    scripts/peers.sh fetch
    echo "    (peers ready in $((SECONDS - stage_start)) s)"
fi

# The static binary the release ships (musl, scripts/build-static.sh): the
# DaemonSet test (tests/daemonset.rs) runs it in the project's own image as
# the chart's pod under the real kubelet. The same build is release.sh's,
# so the packaging test below reuses it.
if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" != "1" ]]; then
    stage_start=$SECONDS
    echo "==> static binary: scripts/build-static.sh x86_64"
    IMGBRIDGE_STATIC_BINARY="$(scripts/build-static.sh x86_64 | awk '$1 == "x86_64" {print $2}')"
    [[ -x "$IMGBRIDGE_STATIC_BINARY" ]] || { echo "scripts/test.sh: no static binary" >&2; exit 1; }
    export IMGBRIDGE_STATIC_BINARY
    echo "    (static binary ready in $((SECONDS - stage_start)) s)"
fi

summary=()
failed=0
# Test binaries run on 1.6 and 2.4 only (see the loop).
broad_only="daemonset hostile breaker harness"
while read -r label version bindir; do
    log="target/test-containerd-$label.log"
    stage_start=$SECONDS
    echo "==> integration tests against containerd $version ($label)"
    set +e
    # Tests of imgbridge itself rather than of a containerd fact (its
    # packaging under kubelet, input validation, fault injection, the
    # harness, the registry's idle-session limits) run on the oldest and
    # newest containerd only, to keep CI within its time (docs/testing.md).
    targets=(--test '*')
    skip=()
    case "$label" in
        1.6 | 2.4) ;;
        *)
            targets=()
            for t in tests/*.rs; do
                t="$(basename "$t" .rs)"
                [[ " $broad_only " == *" $t "* ]] || targets+=(--test "$t")
            done
            skip=(--skip idle_upload_sessions_)
            ;;
    esac
    IMGBRIDGE_CONTAINERD="$bindir" cargo test "${targets[@]}" --no-fail-fast -- --test-threads=2 "${skip[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    passed=$(grep -Eo '^test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
    nfail=$(grep -E '^test result:' "$log" | grep -Eo '[0-9]+ failed' | awk '{s += $1} END {print s + 0}')
    if [[ $rc -ne 0 && $nfail -eq 0 ]]; then
        nfail="build or harness error (exit $rc)"
    fi
    summary+=("containerd $version: $passed passed, $nfail failed ($((SECONDS - stage_start)) s)")
    [[ $rc -eq 0 ]] || failed=1
done < target/containerd-matrix.txt

echo "==> summary"
printf '%s\n' "${summary[@]}"
if [[ $failed -ne 0 ]]; then
    echo "scripts/test.sh: integration tests failed on at least one containerd version" >&2
    exit 1
fi

# scripts/release.sh (static binary, tarball, .deb, OCI image, chart, SBOM),
# run twice (the same bytes), then every artefact checked: the binary in an
# empty root, the image imported and run, the .deb installed with dpkg (CI
# machines are throwaway). IMGBRIDGE_SKIP_PACKAGING=1
# skips it on a developer machine.
if [[ "${IMGBRIDGE_SKIP_PACKAGING:-0}" == "1" ]]; then
    echo "==> packaging test skipped (IMGBRIDGE_SKIP_PACKAGING=1)"
else
    echo "==> scripts/test-packaging.sh"
    stage_start=$SECONDS
    scripts/test-packaging.sh
    echo "    (packaging checked in $((SECONDS - stage_start)) s)"
fi
