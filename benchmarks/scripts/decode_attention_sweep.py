"""The engine's split-K decode attention (`engine.decode_attention`) under other launch settings: keys a block, warps a
program and programs an SM (`engine.DECODE_ATTENTION_*`), against the shipped ones in interleaved rounds
(`timing.bench_rounds`: CUDA graphs, median; each case's caches rotated past the L2). One query token per sequence
against a long cache filled to several lengths, at Llama-2-7B's heads (32 kv heads of 128) and Llama-3-8B's (8 kv
heads, 4 query heads each), batch 1 and 8. What it would buy the step: at 3,840 positions Llama-2-7B's attention
reads its keys at ~80% of an H100's bandwidth (session 78).

    PYTHONPATH=. python3 benchmarks/scripts/decode_attention_sweep.py --json $OUT/decode-attention-sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_rounds, env_meta, rotations  # noqa: E402
from nibble.eval import engine as engine_mod  # noqa: E402

HEADS = {"llama-2-7b": (32, 1), "llama-3-8b": (8, 4)}  # kv heads, query heads a kv head
KNOBS = ("DECODE_ATTENTION_BLOCK", "DECODE_ATTENTION_WARPS", "DECODE_ATTENTION_PROGRAMS_PER_SM")


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--per-sm", default="2,4")
    ap.add_argument("--lengths", default="128,1024,3840")
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention_sweep needs a CUDA GPU")
    shipped = tuple(getattr(engine_mod, k) for k in KNOBS)
    settings = [shipped] + [s for s in itertools.product(ints(args.blocks), ints(args.warps), ints(args.per_sm))
                            if s != shipped]
    name = {s: "block {} warps {} per-SM {}".format(*s) for s in settings}
    rows, D, S = [], 128, args.cache
    for model, (kv, rep) in HEADS.items():
        for B in ints(args.batches):
            n_rot = rotations(2 * B * kv * S * D * 2)  # k and v of one layer
            caches = [[torch.randn(B, kv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                      for _ in range(n_rot)]
            q = torch.randn(B, kv, rep, D, device="cuda", dtype=torch.bfloat16)
            mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)  # read by SDPA's path only
            for length in ints(args.lengths):
                pos = torch.full((B,), length - 1, device="cuda")

                def arm(setting):
                    def factory(i):
                        k, v = caches[i]

                        def call():
                            for knob, value in zip(KNOBS, setting):
                                setattr(engine_mod, knob, value)
                            return engine_mod.decode_attention(q, k, v, pos, D ** -0.5, mask)
                        return call
                    return factory, n_rot
                arms = {name[s]: arm(s) for s in settings}
                ref = arms[name[shipped]][0](0)()
                for s in settings:
                    torch.testing.assert_close(arms[name[s]][0](0)(), ref, rtol=2e-2, atol=2e-3)
                times = bench_rounds(arms, args.rounds)
                base = statistics.median(times[name[shipped]])
                for s in settings:
                    us = statistics.median(times[name[s]])
                    rows.append(dict(model=model, batch=B, length=length, cache=S, block=s[0], warps=s[1],
                                     per_sm=s[2], us=us, rounds=times[name[s]], speedup=base / us,
                                     kv_gb_per_s=2 * B * kv * length * D * 2 / us / 1e3))
                best = max(rows[-len(settings):], key=lambda r: r["speedup"])
                print(f"{model} b={B} length {length}: shipped {base:.1f} us "
                      f"({rows[-len(settings)]['kv_gb_per_s']:.0f} GB/s), best block {best['block']} warps "
                      f"{best['warps']} per-SM {best['per_sm']} {best['us']:.1f} us ({best['speedup']:.3f}x)",
                      flush=True)
            caches.clear()
            torch.cuda.empty_cache()
    for knob, value in zip(KNOBS, shipped):
        setattr(engine_mod, knob, value)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
