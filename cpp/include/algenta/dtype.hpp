// The one vocabulary of element types, for every family and both backends: what lossk's inputs
// and gradients are (f32, f64, bf16, f16), how a session holds its weight matrices (f32, bf16,
// f16, int8) and what a checkpoint's tensors arrive as (f32, bf16, f16). Each API states the
// subset it takes and refuses any other by name; the names here are the only spelling, and the
// Python layer reads them from this table (algenta._core.DTYPES).
#pragma once

#include <cstdint>

namespace algenta {

// int8 is a block format (quant.hpp: blocks of 32 codes with one float32 scale), not a plain
// integer array; `bytes` is its per-code size. q8_0, q4_0, q4_k and q6_k are llama.cpp's block
// formats as a GGUF file stores them (ggml_blocks.hpp): source types a session reads, not
// formats it holds; `bytes` is one block's size and `block` the values it holds.
enum class Dtype : int {
  F32 = 0, F64 = 1, BF16 = 2, F16 = 3, Int8 = 4, Q8_0 = 5, Q4_0 = 6, Q4_K = 7, Q6_K = 8
};

struct DtypeInfo {
  Dtype id;
  const char* name;       // what every API takes: "f32", "bf16", ...
  const char* long_name;  // NumPy's and PyTorch's spelling, used in messages: "float32", ...
  int bytes;              // bytes of one stored element (of one block for a ggml block type)
  int block;              // values per block of a ggml block type; 1 for every other type
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::F32, "f32", "float32", 4, 1},   {Dtype::F64, "f64", "float64", 8, 1},
    {Dtype::BF16, "bf16", "bfloat16", 2, 1}, {Dtype::F16, "f16", "float16", 2, 1},
    {Dtype::Int8, "int8", "int8", 1, 1},     {Dtype::Q8_0, "q8_0", "Q8_0", 34, 32},
    {Dtype::Q4_0, "q4_0", "Q4_0", 18, 32},   {Dtype::Q4_K, "q4_k", "Q4_K", 144, 256},
    {Dtype::Q6_K, "q6_k", "Q6_K", 210, 256},
};
constexpr int kNumDtypes = int(sizeof(kDtypes) / sizeof(kDtypes[0]));

constexpr const DtypeInfo& dtype_info(Dtype d) { return kDtypes[int(d)]; }
inline const char* dtype_name(Dtype d) { return dtype_info(d).name; }
inline const char* dtype_long_name(Dtype d) { return dtype_info(d).long_name; }
constexpr bool is_half(Dtype d) { return d == Dtype::BF16 || d == Dtype::F16; }
constexpr bool is_ggml_block(Dtype d) { return dtype_info(d).block > 1; }

}  // namespace algenta
