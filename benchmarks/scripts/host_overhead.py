"""What one eager call of a layer costs the host (the CPU time from the call to its kernel launch),
which is what `model.generate` pays per layer per token outside CUDA graphs: nn.Linear (cuBLAS)
against nibble's QuantLinear (W4A16, W4A4) and the grouped projections, at one token. Each case is
called in a loop whose GPU work is a few microseconds a call, so the loop runs at the host's pace;
then cProfile of the same loop shows where the time goes.

    PYTHONPATH=. python3 benchmarks/scripts/host_overhead.py --json $OUT/host-overhead.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
from torch import nn

from nibble import QuantConfig, QuantLinear
from nibble.bench.timing import env_meta
from nibble.nn.quant_linear import shared_input_forward


def host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def profile(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def cases(n: int, k: int):
    x = torch.randn(1, 1, k, dtype=torch.bfloat16, device="cuda")
    linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
    w4a16 = QuantLinear.from_linear(linear, QuantConfig(mode="w4a16"))
    w4a4 = QuantLinear.from_linear(linear, QuantConfig(mode="w4a4"))
    qkv = [QuantLinear.from_linear(nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda"),
                                   QuantConfig(mode="w4a16")) for _ in range(3)]
    return {"nn.Linear bf16": lambda: linear(x), "QuantLinear w4a16": lambda: w4a16(x),
            "QuantLinear w4a4": lambda: w4a4(x), "shared_input_forward w4a16 x3": lambda: shared_input_forward(qkv, x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096", help="N x K")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=18, help="cProfile rows a case (0: no profile)")
    ap.add_argument("--json")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    rows = []
    with torch.inference_mode():
        for name, fn in cases(n, k).items():
            us = host_us(fn, args.calls)
            rows.append(dict(case=name, N=n, K=k, M=1, host_us_per_call=us))
            print(f"{name:32s} {us:7.1f} us a call", flush=True)
        if args.top:
            for name, fn in cases(n, k).items():
                print(f"\n==== {name}\n{profile(fn, 500, args.top)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
