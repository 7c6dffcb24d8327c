//! Top-label calibration: expected calibration error over equal-width and
//! equal-mass bins, and the reliability table behind the diagram.

use serde::Serialize;

/// One equal-width confidence bin (lo, hi] of a reliability table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReliabilityBin {
    /// Lower edge (exclusive).
    pub lo: f64,
    /// Upper edge (inclusive).
    pub hi: f64,
    /// Questions whose confidence falls in the bin.
    pub count: usize,
    /// Mean confidence of those questions (`None` when empty).
    pub mean_confidence: Option<f64>,
    /// Share of them answered correctly (`None` when empty).
    pub accuracy: Option<f64>,
}

/// Bin edges 0 = e_0 < e_1 < ... < e_bins = 1 with e_i = i * (1 / bins), exactly as
/// `numpy.linspace(0, 1, bins + 1)` computes them (the last forced to 1).
pub fn bin_edges(bins: usize) -> Vec<f64> {
    let step = 1.0 / bins as f64;
    let mut edges: Vec<f64> = (0..=bins).map(|i| i as f64 * step).collect();
    edges[bins] = 1.0;
    edges
}

/// Equal-width reliability table: bin b holds confidences c with e_b < c <= e_(b+1)
/// (a confidence of exactly 0, impossible for a top-1 probability, goes to bin 0).
pub fn reliability_table(confidence: &[f64], correct: &[bool], bins: usize) -> Vec<ReliabilityBin> {
    assert_eq!(confidence.len(), correct.len());
    assert!(bins > 0, "bins must be positive");
    let edges = bin_edges(bins);
    let mut count = vec![0usize; bins];
    let mut sum_confidence = vec![0.0f64; bins];
    let mut sum_correct = vec![0usize; bins];
    for (&c, &ok) in confidence.iter().zip(correct) {
        // First edge >= c; the bin is the one ending there.
        let first_not_below = edges.partition_point(|&e| e < c);
        let b = first_not_below.saturating_sub(1).min(bins - 1);
        count[b] += 1;
        sum_confidence[b] += c;
        sum_correct[b] += usize::from(ok);
    }
    (0..bins)
        .map(|b| ReliabilityBin {
            lo: edges[b],
            hi: edges[b + 1],
            count: count[b],
            mean_confidence: (count[b] > 0).then(|| sum_confidence[b] / count[b] as f64),
            accuracy: (count[b] > 0).then(|| sum_correct[b] as f64 / count[b] as f64),
        })
        .collect()
}

/// Expected calibration error of a reliability table:
/// sum_b (n_b / N) |accuracy_b - mean confidence_b|. `None` when the table is empty.
pub fn expected_calibration_error(table: &[ReliabilityBin]) -> Option<f64> {
    let total: usize = table.iter().map(|b| b.count).sum();
    if total == 0 {
        return None;
    }
    Some(
        table
            .iter()
            .filter_map(|b| {
                let gap = (b.accuracy? - b.mean_confidence?).abs();
                Some(b.count as f64 / total as f64 * gap)
            })
            .sum(),
    )
}

/// Adaptive (equal-mass) ECE: questions sorted by confidence (stable, so ties keep
/// their input order), split into `bins` consecutive groups whose sizes differ by
/// at most one, the larger ones first (`numpy.array_split`); then
/// sum_g (n_g / N) |accuracy_g - mean confidence_g| over non-empty groups.
/// `None` when there are no questions.
pub fn adaptive_calibration_error(
    confidence: &[f64],
    correct: &[bool],
    bins: usize,
) -> Option<f64> {
    assert_eq!(confidence.len(), correct.len());
    assert!(bins > 0, "bins must be positive");
    let n = confidence.len();
    if n == 0 {
        return None;
    }
    let sorted = sorted_by_confidence(confidence, correct);
    let (base, larger) = (n / bins, n % bins);
    let mut start = 0;
    let mut ece = 0.0;
    for g in 0..bins {
        let size = base + usize::from(g < larger);
        if size == 0 {
            continue;
        }
        let group = &sorted[start..start + size];
        start += size;
        let mean_confidence = group
            .iter()
            .map(|&(key, _)| confidence_of_key(key))
            .sum::<f64>()
            / size as f64;
        let accuracy = group.iter().filter(|&&(_, ok)| ok).count() as f64 / size as f64;
        ece += size as f64 / n as f64 * (accuracy - mean_confidence).abs();
    }
    Some(ece)
}

/// The key of `x` in `f64::total_cmp`'s order, as an unsigned integer.
fn total_order_key(x: f64) -> u64 {
    let bits = x.to_bits();
    // total_cmp flips the magnitude bits of negatives; flipping the sign bit as well
    // turns its signed comparison into an unsigned one.
    (bits ^ ((((bits as i64) >> 63) as u64) >> 1)) ^ (1 << 63)
}

/// The inverse of [`total_order_key`].
fn confidence_of_key(key: u64) -> f64 {
    let bits = key ^ (1 << 63);
    f64::from_bits(bits ^ ((((bits as i64) >> 63) as u64) >> 1))
}

/// (confidence key, correct) sorted by confidence in `f64::total_cmp`'s order, ties
/// in input order: what a stable sort of the questions by confidence gives, by a
/// least-significant-digit radix sort (byte by byte, each pass stable; a byte every
/// key shares is skipped), linear in the number of questions.
fn sorted_by_confidence(confidence: &[f64], correct: &[bool]) -> Vec<(u64, bool)> {
    let mut items: Vec<(u64, bool)> = confidence
        .iter()
        .zip(correct)
        .map(|(&c, &ok)| (total_order_key(c), ok))
        .collect();
    let mut counts = vec![[0usize; 256]; 8];
    for &(key, _) in &items {
        for (byte, count) in counts.iter_mut().enumerate() {
            count[(key >> (8 * byte)) as usize & 0xFF] += 1;
        }
    }
    let mut scattered = vec![(0u64, false); items.len()];
    for (byte, count) in counts.iter().enumerate() {
        if count.contains(&items.len()) {
            continue;
        }
        let mut next = [0usize; 256];
        let mut total = 0;
        for (next, &count) in next.iter_mut().zip(count) {
            *next = total;
            total += count;
        }
        for &item in &items {
            let digit = (item.0 >> (8 * byte)) as usize & 0xFF;
            scattered[next[digit]] = item;
            next[digit] += 1;
        }
        std::mem::swap(&mut items, &mut scattered);
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_values_go_to_the_bin_they_close() {
        let table = reliability_table(&[0.2, 1.0, 0.5], &[true, true, false], 5);
        // 0.2 closes (0, 0.2]; 1.0 closes (0.8, 1]; 0.5 is inside (0.4, 0.6].
        let counts: Vec<usize> = table.iter().map(|b| b.count).collect();
        assert_eq!(counts, vec![1, 0, 1, 0, 1]);
    }

    #[test]
    fn perfectly_calibrated_bins_have_zero_ece() {
        let conf = [0.75; 4];
        let correct = [true, true, true, false];
        let table = reliability_table(&conf, &correct, 15);
        assert_eq!(expected_calibration_error(&table), Some(0.0));
        assert_eq!(adaptive_calibration_error(&conf, &correct, 1), Some(0.0));
    }

    #[test]
    fn radix_order_is_a_stable_sort_by_total_order() {
        let values = [
            0.5,
            -0.0,
            0.0,
            1.0,
            0.25,
            -3.0,
            0.5,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            0.5,
            1e300,
            -1e-300,
            0.7,
        ];
        let correct: Vec<bool> = (0..values.len()).map(|i| i % 2 == 0).collect();
        let mut expected: Vec<usize> = (0..values.len()).collect();
        expected.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
        let sorted = sorted_by_confidence(&values, &correct);
        let got: Vec<(u64, bool)> = expected
            .iter()
            .map(|&i| (values[i].to_bits(), correct[i]))
            .collect();
        let ours: Vec<(u64, bool)> = sorted
            .iter()
            .map(|&(key, ok)| (confidence_of_key(key).to_bits(), ok))
            .collect();
        assert_eq!(ours, got);
    }
}
