//! Weight formats: what each stored format is (its block geometry, declared once
//! here), the NVFP4 global scale and the scale codes of every block format.
//!
//! Only element facts ([`crate::element`]) are used here; the quantization schemes,
//! the weight containers and the hot loops all build on this module, never the
//! other way round.

use crate::element::{E4M3_MAX, E4M3_MIN_SUBNORMAL, e4m3_encode};
use crate::ggml::GgmlType;
use std::fmt;

/// A stored weight format: the element encoding and where its scales apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Unquantized bf16 (a plain checkpoint's weights).
    Bf16,
    /// FP8 E4M3 with a scale per tensor, output row or 128x128 tile.
    Fp8(Fp8Granularity),
    /// NVFP4: E2M1 elements, an E4M3 scale per 16 inputs, an f32 global scale.
    Nvfp4,
    /// MXFP4 (OCP MX): E2M1 elements, an E8M0 scale per 32 inputs.
    Mxfp4,
    /// 4-bit integers with an f32 scale and a zero point per 128 inputs.
    Int4G128,
    /// A ggml type of a GGUF file (llama.cpp): Q8_0, Q4_K, IQ4_XS, ... in ggml's
    /// block layout ([`crate::ggml`]).
    Ggml(GgmlType),
}

/// The region one scale covers: `out` rows by `in` inputs, `None` for the whole
/// dimension. Partial blocks at the edges have their own scale where the format
/// allows them (fp8 tiles, INT4 groups); NVFP4 and MXFP4 have none
/// ([`WeightFormat::in_features_multiple`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScaleBlock {
    /// Output rows per scale (`None`: every row).
    pub out: Option<usize>,
    /// Inputs per scale (`None`: the whole row).
    pub inputs: Option<usize>,
}

impl WeightFormat {
    /// Every format the crate stores, fp8 in each granularity.
    pub const ALL: [WeightFormat; 7] = [
        Self::Bf16,
        Self::Fp8(Fp8Granularity::Tensor),
        Self::Fp8(Fp8Granularity::Channel),
        Self::Fp8(Fp8Granularity::Block128),
        Self::Nvfp4,
        Self::Mxfp4,
        Self::Int4G128,
    ];

    /// Short name (`bf16`, `fp8-block128`, `nvfp4`, ...), as in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8(Fp8Granularity::Tensor) => "fp8-tensor",
            Self::Fp8(Fp8Granularity::Channel) => "fp8-channel",
            Self::Fp8(Fp8Granularity::Block128) => "fp8-block128",
            Self::Nvfp4 => "nvfp4",
            Self::Mxfp4 => "mxfp4",
            Self::Int4G128 => "int4-g128",
            Self::Ggml(t) => t.name(),
        }
    }

    /// The region one scale covers (`None` for bf16, which has no scales).
    pub fn scale_block(self) -> Option<ScaleBlock> {
        let block = |out, inputs| Some(ScaleBlock { out, inputs });
        match self {
            Self::Bf16 => None,
            Self::Fp8(Fp8Granularity::Tensor) => block(None, None),
            Self::Fp8(Fp8Granularity::Channel) => block(Some(1), None),
            Self::Fp8(Fp8Granularity::Block128) => block(Some(FP8_BLOCK), Some(FP8_BLOCK)),
            Self::Nvfp4 => block(Some(1), Some(NVFP4_BLOCK)),
            Self::Mxfp4 => block(Some(1), Some(MXFP4_BLOCK)),
            Self::Int4G128 => block(Some(1), Some(INT4_GROUP)),
            Self::Ggml(t) if t.is_quantized() => block(Some(1), Some(t.block().elements)),
            Self::Ggml(_) => None,
        }
    }

    /// Multiple the input dimension must have: the scale block of NVFP4 (16) and
    /// MXFP4 (32), the block of a ggml type (32 or 256), whose layouts have no
    /// partial block; 1 for the others.
    pub fn in_features_multiple(self) -> usize {
        match self {
            Self::Nvfp4 => NVFP4_BLOCK,
            Self::Mxfp4 => MXFP4_BLOCK,
            Self::Ggml(t) => t.block().elements,
            _ => 1,
        }
    }

    /// Elements stored per byte of codes: 2 for the 4-bit formats, 1 for fp8; bf16
    /// takes 2 bytes per element and reports 0, as do the ggml types (whose codes,
    /// scales and high bits share each block; [`GgmlType::block`] has their size).
    pub fn elements_per_byte(self) -> usize {
        match self {
            Self::Bf16 | Self::Ggml(_) => 0,
            Self::Fp8(_) => 1,
            Self::Nvfp4 | Self::Mxfp4 | Self::Int4G128 => 2,
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rows and columns of an FP8 block-scaling tile (DeepSeek / Qwen FP8 checkpoints).
pub const FP8_BLOCK: usize = 128;

/// Elements per NVFP4 block scale, along the input dimension.
pub const NVFP4_BLOCK: usize = 16;

/// Elements per MXFP4 block scale, along the input dimension.
pub const MXFP4_BLOCK: usize = 32;

/// Elements per INT4 group, along the input dimension.
pub const INT4_GROUP: usize = 128;

/// `6 * 448`: the largest E2M1 value times the largest E4M3 value, the NVFP4
/// global-scale denominator.
pub const NVFP4_GLOBAL_DENOMINATOR: f32 = 2688.0;

/// Granularity of FP8 scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Granularity {
    /// One scale.
    Tensor,
    /// One scale per output row.
    Channel,
    /// One scale per 128x128 tile; partial tiles at the edges have their own scale.
    Block128,
}

/// Number of `block`-wide blocks covering `len` (the last one may be partial).
pub fn blocks(len: usize, block: usize) -> usize {
    len.div_ceil(block)
}

/// The FP8 scale of a group with largest magnitude $a$ (`amax`): $a / 448$, or 1 for an
/// all-zero group.
#[inline(always)]
pub fn fp8_scale(amax: f32) -> f32 {
    if amax == 0.0 { 1.0 } else { amax / E4M3_MAX }
}

/// Scale-tensor shape of an FP8 weight of the given granularity.
pub fn fp8_scale_shape(
    granularity: Fp8Granularity,
    out_features: usize,
    in_features: usize,
) -> [usize; 2] {
    match granularity {
        Fp8Granularity::Tensor => [1, 1],
        Fp8Granularity::Channel => [out_features, 1],
        Fp8Granularity::Block128 => [
            blocks(out_features, FP8_BLOCK),
            blocks(in_features, FP8_BLOCK),
        ],
    }
}

/// Direction of an NVFP4 global scale as stored in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Nvfp4GlobalScale {
    /// ModelOpt `weight_scale_2 = amax / 2688`: multiply to dequantize.
    Multiplier(f32),
    /// compressed-tensors `weight_global_scale = 2688 / amax`: divide to dequantize.
    Divisor(f32),
}

impl Nvfp4GlobalScale {
    /// The value of E2M1 element `element` (a value from the E2M1 table) in a block
    /// whose E4M3 scale is `block_scale`, in the order each producer's own
    /// dequantization computes it (checked against both libraries' output):
    /// ModelOpt `element * (block_scale * g)` (the divisor quantization used), with
    /// code 8 (-0) read as +0 as ModelOpt's value table has it (the `+ 0.0`);
    /// compressed-tensors `element * (block_scale / d)`, code 8 giving -0.
    #[inline(always)]
    pub fn dequantize(self, element: f32, block_scale: f32) -> f32 {
        match self {
            Self::Multiplier(g) => element * (block_scale * g) + 0.0,
            Self::Divisor(d) => element * (block_scale / d),
        }
    }
}

/// The canonical NVFP4 global scale in the dequantization direction,
/// $g = a / (6 \cdot 448)$ for the tensor's largest magnitude $a$, or 1 for an all-zero
/// tensor.
#[inline(always)]
pub fn nvfp4_global_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        1.0
    } else {
        amax / NVFP4_GLOBAL_DENOMINATOR
    }
}

/// The E4M3 code of the NVFP4 scale of a 16-block with largest magnitude `amax_block`
/// $a_b$ under global scale $g$: $\mathrm{e4m3}(\mathrm{clamp}(a_b / (6 g), 2^{-9}, 448))$, or
/// the code of 1.0 when the block is all zero.
#[inline(always)]
pub fn nvfp4_block_scale_code(amax_block: f32, global: f32) -> u8 {
    if amax_block == 0.0 {
        return e4m3_encode(1.0);
    }
    let ratio = amax_block / (6.0 * global);
    e4m3_encode(ratio.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
}

/// The E8M0 code of the MXFP4 scale `2^(floor(log2 amax) - 2)` of a block, clamped to
/// the E8M0 range; an all-zero block (`log2 0 = -inf`) gets the smallest scale,
/// code 0, as the OCP reference implementation does.
#[inline(always)]
pub fn mxfp4_scale_code(amax_block: f32) -> u8 {
    // floor(log2 amax) = biased exponent - 127 for normal f32; subnormals and zero
    // land below -127 after the "- 2" and clamp to code 0.
    let biased_exponent = amax_block.to_bits() >> 23;
    biased_exponent.saturating_sub(2).min(254) as u8
}
