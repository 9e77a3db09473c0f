#!/usr/bin/env bash
# Benchmarks a push to imgbridge's registry endpoint (docs/registry.md)
# against the two ways images reach a node today, each measured until CRI
# resolves the image in k8s.io (what kubelet needs before it can start a pod):
#
#   endpoint   skopeo copy oci:DIR docker://127.0.0.1:P/bench:N   (imgbridge
#              answers the manifest PUT once CRI resolves the name; checked)
#   registry   skopeo copy … to a loopback docker-registry (Debian's
#              distribution), then crictl pull (CRI PullImage into k8s.io)
#   import     skopeo copy … docker-archive:X.tar (docker save), then
#              ctr -n k8s.io images import X.tar (kind load)
#   floor      ctr content ingest of the blobs a push must move (every blob
#              first, then only the rebuild's new ones), all at once, into
#              a fresh containerd: containerd's own write of those bytes
#              and nothing else (no client, HTTP, record, replication or
#              CRI), so strictly less than any design of the endpoint
#
# The image: $LAYERS uncompressed layers of $LAYER_MIB MiB random data
# (about 500 MiB), pushed first whole, then rebuilt with its top layer
# changed ("rebuild"). Each path runs on a fresh containerd (with CRI) in its
# own root, $ROUNDS rounds, the order alternating; it reports medians with
# their spread and the per-round ratios. Also reports imgbridge's peak RSS
# after the endpoint runs (VmHWM), and after a push of a small image on a
# fresh imgbridge, to show it does not grow with the image size. With
# IMGBRIDGE_BASE (e.g. the build before a change) a path "base" runs the
# endpoint's push on that build too; PATHS picks paths (e.g. PATHS="endpoint
# base floor").
#
# MODE=blob measures ONE blob's write instead, on one containerd (with CRI)
# and one imgbridge (two with IMGBRIDGE_BASE): $LAYER_MIB MiB of random
# bytes each time (the same bytes, their first 16 changed per write so that
# every write is of a blob containerd does not have: one it has would be
# shared, not written), timed until the client returns (the 201 for HTTP),
# $ROUNDS rounds (default 9) after one warm-up round, the order of the
# variants rotating and reversing every round:
#
#   ctr         ctr -n buildkit content ingest --expected-size/-digest (the
#               floor: containerd's Go client, 1 MiB per WRITE)
#   put         curl: POST /v2/bench/blobs/uploads/, then PUT <location>
#               ?digest= with the whole body (Content-Length): monolithic
#   patch       curl: POST, then one PATCH with the whole body (chunked, as
#               crane streams a layer) and PUT ?digest= with no body on one
#               connection
#   put@base, patch@base   the same against $IMGBRIDGE_BASE
#
# It prints each variant's median (min-max), the median of its per-round
# ratios to ctr, and the CPU time containerd and imgbridge spent on it.
# Needs containerd, ctr, curl, sha256sum and python3 only.
#
# The push needs: containerd + ctr (PATH, or CONTAINERD_BIN=<bin dir>), skopeo,
# docker-registry, sha256sum, python3, curl, crictl (PATH, or built with
# scripts/peers.sh fetch crictl). No farm, no network.
# Usage: scripts/bench-push.sh   (env: IMGBRIDGE, IMGBRIDGE_BASE, PATHS,
#        WORK, ROUNDS, LAYERS, LAYER_MIB, CONTAINERD_BIN, KEEP=1 to keep
#        $WORK)
#        MODE=blob scripts/bench-push.sh   (env: IMGBRIDGE, IMGBRIDGE_BASE,
#        WORK, ROUNDS, LAYER_MIB, CONTAINERD_BIN, KEEP, VARIANTS to pick
#        some, e.g. "ctr put patch")
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
IMGBRIDGE=${IMGBRIDGE:-$root/target/release/imgbridge}
WORK=${WORK:-$(mktemp -d /tmp/imgbridge-bench-push.XXXXXX)}
MODE=${MODE:-push}
if [ "$MODE" = blob ]; then ROUNDS=${ROUNDS:-9}; else ROUNDS=${ROUNDS:-3}; fi
LAYERS=${LAYERS:-10}
LAYER_MIB=${LAYER_MIB:-50}
[ -n "${CONTAINERD_BIN:-}" ] && export PATH="$CONTAINERD_BIN:$PATH"

[ -x "$IMGBRIDGE" ] || { echo "build imgbridge first: cargo build --release ($IMGBRIDGE)" >&2; exit 2; }
needs="containerd ctr sha256sum python3 curl"
[ "$MODE" = blob ] || needs="$needs skopeo docker-registry"
for t in $needs; do
    command -v "$t" > /dev/null || { echo "$t is needed" >&2; exit 2; }
done
CRICTL=${CRICTL:-$(command -v crictl || true)}
if [ -z "$CRICTL" ] && [ "$MODE" != blob ]; then
    CRICTL="$("$root/scripts/peers.sh" fetch crictl | awk '{ print $3 }')/crictl"
fi
mkdir -p "$WORK"
: > "$WORK/crictl.yaml"
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null && wait "$p" 2> /dev/null || true; done
    [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # what cmd...
    local what=$1 deadline=$((SECONDS + 30))
    shift
    until "$@" > /dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { echo "$what did not come up" >&2; exit 1; }
        sleep 0.1
    done
}
stop() { # pid
    kill "$1" 2> /dev/null || true
    wait "$1" 2> /dev/null || true
}

# layer DIR N MIB: one uncompressed tar layer holding N MiB of random data;
# prints its digest (an uncompressed layer's digest is its diff id).
layer() {
    local dir=$1 mib=$2 stage d
    stage=$(mktemp -d "$WORK/stage.XXXXXX")
    head -c "${mib}M" /dev/urandom > "$stage/data"
    tar -C "$stage" -cf "$WORK/layer.tar" .
    rm -rf "$stage"
    d=$(sha256sum "$WORK/layer.tar" | cut -d' ' -f1)
    mv "$WORK/layer.tar" "$dir/blobs/sha256/$d"
    echo "$d"
}

# layout DIR TAG DIGEST...: an OCI layout of those layers under TAG.
layout() {
    local dir=$1 tag=$2
    shift 2
    python3 - "$dir" "$tag" "$@" << 'EOF'
import hashlib, json, os, sys
d, tag, layers = sys.argv[1], sys.argv[2], sys.argv[3:]
def put(data):
    h = hashlib.sha256(data).hexdigest()
    open(os.path.join(d, "blobs/sha256", h), "wb").write(data)
    return {"digest": "sha256:" + h, "size": len(data)}
size = lambda h: os.path.getsize(os.path.join(d, "blobs/sha256", h))
config = put(json.dumps({"architecture": "amd64", "os": "linux",
    "config": {"Cmd": ["/data"]},
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + l for l in layers]}}).encode())
config["mediaType"] = "application/vnd.oci.image.config.v1+json"
manifest = put(json.dumps({"schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json", "config": config,
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": "sha256:" + l, "size": size(l)} for l in layers]}).encode())
manifest["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}
json.dump({"schemaVersion": 2, "manifests": [manifest]}, open(os.path.join(d, "index.json"), "w"))
json.dump({"imageLayoutVersion": "1.0.0"}, open(os.path.join(d, "oci-layout"), "w"))
EOF
}

# A fresh containerd with CRI in its own root; sets SOCK and CTD_PID.
start_containerd() {
    local d="$WORK/ctd"
    rm -rf "$d"
    mkdir -p "$d"
    "$root/scripts/lib/containerd-config.sh" --dir "$d" --socket "$d/c.sock" --cri > "$d/config.toml"
    containerd --config "$d/config.toml" > "$d/log" 2>&1 &
    CTD_PID=$!
    PIDS+=("$CTD_PID")
    SOCK="$d/c.sock"
    if [ "$MODE" = blob ]; then
        wait_for containerd ctr -a "$SOCK" version
    else
        wait_for containerd crictl_ version
    fi
}

crictl_() { "$CRICTL" --config "$WORK/crictl.yaml" --runtime-endpoint "unix://$SOCK" --image-endpoint "unix://$SOCK" "$@"; }
resolves() { crictl_ inspecti -o json "$1" > /dev/null 2>&1 || { echo "CRI does not resolve $1" >&2; exit 1; }; }

# start_imgbridge [BINARY [DIR]]: sets IB_PORT and IB_PID.
start_imgbridge() {
    local bin=${1:-$IMGBRIDGE} d="$WORK/${2:-ib}"
    rm -rf "$d"
    mkdir -p "$d"
    IB_PORT=$(free_port)
    printf '[reconcile]\nenabled = false\n[registry]\nlisten = "127.0.0.1:%s"\n' "$IB_PORT" > "$d/config.toml"
    RUST_LOG=warn "$bin" serve --config "$d/config.toml" --listen "$d/ib.sock" --upstream "$SOCK" > "$d/log" 2>&1 &
    IB_PID=$!
    PIDS+=("$IB_PID")
    wait_for imgbridge curl -sf "http://127.0.0.1:$IB_PORT/v2/"
}

start_registry() {
    local d="$WORK/reg"
    rm -rf "$d"
    mkdir -p "$d"
    REG_PORT=$(free_port)
    printf 'version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
        "$d/data" "$REG_PORT" > "$d/config.yml"
    docker-registry serve "$d/config.yml" > "$d/log" 2>&1 &
    REG_PID=$!
    PIDS+=("$REG_PID")
    wait_for docker-registry curl -sf "http://127.0.0.1:$REG_PORT/v2/"
}

skopeo_to() { skopeo copy --quiet --dest-tls-verify=false "oci:$1" "docker://$2"; }
hwm() { awk '/VmHWM/ { print $2 }' "/proc/$1/status"; }

# One path, first push then the rebuild; prints "first rebuild [rss_kib]".
run_endpoint() {
    local t0 t1 t2 rss
    start_containerd
    start_imgbridge
    sync
    t0=$(now)
    skopeo_to "$WORK/a:1" "127.0.0.1:$IB_PORT/bench:1"
    t1=$(now)
    resolves "127.0.0.1:$IB_PORT/bench:1"
    t1b=$(now)
    skopeo_to "$WORK/b:2" "127.0.0.1:$IB_PORT/bench:2"
    t2=$(now)
    resolves "127.0.0.1:$IB_PORT/bench:2"
    rss=$(hwm "$IB_PID")
    stop "$IB_PID"
    stop "$CTD_PID"
    echo "$(elapsed "$t0" "$t1") $(elapsed "$t1b" "$t2") $rss"
}

# The same with $IMGBRIDGE_BASE (e.g. the build before a change).
run_base() {
    local IMGBRIDGE=$IMGBRIDGE_BASE
    run_endpoint
}

run_registry() {
    local t0 t1 t1b t2
    start_containerd
    start_registry
    sync
    t0=$(now)
    skopeo_to "$WORK/a:1" "127.0.0.1:$REG_PORT/bench:1"
    crictl_ pull "127.0.0.1:$REG_PORT/bench:1" > /dev/null
    t1=$(now)
    resolves "127.0.0.1:$REG_PORT/bench:1"
    t1b=$(now)
    skopeo_to "$WORK/b:2" "127.0.0.1:$REG_PORT/bench:2"
    crictl_ pull "127.0.0.1:$REG_PORT/bench:2" > /dev/null
    t2=$(now)
    resolves "127.0.0.1:$REG_PORT/bench:2"
    stop "$REG_PID"
    stop "$CTD_PID"
    echo "$(elapsed "$t0" "$t1") $(elapsed "$t1b" "$t2")"
}

run_import() {
    local t0 t1 t1b t2
    start_containerd
    sync
    t0=$(now)
    rm -f "$WORK/a.tar"
    skopeo copy --quiet "oci:$WORK/a:1" "docker-archive:$WORK/a.tar:bench:1"
    ctr -a "$SOCK" -n k8s.io images import "$WORK/a.tar" > /dev/null
    t1=$(now)
    resolves docker.io/library/bench:1
    t1b=$(now)
    rm -f "$WORK/b.tar"
    skopeo copy --quiet "oci:$WORK/b:2" "docker-archive:$WORK/b.tar:bench:2"
    ctr -a "$SOCK" -n k8s.io images import "$WORK/b.tar" > /dev/null
    t2=$(now)
    resolves docker.io/library/bench:2
    rm -f "$WORK/a.tar" "$WORK/b.tar"
    stop "$CTD_PID"
    echo "$(elapsed "$t0" "$t1") $(elapsed "$t1b" "$t2")"
}

# ingest_all DIR...: every blob file given, ingested at once (as a client
# uploads layers in parallel) into the fresh containerd.
ingest_all() {
    local f pids=()
    for f in "$@"; do
        ctr -a "$SOCK" -n buildkit content ingest --expected-size "$(stat -c %s "$f")" \
            --expected-digest "sha256:${f##*/}" "floor-${f##*/}" < "$f" &
        pids+=($!)
    done
    for f in "${pids[@]}"; do wait "$f"; done
}

run_floor() {
    local t0 t1 t1b t2 new=() f
    for f in "$WORK"/b/blobs/sha256/*; do
        [ -e "$WORK/a/blobs/sha256/${f##*/}" ] || new+=("$f")
    done
    start_containerd
    sync
    t0=$(now)
    ingest_all "$WORK"/a/blobs/sha256/*
    t1=$(now)
    t1b=$(now)
    ingest_all "${new[@]}"
    t2=$(now)
    stop "$CTD_PID"
    echo "$(elapsed "$t0" "$t1") $(elapsed "$t1b" "$t2")"
}

# ---- MODE=blob: one blob's write, ctr content ingest against the endpoint.

# blob_file N: $WORK/blob, the base bytes with their first 16 made N's; sets
# BLOB_DIGEST and BLOB_SIZE.
blob_file() {
    { printf '%016d' "$1"; tail -c +17 "$WORK/base"; } > "$WORK/blob"
    BLOB_DIGEST="sha256:$(sha256sum "$WORK/blob" | cut -d' ' -f1)"
    BLOB_SIZE=$(stat -c %s "$WORK/blob")
}

# upload_start PORT: POSTs an upload session; prints its location.
upload_start() {
    curl -sS -o /dev/null -D - -X POST "http://127.0.0.1:$1/v2/bench/blobs/uploads/" |
        tr -d '\r' | awk 'tolower($1) == "location:" { print $2 }'
}

# query LOCATION: what joins a query parameter to it.
query() { case $1 in *\?*) echo '&' ;; *) echo '?' ;; esac; }

# blob_VARIANT PORT: one write of $WORK/blob; fails unless it succeeded
# (ctr: containerd committed it as the expected digest; HTTP: a 201, which
# the endpoint answers once containerd did). Not looked up afterwards: a blob
# ctr wrote holds no lease, and GC may take it at once.
blob_ctr() {
    ctr -a "$SOCK" -n buildkit content ingest --expected-size "$BLOB_SIZE" \
        --expected-digest "$BLOB_DIGEST" "bench-${BLOB_DIGEST#sha256:}" < "$WORK/blob"
}
blob_put() {
    local loc code
    loc=$(upload_start "$1")
    code=$(curl -sS -o /dev/null -w '%{http_code}' -X PUT -H 'Expect:' \
        -H 'Content-Type: application/octet-stream' -T "$WORK/blob" \
        "http://127.0.0.1:$1$loc$(query "$loc")digest=$BLOB_DIGEST")
    [ "$code" = 201 ] || { echo "PUT answered $code" >&2; return 1; }
}
blob_patch() {
    local loc codes
    loc=$(upload_start "$1")
    # PATCH and PUT on one connection, as a client does (the endpoint's
    # location does not change with the PATCH; its 202 is checked).
    codes=$(curl -sS -o /dev/null -w '%{http_code} ' -X PATCH -H 'Expect:' -H 'Transfer-Encoding: chunked' \
        -H 'Content-Type: application/octet-stream' -T - "http://127.0.0.1:$1$loc" \
        --next -sS -o /dev/null -w '%{http_code}' -X PUT -H 'Content-Length: 0' \
        "http://127.0.0.1:$1$loc$(query "$loc")digest=$BLOB_DIGEST" < "$WORK/blob")
    [ "$codes" = "202 201" ] || { echo "PATCH, PUT answered $codes" >&2; return 1; }
}

# cpu_ms PID: CPU time its threads have used so far, in ms.
cpu_ms() { cat /proc/"$1"/task/*/schedstat 2> /dev/null | awk '{ s += $1 } END { printf "%.0f", s / 1e6 }'; }

run_blob_mode() {
    local r i n=0 k t0 t1 c0 b0 port pid line turn rev vs
    read -ra vs <<< "${VARIANTS:-ctr put patch${IMGBRIDGE_BASE:+ put@base patch@base}}"
    echo "== one ${LAYER_MIB} MiB blob's write, $ROUNDS rounds, in $WORK"
    head -c "${LAYER_MIB}M" /dev/urandom > "$WORK/base"
    start_containerd
    start_imgbridge "$IMGBRIDGE" ib
    PORT_NEW=$IB_PORT PID_NEW=$IB_PID
    if [ -n "${IMGBRIDGE_BASE:-}" ]; then
        start_imgbridge "$IMGBRIDGE_BASE" ib-base
        PORT_BASE=$IB_PORT PID_BASE=$IB_PID
    fi
    echo "   containerd $(containerd --version | awk '{ print $3 }'); imgbridge $IMGBRIDGE${IMGBRIDGE_BASE:+; base $IMGBRIDGE_BASE}"
    for k in "${vs[@]}"; do : > "$WORK/blob-${k/@/-}.t"; done
    # Round 0 is a warm-up, not counted.
    for r in $(seq 0 "$ROUNDS"); do
        turn=()
        for i in "${!vs[@]}"; do turn+=("${vs[$(((i + r) % ${#vs[@]}))]}"); done
        if [ $((r % 2)) = 1 ]; then
            rev=()
            for ((i = ${#turn[@]} - 1; i >= 0; i--)); do rev+=("${turn[$i]}"); done
            turn=("${rev[@]}")
        fi
        line=""
        for k in "${turn[@]}"; do
            n=$((n + 1))
            blob_file "$n"
            sync
            case $k in *@base) port=$PORT_BASE pid=$PID_BASE ;; *) port=$PORT_NEW pid=$PID_NEW ;; esac
            c0=$(cpu_ms "$CTD_PID")
            b0=$(cpu_ms "$pid")
            t0=$(now)
            "blob_${k%@base}" "$port" > /dev/null 2> "$WORK/client.err" || { cat "$WORK/client.err" >&2; exit 1; }
            t1=$(now)
            t1=$(awk -v a="$t0" -v b="$t1" -v c="$(($(cpu_ms "$CTD_PID") - c0))" -v i="$(($(cpu_ms "$pid") - b0))" \
                'BEGIN { printf "%.3f %d %d", b - a, c, i }')
            [ "$r" = 0 ] || echo "$t1" >> "$WORK/blob-${k/@/-}.t"
            line="$line  $k ${t1%% *}s"
            ctr -a "$SOCK" -n buildkit content rm "$BLOB_DIGEST" > /dev/null 2>&1
        done
        if [ "$r" = 0 ]; then echo "   warm-up:$line"; else echo "   round $r:$line"; fi
    done
    echo
    echo "== results, $ROUNDS rounds: wall s, median (min-max); per-round ratio to ctr, median (min-max);"
    echo "   CPU ms of containerd and of the imgbridge serving the write (ctr: idle), medians"
    python3 - "$WORK" "${vs[@]}" << 'EOF'
import statistics, sys
work, vs = sys.argv[1], sys.argv[2:]
rows = {k: [[float(x) for x in l.split()] for l in open(f"{work}/blob-{k.replace('@', '-')}.t")] for k in vs}
t = {k: [r[0] for r in rows[k]] for k in vs}
med = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
for k in vs:
    line = f"   {k:<11} {statistics.median(t[k]):6.3f} s ({min(t[k]):.3f}-{max(t[k]):.3f})"
    if "ctr" in t and k != "ctr":
        line += f"   {k}/ctr {med([a / b for a, b in zip(t[k], t['ctr'])])}x"
    else:
        line += " " * 30
    line += f"   CPU containerd {statistics.median(r[1] for r in rows[k]):4.0f}, imgbridge {statistics.median(r[2] for r in rows[k]):4.0f}"
    print(line)
for k in vs:
    if k.endswith("@base") and k[:-5] in t:
        print(f"   {k[:-5]}/{k}: {med([a / b for a, b in zip(t[k[:-5]], t[k])])}x per round")
EOF
}

if [ "$MODE" = blob ]; then
    run_blob_mode
    exit 0
fi

echo "== building a ${LAYERS}x${LAYER_MIB} MiB image and its one-layer rebuild in $WORK"
mkdir -p "$WORK/a/blobs/sha256" "$WORK/b/blobs/sha256"
digests=()
for i in $(seq 1 "$LAYERS"); do digests+=("$(layer "$WORK/a" "$LAYER_MIB")"); done
layout "$WORK/a" 1 "${digests[@]}"
for d in "${digests[@]:0:$((LAYERS - 1))}"; do cp "$WORK/a/blobs/sha256/$d" "$WORK/b/blobs/sha256/"; done
changed=$(layer "$WORK/b" "$LAYER_MIB")
layout "$WORK/b" 2 "${digests[@]:0:$((LAYERS - 1))}" "$changed"
echo "   $(du -sm "$WORK/a" | cut -f1) MiB; containerd $(containerd --version | awk '{ print $3 }'); imgbridge $IMGBRIDGE"

# The paths, in the order of odd rounds (even rounds reverse it).
read -ra paths <<< "${PATHS:-endpoint${IMGBRIDGE_BASE:+ base} registry import floor}"
for k in "${paths[@]}"; do : > "$WORK/$k.t"; done
for r in $(seq 1 "$ROUNDS"); do
    order=("${paths[@]}")
    if [ $((r % 2)) = 0 ]; then
        order=()
        for ((i = ${#paths[@]} - 1; i >= 0; i--)); do order+=("${paths[$i]}"); done
    fi
    for k in "${order[@]}"; do
        res=$("run_$k")
        printf '   round %d %-9s first %6ss  rebuild %6ss%s\n' "$r" "$k" $(echo "$res" | cut -d' ' -f1,2) \
            "$(echo "$res" | awk 'NF == 3 { printf "  imgbridge peak RSS %d MiB", $3 / 1024 }')"
        echo "$res" >> "$WORK/$k.t"
    done
done

# Peak RSS on a small image, to compare with the big one's.
mkdir -p "$WORK/s/blobs/sha256"
layout "$WORK/s" 1 "$(layer "$WORK/s" 1)"
start_containerd
start_imgbridge
skopeo_to "$WORK/s:1" "127.0.0.1:$IB_PORT/small:1"
resolves "127.0.0.1:$IB_PORT/small:1"
SMALL_RSS=$(hwm "$IB_PID")
stop "$IB_PID"
stop "$CTD_PID"

echo
echo "== results, $ROUNDS rounds, wall clock until CRI resolves the image: median (min-max);"
echo "   ratios: median of the per-round ratios (min-max)"
python3 - "$WORK" "$LAYERS" "$LAYER_MIB" "$SMALL_RSS" "${paths[@]}" << 'EOF'
import statistics, sys
work, layers, mib, small, paths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
t = {k: [[float(x) for x in l.split()] for l in open(f"{work}/{k}.t")] for k in paths}
name = {
    "endpoint": "endpoint (skopeo push, 201 after CRI)",
    "base": "endpoint, IMGBRIDGE_BASE",
    "registry": "docker-registry push + crictl pull",
    "import": "docker-archive + ctr import (kind load)",
    "floor": "floor: ctr content ingest of the new blobs",
}
md = lambda xs: f"{statistics.median(xs):5.2f} ({min(xs):.2f}-{max(xs):.2f})"
for k in paths:
    print(f"   {name[k]:<44} first {md([r[0] for r in t[k]])}s  rebuild {md([r[1] for r in t[k]])}s")
def ratio(a, b, goal=("", "")):
    if a in t and b in t:
        f = [x[0] / y[0] for x, y in zip(t[a], t[b])]
        r = [x[1] / y[1] for x, y in zip(t[a], t[b])]
        print(f"   {a + ' / ' + b + ':':<26} first {md(f)}x{goal[0]}, rebuild {md(r)}x{goal[1]}")
ratio("endpoint", "registry", (" (goal <= 0.7)", " (goal <= 0.3)"))
ratio("floor", "registry", ("", " (no design goes below)"))
ratio("endpoint", "floor")
ratio("base", "floor")
ratio("endpoint", "base")
ratio("endpoint", "import")
rss = max([int(r[2]) for r in t.get("endpoint", []) if len(r) > 2] or [0])
print(f"   imgbridge peak RSS: {rss // 1024} MiB after the {layers * mib} MiB image, {small // 1024} MiB after a 1 MiB one")
EOF
