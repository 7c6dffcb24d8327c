//! Small exact statistics: means with standard errors, percentiles, the Wilson
//! interval, the exact binomial test behind McNemar's test, and the paired bootstrap.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Binomial, Distribution};

/// $z = \Phi^{-1}(0.975)$, the two-sided 95% normal quantile.
pub const Z_95: f64 = 1.959_963_984_540_054;

/// Arithmetic mean; `None` for an empty slice.
pub fn mean(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        None
    } else {
        Some(values.iter().sum::<f64>() / values.len() as f64)
    }
}

/// Standard error of the mean with $N - 1$: $\sqrt{\sum_i (x_i - \bar x)^2 / (N - 1)} / \sqrt{N}$.
///
/// This equals llama.cpp's `sqrt((<x^2> - <x>^2) / (N - 1))` (its KL-divergence
/// statistics), computed in two passes so it does not cancel; llama.cpp prints 0
/// for N <= 10, this gives the value for every N >= 2 and `None` below.
pub fn standard_error(values: &[f64]) -> Option<f64> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let m = mean(values)?;
    let ss: f64 = values.iter().map(|x| (x - m) * (x - m)).sum();
    Some((ss / (n - 1) as f64).sqrt() / (n as f64).sqrt())
}

/// Percentile `q` (0..=100) of ascending `sorted` values by linear interpolation
/// between closest ranks: position $h = (q / 100)(N - 1)$, exactly numpy's default
/// (`method="linear"`, including its two-sided lerp). `None` for an empty slice.
pub fn percentile_sorted(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let (i, t) = percentile_rank(q, n);
    Some(lerp(sorted[i], sorted[(i + 1).min(n - 1)], t))
}

/// The rank below percentile `q` of `n > 0` values and the fraction of the way to
/// the next one.
fn percentile_rank(q: f64, n: usize) -> (usize, f64) {
    let h = (q / 100.0) * (n - 1) as f64;
    let below = h.floor();
    ((below as usize).min(n - 1), h - below)
}

/// numpy's two-sided lerp between neighbouring order statistics.
fn lerp(a: f64, b: f64, t: f64) -> f64 {
    let d = b - a;
    if t >= 0.5 {
        b - d * (1.0 - t)
    } else {
        a + d * t
    }
}

/// Percentiles `qs` of unsorted values, each the value [`percentile_sorted`] gives on
/// the sorted values, found by selection (`select_nth_unstable_by`, linear time per
/// rank) instead of a sort: an order statistic of the total order is one value
/// whatever the order of its ties. `None` for an empty slice.
pub fn percentiles(values: &[f64], qs: &[f64]) -> Option<Vec<f64>> {
    percentiles_in_place(&mut values.to_vec(), qs)
}

/// [`percentiles`] of `values`, which it reorders instead of copying them (the
/// same values come out: the selection sees the same input either way).
pub fn percentiles_in_place(values: &mut [f64], qs: &[f64]) -> Option<Vec<f64>> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let mut ranks: Vec<usize> = qs
        .iter()
        .flat_map(|&q| {
            let (i, _) = percentile_rank(q, n);
            [i, (i + 1).min(n - 1)]
        })
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    let work = values;
    let mut order_statistics = Vec::with_capacity(ranks.len());
    // Ascending ranks: each selection runs on what lies above the previous rank.
    let mut below = 0;
    for &rank in &ranks {
        let (_, value, _) = work[below..].select_nth_unstable_by(rank - below, f64::total_cmp);
        order_statistics.push(*value);
        below = rank + 1;
    }
    let at = |rank: usize| order_statistics[ranks.binary_search(&rank).expect("selected")];
    Some(
        qs.iter()
            .map(|&q| {
                let (i, t) = percentile_rank(q, n);
                lerp(at(i), at((i + 1).min(n - 1)), t)
            })
            .collect(),
    )
}

/// Median (the 50th percentile by [`percentile_sorted`]) of unsorted values, by
/// selection ([`percentiles`]).
pub fn median(values: &[f64]) -> Option<f64> {
    percentiles(values, &[50.0]).map(|p| p[0])
}

/// Wilson score 95% interval of a proportion $k / n$, with the bounds exactly 0 at
/// $k = 0$ and 1 at $k = n$ (scipy's `binomtest(k, n).proportion_ci(method="wilson")`).
/// `None` when $n = 0$.
pub fn wilson_interval(k: usize, n: usize) -> Option<[f64; 2]> {
    if n == 0 {
        return None;
    }
    let (kf, nf) = (k as f64, n as f64);
    let p = kf / nf;
    let z = Z_95;
    let denom = 2.0 * (nf + z * z);
    let center = (2.0 * nf * p + z * z) / denom;
    let delta = z / denom * (4.0 * nf * p * (1.0 - p) + z * z).sqrt();
    let lo = if k == 0 { 0.0 } else { center - delta };
    let hi = if k == n { 1.0 } else { center + delta };
    Some([lo, hi])
}

/// McNemar's exact test on the discordant pairs $b$ (one way) and $c$ (the other):
/// returns (p, mid-p) with $p = \min(1, 2 P(X \le \min(b, c)))$ and
/// $\text{mid-}p = p - P(X = \min(b, c))$ for $X \sim \mathrm{Binomial}(b + c, 1/2)$.
/// Both are 1 when $b + c = 0$.
pub fn mcnemar(b: u64, c: u64) -> (f64, f64) {
    let n = b + c;
    if n == 0 {
        return (1.0, 1.0);
    }
    let k = b.min(c);
    let pmf_k = binomial_half_pmf(k, n);
    let cdf_k = binomial_half_cdf_from(k, n, pmf_k);
    let p = (2.0 * cdf_k).min(1.0);
    let mid_p = (2.0 * cdf_k - pmf_k).min(1.0);
    (p, mid_p)
}

/// $P(X = k)$ for $X \sim \mathrm{Binomial}(n, 1/2)$, by Loader's saddle-point form
/// $e^{-(\text{stirlerr terms}) - (\text{bd0 terms})} / \sqrt{2 \pi k (n - k) / n}$, accurate to a few ulps
/// for every n (no cancellation of large log-factorials).
pub fn binomial_half_pmf(k: u64, n: u64) -> f64 {
    assert!(k <= n, "binomial_half_pmf: k > n");
    let nf = n as f64;
    if k == 0 || k == n {
        return (-nf * std::f64::consts::LN_2).exp();
    }
    let kf = k as f64;
    let rest = nf - kf;
    let half = nf / 2.0;
    let lc = stirling_error(nf)
        - stirling_error(kf)
        - stirling_error(rest)
        - bd0(kf, half)
        - bd0(rest, half);
    lc.exp() * (nf / (2.0 * std::f64::consts::PI * kf * rest)).sqrt()
}

/// $P(X \le k)$ for $X \sim \mathrm{Binomial}(n, 1/2)$, given $P(X = k)$ ($k \le n/2$): sums
/// the terms downwards with $p_{i-1} = p_i \\, i / (n - i + 1)$ until they no longer matter.
fn binomial_half_cdf_from(k: u64, n: u64, pmf_k: f64) -> f64 {
    let mut term = pmf_k;
    let mut sum = pmf_k;
    let mut i = k;
    while i > 0 {
        term *= i as f64 / (n - i + 1) as f64;
        sum += term;
        if term < sum * 1e-18 {
            break;
        }
        i -= 1;
    }
    sum
}

/// $\mathrm{stirlerr}(x) = \ln x! - ((x + \tfrac12) \ln x - x + \ln \sqrt{2\pi})$, Loader (2000).
fn stirling_error(x: f64) -> f64 {
    const S0: f64 = 1.0 / 12.0;
    const S1: f64 = 1.0 / 360.0;
    const S2: f64 = 1.0 / 1260.0;
    const S3: f64 = 1.0 / 1680.0;
    const S4: f64 = 1.0 / 1188.0;
    if x <= 15.0 {
        // Direct for small integers: ln(x!) by summation is exact to a few ulps here.
        let mut ln_fact = 0.0;
        let mut i = 2.0;
        while i <= x {
            ln_fact += f64::ln(i);
            i += 1.0;
        }
        return ln_fact - ((x + 0.5) * x.ln() - x + 0.5 * (2.0 * std::f64::consts::PI).ln());
    }
    let xx = x * x;
    if x > 500.0 {
        return (S0 - S1 / xx) / x;
    }
    if x > 80.0 {
        return (S0 - (S1 - S2 / xx) / xx) / x;
    }
    if x > 35.0 {
        return (S0 - (S1 - (S2 - S3 / xx) / xx) / xx) / x;
    }
    (S0 - (S1 - (S2 - (S3 - S4 / xx) / xx) / xx) / xx) / x
}

/// $\mathrm{bd0}(x, np) = x \ln(x / np) + np - x$, by a series when $x$ is close to $np$ (Loader).
fn bd0(x: f64, np: f64) -> f64 {
    if (x - np).abs() < 0.1 * (x + np) {
        let v = (x - np) / (x + np);
        let mut s = (x - np) * v;
        let mut ej = 2.0 * x * v;
        let v2 = v * v;
        let mut j = 1.0;
        loop {
            ej *= v2;
            let s1 = s + ej / (2.0 * j + 1.0);
            if s1 == s {
                return s1;
            }
            s = s1;
            j += 1.0;
        }
    }
    x * (x / np).ln() + np - x
}

/// Paired bootstrap 95% interval of an accuracy delta over `n` questions, of which
/// `worse` went correct -> wrong (-1) and `better` wrong -> correct (+1).
///
/// Resampling n questions with replacement and averaging their per-question deltas
/// $d \in \lbrace -1, 0, +1 \rbrace$ is, draw for draw, the same distribution as drawing the
/// counts $(k_+, k_-, k_0) \sim \mathrm{Multinomial}(n; b/n, w/n, r/n)$ ($b$ = `better`,
/// $w$ = `worse`, $r$ the rest), which is sampled exactly as
/// $k_+ \sim \mathrm{Binomial}(n, b/n)$, $k_- \sim \mathrm{Binomial}(n - k_+, w/(n - b))$:
/// $O(\text{resamples})$, not $O(\text{resamples} \times n)$. The bounds are the 2.5th and 97.5th
/// percentiles of the resampled deltas ([`percentile_sorted`]). ChaCha8 seeded with
/// `seed`, so a run is reproducible. `None` when n or `resamples` is 0.
pub fn paired_bootstrap_delta_ci(
    n: u64,
    worse: u64,
    better: u64,
    resamples: usize,
    seed: u64,
) -> Option<[f64; 2]> {
    if n == 0 || resamples == 0 {
        return None;
    }
    assert!(
        worse + better <= n,
        "paired_bootstrap_delta_ci: counts exceed n"
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let nf = n as f64;
    let p_better = better as f64 / nf;
    let not_better = n - better;
    let p_worse_given = if not_better == 0 {
        0.0
    } else {
        worse as f64 / not_better as f64
    };
    let draw_better = Binomial::new(n, p_better).expect("probability in [0, 1]");
    let mut deltas = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        let k_better = draw_better.sample(&mut rng);
        let k_worse = Binomial::new(n - k_better, p_worse_given)
            .expect("probability in [0, 1]")
            .sample(&mut rng);
        deltas.push((k_better as f64 - k_worse as f64) / nf);
    }
    deltas.sort_unstable_by(f64::total_cmp);
    Some([
        percentile_sorted(&deltas, 2.5)?,
        percentile_sorted(&deltas, 97.5)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In place or on a copy, the same percentiles, bit for bit, against a full sort.
    #[test]
    fn percentiles_in_place_are_those_of_a_sort() {
        let mut state = 5u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f64 / 1024.0
        };
        let qs = [0.0, 12.5, 50.0, 90.0, 99.0, 99.9, 100.0];
        for n in [1, 2, 7, 1000, 4099] {
            // Values with ties (a coarse grid) and both zeros.
            let values: Vec<f64> = (0..n)
                .map(|i| match i % 11 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (next() * 4.0).round() / 4.0,
                })
                .collect();
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let expected: Vec<u64> = qs
                .iter()
                .map(|&q| percentile_sorted(&sorted, q).unwrap().to_bits())
                .collect();
            let copied: Vec<u64> = percentiles(&values, &qs)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let mut work = values.clone();
            let in_place: Vec<u64> = percentiles_in_place(&mut work, &qs)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(copied, expected, "{n}");
            assert_eq!(in_place, expected, "{n}");
        }
        assert_eq!(percentiles_in_place(&mut [], &[50.0]), None);
    }

    /// pmf by Pascal's triangle: exact integers up to n = 56, then rounding of
    /// about n ulps (hence the 1e-12 tolerance).
    fn pascal_pmf(k: u64, n: u64) -> f64 {
        let mut row = vec![1.0f64];
        for _ in 0..n {
            let mut next = vec![1.0; row.len() + 1];
            for j in 1..row.len() {
                next[j] = row[j - 1] + row[j];
            }
            row = next;
        }
        row[k as usize] / 2f64.powi(n as i32)
    }

    #[test]
    fn binomial_pmf_matches_pascal_to_1e_12() {
        for n in [1u64, 2, 5, 16, 17, 40, 90, 120, 600, 1000] {
            for k in 0..=n.min(1000) {
                let exact = pascal_pmf(k, n);
                let ours = binomial_half_pmf(k, n);
                assert!(
                    (ours - exact).abs() <= 1e-12 * exact + 1e-300,
                    "n={n} k={k}: {ours} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn mcnemar_symmetric_table_has_p_one() {
        assert_eq!(mcnemar(0, 0), (1.0, 1.0));
        let (p, mid) = mcnemar(7, 7);
        assert_eq!(p, 1.0);
        assert!((mid - 1.0).abs() < 1e-15);
        // b = 0, c = 5: p = 2 / 32, mid-p = 1 / 32.
        let (p, mid) = mcnemar(0, 5);
        assert!((p - 2.0 / 32.0).abs() < 1e-16 && (mid - 1.0 / 32.0).abs() < 1e-16);
    }

    #[test]
    fn percentile_matches_numpy_hand_values() {
        let v = [1.0, 2.0, 4.0, 8.0];
        // numpy.percentile([1,2,4,8], [0, 50, 90, 100]) = [1, 3, 6.8, 8]
        assert_eq!(percentile_sorted(&v, 0.0), Some(1.0));
        assert_eq!(percentile_sorted(&v, 50.0), Some(3.0));
        assert!((percentile_sorted(&v, 90.0).unwrap() - 6.8).abs() < 1e-15);
        assert_eq!(percentile_sorted(&v, 100.0), Some(8.0));
    }

    #[test]
    fn bootstrap_is_reproducible_and_brackets_the_delta() {
        let a = paired_bootstrap_delta_ci(1000, 50, 80, 2000, 3).unwrap();
        let b = paired_bootstrap_delta_ci(1000, 50, 80, 2000, 3).unwrap();
        assert_eq!(a, b);
        assert!(a[0] < 0.03 && 0.03 < a[1], "{a:?}");
    }
}
