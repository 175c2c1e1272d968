// What the Hopper GEMMs (w4a4_wgmma.cu, w4a16_wgmma.cu; sm_90a) share: warpgroup MMAs with the
// weight as the register operand A and the activations as B in shared memory, the weight's stage
// layout and each lane's columns of it, the mbarriers and tensor-map copies (TMA) of their
// pipelines, the split-K hand-off, and the tensor maps' encoder.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (the encoder is fetched from the driver at run time)
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "skinny.cuh"  // launch_kernel, wait_for_prior_grids: early launch

// The accumulator registers of one m64nN instruction, in PTX operand order.
#define NIBBLE_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define NIBBLE_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define NIBBLE_D128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, " \
  "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127}"
#define NIBBLE_OPS8(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define NIBBLE_OPS32(C) NIBBLE_OPS8(C, 0), NIBBLE_OPS8(C, 8), NIBBLE_OPS8(C, 16), NIBBLE_OPS8(C, 24)
#define NIBBLE_OPS64(C) NIBBLE_OPS32(C), NIBBLE_OPS8(C, 32), NIBBLE_OPS8(C, 40), NIBBLE_OPS8(C, 48), NIBBLE_OPS8(C, 56)
#define NIBBLE_OPS128(C)                                                                                  \
  NIBBLE_OPS64(C), NIBBLE_OPS8(C, 64), NIBBLE_OPS8(C, 72), NIBBLE_OPS8(C, 80), NIBBLE_OPS8(C, 88), NIBBLE_OPS8(C, 96), \
      NIBBLE_OPS8(C, 104), NIBBLE_OPS8(C, 112), NIBBLE_OPS8(C, 120)

template <typename E, int N> struct alignas(sizeof(E) * N) Vec { E v[N]; };  // one N-wide access

// d += A (64 x K, four registers per thread) * B (K x BN, shared memory descriptor, K-major).
// Kind: s8 (K = 32, int32 accumulators), f16 / bf16 (K = 16, fp32 accumulators).
struct S8 {};
struct F16 {};
struct BF16 {};
template <typename Kind, int BN> struct Wgmma;
template <> struct Wgmma<S8, 64> {
  static __device__ __forceinline__ void mma(int (&d)[32], const uint32_t* a, uint64_t desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " NIBBLE_D32 ", {%32, %33, %34, %35}, %36, 1;"
                 : NIBBLE_OPS32("+r") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
};
template <> struct Wgmma<S8, 128> {
  static __device__ __forceinline__ void mma(int (&d)[64], const uint32_t* a, uint64_t desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " NIBBLE_D64 ", {%64, %65, %66, %67}, %68, 1;"
                 : NIBBLE_OPS64("+r") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
};
// Floating point (TYPE "f16" or "bf16"): scale-d 1 (accumulate), A and B not negated, B not
// transposed (K-major).
#define NIBBLE_WGMMA_F32(KIND, TYPE)                                                                          \
  template <> struct Wgmma<KIND, 64> {                                                                        \
    static __device__ __forceinline__ void mma(float (&d)[32], const uint32_t* a, uint64_t desc) {            \
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " NIBBLE_D32                 \
                   ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"                                                 \
                   : NIBBLE_OPS32("+f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));              \
    }                                                                                                         \
  };                                                                                                          \
  template <> struct Wgmma<KIND, 128> {                                                                       \
    static __device__ __forceinline__ void mma(float (&d)[64], const uint32_t* a, uint64_t desc) {            \
      asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " NIBBLE_D64                \
                   ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"                                                 \
                   : NIBBLE_OPS64("+f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));              \
    }                                                                                                         \
  };                                                                                                          \
  template <> struct Wgmma<KIND, 256> {                                                                       \
    static __device__ __forceinline__ void mma(float (&d)[128], const uint32_t* a, uint64_t desc) {           \
      asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " NIBBLE_D128               \
                   ", {%128, %129, %130, %131}, %132, 1, 1, 1, 0;"                                            \
                   : NIBBLE_OPS128("+f") : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));             \
    }                                                                                                         \
  };
NIBBLE_WGMMA_F32(F16, "f16")
NIBBLE_WGMMA_F32(BF16, "bf16")
#undef NIBBLE_WGMMA_F32

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory"); }
// Keeps the compiler from moving accumulator reads / writes across the asynchronous MMAs.
template <int R>
__device__ __forceinline__ void fence_operands(int (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// K-major operand, 128-byte swizzle: start address, leading offset unused (1), 1024 bytes between
// 8-row groups. A K step inside a 128-byte row is the start moved by its byte offset.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr >> 4) & 0x3FFF) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; @!done bra WAIT_%=; }"
      ::"r"(bar), "r"(parity) : "memory");
}
// A 2-D box of a tensor map (c0: innermost coordinate) into shared memory; completes on `bar`
// with the box's full size in bytes, zero-filled past the tensor's edges.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// The weight both GEMMs read: nibble's canonical INT4 words (int32 [K / 8, N], word row i = K rows
// 8i .. 8i+7 of its column), copied per stage of BK K rows as boxes of 32 columns x BK / 8 word rows
// (128-byte rows in the TMA's 128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)).
constexpr int BK = 128;              // K per pipeline stage
constexpr int W_BOX = BK / 8 * 128;  // bytes of one box

// The producer's copies of one stage's CH / 32 weight boxes (columns n0 .., K rows k0 ..) to dst.
template <int CH>
__device__ __forceinline__ void load_weight_boxes(uint32_t dst, const CUtensorMap* w_map, int n0, int k0,
                                                  uint32_t full) {
#pragma unroll
  for (int b = 0; b < CH / 32; ++b) tma_load(dst + b * W_BOX, w_map, n0 + 32 * b, k0 / 8, full);
}

// WORDS 32-bit words at byte `byte` (of a 128-byte row) of row r of the swizzled box at stage + box.
template <int WORDS>
__device__ __forceinline__ Vec<uint32_t, WORDS> swizzled_words(const unsigned char* stage, int box, int byte, int r) {
  return *reinterpret_cast<const Vec<uint32_t, WORDS>*>(stage + box + r * 128 +
                                                        ((((byte >> 4) ^ (r & 7)) << 4) | (byte & 15)));
}

// The weight columns a lane of a consumer warpgroup owns when each warpgroup issues J m64
// instructions: 2J consecutive columns col .. of the CTA (MMA rows g / g+8 of instruction j are
// columns col + 2j / col + 2j + 1), and its words of word row r in a stage whose boxes start at
// byte `boxes` (one 2J-word piece: 16 or 8 bytes of a swizzled row).
//
// GATED (w4a4_wgmma.cu's SiLU(gate) * up): the stage holds CH / 2 columns of the gate weight in
// its first half of boxes (`up` bytes long) and the same columns of up in the second. The lane owns
// J gate / up pairs: rows g / g+8 of instruction j are gate / up column p + j, so one lane holds
// both factors of J outputs, and its words are two J-word pieces (8 or 4 bytes), one from each half.
// col = 2p, the lane's first "gated" column (the tile's 2 x CH / 2, in the units the split-K
// partials and the tile bounds count). The 4 / J warps that share a box of 32 columns take chunks
// of it half a row apart (lanes g < 4: 16-byte chunk c, g >= 4: chunk c + 4): under the swizzle the
// four K rows a load spans then hit every bank group twice, not half of them four times, as 64
// contiguous bytes would (the two measured alike on the H200; the mapping costs nothing).
template <int J, bool GATED = false> struct LaneWeights {
  int col, offset, byte, up;
  __device__ __forceinline__ LaneWeights(int warp, int g, int boxes, int up_ = 0) {
    if constexpr (GATED) {
      constexpr int WARPS_PER_BOX = 4 / J;
      const int p = warp / WARPS_PER_BOX * 32 + warp % WARPS_PER_BOX * 4 * J + (g >> 2) * 16 + (g & 3) * J;
      col = 2 * p;
      offset = boxes + p / 32 * W_BOX;
      byte = (p % 32) * 4;
    } else {
      col = (warp >> 2) * 64 * J + (warp & 3) * 16 * J + 2 * J * g;
      offset = boxes + col / 32 * W_BOX;
      byte = (col % 32) * 4;
    }
    up = up_;
  }
  __device__ __forceinline__ Vec<uint32_t, 2 * J> words(const unsigned char* stage, int r) const {
    if constexpr (!GATED) return swizzled_words<2 * J>(stage, offset, byte, r);
    const Vec<uint32_t, J> gate = swizzled_words<J>(stage, offset, byte, r),
                           upw = swizzled_words<J>(stage, offset + up, byte, r);
    Vec<uint32_t, 2 * J> w;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      w.v[2 * j] = gate.v[j];
      w.v[2 * j + 1] = upw.v[j];
    }
    return w;
  }
};

// The consumers' accumulators, zeroed and fenced before the first asynchronous MMA.
template <typename A, int J, int R>
__device__ __forceinline__ void zero_accumulators(A (&acc)[J][R]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int i = 0; i < R; ++i) acc[j][i] = A(0);
    fence_operands(acc[j]);
  }
}

// After the MMAs: acc[j][4 b + c] holds token 8 b + 2 t + (c & 1) of the tile, column col + 2 j +
// (c >> 1); v gets the lane's 2J columns of token 8 b + 2 t + p in column order.
template <typename A, int J, int R>
__device__ __forceinline__ void token_values(const A (&acc)[J][R], int b, int p, A (&v)[2 * J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    v[2 * j] = acc[j][4 * b + p];
    v[2 * j + 1] = acc[j][4 * b + 2 + p];
  }
}

// One token's packed 16-bit outputs (WORDS = J words: 4 or 8 bytes), stored where `live` (a token
// inside M) by a predicated store, so that the epilogues have no branch per token: they are time
// the tensor cores wait, and in a model their code is fetched cold at every launch (w4a4_wgmma.cu
// measures it). Written in PTX also because nvcc 13.0 splits a plain store of two packed words
// (a uint2 or an aligned Vec) into two 4-byte ones.
template <int WORDS>
__device__ __forceinline__ void store_if(bool live, void* dst, const Vec<uint32_t, WORDS>& o) {
  static_assert(WORDS == 1 || WORDS == 2, "one token's outputs are 1 or 2 packed words");
  if constexpr (WORDS == 1)
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p st.global.b32 [%0], %1; }" ::"l"(dst), "r"(o.v[0]),
                 "r"((int)live));
  else
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %3, 0; @p st.global.v2.b32 [%0], {%1, %2}; }" ::"l"(dst),
                 "r"(o.v[0]), "r"(o.v[1]), "r"((int)live));
}

// Split-K. The splits of an output tile run as one thread-block cluster (launched with cluster
// dimension `splits` along the split axis), so they are resident together and can read each
// other's shared memory (DSMEM). After its mainloop each CTA stores the token rows the others sum
// into its own ring (free by then: the CTA has no next item), meets them at a cluster barrier,
// sums its share of the tile's rows (RowShare: groups b of 8 tokens) over every split, reading
// the others' rings, and meets them once more (until then another may still read its ring, which
// must not be reused nor its CTA exit); its epilogue stores the share. The reduction and the
// epilogue are spread over the splits' CTAs. H200, against the same hand-off through global memory (partials stored, a
// __threadfence, loads through the L2): W4A4 4096 x 11008 at M = 128 in 3 splits of 128 x 128
// 19.6 -> 17.4 us, W4A16 38.5 -> 33.9, 8192 x 28672 in 2 splits 53.3 -> 50.3 and 129 -> 122
// (benchmarks/results/split-k-dsmem-h200.json; the partials' data is what cost: without any it
// took 14.5 us). (Before that, the last CTA to arrive on a tile, found by an atomic counter, summed
// every split's rows and ran the whole epilogue alone while the other CTAs of the tile idled: W4A4
// 4096 x 4096 at M = 128 in 6 splits of 128 x 256 tiles took 41.7 us, then 17.4.)
struct RowShare {
  int lo, hi;  // groups [lo, hi) of the tile's BN / 8
  __device__ __forceinline__ bool mine(int b) const { return lo <= b && b < hi; }
  // The epilogues store token row r (8 b + 2 t + p) of the tile where (unsigned)(r - 8 lo) < this:
  // the share and the bounds test in one compare per token, as the bounds test alone was.
  __device__ __forceinline__ unsigned stored_rows(int m0, int M) const { return max(0, min(8 * hi, M - m0) - 8 * lo); }
};
__device__ __forceinline__ RowShare row_share(int groups, int split, int splits) {
  return {groups * split / splits, groups * (split + 1) / splits};
}

// The pipeline both GEMMs run: a CTA of two consumer warpgroups (256 threads) and one producer
// warpgroup; per stage a "full" mbarrier (the producer's expected TMA bytes landed) and an "empty"
// one (both consumer warpgroups released the stage), full[STAGES] then empty[STAGES] at `bars`.
constexpr int CONSUMER_THREADS = 256;

// The partials in a ring: consumer thread i keeps its 2J values of token row 8 b + 2 t + p at slot
// (2 b + p) * 256 + i, 8J bytes each. Consecutive threads write consecutive slots (no bank
// conflicts), and the thread of the same index in another split's CTA owns the same outputs, so
// it reads the same slot there. BN * 512 * J bytes: within every tile's ring (static_asserts).
template <int BN, int J>
constexpr int partial_bytes() { return BN / 8 * 2 * CONSUMER_THREADS * 8 * J; }
template <int J>
__device__ __forceinline__ uint32_t partial_slot(uint32_t ring, int b, int p, int thread) {
  return ring + ((2 * b + p) * CONSUMER_THREADS + thread) * 8 * J;
}

// Both consumer warpgroups' MMAs are done reading the ring (named barrier 1; the W4A4 epilogue uses
// 2 and 3), so the partials may overwrite it.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// The CTA's partial sums of the token rows outside `skip` into its own ring, for the other splits.
template <int BN, typename A, int J, int R>
__device__ __forceinline__ void store_partial(const A (&acc)[J][R], uint32_t ring, int thread, RowShare skip) {
  static_assert(sizeof(A) == 4 && (J == 1 || J == 2), "2J 32-bit values: one 8- or 16-byte access");
#pragma unroll
  for (int b = 0; b < BN / 8; ++b)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      if (skip.mine(b)) continue;
      Vec<A, 2 * J> v;
      token_values(acc, b, p, v.v);
      const uint32_t* w = reinterpret_cast<const uint32_t*>(v.v);
      const uint32_t at = partial_slot<J>(ring, b, p, thread);
      if constexpr (J == 1) asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(at), "r"(w[0]), "r"(w[1]) : "memory");
      else asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                        : "memory");
    }
}

// Every consumer thread of the cluster: what each stored to shared memory before is visible to
// the others after (release / acquire at cluster scope), and none is still reading another's.
// (Split into an arrive after the sums and a wait after the epilogue, to hide the second barrier:
// W4A4 no faster, W4A16 up to 4% slower with its stores moved out of the sums' batches; H200.)
__device__ __forceinline__ void cluster_sync_partials() {
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// `ring` (a shared address of this CTA) as the same address in cluster CTA `rank`'s shared memory.
__device__ __forceinline__ uint32_t cluster_address(uint32_t ring, int rank) {
  uint32_t there;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(there) : "r"(ring), "r"(rank));
  return there;
}

// After cluster_sync_partials: the rows of `share` in acc become the sum of the splits' partials
// in split order (fp32 then rounds the same on every call; int32 is exact in any order). acc
// already holds split `own`'s partial and skips it, or (own < 0) starts from zero, every split's
// partial read from its ring (this CTA's own included). Token rows go in batches (values of b) of
// 32 registers of loads, 8 beside 128 accumulators: all loads of a batch and split are issued
// before any is used (batches of 64 registers: W4A4 as fast, W4A16 up to 5% slower; H200); done(b)
// is called on each b once its rows are summed (a caller that stores there overlaps its stores
// with the next batch's loads). Rows outside the share are not loaded (their acc is meaningless
// after).
template <int BN, typename A, int J, int R, typename Done>
__device__ __forceinline__ void sum_partials(A (&acc)[J][R], uint32_t ring, int thread, int splits, int own,
                                             RowShare share, Done done) {
  static_assert(sizeof(A) == 4 && (J == 1 || J == 2), "2J 32-bit values: one 8- or 16-byte access");
  constexpr int LOAD_REGS = BN * J >= 256 ? 8 : 32;  // beside 128 accumulators 16 spilled (ptxas: 168 registers)
  constexpr int ROWS = LOAD_REGS / (4 * J) < BN / 8 ? LOAD_REGS / (4 * J) : BN / 8;
#pragma unroll
  for (int b0 = 0; b0 < BN / 8; b0 += ROWS) {
    if (share.hi <= b0 || b0 + ROWS <= share.lo) continue;  // no row of this batch is ours
    if (own < 0)
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][4 * b + i] = A(0);
#pragma unroll 1
    for (int s = 0; s < splits; ++s) {
      if (s == own) continue;
      const uint32_t there = cluster_address(ring, s);
      uint32_t o[ROWS][2][2 * J];
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (!share.mine(b)) continue;
          uint32_t* w = o[b - b0][p];
          const uint32_t at = partial_slot<J>(there, b, p, thread);
          if constexpr (J == 1)
            asm volatile("ld.shared::cluster.v2.b32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(at) : "memory");
          else
            asm volatile("ld.shared::cluster.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at) : "memory");
        }
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int j = 0; j < J; ++j) {
            acc[j][4 * b + p] += reinterpret_cast<const A&>(o[b - b0][p][2 * j]);
            acc[j][4 * b + 2 + p] += reinterpret_cast<const A&>(o[b - b0][p][2 * j + 1]);
          }
    }
#pragma unroll
    for (int b = b0; b < b0 + ROWS; ++b) done(b);
  }
}

// The whole hand-off of split `split` of `splits`, after its mainloop: the rows of `share` in acc
// become the sum over the splits, done(b) as in sum_partials. ORDERED (fp32, bitwise repeatable):
// every split's partial is stored and summed in split order, this CTA's own read back from its
// ring; else (int32, exact in any order) acc keeps this CTA's own and only the others' rows are
// stored.
template <bool ORDERED, int BN, typename A, int J, int R, typename Done>
__device__ __forceinline__ void split_k_sum(A (&acc)[J][R], uint32_t ring, int thread, int split, int splits,
                                            RowShare share, Done done) {
  consumers_sync();
  store_partial<BN>(acc, ring, thread, ORDERED ? RowShare{0, 0} : share);
  cluster_sync_partials();
  sum_partials<BN>(acc, ring, thread, splits, ORDERED ? -1 : split, share, done);
  cluster_sync_partials();  // the other splits are done reading this ring
}

constexpr int GROUP_M = 8;  // token tiles that run next to each other over the same weight tiles

// Output tile `pid`'s first token and channel (grouped order: GROUP_M token tiles share each weight
// tile while it is in the L2) and the K stages of its split `split`.
struct CtaWork {
  int m0, n0, k_begin, k_tiles;
};
__device__ __forceinline__ CtaWork cta_work(int M, int N, int K, int tokens, int channels, int tiles_per_split,
                                            int pid, int split) {
  const int num_m = (M + tokens - 1) / tokens, num_n = (N + channels - 1) / channels;
  const int group = GROUP_M * num_n, first_m = (pid / group) * GROUP_M;
  const int gm = min(num_m - first_m, GROUP_M);
  const int k_all = (K + BK - 1) / BK, k_begin = split * tiles_per_split;
  return {(first_m + (pid % group) % gm) * tokens, ((pid % group) / gm) * channels, k_begin,
          min(k_begin + tiles_per_split, k_all) - k_begin};
}

// Several weights in one launch (skinny.cuh: MAX_WEIGHTS), their output columns side by side:
// weight i owns the launch's columns [col_end[i - 1], col_end[i]) (col_end of unused entries is
// INT_MAX). The weight of the tile whose first column is n0, and that weight's first column
// (col0). Every weight but the last has a multiple of the tile's channels (the host checks), so a
// tile never spans two weights, and each weight's tensor map zero-fills its own tail.
__device__ __forceinline__ int column_weight(const int (&col_end)[MAX_WEIGHTS], int n0, int& col0) {
  const int which = (n0 >= col_end[0]) + (n0 >= col_end[1]);
  col0 = which ? pick(col_end, which - 1) : 0;
  return which;
}

// Thread 0, before the CTA's first barrier.
template <int STAGES>
__device__ __forceinline__ void init_stage_barriers(uint32_t bars) {
  for (int s = 0; s < STAGES; ++s) {
    mbar_init(bars + 8 * s, 1);             // the producer's expect_tx
    mbar_init(bars + 8 * (STAGES + s), 2);  // one release per consumer warpgroup
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The producer's one thread: the CTA's K tiles are numbered on from `first` (a persistent CTA
// continues its ring from one output tile to the next); tile g goes to stage g % STAGES once the
// stage's previous tile was released. load_w / load_x (shared address of the stage, first K of the
// tile, full barrier) issue the stage's copies of the weight and of x, `bytes` in all.
// Early launch (skinny.cuh): the kernel may start while the previous one, which writes x, still
// runs. So the CTA's first STAGES tiles get their weight copies (no kernel writes weights) before
// wait_for_prior_grids, and their x after it: the ring's first DRAM round trip overlaps the
// previous kernel.
template <int STAGES, typename LoadW, typename LoadX>
__device__ __forceinline__ void produce(uint32_t bars, uint32_t base, int stage_bytes, int bytes, int k_begin,
                                        int k_tiles, int first, LoadW load_w, LoadX load_x) {
  const int early = first == 0 ? min(STAGES, k_tiles) : 0;
  for (int i = 0; i < early; ++i) {
    mbar_expect_tx(bars + 8 * i, bytes);
    load_w(base + i * stage_bytes, (k_begin + i) * BK, bars + 8 * i);
  }
  if (first == 0) wait_for_prior_grids();
  for (int i = 0; i < early; ++i) load_x(base + i * stage_bytes, (k_begin + i) * BK, bars + 8 * i);
  for (int i = early; i < k_tiles; ++i) {
    const int g = first + i, s = g % STAGES;
    if (g >= STAGES) mbar_wait(bars + 8 * (STAGES + s), (g / STAGES - 1) & 1);
    mbar_expect_tx(bars + 8 * s, bytes);
    load_w(base + s * stage_bytes, (k_begin + i) * BK, bars + 8 * s);
    load_x(base + s * stage_bytes, (k_begin + i) * BK, bars + 8 * s);
  }
}

// How many clusters of `splits` CTAs of Kernel (`threads` threads, `smem` bytes of dynamic shared
// memory, one CTA per SM) can be resident at once on the current device, cached per device and
// `splits` (a kernel's first threads and smem stand for its later calls of the same splits). The
// SMs of a cluster share a GPC, so this can be fewer than SMs / splits: on the H200, 30 clusters of
// 4 (not 33) and 15 of 8 (not 16), so 32 tiles in 4 splits run in two rounds.
template <auto Kernel>
cudaError_t resident_clusters(int splits, int threads, size_t smem, int& clusters) {
  constexpr int kMaxDevices = 64, kMaxSplits = 16;
  static int known[kMaxDevices][kMaxSplits + 1] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices || splits < 1 || splits > kMaxSplits) return cudaErrorInvalidValue;
  if (known[device][splits] == 0) {
    int sms = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    int n = sms;
    if (splits > 1) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = splits;
      attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(splits * sms);
      config.blockDim = dim3(threads);
      config.dynamicSmemBytes = smem;
      config.attrs = &attr;
      config.numAttrs = 1;
      err = cudaOccupancyMaxActiveClusters(&n, Kernel, &config);
      if (err != cudaSuccess) return err;
      if (n < 1) return cudaErrorInvalidConfiguration;
    }
    known[device][splits] = n;
  }
  clusters = known[device][splits];
  return cudaSuccess;
}

// The tensor maps' encoder lives in the driver; fetched once (no link against libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A row-major [outer, inner] tensor (rows of row_bytes) read in boxes of [box_outer, box_inner].
inline cudaError_t tensor_map_2d(CUtensorMap* map, CUtensorMapDataType dtype, const void* ptr, uint64_t inner,
                                 uint64_t outer, uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer,
                                 CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  const cuuint64_t dims[2] = {inner, outer}, strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer}, unit[2] = {1, 1};
  const CUresult r = encode(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The weight's tensor map: boxes of 32 columns x BK / 8 word rows, 128-byte swizzle.
inline cudaError_t weight_map(CUtensorMap* map, const void* qweight, int N, int K) {
  return tensor_map_2d(map, CU_TENSOR_MAP_DATA_TYPE_INT32, qweight, N, K / 8, (uint64_t)N * 4, 32, BK / 8);
}
