#!/usr/bin/env bash
# Collects the licence files that ship with the static binary: imgbridge's
# own LICENSE and THIRD-PARTY-LICENSES, the licence texts of every crate
# linked into it (normal dependencies for the targets, from Cargo.lock), of
# the C libraries those crates bundle (jemalloc, zstd) and of the C library
# the static binary contains (musl; glibc for *-gnu targets).
#
#   scripts/licenses.sh OUTDIR [RUST_TARGET...]   (default x86_64-unknown-linux-musl)
#
# Deterministic: crates in name order, files in name order.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "licenses: $*" >&2; exit 1; }

out="${1:?usage: $0 OUTDIR [RUST_TARGET...]}"
shift
targets=("$@")
((${#targets[@]})) || targets=(x86_64-unknown-linux-musl)
export LC_ALL=C
mkdir -p "$out"
cp LICENSE "$out/LICENSE"

meta="$(mktemp)"
trap 'rm -f "$meta"' EXIT
cargo metadata --format-version 1 --locked >"$meta"

# "<name> <version>" of every crate linked in (not build or dev dependencies).
crates="$(for t in "${targets[@]}"; do
    cargo tree --locked -e normal --target "$t" --prefix none --format '{p}'
done | sed 's/ (\*)$//; s/ (.*)$//' | sort -u)"
[[ -n "$crates" ]] || die "cargo tree listed no crates"

{
    echo "imgbridge links the following software into its static binary."
    echo "Each section names a crate, its version and licence expression, then"
    echo "the licence files it ships (and those of C code it bundles)."
    echo
    for t in "${targets[@]}"; do
        case "$t" in
            *-musl) libc="musl libc (MIT)" doc=/usr/share/doc/musl/copyright ;;
            *-gnu) libc="GNU C Library (LGPL-2.1-or-later; imgbridge's source is public, so the binary can be relinked)"
                doc=/usr/share/doc/libc6-dev-arm64-cross/copyright ;;
        esac
        echo "== $libc, statically linked ($t)"
        if [[ -f "$doc" ]]; then cat "$doc"; else echo "(licence text: $doc missing on the build machine)"; fi
        echo
    done
    while read -r name ver; do
        [[ "$name" == imgbridge ]] && continue
        ver="${ver#v}"
        read -r dir lic < <(jq -r --arg n "$name" --arg v "$ver" \
            '.packages[] | select(.name == $n and .version == $v)
             | "\(.manifest_path | rtrimstr("/Cargo.toml")) \(.license // "see files")"' "$meta")
        [[ -n "${dir:-}" ]] || die "no metadata for $name $ver"
        echo "== $name $ver ($lic)"
        # Top-level licence files; for -sys crates also the bundled C sources'.
        depth=1
        [[ "$name" == *-sys ]] && depth=3
        found=0
        while IFS= read -r f; do
            echo "-- ${f#"$dir"/}"
            cat "$f"
            echo
            found=1
        done < <(find "$dir" -maxdepth "$depth" -type f \
            \( -iname 'LICEN[CS]E*' -o -iname 'COPYING*' -o -iname 'NOTICE*' -o -iname 'COPYRIGHT*' \) \
            -not -path '*/tests/*' | sort)
        ((found)) || echo "-- (no licence file in the crate; licence: $lic)"
        echo
    done <<<"$crates"
} >"$out/THIRD-PARTY-LICENSES"
echo "licenses: $(grep -c '^== ' "$out/THIRD-PARTY-LICENSES") components in $out/THIRD-PARTY-LICENSES" >&2
