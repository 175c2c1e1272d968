"""W4A4 at 17-128 tokens: the Hopper GEMM's prologue with its TMA descriptors prefetched. A CTA's
first copy of x (issued after the wait for the quantization, on the critical path) and of each weight
fetches its tensor map from the kernel's parameters; CUTLASS's producers issue `prefetch.tensormap` for
every map first thing. Variant "prefetch": the producer's issuing thread prefetches the x map and the
weights' maps before anything else (so before its wait for the previous grid). Timed against the
shipped build in one process: the GEMM back to back (`wgmma_ab.time_builds`, outputs equal) and the op
(quantize + GEMM, `wgmma_ab.time_ops`).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_tensormap_prefetch.py --build-only .exp/prefetch
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_tensormap_prefetch.py --prebuilt .exp/prefetch --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import build_variants, time_product_and_op, variants_main  # noqa: E402

PRODUCER = '    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");\n'
PREFETCH = ('    if (tid == CONSUMER_THREADS) {\n'
            '      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&x_map)) : "memory");\n'
            '      for (int i = 0; i < MAX_WEIGHTS; ++i)\n'
            '        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&weights.map[i])) : "memory");\n'
            '    }\n')
VARIANT_EDITS = {"prefetch": [(PRODUCER, PRODUCER + PREFETCH)]}

if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS), partial(time_product_and_op, names=VARIANT_EDITS),
                  "64,128", dict(variants=list(VARIANT_EDITS)))
