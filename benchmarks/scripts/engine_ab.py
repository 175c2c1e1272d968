"""Decode (and prefill) A/B of versions of the engine (`nibble/eval/engine.py`) in one process: the package's
and other copies of the file (e.g. `git show <commit>:nibble/eval/engine.py > old_engine.py`), each
engine capturing its own graphs, on random-weight models, in alternating rounds; the greedy tokens
of each compared with the first other version's (the baseline). Each step is timed after each of ``--prompts``,
in a cache of ``--max-seq-len`` positions (by default just long enough for the longest prompt); with
``--prefills``, each prefill of those batch x prompt shapes too (the batch must be one of ``--batches``).

    git show HEAD~1:nibble/eval/engine.py > .exp/old_engine.py
    PYTHONPATH=. python3 benchmarks/scripts/engine_ab.py --other old=.exp/old_engine.py --json $OUT/ab.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import engine as new_engine  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def load_engine_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"nibble_engine_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", nargs="+", required=True, metavar="NAME=PATH",
                    help="other engine.py versions; the first is the baseline")
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16", "w4a4"])
    ap.add_argument("--models", nargs="*", default=["llama-2-7b"], choices=list(speed.SPEED_MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="128", help="prompt lengths, comma-separated")
    ap.add_argument("--prefills", default="", help="prefill shapes BATCHxPROMPT, comma-separated (e.g. 1x128,8x512)")
    ap.add_argument("--max-seq-len", type=int, help="the engines' cache (default: the longest prompt + 160)")
    ap.add_argument("--rounds", type=int, default=4, help="even: each version runs first as often")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    try:
        prefills = shape_list(args.prefills) if args.prefills else []
    except ValueError:
        ap.error(f"--prefills wants BATCHxPROMPT shapes such as 1x128,8x512, got {args.prefills!r}")
    if any(len(shape) != 2 or shape[0] not in batches for shape in prefills):
        ap.error(f"--prefills {args.prefills}: each BATCHxPROMPT's batch must be one of --batches {args.batches}")
    speed.require_cuda("engine_ab")
    others = dict(o.split("=", 1) for o in args.other)
    versions = {name: load_engine_module(name, path) for name, path in others.items()}
    versions["package"] = new_engine
    base = next(iter(others))
    max_seq_len = args.max_seq_len or max(prompts + [T for _, T in prefills]) + 160
    rows = []
    for model_name in args.models:
        for config in args.configs:
            model = speed.random_model(model_name)
            speed.quantize_in_place(model, quant_config(config, model, clip_search=False))
            for batch in batches:
                engines = {name: mod.Engine(model, max_batch=batch, max_seq_len=max_seq_len)
                           for name, mod in versions.items()}
                prompt = torch.randint(1, 1000, (batch, 16), generator=torch.Generator().manual_seed(0)).cuda()
                tokens = {name: e.generate(prompt, 12).tolist() for name, e in engines.items()}
                shapes = [(b, T) for b, T in prefills if b == batch]
                prefill_times = speed.alternating_prefills(engines, shapes, args.rounds) if shapes else {}
                for shape in shapes:
                    base_ms = statistics.median(prefill_times[base, shape])
                    for name in engines:
                        ms = statistics.median(prefill_times[name, shape])
                        rows.append(dict(model=model_name, config=config, batch=batch, prompt=shape[1],
                                         max_seq_len=max_seq_len, engine=name, prefill_ms=ms,
                                         rounds=prefill_times[name, shape], speedup=base_ms / ms))
                        print(f"{model_name} {config:6s} b={batch:2d} prompt {shape[1]:5d} cache {max_seq_len:5d} "
                              f"prefill {name:10s} {ms:.4f} ms ({rows[-1]['speedup']:.3f}x {base})", flush=True)
                for prompt_len in prompts:
                    times = speed.alternating_decodes(engines, batch, prompt_len, 128, args.rounds)
                    for name, t in times.items():
                        ms = statistics.median(t)
                        rows.append(dict(model=model_name, config=config, batch=batch, prompt=prompt_len,
                                         max_seq_len=max_seq_len, engine=name, ms_per_step=ms, rounds=t,
                                         speedup=statistics.median(times[base]) / ms,
                                         same_tokens=tokens[name] == tokens[base]))
                        print(f"{model_name} {config:6s} b={batch:2d} prompt {prompt_len:5d} cache {max_seq_len:5d} "
                              f"decode {name:10s} {ms:.4f} ms/step ({rows[-1]['speedup']:.3f}x {base}) tokens "
                              f"{'same' if rows[-1]['same_tokens'] else 'DIFFER'}", flush=True)
                for e in engines.values():
                    e.close()
                speed.release()
            speed.release(model)
            if args.json:
                Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
