#!/usr/bin/env bash
# Packaging test, for a throwaway CI machine (it installs the .deb): runs
# scripts/release.sh and checks every artefact in dist/:
#   - SHA256SUMS matches; names carry Cargo.toml's version
#   - the tarball's binary is static (no interpreter, no NEEDED) and runs in
#     an empty root (a chroot holding only it and /etc/group) in front of a
#     private containerd 2.4, socket group looked up by name; through it
#     `ctr import` loads the OCI archive into the build namespace and the
#     image is in k8s.io when the call returns; the image then runs as a
#     container (its only file is the binary); nerdctl load and skopeo read
#     the archive too
#   - the image's labels, user, entrypoint
#   - a second release.sh run writes the same bytes (reproducibility)
#   - the tarball's files, the OpenRC script's syntax, the SBOM, the chart
#   - the .deb: installed with dpkg -i, its binary, files, config and units
set -euo pipefail
cd "$(dirname "$0")/.."
repo_root="$PWD"
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok $*"; }
work="$(mktemp -d /tmp/imgbridge-pkg.XXXXXX)"
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    umount -R "$work/ctd/state" 2>/dev/null || true
    rm -rf "$work" 2>/dev/null || true
}
trap cleanup EXIT

# x86_64 only unless told: an aarch64 build costs CI about six more minutes
# of two cores (IMGBRIDGE_ARCHS="x86_64 aarch64" checks both).
export IMGBRIDGE_ARCHS="${IMGBRIDGE_ARCHS:-x86_64}"

# Twice: the second run must write the same bytes (cargo does not rebuild
# the binary; everything made from it is made again).
echo "== scripts/release.sh (1)"
scripts/release.sh
cp dist/SHA256SUMS "$work/SHA256SUMS.1"
echo "== scripts/release.sh (2)"
scripts/release.sh
diff -u "$work/SHA256SUMS.1" dist/SHA256SUMS || fail "a second release.sh run wrote other bytes"
ok "two release.sh runs: the same SHA256SUMS (tarball, .deb, image, chart, SBOM)"

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
commit="$(git rev-parse HEAD)"
dist="$repo_root/dist"
tarball="$dist/imgbridge-$version-x86_64-linux.tar.gz"
image="$dist/imgbridge-$version-oci.tar"
chart="$dist/imgbridge-$version.tgz"
sbom="$dist/imgbridge-$version.cdx.json"
deb="$dist/imgbridge_${version}-1_amd64.deb"

echo "== dist/"
for f in "$tarball" "$image" "$chart" "$sbom" "$deb" "$dist/SHA256SUMS"; do
    [[ -s "$f" ]] || fail "missing $f"
done
(cd "$dist" && sha256sum --check --strict SHA256SUMS) || fail "SHA256SUMS does not match"
[[ "$(wc -l <"$dist/SHA256SUMS")" -eq "$(($(ls "$dist" | wc -l) - 1))" ]] || fail "SHA256SUMS does not list every artefact"
ok "every artefact, SHA256SUMS verified"

# Polls "$@" every 50 ms for up to 10 s.
wait_for() { local i; for i in $(seq 200); do "$@" 2>/dev/null && return 0; sleep 0.05; done; return 1; }

echo "== static tarball"
tar -xzf "$tarball" -C "$work"
t="$work/imgbridge-$version-x86_64-linux"
for f in imgbridge LICENSE THIRD-PARTY-LICENSES INSTALL.md config.toml man/imgbridge.8.gz \
    man/imgbridge-serve.8.gz completions/imgbridge.bash completions/_imgbridge \
    completions/imgbridge.fish systemd/imgbridge.service systemd/imgbridge.socket \
    openrc/imgbridge openrc/imgbridge.confd kubernetes/daemonset.yaml; do
    [[ -f "$t/$f" ]] || fail "tarball lacks $f"
done
grep -qx 'ExecStart=/usr/local/bin/imgbridge serve --config /etc/imgbridge/config.toml' "$t/systemd/imgbridge.service" ||
    fail "tarball's unit does not start /usr/local/bin/imgbridge"
sh -n "$t/openrc/imgbridge" || fail "OpenRC script: syntax"
head -n1 "$t/openrc/imgbridge" | grep -qx '#!/sbin/openrc-run' || fail "OpenRC script lacks #!/sbin/openrc-run"
grep -q '^== tokio ' "$t/THIRD-PARTY-LICENSES" || fail "THIRD-PARTY-LICENSES lacks tokio"
ok "tarball files"
# docs/install.md's edits for Rancher Desktop and colima, on the tarball's config.
cp "$t/config.toml" "$work/desktop.toml"
sed -i 's|^source_namespaces = .*|source_namespaces = ["default", "buildkit"]|' "$work/desktop.toml"
sed -i 's|^upstream = .*|upstream = "/run/k3s/containerd/containerd.sock"|' "$work/desktop.toml"
"$t/imgbridge" serve --config "$work/desktop.toml" --print-config >"$work/desktop.printed"
flat="$(tr -d ' \n' <"$work/desktop.printed")"
[[ "$flat" == *'source_namespaces=["default","buildkit",]'* &&
    "$flat" == *'upstream="/run/k3s/containerd/containerd.sock"'* ]] ||
    fail "docs/install.md's desktop edits do not take: $(cat "$work/desktop.printed")"
ok "the desktop recipe's config edits load"
file "$t/imgbridge"
ldd "$t/imgbridge" 2>&1 | sed 's/^/ldd: /' || true
if readelf -lW "$t/imgbridge" | grep INTERP >/dev/null || readelf -dW "$t/imgbridge" | grep NEEDED >/dev/null; then
    fail "the tarball's binary is not static"
fi
[[ "$("$t/imgbridge" --version)" == "imgbridge $version (${commit:0:12})" ]] || fail "--version: $("$t/imgbridge" --version)"
ok "static binary (no interpreter, no NEEDED), --version stamped"

if [[ " $IMGBRIDGE_ARCHS " == *" aarch64 "* ]]; then
    echo "== aarch64 tarball"
    tar -xzf "$dist/imgbridge-$version-aarch64-linux.tar.gz" -C "$work"
    a="$work/imgbridge-$version-aarch64-linux/imgbridge"
    file "$a"
    if readelf -lW "$a" | grep INTERP >/dev/null || readelf -dW "$a" | grep NEEDED >/dev/null; then
        fail "the aarch64 binary is not static"
    fi
    readelf -hW "$a" | grep -E 'Machine:.*AArch64' >/dev/null || fail "the aarch64 tarball's binary is not AArch64"
    if command -v qemu-aarch64-static >/dev/null; then
        # In an empty root too: only the binary, qemu and /etc/group.
        r="$work/root-arm64"
        mkdir -p "$r/etc" "$r/run"
        cp "$a" "$r/imgbridge"
        cp "$(command -v qemu-aarch64-static)" "$r/qemu"
        printf 'root:x:0:\nbuilders:x:4242:\n' >"$r/etc/group"
        [[ "$(chroot "$r" /qemu /imgbridge --version)" == "imgbridge $version (${commit:0:12})" ]] ||
            fail "aarch64 --version under qemu"
        chroot "$r" /qemu /imgbridge serve --listen /run/ib.sock --upstream /run/none.sock \
            --socket-group builders >"$work/arm64.log" 2>&1 &
        pids+=($!)
        wait_for test -S "$r/run/ib.sock" || { cat "$work/arm64.log"; fail "aarch64 binary did not listen in an empty root"; }
        [[ "$(stat -c %g "$r/run/ib.sock")" == 4242 ]] || fail "aarch64: socket group not resolved from /etc/group"
        ok "aarch64 binary: static, serves in an empty root under qemu, socket group from /etc/group"
    else
        ok "aarch64 binary: static AArch64 (qemu-user-static missing: not run)"
    fi
fi

echo "== the static binary in an empty root, in front of a private containerd"
# containerd 2.4 of the test matrix (cached by scripts/test.sh's matrix
# step): nerdctl load needs its streaming service, which 1.6 lacks.
ctd_bin="$(scripts/containerd-matrix.sh fetch 2.4 | awk '{print $3}')"
[[ -x "$ctd_bin/containerd" ]] || fail "no containerd 2.4 from scripts/containerd-matrix.sh"
export PATH="$ctd_bin:$PATH"
root="$work/root"
mkdir -p "$root/etc" "$root/run/containerd" "$root/run/imgbridge"
cp "$t/imgbridge" "$root/imgbridge"
printf 'root:x:0:\nbuilders:x:4242:\n' >"$root/etc/group"
scripts/lib/containerd-config.sh --dir "$work/ctd" --containerd "$ctd_bin/containerd" --cri \
    --socket "$root/run/containerd/containerd.sock" >"$work/containerd.toml"
containerd --config "$work/containerd.toml" >"$work/containerd.log" 2>&1 &
pids+=($!)
ctrd=(ctr --address "$root/run/containerd/containerd.sock")
wait_for "${ctrd[@]}" version >/dev/null || { cat "$work/containerd.log"; fail "containerd did not start"; }
port=$((20000 + RANDOM % 20000))
chroot "$root" /imgbridge serve --upstream /run/containerd/containerd.sock \
    --listen /run/imgbridge/containerd.sock --socket-group builders \
    --metrics-listen "127.0.0.1:$port" >"$work/imgbridge.log" 2>&1 &
pids+=($!)
wait_for test -S "$root/run/imgbridge/containerd.sock" || { cat "$work/imgbridge.log"; fail "imgbridge did not listen in the empty root"; }
[[ "$(stat -c %g "$root/run/imgbridge/containerd.sock")" == 4242 ]] || fail "socket group 'builders' not resolved from /etc/group"
ok "serves in an empty root; socket_group 'builders' → gid 4242 from /etc/group"
wait_for curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" || { curl -sS "http://127.0.0.1:$port/readyz"; fail "not ready"; }
chroot "$root" /imgbridge doctor --upstream /run/containerd/containerd.sock --listen /run/imgbridge/containerd.sock >"$work/doctor.txt" ||
    { cat "$work/doctor.txt"; fail "doctor fails in the empty root"; }
ok "ready, doctor passes in the empty root"

echo "== the OCI archive: ctr import through the static imgbridge, then run it"
name="docker.io/library/imgbridge:$version"
ctr --address "$root/run/imgbridge/containerd.sock" -n buildkit images import "$image"
# (Listed first, then matched: grep -q in a pipe under pipefail would fail
# the pipe whenever it exits before ctr is done writing.)
listed="$("${ctrd[@]}" -n k8s.io images ls -q)"
grep -qxF "$name" <<<"$listed" ||
    fail "$name not in k8s.io when ctr import returned; k8s.io has: $("${ctrd[@]}" -n k8s.io images ls -q); imgbridge log:"$'\n'"$(tail -n 20 "$work/imgbridge.log")"
ok "ctr import (namespace buildkit, through imgbridge) → $name in k8s.io at once"
out="$("${ctrd[@]}" -n k8s.io run --rm "$name" "imgbridge-pkg-$$" /usr/bin/imgbridge --version)"
[[ "$out" == "imgbridge $version (${commit:0:12})" ]] || fail "the image's binary prints '$out'"
ok "the image runs: $out"
chroot "$root" /imgbridge doctor --upstream /run/containerd/containerd.sock --listen /run/imgbridge/containerd.sock >/dev/null ||
    fail "doctor fails after the import"
if [[ "${IMGBRIDGE_SKIP_PEERS:-0}" != 1 ]]; then
    nerdctl="$(scripts/peers.sh fetch nerdctl | awk '{print $3}')/nerdctl"
    "$nerdctl" --address "$root/run/containerd/containerd.sock" --namespace loadtest load -i "$image"
    listed="$("${ctrd[@]}" -n loadtest images ls -q)"
    grep -qxF "$name" <<<"$listed" || fail "nerdctl load did not create $name"
    ok "nerdctl load"
fi
skopeo inspect "oci-archive:$image" >"$work/inspect.json"
jq -e --arg v "$version" --arg c "$commit" '.Architecture == "amd64" and .Os == "linux"
    and .Labels["org.opencontainers.image.version"] == $v
    and .Labels["org.opencontainers.image.revision"] == $c
    and .Labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    and (.Labels["org.opencontainers.image.source"] | length > 0)' "$work/inspect.json" >/dev/null ||
    fail "image labels: $(cat "$work/inspect.json")"
skopeo inspect --config "oci-archive:$image" |
    jq -e '.config.Entrypoint == ["/usr/bin/imgbridge"] and .config.User == "0:0"' >/dev/null ||
    fail "image config: entrypoint or user"
skopeo copy -q "oci-archive:$image" "oci:$work/copy:$version" || fail "skopeo copy"
tar -tzf "$(ls -S "$work"/copy/blobs/sha256/* | head -n1)" | sort >"$work/layer.txt"
diff -u <(printf '%s\n' usr/ usr/bin/ usr/bin/imgbridge usr/share/ usr/share/doc/ usr/share/doc/imgbridge/ \
    usr/share/doc/imgbridge/LICENSE usr/share/doc/imgbridge/THIRD-PARTY-LICENSES | sort) "$work/layer.txt" ||
    fail "the layer holds more or less than the binary and its licences"
ok "skopeo inspect/copy: digest $(jq -r .Digest "$work/inspect.json"), labels, entrypoint, user 0:0, one layer of binary + licences"

echo "== chart and SBOM"
helm="$(scripts/peers.sh fetch helm | awk '{print $3}')/helm"
"$helm" show chart "$chart" | grep -x "version: $version" >/dev/null || fail "packaged chart version"
"$helm" lint --strict "$chart" >/dev/null || fail "helm lint of the packaged chart"
ok "packaged chart: version $version, lint"
jq -e --arg v "$version" '.bomFormat == "CycloneDX" and .metadata.component.name == "imgbridge"
    and .metadata.component.version == $v
    and ([.components[] | select(.name == "tokio")] | length == 1)' "$sbom" >/dev/null ||
    fail "SBOM: not CycloneDX for imgbridge $version with tokio"
ok "SBOM: CycloneDX, $(jq '.components | length' "$sbom") components"

echo "== .deb: $deb"
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"
dpkg -i "$deb"
v=$(/usr/bin/imgbridge --version)
echo "$v"
[[ $v == "imgbridge $version ("*")" ]] || fail "unexpected --version: $v"
readelf -dW /usr/bin/imgbridge | grep NEEDED >/dev/null && fail "the packaged binary is not static"
for f in /lib/systemd/system/imgbridge.service /lib/systemd/system/imgbridge.socket \
         /etc/imgbridge/config.toml /usr/share/man/man8/imgbridge.8.gz \
         /usr/share/man/man8/imgbridge-serve.8.gz /usr/share/man/man8/imgbridge-doctor.8.gz \
         /usr/share/bash-completion/completions/imgbridge; do
    [ -f "$f" ] || fail "missing $f"
    echo "ok $f"
done
dpkg-query -W -f='${Conffiles}\n' imgbridge | grep /etc/imgbridge/config.toml >/dev/null \
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
