"""Prefill latency of bf16 against nibble configs, interleaved in one process: one random-weight
model per config (Llama-2-7B's shape by default) stays resident, and each round times every config
once per prompt shape (`nibble.eval.speed.measure_prefill`: CUDA-graph replays, median of 10), the
config order alternating from round to round, every model resident. (The report rebuilds one
model at a time, for its peak memory, and since session 24 times its speed models in rounds of
alternating order too; before, it timed each config once, one after another, and its ratios moved
with the run: the bf16 baseline alone moved 8% between two device calls of one session.)

    PYTHONPATH=. python3 benchmarks/scripts/prefill_repeats.py --configs bf16 w4a4 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--configs", nargs="+", default=["bf16", "w4a4"])
    ap.add_argument("--shapes", default="1x128,1x512", help="batch x tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = shape_list(args.shapes)
    engines = {}
    for name in args.configs:
        model = speed.random_model(args.model)
        speed.quantize_in_place(model, quant_config(name, model, clip_search=False))
        engines[name] = Engine(model, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes))
    times = speed.alternating_prefills(engines, shapes, args.rounds, lambda r, times: print(
        f"round {r}: " + "  ".join(f"{n} {b}x{t} {times[n, (b, t)][-1]:.2f} ms" for n in args.configs
                                   for b, t in shapes), flush=True))
    base = args.configs[0]
    rows = []
    for shape in shapes:
        for name in args.configs:
            ratios = [b / t for b, t in zip(times[base, shape], times[name, shape])]
            rows.append(dict(config=name, batch=shape[0], tokens=shape[1], ms=times[name, shape],
                             median_ms=statistics.median(times[name, shape]), speedup_per_round=ratios,
                             median_speedup=statistics.median(ratios)))
            print(f"{name:14s} {shape[0]}x{shape[1]}: median {rows[-1]['median_ms']:.2f} ms, speedup vs {base} per round "
                  + " ".join(f"{x:.3f}" for x in ratios) + f" (median {rows[-1]['median_speedup']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(model=args.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
