//! Weight quantization schemes: quantize, dequantize and fake-quant
//! (quantize then dequantize) of a weight matrix `[out, in]`, row-major, with the
//! exact formulas of `docs/quantization.md`.
//!
//! Every scheme refuses NaN and infinite weights, and every all-zero scaling group
//! gets a defined scale (1, or the smallest E8M0 scale for MXFP4), so no division by
//! zero ever happens.

use crate::error::{QuantError, Result};
use crate::format::{
    FP8_BLOCK, Fp8Granularity, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale,
    WeightFormat, blocks, fp8_scale, fp8_scale_shape, nvfp4_global_scale,
};
pub(crate) use crate::runs::abs_max_bits;
use crate::runs::{self, MXFP4_RUN, NVFP4_RUN};
use crate::weight::{
    Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight, pack_int4_rows,
};
use rayon::prelude::*;
use std::fmt;
use std::str::FromStr;

/// A weight quantization scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// FP8 E4M3 with one scale $a / 448$ for the whole tensor (largest magnitude $a$).
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
        self.format().in_features_multiple()
    }

    /// The stored format the scheme quantizes to.
    pub fn format(self) -> WeightFormat {
        match self {
            Self::Fp8Tensor => WeightFormat::Fp8(Fp8Granularity::Tensor),
            Self::Fp8Channel => WeightFormat::Fp8(Fp8Granularity::Channel),
            Self::Fp8Block128 => WeightFormat::Fp8(Fp8Granularity::Block128),
            Self::Nvfp4 => WeightFormat::Nvfp4,
            Self::Mxfp4 => WeightFormat::Mxfp4,
            Self::Int4G128Sym | Self::Int4G128Asym => WeightFormat::Int4G128,
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

    /// Fake-quant into `out` (`out_features * in_features` values), bit-identical to
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
                    .for_each(|(o, x)| runs::nvfp4_fake_quant_run(x, global, o));
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

/// A named, row-major `f32` weight matrix `[out_features = out features, in_features = in features]`.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// Tensor name, used in error messages.
    pub name: &'a str,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// `out_features * in_features` values.
    pub data: &'a [f32],
}

impl<'a> WeightView<'a> {
    /// A view after checking that `data` holds exactly `out_features * in_features` values.
    pub fn new(
        name: &'a str,
        out_features: usize,
        in_features: usize,
        data: &'a [f32],
    ) -> Result<Self> {
        if out_features.checked_mul(in_features) != Some(data.len()) {
            return Err(QuantError::ShapeMismatch {
                tensor: name.to_string(),
                out_features,
                in_features,
                len: data.len(),
            });
        }
        Ok(Self {
            name,
            out_features,
            in_features,
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
                row: index / self.in_features.max(1),
                col: index % self.in_features.max(1),
                value: self.data[index],
            });
        }
        Ok(f32::from_bits(max_bits))
    }

    fn require_multiple(&self, scheme: Scheme) -> Result<()> {
        let multiple = scheme.input_multiple();
        if !self.in_features.is_multiple_of(multiple) {
            return Err(QuantError::InputDimNotDivisible {
                tensor: self.name.to_string(),
                scheme: scheme.name(),
                multiple,
                in_features: self.in_features,
            });
        }
        Ok(())
    }
}

/// Quantizes to FP8 E4M3 with $s = a / 448$ per group of largest magnitude $a$ (1 for
/// all-zero groups) and $q = \mathrm{e4m3}(\mathrm{clamp}(x / s, -448, 448))$.
pub fn quantize_fp8(weight: WeightView<'_>, granularity: Fp8Granularity) -> Result<Fp8Weight> {
    let amax = weight.finite_abs_max()?;
    Ok(quantize_fp8_values(
        weight.data,
        weight.out_features,
        weight.in_features,
        amax,
        granularity,
    ))
}

/// A weight's row-major values as the quantizers read them, one run at a time: f32
/// in memory, or the bf16 of a checkpoint converted run by run (never the whole
/// matrix as f32).
trait Values: Sync {
    /// Calls `f` on values `start..start + len` as f32, converted into `scratch`
    /// where they are stored otherwise.
    fn with_run<R>(
        &self,
        start: usize,
        len: usize,
        scratch: &mut Vec<f32>,
        f: impl FnOnce(&[f32]) -> R,
    ) -> R;
}

impl Values for [f32] {
    fn with_run<R>(
        &self,
        start: usize,
        len: usize,
        _scratch: &mut Vec<f32>,
        f: impl FnOnce(&[f32]) -> R,
    ) -> R {
        f(&self[start..start + len])
    }
}

/// Little-endian bf16 values.
struct Bf16Values<'a>(&'a [u8]);

impl Values for Bf16Values<'_> {
    fn with_run<R>(
        &self,
        start: usize,
        len: usize,
        scratch: &mut Vec<f32>,
        f: impl FnOnce(&[f32]) -> R,
    ) -> R {
        scratch.resize(len, 0.0);
        runs::bf16_to_f32_run(&self.0[2 * start..2 * (start + len)], scratch);
        f(scratch)
    }
}

/// [`quantize_fp8`] of checked values whose largest magnitude is `amax`.
fn quantize_fp8_values<V: Values + ?Sized>(
    values: &V,
    out_features: usize,
    in_features: usize,
    amax: f32,
    granularity: Fp8Granularity,
) -> Fp8Weight {
    let mut codes = vec![0u8; out_features * in_features];
    let [scale_rows, scale_cols] = fp8_scale_shape(granularity, out_features, in_features);
    let mut scales = vec![0.0f32; scale_rows * scale_cols];
    if in_features == 0 || out_features == 0 {
        scales.fill(1.0);
        return Fp8Weight {
            out_features,
            in_features,
            granularity,
            codes,
            scales,
        };
    }
    match granularity {
        Fp8Granularity::Tensor => {
            let scale = fp8_scale(amax);
            scales[0] = scale;
            codes.par_chunks_mut(in_features).enumerate().for_each_init(
                Vec::new,
                |scratch, (row, c)| {
                    values.with_run(row * in_features, in_features, scratch, |x| {
                        runs::encode_fp8_run(x, scale, c)
                    })
                },
            );
        }
        Fp8Granularity::Channel => {
            codes
                .par_chunks_mut(in_features)
                .zip(scales.par_iter_mut())
                .enumerate()
                .for_each_init(Vec::new, |scratch, (row, (c, s))| {
                    values.with_run(row * in_features, in_features, scratch, |x| {
                        *s = fp8_scale(f32::from_bits(abs_max_bits(x)));
                        runs::encode_fp8_run(x, *s, c);
                    })
                });
        }
        Fp8Granularity::Block128 => {
            codes
                .par_chunks_mut(FP8_BLOCK * in_features)
                .zip(scales.par_chunks_mut(scale_cols))
                .enumerate()
                .for_each_init(Vec::new, |scratch, (band, (c, s))| {
                    let start = band * FP8_BLOCK * in_features;
                    values.with_run(start, c.len(), scratch, |x| {
                        s.copy_from_slice(&fp8_tile_scales(x, in_features, scale_cols));
                        for (code_row, row) in c.chunks_mut(in_features).zip(x.chunks(in_features))
                        {
                            for ((code_run, run), &scale) in code_row
                                .chunks_mut(FP8_BLOCK)
                                .zip(row.chunks(FP8_BLOCK))
                                .zip(s.iter())
                            {
                                runs::encode_fp8_run(run, scale, code_run);
                            }
                        }
                    })
                });
        }
    }
    Fp8Weight {
        out_features,
        in_features,
        granularity,
        codes,
        scales,
    }
}

/// A weight matrix stored as little-endian bf16 (a checkpoint's bytes), quantized by
/// [`Scheme::quantize_bf16`] without an f32 copy of the whole matrix.
#[derive(Clone, Copy, Debug)]
pub struct Bf16WeightView<'a> {
    /// Tensor name, used in error messages.
    pub name: &'a str,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// `2 * out_features * in_features` bytes.
    pub bytes: &'a [u8],
}

impl<'a> Bf16WeightView<'a> {
    /// A view after checking that `bytes` holds exactly `out_features * in_features`
    /// bf16 values.
    pub fn new(
        name: &'a str,
        out_features: usize,
        in_features: usize,
        bytes: &'a [u8],
    ) -> Result<Self> {
        if out_features
            .checked_mul(in_features)
            .and_then(|n| n.checked_mul(2))
            != Some(bytes.len())
        {
            return Err(QuantError::ShapeMismatch {
                tensor: name.to_string(),
                out_features,
                in_features,
                len: bytes.len() / 2,
            });
        }
        Ok(Self {
            name,
            out_features,
            in_features,
            bytes,
        })
    }

    /// The index and value of the first NaN or infinite entry, if any (in parallel:
    /// one pass at memory speed when there is none).
    pub fn first_non_finite(&self) -> Option<(usize, f32)> {
        if self.abs_max_bits() < 0x7F80_0000 {
            return None;
        }
        let values = Bf16Values(self.bytes);
        let mut scratch = Vec::new();
        let len = self.bytes.len() / 2;
        (0..len).step_by(1 << 16).find_map(|start| {
            let run = (1 << 16).min(len - start);
            values.with_run(start, run, &mut scratch, |x| {
                x.iter()
                    .position(|v| !v.is_finite())
                    .map(|i| (start + i, x[i]))
            })
        })
    }

    fn abs_max_bits(&self) -> u32 {
        self.bytes
            .par_chunks(1 << 17)
            .map(runs::bf16_abs_max_bits)
            .max()
            .unwrap_or(0)
    }

    /// The largest magnitude, or the first non-finite entry as an error (as
    /// [`WeightView::finite_abs_max`] on the values converted to f32).
    pub fn finite_abs_max(&self) -> Result<f32> {
        let max_bits = self.abs_max_bits();
        if max_bits >= 0x7F80_0000 {
            let (index, value) = self.first_non_finite().expect("a non-finite entry exists");
            return Err(QuantError::NonFinite {
                tensor: self.name.to_string(),
                row: index / self.in_features.max(1),
                col: index % self.in_features.max(1),
                value,
            });
        }
        Ok(f32::from_bits(max_bits))
    }

    /// The values as f32 (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.bytes.len() / 2];
        out.par_chunks_mut(1 << 16)
            .zip(self.bytes.par_chunks(2 << 16))
            .for_each(|(o, b)| runs::bf16_to_f32_run(b, o));
        out
    }
}

impl Scheme {
    /// [`Scheme::quantize`] of bf16 values, bit-identical to it on the values converted
    /// to f32: FP8 and NVFP4 convert run by run inside the quantizer (no f32 copy of the
    /// matrix: a third of the memory traffic), the other schemes convert the whole
    /// matrix first.
    pub fn quantize_bf16(self, weight: Bf16WeightView<'_>) -> Result<QuantizedWeight> {
        let values = Bf16Values(weight.bytes);
        let (out_features, in_features) = (weight.out_features, weight.in_features);
        match self.format() {
            WeightFormat::Fp8(Fp8Granularity::Block128) => quantize_fp8_bf16_block128(weight),
            WeightFormat::Fp8(granularity) => {
                let amax = weight.finite_abs_max()?;
                Ok(QuantizedWeight::Fp8(quantize_fp8_values(
                    &values,
                    out_features,
                    in_features,
                    amax,
                    granularity,
                )))
            }
            WeightFormat::Nvfp4 => {
                if in_features % NVFP4_BLOCK != 0 {
                    return Err(QuantError::InputDimNotDivisible {
                        tensor: weight.name.to_string(),
                        scheme: self.name(),
                        multiple: NVFP4_BLOCK,
                        in_features,
                    });
                }
                let amax = weight.finite_abs_max()?;
                let global = nvfp4_global_scale(amax);
                Ok(QuantizedWeight::Nvfp4(quantize_nvfp4_values(
                    &values,
                    out_features,
                    in_features,
                    global,
                )))
            }
            _ => {
                let data = weight.to_f32();
                self.quantize(WeightView::new(
                    weight.name,
                    out_features,
                    in_features,
                    &data,
                )?)
            }
        }
    }
}

/// FP8 with 128x128 tile scales of bf16 values read in place, one fused pass per band
/// of 128 rows (tile scales, then codes) on every core and no pass over the whole
/// matrix before it: a NaN or an infinity shows in its tile's largest magnitude, and
/// is then reported as [`WeightView::finite_abs_max`] reports it.
fn quantize_fp8_bf16_block128(weight: Bf16WeightView<'_>) -> Result<QuantizedWeight> {
    let (out_features, in_features) = (weight.out_features, weight.in_features);
    let granularity = Fp8Granularity::Block128;
    let mut codes = vec![0u8; out_features * in_features];
    let [scale_rows, scale_cols] = fp8_scale_shape(granularity, out_features, in_features);
    let mut scales = vec![1.0f32; scale_rows * scale_cols];
    if in_features > 0 && out_features > 0 {
        let max_bits = codes
            .par_chunks_mut(FP8_BLOCK * in_features)
            .zip(scales.par_chunks_mut(scale_cols))
            .zip(weight.bytes.par_chunks(2 * FP8_BLOCK * in_features))
            .map(|((c, s), band)| runs::fp8_bf16_band(band, in_features, FP8_BLOCK, s, c))
            .max()
            .unwrap_or(0);
        if max_bits >= 0x7F80_0000 {
            weight.finite_abs_max()?;
        }
    }
    Ok(QuantizedWeight::Fp8(Fp8Weight {
        out_features,
        in_features,
        granularity,
        codes,
        scales,
    }))
}

/// Fused FP8 fake-quant: the scales of [`quantize_fp8`], then
/// `out = e4m3_value(e4m3(x / s)) * s` without storing codes.
fn fake_quant_fp8(
    weight: WeightView<'_>,
    granularity: Fp8Granularity,
    out: &mut [f32],
) -> Result<()> {
    let amax = weight.finite_abs_max()?;
    let in_features = weight.in_features;
    if in_features == 0 || weight.out_features == 0 {
        return Ok(());
    }
    match granularity {
        Fp8Granularity::Tensor => {
            let scale = fp8_scale(amax);
            out.par_chunks_mut(in_features)
                .zip(weight.data.par_chunks(in_features))
                .for_each(|(o, x)| runs::fake_quant_fp8_run(x, scale, o));
        }
        Fp8Granularity::Channel => {
            out.par_chunks_mut(in_features)
                .zip(weight.data.par_chunks(in_features))
                .for_each(|(o, x)| {
                    let scale = fp8_scale(f32::from_bits(abs_max_bits(x)));
                    runs::fake_quant_fp8_run(x, scale, o);
                });
        }
        Fp8Granularity::Block128 => {
            let scale_cols = blocks(in_features, FP8_BLOCK);
            out.par_chunks_mut(FP8_BLOCK * in_features)
                .zip(weight.data.par_chunks(FP8_BLOCK * in_features))
                .for_each(|(o, x)| {
                    let scales = fp8_tile_scales(x, in_features, scale_cols);
                    for (out_row, row) in o.chunks_mut(in_features).zip(x.chunks(in_features)) {
                        for ((out_run, run), &scale) in out_row
                            .chunks_mut(FP8_BLOCK)
                            .zip(row.chunks(FP8_BLOCK))
                            .zip(&scales)
                        {
                            runs::fake_quant_fp8_run(run, scale, out_run);
                        }
                    }
                });
        }
    }
    Ok(())
}

/// Scales of the 128x128 tiles of one band of up to 128 rows.
fn fp8_tile_scales(band: &[f32], in_features: usize, scale_cols: usize) -> Vec<f32> {
    let mut amax_bits = vec![0u32; scale_cols];
    for row in band.chunks(in_features) {
        for (m, run) in amax_bits.iter_mut().zip(row.chunks(FP8_BLOCK)) {
            *m = (*m).max(abs_max_bits(run));
        }
    }
    amax_bits
        .into_iter()
        .map(|m| fp8_scale(f32::from_bits(m)))
        .collect()
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
    quantize_nvfp4_values(weight.data, weight.out_features, weight.in_features, global)
}

/// [`quantize_nvfp4_with_global`] of any [`Values`].
fn quantize_nvfp4_values<V: Values + ?Sized>(
    values: &V,
    out_features: usize,
    in_features: usize,
    global: f32,
) -> Nvfp4Weight {
    let len = out_features * in_features;
    let mut packed = vec![0u8; len / 2];
    let mut block_scales = vec![0u8; len / NVFP4_BLOCK];
    packed
        .par_chunks_mut(NVFP4_RUN / 2)
        .zip(block_scales.par_chunks_mut(NVFP4_RUN / NVFP4_BLOCK))
        .enumerate()
        .for_each_init(Vec::new, |scratch, (run, (p, s))| {
            values.with_run(run * NVFP4_RUN, 2 * p.len(), scratch, |x| {
                runs::nvfp4_quantize_run(x, global, p, s)
            })
        });
    Nvfp4Weight {
        out_features,
        in_features,
        packed,
        block_scales,
        global_scale: Nvfp4GlobalScale::Multiplier(global),
    }
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
        .for_each(|((p, s), x)| runs::mxfp4_quantize_run(x, p, s));
    Ok(Mxfp4Weight {
        out_features: weight.out_features,
        in_features: weight.in_features,
        packed,
        scales,
    })
}

/// Scale and zero point of one INT4 group (GPTQ's `find_params`):
/// symmetric $s = 2 a / 15$, $z = 8$ (largest magnitude $a$); asymmetric over
/// $[\min(x, 0), \max(x, 0)]$, $s = (\max - \min) / 15$, $z = \mathrm{round}(-\min / s)$.
/// An all-zero group gets $s = 1$, $z = 8$.
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
    let (out_features, in_features) = (weight.out_features, weight.in_features);
    let groups = blocks(in_features, INT4_GROUP);
    let mut codes = vec![0u8; weight.data.len()];
    let mut scales = vec![1.0f32; out_features * groups];
    let mut zeros = vec![8u8; out_features * groups];
    if in_features > 0 {
        codes
            .par_chunks_mut(in_features)
            .zip(weight.data.par_chunks(in_features))
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
                    runs::int4_encode_run(run, *s, *z, code_run);
                }
            });
    }
    let packed = pack_int4_rows(out_features, in_features, &codes);
    Ok(Int4Weight {
        out_features,
        in_features,
        symmetric,
        packed,
        scales,
        zeros,
    })
}
