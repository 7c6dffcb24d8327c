//! The comparison report: every figure of `loraq compare`, with the JSON keys
//! documented in docs/evaluation.md.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::calibration::{
    ReliabilityBin, adaptive_calibration_error, expected_calibration_error, reliability_table,
};
use crate::error::{EvalError, Result};
use crate::pair::{PairStats, PairedAnswers, pair_files};
use crate::stats::{
    mcnemar, mean, median, paired_bootstrap_delta_ci, percentiles_in_place, standard_error,
    wilson_interval,
};

/// Margin under which a flip counts as a near tie.
pub const NEAR_TIE_MARGIN: f64 = 0.1;

/// Parameters of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareOptions {
    /// Equal-width (and equal-mass) calibration bins.
    pub bins: usize,
    /// Paired bootstrap resamples for the accuracy-delta interval (0: no interval).
    pub bootstrap: usize,
    /// Seed of the bootstrap's ChaCha8 generator.
    pub seed: u64,
    /// Count ids present in only one file instead of refusing them.
    pub allow_unpaired: bool,
}

impl Default for CompareOptions {
    fn default() -> Self {
        Self {
            bins: 15,
            bootstrap: 10_000,
            seed: 0,
            allow_unpaired: false,
        }
    }
}

/// KL(reference || candidate) distribution over paired questions, nats.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KlSummary {
    /// Mean.
    pub mean: f64,
    /// Standard error of the mean (N-1; null for N < 2).
    pub mean_se: Option<f64>,
    /// 50th percentile (numpy linear).
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

/// Accuracy of both sides on the questions with gold, and the paired test of the
/// difference. Every field is null when no question has gold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AccuracySummary {
    /// Reference accuracy.
    pub reference: Option<f64>,
    /// Candidate accuracy.
    pub candidate: Option<f64>,
    /// candidate - reference.
    pub delta: Option<f64>,
    /// Paired bootstrap 95% interval of `delta`.
    pub delta_ci95: Option<[f64; 2]>,
    /// McNemar exact two-sided p-value.
    pub mcnemar_p: Option<f64>,
    /// McNemar mid-p value.
    pub mcnemar_midp: Option<f64>,
}

/// Calibration of one side on the questions with gold (null fields without gold).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationSummary {
    /// Top-label ECE over equal-width bins (lo, hi].
    pub ece: Option<f64>,
    /// Top-label ECE over equal-mass bins.
    pub adaptive_ece: Option<f64>,
    /// Mean multiclass Brier score sum_k (p_k - y_k)^2.
    pub brier: Option<f64>,
    /// Mean negative log-likelihood of the gold option, nats.
    pub nll: Option<f64>,
}

/// Calibration of both sides.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationPair {
    /// The reference side.
    pub reference: CalibrationSummary,
    /// The candidate side.
    pub candidate: CalibrationSummary,
}

/// Reference margins (top-1 minus top-2 probability) of flipped vs all questions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NearTies {
    /// Median reference margin of the flipped questions (null without flips).
    pub flip_margin_median: Option<f64>,
    /// Median reference margin of all paired questions.
    pub all_margin_median: f64,
    /// Share of flips whose reference margin is below 0.1 (null without flips).
    pub flips_margin_below_0_1: Option<f64>,
}

/// One group's (benchmark's) figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupSummary {
    /// Paired questions in the group.
    pub n: usize,
    /// Flips in the group.
    pub flips: usize,
    /// flips / n.
    pub flip_rate: f64,
    /// Candidate minus reference accuracy on the group's gold questions.
    pub accuracy_delta: Option<f64>,
    /// Mean KL(reference || candidate) in the group.
    pub kl_mean: f64,
}

/// The machine-readable report; field names are the JSON keys.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Paired questions.
    pub n: usize,
    /// Ids present in only one of the files (both directions; 0 unless allowed).
    pub unpaired: usize,
    /// Questions whose top option differs.
    pub flips: usize,
    /// flips / n.
    pub flip_rate: f64,
    /// Wilson 95% interval of `flip_rate`.
    pub flip_rate_ci95: [f64; 2],
    /// Gold questions the reference got right and the candidate wrong.
    pub flips_correct_to_wrong: Option<usize>,
    /// Gold questions the reference got wrong and the candidate right.
    pub flips_wrong_to_correct: Option<usize>,
    /// Gold questions both got wrong, with different answers.
    pub flips_wrong_to_other_wrong: Option<usize>,
    /// Share of questions with the same top option (1 - flip_rate).
    pub same_top: f64,
    /// KL(reference || candidate) distribution.
    pub kl: KlSummary,
    /// Accuracy and its paired test.
    pub accuracy: AccuracySummary,
    /// Calibration of both sides.
    pub calibration: CalibrationPair,
    /// Near-tie analysis.
    pub near_ties: NearTies,
    /// Per-group figures, by group name.
    pub groups: BTreeMap<String, GroupSummary>,
    /// Unweighted mean of the groups' non-null accuracy deltas.
    pub mean_group_accuracy_delta: Option<f64>,
}

/// The report plus what the human renderings need beyond it.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The JSON report.
    pub report: Report,
    /// Reference file name.
    pub reference_name: String,
    /// Candidate file name.
    pub candidate_name: String,
    /// Reference ids without a candidate answer.
    pub reference_only: usize,
    /// Candidate ids without a reference answer.
    pub candidate_only: usize,
    /// Paired questions with gold.
    pub n_gold: usize,
    /// Discordant gold pairs (reference right -> candidate wrong, wrong -> right).
    pub discordant: (usize, usize),
    /// Equal-width reliability tables of (reference, candidate); `None` without gold.
    pub reliability: Option<(Vec<ReliabilityBin>, Vec<ReliabilityBin>)>,
    /// Reference margins of the flipped questions, in reference order.
    pub flip_margins: Vec<f64>,
    /// The options the figures were computed with.
    pub options: CompareOptions,
}

/// Pairs two answers files and compares them.
pub fn compare_files(
    reference: impl AsRef<Path>,
    candidate: impl AsRef<Path>,
    options: &CompareOptions,
) -> Result<Comparison> {
    // Refuse bad options before reading two possibly large files.
    check_options(options)?;
    let paired = pair_files(reference, candidate, options.allow_unpaired)?;
    compare(&paired, options)
}

/// Computes every figure from paired answers.
/// Most bootstrap resamples [`compare`] draws: 10^7, 80 MB of deltas and a few
/// seconds; the interval's Monte Carlo error is then far below the digits reported
/// (the default, 10^4, already gives them). 10^12 aborted allocating 8 TB.
pub const MAX_BOOTSTRAP_RESAMPLES: usize = 10_000_000;

fn check_options(options: &CompareOptions) -> Result<()> {
    if options.bins == 0 {
        return Err(EvalError::InvalidOption("bins must be at least 1".into()));
    }
    if options.bootstrap > MAX_BOOTSTRAP_RESAMPLES {
        return Err(EvalError::InvalidOption(format!(
            "--bootstrap {} is above the limit of {MAX_BOOTSTRAP_RESAMPLES} resamples (each costs 8 bytes; more add no digits to the interval)",
            options.bootstrap
        )));
    }
    Ok(())
}

/// Compares answers already paired by id: flips, KL, the paired accuracy test,
/// calibration and near ties of `paired` under `options` (refused when the options are
/// out of range or there is no pair).
pub fn compare(paired: &PairedAnswers, options: &CompareOptions) -> Result<Comparison> {
    check_options(options)?;
    let pairs = &paired.pairs;
    let n = pairs.len();
    if n == 0 {
        return Err(EvalError::NoPairs {
            reference: paired.reference_path.clone(),
            candidate: paired.candidate_path.clone(),
        });
    }
    // The counts in one pass over the pairs (a hundred bytes each: a pass per count
    // read them again from memory).
    let mut flips = 0;
    let mut n_gold = 0;
    let (mut correct_to_wrong, mut wrong_to_correct, mut wrong_to_other) = (0, 0, 0);
    let (mut reference_correct, mut candidate_correct) = (0usize, 0usize);
    for p in pairs {
        flips += usize::from(p.flip);
        if let Some((r, c)) = p.gold {
            n_gold += 1;
            correct_to_wrong += usize::from(r.correct && !c.correct);
            wrong_to_correct += usize::from(!r.correct && c.correct);
            wrong_to_other += usize::from(!r.correct && !c.correct && p.flip);
            reference_correct += usize::from(r.correct);
            candidate_correct += usize::from(c.correct);
        }
    }

    // The pairs with gold, in order (a filter instead of a vector of them: each
    // vector of a million questions is 8 MB of fresh memory to fault in and clear).
    let gold = || pairs.iter().filter(|p| p.gold.is_some());
    // The independent figures are computed side by side: the KL percentiles, the
    // margins' medians and each side's calibration (below).
    let kl_summary = || {
        let mut kl: Vec<f64> = pairs.iter().map(|p| p.kl).collect();
        let (mean, mean_se) = (mean(&kl).expect("n > 0"), standard_error(&kl));
        let max = kl.iter().copied().max_by(f64::total_cmp).expect("n > 0");
        // Last: the selection reorders the values.
        let [median, p90, p99, p999] = percentiles_in_place(&mut kl, &[50.0, 90.0, 99.0, 99.9])
            .expect("n > 0")
            .try_into()
            .expect("four percentiles");
        KlSummary {
            mean,
            mean_se,
            median,
            p90,
            p99,
            p999,
            max,
        }
    };

    let has_gold = n_gold > 0;
    let gold_count = |c: usize| has_gold.then_some(c);

    let accuracy = if has_gold {
        let reference = reference_correct as f64 / n_gold as f64;
        let candidate = candidate_correct as f64 / n_gold as f64;
        let (p, midp) = mcnemar(correct_to_wrong as u64, wrong_to_correct as u64);
        AccuracySummary {
            reference: Some(reference),
            candidate: Some(candidate),
            delta: Some(candidate - reference),
            delta_ci95: paired_bootstrap_delta_ci(
                n_gold as u64,
                correct_to_wrong as u64,
                wrong_to_correct as u64,
                options.bootstrap,
                options.seed,
            ),
            mcnemar_p: Some(p),
            mcnemar_midp: Some(midp),
        }
    } else {
        AccuracySummary {
            reference: None,
            candidate: None,
            delta: None,
            delta_ci95: None,
            mcnemar_p: None,
            mcnemar_midp: None,
        }
    };

    let side_calibration = |which: fn(&PairStats) -> (f64, crate::pair::GoldSide)| {
        let mut confidence = Vec::with_capacity(n_gold);
        let mut correct = Vec::with_capacity(n_gold);
        for p in gold() {
            let (c, side) = which(p);
            confidence.push(c);
            correct.push(side.correct);
        }
        // The means of `stats::mean`, summed in the same order by the same `Sum`,
        // without a vector of the values.
        let side_mean = |value: fn(&crate::pair::GoldSide) -> f64| {
            (n_gold > 0).then(|| gold().map(|p| value(&which(p).1)).sum::<f64>() / n_gold as f64)
        };
        let table = reliability_table(&confidence, &correct, options.bins);
        let summary = CalibrationSummary {
            ece: expected_calibration_error(&table),
            adaptive_ece: adaptive_calibration_error(&confidence, &correct, options.bins),
            brier: side_mean(|side| side.brier),
            nll: side_mean(|side| side.nll),
        };
        (summary, table)
    };
    let near_ties = || {
        let mut all_margins: Vec<f64> = pairs.iter().map(|p| p.reference_margin).collect();
        let flip_margins: Vec<f64> = pairs
            .iter()
            .filter(|p| p.flip)
            .map(|p| p.reference_margin)
            .collect();
        let near_ties = NearTies {
            flip_margin_median: median(&flip_margins),
            all_margin_median: percentiles_in_place(&mut all_margins, &[50.0]).expect("n > 0")[0],
            flips_margin_below_0_1: (!flip_margins.is_empty()).then(|| {
                flip_margins
                    .iter()
                    .filter(|&&m| m < NEAR_TIE_MARGIN)
                    .count() as f64
                    / flip_margins.len() as f64
            }),
        };
        (near_ties, flip_margins)
    };
    // The groups' pass too (a sequential pass over every pair once the rest was done).
    let (((kl_summary, (near_ties, flip_margins)), groups), (reference, candidate)) = rayon::join(
        || {
            rayon::join(
                || rayon::join(kl_summary, near_ties),
                || group_summaries(paired),
            )
        },
        || {
            rayon::join(
                || side_calibration(|p| (p.reference_confidence, p.gold.expect("gold").0)),
                || side_calibration(|p| (p.candidate_confidence, p.gold.expect("gold").1)),
            )
        },
    );
    let (reference_calibration, reference_table) = reference;
    let (candidate_calibration, candidate_table) = candidate;

    let group_deltas: Vec<f64> = groups.values().filter_map(|g| g.accuracy_delta).collect();

    let report = Report {
        n,
        unpaired: paired.reference_only + paired.candidate_only,
        flips,
        flip_rate: flips as f64 / n as f64,
        flip_rate_ci95: wilson_interval(flips, n).expect("n > 0"),
        flips_correct_to_wrong: gold_count(correct_to_wrong),
        flips_wrong_to_correct: gold_count(wrong_to_correct),
        flips_wrong_to_other_wrong: gold_count(wrong_to_other),
        same_top: (n - flips) as f64 / n as f64,
        kl: kl_summary,
        accuracy,
        calibration: CalibrationPair {
            reference: reference_calibration,
            candidate: candidate_calibration,
        },
        near_ties,
        groups,
        mean_group_accuracy_delta: mean(&group_deltas),
    };
    Ok(Comparison {
        report,
        reference_name: paired.reference_path.display().to_string(),
        candidate_name: paired.candidate_path.display().to_string(),
        reference_only: paired.reference_only,
        candidate_only: paired.candidate_only,
        n_gold,
        discordant: (correct_to_wrong, wrong_to_correct),
        reliability: has_gold.then_some((reference_table, candidate_table)),
        flip_margins,
        options: options.clone(),
    })
}

fn group_summaries(paired: &PairedAnswers) -> BTreeMap<String, GroupSummary> {
    #[derive(Default)]
    struct Acc {
        n: usize,
        flips: usize,
        /// The group's KL values summed in order, as `stats::mean` sums them.
        kl_sum: f64,
        gold: usize,
        reference_correct: usize,
        candidate_correct: usize,
    }
    // The start of `Sum for f64`'s fold, so that adding in order gives `mean`'s sums
    // bit for bit (a vector of each group's values was 8 MB on a million questions).
    let zero: f64 = std::iter::empty::<f64>().sum();
    let mut accs: Vec<Acc> = paired
        .groups
        .iter()
        .map(|_| Acc {
            kl_sum: zero,
            ..Acc::default()
        })
        .collect();
    for p in &paired.pairs {
        let acc = &mut accs[p.group as usize];
        acc.n += 1;
        acc.flips += usize::from(p.flip);
        acc.kl_sum += p.kl;
        if let Some((r, c)) = p.gold {
            acc.gold += 1;
            acc.reference_correct += usize::from(r.correct);
            acc.candidate_correct += usize::from(c.correct);
        }
    }
    paired
        .groups
        .iter()
        .zip(accs)
        .filter(|(_, acc)| acc.n > 0)
        .map(|(name, acc)| {
            let summary = GroupSummary {
                n: acc.n,
                flips: acc.flips,
                flip_rate: acc.flips as f64 / acc.n as f64,
                accuracy_delta: (acc.gold > 0).then(|| {
                    acc.candidate_correct as f64 / acc.gold as f64
                        - acc.reference_correct as f64 / acc.gold as f64
                }),
                kl_mean: acc.kl_sum / acc.n as f64,
            };
            (name.clone(), summary)
        })
        .collect()
}
