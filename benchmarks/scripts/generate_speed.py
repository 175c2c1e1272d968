"""Greedy generation as a user runs it: transformers' `model.generate` (eager, or with a static cache,
whose decode step transformers compiles) against `nibble.Engine` (what `nibble generate` decodes with),
on a random-weight model built on the GPU, bf16 and nibble's configs; wall-clock time of a whole call
(prompt + new tokens) after a warm-up call, median of a few.

    PYTHONPATH=. python3 benchmarks/scripts/generate_speed.py --configs bf16 w4a16 w4a4 --json $OUT/generate-speed.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble import Engine  # noqa: E402
from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def wall_s(fn, reps: int) -> float:
    fn()  # warm-up: compiles, captures the engine's graphs
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ways", nargs="*", default=["transformers generate", "nibble.Engine"],
                    help='any of "transformers generate", "transformers generate, static cache" (its first call '
                         'compiles for minutes), "nibble.Engine", "nibble.Engine, sampled" (temperature 0.7, top-p 0.9)')
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("generate_speed")
    rows = []
    ids = torch.randint(1, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    for config in args.configs:
        model = speed.random_model(args.model)
        speed.quantize_in_place(model, quant_config(config, model, clip_search=False))
        model.generation_config.eos_token_id = None  # random weights: make every call produce --new tokens
        engine = Engine(model, max_seq_len=args.prompt + args.new)
        ways = {"transformers generate": lambda: model.generate(ids, max_new_tokens=args.new, do_sample=False),
                # transformers compiles the decode step (torch.compile, CUDA graphs) when the cache is static
                "transformers generate, static cache": lambda: model.generate(
                    ids, max_new_tokens=args.new, do_sample=False, cache_implementation="static"),
                "nibble.Engine": lambda: engine.generate(ids, args.new),
                # sampled: the draw (one Triton program a row: top-p by rejection) inside each step's graph
                "nibble.Engine, sampled": lambda: engine.generate(ids, args.new, temperature=0.7, top_p=0.9)}
        for way in args.ways:
            fn = ways[way]
            s = wall_s(fn, args.reps)
            rows.append(dict(model=args.model, config=config, way=way, prompt=args.prompt, new_tokens=args.new,
                             seconds=s, tokens_per_s=args.new / s))
            print(f"{args.model} {config:6s} {way:36s} {s:7.3f} s for {args.prompt} + {args.new} tokens: "
                  f"{args.new / s:7.1f} new tokens/s", flush=True)
        speed.release(engine, model)
        torch._dynamo.reset()  # each config compiles afresh: compiled frames are shared by code, across models
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
