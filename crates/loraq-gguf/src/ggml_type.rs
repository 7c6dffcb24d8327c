//! ggml's tensor element types as GGUF stores them: the type id, the name, and the
//! block geometry (elements and bytes per block) that gives every tensor's byte size.
//! This is loraq's one table of them; loraq-quant's `ggml` module (the decoders and
//! quantizers) re-exports [`GgmlType`] and builds on this table.
//!
//! The ids and sizes are llama.cpp's: `gguf-py/gguf/constants.py`
//! (`GGMLQuantizationType`, `GGML_QUANT_SIZES`), `ggml/include/ggml.h`
//! (`enum ggml_type`) and `ggml/src/ggml.c` (`type_traits`; the struct sizes of
//! ggml-common.h), at the version llama-cpp-python 0.3.36 vendors. Ids that ggml has
//! retired (4, 5, 31-33, 36-38) are unknown here, as they are to ggml.

use std::fmt;

/// Elements per super-block of the K-quants and most IQ types (`QK_K` in
/// ggml-common.h).
pub const QK_K: usize = 256;

/// Block geometry of a type: elements per block and bytes per block (`blck_size` and
/// `type_size` of ggml's `type_traits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGeometry {
    /// Elements per block (1 for the plain number types).
    pub elements: usize,
    /// Bytes per block.
    pub bytes: usize,
}

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $elements:expr, $bytes:expr; )*) => {
        /// A ggml tensor type; the discriminant is its id in `enum ggml_type` and in
        /// GGUF tensor infos. The variants carry ggml's own spelling (`Q4_K`,
        /// `IQ4_XS`, `BF16`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        #[allow(non_camel_case_types)] // the names ggml and GGUF tools print
        pub enum GgmlType {
            $(
                #[doc = concat!("`", $name, "` (id ", stringify!($id), ")")]
                $variant = $id,
            )*
        }

        impl GgmlType {
            /// Every type ggml defines at this version, by id.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The type with this id, or `None` for an id ggml does not define.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id { $($id => Some(GgmlType::$variant),)* _ => None }
            }

            /// The name gguf-py gives the type (`Q4_K`, `IQ4_XS`, `BF16`, ...; ggml's
            /// `ggml_type_name` prints the same letters in another case).
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$variant => $name),* }
            }

            /// Elements and bytes per block.
            pub const fn block(self) -> BlockGeometry {
                let (elements, bytes): (usize, usize) =
                    match self { $(GgmlType::$variant => ($elements, $bytes)),* };
                BlockGeometry { elements, bytes }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 2 + 16;
    Q4_1 = 3, "Q4_1", 32, 2 + 2 + 16;
    Q5_0 = 6, "Q5_0", 32, 2 + 4 + 16;
    Q5_1 = 7, "Q5_1", 32, 2 + 2 + 4 + 16;
    Q8_0 = 8, "Q8_0", 32, 2 + 32;
    Q8_1 = 9, "Q8_1", 32, 2 + 2 + 32;
    Q2_K = 10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4;
    Q3_K = 11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12;
    Q4_K = 12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12;
    Q5_K = 13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    Q6_K = 14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16;
    Q8_K = 15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8;
    IQ2_XXS = 16, "IQ2_XXS", QK_K, 2 + QK_K / 4;
    IQ2_XS = 17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32;
    IQ3_XXS = 18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8;
    IQ1_S = 19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16;
    IQ4_NL = 20, "IQ4_NL", 32, 2 + 16;
    IQ3_S = 21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    IQ2_S = 22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16;
    IQ4_XS = 23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", QK_K, 2 + 4 * 13;
    TQ2_0 = 35, "TQ2_0", QK_K, 2 + 64;
    MXFP4 = 39, "MXFP4", 32, 1 + 16;
    NVFP4 = 40, "NVFP4", 64, 4 + 32;
    Q1_0 = 41, "Q1_0", 128, 2 + 16;
    Q2_0 = 42, "Q2_0", 64, 2 + 16;
}

impl GgmlType {
    /// The ggml id (`enum ggml_type`, GGUF tensor info).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type named `name` (as [`GgmlType::name`], any case), e.g. `q4_k` or `BF16`.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Whether the type has blocks of more than one element (ggml's
    /// `ggml_is_quantized`).
    pub fn is_quantized(self) -> bool {
        self.block().elements > 1
    }

    /// Bytes of a row of `elements` elements (`ggml_row_size`), or `None` when
    /// `elements` is not a whole number of blocks or the size overflows.
    pub fn row_bytes(self, elements: u64) -> Option<u64> {
        let block = self.block();
        let (block_elements, block_bytes) = (block.elements as u64, block.bytes as u64);
        if !elements.is_multiple_of(block_elements) {
            return None;
        }
        (elements / block_elements).checked_mul(block_bytes)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
        // Spot checks against gguf-py's GGML_QUANT_SIZES.
        assert_eq!(GgmlType::Q4_K.block().bytes, 144);
        assert_eq!(GgmlType::Q6_K.block().bytes, 210);
        assert_eq!(GgmlType::IQ4_XS.block().bytes, 136);
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
        assert_eq!(GgmlType::from_name("q4_k"), Some(GgmlType::Q4_K));
    }
}
