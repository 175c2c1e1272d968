"""Decode speed against the context a step attends over: bf16 and nibble in the same engine, on random-weight models,
each step after prompts of several lengths, configs in alternating rounds. At long contexts the 16-bit KV cache a step
reads grows toward the 4-bit weights' bytes, so what 4 bits buy shrinks; the JSON gives both byte counts per step.
Each engine is also timed at the shortest prompt with a cache sized for it, which shows whether a long cache
(`max_seq_len`) costs a short context anything.

    PYTHONPATH=. python3 benchmarks/scripts/decode_context.py --json $OUT/decode-context.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.memory import decode_stream_bytes, weight_memory  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def kv_bytes_per_step(engine: Engine, context: float, batch: int) -> float:
    """Bytes of keys and values one decode step of ``engine`` reads at ``context`` positions: its cache's, per
    position of a sequence."""
    return engine.kv_cache_bytes() / (engine.max_batch * engine.capacity) * context * batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16", "w4a4"])
    ap.add_argument("--prompts", default="128,1024,2048,3840", help="prompt lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps timed after each prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("decode_context")
    prompts = [int(p) for p in args.prompts.split(",")]
    short_cache = prompts[0] + args.tokens + 2
    long_cache = max(prompts) + args.tokens + 2
    models, engines = {}, {}
    for config in args.configs:
        models[config] = speed.random_model(args.model)
        speed.quantize_in_place(models[config], quant_config(config, models[config], clip_search=False))
        for cache in (short_cache, long_cache):
            engines[config, cache] = Engine(models[config], max_batch=args.batch, max_seq_len=cache)
    weights = {config: decode_stream_bytes(weight_memory(model)) for config, model in models.items()}
    rows = []
    for prompt in prompts:
        for cache in ((short_cache, long_cache) if prompt == prompts[0] else (long_cache,)):
            times = speed.alternating_decodes({c: engines[c, cache] for c in args.configs}, args.batch, prompt,
                                              args.tokens, args.rounds)
            base = statistics.median(times[args.configs[0]])
            kv = kv_bytes_per_step(engines[args.configs[0], cache], prompt + args.tokens / 2, args.batch)
            for config, t in times.items():
                ms = statistics.median(t)
                rows.append(dict(model=args.model, config=config, batch=args.batch, prompt=prompt, cache=cache,
                                 tokens=args.tokens, ms_per_step=ms, rounds=t, speedup=base / ms,
                                 weight_bytes_per_step=weights[config], kv_bytes_per_step=kv))
                print(f"{args.model} {config:6s} b={args.batch} prompt {prompt:5d} cache {cache:5d}: {ms:.3f} ms/step "
                      f"({base / ms:.2f}x {args.configs[0]}), weights {weights[config] / 1e9:.2f} "
                      f"+ KV {kv / 1e9:.2f} GB a step", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"meta": env_meta(), "args": vars(args), "rows": rows},
                                                      indent=1))


if __name__ == "__main__":
    main()
