//! `loraq check`: two adapter directories compared: module sets, shapes, ranks,
//! configurations, reconstructed deltas, and factor pairs up to a shared sign.

use crate::error::Result;
use crate::ordered_sum::fold_in_order;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use loraq_io::module_name::text_module_path;
use loraq_io::{AdapterConfig, LoraAdapter, ModulePathMap};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// How the factor pairs of a module compare, component by component.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FactorPairs {
    /// Components whose A row and B column are bit-identical.
    pub identical: usize,
    /// Components equal after negating both A's row and B's column (an SVD sign).
    pub equal_up_to_sign: usize,
    /// Components that differ otherwise.
    pub different: usize,
}

/// One module present in both adapters.
#[derive(Debug, Clone, Serialize)]
pub struct CheckedModule {
    /// Module path.
    pub module: String,
    /// `[out, in, rank]` in the first adapter.
    pub first: [usize; 3],
    /// `[out, in, rank]` in the second.
    pub second: [usize; 3],
    /// $\\|\Delta_1 - \Delta_2\\|_F / \\|\Delta_1\\|_F$ with $\Delta = s\\,BA$ (None when shapes differ).
    pub relative_difference: Option<f64>,
    /// Factor pairs (None when ranks or shapes differ).
    pub factor_pairs: Option<FactorPairs>,
}

/// The comparison.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// Modules both adapters have.
    pub modules: Vec<CheckedModule>,
    /// Modules only the first has.
    pub only_in_first: Vec<String>,
    /// Modules only the second has.
    pub only_in_second: Vec<String>,
    /// Configuration fields that differ and change what the adapter computes.
    pub config_differences: Vec<String>,
    /// Configuration fields that differ but are informational (base path, revision).
    pub config_notes: Vec<String>,
    /// The worst relative difference of reconstructed deltas.
    pub worst_relative_difference: f64,
    /// The module with it.
    pub worst_module: Option<String>,
    /// Allowed relative difference.
    pub tolerance: f64,
    /// True when module sets, shapes, ranks and configs agree and every delta is within
    /// the tolerance.
    pub passed: bool,
}

fn config_differences(a: &AdapterConfig, b: &AdapterConfig) -> (Vec<String>, Vec<String>) {
    let mut differences = Vec::new();
    let mut notes = Vec::new();
    let mut field = |name: &str, x: String, y: String, material: bool| {
        if x != y {
            let line = format!("{name}: {x} vs {y}");
            if material {
                differences.push(line)
            } else {
                notes.push(line)
            }
        }
    };
    field("r", a.r.to_string(), b.r.to_string(), true);
    field(
        "lora_alpha",
        a.lora_alpha.to_string(),
        b.lora_alpha.to_string(),
        true,
    );
    let sorted = |v: &[String]| {
        let mut v = v.to_vec();
        v.sort();
        format!("{v:?}")
    };
    field(
        "target_modules",
        sorted(&a.target_modules),
        sorted(&b.target_modules),
        true,
    );
    // Pattern keys compared in one naming, so that the same adapter written with
    // `--names text` and `--names checkpoint` agrees.
    fn text_keys<V: std::fmt::Debug>(pattern: &BTreeMap<String, V>) -> String {
        let keys: BTreeMap<String, &V> = pattern
            .iter()
            .map(|(k, v)| match k.strip_prefix('^') {
                Some(path) => (format!("^{}", text_module_path(path)), v),
                None => (text_module_path(k), v),
            })
            .collect();
        format!("{keys:?}")
    }
    field(
        "rank_pattern",
        text_keys(&a.rank_pattern),
        text_keys(&b.rank_pattern),
        true,
    );
    field(
        "alpha_pattern",
        text_keys(&a.alpha_pattern),
        text_keys(&b.alpha_pattern),
        true,
    );
    field(
        "use_rslora",
        a.use_rslora.to_string(),
        b.use_rslora.to_string(),
        true,
    );
    field(
        "fan_in_fan_out",
        a.fan_in_fan_out.to_string(),
        b.fan_in_fan_out.to_string(),
        true,
    );
    field("bias", a.bias.clone(), b.bias.clone(), true);
    field(
        "base_model_name_or_path",
        format!("{:?}", a.base_model_name_or_path),
        format!("{:?}", b.base_model_name_or_path),
        false,
    );
    field(
        "revision",
        format!("{:?}", a.revision),
        format!("{:?}", b.revision),
        false,
    );
    (differences, notes)
}

fn delta(b: &[f32], a: &[f32], rows: usize, cols: usize, rank: usize, par: Par) -> Mat<f32> {
    let mut out = Mat::<f32>::zeros(rows, cols);
    matmul(
        out.as_mut(),
        Accum::Replace,
        MatRef::from_row_major_slice(b, rows, rank),
        MatRef::from_row_major_slice(a, rank, cols),
        1.0,
        par,
    );
    out
}

fn compare_pairs(
    a1: &[f32],
    b1: &[f32],
    a2: &[f32],
    b2: &[f32],
    rank: usize,
    cols: usize,
) -> FactorPairs {
    let mut pairs = FactorPairs::default();
    let rows = b1.len() / rank.max(1);
    for l in 0..rank {
        let row1 = &a1[l * cols..(l + 1) * cols];
        let row2 = &a2[l * cols..(l + 1) * cols];
        let col = |b: &[f32]| -> Vec<f32> { (0..rows).map(|i| b[i * rank + l]).collect() };
        let (c1, c2) = (col(b1), col(b2));
        let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        let negated = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| *p == -*q);
        if same(row1, row2) && same(&c1, &c2) {
            pairs.identical += 1;
        } else if negated(row1, row2) && negated(&c1, &c2) {
            pairs.equal_up_to_sign += 1;
        } else {
            pairs.different += 1;
        }
    }
    pairs
}

/// Compares adapters `first` and `second`.
/// `threads` sizes the products (0: all cores).
pub fn check(
    first: &Path,
    second: &Path,
    tolerance: f64,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<CheckReport> {
    let par = Par::rayon(threads);
    let x = LoraAdapter::open(first)?;
    let y = LoraAdapter::open(second)?;
    let (config_differences, mut config_notes) = config_differences(&x.config, &y.config);
    // The second adapter's modules in the first's naming (model.layers.* and
    // model.language_model.layers.* name the same module), so either naming compares.
    let first_names =
        ModulePathMap::from_module_paths(x.modules.iter().map(|m| m.module_path.as_str()));
    let second_of_first: BTreeMap<&str, &str> = y
        .modules
        .iter()
        .filter_map(|m| Some((first_names.resolve(&m.module_path)?, m.module_path.as_str())))
        .collect();
    let renamed = second_of_first.iter().filter(|(a, b)| a != b).count();
    if renamed > 0 {
        config_notes.push(format!(
            "module names: {renamed} module(s) of the second adapter are named in the other naming (model.layers.* vs model.language_model.layers.*) and compared as the same modules"
        ));
    }
    let only_in_first: Vec<String> = x
        .modules
        .iter()
        .filter(|m| !second_of_first.contains_key(m.module_path.as_str()))
        .map(|m| m.module_path.clone())
        .collect();
    let only_in_second: Vec<String> = y
        .modules
        .iter()
        .filter(|m| first_names.resolve(&m.module_path).is_none())
        .map(|m| m.module_path.clone())
        .collect();
    let mut modules = Vec::new();
    for (i, mx) in x.modules.iter().enumerate() {
        progress(i, x.modules.len(), &mx.module_path);
        let Some(my) = second_of_first
            .get(mx.module_path.as_str())
            .and_then(|p| y.module(p))
        else {
            continue;
        };
        let first_shape = [mx.out_features, mx.in_features, mx.rank];
        let second_shape = [my.out_features, my.in_features, my.rank];
        let (a1, b1) = (
            x.read_a_f32(&mx.module_path)?,
            x.read_b_f32(&mx.module_path)?,
        );
        let (a2, b2) = (
            y.read_a_f32(&my.module_path)?,
            y.read_b_f32(&my.module_path)?,
        );
        let same_shape = first_shape[..2] == second_shape[..2];
        let relative_difference = same_shape.then(|| {
            let (rows, cols) = (mx.out_features, mx.in_features);
            let d1 = delta(&b1, &a1, rows, cols, mx.rank, par);
            let d2 = delta(&b2, &a2, rows, cols, my.rank, par);
            let (s1, s2) = (mx.scale, my.scale);
            let (num, den) = fold_in_order(
                (0..cols).into_par_iter().map(|j| {
                    let (c1, c2) = (d1.col(j), d2.col(j));
                    let mut num = 0f64;
                    let mut den = 0f64;
                    for i in 0..rows {
                        let p = s1 * c1[i] as f64;
                        let q = s2 * c2[i] as f64;
                        num += (p - q) * (p - q);
                        den += p * p;
                    }
                    (num, den)
                }),
                (0.0, 0.0),
                |a, b| (a.0 + b.0, a.1 + b.1),
            );
            if den > 0.0 {
                (num / den).sqrt()
            } else if num > 0.0 {
                f64::INFINITY
            } else {
                0.0
            }
        });
        let factor_pairs = (first_shape == second_shape)
            .then(|| compare_pairs(&a1, &b1, &a2, &b2, mx.rank, mx.in_features));
        modules.push(CheckedModule {
            module: mx.module_path.clone(),
            first: first_shape,
            second: second_shape,
            relative_difference,
            factor_pairs,
        });
    }
    progress(x.modules.len(), x.modules.len(), "");
    let worst = modules
        .iter()
        .filter_map(|m| m.relative_difference.map(|d| (d, &m.module)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let worst_relative_difference = worst.map_or(0.0, |w| w.0);
    let shapes_agree = modules.iter().all(|m| m.first == m.second);
    let passed = only_in_first.is_empty()
        && only_in_second.is_empty()
        && config_differences.is_empty()
        && shapes_agree
        && worst_relative_difference <= tolerance;
    Ok(CheckReport {
        worst_module: worst.map(|w| w.1.clone()),
        modules,
        only_in_first,
        only_in_second,
        config_differences,
        config_notes,
        worst_relative_difference,
        tolerance,
        passed,
    })
}
