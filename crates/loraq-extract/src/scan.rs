//! The diff scan: every tensor of the merge compared with the base's, in full.

use crate::error::{ExtractError, Refusal, Result};
use crate::read::ShardFiles;
use loraq_io::{Checkpoint, DType, ModuleName, TensorInfo};
use rayon::prelude::*;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// Tensors whose first block matched the base's and whose rest is still to be
    /// compared (zero once the scan is complete).
    #[serde(skip)]
    pub pending_identical: usize,
}

/// Bytes at the start of every tensor compared before any factoring, on each side. A
/// projection the LoRA changed differs almost everywhere, so its first rows find it;
/// small, because a 27B model holds hundreds of tensors the LoRA leaves alone and this
/// part of the scan is not overlapped with anything.
pub const FIRST_BLOCK: usize = 1 << 20;

/// Bytes compared per read in the rest of the scan ([`PendingScan::finish`]), on each
/// side: large sequential reads, while the modules are factored.
pub const SCAN_BLOCK: usize = 8 << 20;

/// Whether the first `block` bytes of the two tensors are equal (both the same length).
fn first_block_equal(
    merged: &ShardFiles,
    m: &TensorInfo,
    base: &ShardFiles,
    b: &TensorInfo,
    buffers: &mut (Vec<u8>, Vec<u8>),
    block: usize,
) -> Result<bool> {
    let n = block.min(m.byte_len());
    let (x, y) = buffers;
    x.resize(n, 0);
    y.resize(n, 0);
    merged.read(m, 0, x)?;
    base.read(b, 0, y)?;
    Ok(x == y)
}

enum Verdict {
    Identical,
    /// The first block matched; the rest is compared later.
    Pending(String),
    Differs(Difference),
}

/// What a tensor that differs from the base is.
enum Difference {
    Projection(Projection),
    Refused(Refusal),
}

fn refusal(m: &TensorInfo, reason: String) -> Difference {
    Difference::Refused(Refusal {
        tensor: m.name.clone(),
        reason,
    })
}

/// Compares dtype, shape and the first `block` bytes of a tensor present in both.
fn compare_first_block(
    merged: &ShardFiles,
    base: &ShardFiles,
    m: &TensorInfo,
    b: &TensorInfo,
    buffers: &mut (Vec<u8>, Vec<u8>),
    block: usize,
) -> Result<Verdict> {
    if m.dtype != b.dtype {
        return Ok(Verdict::Differs(refusal(
            m,
            format!(
                "dtype differs: base {}, merged {}",
                b.dtype.as_str(),
                m.dtype.as_str()
            ),
        )));
    }
    if m.shape != b.shape || m.byte_len() != b.byte_len() {
        return Ok(Verdict::Differs(refusal(
            m,
            format!("shape differs: base {:?}, merged {:?}", b.shape, m.shape),
        )));
    }
    if !first_block_equal(merged, m, base, b, buffers, block)? {
        return Ok(Verdict::Differs(classify_differing(m)));
    }
    if m.byte_len() <= block {
        Ok(Verdict::Identical)
    } else {
        Ok(Verdict::Pending(m.name.clone()))
    }
}

/// A tensor whose bytes differ from the base's: one of the LoRA's projections (the
/// weight of a 2-D float linear), or a refusal naming why it cannot be.
fn classify_differing(m: &TensorInfo) -> Difference {
    let parsed = ModuleName::parse(&m.name);
    let linear = parsed.as_ref().filter(|p| p.is_linear_weight());
    match (linear, m.matrix_shape()) {
        (Some(p), Some((out_features, in_features)))
            if matches!(m.dtype, DType::BF16 | DType::F16 | DType::F32) =>
        {
            Difference::Projection(Projection {
                tensor: m.name.clone(),
                module_path: p.module_path(),
                out_features,
                in_features,
            })
        }
        (Some(_), _) => refusal(
            m,
            format!(
                "differs but is not a 2-D BF16/F16/F32 weight ({} {:?})",
                m.dtype.as_str(),
                m.shape
            ),
        ),
        (None, _) => refusal(
            m,
            format!(
                "differs but is not a linear projection's weight (norm, embedding, lm_head, conv1d, A_log, dt_bias and biases cannot be in a LoRA adapter) ({} {:?})",
                m.dtype.as_str(),
                m.shape
            ),
        ),
    }
}

/// The tensors whose first block matched the base's, left to compare in full: in
/// `loraq extract` while the modules are factored, so that reading them (most of a
/// model the LoRA leaves alone) overlaps the factorization instead of preceding it.
#[derive(Debug, Default)]
pub struct PendingScan {
    /// Tensor names: those that could only be refused if they differ (embeddings,
    /// lm_head, norms: e.g. rows for added tokens at the end of embed_tokens) first,
    /// then the linears, each group in the merge's order.
    tensors: Vec<String>,
    /// Refusals found so far, for [`PendingScan::refused_so_far`].
    refused: std::sync::Mutex<Vec<Refusal>>,
    /// Bytes per checkpoint still to compare.
    bytes: u64,
    /// Bytes at the start of each tensor already compared.
    first_block: usize,
    /// Bytes compared per read.
    block: usize,
}

/// What comparing the [`PendingScan`]'s tensors in full found.
#[derive(Debug, Clone, Default)]
pub struct PendingOutcome {
    /// Tensors found identical.
    pub identical: usize,
    /// Tensors that differ after their first block: projections to factor.
    pub projections: Vec<Projection>,
    /// Tensors that differ after their first block and cannot be in an adapter.
    pub refusals: Vec<Refusal>,
}

impl PendingScan {
    /// Number of tensors left to compare.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether nothing is left to compare.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Bytes per checkpoint left to compare.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The refusals [`PendingScan::finish`] has found so far (while it runs beside the
    /// factoring, which stops at the next module when there is one).
    pub fn refused_so_far(&self) -> Vec<Refusal> {
        self.refused
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Compares the rest of every pending tensor, one tensor after another in large
    /// sequential reads (two block buffers, reused), on the calling thread. Stops early,
    /// with what it found so far, when `cancel` is set (the extraction failed
    /// elsewhere; the outcome is then not used).
    pub fn finish(
        &self,
        merged: &Checkpoint,
        base: &Checkpoint,
        cancel: &AtomicBool,
    ) -> Result<PendingOutcome> {
        let merged_files = ShardFiles::open(merged)?;
        let base_files = ShardFiles::open(base)?;
        let span = crate::timeline::Span::start();
        let mut outcome = PendingOutcome::default();
        let mut x = Vec::new();
        let mut y = Vec::new();
        for name in &self.tensors {
            if cancel.load(Ordering::Relaxed) {
                break;
            }
            let m = merged.info(name)?;
            let b = base.info(name)?;
            let len = m.byte_len();
            let mut equal = true;
            let mut start = self.first_block.min(len);
            while start < len {
                if cancel.load(Ordering::Relaxed) {
                    return Ok(outcome);
                }
                let n = self.block.min(len - start);
                x.resize(n, 0);
                y.resize(n, 0);
                merged_files.read(m, start, &mut x)?;
                base_files.read(b, start, &mut y)?;
                if x != y {
                    equal = false;
                    break;
                }
                start += n;
            }
            if equal {
                outcome.identical += 1;
            } else {
                match classify_differing(m) {
                    Difference::Projection(p) => outcome.projections.push(p),
                    Difference::Refused(r) => {
                        self.refused
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .push(r.clone());
                        outcome.refusals.push(r);
                    }
                }
            }
        }
        span.end(
            "scan rest",
            &format!("{} tensors, {} bytes", self.tensors.len(), self.bytes),
        );
        Ok(outcome)
    }
}

/// Compares every tensor of `merged` with `base`, byte for byte (no sampling): dtype,
/// shape and first block of every tensor in parallel, then the rest of the tensors
/// whose first block matched.
pub fn scan(merged: &Checkpoint, base: &Checkpoint) -> Result<ScanReport> {
    let (mut report, pending) = scan_first_blocks(merged, base)?;
    let outcome = pending.finish(merged, base, &AtomicBool::new(false))?;
    report.absorb(outcome);
    Ok(report)
}

/// The first part of [`scan`]: dtype, shape and the first [`FIRST_BLOCK`] bytes of every
/// tensor, tensors in parallel. Every tensor of the LoRA differs within its first
/// block unless its first rows are untouched; the tensors whose first block matched
/// are returned to compare in full with [`PendingScan::finish`].
pub fn scan_first_blocks(
    merged: &Checkpoint,
    base: &Checkpoint,
) -> Result<(ScanReport, PendingScan)> {
    scan_first_blocks_by(merged, base, FIRST_BLOCK, SCAN_BLOCK)
}

fn scan_first_blocks_by(
    merged: &Checkpoint,
    base: &Checkpoint,
    block: usize,
    rest_block: usize,
) -> Result<(ScanReport, PendingScan)> {
    let span = crate::timeline::Span::start();
    let merged_files = ShardFiles::open(merged)?;
    let base_files = ShardFiles::open(base)?;
    let merged_tensors: Vec<&TensorInfo> = merged.tensors().collect();
    let verdicts: Vec<Verdict> = merged_tensors
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |buffers, m| match base.get(&m.name) {
                Some(b) => compare_first_block(&merged_files, &base_files, m, b, buffers, block),
                None => Ok(Verdict::Differs(refusal(
                    m,
                    "only in the merge (an adapter cannot add tensors)".into(),
                ))),
            },
        )
        .collect::<Result<_>>()?;
    let mut report = ScanReport::default();
    let mut pending = PendingScan {
        first_block: block,
        block: rest_block.max(1),
        ..PendingScan::default()
    };
    for verdict in verdicts {
        match verdict {
            Verdict::Identical => report.identical += 1,
            Verdict::Pending(name) => {
                let len = merged.info(&name)?.byte_len();
                pending.bytes += (len - block.min(len)) as u64;
                pending.tensors.push(name);
            }
            Verdict::Differs(Difference::Projection(p)) => report.projections.push(p),
            Verdict::Differs(Difference::Refused(r)) => report.refusals.push(r),
        }
    }
    // Tensors that can only be refused first, so that such a refusal stops the
    // factoring early.
    pending.tensors.sort_by_key(|name| {
        ModuleName::parse(name)
            .as_ref()
            .is_some_and(ModuleName::is_linear_weight)
    });
    report.pending_identical = pending.len();
    report.base_only = base
        .tensors()
        .filter(|b| !merged.contains(&b.name))
        .map(|b| b.name.clone())
        .collect();
    report.projections.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    report.refusals.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    span.end(
        "scan first blocks",
        &format!("{} tensors", merged_tensors.len()),
    );
    Ok((report, pending))
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

    /// Adds what comparing the pending tensors in full found: the report is then the
    /// full scan's (`pending_identical` zero, projections and refusals sorted).
    pub fn absorb(&mut self, outcome: PendingOutcome) {
        self.identical += outcome.identical;
        self.pending_identical = 0;
        self.projections.extend(outcome.projections);
        self.refusals.extend(outcome.refusals);
        self.projections.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        self.refusals.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    }
}
