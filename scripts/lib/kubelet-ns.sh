#!/usr/bin/env bash
# Runs a standalone kubelet in a mount namespace of its own, so it leaves
# the host as it found it: the one wrapper for the integration-test harness
# (tests/support/src/kubelet.rs) and scripts/bench-devloop.sh.
#
#   scripts/lib/kubelet-ns.sh DIR KUBELET [ARG...]   run KUBELET ARG... (exec:
#                                                    the pid stays this one)
#   scripts/lib/kubelet-ns.sh --sysctls              the sysctls it hides, a
#                                                    "path value" line each
#
# kubelet's container manager sets host sysctls (setupKernelTunables) with
# no setting to stop it: a file under DIR/sysctl with the value it wants is
# bind-mounted over each. It creates /var/lib/kubelet, /var/log/containers
# and /usr/libexec/kubernetes whatever its root dir: tmpfs over /var/lib and
# /var/log hide the first two (the harness checks the host after it stops).
set -euo pipefail

sysctls() {
    cat <<'LIST'
vm/overcommit_memory 1
vm/panic_on_oom 0
kernel/panic 10
kernel/panic_on_oops 1
kernel/keys/root_maxkeys 1000000
kernel/keys/root_maxbytes 25000000
LIST
}

if [[ ${1:-} == --sysctls ]]; then
    sysctls
    exit 0
fi
(($# >= 2)) || { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }
dir=$1
shift

if [[ ${IMGBRIDGE_KUBELET_NS:-} != "$dir" ]]; then
    # unshare execs (no --fork): the pid the caller holds stays kubelet's.
    exec env IMGBRIDGE_KUBELET_NS="$dir" unshare --mount --propagation private -- "$0" "$dir" "$@"
fi
unset IMGBRIDGE_KUBELET_NS
mkdir -p "$dir/sysctl"
while read -r path value; do
    file="$dir/sysctl/${path//\//.}"
    echo "$value" >"$file"
    mount --bind "$file" "/proc/sys/$path"
done < <(sysctls)
mount -t tmpfs -o size=16m,mode=755 kubelet-var-lib /var/lib
mount -t tmpfs -o size=16m,mode=755 kubelet-var-log /var/log
exec "$@"
