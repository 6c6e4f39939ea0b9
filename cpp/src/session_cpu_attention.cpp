// The CPU engine's attention, shared by decode and prefill so the KV cache holds the same bits
// either way: each head of a position's fused q|k|v vector biased, normed and rotated (RoPE)
// in place, k and v written to the slot's cache in its format (head_rope_store); then causal
// attention, softmax(q K[lo..n)^T * scale) V[lo..n), the G query heads of a KV head (and, in
// prefill, several rows) reading the keys and values once for all of them (attend_rows).
// Numerics: each query's dot products, softmax and weighted sums run in the order they run for
// that query alone, whatever group it is in (SessionOps::kv_dots / kv_axpys); RMSNorm sums
// squares in double; RoPE reads the shared host-built table.
// Never materialized: more than one score row a query (p + 1 floats, in the thread's scratch).

#include <algorithm>

#include "algenta/session_math.hpp"
#include "session_cpu.hpp"

namespace algenta {
namespace residentk {
namespace cpu_engine {

// In place on one head vector h (Dh): its bias b (or none), per-head RMSNorm with w where the
// family has one, then rotate-half RoPE at p from table `rope`.
inline void CpuSession::norm_rope(float* h, const float* b, const float* w, const float* rope,
                                  int64_t p) const {
  const int64_t Dh = c_.d_head, half = Dh / 2;
  if (b)
    for (int64_t i = 0; i < Dh; ++i) h[i] += b[i];
  if (qk_norm_) rmsnorm(h, w, Dh, c_.rms_eps, h);
  const float* cs = rope + p * rope_hw_;
  const float* sn = rope + cap_ * rope_hw_ + p * rope_hw_;
  for (int64_t i = 0; i < half; ++i)
    session_math::rope_pair(h[i], h[i + half], cs[i], sn[i], &h[i], &h[i + half]);
}

// Head h of one position's fused q|k|v vector v (Dh) at position p: a query head is normed
// and rotated in place; a key head is too, then written to its KV slot; a value head is
// written as is. Decode and prefill both go through here, so the cache holds the same bits.
void CpuSession::head_rope_store(const Layer& L, int64_t Kc, int64_t Vc, int64_t h, float* v,
                                 int64_t p) {
  const int64_t Hq = c_.h_q, Hkv = c_.h_kv, Dh = c_.d_head;
  const float* b = L.qkv_b.p ? L.qkv_b.p + h * Dh : nullptr;
  if (h < Hq) {
    norm_rope(v, b, L.q_norm.p, L.rope, p);
  } else if (h < Hq + Hkv) {
    norm_rope(v, b, L.k_norm.p, L.rope, p);
    kv_.store(Kc + ((h - Hq) * cap_ + p) * Dh, v, Dh);
  } else {
    if (b)
      for (int64_t i = 0; i < Dh; ++i) v[i] += b[i];
    kv_.store(Vc + ((h - Hq - Hkv) * cap_ + p) * Dh, v, Dh);
  }
}

// The first key a query at position n - 1 sees: n - sliding_window on a sliding layer, else 0.
inline int64_t CpuSession::first_key(const Layer& L, int64_t n) const {
  return L.slides && n > c_.sliding_window ? n - c_.sliding_window : 0;
}

// One query's raw dot products s (n) with its keys -> its softmax weights, in place: scaled,
// soft-capped where the family caps them, then SessionOps::softmax.
inline void CpuSession::softmax_weights(const Simd& S, float* s, int64_t n) const {
  const float scale = attn_scale_, cap = float(c_.attn_softcap);
  for (int64_t j = 0; j < n; ++j) s[j] = s[j] * scale;
  if (cap > 0.f) S.softcap(s, n, cap);
  S.softmax(s, n);
}

// out (Dh) = softmax(q . K[lo..n) * scale) V[lo..n) for the queries of rows [r0, r1) (positions
// p0 + r; a decode step's one row: r0 = 0, r1 = 1) in the G query heads that share KV head g,
// up to kMaxAttendQueries at once reading the keys and values once for all of them
// (SessionOps::kv_dots / kv_axpys): each query's products, sums and their order its own,
// whatever group it is in. s: room for min(G (r1 - r0), kMaxAttendQueries) rows of p0 + r1
// scores.
void CpuSession::attend_rows(const Simd& S, const Layer& L, const float* QKV, int64_t Kc,
                             int64_t Vc, int64_t g, int64_t r0, int64_t r1, int64_t p0, float* s,
                             float* A) const {
  const int64_t Dh = c_.d_head, G = c_.h_q / c_.h_kv, HD = c_.h_q * Dh;
  const int64_t K = Kc + g * cap_ * Dh, V = Vc + g * cap_ * Dh, total = (r1 - r0) * G;
  for (int64_t t0 = 0; t0 < total; t0 += kMaxAttendQueries) {
    const int nq = int(std::min<int64_t>(kMaxAttendQueries, total - t0));
    const float* q[kMaxAttendQueries];
    float* out[kMaxAttendQueries];
    int64_t lo[kMaxAttendQueries], hi[kMaxAttendQueries];
    for (int t = 0; t < nq; ++t) {  // row-major: lo and hi never decrease with t
      const int64_t r = r0 + (t0 + t) / G, h = g * G + (t0 + t) % G;
      q[t] = QKV + r * q_rows_ + h * Dh;
      out[t] = A + r * HD + h * Dh;
      hi[t] = p0 + r + 1;
      lo[t] = first_key(L, hi[t]);
    }
    // the keys any of them sees [j0, j1), and those all of them see [c0, c1)
    const int64_t j0 = lo[0], j1 = hi[nq - 1], c0 = lo[nq - 1], c1 = hi[0], ld = j1 - j0;
    kv_.dots(S, q, nq, K, Dh, j0, j1, s, ld);
    for (int t = 0; t < nq; ++t) {
      softmax_weights(S, s + t * ld + (lo[t] - j0), hi[t] - lo[t]);
      std::fill(out[t], out[t] + Dh, 0.f);
    }
    // each query's keys in order: those before the common part alone, the common part
    // together, the rest alone
    const bool common = c0 < c1;
    for (int t = 0; t < nq; ++t)
      kv_.axpys(S, s + t * ld + (lo[t] - j0), ld, 1, V, Dh, lo[t], common ? c0 : hi[t],
                &out[t]);
    if (!common) continue;
    kv_.axpys(S, s + (c0 - j0), ld, nq, V, Dh, c0, c1, out);
    for (int t = 0; t < nq; ++t)
      kv_.axpys(S, s + t * ld + (c1 - j0), ld, 1, V, Dh, c1, hi[t], &out[t]);
  }
}

}  // namespace cpu_engine
}  // namespace residentk
}  // namespace algenta
