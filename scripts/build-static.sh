#!/usr/bin/env bash
# Builds the static imgbridge binary (the C library linked in, no shared
# libraries: it runs on any Linux, Alpine and empty container roots
# included) for each architecture named, x86_64 by default:
#
#   scripts/build-static.sh [x86_64] [aarch64]
#       stdout, one line each: <arch> <absolute path of the binary>
#
#   x86_64   x86_64-unknown-linux-musl: musl linked in; the C code linked in
#            (jemalloc, zstd) is compiled with Debian's musl-tools
#   aarch64  aarch64-unknown-linux-gnu with crt-static: glibc linked in;
#            Debian's gcc-aarch64-linux-gnu and libc6-dev-arm64-cross
# The Rust standard library of each target comes from rustup. What is
# missing is named.
#
# Reproducible: --locked, the checkout, target dir and cargo home remapped
# out of panic locations, and the git commit stamped by build.rs; the binary keeps line tables (profile.release
# debug = 1) for the .deb's -dbgsym package, release.sh strips its copies.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "build-static: $*" >&2; exit 1; }
log() { echo "build-static: $*" >&2; }

cargo_home="${CARGO_HOME:-$HOME/.cargo}"
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"

need_target() { # rust triple
    rustup target list --installed 2>/dev/null | grep -x "$1" >/dev/null && return 0
    log "installing the Rust standard library for $1 (rustup target add)"
    rustup target add "$1" >&2 ||
        die "the Rust standard library for $1 is missing and rustup could not fetch it (rustup target add $1)"
}

build() { # arch
    local arch="$1" triple env_triple
    unset JEMALLOC_SYS_WITH_LG_PAGE
    case "$arch" in
        x86_64)
            triple=x86_64-unknown-linux-musl
            # The cc crate finds musl-gcc for this target by itself.
            command -v musl-gcc >/dev/null || die "musl-gcc missing: apt-get install musl-tools"
            ;;
        aarch64)
            # glibc linked in (crt-static): Debian's cross gcc and arm64
            # glibc install without a second dpkg architecture, musl's
            # arm64 headers do not. Nothing here needs glibc's NSS: see
            # docs/packaging.md.
            triple=aarch64-unknown-linux-gnu
            command -v aarch64-linux-gnu-gcc >/dev/null ||
                die "aarch64-linux-gnu-gcc missing: apt-get install gcc-aarch64-linux-gnu"
            [[ -f /usr/aarch64-linux-gnu/lib/libc.a ]] ||
                die "/usr/aarch64-linux-gnu/lib/libc.a missing: apt-get install libc6-dev-arm64-cross"
            export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
            export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
            # jemalloc cannot probe the page size when cross-compiled: 64 KiB
            # pages work on 4, 16 and 64 KiB kernels alike.
            export JEMALLOC_SYS_WITH_LG_PAGE=16
            ;;
        *) die "architecture '$arch': x86_64 or aarch64" ;;
    esac
    need_target "$triple"
    env_triple="$(tr 'a-z-' 'A-Z_' <<<"$triple")"
    # Only the target's crates get these flags (not build scripts, which run
    # here). The remaps keep where this checkout, its target dir (code
    # generated into OUT_DIR) and the cargo home are out of panic locations;
    # cargo leaves --remap-path-prefix out of its crate hashes, so symbol
    # names and the binary do not depend on them.
    export "CARGO_TARGET_${env_triple}_RUSTFLAGS=-C target-feature=+crt-static --remap-path-prefix=$PWD=/build --remap-path-prefix=$target_dir=/build/target --remap-path-prefix=$cargo_home=/cargo"
    # The same for the C code's debug info (jemalloc's build dir, zstd's
    # sources): the linker's build id hashes it, and the build id stays in
    # the stripped copies.
    export "CFLAGS_${triple//-/_}=-ffile-prefix-map=$target_dir=/build/target -ffile-prefix-map=$cargo_home=/cargo"
    log "cargo build --release --locked --target $triple"
    # Without SOURCE_DATE_EPOCH: nothing in the binary reads it, but the cc
    # crate's build scripts watch it, so a value set by release.sh (the
    # commit's time) would rebuild jemalloc and zstd at every commit and at
    # every switch between release.sh and test.sh.
    env -u SOURCE_DATE_EPOCH cargo build --release --locked --target "$triple" --bin imgbridge >&2
    local bin="$target_dir/$triple/release/imgbridge"
    # Static: no program interpreter, no shared library needed.
    if readelf -lW "$bin" | grep INTERP >/dev/null || readelf -dW "$bin" | grep NEEDED >/dev/null; then
        die "$bin is not static: $(readelf -dW "$bin" | grep NEEDED)"
    fi
    echo "$arch $bin"
}

archs=("$@")
((${#archs[@]})) || archs=(x86_64)
for a in "${archs[@]}"; do build "$a"; done
