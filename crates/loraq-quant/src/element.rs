//! Element formats: E4M3 (fn), E5M2, E2M1 and E8M0, encoded from `f32` with
//! round-to-nearest-even and saturation, decoded through lookup tables.
//!
//! Encoding is branch-light so the slice versions vectorize: the magnitude is
//! clamped to the format's largest finite value first (what quantizers do; no
//! input ever becomes Inf or NaN unless it already was NaN), then two candidate
//! codes are computed and one selected:
//!
//! * normal range: the classic bias-and-round trick on the `f32` bits:
//!   `(bits - (127 - bias) << 23 + (1 << (22 - m)) - 1 + lsb) >> (23 - m)`, where
//!   `lsb` is the bit that becomes the last mantissa bit (ties go to even; a
//!   carry out of the mantissa correctly bumps the exponent);
//! * subnormal range: one `f32` addition of a magic constant whose unit in the last
//!   place equals the format's subnormal spacing, so the FPU performs the
//!   round-to-nearest-even, then the magic's bits are subtracted.
//!
//! Where the results differ from `ml_dtypes` (which converts overflow to NaN or
//! Inf) is documented on each function and in `docs/quantization.md`.

/// Largest finite E4M3 (fn) value, `1.75 * 2^8` (hard-coded, not taken from a crate).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value, `1.75 * 2^15`.
pub const E5M2_MAX: f32 = 57344.0;
/// Largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;
/// Smallest positive E4M3 value (subnormal), $2^{-9}$: the floor of NVFP4 block scales.
pub const E4M3_MIN_SUBNORMAL: f32 = 1.0 / 512.0;

/// The element formats of this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementFormat {
    /// FP8 E4M3 "fn": bias 7, max 448, no infinities, NaN = `0x7F` / `0xFF`.
    E4M3,
    /// FP8 E5M2: bias 15, max 57344, IEEE-style infinities and NaNs.
    E5M2,
    /// FP4 E2M1: `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` with a sign bit, in the low nibble.
    E2M1,
    /// E8M0 scale: `2^(e - 127)`, unsigned, no zero, `0xFF` = NaN.
    E8M0,
}

impl ElementFormat {
    /// Every format, in declaration order.
    pub const ALL: [ElementFormat; 4] = [Self::E4M3, Self::E5M2, Self::E2M1, Self::E8M0];

    /// Lower-case name (`"e4m3"`, ...), as used in file names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::E4M3 => "e4m3",
            Self::E5M2 => "e5m2",
            Self::E2M1 => "e2m1",
            Self::E8M0 => "e8m0",
        }
    }

    /// Encodes one value (see the per-format functions for rounding and saturation).
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Self::E4M3 => e4m3_encode(x),
            Self::E5M2 => e5m2_encode(x),
            Self::E2M1 => e2m1_encode(x),
            Self::E8M0 => e8m0_encode(x),
        }
    }

    /// Decodes one code (E2M1 reads the low nibble only).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Self::E4M3 => e4m3_decode(code),
            Self::E5M2 => e5m2_decode(code),
            Self::E2M1 => e2m1_decode(code),
            Self::E8M0 => e8m0_decode(code),
        }
    }

    /// Encodes `src` into `dst` element by element.
    ///
    /// # Panics
    /// If the slices differ in length.
    pub fn encode_slice(self, src: &[f32], dst: &mut [u8]) {
        match self {
            Self::E4M3 => e4m3_encode_slice(src, dst),
            Self::E5M2 => e5m2_encode_slice(src, dst),
            Self::E2M1 => e2m1_encode_slice(src, dst),
            Self::E8M0 => {
                assert_eq!(src.len(), dst.len(), "e8m0_encode_slice: length mismatch");
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = e8m0_encode(s);
                }
            }
        }
    }

    /// Decodes `src` into `dst` through the format's lookup table.
    ///
    /// # Panics
    /// If the slices differ in length.
    pub fn decode_slice(self, src: &[u8], dst: &mut [f32]) {
        let table: &[f32; 256] = match self {
            Self::E4M3 => &E4M3_TABLE,
            Self::E5M2 => &E5M2_TABLE,
            Self::E2M1 => &E2M1_TABLE_256,
            Self::E8M0 => &E8M0_TABLE,
        };
        decode_with(table, src, dst);
    }
}

/// Rounds `|x|` (already clamped, not NaN, sign removed) to the code of a small float
/// with `exp_bits` exponent bits, `man_bits` mantissa bits (1..=3) and bias `bias`,
/// round-to-nearest-even, subnormals included. Returns the code without sign.
#[inline(always)]
fn round_magnitude(magnitude: f32, man_bits: u32, bias: i32) -> u32 {
    let bits = magnitude.to_bits();
    // Normal range: rebias the exponent and round the dropped mantissa bits.
    let shift = 23 - man_bits;
    let lsb = (bits >> shift) & 1;
    let rebias = ((bias - 127) << 23) as u32;
    let normal = bits
        .wrapping_add(rebias)
        .wrapping_add((1u32 << (shift - 1)) - 1 + lsb)
        >> shift;
    // Subnormal range: the magic constant's ulp is the subnormal spacing 2^(1-bias-m).
    let magic_bits = (((127 - bias) + shift as i32 + 1) as u32) << 23;
    let magic = f32::from_bits(magic_bits);
    let subnormal = (magnitude + magic).to_bits().wrapping_sub(magic_bits);
    let min_normal_bits = ((1 - bias + 127) as u32) << 23;
    if bits < min_normal_bits {
        subnormal
    } else {
        normal
    }
}

/// E4M3 (fn) code of `x`: round to nearest even after clamping to `[-448, 448]`.
///
/// Saturation: every finite value above 448 in magnitude and +-Inf encode as +-448
/// (`0x7E` / `0xFE`), as FP8 quantizers clamp before casting. `ml_dtypes` (and a
/// plain `torch` cast) instead give NaN from 464 upward and for Inf. NaN keeps its
/// sign: `0x7F` / `0xFF`. Both zeros keep their sign.
#[inline(always)]
pub fn e4m3_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let code = round_magnitude(x.abs().min(E4M3_MAX), 3, 7) as u8;
    if x.is_nan() { sign | 0x7F } else { sign | code }
}

/// E5M2 code of `x`: round to nearest even after clamping to `[-57344, 57344]`.
///
/// Saturation: finite overflow and +-Inf encode as +-57344 (`0x7B` / `0xFB`), where
/// `ml_dtypes` gives +-Inf (from 61440 upward). NaN encodes as `0x7E` / `0xFE`
/// (sign kept), as `ml_dtypes` does.
#[inline(always)]
pub fn e5m2_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let code = round_magnitude(x.abs().min(E5M2_MAX), 2, 15) as u8;
    if x.is_nan() { sign | 0x7E } else { sign | code }
}

/// E2M1 code of `x` in the low nibble (sign in bit 3): round to nearest even, and
/// saturating at +-6 (Inf included), as `ml_dtypes` does.
///
/// E2M1 has no NaN: NaN encodes as `+0` (code 0). `ml_dtypes` also gives a zero, but
/// with the sign bit inverted (`+NaN` gives `0x8`); quantization schemes refuse NaN
/// weights before they get here.
#[inline(always)]
pub fn e2m1_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 28) & 0x8) as u8;
    let code = round_magnitude(x.abs().min(E2M1_MAX), 1, 1) as u8;
    if x.is_nan() { 0 } else { sign | code }
}

/// E8M0 code of `x`: the nearest power of two $2^{c - 127}$ (code $c$), ties (mantissa
/// exactly 1.5) rounding up, as `ml_dtypes` does (with no mantissa bit there is no
/// "even" to tie to).
///
/// Positive values below $2^{-127}$ give code 0 ($2^{-127}$, the smallest value, since
/// E8M0 has no zero); values that round past $2^{127}$, and +Inf, saturate to code 254
/// (`ml_dtypes`: NaN). Zero, negative values and NaN give `0xFF` (NaN), as in
/// `ml_dtypes`. `f32` subnormals round by value (`ml_dtypes` rounds
/// $[1.5 \cdot 2^{-127}, 2^{-126})$ correctly but also sends $(2^{-127}, 1.5 \cdot 2^{-127})$
/// up).
#[inline(always)]
pub fn e8m0_encode(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0xFF;
    }
    let bits = x.to_bits();
    let exponent = bits >> 23;
    if exponent == 0 {
        // f32 subnormal: only 2^-127 (0x0040_0000) and 2^-126 are candidates.
        return u8::from(bits >= 0x0060_0000);
    }
    let rounded = exponent + u32::from(bits & 0x007F_FFFF >= 0x0040_0000);
    rounded.min(254) as u8
}

/// Value of an E4M3 (fn) code; `0x7F` / `0xFF` are NaN.
#[inline(always)]
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

/// Value of an E5M2 code (`0x7C` is +Inf, `0x7D..=0x7F` NaN, likewise negative).
#[inline(always)]
pub fn e5m2_decode(code: u8) -> f32 {
    E5M2_TABLE[code as usize]
}

/// Value of the E2M1 code in the low nibble of `code` (the high nibble is ignored).
#[inline(always)]
pub fn e2m1_decode(code: u8) -> f32 {
    E2M1_TABLE[(code & 0xF) as usize]
}

/// Value of an E8M0 code, `2^(code - 127)`; `0xFF` is NaN.
#[inline(always)]
pub fn e8m0_decode(code: u8) -> f32 {
    E8M0_TABLE[code as usize]
}

/// Encodes a slice to E4M3 (see [`e4m3_encode`]).
///
/// # Panics
/// If the slices differ in length.
pub fn e4m3_encode_slice(src: &[f32], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "e4m3_encode_slice: length mismatch");
    e4m3_encode_run(src, dst);
}

crate::multiversion::multiversion! {
    /// `dst[i] = e4m3_encode(src[i])`, vectorized.
    fn e4m3_encode_run(src: &[f32], dst: &mut [u8]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = e4m3_encode(s);
        }
    }
}

/// Encodes a slice to E5M2 (see [`e5m2_encode`]).
///
/// # Panics
/// If the slices differ in length.
pub fn e5m2_encode_slice(src: &[f32], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "e5m2_encode_slice: length mismatch");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = e5m2_encode(s);
    }
}

/// Encodes a slice to E2M1, one code per byte (see [`e2m1_encode`]; pack with
/// [`pack_e2m1`]).
///
/// # Panics
/// If the slices differ in length.
pub fn e2m1_encode_slice(src: &[f32], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "e2m1_encode_slice: length mismatch");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = e2m1_encode(s);
    }
}

/// Decodes E4M3 codes into `dst`.
///
/// # Panics
/// If the slices differ in length.
pub fn e4m3_decode_slice(src: &[u8], dst: &mut [f32]) {
    decode_with(&E4M3_TABLE, src, dst);
}

/// Decodes E5M2 codes into `dst`.
///
/// # Panics
/// If the slices differ in length.
pub fn e5m2_decode_slice(src: &[u8], dst: &mut [f32]) {
    decode_with(&E5M2_TABLE, src, dst);
}

/// Packs E2M1 codes two per byte, the even-indexed element in the LOW nibble (the
/// NVFP4 / MXFP4 checkpoint order). `codes.len()` must be even.
///
/// # Panics
/// If `codes.len() != 2 * packed.len()`.
pub fn pack_e2m1(codes: &[u8], packed: &mut [u8]) {
    assert_eq!(codes.len(), 2 * packed.len(), "pack_e2m1: length mismatch");
    for (p, pair) in packed.iter_mut().zip(codes.chunks_exact(2)) {
        *p = (pair[0] & 0xF) | (pair[1] << 4);
    }
}

/// Decodes packed E2M1 bytes (even element in the low nibble) into `dst`, two values
/// per byte.
///
/// # Panics
/// If `dst.len() != 2 * packed.len()`.
pub fn e2m1_decode_packed(packed: &[u8], dst: &mut [f32]) {
    assert_eq!(
        dst.len(),
        2 * packed.len(),
        "e2m1_decode_packed: length mismatch"
    );
    for (pair, &byte) in dst.chunks_exact_mut(2).zip(packed) {
        pair[0] = E2M1_TABLE[(byte & 0xF) as usize];
        pair[1] = E2M1_TABLE[(byte >> 4) as usize];
    }
}

fn decode_with(table: &[f32; 256], src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "decode: length mismatch");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = table[s as usize];
    }
}

/// A quiet NaN carrying the sign of `negative`.
const fn signed_nan(negative: bool) -> f32 {
    f32::from_bits(if negative { 0xFFC0_0000 } else { 0x7FC0_0000 })
}

/// Value of a sign-magnitude small float code with `man_bits` mantissa bits and `bias`
/// (finite codes only): subnormals are `m * 2^(1 - bias - man_bits)`.
const fn small_float_value(code: u32, exp_bits: u32, man_bits: u32, bias: i32) -> f32 {
    let negative = (code >> (exp_bits + man_bits)) & 1 == 1;
    let exponent = ((code >> man_bits) & ((1 << exp_bits) - 1)) as i32;
    let mantissa = code & ((1 << man_bits) - 1);
    let magnitude = if exponent == 0 {
        // m * 2^(1 - bias - man_bits), exact in f32.
        let unit = f32::from_bits(((1 - bias - man_bits as i32 + 127) as u32) << 23);
        mantissa as f32 * unit
    } else {
        f32::from_bits((((exponent - bias + 127) as u32) << 23) | (mantissa << (23 - man_bits)))
    };
    if negative { -magnitude } else { magnitude }
}

const fn build_e4m3() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = if code & 0x7F == 0x7F {
            signed_nan(code >= 0x80)
        } else {
            small_float_value(code as u32, 4, 3, 7)
        };
        code += 1;
    }
    table
}

const fn build_e5m2() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let magnitude = code & 0x7F;
        table[code] = if magnitude == 0x7C {
            if code >= 0x80 {
                f32::NEG_INFINITY
            } else {
                f32::INFINITY
            }
        } else if magnitude > 0x7C {
            signed_nan(code >= 0x80)
        } else {
            small_float_value(code as u32, 5, 2, 15)
        };
        code += 1;
    }
    table
}

const fn build_e2m1() -> [f32; 256] {
    // Indexed by the full byte so `decode_slice` can share the 256-entry path; only
    // the low nibble matters.
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = small_float_value((code & 0xF) as u32, 2, 1, 1);
        code += 1;
    }
    table
}

const fn build_e8m0() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    // Code 0 is 2^-127, an f32 subnormal.
    table[0] = f32::from_bits(0x0040_0000);
    let mut code = 1;
    while code < 255 {
        table[code] = f32::from_bits((code as u32) << 23);
        code += 1;
    }
    table[255] = signed_nan(false);
    table
}

/// E4M3 (fn) decode table, indexed by code.
pub static E4M3_TABLE: [f32; 256] = build_e4m3();
/// E5M2 decode table, indexed by code.
pub static E5M2_TABLE: [f32; 256] = build_e5m2();
/// E2M1 decode table for the 16 nibble codes.
pub static E2M1_TABLE: [f32; 16] = {
    let full = build_e2m1();
    let mut table = [0.0f32; 16];
    let mut code = 0;
    while code < 16 {
        table[code] = full[code];
        code += 1;
    }
    table
};
static E2M1_TABLE_256: [f32; 256] = build_e2m1();
/// E8M0 decode table, indexed by code.
pub static E8M0_TABLE: [f32; 256] = build_e8m0();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_table_is_the_ocp_value_set() {
        assert_eq!(E2M1_TABLE[..8], [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        for code in 0..8 {
            assert_eq!(E2M1_TABLE[code + 8], -E2M1_TABLE[code]);
        }
    }

    #[test]
    fn maxima_are_the_hard_coded_constants() {
        assert_eq!(e4m3_decode(0x7E), E4M3_MAX);
        assert_eq!(e5m2_decode(0x7B), E5M2_MAX);
        assert_eq!(e4m3_decode(0x01), E4M3_MIN_SUBNORMAL);
        assert_eq!(e8m0_decode(127), 1.0);
    }

    #[test]
    fn packing_puts_the_even_element_in_the_low_nibble() {
        let mut packed = [0u8; 2];
        pack_e2m1(&[0x1, 0x2, 0xF, 0x7], &mut packed);
        assert_eq!(packed, [0x21, 0x7F]);
        let mut values = [0.0f32; 4];
        e2m1_decode_packed(&packed, &mut values);
        assert_eq!(values, [0.5, 1.0, -6.0, 6.0]);
    }
}
