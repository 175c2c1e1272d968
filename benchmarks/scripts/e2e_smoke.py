"""End-to-end smoke on a GPU: the engine's GPU tests, then memory and speed of random-weight
7B-shaped models for bf16 / w4a16 / w4a4 through the engine (static KV cache, CUDA graphs).

    PYTHONPATH=. python3 benchmarks/scripts/e2e_smoke.py [--models llama-2-7b] [--configs bf16 w4a16 w4a4]

Prints one line per measurement (each with its roofline), a target table last, and writes
``$OUT/e2e_smoke.json`` (or ./e2e_smoke.json). ``--budget-s`` stops starting new configs once
that many seconds have passed, so the call ends inside its device time.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from nibble.bench.timing import env_meta
from nibble.eval import report, speed
from nibble.eval.memory import format_bytes, linear_bytes


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["llama-2-7b"], choices=list(speed.SPEED_MODELS))
    p.add_argument("--configs", nargs="+", default=["bf16", "w4a16", "w4a4"])
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--no-tests", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        print("e2e_smoke needs a CUDA GPU; none is visible")
        return 2
    meta = env_meta(ceilings=speed.device_ceilings())
    print(json.dumps(meta))
    if not args.no_tests:
        import pytest
        rc = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/eval/test_speed_memory.py"])
        print(f"gpu tests: exit {rc} ({time.perf_counter() - t0:.0f} s)")
    results = {"meta": {**meta, "configs": args.configs, "tasks": []}, "configs": {}, "speed_models": {}}
    for m in args.models:
        results["speed_models"][m] = {}
        for c in args.configs:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"[{m}/{c}] skipped: past the {args.budget_s:.0f} s budget")
                continue
            t1 = time.perf_counter()
            try:
                results["speed_models"][m][c] = report.measure_speed_models(m, [c], rounds=1)[c]
            except Exception as e:  # keep going: one broken config must not hide the others
                import traceback
                traceback.print_exc()
                results["speed_models"][m][c] = {"config": c, "error": f"{type(e).__name__}: {e}"}
                speed.release()
            print(f"[{m}/{c}] {time.perf_counter() - t1:.0f} s")
    results["summary"] = summarize = report.summarize(results)
    out = Path(os.environ.get("OUT", ".")) / "e2e_smoke.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    for m, by_config in results["speed_models"].items():
        for c, r in by_config.items():
            if "weights" in r:
                print(f"{m}/{c}: linears {format_bytes(linear_bytes(r['weights']))}, weights "
                      f"{format_bytes(r['weights']['total_bytes'])}, peak {format_bytes(r['peak']['peak_bytes'])}; "
                      + ", ".join(f"{k} {v:.3f}" for k, v in summarize.get(m, {}).get(c, {}).items() if v is not None))
    for t, chk in summarize["targets_llama-2-7b"].items():
        v = "-" if chk["value"] is None else f"{chk['value']:.3f}"
        print(f"TARGET {t:45s} {v:>7s} {chk['target']:>7s} {'PASS' if chk['pass'] else 'FAIL' if chk['pass'] is False else '-'}")
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
