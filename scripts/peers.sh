#!/usr/bin/env bash
# Provides the real client peers the integration tests drive, built from the
# Go module proxy at the versions pinned in tests/peers/<name>/go.mod (one Go
# module per peer, see tests/peers/README.md), each set in its own bin dir,
# cached outside the repo and reused across runs.
#
#   scripts/peers.sh fetch [NAME...]    (default: buildkit nerdctl crictl spegel kubelet etcd crane conformance oras helm ko)
#       stdout, one line per name: <name> <version> <absolute bindir>
#       bindir holds buildkitd + buildctl (buildkit), nerdctl, crictl,
#       spegel, kubelet (with kube-apiserver, kube-controller-manager,
#       kube-scheduler and kubectl), etcd, crane, conformance, oras, helm, or ko.
#   scripts/peers.sh fetch grpcbench   (not in the default list: only
#       scripts/bench.sh runs it) scripts/bench.sh's grpc-go unary client
#   scripts/peers.sh versions
#       stdout: "<module> <version>" for every Go peer (containerd included)
#   scripts/peers.sh verify [NAME...]
#       checks that each build uses upstream's own dependency versions and
#       mirrors its exclude/replace directives (needs network)
#
# Environment:
#   IMGBRIDGE_CACHE   cache root (default /var/cache/imgbridge-test); builds go
#                     to $IMGBRIDGE_CACHE/peers/<name>-<version>-<hash>/bin
#
# Progress goes to stderr. Exits non-zero naming every peer that could not be
# provided (the lines of the others are still printed). containerd itself
# comes from scripts/containerd-matrix.sh.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${IMGBRIDGE_CACHE:-/var/cache/imgbridge-test}"
peers_cache="$cache_root/peers"
all_names=(buildkit nerdctl crictl spegel kubelet etcd crane conformance oras helm ko)

log() { echo "peers: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shellcheck source=scripts/lib/gobuild.sh
. "$repo_root/scripts/lib/gobuild.sh"
# gobuild.sh lists the peers it knew of when written; spegel, kubelet, crane,
# conformance, oras, helm and ko are more (so `versions` prints their pins
# too).
for _p in spegel kubelet etcd crane conformance oras helm ko; do
    [[ " ${gobuild_peer_names[*]} " == *" $_p "* ]] || gobuild_peer_names+=("$_p")
done

# Sets $module, $binaries and $units (see scripts/lib/gobuild.sh) for peer
# $1 at version $2, with the flags of upstream's release builds:
#   helm      Makefile build: CGO_ENABLED=0, -trimpath, ldflags "-w -s -X
#             internal/version.version=<tag> -X internal/version.metadata="
#             (empty for a tag); `helm version` prints the tag.
#   buildkit  Dockerfile stages buildctl/buildkitd: CGO_ENABLED=0, ldflags
#             -X version.{Version,Revision,Package}; buildkitd also with
#             -extldflags '-static' and tags "osusergo netgo static_build
#             seccomp"; no -s -w.
#   nerdctl   Makefile GO_BUILD: CGO_ENABLED=0, ldflags "-s -w -X
#             pkg/version.Version=... -X pkg/version.Revision=...".
#   crictl    hack/release.sh under the Makefile's GOFLAGS=-trimpath:
#             CGO_ENABLED=0, -X pkg/version.Version=<tag>.
#   spegel    .goreleaser.yaml: CGO_ENABLED=0, ldflags "-s -w", flags
#             -trimpath -a; -a is left out here: it only forces every package
#             (the standard library too) to be recompiled, the binary is the
#             same, and that would cost minutes of the shared cores. It sets
#             no version by ldflags: `spegel version` prints one only from VCS
#             build info, which a build from the module proxy has not (it
#             prints "spegel version  "), so check_peer reads the spegel
#             module's version from the binary's build info (`go version -m`).
#   kubelet   hack/lib/golang.sh (kube::golang::build_binaries) for a
#             non-debug build: CGO_ENABLED=0 (kubelet is a static binary),
#             tags "selinux notest grpcnotrace", ldflags "-s -w" plus the
#             version ldflags (gitVersion, gitMajor, gitMinor of
#             component-base/version, which `kubelet --version` prints, and
#             of client-go/pkg/version), -trimpath. About 1,800 packages:
#             ~15 min cold on two busy cores, seconds warm.
#             kube-apiserver, kube-controller-manager, kube-scheduler and
#             kubectl are built by the same invocation (same flags), so most
#             of their packages are kubelet's, compiled once.
#   etcd      server/ of etcd's repository is the etcd main package; its
#             scripts/build.sh: CGO_ENABLED=0, -trimpath, ldflags "-X
#             api/v3/version.GitSHA=<sha>" (unset here: the module proxy
#             carries no commit id). `etcd --version` prints the version.
#   crane     .goreleaser.yaml of go-containerregistry: CGO_ENABLED=0,
#             ldflags "-s -w -X cmd/crane/cmd.Version=<tag>", -trimpath.
#   conformance  the OCI distribution-spec conformance suite (a main package;
#             its Dockerfile: CGO_ENABLED=0 go build). It has no version
#             flag: check_peer reads the module's version from the build
#             info, as for spegel.
#   oras      Makefile build-linux-amd64 for a tag: CGO_ENABLED=0, ldflags
#             "-w -X internal/version.BuildMetadata=" (GitCommit stays unset:
#             the module proxy carries no commit id); `oras version` prints
#             the version.
#   ko        .goreleaser.yml (builds id binary, main ./main.go, the module
#             root): CGO_ENABLED=0, -trimpath, ldflags "-s -w -X
#             pkg/commands.Version={{.Version}}", and goreleaser's .Version is
#             the tag without its "v": `ko version` prints 0.19.1 for v0.19.1,
#             as the released binaries do.
# Revision stays unset: the module proxy carries no commit id (buildkit
# prints an empty revision, nerdctl "<unknown>").
peer_spec() { # name version
    local ver="$2" ld
    case "$1" in
        helm)
            module=helm.sh/helm/v4
            binaries=(helm)
            units=("0||-w -s -X $module/internal/version.version=$ver -X $module/internal/version.metadata=|-trimpath|$module/cmd/helm")
            ;;
        buildkit)
            module=github.com/moby/buildkit
            binaries=(buildkitd buildctl)
            ld="-X $module/version.Version=$ver -X $module/version.Package=$module"
            units=(
                "0||$ld||$module/cmd/buildctl"
                "0|osusergo netgo static_build seccomp|$ld -extldflags '-static'||$module/cmd/buildkitd"
            )
            ;;
        nerdctl)
            module=github.com/containerd/nerdctl/v2
            binaries=(nerdctl)
            units=("0||-s -w -X $module/pkg/version.Version=$ver||$module/cmd/nerdctl")
            ;;
        crictl)
            module=sigs.k8s.io/cri-tools
            binaries=(crictl)
            units=("0||-X $module/pkg/version.Version=$ver|-trimpath|$module/cmd/crictl")
            ;;
        spegel)
            module=github.com/spegel-org/spegel
            binaries=(spegel)
            units=("0||-s -w|-trimpath|$module")
            ;;
        etcd)
            module=go.etcd.io/etcd/server/v3
            binaries=(etcd)
            units=("0|||-trimpath|$module=etcd")
            ;;
        crane)
            module=github.com/google/go-containerregistry
            binaries=(crane)
            units=("0||-s -w -X $module/cmd/crane/cmd.Version=$ver|-trimpath|$module/cmd/crane")
            ;;
        ko)
            module=github.com/google/ko
            binaries=(ko)
            units=("0||-s -w -X $module/pkg/commands.Version=${ver#v}|-trimpath|$module")
            ;;
        oras)
            module=oras.land/oras
            binaries=(oras)
            units=("0||-w -X $module/internal/version.BuildMetadata=||$module/cmd/oras")
            ;;
        grpcbench)
            # scripts/bench.sh's unary client on grpc-go (our own main in
            # tests/peers/grpcbench): the version is grpc-go's.
            module=google.golang.org/grpc
            binaries=(grpcbench)
            units=("0|||-trimpath|imgbridge.test/peers/grpcbench")
            ;;
        conformance)
            module=github.com/opencontainers/distribution-spec/conformance
            binaries=(conformance)
            units=("0||||$module")
            ;;
        kubelet)
            module=k8s.io/kubernetes
            binaries=(kubelet kube-apiserver kube-controller-manager kube-scheduler kubectl)
            ld="-s -w"
            local mm="${ver#v}" pkg
            for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                ld+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=${mm%%.*}"
                mm="${ver#v}"
                mm="${mm#*.}"
                ld+=" -X $pkg.gitMinor=${mm%%.*}"
                mm="${ver#v}"
            done
            units=("0|selinux notest grpcnotrace|$ld|-trimpath|${binaries[*]/#/$module/cmd/}")
            ;;
        *) die "unknown peer '$1' (known: ${all_names[*]})" ;;
    esac
}

# Each binary must run and report the pinned version in --version (nerdctl
# prints it without the leading "v").
check_peer() { # bindir; uses $name $ver $binaries $module
    local b out
    for b in "${binaries[@]}"; do
        [[ -x "$1/$b" ]] || die "peer $name: $1/$b missing"
        if [[ "$name" == helm ]]; then # no --version flag
            out="$("$1/$b" version --template '{{.Version}}' 2>&1)" || die "peer $name: $1/$b version failed: $out"
            [[ "$out" == "$ver" ]] || die "peer $name: $1/$b version prints '$out', expected $ver"
            continue
        fi
        if [[ "$name" == spegel || "$name" == conformance || "$name" == grpcbench ]]; then
            [[ "$name" == conformance || "$name" == grpcbench ]] ||
                "$1/$b" version >/dev/null 2>&1 || die "peer $name: $1/$b version failed"
            out="$("$(gobuild_find_go)" version -m "$1/$b" | awk -v m="$module" '($1 == "mod" || $1 == "dep") && $2 == m { print $3 }')"
            [[ "$out" == "$ver" ]] || die "peer $name: $1/$b links $module '$out', expected $ver"
            continue
        fi
        if [[ "$name" == oras ]]; then
            out="$("$1/$b" version 2>&1)" || die "peer $name: $1/$b version failed: $out"
            [[ "$out" == *"Version:"*" ${ver#v}"* ]] || die "peer $name: $1/$b version prints '$out', expected ${ver#v}"
            continue
        fi
        if [[ "$name" == crane ]]; then
            out="$("$1/$b" version 2>&1)" || die "peer $name: $1/$b version failed: $out"
            [[ "$out" == "$ver" ]] || die "peer $name: $1/$b version prints '$out', expected $ver"
            continue
        fi
        if [[ "$name" == ko ]]; then # the tag without its "v", as released
            out="$("$1/$b" version 2>&1)" || die "peer $name: $1/$b version failed: $out"
            [[ "$out" == "${ver#v}" ]] || die "peer $name: $1/$b version prints '$out', expected ${ver#v}"
            continue
        fi
        if [[ "$name" == etcd ]]; then # "etcd Version: 3.7.3" on its own line
            out="$("$1/$b" --version 2>&1)" || die "peer $name: $1/$b --version failed: $out"
            grep -qxF "etcd Version: ${ver#v}" <<<"$out" || die "peer $name: $1/$b --version prints '$out', expected ${ver#v}"
            continue
        fi
        if [[ "$b" == kubectl ]]; then # "Client Version: v1.37.2" (no --version flag)
            out="$("$1/$b" version --client 2>&1)" || die "peer $name: $1/$b version --client failed: $out"
            [[ "$out" == *"Client Version: $ver"* ]] || die "peer $name: $1/$b version --client prints '$out', expected $ver"
            continue
        fi
        out="$("$1/$b" --version 2>&1)" || die "peer $name: $1/$b --version failed: $out"
        [[ " $out " == *" $ver "* || " $out " == *" ${ver#v} "* ]] ||
            die "peer $name: $1/$b --version prints '$out', expected $ver"
    done
}

fetch_peer() { # name; run in a subshell (see below)
    trap gobuild_cleanup EXIT
    local name="$1" go ver module
    local -a binaries units
    go="$(gobuild_find_go)" || die "peer $name: go not found (needed to build it)"
    # Validates the name before anything else.
    peer_spec "$name" ""
    ver="$(gobuild_pin "$name" "$module")"
    [[ -n "$ver" ]] || die "peer $name: $module not pinned in tests/peers/$name/go.mod"
    peer_spec "$name" "$ver"
    gobuild_fetch "$name" "$go" "$peers_cache/$name-$ver" "${binaries[0]}" check_peer "${units[@]}"
    check_peer "$gobuild_bindir"
    echo "$name $ver $gobuild_bindir"
}

verify_peer() { # name; run in a subshell
    local name="$1" go module
    local -a binaries units
    go="$(gobuild_find_go)" || die "go not found"
    peer_spec "$name" ""
    peer_spec "$name" "$(gobuild_pin "$name" "$module")"
    gobuild_verify "$name" "$go" "${units[@]}"
}

cmd="${1:-}"
case "$cmd" in
    fetch | verify)
        shift
        names=("$@")
        ((${#names[@]})) || names=("${all_names[@]}")
        gobuild_each "$cmd failed for peer(s)" "${cmd}_peer" "${names[@]}"
        ;;
    versions)
        gobuild_all_pins
        ;;
    *)
        echo "usage: $0 fetch [NAME...] | versions | verify [NAME...]   (names: ${all_names[*]} helm)" >&2
        exit 2
        ;;
esac
