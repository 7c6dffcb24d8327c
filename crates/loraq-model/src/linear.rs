//! Linear projections with an optional LoRA adapter applied unmerged at run time.
//!
//! The model calls every projection through [`LinearLayer`], so the dense f32
//! implementation here can be replaced by loraq-kernels' quantized-base linears
//! without touching the model.

use crate::error::{ModelError, Result, TensorContext};
use candle_core::Tensor;
use loraq_quant::ActivationQuant;

/// A projection `y = x W^T (+ adapter)` from `[tokens, in]` to `[tokens, out]`, on
/// plain row-major f32 buffers (the forward pass keeps its activations in reused
/// buffers, never in per-call tensors).
pub trait LinearLayer: Send + Sync + std::fmt::Debug {
    /// Writes the projection of `x` (`[tokens, in_features]` row-major) into `out`
    /// (`[tokens, out_features]`, every element overwritten).
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()>;
    /// Input features.
    fn in_features(&self) -> usize;
    /// Output features.
    fn out_features(&self) -> usize;
}

/// Running sums of one linear's squared inputs, per input feature, in f64, and
/// the largest absolute input seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputSqSum {
    /// `sum over tokens of x_k^2`, `[in_features]`.
    pub sum_sq: Vec<f64>,
    /// `max over tokens and features of |x|` (0 before any token): the amax a static
    /// activation scale is calibrated from.
    pub abs_max: f32,
    /// Tokens (rows of the input) accumulated.
    pub tokens: u64,
}

impl InputSqSum {
    /// Zero sums for a linear of `in_features` inputs.
    pub fn new(in_features: usize) -> InputSqSum {
        InputSqSum {
            sum_sq: vec![0.0; in_features],
            abs_max: 0.0,
            tokens: 0,
        }
    }

    /// Adds the rows of `x` (`[tokens, in_features]` row-major).
    pub fn add_rows(&mut self, x: &[f32]) {
        let width = self.sum_sq.len();
        for row in x.chunks_exact(width) {
            for (s, &v) in self.sum_sq.iter_mut().zip(row) {
                // A NaN input makes the maximum NaN too, so write_activation_stats
                // refuses it instead of calibrating a scale around it.
                let magnitude = v.abs();
                if magnitude > self.abs_max || magnitude.is_nan() {
                    self.abs_max = magnitude;
                }
                let v = f64::from(v);
                *s += v * v;
            }
            self.tokens += 1;
        }
    }

    /// `E[x_k^2]`: the sums over the token count (zeros before any token).
    pub fn mean(&self) -> Vec<f64> {
        let n = self.tokens.max(1) as f64;
        self.sum_sq.iter().map(|s| s / n).collect()
    }
}

/// A linear that records the mean square of its input before handing it on
/// unchanged to the wrapped linear, so the statistics see the activation as it
/// enters the module, before any activation fake-quant the wrapped linear applies.
///
/// Only built when statistics are asked for; a model loaded without them runs its
/// linears unwrapped.
#[derive(Debug)]
pub struct InputStatsLinear {
    /// The module path, for error messages.
    pub name: String,
    inner: Box<dyn LinearLayer>,
    sums: std::sync::Arc<std::sync::Mutex<InputSqSum>>,
}

impl InputStatsLinear {
    /// Wraps `inner`, accumulating into `sums` (shared with whoever reads them).
    pub fn new(
        name: String,
        inner: Box<dyn LinearLayer>,
        sums: std::sync::Arc<std::sync::Mutex<InputSqSum>>,
    ) -> InputStatsLinear {
        InputStatsLinear { name, inner, sums }
    }
}

impl LinearLayer for InputStatsLinear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()> {
        check_shapes(&self.name, self.inner.as_ref(), x, tokens, out)?;
        // A poisoned lock only means another forward pass panicked; the sums it
        // guards are still whole rows, so keep using them.
        self.sums
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_rows(x);
        self.inner.forward(x, tokens, out)
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn out_features(&self) -> usize {
        self.inner.out_features()
    }
}

/// Refuses buffers whose lengths are not `tokens` rows of the linear's inputs and
/// outputs, naming the module.
fn check_shapes(
    name: &str,
    linear: &dyn LinearLayer,
    x: &[f32],
    tokens: usize,
    out: &[f32],
) -> Result<()> {
    let expected_in = tokens.checked_mul(linear.in_features());
    let expected_out = tokens.checked_mul(linear.out_features());
    if expected_in != Some(x.len()) || expected_out != Some(out.len()) {
        return Err(ModelError::Tensor {
            context: name.to_string(),
            source: candle_core::Error::Msg(format!(
                "{tokens} tokens: input of {} values and output of {} for a linear of {} inputs and {} outputs",
                x.len(),
                out.len(),
                linear.in_features(),
                linear.out_features()
            )),
        });
    }
    Ok(())
}

/// The low-rank factors of one adapted module.
#[derive(Debug, Clone)]
pub struct LoraFactorsF32 {
    /// `lora_A`, `[rank, in]`.
    pub a: Tensor,
    /// `lora_B`, `[out, rank]`.
    pub b: Tensor,
    /// `alpha / rank` of the module.
    pub scale: f64,
}

/// A dense f32 weight with an optional LoRA: `y = act_q(x) W^T + scale (x A^T) B^T`.
///
/// The adapter path is applied to the unquantized input and never merged into `W`,
/// so a quantized or rounded base keeps its own error and the adapter its own.
#[derive(Debug, Clone)]
pub struct DenseLinear {
    /// The module path, for error messages.
    pub name: String,
    /// `W^T`, `[in, out]`: stored transposed so the product is one contiguous matmul.
    weight_t: Tensor,
    lora: Option<LoraFactorsF32>,
    act_quant: ActivationQuant,
    in_features: usize,
    out_features: usize,
}

impl DenseLinear {
    /// Builds the layer from `weight` `[out, in]` and optional factors.
    pub fn new(name: String, weight: &Tensor, lora: Option<LoraFactorsF32>) -> Result<DenseLinear> {
        let (out_features, in_features) = weight.dims2().ctx(&name)?;
        let lora = lora
            .map(|f| -> Result<LoraFactorsF32> {
                Ok(LoraFactorsF32 {
                    // Transposed once here for the same reason as the weight.
                    a: f.a.t().ctx(&name)?.contiguous().ctx(&name)?,
                    b: f.b.t().ctx(&name)?.contiguous().ctx(&name)?,
                    scale: f.scale,
                })
            })
            .transpose()?;
        Ok(DenseLinear {
            weight_t: weight.t().ctx(&name)?.contiguous().ctx(&name)?,
            name,
            lora,
            act_quant: ActivationQuant::None,
            in_features,
            out_features,
        })
    }

    /// Sets the activation fake-quant of the base path.
    pub fn with_act_quant(mut self, act_quant: ActivationQuant) -> DenseLinear {
        self.act_quant = act_quant;
        self
    }

    /// Whether an adapter is attached.
    pub fn has_adapter(&self) -> bool {
        self.lora.is_some()
    }
}

impl LinearLayer for DenseLinear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()> {
        check_shapes(&self.name, self, x, tokens, out)?;
        let ctx = self.name.as_str();
        let device = self.weight_t.device();
        let input = Tensor::from_slice(x, (tokens, self.in_features), device).ctx(ctx)?;
        let base = match self.act_quant {
            ActivationQuant::None => input.matmul(&self.weight_t).ctx(ctx)?,
            quant => {
                let mut values = x.to_vec();
                quant
                    .apply(ctx, &mut values, self.in_features)
                    .map_err(|source| ModelError::Quant {
                        module: self.name.clone(),
                        source,
                    })?;
                Tensor::from_vec(values, (tokens, self.in_features), device)
                    .ctx(ctx)?
                    .matmul(&self.weight_t)
                    .ctx(ctx)?
            }
        };
        let y = match &self.lora {
            None => base,
            Some(f) => {
                // f.a holds A^T [in, r], f.b holds B^T [r, out].
                let low = input.matmul(&f.a).ctx(ctx)?.matmul(&f.b).ctx(ctx)?;
                (base + (low * f.scale).ctx(ctx)?).ctx(ctx)?
            }
        };
        let values: Vec<f32> = y.flatten_all().ctx(ctx)?.to_vec1().ctx(ctx)?;
        out.copy_from_slice(&values);
        Ok(())
    }

    fn in_features(&self) -> usize {
        self.in_features
    }

    fn out_features(&self) -> usize {
        self.out_features
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn lora_adds_scaled_low_rank_product() {
        let dev = Device::Cpu;
        // W = [[1, 2], [3, 4]], A = [[1, 1]] (rank 1), B = [[1], [-1]], scale 0.5, x = [1, 2].
        // W x = [5, 11]; A x = 3; B (A x) = [3, -3]; y = [5 + 1.5, 11 - 1.5].
        let w = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), &dev).unwrap();
        let a = Tensor::from_vec(vec![1f32, 1.], (1, 2), &dev).unwrap();
        let b = Tensor::from_vec(vec![1f32, -1.], (2, 1), &dev).unwrap();
        let lin =
            DenseLinear::new("t".into(), &w, Some(LoraFactorsF32 { a, b, scale: 0.5 })).unwrap();
        let mut y = vec![0f32; 2];
        lin.forward(&[1., 2.], 1, &mut y).unwrap();
        assert_eq!(y, vec![6.5, 9.5]);
        assert_eq!((lin.in_features(), lin.out_features()), (2, 2));
    }

    #[test]
    fn gathered_input_linear_is_the_ungathered_product() {
        // W (3 x 6) and A (1 x 6) of small integers: every sum is exact in f32, in any
        // order, so the gathered product must equal the plain one bit for bit.
        let dev = Device::Cpu;
        let (out, inp) = (3usize, 6usize);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| (i as f32 * 7.0) % 11.0 - 5.0)
            .collect();
        let a: Vec<f32> = (0..inp).map(|i| i as f32 - 2.0).collect();
        let b = vec![1f32, -2.0, 3.0];
        // Two runs of two columns and two single columns.
        let gather = [4usize, 5, 0, 1, 3, 2];
        let gathered = |m: &[f32]| -> Vec<f32> {
            m.chunks_exact(inp)
                .flat_map(|row| gather.iter().map(move |&c| row[c]))
                .collect()
        };
        let t = |v: &[f32], r: usize, c: usize| Tensor::from_slice(v, (r, c), &dev).unwrap();
        let lora = |a: &[f32]| LoraFactorsF32 {
            a: t(a, 1, inp),
            b: t(&b, out, 1),
            scale: 0.5,
        };
        let plain = DenseLinear::new("m".into(), &t(&w, out, inp), Some(lora(&a))).unwrap();
        let inner = DenseLinear::new(
            "m".into(),
            &t(&gathered(&w), out, inp),
            Some(lora(&gathered(&a))),
        )
        .unwrap();
        let linear = GatheredInputLinear::new("m".into(), Box::new(inner), &gather).unwrap();
        assert_eq!(
            linear.runs,
            vec![(4, 0, 2), (0, 2, 2), (3, 4, 1), (2, 5, 1)]
        );
        let tokens = 2;
        let x: Vec<f32> = (0..tokens * inp).map(|i| (i % 5) as f32 - 1.0).collect();
        let (mut want, mut got) = (vec![0f32; tokens * out], vec![f32::NAN; tokens * out]);
        plain.forward(&x, tokens, &mut want).unwrap();
        linear.forward(&x, tokens, &mut got).unwrap();
        assert_eq!(got, want);
        // Not a permutation of the six inputs: refused.
        for bad in [
            &[0usize, 1, 2, 3, 4][..],
            &[0, 1, 2, 3, 4, 4],
            &[0, 1, 2, 3, 4, 6],
        ] {
            let inner = DenseLinear::new("m".into(), &t(&w, out, inp), None).unwrap();
            assert!(GatheredInputLinear::new("m".into(), Box::new(inner), bad).is_err());
        }
    }
}

/// A linear run by one of loraq-kernels' backends (CPU, reference, CUDA) on the base
/// weight in its stored format, with the adapter's bf16 factors applied unmerged.
#[derive(Debug)]
pub struct KernelLinear {
    /// The module path, for error messages.
    pub name: String,
    inner: Box<dyn loraq_kernels::LoraLinear>,
}

impl KernelLinear {
    /// Wraps a built kernels linear.
    pub fn new(name: String, inner: Box<dyn loraq_kernels::LoraLinear>) -> KernelLinear {
        KernelLinear { name, inner }
    }
}

impl LinearLayer for KernelLinear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()> {
        check_shapes(&self.name, self, x, tokens, out)?;
        self.inner
            .forward(x, tokens, out)
            .map_err(|source| ModelError::Kernel {
                module: self.name.clone(),
                source,
            })
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn out_features(&self) -> usize {
        self.inner.out_features()
    }
}

/// A linear whose weight is stored with its input columns in another order (a GGUF
/// `out_proj` kept in GGUF's column order, loraq-quant's
/// `LinearWeight::input_gather`): each token's input is gathered into the stored
/// order, `x'[j] = x[gather[j]]`, before the wrapped linear runs, so the wrapped
/// linear's `W' x' + s B (A' x')` (`W'`, `A'` with their columns gathered the same way)
/// is the checkpoint's `W x + s B (A x)`, term for term. Only the summation order of
/// each dot product changes.
#[derive(Debug)]
pub struct GatheredInputLinear {
    /// The module path, for error messages.
    pub name: String,
    inner: Box<dyn LinearLayer>,
    /// `(from, to, len)`: the gather as runs of consecutive columns (a value head's
    /// columns move together), copied as slices.
    runs: Vec<(usize, usize, usize)>,
    /// The gathered input, kept between calls so a batch allocates nothing (a call
    /// that finds it in use by another thread allocates its own).
    scratch: std::sync::Mutex<Vec<f32>>,
}

impl GatheredInputLinear {
    /// Wraps `inner`, whose input is `x` gathered by `gather` (`gather[j]` is the input
    /// column that becomes column `j`); refuses a gather that is not a permutation of
    /// `inner`'s input columns.
    pub fn new(
        name: String,
        inner: Box<dyn LinearLayer>,
        gather: &[usize],
    ) -> Result<GatheredInputLinear> {
        let n = inner.in_features();
        let mut seen = vec![false; n];
        let is_permutation = gather.len() == n
            && gather
                .iter()
                .all(|&i| i < n && !std::mem::replace(&mut seen[i], true));
        if !is_permutation {
            return Err(ModelError::Tensor {
                context: name,
                source: candle_core::Error::Msg(format!(
                    "an input gather of {} entries is not a permutation of the linear's {n} inputs",
                    gather.len()
                )),
            });
        }
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (to, &from) in gather.iter().enumerate() {
            match runs.last_mut() {
                Some((f, t, len)) if *f + *len == from && *t + *len == to => *len += 1,
                _ => runs.push((from, to, 1)),
            }
        }
        Ok(GatheredInputLinear {
            name,
            inner,
            runs,
            scratch: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn gather_into(&self, x: &[f32], gathered: &mut [f32]) {
        let width = self.in_features();
        for (src, dst) in x
            .chunks_exact(width.max(1))
            .zip(gathered.chunks_exact_mut(width.max(1)))
        {
            for &(from, to, len) in &self.runs {
                dst[to..to + len].copy_from_slice(&src[from..from + len]);
            }
        }
    }
}

impl LinearLayer for GatheredInputLinear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()> {
        check_shapes(&self.name, self, x, tokens, out)?;
        let mut own = Vec::new();
        let mut shared = self.scratch.try_lock();
        let gathered = match shared.as_deref_mut() {
            Ok(buffer) => buffer,
            Err(_) => &mut own,
        };
        gathered.resize(x.len(), 0.0);
        self.gather_into(x, gathered);
        self.inner.forward(gathered, tokens, out)
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn out_features(&self) -> usize {
        self.inner.out_features()
    }
}

/// Tokens from which [`AmxLinear`] runs a product on AMX tiles; fewer go to the
/// wrapped linear (the kernels' GEMV, which reads the stored codes once per token).
pub const AMX_MIN_TOKENS: usize = 16;

/// A linear whose prefill-sized products run on AMX bf16 tiles (loraq-amx), exactly
/// as accurate as an f32 product: the weight's values are bf16, packed once into the
/// tile layout ([`loraq_amx::PackedBf16`]), so each `x_k w_jk` is formed exactly from
/// the three bf16 planes of `x_k` times `w_jk` (three tile products) and summed in f32,
/// as the f32 GEMM sums them. The LoRA path is the same two products as the kernels'
/// (`s (x A^T)` in f32, then times `B^T`), each on the tiles with the bf16 factors
/// packed once as the one-plane operand, and added to the output (one more f32
/// rounding per element than the kernels' fused tile). Below [`AMX_MIN_TOKENS`] tokens
/// it calls the wrapped linear.
#[derive(Debug)]
pub struct AmxLinear {
    /// The module path, for error messages.
    pub name: String,
    amx: loraq_amx::Amx,
    inner: Box<dyn LinearLayer>,
    /// `W`, `[out_features, in_features]`.
    weight: loraq_amx::PackedBf16,
    lora: Option<AmxLora>,
}

/// The LoRA factors of an [`AmxLinear`], bf16 values packed once for the tiles.
#[derive(Debug)]
pub struct AmxLora {
    /// `lora_A`, `[rank, in_features]` (the weight of `x A^T`).
    pub a: loraq_amx::PackedBf16,
    /// `lora_B`, `[out_features, rank]` (the weight of `(s x A^T) B^T`).
    pub b: loraq_amx::PackedBf16,
    /// `alpha / rank` of the module.
    pub scale: f32,
}

impl AmxLinear {
    /// Wraps `inner` (the linear of `weight` `[out_features, in_features]` and the
    /// optional factors); gives `inner` back when a shape disagrees with it, and the
    /// caller keeps it alone.
    pub fn new(
        name: String,
        amx: loraq_amx::Amx,
        inner: Box<dyn LinearLayer>,
        weight: loraq_amx::PackedBf16,
        lora: Option<AmxLora>,
    ) -> std::result::Result<AmxLinear, Box<dyn LinearLayer>> {
        let (out_features, in_features) = (inner.out_features(), inner.in_features());
        let weight_agrees =
            (weight.out_features(), weight.in_features()) == (out_features, in_features);
        let lora_agrees = lora.as_ref().is_none_or(|f| {
            let rank = f.a.out_features();
            f.a.in_features() == in_features
                && (f.b.out_features(), f.b.in_features()) == (out_features, rank)
        });
        if !weight_agrees || !lora_agrees {
            return Err(inner);
        }
        Ok(AmxLinear {
            name,
            amx,
            inner,
            weight,
            lora,
        })
    }

    fn tiles(
        &self,
        x: &[f32],
        tokens: usize,
        out: &mut [f32],
    ) -> std::result::Result<(), loraq_amx::AmxError> {
        use loraq_amx::{Accumulate, MatrixMut, MatrixRef, Planes};
        let (out_features, in_features) = (self.out_features(), self.in_features());
        let x = MatrixRef::row_major(x, tokens, in_features)?;
        self.amx.matmul_packed(
            MatrixMut::row_major(out, tokens, out_features, out_features)?,
            x,
            Planes::Three,
            &self.weight,
            Accumulate::Replace,
        )?;
        if let Some(lora) = &self.lora {
            let rank = lora.a.out_features();
            let mut low = vec![0f32; tokens * rank];
            self.amx.matmul_packed(
                MatrixMut::row_major(&mut low, tokens, rank, rank)?,
                x,
                Planes::Three,
                &lora.a,
                Accumulate::Replace,
            )?;
            for v in &mut low {
                *v *= lora.scale;
            }
            self.amx.matmul_packed(
                MatrixMut::row_major(out, tokens, out_features, out_features)?,
                MatrixRef::row_major(&low, tokens, rank)?,
                Planes::Three,
                &lora.b,
                Accumulate::Add,
            )?;
        }
        Ok(())
    }
}

impl LinearLayer for AmxLinear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<()> {
        if tokens < AMX_MIN_TOKENS {
            // The wrapped linear checks the shapes itself.
            return self.inner.forward(x, tokens, out);
        }
        check_shapes(&self.name, self, x, tokens, out)?;
        self.tiles(x, tokens, out)
            .map_err(|source| ModelError::Amx {
                module: self.name.clone(),
                source,
            })
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn out_features(&self) -> usize {
        self.inner.out_features()
    }
}

#[cfg(test)]
mod amx_tests {
    use super::*;
    use candle_core::Device;
    use loraq_amx::PackedBf16;

    /// Deterministic bf16 values in about `[-scale, scale)`.
    fn bf16_values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                loraq_amx::round_bf16(unit * 2.0 * scale)
            })
            .collect()
    }

    /// `x W^T + scale (x A^T) B^T` in f64, and per element the sum of the magnitudes of
    /// its terms (the scale of its f32 rounding).
    fn reference(
        x: &[f32],
        tokens: usize,
        w: &[f32],
        (a, b, scale): (&[f32], &[f32], f32),
        rank: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let inp = x.len() / tokens;
        let out = w.len() / inp;
        let mut y = vec![0f64; tokens * out];
        let mut magnitude = vec![0f64; tokens * out];
        for t in 0..tokens {
            let xr = &x[t * inp..(t + 1) * inp];
            let low: Vec<f64> = (0..rank)
                .map(|r| {
                    let ar = &a[r * inp..(r + 1) * inp];
                    f64::from(scale)
                        * xr.iter()
                            .zip(ar)
                            .map(|(&p, &q)| f64::from(p) * f64::from(q))
                            .sum::<f64>()
                })
                .collect();
            for j in 0..out {
                let wr = &w[j * inp..(j + 1) * inp];
                let base: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum();
                let lora: f64 = (0..rank).map(|r| low[r] * f64::from(b[j * rank + r])).sum();
                y[t * out + j] = base + lora;
                magnitude[t * out + j] = xr
                    .iter()
                    .zip(wr)
                    .map(|(&p, &q)| f64::from(p.abs()) * f64::from(q.abs()))
                    .sum::<f64>()
                    + (0..rank)
                        .map(|r| low[r].abs() * f64::from(b[j * rank + r].abs()))
                        .sum::<f64>();
            }
        }
        (y, magnitude)
    }

    #[test]
    fn amx_linear_equals_the_f64_product_and_falls_back() {
        let (out, inp, rank) = (40usize, 72usize, 4usize);
        let w = bf16_values(out * inp, 1, 1.0);
        let a = bf16_values(rank * inp, 2, 0.5);
        let b = bf16_values(out * rank, 3, 0.5);
        let scale = 2.0f32;
        let dev = Device::Cpu;
        let dense = || {
            let t = |v: &[f32], r, c| Tensor::from_slice(v, (r, c), &dev).unwrap();
            let lora = LoraFactorsF32 {
                a: t(&a, rank, inp),
                b: t(&b, out, rank),
                scale: f64::from(scale),
            };
            Box::new(DenseLinear::new("m".into(), &t(&w, out, inp), Some(lora)).unwrap())
        };
        let pack = |v: &[f32], rows, cols| PackedBf16::from_weight_f32(v, rows, cols).unwrap();
        // A weight of another shape: the wrapped linear comes back.
        if let Some(amx) = loraq_amx::Amx::detect() {
            let refused = AmxLinear::new("m".into(), amx, dense(), pack(&w, inp, out), None);
            assert!(refused.is_err_and(|inner| inner.out_features() == out));
        }
        // 37 tokens (tiles and the AMX path, where present) and 5 (the fallback).
        for tokens in [37usize, 5] {
            // Activations are f32 values, not bf16: all three planes matter.
            let x: Vec<f32> = bf16_values(tokens * inp, 4, 3.0)
                .iter()
                .zip(bf16_values(tokens * inp, 5, 0.01))
                .map(|(p, q)| p + q / 3.0)
                .collect();
            let (y_ref, magnitude) = reference(&x, tokens, &w, (&a, &b, scale), rank);
            let linear: Box<dyn LinearLayer> = match loraq_amx::Amx::detect() {
                Some(amx) => Box::new(
                    AmxLinear::new(
                        "m".into(),
                        amx,
                        dense(),
                        pack(&w, out, inp),
                        Some(AmxLora {
                            a: pack(&a, rank, inp),
                            b: pack(&b, out, rank),
                            scale,
                        }),
                    )
                    .expect("shapes agree"),
                ),
                // No AMX here: the dense linear is what the model keeps.
                None => dense(),
            };
            let mut y = vec![f32::NAN; tokens * out];
            linear.forward(&x, tokens, &mut y).unwrap();
            for (i, ((&got, &want), &m)) in y.iter().zip(&y_ref).zip(&magnitude).enumerate() {
                // f32 accumulation of inp + rank terms and the added LoRA path.
                let bound = 4.0 * (inp + rank + 2) as f64 * f64::from(f32::EPSILON) * m;
                assert!(
                    (f64::from(got) - want).abs() <= bound,
                    "{tokens} tokens, element {i}: {got} vs {want} (bound {bound})"
                );
            }
        }
    }
}
