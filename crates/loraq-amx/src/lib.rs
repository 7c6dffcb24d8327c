//! f32-accurate matrix products on Intel AMX bf16 tiles.
//!
//! AMX (`tdpbf16ps`) multiplies bf16 values exactly and accumulates in f32, several
//! times faster than f32 FMA. An f32 operand is split into bf16 *planes*
//! `x = x_0 + x_1 + x_2` ([`split_bf16`]), and the product of two split operands is the
//! sum of the plane products `(i, j)` that matter ([`plane_pairs`]): three planes of an
//! f32 operand against one plane of a bf16 operand give every product exactly, two
//! planes of each give each product to about `3 * 2^-16` relative, three of each to
//! about `2^-23` ([`relative_error_bound`]). The sums are f32, as in an f32 GEMM
//! ([`accumulation_bound`]). docs/amx.md derives the bounds and says what AMX does with
//! subnormals.
//!
//! [`Amx::detect`] answers whether this process can use AMX (CPUID, XCR0, and on Linux
//! the kernel's permission for the tile data, asked once); it is `None` on other
//! machines, on other architectures, and when `LORAQ_AMX=0` is set, so callers keep
//! their own f32 path as the fallback:
//!
//! ```
//! use loraq_amx::{Accumulate, Amx, MatrixMut, MatrixRef, Operand, Planes};
//! let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2x3, row-major
//! let b = [0.5f32, -1.0, 0.25, 2.0, 1.0, 0.125]; // 3x2
//! let mut c = [0f32; 4];
//! if let Some(amx) = Amx::detect() {
//!     let out = MatrixMut::row_major(&mut c, 2, 2, 2).unwrap();
//!     let a = Operand::new(MatrixRef::row_major(&a, 2, 3).unwrap(), Planes::Three);
//!     let b = Operand::new(MatrixRef::row_major(&b, 3, 2).unwrap(), Planes::One);
//!     amx.matmul(out, a, b, Accumulate::Replace).unwrap();
//!     assert_eq!(c, [4.0, 3.375, 9.25, 6.75]);
//! }
//! ```

#[cfg(target_arch = "x86_64")]
mod detect;
mod error;
#[cfg(target_arch = "x86_64")]
mod kernel;
mod packed;
#[cfg(target_arch = "x86_64")]
mod packed_kernel;
mod split;
mod view;

pub use error::AmxError;
pub use packed::PackedBf16;
pub use split::{
    BF16_UNIT_ROUNDOFF, Planes, accumulation_bound, plane_pairs, relative_error_bound, round_bf16,
    split_bf16,
};
pub use view::{MatrixMut, MatrixRef};

/// The environment variable that turns AMX off (`LORAQ_AMX=0`): [`Amx::detect`] then
/// answers `None` and callers take their fallback path.
pub const DISABLE_VAR: &str = "LORAQ_AMX";

/// Proof that this process can run AMX bf16 tile products: obtained from
/// [`Amx::detect`].
#[derive(Debug, Clone, Copy)]
pub struct Amx {
    _private: (),
}

/// One operand of a product and how many of its bf16 planes enter it.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    /// The f32 values.
    pub matrix: MatrixRef<'a>,
    /// The planes used ([`Planes::One`] for bf16 values, or to use `bf16(x)` only).
    pub planes: Planes,
}

impl<'a> Operand<'a> {
    /// The operand `matrix` split into `planes` planes.
    pub fn new(matrix: MatrixRef<'a>, planes: Planes) -> Operand<'a> {
        Operand { matrix, planes }
    }
}

/// Whether a product replaces the output or is added to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulate {
    /// `out = a b`.
    Replace,
    /// `out += a b` (one more f32 rounding per element).
    Add,
}

impl Amx {
    /// `Some` when the CPU has AMX-TILE and AMX-BF16, the operating system enables the
    /// tile state and (Linux) grants it to this process, and `LORAQ_AMX` is not `0`.
    /// The hardware answer is cached; the variable is read at every call.
    pub fn detect() -> Option<Amx> {
        if std::env::var_os(DISABLE_VAR).is_some_and(|v| v == "0") {
            return None;
        }
        Amx::hardware_usable().then_some(Amx { _private: () })
    }

    /// Whether the hardware and the operating system allow AMX in this process,
    /// whatever `LORAQ_AMX` says.
    pub fn hardware_usable() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            detect::usable()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `out = a b` ([`Accumulate::Replace`]) or `out += a b`, each product formed from
    /// the plane pairs of [`plane_pairs`]`(a.planes, b.planes)` and accumulated in f32,
    /// on the current rayon pool. An error when the shapes disagree.
    pub fn matmul(
        &self,
        out: MatrixMut<'_>,
        a: Operand<'_>,
        b: Operand<'_>,
        accumulate: Accumulate,
    ) -> Result<(), AmxError> {
        let (ma, mb) = (a.matrix, b.matrix);
        if ma.cols() != mb.rows() || out.rows() != ma.rows() || out.cols() != mb.cols() {
            return Err(AmxError::ShapeMismatch {
                a_rows: ma.rows(),
                a_cols: ma.cols(),
                b_rows: mb.rows(),
                b_cols: mb.cols(),
                out_rows: out.rows(),
                out_cols: out.cols(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: an `Amx` exists only where `detect::usable` said yes; the shapes
            // agree (checked above).
            unsafe {
                kernel::matmul(
                    out,
                    ma,
                    a.planes,
                    mb,
                    b.planes,
                    accumulate == Accumulate::Add,
                );
            }
            Ok(())
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = accumulate;
            Err(AmxError::Unavailable)
        }
    }
}
