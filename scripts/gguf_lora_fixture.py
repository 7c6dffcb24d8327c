"""PEFT adapters with rank_pattern / alpha_pattern / rsLoRA, and llama.cpp's own
conversion of adapters to GGUF, as the oracle of `loraq export-gguf` (docs/gguf.md).

  patterns --model HF --out DIR
      writes a PEFT adapter for the checkpoint HF into DIR: every linear of every
      layer, r 4 and lora_alpha 8 by default, rank_pattern (in_proj_a / in_proj_b
      rank 2, layer 1's q_proj rank 8, or gate_proj rank 2 without linear attention),
      alpha_pattern (down_proj alpha 3, one out_proj or up_proj alpha 16),
      use_rslora true: every module's scale alpha / sqrt(r) differs from what
      llama.cpp's converter (which writes lora_alpha alone) would apply. Factors are
      seeded bf16, the product scaled to about 0.3 of the weight's RMS.
  base --llama-cpp DIR --model HF --out FILE [--outtype f32|q8_0|...]
      llama.cpp's convert_hf_to_gguf.py --outtype f32 (or another) on a copy of HF given
      scripts/collect_fixture.py's tokenizer and rope sections (the converter needs
      a tokenizer), --no-mtp for Qwen3.5.
  convert --llama-cpp DIR --adapter ADAPTER --base HF --out FILE
      llama.cpp's convert_lora_to_gguf.py --outtype f32 (scripts/collect_fixture.py
      runs it the same way).

The committed files under tests/data/gguf/ were made with

  python scripts/gguf_lora_fixture.py base --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --model tests/data/model/qwen3_5 --out tests/data/gguf/qwen3_5-f32.gguf
  python scripts/gguf_lora_fixture.py base --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --model tests/data/model/qwen3_5 --outtype q8_0 --out tests/data/gguf/qwen3_5-q8_0.gguf
  python scripts/gguf_lora_fixture.py base --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --model tests/data/model/qwen3 --outtype q8_0 --out tests/data/gguf/qwen3-q8_0.gguf

(the converter's Qwen3 vocabulary step imports `sentencepiece` before it falls back to
the tokenizer.json vocabulary: `pip install sentencepiece` where it runs).

  python scripts/gguf_lora_fixture.py patterns --model tests/data/model/qwen3 --out tests/data/gguf/qwen3-lora
  python scripts/gguf_lora_fixture.py convert --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --adapter tests/data/gguf/qwen3-lora --base tests/data/model/qwen3 --out tests/data/gguf/qwen3-lora-converter.gguf
  python scripts/gguf_lora_fixture.py convert --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --adapter tests/data/model/qwen3_5-lora --base tests/data/model/qwen3_5 --out tests/data/gguf/qwen3_5-lora-converter.gguf
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_fixture import LINEAR_MODULES, run_converter, write_tokenizer  # noqa: E402

RANK = 4
ALPHA = 8


def patterns(model_dir: Path, out: Path, seed: int):
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = sorted(k for k in f.keys()
                       if k.endswith(".weight") and k.split(".")[-2] in LINEAR_MODULES and f.get_slice(k).get_shape().__len__() == 2)
        weights = {k: f.get_tensor(k).float() for k in names}
    hybrid = any(".linear_attn." in k for k in names)
    rank_pattern = {"in_proj_a": 2, "in_proj_b": 2, r"^model\.layers\.1\.self_attn\.q_proj": 8} if hybrid \
        else {"gate_proj": 2, r"^model\.layers\.1\.self_attn\.q_proj": 8}
    alpha_pattern = {"down_proj": 3, r"^model\.layers\.2\.linear_attn\.out_proj": 16} if hybrid \
        else {"down_proj": 3, r"^model\.layers\.0\.mlp\.up_proj": 16}

    def resolve(pattern, module, default):
        import re
        for key, value in pattern.items():
            body = key[1:] if key.startswith("^") else key
            regex = f"^(?:{body})$" if key.startswith("^") else f"^(?:.*\\.)?(?:{body})$"
            if re.match(regex, module):
                return value
        return default

    rng = np.random.default_rng(seed)
    tensors = {}
    for name in names:
        module = name[: -len(".weight")]
        weight = weights[name]
        out_features, in_features = weight.shape
        r = resolve(rank_pattern, module, RANK)
        alpha = resolve(alpha_pattern, module, ALPHA)
        scale = alpha / np.sqrt(r)
        rms = weight.pow(2).mean().sqrt().item()
        a = rng.standard_normal((r, in_features)) / np.sqrt(in_features)
        b = rng.standard_normal((out_features, r)) * 0.3 * rms / np.sqrt(r) / scale
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.tensor(a, dtype=torch.bfloat16)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.tensor(b, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted({n.split(".")[-2] for n in names}),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "base_model_name_or_path": None,
        "bias": "none",
        "use_rslora": True,
        "use_dora": False,
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("patterns")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=23)
    b = sub.add_parser("base")
    b.add_argument("--llama-cpp", type=Path, required=True)
    b.add_argument("--model", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--outtype", default="f32", help="the converter's --outtype (f32, q8_0, ...)")
    c = sub.add_parser("convert")
    c.add_argument("--llama-cpp", type=Path, required=True)
    c.add_argument("--adapter", type=Path, required=True)
    c.add_argument("--base", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "patterns":
        patterns(args.model, args.out, args.seed)
    elif args.command == "base":
        import shutil
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / "hf"
            hf.mkdir()
            for name in ("config.json", "model.safetensors"):
                shutil.copyfile(args.model / name, hf / name)
            config = json.loads((hf / "config.json").read_text())
            hybrid = "linear_num_value_heads" in config
            if hybrid:  # as scripts/collect_fixture.py: the model's own rotary pairs
                rope = config.setdefault("rope_parameters", {})
                pairs = int(config["head_dim"] * rope.get("partial_rotary_factor", 0.25)) // 2
                rope.setdefault("mrope_section", [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3])
                (hf / "config.json").write_text(json.dumps(config, indent=2))
            write_tokenizer(hf, config["vocab_size"])
            run_converter(args.llama_cpp, "convert_hf_to_gguf.py",
                          [str(hf), "--outtype", args.outtype, *(["--no-mtp"] if hybrid else []),
                           "--outfile", str(args.out)])
    else:
        # convert_lora_to_gguf.py has no --no-mtp; with a Qwen3.5 base that holds no
        # mtp.* tensors its MTP mixin asserts (conversion/qwen.py, _QwenMtpMixin).
        # convert_hf_to_gguf.py --no-mtp sets this class attribute, which is what
        # lets scripts/collect_fixture.py convert the adapter in the same process.
        sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
        sys.path.insert(0, str(args.llama_cpp))
        import conversion.base as base
        base.ModelBase.no_mtp = True
        run_converter(args.llama_cpp, "convert_lora_to_gguf.py",
                      [str(args.adapter), "--base", str(args.base), "--outtype", "f32",
                       "--outfile", str(args.out)])
    print(args.out)


if __name__ == "__main__":
    main()
