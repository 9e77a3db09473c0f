# shellcheck shell=bash
# Sourced (not run) by scripts/containerd-matrix.sh and scripts/peers.sh.
#
# Builds the pinned Go peers (containerd, buildkit, nerdctl, crictl) from the
# Go module proxy. Each peer has its own small Go module, tests/peers/<name>/
# (see tests/peers/README.md), so each binary gets upstream's own dependency
# versions. Binaries go into a cache dir keyed by the peer's version and a hash
# of everything that changes them (the module dir's files, the toolchain, the
# flags); a warm fetch needs no network.
#
# A build is described by "units", one string per `go build` invocation:
#     "<CGO_ENABLED>|<tags>|<ldflags>|<other go build flags>|<packages>"
# (tags, flags and packages space-separated; ldflags passed as one -ldflags).
# A unit of one package may name its binary, "<package>=<binary>", where go
# would name it otherwise (a module root with a /vN suffix: etcd's server).
#
# The sourcing script sets repo_root and defines log and die (die exits).

gobuild_peers_dir="${repo_root:?set repo_root before sourcing gobuild.sh}/tests/peers"
# Every peer module, in the order `versions` prints them.
gobuild_peer_names=(containerd buildkit nerdctl crictl)

# --------------------------------------------------------------- go.mod pins

# "<module> <version>" for each module of tests/peers/NAME/go.mod that
# provides a tool directive (the peer itself). Parses go.mod, so it needs
# neither network nor a module cache.
gobuild_pins() { # name
    local gomod="$gobuild_peers_dir/$1/go.mod"
    [[ -f "$gomod" ]] || die "peer $1: $gomod missing"
    awk '
        $1 ~ /^\/\// || NF == 0 { next }
        /^\)/                   { blk = ""; next }
        /^(tool|require) \(/    { blk = $1; next }
        $1 == "tool"            { tools[++nt] = $2; next }
        $1 == "require"         { req[$2] = $3; next }
        blk == "tool"           { tools[++nt] = $1 }
        blk == "require"        { req[$1] = $2 }
        END {
            for (i = 1; i <= nt; i++) {
                best = ""
                for (m in req)
                    if ((tools[i] == m || index(tools[i], m "/") == 1) &&
                        length(m) > length(best)) best = m
                if (best != "" && !(best in seen)) {
                    seen[best] = 1; print best, req[best]
                }
            }
        }' "$gomod"
}

# A peer whose main is ours (grpcbench) has no tool directive: its pin is
# the require line of the module it is built on.
gobuild_pin() { # name module → pinned version (empty if not pinned)
    local v
    v="$(gobuild_pins "$1" | awk -v m="$2" '$1 == m { print $2 }')"
    [[ -n "$v" ]] || v="$(awk -v m="$2" '$1 == m && NF >= 2 { print $2; exit }
        $1 == "require" && $2 == m { print $3; exit }' "$gobuild_peers_dir/$1/go.mod")"
    echo "$v"
}

gobuild_all_pins() { # every peer's pins, one "<module> <version>" a line
    local name
    for name in "${gobuild_peer_names[@]}"; do
        gobuild_pins "$name"
    done
}

# ------------------------------------------------------------------ go tool

gobuild_find_go() {
    if command -v go >/dev/null 2>&1; then
        command -v go
    elif [[ -x /usr/local/go/bin/go ]]; then
        echo /usr/local/go/bin/go
    else
        return 1
    fi
}

# Runs go in the peer's module with a fixed environment: GOWORK=off (no
# go.work above the repo changes the build list) and GOFLAGS=-mod=readonly
# (go.mod/go.sum are never rewritten; the caller's GOFLAGS do not leak in).
gobuild_go() { # name go args...
    (cd "$gobuild_peers_dir/$1" && GOWORK=off GOFLAGS=-mod=readonly "$2" "${@:3}")
}

# Cache key: the module dir's files (go.mod, go.sum, any vendored replace
# target), the toolchain go selects for it, the target, and the units.
gobuild_key() { # name go unit...
    local name="$1" go="$2"
    shift 2
    {
        (cd "$gobuild_peers_dir/$name" &&
            find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
        gobuild_go "$name" "$go" env GOVERSION GOOS GOARCH GOAMD64
        printf '%s\n' "$@"
    } | sha256sum | cut -c1-12
}

gobuild_build() { # name go outdir unit...
    local name="$1" go="$2" out="$3" unit cgo tags ldflags flags pkgs dest
    local -a flag_a pkg_a tag_a
    shift 3
    for unit in "$@"; do
        IFS='|' read -r cgo tags ldflags flags pkgs <<<"$unit"
        read -ra flag_a <<<"$flags"
        read -ra pkg_a <<<"$pkgs"
        dest="$out/"
        if [[ ${#pkg_a[@]} == 1 && "${pkg_a[0]}" == *=* ]]; then
            dest="$out/${pkg_a[0]#*=}"
            pkg_a=("${pkg_a[0]%%=*}")
        fi
        tag_a=()
        [[ -z "$tags" ]] || tag_a=(-tags "$tags")
        log "peer $name: CGO_ENABLED=$cgo go build${tags:+ -tags \"$tags\"} -ldflags \"$ldflags\"${flags:+ $flags} $pkgs"
        CGO_ENABLED="$cgo" gobuild_go "$name" "$go" build "${tag_a[@]}" \
            -ldflags "$ldflags" "${flag_a[@]}" -o "$dest" "${pkg_a[@]}" >&2 ||
            die "peer $name: go build of ${pkg_a[*]} failed"
    done
}

# Runs `FN ITEM` for each item, each in a subshell with set -e, and not called
# from `||`/`if` (there bash would ignore set -e inside it): one failing item
# does not stop the rest. Then dies naming the items that failed.
gobuild_each() { # message fn item...
    local msg="$1" fn="$2" item rc
    local -a failed=()
    shift 2
    for item in "$@"; do
        set +e
        (set -e; "$fn" "$item")
        rc=$?
        set -e
        ((rc == 0)) || failed+=("$item")
    done
    ((${#failed[@]} == 0)) || die "$msg: ${failed[*]}"
}

# ------------------------------------------------------------ cache helpers

# Temp dirs live inside the cache (same filesystem) so a finished dir can be
# renamed into place atomically: a dir there without a ".tmp." prefix is
# complete.
gobuild_tmp_dirs=()
gobuild_cleanup() {
    if ((${#gobuild_tmp_dirs[@]})); then rm -rf "${gobuild_tmp_dirs[@]}"; fi
}
gobuild_new_tmp() { # parent → path of a fresh temp dir in parent (set as $tmp)
    mkdir -p "$1"
    tmp="$(mktemp -d "$1/.tmp.XXXXXX")"
    gobuild_tmp_dirs+=("$tmp")
}
gobuild_install() { # tmpdir finaldir marker: rename, or keep a dir a concurrent run made
    if ! mv -T "$1" "$2" 2>/dev/null; then
        [[ -x "$2/bin/$3" ]] || die "cannot move $1 to $2"
        rm -rf "$1"
    fi
}

# Builds the units into <prefix>-<key>/bin unless that exists, then sets
# $gobuild_bindir. MARKER is a binary that a complete bin dir has; CHECK is
# a command run as `CHECK <bindir>` on a fresh build before it is installed
# (it must die on a bad build). A lock serialises concurrent fetches of the
# same build, so the second waits and reuses the first's result.
gobuild_fetch() { # name go prefix marker check unit...
    local name="$1" go="$2" prefix="$3" marker="$4" check="$5" key dir lockfd
    shift 5
    key="$(gobuild_key "$name" "$go" "$@")"
    dir="$prefix-$key"
    if [[ ! -x "$dir/bin/$marker" ]]; then
        mkdir -p "$(dirname "$dir")"
        exec {lockfd}>"$dir.lock"
        flock "$lockfd"
        if [[ ! -x "$dir/bin/$marker" ]]; then
            log "peer $name: building $(basename "$prefix") with $(gobuild_go "$name" "$go" env GOVERSION) into $dir (first time: downloads modules, takes minutes)"
            gobuild_new_tmp "$(dirname "$dir")"
            gobuild_build "$name" "$go" "$tmp/bin" "$@"
            "$check" "$tmp/bin"
            chmod 755 "$tmp"
            gobuild_install "$tmp" "$dir" "$marker"
        fi
        exec {lockfd}>&-
    fi
    # shellcheck disable=SC2034  # the result, read by the caller
    gobuild_bindir="$dir/bin"
}

# ------------------------------------------------------------------- verify

# "<path> <version>" of every require of a go.mod file; with a second
# argument "directives", its exclude and replace lines instead
# ("exclude <path> <version>", "replace <path>[ <version>] => ...").
gobuild_gomod_list() { # gomod [directives]
    awk -v want="${2:-require}" '
        { sub(/\/\/.*/, "") }
        NF == 0                          { next }
        /^\)/                            { blk = ""; next }
        /^(require|exclude|replace) \($/ { blk = $1; next }
        /^(require|exclude|replace) /    { kw = $1; sub(/^[a-z]+ /, ""); emit(kw); next }
        blk != ""                        { emit(blk) }
        function emit(kw) {
            if (want == "require" && kw == "require") print $1, $2
            else if (want != "require" && kw != "require") {
                gsub(/[ \t]+/, " "); sub(/^ /, ""); sub(/ $/, ""); print kw, $0
            }
        }' "$1"
}

# Checks that the peer's binaries are built from upstream's own dependency
# versions: every module that provides a package linked into a unit's
# binaries is at the version the peer's own go.mod requires, every
# requirement of that go.mod is at the same version in `go list -m all`
# here, and every exclude/replace of it is mirrored here. A module upstream
# replaces with a directory of its own repository (kubernetes' ./staging)
# has no version there (v0.0.0): it must be replaced here by a published
# module version, and is left out of the version comparisons. Needs network (or
# a module cache that has the upstream go.mod files). Prints a summary;
# returns non-zero on any difference.
gobuild_verify() { # name go unit...
    local name="$1" go="$2" unit cgo tags pkgs gomod bad=0
    local -a pkg_a
    local up linked all directives mine pins mod ver kw rest localrep diff
    shift 2
    up="$(mktemp)" linked="$(mktemp)" all="$(mktemp)" \
        directives="$(mktemp)" mine="$(mktemp)" pins="$(mktemp)" localrep="$(mktemp)"
    gobuild_pins "$name" >"$pins"
    : >"$up"
    : >"$directives"
    while read -r mod ver; do
        gomod="$(gobuild_go "$name" "$go" mod download -json "$mod@$ver" |
            awk -F'"' '$2 == "GoMod" { print $4 }')"
        [[ -f "$gomod" ]] || { log "peer $name: no go.mod for $mod@$ver"; bad=1; continue; }
        gobuild_gomod_list "$gomod" >>"$up"
        gobuild_gomod_list "$gomod" directives >>"$directives"
    done <"$pins"
    sort -u -o "$up" "$up"
    gobuild_gomod_list "$gobuild_peers_dir/$name/go.mod" directives >"$mine"
    # Upstream's replaces by a directory: "replace X => ./dir" (no version).
    awk '$1 == "replace" && $3 == "=>" && $4 ~ /^(\.|\/)/ { print $2 }' "$directives" | sort -u >"$localrep"
    if [[ -s "$localrep" ]]; then
        # In the build list, each must be replaced by a version (one not in
        # the build list is not built: its replace line does nothing).
        diff="$(gobuild_go "$name" "$go" list -m -f '{{.Path}} {{with .Replace}}{{.Version}}{{end}}' all |
            awk 'FILENAME == ARGV[1] { want[$1] = 1; next } ($1 in want) && NF < 2 { print "  " $1 }' "$localrep" -)"
        if [[ -n "$diff" ]]; then
            log "peer $name: upstream replaces these by a directory; here they must be replaced by a module version:"$'\n'"$diff"
            bad=1
        fi
    fi

    # Directives: each of upstream's must be here (replace: same left side).
    while read -r kw rest; do
        if [[ "$kw" == exclude ]]; then
            grep -qxF "exclude $rest" "$mine" ||
                { log "peer $name: upstream has 'exclude $rest', this module does not"; bad=1; }
        else
            grep -qF "replace ${rest%%=>*}=>" "$mine" ||
                { log "peer $name: upstream has 'replace $rest', this module does not"; bad=1; }
        fi
    done <"$directives"

    # Modules linked into the binaries, per unit's CGO and tags.
    : >"$linked"
    for unit in "$@"; do
        IFS='|' read -r cgo tags _ _ pkgs <<<"$unit"
        read -ra pkg_a <<<"${pkgs%%=*}"
        CGO_ENABLED="$cgo" gobuild_go "$name" "$go" list -deps -tags "$tags" \
            -f '{{with .Module}}{{if not .Main}}{{.Path}} {{.Version}}{{end}}{{end}}' \
            "${pkg_a[@]}" >>"$linked" || { log "peer $name: go list -deps failed"; bad=1; }
    done
    sort -u -o "$linked" "$linked"
    gobuild_go "$name" "$go" list -m -f '{{if not .Main}}{{.Path}} {{.Version}}{{end}}' all |
        sort -u >"$all" || { log "peer $name: go list -m all failed"; bad=1; }

    # linked: each at upstream's required version (the peer itself at its pin)
    diff="$(awk 'FILENAME == ARGV[1] { skip[$1] = 1; next }
                 FILENAME == ARGV[2] { v[$1] = $2; next }
                 $1 in skip    { next }
                 !($1 in v)    { print "  " $1 " " $2 " (not required by upstream go.mod)"; next }
                 v[$1] != $2   { print "  " $1 " " $2 " (upstream requires " v[$1] ")" }' \
        "$localrep" <(cat "$up" "$pins") "$linked")"
    if [[ -n "$diff" ]]; then
        log "peer $name: linked modules not at upstream's versions:"$'\n'"$diff"
        bad=1
    fi
    # go list -m all: each upstream requirement present at the same version
    diff="$(awk 'FILENAME == ARGV[1] { skip[$1] = 1; next }
                 FILENAME == ARGV[2] { v[$1] = $2; next }
                 $1 in skip  { next }
                 !($1 in v)  { print "  " $1 " " $2 " (missing from go list -m all)"; next }
                 v[$1] != $2 { print "  " $1 " upstream " $2 ", here " v[$1] }' "$localrep" "$all" "$up")"
    if [[ -n "$diff" ]]; then
        log "peer $name: go list -m all differs from upstream's go.mod:"$'\n'"$diff"
        bad=1
    fi
    printf '%s %s: %s linked modules, %s upstream requirements (go list -m all: %s modules), %s upstream exclude/replace (%s of a directory, replaced by a version here)\n' \
        "$name" "$( ((bad)) && echo DIFFERS || echo OK)" "$(wc -l <"$linked")" \
        "$(wc -l <"$up")" "$(wc -l <"$all")" "$(wc -l <"$directives")" "$(wc -l <"$localrep")"
    rm -f "$up" "$linked" "$all" "$directives" "$mine" "$pins" "$localrep"
    return "$bad"
}
