//! Calibration statistics: the mean square of every linear module's input, per
//! input feature, and its absolute maximum, over the tokens of a calibration record
//! set.
//!
//! `loraq run --collect-stats FILE` writes them; quantization-aware extraction
//! (`loraq extract --calibration FILE`) weights each input column of a module's
//! error by $\sqrt{\mathrm{E}[x_k^2]}$, and `loraq quantize --scheme nvfp4 --calibration FILE`
//! turns each module's absolute maximum into its static activation scale
//! (`input_scale` $= a / (6 \cdot 448)$ for the largest magnitude $a$, NVIDIA ModelOpt's
//! convention). The file is a
//! safetensors file:
//!
//! - one F32 tensor per linear module, named `<module path>.input_sq_mean` (the
//!   module path is the weight's name without `.weight`, as in the checkpoint,
//!   e.g. `model.language_model.layers.40.mlp.down_proj.input_sq_mean`), shape
//!   `[in_features]`, holding the mean over tokens of $x_k^2$ of the activations that
//!   enter the linear (before any activation fake-quant);
//! - (version 2) one F32 scalar per linear module, `<module path>.input_abs_max`,
//!   shape `[]`: the maximum over tokens and features of $|x|$ of the same activations;
//! - metadata `{"format": "loraq-calibration", "version": "2", "tokens": "<count>",
//!   "records": "<count>"}`.
//!
//! Version 1 files (no `input_abs_max`) still read, with no absolute maxima.

use crate::atomic::write_file_atomically;
use crate::checkpoint::Checkpoint;
use crate::dtype::DType;
use crate::error::{IoError, Result};
use crate::writer::{TensorSpec, write_safetensors_file};
use std::collections::BTreeMap;
use std::path::Path;

/// The `format` metadata value of a calibration file.
pub const ACTIVATION_STATS_FORMAT: &str = "loraq-calibration";
/// The `version` metadata value this crate writes.
pub const ACTIVATION_STATS_VERSION: &str = "2";
/// Every `version` this crate reads: 1 (mean squares only) and 2 (with absolute maxima).
pub const ACTIVATION_STATS_VERSIONS_READ: [&str; 2] = ["1", "2"];
/// The suffix that turns a module path into its mean-square tensor's name.
pub const INPUT_SQ_MEAN_SUFFIX: &str = ".input_sq_mean";
/// The suffix that turns a module path into its absolute-maximum tensor's name.
pub const INPUT_ABS_MAX_SUFFIX: &str = ".input_abs_max";

/// Per-module input statistics of a calibration run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ActivationStats {
    /// Prompt tokens the means are taken over (every module saw each of them).
    pub tokens: u64,
    /// Records (prompts) those tokens came from.
    pub records: u64,
    /// Module path -> $\mathrm{E}[x_k^2]$ per input feature $k$.
    pub input_sq_mean: BTreeMap<String, Vec<f32>>,
    /// Module path -> `max |x|` over every token and input feature (empty when read
    /// from a version 1 file).
    pub input_abs_max: BTreeMap<String, f32>,
}

impl ActivationStats {
    /// The statistics of one module, by module path (no `.weight`).
    pub fn module(&self, module_path: &str) -> Option<&[f32]> {
        self.input_sq_mean.get(module_path).map(Vec::as_slice)
    }

    /// The input absolute maximum of one module, by module path (no `.weight`).
    pub fn abs_max(&self, module_path: &str) -> Option<f32> {
        self.input_abs_max.get(module_path).copied()
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> IoError {
    IoError::ActivationStats {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes `stats` to `path` atomically (a temporary sibling renamed into place, so
/// a reader never sees a partial file); an existing file is replaced, as `loraq
/// run --out` replaces its answers.
///
/// Refuses (writing nothing) a module with no features, a negative or non-finite
/// value, or zero tokens.
pub fn write_activation_stats(path: &Path, stats: &ActivationStats) -> Result<()> {
    for (module, amax) in &stats.input_abs_max {
        if !amax.is_finite() || *amax < 0.0 {
            return Err(bad(
                path,
                format!("module {module} has input absolute maximum {amax}"),
            ));
        }
    }
    if stats.tokens == 0 {
        return Err(bad(path, "no tokens were seen; nothing to write"));
    }
    for (module, values) in &stats.input_sq_mean {
        if values.is_empty() {
            return Err(bad(path, format!("module {module} has no input features")));
        }
        if let Some((k, v)) = values
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite() || **v < 0.0)
        {
            return Err(bad(
                path,
                format!("module {module}: input feature {k} has mean square {v}"),
            ));
        }
    }
    let bytes: Vec<Vec<u8>> = stats
        .input_sq_mean
        .values()
        .map(|v| crate::convert::f32_to_le_bytes(v))
        .collect();
    let abs_max_bytes: Vec<[u8; 4]> = stats
        .input_abs_max
        .values()
        .map(|v| v.to_le_bytes())
        .collect();
    let mut tensors: Vec<(TensorSpec, &[u8])> = stats
        .input_sq_mean
        .iter()
        .zip(&bytes)
        .map(|((module, values), b)| {
            (
                TensorSpec::new(
                    format!("{module}{INPUT_SQ_MEAN_SUFFIX}"),
                    DType::F32,
                    vec![values.len()],
                ),
                b.as_slice(),
            )
        })
        .collect();
    tensors.extend(
        stats
            .input_abs_max
            .keys()
            .zip(&abs_max_bytes)
            .map(|(module, b)| {
                (
                    TensorSpec::new(
                        format!("{module}{INPUT_ABS_MAX_SUFFIX}"),
                        DType::F32,
                        vec![],
                    ),
                    b.as_slice(),
                )
            }),
    );
    let metadata = BTreeMap::from([
        ("format".to_string(), ACTIVATION_STATS_FORMAT.to_string()),
        ("version".to_string(), ACTIVATION_STATS_VERSION.to_string()),
        ("tokens".to_string(), stats.tokens.to_string()),
        ("records".to_string(), stats.records.to_string()),
    ]);
    write_file_atomically(path, |temp| {
        write_safetensors_file(temp, &tensors, &metadata)
    })
}

/// Reads a calibration file, checking its metadata, every tensor's name, dtype
/// (F32), rank (1) and values (finite, non-negative).
pub fn read_activation_stats(path: &Path) -> Result<ActivationStats> {
    let ckpt = Checkpoint::open(path)?;
    if !path.is_file() {
        return Err(bad(path, "not a file (expected one .safetensors file)"));
    }
    let meta = ckpt.shard_metadata(0);
    let field = |key: &str| {
        meta.get(key)
            .ok_or_else(|| bad(path, format!("metadata lacks {key:?}")))
    };
    if field("format")? != ACTIVATION_STATS_FORMAT {
        return Err(bad(
            path,
            format!(
                "metadata format is {:?}, not {ACTIVATION_STATS_FORMAT:?}",
                field("format")?
            ),
        ));
    }
    let version = field("version")?;
    if !ACTIVATION_STATS_VERSIONS_READ.contains(&version.as_str()) {
        return Err(bad(
            path,
            format!(
                "version {version:?} is not supported (this loraq reads {})",
                ACTIVATION_STATS_VERSIONS_READ.join(", ")
            ),
        ));
    }
    let count = |key: &str| -> Result<u64> {
        let v = field(key)?;
        v.parse()
            .map_err(|_| bad(path, format!("metadata {key} {v:?} is not a count")))
    };
    let (tokens, records) = (count("tokens")?, count("records")?);
    if tokens == 0 {
        return Err(bad(path, "metadata tokens is 0"));
    }
    let mut input_sq_mean = BTreeMap::new();
    let mut input_abs_max = BTreeMap::new();
    for info in ckpt.tensors() {
        let tensor_err = |reason: String| IoError::Tensor {
            path: path.to_path_buf(),
            tensor: info.name.clone(),
            reason,
        };
        if let Some(module) = info
            .name
            .strip_suffix(INPUT_ABS_MAX_SUFFIX)
            .filter(|m| !m.is_empty() && version != "1")
        {
            if info.dtype != DType::F32 || info.shape.iter().product::<usize>() != 1 {
                return Err(tensor_err(format!(
                    "is {} {:?}; expected an F32 scalar",
                    info.dtype, info.shape
                )));
            }
            let amax = ckpt.read_f32(&info.name)?[0];
            if !amax.is_finite() || amax < 0.0 {
                return Err(tensor_err(format!("input absolute maximum is {amax}")));
            }
            input_abs_max.insert(module.to_string(), amax);
            continue;
        }
        let module = info
            .name
            .strip_suffix(INPUT_SQ_MEAN_SUFFIX)
            .filter(|m| !m.is_empty())
            .ok_or_else(|| tensor_err(format!("name does not end in {INPUT_SQ_MEAN_SUFFIX}")))?;
        if info.dtype != DType::F32 || info.shape.len() != 1 || info.shape[0] == 0 {
            return Err(tensor_err(format!(
                "is {} {:?}; expected F32 [in_features]",
                info.dtype, info.shape
            )));
        }
        let values = ckpt.read_f32(&info.name)?;
        if let Some((k, v)) = values
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite() || **v < 0.0)
        {
            return Err(tensor_err(format!("input feature {k} has mean square {v}")));
        }
        input_sq_mean.insert(module.to_string(), values);
    }
    if let Some(module) = input_abs_max
        .keys()
        .find(|m| !input_sq_mean.contains_key(*m))
    {
        return Err(bad(
            path,
            format!("{module}{INPUT_ABS_MAX_SUFFIX} has no {INPUT_SQ_MEAN_SUFFIX}"),
        ));
    }
    Ok(ActivationStats {
        tokens,
        records,
        input_sq_mean,
        input_abs_max,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats() -> ActivationStats {
        ActivationStats {
            tokens: 12,
            records: 3,
            input_sq_mean: BTreeMap::from([
                (
                    "model.layers.0.mlp.down_proj".to_string(),
                    vec![0.5, 2.0, 0.0],
                ),
                ("model.layers.0.mlp.up_proj".to_string(), vec![1.25]),
            ]),
            input_abs_max: BTreeMap::from([
                ("model.layers.0.mlp.down_proj".to_string(), 1.5),
                ("model.layers.0.mlp.up_proj".to_string(), 1.125),
            ]),
        }
    }

    #[test]
    fn round_trip_keeps_values_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats.safetensors");
        write_activation_stats(&path, &stats()).unwrap();
        assert_eq!(read_activation_stats(&path).unwrap(), stats());
        // The tensor names and metadata are the documented ones.
        let ckpt = Checkpoint::open(&path).unwrap();
        assert!(ckpt.contains("model.layers.0.mlp.down_proj.input_sq_mean"));
        let amax = ckpt
            .info("model.layers.0.mlp.down_proj.input_abs_max")
            .unwrap();
        assert_eq!((amax.dtype, amax.shape.as_slice()), (DType::F32, &[][..]));
        assert_eq!(ckpt.shard_metadata(0)["format"], "loraq-calibration");
        assert_eq!(ckpt.shard_metadata(0)["version"], "2");
        assert_eq!(ckpt.shard_metadata(0)["tokens"], "12");
        assert_eq!(ckpt.shard_metadata(0)["records"], "3");
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn negative_or_nan_values_are_refused_with_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats.safetensors");
        let mut s = stats();
        s.input_sq_mean
            .get_mut("model.layers.0.mlp.up_proj")
            .unwrap()[0] = f32::NAN;
        let err = write_activation_stats(&path, &s).unwrap_err().to_string();
        assert!(err.contains("model.layers.0.mlp.up_proj"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn other_safetensors_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.safetensors");
        let bytes = crate::convert::f32_to_le_bytes(&[1.0]);
        write_safetensors_file(
            &path,
            &[(TensorSpec::new("x.weight", DType::F32, vec![1]), &bytes)],
            &BTreeMap::new(),
        )
        .unwrap();
        let err = read_activation_stats(&path).unwrap_err().to_string();
        assert!(err.contains("format"), "{err}");
        let metadata = BTreeMap::from([
            ("format".to_string(), ACTIVATION_STATS_FORMAT.to_string()),
            ("version".to_string(), "1".to_string()),
            ("tokens".to_string(), "4".to_string()),
            ("records".to_string(), "1".to_string()),
        ]);
        write_safetensors_file(
            &path,
            &[(TensorSpec::new("x.weight", DType::F32, vec![1]), &bytes)],
            &metadata,
        )
        .unwrap();
        let err = read_activation_stats(&path).unwrap_err().to_string();
        assert!(
            err.contains("x.weight") && err.contains("input_sq_mean"),
            "{err}"
        );
    }

    #[test]
    fn version_1_files_read_without_absolute_maxima() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.safetensors");
        let bytes = crate::convert::f32_to_le_bytes(&[0.5, 2.0]);
        let metadata = BTreeMap::from([
            ("format".to_string(), ACTIVATION_STATS_FORMAT.to_string()),
            ("version".to_string(), "1".to_string()),
            ("tokens".to_string(), "4".to_string()),
            ("records".to_string(), "1".to_string()),
        ]);
        write_safetensors_file(
            &path,
            &[(
                TensorSpec::new("m.input_sq_mean", DType::F32, vec![2]),
                &bytes,
            )],
            &metadata,
        )
        .unwrap();
        let stats = read_activation_stats(&path).unwrap();
        assert_eq!(stats.module("m"), Some(&[0.5, 2.0][..]));
        assert!(stats.input_abs_max.is_empty());
        assert_eq!(stats.abs_max("m"), None);
    }

    #[test]
    fn non_finite_absolute_maximum_is_refused_with_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats.safetensors");
        let mut s = stats();
        s.input_abs_max
            .insert("model.layers.0.mlp.up_proj".to_string(), f32::INFINITY);
        let err = write_activation_stats(&path, &s).unwrap_err().to_string();
        assert!(err.contains("model.layers.0.mlp.up_proj"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
