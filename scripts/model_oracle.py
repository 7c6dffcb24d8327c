#!/usr/bin/env python3
"""Parity fixtures for crates/loraq-model: tiny random models of the real
architectures, run by transformers (and PEFT) in float32.

Writes under tests/data/model/ (run from the repository root):
  qwen3_5/        a Qwen3_5ForCausalLM (text backbone, both layer types): config.json,
                  model.safetensors (bf16)
  qwen3_5-lora/   a PEFT LoRA adapter on every linear of it (bf16 factors, alpha != r,
                  one module with its own alpha through alpha_pattern)
  qwen3/          a dense Qwen3ForCausalLM with tied embeddings
  records.jsonl   prompts (tokens) with four option tokens each, lengths 1..48
  expected-qwen3_5.jsonl, expected-qwen3_5-lora.jsonl, expected-qwen3.jsonl:
                  answers (docs/evaluation.md format) with the option logits transformers
                  computes at the last prompt position, float32 compute on the
                  bf16-representable weights.

Versions: scripts/requirements-model.txt. Deterministic (fixed seeds, 1 thread).

Speed reference: `python scripts/model_oracle.py bench --model DIR --records FILE
--threads N` runs the same records through transformers (float32, eager, one record
at a time as `loraq run` does) and prints prefill tokens/s, to set beside the figure
`loraq run --threads N` prints on stderr.
"""

import copy
import json
import os
import shutil

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

OUT = "tests/data/model"
VOCAB = 128
torch.set_num_threads(1)


def bf16_exact(model):
    """Rounds every parameter to bf16 and back, so f32 compute sees exactly the
    values the bf16 checkpoint stores."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def randomize(model, gen):
    """Scales a trained model would have: N(0, 1/in) projections, N(0, 1)
    embeddings, norm offsets N(0, 0.1^2) (so (1 + w) is not the identity),
    Gated DeltaNet A_log = log U(1, 16), dt_bias ~ 1 + N(0, 0.1^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
            elif "embed" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen).mul(15).add(1).log())
            elif name.endswith("dt_bias"):
                p.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1, generator=gen)  # the gated norm's weight is used as is
            elif "norm" in name:
                p.normal_(0.0, 0.1, generator=gen)
            else:
                raise ValueError(f"unexpected parameter {name}")


def records(gen):
    out = []
    for i, length in enumerate([1, 2, 3, 5, 8, 13, 21, 34, 48]):
        tokens = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        option_tokens = torch.randperm(VOCAB, generator=gen)[:4].tolist()
        options = ["A", "B", "C", "D"]
        gold = options[int(torch.randint(0, 4, (1,), generator=gen))]
        out.append(
            {
                "id": f"q{i}",
                "group": "lengths",
                "tokens": tokens,
                "options": options,
                "option_tokens": option_tokens,
                "gold": gold,
            }
        )
    return out


@torch.no_grad()
def answers(model, recs):
    out = []
    for r in recs:
        ids = torch.tensor([r["tokens"]])
        logits = model(input_ids=ids).logits[0, -1].to(torch.float32)
        out.append(
            {
                "id": r["id"],
                "group": r["group"],
                "options": r["options"],
                "logits": [float(logits[t]) for t in r["option_tokens"]],
                "gold": r["gold"],
            }
        )
    return out


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def save(model, name):
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    # A bf16 copy: converting the model itself would also round its rotary inv_freq
    # buffer to bf16, and every later forward pass of it would be off.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for extra in ["generation_config.json"]:
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))


def main():
    os.makedirs(OUT, exist_ok=True)
    gen = torch.Generator().manual_seed(20261129)
    recs = records(gen)
    write_jsonl(os.path.join(OUT, "records.jsonl"), recs)

    # Qwen3.5: both layer types, GQA in both mixers (4 value heads per 2 key heads,
    # 4 query heads per 2 kv heads), partial rotary (16 * 0.25 = 4 dims), theta small
    # enough that the rotation differs visibly across 48 positions.
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).eval()
    randomize(model, gen)
    bf16_exact(model)
    write_jsonl(os.path.join(OUT, "expected-qwen3_5.jsonl"), answers(model, recs))
    save(model, "qwen3_5")

    # PEFT LoRA on every linear, unmerged; alpha 8 over r 4 (scale 2) and one module
    # with alpha 2 (scale 0.5) through alpha_pattern.
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        alpha_pattern={"layers.1.self_attn.o_proj": 2},
        target_modules=[
            "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, lora).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5, generator=gen)
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    write_jsonl(os.path.join(OUT, "expected-qwen3_5-lora.jsonl"), answers(peft_model, recs))
    adapter_dir = os.path.join(OUT, "qwen3_5-lora")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    # PEFT writes f32 factors; store them as bf16 (what extract writes), same values.
    from safetensors.torch import load_file, save_file

    weights_path = os.path.join(adapter_dir, "adapter_model.safetensors")
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(weights_path).items()}
    save_file(weights, weights_path, metadata={"format": "pt"})
    readme = os.path.join(adapter_dir, "README.md")
    if os.path.exists(readme):
        os.remove(readme)

    # Dense Qwen3 with tied embeddings.
    gen = torch.Generator().manual_seed(3)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
            elif "embed" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:  # Qwen3 norms multiply by w directly
                p.normal_(1.0, 0.1, generator=gen)
    bf16_exact(model)
    write_jsonl(os.path.join(OUT, "expected-qwen3.jsonl"), answers(model, recs))
    save(model, "qwen3")


def bench(argv):
    import argparse
    import time

    from safetensors.torch import load_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    raw = json.load(open(os.path.join(args.model, "config.json")))
    text = dict(raw.get("text_config", raw))
    for key in ["model_type", "dtype", "torch_dtype", "full_attention_interval"]:
        text.pop(key, None)
    config = Qwen3_5TextConfig(**text)
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).eval()
    state = {}
    for name in sorted(os.listdir(args.model)):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(args.model, name)).items():
                if not k.startswith("mtp."):
                    state[k.replace("model.language_model.", "model.")] = v.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in m for m in missing), (missing, unexpected)
    recs = [json.loads(line) for line in open(args.records) if line.strip()]
    tokens = sum(len(r["tokens"]) for r in recs)
    with torch.no_grad():
        model(input_ids=torch.tensor([recs[0]["tokens"]]))  # warm-up
        start = time.perf_counter()
        for r in recs:
            # Logits at the last position only, as `loraq run` (which multiplies
            # only the options' lm_head rows there); by default transformers would
            # run lm_head at every position.
            model(input_ids=torch.tensor([r["tokens"]]), use_cache=False, logits_to_keep=1)
        seconds = time.perf_counter() - start
    print(f"transformers: {len(recs)} records ({tokens} prompt tokens) in {seconds:.2f} s "
          f"({tokens / seconds:.0f} tokens/s, {args.threads} threads)")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["bench"]:
        bench(sys.argv[2:])
    else:
        main()
