// Internal, per instruction set: what each kernel file of cpp/src/kernels/ gives the others and
// tables.cpp, which joins them into the instruction set's IsaTable and SessionOps (kernels.hpp
// says what each entry promises). In the per-ISA namespace: every file here is compiled once per
// instruction set (CMakeLists.txt), and each copy binds only to its own.
//
//   gemm.hpp, gemm.cpp     lossk's packed float32 / float64 GEMM, its half-precision sources,
//                          the half conversions
//   fpanels.cpp            the session's float32 / bf16 / f16 weight panels on that GEMM's
//                          micro-kernel
//   x86/bf16dot.cpp        vdpbf16ps: lossk's bf16 dot-product GEMMs, the session's bf16 pair
//                          panels (AVX512-BF16 builds)
//   amx/amx.cpp            AMX tiles: lossk's bf16 dot-product GEMMs (the amx build)
//   q8panels.cpp           the session's int8 weight panels and their activations' quantization
//   attention.cpp          the KV cache's dot products and updates, attention's softmax
//   elementwise.cpp        the session's element-wise stages, RMSNorm's sum of squares, the
//                          bf16 rounding of activations, the read-bandwidth probe
//   epilogues.cpp          lossk's per-block statistics, logit epilogue and softmax gradient
#pragma once
#include <cstdint>

#include "algenta/kernels.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

// A template entry of the tables is defined in its file and instantiated there for tables.cpp,
// for both of its arguments (float and double, or the two half formats).
#define ALGENTA_KERN_INSTANTIATE(f, A, B) \
  template decltype(f<A>) f<A>;            \
  template decltype(f<B>) f<B>;

// ---- gemm.cpp (packed_a_elems and pack_a_rows: gemm.hpp) --------------------------------------
template <class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa, const T* B,
          int64_t rsb, int64_t csb, T* C, int64_t ldc, bool accumulate, T* ws);
template <class T>
int64_t gemm_ws_elems();
template <class T, class S = T>
void pack_b_full(int64_t K, int64_t N, const S* B, int64_t rsb, int64_t csb, T* Bfull);
template <class T>
int64_t packed_b_elems(int64_t K, int64_t N);
template <class T>
int64_t packed_b_max_cols();
template <class T>
void gemm_pb(int64_t M, int64_t N, int64_t K, const T* A, int64_t rsa, int64_t csa,
             const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws);
template <class T>
int64_t packed_a_elems(int64_t M, int64_t K);
template <class T, class S = T>
void pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const S* A, int64_t rsa,
                 int64_t csa, T* Afull);
template <class T>
void gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K, const T* Afull,
               const T* Bfull, T* C, int64_t ldc, bool accumulate, T* ws);
template <class T>
int64_t row_quantum();
// H: BF16 or F16 (simd.hpp), the source's storage, widened exactly as it is packed
template <class H>
void gemm_bh(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
             const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, bool accumulate,
             float* ws);
template <class H>
void pack_b_full_h(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                   float* Bfull);
template <class H>
void pack_a_rows_h(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                   int64_t csa, float* Afull);
template <int KIND>  // Half
void narrow_h(const float* src, uint16_t* dst, int64_t n);
template <int KIND>
void widen_h(const uint16_t* src, float* dst, int64_t n);

// ---- epilogues.cpp --------------------------------------------------------------------------
template <class T>
BlockStats block_stats(const T* z, int64_t n, const T* w, bool entropy);
template <class T>
void logit_epilogue(T* z, int64_t n, const T* bias, double cap, double temperature);
template <class T>
void softmax_grad(T* z, int64_t n, double lse, double a, double b, const T* w, double cap,
                  double e, double m);

// ---- fpanels.cpp: the float panels, by element kind -------------------------------------------
enum : int { PANEL_F32 = 0, PANEL_BF16 = 1, PANEL_F16 = 2 };

int64_t fpanel_block_elems(int64_t K);  // elements (4 or 2 bytes) of one block
void fpanel_put_row(int kind, void* blk, int64_t K, int64_t c, const void* row);
void fpanel_get_row(int kind, const void* blk, int64_t K, int64_t c, float* dst);
void fpanel_gemm(int kind, int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx,
                 const float* Xpacked, const void* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws);
int64_t fpanel_packed_elems(int64_t M, int64_t K);
void fpanel_pack(int64_t M, int64_t K, const float* X, int64_t ldx, float* dst);
int64_t fpanel_ws_elems();

// ---- the bf16 dot-product paths: x86/bf16dot.cpp (prefix dp_), amx/amx.cpp (prefix amx_) ----
// Each gives lossk's Bf16DotOps (kernels.hpp) under its prefix; ALGENTA_BF16DOT_OPS (tables.cpp)
// puts one path's entries into the table.
#define ALGENTA_BF16DOT_DECLARE(P)                                                              \
  int64_t P##_packed_a_elems(int64_t M, int64_t K);                                             \
  void P##_pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A,          \
                       int64_t rsa, int64_t csa, uint32_t* Afull);                              \
  int64_t P##_packed_b_elems(int64_t K, int64_t N);                                             \
  int64_t P##_packed_b_max_cols();                                                              \
  void P##_pack_b_full(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,       \
                       uint32_t* Bfull);                                                        \
  void P##_gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K,              \
                     const uint32_t* Afull, const uint32_t* Bfull, float* C, int64_t ldc,       \
                     bool accumulate, float* ws);                                               \
  void P##_gemm_bb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa, \
                   const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc,          \
                   bool accumulate, float* ws);                                                 \
  void P##_gemm_bpb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa,            \
                    int64_t csa, const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate, \
                    float* ws);                                                                 \
  int64_t P##_row_quantum();
#define ALGENTA_BF16DOT_OPS(P, k_quantum, path)                                           \
  Bf16DotOps {                                                                            \
    P##_packed_a_elems, P##_pack_a_rows, P##_packed_b_elems, P##_packed_b_max_cols,       \
        P##_pack_b_full, P##_gemm_papb, P##_gemm_bb, P##_gemm_bpb, P##_row_quantum,       \
        k_quantum, path                                                                   \
  }

#if defined(__AVX512BF16__)
ALGENTA_BF16DOT_DECLARE(dp)
// the session's bf16 pair panels (fpanels' counterparts on vdpbf16ps)
int64_t dpanel_block_u32(int64_t K);
void dpanel_put_row(uint32_t* blk, int64_t K, int64_t c, const uint16_t* row);
void dpanel_get_row(const uint32_t* blk, int64_t K, int64_t c, float* dst);
void dpanel_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* X, int64_t ldx,
                 const uint32_t* Xp, const uint32_t* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws);
int64_t dpanel_packed_u32(int64_t M, int64_t K);
void dpanel_pack(int64_t M, int64_t K, const uint16_t* X, int64_t ldx, uint32_t* dst);
#endif
#if defined(__AMX_BF16__)
ALGENTA_BF16DOT_DECLARE(amx)
int64_t amx_ws_u32();  // the tile GEMMs' scratch, in 4-byte elements
#endif

// ---- q8panels.cpp: the int8 panels (PanelOps' signatures) ----------------------------------
void quantize_q8(const float* x, int64_t n, int8_t* xq, float* xs);
int64_t q8_block_bytes(int64_t K);
void q8_put_row(void* blk, int64_t K, int64_t c, const void* row, const float* scales);
void q8_get_row(const void* blk, int64_t K, int64_t c, float* dst);
void q8_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
             int64_t ldy, bool accumulate, void* ws);
int64_t q8_ws_bytes(int64_t K);
// what multiplies them, for reports
#if ALGENTA_VBYTES == 64 && defined(__AVX512VNNI__)
constexpr const char* Q8_PATH = "vpdpbusd";
#elif ALGENTA_VBYTES >= 32
constexpr const char* Q8_PATH = "vpmaddubsw";
#else
constexpr const char* Q8_PATH = "scalar";
#endif

// ---- q4panels.cpp: the Q4_0 panels (PanelOps' signatures; activations as quantize_q8's) ----
int64_t q4_block_bytes(int64_t K);
void q4_put_row(void* blk, int64_t K, int64_t c, const void* row, const float* scales);
void q4_get_row(const void* blk, int64_t K, int64_t c, float* dst);
void q4_gemm(int64_t M, int64_t N, int64_t K, const PanelAct& X, const void* W, float* Y,
             int64_t ldy, bool accumulate, void* ws);
int64_t q4_ws_bytes(int64_t K);
#if ALGENTA_VBYTES >= 32
constexpr const char* Q4_PATH = "vpmaddubsw on 4-bit codes";
#else
constexpr const char* Q4_PATH = "scalar on 4-bit codes";
#endif

// ---- attention.cpp --------------------------------------------------------------------------
void kv_dots(Dtype f, const float* const* q, int nq, const void* K, int64_t n, int64_t j0,
             int64_t j1, float* s, int64_t lds);
void kv_axpys(Dtype f, const float* p, int64_t ldp, int nq, const void* V, int64_t n, int64_t j0,
              int64_t j1, float* const* out);
void softmax(float* s, int64_t n);

// ---- elementwise.cpp ------------------------------------------------------------------------
float sum(const float* a, int64_t n, int streams, bool prefetch);
double sum_sq(const float* x, int64_t n);
void round_bf16(const float* x, int64_t n, uint16_t* xb, float* xr);
void softcap(float* z, int64_t n, float cap);
template <float (*Act)(float, float)>
void gate_mul(const float* g, const float* u, const float* gb, const float* ub, float* out,
              int64_t n);

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta
