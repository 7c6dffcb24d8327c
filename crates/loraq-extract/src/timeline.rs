//! Where an extraction's wall time goes: with `LORAQ_EXTRACT_TIMELINE` set (to
//! anything), every stage span (the scan's two parts, each pair read, each wait of the
//! factoring for the reader, each module's factoring, the writing) is printed to
//! stderr as one line, `timeline <thread> <start> <end> <cpu> <span> <detail>`: seconds
//! since the first span was opened, and the CPU seconds the thread that ran the span
//! spent in it (user and system; Linux, else 0: the pool threads' work in a module's
//! factoring is not counted there). Off by default: one environment lookup, then nothing.
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

/// A span being timed: its start, wall and the thread's CPU time.
pub struct Span {
    started: Instant,
    cpu: f64,
}

impl Span {
    /// Starts timing a span on the calling thread.
    pub fn start() -> Span {
        Span {
            started: Instant::now(),
            cpu: if enabled() { thread_cpu_seconds() } else { 0.0 },
        }
    }

    /// Prints the span, from its start to now, when the timeline is on.
    pub fn end(self, what: &str, detail: &str) {
        let Some(origin) = origin() else {
            return;
        };
        let now = Instant::now();
        let cpu = thread_cpu_seconds() - self.cpu;
        let offset = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
        let thread = std::thread::current();
        eprintln!(
            "timeline {} {:.4} {:.4} {cpu:.4} {what} {detail}",
            thread.name().unwrap_or("main").replace(' ', "_"),
            offset(self.started),
            offset(now)
        );
    }
}

/// The calling thread's CPU time (user and system), in seconds.
#[cfg(target_os = "linux")]
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `t` is.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
    if ok {
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    } else {
        0.0
    }
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_seconds() -> f64 {
    0.0
}

/// Prints the span from `started` to now, when the timeline is on, without the
/// thread's CPU time (`-`: for a span whose work runs on the pool).
pub fn span(what: &str, detail: &str, started: Instant) {
    let Some(origin) = origin() else {
        return;
    };
    let now = Instant::now();
    let offset = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
    let thread = std::thread::current();
    eprintln!(
        "timeline {} {:.4} {:.4} - {what} {detail}",
        thread.name().unwrap_or("main").replace(' ', "_"),
        offset(started),
        offset(now)
    );
}
