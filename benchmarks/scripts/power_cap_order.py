"""Does the order of a benchmark's ops move their times? The W4A16 op, the same Hopper GEMM launch called
with the op's own config, and cuBLAS bf16, timed in four orders per (shape, M) while `nvidia-smi` samples the SM
clock and the board's power every 50 ms (benchmarks/notes-w4a16.md, session 40: under compute-bound products the
H200 draws up to its power cap and its clock moves from one sample to the next, which is why the kernel benchmarks
time their ops in interleaved rounds, `nibble.bench.timing.bench_rounds`).

    PYTHONPATH=. python3 benchmarks/scripts/power_cap_order.py --smi-log smi.log | tee order.log

Each printed row: (us, CUDA-graph calls per replay, start and end in seconds after the "T0" line) per op.
"""
import argparse
import datetime
import time

import torch
import torch.nn.functional as F

from nibble.bench.kernels import GROUP, TIMING, weight_sets
from nibble.bench.timing import ClockSampler, bench_us
from nibble.kernels import hopper
from nibble.kernels import w4a16 as W

ORDERS = (("op", "cfg", "bf16"), ("cfg", "op", "bf16"), ("bf16", "cfg", "op"), ("bf16", "op", "cfg"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smi-log", default="smi.log", help="where nvidia-smi's samples go")
    args = ap.parse_args()
    dev = torch.device("cuda")
    clusters = W.WGMMA.clusters(dev)
    with ClockSampler(log_path=args.smi_log):
        print("T0", datetime.datetime.now(), flush=True)
        t0 = time.time()
        for N, K in [(14336, 4096), (12288, 4096), (8192, 28672)]:
            w4, wb, _ = weight_sets(N, K, GROUP, dev)
            for M in (128, 1024):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                pick = hopper.pick_config(M, N, K, W.WGMMA.model, clusters, W.WGMMA.tiles())
                arms = {"op": (lambda i: (lambda: W.w4a16_linear(x, *w4[i], GROUP)), len(w4)),
                        "cfg": (lambda i: (lambda: W.w4a16_wgmma(x, *w4[i], GROUP, config=pick)), len(w4)),
                        "bf16": (lambda i: (lambda: F.linear(x, wb[i])), len(wb))}
                for order in ORDERS:
                    res = {}
                    for name in order:
                        start = round(time.time() - t0, 3)
                        r = bench_us(*arms[name], return_all=True, **TIMING)
                        res[name] = (round(r["us"], 2), r["calls_per_replay"], start, round(time.time() - t0, 3))
                    print(N, K, M, pick, list(order), res, flush=True)


if __name__ == "__main__":
    main()
