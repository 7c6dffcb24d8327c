#!/usr/bin/env python3
"""Reference timings for loraq's factorization bench, on the same matrix.

`cargo bench -p loraq-extract --bench factorize` writes the 17408x5120 rank-256 delta
(raw little-endian f32, row-major) and a JSON summary of loraq's run to $LORAQ_BENCH_DIR
(default: the temp dir). This script loads that matrix and times, in this process:

  * torch.svd_lowrank(D, q=272, niter=2)   (the goal: loraq at most 0.5x its time)
  * torch.linalg.svd(D, full_matrices=False) (f32, exact truncated SVD)
  * the f64 Gram eigendecomposition of the smaller side (D^T D, 5120x5120)

and for each the rank-256 truncation residual over the bf16 rounding floor, then prints
the ratios against loraq's figures. Run both on the same machine, one after the other.

Pinned: python 3.11, torch==2.15.0 (CPU), numpy==2.4.6.
With --interleave, and the pair the delta is the difference of beside it
(delta_ROWSxCOLS.merged.bf16 / .base.bf16, written by the same bench), it also alternates
factor_file --pair (the whole per-projection run: the delta from the two bf16 weights,
the factorization and the bf16 cast, as loraq extract runs it) with torch.svd_lowrank and
prints a "whole:" line against torch's runs of the same loop.
With --cast FACTOR_FILE_BIN it also runs loraq's factor_file with a factors file, reads
the bf16 lora_B / lora_A it wrote, and gives the exact residual after the bf16 cast,
||D - B_bf16 A_bf16||_F in f64, over torch.svd_lowrank's residual with its f32 factors.

Usage: python scripts/bench_svd_reference.py [--dir DIR] [--rows 17408] [--cols 5120] [--skip-full]
       [--repeat N] [--interleave target/release/examples/factor_file] [--cast target/release/examples/factor_file]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

RANK = 256


def residual(d: torch.Tensor, u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> float:
    """||D - U_r S_r V_r^T||_F in f64, by blocks of rows."""
    total = 0.0
    u, s, v = u[:, :RANK].double(), s[:RANK].double(), v[:, :RANK].double()
    for start in range(0, d.shape[0], 2048):
        block = d[start:start + 2048].double()
        approx = (u[start:start + 2048] * s) @ v.T
        total += float(((block - approx) ** 2).sum())
    return total ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=os.environ.get("LORAQ_BENCH_DIR", tempfile.gettempdir()))
    parser.add_argument("--rows", type=int, default=17408)
    parser.add_argument("--cols", type=int, default=5120)
    parser.add_argument("--skip-full", action="store_true", help="skip torch.linalg.svd and the Gram method")
    parser.add_argument("--repeat", type=int, default=3, help="best of N for torch.svd_lowrank (loraq's bench is best of 3)")
    parser.add_argument("--interleave", metavar="FACTOR_FILE_BIN", help="alternate N runs of loraq's "
                        "factor_file example (path to the built binary) with N of torch.svd_lowrank and "
                        "compare the best of each: fair on a machine shared with other work. Each "
                        "factor_file run times its second factorization (--warm-up), as torch's "
                        "calls follow a warm-up call")
    parser.add_argument("--cast", metavar="FACTOR_FILE_BIN", help="run loraq's factor_file with a "
                        "factors file and compare the exact residual of its bf16 factors with "
                        "torch.svd_lowrank's f32-factor residual")
    args = parser.parse_args()
    stem = os.path.join(args.dir, f"delta_{args.rows}x{args.cols}")
    summary = json.load(open(stem + ".json"))
    d = torch.from_numpy(np.fromfile(stem + ".f32", dtype="<f4").reshape(args.rows, args.cols))
    floor = summary["floor"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; delta {args.rows}x{args.cols}, "
          f"||D|| {summary['delta_norm']:.4e}, floor {floor:.4e}")

    torch.manual_seed(0)
    torch.svd_lowrank(d, q=RANK + 16, niter=2)  # warm-up: allocations, thread pool
    if args.interleave:
        # The whole per-projection run (delta from the two bf16 weights, factorization,
        # cast) when the factorize bench wrote the pair the delta comes from.
        pair = [stem + ".merged.bf16", stem + ".base.bf16"]
        whole = all(os.path.exists(p) for p in pair)
        ours, theirs, cold, ours_whole, cold_whole = [], [], [], [], []

        def factor_file(*rest: str) -> dict:
            """One warm factor_file run (--warm-up), its JSON line."""
            return json.loads(subprocess.run([args.interleave, "--warm-up", *rest], check=True,
                                             capture_output=True, text=True).stdout)

        def torch_run() -> None:
            t = time.perf_counter()
            torch.svd_lowrank(d, q=RANK + 16, niter=2)
            theirs.append(time.perf_counter() - t)

        for _ in range(args.repeat):
            # --warm-up: factor_file runs the factorization once untimed first, as torch
            # was called once above before it is timed (its cold run is printed too).
            out = factor_file(stem + ".f32", str(args.rows), str(args.cols), repr(floor))
            ours.append(out["seconds"])
            cold.append(out["cold_seconds"])
            torch_run()
            if whole:
                out = factor_file("--pair", *pair, str(args.rows), str(args.cols))
                ours_whole.append(out["seconds"])
                cold_whole.append(out["cold_seconds"])
                torch_run()

        def best_median(xs: list) -> tuple:
            # The median of an even count (torch's six calls) is the mean of the middle two.
            return min(xs), statistics.median(xs)

        print("interleaved, seconds per run:")
        print("  loraq randomized:  " + " ".join(f"{x:.3f}" for x in ours))
        print("  loraq, cold run:   " + " ".join(f"{x:.3f}" for x in cold))
        if whole:
            print("  loraq whole run:   " + " ".join(f"{x:.3f}" for x in ours_whole))
            print("  whole, cold run:   " + " ".join(f"{x:.3f}" for x in cold_whole))
        print("  torch.svd_lowrank: " + " ".join(f"{x:.3f}" for x in theirs))
        (ob, om), (tb, tm) = best_median(ours), best_median(theirs)
        print(f"best: loraq {ob:.3f} s, torch {tb:.3f} s, ratio {ob / tb:.3f}; "
              f"median: loraq {om:.3f} s, torch {tm:.3f} s, ratio {om / tm:.3f}", flush=True)
        print("cold: loraq {:.3f} s best, {:.3f} s median".format(*best_median(cold)), flush=True)
        if whole:
            (wb, wm), (cb, cm) = best_median(ours_whole), best_median(cold_whole)
            print(f"whole: loraq {wb:.3f} s, torch {tb:.3f} s, ratio {wb / tb:.3f}; "
                  f"median: loraq {wm:.3f} s, torch {tm:.3f} s, ratio {wm / tm:.3f}; "
                  f"cold: {cb:.3f} / {cm:.3f} s", flush=True)

    results = {}
    best = float("inf")
    for _ in range(args.repeat):
        t = time.perf_counter()
        u, s, v = torch.svd_lowrank(d, q=RANK + 16, niter=2)
        best = min(best, time.perf_counter() - t)
    results["torch.svd_lowrank(q=272, niter=2)"] = (best, residual(d, u, s, v))
    print(f"torch.svd_lowrank: best of {args.repeat} {best:.3f} s; loraq {summary['randomized_seconds']:.3f} s "
          f"(ratio {summary['randomized_seconds'] / best:.3f})", flush=True)

    if args.cast:
        # The factors go to a scratch directory, not --dir: the inputs may be read-only.
        with tempfile.TemporaryDirectory() as scratch:
            factors = os.path.join(scratch, "factors.bf16")
            out = subprocess.run([args.cast, stem + ".f32", str(args.rows), str(args.cols), repr(floor),
                                  str(RANK), factors], check=True, capture_output=True, text=True).stdout
            raw = np.fromfile(factors, dtype="<u2").astype(np.uint32) << 16
        line = json.loads(out)
        values = torch.from_numpy(raw.view(np.float32).copy())
        b = values[:args.rows * RANK].reshape(args.rows, RANK).double()
        a = values[args.rows * RANK:].reshape(RANK, args.cols).double()
        total = 0.0
        for start in range(0, args.rows, 2048):
            block = d[start:start + 2048].double() - b[start:start + 2048] @ a
            total += float((block ** 2).sum())
        after_cast = total ** 0.5
        torch_residual = results["torch.svd_lowrank(q=272, niter=2)"][1]
        print(f"loraq bf16 factors: residual after the cast {after_cast / floor:.5f} x floor "
              f"(report's estimate {(line['residual'] ** 2 + line['cast_error'] ** 2) ** 0.5 / floor:.5f}), "
              f"cast error {line['cast_error'] / summary['delta_norm'] * 100:.4f}% of ||D||; "
              f"over torch.svd_lowrank's f32-factor residual: {after_cast / torch_residual:.5f}", flush=True)

    if not args.skip_full:
        t = time.perf_counter()
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        results["torch.linalg.svd (f32)"] = (time.perf_counter() - t, residual(d, u, s, vh.T))

        t = time.perf_counter()
        dd = d.double()
        gram = dd.T @ dd
        evals, evecs = torch.linalg.eigh(gram)
        v = evecs[:, -RANK:].flip(1)
        s = evals[-RANK:].flip(0).clamp(min=0).sqrt()
        u = (dd @ v) / s
        results["f64 Gram eigh"] = (time.perf_counter() - t, residual(d, u.float(), s.float(), v.float()))

    ours_s = summary["randomized_seconds"]
    ours_res = summary["randomized_residual"]
    print(f"{'method':<36} {'seconds':>9} {'residual/floor':>15} {'loraq time ratio':>17} {'loraq residual ratio':>21}")
    print(f"{'loraq randomized':<36} {ours_s:>9.3f} {ours_res / floor:>15.5f} {'1':>17} {'1':>21}")
    for name, (secs, res) in results.items():
        print(f"{name:<36} {secs:>9.3f} {res / floor:>15.5f} {ours_s / secs:>17.3f} {ours_res / res:>21.6f}")


if __name__ == "__main__":
    main()
