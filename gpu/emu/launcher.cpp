// The `emulate` feature's kernel launcher: every kernel of kernels.cu, run on the CPU through
// cuda_shim.h, called by name with its arguments packed as for cuLaunchKernel (one address per
// argument). Built by gpu/build.rs; called by gpu/src/device_emu.rs (one launch at a time).
#include "cuda_shim.h"
#include "../src/kernels.cu"
#include <cstring>
#include <type_traits>
#include <utility>

template <class... A, std::size_t... I>
static void call_with(void (*k)(A...), void** p, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(p[I])...);
}
template <class... A>
static void call(void (*k)(A...), void** p) {
    call_with(k, p, std::index_sequence_for<A...>{});
}

#define ATTN(X, D)                                                                                   \
    X(attn_forward_d##D) X(attn_backward_dq_d##D) X(attn_backward_dkdv_d##D) X(attn_tc_forward_d##D) \
        X(attn_tc_backward_dq_d##D) X(attn_tc_backward_dkdv_d##D) X(attn_tc2_forward_d##D)              \
            X(attn_tc2_backward_dq_d##D) X(attn_tc2_backward_dkdv_d##D)
#define KERNELS(X)                                                                                   \
    X(embed_forward) X(embed_backward_tokens) X(embed_backward_positions)                           \
    X(embed_backward_positions_reset) X(column_sum_partial)                                          \
    X(column_sum_finish) X(add_bias) X(add) X(add_assign) X(copy_rows) X(bias_gelu_forward)          \
    X(gelu_backward) X(norm_forward) X(norm_backward_input) X(norm_backward_params_partial) X(rope)  \
    X(attn_backward_delta) X(attn_tc2_backward_delta) X(softmax_cross_entropy) X(adamw) X(sum_squares_partial)                   \
    X(sum_squares_finish) X(to_bf16) ATTN(X, 16) ATTN(X, 32) ATTN(X, 64) ATTN(X, 128)

extern "C" int seqpipe_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned block,
                                  void** params) {
#define TRY(k)                                                                                       \
    if (std::strcmp(name, #k) == 0) {                                                                \
        launch(dim3{gx, gy, gz}, block, [&] { call(k, params); });                                   \
        return 0;                                                                                    \
    }
    KERNELS(TRY)
#undef TRY
    return 1;
}
