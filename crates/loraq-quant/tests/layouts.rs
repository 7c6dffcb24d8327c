//! Quantized checkpoint layouts: hand-checked bytes of every read layout, round
//! trips of every written layout through `QuantizedBase`, and bad scale tensors.

use loraq_io::{Checkpoint, DType, TensorSpec, write_safetensors_file};
use loraq_quant::layout::{
    DEFAULT_SKIP, Layout, QuantizeOptions, compile_skip, plan_quantization, write_quantized,
};
use loraq_quant::{QuantError, QuantizedBase, Scheme, StoredWeight, WeightView};
use std::collections::BTreeMap;
use std::path::Path;

const CONFIG: &str = r#"{"model_type": "qwen3", "hidden_size": 272, "intermediate_size": 40,
  "num_hidden_layers": 1, "vocab_size": 50}"#;

fn write_checkpoint(
    dir: &Path,
    config: Option<&str>,
    tensors: &[(&str, DType, Vec<usize>, Vec<u8>)],
) {
    std::fs::create_dir_all(dir).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.join("config.json"), config).unwrap();
    }
    let owned: Vec<(TensorSpec, &[u8])> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                TensorSpec::new(*name, *dtype, shape.clone()),
                bytes.as_slice(),
            )
        })
        .collect();
    write_safetensors_file(&dir.join("model.safetensors"), &owned, &BTreeMap::new()).unwrap();
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Codes 1, 2, ..., 15, 0 packed with the even element in the low nibble.
const PACKED: [u8; 8] = [0x21, 0x43, 0x65, 0x87, 0xA9, 0xCB, 0xED, 0x0F];
/// Their E2M1 values times block scale 2.0 times global 0.25 (= times 0.5); code 8
/// (-0) is +0 in ModelOpt's value table and -0 in compressed-tensors'.
const MODELOPT_EXPECTED: [f32; 16] = [
    0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, 0.0,
];
const CT_EXPECTED: [f32; 16] = [
    0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, -0.0, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, 0.0,
];

fn assert_bits(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(a.to_bits(), e.to_bits(), "{what}[{i}]: {a} vs {e}");
    }
}

#[test]
fn modelopt_nvfp4_hand_checked_bytes() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        dir.path(),
        None,
        &[
            ("m.weight", DType::U8, vec![1, 8], PACKED.to_vec()),
            ("m.weight_scale", DType::F8E4M3, vec![1, 1], vec![0x40]), // 2.0
            ("m.weight_scale_2", DType::F32, vec![], f32_bytes(&[0.25])),
        ],
    );
    let base = QuantizedBase::open(dir.path()).unwrap();
    let weight = base.weight("m.weight").unwrap();
    assert_eq!((weight.out_features, weight.in_features), (1, 16));
    assert!(matches!(weight.stored, StoredWeight::Nvfp4ModelOpt { .. }));
    assert_bits(
        &base.read_weight_f32("m.weight").unwrap(),
        &MODELOPT_EXPECTED,
        "modelopt",
    );
}

#[test]
fn compressed_tensors_nvfp4_divides_by_the_global_scale() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        dir.path(),
        None,
        &[
            ("m.weight_packed", DType::U8, vec![1, 8], PACKED.to_vec()),
            ("m.weight_scale", DType::F8E4M3, vec![1, 1], vec![0x40]),
            (
                "m.weight_global_scale",
                DType::F32,
                vec![1],
                f32_bytes(&[4.0]),
            ),
            (
                "m.input_global_scale",
                DType::F32,
                vec![1],
                f32_bytes(&[1.0]),
            ),
        ],
    );
    let base = QuantizedBase::open(dir.path()).unwrap();
    assert_eq!(base.weights().count(), 1, "scales are not weights");
    assert_bits(
        &base.read_weight_f32("m.weight").unwrap(),
        &CT_EXPECTED,
        "ct",
    );
}

#[test]
fn fp8_block128_with_bf16_scale_inv_hand_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mut codes = vec![0x38u8; 2 * 130]; // 1.0
    codes[129] = 0xB0; // -0.5
    write_checkpoint(
        dir.path(),
        None,
        &[
            ("m.weight", DType::F8E4M3, vec![2, 130], codes),
            // bf16 2.0 and 0.5: the two column tiles.
            (
                "m.weight_scale_inv",
                DType::BF16,
                vec![1, 2],
                vec![0x00, 0x40, 0x00, 0x3F],
            ),
        ],
    );
    let base = QuantizedBase::open(dir.path()).unwrap();
    let values = base.read_weight_f32("m.weight").unwrap();
    let mut expected = vec![2.0f32; 260];
    for row in 0..2 {
        expected[row * 130 + 128] = 0.5;
        expected[row * 130 + 129] = 0.5;
    }
    expected[129] = -0.25;
    assert_bits(&values, &expected, "fp8-block128");
}

#[test]
fn fp8_per_channel_and_per_tensor_scales() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        dir.path(),
        None,
        &[
            (
                "a.weight",
                DType::F8E4M3,
                vec![2, 2],
                vec![0x38, 0x40, 0x38, 0xC0],
            ),
            (
                "a.weight_scale",
                DType::F32,
                vec![2, 1],
                f32_bytes(&[3.0, 0.5]),
            ),
            ("b.weight", DType::F8E4M3, vec![1, 2], vec![0x38, 0x30]),
            ("b.weight_scale", DType::F32, vec![], f32_bytes(&[3.0])),
        ],
    );
    let base = QuantizedBase::open(dir.path()).unwrap();
    assert_bits(
        &base.read_weight_f32("a.weight").unwrap(),
        &[3.0, 6.0, 0.5, -1.0],
        "channel",
    );
    assert_bits(
        &base.read_weight_f32("b.weight").unwrap(),
        &[3.0, 1.5],
        "tensor",
    );
}

fn open_err(tensors: &[(&str, DType, Vec<usize>, Vec<u8>)]) -> QuantError {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), None, tensors);
    match QuantizedBase::open(dir.path()) {
        Ok(_) => panic!("expected an error"),
        Err(err) => err,
    }
}

#[test]
fn scale_shape_mismatch_is_refused_naming_the_tensor() {
    let err = open_err(&[
        ("m.weight", DType::F8E4M3, vec![2, 130], vec![0x38; 260]),
        (
            "m.weight_scale_inv",
            DType::F32,
            vec![1, 1],
            f32_bytes(&[1.0]),
        ),
    ]);
    assert!(
        matches!(&err, QuantError::TensorShape { tensor, .. } if tensor == "m.weight_scale_inv")
    );
    assert!(err.to_string().contains("[1, 2]"), "{err}");
    let err = open_err(&[
        ("m.weight", DType::U8, vec![1, 8], PACKED.to_vec()),
        (
            "m.weight_scale",
            DType::F8E4M3,
            vec![1, 2],
            vec![0x40, 0x40],
        ),
        ("m.weight_scale_2", DType::F32, vec![], f32_bytes(&[0.25])),
    ]);
    assert!(matches!(&err, QuantError::TensorShape { tensor, .. } if tensor == "m.weight_scale"));
}

#[test]
fn scale_dtype_mismatch_is_refused_naming_the_tensor() {
    let err = open_err(&[
        ("m.weight", DType::F8E4M3, vec![2, 130], vec![0x38; 260]),
        ("m.weight_scale_inv", DType::U8, vec![1, 2], vec![1, 1]),
    ]);
    assert!(
        matches!(&err, QuantError::TensorDtype { tensor, .. } if tensor == "m.weight_scale_inv")
    );
    assert!(err.to_string().contains("F32 or BF16 or F16"), "{err}");
    let err = open_err(&[
        ("m.weight", DType::U8, vec![1, 8], PACKED.to_vec()),
        ("m.weight_scale", DType::F32, vec![1, 1], f32_bytes(&[2.0])),
        ("m.weight_scale_2", DType::F32, vec![], f32_bytes(&[0.25])),
    ]);
    assert!(matches!(&err, QuantError::TensorDtype { tensor, .. } if tensor == "m.weight_scale"));
}

#[test]
fn missing_global_scale_is_refused() {
    let err = open_err(&[
        ("m.weight", DType::U8, vec![1, 8], PACKED.to_vec()),
        ("m.weight_scale", DType::F8E4M3, vec![1, 1], vec![0x40]),
    ]);
    assert!(
        matches!(&err, QuantError::MissingTensor { tensor, .. } if tensor == "m.weight_scale_2")
    );
}

// ------------------------------------------------------------------------------
// Writing

struct Source {
    dir: tempfile::TempDir,
    up: Vec<f32>,
    in_proj_a: Vec<f32>,
}

/// A tiny bf16 checkpoint: a 40x272 projection (partial 128-tiles both ways, an
/// all-zero tile, an outlier), a linear-attention in_proj_a, embeddings and a norm.
fn source() -> Source {
    let bf16 = |x: f32| f32::from_bits(x.to_bits() & 0xFFFF_0000);
    let mut up: Vec<f32> = (0..40 * 272)
        .map(|i| bf16(((i as f32) * 0.7318).sin() * 0.05))
        .collect();
    for row in 0..40 {
        for col in 256..272 {
            up[row * 272 + col] = 0.0;
        }
    }
    up[5 * 272 + 3] = 1.5;
    let in_proj_a: Vec<f32> = (0..8 * 272)
        .map(|i| bf16((i as f32 * 0.11).cos() * 0.1))
        .collect();
    let embed: Vec<f32> = (0..50 * 272)
        .map(|i| bf16((i as f32 * 0.013).sin()))
        .collect();
    let norm = vec![1.0f32; 272];
    let to_bf16 = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    write_checkpoint(
        &src,
        Some(CONFIG),
        &[
            (
                "model.embed_tokens.weight",
                DType::BF16,
                vec![50, 272],
                to_bf16(&embed),
            ),
            (
                "model.layers.0.input_layernorm.weight",
                DType::BF16,
                vec![272],
                to_bf16(&norm),
            ),
            (
                "model.layers.0.linear_attn.in_proj_a.weight",
                DType::BF16,
                vec![8, 272],
                to_bf16(&in_proj_a),
            ),
            (
                "model.layers.0.mlp.up_proj.weight",
                DType::BF16,
                vec![40, 272],
                to_bf16(&up),
            ),
        ],
    );
    Source { dir, up, in_proj_a }
}

fn quantize(
    source: &Source,
    scheme: Scheme,
    layout: Layout,
    max_shard_bytes: usize,
) -> QuantizedBase {
    let input = Checkpoint::open(source.dir.path().join("src")).unwrap();
    let skip: Vec<String> = DEFAULT_SKIP.iter().map(|s| s.to_string()).collect();
    let options = QuantizeOptions {
        scheme,
        layout,
        skip: compile_skip(&skip).unwrap(),
        max_shard_bytes,
    };
    let plan = plan_quantization(&input, &options).unwrap();
    assert_eq!(plan.quantized_count(), 1);
    let out = source
        .dir
        .path()
        .join(format!("{scheme}-{layout}-{max_shard_bytes}"));
    std::fs::create_dir(&out).unwrap();
    let mut seen = Vec::new();
    write_quantized(&input, &plan, &options, &out, &mut |name| {
        seen.push(name.to_string())
    })
    .unwrap();
    assert_eq!(seen.len(), 4, "progress once per input tensor");
    QuantizedBase::open(&out).unwrap()
}

/// Quantizes the source, checks the decode, and returns the output (with the
/// temporary directory that holds it).
fn check_round_trip(
    scheme: Scheme,
    layout: Layout,
    max_shard_bytes: usize,
) -> (Source, QuantizedBase) {
    let source = source();
    let base = quantize(&source, scheme, layout, max_shard_bytes);
    let view = WeightView::new("up", 40, 272, &source.up).unwrap();
    let mut expected = scheme.fake_quant(view).unwrap();
    if layout == Layout::Bf16Emulated {
        for x in &mut expected {
            *x = loraq_io::convert::round_to_bf16(*x);
        }
    }
    let decoded = base
        .read_weight_f32("model.layers.0.mlp.up_proj.weight")
        .unwrap();
    assert_bits(&decoded, &expected, &format!("{scheme} in {layout}"));
    // Skipped weights are copied bit for bit.
    let kept = base
        .read_weight_f32("model.layers.0.linear_attn.in_proj_a.weight")
        .unwrap();
    assert_bits(&kept, &source.in_proj_a, "in_proj_a");
    assert_eq!(
        base.checkpoint()
            .info("model.layers.0.input_layernorm.weight")
            .unwrap()
            .dtype,
        DType::BF16
    );
    (source, base)
}

fn quantization_config(base: &QuantizedBase) -> serde_json::Value {
    let text = std::fs::read_to_string(base.checkpoint().root().join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        config["hidden_size"], 272,
        "the rest of config.json is kept"
    );
    config["quantization_config"].clone()
}

#[test]
fn fp8_block128_round_trip_and_config() {
    let (_source, base) = check_round_trip(Scheme::Fp8Block128, Layout::Fp8Block128, 1 << 30);
    let q = quantization_config(&base);
    assert_eq!(q["quant_method"], "fp8");
    assert_eq!(q["fmt"], "e4m3");
    assert_eq!(q["activation_scheme"], "dynamic");
    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
    let skipped = q["modules_to_not_convert"].as_array().unwrap();
    assert!(
        skipped.contains(&"model.embed_tokens".into()),
        "{skipped:?}"
    );
    assert!(skipped.contains(&"model.layers.0.linear_attn.in_proj_a".into()));
    let scale = base
        .checkpoint()
        .info("model.layers.0.mlp.up_proj.weight_scale_inv")
        .unwrap();
    assert_eq!((scale.dtype, scale.shape.clone()), (DType::F32, vec![1, 3]));
}

#[test]
fn fp8_block128_sharded_output_has_an_index() {
    let (_source, base) = check_round_trip(Scheme::Fp8Block128, Layout::Fp8Block128, 20_000);
    assert!(base.checkpoint().shard_count() > 1);
    assert!(
        base.checkpoint()
            .root()
            .join("model.safetensors.index.json")
            .is_file()
    );
}

#[test]
fn fp8_tensor_round_trip() {
    let (_source, base) = check_round_trip(Scheme::Fp8Tensor, Layout::Fp8Tensor, 1 << 30);
    assert!(
        quantization_config(&base)
            .get("weight_block_size")
            .is_none()
    );
}

#[test]
fn fp8_channel_compressed_tensors_round_trip_and_config() {
    let (_source, base) = check_round_trip(
        Scheme::Fp8Channel,
        Layout::Fp8ChannelCompressedTensors,
        1 << 30,
    );
    let q = quantization_config(&base);
    assert_eq!(q["quant_method"], "compressed-tensors");
    assert_eq!(q["format"], "float-quantized");
    assert_eq!(
        q["config_groups"]["group_0"]["weights"]["strategy"],
        "channel"
    );
    let ignored = q["ignore"].as_array().unwrap();
    assert!(ignored.contains(&"model.layers.0.linear_attn.in_proj_a".into()));
    let scale = base
        .checkpoint()
        .info("model.layers.0.mlp.up_proj.weight_scale")
        .unwrap();
    assert_eq!(
        (scale.dtype, scale.shape.clone()),
        (DType::F32, vec![40, 1])
    );
}

/// Without calibration the checkpoint is weight-only: `W4A16_NVFP4`, the
/// quant_algo vLLM runs with unquantized activations (`NVFP4` made it register
/// an `input_scale` loraq never wrote and use it as the activation scale), and
/// config.json lists the skipped modules under `ignore`, the key vLLM reads there
/// (`exclude_modules` only counts in hf_quant_config.json).
#[test]
fn nvfp4_modelopt_round_trip_and_config() {
    let (_source, base) = check_round_trip(Scheme::Nvfp4, Layout::Nvfp4ModelOpt, 1 << 30);
    let q = quantization_config(&base);
    assert_eq!(q["quant_method"], "modelopt");
    assert_eq!(q["quant_algo"], "W4A16_NVFP4");
    assert_eq!(q["config_groups"]["group_0"]["weights"]["group_size"], 16);
    assert!(
        q["config_groups"]["group_0"]
            .get("input_activations")
            .is_none()
    );
    let ignored = q["ignore"].as_array().unwrap();
    assert!(ignored.contains(&"model.layers.0.linear_attn.in_proj_a".into()));
    assert!(
        !base
            .checkpoint()
            .contains("model.layers.0.mlp.up_proj.input_scale")
    );
    let hf_quant: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(base.checkpoint().root().join("hf_quant_config.json")).unwrap(),
    )
    .unwrap();
    let section = &hf_quant["quantization"];
    assert_eq!(section["quant_algo"], "W4A16_NVFP4");
    assert_eq!(section["group_size"], 16);
    assert!(section["kv_cache_quant_algo"].is_null());
    assert_eq!(section["exclude_modules"], q["ignore"]);
    let packed = base
        .checkpoint()
        .info("model.layers.0.mlp.up_proj.weight")
        .unwrap();
    assert_eq!(
        (packed.dtype, packed.shape.clone()),
        (DType::U8, vec![40, 136])
    );
}

#[test]
fn bf16_emulated_round_trip_of_every_scheme() {
    for scheme in Scheme::ALL {
        if scheme == Scheme::Mxfp4 {
            continue; // 272 is not a multiple of 32; see mxfp4_refuses below
        }
        let (_source, base) = check_round_trip(scheme, Layout::Bf16Emulated, 1 << 30);
        let text = std::fs::read_to_string(base.checkpoint().root().join("config.json")).unwrap();
        assert!(
            !text.contains("quantization_config"),
            "{scheme}: plain bf16 checkpoint"
        );
    }
}

#[test]
fn nvfp4_plan_refuses_input_dim_not_divisible_naming_the_tensor() {
    let source = source();
    let input = Checkpoint::open(source.dir.path().join("src")).unwrap();
    let options = QuantizeOptions {
        scheme: Scheme::Mxfp4,
        layout: Layout::Bf16Emulated,
        skip: vec![],
        max_shard_bytes: 1 << 30,
    };
    let err = plan_quantization(&input, &options).unwrap_err();
    assert!(
        err.to_string().contains("model.embed_tokens.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("multiple of 32"), "{err}");
}

#[test]
fn scheme_layout_mismatch_and_quantized_input_are_refused() {
    let source = source();
    let input = Checkpoint::open(source.dir.path().join("src")).unwrap();
    let options = QuantizeOptions {
        scheme: Scheme::Nvfp4,
        layout: Layout::Fp8Block128,
        skip: vec![],
        max_shard_bytes: 1 << 30,
    };
    assert!(matches!(
        plan_quantization(&input, &options),
        Err(QuantError::SchemeLayoutMismatch { .. })
    ));
    let base = quantize(&source, Scheme::Fp8Block128, Layout::Fp8Block128, 1 << 30);
    let requantize = QuantizeOptions {
        layout: Layout::Fp8Block128,
        scheme: Scheme::Fp8Block128,
        ..options
    };
    let err = plan_quantization(base.checkpoint(), &requantize).unwrap_err();
    assert!(err.to_string().contains("already quantized"), "{err}");
}

#[test]
fn bad_skip_pattern_is_named() {
    let err = compile_skip(&["(".to_string()]).unwrap_err();
    assert!(err.to_string().contains("\"(\""), "{err}");
    assert!("nvfp4-gguf".parse::<Layout>().is_err());
    assert_eq!(
        "nvfp4-ct".parse::<Layout>().unwrap(),
        Layout::Nvfp4CompressedTensors
    );
}
