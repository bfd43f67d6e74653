// Every kernel of gpu/src/kernels.cu run on the CPU (cuda_shim.h) against double-precision
// references written out here, at the shapes the GPU stage uses (the attention in its K/V-cache
// layout with q_stride = 3C, tails that are not multiples of the block sizes, GPT-2 vocabulary
// rows). Outputs start as NaN so that an element a kernel forgets to write fails. Prints one line
// per output and exits non-zero on any failure. Run by gpu/tests/emulated_kernels.rs.
#include "cuda_shim.h"
#include "../src/kernels.cu"
#include <cstdio>
#include <random>
#include <string>
typedef std::vector<float> V;
static std::mt19937 rng(1);
V rnd(size_t n, float s = 1.f) { std::uniform_real_distribution<float> u(-s, s); V v(n); for (auto& x : v) x = u(rng); return v; }
int fails = 0;
void cmp(const std::string& what, const float* a, const std::vector<double>& b, double bound = 1e-5) {
    double num = 0, den = 0; bool nan = false; size_t worst = 0; double we = 0;
    for (size_t i = 0; i < b.size(); ++i) { double d = a[i] - b[i]; if (!std::isfinite(a[i])) nan = true; num += d * d; den += b[i] * b[i]; if (std::fabs(d) > we) { we = std::fabs(d); worst = i; } }
    double rel = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
    bool ok = !nan && rel <= bound;
    if (!ok) ++fails;
    printf("%s %-60s rel %.3g%s (worst at %zu: %g vs %g)\n", ok ? "ok  " : "FAIL", what.c_str(), rel, nan ? " NaN" : "", worst, b.empty() ? 0.0 : (double)a[worst], b.empty() ? 0.0 : b[worst]);
}
dim3 G(unsigned x, unsigned y = 1) { return dim3{x, y, 1}; }
unsigned nb(size_t t) { return (t + 255) / 256; }

// ----- attention in the stage's layout
// `tc`: the tensor-core kernels (bf16 operands), within `bound` of the double reference; with
// `v2` their second version (attn_tc2_*, `SEQPIPE_ATTENTION=v2`), whose forward blocks hold 128
// queries for D <= 64 (so tails of 128-query blocks are exercised too). `docs` (not for v1): per
// sequence and position of the cache, its document's start (the kernels' document mask).
void attention(int d, int s, int p, int seq, bool tc = false, double bound = 1e-5, int b = 2, int h = 3, bool v2 = false,
               const std::vector<unsigned>* docs = nullptr) {
    const unsigned* dd = docs ? docs->data() : nullptr;
    auto lo_of = [&](int bi, int pos) { return docs ? (int)(*docs)[(size_t)bi * seq + pos] : 0; };
    unsigned rows_per_block = 64, threads = tc ? 128 : 64;
    unsigned fwd_rows = v2 && d <= 64 ? 128 : rows_per_block;
    int c = h * d, L = p + s, n = b * s;
    float scale = 1.0f / std::sqrt((float)d);
    V full = rnd((size_t)b * seq * 3 * c);        // Q,K,V of whole sequences (rows of 3C)
    V qkv((size_t)n * 3 * c);                      // the segment's rows
    for (int bi = 0; bi < b; ++bi) for (int t = 0; t < s; ++t) for (int j = 0; j < 3 * c; ++j)
        qkv[((size_t)bi * s + t) * 3 * c + j] = full[((size_t)bi * seq + p + t) * 3 * c + j];
    V cache((size_t)b * seq * 3 * c, 7.0f);
    for (int bi = 0; bi < b; ++bi) for (int l = 0; l < p; ++l) for (int j = 0; j < 3 * c; ++j)
        cache[((size_t)bi * seq + l) * 3 * c + j] = full[((size_t)bi * seq + l) * 3 * c + j];
    launch(G(nb((size_t)b * s * 3 * c)), 256, [&] { copy_rows(cache.data(), qkv.data(), b, s, 3 * c, seq, p, s, 0); });
    V y((size_t)n * c, NAN), lse((size_t)b * h * s, NAN);
    auto fwd = [&](auto kern) { launch(G((s + fwd_rows - 1) / fwd_rows, b * h), threads, [&] { kern(y.data(), lse.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, dd, b, h, s, p, 3 * c, 3 * c, seq, scale); }); };
    auto fwd1 = [&](auto kern) { launch(G((s + fwd_rows - 1) / fwd_rows, b * h), threads, [&] { kern(y.data(), lse.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, b, h, s, p, 3 * c, 3 * c, seq, scale); }); };
    if (v2) { if (d == 16) fwd(attn_tc2_forward_d16); else if (d == 32) fwd(attn_tc2_forward_d32); else if (d == 64) fwd(attn_tc2_forward_d64); else fwd(attn_tc2_forward_d128); }
    else if (tc) { if (d == 16) fwd1(attn_tc_forward_d16); else if (d == 32) fwd1(attn_tc_forward_d32); else if (d == 64) fwd1(attn_tc_forward_d64); else fwd1(attn_tc_forward_d128); }
    else if (d == 16) fwd(attn_forward_d16); else if (d == 32) fwd(attn_forward_d32); else if (d == 64) fwd(attn_forward_d64); else fwd(attn_forward_d128);
    V dy = rnd((size_t)n * c);
    // reference in double
    auto Q = [&](int bi, int t, int hh, int e) { return (double)full[((size_t)bi * seq + p + t) * 3 * c + hh * d + e]; };
    auto K = [&](int bi, int l, int hh, int e) { return (double)full[((size_t)bi * seq + l) * 3 * c + c + hh * d + e]; };
    auto Vv = [&](int bi, int l, int hh, int e) { return (double)full[((size_t)bi * seq + l) * 3 * c + 2 * c + hh * d + e]; };
    std::vector<double> ry((size_t)n * c), rl((size_t)b * h * s), rdq((size_t)n * c, 0), rdk((size_t)b * seq * c, 0.5), rdv((size_t)b * seq * c, 0.5);
    for (int bi = 0; bi < b; ++bi) for (int hh = 0; hh < h; ++hh) for (int t = 0; t < s; ++t) {
        int vis = p + t + 1, lo = lo_of(bi, p + t); std::vector<double> sc(vis), pr(vis, 0.0); double mx = -1e300;
        for (int l = lo; l < vis; ++l) { double z = 0; for (int e = 0; e < d; ++e) z += Q(bi, t, hh, e) * K(bi, l, hh, e); sc[l] = z * scale; mx = std::max(mx, sc[l]); }
        double sum = 0; for (int l = lo; l < vis; ++l) sum += std::exp(sc[l] - mx);
        for (int l = lo; l < vis; ++l) pr[l] = std::exp(sc[l] - mx) / sum;
        rl[((size_t)bi * h + hh) * s + t] = mx + std::log(sum);
        size_t row = ((size_t)bi * s + t) * c + hh * d;
        for (int e = 0; e < d; ++e) { double a = 0; for (int l = lo; l < vis; ++l) a += pr[l] * Vv(bi, l, hh, e); ry[row + e] = a; }
        double delta = 0; for (int e = 0; e < d; ++e) delta += dy[row + e] * ry[row + e];
        for (int l = lo; l < vis; ++l) {
            double dp = 0; for (int e = 0; e < d; ++e) dp += dy[row + e] * Vv(bi, l, hh, e);
            double ds = pr[l] * (dp - delta) * scale;
            size_t kr = ((size_t)bi * seq + l) * c + hh * d;
            for (int e = 0; e < d; ++e) { rdq[row + e] += ds * K(bi, l, hh, e); rdk[kr + e] += ds * Q(bi, t, hh, e); rdv[kr + e] += pr[l] * dy[row + e]; }
        }
    }
    char tag[160]; snprintf(tag, sizeof tag, "(D %d, s %d, P %d, cache %d)%s%s", d, s, p, seq, v2 ? " tensor cores v2" : tc ? " tensor cores" : "", docs ? " documents" : "");
    cmp(std::string("attn y ") + tag, y.data(), ry, bound);
    cmp(std::string("attn lse ") + tag, lse.data(), rl, bound);
    for (int acc = 1; acc >= 0; --acc) {
        V delta((size_t)b * h * s, NAN), dq((size_t)n * c, NAN), dk((size_t)b * seq * c, acc ? 0.5f : NAN), dv(dk);
        if (v2) launch(G((unsigned)(((size_t)b * h * s + 3) / 4)), 128, [&] { attn_tc2_backward_delta(delta.data(), dy.data(), y.data(), b, h, s, d); });
        else launch(G(nb((size_t)b * h * s)), 256, [&] { attn_backward_delta(delta.data(), dy.data(), y.data(), b, h, s, d); });
        auto dqk = [&](auto kq, auto kkv) {
            launch(G((s + rows_per_block - 1) / rows_per_block, b * h), threads, [&] { kq(dq.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, dy.data(), lse.data(), delta.data(), dd, b, h, s, p, 3 * c, 3 * c, seq, scale); });
            launch(G((L + rows_per_block - 1) / rows_per_block, b * h), threads, [&] { kkv(dk.data(), dv.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, dy.data(), lse.data(), delta.data(), dd, b, h, s, p, 3 * c, 3 * c, seq, acc, scale); });
        };
        auto dqk1 = [&](auto kq, auto kkv) {
            launch(G((s + rows_per_block - 1) / rows_per_block, b * h), threads, [&] { kq(dq.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, dy.data(), lse.data(), delta.data(), b, h, s, p, 3 * c, 3 * c, seq, scale); });
            launch(G((L + rows_per_block - 1) / rows_per_block, b * h), threads, [&] { kkv(dk.data(), dv.data(), qkv.data(), cache.data() + c, cache.data() + 2 * c, dy.data(), lse.data(), delta.data(), b, h, s, p, 3 * c, 3 * c, seq, acc, scale); });
        };
        if (v2) {
            if (d == 16) dqk(attn_tc2_backward_dq_d16, attn_tc2_backward_dkdv_d16); else if (d == 32) dqk(attn_tc2_backward_dq_d32, attn_tc2_backward_dkdv_d32);
            else if (d == 64) dqk(attn_tc2_backward_dq_d64, attn_tc2_backward_dkdv_d64); else dqk(attn_tc2_backward_dq_d128, attn_tc2_backward_dkdv_d128);
        } else if (tc) {
            if (d == 16) dqk1(attn_tc_backward_dq_d16, attn_tc_backward_dkdv_d16); else if (d == 32) dqk1(attn_tc_backward_dq_d32, attn_tc_backward_dkdv_d32);
            else if (d == 64) dqk1(attn_tc_backward_dq_d64, attn_tc_backward_dkdv_d64); else dqk1(attn_tc_backward_dq_d128, attn_tc_backward_dkdv_d128);
        } else if (d == 16) dqk(attn_backward_dq_d16, attn_backward_dkdv_d16); else if (d == 32) dqk(attn_backward_dq_d32, attn_backward_dkdv_d32);
        else if (d == 64) dqk(attn_backward_dq_d64, attn_backward_dkdv_d64); else dqk(attn_backward_dq_d128, attn_backward_dkdv_d128);
        std::string a = acc ? " acc " : " write ";
        cmp("attn dq" + a + tag, dq.data(), rdq, bound);
        if (acc) { cmp("attn dk" + a + tag, dk.data(), rdk, bound); cmp("attn dv" + a + tag, dv.data(), rdv, bound); }
        else {  // rows 0..L of each sequence
            V gk, gv; std::vector<double> wk, wv;
            for (int bi = 0; bi < b; ++bi) for (int l = 0; l < L; ++l) for (int j = 0; j < c; ++j) {
                size_t i = ((size_t)bi * seq + l) * c + j; gk.push_back(dk[i]); gv.push_back(dv[i]); wk.push_back(rdk[i] - 0.5); wv.push_back(rdv[i] - 0.5); }
            cmp("attn dk" + a + tag, gk.data(), wk, bound); cmp("attn dv" + a + tag, gv.data(), wv, bound);
        }
    }
}

void norms(int n, int c, bool rms) {
    V x = rnd((size_t)n * c, 2), w = rnd(c), bb = rnd(c), dy = rnd((size_t)n * c);
    for (size_t i = 0; i < x.size(); ++i) x[i] += 3.0f;  // an offset mean
    V y((size_t)n * c, NAN), mean(n), rstd(n), dx((size_t)n * c, NAN), dw(c, 0.25f), db(c, 0.25f);
    launch(G(n), 128, [&] { norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), rms ? nullptr : bb.data(), c, 1e-5f, rms); });
    launch(G(n), 128, [&] { norm_backward_input(dx.data(), dy.data(), x.data(), mean.data(), rstd.data(), w.data(), c, rms); });
    int chunks = std::max(1, (n + 63) / 64);
    V scratch(2 * (size_t)chunks * c, NAN);
    launch(G(nb(c), chunks), 256, [&] { norm_backward_params_partial(scratch.data(), rms ? nullptr : scratch.data() + (size_t)chunks * c, dy.data(), x.data(), mean.data(), rstd.data(), n, c, 64); });
    launch(G(nb(c)), 256, [&] { column_sum_finish(dw.data(), scratch.data(), chunks, c, 1); });
    if (!rms) launch(G(nb(c)), 256, [&] { column_sum_finish(db.data(), scratch.data() + (size_t)chunks * c, chunks, c, 1); });
    std::vector<double> ry((size_t)n * c), rdx((size_t)n * c), rdw(c, 0.25), rdb(c, 0.25);
    for (int r = 0; r < n; ++r) {
        double m = 0; if (!rms) { for (int j = 0; j < c; ++j) m += x[(size_t)r * c + j]; m /= c; }
        double var = 0; for (int j = 0; j < c; ++j) { double dd = x[(size_t)r * c + j] - m; var += dd * dd; } var /= c;
        double rs = 1 / std::sqrt(var + 1e-5);
        double sg = 0, sgx = 0;
        for (int j = 0; j < c; ++j) { double xh = (x[(size_t)r * c + j] - m) * rs; ry[(size_t)r * c + j] = xh * w[j] + (rms ? 0 : bb[j]); double g = dy[(size_t)r * c + j] * w[j]; sg += g; sgx += g * xh; rdw[j] += dy[(size_t)r * c + j] * xh; rdb[j] += dy[(size_t)r * c + j]; }
        if (rms) sg = 0;
        for (int j = 0; j < c; ++j) { double xh = (x[(size_t)r * c + j] - m) * rs; rdx[(size_t)r * c + j] = rs * (dy[(size_t)r * c + j] * w[j] - sg / c - xh * sgx / c); }
    }
    std::string k = (rms ? "rms" : "layer") + std::string(" norm n ") + std::to_string(n) + " c " + std::to_string(c);
    cmp(k + " y", y.data(), ry); cmp(k + " dx", dx.data(), rdx); cmp(k + " dw", dw.data(), rdw);
    if (!rms) cmp(k + " db", db.data(), rdb);
}

void xent(int rows, int v, bool grad) {
    V logits = rnd((size_t)rows * v, 5); std::vector<unsigned> tg(rows); for (auto& t : tg) t = rng() % v;
    tg[0] = v - 1;
    V loss(rows, NAN); float gs = 0.37f;
    V orig = logits;
    launch(G(rows), 256, [&] { softmax_cross_entropy(logits.data(), loss.data(), tg.data(), v, v, gs, grad); });
    std::vector<double> rloss(rows), rg((size_t)rows * v);
    for (int r = 0; r < rows; ++r) {
        double mx = -1e300; for (int j = 0; j < v; ++j) mx = std::max(mx, (double)orig[(size_t)r * v + j]);
        double sum = 0; for (int j = 0; j < v; ++j) sum += std::exp(orig[(size_t)r * v + j] - mx);
        rloss[r] = mx + std::log(sum) - orig[(size_t)r * v + tg[r]];
        for (int j = 0; j < v; ++j) rg[(size_t)r * v + j] = grad ? gs * (std::exp(orig[(size_t)r * v + j] - mx) / sum - (j == (int)tg[r])) : orig[(size_t)r * v + j];
    }
    std::string k = "xent rows " + std::to_string(rows) + " V " + std::to_string(v) + (grad ? " grad" : " nograd");
    cmp(k + " loss", loss.data(), rloss); cmp(k + " logits", logits.data(), rg);
}

void misc() {
    // column sums with accumulate and tails
    { int n = 129, c = 300, chunks = (n + 63) / 64; V x = rnd((size_t)n * c), out(c, 1.0f), sc((size_t)chunks * c, NAN);
      launch(G(nb(c), chunks), 256, [&] { column_sum_partial(sc.data(), x.data(), n, c, 64); });
      launch(G(nb(c)), 256, [&] { column_sum_finish(out.data(), sc.data(), chunks, c, 1); });
      std::vector<double> r(c, 1.0); for (int i = 0; i < n; ++i) for (int j = 0; j < c; ++j) r[j] += x[(size_t)i * c + j];
      cmp("column sum n 129 c 300 accumulate", out.data(), r); }
    // gelu
    { int n = 7, c = 301; size_t t = (size_t)n * c; V x = rnd(t, 4), b = rnd(c), y(t, NAN), dy = rnd(t), du(t, NAN); V x0 = x;
      launch(G(nb(t)), 256, [&] { bias_gelu_forward(y.data(), x.data(), b.data(), (long long)t, c); });
      launch(G(nb(t)), 256, [&] { gelu_backward(du.data(), dy.data(), x.data(), (long long)t); });
      std::vector<double> ry(t), ru(t), rdu(t);
      for (size_t i = 0; i < t; ++i) { double u = (double)x0[i] + b[i % c]; ru[i] = u; double k0 = std::sqrt(2 / M_PI), k1 = 0.044715; double th = std::tanh(k0 * (u + k1 * u * u * u));
        ry[i] = 0.5 * u * (1 + th); rdu[i] = dy[i] * (0.5 * (1 + th) + 0.5 * u * (1 - th * th) * k0 * (1 + 3 * k1 * u * u)); }
      cmp("gelu u saved", x.data(), ru); cmp("gelu y", y.data(), ry); cmp("gelu du", du.data(), rdu); }
    // embeddings
    { int vocab = 50, c = 70, b = 3, t = 11, pos0 = 5, n = b * t; V wte = rnd((size_t)vocab * c), wpe = rnd((size_t)(pos0 + t) * c), out((size_t)n * c, NAN), dy = rnd((size_t)n * c);
      std::vector<unsigned> ids(n); for (auto& i : ids) i = rng() % 10;
      launch(G(n), 128, [&] { embed_forward(out.data(), ids.data(), wte.data(), wpe.data(), n, c, t, pos0, nullptr, 0); });
      std::vector<double> r((size_t)n * c); for (int i = 0; i < n; ++i) for (int j = 0; j < c; ++j) r[(size_t)i * c + j] = wte[(size_t)ids[i] * c + j] + wpe[(size_t)(pos0 + i % t) * c + j];
      cmp("embed forward", out.data(), r);
      std::vector<unsigned> order(n); for (int i = 0; i < n; ++i) order[i] = i; std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b2) { return ids[a] < ids[b2]; });
      std::vector<unsigned> uniq, starts; for (int s2 = 0; s2 < n; ++s2) { unsigned id = ids[order[s2]]; if (uniq.empty() || uniq.back() != id) { uniq.push_back(id); starts.push_back(s2); } } starts.push_back(n);
      V dwte((size_t)vocab * c, 0.5f), dwpe((size_t)(pos0 + t) * c, 0.5f);
      launch(G(uniq.size()), 128, [&] { embed_backward_tokens(dwte.data(), dy.data(), order.data(), starts.data(), uniq.data(), c); });
      launch(G(t), 128, [&] { embed_backward_positions(dwpe.data(), dy.data(), b, t, c, pos0); });
      std::vector<double> rw(dwte.size(), 0.5), rp(dwpe.size(), 0.5);
      for (int i = 0; i < n; ++i) for (int j = 0; j < c; ++j) { rw[(size_t)ids[i] * c + j] += dy[(size_t)i * c + j]; rp[(size_t)(pos0 + i % t) * c + j] += dy[(size_t)i * c + j]; }
      cmp("embed dwte", dwte.data(), rw); cmp("embed dwpe", dwpe.data(), rp); }
    // embeddings with positions restarting at each document: a segment (positions 5..16 of 20) whose
    // rows' documents start before it, on its first and last positions, and inside it; the position
    // gradient summed in token order from 0 (the CPU's order): bit-identical to that float sum.
    { int vocab = 50, c = 70, seq = 20, pos0 = 5, t = 11, b = 3, n = b * t;
      std::vector<std::vector<unsigned>> rows = {{0, 3, 9, 10}, {0}, {0, 5, 15}};
      std::vector<unsigned> docs; for (auto& r : rows) for (int p = 0; p < seq; ++p) { unsigned s0 = 0; for (unsigned s1 : r) if ((int)s1 <= p) s0 = s1; docs.push_back(s0); }
      std::vector<int> pid(n); int ids_max = 0;
      for (int i = 0; i < n; ++i) { int p = pos0 + i % t; pid[i] = p - (int)docs[(size_t)(i / t) * seq + p]; ids_max = std::max(ids_max, pid[i]); }
      V wte = rnd((size_t)vocab * c), wpe = rnd((size_t)seq * c), out((size_t)n * c, NAN), dy = rnd((size_t)n * c);
      std::vector<unsigned> ids(n); for (auto& i : ids) i = rng() % 10;
      launch(G(n), 128, [&] { embed_forward(out.data(), ids.data(), wte.data(), wpe.data(), n, c, t, pos0, docs.data(), seq); });
      std::vector<double> r((size_t)n * c); for (int i = 0; i < n; ++i) for (int j = 0; j < c; ++j) r[(size_t)i * c + j] = wte[(size_t)ids[i] * c + j] + wpe[(size_t)pid[i] * c + j];
      cmp("embed forward, restarting positions", out.data(), r);
      V dwpe((size_t)seq * c, 0.5f), sum((size_t)seq * c, 0.0f);
      launch(G(ids_max + 1), 128, [&] { embed_backward_positions_reset(dwpe.data(), dy.data(), docs.data(), b, t, c, pos0, seq); });
      for (int i = 0; i < n; ++i) for (int j = 0; j < c; ++j) sum[(size_t)pid[i] * c + j] += dy[(size_t)i * c + j];
      std::vector<double> rp(dwpe.size()); for (size_t k = 0; k < rp.size(); ++k) rp[k] = (double)(0.5f + sum[k]);
      cmp("embed dwpe, restarting positions (bit-exact)", dwpe.data(), rp, 0.0); }
    // rope
    { int b = 2, s = 9, h = 3, d = 32, off = 4, stride = 3 * h * d, half = d / 2, maxl = 20; V x = rnd((size_t)b * s * stride), x0 = x, co((size_t)maxl * half), si((size_t)maxl * half);
      for (int p = 0; p < maxl; ++p) for (int i = 0; i < half; ++i) { double th = p * std::pow(10000.0, -2.0 * i / d); co[p * half + i] = std::cos(th); si[p * half + i] = std::sin(th); }
      launch(G(nb((size_t)b * s * h * half)), 256, [&] { rope(x.data(), co.data(), si.data(), b, s, h, d, stride, off, 0); });
      std::vector<double> r(x0.begin(), x0.end());
      for (int row = 0; row < b * s; ++row) for (int hh = 0; hh < h; ++hh) for (int i = 0; i < half; ++i) { size_t q = (size_t)row * stride + hh * d; int pos = off + row % s;
        double x1 = x0[q + i], x2 = x0[q + i + half]; r[q + i] = x1 * co[pos * half + i] - x2 * si[pos * half + i]; r[q + i + half] = x1 * si[pos * half + i] + x2 * co[pos * half + i]; }
      cmp("rope forward (stride 3C)", x.data(), r);
      launch(G(nb((size_t)b * s * h * half)), 256, [&] { rope(x.data(), co.data(), si.data(), b, s, h, d, stride, off, 1); });
      std::vector<double> r0(x0.begin(), x0.end()); cmp("rope inverse restores", x.data(), r0); }
    // adamw
    { int n = 1000; V p = rnd(n), m(n, 0), v(n, 0), g = rnd(n, 0.1f); double b1 = 0.9, b2 = 0.95, eps = 1e-8, lr = 1e-3, wd = 0.1, clip = 0.7;
      std::vector<double> rp(p.begin(), p.end()), rm(n, 0), rv(n, 0);
      for (int t = 1; t <= 3; ++t) { double ib2 = 1 / (1 - std::pow(b2, t)), lb1 = lr / (1 - std::pow(b1, t));
        launch(G(nb(n)), 256, [&] { adamw(p.data(), m.data(), v.data(), g.data(), n, clip, b1, b2, 1 - b1, 1 - b2, eps, ib2, lb1, 1 - lr * wd); });
        for (int i = 0; i < n; ++i) { double gg = g[i] * clip; rm[i] = b1 * rm[i] + (1 - b1) * gg; rv[i] = b2 * rv[i] + (1 - b2) * gg * gg; rp[i] = rp[i] * (1 - lr * wd) - lb1 * rm[i] / (std::sqrt(rv[i] * ib2) + eps); } }
      cmp("adamw p", p.data(), rp); cmp("adamw m", m.data(), rm); cmp("adamw v", v.data(), rv); }
    // sums of squares
    for (long long n : {1LL, 300LL, 70000LL}) { V x = rnd(n); std::vector<double> part(256, NAN), out(1, NAN);
      launch(G(256), 256, [&] { sum_squares_partial(part.data(), x.data(), n); });
      launch(G(1), 256, [&] { sum_squares_finish(out.data(), part.data(), 256); });
      double r = 0; for (auto xi : x) r += (double)xi * xi; float got = out[0]; cmp("sum of squares n " + std::to_string(n), &got, {r}, 1e-12 + 1e-7); }
    // a target past the vocabulary: a NaN loss for that row, nothing read past it
    { V logits = rnd(2 * 10); std::vector<unsigned> tg = {10, 3}; V loss(2, 0.0f);
      launch(G(2), 256, [&] { softmax_cross_entropy(logits.data(), loss.data(), tg.data(), 10, 10, 1.0f, false); });
      bool ok = std::isnan(loss[0]) && std::isfinite(loss[1]); if (!ok) ++fails;
      printf("%s xent target past the vocabulary gives a NaN loss\n", ok ? "ok  " : "FAIL"); }
}

// Document layouts for the masked attention: per sequence of two, the start of each position's
// document, from sorted starts. Documents span the prefix boundary and whole key tiles, a
// one-token document, a start exactly at the segment's first query, one whole-sequence row.
struct Masked { int d, s, p, seq; std::vector<unsigned> docs; };
static std::vector<unsigned> doc_layout(int seq, const std::vector<std::vector<int>>& rows) {
    std::vector<unsigned> out;
    for (auto& starts : rows) {
        size_t i = 0;
        for (int pos = 0; pos < seq; ++pos) { while (i + 1 < starts.size() && starts[i + 1] <= pos) ++i; out.push_back((unsigned)starts[i]); }
    }
    return out;
}
static std::vector<Masked> masked_cases() {
    return {
        // prefix 160, segment 96: documents 0..37, 37..38 (one token), 38..160 (ends at the
        // segment's start), 160..201, 201..; the second row a document spanning everything.
        {64, 96, 160, 300, doc_layout(300, {{0, 37, 38, 160, 201}, {0}})},
        // a document from the prefix through the whole segment, and many short ones
        {32, 70, 33, 110, doc_layout(110, {{0, 5, 90}, {0, 2, 3, 40, 41, 64, 65, 66, 100}})},
        // two 128-query blocks (v2's forward), starts inside the second block and past a key tile
        {16, 200, 57, 300, doc_layout(300, {{0, 130, 131, 250}, {0, 56, 57, 58, 190}})},
        {128, 64, 64, 128, doc_layout(128, {{0, 64, 100}, {0, 127}})},
    };
}

int main(int argc, char** argv) {
    std::string only = argc > 1 ? argv[1] : "";
    if (only.empty() || only == "misc") { misc(); for (bool r : {false, true}) { norms(257, 384, r); norms(3, 100, r); norms(2, 768, r); } xent(3, 1000, true); xent(2, 1000, false); xent(1, 50257, true); }
    if (only.empty() || only == "attn") {
        attention(64, 128, 0, 128); attention(64, 96, 160, 300); attention(32, 70, 33, 110); attention(128, 64, 64, 128);
        attention(16, 50, 0, 50); attention(64, 1, 200, 256); attention(64, 65, 0, 65); attention(32, 33, 31, 100); attention(16, 130, 70, 260);
        for (auto& m : masked_cases()) attention(m.d, m.s, m.p, m.seq, false, 1e-5, 2, 3, false, &m.docs);
    }
    if (only.empty() || only == "attn-tc") {
        // bf16 operands (8-bit significands) leave ~0.2-0.35% here; a misplaced fragment ~100%.
        // One sequence, two heads: every emulated mma is two barriers over a warp's 32 threads.
        double tc = 1e-2;
        attention(64, 96, 160, 300, true, tc, 1, 2); attention(32, 33, 31, 100, true, tc, 1, 2);
        attention(128, 64, 64, 128, true, tc, 1, 2); attention(16, 50, 0, 50, true, tc, 1, 2);
        attention(64, 1, 200, 256, true, tc, 1, 2); attention(16, 130, 70, 260, true, tc, 1, 2);
    }
    if (only.empty() || only == "attn-tc2") {
        // The v2 kernels at every shape above, and a segment of two 128-query forward blocks, the
        // second a tail (72 queries: one warp with 8, one with none), over a prefix that is no
        // multiple of a tile, with the pipeline's cache layout.
        double tc = 1e-2;
        attention(64, 96, 160, 300, true, tc, 1, 2, true); attention(32, 33, 31, 100, true, tc, 1, 2, true);
        attention(128, 64, 64, 128, true, tc, 1, 2, true); attention(16, 50, 0, 50, true, tc, 1, 2, true);
        attention(64, 1, 200, 256, true, tc, 1, 2, true); attention(16, 130, 70, 260, true, tc, 1, 2, true);
        attention(64, 200, 57, 300, true, tc, 1, 2, true); attention(128, 70, 35, 120, true, tc, 1, 2, true);
        for (auto& m : masked_cases()) attention(m.d, m.s, m.p, m.seq, true, tc, 2, 2, true, &m.docs);
    }
    printf("%d failures\n", fails);
    return fails != 0;
}
