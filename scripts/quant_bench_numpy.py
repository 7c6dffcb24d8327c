#!/usr/bin/env python3
"""Ratio of loraq-quant's fake-quant speed to numpy + ml_dtypes on the same formulas.

Times fp8-block128 and nvfp4 fake-quant of a 17408x5120 matrix (bf16-representable
values, widened to f32 once, as the Rust bench does) with vectorized numpy versions
of the formulas in docs/quantization.md, checks that they give the same values as
the oracle functions of scripts/quant_oracle.py on a slice, then reads the Rust
figures that `cargo bench -p loraq-quant --bench quant` left in
target/criterion and prints the ratio. Throughput is in bytes of bf16 input.

Run on an idle machine, same thread count for both sides (numpy is single-threaded
here; use RAYON_NUM_THREADS=1 for the Rust bench for a per-core ratio):

    RAYON_NUM_THREADS=1 cargo bench -p loraq-quant --bench quant -- fake_quant_into
    python scripts/quant_bench_numpy.py [--criterion target/criterion]

Pinned versions: scripts/requirements-quant.txt.
"""

import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_oracle as oracle  # noqa: E402

F32 = np.float32
ROWS, COLS = 17408, 5120
GROUP = "quant_17408x5120"


def weights(rng):
    values = (rng.standard_normal((ROWS, COLS), dtype=F32) * F32(0.02)).astype(F32)
    values.flat[:: 100_003] *= F32(100)
    return values.astype(ml_dtypes.bfloat16).astype(F32)


def fp8_block128(w):
    rows, cols = w.shape
    tiles = w.reshape(rows // 128, 128, cols // 128, 128)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale = np.where(amax == 0, F32(1), amax / F32(448)).astype(F32)
    s = scale[:, None, :, None]
    q = np.clip(tiles / s, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(F32) * s).reshape(rows, cols)


def nvfp4(w):
    rows, cols = w.shape
    amax = np.abs(w).max()
    g = F32(1) if amax == 0 else F32(amax / F32(2688))
    blocks = w.reshape(rows, cols // 16, 16)
    amax_b = np.abs(blocks).max(axis=2)
    ratio = np.clip(amax_b / (F32(6) * g), F32(2.0**-9), F32(448)).astype(F32)
    ratio = np.where(amax_b == 0, F32(1), ratio)
    block_scale = ratio.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    q = np.clip(blocks / (block_scale * g)[:, :, None], F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn)
    return ((q.astype(F32) * block_scale[:, :, None]) * g).reshape(rows, cols)


def best_of(function, argument, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(argument)
        times.append(time.perf_counter() - start)
    return min(times)


def criterion_seconds(root, bench):
    path = os.path.join(root, GROUP, bench.replace("/", "_"), "new", "estimates.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"] / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criterion", default="target/criterion")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w = weights(rng)
    # Same formulas as the oracle (which is checked bit for bit against Rust).
    part = w[:256, :512]
    assert np.array_equal(fp8_block128(part), oracle.fp8(part, "block")[1])
    assert np.array_equal(nvfp4(part), oracle.nvfp4(part)[1])
    bf16_bytes = ROWS * COLS * 2
    print(f"{'scheme':<14} {'numpy GB/s':>11} {'rust GB/s':>10} {'ratio':>7}")
    for scheme, function in [("fp8-block128", fp8_block128), ("nvfp4", nvfp4)]:
        seconds = best_of(function, w, args.repeats)
        rust = criterion_seconds(args.criterion, f"fake_quant_into/{scheme}")
        rust_text = f"{bf16_bytes / rust / 1e9:>10.2f}" if rust else f"{'-':>10}"
        ratio = f"{seconds / rust:>7.1f}" if rust else f"{'-':>7}"
        print(f"{scheme:<14} {bf16_bytes / seconds / 1e9:>11.3f} {rust_text} {ratio}")


if __name__ == "__main__":
    main()
