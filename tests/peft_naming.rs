//! Adapters that the real clients load as written (issue 15): module naming
//! (`--names checkpoint|text`), `r`, `base_model_name_or_path` and the model card, on a
//! merge in the *ForConditionalGeneration* naming that PEFT and transformers made
//! (tests/data/peft-multimodal, scripts/peft_multimodal_fixture.py).
//!
//! The two `*_with_real_peft` tests load the extracted adapter with PEFT through
//! scripts/peft_load_check.py (skipped without LORAQ_ORACLE_PYTHON, required under CI).

mod common;

use common::{loraq, ok, oracle_python, run_oracle, s, stderr};
use loraq_io::{Checkpoint, LoraAdapter, LoraFactors, write_adapter};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/peft-multimodal")
}

/// `loraq extract` of the fixture pair into `out`, with `extra` arguments.
fn extract(out: &Path, extra: &[&str]) {
    let (merged, base) = (data().join("merged"), data().join("base"));
    let mut args = vec![
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(out),
    ];
    args.extend_from_slice(extra);
    ok(loraq(&args));
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The adapter's tensor names (safetensors header keys, without __metadata__).
fn tensor_names(adapter: &Path) -> Vec<String> {
    let c = Checkpoint::open(adapter.join("adapter_model.safetensors")).unwrap();
    c.tensors().map(|t| t.name.clone()).collect()
}

/// The figures scripts/peft_load_check.py printed, after it passed.
fn peft_load_check(python: &Path, adapter: &Path, class: &str) -> Value {
    let (base, merged, exact) = (
        data().join("base"),
        data().join("merged"),
        data().join("peft-adapter"),
    );
    let out = run_oracle(
        python,
        "scripts/peft_load_check.py",
        &[
            "--base",
            s(&base),
            "--merged",
            s(&merged),
            "--adapter",
            s(adapter),
            "--exact",
            s(&exact),
            "--class",
            class,
        ],
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// What every real-PEFT check asserts on top of the script's own exit status.
fn assert_applied_everywhere(figures: &Value, class: &str) {
    assert_eq!(figures["class"], class, "{figures}");
    // The fixture's LoRA covers all twelve linear kinds of both layers: 8 in the
    // linear-attention layer, 7 in the full-attention one.
    assert_eq!(figures["modules_in_file"], 15, "{figures}");
    assert_eq!(figures["lora_layers_applied"], 15, "{figures}");
    assert_eq!(figures["warnings"], Value::Array(vec![]), "{figures}");
    assert_eq!(figures["problems"], Value::Array(vec![]), "{figures}");
    let diff = figures["max_abs_logit_diff_adapter_vs_merged"]
        .as_f64()
        .unwrap();
    let exact = figures["max_abs_logit_diff_exact_adapter_vs_merged"]
        .as_f64()
        .unwrap();
    let base = figures["max_abs_logit_diff_base_vs_merged"]
        .as_f64()
        .unwrap();
    assert!(diff <= 1.5 * exact && diff * 20.0 <= base, "{figures}");
    assert_eq!(figures["same_top_token"], 1.0, "{figures}");
}

#[test]
fn text_names_adapter_applies_every_tensor_through_auto_model_for_causal_lm_with_real_peft() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    extract(&adapter, &["--rank", "8", "--names", "text"]);
    let figures = peft_load_check(&python, &adapter, "auto");
    assert_eq!(figures["first_module"], "model.layers.0.mlp.up_proj");
    assert_applied_everywhere(&figures, "Qwen3_5ForCausalLM");
}

#[test]
fn checkpoint_names_adapter_applies_every_tensor_through_the_checkpoints_class_with_real_peft() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    extract(&adapter, &["--rank", "8"]);
    let figures = peft_load_check(&python, &adapter, "checkpoint");
    assert_eq!(
        figures["first_module"],
        "model.language_model.layers.0.mlp.up_proj"
    );
    assert_applied_everywhere(&figures, "Qwen3_5ForConditionalGeneration");
}

/// Problem 1: every key was written as `model.language_model.*`, which
/// `AutoModelForCausalLM` + PEFT silently ignores; `--names text` writes `model.layers.*`
/// in tensor names and in rank_pattern / alpha_pattern keys alike.
#[test]
fn names_flag_renames_tensors_and_rank_pattern_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (checkpoint, text) = (dir.path().join("checkpoint"), dir.path().join("text"));
    extract(&checkpoint, &["--rank", "8"]);
    extract(&text, &["--rank", "8", "--names", "text"]);
    for (adapter, prefix) in [
        (&checkpoint, "model.language_model.layers."),
        (&text, "model.layers."),
    ] {
        let names = tensor_names(adapter);
        assert_eq!(names.len(), 30);
        for name in &names {
            assert!(
                name.starts_with(&format!("base_model.model.{prefix}")),
                "{name} is not under {prefix}"
            );
        }
        let config = json(&adapter.join("adapter_config.json"));
        // in_proj_a / in_proj_b are 4 rows: their rank differs from r and needs a pattern.
        for pattern in ["rank_pattern", "alpha_pattern"] {
            let keys: Vec<&String> = config[pattern].as_object().unwrap().keys().collect();
            assert_eq!(keys.len(), 2, "{pattern}: {keys:?}");
            for key in keys {
                assert!(
                    key.starts_with(&format!("^{prefix}")),
                    "{pattern} key {key}"
                );
            }
        }
        assert_eq!(
            config["rank_pattern"][format!("^{prefix}0.linear_attn.in_proj_a")],
            4
        );
        let manifest = json(&adapter.join("manifest.json"));
        assert_eq!(
            manifest["names"],
            if prefix == "model.layers." {
                "text"
            } else {
                "checkpoint"
            }
        );
    }
}

/// Problem 4: with the default `--rank 256`, a pair whose largest module rank is 64
/// wrote `r: 256`, which vLLM refuses unless served with `--max-lora-rank 256`. (At
/// `--rank 256` every module of this 64-wide model keeps its full width: the merge's
/// bf16 rounding makes each delta full-rank above the 1e-7 cut.)
#[test]
fn adapter_r_is_the_smallest_vllm_rank_covering_the_largest_module() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    extract(&adapter, &[]); // default --rank 256
    let config = json(&adapter.join("adapter_config.json"));
    assert_eq!(config["r"], 64);
    assert_eq!(config["lora_alpha"], 64);
    let opened = LoraAdapter::open(&adapter).unwrap();
    assert_eq!(opened.modules.iter().map(|m| m.rank).max(), Some(64));
    assert!(opened.modules.iter().all(|m| m.scale == 1.0));
    // Narrower modules (in_proj_a / in_proj_b: 4, k_proj / v_proj: 32) through the
    // patterns, alpha = rank.
    let pattern = config["rank_pattern"].as_object().unwrap();
    assert_eq!(pattern.len(), 4, "{pattern:?}");
    assert_eq!(config["rank_pattern"], config["alpha_pattern"]);
    assert_eq!(json(&adapter.join("extraction_report.json"))["r"], 64);
    let card = std::fs::read_to_string(adapter.join("README.md")).unwrap();
    assert!(card.contains("--enable-lora --max-lora-rank 64 --lora-modules adapter="));
}

/// Problem 5: base_model_name_or_path was the path as typed (`s/base`), which resolves
/// only from the directory extract ran in.
#[test]
fn base_model_name_or_path_is_the_absolute_base_or_base_id() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    // A relative --base, from the fixture's parent directory.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_loraq"))
        .current_dir(data().parent().unwrap())
        .args([
            "extract",
            "--merged",
            "peft-multimodal/merged",
            "--base",
            "peft-multimodal/base",
            "--out",
            s(&adapter),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let absolute = std::fs::canonicalize(data().join("base")).unwrap();
    let config = json(&adapter.join("adapter_config.json"));
    assert_eq!(config["base_model_name_or_path"], s(&absolute));

    let with_id = dir.path().join("with-id");
    extract(
        &with_id,
        &[
            "--base-id",
            "Qwen/Qwen3.5-0.8B",
            "--base-revision",
            "abc123",
        ],
    );
    let config = json(&with_id.join("adapter_config.json"));
    assert_eq!(config["base_model_name_or_path"], "Qwen/Qwen3.5-0.8B");
    assert_eq!(config["revision"], "abc123");
    let card = std::fs::read_to_string(with_id.join("README.md")).unwrap();
    assert!(card.starts_with("---\nbase_model: \"Qwen/Qwen3.5-0.8B\"\nlibrary_name: peft\n"));
    assert!(card.contains("from_pretrained(\"Qwen/Qwen3.5-0.8B\", revision=\"abc123\""));
}

#[test]
fn model_card_names_the_loading_class_serving_line_residuals_and_license() {
    let dir = tempfile::tempdir().unwrap();
    // The merge with a LICENSE next to it, copied with --copy.
    let merged = dir.path().join("merged");
    std::fs::create_dir(&merged).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(data().join("merged").join(f), merged.join(f)).unwrap();
    }
    std::fs::write(merged.join("LICENSE"), "Apache License 2.0\n").unwrap();
    let base = data().join("base");
    for (names, class) in [
        ("checkpoint", "Qwen3_5ForConditionalGeneration"),
        ("text", "AutoModelForCausalLM"),
    ] {
        let adapter = dir.path().join(format!("adapter-{names}"));
        ok(loraq(&[
            "extract",
            "--merged",
            s(&merged),
            "--base",
            s(&base),
            "--out",
            s(&adapter),
            "--names",
            names,
            "--copy",
            "LICENSE",
        ]));
        let card = std::fs::read_to_string(adapter.join("README.md")).unwrap();
        let report = json(&adapter.join("extraction_report.json"));
        assert_eq!(report["loading_class"], class);
        assert!(card.contains(&format!("from transformers import {class}\n")));
        assert!(card.contains(&format!("base = {class}.from_pretrained(")));
        assert!(card.contains(&format!(
            "model = PeftModel.from_pretrained(base, \"{}\")",
            s(&adapter)
        )));
        assert!(card.contains("library_name: peft\n"));
        assert!(card.contains("- lora\n"));
        // The residual table: min / median / max of residual over floor, from the report.
        let mut ratios: Vec<f64> = report["modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["ratio"].as_f64().unwrap())
            .collect();
        ratios.sort_by(f64::total_cmp);
        assert!(card.contains(&format!(
            "| truncation (f32 factors) | {:.4} | {:.4} | {:.4} |",
            ratios[0], ratios[7], ratios[14]
        )));
        let worst = report["totals"]["max_ratio_module"].as_str().unwrap();
        assert!(card.contains(&format!("| `{worst}` |")));
        assert!(card.contains("Copied from the source: [`LICENSE`](LICENSE)"));
        assert!(card.contains(&format!(
            "vllm serve {} --enable-lora --max-lora-rank 64 --lora-modules adapter-{names}={}",
            s(&std::fs::canonicalize(&base).unwrap()),
            s(&adapter)
        )));
        // Listed in SHA256SUMS like every other file, and the list holds.
        let sums = std::fs::read_to_string(adapter.join("SHA256SUMS")).unwrap();
        assert!(sums.lines().any(|l| l.ends_with("  README.md")), "{sums}");
        assert!(sums.lines().any(|l| l.ends_with("  LICENSE")), "{sums}");
        loraq_io::verify_sha256sums(&adapter).unwrap();
    }
}

/// `verify`, `check`, `run` and `quant-error` take an adapter in either naming.
#[test]
fn verify_check_run_and_quant_error_accept_either_naming() {
    let dir = tempfile::tempdir().unwrap();
    let (checkpoint, text) = (dir.path().join("checkpoint"), dir.path().join("text"));
    extract(&checkpoint, &[]);
    extract(&text, &["--names", "text"]);
    let (base, merged) = (data().join("base"), data().join("merged"));
    for adapter in [&checkpoint, &text] {
        let o = ok(loraq(&[
            "verify",
            "--adapter",
            s(adapter),
            "--merged",
            s(&merged),
            "--base",
            s(&base),
            "--json",
        ]));
        let report: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["passed"], true, "{report}");
        assert_eq!(report["modules"].as_array().unwrap().len(), 15);
        assert_eq!(report["unexplained"], Value::Array(vec![]));
    }
    // The same factors under the two namings: check finds them identical.
    let o = ok(loraq(&["check", s(&checkpoint), s(&text), "--json"]));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["passed"], true, "{report}");
    assert_eq!(report["modules"].as_array().unwrap().len(), 15);
    assert_eq!(report["worst_relative_difference"], 0.0);

    // quant-error: the adapter's modules are found on the base in either naming.
    let mut totals = Vec::new();
    for adapter in [&checkpoint, &text] {
        let o = ok(loraq(&[
            "quant-error",
            "--base",
            s(&base),
            "--scheme",
            "fp8-block128",
            "--adapter",
            s(adapter),
            "--merged",
            s(&merged),
            "--json",
        ]));
        let report: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["totals"]["adapter"]["modules"], 15, "{report}");
        totals.push(report["totals"]["adapter"].clone());
    }
    assert_eq!(totals[0], totals[1]);

    // run: base + either adapter gives the same answers, bit for bit.
    let records = dir.path().join("records.jsonl");
    std::fs::write(
        &records,
        "{\"id\":\"a\",\"tokens\":[3,17,42,9],\"options\":[\"A\",\"B\"],\"option_tokens\":[5,6]}\n\
         {\"id\":\"b\",\"tokens\":[99,1],\"options\":[\"A\",\"B\"],\"option_tokens\":[7,8]}\n",
    )
    .unwrap();
    let mut answers = Vec::new();
    for adapter in [&checkpoint, &text] {
        let out = dir.path().join(format!(
            "{}.jsonl",
            adapter.file_name().unwrap().to_string_lossy()
        ));
        ok(loraq(&[
            "run",
            "--model",
            s(&base),
            "--adapter",
            s(adapter),
            "--records",
            s(&records),
            "--out",
            s(&out),
        ]));
        answers.push(std::fs::read_to_string(&out).unwrap());
    }
    assert_eq!(answers[0], answers[1]);
}

/// An adapter module that names no module of the checkpoint, in either naming, is
/// refused by name, by quant-error as by the other commands.
#[test]
fn adapter_module_missing_from_the_checkpoint_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    extract(&adapter, &["--rank", "8", "--names", "text"]);
    // Add a module of a layer the two-layer model does not have.
    let stray = dir.path().join("stray");
    std::fs::create_dir(&stray).unwrap();
    let opened = LoraAdapter::open(&adapter).unwrap();
    let mut factors: Vec<LoraFactors> = opened
        .modules
        .iter()
        .map(|m| LoraFactors {
            module_path: m.module_path.clone(),
            rank: m.rank,
            in_features: m.in_features,
            out_features: m.out_features,
            a_bf16: bf16_bytes(&opened.read_a_f32(&m.module_path).unwrap()),
            b_bf16: bf16_bytes(&opened.read_b_f32(&m.module_path).unwrap()),
        })
        .collect();
    let mut extra = factors
        .iter()
        .find(|f| f.module_path == "model.layers.1.mlp.up_proj")
        .unwrap()
        .clone();
    extra.module_path = "model.layers.7.mlp.up_proj".into();
    factors.push(extra);
    let mut ranks: std::collections::BTreeMap<String, usize> = opened
        .modules
        .iter()
        .map(|m| (m.module_path.clone(), m.rank))
        .collect();
    ranks.insert("model.layers.7.mlp.up_proj".into(), 8);
    let config = loraq_io::AdapterConfig::for_ranks(8, &ranks, None, None);
    write_adapter(&stray, &config, &factors).unwrap();

    let (base, merged) = (data().join("base"), data().join("merged"));
    for args in [
        vec![
            "verify",
            "--adapter",
            s(&stray),
            "--merged",
            s(&merged),
            "--base",
            s(&base),
        ],
        vec![
            "quant-error",
            "--base",
            s(&base),
            "--scheme",
            "fp8-block128",
            "--adapter",
            s(&stray),
            "--merged",
            s(&merged),
        ],
    ] {
        let o = loraq(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?} should fail");
        let err = stderr(&o);
        assert!(
            err.contains("model.layers.7.mlp.up_proj") && err.contains("name no module of"),
            "{args:?}: {err}"
        );
    }
}

/// bf16 bytes of values read from bf16 (exact: the low 16 bits of their f32 are zero).
fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}
