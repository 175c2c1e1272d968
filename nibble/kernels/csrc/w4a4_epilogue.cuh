// The float epilogue the W4A4 kernels (w4a4_mma.cu, w4a4_wgmma.cu) share: y = acc * (x_scale[m] *
// w_scale[n]) (+ bias[n]), in the reference's order, saturated to the output type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Scale and bias dtypes, chosen at run time (read once per output): 0 float32, 1 float16, 2 bfloat16.
__device__ __forceinline__ float load_float(const void* p, int dtype, int i) {
  if (dtype == 1) return __half2float(static_cast<const __half*>(p)[i]);
  if (dtype == 2) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// A float32 / float16 / bfloat16 value as its raw bits, loaded where it is written (asm volatile:
// ptxas cannot sink it to its first use; w4a4_wgmma.cu issues it a whole mainloop ahead);
// float_of_bits decodes it.
__device__ __forceinline__ uint32_t load_bits_early(const void* p, int dtype, int i) {
  uint32_t v;
  if (dtype == 0) {
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(static_cast<const uint32_t*>(p) + i));
  } else {
    unsigned short h;
    asm volatile("ld.global.nc.b16 %0, [%1];" : "=h"(h) : "l"(static_cast<const unsigned short*>(p) + i));
    v = h;
  }
  return v;
}
__device__ __forceinline__ float float_of_bits(uint32_t v, int dtype) {
  if (dtype == 1) return __half2float(__ushort_as_half(static_cast<unsigned short>(v)));
  if (dtype == 2) return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v)));
  return __uint_as_float(v);
}

// Saturate to the output type's largest finite value (a token that held +-Inf has a huge scale), as
// the reference clamps; comparisons keep a NaN a NaN.
__device__ __forceinline__ float clamp_abs(float v, float hi) { return v > hi ? hi : (v < -hi ? -hi : v); }
template <typename T> __device__ __forceinline__ T saturate_cast(float v);
template <> __device__ __forceinline__ __half saturate_cast<__half>(float v) {
  return __float2half_rn(clamp_abs(v, 65504.f));
}
template <> __device__ __forceinline__ __nv_bfloat16 saturate_cast<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(clamp_abs(v, 3.3895313892515355e38f));
}
template <> __device__ __forceinline__ float saturate_cast<float>(float v) { return clamp_abs(v, 3.4028234663852886e38f); }

// The reference's order: the two scales first (acc * x_scale alone can overflow for a token that
// held +-Inf), then the bias; no FMA contraction.
__device__ __forceinline__ float scale_output(int acc, float x_scale, float w_scale, bool has_bias, float bias) {
  const float y = __fmul_rn((float)acc, __fmul_rn(x_scale, w_scale));
  return has_bias ? __fadd_rn(y, bias) : y;
}

// Two 16-bit outputs rounded, saturated and packed by one instruction (as saturate_cast, to the
// bit: .satfinite turns +-Inf and overflow into +-max and keeps a NaN a NaN); lo in the low half.
// saturate_cast's compares and selects were most of the wgmma epilogue's instructions, and the
// epilogue is time the tensor cores wait (~8 us of 80 on 12288 x 4096 at M = 1024, H200).
template <typename T> __device__ __forceinline__ uint32_t saturate_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t saturate_pack2<__nv_bfloat16>(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.satfinite.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
template <> __device__ __forceinline__ uint32_t saturate_pack2<__half>(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
