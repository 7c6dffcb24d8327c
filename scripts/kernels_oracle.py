#!/usr/bin/env python3
"""Oracle vectors for loraq-kernels: y = dequant(W) x + scale * B (A x).

Weights are drawn directly as stored codes (E4M3 bytes with 128x128 f32 tile scales,
packed E2M1 with E4M3 or E8M0 block scales, bf16) and decoded by ml_dtypes, the
products computed by numpy in float64. The Rust tests (tests/oracle_vectors.rs) check
the reference and the fast CPU path against these outputs.

Pinned: python 3.11, numpy==2.2.6, ml_dtypes==0.5.3.
Run: python scripts/kernels_oracle.py crates/loraq-kernels/tests/data/oracle_vectors.json
"""
import json
import sys

import ml_dtypes
import numpy as np

RNG = np.random.default_rng(20261129)


def bf16_bits(values):
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_value(bits):
    return np.asarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def e4m3_codes(shape):
    codes = RNG.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes).astype(np.uint8)


def e4m3_value(codes):
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e2m1_value(nibbles):
    return np.asarray(nibbles, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def e8m0_value(codes):
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def unpack(packed, out_dim, in_dim):
    lo = packed & 0x0F
    hi = packed >> 4
    nib = np.empty((out_dim, in_dim), dtype=np.uint8)
    nib[:, 0::2] = lo
    nib[:, 1::2] = hi
    return nib


def case(fmt, out_dim, in_dim, rank, batch):
    c = {"format": fmt, "out_dim": out_dim, "in_dim": in_dim, "rank": rank, "batch": batch}
    if fmt == "bf16":
        bits = bf16_bits(RNG.uniform(-0.1, 0.1, size=(out_dim, in_dim)))
        c["weight_bits"] = bits.ravel().tolist()
        w = bf16_value(bits)
    elif fmt == "fp8-block128":
        codes = e4m3_codes((out_dim, in_dim))
        tiles = (-(-out_dim // 128), -(-in_dim // 128))
        scales = RNG.uniform(1e-5, 1e-3, size=tiles).astype(np.float32)
        c["codes"] = codes.ravel().tolist()
        c["scales"] = scales.ravel().tolist()
        full = np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:out_dim, :in_dim]
        w = e4m3_value(codes) * full
    elif fmt in ("nvfp4", "mxfp4"):
        block = 16 if fmt == "nvfp4" else 32
        packed = RNG.integers(0, 256, size=(out_dim, in_dim // 2), dtype=np.uint8)
        if fmt == "nvfp4":
            scale_codes = (RNG.integers(0, 0x60, size=(out_dim, in_dim // block)) |
                           (RNG.integers(0, 2, size=(out_dim, in_dim // block)) << 7)).astype(np.uint8)
            glob = np.float32(RNG.uniform(1e-4, 1e-2))
            c["global_scale"] = float(glob)
            s = e4m3_value(scale_codes) * np.float64(glob)
        else:
            scale_codes = RNG.integers(118, 130, size=(out_dim, in_dim // block), dtype=np.uint8)
            s = e8m0_value(scale_codes)
        c["packed"] = packed.ravel().tolist()
        c["block_scales"] = scale_codes.ravel().tolist()
        w = e2m1_value(unpack(packed, out_dim, in_dim)) * np.repeat(s, block, 1)
    else:
        raise ValueError(fmt)
    a_bits = bf16_bits(RNG.uniform(-0.05, 0.05, size=(rank, in_dim)))
    b_bits = bf16_bits(RNG.uniform(-0.05, 0.05, size=(out_dim, rank)))
    scale = float(np.float32(RNG.uniform(0.25, 2.0)))
    x = RNG.uniform(-2, 2, size=(batch, in_dim)).astype(np.float32)
    y = x.astype(np.float64) @ w.T + scale * ((x.astype(np.float64) @ bf16_value(a_bits).T) @ bf16_value(b_bits).T)
    c.update({
        "lora_a_bits": a_bits.ravel().tolist(),
        "lora_b_bits": b_bits.ravel().tolist(),
        "lora_scale": scale,
        "x": x.ravel().tolist(),
        "y": y.ravel().tolist(),
    })
    return c


def main():
    cases = [
        case("bf16", 9, 40, 3, 2),
        case("fp8-block128", 130, 140, 4, 3),
        case("nvfp4", 7, 64, 5, 10),
        case("mxfp4", 6, 64, 2, 1),
    ]
    with open(sys.argv[1], "w") as f:
        json.dump({"generator": "scripts/kernels_oracle.py", "numpy": np.__version__,
                   "ml_dtypes": ml_dtypes.__version__, "cases": cases}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
