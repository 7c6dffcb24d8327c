#!/usr/bin/env python3
"""Oracle vectors for loraq-extract's numerics, from numpy and ml_dtypes.

Writes crates/loraq-extract/tests/data/oracle.json:
  * floors: bf16 tensors (as u16 bits) and their rounding floor
    sqrt(sum(spacing(m)^2) / 12), with ml_dtypes' np.spacing as the ulp;
  * svd: deltas D = f32(merged) - f32(base) of bf16 low-rank merges (f32 values) and
    numpy's f64 SVD of them: leading singular values and the truncated residuals
    sqrt(sum_{i>k} s_i^2) at a few ranks.

Pinned: python 3.11, numpy==2.4.6, ml_dtypes==0.6.0. Run from the repository root:
    python scripts/extract_oracle.py
"""

import json
import os

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
rng = np.random.default_rng(20261129)


def floor_case(n: int, scale: float) -> dict:
    values = (rng.standard_normal(n) * scale).astype(np.float32)
    values[:3] = [0.0, -0.0, 1e-40]  # zero, negative zero, a subnormal
    values[3] = 3.0e38  # near the top of the range
    m = values.astype(BF16)
    ulp = np.abs(np.spacing(m).astype(np.float64))
    return {
        "bits": m.view(np.uint16).tolist(),
        "floor": float(np.sqrt((ulp ** 2).sum() / 12.0)),
    }


def svd_case(rows: int, cols: int, rank: int, relative: float, ranks: list) -> dict:
    base = (rng.standard_normal((rows, cols)) * 0.02).astype(BF16)
    left = rng.standard_normal((rows, rank))
    right = rng.standard_normal((rank, cols)) * np.logspace(0, -1, rank)[:, None]
    low = left @ right
    base32 = base.astype(np.float32)
    low *= relative * np.linalg.norm(base32) / np.linalg.norm(low)
    merged = (base32 + low.astype(np.float32)).astype(BF16)
    delta = merged.astype(np.float32) - base32
    s = np.linalg.svd(delta.astype(np.float64), compute_uv=False)
    return {
        "rows": rows,
        "cols": cols,
        "true_rank": rank,
        "delta": delta.ravel().tolist(),
        "singular_values": s[:12].tolist(),
        "residuals": {str(k): float(np.sqrt((s[k:] ** 2).sum())) for k in ranks},
        "delta_norm": float(np.sqrt((s ** 2).sum())),
    }


def main() -> None:
    out = {
        "generator": f"scripts/extract_oracle.py numpy {np.__version__} ml_dtypes {ml_dtypes.__version__}",
        "floors": [floor_case(700, 0.02), floor_case(300, 3.0)],
        "svd": [
            svd_case(96, 40, 5, 0.1, [2, 5, 8]),
            svd_case(30, 120, 4, 0.05, [1, 4, 6]),
            svd_case(200, 64, 6, 0.2, [3, 6, 10]),
        ],
    }
    path = os.path.join("crates", "loraq-extract", "tests", "data", "oracle.json")
    with open(path, "w") as f:
        json.dump(out, f)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
