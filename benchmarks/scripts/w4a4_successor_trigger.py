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
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import build_variants, time_product_and_op, variants_main  # noqa: E402

WAIT = "  wait_for_prior_grids();  // x_scale, like x, is the previous kernel's output\n"
LAST_MAINLOOP = "    first += k_tiles;\n"
TRIGGER = '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
VARIANT_EDITS = {
    "start": [(WAIT, WAIT + TRIGGER)],
    "last_item": [(LAST_MAINLOOP, LAST_MAINLOOP + "  if (w + (int)gridDim.x >= items)" + TRIGGER)],
}


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS), partial(time_product_and_op, names=VARIANT_EDITS),
                  "64,128", dict(variants=list(VARIANT_EDITS)))
