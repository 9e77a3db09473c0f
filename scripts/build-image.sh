#!/usr/bin/env bash
# Builds imgbridge's OCI image from static binaries alone (no base image, no
# registry, no container engine) into an oci-archive tar that `ctr import`,
# `nerdctl load` and `skopeo copy oci-archive:` read.
#
#   scripts/build-image.sh OUT.tar ARCH=BINARY [ARCH=BINARY...]
#       ARCH is an OCI architecture (amd64, arm64). One ARCH: index.json
#       names that image's manifest; several: an image index of them.
#
# The one layer holds /usr/bin/imgbridge (the entrypoint, run as root: it
# owns a socket next to containerd's, root:root 0660) and the licence files
# under /usr/share/doc/imgbridge/. Every byte is a function of the inputs and
# SOURCE_DATE_EPOCH (sorted names, ustar, uid/gid 0, fixed mtimes, gzip -n,
# JSON with sorted keys), so one commit always gives the same digest.
#
# Environment (defaults from the checkout):
#   IMGBRIDGE_VERSION    Cargo.toml's version
#   IMGBRIDGE_REVISION   git rev-parse HEAD
#   SOURCE_DATE_EPOCH    the commit's time (git log -1 --format=%ct)
#   IMGBRIDGE_IMAGE_NAME image name recorded for importers
#                        (default docker.io/library/imgbridge:<version>)
#   IMGBRIDGE_LICENSES   dir of licence files for /usr/share/doc/imgbridge
#                        (default: LICENSE only)
# Prints the image's digest (the manifest's, or the index's) on stdout.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "build-image: $*" >&2; exit 1; }
(($# >= 2)) || die "usage: $0 OUT.tar ARCH=BINARY [ARCH=BINARY...]"
out="$1"
shift

version="${IMGBRIDGE_VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo_root/Cargo.toml" | head -n1)}"
revision="${IMGBRIDGE_REVISION:-$(git -C "$repo_root" rev-parse HEAD)}"
epoch="${SOURCE_DATE_EPOCH:-$(git -C "$repo_root" log -1 --format=%ct)}"
name="${IMGBRIDGE_IMAGE_NAME:-docker.io/library/imgbridge:$version}"
source_url="$(sed -n 's/^repository = "\(.*\)"/\1/p' "$repo_root/Cargo.toml" | head -n1)"
license="$(sed -n 's/^license = "\(.*\)"/\1/p' "$repo_root/Cargo.toml" | head -n1)"
created="$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)"
[[ "$version" =~ ^[0-9A-Za-z.+-]+$ ]] || die "bad version '$version'"
[[ "$revision" =~ ^[0-9a-f]+$ ]] || die "bad revision '$revision'"
for v in "$name" "$source_url" "$license"; do
    [[ "$v" != *[\"\\]* ]] || die "'$v' would need JSON escaping"
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
blobs="$work/layout/blobs/sha256"
mkdir -p "$blobs"
export LC_ALL=C TZ=UTC

# Stores stdin as a blob; prints "<sha256> <size>".
put_blob() {
    local tmp="$work/blob.tmp" sum
    cat >"$tmp"
    sum="$(sha256sum "$tmp" | cut -d' ' -f1)"
    mv "$tmp" "$blobs/$sum"
    echo "$sum $(stat -c %s "$blobs/$sum")"
}

# A deterministic tar of dir $1's entries (names sorted, ustar: no
# extended headers, root-owned, mtime = epoch, modes as set).
det_tar() {
    tar --create --format=ustar --sort=name --mtime="@$epoch" \
        --owner=0 --group=0 --numeric-owner -C "$1" "${@:2}"
}

q() { printf '"%s"' "$1"; }

labels="$(printf '{%s:%s,%s:%s,%s:%s,%s:%s,%s:%s,%s:%s,%s:%s}' \
    "$(q org.opencontainers.image.created)" "$(q "$created")" \
    "$(q org.opencontainers.image.description)" "$(q "containerd proxy shim: replicates build-namespace images into k8s.io")" \
    "$(q org.opencontainers.image.licenses)" "$(q "$license")" \
    "$(q org.opencontainers.image.revision)" "$(q "$revision")" \
    "$(q org.opencontainers.image.source)" "$(q "$source_url")" \
    "$(q org.opencontainers.image.title)" "$(q imgbridge)" \
    "$(q org.opencontainers.image.version)" "$(q "$version")")"

manifests=()
for spec in "$@"; do
    arch="${spec%%=*}" bin="${spec#*=}"
    [[ "$arch" =~ ^(amd64|arm64)$ ]] || die "architecture '$arch': amd64 or arm64"
    [[ -x "$bin" ]] || die "$bin: not an executable"

    root="$work/rootfs-$arch"
    mkdir -p "$root/usr/bin" "$root/usr/share/doc/imgbridge"
    install -m 0755 "$bin" "$root/usr/bin/imgbridge"
    if [[ -n "${IMGBRIDGE_LICENSES:-}" ]]; then
        cp -r "$IMGBRIDGE_LICENSES/." "$root/usr/share/doc/imgbridge/"
    else
        cp "$repo_root/LICENSE" "$root/usr/share/doc/imgbridge/LICENSE"
    fi
    find "$root" -type d -exec chmod 0755 {} +
    find "$root/usr/share" -type f -exec chmod 0644 {} +
    det_tar "$root" usr >"$work/layer-$arch.tar"
    diff_id="$(sha256sum "$work/layer-$arch.tar" | cut -d' ' -f1)"
    read -r layer layer_size < <(gzip -9 -n -c "$work/layer-$arch.tar" | put_blob)

    read -r config config_size < <(printf '{"architecture":"%s","config":{"Cmd":["serve"],"Entrypoint":["/usr/bin/imgbridge"],"Env":["PATH=/usr/bin"],"Labels":%s,"User":"0:0"},"created":"%s","history":[{"created":"%s","created_by":"scripts/build-image.sh: /usr/bin/imgbridge and its licence files"}],"os":"linux","rootfs":{"diff_ids":["sha256:%s"],"type":"layers"}}' \
        "$arch" "$labels" "$created" "$created" "$diff_id" | put_blob)
    read -r manifest manifest_size < <(printf '{"annotations":%s,"config":{"digest":"sha256:%s","mediaType":"application/vnd.oci.image.config.v1+json","size":%s},"layers":[{"digest":"sha256:%s","mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","size":%s}],"mediaType":"application/vnd.oci.image.manifest.v1+json","schemaVersion":2}' \
        "$labels" "$config" "$config_size" "$layer" "$layer_size" | put_blob)
    manifests+=("$(printf '{"digest":"sha256:%s","mediaType":"application/vnd.oci.image.manifest.v1+json","platform":{"architecture":"%s","os":"linux"},"size":%s}' \
        "$manifest" "$arch" "$manifest_size")")
done

# index.json names the image for importers: containerd (ctr import, nerdctl
# load) takes io.containerd.image.name, skopeo and umoci the ref.name tag.
names="$(printf '{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}' "$name" "${name##*:}")"
if ((${#manifests[@]} == 1)); then
    # keys stay sorted: annotations before digest
    top="{\"annotations\":$names,${manifests[0]#\{}"
    digest="$manifest"
else
    read -r index index_size < <(printf '{"annotations":%s,"manifests":[%s],"mediaType":"application/vnd.oci.image.index.v1+json","schemaVersion":2}' \
        "$labels" "$(IFS=,; echo "${manifests[*]}")" | put_blob)
    top="$(printf '{"annotations":%s,"digest":"sha256:%s","mediaType":"application/vnd.oci.image.index.v1+json","size":%s}' "$names" "$index" "$index_size")"
    digest="$index"
fi
printf '{"manifests":[%s],"mediaType":"application/vnd.oci.image.index.v1+json","schemaVersion":2}' "$top" >"$work/layout/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$work/layout/oci-layout"
find "$work/layout" -type d -exec chmod 0755 {} +
find "$work/layout" -type f -exec chmod 0644 {} +

mkdir -p "$(dirname "$out")"
det_tar "$work/layout" oci-layout index.json blobs >"$out.tmp"
mv "$out.tmp" "$out"
echo "sha256:$digest"
