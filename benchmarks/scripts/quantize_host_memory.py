"""Host memory while quantizing a model loaded from safetensors: transformers maps the checkpoint's files
(a bf16 checkpoint read as bf16 costs page cache, which the kernel can drop, not process memory), so what a
run adds is what nibble writes: the peak of the process's anonymous memory (RssAnon, sampled every 10 ms)
above its level after loading, against the checkpoint's bytes.

    PYTHONPATH=. python3 benchmarks/scripts/quantize_host_memory.py --save-random llama-2-7b DIR [--layers 8]
    PYTHONPATH=. python3 benchmarks/scripts/quantize_host_memory.py DIR --configs w4a16 w4a4-hadamard \\
        --device cuda --json $OUT/quantize-host-memory.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble import quantize_model  # noqa: E402
from nibble.bench.timing import env_meta  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402


def rss_anon() -> int:
    """Bytes of the process's anonymous resident memory (what swapping or an OOM is about; file pages are not)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """The largest `rss_anon` seen while the block runs, sampled every ``interval`` seconds by a thread."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = rss_anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", help="a Hugging Face directory of a bf16 safetensors checkpoint")
    ap.add_argument("--save-random", nargs=2, metavar=("MODEL", "DIR"),
                    help=f"write a random-weight checkpoint of one of {list(speed.SPEED_MODELS)} to DIR and stop")
    ap.add_argument("--layers", type=int, help="--save-random: this many decoder layers instead of the model's")
    ap.add_argument("--configs", nargs="*", default=["w4a16", "w4a4-hadamard"])
    ap.add_argument("--device", default=None, help="quantize onto this device (default: where the model is, the CPU)")
    ap.add_argument("--calib", type=int, nargs=2, default=[16, 512], metavar=("SAMPLES", "TOKENS"),
                    help="random calibration ids for -gptq / -awq configs")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.save_random:
        name, out = args.save_random
        layers = {"num_hidden_layers": args.layers} if args.layers else {}
        speed.random_model(name, device="cuda" if torch.cuda.is_available() else "cpu", **layers).save_pretrained(out)
        print(f"wrote a random {name}{f' of {args.layers} layers' if args.layers else ''} to {out}")
        return
    if not args.checkpoint:
        ap.error("give a checkpoint directory, or --save-random MODEL DIR to write one")
    rows = []
    for config in args.configs:
        # as nibble.models.loading.load_model reads a directory (which also wants a tokenizer there)
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        calib = None
        if "gptq" in config or "awq" in config:
            calib = torch.randint(0, model.config.vocab_size, tuple(args.calib),
                                  generator=torch.Generator().manual_seed(0))
        base = rss_anon()
        start = time.perf_counter()
        with PeakSampler() as sampler:
            # RTN's clip search off; GPTQ and AWQ run their own (QuantConfig refuses clip_search with them)
            quantize_model(model, quant_config(config, model, clip_search=False if calib is None else None),
                           progress=False, calibration=calib, device=args.device)
        seconds = time.perf_counter() - start
        row = dict(config=config, device=args.device or "cpu", model_gib=model_bytes / 2**30,
                   anon_after_load_gib=base / 2**30, anon_peak_added_gib=(sampler.peak - base) / 2**30,
                   anon_peak_added_of_model=(sampler.peak - base) / model_bytes, seconds=seconds)
        rows.append(row)
        print(f"{config}: host anonymous memory +{row['anon_peak_added_gib']:.2f} GiB at its peak "
              f"({row['anon_peak_added_of_model']:.2f}x the {row['model_gib']:.2f} GiB checkpoint), {seconds:.1f} s",
              flush=True)
        del model
        speed.release()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(command=" ".join(sys.argv)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
