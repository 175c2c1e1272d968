// Appended to csrc/w4a16_mma.cu by benchmarks/scripts/w4a16_spread.py (an experiment, not shipped;
// benchmarks/notes-w4a16.md, session 35): the skinny kernel's loop, spread over a few CTAs per SM.
// The script also removes the CTA barrier at the end of skinny.cuh's run_pipeline (a warp here runs
// one or two pipelines, so CTA barriers inside them would not pair up) and puts it back after the
// pipeline of w4a16_mma_kernel, whose SASS is then the shipped one's. The segment below repeats that
// kernel's issue and step lambdas on purpose: the shipped kernel factored into segments that both
// kernels call (tried first) spilled 12 bytes inside its full-round loop at 64 registers (ptxas, sm_90),
// and the shipped kernel's code is what the comparison must keep.
namespace {

// A spread launch (one token tile) runs a few CTAs per SM instead of one CTA per 32-column
// block. At one token an SM streams at about its share of HBM and no faster, so a grid of one CTA per
// block takes as long as the SMs that hold the most blocks: Llama-2-7B's gate/up (688 blocks) puts 6
// on 28 SMs and 5 on the rest, 11008 x 4096 (344) 3 on 80 and 2 on 52 (benchmarks/notes-w4a16.md,
// sessions 18 and 32). Here the groups of all blocks, block after block, are cut into gridDim.x equal
// ranges, one a CTA, and each CTA's range into equal ranges of whole groups, one a warp. A warp's range
// crosses at most one block boundary (the host sees to it), so a warp runs one or two segments, each
// the same pipeline as a CTA of the unspread kernel, and leaves each segment's sums in its own slot
// of shared memory. A block inside the CTA's range is summed and stored; a block cut by a CTA
// boundary has exactly two contributors (no CTA range is shorter than a block), which meet through
// `slots`: each swaps (1, its fp32 sum) into the boundary's 64-bit slot with one atomic; the one that
// finds the other's sum there adds the two (fp32 addition is commutative, so the result does not
// depend on who came second), stores the output and zeroes the slot for the next launch. No CTA waits
// for another, and no fence is needed: the value travels inside the atomic.
struct Spread {
  int blocks;                  // 32-column blocks of the launch (all weights)
  int per_cta, extra;          // its groups / gridDim.x and % gridDim.x (no 64-bit division in the kernel)
  unsigned long long* slots;   // [gridDim.x - 1 boundaries][MT * 8 tokens][32 columns], zero between launches
};

// skinny.cuh's cta_weight for any block, not only blockIdx.x.
template <bool MANY>
__device__ __forceinline__ int spread_block_weight(const int (&cta_end)[MAX_WEIGHTS], unsigned block, int& tile_col) {
  if constexpr (!MANY) {
    tile_col = block * 32;
    return 0;
  }
  const int which = (block >= cta_end[0]) + (block >= cta_end[1]);
  tile_col = (block - (which ? pick(cta_end, which - 1) : 0)) * 32;
  return which;
}

template <typename T, int MT, int GS, bool MANY, bool X_L1>
__global__ void __launch_bounds__(512, 2)
    w4a16_mma_spread_kernel(const T* __restrict__ x, const Weights<T> weights, int M, int K, int group_shift_steps,
                            int ldx, int trigger, const Spread spread) {
  // The stages are w4a16_mma_kernel's; behind the rings, each warp's two segment slots.
  constexpr int STAGE = 640 + 512 * MT, SZ = 512, XS = 640, GSTEP = GS ? GS : 1, TILE = MT * 8 * 32;
  static_assert(MT == 1, "spread launches are built for one token tile");
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // the lane's column quad (its MMA rows g, g + 8)
  const int steps = K >> 5;  // step s covers word rows 4s .. 4s+3
  // Warps own contiguous ranges of whole groups (any split when there is one group per column),
  // so a group never straddles two warps and a range always ends a group.
  const bool one_group = group_shift_steps >= 30;
  const int unit_shift = one_group ? 0 : group_shift_steps, units = steps >> unit_shift;
  const int group_steps = one_group ? steps : 1 << group_shift_steps;
  const int m_rows = M < MT * 8 ? M : MT * 8;

  unsigned char* ring = smem + (size_t)warp * RING * STAGE;
  const uint32_t ring_addr = (uint32_t)__cvta_generic_to_shared(ring);

  // Steps [s_begin, s_end) (whole groups) of block `block`, their sums handed to done(acc). The first
  // segment of a warp prefetches, waits for the previous kernel and lets the next one launch.
  auto segment = [&](int block, int s_begin, int s_end, bool first, auto done) {
    int tile_col;
    const int which = spread_block_weight<MANY>(weights.cta_end, block, tile_col);
    const uint32_t* __restrict__ qweight = pick(weights.qweight, which);
    const __half* __restrict__ scales = pick(weights.scales, which);
    const __half* __restrict__ zeros = pick(weights.zeros, which);
    const int N = pick(weights.n, which);
    // Copy state, advanced as steps are issued (recomputing the addresses of every step cost as
    // many instructions as the dequantization).
    WeightStream ws(ring_addr, lane, qweight, N, s_begin, tile_col);
    const bool copies_sz = lane < 16;  // lanes 0-7: scales, 8-15: zeros
    const uint32_t sz_dst = ring_addr + SZ + ws.copy_quad * 16 + (lane < 8 ? 0 : 8);
    const __half* sz_src = (lane < 8 ? scales : zeros) + tile_col + 4 * ws.copy_quad +
                           (size_t)(one_group ? 0 : s_begin >> group_shift_steps) * N;
    const int sz_stride = one_group ? 0 : N;
    if (first) {
      ws.prefetch<RING>(s_begin, s_end);
      prefetch_l2(copies_sz, sz_src);
      wait_for_prior_grids();  // x is the previous kernel's output
    }
    // GS == 0 only: the first step past the current group, for the copies and for the reads
    int issue_group_end = min(s_begin + group_steps, s_end), read_group_end = issue_group_end;
    TokenStream<T, uint4, MT> xstream(x, ldx, m_rows, lane, s_begin, ring + XS, STAGE, RING);
    if (first) let_successor_launch(trigger);  // after the wait: at most two grids in flight (skinny.cuh)

    // Copy step j into `stage` (run_pipeline's contract); a group's scales and zeros ride with its
    // last step.
    auto issue = [&](int stage, int j, int ahead, bool live) {
      const bool closes = GS ? (stage + 1) % GSTEP == 0 : j + 1 == issue_group_end;
      cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);
      cp_async_8(live && closes && copies_sz, sz_dst + stage * STAGE, sz_src);
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
      raw_codes<T>(wv.x, r[0]);
      raw_codes<T>(wv.y, r[1]);
      raw_codes<T>(wv.z, r[2]);
      raw_codes<T>(wv.w, r[3]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)  // a group's first step starts its sums from zero
        step_mmas<T>(raw[mt], xsum[mt], r, *reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)),
                     GS && i % GSTEP == 0);

      if (GS ? (i + 1) % GSTEP == 0 : s + 1 == read_group_end) {  // the group closes; its parameters came with this step
        if (!GS) read_group_end += group_steps;
        const uint4 sz = *reinterpret_cast<const uint4*>(here + SZ + g * 16);  // scales, zeros of c..c+3
        const GroupFold<T> fold(make_uint2(sz.x, sz.y), make_uint2(sz.z, sz.w));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fold(acc[mt], raw[mt], xsum[mt]);
          if (!GS)
#pragma unroll
            for (int c = 0; c < 4; ++c) raw[mt][0][c] = raw[mt][1][c] = xsum[mt][c] = 0.f;
        }
      }
    };
    run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });
    asm volatile("bar.warp.sync -1;" ::: "memory");  // the ring is free for the next segment
    done(acc);
  };

  {
    // Behind the rings: each warp's two segment slots [warps][2][TILE] and their blocks [warps][2].
    float* parts = reinterpret_cast<float*>(smem + (size_t)warps * RING * STAGE);
    int* part_block = reinterpret_cast<int*>(parts + warps * 2 * TILE);
    // This CTA's units (groups of the launch, block after block), then this warp's share of them
    const int cta = blockIdx.x, length = spread.per_cta + (cta < spread.extra);
    const int cta_begin = cta * spread.per_cta + min(cta, spread.extra), cta_end = cta_begin + length;
    const int u_begin = cta_begin + length * warp / warps, u_end = cta_begin + length * (warp + 1) / warps;
    if (lane < 2) part_block[2 * warp + lane] = -1;
    {  // the second segment's first steps into the L2 now: its pipeline then starts on L2 hits
      const int block = u_begin / units + 1, s = 0;
      if (u_begin < u_end && block * units < u_end) {
        int tile_col;
        const int which = spread_block_weight<MANY>(weights.cta_end, block, tile_col);
        WeightStream(ring_addr, lane, pick(weights.qweight, which), pick(weights.n, which), s, tile_col)
            .prefetch<RING>(s, (u_end - block * units) << unit_shift);
      }
    }
    for (int u = u_begin, seg = 0; u < u_end; ++seg) {
      const int block = u / units, stop = min(u_end, (block + 1) * units);
      segment(block, (u - block * units) << unit_shift, (stop - block * units) << unit_shift, seg == 0,
              [&](const float (&acc)[MT][2][4]) {
                store_fragments<MT>(parts + seg * TILE, 2 * warp, lane,
                                    [&](int mt, int tile, int c) { return acc[mt][tile][c]; });
              });
      if (lane == 0) part_block[2 * warp + seg] = block;
      u = stop;
    }
    __syncthreads();
    const int first_block = cta_begin / units, last_block = (cta_end - 1) / units;
    for (int block = first_block; block <= last_block; ++block) {
      int tile_col;
      const int which = spread_block_weight<MANY>(weights.cta_end, block, tile_col);
      T* __restrict__ out = pick(weights.out, which);
      const int ldo = pick(weights.ldo, which);
      // The CTA before or after holds the rest of a block this range cuts (one of them: no range
      // is shorter than a block); the boundary between the two names their slot.
      const bool cut_before = block * units < cta_begin, cut_after = (block + 1) * units > cta_end;
      for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
        float sum = 0.f;
        for (int p = 0; p < 2 * warps; ++p)
          if (part_block[p] == block) sum += parts[p * TILE + i];
        T* dst = out + (size_t)(i >> 5) * ldo + tile_col + (i & 31);
        if (!cut_before && !cut_after) {
          *dst = Num<T>::from_float(sum);
          continue;
        }
        unsigned long long* slot = spread.slots + (size_t)(blockIdx.x - cut_before) * TILE + i;
        const unsigned long long other = atomicExch(slot, (1ull << 32) | __float_as_uint(sum));
        if (other >> 32) {
          *dst = Num<T>::from_float(sum + __uint_as_float((uint32_t)other));
          *slot = 0ull;
        }
      }
    }
  }
}

template <typename T, int GS, bool MANY, bool X_L1>
cudaError_t launch_spread(const T* x, const Weights<T>& w, int ctas, const Spread& spread, int M, int K,
                          int group_shift_steps, int ldx, int warps, cudaStream_t stream, bool pdl, int successor) {
  constexpr auto kernel = w4a16_mma_spread_kernel<T, 1, GS, MANY, X_L1>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  int trigger = 0;
  size_t smem = smem_bytes(warps, 1) + (size_t)warps * 2 * (256 * sizeof(float) + sizeof(int));  // + segment slots
  if ((err = successor_smem<kernel>(successor, pdl, ctas, warps * 32, smem, trigger)) != cudaSuccess) return err;
  return launch_kernel(kernel, ctas, warps * 32, smem, stream, pdl, x, w, M, K, group_shift_steps, ldx, trigger, spread);
}

template <typename T, bool MANY, bool X_L1>
cudaError_t launch_spread_gs(const T* x, const Weights<T>& w, int ctas, const Spread& spread, int M, int K,
                             int group_shift_steps, int ldx, int warps, cudaStream_t stream, bool pdl, int successor) {
  switch (group_shift_steps) {
    case 0: return launch_spread<T, 1, MANY, X_L1>(x, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
    case 1: return launch_spread<T, 2, MANY, X_L1>(x, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
    case 2: return launch_spread<T, 4, MANY, X_L1>(x, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
    default: return launch_spread<T, 0, MANY, X_L1>(x, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
  }
}

template <typename T>
cudaError_t launch_spread_all(int warps, bool x_l1, const void* x, int M, int K, int group_shift_steps, int ldx, int count,
                              const void* const* qweights, const void* const* scales, const void* const* zeros,
                              void* const* outs, const int* ns, const int* ldos, int ctas, void* slots,
                              cudaStream_t stream, bool pdl, int successor) {
  if (count < 1 || count > MAX_WEIGHTS || M > 8 || ctas < 1 || !slots) return cudaErrorInvalidValue;
  Weights<T> w{};
  for (int i = 0; i < count; ++i) {
    w.qweight[i] = static_cast<const uint32_t*>(qweights[i]);
    w.scales[i] = static_cast<const __half*>(scales[i]);
    w.zeros[i] = static_cast<const __half*>(zeros[i]);
    w.out[i] = static_cast<T*>(outs[i]);
    w.n[i] = ns[i];
    w.ldo[i] = ldos[i];
  }
  const int blocks = running_ends(count, ns, 32, w.cta_end);
  const long long units = (long long)(K >> 5) >> (group_shift_steps >= 30 ? 0 : group_shift_steps);
  const long long most_per_warp = ((units * blocks + ctas - 1) / ctas + warps - 1) / warps;
  if (ctas > blocks || most_per_warp > units) return cudaErrorInvalidValue;  // see Spread
  const Spread spread{blocks, (int)(units * blocks / ctas), (int)(units * blocks % ctas),
                      static_cast<unsigned long long*>(slots)};
  const T* xt = static_cast<const T*>(x);
  if (count > 1)
    return x_l1 ? launch_spread_gs<T, true, true>(xt, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor)
                : launch_spread_gs<T, true, false>(xt, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
  return x_l1 ? launch_spread_gs<T, false, true>(xt, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor)
              : launch_spread_gs<T, false, false>(xt, w, ctas, spread, M, K, group_shift_steps, ldx, warps, stream, pdl, successor);
}

}  // namespace

// nibble_w4a16_mma's arguments for one token tile, plus the grid (`ctas`) and its zeroed exchange slots
// (8 bytes x 256 per CTA).
extern "C" int nibble_w4a16_mma_spread(int is_bf16, int warps, int x_l1, const void* x, int M, int K, int group_shift_steps,
                                       int ldx, int count, const void* const* qweights, const void* const* scales,
                                       const void* const* zeros, void* const* outs, const int* ns, const int* ldos,
                                       int ctas, void* slots, int pdl, int successor, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return (int)(is_bf16 ? launch_spread_all<__nv_bfloat16>(warps, x_l1 != 0, x, M, K, group_shift_steps, ldx, count, qweights,
                                                          scales, zeros, outs, ns, ldos, ctas, slots, st, pdl, successor)
                       : launch_spread_all<__half>(warps, x_l1 != 0, x, M, K, group_shift_steps, ldx, count, qweights, scales,
                                                   zeros, outs, ns, ldos, ctas, slots, st, pdl, successor));
}
