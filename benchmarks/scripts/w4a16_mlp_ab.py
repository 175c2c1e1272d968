"""The decode MLP as the engine ran it (gate/up launch, SiLU(gate) * up, down_proj launch) against one
launch (`w4a16.w4a16_mlp_accumulate`, at several warp counts, down_proj's L2 prefetch on and off), in
interleaved rounds, CUDA graphs, weights rotated past the L2; the one-launch output checked against the
three launches first. The one launch adds into a float32 sum the engine's next norm reads and zeroes;
here that zeroing is left out (it rides in the norm kernel), so the sum grows over a replay (timing only).

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_mlp_ab.py --json $OUT/mlp-ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from nibble.bench.timing import add_rounds_argument, bench_rounds, env_meta, rotations
from nibble.eval.engine import silu_mul
from nibble.kernels import w4a16 as W
from nibble.kernels.reference import w4a16_mlp

SHAPES = {"llama-2-7b": (4096, 11008), "llama-3-8b": (4096, 14336), "llama-3.2-1b": (2048, 8192)}


def random_weight(n: int, k: int, group: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, device="cuda", dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=g, device="cuda") * 0.02 + 0.002).half()
    zeros = (-8 * scales.float()).half()
    return qweight, scales, zeros


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(SHAPES))
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--json")
    add_rounds_argument(ap)
    args = ap.parse_args()
    rows = []
    for model in args.models:
        hidden, inter = SHAPES[model]
        G = args.group
        per_set = 3 * hidden * inter // 2
        n_rot = rotations(per_set)
        sets = [[random_weight(n, k, G, 3 * i + j) for j, (n, k) in
                 enumerate(((inter, hidden), (inter, hidden), (hidden, inter)))] for i in range(n_rot)]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16)
            out = torch.zeros(M, hidden, device="cuda")
            gate, up, down = sets[0]
            W.w4a16_mlp_accumulate(x, gate, up, down, G, out)
            ref = w4a16_mlp(x, gate, up, down, G)
            err = ((out - ref).norm() / ref.norm()).item()

            def three(i):
                gate, up, down = sets[i]
                return lambda: W.linear(silu_mul(*W.linears(x, *zip(gate, up), G)), *down, G)

            def one(cfg):
                def factory(i):
                    return lambda: W.w4a16_mlp_accumulate(x, *sets[i], G, out, cfg)
                return factory
            arms = {"three launches": (three, n_rot)}
            for warps in (int(w) for w in args.warps.split(",")):
                for prefetch, label in ((False, ""), (4, " no down (wrong)"), (8, " no red (wrong)")):
                    arms[f"one launch w{warps}{label}"] = (one(W.MlpConfig(warps, prefetch)), n_rot)
            times = bench_rounds(arms, args.rounds)
            base = statistics.median(times["three launches"])
            for name, t in times.items():
                us = statistics.median(t)
                rows.append(dict(model=model, M=M, arm=name, us=us, us_rounds=t, speedup=base / us, rel_err=err))
                print(f"{model} M={M} {name:28s} {us:7.2f} us  {base / us:.3f}x  (rel err {err:.1e})", flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": env_meta(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
