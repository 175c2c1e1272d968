// W4A4's online rotation and per-token quantization in one pass (nibble/kernels/w4a4.py:
// rotate_quantize), for rows of K = m * 2^k, H_K = H_m (x) H_{2^k} (nibble/kernels/hadamard.py):
//
//   y = (x @ H_K.T) / sqrt(K) rounded to x's type, saturated (NaN -> 0, +-Inf -> +-max);
//   scale = amax|y| / 7;  q = clamp(rint(y / scale), -8, 7)      (reference.quantize_activations)
//
// One CTA per token row; the whole row lives in shared memory. The Triton kernel (w4a4.py:
// _act_quant_kernel) holds a row in one program's registers (~250 of them, one program an SM) and
// multiplies the dense factor in tf32; for a few rows it splits each row's dense outputs over
// programs and quantizes in a second kernel. Here:
//
// - The row, viewed as X [m, 2^k] (element i * 2^k + j), is staged in its own 16-bit type, so the
//   dense factor runs on mma.m16n8k16 with exact inputs: Z = H_m X, A = H_m (+-1, exact in 16 bits,
//   zero padded to mp = m rounded up to 16, read from global memory where the L1 keeps it), B = X
//   (ldmatrix.trans from the staged rows; rows >= m are zeros). Products are exact; sums are the
//   tensor cores' float32 accumulators, as in the Triton kernel. The dense factor goes first
//   because its inputs are then x itself, exact in 16 bits; the butterflies that follow are float32.
// - Sylvester butterflies over j (log2 2^k passes over shared memory, one barrier each).
// - Scale and codes as the spec: the rotated value rounded to x's type, correctly rounded divisions
//   (amax / 7, y / scale), round half to even; codes written in natural or "even_odd" order
//   (w4a4_wgmma's: each 32-column block as its 16 even columns, then its 16 odd ones).
//
// Shared memory: X [mp][2^k + 8] 16-bit (the 16-byte pad puts ldmatrix's 8 rows on distinct bank
// groups), Y [m][2^k + 4] float32, and 32 floats for the amax reduction. 2^k >= 8 (ldmatrix rows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "skinny.cuh"

namespace {

constexpr int THREADS = 512;

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__float2half_rn(v));
  else return __bfloat162float(__float2bfloat16_rn(v));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

size_t smem_bytes(int m, int log2p) {
  const size_t p = (size_t)1 << log2p, mp = (m + 15) & ~15;
  return (m > 1 ? mp * (p + 8) * 2 : 0) + (size_t)m * (p + 4) * 4 + 32 * 4;
}

// dense: H_m [mp][mp] in T, zero padded (unused when m == 1); row_scale = 1 / sqrt(K) in float32;
// fmax = the largest finite T.
template <typename T>
__global__ void __launch_bounds__(THREADS) rotate_quantize_kernel(const T* __restrict__ x, int ldx,
                                                                  int8_t* __restrict__ q, int ldq,
                                                                  float* __restrict__ scales,
                                                                  const T* __restrict__ dense, int m, int log2p,
                                                                  float row_scale, float fmax, int even_odd,
                                                                  int trigger) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int p = 1 << log2p, K = m << log2p, mp = (m + 15) & ~15;
  const int xs_stride = p + 8, ys_stride = p + 4;
  T* xs = reinterpret_cast<T*>(smem);
  float* ys = reinterpret_cast<float*>(smem + (m > 1 ? (size_t)mp * xs_stride * sizeof(T) : 0));
  float* red = ys + (size_t)m * ys_stride;
  const T* __restrict__ xr = x + (size_t)blockIdx.x * ldx;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  wait_for_prior_grids();  // x is the previous kernel's output
  let_successor_launch(trigger);

  // 1. Stage the row, 16 bytes a thread (p >= 8: a piece never straddles two sub-rows).
  for (int e = threadIdx.x * 8; e < (m > 1 ? mp : 1) << log2p; e += THREADS * 8) {
    const int i = e >> log2p, j = e & (p - 1);
    const uint4 v = i < m ? *reinterpret_cast<const uint4*>(xr + e) : make_uint4(0, 0, 0, 0);
    if (m > 1) {
      *reinterpret_cast<uint4*>(xs + i * xs_stride + j) = v;
    } else {
      const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int u = 0; u < 8; ++u) ys[j + u] = static_cast<float>(h[u]);
    }
  }
  __syncthreads();

  // 2. Z = H_m X on the tensor cores. A warp item: one 16-row tile of Z by up to 8 column tiles of
  // 8, so each A fragment (4 loads) serves up to 8 MMAs.
  if (m > 1) {
    const int g = lane >> 2, t = lane & 3;
    const int tiles_i = mp >> 4, tiles_j = p >> 3, jt = tiles_j < 8 ? tiles_j : 8;
    const int items = tiles_i * (tiles_j / jt);
    const uint32_t xs_addr = (uint32_t)__cvta_generic_to_shared(xs);
    for (int item = warp; item < items; item += THREADS / 32) {
      const int it = item % tiles_i, j_first = (item / tiles_i) * jt * 8;
      float c[8][4];
#pragma unroll
      for (int u = 0; u < 8; ++u) c[u][0] = c[u][1] = c[u][2] = c[u][3] = 0.f;
      for (int kt = 0; kt < tiles_i; ++kt) {
        const uint32_t* a_src = reinterpret_cast<const uint32_t*>(dense + (size_t)(it * 16 + g) * mp + kt * 16 + 2 * t);
        const uint32_t a[4] = {__ldg(a_src), __ldg(a_src + 4 * mp), __ldg(a_src + 4), __ldg(a_src + 4 * mp + 4)};
        // ldmatrix.x2.trans: lanes 0-15 name rows k = kt * 16 + lane of X (8 columns each); lane
        // (g, t) receives X[2t, 2t+1][g] and X[2t+8, 2t+9][g] of the tile, the B fragment.
        const uint32_t row_addr = xs_addr + ((kt * 16 + (lane & 15)) * xs_stride + j_first) * (uint32_t)sizeof(T);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (u < jt) {
            uint32_t b0, b1;
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                         : "=r"(b0), "=r"(b1) : "r"(row_addr + u * 8 * (uint32_t)sizeof(T)));
            mma_16816<T>(c[u], a, b0, b1);
          }
        }
      }
      // C fragment: c0 / c1 = Z[g][2t, 2t+1], c2 / c3 = Z[g + 8][...] of the tile
      const int i0 = it * 16 + g;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (u < jt) {
          const int j = j_first + u * 8 + 2 * t;
          if (i0 < m) *reinterpret_cast<float2*>(ys + i0 * ys_stride + j) = make_float2(c[u][0], c[u][1]);
          if (i0 + 8 < m) *reinterpret_cast<float2*>(ys + (i0 + 8) * ys_stride + j) = make_float2(c[u][2], c[u][3]);
        }
      }
    }
    __syncthreads();
  }

  // 3. Sylvester butterflies over j: pass h pairs j and j + h for every j with bit h clear.
  for (int log2h = 0; log2h < log2p; ++log2h) {
    const int h = 1 << log2h;
    for (int pair = threadIdx.x; pair < K >> 1; pair += THREADS) {
      const int i = pair >> (log2p - 1), r = pair & ((p >> 1) - 1);
      float* y = ys + i * ys_stride + (((r >> log2h) << (log2h + 1)) | (r & (h - 1)));
      const float lo = y[0], hi = y[h];
      y[0] = lo + hi;
      y[h] = lo - hi;
    }
    __syncthreads();
  }

  // 4. The rotated row as the spec rounds it, saturated; its largest magnitude.
  float amax = 0.f;
  for (int n = threadIdx.x; n < K; n += THREADS) {
    float* y = ys + (n >> log2p) * ys_stride + (n & (p - 1));
    float v = round_to<T>(*y * row_scale);
    v = v != v ? 0.f : fminf(fmaxf(v, -fmax), fmax);
    *y = v;
    amax = fmaxf(amax, fabsf(v));
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  amax = red[0];
  for (int w = 1; w < THREADS / 32; ++w) amax = fmaxf(amax, red[w]);
  const float scale = __fdiv_rn(amax, 7.f), safe = scale > 0.f ? scale : 1.f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;

  // 5. Codes, 4 consecutive outputs a thread (one 32-bit store): in even_odd order output position
  // o of a 32-column block holds column 2o (o < 16) or 2(o - 16) + 1.
  int8_t* __restrict__ qr = q + (size_t)blockIdx.x * ldq;
  for (int o = threadIdx.x * 4; o < K; o += THREADS * 4) {
    uint32_t word = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int pos = o + u, within = pos & 31;
      const int n = even_odd ? (pos & ~31) | (within < 16 ? 2 * within : 2 * (within - 16) + 1) : pos;
      const float v = ys[(n >> log2p) * ys_stride + (n & (p - 1))];
      const int code = (int)fminf(fmaxf(rintf(__fdiv_rn(v, safe)), -8.f), 7.f);
      word |= (uint32_t)(code & 0xFF) << (8 * u);
    }
    *reinterpret_cast<uint32_t*>(qr + o) = word;
  }
}

template <typename T>
cudaError_t launch(const void* x, int M, int ldx, void* q, int ldq, float* scales, const void* dense, int m,
                   int log2p, float row_scale, float fmax, int even_odd, cudaStream_t stream, bool pdl) {
  constexpr auto kernel = rotate_quantize_kernel<T>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  return launch_kernel(kernel, M, THREADS, smem_bytes(m, log2p), stream, pdl, static_cast<const T*>(x), ldx,
                       static_cast<int8_t*>(q), ldq, scales, static_cast<const T*>(dense), m, log2p, row_scale, fmax,
                       even_odd, (int)pdl);
}

}  // namespace

// Host entry point (called through ctypes). Preconditions checked by the Python caller
// (w4a4.rotate_quantize_applicable): K = m * 2^log2p with 2^log2p >= 8, x rows 16-byte aligned
// (ldx % 8 == 0), q rows 4-byte aligned (ldq % 4 == 0), dense = H_m zero padded to a multiple of 16
// in x's type when m > 1, smem_bytes(m, log2p) within the device's per-CTA limit.
extern "C" int nibble_rotate_quantize(int is_bf16, const void* x, int M, int ldx, void* q, int ldq, float* scales,
                                      const void* dense, int m, int log2p, float row_scale, float fmax, int even_odd,
                                      int pdl, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const cudaError_t err =
      is_bf16 ? launch<__nv_bfloat16>(x, M, ldx, q, ldq, scales, dense, m, log2p, row_scale, fmax, even_odd, st, pdl)
              : launch<__half>(x, M, ldx, q, ldq, scales, dense, m, log2p, row_scale, fmax, even_odd, st, pdl);
  return (int)err;
}

extern "C" size_t nibble_rotate_quantize_smem(int m, int log2p) { return smem_bytes(m, log2p); }

extern "C" const char* nibble_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
