#!/usr/bin/env python3
"""A merge in the *ForConditionalGeneration* naming, made by the real clients (issue 15).

Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: their text tensors
are `model.language_model.layers.*`, next to a vision tower (`model.visual.*`).
transformers 5.x loads the same files through AutoModelForCausalLM as
Qwen3_5ForCausalLM, whose modules are `model.layers.*`, so an adapter's module names
decide which class applies it. scripts/peft_fixture.py only built text-only
checkpoints, where both namings coincide; this one builds:

1. tests/data/peft-multimodal/base: a tiny random Qwen3_5ForConditionalGeneration
   (both layer types, a one-block vision tower), rounded to bf16.
2. tests/data/peft-multimodal/peft-adapter: a PEFT LoRA (r = 8, alpha = 16, the text
   backbone's twelve linear kinds; in_proj_a / in_proj_b are 4 rows, narrower than r)
   with non-zero B, saved by PEFT with f32 factors: the exact adapter, the reference
   of how close any adapter can come to the bf16 merge.
3. tests/data/peft-multimodal/merged: that LoRA merged by PEFT's merge_and_unload,
   saved in bf16 with the checkpoint's own class (so its names are the multimodal ones).

tests/peft_naming.rs extracts the pair with loraq and loads the result with
scripts/peft_load_check.py. Versions: scripts/requirements-clients.txt. Run once from
the repository root: python scripts/peft_multimodal_fixture.py
"""

import copy
import os
import shutil

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5 import Qwen3_5Config

import model_oracle  # scripts/model_oracle.py: the parity fixtures' random scales

OUT = "tests/data/peft-multimodal"
VOCAB = 128
TARGETS = [
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
]
torch.set_num_threads(1)


def config():
    text = dict(
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
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
    )
    c = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
        tie_word_embeddings=False,
    )
    c._attn_implementation = "eager"
    c.text_config._attn_implementation = "eager"
    return c


def randomize(model, gen):
    """The text backbone gets the parity fixtures' scales (model_oracle.randomize);
    the vision tower, which no test runs, small normal values; all rounded to bf16."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                p.normal_(0.0, 0.02, generator=gen)
        text = model.model.language_model
        model_oracle.randomize(text, gen)
        model.lm_head.weight.normal_(0.0, model.lm_head.weight.shape[1] ** -0.5, generator=gen)
    model_oracle.bf16_exact(model)


def save_bf16(model, path):
    shutil.rmtree(path, ignore_errors=True)
    # A bf16 copy: converting the model itself would round its rotary buffers too.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for extra in ["generation_config.json", "README.md"]:
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))


def main():
    os.makedirs(OUT, exist_ok=True)
    gen = torch.Generator().manual_seed(15)

    base = Qwen3_5ForConditionalGeneration(config()).eval()
    randomize(base, gen)
    save_bf16(base, os.path.join(OUT, "base"))

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(copy.deepcopy(base), lora).eval()
    names = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
    assert names and all(".language_model.layers." in n for n in names), names
    with torch.no_grad():
        # A delta of a few tens of bf16 ulps of the N(0, 1/in) weights, as a fine-tune
        # leaves: scale * B A has entries of RMS about 0.08 / sqrt(in).
        params = dict(peft_model.named_parameters())
        for name, p in params.items():
            if "lora_A" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif "lora_B" in name:
                in_features = params[name.replace("lora_B", "lora_A")].shape[1]
                p.normal_(0.0, 0.04 / (8 * in_features) ** 0.5, generator=gen)
    adapter_dir = os.path.join(OUT, "peft-adapter")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    if os.path.exists(os.path.join(adapter_dir, "README.md")):
        os.remove(os.path.join(adapter_dir, "README.md"))
    merged = peft_model.merge_and_unload()
    save_bf16(merged, os.path.join(OUT, "merged"))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
