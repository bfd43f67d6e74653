// seqpipe's CUDA kernels: the GPU counterparts of the CPU kernels in `ops/` (which stay the oracle
// they are tested against). Compiled at run time by NVRTC for the device's compute capability
// (gpu/src/compile.rs); every kernel is `extern "C"` so its name is its symbol.
//
// Determinism: no kernel uses atomics. Every reduction runs in a fixed order that depends only on
// the shapes (a block reduces in a fixed tree; column sums go through per-chunk partials summed in
// chunk order), so the same inputs give bit-identical outputs on the same GPU type.
//
// Layouts (row-major): activations (N, C) with N = B*T tokens; the attention reads queries, keys
// and values from rows with a given stride, so the fused QKV buffer (N, 3C) is used in place.

#define WARP 32
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024) in a fixed tree; every thread gets
// the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : -INFINITY;
    r = warp_max(r);
    return r;
}

// ---------------------------------------------------------------------------------------------
// Embeddings.

// out[i, :] = wte[ids[i], :] + (wpe ? wpe[pos0 + i % t, :] : 0)          out (N, C)
// out (n, C) = wte[ids[i]] + wpe[position id of i]; token i is position pos0 + i % t of row i / t.
// The position id is that position, or with `docs` (not null: positions restart at each document,
// `data.reset_positions`) its offset in its document, position - docs[row * seq + position] (the
// per-position document starts of the attention kernels).
extern "C" __global__ void embed_forward(float* out, const unsigned int* ids, const float* wte,
                                         const float* wpe, int n, int c, int t, int pos0,
                                         const unsigned int* docs, int seq) {
    int i = blockIdx.x;
    if (i >= n) return;
    int pos = pos0 + i % t;
    if (docs) pos -= (int)docs[(size_t)(i / t) * seq + pos];
    const float* row = wte + (size_t)ids[i] * c;
    const float* prow = wpe ? wpe + (size_t)pos * c : nullptr;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        out[(size_t)i * c + j] = row[j] + (prow ? prow[j] : 0.0f);
    }
}

// Token-table gradient without atomics: the host sorts the token positions by id (`order`, with
// `starts[u]..starts[u+1]` the positions of unique id `uniq[u]`); one block per unique id sums its
// rows of dy in position order and adds the sum to dwte[id].
extern "C" __global__ void embed_backward_tokens(float* dwte, const float* dy, const unsigned int* order,
                                                 const unsigned int* starts, const unsigned int* uniq,
                                                 int c) {
    int u = blockIdx.x;
    unsigned int s0 = starts[u], s1 = starts[u + 1];
    float* dst = dwte + (size_t)uniq[u] * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int s = s0; s < s1; ++s) acc += dy[(size_t)order[s] * c + j];
        dst[j] += acc;
    }
}

// Position-table gradient: dwpe[pos0 + p, :] += sum over rows b of dy[b * t + p, :] (b in order).
extern "C" __global__ void embed_backward_positions(float* dwpe, const float* dy, int b, int t, int c,
                                                    int pos0) {
    int p = blockIdx.x;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < b; ++r) acc += dy[((size_t)r * t + p) * c + j];
        dwpe[(size_t)(pos0 + p) * c + j] += acc;
    }
}

// Position-table gradient with positions restarting at each document (`data.reset_positions`):
// position p of row r has id p - docs[r * seq + p]. dwpe[q, :] += the sum of dy over the unit's
// tokens of id q (positions pos0..pos0+t of b rows), added in token order (row by row, positions
// ascending) from 0: the order of the CPU's ops::embedding_backward, so the two agree bit for bit
// on the same dy. One block per id q (grid: the unit's largest id + 1), threads over channels; no
// atomics and no sort. A document's positions are contiguous with ids 0, 1, 2, ..., so in a row
// the token of id q of document d is start_d + q, if d reaches it: the block walks each row's
// documents that meet the segment, finding the next one's first position by a binary search over
// the non-decreasing per-position starts.
extern "C" __global__ void embed_backward_positions_reset(float* dwpe, const float* dy,
                                                          const unsigned int* docs, int b, int t,
                                                          int c, int pos0, int seq) {
    int q = blockIdx.x, end = pos0 + t;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < b; ++r) {
            const unsigned int* row = docs + (size_t)r * seq;
            for (int p = pos0; p < end;) {
                int s = (int)row[p];  // the start of p's document (before pos0 for the first)
                // The first position of the next document in the segment (or its end).
                int lo = p + 1, hi = end;
                while (lo < hi) {
                    int mid = lo + (hi - lo) / 2;
                    if ((int)row[mid] == s) lo = mid + 1;
                    else hi = mid;
                }
                int at = s + q;  // the document's position of id q
                if (at >= p && at < lo) acc += dy[((size_t)r * t + (at - pos0)) * c + j];
                p = lo;
            }
        }
        dwpe[(size_t)q * c + j] += acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Column sums (bias and norm-parameter gradients) in two deterministic passes.

// partial[k, j] = sum of x[r, j] over rows r of chunk k (rows k*rows_per_chunk .. in order).
// grid (ceil(c / blockDim.x), chunks)
extern "C" __global__ void column_sum_partial(float* partial, const float* x, int n, int c,
                                              int rows_per_chunk) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int k = blockIdx.y;
    if (j >= c) return;
    int r0 = k * rows_per_chunk, r1 = min(n, r0 + rows_per_chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; ++r) acc += x[(size_t)r * c + j];
    partial[(size_t)k * c + j] = acc;
}

// out[j] (+)= sum over chunks k of partial[k, j], k in order.
extern "C" __global__ void column_sum_finish(float* out, const float* partial, int chunks, int c,
                                             int accumulate) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float acc = 0.0f;
    for (int k = 0; k < chunks; ++k) acc += partial[(size_t)k * c + j];
    out[j] = accumulate ? out[j] + acc : acc;
}

// ---------------------------------------------------------------------------------------------
// Element-wise.

// y[i, j] += b[j]            y (N, C)
extern "C" __global__ void add_bias(float* y, const float* b, long long total, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % c];
}

// out = a + b
extern "C" __global__ void add(float* out, const float* a, const float* b, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = a[i] + b[i];
}

// out += a
extern "C" __global__ void add_assign(float* out, const float* a, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] += a[i];
}

// Copies b blocks of `rows` rows of `width` floats: block i from src rows src_row0.. of the i-th
// group of src_rows rows to dst rows dst_row0.. of the i-th group of dst_rows rows (a segment's
// rows into or out of a whole-sequence K/V cache).
extern "C" __global__ void copy_rows(float* dst, const float* src, int b, int rows, int width, int dst_rows,
                                     int dst_row0, int src_rows, int src_row0) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)b * rows * width;
    if (idx >= total) return;
    int e = idx % width;
    int r = (idx / width) % rows;
    int i = idx / ((long long)width * rows);
    dst[((size_t)i * dst_rows + dst_row0 + r) * width + e] = src[((size_t)i * src_rows + src_row0 + r) * width + e];
}

#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f

// u = x + b (saved for the backward, written over x), y = gelu_tanh(u).
extern "C" __global__ void bias_gelu_forward(float* y, float* x, const float* b, long long total, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float u = x[i] + (b ? b[i % c] : 0.0f);
    x[i] = u;
    float t = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
    y[i] = 0.5f * u * (1.0f + t);
}

// du = dy * gelu'(u)
extern "C" __global__ void gelu_backward(float* du, const float* dy, const float* u, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float x = u[i];
    float inner = GELU_K0 * (x + GELU_K1 * x * x * x);
    float t = tanhf(inner);
    float dinner = GELU_K0 * (1.0f + 3.0f * GELU_K1 * x * x);
    du[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner);
}

// ---------------------------------------------------------------------------------------------
// Layer norm and RMS norm: one block of 128 threads per row.

// y = (x - mean) * rstd * w + b; saves mean and rstd per row. `b` null and rms = 1: RMS norm
// (mean 0, rstd = 1 / sqrt(mean(x^2) + eps)).
extern "C" __global__ void norm_forward(float* y, float* mean_out, float* rstd_out, const float* x,
                                        const float* w, const float* b, int c, float eps, int rms) {
    __shared__ float scratch[32];
    int i = blockIdx.x;
    const float* xr = x + (size_t)i * c;
    float mean = 0.0f;
    if (!rms) {
        float s = 0.0f;
        for (int j = threadIdx.x; j < c; j += blockDim.x) s += xr[j];
        mean = block_sum(s, scratch) / c;
    }
    float s2 = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float d = xr[j] - mean;
        s2 += d * d;
    }
    float var = block_sum(s2, scratch) / c;
    float rstd = rsqrtf(var + eps);
    float* yr = y + (size_t)i * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float v = (xr[j] - mean) * rstd * w[j];
        yr[j] = b ? v + b[j] : v;
    }
    if (threadIdx.x == 0) {
        mean_out[i] = mean;
        rstd_out[i] = rstd;
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w (layer norm);
// dx = rstd * (g - xhat * mean(g * xhat)) (RMS norm).
extern "C" __global__ void norm_backward_input(float* dx, const float* dy, const float* x, const float* mean_in,
                                               const float* rstd_in, const float* w, int c, int rms) {
    __shared__ float scratch[32];
    int i = blockIdx.x;
    const float* xr = x + (size_t)i * c;
    const float* dyr = dy + (size_t)i * c;
    float mean = mean_in[i], rstd = rstd_in[i];
    float sg = 0.0f, sgx = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float g = dyr[j] * w[j];
        float xhat = (xr[j] - mean) * rstd;
        sg += g;
        sgx += g * xhat;
    }
    float mg = rms ? 0.0f : block_sum(sg, scratch) / c;
    float mgx = block_sum(sgx, scratch) / c;
    float* dxr = dx + (size_t)i * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float g = dyr[j] * w[j];
        float xhat = (xr[j] - mean) * rstd;
        dxr[j] = rstd * (g - mg - xhat * mgx);
    }
}

// Partial parameter gradients of a chunk of rows: pw[k, j] = sum dy * xhat, pb[k, j] = sum dy.
// grid (ceil(c / blockDim.x), chunks); `pb` null for RMS norm.
extern "C" __global__ void norm_backward_params_partial(float* pw, float* pb, const float* dy, const float* x,
                                                        const float* mean_in, const float* rstd_in, int n,
                                                        int c, int rows_per_chunk) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int k = blockIdx.y;
    if (j >= c) return;
    int r0 = k * rows_per_chunk, r1 = min(n, r0 + rows_per_chunk);
    float aw = 0.0f, ab = 0.0f;
    for (int r = r0; r < r1; ++r) {
        float d = dy[(size_t)r * c + j];
        aw += d * (x[(size_t)r * c + j] - mean_in[r]) * rstd_in[r];
        ab += d;
    }
    pw[(size_t)k * c + j] = aw;
    if (pb) pb[(size_t)k * c + j] = ab;
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding on (rows of) heads: x (B, s, H, D) with row stride `stride` floats,
// position of row t = offset + t; pairs (i, i + D/2) rotated by cos/sin tables (max_len, D/2).
// `inverse` rotates back (the backward).
extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t, int b, int s, int h, int d,
                                int stride, int offset, int inverse) {
    int half = d / 2;
    long long total = (long long)b * s * h * half;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    int i = idx % half;
    long long rest = idx / half;
    int head = rest % h;
    long long row = rest / h;  // b * s + t
    int t = row % s;
    float* p = x + row * stride + head * d;
    float co = cos_t[(size_t)(offset + t) * half + i];
    float si = sin_t[(size_t)(offset + t) * half + i];
    if (inverse) si = -si;
    float x1 = p[i], x2 = p[i + half];
    p[i] = x1 * co - x2 * si;
    p[i + half] = x1 * si + x2 * co;
}

// ---------------------------------------------------------------------------------------------
// Causal attention of a query segment over a key/value prefix (flash-attention 2 style, FP32).
//
// Queries: positions P..P+s of each sequence; element (b, t, h, e) of q at
// q[(b*s + t) * q_stride + h*D + e]. Keys/values: positions 0..L = P+s, element (b, l, h, e) at
// k[(b*kv_rows + l) * kv_stride + h*D + e] (kv_rows >= L: a K/V cache may hold the whole sequence). Query t sees keys 0..=P+t. Output y (B*s, H*D) row-major,
// lse (B, H, s): log-sum-exp of the scaled, masked scores (saved for the backward).
//
// Document masks (packed documents): `docs`, when not null, holds per sequence and key position
// the start of the document that position belongs to, laid out like the K/V rows (position l of
// sequence b at docs[b*kv_rows + l]: one u32 per position of the micro-batch, uploaded once and
// read by every segment and layer). Query t then sees keys docs[p+t]..=p+t only. Starts are
// non-decreasing along a sequence, so a block's first query has its smallest start: every pass
// begins its key tiles there and never loads the keys before it (skipped, not masked after the
// fact), and the dK/dV pass stops at the first query tile whose first query starts after the
// block's last key. With `docs` null every start is 0 and the arithmetic is the unmasked one.
//
// One thread owns one query row (its q and accumulator live in registers); a block of BR threads
// walks the visible keys in tiles of BC held in shared memory, with an online softmax.

#define BR 64
#define BC 32

// The document start of position `pos` of sequence b (the first key a query there may see); 0
// with no mask.
__device__ __forceinline__ int doc_start(const unsigned int* docs, int b, int kv_rows, int pos) {
    return docs ? (int)docs[(size_t)b * kv_rows + pos] : 0;
}

// Keys/values k0..k0+BC of (sequence b, head h) into shared memory (zeros past `keys`), between
// barriers: the tile of the previous iteration is no longer read when this one is written.
template <int D>
__device__ __forceinline__ void load_kv_tile(float (*ks)[D], float (*vs)[D], const float* k, const float* v, int b,
                                             int h, int kv_rows, int k0, int keys, int kv_stride) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < BC * D; idx += BR) {
        int r = idx / D, e = idx % D;
        int l_idx = k0 + r;
        bool ok = l_idx < keys;
        size_t off = ((size_t)b * kv_rows + (ok ? l_idx : 0)) * kv_stride + h * D + e;
        ks[r][e] = ok ? k[off] : 0.0f;
        vs[r][e] = ok ? v[off] : 0.0f;
    }
    __syncthreads();
}

template <int D>
__device__ void attn_forward(float* y, float* lse, const float* q, const float* k, const float* v,
                             const unsigned int* docs, int b_count, int h_count, int s, int p, int q_stride,
                             int kv_stride, int kv_rows, float scale) {
    __shared__ float ks[BC][D];
    __shared__ float vs[BC][D];
    int bh = blockIdx.y;
    int b = bh / h_count, h = bh % h_count;
    int t = blockIdx.x * BR + threadIdx.x;
    bool active = t < s;
    float qr[D], acc[D];
    const float* qrow = q + ((size_t)b * s + (active ? t : 0)) * q_stride + h * D;
    #pragma unroll
    for (int e = 0; e < D; ++e) {
        qr[e] = active ? qrow[e] * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int t_last = min(s, (int)(blockIdx.x + 1) * BR) - 1;
    int keys = p + t_last + 1;  // keys some query of this block sees
    int visible = active ? p + t + 1 : 0;
    int lo = active ? doc_start(docs, b, kv_rows, p + t) : 0;  // first key this query sees
    int k_begin = doc_start(docs, b, kv_rows, p + blockIdx.x * BR);  // first key any query sees
    for (int k0 = k_begin; k0 < keys; k0 += BC) {
        load_kv_tile<D>(ks, vs, k, v, b, h, kv_rows, k0, keys, kv_stride);
        int n_here = min(BC, visible - k0);
        int r_lo = max(0, lo - k0);
        if (n_here <= r_lo) continue;
        float sc[BC];
        float tile_max = -INFINITY;
        #pragma unroll
        for (int r = 0; r < BC; ++r) {
            if (r >= r_lo && r < n_here) {
                float dot = 0.0f;
                #pragma unroll
                for (int e = 0; e < D; ++e) dot += qr[e] * ks[r][e];
                sc[r] = dot;
                tile_max = fmaxf(tile_max, dot);
            }
        }
        float m_new = fmaxf(m, tile_max);
        float corr = expf(m - m_new);
        l *= corr;
        #pragma unroll
        for (int e = 0; e < D; ++e) acc[e] *= corr;
        #pragma unroll
        for (int r = 0; r < BC; ++r) {
            if (r >= r_lo && r < n_here) {
                float pr = expf(sc[r] - m_new);
                l += pr;
                #pragma unroll
                for (int e = 0; e < D; ++e) acc[e] += pr * vs[r][e];
            }
        }
        m = m_new;
    }
    if (active) {
        float inv = 1.0f / l;
        float* yrow = y + ((size_t)b * s + t) * (h_count * D) + h * D;
        #pragma unroll
        for (int e = 0; e < D; ++e) yrow[e] = acc[e] * inv;
        lse[((size_t)b * h_count + h) * s + t] = m + logf(l);
    }
}

// delta[b, h, t] = sum_e dy[row, h*D + e] * y[row, h*D + e]    (rows of (B*s, H*D))
extern "C" __global__ void attn_backward_delta(float* delta, const float* dy, const float* y, int b_count,
                                               int h_count, int s, int d) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)b_count * h_count * s;
    if (idx >= total) return;
    int t = idx % s;
    int h = (idx / s) % h_count;
    int b = idx / ((long long)s * h_count);
    const float* a = dy + ((size_t)b * s + t) * (h_count * d) + h * d;
    const float* c = y + ((size_t)b * s + t) * (h_count * d) + h * d;
    float acc = 0.0f;
    for (int e = 0; e < d; ++e) acc += a[e] * c[e];
    delta[idx] = acc;
}

// dQ: one thread per query; walks the visible keys like the forward.
// dq (B*s, H*D) row-major, written (not accumulated).
template <int D>
__device__ void attn_backward_dq(float* dq, const float* q, const float* k, const float* v, const float* dy,
                                 const float* lse, const float* delta, const unsigned int* docs, int b_count,
                                 int h_count, int s, int p, int q_stride, int kv_stride, int kv_rows,
                                 float scale) {
    __shared__ float ks[BC][D];
    __shared__ float vs[BC][D];
    int bh = blockIdx.y;
    int b = bh / h_count, h = bh % h_count;
    int t = blockIdx.x * BR + threadIdx.x;
    bool active = t < s;
    int tt = active ? t : 0;
    float qr[D], dor[D], acc[D];
    const float* qrow = q + ((size_t)b * s + tt) * q_stride + h * D;
    const float* drow = dy + ((size_t)b * s + tt) * (h_count * D) + h * D;
    #pragma unroll
    for (int e = 0; e < D; ++e) {
        qr[e] = qrow[e] * scale;
        dor[e] = drow[e];
        acc[e] = 0.0f;
    }
    size_t stat = ((size_t)b * h_count + h) * s + tt;
    float my_lse = lse[stat], my_delta = delta[stat];
    int t_last = min(s, (int)(blockIdx.x + 1) * BR) - 1;
    int keys = p + t_last + 1;
    int visible = active ? p + t + 1 : 0;
    int lo = doc_start(docs, b, kv_rows, p + tt);
    int k_begin = doc_start(docs, b, kv_rows, p + blockIdx.x * BR);
    for (int k0 = k_begin; k0 < keys; k0 += BC) {
        load_kv_tile<D>(ks, vs, k, v, b, h, kv_rows, k0, keys, kv_stride);
        int n_here = min(BC, visible - k0);
        for (int r = max(0, lo - k0); r < n_here; ++r) {
            float dot = 0.0f, dp = 0.0f;
            #pragma unroll
            for (int e = 0; e < D; ++e) {
                dot += qr[e] * ks[r][e];
                dp += dor[e] * vs[r][e];
            }
            float pr = expf(dot - my_lse);
            float ds = pr * (dp - my_delta);
            #pragma unroll
            for (int e = 0; e < D; ++e) acc[e] += ds * ks[r][e];
        }
    }
    if (active) {
        float* out = dq + ((size_t)b * s + t) * (h_count * D) + h * D;
        #pragma unroll
        for (int e = 0; e < D; ++e) out[e] = acc[e] * scale;
    }
}

// dK, dV: one thread per key position l of 0..L; walks the queries that see it (t >= l - P) in
// tiles of BC held in shared memory. dk, dv: rows of H*D floats, kv_rows per sequence like k and v
// (row l of sequence b at (b*kv_rows + l)); written, or added to with `accumulate` (the dK/dV of
// a K/V prefix gathers every later segment's share, in backward order: no atomics). With `docs`,
// key l is seen by the queries t >= l - P whose document starts at or before l: a prefix of them.
template <int D>
__device__ void attn_backward_dkdv(float* dk, float* dv, const float* q, const float* k, const float* v,
                                   const float* dy, const float* lse, const float* delta,
                                   const unsigned int* docs, int b_count, int h_count, int s, int p,
                                   int q_stride, int kv_stride, int kv_rows, int accumulate, float scale) {
    __shared__ float qs[BC][D];
    __shared__ float ds_[BC][D];
    __shared__ float ls[BC];
    __shared__ float dl[BC];
    __shared__ int los[BC];
    int bh = blockIdx.y;
    int b = bh / h_count, h = bh % h_count;
    int L = p + s;
    int l = blockIdx.x * BR + threadIdx.x;
    bool active = l < L;
    int ll = active ? l : 0;
    float kr[D], vr[D], adk[D], adv[D];
    const float* krow = k + ((size_t)b * kv_rows + ll) * kv_stride + h * D;
    const float* vrow = v + ((size_t)b * kv_rows + ll) * kv_stride + h * D;
    #pragma unroll
    for (int e = 0; e < D; ++e) {
        kr[e] = krow[e];
        vr[e] = vrow[e];
        adk[e] = 0.0f;
        adv[e] = 0.0f;
    }
    // First query any key of this block is seen by: t = l_first - P (at least 0).
    int l_first = blockIdx.x * BR;
    int t_start = max(0, l_first - p);
    int my_first = active ? max(0, l - p) : s;
    int l_last = min(L, l_first + BR) - 1;  // this block's last key
    for (int t0 = t_start; t0 < s; t0 += BC) {
        // Queries from here on start their documents after every key of the block (uniform).
        if (doc_start(docs, b, kv_rows, p + t0) > l_last) break;
        __syncthreads();
        for (int idx = threadIdx.x; idx < BC * D; idx += BR) {
            int r = idx / D, e = idx % D;
            int t = t0 + r;
            bool ok = t < s;
            size_t row = (size_t)b * s + (ok ? t : 0);
            qs[r][e] = ok ? q[row * q_stride + h * D + e] * scale : 0.0f;
            ds_[r][e] = ok ? dy[row * (h_count * D) + h * D + e] : 0.0f;
        }
        for (int r = threadIdx.x; r < BC; r += BR) {
            int t = t0 + r;
            bool ok = t < s;
            size_t stat = ((size_t)b * h_count + h) * s + (ok ? t : 0);
            ls[r] = ok ? lse[stat] : 0.0f;
            dl[r] = ok ? delta[stat] : 0.0f;
            los[r] = ok ? doc_start(docs, b, kv_rows, p + t) : 0;
        }
        __syncthreads();
        int r0 = max(0, my_first - t0);
        int r1 = min(BC, s - t0);
        for (int r = r0; r < r1; ++r) {
            if (los[r] > l) break;  // this query's document (and every later one's) starts after l
            float dot = 0.0f, dp = 0.0f;
            #pragma unroll
            for (int e = 0; e < D; ++e) {
                dot += qs[r][e] * kr[e];
                dp += ds_[r][e] * vr[e];
            }
            float pr = expf(dot - ls[r]);
            float dsc = pr * (dp - dl[r]);
            #pragma unroll
            for (int e = 0; e < D; ++e) {
                adv[e] += pr * ds_[r][e];
                adk[e] += dsc * qs[r][e];  // qs already holds scale * q
            }
        }
    }
    if (active) {
        float* ok_ = dk + ((size_t)b * kv_rows + l) * (h_count * D) + h * D;
        float* ov = dv + ((size_t)b * kv_rows + l) * (h_count * D) + h * D;
        #pragma unroll
        for (int e = 0; e < D; ++e) {
            ok_[e] = accumulate ? ok_[e] + adk[e] : adk[e];
            ov[e] = accumulate ? ov[e] + adv[e] : adv[e];
        }
    }
}

#define ATTN_INSTANCES(D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(BR) attn_forward_d##D(                                   \
        float* y, float* lse, const float* q, const float* k, const float* v, const unsigned int* docs,     \
        int b, int h, int s, int p, int q_stride, int kv_stride, int kv_rows, float scale) {               \
        attn_forward<D>(y, lse, q, k, v, docs, b, h, s, p, q_stride, kv_stride, kv_rows, scale);           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(BR) attn_backward_dq_d##D(                               \
        float* dq, const float* q, const float* k, const float* v, const float* dy, const float* lse,      \
        const float* delta, const unsigned int* docs, int b, int h, int s, int p, int q_stride,            \
        int kv_stride, int kv_rows, float scale) {                                                         \
        attn_backward_dq<D>(dq, q, k, v, dy, lse, delta, docs, b, h, s, p, q_stride, kv_stride, kv_rows,   \
                            scale);                                                                        \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(BR) attn_backward_dkdv_d##D(                             \
        float* dk, float* dv, const float* q, const float* k, const float* v, const float* dy,             \
        const float* lse, const float* delta, const unsigned int* docs, int b, int h, int s, int p,        \
        int q_stride, int kv_stride, int kv_rows, int accumulate, float scale) {                           \
        attn_backward_dkdv<D>(dk, dv, q, k, v, dy, lse, delta, docs, b, h, s, p, q_stride, kv_stride,      \
                              kv_rows, accumulate, scale);                                                 \
    }

ATTN_INSTANCES(16)
ATTN_INSTANCES(32)
ATTN_INSTANCES(64)
ATTN_INSTANCES(128)

// ---------------------------------------------------------------------------------------------
// The same attention on tensor cores (bf16 operands, fp32 accumulation and softmax), for
// `model.precision = "bf16"` on compute capability 8.0 and later: same arguments, layouts and
// outputs as the FP32 kernels above, blocks of 4 warps (TC_THREADS) over TC_ROWS rows. Each warp
// owns 16 rows (queries; keys in the dK/dV pass) and multiplies 16×8×16 tiles with mma.sync; the
// products' operands are rounded to bf16 (round to nearest even), everything else stays fp32.
// Deterministic like the rest: no atomics, every sum in a fixed order.

#define TC_ROWS 64
#define TC_THREADS 128
#define TC_COLS 64  // keys (forward, dQ) or queries (dK/dV) per shared-memory tile
#define TC_PAD 8    // bf16 padding per shared row, against bank conflicts

// The bf16 nearest to x (round to nearest even; a NaN stays a NaN), as the low 16 bits.
__device__ __forceinline__ unsigned int bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// Two bf16 in one register: `lo` (the element of lower index) in bits 0..15.
__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return bf16_bits(lo) | (bf16_bits(hi) << 16);
}

// out = bf16(x), round to nearest even (matrix-product operands in BF16).
extern "C" __global__ void to_bf16(unsigned short* out, const float* x, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = (unsigned short)bf16_bits(x[i]);
}
// Two neighbouring bf16 of a shared tile as one register: at an even index of a row of even length
// in a 16-byte aligned tile, so the 32-bit load is aligned.
__device__ __forceinline__ unsigned int pair_at(const unsigned short* p) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<const unsigned int*>(p);
#else
    return (unsigned int)p[0] | ((unsigned int)p[1] << 16);
#endif
}

// d += a·b for one warp: a 16×16 (row-major), b 16×8 (column-major) in bf16, d 16×8 in fp32.
// Fragments as the PTX ISA lays out mma.m16n8k16, with g = lane / 4 and j = lane % 4:
//   a[0] = A(g, 2j..2j+1)   a[1] = A(g+8, 2j..2j+1)   a[2] = A(g, 2j+8..2j+9)   a[3] = A(g+8, 2j+8..2j+9)
//   b[0] = B(2j..2j+1, g)   b[1] = B(2j+8..2j+9, g)
//   d[0], d[1] = D(g, 2j), D(g, 2j+1)                  d[2], d[3] = D(g+8, 2j), D(g+8, 2j+1)
// (cuda_shim.h emulates it with the same layout on the CPU.)
__device__ __forceinline__ void mma_bf16(float* d, const unsigned int* a, const unsigned int* b) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the host launches these kernels on compute capability 8.0 and later only
#endif
#else
    emu_mma_bf16(d, a, b);
#endif
}

// The A fragments of a 16-row band of an fp32 matrix (row r of the band at src + r * stride,
// rows from `rows` on read as zeros), each element times `mul`: a[kk][0..4] for columns 16kk...
template <int D>
__device__ __forceinline__ void load_a_rows(unsigned int (*a)[4], const float* src, size_t stride, int rows,
                                            float mul) {
    int g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    const float* r0 = src + (size_t)(g < rows ? g : 0) * stride;
    const float* r8 = src + (size_t)(g + 8 < rows ? g + 8 : 0) * stride;
    float z0 = g < rows ? mul : 0.0f, z8 = g + 8 < rows ? mul : 0.0f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        int c = 16 * kk + 2 * j;
        a[kk][0] = pack_bf16(r0[c] * z0, r0[c + 1] * z0);
        a[kk][1] = pack_bf16(r8[c] * z8, r8[c + 1] * z8);
        a[kk][2] = pack_bf16(r0[c + 8] * z0, r0[c + 9] * z0);
        a[kk][3] = pack_bf16(r8[c + 8] * z8, r8[c + 9] * z8);
    }
}

// An A fragment from a 16×16 block of fp32 accumulators: n-tiles `lo` (columns 0..7) and `hi`
// (columns 8..15) in the d layout of mma_bf16.
__device__ __forceinline__ void acc_to_a(unsigned int* a, const float* lo, const float* hi) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

// B fragments from a shared bf16 tile `t` (rows of D + TC_PAD). `b_transposed`: the block whose
// column c is tile row n0 + c and whose row k is tile column k0 + k (B = Tᵀ, e.g. keys as columns
// of QKᵀ); `b_as_is`: the block of tile rows k0.. and columns n0.. as it lies (e.g. V in PV).
template <int D>
__device__ __forceinline__ void b_transposed(unsigned int* b, const unsigned short (*t)[D + TC_PAD], int n0, int k0) {
    int g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    b[0] = pair_at(&t[n0 + g][k0 + 2 * j]);
    b[1] = pair_at(&t[n0 + g][k0 + 8 + 2 * j]);
}
template <int D>
__device__ __forceinline__ void b_as_is(unsigned int* b, const unsigned short (*t)[D + TC_PAD], int k0, int n0) {
    int g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int r = k0 + 2 * j, c = n0 + g;
    b[0] = (unsigned int)t[r][c] | ((unsigned int)t[r + 1][c] << 16);
    b[1] = (unsigned int)t[r + 8][c] | ((unsigned int)t[r + 9][c] << 16);
}

// Rows `first`..first+TC_COLS of an fp32 matrix into shared bf16 (zeros from row `count` on),
// each element times `mul`: rows of D, row r of the source at src + r * stride.
template <int D>
__device__ __forceinline__ void load_tile_bf16(unsigned short (*dst)[D + TC_PAD], const float* src, size_t stride,
                                               int first, int count, float mul) {
    for (int idx = threadIdx.x; idx < TC_COLS * D; idx += TC_THREADS) {
        int r = idx / D, e = idx % D;
        bool ok = first + r < count;
        dst[r][e] = (unsigned short)bf16_bits(ok ? src[(size_t)(ok ? first + r : 0) * stride + e] * mul : 0.0f);
    }
}

// Keys/values k0..k0+TC_COLS of one sequence and head (rows of `kb`, `vb`; zeros from `keys` on)
// into shared memory, between barriers: the previous tiles are no longer read when these are written.
template <int D>
__device__ __forceinline__ void load_kv_tiles_bf16(unsigned short (*ks)[D + TC_PAD], unsigned short (*vs)[D + TC_PAD],
                                                   const float* kb, const float* vb, int kv_stride, int k0, int keys) {
    __syncthreads();
    load_tile_bf16<D>(ks, kb + (size_t)k0 * kv_stride, kv_stride, 0, keys - k0, 1.0f);
    load_tile_bf16<D>(vs, vb + (size_t)k0 * kv_stride, kv_stride, 0, keys - k0, 1.0f);
    __syncthreads();
}

// Row max and sum over the 4 lanes that hold one row's accumulators.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int D>
__device__ void attn_tc_forward(float* y, float* lse, const float* q, const float* k, const float* v, int b_count,
                                int h_count, int s, int p, int q_stride, int kv_stride, int kv_rows, float scale) {
    __shared__ __align__(16) unsigned short ks[TC_COLS][D + TC_PAD];
    __shared__ __align__(16) unsigned short vs[TC_COLS][D + TC_PAD];
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int row0 = blockIdx.x * TC_ROWS + warp * 16;  // this warp's first query
    int rows = max(0, min(16, s - row0));
    unsigned int qa[D / 16][4];
    load_a_rows<D>(qa, q + ((size_t)b * s + min(row0, s - 1)) * q_stride + h * D, q_stride, rows, scale);
    float o[D / 8][4] = {};
    float m0 = -INFINITY, m8 = -INFINITY, l0 = 0.0f, l8 = 0.0f;  // rows g and g + 8
    int t_last = min(s, (int)(blockIdx.x + 1) * TC_ROWS) - 1;
    int keys = p + t_last + 1;
    int warp_keys = rows > 0 ? p + row0 + rows : 0;  // keys this warp's queries see
    const float* kb = k + (size_t)b * kv_rows * kv_stride + h * D;
    const float* vb = v + (size_t)b * kv_rows * kv_stride + h * D;
    for (int k0 = 0; k0 < keys; k0 += TC_COLS) {
        load_kv_tiles_bf16<D>(ks, vs, kb, vb, kv_stride, k0, keys);
        if (k0 >= warp_keys) continue;
        float sc[TC_COLS / 8][4] = {};
        #pragma unroll
        for (int n = 0; n < TC_COLS / 8; ++n)
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int bf[2];
                b_transposed<D>(bf, ks, 8 * n, 16 * kk);
                mma_bf16(sc[n], qa[kk], bf);
            }
        // Causal mask: query row0 + r sees keys 0..=p + row0 + r.
        float mx0 = -INFINITY, mx8 = -INFINITY;
        #pragma unroll
        for (int n = 0; n < TC_COLS / 8; ++n)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = g + (i >= 2 ? 8 : 0), key = k0 + 8 * n + 2 * j + (i & 1);
                bool ok = r < rows && key <= p + row0 + r;
                sc[n][i] = ok ? sc[n][i] : -INFINITY;
                if (i < 2) mx0 = fmaxf(mx0, sc[n][i]); else mx8 = fmaxf(mx8, sc[n][i]);
            }
        float n0 = fmaxf(m0, quad_max(mx0)), n8 = fmaxf(m8, quad_max(mx8));
        // A row that has seen no key yet keeps m = -inf: its probabilities are 0, not NaN.
        float c0 = n0 == -INFINITY ? 1.0f : expf(m0 - n0), c8 = n8 == -INFINITY ? 1.0f : expf(m8 - n8);
        float base0 = n0 == -INFINITY ? 0.0f : n0, base8 = n8 == -INFINITY ? 0.0f : n8;
        l0 *= c0;
        l8 *= c8;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= c0; o[n][1] *= c0; o[n][2] *= c8; o[n][3] *= c8;
        }
        #pragma unroll
        for (int n = 0; n < TC_COLS / 8; ++n) {
            sc[n][0] = expf(sc[n][0] - base0); sc[n][1] = expf(sc[n][1] - base0);
            sc[n][2] = expf(sc[n][2] - base8); sc[n][3] = expf(sc[n][3] - base8);
            l0 += sc[n][0] + sc[n][1];
            l8 += sc[n][2] + sc[n][3];
        }
        m0 = n0;
        m8 = n8;
        // o += P·V, P (16 × TC_COLS) straight from the score accumulators.
        #pragma unroll
        for (int kk = 0; kk < TC_COLS / 16; ++kk) {
            unsigned int pa[4];
            acc_to_a(pa, sc[2 * kk], sc[2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int bf[2];
                b_as_is<D>(bf, vs, 16 * kk, 8 * n);
                mma_bf16(o[n], pa, bf);
            }
        }
    }
    l0 = quad_sum(l0);
    l8 = quad_sum(l8);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = g + 8 * half;
        if (r >= rows) continue;
        float l = half ? l8 : l0, m = half ? m8 : m0, inv = 1.0f / l;
        float* yrow = y + ((size_t)b * s + row0 + r) * (h_count * D) + h * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            yrow[8 * n + 2 * j] = o[n][2 * half] * inv;
            yrow[8 * n + 2 * j + 1] = o[n][2 * half + 1] * inv;
        }
        if (j == 0) lse[((size_t)b * h_count + h) * s + row0 + r] = m + logf(l);
    }
}

// dQ on tensor cores: each warp owns 16 queries and walks the visible keys like the forward,
// recomputing P from the saved log-sum-exp; dq written (not accumulated).
template <int D>
__device__ void attn_tc_backward_dq(float* dq, const float* q, const float* k, const float* v, const float* dy,
                                    const float* lse, const float* delta, int b_count, int h_count, int s, int p,
                                    int q_stride, int kv_stride, int kv_rows, float scale) {
    __shared__ __align__(16) unsigned short ks[TC_COLS][D + TC_PAD];
    __shared__ __align__(16) unsigned short vs[TC_COLS][D + TC_PAD];
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int row0 = blockIdx.x * TC_ROWS + warp * 16;
    int rows = max(0, min(16, s - row0));
    int first = min(row0, s - 1);
    unsigned int qa[D / 16][4], da[D / 16][4];
    load_a_rows<D>(qa, q + ((size_t)b * s + first) * q_stride + h * D, q_stride, rows, scale);
    load_a_rows<D>(da, dy + ((size_t)b * s + first) * (h_count * D) + h * D, (size_t)h_count * D, rows, 1.0f);
    size_t stat = ((size_t)b * h_count + h) * s;
    float lse0 = g < rows ? lse[stat + row0 + g] : 0.0f, lse8 = g + 8 < rows ? lse[stat + row0 + g + 8] : 0.0f;
    float dl0 = g < rows ? delta[stat + row0 + g] : 0.0f, dl8 = g + 8 < rows ? delta[stat + row0 + g + 8] : 0.0f;
    float acc[D / 8][4] = {};
    int t_last = min(s, (int)(blockIdx.x + 1) * TC_ROWS) - 1;
    int keys = p + t_last + 1;
    int warp_keys = rows > 0 ? p + row0 + rows : 0;
    const float* kb = k + (size_t)b * kv_rows * kv_stride + h * D;
    const float* vb = v + (size_t)b * kv_rows * kv_stride + h * D;
    for (int k0 = 0; k0 < keys; k0 += TC_COLS) {
        load_kv_tiles_bf16<D>(ks, vs, kb, vb, kv_stride, k0, keys);
        if (k0 >= warp_keys) continue;
        float sc[TC_COLS / 8][4] = {}, dp[TC_COLS / 8][4] = {};
        #pragma unroll
        for (int n = 0; n < TC_COLS / 8; ++n) {
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int kf[2], vf[2];
                b_transposed<D>(kf, ks, 8 * n, 16 * kk);
                b_transposed<D>(vf, vs, 8 * n, 16 * kk);
                mma_bf16(sc[n], qa[kk], kf);
                mma_bf16(dp[n], da[kk], vf);
            }
            // dS = P ∘ (dP − delta), P = exp(S − lse) where visible, else 0.
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = g + (i >= 2 ? 8 : 0), key = k0 + 8 * n + 2 * j + (i & 1);
                bool ok = r < rows && key <= p + row0 + r;
                float pr = ok ? expf(sc[n][i] - (i >= 2 ? lse8 : lse0)) : 0.0f;
                sc[n][i] = pr * (dp[n][i] - (i >= 2 ? dl8 : dl0));
            }
        }
        // dQ += dS·K
        #pragma unroll
        for (int kk = 0; kk < TC_COLS / 16; ++kk) {
            unsigned int sa[4];
            acc_to_a(sa, sc[2 * kk], sc[2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int bf[2];
                b_as_is<D>(bf, ks, 16 * kk, 8 * n);
                mma_bf16(acc[n], sa, bf);
            }
        }
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = g + 8 * half;
        if (r >= rows) continue;
        float* out = dq + ((size_t)b * s + row0 + r) * (h_count * D) + h * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            out[8 * n + 2 * j] = acc[n][2 * half] * scale;
            out[8 * n + 2 * j + 1] = acc[n][2 * half + 1] * scale;
        }
    }
}

// dK, dV on tensor cores: each warp owns 16 key positions of 0..L and walks the queries that see
// them in tiles of TC_COLS; written, or added to with `accumulate`, like the FP32 kernel.
template <int D>
__device__ void attn_tc_backward_dkdv(float* dk, float* dv, const float* q, const float* k, const float* v,
                                      const float* dy, const float* lse, const float* delta, int b_count,
                                      int h_count, int s, int p, int q_stride, int kv_stride, int kv_rows,
                                      int accumulate, float scale) {
    __shared__ __align__(16) unsigned short qs[TC_COLS][D + TC_PAD];
    __shared__ __align__(16) unsigned short ds_[TC_COLS][D + TC_PAD];
    __shared__ float ls[TC_COLS];
    __shared__ float dl[TC_COLS];
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int L = p + s;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int key0 = blockIdx.x * TC_ROWS + warp * 16;  // this warp's first key
    int rows = max(0, min(16, L - key0));
    int first = min(key0, L - 1);
    unsigned int ka[D / 16][4], va[D / 16][4];
    load_a_rows<D>(ka, k + ((size_t)b * kv_rows + first) * kv_stride + h * D, kv_stride, rows, 1.0f);
    load_a_rows<D>(va, v + ((size_t)b * kv_rows + first) * kv_stride + h * D, kv_stride, rows, 1.0f);
    float adk[D / 8][4] = {}, adv[D / 8][4] = {};
    // First query any key of this block is seen by: t = l_first - P (at least 0).
    int t_start = max(0, (int)blockIdx.x * TC_ROWS - p);
    int warp_first = rows > 0 ? max(0, key0 - p) : s;  // first query that sees a key of this warp
    const float* qb = q + (size_t)b * s * q_stride + h * D;
    const float* db = dy + (size_t)b * s * (h_count * D) + h * D;
    size_t stat = ((size_t)b * h_count + h) * s;
    for (int t0 = t_start; t0 < s; t0 += TC_COLS) {
        __syncthreads();
        load_tile_bf16<D>(qs, qb + (size_t)t0 * q_stride, q_stride, 0, s - t0, scale);
        load_tile_bf16<D>(ds_, db + (size_t)t0 * (h_count * D), (size_t)h_count * D, 0, s - t0, 1.0f);
        for (int r = threadIdx.x; r < TC_COLS; r += TC_THREADS) {
            bool ok = t0 + r < s;
            ls[r] = ok ? lse[stat + t0 + r] : 0.0f;
            dl[r] = ok ? delta[stat + t0 + r] : 0.0f;
        }
        __syncthreads();
        if (t0 + TC_COLS <= warp_first) continue;
        float pt[TC_COLS / 8][4] = {}, dpt[TC_COLS / 8][4] = {};  // P^T, dP^T: rows keys, columns queries
        #pragma unroll
        for (int n = 0; n < TC_COLS / 8; ++n) {
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int qf[2], df[2];
                b_transposed<D>(qf, qs, 8 * n, 16 * kk);
                b_transposed<D>(df, ds_, 8 * n, 16 * kk);
                mma_bf16(pt[n], ka[kk], qf);
                mma_bf16(dpt[n], va[kk], df);
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = g + (i >= 2 ? 8 : 0), c = 8 * n + 2 * j + (i & 1), t = t0 + c;
                bool ok = r < rows && t < s && key0 + r <= p + t;
                float pr = ok ? expf(pt[n][i] - ls[c]) : 0.0f;
                pt[n][i] = pr;
                dpt[n][i] = pr * (dpt[n][i] - dl[c]);  // dS^T
            }
        }
        // dV += P^T·dO, dK += dS^T·(scale q)
        #pragma unroll
        for (int kk = 0; kk < TC_COLS / 16; ++kk) {
            unsigned int pa[4], sa[4];
            acc_to_a(pa, pt[2 * kk], pt[2 * kk + 1]);
            acc_to_a(sa, dpt[2 * kk], dpt[2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int dof[2], qf[2];
                b_as_is<D>(dof, ds_, 16 * kk, 8 * n);
                b_as_is<D>(qf, qs, 16 * kk, 8 * n);
                mma_bf16(adv[n], pa, dof);
                mma_bf16(adk[n], sa, qf);
            }
        }
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = g + 8 * half;
        if (r >= rows) continue;
        size_t at = ((size_t)b * kv_rows + key0 + r) * (h_count * D) + h * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                size_t i = at + 8 * n + 2 * j + e;
                float gk = adk[n][2 * half + e], gv = adv[n][2 * half + e];
                dk[i] = accumulate ? dk[i] + gk : gk;
                dv[i] = accumulate ? dv[i] + gv : gv;
            }
    }
}

#define ATTN_TC_INSTANCES(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc_forward_d##D(                        \
        float* y, float* lse, const float* q, const float* k, const float* v, int b, int h, int s, int p,   \
        int q_stride, int kv_stride, int kv_rows, float scale) {                                           \
        attn_tc_forward<D>(y, lse, q, k, v, b, h, s, p, q_stride, kv_stride, kv_rows, scale);              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc_backward_dq_d##D(                    \
        float* dq, const float* q, const float* k, const float* v, const float* dy, const float* lse,      \
        const float* delta, int b, int h, int s, int p, int q_stride, int kv_stride, int kv_rows,          \
        float scale) {                                                                                     \
        attn_tc_backward_dq<D>(dq, q, k, v, dy, lse, delta, b, h, s, p, q_stride, kv_stride, kv_rows,      \
                               scale);                                                                     \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc_backward_dkdv_d##D(                  \
        float* dk, float* dv, const float* q, const float* k, const float* v, const float* dy,             \
        const float* lse, const float* delta, int b, int h, int s, int p, int q_stride, int kv_stride,     \
        int kv_rows, int accumulate, float scale) {                                                        \
        attn_tc_backward_dkdv<D>(dk, dv, q, k, v, dy, lse, delta, b, h, s, p, q_stride, kv_stride,         \
                                 kv_rows, accumulate, scale);                                              \
    }

ATTN_TC_INSTANCES(16)
ATTN_TC_INSTANCES(32)
ATTN_TC_INSTANCES(64)
ATTN_TC_INSTANCES(128)

// ---------------------------------------------------------------------------------------------
// Attention v2 on tensor cores (`SEQPIPE_ATTENTION=v2`): the same contract as the attn_tc_ kernels
// above (arguments, layouts, outputs, masks, dK/dV accumulation), rebuilt for speed:
// - every shared tile is stored in the layout its fragments read, so every B fragment is two 32-bit
//   shared loads: a tile read "as is" by a product (V in P·V, K in dS·K, Q and dO in dK/dV) is kept
//   transposed as well, written once per block and read by all four warps;
// - fp32 rows are read with 16-byte loads (the host checks that rows are 16-byte aligned) and
//   rounded to bf16 two at a time (cvt.rn.bf16x2 on compute capability 8.0 and later: round to
//   nearest even, like bf16_bits);
// - the forward gives each warp MT m-tiles of 16 queries (two for D <= 64), so each K/V fragment
//   loaded from shared memory feeds MT products;
// - the causal mask is applied only on tiles that cross the diagonal (or hold a tail), and the
//   exponentials are exp2 of one fused multiply-add;
// - query blocks run heaviest first (the last queries see the most keys);
// - document masks (`docs`, as the FP32 kernels take them): a tile is masked element by element
//   only where it holds a key before the last document start of the warp's (or m-tile's)
//   queries, and tiles wholly before the first one are neither loaded nor multiplied.
// Each output element is still one thread's fixed-order sum: no atomics, bit-identical run to run.

#define LOG2E 1.4426950408889634f

// Forward: m-tiles of 16 queries per warp, and keys per shared tile, by head width (the registers
// of MT × D/8 accumulators and the 48 KiB of static shared memory bound them).
template <int D> struct V2Shape {
    static constexpr int MT = D <= 64 ? 2 : 1;
    static constexpr int BK = D <= 64 ? 64 : 32;  // keys per tile (forward, dQ), queries (dK/dV)
};

// Two floats as two bf16 in one register, `lo` in bits 0..15 (round to nearest even).
__device__ __forceinline__ unsigned int pack2_bf16(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack_bf16(lo, hi);
#endif
}

// Four floats at a 16-byte aligned address.
__device__ __forceinline__ void load4(const float* p, float* x) {
#if defined(__CUDA_ARCH__)
    float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
#else
    x[0] = p[0]; x[1] = p[1]; x[2] = p[2]; x[3] = p[3];
#endif
}

// One 32-bit word into a shared bf16 tile at an even index.
__device__ __forceinline__ void store_pair(unsigned short* p, unsigned int w) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<unsigned int*>(p) = w;
#else
    p[0] = (unsigned short)(w & 0xffffu);
    p[1] = (unsigned short)(w >> 16);
#endif
}

// B fragment of a shared bf16 tile `t` with rows of W elements: B(k, n) = t[n0 + n][k0 + k].
template <int W>
__device__ __forceinline__ void frag_b(unsigned int* b, const unsigned short* t, int n0, int k0) {
    int g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    const unsigned short* row = t + (n0 + g) * W + k0 + 2 * j;
    b[0] = pair_at(row);
    b[1] = pair_at(row + 8);
}

// Rows 0..R of an fp32 matrix (row r at src + r * stride, 16-byte aligned; zeros from row `count`
// on), each element times `mul`, into shared bf16: `normal` (R × (D + TC_PAD), as it lies) and/or
// `trans` (D × (R + TC_PAD), transposed). A thread takes two rows of four columns at a time, so
// the transposed tile gets whole 32-bit words; a warp's 32 lanes take 16 columns of 8 row pairs
// (64 contiguous bytes per row: whole 32-byte sectors, and at most 2-way bank conflicts when the
// transposed words are stored).
template <int D, int R>
__device__ __forceinline__ void load_tile_v2(unsigned short* normal, unsigned short* trans, const float* src,
                                             size_t stride, int count, float mul) {
    constexpr int C4 = D / 4;  // groups of four columns: a multiple of 4 (D is one of 16)
    for (int idx = threadIdx.x; idx < (R / 2) * C4; idx += TC_THREADS) {
        int rest = idx / 4;
        int r = 2 * (rest % (R / 2)), c = 4 * (4 * (rest / (R / 2)) + idx % 4);
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (r < count) load4(src + (size_t)r * stride + c, a);
        if (r + 1 < count) load4(src + (size_t)(r + 1) * stride + c, b);
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            a[i] *= mul;
            b[i] *= mul;
        }
        if (normal) {
            store_pair(normal + r * (D + TC_PAD) + c, pack2_bf16(a[0], a[1]));
            store_pair(normal + r * (D + TC_PAD) + c + 2, pack2_bf16(a[2], a[3]));
            store_pair(normal + (r + 1) * (D + TC_PAD) + c, pack2_bf16(b[0], b[1]));
            store_pair(normal + (r + 1) * (D + TC_PAD) + c + 2, pack2_bf16(b[2], b[3]));
        }
        if (trans) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) store_pair(trans + (c + i) * (R + TC_PAD) + r, pack2_bf16(a[i], b[i]));
        }
    }
}

// An A fragment from two n-tiles of fp32 accumulators (as acc_to_a).
__device__ __forceinline__ void acc_to_a_v2(unsigned int* a, const float* lo, const float* hi) {
    a[0] = pack2_bf16(lo[0], lo[1]);
    a[1] = pack2_bf16(lo[2], lo[3]);
    a[2] = pack2_bf16(hi[0], hi[1]);
    a[3] = pack2_bf16(hi[2], hi[3]);
}

template <int D>
__device__ void attn_tc2_forward(float* y, float* lse, const float* q, const float* k, const float* v,
                                 const unsigned int* docs, int b_count, int h_count, int s, int p, int q_stride,
                                 int kv_stride, int kv_rows, float scale) {
    constexpr int MT = V2Shape<D>::MT, BK = V2Shape<D>::BK, ROWS = 4 * 16 * MT;
    __shared__ __align__(16) unsigned short ks[BK * (D + TC_PAD)];   // K, as it lies (keys × D)
    __shared__ __align__(16) unsigned short vt[D * (BK + TC_PAD)];   // Vᵀ (D × keys)
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int blk = gridDim.x - 1 - blockIdx.x;  // heaviest (last) queries first
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int row0[MT], rows[MT];
    // Document starts: of rows g and g + 8 of each m-tile, of its first and last rows.
    int lo0[MT], lo8[MT], lo_first[MT], lo_last[MT];
    unsigned int qa[MT][D / 16][4];
    float o[MT][D / 8][4], m0[MT], m8[MT], l0[MT], l8[MT];  // rows g and g + 8 of each m-tile
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row0[mt] = blk * ROWS + warp * 16 * MT + 16 * mt;
        rows[mt] = max(0, min(16, s - row0[mt]));
        load_a_rows<D>(qa[mt], q + ((size_t)b * s + min(row0[mt], s - 1)) * q_stride + h * D, q_stride, rows[mt],
                       scale);
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        m0[mt] = m8[mt] = -INFINITY;
        l0[mt] = l8[mt] = 0.0f;
        lo0[mt] = g < rows[mt] ? doc_start(docs, b, kv_rows, p + row0[mt] + g) : 0;
        lo8[mt] = g + 8 < rows[mt] ? doc_start(docs, b, kv_rows, p + row0[mt] + g + 8) : 0;
        lo_first[mt] = rows[mt] > 0 ? doc_start(docs, b, kv_rows, p + row0[mt]) : 0;
        lo_last[mt] = rows[mt] > 0 ? doc_start(docs, b, kv_rows, p + row0[mt] + rows[mt] - 1) : 0;
    }
    int t_last = min(s, (blk + 1) * ROWS) - 1;
    int keys = p + t_last + 1;
    // Keys this warp's queries see (its last m-tile's rows are its last queries), from warp_lo.
    int warp_keys = rows[0] > 0 ? p + min(s, row0[0] + 16 * MT) : 0;
    int warp_lo = lo_first[0];
    const float* kb = k + (size_t)b * kv_rows * kv_stride + h * D;
    const float* vb = v + (size_t)b * kv_rows * kv_stride + h * D;
    for (int k0 = doc_start(docs, b, kv_rows, p + blk * ROWS); k0 < keys; k0 += BK) {
        __syncthreads();
        load_tile_v2<D, BK>(ks, nullptr, kb + (size_t)k0 * kv_stride, kv_stride, keys - k0, 1.0f);
        load_tile_v2<D, BK>(nullptr, vt, vb + (size_t)k0 * kv_stride, kv_stride, keys - k0, 1.0f);
        __syncthreads();
        if (k0 >= warp_keys || k0 + BK <= warp_lo) continue;
        float sc[MT][BK / 8][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int n = 0; n < BK / 8; ++n) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.0f;
        #pragma unroll
        for (int n = 0; n < BK / 8; ++n)
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int bf[2];
                frag_b<D + TC_PAD>(bf, ks, 8 * n, 16 * kk);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(sc[mt][n], qa[mt][kk], bf);
            }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // No query of this m-tile sees these keys.
            if (k0 >= p + row0[mt] + rows[mt] || k0 + BK <= lo_first[mt]) {
                #pragma unroll
                for (int n = 0; n < BK / 8; ++n) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.0f;
                continue;
            }
            float mx0 = -INFINITY, mx8 = -INFINITY;
            // Causal mask (query row0 + r sees keys 0..=p + row0 + r), only where a key of the tile
            // lies past the m-tile's first query's last key, or the m-tile is a tail; document
            // mask (keys from the query's document start), only where a key lies before the
            // m-tile's last start.
            bool mask = k0 + BK - 1 > p + row0[mt] || rows[mt] < 16 || k0 < lo_last[mt];
            #pragma unroll
            for (int n = 0; n < BK / 8; ++n)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (mask) {
                        int r = g + (i >= 2 ? 8 : 0), key = k0 + 8 * n + 2 * j + (i & 1);
                        bool ok = r < rows[mt] && key <= p + row0[mt] + r && key >= (i >= 2 ? lo8[mt] : lo0[mt]);
                        sc[mt][n][i] = ok ? sc[mt][n][i] : -INFINITY;
                    }
                    if (i < 2) mx0 = fmaxf(mx0, sc[mt][n][i]); else mx8 = fmaxf(mx8, sc[mt][n][i]);
                }
            float n0 = fmaxf(m0[mt], quad_max(mx0)), n8 = fmaxf(m8[mt], quad_max(mx8));
            // A row that has seen no key yet keeps m = -inf: its probabilities are 0, not NaN.
            float c0 = n0 == -INFINITY ? 1.0f : exp2f((m0[mt] - n0) * LOG2E);
            float c8 = n8 == -INFINITY ? 1.0f : exp2f((m8[mt] - n8) * LOG2E);
            float base0 = n0 == -INFINITY ? 0.0f : -n0 * LOG2E, base8 = n8 == -INFINITY ? 0.0f : -n8 * LOG2E;
            l0[mt] *= c0;
            l8[mt] *= c8;
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[mt][n][0] *= c0; o[mt][n][1] *= c0; o[mt][n][2] *= c8; o[mt][n][3] *= c8;
            }
            #pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                sc[mt][n][0] = exp2f(fmaf(sc[mt][n][0], LOG2E, base0));
                sc[mt][n][1] = exp2f(fmaf(sc[mt][n][1], LOG2E, base0));
                sc[mt][n][2] = exp2f(fmaf(sc[mt][n][2], LOG2E, base8));
                sc[mt][n][3] = exp2f(fmaf(sc[mt][n][3], LOG2E, base8));
                l0[mt] += sc[mt][n][0] + sc[mt][n][1];
                l8[mt] += sc[mt][n][2] + sc[mt][n][3];
            }
            m0[mt] = n0;
            m8[mt] = n8;
        }
        // o += P·V, P (16 × BK per m-tile) straight from the score accumulators; B = V from Vᵀ.
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned int pa[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) acc_to_a_v2(pa[mt], sc[mt][2 * kk], sc[mt][2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int bf[2];
                frag_b<BK + TC_PAD>(bf, vt, 8 * n, 16 * kk);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(o[mt][n], pa[mt], bf);
            }
        }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float s0 = quad_sum(l0[mt]), s8 = quad_sum(l8[mt]);
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            int r = g + 8 * half;
            if (r >= rows[mt]) continue;
            float l = half ? s8 : s0, m = half ? m8[mt] : m0[mt], inv = 1.0f / l;
            float* yrow = y + ((size_t)b * s + row0[mt] + r) * (h_count * D) + h * D;
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                yrow[8 * n + 2 * j] = o[mt][n][2 * half] * inv;
                yrow[8 * n + 2 * j + 1] = o[mt][n][2 * half + 1] * inv;
            }
            if (j == 0) lse[((size_t)b * h_count + h) * s + row0[mt] + r] = m + logf(l);
        }
    }
}

// delta[b, h, t] = Σ_e dy·y over one row of a head: one warp per row, lanes over e (coalesced),
// summed by the fixed butterfly of warp_sum. Blocks of TC_THREADS (4 rows).
extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc2_backward_delta(float* delta, const float* dy,
                                                                                const float* y, int b_count,
                                                                                int h_count, int s, int d) {
    long long row = (long long)blockIdx.x * (TC_THREADS / 32) + threadIdx.x / 32;
    long long total = (long long)b_count * h_count * s;
    int lane = threadIdx.x % 32;
    long long rr = row < total ? row : 0;
    int t = rr % s;
    int h = (rr / s) % h_count;
    long long b = rr / ((long long)s * h_count);
    const float* a = dy + ((size_t)b * s + t) * (h_count * d) + h * d;
    const float* c = y + ((size_t)b * s + t) * (h_count * d) + h * d;
    float acc = 0.0f;
    for (int e = lane; e < d; e += 32) acc += a[e] * c[e];
    acc = warp_sum(acc);
    if (row < total && lane == 0) delta[row] = acc;
}

// dQ: each warp owns 16 queries (blocks of 64, heaviest first) and walks the visible keys in
// tiles of BK: K (for S = QKᵀ), Kᵀ (for dQ += dS·K) and V (for dP = dO·Vᵀ) in shared memory.
template <int D>
__device__ void attn_tc2_backward_dq(float* dq, const float* q, const float* k, const float* v, const float* dy,
                                     const float* lse, const float* delta, const unsigned int* docs, int b_count,
                                     int h_count, int s, int p, int q_stride, int kv_stride, int kv_rows,
                                     float scale) {
    constexpr int BK = V2Shape<D>::BK;
    __shared__ __align__(16) unsigned short ks[BK * (D + TC_PAD)];
    __shared__ __align__(16) unsigned short kt[D * (BK + TC_PAD)];
    __shared__ __align__(16) unsigned short vs[BK * (D + TC_PAD)];
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int blk = gridDim.x - 1 - blockIdx.x;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int row0 = blk * TC_ROWS + warp * 16;
    int rows = max(0, min(16, s - row0));
    int first = min(row0, s - 1);
    unsigned int qa[D / 16][4], da[D / 16][4];
    load_a_rows<D>(qa, q + ((size_t)b * s + first) * q_stride + h * D, q_stride, rows, scale);
    load_a_rows<D>(da, dy + ((size_t)b * s + first) * (h_count * D) + h * D, (size_t)h_count * D, rows, 1.0f);
    size_t stat = ((size_t)b * h_count + h) * s;
    // -lse·log2(e) and delta of rows g and g + 8.
    float nl0 = g < rows ? -lse[stat + row0 + g] * LOG2E : 0.0f;
    float nl8 = g + 8 < rows ? -lse[stat + row0 + g + 8] * LOG2E : 0.0f;
    float dl0 = g < rows ? delta[stat + row0 + g] : 0.0f, dl8 = g + 8 < rows ? delta[stat + row0 + g + 8] : 0.0f;
    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    int t_last = min(s, (blk + 1) * TC_ROWS) - 1;
    int keys = p + t_last + 1;
    int warp_keys = rows > 0 ? p + row0 + rows : 0;
    // Document starts of rows g and g + 8, and of the warp's first and last rows.
    int lo0 = g < rows ? doc_start(docs, b, kv_rows, p + row0 + g) : 0;
    int lo8 = g + 8 < rows ? doc_start(docs, b, kv_rows, p + row0 + g + 8) : 0;
    int warp_lo = rows > 0 ? doc_start(docs, b, kv_rows, p + row0) : 0;
    int warp_lo_last = rows > 0 ? doc_start(docs, b, kv_rows, p + row0 + rows - 1) : 0;
    const float* kb = k + (size_t)b * kv_rows * kv_stride + h * D;
    const float* vb = v + (size_t)b * kv_rows * kv_stride + h * D;
    for (int k0 = doc_start(docs, b, kv_rows, p + blk * TC_ROWS); k0 < keys; k0 += BK) {
        __syncthreads();
        load_tile_v2<D, BK>(ks, kt, kb + (size_t)k0 * kv_stride, kv_stride, keys - k0, 1.0f);
        load_tile_v2<D, BK>(vs, nullptr, vb + (size_t)k0 * kv_stride, kv_stride, keys - k0, 1.0f);
        __syncthreads();
        if (k0 >= warp_keys || k0 + BK <= warp_lo) continue;
        bool mask = k0 + BK - 1 > p + row0 || rows < 16 || k0 < warp_lo_last;
        float sc[BK / 8][4], dp[BK / 8][4];
        #pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int kf[2], vf[2];
                frag_b<D + TC_PAD>(kf, ks, 8 * n, 16 * kk);
                frag_b<D + TC_PAD>(vf, vs, 8 * n, 16 * kk);
                mma_bf16(sc[n], qa[kk], kf);
                mma_bf16(dp[n], da[kk], vf);
            }
            // dS = P ∘ (dP − delta), P = exp(S − lse) where visible, else 0.
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                bool ok = true;
                if (mask) {
                    int r = g + (i >= 2 ? 8 : 0), key = k0 + 8 * n + 2 * j + (i & 1);
                    ok = r < rows && key <= p + row0 + r && key >= (i >= 2 ? lo8 : lo0);
                }
                float pr = ok ? exp2f(fmaf(sc[n][i], LOG2E, i >= 2 ? nl8 : nl0)) : 0.0f;
                sc[n][i] = pr * (dp[n][i] - (i >= 2 ? dl8 : dl0));
            }
        }
        // dQ += dS·K, B(key, e) = K[key][e] = Kᵀ[e][key].
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned int sa[4];
            acc_to_a_v2(sa, sc[2 * kk], sc[2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int bf[2];
                frag_b<BK + TC_PAD>(bf, kt, 8 * n, 16 * kk);
                mma_bf16(acc[n], sa, bf);
            }
        }
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = g + 8 * half;
        if (r >= rows) continue;
        float* out = dq + ((size_t)b * s + row0 + r) * (h_count * D) + h * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            out[8 * n + 2 * j] = acc[n][2 * half] * scale;
            out[8 * n + 2 * j + 1] = acc[n][2 * half + 1] * scale;
        }
    }
}

// dK, dV: each warp owns 16 key positions of 0..L (blocks of 64) and walks the queries that see
// them in tiles of BQ = V2Shape::BK: Q and dO as they lie (for Pᵀ = K·Qᵀ, dPᵀ = V·dOᵀ) and
// transposed (for dK += dSᵀ·Q, dV += Pᵀ·dO); written, or added to with `accumulate`.
template <int D>
__device__ void attn_tc2_backward_dkdv(float* dk, float* dv, const float* q, const float* k, const float* v,
                                       const float* dy, const float* lse, const float* delta,
                                       const unsigned int* docs, int b_count, int h_count, int s, int p,
                                       int q_stride, int kv_stride, int kv_rows, int accumulate, float scale) {
    constexpr int BQ = V2Shape<D>::BK;
    __shared__ __align__(16) unsigned short qs[BQ * (D + TC_PAD)];
    __shared__ __align__(16) unsigned short qt[D * (BQ + TC_PAD)];
    __shared__ __align__(16) unsigned short ds_[BQ * (D + TC_PAD)];
    __shared__ __align__(16) unsigned short dt[D * (BQ + TC_PAD)];
    __shared__ float nls[BQ];  // -lse·log2(e)
    __shared__ float dl[BQ];
    __shared__ int los[BQ];  // document starts of the tile's queries
    int bh = blockIdx.y, b = bh / h_count, h = bh % h_count;
    int L = p + s;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, j = threadIdx.x % 4;
    int key0 = blockIdx.x * TC_ROWS + warp * 16;  // this warp's first key
    int rows = max(0, min(16, L - key0));
    int first = min(key0, L - 1);
    unsigned int ka[D / 16][4], va[D / 16][4];
    load_a_rows<D>(ka, k + ((size_t)b * kv_rows + first) * kv_stride + h * D, kv_stride, rows, 1.0f);
    load_a_rows<D>(va, v + ((size_t)b * kv_rows + first) * kv_stride + h * D, kv_stride, rows, 1.0f);
    float adk[D / 8][4], adv[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i) adk[n][i] = adv[n][i] = 0.0f;
    // First query any key of this block is seen by: t = l_first - P (at least 0).
    int t_start = max(0, (int)blockIdx.x * TC_ROWS - p);
    int warp_first = rows > 0 ? max(0, key0 - p) : s;  // first query that sees a key of this warp
    const float* qb = q + (size_t)b * s * q_stride + h * D;
    const float* db = dy + (size_t)b * s * (h_count * D) + h * D;
    size_t stat = ((size_t)b * h_count + h) * s;
    int block_last = min(L, ((int)blockIdx.x + 1) * TC_ROWS) - 1;  // this block's last key
    for (int t0 = t_start; t0 < s; t0 += BQ) {
        // Queries from here on start their documents after every key of the block (uniform).
        if (doc_start(docs, b, kv_rows, p + t0) > block_last) break;
        __syncthreads();
        load_tile_v2<D, BQ>(qs, qt, qb + (size_t)t0 * q_stride, q_stride, s - t0, scale);
        load_tile_v2<D, BQ>(ds_, dt, db + (size_t)t0 * (h_count * D), (size_t)h_count * D, s - t0, 1.0f);
        for (int r = threadIdx.x; r < BQ; r += TC_THREADS) {
            bool ok = t0 + r < s;
            nls[r] = ok ? -lse[stat + t0 + r] * LOG2E : 0.0f;
            dl[r] = ok ? delta[stat + t0 + r] : 0.0f;
            los[r] = ok ? doc_start(docs, b, kv_rows, p + t0 + r) : 0;
        }
        __syncthreads();
        if (t0 + BQ <= warp_first || (rows > 0 && los[0] > key0 + rows - 1)) continue;
        // Every key of this warp is seen by every query of the tile (a full tile whose last
        // query's document starts at or before the warp's first key): no mask.
        bool mask = key0 + 15 > p + t0 || t0 + BQ > s || rows < 16 || los[BQ - 1] > key0;
        float pt[BQ / 8][4], dpt[BQ / 8][4];  // Pᵀ, dPᵀ: rows keys, columns queries
        #pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) pt[n][i] = dpt[n][i] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned int qf[2], df[2];
                frag_b<D + TC_PAD>(qf, qs, 8 * n, 16 * kk);
                frag_b<D + TC_PAD>(df, ds_, 8 * n, 16 * kk);
                mma_bf16(pt[n], ka[kk], qf);
                mma_bf16(dpt[n], va[kk], df);
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                int c = 8 * n + 2 * j + (i & 1);
                bool ok = true;
                if (mask) {
                    int r = g + (i >= 2 ? 8 : 0), t = t0 + c;
                    ok = r < rows && t < s && key0 + r <= p + t && los[c] <= key0 + r;
                }
                float pr = ok ? exp2f(fmaf(pt[n][i], LOG2E, nls[c])) : 0.0f;
                pt[n][i] = pr;
                dpt[n][i] = pr * (dpt[n][i] - dl[c]);  // dSᵀ
            }
        }
        // dV += Pᵀ·dO, dK += dSᵀ·(scale q): B(query, e) from the transposed tiles.
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            unsigned int pa[4], sa[4];
            acc_to_a_v2(pa, pt[2 * kk], pt[2 * kk + 1]);
            acc_to_a_v2(sa, dpt[2 * kk], dpt[2 * kk + 1]);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned int dof[2], qf[2];
                frag_b<BQ + TC_PAD>(dof, dt, 8 * n, 16 * kk);
                frag_b<BQ + TC_PAD>(qf, qt, 8 * n, 16 * kk);
                mma_bf16(adv[n], pa, dof);
                mma_bf16(adk[n], sa, qf);
            }
        }
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = g + 8 * half;
        if (r >= rows) continue;
        size_t at = ((size_t)b * kv_rows + key0 + r) * (h_count * D) + h * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                size_t i = at + 8 * n + 2 * j + e;
                float gk = adk[n][2 * half + e], gv = adv[n][2 * half + e];
                dk[i] = accumulate ? dk[i] + gk : gk;
                dv[i] = accumulate ? dv[i] + gv : gv;
            }
    }
}

#define ATTN_TC2_INSTANCES(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc2_forward_d##D(                       \
        float* y, float* lse, const float* q, const float* k, const float* v, const unsigned int* docs,     \
        int b, int h, int s, int p, int q_stride, int kv_stride, int kv_rows, float scale) {               \
        attn_tc2_forward<D>(y, lse, q, k, v, docs, b, h, s, p, q_stride, kv_stride, kv_rows, scale);       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc2_backward_dq_d##D(                   \
        float* dq, const float* q, const float* k, const float* v, const float* dy, const float* lse,      \
        const float* delta, const unsigned int* docs, int b, int h, int s, int p, int q_stride,            \
        int kv_stride, int kv_rows, float scale) {                                                         \
        attn_tc2_backward_dq<D>(dq, q, k, v, dy, lse, delta, docs, b, h, s, p, q_stride, kv_stride,        \
                                kv_rows, scale);                                                           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_tc2_backward_dkdv_d##D(                 \
        float* dk, float* dv, const float* q, const float* k, const float* v, const float* dy,             \
        const float* lse, const float* delta, const unsigned int* docs, int b, int h, int s, int p,        \
        int q_stride, int kv_stride, int kv_rows, int accumulate, float scale) {                           \
        attn_tc2_backward_dkdv<D>(dk, dv, q, k, v, dy, lse, delta, docs, b, h, s, p, q_stride, kv_stride,  \
                                  kv_rows, accumulate, scale);                                             \
    }

ATTN_TC2_INSTANCES(16)
ATTN_TC2_INSTANCES(32)
ATTN_TC2_INSTANCES(64)
ATTN_TC2_INSTANCES(128)

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy over a chunk of logits, in place: one block per row. logits (R, V) become
// grad_scale * (softmax - onehot(target)); loss[r] = logsumexp - logit[target].
// Rows are `ld >= v` floats apart (the BF16 head's padded vocabulary): only the first v columns are
// read; with want_grad the padded columns v..ld are set to 0, so a product over the padded width
// adds exact zeros for them.
extern "C" __global__ void softmax_cross_entropy(float* logits, float* loss, const unsigned int* targets, int v,
                                                 int ld, float grad_scale, int want_grad) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    float* row = logits + (size_t)r * ld;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) sum += expf(row[j] - mx);
    sum = block_sum(sum, scratch);
    float lse = mx + logf(sum);
    unsigned int tgt = targets[r];
    // A target outside the vocabulary would read past the row: its loss is NaN instead.
    if (threadIdx.x == 0) loss[r] = tgt < (unsigned int)v ? lse - row[tgt] : __int_as_float(0x7fc00000);
    __syncthreads();
    if (!want_grad) return;
    float inv = 1.0f / sum;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float pr = expf(row[j] - mx) * inv;
        row[j] = grad_scale * (pr - (j == (int)tgt ? 1.0f : 0.0f));
    }
    for (int j = v + threadIdx.x; j < ld; j += blockDim.x) row[j] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Optimizer and gradient norm.

// AdamW, one pass (ops/src/adamw.rs): g = grad * grad_scale; m, v updated; p = p * decay - lr_bc1 * m /
// (sqrt(v * inv_bc2) + eps). `one_b1`, `one_b2` are 1 - beta1, 1 - beta2 rounded once from f64 on the
// host, as the CPU's (1.0f - beta1 in f32 would differ in the last bits).
extern "C" __global__ void adamw(float* p, float* m, float* v, const float* grad, long long n, float grad_scale,
                                 float beta1, float beta2, float one_b1, float one_b2, float eps, float inv_bc2,
                                 float lr_bc1, float decay) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = grad[i] * grad_scale;
    float mi = beta1 * m[i] + one_b1 * g;
    float vi = beta2 * v[i] + one_b2 * (g * g);
    float upd = mi * lr_bc1 / (sqrtf(vi * inv_bc2) + eps);
    p[i] = p[i] * decay - upd;
    m[i] = mi;
    v[i] = vi;
}

// Sum of squares in two passes, in double: partial[blk] over a grid-stride loop of a fixed grid
// size, then one block sums the partials in a fixed tree.
extern "C" __global__ void sum_squares_partial(double* partial, const float* x, long long n) {
    __shared__ double sh[256];
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        double xi = x[i];
        acc += xi * xi;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

extern "C" __global__ void sum_squares_finish(double* out, const double* partial, int count) {
    __shared__ double sh[256];
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = sh[0];
}
