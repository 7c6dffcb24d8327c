//! The base an adapter will run on, when it is not the bf16 base: a quantization scheme
//! applied exactly as `loraq quantize` applies it, or a quantized checkpoint directory
//! decoded exactly. Quantization-aware extraction factors `merged - target` instead of
//! `merged - base`.

use crate::error::{ExtractError, Result};
use loraq_io::Checkpoint;
use loraq_quant::layout::{
    DEFAULT_SKIP, Layout, QuantizeOptions, TensorAction, compile_skip, plan_quantization,
};
use loraq_quant::{QuantizedBase, Scheme, WeightView};
use rayon::prelude::*;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What `--target-base` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    /// A scheme, applied to the base as `loraq quantize --scheme SCHEME` does (default
    /// layout, default skip list).
    Scheme(Scheme),
    /// A quantized checkpoint (any layout `QuantizedBase` reads).
    Dir(PathBuf),
}

impl TargetSpec {
    /// A scheme name (`fp8-block128`, `nvfp4`, `int4-g128`, ...) is a scheme; anything
    /// else is a directory (write `./nvfp4` for a directory with a scheme's name).
    pub fn parse(text: &str) -> TargetSpec {
        match text.parse::<Scheme>() {
            Ok(scheme) => TargetSpec::Scheme(scheme),
            Err(_) => TargetSpec::Dir(PathBuf::from(text)),
        }
    }

    /// How the report names it: the scheme, or the directory.
    pub fn describe(&self) -> String {
        match self {
            TargetSpec::Scheme(s) => s.name().to_string(),
            TargetSpec::Dir(p) => p.display().to_string(),
        }
    }
}

enum Kind {
    Scheme {
        scheme: Scheme,
        layout: Layout,
        /// Tensors `loraq quantize` would quantize (the rest it copies).
        quantized: BTreeSet<String>,
    },
    Dir {
        path: PathBuf,
        decoded: Box<QuantizedBase>,
    },
}

/// An opened target base, checked against the bf16 base.
pub struct TargetBase {
    kind: Kind,
}

impl std::fmt::Debug for TargetBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Scheme { scheme, layout, .. } => {
                write!(f, "TargetBase::Scheme({scheme}, {layout})")
            }
            Kind::Dir { path, .. } => write!(f, "TargetBase::Dir({})", path.display()),
        }
    }
}

impl TargetBase {
    /// Opens the target. A scheme is planned over the whole base with
    /// `loraq quantize`'s own [`plan_quantization`] (so an unquantizable shape or an
    /// already quantized base is refused as `quantize` refuses it). A directory must
    /// hold every tensor of the base with the same shape: linear weights decodable to
    /// `[out, in]`, everything else stored as is; the error names the tensor.
    pub fn open(spec: &TargetSpec, base: &Checkpoint) -> Result<TargetBase> {
        let kind = match spec {
            TargetSpec::Scheme(scheme) => {
                let layout = Layout::default_for(*scheme);
                let patterns: Vec<String> = DEFAULT_SKIP.iter().map(|s| s.to_string()).collect();
                let options = QuantizeOptions {
                    scheme: *scheme,
                    layout,
                    skip: compile_skip(&patterns)?,
                    max_shard_bytes: usize::MAX,
                };
                let plan = plan_quantization(base, &options)?;
                let quantized = plan
                    .actions
                    .iter()
                    .filter(|(_, a)| matches!(a, TensorAction::Quantize { .. }))
                    .map(|(name, _)| name.clone())
                    .collect();
                Kind::Scheme {
                    scheme: *scheme,
                    layout,
                    quantized,
                }
            }
            TargetSpec::Dir(path) => {
                let decoded = QuantizedBase::open(path)?;
                check_dir_matches(path, &decoded, base)?;
                Kind::Dir {
                    path: path.clone(),
                    decoded: Box::new(decoded),
                }
            }
        };
        Ok(TargetBase { kind })
    }

    /// How the target stores `tensor`: the scheme's name, `bf16`-like for a weight left
    /// unquantized, or the directory's storage format.
    pub fn format_of(&self, tensor: &str, base_dtype: &str) -> String {
        match &self.kind {
            Kind::Scheme {
                scheme,
                layout,
                quantized,
            } => {
                if !quantized.contains(tensor) {
                    format!("{} (not quantized)", base_dtype.to_lowercase())
                } else if *layout == Layout::Bf16Emulated {
                    format!("{scheme} (bf16-emulated)")
                } else {
                    scheme.name().to_string()
                }
            }
            Kind::Dir { decoded, .. } => decoded
                .weight(tensor)
                .map(|w| w.stored.format_name())
                .unwrap_or_else(|_| "missing".into()),
        }
    }

    /// Whether the target may store `tensor` differently from the base (false for a
    /// tensor the scheme leaves unquantized; a directory is decoded to find out).
    pub fn may_change(&self, tensor: &str) -> bool {
        match &self.kind {
            Kind::Scheme { quantized, .. } => quantized.contains(tensor),
            Kind::Dir { .. } => true,
        }
    }

    /// The target's weight for `tensor`, decoded to f32 (`rows * cols`), from the base's
    /// own values `base_values`; `None` when the target keeps the base's weight as it is
    /// (a tensor the scheme skips).
    ///
    /// With a scheme this is bit-identical to what decoding `loraq quantize`'s output
    /// gives: the same quantizer on the same f32 values, and a bf16 rounding where the
    /// scheme's layout is bf16-emulated (mxfp4, int4).
    pub fn weight(
        &self,
        tensor: &str,
        rows: usize,
        cols: usize,
        base_values: &[f32],
    ) -> Result<Option<Vec<f32>>> {
        match &self.kind {
            Kind::Scheme {
                scheme,
                layout,
                quantized,
            } => {
                if !quantized.contains(tensor) {
                    return Ok(None);
                }
                let view = WeightView::new(tensor, rows, cols, base_values)?;
                let mut out = scheme.fake_quant(view)?;
                if *layout == Layout::Bf16Emulated {
                    out.par_iter_mut()
                        .for_each(|x| *x = loraq_io::convert::round_to_bf16(*x));
                }
                Ok(Some(out))
            }
            Kind::Dir { path, decoded } => {
                let w = decoded
                    .weight(tensor)
                    .map_err(|_| ExtractError::TargetBase {
                        path: path.clone(),
                        tensor: tensor.to_string(),
                        what: "missing".into(),
                    })?;
                if (w.out_features, w.in_features) != (rows, cols) {
                    return Err(ExtractError::TargetBase {
                        path: path.clone(),
                        tensor: tensor.to_string(),
                        what: format!(
                            "[{}, {}], the base has [{rows}, {cols}]",
                            w.out_features, w.in_features
                        ),
                    });
                }
                let values = decoded.read_weight_f32(tensor)?;
                if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                    return Err(ExtractError::TargetBase {
                        path: path.clone(),
                        tensor: tensor.to_string(),
                        what: format!("decodes to a non-finite value at element {i}"),
                    });
                }
                Ok(Some(values))
            }
        }
    }
}

/// Every tensor of the base is in the target with the same shape (a linear weight as
/// its decoded `[out, in]`).
fn check_dir_matches(path: &Path, decoded: &QuantizedBase, base: &Checkpoint) -> Result<()> {
    let target = decoded.checkpoint();
    for info in base.tensors() {
        let mismatch = |what: String| ExtractError::TargetBase {
            path: path.to_path_buf(),
            tensor: info.name.clone(),
            what,
        };
        let is_matrix_weight =
            info.name.ends_with(".weight") && info.shape.len() == 2 && info.dtype.is_float();
        if is_matrix_weight {
            let w = decoded.weight(&info.name).map_err(|_| {
                mismatch("missing (the base has it; is this a quantization of that base?)".into())
            })?;
            if [w.out_features, w.in_features] != info.shape[..] {
                return Err(mismatch(format!(
                    "decodes to [{}, {}], the base has {:?}",
                    w.out_features, w.in_features, info.shape
                )));
            }
        } else {
            let t = target.get(&info.name).ok_or_else(|| {
                mismatch("missing (the base has it; is this a quantization of that base?)".into())
            })?;
            if t.shape != info.shape {
                return Err(mismatch(format!(
                    "shape {:?}, the base has {:?}",
                    t.shape, info.shape
                )));
            }
        }
    }
    Ok(())
}
