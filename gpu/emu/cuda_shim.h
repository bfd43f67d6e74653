// The subset of CUDA that gpu/src/kernels.cu uses, emulated on the CPU so that every kernel runs
// in the test suite on machines without a GPU (gpu/tests/emulated_kernels.rs): a block's threads
// are fibers (ucontext) taking turns on the launching OS thread, __syncthreads() is a barrier
// over them, a warp shuffle is a barrier over the warp's lanes around a shared exchange slot, and
// __shared__ variables are function statics. One OS thread per launch, however wide the block:
// the emulation never oversubscribes the machine's cores (OS threads per block thread, meeting
// at spinning barriers, drove the load average past 600 in the test suite).
// It checks indexing, barriers, shuffles and numerics; not timing, memory coalescing or the
// compiler's floating-point contractions (the GPU run compares against the CPU oracle for those).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
#undef INFINITY

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

// The threads of one block as fibers on the calling OS thread. `run(n, job)` runs job(t) for
// t = 0..n-1 and returns when all have finished: each fiber runs until it waits at a barrier or
// ends, then the next runnable one (in thread order) runs, so a launch is deterministic. One run
// at a time (the callers launch one kernel at a time).
class Fibers {
  public:
    // A barrier over `expected` fibers; reusable, as a hardware barrier is.
    struct Barrier {
        unsigned expected, arrived = 0;
        unsigned long long phase = 0;
        explicit Barrier(unsigned n) : expected(n) {}
    };

    void run(unsigned n, const std::function<void(unsigned)>& job) {
        job_ = &job;
        while (fibers_.size() < n) fibers_.emplace_back(new Fiber);
        for (unsigned i = 0; i < n; ++i) {
            Fiber& f = *fibers_[i];
            if (!f.stack) f.stack.reset(new char[kStack]);
            f.done = false;
            f.waiting = nullptr;
            f.idx = dim3{i, 0, 0};
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack.get();
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = &main_;
            makecontext(&f.ctx, &Fibers::entry, 0);
        }
        unsigned left = n;
        while (left > 0) {
            bool progress = false;
            for (unsigned i = 0; i < n; ++i) {
                Fiber& f = *fibers_[i];
                if (f.done || (f.waiting && f.waiting->phase == f.phase)) continue;
                f.waiting = nullptr;
                current_ = i;
                threadIdx = f.idx;
                swapcontext(&main_, &f.ctx);
                progress = true;
                if (f.done) --left;
            }
            if (!progress) {
                std::fprintf(stderr, "emulated GPU: a kernel's threads deadlocked at a barrier "
                                     "(a __syncthreads or shuffle that not every thread reached)\n");
                std::abort();
            }
        }
        job_ = nullptr;
    }

    // Called by a fiber: waits until `expected` fibers have arrived at `b`.
    void wait(Barrier& b) {
        if (++b.arrived == b.expected) {
            b.arrived = 0;
            ++b.phase;
            return;
        }
        Fiber& f = *fibers_[current_];
        f.waiting = &b;
        f.phase = b.phase;
        swapcontext(&f.ctx, &main_);
        threadIdx = f.idx;
    }

  private:
    static constexpr std::size_t kStack = 256 * 1024;
    struct Fiber {
        ucontext_t ctx;
        std::unique_ptr<char[]> stack;
        bool done = false;
        Barrier* waiting = nullptr;
        unsigned long long phase = 0;
        dim3 idx;
    };
    static void entry();
    std::vector<std::unique_ptr<Fiber>> fibers_;
    ucontext_t main_;
    unsigned current_ = 0;
    const std::function<void(unsigned)>* job_ = nullptr;
};
inline Fibers& fibers() {
    static Fibers* f = new Fibers;
    return *f;
}
inline void Fibers::entry() {
    Fibers& s = fibers();
    unsigned i = s.current_;
    (*s.job_)(i);
    s.fibers_[i]->done = true;
    // Returning resumes uc_link: the scheduler in run().
}

inline Fibers::Barrier* g_block_bar = nullptr;
inline Fibers::Barrier* g_warp_bar[32];
inline double g_shfl[32][32];

#define __global__
#define __device__
#define __forceinline__
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { fibers().wait(*g_block_bar); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    g_shfl[w][lane] = v;
    fibers().wait(*g_warp_bar[w]);
    float r = (float)g_shfl[w][lane ^ o];
    fibers().wait(*g_warp_bar[w]);
    return r;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for one warp, built from the PTX ISA's
// fragment tables and NOT from kernels.cu's own description of them (so that the emulated
// attention tests check the kernels against the ISA, not against themselves). PTX ISA, section
// 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type":
//
//   groupID           = %laneid >> 2
//   threadID_in_group = %laneid % 4
//   Multiplicand A (.f16/.bf16: four .f16x2 registers, elements a0..a7 low to high; Figure 79):
//     row = groupID            for ai where 0 <= i < 2 || 4 <= i < 6
//           groupID + 8        otherwise
//     col = (threadID_in_group * 2) + (i & 0x1)        for ai where i < 4
//           (threadID_in_group * 2) + (i & 0x1) + 8    for ai where i >= 4
//   Multiplicand B (two .f16x2 registers, elements b0..b3 low to high):
//     row = (threadID_in_group * 2) + (i & 0x1)        for bi where i < 2
//           (threadID_in_group * 2) + (i & 0x1) + 8    for bi where i >= 2
//     col = groupID
//   Accumulators C/D (.f32: four registers c0..c3):
//     row = groupID            for ci where i < 2
//           groupID + 8        for ci where i >= 2
//     col = (threadID_in_group * 2) + (i & 0x1)        for ci where i = {0,..,3}
//
// "Low to high": element 2r of a register pair is its low 16 bits, element 2r + 1 its high ones.
// Every lane scatters its elements into the warp's whole A (16×16) and B (16×8) tiles through
// these index functions, then computes its own accumulators from the whole tiles, summing the 16
// exact products in k order. The first call checks that the index functions place every element
// of A, B and D exactly once (a table typed in wrong would not).
struct MmaAt {
    int row, col;
};
inline int mma_group(int lane) { return lane >> 2; }
inline int mma_thread_in_group(int lane) { return lane % 4; }
inline MmaAt mma_a_at(int lane, int i) {
    int g = mma_group(lane), t = mma_thread_in_group(lane);
    int row = ((0 <= i && i < 2) || (4 <= i && i < 6)) ? g : g + 8;
    int col = i < 4 ? t * 2 + (i & 0x1) : t * 2 + (i & 0x1) + 8;
    return {row, col};
}
inline MmaAt mma_b_at(int lane, int i) {  // row = k, col = n
    int g = mma_group(lane), t = mma_thread_in_group(lane);
    int row = i < 2 ? t * 2 + (i & 0x1) : t * 2 + (i & 0x1) + 8;
    return {row, g};
}
inline MmaAt mma_c_at(int lane, int i) {
    int g = mma_group(lane), t = mma_thread_in_group(lane);
    return {i < 2 ? g : g + 8, t * 2 + (i & 0x1)};
}
inline bool mma_tables_cover_each_element_once() {
    int a[16][16] = {}, b[16][8] = {}, c[16][8] = {};
    for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 8; ++i) { MmaAt p = mma_a_at(lane, i); ++a[p.row][p.col]; }
        for (int i = 0; i < 4; ++i) { MmaAt p = mma_b_at(lane, i); ++b[p.row][p.col]; }
        for (int i = 0; i < 4; ++i) { MmaAt p = mma_c_at(lane, i); ++c[p.row][p.col]; }
    }
    for (int r = 0; r < 16; ++r) {
        for (int k = 0; k < 16; ++k) if (a[r][k] != 1) return false;
        for (int n = 0; n < 8; ++n) if (b[r][n] != 1 || c[r][n] != 1) return false;
    }
    return true;
}
inline float g_mma_a[32][16][16], g_mma_b[32][16][8];
inline float bf16_value(unsigned int reg, int high) {
    unsigned int u = (high ? reg >> 16 : reg & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void emu_mma_bf16(float* d, const unsigned int* a, const unsigned int* b) {
    static const bool tables_ok = mma_tables_cover_each_element_once();
    if (!tables_ok) {
        std::fprintf(stderr, "cuda_shim.h: the mma fragment tables do not cover each element once\n");
        std::abort();
    }
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    for (int i = 0; i < 8; ++i) {
        MmaAt p = mma_a_at(lane, i);
        g_mma_a[w][p.row][p.col] = bf16_value(a[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
        MmaAt p = mma_b_at(lane, i);
        g_mma_b[w][p.row][p.col] = bf16_value(b[i / 2], i % 2);
    }
    fibers().wait(*g_warp_bar[w]);
    for (int i = 0; i < 4; ++i) {
        MmaAt p = mma_c_at(lane, i);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += g_mma_a[w][p.row][k] * g_mma_b[w][k][p.col];
        d[i] += sum;
    }
    fibers().wait(*g_warp_bar[w]);
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#include <math.h>

// Runs kernel body `f` on `grid` blocks of `block` threads: fiber t is thread t of every block in
// turn, and all of them finish a block (a barrier) before any starts the next, so the statics
// that stand for __shared__ memory are never shared between two blocks.
template <class F>
void launch(dim3 grid, unsigned block, F f) {
    gridDim = grid;
    blockDim = dim3{block, 1, 1};
    Fibers::Barrier sync(block), next_block(block);
    g_block_bar = &sync;
    unsigned warps = (block + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) g_warp_bar[w] = new Fibers::Barrier(std::min(32u, block - w * 32));
    std::function<void(unsigned)> job = [&](unsigned t) {
        threadIdx = dim3{t, 0, 0};
        for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
                for (unsigned x = 0; x < grid.x; ++x) {
                    blockIdx = dim3{x, y, z};
                    f();
                    fibers().wait(next_block);
                }
    };
    fibers().run(block, job);
    for (unsigned w = 0; w < warps; ++w) delete g_warp_bar[w];
}
