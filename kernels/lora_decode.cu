// Decode-shaped (batch 1..16) quantized-base + LoRA linears: y = g * W x + B (s * A x).
//
// One warp owns R consecutive output rows; each lane streams 16 weights of every row
// per step (16-byte fp8 / 8-byte nvfp4 / 32-byte bf16 loads, a warp covers 512 inputs),
// dequantizes them in registers and multiplies them into all NB tokens' accumulators.
// x (bf16) is re-read from L1/L2, the weight exactly once.
//
// Fused kernels are ONE launch: the first `shrink_blocks` blocks compute the LoRA
// intermediate t = s * A x (f32, [batch, rank]) and publish it with a release counter;
// the other blocks stream their base rows first and only then wait for the counter,
// so the shrink overlaps the base stream. The counter is never reset: the host passes
// the value it will have reached when this launch's shrink is complete (`target`).
// Shrink blocks have the lowest indices and never wait, so they are always scheduled
// and the wait cannot deadlock.
#include "loraq_common.cuh"

// Warps per block are chosen by the host (2, 4 or 8) to spread the rows evenly over
// the SMs; every index below derives from blockDim.
#define WARPS_PER_BLOCK ((int)(blockDim.x >> 5))

template <int NB>
struct RowsPerWarp {
    static constexpr int value = NB <= 4 ? 4 : 2;
};

// acc[r][b] = sum_k W[row0 + r, k] * x[b, k] (warp-reduced, valid in every lane).
template <class W, class XT, int NB, int R>
__device__ __forceinline__ void warp_rows_dot(const W& w, int row0, int rows_valid, const XT* x,
                                              int x_stride, int batch, int K, float (&acc)[R][NB]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;
    if ((K & 15) == 0) {
        for (int k = lane * 16; k < K; k += 32 * 16) {
            float wv[R][16];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < rows_valid) {
                    w.load16(row0 + r, k, wv[r]);
                } else {
#pragma unroll
                    for (int i = 0; i < 16; ++i) wv[r][i] = 0.0f;
                }
            }
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b < batch) {
                    float xv[16];
                    load16_x(x + (size_t)b * x_stride + k, xv);
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < 16; ++i) acc[r][b] = fmaf(wv[r][i], xv[i], acc[r][b]);
                }
            }
        }
    } else {
        // Unaligned reduction length (small LoRA ranks): one element per lane per step.
        for (int k = lane; k < K; k += 32) {
            float wv[R];
#pragma unroll
            for (int r = 0; r < R; ++r) wv[r] = r < rows_valid ? w.get(row0 + r, k) : 0.0f;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b < batch) {
                    float xv = load1_x(x + (size_t)b * x_stride + k);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][b] = fmaf(wv[r], xv, acc[r][b]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = warp_sum(acc[r][b]);
}

// t[b, j] = t_scale * sum_k A[j, k] x[b, k] for this warp's rows of A.
template <int NB, int R>
__device__ __forceinline__ void shrink_rows(const bf16* lora_a, int rank, int K, const bf16* x, int batch,
                                            float t_scale, float* t, int warp_global) {
    const int row0 = warp_global * R;
    if (row0 >= rank) return;
    Bf16Weight a{lora_a, K, 1.0f};
    float acc[R][NB];
    warp_rows_dot<Bf16Weight, bf16, NB, R>(a, row0, rank - row0, x, K, batch, K, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                if (row0 + r < rank && b < batch) t[(size_t)b * rank + row0 + r] = acc[r][b] * t_scale;
    }
}

template <class W, int NB>
__device__ void fused_kernel(const bf16* __restrict__ x, int batch, int N, int K, W w,
                             const bf16* __restrict__ lora_a, const bf16* __restrict__ lora_b, int rank,
                             float t_scale, float* t, unsigned int* counter, unsigned int target,
                             int shrink_blocks, bf16* __restrict__ y) {
    constexpr int R = RowsPerWarp<NB>::value;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    if ((int)blockIdx.x < shrink_blocks) {
        shrink_rows<NB, R>(lora_a, rank, K, x, batch, t_scale, t, blockIdx.x * WARPS_PER_BLOCK + warp);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counter, 1u);
        return;
    }
    const int row0 = ((blockIdx.x - shrink_blocks) * WARPS_PER_BLOCK + warp) * R;
    const int rows_valid = N - row0;
    float acc[R][NB];
    if (rows_valid > 0) {
        warp_rows_dot<W, bf16, NB, R>(w, row0, rows_valid, x, K, batch, K, acc);
    }
    if (rank > 0) {
        // Wait for every shrink block of this launch (acquire).
        if (threadIdx.x == 0) {
            while ((int)(atomicAdd(counter, 0u) - target) < 0) __nanosleep(64);
            __threadfence();
        }
        __syncthreads();
    }
    if (rows_valid <= 0) return;
    float lora[R][NB];
    if (rank > 0) {
        Bf16Weight b{lora_b, rank, 1.0f};
        warp_rows_dot<Bf16Weight, float, NB, R>(b, row0, rows_valid, t, rank, batch, rank, lora);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                if (r < rows_valid && b < batch) {
                    float v = acc[r][b] * w.global + (rank > 0 ? lora[r][b] : 0.0f);
                    y[(size_t)b * N + row0 + r] = __float2bfloat16_rn(v);
                }
    }
}

// Unfused baseline, step 1: y = g * W x.
template <class W, int NB>
__device__ void base_kernel(const bf16* __restrict__ x, int batch, int N, int K, W w, bf16* __restrict__ y) {
    constexpr int R = RowsPerWarp<NB>::value;
    const int row0 = (blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5)) * R;
    if (row0 >= N) return;
    float acc[R][NB];
    warp_rows_dot<W, bf16, NB, R>(w, row0, N - row0, x, K, batch, K, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                if (row0 + r < N && b < batch)
                    y[(size_t)b * N + row0 + r] = __float2bfloat16_rn(acc[r][b] * w.global);
    }
}

#define FORMAT_ENTRIES(NAME, WTYPE, MAKE_W, NB)                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME##_fused_b##NB(                              \
        const bf16* x, int batch, int N, int K, const void* w_codes, const void* w_scales,             \
        float w_global, const bf16* lora_a, const bf16* lora_b, int rank, float t_scale, float* t,     \
        unsigned int* counter, unsigned int target, int shrink_blocks, bf16* y) {                      \
        WTYPE w = MAKE_W;                                                                              \
        fused_kernel<WTYPE, NB>(x, batch, N, K, w, lora_a, lora_b, rank, t_scale, t, counter, target, \
                                shrink_blocks, y);                                                     \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME##_base_b##NB(                               \
        const bf16* x, int batch, int N, int K, const void* w_codes, const void* w_scales,             \
        float w_global, bf16* y) {                                                                     \
        WTYPE w = MAKE_W;                                                                              \
        base_kernel<WTYPE, NB>(x, batch, N, K, w, y);                                                  \
    }

#define MAKE_BF16 Bf16Weight{static_cast<const bf16*>(w_codes), K, w_global}
#define MAKE_FP8 \
    Fp8Block128Weight{static_cast<const unsigned char*>(w_codes), static_cast<const float*>(w_scales), K, (K + 127) / 128, w_global}
#define MAKE_NVFP4 \
    Nvfp4Weight{static_cast<const unsigned char*>(w_codes), static_cast<const unsigned char*>(w_scales), K, w_global}

#define ALL_FORMATS(NB)                                     \
    FORMAT_ENTRIES(bf16, Bf16Weight, MAKE_BF16, NB)         \
    FORMAT_ENTRIES(fp8b128, Fp8Block128Weight, MAKE_FP8, NB) \
    FORMAT_ENTRIES(nvfp4, Nvfp4Weight, MAKE_NVFP4, NB)

// Unfused baseline, step 2: t = s * A x (grid: ceil(rank / rows per block)).
// Step 3: y += B t (grid: ceil(N / rows per block)).
#define LORA_ENTRIES(NB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) lora_shrink_b##NB(                                \
        const bf16* x, int batch, int K, const bf16* lora_a, int rank, float t_scale, float* t) {       \
        shrink_rows<NB, RowsPerWarp<NB>::value>(lora_a, rank, K, x, batch, t_scale, t,                   \
                                                blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5));      \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) lora_expand_b##NB(                                \
        const float* t, int batch, int N, const bf16* lora_b, int rank, bf16* y) {                       \
        constexpr int R = RowsPerWarp<NB>::value;                                                        \
        const int row0 = (blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5)) * R;                        \
        if (row0 >= N) return;                                                                           \
        Bf16Weight b{lora_b, rank, 1.0f};                                                                \
        float acc[R][NB];                                                                                \
        warp_rows_dot<Bf16Weight, float, NB, R>(b, row0, N - row0, t, rank, batch, rank, acc);           \
        if ((threadIdx.x & 31) == 0) {                                                                   \
            for (int r = 0; r < R; ++r)                                                                  \
                for (int bb = 0; bb < NB; ++bb)                                                          \
                    if (row0 + r < N && bb < batch) {                                                    \
                        size_t i = (size_t)bb * N + row0 + r;                                            \
                        y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + acc[r][bb]);                 \
                    }                                                                                    \
        }                                                                                                \
    }

// Batch 1, <= 4, <= 16: the decode kernels are bandwidth-bound, so padding the token
// count costs registers, not time, and three instantiations keep NVRTC fast.
ALL_FORMATS(1)
ALL_FORMATS(4)
ALL_FORMATS(16)
LORA_ENTRIES(1)
LORA_ENTRIES(4)
LORA_ENTRIES(16)
