//! Properties that hold for any answers: comparing a file with itself, swapping the
//! two sides, and the building blocks (percentiles, Wilson, McNemar).

use loraq_eval::stats::{mcnemar, percentile_sorted, wilson_interval};
use loraq_eval::{AnswersReader, CompareOptions, compare, pair_answers};
use proptest::prelude::*;

/// Answers files for `logits` (one question per row, 2-5 options) with gold.
fn jsonl(logits: &[Vec<f64>], gold: &[usize]) -> String {
    let mut out = String::new();
    for (i, (row, &g)) in logits.iter().zip(gold).enumerate() {
        let options: Vec<String> = (0..row.len()).map(|k| format!("o{k}")).collect();
        let record = serde_json::json!({
            "id": format!("q{i}"),
            "group": if i % 2 == 0 { "even" } else { "odd" },
            "options": options,
            "logits": row,
            "gold": options[g % row.len()],
        });
        out.push_str(&record.to_string());
        out.push('\n');
    }
    out
}

fn questions() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<usize>)> {
    (1usize..40).prop_flat_map(|n| {
        let widths = proptest::collection::vec(2usize..6, n);
        widths.prop_flat_map(move |widths| {
            let rows = |widths: &Vec<usize>| {
                widths
                    .iter()
                    .map(|&k| proptest::collection::vec(-20.0f64..20.0, k))
                    .collect::<Vec<_>>()
            };
            (
                rows(&widths),
                rows(&widths),
                proptest::collection::vec(0usize..5, n),
            )
        })
    })
}

fn run(reference: &str, candidate: &str) -> loraq_eval::Comparison {
    let paired = pair_answers(
        AnswersReader::new(reference.as_bytes(), "r.jsonl"),
        AnswersReader::new(candidate.as_bytes(), "c.jsonl"),
        false,
    )
    .unwrap();
    let options = CompareOptions {
        bootstrap: 200,
        ..CompareOptions::default()
    };
    compare(&paired, &options).unwrap()
}

proptest! {
    #[test]
    fn a_file_compared_with_itself_has_no_flip_and_zero_kl((a, _, gold) in questions()) {
        let text = jsonl(&a, &gold);
        let r = run(&text, &text).report;
        prop_assert_eq!(r.flips, 0);
        prop_assert_eq!(r.kl.max, 0.0);
        prop_assert_eq!(r.accuracy.delta, Some(0.0));
        prop_assert_eq!(r.accuracy.mcnemar_p, Some(1.0));
        prop_assert_eq!(r.accuracy.delta_ci95, Some([0.0, 0.0]));
        prop_assert_eq!(r.calibration.reference.clone(), r.calibration.candidate.clone());
    }

    #[test]
    fn swapping_the_sides_negates_the_delta_and_keeps_the_flips((a, b, gold) in questions()) {
        let (ta, tb) = (jsonl(&a, &gold), jsonl(&b, &gold));
        let ab = run(&ta, &tb).report;
        let ba = run(&tb, &ta).report;
        prop_assert_eq!(ab.flips, ba.flips);
        prop_assert_eq!(ab.flips_correct_to_wrong, ba.flips_wrong_to_correct);
        prop_assert_eq!(ab.accuracy.delta.unwrap(), -ba.accuracy.delta.unwrap());
        prop_assert_eq!(ab.accuracy.mcnemar_p, ba.accuracy.mcnemar_p);
        prop_assert_eq!(ab.calibration.reference.clone(), ba.calibration.candidate.clone());
        prop_assert!(ab.kl.mean >= -1e-12 && ba.kl.mean >= -1e-12);
        prop_assert!(ab.kl.median <= ab.kl.p90 && ab.kl.p90 <= ab.kl.p99 && ab.kl.p99 <= ab.kl.max);
        let [lo, hi] = ab.flip_rate_ci95;
        prop_assert!(lo <= ab.flip_rate && ab.flip_rate <= hi);
        let [dlo, dhi] = ab.accuracy.delta_ci95.unwrap();
        prop_assert!(dlo <= dhi);
    }

    #[test]
    fn percentiles_are_monotone_and_bounded(mut v in proptest::collection::vec(-1e6f64..1e6, 1..200), q1 in 0.0f64..100.0, q2 in 0.0f64..100.0) {
        v.sort_by(f64::total_cmp);
        let (lo, hi) = (q1.min(q2), q1.max(q2));
        let a = percentile_sorted(&v, lo).unwrap();
        let b = percentile_sorted(&v, hi).unwrap();
        prop_assert!(v[0] <= a && a <= b && b <= v[v.len() - 1]);
    }

    #[test]
    fn wilson_contains_the_proportion(n in 1usize..5000, k_frac in 0.0f64..=1.0) {
        let k = ((n as f64) * k_frac).floor() as usize;
        let [lo, hi] = wilson_interval(k, n).unwrap();
        let p = k as f64 / n as f64;
        prop_assert!((0.0..=p).contains(&lo) && (p..=1.0).contains(&hi), "{lo} {p} {hi}");
    }

    #[test]
    fn mcnemar_is_symmetric_and_mid_p_below_p(b in 0u64..3000, c in 0u64..3000) {
        let (p, mid) = mcnemar(b, c);
        prop_assert_eq!((p, mid), mcnemar(c, b));
        // p underflows to 0 below 2^-1074 (b + c > 1074 with min(b, c) = 0).
        prop_assert!(0.0 <= mid && mid <= p && p <= 1.0, "{mid} {p}");
    }
}
