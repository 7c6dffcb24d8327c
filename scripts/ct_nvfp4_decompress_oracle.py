#!/usr/bin/env python3
"""Oracle: compressed-tensors reads and decompresses an NVFP4 checkpoint loraq wrote.

Usage: python scripts/ct_nvfp4_decompress_oracle.py CHECKPOINT_DIR OUT_DIR

Run by tests/quantize_nvfp4_serving.rs through tests/common run_oracle with the
client environment (scripts/requirements-clients.txt: compressed-tensors 0.20.0,
transformers 5.24.0, torch). It

1. parses config.json's quantization_config as the loaders do: transformers'
   CompressedTensorsConfig (what AutoModel uses) and compressed-tensors'
   ModelCompressor built from it; the format must resolve in the package's
   compressor registry to NVFP4PackedCompressor; every config group must be compressed-tensors' NVFP4A16
   preset (weight-only) or NVFP4 preset (with static input_global_scale tensors)
   in the fields that define the numbers;
2. checks every `ignore` entry is a module of the checkpoint kept unquantized
   (its `.weight` is there, with no `.weight_packed`);
3. decompresses every `<module>.weight_packed` with the package's own functions,
   the ones NVFP4PackedCompressor.decompress calls (unpack_fp4_from_uint8, then
   lifecycle.forward.dequantize with the stored weight_scale and
   weight_global_scale), in float32, and writes `<module>.f32` (little-endian,
   row-major) into OUT_DIR.

Prints a JSON summary on stdout: {"modules": [...], "ignore": [...],
"input_global_scale": [...], "scheme": "NVFP4A16" | "NVFP4"}.
"""

import json
import os
import sys

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor, NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors import safe_open
from transformers.utils.quantization_config import CompressedTensorsConfig

FIELDS = ["num_bits", "type", "symmetric", "group_size", "strategy", "dynamic"]


def load_tensors(root):
    index = os.path.join(root, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(os.path.join(root, name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def same_args(ours, preset, what):
    for field in FIELDS:
        a, b = getattr(ours, field), getattr(preset, field)
        assert a == b, f"{what}.{field}: {a!r}, preset {b!r}"


def main():
    root, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    raw = json.load(open(os.path.join(root, "config.json")))["quantization_config"]

    config = CompressedTensorsConfig.from_dict(raw)
    compressor = ModelCompressor.from_compression_config(config)
    qconfig = compressor.quantization_config
    assert qconfig.format == "nvfp4-pack-quantized", qconfig.format
    assert str(getattr(qconfig.quantization_status, "value", qconfig.quantization_status)) == "compressed"
    registered = BaseCompressor.get_value_from_registry(qconfig.format)
    assert registered is NVFP4PackedCompressor, registered

    tensors = load_tensors(root)
    calibrated = any(k.endswith(".input_global_scale") for k in tensors)
    preset = preset_name_to_scheme("NVFP4" if calibrated else "NVFP4A16", ["Linear"])
    for name, group in qconfig.config_groups.items():
        assert group.targets == ["Linear"], group.targets
        same_args(group.weights, preset.weights, f"{name}.weights")
        if calibrated:
            same_args(group.input_activations, preset.input_activations, f"{name}.input_activations")
        else:
            assert group.input_activations is None, group.input_activations
        scheme = group

    for module in qconfig.ignore or []:
        assert f"{module}.weight" in tensors, f"ignored {module} has no weight"
        assert f"{module}.weight_packed" not in tensors, f"ignored {module} is quantized"

    modules = sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    assert modules, "no NVFP4 module"
    with_input_scale = []
    for module in modules:
        packed = tensors[f"{module}.weight_packed"]
        scale = tensors[f"{module}.weight_scale"]
        global_scale = tensors[f"{module}.weight_global_scale"]
        assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
        assert global_scale.dtype == torch.float32 and global_scale.shape == (1,)
        rows, half = packed.shape
        unpacked = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32)
        weight = dequantize(
            x_q=unpacked,
            scale=scale.to(torch.float32),
            args=scheme.weights,
            global_scale=global_scale,
            dtype=torch.float32,
        )
        with open(os.path.join(out, f"{module}.f32"), "wb") as f:
            f.write(weight.contiguous().numpy().astype("<f4").tobytes())
        if f"{module}.input_global_scale" in tensors:
            g = tensors[f"{module}.input_global_scale"]
            assert g.dtype == torch.float32 and g.shape == (1,) and g.item() > 0, module
            with_input_scale.append(module)
    if calibrated:
        assert with_input_scale == modules, "every quantized module has an input_global_scale"
    print(json.dumps({
        "modules": modules,
        "ignore": list(qconfig.ignore or []),
        "input_global_scale": with_input_scale,
        "scheme": "NVFP4" if calibrated else "NVFP4A16",
    }))


if __name__ == "__main__":
    main()
