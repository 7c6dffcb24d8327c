#!/usr/bin/env python3
"""PEFT loads a quantization-aware adapter with corrections (`loraq extract
--target-base fp8-block128 --extra-rank 8 --all-layers --correction-rank 8`) as the
plain LoRA it is, and its delta repairs the fp8 base.

On the real-client fixture of tests/data/peft (a tiny Qwen3.5 text model and its PEFT
merge), with the merge of layer 1 reset to the base so the LoRA leaves that layer
alone:
1. `loraq quantize --scheme fp8-block128` of the base, `loraq extract` plain and
   quantization-aware with corrections;
2. `PeftModel.from_pretrained` loads the adapter: every module of the file is wrapped,
   with the file's factors, rank (r and rank_pattern) and scaling 1; a module wrapped
   that the file lacks (same name in another layer) has PEFT's zero lora_B;
3. per module, with the fp8 weights decoded here in torch (codes x 128x128 tile scale):
   ||merged - (W_fp8 + PEFT delta)||_F / ||merged||_F for the plain and the
   quantization-aware adapter.

Versions: scripts/requirements-model.txt (torch, transformers, peft). Run from the
repository root: python scripts/qa_peft_check.py --loraq target/release/loraq
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

FIXTURE = "tests/data/peft"


def run(*args):
    subprocess.run(list(args), check=True, stdout=subprocess.DEVNULL)


def fp8_block_decode(codes, scale_inv):
    rows, cols = codes.shape
    s = scale_inv.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return codes.float() * s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loraq", required=True)
    parser.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    try:
        base = os.path.join(FIXTURE, "base")
        merged = os.path.join(tmp, "merged")
        shutil.copytree(os.path.join(FIXTURE, "merged"), merged)
        m = load_file(os.path.join(merged, "model.safetensors"))
        b = load_file(os.path.join(base, "model.safetensors"))
        for name in list(m):
            if name.startswith("model.layers.1.") and name.endswith("_proj.weight"):
                m[name] = b[name].clone()
        save_file(m, os.path.join(merged, "model.safetensors"), metadata={"format": "pt"})
        fp8 = os.path.join(tmp, "fp8")
        run(args.loraq, "quantize", "--in", base, "--out", fp8, "--scheme", "fp8-block128")
        plain = os.path.join(tmp, "plain")
        qa = os.path.join(tmp, "qa")
        run(args.loraq, "extract", "--merged", merged, "--base", base, "--out", plain, "--rank", "8")
        run(args.loraq, "extract", "--merged", merged, "--base", base, "--out", qa, "--rank", "8",
            "--target-base", "fp8-block128", "--extra-rank", "8", "--all-layers",
            "--correction-rank", "8")
        config = json.load(open(os.path.join(qa, "adapter_config.json")))
        q = load_file(os.path.join(fp8, "model.safetensors"))

        figures = {"r": config["r"], "rank_pattern": config["rank_pattern"], "modules": {}}
        for name, adapter in [("plain", plain), ("quantization_aware", qa)]:
            model = Qwen3_5ForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
            peft = PeftModel.from_pretrained(model, adapter)
            stored = load_file(os.path.join(adapter, "adapter_model.safetensors"))
            file_modules = {k[len("base_model.model."):-len(".lora_A.weight")]
                            for k in stored if k.endswith(".lora_A.weight")}
            wrapped = {}
            for full, module in peft.named_modules():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    wrapped[full[len("base_model.model."):]] = module
            # target_modules lists module names, so PEFT also wraps same-named modules
            # the file lacks (the plain adapter's untouched layers): their lora_B is
            # PEFT's zero init, no effect. Every module of the file must be wrapped.
            assert file_modules <= set(wrapped), sorted(file_modules - set(wrapped))
            extra = sorted(set(wrapped) - file_modules)
            for path in extra:
                assert not wrapped[path].lora_B["default"].weight.data.any(), path
            figures[f"{name}_wrapped_without_factors"] = extra
            wrapped = {k: v for k, v in wrapped.items() if k in file_modules}
            for path, module in wrapped.items():
                a = stored[f"base_model.model.{path}.lora_A.weight"]
                bb = stored[f"base_model.model.{path}.lora_B.weight"]
                assert torch.equal(module.lora_A["default"].weight.data, a.float()), path
                assert torch.equal(module.lora_B["default"].weight.data, bb.float()), path
                assert module.scaling["default"] == 1.0, (path, module.scaling)
                delta = module.get_delta_weight("default").float()
                tensor = f"{path}.weight"
                w = (fp8_block_decode(q[tensor], q[tensor + "_scale_inv"])
                     if tensor + "_scale_inv" in q else q[tensor].float())
                target = m[tensor].float()
                rel = float((target - (w + delta)).norm() / target.norm())
                row = figures["modules"].setdefault(path, {"rank": {}})
                row["rank"][name] = a.shape[0]
                row[name] = rel
            for path in m:
                if path.endswith("_proj.weight"):
                    mod = path[:-len(".weight")]
                    if mod not in wrapped:
                        w = (fp8_block_decode(q[path], q[path + "_scale_inv"])
                             if path + "_scale_inv" in q else q[path].float())
                        target = m[path].float()
                        row = figures["modules"].setdefault(mod, {"rank": {}})
                        row["rank"][name] = 0
                        row[name] = float((target - w).norm() / target.norm())
            figures[f"{name}_wrapped"] = len(wrapped)
        for path, row in sorted(figures["modules"].items()):
            print(f"{path:45s} rank {row['rank'].get('plain', 0):>2} -> "
                  f"{row['rank'].get('quantization_aware', 0):>2}  plain {row['plain']:.4e}  "
                  f"quantization-aware {row['quantization_aware']:.4e}")
        print(f"r = {config['r']}, rank_pattern = {config['rank_pattern']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(figures, f, indent=1, sort_keys=True)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
