"""Fit the Hopper GEMMs' config models (`nibble.kernels.hopper.CostModel`) to their sweeps, and say how
far the fitted model's picks are from the best measured config.

    PYTHONPATH=. python3 benchmarks/scripts/fit_cost_model.py

Reads the committed H200 sweeps: `benchmarks/results/w4a4-explore-h200.json` (W4A4, every tile x
split-K, the issue's shapes at M = 64..1024) with `w4a4-explore-small-models-h200.json` (SmolLM2-135M's,
Qwen2-0.5B's and Llama-3.2-1B's layers at M = 64..4096) and, for W4A16, `w4a16-wgmma-sweep-s16-h200.json`
(M = 64..512) with `w4a16-wgmma-sweep-small-models-h200.json` and the unsplit configs of session 7's
`w4a16-wgmma-sweep-h200.json` for M >= 1024 (its split-K was the last-CTA sum since replaced by
clusters). Each sweep records how many clusters of each split fit
on its GPU at once (the waves count in those). The model is linear in its parameters: per wave of
tiles the split's K stages x the tile's stage time + the tile's fixed cost per item,
a fixed cost per launch (which no choice changes, so it is fitted but not kept), and for split-K a
cost per split and per million outputs and split. Least squares, weighted by 1 / time, on the
configs within 30% of each (shape, M)'s best: the model has to rank the good configs, not predict
the bad ones. The tiles (and the tokens each was swept up to) are the package models' own (a new
tile: add it there first, then sweep it).
Prints the CostModel to paste into nibble/kernels/w4a4.py / w4a16.py and the regret.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nibble.kernels import hopper  # noqa: E402
from nibble.kernels import w4a4, w4a16  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# The issue-3 shapes (M = 64..1024) and the small models' layers (M = 64..4096, session 21)
W4A4_SWEEPS = ("w4a4-explore-h200.json", "w4a4-explore-small-models-h200.json")
NEAR_BEST = 1.3


def _clusters(recorded: dict) -> dict:
    return {int(split): n for split, n in recorded.items()}


def w4a4_sweep() -> tuple[list[tuple], dict]:
    """(M, N, K, tile, split, us) of every wgmma config in the W4A4 sweeps (columns "bn128_ch256_s2"),
    and the sweep GPU's resident clusters."""
    sweeps = [json.loads((RESULTS / name).read_text()) for name in W4A4_SWEEPS]
    assert all(s["clusters"] == sweeps[0]["clusters"] for s in sweeps), "sweeps from GPUs of different clusters"
    rows = []
    for r in (r for s in sweeps for r in s["rows"]):
        for key, us in r.items():
            if key.startswith("bn"):
                bn, ch, sp = key[2:].split("_")
                rows.append((r["M"], r["N"], r["K"], (int(bn), int(ch[2:])), int(sp[1:]), us))
    return rows, _clusters(sweeps[0]["clusters"])


def w4a16_sweep() -> tuple[list[tuple], dict]:
    """The same for W4A16 (ops "wgmma_bn128_ch256_s2[_auto]")."""
    sweep = json.loads((RESULTS / "w4a16-wgmma-sweep-s16-h200.json").read_text())
    small = json.loads((RESULTS / "w4a16-wgmma-sweep-small-models-h200.json").read_text())
    assert small["meta"]["clusters"] == sweep["meta"]["clusters"], "sweeps from GPUs of different clusters"
    rows = sweep["rows"] + small["rows"] + [r for r in json.loads((RESULTS / "w4a16-wgmma-sweep-h200.json").read_text())["rows"]
                            if r["M"] >= 1024 and r["op"].removesuffix("_auto").endswith("_s1")]
    out = []
    for r in rows:
        if r["op"].startswith("wgmma"):
            bn, ch, sp = r["op"].removesuffix("_auto").removeprefix("wgmma_bn").split("_")
            out.append((r["M"], r["N"], r["K"], (int(bn), int(ch[2:])), int(sp[1:]), r["us"]))
    return out, _clusters(sweep["meta"]["clusters"])


def fit(data: list[tuple], package: hopper.CostModel, clusters: dict) -> tuple[hopper.CostModel, float]:
    """The CostModel of least weighted squared error over the package model's tiles (keeping its
    tokens bounds), and the fitted launch cost (us)."""
    tiles = list(package.stage_us)
    best = {}
    for M, N, K, _, _, us in data:
        best[(M, N, K)] = min(us, best.get((M, N, K), math.inf))
    T = len(tiles)

    def features(M, N, K, tile, split):
        waves = -(-hopper.tile_count(M, N, *tile) // clusters[split])
        f = np.zeros(2 * T + 3)
        f[tiles.index(tile)] = waves * -(-(-(-K // hopper.STAGE_K)) // split)
        f[T + tiles.index(tile)] = waves
        f[2 * T] = 1.0
        if split > 1:
            f[2 * T + 1], f[2 * T + 2] = M * N * split / 1e6, split
        return f

    near = [d for d in data if d[5] <= NEAR_BEST * best[d[:3]]]
    X = np.array([features(*d[:5]) for d in near])
    y = np.array([d[5] for d in near])
    w = 1.0 / y
    p, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    if p[2 * T] < 0:  # no negative launch cost: refit without it
        keep = [i for i in range(X.shape[1]) if i != 2 * T]
        q, *_ = np.linalg.lstsq((X * w[:, None])[:, keep], y * w, rcond=None)
        p = np.insert(q, 2 * T, 0.0)
    model = hopper.CostModel(stage_us={t: round(float(v), 3) for t, v in zip(tiles, p[:T])},
                             item_us={t: round(float(v), 2) for t, v in zip(tiles, p[T:2 * T])},
                             split_output_us=round(float(p[2 * T + 1]), 2), split_us=round(float(p[2 * T + 2]), 2),
                             max_tokens=package.max_tokens)
    return model, float(p[2 * T])


def regret(model: hopper.CostModel, data: list[tuple], clusters: dict) -> list[tuple]:
    """Per (shape, M): the measured time of the model's pick over the best measured time."""
    cells: dict = {}
    for M, N, K, tile, split, us in data:
        cells.setdefault((M, N, K), {})[(tile, split)] = us
    out = []
    for (M, N, K), times in sorted(cells.items()):
        cfg = hopper.pick_config(M, N, K, model, clusters)
        picked = times.get(((cfg["bn"], cfg["channels"]), cfg["split_k"]))
        if picked is None:
            print(f"  not measured: M={M} N={N} K={K} {cfg}")
            continue
        out.append((picked / min(times.values()), (M, N, K), cfg))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for name, (data, clusters), package in (("W4A4", w4a4_sweep(), w4a4.WGMMA.model),
                                            ("W4A16", w4a16_sweep(), w4a16.WGMMA.model)):
        model, launch_us = fit(data, package, clusters)
        r = regret(model, data, clusters)
        mean = math.exp(sum(math.log(x[0]) for x in r) / len(r))
        print(f"{name}: {model}\n  launch {launch_us:.2f} us (not kept); picks {100 * (mean - 1):.1f}% above the best "
              f"on average over {len(r)} cells; worst {max(r)[0]:.2f}x at M, N, K = {max(r)[1]}")


if __name__ == "__main__":
    main()
