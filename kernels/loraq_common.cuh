// Shared device code of the loraq kernels: weight formats decoded in registers.
// Layouts are those of DESIGN.md ("Quantized checkpoints"); rows are output features,
// columns input features, row-major.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;

// E4M3 code -> f32: the code's exponent+mantissa bits are placed under f32's, the value
// is then 2^-120 of the E4M3 value (subnormals land on f32 subnormals, exactly), and one
// multiply by 2^120 rebiases. The codes 0x7F/0xFF (NaN) never occur in a quantized weight
// (the host refuses them).
__device__ __forceinline__ float e4m3_to_f32(unsigned int code) {
    return __uint_as_float(((code & 0x7Fu) << 20) | ((code & 0x80u) << 24)) * 0x1p120f;
}

// E2M1 code (4 bits) -> f32, the same trick with a 2^126 rebias:
// {0, .5, 1, 1.5, 2, 3, 4, 6} and their negatives.
__device__ __forceinline__ float e2m1_to_f32(unsigned int code) {
    return __uint_as_float(((code & 0x7u) << 22) | ((code & 0x8u) << 28)) * 0x1p126f;
}

__device__ __forceinline__ void unpack_bf16x2(unsigned int word, float* out) {
    out[0] = __uint_as_float(word << 16);
    out[1] = __uint_as_float(word & 0xFFFF0000u);
}

// 16 consecutive bf16 -> f32 (32-byte aligned).
__device__ __forceinline__ void load16_bf16(const bf16* p, float* out) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
    uint4 a = __ldg(v);
    uint4 b = __ldg(v + 1);
    unpack_bf16x2(a.x, out + 0);
    unpack_bf16x2(a.y, out + 2);
    unpack_bf16x2(a.z, out + 4);
    unpack_bf16x2(a.w, out + 6);
    unpack_bf16x2(b.x, out + 8);
    unpack_bf16x2(b.y, out + 10);
    unpack_bf16x2(b.z, out + 12);
    unpack_bf16x2(b.w, out + 14);
}

// 16 consecutive f32 (64-byte aligned), read through L2 only: the LoRA intermediate may
// have been written by another block of the same launch.
__device__ __forceinline__ void load16_f32_cg(const float* p, float* out) {
    const float4* v = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 q = __ldcg(v + i);
        out[4 * i + 0] = q.x;
        out[4 * i + 1] = q.y;
        out[4 * i + 2] = q.z;
        out[4 * i + 3] = q.w;
    }
}

__device__ __forceinline__ void load16_x(const bf16* p, float* out) { load16_bf16(p, out); }
__device__ __forceinline__ void load16_x(const float* p, float* out) { load16_f32_cg(p, out); }
__device__ __forceinline__ float load1_x(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load1_x(const float* p) { return __ldcg(p); }

// ---- Weight formats. Each has load16(row, k, out) for k % 16 == 0 (and K % 16 == 0),
// get(row, k) for any element, and `global` (a multiplier applied to the finished sum).

struct Bf16Weight {
    const bf16* w;
    int K;
    float global;
    __device__ __forceinline__ void load16(int row, int k, float* out) const {
        load16_bf16(w + (size_t)row * K + k, out);
    }
    __device__ __forceinline__ float get(int row, int k) const {
        return __bfloat162float(w[(size_t)row * K + k]);
    }
};

// fp8-block128: E4M3 codes [N, K], f32 multipliers [ceil(N/128), ceil(K/128)].
struct Fp8Block128Weight {
    const unsigned char* q;
    const float* scales;
    int K;
    int scale_cols;
    float global;
    __device__ __forceinline__ float scale(int row, int k) const {
        return __ldg(scales + (size_t)(row >> 7) * scale_cols + (k >> 7));
    }
    __device__ __forceinline__ void load16(int row, int k, float* out) const {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(q + (size_t)row * K + k));
        float s = scale(row, k);
        unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                out[4 * i + j] = e4m3_to_f32((words[i] >> (8 * j)) & 0xFFu) * s;
            }
        }
    }
    __device__ __forceinline__ float get(int row, int k) const {
        return e4m3_to_f32(q[(size_t)row * K + k]) * scale(row, k);
    }
};

// NVFP4 (ModelOpt): packed E2M1 [N, K/2] (even element in the low nibble), E4M3 block
// scales [N, K/16]; `global` is weight_scale_2.
struct Nvfp4Weight {
    const unsigned char* q;
    const unsigned char* scales;
    int K;
    float global;
    __device__ __forceinline__ float scale(int row, int k) const {
        return e4m3_to_f32(__ldg(scales + (size_t)row * (K >> 4) + (k >> 4)));
    }
    __device__ __forceinline__ void load16(int row, int k, float* out) const {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(q + (size_t)row * (K >> 1) + (k >> 1)));
        float s = scale(row, k);
        unsigned int words[2] = {v.x, v.y};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                out[8 * i + j] = e2m1_to_f32((words[i] >> (4 * j)) & 0xFu) * s;
            }
        }
    }
    __device__ __forceinline__ float get(int row, int k) const {
        unsigned int byte = q[(size_t)row * (K >> 1) + (k >> 1)];
        return e2m1_to_f32((k & 1) ? (byte >> 4) : (byte & 0xFu)) * scale(row, k);
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    }
    return v;
}
