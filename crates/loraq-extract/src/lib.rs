//! Extraction of LoRA adapters from merged weights: the delta between a merged
//! fine-tune and its base, factored at the bf16 rounding floor into LoRA pairs, with a
//! certificate per module, and the checks that refuse what is not an adapter.
//!
//! - [`scan`]: byte-for-byte comparison of every tensor, refusals by name.
//! - [`floor`]: the bf16 rounding floor and the residual a perfect fit leaves.
//! - [`factor`]: the top-r factorization (randomized with a certificate, or exact).
//! - [`split`]: balanced / orthonormal-A split, bf16 cast, cast error; [`cast`]: the
//!   cast-aware rounding (mixing rotation, error feedback, refits).
//! - [`extract`]: the whole `loraq extract`, written atomically, as stages over one
//!   list of planned modules: [`options`], [`plan`] (inputs opened and scanned,
//!   modules listed), [`factoring`] (factor, thresholds), [`output`] (write, then
//!   re-read and check); [`report`]: what it reports; [`card`]: the model card
//!   (README.md) it writes into the adapter directory.
//! - [`target`] / [`quant_aware`] / [`activation_stats`]: quantization-aware extraction
//!   (`--target-base`): factor merged - dequant(Q(base)), optionally weighted by the
//!   input second moments of a calibration run.
//! - [`verify`] / [`check`]: an adapter against base + merge, and two adapters against
//!   each other.

pub mod activation_stats;
pub mod card;
pub mod cast;
pub mod check;
pub mod error;
pub mod extract;
pub mod factor;
pub mod factoring;
pub mod floor;
mod gram;
pub mod options;
mod ordered_sum;
pub mod output;
pub mod plan;
pub mod quant_aware;
pub mod read;
pub mod report;
pub mod scan;
pub mod split;
pub mod target;
pub mod timeline;
pub mod verify;

pub use error::{ExtractError, Refusal, Result};
