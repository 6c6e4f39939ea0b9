// AMX tile kernels (Intel Sapphire Rapids and later), compiled only into the `amx` instruction
// set (CMakeLists.txt) and reached through its IsaTable: lossk's bf16 dot-product GEMMs
// (Bf16DotOps: logits, d_hidden, d_weight, and the resident session's bf16 prefill, which calls
// gemm_bb) on tdpbf16ps. cpu_dispatch.cpp selects this table only after the kernel granted the
// process the tile state (arch_prctl); every call loads its own tile configuration, so each
// OpenMP worker has one before its first tile instruction, and releases the tiles on return.
//
// Operands are bf16 pairs (uint32: k = 2p in the low half, 2p + 1 in the high half), packed
// into whole 16 x 16-pair tiles (1 KB, contiguous): A panels of 16 rows, B panels of 16 columns,
// each a run of k tiles of TK = 32 values, zero rows, columns and k values padding every edge;
// an A whose rows are k-contiguous and whose block is whole tiles is read in place instead.
// Never allocates (scratch is the caller's gemm_ws_elems()); reads nothing past its operands.
//
// Numerics (measured on an AMX host: splitting one tile's k into two instructions changed about
// half of the cells): one tdpbf16ps adds its 32 products to an accumulator cell as one wider sum,
// not as 32 float32 steps, so a cell's bits depend on how k was grouped into instructions. k
// tiles therefore always start at k = 0 of the whole product (K blocks hold whole tiles), and a
// split of K must fall on a multiple of TK (Bf16DotOps::k_quantum; lossk rounds its chunk to it).
// With that, a cell is one chain of tiles from its first to its last, continued exactly through C
// between calls (C is float32 in memory and in the tile alike), and never depends on M or N
// blocking, on threads, or on where the caller split K. Products are exact; subnormal inputs and
// results are treated as zero, as vdpbf16ps does. The bits differ from the vdpbf16ps path's (a
// different grouping of the same products).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "algenta/kernels.hpp"
#include "../parts.hpp"
#include "../simd.hpp"

#ifndef ALGENTA_ISA_NS
#error "compile with -DALGENTA_ISA_NS=isa_<name>"
#endif
#if !defined(__AMX_BF16__) || !defined(__AMX_TILE__)
#error "amx/amx.cpp is compiled for the amx instruction set only"
#endif

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {
namespace {

constexpr int64_t TK = 32;   // bf16 values of k in one tile row (64 bytes)
constexpr int64_t TT = 256;  // uint32 in one tile (16 rows x 16 pairs, or 16 pairs x 16 columns)
// Blocking: an A block (MCB x KCB) and a B block (KCB x NCB) of packed tiles stay in L2 while
// the 32 x 32 micro-kernel sweeps them; correctness never depends on these.
constexpr int64_t KCB = 512;  // a multiple of TK
constexpr int64_t MCB = 192;  // a multiple of 32
constexpr int64_t NCB = 256;  // a multiple of 32
constexpr int64_t MAX_PACKED_COLS = 8192;  // pack_b_full's widest B (a multiple of 16)
static_assert(KCB % TK == 0 && MCB % 32 == 0 && NCB % 32 == 0, "blocks hold whole tiles");

inline int64_t tiles_of(int64_t k) { return (k + TK - 1) / TK; }
inline int64_t panels_of(int64_t n) { return (n + 15) / 16; }

// uint32 of scratch a call uses: one A block, one B block, one 32 x 32 float edge tile, plus
// alignment slack (the amx table's gemm_ws_elems() is at least this, gemm.cpp).
constexpr int64_t WS_U32 = MCB * (KCB / 2) + (KCB / 2) * NCB + 32 * 32 + 3 * 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (2 x 2 of 16 x 16 float32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 pairs x 32
// bf16), every one 16 rows of 64 bytes.
struct Tiles {
  Tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// 16 bf16 at p, lanes past n zero (masked: nothing past them is read).
inline __m256i load16(const uint16_t* p, int64_t n) {
  if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (n <= 0) return _mm256_setzero_si256();
  return _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p);
}

// 16 dwords pair(lo[i], hi[i]).
inline __m512i pairs16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// 32 bf16 at p as 16 pairs, values past n zero.
inline __m512i load32(const uint16_t* p, int64_t n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  if (n <= 0) return _mm512_setzero_si512();
  return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
}

// The pair (k, k + 1) of a line whose element k is p[k * step], zero past kc or where the line
// lies past the operand's edge (valid false): the strided packings' element-wise fallback.
inline uint32_t pair_at(const uint16_t* p, int64_t k, int64_t kc, int64_t step, bool valid) {
  const uint16_t lo = valid && k < kc ? p[k * step] : 0;
  const uint16_t hi = valid && k + 1 < kc ? p[(k + 1) * step] : 0;
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// A block (mc x kc bf16; element (i, k) at A[i*rsa + k*csa]) -> Ap[panel][kt][r][p], the pair
// (A[r][kt*TK + 2p], A[r][kt*TK + 2p + 1]) of the panel's row r.
void pack_a(int64_t mc, int64_t kc, const uint16_t* A, int64_t rsa, int64_t csa, uint32_t* Ap) {
  const int64_t nkt = tiles_of(kc);
  for (int64_t i0 = 0; i0 < mc; i0 += 16) {
    const int64_t mr = mc - i0 < 16 ? mc - i0 : 16;
    for (int64_t kt = 0; kt < nkt; ++kt) {
      uint32_t* t = Ap + ((i0 / 16) * nkt + kt) * TT;
      const int64_t k0 = kt * TK, kn = kc - k0;
      if (csa == 1) {  // k-contiguous rows (hidden, d_logits): a tile row is 64 bytes of a row
        for (int64_t r = 0; r < 16; ++r)
          _mm512_storeu_si512(t + r * 16, r < mr ? load32(A + (i0 + r) * rsa + k0, kn)
                                                : _mm512_setzero_si512());
      } else if (rsa == 1) {  // d_logits read transposed (d_weight): k rows interleaved by two
        __m512i v[16];
        for (int64_t p = 0; p < 16; ++p) {
          const uint16_t* lo = A + i0 + (k0 + 2 * p) * csa;
          v[p] = pairs16(2 * p < kn ? load16(lo, mr) : _mm256_setzero_si256(),
                         2 * p + 1 < kn ? load16(lo + csa, mr) : _mm256_setzero_si256());
        }
        transpose16(v);  // [p][r] -> [r][p]
        for (int r = 0; r < 16; ++r) _mm512_storeu_si512(t + r * 16, v[r]);
      } else {
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t p = 0; p < 16; ++p)
            t[r * 16 + p] = pair_at(A + (i0 + r) * rsa, k0 + 2 * p, kc, csa, r < mr);
      }
    }
  }
}

// B block (kc x nc bf16; element (k, j) at B[k*rsb + j*csb]) -> Bp[panel][kt][p][c], the pair
// (B[kt*TK + 2p][c], B[kt*TK + 2p + 1][c]) of the panel's column c.
void pack_b(int64_t kc, int64_t nc, const uint16_t* B, int64_t rsb, int64_t csb, uint32_t* Bp) {
  const int64_t nkt = tiles_of(kc);
  for (int64_t j0 = 0; j0 < nc; j0 += 16) {
    const int64_t w = nc - j0 < 16 ? nc - j0 : 16;
    for (int64_t kt = 0; kt < nkt; ++kt) {
      uint32_t* t = Bp + ((j0 / 16) * nkt + kt) * TT;
      const int64_t k0 = kt * TK, kn = kc - k0;
      if (rsb == 1) {  // k-contiguous columns (B = W^T): column c's 16 pairs are 64 bytes
        __m512i v[16];
        for (int64_t c = 0; c < 16; ++c)
          v[c] = c < w ? load32(B + (j0 + c) * csb + k0, kn) : _mm512_setzero_si512();
        transpose16(v);  // [c][p] -> [p][c]
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(t + p * 16, v[p]);
      } else if (csb == 1) {  // row-contiguous (W, the chunk's hidden rows): rows by two
        for (int64_t p = 0; p < 16; ++p) {
          const uint16_t* lo = B + (k0 + 2 * p) * rsb + j0;
          _mm512_storeu_si512(t + p * 16,
                             pairs16(2 * p < kn ? load16(lo, w) : _mm256_setzero_si256(),
                                     2 * p + 1 < kn ? load16(lo + rsb, w)
                                                    : _mm256_setzero_si256()));
        }
      } else {
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t c = 0; c < 16; ++c)
            t[p * 16 + c] = pair_at(B + (j0 + c) * csb, k0 + 2 * p, kc, rsb, c < w);
      }
    }
  }
}

// An A operand as the micro-kernel reads it: row panel i's k tile kt is 16 rows of 64 bytes at
// p + i * panel + kt * kstep, ld bytes apart. Packed tiles: panel = nkt KB, kstep 1 KB, ld 64;
// rows of the caller's own k-contiguous bf16 matrix, read in place: panel = 16 rows, kstep 64
// bytes, ld its row stride.
struct ATiles {
  const char* p;
  int64_t panel, kstep, ld;
};

// A (TM x 16) x (TN x 16) block of C: C = (load ? C : 0) + sum over nkt k tiles of A . B.
// b: the first column panel's first packed k tile, bs: uint32 from one column panel to the
// next. rows, cols: the valid part; a partial block goes through edge (a 32 x 32 float tile)
// so nothing past C's valid cells is read or written.
template <int TM, int TN>
void kernel(int64_t nkt, ATiles a, const uint32_t* b, int64_t bs, float* C, int64_t ldc,
            bool load, int64_t rows, int64_t cols, float* edge) {
  const bool full = rows == 16 * TM && cols == 16 * TN;
  float* c = C;
  int64_t ld = ldc;
  if (!full) {
    c = edge;
    ld = 32;
    std::memset(edge, 0, sizeof(float) * 32 * 32);
    if (load)
      for (int64_t i = 0; i < rows; ++i) std::memcpy(edge + i * 32, C + i * ldc, sizeof(float) * cols);
  }
  const int64_t sb = ld * int64_t(sizeof(float));
  if (load) {
    _tile_loadd(0, c, sb);
    if constexpr (TN == 2) _tile_loadd(1, c + 16, sb);
    if constexpr (TM == 2) _tile_loadd(2, c + 16 * ld, sb);
    if constexpr (TM == 2 && TN == 2) _tile_loadd(3, c + 16 * ld + 16, sb);
  } else {
    _tile_zero(0);
    if constexpr (TN == 2) _tile_zero(1);
    if constexpr (TM == 2) _tile_zero(2);
    if constexpr (TM == 2 && TN == 2) _tile_zero(3);
  }
  for (int64_t kt = 0; kt < nkt; ++kt) {
    _tile_loadd(4, a.p + kt * a.kstep, a.ld);
    _tile_loadd(6, b + kt * TT, 64);
    if constexpr (TM == 2) _tile_loadd(5, a.p + a.panel + kt * a.kstep, a.ld);
    if constexpr (TN == 2) _tile_loadd(7, b + bs + kt * TT, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TN == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (TM == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (TM == 2 && TN == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sb);
  if constexpr (TN == 2) _tile_stored(1, c + 16, sb);
  if constexpr (TM == 2) _tile_stored(2, c + 16 * ld, sb);
  if constexpr (TM == 2 && TN == 2) _tile_stored(3, c + 16 * ld + 16, sb);
  if (!full)
    for (int64_t i = 0; i < rows; ++i) std::memcpy(C + i * ldc, edge + i * 32, sizeof(float) * cols);
}

// C block (mc x nc at c) from an A block and a packed B block over nkt k tiles, 32 x 32 at a
// time.
void sweep(int64_t mc, int64_t nc, int64_t nkt, ATiles a, const uint32_t* bk, int64_t bs,
           float* C, int64_t ldc, bool load, float* edge) {
  for (int64_t jr = 0; jr < nc; jr += 32) {
    const int64_t cols = nc - jr < 32 ? nc - jr : 32;
    const uint32_t* b = bk + (jr / 16) * bs;
    for (int64_t ir = 0; ir < mc; ir += 32) {
      const int64_t rows = mc - ir < 32 ? mc - ir : 32;
      ATiles ai = a;
      ai.p += (ir / 16) * a.panel;
      float* c = C + ir * ldc + jr;
      if (rows > 16 && cols > 16)
        kernel<2, 2>(nkt, ai, b, bs, c, ldc, load, rows, cols, edge);
      else if (rows > 16)
        kernel<2, 1>(nkt, ai, b, bs, c, ldc, load, rows, cols, edge);
      else if (cols > 16)
        kernel<1, 2>(nkt, ai, b, bs, c, ldc, load, rows, cols, edge);
      else
        kernel<1, 1>(nkt, ai, b, bs, c, ldc, load, rows, cols, edge);
    }
  }
}

// C (M x N, ldc) (+)= A (M x K) B (K x N). A: bf16 (read in place where its rows are
// k-contiguous and the block is whole tiles, else packed block by block), or Afull (pack_a_rows,
// this call's rows from row a0, a multiple of 16); B: bf16 packed block by block, or Bfull
// (pack_b_full). K blocks outermost, in order (a cell's chain); then whichever operand is packed
// here is packed once per block: with B packed on the fly, column blocks then row blocks; with
// Bfull, row blocks then column blocks, so an A block (d_weight's transposed d_logits) is packed
// once for every column. ws: at least WS_U32 uint32.
void gemm_core(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
               const uint16_t* B, int64_t rsb, int64_t csb, const uint32_t* Afull, int64_t a0,
               const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate, float* ws) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * size_t(N));
    return;
  }
  uint32_t* Ap = align64(reinterpret_cast<uint32_t*>(ws));
  uint32_t* Bp = align64(Ap + MCB * (KCB / 2));
  float* edge = reinterpret_cast<float*>(align64(Bp + (KCB / 2) * NCB));
  const int64_t nkt_all = tiles_of(K);
  const Tiles tiles;
  // the A block [ic, ic + mc) x [pc, pc + kc) as tiles: in place, pre-packed, or packed now
  auto a_block = [&](int64_t ic, int64_t mc, int64_t pc, int64_t kc) {
    if (Afull)
      return ATiles{reinterpret_cast<const char*>(Afull + ((a0 + ic) / 16 * nkt_all + pc / TK) * TT),
                    nkt_all * TT * 4, TT * 4, 64};
    if (csa == 1 && mc % 16 == 0 && kc % TK == 0)
      return ATiles{reinterpret_cast<const char*>(A + ic * rsa + pc), 16 * rsa * 2, TK * 2,
                    rsa * 2};
    pack_a(mc, kc, A + ic * rsa + pc * csa, rsa, csa, Ap);
    return ATiles{reinterpret_cast<const char*>(Ap), tiles_of(kc) * TT * 4, TT * 4, 64};
  };
  for (int64_t pc = 0; pc < K; pc += KCB) {
    const int64_t kc = K - pc < KCB ? K - pc : KCB, nkt = tiles_of(kc), kt0 = pc / TK;
    const bool load = accumulate || pc > 0;  // later k blocks continue the same chain
    if (Bfull) {
      const int64_t bs = nkt_all * TT;
      for (int64_t ic = 0; ic < M; ic += MCB) {
        const int64_t mc = M - ic < MCB ? M - ic : MCB;
        const ATiles a = a_block(ic, mc, pc, kc);
        for (int64_t jc = 0; jc < N; jc += NCB)
          sweep(mc, N - jc < NCB ? N - jc : NCB, nkt, a, Bfull + (jc / 16) * bs + kt0 * TT, bs,
                C + ic * ldc + jc, ldc, load, edge);
      }
      continue;
    }
    for (int64_t jc = 0; jc < N; jc += NCB) {
      const int64_t nc = N - jc < NCB ? N - jc : NCB;
      pack_b(kc, nc, B + pc * rsb + jc * csb, rsb, csb, Bp);
      for (int64_t ic = 0; ic < M; ic += MCB) {
        const int64_t mc = M - ic < MCB ? M - ic : MCB;
        sweep(mc, nc, nkt, a_block(ic, mc, pc, kc), Bp, nkt * TT, C + ic * ldc + jc, ldc, load,
              edge);
      }
    }
  }
}

}  // namespace

// The amx table's Bf16DotOps (tables.cpp); the contract is kernels.hpp's.
int64_t amx_packed_a_elems(int64_t M, int64_t K) { return panels_of(M) * tiles_of(K) * TT + 16; }

void amx_pack_a_rows(int64_t M, int64_t K, int64_t r0, int64_t r1, const uint16_t* A, int64_t rsa,
                 int64_t csa, uint32_t* Afull) {
  (void)M;
  pack_a(r1 - r0, K, A + r0 * rsa, rsa, csa, Afull + (r0 / 16) * tiles_of(K) * TT);
}

int64_t amx_packed_b_elems(int64_t K, int64_t N) { return panels_of(N) * tiles_of(K) * TT + 16; }

// Column blocks of NCB inside: a packed B of any width is swept in place, so d_weight takes all
// of d_model in one tile and packs each block of transposed d_logits once.
int64_t amx_packed_b_max_cols() { return MAX_PACKED_COLS; }

void amx_pack_b_full(int64_t K, int64_t N, const uint16_t* B, int64_t rsb, int64_t csb,
                 uint32_t* Bfull) {
  pack_b(K, N, B, rsb, csb, Bfull);
}

void amx_gemm_papb(int64_t Mfull, int64_t row0, int64_t M, int64_t N, int64_t K,
               const uint32_t* Afull, const uint32_t* Bfull, float* C, int64_t ldc,
               bool accumulate, float* ws) {
  (void)Mfull;
  gemm_core(M, N, K, nullptr, 0, 0, nullptr, 0, 0, Afull, row0, Bfull, C, ldc, accumulate, ws);
}

void amx_gemm_bb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
             const uint16_t* B, int64_t rsb, int64_t csb, float* C, int64_t ldc, bool accumulate,
             float* ws) {
  gemm_core(M, N, K, A, rsa, csa, B, rsb, csb, nullptr, 0, nullptr, C, ldc, accumulate, ws);
}

void amx_gemm_bpb(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t rsa, int64_t csa,
              const uint32_t* Bfull, float* C, int64_t ldc, bool accumulate, float* ws) {
  gemm_core(M, N, K, A, rsa, csa, nullptr, 0, 0, nullptr, 0, Bfull, C, ldc, accumulate, ws);
}

int64_t amx_row_quantum() { return 16; }

int64_t amx_ws_u32() { return WS_U32; }

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta
