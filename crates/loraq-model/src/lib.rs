//! Native forward pass of the Qwen3.5 text backbone (hybrid Gated DeltaNet and
//! gated softmax attention) and of dense Qwen3, on candle-core tensors, with a
//! LoRA adapter applied unmerged at run time; and option scoring of records.
//!
//! - [`Model::load`]: a model directory (bf16/f32 safetensors + config.json) and an
//!   optional PEFT adapter directory.
//! - [`Model::last_hidden`] / [`Model::logits_of`]: the last prompt position's final
//!   hidden state and the logits of chosen vocabulary rows only.
//! - [`score_records`]: records in, answers out (the formats of docs/model.md and docs/evaluation.md).
//! - [`Model::input_stats`]: with [`LoadOptions::collect_input_stats`], the mean
//!   square of every linear's input per feature (calibration for
//!   quantization-aware extraction; written by [`loraq_io::write_activation_stats`]).
//!
//! The math follows transformers' `modeling_qwen3_5.py` exactly: `(1 + w)` RMSNorms,
//! the gated RMSNorm `w * norm(x) * silu(z)` of linear attention, the causal
//! depthwise conv + SiLU, `g = -exp(A_log) softplus(a + dt_bias)`, `beta =
//! sigmoid(b)`, l2-normalized q/k with q scaled by `1/sqrt(d_k)`, the delta rule,
//! per-head query/gate interleaving in `q_proj`, q/k norms, partial rotary embedding
//! and `sigmoid(gate)` on the attention output.

pub mod attention;
pub mod chunked;
pub mod config;
pub mod error;
pub mod linear;
pub mod model;
pub mod ops;
pub mod records;
mod small_matmul;
pub mod tokenize;

pub use config::{Family, TextConfig};
pub use error::{ModelError, Result};
pub use linear::{
    AMX_MIN_TOKENS, AmxLinear, AmxLora, DenseLinear, GatheredInputLinear, InputSqSum,
    InputStatsLinear, KernelLinear, LinearLayer, LoraFactorsF32,
};
pub use model::{LinearBackend, LoadOptions, Model};
pub use records::{
    HiddenStates, OptionAnswer, Record, ScoreOptions, read_records, score_records,
    score_records_with_hidden, write_answers, write_hidden,
};
pub use tokenize::{TOKENIZER_FILE, tokenize_records};
