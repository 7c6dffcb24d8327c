#!/usr/bin/env python3
"""Vectors of llama.cpp's own path from a checkpoint to a quantized GGUF, for
tests/gguf_quantize.rs (docs/gguf.md, "Quantized GGUF bases").

`models` writes two small synthetic bf16 checkpoints under tests/data/gguf_quantize/
(committed), each with a tokenizer as a published model ships one (tokenizer.json with
byte-level BPE, added special tokens, tokenizer_config.json with a chat template, ids
past the tokenizer's padded by the converter):

  qwen3/   Qwen3ForCausalLM, 2 layers, hidden 256, 4 heads of 32 and 1 KV head
           (n_gqa 4), FFN 32 (ffn_down rows fall back), untied output;
  qwen35/  Qwen3_5ForCausalLM, a Gated DeltaNet layer (2 key heads, 4 value heads:
           the value heads are reordered) and a gated attention layer, tied output.

`expected` converts each with llama.cpp's convert_hf_to_gguf.py --outtype bf16 (the
copy scripts/build-llama-server.sh keeps), runs llama-quantize for Q8_0, Q6_K, Q5_K_M,
Q4_K_M, Q4_0 and IQ4_XS, and records, per model and file type, every metadata key
(type and value; long arrays as their SHA-256) and every tensor (name, type, GGUF
dimensions, SHA-256 of its bytes) in file order, to
tests/data/gguf_quantize/expected.json.

One thing is set by hand, as scripts/collect_fixture.py does: the converter names a
BPE pre-tokenizer by hashing how it tokenizes a fixed text and refuses hashes it does
not know; the fixture declares the architecture's own (qwen3: "qwen2", the name the
converter gives Qwen3's published tokenizer; qwen35: "qwen35"). The qwen3 path
imports `sentencepiece` (Qwen2Model.set_vocab tries a SentencePiece vocabulary first).

`adapter --model DIR --out DIR` writes a PEFT LoRA adapter for one of them (rank 4 on
every linear, alpha 8, seeded; scripts/collect_fixture.py's) for the llama-server test.

    python scripts/gguf_quantize_fixture.py models
    python scripts/gguf_quantize_fixture.py expected \\
        --llama-cpp ~/.cache/loraq-ci/llama-server-0.3.36/llama.cpp \\
        --llama-quantize BUILD/bin/llama-quantize
"""

import argparse
import hashlib
import json
import pathlib
import runpy
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from collect_fixture import bytes_to_unicode, write_adapter  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf_quantize"
FTYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS"]
VOCAB = 136  # the tokenizer has 132 ids; 132..135 are padded by the converter
PRE = {"qwen3": "qwen2", "qwen35": "qwen35"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def qwen3_config():
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 128, "eos_token_id": 130, "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 256, "intermediate_size": 32, "max_position_embeddings": 512,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": VOCAB,
        "layer_types": ["full_attention", "full_attention"],
    }


def qwen35_config():
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attention_bias": False,
        "bos_token_id": 128, "eos_token_id": 130, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 256, "intermediate_size": 32, "max_position_embeddings": 512,
        "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "full_attention_interval": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 32,
        # 64 x 0.25 = 16 rotary dimensions, 8 pairs split as Qwen3.5 splits its 32.
        "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default",
                            "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                            "mrope_interleaved": True},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": VOCAB,
    }


def shapes(config):
    """(name, torch shape) of every tensor of the checkpoint."""
    h, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    gated = config["model_type"] == "qwen3_5_text"
    out = [("model.embed_tokens.weight", [v, h]), ("model.norm.weight", [h])]
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", [v, h]))
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h])]
        if kind == "full_attention":
            out += [
                (p + "self_attn.q_proj.weight", [nh * hd * (2 if gated else 1), h]),
                (p + "self_attn.k_proj.weight", [nkv * hd, h]),
                (p + "self_attn.v_proj.weight", [nkv * hd, h]),
                (p + "self_attn.o_proj.weight", [h, nh * hd]),
                (p + "self_attn.q_norm.weight", [hd]),
                (p + "self_attn.k_norm.weight", [hd]),
            ]
        else:
            nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
            dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
            conv = 2 * nk * dk + nv * dv
            out += [
                (p + "linear_attn.in_proj_qkv.weight", [conv, h]),
                (p + "linear_attn.in_proj_z.weight", [nv * dv, h]),
                (p + "linear_attn.in_proj_a.weight", [nv, h]),
                (p + "linear_attn.in_proj_b.weight", [nv, h]),
                (p + "linear_attn.out_proj.weight", [h, nv * dv]),
                (p + "linear_attn.conv1d.weight", [conv, 1, config["linear_conv_kernel_dim"]]),
                (p + "linear_attn.A_log", [nv]),
                (p + "linear_attn.dt_bias", [nv]),
                (p + "linear_attn.norm.weight", [dv]),
            ]
        out += [
            (p + "mlp.gate_proj.weight", [ff, h]),
            (p + "mlp.up_proj.weight", [ff, h]),
            (p + "mlp.down_proj.weight", [h, ff]),
        ]
    return out


def write_tokenizer(out: pathlib.Path):
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(127)}
    space = alphabet[ord(" ")]
    vocab[space + space] = 127
    added = [
        {"id": 128, "content": "<|endoftext|>", "special": True},
        {"id": 129, "content": "<|im_start|>", "special": True},
        {"id": 130, "content": "<|im_end|>", "special": True},
        {"id": 131, "content": "<think>", "special": False},
    ]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{**a, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False} for a in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [[space, space]]},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "errors": "replace", "model_max_length": 512,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=1) + "\n")


def models():
    rng = np.random.default_rng(18)
    for name, config in (("qwen3", qwen3_config()), ("qwen35", qwen35_config())):
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for tensor, shape in shapes(config):
            if tensor.endswith("A_log"):
                values = rng.uniform(-1.0, 1.5, shape)
            elif tensor.endswith("dt_bias"):
                values = rng.uniform(0.5, 2.0, shape)
            elif "norm" in tensor:
                values = rng.normal(0.0, 0.1, shape)
            else:
                values = rng.normal(0.0, 0.05, shape)
                # one outlier per matrix: the block scales must follow it
                values.flat[int(rng.integers(values.size))] = 0.75
            tensors[tensor] = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(out)
        print("wrote", out)


def run_converter(llama_cpp: pathlib.Path, argv, pre):
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import conversion.base as base  # llama.cpp's converter package

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    saved = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    try:
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    finally:
        sys.argv = saved


def describe(path):
    """Metadata and tensors of a GGUF file as gguf-py reads them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    metadata = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        entry = {"key": field.name, "type": kind.name}
        if kind == gguf.GGUFValueType.ARRAY:
            entry["element_type"] = field.types[-1].name
            value = field.contents()
            entry["len"] = len(value)
            if len(value) <= 16:
                entry["value"] = value
            else:
                entry["sha256"] = hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()
        else:
            value = field.contents()
            if kind in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                value = float(value)
            entry["value"] = value
        metadata.append(entry)
    tensors = []
    for t in reader.tensors:
        raw = np.asarray(t.data).view(np.uint8).tobytes()
        entry = {"name": t.name, "type": t.tensor_type.name.lower(),
                 "dims": [int(d) for d in t.shape], "sha256": hashlib.sha256(raw).hexdigest()}
        if t.name.endswith(".ssm_a"):
            # -exp(A_log) by torch, whose exp depends on the CPU it runs on (MKL's
            # vsExp): the test compares these within one unit in the last place.
            entry["f32_bits"] = [int(b) for b in np.frombuffer(raw, dtype="<u4")]
        tensors.append(entry)
    return {"metadata": metadata, "tensors": tensors}


def expected(args):
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
    result = {"source": "scripts/gguf_quantize_fixture.py",
              "llama_cpp": "llama-cpp-python 0.3.36 sdist: convert_hf_to_gguf.py --outtype bf16, llama-quantize",
              "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("qwen3", "qwen35"):
            src = pathlib.Path(tmp) / f"{name}-bf16.gguf"
            # --no-mtp: loraq writes no multi-token-prediction block (docs/gguf.md); the
            # converter asserts on a Qwen3.5 checkpoint without one unless told so.
            mtp = ["--no-mtp"] if name == "qwen35" else []
            run_converter(args.llama_cpp, [str(OUT / name), "--outtype", "bf16", *mtp, "--outfile", str(src)],
                          PRE[name])
            per = {"bf16": describe(src)}
            for ftype in FTYPES:
                dst = pathlib.Path(tmp) / f"{name}-{ftype}.gguf"
                subprocess.run([str(args.llama_quantize), str(src), str(dst), ftype, "1"], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                per[ftype] = describe(dst)
            result["models"][name] = per
    (OUT / "expected.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print("wrote", OUT / "expected.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["models", "expected", "adapter"])
    parser.add_argument("--model", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--llama-cpp", type=pathlib.Path)
    parser.add_argument("--llama-quantize", type=pathlib.Path)
    args = parser.parse_args()
    if args.what == "models":
        models()
    elif args.what == "adapter":
        if args.model is None or args.out is None:
            parser.error("adapter needs --model and --out")
        write_adapter(args.model, args.out, 19)
        print(args.out)
    else:
        if args.llama_cpp is None or args.llama_quantize is None:
            parser.error("expected needs --llama-cpp and --llama-quantize")
        expected(args)


if __name__ == "__main__":
    main()
