#!/usr/bin/env bash
# Plain vs quantization-aware adapter on Qwen3.5-9B layer shapes (issue 8).
#
# Synthesizes the 9b-slice pair (hidden 4096, intermediate 12288, one linear-attention
# and one attention layer, a rank-256 LoRA merged in bf16), extracts the plain
# adapter, quantizes the base, collects calibration statistics on the merged model
# with prompts that are not the questions, extracts the quantization-aware adapter at
# the same rank (and, with EXTRA_RANK > 0, one with more rank), runs the questions
# through the merged reference and the adapters on the quantized base, and compares
# each with the reference. The comparison tables go to stdout; every output stays
# under $OUT. The slices keep a 2048-token vocabulary; questions are random prompts
# with four random option tokens each (no gold: accuracy is not reported).
#
# Usage (from the repository root, after `cargo build --release`):
#   scripts/qa-9b-slice.sh
# Environment (defaults): LORAQ (target/release/loraq), OUT (qa-9b-slice-out),
#   SCHEMES ("nvfp4"; any of fp8-block128 nvfp4 int4-g128), QUESTIONS (120),
#   CALIBRATION (48), EXTRA_RANK (0; rank 256 + EXTRA_RANK must be at most 512),
#   THREADS (unset: all cores).
# Disk: about 4 GB under $OUT. Time on 2 cores: tens of minutes (most of it `run`).
set -euo pipefail

LORAQ="${LORAQ:-target/release/loraq}"
OUT="${OUT:-qa-9b-slice-out}"
SCHEMES="${SCHEMES:-nvfp4}"
QUESTIONS="${QUESTIONS:-120}"
CALIBRATION="${CALIBRATION:-48}"
EXTRA_RANK="${EXTRA_RANK:-0}"
RANK=256
VOCAB=2048
PROMPT_TOKENS=20
threads=()
if [[ -n "${THREADS:-}" ]]; then threads=(--threads "$THREADS"); fi

say() { echo "+ $*" >&2; "$@"; }

# Random prompts (awk's seeded generator: deterministic for a given awk) with four
# distinct option tokens each: $1 records, $2 seed, $3 id prefix.
records() {
    awk -v n="$1" -v seed="$2" -v prefix="$3" -v vocab="$VOCAB" -v len="$PROMPT_TOKENS" '
    BEGIN {
        srand(seed)
        for (i = 0; i < n; i++) {
            line = sprintf("{\"id\":\"%s%04d\",\"tokens\":[", prefix, i)
            for (t = 0; t < len; t++) line = line (t ? "," : "") int(rand() * vocab)
            split("", used); opts = ""
            for (k = 0; k < 4; k++) {
                do { o = int(rand() * vocab) } while (o in used)
                used[o] = 1; opts = opts (k ? "," : "") o
            }
            print line "],\"options\":[\"A\",\"B\",\"C\",\"D\"],\"option_tokens\":[" opts "]}"
        }
    }'
}

mkdir -p "$OUT"
pair="$OUT/pair"
if [[ ! -d "$pair/merged" ]]; then
    say "$LORAQ" synth --preset 9b-slice --out "$pair" --seed 0
fi
if [[ ! -d "$OUT/adapter" ]]; then
    say "$LORAQ" extract --merged "$pair/merged" --base "$pair/base" --out "$OUT/adapter" --rank "$RANK"
fi
records "$QUESTIONS" 1 q > "$OUT/questions.jsonl"
records "$CALIBRATION" 2 c > "$OUT/calibration.jsonl"
say "$LORAQ" run --force "${threads[@]}" --model "$pair/merged" --records "$OUT/calibration.jsonl" \
    --out "$OUT/calibration-answers.jsonl" --collect-stats "$OUT/calibration.safetensors"
mkdir -p "$OUT/answers"
say "$LORAQ" run --force "${threads[@]}" --model "$pair/merged" --records "$OUT/questions.jsonl" \
    --out "$OUT/answers/merged.jsonl"

compare() { # $1 label, $2 answers file
    echo
    echo "== $1 (vs the merged reference)"
    "$LORAQ" compare --force --reference "$OUT/answers/merged.jsonl" --candidate "$2" \
        --json "${2%.jsonl}.compare.json"
}

for scheme in $SCHEMES; do
    quantized="$OUT/base-$scheme"
    if [[ ! -d "$quantized" ]]; then
        say "$LORAQ" quantize --in "$pair/base" --out "$quantized" --scheme "$scheme"
    fi
    act=()
    if [[ "$scheme" == fp8-block128 ]]; then act=(--act-quant fp8-group); fi
    extras=(0)
    if [[ "$EXTRA_RANK" != 0 ]]; then extras+=("$EXTRA_RANK"); fi
    for extra in "${extras[@]}"; do
        qa="$OUT/adapter-qa-$scheme-extra$extra"
        if [[ ! -d "$qa" ]]; then
            say "$LORAQ" extract --merged "$pair/merged" --base "$pair/base" --out "$qa" \
                --rank "$RANK" --target-base "$quantized" \
                --calibration "$OUT/calibration.safetensors" --extra-rank "$extra"
        fi
    done
    say "$LORAQ" run --force "${threads[@]}" --model "$quantized" --adapter "$OUT/adapter" "${act[@]}" \
        --records "$OUT/questions.jsonl" --out "$OUT/answers/$scheme-plain.jsonl"
    for extra in "${extras[@]}"; do
        say "$LORAQ" run --force "${threads[@]}" --model "$quantized" \
            --adapter "$OUT/adapter-qa-$scheme-extra$extra" "${act[@]}" \
            --records "$OUT/questions.jsonl" --out "$OUT/answers/$scheme-qa-extra$extra.jsonl"
    done
    compare "$scheme base + plain adapter (rank $RANK)" "$OUT/answers/$scheme-plain.jsonl"
    for extra in "${extras[@]}"; do
        compare "$scheme base + quantization-aware adapter (rank $RANK + $extra)" \
            "$OUT/answers/$scheme-qa-extra$extra.jsonl"
    done
done
