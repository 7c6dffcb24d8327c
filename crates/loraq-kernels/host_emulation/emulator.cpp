// Runs one fused decode kernel of kernels/lora_decode.cu on the CPU (see
// cuda_host_stub.h): blocks one after another in grid order (shrink blocks first, so the
// base blocks' wait for the release counter always ends), each as 128 OS threads with
// real barriers for __syncthreads / __syncwarp and warp-collective shuffles and mma.
//
//   emulator INPUT OUTPUT
//
// INPUT (little-endian, written by the loraq-kernels host_emulation tests): the kernel's
// name (u32 length + bytes); i32 batch, N, K, rank, shrink_blocks, base_blocks,
// slice_chunks, target, part_floats; f32 w_global, t_scale; then five u64-length-prefixed
// byte arrays: codes, scales, x (bf16), lora_a (bf16), lora_b (bf16). OUTPUT: y, bf16
// [batch, N].
#include "cuda_host_stub.h"

#include "lora_decode.cu"

#include <barrier>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

thread_local dim3_emu threadIdx;
thread_local dim3_emu blockIdx;
dim3_emu blockDim;
dim3_emu gridDim;

namespace {
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
std::unique_ptr<std::barrier<>> block_barrier;
std::unique_ptr<std::barrier<>> warp_barrier[kWarps];
float shuffle_slots[kThreads];
unsigned int mma_a[kWarps][32][4];
unsigned int mma_b[kWarps][32][2];

float bf16_half(unsigned int word, int half) {
    return __uint_as_float(half ? (word & 0xFFFF0000u) : (word << 16));
}
}  // namespace

void __syncthreads() { block_barrier->arrive_and_wait(); }
void __syncwarp(unsigned int) { warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }

float __shfl_xor_sync(unsigned int, float v, int lane_mask) {
    const int t = threadIdx.x;
    shuffle_slots[t] = v;
    __syncwarp();
    const float other = shuffle_slots[(t & ~31) | ((t & 31) ^ lane_mask)];
    __syncwarp();
    return other;
}

// mma.m16n8k16 row.col bf16 -> f32 from the 32 lanes' fragments, laid out as the PTX
// ISA's "Matrix Fragments for mma.m16n8k16" (g = lane / 4, q = lane % 4): A register
// i of lane (g, q) holds row g (i = 0, 2) or g + 8 (i = 1, 3), columns 2q, 2q + 1 (+ 8
// for i >= 2); B register i holds rows (k) 2q, 2q + 1 (+ 8 for i = 1) of column g; C
// element e is row g (e < 2) or g + 8, column 2q + (e & 1).
void emu_mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) mma_a[warp][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) mma_b[warp][lane][i] = b[i];
    __syncwarp();
    const int g = lane / 4, q = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) {
            const int a_lane = (row % 8) * 4 + (k % 8) / 2;
            const int a_reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
            const int b_lane = col * 4 + (k % 8) / 2;
            const int b_reg = k >= 8 ? 1 : 0;
            sum += (double)bf16_half(mma_a[warp][a_lane][a_reg], k & 1) *
                   (double)bf16_half(mma_b[warp][b_lane][b_reg], k & 1);
        }
        c[e] += (float)sum;
    }
    __syncwarp();
}

typedef void (*FusedKernel)(const bf16*, int, int, int, const void*, const void*, float, const bf16*,
                            const bf16*, int, float, float*, unsigned int*, unsigned int, int, int, float*,
                            unsigned int*, bf16*);

#define ENTRY(name) {#name, name}
static const std::map<std::string, FusedKernel> kKernels = {
    ENTRY(bf16_fused_b1),           ENTRY(bf16_fused_b4),           ENTRY(bf16_fused_b16),
    ENTRY(fp8b128_fused_b1),        ENTRY(fp8b128_fused_b4),        ENTRY(fp8b128_fused_b16),
    ENTRY(nvfp4_fused_b1),          ENTRY(nvfp4_fused_b4),          ENTRY(nvfp4_fused_b16),
    ENTRY(bf16_tcdec_fused_b8),     ENTRY(bf16_tcdec_fused_b16),    ENTRY(fp8b128_tcdec_fused_b8),
    ENTRY(fp8b128_tcdec_fused_b16), ENTRY(nvfp4_tcdec_fused_b8),    ENTRY(nvfp4_tcdec_fused_b16),
};

namespace {
struct Reader {
    std::ifstream in;
    template <class T>
    T get() {
        T v;
        in.read(reinterpret_cast<char*>(&v), sizeof(T));
        if (!in) {
            std::fprintf(stderr, "emulator: input truncated\n");
            std::exit(2);
        }
        return v;
    }
    std::vector<unsigned char> bytes() {
        const auto len = get<unsigned long long>();
        // At least 16 bytes, so an empty operand is still a valid (never read) pointer.
        std::vector<unsigned char> v(std::max<unsigned long long>(len, 16));
        in.read(reinterpret_cast<char*>(v.data()), (std::streamsize)len);
        if (!in) {
            std::fprintf(stderr, "emulator: input truncated\n");
            std::exit(2);
        }
        return v;
    }
};
}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: emulator INPUT OUTPUT\n");
        return 2;
    }
    Reader r{std::ifstream(argv[1], std::ios::binary)};
    const auto name_len = r.get<unsigned int>();
    std::string name(name_len, '\0');
    r.in.read(name.data(), name_len);
    const auto kernel = kKernels.find(name);
    if (kernel == kKernels.end()) {
        std::fprintf(stderr, "emulator: no kernel %s\n", name.c_str());
        return 2;
    }
    const int batch = r.get<int>(), n = r.get<int>(), k = r.get<int>(), rank = r.get<int>();
    const int shrink_blocks = r.get<int>(), base_blocks = r.get<int>(), slice_chunks = r.get<int>();
    const unsigned int target = (unsigned int)r.get<int>();
    const int part_floats = r.get<int>();
    const float w_global = r.get<float>(), t_scale = r.get<float>();
    auto codes = r.bytes(), scales = r.bytes(), x = r.bytes(), lora_a = r.bytes(), lora_b = r.bytes();

    std::vector<float> t((size_t)std::max(1, batch * rank), 0.0f);
    std::vector<float> part((size_t)std::max(16, part_floats), 0.0f);
    std::vector<unsigned int> tickets(64, 0);
    unsigned int counter = 0;
    std::vector<bf16> y((size_t)batch * n, __float2bfloat16_rn(NAN));

    const int grid = shrink_blocks + base_blocks;
    gridDim = {(unsigned int)grid, 1, 1};
    blockDim = {kThreads, 1, 1};
    for (int block = 0; block < grid; ++block) {
        block_barrier = std::make_unique<std::barrier<>>(kThreads);
        for (auto& w : warp_barrier) w = std::make_unique<std::barrier<>>(32);
        std::vector<std::thread> threads;
        threads.reserve(kThreads);
        for (int thread = 0; thread < kThreads; ++thread) {
            threads.emplace_back([&, block, thread] {
                threadIdx = {(unsigned int)thread, 0, 0};
                blockIdx = {(unsigned int)block, 0, 0};
                kernel->second(reinterpret_cast<const bf16*>(x.data()), batch, n, k, codes.data(), scales.data(),
                               w_global, reinterpret_cast<const bf16*>(lora_a.data()),
                               reinterpret_cast<const bf16*>(lora_b.data()), rank, t_scale, t.data(), &counter,
                               target, shrink_blocks, slice_chunks, part.data(), tickets.data(), y.data());
            });
        }
        for (auto& th : threads) th.join();
    }
    for (unsigned int ticket : tickets) {
        if (ticket != 0) {
            std::fprintf(stderr, "emulator: a shrink ticket was left at %u\n", ticket);
            return 3;
        }
    }
    if (counter != target) {
        std::fprintf(stderr, "emulator: release counter %u, expected %u\n", counter, target);
        return 3;
    }
    std::ofstream out(argv[2], std::ios::binary);
    out.write(reinterpret_cast<const char*>(y.data()), (std::streamsize)(y.size() * sizeof(bf16)));
    return out ? 0 : 2;
}
