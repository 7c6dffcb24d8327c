#!/usr/bin/env python3
"""Oracle for the demo's trained pair (data/demo-model/), run by tests/demo_model.rs.

  merge   --base DIR --adapter DIR --out FILE
          PEFT's merge: the bf16 base loaded with transformers, the adapter with
          PeftModel.from_pretrained (defaults: factors held in float32), then
          merge_and_unload(); writes the merged state dict (bf16) as one safetensors
          file, under the base's tensor names.
  answers --model DIR [--adapter DIR] --records FILE --out FILE
          transformers' forward (float32 compute on the stored bf16 weights, eager
          attention, the library's own Gated DeltaNet path), one record at a time: the
          logits of each record's option tokens at the last prompt position, in the
          answers format (docs/evaluation.md). With --adapter, PEFT applies it unmerged.

Versions: scripts/requirements-clients.txt. CPU only, 1 thread, deterministic.
"""

import argparse
import json

import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

torch.set_num_threads(1)


def load(model_dir, dtype):
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.config._attn_implementation = "eager"
    return model.eval()


def merge(args):
    model = load(args.base, torch.bfloat16)
    peft_model = PeftModel.from_pretrained(model, args.adapter)
    merged = peft_model.merge_and_unload()
    state = {k: v.contiguous() for k, v in merged.state_dict().items()}
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    save_file(state, args.out, metadata={"format": "pt"})


@torch.no_grad()
def answers(args):
    model = load(args.model, torch.float32)
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter).eval()
    with open(args.records) as f, open(args.out, "w") as out:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            logits = model(input_ids=torch.tensor([r["tokens"]])).logits[0, -1].float()
            out.write(json.dumps({
                "id": r["id"],
                "group": r.get("group"),
                "options": r["options"],
                "logits": [float(logits[t]) for t in r["option_tokens"]],
                "gold": r.get("gold"),
            }) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--base", required=True)
    m.add_argument("--adapter", required=True)
    m.add_argument("--out", required=True)
    a = sub.add_parser("answers")
    a.add_argument("--model", required=True)
    a.add_argument("--adapter")
    a.add_argument("--records", required=True)
    a.add_argument("--out", required=True)
    args = ap.parse_args()
    {"merge": merge, "answers": answers}[args.command](args)


if __name__ == "__main__":
    main()
