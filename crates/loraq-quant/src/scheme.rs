//! Weight quantization schemes: quantize, dequantize and fake-quant
//! (quantize then dequantize) of a weight matrix `[out, in]`, row-major, with the
//! exact formulas of `docs/quantization.md`.
//!
//! Every scheme refuses NaN and infinite weights, and every all-zero scaling group
//! gets a defined scale (1, or the smallest E8M0 scale for MXFP4), so no division by
//! zero ever happens.

use crate::element::{E4M3_MAX, E4M3_MIN_SUBNORMAL, e4m3_encode};
use crate::error::{QuantError, Result};
use crate::kernels;
pub(crate) use crate::kernels::abs_max_bits;
use rayon::prelude::*;
use std::fmt;
use std::str::FromStr;

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
/// Values per parallel work item of the NVFP4 kernels (whole blocks, so a run never
/// splits a block; rows do not matter since blocks never cross rows).
const NVFP4_RUN: usize = NVFP4_BLOCK * 256;
/// Values per parallel work item of the MXFP4 kernels.
const MXFP4_RUN: usize = MXFP4_BLOCK * 128;

/// A weight quantization scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// FP8 E4M3 with one scale `amax / 448` for the whole tensor.
    Fp8Tensor,
    /// FP8 E4M3 with one scale per output row.
    Fp8Channel,
    /// FP8 E4M3 with one scale per 128x128 tile (DeepSeek / Qwen layout).
    Fp8Block128,
    /// NVFP4: E2M1 elements, E4M3 scale per 16 inputs, f32 global scale (ModelOpt).
    Nvfp4,
    /// MXFP4 (OCP MX): E2M1 elements, E8M0 scale per 32 inputs.
    Mxfp4,
    /// 4-bit integers, symmetric, scale per 128 inputs (GPTQ `sym=True` formula).
    Int4G128Sym,
    /// 4-bit integers with a zero point, per 128 inputs (GPTQ `sym=False` formula).
    Int4G128Asym,
}

impl Scheme {
    /// Every scheme.
    pub const ALL: [Scheme; 7] = [
        Self::Fp8Tensor,
        Self::Fp8Channel,
        Self::Fp8Block128,
        Self::Nvfp4,
        Self::Mxfp4,
        Self::Int4G128Sym,
        Self::Int4G128Asym,
    ];

    /// The scheme's command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp8Tensor => "fp8-tensor",
            Self::Fp8Channel => "fp8-channel",
            Self::Fp8Block128 => "fp8-block128",
            Self::Nvfp4 => "nvfp4",
            Self::Mxfp4 => "mxfp4",
            Self::Int4G128Sym => "int4-g128-sym",
            Self::Int4G128Asym => "int4-g128-asym",
        }
    }

    /// Multiple the input dimension must have (1 if any).
    pub fn input_multiple(self) -> usize {
        match self {
            Self::Nvfp4 => NVFP4_BLOCK,
            Self::Mxfp4 => MXFP4_BLOCK,
            _ => 1,
        }
    }

    /// Quantizes `weight` with this scheme.
    pub fn quantize(self, weight: WeightView<'_>) -> Result<QuantizedWeight> {
        Ok(match self {
            Self::Fp8Tensor => QuantizedWeight::Fp8(quantize_fp8(weight, Fp8Granularity::Tensor)?),
            Self::Fp8Channel => {
                QuantizedWeight::Fp8(quantize_fp8(weight, Fp8Granularity::Channel)?)
            }
            Self::Fp8Block128 => {
                QuantizedWeight::Fp8(quantize_fp8(weight, Fp8Granularity::Block128)?)
            }
            Self::Nvfp4 => QuantizedWeight::Nvfp4(quantize_nvfp4(weight)?),
            Self::Mxfp4 => QuantizedWeight::Mxfp4(quantize_mxfp4(weight)?),
            Self::Int4G128Sym => QuantizedWeight::Int4(quantize_int4(weight, true)?),
            Self::Int4G128Asym => QuantizedWeight::Int4(quantize_int4(weight, false)?),
        })
    }

    /// Fake-quant: the dequantized values of [`Scheme::quantize`], `[out * in]` f32.
    pub fn fake_quant(self, weight: WeightView<'_>) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; weight.data.len()];
        self.fake_quant_into(weight, &mut out)?;
        Ok(out)
    }

    /// Fake-quant into `out` (`rows * cols` values), bit-identical to
    /// `quantize(weight)?.dequantize()`; FP8 and NVFP4 run fused, without storing codes.
    ///
    /// # Panics
    /// If `out.len() != weight.data.len()`.
    pub fn fake_quant_into(self, weight: WeightView<'_>, out: &mut [f32]) -> Result<()> {
        assert_eq!(
            out.len(),
            weight.data.len(),
            "fake_quant_into: length mismatch"
        );
        match self {
            Self::Fp8Tensor => fake_quant_fp8(weight, Fp8Granularity::Tensor, out),
            Self::Fp8Channel => fake_quant_fp8(weight, Fp8Granularity::Channel, out),
            Self::Fp8Block128 => fake_quant_fp8(weight, Fp8Granularity::Block128, out),
            Self::Nvfp4 => {
                weight.require_multiple(Self::Nvfp4)?;
                let global = nvfp4_global_scale(weight.finite_abs_max()?);
                out.par_chunks_mut(NVFP4_RUN)
                    .zip(weight.data.par_chunks(NVFP4_RUN))
                    .for_each(|(o, x)| kernels::nvfp4_fake_quant_run(x, global, o));
                Ok(())
            }
            Self::Mxfp4 | Self::Int4G128Sym | Self::Int4G128Asym => {
                let dequantized = self.quantize(weight)?.dequantize();
                out.copy_from_slice(&dequantized);
                Ok(())
            }
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scheme {
    type Err = QuantError;

    /// Parses a scheme name; `int4-g128` is accepted for `int4-g128-sym`.
    fn from_str(name: &str) -> Result<Self> {
        if name == "int4-g128" {
            return Ok(Self::Int4G128Sym);
        }
        Self::ALL
            .into_iter()
            .find(|scheme| scheme.name() == name)
            .ok_or_else(|| QuantError::UnknownScheme {
                name: name.to_string(),
                known: Self::ALL.map(Scheme::name).join(", "),
            })
    }
}

/// A named, row-major `f32` weight matrix `[rows = out features, cols = in features]`.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// Tensor name, used in error messages.
    pub name: &'a str,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `rows * cols` values.
    pub data: &'a [f32],
}

impl<'a> WeightView<'a> {
    /// A view after checking that `data` holds exactly `rows * cols` values.
    pub fn new(name: &'a str, rows: usize, cols: usize, data: &'a [f32]) -> Result<Self> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(QuantError::ShapeMismatch {
                tensor: name.to_string(),
                rows,
                cols,
                len: data.len(),
            });
        }
        Ok(Self {
            name,
            rows,
            cols,
            data,
        })
    }

    /// The largest magnitude, or the first non-finite entry as an error.
    pub fn finite_abs_max(&self) -> Result<f32> {
        let max_bits = self
            .data
            .par_chunks(1 << 16)
            .map(abs_max_bits)
            .max()
            .unwrap_or(0);
        if max_bits >= 0x7F80_0000 {
            let index = self
                .data
                .iter()
                .position(|x| !x.is_finite())
                .expect("a non-finite entry exists");
            return Err(QuantError::NonFinite {
                tensor: self.name.to_string(),
                row: index / self.cols.max(1),
                col: index % self.cols.max(1),
                value: self.data[index],
            });
        }
        Ok(f32::from_bits(max_bits))
    }

    fn require_multiple(&self, scheme: Scheme) -> Result<()> {
        let multiple = scheme.input_multiple();
        if self.cols % multiple != 0 {
            return Err(QuantError::InputDimNotDivisible {
                tensor: self.name.to_string(),
                scheme: scheme.name(),
                multiple,
                cols: self.cols,
            });
        }
        Ok(())
    }
}

/// A quantized weight of any scheme.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantizedWeight {
    /// FP8 E4M3, per tensor, channel or 128x128 tile.
    Fp8(Fp8Weight),
    /// NVFP4.
    Nvfp4(Nvfp4Weight),
    /// MXFP4.
    Mxfp4(Mxfp4Weight),
    /// INT4, group 128.
    Int4(Int4Weight),
}

impl QuantizedWeight {
    /// The dequantized matrix, `[rows * cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            Self::Fp8(w) => w.dequantize(),
            Self::Nvfp4(w) => w.dequantize(),
            Self::Mxfp4(w) => w.dequantize(),
            Self::Int4(w) => w.dequantize(),
        }
    }

    /// `(rows, cols)` of the original matrix.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Fp8(w) => (w.rows, w.cols),
            Self::Nvfp4(w) => (w.rows, w.cols),
            Self::Mxfp4(w) => (w.rows, w.cols),
            Self::Int4(w) => (w.rows, w.cols),
        }
    }
}

/// Granularity of FP8 scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Granularity {
    /// One scale.
    Tensor,
    /// One scale per output row.
    Channel,
    /// One scale per 128x128 tile; partial tiles at the edges have their own scale.
    Block128,
}

/// An FP8 E4M3 weight: `w[r, c] = e4m3(codes[r, c]) * scale(r, c)` with the scale in
/// the dequantization direction (what checkpoints call `weight_scale_inv` /
/// `weight_scale`).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Which scale applies where.
    pub granularity: Fp8Granularity,
    /// E4M3 codes, row-major `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Scales, row-major in [`Fp8Weight::scale_shape`].
    pub scales: Vec<f32>,
}

/// Number of `block`-wide blocks covering `len` (the last one may be partial).
pub fn blocks(len: usize, block: usize) -> usize {
    len.div_ceil(block)
}

/// The FP8 scale of a group with largest magnitude `amax`: `amax / 448`, or 1 for an
/// all-zero group.
#[inline(always)]
pub fn fp8_scale(amax: f32) -> f32 {
    if amax == 0.0 { 1.0 } else { amax / E4M3_MAX }
}

impl Fp8Weight {
    /// Shape of the scale tensor: `[1]`-like `[1, 1]`, `[rows, 1]` or
    /// `[ceil(rows/128), ceil(cols/128)]`.
    pub fn scale_shape(&self) -> [usize; 2] {
        fp8_scale_shape(self.granularity, self.rows, self.cols)
    }

    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.codes.len()];
        self.dequantize_into(&mut out);
        out
    }

    /// Dequantizes into `out` (`rows * cols` values).
    ///
    /// # Panics
    /// If `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        dequantize_fp8_into(&self.codes, &self.scales, self.granularity, self.cols, out);
    }
}

/// Dequantizes FP8 E4M3 codes stored anywhere (e.g. zero-copy from a checkpoint):
/// `out[r, c] = e4m3(codes[r, c]) * scale(r, c)`, with `scales` in the
/// dequantization direction, laid out as [`fp8_scale_shape`] says for `granularity`.
///
/// This is the decode of the fp8-block128 checkpoint layout (`weight` +
/// `weight_scale_inv`, despite the name a multiplier) and of per-tensor / per-channel
/// `weight_scale`.
///
/// # Panics
/// If `codes` and `out` differ in length, `cols` does not divide it, or `scales` is
/// shorter than the granularity needs.
pub fn dequantize_fp8_into(
    codes: &[u8],
    scales: &[f32],
    granularity: Fp8Granularity,
    cols: usize,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        codes.len(),
        "dequantize_fp8_into: length mismatch"
    );
    if cols == 0 || codes.is_empty() {
        return;
    }
    assert_eq!(codes.len() % cols, 0, "dequantize_fp8_into: ragged rows");
    let rows = codes.len() / cols;
    let [scale_rows, scale_cols] = fp8_scale_shape(granularity, rows, cols);
    assert!(
        scales.len() >= scale_rows * scale_cols,
        "dequantize_fp8_into: too few scales"
    );
    out.par_chunks_mut(cols)
        .zip(codes.par_chunks(cols))
        .enumerate()
        .for_each(|(row, (out_row, code_row))| {
            for (block, (out_block, code_block)) in out_row
                .chunks_mut(FP8_BLOCK)
                .zip(code_row.chunks(FP8_BLOCK))
                .enumerate()
            {
                let scale = match granularity {
                    Fp8Granularity::Tensor => scales[0],
                    Fp8Granularity::Channel => scales[row],
                    Fp8Granularity::Block128 => scales[(row / FP8_BLOCK) * scale_cols + block],
                };
                kernels::decode_fp8_run(code_block, scale, out_block);
            }
        });
}

/// Scale-tensor shape of an FP8 weight of the given granularity.
pub fn fp8_scale_shape(granularity: Fp8Granularity, rows: usize, cols: usize) -> [usize; 2] {
    match granularity {
        Fp8Granularity::Tensor => [1, 1],
        Fp8Granularity::Channel => [rows, 1],
        Fp8Granularity::Block128 => [blocks(rows, FP8_BLOCK), blocks(cols, FP8_BLOCK)],
    }
}

/// Quantizes to FP8 E4M3 with `s = amax / 448` per group (1 for all-zero groups) and
/// `q = e4m3(clamp(x / s, -448, 448))`.
pub fn quantize_fp8(weight: WeightView<'_>, granularity: Fp8Granularity) -> Result<Fp8Weight> {
    let amax = weight.finite_abs_max()?;
    let (rows, cols) = (weight.rows, weight.cols);
    let mut codes = vec![0u8; weight.data.len()];
    let [scale_rows, scale_cols] = fp8_scale_shape(granularity, rows, cols);
    let mut scales = vec![0.0f32; scale_rows * scale_cols];
    if cols == 0 || rows == 0 {
        scales.fill(1.0);
        return Ok(Fp8Weight {
            rows,
            cols,
            granularity,
            codes,
            scales,
        });
    }
    match granularity {
        Fp8Granularity::Tensor => {
            let scale = fp8_scale(amax);
            scales[0] = scale;
            codes
                .par_chunks_mut(cols)
                .zip(weight.data.par_chunks(cols))
                .for_each(|(c, x)| kernels::encode_fp8_run(x, scale, c));
        }
        Fp8Granularity::Channel => {
            codes
                .par_chunks_mut(cols)
                .zip(weight.data.par_chunks(cols))
                .zip(scales.par_iter_mut())
                .for_each(|((c, x), s)| {
                    *s = fp8_scale(f32::from_bits(abs_max_bits(x)));
                    kernels::encode_fp8_run(x, *s, c);
                });
        }
        Fp8Granularity::Block128 => {
            codes
                .par_chunks_mut(FP8_BLOCK * cols)
                .zip(weight.data.par_chunks(FP8_BLOCK * cols))
                .zip(scales.par_chunks_mut(scale_cols))
                .for_each(|((c, x), s)| {
                    s.copy_from_slice(&fp8_tile_scales(x, cols, scale_cols));
                    for (code_row, row) in c.chunks_mut(cols).zip(x.chunks(cols)) {
                        for ((code_run, run), &scale) in code_row
                            .chunks_mut(FP8_BLOCK)
                            .zip(row.chunks(FP8_BLOCK))
                            .zip(s.iter())
                        {
                            kernels::encode_fp8_run(run, scale, code_run);
                        }
                    }
                });
        }
    }
    Ok(Fp8Weight {
        rows,
        cols,
        granularity,
        codes,
        scales,
    })
}

/// Fused FP8 fake-quant: the scales of [`quantize_fp8`], then
/// `out = e4m3_value(e4m3(x / s)) * s` without storing codes.
fn fake_quant_fp8(
    weight: WeightView<'_>,
    granularity: Fp8Granularity,
    out: &mut [f32],
) -> Result<()> {
    let amax = weight.finite_abs_max()?;
    let cols = weight.cols;
    if cols == 0 || weight.rows == 0 {
        return Ok(());
    }
    match granularity {
        Fp8Granularity::Tensor => {
            let scale = fp8_scale(amax);
            out.par_chunks_mut(cols)
                .zip(weight.data.par_chunks(cols))
                .for_each(|(o, x)| kernels::fake_quant_fp8_run(x, scale, o));
        }
        Fp8Granularity::Channel => {
            out.par_chunks_mut(cols)
                .zip(weight.data.par_chunks(cols))
                .for_each(|(o, x)| {
                    let scale = fp8_scale(f32::from_bits(abs_max_bits(x)));
                    kernels::fake_quant_fp8_run(x, scale, o);
                });
        }
        Fp8Granularity::Block128 => {
            let scale_cols = blocks(cols, FP8_BLOCK);
            out.par_chunks_mut(FP8_BLOCK * cols)
                .zip(weight.data.par_chunks(FP8_BLOCK * cols))
                .for_each(|(o, x)| {
                    let scales = fp8_tile_scales(x, cols, scale_cols);
                    for (out_row, row) in o.chunks_mut(cols).zip(x.chunks(cols)) {
                        for ((out_run, run), &scale) in out_row
                            .chunks_mut(FP8_BLOCK)
                            .zip(row.chunks(FP8_BLOCK))
                            .zip(&scales)
                        {
                            kernels::fake_quant_fp8_run(run, scale, out_run);
                        }
                    }
                });
        }
    }
    Ok(())
}

/// Scales of the 128x128 tiles of one band of up to 128 rows.
fn fp8_tile_scales(band: &[f32], cols: usize, scale_cols: usize) -> Vec<f32> {
    let mut amax_bits = vec![0u32; scale_cols];
    for row in band.chunks(cols) {
        for (m, run) in amax_bits.iter_mut().zip(row.chunks(FP8_BLOCK)) {
            *m = (*m).max(abs_max_bits(run));
        }
    }
    amax_bits
        .into_iter()
        .map(|m| fp8_scale(f32::from_bits(m)))
        .collect()
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

/// An NVFP4 weight: `w[r, c] = e2m1(q[r, c]) * e4m3(block_scales[r, c / 16])`
/// combined with the global scale (see [`Nvfp4GlobalScale::dequantize`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Weight {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 16).
    pub cols: usize,
    /// E2M1 codes, two per byte, even element in the low nibble, `[rows, cols / 2]`.
    pub packed: Vec<u8>,
    /// E4M3 block-scale codes, `[rows, cols / 16]`.
    pub block_scales: Vec<u8>,
    /// Per-tensor scale.
    pub global_scale: Nvfp4GlobalScale,
}

/// The canonical NVFP4 global scale in the dequantization direction,
/// `g = amax / (6 * 448)`, or 1 for an all-zero tensor.
#[inline(always)]
pub fn nvfp4_global_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        1.0
    } else {
        amax / NVFP4_GLOBAL_DENOMINATOR
    }
}

/// The E4M3 code of the NVFP4 scale of a 16-block with largest magnitude `amax_block`
/// under global scale `g`: `e4m3(clamp(amax_block / (6 g), 2^-9, 448))`, or the code of
/// 1.0 when the block is all zero.
#[inline(always)]
pub fn nvfp4_block_scale_code(amax_block: f32, global: f32) -> u8 {
    if amax_block == 0.0 {
        return e4m3_encode(1.0);
    }
    let ratio = amax_block / (6.0 * global);
    e4m3_encode(ratio.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
}

/// Quantizes to NVFP4 with the canonical ModelOpt formula (see the module docs of
/// [`crate`] and `docs/quantization.md`). The input dimension must be a multiple
/// of 16.
pub fn quantize_nvfp4(weight: WeightView<'_>) -> Result<Nvfp4Weight> {
    weight.require_multiple(Scheme::Nvfp4)?;
    let amax = weight.finite_abs_max()?;
    let global = nvfp4_global_scale(amax);
    Ok(quantize_nvfp4_with_global(weight, global))
}

/// NVFP4 quantization under a given global scale (dequantization direction); the
/// weight must already be checked (finite, input dimension a multiple of 16).
pub(crate) fn quantize_nvfp4_with_global(weight: WeightView<'_>, global: f32) -> Nvfp4Weight {
    let (rows, cols) = (weight.rows, weight.cols);
    let mut packed = vec![0u8; weight.data.len() / 2];
    let mut block_scales = vec![0u8; weight.data.len() / NVFP4_BLOCK];
    packed
        .par_chunks_mut(NVFP4_RUN / 2)
        .zip(block_scales.par_chunks_mut(NVFP4_RUN / NVFP4_BLOCK))
        .zip(weight.data.par_chunks(NVFP4_RUN))
        .for_each(|((p, s), x)| kernels::nvfp4_quantize_run(x, global, p, s));
    Nvfp4Weight {
        rows,
        cols,
        packed,
        block_scales,
        global_scale: Nvfp4GlobalScale::Multiplier(global),
    }
}

impl Nvfp4Weight {
    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.packed.len() * 2];
        self.dequantize_into(&mut out);
        out
    }

    /// Dequantizes into `out` (`rows * cols` values).
    ///
    /// # Panics
    /// If `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        dequantize_nvfp4_into(&self.packed, &self.block_scales, self.global_scale, out);
    }
}

/// Dequantizes NVFP4 stored anywhere (e.g. zero-copy from a checkpoint):
/// `packed` holds two E2M1 codes per byte (even element in the low nibble),
/// `block_scales` one E4M3 code per 16 elements, row-major; each value is computed
/// by [`Nvfp4GlobalScale::dequantize`] (ModelOpt `weight_scale_2` multiplies,
/// compressed-tensors `weight_global_scale` divides).
///
/// # Panics
/// If `out.len() != 2 * packed.len()` or `block_scales.len() * 16 != out.len()`.
pub fn dequantize_nvfp4_into(
    packed: &[u8],
    block_scales: &[u8],
    global: Nvfp4GlobalScale,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        packed.len() * 2,
        "dequantize_nvfp4_into: length mismatch"
    );
    assert_eq!(
        block_scales.len() * NVFP4_BLOCK,
        out.len(),
        "dequantize_nvfp4_into: block scale count"
    );
    out.par_chunks_mut(NVFP4_RUN)
        .zip(packed.par_chunks(NVFP4_RUN / 2))
        .zip(block_scales.par_chunks(NVFP4_RUN / NVFP4_BLOCK))
        .for_each(|((o, p), s)| kernels::nvfp4_dequantize_run(p, s, global, o));
}

/// An MXFP4 weight: `w[r, c] = e2m1(q[r, c]) * e8m0(scales[r, c / 32])`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Weight {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// E2M1 codes, two per byte, even element in the low nibble, `[rows, cols / 2]`.
    pub packed: Vec<u8>,
    /// E8M0 scale codes, `[rows, cols / 32]`.
    pub scales: Vec<u8>,
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

/// Quantizes to MXFP4: per 32 inputs, `s = 2^(floor(log2 amax) - 2)` (E8M0) and
/// `q = e2m1(x / s)`, saturating at 6. The input dimension must be a multiple of 32.
pub fn quantize_mxfp4(weight: WeightView<'_>) -> Result<Mxfp4Weight> {
    weight.require_multiple(Scheme::Mxfp4)?;
    weight.finite_abs_max()?;
    let mut packed = vec![0u8; weight.data.len() / 2];
    let mut scales = vec![0u8; weight.data.len() / MXFP4_BLOCK];
    packed
        .par_chunks_mut(MXFP4_RUN / 2)
        .zip(scales.par_chunks_mut(MXFP4_RUN / MXFP4_BLOCK))
        .zip(weight.data.par_chunks(MXFP4_RUN))
        .for_each(|((p, s), x)| kernels::mxfp4_quantize_run(x, p, s));
    Ok(Mxfp4Weight {
        rows: weight.rows,
        cols: weight.cols,
        packed,
        scales,
    })
}

impl Mxfp4Weight {
    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.packed.len() * 2];
        out.par_chunks_mut(MXFP4_RUN)
            .zip(self.packed.par_chunks(MXFP4_RUN / 2))
            .zip(self.scales.par_chunks(MXFP4_RUN / MXFP4_BLOCK))
            .for_each(|((o, p), s)| kernels::mxfp4_dequantize_run(p, s, o));
        out
    }
}

/// A 4-bit integer weight, group 128 along the input dimension:
/// `w[r, c] = (q[r, c] - zero[r, g]) * scale[r, g]` with `g = c / 128`.
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Weight {
    /// Output features.
    pub rows: usize,
    /// Input features (the last group may be partial).
    pub cols: usize,
    /// Whether the zero point is fixed at 8 (symmetric).
    pub symmetric: bool,
    /// Unsigned codes `0..=15`, one per byte, `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Scales, `[rows, ceil(cols / 128)]`.
    pub scales: Vec<f32>,
    /// Zero points `0..=15`, `[rows, ceil(cols / 128)]`.
    pub zeros: Vec<u8>,
}

/// Scale and zero point of one INT4 group (GPTQ's `find_params`):
/// symmetric `s = 2 amax / 15`, `z = 8`; asymmetric over `[min(x, 0), max(x, 0)]`,
/// `s = (max - min) / 15`, `z = round(-min / s)`. An all-zero group gets `s = 1, z = 8`.
#[inline(always)]
pub fn int4_group_params(values: &[f32], symmetric: bool) -> (f32, u8) {
    if symmetric {
        let amax = f32::from_bits(abs_max_bits(values));
        if amax == 0.0 {
            return (1.0, 8);
        }
        ((amax + amax) / 15.0, 8)
    } else {
        let (min, max) = values
            .iter()
            .fold((0.0f32, 0.0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        if min == 0.0 && max == 0.0 {
            return (1.0, 8);
        }
        let scale = (max - min) / 15.0;
        let zero = (-min / scale).round_ties_even().clamp(0.0, 15.0);
        (scale, zero as u8)
    }
}

/// Quantizes to INT4 with group 128 along the input dimension,
/// `q = clamp(round_half_even(x / s) + z, 0, 15)`.
pub fn quantize_int4(weight: WeightView<'_>, symmetric: bool) -> Result<Int4Weight> {
    weight.finite_abs_max()?;
    let (rows, cols) = (weight.rows, weight.cols);
    let groups = blocks(cols, INT4_GROUP);
    let mut codes = vec![0u8; weight.data.len()];
    let mut scales = vec![1.0f32; rows * groups];
    let mut zeros = vec![8u8; rows * groups];
    if cols > 0 {
        codes
            .par_chunks_mut(cols)
            .zip(weight.data.par_chunks(cols))
            .zip(
                scales
                    .par_chunks_mut(groups)
                    .zip(zeros.par_chunks_mut(groups)),
            )
            .for_each(|((code_row, row), (scale_row, zero_row))| {
                for (((code_run, run), s), z) in code_row
                    .chunks_mut(INT4_GROUP)
                    .zip(row.chunks(INT4_GROUP))
                    .zip(scale_row.iter_mut())
                    .zip(zero_row.iter_mut())
                {
                    (*s, *z) = int4_group_params(run, symmetric);
                    kernels::int4_encode_run(run, *s, *z, code_run);
                }
            });
    }
    Ok(Int4Weight {
        rows,
        cols,
        symmetric,
        codes,
        scales,
        zeros,
    })
}

impl Int4Weight {
    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.codes.len()];
        if self.cols == 0 {
            return out;
        }
        let groups = blocks(self.cols, INT4_GROUP);
        out.par_chunks_mut(self.cols)
            .zip(self.codes.par_chunks(self.cols))
            .zip(
                self.scales
                    .par_chunks(groups)
                    .zip(self.zeros.par_chunks(groups)),
            )
            .for_each(|((out_row, code_row), (scale_row, zero_row))| {
                for (((o, c), &s), &z) in out_row
                    .chunks_mut(INT4_GROUP)
                    .zip(code_row.chunks(INT4_GROUP))
                    .zip(scale_row)
                    .zip(zero_row)
                {
                    kernels::int4_decode_run(c, s, z, o);
                }
            });
        out
    }
}
