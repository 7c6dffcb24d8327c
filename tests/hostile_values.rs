//! Hostile values (issue 16, classes 1, 3, 4 and 9): non-finite and degenerate inputs,
//! sizes past the stated limits, thread counts, and the smaller defects. Each command
//! must exit with status 2 and a message naming the file and tensor (or flag, or
//! record), write nothing, and never echo a huge value.

mod common;

use common::{assert_refused, data, loraq, run_args, s, stderr};
use loraq_io::{Checkpoint, TensorSpec, write_safetensors_file};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A writable copy of a fixture directory.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Rewrites one safetensors file with `edit` applied to the bytes of the first tensor
/// whose name ends with `suffix`; returns that tensor's name.
fn edit_tensor(file: &Path, suffix: &str, edit: impl FnOnce(&mut [u8])) -> String {
    let ckpt = Checkpoint::open(file).unwrap();
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = ckpt
        .tensors()
        .map(|t| {
            (
                TensorSpec::new(t.name.clone(), t.dtype, t.shape.clone()),
                ckpt.bytes(&t.name).unwrap().to_vec(),
            )
        })
        .collect();
    let metadata = ckpt.shard_metadata(0).clone();
    drop(ckpt);
    let (spec, bytes) = tensors
        .iter_mut()
        .find(|(spec, _)| spec.name.ends_with(suffix))
        .unwrap_or_else(|| panic!("no tensor ending in {suffix}"));
    edit(bytes);
    let name = spec.name.clone();
    let borrowed: Vec<(TensorSpec, &[u8])> = tensors
        .iter()
        .map(|(spec, bytes)| (spec.clone(), bytes.as_slice()))
        .collect();
    let temp = file.with_extension("rewrite");
    write_safetensors_file(&temp, &borrowed, &metadata).unwrap();
    std::fs::rename(&temp, file).unwrap();
    name
}

/// Rewrites the JSON file at `path` with `edit` applied.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// bf16 NaN in the first element.
fn first_bf16_nan(bytes: &mut [u8]) {
    bytes[..2].copy_from_slice(&0x7FC0u16.to_le_bytes());
}

/// A tiny synthetic base / merged / true-adapter triple in `dir`.
fn synth_tiny(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let dir = dir.join("pair");
    let o = loraq(&["synth", "--preset", "tiny", "--out", s(&dir), "--seed", "3"]);
    assert!(o.status.success(), "synth: {}", stderr(&o));
    (
        dir.join("base"),
        dir.join("merged"),
        dir.join("true-adapter"),
    )
}

fn verify(adapter: &Path, base: &Path, merged: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "verify",
        "--adapter",
        s(adapter),
        "--base",
        s(base),
        "--merged",
        s(merged),
    ];
    args.extend_from_slice(extra);
    loraq(&args)
}

// Class 1: no wrong success on non-finite or degenerate input.

#[test]
fn verify_refuses_an_adapter_holding_one_nan() {
    let dir = tempfile::tempdir().unwrap();
    let (base, merged, adapter) = synth_tiny(dir.path());
    assert!(verify(&adapter, &base, &merged, &[]).status.success());
    let weights = adapter.join("adapter_model.safetensors");
    let tensor = edit_tensor(&weights, "lora_B.weight", first_bf16_nan);
    let o = verify(&adapter, &base, &merged, &[]);
    assert_refused(&o, &["adapter_model.safetensors", &tensor, "NaN"]);
}

#[test]
fn verify_refuses_a_rank_zero_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let (base, merged, adapter) = synth_tiny(dir.path());
    let weights = adapter.join("adapter_model.safetensors");
    let ckpt = Checkpoint::open(&weights).unwrap();
    let specs: Vec<TensorSpec> = ckpt
        .tensors()
        .map(|t| {
            let shape = if t.name.ends_with("lora_A.weight") {
                vec![0, t.shape[1]]
            } else {
                vec![t.shape[0], 0]
            };
            TensorSpec::new(t.name.clone(), t.dtype, shape)
        })
        .collect();
    drop(ckpt);
    let empty: Vec<(TensorSpec, &[u8])> = specs.into_iter().map(|s| (s, &[][..])).collect();
    write_safetensors_file(&weights, &empty, &BTreeMap::new()).unwrap();
    edit_json(&adapter.join("adapter_config.json"), |config| {
        config["r"] = 0.into();
        config["rank_pattern"] = serde_json::json!({});
        config["alpha_pattern"] = serde_json::json!({});
    });
    let o = verify(&adapter, &base, &merged, &[]);
    assert_refused(&o, &["adapter_model.safetensors", "rank 0"]);
}

#[test]
fn verify_refuses_a_threshold_that_is_not_a_finite_positive_number() {
    let dir = tempfile::tempdir().unwrap();
    let (base, merged, adapter) = synth_tiny(dir.path());
    for bad in ["NaN", "inf", "0", "-1"] {
        let flag = format!("--max-residual-ratio={bad}");
        let o = verify(&adapter, &base, &merged, &[&flag]);
        assert_refused(&o, &["--max-residual-ratio"]);
    }
}

/// A copy of the test model in a temporary directory with the first bf16 of the
/// tensor ending in `suffix` made NaN: (guard, model directory, the tensor's name).
fn model_with_a_nan(suffix: &str) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&data().join("qwen3_5"), &model);
    let tensor = edit_tensor(&model.join("model.safetensors"), suffix, first_bf16_nan);
    (dir, model, tensor)
}

/// `loraq run` of `model` on the test records with `extra` arguments is refused on
/// both backends, naming every needle, and writes no answers under `dir`.
fn assert_run_refused(dir: &Path, model: &Path, extra: &[&str], needles: &[&str]) {
    let out = dir.join("answers.jsonl");
    let records = data().join("records.jsonl");
    for backend in ["kernels", "dense"] {
        let mut args = run_args(model, &records, &out);
        args.extend_from_slice(extra);
        args.extend(["--backend", backend]);
        let o = loraq(&args);
        assert_refused(&o, needles);
        assert!(!out.exists(), "no answers on a refused run ({backend})");
    }
}

#[test]
fn run_refuses_nan_adapter_factors_and_writes_no_answers() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("adapter");
    copy_dir(&data().join("qwen3_5-lora"), &adapter);
    let tensor = edit_tensor(
        &adapter.join("adapter_model.safetensors"),
        "mlp.up_proj.lora_A.weight",
        |b| b[..4].copy_from_slice(&f32::INFINITY.to_le_bytes()),
    );
    assert_run_refused(
        dir.path(),
        &data().join("qwen3_5"),
        &["--adapter", s(&adapter)],
        &["adapter_model.safetensors", &tensor],
    );
}

#[test]
fn run_refuses_a_nan_base_weight_by_file_and_tensor() {
    let (dir, model, tensor) = model_with_a_nan("layers.1.mlp.down_proj.weight");
    assert_run_refused(
        dir.path(),
        &model,
        &[],
        &["model.safetensors", &tensor, "NaN"],
    );
}

#[test]
fn quant_error_refuses_a_nan_weight_by_file_and_tensor() {
    let (_dir, model, tensor) = model_with_a_nan("layers.0.mlp.gate_proj.weight");
    let o = loraq(&[
        "quant-error",
        "--base",
        s(&model),
        "--scheme",
        "fp8-block128",
    ]);
    assert_refused(&o, &["model.safetensors", &tensor]);
}

#[test]
fn quantize_names_the_file_and_tensor_of_a_nan_weight() {
    let (dir, model, tensor) = model_with_a_nan("layers.2.mlp.up_proj.weight");
    let out = dir.path().join("fp8");
    let o = loraq(&[
        "quantize",
        "--in",
        s(&model),
        "--out",
        s(&out),
        "--scheme",
        "fp8-block128",
    ]);
    assert_refused(&o, &["model.safetensors", &tensor, "NaN"]);
    assert!(!out.exists());
}

#[test]
fn extract_names_the_file_of_a_nan_input() {
    let dir = tempfile::tempdir().unwrap();
    let (base, merged, _) = synth_tiny(dir.path());
    let shard = std::fs::read_dir(&merged)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let tensor = edit_tensor(&shard, "mlp.up_proj.weight", first_bf16_nan);
    let out = dir.path().join("adapter");
    let o = loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&out),
    ]);
    let file = shard.file_name().unwrap().to_str().unwrap();
    assert_refused(&o, &[file, &tensor, "not finite"]);
    assert!(!out.exists());
}

// Class 3: limits before allocation.

#[test]
fn inspect_run_and_extract_refuse_2_pow_40_layers() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&data().join("qwen3_5"), &model);
    edit_json(&model.join("config.json"), |config| {
        config["num_hidden_layers"] = (1u64 << 40).into();
        config.as_object_mut().unwrap().remove("layer_types");
    });
    let out = dir.path().join("answers.jsonl");
    let records = data().join("records.jsonl");
    for o in [
        loraq(&["inspect", s(&model)]),
        loraq(&run_args(&model, &records, &out)),
        loraq(&[
            "extract",
            "--merged",
            s(&model),
            "--base",
            s(&data().join("qwen3_5")),
            "--out",
            s(&dir.path().join("adapter")),
        ]),
    ] {
        assert_refused(&o, &["config.json", "num_hidden_layers", "limit"]);
    }
}

/// Two small answers files for compare.
fn answers_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let line = |id: &str, logits: [f64; 2]| {
        serde_json::json!({"id": id, "options": ["A", "B"], "logits": logits, "gold": "A"})
            .to_string()
    };
    let reference = dir.join("reference.jsonl");
    let candidate = dir.join("candidate.jsonl");
    std::fs::write(
        &reference,
        [line("q0", [1.0, 0.0]), line("q1", [0.0, 1.0])].join("\n"),
    )
    .unwrap();
    std::fs::write(
        &candidate,
        [line("q0", [0.5, 0.0]), line("q1", [1.0, 0.0])].join("\n"),
    )
    .unwrap();
    (reference, candidate)
}

#[test]
fn compare_refuses_a_bootstrap_count_above_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (reference, candidate) = answers_pair(dir.path());
    let o = loraq(&[
        "compare",
        "--reference",
        s(&reference),
        "--candidate",
        s(&candidate),
        "--bootstrap",
        "1000000000000",
    ]);
    assert_refused(&o, &["--bootstrap", "limit"]);
}

/// Runs loraq with `args`, killed after `limit` (a read that never ends fails the
/// test instead of hanging it).
fn loraq_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            panic!("loraq {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn endless_json_lines_are_refused_at_the_line_cap() {
    let dir = tempfile::tempdir().unwrap();
    let (reference, _) = answers_pair(dir.path());
    let out = dir.path().join("answers.jsonl");
    // /dev/zero has no newline: a reader without a cap reads until memory runs out.
    let endless = Path::new("/dev/zero");
    if endless.exists() {
        let o = loraq_within(
            &run_args(&data().join("qwen3_5"), endless, &out),
            Duration::from_secs(60),
        );
        assert_refused(&o, &["/dev/zero", "line longer than"]);
        let o = loraq_within(
            &[
                "compare",
                "--reference",
                s(&reference),
                "--candidate",
                "/dev/zero",
            ],
            Duration::from_secs(60),
        );
        assert_refused(&o, &["/dev/zero", "line longer than"]);
    }
    // A 17 MiB line in a regular file, the same for both readers.
    let long = dir.path().join("long.jsonl");
    let mut file = std::fs::File::create(&long).unwrap();
    file.write_all(b"{\"id\": \"").unwrap();
    file.write_all(&vec![b'x'; 17 << 20]).unwrap();
    file.write_all(b"\"}\n").unwrap();
    drop(file);
    let o = loraq(&run_args(&data().join("qwen3_5"), &long, &out));
    assert_refused(&o, &["long.jsonl:1", "line longer than"]);
    let o = loraq(&[
        "compare",
        "--reference",
        s(&reference),
        "--candidate",
        s(&long),
    ]);
    assert_refused(&o, &["long.jsonl:1", "line longer than"]);
    assert!(!out.exists());
}

#[test]
fn run_refuses_a_prompt_longer_than_the_token_limit() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&data().join("qwen3_5"), &model);
    // Without max_position_embeddings, only loraq's own limit stands.
    edit_json(&model.join("config.json"), |config| {
        config
            .as_object_mut()
            .unwrap()
            .remove("max_position_embeddings");
    });
    let records = dir.path().join("records.jsonl");
    let tokens = vec![1u32; loraq_io::limits::MAX_PROMPT_TOKENS + 1];
    std::fs::write(
        &records,
        serde_json::json!({"id": "long", "tokens": tokens, "options": ["A", "B"], "option_tokens": [1, 2]})
            .to_string(),
    )
    .unwrap();
    let out = dir.path().join("answers.jsonl");
    let o = loraq(&run_args(&model, &records, &out));
    assert_refused(
        &o,
        &["records.jsonl:1", "\"long\"", "limit of 262144 tokens"],
    );
    assert!(!out.exists());
}

// Class 4: --threads.

#[test]
fn thread_counts_above_the_limit_are_refused_by_run_and_extract() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("answers.jsonl");
    let records = data().join("records.jsonl");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let just_above = (4 * cores + 1).min(1025).to_string();
    let model = data().join("qwen3_5");
    for threads in ["100000", just_above.as_str()] {
        let mut args = run_args(&model, &records, &out);
        args.extend(["--threads", threads]);
        assert_refused(
            &loraq_within(&args, Duration::from_secs(60)),
            &["--threads", "limit"],
        );
        let o = loraq_within(
            &[
                "extract",
                "--merged",
                s(&data().join("qwen3_5")),
                "--base",
                s(&data().join("qwen3_5")),
                "--out",
                s(&dir.path().join("adapter")),
                "--threads",
                threads,
            ],
            Duration::from_secs(60),
        );
        assert_refused(&o, &["--threads", "limit"]);
    }
    assert!(!out.exists());
}

// Class 9: the smaller defects.

#[test]
fn run_refuses_records_that_compare_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("answers.jsonl");
    let record = |id: &str, options: &[&str]| {
        let tokens: Vec<u32> = (0..options.len() as u32).collect();
        serde_json::json!({"id": id, "tokens": [5, 6], "options": options, "option_tokens": tokens})
            .to_string()
    };
    let cases = [
        (
            vec![record("q0", &["A", "B"]), record("q0", &["A", "B"])],
            "duplicate id",
        ),
        (vec![record("q0", &["A"])], "at least 2"),
        (vec![record("q0", &["A", "A"])], "appears twice"),
    ];
    for (lines, needle) in cases {
        let records = dir.path().join("records.jsonl");
        std::fs::write(&records, lines.join("\n")).unwrap();
        let o = loraq(&run_args(&data().join("qwen3_5"), &records, &out));
        assert_refused(&o, &["records.jsonl:", needle]);
        assert!(!out.exists());
    }
}

#[test]
fn error_messages_elide_huge_ids_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let (reference, _) = answers_pair(dir.path());
    let huge = "i".repeat(5 << 20);
    let candidate = dir.path().join("candidate.jsonl");
    let line = serde_json::json!({"id": huge, "options": ["A", "B"], "logits": [0.0, 1.0]});
    std::fs::write(&candidate, format!("{line}\n{line}\n")).unwrap();
    let o = loraq(&[
        "compare",
        "--reference",
        s(&reference),
        "--candidate",
        s(&candidate),
    ]);
    assert_refused(&o, &["candidate.jsonl:1", "bytes in all"]);
    assert!(stderr(&o).len() < 2000, "{} bytes", stderr(&o).len());

    let option = "o".repeat(2 << 20);
    let records = dir.path().join("records.jsonl");
    let line = serde_json::json!({"id": "q", "tokens": [1], "options": [option, option], "option_tokens": [1, 2]});
    std::fs::write(&records, line.to_string()).unwrap();
    let o = loraq(&run_args(
        &data().join("qwen3_5"),
        &records,
        &dir.path().join("a.jsonl"),
    ));
    assert_refused(&o, &["appears twice", "bytes in all"]);
    assert!(stderr(&o).len() < 2000, "{} bytes", stderr(&o).len());
}

#[test]
fn fan_in_fan_out_and_untargeted_modules_are_refused() {
    let model = data().join("qwen3_5");
    let records = data().join("records.jsonl");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("answers.jsonl");
    let edits: [(&str, serde_json::Value, &str); 2] = [
        ("fan_in_fan_out", serde_json::json!(true), "fan_in_fan_out"),
        (
            "target_modules",
            serde_json::json!(["lm_head"]),
            "not matched by target_modules",
        ),
    ];
    for (field, value, needle) in edits {
        let adapter = dir.path().join(field);
        copy_dir(&data().join("qwen3_5-lora"), &adapter);
        edit_json(&adapter.join("adapter_config.json"), |config| {
            config[field] = value
        });
        let mut args = run_args(&model, &records, &out);
        args.extend(["--adapter", s(&adapter)]);
        let o = loraq(&args);
        assert_refused(&o, &["adapter_config.json", needle]);
        assert!(!out.exists());
    }
    // The unchanged fixture (PEFT's own config: a list of module names) runs.
    let mut args = run_args(&model, &records, &out);
    let adapter = data().join("qwen3_5-lora");
    args.extend(["--adapter", s(&adapter)]);
    let o = loraq(&args);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A base of zeros and a rank-1 merge: the delta is the whole weight, as when a
/// merge holds bf16-max values. Its entries sit at the top of their binade (1.88 to
/// 2), where the bf16 floor is smallest relative to the values, so that the cast of
/// rank-1 factors (about 0.16% of ||D||) exceeds the floor: at rank 1 the cast-aware
/// rounding has no other component to carry the rounding error into (at rank 4 it
/// brings this delta to 0.16x the floor).
fn huge_delta_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let (rows, cols) = (64usize, 48usize);
    let name = "model.layers.0.mlp.up_proj.weight";
    let write = |path: &Path, values: &[f32]| {
        std::fs::create_dir_all(path).unwrap();
        let bytes = loraq_io::convert::f32_to_bf16_bytes(values);
        write_safetensors_file(
            &path.join("model.safetensors"),
            &[(
                TensorSpec::new(name, loraq_io::DType::BF16, vec![rows, cols]),
                &bytes[..],
            )],
            &BTreeMap::new(),
        )
        .unwrap();
    };
    let u: Vec<f32> = (0..rows).map(|i| 0.999 - (i % 7) as f32 * 0.0045).collect();
    let v: Vec<f32> = (0..cols).map(|j| 0.999 - (j % 5) as f32 * 0.006).collect();
    let merged: Vec<f32> = (0..rows * cols)
        .map(|k| 2.0 * u[k / cols] * v[k % cols])
        .collect();
    let (base_dir, merged_dir) = (dir.join("base"), dir.join("merged"));
    write(&base_dir, &vec![0.0; rows * cols]);
    write(&merged_dir, &merged);
    (base_dir, merged_dir)
}

#[test]
fn extract_does_not_succeed_on_an_adapter_that_verify_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let (base, merged) = huge_delta_pair(dir.path());
    let out = dir.path().join("adapter");
    let extract = |extra: &[&str]| {
        let mut args = vec![
            "extract",
            "--merged",
            s(&merged),
            "--base",
            s(&base),
            "--out",
            s(&out),
            "--rank",
            "1",
        ];
        args.extend_from_slice(extra);
        loraq(&args)
    };
    let o = extract(&[]);
    assert_refused(&o, &["model.layers.0.mlp.up_proj", "loraq verify"]);
    assert!(!out.exists());
    // Written anyway on request: verify then rejects it, as extract said it would.
    let o = extract(&["--allow-residual"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = verify(&out, &base, &merged, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}
