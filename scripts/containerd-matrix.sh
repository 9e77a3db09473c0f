#!/usr/bin/env bash
# Provides the containerd binaries of the test version matrix, each set in its
# own bin dir (containerd, ctr, containerd-shim-runc-v2 and nothing else, so
# the dir can go first on PATH), cached outside the repo and reused across runs.
#
#   scripts/containerd-matrix.sh fetch [LABEL...]   (default: 1.6 1.7 2.1 2.4)
#       stdout, one line per label: <label> <version> <absolute bindir>
#       <version> is the Debian package version for Debian builds (it is what
#       `containerd --version` prints as revision for 1.6/1.7; sid's 2.1 build
#       only prints "2.1.9+unknown"), else containerd's own (v2.4.2).
#   scripts/containerd-matrix.sh versions
#       stdout: "<module> <version>" for every Go peer pinned under tests/peers/
#       (containerd, buildkit, nerdctl, crictl; scripts/peers.sh builds the
#       clients)
#   scripts/containerd-matrix.sh verify
#       checks that the 2.4 build uses containerd's own dependency versions
#       (needs network; see gobuild_verify in scripts/lib/gobuild.sh)
#
# Labels:
#   1.6  Debian package installed on this machine (bookworm), via symlinks
#   1.7  Debian trixie's containerd package
#   2.1  Debian sid's containerd package
#   2.4  built from the Go module pinned in tests/peers/containerd/go.mod
#
# Environment:
#   IMGBRIDGE_CACHE            cache root (default /var/cache/imgbridge-test)
#   IMGBRIDGE_MATRIX_REFRESH=1 re-run apt update and pick up newer Debian
#                              versions; otherwise a cached one is reused, so a
#                              warm run needs no network
#   IMGBRIDGE_DEBIAN_MIRROR    Debian mirror URI (default: the one this
#                              machine's apt sources use for its own release)
#
# Progress goes to stderr. Exits non-zero naming every label that could not be
# provided (the lines of the others are still printed).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${IMGBRIDGE_CACHE:-/var/cache/imgbridge-test}"
ctd_cache="$cache_root/containerd"
all_labels=(1.6 1.7 2.1 2.4)
# Only these go into a bin dir; Debian's 1.7 package also ships the v1 shims.
binaries=(containerd ctr containerd-shim-runc-v2)
containerd_module=github.com/containerd/containerd/v2

log() { echo "containerd-matrix: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Go peer pins and builds, temp dirs renamed into the cache when complete.
# shellcheck source=scripts/lib/gobuild.sh
. "$repo_root/scripts/lib/gobuild.sh"
# debian_mirror: the Debian mirror this machine's apt uses (no host name is
# written into the repo).
# shellcheck source=scripts/lib/debian-mirror.sh
. "$repo_root/scripts/lib/debian-mirror.sh"

# Runs the three binaries; fails unless `containerd --version` reports
# $2 (an upstream version prefix). Prints that version field.
check_bindir() { # label bindir expected-prefix
    local label="$1" bindir="$2" want="$3" out ver
    for b in "${binaries[@]}"; do
        [[ -x "$bindir/$b" ]] || die "label $label: $bindir/$b missing"
    done
    out="$("$bindir/containerd" --version 2>&1)" ||
        die "label $label: $bindir/containerd --version failed: $out"
    "$bindir/ctr" --version >/dev/null 2>&1 ||
        die "label $label: $bindir/ctr --version failed"
    "$bindir/containerd-shim-runc-v2" -v >/dev/null 2>&1 ||
        die "label $label: $bindir/containerd-shim-runc-v2 -v failed"
    # "containerd <package> <version> <revision>"
    ver="$(awk '{print $3}' <<<"$out")"
    [[ "$ver" == "$want"* ]] ||
        die "label $label: $bindir/containerd reports '$ver', expected $want*"
    printf '%s\n' "$ver"
}

# ---------------------------------------------------------------- 1.6 system

fetch_system() { # label: the Debian package installed on this machine
    local label="$1" bindir="$ctd_cache/1.6-system/bin" ver
    [[ -x /usr/bin/containerd ]] ||
        die "label $label: /usr/bin/containerd missing (scripts/test.sh installs it: apt-get install containerd)"
    ver="$(dpkg-query -W -f='${Version}' containerd 2>/dev/null)" ||
        die "label $label: Debian package containerd is not installed"
    # Symlinks, not copies: always the installed version, and a bin dir that
    # exposes only these three (unlike /usr/bin).
    mkdir -p "$bindir"
    for b in "${binaries[@]}"; do
        ln -sfn "/usr/bin/$b" "$bindir/$b"
    done
    check_bindir "$label" "$bindir" "$label." >/dev/null
    echo "$label $ver $bindir"
}

# ---------------------------------------------------------- 1.7/2.1 Debian

# A private apt setup per suite: own sources, lists, cache and an empty dpkg
# status, so the system's apt state and sources are never touched. The
# system's apt.conf.d still applies (proxies etc.).
apt_opts() { # suite → sets array $apt
    local d="$cache_root/apt/$1"
    apt=(
        -o "Dir::Etc::SourceList=/dev/null"
        -o "Dir::Etc::SourceParts=$d/sources.list.d"
        -o "Dir::Etc::Preferences=/dev/null"
        -o "Dir::Etc::PreferencesParts=/dev/null"
        -o "Dir::State::Lists=$d/lists"
        -o "Dir::State::Status=$d/status"
        -o "Dir::Cache=$d/cache"
    )
}

apt_update() { # label suite
    local label="$1" suite="$2" d="$cache_root/apt/$2" mirror
    mirror="$(debian_mirror)" ||
        die "label $label: no Debian mirror found in /etc/apt (set IMGBRIDGE_DEBIAN_MIRROR)"
    mkdir -p "$d/sources.list.d" "$d/lists/partial" "$d/cache/archives/partial"
    : >"$d/status"
    # debian-archive-keyring (bookworm, 2023.3+deb12u2) already holds the
    # trixie archive/release keys that sign trixie and sid. Targets: Packages
    # skips the Translation/DEP-11 indexes the system config would add.
    cat >"$d/sources.list.d/$suite.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
Targets: Packages
EOF
    log "apt-get update ($suite, private lists in $d)"
    apt_opts "$suite"
    apt-get "${apt[@]}" -q --error-on=any update >&2 ||
        die "label $label: apt-get update for Debian $suite failed"
}

fetch_debian() { # label suite
    local label="$1" suite="$2" ptr="$ctd_cache/debian-$2.version" ver dir deb upstream
    # The version is only known after apt-get update; remember what was
    # resolved last time and reuse it unless a refresh is asked for.
    ver=""
    if [[ -z "${IMGBRIDGE_MATRIX_REFRESH:-}" && -f "$ptr" ]]; then
        ver="$(<"$ptr")"
        [[ -x "$ctd_cache/${ver//:/_}/bin/containerd" ]] || ver=""
    fi
    if [[ -z "$ver" ]]; then
        apt_update "$label" "$suite"
        apt_opts "$suite"
        ver="$(apt-cache "${apt[@]}" policy containerd | awk '/Candidate:/ {print $2}')"
        [[ -n "$ver" && "$ver" != "(none)" ]] ||
            die "label $label: no containerd package in Debian $suite"
        # Debian versions look like 1.7.24~ds1-6+deb13u1: the upstream part
        # must belong to this label, or the label would silently change.
        [[ "${ver#*:}" == "$label."* ]] ||
            die "label $label: Debian $suite now has containerd $ver (not $label.x); update the matrix"
    fi
    # No ':' (an epoch) in the dir name: the bin dir goes into PATH.
    dir="$ctd_cache/${ver//:/_}"
    upstream="${ver#*:}" && upstream="${upstream%%[~+-]*}"
    if [[ ! -x "$dir/bin/containerd" ]]; then
        log "downloading containerd=$ver from Debian $suite"
        gobuild_new_tmp "$ctd_cache"
        # apt's download sandbox runs as _apt, which must be able to write here.
        if id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
        (cd "$tmp" && apt-get "${apt[@]}" -q download "containerd=$ver" >&2) ||
            die "label $label: apt-get download containerd=$ver failed"
        chown root "$tmp"
        deb=("$tmp"/containerd_*.deb)
        [[ -f "${deb[0]}" ]] || die "label $label: no .deb downloaded"
        dpkg-deb -x "${deb[0]}" "$tmp/root"
        mkdir -p "$tmp/bin"
        for b in "${binaries[@]}"; do
            [[ -f "$tmp/root/usr/bin/$b" ]] ||
                die "label $label: package containerd=$ver has no usr/bin/$b"
            mv "$tmp/root/usr/bin/$b" "$tmp/bin/$b"
        done
        rm -rf "$tmp/root" "${deb[@]}"
        check_bindir "$label" "$tmp/bin" "$upstream" >/dev/null
        chmod 755 "$tmp"
        gobuild_install "$tmp" "$dir" containerd
    fi
    printf '%s\n' "$ver" >"$ptr.tmp.$$" && mv -f "$ptr.tmp.$$" "$ptr"
    check_bindir "$label" "$dir/bin" "$upstream" >/dev/null
    echo "$label $ver $dir/bin"
}

# ------------------------------------------------------------------- 2.4 Go

# Sets the array $units (see scripts/lib/gobuild.sh) for containerd $1.
# Flags follow containerd's Makefile (+ Makefile.linux) for a release build:
# version stamped via ldflags (Revision stays empty: the module proxy carries
# no commit id), -s -w, tag urfave_cli_no_docs, and -buildmode=pie with cgo
# for containerd/ctr (cgo brings in the btrfs snapshotter; it needs only
# linux/btrfs.h from linux-libc-dev). The shim is built as upstream does:
# CGO_ENABLED=0 (static) with tag no_grpc. Without a C compiler we fall back
# to CGO_ENABLED=0 (no btrfs snapshotter, which the tests do not use).
containerd_units() { # version go
    local ver="$1" go="$2" cc cgo ldflags
    cc="$("$go" env CC)"
    if command -v "${cc%% *}" >/dev/null 2>&1; then cgo=1; else
        cgo=0
        log "no C compiler ($cc); building containerd/ctr with CGO_ENABLED=0"
    fi
    ldflags="-X $containerd_module/version.Version=$ver -X $containerd_module/version.Package=$containerd_module -s -w"
    units=(
        "$cgo|urfave_cli_no_docs|$ldflags|-buildmode=pie|$containerd_module/cmd/containerd $containerd_module/cmd/ctr"
        "0|urfave_cli_no_docs no_grpc|$ldflags||$containerd_module/cmd/containerd-shim-runc-v2"
    )
}

fetch_go_containerd() { # label
    local label="$1" go ver
    local -a units
    go="$(gobuild_find_go)" || die "label $label: go not found (needed to build containerd)"
    ver="$(gobuild_pin containerd "$containerd_module")"
    [[ -n "$ver" ]] || die "label $label: $containerd_module not pinned in tests/peers/containerd/go.mod"
    [[ "$ver" == "v$label."* ]] ||
        die "label $label: tests/peers/containerd/go.mod pins $containerd_module $ver (not v$label.x)"
    containerd_units "$ver" "$go"
    # shellcheck disable=SC2317  # called by gobuild_fetch
    check_new() { check_bindir "$label" "$1" "$ver" >/dev/null; }
    gobuild_fetch containerd "$go" "$ctd_cache/$ver" containerd check_new "${units[@]}"
    ver="$(check_bindir "$label" "$gobuild_bindir" "$ver")"
    echo "$label $ver $gobuild_bindir"
}

# --------------------------------------------------------------------- main

fetch_label() { # label; run in a subshell (see below)
    trap gobuild_cleanup EXIT
    mkdir -p "$ctd_cache"
    case "$1" in
        1.6) fetch_system 1.6 ;;
        1.7) fetch_debian 1.7 trixie ;;
        2.1) fetch_debian 2.1 sid ;;
        2.4) fetch_go_containerd 2.4 ;;
        *) die "unknown label '$1' (known: ${all_labels[*]})" ;;
    esac
}

cmd="${1:-}"
case "$cmd" in
    fetch)
        shift
        labels=("$@")
        ((${#labels[@]})) || labels=("${all_labels[@]}")
        gobuild_each "could not provide containerd for label(s)" fetch_label "${labels[@]}"
        ;;
    versions)
        gobuild_all_pins
        ;;
    verify)
        go="$(gobuild_find_go)" || die "go not found"
        containerd_units "$(gobuild_pin containerd "$containerd_module")" "$go"
        gobuild_verify containerd "$go" "${units[@]}"
        ;;
    *)
        echo "usage: $0 fetch [LABEL...] | versions | verify   (labels: ${all_labels[*]})" >&2
        exit 2
        ;;
esac
