// ALGENTA_HD marks a function that host C++ and CUDA device code both compile: the headers of
// math both backends compute (half.hpp, quant.hpp) are written with it.
#pragma once

#if !defined(ALGENTA_HD)
#if defined(__CUDACC__)
#define ALGENTA_HD __host__ __device__ __forceinline__
#else
#define ALGENTA_HD inline
#endif
#endif
