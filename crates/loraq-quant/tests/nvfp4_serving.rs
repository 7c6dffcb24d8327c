//! What serving engines read from a quantized checkpoint: NVFP4 written weight-only
//! (W4A16) without calibration and with static activation scales (W4A4) with it,
//! in the ModelOpt and the compressed-tensors layout, and the multi-token-prediction
//! head (`mtp.*`) kept unquantized by default under every scheme (issue 15,
//! problems 2 and 3). Field by field sources: docs/quantization.md.

use loraq_io::{Checkpoint, DType, TensorSpec, write_safetensors_file};
use loraq_quant::layout::{
    DEFAULT_SKIP, InputActivationStats, Layout, QuantizeOptions, TensorAction, compile_skip,
    plan_quantization, plan_quantization_calibrated, write_quantized,
};
use loraq_quant::{QuantError, QuantizedBase, Scheme, StoredWeight};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const UP: &str = "model.layers.0.mlp.up_proj";
const MTP_FC: &str = "mtp.fc";
const MTP_UP: &str = "mtp.layers.0.mlp.up_proj";
/// ModelOpt's `input_scale` for an input amax of 3.5: torch
/// `torch.tensor(3.5) / (6 * 448)` gives 0x3AAAAAAB.
const INPUT_SCALE_OF_3_5: u32 = 0x3AAA_AAAB;

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn matrix(rows: usize, cols: usize, seed: f32) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| f32::from_bits((((i as f32) * seed).sin() * 0.1).to_bits() & 0xFFFF_0000))
        .collect()
}

/// A Qwen3.5-like source: one decoder linear, an lm_head, and an MTP head whose
/// fc and MLP are linears like any other.
fn source(dir: &Path) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("config.json"),
        r#"{"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 32,
            "num_hidden_layers": 1, "vocab_size": 48}"#,
    )
    .unwrap();
    let tensors = [
        (format!("{UP}.weight"), matrix(32, 128, 0.37)),
        ("lm_head.weight".to_string(), matrix(48, 128, 0.11)),
        (format!("{MTP_FC}.weight"), matrix(128, 256, 0.23)),
        (format!("{MTP_UP}.weight"), matrix(32, 128, 0.53)),
    ];
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, v)| bf16_bytes(v)).collect();
    let specs: Vec<(TensorSpec, &[u8])> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, values), b)| {
            let cols = if name.starts_with(MTP_FC) { 256 } else { 128 };
            (
                TensorSpec::new(name, DType::BF16, vec![values.len() / cols, cols]),
                b.as_slice(),
            )
        })
        .collect();
    write_safetensors_file(&src.join("model.safetensors"), &specs, &BTreeMap::new()).unwrap();
    src
}

fn options(scheme: Scheme, layout: Layout) -> QuantizeOptions {
    let skip: Vec<String> = DEFAULT_SKIP.iter().map(|s| s.to_string()).collect();
    QuantizeOptions {
        scheme,
        layout,
        skip: compile_skip(&skip).unwrap(),
        max_shard_bytes: 1 << 30,
    }
}

fn calibration(modules: &[(&str, f32)]) -> InputActivationStats {
    InputActivationStats {
        source: PathBuf::from("stats.safetensors"),
        abs_max: modules.iter().map(|(m, a)| (m.to_string(), *a)).collect(),
    }
}

/// Plans and writes `layout`, returning the output directory.
fn write(
    dir: &Path,
    src: &Path,
    scheme: Scheme,
    layout: Layout,
    calibration: Option<&InputActivationStats>,
) -> PathBuf {
    let input = Checkpoint::open(src).unwrap();
    let options = options(scheme, layout);
    let plan = plan_quantization_calibrated(&input, &options, calibration).unwrap();
    let out = dir.join(format!("{layout}-{}", calibration.is_some()));
    std::fs::create_dir(&out).unwrap();
    write_quantized(&input, &plan, &options, &out, &mut |_| {}).unwrap();
    out
}

fn json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn quantization_config(out: &Path) -> Value {
    json(out.join("config.json"))["quantization_config"].clone()
}

/// Regression (problem 3): `mtp.fc` and the MTP layer's linears were quantized
/// like the decoder's, which vLLM's Qwen3.5 MTP cannot load (it builds `mtp.fc`
/// unquantized under NVFP4). By default they stay as they are under every scheme
/// and every layout's not-converted list names them.
#[test]
fn mtp_head_stays_unquantized_under_every_scheme_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    let input = Checkpoint::open(&src).unwrap();
    for (scheme, layout, list) in [
        (Scheme::Nvfp4, Layout::Nvfp4ModelOpt, "ignore"),
        (Scheme::Nvfp4, Layout::Nvfp4CompressedTensors, "ignore"),
        (
            Scheme::Fp8Block128,
            Layout::Fp8Block128,
            "modules_to_not_convert",
        ),
        (
            Scheme::Fp8Tensor,
            Layout::Fp8Tensor,
            "modules_to_not_convert",
        ),
        (
            Scheme::Fp8Channel,
            Layout::Fp8ChannelCompressedTensors,
            "ignore",
        ),
        (Scheme::Mxfp4, Layout::Bf16Emulated, ""),
        (Scheme::Int4G128Sym, Layout::Bf16Emulated, ""),
    ] {
        let plan = plan_quantization(&input, &options(scheme, layout)).unwrap();
        for module in [MTP_FC, MTP_UP] {
            let name = format!("{module}.weight");
            let action = &plan.actions.iter().find(|(n, _)| *n == name).unwrap().1;
            assert_eq!(*action, TensorAction::Copy, "{scheme} {layout}: {name}");
            assert!(
                plan.not_converted.contains(&module.to_string()),
                "{scheme} {layout}: {module} not listed"
            );
            if !list.is_empty() {
                let listed = plan.quantization_config.as_ref().unwrap()[list]
                    .as_array()
                    .unwrap()
                    .contains(&module.into());
                assert!(listed, "{scheme} {layout}: {module} not in {list}");
            }
        }
        let up = plan
            .actions
            .iter()
            .find(|(n, _)| *n == format!("{UP}.weight"))
            .unwrap();
        assert!(matches!(up.1, TensorAction::Quantize { .. }), "{scheme}");
    }
    // Written out, the MTP weights are the source's bf16 bytes.
    let out = write(dir.path(), &src, Scheme::Nvfp4, Layout::Nvfp4ModelOpt, None);
    let written = Checkpoint::open(&out).unwrap();
    for module in [MTP_FC, MTP_UP] {
        let name = format!("{module}.weight");
        assert_eq!(written.info(&name).unwrap().dtype, DType::BF16);
        assert_eq!(written.bytes(&name).unwrap(), input.bytes(&name).unwrap());
    }
}

/// With calibration, the ModelOpt layout carries each module's `input_scale` =
/// amax / (6 * 448) (F32 scalar, ModelOpt's value) and says `NVFP4` (W4A4) in
/// both config files, with the activation group in config.json.
#[test]
fn nvfp4_modelopt_with_calibration_writes_input_scale_and_w4a4_config() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    let cal = calibration(&[(UP, 3.5), ("lm_head", 7.0)]);
    let out = write(
        dir.path(),
        &src,
        Scheme::Nvfp4,
        Layout::Nvfp4ModelOpt,
        Some(&cal),
    );
    let ckpt = Checkpoint::open(&out).unwrap();
    let info = ckpt.info(&format!("{UP}.input_scale")).unwrap();
    assert_eq!((info.dtype, info.shape.clone()), (DType::F32, vec![]));
    assert_eq!(
        ckpt.read_f32(&format!("{UP}.input_scale")).unwrap()[0].to_bits(),
        INPUT_SCALE_OF_3_5
    );
    assert!(!ckpt.contains("lm_head.input_scale"), "lm_head stays bf16");
    let q = quantization_config(&out);
    assert_eq!(q["quant_method"], "modelopt");
    assert_eq!(q["quant_algo"], "NVFP4");
    let group = &q["config_groups"]["group_0"];
    for key in ["weights", "input_activations"] {
        assert_eq!(
            group[key],
            serde_json::json!({"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16}),
            "{key}"
        );
    }
    let hf_quant = json(out.join("hf_quant_config.json"));
    assert_eq!(hf_quant["quantization"]["quant_algo"], "NVFP4");
}

/// The compressed-tensors layout stores the same codes and block scales as the
/// ModelOpt layout under compressed-tensors' names, the global scales as
/// divisors (2688 / amax, `input_global_scale` 2688 / 3.5 = 768), and reads back
/// through `QuantizedBase` as compressed-tensors NVFP4.
#[test]
fn nvfp4_compressed_tensors_layout_matches_modelopt_codes_with_divisor_scales() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    let cal = calibration(&[(UP, 3.5)]);
    let modelopt = Checkpoint::open(write(
        dir.path(),
        &src,
        Scheme::Nvfp4,
        Layout::Nvfp4ModelOpt,
        Some(&cal),
    ))
    .unwrap();
    let out = write(
        dir.path(),
        &src,
        Scheme::Nvfp4,
        Layout::Nvfp4CompressedTensors,
        Some(&cal),
    );
    let base = QuantizedBase::open(&out).unwrap();
    let ckpt = base.checkpoint();
    assert_eq!(
        ckpt.bytes(&format!("{UP}.weight_packed")).unwrap(),
        modelopt.bytes(&format!("{UP}.weight")).unwrap()
    );
    assert_eq!(
        ckpt.bytes(&format!("{UP}.weight_scale")).unwrap(),
        modelopt.bytes(&format!("{UP}.weight_scale")).unwrap()
    );
    assert!(!ckpt.contains(&format!("{UP}.weight")));
    for tensor in ["weight_global_scale", "input_global_scale"] {
        let info = ckpt.info(&format!("{UP}.{tensor}")).unwrap();
        assert_eq!(
            (info.dtype, info.shape.clone()),
            (DType::F32, vec![1]),
            "{tensor}"
        );
    }
    assert_eq!(
        ckpt.read_f32(&format!("{UP}.input_global_scale")).unwrap()[0],
        768.0
    );
    // The weight's divisor is 2688 over the largest |w| of the source.
    let source = Checkpoint::open(&src).unwrap();
    let amax = source
        .read_f32(&format!("{UP}.weight"))
        .unwrap()
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()));
    assert_eq!(
        ckpt.read_f32(&format!("{UP}.weight_global_scale")).unwrap()[0],
        2688.0 / amax
    );
    let weight = base.weight(&format!("{UP}.weight")).unwrap();
    assert_eq!((weight.out_features, weight.in_features), (32, 128));
    assert!(matches!(
        weight.stored,
        StoredWeight::Nvfp4CompressedTensors { .. }
    ));
    let q = quantization_config(&out);
    assert_eq!(q["quant_method"], "compressed-tensors");
    assert_eq!(q["format"], "nvfp4-pack-quantized");
    assert_eq!(q["quantization_status"], "compressed");
    let group = &q["config_groups"]["group_0"];
    assert_eq!(group["weights"]["strategy"], "tensor_group");
    assert_eq!(group["input_activations"]["dynamic"], "local");
    assert!(q["ignore"].as_array().unwrap().contains(&"lm_head".into()));
    assert!(!out.join("hf_quant_config.json").exists());
    // Weight-only: no input_global_scale and no activation group.
    let weight_only = write(
        dir.path(),
        &src,
        Scheme::Nvfp4,
        Layout::Nvfp4CompressedTensors,
        None,
    );
    assert!(
        !Checkpoint::open(&weight_only)
            .unwrap()
            .contains(&format!("{UP}.input_global_scale"))
    );
    assert!(
        quantization_config(&weight_only)["config_groups"]["group_0"]["input_activations"]
            .is_null()
    );
}

/// A calibration that misses a quantized module, gives it a zero maximum, or
/// targets a layout without static activation scales is refused, naming the
/// file and the module, before anything is written.
#[test]
fn bad_calibration_is_refused_naming_file_and_module() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    let input = Checkpoint::open(&src).unwrap();
    let nvfp4 = options(Scheme::Nvfp4, Layout::Nvfp4ModelOpt);
    for cal in [
        calibration(&[("model.layers.0.mlp.down_proj", 1.0)]),
        calibration(&[(UP, 0.0)]),
        calibration(&[(UP, f32::NAN)]),
    ] {
        let err = plan_quantization_calibrated(&input, &nvfp4, Some(&cal)).unwrap_err();
        assert!(matches!(err, QuantError::ActivationStats { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("stats.safetensors") && text.contains(UP),
            "{text}"
        );
    }
    let fp8 = options(Scheme::Fp8Block128, Layout::Fp8Block128);
    let err =
        plan_quantization_calibrated(&input, &fp8, Some(&calibration(&[(UP, 1.0)]))).unwrap_err();
    assert!(err.to_string().contains("nvfp4 layouts only"), "{err}");
}
