// The CUDA resident decode engine: the session's model families with float32 activations,
// weight matrices resident in float32, bfloat16, float16 or int8 (SessionConfig::weights: the
// CPU engine's formats, stored by the same conversion, session_weights.hpp's narrow_row) and a
// fixed-capacity KV cache in float32, bfloat16 or float16 (SessionConfig::kv), all in device
// memory for the session's whole life; the same model, stage for stage and format for format,
// as the CPU engine (cpp/src/session_cpu.cpp), which is its reference. The registry, the
// refusals and the position are SessionBase's (cpp/include/algenta/session_base.hpp), shared
// with the CPU engine.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, G = Hq/Hkv, Dh d_head,
// Q = (Hq + 2*Hkv)*Dh fused q/k/v rows, A = Hq*Dh, F d_ff, L layers, V vocab, T capacity,
// P position, M prefill block rows, S split-K splits.
//
// The model is any family of SessionConfig::arch (session_weights.hpp's ArchSpec table), as the
// CPU engine computes it: biases added where the table has them (q/k/v in k_qk_norm_rope, o and
// down in k_matvec_residual's epilogue, gate/up in the gate), q/k norms only where the family
// has them, the GELU gate, sliding windows and soft caps inside k_attn_partial and
// k_head_argmax, scaled embeddings in k_embed, a second RoPE table for sliding layers with a
// base of their own, and for the sandwich families (Gemma 2/3) o_proj and down written to a
// buffer that k_out_norm_residual norms onto the residual: two more launches a layer
// (decode_stages).
//
// Decode launches, per token, exactly the stages residentk_dispatch_budget counts (Qwen3):
//   fixed:     k_embed (x = E[tok])  ...  k_rmsnorm_rows (xf)  ...  k_head_argmax (logits, argmax)
//   per layer: 1 k_norm_qkv        qkv = Wqkv rmsnorm(x)         (norm fused: each block stages it)
//              2 k_qk_norm_rope    per head q/k RMSNorm + RoPE; K and V written to slot P in place
//              3 k_attn_partial    softmax(q K[0..P]^T / sqrt(Dh)) V[0..P], online softmax
//                (+ k_attn_merge when residentk_splitk_should_split(P+1): S partials, then merge,
//                 the residentk_dispatch_budget_deep count)
//              4 k_matvec_residual x += Wo attn
//              5 k_norm_gateup     act = silu(Wg rmsnorm(x)) * (Wu rmsnorm(x))
//              6 k_matvec_residual x += Wd act
// Never materialized: the normed x (each block rebuilds it in shared memory, D floats, instead
// of a separate launch), gate and up separately, any [T]-sized score row (online softmax keeps a
// running max and sum per warp), the logits on the host in greedy decoding (the head kernel's
// last block reduces the per-block maxima and leaves the argmax on the device).
//
// Each step's token, position, slot and split count reach the device in one copy into a row
// (StepRow) the kernels read, so a step's launch sequence depends on nothing else: two CUDA graphs
// (the standard path; the split-K path, its grid sized once to the plan's maximum split count, the
// blocks past this step's count exiting at once) are captured when the session opens and one is
// replayed per token. ALGENTA_CUDA_GRAPHS=0 at session open launches kernel by kernel instead.
//
// Slots: a session of several holds one KV region a slot (slot s at s * kv_slot_stride
// elements). A batched step (step_slots) runs the same stages over up to step_rows rows of any
// slots and positions, each its own row; the matvecs are the same kernels at width PASS_ROWS
// (each weight load multiplied by up to that many staged rows, each row's sums in the one-row
// order), attention a block per (head, split, row) on the path a lone step at that position
// takes. Every row's logits are therefore the bits a lone step gives. Such a session also
// prefills through these kernels (step_rows tokens a launch sequence), so a sequence's bits do
// not depend on how its prompt was split or whether a prefix was copied; a session of one slot
// prefills through the GEMMs below.
//
// Prefill runs blocks of M <= PREFILL_BLOCK tokens as GEMMs: k_gemm_narrow (one weight row per
// warp, NARROW_ROWS activation rows per pass, for M < 32) or k_gemm_wide (64 x 64 shared-memory
// tiles), as residentk_prefill_gemm_use_narrow_tile decides; bf16 weights take lossk's tile GEMM
// on tensor cores instead of k_gemm_wide, int8 weights k_gemm_q8 (dp4a) at every M. Attention
// is k_attn_partial with one split per (head, row), causal through n_keys = P + row + 1.
//
// Numerics: float32 activations; RMSNorm sums squares in double and rounds the inverse once, as
// the CPU engine; RoPE uses the same host-built table. Each weight format multiplies what the
// CPU engine's does (bf16 activations for bf16 weights, Q8_0 x Q8_0 for int8: see
// session_matvec.cuh and session_stage.cuh). A 16-bit KV cache holds each key and value rounded once as it is written
// (session_math::kv_narrow, the CPU engine's rule); attention widens them and accumulates in
// float32. Dot products reduce in a different order
// than the CPU engine (lanes, then a warp shuffle), so logits agree with it to float32 rounding
// times the reduction widths, not bit for bit (the tests' tolerance is documented in
// tests/test_residentk_cuda.py).
//
// Limits: shapes residentk_shape_check accepts (the largest staged vector max(D, F, A) fits the
// compiled shared-memory tier, and the device's opt-in per-block limit, checked at open). All
// host-side sizes, grids and offsets come from session_cuda_plan.hpp (tested on the CPU).
// Prefill attention is the decode kernel run once per (head, row), not a tiled flash kernel:
// correct at any length, but O(M * P) key reads per layer with no reuse across rows.
// Errors: every CUDA call is checked; a failure throws StatusError 608 naming the call. A host
// without a usable device gets 605 before any allocation. Nothing here aborts or exits.
//
// Verified: every kernel and host path here runs in CI on the CPU emulator (cuda/emu,
// ALGENTA_CUDA_EMU) in forward, reverse and random thread order against the CPU engine. Not
// covered there: device expf rounding, memory ordering between blocks beyond what the
// emulator's sequentially consistent atomics give, timing. Those need a device run
// (tests/test_residentk_cuda.py and perf/bench_decode_gpu.py, see README).
//
// Files: this one holds the engine class (opening: plan, checks, allocations, kernel loading,
// graph capture; weight placement in the arena; the KV cache's prefix copy), its members
// defined in session_cuda_decode.cuh (decode's rows, launch sequence and graphs) and
// session_cuda_prefill.cuh (prefill on GEMMs), its host plumbing in session_cuda_host.cuh;
// the kernels are session_kernels.cuh's, one stage a header. One translation unit: each kernel
// template is instantiated, loaded (load_kernel) and launched in the same one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "algenta/residentk.hpp"
#include "algenta/session_base.hpp"
#include "algenta/session_weights.hpp"
#include "algenta/status_error.hpp"
#include "lossk_tile.cuh"  // the tile GEMM on tensor cores, for the bf16 prefill
#include "session_kernels.cuh"
#include "session_cuda_host.cuh"

namespace algenta {
namespace residentk {

namespace {

using namespace cudaplan;

// ---- host side ------------------------------------------------------------------------------

static_assert(GEMM_BM == GEMM_BN, "k_gemm_wide loads both tiles with one index: BM == BN");
static_assert(GEMM_THREADS == 256 && GEMM_BM == 64 && GEMM_BN == 64,
              "k_gemm_wide: 16 x 16 threads, each 4 x 4 outputs of a 64 x 64 tile");
static_assert((GEMM_BM * GEMM_BK) % GEMM_THREADS == 0, "k_gemm_wide: whole tile loads per thread");
static_assert(MATVEC_THREADS % WARP == 0 && MATVEC_WARPS == MATVEC_THREADS / WARP &&
                  MATVEC_WARPS <= 32,
              "matvec kernels: whole warps, one partial per warp in a 32-entry shared array");
static_assert(ATTN_THREADS == ATTN_WARPS * WARP && ATTN_WARPS <= 32,
              "k_attn_partial: whole warps; per-warp (m, l) pairs in the plan's smem size");
static_assert(ROW_THREADS % WARP == 0 && ROW_THREADS <= 1024,
              "block reductions: whole warps, at most 32 of them");

class CudaSession final : public SessionBase {
 public:
  CudaSession(const SessionConfig& c, int64_t max_ctx, int64_t slots)
      : SessionBase(c, max_ctx, slots) {
    const CudaBackend& be = cuda_backend();
    if (!be.usable)
      refuse(RESIDENT_ERR_NO_ACCELERATOR,
             "device='cuda': the CUDA backend is built in but this host has no usable CUDA "
             "device (" + be.why + "); use device='cpu'");
    CK(cudaGetDevice(&dev_));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, dev_));
    plan_ = make_plan(c, max_ctx, prop.multiProcessorCount, slots);
    if (plan_.status != RESIDENT_OK) refuse(plan_.status, plan_.why);

    // Shared memory per block: the staged vector (max(D, F, A) values, in its format's layout)
    // plus the kernels' own static arrays (under 1 KiB) must fit the device's opt-in limit.
    const int64_t staged_bytes = plan_.staged_bytes;
    if (staged_bytes + 1024 > int64_t(prop.sharedMemPerBlockOptin))
      refuse(RESIDENT_ERR_DIMENSION_TOO_LARGE,
             "largest staged vector (" + std::to_string(staged_bytes) + " bytes) exceeds " +
                 prop.name + "'s per-block shared memory (" +
                 std::to_string(prop.sharedMemPerBlockOptin) + " bytes)");
    // The row kernels of a session of several slots stage as many rows as fit beside that.
    pass_rows_ = int(matvec_pass_rows(stage_stride(plan_.staged_floats, c.weights),
                                      int64_t(prop.sharedMemPerBlockOptin)));

    // Everything the session will ever hold, checked against free device memory before the
    // first allocation, so an oversized session is one clear 608 rather than a partial open.
    const int64_t bytes = plan_.weight_bytes + plan_.kv_elems * plan_.kv_elem_bytes +
                          4 * (plan_.rope_floats + plan_.act_floats + plan_.prefill_floats) +
                          8 * plan_.head_mv.grid + int64_t(sizeof(StepRow)) * plan_.row_entries +
                          int64_t(sizeof(Control));
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    if (bytes > int64_t(free_b))
      refuse(RESIDENT_ERR_LAUNCH_FAILED,
             "the session needs " + std::to_string(bytes) + " bytes of device memory, " +
                 std::to_string(free_b) + " are free on " + prop.name);

    stream_.create();
    // Nothing below is zeroed but the control block: every weight is written before the first
    // token can run (the registry refuses a step until all are), KV slots are written before
    // attention reads them, and every scratch cell is written by the kernel before its reader.
    weights_dev_.alloc(plan_.weight_bytes, "cudaMalloc(weights)");
    kv_.alloc(plan_.kv_elems * plan_.kv_elem_bytes, "cudaMalloc(kv cache)");
    rope_.alloc(4 * plan_.rope_floats, "cudaMalloc(rope table)");
    act_.alloc(4 * plan_.act_floats, "cudaMalloc(decode activations)");
    pre_.alloc(4 * plan_.prefill_floats, "cudaMalloc(prefill activations)");
    blk_idx_.alloc(8 * plan_.head_mv.grid, "cudaMalloc(argmax scratch)");
    rows_.alloc(int64_t(sizeof(StepRow)) * plan_.row_entries, "cudaMalloc(step rows)");
    ctl_.alloc(sizeof(Control), "cudaMalloc(control)");
    CK(cudaMemsetAsync(ctl_.p, 0, sizeof(Control), stream_));
    host_.alloc(1, "cudaMallocHost(argmax slot)");
    host_rows_.alloc(plan_.row_entries, "cudaMallocHost(step rows)");
    staging_.alloc(STAGING_FLOATS, "cudaMallocHost(weight staging)");
    if (c.weights != Dtype::F32) {  // the rows in their format on their way up, and int8 scales
      narrow_.alloc(STAGING_FLOATS * plan_.elem_bytes, "cudaMallocHost(narrow staging)");
      if (c.weights == Dtype::Int8) scales_.alloc(STAGING_FLOATS, "cudaMallocHost(int8 scales)");
    }

    const std::vector<float> rope = rope_table(c, plan_.capacity);
    upload(rope_.f(), rope.data(), int64_t(rope.size()) * 4);
    if (c.rope_local_theta > 0.0) {  // sliding layers' own base, after the global table
      const std::vector<float> local = rope_table(c, plan_.capacity, true);
      upload(rope_.f() + rope.size(), local.data(), int64_t(local.size()) * 4);
    }
    const ArchSpec& arch = arch_spec(c.arch);
    gelu_ = arch.act == residentk::Act::GeluTanh;  // (Act alone: the prefill rows' struct)
    sandwich_ = arch.sandwich;
    embed_scale_ = arch.embed_scaled ? float(std::sqrt(double(c.d_model))) : 0.f;
    attn_scale_ = float(c.attn_scale > 0.0 ? c.attn_scale : 1.0 / std::sqrt(double(c.d_head)));

    const int optin = int(prop.sharedMemPerBlockOptin);
    load_kernel(k_rmsnorm_rows, "k_rmsnorm_rows", 0);
    // The KV format's two kernels, chosen once (a format's kernel only ever reads its own
    // element type).
    switch (c.kv) {
      case Dtype::BF16: use_kv<Dtype::BF16>(optin); break;
      case Dtype::F16: use_kv<Dtype::F16>(optin); break;
      default: use_kv<Dtype::F32>(optin); break;  // f32 (session_open_status refused the rest)
    }
    load_kernel(k_attn_merge, "k_attn_merge", 0);
    load_kernel(k_gate_act, "k_gate_act", 0);
    load_kernel(k_out_norm_residual, "k_out_norm_residual", 0);
    load_kernel(k_bias_residual, "k_bias_residual", 0);
    by_format([&](auto f) { load_format_kernels<decltype(f)::value, 1>(optin); });
    if (plan_.slots > 1)
      by_format([&](auto f) { load_format_kernels<decltype(f)::value, PASS_ROWS>(optin); });

    // The two decode graphs (standard path, and split-K with the split count read on the
    // device), captured once: only kernels, reading the control block when they run.
    const char* g = std::getenv("ALGENTA_CUDA_GRAPHS");
    use_graphs_ = !(g && std::string(g) == "0");
    // Decode's kernels overlap their neighbours' launch gaps on Hopper and later (gpu::launch):
    // programmatic dependent launch exists from compute capability 9.0.
    pdl_ = prop.major >= 9;
    if (use_graphs_) {
      capture(standard_, false);
      capture(deep_, true);
    }
    CK(cudaStreamSynchronize(stream_));
  }

  ~CudaSession() override {
    if (stream_.s) cudaStreamSynchronize(stream_.s);
    cudaGetLastError();  // a destructor reports nothing; leave no pending error behind
  }

  const char* device() const override { return "cuda"; }

 protected:
  // A tensor's float32 rows are staged in pinned memory a chunk at a time, converted to the
  // session's format there (narrow_row, the CPU engine's conversion) and uploaded into their
  // arena place (loading never holds a float32 copy of a whole tensor on the side).
  float* stage_weight(const TensorSpec&, int64_t, int64_t) override {
    use_device();
    return staging_.p;
  }
  void commit_weight(const TensorSpec& t, int64_t r0, int64_t r1) override {
    // The staging slots are reused by the next chunk: each upload finishes before returning.
    char* base = static_cast<char*>(weights_dev_.p);
    const int64_t cols = t.cols(), n = r1 - r0;
    const Place at = place(t);
    const int64_t row = at.row0 + r0;  // the first row in the (fused) matrix; 0 for a norm
    if (at.vector) {  // a norm, a bias, or q/k/v's part of the fused bias (from float row0)
      upload(base + at.data + (at.row0 + r0 * cols) * 4, staging_.p, n * cols * 4);
      return;
    }
    if (c_.weights == Dtype::F32) {
      upload(base + at.data + row * cols * 4, staging_.p, n * cols * 4);
      return;
    }
    const int64_t esize = plan_.elem_bytes, nb = ceil_div(cols, RESIDENT_INT8_BLOCK);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t bad = narrow_row(c_.weights, staging_.p + r * cols, cols,
                                     narrow_.p + r * cols * esize, scales_.p + r * nb);
      if (bad >= 0)
        refuse_past_range(t.name, c_.weights, staging_.p[r * cols + bad], (r0 + r) * cols + bad);
    }
    upload(base + at.data + row * cols * esize, narrow_.p, n * cols * esize);
    if (c_.weights == Dtype::Int8)
      upload(base + at.scales + row * nb * 4, scales_.p, n * nb * 4);
  }
  int64_t weight_chunk_elems() const override { return STAGING_FLOATS; }

  // Prefill (session_cuda_prefill.cuh), decode (session_cuda_decode.cuh).
  void run_prefill(int64_t slot, const int64_t* ids, int64_t n, float* logits) override;
  void run_step_slots(const int64_t* slots, const int64_t* ids, int64_t B,
                      float* logits) override;
  void run_step(int64_t id, float* logits) override;
  int64_t run_step_greedy(int64_t id) override;

  // Positions [0, n) of src's region to dst's: each (layer, K or V, head) of a region is one run
  // of T positions of Dh elements, the first n of which are copied, bits as they are.
  void run_copy_prefix(int64_t src, int64_t dst, int64_t n) override {
    use_device();
    const int64_t eb = plan_.kv_elem_bytes, run = plan_.capacity * c_.d_head;
    char* base = static_cast<char*>(kv_.p);
    for (int64_t i = 0; i < plan_.kv_slot_stride / run; ++i)
      CK(cudaMemcpyAsync(base + (dst * plan_.kv_slot_stride + i * run) * eb,
                         base + (src * plan_.kv_slot_stride + i * run) * eb,
                         size_t(n * c_.d_head * eb), cudaMemcpyDeviceToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

 private:
  static constexpr int64_t STAGING_FLOATS = int64_t(1) << 20;  // 4 MiB of pinned staging

  // An instantiated decode graph, destroyed with the session (also when opening throws).
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t kernels = 0;
    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
      if (exec) cudaGraphExecDestroy(exec);
    }
  };

  // Where a table entry lives in the weight arena (byte offsets): a float32 norm vector, or the
  // matrix its rows join from row row0 on (q, k and v share the fused wqkv rows).
  struct Place {
    bool vector = false;
    int64_t data = 0, scales = -1, row0 = 0;
  };
  Place place(const TensorSpec& t) const {
    const int64_t Dh = c_.d_head;
    const LayerOffsets* l = t.layer >= 0 ? &plan_.layers[size_t(t.layer)] : nullptr;
    auto vec = [](int64_t off) { return Place{true, off, -1, 0}; };
    auto matrix = [](const MatOffsets& m, int64_t row0) {
      return Place{false, m.data, m.scales, row0};
    };
    switch (t.field) {
      case Field::Embed: return matrix(plan_.embed, 0);
      case Field::LmHead: return matrix(plan_.head, 0);
      case Field::FinalNorm: return vec(plan_.final_norm);
      case Field::InNorm: return vec(l->in_norm);
      case Field::QProj: return matrix(l->wqkv, 0);
      case Field::KProj: return matrix(l->wqkv, c_.h_q * Dh);
      case Field::VProj: return matrix(l->wqkv, (c_.h_q + c_.h_kv) * Dh);
      case Field::QNorm: return vec(l->q_norm);
      case Field::KNorm: return vec(l->k_norm);
      case Field::OProj: return matrix(l->wo, 0);
      case Field::PostNorm: return vec(l->post_norm);
      case Field::Gate: return matrix(l->wg, 0);
      case Field::Up: return matrix(l->wu, 0);
      case Field::Down: return matrix(l->wd, 0);
      case Field::QBias: return Place{true, l->qkv_b, -1, 0};
      case Field::KBias: return Place{true, l->qkv_b, -1, c_.h_q * Dh};
      case Field::VBias: return Place{true, l->qkv_b, -1, (c_.h_q + c_.h_kv) * Dh};
      case Field::OBias: return vec(l->o_b);
      case Field::GateBias: return vec(l->g_b);
      case Field::UpBias: return vec(l->u_b);
      case Field::DownBias: return vec(l->d_b);
      case Field::AttnOutNorm: return vec(l->attn_out_norm);
      case Field::MlpOutNorm: return vec(l->mlp_out_norm);
    }
    return Place{};
  }

  // fn(Format<F>{}) for the session's weight format F: the one instantiation of each templated
  // kernel this session launches.
  template <Dtype F>
  using Format = std::integral_constant<Dtype, F>;
  template <class Fn>
  auto by_format(Fn&& fn) -> decltype(fn(Format<Dtype::F32>{})) {
    switch (c_.weights) {
      case Dtype::BF16: return fn(Format<Dtype::BF16>{});
      case Dtype::F16: return fn(Format<Dtype::F16>{});
      case Dtype::Int8: return fn(Format<Dtype::Int8>{});
      default: return fn(Format<Dtype::F32>{});  // f32 (session_open_status refused the rest)
    }
  }
  // Y (M, N) (+)= X (M, K) . W (N, K)^T in lossk's tile GEMM: bf16 wmma steps on X (float32
  // values staged as bf16) and W (bf16 rows), float32 accumulators continuing from Y.
  using Bf16PrefillTile =
      lossk::TileProduct<lossk::WMMA_BF16, float, float, lossk::ALayout::MK, __nv_bfloat16,
                         lossk::BLayout::NK, lossk::EPI_STORE, float>;

  // The format's kernels; R: the row kernels' width (1: decode's one row, PASS_ROWS: the rows of
  // a session of several slots, loaded only there).
  template <Dtype F, int R>
  void load_format_kernels(int optin) {
    load_kernel(k_norm_qkv<F, R>, "k_norm_qkv", optin);
    load_kernel(k_norm_gateup<F, R>, "k_norm_gateup", optin);
    load_kernel(k_matvec_residual<F, R>, "k_matvec_residual", optin);
    load_kernel(k_head_argmax<F, R>, "k_head_argmax", optin);
    if (R > 1) return;
    load_kernel(k_embed<F>, "k_embed", 0);
    load_kernel(k_gemm_narrow<F>, "k_gemm_narrow", 0);
    load_kernel(k_gemm_wide<F>, "k_gemm_wide", 0);
    if (F == Dtype::BF16) {
      load_kernel(k_round_bf16, "k_round_bf16", 0);
      load_kernel(lossk::k_tile<Bf16PrefillTile>, "k_tile(prefill)",
                  lossk::tile_bytes<Bf16PrefillTile>());
    }
    if (F == Dtype::Int8) {
      load_kernel(k_quantize_rows, "k_quantize_rows", 0);
      load_kernel(k_gemm_q8, "k_gemm_q8", 0);
    }
  }

  template <Dtype KV>
  void use_kv(int optin) {
    k_qk_norm_rope_ = k_qk_norm_rope<KV>;
    k_attn_partial_ = k_attn_partial<KV>;
    load_kernel(k_qk_norm_rope_, "k_qk_norm_rope", 0);
    load_kernel(k_attn_partial_, "k_attn_partial", optin);
  }

  Control* ctl() const { return static_cast<Control*>(ctl_.p); }
  // A float32 norm or bias vector and a weight matrix of the arena; W of an offset of -1 (a
  // tensor the family does not hold) is null.
  const float* W(int64_t off) const {
    if (off < 0) return nullptr;
    return reinterpret_cast<const float*>(static_cast<const char*>(weights_dev_.p) + off);
  }
  DevMat mat(const MatOffsets& m) const {
    const char* base = static_cast<const char*>(weights_dev_.p);
    return DevMat{base + m.data,
                  m.scales >= 0 ? reinterpret_cast<const float*>(base + m.scales) : nullptr};
  }
  // Dynamic shared memory of a row kernel staging nr K-vectors.
  size_t smem(int64_t K, int nr = 1) const {
    return size_t(nr == 1 ? stage_bytes(K, c_.weights) : nr * stage_stride(K, c_.weights));
  }
  const StepRow* rows() const { return static_cast<const StepRow*>(rows_.p); }
  // Layer l's K (Hkv, T, Dh) and V (Hkv, T, Dh) in slot 0's region (a row's slot adds
  // slot * kv_slot_stride elements), elements of the KV format.
  void* kcache(int64_t l) const {
    return static_cast<char*>(kv_.p) + l * plan_.kv_layer_stride * plan_.kv_elem_bytes;
  }
  void* vcache(int64_t l) const {
    return static_cast<char*>(kcache(l)) +
           c_.h_kv * plan_.capacity * c_.d_head * plan_.kv_elem_bytes;
  }
  float* A(int64_t off) const { return act_.f() + off; }
  float* P(int64_t off) const { return pre_.f() + off; }

  void launched(const char* what) { ck(cudaGetLastError(), what); }
  // The CUDA current device is per host thread: a call from another thread (or after the caller
  // switched devices) must run on the device this session's memory lives on.
  void use_device() { CK(cudaSetDevice(dev_)); }

  // Host -> device on the session's stream, finished before returning (src may be reused).
  void upload(void* dst, const void* src, int64_t bytes) {
    CK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  // ---- decode: its rows, launch sequence and graphs (session_cuda_decode.cuh) ----------------
  bool put_row(int64_t r, int64_t slot, int64_t tok, int64_t pos);
  void set_rows(int64_t n);
  int64_t run_rows(int64_t M, int64_t head_from);
  void decode(int64_t id);
  void capture(Graph& out, bool deep);
  int64_t enqueue_decode(bool deep);
  template <Dtype Fw, int R>
  int64_t enqueue_rows(int64_t M, int nr, bool deep, int64_t head_from);
  // the launches decode and prefill share
  void norm_rope(const LayerOffsets& l, int64_t li, float* qkv, int64_t M, bool pdl);
  void attention(int64_t li, const float* qkv, int64_t M, int64_t S_grid, float* out, bool pdl);
  template <Dtype Fw, int R>
  int64_t matvec_residual(const MatvecLaunch& mv, const MatOffsets& w, float* in, int64_t K,
                          int64_t b_off, int64_t norm_off, int64_t M, int nr, bool pdl,
                          const char* what);
  int64_t out_norm(float* X, const float* Y, int64_t w_off, int64_t M, bool pdl);
  template <Dtype Fw, int R>
  int64_t head(const float* X, int64_t M, int nr, bool pdl);

  // ---- prefill of a session of one slot, on GEMMs (session_cuda_prefill.cuh) -----------------
  // An activation matrix (M, K) as F's prefill GEMMs take it: its float32 values, and for int8
  // its codes (M, ldq) and block scales (M, ldq / 32).
  struct Act {
    const float* x;
    const int8_t* q = nullptr;
    const float* s = nullptr;
    int64_t ldq = 0;
  };
  template <Dtype F>
  Act as_consumed(float* X, int64_t M, int64_t K);
  template <Dtype F>
  void gemm(const Act& A, int64_t M, int64_t K, DevMat Wt, int64_t N, float* Y, bool accumulate);
  template <Dtype Fw>
  void residual(const Act& a, int64_t M, int64_t K, DevMat Wt, int64_t b_off, int64_t norm_off,
                float* X, float* Y);
  void prefill_block(const int64_t* ids, int64_t M, int64_t p0, float* logits);
  template <Dtype Fw>
  void prefill_block(const int64_t* ids, int64_t M, int64_t p0, float* logits);

  int dev_ = 0;
  Plan plan_;
  Stream stream_;  // declared before the buffers: destroyed after them (cudaFree syncs first)
  Pinned<int64_t> host_;       // the argmax coming out
  Pinned<StepRow> host_rows_;  // rows going in (put_row), plan_.row_entries of them
  Pinned<float> staging_;   // weight rows on their way to the arena, as float32
  Pinned<char> narrow_;     // the same rows in a narrow format (not allocated for f32)
  Pinned<float> scales_;    // and their int8 block scales (int8 only)
  DevMem weights_dev_, kv_, rope_, act_, pre_, blk_idx_, rows_, ctl_;
  Graph standard_, deep_;   // destroyed first: they refer to the buffers above
  // The KV format's instantiations of the two kernels that touch the cache.
  decltype(&k_qk_norm_rope<Dtype::F32>) k_qk_norm_rope_ = nullptr;
  decltype(&k_attn_partial<Dtype::F32>) k_attn_partial_ = nullptr;
  bool use_graphs_ = true;
  bool pdl_ = false;  // decode's kernels as programmatic dependent launches (set at open)
  int pass_rows_ = 1;  // rows a row kernel's block stages (matvec_pass_rows, set at open)
  // the family (arch_spec) as the kernels take it
  bool gelu_ = false, sandwich_ = false;
  float embed_scale_ = 0.f;  // 0: embeddings unscaled
  float attn_scale_ = 1.f;
};

}  // namespace
}  // namespace residentk
}  // namespace algenta

#include "session_cuda_decode.cuh"
#include "session_cuda_prefill.cuh"

namespace algenta {
namespace residentk {

std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx,
                                           int64_t slots) {
  return std::unique_ptr<Session>(new CudaSession(cfg, max_ctx, slots));
}

}  // namespace residentk
}  // namespace algenta
