// Experiment (benchmarks/scripts/act_quant_cluster_ab.py): W4A4's per-token quantization of bf16 rows
// with each row split over a thread-block cluster of C CTAs, so that a long row's values are spread
// over C SMs' worth of issue slots and loads (the package's Triton kernel gives a row one program, and
// at 128 rows of 11008-28672 values that program is compute-bound on its SM). The CTAs' amax meet
// through distributed shared memory between two cluster barriers. The arithmetic is the Triton
// kernel's, operation for operation (nibble/kernels/w4a4.py: _sanitize, _int4_scale, _row_quotients,
// _round_to_int8), so the codes and scales must come out equal.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "hopper.cuh"  // cluster_sync_partials, cluster_address
#include "skinny.cuh"  // launch_cluster_kernel, wait_for_prior_grids, let_successor_launch

namespace {

constexpr int THREADS = 256, WARPS = THREADS / 32;

// grid (C, M), clusters (C, 1, 1): CTA `rank` of row blockIdx.y owns columns [rank chunk, (rank + 1) chunk)
// (chunk a multiple of 32, so an even_odd block never straddles two CTAs); each thread up to V vectors
// of 8 values.
template <int V>
__global__ void __launch_bounds__(THREADS) quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                                                                int8_t* __restrict__ q, int ldq,
                                                                float* __restrict__ scales, int K, int chunk,
                                                                float fmax, int even_odd) {
  __shared__ float red[WARPS + 1];
  const int rank = blockIdx.x, clusters = gridDim.x, row = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  wait_for_prior_grids();
  let_successor_launch(1);
  const int c0 = rank * chunk, c1 = min(K, c0 + chunk);
  const __nv_bfloat16* xr = x + (size_t)row * ldx;
  float v[V][8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int col = c0 + (threadIdx.x + i * THREADS) * 8;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (col < c1) raw = *reinterpret_cast<const uint4*>(xr + col);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float f = __uint_as_float(e & 1 ? w[e / 2] & 0xFFFF0000u : w[e / 2] << 16);
      f = f != f ? 0.f : fminf(fmaxf(f, -fmax), fmax);  // NaN -> 0, +-Inf -> +-max
      v[i][e] = f;
      amax = fmaxf(amax, fabsf(f));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = red[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = fmaxf(m, red[w]);
    red[WARPS] = m;
  }
  cluster_sync_partials();  // every CTA's amax is in its red[WARPS]
  const uint32_t mine = (uint32_t)__cvta_generic_to_shared(&red[WARPS]);
  float row_amax = 0.f;
  for (int r = 0; r < clusters; ++r) {
    float a;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(a) : "r"(cluster_address(mine, r)));
    row_amax = fmaxf(row_amax, a);
  }
  const float scale = __fdiv_rn(row_amax, 7.f);
  const float safe = scale > 0.f ? scale : 1.f;
  const float pre = safe < 1.0e-19f ? 18446744073709551616.f : 1.f;
  const float s = __fmul_rn(safe, pre), inv = __fdiv_rn(1.f, s);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int col = c0 + (threadIdx.x + i * THREADS) * 8;
    if (col >= c1) continue;
    uint32_t b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float xv = __fmul_rn(v[i][e], pre);
      const float q0 = __fmul_rn(xv, inv);
      const float y = fminf(fmaxf(__fmaf_rn(__fmaf_rn(q0, -s, xv), inv, q0), -8.f), 7.f);
      b[e] = __float_as_uint(__fadd_rn(y, 12582912.f)) & 0xFFu;
    }
    int8_t* qr = q + (size_t)row * ldq;
    if (even_odd) {  // columns col .. col + 7 are slots 4j .. of the 32-block's even half and of its odd half
      const int block = col & ~31, j = (col & 31) >> 3;
      *reinterpret_cast<uint32_t*>(qr + block + 4 * j) = b[0] | b[2] << 8 | b[4] << 16 | b[6] << 24;
      *reinterpret_cast<uint32_t*>(qr + block + 16 + 4 * j) = b[1] | b[3] << 8 | b[5] << 16 | b[7] << 24;
    } else {
      *reinterpret_cast<uint2*>(qr + col) = make_uint2(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24,
                                                       b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24);
    }
  }
  if (rank == 0 && threadIdx.x == 0) scales[row] = scale;
  cluster_sync_partials();  // the other CTAs are done reading this CTA's amax
}

}  // namespace

// x [M, K] bf16 (ldx elements a row), q [M, K] int8, scales [M] float32; K % 32 == 0, ldx % 8 == 0.
// Returns a cudaError_t; cudaErrorInvalidValue where a chunk does not fit V = 8 vectors a thread.
extern "C" int nibble_quantize_rows_cluster(int cluster, const void* x, int ldx, void* q, int ldq, void* scales,
                                            int M, int K, float fmax, int even_odd, int pdl, void* stream) {
  if (cluster < 1 || cluster > 8 || K % 32 || ldx % 8) return cudaErrorInvalidValue;
  const int chunk = (K / 32 + cluster - 1) / cluster * 32, vectors = (chunk / 8 + THREADS - 1) / THREADS;
  const auto st = static_cast<cudaStream_t>(stream);
  const auto args = [&](auto kernel) {
    return launch_cluster_kernel(kernel, dim3(cluster, M), dim3(cluster, 1, 1), THREADS, 0, st, pdl != 0,
                                 static_cast<const __nv_bfloat16*>(x), ldx, static_cast<int8_t*>(q), ldq,
                                 static_cast<float*>(scales), K, chunk, fmax, even_odd);
  };
  if (vectors <= 1) return args(quantize_rows_kernel<1>);
  if (vectors <= 2) return args(quantize_rows_kernel<2>);
  if (vectors <= 4) return args(quantize_rows_kernel<4>);
  if (vectors <= 8) return args(quantize_rows_kernel<8>);
  return cudaErrorInvalidValue;
}
