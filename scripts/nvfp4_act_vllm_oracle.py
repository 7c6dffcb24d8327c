#!/usr/bin/env python3
"""Test vectors: NVFP4 static activation quantization as vLLM applies it (W4A4).

vLLM quantizes the input of an NVFP4 W4A4 linear with `scaled_fp4_quant(x,
input_global_scale_inv)`; its CUDA kernel (csrc/quantization/fp4/nvfp4_utils.cuh,
`cvt_warp_fp16_to_fp4`) and the torch reference it keeps for GPUs without FP4
(vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py,
`ref_nvfp4_quant`) compute, per 16 inputs, with q the quantization-direction
global scale:

    scale   = e4m3(clamp(q * (amax * (1/6)), -448, 448))      # no lower clamp
    out     = 1 / (scale * (1 / q))        (0 where scale == 0)
    x_fp4   = e2m1(clamp(x * out, -6, 6))  # round to nearest even

and the GEMM multiplies the accumulator by alpha = input_global_scale *
weight_global_scale, so the activation it sees is (x_fp4 * scale) * m with m the
dequantization-direction scale. q and m come from the checkpoint
(vllm/model_executor/layers/quantization/modelopt.py ModelOptNvFp4LinearMethod,
compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py):

    ModelOpt `input_scale` s:                q = (1.0 / s).to(float32), m = s
    compressed-tensors `input_global_scale` d: q = d,  m = (1.0 / d).to(float32)

This script transcribes `ref_nvfp4_quant` (torch, float32; the reciprocals are
torch's correctly rounded divisions, where the CUDA kernel uses rcp.approx.ftz)
and writes, under tests/data/quant/act_nvfp4_vllm/:

    x.f32                      input [tokens, hidden] (bf16 values as f32)
    modelopt.f32, ct.f32       the fake-quantized activation for each direction
    manifest.json              shapes and the two stored scales

The input has an outlier channel (block scales saturating at 448), an all-zero
token, a -0 block, and a token of ~1e-6 values whose block scales round to 0 in
E4M3: vLLM quantizes those blocks to 0, where the weight formula's 2^-9 floor
would keep them. crates/loraq-quant/tests/oracle_activations.rs requires
`activation::nvfp4_static_vllm` to give the same bits.

Versions: torch 2.15.0 (scripts/requirements-clients.txt). Run from the
repository root: python scripts/nvfp4_act_vllm_oracle.py
"""

import json
import os

import torch

OUT = "tests/data/quant/act_nvfp4_vllm"
BLOCK = 16


def cast_to_fp4(x):
    # vLLM's cast_to_fp4: round to nearest even on the E2M1 grid.
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def reciprocal(x):
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)


def fake_quant(x, q, m):
    tokens, hidden = x.shape
    blocks = x.reshape(tokens, hidden // BLOCK, BLOCK)
    vec_max = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = q * (vec_max * (1.0 / 6.0))
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = reciprocal(scale * reciprocal(q))
    x_fp4 = cast_to_fp4(torch.clamp(blocks * output_scale, -6.0, 6.0))
    return ((x_fp4 * scale) * m).reshape(tokens, hidden)


def main():
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(20261201)
    tokens, hidden = 12, 128
    x = torch.randn(tokens, hidden, generator=g)
    x[:, 5] *= 40.0  # an outlier channel
    x[2, :] = 0.0  # an all-zero token
    x[3, 32:48] = -0.0  # a -0 block
    x[4, :] = 1e-6 * torch.randn(hidden, generator=g)  # block scales round to 0
    x[5, :] *= 1e-3
    x = x.to(torch.bfloat16).to(torch.float32)
    amax = x.abs().max()
    # ModelOpt input_scale = amax / 2688 from a calibration that saw a tenth of
    # this input's range: outlier blocks saturate at 448.
    input_scale = (amax * 0.1 / (6 * 448)).to(torch.float32)
    q = (1.0 / input_scale).to(torch.float32)
    modelopt = fake_quant(x, q, input_scale)
    # compressed-tensors input_global_scale = 2688 / amax (a divisor).
    divisor = torch.tensor(6 * 448, dtype=torch.float32) / (amax * 0.5)
    ct = fake_quant(x, divisor, (1.0 / divisor).to(torch.float32))
    assert (modelopt[4] == 0).all(), "the ~1e-6 token quantizes to zero"
    for name, t in [("x.f32", x), ("modelopt.f32", modelopt), ("ct.f32", ct)]:
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(t.contiguous().numpy().astype("<f4").tobytes())
    manifest = {
        "tokens": tokens,
        "hidden": hidden,
        "modelopt_input_scale_bits": int(input_scale.view(torch.int32).item()),
        "ct_input_global_scale_bits": int(divisor.view(torch.int32).item()),
        "torch": torch.__version__,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    print(manifest)


if __name__ == "__main__":
    main()
