"""GGUF files written and read by gguf-py, llama.cpp's own Python GGUF library (the
copy llama-cpp-python 0.3.36 vendors; pass its directory with --gguf-py), as the
oracle of loraq-gguf's reader and writer (docs/gguf.md).

  fixtures OUT   writes the files of tests/data/gguf/ with gguf-py's GGUFWriter:
                 every-type.gguf (every metadata value type, arrays of each, a custom
                 alignment of 64, F32 / F16 / BF16 / Q8_0 tensors of 1 to 4 dims),
                 split-0000N-of-00003.gguf (one model in three files, split by
                 gguf-py's split_max_tensors), and expected.json: each file as
                 gguf-py's GGUFReader reads it back (dump below).
  dump FILE...   prints each file as GGUFReader reads it, as JSON: alignment, data
                 offset, metadata (key, type, element type, value) in file order,
                 tensors (name, ggml type, dims innermost first, offset, values of
                 float tensors, SHA-256 of the raw bytes).

  python scripts/gguf_oracle.py --gguf-py CACHE/llama-server-0.3.36/llama.cpp/gguf-py \
      fixtures tests/data/gguf
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np


def load_gguf(path):
    sys.path.insert(0, str(path))
    import gguf  # noqa: E402
    return gguf


def dump(gguf, path):
    reader = gguf.GGUFReader(path)
    metadata = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's own fields, not metadata pairs
        types = [t.name for t in field.types]
        value = field.contents()
        metadata.append({"key": key, "type": types[0], "element": types[-1] if types[0] == "ARRAY" else None,
                         "value": value})
    tensors = []
    for t in reader.tensors:
        raw = np.asarray(t.data).tobytes()
        entry = {"name": t.name, "type": t.tensor_type.name, "dims": [int(d) for d in t.shape],
                 "offset": int(t.data_offset) - int(reader.data_offset),
                 "sha256": hashlib.sha256(raw).hexdigest()}
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            values = gguf.quants.dequantize(np.frombuffer(raw, dtype=np.uint8), t.tensor_type)
            entry["values"] = [float(x) for x in np.asarray(values, dtype=np.float64).reshape(-1)]
        tensors.append(entry)
    return {"file": Path(path).name, "alignment": int(reader.alignment),
            "data_offset": int(reader.data_offset), "metadata": metadata, "tensors": tensors}


def every_type(gguf, path):
    T = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, arch="qwen35")  # writes general.architecture
    w.add_custom_alignment(64)
    w.add_key_value("test.u8", 200, T.UINT8)
    w.add_key_value("test.i8", -100, T.INT8)
    w.add_key_value("test.u16", 60000, T.UINT16)
    w.add_key_value("test.i16", -30000, T.INT16)
    w.add_key_value("test.u32", 4000000000, T.UINT32)
    w.add_key_value("test.i32", -2000000000, T.INT32)
    w.add_key_value("test.f32", 0.1, T.FLOAT32)
    w.add_key_value("test.bool_true", True, T.BOOL)
    w.add_key_value("test.bool_false", False, T.BOOL)
    w.add_key_value("test.string", "Grüße, \"GGUF\"\n\t€", T.STRING)
    w.add_key_value("test.u64", 18000000000000000000, T.UINT64)
    w.add_key_value("test.i64", -9000000000000000000, T.INT64)
    w.add_key_value("test.f64", 1.0 / 3.0, T.FLOAT64)
    w.add_key_value("test.array.u8", [0, 1, 255], T.ARRAY, sub_type=T.UINT8)
    w.add_key_value("test.array.i8", [-128, 0, 127], T.ARRAY, sub_type=T.INT8)
    w.add_key_value("test.array.u16", [0, 65535], T.ARRAY, sub_type=T.UINT16)
    w.add_key_value("test.array.i16", [-32768, 32767], T.ARRAY, sub_type=T.INT16)
    w.add_key_value("test.array.u32", [1, 2, 4294967295], T.ARRAY, sub_type=T.UINT32)
    w.add_key_value("test.array.i32", [-1, 5, 2147483647], T.ARRAY, sub_type=T.INT32)
    w.add_key_value("test.array.f32", [1.5, -0.25, 3.0e-5], T.ARRAY, sub_type=T.FLOAT32)
    w.add_key_value("test.array.bool", [True, False, True], T.ARRAY, sub_type=T.BOOL)
    w.add_key_value("test.array.string", ["a", "", "ß-Ω"], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("test.array.u64", [0, 18446744073709551615], T.ARRAY, sub_type=T.UINT64)
    w.add_key_value("test.array.i64", [-9223372036854775808, 9223372036854775807], T.ARRAY, sub_type=T.INT64)
    w.add_key_value("test.array.f64", [2.5, -1e300], T.ARRAY, sub_type=T.FLOAT64)
    rng = np.random.default_rng(7)
    w.add_tensor("vector.f32", rng.standard_normal(5).astype(np.float32))
    w.add_tensor("matrix.f16", rng.standard_normal((3, 4)).astype(np.float16))
    bf16 = (rng.standard_normal((2, 3, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("cube.bf16", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("rows.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("four.f32", rng.standard_normal((2, 1, 3, 2)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def split(gguf, out):
    w = gguf.GGUFWriter(out / "split.gguf", arch="qwen3", split_max_tensors=2)
    w.add_block_count(2)
    w.add_string("general.name", "split fixture")
    rng = np.random.default_rng(11)
    for i in range(5):
        w.add_tensor(f"t{i}.weight", rng.standard_normal((2, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf-py", type=Path, required=True, help="llama.cpp's gguf-py directory")
    sub = parser.add_subparsers(dest="command", required=True)
    fixtures = sub.add_parser("fixtures")
    fixtures.add_argument("out", type=Path)
    dumping = sub.add_parser("dump")
    dumping.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    gguf = load_gguf(args.gguf_py)
    if args.command == "dump":
        print(json.dumps([dump(gguf, f) for f in args.files], indent=1, ensure_ascii=False))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    every_type(gguf, args.out / "every-type.gguf")
    split(gguf, args.out)
    files = [args.out / "every-type.gguf"] + sorted(args.out.glob("split-*-of-*.gguf"))
    expected = [dump(gguf, f) for f in files]
    (args.out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
