// residentk session: the interface every resident decode backend implements (the CPU engine in
// cpp/src/session_cpu.cpp, the CUDA engine in cuda/session_cuda.cu), and the CUDA backend's
// entry points. No CUDA, no OpenMP.
//
// Dimension legend: D d_model, Hq query heads, Hkv key/value heads, Dh d_head, F d_ff, L layers,
// V vocab, T capacity (KV positions allocated), P position (tokens already in the cache).
//
// A session holds its weights and, for each of its `slots` sequences, one fixed-capacity KV
// region (allocated once, at construction, at T = resident_bucket_ctx(max_ctx) positions each)
// for its whole life. Fixed regions, not a pool of blocks: attention then reads one contiguous
// run of keys per head, the capacity question is exact arithmetic answered before allocation
// (slots x one sequence's cache), and a server bounds max_ctx per request anyway. Tokens are appended one KV
// slot each, written in place; nothing is ever reallocated or copied to grow. The model is one of
// the families of SessionConfig::arch exactly as HuggingFace transformers computes it (see
// session_cpu.cpp for the stage list, session_weights.hpp for what each family changes).
//
// A session may be shared between threads. It has one lock: every call that writes (set_weight,
// prefill, step, step_greedy, reset, the slot calls) holds it for its duration, so calls are
// serialized, never interleaved, and the property reads never take it. Serializing single calls
// does not make a sequence of them (reset, prefill, steps) one thread's: lock() holds the same
// lock across a caller's calls (ResidentSession takes it for a whole generate and a hold()
// block). Every check of a request is made here, once, where it runs: the bindings and the
// Python faces only convert types.
// Weights are handed over one tensor at a time by their HuggingFace names
// (`model.layers.3.self_attn.q_proj.weight`, ...) so a loader can stream a checkpoint with peak
// memory about one model, and every tensor's shape is checked against the config before a byte
// of it is kept (status 607 naming the tensor). The table of names and shapes, the registry and
// the conversions are written once, in session_weights.hpp, for every backend.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "algenta/residentk.hpp"

namespace algenta {
namespace residentk {

// The model families a session computes, each as transformers computes it; what sets them
// apart is data (session_weights.hpp, arch_spec), read by the tensor table and every engine.
enum class Arch : int { Qwen3, Llama, Qwen2, Mistral, Gemma2, Gemma3 };
// RoPE frequency scaling (transformers' rope_type): none, every frequency divided by a factor,
// or Llama 3's banded rule (low frequencies divided, high kept, a smooth ramp between).
enum class RopeType : int { Default, Linear, Llama3 };

// A session's model: its shape (the ModelShape record every check and sizing reads, so a
// config is passed to them as it is), then what the shape does not say.
struct SessionConfig : ModelShape {
  double rms_eps = 1e-6;
  double rope_theta = 1e6;
  bool tie_word_embeddings = true;  // the head reuses model.embed_tokens.weight

  // ---- the family (session_weights.hpp: arch_spec says what each computes) ----------------
  // Every field below keeps Qwen3's behaviour at its default, so a Qwen3 config is unchanged.
  Arch arch = Arch::Qwen3;
  bool qkv_bias = false;   // q, k and v projections carry biases (Qwen2 always, Llama's
                           // attention_bias)
  bool o_bias = false;     // o_proj carries a bias (Llama's attention_bias)
  bool mlp_bias = false;   // gate, up and down carry biases (Llama's mlp_bias)
  // Keys a sliding layer's query sees, itself included (key j is seen from position p when
  // p - W < j <= p, as transformers' sliding mask); 0: no layer slides.
  int64_t sliding_window = 0;
  // Per layer, 1 where the layer slides (its size is n_layers, or 0 for "every layer" when
  // sliding_window > 0).
  std::vector<uint8_t> sliding_layers;
  double attn_scale = 0.0;     // what q.k is multiplied by; 0: 1/sqrt(d_head)
  double attn_softcap = 0.0;   // scores become cap * tanh(s / cap); 0: none (Gemma 2: 50)
  double final_softcap = 0.0;  // the same on the logits (Gemma 2: 30)
  // RoPE of the full-attention layers (of every layer when rope_local_theta is 0): scaled as
  // rope_type says. Sliding layers use plain RoPE at rope_local_theta when it is > 0 (Gemma 3).
  RopeType rope_type = RopeType::Default;
  double rope_factor = 1.0;             // linear, llama3
  double rope_low_freq_factor = 1.0;    // llama3
  double rope_high_freq_factor = 4.0;   // llama3
  int64_t rope_original_ctx = 8192;     // llama3: original_max_position_embeddings
  double rope_local_theta = 0.0;
  bool layer_slides(int64_t l) const {
    if (sliding_window <= 0) return false;
    return sliding_layers.empty() ||
           (l < int64_t(sliding_layers.size()) && sliding_layers[size_t(l)]);
  }
  // How the weight matrices are held resident (residentk.hpp); norms, activations and RoPE are
  // float32 whatever this says.
  Dtype weights = Dtype::F32;
  // How the KV cache holds keys and values (residentk.hpp's kKvFormats): each rounded once,
  // when its position is written; attention reads them widened, accumulating in float32.
  Dtype kv = Dtype::F32;
};

// A tensor arrives as f32, bf16 or f16 (what checkpoints store; dtype.hpp).

// The refusal of a call the lock's holder makes while it has sealed the session (Session::seal):
// a usage error of the program, not a refused input (Python's RuntimeError).
struct SessionSealed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Session {
 public:
  virtual ~Session() = default;

  virtual const SessionConfig& config() const = 0;
  virtual const char* device() const = 0;
  virtual int64_t max_ctx() const = 0;   // what the caller asked for (the context check's limit)
  virtual int64_t capacity() const = 0;  // T, what the KV cache holds
  virtual int64_t position() const = 0;  // P
  // Stages the last decode step ran (0 before the first step): counted, not restated, so a
  // fused or skipped stage shows up against residentk_dispatch_budget(n_layers).
  virtual int64_t dispatches_per_token() const = 0;

  // Copy one HF-named tensor (`type` elements, row-major, any alignment: a view into a file
  // often is not aligned) into the resident weights, converted to the session's weight format
  // (through float32: a bf16 tensor kept as bf16 keeps its bits). A name the model does not
  // have or a shape that does not match the config throws 607; a non-finite value, or one past
  // the format's range (float16's 65504), 609, and leaves the tensor unset (never half old,
  // half new).
  virtual void set_weight(const std::string& name, const std::vector<int64_t>& shape,
                          const void* data, Dtype type) = 0;
  // The shape the config declares for an HF-named tensor; empty when the model has no such
  // tensor. Lets a loader refuse a checkpoint entry before reading (or converting) its data.
  virtual std::vector<int64_t> weight_shape(const std::string& name) const = 0;
  // HF names of the tensors not yet set (empty once the session can run).
  virtual std::vector<std::string> missing_weights() const = 0;

  // Append n tokens at positions P..P+n-1; logits (V) receive the last position's logits.
  // Refuses (606) when P+n > T, (607) when weights are missing, (601) on n < 1 or an id outside
  // [0, V); a refusal, or a failure of the backend (608), leaves the position where it was.
  virtual void prefill(const int64_t* ids, int64_t n, float* logits) = 0;
  // Append one token; logits (V). Same refusals as prefill.
  virtual void step(int64_t id, float* logits) = 0;
  // Append one token and return the argmax of its logits (greedy decoding: the first maximum,
  // a NaN counting as larger than any number, exactly as numpy.argmax). A backend may form it
  // where the logits are (the CUDA engine copies back one id instead of V logits).
  virtual int64_t step_greedy(int64_t id) = 0;
  // The token check prefill and the steps make (601 naming `what` and the first id outside
  // [0, V)), for a caller that must refuse a request before it changes anything (a generation
  // that rewinds first, a scheduler's queue). Never blocks.
  virtual void check_tokens(const int64_t* ids, int64_t n, const char* what) const = 0;
  // Rewind to position 0. The cache is not freed or reallocated; stale slots past P are never
  // read because attention only ever looks at positions < P.
  virtual void reset() = 0;

  // ---- many sequences ----------------------------------------------------------------------
  // The calls above act on slot 0. A slot is one sequence: its own KV region and position.
  // Every refusal below comes before any work: 601 for a slot outside [0, slots), a slot
  // named twice in one step, or n outside what the call allows; 606 / 607 / 601 as above.
  virtual int64_t slots() const = 0;
  virtual int64_t slot_position(int64_t slot) const = 0;
  // prefill() on one slot.
  virtual void prefill_slot(int64_t slot, const int64_t* ids, int64_t n, float* logits) = 0;
  // One decode step of B sequences at once, the weights read once for all of them: slot
  // slots[b] appends ids[b]; returns logits (B, V), row b for slots[b], allocated only once
  // every refusal has passed (B is the caller's, so a refused request allocates nothing).
  // n_slots and n_ids must both be B, 1 <= B <= slots() (601). A sequence's logits are
  // bit-identical to what step() on that slot alone would give (batch invariance): each
  // engine's products compute each cell by one multiply-add sequence whatever the row count
  // (the CPU's panels; the CUDA engine's row kernels, session_kernels.cuh).
  virtual std::unique_ptr<float[]> step_slots(const int64_t* slots, int64_t n_slots,
                                              const int64_t* ids, int64_t n_ids) = 0;
  // Rewind one slot to position n (0 <= n <= its position): the first n tokens stay cached.
  virtual void truncate_slot(int64_t slot, int64_t n) = 0;
  // Slot dst's cache becomes the first n positions of slot src's (n <= src's position, src !=
  // dst) and its position n: a prompt sharing a cached prefix skips recomputing it. The bits
  // copied are the bits prefill would have written, so what follows is unchanged.
  virtual void copy_prefix(int64_t src, int64_t dst, int64_t n) = 0;

  // ---- holding the session -----------------------------------------------------------------
  // lock() takes the session's one lock for a sequence of calls: every other thread's calls
  // wait until the matching unlock(), the holder's own calls pass (it is reentrant). unlock()
  // by a thread that does not hold it throws std::logic_error. A binding waits on it with the
  // GIL released, so a holder running Python between its calls never waits on a waiter.
  virtual void lock() = 0;
  virtual void unlock() = 0;
  // While the holder has sealed the session (why non-empty), its own calls that write, and
  // lock(), throw SessionSealed: "<call>() <why>". A callback the holder runs in the middle of a
  // sequence (a generation's on_token) may read the session, never rewrite what the sequence
  // is decoding from. "" unseals; the last unlock() does too. Only the holder may seal
  // (std::logic_error otherwise).
  virtual void seal(const std::string& why) = 0;
};

// The CPU engine (OpenMP; weights in any Dtype). Throws StatusError(Resident, 601-603/609) on a config the
// residentk contract refuses, 601/602 on a max_ctx outside [1, RESIDENT_MAX_CONTEXT] or
// `slots` outside [1, RESIDENT_MAX_SLOTS].
std::unique_ptr<Session> make_cpu_session(const SessionConfig& cfg, int64_t max_ctx,
                                          int64_t slots = 1);

// All-core streaming read bandwidth of this host in bytes/s: sums a buffer of `bytes` bytes
// `reps` times in each of four read patterns (one stream with and without software prefetch,
// two and four streams), with the SIMD and thread layout the decode matvec uses, and returns the
// best: the roofline perf/bench_decode_cpu.py reports decode against.
double cpu_read_bandwidth(int64_t bytes, int reps);

// What multiplies a CPU session's weights held in format f on the active instruction set
// ("fp32", "fp32 on widened f16", "vdpbf16ps", "vpdpbusd", ...): the path benchmarks report.
const char* cpu_weight_path(Dtype f);

// The int8 decode product of the active instruction set, for tests against an independent
// model: x (n) quantized once (xq (n), xs (ceil(n / 32)) out), then y[o] = row o of q (rows, n)
// with its block scales sc (rows, ceil(n / 32)) times x, as a decode step computes it.
void cpu_int8_products(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* x,
                       float* y, int8_t* xq, float* xs);
// The int8 prefill GEMM of the active instruction set (every one has one): the M rows of X
// (M, n) quantized as cpu_int8_products quantizes x, Y (M, rows) = X q^T.
void cpu_int8_gemm(const int8_t* q, const float* sc, int64_t rows, int64_t n, const float* X,
                   int64_t M, float* Y);
// The Q4_0 GEMM of the active instruction set (M == 1: a decode step's product): codes (rows, n)
// 0..15 (a value is (code - 8) * scale), sc (rows, ceil(n / 32)) float16 values, X as above.
void cpu_q4_gemm(const uint8_t* codes, const float* sc, int64_t rows, int64_t n, const float* X,
                 int64_t M, float* Y);
// The MLP gate of the active instruction set, out (n) = act(g) * u with act silu or (gelu) GELU's
// tanh form, and RMSNorm's sum of squares, x (n) squared and summed in double, as both engines'
// stages compute them.
void cpu_gate(bool gelu, const float* g, const float* u, int64_t n, float* out);
double cpu_sum_sq(const float* x, int64_t n);
// The same for bf16 rows w (rows, n bf16 bits): x rounded to bf16 once (xb (n) out), then
// y[o] = row o . x as a decode step computes it.
void cpu_bf16_products(const uint16_t* w, int64_t rows, int64_t n, const float* x, float* y,
                       uint16_t* xb);
// Y (M, rows) = the M rows of X (M, n) times w (rows, n) held in f (f32, bf16 or f16; w in that
// format's elements), as the session multiplies them: M == 1 a decode step's product, M > 1 a
// prefill GEMM (X packed once for the product, as prefill packs it, where the panels take packed
// rows) or, `packed` false, a batched decode step's (each row prepared as is). For tests that
// every row of a GEMM is the bits its own step gives.
void cpu_panel_products(Dtype f, const void* w, int64_t rows, int64_t n, const float* X,
                        int64_t M, float* Y, bool packed);

// ---- the CUDA backend's entry points ------------------------------------------------------
// Implemented by cuda/ in a build with a CUDA backend (ALGENTA_GPU with nvcc, or ALGENTA_CUDA_EMU
// over the CPU emulator) and by cpp/src/cuda_absent.cpp, which refuses with 604, in a build without one.

struct CudaBackend {
  std::string kind;     // "device" (nvcc build), "emulator" (ALGENTA_CUDA_EMU) or "none"
  bool usable = false;  // a device (or the emulated one) this binary's kernels run on
  std::string device_name;
  std::string why;      // when not usable: what failed, with the CUDA error and versions
  int driver_version = 0, runtime_version = 0;  // 1000 * major + 10 * minor, 0 when unknown
};
// Asked once per process (the CUDA runtime's own initialization result is fixed for its life).
const CudaBackend& cuda_backend();

// The CUDA engine: the same contract as the CPU engine, weights and the KV caches of `slots`
// sequences resident in device memory. Refuses as make_cpu_session does (the checks run on the
// host first), then 604 in a build without a CUDA backend, 605 on a host without a usable device
// (before any allocation, naming why), and 608 for any CUDA error at any later call.
std::unique_ptr<Session> make_cuda_session(const SessionConfig& cfg, int64_t max_ctx,
                                           int64_t slots = 1);
// Device-to-device copy bandwidth of the current CUDA device in bytes/s, counting the read and
// the write (2 * bytes per copy): the best of `reps` timed copies of a `bytes` buffer. The
// roofline perf/bench_decode_gpu.py reports decode against. 604/605/608 as make_cuda_session.
double cuda_copy_bandwidth(int64_t bytes, int reps);
// Test hook of the emulation build: the n-th next CUDA call that can fail on a device (launch,
// copy, memset, synchronization, graph launch) fails with cudaErrorLaunchFailure; 0 turns it
// off. Returns false, doing nothing, in every other build.
bool cuda_emulator_fail_after(int64_t n);
// Measurement hook of the emulation build: global-memory traffic per kernel, counted in 32-byte
// sectors per warp instruction (cuda/emu/cuda_runtime.h, "global-memory traffic") for the
// accesses the kernels spell with the cache-hinted intrinsics. start=true clears the counts and
// turns counting on; start=false turns it off and fills *out. Returns false, doing nothing, in
// every other build.
struct KernelTraffic {
  std::string kernel;
  // loads, then stores: warp instructions, sectors touched, ceil(bytes needed / 32) summed over
  // the instructions, bytes needed (the union of the lanes' byte ranges)
  int64_t load[4] = {0, 0, 0, 0};
  int64_t store[4] = {0, 0, 0, 0};
};
bool cuda_emulator_traffic(bool start, std::vector<KernelTraffic>* out);

// Test hooks of the emulation build for programmatic dependent launch (cuda/common.cuh,
// gpu::launch): how many such launches have run (-1 in every other build), and a probe kernel
// launched that way which waits as it must (mode 0), reads global memory before its wait (1) or
// exits without waiting (2); the emulator aborts the process on 1 and 2, naming the kernel.
// Returns false, doing nothing, in every other build.
int64_t cuda_emulator_pdl_launches();
bool cuda_emulator_pdl_probe(int mode);

}  // namespace residentk
}  // namespace algenta
