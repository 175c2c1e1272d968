"""Is the skinny W4A16 kernel at M = 1 bound by how its CTAs fall on the SMs?

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_skinny_balance.py --json $OUT/balance.json

One CTA computes 32 columns over the whole of K, and a 4096-deep layer's CTAs all fit on the GPU at
once (up to four 8-warp CTAs per SM), so an SM holds floor or ceil(CTAs / SMs) of them. If an SM's
share of the stream, not the GPU's, sets the time, the time steps with ceil(CTAs / SMs) rather than
growing with N, and the same bytes cut into more, shorter CTAs (2N x K / 2, 4N x K / 4) run
faster where the split evens the shares out. Both are timed here at M = 1 (bf16, group 128), for
the warps the selector picks and for 4 and 8, with the benchmark's timing.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # N sweep at K = 4096, then equal-byte reshapes of the issue-3 layers whose CTAs fall unevenly
    shapes = [(n, 4096) for n in (4224, 8448, 10560, 11008, 12288, 12672, 14336, 14784, 16896, 22016)]
    shapes += [(22016, 2048), (44032, 1024), (28672, 2048), (57344, 1024), (24576, 2048), (8192, 2048)]
    rows = []
    for N, K in shapes:
        per_set = N * K // 2 + 4 * (K // GROUP) * N
        sets = [random_int4(N, K, GROUP, dev) for _ in range(rotations(per_set))]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        picked = W.select_mma_config(1, N, K, sms)
        res = {}
        for warps in sorted({4, 8, picked.warps}):
            cfg = replace(picked, warps=warps)
            res[warps] = bench_us(lambda i: (lambda: W.w4a16_mma(x, *sets[i], GROUP, config=cfg)), len(sets), **TIMING)
        ctas = N // 32
        row = dict(N=N, K=K, ctas=ctas, ctas_per_sm=round(ctas / sms, 2), max_ctas_per_sm=math.ceil(ctas / sms),
                   MB=round(per_set / 1e6, 2), picked_warps=picked.warps, us={w: round(v, 3) for w, v in res.items()},
                   GBps_picked=round(per_set / res[picked.warps] / 1e3, 1))
        rows.append(row)
        print(f"{N:6d} x {K:5d}  CTAs {ctas:5d} ({ctas / sms:5.2f}/SM, max {row['max_ctas_per_sm']})  {row['MB']:6.1f} MB  "
              + "  ".join(f"w{w} {v:6.2f} us" for w, v in res.items())
              + f"  picked w{picked.warps}: {row['GBps_picked']:.0f} GB/s", flush=True)
        sets = None
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
