// One instruction set's kernel tables (kernels.hpp): its IsaTable, which cpu_dispatch.cpp picks
// at run time (or ALGENTA_ISA forces), and its SessionOps, each entry a function of this folder
// (parts.hpp says which file holds it), plus the adapters that put the float and bf16 panels
// behind PanelOps' one signature. Compiled once per instruction set like every kernel file.
// Every table is constexpr: constant-initialized, so no kernel call can see it half built.
#include <cstdint>

#include "algenta/kernels.hpp"
#include "algenta/session_math.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

// ---- the float and bf16 panels (fpanels.cpp, x86/bf16dot.cpp) behind PanelOps' signature -------
template <int KIND>
int64_t fp_block_bytes(int64_t K) {
  return fpanel_block_elems(K) * (KIND == PANEL_F32 ? 4 : 2);
}
template <int KIND>
void fp_put_row(void* blk, int64_t K, int64_t c, const void* row, const float*) {
  fpanel_put_row(KIND, blk, K, c, row);
}
template <int KIND>
void fp_get_row(const void* blk, int64_t K, int64_t c, float* dst) {
  fpanel_get_row(KIND, blk, K, c, dst);
}
template <int KIND>
void fp_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
             int64_t ldy, bool accumulate, void* ws) {
  fpanel_gemm(KIND, M, N, K, X.f, X.ld, static_cast<const float*>(X.packed), W, Y, ldy,
              accumulate, static_cast<float*>(ws));
}
int64_t fp_ws_bytes(int64_t) { return fpanel_ws_elems() * 4; }
void fp_pack(int64_t M, int64_t K, const PanelAct& X, void* dst) {
  fpanel_pack(M, K, X.f, X.ld, static_cast<float*>(dst));
}
template <int KIND>
constexpr PanelOps fp_panels(const char* path) {
  return {fp_block_bytes<KIND>, fp_put_row<KIND>, fp_get_row<KIND>, fp_gemm<KIND>, fp_ws_bytes,
          ACT_F32, path, fpanel_packed_elems, fp_pack};
}

#if defined(__AVX512BF16__)
int64_t dp_block_bytes(int64_t K) { return dpanel_block_u32(K) * 4; }
void dp_put_row(void* blk, int64_t K, int64_t c, const void* row, const float*) {
  dpanel_put_row(static_cast<uint32_t*>(blk), K, c, static_cast<const uint16_t*>(row));
}
void dp_get_row(const void* blk, int64_t K, int64_t c, float* dst) {
  dpanel_get_row(static_cast<const uint32_t*>(blk), K, c, dst);
}
void dp_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
             int64_t ldy, bool accumulate, void* ws) {
  dpanel_gemm(M, N, K, X.b, X.ld, static_cast<const uint32_t*>(X.packed),
              static_cast<const uint32_t*>(W), Y, ldy, accumulate, static_cast<float*>(ws));
}
void dp_pack(int64_t M, int64_t K, const PanelAct& X, void* dst) {
  dpanel_pack(M, K, X.b, X.ld, static_cast<uint32_t*>(dst));
}
constexpr PanelOps kBf16Panels = {dp_block_bytes, dp_put_row, dp_get_row, dp_gemm, fp_ws_bytes,
                                  ACT_BF16_BITS, "vdpbf16ps", dpanel_packed_u32, dp_pack};
#else
constexpr PanelOps kBf16Panels = fp_panels<PANEL_BF16>("fp32 on widened bf16");
#endif

// lossk's bf16 dot products: AMX tiles where the build has them, else vdpbf16ps, else none
#if defined(__AMX_BF16__)
constexpr Bf16DotOps kBf16Dot = ALGENTA_BF16DOT_OPS(amx, 32, "amx");
#elif defined(__AVX512BF16__)
constexpr Bf16DotOps kBf16Dot = ALGENTA_BF16DOT_OPS(dp, 2, "vdpbf16ps");
#else
constexpr Bf16DotOps kBf16Dot = {};  // this instruction set has no bf16 dot product
#endif

// lossk's entries for T; the half-precision sources and the bf16 dot products are float32's only
template <class T>
constexpr IsaOps<T> lossk_ops() {
  IsaOps<T> o = {gemm<T>, gemm_ws_elems<T>, pack_b_full<T>, packed_b_elems<T>,
                 packed_b_max_cols<T>, gemm_pb<T>, packed_a_elems<T>, pack_a_rows<T>,
                 gemm_papb<T>, row_quantum<T>, block_stats<T>, logit_epilogue<T>,
                 softmax_grad<T>, {}, {}, {}, {}, {}, {}};
  if constexpr (sizeof(T) == 4) {
    o.pack_b_full_h[HALF_BF16] = pack_b_full_h<BF16>;
    o.pack_b_full_h[HALF_F16] = pack_b_full_h<F16>;
    o.pack_a_rows_h[HALF_BF16] = pack_a_rows_h<BF16>;
    o.pack_a_rows_h[HALF_F16] = pack_a_rows_h<F16>;
    o.gemm_bh[HALF_BF16] = gemm_bh<BF16>;
    o.gemm_bh[HALF_F16] = gemm_bh<F16>;
    o.narrow_h[HALF_BF16] = narrow_h<HALF_BF16>;
    o.narrow_h[HALF_F16] = narrow_h<HALF_F16>;
    o.widen_h[HALF_BF16] = widen_h<HALF_BF16>;
    o.widen_h[HALF_F16] = widen_h<HALF_F16>;
    o.bf16dot = kBf16Dot;
  }
  return o;
}

}  // namespace

extern const SessionOps session_ops;
constexpr SessionOps session_ops = {
    sum,
    kv_dots,
    kv_axpys,
    round_bf16,
    quantize_q8,
    softcap,
    softmax,
    sum_sq,
    gate_mul<session_math::silu_mul>,
    gate_mul<session_math::gelu_tanh_mul>,
    {
        fp_panels<PANEL_F32>("fp32"),
        kBf16Panels,
        fp_panels<PANEL_F16>("fp32 on widened f16"),
        {q8_block_bytes, q8_put_row, q8_get_row, q8_gemm, q8_ws_bytes, ACT_Q8, Q8_PATH, nullptr,
         nullptr},
        {q4_block_bytes, q4_put_row, q4_get_row, q4_gemm, q4_ws_bytes, ACT_Q8, Q4_PATH, nullptr,
         nullptr},
    },
};

}  // namespace ALGENTA_ISA_NS

#define ALGENTA_CAT2(a, b) a##b
#define ALGENTA_CAT(a, b) ALGENTA_CAT2(a, b)

// One table per compiled instruction set; cpu_dispatch.cpp declares and picks among them.
extern const IsaTable ALGENTA_CAT(ALGENTA_ISA_NS, _table);
constexpr IsaTable ALGENTA_CAT(ALGENTA_ISA_NS, _table) = {
    ALGENTA_ISA_NAME,
    ALGENTA_ISA_NS::lossk_ops<float>(),
    ALGENTA_ISA_NS::lossk_ops<double>(),
    &ALGENTA_ISA_NS::session_ops,
};

}  // namespace kern
}  // namespace algenta
