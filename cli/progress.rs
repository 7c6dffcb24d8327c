//! Progress bars on stderr, hidden when stderr is not a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// A bar over `len` steps labelled `what`, drawn on stderr only when it is a terminal.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), draw_target());
    bar.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {msg} (eta {eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    bar
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// Updates `bar` from a library's `(done, total, item)` progress callback.
pub fn track(bar: &ProgressBar, done: usize, total: usize, item: &str) {
    bar.set_length(total as u64);
    bar.set_position(done as u64);
    bar.set_message(item.to_string());
}
