#!/usr/bin/env bash
# Prefill speed of `loraq run` beside transformers on the same model and records, at
# 20, 512 and 4096 tokens per prompt: the demo-sized model (`loraq synth --preset demo`,
# merged weights, no adapter), transformers 5.24 in float32 with eager attention
# (`scripts/model_oracle.py bench`), both on THREADS threads, run alternately ROUNDS
# times so both see the same load; each line gives tokens/s, the ratio and the load
# average at that moment. With OLD_LORAQ=path/to/another/loraq it also times that binary
# in the same rotation (new/old ratios under load, when an idle machine is not at hand).
#
#   benches/prefill_vs_transformers.sh                      # a few minutes on 2 cores
#   ROUNDS=3 THREADS=2 OLD_LORAQ=/tmp/loraq-main benches/prefill_vs_transformers.sh
#
# Environment: LORAQ (default target/release/loraq, built first), LORAQ_ORACLE_PYTHON
# (a Python with scripts/requirements-model.txt; default python3), THREADS (2), ROUNDS
# (2), LENGTHS ("20:240 512:16 4096:2", tokens per prompt : prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
LORAQ=${LORAQ:-target/release/loraq}
PYTHON=${LORAQ_ORACLE_PYTHON:-python3}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
LENGTHS=${LENGTHS:-"20:240 512:16 4096:2"}
OLD_LORAQ=${OLD_LORAQ:-}
[ -x "$LORAQ" ] || cargo build --release --bin loraq
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$LORAQ" synth --preset demo --out "$work/pair" >/dev/null
model="$work/pair/merged"
for spec in $LENGTHS; do
    "$PYTHON" - "$spec" "$work/records-${spec%%:*}.jsonl" <<'PY'
import json, sys
length, count = map(int, sys.argv[1].split(":"))
state = 12345
with open(sys.argv[2], "w") as f:
    for i in range(count):
        tokens = []
        for _ in range(length):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            tokens.append((state >> 33) % 4096)
        f.write(json.dumps({"id": f"p{i}", "tokens": tokens, "options": ["A", "B", "C", "D"],
                            "option_tokens": [11, 12, 13, 14]}) + "\n")
PY
done

# tokens/s that `loraq run` prints on stderr.
loraq_rate() {
    "$1" run --model "$model" --records "$2" --out "$work/answers.jsonl" --force \
        --threads "$THREADS" 2>&1 >/dev/null | sed -n 's/.*s, \([0-9.]*\) tokens\/s).*/\1/p' | tail -1
}
transformers_rate() {
    "$PYTHON" scripts/model_oracle.py bench --model "$model" --records "$1" --threads "$THREADS" 2>/dev/null \
        | sed -n 's/.*(\([0-9.]*\) tokens\/s.*/\1/p'
}
load() { cut -d' ' -f1-3 /proc/loadavg; }

printf '%-6s %-7s %12s %12s %8s' tokens prompts "loraq tok/s" "tf tok/s" ratio
[ -n "$OLD_LORAQ" ] && printf ' %12s %8s' "old tok/s" new/old
printf '   load average\n'
for round in $(seq "$ROUNDS"); do
    for spec in $LENGTHS; do
        length=${spec%%:*} count=${spec##*:}
        records="$work/records-$length.jsonl"
        ours=$(loraq_rate "$LORAQ" "$records")
        old=""
        [ -n "$OLD_LORAQ" ] && old=$(loraq_rate "$OLD_LORAQ" "$records")
        theirs=$(transformers_rate "$records")
        printf '%-6s %-7s %12s %12s %8.2f' "$length" "$count" "$ours" "$theirs" \
            "$(awk -v a="$ours" -v b="$theirs" 'BEGIN { print a / b }')"
        [ -n "$OLD_LORAQ" ] && printf ' %12s %8.2f' "$old" "$(awk -v a="$ours" -v b="$old" 'BEGIN { print a / b }')"
        printf '   %s (round %s)\n' "$(load)" "$round"
    done
done
