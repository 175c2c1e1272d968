"""Qwen3's per-head q / k RMSNorms fused into the engine's RoPE + KV-cache kernel, against the same norms run as the
model's own modules before it (the engine before session 75): two engines on one random-weight Qwen3-8B-shaped
model per config, timed in alternating rounds (`nibble.eval.speed`: CUDA-graph replays, median of each round).
Each engine's graphs are captured, and re-captured if they ever are, with its own choice in force.

    PYTHONPATH=. python3 benchmarks/scripts/head_norm_ab.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import engine as engine_mod  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402

FUSED_PARAMS = engine_mod._rmsnorm_params


def _unfused_params(norm):
    """The engine's view of a norm with the head norms left unfused (called as modules, as before)."""
    return None if type(norm).__name__ == "Qwen3RMSNorm" and norm.weight.numel() <= 256 else FUSED_PARAMS(norm)


def _as(name: str) -> None:
    engine_mod._rmsnorm_params = FUSED_PARAMS if name == "fused" else _unfused_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--configs", nargs="*", default=["bf16", "w4a16", "w4a4"])
    ap.add_argument("--prefill", default="1x128,1x512", help="batch x tokens, comma-separated")
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes, batches = shape_list(args.prefill), [int(b) for b in args.decode_batches.split(",")]
    rows = []
    for config in args.configs:
        model = speed.random_model(args.model)
        speed.quantize_in_place(model, quant_config(config, model, clip_search=False) if config != "bf16" else None)
        engines = {name: Engine(model, max_batch=max(batches + [b for b, _ in shapes]),
                                max_seq_len=max(t for _, t in shapes) + 64) for name in ("fused", "unfused")}
        times = {}
        for r in range(args.rounds + 1):  # round 0 captures the graphs and is not counted
            for name in speed.round_order(engines, r):
                _as(name)
                for shape in shapes:
                    times.setdefault((name, "prefill", shape), []).append(speed.measure_prefill(engines[name], *shape))
                for b in batches:
                    times.setdefault((name, "decode", b), []).append(
                        speed.measure_decode(engines[name], b, 128, 64))
        _as("fused")
        for kind, what in [("prefill", s) for s in shapes] + [("decode", b) for b in batches]:
            fused, unfused = (statistics.median(times[name, kind, what][1:]) for name in ("fused", "unfused"))
            rows.append(dict(config=config, kind=kind, shape=what, fused_ms=fused, unfused_ms=unfused,
                             rounds_fused=times["fused", kind, what][1:], rounds_unfused=times["unfused", kind, what][1:],
                             speedup=unfused / fused))
            print(f"{config} {kind} {what}: unfused {unfused:.3f} ms, fused {fused:.3f} ms ({unfused / fused:.3f}x)",
                  flush=True)
        speed.release(*engines.values())
        del model, engines
        speed.release()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(model=args.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
