// W4A4 GEMM for many tokens (prefill, batches) on Hopper's asynchronous INT8 tensor cores
// (wgmma, sm_90a), exact in int32:
//
//   acc[m, n] = sum_k qx[m, k] * (q[k, n] - 8),   y[m, n] = acc * (x_scale[m] * w_scale[n]) (+ bias[n])
//
// Why a CUDA kernel: Triton keeps an int8 wgmma synchronous (int32 accumulators), so its unpacking
// and its MMAs serialize. Here the MMAs run asynchronously while the warps unpack the next weights.
//
// Roles. The weight is wgmma's A operand, taken from registers: 64 output channels x 32 K per
// instruction, so a warpgroup unpacks its own INT4 weights straight into the fragments (no int8
// copy of the weight in shared memory). The activations are B (tokens = wgmma's N), read by the
// tensor cores from shared memory through a descriptor. A CTA is two warpgroups x CH / 2 channels
// (J = CH / 128 m64 instructions each) x BN tokens (the Tile shapes below); each warp owns 16 J
// channels.
//
// Weight fragments. lane (g, t) of a warp reads, per 32-deep K step s, the words of its 2J columns
// c .. (one 16- or 8-byte piece) in word row 4 s + t (K rows 32 s + 8 t .. + 7). MMA rows g / g+8
// of instruction j are columns c + 2 j / c + 2 j + 1; a0/a1 (K slots 4t .. 4t+3) take the even K
// rows of those two columns, a2/a3 (K slots 16+4t ..) the odd rows. Nibble arithmetic, 3
// instructions per word: v = w ^ 0x88888888 turns code q into the 4-bit two's complement of q - 8;
// v & 0xF0F0F0F0 leaves the odd nibbles in the high half of each byte, i.e. the signed bytes
// 16 (q - 8); (v << 4) & 0xF0F0F0F0 does the same for the even nibbles. The products are 16x the
// true ones, exact (|16 (q - 8) x| <= 1024, so K up to 2^21 fits int32); the epilogue shifts by 4.
//
// Activation order. The K slots of a step hold K rows 32 s + 2 p (slot p < 16) and 32 s + 2 (p - 16)
// + 1 (slot p >= 16): even rows first, then odd. So qx must arrive in that "even-odd" order, each
// 32-column block as its 16 even columns then its 16 odd ones: the activation quantization writes
// it so (w4a4.py, order="even_odd") at no cost; the tensor cores then read plain rows.
//
// Shared memory, per stage: x as BN rows of 128 bytes (128 K), then the weight as CH / 32 boxes of
// 16 word rows x 32 columns (128 bytes). Both arrive by TMA in its 128-byte swizzle (16-byte chunk c of row r
// at chunk c ^ (r % 8), every box 1024-byte aligned), which is what wgmma's descriptor expects for
// x (a K step is the descriptor's start moved by 32 bytes); the weight pieces read by the 8 lanes of
// a phase then fall in 4 bank groups (a 2-way conflict on 4 loads per 128-deep tile: negligible).
// TMA zero-fills past M, K and N, so tails need no code (zero x times any weight adds nothing).
//
// Pipeline: a third warpgroup only issues the TMA copies (one thread), STAGES tiles ahead, each stage
// guarded by a "full" mbarrier (TMA bytes landed) and an "empty" one (both warpgroups released it).
// The consumers never meet at a CTA barrier: per 32-deep step they load and unpack their weight
// quads, issue two wgmmas, commit, and wait until only this step's group is in flight; after the
// first step of a tile, the previous tile's wgmmas are complete, so its stage is released.
// (The first version copied with cp.async from all threads and met at __syncthreads per tile, with
// a proxy fence before the tensor cores could read: 1000 TOPS at best, its MMAs and copies barely
// overlapping; benchmarks/notes-w4a4.md has the measurements.)
//
// Epilogue: lane (g, t) holds channels c .. c+2J-1 of tokens 8 b + 2 t + {0, 1}: one 2J-wide store
// per token. Split-K (few tiles for the SMs): the splits of a tile are one cluster; each adds the
// others' int32 partials of its share of the tile's rows to its own (exact, order-free), read from
// their shared memory, and scales them (hopper.cuh: RowShare).
//
// Persistent: one CTA per SM walks a list of tiles, the ring running on from one to the next (see
// the kernel). Not with split-K: there a CTA's ring holds its partials after the mainloop, so each
// CTA computes one (tile, split) item and the grid has them all.
//
// Several weights that read the same x (a block's q/k/v or gate/up projections, up to MAX_WEIGHTS)
// run as one GEMM over their output columns side by side (hopper.cuh: column_weight), each tile
// reading its weight's tensor map and writing its weight's output. At prefill sizes the separate
// products leave SMs idle: Llama-2-7B's q, k and v at 128 tokens are 3 x 32 tiles of 128 x 128, one
// wave each, where the group's 96 tiles are one wave in all.
//
// GATED: the MLP's gate and up weights (N columns each) as one GEMM whose epilogue writes
// SiLU(gate) * up, N columns, instead of the 2N columns of the two products. A tile of CH "gated"
// columns copies CH / 2 columns of each weight (gate's boxes, then up's: two tensor maps), and each
// lane's MMA rows pair a gate column with the same up column (hopper.cuh: LaneWeights), so the
// epilogue multiplies in registers. The 2N-wide output and the glue kernel that read it back go
// (at 512 tokens of Llama-2-7B, 34 MB of traffic a layer), but the epilogue, time the tensor cores
// wait, grows by about as much (benchmarks/results/gated-gemm-h200.json), so the engine uses it
// from 512 tokens (w4a4.py: GATED_MIN_TOKENS). The SiLU is the engine's glue kernel's to the bit
// (its PTX: ex2.approx, div.full), so fused and unfused prefills give the same tokens.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "hopper.cuh"
#include "skinny.cuh"
#include "w4a4_epilogue.cuh"

namespace {

constexpr int THREADS = CONSUMER_THREADS + 128;  // registers are granted per warpgroup

// The CTA: BN tokens x CH channels, CH / 128 = J m64 x BN x k32 instructions per warpgroup and step
// (a lane owns 2J consecutive columns). 256 channels share each x tile between more weights; 128
// make twice the CTAs where the output has few tiles; 64 x 128 twice again, at nearly the time per
// stage of 128 x 128 (the stage's latency, not its MMAs, sets it): up to 64 tokens, and the 4096 x
// 4096 o_proj at 128 (H200, session 20: benchmarks/results/w4a4-explore-64x128-h200.json, 12288 x
// 4096 at 64 tokens 16.0 -> 13.2 us, 4096 x 4096 at 128 13.5 -> 10.7). Four stages each, as
// measured (H200, session 15: benchmarks/results/w4a4-stages-h200.json): 3, 5 or 6 for 128 x 256
// ran 2-13% slower, 6 or 8 for 128 x 128 1.5-4% slower than 4.
template <int BN, int CH_> struct Tile {
  static constexpr int CH = CH_, J = CH / 128;
  static constexpr int X_BYTES = BN * BK, W_BYTES = CH / 32 * W_BOX, STAGE = X_BYTES + W_BYTES;
  static constexpr int STAGES = 4;
  static_assert(partial_bytes<BN, J>() <= STAGES * STAGE, "split-K's partials go through the ring");
  // + alignment slack, 2 mbarriers per stage, the token scales of each consumer warpgroup
  static constexpr size_t SMEM = (size_t)STAGES * STAGE + 1024 + 16 * STAGES + 2 * 4 * BN;
};

// A load issued where it is written (asm volatile keeps its place among the MMAs' asm; ptxas
// would otherwise sink a plain load next to its first use, the epilogue).
__device__ __forceinline__ float load_early(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t even_nibbles(uint32_t w) { return ((w << 4) ^ 0x80808080u) & 0xF0F0F0F0u; }
__device__ __forceinline__ uint32_t odd_nibbles(uint32_t w) { return (w ^ 0x80808080u) & 0xF0F0F0F0u; }

// The weights of one launch: weight i owns the launch's columns [col_end[i - 1], col_end[i]).
struct Weights {
  CUtensorMap map[MAX_WEIGHTS];
  const void* w_scale[MAX_WEIGHTS];
  const void* bias[MAX_WEIGHTS];
  void* out[MAX_WEIGHTS];
  int ldo[MAX_WEIGHTS], col_end[MAX_WEIGHTS];
};

// The GATED epilogue: SiLU(gate) * up as the engine computes it from the two products, to the bit.
// The products round to T (saturate_pack2, as the plain epilogue stores them), then the engine's
// glue kernel (nibble/eval/engine.py: _silu_mul_kernel) takes over: its instructions (Triton's
// exp and division: ex2.approx of -g log2(e), div.full), SiLU rounded to T, times up, rounded once.
// Counted in instructions, because the epilogue is time the tensor cores wait: a plain
// transcription (34 PTX instructions an output: saturation by compares, one conversion per value)
// made Llama-2-7B's 512-token prefill 0.25 ms slower than the unfused path; this one (~20: paired
// conversions, one multiply for -g log2(e), ex2 flushing to zero) breaks even there (H200).
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

// The J outputs of one token from its J gate / up accumulator pairs v[2i] / v[2i + 1] (stored where live).
template <typename T, int J>
__device__ __forceinline__ void store_silu_mul(bool live, T* dst, const int (&v)[2 * J], float x_scale,
                                               const float (&ws)[2 * J], bool has_bias, const float (&bs)[2 * J]) {
  float y[J];
#pragma unroll
  for (int i = 0; i < J; ++i) {
    const uint32_t gu = saturate_pack2<T>(scale_output(v[2 * i] >> 4, x_scale, ws[2 * i], has_bias, bs[2 * i]),
                                          scale_output(v[2 * i + 1] >> 4, x_scale, ws[2 * i + 1], has_bias, bs[2 * i + 1]));
    y[i] = __fmul_rn(silu_rounded<T>(low_half<T>(gu)), high_half<T>(gu));
  }
  if constexpr (J == 2) {
    store_if<1>(live, dst, {pack2<T>(y[0], y[1])});
  } else if (live) {
    *reinterpret_cast<unsigned short*>(dst) = static_cast<unsigned short>(pack2<T>(y[0], y[0]));
  }
}

// SPLIT: split-K in clusters (splits > 1). A kernel of its own, so that the unsplit one carries none
// of its code: compiled in, even unused, it made the unsplit products 1-5% slower (H200).
template <typename T, int BN, int CH_, bool GATED, bool SPLIT>
__global__ void __launch_bounds__(THREADS, 1)
    w4a4_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ Weights weights,
                      const float* __restrict__ x_scale, int w_scale_dtype, int bias_dtype, int M, int N, int K,
                      int tiles_per_split, int splits) {
  using L = Tile<BN, CH_>;
  constexpr int J = L::J, CH = L::CH, STAGES = L::STAGES, STAGE = L::STAGE, X_STAGE = L::X_BYTES, R = BN / 2;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const unsigned char* smem = smem_raw + (base - raw);
  const uint32_t bars = base + STAGES * STAGE;  // full[STAGES], then empty[STAGES]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // Persistent CTAs: work item w = (output tile w / splits, split w % splits), CTA b takes items b,
  // b + gridDim.x, ...; its K tiles are numbered on across items, so the producer fills the ring
  // with the next item's first stages while the consumers finish the previous one (its last MMAs,
  // its epilogue). One wave of CTAs instead of one per item: the pipeline fills once. With split-K
  // the grid has every item (the ring holds the partials after the mainloop, so nothing may refill
  // it), in clusters of `splits` CTAs: a CTA's split is its rank in its cluster.
  const int tiles = ((M + BN - 1) / BN) * ((N + CH - 1) / CH), items = tiles * splits;

  if (tid == 0) init_stage_barriers<STAGES>(bars);
  __syncthreads();

  if (warp >= CONSUMER_THREADS / 32) {  // the producer warpgroup: one thread issues, the rest idle
    // 128 x 40 + 256 x 232 registers fit the 64K: the consumers keep two wgmma groups in flight.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == CONSUMER_THREADS)
      for (int w = blockIdx.x, first = 0; w < items; w += gridDim.x) {
        const CtaWork work = cta_work(M, N, K, BN, CH, tiles_per_split, SPLIT ? w / splits : w, SPLIT ? w % splits : 0);
        int col0;
        const int which = column_weight(weights.col_end, work.n0, col0);
        const CUtensorMap* w_map = pick_address(weights.map, which);
        produce<STAGES>(
            bars, base, STAGE, STAGE, work.k_begin, work.k_tiles, first,
            [&](uint32_t dst, int k0, uint32_t full) {
              if constexpr (GATED) {  // the tile's columns of gate, then the same columns of up
                load_weight_boxes<CH / 2>(dst + X_STAGE, &weights.map[0], work.n0 / 2, k0, full);
                load_weight_boxes<CH / 2>(dst + X_STAGE + CH / 64 * W_BOX, &weights.map[1], work.n0 / 2, k0, full);
              } else {
                load_weight_boxes<CH>(dst + X_STAGE, w_map, work.n0 - col0, k0, full);
              }
            },
            [&](uint32_t dst, int k0, uint32_t full) { tma_load(dst, &x_map, k0, work.m0, full); });
        first += work.k_tiles;
      }
    return;  // exited threads count as arrived at the consumers' cluster barriers
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  wait_for_prior_grids();  // x_scale, like x, is the previous kernel's output
  // The epilogue's per-token scales: each warpgroup stages its item's in shared memory (loaded in
  // the epilogue itself, each thread's 32 dependent loads cost ~6 us per tile, measured); the
  // global load is issued as the item starts, so the MMAs hide its latency.
  const int wg = warp >> 2, wg_tid = tid & 127;
  float* token_scale = reinterpret_cast<float*>(smem_raw + (base - raw) + STAGES * STAGE + 16 * STAGES) + wg * BN;
  const LaneWeights<J, GATED> lane_w(warp, g, X_STAGE, CH / 64 * W_BOX);  // word rows 4 step + t of each stage
  int acc[J][R];

  for (int w = blockIdx.x, first = 0; w < items; w += gridDim.x) {
    const int tile = SPLIT ? w / splits : w, split = SPLIT ? w % splits : 0;
    const CtaWork work = cta_work(M, N, K, BN, CH, tiles_per_split, tile, split);
    const int m0 = work.m0, n0 = work.n0, k_tiles = work.k_tiles;
    const float my_scale = load_early(x_scale + min(m0 + wg_tid, M - 1));  // tokens past M are never read
    // The lane's channel scales and bias are loaded here too, as raw bits, for the same reason:
    // loaded in the epilogue, their DRAM round trip was the bulk of its ~2.2 us per item.
    const int ch = n0 + lane_w.col;
    int col0;
    const int which = column_weight(weights.col_end, n0, col0);
    const int wch = GATED ? ch / 2 : ch - col0;  // the lane's first column in its weight (GATED: in gate and up)
    const void* w_scale = pick(weights.w_scale, which);
    const void* bias = pick(weights.bias, which);
    uint32_t ws_bits[2 * J], bias_bits[2 * J];  // GATED: of gate, up, gate, up ...
#pragma unroll
    for (int i = 0; i < 2 * J; ++i) {
      const void* w_scale_i = GATED ? weights.w_scale[i % 2] : w_scale;
      const void* bias_i = GATED ? weights.bias[i % 2] : bias;
      const int col = GATED ? wch + i / 2 : wch + i;
      ws_bits[i] = ch < N ? load_bits_early(w_scale_i, w_scale_dtype, col) : 0u;
      bias_bits[i] = ch < N && bias_i != nullptr ? load_bits_early(bias_i, bias_dtype, col) : 0u;
    }
    zero_accumulators(acc);
    // With two m64 instructions a step (J = 2: 128 x 256 and 64 x 256 tiles) the weight words are
    // read from shared memory one step ahead, while the step before runs on the tensor cores; read
    // at their use, the load's latency sat between every two steps' MMAs (2-8% of the product's
    // time, H200). With one instruction a step (128 x 128) reading ahead measured 2-5% slower, so
    // those read at use (benchmarks/results/w4a4-load-ahead-ab-h200.json).
    constexpr bool AHEAD = J > 1;
    Vec<uint32_t, 2 * J> wv;
    if (AHEAD) {
      mbar_wait(bars + 8 * (first % STAGES), (first / STAGES) & 1);
      wv = lane_w.words(smem + (first % STAGES) * STAGE, t);
    }
    for (int i = 0; i < k_tiles; ++i) {
      const int s = (first + i) % STAGES;
      if (!AHEAD) mbar_wait(bars + 8 * s, ((first + i) / STAGES) & 1);
      const uint32_t sx = base + s * STAGE;
      const unsigned char* here = smem + s * STAGE;
#pragma unroll
      for (int k = 0; k < BK / 32; ++k) {
        if (!AHEAD) wv = lane_w.words(here, 4 * k + t);
        const uint64_t desc = smem_desc(sx + 32 * k);
        uint32_t a[J][4];
#pragma unroll
        for (int j = 0; j < J; ++j) {
          a[j][0] = even_nibbles(wv.v[2 * j]);
          a[j][1] = even_nibbles(wv.v[2 * j + 1]);
          a[j][2] = odd_nibbles(wv.v[2 * j]);
          a[j][3] = odd_nibbles(wv.v[2 * j + 1]);
        }
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < J; ++j) Wgmma<S8, BN>::mma(acc[j], a[j], desc);
        wgmma_commit();
        if (AHEAD) {  // the next step's words: this stage's, or the next tile's first once it has landed
          const unsigned char* next = here;  // (past the item's last tile: read, never used)
          int next_k = k + 1;
          if (k == BK / 32 - 1) {
            const int n = first + i + 1;
            if (i + 1 < k_tiles) mbar_wait(bars + 8 * (n % STAGES), (n / STAGES) & 1);
            next = smem + (n % STAGES) * STAGE;
            next_k = 0;
          }
          wv = lane_w.words(next, 4 * next_k + t);
        }
        wgmma_wait<1>();  // the previous step's group is done: its registers are free
        // ... and after this tile's first step, so is the previous tile: release its stage.
        if (k == 0 && i > 0 && wg_tid == 0) mbar_arrive(bars + 8 * (STAGES + (first + i - 1) % STAGES));
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < J; ++j) fence_operands(acc[j]);
    // The item's last stage, released now: the producer refills it during the epilogue.
    if (wg_tid == 0) mbar_arrive(bars + 8 * (STAGES + (first + k_tiles - 1) % STAGES));
    first += k_tiles;

    // the token rows this CTA finishes
    const RowShare share = SPLIT ? row_share(BN / 8, split, splits) : RowShare{0, BN / 8};
    if constexpr (SPLIT) {
      split_k_sum<false, BN>(acc, base, tid, split, splits, share, [](int) {});
    }

    // The warpgroup's readers of the previous item's scales are done (they reached this barrier).
    asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
    if (wg_tid < BN) token_scale[wg_tid] = my_scale;
    asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
    if (ch >= N) continue;
    float ws[2 * J], bs[2 * J];  // scale_output's order: bias added last
#pragma unroll
    for (int i = 0; i < 2 * J; ++i) {
      ws[i] = float_of_bits(ws_bits[i], w_scale_dtype);
      bs[i] = float_of_bits(bias_bits[i], bias_dtype);
    }
    // The lane's outputs of token 8 b + 2 t + p sit at row_out + (8 b + p) ldo. The loop has no
    // branch: tokens past M are computed and their stores predicated off. The epilogue is time the
    // tensor cores wait, and its code is fetched cold at every launch in a model (other kernels ran
    // in between): a branch per token (the bounds test, with its reconvergence) took the bf16 128 x
    // 256 tile's epilogue to 39 SASS instructions a token; four copies of the loop specialised for
    // bias and tail took it to 21 and ran faster back to back, but 15% slower for gate/up inside a
    // Llama-2-7B prefill. One branch-free copy, ~25 a token, is the fastest there (H200, session 15).
    const bool has_bias = bias != nullptr;
    const size_t ldo = pick(weights.ldo, which);
    T* const row_out = static_cast<T*>(pick(weights.out, which)) + (m0 + 2 * t) * ldo + wch;
    const float* tile_scale = token_scale + 2 * t;
    const int row_base = 2 * t - 8 * share.lo;  // token row 8 b + 2 t + p, relative to the share
    const unsigned rows = share.stored_rows(m0, M);
#pragma unroll
    for (int b = 0; b < BN / 8; ++b) {
      const float2 xs = *reinterpret_cast<const float2*>(tile_scale + 8 * b);  // tokens 8 b + 2 t + {0, 1}
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const bool live = (unsigned)(row_base + 8 * b + p) < rows;
        int v[2 * J];
        token_values(acc, b, p, v);
        T* dst = row_out + (8 * b + p) * ldo;
        [[maybe_unused]] const float x_scale = p ? xs.y : xs.x;
        if constexpr (GATED) {
          store_silu_mul<T, J>(live, dst, v, x_scale, ws, has_bias, bs);
        } else if constexpr (std::is_same_v<T, int>) {
          Vec<int, 2 * J> o;
#pragma unroll
          for (int i = 0; i < 2 * J; ++i) o.v[i] = v[i] >> 4;  // the 16x of the weight bytes shifted out (exact)
          if (live) *reinterpret_cast<Vec<int, 2 * J>*>(dst) = o;
        } else {
          float y[2 * J];
#pragma unroll
          for (int i = 0; i < 2 * J; ++i) y[i] = scale_output(v[i] >> 4, x_scale, ws[i], has_bias, bs[i]);
          if constexpr (std::is_same_v<T, float>) {
            Vec<float, 2 * J> o;
#pragma unroll
            for (int i = 0; i < 2 * J; ++i) o.v[i] = saturate_cast<float>(y[i]);
            if (live) *reinterpret_cast<Vec<float, 2 * J>*>(dst) = o;
          } else {
            Vec<uint32_t, J> o;
#pragma unroll
            for (int i = 0; i < J; ++i) o.v[i] = saturate_pack2<T>(y[2 * i], y[2 * i + 1]);
            store_if(live, dst, o);
          }
        }
      }
    }
  }
}

template <typename T, int BN, int CH, bool GATED, bool SPLIT>
cudaError_t launch(const void* qx, const float* xs, const Weights& weights, int ws_dtype, int bias_dtype, int M,
                   int N, int K, int ldx, int splits, int tiles_per_split, cudaStream_t stream, bool pdl) {
  constexpr auto kernel = w4a4_wgmma_kernel<T, BN, CH, GATED, SPLIT>;
  constexpr size_t smem = Tile<BN, CH>::SMEM;
  CUtensorMap x_map;
  cudaError_t err = tensor_map_2d(&x_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, qx, K, M, ldx, BK, BN);
  if (err == cudaSuccess) err = opt_in_shared_memory<kernel>();
  int ctas = ((M + BN - 1) / BN) * ((N + CH - 1) / CH);  // one per tile, and with split-K per item
  if (SPLIT) {
    ctas *= splits;
  } else {  // persistent: at most one CTA per SM
    int sms = 0;
    if (err == cudaSuccess) err = resident_clusters<kernel>(1, THREADS, smem, sms);
    if (ctas > sms) ctas = sms;
  }
  if (err != cudaSuccess) return err;
  return launch_cluster_kernel(kernel, dim3(ctas), dim3(splits), THREADS, smem, stream, pdl, x_map, weights, xs,
                               ws_dtype, bias_dtype, M, N, K, tiles_per_split, splits);
}

template <typename T, bool GATED = false>
cudaError_t launch_t(int bn, int ch, const void* qx, const float* xs, const Weights& weights, int ws_dtype,
                     int bias_dtype, int M, int N, int K, int ldx, int splits, int tiles_per_split,
                     cudaStream_t st, bool pdl) {
#define NIBBLE_LAUNCH(BN_, CH_)                                                                                   \
  if (bn == BN_ && ch == CH_)                                                                                     \
    return splits > 1 ? launch<T, BN_, CH_, GATED, true>(qx, xs, weights, ws_dtype, bias_dtype, M, N, K, ldx,   \
                                                          splits, tiles_per_split, st, pdl)                          \
                      : launch<T, BN_, CH_, GATED, false>(qx, xs, weights, ws_dtype, bias_dtype, M, N, K, ldx,  \
                                                          splits, tiles_per_split, st, pdl);
  NIBBLE_LAUNCH(64, 256)
  NIBBLE_LAUNCH(128, 256)
  NIBBLE_LAUNCH(128, 128)
  NIBBLE_LAUNCH(64, 128)
#undef NIBBLE_LAUNCH
  return cudaErrorInvalidValue;
}

}  // namespace

// Host entry point (called through ctypes). Preconditions are checked by the Python caller: compute
// capability 9.0, K % 32 == 0, qx in even-odd order with 16-byte aligned rows (ldx % 16 == 0), (bn,
// channels) in {(64, 256), (128, 256), (128, 128), (64, 128)}; count (1 to MAX_WEIGHTS) weights of
// ns[i] columns, ns[i] % 4 == 0 and every ns[i] but the last a multiple of `channels` (a tile never
// spans two weights), each with its qweight, w_scale, bias (may be null) and output (ldos[i] % 4 ==
// 0); 1 <= splits <= 8 (the splits of a tile are a cluster of CTAs). out_dtype: 0
// float32, 1 float16, 2 bfloat16, 3 int32 (raw accumulators); w_scale_dtype / bias_dtype: 0
// float32, 1 float16, 2 bfloat16. pdl: launch early (skinny.cuh: launch_cluster_kernel).
// gated: SiLU(gate) * up into outs[0] (ldos[0]) of ns[0] columns, from count = 2 weights (gate, up)
// of ns[0] == ns[1] columns, both or neither with a bias; out_dtype 1 or 2. The launch then has 2 ns[0]
// "gated" columns.
extern "C" int nibble_w4a4_wgmma(int out_dtype, int bn, int channels, const void* qx, const void* x_scale,
                                 int w_scale_dtype, int bias_dtype, int M, int K, int ldx, int count,
                                 const void* const* qweights, const void* const* w_scales, const void* const* biases,
                                 void* const* outs, const int* ns, const int* ldos, int splits, int tiles_per_split,
                                 int gated, int pdl, void* stream) {
  if (count < 1 || count > MAX_WEIGHTS) return (int)cudaErrorInvalidValue;
  if (gated && (count != 2 || ns[0] != ns[1] || (out_dtype != 1 && out_dtype != 2))) return (int)cudaErrorInvalidValue;
  Weights w{};
  const int gated_columns = 2 * ns[0];
  const int N = gated ? running_ends(1, &gated_columns, 1, w.col_end) : running_ends(count, ns, 1, w.col_end);
  for (int i = 0; i < count; ++i) {
    const cudaError_t err = weight_map(&w.map[i], qweights[i], ns[i], K);
    if (err != cudaSuccess) return (int)err;
    w.w_scale[i] = w_scales[i];
    w.bias[i] = biases[i];
    w.out[i] = outs[i];
    w.ldo[i] = ldos[i];
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const float* xs = static_cast<const float*>(x_scale);
  cudaError_t err;
#define NIBBLE_ARGS bn, channels, qx, xs, w, w_scale_dtype, bias_dtype, M, N, K, ldx, splits, tiles_per_split, st, pdl
  if (gated)
    err = out_dtype == 1 ? launch_t<__half, true>(NIBBLE_ARGS) : launch_t<__nv_bfloat16, true>(NIBBLE_ARGS);
  else switch (out_dtype) {
    case 0: err = launch_t<float>(NIBBLE_ARGS); break;
    case 1: err = launch_t<__half>(NIBBLE_ARGS); break;
    case 2: err = launch_t<__nv_bfloat16>(NIBBLE_ARGS); break;
    case 3: err = launch_t<int>(NIBBLE_ARGS); break;
    default: err = cudaErrorInvalidValue;
  }
#undef NIBBLE_ARGS
  return (int)err;
}

// How many clusters of `splits` CTAs (1: single CTAs) of the GEMM fit on the current device at once
// (hopper.cuh: resident_clusters; every tile takes a whole SM), for the config model.
extern "C" int nibble_w4a4_wgmma_clusters(int splits, int* clusters) {
  constexpr auto kernel = w4a4_wgmma_kernel<__nv_bfloat16, 128, 256, false, true>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err == cudaSuccess) err = resident_clusters<kernel>(splits, THREADS, Tile<128, 256>::SMEM, *clusters);
  return (int)err;
}

extern "C" const char* nibble_w4a4_wgmma_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
