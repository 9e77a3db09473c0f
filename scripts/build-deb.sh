#!/usr/bin/env bash
# Builds target/x86_64-unknown-linux-musl/debian/imgbridge_<version>-1_amd64.deb
# with cargo-deb from the static binary (scripts/build-static.sh: the same
# binary as the release tarball and the image, no shared library needed),
# then the man page and completions generated from it, then the package.
set -euo pipefail
cd "$(dirname "$0")/.."

triple=x86_64-unknown-linux-musl
# Pinned, installed once into the tools cache (scripts/lib/cargo-tools.sh).
cargo_deb="$(scripts/lib/cargo-tools.sh path cargo-deb)"

echo "== static release binary"
bin="$(scripts/build-static.sh x86_64 | awk '$1 == "x86_64" { print $2 }')"

echo "== generating man page and completions into target/assets"
rm -rf target/assets && mkdir -p target/assets/man
"$bin" man --dir target/assets/man
gzip -9n target/assets/man/*.8
"$bin" completions bash > target/assets/imgbridge.bash
"$bin" completions zsh > target/assets/_imgbridge
"$bin" completions fish > target/assets/imgbridge.fish

echo "== cargo deb --target $triple"
# Asset paths target/release/... are read from target/$triple/release/.
# Debug info (profile.release debug = 1) goes into a separate -dbgsym package.
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}" \
    PATH="$(dirname "$cargo_deb"):$PATH" cargo deb --no-build --dbgsym --target "$triple"
