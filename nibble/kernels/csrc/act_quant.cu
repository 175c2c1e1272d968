// Per-token INT4 activation quantization for many tokens, bit-identical to the Triton act-quant
// kernel of w4a4.py (and so to the spec, reference.quantize_activations):
//
//   x -> saturate (NaN -> 0, +-Inf -> +-max of x's type) -> scale = amax / 7 (div.rn)
//     -> q = clamp(rint(x / scale), -8, 7) as int8, in the "natural" or the "even_odd" column order
//
// Why a CUDA kernel. The Triton kernel holds a row as float32 padded to a power of two: a row of
// 11008 is 16384 values, 64 a thread at 8 warps, 128 registers, so two rows fit an SM and 512 rows
// take two waves (H200: 10.8 us for 512 x 11008, ~4 us of memory). Here a row stays in its 16-bit
// type, unpadded: 16-byte loads, 8 values each, at most 8 loads a thread of 256 (rows up to
// 16384), so 24 registers hold a row of 11008 and four rows share an SM (57 registers a thread).
//
// The quotient is Markstein's correctly rounded x / scale without a division per element, exactly
// as w4a4.py's _row_quotients computes it (same operations, same roundings: ties go to even the
// same way), so the codes equal the Triton kernel's bit for bit.
//
// Orders. even_odd (what csrc/w4a4_wgmma.cu reads): each 32-column block as its 16 even columns,
// then its 16 odd ones. A thread's 8 columns c0 .. c0 + 7 (c0 % 8 == 0, offset o = c0 % 32 in its
// block) land at bytes o / 2 .. o / 2 + 3 (the even ones) and 16 + o / 2 .. (the odd ones): two
// 4-byte stores. natural: one 8-byte store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int THREADS = 256, VEC = 8, MAX_LOADS = 8;

__device__ __forceinline__ float value(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float value(const __half* p) { return __half2float(*p); }

// NaN -> 0, +-Inf (and anything beyond) -> +-fmax: the spec's saturation.
__device__ __forceinline__ float saturate(float v, float fmax) { return v != v ? 0.f : fminf(fmaxf(v, -fmax), fmax); }

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) v = fmaxf(v, red[w]);
  return v;
}

template <typename T, int LOADS>
__global__ void __launch_bounds__(THREADS) act_quant_kernel(const T* __restrict__ x, int8_t* __restrict__ q,
                                                            float* __restrict__ scales, int K, int ldx, int ldq,
                                                            float fmax, bool even_odd) {
  __shared__ float red[THREADS / 32];
  const int row = blockIdx.x, vecs = K / VEC;
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)row * ldx);
  uint4 v[LOADS];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {  // all loads first: the row in flight at once
    const int c = threadIdx.x + i * THREADS;
    v[i] = c < vecs ? __ldg(src + c) : make_uint4(0, 0, 0, 0);
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const T* e = reinterpret_cast<const T*>(&v[i]);
#pragma unroll
    for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(saturate(value(e + j), fmax)));
  }
  amax = block_max(amax, red);
  const float scale = __fdiv_rn(amax, 7.f);
  // _row_quotients: a tiny scale's row is scaled by 2^64 first (exact), so 1 / s stays finite
  const float safe = scale > 0.f ? scale : 1.f;
  const float pre = safe < 1.0e-19f ? 18446744073709551616.f : 1.f;
  const float s = __fmul_rn(safe, pre), inv = __fdiv_rn(1.f, s);
  int8_t* dst = q + (size_t)row * ldq;
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const int c = threadIdx.x + i * THREADS;
    if (c >= vecs) break;
    const T* e = reinterpret_cast<const T*>(&v[i]);
    uint32_t code[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xs = __fmul_rn(saturate(value(e + j), fmax), pre);
      const float q0 = __fmul_rn(xs, inv);
      const float r = __fmaf_rn(-q0, s, xs);
      const float y = fminf(fmaxf(rintf(__fmaf_rn(r, inv, q0)), -8.f), 7.f);
      code[j] = static_cast<uint32_t>(static_cast<int>(y)) & 0xFFu;
    }
    const int c0 = c * VEC;
    if (even_odd) {
      int8_t* block = dst + (c0 & ~31) + (c0 & 31) / 2;
      *reinterpret_cast<uint32_t*>(block) = code[0] | code[2] << 8 | code[4] << 16 | code[6] << 24;
      *reinterpret_cast<uint32_t*>(block + 16) = code[1] | code[3] << 8 | code[5] << 16 | code[7] << 24;
    } else {
      *reinterpret_cast<uint2*>(dst + c0) = make_uint2(code[0] | code[1] << 8 | code[2] << 16 | code[3] << 24,
                                                       code[4] | code[5] << 8 | code[6] << 16 | code[7] << 24);
    }
  }
  if (threadIdx.x == 0) scales[row] = scale;
}

template <typename T>
cudaError_t launch(const void* x, void* q, void* scales, int M, int K, int ldx, int ldq, float fmax, bool even_odd,
                   cudaStream_t stream) {
  const int loads = (K / VEC + THREADS - 1) / THREADS;
  const T* xt = static_cast<const T*>(x);
  int8_t* qt = static_cast<int8_t*>(q);
  float* st = static_cast<float*>(scales);
#define NIBBLE_CASE(L) \
  case L: act_quant_kernel<T, L><<<M, THREADS, 0, stream>>>(xt, qt, st, K, ldx, ldq, fmax, even_odd); break;
  switch (loads) {
    NIBBLE_CASE(1) NIBBLE_CASE(2) NIBBLE_CASE(3) NIBBLE_CASE(4) NIBBLE_CASE(5) NIBBLE_CASE(6) NIBBLE_CASE(7)
    NIBBLE_CASE(8)
    default: return cudaErrorInvalidValue;
  }
#undef NIBBLE_CASE
  return cudaGetLastError();
}

}  // namespace

// Host entry point (called through ctypes). Preconditions checked by the Python caller: dtype 1
// float16 or 2 bfloat16; 1 <= M; 8 <= K <= 16384, K % 8 == 0 (K % 32 == 0 for even_odd); x rows
// 16-byte aligned (ldx % 8 == 0, x aligned), q rows 8-byte aligned (ldq % 8 == 0).
extern "C" int nibble_act_quant(int dtype, const void* x, void* q, void* scales, int M, int K, int ldx, int ldq,
                                float fmax, int even_odd, void* stream) {
  if (K / VEC > MAX_LOADS * THREADS) return (int)cudaErrorInvalidValue;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  if (dtype == 1) err = launch<__half>(x, q, scales, M, K, ldx, ldq, fmax, even_odd != 0, st);
  if (dtype == 2) err = launch<__nv_bfloat16>(x, q, scales, M, K, ldx, ldq, fmax, even_odd != 0, st);
  return (int)err;
}

extern "C" const char* nibble_act_quant_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
