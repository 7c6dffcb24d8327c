"""The llama.cpp fixture of the collect tests (docs/collect.md, "The CI fixture").

From a small Qwen3.5 checkpoint written by transformers (tests/data/model/qwen3_5:
hybrid Gated DeltaNet + attention, vocabulary 128), writes under OUT:

  hf/            the checkpoint plus a tokenizer (byte-level BPE: ids 0-126 the ASCII
                 bytes but DEL, id 127 two spaces, the one merge), so that llama.cpp's
                 converter and its /tokenize have one;
  adapter/       a PEFT LoRA adapter (rank 4 on every linear of every layer, alpha 8,
                 scale 2, bf16 factors, seeded), uniform in rank so that llama.cpp's
                 per-tensor scale alpha / rank equals PEFT's alpha / r;
  base-f32.gguf  hf/ converted by llama.cpp's convert_hf_to_gguf.py --outtype f32;
  adapter-f32.gguf  adapter/ converted by convert_lora_to_gguf.py --outtype f32.

The converters are llama.cpp's own (the copy kept by scripts/build-llama-server.sh).
One thing is set by hand: the converter names a BPE tokenizer's pre-tokenizer by
hashing how it tokenizes a fixed text and refuses hashes it does not know, which any
tokenizer but a published model's is; the fixture declares the pre-tokenizer of
Qwen3.5 ("qwen35") instead, by replacing that one lookup before the converter runs.
Everything else (tensor names, the V-head reordering of the linear-attention
projections, A_log -> -exp, norm + 1, the adapter's factors) is the converter's.

  python scripts/collect_fixture.py --llama-cpp CACHE/llama-server-0.3.36/llama.cpp \
      --model tests/data/model/qwen3_5 --out DIR
"""

import argparse
import json
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
    "gate_proj", "up_proj", "down_proj",
)
RANK = 4
ALPHA = 8


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: byte -> printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(out: Path, vocab_size: int):
    if vocab_size < 128:
        sys.exit(f"vocab_size {vocab_size}: the fixture tokenizer needs 128 ids (the ASCII bytes)")
    alphabet = bytes_to_unicode()
    # Ids 0-126 are the ASCII bytes but DEL; id 127 is two spaces, the one merge: a
    # BPE vocabulary without merges is refused by llama.cpp ("cannot find tokenizer
    # merges in model file").
    vocab = {alphabet[b]: b for b in range(127)}
    space = alphabet[ord(" ")]
    vocab[space + space] = 127
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [[space, space]]},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }, indent=1))


def write_adapter(model_dir: Path, out: Path, seed: int):
    rng = np.random.default_rng(seed)
    tensors = {}
    targets = set()
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in sorted(f.keys()):
            parts = name.split(".")
            if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in LINEAR_MODULES:
                continue
            weight = f.get_tensor(name).float()
            if weight.ndim != 2:
                continue
            out_features, in_features = weight.shape
            rms = weight.pow(2).mean().sqrt().item()
            # delta = (alpha / r) B A with an RMS of about 0.3 of the weight's: the
            # adapter moves the answers well beyond rounding.
            a = rng.standard_normal((RANK, in_features)) / np.sqrt(in_features)
            b = rng.standard_normal((out_features, RANK)) * 0.3 * rms / np.sqrt(RANK) / (ALPHA / RANK)
            module = name[: -len(".weight")]
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.tensor(a, dtype=torch.bfloat16)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.tensor(b, dtype=torch.bfloat16)
            targets.add(parts[-2])
    if not tensors:
        sys.exit(f"{model_dir}: no linear weights found")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted(targets),
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
        "bias": "none",
        "use_rslora": False,
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }, indent=1))


def run_converter(llama_cpp: Path, script: str, argv: list[str]):
    """Runs one of llama.cpp's converters in this interpreter with the fixture's
    pre-tokenizer declared (see the module docstring)."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import conversion.base as base  # llama.cpp's converter package

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(llama_cpp / script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    finally:
        sys.argv = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path,
                        help="llama.cpp's Python side (convert_*.py, conversion/, gguf-py/)")
    parser.add_argument("--model", type=Path, required=True, help="a transformers Qwen3.5 checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--no-gguf", action="store_true",
                        help="write hf/ and adapter/ only (for vLLM, scripts/gpu-check.sh)")
    args = parser.parse_args()

    hf = args.out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(args.model / name, hf / name)
    config = json.loads((hf / "config.json").read_text())
    # Qwen3.5's rotary embedding is interleaved MRoPE; llama.cpp's converter writes
    # Qwen3.5-9B's sections [11, 11, 10] (32 rotary pairs) when the config has none,
    # more pairs than this model's head has (ggml asserts). Sections split the rotary
    # pairs between the time / height / width positions, which are all equal for text,
    # so any split gives plain RoPE; this one splits the model's own pairs the same way.
    rope = config.setdefault("rope_parameters", {})
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    pairs = int(head_dim * rope.get("partial_rotary_factor", 0.25)) // 2
    rope.setdefault("mrope_section", [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3])
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(hf, config["vocab_size"])
    write_adapter(hf, args.out / "adapter", args.seed)
    if args.no_gguf:
        print(args.out)
        return
    if args.llama_cpp is None:
        parser.error("--llama-cpp is required to write the GGUF files")

    run_converter(args.llama_cpp, "convert_hf_to_gguf.py",
                  [str(hf), "--outtype", "f32", "--no-mtp", "--outfile", str(args.out / "base-f32.gguf")])
    run_converter(args.llama_cpp, "convert_lora_to_gguf.py",
                  [str(args.out / "adapter"), "--base", str(hf), "--outtype", "f32",
                   "--outfile", str(args.out / "adapter-f32.gguf")])
    print(args.out)


if __name__ == "__main__":
    main()
