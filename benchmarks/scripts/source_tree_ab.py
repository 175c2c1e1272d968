"""The rotated activation path of two source trees, timed side by side on one GPU: what a change to its kernels costs.

Each round runs one worker process per tree (its ``nibble`` first on sys.path), alternating which tree goes first;
a worker times, with CUDA graphs and inputs rotated past the L2 (`bench_us`):
- ``rotq``: `quantize_activations_triton(x, input_hadamard=True)`, the online Hadamard + per-token INT4 of a
  down_proj's input (the CUDA rotate_quantize kernel takes a few rows where it is built; the Triton kernels the rest);
- ``had``: `hadamard_transform_triton(x)`;
- ``linear``: `w4a4_linear(x, W, input_hadamard=True)` on a down_proj weight [4096, K] (rotate, quantize, product);
- ``plain``: `quantize_activations_triton(x)`, no rotation (the control: code both trees share).
The table gives each case's median over rounds and the ratio new / old (> 1: the new tree is slower).

    python3 benchmarks/scripts/source_tree_ab.py --old OLD_TREE --new . --rounds 3 --json out.json

OLD_TREE is a folder holding the other tree's ``nibble`` package (e.g. `git worktree add` of the base commit, or a
copy of its nibble/ carried to the GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

KS = (4096, 11008, 14336)  # Llama-2-7B / Llama-3-8B down_proj widths, and a power of two
MS = (1, 16, 128, 1024, 4096)


def worker(ms, ks) -> dict:
    import torch

    from nibble.bench.timing import bench_us, rotations
    from nibble.bench.w4a4 import random_w4a4
    from nibble.kernels import w4a4_linear
    from nibble.kernels.hadamard import hadamard_transform_triton
    from nibble.kernels.w4a4 import quantize_activations_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    times = {}
    for K in ks:
        qweight, w_scale = random_w4a4(4096, K, "cuda", gen)
        for M in ms:
            n = rotations(M * K * 2)
            xs = [torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(n)]
            cases = {"rotq": lambda i: lambda: quantize_activations_triton(xs[i], True),
                     "had": lambda i: lambda: hadamard_transform_triton(xs[i]),
                     "linear": lambda i: lambda: w4a4_linear(xs[i], qweight, w_scale, input_hadamard=True),
                     "plain": lambda i: lambda: quantize_activations_triton(xs[i])}
            for name, factory in cases.items():
                times[f"{name} M={M} K={K}"] = bench_us(factory, n)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="folder holding the old tree's nibble package")
    p.add_argument("--new", default=".", help="folder holding the new tree's nibble package (default: .)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    ms, ks = [int(v) for v in args.ms.split(",")], [int(v) for v in args.ks.split(",")]
    if args.worker:
        print(json.dumps(worker(ms, ks)))
        return
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([trees[name], os.environ.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, __file__, "--worker", "--old", args.old, "--ms", args.ms,
                                  "--ks", args.ks], env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name} done", flush=True)
    rows = []
    for case in runs["old"][0]:
        old = statistics.median(run[case] for run in runs["old"])
        new = statistics.median(run[case] for run in runs["new"])
        rows.append({"case": case, "old_us": round(old, 3), "new_us": round(new, 3), "new_over_old": round(new / old, 4)})
        print(f"{case:24s} old {old:9.2f} us  new {new:9.2f} us  new/old {new / old:.3f}")
    if args.json:  # what a reader needs to know which code ran: each tree's source digest, and the run's setting
        sys.path.insert(0, trees["new"])  # the new tree's nibble names the run (the old one's digest beside it)
        from nibble.bench.timing import env_meta, source_hash
        meta = env_meta(trees=trees, tree_sources={name: source_hash(Path(tree) / "nibble") for name, tree in trees.items()},
                        rounds=args.rounds, command=" ".join(sys.argv))
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
