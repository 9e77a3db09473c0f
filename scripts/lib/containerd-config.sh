#!/usr/bin/env bash
# The config.toml of a private, throwaway containerd, printed to stdout: the
# one place it is written, for the integration-test harness
# (tests/support/src/containerd.rs) and for every script that starts one
# (try.sh, bench*.sh, test-packaging.sh).
#
#   scripts/lib/containerd-config.sh --dir DIR [OPTION...] > DIR/config.toml
#
# Everything of that containerd lives under DIR: root, state, opt, the
# sockets (DIR/containerd.sock and .ttrpc) and, with --cri, runc's state,
# the CNI dirs, the NRI socket (2.x) and the registry hosts dir
# (DIR/certs.d). Nothing of the host's containerd is shared, and the debug
# and metrics servers are off.
#
# The config is written in the version the containerd reads natively, as
# `imgbridge doctor` expects it (doctor::native_config_version): 1.x
# `version = 2`, 2.0 to 2.2 `version = 3` (CRI split into the
# io.containerd.cri.v1.images and .runtime plugins), 2.3 and later
# `version = 4` (the grpc, ttrpc, debug and metrics servers are plugins).
#
# Options:
#   --dir DIR            (required) where that containerd keeps everything
#   --containerd BIN     the containerd it is for (default: `containerd` on
#                        PATH); its `--version` picks the config version
#   --socket PATH        the gRPC socket (default DIR/containerd.sock); the
#                        ttrpc one is PATH.ttrpc
#   --isolated           content_sharing_policy = "isolated" (default shared)
#   --manual-gc          GC only when asked for (an Images.Delete with sync),
#                        never on its own after start or a deletion
#   --cri                the CRI plugins (without it they are disabled):
#                        apparmor off, runc state in DIR/runc, CNI dirs under
#                        DIR/cni, the stream server on 127.0.0.1, a random port
# With --cri:
#   --snapshotter NAME   CRI's snapshotter (default containerd's: overlayfs)
#   --sandbox-image REF  the pause image (1.x sandbox_image, 2.x
#                        pinned_images.sandbox)
#   --certs DIR          the registry config_path (a hosts.toml per registry
#                        under it). 2.x always has one, DIR/certs.d unless
#                        given; 1.x only when given
#   --mirror HOST        CRI pulls HOST's images from HOST over plain http:
#                        1.x a `mirrors` entry (not with --certs: 1.x refuses
#                        both), 2.x a hosts.toml under the config_path, which
#                        this script writes (the only file it writes)
#   --keep-unpacked-layers
#                        discard_unpacked_layers = false (a node that serves
#                        its layers to others must keep them)
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }
die() { echo "containerd-config.sh: $*" >&2; exit 2; }

dir="" containerd=containerd sock="" isolated=0 manual_gc=0 cri=0
snapshotter="" sandbox="" certs="" mirror="" keep_layers=0
while (($#)); do
    case "$1" in
        --dir) dir=${2:?--dir DIR}; shift ;;
        --containerd) containerd=${2:?--containerd BIN}; shift ;;
        --socket) sock=${2:?--socket PATH}; shift ;;
        --isolated) isolated=1 ;;
        --manual-gc) manual_gc=1 ;;
        --cri) cri=1 ;;
        --snapshotter) snapshotter=${2:?--snapshotter NAME}; shift ;;
        --sandbox-image) sandbox=${2:?--sandbox-image REF}; shift ;;
        --certs) certs=${2:?--certs DIR}; shift ;;
        --mirror) mirror=${2:?--mirror HOST}; shift ;;
        --keep-unpacked-layers) keep_layers=1 ;;
        -h | --help) usage ;;
        *) die "unknown option $1 (--help)" ;;
    esac
    shift
done
[[ -n "$dir" ]] || die "--dir DIR is required"
# containerd wants absolute paths; symlinks are left as they are (the
# harness finds its shims by the socket path it gave).
abs() { if [[ -z "$1" || "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
dir=$(abs "$dir") sock=$(abs "$sock") certs=$(abs "$certs")
sock=${sock:-$dir/containerd.sock}
if ((!cri)) && [[ -n "$snapshotter$sandbox$certs$mirror" || $keep_layers == 1 ]]; then
    die "--snapshotter, --sandbox-image, --certs, --mirror and --keep-unpacked-layers need --cri"
fi

# "containerd github.com/containerd/containerd/v2 v2.4.2 <commit>",
# "containerd github.com/containerd/containerd 1.6.20~ds1 <commit>".
out=$("$containerd" --version) || die "$containerd --version failed"
read -r _ _ release _ <<<"$out"
release=${release#v}
[[ "$release" =~ ^([0-9]+)\.([0-9]+) ]] || die "cannot parse the version in: $out"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
if ((major < 2)); then
    version=2
elif ((major == 2 && minor < 3)); then
    version=3
else
    version=4
fi
v2=$((major >= 2))

if ((!cri)); then
    if ((v2)); then
        disabled='"io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime"'
    else
        disabled='"io.containerd.grpc.v1.cri"'
    fi
else
    disabled=""
fi
policy=shared
((isolated)) && policy=isolated

cat <<EOF
version = $version
root = "$dir/root"
state = "$dir/state"
disabled_plugins = [$disabled]

EOF
# The servers: top-level sections up to config version 3; from 4 (2.3+)
# they are plugins like everything else.
if ((version < 4)); then
    cat <<EOF
[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins]
EOF
else
    cat <<EOF
[plugins]
  [plugins."io.containerd.server.v1.grpc"]
    address = "$sock"
  [plugins."io.containerd.server.v1.ttrpc"]
    address = "$sock.ttrpc"
  [plugins."io.containerd.server.v1.debug"]
    address = ""
  [plugins."io.containerd.server.v1.metrics"]
    address = ""
EOF
fi
cat <<EOF
  [plugins."io.containerd.internal.v1.opt"]
    path = "$dir/opt"
  [plugins."io.containerd.metadata.v1.bolt"]
    content_sharing_policy = "$policy"
EOF
if ((manual_gc)); then
    # containerd's defaults collect 100 ms after start and at once after any
    # deletion (a lease released anywhere): the tests that stand in for
    # buildkit with `ctr content ingest` leave a blob unreferenced until they
    # label it or name an image after it, and that window was a race.
    cat <<EOF
  [plugins."io.containerd.gc.v1.scheduler"]
    startup_delay = "0s"
    deletion_threshold = 1000000
    mutation_threshold = 1000000
EOF
fi
((cri)) || exit 0

if ((v2)); then
    certs=${certs:-$dir/certs.d}
    if [[ -n "$mirror" ]]; then
        # 2.x dropped the `mirrors` table: a hosts.toml under config_path.
        mkdir -p "$certs/$mirror"
        printf 'server = "http://%s"\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
            "$mirror" "$mirror" >"$certs/$mirror/hosts.toml"
    fi
    # NRI is on by default in 2.x; its socket (/var/run/nri/nri.sock) would
    # be the host containerd's or another private one's.
    cat <<EOF
  [plugins."io.containerd.nri.v1.nri"]
    socket_path = "$dir/nri.sock"
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins."io.containerd.cri.v1.images"]
EOF
    [[ -z "$snapshotter" ]] || echo "    snapshotter = \"$snapshotter\""
    ((!keep_layers)) || echo "    discard_unpacked_layers = false"
    [[ -z "$sandbox" ]] || cat <<EOF
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = "$sandbox"
EOF
    cat <<EOF
    [plugins."io.containerd.cri.v1.images".registry]
      config_path = "$certs"
  [plugins."io.containerd.cri.v1.runtime"]
    disable_apparmor = true
    restrict_oom_score_adj = true
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          Root = "$dir/runc"
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = ["$dir/cni/bin"]
      conf_dir = "$dir/cni/net.d"
EOF
    exit 0
fi

[[ -z "$mirror" || -z "$certs" ]] || die "containerd 1.x refuses --mirror next to --certs"
cat <<EOF
  [plugins."io.containerd.grpc.v1.cri"]
    disable_apparmor = true
    restrict_oom_score_adj = true
EOF
[[ -z "$sandbox" ]] || echo "    sandbox_image = \"$sandbox\""
cat <<EOF
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".containerd]
EOF
[[ -z "$snapshotter" ]] || echo "      snapshotter = \"$snapshotter\""
((!keep_layers)) || echo "      discard_unpacked_layers = false"
cat <<EOF
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          Root = "$dir/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "$dir/cni/bin"
      conf_dir = "$dir/cni/net.d"
EOF
[[ -z "$mirror" ]] || cat <<EOF
    [plugins."io.containerd.grpc.v1.cri".registry.mirrors."$mirror"]
      endpoint = ["http://$mirror"]
EOF
[[ -z "$certs" ]] || cat <<EOF
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "$certs"
EOF
