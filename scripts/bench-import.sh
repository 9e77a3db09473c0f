#!/usr/bin/env bash
# Benchmarks `imgbridge import` against containerd's own importer.
#
#  1. Builds a ~512 MiB docker-archive of random (incompressible) layers,
#     gzipped, and times, in alternating order over $ROUNDS rounds, each on a
#     fresh throwaway containerd (so both do the full work):
#       gunzip -c X.tar.gz | ctr -n k8s.io images import -
#       gunzip -c X.tar.gz | ctr -n k8s.io images import --no-unpack -   (reference)
#       imgbridge import X.tar.gz
#     ctr unpacks by default; imgbridge never does (CRI unpacks on first use),
#     so the --no-unpack run is the like-for-like comparison.
#  2. Builds a ~2 GiB uncompressed .tar and reports imgbridge's peak RSS.
#
# Needs: containerd, ctr, gzip, GNU time (/usr/bin/time), sha256sum, awk.
# Usage: scripts/bench-import.sh   (env: IMGBRIDGE, WORK, ROUNDS, LAYERS,
#        LAYER_MIB, BIG_LAYERS, BIG_LAYER_MIB, KEEP=1 to keep $WORK)
set -euo pipefail

IMGBRIDGE=${IMGBRIDGE:-$(dirname "$0")/../target/release/imgbridge}
IMGBRIDGE=$(readlink -f "$IMGBRIDGE")
WORK=${WORK:-$(mktemp -d /tmp/imgbridge-bench.XXXXXX)}
ROUNDS=${ROUNDS:-3}
LAYERS=${LAYERS:-8}
LAYER_MIB=${LAYER_MIB:-64}
BIG_LAYERS=${BIG_LAYERS:-16}
BIG_LAYER_MIB=${BIG_LAYER_MIB:-128}
TIME=/usr/bin/time

[ -x "$IMGBRIDGE" ] || { echo "build imgbridge first: cargo build --release ($IMGBRIDGE)" >&2; exit 2; }
[ -x "$TIME" ] || { echo "GNU time is needed at $TIME (apt-get install time)" >&2; exit 2; }
mkdir -p "$WORK"
CTD_PID=
cleanup() {
    [ -n "$CTD_PID" ] && kill "$CTD_PID" 2>/dev/null && wait "$CTD_PID" 2>/dev/null || true
    [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# make_archive OUT NAME NLAYERS MIB: a docker-archive with random layers,
# layers first and manifest.json last, like `docker save` / skopeo.
make_archive() {
    local out=$1 name=$2 n=$3 mib=$4 dir="$WORK/build-$2" i d diff_ids="" layers=""
    rm -rf "$dir"; mkdir -p "$dir"
    for i in $(seq 1 "$n"); do
        mkdir -p "$dir/l$i"
        head -c "${mib}M" /dev/urandom > "$dir/l$i/data-$i"
        tar -C "$dir/l$i" -cf "$dir/layer.tar" .
        rm -rf "$dir/l$i"
        d=$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)
        mv "$dir/layer.tar" "$dir/$d.tar"
        diff_ids+="${diff_ids:+,}\"sha256:$d\""
        layers+="${layers:+,}\"$d.tar\""
    done
    printf '{"architecture":"amd64","os":"linux","config":{"Cmd":["/data-1"]},"rootfs":{"type":"layers","diff_ids":[%s]}}' \
        "$diff_ids" > "$dir/config.json"
    d=$(sha256sum "$dir/config.json" | cut -d' ' -f1)
    mv "$dir/config.json" "$dir/$d.json"
    printf '[{"Config":"%s.json","RepoTags":["bench/%s:latest"],"Layers":[%s]}]' "$d" "$name" "$layers" \
        > "$dir/manifest.json"
    # Globs sort hex names before manifest.json: layers, config, manifest last.
    (cd "$dir" && tar -cf "$out" *.tar *.json)
    rm -rf "$dir"
}

# A fresh containerd in its own root (no CRI: neither importer needs it).
start_containerd() {
    local d="$WORK/ctd"
    rm -rf "$d"; mkdir -p "$d"
    "$(dirname "$0")/lib/containerd-config.sh" --dir "$d" --socket "$d/c.sock" > "$d/config.toml"
    containerd --config "$d/config.toml" > "$d/log" 2>&1 &
    CTD_PID=$!
    SOCK="$d/c.sock"
    local deadline=$((SECONDS + 30))
    until ctr -a "$SOCK" version > /dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { echo "containerd did not start" >&2; cat "$d/log" >&2; exit 1; }
        sleep 0.1
    done
}

stop_containerd() {
    kill "$CTD_PID"; wait "$CTD_PID" 2>/dev/null || true
    CTD_PID=
    rm -rf "$WORK/ctd"
}

# run_one KIND ARCHIVE → prints "seconds maxrss_kib"
run_one() {
    local kind=$1 archive=$2 t0 t1 rss
    start_containerd
    sync
    t0=$(now)
    case $kind in
        ctr) $TIME -f %M -o "$WORK/rss" bash -c "gunzip -c '$archive' | ctr -a '$SOCK' -n k8s.io images import - > /dev/null" ;;
        ctr-nounpack) $TIME -f %M -o "$WORK/rss" bash -c "gunzip -c '$archive' | ctr -a '$SOCK' -n k8s.io images import --no-unpack - > /dev/null" ;;
        imgbridge) RUST_LOG=warn $TIME -f %M -o "$WORK/rss" "$IMGBRIDGE" import --upstream "$SOCK" --namespace k8s.io "$archive" ;;
    esac
    t1=$(now)
    rss=$(tail -1 "$WORK/rss")
    ctr -a "$SOCK" -n k8s.io images ls -q | grep -q "bench/" || { echo "$kind: no image imported" >&2; exit 1; }
    stop_containerd
    echo "$(elapsed "$t0" "$t1") $rss"
}

mean() { awk '{ s += $1; n++ } END { printf "%.2f", s / n }'; }

echo "== building a ${LAYERS}x${LAYER_MIB} MiB random-layer image (.tar.gz) in $WORK"
make_archive "$WORK/img.tar" img "$LAYERS" "$LAYER_MIB"
gzip -1 -c "$WORK/img.tar" > "$WORK/img.tar.gz"
rm -f "$WORK/img.tar"
echo "   $(du -m "$WORK/img.tar.gz" | cut -f1) MiB compressed"

: > "$WORK/ctr.t"; : > "$WORK/nounpack.t"; : > "$WORK/imgbridge.t"
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="ctr ctr-nounpack imgbridge"; else order="imgbridge ctr-nounpack ctr"; fi
    for k in $order; do
        res=$(run_one "$k" "$WORK/img.tar.gz")
        printf '   round %d %-13s %6ss  peak RSS %6d KiB\n' "$r" "$k" ${res% *} ${res#* }
        case $k in
            ctr) echo "$res" >> "$WORK/ctr.t" ;;
            ctr-nounpack) echo "$res" >> "$WORK/nounpack.t" ;;
            imgbridge) echo "$res" >> "$WORK/imgbridge.t" ;;
        esac
    done
done
CTR=$(mean < "$WORK/ctr.t"); NOUNPACK=$(mean < "$WORK/nounpack.t"); IB=$(mean < "$WORK/imgbridge.t")
rm -f "$WORK/img.tar.gz"

echo "== building a ${BIG_LAYERS}x${BIG_LAYER_MIB} MiB uncompressed .tar"
make_archive "$WORK/big.tar" big "$BIG_LAYERS" "$BIG_LAYER_MIB"
echo "   $(du -m "$WORK/big.tar" | cut -f1) MiB"
BIG=$(run_one imgbridge "$WORK/big.tar")
rm -f "$WORK/big.tar"

echo
echo "== results (mean of $ROUNDS rounds, wall clock)"
printf '   gunzip | ctr images import -              %6ss\n' "$CTR"
printf '   gunzip | ctr images import --no-unpack -  %6ss\n' "$NOUNPACK"
printf '   imgbridge import X.tar.gz                 %6ss\n' "$IB"
awk -v i="$IB" -v c="$CTR" -v n="$NOUNPACK" 'BEGIN {
    printf "   ratio imgbridge / ctr             %.2fx  (target <= 1.0)\n", i / c
    printf "   ratio imgbridge / ctr --no-unpack %.2fx\n", i / n }'
printf '   imgbridge on %s MiB .tar: %ss, peak RSS %d MiB (target <= 64 MiB)\n' \
    "$((BIG_LAYERS * BIG_LAYER_MIB))" "${BIG% *}" "$(( ${BIG#* } / 1024 ))"
