"""What would a grid-wide barrier cost W4A4's Hopper GEMM at up to 128 tokens? The op (quantize +
product) runs two kernels: the product's x copies wait for the whole quantization kernel to end
(its last row, its exit, the early-launch hand-off), 1.2-2.4 us of the op at 128 tokens (H200,
session 32). A product that quantized x itself would have every CTA quantize a few rows, meet the
others at a grid-wide barrier (its CTAs are all resident: one wave, persistent or one cluster per
tile), then copy x. This prices the barrier alone.

Variant "gridbar": the producer thread of each CTA, after its wait for the previous grid and before
its first copies of x, arrives on a counter in global memory (atom.add.acq_rel.gpu) and spins until
the last CTA of the grid bumps a generation word (st.release.gpu; the counter reset before it), so
no copy of x starts before every CTA has arrived. Exact (no data changes). Timed against the
shipped build in one process: the GEMM back to back (`wgmma_ab.time_builds`) and the op
(`wgmma_ab.time_ops`). Only grids that are resident at once (M <= 128 here) may run it.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_grid_barrier.py --build-only .exp/gridbar
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_grid_barrier.py --prebuilt .exp/gridbar --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import build_variants, time_product_and_op, variants_main  # noqa: E402

BARRIER = r'''
__device__ unsigned int grid_arrivals;
__device__ unsigned int grid_generation;

// One thread per CTA: every CTA of the grid has arrived when this returns (all resident at once).
__device__ __forceinline__ void grid_barrier() {
  const unsigned int total = gridDim.x * gridDim.y * gridDim.z;
  unsigned int gen, arrived;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(gen) : "l"(&grid_generation) : "memory");
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(&grid_arrivals) : "memory");
  if (arrived == total - 1) {
    asm volatile("st.relaxed.gpu.u32 [%0], 0;" ::"l"(&grid_arrivals) : "memory");
    asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(&grid_generation), "r"(gen + 1) : "memory");
  } else {
    unsigned int now;
    do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(&grid_generation) : "memory");
    while (now == gen);
  }
}

'''
PRODUCE = "template <int STAGES, typename LoadW, typename LoadX>\n__device__ __forceinline__ void produce("
VARIANT_EDITS = {"gridbar": []}
HEADER_EDITS = {"hopper.cuh": [
    (PRODUCE, BARRIER + PRODUCE),
    ("  if (first == 0) wait_for_prior_grids();\n",
     "  if (first == 0) {\n    wait_for_prior_grids();\n    grid_barrier();\n  }\n")]}


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS, header_edits=HEADER_EDITS),
                  partial(time_product_and_op, names=VARIANT_EDITS), "128,64",
                  dict(variants=list(VARIANT_EDITS)))
