// The CPU engine's test hooks (session.hpp: cpu_weight_path, cpu_int8_products, cpu_int8_gemm,
// cpu_bf16_products, cpu_gate, cpu_sum_sq, cpu_panel_products), each running the session's own
// kernels on caller data, so the tests check exactly what a session multiplies; and
// cpu_read_bandwidth, the roofline the decode benchmark divides by, read from the weights' own
// kind of memory (an Arena in huge pages).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "session_cpu.hpp"

namespace algenta {
namespace residentk {

using namespace cpu_engine;

namespace {
// The test hooks' one body: w (rows, n) in format f (int8 with its block scales, `sc`) put into
// the session's own panels, X (M, n) prepared as a step or a prefill prepares its activations,
// and Y (M, rows) = X w^T through the session's own kernels. `in` keeps the prepared activations
// (they live in `act`) for the hooks that return them.
struct HookProducts {
  ActScratch act;
  kern::PanelAct in;
  HookProducts(Dtype f, const void* w, const float* sc, int64_t rows, int64_t n, const float* X,
               int64_t M, float* Y, bool packed = false)
      : act(f, 1, n, M) {
    Arena arena;
    size_t need = 0;
    WMat(f, rows, n, &arena, &need);
    arena.open(need);
    WMat m(f, rows, n, &arena);
    // a row's elements as put_row takes them: q4_0's codes one a byte, like int8's
    const size_t row_bytes = size_t(n) * size_t(f == Dtype::Q4_0 ? 1 : dtype_info(f).bytes);
    const int64_t blocks = (n + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK;
    for (int64_t o = 0; o < rows; ++o)
      m.put_row(o, static_cast<const char*>(w) + size_t(o) * row_bytes,
                sc ? sc + o * blocks : nullptr);
    in = act.prepare(simd(), X, M, n, n, 0);
    const kern::PanelOps& P = m.ops();
    Buf pk(packed && P.pack && M > 1 ? P.packed_elems(M, n) : 0);
    if (pk.n) {  // as prefill's act_rows
      P.pack(M, n, in, pk.p);
      in.packed = pk.p;
    }
    const ABuf<char> ws(m.ops().ws_bytes(m.cols));
    m.gemm(M, in, 0, rows, Y, rows, false, ws.p);
    in.packed = nullptr;  // pk ends here
  }
};
}  // namespace

const char* cpu_weight_path(Dtype f) { return simd().panels[kern::panel_index(f)].path; }

void cpu_int8_products(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* x,
                       float* y, int8_t* xq, float* xs) {
  const HookProducts h(Dtype::Int8, q, sc, rows, n, x, 1, y);
  std::memcpy(xq, h.in.q, size_t(n));
  const int64_t blocks = (n + RESIDENT_INT8_BLOCK - 1) / RESIDENT_INT8_BLOCK;
  std::memcpy(xs, h.in.s, size_t(blocks) * sizeof(float));
}

void cpu_int8_gemm(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* X,
                   int64_t M, float* Y) {
  HookProducts(Dtype::Int8, q, sc, rows, n, X, M, Y);
}

void cpu_q4_gemm(const uint8_t* codes, const float* sc, int64_t rows, int64_t n, const float* X,
                 int64_t M, float* Y) {
  HookProducts(Dtype::Q4_0, codes, sc, rows, n, X, M, Y);
}

void cpu_bf16_products(const uint16_t* w, int64_t rows, int64_t n, const float* x, float* y,
                       uint16_t* xb) {
  const HookProducts h(Dtype::BF16, w, nullptr, rows, n, x, 1, y);
  std::memcpy(xb, h.in.b, size_t(n) * sizeof(uint16_t));
}

void cpu_gate(bool gelu, const float* g, const float* u, int64_t n, float* out) {
  (gelu ? simd().gelu_mul : simd().silu_mul)(g, u, nullptr, nullptr, out, n);
}
double cpu_sum_sq(const float* x, int64_t n) { return simd().sum_sq(x, n); }

void cpu_panel_products(Dtype f, const void* w, int64_t rows, int64_t n, const float* X,
                        int64_t M, float* Y, bool packed) {
  HookProducts(f, w, nullptr, rows, n, X, M, Y, packed);
}

double cpu_read_bandwidth(int64_t bytes, int reps) {
  const int64_t n = std::max<int64_t>(bytes / int64_t(sizeof(float)), 1 << 16);
  // in the weights' kind of memory (an Arena: huge pages), so the roofline is decode's own
  Arena arena;
  arena.open(size_t(n) * sizeof(float));
  Buf a = arena.take<float>(n);
  const int nt = std::max(1, omp_get_max_threads());
  // Touch the pages from the threads that will read them (first-touch placement).
#pragma omp parallel num_threads(nt)
  {
    int64_t r0, r1;
    split(n, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t i = r0; i < r1; ++i) a.p[i] = float(i & 7);
  }
  const Simd& S = simd();
  double best = 0.0;
  volatile float sink = 0.f;
  // each rep reads in every pattern (one prefetched stream, one plain, two and four plain side
  // by side)
  static constexpr struct { int streams; bool prefetch; } patterns[] = {
      {1, true}, {1, false}, {2, false}, {4, false}};
  for (int rep = 0; rep < std::max(1, reps); ++rep)
    for (const auto& pat : patterns) {
      const double t0 = omp_get_wtime();
      float tot = 0.f;
#pragma omp parallel num_threads(nt) reduction(+ : tot)
      {
        int64_t r0, r1;
        split(n, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
        tot += S.sum(a.p + r0, r1 - r0, pat.streams, pat.prefetch);
      }
      const double dt = omp_get_wtime() - t0;
      sink = sink + tot;
      if (dt > 0) best = std::max(best, double(n) * sizeof(float) / dt);
    }
  (void)sink;
  return best;
}

}  // namespace residentk
}  // namespace algenta
