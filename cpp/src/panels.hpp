// Internal, per instruction set: the resident session's weight panels that kernels_isa.cpp
// implements with the GEMM's own micro-kernels (float32, bf16 and f16 panels; bf16 pair panels on
// vdpbf16ps), declared for session_kernels.cpp, which puts them with its int8 panels into the
// instruction set's SessionOps (kernels.hpp says what a panel is). In the per-ISA namespace.
#pragma once
#include <cstdint>

#include "algenta/kernels.hpp"

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

// Element kinds of the float panels.
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

#if defined(__AVX512BF16__)
int64_t dpanel_block_u32(int64_t K);
void dpanel_put_row(uint32_t* blk, int64_t K, int64_t c, const uint16_t* row);
void dpanel_get_row(const uint32_t* blk, int64_t K, int64_t c, float* dst);
void dpanel_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* X, int64_t ldx,
                 const uint32_t* Xp, const uint32_t* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws);
int64_t dpanel_packed_u32(int64_t M, int64_t K);
void dpanel_pack(int64_t M, int64_t K, const uint16_t* X, int64_t ldx, uint32_t* dst);
#endif

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta
