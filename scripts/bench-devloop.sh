#!/usr/bin/env bash
# Dev-loop benchmark (not a test): "build, then start a pod
# from it at once" (the Tilt race), with the real buildkitd, containerd with
# CRI and crictl standing in for kubelet on containerd's own socket.
#
# One private containerd (CRI; its own root, state, sockets, runc root and
# NRI socket in a temp dir), four ways to get a freshly built image into a
# running pod, alternating round by round (the order rotates every round and
# flips every other round, so drift on a busy machine hits all alike):
#
#   A  imgbridge    buildkitd (namespace buildkit) -> imgbridge -> containerd;
#                   pod started the moment buildctl returns (no wait)
#   B  direct k8s.io  a second buildkitd writing straight into k8s.io on
#                   containerd's socket (what a user can do instead, letting
#                   buildkit own kubelet's namespace); pod at once
#   C  export|import  a third buildkitd, namespace buildkit, straight on
#                   containerd's socket (imgbridge not involved); then
#                   `ctr -n buildkit images export - | ctr -n k8s.io images
#                   import -` (what `kind load` / `k3d image import` do); pod
#   D  registry     C's buildkitd pushes to a loopback docker-registry (plain
#                   http, `push=true`); then `crictl pull`; pod
#
# Every build changes the image: the context holds the static busybox and a
# file `v` with "devloop <variant> <iteration> <nonce>"; the image (FROM
# scratch, COPY --chmod=755 busybox, COPY v) runs `cat /v; sleep`. The pod is
# a host-network crictl pod (runp, create --no-pull, start, as kubelet);
# "running" = the container's log shows this iteration's line. A failure is a
# create that fails (CRI does not know the image), a pod that prints another
# iteration's line (old image), or no line within BENCH_POD_TIMEOUT. Pods are
# stopped and removed after each iteration (not timed). Each buildkitd gets
# one warm-up build first (busybox layer cached, not counted).
#
# Per variant: build wall time (buildctl's own run, for D including the
# push), build done -> running (C: export|import + pod, D: pull + pod),
# total; medians, min, max; failures. A/B build ratio = median of per-round
# ratios with a 95% confidence interval (goal <= 1.05x, "met" only when the
# whole interval is under it; 20 rounds rarely decide it, 100 take about 3
# minutes), the same for F/B and A/F, the median per-round difference in ms, and
# imgbridge's own duration of each held Images.Create/Update (replication +
# CRI confirmation) from its log; a Markdown table at the end.
#
# imgbridge runs with its reconciler off, as in the integration tests: only
# the proxied write replicates. containerd keeps its default GC settings.
# Seen on this machine: ctr 2.x exports through the Transfer service by
# default, and v2.4.2's export sometimes writes a truncated archive (C fails
# with "short read ... unexpected EOF"); such an iteration is counted as a
# failure, not retried.
#
# usage: scripts/bench-devloop.sh                       (as root; a few minutes)
# env:   BENCH_ITERATIONS=20   iterations per variant
#        BENCH_CONTAINERD=2.4  containerd label of scripts/containerd-matrix.sh
#                              (1.6, 1.7, 2.1, 2.4) or a bin dir
#        BENCH_VARIANTS="a b c d"  a subset, e.g. "a b"; or add "e": B's build
#                              through imgbridge's socket (a fourth buildkitd,
#                              namespace k8s.io, which imgbridge only relays):
#                              E-B is the hop's cost, A-E the replication's;
#                              "f": the same through a bare byte relay
#                              (examples/floor_relay.rs): F-B is any hop's cost;
#                              "g": A through another imgbridge build (needs
#                              IMGBRIDGE_BASELINE): A-G is what a change did;
#                              "h": B's build through an imgbridge with
#                              `confirm_direct_writes` (each Create held until
#                              CRI resolves it, nothing replicated): the floor
#                              of any proxy that keeps the contract, since B's
#                              own record is the cheapest k8s.io record there is
#        BENCH_DIR=/tmp        parent of the temp dir (containerd's root; /dev/shm
#                              takes the disk's fsyncs out of the figures)
#        BENCH_POD_TIMEOUT=30  seconds for a container to print its line
#        BENCH_RECONCILE=0     1: imgbridge's reconciler on (events backstop);
#                              C then builds into namespace `buildkit-direct` so
#                              imgbridge does not copy its images behind its back
#        BENCH_UNPACK=0        1: every build with unpack=true
#        BENCH_RUN=0           1: the Dockerfile also has a RUN step (buildkit starts
#                              a container through containerd each build)
#        BENCH_TAG=unique      devloop:<variant>-<iteration> (Tilt: a new tag per
#                              build); fixed: one tag per variant rebuilt every
#                              iteration (`app:dev`), where a late update makes
#                              CRI start the previous image ("ran other content")
#        BENCH_POD=crictl      kubelet: the pod is a static pod of a real,
#                              standalone kubelet (scripts/peers.sh fetch
#                              kubelet) on containerd's own socket: its
#                              manifest is written the moment the build is
#                              done (C: the import), imagePullPolicy
#                              IfNotPresent; "running" = the line in kubelet's
#                              pod log file. kubelet runs in a mount namespace
#                              of its own with its sysctls bind-mounted and
#                              tmpfs over /var/lib and /var/log (it writes
#                              those whatever its root dir), as the tests'
#                              harness does; variants a b c only
#        BENCH_SANDBOX=after   runp after the build returns (kubelet's order for a
#                              new pod); before: the sandbox is started before the
#                              build (not timed), so `crictl create` follows
#                              buildctl's return within milliseconds: the
#                              sharpest form of the race
#        IMGBRIDGE_BIN=path    benchmark another build (skips cargo build)
#        IMGBRIDGE_BASELINE=path  the build variant "g" runs (its own buildkitd,
#                              namespace buildkit, and its own socket)
#        BENCH_NO_BUILD=1      skip cargo build (use target/release/imgbridge)
#        BENCH_KEEP=1          keep the temp dir (logs, per-iteration records)
# Needs: cargo, go (first run: scripts/containerd-matrix.sh and scripts/peers.sh
# build containerd 2.4, buildkit and crictl into /var/cache/imgbridge-test),
# Debian's docker-registry, umoci, skopeo, busybox-static.
set -euo pipefail
export LC_ALL=C
cd "$(dirname "$0")/.."

ITER=${BENCH_ITERATIONS:-20}
LABEL=${BENCH_CONTAINERD:-2.4}
read -r -a VARIANTS <<<"${BENCH_VARIANTS:-a b c d}"
POD_TIMEOUT=${BENCH_POD_TIMEOUT:-30}
RECONCILE=${BENCH_RECONCILE:-0}
UNPACK=${BENCH_UNPACK:-0}
TAG=${BENCH_TAG:-unique}
RUN=${BENCH_RUN:-0}
SANDBOX=${BENCH_SANDBOX:-after}
POD=${BENCH_POD:-crictl}
[[ $POD == crictl || $POD == kubelet ]] || { echo "BENCH_POD must be crictl or kubelet" >&2; exit 1; }
[[ $SANDBOX == after || $SANDBOX == before ]] || { echo "BENCH_SANDBOX must be after or before" >&2; exit 1; }
[[ $TAG == unique || $TAG == fixed ]] || { echo "BENCH_TAG must be unique or fixed" >&2; exit 1; }
C_NS=buildkit
[ "$RECONCILE" = 1 ] && C_NS=buildkit-direct

want() { [[ " ${VARIANTS[*]} " == *" $1 "* ]]; }
log() { printf '[devloop] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (it runs a private containerd with CRI)"
for v in "${VARIANTS[@]}"; do [[ $v == [abcdefgh] ]] || die "unknown variant '$v' (a b c d e f g h)"; done
if [ "$POD" = kubelet ]; then
  for v in "${VARIANTS[@]}"; do [[ $v == [abc] ]] || die "BENCH_POD=kubelet runs variants a b c only"; done
  [ "$SANDBOX" = after ] || die "BENCH_POD=kubelet: kubelet starts the sandbox itself (BENCH_SANDBOX=after)"
fi
missing=()
for b in docker-registry umoci skopeo; do command -v "$b" >/dev/null || missing+=("$b"); done
[ -x /bin/busybox ] || missing+=(busybox-static)
if ((${#missing[@]})); then
  log "installing Debian packages for: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker-registry umoci skopeo busybox-static runc containerd >/dev/null
fi
# shellcheck disable=SC1091
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER BUILDKIT_HOST

# ---------------------------------------------------------------- binaries
if [ -n "${IMGBRIDGE_BIN:-}" ]; then
  IB=$IMGBRIDGE_BIN
else
  if [ -z "${BENCH_NO_BUILD:-}" ]; then
    log "cargo build --release --bin imgbridge"
    cargo build --release --quiet --bin imgbridge
  fi
  IB=target/release/imgbridge
fi
if want f; then
  [ -n "${BENCH_NO_BUILD:-}" ] || cargo build --release --quiet --example floor_relay
  FLOOR=$(realpath target/release/examples/floor_relay)
fi
[ -x "$IB" ] || die "no imgbridge binary at $IB"
IB=$(realpath "$IB")
if want g; then
  BASE=${IMGBRIDGE_BASELINE:-}
  [ -x "$BASE" ] || die "variant g needs IMGBRIDGE_BASELINE=<another imgbridge binary>"
  BASE=$(realpath "$BASE")
fi

if [ -d "$LABEL" ]; then
  CTRD_BIN=$(realpath "$LABEL")
else
  line=$(scripts/containerd-matrix.sh fetch "$LABEL") || die "containerd-matrix.sh fetch $LABEL failed"
  CTRD_BIN=$(awk '{print $3}' <<<"$line")
fi
peer_names=(buildkit crictl)
[ "$POD" = kubelet ] && peer_names+=(kubelet)
peers=$(scripts/peers.sh fetch "${peer_names[@]}") || die "peers.sh fetch failed"
KUBELET_BIN=$(awk '$1 == "kubelet" {print $3}' <<<"$peers")
BK_BIN=$(awk '$1 == "buildkit" {print $3}' <<<"$peers")
CRICTL_BIN=$(awk '$1 == "crictl" {print $3}' <<<"$peers")
export PATH="$CTRD_BIN:$PATH" # its ctr and shim first, for everything below
CTRD_VER=$("$CTRD_BIN/containerd" --version | awk '{print $3}')
BK_VER=$("$BK_BIN/buildkitd" --version | awk '{print $3}')
CRICTL_VER=$("$CRICTL_BIN/crictl" --version | awk '{print $3}')

# ---------------------------------------------------------------- temp dir, teardown
T=$(mktemp -d "${BENCH_DIR:-/tmp}/imgbridge-devloop.XXXXXX")
C="$T/containerd/containerd.sock"
pids=() # every daemon we start, in start order (stopped in reverse)

stop_pid() { # pid: TERM, wait up to 5 s, KILL
  local p=$1 i
  kill "$p" 2>/dev/null || return 0
  for ((i = 0; i < 100; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
  kill -9 "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}
# Shims started for this containerd (argv0 containerd-shim*, `-address $C`),
# with all their descendants (pause and app processes): SIGKILL, then the
# shim sockets under /run/containerd/s (sha256 of "<address>/<ns>/<id>").
kill_shims() {
  local tab shims p ns id victims
  tab=$(ps -eo pid=,ppid=,args= 2>/dev/null) || return 0
  shims=$(awk -v a="$C" '{
      n = split($3, p, "/"); if (p[n] !~ /^containerd-shim/) next
      for (i = 4; i < NF; i++) if ($i == "-address" && $(i+1) == a) { print $1; next }
    }' <<<"$tab")
  [ -n "$shims" ] || return 0
  log "killing leftover shims of $C: $(tr '\n' ' ' <<<"$shims")"
  for p in $shims; do
    victims=$(awk -v root="$p" '{par[$1] = $2; pid[NR] = $1}
      END {for (i = 1; i <= NR; i++) {q = pid[i]; while (q in par && q != 1) {q = par[q]; if (q == root) {print pid[i]; break}}}}' <<<"$tab")
    ns=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | awk 'f {print; exit} $0 == "-namespace" {f = 1}') || true
    id=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | awk 'f {print; exit} $0 == "-id" {f = 1}') || true
    # shellcheck disable=SC2086
    kill -9 $victims "$p" 2>/dev/null || true
    if [ -n "$id" ]; then
      s=/run/containerd/s/$(printf '%s' "$C/$ns/$id" | sha256sum | cut -d' ' -f1)
      rm -f "$s" "$s.debug"
    fi
  done
}
unmount_under() { # dir: deepest first, lazily
  local m i
  for ((i = 0; i < 5; i++)); do
    m=$(awk -v r="$1" '$5 == r || index($5, r "/") == 1 {print length($5), $5}' /proc/self/mountinfo | sort -rn | cut -d' ' -f2-)
    [ -n "$m" ] || return 0
    while read -r x; do umount -l "$(printf '%b' "$x")" 2>/dev/null || true; done <<<"$m"
  done
}
cleanup() {
  local rc=$? i
  trap - EXIT INT TERM
  rm -f "$T"/kubelet/manifests/*.json 2>/dev/null || true
  if [ -S "$C" ] && [ -n "${CRICTL:-}" ]; then # pods first, while containerd lives
    timeout 60 "${CRICTL[@]}" rmp -a -f >/dev/null 2>&1 || true
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop_pid "${pids[$i]}"; done
  kill_shims
  unmount_under "$T"
  if [ "${BENCH_KEEP:-0}" = 1 ]; then
    log "kept $T (logs)"
  else
    if [ "$rc" != 0 ]; then
      for f in "$T"/containerd/containerd.log "$T"/imgbridge/imgbridge.log "$T"/bk-*/buildkitd.log; do
        [ -s "$f" ] && { log "last lines of $f:"; tail -5 "$f" >&2; }
      done
      log "failed (exit $rc); BENCH_KEEP=1 keeps the temp dir and its logs"
    fi
    rm -rf "$T" 2>/dev/null || log "could not remove all of $T"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# A sleep without a fork: read with a timeout on a pipe nobody writes to.
exec {SLEEPFD}<> <(:)
nap() { read -r -t "$1" -u "$SLEEPFD" _ || true; }
now_us() { local t=$EPOCHREALTIME; REPLY=${t/./}; }
wait_sock() { local i; for ((i = 0; i < 600; i++)); do [ -S "$1" ] && return 0; nap 0.05; done; die "no socket $1"; }
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

snap=overlayfs
mkdir -p "$T/ovl/l" "$T/ovl/u" "$T/ovl/w" "$T/ovl/m"
echo ok >"$T/ovl/l/probe"
if mount -t overlay overlay -o "lowerdir=$T/ovl/l,upperdir=$T/ovl/u,workdir=$T/ovl/w" "$T/ovl/m" 2>/dev/null; then
  umount "$T/ovl/m"
else
  snap=native
fi
rm -rf "$T/ovl"

# ---------------------------------------------------------------- registry (D)
REG=""
if want d; then
  mkdir -p "$T/registry"
  for _ in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 40000))
    port_free "$port" || continue
    cat >"$T/registry/config.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $T/registry/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$port
  secret: imgbridge-devloop
EOF
    docker-registry serve "$T/registry/config.yml" >"$T/registry/registry.log" 2>&1 &
    reg_pid=$!
    for ((i = 0; i < 200; i++)); do
      curl -fsS -o /dev/null "http://127.0.0.1:$port/v2/" 2>/dev/null && { REG=127.0.0.1:$port; break; }
      kill -0 "$reg_pid" 2>/dev/null || break
      nap 0.05
    done
    if [ -n "$REG" ]; then pids+=("$reg_pid"); break; fi
    stop_pid "$reg_pid"
  done
  [ -n "$REG" ] || die "docker-registry did not start: $(tail -5 "$T/registry/registry.log")"
fi

# ---------------------------------------------------------------- containerd with CRI
PAUSE=registry.k8s.io/pause:3.6
D="$T/containerd"
mkdir -p "$D/cni/bin" "$D/cni/net.d" "$D/certs.d"
cfg="$D/config.toml"
# The one generator of a private containerd's config (scripts/lib/); on 2.x
# it writes $REG's hosts.toml under $D/certs.d, on 1.x a mirrors entry.
scripts/lib/containerd-config.sh --dir "$D" --containerd "$CTRD_BIN/containerd" --socket "$C" \
  --cri --snapshotter "$snap" --sandbox-image "$PAUSE" ${REG:+--mirror "$REG"} >"$cfg"
CFG_VER=$(awk '$1 == "version" {print $3; exit}' "$cfg")
"$CTRD_BIN/containerd" --config "$cfg" --log-level warn >"$D/containerd.log" 2>&1 &
pids+=($!)
wait_sock "$C"
for ((i = 0; i < 200; i++)); do ctr -a "$C" version >/dev/null 2>&1 && break; nap 0.05; done
ctr -a "$C" version >/dev/null 2>&1 || die "containerd not ready: $(tail -5 "$D/containerd.log")"
CRICTL=("$CRICTL_BIN/crictl" --runtime-endpoint "unix://$C" --image-endpoint "unix://$C" --timeout 20s)
export CRI_CONFIG_FILE=/dev/null # no /etc/crictl.yaml of the machine's

# The pause image: the static busybox sleeping (no network needed).
log "pause image (busybox sleep) as $PAUSE"
mkdir -p "$T/pause/stage/bin"
cp /bin/busybox "$T/pause/stage/bin/busybox"
umoci init --layout "$T/pause/oci" >/dev/null
umoci new --image "$T/pause/oci:p" >/dev/null
umoci insert --image "$T/pause/oci:p" "$T/pause/stage" / >/dev/null
umoci config --image "$T/pause/oci:p" --config.cmd /bin/busybox --config.cmd sleep --config.cmd 86400 >/dev/null
skopeo --insecure-policy copy -q "oci:$T/pause/oci:p" "docker-archive:$T/pause/pause.tar:$PAUSE"
ctr -a "$C" -n k8s.io images import "$T/pause/pause.tar" >/dev/null 2>"$T/pause/import.err" ||
  die "pause import: $(cat "$T/pause/import.err")"
for ((i = 0; i < 200; i++)); do "${CRICTL[@]}" inspecti "$PAUSE" >/dev/null 2>&1 && break; nap 0.05; done
"${CRICTL[@]}" inspecti "$PAUSE" >/dev/null || die "CRI does not resolve $PAUSE"

# ---------------------------------------------------------------- imgbridge (A)
# start_imgbridge DIR BINARY [TOML]: TOML is appended to its config
start_imgbridge() {
  local d=$1
  mkdir -p "$d"
  if [ "$RECONCILE" = 1 ]; then
    printf 'ttrpc = false\n' >"$d/config.toml"
  else
    # As the integration tests: only the proxied writes replicate, so C's
    # direct writes into `buildkit` are not copied behind the benchmark's back.
    printf 'ttrpc = false\n[reconcile]\nenabled = false\n' >"$d/config.toml"
  fi
  # Its metrics on a socket of the run's own: the calls each build makes
  # through it (what the hop costs scales with them).
  printf '[metrics]\nlisten = "%s"\n' "$d/metrics.sock" >>"$d/config.toml"
  [ -z "${3:-}" ] || printf '%s\n' "$3" >>"$d/config.toml"
  "$2" serve --config "$d/config.toml" --listen "$d/imgbridge.sock" \
    --upstream "$C" >"$d/imgbridge.log" 2>&1 &
  pids+=($!)
  wait_sock "$d/imgbridge.sock"
}
if want a || want e; then start_imgbridge "$T/imgbridge" "$IB"; fi
if want g; then start_imgbridge "$T/baseline" "$BASE"; fi
if want h; then start_imgbridge "$T/confirm" "$IB" $'[replication]\nconfirm_direct_writes = true'; fi

# ---------------------------------------------------------------- buildkitds
# start_buildkitd NAME CONTAINERD_SOCK NAMESPACE
start_buildkitd() {
  local n=$1 sock=$2 ns=$3 d="$T/bk-$1" i
  mkdir -p "$d"
  scripts/lib/buildkitd-config.sh --dir "$d" --containerd "$sock" --namespace "$ns" \
    --snapshotter "$snap" ${REG:+--registry "$REG"} >"$d/buildkitd.toml"
  "$BK_BIN/buildkitd" --config "$d/buildkitd.toml" >"$d/buildkitd.log" 2>&1 &
  pids+=($!)
  for ((i = 0; i < 600; i++)); do
    "$BK_BIN/buildctl" --addr "unix://$d/buildkitd.sock" debug workers >/dev/null 2>&1 && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || break
    nap 0.05
  done
  die "buildkitd $n not ready: $(tail -5 "$d/buildkitd.log")"
}
want a && start_buildkitd a "$T/imgbridge/imgbridge.sock" buildkit
want e && start_buildkitd e "$T/imgbridge/imgbridge.sock" k8s.io
if want f; then
  # F: B's build through a bare byte relay (examples/floor_relay.rs): what
  # any hop costs, against E's (imgbridge's) hop.
  mkdir -p "$T/floor"
  "$FLOOR" "$T/floor/floor.sock" "$C" 2>"$T/floor/floor.log" &
  pids+=($!)
  wait_sock "$T/floor/floor.sock"
  start_buildkitd f "$T/floor/floor.sock" k8s.io
fi
want b && start_buildkitd b "$C" k8s.io
want g && start_buildkitd g "$T/baseline/imgbridge.sock" buildkit
want h && start_buildkitd h "$T/confirm/imgbridge.sock" k8s.io
{ want c || want d; } && start_buildkitd c "$C" "$C_NS"
bk_of() { case $1 in c | d) echo c ;; *) echo "$1" ;; esac; }

# ---------------------------------------------------------------- kubelet (BENCH_POD=kubelet)
# Standalone (no API server), static pods, configured and run as the harness does
# (scripts/lib/kubelet-config.sh, kubelet-ns.sh): ports on loopback, image GC and
# disk eviction off, no kubepods cgroups.
NODE=imgbridge-bench
if [ "$POD" = kubelet ]; then
  K="$T/kubelet"
  mkdir -p "$K/manifests" "$K/root" "$K/pod-logs"
  free_port() { local p; while :; do p=$((20000 + RANDOM % 40000)); port_free "$p" && { echo "$p"; return; }; done; }
  KRO=$(free_port)
  scripts/lib/kubelet-config.sh --dir "$K" --endpoint "$C" \
    --port "$(free_port)" --read-only-port "$KRO" --healthz-port "$(free_port)" >"$K/kubelet.yaml"
  scripts/lib/kubelet-ns.sh "$K" "$KUBELET_BIN/kubelet" \
    --config="$K/kubelet.yaml" --root-dir="$K/root" --hostname-override="$NODE" --v=2 >"$K/kubelet.log" 2>&1 &
  pids+=($!)
  for ((i = 0; i < 600; i++)); do
    [ "$(curl -s "http://127.0.0.1:$KRO/healthz" 2>/dev/null)" = ok ] && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    nap 0.05
  done
  [ "$(curl -s "http://127.0.0.1:$KRO/healthz" 2>/dev/null)" = ok ] || die "kubelet not healthy: $(tail -5 "$K/kubelet.log")"
  KUBELET_VER=$("$KUBELET_BIN/kubelet" --version | awk '{print $2}')
fi

# ---------------------------------------------------------------- one iteration
for v in "${VARIANTS[@]}"; do
  mkdir -p "$T/ctx-$v"
  cp /bin/busybox "$T/ctx-$v/busybox"
  {
    printf '%s\n' 'FROM scratch' 'COPY --chmod=755 busybox /bin/busybox' 'COPY v /v'
    # A build step that runs (a container started by buildkit through the
    # same socket), as a real build's compile step.
    if [ "$RUN" = 1 ]; then printf '%s\n' 'RUN ["/bin/busybox", "sh", "-c", "/bin/busybox md5sum /v > /v.md5"]'; fi
    printf '%s\n' 'CMD ["/bin/busybox", "sh", "-c", "/bin/busybox cat /v; exec /bin/busybox sleep 3600"]'
  } >"$T/ctx-$v/Dockerfile"
done
image_of() { # variant iteration -> the reference the pod runs
  local tag=$1-$2
  [ "$TAG" = fixed ] && tag=$1
  case $1 in
    d) echo "$REG/devloop:$tag" ;;
    *) echo "docker.io/library/devloop:$tag" ;;
  esac
}
unpack_opt() { [ "$UNPACK" = 1 ] && echo ",unpack=true"; true; }

# remove_pod ID: stopp + rmp, retried (1.6 can fail a stop with "ttrpc: closed").
remove_pod() {
  local i
  for ((i = 0; i < 20; i++)); do
    "${CRICTL[@]}" stopp "$1" >/dev/null 2>&1 && "${CRICTL[@]}" rmp "$1" >/dev/null 2>&1 && return 0
    nap 0.5
  done
  log "could not remove pod $1"
}

# iteration VARIANT ITER: sets R_build R_xfer R_pod (ms), R_ok (1/0), R_why.
iteration() {
  local v=$1 it=$2 ref expect d pj cj pod="" cid t0 t1 t2 t3 line deadline
  ref=$(image_of "$v" "$it")
  expect="devloop $v $it $RANDOM$RANDOM"
  printf '%s\n' "$expect" >"$T/ctx-$v/v"
  local output
  output="type=image,name=$ref$(unpack_opt)"
  [ "$v" = d ] && output+=",push=true"
  d="$T/pods/$v-$it"
  mkdir -p "$d/logs"
  pj="$d/pod.json" cj="$d/ctr.json"
  printf '{"metadata":{"name":"devloop-%s-%s","namespace":"devloop","uid":"%s","attempt":0},"log_directory":"%s","linux":{"security_context":{"namespace_options":{"network":2,"pid":2,"ipc":2}}}}\n' \
    "$v" "$it" "uid-$v-$it-$RANDOM$RANDOM" "$d/logs" >"$pj"
  printf '{"metadata":{"name":"main"},"image":{"image":"%s"},"log_path":"main.log","linux":{}}\n' "$ref" >"$cj"
  R_build=0 R_xfer=0 R_pod=0 R_ok=0 R_why=""
  if [ "$SANDBOX" = before ] && ! pod=$("${CRICTL[@]}" runp "$pj" 2>"$d/runp.err"); then
    R_why="runp failed: $(tail -1 "$d/runp.err")"
    return 0
  fi

  now_us; t0=$REPLY
  if ! "$BK_BIN/buildctl" --addr "unix://$T/bk-$(bk_of "$v")/buildkitd.sock" build \
    --frontend dockerfile.v0 --local "context=$T/ctx-$v" --local "dockerfile=$T/ctx-$v" \
    --output "$output" >/dev/null 2>"$d/build.err"; then
    R_why="build failed: $(tail -1 "$d/build.err")"
    if [ -n "$pod" ]; then remove_pod "$pod"; fi
    return 0
  fi
  now_us; t1=$REPLY
  R_build=$(((t1 - t0) / 1000))
  case $v in
    c)
      if ! { ctr -a "$C" -n "$C_NS" images export - "$ref" | ctr -a "$C" -n k8s.io images import - >/dev/null; } 2>"$d/copy.err"; then
        R_why="export|import failed: $(tail -1 "$d/copy.err")"
        if [ -n "$pod" ]; then remove_pod "$pod"; fi
        return 0
      fi
      ;;
    d)
      if ! "${CRICTL[@]}" pull "$ref" >/dev/null 2>"$d/copy.err"; then
        R_why="crictl pull failed: $(tail -1 "$d/copy.err")"
        if [ -n "$pod" ]; then remove_pod "$pod"; fi
        return 0
      fi
      ;;
  esac
  now_us; t2=$REPLY
  R_xfer=$(((t2 - t1) / 1000))
  if [ "$POD" = kubelet ]; then
    kubelet_pod "$v" "$it" "$ref" "$expect" "$t2"
    return 0
  fi
  if [ "$SANDBOX" = after ] && ! pod=$("${CRICTL[@]}" runp "$pj" 2>"$d/runp.err"); then
    R_why="runp failed: $(tail -1 "$d/runp.err")"
    return 0
  fi
  if ! cid=$("${CRICTL[@]}" create --no-pull "$pod" "$cj" "$pj" 2>"$d/create.err"); then
    R_why="create failed: $(tail -1 "$d/create.err")"
    remove_pod "$pod"
    return 0
  fi
  if ! "${CRICTL[@]}" start "$cid" >/dev/null 2>"$d/start.err"; then
    R_why="start failed: $(tail -1 "$d/start.err")"
    remove_pod "$pod"
    return 0
  fi
  # Running = the container printed its line (CRI log: "<time> stdout F <line>").
  deadline=$((t2 + POD_TIMEOUT * 1000000))
  line=""
  while :; do
    if [ -s "$d/logs/main.log" ] && read -r line <"$d/logs/main.log" && [ -n "$line" ]; then break; fi
    now_us
    if ((REPLY > deadline)); then break; fi
    nap 0.005
  done
  now_us; t3=$REPLY
  R_pod=$(((t3 - t2) / 1000))
  if [ -z "$line" ]; then
    R_why="no output within ${POD_TIMEOUT}s"
  elif [[ " $line" != *" stdout F $expect" ]]; then
    R_why="ran other content: '${line#* stdout F }' (expected '$expect')"
  else
    R_ok=1
  fi
  remove_pod "$pod"
  return 0
}

# kubelet_pod VARIANT ITER REF EXPECT T2: the static pod for this iteration,
# written now; R_pod = until its first log line (kubelet's pod log file);
# then the manifest is removed (kubelet stops the pod, not timed).
kubelet_pod() {
  local v=$1 it=$2 ref=$3 expect=$4 t2=$5 name="devloop-$1-$2" m line="" f deadline
  m="$K/manifests/$name.json"
  printf '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"%s","namespace":"default"},"spec":{"hostNetwork":true,"terminationGracePeriodSeconds":1,"containers":[{"name":"app","image":"%s","imagePullPolicy":"IfNotPresent"}]}}\n' \
    "$name" "$ref" >"$K/.$name.tmp"
  mv "$K/.$name.tmp" "$m"
  deadline=$((t2 + POD_TIMEOUT * 1000000))
  while :; do
    for f in "$K/pod-logs/default_$name-${NODE}_"*/app/0.log; do
      if [ -s "$f" ] && read -r line <"$f" && [ -n "$line" ]; then break 2; fi
    done
    now_us
    if ((REPLY > deadline)); then break; fi
    nap 0.005
  done
  now_us
  R_pod=$(((REPLY - t2) / 1000))
  if [ -z "$line" ]; then
    R_why="no output within ${POD_TIMEOUT}s: $(grep -E "$name.*(ErrImage|BackOff|Pulling|Failed)" "$K/kubelet.log" | tail -1 | cut -c1-200)"
  elif [[ " $line" != *" stdout F $expect" ]]; then
    R_why="ran other content: '${line#* stdout F }' (expected '$expect')"
  else
    R_ok=1
  fi
  rm -f "$m"
}

# ---------------------------------------------------------------- rounds
RES="$T/results" # variant iteration ok build_ms xfer_ms pod_ms
: >"$RES"
log "containerd $CTRD_VER ($LABEL, config v$CFG_VER, $snap), buildkit $BK_VER, crictl $CRICTL_VER, imgbridge $("$IB" --version 2>/dev/null | awk '{print $2}')"
log "variants: ${VARIANTS[*]}, $ITER iterations each; temp dir $T; load $(cut -d' ' -f1-3 /proc/loadavg)"
load0=$(cut -d' ' -f1-3 /proc/loadavg)
now_us; start_all=$REPLY
for v in "${VARIANTS[@]}"; do
  iteration "$v" 0 || true
  if [ "$R_ok" != 1 ]; then
    log "warm-up of $v failed: $R_why"
    log "buildkitd log: $(tail -3 "$T/bk-$(bk_of "$v")/buildkitd.log")"
    exit 1
  fi
  log "warm-up $v: build $R_build ms, +$R_xfer ms, pod $R_pod ms"
done
n=${#VARIANTS[@]}
for ((r = 1; r <= ITER; r++)); do
  order=()
  for ((k = 0; k < n; k++)); do order+=("${VARIANTS[$(((k + r) % n))]}"); done
  if ((r % 2 == 0)); then
    rev=(); for ((k = n - 1; k >= 0; k--)); do rev+=("${order[$k]}"); done; order=("${rev[@]}")
  fi
  msg="round $r/$ITER:"
  for v in "${order[@]}"; do
    iteration "$v" "$r" || R_why="iteration failed (status $?)"
    echo "$v $r $R_ok $R_build $R_xfer $R_pod" >>"$RES"
    if [ "$R_ok" = 1 ]; then
      msg+=" $v=$R_build+$R_xfer+${R_pod}ms"
    else
      msg+=" $v=FAIL"
      echo "$v $r $R_why" >>"$T/failures"
      log "round $r $v: $R_why"
    fi
  done
  log "$msg"
done
now_us; elapsed=$(((REPLY - start_all) / 1000000))
load1=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- summary
# stats VARIANT COLUMN [all]: "median min max" (ms) over ok iterations (or all
# iterations with a build, for the build column)
stats() {
  awk -v v="$1" -v c="$2" -v all="${3:-}" '$1 == v && ($3 == 1 || (all != "" && $4 > 0)) {print $c}' "$RES" | sort -n |
    awk '{a[NR] = $1} END {if (NR == 0) {print "- - -"; exit}
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.0f %d %d\n", m, a[1], a[NR]}'
}
col_sum() { # VARIANT: build + xfer + pod per ok iteration
  awk -v v="$1" '$1 == v && $3 == 1 {print $4 + $5 + $6}' "$RES" | sort -n |
    awk '{a[NR] = $1} END {if (NR == 0) {print "- - -"; exit}
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.0f %d %d\n", m, a[1], a[NR]}'
}
ready_stats() { # VARIANT: xfer + pod (build done -> running)
  awk -v v="$1" '$1 == v && $3 == 1 {print $5 + $6}' "$RES" | sort -n |
    awk '{a[NR] = $1} END {if (NR == 0) {print "- - -"; exit}
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.0f %d %d\n", m, a[1], a[NR]}'
}
fails() { awk -v v="$1" '$1 == v && $3 != 1' "$RES" | wc -l; }
p50_p99() { # VARIANT: build done -> running, nearest-rank p50 and p99 (ms)
  awk -v v="$1" '$1 == v && $3 == 1 {print $5 + $6}' "$RES" | sort -n |
    awk '{a[NR] = $1} END {if (NR == 0) {print "-"; exit}
      i = int(NR * 0.5); if (i < NR * 0.5) i++; j = int(NR * 0.99); if (j < NR * 0.99) j++
      printf "%d / %d\n", a[i], a[j]}'
}
# ratio X Y COLUMNS: median, min, max, count of per-round X/Y (rounds where
# both built), and a 95% confidence interval of that median: the order
# statistics k and n+1-k with k = n/2 - 0.98 sqrt(n) (distribution-free, as
# the per-round ratios are not normal: a GC pause makes one round 1.3x)
ratio() {
  awk -v x="$1" -v y="$2" -v cols="$3" '
    {k = $2; s = 0; n = split(cols, cs, ","); for (i = 1; i <= n; i++) s += $(cs[i])}
    $1 == x && $4 > 0 {X[k] = s} $1 == y && $4 > 0 {Y[k] = s}
    END {for (k in X) if ((k in Y) && Y[k] > 0) print X[k] / Y[k]}' "$RES" | sort -g |
    awk '{a[NR] = $1} END {if (NR == 0) {print "- - - 0 - -"; exit}
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
      k = int(NR / 2 - 0.98 * sqrt(NR)); if (k < 1) k = 1
      printf "%.3f %.3f %.3f %d %.3f %.3f\n", m, a[1], a[NR], NR, a[k], a[NR + 1 - k]}'
}
# verdict LO HI GOAL: the goal against a confidence interval
verdict() {
  awk -v lo="$1" -v hi="$2" -v g="$3" 'BEGIN {
    if (lo == "-") print "no data"; else if (hi + 0 <= g) print "met"; else if (lo + 0 > g) print "MISSED"
    else print "not shown (the interval spans the goal: more iterations)"}'
}
diff_ms() { # as ratio, X - Y in ms
  awk -v x="$1" -v y="$2" -v cols="$3" '
    {k = $2; s = 0; n = split(cols, cs, ","); for (i = 1; i <= n; i++) s += $(cs[i])}
    $1 == x && $4 > 0 {X[k] = s} $1 == y && $4 > 0 {Y[k] = s}
    END {for (k in X) if (k in Y) print X[k] - Y[k]}' "$RES" | sort -g |
    awk '{a[NR] = $1} END {if (NR == 0) {print "- - - 0"; exit}
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%+.0f %+d %+d %d\n", m, a[1], a[NR], NR}'
}
name_of() {
  case $1 in
    a) echo "A imgbridge (buildkit ns -> k8s.io before return)" ;;
    b) echo "B buildkitd straight into k8s.io" ;;
    c) echo "C build + ctr export | ctr import" ;;
    d) echo "D build + push to local registry + crictl pull" ;;
    e) echo "E = B through imgbridge's socket (hop only)" ;;
    f) echo "F = B through a bare byte relay (any hop)" ;;
    g) echo "G = A through IMGBRIDGE_BASELINE" ;;
    h) echo "H = B through imgbridge, held for CRI (floor)" ;;
  esac
}
short_of() {
  case $1 in
    a) echo "A: imgbridge (buildkitd → imgbridge, ns \`buildkit\`)" ;;
    b) echo "B: buildkitd straight into \`k8s.io\`" ;;
    c) echo "C: build, then \`ctr export \| ctr import\` (kind load)" ;;
    d) echo "D: build + push to loopback registry, \`crictl pull\`" ;;
    e) echo "E: B through imgbridge's socket (\`k8s.io\` is only relayed)" ;;
    f) echo "F: B through a bare byte relay (\`examples/floor_relay.rs\`)" ;;
    g) echo "G: A through the baseline build (\`IMGBRIDGE_BASELINE\`)" ;;
    h) echo "H: B through imgbridge, each write held until CRI resolves it (the contract's floor)" ;;
  esac
}
mmm() { read -r m lo hi <<<"$1"; if [ "$m" = - ]; then echo "-"; else echo "$m ($lo-$hi)"; fi; }

echo
echo "== dev loop: build, then a $([ "$POD" = kubelet ] && echo "static pod of a real kubelet" || echo "CRI pod") from the new image at once ($ITER iterations per variant, alternating)"
echo "   containerd $CTRD_VER ($LABEL, $snap), buildkit $BK_VER, $([ "$POD" = kubelet ] && echo "kubelet $KUBELET_VER" || echo "crictl $CRICTL_VER"), imgbridge $("$IB" --version 2>/dev/null | awk '{print $2}')"
echo "   $(nproc) cores; load before $load0, after $load1; rounds took ${elapsed}s; reconcile $([ "$RECONCILE" = 1 ] && echo on || echo off), unpack=$([ "$UNPACK" = 1 ] && echo true || echo false), tags $TAG, sandbox $SANDBOX the build, RUN step $([ "$RUN" = 1 ] && echo yes || echo no)"
echo "   times in ms: median (min-max) over successful iterations; build = buildctl wall time"
printf '   %-50s %-20s %-20s %-20s %-20s %s\n' variant "build" "done->running" "(of which copy)" "total" failures
for v in "${VARIANTS[@]}"; do
  printf '   %-50s %-20s %-20s %-20s %-20s %s/%s\n' "$(name_of "$v")" "$(mmm "$(stats "$v" 4 all)")" \
    "$(mmm "$(ready_stats "$v")")" "$(mmm "$(stats "$v" 5)")" "$(mmm "$(col_sum "$v")")" "$(fails "$v")" "$ITER"
done
for v in "${VARIANTS[@]}"; do
  printf '   %-50s build done -> running p50 / p99: %s ms\n' "$(name_of "$v")" "$(p50_p99 "$v")"
done
if [ -s "$T/failures" ]; then
  echo "   failures:"
  sed 's/^/     /' "$T/failures"
fi
rb=""
if want a && want b; then
  read -r rb rblo rbhi rbn rbcl rbch <<<"$(ratio a b 4)"
  read -r rt rtlo rthi _ <<<"$(ratio a b 4,5,6)"
  echo "   imgbridge / direct-to-k8s.io build wall time: ${rb}x (median of $rbn per-round ratios, 95% interval $rbcl-$rbch; range $rblo-$rbhi) goal <= 1.05x: $(verdict "$rbcl" "$rbch" 1.05)"
  read -r dm dlo dhi _ <<<"$(diff_ms a b 4)"
  echo "   imgbridge - direct-to-k8s.io build wall time: ${dm} ms (median of per-round differences; range $dlo to $dhi ms)"
  echo "   imgbridge / direct-to-k8s.io build + pod total:   ${rt}x (range $rtlo-$rthi)"
  echo "   imgbridge failures: $(fails a) (goal 0)"
fi
if want f && want b; then
  # The floor of any proxy: a bare byte relay, no parsing, no replication.
  read -r x xlo xhi xn xcl xch <<<"$(ratio f b 4)"
  read -r d _ _ _ <<<"$(diff_ms f b 4)"
  echo "   F / B build wall time (a bare byte relay alone): ${x}x (median of $xn per-round ratios, 95% interval $xcl-$xch), ${d} ms per build"
  if want a; then
    read -r x xlo xhi xn xcl xch <<<"$(ratio a f 4)"
    read -r d _ _ _ <<<"$(diff_ms a f 4)"
    echo "   A / F build wall time (imgbridge against that floor): ${x}x (95% interval $xcl-$xch), ${d} ms per build"
  fi
fi
if want h && want b; then
  # The floor of the contract: B's own record (no replication), the hop,
  # and the wait for CRI before the reply. No proxy that confirms through
  # CRI before replying can build faster than this.
  read -r x xlo xhi xn xcl xch <<<"$(ratio h b 4)"
  read -r d _ _ _ <<<"$(diff_ms h b 4)"
  echo "   H / B build wall time (the contract's floor: hop + CRI confirmation, nothing replicated): ${x}x (median of $xn per-round ratios, 95% interval $xcl-$xch), ${d} ms per build; goal <= 1.05x within reach of any such proxy: $(verdict "$xcl" "$xch" 1.05 | sed 's/^met$/yes/; s/^MISSED$/no (the floor itself is over it)/')"
  if want a; then
    read -r x xlo xhi xn xcl xch <<<"$(ratio a h 4)"
    read -r d _ _ _ <<<"$(diff_ms a h 4)"
    echo "   A / H build wall time (replication's cost over that floor): ${x}x (95% interval $xcl-$xch), ${d} ms per build"
  fi
fi
held=""
if want e && want b; then
  read -r x xlo xhi _ <<<"$(diff_ms e b 4)"
  echo "   E - B build wall time (imgbridge's hop, no replication): ${x} ms (median of per-round differences; range $xlo to $xhi ms)"
  if want f; then
    read -r x xlo xhi _ <<<"$(diff_ms f b 4)"
    echo "   F - B build wall time (a bare byte relay's hop): ${x} ms (range $xlo to $xhi ms)"
    read -r x xlo xhi _ <<<"$(diff_ms e f 4)"
    echo "   E - F build wall time (imgbridge's hop over the bare relay's): ${x} ms (range $xlo to $xhi ms)"
  fi
  if want a; then
    read -r x xlo xhi _ <<<"$(diff_ms a e 4)"
    echo "   A - E build wall time (replication + CRI confirmation): ${x} ms (range $xlo to $xhi ms)"
  fi
fi
# held_of LOG VARIANT: imgbridge logs each intercepted call with its
# duration: the held Images.Create is the replication plus the CRI
# confirmation (the first one, the warm-up, is skipped; best effort: nothing
# is printed if the log format differs).
held_of() {
  [ -s "$1" ] || return 0
  sed 's/\x1b\[[0-9;]*m//g' "$1" |
    awk -v v="devloop:$2" '/intercepted call done/ && /Images\/(Create|Update)"/ && index($0, v) && n++ {
        for (i = 1; i <= NF; i++) if ($i ~ /^duration_ms=/) {sub(/duration_ms=/, "", $i); d = $i}
        print d}' | sort -n |
    awk '{a[NR] = $1} END {if (NR == 0) exit
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.1f ms (%.1f-%.1f) over %d builds\n", m, a[1], a[NR], NR}'
}
if want a; then
  held=$(held_of "$T/imgbridge/imgbridge.log" a)
  [ -n "$held" ] && echo "   imgbridge's held Images.Create/Update (replication + CRI confirmation), from its log: median $held"
fi
if want h; then
  hheld=$(held_of "$T/confirm/imgbridge.log" h)
  [ -n "$hheld" ] && echo "   H's held Images.Create/Update (CRI confirmation only), from its log: median $hheld"
fi
if want g; then
  gheld=$(held_of "$T/baseline/imgbridge.log" g)
  [ -n "$gheld" ] && echo "   the baseline's held Images.Create/Update (G), from its log: median $gheld"
  if want a; then
    read -r x xlo xhi _ <<<"$(diff_ms a g 4)"
    read -r y ylo yhi _ <<<"$(ratio a g 4)"
    echo "   A - G build wall time (this build against the baseline): ${x} ms (range $xlo to $xhi ms); A/G ${y}x (range $ylo-$yhi)"
  fi
fi
if { want a || want e; } && [ -S "$T/imgbridge/metrics.sock" ]; then
  # Calls of A's and E's builds (and the warm-ups) through imgbridge, per
  # build; the buildkitds' own housekeeping is included.
  builds=$((ITER * ($(want a && echo 1 || echo 0) + $(want e && echo 1 || echo 0)) + 1))
  curl -s --unix-socket "$T/imgbridge/metrics.sock" http://imgbridge/metrics |
    awk -v b="$builds" '/^imgbridge_proxy_calls_total/ {
        m = $0; sub(/.*method="\/containerd\.services\./, "", m); sub(/".*/, "", m)
        n[m] += $NF; t += $NF }
      END { if (t == 0) exit
        printf "TOTAL %.1f\n", t / b
        for (m in n) printf "%.1f %s\n", n[m] / b, m }' |
    sort -k1,1nr >"$T/calls.txt" || true
  if [ -s "$T/calls.txt" ]; then
    echo "   calls through imgbridge per build: $(awk '/^TOTAL/ {print $2}' "$T/calls.txt") ($(grep -v '^TOTAL' "$T/calls.txt" | head -6 | awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $1}'))"
  fi
fi
for v in c d; do
  if want a && want "$v"; then
    read -r x xlo xhi _ <<<"$(ratio a "$v" 4,5,6)"
    echo "   imgbridge / ${v^^} build + pod total: ${x}x (range $xlo-$xhi)"
  fi
done

echo
echo "Markdown (\`scripts/bench-devloop.sh\`, containerd $CTRD_VER, $ITER iterations per variant alternating, $TAG tags, sandbox started $SANDBOX the build$([ "$RUN" = 1 ] && echo ", Dockerfile with a RUN step"), $(nproc) cores, load $load0 → $load1; ms, median (min-max)):"
echo
echo "| variant | build wall time | build done → container running | p50 / p99 | of which image copy | total | failures |"
echo "|---|---|---|---|---|---|---|"
for v in "${VARIANTS[@]}"; do
  echo "| $(short_of "$v") | $(mmm "$(stats "$v" 4 all)") | $(mmm "$(ready_stats "$v")") | $(p50_p99 "$v") | $(mmm "$(stats "$v" 5)") | $(mmm "$(col_sum "$v")") | $(fails "$v")/$ITER |"
done
if [ -n "$rb" ]; then
  echo
  echo "imgbridge / direct-to-\`k8s.io\` build wall time: **${rb}×** (median of per-round ratios, 95% interval $rbcl-$rbch, range $rblo-$rbhi; goal ≤ 1.05×: $(verdict "$rbcl" "$rbch" 1.05)), ${dm} ms per build; build + pod: ${rt}×; imgbridge failures: $(fails a) (goal 0).$(if [ -n "$held" ]; then echo " imgbridge's held \`Images.Create/Update\` (replication + CRI confirmation): $held."; fi)"
fi
