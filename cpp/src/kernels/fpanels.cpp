// The resident session's float weight panels (float32, and bf16 / f16 bits widened exactly as
// they are loaded), per instruction set, multiplied by the GEMM's own micro-kernel (gemm.hpp).
//
// A session weight matrix (N rows of K) is resident as blocks of PANEL_ROWS rows, each held the
// way pack_b_full holds B = the block's rows transposed (K x PANEL_ROWS): k blocks of KC, each
// NR-column panel's kc rows contiguous. Prefill multiplies such blocks with the GEMM's own
// micro-kernel and never packs a weight; a decode step multiplies them in fpanel_gemv, which runs
// the micro-kernel's sequence for one row without packing x.
//
// Numerics: each output cell sums each k block (KC values) in its own multiply-add chain from 0
// (acc += b[k] * x[k], k increasing) and adds the block sums in order to the cell (y + s0 + s1 +
// ... when accumulating, s0 + s1 + ... otherwise): blocked summation, whose rounding error grows
// with KC + K / KC terms instead of K (one chain over all of K put the f32 engine 7x further from
// transformers at d_ff 3072). So each cell has one sequence for any number of activation rows: a
// prompt's logits are the same whether it is prefilled at once, in pieces or stepped. Never
// allocates (scratch: fpanel_ws_elems()).
#include <cstdint>
#include <type_traits>

#include "algenta/kernels.hpp"
#include "gemm.hpp"
#include "parts.hpp"
#include "simd.hpp"

namespace algenta {
namespace kern {
namespace ALGENTA_ISA_NS {

int64_t fpanel_block_elems(int64_t K) { return K * PANEL_ROWS; }

// Element (k, c) of a block: pack_b's panel layout with npad = PANEL_ROWS.
inline int64_t fpanel_at(int64_t K, int64_t k, int64_t c) {
  constexpr int64_t NR = nr<float>();
  static_assert(PANEL_ROWS % NR == 0, "a block holds whole panels");
  const int64_t pc = k / KC * KC, kc = K - pc < KC ? K - pc : KC;
  return pc * PANEL_ROWS + (c / NR) * NR * kc + (k - pc) * NR + c % NR;
}

template <class PB>
void fpanel_put_row_t(PB* blk, int64_t K, int64_t c, const PB* row) {
  for (int64_t k = 0; k < K; ++k) blk[fpanel_at(K, k, c)] = row[k];
}

void fpanel_put_row(int kind, void* blk, int64_t K, int64_t c, const void* row) {
  if (kind == PANEL_F32)
    fpanel_put_row_t(static_cast<float*>(blk), K, c, static_cast<const float*>(row));
  else
    fpanel_put_row_t(static_cast<uint16_t*>(blk), K, c, static_cast<const uint16_t*>(row));
}

void fpanel_get_row(int kind, const void* blk, int64_t K, int64_t c, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t at = fpanel_at(K, k, c);
    if (kind == PANEL_F32)
      dst[k] = static_cast<const float*>(blk)[at];
    else if (kind == PANEL_BF16)
      dst[k] = widen(static_cast<const BF16*>(blk)[at]);
    else
      dst[k] = widen(static_cast<const F16*>(blk)[at]);
  }
}

// The micro-tiles of one (k block, row block, panel block): each tile's k-block sums formed from
// 0, then C = first ? sums : C + sums, in the micro-kernel's epilogue for whole tiles and through
// `tile` at a column edge. stream: Bk is read from memory (TILE_STREAM on each panel's first tile).
template <class PB>
void fpanel_tiles(int64_t mc, int64_t nb, int64_t kc, const float* Ap, const PB* Bk, float* C,
                  int64_t ldc, bool first, float* tile, bool stream) {
  constexpr int64_t NR = nr<float>();
  for (int64_t jr = 0; jr < nb; jr += NR) {
    const int64_t nr_ = nb - jr < NR ? nb - jr : NR;
    for (int64_t ir = 0; ir < mc; ir += MR<float>) {
      const int64_t mr_ = mc - ir < MR<float> ? mc - ir : MR<float>;
      const UkernelFn<float, PB> uk = ukernels<float, PB>()[size_t(mr_ - 1)];
      float* c = C + ir * ldc + jr;
      const int pf = stream && ir == 0 ? TILE_STREAM : 0;
      if (nr_ == NR) {
        uk(kc, Ap + ir * kc, Bk + jr * kc, c, ldc, (first ? TILE_SET : TILE_ADD) | pf);
        continue;
      }
      uk(kc, Ap + ir * kc, Bk + jr * kc, tile, NR, TILE_SET | pf);
      for (int64_t i = 0; i < mr_; ++i)
        for (int64_t j = 0; j < nr_; ++j)
          c[i * ldc + j] = first ? tile[i * NR + j] : c[i * ldc + j] + tile[i * NR + j];
    }
  }
}

// Y (M, ldy) (+)= X (M, K; rows ldx apart) times the first N rows of the blocks at W: gemm_core's
// loop over already packed B blocks, A packed once per (k block, row block) for all of them.
// Xp: X already packed by fpanel_pack (pack_a_rows' layout), or null to pack here.
template <class PB>
void fpanel_gemm_t(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx,
                   const float* Xp, const PB* W, float* Y, int64_t ldy, bool accumulate,
                   float* ws) {
  float* Ap = align64(ws);
  float* tile = align64(Ap + MC * KC);
  float* wide = align64(tile + MR<float> * nr<float>());
  const int64_t mp = (M + MR<float> - 1) / MR<float> * MR<float>;
  constexpr bool half = !std::is_same<PB, float>::value;
  // Three or more micro-tile rows will read a half block: widen it once (exact, the values ldp
  // gives) and run the float32 kernel on it: the same multiply-adds, without a conversion per
  // load. For one or two rows of tiles (a batched decode step) the widened copy, twice the bytes
  // and past L1, costs more than the conversions. With X packed whole, every row block of a k
  // block takes the same widened copy (jb outside ic), so a half block is widened once, not once
  // per MC rows (perf/RESULTS.md has the measurements behind both choices).
  if (half && Xp && M > 2 * MR<float>) {
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = K - pc < KC ? K - pc : KC;
      const bool first = pc == 0 && !accumulate;
      for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
        const PB* Bk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS + pc * PANEL_ROWS;
        const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
        for (int64_t i = 0; i < kc * PANEL_ROWS; i += lanes<float>())
          storeu(wide + i, ldp<vf>(Bk + i));
        for (int64_t ic = 0; ic < M; ic += MC) {
          const int64_t mc = M - ic < MC ? M - ic : MC;
          fpanel_tiles<float>(mc, nb, kc, Xp + pc * mp + ic * kc, wide, Y + ic * ldy + jb, ldy,
                              first, tile, false);
        }
      }
    }
    return;
  }
  for (int64_t pc = 0; pc < K; pc += KC) {
    const int64_t kc = K - pc < KC ? K - pc : KC;
    const bool first = pc == 0 && !accumulate;  // the cell takes its first block's sum as is
    for (int64_t ic = 0; ic < M; ic += MC) {
      const int64_t mc = M - ic < MC ? M - ic : MC;
      const float* Ak = Xp ? Xp + pc * mp + ic * kc : Ap;
      if (!Xp) pack_a<float, float>(mc, kc, X + ic * ldx + pc, ldx, 1, Ap);
      for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
        const PB* Bk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS + pc * PANEL_ROWS;
        const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
        if (half && mc > 2 * MR<float>) {
          for (int64_t i = 0; i < kc * PANEL_ROWS; i += lanes<float>())
            storeu(wide + i, ldp<vf>(Bk + i));
          fpanel_tiles<float>(mc, nb, kc, Ak, wide, Y + ic * ldy + jb, ldy, first, tile, false);
        } else {
          fpanel_tiles<PB>(mc, nb, kc, Ak, Bk, Y + ic * ldy + jb, ldy, first, tile, true);
        }
      }
    }
  }
}

// y (N) (+)= x (K) times the first N rows of the blocks at W: fpanel_tiles' sequence for one row
// (ukernel_rows<float, 1>'s chain per k block, the block sums added in order). A k block's chain
// starts from 0 whichever block precedes it, so several blocks' chains run side by side and their
// sums join the cell in order afterwards: the same bits for any GEMV_PANELS x GEMV_KBLOCKS.
// What the pass shape buys is memory-level parallelism: each k block of a panel is its own
// stream (blocks lie KC * PANEL_ROWS values apart), and one core keeps more lines in flight over
// several streams than over one: 1 panel x 4 blocks read fastest on AVX2 and AVX-512 hosts
// (perf/RESULTS.md). The SSE2 build keeps 2 x 2 (not timed).
constexpr int GEMV_PANELS = VBYTES >= 32 ? 1 : 2;
constexpr int GEMV_KBLOCKS = VBYTES >= 32 ? 4 : 2;

// One pass: P panels from column jr of a row block times NB k blocks from pc into tot. Only the
// matrix's last k block may be short, so blocks 0..NB-2 of a pass hold KC values.
template <class PB, int P, int NB>
inline void fpanel_gemv_pass(const PB* blk, int64_t K, int64_t pc, int64_t jr, const float* x,
                             vf (&tot)[GEMV_PANELS][NV<float>], bool first) {
  constexpr int L = lanes<float>();
  constexpr int64_t NR = nr<float>();
  constexpr int NVF = NV<float>;
  const int64_t klast = pc + (NB - 1) * KC;
  const int64_t kcl = K - klast < KC ? K - klast : KC;  // the last block's length
  const PB* b[NB];
  const float* xk[NB];
  for (int h = 0; h < NB; ++h) {
    const int64_t kh = pc + h * KC, kc = h == NB - 1 ? kcl : KC;
    b[h] = blk + kh * PANEL_ROWS + jr * kc;  // panel p at + p * NR * kc
    xk[h] = x + kh;
  }
  vf acc[NB][P][NVF];
  for (int h = 0; h < NB; ++h)
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < NVF; ++j) acc[h][p][j] = vf{};
  int64_t k = 0;
  for (; k < kcl; ++k)
    for (int h = 0; h < NB; ++h) {
      const float xv = xk[h][k];
      const int64_t kc = h == NB - 1 ? kcl : KC;
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < NVF; ++j)
          acc[h][p][j] += ldp<vf>(b[h] + p * NR * kc + k * NR + j * L) * xv;
    }
  for (; k < KC; ++k)  // the full blocks past a short last one
    for (int h = 0; h < NB - 1; ++h) {
      const float xv = xk[h][k];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < NVF; ++j)
          acc[h][p][j] += ldp<vf>(b[h] + p * NR * KC + k * NR + j * L) * xv;
    }
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < NVF; ++j) {
      tot[p][j] = first ? acc[0][p][j] : tot[p][j] + acc[0][p][j];
      for (int h = 1; h < NB; ++h) tot[p][j] = tot[p][j] + acc[h][p][j];
    }
}

template <class PB, int P>
void fpanel_gemv_col(const PB* blk, int64_t K, int64_t jr, const float* x,
                     vf (&tot)[GEMV_PANELS][NV<float>], bool accumulate) {
  static_assert(GEMV_KBLOCKS >= 1 && GEMV_KBLOCKS <= 4, "passes of 1 to 4 k blocks");
  for (int64_t pc = 0; pc < K; pc += GEMV_KBLOCKS * KC) {
    const int64_t left = (K - pc + KC - 1) / KC;
    const bool first = pc == 0 && !accumulate;
    switch (left < GEMV_KBLOCKS ? left : GEMV_KBLOCKS) {
      case 4: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 4 ? 1 : 4>(blk, K, pc, jr, x, tot, first); break;
      case 3: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 3 ? 1 : 3>(blk, K, pc, jr, x, tot, first); break;
      case 2: fpanel_gemv_pass<PB, P, GEMV_KBLOCKS < 2 ? 1 : 2>(blk, K, pc, jr, x, tot, first); break;
      default: fpanel_gemv_pass<PB, P, 1>(blk, K, pc, jr, x, tot, first); break;
    }
  }
}

template <class PB>
void fpanel_gemv_t(int64_t N, int64_t K, const float* x, const PB* W, float* y, bool accumulate) {
  constexpr int L = lanes<float>();
  constexpr int64_t NR = nr<float>();
  constexpr int NVF = NV<float>;
  constexpr int64_t CW = GEMV_PANELS * NR;  // columns a pass
  static_assert(GEMV_PANELS == 1 || GEMV_PANELS == 2, "passes of one or two panels");
  static_assert(PANEL_ROWS % CW == 0, "a row block holds whole passes");
  for (int64_t jb = 0; jb < N; jb += PANEL_ROWS) {
    const PB* blk = W + (jb / PANEL_ROWS) * K * PANEL_ROWS;
    const int64_t nb = N - jb < PANEL_ROWS ? N - jb : PANEL_ROWS;
    for (int64_t jr = 0; jr < nb; jr += CW) {
      const int64_t w = nb - jr < CW ? nb - jr : CW;
      const int np = int((w + NR - 1) / NR);  // panels this pass
      vf tot[GEMV_PANELS][NVF];
      float edge[CW];
      for (int64_t i = 0; i < CW; ++i) edge[i] = accumulate && i < w ? y[jb + jr + i] : 0.f;
      for (int p = 0; p < GEMV_PANELS; ++p)
        for (int j = 0; j < NVF; ++j) tot[p][j] = loadu<vf>(edge + p * NR + j * L);
      if (GEMV_PANELS > 1 && np == 2)
        fpanel_gemv_col<PB, GEMV_PANELS < 2 ? 1 : 2>(blk, K, jr, x, tot, accumulate);
      else
        fpanel_gemv_col<PB, 1>(blk, K, jr, x, tot, accumulate);
      for (int p = 0; p < np; ++p)
        for (int j = 0; j < NVF; ++j) storeu(edge + p * NR + j * L, tot[p][j]);
      for (int64_t i = 0; i < w; ++i) y[jb + jr + i] = edge[i];
    }
  }
}

void fpanel_gemm(int kind, int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx,
                 const float* Xp, const void* W, float* Y, int64_t ldy, bool accumulate,
                 float* ws) {
  if (M <= 0 || N <= 0) return;
  if (M == 1) {  // the same cells' chains, without packing the row
    if (kind == PANEL_F32)
      return fpanel_gemv_t(N, K, X, static_cast<const float*>(W), Y, accumulate);
    if (kind == PANEL_BF16)
      return fpanel_gemv_t(N, K, X, static_cast<const BF16*>(W), Y, accumulate);
    return fpanel_gemv_t(N, K, X, static_cast<const F16*>(W), Y, accumulate);
  }
  if (kind == PANEL_F32)
    return fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const float*>(W), Y, ldy, accumulate,
                         ws);
  if (kind == PANEL_BF16)
    return fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const BF16*>(W), Y, ldy, accumulate,
                         ws);
  fpanel_gemm_t(M, N, K, X, ldx, Xp, static_cast<const F16*>(W), Y, ldy, accumulate, ws);
}

// X (M x K) packed once as fpanel_gemm_t packs each (k block, row block) of it: a prefill
// projection's tasks then share one copy instead of each packing its own (a copy of X per 256
// weight rows).
int64_t fpanel_packed_elems(int64_t M, int64_t K) { return packed_a_elems<float>(M, K); }
void fpanel_pack(int64_t M, int64_t K, const float* X, int64_t ldx, float* dst) {
  pack_a_rows<float, float>(M, K, 0, M, X, ldx, 1, dst);
}

// packed A (MC x KC), one edge tile and a widened half block, 64-byte aligned: the blocks are B,
// already packed
int64_t fpanel_ws_elems() {
  return MC * KC + MR<float> * nr<float>() + KC * PANEL_ROWS + 4 * 64;
}

}  // namespace ALGENTA_ISA_NS
}  // namespace kern
}  // namespace algenta
