"""The SM clock and board power each op runs at under sustained load: W4A16 (the op) against cuBLAS bf16, each
replayed back to back for ~1.5 s while `nvidia-smi` samples every 50 ms; per op the median clock and power over
its last second, and its time per call (benchmarks/notes-w4a16.md, session 40).

    PYTHONPATH=. python3 benchmarks/scripts/power_cap_clocks.py --ms 1,16,128,1024,4096 --json clocks.json
"""
import argparse
import datetime
import json
import time

import torch
import torch.nn.functional as F

from nibble.bench.kernels import GROUP, weight_sets
from nibble.bench.timing import ClockSampler, capture_graph, env_meta, sized_calls
from nibble.kernels import w4a16 as W


def sustained(run_graph, seconds: float = 1.5, ahead: int = 4):
    """(steady-from, end) wall times of `seconds` of back-to-back replays, and us per replay over the steady
    part (its last second). The host keeps `ahead` replays queued, waiting on the oldest one's event only,
    so the GPU never idles between replays (a synchronize every few replays would time the host's round
    trips too)."""
    t0 = time.time()
    steady, first, queued = None, None, []
    while time.time() - t0 < seconds:
        if steady is None and time.time() - t0 > seconds - 1.0:
            steady, first, replays = datetime.datetime.now(), torch.cuda.Event(enable_timing=True), 0
            first.record()
        run_graph()
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        queued.append(done)
        if steady is not None:
            replays += 1
        if len(queued) > ahead:
            queued.pop(0).synchronize()
    queued[-1].synchronize()
    return steady, datetime.datetime.now(), first.elapsed_time(queued[-1]) * 1000.0 / replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--ms", default="1,16,128,1024,4096", help="token counts, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    periods, rows = [], []
    with ClockSampler() as clocks:
        for N, K in [(28672, 8192), (12288, 4096)]:
            w4, wb, _ = weight_sets(N, K, GROUP, dev)
            for M in map(int, args.ms.split(",")):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                ops = {"bf16": (lambda i: (lambda: F.linear(x, wb[i])), len(wb)),
                       "w4a16": (lambda i: (lambda: W.w4a16_linear(x, *w4[i], GROUP)), len(w4))}
                graphs, calls = {}, {}
                for name, (factory, sets) in ops.items():
                    # a replay of ~2 ms, every weight copy in turn, as `bench_us` sizes its graphs
                    round_robin, calls[name] = sized_calls(factory, sets)
                    graphs[name] = capture_graph(round_robin(calls[name]), warmup=round_robin(sets))[0]
                for name in ("bf16", "w4a16", "w4a16", "bf16"):
                    steady, end, us = sustained(graphs[name].replay)
                    periods.append((N, K, M, name, steady, end, us / calls[name]))
                    time.sleep(0.5)  # the board's draw settles between ops
                del graphs
            w4 = wb = None  # freed (not del: the lambdas above close over them)
            torch.cuda.empty_cache()
    for N, K, M, name, steady, end, us in periods:
        row = dict(N=N, K=K, M=M, op=name, us=round(us, 2), **clocks.during(steady, end))
        rows.append(row)
        print(row, flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=env_meta(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
