#!/usr/bin/env python3
"""Oracle vectors for the ggml block types (crates/loraq-quant/src/ggml, tests
crates/loraq-quant/tests/oracle_gguf_blocks.rs), written to tests/data/gguf_blocks/.

Two independent implementations of the llama.cpp that llama-cpp-python 0.3.36
vendors give the expected values:

* gguf-py (that llama.cpp's gguf-py/gguf/quants.py, numpy): dequantize of every
  type; quantize of F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
* libggml-base (ggml's C, built from the same sdist, called with ctypes):
  `ggml_quantize_chunk` without an importance matrix for every quantized type (what
  llama-quantize calls), and the type traits' `to_float` (`dequantize_row_*`).

Every decode is checked here to agree between the two (bitwise); every gguf-py
quantization is checked to agree with ggml's byte for byte (the manifest lists any
case where it does not). The committed expected bytes are ggml's.

With --llama-cpp-src (the sdist's vendor/llama.cpp), it also copies the sections for
the file types Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0 and IQ4_XS of llama.cpp's own
type-selection snapshots (tests/snapshots/*.schema, written by
tests/test-quant-type-selection.cpp from the tensor lists of the published GGUF
files) of Qwen3-0.6B, Qwen3-14B (qwen3) and Qwen3.6-27B (qwen35) to mix/, the
oracle of loraq's port of llama-quantize's per-tensor type choice.

Build libggml-base (CPU, portable, ~2 minutes on 2 cores) from the sdist:

    TOOLS=~/.cache/loraq-ci/llama-build-tools-venv/bin
    $TOOLS/pip download --no-deps --no-binary :all: --no-build-isolation \\
        llama-cpp-python==0.3.36 -d SDIST && tar -xzf SDIST/llama_cpp_python-0.3.36.tar.gz -C SDIST
    PATH=$TOOLS:$PATH cmake -S SDIST/llama_cpp_python-0.3.36/vendor/llama.cpp -B BUILD -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF \\
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=OFF
    PATH=$TOOLS:$PATH cmake --build BUILD --target ggml-base

then

    python scripts/gguf_blocks_oracle.py --libggml BUILD/bin/libggml-base.so \\
        --gguf-py ~/.cache/loraq-ci/llama-server-0.3.36/llama.cpp/gguf-py

(x86-64: ggml-base is compiled without FMA, so its float operations are the C
source's, one rounding each, as loraq's port computes them.)
"""

import argparse
import ctypes
import hashlib
import json
import pathlib
import sys

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf_blocks"

# name -> (ggml id, elements per block, bytes per block)
TYPES = {
    "f32": (0, 1, 4),
    "f16": (1, 1, 2),
    "bf16": (30, 1, 2),
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34),
    "q2_K": (10, 256, 84),
    "q3_K": (11, 256, 110),
    "q4_K": (12, 256, 144),
    "q5_K": (13, 256, 176),
    "q6_K": (14, 256, 210),
    "iq4_nl": (20, 32, 18),
    "iq4_xs": (23, 256, 136),
    "mxfp4": (39, 32, 17),
}
# gguf-py quantizes these (bit-exact with ggml, checked below).
GGUF_PY_QUANTIZE = ["f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
# loraq quantizes these; ggml_quantize_chunk is the oracle.
QUANTIZED = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K",
             "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs"]
# f16 scale fields (byte offsets in a block) of the types whose decode vectors
# come from random bytes: the random f16 there is replaced by a finite one.
F16_FIELDS = {
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
    "q2_K": [80, 82], "q3_K": [108], "q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208],
    "iq4_nl": [0], "iq4_xs": [0],
}


class TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


class Ggml:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p]
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        self.to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

    def quantize(self, name, values):
        tid, blck, size = TYPES[name]
        rows, n = values.shape
        src = np.ascontiguousarray(values, dtype=np.float32)
        dst = np.zeros(rows * (n // blck) * size, dtype=np.uint8)
        written = self.lib.ggml_quantize_chunk(tid, src.ctypes.data, dst.ctypes.data, 0, rows, n, None)
        assert written == dst.size, (name, written, dst.size)
        return dst

    def dequantize(self, name, data, n_elements):
        tid, _, _ = TYPES[name]
        if name == "f32":
            return data.view(np.float32).copy()
        traits = self.lib.ggml_get_type_traits(tid).contents
        out = np.zeros(n_elements, dtype=np.float32)
        self.to_float_t(traits.to_float)(data.ctypes.data, out.ctypes.data, n_elements)
        return out


def gguf_type(gguf, name):
    return getattr(gguf.GGMLQuantizationType, name.upper())


def same_bits(a, b):
    a = np.asarray(a, dtype=np.float32).view(np.uint32)
    b = np.asarray(b, dtype=np.float32).view(np.uint32)
    nan_a = (a & 0x7FFFFFFF) > 0x7F800000
    nan_b = (b & 0x7FFFFFFF) > 0x7F800000
    return bool(np.all((a == b) | (nan_a & nan_b)))


def quantize_cases(rng):
    """Awkward inputs, each (name, matrix); the widths are multiples of 256 unless
    the name says otherwise (those run on the 32-element types only)."""
    cases = []
    g = rng.standard_normal((4, 512)).astype(np.float32) * np.float32(0.02)
    cases.append(("gaussian", g))
    # bf16-representable values, as llama-quantize reads them from a bf16 checkpoint
    b = (rng.standard_normal((4, 512)).astype(np.float32) * np.float32(0.05)).view(np.uint32)
    cases.append(("bf16_values", (b & np.uint32(0xFFFF0000)).view(np.float32)))
    cases.append(("zeros", np.zeros((2, 256), dtype=np.float32)))
    o = rng.standard_normal((2, 512)).astype(np.float32) * np.float32(0.01)
    o[0, 37] = 900.0
    o[1, 300] = -0.75
    cases.append(("outlier", o))
    # f32 subnormals, f16-subnormal-sized scales and tiny normals: blocks whose
    # scale underflows f16 or whose reciprocal overflows f32
    d = np.stack([
        rng.uniform(-1, 1, 256).astype(np.float32) * np.float32(1e-39),
        rng.uniform(-1, 1, 256).astype(np.float32) * np.float32(1e-6),
        rng.uniform(-1, 1, 256).astype(np.float32) * np.float32(3e-38),
        rng.uniform(-1, 1, 256).astype(np.float32) * np.float32(1e-3),
    ])
    cases.append(("denormal_small", d))
    cases.append(("negative_only", -np.abs(rng.standard_normal((2, 512)).astype(np.float32)) * np.float32(0.1)))
    # multiples of 1/8: quotients land exactly on .5 for many scales
    t = (rng.integers(-64, 65, (4, 256)).astype(np.float32) / np.float32(8.0))
    t[0, :32] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    cases.append(("half_ties", t))
    # one scale per row over nine decades, and rows with a constant value
    s = rng.standard_normal((12, 256)).astype(np.float32)
    s *= np.logspace(-6, 3, 12, dtype=np.float32)[:, None]
    s[10, :] = np.float32(0.3)
    s[11, :] = np.float32(-2.5)
    cases.append(("scales", s))
    cases.append(("width96", rng.standard_normal((3, 96)).astype(np.float32) * np.float32(0.1)))
    return cases


def decode_blocks(rng, name, ggml):
    """Blocks to decode: random bytes with finite f16 scales (every code pattern
    occurs), plus ggml's quantization of a gaussian row."""
    _, blck, size = TYPES[name]
    n_random = 12 if blck == 256 else (48 if blck == 32 else 256)
    raw = rng.integers(0, 256, (n_random, size), dtype=np.uint8)
    if name in ("f16",):
        raw = rng.standard_normal(n_random).astype(np.float16).view(np.uint8).reshape(n_random, size)
        raw[:4] = np.array([0x00, 0x00, 0x01, 0x00, 0xFF, 0x7B, 0x00, 0x80], dtype=np.uint8).reshape(4, 2)
    if name in ("f32",):
        raw = rng.standard_normal(n_random).astype(np.float32).view(np.uint8).reshape(n_random, size)
    for off in F16_FIELDS.get(name, []):
        mags = np.concatenate([
            rng.uniform(1e-4, 1.0, n_random // 2),
            rng.uniform(1e-7, 6e-5, n_random - n_random // 2),  # f16 subnormals
        ]).astype(np.float32)
        signs = np.where(rng.random(n_random) < 0.3, -1.0, 1.0).astype(np.float32)
        raw[:, off:off + 2] = (mags * signs).astype(np.float16).view(np.uint8).reshape(n_random, 2)
    blocks = raw.reshape(-1)
    if name in QUANTIZED and blck > 1:
        row = rng.standard_normal((1, 256 if blck == 256 else 64)).astype(np.float32)
        blocks = np.concatenate([blocks, ggml.quantize(name, row)])
    return blocks


class TypeTraitsCpu(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


def activation_vectors(ggml, rng, manifest):
    """llama.cpp's CPU activation quantization (libggml-cpu's from_float of Q8_0 and
    Q8_K, the x86 AVX2 build), dequantized as the dot products read it: Q8_0 blocks
    `q * f16 d`, Q8_K blocks `q * f32 d`."""
    cpu = ctypes.CDLL(str(pathlib.Path(ggml.lib._name).with_name("libggml-cpu.so")))
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[0, :32] = 0.0                                          # an all-zero block
    x[0, 32:64] = np.arange(-16, 16, dtype=np.float32) * np.float32(127 / 32.0)  # ties
    x[1, 7] = 3000.0                                         # an outlier
    x[2, 256:] *= np.float32(1e-30)                          # tiny values
    x[2, :256] = -np.abs(x[2, :256])                         # negative-only block
    (OUT / "act_x.f32").write_bytes(x.astype("<f4").tobytes())
    manifest["activations"] = {"input": "act_x.f32", "tokens": 3, "hidden": 512}
    for name, tid, blck, size in (("q8_0", 8, 32, 34), ("q8_K", 15, 256, 292)):
        traits = cpu.ggml_get_type_traits_cpu(tid).contents
        out = np.zeros(x.size // blck * size, dtype=np.uint8)
        from_float_t(traits.from_float)(x.ctypes.data, out.ctypes.data, x.size)
        blocks = out.reshape(-1, size)
        if name == "q8_0":
            d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            q = blocks[:, 2:].view(np.int8).astype(np.float32)
        else:
            d = blocks[:, :4].copy().view(np.float32)
            q = blocks[:, 4:4 + 256].view(np.int8).astype(np.float32)
        values = (q * d).reshape(-1)
        (OUT / f"act_{name}.f32").write_bytes(values.astype("<f4").tobytes())
        manifest["activations"][name] = f"act_{name}.f32"


MIX_FTYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS"]
MIX_MODELS = ["qwen3-0.6b", "qwen3-14b", "qwen3.6-27b"]


def copy_snapshots(src, dst):
    """The header and the six file types' sections of llama.cpp's snapshots."""
    dst.mkdir(parents=True, exist_ok=True)
    for model in MIX_MODELS:
        lines = (src / f"{model}.schema").read_text().splitlines()
        out = [f"# From llama.cpp tests/snapshots/{model}.schema (llama-cpp-python 0.3.36 sdist),"]
        out.append("# the sections of the file types loraq plans; format: [FTYPE] default type,")
        out.append("# then every tensor whose type differs from it.")
        out += [line for line in lines if line.startswith("# ")]
        keep = False
        for line in lines:
            if line.startswith("["):
                keep = line[1:line.index("]")] in MIX_FTYPES
                if keep:
                    out.append("")
            if keep and line.strip():
                out.append(line)
        (dst / f"{model}.schema").write_text("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libggml", required=True, help="path to libggml-base.so")
    parser.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py directory")
    parser.add_argument("--llama-cpp-src", help="the sdist's vendor/llama.cpp (for the type-selection snapshots)")
    args = parser.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: E402
    from gguf import quants  # noqa: E402

    ggml = Ggml(args.libggml)
    rng = np.random.default_rng(18)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        if old.is_file():
            old.unlink()
    manifest = {"source": "scripts/gguf_blocks_oracle.py", "llama_cpp": "llama-cpp-python 0.3.36 sdist",
                "decode": {}, "quantize": {"cases": [], "expected": {}}, "gguf_py_quantize_differs": []}

    # decode: gguf-py and ggml agree bitwise; the expected values are gguf-py's
    for name, (_, blck, size) in TYPES.items():
        blocks = decode_blocks(rng, name, ggml)
        n_elements = blocks.size // size * blck
        ours = quants.dequantize(blocks.reshape(1, -1), gguf_type(gguf, name)).reshape(-1).astype(np.float32)
        theirs = ggml.dequantize(name, blocks, n_elements)
        assert same_bits(ours, theirs), f"gguf-py and ggml decode {name} differently"
        (OUT / f"decode_{name}.bin").write_bytes(blocks.tobytes())
        (OUT / f"decode_{name}.f32").write_bytes(ours.astype("<f4").tobytes())
        manifest["decode"][name] = {"blocks": f"decode_{name}.bin", "values": f"decode_{name}.f32",
                                    "elements": int(n_elements)}

    # quantize: ggml_quantize_chunk; gguf-py's numpy quantizers checked against it
    for case, values in quantize_cases(rng):
        rows, width = values.shape
        (OUT / f"input_{case}.f32").write_bytes(values.astype("<f4").tobytes())
        manifest["quantize"]["cases"].append({"name": case, "input": f"input_{case}.f32",
                                              "out_features": rows, "in_features": width})
        for name in QUANTIZED:
            blck = TYPES[name][1]
            if width % blck:
                continue
            data = ggml.quantize(name, values)
            if name in GGUF_PY_QUANTIZE:
                py = quants.quantize(values, gguf_type(gguf, name)).reshape(-1).view(np.uint8)
                if not np.array_equal(py, data):
                    manifest["gguf_py_quantize_differs"].append(f"{name}/{case}")
            decoded = ggml.dequantize(name, data, values.size)
            key = f"{name}/{case}"
            fname = f"q_{name}_{case}.bin"
            (OUT / fname).write_bytes(data.tobytes())
            manifest["quantize"]["expected"][key] = {
                "bytes": fname,
                "decode_sha256": hashlib.sha256(decoded.astype("<f4").tobytes()).hexdigest(),
            }
    activation_vectors(ggml, rng, manifest)
    if args.llama_cpp_src:
        copy_snapshots(pathlib.Path(args.llama_cpp_src) / "tests" / "snapshots", OUT / "mix")
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {len(list(OUT.iterdir()))} files, {total} bytes, to {OUT}")
    print("gguf-py quantize differs from ggml on:", manifest["gguf_py_quantize_differs"] or "nothing")


if __name__ == "__main__":
    main()
