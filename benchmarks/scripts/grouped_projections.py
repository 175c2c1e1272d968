"""One launch for the projections that read one input (q/k/v, gate/up) against one launch per layer,
at decode sizes, W4A16 and bf16 (the engine's `shared_input_forward` and `stack_weights`).

    PYTHONPATH=. python3 benchmarks/scripts/grouped_projections.py --json $OUT/grouped-projections.json

Same timing as ``python -m nibble.bench kernels`` (CUDA-graph replay, weights rotated past the L2,
median). W4A16 "sep" is one ``w4a16_linear`` per layer, "grp" one ``w4a16_linears`` launch; bf16
"sep" one ``F.linear`` per layer, "grp" one ``F.linear`` over the stacked weight. Each grouped output
is first checked against its own layer's op.
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
        wb = [torch.randn(sum(ns), K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(rb)]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

            def grouped(i):
                return lambda: w4a16_linears(x, *(list(t) for t in zip(*w4[i])), G)
            for y, w in zip(grouped(0)(), w4[0]):
                ref = w4a16_linear(x, *w, G).float()
                assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2, (name, M)
            us = {"w4a16_sep": bench_us(lambda i: (lambda: [w4a16_linear(x, *w, G) for w in w4[i]]),
                                        r4, **TIMING),
                  "w4a16_grp": bench_us(grouped, r4, **TIMING),
                  "bf16_sep": bench_us(lambda i: (lambda: [F.linear(x, v) for v in wb[i].split(ns)]), rb, **TIMING),
                  "bf16_grp": bench_us(lambda i: (lambda: F.linear(x, wb[i])), rb, **TIMING)}
            rows.append(dict(group=name, N=ns, K=K, M=M, us={k: round(v, 2) for k, v in us.items()}))
            print(rows[-1], flush=True)
    Path(args.json).write_text(json.dumps({"meta": env_meta(benchmark="grouped-projections",
                                                            command=" ".join(sys.argv)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
