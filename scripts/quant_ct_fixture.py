#!/usr/bin/env python3
"""A tiny NVFP4 checkpoint written by compressed-tensors itself, with its own decode.

Quantizes two bf16 matrices (one with an all-zero block and an outlier, one with 16
columns only) with compressed-tensors' NVFP4 preset (NVFP4A16: its generate_gparam /
calculate_qparams / NVFP4PackedCompressor.compress, the path llm-compressor takes),
writes the compressed tensors as tests/data/quant/ct_nvfp4/model.safetensors with a
compressed-tensors config.json, and the library's own dequantization of every
weight in f32 (compressed_tensors.quantization.lifecycle.forward.dequantize with
dtype=float32) as <name>.expected.f32. crates/loraq-quant/tests/producers.rs reads
the checkpoint back with QuantizedBase and requires the same bits.

Pinned versions: scripts/requirements-quant-ct.txt (python 3.11; torch from PyPI).
Run: python scripts/quant_ct_fixture.py [--out tests/data/quant/ct_nvfp4]
"""

import argparse
import json
import os

import compressed_tensors
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import save_file


def quantize(weight, scheme):
    rows, cols = weight.shape
    global_scale = generate_gparam(weight.min(), weight.max())
    blocks = weight.reshape(rows, cols // 16, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    packed = compressed["weight_packed"]
    unpacked = unpack_fp4_from_uint8(packed, rows, cols, dtype=torch.float32)
    expected = dequantize(
        x_q=unpacked,
        scale=compressed["weight_scale"].to(torch.float32),
        args=scheme.weights,
        global_scale=compressed["weight_global_scale"],
        dtype=torch.float32,
    )
    return compressed, expected


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/data/quant/ct_nvfp4")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(20261129)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    a = torch.randn(48, 96) * 0.02
    a[3, 16:32] = 0  # an all-zero block
    a[7, 5] = 0.9  # the tensor maximum
    b = torch.randn(8, 16) * 3.0
    weights = {
        "model.layers.0.mlp.up_proj": a.to(torch.bfloat16).to(torch.float32),
        "model.layers.0.mlp.down_proj": b.to(torch.bfloat16).to(torch.float32),
    }
    tensors = {}
    for module, weight in weights.items():
        compressed, expected = quantize(weight, scheme)
        for key, value in compressed.items():
            tensors[f"{module}.{key}"] = value.contiguous()
        with open(os.path.join(args.out, f"{module}.expected.f32"), "wb") as f:
            f.write(expected.contiguous().numpy().astype("<f4").tobytes())
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": "qwen3",
        "hidden_size": 96,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "vocab_size": 16,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], **json.loads(scheme.model_dump_json(exclude={"targets"}))}},
            "version": compressed_tensors.__version__,
        },
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
        f.write("\n")


if __name__ == "__main__":
    main()
