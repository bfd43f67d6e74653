// The subset of CUDA that gpu/src/kernels.cu uses, emulated on the CPU so that every kernel runs
// in the test suite on machines without a GPU (gpu/tests/emulated_kernels.rs): a block's threads
// are std::threads, __syncthreads() is a barrier over them, a warp shuffle is a barrier over the
// warp's lanes around a shared exchange slot, and __shared__ variables are function statics.
// It checks indexing, barriers, shuffles and numerics; not timing, memory coalescing or the
// compiler's floating-point contractions (the GPU run compares against the CPU oracle for those).
#pragma once
#include <algorithm>
#include <barrier>
#include <condition_variable>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#undef INFINITY

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* g_block_bar = nullptr;
inline std::barrier<>* g_warp_bar[32];
inline double g_shfl[32][32];

#define __global__
#define __device__
#define __forceinline__
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    g_shfl[w][lane] = v;
    g_warp_bar[w]->arrive_and_wait();
    float r = (float)g_shfl[w][lane ^ o];
    g_warp_bar[w]->arrive_and_wait();
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
    g_warp_bar[w]->arrive_and_wait();
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
    g_warp_bar[w]->arrive_and_wait();
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#include <math.h>

// The OS threads that stand for a block's threads, kept across launches (creating a block's
// threads anew at every launch was most of an emulated training step's time). `run(n, job)` runs
// job(t) on threads t = 0..n-1 at once and returns when all have finished; one run at a time (the
// callers launch one kernel at a time). Never destroyed: its idle threads die with the process.
class ThreadPool {
  public:
    void run(unsigned n, const std::function<void(unsigned)>& job) {
        std::unique_lock<std::mutex> lk(m_);
        // A thread made here starts having seen no run: it takes part in this one.
        while (threads_.size() < n) {
            unsigned id = (unsigned)threads_.size();
            threads_.emplace_back([this, id] { loop(id); });
            threads_.back().detach();
        }
        job_ = &job;
        width_ = n;
        left_ = n;
        ++generation_;
        wake_.notify_all();
        done_.wait(lk, [&] { return left_ == 0; });
        job_ = nullptr;
    }

  private:
    void loop(unsigned id) {
        unsigned long long seen = 0;
        for (;;) {
            const std::function<void(unsigned)>* job;
            {
                std::unique_lock<std::mutex> lk(m_);
                wake_.wait(lk, [&] { return generation_ != seen; });
                seen = generation_;
                if (id >= width_) continue;  // not needed by this run (a narrower block)
                job = job_;
            }
            (*job)(id);
            std::lock_guard<std::mutex> lk(m_);
            if (--left_ == 0) done_.notify_one();
        }
    }
    std::mutex m_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> threads_;
    const std::function<void(unsigned)>* job_ = nullptr;
    unsigned width_ = 0, left_ = 0;
    unsigned long long generation_ = 0;
};
inline ThreadPool& thread_pool() {
    static ThreadPool* pool = new ThreadPool;
    return *pool;
}

// Runs kernel body `f` on `grid` blocks of `block` threads: thread t of the pool is thread t of
// every block in turn, and all of them finish a block (a barrier) before any starts the next, so
// the statics that stand for __shared__ memory are never shared between two blocks.
template <class F>
void launch(dim3 grid, unsigned block, F f) {
    gridDim = grid;
    blockDim = dim3{block, 1, 1};
    std::barrier<> sync(block), next_block(block);
    g_block_bar = &sync;
    unsigned warps = (block + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) g_warp_bar[w] = new std::barrier<>(std::min(32u, block - w * 32));
    std::function<void(unsigned)> job = [&](unsigned t) {
        threadIdx = dim3{t, 0, 0};
        for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
                for (unsigned x = 0; x < grid.x; ++x) {
                    blockIdx = dim3{x, y, z};
                    f();
                    next_block.arrive_and_wait();
                }
    };
    thread_pool().run(block, job);
    for (unsigned w = 0; w < warps; ++w) delete g_warp_bar[w];
}
