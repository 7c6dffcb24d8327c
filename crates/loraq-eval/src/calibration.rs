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
    let sorted = sorted_keys(confidence);
    let (base, larger) = (n / bins, n % bins);
    // Group g holds ranks starts[g]..starts[g + 1] of the stable order.
    let mut starts = Vec::with_capacity(bins + 1);
    let mut start = 0;
    for g in 0..bins {
        starts.push(start);
        start += base + usize::from(g < larger);
    }
    starts.push(n);
    let correct_below = correct_below_ranks(&sorted, confidence, correct, &starts);
    let mut ece = 0.0;
    for g in 0..bins {
        let size = starts[g + 1] - starts[g];
        if size == 0 {
            continue;
        }
        let mean_confidence = sorted[starts[g]..starts[g + 1]]
            .iter()
            .map(|&key| confidence_of_key(key))
            .sum::<f64>()
            / size as f64;
        let accuracy = (correct_below[g + 1] - correct_below[g]) as f64 / size as f64;
        ece += size as f64 / n as f64 * (accuracy - mean_confidence).abs();
    }
    Some(ece)
}

/// For each rank `r` of `ranks` (ascending), how many of the first `r` questions of
/// the stable order by confidence (ties in input order) are correct, without
/// ordering the questions themselves: the first `r` are those whose key is below
/// the key at rank `r` and the first few, in input order, of those whose key equals
/// it (as many as rank `r` lies past the first of that key in `sorted`).
fn correct_below_ranks(
    sorted: &[u64],
    confidence: &[f64],
    correct: &[bool],
    ranks: &[usize],
) -> Vec<usize> {
    // (key at the rank, questions of that key before the rank); past the end every
    // question lies below.
    let bounds: Vec<(u64, usize)> = ranks
        .iter()
        .map(|&rank| match sorted.get(rank) {
            Some(&key) => (key, rank - sorted.partition_point(|&k| k < key)),
            None => (u64::MAX, usize::MAX),
        })
        .collect();
    // A correct question counts for every bound from some index on: one increment
    // there, then a running sum.
    let mut first_counted = vec![0usize; bounds.len() + 1];
    // Questions seen so far of the key of the bounds starting at each index.
    let mut ties_seen = vec![0usize; bounds.len()];
    for (&c, &ok) in confidence.iter().zip(correct) {
        let key = total_order_key(c);
        let below = bounds.partition_point(|&(k, _)| k < key);
        let mut from = below;
        if bounds.get(below).is_some_and(|&(k, _)| k == key) {
            let seen = ties_seen[below];
            ties_seen[below] += 1;
            while bounds
                .get(from)
                .is_some_and(|&(k, need)| k == key && need <= seen)
            {
                from += 1;
            }
        }
        if ok {
            first_counted[from] += 1;
        }
    }
    let mut running = 0;
    first_counted[..bounds.len()]
        .iter()
        .map(|&count| {
            running += count;
            running
        })
        .collect()
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

/// The confidences' [`total_order_key`]s in ascending order, by a
/// least-significant-digit radix sort (11 bits a pass; a digit every key shares is
/// skipped), linear in the number of questions. Equal keys are equal confidences,
/// so the order of ties is not needed here ([`correct_below_ranks`] places them).
fn sorted_keys(confidence: &[f64]) -> Vec<u64> {
    const BITS: u32 = 11;
    const DIGITS: usize = 64_usize.div_ceil(BITS as usize);
    const BUCKETS: usize = 1 << BITS;
    let digit = |key: u64, pass: usize| (key >> (BITS as usize * pass)) as usize & (BUCKETS - 1);
    let mut keys: Vec<u64> = confidence.iter().map(|&c| total_order_key(c)).collect();
    let mut counts = vec![[0usize; BUCKETS]; DIGITS];
    for &key in &keys {
        for (pass, count) in counts.iter_mut().enumerate() {
            count[digit(key, pass)] += 1;
        }
    }
    let mut scattered = vec![0u64; keys.len()];
    for (pass, count) in counts.iter().enumerate() {
        if count.contains(&keys.len()) {
            continue;
        }
        let mut next = [0usize; BUCKETS];
        let mut total = 0;
        for (next, &count) in next.iter_mut().zip(count) {
            *next = total;
            total += count;
        }
        for &key in &keys {
            let d = digit(key, pass);
            scattered[next[d]] = key;
            next[d] += 1;
        }
        std::mem::swap(&mut keys, &mut scattered);
    }
    keys
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
    fn radix_order_is_the_total_order() {
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
        let mut expected = values.to_vec();
        expected.sort_by(f64::total_cmp);
        let ours: Vec<u64> = sorted_keys(&values)
            .iter()
            .map(|&key| confidence_of_key(key).to_bits())
            .collect();
        let expected: Vec<u64> = expected.iter().map(|v| v.to_bits()).collect();
        assert_eq!(ours, expected);
    }

    /// The definition: questions stably sorted by confidence, split as
    /// `numpy.array_split`, sums in sorted order.
    fn adaptive_by_stable_sort(confidence: &[f64], correct: &[bool], bins: usize) -> f64 {
        let n = confidence.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| confidence[a].total_cmp(&confidence[b]));
        let (base, larger) = (n / bins, n % bins);
        let (mut start, mut ece) = (0, 0.0);
        for g in 0..bins {
            let size = base + usize::from(g < larger);
            if size == 0 {
                continue;
            }
            let group = &order[start..start + size];
            start += size;
            let mean = group.iter().map(|&i| confidence[i]).sum::<f64>() / size as f64;
            let accuracy = group.iter().filter(|&&i| correct[i]).count() as f64 / size as f64;
            ece += size as f64 / n as f64 * (accuracy - mean).abs();
        }
        ece
    }

    #[test]
    fn adaptive_ece_places_ties_as_a_stable_sort() {
        // Few distinct confidences, so that ties straddle the group boundaries.
        let mut state = 3u64;
        let mut next = |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % bound
        };
        for trial in 0..300 {
            let n = 1 + next(400) as usize;
            let distinct = 1 + next(if trial % 2 == 0 { 5 } else { 1000 });
            let confidence: Vec<f64> = (0..n)
                .map(|_| 0.25 + 0.75 * next(distinct) as f64 / distinct as f64)
                .collect();
            let correct: Vec<bool> = (0..n).map(|_| next(2) == 0).collect();
            for bins in [1, 2, 3, 7, 15, n, n + 3] {
                let ours = adaptive_calibration_error(&confidence, &correct, bins).unwrap();
                let expected = adaptive_by_stable_sort(&confidence, &correct, bins);
                assert_eq!(ours.to_bits(), expected.to_bits(), "n {n}, bins {bins}");
            }
        }
    }
}
