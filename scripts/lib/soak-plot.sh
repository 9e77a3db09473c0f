#!/usr/bin/env bash
# Plots a soak run (scripts/soak.sh, tests/soak.rs) into DIR/soak.png:
# three stacked panels over the minutes since the start,
#   (a) imgbridge's RSS (MiB),
#   (b) imgbridge's open descriptors and tokio tasks (left axis) and threads
#       (right axis),
#   (c) containerd's leases (but buildkitd's own cache and history), the leases labelled by imgbridge and the
#       active ingests,
# with every injected fault drawn in each panel as a thin vertical line at
# its moment (its recovery, when known, as a faint band after it), colored
# by kind.
#
#   scripts/lib/soak-plot.sh DIR
#
# Reads from DIR (tab-separated, header line first, `-` for a missing value):
#   samples.tsv  t_s pid rss_kib fds threads streams leases imgbridge_leases
#                ingests images_src images_k8s pending_blobs import_pending
#   faults.tsv   t_s kind recovered_s failed_calls detail  (optional; may be
#                empty or header only)
#   soak-run.txt key=value lines scripts/soak.sh writes (seed, minutes,
#                containerd, commit), for the title (optional)
# Lines of the plot break where imgbridge's pid changes (a restart). Callable
# on its own for an existing run dir. Needs gnuplot (Debian: gnuplot-nox)
# and awk. Exits non-zero if there is nothing to plot or gnuplot fails.
set -euo pipefail

die() { echo "soak-plot: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: scripts/lib/soak-plot.sh DIR"
dir="$1"
samples="$dir/samples.tsv"
faults="$dir/faults.tsv"
meta="$dir/soak-run.txt"
png="$dir/soak.png"
[[ -s "$samples" ]] || die "no $samples"
command -v gnuplot >/dev/null 2>&1 || die "gnuplot not found (apt-get install gnuplot-nox)"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/soak-plot.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# ----------------------------------------------------------------- samples
# minutes rss_mib fds threads leases imgbridge_leases ingests tasks, NaN where
# missing, a blank line where the pid changes (gnuplot breaks the line
# there). stats.txt: the numbers of the subtitle.
awk -F'\t' -v stats="$tmp/stats.txt" '
    function v(name,   i, x) {
        i = col[name]
        if (!i) return "NaN"
        x = $i
        if (x == "-" || x == "" || x !~ /^[-+]?[0-9.]+([eE][-+]?[0-9]+)?$/) return "NaN"
        return x + 0
    }
    NR == 1 {
        for (i = 1; i <= NF; i++) col[$i] = i
        for (n = split("t_s pid rss_kib fds threads leases imgbridge_leases ingests", need, " "); n > 0; n--)
            if (!(need[n] in col)) printf "soak-plot: samples.tsv has no column %s\n", need[n] > "/dev/stderr"
        next
    }
    {
        t = v("t_s")
        if (t == "NaN") next
        pid = v("pid")
        if (pid != "NaN" && last_pid != "" && pid != last_pid) { print ""; restarts++ }
        if (pid != "NaN") last_pid = pid
        rss = v("rss_kib"); if (rss != "NaN") rss = rss / 1024
        fds = v("fds"); thr = v("threads")
        printf "%.4f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t / 60, rss, fds, thr, v("leases"), v("imgbridge_leases"), v("ingests"), v("tasks")
        rows++
        if (t > tmax) tmax = t
        if (rss != "NaN") { if (rss > rss_peak) rss_peak = rss; rss_last = rss }
        if (fds != "NaN") { if (fds > fds_peak) fds_peak = fds; fds_last = fds }
        if (thr != "NaN") { if (thr > thr_peak) thr_peak = thr; thr_last = thr }
    }
    END {
        printf "rows=%d\ntmax_min=%.4f\nrestarts=%d\n", rows, tmax / 60, restarts > stats
        printf "rss=%s\nrss_peak=%s\n", or_dash(rss_last, "%.1f"), or_dash(rss_peak, "%.1f") > stats
        printf "fds=%s\nfds_peak=%s\n", or_dash(fds_last, "%d"), or_dash(fds_peak, "%d") > stats
        printf "threads=%s\nthreads_peak=%s\n", or_dash(thr_last, "%d"), or_dash(thr_peak, "%d") > stats
    }
    function or_dash(x, fmt) {
        return x == "" ? "-" : sprintf(fmt, x)
    }
' "$samples" >"$tmp/samples.dat"

stat() { awk -F= -v k="$1" '$1 == k { sub(/^[^=]*=/, ""); print; exit }' "$tmp/stats.txt"; }
rows="$(stat rows)"
[[ "$rows" -gt 0 ]] || die "$samples has no data rows"
xmax="$(awk -v m="$(stat tmax_min)" 'BEGIN { print (m > 0 ? m : 1) }')"

# ------------------------------------------------------------------ faults
# faults.gp: one arrow (and a recovery band) per fault, which every panel
# draws; keys.gp: one key entry per kind seen, with its count.
: >"$tmp/faults.gp"
: >"$tmp/keys.gp"
nfaults=0
if [[ -s "$faults" ]]; then
    awk -F'\t' -v keys="$tmp/keys.gp" '
        BEGIN {
            color["imgbridge-sigkill"] = "#e41a1c"
            color["imgbridge-sigterm"] = "#ff7f00"
            color["containerd-restart"] = "#377eb8"
            color["containerd-sigkill"] = "#984ea3"
            color["client-reset"] = "#f781bf"
            color["write-cut"] = "#a65628"
            color["disk-full"] = "#d9b800"
            order = "imgbridge-sigkill imgbridge-sigterm containerd-restart containerd-sigkill client-reset write-cut disk-full"
        }
        function num(x) { return x ~ /^[-+]?[0-9.]+([eE][-+]?[0-9]+)?$/ }
        NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
        {
            t = $(col["t_s"]); kind = $(col["kind"])
            rec = col["recovered_s"] ? $(col["recovered_s"]) : "-"
            if (!num(t)) next
            gsub(/[^A-Za-z0-9_.-]/, "", kind)
            if (kind == "") kind = "unknown"
            c = (kind in color) ? color[kind] : "#808080"
            x = t / 60
            if (num(rec) && rec > 0)
                printf "set object rect from first %.4f, graph 0 to first %.4f, graph 1 fc rgb \"%s\" fs transparent solid 0.12 noborder back\n", x, (t + rec) / 60, c
            printf "set arrow from first %.4f, graph 0 to first %.4f, graph 1 nohead lc rgb \"%s\" lw 1 back\n", x, x, c
            if (!(kind in count)) seen[++nseen] = kind
            count[kind]++
            n++
        }
        END {
            # The known kinds in their fixed order, then any other.
            k = split(order, o, " ")
            for (i = 1; i <= k; i++) if (o[i] in count) key(o[i])
            for (i = 1; i <= nseen; i++) if (!(seen[i] in color)) key(seen[i])
            print n + 0 > "/dev/stderr"
        }
        function key(kind) {
            c = (kind in color) ? color[kind] : "#808080"
            printf ", NaN with lines lc rgb \"%s\" lw 2 title \"%s (%d)\"", c, kind, count[kind] > keys
        }
    ' "$faults" >"$tmp/faults.gp" 2>"$tmp/nfaults"
    nfaults="$(tail -n1 "$tmp/nfaults")"
fi

# ------------------------------------------------------------------- title
meta_get() {
    if [[ -f "$meta" ]]; then
        awk -F= -v k="$1" '$1 == k { sub(/^[^=]*=/, ""); print; exit }' "$meta"
    fi
}
clean() { tr -d '"\\\n' <<<"$1"; }
seed="$(meta_get seed)"
if [[ -z "$seed" && -f "$dir/report.txt" ]]; then
    seed="$(grep -m1 -oiE 'seed[ =:]+[0-9]+' "$dir/report.txt" | grep -oE '[0-9]+$' || true)"
fi
minutes="$(meta_get minutes)"
[[ -n "$minutes" ]] || minutes="$(awk -v m="$xmax" 'BEGIN { printf "%.0f", m }')"
containerd="$(meta_get containerd)"
commit="$(meta_get commit)"
title="imgbridge soak: seed ${seed:-?}, ${minutes} min, containerd ${containerd:-?}${commit:+, commit $commit}"
subtitle="$nfaults faults, $(stat restarts) imgbridge restarts; RSS last $(stat rss) MiB (peak $(stat rss_peak)); fds last $(stat fds) (peak $(stat fds_peak)); threads last $(stat threads) (peak $(stat threads_peak))"
title="$(clean "$title")"
subtitle="$(clean "$subtitle")"

# ---------------------------------------------------------------- gnuplot
if gnuplot -e 'set terminal pngcairo' </dev/null >/dev/null 2>&1; then
    term='set terminal pngcairo size 1200,1100 font "sans,10" noenhanced'
else
    term='set terminal png size 1200,1100 noenhanced'
fi

cat >"$tmp/soak.gp" <<EOF
$term
set output "$tmp/soak.png"
set datafile separator "\t"
set datafile missing "NaN"
# Each panel also plots an invisible 0: a panel whose series are all
# missing (-) is then an empty panel, not an error.
set multiplot title "$title\n$subtitle"
load "$tmp/faults.gp"
set xrange [0:$xmax]
set grid xtics ytics lc rgb "#dddddd" lt 1
set border lc rgb "#444444"
set lmargin at screen 0.07
set rmargin at screen 0.76
set key left top Left reverse samplen 2 spacing 1.1 box lc rgb "#bbbbbb"
set format x ""
set xtics nomirror
set ytics nomirror

# (a) RSS
set tmargin at screen 0.92
set bmargin at screen 0.65
set key at screen 0.80, screen 0.92
set ylabel "imgbridge RSS (MiB)"
set yrange [0:*]
plot 0 lt nodraw notitle, \
     "$tmp/samples.dat" using 1:2 with lines lw 2 lc rgb "#000000" title "RSS (MiB)"$(cat "$tmp/keys.gp")

# (b) descriptors, tokio tasks, threads
set tmargin at screen 0.635
set bmargin at screen 0.365
set key at screen 0.80, screen 0.635
set ylabel "open descriptors, tokio tasks"
set y2label "threads" tc rgb "#1a9850"
set y2tics tc rgb "#1a9850"
set yrange [0:*]
set y2range [0:*]
plot 0 lt nodraw notitle, 0 axes x1y2 lt nodraw notitle, \
     "$tmp/samples.dat" using 1:3 with steps lw 1.2 lc rgb "#000000" title "open fds", \
     "" using 1:8 with steps lw 1.2 lc rgb "#984ea3" title "tokio tasks", \
     "" using 1:4 axes x1y2 with steps lw 1.2 lc rgb "#1a9850" title "threads (right axis)"
unset y2label
unset y2tics

# (c) leases, ingests
set tmargin at screen 0.35
set bmargin at screen 0.08
set key at screen 0.80, screen 0.35
set format x "%g"
set xlabel "minutes since start"
set ylabel "containerd (count)"
set yrange [0:*]
plot 0 lt nodraw notitle, \
     "$tmp/samples.dat" using 1:5 with steps lw 1.2 lc rgb "#000000" title "leases (but buildkitd's cache and history)", \
     "" using 1:6 with steps lw 1.2 dt 2 lc rgb "#404040" title "leases of imgbridge", \
     "" using 1:7 with steps lw 1.2 lc rgb "#1a9850" title "active ingests"
unset multiplot
EOF

if ! gnuplot "$tmp/soak.gp" 2> >(grep -vE 'Skipping data file with no valid points|empty y2? range' >&2); then
    cp "$tmp/soak.gp" "$dir/soak-plot.gp.failed" 2>/dev/null || true
    die "gnuplot failed (its script: $dir/soak-plot.gp.failed)"
fi
mv "$tmp/soak.png" "$png"
echo "$png"
