//! Element conversions between stored dtypes and f32.
//!
//! Conversions run over slices in parallel chunks: reading a 17408x5120 bf16
//! projection is bound by memory bandwidth, not by the arithmetic.

use crate::dtype::DType;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Elements converted per parallel task: large enough to amortize scheduling,
/// small enough to spread a single projection over every core.
const CHUNK_ELEMENTS: usize = 1 << 16;

/// bf16 bits to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bf16 bits, rounding to nearest even; NaN stays NaN.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// f32 rounded to the nearest bf16 value, returned as f32.
#[inline]
pub fn round_to_bf16(x: f32) -> f32 {
    bf16_bits_to_f32(f32_to_bf16_bits(x))
}

/// f32 values to little-endian bf16 bytes (round to nearest even).
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * 2];
    out.par_chunks_mut(CHUNK_ELEMENTS * 2)
        .zip(values.par_chunks(CHUNK_ELEMENTS))
        .for_each(|(dst, src)| {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f32_to_bf16_bits(x).to_le_bytes());
            }
        });
    out
}

/// f32 values to little-endian f32 bytes.
pub fn f32_to_le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn fp8_table(dtype: DType) -> &'static [f32; 256] {
    static E4M3: OnceLock<[f32; 256]> = OnceLock::new();
    static E5M2: OnceLock<[f32; 256]> = OnceLock::new();
    match dtype {
        DType::F8E4M3 => E4M3
            .get_or_init(|| std::array::from_fn(|b| float8::F8E4M3::from_bits(b as u8).to_f32())),
        _ => E5M2
            .get_or_init(|| std::array::from_fn(|b| float8::F8E5M2::from_bits(b as u8).to_f32())),
    }
}

/// Decodes little-endian `bytes` of `dtype` into `out` (one f32 per element).
///
/// Returns `false` (leaving `out` untouched) when the dtype is not a float format
/// or the lengths disagree.
pub fn decode_to_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) -> bool {
    if !dtype.is_float() || bytes.len() != out.len() * dtype.size_bytes() {
        return false;
    }
    let width = dtype.size_bytes();
    out.par_chunks_mut(CHUNK_ELEMENTS)
        .zip(bytes.par_chunks(CHUNK_ELEMENTS * width))
        .for_each(|(dst, src)| decode_chunk(dtype, src, dst));
    true
}

fn decode_chunk(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]));
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::F64 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(8)) {
                *d = f64::from_le_bytes(s.try_into().expect("8 bytes")) as f32;
            }
        }
        DType::F8E4M3 | DType::F8E5M2 => {
            let table = fp8_table(dtype);
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = table[usize::from(s)];
            }
        }
        _ => unreachable!("decode_to_f32 checked the dtype"),
    }
}

/// Index of the first NaN or infinite value, if any (scanned in parallel chunks).
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    values
        .par_chunks(CHUNK_ELEMENTS)
        .enumerate()
        .filter_map(|(c, chunk)| {
            chunk
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| c * CHUNK_ELEMENTS + i)
        })
        .min()
}

/// The bf16 unit in the last place of `m`, as the rounding floor uses it (docs/extraction.md):
/// $2^{\lfloor \log_2 |m| \rfloor - 7}$ for normal values, $2^{-133}$ for subnormals and
/// zero.
#[inline]
pub fn bf16_ulp(m: f32) -> f64 {
    let exponent = ((m.to_bits() >> 23) & 0xff) as i32;
    if exponent == 0 {
        2f64.powi(-133)
    } else {
        2f64.powi(exponent - 127 - 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_and_rounds_to_nearest_even() {
        for bits in [0u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x8000] {
            assert_eq!(f32_to_bf16_bits(bf16_bits_to_f32(bits)), bits);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even 1.0.
        assert_eq!(f32_to_bf16_bits(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    }

    #[test]
    fn ulp_follows_the_exponent() {
        assert_eq!(bf16_ulp(1.0), 2f64.powi(-7));
        assert_eq!(bf16_ulp(-1.5), 2f64.powi(-7));
        assert_eq!(bf16_ulp(0.75), 2f64.powi(-8));
        assert_eq!(bf16_ulp(0.0), 2f64.powi(-133));
    }

    #[test]
    fn fp8_decode_matches_known_codes() {
        let bytes = [0x38u8, 0x7e, 0xfe, 0x7f, 0x01];
        let mut out = [0f32; 5];
        assert!(decode_to_f32(DType::F8E4M3, &bytes, &mut out));
        assert_eq!(&out[..3], &[1.0, 448.0, -448.0]);
        assert!(out[3].is_nan());
        assert_eq!(out[4], 2f32.powi(-9));
    }
}
