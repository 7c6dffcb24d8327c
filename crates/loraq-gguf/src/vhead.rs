//! The order of Gated DeltaNet value heads in llama.cpp's `qwen35` GGUF files.
//!
//! When a Qwen3.5 model has fewer key heads than value heads, the checkpoint stores
//! the value heads grouped by key head (`[k0: v0..v{r-1}, k1: v0..v{r-1}, ...]`, r =
//! value heads per key head) and llama.cpp's converter reorders them to tiled order
//! (`[v0 of k0, v0 of k1, ..., v1 of k0, v1 of k1, ...]`) so that ggml can broadcast
//! the key heads with a plain repeat (`_LinearAttentionVReorderBase._reorder_v_heads`
//! and `.modify_tensors` in `conversion/qwen.py`). The same permutation applies to:
//! the rows of the V part of `in_proj_qkv` (after the `2 x key heads x key head dim`
//! rows of Q and K), the rows of `in_proj_z`, the rows of `in_proj_a` and `in_proj_b`
//! (one row per value head), the columns of `out_proj`, `A_log` and `dt_bias` (one
//! entry per value head) and the V channels of `conv1d`. For a LoRA adapter the
//! converter permutes the rows of B (`in_proj_qkv`, `in_proj_z`, `in_proj_a`,
//! `in_proj_b`) and the columns of A (`out_proj`), so that `B A` is permuted as the
//! weight is.

use loraq_io::ModuleKind;

/// The linear-attention head counts and sizes that fix the permutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct VHeadLayout {
    /// `linear_num_key_heads` (GGUF: `ssm.group_count`).
    pub num_k_heads: usize,
    /// `linear_num_value_heads` (GGUF: `ssm.time_step_rank`).
    pub num_v_heads: usize,
    /// `linear_key_head_dim` (GGUF: `ssm.state_size`).
    pub head_k_dim: usize,
    /// `linear_value_head_dim` (GGUF: `ssm.inner_size / ssm.time_step_rank`).
    pub head_v_dim: usize,
}

/// Which axis of a module's weight the reorder permutes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermutedAxis {
    /// Output rows from `start` on, in groups of `head_dim` per value head (a LoRA
    /// adapter's B rows).
    Rows {
        /// The first permuted row.
        start: usize,
        /// Rows per value head.
        head_dim: usize,
    },
    /// Input columns, in groups of `head_dim` per value head (a LoRA adapter's A
    /// columns).
    Columns {
        /// Columns per value head.
        head_dim: usize,
    },
}

impl VHeadLayout {
    /// Whether the converter reorders anything: only when both counts are known,
    /// differ, and the value heads divide evenly among the key heads (the converter's
    /// condition, `num_k_heads != num_v_heads`).
    pub fn reorders(&self) -> bool {
        self.num_k_heads > 0
            && self.num_v_heads > 0
            && self.num_k_heads != self.num_v_heads
            && self.num_v_heads.is_multiple_of(self.num_k_heads)
    }

    /// The axis of a linear-attention module's weight that is permuted, or `None`
    /// when the module is not reordered.
    pub fn axis(&self, kind: ModuleKind) -> Option<PermutedAxis> {
        if !self.reorders() {
            return None;
        }
        match kind {
            ModuleKind::InProjQkv => Some(PermutedAxis::Rows {
                start: 2 * self.num_k_heads * self.head_k_dim,
                head_dim: self.head_v_dim,
            }),
            ModuleKind::InProjZ => Some(PermutedAxis::Rows {
                start: 0,
                head_dim: self.head_v_dim,
            }),
            ModuleKind::InProjA | ModuleKind::InProjB => Some(PermutedAxis::Rows {
                start: 0,
                head_dim: 1,
            }),
            ModuleKind::OutProj => Some(PermutedAxis::Columns {
                head_dim: self.head_v_dim,
            }),
            _ => None,
        }
    }

    /// The GGUF order as a gather: position `j` of the reordered axis holds position
    /// `permutation(head_dim)[j]` of the checkpoint's (`idx` of `_reorder_v_heads`:
    /// `arange(n).reshape(k, r, head_dim).permute(1, 0, 2)`).
    pub fn permutation(&self, head_dim: usize) -> Vec<usize> {
        let (k, r) = (self.num_k_heads, self.num_v_heads / self.num_k_heads.max(1));
        let mut idx = Vec::with_capacity(k * r * head_dim);
        for v in 0..r {
            for key in 0..k {
                for h in 0..head_dim {
                    idx.push((key * r + v) * head_dim + h);
                }
            }
        }
        idx
    }

    /// The inverse gather: GGUF order back to the checkpoint's.
    pub fn inverse_permutation(&self, head_dim: usize) -> Vec<usize> {
        let forward = self.permutation(head_dim);
        let mut inverse = vec![0; forward.len()];
        for (j, &i) in forward.iter().enumerate() {
            inverse[i] = j;
        }
        inverse
    }
}

/// Gathers rows `start..start + gather.len()` of a row-major matrix with rows of
/// `row_len`: row `start + j` becomes old row `start + gather[j]`.
pub fn gather_rows<T: Copy>(data: &mut [T], row_len: usize, start: usize, gather: &[usize]) {
    let block = &mut data[start * row_len..(start + gather.len()) * row_len];
    let old = block.to_vec();
    for (j, &i) in gather.iter().enumerate() {
        block[j * row_len..(j + 1) * row_len].copy_from_slice(&old[i * row_len..(i + 1) * row_len]);
    }
}

/// Gathers the columns of a row-major matrix with rows of `row_len`: column `j`
/// becomes old column `gather[j]` (`gather.len() == row_len`).
pub fn gather_columns<T: Copy>(data: &mut [T], row_len: usize, gather: &[usize]) {
    let Some(&first) = data.first() else { return };
    let mut old = vec![first; row_len];
    for row in data.chunks_exact_mut(row_len) {
        old.copy_from_slice(row);
        for (j, &i) in gather.iter().enumerate() {
            row[j] = old[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_value_heads_and_inverts() {
        let layout = VHeadLayout {
            num_k_heads: 2,
            num_v_heads: 4,
            head_k_dim: 8,
            head_v_dim: 2,
        };
        // Heads k0v0 k0v1 k1v0 k1v1 -> k0v0 k1v0 k0v1 k1v1, two rows each.
        assert_eq!(layout.permutation(2), vec![0, 1, 4, 5, 2, 3, 6, 7]);
        assert_eq!(layout.permutation(1), vec![0, 2, 1, 3]);
        let inv = layout.inverse_permutation(2);
        let fwd = layout.permutation(2);
        for j in 0..8 {
            assert_eq!(inv[fwd[j]], j);
        }
        let mut m: Vec<u32> = (0..16).collect(); // 8 rows of 2
        gather_rows(&mut m, 2, 0, &fwd);
        assert_eq!(&m[..6], &[0, 1, 2, 3, 8, 9]);
        gather_rows(&mut m, 2, 0, &inv);
        assert_eq!(m, (0..16).collect::<Vec<_>>());
        let equal = VHeadLayout {
            num_v_heads: 2,
            ..layout
        };
        assert!(!equal.reorders());
        assert_eq!(equal.axis(ModuleKind::InProjZ), None);
    }
}
