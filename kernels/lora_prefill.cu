// Prefill-shaped (many tokens) quantized-base + LoRA linears on tensor cores
// (mma.sync m16n8k16, bf16 inputs, f32 accumulation; inline PTX, so only the runtime
// headers are needed).
//
// Y[M, N] = out_scale * ( X[M, K] * Wdq[N, K]^T  +  T[M, r] * B[N, r]^T ) (+ Y if accumulate)
//
// A block computes a 64 x 64 tile of Y with 4 warps (32 x 32 each, 8 mma fragments). For every 32-wide
// slice of the reduction, 128 threads each load 16 weights of one row, dequantize them in
// registers and store bf16 to shared memory; X likewise. The LoRA expand is the same loop
// continued over the rank dimension (fused, same accumulators). T, the LoRA intermediate,
// stays f32 in memory and enters the tensor cores as a bf16 hi/lo pair (T = hi + lo,
// about 16 significant bits), i.e. two passes over B.
//
// NVFP4 codes times their E4M3 block scale are exact in bf16; the global scale is applied
// once to the finished tile (`out_scale`), and the host divides the LoRA scale by it in
// the shrink so T * B comes out right. fp8 codes times their 128x128 tile multiplier are
// rounded to bf16 (relative 2^-9 per weight, within bf16 tolerance of the result).
#include "loraq_common.cuh"

#define BM 64
#define BN 64
#define BK 32
#define PAD 8

struct TileSmem {
    bf16 xs[BM][BK + PAD];
    bf16 ws[BN][BK + PAD];
};

__device__ __forceinline__ void store16_bf16(bf16* dst, const float* v) {
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
        *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(v[i], v[i + 1]);
    }
}

// One thread's share of a BM x BK slice of X (bf16 rows) and a BN x BK slice of W, as
// loaded from global memory: row threadIdx / 2, columns (threadIdx % 2) * 16 .. + 16.
// Fetched one slice ahead, so the loads are in flight while the tensor cores work on
// the slice before. Requires K % 16 == 0.
template <class W>
struct StagedSlice {
    uint4 x0, x1;
    typename W::Chunk::Raw w;
    float w_scale;
};

template <class W>
__device__ __forceinline__ StagedSlice<W> fetch_slice(const bf16* x, int M, int K, const W& w, int N, int m0,
                                                      int n0, int k0) {
    const int r = threadIdx.x >> 1;
    const int k = k0 + (threadIdx.x & 1) * 16;
    StagedSlice<W> st;
    st.x0 = st.x1 = make_uint4(0, 0, 0, 0);
    if (m0 + r < M && k < K) {
        const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)(m0 + r) * K + k);
        st.x0 = __ldg(src);
        st.x1 = __ldg(src + 1);
    }
    const bool w_valid = n0 + r < N && k < K;
    st.w = w_valid ? w.raw16(n0 + r, k) : W::Chunk::zero();
    st.w_scale = w_valid ? w.chunk_scale(n0 + r, k) : 0.0f;
    return st;
}

// Dequantizes a fetched slice into shared memory (bf16; the weight times its chunk scale,
// as W::load16 computes it).
template <class W>
__device__ __forceinline__ void store_slice(TileSmem& s, const StagedSlice<W>& st) {
    const int r = threadIdx.x >> 1;
    const int c = (threadIdx.x & 1) * 16;
    uint4* xs = reinterpret_cast<uint4*>(&s.xs[r][c]);
    xs[0] = st.x0;
    xs[1] = st.x1;
    float v[16];
    W::Chunk::decode(st.w, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] *= st.w_scale;
    store16_bf16(&s.ws[r][c], v);
}

// LoRA slice: X side from the f32 intermediate T (hi or lo bf16 part), W side from B.
// Element-wise with bounds so any rank works.
__device__ __forceinline__ void load_lora_tiles(TileSmem& s, const float* t, int M, int rank, const bf16* lora_b,
                                                int N, int m0, int n0, int k0, bool low_part) {
    const int r = threadIdx.x >> 1;
    const int c = (threadIdx.x & 1) * 16;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int k = k0 + c + i;
        float tv = 0.0f;
        if (m0 + r < M && k < rank) tv = __ldcg(t + (size_t)(m0 + r) * rank + k);
        bf16 hi = __float2bfloat16_rn(tv);
        s.xs[r][c + i] = low_part ? __float2bfloat16_rn(tv - __bfloat162float(hi)) : hi;
        s.ws[r][c + i] = (n0 + r < N && k < rank) ? lora_b[(size_t)(n0 + r) * rank + k] : __float2bfloat16_rn(0.0f);
    }
}

// Per warp: a 32 x 32 output tile = 2 (m16) x 4 (n8) accumulator fragments.
struct WarpAcc {
    float c[2][4][4];
};

__device__ __forceinline__ unsigned int smem_u32(const bf16* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

__device__ __forceinline__ void mma_tile(const TileSmem& s, WarpAcc& acc) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int wm = (warp >> 1) * 32;
    const int wn = (warp & 1) * 32;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        unsigned int a[2][4];
        unsigned int b[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = wm + 16 * i + g;
            a[i][0] = smem_u32(&s.xs[r][kk + 2 * q]);
            a[i][1] = smem_u32(&s.xs[r + 8][kk + 2 * q]);
            a[i][2] = smem_u32(&s.xs[r][kk + 8 + 2 * q]);
            a[i][3] = smem_u32(&s.xs[r + 8][kk + 8 + 2 * q]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = wn + 8 * j + g;
            b[j][0] = smem_u32(&s.ws[n][kk + 2 * q]);
            b[j][1] = smem_u32(&s.ws[n][kk + 8 + 2 * q]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_bf16_16816(acc.c[i][j], a[i], b[j]);
    }
}

__device__ __forceinline__ void store_out(bf16* y, size_t i, float v, int accumulate) {
    if (accumulate) v += __bfloat162float(y[i]);
    y[i] = __float2bfloat16_rn(v);
}

__device__ __forceinline__ void store_out(float* y, size_t i, float v, int accumulate) {
    if (accumulate) v += y[i];
    y[i] = v;
}

template <class W, class OutT>
__device__ void tc_gemm(const bf16* __restrict__ x, int M, int K, W w, int N, const float* t,
                        const bf16* __restrict__ lora_b, int rank, OutT* y, float out_scale, int accumulate) {
    // Two slices: the tensor cores read one while the next is stored into the other, so
    // one barrier per slice suffices (a buffer is rewritten only after every thread has
    // passed the barrier that ended its last read).
    __shared__ __align__(16) TileSmem s[2];
    const int m0 = blockIdx.y * BM;
    const int n0 = blockIdx.x * BN;
    WarpAcc acc;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc.c[i][j][e] = 0.0f;

    if (K > 0) {
        StagedSlice<W> staged = fetch_slice(x, M, K, w, N, m0, n0, 0);
        store_slice(s[0], staged);
        __syncthreads();
        int cur = 0;
        for (int k0 = 0; k0 < K; k0 += BK) {
            const bool more = k0 + BK < K;
            if (more) staged = fetch_slice(x, M, K, w, N, m0, n0, k0 + BK);
            mma_tile(s[cur], acc);
            if (more) store_slice(s[cur ^ 1], staged);
            __syncthreads();
            cur ^= 1;
        }
    }
    if (rank > 0 && t != nullptr) {
        for (int part = 0; part < 2; ++part) {
            for (int k0 = 0; k0 < rank; k0 += BK) {
                load_lora_tiles(s[0], t, M, rank, lora_b, N, m0, n0, k0, part == 1);
                __syncthreads();
                mma_tile(s[0], acc);
                __syncthreads();
            }
        }
    }
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int wm = m0 + (warp >> 1) * 32;
    const int wn = n0 + (warp & 1) * 32;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = wm + 16 * i + g + (e >= 2 ? 8 : 0);
                const int c = wn + 8 * j + 2 * q + (e & 1);
                if (r < M && c < N) store_out(y, (size_t)r * N + c, acc.c[i][j][e] * out_scale, accumulate);
            }
}

// Grid: (ceil(N / 64), ceil(M / 64)), block 128. K == 0 skips the base product (the
// unfused baseline's separate expand launch).
#define TC_ENTRY(NAME, WTYPE, MAKE_W)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) NAME##_tc_gemm(const TcGemmArgs args) {               \
        const int K = args.in_features;                                                                      \
        const void* w_codes = args.w_codes;                                                                  \
        const void* w_scales = args.w_scales;                                                                \
        const float w_global = args.w_global;                                                                \
        WTYPE w = MAKE_W;                                                                                    \
        tc_gemm<WTYPE, bf16>(args.x, args.batch, K, w, args.out_features, args.t, args.lora_b, args.rank,    \
                             args.y, w_global, args.accumulate);                                             \
    }

#define MAKE_BF16 Bf16Weight{static_cast<const bf16*>(w_codes), K, w_global}
#define MAKE_FP8 \
    Fp8Block128Weight{static_cast<const unsigned char*>(w_codes), static_cast<const float*>(w_scales), K, (K + 127) / 128, w_global}
#define MAKE_NVFP4 \
    Nvfp4Weight{static_cast<const unsigned char*>(w_codes), static_cast<const unsigned char*>(w_scales), K, w_global}

TC_ENTRY(bf16, Bf16Weight, MAKE_BF16)
TC_ENTRY(fp8b128, Fp8Block128Weight, MAKE_FP8)
TC_ENTRY(nvfp4, Nvfp4Weight, MAKE_NVFP4)

// T[M, rank] = t_scale * X A^T in f32 (grid: (ceil(rank / 64), ceil(M / 64)), block 128).
extern "C" __global__ void __launch_bounds__(128) lora_tc_shrink(const LoraShrinkArgs args) {
    Bf16Weight a{args.lora_a, args.in_features, 1.0f};
    tc_gemm<Bf16Weight, float>(args.x, args.batch, args.in_features, a, args.rank, nullptr, nullptr, 0, args.t,
                               args.t_scale, 0);
}
