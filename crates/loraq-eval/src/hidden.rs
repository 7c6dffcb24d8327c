//! Hidden-state comparison: two safetensors files with the same tensor names (one
//! tensor per layer, rows = records), compared tensor by tensor.

use std::cmp::Ordering;
use std::path::Path;

use loraq_io::{Checkpoint, DType};
use serde::Serialize;

use crate::error::{EvalError, Result};

/// The comparison of one tensor of A (the reference) with the same tensor of B.
///
/// With a = A flattened, b = B flattened, e = b - a, all accumulated in f64:
/// cosine = <a, b> / (|a| |b|), relative L2 = |e| / |a|, SQNR = 10 log10(|a|^2 / |e|^2) dB.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HiddenComparison {
    /// Tensor name.
    pub name: String,
    /// Shape (the same in both files).
    pub shape: Vec<usize>,
    /// Cosine similarity of the flattened tensors (null when either is all zero).
    pub cosine: Option<f64>,
    /// Smallest cosine between matching rows (first dimension = records), over the
    /// rows where neither side is zero; null for 1-D tensors or no such row.
    pub min_row_cosine: Option<f64>,
    /// |B - A| / |A| (null when A is all zero).
    pub relative_l2: Option<f64>,
    /// Signal-to-quantization-noise ratio in dB (null when A is all zero or the
    /// tensors are identical: see `identical`).
    pub sqnr_db: Option<f64>,
    /// The two tensors hold exactly the same values.
    pub identical: bool,
}

/// Compares every tensor of two hidden-state files (or checkpoints). Both must have
/// the same tensor names and shapes; dtypes may differ (values are compared as
/// f64). Rows come in natural name order ("layers.2" before "layers.10").
pub fn compare_hidden(a: impl AsRef<Path>, b: impl AsRef<Path>) -> Result<Vec<HiddenComparison>> {
    let (a_path, b_path) = (a.as_ref(), b.as_ref());
    let a = Checkpoint::open(a_path)?;
    let b = Checkpoint::open(b_path)?;
    for (ours, theirs, theirs_path) in [(&a, &b, b_path), (&b, &a, a_path)] {
        if let Some(missing) = ours.tensors().find(|t| !theirs.contains(&t.name)) {
            return Err(EvalError::Hidden {
                path: theirs_path.to_path_buf(),
                tensor: missing.name.clone(),
                reason: "missing (the two files must hold the same tensors)".into(),
            });
        }
    }
    let mut names: Vec<&str> = a.tensors().map(|t| t.name.as_str()).collect();
    names.sort_by(|x, y| natural_cmp(x, y));
    let mut rows = Vec::with_capacity(names.len());
    for name in names {
        let (ia, ib) = (a.info(name)?, b.info(name)?);
        if ia.shape != ib.shape {
            return Err(EvalError::Hidden {
                path: b_path.to_path_buf(),
                tensor: name.to_string(),
                reason: format!(
                    "shape {:?} differs from {:?} in {}",
                    ib.shape,
                    ia.shape,
                    a_path.display()
                ),
            });
        }
        let x = read_f64(&a, a_path, name)?;
        let y = read_f64(&b, b_path, name)?;
        let row_len = match ia.shape.as_slice() {
            [rows, ..] if ia.shape.len() >= 2 && *rows > 0 => Some(x.len() / rows),
            _ => None,
        };
        rows.push(compare_values(name, &ia.shape, &x, &y, row_len));
    }
    Ok(rows)
}

fn read_f64(ckpt: &Checkpoint, path: &Path, name: &str) -> Result<Vec<f64>> {
    let info = ckpt.info(name)?;
    if !info.dtype.is_float() {
        return Err(EvalError::Hidden {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!("dtype {} is not a float type", info.dtype),
        });
    }
    let values: Vec<f64> = if info.dtype == DType::F64 {
        // Kept in full precision (read_f32 would round it).
        ckpt.bytes(name)?
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()
    } else {
        ckpt.read_f32(name)?.into_iter().map(f64::from).collect()
    };
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(EvalError::Hidden {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!("element {i} is not finite ({})", values[i]),
        });
    }
    Ok(values)
}

/// Sums of <x, y>, |x|^2, |y|^2 and |y - x|^2 in f64.
fn sums(x: &[f64], y: &[f64]) -> (f64, f64, f64, f64) {
    let (mut dot, mut xx, mut yy, mut ee) = (0.0, 0.0, 0.0, 0.0);
    for (&a, &b) in x.iter().zip(y) {
        dot += a * b;
        xx += a * a;
        yy += b * b;
        ee += (b - a) * (b - a);
    }
    (dot, xx, yy, ee)
}

fn compare_values(
    name: &str,
    shape: &[usize],
    x: &[f64],
    y: &[f64],
    row_len: Option<usize>,
) -> HiddenComparison {
    let (dot, xx, yy, ee) = sums(x, y);
    let cosine = (xx > 0.0 && yy > 0.0).then(|| dot / (xx.sqrt() * yy.sqrt()));
    let min_row_cosine = row_len.filter(|&len| len > 0).and_then(|len| {
        x.chunks_exact(len)
            .zip(y.chunks_exact(len))
            .filter_map(|(rx, ry)| {
                let (d, a, b, _) = sums(rx, ry);
                (a > 0.0 && b > 0.0).then(|| d / (a.sqrt() * b.sqrt()))
            })
            .min_by(f64::total_cmp)
    });
    let identical = x == y;
    HiddenComparison {
        name: name.to_string(),
        shape: shape.to_vec(),
        cosine,
        min_row_cosine,
        relative_l2: (xx > 0.0).then(|| ee.sqrt() / xx.sqrt()),
        sqnr_db: (xx > 0.0 && ee > 0.0).then(|| 10.0 * (xx / ee).log10()),
        identical,
    }
}

/// Natural order: digit runs compare as numbers, so "layers.2" < "layers.10".
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let da = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let db = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (na, nb) = (trim_zeros(&a[..da]), trim_zeros(&b[..db]));
                let order = na
                    .len()
                    .cmp(&nb.len())
                    .then_with(|| na.cmp(nb))
                    .then(da.cmp(&db));
                if order != Ordering::Equal {
                    return order;
                }
                a = &a[da..];
                b = &b[db..];
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}

fn trim_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&c| c == b'0').count();
    &digits[zeros..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_puts_2_before_10() {
        let mut names = vec!["layers.10", "layers.2", "embed", "layers.02x", "layers.1"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            names,
            vec!["embed", "layers.1", "layers.2", "layers.02x", "layers.10"]
        );
    }

    #[test]
    fn identical_tensors_have_no_finite_sqnr() {
        let r = compare_values(
            "t",
            &[2, 2],
            &[1.0, 2.0, 3.0, 4.0],
            &[1.0, 2.0, 3.0, 4.0],
            Some(2),
        );
        assert!(r.identical);
        assert_eq!(r.relative_l2, Some(0.0));
        assert_eq!(r.sqnr_db, None);
        assert!((r.cosine.unwrap() - 1.0).abs() < 1e-15);
    }
}
