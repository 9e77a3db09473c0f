#!/usr/bin/env bash
# The whole story on a throwaway containerd: import an image into the build
# namespace *through imgbridge*, see it in k8s.io the instant the call
# returns, and run it as a CRI pod. Needs root (containerd, runc). Touches
# no system containerd: everything lives in a temp dir and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then echo "try.sh needs root (it runs a private containerd)"; exit 1; fi
need=(containerd ctr runc umoci skopeo busybox protoc make gcc)
missing=0; for b in "${need[@]}"; do command -v "$b" >/dev/null || missing=1; done
[ -x /bin/busybox ] || missing=1
if [ $missing = 1 ]; then
  echo "== installing Debian packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    containerd runc protobuf-compiler skopeo umoci busybox-static ca-certificates make gcc libc6-dev >/dev/null
fi
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

echo "== building imgbridge"
cargo build --release --quiet --bin imgbridge --example try_pod
IB=target/release/imgbridge
POD=target/release/examples/try_pod

T=$(mktemp -d /tmp/imgbridge-try.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  umount -R "$T/state" 2>/dev/null || true
  rm -rf "$T" 2>/dev/null || true
}
trap cleanup EXIT

wait_sock() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1"; exit 1; }

echo "== building test images offline (busybox, umoci, skopeo)"
umoci init --layout "$T/oci" >/dev/null
umoci new --image "$T/oci:base" >/dev/null
mkdir -p "$T/rootfs/bin"
cp /bin/busybox "$T/rootfs/bin/busybox"
umoci insert --image "$T/oci:base" "$T/rootfs" / >/dev/null
umoci config --image "$T/oci:base" --config.cmd /bin/busybox --config.cmd sleep --config.cmd 86400 >/dev/null
skopeo copy -q "oci:$T/oci:base" "docker-archive:$T/pause.tar:registry.k8s.io/pause:3.6"
umoci tag --image "$T/oci:base" app >/dev/null
umoci config --image "$T/oci:app" --config.cmd /bin/busybox --config.cmd echo --config.cmd "hello from a pod started by kubelet's API" >/dev/null
skopeo copy -q "oci:$T/oci:app" "docker-archive:$T/app.tar:myapp:dev"

snap=overlayfs
echo "== starting a throwaway containerd in $T"
scripts/lib/containerd-config.sh --dir "$T" --cri --snapshotter "$snap" \
  --sandbox-image registry.k8s.io/pause:3.6 >"$T/config.toml"
containerd --config "$T/config.toml" >"$T/containerd.log" 2>&1 &
pids+=($!)
wait_sock "$T/containerd.sock"
for _ in $(seq 100); do ctr -a "$T/containerd.sock" version >/dev/null 2>&1 && break; sleep 0.05; done
ctr -a "$T/containerd.sock" -n k8s.io images import "$T/pause.tar" >/dev/null

echo "== starting imgbridge in front of it"
$IB serve --listen "$T/imgbridge.sock" --upstream "$T/containerd.sock" >"$T/imgbridge.log" 2>&1 &
pids+=($!)
wait_sock "$T/imgbridge.sock"

echo "== a build tool writes myapp:dev into namespace 'buildkit' through imgbridge"
start=$(date +%s%N)
ctr -a "$T/imgbridge.sock" -n buildkit images import "$T/app.tar"
end=$(date +%s%N)
echo "   import returned after $(( (end - start) / 1000000 )) ms"

echo "== at once, on containerd's own socket, in k8s.io:"
ctr -a "$T/containerd.sock" -n k8s.io images ls | cut -c1-140
echo "== kubelet's view (CRI ImageStatus) and a pod, with no registry and no retry:"
$POD "$T/containerd.sock" myapp:dev "hello from a pod"
echo
echo "imgbridge log:"
sed 's/^/   /' "$T/imgbridge.log"
echo "OK: built into 'buildkit', usable by Kubernetes the moment the build returned."
