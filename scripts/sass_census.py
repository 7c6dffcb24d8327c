#!/usr/bin/env python3
"""Static instruction census of the decode kernels' stream loops (no GPU needed).

At batch 1 a decode kernel issues a few hundred instructions per warp step, and on an
H200 that issue time is of the same order as the HBM time of the weights it streams
(docs/kernels.md, "Instruction budget"), so the loop's instruction count is a figure to
watch between GPU runs. This script disassembles cubins with nvdisasm and, for each
kernel, reports the weight stream's loop (the shortest loop issuing cp.async: a backward
branch and everything between it and its target, i.e. the per-step path plus the
group-boundary path the compiler placed inside), split by opcode class.

    scripts/sass_census.py CUBIN [KERNEL_REGEX]

CUBIN: e.g. target/gpu-prep/cubins/lora_decode.cu.sm_90a.cubin, written by
`cargo run --release -p loraq-kernels --example compile_kernels -- DIR sm_90a`.
nvdisasm is taken from LORAQ_NVDISASM, PATH, or the `nvidia-cuda-nvdisasm` wheel
(`pip install nvidia-cuda-nvdisasm`) in this Python's site-packages.
"""

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

# Opcode classes of the census columns; everything else counts as "other".
CLASSES = {
    "ffma": {"FFMA", "FMUL", "FADD"},
    "cvt": {"HADD2", "F2FP", "F2F", "I2F", "HFMA2"},
    "int": {"LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT", "VIADD", "SEL", "MOV", "ISETP"},
    "mem": {"LDG", "LDS", "STS", "STG", "LDGSTS", "LDC", "LDGDEPBAR", "DEPBAR", "SHFL"},
    "branch": {"BRA", "BSSY", "BSYNC", "WARPSYNC"},
}


def find_nvdisasm():
    """nvdisasm from LORAQ_NVDISASM, PATH, or an installed nvidia-cuda-nvdisasm wheel."""
    explicit = os.environ.get("LORAQ_NVDISASM")
    if explicit:
        return explicit
    on_path = shutil.which("nvdisasm")
    if on_path:
        return on_path
    site = sysconfig.get_paths()["purelib"]
    wheels = sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvdisasm")))
    if wheels:
        return wheels[-1]
    sys.exit("sass_census: no nvdisasm (set LORAQ_NVDISASM or pip install nvidia-cuda-nvdisasm)")


def kernels(sass):
    """(name, [instruction text], {label: index}) for every function in the listing."""
    parts = re.split(r"\n\.text\.(\S+):\n", sass)
    for i in range(1, len(parts), 2):
        instructions, labels = [], {}
        for line in parts[i + 1].split("\n"):
            label = re.match(r"\s*(\.L_x_\d+):", line)
            if label:
                labels[label.group(1)] = len(instructions)
                continue
            instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
            if instruction:
                instructions.append(instruction.group(1))
        yield parts[i], instructions, labels


def opcode(instruction):
    """The opcode without predicate and modifiers: `@!P0 LDS.128 R8, [R12]` -> LDS."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def stream_loop(instructions, labels):
    """The shortest [target, branch] span of a backward branch that issues a cp.async
    (LDGSTS): the weight stream's loop, not the LoRA shrink's or a spin wait. None if
    no loop does."""
    best = None
    for end, text in enumerate(instructions):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            start = labels[target.group(1)]
            streams = any(opcode(t) == "LDGSTS" for t in instructions[start : end + 1])
            if streams and (best is None or end - start < best[1] - best[0]):
                best = (start, end)
    return best


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else r"_(base|fused)_b\d+$")
    sass = subprocess.run(
        [find_nvdisasm(), "-c", sys.argv[1]], check=True, capture_output=True, text=True
    ).stdout
    print("| kernel | stream loop instructions | " + " | ".join(CLASSES) + " | other |")
    print("|---|---:|" + "---:|" * (len(CLASSES) + 1))
    for name, instructions, labels in sorted(kernels(sass)):
        if not pattern.search(name):
            continue
        span = stream_loop(instructions, labels)
        if span is None:
            continue
        counts = collections.Counter(opcode(t) for t in instructions[span[0] : span[1] + 1])
        by_class = {c: sum(counts[o] for o in ops) for c, ops in CLASSES.items()}
        other = sum(counts.values()) - sum(by_class.values())
        cells = " | ".join(str(by_class[c]) for c in CLASSES)
        print(f"| {name} | {sum(counts.values())} | {cells} | {other} |")


if __name__ == "__main__":
    main()
