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
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) for one warp, with the fragment layout of the PTX
// ISA (see mma_bf16 in kernels.cu): every lane posts its fragments, then computes its own four
// outputs from the whole tiles, summing the 16 exact products in k order.
inline unsigned int g_mma[32][32][6];
inline float bf16_value(unsigned int reg, int high) {
    unsigned int u = (high ? reg >> 16 : reg & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void emu_mma_bf16(float* d, const unsigned int* a, const unsigned int* b) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    for (int i = 0; i < 4; ++i) g_mma[w][lane][i] = a[i];
    g_mma[w][lane][4] = b[0];
    g_mma[w][lane][5] = b[1];
    fibers().wait(*g_warp_bar[w]);
    auto A = [&](int row, int k) {
        int holder = (row % 8) * 4 + (k % 8) / 2, reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return bf16_value(g_mma[w][holder][reg], k % 2);
    };
    auto B = [&](int k, int col) {
        int holder = col * 4 + (k % 8) / 2, reg = 4 + (k >= 8 ? 1 : 0);
        return bf16_value(g_mma[w][holder][reg], k % 2);
    };
    int g = lane / 4, j = lane % 4;
    for (int i = 0; i < 4; ++i) {
        int row = g + (i >= 2 ? 8 : 0), col = 2 * j + (i & 1);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
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
