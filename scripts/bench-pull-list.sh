#!/usr/bin/env bash
# Parse time of a big pull list, in a release build: the
# 1 MiB / ~145k-reference list tests/hostile.rs drops, parsed as the
# importer does (`import::pull::read`, then the host policy), side by side
# with a floor that only reads the file and finds its lines. Variants
# alternate round by round (examples/bench_pull_list.rs). The test checks
# that the proxy is not stalled meanwhile; how long the parse takes is
# measured here.
#
# Usage: scripts/bench-pull-list.sh   (env: ROUNDS=10, BENCH_NO_BUILD=1 to
#        skip cargo build, BENCH_DIR=<dir for the list>, default /tmp)
set -euo pipefail

ROUNDS=${ROUNDS:-10}
cd "$(dirname "$0")/.."
if [[ -z ${BENCH_NO_BUILD:-} ]]; then
    cargo build --release --example bench_pull_list >&2
fi
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
bin=${target_dir:-target}/release/examples/bench_pull_list
[[ -x $bin ]] || { echo "missing $bin (build failed?)" >&2; exit 1; }

echo "== pull list parse, release build, git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), load $(cut -d' ' -f1-3 /proc/loadavg)"
"$bin" --rounds "$ROUNDS" --dir "${BENCH_DIR:-/tmp}"
