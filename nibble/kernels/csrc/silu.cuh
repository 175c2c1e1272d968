// SiLU(g) * u exactly as the engine's glue kernel computes it (nibble/eval/engine.py:
// _silu_mul_kernel, Triton: ex2.approx of -g log2(e), div.full, SiLU rounded to T, times u in fp32,
// rounded once), for the GEMM epilogues that fuse it (w4a4_wgmma.cu, w4a16_mma.cu): fused and
// unfused forward passes then give the same tokens.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

template <typename T>
__device__ __forceinline__ float low_half(uint32_t d) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(static_cast<unsigned short>(d)));
  else return __uint_as_float(d << 16);
}
template <typename T>
__device__ __forceinline__ float high_half(uint32_t d) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(static_cast<unsigned short>(d >> 16)));
  else return __uint_as_float(d & 0xFFFF0000u);
}

// Two floats rounded to T and packed by one instruction (lo in the low half), without saturation:
// an overflow is Inf, as in the glue kernel's bf16 / fp16 multiply.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t d;
  if constexpr (std::is_same_v<T, __half>) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// SiLU(g) rounded to T. -g log2(e) in one multiply is (0 - g) log2(e) to the bit, and the flush to
// zero changes no result: a subnormal argument or result of ex2 still gives 1 + e = 1.
template <typename T>
__device__ __forceinline__ float silu_rounded(float g) {
  float s;
  asm("{ .reg .f32 e; mul.f32 e, %1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; add.f32 e, e, 0f3F800000;"
      " div.full.f32 %0, %1, e; }" : "=f"(s) : "f"(g));
  return low_half<T>(pack2<T>(s, s));
}

// SiLU(g) * u for products g and u already rounded to T (as the unfused GEMMs store them), in fp32.
template <typename T>
__device__ __forceinline__ float silu_mul_rounded(float g, float u) {
  return __fmul_rn(silu_rounded<T>(g), u);
}
