#!/usr/bin/env python3
"""Test vectors for crates/loraq-quant, from an independent numpy + ml_dtypes oracle.

Writes tests/data/quant/ (raw little-endian arrays plus manifest.json):

* element formats: one shared set of f32 inputs (random, every tie of every format
  with its two neighbours, subnormals, +-0, overflow, Inf, NaN) and the codes
  ml_dtypes gives for each format; ml_dtypes' decode of every code.
* weight schemes: bf16 test matrices (outliers, all-zero blocks, partial 128-blocks)
  and, per scheme, the codes / scales / zero points computed here with the formulas of
  docs/quantization.md written directly in numpy, plus the SHA-256 of the
  dequantized f32 matrix.
* activation fake-quant outputs.

Element encoding here always goes through ml_dtypes casts (after the clamp that
quantizers apply), never through bit tricks, so the Rust encoder is checked against
an independent implementation.

Pinned versions: scripts/requirements-quant.txt (python 3.11, numpy 2.4.6,
ml_dtypes 0.6.0). Run: python scripts/quant_oracle.py [--out tests/data/quant]
"""

import argparse
import hashlib
import json
import os

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu

FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1, "e8m0": E8M0}


def codes_of(values, dtype):
    """ml_dtypes' codes of f32 values (one byte each; E2M1 in the low nibble)."""
    return np.asarray(values, dtype=F32).astype(dtype).view(np.uint8)


def decode_all(dtype, count):
    return np.arange(count, dtype=np.uint8).view(dtype).astype(F32)


# ----------------------------------------------------------------------------------
# Element formats


def element_inputs(rng):
    parts = []
    # Every representable value of each format, the midpoints between neighbours
    # (the ties) and the f32 neighbours of every midpoint, both signs.
    for name, dtype in FORMATS.items():
        count = 16 if name == "e2m1" else 256
        values = decode_all(dtype, count).astype(np.float64)
        values = np.unique(values[np.isfinite(values) & (values >= 0)])
        # Values just past the largest one too, so overflow rounding is covered.
        top = values[-1]
        step = values[-1] - values[-2]
        values = np.concatenate([values, [top + step, top + 2 * step, top * 2]])
        mids = ((values[:-1] + values[1:]) / 2).astype(F32)
        exact = values.astype(F32)
        for group in (exact, mids):
            parts += [group, np.nextafter(group, F32(np.inf)), np.nextafter(group, F32(0))]
    structured = np.concatenate(parts).astype(F32)
    # Log-uniform random magnitudes over every range these formats cover, and raw
    # random bit patterns (all exponents, f32 subnormals, Inf and NaN included).
    random = [
        (2.0 ** rng.uniform(-135, 135, size=100_000)).astype(F32),
        rng.integers(0, 2**31, size=20_000, dtype=np.uint32).view(F32),
        # f32 subnormals and the formats' own subnormal ranges.
        rng.integers(1, 1 << 23, size=2_000, dtype=np.uint32).view(F32),
        rng.uniform(0, 2.0**-6, size=2_000).astype(F32),
        rng.uniform(0, 2.0**-14, size=2_000).astype(F32),
        rng.uniform(0, 1.0, size=2_000).astype(F32),
    ]
    random = np.concatenate(random).astype(F32)
    signs = rng.integers(0, 2, size=random.size).astype(bool)
    random = np.where(signs, -random, random).astype(F32)
    specials = np.array(
        [0.0, np.inf, np.nan, 3.4028235e38, 1e-45, 1.1754944e-38, 2.0**-127, 2.0**-149],
        dtype=F32,
    )
    values = np.concatenate([structured, -structured, random, specials, -specials])
    return values


# ----------------------------------------------------------------------------------
# Weight schemes (formulas of docs/quantization.md, written with array slicing)


def e4m3_sat(values):
    return np.clip(values, F32(-448), F32(448)).astype(E4M3)


def e2m1_sat(values):
    return np.clip(values, F32(-6), F32(6)).astype(E2M1)


def fp8_scale(amax):
    amax = np.asarray(amax, dtype=F32)
    return np.where(amax == 0, F32(1), amax / F32(448)).astype(F32)


def fp8(weight, granularity):
    rows, cols = weight.shape
    if granularity == "tensor":
        scales = fp8_scale(np.abs(weight).max()).reshape(1, 1)
        full = np.broadcast_to(scales, weight.shape)
    elif granularity == "channel":
        scales = fp8_scale(np.abs(weight).max(axis=1)).reshape(rows, 1)
        full = np.broadcast_to(scales, weight.shape)
    else:
        br, bc = -(-rows // 128), -(-cols // 128)
        scales = np.zeros((br, bc), dtype=F32)
        for i in range(br):
            for j in range(bc):
                tile = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                scales[i, j] = fp8_scale(np.abs(tile).max())
        full = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:rows, :cols]
    codes = e4m3_sat(weight / full)
    dequant = (codes.astype(F32) * full).astype(F32)
    return {"codes": codes.view(np.uint8), "scales": scales.astype(F32)}, dequant


def nvfp4_global(amax):
    amax = F32(amax)
    return F32(1) if amax == 0 else F32(amax / F32(2688))


def nvfp4(weight, global_scale=None):
    rows, cols = weight.shape
    if global_scale is None:
        global_scale = nvfp4_global(np.abs(weight).max())
    g = F32(global_scale)
    blocks = weight.reshape(rows, cols // 16, 16)
    amax_b = np.abs(blocks).max(axis=2)
    ratio = np.clip(amax_b / (F32(6) * g), F32(2.0**-9), F32(448)).astype(F32)
    ratio = np.where(amax_b == 0, F32(1), ratio)
    scale_codes = ratio.astype(E4M3)
    block_scale = scale_codes.astype(F32)
    divisor = (block_scale * g).astype(F32)
    # "+ 0": ModelOpt encodes an exact -0.0 as code 0 (+0).
    q = e2m1_sat(blocks / divisor[:, :, None] + F32(0))
    qn = q.view(np.uint8).reshape(rows, cols)
    packed = (qn[:, 0::2] | (qn[:, 1::2] << 4)).astype(np.uint8)
    # ModelOpt's dequantize: e2m1 * (f32(s_b) * g), the divisor used above, with
    # code 8 read as +0 (its value table has no -0): "+ 0" does that.
    dequant = (q.astype(F32) * divisor[:, :, None] + F32(0)).astype(F32).reshape(rows, cols)
    return {
        "packed": packed,
        "block_scales": scale_codes.view(np.uint8),
        "global_scale": np.array([g], dtype=F32),
    }, dequant


def mxfp4(weight):
    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // 32, 32)
    amax_b = np.abs(blocks).max(axis=2).astype(np.float64)
    _, exponent = np.frexp(np.where(amax_b == 0, 1.0, amax_b))
    floor_log2 = np.where(amax_b == 0, -1000, exponent - 1)
    scale_exp = np.clip(floor_log2 - 2, -127, 127)
    scale = np.ldexp(np.float64(1), scale_exp).astype(F32)
    scale_codes = scale.astype(E8M0)
    assert (scale_codes.astype(F32) == scale).all()
    q = e2m1_sat(blocks / scale[:, :, None])
    qn = q.view(np.uint8).reshape(rows, cols)
    packed = (qn[:, 0::2] | (qn[:, 1::2] << 4)).astype(np.uint8)
    dequant = (q.astype(F32) * scale[:, :, None]).astype(F32).reshape(rows, cols)
    return {"packed": packed, "scales": scale_codes.view(np.uint8)}, dequant


def int4(weight, symmetric):
    rows, cols = weight.shape
    groups = -(-cols // 128)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((rows, groups), dtype=F32)
    zeros = np.zeros((rows, groups), dtype=np.uint8)
    dequant = np.zeros((rows, cols), dtype=F32)
    for r in range(rows):
        for j in range(groups):
            x = weight[r, j * 128 : (j + 1) * 128]
            if symmetric:
                amax = np.abs(x).max()
                s, z = (F32(1), 8) if amax == 0 else (F32((amax + amax) / F32(15)), 8)
            else:
                lo, hi = min(F32(x.min()), F32(0)), max(F32(x.max()), F32(0))
                if lo == 0 and hi == 0:
                    s, z = F32(1), 8
                else:
                    s = F32((hi - lo) / F32(15))
                    z = int(np.clip(np.rint(-lo / s), 0, 15))
            q = np.clip(np.rint(x / s) + F32(z), 0, 15).astype(np.uint8)
            codes[r, j * 128 : (j + 1) * 128] = q
            scales[r, j], zeros[r, j] = s, z
            dequant[r, j * 128 : (j + 1) * 128] = (q.astype(np.int32) - z).astype(F32) * s
    return {"codes": codes, "scales": scales, "zeros": zeros}, dequant


SCHEMES = {
    "fp8-tensor": lambda w: fp8(w, "tensor"),
    "fp8-channel": lambda w: fp8(w, "channel"),
    "fp8-block128": lambda w: fp8(w, "block"),
    "nvfp4": nvfp4,
    "mxfp4": mxfp4,
    "int4-g128-sym": lambda w: int4(w, True),
    "int4-g128-asym": lambda w: int4(w, False),
}


def test_weights(rng):
    """bf16-representable matrices: outliers, all-zero blocks, partial 128-blocks."""

    def bf16(values):
        return values.astype(ml_dtypes.bfloat16).astype(F32)

    a = rng.standard_normal((200, 320)).astype(F32) * F32(0.02)
    outliers = rng.integers(0, a.size, size=40)
    a.flat[outliers] *= F32(60)
    a[128:200, 256:320] = 0  # the whole bottom-right (partial) 128-tile
    a[3, 32:64] = 0  # one 32-block (two 16-blocks)
    a[7, 128:256] = 0  # one int4 group
    a[9, 0:16] = 1e-30  # a block whose NVFP4 scale is floored at 2^-9
    a[11, :] = 0  # an all-zero row (fp8-channel scale 1)
    a[13, 5] = 3.0  # the tensor max sits here
    a[15, 40:48] = -0.0  # ModelOpt encodes -0.0 as +0
    b = bf16(rng.standard_normal((130, 96)).astype(F32) * F32(0.5))
    b[:, :16] = bf16(rng.standard_normal((130, 16)).astype(F32) * F32(1e-3))
    zero = np.zeros((4, 32), dtype=F32)
    return {"a": bf16(a), "b": b, "zero": zero}


# ----------------------------------------------------------------------------------
# Activations


def act_per_token(x, eps):
    amax = np.maximum(np.abs(x).max(axis=1, keepdims=True), F32(eps))
    s = (amax / F32(448)).astype(F32)
    return (e4m3_sat(x / s).astype(F32) * s).astype(F32)


def act_per_group(x, eps):
    out = np.empty_like(x)
    for j in range(0, x.shape[1], 128):
        out[:, j : j + 128] = act_per_token(x[:, j : j + 128], eps)
    return out


def act_static(x, scale):
    s = F32(scale)
    return (e4m3_sat(x / s).astype(F32) * s).astype(F32)


def act_nvfp4(x, global_scale):
    _, dequant = nvfp4(x, global_scale)
    return dequant


def test_activations(rng):
    x = rng.standard_normal((24, 384)).astype(F32)
    x[:, 7] *= F32(40)  # an outlier channel
    x[5, :] = 0  # an all-zero token
    x[6, :] = F32(1e-4) * rng.standard_normal(384).astype(F32)  # below the per-token eps
    x[8, 128:256] = 0  # an all-zero group
    x[9, 16:32] = -0.0
    return x.astype(ml_dtypes.bfloat16).astype(F32)


# ----------------------------------------------------------------------------------


def write(out, name, array):
    data = np.ascontiguousarray(array)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    with open(os.path.join(out, name), "wb") as f:
        f.write(data.tobytes())
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/data/quant")
    args = parser.parse_args()
    out = args.out
    os.makedirs(out, exist_ok=True)
    np.seterr(over="ignore", invalid="ignore")  # Inf / NaN inputs are intended
    rng = np.random.default_rng(20261129)
    manifest = {
        "generator": "scripts/quant_oracle.py",
        "versions": {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__},
        "encoding": "raw little-endian arrays, row-major",
    }

    inputs = element_inputs(rng)
    elements = {"inputs": write(out, "element_inputs.f32", inputs), "count": int(inputs.size)}
    for name, dtype in FORMATS.items():
        count = 16 if name == "e2m1" else 256
        elements[name] = {
            "codes": write(out, f"element_{name}_codes.u8", codes_of(inputs, dtype)),
            "decode": write(out, f"element_{name}_decode.f32", decode_all(dtype, count)),
        }
    manifest["elements"] = elements

    weights = test_weights(rng)
    manifest["weights"] = {}
    for tensor, weight in weights.items():
        rows, cols = weight.shape
        entry = {
            "rows": rows,
            "cols": cols,
            "values": write(out, f"w_{tensor}.bf16", weight.astype(ml_dtypes.bfloat16).view(np.uint16)),
            "schemes": {},
        }
        for scheme, function in SCHEMES.items():
            if scheme == "nvfp4" and cols % 16 or scheme == "mxfp4" and cols % 32:
                continue
            arrays, dequant = function(weight)
            files = {}
            for key, array in arrays.items():
                suffix = {np.dtype(np.uint8): "u8", np.dtype(F32): "f32"}[array.dtype]
                files[key] = write(out, f"w_{tensor}_{scheme}_{key}.{suffix}", array)
            files["dequant_sha256"] = hashlib.sha256(dequant.astype("<f4").tobytes()).hexdigest()
            entry["schemes"][scheme] = files
        manifest["weights"][tensor] = entry

    x = test_activations(rng)
    amax = np.abs(x).max()
    static_scale = F32(amax / F32(448) * F32(0.25))  # saturates the outlier channel
    nvfp4_global_scale = F32(amax / F32(2688) * F32(0.05))  # block scales clamp at 448
    manifest["activations"] = {
        "tokens": x.shape[0],
        "hidden": x.shape[1],
        "values": write(out, "act_x.f32", x),
        "static_scale": float(static_scale),
        "nvfp4_global_scale": float(nvfp4_global_scale),
        "per_token_eps": 2.0**-9,
        "per_group_eps": 1e-10,
        "fp8_per_token": write(out, "act_fp8_per_token.f32", act_per_token(x, F32(2.0**-9))),
        "fp8_per_group": write(out, "act_fp8_per_group.f32", act_per_group(x, F32(1e-10))),
        "fp8_static": write(out, "act_fp8_static.f32", act_static(x, static_scale)),
        "nvfp4_dynamic": write(out, "act_nvfp4_dynamic.f32", act_nvfp4(x, nvfp4_global_scale)),
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
