//! The launch arguments of the kernels in `kernels/`, one `#[repr(C)]` struct per kernel
//! signature, each passed to its kernel by value as the kernel's only parameter.
//!
//! Every struct here has a C twin of the same name and fields in
//! `kernels/loraq_common.cuh`. [`layout_assertions`] writes the Rust layout (size,
//! alignment, each field's offset, size and type) as C++ `static_assert`s, which the
//! NVRTC compile test (`tests/nvrtc_compile.rs`) and the host emulation's compile test
//! compile together with the header: a field added, dropped, reordered or retyped on one
//! side only fails the build of that snippet.
//!
//! Device buffers are [`DeviceAddress`]es (a `CUdeviceptr` on a device; the host
//! emulation passes buffer indices and relocates them). Dimensions, counts and ranks are
//! `i32`, as the kernels index with `int`.

use std::fmt::Write as _;

/// A device buffer's address as a kernel parameter (the C field is a typed pointer).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DeviceAddress(pub u64);

/// The C type class of one field of a launch-argument struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldType {
    /// A pointer (any pointee): [`DeviceAddress`].
    Pointer,
    /// `int`: `i32`.
    Int,
    /// `unsigned int`: `u32`.
    Unsigned,
    /// `float`: `f32`.
    Float,
}

/// One field of a launch-argument struct as Rust lays it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgField {
    /// Field name (the same in the C struct).
    pub name: &'static str,
    /// Byte offset in the struct (`std::mem::offset_of!`).
    pub offset: usize,
    /// Byte size.
    pub size: usize,
    /// C type class.
    pub field_type: FieldType,
}

/// A scalar or address that a launch-argument struct holds.
pub trait ArgValue: Copy {
    /// Its C type class.
    const FIELD_TYPE: FieldType;
    /// Writes its native-endian bytes to the front of `out`.
    fn write_to(self, out: &mut [u8]);
}

impl ArgValue for DeviceAddress {
    const FIELD_TYPE: FieldType = FieldType::Pointer;
    fn write_to(self, out: &mut [u8]) {
        out[..8].copy_from_slice(&self.0.to_ne_bytes());
    }
}

impl ArgValue for i32 {
    const FIELD_TYPE: FieldType = FieldType::Int;
    fn write_to(self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.to_ne_bytes());
    }
}

impl ArgValue for u32 {
    const FIELD_TYPE: FieldType = FieldType::Unsigned;
    fn write_to(self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.to_ne_bytes());
    }
}

impl ArgValue for f32 {
    const FIELD_TYPE: FieldType = FieldType::Float;
    fn write_to(self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.to_ne_bytes());
    }
}

/// A launch-argument struct: its C name and its fields as Rust lays them out.
pub trait KernelArgs: Copy {
    /// Name of the struct (the same in C).
    const C_NAME: &'static str;
    /// Fields in declaration order.
    fn fields() -> Vec<ArgField>;
    /// The struct's bytes as the kernel receives them, padding zeroed.
    fn to_bytes(&self) -> Vec<u8>;
}

macro_rules! kernel_args {
    ($(#[$meta:meta])* $name:ident { $($(#[$field_meta:meta])* $field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub struct $name {
            $($(#[$field_meta])* pub $field: $ty,)*
        }

        impl KernelArgs for $name {
            const C_NAME: &'static str = stringify!($name);

            fn fields() -> Vec<ArgField> {
                vec![$(ArgField {
                    name: stringify!($field),
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                    field_type: <$ty as ArgValue>::FIELD_TYPE,
                },)*]
            }

            fn to_bytes(&self) -> Vec<u8> {
                let mut out = vec![0u8; std::mem::size_of::<Self>()];
                $(self.$field.write_to(&mut out[std::mem::offset_of!($name, $field)..]);)*
                out
            }
        }
    };
}

kernel_args! {
    /// `{format}_fused_b{NB}` and `{format}_tcdec_fused_b{NB}` (lora_decode.cu): the fused
    /// decode, `shrink_blocks` blocks of LoRA shrink, then the base stream with the
    /// expand folded in. The CUDA-core kernel ignores `slice_chunks`, `part`, `tickets`.
    FusedDecodeArgs {
        /// bf16 activations `[batch, in_features]`.
        x: DeviceAddress,
        /// Base weight codes (bf16 values, E4M3 codes or packed E2M1 pairs).
        w_codes: DeviceAddress,
        /// Base weight scales (fp8 tile multipliers as f32, NVFP4 E4M3 block scales).
        w_scales: DeviceAddress,
        /// LoRA A, bf16 `[rank, in_features]`.
        lora_a: DeviceAddress,
        /// LoRA B, bf16 `[out_features, rank]`.
        lora_b: DeviceAddress,
        /// LoRA intermediate `s * A x`, f32 `[batch, rank]`.
        t: DeviceAddress,
        /// Release counter (u32), incremented by the shrink.
        counter: DeviceAddress,
        /// Tensor-core shrink's per-slice partial sums, f32 `[slices, NB, rank]`.
        part: DeviceAddress,
        /// Tensor-core shrink's ticket per 16 rows of A (u32, left at 0).
        tickets: DeviceAddress,
        /// bf16 output `[batch, out_features]`.
        y: DeviceAddress,
        /// Tokens.
        batch: i32,
        /// Rows of the base weight.
        out_features: i32,
        /// Columns of the base weight.
        in_features: i32,
        /// LoRA rank (0: no LoRA).
        rank: i32,
        /// The base weight's global multiplier (NVFP4; 1 otherwise).
        w_global: f32,
        /// LoRA scale applied to `A x`.
        t_scale: f32,
        /// Counter value once this launch's shrink is complete.
        target: u32,
        /// Blocks computing the shrink (first in the grid).
        shrink_blocks: i32,
        /// Tensor-core shrink: in-dim chunks per slice.
        slice_chunks: i32,
    }
}

kernel_args! {
    /// `{format}_base_b{NB}` (lora_decode.cu): the unfused decode's base product
    /// `y = W x`.
    BaseDecodeArgs {
        /// bf16 activations `[batch, in_features]`.
        x: DeviceAddress,
        /// Base weight codes.
        w_codes: DeviceAddress,
        /// Base weight scales.
        w_scales: DeviceAddress,
        /// bf16 output `[batch, out_features]`.
        y: DeviceAddress,
        /// Tokens.
        batch: i32,
        /// Rows of the base weight.
        out_features: i32,
        /// Columns of the base weight.
        in_features: i32,
        /// The base weight's global multiplier.
        w_global: f32,
    }
}

kernel_args! {
    /// `lora_shrink_b{NB}` (lora_decode.cu) and `lora_tc_shrink` (lora_prefill.cu):
    /// `t = t_scale * A x`.
    LoraShrinkArgs {
        /// bf16 activations `[batch, in_features]`.
        x: DeviceAddress,
        /// LoRA A, bf16 `[rank, in_features]`.
        lora_a: DeviceAddress,
        /// f32 output `[batch, rank]`.
        t: DeviceAddress,
        /// Tokens.
        batch: i32,
        /// Columns of A.
        in_features: i32,
        /// Rows of A.
        rank: i32,
        /// Multiplier of the product.
        t_scale: f32,
    }
}

kernel_args! {
    /// `lora_expand_b{NB}` (lora_decode.cu): `y += B t`.
    LoraExpandArgs {
        /// f32 LoRA intermediate `[batch, rank]`.
        t: DeviceAddress,
        /// LoRA B, bf16 `[out_features, rank]`.
        lora_b: DeviceAddress,
        /// bf16 output `[batch, out_features]`, accumulated into.
        y: DeviceAddress,
        /// Tokens.
        batch: i32,
        /// Rows of B.
        out_features: i32,
        /// Columns of B.
        rank: i32,
    }
}

kernel_args! {
    /// `{format}_tc_gemm` (lora_prefill.cu): `y (+)= W x + B t` on tensor cores, the base
    /// product skipped when `in_features` is 0, the expand when `rank` is 0.
    TcGemmArgs {
        /// bf16 activations `[batch, in_features]`.
        x: DeviceAddress,
        /// Base weight codes.
        w_codes: DeviceAddress,
        /// Base weight scales.
        w_scales: DeviceAddress,
        /// f32 LoRA intermediate `[batch, rank]`.
        t: DeviceAddress,
        /// LoRA B, bf16 `[out_features, rank]`.
        lora_b: DeviceAddress,
        /// bf16 output `[batch, out_features]`.
        y: DeviceAddress,
        /// Tokens (the GEMM's M).
        batch: i32,
        /// Columns of the base weight (the GEMM's K).
        in_features: i32,
        /// Rows of the base weight (the GEMM's N).
        out_features: i32,
        /// LoRA rank (0: no expand).
        rank: i32,
        /// Nonzero: add to `y` instead of overwriting it.
        accumulate: i32,
        /// Multiplier of the whole tile (the base's global scale).
        w_global: f32,
    }
}

/// The arguments of one launch, by kernel signature.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LaunchArgs {
    /// The fused decode (CUDA-core or tensor-core).
    FusedDecode(FusedDecodeArgs),
    /// The unfused decode's base product.
    BaseDecode(BaseDecodeArgs),
    /// A LoRA shrink (decode or prefill).
    LoraShrink(LoraShrinkArgs),
    /// The unfused decode's LoRA expand.
    LoraExpand(LoraExpandArgs),
    /// The prefill's tensor-core GEMM.
    TcGemm(TcGemmArgs),
}

impl LaunchArgs {
    /// The struct's bytes as the kernel receives them, padding zeroed.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Self::FusedDecode(a) => a.to_bytes(),
            Self::BaseDecode(a) => a.to_bytes(),
            Self::LoraShrink(a) => a.to_bytes(),
            Self::LoraExpand(a) => a.to_bytes(),
            Self::TcGemm(a) => a.to_bytes(),
        }
    }

    /// The struct's fields as Rust lays them out.
    pub fn fields(&self) -> Vec<ArgField> {
        match self {
            Self::FusedDecode(_) => FusedDecodeArgs::fields(),
            Self::BaseDecode(_) => BaseDecodeArgs::fields(),
            Self::LoraShrink(_) => LoraShrinkArgs::fields(),
            Self::LoraExpand(_) => LoraExpandArgs::fields(),
            Self::TcGemm(_) => TcGemmArgs::fields(),
        }
    }

    /// A pointer to the struct, as `cuLaunchKernel` takes a by-value parameter; valid
    /// while `self` is neither moved nor dropped.
    pub fn as_kernel_param(&mut self) -> *mut std::ffi::c_void {
        match self {
            Self::FusedDecode(a) => a as *mut FusedDecodeArgs as *mut std::ffi::c_void,
            Self::BaseDecode(a) => a as *mut BaseDecodeArgs as *mut std::ffi::c_void,
            Self::LoraShrink(a) => a as *mut LoraShrinkArgs as *mut std::ffi::c_void,
            Self::LoraExpand(a) => a as *mut LoraExpandArgs as *mut std::ffi::c_void,
            Self::TcGemm(a) => a as *mut TcGemmArgs as *mut std::ffi::c_void,
        }
    }
}

fn assert_layout<T: KernelArgs>(out: &mut String) {
    let name = T::C_NAME;
    let fields = T::fields();
    let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
    // `write!` to a String cannot fail.
    let _ = writeln!(
        out,
        "static_assert(sizeof({name}) == {size}, \"{name}: Rust's size is {size}\");\n\
         static_assert(alignof({name}) == {align}, \"{name}: Rust's alignment is {align}\");"
    );
    // Member order and names: C++20 designated initializers must follow the
    // declaration order. Member count: one initializer more must not compile.
    let designators: Vec<String> = fields
        .iter()
        .map(|f| format!(".{} = {{}}", f.name))
        .collect();
    let one_more = vec!["{}"; fields.len() + 1].join(", ");
    let _ = writeln!(
        out,
        "inline void loraq_layout_order_{name}() {{ {name} args{{{}}}; (void)args; }}\n\
         template <class T, class = void> struct loraq_layout_more_{name} {{ static const bool value = false; }};\n\
         template <class T> struct loraq_layout_more_{name}<T, decltype((void)T{{{one_more}}})> {{ static const bool value = true; }};\n\
         static_assert(!loraq_layout_more_{name}<{name}>::value, \"{name}: Rust has {} fields\");",
        designators.join(", "),
        fields.len()
    );
    // The natural layout's offsets of the C declaration (each member at the next
    // multiple of its alignment), for NVRTC, which has no offsetof.
    let mut end = "0".to_string();
    for field in &fields {
        let f = field.name;
        let _ = writeln!(
            out,
            "namespace loraq_layout {{ constexpr unsigned long long {name}_{f} = align_up({end}, alignof(decltype(::{name}::{f}))); }}"
        );
        end = format!("loraq_layout::{name}_{f} + sizeof(::{name}::{f})");
    }
    for field in &fields {
        let (f, offset, size) = (field.name, field.offset, field.size);
        let type_check = match field.field_type {
            FieldType::Pointer => format!("loraq_layout_is_pointer<decltype({name}::{f})>::value"),
            FieldType::Int => format!("loraq_layout_same<decltype({name}::{f}), int>::value"),
            FieldType::Unsigned => {
                format!("loraq_layout_same<decltype({name}::{f}), unsigned int>::value")
            }
            FieldType::Float => format!("loraq_layout_same<decltype({name}::{f}), float>::value"),
        };
        let _ = writeln!(
            out,
            "static_assert(LORAQ_OFFSETOF({name}, {f}) == {offset}, \"{name}::{f}: Rust's offset is {offset}\");\n\
             static_assert(sizeof({name}::{f}) == {size}, \"{name}::{f}: Rust's size is {size}\");\n\
             static_assert({type_check}, \"{name}::{f}: Rust's type is {:?}\");",
            field.field_type
        );
    }
}

/// C++20 source that includes `loraq_common.cuh` and asserts, at compile time, that
/// each launch-argument struct there has the size, alignment, member order, member
/// count, member offsets, sizes and types of its Rust twin here. Compiles (with
/// `-std=c++20`) only if the two agree. Offsets are the compiler's own
/// (`__builtin_offsetof`) under a host compiler; NVRTC has no offsetof, so there they
/// are the natural layout's offsets of the C declaration, whose order, count and
/// member types the other assertions pin down.
pub fn layout_assertions() -> String {
    let mut out = String::from(
        "// Generated by loraq_kernels::kernel_args::layout_assertions.\n\
         #include \"loraq_common.cuh\"\n\
         #if defined(__CUDACC_RTC__)\n\
         #define LORAQ_OFFSETOF(T, f) loraq_layout::T##_##f\n\
         #else\n\
         #define LORAQ_OFFSETOF(T, f) __builtin_offsetof(T, f)\n\
         #endif\n\
         namespace loraq_layout {\n\
         constexpr unsigned long long align_up(unsigned long long offset, unsigned long long align) {\n\
         \x20   return (offset + align - 1) / align * align;\n\
         }\n\
         }  // namespace loraq_layout\n\
         template <class T> struct loraq_layout_is_pointer { static const bool value = false; };\n\
         template <class T> struct loraq_layout_is_pointer<T*> { static const bool value = true; };\n\
         template <class T, class U> struct loraq_layout_same { static const bool value = false; };\n\
         template <class T> struct loraq_layout_same<T, T> { static const bool value = true; };\n",
    );
    assert_layout::<FusedDecodeArgs>(&mut out);
    assert_layout::<BaseDecodeArgs>(&mut out);
    assert_layout::<LoraShrinkArgs>(&mut out);
    assert_layout::<LoraExpandArgs>(&mut out);
    assert_layout::<TcGemmArgs>(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::process::Command;

    /// Compiles `source` with the host compiler against the header and the host
    /// emulation's CUDA stand-ins; `None` where no C++ compiler runs.
    fn host_compile(source: &str) -> Option<std::result::Result<(), String>> {
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::temp_dir().join(format!("loraq-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("layout-{:x}.cpp", source.len()));
        std::fs::write(&file, source).unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-fsyntax-only", "-w", "-I"])
            .arg(crate_dir.join("host_emulation"))
            .arg("-I")
            .arg(crate_dir.join("../../kernels"))
            .arg(&file)
            .output();
        std::fs::remove_file(&file).unwrap();
        match out {
            Ok(out) if out.status.success() => Some(Ok(())),
            Ok(out) => Some(Err(String::from_utf8_lossy(&out.stderr).into_owned())),
            Err(e) => {
                eprintln!("skipped: no C++ compiler ({cxx}: {e})");
                None
            }
        }
    }

    /// The C structs have the Rust layout as the host compiler lays them out (the
    /// host emulation passes them as bytes); NVRTC's layout is checked in
    /// tests/nvrtc_compile.rs. A wrong offset fails the check.
    #[test]
    fn host_compiler_lays_out_the_c_structs_as_rust_does() {
        let assertions = layout_assertions();
        let Some(result) = host_compile(&assertions) else {
            return;
        };
        result.unwrap_or_else(|e| panic!("launch argument layouts differ:\n{e}"));
        let offset = std::mem::offset_of!(TcGemmArgs, accumulate);
        let correct = format!("LORAQ_OFFSETOF(TcGemmArgs, accumulate) == {offset}");
        assert!(assertions.contains(&correct));
        let wrong = assertions.replace(
            &correct,
            &format!("LORAQ_OFFSETOF(TcGemmArgs, accumulate) == {}", offset + 4),
        );
        let message = host_compile(&wrong).unwrap().unwrap_err();
        assert!(message.contains("TcGemmArgs::accumulate"), "{message}");
    }

    /// Bytes follow the fields: each value at its offset, padding zero.
    #[test]
    fn bytes_put_each_field_at_its_offset() {
        let args = LoraExpandArgs {
            t: DeviceAddress(0x0102_0304_0506_0708),
            lora_b: DeviceAddress(2),
            y: DeviceAddress(3),
            batch: 5,
            out_features: -6,
            rank: 7,
        };
        let bytes = args.to_bytes();
        assert_eq!(bytes.len(), 40);
        assert_eq!(&bytes[0..8], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(&bytes[8..16], &2u64.to_ne_bytes());
        assert_eq!(&bytes[28..32], &(-6i32).to_ne_bytes());
        assert_eq!(&bytes[32..36], &7i32.to_ne_bytes());
        assert_eq!(&bytes[36..40], &[0; 4]);
    }
}
