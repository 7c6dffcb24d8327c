//! Per-module input statistics for calibration-weighted factorization: the file
//! `loraq run --collect-stats FILE` writes (format and reader in
//! [`loraq_io::activation_stats`]), checked here against the modules being factored.
//!
//! The weight of input feature $k$ is $s_k = \sqrt{\max(E[x_k^2],\ \epsilon \max_j E[x_j^2])}$
//! with $\epsilon$ = [`RELATIVE_FLOOR`]: a feature that was (nearly) never active
//! keeps a small weight, so $S = \mathrm{diag}(s)$ stays invertible and $A = A^{\prime} S^{-1}$
//! stays bounded (at most $10^3 \times$ the largest weight's scale).
//!
//! A module the file lacks is an error: weighting some modules by their activations and
//! others uniformly would mix two objectives in one adapter without saying so.

use crate::error::{ExtractError, Result};
use loraq_io::activation_stats::INPUT_SQ_MEAN_SUFFIX;
use loraq_io::{ActivationStats, read_activation_stats};
use std::path::{Path, PathBuf};

/// $E[x^2]$ entries below this fraction of the module's largest are raised to it.
pub const RELATIVE_FLOOR: f64 = 1e-6;

/// An opened statistics file (read and checked by [`loraq_io::read_activation_stats`]).
#[derive(Debug)]
pub struct ActivationStatsFile {
    path: PathBuf,
    stats: ActivationStats,
}

impl ActivationStatsFile {
    /// Reads `path` and checks its metadata and every tensor.
    pub fn open(path: &Path) -> Result<ActivationStatsFile> {
        Ok(ActivationStatsFile {
            path: path.to_path_buf(),
            stats: read_activation_stats(path)?,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens the statistics were collected over.
    pub fn tokens(&self) -> u64 {
        self.stats.tokens
    }

    /// Records the statistics were collected over.
    pub fn records(&self) -> u64 {
        self.stats.records
    }

    /// $E[x^2]$ of `module_path`'s input, checked against the module: present, shape
    /// `[in_features]`, not all zero (finite and non-negative are checked on reading).
    pub fn input_sq_mean(&self, module_path: &str, in_features: usize) -> Result<&[f32]> {
        let tensor = format!("{module_path}{INPUT_SQ_MEAN_SUFFIX}");
        let bad = |what: String| ExtractError::ActivationStats {
            path: self.path.clone(),
            tensor: tensor.clone(),
            what,
        };
        let values = self.stats.module(module_path).ok_or_else(|| {
            bad("missing: the statistics do not cover this module (collect them with `loraq run --collect-stats` on the same model)".into())
        })?;
        if values.len() != in_features {
            return Err(bad(format!(
                "F32 [{}], expected F32 [{in_features}] (the module's input features)",
                values.len()
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
            self.input_sq_mean(module_path, in_features)?,
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
