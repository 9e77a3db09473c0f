#!/usr/bin/env bash
# The buildkitd.toml of a private buildkitd, printed to stdout: the one place
# it is written, for the integration-test harness (tests/support/src/peers.rs)
# and scripts/bench-devloop.sh.
#
#   scripts/lib/buildkitd-config.sh --dir DIR --containerd SOCK \
#       --namespace NS --snapshotter NAME [--registry HOST:PORT] > DIR/buildkitd.toml
#
# Only the containerd worker (on SOCK, which is imgbridge's socket or
# containerd's own), writing images into NS; its own GC off, so only the
# test or the bench decides what goes. Everything else lives under DIR: the
# root, the gRPC socket DIR/buildkitd.sock and the OpenTelemetry socket.
# --registry: a loopback registry it pulls from over plain http.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }

dir="" containerd="" namespace="" snapshotter="" registry=""
while (($#)); do
    case "$1" in
        --dir) dir=${2:?--dir DIR}; shift ;;
        --containerd) containerd=${2:?--containerd SOCK}; shift ;;
        --namespace) namespace=${2:?--namespace NS}; shift ;;
        --snapshotter) snapshotter=${2:?--snapshotter NAME}; shift ;;
        --registry) registry=${2:?--registry HOST:PORT}; shift ;;
        -h | --help) usage ;;
        *) echo "buildkitd-config.sh: unknown option $1" >&2; usage ;;
    esac
    shift
done
[[ -n $dir && -n $containerd && -n $namespace && -n $snapshotter ]] || usage

cat <<TOML
root = "$dir/root"
[grpc]
  address = ["unix://$dir/buildkitd.sock"]
[worker.oci]
  enabled = false
[worker.containerd]
  enabled = true
  address = "$containerd"
  namespace = "$namespace"
  snapshotter = "$snapshotter"
  gc = false
[otel]
  socketPath = "$dir/otel-grpc.sock"
TOML
if [[ -n $registry ]]; then
    printf '[registry."%s"]\n  http = true\n  insecure = true\n' "$registry"
fi
