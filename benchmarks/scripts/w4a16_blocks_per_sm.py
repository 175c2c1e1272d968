"""Does the W4A16 decode kernel's time follow the most 32-column blocks any SM streams? At one token
the skinny kernel (csrc/w4a16_mma.cu) gives each CTA one block of 32 columns x the whole K, and the
H200 spreads a grid breadth-first: 11008 columns (344 blocks) put 3 on 80 SMs and 2 on 52, 22016
(Llama-2-7B's gate/up, 688) 6 on 28 and 5 on 104. If an SM's share of DRAM bandwidth bounds it, the
time follows ceil(blocks / SMs), not blocks / SMs, and a balanced split of the last blocks would pay;
if it follows blocks / SMs, the imbalance costs nothing.

Times the kernel at one token on K = 4096 (and 8192) for N giving 2 to 6 blocks per SM in steps of a
quarter or less, at the config the op picks for Llama-2-7B's gate/up (fixed, so only N changes) and at
the op's own pick; CUDA graphs, weights rotated past the L2, medians.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_blocks_per_sm.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, int4_bytes, int4_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.kernels import launch, w4a16  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="4096,8192")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = launch.num_sms(dev)
    fixed = w4a16.select_mma_config(1, 22016, 4096, sms)
    rows = []
    for K in (int(k) for k in args.ks.split(",")):
        per_sm = [2 + q / 8 for q in range(33)]  # 2 .. 6 blocks per SM
        widths = sorted({round(b * sms) * 32 for b in per_sm} | {11008, 12288, 14336, 22016})
        for N in widths:
            ws = int4_sets(N, K, GROUP, dev)
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            pick = w4a16.select_mma_config(1, N, K, sms)
            t_fixed = bench_us(lambda i: (lambda: w4a16.w4a16_mma(x, *ws[i], GROUP, config=fixed)), len(ws), **TIMING)
            t_pick = bench_us(lambda i: (lambda: w4a16.w4a16_mma(x, *ws[i], GROUP, config=pick)), len(ws), **TIMING)
            blocks = N // 32
            row = dict(N=N, K=K, blocks=blocks, blocks_per_sm=blocks / sms, most_on_an_sm=-(-blocks // sms),
                       fixed_config=str(fixed), fixed_us=t_fixed, pick_config=str(pick), pick_us=t_pick,
                       bytes=int4_bytes(N, K, GROUP))
            rows.append(row)
            print(f"K={K:5d} N={N:6d} blocks/SM {blocks / sms:5.2f} (most {row['most_on_an_sm']}): fixed {t_fixed:6.2f} us "
                  f"({row['bytes'] / t_fixed / 1e3:5.0f} GB/s)  pick {t_pick:6.2f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(fixed=str(fixed)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
