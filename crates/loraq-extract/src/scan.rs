//! The diff scan: every tensor of the merge compared with the base's, in full.

use crate::error::{ExtractError, Refusal, Result};
use crate::read::ShardFiles;
use loraq_io::{Checkpoint, DType, ModuleName, TensorInfo};
use rayon::prelude::*;
use serde::Serialize;

/// A differing tensor that is a LoRA target: the weight of a 2-D linear projection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Projection {
    /// Tensor name, e.g. `model.language_model.layers.40.mlp.up_proj.weight`.
    pub tensor: String,
    /// Module path (tensor name without `.weight`).
    pub module_path: String,
    /// Output features (rows).
    pub out_features: usize,
    /// Input features (columns).
    pub in_features: usize,
}

/// What the scan found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScanReport {
    /// Tensors byte-for-byte identical in both checkpoints.
    pub identical: usize,
    /// Differing projection weights, sorted by name: what the adapter must reproduce.
    pub projections: Vec<Projection>,
    /// Tensors only the base holds (ignored: e.g. an MTP head the merge dropped).
    pub base_only: Vec<String>,
    /// Everything that stops the extraction (empty when the merge is base + LoRA).
    pub refusals: Vec<Refusal>,
}

/// Whether two tensors' bytes are equal, read and compared in parallel blocks (one
/// pair of block buffers per worker, reused). Stops at the first differing block: a
/// projection the LoRA changed differs almost everywhere, and the factor stage reads
/// it again anyway, so only identical tensors are read in full.
fn bytes_equal(
    merged: &ShardFiles,
    m: &TensorInfo,
    base: &ShardFiles,
    b: &TensorInfo,
) -> Result<bool> {
    const BLOCK: usize = 4 << 20;
    let len = m.byte_len();
    if len != b.byte_len() {
        return Ok(false);
    }
    let blocks: Vec<usize> = (0..len).step_by(BLOCK).collect();
    let first_difference = blocks
        .par_iter()
        .map_init(
            || (vec![0u8; BLOCK], vec![0u8; BLOCK]),
            |(x, y), &start| -> Result<bool> {
                let n = BLOCK.min(len - start);
                merged.read(m, start, &mut x[..n])?;
                base.read(b, start, &mut y[..n])?;
                Ok(x[..n] != y[..n])
            },
        )
        .find_any(|outcome| !matches!(outcome, Ok(false)));
    match first_difference {
        None => Ok(true),
        Some(Err(e)) => Err(e),
        Some(Ok(_)) => Ok(false),
    }
}

enum Verdict {
    Identical,
    Projection(Projection),
    Refused(Refusal),
}

fn compare(
    merged: &ShardFiles,
    base: &ShardFiles,
    m: &TensorInfo,
    b: &TensorInfo,
) -> Result<Verdict> {
    let refuse = |reason: String| {
        Ok(Verdict::Refused(Refusal {
            tensor: m.name.clone(),
            reason,
        }))
    };
    if m.dtype != b.dtype {
        return refuse(format!(
            "dtype differs: base {}, merged {}",
            b.dtype.as_str(),
            m.dtype.as_str()
        ));
    }
    if m.shape != b.shape {
        return refuse(format!(
            "shape differs: base {:?}, merged {:?}",
            b.shape, m.shape
        ));
    }
    if bytes_equal(merged, m, base, b)? {
        return Ok(Verdict::Identical);
    }
    let parsed = ModuleName::parse(&m.name);
    let linear = parsed.as_ref().filter(|p| p.is_linear_weight());
    match (linear, m.matrix_shape()) {
        (Some(p), Some((out_features, in_features)))
            if matches!(m.dtype, DType::BF16 | DType::F16 | DType::F32) =>
        {
            Ok(Verdict::Projection(Projection {
                tensor: m.name.clone(),
                module_path: p.module_path(),
                out_features,
                in_features,
            }))
        }
        (Some(_), _) => refuse(format!(
            "differs but is not a 2-D BF16/F16/F32 weight ({} {:?})",
            m.dtype.as_str(),
            m.shape
        )),
        (None, _) => refuse(format!(
            "differs but is not a linear projection's weight (norm, embedding, lm_head, conv1d, A_log, dt_bias and biases cannot be in a LoRA adapter) ({} {:?})",
            m.dtype.as_str(),
            m.shape
        )),
    }
}

/// Compares every tensor of `merged` with `base`, byte for byte (no sampling), tensors
/// in parallel and each large tensor in parallel blocks.
pub fn scan(merged: &Checkpoint, base: &Checkpoint) -> Result<ScanReport> {
    let merged_files = ShardFiles::open(merged)?;
    let base_files = ShardFiles::open(base)?;
    let merged_tensors: Vec<&TensorInfo> = merged.tensors().collect();
    let verdicts: Vec<Verdict> = merged_tensors
        .par_iter()
        .map(|m| match base.get(&m.name) {
            Some(b) => compare(&merged_files, &base_files, m, b),
            None => Ok(Verdict::Refused(Refusal {
                tensor: m.name.clone(),
                reason: "only in the merge (an adapter cannot add tensors)".into(),
            })),
        })
        .collect::<Result<_>>()?;
    let mut report = ScanReport::default();
    for verdict in verdicts {
        match verdict {
            Verdict::Identical => report.identical += 1,
            Verdict::Projection(p) => report.projections.push(p),
            Verdict::Refused(r) => report.refusals.push(r),
        }
    }
    report.base_only = base
        .tensors()
        .filter(|b| !merged.contains(&b.name))
        .map(|b| b.name.clone())
        .collect();
    report.projections.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    report.refusals.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    Ok(report)
}

impl ScanReport {
    /// The report, or [`ExtractError::Refused`] naming every refused tensor.
    pub fn into_result(self) -> Result<ScanReport> {
        if self.refusals.is_empty() {
            Ok(self)
        } else {
            Err(ExtractError::Refused {
                refusals: self.refusals,
            })
        }
    }
}
