//! Per-module input statistics for calibration-weighted factorization: the file
//! `loraq run --collect-stats FILE` writes.
//!
//! Format (version 1): one safetensors file, one F32 tensor per linear module named
//! `<module path>.input_sq_mean`, shape `[in_features]`, holding $E[x_k^2]$ of that
//! linear's input over every token of the record set; metadata
//! `{"format": "loraq-calibration", "version": "1", "tokens": "<n>", "records": "<n>"}`.
//!
//! The weight of input feature $k$ is $s_k = \sqrt{\max(E[x_k^2],\ \epsilon \max_j E[x_j^2])}$
//! with $\epsilon$ = [`RELATIVE_FLOOR`]: a feature that was (nearly) never active
//! keeps a small weight, so $S = \mathrm{diag}(s)$ stays invertible and $A = A' S^{-1}$
//! stays bounded (at most $10^3 \times$ the largest weight's scale).
//!
//! A module the file lacks is an error: weighting some modules by their activations and
//! others uniformly would mix two objectives in one adapter without saying so.

use crate::error::{ExtractError, Result};
use loraq_io::{Checkpoint, DType};
use std::path::{Path, PathBuf};

/// Suffix of the statistics tensor after the module path.
pub const TENSOR_SUFFIX: &str = ".input_sq_mean";
/// `format` in the file's metadata.
pub const FORMAT: &str = "loraq-calibration";
/// `version` in the file's metadata.
pub const VERSION: &str = "1";
/// $E[x^2]$ entries below this fraction of the module's largest are raised to it.
pub const RELATIVE_FLOOR: f64 = 1e-6;

/// An opened statistics file.
pub struct Calibration {
    path: PathBuf,
    file: Checkpoint,
    /// Tokens the statistics were collected over (from the metadata).
    pub tokens: u64,
    /// Records the statistics were collected over (from the metadata).
    pub records: u64,
}

impl std::fmt::Debug for Calibration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calibration")
            .field("path", &self.path)
            .field("tokens", &self.tokens)
            .field("records", &self.records)
            .finish()
    }
}

impl Calibration {
    /// Opens `path` and checks its metadata.
    pub fn open(path: &Path) -> Result<Calibration> {
        let bad = |tensor: &str, what: String| ExtractError::Calibration {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            what,
        };
        if !path.is_file() {
            return Err(bad("-", "not a file".into()));
        }
        let file = Checkpoint::open(path)?;
        let metadata = file.shard_metadata(0);
        let field = |key: &str| -> Result<&String> {
            metadata
                .get(key)
                .ok_or_else(|| bad(key, "missing from the metadata".into()))
        };
        let format = field("format")?;
        if format != FORMAT {
            return Err(bad("format", format!("{format:?}, expected {FORMAT:?}")));
        }
        let version = field("version")?;
        if version != VERSION {
            return Err(bad(
                "version",
                format!("{version:?}, this build reads {VERSION:?}"),
            ));
        }
        let count = |key: &str| -> Result<u64> {
            let text = field(key)?;
            text.parse()
                .map_err(|_| bad(key, format!("{text:?} is not a count")))
        };
        let tokens = count("tokens")?;
        let records = count("records")?;
        if tokens == 0 {
            return Err(bad("tokens", "0: statistics of no token".into()));
        }
        Ok(Calibration {
            path: path.to_path_buf(),
            file,
            tokens,
            records,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// $E[x^2]$ of `module_path`'s input, checked: F32, shape `[in_features]`, finite,
    /// non-negative and not all zero.
    pub fn input_sq_mean(&self, module_path: &str, in_features: usize) -> Result<Vec<f32>> {
        let tensor = format!("{module_path}{TENSOR_SUFFIX}");
        let bad = |what: String| ExtractError::Calibration {
            path: self.path.clone(),
            tensor: tensor.clone(),
            what,
        };
        let info = self.file.get(&tensor).ok_or_else(|| {
            bad("missing: the statistics do not cover this module (collect them with `loraq run --collect-stats` on the same model)".into())
        })?;
        if info.dtype != DType::F32 || info.shape != [in_features] {
            return Err(bad(format!(
                "{} {:?}, expected F32 [{in_features}] (the module's input features)",
                info.dtype.as_str(),
                info.shape
            )));
        }
        let values = self.file.read_f32(&tensor)?;
        if let Some(k) = values.iter().position(|v| !v.is_finite() || *v < 0.0) {
            return Err(bad(format!(
                "value {} at feature {k}: a mean of squares is finite and >= 0",
                values[k]
            )));
        }
        if values.iter().all(|&v| v == 0.0) {
            return Err(bad("all zero: the module never saw a non-zero input".into()));
        }
        Ok(values)
    }

    /// The column weights $s_k$ of `module_path` (see the module docs).
    pub fn column_weights(&self, module_path: &str, in_features: usize) -> Result<Vec<f32>> {
        Ok(column_weights(
            &self.input_sq_mean(module_path, in_features)?,
        ))
    }
}

/// $s_k = \sqrt{\max(e_k, \epsilon \max_j e_j)}$ for $E[x^2]$ values `e` (finite, >= 0,
/// not all zero), computed in f64 and rounded to f32.
pub fn column_weights(sq_mean: &[f32]) -> Vec<f32> {
    let max = sq_mean.iter().fold(0.0f64, |m, &v| m.max(v as f64));
    let floor = RELATIVE_FLOOR * max;
    sq_mean
        .iter()
        .map(|&v| (v as f64).max(floor).sqrt() as f32)
        .collect()
}
