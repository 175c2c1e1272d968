"""One launch for the projections that read one input (q/k/v, gate/up) against one launch per layer,
W4A16, W4A4 and bf16 (the engine's `shared_input_forward` and `stack_weights`), at decode and prefill
sizes.

    PYTHONPATH=. python3 benchmarks/scripts/grouped_projections.py --ms 1,8,16,64,128,512,2048 \
        --json $OUT/grouped-projections.json

Same timing as ``python -m nibble.bench kernels`` (CUDA-graph replay, weights rotated past the L2,
median). W4A16 "sep" is one ``w4a16_linear`` per layer, "grp" one ``w4a16_linears`` call (one launch
where the skinny or the Hopper kernel runs). W4A4 "sep" quantizes x once and runs one product
launch per layer (what ``w4a4_linears`` did above 16 tokens before session 12), "grp" is
``w4a4_linears``. bf16 "sep" is one ``F.linear`` per layer, "grp" one ``F.linear`` over the stacked
weight. Each grouped output is first checked against its own layer's op.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402
from nibble.kernels.w4a16 import w4a16_linear, w4a16_linears  # noqa: E402

GROUPS = {"llama2-qkv": ([4096] * 3, 4096), "llama2-gate-up": ([11008] * 2, 4096),
          "llama3-qkv": ([4096, 1024, 1024], 4096), "llama3-gate-up": ([14336] * 2, 4096)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev, G = torch.device("cuda"), 128
    rows = []
    for name, (ns, K) in GROUPS.items():
        int4_bytes = sum(n * K // 2 for n in ns)
        r4, rb = rotations(int4_bytes), rotations(4 * int4_bytes)
        w4 = [[random_int4(n, K, G, dev) for n in ns] for _ in range(r4)]
        wq = [[random_w4a4(n, K, dev) for n in ns] for _ in range(r4)]
        wb = [torch.randn(sum(ns), K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(rb)]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

            def grouped(i):
                return lambda: w4a16_linears(x, *(list(t) for t in zip(*w4[i])), G)
            for y, w in zip(grouped(0)(), w4[0]):
                ref = w4a16_linear(x, *w, G).float()
                assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2, (name, M)
            def w4a4_grouped(i):
                return lambda: w4a4.w4a4_linears(x, [q for q, _ in wq[i]], [s for _, s in wq[i]], [None] * len(ns),
                                                 False)

            def w4a4_separate(i):
                order = w4a4.product_order(M, ns[0], K, dev)

                def run():
                    qx, sx = w4a4.quantize_activations_triton(x, False, order)
                    return [w4a4.w4a4_matmul(qx, sx, q, s, None, x.dtype, order) for q, s in wq[i]]
                return run
            for y, ref in zip(w4a4_grouped(0)(), w4a4_separate(0)()):
                assert torch.equal(y, ref), (name, M)
            us = {"w4a16_sep": bench_us(lambda i: (lambda: [w4a16_linear(x, *w, G) for w in w4[i]]),
                                        r4, **TIMING),
                  "w4a16_grp": bench_us(grouped, r4, **TIMING),
                  "w4a4_sep": bench_us(w4a4_separate, r4, **TIMING),
                  "w4a4_grp": bench_us(w4a4_grouped, r4, **TIMING),
                  "bf16_sep": bench_us(lambda i: (lambda: [F.linear(x, v) for v in wb[i].split(ns)]), rb, **TIMING),
                  "bf16_grp": bench_us(lambda i: (lambda: F.linear(x, wb[i])), rb, **TIMING)}
            rows.append(dict(group=name, N=ns, K=K, M=M, us={k: round(v, 2) for k, v in us.items()}))
            print(rows[-1], flush=True)
    Path(args.json).write_text(json.dumps({"meta": env_meta(benchmark="grouped-projections",
                                                            command=" ".join(sys.argv)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
