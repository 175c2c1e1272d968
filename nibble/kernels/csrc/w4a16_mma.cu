// W4A16 skinny GEMM for M <= 64 (decode and small batches) on nibble's canonical INT4 layout.
//
//   y[m, n] = sum_k x[m, k] * (q[k, n] * s[k / G, n] + z[k / G, n])
//   qweight int32 [K / 8, N]: word (i, n) holds K rows 8i .. 8i+7 of column n, nibble j = row 8i + j.
//
// No re-layout of the stored weight: the fragment mapping below is chosen so the canonical words
// can be fed to the tensor cores as they are. The weight is the A operand of mma.m16n8k16 and x^T
// the B operand: 16 output columns per MMA, so at M = 1 one MMA consumes 256 weights and the tensor
// pipe stays well below the memory rate (with x as A, 15/16 of every MMA would be padding).
//
// Fragment layout (g = lane / 4, t = lane % 4). Per 32-deep K step a warp consumes 4 word rows x
//   32 columns = 512 bytes; lane (g, t) consumes the 16 bytes of columns c .. c+3 (c = tile_col + 4g)
//   at word row 4*step + t. Those four columns become the MMA rows g / g+8 of two m16 tiles: tile 0
//   rows (g, g+8) = columns (c, c+1), tile 1 = (c+2, c+3). The C fragment rows of a lane are then
//   exactly its own four columns, so the lane applies its own group scales to its own accumulators.
// The lane that copies a 16-byte piece is not the lane that consumes it: lane L copies row L / 8,
//   columns 4 (L % 8) .. +3, so each 8-lane phase of the copy is one whole 128-byte line. (Copying
//   with the consumer's mapping makes every phase touch 4 lines, one sector each: the L2 then serves
//   4 requests per line, hits 3 of them, and the kernel stalls on L2 throughput at ~45% of HBM
//   bandwidth -- measured with Nsight Compute on the H200, L2 hit rate 68% on data read once.)
//   In shared memory row r of the stage sits at 128 r and column quad q at 16 ((q ^ 2r) & 7): both
//   the copy (one row, 8 quads) and the read-back (quads g = 2p, 2p+1 of 4 rows) hit 8 distinct
//   16-byte bank groups per phase.
// The MMA's K order is free as long as A and B agree. One lop3 extracts nibbles (j, j+4) of a word
// into one register, so for lane t the MMA K slots are
//   half-step 0: a0/b0 = rows (8w+0, 8w+4), a2/b1 = (8w+1, 8w+5); half-step 1: (8w+2, 8w+6), (8w+3, 8w+7)
// with w the lane's word row; the lane's 16-byte x load (x[m, 8w .. 8w+7]) is permuted to the same
// pairs with one byte-permute per register. Every K row is covered exactly once.
//
// Dequant without conversions, factored out of the inner loop: a nibble OR-ed into the mantissa of
// B = 1024 (fp16 0x6400) or B = 128 (bf16 0x4300), where the ulp is 1, is the exact float B + q.
// Those raw codes go through the MMA as they are (3 shifts + 4 lop3 per 8 weights, nothing else),
// summed per group in fp32 as R = sum (B + q) x; one extra MMA with an all-ones A gives X = sum x.
// At the end of each group, in fp32:  sum (q s + z) x = s R + (z - B s) X.
// fp16's 10-bit mantissa also holds a nibble at bits 4-7: over B = 64 (0x5400, ulp 1/16 at bit 0)
// it reads as 64 + q, over 1024 (0x6400) a nibble at bits 0-3 as 1024 + q. So the pairs (j, j+4) of
// even j (bits 0-3 / 16-19, B = 1024) and odd j (bits 4-7 / 20-23, B = 64) need one shift a word,
// not three (Marlin's trick; at one and two token tiles, `two_bases`): 1 shift + 4 lop3 per 8 weights.
// The x-sum MMA then carries two rows: its A holds B in rows 0-7 (1024 in the K slots of even j, 64
// in those of odd j) and 1 in rows 8-15, giving W = sum B x and X = sum x at once, and
// sum (q s + z) x = s (R - W) + z X.
// (Doing q * s + z in 16 bits per weight costs 8 more instructions per word, and folding B into
// z in 16 bits would cancel catastrophically; in fp32 the cancellation costs ~2^-14 relative.)
// At four token tiles, where two sets of accumulators do not fit the registers, R runs on in the
// output accumulators themselves, rescaled at each group's end (RunningFold).
//
// Weights go HBM -> shared memory with cp.async (16 bytes per lane, bypassing L1) through a
// per-warp ring of 4 stages, 2 steps in flight, without holding registers. (Plain loads into a
// register batch do not work: ptxas sinks each load next to its first use to save registers,
// leaving one load per warp in flight.) Lanes read back pieces other lanes copied, so each step
// starts with cp.async.wait_group (this thread's copies) and a warp barrier (everyone's).
//
// The kernel is bound by instruction issue long before the tensor cores matter, so the loop is
// built to issue few: unrolled over the ring (shared-memory addresses are immediates), group
// boundaries at compile-time positions for groups of 32-128 (no per-step group tests, the first
// MMA of a group starts from zero instead of zeroing the sums), predicates only in the last
// rounds. Per 512 bytes of weight: 16 lop3 + 12 shifts (fp16: 4) + 4 byte-permutes + 6 MMA + ~26 other,
// ~64 instructions (from ~114 with per-step bookkeeping: 46.6 -> 34.5 us on 28672 x 8192, H200).
//
// K is split across the warps of a CTA (each owns a contiguous range of whole groups); partial
// sums meet in shared memory and the CTA writes its 32 output columns. N / 32 CTAs; the launcher
// picks warps per CTA so that enough loads are in flight on every SM.
// One launch can serve up to three weights that read the same x, each with its own qweight, scales,
// zeros and output (skinny.cuh: MAX_WEIGHTS).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "skinny.cuh"

namespace {

// Per activation type: the raw-code base B (twice, as the lop3 OR constant, and as a float), with
// ONE_SHIFT the base of nibbles at bits 4-7 (twice), 1.0 twice, and the output conversion.
template <typename T> struct Num;

template <> struct Num<__half> {
  static constexpr bool ONE_SHIFT = true;
  static constexpr uint32_t BASE2 = 0x64006400u;      // 1024, 1024: nibbles at bits 0-3 / 16-19
  static constexpr uint32_t BASE2_ODD = 0x54005400u;  // 64, 64: nibbles at bits 4-7 / 20-23
  static constexpr uint32_t ONE2 = 0x3c003c00u;
  static constexpr float BASE = 1024.f;
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <> struct Num<__nv_bfloat16> {
  static constexpr bool ONE_SHIFT = false;
  static constexpr uint32_t BASE2 = 0x43004300u;  // 128, 128
  static constexpr uint32_t ONE2 = 0x3f803f80u;
  static constexpr float BASE = 128.f;
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// The weights of one launch (skinny.cuh: cta_weight)
template <typename T>
struct Weights {
  const uint32_t* qweight[MAX_WEIGHTS];
  const __half* scales[MAX_WEIGHTS];
  const __half* zeros[MAX_WEIGHTS];
  T* out[MAX_WEIGHTS];
  int n[MAX_WEIGHTS], ldo[MAX_WEIGHTS], cta_end[MAX_WEIGHTS];
};

// Where the kernel reads fp16 codes with one shift a word (TWO_BASES): at one and two token tiles.
// H200, fp16, against a shift per pair (benchmarks/notes-w4a16.md, session 37): M = 1 1-8% faster
// (geomean of the >= 64 MB shapes 2.94x -> 3.04x cuBLAS fp16), M = 8 1-7%, M = 16 0-3%; at four tiles
// (RunningFold) 1-3% slower, eight not measured.
template <typename T>
__host__ __device__ constexpr bool two_bases(int mt) {
  return Num<T>::ONE_SHIFT && mt <= 2;
}

// word -> raw code pairs (B_j + q_j, B_j + q_{j+4}), j = 0..3. (TWO_BASES defaults to one base here
// and below for benchmarks/scripts/w4a16_spread.cu and w4a16_tma_stream.cu, which reuse these helpers.)
template <typename T, bool TWO_BASES = false>
__device__ __forceinline__ void raw_codes(uint32_t w, uint32_t (&r)[4]) {
  if constexpr (TWO_BASES) {
    const uint32_t w8 = w >> 8;
    r[0] = and_or(w, 0x000f000fu, Num<T>::BASE2);
    r[1] = and_or(w, 0x00f000f0u, Num<T>::BASE2_ODD);
    r[2] = and_or(w8, 0x000f000fu, Num<T>::BASE2);
    r[3] = and_or(w8, 0x00f000f0u, Num<T>::BASE2_ODD);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = and_or(w >> (4 * j), 0x000f000fu, Num<T>::BASE2);
  }
}

// One 32-deep step's MMAs for one token tile: A = the raw codes r ([column c + j][nibble pair]),
// B = the lane's 16 bytes of x (x[m, 8w .. 8w+7] of its word row w) permuted from pairs (0,1) (2,3)
// (4,5) (6,7) to the nibble pairs (j, j+4). R += (B + q) x per column, X += x (the x-sum MMA; with
// TWO_BASES its rows g give W += B x: the low K half of each MMA takes even j, the high half odd j);
// `fresh` (a group's first step) starts both from zero.
template <typename T, bool RUNNING = false, bool TWO_BASES = false>
__device__ __forceinline__ void step_mmas(float (&raw)[2][4], float (&xsum)[4], const uint32_t (&r)[4][4], uint4 xr,
                                          bool fresh) {
  // A fragment: a0 / a2 = rows g, K slots 2t.. / 2t+8.., a1 / a3 = rows g + 8
  uint32_t ones[4] = {Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2};
  if constexpr (TWO_BASES) ones[0] = Num<T>::BASE2, ones[2] = Num<T>::BASE2_ODD;
  const uint32_t b[2][2] = {{__byte_perm(xr.x, xr.z, 0x5410), __byte_perm(xr.x, xr.z, 0x7632)},
                            {__byte_perm(xr.y, xr.w, 0x5410), __byte_perm(xr.y, xr.w, 0x7632)}};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      const uint32_t a[4] = {r[2 * tile][2 * half], r[2 * tile + 1][2 * half], r[2 * tile][2 * half + 1],
                             r[2 * tile + 1][2 * half + 1]};
      if (!RUNNING && fresh && half == 0) mma<T, true>(raw[tile], a, b[half][0], b[half][1]);
      else mma<T, false>(raw[tile], a, b[half][0], b[half][1]);
    }
    if (fresh && half == 0) mma<T, true>(xsum, ones, b[half][0], b[half][1]);
    else mma<T, false>(xsum, ones, b[half][0], b[half][1]);
  }
}

// Four fp16 values (two half2 words: a column quad's scales, zeros) as floats.
__device__ __forceinline__ void quad_to_float(uint2 h, float (&f)[4]) {
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
  f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
}

// A closed group folded into the lane's sums, in fp32: sum (q s + z) x = s R + (z - B s) X (one
// base) or s (R - W) + z X (TWO_BASES) for its columns c .. c+3, from their fp16 scales and zeros
// (two half2 words each). The x-sum MMA's C fragment: c0 / c1 (tokens 2t, 2t+1) are its rows g,
// c2 / c3 its rows g + 8; with one base every row is X, with TWO_BASES rows g are W, rows g + 8 X.
template <typename T, bool TWO_BASES = false>
struct GroupFold {
  float s[4], zb[4];  // s and z - B s (TWO_BASES: z; W carries B) of column c + j
  __device__ __forceinline__ GroupFold(uint2 scales, uint2 zeros) {
    float z[4];
    quad_to_float(scales, s);
    quad_to_float(zeros, z);
#pragma unroll
    for (int j = 0; j < 4; ++j) zb[j] = TWO_BASES ? z[j] : z[j] - Num<T>::BASE * s[j];
  }
  // C fragment: row g of tile t is column c + 2t, row g + 8 is c + 2t + 1; c & 1 picks the token.
  __device__ __forceinline__ void operator()(float (&acc)[2][4], const float (&raw)[2][4],
                                             const float (&xsum)[4]) const {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 2 * tile + (c >> 1);
        const float r = TWO_BASES ? raw[tile][c] - xsum[c & 1] : raw[tile][c];
        acc[tile][c] = fmaf(s[j], r, fmaf(zb[j], xsum[(TWO_BASES ? 2 : 0) + (c & 1)], acc[tile][c]));
      }
  }
};

// RunningFold: the raw sums go into the output accumulators themselves, kept in units of the current
// group's scale u (s, or 2^-60 where s = 0), so no second set of accumulators is held: at a group's
// close  T = u A + (z - B s) X  is the true sum so far, and A = T / u' carries it into the next group
// (u' = 1 after the warp's last group). Per column: si = u / u', zi = (z - B s) / u'.
// A zero scale's codes then add u R (R = sum (B + q) x): below 2^-60 |R|, far under any rounding.
template <typename T>
struct RunningFold {
  float si[4], zi[4];
  __device__ __forceinline__ RunningFold(uint2 scales, uint2 zeros, uint2 next, bool last) {
    float s[4], z[4], n[4];
    quad_to_float(scales, s);
    quad_to_float(zeros, z);
    quad_to_float(next, n);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // (rcp.approx instead: 4 more registers, and four tiles of groups of 128 spill 68 bytes)
      const float inv = last ? 1.f : __frcp_rn(n[j] != 0.f ? n[j] : 0x1p-60f);
      si[j] = (s[j] != 0.f ? s[j] : 0x1p-60f) * inv;
      zi[j] = (z[j] - Num<T>::BASE * s[j]) * inv;
    }
  }
  __device__ __forceinline__ void operator()(float (&acc)[2][4], const float (&xsum)[4]) const {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 2 * tile + (c >> 1);
        acc[tile][c] = fmaf(si[j], acc[tile][c], zi[j] * xsum[c & 1]);
      }
  }
};

// Where the kernel folds with RunningFold: at four token tiles (17-32 tokens), where the second set
// of accumulators spilled 44-440 bytes at the 128-register cap (none with RunningFold): 4-12% faster
// at 32 tokens on every issue-3 shape, 2% slower to 6% faster at 17 (H200). Elsewhere the fold's
// dependence (a group's first MMAs wait for the previous group's fold; with a fresh set they do not)
// costs more than the registers buy: 3-8% slower at 1 and 8 tokens, 4-13% at 16 even where 80
// registers let 24 warps share an SM instead of 16, 6-12% at eight tiles (33-64 tokens), whose
// spills cost less than the dependence (benchmarks/notes-w4a16.md, session 36).
__host__ __device__ constexpr bool running_fold(int mt) { return mt == 4; }
// Byte offset of x in a stage: the weights' 512 bytes, then the group parameters (scales and zeros;
// with RunningFold the next group's scales too), then x.
__host__ __device__ constexpr int stage_x_offset(int mt) { return running_fold(mt) ? 704 : 640; }

// Ring of RING stages per warp with AHEAD steps in flight: one stage of slack lets a single
// warp barrier per step order the reads of a stage before its refill. (Measured on the H200: rings
// of 6 and 8 stages were no faster; the extra shared memory is better spent on resident warps.)
constexpr int RING = 4, AHEAD = RING - 2;

// MT: token tiles of 8 (M <= 8 * MT). GS: steps per group when it divides RING (groups of 32, 64,
// 128: every group boundary then falls at a fixed position in the unrolled ring), 0 otherwise
// (group_shift_steps at run time; a shift >= 30 means one group per column).
// Launch bounds (registers): 64 at one token tile, for 32 resident warps per SM (34.5 instead of
// 37.2 us at 72-79 registers and 24 warps on 28672 x 8192, H200); 128 at four token tiles, for two
// CTAs of 8 warps per SM. Two and eight tiles take what they need (~110 and ~250).
// X_L1: x copied through the L1 (cp.async.ca) instead of around it; the caller picks (w4a16.py:
// x_through_l1, where the measurements are).
template <typename T, int MT, int GS, bool MANY, bool X_L1>
__global__ void __launch_bounds__(MT <= 2 ? 512 : 256, MT == 1 || MT == 4 ? 2 : 1)
    w4a16_mma_kernel(const T* __restrict__ x, const Weights<T> weights, int M, int K, int group_shift_steps,
                     int ldx, int trigger) {
  // A stage (bytes): [0, 512) weights (swizzled rows, see the header); [512, 640) scales (8 B) +
  // zeros (8 B) of the 8 column quads, copied only into the stage of a group's last step, where the
  // group is closed (lanes 0-7 copy the scales, 8-15 the zeros: one 64-byte request each; with
  // RunningFold lanes 16-23 copy the next group's scales into [640, 704), where the warp has one);
  // [XS, XS + 512 MT) x, 64 bytes per token (4 word rows of 16 B), copied for real tokens only
  // (the slots of padding tokens are zeroed once). Everything a step needs is in flight together
  // (x and the group parameters are L2 hits at best; waiting for them inside the step costs a
  // round trip per step). The stage size is a compile-time constant and the loop is unrolled over
  // the ring, so every shared-memory address is a register plus an immediate.
  // Reused after the loop as [warps][MT * 8][32] floats.
  constexpr bool RUNNING = running_fold(MT), TWO_BASES = two_bases<T>(MT);
  constexpr int SZ = 512, XS = stage_x_offset(MT), STAGE = XS + 512 * MT, GSTEP = GS ? GS : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // the lane's column quad (its MMA rows g, g + 8)
  int tile_col;
  const int which = cta_weight<MANY>(weights.cta_end, tile_col);
  const uint32_t* __restrict__ qweight = pick(weights.qweight, which);
  const __half* __restrict__ scales = pick(weights.scales, which);
  const __half* __restrict__ zeros = pick(weights.zeros, which);
  const int N = pick(weights.n, which);
  const int steps = K >> 5;  // step s covers word rows 4s .. 4s+3
  // Warps own contiguous ranges of whole groups (any split when there is one group per column),
  // so a group never straddles two warps and a range always ends a group.
  const bool one_group = group_shift_steps >= 30;
  const int unit_shift = one_group ? 0 : group_shift_steps, units = steps >> unit_shift;
  const int s_begin = (int)((long long)units * warp / warps) << unit_shift;
  const int s_end = (int)((long long)units * (warp + 1) / warps) << unit_shift;
  const int group_steps = one_group ? steps : 1 << group_shift_steps;
  const int m_rows = M < MT * 8 ? M : MT * 8;

  unsigned char* ring = smem + (size_t)warp * RING * STAGE;
  const uint32_t ring_addr = (uint32_t)__cvta_generic_to_shared(ring);
  // Copy state, advanced as steps are issued (recomputing the addresses of every step cost as many
  // instructions as the dequantization).
  WeightStream ws(ring_addr, lane, qweight, N, s_begin, tile_col);
  const bool copies_sz = lane < (RUNNING ? 24 : 16);  // lanes 0-7: scales, 8-15: zeros, 16-23: next scales
  const bool copies_next = RUNNING && lane >= 16;
  const uint32_t sz_dst = ring_addr + SZ + (copies_next ? 128 + ws.copy_quad * 8 : ws.copy_quad * 16 + (lane < 8 ? 0 : 8));
  const __half* sz_src = (lane < 8 || copies_next ? scales : zeros) + tile_col + 4 * ws.copy_quad +
                         (size_t)(one_group ? 0 : (s_begin >> group_shift_steps) + copies_next) * N;
  const int sz_stride = one_group ? 0 : N;
  ws.prefetch<RING>(s_begin, s_end);
  prefetch_l2(copies_sz && !copies_next, sz_src);
  wait_for_prior_grids();  // x is the previous kernel's output
  // GS == 0 only: the first step past the current group, for the copies and for the reads
  int issue_group_end = min(s_begin + group_steps, s_end), read_group_end = issue_group_end;
  TokenStream<T, uint4, MT> xstream(x, ldx, m_rows, lane, s_begin, ring + XS, STAGE, RING);
  let_successor_launch(trigger);  // after the wait: at most two grids in flight (skinny.cuh)

  // Copy step j into `stage` (run_pipeline's contract); a group's scales and zeros ride with its
  // last step.
  auto issue = [&](int stage, int j, int ahead, bool live) {
    const bool closes = GS ? (stage + 1) % GSTEP == 0 : j + 1 == issue_group_end;
    cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);
    cp_async_8(live && closes && copies_sz && (!copies_next || j + 1 < s_end), sz_dst + stage * STAGE, sz_src);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      cp_async_16<X_L1>(live && xstream.live[mt], ring_addr + stage * STAGE + XS + xstream.offset(mt),
                        xstream.src[mt] + 32 * ahead);
    cp_async_commit();
    ws.src += ws.step_stride;  // past the range: never read
    if (closes) {
      sz_src += sz_stride;
      if (!GS) issue_group_end += group_steps;
    }
  };

  float acc[MT][2][4], raw[MT][2][4], xsum[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[mt][0][j] = acc[mt][1][j] = raw[mt][0][j] = raw[mt][1][j] = xsum[mt][j] = 0.f;
    }

  // Step s from stage i: dequantize, MMA, and where a group closes fold its sums into acc.
  auto step = [&](int i, int s) {
    const unsigned char* here = ring + i * STAGE;
    const uint4 wv = *reinterpret_cast<const uint4*>(here + ws.read_src);
    uint32_t r[4][4];  // [column c + j][nibble pair]
    raw_codes<T, TWO_BASES>(wv.x, r[0]);
    raw_codes<T, TWO_BASES>(wv.y, r[1]);
    raw_codes<T, TWO_BASES>(wv.z, r[2]);
    raw_codes<T, TWO_BASES>(wv.w, r[3]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)  // a group's first step starts its sums from zero
      step_mmas<T, RUNNING, TWO_BASES>(RUNNING ? acc[mt] : raw[mt], xsum[mt], r,
                                       *reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)),
                                       GS && i % GSTEP == 0);

    if (GS ? (i + 1) % GSTEP == 0 : s + 1 == read_group_end) {  // the group closes; its parameters came with this step
      if (!GS) read_group_end += group_steps;
      const uint4 sz = *reinterpret_cast<const uint4*>(here + SZ + g * 16);  // scales, zeros of c..c+3
      if constexpr (RUNNING) {
        const RunningFold<T> fold(make_uint2(sz.x, sz.y), make_uint2(sz.z, sz.w),
                                  *reinterpret_cast<const uint2*>(here + SZ + 128 + g * 8), s + 1 == s_end);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fold(acc[mt], xsum[mt]);
          if (!GS)
#pragma unroll
            for (int c = 0; c < 4; ++c) xsum[mt][c] = 0.f;
        }
      } else {
        const GroupFold<T, TWO_BASES> fold(make_uint2(sz.x, sz.y), make_uint2(sz.z, sz.w));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fold(acc[mt], raw[mt], xsum[mt]);
          if (!GS)
#pragma unroll
            for (int c = 0; c < 4; ++c) raw[mt][0][c] = raw[mt][1][c] = xsum[mt][c] = 0.f;
        }
      }
    }
  };
  run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });

  float* partial = reinterpret_cast<float*>(smem);
  store_fragments<MT>(partial, warp, lane, [&](int mt, int tile, int c) { return acc[mt][tile][c]; });
  __syncthreads();
  // The output's weight is worked out from blockIdx again, not held through the loop: at one token
  // tile and 64 registers, `which` kept live made ptxas spill 16 bytes of the several-weight kernel
  // (groups of 128) and reload them every ring round. H200, M = 1: Llama-2-7B's q/k/v 10.8 -> 10.0
  // us, gate/up 20.5 -> 17.5 (benchmarks/results/w4a16-grouped-spill-h200.json).
  const int out_weight = cta_weight<MANY>(weights.cta_end, tile_col);
  T* __restrict__ out = pick(weights.out, out_weight);
  const int ldo = pick(weights.ldo, out_weight);
  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += partial[w * (MT * 8 * 32) + i];
    out[(size_t)(i >> 5) * ldo + tile_col + (i & 31)] = Num<T>::from_float(sum);
  }
}

size_t smem_bytes(int warps, int mt) {
  const size_t ring = (size_t)warps * RING * (stage_x_offset(mt) + 512 * mt), partial = (size_t)warps * mt * 8 * 32 * sizeof(float);
  return ring > partial ? ring : partial;
}

template <typename T, int MT, int GS, bool MANY, bool X_L1>
cudaError_t launch_gs(const void* x, const Weights<T>& weights, int ctas, int M, int K, int group_shift_steps, int ldx,
                      int warps, cudaStream_t stream, bool pdl, int successor) {
  constexpr auto kernel = w4a16_mma_kernel<T, MT, GS, MANY, X_L1>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  int trigger = 0;
  size_t smem = smem_bytes(warps, MT);
  if ((err = successor_smem<kernel>(successor, pdl, ctas, warps * 32, smem, trigger)) != cudaSuccess) return err;
  return launch_kernel(kernel, ctas, warps * 32, smem, stream, pdl, static_cast<const T*>(x), weights, M, K,
                       group_shift_steps, ldx, trigger);
}

template <typename T, int MT, bool MANY, bool X_L1>
cudaError_t launch_mt(const void* x, const Weights<T>& weights, int ctas, int M, int K, int group_shift_steps, int ldx,
                      int warps, cudaStream_t stream, bool pdl, int successor) {
  switch (group_shift_steps) {  // groups of 32, 64, 128 get the compile-time schedule
    case 0:
      return launch_gs<T, MT, 1, MANY, X_L1>(x, weights, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl,
                                             successor);
    case 1:
      return launch_gs<T, MT, 2, MANY, X_L1>(x, weights, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl,
                                             successor);
    case 2:
      return launch_gs<T, MT, 4, MANY, X_L1>(x, weights, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl,
                                             successor);
    default:
      return launch_gs<T, MT, 0, MANY, X_L1>(x, weights, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl,
                                             successor);
  }
}

template <typename T>
cudaError_t launch(int mt, int warps, bool x_l1, const void* x, int M, int K, int group_shift_steps, int ldx, int count,
                   const void* const* qweights, const void* const* scales, const void* const* zeros,
                   void* const* outs, const int* ns, const int* ldos, cudaStream_t stream, bool pdl, int successor) {
  if (count < 1 || count > MAX_WEIGHTS) return cudaErrorInvalidValue;
  Weights<T> w{};
  for (int i = 0; i < count; ++i) {
    w.qweight[i] = static_cast<const uint32_t*>(qweights[i]);
    w.scales[i] = static_cast<const __half*>(scales[i]);
    w.zeros[i] = static_cast<const __half*>(zeros[i]);
    w.out[i] = static_cast<T*>(outs[i]);
    w.n[i] = ns[i];
    w.ldo[i] = ldos[i];
  }
  const int ctas = running_ends(count, ns, 32, w.cta_end);
  // Several weights in one launch up to 32 tokens (the decode sizes the grouping is for); eight
  // token tiles keep a single-weight kernel only (it is at the register limit).
  const bool many = count > 1;
#define NIBBLE_LAUNCH_MT(MT, X_L1) \
  (many ? launch_mt<T, MT, true, X_L1>(x, w, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl, successor) \
        : launch_mt<T, MT, false, X_L1>(x, w, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl, successor))
  switch (mt) {
    case 1: return x_l1 ? NIBBLE_LAUNCH_MT(1, true) : NIBBLE_LAUNCH_MT(1, false);
    case 2: return x_l1 ? NIBBLE_LAUNCH_MT(2, true) : NIBBLE_LAUNCH_MT(2, false);
    case 4: return x_l1 ? cudaErrorInvalidValue : NIBBLE_LAUNCH_MT(4, false);
    case 8: return many || x_l1 ? cudaErrorInvalidValue : launch_mt<T, 8, false, false>(x, w, ctas, M, K, group_shift_steps,
                                                                               ldx, warps, stream, pdl, successor);
    default: return cudaErrorInvalidValue;
  }
#undef NIBBLE_LAUNCH_MT
}

}  // namespace

// Host entry point (called through ctypes): `count` weights (1 to 3) that read the same x, their
// pointers, column counts and output row strides in arrays. Preconditions are checked by the Python
// caller: every N % 32 == 0, K % 32 == 0, M <= 8 * mt (mt <= 4 for several weights), 16-byte
// aligned x rows (ldx % 8 == 0), group = 32 * 2^group_shift_steps (or one group per column:
// group_shift_steps >= 30), 1 <= warps <= 16 (8 at mt >= 4), mt in {1, 2, 4, 8}. x_l1: x through
// the L1 (mt 1 and 2 only: slower at four tiles, not measured at eight). pdl: launch early
// (skinny.cuh: launch_kernel); successor: when the next kernel may launch (skinny.cuh: Successor).
extern "C" int nibble_w4a16_mma(int is_bf16, int mt, int warps, int x_l1, const void* x, int M, int K, int group_shift_steps,
                                int ldx, int count, const void* const* qweights, const void* const* scales,
                                const void* const* zeros, void* const* outs, const int* ns, const int* ldos,
                                int pdl, int successor, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = is_bf16 ? launch<__nv_bfloat16>(mt, warps, x_l1 != 0, x, M, K, group_shift_steps, ldx, count, qweights,
                                                    scales, zeros, outs, ns, ldos, st, pdl, successor)
                            : launch<__half>(mt, warps, x_l1 != 0, x, M, K, group_shift_steps, ldx, count, qweights, scales,
                                             zeros, outs, ns, ldos, st, pdl, successor);
  return (int)err;
}

extern "C" const char* nibble_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
