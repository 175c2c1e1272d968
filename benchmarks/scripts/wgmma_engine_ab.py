"""Builds of a Hopper GEMM (`csrc/w4a4_wgmma.cu`, or `csrc/w4a16_wgmma.cu` with --config w4a16) in
the engine: prefills of a random-weight model, one engine captured with the package's own build and
one with each other build (prebuilt .so files of other versions of the source, e.g. the previous
commit's), timed in rounds that alternate their order (`nibble.eval.speed.measure_prefill`:
CUDA-graph replays, median of 10). Each shape's last logits must be equal across the builds. Kernel
benchmarks time a GEMM back to back, with its code in the instruction cache; in a model other
kernels run in between, and session 15 found a change that was faster back to back and slower here.

    PYTHONPATH=. python3 benchmarks/scripts/wgmma_engine_ab.py old.so [other.so ...] --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a4, w4a16  # noqa: E402
from wgmma_ab import package_and_builds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("others", nargs="+", help="shared libraries built from other versions of the kernel's source")
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--config", default="w4a4", choices=("w4a4", "w4a16"))
    ap.add_argument("--shapes", default="1x128,1x512,8x128,8x512", help="batch x tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = shape_list(args.shapes)
    kernels = {"w4a4": w4a4, "w4a16": w4a16}[args.config]
    libs = package_and_builds(kernels, args.others)
    shipped = kernels.WGMMA.lib
    model = speed.random_model(args.model)
    speed.quantize_in_place(model, quant_config(args.config, model, clip_search=False))
    engines, logits = {}, {}
    for name, lib in libs.items():
        kernels.WGMMA.lib = lambda _device, lib=lib: lib  # read as each shape's graph is captured
        engines[name] = Engine(model, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes))
        for b, t in shapes:
            prompt = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(t))
            logits[name, (b, t)] = engines[name].prefill(prompt.cuda()).clone()
            speed.measure_prefill(engines[name], b, t)
    kernels.WGMMA.lib = shipped
    for name in libs:
        for shape in shapes:
            assert torch.equal(logits["package", shape], logits[name, shape]), f"{name}: logits differ at {shape}"
    times = speed.alternating_prefills(engines, shapes, args.rounds)
    rows = []
    for shape in shapes:
        median = {name: statistics.median(times[name, shape]) for name in libs}
        rows.append(dict(batch=shape[0], tokens=shape[1], ms={name: times[name, shape] for name in libs},
                         median_ms=median))
        print(f"{shape[0]}x{shape[1]}: " + "  ".join(
            f"{name} {ms:.3f} ms ({ms / median['package']:.3f}x the package's time)" for name, ms in median.items()),
            flush=True)
    if args.json:
        meta = env_meta(model=args.model, config=args.config, others=args.others)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
