//! What the kernels require of a base weight before they run it.
//!
//! The weight itself is `loraq_quant`'s [`QuantizedWeight`], codes and scales as the
//! checkpoint stores them (docs/quantization.md, "Checkpoint layouts"); nothing here
//! copies or dequantizes it. Shapes follow PyTorch's `nn.Linear`: `[rows = out_features,
//! cols = in_features]`, row `o` holds the weights of output `o`. Every length is checked
//! with checked arithmetic (the sizes may come from a file) and every code the
//! kernels would read as NaN is refused, so the fast paths index without checks.

use crate::error::{KernelError, Result};
use loraq_quant::{
    FP8_BLOCK, Fp8Granularity, INT4_GROUP, Nvfp4GlobalScale, QuantizedWeight, WeightFormat,
};

/// Checked `rows * cols`.
pub(crate) fn checked_area(what: &'static str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols)
        .ok_or(KernelError::SizeOverflow { what, rows, cols })
}

fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch {
            what,
            expected,
            actual,
        })
    }
}

fn check_finite(what: &'static str, scales: &[f32]) -> Result<()> {
    match scales.iter().position(|s| !s.is_finite()) {
        Some(index) => Err(KernelError::BadScale {
            what,
            index,
            value: scales[index],
        }),
        None => Ok(()),
    }
}

fn check_codes(what: &'static str, codes: &[u8], bad: impl Fn(u8) -> bool) -> Result<()> {
    match codes.iter().position(|&c| bad(c)) {
        Some(index) => Err(KernelError::BadScale {
            what,
            index,
            value: f32::NAN,
        }),
        None => Ok(()),
    }
}

/// Checks that the kernels can run `weight`: a format they have (bf16, fp8 with
/// 128x128 tiles, NVFP4, MXFP4, INT4 group 128), positive dimensions, an input
/// dimension the format's blocks divide, every buffer of the length its shape implies,
/// finite scales, and no code that decodes to NaN (a quantizer never writes one).
pub(crate) fn check_runnable(weight: &QuantizedWeight) -> Result<()> {
    let (out_features, in_features) = weight.shape();
    if out_features == 0 {
        return Err(KernelError::ZeroDimension {
            what: "out_features",
        });
    }
    if in_features == 0 {
        return Err(KernelError::ZeroDimension {
            what: "in_features",
        });
    }
    let format = weight.format();
    let block = format.in_features_multiple();
    if !in_features.is_multiple_of(block) {
        return Err(KernelError::InDimNotBlockAligned {
            format: format.name(),
            block,
            in_features,
        });
    }
    match weight {
        QuantizedWeight::Bf16(w) => check_len(
            "bf16 weight",
            checked_area("bf16 weight", out_features, in_features)?,
            w.data.len(),
        ),
        QuantizedWeight::Fp8(w) => {
            if w.granularity != Fp8Granularity::Block128 {
                return Err(KernelError::UnsupportedScheme {
                    what: format!("{format} (the fp8 kernels take 128x128 tiles)"),
                });
            }
            check_len(
                "fp8-block128 weight codes",
                checked_area("fp8-block128 weight codes", out_features, in_features)?,
                w.codes.len(),
            )?;
            let tiles = checked_area(
                "fp8-block128 weight scales",
                out_features.div_ceil(FP8_BLOCK),
                in_features.div_ceil(FP8_BLOCK),
            )?;
            check_len("fp8-block128 weight scales", tiles, w.scales.len())?;
            check_finite("fp8-block128 weight_scale_inv", &w.scales)?;
            check_codes("fp8-block128 weight code (E4M3 NaN)", &w.codes, |c| {
                c & 0x7F == 0x7F
            })
        }
        QuantizedWeight::Nvfp4(w) => {
            check_len(
                "nvfp4 packed weight",
                checked_area("nvfp4 packed weight", out_features, in_features / 2)?,
                w.packed.len(),
            )?;
            check_len(
                "nvfp4 weight_scale",
                checked_area("nvfp4 weight_scale", out_features, in_features / block)?,
                w.block_scales.len(),
            )?;
            let (what, stored) = match w.global_scale {
                Nvfp4GlobalScale::Multiplier(g) => ("nvfp4 weight_scale_2", g),
                Nvfp4GlobalScale::Divisor(d) => ("nvfp4 weight_global_scale", d),
            };
            if !(stored.is_finite() && stored > 0.0) {
                return Err(KernelError::BadScale {
                    what,
                    index: 0,
                    value: stored,
                });
            }
            check_codes("nvfp4 weight_scale (E4M3 NaN)", &w.block_scales, |c| {
                c & 0x7F == 0x7F
            })
        }
        QuantizedWeight::Mxfp4(w) => {
            check_len(
                "mxfp4 packed weight",
                checked_area("mxfp4 packed weight", out_features, in_features / 2)?,
                w.packed.len(),
            )?;
            check_len(
                "mxfp4 scales",
                checked_area("mxfp4 scales", out_features, in_features / block)?,
                w.scales.len(),
            )?;
            check_codes("mxfp4 scale (E8M0 NaN)", &w.scales, |c| c == 0xFF)
        }
        QuantizedWeight::Ggml(w) => {
            let expected = loraq_quant::ggml::matrix_bytes(
                w.ggml_type,
                "ggml weight",
                out_features,
                in_features,
            )
            .map_err(KernelError::Quant)?;
            check_len("ggml weight blocks", expected, w.data.len())?;
            // A NaN or infinite f16 scale makes its whole block NaN / infinite.
            let block = w.ggml_type.block();
            for (b, data) in w.data.chunks_exact(block.bytes).enumerate() {
                for &offset in loraq_quant::ggml::f16_scale_offsets(w.ggml_type) {
                    let bits = u16::from_le_bytes([data[offset], data[offset + 1]]);
                    let value = loraq_quant::ggml::fp16_to_f32(bits);
                    if !value.is_finite() {
                        return Err(KernelError::BadScale {
                            what: "ggml block scale (f16)",
                            index: b,
                            value,
                        });
                    }
                }
            }
            Ok(())
        }
        QuantizedWeight::Int4(w) => {
            check_len(
                "int4-g128 packed weight",
                checked_area(
                    "int4-g128 packed weight",
                    out_features,
                    in_features.div_ceil(2),
                )?,
                w.packed.len(),
            )?;
            let groups = checked_area(
                "int4-g128 scales",
                out_features,
                in_features.div_ceil(INT4_GROUP),
            )?;
            check_len("int4-g128 scales", groups, w.scales.len())?;
            check_len("int4-g128 zero points", groups, w.zeros.len())?;
            check_finite("int4-g128 scale", &w.scales)?;
            match w.zeros.iter().position(|&z| z > 15) {
                Some(index) => Err(KernelError::BadScale {
                    what: "int4-g128 zero point (above 15)",
                    index,
                    value: f32::from(w.zeros[index]),
                }),
                None => Ok(()),
            }
        }
    }
}

/// Whether the kernels have a path for `format` at all (the lengths and codes of a
/// particular weight are checked when its linear is built,
/// [`crate::QuantLoraLinear::new`]).
pub fn has_kernel(format: WeightFormat) -> bool {
    !matches!(
        format,
        WeightFormat::Fp8(Fp8Granularity::Tensor | Fp8Granularity::Channel)
    )
}
