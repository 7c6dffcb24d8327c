//! Base weight containers in their stored (quantized) layouts.
//!
//! Every container keeps the bytes exactly as the checkpoint stores them (see docs/quantization.md,
//! "Checkpoint layouts"); nothing here dequantizes a whole matrix. Shapes follow
//! PyTorch's `nn.Linear`: `[out_dim, in_dim]`, row `o` holds the weights of output `o`.

use crate::error::{KernelError, Result};
use half::bf16;

/// Side of the square fp8 scale tile (weight_block_size [128, 128]).
pub const FP8_BLOCK: usize = 128;
/// Elements per NVFP4 scale block along the input dimension.
pub const NVFP4_BLOCK: usize = 16;
/// Elements per MXFP4 scale block along the input dimension.
pub const MXFP4_BLOCK: usize = 32;
/// Elements per INT4 group along the input dimension (the last one may be partial).
pub const INT4_GROUP: usize = 128;

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

fn check_dims(out_dim: usize, in_dim: usize) -> Result<()> {
    if out_dim == 0 {
        return Err(KernelError::ZeroDimension { what: "out_dim" });
    }
    if in_dim == 0 {
        return Err(KernelError::ZeroDimension { what: "in_dim" });
    }
    Ok(())
}

/// Unquantized bf16 weight `[out_dim, in_dim]`, row-major.
#[derive(Clone, Debug)]
pub struct Bf16Weight {
    pub(crate) out_dim: usize,
    pub(crate) in_dim: usize,
    pub(crate) data: Vec<bf16>,
}

impl Bf16Weight {
    /// Wraps row-major bf16 data of shape `[out_dim, in_dim]`.
    pub fn new(out_dim: usize, in_dim: usize, data: Vec<bf16>) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        check_len(
            "bf16 weight",
            checked_area("bf16 weight", out_dim, in_dim)?,
            data.len(),
        )?;
        Ok(Self {
            out_dim,
            in_dim,
            data,
        })
    }

    /// The raw row-major data.
    pub fn data(&self) -> &[bf16] {
        &self.data
    }
}

/// FP8 E4M3 weight with one f32 dequantization multiplier per 128x128 tile
/// (the Qwen/DeepSeek `weight` + `weight_scale_inv` layout):
/// `W[o, k] = e4m3(q[o, k]) * scale[o / 128, k / 128]`.
#[derive(Clone, Debug)]
pub struct Fp8Block128Weight {
    pub(crate) out_dim: usize,
    pub(crate) in_dim: usize,
    /// E4M3 bit patterns, `[out_dim, in_dim]`.
    pub(crate) codes: Vec<u8>,
    /// Multipliers, `[ceil(out_dim / 128), ceil(in_dim / 128)]`.
    pub(crate) scales: Vec<f32>,
}

impl Fp8Block128Weight {
    /// Wraps E4M3 codes `[out_dim, in_dim]` and tile multipliers
    /// `[ceil(out_dim/128), ceil(in_dim/128)]`. Scales must be finite; E4M3 NaN codes
    /// (0x7F, 0xFF) are refused because a quantizer never produces them.
    pub fn new(out_dim: usize, in_dim: usize, codes: Vec<u8>, scales: Vec<f32>) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        check_len(
            "fp8-block128 weight codes",
            checked_area("fp8-block128 weight codes", out_dim, in_dim)?,
            codes.len(),
        )?;
        let tiles = checked_area(
            "fp8-block128 weight scales",
            out_dim.div_ceil(FP8_BLOCK),
            in_dim.div_ceil(FP8_BLOCK),
        )?;
        check_len("fp8-block128 weight scales", tiles, scales.len())?;
        if let Some(index) = scales.iter().position(|s| !s.is_finite()) {
            return Err(KernelError::BadScale {
                what: "fp8-block128 weight_scale_inv",
                index,
                value: scales[index],
            });
        }
        if let Some(index) = codes.iter().position(|&c| c & 0x7F == 0x7F) {
            return Err(KernelError::BadScale {
                what: "fp8-block128 weight code (E4M3 NaN)",
                index,
                value: f32::NAN,
            });
        }
        Ok(Self {
            out_dim,
            in_dim,
            codes,
            scales,
        })
    }

    /// E4M3 codes, row-major `[out_dim, in_dim]`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// Tile multipliers, row-major `[ceil(out/128), ceil(in/128)]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Number of scale tiles along the input dimension.
    pub fn scale_cols(&self) -> usize {
        self.in_dim.div_ceil(FP8_BLOCK)
    }
}

/// NVFP4 weight in the ModelOpt layout: E2M1 codes packed two per byte (even element in
/// the low nibble), one E4M3 scale per 16 inputs, one f32 global multiplier:
/// `W[o, k] = e2m1(q[o, k]) * e4m3(s[o, k / 16]) * global_scale`.
#[derive(Clone, Debug)]
pub struct Nvfp4Weight {
    pub(crate) out_dim: usize,
    pub(crate) in_dim: usize,
    /// Packed codes `[out_dim, in_dim / 2]`.
    pub(crate) packed: Vec<u8>,
    /// E4M3 block scales `[out_dim, in_dim / 16]`.
    pub(crate) block_scales: Vec<u8>,
    /// `weight_scale_2` (dequantization direction, = amax / 2688 for ModelOpt).
    pub(crate) global_scale: f32,
}

impl Nvfp4Weight {
    /// Wraps ModelOpt NVFP4 tensors. `in_dim` must be a multiple of 16: a partial block
    /// has no representation in the format, so other shapes are refused.
    pub fn new(
        out_dim: usize,
        in_dim: usize,
        packed: Vec<u8>,
        block_scales: Vec<u8>,
        global_scale: f32,
    ) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        if !in_dim.is_multiple_of(NVFP4_BLOCK) {
            return Err(KernelError::InDimNotBlockAligned {
                format: "nvfp4",
                block: NVFP4_BLOCK,
                in_dim,
            });
        }
        check_len(
            "nvfp4 packed weight",
            checked_area("nvfp4 packed weight", out_dim, in_dim / 2)?,
            packed.len(),
        )?;
        check_len(
            "nvfp4 weight_scale",
            checked_area("nvfp4 weight_scale", out_dim, in_dim / NVFP4_BLOCK)?,
            block_scales.len(),
        )?;
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(KernelError::BadScale {
                what: "nvfp4 weight_scale_2",
                index: 0,
                value: global_scale,
            });
        }
        if let Some(index) = block_scales.iter().position(|&c| c & 0x7F == 0x7F) {
            return Err(KernelError::BadScale {
                what: "nvfp4 weight_scale (E4M3 NaN)",
                index,
                value: f32::NAN,
            });
        }
        Ok(Self {
            out_dim,
            in_dim,
            packed,
            block_scales,
            global_scale,
        })
    }

    /// Packed E2M1 codes `[out_dim, in_dim / 2]`.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// E4M3 block scales `[out_dim, in_dim / 16]`.
    pub fn block_scales(&self) -> &[u8] {
        &self.block_scales
    }

    /// Global dequantization multiplier.
    pub fn global_scale(&self) -> f32 {
        self.global_scale
    }
}

/// MXFP4 weight (OCP MX): E2M1 codes packed like NVFP4, one E8M0 scale per 32 inputs:
/// `W[o, k] = e2m1(q[o, k]) * 2^(s[o, k / 32] - 127)`.
#[derive(Clone, Debug)]
pub struct Mxfp4Weight {
    pub(crate) out_dim: usize,
    pub(crate) in_dim: usize,
    pub(crate) packed: Vec<u8>,
    pub(crate) block_scales: Vec<u8>,
}

impl Mxfp4Weight {
    /// Wraps MXFP4 tensors; `in_dim` must be a multiple of 32. The E8M0 NaN code 0xFF
    /// is refused.
    pub fn new(
        out_dim: usize,
        in_dim: usize,
        packed: Vec<u8>,
        block_scales: Vec<u8>,
    ) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        if !in_dim.is_multiple_of(MXFP4_BLOCK) {
            return Err(KernelError::InDimNotBlockAligned {
                format: "mxfp4",
                block: MXFP4_BLOCK,
                in_dim,
            });
        }
        check_len(
            "mxfp4 packed weight",
            checked_area("mxfp4 packed weight", out_dim, in_dim / 2)?,
            packed.len(),
        )?;
        check_len(
            "mxfp4 scales",
            checked_area("mxfp4 scales", out_dim, in_dim / MXFP4_BLOCK)?,
            block_scales.len(),
        )?;
        if let Some(index) = block_scales.iter().position(|&c| c == 0xFF) {
            return Err(KernelError::BadScale {
                what: "mxfp4 scale (E8M0 NaN)",
                index,
                value: f32::NAN,
            });
        }
        Ok(Self {
            out_dim,
            in_dim,
            packed,
            block_scales,
        })
    }

    /// Packed E2M1 codes `[out_dim, in_dim / 2]`.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// E8M0 block scales `[out_dim, in_dim / 32]`.
    pub fn block_scales(&self) -> &[u8] {
        &self.block_scales
    }
}

/// INT4 weight with one f32 scale and one zero point per 128 inputs (the last group of a
/// row may be partial), the scheme `loraq-quant` writes (`int4-g128-sym`: zero 8,
/// `int4-g128-asym`: any zero): `W[o, k] = (q[o, k] - z[o, k / 128]) * s[o, k / 128]`.
/// Codes are packed two per byte, the even element in the low nibble, each row padded to
/// whole bytes (`ceil(in_dim / 2)` bytes per row).
#[derive(Clone, Debug)]
pub struct Int4G128Weight {
    pub(crate) out_dim: usize,
    pub(crate) in_dim: usize,
    /// Packed codes `[out_dim, ceil(in_dim / 2)]`.
    pub(crate) packed: Vec<u8>,
    /// Scales `[out_dim, ceil(in_dim / 128)]`.
    pub(crate) scales: Vec<f32>,
    /// Zero points `0..=15`, `[out_dim, ceil(in_dim / 128)]`.
    pub(crate) zeros: Vec<u8>,
}

impl Int4G128Weight {
    /// Wraps packed codes `[out_dim, ceil(in_dim / 2)]` (even element in the low nibble),
    /// scales and zero points `[out_dim, ceil(in_dim / 128)]`. Scales must be finite and
    /// zero points at most 15.
    pub fn new(
        out_dim: usize,
        in_dim: usize,
        packed: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<u8>,
    ) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        check_len(
            "int4-g128 packed weight",
            checked_area("int4-g128 packed weight", out_dim, in_dim.div_ceil(2))?,
            packed.len(),
        )?;
        let groups = checked_area("int4-g128 scales", out_dim, in_dim.div_ceil(INT4_GROUP))?;
        check_len("int4-g128 scales", groups, scales.len())?;
        check_len("int4-g128 zero points", groups, zeros.len())?;
        if let Some(index) = scales.iter().position(|s| !s.is_finite()) {
            return Err(KernelError::BadScale {
                what: "int4-g128 scale",
                index,
                value: scales[index],
            });
        }
        if let Some(index) = zeros.iter().position(|&z| z > 15) {
            return Err(KernelError::BadScale {
                what: "int4-g128 zero point (above 15)",
                index,
                value: f32::from(zeros[index]),
            });
        }
        Ok(Self {
            out_dim,
            in_dim,
            packed,
            scales,
            zeros,
        })
    }

    /// Packs codes stored one per byte (`[out_dim, in_dim]`, as `loraq-quant`'s
    /// `Int4Weight` keeps them) and wraps them; codes above 15 are refused.
    pub fn from_codes(
        out_dim: usize,
        in_dim: usize,
        codes: &[u8],
        scales: Vec<f32>,
        zeros: Vec<u8>,
    ) -> Result<Self> {
        check_dims(out_dim, in_dim)?;
        check_len(
            "int4-g128 codes",
            checked_area("int4-g128 codes", out_dim, in_dim)?,
            codes.len(),
        )?;
        if let Some(index) = codes.iter().position(|&c| c > 15) {
            return Err(KernelError::BadScale {
                what: "int4-g128 code (above 15)",
                index,
                value: f32::from(codes[index]),
            });
        }
        let row_bytes = in_dim.div_ceil(2);
        let mut packed = vec![0u8; out_dim * row_bytes];
        for (dst, src) in packed.chunks_mut(row_bytes).zip(codes.chunks(in_dim)) {
            for (d, pair) in dst.iter_mut().zip(src.chunks(2)) {
                *d = pair[0] | pair.get(1).map_or(0, |hi| hi << 4);
            }
        }
        Self::new(out_dim, in_dim, packed, scales, zeros)
    }

    /// Packed codes `[out_dim, ceil(in_dim / 2)]`.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// Scales `[out_dim, ceil(in_dim / 128)]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Zero points `[out_dim, ceil(in_dim / 128)]`.
    pub fn zeros(&self) -> &[u8] {
        &self.zeros
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.in_dim.div_ceil(INT4_GROUP)
    }
}

/// A base weight in one of the supported storage formats.
#[derive(Clone, Debug)]
pub enum BaseWeight {
    /// Unquantized bf16.
    Bf16(Bf16Weight),
    /// FP8 E4M3 with 128x128 block scales.
    Fp8Block128(Fp8Block128Weight),
    /// NVFP4 (E2M1 + E4M3 per 16 + f32 global).
    Nvfp4(Nvfp4Weight),
    /// MXFP4 (E2M1 + E8M0 per 32).
    Mxfp4(Mxfp4Weight),
    /// INT4 with a scale and zero point per 128 inputs.
    Int4G128(Int4G128Weight),
}

impl BaseWeight {
    /// Output features.
    pub fn out_dim(&self) -> usize {
        match self {
            Self::Bf16(w) => w.out_dim,
            Self::Fp8Block128(w) => w.out_dim,
            Self::Nvfp4(w) => w.out_dim,
            Self::Mxfp4(w) => w.out_dim,
            Self::Int4G128(w) => w.out_dim,
        }
    }

    /// Input features.
    pub fn in_dim(&self) -> usize {
        match self {
            Self::Bf16(w) => w.in_dim,
            Self::Fp8Block128(w) => w.in_dim,
            Self::Nvfp4(w) => w.in_dim,
            Self::Mxfp4(w) => w.in_dim,
            Self::Int4G128(w) => w.in_dim,
        }
    }

    /// Short name of the format, as used in reports.
    pub fn format_name(&self) -> &'static str {
        match self {
            Self::Bf16(_) => "bf16",
            Self::Fp8Block128(_) => "fp8-block128",
            Self::Nvfp4(_) => "nvfp4",
            Self::Mxfp4(_) => "mxfp4",
            Self::Int4G128(_) => "int4-g128",
        }
    }

    /// Bytes a pass over the weight must read (codes plus scales): the numerator of
    /// "effective bandwidth".
    pub fn stored_bytes(&self) -> usize {
        match self {
            Self::Bf16(w) => w.data.len() * 2,
            Self::Fp8Block128(w) => w.codes.len() + w.scales.len() * 4,
            Self::Nvfp4(w) => w.packed.len() + w.block_scales.len() + 4,
            Self::Mxfp4(w) => w.packed.len() + w.block_scales.len(),
            Self::Int4G128(w) => w.packed.len() + w.scales.len() * 4 + w.zeros.len(),
        }
    }
}

impl TryFrom<loraq_quant::QuantizedWeight> for BaseWeight {
    type Error = KernelError;

    /// Takes a weight quantized (or loaded) by `loraq-quant`: fp8 with 128x128 tiles,
    /// NVFP4, MXFP4 and INT4 group 128 (codes packed two per byte here) have fused
    /// kernels; fp8 per tensor / per channel does not.
    /// An NVFP4 global scale stored as a divisor (compressed-tensors) becomes the
    /// multiplier `1 / d`, one extra rounding of the scale.
    fn try_from(weight: loraq_quant::QuantizedWeight) -> Result<Self> {
        use loraq_quant::{Fp8Granularity, Nvfp4GlobalScale, QuantizedWeight};
        match weight {
            QuantizedWeight::Fp8(w) if w.granularity == Fp8Granularity::Block128 => Ok(
                Self::Fp8Block128(Fp8Block128Weight::new(w.rows, w.cols, w.codes, w.scales)?),
            ),
            QuantizedWeight::Nvfp4(w) => {
                let global = match w.global_scale {
                    Nvfp4GlobalScale::Multiplier(g) => g,
                    Nvfp4GlobalScale::Divisor(d) => 1.0 / d,
                };
                Ok(Self::Nvfp4(Nvfp4Weight::new(
                    w.rows,
                    w.cols,
                    w.packed,
                    w.block_scales,
                    global,
                )?))
            }
            QuantizedWeight::Mxfp4(w) => Ok(Self::Mxfp4(Mxfp4Weight::new(
                w.rows, w.cols, w.packed, w.scales,
            )?)),
            QuantizedWeight::Fp8(w) => Err(KernelError::UnsupportedScheme {
                what: format!("fp8 with {:?} scales (only 128x128 blocks)", w.granularity),
            }),
            QuantizedWeight::Int4(w) => Ok(Self::Int4G128(Int4G128Weight::from_codes(
                w.rows, w.cols, &w.codes, w.scales, w.zeros,
            )?)),
        }
    }
}
