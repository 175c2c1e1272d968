// W4A16 GEMM for many tokens (prefill, batches) on Hopper's asynchronous tensor cores (wgmma,
// sm_90a), reading nibble's canonical INT4 layout as stored:
//
//   y[m, n] = sum_k x[m, k] * (q[k, n] * s[k / G, n] + z[k / G, n])     fp32 accumulation
//
// Why a CUDA kernel: below ~32 tokens csrc/w4a16_mma.cu streams the weight; above, the work is the
// tensor cores', and the weight must reach them dequantized without a round trip through shared
// memory or HBM (the previous path dequantized the whole weight to bf16, then ran cuBLAS).
//
// Roles (those of csrc/w4a4_wgmma.cu, whose header explains the pipeline). The weight is wgmma's A
// operand, taken from registers: each warpgroup dequantizes its own CH / 2 output channels straight
// into the fragments of J = CH / 128 m64 x k16 instructions. The activations are B (tokens = wgmma's
// N), read by the tensor cores from shared memory. A CTA is two warpgroups x CH / 2 channels x BN
// tokens (the Tile shapes below); a third warpgroup issues the TMA copies, STAGES tiles of 128 K
// ahead, through full / empty mbarriers.
//
// Weight fragments. An m64 x k16 fragment gives lane (g, t) of each warp the K pairs (2t, 2t+1) and
// (2t+8, 2t+9) of rows g and g+8. A k16 step is two word rows of the canonical layout (word row i
// holds K rows 8i .. 8i+7, nibble j = row 8i + j), and K pair (2t, 2t+1) is exactly byte t of a
// word. So lane (g, t) reads, per k16 step, the words of its 2J consecutive columns c .. (one 16- or
// 8-byte piece) in both word rows (rows g / g+8 of instruction j are columns c + 2j / c + 2j + 1),
// and takes byte t of each word: the K order of the tensor cores is the natural one, so x needs no
// permutation and arrives by TMA as the caller holds it. The four lanes t read the same bytes (a
// shared-memory broadcast); each dequantizes only its own byte.
//
// Dequantization for bf16 x, exact and in fp32 (6 instructions per register of two weights):
//   r = rotate(word, 15 - 8t)                 byte t at bits 15..22: low nibble 15..18, high 19..22
//   lo = float(r & 0x00078000 | 0x3F800000)   = 1 + q_lo / 256 exactly (the nibble in the mantissa)
//   hi = float(r & 0x00780000 | 0x3F800000)   = 1 + q_hi / 16
//   w_lo = fma(lo, 256 s, z - 256 s),  w_hi = fma(hi, 16 s, z - 16 s)   then one cvt packs both.
// The per-group constants are fp32 (s and z are fp16, so 256 s is exact and z - 256 s is off by at
// most 2^-16 s), and each weight is rounded once, to x's dtype: the same weight the reference
// rounds. (In 16-bit arithmetic, bf16 scales would cost 2-3 ulp per weight: measured 1.65x the
// error of a bf16 product, for 5-10% of speed. Folding the magic constant into z in 16 bits
// cancels catastrophically.)
// For fp16 x the scales and zeros are already x's type, so 16-bit arithmetic rounds each weight
// once too (4 instructions per register):
//   v = byte_perm(word, 0x64646464, [t, 4, t, 4]) & 0xFFF0FF0F   halves 0x640L, 0x64H0: the fp16
//                                              1024 + q_lo (ulp 1), 1024 + 16 q_hi (ulp 16)
//   q = v * (1, 1/16) - (1024, 64)             (q_lo, q_hi), exactly
//   w = q * (s, s) + (z, z)                    one fused multiply-add: q s + z rounded once
//
// Where the time goes (Nsight Compute, H200; benchmarks/notes-w4a16.md session 7): the unpacking
// does not hide behind the asynchronous MMAs as well as the int8 kernel's 3 instructions per word
// do. Without MMAs it takes ~30% of the kernel's time, without unpacking the MMAs run at ~770
// TFLOP/s (cuBLAS's rate), together they overlap only in part; hence 256-token tiles where M is
// large (half the unpacking per MAC).
//
// Shared memory, per stage: x as two boxes of BN rows x 64 K (128 bytes, the TMA's 128-byte swizzle
// that wgmma's descriptor reads; a k16 step moves the descriptor by 32 bytes), the weight as CH / 32
// boxes of 16 word rows x 32 columns (same swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)),
// then the group's scales and zeros: one row of CH fp16 per group the stage touches (G >= 128: one;
// G = 64, 32: two, four). TMA zero-fills past M, N, K: zero x times any finite weight adds nothing.
//
// Epilogue: lane (g, t) holds channels c .. c+2J-1 of tokens 8 b + 2 t + {0, 1}: one 2J-wide store
// per token. Split-K (few tiles for the SMs): the splits of a tile are one cluster; each stores its
// fp32 partial in its shared memory, then sums every split's partials of its share of the tile's
// rows in split order (bitwise repeatable), read from their shared memory, and stores them
// (hopper.cuh: RowShare).
//
// Several weights that read the same x (a block's q/k/v or gate/up, up to MAX_WEIGHTS, one group
// size) run as one GEMM over their output columns side by side, as in csrc/w4a4_wgmma.cu: each tile
// reads its weight's tensor maps and writes its weight's output (hopper.cuh: column_weight).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "hopper.cuh"
#include "skinny.cuh"

namespace {

constexpr int THREADS = CONSUMER_THREADS + 128;  // registers are granted per warpgroup
constexpr int STEPS = BK / 16;            // k16 steps per stage
constexpr int X_BOX = 64;                 // x columns per 128-byte swizzled row

// The CTA: BN tokens x CH channels, CH / 128 = J m64 x BN x k16 instructions per warpgroup and
// step (a lane owns 2J consecutive columns). 256 channels share each x tile between more weights;
// 128 channels make twice the CTAs where the output has few tiles, 64 x 128 twice again (picked at
// 64 tokens on some layers: H200, session 20, 8192 x 28672 109.9 -> 97.9 us); 256 tokens (J = 1,
// the same 128 accumulators per thread) make every dequantized weight feed twice the tokens, which
// halves the unpacking per MAC where M is large. Per stage: x, the weight boxes, then the scales and
// zeros of the SZ_ROWS groups it touches (GROUP_STEPS k16 steps per group), padded so that every
// stage starts 1024-byte aligned; as many stages as fit (at most 6).
template <int BN, int CH_, int GROUP_STEPS> struct Tile {
  static constexpr int CH = CH_, J = CH / 128;
  static constexpr int SZ_ROWS = STEPS / GROUP_STEPS, SZ_ROW = CH * 2;
  static constexpr int X_BYTES = BN * BK * 2, W_BYTES = CH / 32 * W_BOX, SZ_BYTES = 2 * SZ_ROWS * SZ_ROW;
  static constexpr int BYTES = X_BYTES + W_BYTES + SZ_BYTES;  // what the TMA brings per stage
  static constexpr int STAGE = X_BYTES + W_BYTES + (SZ_BYTES + 1023) / 1024 * 1024;
  static constexpr int STAGES = (227 * 1024 - 1024 - 128) / STAGE < 6 ? (227 * 1024 - 1024 - 128) / STAGE : 6;
  static constexpr size_t SMEM = (size_t)STAGES * STAGE + 1024 + 16 * STAGES;  // + alignment, mbarriers
  static_assert(partial_bytes<BN, J>() <= STAGES * STAGE, "split-K's partials go through the ring");
};

// The activation type T (__half or __nv_bfloat16): its wgmma kind, its TMA element type, and two
// fp32 values rounded into one fragment register (low half first).
template <typename T> struct Elem {
  static constexpr bool HALF = std::is_same_v<T, __half>;
  using Kind = std::conditional_t<HALF, F16, BF16>;
  static constexpr CUtensorMapDataType map_type =
      HALF ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    if constexpr (HALF) {
      const __half2 h = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&h);
    }
  }
};

// One column's group. bf16: w = (1 + q/256) * s256 + z256 for the low nibble of a byte, (1 + q/16)
// * s16 + z16 for the high one. fp16: s and z, each twice.
template <typename T, bool HALF = Elem<T>::HALF>
struct Affine {
  float s256, z256, s16, z16;
  __device__ __forceinline__ Affine() {}
  __device__ __forceinline__ Affine(__half s, __half z) {
    const float sf = __half2float(s), zf = __half2float(z);
    s256 = 256.f * sf;
    z256 = zf - s256;
    s16 = 16.f * sf;
    z16 = zf - s16;
  }
};

template <typename T>
struct Affine<T, true> {
  __half2 s2, z2;
  __device__ __forceinline__ Affine() {}
  __device__ __forceinline__ Affine(__half s, __half z) : s2(__half2half2(s)), z2(__half2half2(z)) {}
};

// What a lane needs to find its byte t in a word: bf16 the rotation (15 - 8t) mod 32, fp16 the
// byte_perm selector [t, 4, t, 4].
template <typename T>
__device__ __forceinline__ uint32_t byte_select(int t) {
  return Elem<T>::HALF ? 0x4040u | (t << 8) | t : (15 - 8 * t) & 31;
}

// Byte t of `word` (`byte_select`) -> the fragment register of its two weights.
template <typename T>
__device__ __forceinline__ uint32_t dequant(uint32_t word, uint32_t select, const Affine<T>& a) {
  if constexpr (Elem<T>::HALF) {
    const auto half2_of = [](uint32_t u) { return *reinterpret_cast<const __half2*>(&u); };
    const uint32_t v = __byte_perm(word, 0x64646464u, select) & 0xfff0ff0fu;
    // (1, 1/16) and (-1024, -64), low half first
    const __half2 q = __hfma2(half2_of(v), half2_of(0x2c003c00u), half2_of(0xd400e400u));
    const __half2 w = __hfma2(q, a.s2, a.z2);
    return *reinterpret_cast<const uint32_t*>(&w);
  } else {
    const uint32_t r = __funnelshift_l(word, word, select);
    const float lo = __uint_as_float(and_or(r, 0x00078000u, 0x3F800000u));
    const float hi = __uint_as_float(and_or(r, 0x00780000u, 0x3F800000u));
    return Elem<T>::pack(fmaf(lo, a.s256, a.z256), fmaf(hi, a.s16, a.z16));
  }
}

// A lane's 2J consecutive outputs of one token, in one store where `live` (hopper.cuh: store_if).
template <typename T, int J>
__device__ __forceinline__ void store_outputs(bool live, T* dst, const float (&v)[2 * J]) {
  Vec<uint32_t, J> o;
#pragma unroll
  for (int j = 0; j < J; ++j) o.v[j] = Elem<T>::pack(v[2 * j], v[2 * j + 1]);
  store_if(live, dst, o);
}

// The weights of one launch: weight i (its codes, scales and zeros) owns the launch's columns
// [col_end[i - 1], col_end[i]).
struct Weights {
  CUtensorMap w_map[MAX_WEIGHTS], s_map[MAX_WEIGHTS], z_map[MAX_WEIGHTS];
  void* out[MAX_WEIGHTS];
  int ldo[MAX_WEIGHTS], col_end[MAX_WEIGHTS];
};

// GROUP_STEPS: k16 steps per group inside a stage (2 for G = 32, 4 for 64, 8 for G >= 128).
// SPLIT: split-K in clusters (gridDim.y > 1), a kernel of its own as in csrc/w4a4_wgmma.cu.
template <typename T, int BN, int CH_, int GROUP_STEPS, bool SPLIT>
__global__ void __launch_bounds__(THREADS, 1)
    w4a16_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ Weights weights,
                       int M, int N, int K, int group_size, int tiles_per_split) {
  using L = Tile<BN, CH_, GROUP_STEPS>;
  constexpr int J = L::J, CH = L::CH, STAGES = L::STAGES, STAGE = L::STAGE, R = BN / 2;
  constexpr int SZ_ROWS = L::SZ_ROWS, SZ_ROW = L::SZ_ROW, X_STAGE = L::X_BYTES, W_STAGE = L::W_BYTES;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const unsigned char* smem = smem_raw + (base - raw);
  const uint32_t bars = base + STAGES * STAGE;  // full[STAGES], then empty[STAGES]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  const CtaWork work = cta_work(M, N, K, BN, CH, tiles_per_split, blockIdx.x, blockIdx.y);
  const int m0 = work.m0, n0 = work.n0, tiles = work.k_tiles;
  int col0;  // the weight's first column in the launch
  const int which = column_weight(weights.col_end, n0, col0);

  if (tid == 0) init_stage_barriers<STAGES>(bars);
  __syncthreads();

  if (warp >= CONSUMER_THREADS / 32) {  // the producer warpgroup: one thread issues, the rest idle
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == CONSUMER_THREADS) {
      const int wn0 = n0 - col0;
      const CUtensorMap* w_map = pick_address(weights.w_map, which);
      const CUtensorMap* s_map = pick_address(weights.s_map, which);
      const CUtensorMap* z_map = pick_address(weights.z_map, which);
      produce<STAGES>(
          bars, base, STAGE, L::BYTES, work.k_begin, tiles, 0,
          [&](uint32_t dst, int k0, uint32_t full) {
            load_weight_boxes<CH>(dst + X_STAGE, w_map, wn0, k0, full);
            tma_load(dst + X_STAGE + W_STAGE, s_map, wn0, k0 / group_size, full);
            tma_load(dst + X_STAGE + W_STAGE + SZ_ROWS * SZ_ROW, z_map, wn0, k0 / group_size, full);
          },
          [&](uint32_t dst, int k0, uint32_t full) {
            tma_load(dst, &x_map, k0, m0, full);
            tma_load(dst + BN * 128, &x_map, k0 + X_BOX, m0, full);
          });
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  float acc[J][R];
  zero_accumulators(acc);

  const LaneWeights<J> lane_w(warp, g, X_STAGE);
  const int col = lane_w.col;
  const int sz_read = X_STAGE + W_STAGE + 2 * col;
  const uint32_t select = byte_select<T>(t);
  // This lane's columns' scales (z = 0) or zeros (z = 1) in the stage's group row j.
  auto params = [&](const unsigned char* stage, int j, int z) {
    return *reinterpret_cast<const Vec<__half, 2 * J>*>(stage + sz_read + (z * SZ_ROWS + j) * SZ_ROW);
  };
  // Shared-memory loads are issued one step ahead of their use: while the tensor cores read their
  // operands a load takes hundreds of cycles, and waited on at once it kept the unpacking from
  // overlapping the MMAs (Nsight Compute: the first shift after each load was the top stall).
  if (tiles > 0) mbar_wait(bars, 0);
  Vec<uint32_t, 2 * J> wa = lane_w.words(smem, 0), wb = lane_w.words(smem, 1);
  Vec<__half, 2 * J> sv = params(smem, 0, 0), zv = params(smem, 0, 1);
  Affine<T> aff[2 * J];
  for (int i = 0; i < tiles; ++i) {
    const int s = i % STAGES;
    const uint32_t sx = base + s * STAGE;
    const unsigned char* here = smem + s * STAGE;
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
      if (k % GROUP_STEPS == 0) {
#pragma unroll
        for (int c = 0; c < 2 * J; ++c) aff[c] = Affine<T>(sv.v[c], zv.v[c]);
      }
      // The next step's words (and group parameters): this stage's, or the first of the next one.
      const unsigned char* next = here;
      int nk = k + 1;
      if (k == STEPS - 1) {
        if (i + 1 < tiles) mbar_wait(bars + 8 * ((i + 1) % STAGES), ((i + 1) / STAGES) & 1);
        next = smem + ((i + 1) % STAGES) * STAGE;  // past the last tile: read, never used
        nk = 0;
      }
      const Vec<uint32_t, 2 * J> na = lane_w.words(next, 2 * nk), nb = lane_w.words(next, 2 * nk + 1);
      if (nk % GROUP_STEPS == 0) {
        sv = params(next, nk / GROUP_STEPS, 0);
        zv = params(next, nk / GROUP_STEPS, 1);
      }
      // Word rows 2k, 2k+1 of the stage (K 16k .. 16k+7, 16k+8 .. +15); instruction j takes
      // columns col + 2j (MMA row g) and col + 2j + 1 (row g + 8).
      uint32_t a[J][4];
#pragma unroll
      for (int j = 0; j < J; ++j) {
        a[j][0] = dequant<T>(wa.v[2 * j], select, aff[2 * j]);
        a[j][1] = dequant<T>(wa.v[2 * j + 1], select, aff[2 * j + 1]);
        a[j][2] = dequant<T>(wb.v[2 * j], select, aff[2 * j]);
        a[j][3] = dequant<T>(wb.v[2 * j + 1], select, aff[2 * j + 1]);
      }
      const uint64_t desc = smem_desc(sx + (k / 4) * BN * 128 + 32 * (k % 4));
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < J; ++j) Wgmma<typename Elem<T>::Kind, BN>::mma(acc[j], a[j], desc);
      wgmma_commit();
      wgmma_wait<1>();  // the previous step's group is done: its registers are free
      // ... and after this tile's first step, so is the previous tile: release its stage.
      if (k == 0 && i > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + (i + STAGES - 1) % STAGES));
      wa = na;
      wb = nb;
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < J; ++j) fence_operands(acc[j]);

  const int ch = n0 + col;
  const size_t ldo = pick(weights.ldo, which);
  T* const row_out = static_cast<T*>(pick(weights.out, which)) + (m0 + 2 * t) * ldo + (ch - col0);
  const int splits = gridDim.y;  // one cluster (hopper.cuh: RowShare)
  const RowShare share = SPLIT ? row_share(BN / 8, blockIdx.y, splits) : RowShare{0, BN / 8};
  // token rows 8 b + 2 t + {0, 1}: one 2J-wide store per row, predicated (no branch per token)
  const int row_base = 2 * t - 8 * share.lo;
  const unsigned rows = ch < N ? share.stored_rows(m0, M) : 0u;
  const auto store_rows = [&](int b) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      float v[2 * J];
      token_values(acc, b, p, v);
      store_outputs<T, J>((unsigned)(row_base + 8 * b + p) < rows, row_out + (8 * b + p) * ldo, v);
    }
  };
  if constexpr (SPLIT) {
    // every row: the share's sums run over every split's partial, this CTA's own included (split order)
    split_k_sum<true, BN>(acc, base, tid, blockIdx.y, splits, share, store_rows);
    return;
  }
#pragma unroll
  for (int b = 0; b < BN / 8; ++b) store_rows(b);
}

template <typename T, int BN, int CH, int GROUP_STEPS, bool SPLIT>
cudaError_t launch(const void* x, int count, const void* const* qweights, const void* const* scales,
                   const void* const* zeros, const int* ns, Weights& w, int M, int N,
                   int K, int group_size, int ldx, int splits, int tiles_per_split, cudaStream_t stream, bool pdl) {
  using L = Tile<BN, CH, GROUP_STEPS>;
  CUtensorMap x_map;
  const int groups = K / group_size;
  cudaError_t err = tensor_map_2d(&x_map, Elem<T>::map_type, x, K, M, (uint64_t)ldx * 2, X_BOX, BN);
  for (int i = 0; i < count && err == cudaSuccess; ++i) {
    err = weight_map(&w.w_map[i], qweights[i], ns[i], K);
    if (err == cudaSuccess)
      err = tensor_map_2d(&w.s_map[i], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, scales[i], ns[i], groups, (uint64_t)ns[i] * 2,
                          L::CH, L::SZ_ROWS, CU_TENSOR_MAP_SWIZZLE_NONE);
    if (err == cudaSuccess)
      err = tensor_map_2d(&w.z_map[i], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, zeros[i], ns[i], groups, (uint64_t)ns[i] * 2,
                          L::CH, L::SZ_ROWS, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  if (err == cudaSuccess) err = opt_in_shared_memory<w4a16_wgmma_kernel<T, BN, CH, GROUP_STEPS, SPLIT>>();
  if (err != cudaSuccess) return err;
  const int tiles = ((M + BN - 1) / BN) * ((N + L::CH - 1) / L::CH);
  return launch_cluster_kernel(w4a16_wgmma_kernel<T, BN, CH, GROUP_STEPS, SPLIT>, dim3(tiles, splits), dim3(1, splits),
                               THREADS, L::SMEM, stream, pdl, x_map, w, M, N, K, group_size, tiles_per_split);
}

template <typename T>
cudaError_t launch_t(int bn, int ch, int group_steps, const void* x, int count, const void* const* qw,
                     const void* const* s, const void* const* z, const int* ns, Weights& w, int M,
                     int N, int K, int G, int ldx, int splits, int tiles_per_split,
                     cudaStream_t st, bool pdl) {
#define NIBBLE_LAUNCH(BN_, CH_, GS_)                                                                          \
  if (bn == BN_ && ch == CH_ && group_steps == GS_)                                                           \
    return splits > 1 ? launch<T, BN_, CH_, GS_, true>(x, count, qw, s, z, ns, w, M, N, K, G, ldx, splits,     \
                                                       tiles_per_split, st, pdl)                                \
                      : launch<T, BN_, CH_, GS_, false>(x, count, qw, s, z, ns, w, M, N, K, G, ldx, splits,    \
                                                        tiles_per_split, st, pdl);
#define NIBBLE_LAUNCH_GROUPS(BN_, CH_) NIBBLE_LAUNCH(BN_, CH_, 2) NIBBLE_LAUNCH(BN_, CH_, 4) NIBBLE_LAUNCH(BN_, CH_, 8)
  NIBBLE_LAUNCH_GROUPS(64, 256)
  NIBBLE_LAUNCH_GROUPS(128, 256)
  NIBBLE_LAUNCH_GROUPS(128, 128)
  NIBBLE_LAUNCH_GROUPS(256, 128)
  NIBBLE_LAUNCH_GROUPS(64, 128)
#undef NIBBLE_LAUNCH_GROUPS
#undef NIBBLE_LAUNCH
  return cudaErrorInvalidValue;
}

}  // namespace

// Host entry point (called through ctypes). Preconditions are checked by the Python caller: compute
// capability 9.0, K % 8 == 0, group G in {32, 64} or G % 128 == 0 or G == K (one group per column),
// x 16-byte aligned with ldx % 8 == 0, (bn, channels) in {(64, 256), (128, 256), (128, 128), (256,
// 128), (64, 128)}; count (1 to MAX_WEIGHTS) weights of ns[i] columns, ns[i] % 8 == 0 and every
// ns[i] but the last a multiple of `channels` (a tile never spans two weights), each with its
// qweight, scales and zeros (16-byte aligned, contiguous) and output (ldos[i] % 4 == 0); 1 <= splits
// <= 8 (the splits of a tile are a cluster of CTAs). dtype: 0 float16, 1 bfloat16 (x and outputs).
// pdl: launch early (skinny.cuh: launch_cluster_kernel).
extern "C" int nibble_w4a16_wgmma(int dtype, int bn, int channels, const void* x, int count,
                                  const void* const* qweights, const void* const* scales, const void* const* zeros,
                                  void* const* outs, const int* ns, const int* ldos, int M, int K,
                                  int group_size, int ldx, int splits, int tiles_per_split, int pdl, void* stream) {
  if (count < 1 || count > MAX_WEIGHTS) return (int)cudaErrorInvalidValue;
  Weights w{};
  const int N = running_ends(count, ns, 1, w.col_end);
  for (int i = 0; i < count; ++i) {
    w.out[i] = outs[i];
    w.ldo[i] = ldos[i];
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int group_steps = group_size == 32 ? 2 : group_size == 64 ? 4 : 8;
  cudaError_t err;
  switch (dtype) {
    case 0: err = launch_t<__half>(bn, channels, group_steps, x, count, qweights, scales, zeros, ns, w, M, N, K, group_size, ldx, splits, tiles_per_split, st, pdl); break;
    case 1: err = launch_t<__nv_bfloat16>(bn, channels, group_steps, x, count, qweights, scales, zeros, ns, w, M, N, K, group_size, ldx, splits, tiles_per_split, st, pdl); break;
    default: err = cudaErrorInvalidValue;
  }
  return (int)err;
}

// How many clusters of `splits` CTAs (1: single CTAs) of the GEMM fit on the current device at once
// (hopper.cuh: resident_clusters; every tile takes a whole SM), for the config model.
extern "C" int nibble_w4a16_wgmma_clusters(int splits, int* clusters) {
  constexpr auto kernel = w4a16_wgmma_kernel<__nv_bfloat16, 128, 256, 8, true>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err == cudaSuccess) err = resident_clusters<kernel>(splits, THREADS, Tile<128, 256, 8>::SMEM, *clusters);
  return (int)err;
}

extern "C" const char* nibble_w4a16_wgmma_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
