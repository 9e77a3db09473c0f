#!/usr/bin/env bash
# The pinned cargo tools of the release (cargo-deb for the .deb,
# cargo-cyclonedx for the SBOM), each `cargo install`ed once into
# $IMGBRIDGE_TOOLS/<crate>-<version> (default
# ${XDG_CACHE_HOME:-~/.cache}/imgbridge-tools) and reused across runs and
# checkouts. Cold, each is minutes of compiling: scripts/test.sh fetches
# them in its Go lane, beside the cargo builds, so the packaging test
# finds them.
#
#   scripts/lib/cargo-tools.sh path CRATE   the tool's binary (installed if missing)
#   scripts/lib/cargo-tools.sh fetch        install every one
set -euo pipefail

declare -A pins=([cargo-deb]=3.8.0 [cargo-cyclonedx]=0.5.9)
tools="${IMGBRIDGE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/imgbridge-tools}"

die() { echo "cargo-tools: $*" >&2; exit 1; }

tool_path() { # crate → path of its binary, installing it first if missing
    local crate="$1" ver="${pins[$1]:-}" dir lockfd
    [[ -n "$ver" ]] || die "unknown tool '$crate' (known: ${!pins[*]})"
    dir="$tools/$crate-$ver"
    if [[ ! -x "$dir/bin/$crate" ]]; then
        mkdir -p "$tools"
        # One install at a time per tool (test.sh's Go lane and release.sh).
        exec {lockfd}>"$dir.lock"
        flock "$lockfd"
        if [[ ! -x "$dir/bin/$crate" ]]; then
            echo "cargo-tools: installing $crate $ver into $dir (first time: builds it, takes minutes)" >&2
            cargo install --locked --quiet --root "$dir" --version "$ver" "$crate" >&2 ||
                die "cargo install $crate $ver failed"
        fi
        exec {lockfd}>&-
    fi
    echo "$dir/bin/$crate"
}

case "${1:-}" in
    path) tool_path "${2:?usage: $0 path CRATE}" ;;
    fetch) for c in "${!pins[@]}"; do tool_path "$c"; done ;;
    *) echo "usage: $0 path CRATE | fetch" >&2; exit 2 ;;
esac
