# shellcheck shell=bash
# The Debian mirror this machine's apt already uses, so that no host name is
# ever written into the repo. Sourced by scripts/containerd-matrix.sh and
# scripts/lib/nspawn.sh (scripts/test-systemd.sh, scripts/test-openrc.sh):
#
#   debian_mirror [CODENAME]  prints the mirror URI for CODENAME (default: this
#                             machine's own release, VERSION_CODENAME in
#                             /etc/os-release, else bookworm); exits 1 if
#                             none is found
#
# In this order: $IMGBRIDGE_DEBIAN_MIRROR when set; the first URI of the first
# deb822 stanza (/etc/apt/sources.list.d/debian.sources first, then the other
# *.sources) with Types "deb" whose Suites name CODENAME itself (so the main
# archive, not CODENAME-security or CODENAME-updates); else the first one-line
# `deb [options] URI CODENAME …` in /etc/apt/sources.list or
# /etc/apt/sources.list.d/*.list.

debian_mirror() {
    if [[ -n "${IMGBRIDGE_DEBIAN_MIRROR:-}" ]]; then
        echo "$IMGBRIDGE_DEBIAN_MIRROR"
        return 0
    fi
    local cn="${1:-}" f uri
    if [[ -z "$cn" ]]; then
        # shellcheck disable=SC1091
        cn="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
        cn="${cn:-bookworm}"
    fi
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        # deb822: one stanza a paragraph.
        uri="$(awk -v cn="$cn" 'BEGIN { RS = ""; FS = "\n" }
            {
                types = ""; suites = ""; uris = ""
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^Types:/)  types = " " substr($i, 7) " "
                    if ($i ~ /^Suites:/) suites = " " substr($i, 8) " "
                    if ($i ~ /^URIs:/)   uris = substr($i, 6)
                }
                gsub(/[ \t]+/, " ", types); gsub(/[ \t]+/, " ", suites)
                if (types ~ / deb / && suites ~ (" " cn " ")) { split(uris, u, " "); print u[1]; exit }
            }' "$f")"
        [[ -n "$uri" ]] && { echo "$uri"; return 0; }
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        # One-line format: deb [options] URI suite components...
        uri="$(awk -v cn="$cn" '$1 == "deb" {
                i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == cn) { print $i; exit } }' "$f")"
        [[ -n "$uri" ]] && { echo "$uri"; return 0; }
    done
    return 1
}
