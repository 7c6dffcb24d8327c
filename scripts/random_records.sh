#!/usr/bin/env bash
# Prints 24 deterministic four-option answer records (12-token prompts, four distinct
# option tokens) over a vocabulary of VOCAB tokens, in the records format `loraq run`
# reads (docs/evaluation.md). scripts/byte_identity.sh and scripts/gpu-check.sh score
# them on the tiny synthetic model.
#
#   scripts/random_records.sh VOCAB > records.jsonl
set -euo pipefail
VOCAB="${1:?usage: random_records.sh VOCAB}"
awk -v vocab="$VOCAB" 'BEGIN {
    srand(7)
    for (i = 0; i < 24; i++) {
        line = sprintf("{\"id\":\"q%02d\",\"tokens\":[", i)
        for (t = 0; t < 12; t++) line = line (t ? "," : "") int(rand() * vocab)
        split("", used); opts = ""
        for (k = 0; k < 4; k++) {
            do { o = int(rand() * vocab) } while (o in used)
            used[o] = 1; opts = opts (k ? "," : "") o
        }
        print line "],\"options\":[\"A\",\"B\",\"C\",\"D\"],\"option_tokens\":[" opts "]}"
    }
}'
