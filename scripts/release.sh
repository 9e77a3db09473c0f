#!/usr/bin/env bash
# Writes every release artefact of this commit into dist/:
#
#   imgbridge-<v>-<arch>-linux.tar.gz  static binary, man pages,
#                                      completions, example config, systemd
#                                      units, OpenRC service, licences
#   imgbridge_<v>-1_amd64.deb          the same binary as a Debian package
#   imgbridge-<v>-oci.tar              OCI image (oci-archive), no base image
#   imgbridge-<v>.tgz                  the Helm chart
#   imgbridge-<v>.cdx.json             SBOM (CycloneDX, cargo-cyclonedx)
#   SHA256SUMS                         of all of the above
#
# The version is Cargo.toml's; a tag on HEAD must be v<version>. It is
# stamped into the binary (with the commit), the image labels and the chart.
# SOURCE_DATE_EPOCH is the commit's time, so a second run on the same commit
# gives the same binary, tarball, image and chart bytes.
#
# Environment:
#   IMGBRIDGE_ARCHS   architectures (default "x86_64 aarch64"; see
#                     scripts/build-static.sh for the toolchain of each)
#   IMGBRIDGE_TOOLS   where the pinned cargo tools are installed
#                     (scripts/lib/cargo-tools.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
repo_root="$PWD"
log() { echo "release: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
[[ -n "$version" ]] || die "no version in Cargo.toml"
tag="$(git describe --tags --exact-match 2>/dev/null || true)"
[[ -z "$tag" || "$tag" == "v$version" ]] || die "HEAD is tagged $tag but Cargo.toml says $version"
commit="$(git rev-parse HEAD)"
[[ -z "$(git status --porcelain --untracked-files=no)" ]] ||
    log "WARNING: uncommitted changes: the artefacts are not those of $commit"
SOURCE_DATE_EPOCH="$(git log -1 --format=%ct)"
export SOURCE_DATE_EPOCH LC_ALL=C TZ=UTC
read -ra archs <<<"${IMGBRIDGE_ARCHS:-x86_64 aarch64}"
# Debian packages the build needs; installed when missing (as root).
have() { command -v "$1" >/dev/null 2>&1; }
need_pkgs=()
have musl-gcc || need_pkgs+=(musl-tools)
have objcopy || need_pkgs+=(binutils)
have jq || need_pkgs+=(jq)
if [[ " ${archs[*]} " == *" aarch64 "* ]]; then
    have aarch64-linux-gnu-gcc || need_pkgs+=(gcc-aarch64-linux-gnu)
    [[ -f /usr/aarch64-linux-gnu/lib/libc.a ]] || need_pkgs+=(libc6-dev-arm64-cross)
fi
if ((${#need_pkgs[@]})); then
    [[ "$(id -u)" == 0 ]] || die "missing Debian packages: ${need_pkgs[*]} (apt-get install them, or run as root)"
    log "installing ${need_pkgs[*]} with apt"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >&2
fi
dist="$repo_root/dist"
stage="$repo_root/target/release-stage"
rm -rf "$dist" "$stage"
mkdir -p "$dist" "$stage"
log "imgbridge $version ($commit), SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH, archs: ${archs[*]}"

# Same bytes for the same inputs: sorted names, root-owned, fixed mtimes.
det_tgz() { # out dir entry...
    tar --create --format=ustar --sort=name --mtime="@$SOURCE_DATE_EPOCH" \
        --owner=0 --group=0 --numeric-owner -C "$2" "${@:3}" | gzip -9 -n >"$1"
}

# ------------------------------------------------------------ static binaries
declare -A bins
while read -r arch bin; do bins[$arch]="$bin"; done < <(scripts/build-static.sh "${archs[@]}")
for arch in "${archs[@]}"; do
    [[ -n "${bins[$arch]:-}" ]] || die "no binary for $arch"
    case "$arch" in x86_64) objcopy=objcopy ;; aarch64) objcopy=aarch64-linux-gnu-objcopy ;; esac
    mkdir -p "$stage/$arch"
    # Debug info stays in the .deb's -dbgsym package; shipped copies drop it.
    "$objcopy" --strip-debug "${bins[$arch]}" "$stage/$arch/imgbridge"
done
host_bin="$stage/x86_64/imgbridge"
[[ -x "$host_bin" ]] || die "x86_64 must be among IMGBRIDGE_ARCHS (its binary generates the man pages)"
v="$("$host_bin" --version)"
[[ "$v" == "imgbridge $version (${commit:0:12})" ]] || die "binary reports '$v', expected imgbridge $version (${commit:0:12})"

# ------------------------------------------------------------------ tarballs
triples=()
for arch in "${archs[@]}"; do
    case "$arch" in x86_64) triples+=(x86_64-unknown-linux-musl) ;; aarch64) triples+=(aarch64-unknown-linux-gnu) ;; esac
done
scripts/licenses.sh "$stage/licenses" "${triples[@]}"
for arch in "${archs[@]}"; do
    name="imgbridge-$version-$arch-linux"
    d="$stage/tar/$name"
    mkdir -p "$d/man" "$d/completions" "$d/systemd" "$d/openrc" "$d/kubernetes"
    install -m 0755 "$stage/$arch/imgbridge" "$d/imgbridge"
    "$host_bin" man --dir "$d/man" >/dev/null
    gzip -9 -n "$d"/man/*.8
    "$host_bin" completions bash >"$d/completions/imgbridge.bash"
    "$host_bin" completions zsh >"$d/completions/_imgbridge"
    "$host_bin" completions fish >"$d/completions/imgbridge.fish"
    cp packaging/config.toml "$d/config.toml"
    # The tarball installs into /usr/local (the .deb into /usr).
    sed 's|^ExecStart=/usr/bin/imgbridge|ExecStart=/usr/local/bin/imgbridge|' packaging/imgbridge.service >"$d/systemd/imgbridge.service"
    cp packaging/imgbridge.socket "$d/systemd/"
    cp packaging/openrc/imgbridge packaging/openrc/imgbridge.confd "$d/openrc/"
    # INSTALL.md's "without Helm" recipe applies it from the tarball.
    cp packaging/kubernetes/daemonset.yaml "$d/kubernetes/"
    cp "$stage/licenses/LICENSE" "$stage/licenses/THIRD-PARTY-LICENSES" "$d/"
    cp docs/install.md "$d/INSTALL.md"
    find "$d" -type d -exec chmod 0755 {} +
    find "$d" -type f -exec chmod 0644 {} +
    chmod 0755 "$d/imgbridge" "$d/openrc/imgbridge"
    det_tgz "$dist/$name.tar.gz" "$stage/tar" "$name"
    log "wrote dist/$name.tar.gz"
done

# ---------------------------------------------------------------------- .deb
scripts/build-deb.sh >&2
deb="${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/debian/imgbridge_${version}-1_amd64.deb"
[[ -f "$deb" ]] || die "build-deb.sh left no $deb"
cp "$deb" "$dist/"

# --------------------------------------------------------------------- image
image_args=()
for arch in "${archs[@]}"; do
    case "$arch" in x86_64) image_args+=("amd64=$stage/x86_64/imgbridge") ;; aarch64) image_args+=("arm64=$stage/aarch64/imgbridge") ;; esac
done
digest="$(IMGBRIDGE_VERSION="$version" IMGBRIDGE_REVISION="$commit" IMGBRIDGE_LICENSES="$stage/licenses" \
    scripts/build-image.sh "$dist/imgbridge-$version-oci.tar" "${image_args[@]}")"
echo "$digest" >"$stage/image-digest"
log "wrote dist/imgbridge-$version-oci.tar ($digest)"

# --------------------------------------------------------------------- chart
helm="$(scripts/peers.sh fetch helm | awk '{print $3}')/helm"
"$helm" lint --strict charts/imgbridge >&2
# helm takes SOURCE_DATE_EPOCH for the archive's times.
"$helm" package charts/imgbridge --version "$version" --app-version "$version" --destination "$dist" >&2
[[ -f "$dist/imgbridge-$version.tgz" ]] || die "helm package wrote no imgbridge-$version.tgz"

# ---------------------------------------------------------------------- SBOM
# cargo-cyclonedx: the CycloneDX project's own cargo plugin.
cyclonedx="$(scripts/lib/cargo-tools.sh path cargo-cyclonedx)"
"$cyclonedx" cyclonedx --format json --spec-version 1.5 --target x86_64-unknown-linux-musl \
    --no-build-deps --override-filename "imgbridge-$version.cdx" >&2
# Its refs name this checkout's path (cargo's package id of imgbridge):
# the same fixed path for every checkout, so the SBOM is reproducible too.
sed "s|path+file://$repo_root#|path+file:///build#|g" "imgbridge-$version.cdx.json" >"$dist/imgbridge-$version.cdx.json"
rm "imgbridge-$version.cdx.json"
# It writes one per workspace member: the test harness's (tests/support) is
# not shipped.
rm -f "tests/support/imgbridge-$version.cdx.json"
grep -F "$repo_root" "$dist/imgbridge-$version.cdx.json" >/dev/null && die "the SBOM still names $repo_root"

# ------------------------------------------------------------------ checksums
(cd "$dist" && sha256sum -- * >SHA256SUMS.tmp && mv SHA256SUMS.tmp SHA256SUMS)
log "dist/:"
(cd "$dist" && ls -l >&2 && cat SHA256SUMS >&2)
