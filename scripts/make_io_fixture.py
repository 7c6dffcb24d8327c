#!/usr/bin/env python3
"""Writes tests/data/io/python_written.safetensors with the Python `safetensors`
package (its Rust-backed `serialize_file`, the writer every HF tool uses), and
python_written.json with the expected dtype, shape and values, computed with numpy
and ml_dtypes, so loraq-io's reader is checked against an independent producer.

Pinned: safetensors==0.6.2 numpy==2.1.3 ml_dtypes==0.5.1
Run: python scripts/make_io_fixture.py (from the repository root)
"""
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors import serialize_file

out = pathlib.Path("tests/data/io")
out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(20261129)

arrays = {
    "model.layers.0.mlp.up_proj.weight": rng.normal(size=(6, 10)).astype(ml_dtypes.bfloat16),
    "model.layers.0.self_attn.q_norm.weight": rng.normal(size=(10,)).astype(np.float16),
    "model.layers.0.linear_attn.A_log": rng.normal(size=(4,)).astype(np.float32),
    "model.layers.0.mlp.down_proj.weight": np.concatenate(
        [rng.normal(scale=100, size=(30,)), [448.0, -448.0, 0.0, -0.0, 2.0**-9]]
    ).astype(ml_dtypes.float8_e4m3fn).reshape(5, 7),
    "scale_e5m2": np.array([1.0, -57344.0, 2.0**-16, 3.5], dtype=ml_dtypes.float8_e5m2),
    "model.layers.0.mlp.gate_proj.weight_packed": rng.integers(0, 256, size=(3, 4), dtype=np.uint8),
    "scalar": np.array(0.125, dtype=np.float64),
}
names = {
    ml_dtypes.bfloat16: "BF16",
    np.float16: "F16",
    np.float32: "F32",
    np.float64: "F64",
    ml_dtypes.float8_e4m3fn: "F8_E4M3",
    ml_dtypes.float8_e5m2: "F8_E5M2",
    np.uint8: "U8",
}
# serialize_file takes torch's dtype names; the file records safetensors' names.
torch_names = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U8": "uint8",
}
tensors = {}
expected = {}
for name, a in arrays.items():
    dtype = names[a.dtype.type]
    tensors[name] = {"dtype": torch_names[dtype], "shape": list(a.shape), "data": a.tobytes()}
    entry = {"dtype": dtype, "shape": list(a.shape)}
    if dtype == "U8":
        entry["bytes"] = a.reshape(-1).tolist()
    else:
        entry["values_f32"] = [float(v) for v in a.astype(np.float32).reshape(-1)]
    expected[name] = entry

serialize_file(tensors, str(out / "python_written.safetensors"), metadata={"format": "pt"})
(out / "python_written.json").write_text(json.dumps({"tensors": expected}, indent=1) + "\n")
print("wrote", out)
