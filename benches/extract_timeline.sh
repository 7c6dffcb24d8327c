#!/usr/bin/env bash
# Where a `loraq extract` run's wall time goes: runs it with LORAQ_EXTRACT_TIMELINE=1
# (crates/loraq-extract/src/timeline.rs) and sums the spans by kind: the first-block
# scan, the rest of the scan (on its own thread, overlapping the factoring), the pair
# reads (the reader thread), the factoring's waits for the reader, the modules'
# factoring and the writing. Reading is overlapped when the waits are near zero.
#
#   benches/extract_timeline.sh [--cold] LORAQ_EXTRACT_ARGS...
#
# --cold drops the page cache first (root: sync; echo 3 > /proc/sys/vm/drop_caches).
# Prints the summary and the bytes the disk read during the run (/proc/diskstats).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LORAQ="${LORAQ:-$ROOT/target/release/loraq}"
if [ "${1:-}" = "--cold" ]; then
    shift
    sync
    echo 3 > /proc/sys/vm/drop_caches
fi
LINES="$(mktemp)"
trap 'rm -f "$LINES"' EXIT
read_sectors() { awk '$4 ~ /^[0-9]+$/ && $3 !~ /[0-9]$/ { s += $6 } END { print s + 0 }' /proc/diskstats; }
before="$(read_sectors)"
LORAQ_EXTRACT_TIMELINE=1 /usr/bin/time -f 'wall %e s, user %U s, sys %S s, peak RSS %M KB' \
    "$LORAQ" extract "$@" 2> "$LINES" > /dev/null
after="$(read_sectors)"
grep -v '^timeline ' "$LINES" | tail -n 1
awk '/^timeline / {
    kind = $6; for (i = 7; i <= NF && $i !~ /[.0-9]/; i++) kind = kind " " $i
    seconds[kind] += $4 - $3; count[kind]++; if ($5 != "-") cpu[kind] += $5
    if ($4 > end) end = $4
} END {
    for (k in seconds) printf "%-22s %4d spans %9.3f s wall %9.3f s CPU of its thread\n", k, count[k], seconds[k], cpu[k]
    printf "last span ends at %.3f s\n", end
}' "$LINES" | sort
awk -v a="$before" -v b="$after" 'BEGIN { printf "disk read during the run: %.0f MB (all devices)\n", (b - a) * 512 / 1e6 }'
