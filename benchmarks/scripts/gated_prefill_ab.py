"""W4A4 prefill with the gate/up pair as one gated GEMM (`w4a4.w4a4_wgmma_silu_mul`) against the
two products then the engine's SiLU(gate) * up kernel, at every prompt shape: two engines on one
random-weight model, one captured with the gated GEMM at every size, one without it, timed in
alternating rounds (`nibble.eval.speed.measure_prefill`: CUDA-graph replays, median of 10). It is
what set `w4a4.GATED_MIN_TOKENS`.

    PYTHONPATH=. python3 benchmarks/scripts/gated_prefill_ab.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402

ALWAYS, NEVER = 17, 1 << 30  # GATED_MIN_TOKENS for each engine (the gated GEMM needs > 16 tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--shapes", default="1x128,1x512,8x128,8x512", help="batch x tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = shape_list(args.shapes)
    model = speed.random_model(args.model)
    speed.quantize_in_place(model, quant_config("w4a4", model, clip_search=False))
    engines = {}
    for name, min_tokens in (("gated", ALWAYS), ("unfused", NEVER)):
        w4a4.GATED_MIN_TOKENS = min_tokens  # read as each shape's graph is captured
        engines[name] = Engine(model, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes))
        for shape in shapes:
            speed.measure_prefill(engines[name], *shape)
    times = speed.alternating_prefills(engines, shapes, args.rounds)
    rows = []
    for shape in shapes:
        gated, unfused = (statistics.median(times[n, shape]) for n in ("gated", "unfused"))
        rows.append(dict(batch=shape[0], tokens=shape[1], gated_ms=times["gated", shape],
                         unfused_ms=times["unfused", shape], median_gated_ms=gated, median_unfused_ms=unfused,
                         speedup=unfused / gated))
        print(f"{shape[0]}x{shape[1]}: unfused {unfused:.3f} ms, gated {gated:.3f} ms ({unfused / gated:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(model=args.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
