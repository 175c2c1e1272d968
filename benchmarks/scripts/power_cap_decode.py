"""The engine's decode under sustained load: bf16 and W4A16 on a random-weight Llama-2-7B-shaped model, batch 1,
each generating back to back (a 128-token prompt, then 128 steps, again and again) for a few seconds while
`nvidia-smi` samples the SM clock and board power every 50 ms; per run of 128 steps its ms a step and the median
clock and power over it (benchmarks/notes-w4a16.md, session 40: whether W4A16's decode kernels meet the H200's
power cap).

    PYTHONPATH=. python3 benchmarks/scripts/power_cap_decode.py --json decode-power.json
"""
import argparse
import datetime
import json
import statistics
import time

import torch

from nibble.bench.timing import ClockSampler, env_meta
from nibble.config import QuantConfig
from nibble.eval.engine import Engine
from nibble.eval.speed import quantize_in_place, random_model


def runs(engine, prompt, seconds):
    """[(start, end, ms a step)] of prefill + 128 decode steps, back to back for ``seconds``."""
    out, t0 = [], time.time()
    while time.time() - t0 < seconds:
        engine.prefill(prompt)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin = datetime.datetime.now()
        start.record()
        engine.decode(128, collect=False)
        end.record()
        end.synchronize()
        out.append((begin, datetime.datetime.now(), start.elapsed_time(end) / 128))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=4.0, help="per config and round")
    args = ap.parse_args()
    engines = {}
    for name, cfg in (("bf16", None), ("w4a16", QuantConfig(mode="w4a16", group_size=128))):
        model = random_model("llama-2-7b")
        quantize_in_place(model, cfg)
        engines[name] = Engine(model, max_batch=1, max_seq_len=256)
    prompt = torch.randint(0, 32000, (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
    for engine in engines.values():  # graphs captured before any timing
        engine.prefill(prompt)
        engine.decode(2, collect=False)
    periods = []
    with ClockSampler() as clocks:
        time.sleep(1.0)  # idle: the board cools to its idle draw
        for name in ("bf16", "w4a16", "w4a16", "bf16"):
            periods += [(name, *r) for r in runs(engines[name], prompt, args.seconds)]
            time.sleep(1.0)
    rows = []
    for name, begin, end, ms in periods:
        rows.append(dict(config=name, ms_per_step=round(ms, 4), **clocks.during(begin, end)))
    for name in ("bf16", "w4a16"):
        mine = [r for r in rows if r["config"] == name]
        print(name, "first runs:", [(r["ms_per_step"], r["sm_mhz"], r["watts"]) for r in mine[:4]], flush=True)
        print(name, "all runs: ms a step median", statistics.median(r["ms_per_step"] for r in mine),
              "min", min(r["ms_per_step"] for r in mine), "max", max(r["ms_per_step"] for r in mine),
              "MHz median", statistics.median(r["sm_mhz"] for r in mine if r["sm_mhz"]), flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=env_meta(), rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
