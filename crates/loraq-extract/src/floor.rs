//! The rounding floor of a stored tensor and the residual a perfect low-rank fit
//! leaves against it.
//!
//! A merged weight stored in bf16 carries a rounding error of up to half a unit in the
//! last place per entry; modelled as uniform, its energy is
//! $F^2 = \sum_{ij} \mathrm{ulp}(m_{ij})^2 / 12$. No factorization of the delta can be
//! expected to do better than this noise allows, so every residual is reported over $F$.

use crate::error::{ExtractError, Result};
use crate::ordered_sum::fold_in_order;
use crate::read::ShardFiles;
use loraq_io::{Checkpoint, DType};
use rayon::prelude::*;
use std::mem::MaybeUninit;
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
    let parts = values
        .par_chunks(1 << 16)
        .map(|chunk| ulp_sq_sum(chunk, format));
    (fold_in_order(parts, 0.0, |a, b| a + b) / 12.0).sqrt()
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
        if merged.len() != base.len() || !merged.len().is_multiple_of(dtype.size_bytes()) {
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
        self.delta_into(Vec::new())
    }

    /// [`PairBytes::delta`] with $D$ written into `buffer`'s allocation (its values are
    /// ignored; grown when too small): a caller that forms one delta after another
    /// hands back the last one's buffer. A fresh allocation of D's size costs the
    /// kernel's zeroing of every page on first touch (356 MB at 17408 x 5120, some
    /// 12% of `cargo bench --bench extract_projection`'s CPU time on a Zen 4 VM);
    /// a reused one has its pages already.
    pub fn delta_into(&self, buffer: Vec<f32>) -> Result<DeltaFigures> {
        let dtype = self.dtype;
        let width = dtype.size_bytes();
        let format = FloorFormat::of(dtype);
        const CHUNK: usize = 1 << 14;
        let n = self.merged.len() / width;
        // Written once, in the pass below: not zero-filled first, and marked for huge
        // pages (its 356 MB at 17408 x 5120 would otherwise fault in 87k 4 KiB pages).
        let mut delta = buffer;
        delta.clear();
        delta.reserve(n);
        crate::read::advise_huge_pages(delta.spare_capacity_mut());
        let parts = delta.spare_capacity_mut()[..n]
            .par_chunks_mut(CHUNK)
            .zip(self.merged.par_chunks(CHUNK * width))
            .zip(self.base.par_chunks(CHUNK * width))
            .enumerate()
            .map_init(Vec::new, |scratch, (c, ((d, m_bytes), b_bytes))| {
                let (figures, d) = if dtype == DType::BF16 {
                    bf16_delta_chunk(m_bytes, b_bytes, d, format)
                } else {
                    // Decoded into scratch space first (the merged values for the
                    // floor, then the base values, which become the delta).
                    scratch.resize(2 * d.len(), 0f32);
                    let (m, b) = scratch.split_at_mut(d.len());
                    decode_chunk(dtype, m_bytes, m);
                    decode_chunk(dtype, b_bytes, b);
                    let figures = ChunkFigures::from_decoded(m, b, format);
                    (figures, write_all(d, b))
                };
                // The position only when the exponent test fails.
                let bad = |top: u32, decoded: &dyn Fn(&mut [f32])| {
                    (top == EXPONENT_MASK).then(|| {
                        let mut x = vec![0f32; d.len()];
                        decoded(&mut x);
                        x.iter().position(|x| !x.is_finite()).map(|i| c * CHUNK + i)
                    })?
                };
                let bad_m = bad(figures.top_merged, &|x| decode_chunk(dtype, m_bytes, x));
                let bad_b = bad(figures.top_base, &|x| decode_chunk(dtype, b_bytes, x));
                let bad_d = bad(figures.top_delta, &|x| x.copy_from_slice(d));
                (bad_m, bad_b, bad_d, figures.floor_sq, figures.norm_sq)
            });
        let partials = fold_in_order(parts, (None, None, None, 0.0, 0.0), |x, y| {
            (
                min_index(x.0, y.0),
                min_index(x.1, y.1),
                min_index(x.2, y.2),
                x.3 + y.3,
                x.4 + y.4,
            )
        });
        // SAFETY: every chunk of the first n values was written above (`write_all`, or
        // `bf16_delta_chunk`, which writes each value of its chunk).
        unsafe { delta.set_len(n) };
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

/// The f32 exponent field (all ones: infinities and NaN).
const EXPONENT_MASK: u32 = 0x7f80_0000;

impl FloorFormat {
    /// The f64 bits of $\mathrm{ulp}^2$ of a value whose f32 exponent field is `field`
    /// (`(bits >> 23) & 0xff`): the ulp of a value of this format depends only on that
    /// field (f32 subnormals and zero lie below every format's smallest normal, so their
    /// ulp is the format's subnormal one), $2^{\max(e, e_{min}) - p}$ with
    /// $e = \mathrm{field} - 127$, and its square is an exact power of two built from
    /// its exponent: `2 * (max(field, lowest) - 127 - p) + 1023` in the f64 bits
    /// (between 725 and 1265 for every field and format, so always a normal f64).
    #[inline(always)]
    fn ulp_sq_from_field(self, field: u32) -> f64 {
        let lowest = (self.min_normal_exponent() + 127) as u32;
        let bias = (1023 - 254 - 2 * self.mantissa_bits()) as u32;
        f64::from_bits(u64::from(2 * field.max(lowest) + bias) << 52)
    }
}

/// $\sum_i \mathrm{ulp}(v_i)^2$ in `format` ([`FloorFormat::ulp_sq_from_field`] of each
/// value's exponent field), summed over eight independent f64 lanes (no chain of
/// dependent additions).
fn ulp_sq_sum(values: &[f32], format: FloorFormat) -> f64 {
    let ulp_sq = |v: f32| format.ulp_sq_from_field((v.to_bits() >> 23) & 0xff);
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

/// What one chunk of the delta pass finds: the largest exponent field (masked, in place)
/// of the merged values, the base values and the differences ([`EXPONENT_MASK`] when
/// one is not finite), the floor's $\sum \mathrm{ulp}^2$ and $\sum d^2$.
struct ChunkFigures {
    top_merged: u32,
    top_base: u32,
    top_delta: u32,
    floor_sq: f64,
    norm_sq: f64,
}

/// The largest exponent field of f32 values (as their masked bits).
fn top_exponent(x: &[f32]) -> u32 {
    x.iter()
        .fold(0u32, |top, v| top.max(v.to_bits() & EXPONENT_MASK))
}

impl ChunkFigures {
    /// From decoded merged values and the base values in `d`, which become the delta.
    fn from_decoded(m: &[f32], d: &mut [f32], format: FloorFormat) -> ChunkFigures {
        let (top_merged, top_base) = (top_exponent(m), top_exponent(d));
        for (d, &m) in d.iter_mut().zip(m) {
            *d = m - *d;
        }
        ChunkFigures {
            top_merged,
            top_base,
            top_delta: top_exponent(d),
            floor_sq: ulp_sq_sum(m, format),
            norm_sq: sum_of_squares(d),
        }
    }
}

/// The delta of one chunk of little-endian bf16 bytes and its [`ChunkFigures`], in one
/// loop over the values (no decoded copies): with AVX-512 or AVX2 where the CPU has it
/// (the build targets baseline x86-64, whose SSE2 loop is four lanes wide). The loop has
/// no multiply-add for the compiler to fuse, so every version gives the same bits.
fn bf16_delta_chunk<'a>(
    m: &[u8],
    b: &[u8],
    d: &'a mut [MaybeUninit<f32>],
    format: FloorFormat,
) -> (ChunkFigures, &'a mut [f32]) {
    let figures = bf16_delta_chunk_figures(m, b, d, format);
    // SAFETY: the loop wrote every value of `d` (one per pair of bytes, the lengths
    // checked there); MaybeUninit<f32> has f32's layout.
    let d = unsafe { &mut *(d as *mut [MaybeUninit<f32>] as *mut [f32]) };
    (figures, d)
}

/// Copies `values` into `dst` (of the same length) and returns it as written.
fn write_all<'a>(dst: &'a mut [MaybeUninit<f32>], values: &[f32]) -> &'a mut [f32] {
    assert_eq!(dst.len(), values.len());
    for (d, &v) in dst.iter_mut().zip(values) {
        d.write(v);
    }
    // SAFETY: every value was written just above; MaybeUninit<f32> has f32's layout.
    unsafe { &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

loraq_quant::multiversion! {
    /// [`bf16_delta_chunk_body`] compiled for the widest instruction set the CPU has
    /// (`multiversion!`).
    fn bf16_delta_chunk_figures(
        m: &[u8],
        b: &[u8],
        d: &mut [MaybeUninit<f32>],
        format: FloorFormat,
    ) -> ChunkFigures {
        bf16_delta_chunk_body(m, b, d, format)
    }
}

/// The loop of [`bf16_delta_chunk`]: eight lanes of each figure, so that nothing chains
/// from one value to the next, written as loops over fixed-size arrays that the
/// compiler unrolls and vectorizes.
#[inline(always)]
fn bf16_delta_chunk_body(
    m: &[u8],
    b: &[u8],
    d: &mut [MaybeUninit<f32>],
    format: FloorFormat,
) -> ChunkFigures {
    const LANES: usize = 8;
    let n = d.len();
    // Every value of `d` is written below: the inputs hold a pair of bytes for each.
    let (m, b) = (&m[..2 * n], &b[..2 * n]);
    let lowest = (format.min_normal_exponent() + 127) as u32;
    let bias = (1023 - 254 - 2 * format.mantissa_bits()) as u32;
    let (mut top_m, mut top_b, mut top_d) = ([0u32; LANES], [0u32; LANES], [0u32; LANES]);
    let (mut floor, mut norm) = ([0f64; LANES], [0f64; LANES]);
    let full = n - n % LANES;
    for ((dc, mc), bc) in d[..full]
        .chunks_exact_mut(LANES)
        .zip(m[..2 * full].chunks_exact(2 * LANES))
        .zip(b[..2 * full].chunks_exact(2 * LANES))
    {
        let (mut mv, mut bv) = ([0u32; LANES], [0u32; LANES]);
        for l in 0..LANES {
            mv[l] = u32::from(u16::from_le_bytes([mc[2 * l], mc[2 * l + 1]])) << 16;
            bv[l] = u32::from(u16::from_le_bytes([bc[2 * l], bc[2 * l + 1]])) << 16;
        }
        for l in 0..LANES {
            let x = f32::from_bits(mv[l]) - f32::from_bits(bv[l]);
            dc[l].write(x);
            top_m[l] = top_m[l].max(mv[l] & EXPONENT_MASK);
            top_b[l] = top_b[l].max(bv[l] & EXPONENT_MASK);
            top_d[l] = top_d[l].max(x.to_bits() & EXPONENT_MASK);
            let field = (mv[l] >> 23) & 0xff;
            floor[l] += f64::from_bits(u64::from(2 * field.max(lowest) + bias) << 52);
            norm[l] += f64::from(x) * f64::from(x);
        }
    }
    let (mut floor_tail, mut norm_tail) = (0f64, 0f64);
    for i in full..n {
        let mv = u32::from(u16::from_le_bytes([m[2 * i], m[2 * i + 1]])) << 16;
        let bv = u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16;
        let x = f32::from_bits(mv) - f32::from_bits(bv);
        d[i].write(x);
        top_m[0] = top_m[0].max(mv & EXPONENT_MASK);
        top_b[0] = top_b[0].max(bv & EXPONENT_MASK);
        top_d[0] = top_d[0].max(x.to_bits() & EXPONENT_MASK);
        floor_tail += format.ulp_sq_from_field((mv >> 23) & 0xff);
        norm_tail += f64::from(x) * f64::from(x);
    }
    let reduce = |lanes: &[u32; LANES]| lanes.iter().fold(0, |a, &b| a.max(b));
    ChunkFigures {
        top_merged: reduce(&top_m),
        top_base: reduce(&top_b),
        top_delta: reduce(&top_d),
        floor_sq: floor.iter().sum::<f64>() + floor_tail,
        norm_sq: norm.iter().sum::<f64>() + norm_tail,
    }
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

    /// The fused bf16 pass (AVX-512 where the CPU has it) against an element-by-element
    /// reference (half's bf16, [`FloorFormat::ulp`]): the same delta bit for bit, the
    /// floor and the norm to f64 rounding, and the first non-finite value of either
    /// input named by its index, on a length that is not a multiple of the lanes.
    #[test]
    fn bf16_delta_pass_matches_the_element_by_element_reference() {
        use half::bf16;
        let n = 3 * (1 << 14) + 13;
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        // Every finite exponent, both signs, zeros and subnormals.
        let mut values = |_| loop {
            let v = bf16::from_bits(next() as u16);
            if v.is_finite() {
                return v;
            }
        };
        let merged: Vec<bf16> = (0..n).map(&mut values).collect();
        let base: Vec<bf16> = (0..n).map(&mut values).collect();
        let bytes = |x: &[bf16]| -> Vec<u8> { x.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let pair = |m: &[bf16], b: &[bf16]| {
            PairBytes::from_bytes(
                "t",
                DType::BF16,
                bytes(m),
                bytes(b),
                "merged.safetensors".into(),
                "base.safetensors".into(),
            )
            .unwrap()
        };
        // Differences of values near the largest overflow f32: keep the magnitudes
        // small enough for a finite delta here.
        let small = |v: bf16| {
            if v.to_f32().abs() > 1e30 {
                bf16::ONE
            } else {
                v
            }
        };
        let merged: Vec<bf16> = merged.into_iter().map(small).collect();
        let base: Vec<bf16> = base.into_iter().map(small).collect();
        let figures = pair(&merged, &base).delta().unwrap();
        let (mut floor_sq, mut norm_sq) = (0f64, 0f64);
        for i in 0..n {
            let d = merged[i].to_f32() - base[i].to_f32();
            assert_eq!(figures.delta[i].to_bits(), d.to_bits(), "element {i}");
            floor_sq += FloorFormat::Bf16.ulp(merged[i].to_f32()).powi(2);
            norm_sq += f64::from(d) * f64::from(d);
        }
        let floor = (floor_sq / 12.0).sqrt();
        assert!((figures.floor - floor).abs() <= 1e-12 * floor);
        assert!((figures.norm_sq - norm_sq).abs() <= 1e-12 * norm_sq);
        let mut bad_base = base.clone();
        bad_base[2 * (1 << 14) + 5] = bf16::NAN;
        bad_base[3 * (1 << 14) + 7] = bf16::INFINITY;
        let err = pair(&merged, &bad_base).delta().unwrap_err().to_string();
        assert!(
            err.contains("base.safetensors")
                && err.contains(&format!("element {}", 2 * (1 << 14) + 5)),
            "{err}"
        );
        let mut bad_merged = merged.clone();
        bad_merged[n - 1] = bf16::NEG_INFINITY;
        let err = pair(&bad_merged, &base).delta().unwrap_err().to_string();
        assert!(
            err.contains("merged.safetensors") && err.contains(&format!("element {}", n - 1)),
            "{err}"
        );
        let mut overflow = (merged.clone(), base.clone());
        overflow.0[17] = bf16::MAX;
        overflow.1[17] = -bf16::MAX;
        let err = pair(&overflow.0, &overflow.1).delta().unwrap_err();
        assert!(
            matches!(
                err,
                ExtractError::NonFinite {
                    what: "delta",
                    index: 17,
                    ..
                }
            ),
            "{err}"
        );
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
