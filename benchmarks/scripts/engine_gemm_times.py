"""Each W4A4 projection's GEMM time inside a model, for builds of `csrc/w4a4_wgmma.cu`: eager
Llama-2-7B-shaped prefills (random weights) under torch.profiler, the wgmma kernels' device times
averaged per projection (q/k/v, o, gate/up, down: a layer's four launches, in order), one engine
per build (the package's own and prebuilt .so files of other versions), two rounds. In a model other
kernels run between two launches of a GEMM, so its code and data start cold: session 15 found an
epilogue that was faster back to back (`wgmma_ab.py`) and 15% slower for gate/up here.

    PYTHONPATH=. python3 benchmarks/scripts/engine_gemm_times.py old.so [other.so ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import GREEDY, Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402
from wgmma_ab import package_and_builds  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate/up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("others", nargs="*", help="shared libraries built from other versions of csrc/w4a4_wgmma.cu")
    ap.add_argument("--model", default="llama-2-7b", choices=list(speed.SPEED_MODELS))
    ap.add_argument("--tokens", default="128,512", help="prompt lengths (batch 1), comma-separated")
    args = ap.parse_args()
    libs = package_and_builds(w4a4, args.others)
    shipped = w4a4.WGMMA.lib
    model = speed.random_model(args.model)
    speed.quantize_in_place(model, quant_config("w4a4", model, clip_search=False))
    for T in (int(t) for t in args.tokens.split(",")):
        prompt = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
        for rnd in range(2):
            for name, lib in libs.items():
                w4a4.WGMMA.lib = lambda _device, lib=lib: lib
                engine = Engine(model, max_batch=1, max_seq_len=T, cuda_graphs=False)
                # the model's prefill, as speed.measure_prefill runs it (not Engine.prefill's id check: its
                # kernels and host sync would count among "other kernels")
                with torch.inference_mode():
                    for _ in range(3):
                        engine._prefill(prompt, [T], GREEDY)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(3):
                            engine._prefill(prompt, [T], GREEDY)
                        torch.cuda.synchronize()
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                gemms = [e.device_time for e in kernels if "w4a4_wgmma_kernel" in e.name]
                rest = sum(e.device_time for e in kernels if "w4a4_wgmma_kernel" not in e.name) / 3
                per = {p: statistics.mean(gemms[i::len(PROJECTIONS)]) for i, p in enumerate(PROJECTIONS)}
                print(f"T={T} round {rnd} {name:18s} " + " ".join(f"{p} {us:6.2f}" for p, us in per.items())
                      + f"  us; all GEMMs {sum(gemms) / 3:7.1f}, other kernels {rest:7.1f} us a prefill", flush=True)
                del engine
    w4a4.WGMMA.lib = shipped


if __name__ == "__main__":
    main()
