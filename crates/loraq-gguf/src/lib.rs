//! GGUF, llama.cpp's model file format, for loraq (docs/gguf.md).
//!
//! - [`GgufFile`] / [`GgufModel`]: the container read over a memory map (one file,
//!   or the files of a split model as one), every size checked.
//! - [`GgufWriter`]: the container written, metadata of every type, tensors aligned.
//! - [`names`]: checkpoint tensor names <-> GGUF names for `qwen3` and `qwen35`.
//! - [`vhead`]: the value-head order llama.cpp's converter gives `qwen35` tensors.
//! - [`base`]: a GGUF model opened as a checkpoint in the checkpoint's terms.
//! - [`convert`]: what llama.cpp's converter writes for a checkpoint besides the
//!   tensor bytes (metadata, tokenizer, value changes).
//! - [`lora`]: a PEFT adapter exported as a llama.cpp LoRA (`loraq export-gguf`).

pub mod base;
pub mod convert;
pub mod error;
pub mod ggml_type;
pub mod lora;
pub mod names;
pub mod reader;
pub mod value;
pub mod vhead;
pub mod writer;

pub use error::{GgufError, Result};
pub use ggml_type::{BlockGeometry, GgmlType, QK_K};
pub use lora::{BaseLayout, ExportSummary, FactorType, export_adapter};
pub use names::GgufArch;
pub use reader::{GgufFile, GgufModel, GgufTensorInfo};
pub use value::{MetadataArray, MetadataValue, ValueType};
pub use vhead::VHeadLayout;
pub use writer::{GgufWriter, TensorSpec};
