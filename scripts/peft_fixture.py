#!/usr/bin/env python3
"""A fixture made by the real client, for `loraq extract` (issue 3).

1. A tiny random Qwen3.5 text model from transformers (both layer types), rounded to
   bf16, saved as tests/data/peft/base.
2. A PEFT LoRA (r = 8, alpha = 16, every linear incl. in_proj_a / in_proj_b, whose
   4 rows are narrower than r) with non-zero B, saved as tests/data/peft/peft-adapter,
   then merged by PEFT's merge_and_unload and saved in bf16 as tests/data/peft/merged.
3. With `--loraq BIN`: runs `loraq extract` on the pair and checks that
   `PeftModel.from_pretrained` loads our adapter directory and reproduces the merged
   model's logits; writes the figures to tests/data/peft/peft_check.json.

Versions: scripts/requirements-model.txt (torch, transformers, peft). Run once from
the repository root: python scripts/peft_fixture.py --loraq target/release/loraq
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import model_oracle  # scripts/model_oracle.py: the same random scales

OUT = "tests/data/peft"
VOCAB = 128
torch.set_num_threads(1)


def config():
    c = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )
    c._attn_implementation = "eager"
    return c


def randomize(model, gen):
    """The parity fixtures' scales (scripts/model_oracle.py), rounded to bf16."""
    model_oracle.randomize(model, gen)
    model_oracle.bf16_exact(model)


def save_bf16(model, path):
    shutil.rmtree(path, ignore_errors=True)
    # A bf16 copy: converting the model itself would round its rotary buffers too.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for extra in ["generation_config.json", "README.md"]:
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))


def load_f32(path):
    model = Qwen3_5ForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    model.config._attn_implementation = "eager"
    return model.to(torch.float32).eval()


@torch.no_grad()
def logits(model, prompts):
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loraq", help="loraq binary: also extract and check with PEFT")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    gen = torch.Generator().manual_seed(7)

    base = Qwen3_5ForCausalLM(config()).eval()
    randomize(base, gen)
    save_bf16(base, os.path.join(OUT, "base"))

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=[
            "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(copy.deepcopy(base), lora).eval()
    with torch.no_grad():
        # A delta of a few tens of bf16 ulps of the N(0, 1/in) weights, as a fine-tune
        # leaves: scale * B A has entries of RMS about 0.08 / sqrt(in).
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif "lora_B" in name:
                in_features = dict(peft_model.named_parameters())[name.replace("lora_B", "lora_A")].shape[1]
                p.normal_(0.0, 0.04 / (8 * in_features) ** 0.5, generator=gen)
    adapter_dir = os.path.join(OUT, "peft-adapter")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    if os.path.exists(os.path.join(adapter_dir, "README.md")):
        os.remove(os.path.join(adapter_dir, "README.md"))
    merged = peft_model.merge_and_unload()
    save_bf16(merged, os.path.join(OUT, "merged"))
    print("wrote", OUT)

    if not args.loraq:
        return
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 3, 8, 21, 40)]
    merged_model = load_f32(os.path.join(OUT, "merged"))
    with tempfile.TemporaryDirectory() as tmp:
        ours = os.path.join(tmp, "adapter")
        subprocess.run(
            [args.loraq, "extract", "--merged", os.path.join(OUT, "merged"), "--base",
             os.path.join(OUT, "base"), "--out", ours, "--rank", "8"],
            check=True,
        )
        with_ours = PeftModel.from_pretrained(load_f32(os.path.join(OUT, "base")), ours).eval()
        ref = logits(merged_model, prompts)
        got = logits(with_ours, prompts)
        plain = logits(load_f32(os.path.join(OUT, "base")), prompts)
        # PEFT's own adapter (f32 factors) on the base: what the merge's bf16 rounding
        # alone leaves between an exact adapter and the merged release.
        theirs = PeftModel.from_pretrained(load_f32(os.path.join(OUT, "base")), adapter_dir).eval()
        exact = logits(theirs, prompts)
    diff = (got - ref).abs().max().item()
    exact_diff = (exact - ref).abs().max().item()
    base_diff = (plain - ref).abs().max().item()
    same_top = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    check = {
        "prompts": len(prompts),
        "max_abs_logit_diff_peft_with_loraq_adapter_vs_merged": diff,
        "max_abs_logit_diff_peft_with_its_own_adapter_vs_merged": exact_diff,
        "max_abs_logit_diff_base_without_adapter_vs_merged": base_diff,
        "max_abs_logit": ref.abs().max().item(),
        "same_top_token": same_top,
    }
    print(json.dumps(check, indent=1))
    # Ours must be as close to the merge as PEFT's own exact adapter is (both are
    # limited by the merge's bf16 rounding), and far closer than the base alone.
    assert same_top == 1.0 and diff < 1.5 * exact_diff and diff < 0.05 * base_diff, check
    with open(os.path.join(OUT, "peft_check.json"), "w") as f:
        f.write(json.dumps(check, indent=1) + "\n")


if __name__ == "__main__":
    main()
