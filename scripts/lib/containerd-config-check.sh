#!/usr/bin/env bash
# Checks scripts/lib/containerd-config.sh against each containerd of the
# test matrix: every kind of config its callers ask for (the harness with
# and without CRI, with a mirror or a registry hosts dir; try.sh and the
# bench scripts; test-packaging.sh's socket elsewhere) loads with
# `containerd config dump`, with no warning (so no migration either: the
# version is that containerd's own), and the loaded config holds what was
# asked for (sockets, root, CRI's settings), which a key in the wrong place
# would not.
#
#   scripts/lib/containerd-config-check.sh [LABEL...]   (default: 1.6 1.7 2.1 2.4)
#
# The binaries come from scripts/containerd-matrix.sh (fetched or built on
# first use, cached after). Prints one line per version; exits 1 if any
# check failed.
set -euo pipefail
cd "$(dirname "$0")/../.."

labels=("$@")
((${#labels[@]})) || labels=(1.6 1.7 2.1 2.4)
gen=scripts/lib/containerd-config.sh
work=$(mktemp -d /tmp/imgbridge-config-check.XXXXXX)
trap 'rm -rf "$work"' EXIT

failures=0
fail() { echo "FAIL $label $case: $*" >&2; failures=$((failures + 1)); }

# check CASE EXPECTED... -- OPTION...: generates a config with OPTIONs (for
# --dir $d), loads it, and looks for each EXPECTED line (single quotes as
# double) in the dump.
check() {
    case=$1
    shift
    local want=() d="$work/$label-$case" dump err
    while [[ $1 != -- ]]; do want+=("$1"); shift; done
    shift
    mkdir -p "$d"
    if ! "$gen" --containerd "$bin/containerd" --dir "$d" "$@" >"$d/config.toml" 2>"$d/gen.err"; then
        fail "containerd-config.sh $*: $(cat "$d/gen.err")"
        return
    fi
    if ! dump=$("$bin/containerd" --config "$d/config.toml" config dump 2>"$d/dump.err"); then
        fail "config dump: $(cat "$d/dump.err")"
        return
    fi
    err=$(cat "$d/dump.err")
    [[ -z "$err" ]] || fail "config dump warns: $err"
    dump=$(tr "'" '"' <<<"$dump" | sed 's/^ *//')
    local w
    for w in "${want[@]}"; do
        w=${w//@/$d}
        grep -qxF -- "$w" <<<"$dump" || fail "no line '$w' in the dump of $d/config.toml"
    done
}

while read -r label version bin; do
    major=${version#v}
    major=${major%%.*}
    before=$failures
    pause=registry.k8s.io/pause:3.10
    check bench 'root = "@/root"' 'address = "@/containerd.sock"' 'address = "@/containerd.sock.ttrpc"' \
        'path = "@/opt"' 'content_sharing_policy = "shared"' --
    check harness 'content_sharing_policy = "isolated"' 'deletion_threshold = 1000000' \
        'startup_delay = "0s"' -- --isolated --manual-gc
    check packaging 'address = "@/run/containerd.sock"' 'address = "@/run/containerd.sock.ttrpc"' \
        -- --cri --socket "$work/$label-packaging/run/containerd.sock"
    if ((major >= 2)); then
        check harness-cri 'snapshotter = "native"' "sandbox = \"$pause\"" 'config_path = "@/certs.d"' \
            'socket_path = "@/nri.sock"' 'Root = "@/runc"' 'bin_dirs = ["@/cni/bin"]' \
            -- --cri --manual-gc --snapshotter native --sandbox-image "$pause" --mirror 127.0.0.1:5000
        [[ -f "$work/$label-harness-cri/certs.d/127.0.0.1:5000/hosts.toml" ]] || fail "no hosts.toml for the mirror"
        check multinode 'discard_unpacked_layers = false' 'config_path = "@/hosts"' -- \
            --cri --snapshotter overlayfs --certs "$work/$label-multinode/hosts" --keep-unpacked-layers
    else
        check harness-cri 'snapshotter = "native"' "sandbox_image = \"$pause\"" 'endpoint = ["http://127.0.0.1:5000"]' \
            'Root = "@/runc"' 'bin_dir = "@/cni/bin"' \
            -- --cri --manual-gc --snapshotter native --sandbox-image "$pause" --mirror 127.0.0.1:5000
        check multinode 'discard_unpacked_layers = false' 'config_path = "@/hosts"' -- \
            --cri --snapshotter overlayfs --certs "$work/$label-multinode/hosts" --keep-unpacked-layers
    fi
    if ((failures == before)); then
        echo "ok containerd $version ($label): $(head -n1 "$work/$label-bench/config.toml"), every config loads"
    else
        echo "FAILED containerd $version ($label)"
    fi
done < <(scripts/containerd-matrix.sh fetch "${labels[@]}")

if ((failures)); then
    echo "containerd-config-check.sh: some generated configs do not load as meant" >&2
    exit 1
fi
