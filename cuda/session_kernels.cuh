// The CUDA resident session's device code, one stage a header, in the order a decode step runs
// them (session_cuda.cu's header has the launch sequence, the numerics and the limits):
//   session_device.cuh     the shared vocabulary: a resident matrix (DevMat) and its elements
//                          widened (w_at), a decode kernel's opening (step_begin, prefetch_rows),
//                          the KV cache's elements in their format
//   session_norm.cuh       RMSNorm by a block (squares in double), k_rmsnorm_rows
//   session_stage.cuh      a matvec's input vector staged in shared memory as the weight format's
//                          products consume it (float32, rounded to bf16, quantized to int8)
//   session_matvec.cuh     one warp's dot products per weight format, a block's warps over its
//                          rows: what the row kernels below are made of
//   session_embed.cuh      k_embed: the token's embedding row
//   session_qkv.cuh        k_norm_qkv (norm + QKV matvec), k_qk_norm_rope (bias, q/k norm, RoPE,
//                          KV write)
//   session_attention.cuh  k_attn_partial (online softmax per split), k_attn_merge
//   session_residual.cuh   k_matvec_residual (o_proj, down onto x), k_out_norm_residual,
//                          k_bias_residual
//   session_mlp.cuh        k_norm_gateup (norm + gate/up matvec + activation), k_gate_act
//   session_head.cuh       k_head_argmax (logits, soft cap, the greedy argmax on the device)
//   session_gemm.cuh       prefill's GEMMs on CUDA cores (k_gemm_narrow, k_gemm_wide) and
//                          k_round_bf16
//   session_gemm_q8.cuh    prefill's int8 path (k_quantize_rows, k_gemm_q8)
// What a launch sequence computes on comes from its rows (StepRow: token, position, slot,
// attention path), written by the host before it runs. The per-element math (RMSNorm's scale,
// the SiLU and GELU gates, the soft cap, RoPE, the argmax order) is session_math.hpp's, the
// bf16/f16 conversions half.hpp's and the int8 block rule quant.hpp's, all shared with the CPU
// engine.
//
// Weight formats: every kernel that reads a weight matrix is a template over the session's
// format F (f32, bf16, f16, int8; the host instantiates the one the session holds). Decode
// multiplies each format as the CPU engine does (session_matvec.cuh, session_stage.cuh); prefill
// rounds or quantizes its activation rows the same way: bf16 rows (k_round_bf16) multiply the
// bf16 weights on tensor cores (lossk's tile GEMM) or, below 32 rows, widened to float32; int8
// rows quantized by the same rule (k_quantize_rows) multiply the int8 weights in integers block
// by block (k_gemm_q8, dp4a), decode's products.
#pragma once

#include "session_device.cuh"
#include "session_norm.cuh"
#include "session_stage.cuh"
#include "session_matvec.cuh"
#include "session_embed.cuh"
#include "session_qkv.cuh"
#include "session_attention.cuh"
#include "session_residual.cuh"
#include "session_mlp.cuh"
#include "session_head.cuh"
#include "session_gemm.cuh"
#include "session_gemm_q8.cuh"
