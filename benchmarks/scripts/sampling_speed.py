"""What sampling costs a decode step: the engine's sampling kernels (`engine.next_tokens`: top-p by
rejection over chunks of the vocabulary, no sort) against the PyTorch ops they replaced (`engine._sample_plain`:
top-p by a sort of the vocabulary), greedy argmax, and other versions of the engine file (``--other``), on the GPU.

Ops: each way's call on random bf16 logits [B, V] (vocabularies of Llama-2, SmolLM2, Llama-3, Qwen2),
a CUDA graph of many calls (`timing.bench_us`), median. Engine: decode steps of a random-weight model
(`speed.measure_decode`, 128-token prompt, 128 steps), greedy / sampled by the kernel / sampled by the
sort, each way its own engine and graphs, rounds in alternating order.

    PYTHONPATH=. python3 benchmarks/scripts/sampling_speed.py --json $OUT/sampling-speed.json
    git show fe67c8f:nibble/eval/engine.py > .exp/one_program_engine.py  # one program a row
    PYTHONPATH=. python3 benchmarks/scripts/sampling_speed.py --other one-program=.exp/one_program_engine.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from engine_ab import load_engine_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.eval import engine as engine_mod  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import GREEDY, Engine, Sampling  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402

# "greedy": the kernel way is the engine's argmax in chunks, the sort way torch.argmax (`--setting greedy`: the
# engine's decode steps greedy both ways)
SETTINGS = {"t0.7 top-p 0.9": Sampling(0.7, top_p=0.9), "t0.7 top-k 50 top-p 0.9": Sampling(0.7, 50, 0.9),
            "t1.0": Sampling(1.0), "t0.7 top-p 0.5": Sampling(0.7, top_p=0.5), "greedy": GREEDY}


def sort_next_tokens(logits, sampling=GREEDY, watch=None):
    """`engine.next_tokens` as it was: the PyTorch ops for every sampled draw (its logits unwatched)."""
    return logits.argmax(-1) if sampling.greedy else engine_mod._sample_plain(logits, sampling)


WAYS = {"kernel": engine_mod.next_tokens, "sort": sort_next_tokens}


def op_rows(vocabs, batches, say, ways=None) -> list[dict]:
    ways = ways or WAYS
    rows = []
    for V in vocabs:
        for B in batches:
            logits = (torch.randn(B, V, device="cuda") * 4).bfloat16()
            greedy = bench_us(lambda i: lambda: logits.argmax(-1))
            for name, sampling in SETTINGS.items():
                us = {way: bench_us(lambda i, f=f: lambda: f(logits, sampling)) for way, f in ways.items()}
                rows.append(dict(part="op", V=V, B=B, setting=name, greedy_us=greedy, **{f"{w}_us": u for w, u in us.items()}))
                say(f"V={V} B={B} {name}: argmax {greedy:.1f} us, " + ", ".join(f"{w} {u:.1f}" for w, u in us.items()))
    return rows


def engine_rows(model_name, configs, batches, setting, rounds, say) -> list[dict]:
    rows = []
    sampling = SETTINGS[setting]
    for config in configs:
        model = speed.random_model(model_name)
        speed.quantize_in_place(model, quant_config(config, model, clip_search=False))
        for B in batches:
            arms = {}
            for way, s in [("greedy", GREEDY)] + [(way, sampling) for way in WAYS]:
                engine_mod.next_tokens = WAYS.get(way, WAYS["kernel"])  # what the engine's graphs capture
                engine = Engine(model, max_batch=B, max_seq_len=256)
                speed.measure_decode(engine, B, 128, 8, reps=1, sampling=s)  # captures this way's graphs
                arms[way] = (engine, s)
            engine_mod.next_tokens = WAYS["kernel"]
            times = {way: [] for way in arms}
            for r in range(rounds):
                for way in speed.round_order(list(arms), r):
                    engine, s = arms[way]
                    times[way].append(speed.measure_decode(engine, B, 128, 128, sampling=s))
            ms = {way: statistics.median(t) for way, t in times.items()}
            rows.append(dict(part="engine", model=model_name, config=config, B=B, setting=setting,
                             **{f"{w}_ms": v for w, v in ms.items()}, rounds_ms=times,
                             tokens_per_s={w: B * 1000 / v for w, v in ms.items()}))
            say(f"{model_name} {config} B={B}: ms/step greedy {ms['greedy']:.3f}, sampled by "
                + ", ".join(f"{way} {ms[way]:.3f}" for way in WAYS) + f" ({setting})")
            speed.release(*(engine for engine, _ in arms.values()))
        speed.release(model)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int, nargs="*", default=[32000, 49152, 128256, 151936])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--models", nargs="*", default=["llama-2-7b"], choices=list(speed.SPEED_MODELS))
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16"])
    ap.add_argument("--setting", default="t0.7 top-p 0.9", choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launches", nargs="*", default=[],
                    help="CHUNKxBLOCKxWARPSxROUNDS of the kernels to time too (ops only: e.g. 4096x1024x4x2), besides "
                         "the shipped ones")
    ap.add_argument("--other", nargs="*", default=[], metavar="NAME=PATH", help="other engine.py versions to time")
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("sampling_speed")

    def say(line):
        print(line, flush=True)
    for other in args.other:
        name, path = other.split("=", 1)
        other_next = load_engine_module(name, path).next_tokens  # versions before session 69 take no watch
        WAYS[name] = lambda logits, sampling=GREEDY, watch=None, f=other_next: f(logits, sampling)
    rows = op_rows(args.vocabs, args.batches, say)
    names = "SAMPLE_CHUNK", "SAMPLE_BLOCK", "SAMPLE_WARPS", "SAMPLE_ROUNDS"
    shipped = [getattr(engine_mod, n) for n in names]
    for launches in args.launches:
        for n, v in zip(names, map(int, launches.split("x"))):
            setattr(engine_mod, n, v)
        say(f"-- kernels with chunks / blocks of {engine_mod.SAMPLE_CHUNK} / {engine_mod.SAMPLE_BLOCK}, "
            f"{engine_mod.SAMPLE_WARPS} warps, {engine_mod.SAMPLE_ROUNDS} rounds over chunks")
        rows += [dict(r, launches=launches) for r in op_rows(args.vocabs, args.batches, say, {"kernel": WAYS["kernel"]})]
    for n, v in zip(names, shipped):
        setattr(engine_mod, n, v)
    for model_name in args.models:
        rows += engine_rows(model_name, args.configs, args.batches, args.setting, args.rounds, say)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(command=" ".join(sys.argv)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
