// Runs kernels of kernels/lora_decode.cu and kernels/lora_prefill.cu on the CPU (see
// cuda_host_stub.h): a sequence of launches over shared buffers, as the launcher queues
// them on one stream. A launch runs its blocks one after another in grid order (shrink
// blocks first, so a fused decode's base blocks find the release counter set), each as
// 128 OS threads with real barriers for __syncthreads / __syncwarp and warp-collective
// shuffles and mma.
//
//   emulator INPUT OUTPUT
//
// INPUT (little-endian, written by the loraq-kernels host_emulation tests):
//   u32 buffer count, then per buffer: u64 byte length + the bytes (its initial content)
//   u32 launch count, then per launch: u32 name length + name, u32 grid x, u32 grid y,
//       u32 byte length + the bytes of the kernel's argument struct (kernel_args.rs;
//       pointer fields hold u64 buffer indices), u32 count of pointer fields + each one's
//       u32 byte offset (replaced by the buffer's host address before the launch)
//   u32 index of the buffer written to OUTPUT
//   u32 count of (u32 buffer index, u32 expected first word) checks made after the last
//       launch (the release counter reached its target, the shrink tickets are back at 0)
#include "cuda_host_stub.h"

#include "lora_decode.cu"
#include "lora_prefill.cu"

#include <barrier>
#include <fstream>
#include <functional>
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

namespace {
// A launch's argument struct, its pointer fields already relocated to host buffers.
typedef std::vector<unsigned char> ArgBytes;

// A kernel: the size of its argument struct, and a call with that struct copied out of a
// launch's bytes.
struct Kernel {
    size_t args_size;
    std::function<void(const ArgBytes&)> call;
};

template <class T>
Kernel by_value(void (*kernel)(T)) {
    return Kernel{sizeof(T), [kernel](const ArgBytes& bytes) {
                      T args;
                      std::memcpy(&args, bytes.data(), sizeof(T));
                      kernel(args);
                  }};
}

#define K(name) {#name, by_value(name)}
#define FORMATS(suffix) K(bf16_##suffix), K(fp8b128_##suffix), K(nvfp4_##suffix)
const std::map<std::string, Kernel> kKernels = {
    FORMATS(fused_b1),       FORMATS(fused_b4),        FORMATS(fused_b16),     FORMATS(tcdec_fused_b8),
    FORMATS(tcdec_fused_b16), FORMATS(base_b1),         FORMATS(base_b4),       FORMATS(base_b16),
    FORMATS(tc_gemm),        K(lora_shrink_b1),        K(lora_shrink_b4),      K(lora_shrink_b16),
    K(lora_expand_b1),       K(lora_expand_b4),        K(lora_expand_b16),     K(lora_tc_shrink),
};

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
    std::string string() {
        std::string s(get<unsigned int>(), '\0');
        in.read(s.data(), (std::streamsize)s.size());
        return s;
    }
};

// 128 threads kept for the whole run; each block is one round: the main thread
// publishes it, all threads run it, and the round's end barrier hands back.
class BlockRunner {
   public:
    BlockRunner() : start_(kThreads + 1), end_(kThreads + 1) {
        block_barrier = std::make_unique<std::barrier<>>(kThreads);
        for (auto& w : warp_barrier) w = std::make_unique<std::barrier<>>(32);
        for (int thread = 0; thread < kThreads; ++thread) {
            threads_.emplace_back([this, thread] {
                threadIdx = {(unsigned int)thread, 0, 0};
                for (;;) {
                    start_.arrive_and_wait();
                    if (!kernel_) return;
                    blockIdx = block_;
                    (*kernel_)(*args_);
                    end_.arrive_and_wait();
                }
            });
        }
    }
    ~BlockRunner() {
        kernel_ = nullptr;
        start_.arrive_and_wait();
        for (auto& th : threads_) th.join();
    }
    void run(const std::function<void(const ArgBytes&)>& kernel, const ArgBytes& args, unsigned int bx,
             unsigned int by) {
        kernel_ = &kernel;
        args_ = &args;
        block_ = {bx, by, 0};
        start_.arrive_and_wait();
        end_.arrive_and_wait();
    }

   private:
    std::barrier<> start_, end_;
    std::vector<std::thread> threads_;
    const std::function<void(const ArgBytes&)>* kernel_ = nullptr;
    const ArgBytes* args_ = nullptr;
    dim3_emu block_{};
};
}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: emulator INPUT OUTPUT\n");
        return 2;
    }
    Reader r{std::ifstream(argv[1], std::ios::binary)};
    // Buffers 16-byte aligned (vector loads), at least 64 bytes, so an empty operand is
    // still a valid (never read) pointer.
    std::vector<std::vector<uint4>> buffers(r.get<unsigned int>());
    std::vector<unsigned long long> sizes;
    for (auto& b : buffers) {
        const auto len = r.get<unsigned long long>();
        sizes.push_back(len);
        b.assign(std::max<unsigned long long>((len + 15) / 16, 4), make_uint4(0, 0, 0, 0));
        r.in.read(reinterpret_cast<char*>(b.data()), (std::streamsize)len);
    }
    BlockRunner runner;
    const unsigned int launches = r.get<unsigned int>();
    for (unsigned int l = 0; l < launches; ++l) {
        const std::string name = r.string();
        const auto kernel = kKernels.find(name);
        if (kernel == kKernels.end()) {
            std::fprintf(stderr, "emulator: no kernel %s\n", name.c_str());
            return 2;
        }
        const unsigned int gx = r.get<unsigned int>(), gy = r.get<unsigned int>();
        ArgBytes args(r.get<unsigned int>());
        r.in.read(reinterpret_cast<char*>(args.data()), (std::streamsize)args.size());
        const unsigned int pointers = r.get<unsigned int>();
        for (unsigned int p = 0; p < pointers; ++p) {
            const unsigned int offset = r.get<unsigned int>();
            unsigned long long index;
            if ((unsigned long long)offset + sizeof(index) > args.size()) {
                std::fprintf(stderr, "emulator: %s: pointer offset %u outside its arguments\n", name.c_str(), offset);
                return 2;
            }
            std::memcpy(&index, args.data() + offset, sizeof(index));
            void* host = buffers.at(index).data();
            std::memcpy(args.data() + offset, &host, sizeof(host));
        }
        if (args.size() != kernel->second.args_size) {
            std::fprintf(stderr, "emulator: %s: %zu bytes of arguments, its struct has %zu\n", name.c_str(),
                         args.size(), kernel->second.args_size);
            return 2;
        }
        gridDim = {gx, gy, 1};
        blockDim = {kThreads, 1, 1};
        for (unsigned int by = 0; by < gy; ++by)
            for (unsigned int bx = 0; bx < gx; ++bx) runner.run(kernel->second.call, args, bx, by);
    }
    const unsigned int output = r.get<unsigned int>();
    const unsigned int checks = r.get<unsigned int>();
    for (unsigned int c = 0; c < checks; ++c) {
        const unsigned int buffer = r.get<unsigned int>(), expected = r.get<unsigned int>();
        const unsigned int* words = reinterpret_cast<const unsigned int*>(buffers.at(buffer).data());
        for (unsigned long long i = 0; i < std::max<unsigned long long>(sizes[buffer] / 4, 1); ++i) {
            if (words[i] != (i == 0 ? expected : 0u)) {
                std::fprintf(stderr, "emulator: buffer %u word %llu is %u after the launches\n", buffer, i, words[i]);
                return 3;
            }
        }
    }
    std::ofstream out(argv[2], std::ios::binary);
    out.write(reinterpret_cast<const char*>(buffers.at(output).data()), (std::streamsize)sizes[output]);
    return out ? 0 : 2;
}
