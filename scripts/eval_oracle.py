#!/usr/bin/env python3
"""Independent oracle for `loraq compare` (crates/loraq-eval).

Writes deterministic answers files (JSON Lines) under tests/data/eval/<case>/ and,
for each case, expected.json: every figure of the comparison report computed here
with numpy / scipy / scikit-learn, from the raw files, without any code of loraq.
tests in crates/loraq-eval and tests/compare_cli.rs compare loraq's output with
these files (1e-9, 1e-3 for the bootstrap bounds, which come from a different
random stream: here a literal index-resampling bootstrap with many resamples).

Also writes a pair of hidden-state safetensors files (tests/data/eval/hidden/) and
their per-tensor cosine / relative L2 / SQNR for `loraq compare-hidden`.

Pinned versions: scripts/requirements-eval.txt. Run from the repository root:
    python scripts/eval_oracle.py
"""

import json
import os
import struct
import sys

import numpy as np
import scipy
import scipy.special
import scipy.stats
import sklearn
from sklearn.metrics import accuracy_score

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "eval")
UNGROUPED = "(ungrouped)"
ORACLE_BOOTSTRAP = 200_000


# ---------------------------------------------------------------- answer files

def logit_row(rng, k, kind):
    """Logits of one question; `kind` picks an easy, hard, near-certain or tied one."""
    if kind == "tie":
        # Exact ties in the top options: equal logits give equal probabilities.
        x = np.round(rng.normal(0, 1, k), 3)
        top = np.max(x) + 1.0
        x[: 2 if k > 2 else k] = top
        return x
    if kind == "uniform":
        return np.zeros(k)
    if kind == "certain":
        x = np.round(rng.normal(0, 1, k), 3)
        x[rng.integers(k)] += 30.0 + rng.uniform(0, 10)
        return x
    scale = 1.0 if kind == "hard" else 3.0
    return np.round(rng.normal(0, scale, k), 4)


def make_case(name, seed, n, n_options, gold_share, groups, candidate_noise,
              probs_share=0.0, extra_reference=0, extra_candidate=0, shuffle=True):
    """Writes reference.jsonl and candidate.jsonl; returns nothing (read back below)."""
    rng = np.random.default_rng(seed)
    letters = "ABCDEFGH"
    reference, candidate = [], []
    for i in range(n + max(extra_reference, extra_candidate)):
        k = int(rng.choice(n_options))
        options = [letters[j] for j in range(k)]
        kind = rng.choice(["easy", "hard", "certain", "tie", "uniform"], p=[0.45, 0.35, 0.08, 0.08, 0.04])
        ref_logits = logit_row(rng, k, kind)
        if kind in ("tie", "uniform") and rng.uniform() < 0.5:
            cand_logits = ref_logits.copy()  # the same tie on both sides
        else:
            cand_logits = np.round(ref_logits + rng.normal(0, candidate_noise, k), 4)
        record_r = {"id": f"{name}-{i:05d}"}
        record_c = {"id": f"{name}-{i:05d}"}
        if groups:
            g = groups[int(rng.integers(len(groups)))]
            if g is not None:
                record_r["group"] = g
                # The group may be written on one side only.
                if rng.uniform() < 0.8:
                    record_c["group"] = g
        record_r["options"] = options
        record_c["options"] = options
        record_r["logits"] = [float(v) for v in ref_logits]
        if rng.uniform() < probs_share:
            record_c["probs"] = [float(v) for v in scipy.special.softmax(cand_logits)]
        else:
            record_c["logits"] = [float(v) for v in cand_logits]
        if rng.uniform() < gold_share:
            # Gold mostly where the reference points, so accuracy is well above chance.
            if rng.uniform() < 0.7:
                gold = options[int(np.argmax(ref_logits))]
            else:
                gold = options[int(rng.integers(k))]
            # Gold on both sides, on the reference only (candidate null), or on the
            # candidate only.
            u = rng.uniform()
            if u < 0.5:
                record_r["gold"] = record_c["gold"] = gold
            elif u < 0.75:
                record_r["gold"], record_c["gold"] = gold, None
            else:
                record_c["gold"] = gold
        if i < n:
            reference.append(record_r)
            candidate.append(record_c)
        else:
            if i - n < extra_reference:
                reference.append(record_r)
            if i - n < extra_candidate:
                record_c = dict(record_c, id=record_c["id"] + "-c")
                candidate.append(record_c)
    if shuffle:
        order = rng.permutation(len(candidate))
        candidate = [candidate[j] for j in order]
    directory = os.path.join(ROOT, name)
    os.makedirs(directory, exist_ok=True)
    for file_name, records in (("reference.jsonl", reference), ("candidate.jsonl", candidate)):
        with open(os.path.join(directory, file_name), "w") as f:
            for j, r in enumerate(records):
                f.write(json.dumps(r) + "\n")
                if j == 3:
                    f.write("\n")  # a blank line, which readers skip


# ---------------------------------------------------------------- the oracle

def read(path):
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[r["id"]] = r
    order = []
    with open(path) as f:
        for line in f:
            if line.strip():
                order.append(json.loads(line)["id"])
    return out, order


def distribution(record):
    """(probabilities, log-probabilities) of a record."""
    if "logits" in record:
        x = np.asarray(record["logits"], dtype=np.float64)
        return scipy.special.softmax(x), scipy.special.log_softmax(x)
    p = np.asarray(record["probs"], dtype=np.float64)
    p = p / p.sum()
    with np.errstate(divide="ignore"):
        return p, np.log(p)


def percentile(x, q):
    return float(np.percentile(np.asarray(x, dtype=np.float64), q))


def ece_equal_width(conf, correct, bins):
    edges = np.linspace(0.0, 1.0, bins + 1)
    total = len(conf)
    ece = 0.0
    table = []
    for b in range(bins):
        if b == 0:
            mask = conf <= edges[1]  # (0, e1]; a confidence of 0 cannot occur
        else:
            mask = (conf > edges[b]) & (conf <= edges[b + 1])
        m = int(mask.sum())
        if m:
            acc = float(correct[mask].mean())
            mc = float(conf[mask].mean())
            ece += m / total * abs(acc - mc)
            table.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "count": m,
                          "mean_confidence": mc, "accuracy": acc})
        else:
            table.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "count": 0,
                          "mean_confidence": None, "accuracy": None})
    return ece, table


def ece_equal_mass(conf, correct, bins):
    order = np.argsort(conf, kind="stable")
    total = len(conf)
    ece = 0.0
    for group in np.array_split(order, bins):
        if len(group):
            ece += len(group) / total * abs(correct[group].mean() - conf[group].mean())
    return float(ece)


def bootstrap_ci(d, seed, resamples):
    """Literal paired bootstrap: resample question indices, average c_i - r_i."""
    rng = np.random.default_rng(seed)
    n = len(d)
    deltas = np.empty(resamples)
    chunk = max(1, 20_000_000 // n)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        deltas[start:stop] = d[idx].mean(axis=1)
    return [percentile(deltas, 2.5), percentile(deltas, 97.5)]


def exact_bootstrap_quantiles(n, worse, better):
    """2.5% / 97.5% quantiles of the ideal (infinite-resample) bootstrap: the sum of
    n draws of d in {-1, 0, +1} has a trinomial law, computed exactly here."""
    kp = np.arange(n + 1)
    p_plus, p_minus = better / n, worse / n
    pmf = {}
    for a in range(n + 1):  # a = number of +1 draws
        pa = scipy.stats.binom.pmf(a, n, p_plus)
        if pa < 1e-300:
            continue
        rest = n - a
        q = p_minus / (1 - p_plus) if p_plus < 1 else 0.0
        pb = scipy.stats.binom.pmf(kp[: rest + 1], rest, q)
        for b in np.nonzero(pb > 1e-300)[0]:
            pmf[a - b] = pmf.get(a - b, 0.0) + pa * pb[b]
    support = sorted(pmf)
    cdf = np.cumsum([pmf[s] for s in support])
    lo = support[int(np.searchsorted(cdf, 0.025))] / n
    hi = support[int(np.searchsorted(cdf, 0.975))] / n
    # Distance of the CDF from the 2.5% / 97.5% levels at the chosen jumps, i.e. how
    # many resamples a bootstrap needs to land on them reliably.
    return [lo, hi]


def compare(case_dir, bins, resamples, seed, allow_unpaired):
    ref, ref_order = read(os.path.join(case_dir, "reference.jsonl"))
    cand, _ = read(os.path.join(case_dir, "candidate.jsonl"))
    paired_ids = [i for i in ref_order if i in cand]
    unpaired = len(set(ref) - set(cand)) + len(set(cand) - set(ref))
    assert allow_unpaired or unpaired == 0
    rows = []
    for qid in paired_ids:
        r, c = ref[qid], cand[qid]
        assert r["options"] == c["options"]
        p, lp = distribution(r)
        q, lq = distribution(c)
        gold_label = r.get("gold") if r.get("gold") is not None else c.get("gold")
        gold = r["options"].index(gold_label) if gold_label is not None else None
        srt = np.sort(p)[::-1]
        rows.append({
            "group": r.get("group", c.get("group", UNGROUPED)),
            "kl": float(np.sum(scipy.special.rel_entr(p, q))),
            "ref_top": int(np.argmax(p)), "cand_top": int(np.argmax(q)),
            "ref_conf": float(np.max(p)), "cand_conf": float(np.max(q)),
            "margin": float(srt[0] - srt[1]),
            "gold": gold,
            "ref_brier": None if gold is None else float(np.sum((p - np.eye(len(p))[gold]) ** 2)),
            "cand_brier": None if gold is None else float(np.sum((q - np.eye(len(q))[gold]) ** 2)),
            "ref_nll": None if gold is None else float(-np.log(p[gold])),
            "cand_nll": None if gold is None else float(-np.log(q[gold])),
        })
    n = len(rows)
    flip = np.array([x["ref_top"] != x["cand_top"] for x in rows])
    flips = int(flip.sum())
    kl = np.array([x["kl"] for x in rows])
    margin = np.array([x["margin"] for x in rows])
    g = [x for x in rows if x["gold"] is not None]
    has_gold = len(g) > 0
    ci = scipy.stats.binomtest(flips, n).proportion_ci(confidence_level=0.95, method="wilson")

    out = {
        "n": n,
        "unpaired": unpaired,
        "flips": flips,
        "flip_rate": flips / n,
        "flip_rate_ci95": [float(ci.low), float(ci.high)],
        "same_top": (n - flips) / n,
        "kl": {
            "mean": float(np.mean(kl)),
            "mean_se": float(scipy.stats.sem(kl)) if n > 1 else None,
            "median": percentile(kl, 50),
            "p90": percentile(kl, 90),
            "p99": percentile(kl, 99),
            "p999": percentile(kl, 99.9),
            "max": float(np.max(kl)),
        },
    }
    tables = {}
    if has_gold:
        gold = np.array([x["gold"] for x in g])
        rc = np.array([x["ref_top"] for x in g]) == gold
        cc = np.array([x["cand_top"] for x in g]) == gold
        gflip = np.array([x["ref_top"] != x["cand_top"] for x in g])
        worse = int(np.sum(rc & ~cc))
        better = int(np.sum(~rc & cc))
        out["flips_correct_to_wrong"] = worse
        out["flips_wrong_to_correct"] = better
        out["flips_wrong_to_other_wrong"] = int(np.sum(~rc & ~cc & gflip))
        ref_acc = accuracy_score(gold, np.array([x["ref_top"] for x in g]))
        cand_acc = accuracy_score(gold, np.array([x["cand_top"] for x in g]))
        k, m = min(worse, better), worse + better
        if m == 0:
            p_exact, midp = 1.0, 1.0
        else:
            p_exact = float(scipy.stats.binomtest(k, m, 0.5).pvalue)
            midp = float(min(1.0, 2 * scipy.stats.binom.cdf(k, m, 0.5) - scipy.stats.binom.pmf(k, m, 0.5)))
        d = cc.astype(np.float64) - rc.astype(np.float64)
        out["accuracy"] = {
            "reference": float(ref_acc),
            "candidate": float(cand_acc),
            "delta": float(cand_acc - ref_acc),
            "delta_ci95": bootstrap_ci(d, seed, ORACLE_BOOTSTRAP) if resamples > 0 else None,
            "mcnemar_p": p_exact,
            "mcnemar_midp": midp,
        }
        out["_exact_bootstrap_ci95"] = exact_bootstrap_quantiles(len(g), worse, better)
        cal = {}
        for side, conf_key, correct in (("reference", "ref_conf", rc), ("candidate", "cand_conf", cc)):
            conf = np.array([x[conf_key] for x in g])
            ece, table = ece_equal_width(conf, correct, bins)
            prefix = "ref" if side == "reference" else "cand"
            cal[side] = {
                "ece": float(ece),
                "adaptive_ece": ece_equal_mass(conf, correct, bins),
                "brier": float(np.mean([x[prefix + "_brier"] for x in g])),
                "nll": float(np.mean([x[prefix + "_nll"] for x in g])),
            }
            tables[side] = table
        out["calibration"] = cal
    else:
        for key in ("flips_correct_to_wrong", "flips_wrong_to_correct", "flips_wrong_to_other_wrong"):
            out[key] = None
        out["accuracy"] = {k: None for k in ("reference", "candidate", "delta", "delta_ci95", "mcnemar_p", "mcnemar_midp")}
        none_cal = {"ece": None, "adaptive_ece": None, "brier": None, "nll": None}
        out["calibration"] = {"reference": dict(none_cal), "candidate": dict(none_cal)}
    flip_margins = margin[flip]
    out["near_ties"] = {
        "flip_margin_median": float(np.median(flip_margins)) if flips else None,
        "all_margin_median": float(np.median(margin)),
        "flips_margin_below_0_1": float(np.mean(flip_margins < 0.1)) if flips else None,
    }
    groups = {}
    for name in sorted({x["group"] for x in rows}):
        members = [x for x in rows if x["group"] == name]
        gf = sum(x["ref_top"] != x["cand_top"] for x in members)
        gg = [x for x in members if x["gold"] is not None]
        delta = None
        if gg:
            delta = (np.mean([x["cand_top"] == x["gold"] for x in gg])
                     - np.mean([x["ref_top"] == x["gold"] for x in gg]))
            delta = float(delta)
        groups[name] = {"n": len(members), "flips": int(gf), "flip_rate": gf / len(members),
                        "accuracy_delta": delta, "kl_mean": float(np.mean([x["kl"] for x in members]))}
    out["groups"] = groups
    deltas = [v["accuracy_delta"] for v in groups.values() if v["accuracy_delta"] is not None]
    out["mean_group_accuracy_delta"] = float(np.mean(deltas)) if deltas else None
    out["_tables"] = tables
    out["_flip_margins"] = [float(v) for v in flip_margins]
    return out


# ---------------------------------------------------------------- hidden states

DTYPES = {"F32": np.float32, "F64": np.float64}


def write_safetensors(path, tensors):
    """Minimal safetensors writer: 8-byte little-endian header size, JSON header,
    then the raw little-endian tensors back to back."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}[array.dtype]
        data = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def hidden_case():
    rng = np.random.default_rng(5)
    a, b = {}, {}
    records, hidden = 6, 64
    for layer in (0, 1, 2, 10):
        x = rng.normal(0, 1 + layer, (records, hidden)).astype(np.float32)
        noise = rng.normal(0, 0.01 * (layer + 1), (records, hidden)).astype(np.float32)
        a[f"layers.{layer}"] = x
        b[f"layers.{layer}"] = (x + noise).astype(np.float32)
    a["layers.3"] = np.zeros((records, hidden), dtype=np.float32)  # zero reference
    b["layers.3"] = np.zeros((records, hidden), dtype=np.float32)
    a["layers.4"] = rng.normal(0, 1, (records, hidden)).astype(np.float32)  # identical
    b["layers.4"] = a["layers.4"].copy()
    a["layers.5"] = rng.normal(0, 1, (records, hidden))  # F64, one zero row in B
    b["layers.5"] = a["layers.5"] + rng.normal(0, 1e-6, (records, hidden))
    b["layers.5"][2] = 0.0
    d = os.path.join(ROOT, "hidden")
    os.makedirs(d, exist_ok=True)
    write_safetensors(os.path.join(d, "a.safetensors"), a)
    write_safetensors(os.path.join(d, "b.safetensors"), b)
    expected = {}
    for name in a:
        x = a[name].astype(np.float64).ravel()
        y = b[name].astype(np.float64).ravel()
        nx, ny, ne = np.linalg.norm(x), np.linalg.norm(y), np.linalg.norm(x - y)
        rows = a[name].astype(np.float64)
        rows_b = b[name].astype(np.float64)
        row_norms = np.linalg.norm(rows, axis=1) * np.linalg.norm(rows_b, axis=1)
        row_cos = [float(np.dot(u, v) / nn) for u, v, nn in zip(rows, rows_b, row_norms) if nn > 0]
        expected[name] = {
            "shape": list(a[name].shape),
            "cosine": float(np.dot(x, y) / (nx * ny)) if nx > 0 and ny > 0 else None,
            "min_row_cosine": min(row_cos) if row_cos else None,
            "relative_l2": float(ne / nx) if nx > 0 else None,
            "sqnr_db": float(10 * np.log10(nx ** 2 / ne ** 2)) if nx > 0 and ne > 0 else None,
            "identical": bool(np.array_equal(a[name], b[name])),
        }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


CASES = [
    # name, generator arguments, comparison options
    ("gold_groups", dict(seed=1, n=2000, n_options=[4], gold_share=1.0,
                         groups=["arc", "hellaswag", "mmlu", None], candidate_noise=0.3,
                         probs_share=0.2),
     dict(bins=15, bootstrap=10000, seed=0, allow_unpaired=False)),
    ("no_gold", dict(seed=2, n=300, n_options=[2, 3, 5], gold_share=0.0, groups=None,
                     candidate_noise=0.6),
     dict(bins=15, bootstrap=10000, seed=0, allow_unpaired=False)),
    ("partial_gold_unpaired", dict(seed=3, n=600, n_options=[3, 4, 5], gold_share=0.6,
                                   groups=["gsm", "piqa"], candidate_noise=0.5,
                                   probs_share=0.3, extra_reference=7, extra_candidate=4),
     dict(bins=15, bootstrap=10000, seed=0, allow_unpaired=True)),
    ("small_bins4", dict(seed=4, n=11, n_options=[2, 4], gold_share=1.0, groups=["x", "y"],
                         candidate_noise=1.5, probs_share=0.5, shuffle=False),
     dict(bins=4, bootstrap=10000, seed=7, allow_unpaired=False)),
]


def main():
    print(f"numpy {np.__version__}, scipy {scipy.__version__}, scikit-learn {sklearn.__version__}",
          file=sys.stderr)
    for name, gen, opts in CASES:
        make_case(name, **gen)
        # Unknown groups in the partial case: one group without gold at all.
        if name == "partial_gold_unpaired":
            strip_gold(os.path.join(ROOT, name), group="piqa")
        result = compare(os.path.join(ROOT, name), opts["bins"], opts["bootstrap"], opts["seed"],
                         opts["allow_unpaired"])
        result["_options"] = opts
        with open(os.path.join(ROOT, name, "expected.json"), "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
        acc = result["accuracy"]
        print(f"{name}: n={result['n']} flips={result['flips']} delta={acc['delta']} "
              f"ci={acc['delta_ci95']} exact={result.get('_exact_bootstrap_ci95')}", file=sys.stderr)
    hidden_case()


def strip_gold(case_dir, group):
    """Removes gold from every question of one group (on both sides)."""
    for file_name in ("reference.jsonl", "candidate.jsonl"):
        path = os.path.join(case_dir, file_name)
        lines = open(path).read().split("\n")
        ref_groups = {}
        if file_name == "candidate.jsonl":
            for line in open(os.path.join(case_dir, "reference.jsonl")):
                if line.strip():
                    r = json.loads(line)
                    ref_groups[r["id"]] = r.get("group")
        out = []
        for line in lines:
            if line.strip():
                r = json.loads(line)
                if r.get("group", ref_groups.get(r["id"])) == group:
                    r.pop("gold", None)
                line = json.dumps(r)
            out.append(line)
        with open(path, "w") as f:
            f.write("\n".join(out))


if __name__ == "__main__":
    main()
