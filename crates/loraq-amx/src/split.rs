//! Splitting f32 values into bf16 planes, and the error of a product of planes.
//!
//! `x = x_0 + x_1 + x_2` with `x_0 = bf16(x)` and each later plane the bf16 rounding
//! (to nearest, ties to even) of what is left: exact for every f32 whose planes are
//! normal bf16 values (`|x| >= 2^-103`), since each plane holds 8 significant bits of
//! the 24. docs/amx.md derives the bounds [`relative_error_bound`] gives.

/// How many bf16 planes of an operand enter a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Planes {
    /// `bf16(x)` only: exact for an operand whose values are bf16 already (a bf16
    /// checkpoint's weights, a basis rounded to bf16 by the caller).
    One,
    /// `x_0 + x_1`: x to within `2^-16 |x|`.
    Two,
    /// `x_0 + x_1 + x_2`: x exactly (normal range).
    Three,
}

impl Planes {
    /// The number of planes, 1 to 3.
    pub fn count(self) -> usize {
        match self {
            Planes::One => 1,
            Planes::Two => 2,
            Planes::Three => 3,
        }
    }
}

/// Unit roundoff of bf16 (8 significant bits, rounding to nearest).
pub const BF16_UNIT_ROUNDOFF: f64 = 1.0 / 256.0;

/// The plane products a product of `a_planes` and `b_planes` planes forms: the pairs
/// `(i, j)`, `i < a_planes`, `j < b_planes`, with `i + j < max(a_planes, b_planes)`
/// (the ones of order `2^-8(i+j)` that the coarser operand's precision can use).
pub fn plane_pairs(a_planes: Planes, b_planes: Planes) -> Vec<(usize, usize)> {
    let (pa, pb) = (a_planes.count(), b_planes.count());
    let order = pa.max(pb);
    let mut pairs = Vec::new();
    for i in 0..pa {
        for j in 0..pb {
            if i + j < order {
                pairs.push((i, j));
            }
        }
    }
    pairs
}

/// The f32 bits of the bf16 rounding (to nearest, ties to even) of a finite value's
/// bits, with the low 16 bits cleared; values whose rounding would overflow to infinity
/// are truncated instead (toward zero).
#[inline(always)]
pub(crate) fn round_bits(bits: u32) -> u32 {
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    // Overflow: the exponent field became all ones while the input's was not.
    let overflowed = (rounded & 0x7f80_0000) == 0x7f80_0000;
    if overflowed {
        bits & 0xffff_0000
    } else {
        rounded
    }
}

/// `bf16(x)` as an f32 (rounding to nearest, ties to even; a finite value never becomes
/// infinite: one that would is truncated). NaN stays NaN, infinities stay.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    if !x.is_finite() {
        // Keep a NaN a NaN whatever its payload (a signalling NaN's payload may lie in
        // the low bits only).
        return if x.is_nan() { f32::NAN } else { x };
    }
    f32::from_bits(round_bits(bits))
}

/// The three bf16 planes of x as f32 values: `x_0 + x_1 + x_2 == x` exactly for finite
/// x with `|x| >= 2^-103` (below, the sum is still x, but the later planes can be f32
/// subnormals that AMX reads as zero). A non-finite x gives `[x, 0, 0]`.
#[inline(always)]
pub fn split_bf16(x: f32) -> [f32; 3] {
    if !x.is_finite() {
        return [round_bf16(x), 0.0, 0.0];
    }
    let hi = f32::from_bits(round_bits(x.to_bits()));
    let rest = x - hi;
    let mid = f32::from_bits(round_bits(rest.to_bits()));
    let lo = rest - mid;
    [hi, mid, f32::from_bits(round_bits(lo.to_bits()))]
}

/// A bound `c` on the relative error of one plane product: for finite x and y with
/// `2^-103 <= |x|, |y| < 2^127 (2 - 2^-8)`,
/// `|x y - sum_{(i,j) in plane_pairs} x_i y_j| <= c |x| |y|`. With `u = 2^-8` the planes
/// obey `|x_0| <= (1+u)|x|`, `|x_1| <= u(1+u)|x|`, `|x_2| <= u^2 |x|` and the part of x
/// that `p` planes leave out is at most `u^p |x|` (0 for p = 3); the error is the sum of
/// the dropped pairs plus the left-out parts (docs/amx.md). `a_bf16` / `b_bf16` say that
/// an operand's values are bf16 already: its first plane is the value, nothing is left
/// out (one plane of a bf16 operand and three of an f32 one: `c = 0`).
pub fn relative_error_bound(a_planes: Planes, a_bf16: bool, b_planes: Planes, b_bf16: bool) -> f64 {
    let u = BF16_UNIT_ROUNDOFF;
    let planes = |exact: bool| {
        if exact {
            [1.0, 0.0, 0.0]
        } else {
            [1.0 + u, u * (1.0 + u), u * u]
        }
    };
    let left_out = |p: usize, exact: bool| {
        if exact || p >= 3 {
            0.0
        } else {
            u.powi(p as i32)
        }
    };
    let (pa, pb) = (a_planes.count(), b_planes.count());
    let kept = plane_pairs(a_planes, b_planes);
    let (xa, xb) = (planes(a_bf16), planes(b_bf16));
    let mut bound = 0.0;
    // x y = (sum_i x_i + r_a)(sum_j y_j + r_b): the dropped pairs, then r_a y + x r_b -
    // r_a r_b.
    for (i, pi) in xa.iter().enumerate().take(pa) {
        for (j, pj) in xb.iter().enumerate().take(pb) {
            if !kept.contains(&(i, j)) {
                bound += pi * pj;
            }
        }
    }
    let (ra, rb) = (left_out(pa, a_bf16), left_out(pb, b_bf16));
    bound + ra + rb + ra * rb
}

/// The bound on the f32 accumulation of `n` terms, any order: `n u_32 / (1 - n u_32)`
/// times the sum of the terms' magnitudes (`u_32 = 2^-24`); AMX rounds each
/// accumulation to f32 (to nearest, ties to even).
pub fn accumulation_bound(n: usize) -> f64 {
    let nu = n as f64 * f64::powi(2.0, -24);
    if nu >= 1.0 {
        f64::INFINITY
    } else {
        nu / (1.0 - nu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_planes_are_exact_and_each_is_bf16() {
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let bits = (state as u32) & 0x7fff_ffff;
            let x = f32::from_bits(bits);
            // Normal range with room for three normal planes, below the overflow edge.
            if !(x.is_finite() && x.abs() >= f32::powi(2.0, -103)) {
                continue;
            }
            let x = if state & (1 << 40) != 0 { -x } else { x };
            let [h, m, l] = split_bf16(x);
            for p in [h, m, l] {
                assert_eq!(p.to_bits() & 0xffff, 0, "{x:e}: plane {p:e} is not bf16");
            }
            assert_eq!(((h as f64) + (m as f64)) + (l as f64), x as f64, "{x:e}");
            let u = BF16_UNIT_ROUNDOFF;
            let xa = x.abs() as f64;
            // The overflow edge truncates (at most 2u); below it, the rounding bounds.
            let first = if (h.abs() as f64) < 3.0e38 {
                u
            } else {
                2.0 * u
            };
            assert!((x as f64 - h as f64).abs() <= first * xa, "{x:e}");
            assert!((l.abs() as f64) <= u * u * xa * 2.0, "{x:e}");
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_and_never_overflows() {
        assert_eq!(round_bf16(1.0 + f32::powi(2.0, -8)), 1.0);
        assert_eq!(
            round_bf16(1.0 + 3.0 * f32::powi(2.0, -8)),
            1.0 + f32::powi(2.0, -6)
        );
        assert_eq!(round_bf16(f32::MAX).to_bits() & 0x7f80_0000, 0x7f00_0000);
        assert!(round_bf16(f32::MAX).is_finite());
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        let [h, m, l] = split_bf16(f32::MAX);
        assert_eq!(h as f64 + m as f64 + l as f64, f32::MAX as f64);
    }

    #[test]
    fn the_pairs_and_bounds_follow_the_plane_counts() {
        assert_eq!(
            plane_pairs(Planes::Two, Planes::Two),
            vec![(0, 0), (0, 1), (1, 0)]
        );
        assert_eq!(plane_pairs(Planes::Three, Planes::One).len(), 3);
        assert_eq!(plane_pairs(Planes::Three, Planes::Three).len(), 6);
        // Two planes each: about 3 u^2 = 4.6e-5.
        let two = relative_error_bound(Planes::Two, false, Planes::Two, false);
        assert!((4.5e-5..4.8e-5).contains(&two), "{two}");
        // A bf16 right operand and three planes of the left: exact.
        assert_eq!(
            relative_error_bound(Planes::Three, false, Planes::One, true),
            0.0
        );
        // Six products of two f32 operands: about 2 u^3.
        let six = relative_error_bound(Planes::Three, false, Planes::Three, false);
        assert!((1.1e-7..1.3e-7).contains(&six), "{six}");
    }
}
