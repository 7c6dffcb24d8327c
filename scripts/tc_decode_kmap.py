"""Checks the tensor-core decode's k-slot map (kernels/lora_decode.cu, TC_CHUNK) against
the PTX fragment layout of mma.m16n8k16: builds the A (16x16) and B (16x8) fragments the
32 lanes supply at each of the 8 steps of a 128-wide chunk, and verifies that every
fragment element is supplied exactly once and that the 8 products sum to W . X^T.

Run: python3 scripts/tc_decode_kmap.py  (numpy)
"""

import numpy as np


def main() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 128))  # 16 weight rows of one chunk
    x = rng.standard_normal((8, 128))  # 8 tokens (one n-tile)
    c = np.zeros((16, 8))
    for s in range(8):
        a_frag = np.full((16, 16), np.nan)
        b_frag = np.full((16, 8), np.nan)
        for lane in range(32):
            g, q = lane // 4, lane % 4
            # Word u of a lane's 32 values: elements 32q + 2u, 32q + 2u + 1.
            def words(row):
                return [(row[32 * q + 2 * u], row[32 * q + 2 * u + 1]) for u in range(16)]

            row_lo, row_hi, xw = words(w[g]), words(w[g + 8]), words(x[g])
            a = [row_lo[2 * s], row_hi[2 * s], row_lo[2 * s + 1], row_hi[2 * s + 1]]
            b = [xw[2 * s], xw[2 * s + 1]]
            # PTX: A register i holds row g (i = 0, 2) or g + 8 (i = 1, 3), columns
            # 2q + e (+ 8 for i >= 2); B register i holds k = 2q + e (+ 8 for i = 1),
            # column g.
            for i in range(4):
                for e in range(2):
                    r = g if i in (0, 2) else g + 8
                    col = 2 * q + e + (8 if i >= 2 else 0)
                    assert np.isnan(a_frag[r, col]), "A element supplied twice"
                    a_frag[r, col] = a[i][e]
            for i in range(2):
                for e in range(2):
                    k = 2 * q + e + (8 if i == 1 else 0)
                    assert np.isnan(b_frag[k, g]), "B element supplied twice"
                    b_frag[k, g] = b[i][e]
        assert not np.isnan(a_frag).any() and not np.isnan(b_frag).any()
        c += a_frag @ b_frag
    err = np.abs(c - w @ x.T).max()
    assert err < 1e-12, err
    print(f"k-slot map ok: 8 steps reproduce W . X^T (max error {err:.1e})")


if __name__ == "__main__":
    main()
