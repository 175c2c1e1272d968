// W4A4 skinny GEMM for M <= 16 (decode) on the INT8 tensor cores, exact in int32:
//
//   acc[m, n] = sum_k qx[m, k] * (q[k, n] - 8),   y[m, n] = acc * (x_scale[m] * w_scale[n]) (+ bias[n])
//   qx int8 [M, K] (per-token INT4 values in [-8, 7]); qweight int32 [K / 8, N] (canonical layout,
//   codes q in 0..15, nibble j of word (i, n) = K row 8i + j); x_scale float32 [M]; w_scale [N].
//
// The skeleton is csrc/w4a16_mma.cu's (its header explains the copy mapping, the swizzled stage and
// the ring): per warp and 32-deep K step, 512 bytes of weights (4 word rows x 32 columns) go HBM ->
// shared memory with cp.async, one whole 128-byte line per 8-lane phase; lane (g, t) then consumes
// the four words of columns c .. c+3 (c = tile_col + 4g) at word row 4 step + t.
//
// What differs is the arithmetic, which is much cheaper than W4A16's:
// - The weight is the A operand of mma.m16n8k32.u8.s8 (rows = output columns, 32 K per MMA). A
//   word's codes go to the tensor cores as unsigned bytes, no sign fix-up: (w & 0x0F0F0F0F) holds
//   K rows 8i + {0, 2, 4, 6} and ((w >> 4) & 0x0F0F0F0F) rows 8i + {1, 3, 5, 7}: one shift and two
//   lop3 per 8 weights. sum_k x (q - 8) = sum_k x q - 8 X with X = sum_k x from one more MMA whose A
//   is all ones, exact in int32.
// - Fragment: MMA rows g / g+8 are columns (c, c+1) for tile 0 and (c+2, c+3) for tile 1; a0/a1
//   (K slots 4t .. 4t+3) are the even rows of those two columns, a2/a3 (K slots 16+4t ..) the odd
//   rows. B (x^T, 32 x 8 int8) takes the same K order: the lane's 8 bytes x[m, 8i .. 8i+7] split
//   into even and odd bytes by two byte-permutes. One k32 MMA per tile covers the whole step.
// - Per-channel scales: no group boundaries, the int32 sums run over the warp's whole K range, meet
//   across warps in shared memory (exact, order-free), and are scaled once per output.
// Per step: 4 x 3 ALU instructions for the weights, 2 permutes per token tile, 3 MMAs per token tile.
// One launch serves up to three weights that read the same qx (skinny.cuh: MAX_WEIGHTS), each with
// its own qweight, w_scale, bias and output; the scale and bias dtypes are the launch's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "skinny.cuh"
#include "w4a4_epilogue.cuh"

namespace {

constexpr int RING = 4, AHEAD = RING - 2;  // as in w4a16_mma.cu: one warp barrier per step

// c += A (16 x 32 u8, four registers) * B (32 x 8 s8, two registers), int32 accumulators
__device__ __forceinline__ void mma_u8s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The weights of one launch (skinny.cuh: cta_weight); bias entries may be null.
struct Weights {
  const uint32_t* qweight[MAX_WEIGHTS];
  const void* w_scale[MAX_WEIGHTS];
  const void* bias[MAX_WEIGHTS];
  void* out[MAX_WEIGHTS];
  int n[MAX_WEIGHTS], ldo[MAX_WEIGHTS], cta_end[MAX_WEIGHTS];
};

// MT: token tiles of 8 (M <= 8 * MT). T: output type (half, bfloat16, float, or int for the raw
// int32 accumulators).
template <typename T, int MT, bool MANY>
__global__ void __launch_bounds__(512, MT == 1 ? 2 : 1)
    w4a4_mma_kernel(const int8_t* __restrict__ qx, const float* __restrict__ x_scale, const Weights weights,
                    int w_scale_dtype, int bias_dtype, int M, int K, int ldx, int trigger) {
  // A stage (bytes): [0, 512) weights (swizzled rows, as in w4a16_mma.cu); [512, 512 + 256 MT) x,
  // 32 bytes per token (8 per lane: x[m, 8i .. 8i+7], the lane's own slot), copied for real tokens
  // only (the slots of padding tokens are zeroed once). Reused after the loop as
  // [warps][MT * 8][32] int32.
  constexpr int STAGE = 512 + 256 * MT, XS = 512;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int tile_col;
  const int which = cta_weight<MANY>(weights.cta_end, tile_col);
  const uint32_t* __restrict__ qweight = pick(weights.qweight, which);
  const int N = pick(weights.n, which);
  const int steps = K >> 5;
  const int s_begin = (int)((long long)steps * warp / warps), s_end = (int)((long long)steps * (warp + 1) / warps);
  const int m_rows = M < MT * 8 ? M : MT * 8;

  unsigned char* ring = smem + (size_t)warp * RING * STAGE;
  const uint32_t ring_addr = (uint32_t)__cvta_generic_to_shared(ring);
  WeightStream ws(ring_addr, lane, qweight, N, s_begin, tile_col);
  ws.prefetch<RING>(s_begin, s_end);
  wait_for_prior_grids();  // qx and x_scale are the previous kernel's output
  let_successor_launch(trigger);
  TokenStream<int8_t, uint2, MT> xstream(qx, ldx, m_rows, lane, s_begin, ring + XS, STAGE, RING);

  auto issue = [&](int stage, int, int ahead, bool live) {
    cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      cp_async_8(live && xstream.live[mt], ring_addr + stage * STAGE + XS + xstream.offset(mt), xstream.src[mt] + 32 * ahead);
    cp_async_commit();
    ws.src += ws.step_stride;  // past the range: never read
  };

  int acc[MT][2][4], xsum[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[mt][0][j] = acc[mt][1][j] = xsum[mt][j] = 0;
  const uint32_t ones[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};

  auto step = [&](int i, int) {
    const unsigned char* here = ring + i * STAGE;
    const uint4 wv = *reinterpret_cast<const uint4*>(here + ws.read_src);
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};  // columns c .. c+3
    uint32_t even[4], odd[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      even[j] = w[j] & 0x0F0F0F0Fu;
      odd[j] = (w[j] >> 4) & 0x0F0F0F0Fu;
    }
    const uint32_t a[2][4] = {{even[0], even[1], odd[0], odd[1]}, {even[2], even[3], odd[2], odd[3]}};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint2 xr = *reinterpret_cast<const uint2*>(here + XS + xstream.offset(mt));
      const uint32_t b0 = __byte_perm(xr.x, xr.y, 0x6420), b1 = __byte_perm(xr.x, xr.y, 0x7531);
      mma_u8s8(acc[mt][0], a[0], b0, b1);
      mma_u8s8(acc[mt][1], a[1], b0, b1);
      mma_u8s8(xsum[mt], ones, b0, b1);
    }
  };
  run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });

  // Codes were q, not q - 8: subtract 8 X.
  int* partial = reinterpret_cast<int*>(smem);
  store_fragments<MT>(partial, warp, lane, [&](int mt, int tile, int c) { return acc[mt][tile][c] - 8 * xsum[mt][c & 1]; });
  __syncthreads();
  T* __restrict__ out = static_cast<T*>(pick(weights.out, which));  // picked here: no registers held in the loop
  const void* __restrict__ w_scale = pick(weights.w_scale, which);
  const void* __restrict__ bias = pick(weights.bias, which);
  const int ldo = pick(weights.ldo, which);
  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    int sum = 0;
    for (int w = 0; w < warps; ++w) sum += partial[w * (MT * 8 * 32) + i];
    const int m = i >> 5, n = tile_col + (i & 31);
    T* dst = out + (size_t)m * ldo + n;
    if constexpr (std::is_same_v<T, int>) {
      *dst = sum;
    } else {
      *dst = saturate_cast<T>(scale_output(sum, x_scale[m], load_float(w_scale, w_scale_dtype, n), bias != nullptr,
                                           bias == nullptr ? 0.f : load_float(bias, bias_dtype, n)));
    }
  }
}

size_t smem_bytes(int warps, int mt) {
  const size_t ring = (size_t)warps * RING * (512 + 256 * mt), partial = (size_t)warps * mt * 8 * 32 * sizeof(int);
  return ring > partial ? ring : partial;
}

template <typename T, int MT, bool MANY>
cudaError_t launch(const void* qx, const float* xs, const Weights& weights, int ctas, int ws_dtype, int bias_dtype,
                   int M, int K, int ldx, int warps, cudaStream_t stream, bool pdl, int successor) {
  constexpr auto kernel = w4a4_mma_kernel<T, MT, MANY>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  int trigger = 0;
  size_t smem = smem_bytes(warps, MT);
  if ((err = successor_smem<kernel>(successor, pdl, ctas, warps * 32, smem, trigger)) != cudaSuccess) return err;
  return launch_kernel(kernel, ctas, warps * 32, smem, stream, pdl, static_cast<const int8_t*>(qx), xs, weights, ws_dtype,
                       bias_dtype, M, K, ldx, trigger);
}

template <typename T>
cudaError_t launch_t(int mt, const void* qx, const float* xs, const Weights& weights, int ctas, int ws_dtype,
                     int bias_dtype, int M, int K, int ldx, int warps, cudaStream_t stream, bool pdl,
                     int successor) {
  const bool many = weights.cta_end[0] < ctas;  // several weights (skinny.cuh: cta_weight)
#define NIBBLE_LAUNCH_MT(MT) \
  (many ? launch<T, MT, true>(qx, xs, weights, ctas, ws_dtype, bias_dtype, M, K, ldx, warps, stream, pdl, successor) \
        : launch<T, MT, false>(qx, xs, weights, ctas, ws_dtype, bias_dtype, M, K, ldx, warps, stream, pdl, successor))
  switch (mt) {
    case 1: return NIBBLE_LAUNCH_MT(1);
    case 2: return NIBBLE_LAUNCH_MT(2);
    default: return cudaErrorInvalidValue;
  }
#undef NIBBLE_LAUNCH_MT
}

}  // namespace

// Host entry point (called through ctypes): `count` weights (1 to 3) that read the same qx, their
// pointers, column counts and output row strides in arrays (a null bias: none). Preconditions are
// checked by the Python caller: every N % 32 == 0, K % 32 == 0, M <= 8 * mt, mt in {1, 2},
// 1 <= warps <= 16, 8-byte aligned qx rows (ldx % 8 == 0). out_dtype: 0 float32, 1 float16,
// 2 bfloat16, 3 int32 (raw accumulators); w_scale_dtype / bias_dtype (every weight's): 0 float32,
// 1 float16, 2 bfloat16. pdl: launch early (skinny.cuh: launch_kernel); successor: when the next
// kernel may launch (skinny.cuh: Successor).
extern "C" int nibble_w4a4_mma(int out_dtype, int mt, int warps, const void* qx, const void* x_scale, int w_scale_dtype,
                               int bias_dtype, int M, int K, int ldx, int count, const void* const* qweights,
                               const void* const* w_scales, const void* const* biases, void* const* outs,
                               const int* ns, const int* ldos, int pdl, int successor, void* stream) {
  if (count < 1 || count > MAX_WEIGHTS) return (int)cudaErrorInvalidValue;
  Weights w{};
  for (int i = 0; i < count; ++i) {
    w.qweight[i] = static_cast<const uint32_t*>(qweights[i]);
    w.w_scale[i] = w_scales[i];
    w.bias[i] = biases[i];
    w.out[i] = outs[i];
    w.n[i] = ns[i];
    w.ldo[i] = ldos[i];
  }
  const int ctas = running_ends(count, ns, 32, w.cta_end);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const float* xs = static_cast<const float*>(x_scale);
  cudaError_t err;
  switch (out_dtype) {
#define NIBBLE_LAUNCH_OUT(T) \
  launch_t<T>(mt, qx, xs, w, ctas, w_scale_dtype, bias_dtype, M, K, ldx, warps, st, pdl, successor)
    case 0: err = NIBBLE_LAUNCH_OUT(float); break;
    case 1: err = NIBBLE_LAUNCH_OUT(__half); break;
    case 2: err = NIBBLE_LAUNCH_OUT(__nv_bfloat16); break;
    case 3: err = NIBBLE_LAUNCH_OUT(int); break;
    default: err = cudaErrorInvalidValue;
#undef NIBBLE_LAUNCH_OUT
  }
  return (int)err;
}

extern "C" const char* nibble_w4a4_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
