#!/usr/bin/env python3
"""Trains the demo's model pair: a small Qwen3.5-architecture base and a LoRA fine-tune.

Writes data/demo-model/ (run from the repository root):
  base/              the trained base: config.json (Qwen3_5ForCausalLM text backbone),
                     model.safetensors (bf16), tokenizer.json (word level, 56 tokens)
  adapter/           the fine-tune: a PEFT LoRA (adapter_config.json,
                     adapter_model.safetensors with bf16 factors) on layers 4-7
  questions.jsonl    the demo's questions: 100 per task group, gold = the true answer
  calibration.jsonl  64 other prompts of the same tasks (activation statistics)
  training.json      the training log: losses and accuracies the docs quote

The tasks (docs/demo.md) are written in a word-level vocabulary: the numbers 0-31,
the letters a-p and the symbols + - = ? >, one token each, separated by spaces.

  arith    "7 + 12 ="                  -> "19"   (a, b in 0..15)
  recall   "a 3 c 17 f 1 d 9 ? c"      -> "17"   (4 key-value pairs, one queried)
  pattern  "> c f k c f k c f k c f"   -> "k"    (a period of 2-4 letters, continued)
  sub      "19 - 7 ="                  -> "12"   (0 <= b <= a <= 31): the fine-tune's

The base learns arith, recall and pattern; it never sees "-". The fine-tune is a
rank-16 LoRA (alpha 32) on every projection of the upper half of the layers (4-7:
Gated DeltaNet in_proj_qkv / in_proj_z / out_proj, attention q/k/v/o, MLP
gate/up/down), trained on sub mixed with the base's tasks (half and half), the base
frozen. Both are trained with AdamW on the cross-entropy of the answer tokens
(training recall sequences go on to ask for every key: four answers each).

Deterministic given --seed: torch.manual_seed, torch.use_deterministic_algorithms(True),
a fixed thread count (--threads, default 2) and Python's random.Random for the data;
the same torch build and thread count reproduce the files bit for bit. CPU only.
Versions: scripts/requirements-model.txt.

  python scripts/train_demo_model.py [--seed 0] [--threads 2] [--out data/demo-model]
"""

import argparse
import copy
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5



def short_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule of transformers' torch_chunk_gated_delta_rule
    (modeling_qwen3_5) for a whole short sequence at once, from a zero state: with
    G_t = sum_{s<=t} g_s, the written values u solve the unit lower-triangular system
    u_t + beta_t sum_{s<t} e^{G_t - G_s} (k_t . k_s) u_s = beta_t v_t, and
    o_t = sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s. One triangular solve instead of
    the library's loop over a 64-token chunk (training sequences are at most 16 tokens):
    training only, checked against the library's function at start-up."""
    assert initial_state is None and not output_final_state
    heads_k, heads_v = key.shape[2], value.shape[2]
    if heads_k != heads_v:
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    q, k, v, b, gg = [x.transpose(1, 2).float() for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (q.shape[-1] ** 0.5)
    t = q.shape[2]
    cum = gg.cumsum(-1)
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # G_t - G_s
    lower = torch.ones(t, t, dtype=torch.bool).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, -1e30)).exp()
    strict = torch.eye(t) + (b.unsqueeze(-1) * decay * (k @ k.transpose(-1, -2))).tril(-1)
    u = torch.linalg.solve_triangular(strict, b.unsqueeze(-1) * v, upper=False, unitriangular=True)
    out = (decay * (q @ k.transpose(-1, -2))) @ u
    return out.transpose(1, 2).contiguous().to(query.dtype), None


LIBRARY_DELTA_RULE = modeling_qwen3_5.torch_chunk_gated_delta_rule

NUMBERS = [str(n) for n in range(32)]
LETTERS = [chr(ord("a") + i) for i in range(16)]
SYMBOLS = ["+", "-", "=", "?", ">"]
VOCAB_WORDS = ["<unk>"] + NUMBERS + LETTERS + SYMBOLS  # 54 words
VOCAB_SIZE = 64  # embedding rows (the last ones unused)
TOKEN = {w: i for i, w in enumerate(VOCAB_WORDS)}

BASE_TASKS = ["arith", "recall", "pattern"]
FINETUNE_TASK = "sub"
GROUPS = BASE_TASKS + [FINETUNE_TASK]
RECALL_PAIRS = 4
PATTERN_LEN = 11  # letters after ">"
UPPER_LAYERS = [4, 5, 6, 7]
LORA_RANK = 16
LORA_ALPHA = 32
LORA_TARGETS = [
    "in_proj_qkv", "in_proj_z", "out_proj",
    "q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
]


def config():
    """Eight layers, Gated DeltaNet with full attention every fourth (as the demo's
    random preset and Qwen3.5), every in_features a multiple of 128 so the 128-wide
    quantization blocks and groups tile them."""
    c = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    c._attn_implementation = "eager"
    return c


# ---- tasks: (prompt words, answer word, distractor words) ----


def task_arith(rng):
    a, b = rng.randrange(16), rng.randrange(16)
    s = a + b
    near = [s + d for d in (-2, -1, 1, 2, 10, -10) if 0 <= s + d < 32]
    return [str(a), "+", str(b), "="], str(s), [str(x) for x in near]


def task_sub(rng):
    a = rng.randrange(32)
    b = rng.randrange(a + 1)
    d = a - b
    # The sum first: the base, which never saw "-", is drawn to it.
    near = [x for x in [a + b] if x < 32] + [d + k for k in (-1, 1, -2, 2) if 0 <= d + k < 32]
    return [str(a), "-", str(b), "="], str(d), [str(x) for x in near if x != d]


def task_recall(rng):
    keys = rng.sample(LETTERS, RECALL_PAIRS)
    values = [rng.randrange(32) for _ in keys]
    q = rng.randrange(RECALL_PAIRS)
    words = []
    for k, v in zip(keys, values):
        words += [k, str(v)]
    words += ["?", keys[q]]
    others = [str(v) for i, v in enumerate(values) if v != values[q]]
    return words, str(values[q]), others


def task_pattern(rng):
    period = rng.randrange(2, 5)
    unit = rng.sample(LETTERS, period)
    seq = [unit[i % period] for i in range(PATTERN_LEN + 1)]
    others = [x for x in unit if x != seq[-1]]
    return [">"] + seq[:-1], seq[-1], others


TASKS = {"arith": task_arith, "recall": task_recall, "pattern": task_pattern, "sub": task_sub}


def batch(task, rng, n):
    """n questions of the task: prompts and answers."""
    xs, ys = [], []
    for _ in range(n):
        words, answer, _ = TASKS[task](rng)
        xs.append([TOKEN[w] for w in words])
        ys.append(TOKEN[answer])
    return torch.tensor(xs), torch.tensor(ys)


def training_batch(task, rng, n):
    """n training sequences of the task: inputs and the target of each position
    (-100 where none). A question's only target is its answer; a recall sequence
    asks for every key after the "?", in random order, each followed by its value,
    so it carries four answers (the question is its first query)."""
    if task != "recall":
        x, y = batch(task, rng, n)
        targets = torch.full(x.shape, -100)
        targets[:, -1] = y
        return x, targets
    xs, ts = [], []
    for _ in range(n):
        words, _, _ = task_recall(rng)
        pairs = words[: 2 * RECALL_PAIRS]
        value = {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}
        order = rng.sample(list(value), RECALL_PAIRS)
        seq = pairs + ["?"]
        for key in order:
            seq += [key, value[key]]
        tokens = [TOKEN[w] for w in seq]
        targets = [-100] * (len(tokens) - 1)
        for i in range(2 * RECALL_PAIRS + 1, len(tokens) - 1, 2):
            targets[i] = tokens[i + 1]
        xs.append(tokens[:-1])
        ts.append(targets)
    return torch.tensor(xs), torch.tensor(ts)


def answer_logits(model, x):
    return model(input_ids=x, use_cache=False).logits[:, -1, :].float()


def loss_on(model, tasks, rng, batch_size):
    total = 0.0
    for task in tasks:
        x, targets = training_batch(task, rng, batch_size)
        logits = model(input_ids=x, use_cache=False).logits.float()
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return total / len(tasks)


@torch.no_grad()
def accuracy(model, tasks, seed, n=256):
    """Greedy accuracy over the whole vocabulary on n fresh prompts per task."""
    rng = random.Random(seed)
    out = {}
    for task in tasks:
        x, y = batch(task, rng, n)
        out[task] = float((answer_logits(model, x).argmax(-1) == y).float().mean())
    return out


def train(model, params, tasks_of_step, steps, lr, rng, batch_size, log, label):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = time.time()
    model.train()
    for step in range(steps):
        loss = loss_on(model, tasks_of_step, rng, batch_size)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            model.eval()
            acc = accuracy(model, GROUPS, 1000 + step, 128)
            model.train()
            row = {"phase": label, "step": step, "loss": round(loss.item(), 4),
                   "accuracy": {k: round(v, 3) for k, v in acc.items()},
                   "seconds": round(time.time() - start, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
    model.eval()
    return time.time() - start


def check_delta_rule():
    """The training delta rule against the library's, values and gradients."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 14, 2, 32), (3, 14, 2, 32), (3, 14, 4, 32), (3, 14, 4), (3, 14, 4)]
    args = [torch.randn(s, generator=gen, dtype=torch.float64).float() for s in shapes]
    args[3] = -torch.rand(shapes[3], generator=gen)  # g <= 0
    args[4] = torch.rand(shapes[4], generator=gen)  # beta in (0, 1)
    outs = []
    for rule in (LIBRARY_DELTA_RULE, short_gated_delta_rule):
        xs = [a.clone().requires_grad_() for a in args]
        o, _ = rule(xs[0], xs[1], xs[2], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
        o.square().sum().backward()
        outs.append([o] + [x.grad for x in xs])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


def bf16_exact(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def tokenizer_json():
    """A word-level tokenizer.json: whitespace-separated words, one id each."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": TOKEN, "unk_token": "<unk>"},
    }


def records(seed, per_group, prefix, groups):
    """Questions round robin over the groups (so any prefix covers every group): four
    options, the true answer and three distractors (the task's own near misses first,
    then random ones of the same kind), shuffled."""
    rng = random.Random(seed)
    out = []
    for i in range(per_group * len(groups)):
        group = groups[i % len(groups)]
        words, answer, near = TASKS[group](rng)
        pool = LETTERS if group == "pattern" else NUMBERS
        options = [answer]
        for d in near:
            if d not in options and len(options) < 4:
                options.append(d)
        while len(options) < 4:
            d = rng.choice(pool)
            if d not in options:
                options.append(d)
        rng.shuffle(options)
        out.append({
            "id": f"{prefix}{i:04d}",
            "group": group,
            "prompt": " ".join(words),
            "tokens": [TOKEN[w] for w in words],
            "options": options,
            "option_tokens": [TOKEN[o] for o in options],
            "gold": answer,
        })
    return out


@torch.no_grad()
def mc_accuracy(model, recs):
    per = {}
    for r in recs:
        logits = answer_logits(model, torch.tensor([r["tokens"]]))[0]
        pick = r["options"][int(torch.argmax(logits[r["option_tokens"]]))]
        n, k = per.get(r["group"], (0, 0))
        per[r["group"]] = (n + 1, k + (pick == r["gold"]))
    return {g: round(k / n, 4) for g, (n, k) in sorted(per.items())}


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="data/demo-model")
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--lora-steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    check_delta_rule()
    modeling_qwen3_5.torch_chunk_gated_delta_rule = short_gated_delta_rule
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    log = []

    # 1. The base, on arith, recall and pattern.
    model = Qwen3_5ForCausalLM(config())
    base_seconds = train(model, list(model.parameters()), BASE_TASKS, args.base_steps, 3e-3,
                         random.Random(args.seed), args.batch, log, "base")
    bf16_exact(model)

    # 2. The fine-tune: LoRA on the upper half, sub mixed with the base's tasks.
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS,
                      layers_to_transform=UPPER_LAYERS, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    lora_params = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    # Each step: two sub batches and one of each base task.
    mix = [FINETUNE_TASK] * 2 + BASE_TASKS
    lora_seconds = train(peft_model, lora_params, mix, args.lora_steps, 2e-3,
                         random.Random(args.seed + 1), args.batch, log, "lora")
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))

    # 3. Files.
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    base_dir = os.path.join(out, "base")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(base_dir, safe_serialization=True)
    for extra in ["generation_config.json"]:
        if os.path.exists(os.path.join(base_dir, extra)):
            os.remove(os.path.join(base_dir, extra))
    with open(os.path.join(base_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(), f, indent=1)
        f.write("\n")
    adapter_dir = os.path.join(out, "adapter")
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    weights_path = os.path.join(adapter_dir, "adapter_model.safetensors")
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(weights_path).items()}
    save_file(weights, weights_path, metadata={"format": "pt"})
    for extra in ["README.md"]:
        if os.path.exists(os.path.join(adapter_dir, extra)):
            os.remove(os.path.join(adapter_dir, extra))
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["base_model_name_or_path"] = "data/demo-model/base"
    cfg["target_modules"] = sorted(cfg["target_modules"])  # a set in PEFT: hash order
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    questions = records(args.seed + 7, 100, "q", GROUPS)
    calibration = records(args.seed + 11, 16, "c", GROUPS)
    write_jsonl(os.path.join(out, "questions.jsonl"), questions)
    write_jsonl(os.path.join(out, "calibration.jsonl"), calibration)

    # 4. What the files hold, in float32 compute on the bf16 weights, through the
    #    library's own (chunked) delta rule.
    modeling_qwen3_5.torch_chunk_gated_delta_rule = LIBRARY_DELTA_RULE
    adapter_parameters = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    merged = peft_model.merge_and_unload()
    summary = {
        "seed": args.seed,
        "threads": args.threads,
        "torch": torch.__version__,
        "base_steps": args.base_steps,
        "lora_steps": args.lora_steps,
        "batch_per_task": args.batch,
        "base_seconds": round(base_seconds, 1),
        "lora_seconds": round(lora_seconds, 1),
        "base_parameters": sum(p.numel() for p in model.parameters()),
        "adapter_parameters": adapter_parameters,
        "final_base_loss": next(r["loss"] for r in reversed(log) if r["phase"] == "base"),
        "final_lora_loss": next(r["loss"] for r in reversed(log) if r["phase"] == "lora"),
        "question_accuracy_base": mc_accuracy(model, questions),
        "question_accuracy_merged": mc_accuracy(merged, questions),
        "log": log,
    }
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=1))


if __name__ == "__main__":
    main()
