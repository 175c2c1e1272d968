"""W4A4 at 17-128 tokens: can the Hopper GEMM's CTAs share an SM with the activation quantization?

The op launches the quantization, then the product early (early_launch.py): the product's producer
copies its first weight stages while the quantization runs, but only on an SM with room for a whole
CTA. The shipped build asks for every register of the SM (384 threads x 168, then 40 for the
producer warpgroup and 232 for the consumers: `setmaxnreg`), so its CTAs wait for the quantization's
CTAs (one per row: 128 of the 132 SMs at 128 tokens) to leave. The "lean" build asks for 128
registers a thread (consumers grown to 168), which leaves 16K registers an SM: the quantization of
4096-wide rows (16 warps x 28 registers) fits beside it. Timed, shipped against lean, in one process:
the GEMM alone (`wgmma_ab.time_builds`, outputs equal) and the op (quantize + GEMM, `w4a4_linear`),
CUDA graphs, weights rotated past the L2, builds in A, B, B, A order.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_lean_registers.py --build-only .exp/lean
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_lean_registers.py --prebuilt .exp/lean --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import build_variants, time_product_and_op, variants_main  # noqa: E402

VARIANT_EDITS = {"lean": [
    ("__global__ void __launch_bounds__(THREADS, 1)\n    w4a4_wgmma_kernel(",
     "__global__ void __maxnreg__(128)\n    w4a4_wgmma_kernel("),
    ('asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");', 'asm volatile("setmaxnreg.inc.sync.aligned.u32 168;");'),
]}


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS), partial(time_product_and_op, names=VARIANT_EDITS),
                  "64,128", dict(variants=list(VARIANT_EDITS)))
