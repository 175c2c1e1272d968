// What the skinny tensor-core kernels (w4a16_mma.cu, w4a4_mma.cu; rotate_quantize.cu too) share:
// cp.async helpers (global -> shared copies that hold no registers), a lop3, the 16-bit mma.sync,
// the lane mappings of their per-warp weight and token streams, and the shared-memory opt-in of
// their launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include <type_traits>

// (a & b) | c in one instruction (lut = (0xF0 & 0xCC) | 0xAA); written out because the compiler
// splits a mask and an OR constant into two.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// c = A (16 x 16, four registers) * B (16 x 8, two registers) + C, fp32 accumulators; C is c, or
// zero for FRESH (the first MMA of a group: no zeroing instructions after each group's fold).
#define NIBBLE_MMA_16816(TYPE, C)                                                                         \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
      "{%8, %9}, " C ";"                                                                                  \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f))

template <typename T, bool FRESH>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  constexpr bool F16 = std::is_same_v<T, __half>;
  if constexpr (F16 && FRESH) NIBBLE_MMA_16816("f16", "{%10, %10, %10, %10}");
  if constexpr (F16 && !FRESH) NIBBLE_MMA_16816("f16", "{%0, %1, %2, %3}");
  if constexpr (!F16 && FRESH) NIBBLE_MMA_16816("bf16", "{%10, %10, %10, %10}");
  if constexpr (!F16 && !FRESH) NIBBLE_MMA_16816("bf16", "{%0, %1, %2, %3}");
}

// Predicated copies: a branch around each copy would cost a reconvergence barrier per step.
// 16 bytes bypass L1 (.cg: weights, read once) unless L1 (.ca: data other CTAs of the SM read too);
// 8 bytes go through it (.ca: small, reused data).
template <bool L1 = false>
__device__ __forceinline__ void cp_async_16(bool pred, uint32_t smem_addr, const void* gmem) {
  if constexpr (L1)
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.ca.shared.global [%1], [%2], 16; }"
                 ::"r"((int)pred), "r"(smem_addr), "l"(gmem));
  else
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.cg.shared.global.L2::128B [%1], [%2], 16; }"
                 ::"r"((int)pred), "r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_8(bool pred, uint32_t smem_addr, const void* gmem) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.ca.shared.global [%1], [%2], 8; }"
               ::"r"((int)pred), "r"(smem_addr), "l"(gmem));
}

// Programmatic dependent launch (sm_90+; nibble/kernels/early_launch.py): a kernel launched with it
// may start while the previous kernel in the stream still runs (the glue kernels before a matmul let
// it). Before wait_for_prior_grids it may only read what no kernel writes (the weights); after it,
// the previous grid's writes (x) are visible. A no-op where the kernel was launched the plain way.
__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The matmul's own successor may launch early too: once the matmul is past its own wait (so at most
// two grids are in flight: a trigger before it would let a chain of early launches fill the SMs
// with CTAs waiting on each other), so that the successor's CTAs take SM slots as they free and run
// up to their own wait while the matmul streams: its launch and first fetches hide under the matmul.
// The danger is CTAs doubling up: a copy of the same matmul launched into SMs this one leaves idle or
// half full ran two CTAs where its grid wanted one (H200, 4096 x 11008 at M = 1 back to back: 9.8 ->
// 12.2 us). Hence three modes (w4a16.py: successor_launch and w4a4.py: mma_successor pick one;
// benchmarks/results/w4a16-successor-*-h200.json, successor-ab-h200.json):
//   SUCCESSOR_AT_END   the successor launches when this kernel ends (no trigger);
//   SUCCESSOR_CAPPED   at once, with at most ceil(CTAs / SMs) CTAs of this launch per SM: the launch
//                      asks for the shared memory that leaves no room for one more, so the successor
//                      takes only the slots this grid never needed (the L1 shrinks with it);
//   SUCCESSOR_IF_FULL  at once where ceil(CTAs / SMs) CTAs fill an SM's slots anyway (nowhere for the
//                      successor to double up), else at the end; shared memory unchanged.
enum Successor { SUCCESSOR_AT_END = 0, SUCCESSOR_CAPPED = 1, SUCCESSOR_IF_FULL = 2 };

__device__ __forceinline__ void let_successor_launch(int trigger) {
#if __CUDA_ARCH__ >= 900
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// What successor_smem needs of the device, read once per device (it runs at every launch):
// SMs, shared memory per SM, per CTA reserved by the system, per CTA at most.
struct SmLimits {
  int sms, smem_per_sm, reserved, optin;
};
inline cudaError_t sm_limits(int device, SmLimits& limits) {
  constexpr int kMaxDevices = 64;
  static SmLimits known[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  SmLimits& l = known[device];
  if (l.sms == 0) {
    const cudaDeviceAttr attrs[] = {cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                    cudaDevAttrReservedSharedMemoryPerBlock,  // 1 KB on sm_90
                                    cudaDevAttrMaxSharedMemoryPerBlockOptin};
    int* values[] = {&l.sms, &l.smem_per_sm, &l.reserved, &l.optin};
    for (int i = 3; i >= 0; --i) {  // sms last: nonzero marks the entry complete
      const cudaError_t err = cudaDeviceGetAttribute(values[i], attrs[i], device);
      if (err != cudaSuccess) return err;
    }
  }
  limits = l;
  return cudaSuccess;
}

// The launch of `ctas` CTAs of `threads` threads of `Kernel` in mode `successor` (above): `smem`, the
// dynamic shared memory the kernel needs (a function of `threads` for a given kernel), becomes what
// to launch with; `trigger` gets the kernel's let_successor_launch flag. Without early launch (pdl
// false) nothing launches early and nothing changes.
template <auto Kernel>
cudaError_t successor_smem(int successor, bool pdl, int ctas, int threads, size_t& smem, int& trigger) {
  trigger = 0;
  if (!pdl || successor == SUCCESSOR_AT_END) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  SmLimits l;
  if ((err = sm_limits(device, l)) != cudaSuccess) return err;
  const int per_sm = (ctas + l.sms - 1) / l.sms;
  if (successor == SUCCESSOR_CAPPED) {
    long capped = ((long)l.smem_per_sm / per_sm - l.reserved) & ~127L;  // per_sm + 1 CTAs no longer fit
    if (capped > l.optin) capped = l.optin;
    if (capped > (long)smem) smem = (size_t)capped;  // else more CTAs than that do not fit anyway
    trigger = 1;
    return cudaSuccess;
  }
  // CTAs that fit an SM, per device and warps (the kernel's shared memory follows from its warps)
  constexpr int kMaxDevices = 64, kMaxWarps = 32;
  static int fits[kMaxDevices][kMaxWarps + 1] = {};
  const int warps = threads / 32;
  if (warps < 1 || warps > kMaxWarps) return cudaErrorInvalidValue;
  int& fit = fits[device][warps];
  if (fit == 0 && (err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Kernel, threads, smem)) != cudaSuccess)
    return err;
  trigger = per_sm >= fit;
  return cudaSuccess;
}
__device__ __forceinline__ void prefetch_l2(bool pred, const void* gmem) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p prefetch.global.L2 [%1]; }" ::"r"((int)pred), "l"(gmem));
}

// kernel<<<grid, threads, smem, stream>>>(args...) in thread-block clusters of `cluster` CTAs
// (dim3(1): none), allowed to start early (see above) when pdl.
template <typename... Params, typename... Args>
cudaError_t launch_cluster_kernel(void (*kernel)(Params...), dim3 grid, dim3 cluster, int threads, size_t smem,
                                  cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = pdl;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = cluster.x;
  attrs[1].val.clusterDim.y = cluster.y;
  attrs[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream, bool pdl,
                          Args... args) {
  return launch_cluster_kernel(kernel, grid, dim3(1), threads, smem, stream, pdl, args...);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }

// One launch serves up to MAX_WEIGHTS weights that read the same x (a block's q/k/v or gate/up
// projections): CTAs are numbered across them, [cta_end[i - 1], cta_end[i]) computing weight i
// (cta_end of unused entries is INT_MAX). A kernel this short pays a fixed cost per launch
// (launch, ramp, drain): Llama-2-7B's q, k and v at M = 1 take 18.4 us in W4A16 as three launches
// and 10.9 us as one (H200).
constexpr int MAX_WEIGHTS = 3;

// a[i] by selects: indexing a kernel parameter array by a run-time value copies it to local memory
template <typename V>
__device__ __forceinline__ V pick(const V (&a)[MAX_WEIGHTS], int i) {
  return i == 0 ? a[0] : i == 1 ? a[1] : a[2];
}
// &a[i] by selects: the tensor map of weight i in a __grid_constant__ parameter, read in place.
template <typename V>
__device__ __forceinline__ const V* pick_address(const V (&a)[MAX_WEIGHTS], int i) {
  return i == 0 ? &a[0] : i == 1 ? &a[1] : &a[2];
}

// The weight this CTA computes, and its first column in that weight. A launch of one weight is its
// own instantiation (MANY = false): weight 0 at compile time, so its pointers are kernel parameters
// at fixed offsets, read as the kernel starts, not after a comparison and selects.
template <bool MANY>
__device__ __forceinline__ int cta_weight(const int (&cta_end)[MAX_WEIGHTS], int& tile_col) {
  if constexpr (!MANY) {
    tile_col = blockIdx.x * 32;
    return 0;
  }
  const int which = (blockIdx.x >= cta_end[0]) + (blockIdx.x >= cta_end[1]);
  tile_col = (blockIdx.x - (which ? pick(cta_end, which - 1) : 0)) * 32;
  return which;
}

// The running ends of `count` weights of ns[i] columns, `per` columns a unit: weight i owns units
// [ends[i - 1], ends[i]), unused entries INT_MAX. Returns the units of the launch: its CTAs for the
// skinny kernels (32 columns each), its columns for the Hopper GEMMs (per = 1: hopper.cuh's
// column_weight).
inline int running_ends(int count, const int* ns, int per, int (&ends)[MAX_WEIGHTS]) {
  int total = 0;
  for (int i = 0; i < MAX_WEIGHTS; ++i) {
    if (i < count) total += ns[i] / per;
    ends[i] = i < count ? total : INT_MAX;
  }
  return total;
}

// The per-warp weight stream of the skinny kernels (w4a16_mma.cu's header explains the choice): a
// 32-deep K step is 4 word rows x 32 columns = 512 bytes. Lane L copies row L / 8, column quad L % 8,
// so each 8-lane phase of the copy is one whole 128-byte line; in the stage, row r sits at 128 r and
// quad q at 16 ((q ^ 2r) & 7), so the copy and the read-back (lane (g, t): quad g of row t) both hit
// 8 distinct 16-byte bank groups per phase.
struct WeightStream {
  int copy_quad;         // the column quad this lane copies
  uint32_t copy_dst;     // shared address of this lane's copy slot in stage 0
  int read_src;          // byte offset in a stage of the piece this lane consumes
  const uint32_t* src;   // global address of this lane's next copy
  size_t step_stride;    // words from one step to the next (4 rows of N)

  __device__ __forceinline__ WeightStream(uint32_t ring_addr, int lane, const uint32_t* qweight, int N, int s_begin,
                                          int tile_col) {
    step_stride = (size_t)4 * N;
    const int copy_row = lane >> 3, g = lane >> 2, t = lane & 3;
    copy_quad = lane & 7;
    copy_dst = ring_addr + copy_row * 128 + ((copy_quad ^ (2 * copy_row)) & 7) * 16;
    read_src = t * 128 + ((g ^ (2 * t)) & 7) * 16;
    src = qweight + (size_t)(4 * s_begin + copy_row) * N + tile_col + 4 * copy_quad;
  }

  // Pull this lane's first `steps` copies into the L2 (while the previous kernel may still run).
  template <int STEPS>
  __device__ __forceinline__ void prefetch(int s_begin, int s_end) const {
#pragma unroll
    for (int p = 0; p < STEPS; ++p) prefetch_l2(s_begin + p < s_end, src + p * step_stride);
  }
};

// The token rows of x in the same stages: per step, lane (g, t) copies the 8 elements
// x[m, 32 s + 8 t .. + 7] of token m = 8 mt + g (one Piece: 16 bytes of 16-bit x, 8 of int8 x) into
// its own slot of token tile mt. Padding tokens (m >= m_rows) copy nothing: their slots are zeroed
// once, in every stage, so they add zeros to the MMAs.
template <typename TX, typename Piece, int MT>
struct TokenStream {
  static constexpr int TILE = 32 * sizeof(Piece);  // bytes of a token tile in a stage
  const TX* src[MT];  // x of the current round's first step
  bool live[MT];
  int slot;  // this lane's byte offset within a tile

  __device__ __forceinline__ TokenStream(const TX* x, int ldx, int m_rows, int lane, int s_begin,
                                         unsigned char* x_area, int stage_bytes, int stages) {
    const int g = lane >> 2, t = lane & 3;
    slot = sizeof(Piece) * lane;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m = mt * 8 + g;
      live[mt] = m < m_rows;
      src[mt] = x + (size_t)(live[mt] ? m : 0) * ldx + t * 8 + 32 * s_begin;
      if (!live[mt])
        for (int st = 0; st < stages; ++st) *reinterpret_cast<Piece*>(x_area + st * stage_bytes + offset(mt)) = Piece{};
    }
  }
  __device__ __forceinline__ int offset(int mt) const { return TILE * mt + slot; }
  __device__ __forceinline__ void advance(int steps) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) src[mt] += 32 * steps;
  }
};

// The per-warp pipeline both kernels run over the steps [s_begin, s_end) of their K range: a ring of
// RING stages with AHEAD = RING - 2 steps in flight and one warp barrier per step.
// issue(stage, s, ahead, live) copies step s (`ahead` steps past the current round's first) into
// `stage`, or only commits an empty group when !live, so that "at most AHEAD groups pending" always
// means "this step has landed"; step(i, s) consumes step s from stage i (i is a compile-time
// position in the unrolled ring, so stage addresses are immediates); end_round() runs after every
// RING steps. Full rounds (every copy they issue is in range) run without predicates; the last one
// or two are tail rounds. On return every copy has landed and every warp is done with its ring,
// whose shared memory the epilogue reuses.
template <int RING, int AHEAD, typename Issue, typename Step, typename EndRound>
__device__ __forceinline__ void run_pipeline(int s_begin, int s_end, Issue issue, Step step, EndRound end_round) {
  static_assert(AHEAD == RING - 2, "one stage of slack lets one warp barrier per step order reads before refills");
#pragma unroll
  for (int p = 0; p < AHEAD; ++p) issue(p, s_begin + p, p, s_begin + p < s_end);
  auto round = [&](int s0, auto tail) {
    constexpr bool TAIL = decltype(tail)::value;
#pragma unroll
    for (int i = 0; i < RING; ++i) {
      const int s = s0 + i;
      if (TAIL && s >= s_end) break;
      // Refill the stage read two steps ago: every lane passed the warp barrier below since.
      issue((i + AHEAD) % RING, s + AHEAD, i + AHEAD, !TAIL || s + AHEAD < s_end);
      cp_async_wait<AHEAD>();
      // The pieces of this step were copied by other lanes. (bar.warp.sync itself: __syncwarp()
      // adds a divergence check and a branch around it.)
      asm volatile("bar.warp.sync -1;" ::: "memory");
      step(i, s);
    }
    end_round();
  };
  int s0 = s_begin;
  for (; s0 + RING + AHEAD <= s_end; s0 += RING) round(s0, std::false_type{});
  for (; s0 < s_end; s0 += RING) round(s0, std::true_type{});
  cp_async_wait<0>();
  __syncthreads();
}

// After the loop, every warp's C fragments go to its [8 MT tokens][32 columns] slice of `partial`
// (shared memory), where the CTA sums the warps. C fragment of lane (g, t): c0/c1 = (row g, tokens
// 2t, 2t+1), c2/c3 = (row g+8, the same tokens); rows g / g+8 of tile `tile` are columns
// 4g + 2 tile + 0 / 1. value(mt, tile, c) gives the accumulator to store.
template <int MT, typename Acc, typename Value>
__device__ __forceinline__ void store_fragments(Acc* partial, int warp, int lane, Value value) {
  const int g = lane >> 2, t = lane & 3;
  Acc* mine = partial + warp * (MT * 8 * 32);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int c = 0; c < 4; ++c) mine[(mt * 8 + 2 * t + (c & 1)) * 32 + 4 * g + 2 * tile + (c >> 1)] = value(mt, tile, c);
}

// Above 48 KB of dynamic shared memory a kernel must opt in, per device: once, to the device's
// maximum. One flag set per kernel (the kernel is the template argument). LARGE_CLUSTERS opts in
// to clusters of 9-16 CTAs too (sm_90 allows them, but they are not portable).
template <auto Kernel, bool LARGE_CLUSTERS = false>
cudaError_t opt_in_shared_memory() {
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!opted_in[device]) {
    int max_optin = 0;
    cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attr;  // the limit covers static + dynamic shared memory
    err = cudaFuncGetAttributes(&attr, Kernel);
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               max_optin - (int)attr.sharedSizeBytes);
    if (err != cudaSuccess) return err;
    if constexpr (LARGE_CLUSTERS) {
      err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    opted_in[device] = true;
  }
  return cudaSuccess;
}

