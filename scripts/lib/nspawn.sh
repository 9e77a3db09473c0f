# shellcheck shell=bash
# A real init as PID 1 for tests, on machines whose own PID 1 is not
# systemd: a cached Debian bookworm root booted with systemd-nspawn
# (docs/systemd-tests.md). systemd by default; another init (OpenRC on
# sysvinit, scripts/test-openrc.sh) with its own root and the NSPAWN_READY,
# NSPAWN_DIAG and NSPAWN_POWEROFF settings below.
# Sourced by bash scripts (scripts/test-systemd.sh, scripts/test-openrc.sh):
#
#   nspawn_root_cached        the cached systemd root, built once (debootstrap)
#                             and again when NSPAWN_PACKAGES changes; prints its
#                             path
#   nspawn_boot NAME          nspawn_prepare NAME, then nspawn_start
#   nspawn_prepare NAME [ROOT]
#                             a per-run root: an overlay on (or a copy of) the
#                             cached root ROOT (default: nspawn_root_cached's)
#                             in a per-run dir, not booted yet (files can be
#                             put into NSPAWN_ROOT first). Sets NSPAWN_DIR (its
#                             console log is $NSPAWN_DIR/nspawn.log) and
#                             NSPAWN_ROOT (the root on the host)
#   nspawn_start              boot NSPAWN_ROOT (again, after the container
#                             exited); returns once NSPAWN_READY succeeds
#                             inside. Sets NSPAWN_PID (the container's PID 1,
#                             exported), NSPAWN_NSPAWN_PID
#   nspawn_run CMD...         run CMD... (joined, as bash -c) inside, as root,
#                             with a clean environment; stdin/out/err are the
#                             caller's
#   nspawn_poll SECONDS CMD   nspawn_run CMD (output discarded) every 100 ms
#                             until it succeeds; 1 after SECONDS
#   nspawn_copy_in SRC DST    copy a host file into the container (any path,
#                             /run included)
#   nspawn_wait_exit SECONDS  wait for the container to exit (a shutdown begun
#                             inside); sets NSPAWN_LAST_EXIT (nspawn's exit
#                             status) and clears NSPAWN_PID; 1 if it still
#                             runs after SECONDS
#   nspawn_reboot             systemctl reboot inside, then the same root booted
#                             again (nspawn exits on a reboot: it does not
#                             restart the container itself); NSPAWN_PID changes
#   nspawn_stop               NSPAWN_POWEROFF, wait, kill if need be; removes
#                             the per-run dir, its mounts and cgroups.
#                             Idempotent: call it from the caller's
#                             EXIT/INT/TERM trap.
#   nspawn_tools              installs debootstrap and systemd-nspawn if missing
#
# One container at a time. Needs root. Environment:
#   IMGBRIDGE_CACHE         cache root (default /var/cache/imgbridge-test); the
#                           root lives in $IMGBRIDGE_CACHE/debian-root/bookworm
#   IMGBRIDGE_DEBIAN_MIRROR the Debian mirror (default: the machine's own, from
#                           /etc/apt, scripts/lib/debian-mirror.sh; no host
#                           name is ever written here)
#   NSPAWN_BOOT_TIMEOUT     seconds for a boot to reach NSPAWN_READY (default
#                           120)
#   NSPAWN_STOP_TIMEOUT     seconds for a poweroff/reboot (default 60)
#   NSPAWN_KEEP=1           keep the per-run dir after nspawn_stop (debugging)
#   NSPAWN_COPY=1           copy the cached root instead of an overlay
# Settings for another init (set after sourcing; defaults for systemd):
#   NSPAWN_READY            bash -c command inside that succeeds once the
#                           container has booted (default: systemctl
#                           is-system-running says running or degraded)
#   NSPAWN_DIAG             bash -c command inside whose output is shown when
#                           a boot times out (default: systemctl --failed)
#   NSPAWN_POWEROFF         bash -c command inside that begins a poweroff
#                           (default: systemctl poweroff --no-block)
#   NSPAWN_CGROUP_PREFIX    the container's cgroups are PREFIX + NAME at the
#                           root of each hierarchy, its per-run dir
#                           $TMPDIR/PREFIX + NAME.XXXXXX (default
#                           imgbridge-nspawn-; may be empty when NAME is
#                           distinctive enough); NAME is the machine name
#   NSPAWN_RUN_ENV          array: more VAR=VALUE for nspawn_run's environment

NSPAWN_RELEASE=bookworm
# Everything the tests use inside: systemd as PID 1, containerd/ctr/runc as
# the runtime, curl/socat/iproute2/procps for probes. A change here rebuilds
# the cached root (the stamp holds this list and NSPAWN_ROOT_RECIPE).
NSPAWN_PACKAGES="systemd,systemd-sysv,dbus,containerd,runc,iproute2,curl,ca-certificates,socat,procps"
# Bumped when the post-processing below changes (forces a rebuild).
NSPAWN_ROOT_RECIPE=2
NSPAWN_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# shellcheck disable=SC2016 # (expanded inside)
[[ -n "${NSPAWN_READY:-}" ]] ||
    NSPAWN_READY='state="$(systemctl is-system-running 2>/dev/null)"; [[ $state == running || $state == degraded ]]'
[[ -n "${NSPAWN_DIAG:-}" ]] || NSPAWN_DIAG='systemctl --failed --no-pager'
[[ -n "${NSPAWN_POWEROFF:-}" ]] || NSPAWN_POWEROFF='systemctl poweroff --no-block'
[[ -v NSPAWN_CGROUP_PREFIX ]] || NSPAWN_CGROUP_PREFIX=imgbridge-nspawn-
[[ -v NSPAWN_RUN_ENV ]] || NSPAWN_RUN_ENV=()

# debian_mirror CODENAME
# shellcheck source=scripts/lib/debian-mirror.sh
source "$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh"

NSPAWN_PID=""
NSPAWN_NSPAWN_PID=""
NSPAWN_DIR=""
NSPAWN_ROOT=""
NSPAWN_NAME=""
NSPAWN_CGROUPS=()
NSPAWN_OVERLAY=0

_nspawn_log() { echo "nspawn: $*" >&2; }

_nspawn_cache_dir() { echo "${IMGBRIDGE_CACHE:-/var/cache/imgbridge-test}/debian-root"; }

_nspawn_stamp() { printf 'release=%s\npackages=%s\nrecipe=%s\n' "$NSPAWN_RELEASE" "$NSPAWN_PACKAGES" "$NSPAWN_ROOT_RECIPE"; }

nspawn_tools() {
    local missing=()
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    command -v systemd-nspawn >/dev/null 2>&1 || missing+=(systemd-container)
    ((${#missing[@]} == 0)) && return 0
    _nspawn_log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null ||
        { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
}

# Prints the cached root's path; builds it if missing or built from another
# package list. Concurrent callers (scripts/test.sh's background lane and the
# stage itself) serialise on a lock; a root is renamed into place only once
# complete, so a half-built one is never used.
nspawn_root_cached() {
    local dir root stamp mirror tmp old="" rc=0
    dir="$(_nspawn_cache_dir)"
    root="$dir/$NSPAWN_RELEASE"
    stamp="$(_nspawn_stamp)"
    mkdir -p "$dir"
    if [[ -f "$root/.imgbridge-root" && "$(cat "$root/.imgbridge-root")" == "$stamp" ]]; then
        echo "$root"
        return 0
    fi
    nspawn_tools || return 1
    (
        flock 9
        # Built by another caller while this one waited for the lock?
        if [[ -f "$root/.imgbridge-root" && "$(cat "$root/.imgbridge-root")" == "$stamp" ]]; then exit 0; fi
        mirror="$(debian_mirror "$NSPAWN_RELEASE")" || { _nspawn_log "no Debian mirror in /etc/apt (set IMGBRIDGE_DEBIAN_MIRROR)"; exit 1; }
        # Leftovers of an interrupted build (under the lock: none is running),
        # and replaced roots no container uses any more.
        rm -rf "$dir/.build.$NSPAWN_RELEASE".*
        for old in "$dir/.old.$NSPAWN_RELEASE".*; do
            [[ -e "$old" ]] || continue
            # (A mount shows the lower dir's path at mount time: any container
            # on "$root" may be on this one.)
            grep -qF "lowerdir=$root" /proc/self/mountinfo || rm -rf --one-file-system "$old"
        done
        old=""
        tmp="$(mktemp -d "$dir/.build.$NSPAWN_RELEASE.XXXXXX")"
        # The root's own mode (mktemp's 0700 would shut every non-root user
        # inside, dbus's included, out of /).
        chmod 0755 "$tmp"
        _nspawn_log "building the $NSPAWN_RELEASE root (debootstrap, a few minutes; log: $tmp.log)"
        if ! debootstrap --variant=minbase --include="$NSPAWN_PACKAGES" \
            "$NSPAWN_RELEASE" "$tmp" "$mirror" >"$tmp.log" 2>&1; then
            tail -n 30 "$tmp.log" >&2
            _nspawn_log "debootstrap failed"
            rm -rf "$tmp"
            exit 1
        fi
        echo imgbridge-test >"$tmp/etc/hostname"
        printf '127.0.0.1\tlocalhost\n127.0.1.1\timgbridge-test\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$tmp/etc/hosts"
        # A fresh machine-id per boot (systemd writes a transient one).
        : >"$tmp/etc/machine-id"
        # Nothing to fetch inside (the container has no network): a smaller
        # root is a faster copy.
        rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*_Packages
        _nspawn_stamp >"$tmp/.imgbridge-root"
        if [[ -e "$root" ]]; then
            old="$(mktemp -d "$dir/.old.$NSPAWN_RELEASE.XXXXXX")"
            mv "$root" "$old/"
        fi
        mv "$tmp" "$root"
        rm -f "$tmp.log"
        # A container booted from the old root (an overlay whose lower dir it
        # is) keeps it until a later build finds it unused.
        if [[ -n "$old" ]] && ! grep -qF "lowerdir=$root" /proc/self/mountinfo; then
            rm -rf --one-file-system "$old"
        fi
        _nspawn_log "root ready: $root"
    ) 9>"$dir/.lock" || rc=$?
    ((rc == 0)) || return "$rc"
    echo "$root"
}

# The container's PID 1: the child of the nspawn process that runs in
# another pid namespace.
_nspawn_find_leader() {
    local npid="$1" c
    for c in $(cat "/proc/$npid/task/$npid/children" 2>/dev/null); do
        if [[ "$(readlink "/proc/$c/ns/pid" 2>/dev/null)" != "$(readlink /proc/self/ns/pid)" ]]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

# Whether nspawn still runs (an exited child stays a zombie until reaped).
_nspawn_alive() {
    local st
    st="$(awk '{print $3}' "/proc/$NSPAWN_NSPAWN_PID/stat" 2>/dev/null)" || return 1
    [[ -n "$st" && "$st" != Z ]]
}

# 0 once NSPAWN_READY succeeds inside, 1 before, 2 if nspawn has exited.
_nspawn_booted() {
    _nspawn_alive || return 2
    NSPAWN_PID="$(_nspawn_find_leader "$NSPAWN_NSPAWN_PID")" || return 1
    nsenter -t "$NSPAWN_PID" -a -- env -i PATH="$NSPAWN_PATH" bash -c "$NSPAWN_READY" >/dev/null 2>&1
}

# Starts nspawn on NSPAWN_ROOT in cgroups of its own, in its own session,
# and waits for the init inside to finish booting (NSPAWN_READY).
nspawn_start() {
    local deadline log="$NSPAWN_DIR/nspawn.log" rc h
    local -a env=()
    # A cgroup of its own in every hierarchy systemd tracks processes in:
    # name=systemd (v1) and the v2 one (/sys/fs/cgroup/unified on a hybrid
    # host like these, /sys/fs/cgroup itself on a pure v2 host). nspawn
    # takes the path of its cgroup in the v2 hierarchy when there is one
    # (hybrid) and creates "payload" (the container) and "supervisor"
    # (itself) under that path in both: launched from the root cgroup, they
    # land at the root of both hierarchies, shared by every container and
    # left behind after it. A cgroup v1 host also needs the legacy hierarchy
    # inside (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=0); a pure v2 host must not.
    NSPAWN_CGROUPS=()
    if [[ "$(stat -fc %T /sys/fs/cgroup)" == cgroup2fs ]]; then
        NSPAWN_CGROUPS+=("/sys/fs/cgroup/$NSPAWN_CGROUP_PREFIX$NSPAWN_NAME")
    else
        env+=(SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=0)
        for h in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified; do
            mountpoint -q "$h" && NSPAWN_CGROUPS+=("$h/$NSPAWN_CGROUP_PREFIX$NSPAWN_NAME")
        done
    fi
    for h in "${NSPAWN_CGROUPS[@]}"; do mkdir -p "$h" || return 1; done
    echo "== boot $(date -u +%FT%TZ)" >>"$log"
    # bash -c: moves itself into those cgroups, then execs (setsid does not
    # fork in a background job: not a group leader), so $! is nspawn's pid.
    # Its own session: a Ctrl-C at the terminal reaches the caller's trap,
    # which powers the container off, not nspawn directly.
    # shellcheck disable=SC2016
    env "${env[@]}" bash -c 'for cg; do [[ $cg == -- ]] && break; echo $$ >"$cg/cgroup.procs" || exit 1; done
            while [[ $1 != -- ]]; do shift; done; shift
            exec setsid "$@"' nspawn "${NSPAWN_CGROUPS[@]}" -- \
        systemd-nspawn -D "$NSPAWN_ROOT" --boot --register=no --keep-unit --private-network \
        -M "$NSPAWN_NAME" --console=read-only </dev/null >>"$log" 2>&1 &
    NSPAWN_NSPAWN_PID=$!
    NSPAWN_PID=""
    deadline=$((SECONDS + ${NSPAWN_BOOT_TIMEOUT:-120}))
    while :; do
        _nspawn_booted && break
        rc=$?
        if ((rc == 2)); then
            tail -n 30 "$log" >&2
            _nspawn_log "systemd-nspawn exited during boot (log above)"
            return 1
        fi
        if ((SECONDS >= deadline)); then
            tail -n 30 "$log" >&2
            [[ -z "$NSPAWN_PID" ]] || nsenter -t "$NSPAWN_PID" -a -- env -i PATH="$NSPAWN_PATH" \
                bash -c "$NSPAWN_DIAG" >&2 || true
            _nspawn_log "not booted within ${NSPAWN_BOOT_TIMEOUT:-120} s (NSPAWN_READY: $NSPAWN_READY)"
            return 1
        fi
        sleep 0.1
    done
    export NSPAWN_PID
}

# nspawn_prepare NAME [ROOT]: a per-run copy of the cached root, not booted.
#
# Copy or overlay, measured here (root of 280 MiB, 9,450 files, ext4 without
# reflink, 2 busy cores): cp -a --reflink=auto took 1.0-1.8 s idle and ~3 s
# under a parallel build, and removing the copy afterwards several more; the
# overlay mount takes ~5 ms and the boot (0.5-1 s to "running") is the same
# either way. So the overlay, when it mounts; containerd's overlayfs
# snapshotter inside works on it (an imported image unpacks). NSPAWN_COPY=1
# forces the copy.
nspawn_prepare() {
    local name="${1:?nspawn_prepare NAME [ROOT]}" cached="${2:-}"
    if [[ -n "$NSPAWN_DIR" ]]; then
        _nspawn_log "nspawn_prepare: $NSPAWN_NAME is still booted (one container at a time)"
        return 1
    fi
    [[ "$(id -u)" == 0 ]] || { _nspawn_log "needs root"; return 1; }
    [[ -n "$cached" ]] || cached="$(nspawn_root_cached)" || return 1
    NSPAWN_NAME="$name"
    NSPAWN_DIR="$(mktemp -d "${TMPDIR:-/var/tmp}/$NSPAWN_CGROUP_PREFIX$name.XXXXXX")"
    NSPAWN_ROOT="$NSPAWN_DIR/root"
    mkdir -p "$NSPAWN_ROOT"
    NSPAWN_OVERLAY=0
    if [[ "${NSPAWN_COPY:-0}" != 1 ]]; then
        mkdir -p "$NSPAWN_DIR/upper" "$NSPAWN_DIR/work"
        if mount -t overlay overlay -o "lowerdir=$cached,upperdir=$NSPAWN_DIR/upper,workdir=$NSPAWN_DIR/work" \
            "$NSPAWN_ROOT" 2>/dev/null; then
            NSPAWN_OVERLAY=1
        fi
    fi
    if ((NSPAWN_OVERLAY == 0)); then
        cp -a --reflink=auto "$cached/." "$NSPAWN_ROOT/" || return 1
    fi
}

# nspawn_boot NAME: a per-run copy of the cached root, booted.
nspawn_boot() {
    nspawn_prepare "${1:?nspawn_boot NAME}" && nspawn_start
}

# nspawn_run CMD...: CMD (words joined by spaces, as for bash -c) inside.
nspawn_run() {
    [[ -n "$NSPAWN_PID" ]] || { _nspawn_log "nspawn_run: no container"; return 1; }
    nsenter -t "$NSPAWN_PID" -a -- env -i PATH="$NSPAWN_PATH" HOME=/root LANG=C.UTF-8 "${NSPAWN_RUN_ENV[@]}" bash -c "$*"
}

# nspawn_poll SECONDS CMD: CMD (as for nspawn_run) every 100 ms until it
# succeeds; 1 if it has not after SECONDS.
nspawn_poll() {
    local deadline=$((SECONDS + $1))
    until nspawn_run "$2" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# nspawn_copy_in SRC DST: DST is a path inside the container (a file, or an
# existing directory). Through /proc/PID/root, so /run (a tmpfs of the
# container's) works too.
nspawn_copy_in() {
    [[ -n "$NSPAWN_PID" ]] || { _nspawn_log "nspawn_copy_in: no container"; return 1; }
    cp -- "$1" "/proc/$NSPAWN_PID/root/${2#/}"
}

# Waits up to $1 seconds for nspawn to exit; sets NSPAWN_LAST_EXIT to its
# exit status and clears NSPAWN_PID (the root stays for nspawn_start). Not in
# a subshell: only this shell can reap it.
nspawn_wait_exit() {
    local deadline=$((SECONDS + $1))
    while _nspawn_alive; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
    NSPAWN_LAST_EXIT=0
    wait "$NSPAWN_NSPAWN_PID" 2>/dev/null || NSPAWN_LAST_EXIT=$?
    NSPAWN_PID=""
    NSPAWN_NSPAWN_PID=""
}

# systemd-nspawn --boot exits with status 133 when the container reboots
# (systemd-nspawn@.service restarts it through RestartForceExitStatus=133);
# it does not boot it again itself. So: reboot, wait for that exit, boot the
# same root again.
nspawn_reboot() {
    [[ -n "$NSPAWN_PID" ]] || { _nspawn_log "nspawn_reboot: no container"; return 1; }
    nspawn_run 'systemctl reboot' || true
    nspawn_wait_exit "${NSPAWN_STOP_TIMEOUT:-60}" || {
        _nspawn_log "nspawn did not exit within ${NSPAWN_STOP_TIMEOUT:-60} s of systemctl reboot"
        return 1
    }
    [[ "$NSPAWN_LAST_EXIT" == 133 ]] || _nspawn_log "nspawn exited with $NSPAWN_LAST_EXIT on reboot (expected 133)"
    nspawn_start
}

# Kills what nspawn_run started inside and left running (a client loop):
# processes in the container's pid namespace but outside its cgroup (nsenter
# joins the namespaces, not the cgroup). systemd's shutdown would only
# SIGTERM them and wait 10 s before SIGKILL; one whose SIGINT/SIGTERM a
# shell ignores (a background job) takes all 10.
_nspawn_kill_strays() {
    local ns p f
    [[ -n "$NSPAWN_PID" && ${#NSPAWN_CGROUPS[@]} -gt 0 ]] || return 0
    ns="$(readlink "/proc/$NSPAWN_PID/ns/pid" 2>/dev/null)" || return 0
    for f in /proc/[0-9]*/ns/pid; do
        p="${f#/proc/}"
        p="${p%%/*}"
        [[ "$(readlink "$f" 2>/dev/null)" == "$ns" ]] || continue
        # Its cgroups are all named so, at the root of each hierarchy.
        grep -qE ":/$NSPAWN_CGROUP_PREFIX$NSPAWN_NAME(/|\$)" "/proc/$p/cgroup" 2>/dev/null ||
            kill -KILL "$p" 2>/dev/null || true
    done
}

# Powers the container off (NSPAWN_POWEROFF; killing it after
# NSPAWN_STOP_TIMEOUT seconds, default 60), removes its dir, mounts and
# cgroups. Safe to call twice, and with nothing booted.
nspawn_stop() {
    local t0=$SECONDS
    if [[ -n "$NSPAWN_NSPAWN_PID" ]] && kill -0 "$NSPAWN_NSPAWN_PID" 2>/dev/null; then
        # (Also when it is a zombie: nspawn_wait_exit reaps it.)
        if [[ -n "$NSPAWN_PID" ]] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
            _nspawn_kill_strays
            timeout 10 nsenter -t "$NSPAWN_PID" -a -- env -i PATH="$NSPAWN_PATH" \
                bash -c "$NSPAWN_POWEROFF" >/dev/null 2>&1 || true
        fi
        if ! nspawn_wait_exit "${NSPAWN_STOP_TIMEOUT:-60}"; then
            _nspawn_log "no poweroff within ${NSPAWN_STOP_TIMEOUT:-60} s: killing the container"
            # Killing nspawn alone leaves the container running: PID 1 first
            # (that ends its whole pid namespace), then nspawn.
            [[ -z "$NSPAWN_PID" ]] || kill -KILL "$NSPAWN_PID" 2>/dev/null || true
            kill -KILL "$NSPAWN_NSPAWN_PID" 2>/dev/null || true
            nspawn_wait_exit 10 || _nspawn_log "nspawn (pid $NSPAWN_NSPAWN_PID) survived SIGKILL"
        fi
        ((SECONDS - t0 < 5)) || _nspawn_log "$NSPAWN_NAME: poweroff took $((SECONDS - t0)) s"
    fi
    NSPAWN_PID=""
    NSPAWN_NSPAWN_PID=""
    # Anything still in its cgroups (a process a test left that escaped the
    # pid namespace: should not happen) is killed, then the trees removed,
    # deepest first.
    local cg deadline
    for cg in "${NSPAWN_CGROUPS[@]}"; do
        [[ -d "$cg" ]] || continue
        # shellcheck disable=SC2038 # (pids, not file names)
        find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        deadline=$((SECONDS + 10))
        until find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null; [[ ! -d "$cg" ]]; do
            ((SECONDS < deadline)) || { _nspawn_log "cannot remove cgroup $cg"; break; }
            sleep 0.1
        done
    done
    NSPAWN_CGROUPS=()
    if [[ -n "$NSPAWN_DIR" ]]; then
        if ((NSPAWN_OVERLAY)); then
            umount "$NSPAWN_ROOT" 2>/dev/null || umount -l "$NSPAWN_ROOT" 2>/dev/null || true
        fi
        # Never follow a mount that is still there into the cached root.
        if grep -qF " $NSPAWN_DIR" /proc/self/mountinfo; then
            _nspawn_log "mounts left under $NSPAWN_DIR: not removing it"
        elif [[ "${NSPAWN_KEEP:-0}" == 1 ]]; then
            _nspawn_log "kept $NSPAWN_DIR"
        else
            rm -rf --one-file-system "$NSPAWN_DIR"
        fi
    fi
    NSPAWN_DIR=""
    NSPAWN_ROOT=""
    NSPAWN_OVERLAY=0
    return 0
}
