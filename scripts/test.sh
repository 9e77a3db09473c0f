#!/usr/bin/env bash
# Full local/CI check: formatting, clippy, and every test target.
#
# Must run as root: the integration tests start private containerd daemons
# (CRI pods, overlay mounts) and a loopback registry. Each daemon lives on
# sockets in its own temp dir; a system containerd (e.g. one the Debian
# package started on /run/containerd/containerd.sock) is never used, stopped
# or otherwise touched.
#
# Two lanes run side by side, as they need different toolchains: the Go lane
# (the containerds of the matrix, the Go peers, the pinned cargo tools of
# the packaging test) in the background, the cargo lane (fmt, clippy, unit
# tests, the test binaries, the one static release binary) in front. The
# integration tests then run two test binaries at a time (docs/testing.md,
# "CI time"). The run ends with a table of each stage's seconds and which
# caches were cold.
#
# Environment:
#   IMGBRIDGE_SKIP_APT=1      skip apt when every needed tool is present
#   IMGBRIDGE_MATRIX="2.4"    containerd labels to test (default all four)
#   IMGBRIDGE_JOBS=N          test binaries run at a time (default 2)
#   IMGBRIDGE_TESTS="a b"     only these integration test binaries (a local loop)
#   IMGBRIDGE_COLD=1          every cache outside the checkout empty: Go build
#                             and module caches, peers, containerds, cargo
#                             home, cargo tools, all in a fresh dir that is
#                             removed at the end (IMGBRIDGE_COLD=DIR keeps
#                             them in DIR). With a fresh clone (no target/)
#                             this is a fresh machine's run.
#   IMGBRIDGE_SKIP_PEERS=1, IMGBRIDGE_SKIP_PACKAGING=1  quick local loops only
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "scripts/test.sh: must run as root (tests start containerd and CRI pods)" >&2
    exit 1
fi

# ------------------------------------------------------------ stage timing
run_start=$SECONDS
stage_names=()
stage_secs=()
stage_done() { # name start
    stage_names+=("$1")
    stage_secs+=("$((SECONDS - $2))")
    echo "    ($1: $((SECONDS - $2)) s)"
}
cache_notes=()
timing_table() {
    local i
    echo "==> timing (seconds)"
    for i in "${!stage_names[@]}"; do
        printf '    %-44s %6s\n' "${stage_names[$i]}" "${stage_secs[$i]}"
    done
    printf '    %-44s %6s\n' "whole run" "$((SECONDS - run_start))"
    echo "    caches at the start: ${cache_notes[*]}"
}

# --------------------------------------------------------------- the caches
if [[ -n "${IMGBRIDGE_COLD:-}" ]]; then
    if [[ "$IMGBRIDGE_COLD" == 1 ]]; then
        cold_root="$(mktemp -d "${TMPDIR:-/var/tmp}/imgbridge-cold.XXXXXX")"
        cold_keep=0
    else
        cold_root="$IMGBRIDGE_COLD"
        mkdir -p "$cold_root"
        cold_keep=1
    fi
    export GOCACHE="$cold_root/go-build" GOMODCACHE="$cold_root/go-mod" \
        IMGBRIDGE_CACHE="$cold_root/cache" CARGO_HOME="$cold_root/cargo-home" \
        IMGBRIDGE_TOOLS="$cold_root/tools"
    mkdir -p "$CARGO_HOME"
    # cargo itself (rustup's proxy) keeps coming from PATH.
    echo "==> cold run: every cache under $cold_root"
    [[ ! -d target ]] || echo "    (target/ exists: the cargo builds are not cold; use a fresh clone)"
fi
cache="${IMGBRIDGE_CACHE:-/var/cache/imgbridge-test}"
tools="${IMGBRIDGE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/imgbridge-tools}"
go_env() { if command -v go >/dev/null 2>&1; then go env "$1"; fi; }
warm_if() { # label test...
    local label="$1"
    shift
    if "$@"; then cache_notes+=("$label warm"); else cache_notes+=("$label COLD"); fi
}
warm_if "go-build" test -e "$(go_env GOCACHE)/trim.txt"
warm_if "go-modules" test -d "$(go_env GOMODCACHE)/cache/download"
warm_if "peers" compgen -G "$cache/peers/kubelet-*/bin/kubelet"
warm_if "containerds" compgen -G "$cache/containerd/v2.*-*/bin/containerd"
warm_if "cargo-registry" test -d "${CARGO_HOME:-$HOME/.cargo}/registry/cache"
warm_if "cargo-target" test -d "${CARGO_TARGET_DIR:-target}/debug/deps"
warm_if "cargo-tools" compgen -G "$tools/cargo-deb-*/bin/cargo-deb"
warm_if "debian-roots" test -d "$cache/debian-root/bookworm" -a -d "$cache/debian-root/bookworm-openrc"

# Disk: a run writes about 5 GiB (target/, then a few hundred MiB of
# images under TMPDIR at a time); a fresh machine adds about 9 GiB of Go
# module and build caches for the peers (docs/testing.md, "Disk"). Checked
# first, so a full disk is one clear line rather than thirty failing tests
# half an hour in.
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
stage_start=$SECONDS
needed_bins=(containerd ctr runc protoc skopeo umoci docker-registry ip nsenter unshare curl make gcc)
missing=()
for bin in "${needed_bins[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
[[ -x /bin/busybox ]] || missing+=(/bin/busybox)
# yq/jq: the chart test; musl-gcc/file/objcopy: the static release binary.
# debootstrap/systemd-nspawn: the systemd stage's Debian root.
for bin in yq jq musl-gcc file objcopy debootstrap systemd-nspawn; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
# openssl: the control plane's certificates; the CNI loopback plugin: its
# node's network (tests/support/src/cluster.rs).
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[[ -x /usr/lib/cni/loopback ]] || missing+=(/usr/lib/cni/loopback)

if [[ "${IMGBRIDGE_SKIP_APT:-0}" == "1" && ${#missing[@]} -eq 0 ]]; then
    echo "==> apt skipped (IMGBRIDGE_SKIP_APT=1, all tools present)"
else
    echo "==> installing test dependencies with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends \
        containerd runc protobuf-compiler skopeo umoci busybox-static \
        docker-registry ca-certificates iproute2 util-linux curl make gcc libc6-dev \
        yq jq musl-tools file binutils debootstrap systemd-container \
        openssl containernetworking-plugins
fi
stage_done "apt" "$stage_start"

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

target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
mkdir -p "$target_dir"
out="$target_dir/test-run"
rm -rf "$out"
mkdir -p "$out"

# Background jobs die with the run; the table is printed however it ends.
go_pid=""
root_pid=""
kill_tree() { # PID: it and every descendant, children first
    local c
    for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
    kill "$1" 2>/dev/null || true
}
finish() {
    local rc=$?
    # The lanes' whole trees (go build, debootstrap), not just their shells:
    # they would go on writing into the caches being removed.
    [[ -z "$go_pid" ]] || kill_tree "$go_pid"
    [[ -z "$root_pid" ]] || kill_tree "$root_pid"
    [[ -z "${static_pid:-}" ]] || kill_tree "$static_pid"
    timing_table
    if [[ -n "${cold_root:-}" && "${cold_keep:-1}" == 0 ]]; then
        chmod -R u+w "$cold_root" 2>/dev/null || true # Go's module cache is read-only
        rm -rf "$cold_root"
    fi
    exit "$rc"
}
trap finish EXIT

# ------------------------------------------------------------------ Go lane
# The containerds of the matrix (Debian's by apt download, 2.4 by go build),
# the real clients (buildkitd, buildctl, nerdctl, crictl, spegel, kubelet
# and the control plane, etcd, crane, oras, helm, ko and the OCI
# conformance suite) and the pinned cargo
# tools the packaging test needs, each built once into its cache (warm: a
# few seconds). IMGBRIDGE_SKIP_PEERS=1 skips the peers and the tests that
# need them (a quick local loop only: CI never sets it).
matrix="${IMGBRIDGE_MATRIX:-1.6 1.7 2.1 2.4}"
echo "==> containerd matrix: $matrix"
echo "    pinned Go peers (tests/peers/*/go.mod):"
scripts/containerd-matrix.sh versions | sed 's/^/      /'
go_lane() {
    local s=$SECONDS
    # shellcheck disable=SC2086
    scripts/containerd-matrix.sh fetch $matrix >"$out/containerd-matrix.txt"
    printf 'Go lane: containerds of the matrix\t%s\n' "$((SECONDS - s))" >>"$out/go-lane.times"
    if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" != "1" ]]; then
        s=$SECONDS
        # helm first: the chart stage needs only it. kubelet and the
        # control plane (the longest build) last: the tests that do not
        # need them start meanwhile (go-early.ok).
        scripts/peers.sh fetch helm buildkit nerdctl crictl spegel etcd crane conformance oras ko >"$out/peers.txt"
        printf 'Go lane: peers but kubelet\t%s\n' "$((SECONDS - s))" >>"$out/go-lane.times"
        touch "$out/go-early.ok"
        s=$SECONDS
        scripts/peers.sh fetch kubelet >>"$out/peers.txt"
        printf 'Go lane: kubelet and the control plane\t%s\n' "$((SECONDS - s))" >>"$out/go-lane.times"
    fi
    touch "$out/go-early.ok" "$out/go-kubelet.ok"
    if [[ "${IMGBRIDGE_SKIP_PACKAGING:-0}" != "1" ]]; then
        s=$SECONDS
        scripts/lib/cargo-tools.sh fetch >/dev/null
        printf 'Go lane: cargo tools (cargo install)\t%s\n' "$((SECONDS - s))" >>"$out/go-lane.times"
    fi
}
go_start=$SECONDS
echo "==> Go lane (background, log: $out/go-lane.log): containerds, peers, cargo tools"
go_lane >"$out/go-lane.log" 2>&1 &
go_pid=$!
# The systemd stage's Debian root (debootstrap: network and disk, hardly
# any CPU), cached like the peers, in a lane of its own: it is waited for
# only by the systemd stage, at the end.
root_pid=""
if [[ "${IMGBRIDGE_SKIP_PACKAGING:-0}" != "1" ]]; then
    (s=$SECONDS; scripts/test-systemd.sh --prepare-root && scripts/test-openrc.sh --prepare-root &&
        echo "debian roots (systemd, OpenRC): $((SECONDS - s)) s") \
        >"$out/debian-root.log" 2>&1 &
    root_pid=$!
fi

# --------------------------------------------------------------- cargo lane
# --all / --workspace: the test harness (tests/support) is a crate of its own.
stage_start=$SECONDS
echo "==> cargo fmt --all --check"
cargo fmt --all --check
echo "==> cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "==> scripts/module-graph.py (no import cycle in src/)"
scripts/module-graph.py
stage_done "fmt, clippy, module graph" "$stage_start"

stage_start=$SECONDS
echo "==> cargo test --lib --bins (unit tests, once)"
cargo test --lib --bins -- --test-threads=2
stage_done "unit tests (build and run)" "$stage_start"

# The integration test binaries, built once; run below by path, two at a
# time, against every containerd (cargo test would hold the target dir's
# lock while they run).
stage_start=$SECONDS
echo "==> cargo test --no-run --test '*' (the integration test binaries)"
cargo test --no-run --test '*' --message-format=json-render-diagnostics |
    jq -r 'select(.reason == "compiler-artifact" and .profile.test == true and .target.kind == ["test"]) | "\(.target.name) \(.executable)"' \
        >"$out/test-binaries.txt"
[[ -s "$out/test-binaries.txt" ]] || { echo "scripts/test.sh: no integration test binary built" >&2; exit 1; }
stage_done "integration test binaries (build)" "$stage_start"

# The one release build: the static binary (musl, scripts/build-static.sh)
# that the DaemonSet and cluster tests run in the project's image under the
# real kubelet, and that release.sh, the .deb and the image of the packaging
# test take as they are (cargo finds it fresh). Only those need it, so it
# builds in a lane of its own beside the first integration tests (about
# 11 minutes of the cargo lane before: docs/testing.md, "CI time").
needs_static="daemonset cluster"
static_wanted=""
for n in $needs_static; do
    if [[ -z "${IMGBRIDGE_TESTS:-}" || " $IMGBRIDGE_TESTS " == *" $n "* ]]; then static_wanted=1; fi
done
static_pid=""
if [[ ("${IMGBRIDGE_SKIP_PEERS:-0}" != "1" && -n "$static_wanted") || "${IMGBRIDGE_SKIP_PACKAGING:-0}" != "1" ]]; then
    echo "==> static binary (background, log: $out/static.log): scripts/build-static.sh x86_64"
    # static.times, written last, is the lane's "done" marker.
    (s=$SECONDS; scripts/build-static.sh x86_64 >"$out/static.txt" &&
        printf 'static binary (musl, beside the tests)\t%s\n' "$((SECONDS - s))" >"$out/static.times") \
        >"$out/static.log" 2>&1 &
    static_pid=$!
fi
cargo_lane_secs=$((SECONDS - go_start))

# Waits until the Go lane wrote marker $1 (true) or ended without it (its
# log printed; false).
go_lane_reached() {
    while [[ ! -e "$out/$1" ]]; do
        if ! kill -0 "$go_pid" 2>/dev/null; then
            [[ -e "$out/$1" ]] && return 0
            cat "$out/go-lane.log"
            echo "scripts/test.sh: the Go lane ended before $1 (log above)" >&2
            return 1
        fi
        sleep 1
    done
}
# A lane's "stage<TAB>seconds" lines, if it wrote them, into the table.
lane_times() { # file
    [[ -f "$1" ]] || return 0
    local what secs
    while IFS=$'\t' read -r what secs; do
        stage_names+=("$what")
        stage_secs+=("$secs")
    done <"$1"
}
# The Go lane's end: its log and timings.
go_lane_end() {
    local go_rc
    set +e
    wait "$go_pid"
    go_rc=$?
    set -e
    go_pid=""
    cat "$out/go-lane.log"
    lane_times "$out/go-lane.times"
    [[ $go_rc -eq 0 ]] || { echo "scripts/test.sh: the Go lane failed (log above)" >&2; exit 1; }
}

# The static lane's end: IMGBRIDGE_STATIC_BINARY exported, its time in the
# table (true), or its log printed (false). Once.
static_lane_end() {
    [[ -n "$static_pid" ]] || return 0
    local rc
    set +e
    wait "$static_pid"
    rc=$?
    set -e
    static_pid=""
    if [[ $rc -ne 0 ]]; then
        cat "$out/static.log"
        echo "scripts/test.sh: building the static binary failed (log above)" >&2
        return 1
    fi
    IMGBRIDGE_STATIC_BINARY="$(awk '$1 == "x86_64" {print $2}' "$out/static.txt")"
    [[ -x "$IMGBRIDGE_STATIC_BINARY" ]] || { echo "scripts/test.sh: no static binary" >&2; return 1; }
    export IMGBRIDGE_STATIC_BINARY
    lane_times "$out/static.times"
}

stage_start=$SECONDS
echo "==> waiting for the Go lane's containerds and peers (kubelet and the control plane may still build)"
go_lane_reached go-early.ok || exit 1
stage_done "waiting for the Go lane (after the cargo lane's $cargo_lane_secs s)" "$stage_start"
cat "$out/containerd-matrix.txt"
[[ ! -s "$out/peers.txt" ]] || sed 's/^/    peer /' "$out/peers.txt"

# The one containerd config generator (the harness's, try.sh's, the bench
# scripts'): every kind of config it writes loads on every version.
stage_start=$SECONDS
echo "==> scripts/lib/containerd-config-check.sh"
# shellcheck disable=SC2086
scripts/lib/containerd-config-check.sh $matrix

# The Helm chart: helm lint and helm template for every runtime preset, each
# rendered config.toml loaded by the debug binary, the static-pod rendering.
if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" != "1" ]]; then
    echo "==> chart: scripts/test-chart.sh"
    scripts/test-chart.sh "$target_dir/debug/imgbridge"
fi
stage_done "containerd configs, chart" "$stage_start"

# ------------------------------------------------------------------ matrix
# Every integration test binary against every containerd of the matrix:
# Debian bookworm's 1.6 (the system package), trixie's 1.7, sid's 2.1 and
# the newest 2.x from the Go module proxy. Tests of imgbridge itself rather
# than of a containerd fact (its packaging under kubelet and a control plane, input validation,
# fault injection, the harness, the registry's idle-session limits) run on
# the oldest and newest only (docs/testing.md).
broad_only="daemonset cluster hostile breaker harness"
# The soak's short variant (tests/soak, 4 minutes of mixed work under
# faults, seed 41) runs against the newest only: what it checks is
# imgbridge's own hygiene over time; the hour is scripts/soak.sh
# (docs/reliability.md).
newest_only="soak"
# IMGBRIDGE_JOBS binaries at a time (each with two test threads): most of
# a test's time is spent waiting on daemons (containerd, kubelet, buildkitd
# and pods starting), so two share the two cores (docs/testing.md, "CI
# time"). Every daemon a test starts is private (its own sockets, ports,
# temp dir, runc root and network namespaces), so binaries of different
# containerds never meet.
njobs="${IMGBRIDGE_JOBS:-2}"
# Longest first, so the lanes end together: the last run's seconds per
# binary and label if known, else this order (measured, longest first).
times_file="$cache/test-times.tsv"
default_order="soak kubelet registry buildkit daemonset cluster multinode nerdctl restart replicate import hostile proxy breaker lazy protected reconcile socket_swap ops conns reset pending pings versions harness"
declare -A ctd_version=()
jobs_file="$out/jobs.txt"
: >"$jobs_file"
while read -r label version bindir; do
    ctd_version[$label]="$version"
    while read -r name exe; do
        [[ -z "${IMGBRIDGE_TESTS:-}" || " $IMGBRIDGE_TESTS " == *" $name "* ]] || continue
        case "$label" in
            1.6 | 2.4) ;;
            *) [[ " $broad_only " != *" $name "* ]] || continue ;;
        esac
        [[ "$label" == 2.4 || " $newest_only " != *" $name "* ]] || continue
        weight="$(awk -v l="$label" -v n="$name" '$1 == l && $2 == n { print $3 }' "$times_file" 2>/dev/null || true)"
        # Never measured: before every measured one (seconds, below 760).
        if [[ -z "$weight" ]]; then
            rank="$(tr ' ' '\n' <<<"$default_order" | grep -nx "$name" | cut -d: -f1 || true)"
            weight=$((1000 - ${rank:-99} * 10))
        fi
        echo "$weight $label $bindir $name $exe" >>"$jobs_file"
    done <"$out/test-binaries.txt"
done <"$out/containerd-matrix.txt"
sort -k1,1nr -o "$jobs_file" "$jobs_file"

run_job() { # label bindir name exe
    local label="$1" bindir="$2" name="$3" exe="$4" s=$SECONDS rc
    local -a skip=()
    case "$label" in 1.6 | 2.4) ;; *) skip=(--skip idle_upload_sessions_) ;; esac
    {
        echo "     Running tests/$name.rs against containerd ${ctd_version[$label]} ($label)"
        set +e
        IMGBRIDGE_CONTAINERD="$bindir" "$exe" --test-threads=2 "${skip[@]}" 2>&1
        rc=$?
        set -e
    } >"$out/job-$label-$name.log"
    echo "$rc $((SECONDS - s))" >"$out/job-$label-$name.end"
}

stage_start=$SECONDS
echo "==> integration tests: $(wc -l <"$jobs_file") test binaries × containerds, $njobs at a time"
declare -A job_of_pid=()
reap() {
    local pid="" j rc secs
    wait -n -p pid || true
    [[ -n "$pid" && -n "${job_of_pid[$pid]:-}" ]] || return 0
    j="${job_of_pid[$pid]}"
    unset "job_of_pid[$pid]"
    cat "$out/job-$j.log"
    read -r rc secs <"$out/job-$j.end" || { rc="lost"; secs="?"; }
    echo "    (tests/${j#*-}.rs on containerd ${j%%-*}: exit $rc, $secs s)"
}
# The binaries that run kubelet wait for its build (the Go lane's last),
# those that run the project's image for the static binary too: each free
# slot takes the longest job whose needs are met.
needs_kubelet="kubelet daemonset cluster"
job_ready() { # name: its needs met (true), not yet (false); exits if a lane failed
    if [[ " $needs_kubelet " == *" $1 "* && ! -e "$out/go-kubelet.ok" ]]; then
        kill -0 "$go_pid" 2>/dev/null && return 1
        go_lane_reached go-kubelet.ok || exit 1
    fi
    if [[ " $needs_static " == *" $1 "* && -n "$static_pid" ]]; then
        [[ -e "$out/static.times" ]] || { kill -0 "$static_pid" 2>/dev/null && return 1; }
        static_lane_end || exit 1
    fi
    return 0
}
pending=()
while read -r _ label bindir name exe; do
    pending+=("$label $bindir $name $exe")
done <"$jobs_file"
while ((${#pending[@]})); do
    while ((${#job_of_pid[@]} >= njobs)); do reap; done
    launched=""
    for i in "${!pending[@]}"; do
        read -r label bindir name exe <<<"${pending[$i]}"
        job_ready "$name" || continue
        run_job "$label" "$bindir" "$name" "$exe" &
        job_of_pid[$!]="$label-$name"
        unset "pending[$i]"
        launched=1
        break
    done
    # A free slot and no job ready: the kubelet or the static build ends soon.
    [[ -n "$launched" ]] || sleep 1
done
while ((${#job_of_pid[@]})); do reap; done
stage_done "integration tests, $njobs binaries at a time (wall)" "$stage_start"
# The rest of the Go lane (the packaging stage's cargo tools).
stage_start=$SECONDS
go_lane_end
stage_done "waiting for the rest of the Go lane" "$stage_start"

summary=()
failed=0
# This run's seconds replace those it measured; the rest are kept, so a
# run of a few binaries (IMGBRIDGE_TESTS) does not forget the others.
mkdir -p "$cache"
times_tmp="$(mktemp "$cache/test-times.XXXXXX")"
times_new="$(mktemp)"
while read -r label version _; do
    passed=0 nfail=0 secs=0 errors=()
    for end in "$out"/job-"$label"-*.end; do
        [[ -e "$end" ]] || continue
        j="$(basename "$end" .end)"
        name="${j#job-"$label"-}"
        read -r rc s <"$end"
        secs=$((secs + s))
        echo "$label $name $s" >>"$times_new"
        p=$(grep -Eo '^test result: [a-zA-Z]+\. [0-9]+ passed' "$out/$j.log" | awk '{s += $4} END {print s + 0}')
        f=$(grep -E '^test result:' "$out/$j.log" | grep -Eo '[0-9]+ failed' | awk '{s += $1} END {print s + 0}')
        passed=$((passed + p))
        nfail=$((nfail + f))
        if [[ "$rc" != 0 ]]; then
            failed=1
            ((f > 0)) || errors+=("$name: exit $rc")
        fi
    done
    line="containerd $version: $passed passed, $nfail failed ($secs s of test binaries)"
    ((${#errors[@]} == 0)) || line+=" — harness error in ${errors[*]}"
    summary+=("$line")
    stage_names+=("  containerd $label (sum of its binaries)")
    stage_secs+=("$secs")
done <"$out/containerd-matrix.txt"
awk 'FILENAME == ARGV[1] { new[$1 " " $2] = 1; print; next } !(($1 " " $2) in new)' \
    "$times_new" "$times_file" 2>/dev/null >"$times_tmp" || cat "$times_new" >"$times_tmp"
rm -f "$times_new"
mv "$times_tmp" "$times_file"

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
    static_lane_end || exit 1
    echo "==> scripts/test-packaging.sh"
    stage_start=$SECONDS
    scripts/test-packaging.sh
    stage_done "packaging" "$stage_start"
    # The .deb just built, under a real systemd (a Debian root booted by
    # systemd-nspawn): socket activation, restarts under a client loop,
    # the socket swap and a reboot, upgrade, remove, purge.
    echo "==> scripts/test-systemd.sh"
    stage_start=$SECONDS
    wait "$root_pid" || { cat "$out/debian-root.log"; echo "scripts/test.sh: building the Debian root failed" >&2; exit 1; }
    root_pid=""
    tail -n1 "$out/debian-root.log"
    version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
    scripts/test-systemd.sh "dist/imgbridge_${version}-1_amd64.deb"
    stage_done "systemd (nspawn)" "$stage_start"
    # The OpenRC script under Debian's OpenRC as PID 1 (Rancher Desktop's
    # init), the static binary just built.
    echo "==> scripts/test-openrc.sh"
    stage_start=$SECONDS
    scripts/test-openrc.sh
    stage_done "OpenRC (nspawn)" "$stage_start"
fi
