//! Value parsers shared by the subcommands' flags: each refuses at parse time what
//! no run could use (a NaN threshold, a thread count that only oversubscribes).

/// `--threads N`: 0 (all cores) up to [`loraq_io::limits::thread_limit`].
pub fn threads(text: &str) -> Result<usize, String> {
    let n: usize = text
        .parse()
        .map_err(|e| format!("{text:?} is not a thread count: {e}"))?;
    loraq_io::limits::check_threads(n)
}

/// A residual / floor threshold: a finite number above 0. A NaN threshold made
/// every comparison false, so nothing was ever above it.
pub fn positive_ratio(text: &str) -> Result<f64, String> {
    let x: f64 = text
        .parse()
        .map_err(|e| format!("{text:?} is not a number: {e}"))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(format!("{x} is not a finite number above 0"));
    }
    Ok(x)
}
