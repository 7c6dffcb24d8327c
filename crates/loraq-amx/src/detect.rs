//! Whether this process can run AMX bf16 tile products (x86_64 only).

use std::sync::OnceLock;

/// The hardware and operating-system answer, asked once per process.
static USABLE: OnceLock<bool> = OnceLock::new();

/// `arch_prctl` code that requests permission for an extended state component.
#[cfg(target_os = "linux")]
const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
/// XSAVE state component 18: the AMX tile data.
#[cfg(target_os = "linux")]
const XFEATURE_XTILEDATA: libc::c_ulong = 18;

/// Whether the CPU has AMX-TILE and AMX-BF16 (plus the AVX-512 the packing uses), the
/// operating system saves the tile state (XCR0 bits 17 and 18) and the kernel granted
/// this process the tile data (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`): asked once per
/// process, the answer cached.
pub(crate) fn usable() -> bool {
    *USABLE.get_or_init(probe)
}

fn probe() -> bool {
    use core::arch::x86_64::__cpuid_count;
    // SAFETY: the CPUID instruction exists on every x86_64 processor (in some Rust
    // versions the intrinsic is a safe function, hence the allow).
    #[allow(unused_unsafe)]
    let (max_leaf, leaf1, leaf7) = unsafe {
        (
            __cpuid_count(0, 0).eax,
            __cpuid_count(1, 0),
            __cpuid_count(7, 0),
        )
    };
    if max_leaf < 7 {
        return false;
    }
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    let amx_bf16 = leaf7.edx & (1 << 22) != 0;
    let amx_tile = leaf7.edx & (1 << 24) != 0;
    if !(osxsave && amx_bf16 && amx_tile) {
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 reads XCR0; it exists whenever CPUID reports OSXSAVE
    // (checked above).
    unsafe {
        core::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi,
            options(nomem, nostack, preserves_flags));
    }
    let tile_state = (1 << 17) | (1 << 18);
    if lo & tile_state != tile_state {
        return false;
    }
    if !(std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw"))
    {
        return false;
    }
    request_tile_data()
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) takes two integers and
    // touches no memory of this process; it fails cleanly (non-zero) where refused.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    // Other systems would need their own permission call: not supported.
    false
}
