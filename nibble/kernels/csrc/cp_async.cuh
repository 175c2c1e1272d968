// cp.async helpers shared by the CUDA kernels (global -> shared copies that hold no registers).
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
