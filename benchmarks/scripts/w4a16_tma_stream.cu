// An experiment (benchmarks/scripts/w4a16_tma_stream.py appends this to csrc/w4a16_mma.cu, whose
// helpers it uses, and builds it for sm_90): the W4A16 skinny product with the weight streamed by
// TMA. Measured on the H200 0.59-0.81x the speed of the shipped cp.async kernel at M = 1, and
// 0.72-0.81x with every warp its own producer (benchmarks/notes-w4a16.md, sessions 19 and 20); not
// part of the package.
#ifndef NIBBLE_TMA_COPY_ONLY
#define NIBBLE_TMA_COPY_ONLY 0
#endif
#ifndef NIBBLE_TMA_SELF_FED
#define NIBBLE_TMA_SELF_FED 0
#endif
namespace {
constexpr bool COPY_ONLY = NIBBLE_TMA_COPY_ONLY;  // consumers wait for each chunk and release it, no arithmetic
// No producer warp: lane 0 of every warp copies its own chunks into its own stages and refills a
// stage as soon as the warp has read it (no "empty" barriers). Every warp is a consumer, so the
// arithmetic has as many warps as the shipped kernel's, and each keeps stages / consumers chunks in
// flight instead of the shipped kernel's 2 steps.
constexpr bool SELF_FED = NIBBLE_TMA_SELF_FED;

// One producer warp per CTA, one lane of it copying whole chunks of CR word rows (CR * 8 deep: the
// weight's CR rows x 32 columns as one box, the chunk's x rows, its groups' scales and zeros) into
// a CTA-wide ring of mbarrier-guarded stages; consumer warp w takes chunks w, w + consumers, ... and
// releases each stage when done. No copy costs a consumer lane an instruction or a register, and
// the ring holds `stages` chunks in flight per CTA. (The shipped kernel keeps 2 steps of 512 bytes
// in flight per warp: at ~1 us of loaded latency ~12 bytes a cycle per SM with 24 warps, under an
// SM's share of HBM.)
// Stage layout (TmaLayout): the weight box in the 128-byte swizzle (16-byte chunk c of row r at
// c ^ (r % 8)), x boxes of up to 256 elements per token row (rows past M neither written nor read),
// the chunk's scale rows, its zero rows (one row for groups of more than 8 CR: a chunk then folds
// its part of its group, which is linear). Past K and N the TMA zero-fills: zero words are raw
// codes B, times zero x, and zero scales fold nothing.
// K order: step i of a chunk reads word row R(i, t) with lane (g, t) reading quad g: under the
// swizzle rows {0, 2, 4, 6} (+1, +8) put the 8 lanes of a phase on 8 distinct bank groups. Groups
// of 32 need a step's 4 rows inside one group: rows 4i + t there (a 2-way conflict).
template <typename T>
struct TmaWeights {
  CUtensorMap qweight[MAX_WEIGHTS], scales[MAX_WEIGHTS], zeros[MAX_WEIGHTS], x;
  T* out[MAX_WEIGHTS];
  int ldo[MAX_WEIGHTS], cta_end[MAX_WEIGHTS];
};

// A stage's layout (bytes, worked out on the host): the weight box of CR word rows at 0, x at
// W = 128 CR (per x box of XR word rows: m_rows token rows of 16 XR bytes), sz_rows scale rows at
// sz, as many zero rows at zs; stages `stage` bytes apart (a multiple of 1024).
struct TmaLayout {
  int stage, sz, zs, sz_rows, m_rows, group_log2;  // group_log2 >= 30: one group per column
};

// Chunk c's stage: consumer c % consumers owns stages c % consumers + consumers * j, used in turn, so
// it waits on each of its stages' fills in order and released the one before itself (a parity
// wait cannot tell fill p + 1 from fill p - 1). stages is a multiple of consumers; chunk c is then
// fill c / stages of its stage.
__device__ __forceinline__ int ring_stage(int c, int consumers, int stages) {
  return c % consumers + consumers * ((c / consumers) % (stages / consumers));
}

template <typename T, int MT, int GS, int CR, bool MANY>
__global__ void __launch_bounds__(SELF_FED ? 512 : 32 * 9, MT == 1 ? (SELF_FED ? 2 : 3) : 1)
    w4a16_tma_kernel(const __grid_constant__ TmaWeights<T> weights, int K, int stages, TmaLayout lay) {
#if __CUDA_ARCH__ >= 900
  constexpr int NS = CR / 4, XR = CR < 32 ? CR : 32, W = 128 * CR;  // steps per chunk, word rows per x box
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t base = (smem_addr + 1023) & ~1023u;  // the swizzle's period
  unsigned char* ring = smem + (base - smem_addr);
  const uint32_t full = base + stages * lay.stage, empty = full + 8 * stages;
  const int consumers = (blockDim.x >> 5) - (SELF_FED ? 0 : 1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (K + 8 * CR - 1) / (8 * CR);
  const int m_rows = lay.m_rows, x_box = m_rows * 16 * XR;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[mt][0][j] = acc[mt][1][j] = 0.f;

  int tile_col;
  const int which = cta_weight<MANY>(weights.cta_end, tile_col);
  const CUtensorMap* qmap = pick_address(weights.qweight, which);
  const CUtensorMap* smap = pick_address(weights.scales, which);
  const CUtensorMap* zmap = pick_address(weights.zeros, which);
  const int bytes = W + 16 * CR * m_rows + 128 * lay.sz_rows;
  auto load_w = [&](uint32_t dst, int c, uint32_t bar) {
    // the chunk's first group row
    const int row = lay.group_log2 >= 30 ? 0 : lay.group_log2 <= 7 ? c * lay.sz_rows : (8 * CR * c) >> lay.group_log2;
    tma_load(dst, qmap, tile_col, CR * c, bar);
    tma_load(dst + lay.sz, smap, tile_col, row, bar);
    tma_load(dst + lay.zs, zmap, tile_col, row, bar);
  };
  auto load_x = [&](uint32_t dst, int c, uint32_t bar) {
#pragma unroll
    for (int b = 0; b < CR / XR; ++b) tma_load(dst + W + b * x_box, &weights.x, 8 * (CR * c + XR * b), 0, bar);
  };
  if (SELF_FED && lane == 0) {  // this warp's first stages: the weights now, x once the previous kernel is done
    for (int c = warp; c < min(stages, chunks); c += consumers) {
      const int s = ring_stage(c, consumers, stages);
      mbar_expect_tx(full + 8 * s, bytes);
      load_w(base + s * lay.stage, c, full + 8 * s);
    }
    wait_for_prior_grids();
    for (int c = warp; c < min(stages, chunks); c += consumers) {
      const int s = ring_stage(c, consumers, stages);
      load_x(base + s * lay.stage, c, full + 8 * s);
    }
  }
  if (!SELF_FED && warp == consumers) {  // the producer
    if (lane == 0) {
#ifdef NIBBLE_TMA_PREFETCH
      asm volatile("prefetch.tensormap [%0];" ::"l"(qmap) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(smap) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(zmap) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&weights.x) : "memory");
#endif
      const int early = min(stages, chunks);
      for (int c = 0; c < early; ++c) {
        mbar_expect_tx(full + 8 * c, bytes);
        load_w(base + c * lay.stage, c, full + 8 * c);
      }
      wait_for_prior_grids();  // x is the previous kernel's output
      for (int c = 0; c < early; ++c) load_x(base + c * lay.stage, c, full + 8 * c);
      for (int c = early; c < chunks; ++c) {
        const int s = ring_stage(c, consumers, stages);
        mbar_wait(empty + 8 * s, (c / stages - 1) & 1);
        mbar_expect_tx(full + 8 * s, bytes);
        load_w(base + s * lay.stage, c, full + 8 * s);
        load_x(base + s * lay.stage, c, full + 8 * s);
      }
    }
    __syncwarp();
  } else {
    const int g = lane >> 2, t = lane & 3;
    float raw[MT][2][4], xsum[MT][4];
    for (int c = warp; c < chunks; c += consumers) {
      const int s = ring_stage(c, consumers, stages);
      mbar_wait(full + 8 * s, (c / stages) & 1);
      const unsigned char* here = ring + s * lay.stage;
#pragma unroll
      for (int i = 0; i < (COPY_ONLY ? 0 : NS); ++i) {
        const int r = GS == 1 ? 4 * i + t : 8 * (i >> 1) + (i & 1) + 2 * t;
        const int xb = (GS == 1 ? 4 * i : 8 * (i >> 1)) / XR;  // r's x box, known at compile time
        const Vec<uint32_t, 4> wv = swizzled_words<4>(here, 0, 16 * g, r);
        uint32_t q[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) raw_codes<T>(wv.v[j], q[j]);
        const bool fresh = i % GS == 0;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint4 xr = make_uint4(0, 0, 0, 0);
          if (8 * mt + g < m_rows)
            xr = *reinterpret_cast<const uint4*>(here + W + xb * x_box + (8 * mt + g) * 16 * XR + 16 * (r % XR));
          step_mmas<T>(raw[mt], xsum[mt], q, xr, fresh);
        }
        if ((i + 1) % GS == 0) {  // a group (or the chunk's part of one) closes
          const int row = min(i / GS, lay.sz_rows - 1);
          const GroupFold<T> fold(*reinterpret_cast<const uint2*>(here + lay.sz + 64 * row + 8 * g),
                                  *reinterpret_cast<const uint2*>(here + lay.zs + 64 * row + 8 * g));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) fold(acc[mt], raw[mt], xsum[mt]);
        }
      }
      __syncwarp();
      if (!SELF_FED) {
        if (lane == 0) mbar_arrive(empty + 8 * s);
      } else if (lane == 0 && c + stages < chunks) {  // the stage's next fill: chunk c + stages
        // the warp's reads of the stage (generic proxy) before the TMA's writes (async proxy)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_expect_tx(full + 8 * s, bytes);
        load_w(base + s * lay.stage, c + stages, full + 8 * s);
        load_x(base + s * lay.stage, c + stages, full + 8 * s);
      }
    }
  }
  __syncthreads();  // every chunk consumed: the ring is free for the cross-warp sums
  float* partial = reinterpret_cast<float*>(ring);
  if (warp < consumers)
    store_fragments<MT>(partial, warp, lane, [&](int mt, int tile, int c) { return acc[mt][tile][c]; });
  __syncthreads();
  const int out_weight = cta_weight<MANY>(weights.cta_end, tile_col);
  T* __restrict__ out = pick(weights.out, out_weight);
  const int ldo = pick(weights.ldo, out_weight);
  wait_for_prior_grids();
  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < consumers; ++w) sum += partial[w * (MT * 8 * 32) + i];
    out[(size_t)(i >> 5) * ldo + tile_col + (i & 31)] = Num<T>::from_float(sum);
  }
#else
  __trap();  // sm_90 only (TMA); the launcher refuses other devices
#endif
}

template <typename T, int MT, int GS, int CR, bool MANY>
cudaError_t launch_tma_gs(const TmaWeights<T>& w, int ctas, int K, int consumers, int stages, TmaLayout lay,
                          cudaStream_t stream, bool pdl) {
  const cudaError_t err = opt_in_shared_memory<w4a16_tma_kernel<T, MT, GS, CR, MANY>>();
  if (err != cudaSuccess) return err;
  const size_t ring = (size_t)stages * lay.stage, partial = (size_t)consumers * MT * 8 * 32 * 4;
  const size_t smem = (ring > partial ? ring : partial) + 1024 + 16 * stages;
  return launch_kernel(w4a16_tma_kernel<T, MT, GS, CR, MANY>, ctas, 32 * (consumers + !SELF_FED), smem, stream, pdl, w, K,
                       stages, lay);
}

template <typename T, int MT, int CR>
cudaError_t launch_tma_mt(const TmaWeights<T>& w, bool many, int ctas, int K, int group_shift_steps, int consumers,
                          int stages, TmaLayout lay, cudaStream_t stream, bool pdl) {
#define NIBBLE_TMA_GS(GS) \
  (many ? launch_tma_gs<T, MT, GS, CR, true>(w, ctas, K, consumers, stages, lay, stream, pdl) \
        : launch_tma_gs<T, MT, GS, CR, false>(w, ctas, K, consumers, stages, lay, stream, pdl))
  switch (group_shift_steps) {
    case 0: return NIBBLE_TMA_GS(1);
    case 1: return NIBBLE_TMA_GS(2);
    default: return NIBBLE_TMA_GS(4);
  }
#undef NIBBLE_TMA_GS
}

template <typename T>
cudaError_t launch_tma(int mt, int chunk_rows, int consumers, int stages, const void* x, int M, int K,
                       int group_shift_steps, int ldx, int count, const void* const* qweights,
                       const void* const* scales, const void* const* zeros, void* const* outs, const int* ns,
                       const int* ldos, cudaStream_t stream, bool pdl) {
  if (count < 1 || count > MAX_WEIGHTS || consumers < 1 || consumers > (SELF_FED ? 16 : 8) || stages % consumers ||
      (chunk_rows != 16 && chunk_rows != 32 && chunk_rows != 64) || (mt != 1 && mt != 2))
    return cudaErrorInvalidValue;
  TmaLayout lay;
  const int CR = chunk_rows, xr = CR < 32 ? CR : 32;
  lay.m_rows = M < 8 * mt ? M : 8 * mt;
  lay.group_log2 = group_shift_steps >= 30 ? 30 : 5 + group_shift_steps;
  lay.sz_rows = lay.group_log2 <= 7 ? 8 * CR >> lay.group_log2 : 1;
  lay.sz = 128 * CR + 16 * CR * lay.m_rows;
  lay.zs = lay.sz + (64 * lay.sz_rows + 127) / 128 * 128;
  lay.stage = (lay.zs + 64 * lay.sz_rows + 1023) / 1024 * 1024;
  TmaWeights<T> w{};
  const int group_rows = group_shift_steps >= 30 ? 1 : K >> (5 + group_shift_steps);
  constexpr bool HALF = std::is_same_v<T, __half>;
  cudaError_t err = tensor_map_2d(&w.x, HALF ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                  x, K, M, (uint64_t)ldx * 2, 8 * xr, lay.m_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
  for (int i = 0; i < count && err == cudaSuccess; ++i) {
    err = tensor_map_2d(&w.qweight[i], CU_TENSOR_MAP_DATA_TYPE_INT32, qweights[i], ns[i], K / 8, (uint64_t)ns[i] * 4,
                        32, CR);
    if (err == cudaSuccess)
      err = tensor_map_2d(&w.scales[i], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, scales[i], ns[i], group_rows,
                          (uint64_t)ns[i] * 2, 32, lay.sz_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
    if (err == cudaSuccess)
      err = tensor_map_2d(&w.zeros[i], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, zeros[i], ns[i], group_rows,
                          (uint64_t)ns[i] * 2, 32, lay.sz_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
    w.out[i] = static_cast<T*>(outs[i]);
    w.ldo[i] = ldos[i];
  }
  if (err != cudaSuccess) return err;
  const int ctas = running_ends(count, ns, 32, w.cta_end);
  const bool many = count > 1;
#define NIBBLE_TMA_MT(MT, CR) launch_tma_mt<T, MT, CR>(w, many, ctas, K, group_shift_steps, consumers, stages, lay, stream, pdl)
  if (mt == 1) return CR == 16 ? NIBBLE_TMA_MT(1, 16) : CR == 32 ? NIBBLE_TMA_MT(1, 32) : NIBBLE_TMA_MT(1, 64);
  return CR == 16 ? NIBBLE_TMA_MT(2, 16) : CR == 32 ? NIBBLE_TMA_MT(2, 32) : NIBBLE_TMA_MT(2, 64);
#undef NIBBLE_TMA_MT
}

}  // namespace

// The TMA-fed kernel (sm_90; same preconditions, mt in {1, 2}, chunks of 16, 32 or 64 word rows,
// 1 <= consumers <= 8 warps, `stages` >= consumers chunks in flight per CTA).
extern "C" int nibble_w4a16_tma(int is_bf16, int mt, int chunk_rows, int consumers, int stages, const void* x, int M,
                                int K, int group_shift_steps, int ldx, int count, const void* const* qweights,
                                const void* const* scales, const void* const* zeros, void* const* outs,
                                const int* ns, const int* ldos, int pdl, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = is_bf16 ? launch_tma<__nv_bfloat16>(mt, chunk_rows, consumers, stages, x, M, K, group_shift_steps,
                                                        ldx, count, qweights, scales, zeros, outs, ns, ldos, st, pdl)
                            : launch_tma<__half>(mt, chunk_rows, consumers, stages, x, M, K, group_shift_steps, ldx,
                                                 count, qweights, scales, zeros, outs, ns, ldos, st, pdl);
  return (int)err;
}
