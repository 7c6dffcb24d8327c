#!/usr/bin/env python3
"""Loads an adapter written by `loraq extract` with the real PEFT and transformers, and
checks that it applies: every tensor, nothing dropped with a warning, the merge's logits.

    python scripts/peft_load_check.py --base B --merged M --adapter A \
        --class auto|checkpoint --exact PEFT_ADAPTER

--class auto loads the base as `AutoModelForCausalLM.from_pretrained(B)` (transformers
5.x: the text-only Qwen3_5ForCausalLM, modules `model.layers.*`); --class checkpoint
with the checkpoint's own class (config.json "architectures", e.g.
Qwen3_5ForConditionalGeneration, modules `model.language_model.layers.*`). Then
`PeftModel.from_pretrained(base, A)`, as a user would, and fails (exit status 1) when:

- PEFT or transformers warns while loading the adapter (PEFT reports an adapter whose
  names match no module only by the warning "Found missing adapter keys" and leaves
  LoRA B at zero, so a warning is a failure here). Deprecation notices
  (FutureWarning / DeprecationWarning) about library internals are listed, not failed;
- a lora_A / lora_B tensor of the file is not in the loaded model bit for bit, the
  model holds LoRA layers the file does not fill, a lora_B is zero, or a module's scale
  is not 1 (alpha = rank: rank_pattern / alpha_pattern keys that match nothing would
  leave r and alpha at their defaults);
- the logits of base + adapter are farther from the merged model's (same class, same
  prompts, f32 on the CPU) than 1.5 x those of base + the exact adapter the merge was
  made from (PEFT's own, f32 factors; --exact), or not 20 x closer than the base alone.
  Why that tolerance: the merge was rounded to bf16, so no adapter reproduces it better
  than the exact one does; an extraction at the bf16 floor lands within a small factor
  of it, and an adapter that is not applied stays as far as the base.

Prints the figures as one JSON object. Versions: scripts/requirements-clients.txt.
"""

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings

import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)
PROMPT_LENGTHS = (1, 3, 8, 21, 40)
# Token ids below every special id of the fixtures' 128-entry vocabulary (image / video
# / vision start and end are 124-127), so no prompt touches the vision path.
PROMPT_VOCAB = 120
TOLERANCE_OVER_EXACT = 1.5
BASE_OVER_ADAPTER = 20.0


def model_class(kind, base_dir):
    if kind == "auto":
        return transformers.AutoModelForCausalLM
    with open(os.path.join(base_dir, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    return getattr(transformers, architecture)


def load_f32(cls, path):
    model = cls.from_pretrained(path, dtype=torch.bfloat16)
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "text_config"):
        model.config.text_config._attn_implementation = "eager"
    return model.to(torch.float32).eval()


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")


def load_adapter(model, adapter):
    """PeftModel.from_pretrained with every warning and logged warning captured."""
    handler = Captured()
    loggers = [logging.getLogger(n) for n in ("peft", "transformers")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = PeftModel.from_pretrained(model, adapter).eval()
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    deprecations = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
    ]
    failures = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, (FutureWarning, DeprecationWarning))
    ] + handler.records
    return loaded, failures, deprecations


def check_tensors(model, adapter):
    """Every factor of the file is in the loaded model bit for bit; every LoRA layer of
    the model is filled, non-zero, at scale 1. Returns (applied modules, problems)."""
    problems = []
    stored = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    state = model.state_dict()
    for key, value in stored.items():
        for factor in ("lora_A", "lora_B"):
            suffix = f".{factor}.weight"
            if key.endswith(suffix):
                loaded_key = key[: -len(suffix)] + f".{factor}.default.weight"
                break
        else:
            problems.append(f"{key}: not a LoRA factor")
            continue
        if loaded_key not in state:
            problems.append(f"{key}: not in the loaded model")
        elif not torch.equal(state[loaded_key].to(torch.float32), value.to(torch.float32)):
            problems.append(f"{key}: loaded values differ from the file")
    modules = {k[: -len(".lora_A.weight")] for k in stored if k.endswith(".lora_A.weight")}
    applied = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_B") or "default" not in getattr(module, "lora_B", {}):
            continue
        b = module.lora_B["default"].weight
        full = f"{name}"
        if full not in modules:
            problems.append(f"{full}: a LoRA layer the file does not fill")
            continue
        if not bool(b.abs().max() > 0):
            problems.append(f"{full}: lora_B is zero in the loaded model")
        scale = module.scaling["default"]
        if scale != 1.0:
            problems.append(f"{full}: scale {scale} (r {module.r['default']}), expected 1")
        applied += 1
    if applied != len(modules):
        problems.append(f"{applied} LoRA layers in the model, {len(modules)} modules in the file")
    return applied, len(modules), problems


def renamed_to_text(adapter, out):
    """A copy of a PEFT adapter in `model.layers.*` names (for the exact reference on
    the text-only class)."""
    os.makedirs(out)
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    renamed = {
        k.replace("base_model.model.model.language_model.", "base_model.model.model."): v
        for k, v in tensors.items()
    }
    save_file(renamed, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(adapter, "adapter_config.json"), out)
    return out


@torch.no_grad()
def logits(model, prompts):
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--exact", required=True, help="the PEFT adapter the merge was made from")
    ap.add_argument("--class", dest="kind", choices=["auto", "checkpoint"], required=True)
    args = ap.parse_args()

    cls = model_class(args.kind, args.base)
    base_model = load_f32(cls, args.base)
    module_names = [n for n, _ in base_model.named_modules()]
    with_adapter, warned, deprecations = load_adapter(base_model, args.adapter)
    applied, in_file, problems = check_tensors(with_adapter, args.adapter)

    gen = torch.Generator().manual_seed(15)
    prompts = [torch.randint(0, PROMPT_VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    merged = logits(load_f32(cls, args.merged), prompts)
    got = logits(with_adapter, prompts)
    plain = logits(load_f32(cls, args.base), prompts)
    with tempfile.TemporaryDirectory() as tmp:
        exact_dir = args.exact
        if args.kind == "auto":
            exact_dir = renamed_to_text(args.exact, os.path.join(tmp, "exact"))
        exact_model, exact_warned, _ = load_adapter(load_f32(cls, args.base), exact_dir)
        exact = logits(exact_model, prompts)
    diff = (got - merged).abs().max().item()
    exact_diff = (exact - merged).abs().max().item()
    base_diff = (plain - merged).abs().max().item()
    figures = {
        "class": type(base_model).__name__,
        "first_module": next((n for n in module_names if n.endswith("mlp.up_proj")), None),
        "modules_in_file": in_file,
        "lora_layers_applied": applied,
        "warnings": warned,
        "deprecations_ignored": deprecations,
        "problems": problems,
        "prompts": len(prompts),
        "max_abs_logit_diff_adapter_vs_merged": diff,
        "max_abs_logit_diff_exact_adapter_vs_merged": exact_diff,
        "max_abs_logit_diff_base_vs_merged": base_diff,
        "tolerance": TOLERANCE_OVER_EXACT * exact_diff,
        "max_abs_logit": merged.abs().max().item(),
        "same_top_token": (got.argmax(-1) == merged.argmax(-1)).float().mean().item(),
    }
    print(json.dumps(figures, indent=1))
    failures = list(warned) + problems + [f"exact reference: {w}" for w in exact_warned]
    if diff > TOLERANCE_OVER_EXACT * exact_diff:
        failures.append(f"logits {diff:.3e} from the merge, over {TOLERANCE_OVER_EXACT} x the exact adapter's {exact_diff:.3e}")
    if diff * BASE_OVER_ADAPTER > base_diff:
        failures.append(f"logits {diff:.3e} from the merge: not {BASE_OVER_ADAPTER} x closer than the base alone ({base_diff:.3e})")
    if failures:
        print("FAILED:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
