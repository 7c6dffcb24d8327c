#!/usr/bin/env python3
"""Oracle for `loraq run --collect-stats` (crates/loraq-model, issue 8).

Loads the committed tiny random Qwen3.5 fixture of scripts/model_oracle.py
(tests/data/model/qwen3_5, bf16 weights computed in float32) with transformers, and
the same model with its PEFT LoRA (tests/data/model/qwen3_5-lora) with PEFT; runs
every prompt of tests/data/model/records.jsonl through it, one record at a time as
`loraq run` does, with a forward pre-hook on every linear the decoder layers run
(everything but lm_head; under PEFT, the LoRA layer that wraps the base linear, so
the hook sees the input both paths read), and accumulates sum x_k^2 per input
feature in float64 and the largest |x| (the amax of a static activation scale).

Writes, as safetensors with float64 values and the calibration file's metadata:
  tests/data/model/calibration-qwen3_5.safetensors
  tests/data/model/calibration-qwen3_5-lora.safetensors
one tensor `<module path>.input_sq_mean` [in_features] per linear: the mean over
all tokens of x_k^2 (module paths as in the checkpoint, e.g.
model.layers.0.linear_attn.in_proj_qkv), and one `<module path>.input_abs_max` []:
the largest |x| over all tokens and features (calibration file version 2).

Versions: scripts/requirements-model.txt (torch 2.15.0, transformers 5.24.0, peft
0.21.2, safetensors 0.8.0). Run from the repository root:
    python scripts/calibration_oracle.py
"""

import json
import os

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

DATA = "tests/data/model"
torch.set_num_threads(1)


def collect(model, linears, records):
    """Runs every record; returns {module path: mean x^2 (float64)},
    {module path: max |x| (float64)}, token count."""
    sums = {}
    counts = {}
    amax = {}

    def hook(name):
        def pre_hook(_module, args):
            x = args[0].detach().to(torch.float64).reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            amax[name] = torch.maximum(amax.get(name, torch.tensor(0.0, dtype=torch.float64)), x.abs().max())

        return pre_hook

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears]
    tokens = 0
    with torch.no_grad():
        for r in records:
            model(input_ids=torch.tensor([r["tokens"]]), use_cache=False)
            tokens += len(r["tokens"])
    for h in handles:
        h.remove()
    assert len(sums) == len(linears), "a linear never ran"
    assert all(c == tokens for c in counts.values()), (counts, tokens)
    return {name: sums[name] / tokens for name in sums}, amax, tokens


def save(path, means, amax, tokens, records):
    tensors = {f"{name}.input_sq_mean": v.contiguous() for name, v in means.items()}
    tensors.update({f"{name}.input_abs_max": v.reshape(()).contiguous() for name, v in amax.items()})
    save_file(
        tensors,
        path,
        metadata={
            "format": "loraq-calibration",
            "version": "2",
            "tokens": str(tokens),
            "records": str(records),
        },
    )
    print(f"{path}: {len(means)} modules, {tokens} tokens")


def main():
    records = [json.loads(line) for line in open(os.path.join(DATA, "records.jsonl")) if line.strip()]
    model = Qwen3_5ForCausalLM.from_pretrained(
        os.path.join(DATA, "qwen3_5"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    ]
    # 2 linear-attention layers (5 linears), 2 attention layers (4), 4 MLPs (3).
    assert len(linears) == 2 * 5 + 2 * 4 + 4 * 3, [n for n, _ in linears]
    means, amax, tokens = collect(model, linears, records)
    save(os.path.join(DATA, "calibration-qwen3_5.safetensors"), means, amax, tokens, len(records))

    peft_model = PeftModel.from_pretrained(model, os.path.join(DATA, "qwen3_5-lora")).eval()
    prefix = "base_model.model."
    lora_linears = [
        (name.removeprefix(prefix), m)
        for name, m in peft_model.named_modules()
        if isinstance(m, LoraLayer)
    ]
    assert len(lora_linears) == len(linears), [n for n, _ in lora_linears]
    means, amax, tokens = collect(peft_model, lora_linears, records)
    save(os.path.join(DATA, "calibration-qwen3_5-lora.safetensors"), means, amax, tokens, len(records))


if __name__ == "__main__":
    main()
