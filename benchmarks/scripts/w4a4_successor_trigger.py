"""W4A4 at 17-128 tokens: the Hopper GEMM letting the next kernel launch early. Launched early itself
(the op's quantization lets it), the shipped GEMM never lets its own successor launch: the next op's
quantization, or the engine's next kernel, launches only once every CTA of the product has exited.
Variants that execute `griddepcontrol.launch_dependents` (only effective when launched early, i.e. up
to w4a4.PRODUCT_EARLY_TOKENS tokens): "start", in the consumers right after their wait for the
previous grid; "last_item", in the consumers once the mainloop of the CTA's last item is done (the
successor launches as the last CTA reaches its epilogue). The successor's own wait still sees all of
the product's writes. Timed against the shipped build in one process: the GEMM back to back
(`wgmma_ab.time_builds`, outputs equal) and the op (quantize + GEMM, `wgmma_ab.time_ops`).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_successor_trigger.py --build-only .exp/trigger
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_successor_trigger.py --prebuilt .exp/trigger --json out.json
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.kernels import cuda_build  # noqa: E402
from wgmma_ab import SHAPES, time_builds, time_ops, variant_builds, variants_main  # noqa: E402

WAIT = "  wait_for_prior_grids();  // x_scale, like x, is the previous kernel's output\n"
LAST_MAINLOOP = "    first += k_tiles;\n"
TRIGGER = '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
VARIANT_EDITS = {
    "start": [(WAIT, WAIT + TRIGGER)],
    "last_item": [(LAST_MAINLOOP, LAST_MAINLOOP + "  if (w + (int)gridDim.x >= items)" + TRIGGER)],
}


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
