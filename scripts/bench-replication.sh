#!/usr/bin/env bash
# Replication and reconcile benchmarks (not tests): imgbridge in front of a
# throwaway containerd with CRI, compared with the same work done straight on
# containerd's socket. Variants alternate round by round (the order flips
# every round) and medians are reported, so a busy machine hurts both alike.
#
#   A1  ctr import of a 10-layer image into `buildkit`: direct vs through
#       imgbridge (replication + CRI wait included), --no-unpack and unpack.
#   A2  Images.Create of a new name for a 50-layer image already in buildkit:
#       direct vs proxied; the difference is replication + CRI confirmation.
#       cold = k8s.io emptied + GC before each call (every blob is linked),
#       warm = k8s.io already holds the blobs (a re-tag); rebuild = each
#       name is a fresh variant (new config and manifest, written untimed
#       before the call) over the 50 layers k8s.io already holds.
#   A3  isolated content: replication as a byte copy vs raw Content.Write of
#       as many bytes (fresh random blobs, same sizes).
#   C   bursts of C_COUNT (200) concurrent Images.Create of new names for the
#       10-layer image in buildkit, over 20 connections: direct vs proxied
#       (each replicated into k8s.io and confirmed through CRI); total time
#       and failed calls. Also, straight on containerd: the floor (the
#       contract's records per name, marked as imgbridge writes them, + CRI
#       resolves) and CRI alone (one record per name in k8s.io + CRI
#       resolves), unmarked and marked managed: what waiting for CRI costs
#       by itself.
#   B   `imgbridge sync` over 500 records: out of sync (images/s) and in sync
#       (seconds, writes must be 0), vs a plain sequential copy.
#
# usage: scripts/bench-replication.sh            (as root; ~10-20 minutes)
# env:   ROUNDS=5 (A1, A3, B rounds: B uses B_ROUNDS=3)  A2_ROUNDS=20
#        A1_LAYER_MIB=4  A3_LAYER_MIB=64  B_IMAGES=500  B_TARGETS=10
#        UNPACK=1 (also A1 with unpack)  KEEP=1 (keep the temp dir)
#        IMGBRIDGE_BIN=path (benchmark another build; default target/release)
#        ONLY=a1,a2,c,b,a3 (run a subset of the phases)  C_COUNT=200
#        CACHE=dir (keep the built image archives there and reuse them)
#        BASELINE_BIN=path (a second imgbridge build, run next to the first as
#          one more alternating variant: before/after comparisons in one run)
#        IMGBRIDGE_TOML='...' (lines added to imgbridge's config, for example
#          $'[replication]\ndigest_refs = false')
# Only Debian packages (containerd, ctr, runc, umoci, skopeo) and cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
A2_ROUNDS=${A2_ROUNDS:-20}
B_ROUNDS=${B_ROUNDS:-3}
A1_LAYER_MIB=${A1_LAYER_MIB:-4}
A3_LAYER_MIB=${A3_LAYER_MIB:-64}
B_IMAGES=${B_IMAGES:-500}
B_TARGETS=${B_TARGETS:-10}
UNPACK=${UNPACK:-1}
C_COUNT=${C_COUNT:-200}
ONLY=${ONLY:-a1,a2,c,b,a3}
want() { [[ ",$ONLY," == *",$1,"* ]]; }

if [ "$(id -u)" != 0 ]; then echo "bench-replication.sh needs root (it runs a private containerd)"; exit 1; fi
missing=0
for b in containerd ctr runc umoci skopeo protoc; do command -v "$b" >/dev/null || missing=1; done
if [ $missing = 1 ]; then
  echo "== installing Debian packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    containerd runc protobuf-compiler skopeo umoci busybox-static ca-certificates >/dev/null
fi
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER

echo "== building (release)"
cargo build --release --quiet --bin imgbridge --example bench_replication
IB=${IMGBRIDGE_BIN:-target/release/imgbridge}
BENCH=target/release/examples/bench_replication

T=$(mktemp -d /tmp/imgbridge-bench.XXXXXX)
RES="$T/results"
: >"$RES"
ctrd_pid="" ib_pid="" base_pid=""
BASE=${BASELINE_BIN:-}
stop_pid() { # pid: TERM, wait, KILL if needed
  local p=$1
  [ -n "$p" ] || return 0
  kill "$p" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
  kill -9 "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}
stop_all() {
  stop_pid "$ib_pid"; ib_pid=""
  stop_pid "$base_pid"; base_pid=""
  stop_pid "$ctrd_pid"; ctrd_pid=""
  for s in "$T"/*/state; do if [ -d "$s" ]; then umount -R "$s" 2>/dev/null || true; fi; done
  true
}
cleanup() {
  stop_all
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $T"; else rm -rf "$T" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'echo "bench-replication.sh: interrupted by a signal" >&2; exit 130' INT TERM

now() { date +%s%N; }
wait_sock() { for _ in $(seq 400); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1"; exit 1; }
median() { sort -n | awk '{a[NR]=$1} END {if (NR==0) {print "nan"; exit} if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
fmt() { awk -v x="$1" 'BEGIN {printf "%.1f", x}'; }
div() { awk -v a="$1" -v b="$2" 'BEGIN {if (b+0 == 0) print "-"; else printf "%.2f", a/b}'; }
result() { echo "$*" >>"$RES"; }
get() { # key: value from the results file
  awk -v k="$1" '$1==k {print $2}' "$RES" | tail -1
}

snap=overlayfs
mkdir -p "$T/ovl/l" "$T/ovl/u" "$T/ovl/w" "$T/ovl/m"
if mount -t overlay overlay -o "lowerdir=$T/ovl/l,upperdir=$T/ovl/u,workdir=$T/ovl/w" "$T/ovl/m" 2>/dev/null; then
  umount "$T/ovl/m"
else
  snap=native
fi

# start_containerd DIR POLICY: a private containerd with CRI, pause imported.
start_containerd() {
  local d=$1 policy=$2
  mkdir -p "$d"
  local iso=()
  [ "$policy" = isolated ] && iso=(--isolated)
  scripts/lib/containerd-config.sh --dir "$d" --cri "${iso[@]}" --snapshotter "$snap" \
    --sandbox-image registry.k8s.io/pause:3.6 >"$d/config.toml"
  containerd --log-level warn --config "$d/config.toml" >"$d/containerd.log" 2>&1 &
  ctrd_pid=$!
  wait_sock "$d/containerd.sock"
  for _ in $(seq 200); do ctr -a "$d/containerd.sock" version >/dev/null 2>&1 && break; sleep 0.05; done
  ctr -a "$d/containerd.sock" -n k8s.io images import "$T/pause.tar" >/dev/null
  C="$d/containerd.sock"
}

# start_imgbridge DIR: imgbridge in front of $C. The reconciler is off so
# that writes made straight on containerd's socket (the "direct" variants
# and B's setup) are not replicated behind the benchmark's back.
start_imgbridge() {
  local d=$1
  cat >"$d/imgbridge.toml" <<TOML
ttrpc = false
[reconcile]
enabled = false
${IMGBRIDGE_TOML:-}
TOML
  "$IB" serve --config "$d/imgbridge.toml" --listen "$d/imgbridge.sock" --upstream "$C" >"$d/imgbridge.log" 2>&1 &
  ib_pid=$!
  wait_sock "$d/imgbridge.sock"
  P="$d/imgbridge.sock"
  PB="" BASEARG=()
  if [ -n "$BASE" ]; then
    "$BASE" serve --config "$d/imgbridge.toml" --listen "$d/baseline.sock" --upstream "$C" >"$d/baseline.log" 2>&1 &
    base_pid=$!
    wait_sock "$d/baseline.sock"
    PB="$d/baseline.sock" BASEARG=(--baseline "$PB")
  fi
}

clean() { "$BENCH" clean --containerd "$C" --keep registry.k8s.io/pause "$@" >/dev/null; }

# build_image NAME LAYERS BYTES_PER_LAYER OUT.tar: random-data layers (umoci),
# exported as a docker-archive (skopeo).
build_image() {
  local name=$1 layers=$2 bytes=$3 out=$4 l
  if [ -n "${CACHE:-}" ] && [ -s "$CACHE/$name-$layers-$bytes.tar" ]; then
    ln -sf "$CACHE/$name-$layers-$bytes.tar" "$out"; return
  fi
  local lay="$T/oci-$(basename "$out" .tar)"
  umoci init --layout "$lay" >/dev/null
  umoci new --image "$lay:img" >/dev/null
  for l in $(seq "$layers"); do
    rm -rf "$T/stage" && mkdir -p "$T/stage"
    head -c "$bytes" /dev/urandom >"$T/stage/layer$l.bin"
    umoci insert --image "$lay:img" "$T/stage" / >/dev/null
  done
  umoci config --image "$lay:img" --config.cmd /bin/true >/dev/null
  skopeo --insecure-policy copy -q "oci:$lay:img" "docker-archive:$out:$name"
  rm -rf "$lay" "$T/stage"
  if [ -n "${CACHE:-}" ]; then
    mkdir -p "$(dirname "$CACHE/$name")"
    mv "$out" "$CACHE/$name-$layers-$bytes.tar" && ln -sf "$CACHE/$name-$layers-$bytes.tar" "$out"
  fi
}

echo "== building images in $T (umoci, skopeo; random data)"
umoci init --layout "$T/oci-pause" >/dev/null
umoci new --image "$T/oci-pause:p" >/dev/null
umoci config --image "$T/oci-pause:p" --config.cmd /pause >/dev/null
skopeo --insecure-policy copy -q "oci:$T/oci-pause:p" "docker-archive:$T/pause.tar:registry.k8s.io/pause:3.6"
if want a1 || want b || want c; then build_image bench/a1:latest 10 $((A1_LAYER_MIB << 20)) "$T/a1.tar"; fi
if want a2; then build_image bench/a2:latest 50 65536 "$T/a2.tar"; fi
if want a3; then build_image bench/a3:latest 4 $((A3_LAYER_MIB << 20)) "$T/a3.tar"; fi
ls -lL "$T"/*.tar | awk '{printf "   %-40s %6.1f MiB\n", $NF, $5/1048576}'

echo "== shared content: containerd ($snap) + imgbridge"
start_containerd "$T/shared" shared
start_imgbridge "$T/shared"
"$IB" --version

# ---------------------------------------------------------------- A1
# import_rounds LABEL [ctr import flags]: alternating direct/proxy(/baseline) imports.
import_rounds() {
  local label=$1; shift
  local variants="direct proxy" r v sock t0 t1 order
  [ -n "$BASE" ] && variants="direct proxy base"
  for v in $variants; do : >"$T/$label.$v"; done
  # Warm-up through the proxy (page cache, CRI detection), not counted.
  clean --ns buildkit --ns k8s.io
  ctr -a "$P" -n buildkit images import "$@" "$T/a1.tar" >/dev/null
  for r in $(seq "$ROUNDS"); do
    order=$(echo $variants | tr ' ' '\n' | awk -v r="$r" '{a[NR-1]=$0} END {for (i=0;i<NR;i++) print a[(i+r)%NR]}')
    if [ $((r % 2)) = 0 ]; then order=$(echo "$order" | tac); fi
    for v in $order; do
      clean --ns buildkit --ns k8s.io
      case $v in direct) sock=$C;; proxy) sock=$P;; base) sock=$PB;; esac
      t0=$(now)
      ctr -a "$sock" -n buildkit images import "$@" "$T/a1.tar" >/dev/null
      t1=$(now)
      echo $(( (t1 - t0) / 1000 )) | awk '{print $1/1000}' >>"$T/$label.$v"
      if [ "$v" != direct ] && ! grep -qx docker.io/bench/a1:latest <<<"$(ctr -a "$C" -n k8s.io images ls -q)"; then
        echo "replica missing in k8s.io after a proxied import"; exit 1
      fi
    done
  done
  local m
  for v in $variants; do
    m=$(median <"$T/$label.$v")
    printf '   %-14s %-7s median %8.1f ms   runs: %s\n' "$label" "$v" "$m" "$(tr '\n' ' ' <"$T/$label.$v")"
    result "$label.$v $m"
  done
}
if want a1; then
echo "== A1: ctr import of a 10 x ${A1_LAYER_MIB} MiB image into buildkit, $ROUNDS rounds"
import_rounds a1_nounpack --no-unpack
if [ "$UNPACK" = 1 ]; then import_rounds a1_unpack; fi
clean --ns buildkit --ns k8s.io
fi

# ---------------------------------------------------------------- A2
if want a2; then
echo "== A2: Images.Create of a new name for a 50-layer image, $A2_ROUNDS rounds per mode"
ctr -a "$C" -n buildkit images import --no-unpack "$T/a2.tar" >/dev/null
"$BENCH" create --containerd "$C" --proxy "$P" "${BASEARG[@]}" --image docker.io/bench/a2:latest --rounds "$A2_ROUNDS" --cold --keep registry.k8s.io/pause | tee "$T/a2cold.out"
"$BENCH" create --containerd "$C" --proxy "$P" "${BASEARG[@]}" --image docker.io/bench/a2:latest --rounds "$A2_ROUNDS" --keep registry.k8s.io/pause | tee "$T/a2warm.out"
"$BENCH" create --containerd "$C" --proxy "$P" "${BASEARG[@]}" --image docker.io/bench/a2:latest --rounds "$A2_ROUNDS" --rebuild --keep registry.k8s.io/pause | tee "$T/a2rebuild.out"
for f in a2cold a2warm a2rebuild; do
  grep '^RESULT' "$T/$f.out" | tr ' ' '\n' | grep = | sed "s/^/$f./; s/=/ /" >>"$RES"
done
clean --ns buildkit --ns k8s.io
fi

# ---------------------------------------------------------------- C
if want c; then
echo "== C: bursts of $C_COUNT concurrent Images.Create, $ROUNDS rounds per mode"
ctr -a "$C" -n buildkit images import --no-unpack "$T/a1.tar" >/dev/null
"$BENCH" burst --containerd "$C" --proxy "$P" --image docker.io/bench/a1:latest --count "$C_COUNT" --rounds "$ROUNDS" \
  --keep registry.k8s.io/pause --keep docker.io/bench/a1 | tee "$T/c.out"
grep '^RESULT' "$T/c.out" | sed 's/^RESULT /c./' >>"$RES"
clean --ns buildkit --ns k8s.io
fi

# ---------------------------------------------------------------- B
if want b; then
echo "== B: reconcile over $B_IMAGES records ($B_TARGETS targets of the 10-layer image), $B_ROUNDS rounds"
ctr -a "$C" -n buildkit images import --no-unpack "$T/a1.tar" >/dev/null
"$BENCH" records --containerd "$C" --image docker.io/bench/a1:latest --count "$B_IMAGES" --targets "$B_TARGETS" --prefix bench-b-
ctr -a "$C" -n buildkit images rm docker.io/bench/a1:latest >/dev/null
n=$(ctr -a "$C" -n buildkit images ls -q | wc -l)
[ "$n" = "$B_IMAGES" ] || { echo "expected $B_IMAGES records in buildkit, found $n"; exit 1; }
: >"$T/b.insync.writes"
bvariants="sync seq"
[ -n "$BASE" ] && bvariants="sync seq base"
for v in $bvariants; do : >"$T/b.$v"; : >"$T/b.$v.insync"; done
# sync_round LABEL BIN: one out-of-sync pass, then two in-sync passes.
sync_round() {
  local v=$1 bin=$2 t0 t1 out w i
  t0=$(now)
  out=$("$bin" sync --config "$T/shared/imgbridge.toml" --upstream "$C" 2>>"$T/sync.log")
  t1=$(now)
  echo "   round $r $v out of sync: $out in $(( (t1 - t0) / 1000000 )) ms"
  echo $(( (t1 - t0) / 1000 )) | awk '{print $1/1e6}' >>"$T/b.$v"
  for i in 1 2; do
    t0=$(now)
    out=$("$bin" sync --config "$T/shared/imgbridge.toml" --upstream "$C" 2>>"$T/sync.log")
    t1=$(now)
    echo "   round $r $v in sync #$i: $out in $(( (t1 - t0) / 1000000 )) ms"
    echo $(( (t1 - t0) / 1000 )) | awk '{print $1/1e6}' >>"$T/b.$v.insync"
    w=$(echo "$out" | sed -n 's/.*, \([0-9]*\) writes.*/\1/p')
    [ "$v" = sync ] && echo "$w" >>"$T/b.insync.writes"
  done
}
for r in $(seq "$B_ROUNDS"); do
  order=$(echo $bvariants | tr ' ' '\n' | awk -v r="$r" '{a[NR-1]=$0} END {for (i=0;i<NR;i++) print a[(i+r)%NR]}')
  if [ $((r % 2)) = 0 ]; then order=$(echo "$order" | tac); fi
  for v in $order; do
    clean --ns k8s.io; sleep 1
    case $v in
      sync) sync_round sync "$IB" ;;
      base) sync_round base "$BASE" ;;
      seq)
        t0=$(now)
        out=$("$BENCH" seqcopy --containerd "$C" --prefix bench-b-)
        t1=$(now)
        echo "   round $r $out (process: $(( (t1 - t0) / 1000000 )) ms)"
        echo $(( (t1 - t0) / 1000 )) | awk '{print $1/1e6}' >>"$T/b.seq"
        ;;
    esac
  done
done
s=$(median <"$T/b.sync"); i=$(median <"$T/b.sync.insync"); q=$(median <"$T/b.seq")
result "b.sync_s $s"; result "b.insync_s $i"; result "b.seq_s $q"
result "b.insync_writes_max $(sort -n "$T/b.insync.writes" | tail -1)"
if [ -n "$BASE" ]; then
  result "b.base_sync_s $(median <"$T/b.base")"; result "b.base_insync_s $(median <"$T/b.base.insync")"
fi
echo "   medians: out-of-sync pass $(fmt "$s") s, in-sync pass $(fmt "$i") s, sequential copy $(fmt "$q") s"
fi
stop_all

# ---------------------------------------------------------------- A3
if want a3; then
echo "== A3: isolated content: containerd + imgbridge"
start_containerd "$T/isolated" isolated
start_imgbridge "$T/isolated"
ctr -a "$C" -n buildkit images import --no-unpack "$T/a3.tar" >/dev/null
"$BENCH" isolated --containerd "$C" --proxy "$P" "${BASEARG[@]}" --image docker.io/bench/a3:latest --rounds "$ROUNDS" --keep registry.k8s.io/pause | tee "$T/a3.out"
grep '^RESULT' "$T/a3.out" | tr ' ' '\n' | grep = | sed "s/^/a3./; s/=/ /" >>"$RES"
stop_all
fi

# ---------------------------------------------------------------- summary
met() { awk -v x="$1" -v op="$2" -v t="$3" 'BEGIN {ok = (op=="<=") ? (x<=t) : (x>=t); print ok ? "yes" : "NO"}'; }
row() { printf '| %-48s | %14s | %14s | %8s | %-17s | %-4s | %s\n' "$@"; }
bl() { if [ -n "$BASE" ]; then echo "$1 |"; else echo ""; fi; }
a1d=$(get a1_nounpack.direct); a1p=$(get a1_nounpack.proxy); a1r=$(div "$a1p" "$a1d")
a2cd=$(get a2cold.direct_ms); a2cp=$(get a2cold.proxy_ms); a2ca=$(get a2cold.added_ms)
a2wd=$(get a2warm.direct_ms); a2wp=$(get a2warm.proxy_ms); a2wa=$(get a2warm.added_ms)
a3raw=$(get a3.raw_par_mbps); a3seq=$(get a3.raw_seq_mbps); a3cp=$(get a3.copy_mbps)
a3r=$(get a3.ratio_vs_par); a3rs=$(get a3.ratio_vs_seq)
bs=$(get b.sync_s); bi=$(get b.insync_s); bq=$(get b.seq_s); bw=$(get b.insync_writes_max)
ips() { awk -v n="$B_IMAGES" -v s="$1" 'BEGIN {if (s+0 == 0) print "-"; else printf "%.0f img/s", n/s}'; }
echo
echo "== summary (medians; $(nproc) cores, load at end: $(cut -d' ' -f1-3 /proc/loadavg))"
[ -n "$BASE" ] && echo "   last column: baseline build $BASE"
row figure direct imgbridge ratio target met? "$(bl baseline)"
row "------" "------" "---------" "-----" "------" "----" "$(bl --------)"
if want a1; then
  row "A1 import 10x${A1_LAYER_MIB}MiB --no-unpack (ms)" "$(fmt "$a1d")" "$(fmt "$a1p")" "$a1r" "ratio <= 1.15" "$(met "$a1r" '<=' 1.15)" \
    "$(bl "$(fmt "$(get a1_nounpack.base)") ($(div "$(get a1_nounpack.base)" "$a1d"))")"
  if [ "$UNPACK" = 1 ]; then
    u1d=$(get a1_unpack.direct); u1p=$(get a1_unpack.proxy); u1r=$(div "$u1p" "$u1d")
    row "A1 import 10x${A1_LAYER_MIB}MiB, unpack (ms)" "$(fmt "$u1d")" "$(fmt "$u1p")" "$u1r" "ratio <= 1.15" "$(met "$u1r" '<=' 1.15)" \
      "$(bl "$(fmt "$(get a1_unpack.base)") ($(div "$(get a1_unpack.base)" "$u1d"))")"
  fi
fi
if want a2; then
  row "A2 Create 50 layers, cold: all linked (ms)" "$(fmt "$a2cd")" "$(fmt "$a2cp")" "+$(fmt "$a2ca")" "added <= 60 ms" "$(met "$a2ca" '<=' 60)" \
    "$(bl "$(fmt "$(get a2cold.base_ms)") (+$(fmt "$(get a2cold.base_added_ms)"))")"
  row "A2   containerd floor for the same links (ms)" "-" "$(fmt "$(get a2cold.floor_ms)")" "-" "(reference)" "-" "$(bl "")"
  row "A2 Create 50 layers, warm: re-tag (ms)" "$(fmt "$a2wd")" "$(fmt "$a2wp")" "+$(fmt "$a2wa")" "added <= 60 ms" "$(met "$a2wa" '<=' 60)" \
    "$(bl "$(fmt "$(get a2warm.base_ms)") (+$(fmt "$(get a2warm.base_added_ms)"))")"
  row "A2 Create 50 layers, rebuild: new config+manifest (ms)" "$(fmt "$(get a2rebuild.direct_ms)")" "$(fmt "$(get a2rebuild.proxy_ms)")" \
    "+$(fmt "$(get a2rebuild.added_ms)")" "added <= 60 ms" "$(met "$(get a2rebuild.added_ms)" '<=' 60)" \
    "$(bl "$(fmt "$(get a2rebuild.base_ms)") (+$(fmt "$(get a2rebuild.base_added_ms)"))")"
fi
if want c; then
  cr=$(get c.burst_ratio)
  row "C $C_COUNT concurrent Creates: total (ms)" "$(fmt "$(get c.burst_direct_ms)")" "$(fmt "$(get c.burst_proxy_ms)")" "$cr" "ratio <= 2" "$(met "$cr" '<=' 2)" "$(bl "")"
  row "C   floor: the contract's records/name + CRI resolves (ms)" "-" "$(fmt "$(get c.burst_floor_ms)")" "$(get c.burst_floor_ratio)" "(reference)" "-" "$(bl "")"
  row "C   imgbridge vs that floor" "-" "-" "$(get c.burst_ratio_vs_floor)" "(reference)" "-" "$(bl "")"
  row "C   CRI alone, unmarked: 1 record/name + CRI resolves (ms)" "-" "$(fmt "$(get c.burst_cri_alone_ms)")" "$(get c.burst_cri_alone_ratio)" "(reference)" "-" "$(bl "")"
  row "C   CRI alone, marked managed (ms)" "-" "$(fmt "$(get c.burst_cri_marked_ms)")" "$(get c.burst_cri_marked_ratio)" "(reference)" "-" "$(bl "")"
  cf=$(get c.burst_proxy_failed)
  row "C   failed calls (direct / proxied)" "$(get c.burst_direct_failed)" "$cf" "-" "0 proxied" "$(met "$cf" '<=' 0)" "$(bl "")"
fi
if want a3; then
  row "A3 isolated copy vs raw Write x16 (MB/s)" "$(fmt "$a3raw")" "$(fmt "$a3cp")" "$a3r" "ratio >= 0.8" "$(met "$a3r" '>=' 0.8)" \
    "$(bl "$(fmt "$(get a3.base_mbps)") ($(get a3.base_ratio_vs_par))")"
  row "A3 isolated copy vs raw Write x1 (MB/s)" "$(fmt "$a3seq")" "$(fmt "$a3cp")" "$a3rs" "ratio >= 0.8" "$(met "$a3rs" '>=' 0.8)" "$(bl "")"
fi
if want b; then
  row "B $B_IMAGES images in sync: pass (s), writes" "-" "$(fmt "$bi") s, $bw w" "-" "<= 2 s, 0 writes" "$(awk -v s="$bi" -v w="$bw" 'BEGIN {print (s<=2 && w==0) ? "yes" : "NO"}')" \
    "$(bl "$(fmt "$(get b.base_insync_s)") s")"
  row "B $B_IMAGES images out of sync (images/s)" "$(ips "$bq") (seq)" "$(ips "$bs")" "$(div "$bq" "$bs")" "report" "-" \
    "$(bl "$(ips "$(get b.base_sync_s)")")"
fi
true
