"""Prefill under session 20's dispatch against the current one, interleaved in one process (session 21):
the same quantized random-weight model behind two engines, each of which captures its prefill graphs
under one dispatch, then replayed in alternating rounds (`nibble.eval.speed.alternating_prefills`).
Session 20's: for W4A16 (`large_m_kernel`), layers of up to 20M weights ("small", q/k/v and gate/up
launches counted together) took the skinny kernel to 64 tokens and dequantize + cuBLAS to 256, the
wgmma kernel above; both Hopper GEMMs' config models were fitted to the issue's shapes only.

    PYTHONPATH=. python3 benchmarks/scripts/dispatch_ab.py --config w4a16 --models llama-2-7b llama-3.2-1b
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import hopper  # noqa: E402
from nibble.kernels import w4a4 as W4  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

PREVIOUS_W4A4_MODEL = hopper.CostModel(
    stage_us={(64, 256): 0.519, (128, 256): 0.587, (128, 128): 0.359, (64, 128): 0.325},
    item_us={(64, 256): -0.01, (128, 256): 2.49, (128, 128): 1.28, (64, 128): -0.28},
    split_output_us=1.33, split_us=0.76, max_tokens={(64, 128): 256})
PREVIOUS_MODEL = hopper.CostModel(
    stage_us={(64, 256): 1.388, (128, 256): 1.79, (128, 128): 0.952, (256, 128): 1.504, (64, 128): 0.804},
    item_us={(64, 256): 3.6, (128, 256): 3.75, (128, 128): 5.59, (256, 128): 1.45, (64, 128): 4.01},
    split_output_us=1.78, split_us=0.52, max_tokens={(64, 128): 256})


def previous_large_m_kernel(M: int, N: int, K: int, weights: int = 1) -> str:
    small = N * K <= 20 << 20  # of the launch's columns together, however many weights
    if M <= 32 or (small and M <= W.MMA_MAX_M):
        return "skinny"
    if M > W.WGMMA_MAX_M or (small and M <= 256):
        return "dequant"
    return "wgmma"


@contextlib.contextmanager
def previous_dispatch():
    saved = W.large_m_kernel, W.WGMMA.model, W4.WGMMA.model
    W.large_m_kernel, W.WGMMA.model, W4.WGMMA.model = previous_large_m_kernel, PREVIOUS_MODEL, PREVIOUS_W4A4_MODEL
    try:
        yield
    finally:
        W.large_m_kernel, W.WGMMA.model, W4.WGMMA.model = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="w4a16", help="a report config: w4a16, w4a4, w4a4-hadamard")
    ap.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-3.2-1b"], choices=list(speed.SPEED_MODELS))
    ap.add_argument("--shapes", default="1x128,1x512,8x128,8x512", help="batch x tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=4, help="even: each engine runs first in half the rounds, "
                    "which matters (the first engine of a round ran up to 6% apart from the second on the H200)")
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = shape_list(args.shapes)
    rows = []
    for name in args.models:
        model = speed.random_model(name)
        speed.quantize_in_place(model, quant_config(args.config, model, clip_search=False))
        engines = {v: Engine(model, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes))
                   for v in ("previous", "current")}
        for b, t in shapes:  # each engine captures its graphs under its own dispatch
            with previous_dispatch():
                speed.measure_prefill(engines["previous"], b, t, reps=1, warmup=1)
            speed.measure_prefill(engines["current"], b, t, reps=1, warmup=1)
        times = speed.alternating_prefills(engines, shapes, args.rounds)
        for shape in shapes:
            prev, cur = statistics.median(times["previous", shape]), statistics.median(times["current", shape])
            rows.append(dict(config=args.config, model=name, batch=shape[0], tokens=shape[1], previous_ms=times["previous", shape],
                             current_ms=times["current", shape], speedup=prev / cur))
            print(f"{name:14s} {shape[0]}x{shape[1]:<4d} previous {prev:7.3f} ms  current {cur:7.3f} ms  "
                  f"{prev / cur:.3f}x", flush=True)
        speed.release(*engines.values(), model)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(config=args.config), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
