#!/usr/bin/env bash
# The .deb under a real systemd: a Debian bookworm root booted with
# systemd-nspawn (scripts/lib/nspawn.sh), the package installed in it with
# dpkg -i, Debian's containerd 1.6 as the runtime (docs/systemd-tests.md).
#
#   scripts/test-systemd.sh [DEB]        the stage (as root)
#   scripts/test-systemd.sh --prepare-root
#                                        only build the cached root (for a
#                                        background lane of scripts/test.sh)
#
# DEB defaults to the newest dist/imgbridge_*_amd64.deb, else the one
# scripts/build-deb.sh writes (built if missing). Scenarios, each a
# function, each line `ok …` or `FAIL …` with what was expected and seen:
#   a  socket activation: imgbridge.service inactive until the first client;
#      an import into `buildkit` through the socket is in k8s.io on return
#   b  restart and SIGKILL of imgbridge.service under a client loop (a ctr
#      call every 50 ms): failed calls, longest gap, recovery time
#   e  imgbridge doctor under systemd
#   c  the drop-in socket swap (docs/socket-swap.md, or `imgbridge swap` when
#      the binary has it) under client loops on both paths, containerd
#      restarted, the container rebooted, then rolled back (a fresh container)
#   d  upgrade to a higher version under the client loop, remove, purge (a
#      fresh container)
# Exits 1 if any check failed; ends with a summary and a timing line.
# Environment: IMGBRIDGE_CACHE (the cached root, scripts/lib/nspawn.sh),
# IMGBRIDGE_SYSTEMD_SCENARIOS="a b e c d f" (a subset, in that order),
# IMGBRIDGE_TEST_KEEP=1 (keep the work dir).
set -uo pipefail
# `cond && ok … || fail …`: ok never fails (SC2015 does not apply).
# shellcheck disable=SC2015

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 2
# shellcheck source=scripts/lib/nspawn.sh
source scripts/lib/nspawn.sh
# ok/fail/note/check_eq, timed, report_summary
# shellcheck source=scripts/lib/report.sh
source scripts/lib/report.sh

if [[ "$(id -u)" -ne 0 ]]; then
    echo "scripts/test-systemd.sh: must run as root (systemd-nspawn)" >&2
    exit 2
fi

if [[ "${1:-}" == --prepare-root ]]; then
    s=$SECONDS
    nspawn_root_cached >/dev/null || exit 1
    echo "nspawn root ready: $(_nspawn_cache_dir)/$NSPAWN_RELEASE ($((SECONDS - s)) s)"
    exit 0
fi

work="$(mktemp -d /tmp/imgbridge-systemd.XXXXXX)"
loop_pids=()
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    # Client loops first (their stop files), so none is left for the
    # container's shutdown to wait for; nspawn_stop kills any still there.
    [[ -z "$NSPAWN_PID" ]] || touch "/proc/$NSPAWN_PID/root/run/ibtest/"{b,d,i,u}.stop 2>/dev/null || true
    for p in "${loop_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    nspawn_stop
    for p in "${loop_pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [[ "${IMGBRIDGE_TEST_KEEP:-0}" == 1 ]]; then echo "kept $work"; else rm -rf "$work"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT
trap 'exit 143' TERM

# -------------------------------------------------------------- the .deb
deb="${1:-}"
if [[ -z "$deb" ]]; then
    deb="$(ls dist/imgbridge_*_amd64.deb 2>/dev/null | sort -V | tail -n1)"
fi
if [[ -z "$deb" ]]; then
    echo "== no dist/imgbridge_*_amd64.deb: scripts/build-deb.sh"
    s=$SECONDS
    scripts/build-deb.sh || { echo "scripts/build-deb.sh failed" >&2; exit 1; }
    deb="$(ls target/x86_64-unknown-linux-musl/debian/imgbridge_*_amd64.deb 2>/dev/null | sort -V | tail -n1)"
    timed "build-deb" "$s"
fi
[[ -f "$deb" ]] || { echo "scripts/test-systemd.sh: no .deb ($deb)" >&2; exit 2; }
deb="$(realpath "$deb")"
deb_version="$(dpkg-deb -f "$deb" Version)"
echo "== .deb: $deb (version $deb_version)"

# ------------------------------------------------------------ helpers
# Polls a host command every 100 ms for up to $1 seconds (a command string
# inside the container: nspawn_poll).
poll_host() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}
in_out() { nspawn_run "$@" 2>&1; }
unit_prop() { nspawn_run "systemctl show -p $2 --value $1" 2>/dev/null; }
unit_active() { nspawn_run "systemctl is-active $1" 2>/dev/null; }

boot() { # NAME
    local s=$SECONDS
    echo "== boot $1"
    if ! nspawn_boot "$1"; then
        fail "boot: the container did not reach running/degraded"
        return 1
    fi
    timed "boot($1)" "$s"
    note "booted in $((SECONDS - s)) s: PID 1 is host pid $NSPAWN_PID (overlay root: $NSPAWN_OVERLAY)"
    local failed_units
    failed_units="$(nspawn_run 'systemctl list-units --failed --plain --no-legend' 2>/dev/null | awk '{print $1}' | tr '\n' ' ')"
    [[ -z "$failed_units" ]] || note "failed units at boot (not ours): $failed_units"
    nspawn_poll 30 'ctr -a /run/containerd/containerd.sock version' ||
        { fail "containerd: /run/containerd/containerd.sock did not answer within 30 s of boot"; return 1; }
}

install_deb() { # DEB (host path)
    nspawn_copy_in "$1" /root/imgbridge.deb || return 1
    local out rc=0
    out="$(in_out 'DEBIAN_FRONTEND=noninteractive dpkg -i /root/imgbridge.deb')" || rc=$?
    if ((rc != 0)); then
        echo "$out" | sed 's/^/     dpkg: /'
        fail "dpkg -i $(basename "$1"): exit $rc"
        return 1
    fi
    ok "dpkg -i $(basename "$1")"
}

# A tiny OCI archive made here (no registry): one layer holding one file.
# Sets oci_tar and oci_name.
make_oci_archive() {
    local d="$work/oci" cfg man idx lsha ldiff lsize csha csize msha msize
    oci_name="docker.io/library/imgbridge-systemd-test:1"
    rm -rf "$d"
    mkdir -p "$d/rootfs" "$d/layout/blobs/sha256"
    echo "hello from imgbridge's systemd test" >"$d/rootfs/hello.txt"
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$d/rootfs" -cf "$d/layer.tar" hello.txt
    ldiff="$(sha256sum <"$d/layer.tar" | cut -d' ' -f1)"
    gzip -n -9 <"$d/layer.tar" >"$d/layer.tar.gz"
    lsha="$(sha256sum <"$d/layer.tar.gz" | cut -d' ' -f1)"
    lsize="$(stat -c %s "$d/layer.tar.gz")"
    cp "$d/layer.tar.gz" "$d/layout/blobs/sha256/$lsha"
    cfg="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"Cmd\":[\"/hello.txt\"]},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$ldiff\"]}}"
    printf '%s' "$cfg" >"$d/cfg"
    csha="$(sha256sum <"$d/cfg" | cut -d' ' -f1)"
    csize="$(stat -c %s "$d/cfg")"
    mv "$d/cfg" "$d/layout/blobs/sha256/$csha"
    man="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$csha\",\"size\":$csize},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$lsha\",\"size\":$lsize}]}"
    printf '%s' "$man" >"$d/man"
    msha="$(sha256sum <"$d/man" | cut -d' ' -f1)"
    msize="$(stat -c %s "$d/man")"
    mv "$d/man" "$d/layout/blobs/sha256/$msha"
    idx="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:$msha\",\"size\":$msize,\"platform\":{\"architecture\":\"amd64\",\"os\":\"linux\"},\"annotations\":{\"io.containerd.image.name\":\"$oci_name\",\"org.opencontainers.image.ref.name\":\"1\"}}]}"
    printf '%s' "$idx" >"$d/layout/index.json"
    printf '{"imageLayoutVersion":"1.0.0"}' >"$d/layout/oci-layout"
    oci_tar="$work/x.tar"
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$d/layout" -cf "$oci_tar" oci-layout index.json blobs
}

# ------------------------------------------------------- the client loop
# loop_start NAME SOCKET: inside the container, `ctr -a SOCKET version`
# again and again, 50 ms apart, until loop_stop NAME; one line per call
# into $work/loop-NAME.log: start end exit-status [error] (epoch seconds,
# microseconds). A call that hangs counts as failed after 20 s.
loop_start() {
    local name="$1" sock="$2"
    : >"$work/loop-$name.log"
    nspawn_run "mkdir -p /run/ibtest && rm -f /run/ibtest/$name.stop"
    # shellcheck disable=SC2016
    nspawn_run '
        stop=/run/ibtest/'"$name"'.stop
        while [[ ! -e $stop ]]; do
            t0=$EPOCHREALTIME
            if err=$(timeout 20 ctr -a '"$sock"' version 2>&1 >/dev/null); then rc=0; err=""; else rc=$?; fi
            t1=$EPOCHREALTIME
            err=${err//$'"'"'\n'"'"'/ }
            printf "%s %s %s %s\n" "$t0" "$t1" "$rc" "${err:0:200}"
            sleep 0.05
        done' >"$work/loop-$name.log" 2>&1 &
    loop_pids+=($!)
    eval "loop_pid_$name=$!"
}
loop_stop() {
    local name="$1" pid
    pid="$(eval echo "\${loop_pid_$name:-}")"
    [[ -n "$pid" ]] || return 0
    [[ -z "$NSPAWN_PID" ]] || touch "/proc/$NSPAWN_PID/root/run/ibtest/$name.stop" 2>/dev/null || true
    poll_host 30 eval "! kill -0 $pid" || kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    eval "loop_pid_$name="
}
# Successful calls that started after epoch time $2.
loop_successes_after() {
    awk -v t="$2" '$3 == 0 && $1 + 0 > t + 0 { n++ } END { print n + 0 }' "$work/loop-$1.log"
}
# Calls (any result) that started after epoch time $2.
loop_calls_after() {
    awk -v t="$2" 'NF >= 3 && $1 + 0 > t + 0 { n++ } END { print n + 0 }' "$work/loop-$1.log"
}
# Waits until COUNT NAME T (loop_calls_after or loop_successes_after) is N.
_loop_wait_count() { # COUNT NAME N T SECONDS
    local deadline=$((SECONDS + $5))
    while (($("$1" "$2" "$4") < $3)); do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}
# Waits until the loop NAME has made N calls that started after T.
loop_wait_calls() { _loop_wait_count loop_calls_after "$@"; } # NAME N T SECONDS
# Waits until the loop NAME has N successes that started after T.
loop_wait() { _loop_wait_count loop_successes_after "$@"; } # NAME N T SECONDS
# loop_report NAME WHAT [MARK]: prints calls, failures, the longest gap
# between two successes (and with MARK, an epoch time: the recovery, from
# MARK to the end of the first success of a call started after it); sets
# loop_failed, loop_gap_ms, loop_recovery_ms.
loop_report() { # NAME WHAT SOCKET [MARK]
    local name="$1" what="$2" mark="${4:-}" line msg
    line="$(awk -v mark="$mark" '
        NF >= 3 {
            calls++
            if ($2 - $1 > longest) longest = $2 - $1
            if ($3 != 0) {
                failed++
                err = $0; sub(/^[^ ]+ [^ ]+ [^ ]+ ?/, "", err)
                if (!(err in seen) && nerr < 3) { seen[err] = 1; errs = errs " | exit " $3 ": " err; nerr++ }
                next
            }
            if (last != "") { g = $2 - last; if (g > gap) gap = g }
            last = $2
            if (mark != "" && rec == "" && $1 + 0 > mark + 0) rec = $2 - mark
        }
        END { printf "%d %d %d %d %s%s\n", calls, failed, gap * 1000, longest * 1000, (rec == "" ? "-" : sprintf("%d", rec * 1000)), errs }' "$work/loop-$name.log")"
    read -r loop_calls loop_failed loop_gap_ms loop_longest_ms loop_recovery_ms loop_errors <<<"$line"
    msg="$what: $loop_calls calls on $3, $loop_failed failed, longest gap between successes ${loop_gap_ms} ms, longest call ${loop_longest_ms} ms"
    [[ -z "$mark" ]] || msg+=", recovery ${loop_recovery_ms} ms"
    if [[ "$loop_calls" -lt 2 ]]; then
        fail "$what: the client loop made only $loop_calls calls on $3 (expected calls throughout)"
    elif [[ "$loop_failed" == 0 ]]; then
        ok "$msg"
    else
        fail "$msg (expected 0 failed); errors: ${loop_errors}"
    fi
}
now() { echo "$EPOCHREALTIME"; }

# -------------------------------------------------------------- scenarios

# a. socket activation, and an import that is in k8s.io when it returns.
scenario_a() {
    current=a
    local enabled active svc out listed
    enabled="$(unit_prop imgbridge.socket UnitFileState)"
    active="$(unit_active imgbridge.socket)"
    svc="$(unit_active imgbridge.service)"
    note "after dpkg -i: imgbridge.socket is $enabled/$active, imgbridge.service $svc"
    # The package enables and starts both (packaging/debian/postinst), as
    # Debian's daemons do.
    check_eq "after dpkg -i: imgbridge.socket (enabled and started by the package)" "enabled/active" "$enabled/$active"
    check_eq "after dpkg -i: imgbridge.service (started by the package)" active "$svc"
    out="$(in_out 'systemctl enable --now imgbridge.socket')" || { fail "systemctl enable --now imgbridge.socket: $out"; return; }
    check_eq "imgbridge.socket after enable --now" "enabled/active" \
        "$(unit_prop imgbridge.socket UnitFileState)/$(unit_active imgbridge.socket)"
    # Socket activation: with the service stopped, the socket stays bound
    # and the first client starts it.
    out="$(in_out 'systemctl stop imgbridge.service')" || fail "systemctl stop imgbridge.service: $out"
    check_eq "imgbridge.service stopped, before any client (socket activation)" inactive "$(unit_active imgbridge.service)"
    if nspawn_run 'test -S /run/imgbridge/containerd.sock'; then
        ok "/run/imgbridge/containerd.sock exists (bound by systemd)"
    else
        fail "/run/imgbridge/containerd.sock: expected a socket, saw: $(in_out 'ls -la /run/imgbridge/ 2>&1')"
    fi
    local t0=$EPOCHREALTIME
    if out="$(in_out 'timeout 60 ctr --address /run/imgbridge/containerd.sock version')"; then
        ok "first client through the socket answered in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", (b - a) * 1000 }') ms (ctr version)"
    else
        fail "ctr --address /run/imgbridge/containerd.sock version: expected the server version, saw: $out"
        in_out 'journalctl -u imgbridge.service -u imgbridge.socket --no-pager -n 30' | sed 's/^/     journal: /'
        return
    fi
    check_eq "imgbridge.service after the first client" active "$(unit_active imgbridge.service)"
    check_eq "imgbridge.service was started by" "imgbridge.socket" "$(unit_prop imgbridge.service TriggeredBy)"

    make_oci_archive
    nspawn_copy_in "$oci_tar" /root/x.tar
    # Both in one shell: the listing runs the moment the import returns.
    out="$(nspawn_run "ctr -a /run/imgbridge/containerd.sock -n buildkit images import /root/x.tar >/tmp/import.out 2>&1; rc=\$?
        ctr -a /run/containerd/containerd.sock -n k8s.io images ls -q; echo import-exit=\$rc" 2>&1)"
    listed="$(grep -v '^import-exit=' <<<"$out")"
    if ! grep -qx 'import-exit=0' <<<"$out"; then
        fail "ctr -n buildkit images import through imgbridge: $(grep '^import-exit=' <<<"$out"): $(in_out 'cat /tmp/import.out')"
    elif grep -qxF "$oci_name" <<<"$listed"; then
        ok "import into buildkit through /run/imgbridge/containerd.sock: $oci_name in k8s.io (direct to containerd) the moment it returned"
    else
        fail "k8s.io right after the import returned: expected $oci_name, saw: $(tr '\n' ' ' <<<"$listed")"
        in_out 'journalctl -u imgbridge.service --no-pager -n 20' | sed 's/^/     journal: /'
    fi
}

# b. restart and SIGKILL of imgbridge.service under the client loop.
scenario_b() {
    current=b
    local t pid0 pid1
    nspawn_run 'timeout 30 ctr -a /run/imgbridge/containerd.sock version' >/dev/null 2>&1 ||
        { fail "imgbridge's socket does not answer before the scenario"; return; }
    pid0="$(unit_prop imgbridge.service MainPID)"

    loop_start b /run/imgbridge/containerd.sock
    t=$(now)
    loop_wait b 5 0 30 || { fail "client loop: no 5 successes within 30 s"; loop_stop b; return; }
    t=$(now)
    in_out 'systemctl restart imgbridge.service' >/dev/null || fail "systemctl restart imgbridge.service failed"
    loop_wait b 10 "$t" 60 || note "fewer than 10 successes within 60 s of the restart"
    loop_stop b
    pid1="$(unit_prop imgbridge.service MainPID)"
    [[ "$pid1" != "$pid0" && "$pid1" != 0 ]] && ok "restart: MainPID $pid0 → $pid1" ||
        fail "restart: expected a new MainPID, saw $pid0 → $pid1"
    loop_report b "systemctl restart imgbridge.service" /run/imgbridge/containerd.sock

    loop_start b /run/imgbridge/containerd.sock
    loop_wait b 5 0 30 || { fail "client loop: no 5 successes within 30 s"; loop_stop b; return; }
    note "RestartSec of imgbridge.service: $(unit_prop imgbridge.service RestartUSec)"
    t=$(now)
    in_out 'systemctl kill -s KILL imgbridge.service' >/dev/null || fail "systemctl kill -s KILL imgbridge.service failed"
    loop_wait b 10 "$t" 60 || note "fewer than 10 successes within 60 s of the kill"
    loop_stop b
    pid0="$pid1"
    pid1="$(unit_prop imgbridge.service MainPID)"
    [[ "$pid1" != "$pid0" && "$pid1" != 0 ]] && ok "SIGKILL: restarted, MainPID $pid0 → $pid1" ||
        fail "SIGKILL: expected a new MainPID, saw $pid0 → $pid1"
    loop_report b "systemctl kill -s KILL imgbridge.service" /run/imgbridge/containerd.sock "$t"
    echo "     [b] recovery after SIGKILL: ${loop_recovery_ms} ms (kill → first success of a call started after it)"
}

# e. imgbridge doctor under systemd.
scenario_e() {
    current=e
    local out rc=0
    out="$(in_out 'imgbridge doctor')" || rc=$?
    sed 's/^/     doctor: /' <<<"$out"
    if ((rc == 0)); then ok "imgbridge doctor: exit 0"; else fail "imgbridge doctor: expected exit 0, saw $rc"; fi
    if grep -qi 'systemd' <<<"$out"; then
        ok "doctor reports on systemd/socket activation: $(grep -i -m1 'systemd' <<<"$out")"
    else
        fail "doctor: expected a line about systemd / socket activation (grep -i systemd), saw none"
    fi
}

# --- the swap, as docs/socket-swap.md writes it (or imgbridge swap).

# The swap as docs/socket-swap.md says: `imgbridge swap apply` (it
# edits containerd's config, writes the drop-ins and restarts in the
# measured order), then `imgbridge swap rollback`.
apply_swap() {
    in_out 'imgbridge swap apply' | sed 's/^/     swap: /'
    return "${PIPESTATUS[0]}"
}
rollback_swap() {
    in_out 'imgbridge swap rollback' | sed 's/^/     swap: /'
    return "${PIPESTATUS[0]}"
}
# Who listens on PATH inside the container (ss: the process name).
listener_of() {
    nspawn_run "ss -xlpn" 2>/dev/null | awk -v p="$1" '$5 == p { match($0, /users:\(\("[^"]+"/); print substr($0, RSTART + 9, RLENGTH - 10); exit }'
}
swap_state() { # prints a one-line description
    echo "default path: $(listener_of /run/containerd/containerd.sock || true), real: $(listener_of /run/containerd/containerd-real.sock || true), imgbridge path: $(listener_of /run/imgbridge/containerd.sock || true)"
}
# Two loops, default path (d) and imgbridge's (i), around a command; a
# path nobody listens on when it starts gets no loop (said so).
under_loops() { # WHAT COMMAND-FUNCTION...
    local what="$1" t rc l
    local -a loops=()
    shift
    for l in d i; do
        if [[ -n "$(listener_of "$(loop_sock "$l")")" ]]; then loops+=("$l"); else
            note "$what: nobody listens on $(loop_sock "$l"): no client loop on it"
        fi
    done
    for l in "${loops[@]}"; do loop_start "$l" "$(loop_sock "$l")"; done
    for l in "${loops[@]}"; do loop_wait_calls "$l" 3 0 30 || note "$what: $(loop_sock "$l"): no 3 calls within 30 s"; done
    t=$(now)
    "$@"
    rc=$?
    # Afterwards: 5 successes on each path, or 10 calls (a path that stays
    # broken), or 30 s.
    t=$(now)
    local deadline=$((SECONDS + 30))
    for l in "${loops[@]}"; do
        while (($(loop_successes_after "$l" "$t") < 5 && $(loop_calls_after "$l" "$t") < 10 && SECONDS < deadline)); do
            sleep 0.1
        done
    done
    for l in "${loops[@]}"; do loop_stop "$l"; done
    for l in "${loops[@]}"; do loop_report "$l" "$what" "$(loop_sock "$l")"; done
    return $rc
}
loop_sock() { case "$1" in d) echo /run/containerd/containerd.sock ;; i) echo /run/imgbridge/containerd.sock ;; esac; }
swap_check_applied() { # WHEN
    local listen
    nspawn_run 'timeout 30 ctr -a /run/containerd/containerd.sock version' >/dev/null 2>&1 &&
        ok "$1: ctr -a /run/containerd/containerd.sock version answers" ||
        fail "$1: ctr -a /run/containerd/containerd.sock version: expected an answer, saw: $(in_out 'timeout 30 ctr -a /run/containerd/containerd.sock version' | tail -n1)"
    # Listen= is the configuration; what is bound is what ss shows (after
    # daemon-reload the two differ: docs/systemd-tests.md).
    listen="$(unit_prop imgbridge.socket Listen | tr '\n' ' ')"
    [[ "$listen" == *"/run/containerd/containerd.sock (Stream)"* ]] &&
        ok "$1: imgbridge.socket's Listen= names the default path ($listen)" ||
        fail "$1: imgbridge.socket Listen=: expected /run/containerd/containerd.sock, saw '$listen'"
    local who
    who="$(listener_of /run/containerd/containerd.sock)"
    [[ "$who" == systemd || "$who" == imgbridge ]] &&
        ok "$1: the default path is bound by $who (imgbridge.socket)" ||
        fail "$1: the default path: expected bound by systemd/imgbridge, saw '${who:-nobody}'"
    check_eq "$1: imgbridge.service (serving the default path)" active "$(unit_active imgbridge.service)"
    nspawn_run 'test -S /run/containerd/containerd-real.sock' &&
        ok "$1: /run/containerd/containerd-real.sock exists" ||
        fail "$1: /run/containerd/containerd-real.sock: expected a socket, saw: $(in_out 'ls -la /run/containerd/' | tr '\n' ' ')"
    check_eq "$1: containerd listens on the real socket" containerd "$(listener_of /run/containerd/containerd-real.sock)"
    note "$1: $(swap_state)"
}

restart_containerd() {
    in_out 'systemctl restart containerd' >"$work/step.out" || fail "systemctl restart containerd: $(cat "$work/step.out")"
}

scenario_c() {
    current=c
    local before
    nspawn_run 'timeout 30 ctr -a /run/imgbridge/containerd.sock version' >/dev/null 2>&1 ||
        { fail "imgbridge's socket does not answer before the swap"; return; }
    note "containerd config before: $(in_out 'grep -c . /etc/containerd/config.toml 2>/dev/null || echo none') non-empty lines; $(swap_state)"
    under_loops "switch (apply_swap)" apply_swap || fail "apply_swap returned non-zero"
    swap_check_applied "after the switch"
    local l
    l="$(listener_of /run/imgbridge/containerd.sock)"
    if [[ -n "$l" ]]; then
        ok "after the switch: /run/imgbridge/containerd.sock still served ($l listens): clients set to it keep working"
    else
        fail "after the switch: nobody listens on /run/imgbridge/containerd.sock ($(nspawn_run 'test -S /run/imgbridge/containerd.sock' && echo 'a stale socket file is left' || echo 'no file')): clients configured with it (README: buildkit, nerdctl, ctr) lose imgbridge; expected it kept beside the default path"
    fi

    under_loops "systemctl restart containerd" restart_containerd
    swap_check_applied "after restarting containerd"

    local s=$SECONDS
    if nspawn_reboot; then
        ok "reboot with the swap in place: booted again in $((SECONDS - s)) s (nspawn exited $NSPAWN_LAST_EXIT on reboot)"
        timed "reboot" "$s"
        swap_check_applied "after the reboot"
        check_eq "after the reboot: stat -c %a /run/containerd" 711 "$(in_out 'stat -c %a /run/containerd')"
        loop_start d /run/containerd/containerd.sock
        loop_wait d 20 0 30 || true
        loop_stop d
        loop_report d "after the reboot, default path" /run/containerd/containerd.sock
    else
        fail "reboot: the container did not come back"
        return
    fi

    under_loops "rollback" rollback_swap || fail "rollback returned non-zero"
    check_eq "after the rollback: the default path's listener" containerd "$(listener_of /run/containerd/containerd.sock)"
    nspawn_run 'timeout 30 ctr -a /run/containerd/containerd.sock version' >/dev/null 2>&1 &&
        ok "after the rollback: the default path answers" || fail "after the rollback: the default path does not answer"
    before="$(listener_of /run/containerd/containerd-real.sock)"
    check_eq "after the rollback: listener on containerd-real.sock" "" "$before"
    check_eq "after the rollback: imgbridge.socket Listen" \
        "/run/imgbridge/containerd.sock (Stream) /run/imgbridge/containerd.sock.ttrpc (Stream) " \
        "$(unit_prop imgbridge.socket Listen | tr '\n' ' ')"
    nspawn_run 'timeout 30 ctr -a /run/imgbridge/containerd.sock version' >/dev/null 2>&1 &&
        ok "after the rollback: imgbridge's own path answers" || fail "after the rollback: /run/imgbridge/containerd.sock does not answer"
}

# d. upgrade under the client loop, then remove and purge.
scenario_d() {
    current=d
    local dir="$work/deb2" v2 deb2 pid0 pid1 exe out rc
    rm -rf "$dir"
    mkdir -p "$dir"
    dpkg-deb -R "$deb" "$dir/pkg" || { fail "dpkg-deb -R $deb"; return; }
    v2="${deb_version}+systemdtest1"
    sed -i "s/^Version: .*/Version: $v2/" "$dir/pkg/DEBIAN/control"
    deb2="$dir/imgbridge_${v2}_amd64.deb"
    dpkg-deb -b -Znone --root-owner-group "$dir/pkg" "$deb2" >/dev/null || { fail "dpkg-deb -b"; return; }
    dpkg --compare-versions "$v2" gt "$deb_version" || { fail "version $v2 is not higher than $deb_version"; return; }
    note "upgrade package: version $v2 (the same files)"

    nspawn_run 'systemctl enable --now imgbridge.socket' >/dev/null 2>&1
    nspawn_run 'timeout 30 ctr -a /run/imgbridge/containerd.sock version' >/dev/null 2>&1 ||
        { fail "imgbridge's socket does not answer before the upgrade"; return; }
    pid0="$(unit_prop imgbridge.service MainPID)"
    nspawn_copy_in "$deb2" /root/imgbridge2.deb
    loop_start u /run/imgbridge/containerd.sock
    loop_wait u 5 0 30 || note "client loop: no 5 successes before the upgrade"
    rc=0
    out="$(in_out 'DEBIAN_FRONTEND=noninteractive dpkg -i /root/imgbridge2.deb')" || rc=$?
    pid1="$(unit_prop imgbridge.service MainPID)"
    loop_wait u 10 "$(now)" 30 || true
    loop_stop u
    if ((rc == 0)); then ok "dpkg -i version $v2 (upgrade)"; else fail "dpkg -i $v2: exit $rc: $out"; fi
    loop_report u "upgrade (dpkg -i $v2)" /run/imgbridge/containerd.sock
    note "imgbridge.service right after dpkg returned: $(unit_active imgbridge.service), MainPID $pid0 → $pid1"
    if [[ "$pid1" == 0 ]]; then
        # Not running: a client starts it (socket activation).
        nspawn_run 'timeout 30 ctr -a /run/imgbridge/containerd.sock version' >/dev/null 2>&1
        pid1="$(unit_prop imgbridge.service MainPID)"
    fi
    if [[ "$pid1" != "$pid0" && "$pid1" != 0 ]]; then
        ok "upgrade: imgbridge restarted (MainPID $pid0 → $pid1)"
    else
        fail "upgrade: expected a new imgbridge process, saw MainPID $pid0 → $pid1 (the old binary keeps serving)"
    fi
    exe="$(readlink "/proc/$NSPAWN_PID/root/proc/$pid1/exe" 2>/dev/null || nspawn_run "readlink /proc/$pid1/exe")"
    check_eq "upgrade: /proc/<MainPID>/exe" /usr/bin/imgbridge "$exe"

    # Removed with the swap in place: the prerm rolls it back first, so
    # containerd's default path (kubelet's runtime) survives the removal.
    if in_out 'imgbridge swap apply' >"$work/swap-d.out"; then
        ok "swap applied before the removal"
    else
        fail "imgbridge swap apply before the removal: $(tail -n 3 "$work/swap-d.out")"
    fi
    rc=0
    out="$(in_out 'DEBIAN_FRONTEND=noninteractive apt-get remove -y imgbridge')" || rc=$?
    if ((rc == 0)); then ok "apt-get remove -y imgbridge"; else fail "apt-get remove: exit $rc: $(tail -n 3 <<<"$out")"; fi
    local who
    who="$(listener_of /run/containerd/containerd.sock)"
    check_eq "after remove: the default path is containerd's own (the swap rolled back)" containerd "$who"
    nspawn_run 'timeout 30 ctr -a /run/containerd/containerd.sock version' >/dev/null 2>&1 &&
        ok "after remove: containerd answers on its default path" ||
        fail "after remove: ctr -a /run/containerd/containerd.sock version does not answer"
    nspawn_run '! grep -q containerd-real /etc/containerd/config.toml 2>/dev/null' &&
        ok "after remove: containerd's config names no containerd-real.sock" ||
        fail "after remove: /etc/containerd/config.toml still moves containerd aside"
    nspawn_run 'test ! -e /run/imgbridge/containerd.sock' && ok "after remove: /run/imgbridge/containerd.sock is gone" ||
        fail "after remove: expected no /run/imgbridge/containerd.sock, saw: $(in_out 'ls -la /run/imgbridge/containerd.sock')"
    local st
    st="$(unit_active imgbridge.socket)"
    [[ "$st" != active ]] && ok "after remove: imgbridge.socket is $st" ||
        fail "after remove: expected imgbridge.socket not active, saw $st"
    st="$(unit_active imgbridge.service)"
    [[ "$st" != active ]] && ok "after remove: imgbridge.service is $st" ||
        fail "after remove: expected imgbridge.service not active, saw $st"
    out="$(in_out 'find /etc/systemd/system -xtype l')"
    [[ -z "$out" ]] && ok "after remove: no dangling symlinks under /etc/systemd/system" ||
        fail "after remove: expected no dangling symlinks under /etc/systemd/system, saw: $(tr '\n' ' ' <<<"$out")"
    rc=0
    out="$(in_out 'dpkg -P imgbridge')" || rc=$?
    if ((rc == 0)); then ok "dpkg -P imgbridge"; else fail "dpkg -P: exit $rc: $(tail -n 3 <<<"$out")"; fi
    nspawn_run 'test ! -e /etc/imgbridge' && ok "after purge: /etc/imgbridge is gone" ||
        fail "after purge: expected no /etc/imgbridge, saw: $(in_out 'ls -la /etc/imgbridge' | tr '\n' ' ')"
    out="$(in_out 'find /etc/systemd/system -xtype l; ls /var/lib/systemd/deb-systemd-helper-enabled 2>/dev/null | grep imgbridge')"
    [[ -z "$out" ]] && ok "after purge: no dangling symlinks, no deb-systemd-helper state" ||
        fail "after purge: left: $(tr '\n' ' ' <<<"$out")"
}

# ----------------------------------------------------------------- the run
s=$SECONDS
root_was="warm"
[[ -f "$(_nspawn_cache_dir)/$NSPAWN_RELEASE/.imgbridge-root" && "$(cat "$(_nspawn_cache_dir)/$NSPAWN_RELEASE/.imgbridge-root")" == "$(_nspawn_stamp)" ]] ||
    root_was="cold"
echo "== cached root ($root_was)"
nspawn_root_cached >/dev/null || { echo "scripts/test-systemd.sh: no root" >&2; exit 1; }
timed "root($root_was)" "$s"

# f: a runtime with no containerd.service (k3s, rke2, k0s, microk8s run
# containerd inside a unit of their own): containerd.service masked, a
# containerd on k3s's socket in a transient k3s.service, upstream set as
# docs/k3s.md says. The packaged unit starts and serves (it only Wants=
# containerd.service; Requires= failed on the masked unit).
scenario_f() {
    current=f
    local out
    out="$(in_out 'systemctl disable --now containerd.service && systemctl mask containerd.service')" ||
        { fail "mask containerd.service: $out"; return; }
    out="$(in_out 'systemd-run --unit=k3s.service /usr/bin/containerd --address /run/k3s/containerd/containerd.sock \
        --root /var/lib/k3s-containerd --state /run/k3s/containerd')" || { fail "systemd-run k3s.service: $out"; return; }
    nspawn_poll 30 'ctr -a /run/k3s/containerd/containerd.sock version' ||
        { fail "the k3s-like containerd never answered"; return; }
    nspawn_run "sed -i 's|^upstream = .*|upstream = \"/run/k3s/containerd/containerd.sock\"|' /etc/imgbridge/config.toml"
    out="$(in_out 'systemctl restart imgbridge.service')" &&
        ok "systemctl restart imgbridge.service with containerd.service masked" ||
        fail "systemctl restart imgbridge.service with containerd.service masked: $out"
    check_eq "imgbridge.service (no containerd.service on the node)" active "$(unit_active imgbridge.service)"
    [[ " $(unit_prop imgbridge.service After) " == *" k3s.service "* ]] &&
        ok "imgbridge.service is ordered after k3s.service" ||
        fail "imgbridge.service After=: expected k3s.service among $(unit_prop imgbridge.service After)"
    out="$(in_out 'timeout 30 ctr -a /run/imgbridge/containerd.sock -n buildkit images import /root/x.tar && ctr -a /run/k3s/containerd/containerd.sock -n k8s.io images ls -q')"
    grep -q 'imgbridge-systemd-test' <<<"$out" &&
        ok "import into buildkit through imgbridge: in the k3s-like containerd's k8s.io when it returned" ||
        fail "import through imgbridge to the k3s-like containerd: $out"
}

scenarios="${IMGBRIDGE_SYSTEMD_SCENARIOS:-a b e c d f}"
booted_for=""
fresh() { # NAME: a fresh container with the .deb installed
    nspawn_stop
    booted_for=""
    boot "$1" || return 1
    install_deb "$deb" || return 1
    booted_for="$1"
}
for sc in $scenarios; do
    s=$SECONDS
    echo "== scenario $sc"
    case "$sc" in
        a) current=a; fresh "ib-a-$$" && scenario_a ;;
        b | e)
            current=$sc
            if [[ -z "$booted_for" ]]; then
                fresh "ib-$sc-$$" && nspawn_run 'systemctl enable --now imgbridge.socket' >/dev/null 2>&1
            fi
            [[ -n "$booted_for" ]] && "scenario_$sc" ;;
        f)
            current=f
            fresh "ib-f-$$" && make_oci_archive && nspawn_copy_in "$oci_tar" /root/x.tar &&
                nspawn_run 'systemctl enable --now imgbridge.socket' >/dev/null 2>&1 && scenario_f ;;
        c | d)
            current=$sc
            fresh "ib-$sc-$$" && nspawn_run 'systemctl enable --now imgbridge.socket' >/dev/null 2>&1 && "scenario_$sc" ;;
        *) echo "unknown scenario $sc" >&2; exit 2 ;;
    esac
    timed "scenario-$sc" "$s"
done
s=$SECONDS
nspawn_stop
timed "stop" "$s"

report_summary
