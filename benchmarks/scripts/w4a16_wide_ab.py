"""The skinny kernel's 80-register one-tile instantiation (`MmaConfig.wide`, `w4a16.wide_pays`)
against the 64-register one: every issue-3 layer and the Llama-2-7B / Llama-3-8B decode launches at
1-8 tokens, each at the op's warps with wide off and on (outputs equal bit for bit), then W4A16 decode
of random-weight Llama-2-7B and Llama-3-8B with the rule of a previous w4a16.py against this one, each
captured into its own engine's graphs, in alternating rounds (`w4a16_skinny_variants.decode_ab`).

    git show <commit>:nibble/kernels/w4a16.py > .exp/old_w4a16.py
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_wide_ab.py --old .exp/old_w4a16.py --json $OUT/ab.json
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

from nibble.bench.kernels import GROUP, SHAPES, TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402
from w4a16_skinny_variants import decode_ab  # noqa: E402  (this folder)
from w4a16_warp_rule_ab import old_rule  # noqa: E402

CASES = [(f"{n}x{k}", [(n, k)]) for n, k in SHAPES] + [
    ("L2 q/k/v 3x4096x4096", [(4096, 4096)] * 3), ("L2 gate/up 2x11008x4096", [(11008, 4096)] * 2),
    ("L3 q/k/v 4096+2x1024 x4096", [(4096, 4096), (1024, 4096), (1024, 4096)]),
    ("L3 gate/up 2x14336x4096", [(14336, 4096)] * 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a previous nibble/kernels/w4a16.py (its select_mma_config)")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds (even)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    speed.require_cuda("w4a16_wide_ab")
    dev = torch.device("cuda")
    rows = []
    for label, shapes in CASES:
        K, N = shapes[0][1], sum(n for n, _ in shapes)
        per_set = sum(n * K // 2 + 4 * (K // GROUP) * n for n, _ in shapes)
        sets = [[random_int4(n, K, GROUP, dev) for n, _ in shapes] for _ in range(rotations(per_set))]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            pick = W.select_mma_config(M, N, K, W.num_sms(dev))
            if pick.token_tiles != 1 or pick.warps > W.MMA_WIDE_MAX_WARPS:
                continue
            us, ys = {}, {}
            for wide in (False, True):
                cfg = replace(pick, wide=wide)
                outs = [[torch.empty(M, n, device=dev, dtype=x.dtype) for n, _ in shapes] for _ in sets]
                ys[wide] = [y.clone() for y in W.w4a16_mma_many(x, sets[0], GROUP, config=cfg)]
                us[wide] = statistics.median(bench_us(
                    lambda i: (lambda: W.w4a16_mma_many(x, sets[i], GROUP, config=cfg, outs=outs[i])),
                    len(sets), **TIMING) for _ in range(3))
            assert all(torch.equal(a, b) for a, b in zip(ys[False], ys[True])), f"wide differs: {label} M={M}"
            ctas = N // 32
            print(f"{label:28s} M={M} w{pick.warps} {ctas} CTAs rule {'wide' if pick.wide else '64'}: "
                  f"64 regs {us[False]:.2f} us, 80 regs {us[True]:.2f} us ({us[False] / us[True]:.3f}x)", flush=True)
            rows.append(dict(case=label, M=M, warps=pick.warps, ctas=ctas, rule_wide=pick.wide,
                             us_64=us[False], us_80=us[True]))
        sets = None
        torch.cuda.empty_cache()
    rules = {"old": old_rule(args.old), "new": W.select_mma_config}
    installers = {name: (lambda rule=rule: setattr(W, "select_mma_config", rule)) for name, rule in rules.items()}
    for model_name in ("llama-2-7b", "llama-3-8b"):
        rows += decode_ab(model_name, installers, (1, 8), args.rounds)
    W.select_mma_config = rules["new"]
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
