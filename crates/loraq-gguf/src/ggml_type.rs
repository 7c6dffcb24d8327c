//! ggml's tensor element types as GGUF stores them: the type id, and the block size
//! and bytes per block that give every tensor's byte size.
//!
//! The ids and sizes are llama.cpp's: `gguf-py/gguf/constants.py`
//! (`GGMLQuantizationType`, `GGML_QUANT_SIZES`) and `ggml/src/ggml.c`
//! (`type_traits`), at the version llama-cpp-python 0.3.36 vendors. Ids that ggml
//! has retired (31-33, 36-38) are unknown here, as they are to ggml.

use std::fmt;

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $block:expr, $bytes:expr; )*) => {
        /// A ggml tensor type.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum GgmlType {
            $(
                #[doc = concat!("`", $name, "` (id ", stringify!($id), ")")]
                $variant,
            )*
        }

        impl GgmlType {
            /// Every type ggml defines at this version.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The id GGUF stores.
            pub fn id(self) -> u32 {
                match self { $(GgmlType::$variant => $id),* }
            }

            /// The type with this id, or `None` for an id ggml does not define.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id { $($id => Some(GgmlType::$variant),)* _ => None }
            }

            /// ggml's name (`Q4_K`, `BF16`, ...).
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$variant => $name),* }
            }

            /// Elements per block: a row's length must be a multiple of it.
            pub fn block_size(self) -> u64 {
                match self { $(GgmlType::$variant => $block),* }
            }

            /// Bytes per block.
            pub fn block_bytes(self) -> u64 {
                match self { $(GgmlType::$variant => $bytes),* }
            }
        }
    };
}

/// Elements per super-block of the K-quants and most IQ types (`QK_K`).
const QK_K: u64 = 256;

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 2 + 16;
    Q4_1 = 3, "Q4_1", 32, 2 + 2 + 16;
    Q5_0 = 6, "Q5_0", 32, 2 + 4 + 16;
    Q5_1 = 7, "Q5_1", 32, 2 + 2 + 4 + 16;
    Q8_0 = 8, "Q8_0", 32, 2 + 32;
    Q8_1 = 9, "Q8_1", 32, 2 + 2 + 32;
    Q2K = 10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4;
    Q3K = 11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12;
    Q4K = 12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12;
    Q5K = 13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    Q6K = 14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16;
    Q8K = 15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8;
    Iq2Xxs = 16, "IQ2_XXS", QK_K, 2 + QK_K / 4;
    Iq2Xs = 17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32;
    Iq3Xxs = 18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8;
    Iq1S = 19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16;
    Iq4Nl = 20, "IQ4_NL", 32, 2 + 16;
    Iq3S = 21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    Iq2S = 22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16;
    Iq4Xs = 23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    Iq1M = 29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    Bf16 = 30, "BF16", 1, 2;
    Tq1_0 = 34, "TQ1_0", QK_K, 2 + 4 * 13;
    Tq2_0 = 35, "TQ2_0", QK_K, 2 + 64;
    Mxfp4 = 39, "MXFP4", 32, 1 + 16;
    Nvfp4 = 40, "NVFP4", 64, 4 + 32;
    Q1_0 = 41, "Q1_0", 128, 2 + 16;
    Q2_0 = 42, "Q2_0", 64, 2 + 16;
}

impl GgmlType {
    /// The type named `name` (ggml's spelling, any case), e.g. `q4_k` or `BF16`.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of a row of `elements` elements, or `None` when `elements` is not a
    /// whole number of blocks or the size overflows.
    pub fn row_bytes(self, elements: u64) -> Option<u64> {
        if elements % self.block_size() != 0 {
            return None;
        }
        (elements / self.block_size()).checked_mul(self.block_bytes())
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
        assert_eq!(GgmlType::Q4K.block_bytes(), 144);
        assert_eq!(GgmlType::Q6K.block_bytes(), 210);
        assert_eq!(GgmlType::Iq4Xs.block_bytes(), 136);
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
    }
}
