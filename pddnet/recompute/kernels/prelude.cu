// Shared definitions of the pddnet recompute kernels (included by the others).
//
// NVRTC-compatible: no includes at all beyond this folder. Compile-time parameters come from -D:
//   KV_DTYPE   0 = float, 1 = __half, 2 = __nv_bfloat16  (storage type of the paged KV cache)
//   HEAD_DIM   width of one head (extend_attention only)
//   ROWS_PER_WARP  query rows each warp owns (extend_attention only)
#pragma once

#ifndef KV_DTYPE
#define KV_DTYPE 1
#endif

// fp16 and bf16 are handled as raw 16-bit patterns, converted with PTX (fp16) or
// bit arithmetic (bf16), both rounding to nearest even. This avoids cuda_fp16.h /
// cuda_bf16.h: NVRTC does not ship them (12.9 was checked), and CuPy's include
// path may lack the toolkit headers.
#if KV_DTYPE == 1
typedef unsigned short kv_t;
__device__ __forceinline__ float kv_to_float(kv_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ kv_t float_to_kv(float x) {
    kv_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#elif KV_DTYPE == 2
typedef unsigned short kv_t;
__device__ __forceinline__ float kv_to_float(kv_t x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ kv_t float_to_kv(float x) {
    const unsigned u = __float_as_uint(x);
    return (kv_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // finite inputs; same as the NumPy path
}
#else
typedef float kv_t;
__device__ __forceinline__ float kv_to_float(kv_t x) { return x; }
__device__ __forceinline__ kv_t float_to_kv(float x) { return x; }
#endif

#define PDD_FULL_MASK 0xffffffffu
#define PDD_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(PDD_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(PDD_FULL_MASK, v, o));
    return v;
}
