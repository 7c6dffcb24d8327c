//! A PEFT LoRA adapter merged into a bf16 base, as PEFT's `merge_and_unload` does it.
//!
//! For every adapted linear of `out_features x in_features`, with the adapter's
//! `scale = alpha / r`:
//!
//! ```text
//! delta[o, i]  = f32(f32(sum_k B[o, k] A[k, i]) * scale)   (sum in f32, k = 0, 1, ...)
//! merged[o, i] = bf16(f32(W[o, i]) + delta[o, i])        (each f32 operation rounded)
//! ```
//!
//! This is what PEFT computes when the adapter is loaded onto a bf16 base with
//! `PeftModel.from_pretrained` (its default `autocast_adapter_dtype=True` holds the
//! factors in float32): `Linear.get_delta_weight` (peft/tuners/lora/layer.py) takes
//! `(B @ A) * scaling` in float32, and `Linear.merge` adds it to the bf16 weight in
//! place (`weight.data += delta`), which torch computes in float32 and rounds to bf16
//! once. The products `B[o, k] A[k, i]` of bf16 factors are exact in f32 (8 + 8
//! significant bits), so only the order of the sum matters: accumulated in f32 over
//! `k` in increasing order, it gives torch's CPU matrix product bit for bit on the
//! demo's trained pair (tests/demo_model.rs compares every element with PEFT's
//! merge). Every other tensor is copied byte for byte.

use crate::{Result, SynthError};
use loraq_io::convert::{bf16_bits_to_f32, f32_to_bf16_bits};
use loraq_io::{AtomicDir, Checkpoint, CheckpointWriter, DType, IoError, LoraAdapter, TensorSpec};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Files besides the weights that the merged directory copies from the base when
/// present: what `loraq run` and the serving engines read next to the weights.
const COPIED_FILES: [&str; 2] = [loraq_io::CONFIG_FILE, "tokenizer.json"];

/// What [`merge_adapter`] wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MergeSummary {
    /// The merged checkpoint's directory.
    pub out: PathBuf,
    /// Tensors written (the base's).
    pub tensors: usize,
    /// Linears the adapter changed.
    pub adapted_modules: usize,
    /// The largest rank among them.
    pub max_rank: usize,
    /// Parameters of the checkpoint.
    pub parameters: usize,
}

/// `delta[o, i] = f32(f32(sum_k B[o, k] A[k, i]) * scale)`, the sum accumulated in f32
/// over `k` in increasing order, for `B` of `out_features x rank` and `A` of
/// `rank x in_features`, row-major.
pub fn lora_delta(
    b: &[f32],
    a: &[f32],
    out_features: usize,
    rank: usize,
    in_features: usize,
    scale: f32,
) -> Vec<f32> {
    debug_assert_eq!(b.len(), out_features * rank);
    debug_assert_eq!(a.len(), rank * in_features);
    let mut out = vec![0f32; out_features * in_features];
    out.par_chunks_mut(in_features)
        .enumerate()
        .for_each(|(o, row)| {
            for k in 0..rank {
                let coef = b[o * rank + k];
                for (s, &x) in row
                    .iter_mut()
                    .zip(&a[k * in_features..(k + 1) * in_features])
                {
                    *s += coef * x;
                }
            }
            for d in row.iter_mut() {
                *d *= scale;
            }
        });
    out
}

/// Merges the PEFT adapter in `adapter` into the bf16 checkpoint in `base`, writing
/// `out` (config.json and tokenizer.json copied, one `model.safetensors`) all at once;
/// an existing `out` is refused unless `force`. Refuses an adapted weight that is not
/// bf16 or whose shape differs from the adapter's factors, naming both.
pub fn merge_adapter(base: &Path, adapter: &Path, out: &Path, force: bool) -> Result<MergeSummary> {
    let checkpoint = Checkpoint::open(base)?;
    let lora = LoraAdapter::open_for(adapter, &checkpoint)?;
    let mut by_weight: BTreeMap<String, &loraq_io::LoraModuleInfo> = BTreeMap::new();
    for module in &lora.modules {
        by_weight.insert(format!("{}.weight", module.module_path), module);
    }
    let mut specs = Vec::with_capacity(checkpoint.len());
    let mut parameters = 0usize;
    for info in checkpoint.tensors() {
        if let Some(module) = by_weight.get(&info.name) {
            let shape = info.matrix_shape();
            if info.dtype != DType::BF16 || shape != Some((module.out_features, module.in_features))
            {
                return Err(SynthError::Invalid(format!(
                    "{}: tensor {} is {:?} {:?}; adapter {} holds a LoRA for a bf16 [{}, {}] linear",
                    base.display(),
                    info.name,
                    info.dtype,
                    info.shape,
                    adapter.display(),
                    module.out_features,
                    module.in_features
                )));
            }
        }
        parameters = parameters
            .checked_add(info.element_count())
            .ok_or_else(|| {
                SynthError::Invalid(format!("{}: parameter count overflows", base.display()))
            })?;
        specs.push(TensorSpec::new(
            info.name.clone(),
            info.dtype,
            info.shape.clone(),
        ));
    }
    let missing: Vec<&str> = by_weight
        .keys()
        .filter(|name| !checkpoint.contains(name))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Err(SynthError::Invalid(format!(
            "adapter {} adapts modules whose weight {} does not hold: {}",
            adapter.display(),
            base.display(),
            missing.join(", ")
        )));
    }

    let dir = AtomicDir::create(out, force, &[base, adapter])?;
    for file in COPIED_FILES {
        let from = checkpoint.root().join(file);
        if from.is_file() {
            let to = dir.path().join(file);
            std::fs::copy(&from, &to).map_err(|source| IoError::Os { path: to, source })?;
        }
    }
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut writer = CheckpointWriter::new(dir.path(), specs, usize::MAX, metadata)?;
    let mut max_rank = 0;
    for info in checkpoint.tensors() {
        let Some(module) = by_weight.get(&info.name) else {
            writer.write_tensor(&info.name, checkpoint.bytes(&info.name)?)?;
            continue;
        };
        let a = lora.read_a_f32(&module.module_path)?;
        let b = lora.read_b_f32(&module.module_path)?;
        let delta = lora_delta(
            &b,
            &a,
            module.out_features,
            module.rank,
            module.in_features,
            module.scale as f32,
        );
        let weight = checkpoint.bytes(&info.name)?;
        let mut merged = vec![0u8; weight.len()];
        merged
            .par_chunks_exact_mut(2)
            .zip(weight.par_chunks_exact(2))
            .zip(&delta)
            .for_each(|((m, w), d)| {
                let w = bf16_bits_to_f32(u16::from_le_bytes([w[0], w[1]]));
                m.copy_from_slice(&f32_to_bf16_bits(w + d).to_le_bytes());
            });
        if let Some(at) = merged
            .chunks_exact(2)
            .position(|m| !bf16_bits_to_f32(u16::from_le_bytes([m[0], m[1]])).is_finite())
        {
            return Err(SynthError::Invalid(format!(
                "merging {} into {}: tensor {} element {at} is not finite after the merge",
                adapter.display(),
                base.display(),
                info.name
            )));
        }
        writer.write_tensor(&info.name, &merged)?;
        max_rank = max_rank.max(module.rank);
    }
    writer.finish()?;
    let summary = MergeSummary {
        out: out.to_path_buf(),
        tensors: checkpoint.len(),
        adapted_modules: by_weight.len(),
        max_rank,
        parameters,
    };
    dir.commit()?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_is_the_scaled_product_rounded_once() {
        // B = [[1, 2], [3, 4]] (2 x 2), A = [[0.5, -1, 2], [0.25, 0, 1]] (2 x 3).
        let b = [1.0, 2.0, 3.0, 4.0];
        let a = [0.5, -1.0, 2.0, 0.25, 0.0, 1.0];
        let d = lora_delta(&b, &a, 2, 2, 3, 2.0);
        assert_eq!(d, vec![2.0, -2.0, 8.0, 5.0, -6.0, 20.0]);
        // The sum is f32 in increasing k: 1 + 2^-24 rounds to 1 (ties to even), twice,
        // where the exact sum 1 + 2^-23 is an f32; the other order keeps both halves.
        let tiny = 2f32.powi(-24);
        let d = lora_delta(&[1.0, 1.0, 1.0], &[1.0, tiny, tiny], 1, 3, 1, 1.0);
        assert_eq!(d, vec![1.0]);
        let d = lora_delta(&[1.0, 1.0, 1.0], &[tiny, tiny, 1.0], 1, 3, 1, 1.0);
        assert_eq!(d, vec![1.0 + 2.0 * tiny]);
    }
}
