// W4A4's online rotation and per-token quantization in one launch for a few rows (decode):
//
//   y = (x @ H_K.T) / sqrt(K) rounded to x's type, saturated (NaN -> 0, +-Inf -> +-max);
//   scale = amax|y| / 7;  q = clamp(rint(y / scale), -8, 7)      (reference.rotate_quantize_activations)
//   (a row whose float32 y is not all finite, x having held NaN or +-Inf: scale 0, q 0)
//
// with H_K = H_m (x) H_{2^k} (nibble/kernels/hadamard.py) = D (x) H_p, D = H_m (x) H_s and
// 2^k = s p (Sylvester's factors in natural index order): the host (w4a4.rotate_quantize_plan)
// picks p (64 or 128, or 2^k when smaller) and passes D as the dense factor and m s as its order,
// here `m`; e.g. 11008 = 172 x 64, 14336 = (28 x 8) x 64, 4096 = 64 x 64. The Triton path for a
// few rows is two launches: the transform, each row's dense outputs split over programs, then the
// quantization, one program a row. One CTA a row is too slow (commit d00f331: 15.5 us for a row of 11008 against
// 7.2): the dense factor alone is ~1,000 MMAs in dependent chains on one SM. So a row is one
// thread-block cluster of C = mp / 16 CTAs (mp = m rounded up to 16), CTA r owning output rows
// [16 r, 16 r + 16) of the row viewed as Y [m, p] (element i * p + j):
//
// - Each CTA stages the whole row X [mp][p] in its own 16-bit type (rows >= m zero; x is an L2
//   hit) and computes its 16 rows of Z = D X on mma.m16n8k16: A = 16 rows of D (+-1, exact in
//   16 bits, zero padded, from global memory), B = X by ldmatrix.trans. Inputs are exact, sums are
//   the tensor cores' float32 accumulators (as the Triton kernel's). The dense factor goes first
//   because its inputs are then x itself, exact in 16 bits.
// - Sylvester butterflies over j on its own rows: a CTA holds whole rows, so no exchange.
// - The rotated values rounded to x's type and saturated; each CTA's amax meets the others' through
//   distributed shared memory (two cluster barriers), then each quantizes its own rows: correctly
//   rounded amax / 7 and y / scale, round half to even, codes in natural or "even_odd" order (each
//   32-column block as its 16 even columns, then its 16 odd ones: w4a4_wgmma's K order; a CTA's
//   16 p outputs start at a multiple of 32, so a block never straddles two CTAs).
//
// Shared memory: X [mp][p + 8] 16-bit (the 16-byte pad puts ldmatrix's 8 rows on distinct bank
// groups), Y [16][p + 4] float32, one float per warp and one for the CTA's amax.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cfloat>  // FLT_MAX
#include <cmath>   // INFINITY
#include <type_traits>

#include "hopper.cuh"  // cluster_sync_partials, cluster_address, resident_clusters
#include "skinny.cuh"  // mma, launch_cluster_kernel, wait_for_prior_grids, let_successor_launch

namespace {

constexpr int THREADS = 256, WARPS = THREADS / 32, MAX_TILES = 16;  // C <= 16: a non-portable cluster

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__float2half_rn(v));
  else return __bfloat162float(__float2bfloat16_rn(v));
}

size_t smem_bytes(int m, int log2p) {
  const size_t p = (size_t)1 << log2p, mp = (m + 15) & ~15;
  return mp * (p + 8) * 2 + 16 * (p + 4) * 4 + (WARPS + 1) * 4;
}

// grid (C, rows), clusters of (C, 1, 1): blockIdx.x is the CTA's rank in its row's cluster.
// dense: D [mp][mp] in T, zero padded; row_scale = 1 / sqrt(K) in float32; fmax = the largest finite T.
template <typename T>
__global__ void __launch_bounds__(THREADS) rotate_quantize_kernel(const T* __restrict__ x, int ldx,
                                                                  int8_t* __restrict__ q, int ldq,
                                                                  float* __restrict__ scales,
                                                                  const T* __restrict__ dense, int m, int log2p,
                                                                  float row_scale, float fmax, int even_odd,
                                                                  int trigger) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  const int p = 1 << log2p, mp = (m + 15) & ~15, tiles = mp >> 4, rank = blockIdx.x;
  const int xs_stride = p + 8, ys_stride = p + 4;
  const int rows_here = min(16, m - 16 * rank);  // output rows of Y this CTA owns
  T* xs = reinterpret_cast<T*>(smem);
  float* ys = reinterpret_cast<float*>(smem + (size_t)mp * xs_stride * sizeof(T));
  float* red = ys + 16 * ys_stride;  // [WARPS] warp maxima, then red[WARPS]: the CTA's
  const T* __restrict__ xr = x + (size_t)blockIdx.y * ldx;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  wait_for_prior_grids();  // x is the previous kernel's output
  let_successor_launch(trigger);

  // 1. The whole row, 16 bytes a thread (p >= 8: a piece never straddles two sub-rows).
  for (int e = threadIdx.x * 8; e < mp << log2p; e += THREADS * 8) {
    const int i = e >> log2p, j = e & (p - 1);
    *reinterpret_cast<uint4*>(xs + i * xs_stride + j) =
        i < m ? *reinterpret_cast<const uint4*>(xr + e) : make_uint4(0, 0, 0, 0);
  }
  // This CTA's 16 rows of D as A fragments, loaded while the row lands: a0 / a1 = rows g / g + 8,
  // columns 2t, 2t + 1 of the k-tile; a2 / a3 the same 8 columns on.
  uint32_t a[MAX_TILES][4];
  const uint32_t* a_src = reinterpret_cast<const uint32_t*>(dense + (size_t)(rank * 16 + g) * mp + 2 * t);
#pragma unroll
  for (int kt = 0; kt < MAX_TILES; ++kt) {
    if (kt < tiles) {
      a[kt][0] = __ldg(a_src + 8 * kt);
      a[kt][1] = __ldg(a_src + 4 * mp + 8 * kt);
      a[kt][2] = __ldg(a_src + 8 * kt + 4);
      a[kt][3] = __ldg(a_src + 4 * mp + 8 * kt + 4);
    }
  }
  __syncthreads();

  // 2. Z = D X for this CTA's 16 rows, one 8-column tile a warp at a time. ldmatrix.x2.trans: lanes
  // 0-15 name rows k = 16 kt + lane of X (8 columns each); lane (g, t) receives X[2t, 2t+1][g] and
  // X[2t+8, 2t+9][g] of the tile, the B fragment.
  const uint32_t xs_addr = (uint32_t)__cvta_generic_to_shared(xs);
  for (int jt = warp; jt < p >> 3; jt += WARPS) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t row_addr = xs_addr + ((lane & 15) * xs_stride + jt * 8) * (uint32_t)sizeof(T);
#pragma unroll
    for (int kt = 0; kt < MAX_TILES; ++kt) {
      if (kt < tiles) {
        uint32_t b0, b1;
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                     : "=r"(b0), "=r"(b1) : "r"(row_addr + kt * 16 * xs_stride * (uint32_t)sizeof(T)));
        mma<T, false>(c, a[kt], b0, b1);
      }
    }
    // C fragment: c0 / c1 = Z[g][2t, 2t+1], c2 / c3 = Z[g + 8][...] of the tile
    *reinterpret_cast<float2*>(ys + g * ys_stride + jt * 8 + 2 * t) = make_float2(c[0], c[1]);
    *reinterpret_cast<float2*>(ys + (g + 8) * ys_stride + jt * 8 + 2 * t) = make_float2(c[2], c[3]);
  }
  __syncthreads();

  // 3. Sylvester butterflies over j (H_p): pass h pairs j and j + h for every j with bit h clear.
  const int n_here = rows_here << log2p;
  for (int log2h = 0; log2h < log2p; ++log2h) {
    const int h = 1 << log2h;
    for (int pair = threadIdx.x; pair < n_here >> 1; pair += THREADS) {
      const int i = pair >> (log2p - 1), r = pair & ((p >> 1) - 1);
      float* y = ys + i * ys_stride + (((r >> log2h) << (log2h + 1)) | (r & (h - 1)));
      const float lo = y[0], hi = y[h];
      y[0] = lo + hi;
      y[h] = lo - hi;
    }
    __syncthreads();
  }

  // 4. The rotated values as the spec rounds them, saturated; the row's largest magnitude from
  // every CTA of the cluster. A float32 sum that is not finite came from a NaN or +-Inf in x, which the
  // rotation spread over the whole row: it counts as an infinite amax, and the row quantizes to zeros
  // (reference.rotate_quantize_activations; the Triton kernels test the same float32 values, w4a4._act_quant_kernel).
  float amax = 0.f;
  for (int n = threadIdx.x; n < n_here; n += THREADS) {
    float* y = ys + (n >> log2p) * ys_stride + (n & (p - 1));
    const float r = *y * row_scale;
    float v = round_to<T>(r);
    v = v != v ? 0.f : fminf(fmaxf(v, -fmax), fmax);
    *y = v;
    amax = fmaxf(amax, fabsf(r) <= FLT_MAX ? fabsf(v) : INFINITY);  // NaN compares false: infinite too
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < WARPS; ++w) amax = fmaxf(amax, red[w]);
    red[WARPS] = amax;
  }
  cluster_sync_partials();  // every CTA's red[WARPS] written and visible
  const uint32_t mine = (uint32_t)__cvta_generic_to_shared(red + WARPS);
  amax = 0.f;
  for (int r = 0; r < tiles; ++r) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_address(mine, r)) : "memory");
    amax = fmaxf(amax, v);
  }
  cluster_sync_partials();  // no CTA exits while another still reads its amax
  const bool zeroed = amax > FLT_MAX;  // the row held a non-finite value (step 4)
  const float scale = zeroed ? 0.f : __fdiv_rn(amax, 7.f), safe = scale > 0.f ? scale : 1.f;
  if (rank == 0 && threadIdx.x == 0) scales[blockIdx.y] = scale;

  // 5. Codes of this CTA's rows, 4 outputs a thread (one 32-bit store): in even_odd order output
  // position o of a 32-column block holds column 2o (o < 16) or 2(o - 16) + 1.
  int8_t* __restrict__ qr = q + (size_t)blockIdx.y * ldq + ((size_t)rank << (4 + log2p));
  for (int o = threadIdx.x * 4; o < n_here; o += THREADS * 4) {
    uint32_t word = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int pos = o + u, within = pos & 31;
      const int n = even_odd ? (pos & ~31) | (within < 16 ? 2 * within : 2 * (within - 16) + 1) : pos;
      const float v = ys[(n >> log2p) * ys_stride + (n & (p - 1))];
      const int code = zeroed ? 0 : (int)fminf(fmaxf(rintf(__fdiv_rn(v, safe)), -8.f), 7.f);
      word |= (uint32_t)(code & 0xFF) << (8 * u);
    }
    *reinterpret_cast<uint32_t*>(qr + o) = word;
  }
#endif
}

template <typename T>
cudaError_t launch(const void* x, int M, int ldx, void* q, int ldq, float* scales, const void* dense, int m,
                   int log2p, float row_scale, float fmax, int even_odd, cudaStream_t stream, bool pdl, bool trigger) {
  constexpr auto kernel = rotate_quantize_kernel<T>;
  const cudaError_t err = opt_in_shared_memory<kernel, true>();  // 172 = 11 tiles of 16: clusters over 8
  if (err != cudaSuccess) return err;
  const int tiles = (m + 15) >> 4;
  return launch_cluster_kernel(kernel, dim3(tiles, M), dim3(tiles), THREADS, smem_bytes(m, log2p), stream, pdl,
                               static_cast<const T*>(x), ldx, static_cast<int8_t*>(q), ldq, scales,
                               static_cast<const T*>(dense), m, log2p, row_scale, fmax, even_odd, (int)(pdl && trigger));
}

}  // namespace

// Host entry point (called through ctypes). Preconditions checked by the Python caller
// (w4a4.rotate_quantize_applicable): sm_90+, K = m * 2^log2p with m <= 256 and 2^log2p >= 8, x
// rows 16-byte aligned (ldx % 8 == 0), q rows 4-byte aligned (ldq % 4 == 0), dense = the dense
// factor of order m zero padded to a multiple of 16 in x's type, smem_bytes(m, log2p) within the
// per-CTA limit. pdl: the kernel may launch early (skinny.cuh); trigger: it lets the next kernel
// launch early too, once past its own wait (w4a4.rotate_quantize_successor says where that pays).
extern "C" int nibble_rotate_quantize(int is_bf16, const void* x, int M, int ldx, void* q, int ldq, float* scales,
                                      const void* dense, int m, int log2p, float row_scale, float fmax, int even_odd,
                                      int pdl, int trigger, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const cudaError_t err =
      is_bf16 ? launch<__nv_bfloat16>(x, M, ldx, q, ldq, scales, dense, m, log2p, row_scale, fmax, even_odd, st, pdl,
                                      trigger)
              : launch<__half>(x, M, ldx, q, ldq, scales, dense, m, log2p, row_scale, fmax, even_odd, st, pdl,
                               trigger);
  return (int)err;
}

// How many of a row's clusters (m rounded up to 16, over 16, CTAs of smem_bytes(m, log2p)) the current
// device holds at once: 0 where it holds none (a cluster's CTAs share a GPC, which a GPU partition or
// another GPU may not offer at 9-16 CTAs; the Python side keeps the Triton path there), or the error.
extern "C" int nibble_rotate_quantize_clusters(int m, int log2p, int* clusters) {
  constexpr auto kernel = rotate_quantize_kernel<__nv_bfloat16>;  // __half's takes the same resources
  cudaError_t err = opt_in_shared_memory<kernel, true>();
  if (err == cudaSuccess) err = resident_clusters<kernel>((m + 15) >> 4, THREADS, smem_bytes(m, log2p), *clusters);
  if (err == cudaErrorInvalidConfiguration) {  // resident_clusters: none fits
    *clusters = 0;
    err = cudaSuccess;
  }
  return (int)err;
}

extern "C" const char* nibble_rotate_quantize_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
