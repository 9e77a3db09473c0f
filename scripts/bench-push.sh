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
# own root, $ROUNDS rounds, the order alternating. Also reports imgbridge's
# peak RSS after the endpoint runs (VmHWM), and after a push of a small image
# on a fresh imgbridge, to show it does not grow with the image size.
#
# Needs: containerd + ctr (PATH, or CONTAINERD_BIN=<bin dir>), skopeo,
# docker-registry, sha256sum, python3, curl, crictl (PATH, or built with
# scripts/peers.sh fetch crictl). No farm, no network.
# Usage: scripts/bench-push.sh   (env: IMGBRIDGE, WORK, ROUNDS, LAYERS,
#        LAYER_MIB, CONTAINERD_BIN, KEEP=1 to keep $WORK)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
IMGBRIDGE=${IMGBRIDGE:-$root/target/release/imgbridge}
WORK=${WORK:-$(mktemp -d /tmp/imgbridge-bench-push.XXXXXX)}
ROUNDS=${ROUNDS:-3}
LAYERS=${LAYERS:-10}
LAYER_MIB=${LAYER_MIB:-50}
[ -n "${CONTAINERD_BIN:-}" ] && export PATH="$CONTAINERD_BIN:$PATH"

[ -x "$IMGBRIDGE" ] || { echo "build imgbridge first: cargo build --release ($IMGBRIDGE)" >&2; exit 2; }
for t in containerd ctr skopeo docker-registry sha256sum python3 curl; do
    command -v "$t" > /dev/null || { echo "$t is needed" >&2; exit 2; }
done
CRICTL=${CRICTL:-$(command -v crictl || true)}
if [ -z "$CRICTL" ]; then
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
    wait_for containerd crictl_ version
}

crictl_() { "$CRICTL" --config "$WORK/crictl.yaml" --runtime-endpoint "unix://$SOCK" --image-endpoint "unix://$SOCK" "$@"; }
resolves() { crictl_ inspecti -o json "$1" > /dev/null 2>&1 || { echo "CRI does not resolve $1" >&2; exit 1; }; }

start_imgbridge() {
    local d="$WORK/ib"
    rm -rf "$d"
    mkdir -p "$d"
    IB_PORT=$(free_port)
    printf '[reconcile]\nenabled = false\n[registry]\nlisten = "127.0.0.1:%s"\n' "$IB_PORT" > "$d/config.toml"
    RUST_LOG=warn "$IMGBRIDGE" serve --config "$d/config.toml" --listen "$d/ib.sock" --upstream "$SOCK" > "$d/log" 2>&1 &
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

echo "== building a ${LAYERS}x${LAYER_MIB} MiB image and its one-layer rebuild in $WORK"
mkdir -p "$WORK/a/blobs/sha256" "$WORK/b/blobs/sha256"
digests=()
for i in $(seq 1 "$LAYERS"); do digests+=("$(layer "$WORK/a" "$LAYER_MIB")"); done
layout "$WORK/a" 1 "${digests[@]}"
for d in "${digests[@]:0:$((LAYERS - 1))}"; do cp "$WORK/a/blobs/sha256/$d" "$WORK/b/blobs/sha256/"; done
changed=$(layer "$WORK/b" "$LAYER_MIB")
layout "$WORK/b" 2 "${digests[@]:0:$((LAYERS - 1))}" "$changed"
echo "   $(du -sm "$WORK/a" | cut -f1) MiB; containerd $(containerd --version | awk '{ print $3 }'); imgbridge $IMGBRIDGE"

: > "$WORK/endpoint.t"
: > "$WORK/registry.t"
: > "$WORK/import.t"
: > "$WORK/floor.t"
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="endpoint registry import floor"; else order="floor import registry endpoint"; fi
    for k in $order; do
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

mean() { awk -v c="$1" '{ s += $c; n++ } END { printf "%.2f", s / n }' "$2"; }
E1=$(mean 1 "$WORK/endpoint.t"); E2=$(mean 2 "$WORK/endpoint.t")
R1=$(mean 1 "$WORK/registry.t"); R2=$(mean 2 "$WORK/registry.t")
I1=$(mean 1 "$WORK/import.t"); I2=$(mean 2 "$WORK/import.t")
F1=$(mean 1 "$WORK/floor.t"); F2=$(mean 2 "$WORK/floor.t")
RSS=$(awk '{ if ($3 > m) m = $3 } END { print m }' "$WORK/endpoint.t")
echo
echo "== results (mean of $ROUNDS rounds, wall clock until CRI resolves the image)"
printf '   %-44s first %6ss  rebuild %6ss\n' "endpoint (skopeo push, 201 after CRI)" "$E1" "$E2"
printf '   %-44s first %6ss  rebuild %6ss\n' "docker-registry push + crictl pull" "$R1" "$R2"
printf '   %-44s first %6ss  rebuild %6ss\n' "docker-archive + ctr import (kind load)" "$I1" "$I2"
printf '   %-44s first %6ss  rebuild %6ss\n' "floor: ctr content ingest of the new blobs" "$F1" "$F2"
awk -v e1="$E1" -v e2="$E2" -v r1="$R1" -v r2="$R2" -v i1="$I1" -v i2="$I2" -v f1="$F1" -v f2="$F2" 'BEGIN {
    printf "   endpoint / registry+pull: first %.2fx (goal <= 0.7), rebuild %.2fx (goal <= 0.3)\n", e1 / r1, e2 / r2
    printf "   floor / registry+pull:    first %.2fx, rebuild %.2fx (no design goes below)\n", f1 / r1, f2 / r2
    printf "   endpoint / floor:         first %.2fx, rebuild %.2fx\n", e1 / f1, e2 / f2
    printf "   endpoint / ctr import:    first %.2fx, rebuild %.2fx\n", e1 / i1, e2 / i2 }'
printf '   imgbridge peak RSS: %d MiB after the %d MiB image, %d MiB after a 1 MiB one\n' \
    "$((RSS / 1024))" "$((LAYERS * LAYER_MIB))" "$((SMALL_RSS / 1024))"
