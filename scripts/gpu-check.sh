#!/usr/bin/env bash
# GPU check of loraq-kernels: builds with `cuda`, runs the GPU kernels against the CPU
# reference, benchmarks the Qwen3.8-27B layer shapes (5120->17408, 17408->5120,
# 5120->10240, 5120->6144) at rank 256, batch 1/4/16/128, fp8-block128 and nvfp4 bases,
# fused vs unfused, and writes a Markdown report to the path given as argument.
# Budget: under 8 minutes on an H200, every step under its own timeout: build 150 s
# (skipped with prebuilt binaries), tests 80 s, benchmark 90 s (main table and blocks
# per SM) + 35 s (tensor-core decode) + 35 s (programmatic dependent launch), then an
# experiment (two variants of the decode's lane step, batch 1: 2 x (15 s compile where
# not prebuilt + 20 s)) appended to the report: at most 460 s. With prebuilt binaries
# the whole check took 12 s on the H200.
#
# Usage:
#   scripts/gpu-check.sh REPORT.md
#       on a machine with an NVIDIA GPU (sm_90+), a CUDA driver, and either cargo or
#       prebuilt binaries (below). Kernels are compiled at run time by NVRTC
#       (LORAQ_CUDA_WHEELS, CUDA_HOME or /usr/local/cuda) or loaded from
#       precompiled cubins in LORAQ_CUBIN_DIR.
#   scripts/gpu-check.sh --prepare DIR
#       on a machine WITHOUT a GPU but with cargo and NVRTC (e.g. the CI wheels):
#       builds the GPU test and bench binaries and the cubins into DIR, so that
#       `LORAQ_GPU_PREBUILT=DIR scripts/gpu-check.sh REPORT.md` works on a GPU machine
#       that has neither cargo nor NVRTC.
#
# Environment: LORAQ_GPU_PEAK_GBPS (default 4800, the H200's HBM3e), LORAQ_GPU_PREBUILT.
set -euo pipefail

cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

find_nvrtc() {
    if [[ -n "${LORAQ_CUDA_WHEELS:-}" || -n "${LORAQ_CUBIN_DIR:-}" ]]; then return 0; fi
    local py
    for py in python3 python; do
        if command -v "$py" >/dev/null 2>&1; then
            local dir
            dir=$("$py" -c 'import nvidia.cuda_nvrtc, os; print(os.path.dirname(list(nvidia.cuda_nvrtc.__path__)[0]))' 2>/dev/null || true)
            if [[ -n "$dir" && -e "$dir/cuda_nvrtc/lib/libnvrtc.so.12" ]]; then
                export LORAQ_CUDA_WHEELS="$dir"
                return 0
            fi
        fi
    done
    # CUDA_HOME / CUDA_PATH / /usr/local/cuda are searched by the binaries themselves.
}

# Variants of the batch-1 decode timed as an experiment beside the default kernels:
# name|NVRTC options|formats. The lane step: NVFP4's former 8 bytes (one 16-weight
# piece) against its default 16, fp8's 32 bytes (two pieces) against its default 16.
DECODE_VARIANTS=(
    "nvfp4-pieces1|-DLORAQ_NVFP4_PIECES=1|nvfp4"
    "fp8-pieces2|-DLORAQ_FP8_PIECES=2|fp8-block128"
)

if [[ "${1:-}" == "--prepare" ]]; then
    out="${2:?usage: gpu-check.sh --prepare DIR}"
    mkdir -p "$out"
    find_nvrtc
    cargo run --release -p loraq-kernels --example compile_kernels -- "$out/cubins"
    # Experiment: variants of the decode (timed after the report's main tables).
    for variant in "${DECODE_VARIANTS[@]}"; do
        IFS='|' read -r name options _ <<<"$variant"
        LORAQ_NVRTC_OPTIONS="$options" \
            cargo run --release -p loraq-kernels --example compile_kernels -- "$out/cubins-$name" sm_90a sm_100a sm_120a
    done
    for kind in "--test gpu" "--bench gpu_linear"; do
        # shellcheck disable=SC2086
        bin=$(cargo test --release -p loraq-kernels --features cuda $kind --no-run --message-format=json 2>/dev/null \
            | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
        [[ -n "$bin" ]] || { echo "gpu-check: building $kind failed" >&2; exit 1; }
        cp "$bin" "$out/$(basename "${kind#* }")"
        # Debug line tables make up most of the size; the device copy needs none.
        if command -v strip >/dev/null 2>&1; then strip --strip-debug "$out/$(basename "${kind#* }")"; fi
    done
    # `loraq run --device cuda` (the model's linears on the GPU) for the run check.
    cargo build --release --features cuda --bin loraq
    cp target/release/loraq "$out/loraq"
    if command -v strip >/dev/null 2>&1; then strip --strip-debug "$out/loraq"; fi
    echo "gpu-check: prepared $out (gpu, gpu_linear, loraq, cubins/)"
    exit 0
fi

report="${1:?usage: gpu-check.sh REPORT.md}"
report="$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
log_dir="$(mktemp -d)"
start=$(date +%s)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no working nvidia-smi; a GPU and its driver are required" >&2
    exit 1
fi
gpu_name=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)
# The driver library normally sits in the loader's cache; some containers mount it apart.
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [[ -e "$d/libcuda.so.1" ]] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

if [[ -n "${LORAQ_GPU_PREBUILT:-}" ]]; then
    prebuilt="$(cd "$LORAQ_GPU_PREBUILT" && pwd)"
    export LORAQ_CUBIN_DIR="${LORAQ_CUBIN_DIR:-$prebuilt/cubins}"
    test_cmd=("$prebuilt/gpu" --nocapture --test-threads=1)
    bench_cmd=("$prebuilt/gpu_linear" --bench)
    loraq_bin="$prebuilt/loraq"
else
    command -v cargo >/dev/null 2>&1 || { echo "gpu-check: no cargo; use --prepare elsewhere and LORAQ_GPU_PREBUILT" >&2; exit 1; }
    find_nvrtc
    echo "== build (feature cuda)"
    timeout 150 cargo build --release -p loraq-kernels --features cuda --tests --benches
    test_cmd=(cargo test --release -p loraq-kernels --features cuda --test gpu -- --nocapture --test-threads=1)
    bench_cmd=(cargo bench -p loraq-kernels --features cuda --bench gpu_linear --)
    timeout 300 cargo build --release --features cuda --bin loraq
    loraq_bin="$(pwd)/target/release/loraq"
fi

# `loraq run --device cuda`: a tiny synthetic model with its adapter on a bf16, an
# fp8-block128 and an NVFP4 base, every linear on the GPU kernels (activations cross
# as bf16), against the CPU kernels' answers of the same run (`loraq compare`).
run_check() {
    local dir="$log_dir/run"
    mkdir -p "$dir"
    "$loraq_bin" synth --preset tiny --out "$dir/pair" --seed 3 >/dev/null || return 1
    local vocab
    vocab=$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$dir/pair/base/config.json" | head -n 1)
    scripts/random_records.sh "${vocab:-256}" > "$dir/records.jsonl"
    local status=0
    for scheme in bf16 fp8-block128 nvfp4; do
        local model="$dir/pair/base"
        if [[ "$scheme" != bf16 ]]; then
            model="$dir/base-$scheme"
            "$loraq_bin" quantize --in "$dir/pair/base" --out "$model" --scheme "$scheme" >/dev/null || return 1
        fi
        for device in cpu cuda; do
            local backend=()
            [[ "$device" == cpu ]] && backend=(--backend kernels)
            "$loraq_bin" run --model "$model" --adapter "$dir/pair/true-adapter" --records "$dir/records.jsonl" \
                --device "$device" "${backend[@]}" --out "$dir/$scheme-$device.jsonl" || status=1
        done
        echo "### $scheme: CUDA answers against the CPU answers"
        "$loraq_bin" compare --reference "$dir/$scheme-cpu.jsonl" --candidate "$dir/$scheme-cuda.jsonl" || status=1
    done
    return $status
}
echo "== loraq run --device cuda vs the CPU"
run_status=passed
if ! timeout 240 bash -c "$(declare -f run_check); log_dir='$log_dir' loraq_bin='$loraq_bin' run_check" \
    2>&1 | tee "$log_dir/run.log"; then
    run_status=FAILED
fi

echo "== GPU kernels vs CPU reference"
test_status=passed
if ! timeout 80 "${test_cmd[@]}" 2>&1 | tee "$log_dir/test.log"; then
    test_status=FAILED
fi
grep -q "skipped" "$log_dir/test.log" && test_status="SKIPPED ($(grep -m1 skipped "$log_dir/test.log"))"

echo "== benchmark"
table="$log_dir/table.md"
bench_status=done
# One process per group of sections, each under its own timeout, the newest kernels
# last: a kernel that faults (which ends its process's CUDA context) or hangs costs only
# its own section. Every section appends to the table as it goes.
for sections in "main,grid:90" "tc:35" "pdl:35"; do
    if ! LORAQ_GPU_TABLE="$table" LORAQ_GPU_TABLE_ONLY=1 LORAQ_GPU_SECTIONS="${sections%:*}" \
        timeout "${sections#*:}" "${bench_cmd[@]}" 2>&1 | tee -a "$log_dir/bench.log"; then
        bench_status="FAILED (section ${sections%:*}; see the bench log)"
        echo "gpu-check: benchmark section ${sections%:*} failed" | tee -a "$log_dir/bench.log"
    fi
done

# Experiment: the decode variants (cubins compiled with their options, by --prepare or
# here with NVRTC), main table at batch 1, their formats only.
experiment="$log_dir/experiment.md"
for variant in "${DECODE_VARIANTS[@]}"; do
    IFS='|' read -r name options formats <<<"$variant"
    cubins="${prebuilt:-$log_dir}/cubins-$name"
    if [[ ! -d "$cubins" ]]; then
        [[ -z "${prebuilt:-}" ]] || continue
        # This device's architecture only (compute capability 9.0 -> sm_90a).
        arch="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')a"
        LORAQ_NVRTC_OPTIONS="$options" timeout 15 \
            cargo run --release -p loraq-kernels --example compile_kernels -- "$cubins" "$arch" >/dev/null 2>&1 || continue
    fi
    echo "== experiment: decode variant $name ($options)"
    part="$log_dir/variant-$name.md"
    if LORAQ_CUBIN_DIR="$cubins" LORAQ_GPU_TABLE="$part" LORAQ_GPU_TABLE_ONLY=1 LORAQ_GPU_FORMATS="$formats" \
        LORAQ_GPU_BATCHES=1 LORAQ_GPU_SECTIONS=main timeout 20 "${bench_cmd[@]}" >>"$log_dir/bench.log" 2>&1; then
        { echo; echo "Variant $name (\`$options\`), batch 1:"; echo; grep '^|' "$part" 2>/dev/null || echo "(no table)"; } >>"$experiment"
    else
        { echo; echo "Variant $name (\`$options\`): FAILED (see the bench log)"; } >>"$experiment"
    fi
done

{
    echo "# loraq-kernels GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- GPU: $gpu_name"
    echo "- GPU tests against the CPU reference (bf16 tolerance): $test_status"
    echo "- benchmark: $bench_status"
    echo "- loraq run --device cuda against the CPU answers: $run_status (log: -run.log)"
    echo "- wall time: $(( $(date +%s) - start )) s"
    echo
    if [[ -s "$table" ]]; then cat "$table"; else echo "(no table: see the bench log below)"; tail -n 30 "$log_dir/bench.log" | sed 's/^/    /'; fi
    if [[ -s "$experiment" ]]; then echo; echo "## Experiment: decode variants"; cat "$experiment"; fi
    echo
    echo "## test log (tail)"
    echo
    tail -n 20 "$log_dir/test.log" | sed 's/^/    /'
} > "$report"
# Full logs beside the report: a failing configuration or a hang is read from them.
cp "$log_dir/test.log" "${report%.md}-test.log"
cp "$log_dir/bench.log" "${report%.md}-bench.log"
cp "$log_dir/run.log" "${report%.md}-run.log"
echo "gpu-check: wrote $report and its -test.log / -bench.log"
# >>> collect: vLLM step (owner: collect; docs/collect.md) >>>
# Serves the tiny Qwen3.5 of tests/data/model/qwen3_5 with the collect fixture's LoRA in
# vLLM, runs `loraq collect` on the base and the adapter, compares each with `loraq run`
# on the same weights, and keeps vLLM's own answers (models, version, one completion with
# logprob_token_ids) beside the report, for tests/data/collect/vllm/. Skipped without
# vllm; at most about 6 minutes (server start 300 s, the rest seconds).
vllm_status="skipped (vllm is not installed)"
if python3 -c 'import vllm' >/dev/null 2>&1; then
    vdir="$log_dir/vllm"
    mkdir -p "$vdir"
    vllm_status="failed (see ${report%.md}-vllm.log)"
    (
        set -e
        loraq_bin="${LORAQ_BIN:-}"
        if [[ -z "$loraq_bin" ]]; then
            cargo build --release --bin loraq >/dev/null 2>&1
            loraq_bin="$CARGO_TARGET_DIR/release/loraq"
        fi
        python3 scripts/collect_fixture.py --no-gguf --model tests/data/model/qwen3_5 --out "$vdir/fx"
        python3 - "$vdir/records.jsonl" <<'PY'
import json, random, sys
rng = random.Random(19)
with open(sys.argv[1], "w") as f:
    for i in range(200):
        f.write(json.dumps({"id": f"r{i}", "tokens": [rng.randrange(128) for _ in range(rng.randint(1, 40))],
                            "options": ["A", "B", "C", "D"], "option_tokens": rng.sample(range(128), 4),
                            "gold": rng.choice("ABCD")}) + "\n")
PY
        port=8765
        python3 -m vllm.entrypoints.openai.api_server --model "$vdir/fx/hf" --served-model-name base \
            --enable-lora --max-lora-rank 8 --lora-modules "adapter=$vdir/fx/adapter" \
            --max-model-len 64 --enforce-eager --gpu-memory-utilization 0.3 --port "$port" \
            >"$vdir/server.log" 2>&1 &
        server=$!
        trap 'kill $server 2>/dev/null || true' EXIT
        for _ in $(seq 300); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            sleep 1
        done
        url="http://127.0.0.1:$port"
        curl -sf "$url/v1/models" >"$vdir/models.json"
        curl -sf "$url/version" >"$vdir/version.json"
        curl -sf "$url/v1/completions" -H 'Content-Type: application/json' -d '{"model": "adapter",
            "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "logprob_token_ids": [11, 12, 13, 14], "return_tokens_as_token_ids": true}' >"$vdir/completion.json"
        for side in base adapter; do
            extra=()
            run_extra=()
            if [[ $side == adapter ]]; then
                extra=(--adapter adapter)
                run_extra=(--adapter "$vdir/fx/adapter")
            fi
            timeout 120 "$loraq_bin" collect --server "$url" --engine vllm --model base "${extra[@]}" \
                --records "$vdir/records.jsonl" --out "$vdir/vllm-$side.jsonl" --concurrency 16 --json
            timeout 120 "$loraq_bin" run --model "$vdir/fx/hf" "${run_extra[@]}" \
                --records "$vdir/records.jsonl" --out "$vdir/run-$side.jsonl"
            timeout 60 "$loraq_bin" compare --reference "$vdir/run-$side.jsonl" \
                --candidate "$vdir/vllm-$side.jsonl" --json "$vdir/compare-$side.json"
        done
    ) >"${report%.md}-vllm.log" 2>&1 && vllm_status="done"
    for f in models.json version.json completion.json compare-base.json compare-adapter.json; do
        [[ -f "$vdir/$f" ]] && cp "$vdir/$f" "${report%.md}-vllm-$f"
    done
fi
{
    echo
    echo "## vLLM: loraq collect against loraq run (tiny Qwen3.5 + LoRA)"
    echo
    echo "- status: $vllm_status"
    for side in base adapter; do
        f="${report%.md}-vllm-compare-$side.json"
        if [[ -f "$f" ]]; then
            echo "- $side: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(f"n={r[\"n\"]}, same top {r[\"same_top\"]:.4f}, mean KL {r[\"kl\"][\"mean\"]:.3e}, max KL {r[\"kl\"][\"max\"]:.3e}")' "$f")"
        fi
    done
} >>"$report"
# <<< collect <<<
[[ "$test_status" == passed && "$bench_status" == done && "$run_status" == passed ]]
