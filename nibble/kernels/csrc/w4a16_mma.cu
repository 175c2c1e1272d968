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
// summed per group in fp32 as R = sum (B + q) x; one extra MMA with an all-ones A gives
// X = sum x. At the end of each group, in fp32:  sum (q s + z) x = s R + (z - B s) X.
// (Doing q * s + z in 16 bits per weight costs 8 more instructions per word, and folding B into
// z in 16 bits would cancel catastrophically; in fp32 the cancellation costs ~2^-14 relative.)
//
// Weights go HBM -> shared memory with cp.async (16 bytes per lane, bypassing L1) through a
// per-warp ring of S stages, so S - 1 loads per warp are in flight without holding registers.
// (Plain loads into a register batch do not work: ptxas sinks each load next to its first use to
// save registers, leaving one load per warp in flight.) Lanes read back pieces other lanes copied,
// so each step starts with cp.async.wait_group (this thread's copies) and __syncwarp (everyone's).
//
// K is split across the warps of a CTA (each owns a contiguous range of 32-deep steps); partial
// sums meet in shared memory and the CTA writes its 32 output columns. N / 32 CTAs; the launcher
// picks warps per CTA so that enough loads are in flight on every SM.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;  // (a & b) | c in one instruction: lut = (0xF0 & 0xCC) | 0xAA
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_8(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr), "l"(gmem));
}
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }

// Per activation type: the raw-code base B (twice, as the lop3 OR constant, and as a float), 1.0
// twice, the MMA's type name and the output conversion.
template <typename T> struct Num;

template <> struct Num<__half> {
  static constexpr uint32_t BASE2 = 0x64006400u;  // 1024, 1024
  static constexpr uint32_t ONE2 = 0x3c003c00u;
  static constexpr float BASE = 1024.f;
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <> struct Num<__nv_bfloat16> {
  static constexpr uint32_t BASE2 = 0x43004300u;  // 128, 128
  static constexpr uint32_t ONE2 = 0x3f803f80u;
  static constexpr float BASE = 128.f;
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// c += A (16 x 16, four registers) * B (16 x 8, two registers), fp32 accumulators
#define NIBBLE_MMA_16816(TYPE)                                                                            \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
      "{%8, %9}, {%0, %1, %2, %3};"                                                                       \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    NIBBLE_MMA_16816("f16");
  } else {
    NIBBLE_MMA_16816("bf16");
  }
}

// word -> raw code pairs (B + q_j, B + q_{j+4}), j = 0..3
template <typename T>
__device__ __forceinline__ void raw_codes(uint32_t w, uint32_t (&r)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = and_or(w >> (4 * j), 0x000f000fu, Num<T>::BASE2);
}

// MT: token tiles of 8 (M <= 8 * MT). S: pipeline stages per warp (S - 1 weight loads in flight).
// Groups are 2^group_shift_steps 32-deep steps (a shift >= 30 means one group per column).
// Launch bounds: a register cap of 128 at four token tiles keeps two CTAs of 8 warps per SM. At one
// tile, a cap of 64 (for 32 warps per SM) made ptxas recompute every address inside the loop: ~210
// instead of ~120 instructions per step, 60 instead of 47 us on 28672 x 8192; 72 registers and 24
// warps per SM win. (Moving the nibble shifts to the FMA pipe as IMAD.HI was slower: 52 us.)
template <typename T, int MT, int S>
__global__ void __launch_bounds__(MT <= 2 ? 512 : 256, MT == 4 ? 2 : 1)
    w4a16_mma_kernel(const T* __restrict__ x, const uint32_t* __restrict__ qweight,
                                 const __half* __restrict__ scales, const __half* __restrict__ zeros,
                                 T* __restrict__ out, int M, int N, int K, int group_shift_steps, int ldx, int ldo) {
  // Per warp and stage (bytes): [0, 512) weights (swizzled rows, see the header); [512, 640) scales
  // (8 B) + zeros (8 B) of the step's group for the 8 column quads (lanes 0-7 copy the scales,
  // 8-15 the zeros: one 64-byte request each); then x, 64 bytes
  // per real token (4 word rows of 16 B), nothing for padding tokens. Everything a step needs is
  // in flight together (x and the group parameters are L2 hits at best; waiting for them inside the
  // step costs a round trip per step), and the ring holds as much weight as it can: at M = 1 the
  // stage is 704 bytes, 73% weights. Reused after the loop as [warps][MT * 8][32] floats.
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile_col = blockIdx.x * 32;
  const int steps = K >> 5;  // step s covers word rows 4s .. 4s+3
  const int s_begin = (int)((long long)steps * warp / warps), s_end = (int)((long long)steps * (warp + 1) / warps);
  const bool one_group = group_shift_steps >= 30;
  const int group_mask = one_group ? -1 : (1 << group_shift_steps) - 1;
  const int m_rows = M < MT * 8 ? M : MT * 8;
  const int stage_bytes = 640 + 64 * m_rows;

  unsigned char* ring = smem + (size_t)warp * S * stage_bytes;
  const uint32_t ring_addr = (uint32_t)__cvta_generic_to_shared(ring);
  const int ring_bytes = S * stage_bytes;
  const size_t step_stride = (size_t)4 * N;
  const int copy_row = lane >> 3, copy_quad = lane & 7;  // the piece this lane copies
  const uint32_t copy_dst = copy_row * 128 + ((copy_quad ^ (2 * copy_row)) & 7) * 16;
  const uint32_t read_src = t * 128 + ((g ^ (2 * t)) & 7) * 16;  // the piece this lane consumes
  // Copy state, advanced step by step (recomputing the addresses of every step cost as many
  // instructions as the dequantization): the next step to copy and where its pieces come from.
  int next = s_begin;
  const uint32_t* wsrc = qweight + (size_t)(4 * s_begin + copy_row) * N + tile_col + 4 * copy_quad;
  const bool copies_sz = lane < 16;  // lanes 0-7: scales, 8-15: zeros
  const uint32_t sz_dst = 512 + copy_quad * 16 + (lane < 8 ? 0 : 8);
  const __half* sz_src = (lane < 8 ? scales : zeros) + tile_col + 4 * copy_quad +
                         (size_t)(one_group ? 0 : s_begin >> group_shift_steps) * N;
  const T* xsrc[MT];
  bool xlive[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m = mt * 8 + g;
    xlive[mt] = m < m_rows;
    xsrc[mt] = x + (size_t)(xlive[mt] ? m : 0) * ldx + t * 8 + 32 * s_begin;
  }
  int fill = 0, drain = 0;  // ring offsets of the stage to copy into next and of the stage to read next
  auto issue = [&]() {
    if (next < s_end) {
      const uint32_t dst = ring_addr + fill;
      cp_async_16(dst + copy_dst, wsrc);
      if (copies_sz) cp_async_8(dst + sz_dst, sz_src);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        if (xlive[mt]) cp_async_16(dst + 640 + ((mt * 8 + g) * 4 + t) * 16, xsrc[mt]);
      wsrc += step_stride;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xsrc[mt] += 32;
      if ((++next & group_mask) == 0) sz_src += N;
    }
    cp_async_commit();
    fill = fill + stage_bytes == ring_bytes ? 0 : fill + stage_bytes;
  };

#pragma unroll
  for (int p = 0; p < S - 1; ++p) issue();

  float acc[MT][2][4], raw[MT][2][4], xsum[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[mt][0][j] = acc[mt][1][j] = raw[mt][0][j] = raw[mt][1][j] = xsum[mt][j] = 0.f;
    }
  const uint32_t ones[4] = {Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2};

  for (int s = s_begin; s < s_end; ++s) {
    __syncwarp();  // every lane has read the stage that is refilled now (last step's)
    issue();
    cp_async_wait<S - 1>();
    __syncwarp();  // the pieces of this step were copied by other lanes
    const unsigned char* here = ring + drain;
    drain = drain + stage_bytes == ring_bytes ? 0 : drain + stage_bytes;
    const uint4 wv = *reinterpret_cast<const uint4*>(here + read_src);
    uint4 xv[MT];  // padding tokens: zero, without reading
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      xv[mt] = xlive[mt] ? *reinterpret_cast<const uint4*>(here + 640 + ((mt * 8 + g) * 4 + t) * 16)
                         : make_uint4(0u, 0u, 0u, 0u);

    uint32_t r[4][4];  // [column c + j][nibble pair]
    raw_codes<T>(wv.x, r[0]);
    raw_codes<T>(wv.y, r[1]);
    raw_codes<T>(wv.z, r[2]);
    raw_codes<T>(wv.w, r[3]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 xr = xv[mt];  // x[m, 8w + 0..7] as pairs (0,1) (2,3) (4,5) (6,7)
      const uint32_t b[2][2] = {{__byte_perm(xr.x, xr.z, 0x5410), __byte_perm(xr.x, xr.z, 0x7632)},
                                {__byte_perm(xr.y, xr.w, 0x5410), __byte_perm(xr.y, xr.w, 0x7632)}};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const uint32_t a[4] = {r[2 * tile][2 * half], r[2 * tile + 1][2 * half], r[2 * tile][2 * half + 1],
                                 r[2 * tile + 1][2 * half + 1]};
          mma<T>(raw[mt][tile], a, b[half][0], b[half][1]);
        }
        mma<T>(xsum[mt], ones, b[half][0], b[half][1]);
      }
    }

    if (((s + 1) & group_mask) == 0 || s + 1 == s_end) {  // group (or this warp's range) ends
      const uint4 sz = *reinterpret_cast<const uint4*>(here + 512 + g * 16);  // scales, zeros of c..c+3
      const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sz.x));
      const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sz.y));
      const float2 z01 = __half22float2(*reinterpret_cast<const __half2*>(&sz.z));
      const float2 z23 = __half22float2(*reinterpret_cast<const __half2*>(&sz.w));
      const float sc[4] = {s01.x, s01.y, s23.x, s23.y};
      const float zc[4] = {z01.x - Num<T>::BASE * s01.x, z01.y - Num<T>::BASE * s01.y,
                           z23.x - Num<T>::BASE * s23.x, z23.y - Num<T>::BASE * s23.y};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
          for (int c = 0; c < 4; ++c) {  // C row g -> column c + 2 tile, row g + 8 -> c + 2 tile + 1
            const int j = 2 * tile + (c >> 1);
            acc[mt][tile][c] = fmaf(sc[j], raw[mt][tile][c], fmaf(zc[j], xsum[mt][c & 1], acc[mt][tile][c]));
            raw[mt][tile][c] = 0.f;
          }
#pragma unroll
        for (int c = 0; c < 4; ++c) xsum[mt][c] = 0.f;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring before the space is reused

  // C fragment: c0/c1 = (row g, tokens 2t, 2t+1), c2/c3 = (row g+8, same tokens); rows g / g+8 of
  // tile `tile` are columns 4g + 2 tile + 0 / 1.
  float* partial = reinterpret_cast<float*>(smem);
  float* mine = partial + warp * (MT * 8 * 32);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        mine[(mt * 8 + 2 * t + (c & 1)) * 32 + 4 * g + 2 * tile + (c >> 1)] = acc[mt][tile][c];
  __syncthreads();
  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += partial[w * (MT * 8 * 32) + i];
    out[(size_t)(i >> 5) * ldo + tile_col + (i & 31)] = Num<T>::from_float(sum);
  }
}

constexpr int kMaxDevices = 64;

size_t smem_bytes(int warps, int mt, int stages, int M) {
  const int m_rows = M < mt * 8 ? M : mt * 8;
  const size_t ring = (size_t)warps * stages * (640 + 64 * m_rows), partial = (size_t)warps * mt * 8 * 32 * sizeof(float);
  return ring > partial ? ring : partial;
}

template <typename T, int MT, int S>
cudaError_t launch_ms(const void* x, const void* qw, const void* s, const void* z, void* out, int M, int N, int K,
                      int group_shift_steps, int ldx, int ldo, int warps, cudaStream_t stream) {
  const size_t smem = smem_bytes(warps, MT, S, M);
  // Above 48 KB a kernel must opt in, per device: once, to the device's maximum.
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!opted_in[device]) {
    int max_optin = 0;
    cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    err = cudaFuncSetAttribute(w4a16_mma_kernel<T, MT, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin);
    if (err != cudaSuccess) return err;
    opted_in[device] = true;
  }
  w4a16_mma_kernel<T, MT, S><<<dim3(N / 32), dim3(warps * 32), smem, stream>>>(
      static_cast<const T*>(x), static_cast<const uint32_t*>(qw), static_cast<const __half*>(s),
      static_cast<const __half*>(z), static_cast<T*>(out), M, N, K, group_shift_steps, ldx, ldo);
  return cudaGetLastError();
}

template <typename T, int MT>
cudaError_t launch_mt(int stages, const void* x, const void* qw, const void* s, const void* z, void* out, int M,
                      int N, int K, int group_shift_steps, int ldx, int ldo, int warps, cudaStream_t stream) {
  switch (stages) {
    case 4: return launch_ms<T, MT, 4>(x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    case 8: return launch_ms<T, MT, 8>(x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch(int mt, int stages, const void* x, const void* qw, const void* s, const void* z, void* out, int M,
                   int N, int K, int group_shift_steps, int ldx, int ldo, int warps, cudaStream_t stream) {
  switch (mt) {
    case 1: return launch_mt<T, 1>(stages, x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    case 2: return launch_mt<T, 2>(stages, x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    case 4: return launch_mt<T, 4>(stages, x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    case 8: return launch_mt<T, 8>(stages, x, qw, s, z, out, M, N, K, group_shift_steps, ldx, ldo, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Host entry point (called through ctypes). Preconditions are checked by the Python caller:
// N % 32 == 0, K % 32 == 0, M <= 8 * mt, 16-byte aligned x rows (ldx % 8 == 0), group = 32 * 2^group_shift_steps
// (or one group per column: group_shift_steps >= 30), 1 <= warps <= 32, mt in {1, 2, 4, 8}, stages in {4, 8}.
extern "C" int nibble_w4a16_mma(int is_bf16, int mt, int stages, int warps, const void* x, const void* qweight,
                                const void* scales, const void* zeros, void* out, int M, int N, int K,
                                int group_shift_steps, int ldx, int ldo, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = is_bf16 ? launch<__nv_bfloat16>(mt, stages, x, qweight, scales, zeros, out, M, N, K, group_shift_steps,
                                                    ldx, ldo, warps, st)
                            : launch<__half>(mt, stages, x, qweight, scales, zeros, out, M, N, K, group_shift_steps, ldx,
                                             ldo, warps, st);
  return (int)err;
}

extern "C" const char* nibble_cuda_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
