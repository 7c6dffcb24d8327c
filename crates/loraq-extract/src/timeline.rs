//! Where an extraction's wall time goes: with `LORAQ_EXTRACT_TIMELINE` set (to
//! anything), every stage span (the scan's two parts, each pair read, each wait of the
//! factoring for the reader, each module's factoring, the writing) is printed to
//! stderr as one line, `timeline <thread> <start> <end> <span> <detail>`, seconds since
//! the first span was opened. Off by default: one environment lookup, then nothing.
//! `benches/extract_timeline.sh` turns the lines into a per-stage summary.

use std::sync::OnceLock;
use std::time::Instant;

/// The origin of the timeline, `None` when it is off.
fn origin() -> Option<Instant> {
    static ORIGIN: OnceLock<Option<Instant>> = OnceLock::new();
    *ORIGIN.get_or_init(|| std::env::var_os("LORAQ_EXTRACT_TIMELINE").map(|_| Instant::now()))
}

/// Whether the timeline is printed.
pub fn enabled() -> bool {
    origin().is_some()
}

/// Starts the clock (the origin is the first call of this or [`span`]).
pub fn start() {
    let _ = origin();
}

/// Prints the span from `started` to now, when the timeline is on.
pub fn span(what: &str, detail: &str, started: Instant) {
    let Some(origin) = origin() else {
        return;
    };
    let now = Instant::now();
    let offset = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
    let thread = std::thread::current();
    eprintln!(
        "timeline {} {:.4} {:.4} {what} {detail}",
        thread.name().unwrap_or("main").replace(' ', "_"),
        offset(started),
        offset(now)
    );
}
