# shellcheck shell=bash
# Check results and timings for the test scripts that report one line a
# check (scripts/test-systemd.sh, scripts/test-openrc.sh). Sourced; `current`
# names the part running now (set by the caller), shown in every line:
#
#   ok MESSAGE...            `ok   [current] MESSAGE`, counted
#   fail MESSAGE...          `FAIL [current] MESSAGE`, counted and listed
#                            again in the summary
#   note MESSAGE...          `     [current] MESSAGE`
#   check_eq WHAT WANT SEEN  ok if SEEN is WANT, else fail saying both
#   timed LABEL START        adds "LABEL <seconds since START>s" to the
#                            timing line (START: a $SECONDS value)
#   report_summary           the counts, the failures again and the timing
#                            line; status 0 if nothing failed (end the
#                            script with it)

run_start=$SECONDS
timings=()
passed=0
failed=0
failures=()
current=""

ok() { passed=$((passed + 1)); echo "ok   [$current] $*"; }
fail() { failed=$((failed + 1)); failures+=("[$current] $1"); echo "FAIL [$current] $*"; }
note() { echo "     [$current] $*"; }
# check DESCRIPTION EXPECTED SEEN: ok if equal.
check_eq() {
    if [[ "$3" == "$2" ]]; then ok "$1: $3"; else fail "$1: expected '$2', saw '$3'"; fi
}

timed() { # label start
    timings+=("$1 $((SECONDS - $2))s")
}

report_summary() {
    local f
    echo "== summary: $passed ok, $failed FAIL"
    for f in "${failures[@]}"; do echo "   FAIL $f"; done
    echo "== timing: ${timings[*]} total $((SECONDS - run_start))s"
    ((failed == 0))
}
