//! Output handling shared by the commands that write: the temporaries a killed
//! earlier run left beside an output are reported on stderr (loraq-io removes those
//! whose process is gone).

use loraq_io::StaleSibling;
use std::path::Path;

/// Prints one warning per stale sibling found beside an output.
pub fn report_stale(stale: &[StaleSibling]) {
    for sibling in stale {
        eprintln!("warning: {sibling}");
    }
}

/// Sweeps and reports the stale siblings of `target` for commands whose library
/// creates the output itself (extract, synth).
pub fn sweep_and_report(target: &Path) {
    report_stale(&loraq_io::sweep_stale_siblings(target));
}
