"""What each glue kernel of a decode step costs on the critical path: the engine's decode of a
random-weight model with one glue op at a time replaced by no kernel at all (its output left
unwritten: the tokens are garbage, the timing is what a perfect fusion of that op could save), one
engine per (config, knockout), each capturing its graph under its knockout, timed in alternating
rounds. Not a correctness test: only the "none" rows run the real model.

    PYTHONPATH=. python3 benchmarks/scripts/decode_glue_knockout.py --json $OUT/knockout.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import engine as E  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def _no_rope(q, k, v, cos, sin, pos, k_cache, v_cache, n_heads, n_kv, head_dim, head_norms=None):
    return torch.empty(q.shape[0], q.shape[1], n_heads, head_dim, dtype=q.dtype, device=q.device)


def _no_attention(q, k_cache, v_cache, pos, scale, mask, scatter=None):
    return torch.empty_like(q)


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _no_norm(x, residual, weight, eps, columns=None):
    return x, x


def _no_silu(g, u):
    return torch.empty(g.shape, dtype=g.dtype, device=g.device)


KNOCKOUTS = {
    "none": {},
    "rope": {"rope_and_cache": _no_rope},
    "combine": {"_decode_attention_combine_kernel": _NoLaunch()},
    "attention": {"decode_attention": _no_attention},
    "norm": {"add_rmsnorm": _no_norm},
    "silu": {"silu_mul": _no_silu},
    "all": {"rope_and_cache": _no_rope, "decode_attention": _no_attention, "add_rmsnorm": _no_norm,
            "silu_mul": _no_silu},
}


@contextlib.contextmanager
def knocked_out(name: str):
    saved = {fn: getattr(E, fn) for fn in KNOCKOUTS[name]}
    for fn, repl in KNOCKOUTS[name].items():
        setattr(E, fn, repl)
    try:
        yield
    finally:
        for fn, orig in saved.items():
            setattr(E, fn, orig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16"])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--knockouts", nargs="*", default=list(KNOCKOUTS), choices=list(KNOCKOUTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("decode_glue_knockout")
    rows = []
    for config in args.configs:
        model = speed.random_model(args.model)
        speed.quantize_in_place(model, quant_config(config, model, clip_search=False))
        engines = {}
        for name in args.knockouts:
            with knocked_out(name):
                engines[name] = E.Engine(model, max_batch=args.batch, max_seq_len=128 + 160)
                speed.measure_decode(engines[name], args.batch, 128, 8, reps=1)  # captures under it
        times = speed.alternating_decodes(engines, args.batch, 128, 128, args.rounds)
        base = statistics.median(times["none"])
        for name in args.knockouts:
            ms = statistics.median(times[name])
            rows.append(dict(model=args.model, config=config, batch=args.batch, knockout=name, ms_per_step=ms,
                             saved_us=1000 * (base - ms), rounds=times[name]))
            print(f"{args.model} {config:6s} b={args.batch} without {name:9s} {ms:.4f} ms/step "
                  f"(saves {1000 * (base - ms):6.1f} us)", flush=True)
        speed.release(*engines.values())
        speed.release(model)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
