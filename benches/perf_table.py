#!/usr/bin/env python3
"""Inputs and references of benches/perf_table.sh (benches/README.md).

  perf_table.py answers DIR N           two answers files of N four-option questions, as
                                        the compare_answers_1m bench writes them (random
                                        logits; the candidate the reference plus noise,
                                        shuffled; gold; four groups): DIR/reference.jsonl,
                                        DIR/candidate.jsonl
  perf_table.py records FILE VOCAB N T  N random prompts of T tokens with four option
                                        tokens, in the records format of `loraq run`
  perf_table.py cast-residual BASE MERGED REPORT TENSOR
                                        loraq's residual after the bf16 cast of module
                                        TENSOR (extraction_report.json) over the residual
                                        of torch.svd_lowrank(q=r+16, niter=2) on the same
                                        delta with f32 factors, and the exact residual of
                                        the bf16 factors as stored (adapter_model.safetensors
                                        beside REPORT) over the same; prints one JSON line
  perf_table.py clef-slice SLICE DST    a Clef-shaped slice: the 27b-slice pair SLICE (its
                                        shards linked) plus, in each checkpoint, the same
                                        tensors the LoRA leaves alone in the proportion a
                                        Clef-shaped model has them (54 GB per checkpoint,
                                        186 LoRA'd projections), as a third shard that is
                                        a separate file in DST/base and DST/merged (so a
                                        cold-cache run reads both from the disk); prints
                                        one JSON line (bytes per checkpoint, tensors added)

Pinned: python 3.11, torch==2.15.0 (CPU), numpy==2.4.6, safetensors (scripts/requirements-model.txt).
"""

import json
import os
import random
import sys


def answers(out_dir: str, n: int) -> None:
    rng = random.Random(1)
    groups = ["arc", "mmlu", "gsm", "piqa"]
    letters = ["A", "B", "C", "D"]
    os.makedirs(out_dir, exist_ok=True)

    def line(i, logits, gold):
        values = ", ".join(f"{x:.4f}" for x in logits)
        return (f'{{"id": "q{i}", "group": "{groups[i % 4]}", "options": ["A", "B", "C", "D"], '
                f'"logits": [{values}], "gold": "{gold}"}}')

    reference, candidate = [], []
    for i in range(n):
        logits = [rng.uniform(-4.0, 4.0) for _ in range(4)]
        noisy = [x + rng.uniform(-0.5, 0.5) for x in logits]
        gold = letters[rng.randrange(4)]
        reference.append(line(i, logits, gold))
        candidate.append(line(i, noisy, gold))
    rng.shuffle(candidate)
    with open(os.path.join(out_dir, "reference.jsonl"), "w") as f:
        f.write("\n".join(reference) + "\n")
    with open(os.path.join(out_dir, "candidate.jsonl"), "w") as f:
        f.write("\n".join(candidate) + "\n")


def records(path: str, vocab: int, n: int, tokens: int) -> None:
    rng = random.Random(tokens * 1000 + n)
    with open(path, "w") as f:
        for i in range(n):
            options = rng.sample(range(vocab), 4)
            f.write(json.dumps({
                "id": f"p{i}",
                "tokens": [rng.randrange(vocab) for _ in range(tokens)],
                "options": ["A", "B", "C", "D"],
                "option_tokens": options,
            }) + "\n")


def cast_residual(base_dir: str, merged_dir: str, report_path: str, tensor: str) -> None:
    import torch
    from safetensors import safe_open

    def load(directory):
        index = os.path.join(directory, "model.safetensors.index.json")
        name = (json.load(open(index))["weight_map"][tensor] if os.path.exists(index)
                else "model.safetensors")
        with safe_open(os.path.join(directory, name), "pt") as f:
            return f.get_tensor(tensor).to(torch.float32)

    delta = load(merged_dir) - load(base_dir)
    report = json.load(open(report_path))
    module = tensor.removesuffix(".weight")
    entry = next(m for m in report["modules"] if m["module"] == module)
    rank = entry["rank"]
    torch.manual_seed(0)
    u, s, v = torch.svd_lowrank(delta, q=rank + 16, niter=2)
    approx = (u[:, :rank].double() * s[:rank].double()) @ v[:, :rank].double().T
    torch_residual = float(torch.linalg.norm(delta.double() - approx))
    # The bf16 factors as stored (scale 1: lora_alpha = r), their exact residual in f64.
    adapter = os.path.join(os.path.dirname(report_path), "adapter_model.safetensors")
    with safe_open(adapter, "pt") as f:
        lora_b = f.get_tensor(f"base_model.model.{module}.lora_B.weight").double()
        lora_a = f.get_tensor(f"base_model.model.{module}.lora_A.weight").double()
    stored_residual = float(torch.linalg.norm(delta.double() - lora_b @ lora_a))
    print(json.dumps({
        "module": module,
        "rank": rank,
        "loraq_residual": entry["residual"],
        "loraq_residual_after_cast": entry["residual_after_cast"],
        "stored_factors_residual": stored_residual,
        "torch_residual": torch_residual,
        "ratio_after_cast": entry["residual_after_cast"] / torch_residual,
        "stored_ratio_after_cast": stored_residual / torch_residual,
    }))


CLEF_BYTES_PER_CHECKPOINT = 54e9
CLEF_PROJECTIONS = 186


def clef_slice(slice_dir: str, out_dir: str) -> None:
    import struct

    def header(path):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return json.loads(f.read(n))

    merged = os.path.join(slice_dir, "merged")
    shards = sorted(x for x in os.listdir(merged) if x.endswith(".safetensors"))
    tensors = {}
    for shard in shards:
        for name, meta in header(os.path.join(merged, shard)).items():
            if name != "__metadata__":
                tensors[name] = meta
    size = {n: m["data_offsets"][1] - m["data_offsets"][0] for n, m in tensors.items()}
    # The slice's LoRA'd projections: the modules of its true adapter (15 for the
    # 27b-slice), named in the adapter as base_model.model.<module>.lora_A.weight.
    adapter = header(os.path.join(slice_dir, "true-adapter", "adapter_model.safetensors"))
    modules = {n[len("base_model.model."):-len(".lora_A.weight")]
               for n in adapter if n.endswith(".lora_A.weight")}
    lora = [n for n in tensors if n[:-len(".weight")] in modules]
    if len(lora) != len(modules):
        sys.exit(f"{slice_dir}: {len(modules)} adapter modules, {len(lora)} found in the merge")
    lora_bytes = sum(size[n] for n in lora)
    outside_bytes = sum(size.values()) - lora_bytes
    # Per slice's share of the model: 54 GB x 15 / 186 in all, of which the projections.
    share = CLEF_BYTES_PER_CHECKPOINT * len(lora) / CLEF_PROJECTIONS
    shape = [17408, 5120]
    tensor_bytes = shape[0] * shape[1] * 2
    count = max(0, round((share - lora_bytes - outside_bytes) / tensor_bytes))
    extra_shard = "model-extra-identical.safetensors"
    names = [f"model.language_model.layers.{2 + i}.mlp.up_proj.weight" for i in range(count)]
    meta = {}
    for i, name in enumerate(names):
        meta[name] = {"dtype": "BF16", "shape": shape,
                      "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes]}
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rng = __import__("numpy").random.default_rng(20)
    outputs = {}
    for side in ("base", "merged"):
        src = os.path.join(slice_dir, side)
        dst = os.path.join(out_dir, side)
        os.makedirs(dst, exist_ok=True)
        index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
        for name in os.listdir(src):
            if name.endswith(".safetensors") or name == "config.json":
                target = os.path.join(dst, name)
                if not os.path.lexists(target):
                    os.symlink(os.path.abspath(os.path.join(src, name)), target)
        for name in names:
            index["weight_map"][name] = extra_shard
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        outputs[side] = open(os.path.join(dst, extra_shard), "wb")
        outputs[side].write(struct.pack("<Q", len(head)) + head)
    # The same bytes on both sides (contents do not matter to a byte comparison).
    chunk = 64 << 20
    left = count * tensor_bytes
    while left > 0:
        block = rng.bytes(min(chunk, left))
        for f in outputs.values():
            f.write(block)
        left -= len(block)
    for f in outputs.values():
        f.close()
    print(json.dumps({
        "projections": len(lora),
        "projection_bytes": lora_bytes,
        "outside_bytes_before": outside_bytes,
        "tensors_added": count,
        "bytes_added_per_checkpoint": count * tensor_bytes,
        "bytes_per_checkpoint": lora_bytes + outside_bytes + count * tensor_bytes,
        "clef_share_per_checkpoint": share,
    }))


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "answers":
        answers(args[0], int(args[1]))
    elif command == "records":
        records(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif command == "cast-residual":
        cast_residual(*args)
    elif command == "clef-slice":
        clef_slice(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
