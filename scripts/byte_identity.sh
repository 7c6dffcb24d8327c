#!/usr/bin/env bash
# Byte-identity check of a loraq binary: synthesizes the tiny model pair, quantizes its
# base in every scheme and layout, extracts the adapter, and runs the forward pass on
# every base (with and without --act-quant, each linear backend), then prints the
# sha256 of every output file. Run it with two binaries and diff the two listings to
# show a change leaves checkpoints, adapters and answers byte for byte as they were.
#
#   scripts/byte_identity.sh LORAQ_BINARY WORK_DIR > hashes.txt
#
# Lines are `sha256  relative/path`; a command that fails prints `FAILED <what>` (a
# refusal is an outcome too, and must match between the binaries).
set -uo pipefail
LORAQ="${1:?usage: byte_identity.sh LORAQ_BINARY WORK_DIR}"
WORK="${2:?usage: byte_identity.sh LORAQ_BINARY WORK_DIR}"
SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf "$WORK"
mkdir -p "$WORK"
cd "$WORK" || exit 1
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-2}"

run() { # $1 label, rest: the command
    local label="$1"
    shift
    if ! "$LORAQ" "$@" > /dev/null 2> "$label.stderr"; then
        echo "FAILED $label: $(tail -n 1 "$label.stderr")"
    fi
}

run synth synth --preset tiny --out pair --seed 3
VOCAB=$(python3 -c 'import json,sys; c=json.load(open("pair/base/config.json")); print(c.get("text_config", c)["vocab_size"])')
"$SCRIPTS/random_records.sh" "$VOCAB" > records.jsonl

# --base-id: the adapter config otherwise names the base by its absolute path.
run extract extract --merged pair/merged --base pair/base --out adapter --rank 8 \
    --base-id loraq/synth-tiny
run stats run --model pair/merged --records records.jsonl --out stats-answers.jsonl \
    --collect-stats stats.safetensors

bases=()
quantize() { # $1 name, rest: quantize options
    local name="$1"
    shift
    run "quantize-$name" quantize --in pair/base --out "base-$name" "$@"
    bases+=("$name")
}
quantize fp8-block128 --scheme fp8-block128
quantize fp8-tensor --scheme fp8-tensor
quantize fp8-channel-ct --scheme fp8-channel
quantize nvfp4-modelopt --scheme nvfp4
quantize nvfp4-ct --scheme nvfp4 --layout nvfp4-ct
quantize nvfp4-modelopt-w4a4 --scheme nvfp4 --calibration stats.safetensors
quantize nvfp4-ct-w4a4 --scheme nvfp4 --layout nvfp4-ct --calibration stats.safetensors
quantize mxfp4 --scheme mxfp4
quantize int4-sym --scheme int4-g128-sym
quantize int4-asym --scheme int4-g128-asym
quantize fp8-block128-emulated --scheme fp8-block128 --layout bf16-emulated
quantize nvfp4-emulated --scheme nvfp4 --layout bf16-emulated
for scheme in fp8-block128 nvfp4 int4-g128-asym; do
    "$LORAQ" quant-error --base pair/base --merged pair/merged --adapter adapter \
        --scheme "$scheme" --json > "quant-error-$scheme.json" 2> /dev/null \
        || echo "FAILED quant-error $scheme"
done

mkdir -p answers
run answers-merged run --model pair/merged --records records.jsonl --out answers/merged.jsonl
for base in base "${bases[@]}"; do
    dir="base-$base"
    [[ "$base" == base ]] && dir=pair/base
    for backend in ${BACKENDS:-dense kernels}; do
        for act in none fp8 fp8-group nvfp4; do
            run "answers-$base-$backend-$act" run --model "$dir" --adapter adapter \
                --records records.jsonl --backend "$backend" --act-quant "$act" \
                --out "answers/$base-$backend-$act.jsonl"
        done
    done
done

find . -type f ! -name '*.stderr' -print0 | sort -z | xargs -0 sha256sum
