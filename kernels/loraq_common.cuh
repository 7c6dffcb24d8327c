// Shared device code of the loraq kernels: weight formats decoded in registers.
// Layouts are those of docs/quantization.md ("Checkpoint layouts"); rows are output features,
// columns input features, row-major.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;

// ---- Launch arguments: each kernel takes one of these structs by value as its only
// parameter. Each has a Rust twin of the same name and fields in
// crates/loraq-kernels/src/kernel_args.rs (pointers first, then 4-byte scalars), whose
// layout the NVRTC compile test asserts against these definitions.

// {format}_fused_b{NB} and {format}_tcdec_fused_b{NB} (lora_decode.cu); the CUDA-core
// kernel ignores slice_chunks, part and tickets.
struct FusedDecodeArgs {
    const bf16* x;
    const void* w_codes;
    const void* w_scales;
    const bf16* lora_a;
    const bf16* lora_b;
    float* t;
    unsigned int* counter;
    float* part;
    unsigned int* tickets;
    bf16* y;
    int batch;
    int out_features;
    int in_features;
    int rank;
    float w_global;
    float t_scale;
    unsigned int target;
    int shrink_blocks;
    int slice_chunks;
};

// {format}_base_b{NB} (lora_decode.cu).
struct BaseDecodeArgs {
    const bf16* x;
    const void* w_codes;
    const void* w_scales;
    bf16* y;
    int batch;
    int out_features;
    int in_features;
    float w_global;
};

// lora_shrink_b{NB} (lora_decode.cu) and lora_tc_shrink (lora_prefill.cu).
struct LoraShrinkArgs {
    const bf16* x;
    const bf16* lora_a;
    float* t;
    int batch;
    int in_features;
    int rank;
    float t_scale;
};

// lora_expand_b{NB} (lora_decode.cu).
struct LoraExpandArgs {
    const float* t;
    const bf16* lora_b;
    bf16* y;
    int batch;
    int out_features;
    int rank;
};

// {format}_tc_gemm (lora_prefill.cu).
struct TcGemmArgs {
    const bf16* x;
    const void* w_codes;
    const void* w_scales;
    const float* t;
    const bf16* lora_b;
    bf16* y;
    int batch;
    int in_features;
    int out_features;
    int rank;
    int accumulate;
    float w_global;
};

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

// ---- Decode-side chunk decoders: 16 consecutive weights of one row (k % 16 == 0) as
// raw bits (one load), then f32 values WITHOUT the chunk's scale, which the caller
// applies once to the chunk's dot product (16 weights share one scale in every format).

// Two E4M3 codes -> two f32 through the hardware conversion (cvt.rn.f16x2.e4m3x2 on
// sm_89+: exact, every E4M3 value is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned int pair) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// E2M1 codes n_j and n_{j+4} of one 32-bit word (8 codes, code i in bits 4i..4i+3) -> two
// f32 equal to 2^-14 times their values. Shifted left by 4 (3 - j), the two codes sit at
// the top of the word's 16-bit halves, signs already on f16's sign bits; the exponent and
// mantissa bits then go under f16's with one more shift (subnormal E2M1 0.5 lands on the
// f16 subnormal 2^-15, exactly), so a pair costs two shifts and two LOP3s (each mask is
// one immediate), and no multiply: the caller folds 2^14 into the block scale. Pairing
// j with j + 4 (not 2j with 2j + 1) is what lets both halves share one shift.
template <int J>
__device__ __forceinline__ float2 e2m1_pair_to_float2_scaled(unsigned int word) {
    const unsigned int top = word << (4 * (3 - J));
    const unsigned int bits = (top & 0x80008000u) | ((top >> 3) & 0x0E000E00u);
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

struct Fp8Chunk {
    typedef uint4 Raw;
    static __device__ __forceinline__ Raw zero() { return make_uint4(0, 0, 0, 0); }
    static __device__ __forceinline__ void decode(const Raw& v, float* out) {
        const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 lo = e4m3x2_to_float2(words[i]);
            float2 hi = e4m3x2_to_float2(words[i] >> 16);
            out[4 * i + 0] = lo.x;
            out[4 * i + 1] = lo.y;
            out[4 * i + 2] = hi.x;
            out[4 * i + 3] = hi.y;
        }
    }
};

struct Nvfp4Chunk {
    typedef uint2 Raw;
    static __device__ __forceinline__ Raw zero() { return make_uint2(0, 0); }
    static __device__ __forceinline__ void decode(const Raw& v, float* out) {
        decode_word(v.x, out);
        decode_word(v.y, out + 8);
    }
    static __device__ __forceinline__ void decode_word(unsigned int word, float* out) {
        decode_pair<0>(word, out);
        decode_pair<1>(word, out);
        decode_pair<2>(word, out);
        decode_pair<3>(word, out);
    }
    template <int J>
    static __device__ __forceinline__ void decode_pair(unsigned int word, float* out) {
        const float2 pair = e2m1_pair_to_float2_scaled<J>(word);
        out[J] = pair.x;
        out[J + 4] = pair.y;
    }
};

struct Bf16Chunk {
    struct Raw {
        uint4 a, b;
    };
    static __device__ __forceinline__ Raw zero() { return Raw{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}; }
    static __device__ __forceinline__ void decode(const Raw& v, float* out) {
        unpack_bf16x2(v.a.x, out + 0);
        unpack_bf16x2(v.a.y, out + 2);
        unpack_bf16x2(v.a.z, out + 4);
        unpack_bf16x2(v.a.w, out + 6);
        unpack_bf16x2(v.b.x, out + 8);
        unpack_bf16x2(v.b.y, out + 10);
        unpack_bf16x2(v.b.z, out + 12);
        unpack_bf16x2(v.b.w, out + 14);
    }
};

// ---- Weight formats. Each has load16(row, k, out) for k % 16 == 0 (and K % 16 == 0),
// get(row, k) for any element, and `global` (a multiplier applied to the finished sum).

// ---- Asynchronous copies (sm_80+): global -> shared without passing through registers,
// so a lane can keep several chunks in flight while it computes on earlier ones.
#ifndef LORAQ_HOST_EMULATION
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#else
// Host emulation (crates/loraq-kernels/host_emulation): the copy completes at once.
inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async8(void* dst, const void* src) { std::memcpy(dst, src, 8); }
inline void cp_async4(void* dst, const void* src) { std::memcpy(dst, src, 4); }
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
#endif

// ---- Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization may start while the previous kernel on its stream still runs: it must
// call griddep_wait() before it reads anything that kernel writes (x) or writes anything
// that kernel reads (t, y, the counter); read-only weights may be fetched before. Without
// that launch attribute both are no-ops. griddep_launch_dependents() lets the next
// programmatic launch be scheduled once every block of this grid has called it (its
// blocks then take the SM slots this grid's blocks free as they finish).
#ifndef LORAQ_HOST_EMULATION
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
#else
// Host emulation runs launches one after another.
inline void griddep_wait() {}
inline void griddep_launch_dependents() {}
#endif

// ---- The decode stream's per-lane shared-memory ring (lora_decode.cu). Each format has
// PIECES (pieces of 16 weights, each with its own scale, per lane and step), Slot (one
// lane's step as it is consumed, in registers), piece(slot, p), slot_scale(slot, row,
// k), and Ring<N>: N slots in shared memory with issue(w, i, row, k) (cp.async of the
// step at weights [k, k + 16 * PIECES) of `row`, k < K), clear(i) and load(i).

// A ring of whole slots, for formats whose slot is only the weights' bytes.
template <class W, int N>
struct SlotRing {
    typename W::Slot slots[N];
    __device__ __forceinline__ void issue(const W& w, int i, int row, int k) { w.issue(&slots[i], row, k); }
    __device__ __forceinline__ void clear(int i) { W::clear(&slots[i]); }
    __device__ __forceinline__ typename W::Slot load(int i) const { return slots[i]; }
};

struct Bf16Weight {
    typedef Bf16Chunk Chunk;
    static constexpr int PIECES = 1;
    struct __align__(16) Slot {
        Bf16Chunk::Raw raw;
    };
    template <int N>
    using Ring = SlotRing<Bf16Weight, N>;
    static __device__ __forceinline__ Bf16Chunk::Raw piece(const Slot& slot, int) { return slot.raw; }
    __device__ __forceinline__ void issue(Slot* dst, int row, int k) const {
        const bf16* src = w + (size_t)row * K + k;
        cp_async16(&dst->raw.a, src);
        cp_async16(&dst->raw.b, src + 8);
    }
    static __device__ __forceinline__ void clear(Slot* dst) { dst->raw = Bf16Chunk::zero(); }
    __device__ __forceinline__ float slot_scale(const Slot&, int, int) const { return 1.0f; }
    const bf16* w;
    int K;
    float global;
    __device__ __forceinline__ Bf16Chunk::Raw raw16(int row, int k) const {
        const uint4* v = reinterpret_cast<const uint4*>(w + (size_t)row * K + k);
        return Bf16Chunk::Raw{__ldg(v), __ldg(v + 1)};
    }
    __device__ __forceinline__ float chunk_scale(int, int) const { return 1.0f; }
    __device__ __forceinline__ void load16(int row, int k, float* out) const {
        load16_bf16(w + (size_t)row * K + k, out);
    }
    __device__ __forceinline__ float get(int row, int k) const {
        return __bfloat162float(w[(size_t)row * K + k]);
    }
};

// Pieces per lane step of the fp8 decode stream: 1 (16 bytes; the default, the step of
// docs/gpu-check.md's figures) or 2 (32 bytes: half the loop, ring and address
// instructions per weight, a 3-stage ring), a variant scripts/gpu-check.sh times.
#ifndef LORAQ_FP8_PIECES
#define LORAQ_FP8_PIECES 1
#endif

// fp8-block128: E4M3 codes [N, K], f32 multipliers [ceil(N/128), ceil(K/128)].
struct Fp8Block128Weight {
    typedef Fp8Chunk Chunk;
    static constexpr int PIECES = LORAQ_FP8_PIECES;
    struct __align__(16) Slot {
        uint4 raw[PIECES];
    };
    template <int N>
    using Ring = SlotRing<Fp8Block128Weight, N>;
    static __device__ __forceinline__ uint4 piece(const Slot& slot, int p) { return slot.raw[p]; }
    // Rows start 16-byte aligned (K % 16 == 0 on the GPU); a piece at or past K is not
    // copied, and never consumed.
    __device__ __forceinline__ void issue(Slot* dst, int row, int k) const {
        const unsigned char* src = q + (size_t)row * K + k;
        cp_async16(&dst->raw[0], src);
#pragma unroll
        for (int p = 1; p < PIECES; ++p)
            if (k + 16 * p < K) cp_async16(&dst->raw[p], src + 16 * p);
    }
    static __device__ __forceinline__ void clear(Slot* dst) {
#pragma unroll
        for (int p = 0; p < PIECES; ++p) dst->raw[p] = make_uint4(0, 0, 0, 0);
    }
    // The 128x128 tile multipliers are few and stay in L1. A step (16 * PIECES inputs,
    // which divides 128) never crosses a tile, so every piece reads the step's first
    // input's multiplier: one load per row and step.
    __device__ __forceinline__ float slot_scale(const Slot&, int row, int k) const {
        return scale(row, k & ~(16 * PIECES - 1));
    }
    const unsigned char* q;
    const float* scales;
    int K;
    int scale_cols;
    float global;
    __device__ __forceinline__ uint4 raw16(int row, int k) const {
        return __ldg(reinterpret_cast<const uint4*>(q + (size_t)row * K + k));
    }
    __device__ __forceinline__ float chunk_scale(int row, int k) const { return scale(row, k); }
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

// Pieces per lane step of the NVFP4 decode stream: 2 (32 weights, 16 bytes of codes; the
// default) or 1 (8 bytes, the step of docs/gpu-check.md's figures), a variant
// scripts/gpu-check.sh times.
#ifndef LORAQ_NVFP4_PIECES
#define LORAQ_NVFP4_PIECES 2
#endif

// One lane step's NVFP4 codes: 8 bytes (one piece) or 16 (two).
template <int P>
struct Nvfp4Codes;
template <>
struct Nvfp4Codes<1> {
    typedef uint2 Type;
    static __device__ __forceinline__ uint2 piece(const uint2& codes, int) { return codes; }
};
template <>
struct Nvfp4Codes<2> {
    typedef uint4 Type;
    static __device__ __forceinline__ uint2 piece(const uint4& codes, int p) {
        return p == 0 ? make_uint2(codes.x, codes.y) : make_uint2(codes.z, codes.w);
    }
};

// NVFP4 (ModelOpt): packed E2M1 [N, K/2] (even element in the low nibble), E4M3 block
// scales [N, K/16]; `global` is weight_scale_2.
struct Nvfp4Weight {
    typedef Nvfp4Chunk Chunk;
    // A lane takes 32 weights of a row per step (two 16-weight pieces, 16 bytes of codes):
    // with 16 weights (8 bytes) per step, a lane spent as many instructions on the ring,
    // its addresses and the loop per weight as on the decode itself, and its ring held
    // half of fp8's bytes in flight. The block scales stream from HBM like the codes (1
    // byte per 16 weights), so they travel through the ring too: each lane copies the
    // aligned 4-byte word holding its scales (possible when a row's scales start 4-byte
    // aligned, K % 64 == 0; else each piece's scale is read when it is consumed).
    static constexpr int PIECES = LORAQ_NVFP4_PIECES;
    typedef Nvfp4Codes<PIECES>::Type Codes;
    struct Slot {
        Codes raw;
        unsigned int scale_word;
    };
    static __device__ __forceinline__ uint2 piece(const Slot& slot, int p) { return Nvfp4Codes<PIECES>::piece(slot.raw, p); }
    __device__ __forceinline__ bool scale_words_aligned() const { return ((K >> 4) & 3) == 0; }
    // Codes and scale words in two arrays: 20 bytes of shared memory per slot rather than
    // a 16-byte-aligned struct's 32, which at six blocks per SM leaves L1 room for x.
    template <int N>
    struct Ring {
        Codes codes[N];
        unsigned int scale_words[N];
        // Where K % 32 == 16 the last lane's second piece lies past the row: it is not
        // copied, and never consumed.
        __device__ __forceinline__ void issue(const Nvfp4Weight& w, int i, int row, int k) {
            const int K = w.K;
            const unsigned char* src = w.q + (size_t)row * (K >> 1) + (k >> 1);
            if (PIECES == 1) {
                cp_async8(&codes[i], src);
            } else if ((K & 31) == 0) {
                cp_async16(&codes[i], src);
            } else {
                // Rows start 8-byte aligned only.
                unsigned int* words = reinterpret_cast<unsigned int*>(&codes[i]);
                cp_async8(words, src);
                if (k + 16 < K) cp_async8(words + 2, src + 8);
            }
            if (w.scale_words_aligned()) {
                // Every piece of the step has its scale in this word (k % (16 * PIECES)
                // == 0, and 16 * PIECES divides 64).
                const size_t index = (size_t)row * (K >> 4) + (k >> 4);
                cp_async4(&scale_words[i], w.scales + (index & ~(size_t)3));
            }
        }
        __device__ __forceinline__ void clear(int i) {
            codes[i] = Codes{};
            scale_words[i] = 0;
        }
        __device__ __forceinline__ Slot load(int i) const { return Slot{codes[i], scale_words[i]}; }
    };
    // The scale of the piece starting at k (k % 16 == 0) of a slot issued for this row.
    __device__ __forceinline__ float slot_scale(const Slot& slot, int row, int k) const {
        if (scale_words_aligned()) {
            const unsigned int byte = (slot.scale_word >> (8 * ((k >> 4) & 3))) & 0xFFu;
            return e4m3_to_f32(byte) * 0x1p14f;
        }
        return chunk_scale(row, k);
    }
    const unsigned char* q;
    const unsigned char* scales;
    int K;
    float global;
    __device__ __forceinline__ uint2 raw16(int row, int k) const {
        return __ldg(reinterpret_cast<const uint2*>(q + (size_t)row * (K >> 1) + (k >> 1)));
    }
    // Times 2^14: Nvfp4Chunk decodes to 2^-14 of the E2M1 values.
    __device__ __forceinline__ float chunk_scale(int row, int k) const { return scale(row, k) * 0x1p14f; }
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


// ---- Tensor cores (sm_80+): C[16x8] += A[16x16] B[16x8], bf16 in, f32 accumulate.
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
// g = lane / 4, q = lane % 4; A regs = {row g, row g+8, row g, row g+8} x k pairs {2q,
// 2q, 2q+8, 2q+8} (+0, +1 in each register, the lower k in the low half); B regs = k
// pairs {2q, 2q+8} x column g; C = rows {g, g, g+8, g+8} x columns {2q, 2q+1, 2q, 2q+1}.
#ifdef LORAQ_HOST_EMULATION
inline void mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) { emu_mma_bf16_16816(c, a, b); }
#else
__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
