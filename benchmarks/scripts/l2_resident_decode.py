"""How fast would Llama-2-7B's decode launches run if their weights were already in the L2? Each launch
at M = 1 (one token, the engine's batch-1 decode), timed the benchmark's way (CUDA graph of back-to-back
calls) twice: weights rotated past the L2 (every call streams from HBM, as in the benchmark), and one
weight called over and over (after the first call it is L2-resident, as a weight prefetched into the
L2 during the glue kernels before it would be). W4A16 (the op's kernel and config) and cuBLAS bf16.

    PYTHONPATH=. python3 benchmarks/scripts/l2_resident_decode.py --json $OUT/l2-resident.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, int4_bytes, int4_sets  # noqa: E402
from nibble.bench.timing import bench_rounds, env_meta, rotations  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

# launch name -> the (N, K) of the weights it computes at once (q/k/v and gate/up share x)
LAUNCHES = {"qkv": [(4096, 4096)] * 3, "o_proj": [(4096, 4096)], "gate_up": [(11008, 4096)] * 2,
            "down": [(4096, 11008)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ms", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for M in [int(m) for m in args.ms.split(",")]:
        for name, shapes in LAUNCHES.items():
            K = shapes[0][1]
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            per_weight = [int4_sets(N, K, GROUP, dev) for N, _ in shapes]
            sets = [[w[i] for w in per_weight] for i in range(min(len(w) for w in per_weight))]
            outs = [[torch.empty(M, N, device=dev, dtype=x.dtype) for N, _ in shapes] for _ in sets]
            n_total = sum(N for N, _ in shapes)
            wb = [torch.randn(n_total, K, device=dev, dtype=torch.bfloat16)
                  for _ in range(rotations(n_total * K * 2))]

            def w4(i):
                return lambda: W.w4a16_mma_many(x, sets[i], GROUP, outs=outs[i])

            def bf16(i):
                return lambda: F.linear(x, wb[i])

            times = bench_rounds({"w4a16_hbm": (w4, len(sets)), "w4a16_l2": (w4, 1),
                                  "bf16_hbm": (bf16, len(wb)), "bf16_l2": (bf16, 1)}, args.rounds, **TIMING)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(launch=name, M=M, shapes=shapes, int4_bytes=sum(int4_bytes(N, K, GROUP) for N, _ in shapes),
                       bf16_bytes=n_total * K * 2, us=med, us_rounds=times)
            rows.append(row)
            print(f"{name} M={M}: " + " ".join(f"{k}={v:.2f}" for k, v in med.items())
                  + f" | w4a16 l2/hbm {med['w4a16_l2'] / med['w4a16_hbm']:.3f}"
                  + f" bf16 l2/hbm {med['bf16_l2'] / med['bf16_hbm']:.3f}", flush=True)
            sets = per_weight = outs = wb = None
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
