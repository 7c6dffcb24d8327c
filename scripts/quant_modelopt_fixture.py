#!/usr/bin/env python3
"""A tiny NVFP4 checkpoint quantized by NVIDIA ModelOpt itself, with its own decode.

Quantizes a bf16 matrix (an all-zero block, -0.0 entries, a block small enough for
the 2^-9 scale floor, an outlier) with modelopt's NVFP4QTensor.quantize (the CPU
path of its export: weights_scaling_factor_2 = amax / (6 * 448), per-16 E4M3 scales,
E2M1 codes packed even-element-low), and writes into tests/data/quant/modelopt_nvfp4:

* model.safetensors in the ModelOpt layout (weight U8, weight_scale F8_E4M3,
  weight_scale_2 F32) and a ModelOpt config.json;
* source.bf16: the input matrix (raw little-endian bf16, 64x128);
* expected.f32: NVFP4QTensor.dequantize(dtype=float32) of the result.

crates/loraq-quant/tests/producers.rs requires loraq's canonical nvfp4 quantization
of source.bf16 to give the same bytes and scales, and QuantizedBase to decode
expected.f32 bit for bit.

Pinned versions: scripts/requirements-quant-ct.txt (python 3.11).
Run: python scripts/quant_modelopt_fixture.py [--out tests/data/quant/modelopt_nvfp4]
"""

import argparse
import json
import os

import modelopt
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from safetensors.torch import save_file

ROWS, COLS = 64, 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/data/quant/modelopt_nvfp4")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(20261129)
    w = torch.randn(ROWS, COLS) * 0.02
    w[2, 32:48] = 0.0  # all-zero block: scale 1
    w[4, 0:8] = -0.0  # ModelOpt encodes -0.0 as +0
    w[6, 64:80] = 1e-30  # block scale floored at 2^-9
    w[9, 100] = 0.75  # the tensor maximum
    w = w.to(torch.bfloat16)
    quantized, block_scale, global_scale = NVFP4QTensor.quantize(w, 16)
    packed = quantized._quantized_data
    expected = quantized.dequantize(
        dtype=torch.float32, scale=block_scale, double_scale=global_scale, block_sizes={-1: 16}
    )
    module = "model.layers.0.mlp.up_proj"
    save_file(
        {
            f"{module}.weight": packed.contiguous(),
            f"{module}.weight_scale": block_scale.contiguous(),
            f"{module}.weight_scale_2": global_scale.reshape([]).to(torch.float32).contiguous(),
        },
        os.path.join(args.out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(args.out, "source.bf16"), "wb") as f:
        f.write(w.view(torch.int16).numpy().astype("<i2").tobytes())
    with open(os.path.join(args.out, "expected.f32"), "wb") as f:
        f.write(expected.contiguous().numpy().astype("<f4").tobytes())
    config = {
        "model_type": "qwen3",
        "hidden_size": COLS,
        "intermediate_size": ROWS,
        "num_hidden_layers": 1,
        "vocab_size": 16,
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "producer": {"name": "modelopt", "version": modelopt.__version__},
        },
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
