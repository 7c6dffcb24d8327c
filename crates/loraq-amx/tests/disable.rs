//! `LORAQ_AMX=0` turns AMX off (a test binary of its own: it sets the variable).

use loraq_amx::{Amx, DISABLE_VAR};

#[test]
fn the_variable_forces_the_fallback() {
    // SAFETY: this test binary has this one test, so no other thread reads the
    // environment meanwhile.
    unsafe { std::env::set_var(DISABLE_VAR, "0") };
    assert!(Amx::detect().is_none());
    // SAFETY: as above.
    unsafe { std::env::set_var(DISABLE_VAR, "1") };
    assert_eq!(Amx::detect().is_some(), Amx::hardware_usable());
    // SAFETY: as above.
    unsafe { std::env::remove_var(DISABLE_VAR) };
    assert_eq!(Amx::detect().is_some(), Amx::hardware_usable());
}
