//! Parallel f64 sums that come out the same from run to run.
//!
//! rayon's `sum` and `reduce` pair the partial results as work stealing split the range,
//! which differs from one run to the next, so an f64 total moves in its last bits
//! between two runs of the same command, and with it the report's figures and their
//! checksums. Here the parts are collected in index order and added in that order.

use rayon::prelude::*;

/// Values per part of [`sum_in_order`]: the per-part cost is nothing at this size, and
/// a 17408 x 5120 matrix still gives both threads over a thousand parts.
const PART: usize = 1 << 16;

/// `parts` folded with `add` from `zero`, in index order.
pub(crate) fn fold_in_order<T: Send>(
    parts: impl IndexedParallelIterator<Item = T>,
    zero: T,
    add: impl Fn(T, T) -> T,
) -> T {
    parts.collect::<Vec<T>>().into_iter().fold(zero, add)
}

/// The sum of `term(x)` over `values`, in parallel, in parts of [`PART`] values added in
/// order.
pub(crate) fn sum_in_order<X: Sync>(values: &[X], term: impl Fn(&X) -> f64 + Sync) -> f64 {
    fold_in_order(
        values
            .par_chunks(PART)
            .map(|part| part.iter().map(&term).sum::<f64>()),
        0.0,
        |a, b| a + b,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values whose f64 sum depends on the order of addition (large and small mixed).
    fn awkward(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i as f32) * 0.618_034).fract();
                if i % 7 == 0 { x * 1.0e7 } else { x * 1.0e-3 }
            })
            .collect()
    }

    #[test]
    fn sum_in_order_gives_the_serial_sum_of_the_parts_at_any_thread_count() {
        let values = awkward(5 * PART + 123);
        let serial: f64 = values
            .chunks(PART)
            .map(|part| part.iter().map(|&x| (x as f64).powi(2)).sum::<f64>())
            .sum();
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for _ in 0..4 {
                let sum = pool.install(|| sum_in_order(&values, |&x| (x as f64).powi(2)));
                assert_eq!(sum.to_bits(), serial.to_bits(), "{threads} threads");
            }
        }
    }

    #[test]
    fn fold_in_order_keeps_the_index_order() {
        let parts = (0..1000usize).into_par_iter().map(|i| vec![i]);
        let order = fold_in_order(parts, Vec::new(), |mut v, part| {
            v.extend(part);
            v
        });
        assert_eq!(order, (0..1000).collect::<Vec<_>>());
    }
}
