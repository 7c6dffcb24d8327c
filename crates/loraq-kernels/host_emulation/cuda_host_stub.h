// Host emulation of the CUDA device code in kernels/*.cu: just enough of the CUDA
// language and runtime headers (cuda_bf16.h, cuda_fp16.h, cuda_fp8.h all lead here) for
// g++ to compile the kernels as ordinary C++, so that `emulator.cpp` can run them on the
// CPU with one OS thread per CUDA thread. What it checks is the kernels' logic (indices,
// bounds, tiling, the shrink's slices and tickets, the fragment maps), not the memory
// model, timing or the PTX the real compiler emits. Used by the `host_emulation` tests
// of loraq-kernels (src/launch_plan.rs); never part of a build.
#pragma once
#define LORAQ_HOST_EMULATION 1

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Shared memory: one static per function (template instance); blocks run one at a time.
#define __shared__ static

struct dim3_emu {
    unsigned int x, y, z;
};
extern thread_local dim3_emu threadIdx;
extern thread_local dim3_emu blockIdx;
extern dim3_emu blockDim;
extern dim3_emu gridDim;

// Collectives, implemented by emulator.cpp.
void __syncthreads();
void __syncwarp(unsigned int mask = 0xFFFFFFFFu);
float __shfl_xor_sync(unsigned int mask, float v, int lane_mask);
void emu_mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b);

struct float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}

template <class T>
inline T __ldg(const T* p) {
    return *p;
}
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
template <class T>
inline T __ldca(const T* p) {
    return *p;
}

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline int min(int a, int b) { return a < b ? a : b; }

inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return std::atomic_ref<unsigned int>(*p).fetch_add(v);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// Nanoseconds: the kernels' bounded waits (2^34 "cycles") then give up after 17 s.
inline long long clock64() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
inline void __nanosleep(unsigned int) { std::this_thread::yield(); }
[[noreturn]] inline void __trap() {
    std::fprintf(stderr, "emulator: __trap() in block %u thread %u\n", blockIdx.x, threadIdx.x);
    std::abort();
}

// ---- bf16 (round to nearest even, NaN kept quiet).
struct __nv_bfloat16 {
    unsigned short bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline unsigned short emu_f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{emu_f32_to_bf16_bits(f)}; }
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float((unsigned int)v.bits << 16); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }

// ---- f16 (only what the decoders need: f16 -> f32, and exact E4M3 -> f16).
struct __half {
    unsigned short bits;
};
struct __half2 {
    __half x, y;
};
struct __half2_raw {
    unsigned short x, y;
};
inline float emu_f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const int exp = (h >> 10) & 0x1F;
    const unsigned int mant = h & 0x3FFu;
    float v;
    if (exp == 0) {
        v = std::ldexp((float)mant, -24);
    } else if (exp == 31) {
        v = mant ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(mant | 0x400u), exp - 25);
    }
    return sign ? -v : v;
}
inline float2 __half22float2(__half2 v) { return float2{emu_f16_to_f32(v.x.bits), emu_f16_to_f32(v.y.bits)}; }

// ---- FP8 E4M3 -> f16 (every E4M3 value is an f16 value, so the conversion is exact).
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline unsigned short emu_e4m3_to_f16_bits(unsigned int code) {
    const unsigned short sign = (unsigned short)((code & 0x80u) << 8);
    const unsigned int exp = (code >> 3) & 0xFu;
    const unsigned int mant = code & 7u;
    if (exp == 0xF && mant == 7) return sign | 0x7E00u;  // NaN
    if (exp == 0 && mant == 0) return sign;
    if (exp == 0) {
        // m * 2^-9: normalize into f16 (exponent bias 15).
        int e = -6;
        unsigned int m = mant;
        while (!(m & 8u)) {
            m <<= 1;
            --e;
        }
        return sign | (unsigned short)((e + 15) << 10) | (unsigned short)((m & 7u) << 7);
    }
    return sign | (unsigned short)((exp - 7 + 15) << 10) | (unsigned short)(mant << 7);
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t pair, __nv_fp8_interpretation_t) {
    return __half2_raw{emu_e4m3_to_f16_bits(pair & 0xFFu), emu_e4m3_to_f16_bits(pair >> 8)};
}
