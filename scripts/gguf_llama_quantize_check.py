#!/usr/bin/env python3
"""End-to-end vectors of a real llama-quantize run, for
crates/loraq-quant/tests/gguf_type_mix.rs (`llama_quantize_end_to_end`).

Writes a small synthetic `qwen3` GGUF in f32 (8 layers, hidden 256, 4 heads of 64 and
one KV head, so n_gqa = 4; ffn 320, so ffn_down rows are not whole 256-blocks and fall
back; vocabulary 64; untied output), whose values are a hash of (tensor, element)
that the Rust test regenerates exactly; runs llama-quantize (from the llama.cpp that
llama-cpp-python 0.3.36 vendors, target `llama-quantize` of the build described in
scripts/gguf_blocks_oracle.py) for Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0 and IQ4_XS; and
records, per file type, the type and the SHA-256 of every tensor's bytes as
llama-quantize wrote them, plus the tensor list, to
tests/data/gguf_blocks/llama_quantize/qwen3-synthetic.json.

    python scripts/gguf_llama_quantize_check.py --llama-quantize BUILD/bin/llama-quantize \\
        --gguf-py ~/.cache/loraq-ci/llama-server-0.3.36/llama.cpp/gguf-py
"""

import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf_blocks" / "llama_quantize"
FTYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS"]
N_LAYER, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB = 8, 256, 320, 4, 1, 64, 64
MASK64 = (1 << 64) - 1


def tensor_list():
    """(name, GGUF dims ne[0] first) in the converter's order."""
    out = [("token_embd.weight", [N_EMBD, N_VOCAB]), ("output_norm.weight", [N_EMBD]),
           ("output.weight", [N_EMBD, N_VOCAB])]
    for il in range(N_LAYER):
        b = f"blk.{il}."
        out += [
            (b + "attn_norm.weight", [N_EMBD]),
            (b + "attn_q.weight", [N_EMBD, N_HEAD * HEAD_DIM]),
            (b + "attn_k.weight", [N_EMBD, N_HEAD_KV * HEAD_DIM]),
            (b + "attn_v.weight", [N_EMBD, N_HEAD_KV * HEAD_DIM]),
            (b + "attn_output.weight", [N_HEAD * HEAD_DIM, N_EMBD]),
            (b + "attn_q_norm.weight", [HEAD_DIM]),
            (b + "attn_k_norm.weight", [HEAD_DIM]),
            (b + "ffn_norm.weight", [N_EMBD]),
            (b + "ffn_gate.weight", [N_EMBD, N_FF]),
            (b + "ffn_up.weight", [N_EMBD, N_FF]),
            (b + "ffn_down.weight", [N_FF, N_EMBD]),
        ]
    return out


def values(index, n):
    """The values of tensor `index`: a 64-bit multiplicative hash of (index, element),
    its top 24 bits centred and scaled by 2^-27 (exact in f32); element 0 is 1.0 (an
    outlier). Mirrored by the Rust test."""
    i = np.arange(n, dtype=np.uint64)
    key = (np.uint64(index) << np.uint64(32)) | i
    with np.errstate(over="ignore"):
        h = key * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
        h = h * np.uint64(0xBF58476D1CE4E5B9)
    top = (h >> np.uint64(40)).astype(np.int64) - (1 << 23)
    v = top.astype(np.float32) * np.float32(2.0 ** -27)
    v[0] = np.float32(1.0)
    return v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-quantize", required=True)
    parser.add_argument("--gguf-py", required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: E402

    tensors = tensor_list()
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "qwen3-f32.gguf"
        w = gguf.GGUFWriter(str(src), "qwen3")
        w.add_context_length(256)
        w.add_embedding_length(N_EMBD)
        w.add_block_count(N_LAYER)
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(1e6)
        w.add_file_type(0)
        for index, (name, dims) in enumerate(tensors):
            n = int(np.prod(dims))
            data = values(index, n).reshape(list(reversed(dims)))
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        result = {"source": "scripts/gguf_llama_quantize_check.py",
                  "llama_cpp": "llama-cpp-python 0.3.36 sdist, llama-quantize",
                  "tensors": [{"name": n, "dims": d} for n, d in tensors],
                  "block_count": N_LAYER, "head_count": N_HEAD, "head_count_kv": N_HEAD_KV,
                  "ftypes": {}}
        for ftype in FTYPES:
            dst = pathlib.Path(tmp) / f"out-{ftype}.gguf"
            subprocess.run([args.llama_quantize, str(src), str(dst), ftype, "1"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            reader = gguf.GGUFReader(str(dst))
            per = {}
            order = []
            for t in reader.tensors:
                raw = np.asarray(t.data).view(np.uint8).tobytes()
                per[t.name] = {"type": t.tensor_type.name.lower(), "sha256": hashlib.sha256(raw).hexdigest()}
                order.append(t.name)
            result["ftypes"][ftype] = {"tensors": per, "file_order": order}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "qwen3-synthetic.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", OUT / "qwen3-synthetic.json")


if __name__ == "__main__":
    main()
