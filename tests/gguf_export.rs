//! `loraq export-gguf` against llama.cpp: the same adapters converted by llama.cpp's
//! own convert_lora_to_gguf.py (committed under tests/data/gguf/, made by
//! scripts/gguf_lora_fixture.py) tensor by tensor; a real llama-server
//! (LORAQ_LLAMA_SERVER) applying loraq's GGUF LoRAs as `loraq run` applies the PEFT
//! adapters; loraq's GGUF writer read back by gguf-py; the refusals.

mod collect_support;
mod common;

use collect_support::*;
use common::{loraq, ok, oracle_python, run_oracle, s, stderr};
use loraq_gguf::{GgufFile, MetadataValue};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn data(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(path)
}

/// Every tensor of a GGUF file as (dims, f32 values), by name.
fn tensors(file: &GgufFile) -> BTreeMap<String, (Vec<u64>, Vec<f32>)> {
    file.tensors()
        .iter()
        .map(|t| {
            let values =
                loraq_gguf::reader::decode_f32(file.path(), t, file.tensor_bytes(&t.name).unwrap())
                    .unwrap();
            (t.name.clone(), (t.dims.clone(), values))
        })
        .collect()
}

fn alpha(file: &GgufFile) -> f32 {
    match file.get("adapter.lora.alpha") {
        Some(MetadataValue::F32(a)) => *a,
        other => panic!("adapter.lora.alpha is {other:?}"),
    }
}

fn export(adapter: &Path, base: &Path, out: &Path, dtype: &str) -> serde_json::Value {
    let o = ok(loraq(&[
        "export-gguf",
        "--adapter",
        s(adapter),
        "--base",
        s(base),
        "--out",
        s(out),
        "--dtype",
        dtype,
        "--json",
    ]));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Compares loraq's export with llama.cpp's conversion of the same adapter. The
/// converter writes PEFT's `lora_alpha` and the factors as they are (it ignores
/// rank_pattern, alpha_pattern and rsLoRA); `scale` gives PEFT's real scale of the
/// module behind a GGUF weight name and its rank. When loraq folded the scales (alpha
/// 0), its lora_b must be the converter's times that scale (one f32 rounding);
/// otherwise both files must be equal.
fn compare_with_converter(ours: &GgufFile, theirs: &GgufFile, scale: &dyn Fn(&str, u64) -> f64) {
    for key in ["general.architecture", "general.type", "adapter.type"] {
        assert_eq!(ours.get(key), theirs.get(key), "{key}");
    }
    let (ours_t, theirs_t) = (tensors(ours), tensors(theirs));
    assert_eq!(
        ours_t.keys().collect::<Vec<_>>(),
        theirs_t.keys().collect::<Vec<_>>()
    );
    let folded = alpha(ours) == 0.0;
    if !folded {
        assert_eq!(alpha(ours), alpha(theirs));
    }
    for (name, (dims, values)) in &ours_t {
        let (their_dims, their_values) = &theirs_t[name];
        assert_eq!(dims, their_dims, "{name}");
        let weight = name.strip_suffix(".lora_b");
        match weight {
            Some(weight) if folded => {
                let rank = dims[0];
                let scale = scale(weight, rank) as f32;
                for (i, (a, b)) in values.iter().zip(their_values).enumerate() {
                    let want = b * scale;
                    assert!(
                        (a - want).abs() <= 1e-6 * want.abs(),
                        "{name} element {i}: {a} vs {want} (scale {scale})"
                    );
                }
            }
            _ => assert_eq!(values, their_values, "{name}"),
        }
    }
}

#[test]
fn export_matches_llama_cpp_converter_tensor_by_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // Qwen3.5 (2 key heads, 4 value heads: every linear-attention module's value
    // heads reordered). alpha 8, r 4; alpha_pattern gives layer 1's o_proj alpha 2.
    let out = dir.path().join("qwen3_5.gguf");
    let summary = export(
        &data("model/qwen3_5-lora"),
        &data("model/qwen3_5"),
        &out,
        "f32",
    );
    assert_eq!(summary["scales_folded"], true, "{summary}");
    let reordered = summary["modules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["v_heads_reordered"] == true)
        .count();
    assert_eq!(
        reordered, 10,
        "5 linear-attention modules in each of 2 layers: {summary}"
    );
    let theirs = GgufFile::open(data("gguf/qwen3_5-lora-converter.gguf")).unwrap();
    let qwen35_scale = |weight: &str, rank: u64| {
        assert_eq!(rank, 4);
        if weight == "blk.1.attn_output.weight" {
            2.0 / 4.0
        } else {
            8.0 / 4.0
        }
    };
    compare_with_converter(&GgufFile::open(&out).unwrap(), &theirs, &qwen35_scale);
    // Against the GGUF base instead of the checkpoint: the same bytes.
    let from_gguf = dir.path().join("from-gguf-base.gguf");
    export(
        &data("model/qwen3_5-lora"),
        &data("gguf/qwen3_5-f32.gguf"),
        &from_gguf,
        "f32",
    );
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&from_gguf).unwrap()
    );

    // Without the alpha pattern every module has scale x rank 8: one alpha, the
    // factors as PEFT wrote them, equal to the converter's.
    let uniform = dir.path().join("uniform");
    std::fs::create_dir(&uniform).unwrap();
    std::fs::copy(
        data("model/qwen3_5-lora/adapter_model.safetensors"),
        uniform.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data("model/qwen3_5-lora/adapter_config.json")).unwrap(),
    )
    .unwrap();
    config["alpha_pattern"] = serde_json::json!({});
    std::fs::write(uniform.join("adapter_config.json"), config.to_string()).unwrap();
    let out = dir.path().join("uniform.gguf");
    let summary = export(&uniform, &data("model/qwen3_5"), &out, "f32");
    assert_eq!(summary["scales_folded"], false);
    let ours = GgufFile::open(&out).unwrap();
    assert_eq!(alpha(&ours), 8.0);
    compare_with_converter(&ours, &theirs, &|_, _| unreachable!());

    // Qwen3 with rank_pattern, alpha_pattern and rsLoRA (scale alpha / sqrt(r)):
    // gate_proj rank 2, layer 1's q_proj rank 8, down_proj alpha 3, layer 0's up_proj
    // alpha 16, else r 4 and alpha 8 (scripts/gguf_lora_fixture.py patterns).
    let out = dir.path().join("qwen3.gguf");
    export(&data("gguf/qwen3-lora"), &data("model/qwen3"), &out, "f32");
    let qwen3_scale = |weight: &str, rank: u64| {
        let want_rank = if weight.ends_with("ffn_gate.weight") {
            2
        } else if weight == "blk.1.attn_q.weight" {
            8
        } else {
            4
        };
        assert_eq!(rank, want_rank, "{weight}");
        let alpha = if weight.ends_with("ffn_down.weight") {
            3.0
        } else if weight == "blk.0.ffn_up.weight" {
            16.0
        } else {
            8.0
        };
        alpha / (rank as f64).sqrt()
    };
    compare_with_converter(
        &GgufFile::open(&out).unwrap(),
        &GgufFile::open(data("gguf/qwen3-lora-converter.gguf")).unwrap(),
        &qwen3_scale,
    );
}

#[test]
fn export_refuses_what_llama_cpp_cannot_apply_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let run = |adapter: &Path, base: &Path| {
        loraq(&[
            "export-gguf",
            "--adapter",
            s(adapter),
            "--base",
            s(base),
            "--out",
            s(&out),
        ])
    };
    // A Qwen3.5 adapter on a Qwen3 base: qwen3 has no linear-attention tensors.
    let o = run(&data("model/qwen3_5-lora"), &data("model/qwen3"));
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("module model.layers.0.linear_attn.in_proj_a")
            && e.contains("llama.cpp's qwen3 has no tensor"),
        "{e}"
    );
    assert!(!out.exists());
    // A Qwen3 adapter on a Qwen3.5 base: layer 0 is linear attention there.
    let o = run(&data("gguf/qwen3-lora"), &data("model/qwen3_5"));
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("module model.layers.0.self_attn.k_proj")
            && e.contains("has no tensor blk.0.attn_k.weight"),
        "{e}"
    );
    assert!(!out.exists());
    // DoRA, bias LoRA and modules_to_save, each refused by name.
    for (field, value, message) in [
        ("use_dora", serde_json::json!(true), "use_dora"),
        ("lora_bias", serde_json::json!(true), "lora_bias"),
        ("bias", serde_json::json!("all"), "bias is \"all\""),
        (
            "modules_to_save",
            serde_json::json!(["lm_head"]),
            "modules_to_save",
        ),
    ] {
        let adapter = dir.path().join(field);
        std::fs::create_dir(&adapter).unwrap();
        std::fs::copy(
            data("model/qwen3_5-lora/adapter_model.safetensors"),
            adapter.join("adapter_model.safetensors"),
        )
        .unwrap();
        let mut config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(data("model/qwen3_5-lora/adapter_config.json")).unwrap(),
        )
        .unwrap();
        config[field] = value;
        std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
        let o = run(&adapter, &data("model/qwen3_5"));
        assert!(!o.status.success(), "{field}");
        assert!(stderr(&o).contains(message), "{field}: {}", stderr(&o));
        assert!(!out.exists(), "{field}");
    }
    // A truncated GGUF base, refused naming the file.
    let broken = dir.path().join("broken.gguf");
    let bytes = std::fs::read(data("gguf/qwen3_5-f32.gguf")).unwrap();
    std::fs::write(&broken, &bytes[..bytes.len() / 2]).unwrap();
    let o = run(&data("model/qwen3_5-lora"), &broken);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("broken.gguf") && stderr(&o).contains("past the end of the file"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
    // An existing output is kept unless --force.
    std::fs::write(&out, b"keep").unwrap();
    let o = run(&data("model/qwen3_5-lora"), &data("model/qwen3_5"));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");
}

#[test]
fn gguf_py_reads_what_loraq_writes() {
    let Some(server) = llama_server() else { return };
    let Some(python) = oracle_python() else {
        return;
    };
    use loraq_gguf::{GgmlType, GgufWriter, MetadataArray as A, MetadataValue as V};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("written.gguf");
    let metadata = vec![
        ("general.architecture", V::String("qwen35".into())),
        ("general.alignment", V::U32(64)),
        ("t.u8", V::U8(250)),
        ("t.i8", V::I8(-7)),
        ("t.u16", V::U16(65535)),
        ("t.i16", V::I16(-32768)),
        ("t.u32", V::U32(4_294_967_295)),
        ("t.i32", V::I32(i32::MIN)),
        ("t.f32", V::F32(-0.3)),
        ("t.bool", V::Bool(true)),
        ("t.string", V::String("Grüße\n\"€\"".into())),
        ("t.u64", V::U64(u64::MAX)),
        ("t.i64", V::I64(i64::MIN)),
        ("t.f64", V::F64(std::f64::consts::PI)),
        ("t.a.u8", V::Array(A::U8(vec![1, 2]))),
        ("t.a.i8", V::Array(A::I8(vec![-1, 1]))),
        ("t.a.u16", V::Array(A::U16(vec![3]))),
        ("t.a.i16", V::Array(A::I16(vec![-3, 3]))),
        ("t.a.u32", V::Array(A::U32(vec![5, 6, 7]))),
        ("t.a.i32", V::Array(A::I32(vec![-5]))),
        ("t.a.f32", V::Array(A::F32(vec![0.5, -2.25]))),
        ("t.a.bool", V::Array(A::Bool(vec![false, true]))),
        (
            "t.a.string",
            V::Array(A::String(vec!["x".into(), "".into(), "ÿ".into()])),
        ),
        ("t.a.u64", V::Array(A::U64(vec![u64::MAX]))),
        ("t.a.i64", V::Array(A::I64(vec![i64::MIN, 0]))),
        ("t.a.f64", V::Array(A::F64(vec![1e-300]))),
    ];
    let mut writer = GgufWriter::new();
    for (k, v) in &metadata {
        writer.add_metadata(*k, v.clone()).unwrap();
    }
    let f32s: Vec<f32> = (0..15).map(|i| i as f32 * 0.25 - 1.0).collect();
    writer
        .add_tensor(
            "a.f32",
            GgmlType::F32,
            &[3, 5],
            f32s.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
        .unwrap();
    let f16s: Vec<u8> = f32s[..6]
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    writer
        .add_tensor("b.f16", GgmlType::F16, &[6], f16s)
        .unwrap();
    let bf16s: Vec<u8> = f32s[..8]
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    writer
        .add_tensor("c.bf16", GgmlType::BF16, &[2, 2, 2], bf16s)
        .unwrap();
    writer
        .add_tensor("d.q8_0", GgmlType::Q8_0, &[1, 32], vec![7; 34])
        .unwrap();
    writer.write_atomically(&path).unwrap();

    let gguf_py = llama_cpp_python_side(&server).join("gguf-py");
    let dump = run_oracle(
        &python,
        "scripts/gguf_oracle.py",
        &["--gguf-py", s(&gguf_py), "dump", s(&path)],
    );
    let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
    let file = &dump[0];
    assert_eq!(file["alignment"], 64);
    let got = file["metadata"].as_array().unwrap();
    assert_eq!(got.len(), metadata.len());
    for ((key, value), g) in metadata.iter().zip(got) {
        assert_eq!(g["key"], *key);
        assert_eq!(g["type"], value.value_type().name(), "{key}");
        let want = match value {
            V::F32(x) => serde_json::json!(f64::from(*x)),
            V::Array(A::F32(v)) => {
                serde_json::json!(v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>())
            }
            V::U8(x) => serde_json::json!(x),
            V::I8(x) => serde_json::json!(x),
            V::U16(x) => serde_json::json!(x),
            V::I16(x) => serde_json::json!(x),
            V::U32(x) => serde_json::json!(x),
            V::I32(x) => serde_json::json!(x),
            V::Bool(x) => serde_json::json!(x),
            V::String(x) => serde_json::json!(x),
            V::U64(x) => serde_json::json!(x),
            V::I64(x) => serde_json::json!(x),
            V::F64(x) => serde_json::json!(x),
            V::Array(A::U8(v)) => serde_json::json!(v),
            V::Array(A::I8(v)) => serde_json::json!(v),
            V::Array(A::U16(v)) => serde_json::json!(v),
            V::Array(A::I16(v)) => serde_json::json!(v),
            V::Array(A::U32(v)) => serde_json::json!(v),
            V::Array(A::I32(v)) => serde_json::json!(v),
            V::Array(A::Bool(v)) => serde_json::json!(v),
            V::Array(A::String(v)) => serde_json::json!(v),
            V::Array(A::U64(v)) => serde_json::json!(v),
            V::Array(A::I64(v)) => serde_json::json!(v),
            V::Array(A::F64(v)) => serde_json::json!(v),
        };
        let close = |a: &serde_json::Value, b: &serde_json::Value| match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) if a.is_f64() || b.is_f64() => {
                (x - y).abs() <= 4.0 * f64::EPSILON * x.abs().max(y.abs())
            }
            _ => a == b,
        };
        let equal = match (&want, &g["value"]) {
            (serde_json::Value::Array(x), serde_json::Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(a, b)| close(a, b))
            }
            (a, b) => close(a, b),
        };
        assert!(equal, "{key}: wrote {want}, gguf-py read {}", g["value"]);
    }
    let t = file["tensors"].as_array().unwrap();
    let names: Vec<&str> = t.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["a.f32", "b.f16", "c.bf16", "d.q8_0"]);
    assert_eq!(t[0]["dims"], serde_json::json!([5, 3]));
    assert_eq!(t[2]["dims"], serde_json::json!([2, 2, 2]));
    assert_eq!(t[3]["type"], "Q8_0");
    let values = |i: usize| -> Vec<f32> {
        t[i]["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    assert_eq!(values(0), f32s);
    assert_eq!(values(1), f32s[..6]);
    assert_eq!(values(2), f32s[..8]);
    // Offsets as ggml requires them: each tensor at the previous end padded to 64.
    let offsets: Vec<u64> = t.iter().map(|t| t["offset"].as_u64().unwrap()).collect();
    assert_eq!(offsets, [0, 64, 128, 192]);
}

/// Largest |difference| of per-option log-softmax allowed between llama.cpp and
/// `loraq run` with the same adapter on the same f32 weights: the collect tests'
/// tolerance (tests/collect_llama.rs, docs/collect.md "Agreement with loraq run"),
/// which covers ggml's other summation order and its f16 rounding of some CPU
/// intermediate results; the adapter adds only products of the same kind.
const LOG_SOFTMAX_TOLERANCE: f64 = 2.5e-2;

#[test]
fn llama_server_applies_exported_adapters_as_loraq_run_applies_peft() {
    let Some(binary) = llama_server() else { return };
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fixture(&python, &binary, d);
    let (hf, plain) = (d.join("hf"), d.join("adapter"));
    let patterns = d.join("adapter-patterns");
    run_oracle(
        &python,
        "scripts/gguf_lora_fixture.py",
        &["patterns", "--model", s(&hf), "--out", s(&patterns)],
    );
    let llama_cpp = llama_cpp_python_side(&binary);
    let converted = d.join("converter-patterns.gguf");
    run_oracle(
        &python,
        "scripts/gguf_lora_fixture.py",
        &[
            "convert",
            "--llama-cpp",
            s(&llama_cpp),
            "--adapter",
            s(&patterns),
            "--base",
            s(&hf),
            "--out",
            s(&converted),
        ],
    );
    let base = d.join("base-f32.gguf");

    // The plain adapter (r 4, alpha 8 everywhere) exported in f32 is the converter's
    // adapter-f32.gguf exactly: names, shapes, V-head order, alpha, values.
    let exact = d.join("loraq-plain-f32.gguf");
    export(&plain, &base, &exact, "f32");
    compare_with_converter(
        &GgufFile::open(&exact).unwrap(),
        &GgufFile::open(d.join("adapter-f32.gguf")).unwrap(),
        &|_, _| unreachable!(),
    );

    // The served adapters: loraq's, in bf16 (the default), and the converter's
    // conversion of the patterns adapter, which ignores the patterns and rsLoRA.
    let (plain_gguf, patterns_gguf) = (d.join("loraq-plain.gguf"), d.join("loraq-patterns.gguf"));
    export(&plain, &base, &plain_gguf, "bf16");
    let summary = export(&patterns, &base, &patterns_gguf, "bf16");
    assert_eq!(summary["scales_folded"], true);
    let records = d.join("records.jsonl");
    write_records(&records, 100);
    let server = Server::start_with(
        &binary,
        d,
        free_port(),
        "server-export.log",
        &[
            "--lora",
            s(&plain_gguf),
            "--lora",
            s(&patterns_gguf),
            "--lora",
            s(&converted),
        ],
    );
    let run = |adapter: Option<&Path>, out: &str| {
        let extra: Vec<&str> = adapter.map_or(vec![], |a| vec!["--adapter", s(a)]);
        run_answers(&hf, &records, &d.join(out), &extra)
    };
    let collect = |id: &str, out: &str| collect_answers(&server, &records, &d.join(out), Some(id));
    let run_base = run(None, "run-base.jsonl");
    let run_plain = run(Some(&plain), "run-plain.jsonl");
    let run_patterns = run(Some(&patterns), "run-patterns.jsonl");
    // Ids: 0 the fixture's adapter-f32.gguf, then the --lora files in order.
    let llama_plain = collect("1", "llama-plain.jsonl");
    let llama_patterns = collect("2", "llama-patterns.jsonl");
    let llama_converted = collect("3", "llama-converted.jsonl");
    let (plain_diff, plain_same) = agreement(&run_plain, &llama_plain);
    let (patterns_diff, patterns_same) = agreement(&run_patterns, &llama_patterns);
    let (converted_diff, _) = agreement(&run_patterns, &llama_converted);
    let (effect, _) = agreement(&run_base, &run_patterns);
    eprintln!(
        "llama-server with loraq's GGUF vs loraq run with PEFT: plain {plain_diff:.3e} (same top {plain_same}), patterns + rsLoRA {patterns_diff:.3e} (same top {patterns_same}); the converter's GGUF of the patterns adapter {converted_diff:.3e}; the adapter's own effect {effect:.3e}"
    );
    assert!(
        plain_diff <= LOG_SOFTMAX_TOLERANCE && plain_same >= 0.99,
        "plain: {plain_diff} {plain_same}"
    );
    assert!(
        patterns_diff <= LOG_SOFTMAX_TOLERANCE && patterns_same >= 0.99,
        "patterns: {patterns_diff} {patterns_same}"
    );
    // The checks have teeth: the adapter moves the answers far beyond the tolerance,
    // and the converter's scaling of the same adapter misses them.
    assert!(
        effect > 10.0 * LOG_SOFTMAX_TOLERANCE,
        "adapter effect {effect}"
    );
    assert!(
        converted_diff > 4.0 * LOG_SOFTMAX_TOLERANCE,
        "converter {converted_diff}"
    );
}
