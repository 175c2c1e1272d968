"""SiLU(gate) * up in the skinny W4A16 launch (`w4a16.w4a16_mma_silu_mul`) against the grouped
gate/up launch followed by the engine's glue kernel (`engine.silu_mul`), at decode sizes.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_gated_decode.py --json $OUT/gated-decode.json

Same timing as ``python -m nibble.bench kernels`` (CUDA-graph replay, weights rotated past the L2,
median); both sides launch early as the engine does. The fused output is first checked against the
unfused one, bit for bit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval.engine import silu_mul  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

SHAPES = {"llama2-gate-up": (11008, 4096), "llama3-gate-up": (14336, 4096), "qwen2-7b-gate-up": (18944, 3584)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (N, K) in SHAPES.items():
        G = GROUP
        sets = [(random_int4(N, K, G, dev), random_int4(N, K, G, dev))
                for _ in range(rotations(2 * (N * K // 2 + 4 * (K // G) * N)))]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            fused = W.w4a16_mma_silu_mul(x, *sets[0], G)
            unfused = silu_mul(*W.w4a16_mma_many(x, list(sets[0]), G))
            exact = torch.equal(fused, unfused)
            picked = W.select_mma_config(M, 2 * N, K)
            row = dict(layer=name, N=N, K=K, M=M, picked_warps=picked.warps, exact=exact, unfused_us={}, fused_us={})
            for warps in sorted({4, 8, picked.warps}):  # per weight
                cfg = W.MmaConfig(picked.token_tiles, warps)
                row["unfused_us"][warps] = round(bench_us(
                    lambda i: (lambda: silu_mul(*W.w4a16_mma_many(x, list(sets[i]), G, config=cfg))), len(sets),
                    **TIMING), 3)
                gated = W.MmaConfig(picked.token_tiles, 2 * warps)
                if W.mma_config_valid(gated, M):
                    row["fused_us"][warps] = round(bench_us(
                        lambda i: (lambda: W.w4a16_mma_silu_mul(x, *sets[i], G, config=gated)), len(sets), **TIMING), 3)
            rows.append(row)
            print(f"{name:16s} M={M:2d} (picked w{picked.warps})  products + glue "
                  + " ".join(f"w{w}: {t:6.2f}" for w, t in row["unfused_us"].items()) + "  fused "
                  + " ".join(f"w{w}+{w}: {t:6.2f}" for w, t in row["fused_us"].items())
                  + ("" if exact else "  NOT EXACT"), flush=True)
        sets = None
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
