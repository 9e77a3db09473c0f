#!/usr/bin/env bash
# Soak run: tests/soak.rs (test `soak`) for SOAK_MINUTES against one
# containerd of the test matrix. Clients pull, push, import and run pods
# through imgbridge while faults are injected at random (seeded) moments:
# imgbridge and containerd killed or restarted, client connections reset,
# writes cut, the disk full. The test writes what it saw into SOAK_OUT
# (samples.tsv every 2 s, faults.tsv, calls.tsv, report.txt); this script
# then plots it into SOAK_OUT/soak.png (scripts/lib/soak-plot.sh) and prints
# the report. A benchmark-style run to look at, not a CI test: CI runs
# scripts/test.sh.
#
# Must run as root (the test starts containerd, CRI pods and a registry, as
# the integration tests do; a system containerd is never used or touched).
#
#   scripts/soak.sh
#
# Environment:
#   SOAK_MINUTES=60        how long the test drives load and faults
#   SOAK_SEED=N            seed of the faults and of the load (default: the
#                          epoch seconds now; printed, so a run can be
#                          repeated with SOAK_SEED=N)
#   SOAK_CONTAINERD=2.4    label of scripts/containerd-matrix.sh (1.6 1.7 2.1 2.4)
#   SOAK_OUT=DIR           the run's dir (default target/soak/<UTC timestamp>);
#                          must not hold a run already
#   IMGBRIDGE_CACHE, IMGBRIDGE_SKIP_PEERS, CARGO_TARGET_DIR  as for
#                          scripts/test.sh
#
# Installs what is missing with apt (scripts/test.sh's package list when one
# of the harness's tools is missing, gnuplot-nox when gnuplot is), takes
# containerd from scripts/containerd-matrix.sh and the client peers from
# scripts/peers.sh (both cached), builds the test binary with cargo and runs
# it with its output in SOAK_OUT/run.log. The plot is drawn even when the test
# failed or was interrupted (Ctrl-C); the exit status is the test's.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "scripts/soak.sh: must run as root (the test starts containerd and CRI pods)" >&2
    exit 1
fi
die() { echo "scripts/soak.sh: $*" >&2; exit 1; }

# ---------------------------------------------------------------- settings
SOAK_MINUTES="${SOAK_MINUTES:-60}"
SOAK_SEED="${SOAK_SEED:-$(date +%s)}"
SOAK_CONTAINERD="${SOAK_CONTAINERD:-2.4}"
[[ "$SOAK_MINUTES" =~ ^[0-9]+([.][0-9]+)?$ && ! "$SOAK_MINUTES" =~ ^0+([.]0+)?$ ]] ||
    die "SOAK_MINUTES must be a positive number of minutes, not '$SOAK_MINUTES'"
[[ "$SOAK_SEED" =~ ^[0-9]+$ ]] || die "SOAK_SEED must be a non-negative integer, not '$SOAK_SEED'"
# SOAK_OUT relative to where the script was called from; the default under
# the target dir.
target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
[[ "$target_dir" == /* ]] || target_dir="$repo_root/$target_dir"
SOAK_OUT="${SOAK_OUT:-$target_dir/soak/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$SOAK_OUT"
SOAK_OUT="$(cd "$SOAK_OUT" && pwd)"
[[ ! -e "$SOAK_OUT/samples.tsv" && ! -e "$SOAK_OUT/run.log" ]] ||
    die "$SOAK_OUT already holds a run (choose another SOAK_OUT)"
cd "$repo_root"

run_start=$SECONDS
echo "==> soak: $SOAK_MINUTES min, seed $SOAK_SEED, containerd $SOAK_CONTAINERD"
echo "    repeat with: SOAK_SEED=$SOAK_SEED SOAK_MINUTES=$SOAK_MINUTES SOAK_CONTAINERD=$SOAK_CONTAINERD scripts/soak.sh"
echo "    output: $SOAK_OUT"

# -------------------------------------------------------------------- apt
# What scripts/test.sh's harness needs (the same package list), and gnuplot
# for the plot.
missing=()
for bin in containerd ctr runc protoc skopeo umoci docker-registry ip nsenter unshare curl make gcc jq openssl; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
[[ -x /bin/busybox ]] || missing+=(/bin/busybox)
[[ -x /usr/lib/cni/loopback ]] || missing+=(/usr/lib/cni/loopback)
packages=()
if ((${#missing[@]})); then
    echo "==> missing: ${missing[*]}"
    packages+=(containerd runc protobuf-compiler skopeo umoci busybox-static
        docker-registry ca-certificates iproute2 util-linux curl make gcc libc6-dev
        yq jq musl-tools file binutils debootstrap systemd-container
        openssl containernetworking-plugins)
fi
command -v gnuplot >/dev/null 2>&1 || packages+=(gnuplot-nox)
if ((${#packages[@]})); then
    echo "==> installing with apt: ${packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${packages[@]}"
fi

if ! command -v cargo >/dev/null 2>&1 && [[ -f "${HOME:-/root}/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    source "${HOME:-/root}/.cargo/env"
fi
command -v cargo >/dev/null 2>&1 || die "cargo not found (install rustup, or put cargo on PATH)"

# Never let a client default to the system containerd.
unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER

# ------------------------------------------------- containerd and the peers
echo "==> scripts/containerd-matrix.sh fetch $SOAK_CONTAINERD"
ctd_line="$(scripts/containerd-matrix.sh fetch "$SOAK_CONTAINERD")"
read -r ctd_label ctd_version ctd_bindir <<<"$ctd_line"
[[ "$ctd_label" == "$SOAK_CONTAINERD" && -x "$ctd_bindir/containerd" ]] ||
    die "scripts/containerd-matrix.sh gave no containerd for $SOAK_CONTAINERD: '$ctd_line'"
echo "    containerd $ctd_version ($ctd_label): $ctd_bindir"
# Fetched here rather than on the test's first use, so a cold build (minutes)
# is not part of the soak's time. The test fetches the same (cached) again.
if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" == "1" ]]; then
    echo "==> peers skipped (IMGBRIDGE_SKIP_PEERS=1: the test skips the clients that need them)"
else
    echo "==> scripts/peers.sh fetch buildkit nerdctl crane crictl"
    scripts/peers.sh fetch buildkit nerdctl crane crictl >"$SOAK_OUT/peers.txt"
    sed 's/^/    peer /' "$SOAK_OUT/peers.txt"
fi

# --------------------------------------------------------------- the build
echo "==> cargo test --no-run --test soak"
exe="$(cargo test --no-run --test soak --message-format=json-render-diagnostics |
    jq -r 'select(.reason == "compiler-artifact" and .profile.test == true and .target.kind == ["test"]) | .executable')"
[[ -n "$exe" && "$exe" != *$'\n'* && -x "$exe" ]] || die "no single soak test binary built (got: '$exe')"
echo "    $exe"

# What the plot's title and a later look need to know about this run.
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD 2>/dev/null || commit+="+dirty"
cat >"$SOAK_OUT/soak-run.txt" <<EOF
seed=$SOAK_SEED
minutes=$SOAK_MINUTES
containerd=$ctd_version ($ctd_label)
commit=$commit
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
test_binary=$exe
EOF

# ----------------------------------------------------------------- the run
# Ctrl-C reaches the test (same process group) and ends it; this script
# goes on to plot what was written so far.
echo "==> the soak test ($SOAK_MINUTES min), log: $SOAK_OUT/run.log"
interrupted=0
trap 'interrupted=1' INT
set +e
IMGBRIDGE_CONTAINERD="$ctd_bindir" SOAK_MINUTES="$SOAK_MINUTES" SOAK_SEED="$SOAK_SEED" \
    SOAK_OUT="$SOAK_OUT" "$exe" --exact soak --nocapture --test-threads=1 2>&1 |
    (trap '' INT; exec tee "$SOAK_OUT/run.log") # tee keeps the test's last words
rc=${PIPESTATUS[0]}
set -e
trap - INT
if ((interrupted)) && ((rc == 0)); then rc=130; fi
echo "finished=$(date -u +%Y-%m-%dT%H:%M:%SZ) exit=$rc" >>"$SOAK_OUT/soak-run.txt"

# ---------------------------------------------------------------- the plot
png=""
if [[ -s "$SOAK_OUT/samples.tsv" ]]; then
    echo "==> scripts/lib/soak-plot.sh $SOAK_OUT"
    if scripts/lib/soak-plot.sh "$SOAK_OUT" >/dev/null; then
        png="$SOAK_OUT/soak.png"
    else
        echo "scripts/soak.sh: the plot failed (messages above)" >&2
    fi
else
    echo "==> no plot: the test wrote no $SOAK_OUT/samples.tsv"
fi

if [[ -f "$SOAK_OUT/report.txt" ]]; then
    echo "==> report ($SOAK_OUT/report.txt)"
    cat "$SOAK_OUT/report.txt"
fi
echo "==> soak: exit $rc$( ((interrupted)) && echo ' (interrupted)'), seed $SOAK_SEED, containerd $ctd_version, $((SECONDS - run_start)) s in all"
echo "    run dir: $SOAK_OUT"
[[ -z "$png" ]] || echo "    plot:    $png"
exit "$rc"
