// Shared by the CUDA kernels: cp.async helpers (global -> shared copies that hold no registers) and
// the lane mappings of the skinny kernels' per-warp weight and token streams.
#pragma once
#include <stdint.h>

// Predicated copies: a branch around each copy would cost a reconvergence barrier per step.
// 16 bytes bypass L1 (.cg: weights, read once); 8 bytes go through it (.ca: small, reused data).
__device__ __forceinline__ void cp_async_16(bool pred, uint32_t smem_addr, const void* gmem) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.cg.shared.global.L2::128B [%1], [%2], 16; }"
               ::"r"((int)pred), "r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_8(bool pred, uint32_t smem_addr, const void* gmem) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.ca.shared.global [%1], [%2], 8; }"
               ::"r"((int)pred), "r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }

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
};

