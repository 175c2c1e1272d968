"""The skinny kernel's warps per CTA (`w4a16.select_mma_config`) against a previous version of the
rule: the launches whose pick differs timed at every warp count (M = 1-8), then W4A16 decode of
random-weight Llama-2-7B and Llama-3-8B with each rule's picks captured into its own engine's
graphs, in alternating rounds (128-token prompt, 128 steps; `w4a16_skinny_variants.decode_ab`).

    git show <commit>:nibble/kernels/w4a16.py > .exp/old_w4a16.py
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_warp_rule_ab.py --old .exp/old_w4a16.py --json $OUT/ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.kernels import launch  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402
from w4a16_skinny_variants import decode_ab  # noqa: E402  (this folder)

# (label, [(N, K)] of one launch): the several-weight decode launches of Llama-2-7B, Llama-3-8B and a
# Llama-70B-shaped q/k/v, and the 70B MLP layer (whose pick stays)
CASES = [("L2 gate/up 2x11008x4096", [(11008, 4096)] * 2), ("L3 gate/up 2x14336x4096", [(14336, 4096)] * 2),
         ("70B qkv 8192+2x1024 x8192", [(8192, 8192), (1024, 8192), (1024, 8192)]), ("28672x8192", [(28672, 8192)])]


def old_rule(path: str):
    """`select_mma_config` as the file at `path` defines it, run with the package's module globals."""
    src = Path(path).read_text()
    start = src.index("def select_mma_config")
    scope = dict(vars(W))
    exec(src[start:src.index("\ndef ", start + 10)], scope)
    return scope["select_mma_config"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a previous nibble/kernels/w4a16.py")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    speed.require_cuda("w4a16_warp_rule_ab")
    rules = {"old": old_rule(args.old), "new": W.select_mma_config}
    dev = torch.device("cuda")
    rows = []
    for label, shapes in CASES:
        K, N = shapes[0][1], sum(n for n, _ in shapes)
        per_set = sum(n * K // 2 + 4 * (K // GROUP) * n for n, _ in shapes)
        sets = [[random_int4(n, K, GROUP, dev) for n, _ in shapes] for _ in range(rotations(per_set))]
        for M in (1, 2, 4, 8):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            picks = {name: rule(M, N, K, launch.num_sms(dev)) for name, rule in rules.items()}
            us = {}
            for warps in (4, 8, 16):
                cfg = replace(picks["new"], warps=warps)
                if not W.mma_config_valid(cfg, M):
                    continue
                outs = [[torch.empty(M, n, device=dev, dtype=x.dtype) for n, _ in shapes] for _ in sets]
                us[warps] = statistics.median(bench_us(
                    lambda i: (lambda: W.w4a16_mma_many(x, sets[i], GROUP, config=cfg, outs=outs[i])),
                    len(sets), **TIMING) for _ in range(3))
            old, new = picks["old"].warps, picks["new"].warps
            print(f"{label:28s} M={M} old w{old} {us[old]:.2f} new w{new} {us[new]:.2f} us ({us[old] / us[new]:.3f}x) | "
                  + " ".join(f"w{w}={t:.2f}" for w, t in us.items()), flush=True)
            rows.append(dict(case=label, M=M, old=old, new=new, us=us))
        sets = None
        torch.cuda.empty_cache()
    # each engine captures its graphs under its rule; the warps split K, so the sums' order changes and
    # the random model's greedy tokens may differ
    installers = {name: (lambda rule=rule: setattr(W, "select_mma_config", rule)) for name, rule in rules.items()}
    for model_name in ("llama-2-7b", "llama-3-8b"):
        rows += decode_ab(model_name, installers, (1, 8), args.rounds)
    W.select_mma_config = rules["new"]
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
