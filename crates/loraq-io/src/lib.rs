//! Checkpoint I/O for loraq.
//!
//! - [`Checkpoint`]: a Hugging Face checkpoint (one safetensors file, or shards with
//!   an index), memory-mapped, headers validated, tensors read one at a time as
//!   zero-copy bytes or converted to f32.
//! - [`ModelConfig`]: config.json with `text_config` nesting, architecture, layer
//!   types and quantization.
//! - [`ModuleName`]: decoder-layer tensor names parsed into layer, block and module;
//!   [`AdapterNaming`] / [`ModulePathMap`]: adapter module paths in either naming
//!   (`model.language_model.layers.*` or `model.layers.*`) mapped onto a checkpoint's.
//! - [`CheckpointWriter`] / [`SafetensorsWriter`]: streaming writers, sharded with an
//!   index past a size limit.
//! - [`StagedOutputs`] / [`AtomicDir`]: outputs that appear only when complete, all
//!   of a command's or none, never over its inputs.
//! - [`write_sha256sums`] / [`verify_sha256sums`]: `sha256sum -c` compatible lists.
//! - [`peft`]: PEFT LoRA adapters, read and written.
//! - [`activation_stats`]: per-module input mean squares (`loraq run --collect-stats`).
//! - [`limits`]: the limits on sizes from files and flags, and error-message elision.

pub mod activation_stats;
pub mod atomic;
pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod dtype;
pub mod error;
pub mod header;
pub mod limits;
pub mod module_name;
pub mod peft;
pub mod sha256sums;
pub mod writer;

pub use activation_stats::{ActivationStats, read_activation_stats, write_activation_stats};
pub use atomic::{
    AtomicDir, OutputKind, StagedOutputs, StaleOutcome, StaleSibling, check_output_path,
    sweep_stale_siblings, temp_file_sibling, write_file_atomically,
};
pub use checkpoint::{CONFIG_FILE, Checkpoint, INDEX_FILE, SINGLE_FILE, TensorInfo};
pub use config::{Architecture, LayerType, ModelConfig, QuantizationConfig};
pub use dtype::DType;
pub use error::{IoError, Result};
pub use module_name::{AdapterNaming, Block, ModuleKind, ModuleName, ModulePathMap};
pub use peft::{AdapterConfig, LoraAdapter, LoraFactors, LoraModuleInfo, write_adapter};
pub use sha256sums::{verify_sha256sums, write_sha256sums};
pub use writer::{
    CheckpointWriter, SafetensorsWriter, TensorSpec, WriteCaching, write_safetensors_file,
};
