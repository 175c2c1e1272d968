"""Decode speed with and without programmatic dependent launch (nibble/kernels/early_launch.py), in
one process: the Llama-2-7B-shaped random model, after a 512-token prompt (``--batch``, ``--prompt``);
with ``--prefill`` the prefill of that prompt is timed too.

    PYTHONPATH=. python3 benchmarks/scripts/early_launch_decode.py --json $OUT/early-launch-decode.json

Each (config, on/off) builds a fresh engine (its CUDA graphs are captured with that launch mode) and
times 128 decode steps, median of 5 runs (``nibble.eval.speed.measure_decode``; prefill:
``measure_prefill``, median of 10). The greedy tokens of a short generation are recorded too: they
must not depend on the launch mode.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import early_launch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["bf16", "w4a16", "w4a4"])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", action="store_true", help="time the prefill of the prompt too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    speed.require_cuda("early_launch_decode")
    rows = []
    for name in args.configs:
        model = speed.random_model(args.model)
        speed.quantize_in_place(model, quant_config(name, model))
        for enabled in (False, True):
            early_launch.ENABLED = enabled
            early_launch._early_launch.cache_clear()
            engine = Engine(model, max_batch=args.batch, max_seq_len=args.prompt + 160)
            ms = speed.measure_decode(engine, args.batch, args.prompt, 128, reps=5)
            prefill = dict(prefill_ms=round(speed.measure_prefill(engine, args.batch, args.prompt), 3)) if args.prefill else {}
            tokens = engine.generate(torch.arange(1, 9, device="cuda")[None], 6)[0].tolist()
            speed.release(engine)
            rows.append(dict(config=name, batch=args.batch, prompt=args.prompt, early_launch=enabled,
                             ms_per_step=round(ms, 4), tokens_per_s=round(1000 * args.batch / ms, 1), **prefill,
                             greedy_tokens=tokens))
            print(rows[-1], flush=True)
        assert rows[-1]["greedy_tokens"] == rows[-2]["greedy_tokens"], f"{name}: tokens depend on the launch mode"
        del model
        speed.release()
    early_launch.ENABLED = True
    early_launch._early_launch.cache_clear()
    if args.json:
        meta = dict(env_meta(), model=args.model, batch=args.batch, prompt=args.prompt, decode_tokens=128,
                    command="PYTHONPATH=. python3 benchmarks/scripts/early_launch_decode.py --json ...")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
