#!/usr/bin/env bash
# imgbridge against direct containerd and against two floors, all in one run:
# "floor", a minimal tokio byte relay (examples/floor_relay.rs, every byte
# copied through a user-space buffer), and "splice", a splice(2) byte relay
# (examples/splice_relay.rs, socket -> pipe -> socket, no user-space copy).
# Neither parses HTTP/2: each does strictly less than any correct proxy.
#
# Starts a throwaway containerd (temp root/state/sockets, CRI disabled), the
# two floor relays and `imgbridge serve` in front of it, then measures:
#   unary   BENCH_CALLS sequential Version calls per socket and client (Rust,
#           grpc-go, Python grpcio: BENCH_CLIENTS), interleaved across
#           the sockets in blocks of BENCH_BLOCK calls (p50/p90/p99 per call).
#           Not one by one: a relay's work after its reply (bookkeeping, a tokio
#           socket's writability wake-ups) overlaps the client's next call, and
#           one by one it was charged to the next socket (the same imgbridge
#           binary measured 3-5 µs slower in the slot after the floor relay
#           than in the slot after itself); in blocks each pays its own.
#   write   Content.Write of BENCH_SIZE_MB MiB of fresh random bytes (MB/s)
#   read    Content.Read of a BENCH_SIZE_MB MiB blob (MB/s)
#   read×N  BENCH_READERS concurrent Content.Read streams of it (aggregate MB/s)
#   RSS     imgbridge's peak RSS (VmHWM) at the end, i.e. over all of the above
# Every test runs BENCH_ROUNDS rounds; each round visits every target, in an
# order rotated per round, so drift on this noisy machine hits all alike.
# Reported: medians over rounds; ratios are medians of the per-round ratios.
#
# Needs Debian's containerd and cargo (go and python3-grpcio for the other
# unary clients). Environment:
#   BENCH_SIZE_MB=1024 BENCH_CALLS=5000 BENCH_WARMUP=200 BENCH_BLOCK=20 BENCH_ROUNDS=3
#   BENCH_NS=bench (buildkit: writes in a source namespace, watched)
#   BENCH_READERS=8 BENCH_NO_BUILD=1 (skip cargo build) BENCH_KEEP=1 (keep temp dir)
#   BENCH_CLIENTS="rust go python" (unary clients: our Rust bench_client;
#       grpc-go, tests/peers/grpcbench via scripts/peers.sh, needs go;
#       Python grpcio, scripts/lib/grpcbench.py, needs python3-grpcio;
#       one missing is skipped with a note)
#   BENCH_DIR=<dir for containerd's root and the sockets>: by default /dev/shm
#       when it has room for four times BENCH_SIZE_MB, else /tmp. On disk, the
#       write figure measured the disk's writeback (the same target ranged
#       from 129 to 211 MB/s within one run), not the hop.
#   BENCH_BASELINE=/path/to/another/imgbridge  (adds it as a 5th target: A/B
#                  a change against the previous build in the same run)
#   BENCH_RUST_LOG=info (imgbridge's log filter) CONTAINERD=containerd
#   BENCH_PUSH=1   runs the unary rounds under a push load: imgbridge serves its
#                  registry endpoint ([registry], docs/registry.md) and a loop
#                  uploads 32 MiB random blobs to it (curl) for as long as the
#                  unary rounds last, so the table shows whether the endpoint
#                  stalls the splice (all targets run under the same load;
#                  compare imgbridge's overhead over the floor with a run
#                  without it)
# Quick run: BENCH_SIZE_MB=64 BENCH_CALLS=500 BENCH_ROUNDS=1 scripts/bench.sh
# Everything (proxy, replication/reconcile, import, pull-list parse): BENCH_ALL=1 scripts/bench.sh
set -euo pipefail

SIZE_MB=${BENCH_SIZE_MB:-1024}
CALLS=${BENCH_CALLS:-5000}
WARMUP=${BENCH_WARMUP:-200}
BLOCK=${BENCH_BLOCK:-20}
ROUNDS=${BENCH_ROUNDS:-3}
READERS=${BENCH_READERS:-8}
CONTAINERD=${CONTAINERD:-containerd}
# BENCH_NS=buildkit measures writes in a source namespace, where imgbridge
# watches each Content.Write for COMMITs that replicas wait for.
NS=${BENCH_NS:-bench}
CLIENTS=${BENCH_CLIENTS:-rust go python}

cd "$(dirname "$0")/.."
if [[ -z ${BENCH_NO_BUILD:-} ]]; then
    cargo build --release --examples --bins >&2
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
rel=${target_dir:-target}/release
client=$rel/examples/bench_client
for b in "$rel/imgbridge" "$rel/examples/floor_relay" "$rel/examples/splice_relay" "$client"; do
    [[ -x $b ]] || { echo "missing $b (build failed?)" >&2; exit 1; }
done
command -v "$CONTAINERD" >/dev/null || { echo "containerd not found (apt-get install containerd)" >&2; exit 1; }

if [[ -z ${BENCH_DIR:-} ]]; then
    BENCH_DIR=/tmp
    shm_mb=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
    if [[ -w /dev/shm && ${shm_mb:-0} -gt $((SIZE_MB * 4 + 256)) ]]; then BENCH_DIR=/dev/shm; fi
fi
tmp=$(mktemp -d "$BENCH_DIR/imgbridge-bench.XXXXXX")
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [[ -z ${BENCH_KEEP:-} ]]; then rm -rf "$tmp"; else echo "kept $tmp" >&2; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { printf '[bench] %s\n' "$*" >&2; }

# --- daemons ---------------------------------------------------------------
cd_sock=$tmp/containerd.sock
scripts/lib/containerd-config.sh --dir "$tmp" --containerd "$CONTAINERD" --socket "$cd_sock" >"$tmp/containerd.toml"
"$CONTAINERD" --config "$tmp/containerd.toml" >"$tmp/containerd.log" 2>&1 &
pids+=($!)

wait_up() { # socket
    local i
    for i in $(seq 100); do
        if [[ -S $1 ]] && "$client" unary --sockets "$1" --calls 1 --warmup 0 >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    echo "$1 did not come up; logs in $tmp" >&2
    BENCH_KEEP=1
    exit 1
}
wait_up "$cd_sock"

names=(direct floor splice imgbridge)
socks=("$cd_sock" "$tmp/floor.sock" "$tmp/splice.sock" "$tmp/imgbridge.sock")
"$rel/examples/floor_relay" "$tmp/floor.sock" "$cd_sock" 2>"$tmp/floor.log" &
pids+=($!)
floor_pid=$!
"$rel/examples/splice_relay" "$tmp/splice.sock" "$cd_sock" 2>"$tmp/splice.log" &
pids+=($!)
splice_pid=$!
: >"$tmp/imgbridge.toml"
if [[ -n ${BENCH_PUSH:-} ]]; then
    command -v curl >/dev/null || { echo "BENCH_PUSH needs curl" >&2; exit 1; }
    # A short expiry: the uploads' leases go soon, and their deletes below
    # let containerd collect them (the root may be a tmpfs).
    printf '[registry]\nlisten = "127.0.0.1:0"\nupload_expiry = "2s"\n' >"$tmp/imgbridge.toml"
fi
start_imgbridge() { # binary socket logfile
    RUST_LOG=${BENCH_RUST_LOG:-info} "$1" serve --config "$tmp/imgbridge.toml" \
        --listen "$2" --upstream "$cd_sock" 2>"$3" &
    pids+=($!)
}
start_imgbridge "$rel/imgbridge" "$tmp/imgbridge.sock" "$tmp/imgbridge.log"
ib_pid=$!
procs=("" "$floor_pid" "$splice_pid" "$ib_pid") # whose CPU time a target costs (direct: none)
if [[ -n ${BENCH_BASELINE:-} ]]; then
    start_imgbridge "$BENCH_BASELINE" "$tmp/baseline.sock" "$tmp/baseline.log"
    base_pid=$!
    names+=(baseline)
    socks+=("$tmp/baseline.sock")
    procs+=("$base_pid")
fi
for s in "${socks[@]}"; do wait_up "$s"; done
n=${#names[@]}
log "containerd $("$CONTAINERD" --version | awk '{print $3}'), targets: ${names[*]}, tmp $tmp"

res=$tmp/results # lines: test round target value
: >"$res"
order() { # round -> indices rotated by round
    local r=$1 k
    for ((k = 0; k < n; k++)); do echo $(((k + r) % n)); done
}
kv() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
hz=$(getconf CLK_TCK)
cpu_ticks() { if [[ -n $1 ]]; then awk '{print $14 + $15}' "/proc/$1/stat"; else echo 0; fi; }

# --- push load (BENCH_PUSH) -------------------------------------------------
# One upload after another of a fresh 32 MiB random blob: POST a session,
# PATCH the bytes, PUT the digest. Appends each finished size to $tmp/pushed.
push_loop() { # registry addr
    local f=$tmp/push.blob loc d
    while :; do
        head -c 32M /dev/urandom >"$f"
        d=sha256:$(sha256sum "$f" | cut -d' ' -f1)
        loc=$(curl -sf -o /dev/null -D - -X POST "http://$1/v2/load/blobs/uploads/" |
            sed -n 's/^[Ll]ocation: *\([^[:space:]]*\).*/\1/p')
        [[ -n $loc ]] || continue
        curl -sf -o /dev/null -X PATCH -H 'Content-Type: application/octet-stream' \
            --data-binary "@$f" "http://$1$loc" || continue
        curl -sf -o /dev/null -X PUT "http://$1$loc?digest=$d" && echo 32 >>"$tmp/pushed"
        curl -sf -o /dev/null -X DELETE "http://$1/v2/load/blobs/$d" || true
    done
}
push_pid=
if [[ -n ${BENCH_PUSH:-} ]]; then
    reg=
    for i in $(seq 100); do
        reg=$(sed -n 's/.*registry endpoint:.* listen=\([^ ]*\).*/\1/p' "$tmp/imgbridge.log" | head -1)
        [[ -n $reg ]] && break
        sleep 0.1
    done
    [[ -n $reg ]] || { echo "imgbridge did not log its registry endpoint" >&2; exit 1; }
    : >"$tmp/pushed"
    push_loop "$reg" &
    push_pid=$!
    pids+=("$push_pid")
    log "push load on $reg during the unary rounds"
fi

# --- unary -----------------------------------------------------------------
# Each client runs the same rounds: imgbridge's own Rust client (tests
# "unary_*"), grpc-go, the stack of kubelet, ctr and buildkit ("go_unary_*",
# tests/peers/grpcbench), and Python grpcio ("py_unary_*",
# scripts/lib/grpcbench.py). They frame and wake differently, so a hop's
# cost is not the same for each (docs/performance.md).
unary_rounds() { # test-prefix client-command...
    local pre=$1 r i out line p
    shift
    for ((r = 0; r < ROUNDS; r++)); do
        idx=($(order $r))
        list=$(for i in "${idx[@]}"; do printf '%s,' "${socks[$i]}"; done)
        log "${pre}unary round $((r + 1))/$ROUNDS: $CALLS calls per target"
        c0=(); for i in "${idx[@]}"; do c0[i]=$(cpu_ticks "${procs[$i]}"); done
        out=$("$@" --sockets "${list%,}" --calls "$CALLS" --warmup "$WARMUP" --block "$BLOCK")
        for i in "${idx[@]}"; do
            if [[ -n ${procs[$i]} ]]; then
                echo "${pre}unary_cpu $r ${names[$i]} $(awk -v t=$(($(cpu_ticks "${procs[$i]}") - c0[i])) \
                    -v hz="$hz" -v n=$((CALLS + WARMUP)) 'BEGIN {print t / hz * 1e6 / n}')" >>"$res"
            fi
            line=$(grep -F "socket=${socks[$i]} " <<<"$out")
            for p in p50 p90 p99; do
                echo "${pre}unary_$p $r ${names[$i]} $(kv ${p}_us <<<"$line")" >>"$res"
            done
        done
    done
}
unary_rounds "" "$client" unary
clients=(rust)
if [[ " $CLIENTS " == *" go "* ]]; then
    if gobench=$(scripts/peers.sh fetch grpcbench 2>"$tmp/peers.log" | awk '{print $3 "/grpcbench"}') &&
        [[ -x $gobench ]]; then
        unary_rounds go_ "$gobench"
        clients+=(go)
    else
        log "no grpc-go client (scripts/peers.sh fetch grpcbench failed: needs go; $tmp/peers.log)"
    fi
fi
if [[ " $CLIENTS " == *" python "* ]]; then
    # Debian's python3-grpcio is in /usr/bin/python3's path, which a
    # python3 of pyenv's or a venv's before it on PATH does not see.
    py=
    for p in python3 /usr/bin/python3; do
        if "$p" -c 'import grpc' 2>/dev/null; then py=$p; break; fi
    done
    if [[ -n $py ]]; then
        unary_rounds py_ "$py" scripts/lib/grpcbench.py
        clients+=(python)
    else
        log "no Python grpcio client (apt-get install python3-grpcio)"
    fi
fi

if [[ -n $push_pid ]]; then
    kill "$push_pid" 2>/dev/null || true
    wait "$push_pid" 2>/dev/null || true
    log "pushed $(awk '{s += $1} END {print s + 0}' "$tmp/pushed") MiB to the endpoint during the unary rounds"
fi

# --- streaming -------------------------------------------------------------
bytes=$((SIZE_MB << 20))
log "creating the ${SIZE_MB} MiB blob to read"
digest=$("$client" write --socket "$cd_sock" --ns $NS --size $bytes | kv digest)
"$client" read --socket "$cd_sock" --ns $NS --digest "$digest" >/dev/null # page cache

stream_test() { # name, GiB moved per run, then client args after --socket S
    local test=$1 gib=$2 r i v c0 out
    shift 2
    for ((r = 0; r < ROUNDS; r++)); do
        for i in $(order $r); do
            # Each write starts with no dirty pages left by the one before:
            # otherwise their writeback lands on every other run, and a
            # target's result depends on its position in the round.
            if [[ $test == write ]]; then sync; fi
            c0=$(cpu_ticks "${procs[$i]}")
            out=$("$client" "$1" --socket "${socks[$i]}" "${@:2}")
            v=$(kv mbps <<<"$out")
            log "$test round $((r + 1))/$ROUNDS ${names[$i]}: $v MB/s"
            echo "$test $r ${names[$i]} $v" >>"$res"
            if [[ -n ${procs[$i]} ]]; then
                echo "${test}_cpu $r ${names[$i]} $(awk -v t=$(($(cpu_ticks "${procs[$i]}") - c0)) \
                    -v hz="$hz" -v g="$gib" 'BEGIN {print t / hz * 1000 / g}')" >>"$res"
            fi
        done
    done
}
gib=$(awk -v m="$SIZE_MB" 'BEGIN {print m / 1024}')
stream_test write "$gib" write --ns $NS --size $bytes --delete
stream_test read "$gib" read --ns $NS --digest "$digest" --concurrency 1
stream_test readN "$(awk -v g="$gib" -v n="$READERS" 'BEGIN {print g * n}')" \
    read --ns $NS --digest "$digest" --concurrency "$READERS"

hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }
rss_ib=$(hwm_kib $ib_pid)
rss_floor=$(hwm_kib $floor_pid)
rss_splice=$(hwm_kib $splice_pid)
rss_base=
if [[ -n ${base_pid:-} ]]; then rss_base=$(hwm_kib "$base_pid"); fi

# --- report ----------------------------------------------------------------
median() { sort -g | awk '{a[NR] = $1} END {if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
val() { awk -v t="$1" -v g="$2" '$1 == t && $3 == g {print $4}' "$res" | median; }
# per-round f(target value, reference value), then the median
paired() { # test target ref mode(ratio|overhead)
    awk -v t="$1" -v g="$2" -v ref="$3" -v m="$4" -v d=direct '
        $1 == t {v[$2, $3] = $4; rounds[$2] = 1}
        END {
            for (r in rounds) {
                if (m == "ratio") { if (v[r, ref] != 0) print v[r, g] / v[r, ref] }
                else if (v[r, ref] != v[r, d]) print (v[r, g] - v[r, d]) / (v[r, ref] - v[r, d])
            }
        }' "$res" | median
}
overhead() { awk -v t="$1" -v g="$2" '$1 == t {v[$2, $3] = $4; rounds[$2] = 1}
    END {for (r in rounds) print v[r, g] - v[r, "direct"]}' "$res" | median; }

echo
echo "imgbridge benchmark: $ROUNDS round(s), $CALLS unary calls per target, ${SIZE_MB} MiB streams, $READERS readers"
echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+dirty'), $(nproc) CPUs, $(date -u +%FT%TZ), containerd root in $BENCH_DIR"
cols=("${names[@]}")
printf '%-22s' metric; printf '%11s' "${cols[@]}"; printf '%12s%12s%12s%12s  %s\n' "ib/floor" "ib/direct" \
    "floor/dir" "splice/dir" target
row() { # label test ratio-kind target-text
    local label=$1 test=$2 kind=$3 goal=$4 g
    printf '%-22s' "$label"
    for g in "${cols[@]}"; do printf '%11.1f' "$(val "$test" "$g")"; done
    case $kind in
        lat) printf '%12s%12s' "$(printf '%.2f' "$(paired "$test" imgbridge floor overhead)")" \
            "$(printf '%.2f' "$(paired "$test" imgbridge direct ratio)")" ;;
        tput) printf '%12s%12s' "$(printf '%.3f' "$(paired "$test" imgbridge floor ratio)")" \
            "$(printf '%.3f' "$(paired "$test" imgbridge direct ratio)")" ;;
    esac
    # both floors against direct (plain per-round ratios)
    for g in floor splice; do printf '%12s' "$(printf '%.3f' "$(paired "$test" "$g" direct ratio)")"; done
    printf '  %s\n' "$goal"
}
for c in "${clients[@]}"; do
    case $c in rust) pre= ;; go) pre=go_ ;; python) pre=py_ ;; esac
    row "$c unary p50 (us)" ${pre}unary_p50 lat "overhead ratio <= 1.0"
    row "$c unary p90 (us)" ${pre}unary_p90 lat ""
    row "$c unary p99 (us)" ${pre}unary_p99 lat ""
    printf '%-22s%11s' "$c p50 overhead" "-"
    for g in "${cols[@]:1}"; do printf '%+11.1f' "$(overhead ${pre}unary_p50 "$g")"; done
    echo "  (us over direct, per-round median)"
done
row "write MB/s" write tput ">= 0.95 of floor"
row "read MB/s" read tput ">= 0.95 of floor"
row "${READERS}x read MB/s" readN tput ">= 0.95 of floor"
cpu_row() { # label test
    local g
    printf '%-22s%11s' "$1" "-"
    for g in "${cols[@]:1}"; do printf '%11.1f' "$(val "$2" "$g")"; done
    printf '%12s\n' "$(printf '%.2f' "$(paired "$2" imgbridge floor ratio)")"
}
echo "CPU time of the relaying process (user+sys, proxies only; less noisy than wall time):"
for c in "${clients[@]}"; do
    case $c in rust) pre= ;; go) pre=go_ ;; python) pre=py_ ;; esac
    cpu_row "  us per call ($c)" ${pre}unary_cpu
done
cpu_row "  ms per GiB write" write_cpu
cpu_row "  ms per GiB read" read_cpu
cpu_row "  ms per GiB ${READERS}x read" readN_cpu
printf '%-22s%11s%11.1f%11.1f%11.1f' "peak RSS (MiB)" "-" "$(awk -v k="$rss_floor" 'BEGIN{print k/1024}')" \
    "$(awk -v k="$rss_splice" 'BEGIN{print k/1024}')" "$(awk -v k="$rss_ib" 'BEGIN{print k/1024}')"
if [[ -n $rss_base ]]; then printf '%11.1f' "$(awk -v k="$rss_base" 'BEGIN{print k/1024}')"; fi
printf '%24s  %s\n' "" "imgbridge <= 32 MiB"
if [[ -n ${BENCH_BASELINE:-} ]]; then
    echo "imgbridge vs baseline: unary p50 overhead $(printf '%.2f' "$(paired unary_p50 imgbridge baseline overhead)")x," \
        "write $(printf '%.3f' "$(paired write imgbridge baseline ratio)")x," \
        "read $(printf '%.3f' "$(paired read imgbridge baseline ratio)")x," \
        "${READERS}x read $(printf '%.3f' "$(paired readN imgbridge baseline ratio)")x"
fi
if [[ -n ${BENCH_RAW:-} ]]; then
    echo "raw results (test round target value):"
    cat "$res"
fi

# The replication/reconcile, import and pull-list benchmarks live in their
# own scripts (they need CRI and large archives); BENCH_ALL=1 runs them
# after this one.
if [[ -n ${BENCH_ALL:-} ]]; then
    scripts/bench-replication.sh
    scripts/bench-import.sh
    scripts/bench-pull-list.sh
fi
