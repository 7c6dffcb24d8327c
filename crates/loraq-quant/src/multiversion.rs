//! The `multiversion!` macro: a function compiled for AVX-512, AVX2 and the baseline
//! target and picked at run time, so branch-free loops vectorize on the machine at
//! hand while the crate still builds for the baseline. Every version runs the same
//! scalar code, so results are bit-identical whichever is picked.

/// Defines `fn $name(args) -> ret` that runs `$body` compiled for the best
/// instruction set the CPU offers. Exported for the other crates' loops (loraq-extract's
/// delta pass and cast rounding).
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports every feature `avx512` is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports every feature `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

pub(crate) use multiversion;
