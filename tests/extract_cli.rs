//! End-to-end tests of `loraq extract`, `loraq verify` and `loraq check` on synthetic
//! pairs from `loraq synth`, whose true adapter is known: the extracted deltas must
//! match it within the bf16 rounding floor, and every input that is not base + LoRA
//! must be refused with no output directory left behind.

mod common;

use common::{extract, extract_ok, loraq, rewrite, s as path, stderr, write_owned};
use loraq_io::{Checkpoint, DType, LoraAdapter, TensorSpec};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn synth(out: &Path, preset: &str, seed: u64, extra: &[&str]) {
    let seed = seed.to_string();
    let mut args = vec![
        "synth",
        "--preset",
        preset,
        "--out",
        path(out),
        "--seed",
        &seed,
    ];
    args.extend_from_slice(extra);
    let o = loraq(&args);
    assert!(o.status.success(), "synth: {}", stderr(&o));
}

/// Refused: non-zero exit, the message names `needle`, and no output directory.
fn assert_refused(o: &Output, out: &Path, needle: &str) {
    assert!(!o.status.success(), "extraction should have been refused");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(o).contains(needle),
        "message should name {needle:?}: {}",
        stderr(o)
    );
    assert!(!out.exists(), "no output directory after a refusal");
    let parent = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".loraq-tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary directory left behind");
}

/// `dst` = `src` with `patch` applied to the bytes of the tensor named `target`, every
/// other tensor as it is.
fn rewrite_one(src: &Path, dst: &Path, target: &str, patch: impl Fn(&mut [u8])) {
    rewrite(
        src,
        dst,
        &mut |name, dtype, shape, bytes| {
            let mut bytes = bytes.to_vec();
            if name == target {
                patch(&mut bytes);
            }
            Some((dtype, shape.to_vec(), bytes))
        },
        Vec::new(),
    );
}

fn keep(
    _: &str,
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
) -> Option<(DType, Vec<usize>, Vec<u8>)> {
    Some((dtype, shape.to_vec(), bytes.to_vec()))
}

const TINY_PREFIX: &str = "model.language_model.layers";

/// A tiny synth triple in a temp dir: (guard, root).
fn tiny(seed: u64, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pair");
    synth(&root, "tiny", seed, extra);
    (dir, root)
}

/// `scale * B A` of a module, row-major f64.
fn adapter_delta(adapter: &LoraAdapter, module: &str) -> Vec<f64> {
    let info = adapter
        .module(module)
        .unwrap_or_else(|| panic!("{module} missing"));
    let a = adapter.read_a_f32(module).unwrap();
    let b = adapter.read_b_f32(module).unwrap();
    let (rows, cols, rank) = (info.out_features, info.in_features, info.rank);
    let mut out = vec![0f64; rows * cols];
    for i in 0..rows {
        for l in 0..rank {
            let coef = b[i * rank + l] as f64 * info.scale;
            for j in 0..cols {
                out[i * cols + j] += coef * a[l * cols + j] as f64;
            }
        }
    }
    out
}

fn module_reports(report: &Value) -> Vec<Value> {
    report["modules"].as_array().expect("modules").clone()
}

#[test]
fn extracted_deltas_match_the_true_adapter_within_the_floor() {
    let (_guard, root) = tiny(3, &[]);
    let out = root.join("extracted");
    let report = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8"],
    );
    let extracted = LoraAdapter::open(&out).unwrap();
    let truth = LoraAdapter::open(root.join("true-adapter")).unwrap();
    assert_eq!(extracted.modules.len(), truth.modules.len());
    let mut low_rank_modules = 0;
    for m in module_reports(&report) {
        let module = m["module"].as_str().unwrap();
        let floor = m["floor"].as_f64().unwrap();
        let (rows, cols) = (
            m["shape"][0].as_u64().unwrap() as usize,
            m["shape"][1].as_u64().unwrap() as usize,
        );
        let rank = m["rank"].as_u64().unwrap() as usize;
        let expected_rank = truth.module(module).unwrap().rank;
        assert_eq!(rank, expected_rank, "{module}: rank");
        let ours = adapter_delta(&extracted, module);
        let theirs = adapter_delta(&truth, module);
        let difference = ours
            .iter()
            .zip(&theirs)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        let ratio = m["ratio"].as_f64().unwrap();
        if rank < rows.min(cols) {
            // The rank-r fit removes most of the merge's rounding noise.
            assert!(
                difference <= floor,
                "{module}: ||extracted - true|| = {difference:e} above the floor {floor:e}"
            );
            // At these tiny shapes the expected ratio sqrt(1 - r(m+n-r)/(mn)) is ~0.87;
            // relative to it the residual must be at the floor.
            let expected = m["expected_ratio"].as_f64().unwrap();
            let relative = ratio / expected;
            assert!(
                (0.9..=1.05).contains(&relative),
                "{module}: ratio {ratio} vs expected {expected}"
            );
            low_rank_modules += 1;
        } else {
            // Full width: the merge itself (its rounding noise included, energy ~F^2 on
            // 256 entries, hence the slack) is reproduced up to the cast.
            assert!(
                ratio < 1e-3,
                "{module}: full-width module must be reproduced, ratio {ratio}"
            );
            let cast = m["cast_error"].as_f64().unwrap();
            assert!(
                difference <= 1.25 * floor.hypot(cast),
                "{module}: {difference:e} vs floor {floor:e}"
            );
        }
    }
    assert!(low_rank_modules > 10);
    // SHA256SUMS covers every other file.
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    for file in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "manifest.json",
        "extraction_report.json",
    ] {
        assert!(
            sums.contains(&format!("  {file}\n")),
            "SHA256SUMS lacks {file}"
        );
    }
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        manifest["modules"].as_array().unwrap().len(),
        extracted.modules.len()
    );
    assert!(manifest["merged"]["config_sha256"].as_str().unwrap().len() == 64);
}

#[test]
fn in_proj_a_and_b_keep_their_full_width_through_rank_pattern() {
    let (_guard, root) = tiny(5, &[]);
    let out = root.join("extracted");
    let report = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8"],
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["r"], 8);
    assert_eq!(config["lora_alpha"], 8);
    assert_eq!(config["rank_pattern"], config["alpha_pattern"]);
    let pattern = config["rank_pattern"].as_object().unwrap();
    let mut seen = 0;
    for m in module_reports(&report) {
        let module = m["module"].as_str().unwrap();
        if module.ends_with("in_proj_a") || module.ends_with("in_proj_b") {
            let width = m["shape"][0].as_u64().unwrap();
            assert!(width < 8, "tiny in_proj_a/b are narrower than the rank");
            assert_eq!(
                m["rank"].as_u64().unwrap(),
                width,
                "{module} keeps its full width"
            );
            assert_eq!(
                pattern[&format!("^{module}")],
                width,
                "{module} in rank_pattern"
            );
            // Reproduced up to the factors' bf16 rounding: no truncation residual.
            assert!(m["ratio"].as_f64().unwrap() < 1e-3);
            // bf16 rounding of both factors: ~0.23% of the delta in RMS.
            assert!(m["cast_error"].as_f64().unwrap() <= 0.004 * m["delta_norm"].as_f64().unwrap());
            seen += 1;
        }
    }
    assert_eq!(seen, 6, "three linear-attention layers, two modules each");
    assert!(config.get("modules_to_save").is_none());
}

#[test]
fn verify_passes_for_extracted_and_true_adapters_and_fails_for_a_wrong_one() {
    let (_guard, root) = tiny(7, &[]);
    let out = root.join("extracted");
    extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8"],
    );
    for adapter in [out.clone(), root.join("true-adapter")] {
        let o = loraq(&[
            "verify",
            "--adapter",
            path(&adapter),
            "--base",
            path(&root.join("base")),
            "--merged",
            path(&root.join("merged")),
            "--json",
        ]);
        assert!(
            o.status.success(),
            "verify {}: {}",
            adapter.display(),
            stderr(&o)
        );
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["passed"], true);
        assert!(v["distribution"]["max"].as_f64().unwrap() < 1.25);
    }
    // An adapter of another seed does not explain this merge.
    let (_other_guard, other) = tiny(8, &[]);
    let o = loraq(&[
        "verify",
        "--adapter",
        path(&other.join("true-adapter")),
        "--base",
        path(&root.join("base")),
        "--merged",
        path(&root.join("merged")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("verification failed"), "{}", stderr(&o));
}

#[test]
fn check_compares_adapters_up_to_the_cast() {
    let (_guard, root) = tiny(9, &[]);
    let (merged, base) = (root.join("merged"), root.join("base"));
    let balanced = root.join("balanced");
    let orthonormal = root.join("orthonormal");
    extract_ok(&merged, &base, &balanced, &["--rank", "8"]);
    extract_ok(
        &merged,
        &base,
        &orthonormal,
        &["--rank", "8", "--split", "orthonormal-a"],
    );
    let o = loraq(&["check", path(&balanced), path(&balanced), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["worst_relative_difference"], 0.0);
    for m in v["modules"].as_array().unwrap() {
        assert_eq!(m["factor_pairs"]["different"], 0);
        assert_eq!(m["factor_pairs"]["equal_up_to_sign"], 0);
    }
    // Another split: the same deltas up to the bf16 cast, different factors.
    let o = loraq(&["check", path(&balanced), path(&orthonormal), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let worst = v["worst_relative_difference"].as_f64().unwrap();
    assert!(worst > 0.0 && worst < 0.01, "{worst}");
    // Against the true adapter: ranks and shapes equal, deltas within what the merge's
    // rounding noise allows (full-width modules reproduce that noise: ~F/||D||, a few %).
    let o = loraq(&[
        "check",
        path(&root.join("true-adapter")),
        path(&balanced),
        "--tolerance",
        "0.1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_factor_pair_with_negated_components_is_equal_up_to_sign() {
    let (_guard, root) = tiny(10, &[]);
    let out = root.join("extracted");
    extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8"],
    );
    // Negate component 0 of every module (A row 0 and B column 0 together).
    let flipped = root.join("flipped");
    std::fs::create_dir_all(&flipped).unwrap();
    std::fs::copy(
        out.join("adapter_config.json"),
        flipped.join("adapter_config.json"),
    )
    .unwrap();
    let weights = Checkpoint::open(out.join("adapter_model.safetensors")).unwrap();
    let mut tensors = Vec::new();
    for info in weights.tensors() {
        let mut bytes = weights.bytes(&info.name).unwrap().to_vec();
        let cols = info.shape[1];
        if info.name.ends_with("lora_A.weight") {
            for j in 0..cols {
                bytes[2 * j + 1] ^= 0x80;
            }
        } else {
            for i in 0..info.shape[0] {
                bytes[2 * i * cols + 1] ^= 0x80;
            }
        }
        tensors.push((
            TensorSpec::new(info.name.clone(), info.dtype, info.shape.clone()),
            bytes,
        ));
    }
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_owned(
        &flipped.join("adapter_model.safetensors"),
        &tensors,
        &metadata,
    );
    let o = loraq(&["check", path(&out), path(&flipped), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["worst_relative_difference"], 0.0);
    for m in v["modules"].as_array().unwrap() {
        assert_eq!(m["factor_pairs"]["equal_up_to_sign"], 1, "{}", m["module"]);
        assert_eq!(m["factor_pairs"]["different"], 0);
    }
}

#[test]
fn a_changed_norm_is_refused_by_name() {
    let (_guard, root) = tiny(11, &[]);
    let merged = root.join("merged-norm");
    let norm = format!("{TINY_PREFIX}.1.input_layernorm.weight");
    rewrite_one(&root.join("merged"), &merged, &norm, |bytes| {
        bytes[0] ^= 0x01
    });
    let out = root.join("out");
    assert_refused(
        &extract(&merged, &root.join("base"), &out, &["--rank", "8"]),
        &out,
        &norm,
    );
}

#[test]
fn a_merged_only_tensor_is_refused() {
    let (_guard, root) = tiny(12, &[]);
    let merged = root.join("merged-extra");
    let extra = "model.language_model.layers.0.mlp.extra_proj.weight";
    rewrite(
        &root.join("merged"),
        &merged,
        &mut keep,
        vec![(
            TensorSpec::new(extra, DType::BF16, vec![2, 2]),
            vec![0u8; 8],
        )],
    );
    let out = root.join("out");
    let o = extract(&merged, &root.join("base"), &out, &["--rank", "8"]);
    assert_refused(&o, &out, extra);
    assert!(stderr(&o).contains("only in the merge"));
}

#[test]
fn nan_in_the_merge_is_refused_with_the_tensor_name() {
    let (_guard, root) = tiny(13, &[]);
    let merged = root.join("merged-nan");
    let target = format!("{TINY_PREFIX}.0.mlp.down_proj.weight");
    rewrite_one(&root.join("merged"), &merged, &target, |bytes| {
        bytes[6..8].copy_from_slice(&0x7fc0u16.to_le_bytes())
    });
    let out = root.join("out");
    let o = extract(&merged, &root.join("base"), &out, &["--rank", "8"]);
    assert_refused(&o, &out, &target);
    // The message names the merge's file, the tensor and the element.
    assert!(
        stderr(&o).contains("merged-nan/") && stderr(&o).contains("element 3 is not finite"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_shape_mismatch_is_refused() {
    let (_guard, root) = tiny(14, &[]);
    let merged = root.join("merged-shape");
    let target = format!("{TINY_PREFIX}.3.self_attn.o_proj.weight");
    rewrite(
        &root.join("merged"),
        &merged,
        &mut |name, dtype, shape, bytes| {
            let shape = if name == target {
                vec![shape[0] * 2, shape[1] / 2]
            } else {
                shape.to_vec()
            };
            Some((dtype, shape, bytes.to_vec()))
        },
        Vec::new(),
    );
    let out = root.join("out");
    let o = extract(&merged, &root.join("base"), &out, &["--rank", "8"]);
    assert_refused(&o, &out, &target);
    assert!(stderr(&o).contains("shape differs"));
}

#[test]
fn an_existing_output_is_refused_without_force_and_replaced_with_it() {
    let (_guard, root) = tiny(15, &[]);
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let o = extract(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8"],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains(path(&out)), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "8", "--force"],
    );
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("adapter_model.safetensors").is_file());
}

#[test]
fn a_rank_too_small_for_the_delta_is_refused_naming_the_modules() {
    let (_guard, root) = tiny(16, &[]);
    let out = root.join("out");
    let o = extract(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "1"],
    );
    assert_refused(&o, &out, "residual above 1.1 x the bf16 rounding floor");
    assert!(
        stderr(&o).contains(&format!("{TINY_PREFIX}.0.mlp.up_proj")),
        "{}",
        stderr(&o)
    );
    // --allow-residual writes it and lists the modules in the report.
    let report = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "1", "--allow-residual"],
    );
    assert!(
        !report["totals"]["above_threshold"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[test]
fn rank_auto_finds_the_true_rank_and_a_servable_r() {
    let (_guard, root) = tiny(17, &[]);
    let out = root.join("out");
    let report = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "auto"],
    );
    assert_eq!(report["r"], 8);
    for m in module_reports(&report) {
        let rows = m["shape"][0].as_u64().unwrap();
        let cols = m["shape"][1].as_u64().unwrap();
        let rank = m["rank"].as_u64().unwrap();
        assert!(
            rank <= 8.min(rows).min(cols),
            "{}: rank {rank}",
            m["module"]
        );
        let (ratio, expected) = (
            m["ratio"].as_f64().unwrap(),
            m["expected_ratio"].as_f64().unwrap(),
        );
        // Full-width modules: expected 0, reached to f64 rounding.
        assert!(
            ratio <= 1.05 * expected + 1e-4,
            "{}: ratio {ratio}, expected {expected}",
            m["module"]
        );
    }
}

#[test]
fn bytes_differing_only_in_signed_zeros_are_reported_and_not_factored() {
    let (_guard, root) = tiny(18, &["--lora-layers", "0-0"]);
    let target = format!("{TINY_PREFIX}.2.mlp.up_proj.weight");
    let zero_first =
        |sign: u16| move |bytes: &mut [u8]| bytes[0..2].copy_from_slice(&sign.to_le_bytes());
    let (base, merged) = (root.join("base-z"), root.join("merged-z"));
    rewrite_one(&root.join("base"), &base, &target, zero_first(0x0000));
    rewrite_one(&root.join("merged"), &merged, &target, zero_first(0x8000));
    let out = root.join("out");
    let report = extract_ok(&merged, &base, &out, &["--rank", "8"]);
    assert_eq!(report["zero_delta"], serde_json::json!([target]));
    let adapter = LoraAdapter::open(&out).unwrap();
    assert!(
        adapter
            .modules
            .iter()
            .all(|m| m.module_path.contains(".0.")),
        "only layer 0 is adapted"
    );
}

#[test]
fn copy_brings_named_files_and_records_them() {
    let (_guard, root) = tiny(19, &[]);
    let merged = root.join("merged");
    std::fs::write(merged.join("LICENSE"), "Apache-2.0\n").unwrap();
    std::fs::write(merged.join("head_config.json"), "{}\n").unwrap();
    let out = root.join("out");
    let report = extract_ok(
        &merged,
        &root.join("base"),
        &out,
        &["--rank", "8", "--copy", "LICENSE", "--copy", "head_*.json"],
    );
    assert_eq!(
        report["copied"],
        serde_json::json!(["LICENSE", "head_config.json"])
    );
    assert_eq!(
        std::fs::read_to_string(out.join("LICENSE")).unwrap(),
        "Apache-2.0\n"
    );
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    assert!(sums.contains("  LICENSE\n") && sums.contains("  head_config.json\n"));
    let out2 = root.join("out2");
    let o = extract(
        &merged,
        &root.join("base"),
        &out2,
        &["--rank", "8", "--copy", "NOTICE"],
    );
    assert_refused(&o, &out2, "--copy NOTICE");
}

#[test]
fn a_killed_run_leaves_no_output_directory() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pair");
    synth(&root, "demo", 1, &[]);
    let out = root.join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args([
            "extract",
            "--merged",
            path(&root.join("merged")),
            "--base",
            path(&root.join("base")),
            "--out",
            path(&out),
            "--rank",
            "32",
            "--method",
            "exact",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the run is writing into its temporary directory, then kill it.
    let started = std::time::Instant::now();
    loop {
        let writing = std::fs::read_dir(&root)
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".out.loraq-tmp-")
            });
        if writing || started.elapsed().as_secs() > 60 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the run must have been killed, not finished"
    );
    assert!(!out.exists(), "a killed run leaves no output directory");
}

/// The 9b-slice (Qwen3.5-9B's real layer shapes, rank 256): every rank-256 module at
/// 0.9-1.05 of the expected ratio over the floor. Slow on 2 cores (minutes).
#[test]
#[ignore = "9b-slice: minutes of CPU; run with --ignored"]
fn nine_b_slice_modules_are_at_the_floor() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pair");
    synth(&root, "9b-slice", 1, &[]);
    let out = root.join("out");
    let report = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &out,
        &["--rank", "256"],
    );
    let truth = LoraAdapter::open(root.join("true-adapter")).unwrap();
    for m in module_reports(&report) {
        let module = m["module"].as_str().unwrap();
        let rows = m["shape"][0].as_u64().unwrap() as usize;
        let cols = m["shape"][1].as_u64().unwrap() as usize;
        let rank = m["rank"].as_u64().unwrap() as usize;
        assert_eq!(rank, truth.module(module).unwrap().rank, "{module}");
        let ratio = m["ratio"].as_f64().unwrap();
        if rank < rows.min(cols) {
            // 0.93-0.97 for the large projections; k_proj / v_proj (1024 rows) expect
            // sqrt(1 - r(m+n-r)/(mn)) = 0.84, so the band is taken relative to that.
            let expected = m["expected_ratio"].as_f64().unwrap();
            assert!(
                (0.9..=1.05).contains(&(ratio / expected)),
                "{module}: {ratio} vs {expected}"
            );
            assert!(ratio <= 1.05, "{module}: {ratio}");
        } else {
            assert!(ratio < 1e-3, "{module}: {ratio}");
        }
    }
}

/// bf16 bits of `x`, rounded to nearest even (finite values).
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Deterministic values in [-1, 1) (a 64-bit LCG), independent of the code under test.
fn lcg_values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Little-endian bf16 bytes of `values`.
fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16_bits(v).to_le_bytes())
        .collect()
}

/// A tiny pair plus one tensor `name` of `shape` in both checkpoints: the base's values
/// random, the merge's the base's plus `delta(row, col)` rounded to bf16, the rows
/// before `first_changed_row` left byte-identical. Returns (guard, root, merged, base,
/// the merge's f32 values minus the base's).
fn pair_with_late_difference(
    seed: u64,
    name: &str,
    shape: &[usize],
    first_changed_row: usize,
    delta: &dyn Fn(usize, usize) -> f64,
) -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf, Vec<f64>) {
    let (guard, root) = tiny(seed, &[]);
    let cols: usize = shape[1..].iter().product();
    let rows = shape[0];
    let base_values: Vec<f32> = lcg_values(seed, rows * cols)
        .iter()
        .map(|v| 0.02 * v)
        .collect();
    let base_bf16: Vec<f32> = base_values
        .iter()
        .map(|&v| bf16_value(bf16_bits(v)))
        .collect();
    let merged_bf16: Vec<f32> = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            if i < first_changed_row {
                base_bf16[k]
            } else {
                bf16_value(bf16_bits((base_bf16[k] as f64 + delta(i, j)) as f32))
            }
        })
        .collect();
    let difference: Vec<f64> = merged_bf16
        .iter()
        .zip(&base_bf16)
        .map(|(&m, &b)| m as f64 - b as f64)
        .collect();
    let mut written = Vec::new();
    for (side, values) in [("base", &base_bf16), ("merged", &merged_bf16)] {
        let dst = root.join(format!("{side}-late"));
        rewrite(
            &root.join(side),
            &dst,
            &mut keep,
            vec![(
                TensorSpec::new(name, DType::BF16, shape.to_vec()),
                bf16_bytes(values),
            )],
        );
        written.push(dst);
    }
    let base = written.remove(0);
    let merged = written.remove(0);
    (guard, root, merged, base, difference)
}

/// A projection whose first 1 MiB (the part the scan compares before factoring) is
/// byte-identical in both checkpoints is found by the rest of the scan, which runs
/// while the other modules are factored, and is factored afterwards: it is in the
/// report and the adapter, in name order, and its factors reproduce the known delta
/// within the floor.
#[test]
fn a_projection_differing_only_past_its_first_mebibyte_is_extracted() {
    let name = "model.language_model.layers.7.mlp.up_proj.weight";
    let (rows, cols) = (1024, 1024);
    let u = lcg_values(101, rows);
    let v = lcg_values(102, cols);
    // Rank 1, about 40 bf16 ulps of the base's values, in rows 600 and on only (the
    // first 512 rows are the first MiB).
    let (_guard, root, merged, base, difference) =
        pair_with_late_difference(21, name, &[rows, cols], 600, &|i, j| {
            5e-3 * u[i] as f64 * v[j] as f64
        });
    assert!(difference[..512 * cols].iter().all(|&d| d == 0.0));
    let out = root.join("out-late");
    let report = extract_ok(&merged, &base, &out, &["--rank", "8"]);
    let modules: Vec<String> = module_reports(&report)
        .iter()
        .map(|m| m["module"].as_str().unwrap().to_string())
        .collect();
    let module = name.trim_end_matches(".weight");
    assert!(
        modules.iter().any(|m| m == module),
        "{module} not extracted: {modules:?}"
    );
    let mut sorted = modules.clone();
    sorted.sort();
    assert_eq!(modules, sorted, "modules in name order");
    // The same identical tensors as the tiny pair alone.
    let plain = extract_ok(
        &root.join("merged"),
        &root.join("base"),
        &root.join("out-plain"),
        &["--rank", "8"],
    );
    assert_eq!(report["identical_tensors"], plain["identical_tensors"]);
    assert_eq!(modules.len(), module_reports(&plain).len() + 1);
    let row = module_reports(&report)
        .into_iter()
        .find(|m| m["module"] == module)
        .unwrap();
    let floor = row["floor"].as_f64().unwrap();
    let adapter = LoraAdapter::open(&out).unwrap();
    let ours = adapter_delta(&adapter, module);
    // The rank-1 delta before the merge's rounding: the fit is within the floor of it.
    let truth: Vec<f64> = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            if i < 600 {
                0.0
            } else {
                5e-3 * u[i] as f64 * v[j] as f64
            }
        })
        .collect();
    let error = ours
        .iter()
        .zip(&truth)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        error <= floor,
        "||BA - true delta|| = {error:e}, floor {floor:e}"
    );
    let norm = difference.iter().map(|d| d * d).sum::<f64>().sqrt();
    assert!(norm > 10.0 * floor, "the delta is well above the floor");
}

/// A tensor that cannot be in an adapter and differs only past its first MiB is
/// refused by name, with no output, though the factoring had started.
#[test]
fn a_norm_differing_only_past_its_first_mebibyte_is_refused() {
    let name = "model.language_model.layers.7.post_attention_layernorm.weight";
    let (_guard, root, merged, base, _) =
        pair_with_late_difference(22, name, &[600_000, 1], 590_000, &|_, _| 1e-2);
    let out = root.join("out-late");
    assert_refused(&extract(&merged, &base, &out, &["--rank", "8"]), &out, name);
}
