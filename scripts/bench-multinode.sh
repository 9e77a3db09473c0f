#!/usr/bin/env bash
# Multi-node benchmark (not a test): the time from "build
# done on one node" to "container running on the other node", through
# spegel, against what `kind load` does, side by side in one run.
#
# It runs tests/multinode.rs's two-node scenario (one machine, two network
# namespaces of its own joined by a veth pair, 198.18.0.1/.2, nothing routed
# out; per node its own containerd with CRI, spegel v0.7.3 bootstrapping
# over HTTP from the other node, imgbridge, and buildkitd writing through
# imgbridge into namespace `buildkit`; crictl on each containerd socket as
# that node's kubelet) with BENCH_ROUNDS rounds each way, alternating A→B
# and B→A. Every round builds new content (FROM scratch, busybox, a file
# /v with the round's text) and, once buildctl returns:
#
#   spegel     the other node pulls it (`crictl pull`, kubelet's
#              imagePullPolicy: Always; the first round by tag
#              docker.io/library/app:dev, later rounds by
#              app:dev@sha256:<digest>, see the test's comment on stale tags)
#              and a host-network pod prints /v;
#   kind load  a second build under another name (app-loaded:dev), then
#              `ctr -n buildkit images export - | ctr -n k8s.io images
#              import -` into the other node's containerd, and a pod prints
#              /v.
#
# Times are wall clock from buildctl's return to the pod's log showing this
# round's line (crictl's own process start-ups included, the same for both);
# p50/p99 per direction and path (with 10 rounds p99 is the slowest round);
# "pull retries" counts pulls that did not resolve yet and were repeated at
# once (kubelet would back off 10 s instead).
#
# usage: scripts/bench-multinode.sh        (as root; about a minute for 10
#                                          rounds, plus the first build)
# env:   BENCH_ROUNDS=10        rounds each way
#        BENCH_CONTAINERD=2.4   containerd label of scripts/containerd-matrix.sh
#                               (1.6, 1.7, 2.1 or 2.4; on 1.x spegel learns
#                               of replicas from imgbridge's /content/create)
#        BENCH_PROFILE=release  cargo profile of imgbridge and the harness
#                               (release, or dev to reuse test builds)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=/dev/null
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

rounds="${BENCH_ROUNDS:-10}"
label="${BENCH_CONTAINERD:-2.4}"
profile="${BENCH_PROFILE:-release}"

log() { echo "bench-multinode: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $EUID -eq 0 ]] || die "run as root (network namespaces, containerd)"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive number"
# Never let a client default to the system containerd.
unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER

log "peers (built once, cached): $(scripts/peers.sh fetch spegel buildkit crictl | awk '{print $1, $2}' | paste -sd, -)"
profile_arg=()
[[ "$profile" == dev ]] || profile_arg=(--profile "$profile")
log "containerd $label, $rounds rounds each way, cargo profile $profile"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
set +e
IMGBRIDGE_CONTAINERD="$label" IMGBRIDGE_MULTINODE_ROUNDS="$rounds" IMGBRIDGE_MULTINODE_BASELINE=1 \
    cargo test "${profile_arg[@]}" --quiet --test multinode build_on_one_node_runs_on_the_other_through_spegel \
    -- --nocapture --test-threads=1 >"$out" 2>&1
rc=$?
set -e
if ((rc != 0)) || ! grep -q '^multinode:' "$out"; then
    tail -n 60 "$out" >&2
    die "the scenario failed (exit $rc)"
fi
grep -E '^(multinode:|  |node [AB]: )' "$out" | grep -v '^  *[0-9]*: ' || true
