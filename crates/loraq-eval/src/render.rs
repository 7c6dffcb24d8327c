//! Renderings of a [`Comparison`] for people: a plain-text table (stdout), a
//! Markdown report and an SVG figure (reliability diagram of both sides and the
//! histogram of the reference margins of flipped answers).

use std::fmt::Write as _;

use crate::calibration::ReliabilityBin;
use crate::compare::{CalibrationSummary, Comparison, NEAR_TIE_MARGIN};

/// Bins of the flip-margin histogram over [0, 1].
pub const MARGIN_HISTOGRAM_BINS: usize = 20;

fn pct(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map(f).unwrap_or_else(|| "-".into())
}

fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 1e-3 && x.abs() < 1e4 {
        format!("{x:.5}")
    } else {
        format!("{x:.3e}")
    }
}

fn signed_points(x: f64) -> String {
    format!("{:+.2} pts", 100.0 * x)
}

fn p_value(x: f64) -> String {
    if x >= 1e-4 {
        format!("{x:.4}")
    } else {
        format!("{x:.2e}")
    }
}

/// The plain-text summary printed on stdout by `loraq compare`.
pub fn text_table(c: &Comparison) -> String {
    let r = &c.report;
    let mut s = String::new();
    let _ = writeln!(s, "reference  {}", c.reference_name);
    let _ = writeln!(s, "candidate  {}", c.candidate_name);
    let _ = writeln!(
        s,
        "questions  {} paired, {} with gold, {} unpaired ({} reference only, {} candidate only)",
        r.n, c.n_gold, r.unpaired, c.reference_only, c.candidate_only
    );
    let _ = writeln!(s);
    let row = |s: &mut String, label: &str, value: String| {
        let _ = writeln!(s, "{label:<24}{value}");
    };
    row(
        &mut s,
        "answers changed",
        format!(
            "{} of {} ({}, 95% CI {} to {})",
            r.flips,
            r.n,
            pct(r.flip_rate),
            pct(r.flip_rate_ci95[0]),
            pct(r.flip_rate_ci95[1])
        ),
    );
    if let (Some(cw), Some(wc), Some(ww)) = (
        r.flips_correct_to_wrong,
        r.flips_wrong_to_correct,
        r.flips_wrong_to_other_wrong,
    ) {
        row(&mut s, "  correct -> wrong", cw.to_string());
        row(&mut s, "  wrong -> correct", wc.to_string());
        row(&mut s, "  wrong -> other wrong", ww.to_string());
    }
    row(&mut s, "same top", pct(r.same_top));
    row(
        &mut s,
        "KL mean (nats)",
        format!("{} ± {}", sci(r.kl.mean), opt(r.kl.mean_se, sci)),
    );
    row(
        &mut s,
        "KL median/p90/p99",
        format!(
            "{} / {} / {}",
            sci(r.kl.median),
            sci(r.kl.p90),
            sci(r.kl.p99)
        ),
    );
    row(
        &mut s,
        "KL p99.9/max",
        format!("{} / {}", sci(r.kl.p999), sci(r.kl.max)),
    );
    let a = &r.accuracy;
    match (a.reference, a.candidate, a.delta) {
        (Some(reference), Some(candidate), Some(delta)) => {
            row(
                &mut s,
                "accuracy",
                format!("reference {}, candidate {}", pct(reference), pct(candidate)),
            );
            let ci = a
                .delta_ci95
                .map(|[lo, hi]| format!(" (95% CI {} to {})", signed_points(lo), signed_points(hi)))
                .unwrap_or_default();
            row(
                &mut s,
                "accuracy change",
                format!(
                    "{}{ci}, McNemar p = {} (mid-p {})",
                    signed_points(delta),
                    opt(a.mcnemar_p, p_value),
                    opt(a.mcnemar_midp, p_value)
                ),
            );
        }
        _ => row(&mut s, "accuracy", "no gold labels".into()),
    }
    let nt = &r.near_ties;
    row(
        &mut s,
        "reference margin",
        format!(
            "median {} over flips, {:.4} over all; {} of flips under {NEAR_TIE_MARGIN}",
            opt(nt.flip_margin_median, |x| format!("{x:.4}")),
            nt.all_margin_median,
            opt(nt.flips_margin_below_0_1, pct)
        ),
    );
    if c.n_gold > 0 {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<12}{:>10}{:>14}{:>10}{:>10}",
            "calibration", "ECE", "adaptive ECE", "Brier", "NLL"
        );
        for (name, cal) in [
            ("reference", &r.calibration.reference),
            ("candidate", &r.calibration.candidate),
        ] {
            let f = |x: Option<f64>| opt(x, |v| format!("{v:.4}"));
            let _ = writeln!(
                s,
                "{:<12}{:>10}{:>14}{:>10}{:>10}",
                name,
                f(cal.ece),
                f(cal.adaptive_ece),
                f(cal.brier),
                f(cal.nll)
            );
        }
    }
    if r.groups.len() > 1 {
        let _ = writeln!(s);
        let width = r
            .groups
            .keys()
            .map(|k| k.chars().count())
            .max()
            .unwrap_or(5)
            .max(5)
            + 2;
        let _ = writeln!(
            s,
            "{:<width$}{:>8}{:>8}{:>11}{:>14}{:>12}",
            "group", "n", "flips", "flip rate", "acc change", "KL mean"
        );
        for (name, g) in &r.groups {
            let _ = writeln!(
                s,
                "{:<width$}{:>8}{:>8}{:>11}{:>14}{:>12}",
                name,
                g.n,
                g.flips,
                pct(g.flip_rate),
                opt(g.accuracy_delta, signed_points),
                sci(g.kl_mean)
            );
        }
        let _ = writeln!(
            s,
            "mean of group accuracy changes: {}",
            opt(r.mean_group_accuracy_delta, signed_points)
        );
    }
    s
}

fn md_calibration_row(name: &str, cal: &CalibrationSummary) -> String {
    let f = |x: Option<f64>| opt(x, |v| format!("{v:.4}"));
    format!(
        "| {name} | {} | {} | {} | {} |\n",
        f(cal.ece),
        f(cal.adaptive_ece),
        f(cal.brier),
        f(cal.nll)
    )
}

/// Counts of flip margins in [`MARGIN_HISTOGRAM_BINS`] equal bins over [0, 1]
/// (each bin [lo, hi), the last one closed).
pub fn margin_histogram(margins: &[f64]) -> Vec<usize> {
    let mut counts = vec![0usize; MARGIN_HISTOGRAM_BINS];
    for &m in margins {
        let b = ((m * MARGIN_HISTOGRAM_BINS as f64).floor().max(0.0) as usize)
            .min(MARGIN_HISTOGRAM_BINS - 1);
        counts[b] += 1;
    }
    counts
}

/// The Markdown report: summary, calibration, reliability tables, flip-margin
/// histogram and groups.
pub fn markdown(c: &Comparison) -> String {
    let r = &c.report;
    let mut s = String::new();
    let _ = writeln!(s, "# loraq compare\n");
    let _ = writeln!(s, "- reference: `{}`", c.reference_name);
    let _ = writeln!(s, "- candidate: `{}`", c.candidate_name);
    let _ = writeln!(
        s,
        "- {} paired questions ({} with gold), {} unpaired; {} calibration bins, {} bootstrap resamples, seed {}\n",
        r.n, c.n_gold, r.unpaired, c.options.bins, c.options.bootstrap, c.options.seed
    );
    let _ = writeln!(s, "## Summary\n\n| figure | value |\n|---|---|");
    let _ = writeln!(
        s,
        "| answers changed | {} of {} ({}; Wilson 95% CI {} to {}) |",
        r.flips,
        r.n,
        pct(r.flip_rate),
        pct(r.flip_rate_ci95[0]),
        pct(r.flip_rate_ci95[1])
    );
    if let (Some(cw), Some(wc), Some(ww)) = (
        r.flips_correct_to_wrong,
        r.flips_wrong_to_correct,
        r.flips_wrong_to_other_wrong,
    ) {
        let _ = writeln!(s, "| correct → wrong | {cw} |");
        let _ = writeln!(s, "| wrong → correct | {wc} |");
        let _ = writeln!(s, "| wrong → other wrong | {ww} |");
    }
    let _ = writeln!(s, "| same top | {} |", pct(r.same_top));
    let _ = writeln!(
        s,
        "| KL mean (nats) | {} ± {} |",
        sci(r.kl.mean),
        opt(r.kl.mean_se, sci)
    );
    let _ = writeln!(
        s,
        "| KL median / p90 / p99 / p99.9 / max | {} / {} / {} / {} / {} |",
        sci(r.kl.median),
        sci(r.kl.p90),
        sci(r.kl.p99),
        sci(r.kl.p999),
        sci(r.kl.max)
    );
    let a = &r.accuracy;
    if let (Some(reference), Some(candidate), Some(delta)) = (a.reference, a.candidate, a.delta) {
        let _ = writeln!(
            s,
            "| accuracy | reference {}, candidate {} |",
            pct(reference),
            pct(candidate)
        );
        let _ = writeln!(
            s,
            "| accuracy change | {} (bootstrap 95% CI {}) |",
            signed_points(delta),
            a.delta_ci95
                .map(|[lo, hi]| format!("{} to {}", signed_points(lo), signed_points(hi)))
                .unwrap_or_else(|| "-".into())
        );
        let _ = writeln!(
            s,
            "| McNemar exact p / mid-p | {} / {} |",
            opt(a.mcnemar_p, p_value),
            opt(a.mcnemar_midp, p_value)
        );
    } else {
        let _ = writeln!(s, "| accuracy | no gold labels |");
    }
    let nt = &r.near_ties;
    let _ = writeln!(
        s,
        "| reference margin, median over flips / all | {} / {:.4} |",
        opt(nt.flip_margin_median, |x| format!("{x:.4}")),
        nt.all_margin_median
    );
    let _ = writeln!(
        s,
        "| flips with reference margin < {NEAR_TIE_MARGIN} | {} |\n",
        opt(nt.flips_margin_below_0_1, pct)
    );

    if let Some((reference, candidate)) = &c.reliability {
        let _ = writeln!(
            s,
            "## Calibration\n\n| side | ECE | adaptive ECE | Brier | NLL |\n|---|---|---|---|---|"
        );
        s.push_str(&md_calibration_row("reference", &r.calibration.reference));
        s.push_str(&md_calibration_row("candidate", &r.calibration.candidate));
        let _ = writeln!(
            s,
            "\n### Reliability\n\n| bin | reference n | reference confidence | reference accuracy | candidate n | candidate confidence | candidate accuracy |\n|---|---|---|---|---|---|---|"
        );
        let f = |x: Option<f64>| opt(x, |v| format!("{v:.4}"));
        for (rb, cb) in reference.iter().zip(candidate) {
            let _ = writeln!(
                s,
                "| ({:.3}, {:.3}] | {} | {} | {} | {} | {} | {} |",
                rb.lo,
                rb.hi,
                rb.count,
                f(rb.mean_confidence),
                f(rb.accuracy),
                cb.count,
                f(cb.mean_confidence),
                f(cb.accuracy)
            );
        }
        let _ = writeln!(s);
    }

    if !c.flip_margins.is_empty() {
        let _ = writeln!(
            s,
            "## Reference margins of flipped answers\n\n| margin | flips |\n|---|---|"
        );
        let width = 1.0 / MARGIN_HISTOGRAM_BINS as f64;
        for (b, count) in margin_histogram(&c.flip_margins).iter().enumerate() {
            let close = if b + 1 == MARGIN_HISTOGRAM_BINS {
                "]"
            } else {
                ")"
            };
            let _ = writeln!(
                s,
                "| [{:.2}, {:.2}{close} | {count} |",
                b as f64 * width,
                (b + 1) as f64 * width
            );
        }
        let _ = writeln!(s);
    }

    if !r.groups.is_empty() {
        let _ = writeln!(
            s,
            "## Groups\n\n| group | n | flips | flip rate | accuracy change | KL mean |\n|---|---|---|---|---|---|"
        );
        for (name, g) in &r.groups {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                name.replace('|', "\\|"),
                g.n,
                g.flips,
                pct(g.flip_rate),
                opt(g.accuracy_delta, signed_points),
                sci(g.kl_mean)
            );
        }
        let _ = writeln!(
            s,
            "\nMean of the groups' accuracy changes: {}",
            opt(r.mean_group_accuracy_delta, signed_points)
        );
    }
    s
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A file name cut to its last 60 characters, for a figure title.
fn shorten(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    if chars.len() <= 60 {
        name.to_string()
    } else {
        format!("…{}", chars[chars.len() - 59..].iter().collect::<String>())
    }
}

/// A plot area inside the SVG: maps data coordinates to pixels.
struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    y_max: f64,
}

impl Panel {
    fn px(&self, v: f64) -> f64 {
        self.x + v * self.w
    }
    fn py(&self, v: f64) -> f64 {
        self.y + self.h - v / self.y_max * self.h
    }

    fn axes(&self, s: &mut String, title: &str, x_label: &str, y_label: &str, y_ticks: &[f64]) {
        let (x0, y0, x1, y1) = (self.x, self.y, self.x + self.w, self.y + self.h);
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y0}" width="{}" height="{}" fill="#fafafa" stroke="#333" stroke-width="1"/>"##,
            self.w, self.h
        );
        for i in 0..=5 {
            let v = i as f64 / 5.0;
            let x = self.px(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y1}" x2="{x:.1}" y2="{:.1}" stroke="#333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{v:.1}</text>"##,
                y1 + 5.0,
                y1 + 20.0
            );
            if i > 0 && i < 5 {
                let _ = writeln!(
                    s,
                    r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{y1}" stroke="#e3e3e3"/>"##
                );
            }
        }
        for &v in y_ticks {
            let y = self.py(v);
            let label = if self.y_max <= 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v}")
            };
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" y1="{y:.1}" x2="{x0}" y2="{y:.1}" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
                x0 - 5.0,
                x0 - 8.0,
                y + 4.0
            );
            if v > 0.0 && v < self.y_max {
                let _ = writeln!(
                    s,
                    r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e3e3e3"/>"##
                );
            }
        }
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"##,
            x0 + self.w / 2.0,
            y0 - 12.0,
            xml_escape(title)
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            x0 + self.w / 2.0,
            y1 + 42.0,
            xml_escape(x_label)
        );
        let (lx, ly) = (x0 - 48.0, y0 + self.h / 2.0);
        let _ = writeln!(
            s,
            r##"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle" transform="rotate(-90 {lx:.1} {ly:.1})">{}</text>"##,
            xml_escape(y_label)
        );
    }
}

/// Side colors: reference blue, candidate orange (colorblind-safe pair).
const REFERENCE_COLOR: &str = "#1f77b4";
const CANDIDATE_COLOR: &str = "#e66100";

fn reliability_curve(
    s: &mut String,
    panel: &Panel,
    table: &[ReliabilityBin],
    color: &str,
    square: bool,
) {
    let points: Vec<(f64, f64)> = table
        .iter()
        .filter_map(|b| Some((panel.px(b.mean_confidence?), panel.py(b.accuracy?))))
        .collect();
    if points.len() > 1 {
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.2},{y:.2}"))
            .collect();
        let _ = writeln!(
            s,
            r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
            path.join(" ")
        );
    }
    for (x, y) in points {
        if square {
            let _ = writeln!(
                s,
                r##"<rect x="{:.2}" y="{:.2}" width="8" height="8" fill="{color}" stroke="white"/>"##,
                x - 4.0,
                y - 4.0
            );
        } else {
            let _ = writeln!(
                s,
                r##"<circle cx="{x:.2}" cy="{y:.2}" r="4.5" fill="{color}" stroke="white"/>"##
            );
        }
    }
}

/// A round axis maximum and its ticks for counts up to `max`.
fn count_ticks(max: usize) -> (f64, Vec<f64>) {
    let max = max.max(1) as f64;
    let raw_step = max / 5.0;
    let magnitude = 10f64.powf(raw_step.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&st| st >= raw_step)
        .unwrap_or(10.0 * magnitude)
        .max(1.0);
    let top = (max / step).ceil() * step;
    let ticks = (0..=((top / step).round() as usize))
        .map(|i| i as f64 * step)
        .collect();
    (top, ticks)
}

/// The SVG figure: left, the reliability diagram of both sides (accuracy against
/// mean confidence per equal-width bin, with the diagonal of perfect calibration);
/// right, the histogram of the reference margins of flipped answers with the 0.1
/// near-tie line.
pub fn svg(c: &Comparison) -> String {
    let (width, height) = (1000.0, 530.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="13">"##
    );
    let _ = writeln!(
        s,
        r##"<rect width="{width}" height="{height}" fill="white"/>"##
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="26" text-anchor="middle" font-size="14" fill="#444">{} vs {}</text>"##,
        width / 2.0,
        xml_escape(&shorten(&c.reference_name)),
        xml_escape(&shorten(&c.candidate_name))
    );

    let left = Panel {
        x: 90.0,
        y: 80.0,
        w: 340.0,
        h: 340.0,
        y_max: 1.0,
    };
    let ticks: Vec<f64> = (0..=5).map(|i| i as f64 / 5.0).collect();
    left.axes(
        &mut s,
        &format!("Reliability ({} bins)", c.options.bins),
        "confidence (top-1 probability)",
        "accuracy",
        &ticks,
    );
    let _ = writeln!(
        s,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#777" stroke-width="1.5" stroke-dasharray="6 4"/>"##,
        left.px(0.0),
        left.py(0.0),
        left.px(1.0),
        left.py(1.0)
    );
    match &c.reliability {
        Some((reference, candidate)) => {
            reliability_curve(&mut s, &left, reference, REFERENCE_COLOR, false);
            reliability_curve(&mut s, &left, candidate, CANDIDATE_COLOR, true);
            // Legend in one row under the panel, so it never hides a point.
            let (lx, ly) = (left.x - 40.0, left.y + left.h + 62.0);
            let cal = &c.report.calibration;
            let ece = |x: Option<f64>| opt(x, |v| format!("{v:.3}"));
            let _ = writeln!(
                s,
                r##"<circle cx="{:.1}" cy="{:.1}" r="4.5" fill="{REFERENCE_COLOR}"/><text x="{:.1}" y="{:.1}">reference (ECE {})</text>
<rect x="{:.1}" y="{:.1}" width="8" height="8" fill="{CANDIDATE_COLOR}"/><text x="{:.1}" y="{:.1}">candidate (ECE {})</text>
<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#777" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}">perfect calibration</text>"##,
                lx + 5.0,
                ly - 4.5,
                lx + 14.0,
                ly,
                ece(cal.reference.ece),
                lx + 186.0,
                ly - 8.5,
                lx + 199.0,
                ly,
                ece(cal.candidate.ece),
                lx + 372.0,
                ly - 4.5,
                lx + 394.0,
                ly - 4.5,
                lx + 400.0,
                ly
            );
        }
        None => {
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#a00">no gold labels: no reliability curve</text>"##,
                left.x + left.w / 2.0,
                left.y + left.h / 2.0
            );
        }
    }

    let counts = margin_histogram(&c.flip_margins);
    let (top, count_ticks) = count_ticks(counts.iter().copied().max().unwrap_or(0));
    let right = Panel {
        x: 590.0,
        y: 80.0,
        w: 360.0,
        h: 340.0,
        y_max: top,
    };
    right.axes(
        &mut s,
        &format!(
            "Reference margins of the {} flipped answers",
            c.flip_margins.len()
        ),
        "reference margin (top-1 minus top-2 probability)",
        "flipped answers",
        &count_ticks,
    );
    let bin_width = 1.0 / MARGIN_HISTOGRAM_BINS as f64;
    for (b, &count) in counts.iter().enumerate() {
        if count == 0 {
            continue;
        }
        let x0 = right.px(b as f64 * bin_width);
        let x1 = right.px((b + 1) as f64 * bin_width);
        let y = right.py(count as f64);
        let _ = writeln!(
            s,
            r##"<rect x="{:.2}" y="{y:.2}" width="{:.2}" height="{:.2}" fill="{CANDIDATE_COLOR}" fill-opacity="0.75" stroke="white"><title>[{:.2}, {:.2}): {count}</title></rect>"##,
            x0 + 0.5,
            x1 - x0 - 1.0,
            right.py(0.0) - y,
            b as f64 * bin_width,
            (b + 1) as f64 * bin_width
        );
    }
    let tie_x = right.px(NEAR_TIE_MARGIN);
    let _ = writeln!(
        s,
        r##"<line x1="{tie_x:.1}" y1="{}" x2="{tie_x:.1}" y2="{}" stroke="#333" stroke-width="1.5" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#333">margin {NEAR_TIE_MARGIN}: {} of flips below</text>"##,
        right.y,
        right.y + right.h,
        tie_x + 6.0,
        right.y + 16.0,
        opt(c.report.near_ties.flips_margin_below_0_1, pct)
    );
    if c.flip_margins.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#444">no answer changed</text>"##,
            right.x + right.w / 2.0,
            right.y + right.h / 2.0
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_ticks_are_round_and_cover_the_maximum() {
        let (top, ticks) = count_ticks(37);
        assert_eq!(top, 40.0);
        assert_eq!(ticks, vec![0.0, 10.0, 20.0, 30.0, 40.0]);
        let (top, ticks) = count_ticks(0);
        assert_eq!(top, 1.0);
        assert_eq!(ticks, vec![0.0, 1.0]);
    }

    #[test]
    fn margin_histogram_closes_the_last_bin() {
        let counts = margin_histogram(&[0.0, 0.04999, 0.05, 1.0]);
        assert_eq!(counts[0], 2);
        assert_eq!(counts[1], 1);
        assert_eq!(counts[MARGIN_HISTOGRAM_BINS - 1], 1);
    }
}
