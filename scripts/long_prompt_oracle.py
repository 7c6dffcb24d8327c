#!/usr/bin/env python3
"""Option logits of records by transformers (float32, eager attention), for prompts
longer than one of loraq's attention blocks (512 tokens): the oracle of
tests/long_prompt_parity.rs.

Usage: long_prompt_oracle.py MODEL_DIR RECORDS.jsonl  -> answers JSON Lines on stdout.
Versions: scripts/requirements-clients.txt.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, records = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with open(records) as f, torch.no_grad():
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            logits = model(input_ids=torch.tensor([r["tokens"]])).logits[0, -1]
            print(
                json.dumps(
                    {
                        "id": r["id"],
                        "options": r["options"],
                        "logits": [float(logits[t]) for t in r["option_tokens"]],
                    }
                )
            )


if __name__ == "__main__":
    main()
