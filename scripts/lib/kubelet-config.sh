#!/usr/bin/env bash
# The KubeletConfiguration of a standalone kubelet (no API server, static
# pods only), printed to stdout: the one place it is written, for the
# integration-test harness (tests/support/src/kubelet.rs) and
# scripts/bench-devloop.sh (BENCH_POD=kubelet).
#
#   scripts/lib/kubelet-config.sh --dir DIR --endpoint SOCK \
#       --port P --read-only-port P --healthz-port P [--extra FILE] > DIR/kubelet.yaml
#
# Static pods from DIR/manifests, pod logs in DIR/pod-logs, every port on
# loopback, anonymous and unchecked (a throwaway node), no kubepods cgroups
# (cgroup v1 without systemd), and kubelet touches no host iptables.
# Defaults a test may override: both CRI endpoints on SOCK, no eviction on
# this shared machine's disk and image GC off (both would act on every
# test's images). --extra FILE: more top-level YAML; a default whose key
# FILE sets is left out.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }

dir="" endpoint="" port="" ro="" healthz="" extra=/dev/null
while (($#)); do
    case "$1" in
        --dir) dir=${2:?--dir DIR}; shift ;;
        --endpoint) endpoint=${2:?--endpoint SOCK}; shift ;;
        --port) port=${2:?--port P}; shift ;;
        --read-only-port) ro=${2:?--read-only-port P}; shift ;;
        --healthz-port) healthz=${2:?--healthz-port P}; shift ;;
        --extra) extra=${2:?--extra FILE}; shift ;;
        -h | --help) usage ;;
        *) echo "kubelet-config.sh: unknown option $1" >&2; usage ;;
    esac
    shift
done
[[ -n $dir && -n $endpoint && -n $port && -n $ro && -n $healthz ]] || usage

cat <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
staticPodPath: $dir/manifests
fileCheckFrequency: 1s
syncFrequency: 10s
podLogsDir: $dir/pod-logs
volumePluginDir: $dir/volume-plugins
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
address: 127.0.0.1
port: $port
readOnlyPort: $ro
healthzBindAddress: 127.0.0.1
healthzPort: $healthz
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
YAML

extra_text=$(cat "$extra")
default() { # KEY YAML: YAML unless the extra lines set KEY at top level
    grep -q "^$1:" <<<"$extra_text" || printf '%s\n' "$2"
}
default containerRuntimeEndpoint "containerRuntimeEndpoint: unix://$endpoint"
default imageServiceEndpoint "imageServiceEndpoint: unix://$endpoint"
default evictionHard $'evictionHard:\n  memory.available: "1Mi"'
default imageGCHighThresholdPercent "imageGCHighThresholdPercent: 100"
[[ -z $extra_text ]] || printf '%s\n' "$extra_text"
