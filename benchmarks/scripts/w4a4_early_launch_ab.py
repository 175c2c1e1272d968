"""W4A4's activation quantization + Hopper product launching early (programmatic dependent launch) at
65-128 tokens, on and off in one process: `w4a4.PRODUCT_EARLY_TOKENS` 128 against 64 (the other
kernels' limit). The op (`torch.ops.nibble.w4a4_linear`) on the issue-4 shapes at M = 96 and 128, the
two settings alternated over three rounds (CUDA graphs, weights rotated past the L2, median), then
Llama-2-7B-shaped W4A4 prefills, one engine per setting (its graphs captured with it), interleaved.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_early_launch_ab.py --json ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a4 as W  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (28672, 8192),
          (8192, 28672)]
LIMITS = (64, 128)


class Pinned:
    """An engine whose W4A4 kernels launch with PRODUCT_EARLY_TOKENS = ``limit`` (set before each
    prefill, so the graphs it captures are captured so). `speed.measure_prefill` calls the engine's
    `_prefill` (the public `prefill` checks the ids first, then calls the engine's own `_prefill`,
    not this one): both are pinned."""

    def __init__(self, engine: Engine, limit: int):
        self.engine, self.limit = engine, limit

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, *args, **kwargs):
        W.PRODUCT_EARLY_TOKENS = self.limit
        return self.engine.prefill(*args, **kwargs)

    def _prefill(self, *args, **kwargs):
        W.PRODUCT_EARLY_TOKENS = self.limit
        return self.engine._prefill(*args, **kwargs)


def op_times() -> dict:
    out = {}
    for N, K in SHAPES:
        n_rot = rotations(K // 8 * N * 4)
        weights = [random_w4a4(N, K, "cuda") for _ in range(n_rot)]
        for M in (96, 128):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            times = {limit: [] for limit in LIMITS}
            for r in range(3):
                for limit in (LIMITS if r % 2 == 0 else reversed(LIMITS)):
                    W.PRODUCT_EARLY_TOKENS = limit
                    times[limit].append(bench_us(lambda i: (lambda: torch.ops.nibble.w4a4_linear(
                        x, weights[i][0], weights[i][1], None, False)), n_rot))
            out[f"{N}x{K} M={M}"] = {str(k): statistics.median(v) for k, v in times.items()}
            print(N, K, M, out[f"{N}x{K} M={M}"], flush=True)
        weights = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    return out


def prefill_times(shapes, rounds: int) -> dict:
    engines = {}
    for limit in LIMITS:
        model = speed.random_model("llama-2-7b")
        speed.quantize_in_place(model, quant_config("w4a4", model, clip_search=False))
        engines[str(limit)] = Pinned(Engine(model, max_batch=max(b for b, _ in shapes),
                                            max_seq_len=max(t for _, t in shapes)), limit)
    times = speed.alternating_prefills(engines, shapes, rounds)
    out = {f"{name} {b}x{t}": v for (name, (b, t)), v in times.items()}
    for key, v in out.items():
        print(key, [round(t, 3) for t in v], "median", round(statistics.median(v), 3), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"meta": env_meta(command=" ".join(sys.argv)), "op": op_times(),
              "prefill": prefill_times([(1, 128), (1, 512), (8, 128)], args.rounds)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
