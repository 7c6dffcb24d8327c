//! Quantization-aware extraction (`loraq extract --target-base`): on a target whose
//! error is exactly low rank the adapter recovers it down to the bf16 floor; on a
//! target equal to the base it is the plain adapter, byte for byte; a scheme gives the
//! same adapter as the checkpoint `loraq quantize` writes for it, and `loraq verify` on
//! that checkpoint measures what the report says; calibration weighting minimizes the
//! weighted error; bad targets and statistics are refused with no output.

mod common;

use common::{extract, extract_ok, loraq, ok, rewrite, s, stderr, write_owned};
use loraq_io::{Checkpoint, DType, ModuleName, TensorSpec};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A tiny synth pair (`extra`: more `loraq synth` arguments): (guard, base, merged).
fn tiny(seed: u64, extra: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let pair = dir.path().join("pair");
    let seed = seed.to_string();
    let mut args = vec![
        "synth",
        "--preset",
        "tiny",
        "--out",
        s(&pair),
        "--seed",
        &seed,
    ];
    args.extend_from_slice(extra);
    ok(loraq(&args));
    (dir, pair.join("base"), pair.join("merged"))
}

/// Refused: exit status 2, the message names every needle, no output directory.
fn assert_refused(o: &Output, out: &Path, needles: &[&str]) {
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    for needle in needles {
        assert!(
            stderr(o).contains(needle),
            "message should name {needle:?}: {}",
            stderr(o)
        );
    }
    assert!(!out.exists(), "no output directory after a refusal");
}

/// Deterministic standard normals (xorshift + Box-Muller), independent of the code
/// under test.
struct Normals(u64);

impl Normals {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Changes a module's statistics (None drops them).
type StatsEdit<'a> = dyn Fn(&str, Vec<f32>) -> Option<Vec<f32>> + 'a;

fn bf16_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Rank of the error planted in the target.
const ERROR_RANK: usize = 8;

/// The planted error is this many times the merged weight's bf16 floor.
const ERROR_OVER_FLOOR: f64 = 10.0;

/// A target checkpoint whose weights are `base - E` with E exactly rank
/// [`ERROR_RANK`] in every projection at least 32 wide (stored as F32, so the
/// target is exact): `merged - target = LoRA + E`, rank r + 8, plus the merge's own
/// bf16 rounding. Returns the modules that got an error.
fn plant_low_rank_error(base: &Path, target: &Path) -> Vec<String> {
    let mut rng = Normals(0x9e37_79b9_7f4a_7c15);
    let mut planted = Vec::new();
    rewrite(
        base,
        target,
        &mut |name, dtype, shape, bytes| {
            let linear = ModuleName::parse(name).is_some_and(|n| n.is_linear_weight());
            if !linear || shape.len() != 2 || shape[0].min(shape[1]) < 32 {
                return Some((dtype, shape.to_vec(), bytes.to_vec()));
            }
            assert_eq!(dtype, DType::BF16);
            let (rows, cols) = (shape[0], shape[1]);
            let w = bf16_to_f32(bytes);
            // Per-entry floor of the weights ~ ulp / sqrt(12); scale E to a multiple of it.
            let rms = (w.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
            let entry_floor = rms * 2f64.powi(-8) / 12f64.sqrt();
            let sigma = (ERROR_OVER_FLOOR * entry_floor / (ERROR_RANK as f64).sqrt()).sqrt();
            let u: Vec<f64> = (0..rows * ERROR_RANK).map(|_| sigma * rng.next()).collect();
            let v: Vec<f64> = (0..ERROR_RANK * cols).map(|_| sigma * rng.next()).collect();
            let t: Vec<f32> = (0..rows * cols)
                .map(|idx| {
                    let (i, j) = (idx / cols, idx % cols);
                    let e: f64 = (0..ERROR_RANK)
                        .map(|l| u[i * ERROR_RANK + l] * v[l * cols + j])
                        .sum();
                    (w[idx] as f64 - e) as f32
                })
                .collect();
            planted.push(name.trim_end_matches(".weight").to_string());
            Some((DType::F32, shape.to_vec(), f32_bytes(&t)))
        },
        Vec::new(),
    );
    planted
}

fn modules(report: &Value) -> &Vec<Value> {
    report["modules"].as_array().unwrap()
}

#[test]
fn an_exactly_low_rank_quantization_error_is_recovered_to_the_floor() {
    let (dir, base, merged) = tiny(11, &[]);
    let target = dir.path().join("target");
    let planted = plant_low_rank_error(&base, &target);
    assert!(planted.len() > 10, "{planted:?}");
    let out = dir.path().join("qa");
    let extra_rank = ERROR_RANK.to_string();
    let report = extract_ok(
        &merged,
        &base,
        &out,
        &[
            "--rank",
            "8",
            "--target-base",
            s(&target),
            "--extra-rank",
            &extra_rank,
        ],
    );
    assert_eq!(report["r"], 16);
    let mut checked = 0;
    for m in modules(&report) {
        let name = m["module"].as_str().unwrap();
        let t = &m["target"];
        let (plain, qa) = (&t["plain"], &t["quantization_aware"]);
        if !planted.iter().any(|p| p == name) {
            // No error planted: the target is the base, both adapters at the floor.
            assert!(qa["ratio"].as_f64().unwrap() < 1.05, "{name}: {t}");
            continue;
        }
        assert_eq!(m["adapter_rank"], 16, "{name}");
        // The plain adapter leaves the planted error; the quantization-aware one
        // reaches the floor, as the plain adapter does on the bf16 base.
        let plain_ratio = plain["ratio"].as_f64().unwrap();
        let qa_ratio = qa["ratio"].as_f64().unwrap();
        assert!(
            plain_ratio > 0.4 * ERROR_OVER_FLOOR,
            "{name}: plain {plain_ratio}"
        );
        assert!(qa_ratio < 1.05, "{name}: quantization-aware {qa_ratio}");
        assert!(
            qa_ratio <= 1.02 * m["ratio_after_cast"].as_f64().unwrap().max(0.9),
            "{name}: {qa_ratio} vs {}",
            m["ratio_after_cast"]
        );
        checked += 1;
    }
    assert_eq!(checked, planted.len());
    let totals = &report["target_base"]["totals"];
    assert!(
        totals["quantization_aware_relative"].as_f64().unwrap()
            < 0.2 * totals["plain_relative"].as_f64().unwrap(),
        "{totals}"
    );

    // The same rank without the extra ranks cannot hold both: above the floor.
    let short = extract_ok(
        &merged,
        &base,
        &dir.path().join("short"),
        &["--rank", "8", "--target-base", s(&target)],
    );
    for m in modules(&short) {
        if planted.iter().any(|p| p == m["module"].as_str().unwrap()) {
            assert!(m["target"]["quantization_aware"]["ratio"].as_f64().unwrap() > 2.0);
        }
    }
}

#[test]
fn a_target_equal_to_the_base_gives_the_plain_adapter_byte_for_byte() {
    let (dir, base, merged) = tiny(12, &[]);
    let plain = dir.path().join("plain");
    let qa = dir.path().join("qa");
    extract_ok(&merged, &base, &plain, &["--rank", "8"]);
    let report = extract_ok(
        &merged,
        &base,
        &qa,
        &["--rank", "8", "--target-base", s(&base)],
    );
    let name = "adapter_model.safetensors";
    assert_eq!(
        std::fs::read(plain.join(name)).unwrap(),
        std::fs::read(qa.join(name)).unwrap()
    );
    for m in modules(&report) {
        let t = &m["target"];
        assert_eq!(t["quantization_error"], 0.0);
        assert_eq!(t["plain"]["residual"], t["quantization_aware"]["residual"]);
    }
}

#[test]
fn a_scheme_target_equals_its_quantized_checkpoint_and_verify_agrees() {
    let (dir, base, merged) = tiny(13, &[]);
    let fp8 = dir.path().join("fp8");
    ok(loraq(&[
        "quantize",
        "--in",
        s(&base),
        "--out",
        s(&fp8),
        "--scheme",
        "fp8-block128",
    ]));
    let (by_scheme, by_dir) = (dir.path().join("scheme"), dir.path().join("dir"));
    let report = extract_ok(
        &merged,
        &base,
        &by_scheme,
        &["--rank", "8", "--target-base", "fp8-block128"],
    );
    extract_ok(
        &merged,
        &base,
        &by_dir,
        &["--rank", "8", "--target-base", s(&fp8)],
    );
    let name = "adapter_model.safetensors";
    assert_eq!(
        std::fs::read(by_scheme.join(name)).unwrap(),
        std::fs::read(by_dir.join(name)).unwrap()
    );
    // verify on the quantized checkpoint measures the quantization-aware residual the
    // report gives, module by module; the plain adapter's report figure likewise.
    let plain = dir.path().join("plain");
    extract_ok(&merged, &base, &plain, &["--rank", "8"]);
    for (adapter, field) in [(&by_scheme, "quantization_aware"), (&plain, "plain")] {
        let o = loraq(&[
            "verify",
            "--adapter",
            s(adapter),
            "--base",
            s(&fp8),
            "--merged",
            s(&merged),
            "--json",
        ]);
        let verified: Value = serde_json::from_slice(&o.stdout).unwrap();
        for v in verified["modules"].as_array().unwrap() {
            let m = modules(&report)
                .iter()
                .find(|m| m["module"] == v["module"])
                .unwrap();
            let ours = m["target"][field]["ratio"].as_f64().unwrap();
            let theirs = v["ratio"].as_f64().unwrap();
            assert!(
                (ours - theirs).abs() <= 1e-3 * theirs,
                "{} {field}: report {ours}, verify {theirs}",
                v["module"]
            );
        }
    }
    // On fp8 the quantization-aware adapter is never worse than the plain one, and
    // skipped modules (in_proj_a / in_proj_b) keep the bf16 weight.
    for m in modules(&report) {
        let t = &m["target"];
        let (p, q) = (
            t["plain"]["residual"].as_f64().unwrap(),
            t["quantization_aware"]["residual"].as_f64().unwrap(),
        );
        assert!(q <= p * 1.001, "{}: {q} vs {p}", m["module"]);
        if m["module"].as_str().unwrap().contains("in_proj_a") {
            assert_eq!(t["format"], "bf16 (not quantized)");
            assert_eq!(t["quantization_error"], 0.0);
        }
    }
}

/// Every linear module of `ckpt`: (module path, in_features).
fn linear_modules(ckpt: &Path) -> Vec<(String, usize)> {
    let c = Checkpoint::open(ckpt).unwrap();
    c.tensors()
        .filter_map(|t| {
            let n = ModuleName::parse(&t.name).filter(|n| n.is_linear_weight())?;
            Some((n.module_path(), t.shape[1]))
        })
        .collect()
}

/// A calibration file (the format of `loraq run --collect-stats`) with `value(k)` for
/// feature k of every module; `edit` may change a module's entry (None drops it).
fn write_activation_stats(
    path: &Path,
    modules: &[(String, usize)],
    value: &dyn Fn(usize) -> f32,
    edit: &StatsEdit,
) {
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = Vec::new();
    for (module, cols) in modules {
        let values: Vec<f32> = (0..*cols).map(value).collect();
        if let Some(v) = edit(module, values) {
            tensors.push((
                TensorSpec::new(format!("{module}.input_sq_mean"), DType::F32, vec![v.len()]),
                f32_bytes(&v),
            ));
        }
    }
    tensors.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    let metadata = BTreeMap::from([
        ("format".to_string(), "loraq-calibration".to_string()),
        ("version".to_string(), "1".to_string()),
        ("tokens".to_string(), "1000".to_string()),
        ("records".to_string(), "10".to_string()),
    ]);
    write_owned(path, &tensors, &metadata);
}

fn keep_all(_: &str, v: Vec<f32>) -> Option<Vec<f32>> {
    Some(v)
}

/// (||D - BA||_F, ||(D - BA) diag(w)||_F) of an adapter's module, in f64, from the
/// adapter's stored factors: the test's own arithmetic.
fn measure(adapter: &loraq_io::LoraAdapter, module: &str, delta: &[f32], w: &[f64]) -> (f64, f64) {
    let info = adapter.module(module).unwrap();
    let (a, b) = (
        adapter.read_a_f32(module).unwrap(),
        adapter.read_b_f32(module).unwrap(),
    );
    let (rows, cols, k) = (info.out_features, info.in_features, info.rank);
    let (mut plain, mut weighted) = (0f64, 0f64);
    for i in 0..rows {
        for j in 0..cols {
            let p: f64 = (0..k)
                .map(|l| b[i * k + l] as f64 * a[l * cols + j] as f64)
                .sum();
            let e = (delta[i * cols + j] as f64 - p).powi(2);
            plain += e;
            weighted += e * w[j] * w[j];
        }
    }
    (plain.sqrt(), weighted.sqrt())
}

#[test]
fn calibration_weighting_minimizes_the_weighted_error() {
    let (dir, base, merged) = tiny(14, &[]);
    let mods = linear_modules(&base);
    let (uniform, skewed) = (dir.path().join("uniform.st"), dir.path().join("skewed.st"));
    write_activation_stats(&uniform, &mods, &|_| 1.0, &keep_all);
    // E[x^2] spanning 1..49 over the features: weights 1..7.
    let sq_mean = |k: usize| ((k % 7 + 1) as f32).powi(2);
    write_activation_stats(&skewed, &mods, &sq_mean, &keep_all);
    let nvfp4 = dir.path().join("nvfp4");
    ok(loraq(&[
        "quantize",
        "--in",
        s(&base),
        "--out",
        s(&nvfp4),
        "--scheme",
        "nvfp4",
    ]));
    let common = ["--rank", "8", "--target-base", "nvfp4", "--method", "exact"];
    let run = |name: &str, calibration: Option<&Path>| {
        let mut args: Vec<&str> = common.to_vec();
        if let Some(c) = calibration {
            args.extend(["--calibration", s(c)]);
        }
        let out = dir.path().join(name);
        let report = extract_ok(&merged, &base, &out, &args);
        (out, report)
    };
    let (unweighted_dir, _) = run("unweighted", None);
    let (uniform_dir, _) = run("uniform", Some(&uniform));
    // Uniform statistics: S = I, the same adapter bit for bit.
    let name = "adapter_model.safetensors";
    assert_eq!(
        std::fs::read(unweighted_dir.join(name)).unwrap(),
        std::fs::read(uniform_dir.join(name)).unwrap()
    );

    // Skewed statistics: measured here on the quantized checkpoint, the weighted
    // adapter has the smaller weighted error, the unweighted one the smaller error.
    let (weighted_dir, weighted) = run("weighted", Some(&skewed));
    let target = loraq_quant::QuantizedBase::open(&nvfp4).unwrap();
    let merged_ckpt = Checkpoint::open(&merged).unwrap();
    let wa = loraq_io::LoraAdapter::open(&weighted_dir).unwrap();
    let ua = loraq_io::LoraAdapter::open(&unweighted_dir).unwrap();
    let (mut w_total, mut u_total) = (0f64, 0f64);
    for m in modules(&weighted) {
        let module = m["module"].as_str().unwrap();
        let tensor = format!("{module}.weight");
        let mut delta = merged_ckpt.read_f32(&tensor).unwrap();
        let t = target.read_weight_f32(&tensor).unwrap();
        delta.iter_mut().zip(&t).for_each(|(d, t)| *d -= t);
        let w: Vec<f64> = (0..m["shape"][1].as_u64().unwrap() as usize)
            .map(|k| (sq_mean(k) as f64).sqrt())
            .collect();
        let (w_plain, w_weighted) = measure(&wa, module, &delta, &w);
        let (u_plain, u_weighted) = measure(&ua, module, &delta, &w);
        // The report's figures are these.
        let qa = &m["target"]["quantization_aware"];
        let reported = qa["weighted_residual"].as_f64().unwrap();
        assert!(
            (reported - w_weighted).abs() <= 1e-4 * w_weighted,
            "{module}"
        );
        assert!((qa["residual"].as_f64().unwrap() - w_plain).abs() <= 1e-4 * w_plain);
        if m["target"]["quantization_error"] == 0.0 {
            continue;
        }
        // Each is optimal for its own objective, up to the bf16 cast of the factors.
        assert!(
            w_weighted <= 1.002 * u_weighted,
            "{module}: {w_weighted} vs {u_weighted}"
        );
        assert!(
            u_plain <= 1.002 * w_plain,
            "{module}: {u_plain} vs {w_plain}"
        );
        w_total += w_weighted * w_weighted;
        u_total += u_weighted * u_weighted;
    }
    assert!(w_total < 0.99 * u_total, "{w_total} vs {u_total}");
}

#[test]
fn bad_targets_and_statistics_are_refused_with_no_output() {
    let (dir, base, merged) = tiny(15, &[]);
    let out = dir.path().join("out");
    let mods = linear_modules(&base);
    let victim = mods
        .iter()
        .find(|(m, _)| m.ends_with("mlp.down_proj"))
        .unwrap()
        .0
        .clone();
    let victim_tensor = format!("{victim}.input_sq_mean");
    let cases: Vec<(&str, Box<StatsEdit<'_>>)> = vec![
        (
            "expected F32",
            Box::new(|m: &str, mut v: Vec<f32>| {
                if m == victim {
                    v.push(1.0);
                }
                Some(v)
            }),
        ),
        (
            "NaN",
            Box::new(|m: &str, mut v: Vec<f32>| {
                if m == victim {
                    v[3] = f32::NAN;
                }
                Some(v)
            }),
        ),
        (
            "missing",
            Box::new(|m: &str, v: Vec<f32>| (m != victim).then_some(v)),
        ),
    ];
    for (i, (needle, edit)) in cases.iter().enumerate() {
        let file = dir.path().join(format!("bad{i}.st"));
        write_activation_stats(&file, &mods, &|_| 1.0, edit.as_ref());
        let o = extract(
            &merged,
            &base,
            &out,
            &[
                "--rank",
                "8",
                "--target-base",
                "fp8-block128",
                "--calibration",
                s(&file),
            ],
        );
        assert_refused(&o, &out, &[needle, &victim_tensor, s(&file)]);
    }

    // A target directory from another model: a tensor of another shape, one missing.
    let norm = "model.language_model.norm.weight";
    let wrong_shape = dir.path().join("wrong-shape");
    rewrite(
        &base,
        &wrong_shape,
        &mut |name, dtype, shape, bytes| {
            if name == norm {
                Some((dtype, vec![shape[0] / 2], bytes[..bytes.len() / 2].to_vec()))
            } else {
                Some((dtype, shape.to_vec(), bytes.to_vec()))
            }
        },
        Vec::new(),
    );
    let o = extract(
        &merged,
        &base,
        &out,
        &["--rank", "8", "--target-base", s(&wrong_shape)],
    );
    assert_refused(&o, &out, &[norm, s(&wrong_shape)]);
    let missing = dir.path().join("missing");
    let gone = format!("{victim}.weight");
    rewrite(
        &base,
        &missing,
        &mut |name, dtype, shape, bytes| {
            (name != gone).then(|| (dtype, shape.to_vec(), bytes.to_vec()))
        },
        Vec::new(),
    );
    let o = extract(
        &merged,
        &base,
        &out,
        &["--rank", "8", "--target-base", s(&missing)],
    );
    assert_refused(&o, &out, &[&gone, "missing"]);

    // Options of a quantization-aware adapter without a target; ranks past 512.
    let o = extract(&merged, &base, &out, &["--extra-rank", "8"]);
    assert_refused(&o, &out, &["--target-base"]);
    let o = extract(
        &merged,
        &base,
        &out,
        &[
            "--rank",
            "512",
            "--target-base",
            "nvfp4",
            "--extra-rank",
            "8",
        ],
    );
    assert_refused(&o, &out, &["--extra-rank", "512"]);
}

#[test]
fn all_layers_corrects_the_modules_the_lora_leaves_alone() {
    let (dir, base, merged) = tiny(16, &["--lora-layers", "2-3"]);
    let out = dir.path().join("qa");
    let report = extract_ok(
        &merged,
        &base,
        &out,
        &[
            "--rank",
            "8",
            "--target-base",
            "fp8-block128",
            "--extra-rank",
            "8",
            "--all-layers",
            "--correction-rank",
            "8",
        ],
    );
    let corrections = report["corrections"].as_array().unwrap();
    let untouched: Vec<String> = linear_modules(&base)
        .into_iter()
        .map(|(m, _)| m)
        .filter(|m| m.contains(".layers.0.") || m.contains(".layers.1."))
        .collect();
    // Every untouched module fp8 quantizes is corrected; in_proj_a / in_proj_b stay
    // bf16 in the target, so there is nothing to correct.
    let expected: Vec<&String> = untouched
        .iter()
        .filter(|m| !m.ends_with("in_proj_a") && !m.ends_with("in_proj_b"))
        .collect();
    assert_eq!(corrections.len(), expected.len(), "{corrections:?}");
    let config: Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["r"], 16);
    let adapter = loraq_io::LoraAdapter::open(&out).unwrap();
    for c in corrections {
        let module = c["module"].as_str().unwrap();
        assert!(expected.iter().any(|m| *m == module), "{module}");
        assert_eq!(c["adapter_rank"], 8);
        assert_eq!(config["rank_pattern"][format!("^{module}")], 8, "{module}");
        assert_eq!(adapter.module(module).unwrap().rank, 8);
        let t = &c["target"];
        assert_eq!(t["plain"]["rank"], 0);
        let (p, q) = (
            t["plain"]["residual"].as_f64().unwrap(),
            t["quantization_aware"]["residual"].as_f64().unwrap(),
        );
        // Without an adapter the residual is the quantization error itself.
        let e = t["quantization_error"].as_f64().unwrap();
        assert!((p - e).abs() <= 1e-12 * e, "{module}: {p} vs {e}");
        assert!(q < p, "{module}: {q} vs {p}");
    }
    for m in modules(&report) {
        assert!(
            m["module"].as_str().unwrap().contains(".layers.2.")
                || m["module"].as_str().unwrap().contains(".layers.3.")
        );
    }
    let corrected = &report["target_base"]["totals"]["corrections"];
    assert!(
        corrected["quantization_aware_relative"].as_f64().unwrap()
            < corrected["plain_relative"].as_f64().unwrap()
    );
    // --all-layers needs its budget.
    let o = extract(
        &merged,
        &base,
        &dir.path().join("no-budget"),
        &["--target-base", "fp8-block128", "--all-layers"],
    );
    assert_eq!(o.status.code(), Some(2));
}
