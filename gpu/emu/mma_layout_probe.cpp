// Test-only (gpu/tests/emulated_kernels.rs): proves that cuda_shim.h's tensor-core `mma` tells a
// right fragment layout from wrong ones. One warp multiplies a 16×16 A by a 16×8 B through
// emu_mma_bf16, loading its fragments the way a kernel would, once with the PTX ISA's layout and
// once with each of several plausible mistakes; each result is compared with a CPU matmul in
// double. Inputs are small integers (exact in bf16, sums exact in fp32), so the right layout must
// match exactly and a wrong one must not. Prints one line per layout; exits non-zero unless the
// right layout matches and every wrong one differs.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <string>

static float A[16][16], B[16][8];  // B: rows are k, columns are n
static float D[16][8];

static unsigned int bits(float x) {
    unsigned int u;
    std::memcpy(&u, &x, 4);
    return u >> 16;  // exact: the inputs are small integers
}
static unsigned int pair(float lo, float hi) { return bits(lo) | (bits(hi) << 16); }

enum Layout { ISA, A_ROWS_SWAPPED, A_REGISTERS_1_2_SWAPPED, A_HALVES_SWAPPED, B_TRANSPOSED, D_ROWS_SWAPPED, LAYOUTS };
static const char* NAMES[LAYOUTS] = {
    "ISA layout",
    "a0,a1 swapped with a2,a3 (rows g and g+8)",
    "a2,a3 swapped with a4,a5 (row+8 and k+8 confused)",
    "low and high halves of each A register swapped",
    "B loaded transposed (k from groupID, n from threadID_in_group)",
    "D rows g and g+8 swapped on store",
};

// The kernel: lane (g, t) loads its fragments as `layout` says, multiplies, stores D.
static void probe(Layout layout) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int r0 = g, r8 = g + 8;
    if (layout == A_ROWS_SWAPPED) std::swap(r0, r8);
    unsigned int a[4] = {
        pair(A[r0][2 * t], A[r0][2 * t + 1]),
        pair(A[r8][2 * t], A[r8][2 * t + 1]),
        pair(A[r0][2 * t + 8], A[r0][2 * t + 9]),
        pair(A[r8][2 * t + 8], A[r8][2 * t + 9]),
    };
    if (layout == A_REGISTERS_1_2_SWAPPED) std::swap(a[1], a[2]);
    if (layout == A_HALVES_SWAPPED)
        for (auto& r : a) r = (r >> 16) | (r << 16);
    unsigned int b[2];
    if (layout == B_TRANSPOSED) {
        b[0] = pair(B[g][2 * t], B[g][2 * t + 1]);
        b[1] = pair(B[g + 8][2 * t], B[g + 8][2 * t + 1]);
    } else {
        b[0] = pair(B[2 * t][g], B[2 * t + 1][g]);
        b[1] = pair(B[2 * t + 8][g], B[2 * t + 9][g]);
    }
    float d[4] = {0, 0, 0, 0};
    emu_mma_bf16(d, a, b);
    int s0 = g, s8 = g + 8;
    if (layout == D_ROWS_SWAPPED) std::swap(s0, s8);
    D[s0][2 * t] = d[0];
    D[s0][2 * t + 1] = d[1];
    D[s8][2 * t] = d[2];
    D[s8][2 * t + 1] = d[3];
}

int main() {
    std::mt19937 rng(29);
    std::uniform_int_distribution<int> small(-4, 4);
    for (auto& row : A) for (auto& x : row) x = (float)small(rng);
    for (auto& row : B) for (auto& x : row) x = (float)small(rng);
    double want[16][8];
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 8; ++n) {
            double s = 0;
            for (int k = 0; k < 16; ++k) s += (double)A[m][k] * B[k][n];
            want[m][n] = s;
        }
    int bad = 0;
    for (int l = 0; l < LAYOUTS; ++l) {
        for (auto& row : D) for (auto& x : row) x = NAN;
        launch(dim3{1, 1, 1}, 32, [&] { probe((Layout)l); });
        double worst = 0;
        int wrong = 0;
        for (int m = 0; m < 16; ++m)
            for (int n = 0; n < 8; ++n) {
                double e = std::isnan(D[m][n]) ? 1e30 : std::fabs(D[m][n] - want[m][n]);
                worst = std::max(worst, e);
                wrong += e != 0;
            }
        bool expect_match = l == ISA;
        bool ok = expect_match ? wrong == 0 : wrong > 0;
        bad += !ok;
        std::printf("%s %-64s %3d of 128 elements differ from the CPU matmul (max |diff| %g)\n",
                    ok ? (expect_match ? "match " : "caught") : "FAIL  ", NAMES[l], wrong, worst);
    }
    std::printf("%d failures\n", bad);
    return bad == 0 ? 0 : 1;
}
