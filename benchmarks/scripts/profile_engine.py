"""Where a decode step's (or a prefill's) time goes: the engine runs eagerly under torch.profiler,
device kernel time summed by kernel name and divided by the steps (the CUDA-graph step minus the
matmuls is the "rest" in the report; this names its parts).

    PYTHONPATH=. python3 benchmarks/scripts/profile_engine.py --model llama-2-7b --config w4a16 --json $OUT/p.json
    PYTHONPATH=. python3 benchmarks/scripts/profile_engine.py --phase prefill --prompt 128 --config w4a4 ...

A prefill "step" is one whole prefill of ``--batch`` x ``--prompt`` tokens. ``--tiny`` shrinks the
model to two 64-wide layers (runs on the CPU too, where CPU op time is summed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import report, speed  # noqa: E402
from nibble.eval.engine import GREEDY, Engine  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def profile_engine(model_name: str, config: str, phase: str = "decode", prompt: int = 512, batch: int = 1,
                   steps: int = 8, tiny: bool = False, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = speed.random_model(model_name, device=device, **(TINY if tiny else {}))
    speed.quantize_in_place(model, report.quant_config(config, model))
    engine = Engine(model, max_batch=batch, max_seq_len=prompt + 2 * steps + 2, cuda_graphs=False)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    cuda = device.startswith("cuda")

    def run():
        if phase == "decode":
            engine.decode(steps, collect=False)
        else:  # the model's prefill, as speed.measure_prefill times it, without Engine.prefill's id check
            for _ in range(steps):
                engine._prefill(ids, [prompt] * batch, GREEDY)
    with torch.inference_mode():
        engine.prefill(ids)
        run()  # warm-up: kernels compiled, allocator settled
        if phase == "decode":
            engine.prefill(ids)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            run()
            if cuda:
                torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [{"name": e.key, "us_per_step": getattr(e, key) / steps, "calls_per_step": e.count / steps}
            for e in prof.key_averages() if getattr(e, key) > 0]
    if cuda:  # device kernels only (CPU-side ops have no self device time of their own)
        rows = [r for r in rows if not r["name"].startswith(("aten::", "cuda"))]
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"meta": env_meta(model=model_name, config=config, phase=phase, prompt=prompt, batch=batch, steps=steps,
                             tiny=tiny, device=device, time=key),
            "total_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--config", default="w4a16", help="bf16, w4a16, w4a4, w4a4-hadamard, ...")
    ap.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="two 64-wide layers (a check that runs anywhere)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = profile_engine(args.model, args.config, args.phase, args.prompt, args.batch, args.steps, args.tiny)
    print(f"{args.model} {args.config}: {res['total_us_per_step']:.1f} us of {res['meta']['time']} per {args.phase}"
          f" step")
    for r in res["kernels"][:args.top]:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['name'][:110]}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
