#!/usr/bin/env bash
# Builds target/debian/imgbridge_<version>_<arch>.deb with cargo-deb: release
# binary, then the man page and completions generated from it, then the package.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo-deb >/dev/null; then
    echo "== installing cargo-deb"
    cargo install cargo-deb --locked
fi

echo "== cargo build --release"
cargo build --release --bin imgbridge
bin=target/release/imgbridge

echo "== generating man page and completions into target/assets"
rm -rf target/assets && mkdir -p target/assets/man
"$bin" man --dir target/assets/man
gzip -9n target/assets/man/*.8
"$bin" completions bash > target/assets/imgbridge.bash
"$bin" completions zsh > target/assets/_imgbridge
"$bin" completions fish > target/assets/imgbridge.fish

echo "== cargo deb"
# Debug info (profile.release debug = 1) goes into a separate -dbgsym package.
cargo deb --no-build --dbgsym
