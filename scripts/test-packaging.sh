#!/usr/bin/env bash
# Packaging test, for a throwaway CI machine (it installs the package):
# builds the .deb, installs it with dpkg -i, checks the installed binary,
# files and config, and runs systemd-analyze verify on the installed units.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build-deb.sh
deb=$(ls -t target/debian/imgbridge_*.deb | head -n1)
ls -l target/debian/
echo "== package: $deb"
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"

echo "== dpkg -i"
dpkg -i "$deb"

fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== installed binary"
v=$(/usr/bin/imgbridge --version)
echo "$v"
want=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
[[ $v == "imgbridge $want ("*")" ]] || fail "unexpected --version: $v"

echo "== installed files"
for f in /lib/systemd/system/imgbridge.service /lib/systemd/system/imgbridge.socket \
         /etc/imgbridge/config.toml /usr/share/man/man8/imgbridge.8.gz \
         /usr/share/man/man8/imgbridge-serve.8.gz /usr/share/man/man8/imgbridge-doctor.8.gz \
         /usr/share/bash-completion/completions/imgbridge; do
    [ -f "$f" ] || fail "missing $f"
    echo "ok $f"
done
dpkg-query -W -f='${Conffiles}\n' imgbridge | grep -q /etc/imgbridge/config.toml \
    || fail "/etc/imgbridge/config.toml is not a conffile"
echo "ok /etc/imgbridge/config.toml is a conffile"
/usr/bin/imgbridge serve --config /etc/imgbridge/config.toml --print-config >/dev/null \
    || fail "the installed config does not load"
echo "ok installed config loads"
if command -v man >/dev/null; then
    man -w imgbridge >/dev/null || fail "man page not found by man"
    echo "ok man imgbridge"
fi

echo "== systemd-analyze verify"
if command -v systemd-analyze >/dev/null; then
    # Exit status and output: any warning about our units fails the test.
    out=$(systemd-analyze verify /lib/systemd/system/imgbridge.socket /lib/systemd/system/imgbridge.service 2>&1) || {
        echo "$out"; fail "systemd-analyze verify failed"; }
    echo "$out"
    if grep -i 'imgbridge' <<<"$out"; then fail "systemd-analyze reported problems in imgbridge units"; fi
    echo "ok systemd-analyze verify"
    echo "== systemd-analyze security (exposure score, informational)"
    systemd-analyze security --offline=true /lib/systemd/system/imgbridge.service 2>/dev/null | tail -n 3 || true
else
    echo "SKIP: systemd-analyze not installed; units not verified"
fi

echo "PASS: packaging"
