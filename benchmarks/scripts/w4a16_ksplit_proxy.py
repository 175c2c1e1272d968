"""Would split-K across CTAs speed up the W4A16 decode kernel on the 4096-wide deep layers? Those
layers run one 16-warp CTA per SM (128 blocks of 32 columns); a split of K over two CTAs would put
32 warps on each SM. Proxy, without writing the split: the same bytes as (f N) x (K / f), f = 2, 4,
i.e. f times the CTAs, each with 1/f of the K range, timed at 4 / 8 / 16 warps against N x K at
M = 1 and 8 (the op's kernel and timing; the sum over the f pieces is left out, so the proxy
overstates what a split could gain).

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_ksplit_proxy.py --json $OUT/ksplit.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, int4_bytes, int4_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.kernels import launch  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

LAYERS = [(4096, 4096), (4096, 11008), (4096, 14336), (12288, 4096), (22016, 4096), (8192, 28672)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for N, K in LAYERS:
        for f in (1, 2, 4):
            if K % (f * GROUP) or (f > 1 and N * f > 40000):
                continue
            n, k = N * f, K // f
            sets = int4_sets(n, k, GROUP, dev)
            for M in (1, 8):
                x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
                picked = W.select_mma_config(M, n, k, launch.num_sms(dev))
                us = {}
                for warps in (4, 8, 16):
                    cfg = replace(picked, warps=warps)
                    if not W.mma_config_valid(cfg, M):
                        continue
                    outs = [[torch.empty(M, n, device=dev, dtype=x.dtype)] for _ in sets]
                    us[warps] = statistics.median(bench_us(
                        lambda i: (lambda: W.w4a16_mma_many(x, [sets[i]], GROUP, config=cfg, outs=outs[i])),
                        len(sets), **TIMING) for _ in range(2))
                print(f"{N}x{K} f{f} ({n}x{k}) M={M} picked w{picked.warps} {us[picked.warps]:.2f} us | "
                      + " ".join(f"w{w}={t:.2f}" for w, t in us.items()), flush=True)
                rows.append(dict(N=N, K=K, f=f, M=M, picked=picked.warps, bytes=int4_bytes(n, k, GROUP), us=us))
            sets = None
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
