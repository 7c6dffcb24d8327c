//! The rounding floor of a stored tensor and the residual a perfect low-rank fit
//! leaves against it.
//!
//! A merged weight stored in bf16 carries a rounding error of up to half a unit in the
//! last place per entry; modelled as uniform, its energy is
//! $F^2 = \sum_{ij} \mathrm{ulp}(m_{ij})^2 / 12$. No factorization of the delta can be
//! expected to do better than this noise allows, so every residual is reported over $F$.

use crate::error::{ExtractError, Result};
use crate::read::ShardFiles;
use loraq_io::{Checkpoint, DType};
use rayon::prelude::*;
use std::path::PathBuf;

/// The floating-point format whose rounding floor is measured: the merged tensor's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorFormat {
    /// bfloat16: 8 significand bits (7 stored), smallest normal $2^{-126}$.
    Bf16,
    /// IEEE half: 11 significand bits (10 stored), smallest normal $2^{-14}$.
    F16,
    /// IEEE single: 24 significand bits (23 stored), smallest normal $2^{-126}$.
    F32,
}

impl FloorFormat {
    /// The format of a stored tensor: f16 and f32 as themselves, everything else
    /// (bf16, and the quantized formats whose merge is bf16) as bf16.
    pub fn of(dtype: DType) -> FloorFormat {
        match dtype {
            DType::F16 => FloorFormat::F16,
            DType::F32 => FloorFormat::F32,
            _ => FloorFormat::Bf16,
        }
    }

    /// Number of stored significand bits.
    fn mantissa_bits(self) -> i32 {
        match self {
            FloorFormat::Bf16 => 7,
            FloorFormat::F16 => 10,
            FloorFormat::F32 => 23,
        }
    }

    /// Exponent of the smallest normal number.
    fn min_normal_exponent(self) -> i32 {
        match self {
            FloorFormat::Bf16 | FloorFormat::F32 => -126,
            FloorFormat::F16 => -14,
        }
    }

    /// Unit in the last place of a value `x` that is representable in this format:
    /// $2^{\lfloor \log_2 |x| \rfloor - p}$ for normals, $2^{e_{min} - p}$ for subnormals
    /// and zero (bf16: $2^{-133}$).
    pub fn ulp(self, x: f32) -> f64 {
        let p = self.mantissa_bits();
        let e_min = self.min_normal_exponent();
        let a = x.abs();
        let exponent = if a == 0.0 || !a.is_finite() {
            e_min
        } else {
            // The exact binary exponent of an f32 value, subnormals included.
            let e = exact_log2_floor(a);
            e.max(e_min)
        };
        // An exact power of two built from its exponent bits (normal in f64 for every
        // exponent these formats reach).
        f64::from_bits(((exponent - p + 1023) as u64) << 52)
    }
}

/// $\lfloor \log_2 a \rfloor$ for a positive finite f32, exact (read from the bits).
fn exact_log2_floor(a: f32) -> i32 {
    let bits = a.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    if biased == 0 {
        // f32 subnormal: value = mantissa * 2^-149.
        let mantissa = bits & 0x7f_ffff;
        let highest = 31 - mantissa.leading_zeros() as i32;
        highest - 149
    } else {
        biased - 127
    }
}

/// The rounding floor $F = \sqrt{\sum \mathrm{ulp}(m_{ij})^2 / 12}$ of a tensor whose
/// values (already widened to f32) are stored in `format`. Summed in f64.
pub fn rounding_floor(values: &[f32], format: FloorFormat) -> f64 {
    let sum: f64 = values
        .par_chunks(1 << 16)
        .map(|chunk| ulp_sq_sum(chunk, format))
        .sum();
    (sum / 12.0).sqrt()
}

/// The residual over the floor that a rank-`rank` truncated SVD of an `rows x cols`
/// delta leaves when the delta is (rank <= `rank`) + independent rounding noise:
/// $\sqrt{1 - r(m+n-r)/(mn)}$. The fit absorbs the noise in the $r(m+n-r)$ dimensions of
/// the rank-r manifold's tangent space; zero at full rank.
pub fn expected_floor_ratio(rows: usize, cols: usize, rank: usize) -> f64 {
    let (m, n) = (rows as f64, cols as f64);
    let r = rank.min(rows).min(cols) as f64;
    if m == 0.0 || n == 0.0 {
        return 0.0;
    }
    (1.0 - r * (m + n - r) / (m * n)).max(0.0).sqrt()
}

/// The stored bytes of one tensor in a merge and its base, read with positioned reads
/// (no growth of the resident set); [`PairBytes::delta`] turns them into the delta.
/// Reading is split from the arithmetic so the next module's bytes can be read while
/// this one is factored.
pub struct PairBytes {
    tensor: String,
    dtype: DType,
    merged: Vec<u8>,
    base: Vec<u8>,
    merged_path: PathBuf,
    base_path: PathBuf,
}

/// $D$, the floor of the merged tensor and $\\|D\\|_F^2$, from one pass.
#[derive(Debug)]
pub struct DeltaFigures {
    /// $D = \mathrm{f32}(\mathrm{merged}) - \mathrm{f32}(\mathrm{base})$, row-major.
    pub delta: Vec<f32>,
    /// The rounding floor of the merged tensor.
    pub floor: f64,
    /// $\\|D\\|_F^2$ in f64.
    pub norm_sq: f64,
}

/// Reads `tensor` from both checkpoints (shape and dtype checked equal).
pub fn read_pair(
    merged: &Checkpoint,
    base: &Checkpoint,
    merged_files: &ShardFiles,
    base_files: &ShardFiles,
    tensor: &str,
) -> Result<PairBytes> {
    let info = merged.info(tensor)?;
    let base_info = base.info(tensor)?;
    if base_info.dtype != info.dtype || base_info.shape != info.shape {
        return Err(ExtractError::BadShape {
            module: tensor.to_string(),
            what: format!(
                "base is {} {:?}, merged {} {:?}",
                base_info.dtype.as_str(),
                base_info.shape,
                info.dtype.as_str(),
                info.shape
            ),
        });
    }
    let merged_bytes = merged_files.read_tensor(info)?;
    let base_bytes = base_files.read_tensor(base_info)?;
    Ok(PairBytes {
        tensor: tensor.to_string(),
        dtype: info.dtype,
        merged: merged_bytes,
        base: base_bytes,
        merged_path: merged.shard_path(info.shard).to_path_buf(),
        base_path: base.shard_path(base_info.shard).to_path_buf(),
    })
}

impl PairBytes {
    /// A pair from bytes already read (`merged` and `base` little-endian values of
    /// `dtype`, the same number of each); the paths name the files in errors.
    pub fn from_bytes(
        tensor: &str,
        dtype: DType,
        merged: Vec<u8>,
        base: Vec<u8>,
        merged_path: PathBuf,
        base_path: PathBuf,
    ) -> Result<PairBytes> {
        if merged.len() != base.len() || merged.len() % dtype.size_bytes() != 0 {
            return Err(ExtractError::BadShape {
                module: tensor.to_string(),
                what: format!(
                    "merged has {} bytes, base {}, not the same whole number of {} values",
                    merged.len(),
                    base.len(),
                    dtype.as_str()
                ),
            });
        }
        Ok(PairBytes {
            tensor: tensor.to_string(),
            dtype,
            merged,
            base,
            merged_path,
            base_path,
        })
    }

    /// The tensor's name.
    pub fn tensor(&self) -> &str {
        &self.tensor
    }

    /// $D$, the floor and $\\|D\\|^2$ in one parallel pass; refuses a non-finite value
    /// in either input (named by the file holding it) and a difference that overflows
    /// f32 (two values of opposite sign near the format's largest).
    pub fn delta(&self) -> Result<DeltaFigures> {
        let dtype = self.dtype;
        let width = dtype.size_bytes();
        let format = FloorFormat::of(dtype);
        const CHUNK: usize = 1 << 14;
        let mut delta = vec![0f32; self.merged.len() / width];
        let partials = delta
            .par_chunks_mut(CHUNK)
            .zip(self.merged.par_chunks(CHUNK * width))
            .zip(self.base.par_chunks(CHUNK * width))
            .enumerate()
            .map_init(
                || (vec![0f32; CHUNK], vec![0f32; CHUNK]),
                |(m, b), (c, ((d, m_bytes), b_bytes))| {
                    let (m, b) = (&mut m[..d.len()], &mut b[..d.len()]);
                    decode_chunk(dtype, m_bytes, m);
                    decode_chunk(dtype, b_bytes, b);
                    // A branch-free test first (the largest exponent field: all ones
                    // only for infinities and NaN), the position only when it fails.
                    let bad = |x: &[f32]| {
                        let top = x
                            .iter()
                            .fold(0u32, |top, v| top.max(v.to_bits() & 0x7f80_0000));
                        if top == 0x7f80_0000 {
                            x.iter().position(|x| !x.is_finite()).map(|i| c * CHUNK + i)
                        } else {
                            None
                        }
                    };
                    let (bad_m, bad_b) = (bad(m), bad(b));
                    for ((d, &m), &b) in d.iter_mut().zip(m.iter()).zip(b.iter()) {
                        *d = m - b;
                    }
                    let floor_sq = ulp_sq_sum(m, format);
                    let norm_sq = sum_of_squares(d);
                    let bad_d = bad(d);
                    (bad_m, bad_b, bad_d, floor_sq, norm_sq)
                },
            )
            .reduce(
                || (None, None, None, 0.0, 0.0),
                |x, y| {
                    (
                        min_index(x.0, y.0),
                        min_index(x.1, y.1),
                        min_index(x.2, y.2),
                        x.3 + y.3,
                        x.4 + y.4,
                    )
                },
            );
        let (bad_merged, bad_base, bad_delta, floor_sq, norm_sq) = partials;
        // Named by the file that holds the value, as every refusal of an input is.
        let non_finite = |path: &PathBuf, index: usize| {
            ExtractError::Io(loraq_io::IoError::Tensor {
                path: path.clone(),
                tensor: self.tensor.clone(),
                reason: format!("element {index} is not finite (NaN or infinite)"),
            })
        };
        if let Some(index) = bad_merged {
            return Err(non_finite(&self.merged_path, index));
        }
        if let Some(index) = bad_base {
            return Err(non_finite(&self.base_path, index));
        }
        if let Some(index) = bad_delta {
            return Err(ExtractError::NonFinite {
                module: self.tensor.clone(),
                what: "delta",
                index,
            });
        }
        Ok(DeltaFigures {
            delta,
            floor: (floor_sq / 12.0).sqrt(),
            norm_sq,
        })
    }
}

/// $\sum_i \mathrm{ulp}(v_i)^2$ in `format`: the ulp of a value depends only on its f32
/// exponent field (f32 subnormals are below every format's smallest normal, so their ulp
/// is the format's subnormal one), so each value's $\mathrm{ulp}^2$ is read from a
/// 256-entry table and summed over eight independent f64 lanes (a per-exponent count
/// would chain every increment of the same bin, and most weights share a few exponents).
fn ulp_sq_sum(values: &[f32], format: FloorFormat) -> f64 {
    let table: [f64; 256] = std::array::from_fn(|exponent| {
        // Any value with this exponent field (the field's smallest magnitude).
        let u = format.ulp(f32::from_bits((exponent as u32) << 23));
        u * u
    });
    let ulp_sq = |v: f32| table[((v.to_bits() >> 23) & 0xff) as usize];
    let mut lanes = [0f64; 8];
    let blocks = values.chunks_exact(8);
    let tail: f64 = blocks.remainder().iter().map(|&v| ulp_sq(v)).sum();
    for block in blocks {
        for (lane, &v) in lanes.iter_mut().zip(block) {
            *lane += ulp_sq(v);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// $\sum_i d_i^2$ in f64, over eight independent lanes the compiler vectorizes.
fn sum_of_squares(values: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let blocks = values.chunks_exact(8);
    let tail: f64 = blocks
        .remainder()
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum();
    for block in blocks {
        for (lane, &x) in lanes.iter_mut().zip(block) {
            *lane += (x as f64) * (x as f64);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// Decodes one chunk of little-endian float bytes (the dtypes the scan lets through).
fn decode_chunk(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            // Indexed with the lengths checked once, so the loop vectorizes.
            let src = &src[..2 * dst.len()];
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f32::from_bits(((src[2 * i] as u32) << 16) | ((src[2 * i + 1] as u32) << 24));
            }
        }
        _ => {
            let decoded = loraq_io::convert::decode_to_f32(dtype, src, dst);
            debug_assert!(decoded, "the scan lets only float dtypes through");
        }
    }
}

/// $D = \mathrm{f32}(\mathrm{merged}) - \mathrm{f32}(\mathrm{base})$ and the floor of the merged tensor, in one parallel pass
/// over both tensors' bytes; refuses a non-finite value in either input.
pub fn delta_and_floor(
    merged: &Checkpoint,
    base: &Checkpoint,
    tensor: &str,
) -> Result<(Vec<f32>, f64)> {
    let (merged_files, base_files) = (ShardFiles::open(merged)?, ShardFiles::open(base)?);
    let figures = read_pair(merged, base, &merged_files, &base_files, tensor)?.delta()?;
    Ok((figures.delta, figures.floor))
}

fn min_index(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_ulp_of_normals_subnormals_and_zero() {
        assert_eq!(FloorFormat::Bf16.ulp(1.0), 2f64.powi(-7));
        assert_eq!(FloorFormat::Bf16.ulp(1.99), 2f64.powi(-7));
        assert_eq!(FloorFormat::Bf16.ulp(-2.0), 2f64.powi(-6));
        assert_eq!(FloorFormat::Bf16.ulp(0.0), 2f64.powi(-133));
        assert_eq!(FloorFormat::Bf16.ulp(1e-39), 2f64.powi(-133));
        assert_eq!(FloorFormat::Bf16.ulp(2f32.powi(-126)), 2f64.powi(-133));
        assert_eq!(FloorFormat::F16.ulp(1.0), 2f64.powi(-10));
        assert_eq!(FloorFormat::F16.ulp(1e-6), 2f64.powi(-24));
        assert_eq!(FloorFormat::F32.ulp(3.0), 2f64.powi(-22));
    }

    /// The table of ulp^2 per exponent gives the same sum as the ulp of every value (only
    /// the order of the f64 additions differs).
    #[test]
    fn ulp_sum_by_exponent_matches_the_sum_over_values() {
        let mut values: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919 % 4001) as f32 - 2000.0) * 1.37e-3 * (1.0 + (i % 13) as f32))
            .collect();
        values.extend([
            0.0,
            -0.0,
            1e-40,
            -3e-39,
            2f32.powi(-126),
            65504.0,
            1e-5,
            3.0e38,
        ]);
        for format in [FloorFormat::Bf16, FloorFormat::F16, FloorFormat::F32] {
            let direct: f64 = values.iter().map(|&v| format.ulp(v).powi(2)).sum();
            let counted = ulp_sq_sum(&values, format);
            assert!(
                (counted - direct).abs() <= 1e-14 * direct,
                "{format:?}: {counted} vs {direct}"
            );
        }
        let squares: f64 = values.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!((sum_of_squares(&values) - squares).abs() <= 1e-14 * squares);
    }

    #[test]
    fn floor_of_a_constant_tensor() {
        let values = vec![1.5f32; 1200];
        let expected = (1200.0 * 2f64.powi(-14) / 12.0).sqrt();
        assert!((rounding_floor(&values, FloorFormat::Bf16) - expected).abs() < 1e-15);
    }

    #[test]
    fn expected_ratio_is_zero_at_full_rank_and_near_one_for_tiny_rank() {
        assert_eq!(expected_floor_ratio(48, 16, 16), 0.0);
        let ratio = expected_floor_ratio(17408, 5120, 256);
        assert!(ratio > 0.95 && ratio < 0.97, "{ratio}");
    }
}
