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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.kernels import cuda_build  # noqa: E402
from wgmma_ab import SHAPES, time_builds, time_ops, variant_builds, variants_main  # noqa: E402

VARIANT_EDITS = {"lean": [
    ("__global__ void __launch_bounds__(THREADS, 1)\n    w4a4_wgmma_kernel(",
     "__global__ void __maxnreg__(128)\n    w4a4_wgmma_kernel("),
    ('asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");', 'asm volatile("setmaxnreg.inc.sync.aligned.u32 168;");'),
]}


def build_all(out_dir: Path) -> None:
    for name, edits in VARIANT_EDITS.items():
        cuda_build.build_edited("w4a4_wgmma", edits, out_dir / name)
        print(f"built {out_dir / name}", flush=True)


def time_variants(prebuilt: Path, ms) -> list[dict]:
    builds = variant_builds(prebuilt, VARIANT_EDITS)
    say = lambda line: print(line, flush=True)  # noqa: E731
    return time_builds(builds, SHAPES, ms, say) + time_ops(builds, SHAPES, ms, say)


if __name__ == "__main__":
    variants_main(__doc__, build_all, time_variants, "64,128", dict(variants=list(VARIANT_EDITS)))
